//! Judge throughput against the loopback server.
//!
//! `cargo run --release -p grpo-tests --example judge_bench [-- CALLS LATENCY_MS CONCURRENCY]`
//!
//! Defaults: 1,000 judge calls, 50 ms server latency, 32 concurrent requests. Prints the wall
//! time and the achieved concurrency of the cold pass (every call goes to the server), then the
//! calls per second of a second pass answered from the SQLite cache.

use std::time::{Duration, Instant};

use grpo_rewards::judge::{Judge, JudgeConfig};
use grpo_rewards::{AsyncReward, RewardInput};
use grpo_tests::loopback::{LoopbackServer, ServerConfig};

fn arg(i: usize, default: u64) -> u64 {
    std::env::args()
        .nth(i)
        .and_then(|a| a.parse().ok())
        .unwrap_or(default)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let calls = arg(1, 1000) as usize;
    let latency_ms = arg(2, 50);
    let concurrency = arg(3, 32) as usize;
    let server = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(latency_ms),
        ..ServerConfig::default()
    })?;
    let dir = tempfile::tempdir()?;
    let mut config = JudgeConfig::new(
        server.base_url(),
        "bench-judge",
        "Rate the answer to {{ prompt }}: {{ completion }}",
    );
    config.name = "bench".into();
    config.max_concurrent = concurrency;
    config.cache_path = Some(dir.path().join("judge_cache.sqlite"));
    let judge = Judge::new(config)?;
    let batch: Vec<RewardInput> = (0..calls)
        .map(|i| {
            RewardInput::new(
                format!("question {i}"),
                format!("answer {i} SCORE=0.{}", i % 10),
            )
        })
        .collect();
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()?;

    let t0 = Instant::now();
    let cold = rt.block_on(judge.score_async(&batch))?;
    let wall = t0.elapsed().as_secs_f64();
    let scored = cold.scores.iter().filter(|s| s.is_some()).count();
    let stats = server.stats();
    let ideal = calls as f64 * latency_ms as f64 / 1000.0 / concurrency as f64;
    println!("cold: {calls} judge calls, {latency_ms} ms latency, max_concurrent {concurrency}");
    println!("  wall time            {wall:.3} s (ideal {ideal:.3} s)");
    println!("  calls/s              {:.0}", calls as f64 / wall);
    println!(
        "  achieved concurrency {:.1} mean (calls × latency / wall), {} peak at the server",
        calls as f64 * latency_ms as f64 / 1000.0 / wall,
        stats.max_in_flight
    );
    println!(
        "  scored {scored}/{calls}, server requests {}",
        stats.requests
    );

    let t1 = Instant::now();
    let warm = rt.block_on(judge.score_async(&batch))?;
    let warm_wall = t1.elapsed().as_secs_f64();
    println!(
        "cached: {} hits in {warm_wall:.3} s = {:.0} calls/s (server requests still {})",
        warm.counters
            .get("judge/cache_hits")
            .copied()
            .unwrap_or(0.0),
        calls as f64 / warm_wall,
        server.stats().requests
    );
    Ok(())
}
