//! `grpo-cli serve` throughput: N concurrent `/v1/completions` requests (one prompt, `n` = 1,
//! `TOKENS` new tokens each, EOS suppressed) against an in-process server, once with batching
//! (`--max-batch-requests 64`) and once without (1), on the same model. Prints one JSON line per
//! setting: wall seconds, completion tokens/s, batches the engine ran.
//!
//!     cargo run --release -p grpo-cli --example serve_bench -- MODEL_DIR [REQUESTS] [TOKENS]
#![allow(clippy::unwrap_used, missing_docs)]

use std::time::Instant;

use grpo_cli::serve::{ServeOptions, start};
use serde_json::{Value, json};

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let model = args
        .get(1)
        .expect("usage: serve_bench MODEL_DIR [REQUESTS] [TOKENS]");
    let requests: usize = args.get(2).map_or(32, |s| s.parse().unwrap());
    let tokens: usize = args.get(3).map_or(64, |s| s.parse().unwrap());
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .unwrap();
    for max_batch in [64usize, 1] {
        let mut o = ServeOptions::new(model);
        o.addr = "127.0.0.1:0".parse().unwrap();
        o.max_batch_requests = max_batch;
        let srv = start(o).unwrap();
        let url = format!("{}/completions", srv.base_url());
        let client = reqwest::Client::new();
        let fire = |seed: usize| {
            let (client, url) = (client.clone(), url.clone());
            async move {
                let body = json!({"prompt": format!("Question {seed}: what is {seed} + 1?"), "max_tokens": tokens,
                                  "min_tokens": tokens, "seed": seed});
                let r: Value = client
                    .post(&url)
                    .json(&body)
                    .send()
                    .await
                    .unwrap()
                    .json()
                    .await
                    .unwrap();
                r["usage"]["completion_tokens"].as_u64().unwrap()
            }
        };
        // Warm-up.
        rt.block_on(fire(0));
        let t0 = Instant::now();
        let done: u64 = rt.block_on(async {
            let tasks: Vec<_> = (0..requests).map(|i| tokio::spawn(fire(i + 1))).collect();
            let mut n = 0;
            for t in tasks {
                n += t.await.unwrap();
            }
            n
        });
        let secs = t0.elapsed().as_secs_f64();
        let stats: Value = rt.block_on(async {
            client
                .get(format!("http://{}/stats", srv.addr))
                .send()
                .await
                .unwrap()
                .json()
                .await
                .unwrap()
        });
        println!(
            "{}",
            json!({"max_batch_requests": max_batch, "requests": requests, "completion_tokens": done,
                   "seconds": secs, "tokens_per_s": done as f64 / secs, "batches": stats["batches"]})
        );
    }
}
