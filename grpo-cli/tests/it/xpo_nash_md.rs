//! XPO and Nash-MD (TRL's experimental XPOTrainer and NashMDTrainer, `algorithm = "xpo"` /
//! `"nash_md"`) on the pipelined loop: each prompt's pair is a policy sample and a sample of
//! the reference (XPO) or of the policy–reference geometric mixture (Nash-MD); each step's
//! loss is TRL's formula computed here from the models' log-probs, before and after an update;
//! a run raises the reward it is ranked by; TRL's defaults, values per epoch, the refusals,
//! exact resume, LoRA with a stale generator and the subcommands.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device};
use grpo_rollout::Transformer;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::stages::{Generator, Loader, Scored};
use grpo_trainer::{self as trainer, FitOptions, NashMdTrainer, RunOptions, XpoTrainer};

use crate::common;
use crate::online_dpo::{digits, log_sigmoid, run};
use common::{
    Fixture, assert_same_steps, completion_logits, first_scored_step, grpo_cli_ok,
    stopped_and_resumed, token_logps,
};

fn fixture() -> Fixture {
    Fixture::new()
        .model("model", 3)
        .model("other", 8)
        .arithmetic(16)
}

/// The fixture's `other` model: a policy that is not the reference.
fn other_policy(f: &Fixture) -> Transformer {
    grpo_rollout::load(&f.root.join("other"), DType::F32, &Device::Cpu)
        .unwrap()
        .model
        .detached()
}

/// Online DPO's test config with `algorithm` and the `inverse_loss` reward (which varies
/// within a pair).
fn config_text(root: &Path, algorithm: &str, out: &str, steps: usize, extra: &str) -> String {
    crate::online_dpo::config_text(root, out, steps, extra)
        .replace(
            "algorithm = \"online_dpo\"",
            &format!("algorithm = \"{algorithm}\""),
        )
        .replace("type = \"accuracy\"", "type = \"inverse_loss\"")
}

