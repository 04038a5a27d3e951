//! Online DPO (TRL's experimental OnlineDPOTrainer, `algorithm = "online_dpo"`) on the
//! pipelined loop: two samples per prompt ranked by the rewards, DPO's loss against the frozen
//! reference. The first step (policy = reference) has TRL's loss exactly (ln 2; IPO 1/(4β²));
//! each step's loss equals the one its logged rewards give; a run raises the reward it is
//! ranked by; TRL's defaults (two generations, temperature 0.9, lr 5e-7), β per epoch, the
//! refusals, exact resume and the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use grpo_rewards::RewardInput;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, FitOptions, OnlineDpoTrainer, RunOptions};

use crate::common;
use common::{Fixture, assert_same_steps, grpo_cli_ok, stopped_and_resumed};

fn fixture() -> Fixture {
    Fixture::new().model("model", 3).arithmetic(16)
}

pub(crate) fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "online_dpo"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
max_completion_length = 8
[optim]
learning_rate = 1e-2
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
per_device_train_batch_size = 4
save_steps = 2
[[rewards]]
type = "accuracy"
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("arith.jsonl").display(),
    )
}

fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn load_err(root: &Path, extra: &str) -> String {
    let p = root.join("bad.toml");
    std::fs::write(&p, config_text(root, "bad", 1, extra)).unwrap();
    format!("{:#}", config::load(&p, &[]).unwrap_err())
}

pub(crate) fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    trainer::run(
        trainer::setup(cfg).unwrap(),
        &opts,
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

/// Share of digits in a completion.
pub(crate) fn digits(batch: &[RewardInput]) -> Vec<f32> {
    batch
        .iter()
        .map(|x| {
            let n = x.completion.chars().count().max(1);
            x.completion.chars().filter(char::is_ascii_digit).count() as f32 / n as f32
        })
        .collect()
}

pub(crate) fn log_sigmoid(x: f64) -> f64 {
    -((-x).exp().ln_1p())
}

#[test]
fn trls_defaults_and_the_first_step_at_the_reference() {
    let f = fixture();
    // TRL's OnlineDPOConfig: two completions per prompt at temperature 0.9, lr 5e-7.
    let text = config_text(&f.root, "defaults", 1, "").replace("learning_rate = 1e-2\n", "");
    std::fs::write(f.root.join("defaults.toml"), text).unwrap();
    let cfg = config::load(&f.root.join("defaults.toml"), &[]).unwrap();
    assert_eq!(cfg.rollout.num_generations, 2);
    assert_eq!(cfg.rollout.temperature, 0.9);
    assert_eq!(cfg.learning_rate(), 5e-7);
    let s = trainer::setup(cfg).unwrap();
    assert!(s.reference.is_some(), "online DPO keeps its reference");

    // Policy = reference at the first step: every DPO reward is 0, the sigmoid loss ln 2,
    // IPO's (0 − 1/(2β))².
    for (name, extra, want) in [
        ("sigmoid", "", std::f64::consts::LN_2),
        (
            "ipo",
            "[online_dpo]\nloss_type = \"ipo\"\nbeta = 0.5\n",
            1.0,
        ),
    ] {
        let r = run(load(&f.root, name, 1, extra), RunOptions::default());
        let m = &r.metrics[0];
        assert!((m["loss"] - want).abs() < 1e-5, "{name}: {m:?}");
        for k in ["rewards/chosen", "rewards/margins", "objective/kl"] {
            assert!(m[k].abs() < 1e-5, "{name}: {k} = {}", m[k]);
        }
        // The chosen completion's reward is never below the rejected one's.
        assert!(m["objective/scores_margin"] >= 0.0, "{m:?}");
        for k in [
            "objective/entropy",
            "objective/scores",
            "val/contain_eos_token",
            "reward",
        ] {
            assert!(m[k].is_finite(), "{k}");
        }
    }
}

/// After the first update the policy differs from the reference: with one pair per step, the
/// logged loss is the loss of the logged DPO rewards (sigmoid: −log σ(margin); ipo on summed
/// log-probs: ((r_c − r_r)/β − 1/(2β))²).
#[test]
fn each_steps_loss_is_the_loss_of_its_logged_rewards() {
    let f = fixture();
    for (loss_type, beta) in [("sigmoid", 0.1), ("ipo", 0.5)] {
        let extra = format!("[online_dpo]\nloss_type = \"{loss_type}\"\nbeta = {beta}\n");
        let mut cfg = load(&f.root, loss_type, 4, &extra);
        (
            cfg.train.prompts_per_step,
            cfg.train.per_device_train_batch_size,
        ) = (1, Some(2));
        let r = run(cfg, RunOptions::default());
        for (s, m) in r.metrics.iter().enumerate().skip(1) {
            let margin = m["rewards/chosen"] - m["rewards/rejected"];
            assert!((margin - m["rewards/margins"]).abs() < 1e-6);
            let want = match loss_type {
                "sigmoid" => -log_sigmoid(margin),
                _ => (margin / beta - 1.0 / (2.0 * beta)).powi(2),
            };
            assert!(
                (m["loss"] - want).abs() < 1e-4 * want.max(1.0),
                "{loss_type} step {s}: loss {} vs {want} ({m:?})",
                m["loss"]
            );
            assert!(
                margin.abs() > 1e-6,
                "{loss_type} step {s}: the policy moved"
            );
        }
    }
}

/// Ranked by the share of digits in a completion (a reward given in code), the policy's
/// samples gain digits, and `beta` follows its per-epoch list.
#[test]
fn online_dpo_raises_the_reward_it_is_ranked_by() {
    let f = fixture();
    let mut cfg = load(&f.root, "learn", 24, "[online_dpo]\nbeta = [0.2, 0.5]\n");
    cfg.rewards.clear();
    cfg.train.save_steps = 0;
    let mut t = OnlineDpoTrainer::from_config(cfg).unwrap();
    let r = t
        .fit_with(FitOptions::default().reward("digits", 1.0, digits))
        .unwrap();
    let mean = |ms: &[grpo_trainer::Metrics]| {
        ms.iter().map(|m| m["objective/scores"]).sum::<f64>() / ms.len() as f64
    };
    let (first, last) = (mean(&r.metrics[..6]), mean(&r.metrics[18..]));
    eprintln!("digit share {first} -> {last}");
    assert!(last > first + 0.1, "digit share {first} -> {last}");
    // 16 rows, 4 per step: epoch 0 is steps 1-4 (β 0.2), then 0.5 for the rest.
    assert_eq!(r.metrics[3]["beta"], 0.2);
    assert_eq!(r.metrics[4]["beta"], 0.5);
    assert_eq!(r.metrics[23]["beta"], 0.5);
}

#[test]
fn online_dpo_refuses_what_it_cannot_train() {
    let f = fixture();
    for (extra, want) in [
        (
            "[online_dpo]\nbeta = 0.0\n",
            "`online_dpo.beta` must be > 0",
        ),
        ("[online_dpo]\nbeta = []\n", "empty list"),
        (
            "[online_dpo]\nmissing_eos_penalty = -1.0\n",
            "missing_eos_penalty",
        ),
        ("[reference]\nbeta = 0.1\n", "leave `reference.beta` at 0"),
        (
            "[loss]\ndrop_zero_std_groups = true\n",
            "trains on every pair",
        ),
        (
            "[online_dpo]\nloss_type = \"hinge\"\n",
            "unknown variant `hinge`",
        ),
    ] {
        let e = load_err(&f.root, extra);
        assert!(e.contains(want) && !e.trim().contains('\n'), "{extra}: {e}");
    }
    let p = f.root.join("four.toml");
    std::fs::write(&p, config_text(&f.root, "four", 1, "")).unwrap();
    let e = format!(
        "{:#}",
        config::load(&p, &["rollout.num_generations=4".into()]).unwrap_err()
    );
    assert!(e.contains("must be 2"), "{e}");
    // An odd micro-batch would split a pair.
    let p = f.root.join("odd.toml");
    std::fs::write(
        &p,
        config_text(&f.root, "odd", 1, "").replace(
            "per_device_train_batch_size = 4",
            "per_device_train_batch_size = 3",
        ),
    )
    .unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("must be even"), "{e}");
}

