//! Batch assembly: a step's completions as micro-batches of token rows and loss masks, and
//! their per-token log-probs under a model ([`completion_logps`]).

use std::collections::HashMap;

use anyhow::Result;
use candle_core::{Device, Tensor};
use grpo_rollout::model::TokenStats;
use grpo_rollout::{FinishReason, Transformer};

use crate::stages::Scored;

/// One GRPO step's completions, cut into micro-batches.
#[derive(Debug)]
pub struct StepBatch<'a> {
    /// Each completion's prompt ids.
    pub prompts: Vec<&'a [u32]>,
    /// Each completion's ids.
    pub completions: Vec<&'a [u32]>,
    /// Completion lengths.
    pub lens: Vec<usize>,
    /// Per completion, per token: the model's token (multi-turn episodes: environment tokens
    /// are false); `None` = every token is the model's.
    pub model_masks: Vec<Option<&'a [bool]>>,
    /// Model tokens of each completion (`lens` for single-turn completions).
    pub model_lens: Vec<usize>,
    /// Whether a completion carries loss (not a masked truncation, not in a dropped group).
    pub keep: Vec<bool>,
    /// Loss tokens of the whole step (dapo's `num_items_in_batch`).
    pub total_tokens: usize,
    /// Micro-batches as `[a, b)` ranges of completions.
    pub chunks: Vec<(usize, usize)>,
    /// The micro-batches of each optimizer update (ranges of `chunks`), set by
    /// [`Self::planned`]; one update of them all before.
    pub updates: Vec<std::ops::Range<usize>>,
    /// Whether the micro-batches were formed by a token budget (unequal sizes: each weighs
    /// its share of its update's completions).
    pub budgeted: bool,
}

impl<'a> StepBatch<'a> {
    /// The micro-batches of `micro` completions of a scored step; `mask_truncated` drops
    /// completions cut at the length limit (TRL's `mask_truncated_completions`).
    pub fn new(s: &'a Scored, eos: &[u32], micro: usize, mask_truncated: bool) -> Self {
        let r = &s.rollouts;
        let n = r.completions.len();
        let prompts = r
            .completions
            .iter()
            .map(|c| r.prompt_ids[c.prompt_index].as_slice())
            .collect();
        let completions = r
            .completions
            .iter()
            .map(|c| c.token_ids.as_slice())
            .collect();
        let keep: Vec<bool> = r
            .completions
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let truncated = c.finish_reason == FinishReason::Length
                    && c.token_ids.last().is_none_or(|t| !eos.contains(t));
                let masked = mask_truncated && truncated;
                !masked && !s.zero_std[i]
            })
            .collect();
        let lens: Vec<usize> = r.completions.iter().map(|c| c.token_ids.len()).collect();
        let model_masks: Vec<Option<&[bool]>> = match &r.episodes {
            Some(e) => (0..n)
                .map(|i| e.model_masks.get(i).map(Vec::as_slice))
                .collect(),
            None => vec![None; n],
        };
        let model_lens: Vec<usize> = (0..n)
            .map(|i| match model_masks[i] {
                Some(m) => m.iter().take(lens[i]).filter(|&&x| x).count(),
                None => lens[i],
            })
            .collect();
        let total_tokens = (0..n).filter(|&i| keep[i]).map(|i| model_lens[i]).sum();
        let chunks: Vec<(usize, usize)> = (0..n)
            .step_by(micro.max(1))
            .map(|a| (a, (a + micro).min(n)))
            .collect();
        let updates = std::iter::once(0..chunks.len()).collect();
        Self {
            prompts,
            completions,
            lens,
            model_masks,
            model_lens,
            keep,
            total_tokens,
            chunks,
            updates,
            budgeted: false,
        }
    }

    /// The micro-batches cut into `updates` optimizer updates (TRL's `steps_per_generation`).
    /// Without a budget the micro-batches stay as they are and each update takes an equal
    /// count of them. With `token_budget`, each update takes an equal share of the
    /// completions, and its micro-batches are re-formed from them: as many consecutive
    /// completions as keep `rows × (longest prompt + longest completion)` within the budget (a
    /// completion over it alone).
    pub fn planned(mut self, updates: usize, token_budget: Option<usize>) -> Self {
        let updates = updates.max(1);
        let Some(budget) = token_budget else {
            let per = self.chunks.len().div_ceil(updates).max(1);
            let k = self.chunks.len();
            self.updates = (0..updates)
                .map(|u| (u * per).min(k)..((u + 1) * per).min(k))
                .collect();
            return self;
        };
        let n = self.completions.len();
        let per = n.div_ceil(updates).max(1);
        let prompt_lens: Vec<usize> = self.prompts.iter().map(|p| p.len()).collect();
        let (mut chunks, mut ranges) = (Vec::new(), Vec::with_capacity(updates));
        for u in 0..updates {
            let first = chunks.len();
            let span = (u * per).min(n)..((u + 1) * per).min(n);
            chunks.extend(budget_chunks(&prompt_lens, &self.lens, span, budget));
            ranges.push(first..chunks.len());
        }
        self.chunks = chunks;
        self.updates = ranges;
        self.budgeted = true;
        self
    }

    /// The completion mask `(b − a, c)` of micro-batch `[a, b)` padded to `c` tokens: 1 on the
    /// tokens that carry loss (0 on padding, on dropped completions and on an episode's
    /// environment tokens). It multiplies the per-token loss, the KL to the reference and the
    /// log-ratios of the importance weights, so environment tokens weigh exactly 0.
    pub fn mask(&self, a: usize, b: usize, c: usize, device: &Device) -> Result<Tensor> {
        let mut m = Vec::with_capacity((b - a) * c);
        for i in a..b {
            let k = if self.keep[i] { self.lens[i] } else { 0 };
            let model = self.model_masks[i];
            m.extend((0..c).map(|j| {
                let is_model = model.is_none_or(|mm| mm.get(j).copied().unwrap_or(false));
                if j < k && is_model { 1f32 } else { 0f32 }
            }));
        }
        Ok(Tensor::from_vec(m, (b - a, c), device)?)
    }
}

