//! A `type = "python"` reward through the trainer: a tiny model trained 2 steps, the rewards
//! logged in completions.jsonl recomputed in Rust from the logged text. Skips (with a message)
//! without a Python (`GRPO_PYTHON`, else `python3`).
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::{FitOptions, GrpoTrainer, TrainConfig};
use serde_json::{Value, json};

const REWARDS_PY: &str = r#"
def answer_and_step(prompts, completions, completion_ids, trainer_state, answer, **kwargs):
    print("scoring step", trainer_state.global_step)
    return [
        (1.0 if a in c else 0.0) + 0.25 * trainer_state.global_step + len(c) / 100
        for c, a in zip(completions, answer)
    ]
"#;

/// `answer_and_step`, in Rust.
fn expected(completion: &str, answer: &str, global_step: usize) -> f32 {
    let hit = if completion.contains(answer) {
        1.0
    } else {
        0.0
    };
    (hit + 0.25 * global_step as f64 + completion.chars().count() as f64 / 100.0) as f32
}

#[test]
fn a_python_reward_scores_every_completion_of_a_run() {
    let python = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into());
    if !std::process::Command::new(&python)
        .args(["-c", "import sys; assert sys.version_info >= (3, 8)"])
        .output()
        .is_ok_and(|o| o.status.success())
    {
        eprintln!("skipped: no Python ≥ 3.8 at `{python}` (set GRPO_PYTHON to one)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    init_model_dir(&model, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    let script = dir.path().join("rewards.py");
    std::fs::write(&script, REWARDS_PY).unwrap();

    let mut cfg = TrainConfig {
        output_dir: dir.path().join("run"),
        ..Default::default()
    };
    cfg.rollout.num_generations = 4;
    cfg.rollout.max_completion_length = 6;
    cfg.train.prompts_per_step = 2;
    cfg.train.per_device_train_batch_size = Some(4);
    cfg.train.save_steps = 0;
    cfg.train.num_completions_to_print = 8;
    cfg.rewards = serde_json::from_value(json!([{
        "type": "python", "name": "py", "path": script, "function": "answer_and_step",
        "python": python,
    }]))
    .unwrap();
    let data = ArithmeticConfig {
        n: 4,
        seed: 11,
        digits: 1,
        steps: 1,
    };
    let mut t = GrpoTrainer::from_pretrained(&model, cfg).unwrap();
    let r = t
        .fit_with(
            FitOptions::default()
                .dataset(data.dataset().unwrap())
                .max_steps(2),
        )
        .unwrap();
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["rewards/py/mean"].is_finite(), "{m:?}");
        assert_eq!(m["rewards/py/worker_restarts"], 0.0, "{m:?}");
    }

    let problems: Vec<(String, String)> = (0..data.n).map(|i| data.problem(i)).collect();
    let text = std::fs::read_to_string(dir.path().join("run/completions.jsonl")).unwrap();
    let lines: Vec<Value> = text
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 2 * 8, "{text}");
    for line in &lines {
        // The logged step is the step being trained (1-based); the reward saw the steps done.
        let step = line["step"].as_u64().unwrap() as usize;
        let prompt = line["prompt"].as_str().unwrap();
        let completion = line["completion"].as_str().unwrap();
        let answer = &problems
            .iter()
            .filter(|(q, _)| prompt.contains(q.as_str()))
            .max_by_key(|(q, _)| q.len())
            .unwrap_or_else(|| panic!("no problem in {prompt:?}"))
            .1;
        let logged = line["rewards"]["py"].as_f64().unwrap() as f32;
        assert_eq!(logged, expected(completion, answer, step - 1), "{line}");
        assert_eq!(line["reward"].as_f64().unwrap() as f32, logged, "{line}");
    }
    let steps: std::collections::BTreeSet<u64> =
        lines.iter().map(|l| l["step"].as_u64().unwrap()).collect();
    assert_eq!(steps.into_iter().collect::<Vec<_>>(), [1, 2]);
}
