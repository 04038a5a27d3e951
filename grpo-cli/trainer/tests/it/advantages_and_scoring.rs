//! The trainer's options from NeMo RL and the inverse-perplexity seed: the leave-one-out
//! baseline, and `inverse_loss` scored with the policy being trained.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use grpo_core::ScaleRewards;
use grpo_core::advantages::leave_one_out_normalized;
use grpo_data::synth::ArithmeticConfig;
use grpo_rewards::builtin::LanguageScorer;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::{FitOptions, GrpoTrainer, TrainConfig};

const G: usize = 4;

fn config(root: &Path, out: &str, rewards: serde_json::Value) -> TrainConfig {
    let mut c = TrainConfig {
        output_dir: root.join(out),
        ..Default::default()
    };
    c.rollout.num_generations = G;
    c.rollout.max_completion_length = 5;
    c.train.prompts_per_step = 2;
    c.train.save_steps = 1;
    c.train.num_completions_to_print = 1000;
    c.optim.learning_rate = Some(5e-2);
    c.rewards = serde_json::from_value(rewards).unwrap();
    c
}

fn fit(root: &Path, cfg: TrainConfig, steps: usize) -> grpo_trainer::TrainingResult {
    let data = ArithmeticConfig {
        n: 8,
        seed: 3,
        digits: 1,
        steps: 1,
    }
    .dataset()
    .unwrap();
    GrpoTrainer::from_pretrained(root.join("model"), cfg)
        .unwrap()
        .fit_with(FitOptions::default().dataset(data).max_steps(steps))
        .unwrap()
}

fn completions(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn f32_of(v: &serde_json::Value) -> f32 {
    v.as_f64().map_or(f32::NAN, |x| x as f32)
}

#[test]
fn leave_one_out_baseline_gives_nemo_rl_advantages() {
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, Arch::Qwen2, 5).unwrap();
    let digits = serde_json::json!([
        {"type": "format", "name": "digit", "pattern": "(?s).*[0-9].*"},
        {"type": "overlong", "max_completion_length": 5, "overlong_buffer": 4}
    ]);
    for (scale, normalize) in [(ScaleRewards::Group, true), (ScaleRewards::None, false)] {
        let out = format!("loo-{}", scale.as_str());
        let mut cfg = config(dir.path(), &out, digits.clone());
        cfg.loss.use_leave_one_out_baseline = true;
        cfg.loss.scale_rewards = scale;
        fit(dir.path(), cfg, 2);
        let lines = completions(&dir.path().join(&out));
        assert_eq!(lines.len(), 2 * 2 * G);
        let rewards: Vec<f32> = lines.iter().map(|l| f32_of(&l["reward"])).collect();
        let logged: Vec<f32> = lines.iter().map(|l| f32_of(&l["advantage"])).collect();
        let want = leave_one_out_normalized(&rewards, G, normalize);
        for (i, (a, b)) in logged.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "{scale:?} completion {i}: {a} vs {b}");
        }
        assert!(
            logged.iter().any(|a| *a != 0.0),
            "every group tied: {rewards:?}"
        );
    }
    // It does not combine with batch scaling.
    let mut cfg = config(dir.path(), "bad", digits);
    cfg.loss.use_leave_one_out_baseline = true;
    cfg.loss.scale_rewards = ScaleRewards::Batch;
    let e = GrpoTrainer::from_pretrained(dir.path().join("model"), cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("use_leave_one_out_baseline"), "{e}");
}