/// Completions `span` cut into consecutive micro-batches `[a, b)` whose padded size,
/// `(b − a) × (longest prompt + longest completion)`, stays within `budget` tokens; a
/// completion over the budget makes a micro-batch alone.
pub fn budget_chunks(
    prompt_lens: &[usize],
    lens: &[usize],
    span: std::ops::Range<usize>,
    budget: usize,
) -> Vec<(usize, usize)> {
    let mut out = Vec::new();
    let mut a = span.start;
    while a < span.end {
        let (mut p, mut c) = (prompt_lens[a], lens[a]);
        let mut b = a + 1;
        while b < span.end {
            let (p2, c2) = (p.max(prompt_lens[b]), c.max(lens[b]));
            if (b + 1 - a) * (p2 + c2) > budget {
                break;
            }
            (p, c) = (p2, c2);
            b += 1;
        }
        out.push((a, b));
        a = b;
    }
    out
}

/// The model inputs of `completions` after `prompts`: the distinct prompts once and the
/// completions after them when prompts repeat (each prompt's forward shared by its
/// completions), else one left-padded batch.
enum CompletionInputs {
    Shared {
        prompts: Tensor,
        prompt_mask: Tensor,
        prompt_of: Vec<u32>,
        completions: Tensor,
        completion_mask: Tensor,
    },
    Padded {
        ids: Tensor,
        mask: Tensor,
    },
}

fn completion_inputs(
    model: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
) -> Result<(CompletionInputs, usize)> {
    let (p, c) = widths(prompts, completions);
    let b = prompts.len();
    let device = model.device();
    let mut distinct: Vec<&[u32]> = Vec::new();
    let mut index: HashMap<&[u32], u32> = HashMap::new();
    let prompt_of: Vec<u32> = prompts
        .iter()
        .map(|pr| {
            *index.entry(pr).or_insert_with(|| {
                distinct.push(pr);
                (distinct.len() - 1) as u32
            })
        })
        .collect();
    // Rows padded to `width`: prompts on the left, completions on the right.
    let push = |ids: &mut Vec<u32>, mask: &mut Vec<u32>, row: &[u32], width: usize, left: bool| {
        let fill = width - row.len();
        if left {
            ids.extend(std::iter::repeat_n(pad, fill));
            mask.extend(std::iter::repeat_n(0u32, fill));
        }
        ids.extend(row);
        mask.extend(std::iter::repeat_n(1u32, row.len()));
        if !left {
            ids.extend(std::iter::repeat_n(pad, fill));
            mask.extend(std::iter::repeat_n(0u32, fill));
        }
    };
    if distinct.len() < b && prompts.iter().all(|pr| !pr.is_empty()) {
        let u = distinct.len();
        let (mut pids, mut pmask) = (Vec::with_capacity(u * p), Vec::with_capacity(u * p));
        for pr in &distinct {
            push(&mut pids, &mut pmask, pr, p, true);
        }
        let (mut cids, mut cmask) = (Vec::with_capacity(b * c), Vec::with_capacity(b * c));
        for co in completions {
            push(&mut cids, &mut cmask, co, c, false);
        }
        let inputs = CompletionInputs::Shared {
            prompts: Tensor::from_vec(pids, (u, p), device)?,
            prompt_mask: Tensor::from_vec(pmask, (u, p), device)?,
            prompt_of,
            completions: Tensor::from_vec(cids, (b, c), device)?,
            completion_mask: Tensor::from_vec(cmask, (b, c), device)?,
        };
        return Ok((inputs, c));
    }
    let (ids, mask, c) = padded_batch(pad, prompts, completions, device)?;
    Ok((CompletionInputs::Padded { ids, mask }, c))
}

