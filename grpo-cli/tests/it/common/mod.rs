//! Helpers the trainer tests share.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::{Path, PathBuf};

/// A temporary directory for a test's files (removed when dropped), filled step by step.
pub struct Fixture {
    _dir: tempfile::TempDir,
    /// Its path.
    pub root: PathBuf,
}

impl Fixture {
    /// An empty directory.
    pub fn new() -> Self {
        let dir = tempfile::tempdir().unwrap();
        let root = dir.path().to_path_buf();
        Self { _dir: dir, root }
    }

    /// A tiny random Qwen2 model (weights from `seed`) in `root/name`.
    pub fn model(self, name: &str, seed: u64) -> Self {
        grpo_rollout::init::init_model_dir(
            &self.root.join(name),
            grpo_rollout::init::Preset::Tiny,
            grpo_rollout::Arch::Qwen2,
            seed,
        )
        .unwrap();
        self
    }

    /// `root/arith.jsonl`: `n` one-digit, one-step sums (seed 1).
    pub fn arithmetic(self, n: u64) -> Self {
        grpo_data::synth::ArithmeticConfig {
            n,
            seed: 1,
            digits: 1,
            steps: 1,
        }
        .write(&self.root.join("arith.jsonl"))
        .unwrap();
        self
    }
}

/// The first `n` rows of a dataset, in file order.
pub fn first_rows(d: &grpo_data::Dataset, n: usize) -> Vec<grpo_data::Sample> {
    let sc = grpo_data::StreamConfig {
        shuffle: false,
        batch_size: n,
        epochs: Some(1),
        ..Default::default()
    };
    grpo_data::SampleStream::new(d.clone(), sc)
        .unwrap()
        .next_batch()
        .unwrap()
        .unwrap()
}

/// Every row of a dataset, in file order.
pub fn all_rows(d: &grpo_data::Dataset) -> Vec<grpo_data::Sample> {
    first_rows(d, d.len() as usize)
}

/// The evaluation lines (those with `eval/loss`) of a run directory's `metrics.jsonl`.
pub fn eval_lines(run_dir: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
        .filter(|l| l.get("eval/loss").is_some())
        .collect()
}

/// Two runs' steps agree on `keys` within 1e-6 (relative above 1).
pub fn assert_same_steps(a: &[grpo_trainer::Metrics], b: &[grpo_trainer::Metrics], keys: &[&str]) {
    for (a, b) in a.iter().zip(b) {
        for k in keys {
            assert!(
                (a[*k] - b[*k]).abs() <= 1e-6 * a[*k].abs().max(1.0),
                "{k}: {} vs {}",
                a[*k],
                b[*k]
            );
        }
    }
}

/// A run stopped after `k` steps and resumed from its last checkpoint: the steps of both parts
/// in order. `run` runs the same config with the options it is given.
pub fn stopped_and_resumed(
    k: usize,
    mut run: impl FnMut(grpo_trainer::RunOptions) -> grpo_trainer::TrainingResult,
) -> Vec<grpo_trainer::Metrics> {
    let first = run(grpo_trainer::RunOptions {
        stop_after: Some(k),
        ..Default::default()
    });
    assert!(first.interrupted, "the first part stops after {k} steps");
    let rest = run(grpo_trainer::RunOptions {
        resume: Some(None),
        ..Default::default()
    });
    first.metrics.into_iter().chain(rest.metrics).collect()
}

/// `grpo-cli` with `args`, which must succeed (its stderr is the failure message).
pub fn grpo_cli_ok(args: &[&str]) -> std::process::Output {
    let out = std::process::Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "grpo-cli {args:?}: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

/// The logits `(completion.len(), V)`, in f64, that predict each token of `completion` after
/// `prompt` under `model` (one unpadded row).
pub fn completion_logits(
    model: &grpo_rollout::Transformer,
    prompt: &[u32],
    completion: &[u32],
) -> candle_core::Tensor {
    use candle_core::{DType, Device, Tensor};
    let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let n = ids.len();
    let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let h = model
        .completion_hidden(&ids, &mask, completion.len())
        .unwrap();
    model.logits(&h).unwrap().to_dtype(DType::F64).unwrap()
}

/// The log-prob of each token of one completion after `prompt` under `model`, at
/// `temperature` (one completion alone, in f64).
pub fn token_logps(
    model: &grpo_rollout::Transformer,
    prompt: &[u32],
    completion: &[u32],
    temperature: f64,
) -> Vec<f64> {
    let z = (completion_logits(model, prompt, completion) / temperature).unwrap();
    let rows: Vec<Vec<f64>> = z.to_vec2().unwrap();
    rows.iter()
        .zip(completion)
        .map(|(r, &t)| {
            let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            r[t as usize] - lse
        })
        .collect()
}

/// A learner over `setup` writing under `dir` (created), and the first step's completions as
/// the pipeline makes them (loaded, sampled with the learner's published policy, scored),
/// before any update: what a test compares the learner's first step with.
pub fn first_scored_step(
    setup: &grpo_trainer::Setup,
    dir: &Path,
) -> (grpo_trainer::Learner, grpo_trainer::stages::Scored) {
    use grpo_trainer::stages::{Generator, Loader, Scorer};
    std::fs::create_dir_all(dir).unwrap();
    let learner = grpo_trainer::Learner::new(setup, dir).unwrap();
    let batch = Loader::new(setup, 0, None)
        .unwrap()
        .process()
        .unwrap()
        .unwrap();
    let r = Generator::new(setup, learner.publish().unwrap(), 0)
        .process(batch)
        .unwrap();
    let scored = Scorer::new(setup).process(r).unwrap();
    (learner, scored)
}

/// A whole run of `cfg` and the metrics of each evaluation it ran (`on_evaluate`).
pub fn run_with_evals(
    cfg: grpo_trainer::TrainConfig,
) -> (grpo_trainer::TrainingResult, Vec<grpo_trainer::Metrics>) {
    struct Evals(Vec<grpo_trainer::Metrics>);
    impl grpo_trainer::Callbacks for Evals {
        fn on_evaluate(&mut self, _: &grpo_trainer::TrainerState, m: &grpo_trainer::Metrics) {
            self.0.push(m.clone());
        }
    }
    let mut evals = Evals(Vec::new());
    let setup = grpo_trainer::setup(cfg).unwrap();
    let r = grpo_trainer::run(setup, &grpo_trainer::RunOptions::default(), &mut evals).unwrap();
    (r, evals.0)
}

/// The mean per-token divergence of `student` from `teacher` (both HF directories) on fixed
/// rows.
pub fn divergence(student: &Path, teacher: &Path, beta: f64) -> f64 {
    let s =
        grpo_rollout::load(student, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let t =
        grpo_rollout::load(teacher, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let ids: Vec<u32> = s
        .tokenizer
        .encode("What is 3 + 4? 7. What is 2 + 2? 4.", false)
        .unwrap();
    let n = ids.len();
    let ids = candle_core::Tensor::from_vec(ids, (1, n), &candle_core::Device::Cpu).unwrap();
    let mask =
        candle_core::Tensor::ones((1, n), candle_core::DType::U32, &candle_core::Device::Cpu)
            .unwrap();
    let h = s.model.completion_hidden(&ids, &mask, n - 1).unwrap();
    let th = t.model.completion_hidden(&ids, &mask, n - 1).unwrap();
    let (d, _) = s.model.distill_rows(&h, &t.model, &th, beta, 1.0).unwrap();
    d.mean_all().unwrap().to_scalar::<f32>().unwrap() as f64
}
