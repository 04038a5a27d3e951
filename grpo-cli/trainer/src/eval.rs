//! Evaluation of a GRPO policy: mean rewards on the eval split, sampled with the current
//! policy, for distillation the divergence from the teacher on those samples, for SDPO and
//! SDFT their loss (SFT, DPO, KTO and reward models evaluate in
//! [`crate::learner::supervised`]).

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
    // XPO's and Nash-MD's second samples (the reference's, the mixture's) are the training
    // pairs' contrast, not the policy's: the eval split is the policy's samples alone.
    let mut generator = Generator::new(setup, model, learner.state.step)
        .with_num_generations(g)
        .policy_only();
    let mut scorer = Scorer::new(setup)
        .without_logs()
        .with_num_generations(g)
        .group_advantages();
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
    // SDPO and SDFT: the loss and the self-distillation term per micro-batch.
    let self_distill = setup.cfg.self_distill().is_some();
    let (mut sd_loss, mut sd_term, mut sd_parts) = (0.0, 0.0, 0.0);
    while let Some(samples) = stream.next_batch().map_err(|e| anyhow!("eval data: {e}"))? {
        let batch = PromptBatch {
            step: usize::MAX / 2,
            draw: usize::MAX / 2,
            samples,
            position: stream.position(),
        };
        let r = generator.process(batch)?;
        let s = scorer.process(r)?;
        if distill {
            let (d, e, t) = learner.distill_eval(&s)?;
            (div, ent, tokens) = (div + d, ent + e, tokens + t);
        }
        if self_distill {
            let (l, d, n) = learner.self_distill_eval(&s, g)?;
            (sd_loss, sd_term, sd_parts) = (sd_loss + l, sd_term + d, sd_parts + n);
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
    if self_distill && sd_parts > 0.0 {
        m.insert("eval/loss".into(), sd_loss / sd_parts);
        m.insert(
            "eval/self_distillation/distillation_loss".into(),
            sd_term / sd_parts,
        );
    }
    if let Some(a) = m.get("eval/rewards/accuracy/mean").copied() {
        m.insert("eval/accuracy".into(), a);
    }
    m.insert("step".into(), learner.state.step as f64);
    Ok(m)
}
