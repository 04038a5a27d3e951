//! Fault injection: an error in any stage of the pipelined loop (data, generator, scorer,
//! learner) stops the whole run within a bounded time, with the error and its stage named, no
//! thread left behind and no half-written checkpoint; with staleness 0 and 1.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use grpo_data::synth::ArithmeticConfig;
use grpo_rewards::{RewardInput, RewardSet};
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions, Setup};

fn setup(root: &Path, name: &str, staleness: usize, data_ext: &str) -> Setup {
    if !root.join("model").exists() {
        init_model_dir(&root.join("model"), Preset::Tiny, Arch::Qwen2, 3).unwrap();
    }
    let data = root.join(format!("{name}.{data_ext}"));
    let synth = ArithmeticConfig {
        n: 40,
        seed: 1,
        digits: 1,
        steps: 1,
    };
    synth.write(&data).unwrap();
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
[optim]
learning_rate = 1e-3
[train]
max_steps = 6
prompts_per_step = 2
save_steps = 1
[pipeline]
max_staleness = {staleness}
"#,
        out = root.join(name).display(),
        model = root.join("model").display(),
        data = data.display(),
    );
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    trainer::setup(config::load(&p, &[]).unwrap()).unwrap()
}

/// Runs and expects an error naming `stage`, within a bounded time; checks that every
/// checkpoint left behind is complete.
fn expect_failure(s: Setup, stage: &str) {
    let run_dir = s.cfg.output_dir.clone();
    let t = Instant::now();
    let e = trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err();
    let msg = format!("{e:#}");
    assert!(
        msg.contains(stage),
        "expected the {stage} stage to be named: {msg}"
    );
    assert!(
        t.elapsed() < Duration::from_secs(120),
        "took {:?}",
        t.elapsed()
    );
    if let Ok(rd) = std::fs::read_dir(run_dir.join("checkpoints")) {
        for d in rd {
            let d = d.unwrap().path();
            let name = d.file_name().unwrap().to_string_lossy().to_string();
            assert!(
                name.starts_with("step-"),
                "temporary checkpoint left behind: {name}"
            );
            assert!(
                d.join("trainer_state.json").exists(),
                "{name} is incomplete"
            );
        }
    }
}

#[test]
fn a_panicking_reward_stops_the_run_naming_the_scorer() {
    let dir = tempfile::tempdir().unwrap();
    for k in [0, 1] {
        let mut s = setup(dir.path(), &format!("panic{k}"), k, "jsonl");
        let calls = Arc::new(AtomicUsize::new(0));
        let c = calls.clone();
        s.rewards =
            Arc::new(
                RewardSet::new().with_reward("bomb", 1.0, move |b: &[RewardInput]| {
                    if c.fetch_add(1, Ordering::SeqCst) == 2 {
                        panic!("reward exploded");
                    }
                    vec![0.5f32; b.len()]
                }),
            );
        expect_failure(s, "scorer");
        assert_eq!(
            calls.load(Ordering::SeqCst),
            3,
            "no batch scored after the fault"
        );
    }
}

#[test]
fn a_reward_error_stops_the_run_naming_the_scorer() {
    let dir = tempfile::tempdir().unwrap();
    for k in [0, 1] {
        let mut s = setup(dir.path(), &format!("err{k}"), k, "jsonl");
        struct Failing(AtomicUsize);
        impl grpo_rewards::Reward for Failing {
            fn score(&self, b: &[RewardInput]) -> grpo_rewards::Result<grpo_rewards::RewardOutput> {
                if self.0.fetch_add(1, Ordering::SeqCst) >= 1 {
                    return Err(grpo_rewards::RewardError::Transport {
                        judge: "flaky".into(),
                        message: "connection refused".into(),
                    });
                }
                Ok(vec![1.0f32; b.len()].into())
            }
        }
        s.rewards =
            Arc::new(RewardSet::new().with_reward("flaky", 1.0, Failing(AtomicUsize::new(0))));
        expect_failure(s, "scorer");
    }
}

#[test]
fn a_non_finite_loss_stops_the_run_naming_the_learner() {
    let dir = tempfile::tempdir().unwrap();
    for k in [0, 1] {
        let s = setup(dir.path(), &format!("nan{k}"), k, "jsonl");
        // Poison one weight of the policy: every logit becomes NaN.
        let (_, v) = s
            .policy
            .vars
            .iter()
            .find(|(n, _)| n.contains("norm"))
            .unwrap();
        v.set(&(v.as_tensor() * f64::NAN).unwrap()).unwrap();
        expect_failure(s, "learner");
    }
}

#[test]
fn a_data_read_error_stops_the_run_naming_the_data_stage() {
    let dir = tempfile::tempdir().unwrap();
    for k in [0, 1] {
        let s = setup(dir.path(), &format!("data{k}"), k, "parquet");
        // The file disappears after the run was set up: the loader's read fails.
        std::fs::remove_file(dir.path().join(format!("data{k}.parquet"))).unwrap();
        expect_failure(s, "data");
    }
}

#[test]
fn a_generation_error_stops_the_run_naming_the_generator() {
    let dir = tempfile::tempdir().unwrap();
    for k in [0, 1] {
        let mut s = setup(dir.path(), &format!("gen{k}"), k, "jsonl");
        // Sampling parameters the generator refuses (set after validation, to reach it).
        s.cfg.rollout.top_p = 2.0;
        expect_failure(s, "generator");
    }
}

/// A device out of memory ends the run with one line that names the micro-batch and the
/// settings that lower memory, after a checkpoint of the last complete step (none when no step
/// completed). The error is CUDA's own text, raised here by a reward at a chosen step.
#[test]
fn out_of_memory_is_one_line_with_the_ways_out_and_a_checkpoint() {
    let dir = tempfile::tempdir().unwrap();
    for (k, fail_at) in [(0usize, 2usize), (1, 2), (0, 0)] {
        let mut s = setup(dir.path(), &format!("oom{k}-{fail_at}"), k, "jsonl");
        s.cfg.train.save_steps = 0;
        let run_dir = s.cfg.output_dir.clone();
        struct Oom(AtomicUsize, usize);
        impl grpo_rewards::Reward for Oom {
            fn score(&self, b: &[RewardInput]) -> grpo_rewards::Result<grpo_rewards::RewardOutput> {
                if self.0.fetch_add(1, Ordering::SeqCst) >= self.1 {
                    return Err(grpo_rewards::RewardError::Transport {
                        judge: "gpu".into(),
                        message: "DriverError(CUDA_ERROR_OUT_OF_MEMORY, \"out of memory\")".into(),
                    });
                }
                Ok(vec![0.5f32; b.len()].into())
            }
        }
        s.rewards =
            Arc::new(RewardSet::new().with_reward("gpu", 1.0, Oom(AtomicUsize::new(0), fail_at)));
        let e =
            trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err();
        let msg = format!("{e:#}");
        assert_eq!(msg.lines().count(), 1, "{msg}");
        for part in [
            "out of memory",
            "per_device_train_batch_size",
            "gradient_checkpointing = true",
            "LoRA",
            "adamw_8bit",
        ] {
            assert!(msg.contains(part), "`{part}` missing: {msg}");
        }
        let ckpt = run_dir.join("checkpoints").join(format!("step-{fail_at}"));
        if fail_at > 0 {
            assert!(msg.contains("--resume"), "{msg}");
            assert!(ckpt.join("trainer_state.json").exists(), "{msg}");
        } else {
            assert!(msg.contains("nothing saved"), "{msg}");
            assert!(!run_dir.join("checkpoints").join("step-1").exists());
        }
    }
}
