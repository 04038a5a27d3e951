//! The pipelined loop with an async LLM judge (the loopback OpenAI-compatible server):
//! requests of several steps in flight at once within the judge's bounds, reproducible
//! metrics, and a judge that goes down (or a judge that panics) stopping the run with its
//! stage named and the progress checkpointed.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use grpo_data::synth::ArithmeticConfig;
use grpo_rewards::{AsyncReward, BoxFuture, RewardInput, RewardOutput, RewardSet};
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_tests::loopback::{Fault, LoopbackServer, ServerConfig, last_message};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, Metrics, RunOptions, Setup};
use serde_json::{Value, json};

/// A judge reply that depends on the completion (so rewards vary within a group).
fn reply_by_length(request: &Value) -> String {
    let text = last_message(request);
    let score = (text.len() % 5) as f64 / 4.0;
    json!({"score": score, "explanation": "by length"}).to_string()
}

struct Run<'a> {
    root: &'a Path,
    url: String,
    staleness: usize,
    scoring_batches: usize,
    max_concurrent: usize,
    steps: usize,
    /// More TOML after the config's sections.
    extra: &'a str,
}

fn setup(name: &str, r: &Run<'_>) -> Setup {
    let root = r.root;
    if !root.join("model").exists() {
        init_model_dir(&root.join("model"), Preset::Tiny, Arch::Qwen2, 3).unwrap();
        let synth = ArithmeticConfig {
            n: 40,
            seed: 1,
            digits: 1,
            steps: 1,
        };
        synth.write(&root.join("data.jsonl")).unwrap();
    }
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 6
[[rewards]]
type = "accuracy"
[[rewards]]
type = "judge"
name = "clarity"
base_url = "{url}"
model = "loopback"
template = "Rate: {{{{ completion }}}}"
max_concurrent = {mc}
max_retries = 1
initial_backoff_ms = 1
max_backoff_ms = 2
max_consecutive_failures = 4
[optim]
learning_rate = 1e-3
[train]
max_steps = {steps}
prompts_per_step = 2
log_completions = false
[pipeline]
max_staleness = {k}
scoring_batches = {sb}
{extra}
"#,
        out = root.join(name).display(),
        model = root.join("model").display(),
        data = root.join("data.jsonl").display(),
        url = r.url,
        mc = r.max_concurrent,
        steps = r.steps,
        k = r.staleness,
        sb = r.scoring_batches,
        extra = r.extra,
    );
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    trainer::setup(config::load(&p, &[]).unwrap()).unwrap()
}

/// Runs the config `name` to the end.
fn train(name: &str, r: &Run<'_>) -> grpo_trainer::TrainingResult {
    trainer::run(
        setup(name, r),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

fn without_timing(ms: &[Metrics]) -> Vec<Vec<(String, f64)>> {
    ms.iter()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| {
                    !k.starts_with("timing/")
                        && !k.starts_with("scoring/")
                        && !matches!(
                            k.as_str(),
                            "step_time" | "tokens_per_s" | "peak_rss_mib" | "judge/cache_hits"
                        )
                })
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        })
        .collect()
}

#[test]
fn judges_keep_requests_of_several_steps_in_flight_within_their_bounds() {
    let dir = tempfile::tempdir().unwrap();
    let server = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(250),
        reply: Arc::new(reply_by_length),
        ..Default::default()
    })
    .unwrap();
    // 2 prompts × 4 generations = 8 requests a step.
    let mut run = Run {
        root: dir.path(),
        url: server.base_url(),
        staleness: 2,
        scoring_batches: 2,
        max_concurrent: 64,
        steps: 6,
        extra: "",
    };

    // One step at a time: never more than a step's 8 requests in flight.
    run.scoring_batches = 1;
    let one = train("one", &run);
    let s1 = server.stats();
    assert!(s1.max_in_flight <= 8, "{}", s1.max_in_flight);
    assert!(
        one.metrics
            .iter()
            .all(|m| m["scoring/batches_in_flight"] == 1.0)
    );

    // Two steps at once: more than one step's requests in flight together.
    server.reset_stats();
    run.scoring_batches = 2;
    let two = train("two", &run);
    let s2 = server.stats();
    assert!(
        s2.max_in_flight > 8 && s2.max_in_flight <= 16,
        "max in flight {}",
        s2.max_in_flight
    );
    assert!(
        two.metrics
            .iter()
            .any(|m| m["scoring/batches_in_flight"] == 2.0)
    );
    // The overlap changes when batches are scored, not what is computed.
    assert_eq!(without_timing(&one.metrics), without_timing(&two.metrics));

    // The judge's own cap bounds the requests of all steps together.
    server.reset_stats();
    run.max_concurrent = 10;
    let capped = train("capped", &run);
    let s3 = server.stats();
    assert!(
        s3.max_in_flight > 8 && s3.max_in_flight <= 10,
        "{}",
        s3.max_in_flight
    );
    assert_eq!(
        without_timing(&one.metrics),
        without_timing(&capped.metrics)
    );

    // And a fixed seed gives the same metrics run after run.
    run.max_concurrent = 64;
    let again = train("again", &run);
    assert_eq!(without_timing(&two.metrics), without_timing(&again.metrics));
}