/// `multi_objective_aggregation = "normalize_then_sum"` (GDPO): the logged advantages are
/// grpo-core's from the logged per-function rewards and weights, and differ from the default
/// aggregation's.
#[test]
fn normalize_then_sum_gives_gdpo_advantages() {
    use grpo_core::advantages::{MultiObjectiveAggregation, normalize_then_sum_advantages};
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, Arch::Qwen2, 5).unwrap();
    let rewards = serde_json::json!([
        {"type": "format", "name": "digit", "pattern": "(?s).*[0-9].*"},
        {"type": "overlong", "max_completion_length": 5, "overlong_buffer": 4, "weight": 0.5}
    ]);
    let mut cfg = config(dir.path(), "gdpo", rewards.clone());
    cfg.loss.multi_objective_aggregation = MultiObjectiveAggregation::NormalizeThenSum;
    fit(dir.path(), cfg, 2);
    let lines = completions(&dir.path().join("gdpo"));
    assert_eq!(lines.len(), 2 * 2 * G);
    for step in lines.chunks(2 * G) {
        let column = |name: &str| -> Vec<Option<f32>> {
            step.iter()
                .map(|l| l["rewards"][name].as_f64().map(|x| x as f32))
                .collect()
        };
        let per_function = [column("digit"), column("overlong")];
        let logged: Vec<f32> = step.iter().map(|l| f32_of(&l["advantage"])).collect();
        let want = normalize_then_sum_advantages(&per_function, &[1.0, 0.5], G);
        for (i, (a, b)) in logged.iter().zip(&want).enumerate() {
            assert!((a - b).abs() < 1e-5, "completion {i}: {a} vs {b}");
        }
    }
    assert!(
        lines.iter().any(|l| f32_of(&l["advantage"]) != 0.0),
        "every completion tied"
    );
    // Both baselines at once are refused.
    let mut cfg = config(dir.path(), "both", rewards);
    cfg.loss.multi_objective_aggregation = MultiObjectiveAggregation::NormalizeThenSum;
    cfg.loss.use_leave_one_out_baseline = true;
    let e = GrpoTrainer::from_pretrained(dir.path().join("model"), cfg)
        .unwrap_err()
        .to_string();
    assert!(e.contains("multi_objective_aggregation"), "{e}");
}

/// `inverse_loss` with `model = "policy"` scores each step with the weights that sampled it:
/// step 2's rewards are −NLL under the step-1 checkpoint, while `model = "reference"` keeps the
/// weights as loaded.
#[test]
fn inverse_loss_scores_with_the_policy_being_trained() {
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, Arch::Qwen2, 6).unwrap();
    let mut runs = Vec::new();
    for model in ["reference", "policy"] {
        let rewards = serde_json::json!([{"type": "inverse_loss", "model": model}]);
        fit(dir.path(), config(dir.path(), model, rewards), 2);
        runs.push(completions(&dir.path().join(model)));
    }
    let step = |lines: &[serde_json::Value], s: u64| -> Vec<serde_json::Value> {
        lines.iter().filter(|l| l["step"] == s).cloned().collect()
    };
    let load = |p: &Path| {
        let m = grpo_rollout::load(p, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
        grpo_rollout::scoring::ModelScorer::new(&m.model, m.tokenizer)
    };
    let initial = load(&dir.path().join("model"));
    let after_one = load(&dir.path().join("policy/checkpoints/step-1/model"));
    let score = |s: &grpo_rollout::scoring::ModelScorer, l: &serde_json::Value| -> f32 {
        let nll = s
            .completion_nll(
                l["prompt"].as_str().unwrap(),
                l["completion"].as_str().unwrap(),
            )
            .unwrap();
        nll.map_or(0.0, |x| -x)
    };
    // Step 1: both score with the initial weights (the same completions: same seed, same
    // weights).
    let (r1, p1) = (step(&runs[0], 1), step(&runs[1], 1));
    assert_eq!(r1.len(), 2 * G);
    for (a, b) in r1.iter().zip(&p1) {
        assert_eq!(a["completion"], b["completion"]);
        let want = score(&initial, a);
        for l in [a, b] {
            let got = f32_of(&l["rewards"]["inverse_loss"]);
            assert!((got - want).abs() < 1e-4, "step 1: {got} vs {want}");
        }
    }
    // Step 2: the policy run scores with the step-1 weights, the reference run with the
    // initial ones.
    let (r2, p2) = (step(&runs[0], 2), step(&runs[1], 2));
    let mut moved = 0f32;
    for l in &p2 {
        let got = f32_of(&l["rewards"]["inverse_loss"]);
        let want = score(&after_one, l);
        assert!((got - want).abs() < 1e-4, "policy, step 2: {got} vs {want}");
        moved = moved.max((want - score(&initial, l)).abs());
    }
    for l in &r2 {
        let got = f32_of(&l["rewards"]["inverse_loss"]);
        assert!((got - score(&initial, l)).abs() < 1e-4);
    }
    assert!(moved > 1e-3, "one step did not move the policy: {moved}");
}
