//! How much of a slow judge the pipelined loop hides.
//!
//! `cargo run --release -p grpo-tests --example pipeline_bench [-- LATENCY_MS STEPS]`
//!
//! A small random model (`init-model --preset small`) trains on arithmetic with an accuracy reward and an LLM judge served by the
//! loopback OpenAI-compatible server, which answers each request after LATENCY_MS (default 0 =
//! measure the learner first and use its median step time, so scoring costs about as much as
//! learning). The same run goes several ways: the sequential loop, and the pipeline with
//! `max_staleness` 0, 1 and 2 (at 2 with `scoring_batches` 1 and 2); then again with a judge
//! twice as slow. Prints the median step time of each (steps
//! after the first two), the median per-stage seconds, the ratio pipelined / sequential and the
//! fraction of the judge's time per step that the pipeline hid:
//! `(sequential − pipelined) / score_s`, capped at 1.

use std::path::Path;
use std::time::Duration;

use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_tests::loopback::{LoopbackServer, ServerConfig};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunMode, RunOptions};

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

struct Run {
    step: f64,
    generate: f64,
    score: f64,
    train: f64,
}

fn run(
    root: &Path,
    name: &str,
    url: &str,
    steps: usize,
    mode: RunMode,
    k: usize,
    scoring_batches: usize,
) -> Run {
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 16
[[rewards]]
type = "accuracy"
[[rewards]]
type = "judge"
name = "clarity"
weight = 0.5
base_url = "{url}"
model = "loopback"
api_key_env = "HOME"
template = "Rate the answer to {{{{ prompt }}}}: {{{{ completion }}}}"
max_concurrent = 64
[optim]
learning_rate = 1e-4
[train]
max_steps = {steps}
prompts_per_step = 8
log_completions = false
[pipeline]
max_staleness = {k}
scoring_batches = {scoring_batches}
"#,
        out = root.join(name).display(),
        model = root.join("model").display(),
        data = root.join("arith.parquet").display(),
    );
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, text).expect("write config");
    let setup = trainer::setup(config::load(&p, &[]).expect("config")).expect("setup");
    let opts = RunOptions {
        mode,
        ..Default::default()
    };
    let r = trainer::run(setup, &opts, &mut grpo_trainer::NoCallbacks).expect("run");
    let col = |k: &str| median(r.metrics[2..].iter().map(|m| m[k]).collect());
    Run {
        step: col("step_time"),
        generate: col("timing/generate_s"),
        score: col("timing/score_s"),
        train: col("timing/train_s"),
    }
}

fn main() {
    let arg = |i: usize, d: u64| -> u64 {
        std::env::args()
            .nth(i)
            .and_then(|a| a.parse().ok())
            .unwrap_or(d)
    };
    let steps = arg(2, 10).max(4) as usize;
    let dir = tempfile::tempdir().expect("tempdir");
    let root = dir.path();
    init_model_dir(&root.join("model"), Preset::Small, Arch::Llama, 5).expect("model");
    let synth = ArithmeticConfig {
        n: 512,
        seed: 2,
        digits: 2,
        steps: 1,
    };
    synth.write(&root.join("arith.parquet")).expect("data");
    let server = LoopbackServer::start(ServerConfig::default()).expect("server");
    let url = server.base_url();
    let mut latency = arg(1, 0);
    if latency == 0 {
        let base = run(root, "calibrate", &url, steps, RunMode::Sequential, 0, 1);
        latency = (base.train * 1000.0).round() as u64;
        println!(
            "learner median {:.3} s/step: judge latency set to {latency} ms",
            base.train
        );
    }
    server.update(|c| c.latency = Duration::from_millis(latency));
    let seq = run(root, "seq", &url, steps, RunMode::Sequential, 0, 1);
    let p0 = run(root, "pipe0", &url, steps, RunMode::Pipelined, 0, 2);
    let p1 = run(root, "pipe1", &url, steps, RunMode::Pipelined, 1, 2);
    let p2s = run(root, "pipe2s", &url, steps, RunMode::Pipelined, 2, 1);
    let p2 = run(root, "pipe2", &url, steps, RunMode::Pipelined, 2, 2);
    report(
        latency,
        &seq,
        &[
            ("pipelined k=0", &p0),
            ("pipelined k=1", &p1),
            ("k=2, 1 batch scoring", &p2s),
            ("k=2, 2 batches scoring", &p2),
        ],
    );
    // A judge twice as slow as the learner: overlapping steps in scoring is what hides it.
    server.update(|c| c.latency = Duration::from_millis(2 * latency));
    let seq = run(root, "seq-slow", &url, steps, RunMode::Sequential, 0, 1);
    let p2s = run(root, "pipe2s-slow", &url, steps, RunMode::Pipelined, 2, 1);
    let p2 = run(root, "pipe2-slow", &url, steps, RunMode::Pipelined, 2, 2);
    report(
        2 * latency,
        &seq,
        &[
            ("k=2, 1 batch scoring", &p2s),
            ("k=2, 2 batches scoring", &p2),
        ],
    );
}

fn report(latency: u64, seq: &Run, rows: &[(&str, &Run)]) {
    println!("judge latency {latency} ms");
    for (name, r) in std::iter::once(&("sequential", seq)).chain(rows) {
        println!(
            "  {name:<24} step {:.3} s (generate {:.3}, score {:.3}, train {:.3}); vs sequential {:.2}; judge time hidden {:.0}%",
            r.step,
            r.generate,
            r.score,
            r.train,
            r.step / seq.step,
            (100.0 * (seq.step - r.step) / seq.score).clamp(0.0, 100.0),
        );
    }
}
