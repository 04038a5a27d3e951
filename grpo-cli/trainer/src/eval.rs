//! Evaluation of a GRPO policy: mean rewards on the eval split, sampled with the current
//! policy, and for distillation the divergence from the teacher on those samples (SFT, DPO,
//! KTO and reward models evaluate in [`crate::learner::supervised`]).

use std::collections::BTreeMap;

use anyhow::{Result, anyhow};
use grpo_data::{Dataset, SampleStream, StreamConfig};

use crate::callbacks::Metrics;
use crate::learner::Learner;
use crate::setup::Setup;
use crate::stages::{Generator, PromptBatch, Scorer};

/// Mean reward (and per-function means) on the eval split, sampled with the current policy.
pub fn evaluate(setup: &Setup, learner: &Learner, eval: &Dataset) -> Result<Metrics> {
    let model = learner.publish()?;
    let r = &setup.cfg.rollout;
    let g = r.num_generations_eval.unwrap_or(r.num_generations);
    let mut generator = Generator::new(setup, model, learner.state.step).with_num_generations(g);
    let mut scorer = Scorer::new(setup).without_logs().with_num_generations(g);
    let sc = StreamConfig {
        seed: setup.cfg.train.seed,
        shuffle: false,
        batch_size: setup.cfg.train.prompts_per_step,
        epochs: Some(1),
        ..Default::default()
    };
    let mut stream = SampleStream::new(eval.clone(), sc).map_err(|e| anyhow!("eval data: {e}"))?;
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    // Distillation: the divergence and the student's entropy per loss token over the split.
    let distill = setup.cfg.algorithm.is_distillation();
    let (mut div, mut ent, mut tokens) = (0.0, 0.0, 0.0);
    while let Some(samples) = stream.next_batch().map_err(|e| anyhow!("eval data: {e}"))? {
        let batch = PromptBatch {
            step: usize::MAX / 2,
            samples,
            position: stream.position(),
        };
        let r = generator.process(batch)?;
        let s = scorer.process(r)?;
        if distill {
            let (d, e, t) = learner.distill_eval(&s)?;
            (div, ent, tokens) = (div + d, ent + e, tokens + t);
        }
        for (i, name) in s.scores.names.iter().enumerate() {
            for v in s.scores.per_function[i].iter().flatten() {
                let e = sums
                    .entry(format!("eval/rewards/{name}/mean"))
                    .or_insert((0.0, 0.0));
                e.0 += *v as f64;
                e.1 += 1.0;
            }
        }
        for v in s.scores.rewards.iter().filter(|v| !v.is_nan()) {
            let e = sums.entry("eval/reward".into()).or_insert((0.0, 0.0));
            e.0 += *v as f64;
            e.1 += 1.0;
        }
    }
    let mut m: Metrics = sums
        .into_iter()
        .map(|(k, (s, c))| (k, s / c.max(1.0)))
        .collect();
    if distill {
        m.insert("eval/loss".into(), div / tokens.max(1.0));
        m.insert("eval/entropy".into(), ent / tokens.max(1.0));
    }
    if let Some(a) = m.get("eval/rewards/accuracy/mean").copied() {
        m.insert("eval/accuracy".into(), a);
    }
    m.insert("step".into(), learner.state.step as f64);
    Ok(m)
}
