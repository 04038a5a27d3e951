//! On-policy distillation (TRL 1.16's DistillationTrainer, `algorithm = "distillation"`) on the
//! pipelined loop: a student distilled from itself has loss 0; a student distilled from another
//! model comes closer to it; rewards are logged, not trained on; resume is exact; the refusals;
//! the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir, init_model_dir_with};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

mod common;
use common::{assert_same_steps, eval_lines};

struct Fixture {
    _dir: tempfile::TempDir,
    root: PathBuf,
}

/// A student, a teacher (another random model with the same tokenizer) and arithmetic prompts.
fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let root = dir.path().to_path_buf();
    init_model_dir(&root.join("student"), Preset::Tiny, Arch::Qwen2, 3).unwrap();
    init_model_dir(&root.join("teacher"), Preset::Tiny, Arch::Qwen2, 11).unwrap();
    ArithmeticConfig {
        n: 40,
        seed: 1,
        digits: 1,
        steps: 1,
    }
    .write(&root.join("arith.jsonl"))
    .unwrap();
    Fixture { _dir: dir, root }
}

fn config_text(root: &Path, out: &str, teacher: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "distillation"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 2
max_completion_length = 8
[optim]
learning_rate = 3e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
per_device_train_batch_size = 4
save_steps = 2
[distillation]
teacher_model_name_or_path = "{teacher}"
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("student").display(),
        data = root.join("arith.jsonl").display(),
        teacher = root.join(teacher).display(),
    )
}

