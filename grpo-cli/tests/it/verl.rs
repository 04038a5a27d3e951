//! verl's advantage estimators in the GRPO trainer (`loss.adv_estimator`) and its in-reward KL
//! penalty (`loss.use_kl_in_reward`, `[loss.kl_ctrl]`): the scorer's advantages are grpo-core's
//! estimators over each completion's score and tokens; the KL coefficient moves as verl's
//! adaptive controller moves it, from the KL the run measured, and comes back on resume;
//! REINFORCE++ with per-token advantages (discount and KL in the reward) raises the score it
//! learns from; the refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use grpo_core::advantages::ScaleRewards;
use grpo_core::estimators::{AdvEstimator, EstimatorParams, estimate, score_rows};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, FitOptions, GrpoTrainer, RunOptions};

use crate::common::{self, Fixture, stopped_and_resumed};
use crate::online_dpo::digits;

fn fixture() -> Fixture {
    Fixture::new().model("policy", 3).arithmetic(40)
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 8
[optim]
learning_rate = 3e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 3
per_device_train_batch_size = 4
save_steps = 2
{extra}
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

const DIGIT: &str = "[[rewards]]\ntype = \"format\"\npattern = '(?s).*[0-9].*'\n";

/// Each estimator's advantages, from the scorer, are grpo-core's on the step's rewards with
/// each completion's tokens as its length (its score on the last one), in groups of
/// `num_generations`; and they differ from TRL's GRPO advantages.
#[test]
fn the_scorer_gives_each_estimators_advantages() {
    let f = fixture();
    for est in [
        AdvEstimator::Opo,
        AdvEstimator::GrpoPassk,
        AdvEstimator::Gpg,
        AdvEstimator::ReinforcePlusPlusBaseline,
        AdvEstimator::ReinforcePlusPlus,
        AdvEstimator::Rloo,
    ] {
        let name = est.as_str();
        // A reward that varies within groups: the share of digits.
        let extra = format!(
            "[[rewards]]\ntype = \"format\"\nname = \"first\"\npattern = '^[0-9]'\n[[rewards]]\ntype = \"format\"\nname = \"any\"\npattern = '(?s).*[0-9].*'\n[loss]\nadv_estimator = \"{name}\"\n"
        );
        let cfg = load(&f.root, name, 1, &extra);
        let s = trainer::setup(cfg).unwrap();
        let (_, sc) = common::first_scored_step(&s, &f.root.join(name));
        let lens: Vec<usize> = sc
            .rollouts
            .completions
            .iter()
            .map(|c| c.token_ids.len())
            .collect();
        let rows = score_rows(&sc.scores.rewards, &lens);
        let params = EstimatorParams {
            gamma: 1.0,
            scale_rewards: ScaleRewards::Group,
        };
        let want = estimate(est, &rows, 4, &params).unwrap();
        assert_eq!(sc.advantages.len(), want.len());
        for (i, (a, w)) in sc.advantages.iter().zip(&want).enumerate() {
            assert!(
                (f64::from(*a) - w[0]).abs() < 1e-5,
                "{name}: completion {i}: {a} vs {}",
                w[0]
            );
        }
        eprintln!("{name}: {:?}", sc.advantages);
    }
}

/// With the KL in the reward and an adaptive controller, each step logs verl's
/// `actor/reward_kl_penalty` (0 at the first step, where the policy is its reference, then
/// positive) and the coefficient it used, which moves as verl's controller moves it from the
/// step's KL and completions; a run stopped after 2 steps and resumed goes on with the moved
/// coefficient and trains the same 4 steps.
#[test]
fn the_in_reward_kl_coefficient_moves_as_verls_and_resumes() {
    let f = fixture();
    let extra = format!(
        "{DIGIT}[loss]\nadv_estimator = \"reinforce_plus_plus\"\ngamma = 0.9\nuse_kl_in_reward = true\nkl_penalty = \"low_var_kl\"\n[loss.kl_ctrl]\ntype = \"adaptive\"\nkl_coef = 0.05\ntarget_kl = 0.001\nhorizon = 100\n"
    );
    let whole = trainer::run(
        trainer::setup(load(&f.root, "whole", 4, &extra)).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    let m = &whole.metrics;
    assert_eq!(m[0]["actor/reward_kl_penalty"], 0.0, "{:?}", m[0]);
    assert_eq!(m[0]["actor/reward_kl_penalty_coeff"], 0.05);
    assert!(m[3]["actor/reward_kl_penalty"] > 0.0, "{:?}", m[3]);
    // β ← β · (1 + clip(KL / target − 1, ±0.2) · n / horizon), n = 12 completions.
    for s in 0..3 {
        let (beta, kl) = (
            m[s]["actor/reward_kl_penalty_coeff"],
            m[s]["actor/reward_kl_penalty"],
        );
        let err = (kl / 0.001 - 1.0).clamp(-0.2, 0.2);
        let want = beta * (1.0 + err * 12.0 / 100.0);
        let got = m[s + 1]["actor/reward_kl_penalty_coeff"];
        assert!((got - want).abs() < 1e-12, "step {s}: {got} vs {want}");
    }
    let mut cfg = load(&f.root, "parts", 4, &extra);
    cfg.train.save_steps = 0;
    let parts = stopped_and_resumed(2, |o| {
        trainer::run(
            trainer::setup(cfg.clone()).unwrap(),
            &o,
            &mut grpo_trainer::NoCallbacks,
        )
        .unwrap()
    });
    common::assert_same_steps(
        m,
        &parts,
        &[
            "loss",
            "grad_norm",
            "actor/reward_kl_penalty",
            "actor/reward_kl_penalty_coeff",
        ],
    );
}

/// REINFORCE++ with a discount and the KL in the reward (each token its own advantage) raises
/// the share of digits it is rewarded for.
#[test]
fn reinforce_plus_plus_with_token_advantages_learns() {
    let f = fixture();
    let cfg = load(
        &f.root,
        "learn",
        20,
        &format!(
            "{DIGIT}[loss]\nadv_estimator = \"reinforce_plus_plus\"\ngamma = 0.95\nuse_kl_in_reward = true\n[loss.kl_ctrl]\nkl_coef = 0.01\n"
        ),
    );
    let (first, last) = digit_share(cfg);
    assert!(last > first + 0.1, "digit share {first} -> {last}");
}

/// A 20-step run of `cfg` on the digits reward alone: its mean reward over the first 5 steps
/// and over the last 5.
fn digit_share(mut cfg: TrainConfig) -> (f64, f64) {
    cfg.rewards.clear();
    cfg.train.save_steps = 0;
    let mut t = GrpoTrainer::from_config(cfg).unwrap();
    let r = t
        .fit_with(FitOptions::default().reward("digits", 1.0, digits))
        .unwrap();
    let mean = |ms: &[grpo_trainer::Metrics]| {
        ms.iter().map(|m| m["reward"]).sum::<f64>() / ms.len() as f64
    };
    let (first, last) = (mean(&r.metrics[..5]), mean(&r.metrics[15..]));
    eprintln!("digit share {first} -> {last}");
    (first, last)
}

/// `loss.kl_loss_type` in a run: the `kl` metric is the chosen estimate of the same policy
/// and reference (the first step's policy is the reference: every estimate 0), and the first
/// steps of k3 and k3+ (same value, k2's gradient) differ once the policy has moved; `full` is
/// refused naming the key.
#[test]
fn the_kl_loss_type_shapes_the_kl_term() {
    let f = fixture();
    let run = |name: &str, t: &str| {
        let cfg = load(
            &f.root,
            name,
            3,
            &format!("{DIGIT}[reference]\nbeta = 0.5\n[loss]\nkl_loss_type = \"{t}\"\n"),
        );
        assert_eq!(cfg.loss_config().kl_loss_type.as_str(), t);
        crate::train::run(cfg, RunOptions::default()).metrics
    };
    let k3 = run("k3", "k3");
    let plus = run("k3plus", "k3+");
    let k1 = run("k1", "k1");
    // Step 1: the policy is the reference, every estimate 0 and the steps alike.
    for m in [&k3[0], &plus[0], &k1[0]] {
        assert_eq!(m["kl"], 0.0, "{m:?}");
    }
    assert_eq!(k3[0]["loss"], plus[0]["loss"]);
    // Step 2 starts from the same weights (step 1's gradients are alike: d = 0): the same k3.
    assert_eq!(k3[1]["kl"], plus[1]["kl"]);
    assert!(k3[1]["kl"] > 0.0);
    // Step 2's gradients differ (k3's 1 − e^{−d} against d), so step 3 does.
    assert_ne!(k3[2]["kl"], plus[2]["kl"]);
    // k1's estimate at step 2 is the mean log-ratio: another number than k3's.
    assert_ne!(k1[1]["kl"], k3[1]["kl"]);
    let p = f.root.join("full.toml");
    std::fs::write(
        &p,
        config_text(&f.root, "full", 1, "[loss]\nkl_loss_type = \"full\"\n"),
    )
    .unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("kl_loss_type `full`"), "{e}");
}

/// `[loss.policy_loss]` Clip-Cov and KL-Cov in a run: both train, the same seed gives the same
/// run (Clip-Cov's draws are seeded per micro-batch and update), Clip-Cov's dropped gradients
/// change the run; KL-Cov logs no clip ratios (it has no clip); RLOO refuses them.
#[test]
fn clip_cov_and_kl_cov_train_reproducibly() {
    let f = fixture();
    let run = |name: &str, extra: &str| {
        let cfg = load(&f.root, name, 3, &format!("{DIGIT}{extra}"));
        crate::train::run(cfg, RunOptions::default()).metrics
    };
    // Shares large enough that each micro-batch of 4 × 8 tokens draws or penalises some.
    let clip = "[loss.policy_loss]\nloss_mode = \"clip_cov\"\nclip_cov_ratio = 0.2\nclip_cov_lb = -10.0\nclip_cov_ub = 10.0\n";
    let a = run("clip_a", clip);
    let b = run("clip_b", clip);
    let plain = run("plain", "");
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x["loss"], y["loss"]);
        assert!(x["loss"].is_finite());
    }
    // Step 1 is on-policy from the same weights: dropping tokens' gradients changes the update,
    // so step 2 differs from the plain run's.
    assert_ne!(a[1]["loss"], plain[1]["loss"]);
    let kl = run(
        "kl_cov",
        "[loss.policy_loss]\nloss_mode = \"kl_cov\"\nkl_cov_ratio = 0.2\nppo_kl_coef = 1.0\n",
    );
    for m in &kl {
        assert!(m["loss"].is_finite());
        assert_eq!(m["clip_ratio/region_mean"], 0.0, "{m:?}");
    }
    let mut cfg = load(
        &f.root,
        "rloo",
        1,
        &format!("{DIGIT}[loss.policy_loss]\nloss_mode = \"kl_cov\"\n"),
    );
    cfg.algorithm = grpo_trainer::config::Algorithm::Rloo;
    let e = cfg.validate().unwrap_err();
    assert!(
        e.contains("loss.policy_loss.loss_mode") && e.contains("rloo"),
        "{e}"
    );
}

