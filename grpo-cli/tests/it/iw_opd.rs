//! IW-OPD (TRL's experimental IWOPDTrainer, `algorithm = "iw_opd"`, or
//! `distillation.distillation_objective = "iw_opd"`): the first step's loss and TRL's `iw_opd/*`
//! metrics equal the objective computed directly from both models one completion at a time (at a
//! sampling temperature of 0.8); one small update moves the student toward the teacher on the
//! step's completions; `jsd` under `iw_opd` is distillation's step; TRL's defaults; the
//! refusals; the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use candle_core::{DType, Device};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{Fixture, assert_same_steps, first_scored_step, grpo_cli_ok, token_logps};

fn fixture() -> Fixture {
    Fixture::new()
        .model("student", 3)
        .model("teacher", 11)
        .arithmetic(16)
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "iw_opd"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 2
max_completion_length = 8
temperature = 0.8
[optim]
learning_rate = 3e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
per_device_train_batch_size = 8
save_steps = 0
[distillation]
teacher_model_name_or_path = "{teacher}"
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("student").display(),
        data = root.join("arith.jsonl").display(),
        teacher = root.join("teacher").display(),
    )
}

fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn run(cfg: TrainConfig) -> trainer::TrainingResult {
    let s = trainer::setup(cfg).unwrap();
    trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap()
}

#[test]
fn the_first_step_is_the_iw_opd_objective() {
    let f = fixture();
    let s = trainer::setup(load(&f.root, "first", 1, "iw_opd_gamma = 0.7")).unwrap();
    let teacher = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    let (mut learner, sc) = first_scored_step(&s, &f.root.join("first"));
    let r = &sc.rollouts;
    let student = s.policy.model.detached();
    let (mut loss, mut tokens) = (0.0, 0.0);
    let (mut adv_all, mut abs_all, mut w_all) = (Vec::new(), Vec::new(), Vec::new());
    for c in &r.completions {
        let p = &r.prompt_ids[c.prompt_index];
        let ls = token_logps(&student, p, &c.token_ids, 0.8);
        let lt = token_logps(&teacher, p, &c.token_ids, 0.8);
        let a: Vec<f64> = lt.iter().zip(&ls).map(|(t, s)| t - s).collect();
        let total = a.iter().map(|x| x.abs()).sum::<f64>().max(1e-8);
        let mut prefix = 0.0;
        for (j, aj) in a.iter().enumerate() {
            let w = 1.0 + 0.7 * (1.0 - prefix / total);
            prefix += aj.abs();
            loss += -ls[j] * w * aj;
            tokens += 1.0;
            adv_all.push(w * aj);
            abs_all.push(aj.abs());
            w_all.push(w);
        }
    }
    let want = loss / tokens;
    let m = learner.process(&sc).unwrap();
    assert!(
        (m["loss"] - want).abs() < 1e-4 * want.abs().max(1e-3),
        "loss {} vs {want}",
        m["loss"]
    );
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len() as f64;
    for (key, want) in [
        ("iw_opd/mean_advantage", mean(&adv_all)),
        ("iw_opd/mean_abs_advantage", mean(&abs_all)),
        ("iw_opd/mean_weight", mean(&w_all)),
        (
            "iw_opd/min_weight",
            w_all.iter().copied().fold(f64::INFINITY, f64::min),
        ),
        (
            "iw_opd/max_weight",
            w_all.iter().copied().fold(f64::NEG_INFINITY, f64::max),
        ),
    ] {
        assert!((m[key] - want).abs() < 1e-4, "{key}: {} vs {want}", m[key]);
    }
    assert!(m["grad_norm"] > 0.0);
}

