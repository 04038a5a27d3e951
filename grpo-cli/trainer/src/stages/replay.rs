//! TRL's `GRPOWithReplayBufferTrainer` (`loss.replay_buffer_size`): a group whose rewards
//! vary is kept in a buffer of the `replay_buffer_size` best groups, scored Σᵢ |Aᵢ| × the
//! group's reward std; a group whose rewards are all equal (no learning signal) is replaced
//! in the loss by a group drawn from the buffer with probability ∝ its score (without
//! replacement while the buffer holds enough groups, as `torch.multinomial`).
//!
//! The scorer applies it to each step in order ([`ReplayBuffer::replay`]), after the
//! advantages: the step as generated stays what metrics and logs describe (TRL logs the
//! fresh batch too), and [`Replay::trained`] is the step the loss trains on. The buffer after
//! each step travels with it to the learner, whose checkpoints keep it
//! (`replay_buffer.json`), so a resumed run replays exactly what the uninterrupted one would.
//!
//! Replayed groups were sampled by an older policy: the loss's view is marked off-policy, so
//! TRL's importance-sampling correction (`loss.vllm_importance_sampling_correction`, on by
//! default) weighs each replayed sequence by its ratio to the log-probs it was sampled with.
//! TRL's trainer applies no correction to them (its old log-probs are the current policy's
//! without vLLM); `vllm_importance_sampling_correction = false` does the same here.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use grpo_rollout::Completion;
use serde::{Deserialize, Serialize};

use super::Scored;

/// The buffer's file in a checkpoint directory.
pub const REPLAY_FILE: &str = "replay_buffer.json";

/// One kept group: what the loss needs to train on it again.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReplayGroup {
    /// Σᵢ |Aᵢ| × the std of the group's rewards (TRL's score; the draw weight).
    pub score: f64,
    /// The step that generated it.
    pub step: usize,
    /// Its prompt's dataset row.
    pub row: u64,
    /// Its prompt's ids.
    pub prompt_ids: Vec<u32>,
    /// Its completions: token ids, the log-probs they were sampled with, finish reasons.
    pub completions: Vec<Completion>,
    /// Per completion, per token: the model's token (multi-turn episodes); `None` when every
    /// token is the model's.
    pub model_masks: Option<Vec<Vec<bool>>>,
    /// Its advantages, as computed when it was generated (TRL replays them unchanged).
    pub advantages: Vec<f32>,
}

/// The best groups seen so far, at most `max_size` (the lowest score leaves first; of equal
/// scores, the oldest).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct ReplayBuffer {
    /// `loss.replay_buffer_size`.
    pub max_size: usize,
    /// Kept groups, oldest first.
    groups: Vec<Arc<ReplayGroup>>,
}

/// What replay did to one step.
#[derive(Debug, Clone)]
pub struct Replay {
    /// The step as the loss trains on it, when a group was replaced: each replaced group's
    /// prompt ids, completions, model masks and advantages in place of the fresh ones (its
    /// other fields are the fresh step's), marked off-policy. `None`: the fresh step.
    pub trained: Option<Box<Scored>>,
    /// The replaced groups: `(group index in the step, step that generated the group put in
    /// its place)`.
    pub replaced: Vec<(usize, usize)>,
    /// The buffer after this step (what a checkpoint after it keeps).
    pub buffer: ReplayBuffer,
}

impl ReplayBuffer {
    /// An empty buffer of `max_size` groups.
    pub fn new(max_size: usize) -> Self {
        Self {
            max_size,
            groups: Vec::new(),
        }
    }

    /// Kept groups, oldest first.
    pub fn groups(&self) -> &[Arc<ReplayGroup>] {
        &self.groups
    }

    /// Keeps `group` if the buffer has room or its score beats the lowest kept one (TRL's
    /// min-heap: `score > min` replaces the min).
    pub fn add(&mut self, group: ReplayGroup) {
        if self.max_size == 0 || !group.score.is_finite() {
            return;
        }
        if self.groups.len() < self.max_size {
            self.groups.push(Arc::new(group));
            return;
        }
        // The first (oldest) of the lowest scores; every kept score is finite.
        let Some((worst, min)) = self
            .groups
            .iter()
            .map(|g| g.score)
            .enumerate()
            .min_by(|a, b| a.1.total_cmp(&b.1))
        else {
            return;
        };
        if group.score > min {
            self.groups.remove(worst);
            self.groups.push(Arc::new(group));
        }
    }