fn load(root: &Path, out: &str, teacher: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, teacher, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    trainer::run(
        trainer::setup(cfg).unwrap(),
        &opts,
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

/// The mean per-token divergence of `student` from `teacher` (both HF directories) on fixed
/// rows.
fn divergence(student: &Path, teacher: &Path, beta: f64) -> f64 {
    let s = grpo_rollout::load(student, DType::F32, &Device::Cpu).unwrap();
    let t = grpo_rollout::load(teacher, DType::F32, &Device::Cpu).unwrap();
    let ids: Vec<u32> = s
        .tokenizer
        .encode("What is 3 + 4? 7. What is 2 + 2? 4.", false)
        .unwrap();
    let n = ids.len();
    let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let h = s.model.completion_hidden(&ids, &mask, n - 1).unwrap();
    let th = t.model.completion_hidden(&ids, &mask, n - 1).unwrap();
    let (d, _) = s.model.distill_rows(&h, &t.model, &th, beta, 1.0).unwrap();
    d.mean_all().unwrap().to_scalar::<f32>().unwrap() as f64
}

#[test]
fn a_student_distilled_from_itself_has_loss_zero() {
    let f = fixture();
    let r = run(
        load(&f.root, "self", "student", 1, ""),
        RunOptions::default(),
    );
    let m = &r.metrics[0];
    assert!(
        m["loss"].abs() < 1e-7 && m["grad_norm"].abs() < 1e-6,
        "{m:?}"
    );
    assert!(
        m["entropy"] > 0.0 && m["completions/mean_length"] > 0.0,
        "{m:?}"
    );
    // No reward: the reward metrics say so (NaN), they do not pretend a score.
    assert!(m["reward"].is_nan());
}

#[test]
fn the_student_comes_closer_to_the_teacher() {
    let f = fixture();
    let (student, teacher) = (f.root.join("student"), f.root.join("teacher"));
    for beta in [1.0, 0.0, 0.5] {
        let out = format!("close-{beta}");
        let r = run(
            load(&f.root, &out, "teacher", 12, &format!("beta = {beta}")),
            RunOptions::default(),
        );
        assert_eq!(r.total_steps, 12);
        assert!(
            r.metrics
                .iter()
                .all(|m| m["loss"].is_finite() && m["loss"] > 0.0)
        );
        let trained = r.best_checkpoint_path.unwrap().join("model");
        let (before, after) = (
            divergence(&student, &teacher, beta),
            divergence(&trained, &teacher, beta),
        );
        assert!(after < 0.8 * before, "beta {beta}: {before} -> {after}");
    }
}

#[test]
fn rewards_are_logged_not_trained_on_and_resume_is_exact() {
    let f = fixture();
    let plain = run(
        load(&f.root, "plain", "teacher", 4, ""),
        RunOptions::default(),
    );
    let rewarded = run(
        load(
            &f.root,
            "rewarded",
            "teacher",
            4,
            "[[rewards]]\ntype = \"accuracy\"\n",
        ),
        RunOptions::default(),
    );
    for (a, b) in plain.metrics.iter().zip(&rewarded.metrics) {
        assert_eq!(a["loss"], b["loss"]);
        assert!(b.contains_key("rewards/accuracy/mean"));
    }
    let mut cfg = load(&f.root, "parts", "teacher", 4, "");
    cfg.train.save_steps = 0;
    let first = run(
        cfg.clone(),
        RunOptions {
            stop_after: Some(2),
            ..Default::default()
        },
    );
    assert!(first.interrupted);
    let rest = run(
        cfg,
        RunOptions {
            resume: Some(None),
            ..Default::default()
        },
    );
    let joined: Vec<f64> = first
        .metrics
        .iter()
        .chain(&rest.metrics)
        .map(|m| m["loss"])
        .collect();
    let all: Vec<f64> = plain.metrics.iter().map(|m| m["loss"]).collect();
    assert_eq!(joined, all);
}

/// Gradient checkpointing recomputes each layer in backward: the same steps as the plain run.
#[test]
fn gradient_checkpointing_gives_the_same_steps() {
    let f = fixture();
    let plain = run(
        load(&f.root, "plain", "teacher", 2, ""),
        RunOptions::default(),
    );
    let mut cfg = load(&f.root, "ckpt", "teacher", 2, "");
    cfg.train.gradient_checkpointing = true;
    let ckpt = run(cfg, RunOptions::default());
    assert_same_steps(&plain.metrics, &ckpt.metrics, &["loss", "grad_norm"]);
}

/// LoRA adapters on the student, gradient checkpointing and a one-step-stale pipeline.
#[test]
fn lora_checkpointing_and_staleness_run() {
    let f = fixture();
    let extra = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n\
                 [pipeline]\nmax_staleness = 1\n";
    let mut cfg = load(&f.root, "lora", "teacher", 3, extra);
    cfg.train.gradient_checkpointing = true;
    let r = run(cfg, RunOptions::default());
    for (s, m) in r.metrics.iter().enumerate() {
        assert!(m["loss"].is_finite() && m["loss"] > 0.0, "{m:?}");
        assert_eq!(m["policy_version"], s.saturating_sub(1) as f64);
    }
    assert!(r.metrics.iter().any(|m| m["grad_norm"] > 0.0));
    let ck = r.best_checkpoint_path.unwrap();
    assert!(ck.join("adapter/adapter_model.safetensors").exists());
}

/// An eval split reports the divergence from the teacher on the policy's samples of held-out
/// prompts (`eval/loss`, per token) and the student's entropy, without updates; distilled from
/// itself the student's eval loss is 0.
#[test]
fn the_eval_split_reports_the_divergence() {
    let f = fixture();
    let mut cfg = load(&f.root, "eval", "teacher", 4, "");
    cfg.data.eval_fraction = Some(0.25);
    cfg.train.eval_steps = 2;
    run(cfg, RunOptions::default());
    let evals = eval_lines(&f.root.join("eval"));
    assert_eq!(evals.len(), 2);
    for e in &evals {
        assert!(e["eval/loss"].as_f64().unwrap() > 0.0, "{e}");
        assert!(e["eval/entropy"].as_f64().unwrap() > 0.0, "{e}");
    }
    let mut cfg = load(&f.root, "eval-self", "student", 1, "");
    cfg.data.eval_fraction = Some(0.25);
    cfg.train.eval_steps = 1;
    cfg.optim.learning_rate = Some(0.0);
    run(cfg, RunOptions::default());
    let e = eval_lines(&f.root.join("eval-self")).remove(0);
    assert!(e["eval/loss"].as_f64().unwrap().abs() < 1e-7, "{e}");
}

#[test]
fn what_distillation_cannot_take_is_refused_in_one_line() {
    let f = fixture();
    init_model_dir_with(&f.root.join("digits"), Preset::Tiny, Arch::Qwen2, 5, true).unwrap();
    let e = trainer::setup(load(&f.root, "tok", "digits", 1, ""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer") && e.contains("digits"), "{e}");
    let e = trainer::setup(load(&f.root, "none", "nowhere", 1, ""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("distillation teacher") && e.contains("nowhere"),
        "{e}"
    );
    for (extra, want) in [
        ("beta = 1.5", "distillation.beta"),
        ("[reference]\nbeta = 0.04", "reference.beta"),
    ] {
        let p = f.root.join("bad.toml");
        std::fs::write(&p, config_text(&f.root, "bad", "teacher", 1, extra)).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want), "{e}");
    }
    let p = f.root.join("noteacher.toml");
    let text =
        config_text(&f.root, "nt", "teacher", 1, "").replace("teacher_model_name_or_path", "# ");
    std::fs::write(&p, text).unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("teacher_model_name_or_path"), "{e}");
}

/// A distillation config without `rollout.num_generations` samples one completion per prompt,
/// as TRL's DistillationTrainer; a value given is kept; GRPO keeps its group of 8.
#[test]
fn one_completion_per_prompt_unless_the_config_says_otherwise() {
    let f = fixture();
    let text = config_text(&f.root, "one", "teacher", 1, "").replace("num_generations = 2\n", "");
    let p = f.root.join("one.toml");
    std::fs::write(&p, &text).unwrap();
    assert_eq!(config::load(&p, &[]).unwrap().rollout.num_generations, 1);
    let given = load(&f.root, "two", "teacher", 1, "");
    assert_eq!(given.rollout.num_generations, 2);
    let grpo = text.replace("algorithm = \"distillation\"", "").replace(
        "[distillation]",
        "[[rewards]]\ntype = \"accuracy\"\n[distillation]",
    );
    std::fs::write(&p, grpo).unwrap();
    assert_eq!(config::load(&p, &[]).unwrap().rollout.num_generations, 8);
}

#[test]
fn the_distillation_subcommand() {
    let f = fixture();
    let text =
        config_text(&f.root, "cli", "teacher", 2, "").replace("algorithm = \"distillation\"", "");
    let p = f.root.join("cli.toml");
    std::fs::write(&p, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["distillation", "--config", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("trained 2 steps; loss"));
}