/// Per-token log-probabilities (and entropies with `with_entropy`) of `completions` after
/// `prompts` under `model`, left-padded with `pad` into one batch: `(logps, entropies, width)`.
pub fn completion_logps(
    model: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    temperature: f64,
    with_entropy: bool,
) -> Result<(Tensor, Option<Tensor>, usize)> {
    let (inputs, c) = completion_inputs(model, pad, prompts, completions)?;
    let (lp, ent) = match &inputs {
        CompletionInputs::Shared {
            prompts,
            prompt_mask,
            prompt_of,
            completions,
            completion_mask,
        } => model.shared_prompt_logprobs(
            prompts,
            prompt_mask,
            prompt_of,
            completions,
            completion_mask,
            temperature,
            with_entropy,
        )?,
        CompletionInputs::Padded { ids, mask } => {
            model.completion_logprobs(ids, mask, c, temperature, with_entropy)?
        }
    };
    Ok((lp, ent, c))
}

/// [`completion_logps`] at temperature 1 with each token's entropy, whether it is the model's
/// most likely token and its mean logit (`TokenStats`, no gradient beside the log-probs) and
/// the width: the inputs of TRL's `entropy`, `mean_token_accuracy` and `logits/*` metrics.
pub fn completion_stats(
    model: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
) -> Result<(TokenStats, usize)> {
    let (inputs, c) = completion_inputs(model, pad, prompts, completions)?;
    let stats = match &inputs {
        CompletionInputs::Shared {
            prompts,
            prompt_mask,
            prompt_of,
            completions,
            completion_mask,
        } => model.shared_prompt_stats(
            prompts,
            prompt_mask,
            prompt_of,
            completions,
            completion_mask,
        )?,
        CompletionInputs::Padded { ids, mask } => model.completion_stats(ids, mask, c)?,
    };
    Ok((stats, c))
}

/// The combined reward of each of `n` completions, an unscored one (NaN, or missing) as 0: TRL's
/// `nansum` in its online trainers.
pub fn rewards_or_zero(rewards: &[f32], n: usize) -> Vec<f64> {
    (0..n)
        .map(|i| match rewards.get(i) {
            Some(v) if !v.is_nan() => f64::from(*v),
            _ => 0.0,
        })
        .collect()
}

impl crate::learner::Learner {
    /// The step batch of `s` for the learners that train on single-turn completions against
    /// the frozen reference (online DPO, A*-PO; `what` names it in errors), and the reference.
    pub(crate) fn single_turn_batch<'s>(
        &self,
        s: &'s Scored,
        what: &str,
    ) -> Result<(StepBatch<'s>, Transformer)> {
        if s.rollouts.episodes.is_some() {
            anyhow::bail!("{what} trains on single-turn completions, not environment episodes");
        }
        let eos = &self.tokenizer.eos_token_ids;
        let batch = StepBatch::new(s, eos, self.cfg.micro_batch(), false);
        let reference = self
            .reference
            .clone()
            .ok_or_else(|| anyhow::anyhow!("{what} needs the reference model"))?;
        Ok((batch, reference))
    }
}

/// Micro-batch `[a, b)`'s summed completion log-probs `(b − a,)` under `policy` (with its
/// graph) and under `reference` (detached), from the raw logits as TRL's online trainers score
/// them (no sampling temperature), every completion token counted.
pub fn summed_policy_and_reference(
    policy: &Transformer,
    reference: &Transformer,
    pad: u32,
    batch: &StepBatch<'_>,
    (a, b): (usize, usize),
) -> Result<(Tensor, Tensor)> {
    let (p, c) = (&batch.prompts[a..b], &batch.completions[a..b]);
    let (lp, rlp) = policy_and_reference_logps(policy, reference, pad, p, c)?;
    Ok((
        lp.sum(candle_core::D::Minus1)?,
        rlp.sum(candle_core::D::Minus1)?,
    ))
}