    /// `n` groups drawn with probability ∝ score: without replacement when the buffer holds
    /// at least `n`, else with replacement (TRL's `torch.multinomial`); none from an empty
    /// buffer. `rng` is the step's own stream.
    pub fn sample(&self, n: usize, rng: &mut grpo_data::rng::SeededRng) -> Vec<Arc<ReplayGroup>> {
        if self.groups.is_empty() {
            return Vec::new();
        }
        let replacement = n > self.groups.len();
        let mut left: Vec<f64> = self
            .groups
            .iter()
            .map(|g| if g.score > 0.0 { g.score } else { 0.0 })
            .collect();
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let total: f64 = left.iter().sum();
            let i = if total > 0.0 && total.is_finite() {
                let mut u = unit(rng) * total;
                let mut pick = left.iter().rposition(|&w| w > 0.0).unwrap_or(0);
                for (i, &w) in left.iter().enumerate() {
                    if w > 0.0 && u < w {
                        pick = i;
                        break;
                    }
                    u -= w;
                }
                pick
            } else {
                // No positive weight left: uniform over what is left.
                let open: Vec<usize> = match replacement {
                    true => (0..left.len()).collect(),
                    false => (0..left.len()).filter(|i| !out.contains(i)).collect(),
                };
                open[rng.below(open.len() as u64) as usize]
            };
            out.push(i);
            if !replacement {
                left[i] = 0.0;
            }
        }
        out.into_iter().map(|i| self.groups[i].clone()).collect()
    }

    /// Applies replay to a scored step of `g`-completion groups (after its advantages): keeps
    /// every group whose rewards vary, then puts a drawn group in the place of every group
    /// whose rewards are all equal. Returns what it did ([`Self::metrics`] reads it). The
    /// draw's stream is `seed`'s and the step's.
    pub fn replay(&mut self, s: &Scored, g: usize, seed: u64) -> Result<Replay> {
        let n = s.rollouts.completions.len();
        if g == 0 || !n.is_multiple_of(g) || s.advantages.len() != n {
            bail!("replay: {n} completions do not form groups of {g}");
        }
        let r = &s.rollouts;
        let masks = r.episodes.as_ref().map(|e| &e.model_masks);
        let mut flat = Vec::new();
        for gi in 0..n / g {
            let range = gi * g..(gi + 1) * g;
            // torch's std (n − 1) of the scored (non-NaN) rewards; NaN for fewer than two.
            let rewards: Vec<Option<f32>> = s.scores.rewards[range.clone()]
                .iter()
                .map(|&x| Some(x))
                .collect();
            let std = grpo_rewards::nan_std(&rewards);
            if std > 0.0 {
                let p = group_prompt(s, gi, g)?;
                let score = std
                    * s.advantages[range.clone()]
                        .iter()
                        .filter(|a| a.is_finite())
                        .map(|a| f64::from(a.abs()))
                        .sum::<f64>();
                self.add(ReplayGroup {
                    score,
                    step: r.batch.step,
                    row: r.batch.samples.get(p).map_or(0, |x| x.index),
                    prompt_ids: r.prompt_ids[p].clone(),
                    completions: r.completions[range.clone()].to_vec(),
                    model_masks: masks.map(|m| {
                        range
                            .clone()
                            .map(|i| m.get(i).cloned().unwrap_or_default())
                            .collect()
                    }),
                    advantages: s.advantages[range].to_vec(),
                });
            } else {
                flat.push(gi);
            }
        }
        let mut rng = grpo_data::rng::SeededRng::new(grpo_data::rng::mix(
            seed,
            0x7265_706c_6179,
            r.batch.step as u64,
        ));
        let drawn = match flat.is_empty() {
            true => Vec::new(),
            false => self.sample(flat.len(), &mut rng),
        };
        let mut replaced = Vec::with_capacity(drawn.len());
        let trained = match drawn.is_empty() {
            true => None,
            false => {
                let mut t = s.clone();
                t.replay = None;
                // Older versions sampled them: TRL's importance-sampling correction applies.
                t.rollouts.sampled_by_other_model = true;
                for (&gi, group) in flat.iter().zip(&drawn) {
                    put_group(&mut t, gi, g, group)?;
                    replaced.push((gi, group.step));
                }
                Some(Box::new(t))
            }
        };
        Ok(Replay {
            trained,
            replaced,
            buffer: self.clone(),
        })
    }

    /// Writes the buffer as `dir/replay_buffer.json`.
    pub fn save(&self, dir: &Path) -> Result<()> {
        let p = dir.join(REPLAY_FILE);
        std::fs::write(&p, serde_json::to_vec(self)?)
            .with_context(|| format!("{}: cannot write", p.display()))
    }

    /// Reads `dir/replay_buffer.json` for a run of `g`-completion groups and `max_size`
    /// (`loss.replay_buffer_size`): a smaller size keeps the best groups.
    pub fn load(dir: &Path, g: usize, max_size: usize) -> Result<Self> {
        let p = dir.join(REPLAY_FILE);
        let text = std::fs::read(&p).with_context(|| {
            format!(
                "{}: cannot read the replay buffer of this checkpoint",
                p.display()
            )
        })?;
        let saved: ReplayBuffer = serde_json::from_slice(&text)
            .with_context(|| format!("{}: not a replay buffer", p.display()))?;
        if let Some(x) = saved.groups.iter().find(|x| x.completions.len() != g) {
            bail!(
                "{}: a group of step {} has {} completions, this run's rollout.num_generations is {g}",
                p.display(),
                x.step,
                x.completions.len()
            );
        }
        let mut out = Self::new(max_size);
        for x in saved.groups {
            out.add(Arc::unwrap_or_clone(x));
        }
        Ok(out)
    }

    /// The `replay/*` metrics of a step's [`Replay`]: the groups replaced, the buffer's size
    /// and (when a group was replaced) the replayed groups' mean age in steps.
    pub fn metrics(step: usize, replay: &Replay) -> Vec<(String, f64)> {
        let mut m = vec![
            (
                "replay/replaced_groups".into(),
                replay.replaced.len() as f64,
            ),
            (
                "replay/buffer_groups".into(),
                replay.buffer.groups.len() as f64,
            ),
        ];
        if !replay.replaced.is_empty() {
            let age: f64 = replay
                .replaced
                .iter()
                .map(|&(_, from)| step.saturating_sub(from) as f64)
                .sum();
            m.push(("replay/mean_age".into(), age / replay.replaced.len() as f64));
        }
        m
    }
}