/// The optimal token baseline (and TIR's, with the zero tail) in a run: the learner forms each
/// token's advantage from a forward of the policy before the update (old log-probs and Σπ²),
/// and it raises the score it learns from; per-token advantages refuse gmpo.
#[test]
fn the_optimal_token_baseline_learns() {
    let f = fixture();
    for est in ["optimal_token_baseline", "tir_optimal_token_baseline"] {
        let cfg = load(
            &f.root,
            est,
            20,
            &format!("{DIGIT}[loss]\nadv_estimator = \"{est}\"\n"),
        );
        let (first, last) = digit_share(cfg);
        assert!(last > first + 0.1, "{est}: digit share {first} -> {last}");
    }
    let mut cfg = load(
        &f.root,
        "otb_gmpo",
        1,
        &format!("{DIGIT}[loss]\nadv_estimator = \"optimal_token_baseline\"\n"),
    );
    cfg.loss.loss_type = grpo_core::loss::LossType::Gmpo;
    let e = cfg.validate().unwrap_err();
    assert!(e.contains("gmpo"), "{e}");
}

#[test]
fn estimator_refusals_are_one_line() {
    let f = fixture();
    for (extra, want) in [
        (
            "algorithm = \"rloo\"\n[loss]\nadv_estimator = \"opo\"",
            "needs algorithm = \"grpo\"",
        ),
        (
            "[loss]\nadv_estimator = \"opo\"\nuse_leave_one_out_baseline = true",
            "two different baselines",
        ),
        (
            "[loss]\nadv_estimator = \"grpo_passk\"\nscale_rewards = \"batch\"",
            "not by the batch's",
        ),
        (
            "[loss]\nadv_estimator = \"reinforce_plus_plus\"\ngamma = 0.9\nloss_type = \"gmpo\"",
            "takes one per completion",
        ),
        (
            "[loss]\ngamma = 1.5\nadv_estimator = \"opo\"",
            "`loss.gamma` must be in [0, 1]",
        ),
        (
            "[loss]\nuse_kl_in_reward = true\n[loss.kl_ctrl]\ntype = \"adaptive\"\ntarget_kl = 0",
            "target_kl > 0",
        ),
        (
            "[loss]\nadv_estimator = \"reinforce\"",
            "unknown adv_estimator `reinforce`",
        ),
        ("[loss]\nkl_penalty = \"full\"", "kl_penalty `full`"),
        (
            "[loss]\nadv_estimator = \"gpg\"\nreplay_buffer_size = 4",
            "replay_buffer_size",
        ),
    ] {
        // `algorithm` is a top-level key: it goes before the first section.
        let text = match extra.strip_prefix("algorithm = \"rloo\"\n") {
            Some(rest) => format!(
                "algorithm = \"rloo\"\n{}",
                config_text(&f.root, "bad", 1, rest)
            ),
            None => config_text(&f.root, "bad", 1, extra),
        };
        let p = f.root.join("bad.toml");
        std::fs::write(&p, text).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want), "{extra}: {e}");
        assert!(!e.trim_end().contains('\n'), "{e}");
    }
    // ReMax's greedy baselines come from the local generator.
    let p = f.root.join("remax.toml");
    std::fs::write(
        &p,
        config_text(&f.root, "remax", 1, "[loss]\nadv_estimator = \"remax\""),
    )
    .unwrap();
    let e = format!(
        "{:#}",
        config::load(&p, &["rollout.backend=openai".into()]).unwrap_err()
    );
    assert!(
        e.contains("samples its greedy baselines with the local generator"),
        "{e}"
    );
}