fn load(root: &Path, algorithm: &str, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, algorithm, out, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn load_err(root: &Path, algorithm: &str, extra: &str, sets: &[&str]) -> String {
    let p = root.join("bad.toml");
    std::fs::write(&p, config_text(root, algorithm, "bad", 1, extra)).unwrap();
    let sets: Vec<String> = sets.iter().map(|s| s.to_string()).collect();
    format!("{:#}", config::load(&p, &sets).unwrap_err())
}

/// Log-probs at `temperature` of `completion` after `prompt` under the geometric mixture
/// `log_softmax(c · reference + (1 − c) · model)`.
fn mixture_logps(
    model: &Transformer,
    reference: &Transformer,
    c: f64,
    prompt: &[u32],
    completion: &[u32],
    temperature: f64,
) -> Vec<f64> {
    let zm: Vec<Vec<f64>> = completion_logits(model, prompt, completion)
        .to_vec2()
        .unwrap();
    let zr: Vec<Vec<f64>> = completion_logits(reference, prompt, completion)
        .to_vec2()
        .unwrap();
    zm.iter()
        .zip(&zr)
        .zip(completion)
        .map(|((a, b), &t)| {
            let z: Vec<f64> = a
                .iter()
                .zip(b)
                .map(|(a, b)| ((1.0 - c) * a + c * b) / temperature)
                .collect();
            let m = z.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            z[t as usize] - m - z.iter().map(|x| (x - m).exp()).sum::<f64>().ln()
        })
        .collect()
}

/// Each prompt's first completion is sampled by the policy; its second by the reference (XPO)
/// or the mixture (Nash-MD): their recorded log-probs are those models' (a policy other than
/// the reference samples, so the two differ).
#[test]
fn each_pair_is_a_policy_sample_and_a_reference_or_mixture_sample() {
    let f = fixture();
    let other = other_policy(&f);
    for (algorithm, extra) in [("xpo", ""), ("nash_md", "[nash_md]\nmixture_coef = 0.3\n")] {
        let s = trainer::setup(load(&f.root, algorithm, algorithm, 1, extra)).unwrap();
        let reference = s.reference.clone().unwrap();
        let batch = Loader::new(&s, 0, None)
            .unwrap()
            .process()
            .unwrap()
            .unwrap();
        let r = Generator::new(&s, Arc::new(other.clone()), 0)
            .process(batch)
            .unwrap();
        assert_eq!(r.completions.len(), 8);
        let t = s.cfg.rollout.temperature;
        let mut differs = false;
        for (i, c) in r.completions.iter().enumerate() {
            assert_eq!((c.prompt_index, c.sample_index), (i / 2, i % 2));
            let p = &r.prompt_ids[c.prompt_index];
            let want = match (i % 2, algorithm) {
                (0, _) => token_logps(&other, p, &c.token_ids, t),
                (_, "xpo") => token_logps(&reference, p, &c.token_ids, t),
                _ => mixture_logps(&other, &reference, 0.3, p, &c.token_ids, t),
            };
            let policy = token_logps(&other, p, &c.token_ids, t);
            for ((w, got), pol) in want.iter().zip(&c.logprobs).zip(&policy) {
                assert!(
                    (w - *got as f64).abs() < 1e-4,
                    "{algorithm} completion {i}: {w} vs {got}"
                );
                differs |= (w - pol).abs() > 1e-3;
            }
        }
        assert!(
            differs,
            "{algorithm}: the second samples are not the policy's"
        );
    }
}

/// TRL's loss of a scored step, from the policy's and the reference's log-probs (raw logits)
/// of its completions: XPO's `−log σ(β Δ) + α Σ log π(y_ref)` over the pairs ranked by reward
/// (a tie keeps the policy's sample as chosen); Nash-MD's
/// `β Σ sg(log π − log π_ref) log π − (σ(r − r') − ½) Σ log π` on the policy's samples.
fn trl_loss(
    algorithm: &str,
    policy: &Transformer,
    reference: &Transformer,
    sc: &Scored,
    beta: f64,
    alpha: f64,
) -> f64 {
    let r = &sc.rollouts;
    let reward = |i: usize| {
        let v = sc.scores.rewards[i];
        if v.is_nan() { 0.0 } else { f64::from(v) }
    };
    let k = r.completions.len() / 2;
    let mut total = 0.0;
    for pair in 0..k {
        let p = &r.prompt_ids[pair];
        let logps = |m: &Transformer, i: usize| token_logps(m, p, &r.completions[i].token_ids, 1.0);
        let sum = |v: Vec<f64>| v.iter().sum::<f64>();
        let (a, b) = (2 * pair, 2 * pair + 1);
        total += if algorithm == "xpo" {
            let (c, j) = if reward(a) >= reward(b) {
                (a, b)
            } else {
                (b, a)
            };
            let ratio = |i| sum(logps(policy, i)) - sum(logps(reference, i));
            -log_sigmoid(beta * (ratio(c) - ratio(j))) + alpha * sum(logps(policy, b))
        } else {
            let prob = 1.0 / (1.0 + (reward(b) - reward(a)).exp());
            let (lp, rlp) = (logps(policy, a), logps(reference, a));
            let kl: f64 = lp.iter().zip(&rlp).map(|(l, r)| (l - r) * l).sum();
            beta * kl - (prob - 0.5) * sum(lp)
        };
    }
    total / k as f64
}

/// The first step (policy = reference) and the next one on the same completions (the policy
/// moved) have TRL's loss; XPO's is its DPO part plus its exploration part, the first DPO part
/// ln 2; Nash-MD's first KL is 0 and then is not.
#[test]
fn each_steps_loss_is_trls_before_and_after_an_update() {
    let f = fixture();
    for algorithm in ["xpo", "nash_md"] {
        let extra = "[xpo]\nalpha = 0.05\n[online_dpo]\nbeta = 0.2\n";
        let s = trainer::setup(load(&f.root, algorithm, algorithm, 1, extra)).unwrap();
        let reference = s.reference.clone().unwrap();
        let (mut learner, sc) = first_scored_step(&s, &f.root.join(algorithm));
        let rewards = &sc.scores.rewards;
        assert!(
            (0..4).any(|k| rewards[2 * k] != rewards[2 * k + 1]),
            "the pairs' rewards should differ: {rewards:?}"
        );
        let mut previous: Option<f64> = None;
        for step in 0..2 {
            let policy = learner.policy().model.detached();
            let want = trl_loss(algorithm, &policy, &reference, &sc, 0.2, 0.05);
            let m = learner.process(&sc).unwrap();
            assert!(
                (m["loss"] - want).abs() < 1e-4 * want.abs().max(1.0),
                "{algorithm} step {step}: loss {} vs TRL's {want}",
                m["loss"]
            );
            if algorithm == "xpo" {
                assert!((m["loss/dpo"] + m["loss/xpo"] - m["loss"]).abs() < 1e-5);
                if step == 0 {
                    assert!((m["loss/dpo"] - std::f64::consts::LN_2).abs() < 1e-5);
                }
                assert_eq!(m["alpha"], 0.05);
            } else {
                let kl = m["loss/kl"].abs();
                assert!(if step == 0 { kl < 1e-5 } else { kl > 1e-4 }, "{m:?}");
                assert_eq!(m["mixture_coef"], 0.5);
                assert!((0.0..=1.0).contains(&m["rewards/probabilities"]));
            }
            assert_eq!(m["beta"], 0.2);
            for k in [
                "val/model_contain_eos_token",
                "val/ref_contain_eos_token",
                "rewards/margins",
                "logps/chosen",
                "objective/entropy",
            ] {
                assert!(m[k].is_finite(), "{algorithm}: {k} in {m:?}");
            }
            if let Some(p) = previous {
                assert!(
                    (m["loss"] - p).abs() > 1e-6,
                    "{algorithm}: the policy moved"
                );
            }
            previous = Some(m["loss"]);
        }
    }
}

/// Ranked by the share of digits in a completion (a reward given in code), the policy's own
/// samples gain digits; `alpha` and `mixture_coef` follow their per-epoch lists.
#[test]
fn xpo_and_nash_md_raise_the_reward_they_are_ranked_by() {
    let f = fixture();
    for algorithm in ["xpo", "nash_md"] {
        let extra = "[xpo]\nalpha = [1e-3, 0.0]\n[nash_md]\nmixture_coef = [0.5, 0.25]\n";
        let mut cfg = load(&f.root, algorithm, &format!("learn-{algorithm}"), 40, extra);
        cfg.rewards.clear();
        cfg.train.save_steps = 0;
        // Nash-MD's preference is σ of the reward difference: a share of digits (in [0, 1])
        // ×10 makes it a clear preference.
        let weight = if algorithm == "xpo" { 1.0 } else { 10.0 };
        let fit = FitOptions::default().reward("digits", weight, digits);
        let r = match algorithm {
            "xpo" => XpoTrainer::from_config(cfg).unwrap().fit_with(fit),
            _ => NashMdTrainer::from_config(cfg).unwrap().fit_with(fit),
        }
        .unwrap();
        let key = match algorithm {
            "xpo" => "objective/model_scores",
            _ => "rewards/chosen",
        };
        let mean =
            |ms: &[grpo_trainer::Metrics]| ms.iter().map(|m| m[key]).sum::<f64>() / ms.len() as f64;
        let (first, last) = (
            mean(&r.metrics[..10]) / f64::from(weight),
            mean(&r.metrics[30..]) / f64::from(weight),
        );
        eprintln!("{algorithm}: digit share {first} -> {last}");
        assert!(
            last > first + 0.1,
            "{algorithm}: digit share {first} -> {last}"
        );
        // 16 rows, 4 per step: epoch 0 is steps 1-4.
        let (k, a, b) = match algorithm {
            "xpo" => ("alpha", 1e-3, 0.0),
            _ => ("mixture_coef", 0.5, 0.25),
        };
        assert_eq!(r.metrics[3][k], a);
        assert_eq!(r.metrics[4][k], b);
    }
}

#[test]
fn trls_defaults_and_the_refusals() {
    let f = fixture();
    for algorithm in ["xpo", "nash_md"] {
        let text = config_text(&f.root, algorithm, "defaults", 1, "")
            .replace("learning_rate = 1e-2\n", "");
        std::fs::write(f.root.join("defaults.toml"), text).unwrap();
        let cfg = config::load(&f.root.join("defaults.toml"), &[]).unwrap();
        // TRL's XPOConfig / NashMDConfig (OnlineDPOConfig's): two completions per prompt at
        // temperature 0.9, lr 5e-7, β 0.1; α 1e-5, mixture coefficient 0.5.
        assert_eq!(cfg.rollout.num_generations, 2);
        assert_eq!(cfg.rollout.temperature, 0.9);
        assert_eq!(cfg.learning_rate(), 5e-7);
        assert_eq!(cfg.online_dpo.beta.at(0), 0.1);
        assert_eq!(cfg.xpo.alpha.at(0), 1e-5);
        assert_eq!(cfg.nash_md.mixture_coef.at(0), 0.5);
        assert!(trainer::setup(cfg).unwrap().reference.is_some());
    }
    for (algorithm, extra, sets, want) in [
        (
            "xpo",
            "[xpo]\nalpha = -1.0\n",
            &[][..],
            "`xpo.alpha` must be >= 0",
        ),
        (
            "xpo",
            "[xpo]\nalpha = []\n",
            &[],
            "`xpo.alpha` is an empty list",
        ),
        (
            "nash_md",
            "[nash_md]\nmixture_coef = [0.5, 1.5]\n",
            &[],
            "`nash_md.mixture_coef` must be in [0, 1], got 1.5",
        ),
        (
            "nash_md",
            "[online_dpo]\nloss_type = \"ipo\"\n",
            &[],
            "`online_dpo.loss_type` does not apply",
        ),
        (
            "nash_md",
            "[online_dpo]\nbeta = 0.0\n",
            &[],
            "`online_dpo.beta` must be > 0",
        ),
        (
            "xpo",
            "",
            &["rollout.num_generations=4"],
            "XPO compares two completions per prompt",
        ),
        (
            "nash_md",
            "[model.lora]\nr = 4\n",
            &["rollout.backend=openai"],
            "Nash-MD samples from the mixture of the policy's and the reference's logits",
        ),
        (
            "xpo",
            "[reference]\nbeta = 0.1\n",
            &[],
            "XPO's beta is `online_dpo.beta`",
        ),
    ] {
        let e = load_err(&f.root, algorithm, extra, sets);
        assert!(e.contains(want) && !e.trim().contains('\n'), "{extra}: {e}");
    }
}

#[test]
fn resume_is_exact_and_the_subcommands_run() {
    let f = fixture();
    for (algorithm, command) in [("xpo", "xpo"), ("nash_md", "nash-md")] {
        let all = run(
            load(&f.root, algorithm, &format!("all-{algorithm}"), 4, ""),
            RunOptions::default(),
        );
        let cfg = load(&f.root, algorithm, &format!("parts-{algorithm}"), 4, "");
        let joined = stopped_and_resumed(2, |o| run(cfg.clone(), o));
        assert_eq!(joined.len(), 4);
        assert_same_steps(&joined, &all.metrics, &["loss", "rewards/margins", "beta"]);

        let out = format!("cli-{algorithm}");
        let text = config_text(&f.root, algorithm, &out, 2, "")
            .replace(&format!("algorithm = \"{algorithm}\""), "");
        let p = f.root.join(format!("{out}.toml"));
        std::fs::write(&p, text).unwrap();
        grpo_cli_ok(&[command, "--config", p.to_str().unwrap()]);
        let metrics = std::fs::read_to_string(f.root.join(&out).join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 2);
        let key = match algorithm {
            "xpo" => "loss/xpo",
            _ => "rewards/probabilities",
        };
        assert!(metrics.contains(key), "{metrics}");
    }
}

/// With LoRA the reference is the base with the adapters off (the generator samples it from the
/// policy's own base); with `max_staleness = 1` the generator samples step s with version s − 1
/// while the learner trains.
#[test]
fn lora_and_a_stale_generator_train() {
    let f = fixture();
    for algorithm in ["xpo", "nash_md"] {
        let mut cfg = load(&f.root, algorithm, &format!("lora-{algorithm}"), 4, "");
        cfg.model.lora = Some(grpo_rollout::LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            ..Default::default()
        });
        cfg.pipeline.max_staleness = 1;
        let r = run(cfg, RunOptions::default());
        assert_eq!(r.metrics.len(), 4);
        for m in &r.metrics {
            for k in ["loss", "grad_norm", "rewards/margins", "logps/chosen"] {
                assert!(m[k].is_finite(), "{algorithm} {k}: {m:?}");
            }
        }
        assert!(
            r.metrics[3]["rewards/margins"].abs() > 1e-6,
            "{algorithm}: the adapters moved"
        );
    }
}