/// A uniform draw in [0, 1).
fn unit(rng: &mut grpo_data::rng::SeededRng) -> f64 {
    (rng.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
}

/// The prompt of group `gi`: every completion of the group has it, and none outside.
fn group_prompt(s: &Scored, gi: usize, g: usize) -> Result<usize> {
    let c = &s.rollouts.completions;
    let p = c[gi * g].prompt_index;
    let inside = c[gi * g..(gi + 1) * g].iter().all(|x| x.prompt_index == p);
    let outside = c
        .iter()
        .enumerate()
        .any(|(i, x)| i / g != gi && x.prompt_index == p);
    if !inside || outside || p >= s.rollouts.prompt_ids.len() {
        bail!("replay: group {gi} is not one prompt's {g} completions");
    }
    Ok(p)
}

/// Puts `group` in the place of group `gi` of `t`.
fn put_group(t: &mut Scored, gi: usize, g: usize, group: &ReplayGroup) -> Result<()> {
    if group.completions.len() != g || group.advantages.len() != g {
        bail!(
            "replay: a kept group of step {} has {} completions, the step's groups {g}",
            group.step,
            group.completions.len()
        );
    }
    let p = group_prompt(t, gi, g)?;
    t.rollouts.prompt_ids[p] = group.prompt_ids.clone();
    for (j, c) in group.completions.iter().enumerate() {
        let i = gi * g + j;
        t.rollouts.completions[i] = Completion {
            prompt_index: p,
            ..c.clone()
        };
        t.advantages[i] = group.advantages[j];
        if let Some(z) = t.zero_std.get_mut(i) {
            *z = false;
        }
    }
    let completions = &t.rollouts.completions;
    match (t.rollouts.episodes.as_mut(), &group.model_masks) {
        (Some(e), masks) => {
            // A completion without a mask is all the model's tokens.
            for c in completions.iter().skip(e.model_masks.len()) {
                e.model_masks.push(vec![true; c.token_ids.len()]);
            }
            for j in 0..g {
                let len = group.completions[j].token_ids.len();
                e.model_masks[gi * g + j] = masks
                    .as_ref()
                    .and_then(|m| m.get(j).cloned())
                    .unwrap_or_else(|| vec![true; len]);
            }
        }
        (None, Some(m)) if m.iter().flatten().any(|&x| !x) => bail!(
            "replay: a kept group of step {} is a multi-turn episode's, this step's are single-turn",
            group.step
        ),
        (None, _) => {}
    }
    Ok(())
}