/// One small update moves the student toward the teacher on the step's own completions: IW-OPD's
/// gradient there is that of `Σ ½ w (log π − log π_T)²` (the weights held), which falls.
#[test]
fn an_update_moves_the_student_toward_the_teacher_and_jsd_is_distillations_step() {
    let f = fixture();
    let mut cfg = load(&f.root, "toward", 1, "");
    cfg.optim.learning_rate = Some(1e-5);
    let s = trainer::setup(cfg).unwrap();
    let teacher = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    let (mut learner, sc) = first_scored_step(&s, &f.root.join("toward"));
    let student = s.policy.model.snapshot().unwrap();
    // The weights of each token, from the student before the update.
    let r = &sc.rollouts;
    let weights: Vec<Vec<f64>> = r
        .completions
        .iter()
        .map(|c| {
            let p = &r.prompt_ids[c.prompt_index];
            let ls = token_logps(&student, p, &c.token_ids, 0.8);
            let lt = token_logps(&teacher, p, &c.token_ids, 0.8);
            let a: Vec<f64> = lt.iter().zip(&ls).map(|(t, s)| (t - s).abs()).collect();
            let total = a.iter().sum::<f64>().max(1e-8);
            let mut prefix = 0.0;
            a.iter()
                .map(|x| {
                    let w = 1.0 + 0.5 * (1.0 - prefix / total);
                    prefix += x;
                    w
                })
                .collect()
        })
        .collect();
    let objective = |m: &grpo_rollout::Transformer| -> f64 {
        let mut sum = 0.0;
        for (c, w) in r.completions.iter().zip(&weights) {
            let p = &r.prompt_ids[c.prompt_index];
            let ls = token_logps(m, p, &c.token_ids, 0.8);
            let lt = token_logps(&teacher, p, &c.token_ids, 0.8);
            for ((x, y), w) in ls.iter().zip(&lt).zip(w) {
                sum += 0.5 * w * (x - y).powi(2);
            }
        }
        sum
    };
    let before = objective(&student);
    learner.process(&sc).unwrap();
    let after = objective(&learner.policy().model.detached());
    assert!(after < 0.99 * before, "{before} -> {after}");
    // The `jsd` objective under iw_opd is distillation's step with TRL's IW-OPD support (its
    // `loss_top_k` 1: the top-1 support at β = 1), and not the full-vocabulary one.
    let a = run(load(&f.root, "jsd", 2, "distillation_objective = \"jsd\""));
    let dist = |out: &str, extra: &str| {
        let mut d = load(&f.root, out, 2, extra);
        d.algorithm = grpo_trainer::Algorithm::Distillation;
        d.output_dir = f.root.join(out);
        run(d)
    };
    let b = dist("dist", "loss_top_k = 1");
    assert_same_steps(&a.metrics, &b.metrics, &["loss", "grad_norm"]);
    assert!(!a.metrics[0].contains_key("iw_opd/mean_weight"));
    let full = dist("dist-full", "");
    assert!(
        (full.metrics[0]["loss"] - a.metrics[0]["loss"]).abs() > 1e-3 * a.metrics[0]["loss"],
        "the top-1 support's loss equals the full vocabulary's"
    );
}

#[test]
fn trls_defaults_the_refusals_and_the_subcommand() {
    let f = fixture();
    let text = config_text(&f.root, "d", 1, "")
        .replace("num_generations = 2\n", "")
        .replace("max_completion_length = 8\n", "")
        .replace("learning_rate = 3e-3\n", "")
        .replace("per_device_train_batch_size = 8\n", "");
    let p = f.root.join("d.toml");
    std::fs::write(&p, &text).unwrap();
    let c = config::load(&p, &[]).unwrap();
    assert_eq!(
        (c.rollout.num_generations, c.rollout.max_completion_length),
        (1, 512)
    );
    assert_eq!((c.rollout.top_p, c.learning_rate()), (0.95, 1e-6));
    assert!(c.dropout_disabled());
    let d = &c.distillation;
    assert_eq!(
        d.objective_for(c.algorithm),
        config::DistillObjective::IwOpd
    );
    assert_eq!((d.beta, d.lmbda_for(c.algorithm)), (1.0, 1.0));
    assert_eq!((d.iw_opd_gamma, d.iw_opd_epsilon), (0.5, 1e-8));
    assert_eq!((d.loss_top_k_for(c.algorithm), d.loss_add_tail), (1, true));
    assert_eq!(d.reverse_kl_top_1_mode, config::ReverseKlTop1Mode::Sampled);
    for (set, want) in [
        (
            "distillation.iw_opd_gamma=-1.0",
            "`distillation.iw_opd_gamma` must be >= 0",
        ),
        (
            "distillation.iw_opd_epsilon=0.0",
            "`distillation.iw_opd_epsilon` must be > 0",
        ),
        (
            "distillation.distillation_objective=\"kl\"",
            "distillation_objective",
        ),
        (
            "distillation.reverse_kl_top_1_mode=\"argmax\"",
            "does not apply to the `iw_opd` objective",
        ),
        (
            "distillation.reverse_kl_top_1_mode=\"student\"",
            "reverse_kl_top_1_mode",
        ),
    ] {
        let e = format!("{:#}", config::load(&p, &[set.to_string()]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{set}: {e}");
    }
    let sets = ["rollout.max_completion_length=6", "train.max_steps=1"];
    let text = text.replace("algorithm = \"iw_opd\"", "");
    std::fs::write(&p, text).unwrap();
    let mut args = vec!["iw-opd", "--config", p.to_str().unwrap()];
    for s in &sets {
        args.extend(["--set", s]);
    }
    grpo_cli_ok(&args);
    let metrics = std::fs::read_to_string(f.root.join("d/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1);
    assert!(metrics.contains("iw_opd/mean_weight"), "{metrics}");
}