/// DAPO's dynamic sampling with an async judge: batches scored two at a time, with the
/// generator two versions ahead, give the metrics of batches scored one at a time; the staleness
/// bound holds over steps that draw several batches.
#[test]
fn dynamic_sampling_overlaps_judge_batches_and_keeps_the_staleness_bound() {
    let dir = tempfile::tempdir().unwrap();
    let server = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(20),
        // Equal scores for short completions: some groups are flat.
        reply: Arc::new(|r: &Value| {
            let score = if last_message(r).len() < 14 { 0.0 } else { 1.0 };
            json!({"score": score, "explanation": "by length"}).to_string()
        }),
        ..Default::default()
    })
    .unwrap();
    let mut run = Run {
        root: dir.path(),
        url: server.base_url(),
        staleness: 2,
        scoring_batches: 1,
        max_concurrent: 64,
        steps: 5,
        extra: "[loss.filter_groups]\nenable = true\nmetric = \"clarity\"\n",
    };
    let one = train("filter_one", &run);
    run.scoring_batches = 2;
    let two = train("filter_two", &run);
    assert_eq!(without_timing(&one.metrics), without_timing(&two.metrics));
    assert!(
        two.metrics
            .iter()
            .any(|m| m["scoring/batches_in_flight"] == 2.0)
    );
    for m in &two.metrics {
        assert!(m["staleness/max"] <= 2.0, "{m:?}");
        assert!(m["rewards/clarity/std"] > 0.0, "{m:?}");
    }
    let draws: f64 = two
        .metrics
        .iter()
        .map(|m| m["filter_groups/num_gen_batches"])
        .sum();
    assert!(draws > 5.0, "no step drew a second batch");
}

/// Takes the judge's server down after step 2.
struct TakeDown<'a> {
    server: &'a LoopbackServer,
}

impl grpo_trainer::Callbacks for TakeDown<'_> {
    fn on_step_end(&mut self, state: &grpo_trainer::TrainerState, _m: &Metrics) {
        if state.step == 2 {
            self.server
                .update(|c| c.default_fault = Some(Fault::Status(503)));
        }
    }
}

#[test]
fn a_judge_down_past_its_retries_stops_the_run_with_a_checkpoint_to_resume_from() {
    let dir = tempfile::tempdir().unwrap();
    let server = LoopbackServer::start(ServerConfig {
        latency: Duration::from_millis(20),
        reply: Arc::new(reply_by_length),
        ..Default::default()
    })
    .unwrap();
    for k in [0, 2] {
        server.update(|c| c.default_fault = None);
        let run = Run {
            root: dir.path(),
            url: server.base_url(),
            staleness: k,
            scoring_batches: 2,
            max_concurrent: 64,
            steps: 8,
            extra: "",
        };
        let name = format!("down{k}");
        let t = Instant::now();
        let e = trainer::run(
            setup(&name, &run),
            &RunOptions::default(),
            &mut TakeDown { server: &server },
        )
        .unwrap_err();
        let msg = format!("{e:#}");
        assert!(msg.contains("scorer stage"), "{msg}");
        assert!(msg.contains("judge `clarity` is down"), "{msg}");
        assert!(msg.contains("HTTP 503"), "{msg}");
        assert!(msg.contains("--resume"), "{msg}");
        assert!(t.elapsed() < Duration::from_secs(60), "{:?}", t.elapsed());
        // The steps learned before the judge went down are kept.
        let ckpts = trainer::list_checkpoints(&dir.path().join(&name));
        let (last, _) = ckpts.last().cloned().expect("a checkpoint");
        assert!(last >= 2, "last checkpoint at step {last}");
        let lines = std::fs::read_to_string(dir.path().join(&name).join("metrics.jsonl"))
            .unwrap()
            .lines()
            .count();
        assert!(lines >= last, "{lines} metric lines for {last} steps");

        // Back up: the run continues from the checkpoint to the end.
        server.update(|c| c.default_fault = None);
        let done = trainer::run(
            setup(&name, &run),
            &RunOptions {
                resume: Some(None),
                ..Default::default()
            },
            &mut grpo_trainer::NoCallbacks,
        )
        .unwrap();
        assert_eq!(done.total_steps, 8);
        assert_eq!(done.metrics.len(), 8 - last);
    }
}

/// An async reward that panics on its third batch.
struct Bomb(AtomicUsize);

impl AsyncReward for Bomb {
    fn score_async<'a>(
        &'a self,
        batch: &'a [RewardInput],
    ) -> BoxFuture<'a, grpo_rewards::Result<RewardOutput>> {
        Box::pin(async move {
            // A short wait so that batches overlap.
            tokio::time::sleep(Duration::from_millis(30)).await;
            if self.0.fetch_add(1, Ordering::SeqCst) == 2 {
                panic!("judge exploded");
            }
            Ok(vec![0.5f32; batch.len()].into())
        })
    }
}

#[test]
fn a_panicking_async_reward_stops_the_run_naming_the_scorer() {
    let dir = tempfile::tempdir().unwrap();
    let server = LoopbackServer::start(ServerConfig::default()).unwrap();
    let run = Run {
        root: dir.path(),
        url: server.base_url(),
        staleness: 2,
        scoring_batches: 2,
        max_concurrent: 8,
        steps: 8,
        extra: "",
    };
    let mut s = setup("bomb", &run);
    s.rewards =
        Arc::new(RewardSet::new().with_async_reward("bomb", 1.0, Bomb(AtomicUsize::new(0))));
    let t = Instant::now();
    let e = trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err();
    let msg = format!("{e:#}");
    assert!(msg.contains("scorer stage"), "{msg}");
    assert!(msg.contains("judge exploded"), "{msg}");
    assert!(t.elapsed() < Duration::from_secs(60));
}