/// ReMax: each prompt's greedy completion is sampled beside the group (the same whatever the
/// seed: argmax decoding) and scored with the run's rewards; each completion's advantage is its
/// reward minus its prompt's greedy reward; with the KL in the reward the per-token advantages
/// train.
#[test]
fn remax_subtracts_the_greedy_completions_reward() {
    let f = fixture();
    let extra = "[[rewards]]\ntype = \"format\"\npattern = '(?s).*[0-9].*'\n[loss]\nadv_estimator = \"remax\"\n";
    let mut greedy_texts = Vec::new();
    for seed in [1u64, 2] {
        let mut cfg = load(&f.root, &format!("remax{seed}"), 1, extra);
        cfg.train.seed = seed;
        let s = trainer::setup(cfg).unwrap();
        let (_, sc) = common::first_scored_step(&s, &f.root.join(format!("remax{seed}")));
        let r = &sc.rollouts;
        let greedy = r.greedy.as_ref().unwrap();
        assert_eq!(greedy.completions.len(), r.batch.samples.len());
        let has_digit = |t: &str| {
            if t.chars().any(|c| c.is_ascii_digit()) {
                1.0
            } else {
                0.0
            }
        };
        for (c, &rw) in greedy.completions.iter().zip(&greedy.rewards) {
            assert_eq!(rw, has_digit(&c.text), "{:?}", c.text);
        }
        for (i, c) in r.completions.iter().enumerate() {
            let want = sc.scores.rewards[i] - greedy.rewards[c.prompt_index];
            assert!(
                (sc.advantages[i] - want).abs() < 1e-6,
                "{i}: {} vs {want}",
                sc.advantages[i]
            );
        }
        greedy_texts.push(
            greedy
                .completions
                .iter()
                .map(|c| c.text.clone())
                .collect::<Vec<_>>(),
        );
    }
    assert_eq!(
        greedy_texts[0], greedy_texts[1],
        "greedy decoding does not depend on the seed"
    );
    // With the KL in the reward the learner forms per-token advantages and trains; evaluation
    // samples no greedy baselines and scores as usual.
    let mut cfg = load(
        &f.root,
        "remax_kl",
        3,
        &format!("{extra}use_kl_in_reward = true\n"),
    );
    cfg.data.eval_fraction = Some(0.2);
    cfg.train.eval_steps = 3;
    let (r, evals) = common::run_with_evals(cfg);
    assert_eq!(r.metrics.len(), 3);
    assert_eq!(evals.len(), 1);
    assert!(evals[0]["eval/reward"].is_finite(), "{:?}", evals[0]);
    assert!(
        r.metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["grad_norm"] > 0.0)
    );
}