/// The per-token log-probs `(n, width)` of `completions` after `prompts` under `policy` (with
/// its graph) and under `reference` (detached, in the policy's dtype), from the raw logits,
/// 0 past each completion's end.
pub fn policy_and_reference_logps(
    policy: &Transformer,
    reference: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
) -> Result<(Tensor, Tensor)> {
    let (lp, _, width) = completion_logps(policy, pad, prompts, completions, 1.0, false)?;
    let (rlp, _, _) = completion_logps(reference, pad, prompts, completions, 1.0, false)?;
    let mut m = Vec::with_capacity(completions.len() * width);
    for x in completions {
        m.extend((0..width).map(|j| f32::from(u8::from(j < x.len()))));
    }
    let mask =
        Tensor::from_vec(m, (completions.len(), width), lp.device())?.to_dtype(lp.dtype())?;
    let rlp = rlp.detach().to_dtype(lp.dtype())?;
    Ok(((&lp * &mask)?, (&rlp * &mask)?))
}

/// [`completion_stats`] (padded) with `log Σ_v p_v²` of each token's distribution (no
/// gradient), for WPO's weights: `(stats, log_sum_sq, width)`.
pub fn completion_logps_and_sum_sq(
    model: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
) -> Result<(TokenStats, Tensor, usize)> {
    let (ids, mask, c) = padded_batch(pad, prompts, completions, model.device())?;
    let (stats, sum_sq) = model.completion_stats_and_sum_sq(&ids, &mask, c)?;
    Ok((stats, sum_sq, c))
}

/// The longest prompt and the longest completion (at least 1).
fn widths(prompts: &[&[u32]], completions: &[&[u32]]) -> (usize, usize) {
    let p = prompts.iter().map(|x| x.len()).max().unwrap_or(0);
    let c = completions.iter().map(|x| x.len()).max().unwrap_or(0);
    (p, c.max(1))
}

/// Each prompt left-padded to the longest, each completion right-padded to the longest after
/// it: ids and attention mask `(B, P + C)`, and `C` (at least 1).
pub(crate) fn padded_batch(
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    device: &Device,
) -> Result<(Tensor, Tensor, usize)> {
    let (p, c) = widths(prompts, completions);
    let b = prompts.len();
    let mut ids = Vec::with_capacity(b * (p + c));
    let mut mask = Vec::with_capacity(b * (p + c));
    for (pr, co) in prompts.iter().zip(completions) {
        let fill = p - pr.len();
        ids.extend(std::iter::repeat_n(pad, fill));
        mask.extend(std::iter::repeat_n(0u32, fill));
        ids.extend(*pr);
        mask.extend(std::iter::repeat_n(1u32, pr.len()));
        ids.extend(*co);
        mask.extend(std::iter::repeat_n(1u32, co.len()));
        ids.extend(std::iter::repeat_n(pad, c - co.len()));
        mask.extend(std::iter::repeat_n(0u32, c - co.len()));
    }
    Ok((
        Tensor::from_vec(ids, (b, p + c), device)?,
        Tensor::from_vec(mask, (b, p + c), device)?,
        c,
    ))
}

/// The log-probs `(B, width)` a server gives of `completions` after `prompts` (`echo`: one
/// request; `use_adapter`: its synced adapter's, else its base model's), 0 past each
/// completion's end: a teacher on a server.
pub(crate) fn served_logps(
    server: &std::sync::Mutex<grpo_rollout::remote::RemoteGenerator>,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    width: usize,
    use_adapter: bool,
    device: &Device,
) -> Result<Tensor> {
    let seqs = joined(prompts, completions);
    let lps = server
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .prompt_logprobs(&seqs, use_adapter)?;
    let mut out = Vec::with_capacity(seqs.len() * width);
    for (row, x) in lps.iter().zip(completions) {
        // The last `len(x)` entries score the completion's tokens.
        let tail = &row[row.len() - x.len()..];
        out.extend((0..width).map(|j| tail.get(j).copied().unwrap_or(0.0)));
    }
    Ok(Tensor::from_vec(out, (seqs.len(), width), device)?)
}

