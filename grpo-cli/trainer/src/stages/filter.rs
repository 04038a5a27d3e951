//! DAPO's dynamic sampling (`[loss.filter_groups]`, verl's `algorithm.filter_groups`): the
//! scorer keeps, of each generation batch, the groups whose metric is not the same for every
//! completion, and closes a step once it has `train.prompts_per_step` of them (the first ones
//! kept, in the order drawn; the rest of the last batch is dropped, as verl does). The
//! advantages are formed on the closed step.
//!
//! A step's rewards metrics describe the groups it trains on; `filter_groups/*` describe what
//! was drawn for it.

use std::collections::BTreeMap;

use anyhow::{Result, bail};
use grpo_rewards::{ScoredBatch, nan_mean, nan_std};

use super::{EpisodeBatch, GreedyBaselines, Rollouts};
use crate::config::FilterGroupsSection;

/// Whether each group of `g` values is kept: its values (NaN = unscored, left out) are not all
/// equal, or the group has one completion (verl keeps those). A group with no value is dropped.
pub fn kept_groups(values: &[f64], g: usize) -> Vec<bool> {
    values
        .chunks(g.max(1))
        .map(|group| {
            if g == 1 {
                return true;
            }
            let mut seen = group.iter().filter(|v| !v.is_nan());
            match seen.next() {
                Some(first) => seen.any(|v| v != first),
                None => false,
            }
        })
        .collect()
}

/// Each completion's value of `metric`: `reward` (the combined reward), a reward's name (its
/// score), else the number the rewards logged under that name for it (NaN where none did).
pub fn metric_values(s: &ScoredBatch, metric: &str) -> Result<Vec<f64>> {
    if metric == "reward" {
        return Ok(s.rewards.iter().map(|&r| f64::from(r)).collect());
    }
    if let Some(k) = s.names.iter().position(|n| n == metric) {
        return Ok(s.per_function[k]
            .iter()
            .map(|v| v.map_or(f64::NAN, f64::from))
            .collect());
    }
    let logged = |i: usize| -> Option<f64> {
        s.info.iter().find_map(|col| {
            let v = col.get(i)?.as_ref()?.get(metric)?;
            v.as_f64()
                .or_else(|| v.as_bool().map(|b| f64::from(u8::from(b))))
        })
    };
    let values: Vec<f64> = (0..s.rewards.len())
        .map(|i| logged(i).unwrap_or(f64::NAN))
        .collect();
    if !values.is_empty() && values.iter().all(|v| v.is_nan()) {
        bail!(
            "loss.filter_groups.metric `{metric}` is not `reward`, a reward's name ({}) nor a number any reward logged for the step's completions",
            s.names.join(", ")
        );
    }
    Ok(values)
}

/// The groups kept so far for the step being filled, and what was drawn for it.
#[derive(Debug)]
pub struct GroupFilter {
    cfg: FilterGroupsSection,
    /// Groups a step trains on.
    prompts: usize,
    /// Completions per group.
    g: usize,
    /// The step being filled.
    step: usize,
    kept: Option<(Rollouts, ScoredBatch)>,
    /// Generation batches drawn for the step.
    draws: usize,
    /// Groups drawn for the step, and of them whose metric differs.
    groups: (usize, usize),
    /// The combined rewards of every completion drawn for the step.
    drawn_rewards: Vec<Option<f32>>,
    /// Counters of the rewards (failures, retries...) summed over the step's batches.
    counters: BTreeMap<String, f64>,
    /// The episodes' metrics of the step's batches: per key, the sum and the batches.
    episode_metrics: BTreeMap<String, (f64, usize)>,
}

impl GroupFilter {
    /// Steps of `prompts` groups of `g` completions, the first being `step`.
    pub fn new(cfg: &FilterGroupsSection, prompts: usize, g: usize, step: usize) -> Self {
        Self {
            cfg: cfg.clone(),
            prompts,
            g,
            step,
            kept: None,
            draws: 0,
            groups: (0, 0),
            drawn_rewards: Vec::new(),
            counters: BTreeMap::new(),
            episode_metrics: BTreeMap::new(),
        }
    }

    /// The step being filled.
    pub fn step(&self) -> usize {
        self.step
    }