#[test]
fn resume_is_exact_and_the_subcommand_runs() {
    let f = fixture();
    let all = run(load(&f.root, "all", 4, ""), RunOptions::default());
    let mut cfg = load(&f.root, "parts", 4, "");
    cfg.train.save_steps = 2;
    let joined = stopped_and_resumed(2, |o| run(cfg.clone(), o));
    assert_eq!(joined.len(), 4);
    assert_same_steps(
        &joined,
        &all.metrics,
        &[
            "loss",
            "rewards/margins",
            "objective/kl",
            "objective/scores",
        ],
    );

    let text = config_text(&f.root, "cli", 2, "").replace("algorithm = \"online_dpo\"", "");
    let p = f.root.join("cli.toml");
    std::fs::write(&p, text).unwrap();
    grpo_cli_ok(&["online-dpo", "--config", p.to_str().unwrap()]);
    let metrics = std::fs::read_to_string(f.root.join("cli/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);
    assert!(metrics.contains("objective/scores_margin"), "{metrics}");
}

/// With LoRA the reference is the base with the adapters off (no copy); with
/// `max_staleness = 1` the generator samples step s with version s − 1 while the learner trains.
#[test]
fn lora_and_a_stale_generator_train() {
    let f = fixture();
    let mut cfg = load(&f.root, "lora", 4, "");
    cfg.model.lora = Some(grpo_rollout::LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        ..Default::default()
    });
    cfg.pipeline.max_staleness = 1;
    let r = run(cfg, RunOptions::default());
    assert_eq!(r.metrics.len(), 4);
    assert!((r.metrics[0]["loss"] - std::f64::consts::LN_2).abs() < 1e-5);
    for m in &r.metrics {
        for k in ["loss", "grad_norm", "rewards/margins", "objective/kl"] {
            assert!(m[k].is_finite(), "{k}: {m:?}");
        }
    }
    assert!(
        r.metrics[3]["rewards/margins"].abs() > 1e-6,
        "the adapters moved"
    );
}