/// What a server gives of `completions` after `prompts` at each completion position, as
/// `(B·width)` rows ([`grpo_core::distill::ServedRows`]): its `top` most likely tokens with
/// their log-probs (`−inf` past what it gave) and its log-prob of the completion's token; past
/// a completion's end a placeholder (the top token id 0 at log-prob 0, the own token's 0) that
/// the loss mask drops. A teacher on a server for the `jsd` objective.
pub(crate) fn served_rows(
    server: &std::sync::Mutex<grpo_rollout::remote::RemoteGenerator>,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    width: usize,
    top: usize,
    device: &Device,
) -> Result<grpo_core::distill::ServedRows> {
    let seqs = joined(prompts, completions);
    let scores = server
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .prompt_top_logprobs(&seqs, top as u32, false)?;
    let n = seqs.len() * width;
    let (mut ids, mut lps, mut actual) = (
        Vec::with_capacity(n * top),
        Vec::with_capacity(n * top),
        Vec::with_capacity(n),
    );
    for (row, x) in scores.iter().zip(completions) {
        // The last `len(x)` positions score the completion's tokens.
        let skip = row.logprobs.len() - x.len();
        for j in 0..width {
            let Some(&own) = row.logprobs.get(skip + j).filter(|_| j < x.len()) else {
                ids.extend(std::iter::repeat_n(0u32, top));
                lps.push(0.0f32);
                lps.extend(std::iter::repeat_n(f32::NEG_INFINITY, top - 1));
                actual.push(0.0f32);
                continue;
            };
            let given = &row.top[skip + j];
            if given.is_empty() {
                anyhow::bail!(
                    "the teacher server gave no top log-probs at completion token {j} of a \
                     sequence of {} tokens",
                    row.logprobs.len() + 1
                );
            }
            for k in 0..top {
                let (id, lp) = given.get(k).copied().unwrap_or((0, f32::NEG_INFINITY));
                ids.push(id);
                lps.push(lp);
            }
            actual.push(own);
        }
    }
    Ok(grpo_core::distill::ServedRows {
        top_ids: Tensor::from_vec(ids, (n, top), device)?,
        top_logps: Tensor::from_vec(lps, (n, top), device)?,
        actual: Tensor::from_vec(actual, n, device)?,
    })
}

/// Each prompt followed by its completion.
fn joined(prompts: &[&[u32]], completions: &[&[u32]]) -> Vec<Vec<u32>> {
    prompts
        .iter()
        .zip(completions)
        .map(|(p, x)| p.iter().chain(x.iter()).copied().collect())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::budget_chunks;
    use proptest::prelude::*;

    #[test]
    fn budget_chunks_pack_consecutive_completions_within_the_budget() {
        // Padded sizes: rows × (longest prompt + longest completion).
        let prompts = [4, 4, 4, 4, 4, 4];
        let lens = [2, 6, 1, 30, 3, 3];
        assert_eq!(
            budget_chunks(&prompts, &lens, 0..6, 20),
            // [0,2): 2 × 10 = 20; 2 more would be 3 × 10; 30 + 4 alone over; [4,6): 2 × 7.
            vec![(0, 2), (2, 3), (3, 4), (4, 6)]
        );
        assert_eq!(budget_chunks(&prompts, &lens, 2..5, 1000), vec![(2, 5)]);
        assert_eq!(budget_chunks(&prompts, &lens, 3..3, 10), vec![]);
    }

    proptest! {
        /// The micro-batches tile the span in order; each is within the budget or a single
        /// completion, and no two neighbours could have been one.
        #[test]
        fn budget_chunks_tile_the_span(
            rows in proptest::collection::vec((1usize..20, 0usize..40), 1..40),
            budget in 1usize..200,
        ) {
            let (p, l): (Vec<usize>, Vec<usize>) = rows.into_iter().unzip();
            let n = p.len();
            let chunks = budget_chunks(&p, &l, 0..n, budget);
            let size = |a: usize, b: usize| {
                (b - a) * (p[a..b].iter().max().unwrap() + l[a..b].iter().max().unwrap())
            };
            let mut at = 0;
            for &(a, b) in &chunks {
                prop_assert_eq!(a, at);
                prop_assert!(b > a);
                prop_assert!(b - a == 1 || size(a, b) <= budget);
                if b < n {
                    prop_assert!(size(a, b + 1) > budget);
                }
                at = b;
            }
            prop_assert_eq!(at, n);
        }
    }
}