    /// Takes a scored generation batch; returns the step once it has its groups.
    pub fn push(&mut self, r: Rollouts, s: ScoredBatch) -> Result<Option<(Rollouts, ScoredBatch)>> {
        let g = self.g;
        let keep = kept_groups(&metric_values(&s, &self.cfg.metric)?, g);
        self.draws += 1;
        self.groups.0 += keep.len();
        self.groups.1 += keep.iter().filter(|&&k| k).count();
        for (k, v) in r.episodes.iter().flat_map(|e| &e.metrics) {
            let e = self.episode_metrics.entry(k.clone()).or_insert((0.0, 0));
            *e = (e.0 + v, e.1 + 1);
        }
        self.drawn_rewards
            .extend(s.rewards.iter().map(|&r| Some(r).filter(|r| !r.is_nan())));
        for (k, v) in &s.metrics {
            if !is_reward_stat(k) {
                *self.counters.entry(k.clone()).or_insert(0.0) += v;
            }
        }
        let have = self.kept.as_ref().map_or(0, |(r, _)| r.batch.samples.len());
        let groups: Vec<usize> = (0..keep.len())
            .filter(|&p| keep[p])
            .take(self.prompts - have)
            .collect();
        let part = select(&r, &s, &groups, g)?;
        let (mut r, mut s) = match self.kept.take() {
            None => part,
            Some(acc) => append(acc, part),
        };
        let have = r.batch.samples.len();
        if have < self.prompts {
            let limit = self.cfg.max_num_gen_batches;
            if limit > 0 && self.draws >= limit {
                bail!(
                    "loss.filter_groups: step {} drew {} generation batches (max_num_gen_batches = {limit}) and kept {have} of its {} groups whose `{}` differs; raise max_num_gen_batches (0: no limit), or check that the prompts are neither all solved nor all failed",
                    self.step + 1,
                    self.draws,
                    self.prompts,
                    self.cfg.metric
                );
            }
            self.kept = Some((r, s));
            return Ok(None);
        }
        // The step: its kept groups' reward statistics, the counters of all it drew.
        r.batch.step = self.step;
        if let Some(e) = r.episodes.as_mut() {
            e.metrics = std::mem::take(&mut self.episode_metrics)
                .into_iter()
                .map(|(k, (sum, n))| (k, sum / n.max(1) as f64))
                .collect();
        }
        for (k, col) in s.names.iter().zip(&s.per_function) {
            s.metrics.insert(format!("rewards/{k}/mean"), nan_mean(col));
            s.metrics.insert(format!("rewards/{k}/std"), nan_std(col));
        }
        s.metrics.extend(std::mem::take(&mut self.counters));
        s.metrics
            .insert("filter_groups/num_gen_batches".into(), self.draws as f64);
        s.metrics.insert(
            "filter_groups/kept_ratio".into(),
            self.groups.1 as f64 / self.groups.0.max(1) as f64,
        );
        s.metrics.insert(
            "filter_groups/reward_drawn_mean".into(),
            nan_mean(&self.drawn_rewards),
        );
        self.step += 1;
        self.draws = 0;
        self.groups = (0, 0);
        self.drawn_rewards.clear();
        Ok(Some((r, s)))
    }
}

/// A per-function statistic the step recomputes (`rewards/{name}/mean|std`), not a counter.
fn is_reward_stat(key: &str) -> bool {
    key.starts_with("rewards/") && (key.ends_with("/mean") || key.ends_with("/std"))
}

