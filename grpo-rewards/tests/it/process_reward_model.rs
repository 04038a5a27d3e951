//! `process_reward_model` against a fake step classifier whose `P(correct)` at a position is
//! the last digit before it, over ten: the rows it is given (BOS, prompt, each
//! step and separator, right padding), the positions it is read at, every aggregation, the
//! completions without a step, the batches, and the config's refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use grpo_rewards::builtin::{
    ProcessRewardModel, ProcessRewardModelConfig, ScorerError, StepAggregation, StepClassifier,
};
use grpo_rewards::{Reward, RewardInput, RewardsConfig, ScoringModels};

const BOS: u32 = 1;
const PAD: u32 = 0;

/// Bytes as token ids; `P(label 1)` at position j is (the last digit before j) / 10, or 0.5.
#[derive(Default)]
struct Digits {
    seen: Mutex<Vec<Vec<u32>>>,
}

impl StepClassifier for Digits {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError> {
        Ok(text.bytes().map(u32::from).collect())
    }
    fn bos_token_id(&self) -> Option<u32> {
        Some(BOS)
    }
    fn pad_token_id(&self) -> u32 {
        PAD
    }
    fn step_probabilities(&self, padded: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ScorerError> {
        self.seen.lock().unwrap().extend(padded.iter().cloned());
        Ok(padded
            .iter()
            .map(|r| {
                (0..r.len())
                    .map(
                        |j| match r[..j].iter().rev().find(|t| (48..58).contains(*t)) {
                            Some(t) => (t - 48) as f32 / 10.0,
                            None => 0.5,
                        },
                    )
                    .collect()
            })
            .collect())
    }
}

fn ids(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

#[test]
fn steps_are_read_where_training_labels_them_and_aggregated() {
    let fake = Arc::new(Digits::default());
    let inputs = [
        RewardInput::new("Q:", "a=3\nb=7\nc=5\n"),
        RewardInput::new("Q:", "x=9"),
        RewardInput::new("Q:", ""),
        RewardInput::new("Q:", "\n\n"),
    ];
    let want = [
        (StepAggregation::Min, 0.3),
        (StepAggregation::Last, 0.5),
        (StepAggregation::Mean, 0.5),
        (StepAggregation::Prod, 0.3 * 0.7 * 0.5),
    ];
    for (agg, first) in want {
        let r = ProcessRewardModel::new(
            fake.clone(),
            ProcessRewardModelConfig {
                aggregation: agg,
                batch_size: 3,
                ..Default::default()
            },
        )
        .unwrap();
        let out = r.score(&inputs).unwrap();
        assert!(
            (out.scores[0].unwrap() - first).abs() < 1e-6,
            "{agg:?}: {:?}",
            out.scores
        );
        // One step: every aggregation is its probability.
        assert!((out.scores[1].unwrap() - 0.9).abs() < 1e-6);
        assert_eq!(out.scores[2], None);
        assert_eq!(out.scores[3], None);
    }
    // The rows: BOS, the prompt, each step with the separator after it (a trailing separator
    // makes no empty step), right-padded to the longest row of the batch (of 3).
    let seen = fake.seen.lock().unwrap();
    let mut first: Vec<u32> = vec![BOS];
    first.extend(ids("Q:a=3\nb=7\nc=5\n"));
    assert_eq!(seen[0], first);
    let mut second: Vec<u32> = vec![BOS];
    second.extend(ids("Q:x=9\n"));
    second.resize(first.len(), PAD);
    assert_eq!(seen[1], second);
    // The fourth input went in a batch of its own.
    assert_eq!(seen[3], vec![BOS, u32::from(b'Q'), u32::from(b':')]);
}

#[test]
fn another_separator_and_the_refusals() {
    let fake = Arc::new(Digits::default());
    let r = ProcessRewardModel::new(
        fake.clone(),
        ProcessRewardModelConfig {
            step_separator: " ; ".into(),
            ..Default::default()
        },
    )
    .unwrap();
    let out = r.score(&[RewardInput::new("", "s=8 ; t=2 ; u=6")]).unwrap();
    assert!((out.scores[0].unwrap() - 0.2).abs() < 1e-6);
    for cfg in [
        ProcessRewardModelConfig {
            batch_size: 0,
            ..Default::default()
        },
        ProcessRewardModelConfig {
            step_separator: String::new(),
            ..Default::default()
        },
    ] {
        assert!(ProcessRewardModel::new(fake.clone(), cfg).is_err());
    }
    // Through a config: `path` is required and must name a loaded model.
    let build = |text: &str, models: &ScoringModels| {
        let cfg: RewardsConfig = toml::from_str(text).unwrap();
        cfg.build(models).map(|_| ()).unwrap_err().to_string()
    };
    let none = ScoringModels::default();
    let e = build("[[rewards]]\ntype = \"process_reward_model\"\n", &none);
    assert!(e.contains("path"), "{e}");
    let e = build(
        "[[rewards]]\ntype = \"process_reward_model\"\npath = \"prm\"\n",
        &none,
    );
    assert!(
        e.contains("no process reward model was loaded from prm"),
        "{e}"
    );
    let mut loaded = ScoringModels::default();
    let m: Arc<dyn StepClassifier> = fake;
    loaded.step_classifiers = HashMap::from([("prm".into(), m)]);
    let cfg: RewardsConfig = toml::from_str(
        "[[rewards]]\ntype = \"process_reward_model\"\npath = \"prm\"\naggregation = \"last\"\n",
    )
    .unwrap();
    let set = cfg.build(&loaded).unwrap();
    let scored = set.score(&[RewardInput::new("Q", "a=1\nb=4")]).unwrap();
    assert!(
        (scored.rewards[0] - 0.4).abs() < 1e-6,
        "{:?}",
        scored.rewards
    );
}
