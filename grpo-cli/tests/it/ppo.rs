//! PPO (TRL's experimental PPOTrainer, `algorithm = "ppo"`): a value model trained beside the
//! policy, GAE advantages from the rewards' score and a KL penalty to the reference. The first
//! epoch at the sampling policy has TRL's statistics and its value loss is the value model's
//! error against GAE's returns computed here from the scores; the policy raises the score it
//! learns from; resume is exact and a checkpoint holds the value model; the refusals; the
//! subcommand.
#![allow(clippy::unwrap_used, missing_docs, clippy::needless_range_loop)]

use std::path::Path;

use candle_core::{DType, Device};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, FitOptions, PpoTrainer, RunOptions};

use crate::common;
use crate::online_dpo::digits;
use common::{Fixture, stopped_and_resumed};

fn fixture() -> Fixture {
    Fixture::new().model("policy", 3).arithmetic(40)
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "ppo"
output_dir = "{out}"
{extra}
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
"#,
        out = root.join(out).display(),
        model = root.join("policy").display(),
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

fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    trainer::run(
        trainer::setup(cfg).unwrap(),
        &opts,
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

const DIGIT: &str = "[[rewards]]\ntype = \"format\"\npattern = '(?s).*[0-9].*'\n";

/// One epoch, one mini-batch, at the sampling policy: the ratio is 1 (no clipping, no KL to
/// the old policy), the policy loss is minus the mean of whitened advantages (0), the policy is
/// its reference (KL 0), and the value loss is half the mean squared error of the value model
/// (the policy's weights with a fresh head, `train.seed`) against the returns of GAE with the
/// score placed after each completion's last token (on it for the longest).
#[test]
fn the_first_epoch_has_trls_statistics_and_value_loss() {
    let f = fixture();
    let extra = format!("{DIGIT}[ppo]\nnum_ppo_epochs = 1\nlam = 0.9\ngamma = 0.95\n");
    let cfg = load(&f.root, "first", 1, &extra);
    let seed = cfg.train.seed;
    let s = trainer::setup(cfg).unwrap();
    let (mut learner, sc) = common::first_scored_step(&s, &f.root.join("first"));
    let m = learner.process(&sc).unwrap();
    for k in [
        "policy/clipfrac_avg",
        "policy/approxkl_avg",
        "loss/policy_avg",
        "objective/kl",
    ] {
        assert!(m[k].abs() < 1e-5, "{k}: {m:?}");
    }
    assert!((m["val/ratio"] - 1.0).abs() < 1e-6, "{m:?}");
    let r = &sc.rollouts;
    let scores: Vec<f64> = sc.scores.rewards.iter().map(|&x| x as f64).collect();
    let n = scores.len();
    assert!((m["objective/scores"] - scores.iter().sum::<f64>() / n as f64).abs() < 1e-6);
    let value = grpo_rollout::load(&f.root.join("policy"), DType::F32, &Device::Cpu)
        .unwrap()
        .model
        .into_sequence_classifier(seed)
        .unwrap();
    let width = r
        .completions
        .iter()
        .map(|c| c.token_ids.len())
        .max()
        .unwrap();
    let (mut err, mut count) = (0.0, 0.0);
    for (i, c) in r.completions.iter().enumerate() {
        let prompt = &r.prompt_ids[c.prompt_index];
        let row: Vec<u32> = prompt.iter().chain(&c.token_ids).copied().collect();
        let all: Vec<f32> = value
            .position_scores(&[&row], 0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_vec1()
            .unwrap();
        let l = c.token_ids.len();
        let k = if l < width { l + 1 } else { l };
        let v: Vec<f64> = (0..k).map(|j| all[prompt.len() - 1 + j] as f64).collect();
        let mut rew = vec![0.0; k];
        rew[if l < width { l } else { l - 1 }] = scores[i];
        let mut ret = vec![0.0; k];
        let mut last = 0.0;
        for t in (0..k).rev() {
            let next = if t + 1 < k { v[t + 1] } else { 0.0 };
            last = rew[t] + 0.95 * next - v[t] + 0.95 * 0.9 * last;
            ret[t] = last + v[t];
        }
        for t in 0..k {
            err += (v[t] - ret[t]).powi(2);
            count += 1.0;
        }
    }
    let want = 0.5 * err / count;
    assert!(
        (m["loss/value_avg"] - want).abs() < 1e-4 * want.max(1.0),
        "value loss {} vs {want}",
        m["loss/value_avg"]
    );
    assert!(
        (m["loss"] - 0.1 * m["loss/value_avg"]).abs() < 1e-5,
        "{m:?}"
    );
    assert!(m["grad_norm"] > 0.0 && m.contains_key("val/num_eos_tokens"));
}

/// Rewarded by the share of digits in a completion (a reward given in code), the policy's
/// samples gain digits; the value loss falls as the value model learns the score.
#[test]
fn ppo_raises_the_score_it_learns_from() {
    let f = fixture();
    let mut cfg = load(
        &f.root,
        "learn",
        24,
        &format!("{DIGIT}[ppo]\nkl_coef = 0.01\n"),
    );
    cfg.rewards.clear();
    cfg.train.save_steps = 0;
    let mut t = PpoTrainer::from_config(cfg).unwrap();
    let r = t
        .fit_with(FitOptions::default().reward("digits", 1.0, digits))
        .unwrap();
    let mean = |ms: &[grpo_trainer::Metrics], k: &str| {
        ms.iter().map(|m| m[k]).sum::<f64>() / ms.len() as f64
    };
    let (first, last) = (
        mean(&r.metrics[..6], "objective/scores"),
        mean(&r.metrics[18..], "objective/scores"),
    );
    let (vf0, vf1) = (
        mean(&r.metrics[..6], "loss/value_avg"),
        mean(&r.metrics[18..], "loss/value_avg"),
    );
    eprintln!("digit share {first} -> {last}; value loss {vf0} -> {vf1}");
    assert!(last > first + 0.1, "digit share {first} -> {last}");
    assert!(vf1 < vf0, "value loss {vf0} -> {vf1}");
}

/// Stopped after 2 steps and resumed: the same 4 steps as one run (the value model and its
/// optimizer come back from the checkpoint, which holds them as a sequence classifier); a LoRA
/// policy with a value model given as a classifier directory trains.
#[test]
fn resume_is_exact_and_the_checkpoint_holds_the_value_model() {
    let f = fixture();
    let extra = format!("{DIGIT}[ppo]\nnum_ppo_epochs = 2\nnum_mini_batches = 2\n");
    let whole = run(load(&f.root, "whole", 4, &extra), RunOptions::default());
    let mut cfg = load(&f.root, "parts", 4, &extra);
    cfg.train.save_steps = 0;
    let parts = stopped_and_resumed(2, |o| run(cfg.clone(), o));
    common::assert_same_steps(
        &whole.metrics,
        &parts,
        &["loss", "loss/value_avg", "grad_norm"],
    );
    let ckpt = whole.best_checkpoint_path.unwrap();
    assert!(ckpt.join("value_optimizer.safetensors").exists());
    let v = grpo_rollout::load(&ckpt.join("value_model"), DType::F32, &Device::Cpu).unwrap();
    assert!(v.model.cfg.sequence_classification && v.model.lm_head.is_none());
    // Every weight of the value model learned (its decoder layers' gradients come from the same
    // backward as the policy's, through both models' layer blocks), starting from the policy's.
    let start = grpo_rollout::load(&f.root.join("policy"), DType::F32, &Device::Cpu).unwrap();
    let start: std::collections::HashMap<String, candle_core::Tensor> =
        start.model.weights().into_iter().collect();
    let mut compared = 0;
    for (k, w) in v.model.weights() {
        let Some(s) = start.get(&k) else { continue };
        let d = (&w - s).unwrap().abs().unwrap().max_all().unwrap();
        assert!(
            d.to_scalar::<f32>().unwrap() > 0.0,
            "value model `{k}` did not move"
        );
        compared += 1;
    }
    assert!(compared > 10, "{compared} weights compared");
    // The saved value model is a reward model as the `reward_model` reward loads one.
    let rm = grpo_rollout::scoring::ClassifierModel::load(
        &ckpt.join("value_model"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let s = rm.scores(&[vec![5, 9, 2]]).unwrap();
    assert!(s[0].iter().all(|x| x.is_finite()));
    // The trained value model as the next run's: a classifier directory; LoRA on the policy.
    let lora = format!(
        "{extra}value_model_name_or_path = \"{}\"\n[model.lora]\nr = 4\nlora_alpha = 8\n\
         target_modules = [\"q_proj\", \"v_proj\"]\n",
        ckpt.join("value_model").display()
    );
    let r = run(load(&f.root, "lora", 2, &lora), RunOptions::default());
    assert!(
        r.metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["grad_norm"] > 0.0)
    );
    let ck = r.best_checkpoint_path.unwrap();
    assert!(ck.join("adapter/adapter_model.safetensors").exists());
    assert!(ck.join("value_model/config.json").exists());
}

/// Gradient checkpointing of both models gives the same step (loss, value loss, joint
/// gradient norm); mixed precision (`train.bf16`, bf16 weights with f32 masters) and a
/// one-step-stale generator train.
#[test]
fn checkpointing_gives_the_same_step_and_bf16_with_staleness_trains() {
    let f = fixture();
    let extra = format!("{DIGIT}[ppo]\nnum_ppo_epochs = 2\n");
    let plain = run(load(&f.root, "plain", 2, &extra), RunOptions::default());
    let mut cfg = load(&f.root, "gc", 2, &extra);
    cfg.train.gradient_checkpointing = true;
    let gc = run(cfg, RunOptions::default());
    for (a, b) in plain.metrics.iter().zip(&gc.metrics) {
        for k in ["loss", "loss/value_avg", "grad_norm"] {
            assert!(
                (a[k] - b[k]).abs() <= 1e-5 * a[k].abs().max(1e-3),
                "{k}: {} vs {}",
                a[k],
                b[k]
            );
        }
    }
    let mut cfg = load(&f.root, "bf16", 3, &extra);
    cfg.model.dtype = grpo_rollout::Dtype::Bf16;
    cfg.train.bf16 = true;
    cfg.pipeline.max_staleness = 1;
    let r = run(cfg, RunOptions::default());
    assert_eq!(r.metrics.len(), 3);
    assert!(
        r.metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["grad_norm"] > 0.0 && m["loss/value_avg"] > 0.0),
        "{:?}",
        r.metrics
    );
}

/// TRL's PPOConfig defaults where they differ from GRPOConfig's: one completion per prompt, at
/// most 53 tokens, temperature 0.7, learning rate 3e-6; `[ppo]`'s own.
#[test]
fn trls_ppo_defaults() {
    let f = fixture();
    let text = config_text(&f.root, "defaults", 1, DIGIT)
        .replace("num_generations = 2\n", "")
        .replace("max_completion_length = 8\n", "")
        .replace("learning_rate = 3e-3\n", "");
    std::fs::write(f.root.join("defaults.toml"), text).unwrap();
    let cfg = config::load(&f.root.join("defaults.toml"), &[]).unwrap();
    assert_eq!(cfg.rollout.num_generations, 1);
    assert_eq!(cfg.rollout.max_completion_length, 53);
    assert_eq!(cfg.rollout.temperature, 0.7);
    assert_eq!(cfg.learning_rate(), 3e-6);
    let p = &cfg.ppo;
    assert_eq!(
        (
            p.num_ppo_epochs,
            p.num_mini_batches,
            p.whiten_rewards,
            p.value_model_name_or_path.clone()
        ),
        (4, 1, false, None)
    );
    assert_eq!(
        (
            p.kl_coef,
            p.cliprange,
            p.vf_coef,
            p.cliprange_value,
            p.gamma,
            p.lam
        ),
        (0.05, 0.2, 0.1, 0.2, 1.0, 0.95)
    );
    assert_eq!(p.kl_estimator, grpo_core::ppo::KlEstimator::K1);
    assert!(p.missing_eos_penalty.is_none() && cfg.dropout_disabled());
    let s = trainer::setup(cfg).unwrap();
    assert!(s.reference.is_some() && s.value_model.is_some());
}

#[test]
fn what_ppo_cannot_take_is_refused_in_one_line() {
    let f = fixture();
    for (extra, want) in [
        ("[reference]\nbeta = 0.1", "ppo.kl_coef"),
        (
            "[ppo]\nnum_mini_batches = 3",
            "must divide the step's 8 completions",
        ),
        ("[ppo]\nnum_ppo_epochs = 0", "ppo.num_ppo_epochs"),
        ("[ppo]\nlam = 1.5", "ppo.lam"),
        ("[ppo]\nvf_coef = -1.0", "ppo.vf_coef"),
        ("[ppo]\nkl_estimator = \"k2\"", "k1 or k3"),
        ("[ppo]\nbeta = 1.0", "unknown field"),
        ("[loss]\nreplay_buffer_size = 4", "replay_buffer_size"),
    ] {
        let e = load_err(&f.root, extra);
        assert!(e.contains(want), "{extra}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{e}");
    }
    let mut cfg = load(&f.root, "iters", 1, DIGIT);
    cfg.optim.num_iterations = 2;
    assert!(cfg.validate().unwrap_err().contains("ppo.num_ppo_epochs"));
    // A value model that is not there, or a token classifier, is refused at setup.
    let cfg = load(
        &f.root,
        "missing",
        1,
        &format!("{DIGIT}[ppo]\nvalue_model_name_or_path = \"/nonexistent/vm\"\n"),
    );
    let e = format!("{:#}", trainer::setup(cfg).unwrap_err());
    assert!(
        e.contains("ppo.value_model_name_or_path /nonexistent/vm"),
        "{e}"
    );
    let tc = grpo_rollout::load(&f.root.join("policy"), DType::F32, &Device::Cpu).unwrap();
    let model = tc.model.into_token_classifier(2, 1).unwrap();
    grpo_rollout::save_hf_dir(&model, &tc.tokenizer, &f.root.join("tc"), DType::F32).unwrap();
    let extra = format!(
        "{DIGIT}[ppo]\nvalue_model_name_or_path = \"{}\"\n",
        f.root.join("tc").display()
    );
    let e = format!(
        "{:#}",
        trainer::setup(load(&f.root, "tc", 1, &extra)).unwrap_err()
    );
    assert!(e.contains("token classifier"), "{e}");
}

#[test]
fn the_ppo_subcommand() {
    let f = fixture();
    let text = config_text(&f.root, "cli", 2, DIGIT).replace("algorithm = \"ppo\"", "");
    let p = f.root.join("cli.toml");
    std::fs::write(&p, text).unwrap();
    let out = common::grpo_cli_ok(&["ppo", "--config", p.to_str().unwrap()]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("trained 2 steps; reward"), "{stdout}");
    let metrics = std::fs::read_to_string(f.root.join("cli/metrics.jsonl")).unwrap();
    assert!(
        metrics.contains("loss/value_avg") && metrics.contains("objective/rlhf_reward"),
        "{metrics}"
    );
}