/// Groups `groups` (prompt indices) of a scored batch, in that order, their completions'
/// prompt indices renumbered.
fn select(
    r: &Rollouts,
    s: &ScoredBatch,
    groups: &[usize],
    g: usize,
) -> Result<(Rollouts, ScoredBatch)> {
    let rows: Vec<usize> = groups.iter().flat_map(|&p| p * g..(p + 1) * g).collect();
    let mut completions = Vec::with_capacity(rows.len());
    for (new, &p) in groups.iter().enumerate() {
        for c in &r.completions[p * g..(p + 1) * g] {
            if c.prompt_index != p {
                bail!(
                    "loss.filter_groups: completion of prompt {} where prompt {p}'s group was expected",
                    c.prompt_index
                );
            }
            let mut c = c.clone();
            c.prompt_index = new;
            completions.push(c);
        }
    }
    let pick = |v: &[String]| -> Vec<String> { groups.iter().map(|&p| v[p].clone()).collect() };
    let episodes = r.episodes.as_ref().map(|e| {
        let rows_of = |v: &[usize]| -> Vec<usize> {
            rows.iter()
                .map(|&i| v.get(i).copied().unwrap_or(0))
                .collect()
        };
        EpisodeBatch {
            model_masks: rows.iter().map(|&i| e.model_masks[i].clone()).collect(),
            rewards: rows.iter().map(|&i| e.rewards[i]).collect(),
            messages: rows.iter().map(|&i| e.messages[i].clone()).collect(),
            metadata: rows.iter().map(|&i| e.metadata[i].clone()).collect(),
            // Materialised per completion, so batches of either kind concatenate.
            prompt_texts: rows.iter().map(|&i| r.prompt_text(i).to_string()).collect(),
            prompt_messages: match e.prompt_messages.is_empty() {
                true => Vec::new(),
                false => rows.iter().map(|&i| e.prompt_messages[i].clone()).collect(),
            },
            own_prompt_tokens: rows_of(&e.own_prompt_tokens),
            metrics: e.metrics.clone(),
        }
    });
    let greedy = r.greedy.as_ref().map(|gb| GreedyBaselines {
        completions: groups
            .iter()
            .enumerate()
            .map(|(new, &p)| {
                let mut c = gb.completions[p].clone();
                c.prompt_index = new;
                c
            })
            .collect(),
        rewards: groups.iter().map(|&p| gb.rewards[p]).collect(),
    });
    let mut batch = r.batch.clone();
    batch.samples = groups.iter().map(|&p| r.batch.samples[p].clone()).collect();
    let rollouts = Rollouts {
        batch,
        prompt_texts: pick(&r.prompt_texts),
        prompt_ids: groups.iter().map(|&p| r.prompt_ids[p].clone()).collect(),
        completions,
        version: r.version,
        weights: r.weights.clone(),
        seconds: r.seconds,
        teaching: r
            .teaching
            .as_ref()
            .map(|t| groups.iter().map(|&p| t[p].clone()).collect()),
        sampled_by_other_model: r.sampled_by_other_model,
        episodes,
        source: r.source,
        greedy,
    };
    let scores = ScoredBatch {
        names: s.names.clone(),
        per_function: s
            .per_function
            .iter()
            .map(|col| rows.iter().map(|&i| col[i]).collect())
            .collect(),
        info: s
            .info
            .iter()
            .map(|col| {
                rows.iter()
                    .map(|&i| col.get(i).cloned().flatten())
                    .collect()
            })
            .collect(),
        rewards: rows.iter().map(|&i| s.rewards[i]).collect(),
        metrics: BTreeMap::new(),
    };
    Ok((rollouts, scores))
}

/// `acc` followed by `part` (a later batch): its groups after, the later batch's position
/// and draw, the oldest policy version, the seconds of both.
fn append(acc: (Rollouts, ScoredBatch), part: (Rollouts, ScoredBatch)) -> (Rollouts, ScoredBatch) {
    let ((mut r, mut s), (p, ps)) = (acc, part);
    let offset = r.batch.samples.len();
    r.batch.samples.extend(p.batch.samples);
    r.batch.position = p.batch.position;
    r.batch.draw = p.batch.draw;
    r.prompt_texts.extend(p.prompt_texts);
    r.prompt_ids.extend(p.prompt_ids);
    r.completions.extend(p.completions.into_iter().map(|mut c| {
        c.prompt_index += offset;
        c
    }));
    r.version = r.version.min(p.version);
    r.weights = p.weights;
    r.seconds += p.seconds;
    r.teaching = match (r.teaching.take(), p.teaching) {
        (Some(mut a), Some(b)) => {
            a.extend(b);
            Some(a)
        }
        _ => None,
    };
    r.sampled_by_other_model |= p.sampled_by_other_model;
    r.episodes = match (r.episodes.take(), p.episodes) {
        (Some(mut a), Some(b)) => {
            a.model_masks.extend(b.model_masks);
            a.rewards.extend(b.rewards);
            a.messages.extend(b.messages);
            a.metadata.extend(b.metadata);
            a.prompt_texts.extend(b.prompt_texts);
            a.prompt_messages = match (a.prompt_messages.is_empty(), b.prompt_messages.is_empty()) {
                (false, false) => {
                    a.prompt_messages.extend(b.prompt_messages);
                    a.prompt_messages
                }
                _ => Vec::new(),
            };
            a.own_prompt_tokens.extend(b.own_prompt_tokens);
            Some(a)
        }
        (a, b) => a.or(b),
    };
    r.greedy = match (r.greedy.take(), p.greedy) {
        (Some(mut a), Some(b)) => {
            a.completions.extend(b.completions.into_iter().map(|mut c| {
                c.prompt_index += offset;
                c
            }));
            a.rewards.extend(b.rewards);
            Some(a)
        }
        (a, b) => a.or(b),
    };
    for (k, col) in s.per_function.iter_mut().enumerate() {
        col.extend(ps.per_function[k].iter().copied());
    }
    for (k, col) in s.info.iter_mut().enumerate() {
        col.extend(ps.info[k].iter().cloned());
    }
    s.rewards.extend(ps.rewards);
    (r, s)
}
