//! Helpers the trainer tests share.
#![allow(dead_code, clippy::unwrap_used)]

use std::path::Path;

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