/// The eval split is scored on the policy's own samples, `num_generations_eval` of them per
/// prompt (no reference or mixture samples among them).
#[test]
fn the_eval_split_samples_the_policy_alone() {
    let f = fixture();
    for algorithm in ["xpo", "nash_md"] {
        let mut cfg = load(&f.root, algorithm, &format!("eval-{algorithm}"), 2, "");
        cfg.data.eval_fraction = Some(0.25);
        cfg.train.eval_steps = 2;
        cfg.rollout.num_generations_eval = Some(3);
        let (_, evals) = common::run_with_evals(cfg);
        assert_eq!(evals.len(), 1, "{algorithm}");
        assert!(
            evals[0]["eval/reward"].is_finite(),
            "{algorithm}: {:?}",
            evals[0]
        );
    }
    // What evaluation's generator samples: the policy's tokens only.
    let s = trainer::setup(load(&f.root, "xpo", "eval-gen", 1, "")).unwrap();
    let other = other_policy(&f);
    let batch = Loader::new(&s, 0, None)
        .unwrap()
        .process()
        .unwrap()
        .unwrap();
    let r = Generator::new(&s, Arc::new(other.clone()), 0)
        .with_num_generations(3)
        .policy_only()
        .process(batch)
        .unwrap();
    assert_eq!(r.completions.len(), 12);
    for c in &r.completions {
        let p = &r.prompt_ids[c.prompt_index];
        let want = token_logps(&other, p, &c.token_ids, s.cfg.rollout.temperature);
        for (w, got) in want.iter().zip(&c.logprobs) {
            assert!((w - *got as f64).abs() < 1e-4);
        }
    }
}
