//! SFT, DPO, KTO, ORPO, CPO and reward models on the GRPO learner: the same optimizer, schedule, gradient accumulation and
//! clipping, run directory, metrics, progress, checkpoints and exact resume; only the step's
//! loss differs (grpo-core's `preference` module).
//!
//! A step takes `train.prompts_per_step` rows from the data stream:
//! * SFT: prompt + completion (`sft.completion_field`, EOS appended), the loss on the completion
//!   tokens only; or a conversation whose assistant turns carry the loss.
//! * DPO: prompt + `dpo.chosen_field` / `dpo.rejected_field`, each completion's summed log-prob
//!   under the policy and the frozen reference.
//! * KTO: prompt + `kto.completion_field` + `kto.label_field`, the completion's summed log-prob
//!   under both, and the micro-batch's KL estimate from mismatched prompt/completion pairs.
//! * Reward: prompt + `reward.chosen_field` / `reward.rejected_field` as two whole sequences,
//!   each scored by the classifier's `score` head (TRL's RewardTrainer, Bradley-Terry loss).
//! * PRM: prompt + steps (`prm.completions_field`) with a label per step (`prm.labels_field`),
//!   one sequence labelled at each step's last token by the token classifier (TRL's
//!   experimental PRMTrainer, cross-entropy).
//! * ORPO and CPO: prompt + chosen / rejected as TRL's experimental trainers tokenise them,
//!   the policy's log-probs alone (no reference model) and an NLL term on the chosen side;
//!   TPO: DPO's rows with a third, gold completion that carries the NLL term.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::{D, DType, Tensor};
use grpo_core::preference::{
    DpoInputs, bco_loss_weighted, dpo_loss_with, kto_loss, sft_loss_typed,
};
use grpo_data::{Prompt, Sample};

use super::Learner;
use super::batch::{completion_logps, completion_logps_and_sum_sq, completion_stats};
use crate::callbacks::{Callbacks, Metrics};
use crate::config::{Algorithm, PackingStrategy};
use crate::optim::clip_grad_norm;
use crate::pipeline::{RunOptions, TrainingResult};
use crate::setup::Setup;
use crate::stages::{Loader, Stage, chat_messages};
use crate::step_end::StepEnd;
use grpo_rollout::model::TokenStats;

/// One tokenised row: the prompt, the completion(s) and, per completion token, whether it
/// carries the loss. `Default`: empty, desirable, one sequence, no margin.
#[derive(Debug, Clone)]
pub struct Row {
    /// The row's index in the dataset (for the DPO reference cache).
    pub index: u64,
    /// Prompt ids.
    pub prompt: Vec<u32>,
    /// SFT: the completion; DPO: the chosen completion.
    pub completion: Vec<u32>,
    /// 1 where the loss applies (SFT: assistant tokens), one per completion token.
    pub mask: Vec<u8>,
    /// DPO: the rejected completion.
    pub rejected: Vec<u32>,
    /// KTO: whether the completion is desirable (the label column); true otherwise.
    pub desirable: bool,
    /// A packed SFT row (`bfd`, `bfd_split`): the lengths of the sequences it holds end to
    /// end (prompt + completion together); each restarts its positions and attends only to
    /// itself. Empty: one sequence.
    pub segments: Vec<usize>,
    /// Reward modelling: the pair's margin (`reward.margin_field`; 0 without the column).
    pub margin: f64,
    /// ORPO and CPO: the rejected side's prompt ids when they differ from `prompt` (TRL
    /// tokenises each side's prompt with its completion, so a merged last token can differ);
    /// empty: the same as `prompt`.
    pub rejected_prompt: Vec<u32>,
    /// TPO: the gold (reference) completion after `prompt`; empty otherwise.
    pub gold: Vec<u32>,
    /// PRM: each token's label of `completion` (the whole sequence): a step's label at its
    /// last token, -100 (ignored) elsewhere; empty otherwise.
    pub labels: Vec<i64>,
}

impl Default for Row {
    fn default() -> Self {
        Self {
            index: 0,
            prompt: Vec::new(),
            completion: Vec::new(),
            mask: Vec::new(),
            rejected: Vec::new(),
            desirable: true,
            segments: Vec::new(),
            margin: 0.0,
            rejected_prompt: Vec::new(),
            gold: Vec::new(),
            labels: Vec::new(),
        }
    }
}

/// Tokenises a batch of samples for the run's algorithm; SFT rows are packed into
/// `sft.max_length`-token sequences with `sft.packing` (see [`rows_packed`]).
pub fn rows(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    samples: &[Sample],
) -> Result<Vec<Row>> {
    rows_packed(cfg, tok, samples, cfg.sft.packing)
}

/// [`rows`], packing SFT rows when `packing` (as TRL packs a dataset: `sft.packing_strategy`
/// over this batch's rows, `grpo_data::packing`; the rows are cut at `sft.max_length` only as
/// the strategy says). A `bfd` or `bfd_split` sequence's first token carries no loss (it would
/// be predicted from the sequence before it), as in TRL's padding-free batches.
pub fn rows_packed(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    samples: &[Sample],
    packing: bool,
) -> Result<Vec<Row>> {
    let rows = match cfg.algorithm {
        Algorithm::Kto | Algorithm::Bco => kto_rows(cfg, tok, samples)?,
        // TRL filters reward pairs by length; it does not cut them.
        Algorithm::Reward => return reward_rows(cfg, tok, samples),
        Algorithm::Prm => return prm_rows(cfg, tok, samples, false),
        // TRL's ORPO and CPO cut each side's completion to fit after its prompt themselves.
        a if a.reference_free_pairs() && a != Algorithm::Tpo => {
            return Ok(samples
                .iter()
                .map(|s| pair_row(cfg, tok, s))
                .collect::<Result<Vec<_>>>()?
                .into_iter()
                .flatten()
                .collect());
        }
        _ => samples
            .iter()
            .map(|s| row(cfg, tok, s))
            .collect::<Result<Vec<_>>>()?,
    };
    let sft = cfg.algorithm == Algorithm::Sft;
    if !sft || !packing {
        let max = match cfg.algorithm {
            Algorithm::Dpo => cfg.dpo.max_length,
            Algorithm::Kto | Algorithm::Bco => cfg.kto.max_length,
            Algorithm::Tpo => cfg.tpo.max_length,
            _ => cfg.sft.max_length,
        };
        return Ok(rows.into_iter().filter_map(|r| truncated(r, max)).collect());
    }
    let seqs: Vec<(Vec<u32>, Vec<u8>)> = rows.iter().map(sequence_of).collect();
    let lengths: Vec<usize> = seqs.iter().map(|(ids, _)| ids.len()).collect();
    let strategy = cfg.sft.packing_strategy;
    let separate = strategy != PackingStrategy::Wrapped;
    let packed = grpo_data::packing::pack(&lengths, cfg.sft.max_length, strategy.strategy());
    Ok(packed
        .iter()
        .filter_map(|pieces| {
            let runs = pieces.iter().map(|p| {
                let (i, l) = &seqs[p.seq];
                let r = p.start..p.start + p.len;
                (&i[r.clone()], &l[r])
            });
            packed_row(rows[pieces[0].seq].index, runs, separate)
        })
        .collect())
}

/// A row as one sequence: its ids and, per token, whether that token is trained.
fn sequence_of(r: &Row) -> (Vec<u32>, Vec<u8>) {
    let ids = r.prompt.iter().chain(&r.completion).copied().collect();
    let labels = std::iter::repeat_n(0u8, r.prompt.len())
        .chain(r.mask.iter().copied())
        .collect();
    (ids, labels)
}

/// One packed row of `runs` (ids and their labels) end to end; with `separate`, each run is a
/// sequence of its own (`Row::segments`) whose first token carries no loss (it would be
/// predicted from the run before). `None` for fewer than two tokens. The first token has no
/// prediction: it is the "prompt" of the packed row.
fn packed_row<'a>(
    index: u64,
    runs: impl IntoIterator<Item = (&'a [u32], &'a [u8])>,
    separate: bool,
) -> Option<Row> {
    let (mut ids, mut labels, mut segments) = (Vec::new(), Vec::new(), Vec::new());
    for (i, l) in runs {
        let at = labels.len();
        ids.extend_from_slice(i);
        labels.extend_from_slice(l);
        if separate && !l.is_empty() {
            labels[at] = 0;
            segments.push(l.len());
        }
    }
    (ids.len() >= 2).then(|| Row {
        index,
        prompt: ids[..1].to_vec(),
        completion: ids[1..].to_vec(),
        mask: labels[1..].to_vec(),
        segments,
        ..Row::default()
    })
}

/// KTO's rows: a prompt, a completion and its label each; a preference row (`chosen` and
/// `rejected`, no completion column) gives two, as TRL's `unpair_preference_dataset` does — the
/// batch's chosen completions (desirable) first, then its rejected ones.
fn kto_rows(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    samples: &[Sample],
) -> Result<Vec<Row>> {
    let k = &cfg.kto;
    let one = |s: &Sample,
               prompt: &Prompt,
               v: Option<&grpo_data::Value>,
               field: &str,
               desirable: bool| {
        let (p, full) = prompt_and_full(tok, s, prompt, v, field)?;
        let n = common_prefix(&p, &full);
        let completion = full[n..].to_vec();
        Ok(Row {
            index: s.index,
            mask: vec![1; completion.len()],
            prompt: p[..n].to_vec(),
            completion,
            desirable,
            ..Row::default()
        })
    };
    let paired = |s: &Sample| s.get(&k.completion_field).is_none_or(|v| v.is_null());
    if samples.iter().all(paired) {
        let mut chosen = Vec::with_capacity(samples.len());
        let mut rejected = Vec::with_capacity(samples.len());
        for s in samples {
            let (prompt, c, r) = match cfg.data.prompt_field == "chosen" {
                true => implicit_prompt(s, "rejected")?,
                false => (
                    s.prompt.clone(),
                    s.get("chosen").cloned(),
                    s.get("rejected").cloned(),
                ),
            };
            chosen.push(one(s, &prompt, c.as_ref(), "chosen", true)?);
            rejected.push(one(s, &prompt, r.as_ref(), "rejected", false)?);
        }
        chosen.extend(rejected);
        return Ok(chosen);
    }
    samples
        .iter()
        .map(|s| {
            let desirable = match s.get(&k.label_field) {
                Some(grpo_data::Value::Bool(b)) => *b,
                Some(grpo_data::Value::Int(i @ (0 | 1))) => *i == 1,
                other => bail!(
                    "row {}: column `{}` must be true or false (the completion is desirable or not), found {other:?}",
                    s.index,
                    k.label_field
                ),
            };
            let field = &k.completion_field;
            one(s, &s.prompt, s.get(field), field, desirable)
        })
        .collect()
}

/// Reward-model pairs as TRL 1.16's RewardTrainer tokenises them: each side whole (`prompt +
/// chosen`, `prompt + rejected`; no prompt column: the columns hold whole sequences), plain
/// text with the EOS text appended and the tokenizer's special tokens, a conversation rendered
/// by the chat template (no generation prompt) with the row's `tools`. A pair with a side
/// longer than `reward.max_length` is dropped. `Row::completion` is the chosen sequence,
/// `Row::rejected` the rejected one, `Row::margin` the margin column's value (0 without it).
fn reward_rows(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    samples: &[Sample],
) -> Result<Vec<Row>> {
    use grpo_data::Value;
    let r = &cfg.reward;
    let whole = cfg.data.prompt_field == r.chosen_field;
    let mut out = Vec::with_capacity(samples.len());
    for s in samples {
        let side = |field: &str| -> Result<Vec<u32>> {
            let v = match (whole && field == r.chosen_field, s.get(field)) {
                (true, _) => match &s.prompt {
                    Prompt::Text(t) => Value::Str(t.clone()),
                    Prompt::Conversation(m) => Value::Messages(m.clone()),
                },
                (false, Some(v)) if !v.is_null() => v.clone(),
                _ => bail!("row {}: column `{field}` is empty", s.index),
            };
            let prompt = match whole {
                true => None,
                false => Some(&s.prompt),
            };
            match (prompt, v) {
                (None | Some(Prompt::Conversation(_)), Value::Messages(m)) => {
                    let mut all = match prompt {
                        Some(Prompt::Conversation(p)) => p.clone(),
                        _ => Vec::new(),
                    };
                    all.extend(m);
                    let text = tok
                        .apply_chat_template_with_tools(&chat_messages(&all), &row_tools(s)?, false)
                        .with_context(|| format!("row {}", s.index))?;
                    Ok(tok.encode(&text, false)?)
                }
                (Some(Prompt::Conversation(_)), _) => bail!(
                    "row {}: the prompt is a conversation but `{field}` is plain text",
                    s.index
                ),
                (_, Value::Messages(_)) => bail!(
                    "row {}: `{field}` is a conversation but the prompt is plain text",
                    s.index
                ),
                (p, v) => {
                    let p = match p {
                        Some(Prompt::Text(t)) => t.as_str(),
                        _ => "",
                    };
                    let c = v.as_text().unwrap_or_default();
                    Ok(tok.encode(&format!("{p}{}", with_eos(tok, &c)), true)?)
                }
            }
        };
        let chosen = side(&r.chosen_field)?;
        let rejected = side(&r.rejected_field)?;
        if chosen.len() > r.max_length || rejected.len() > r.max_length {
            continue;
        }
        let margin = match s.get(&r.margin_field) {
            None | Some(Value::Null) => 0.0,
            Some(Value::Float(x)) => *x,
            Some(Value::Int(i)) => *i as f64,
            Some(other) => bail!(
                "row {}: column `{}` must be a number (the pair's margin), found {other:?}",
                s.index,
                r.margin_field
            ),
        };
        out.push(Row {
            index: s.index,
            mask: vec![1; chosen.len()],
            completion: chosen,
            rejected,
            margin,
            ..Row::default()
        });
    }
    Ok(out)
}

/// Step-wise supervision rows as TRL's experimental PRMTrainer tokenises them (its
/// `tokenize_row`): the prompt (plain text) and each step without special tokens, each step
/// followed by `prm.step_separator`'s tokens and labelled at its last token (-100 elsewhere;
/// with `train_on_last_step_only`, outside evaluation (`eval`), the last step's label only),
/// the steps joined and cut to `prm.max_completion_length`, the prompt (after the tokenizer's
/// BOS, when it has one) put in front, the whole cut to `prm.max_length` (0: no cut).
/// `Row::completion` is the whole sequence, `Row::labels` its labels, `Row::mask` where they
/// count. A row left with no labelled token (cut away) is dropped.
pub fn prm_rows(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    samples: &[Sample],
    eval: bool,
) -> Result<Vec<Row>> {
    use grpo_data::Value;
    let p = &cfg.prm;
    let sep = tok.encode(&p.step_separator, false)?;
    let bos = tok
        .bos_token
        .as_deref()
        .and_then(|t| tok.inner.token_to_id(t));
    let mut out = Vec::with_capacity(samples.len());
    for s in samples {
        let Prompt::Text(prompt) = &s.prompt else {
            bail!(
                "row {}: the prompt is a conversation; a process reward model reads plain-text \
                 prompts (TRL's PRMTrainer tokenises the prompt as it is)",
                s.index
            );
        };
        let steps = match s.get(&p.completions_field) {
            Some(Value::StrList(l)) => l.clone(),
            other => bail!(
                "row {}: column `{}` must be a list of strings (the steps), found {}",
                s.index,
                p.completions_field,
                other.map_or("nothing".to_string(), |v| v.to_string())
            ),
        };
        let labels = step_labels(s.get(&p.labels_field)).map_err(|e| {
            anyhow!(
                "row {}: column `{}` must be a list of booleans, one per step: {e}",
                s.index,
                p.labels_field
            )
        })?;
        if labels.len() != steps.len() {
            bail!(
                "row {}: `{}` has {} steps but `{}` has {} labels",
                s.index,
                p.completions_field,
                steps.len(),
                p.labels_field,
                labels.len()
            );
        }
        let last = labels.len().saturating_sub(1);
        let (mut ids, mut lab) = (Vec::new(), Vec::new());
        for (i, (step, label)) in steps.iter().zip(labels).enumerate() {
            let mut t = tok.encode(step, false)?;
            t.extend_from_slice(&sep);
            if t.is_empty() {
                bail!(
                    "row {}: step {i} with `prm.step_separator` gives no token to label",
                    s.index
                );
            }
            let label = match p.train_on_last_step_only && !eval && i != last {
                true => -100,
                false => i64::from(label),
            };
            lab.extend(std::iter::repeat_n(-100, t.len() - 1));
            lab.push(label);
            ids.extend(t);
        }
        if let Some(m) = p.max_completion_length {
            ids.truncate(m);
            lab.truncate(m);
        }
        let mut all: Vec<u32> = bos.into_iter().collect();
        all.extend(tok.encode(prompt, false)?);
        let mut labels = vec![-100; all.len()];
        all.extend(ids);
        labels.extend(lab);
        if p.max_length > 0 {
            all.truncate(p.max_length);
            labels.truncate(p.max_length);
        }
        if labels.iter().all(|&l| l < 0) {
            continue;
        }
        out.push(Row {
            index: s.index,
            mask: labels.iter().map(|&l| u8::from(l >= 0)).collect(),
            completion: all,
            labels,
            ..Row::default()
        });
    }
    Ok(out)
}

/// PRM: the labelled tokens of `rows` (their labels that are not -100).
fn labelled_tokens(rows: &[Row]) -> f64 {
    rows.iter()
        .map(|r| r.labels.iter().filter(|&&l| l >= 0).count() as f64)
        .sum()
}

/// A PRM row's step labels: a list of booleans or of 0 / 1 (JSONL arrays and Arrow lists reach
/// here as their JSON text), or of the strings "true" / "false".
fn step_labels(v: Option<&grpo_data::Value>) -> std::result::Result<Vec<bool>, String> {
    use grpo_data::Value;
    let one = |x: &serde_json::Value| -> std::result::Result<bool, String> {
        match x {
            serde_json::Value::Bool(b) => Ok(*b),
            serde_json::Value::Number(n) if n.as_f64() == Some(1.0) => Ok(true),
            serde_json::Value::Number(n) if n.as_f64() == Some(0.0) => Ok(false),
            other => Err(format!("found {other}")),
        }
    };
    match v {
        Some(Value::Str(s)) => match serde_json::from_str::<serde_json::Value>(s) {
            Ok(serde_json::Value::Array(items)) => items.iter().map(one).collect(),
            _ => Err(format!("found {s:?}")),
        },
        Some(Value::StrList(l)) => l
            .iter()
            .map(|x| match x.to_ascii_lowercase().as_str() {
                "true" | "1" => Ok(true),
                "false" | "0" => Ok(false),
                _ => Err(format!("found {x:?}")),
            })
            .collect(),
        Some(other) => Err(format!("found {other}")),
        None => Err("the column is missing".into()),
    }
}

/// A preference pair as TRL 1.16's experimental ORPO and CPO trainers read it: the prompt,
/// chosen and rejected texts (a conversation rendered by the chat template, TRL's
/// `maybe_apply_chat_template`: the prompt with the generation prompt, each completion as the
/// rest of the rendered prompt + completion), then TRL's `tokenize_row`: each side tokenised
/// as prompt + completion without special tokens, its prompt the leading tokens of the prompt
/// alone (one fewer when the last one merges into the completion), BOS put before each prompt
/// and EOS after each completion unless already there, each completion cut to
/// `max_length` − its prompt. `None` (dropped) when a completion has no token left to score
/// (TRL's loss would be NaN).
fn pair_row(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    s: &Sample,
) -> Result<Option<Row>> {
    let (chosen_field, rejected_field) = cfg.pair_fields();
    let max_length = match cfg.algorithm {
        Algorithm::Cpo => cfg.cpo.max_length,
        _ => cfg.orpo.max_length,
    };
    let (prompt, chosen, rejected) = match cfg.data.prompt_field == chosen_field {
        true => implicit_prompt(s, rejected_field)?,
        false => (
            s.prompt.clone(),
            s.get(chosen_field).cloned(),
            s.get(rejected_field).cloned(),
        ),
    };
    let (p, c, r) = pair_texts(
        tok,
        s,
        &prompt,
        [
            (chosen.as_ref(), chosen_field),
            (rejected.as_ref(), rejected_field),
        ],
    )?;
    let prompt_ids = tok.encode(&p, false)?;
    // TRL's `build_tokenized_answer`.
    let side = |answer: &str| -> Result<(Vec<u32>, Vec<u32>)> {
        let full = tok.encode(&format!("{p}{answer}"), false)?;
        let mut start = prompt_ids.len();
        if full.get(..start) != Some(&prompt_ids[..]) {
            start = start.saturating_sub(1);
        }
        let start = start.min(full.len());
        Ok((full[..start].to_vec(), full[start..].to_vec()))
    };
    let (mut cp, mut ca) = side(&c)?;
    let (mut rp, mut ra) = side(&r)?;
    let differ = cp.iter().zip(&rp).filter(|(a, b)| a != b).count();
    if differ > 1 || cp.len().abs_diff(rp.len()) > 1 {
        bail!(
            "row {}: the prompt tokenises differently before `{chosen_field}` and              `{rejected_field}` beyond its last token",
            s.index
        );
    }
    let id = |t: Option<&str>| t.and_then(|t| tok.inner.token_to_id(t));
    if let Some(bos) = id(tok.bos_token.as_deref()) {
        for ids in [&mut cp, &mut rp] {
            if ids.first() != Some(&bos) {
                ids.insert(0, bos);
            }
        }
    }
    let eos = id(tok.eos_token.as_deref()).or(tok.eos_token_ids.first().copied());
    if let Some(eos) = eos {
        for ids in [&mut ca, &mut ra] {
            if ids.last() != Some(&eos) {
                ids.push(eos);
            }
        }
    }
    ca.truncate(max_length.saturating_sub(cp.len()));
    ra.truncate(max_length.saturating_sub(rp.len()));
    // A completion's tokens with a prediction (without a prompt its first token has none).
    let scored = |p: &[u32], a: &[u32]| a.len() - usize::from(p.is_empty() && !a.is_empty());
    if scored(&cp, &ca) == 0 || scored(&rp, &ra) == 0 {
        return Ok(None);
    }
    Ok(Some(Row {
        index: s.index,
        mask: vec![1; ca.len()],
        rejected_prompt: if rp == cp { Vec::new() } else { rp },
        prompt: cp,
        completion: ca,
        rejected: ra,
        ..Row::default()
    }))
}

/// The prompt, chosen and rejected texts of a pair, as TRL's `maybe_apply_chat_template`
/// makes them: plain text as it is; a conversation's prompt rendered with the generation
/// prompt (none after an assistant turn) and each completion the rest of the rendered
/// prompt-and-completion after the three renderings' common beginning; a plain-text completion
/// after a conversation prompt as it is.
fn pair_texts(
    tok: &grpo_rollout::Tokenizer,
    s: &Sample,
    prompt: &Prompt,
    sides: [(Option<&grpo_data::Value>, &str); 2],
) -> Result<(String, String, String)> {
    use grpo_data::Value;
    let index = s.index;
    let at = || format!("row {index}");
    for (v, field) in sides {
        if v.is_none_or(Value::is_null) {
            bail!("row {index}: column `{field}` is empty");
        }
        if let (Prompt::Text(_), Some(Value::Messages(_))) = (prompt, v) {
            bail!("row {index}: `{field}` is a conversation but the prompt is plain text");
        }
    }
    let [(c, _), (r, _)] = sides;
    let text = |v: Option<&Value>| v.and_then(Value::as_text).unwrap_or_default();
    let Prompt::Conversation(p) = prompt else {
        let Prompt::Text(p) = prompt else {
            unreachable!()
        };
        return Ok((p.clone(), text(c), text(r)));
    };
    let tools = row_tools(s)?;
    let template = tok.compile_chat_template().with_context(at)?;
    let generation = p.last().is_none_or(|m| m.role != "assistant");
    let rendered = template
        .render_with_tools(&chat_messages(p), &tools, generation)
        .with_context(at)?;
    let whole = |v: Option<&Value>| -> Result<Option<String>> {
        let Some(Value::Messages(turns)) = v else {
            return Ok(None);
        };
        let mut all = p.clone();
        all.extend(turns.iter().cloned());
        Ok(Some(
            template
                .render_with_tools(&chat_messages(&all), &tools, false)
                .with_context(at)?,
        ))
    };
    let (wc, wr) = (whole(c)?, whole(r)?);
    let mut shared = rendered.len();
    for w in [&wc, &wr].into_iter().flatten() {
        shared = shared.min(common_char_prefix(&rendered, w));
    }
    let prompt_text = rendered[..shared].to_string();
    let rest = |w: Option<String>, v: Option<&Value>| match w {
        Some(w) => w[shared..].to_string(),
        None => text(v),
    };
    Ok((prompt_text, rest(wc, c), rest(wr, r)))
}

/// The byte length of the longest common prefix of `a` and `b`, in whole characters.
fn common_char_prefix(a: &str, b: &str) -> usize {
    a.char_indices()
        .zip(b.chars())
        .find(|((_, x), y)| x != y)
        .map_or(a.len().min(b.len()), |((i, _), _)| i)
}

/// A row cut to `max` prompt + completion tokens, keeping the start (TRL's `keep_start`, its
/// only supported truncation); `None` when nothing is left to learn from, as TRL drops such
/// rows: an SFT row without a loss token, a DPO pair whose prompt alone fills `max`.
fn truncated(mut r: Row, max: usize) -> Option<Row> {
    if r.prompt.len() >= max {
        return None;
    }
    let room = max - r.prompt.len();
    r.completion.truncate(room);
    r.mask.truncate(room);
    r.rejected.truncate(room);
    r.gold.truncate(room);
    r.mask.contains(&1).then_some(r)
}

/// `text` ended by the tokenizer's EOS text (unless it ends with it already), tokenised with
/// the tokenizer's special tokens: TRL's `add_eos` then `tokenizer(text=...)`.
fn text_ids(tok: &grpo_rollout::Tokenizer, text: &str) -> Result<Vec<u32>> {
    Ok(tok.encode(&with_eos(tok, text), true)?)
}

/// `text` with the tokenizer's EOS text appended, as TRL's `add_eos` does.
fn with_eos(tok: &grpo_rollout::Tokenizer, text: &str) -> String {
    match tok.eos_token.as_deref() {
        Some(eos) if !text.ends_with(eos) => format!("{text}{eos}"),
        _ => text.to_string(),
    }
}

/// A row's `tools` column (TRL's per-example tool schemas, a JSON list or its text), for
/// the chat template; empty without one.
fn row_tools(s: &Sample) -> Result<Vec<serde_json::Value>> {
    let text = match s.get("tools") {
        None | Some(grpo_data::Value::Null) => return Ok(Vec::new()),
        Some(v) => v.as_text().unwrap_or_default(),
    };
    match serde_json::from_str(&text) {
        Ok(serde_json::Value::Array(tools)) => Ok(tools),
        Ok(serde_json::Value::Null) => Ok(Vec::new()),
        _ => bail!(
            "row {}: column `tools` is not a JSON list of tool schemas",
            s.index
        ),
    }
}

/// How many leading tokens `a` and `b` share (TRL's `common_prefix_length`).
fn common_prefix(a: &[u32], b: &[u32]) -> usize {
    a.iter().zip(b).take_while(|(x, y)| x == y).count()
}

/// A DPO pair, or TPO's triple with its gold completion (`gold`: its column), as TRL 1.16's
/// DPOTrainer and TPOTrainer tokenise them: without a prompt column the prompt is the common
/// beginning of `chosen` and `rejected` (and is stripped from the gold completion, which must
/// start with it); each completion is tokenised with the prompt, and all start where the prompt
/// alone and the first of them part.
fn preference_row(
    cfg: &crate::config::TrainConfig,
    tok: &grpo_rollout::Tokenizer,
    s: &Sample,
    (chosen_field, rejected_field): (&str, &str),
    gold: Option<&str>,
) -> Result<Row> {
    let (prompt, chosen, rejected) = match cfg.data.prompt_field == chosen_field {
        // TRL's implicit prompt: the rows are read by `chosen`; the prompt is the common
        // beginning of `chosen` and `rejected`.
        true => implicit_prompt(s, rejected_field)?,
        false => (
            s.prompt.clone(),
            s.get(chosen_field).cloned(),
            s.get(rejected_field).cloned(),
        ),
    };
    let gold_value = match gold {
        Some(field) if cfg.data.prompt_field == chosen_field => {
            Some((strip_prompt(s, &prompt, field)?, field))
        }
        Some(field) => Some((s.get(field).cloned(), field)),
        None => None,
    };
    let of = |v: Option<&grpo_data::Value>, field: &str| prompt_and_full(tok, s, &prompt, v, field);
    let (prompt, chosen) = of(chosen.as_ref(), chosen_field)?;
    let (_, rejected) = of(rejected.as_ref(), rejected_field)?;
    let gold = match gold_value {
        Some((v, field)) => Some(of(v.as_ref(), field)?.1),
        None => None,
    };
    // TRL: the completions start where the prompt alone and prompt + completion diverge.
    let n = [&chosen, &rejected]
        .into_iter()
        .chain(gold.as_ref())
        .map(|full| common_prefix(&prompt, full))
        .min()
        .unwrap_or(0);
    Ok(Row {
        index: s.index,
        mask: vec![1; chosen.len() - n],
        prompt: prompt[..n].to_vec(),
        completion: chosen[n..].to_vec(),
        rejected: rejected[n..].to_vec(),
        gold: gold.map(|g| g[n..].to_vec()).unwrap_or_default(),
        ..Row::default()
    })
}

/// TPO's gold column without the implicit prompt `prompt` it must start with (TRL's
/// `_extract_triple_prompt`).
fn strip_prompt(s: &Sample, prompt: &Prompt, field: &str) -> Result<Option<grpo_data::Value>> {
    use grpo_data::Value;
    let missing = || {
        anyhow!(
            "row {}: column `{field}` does not start with the prompt that `chosen` and `rejected` share: give the rows a prompt column",
            s.index
        )
    };
    Ok(match (s.get(field), prompt) {
        (Some(Value::Messages(m)), Prompt::Conversation(p)) => {
            if m.len() < p.len() || m[..p.len()] != p[..] {
                return Err(missing());
            }
            Some(Value::Messages(m[p.len()..].to_vec()))
        }
        (Some(v), Prompt::Text(p)) if !v.is_null() => {
            let t = v.as_text().unwrap_or_default();
            Some(Value::Str(
                t.strip_prefix(p.as_str()).ok_or_else(missing)?.to_string(),
            ))
        }
        (other, _) => other.cloned(),
    })
}

fn row(cfg: &crate::config::TrainConfig, tok: &grpo_rollout::Tokenizer, s: &Sample) -> Result<Row> {
    match cfg.algorithm {
        Algorithm::Dpo => {
            let d = &cfg.dpo;
            return preference_row(cfg, tok, s, (&d.chosen_field, &d.rejected_field), None);
        }
        Algorithm::Tpo => {
            let t = &cfg.tpo;
            let fields = (t.chosen_field.as_str(), t.rejected_field.as_str());
            return preference_row(cfg, tok, s, fields, Some(&t.reference_field));
        }
        _ => {}
    }
    let has_completion = s
        .get(&cfg.sft.completion_field)
        .is_some_and(|v| !v.is_null());
    let lm_text = match &s.prompt {
        Prompt::Text(t)
            if !has_completion && cfg.data.prompt_field == cfg.sft.dataset_text_field =>
        {
            Some(t)
        }
        _ => None,
    };
    let (prompt, completion, mask) = match has_completion {
        // Language-modelling text: every token after the first (TRL's `dataset_text_field`).
        false if lm_text.is_some() => {
            let ids = text_ids(tok, lm_text.map_or("", |t| t.as_str()))?;
            if ids.len() < 2 {
                bail!(
                    "row {}: `{}` has fewer than two tokens",
                    s.index,
                    cfg.data.prompt_field
                );
            }
            (ids, Vec::new(), Vec::new())
        }
        true => {
            let field = &cfg.sft.completion_field;
            let (prompt, full) = prompt_and_full(tok, s, &s.prompt, s.get(field), field)?;
            let n = common_prefix(&prompt, &full);
            let completion = full[n..].to_vec();
            let mask = vec![1; completion.len()];
            (prompt[..n].to_vec(), completion, mask)
        }
        // A conversation trained on every token (TRL's default): the rendered conversation as
        // it is; no turn boundaries are needed.
        false if !cfg.sft.assistant_only_loss => {
            let Prompt::Conversation(msgs) = &s.prompt else {
                bail!(
                    "row {}: no `{}` column and the prompt is not a conversation",
                    s.index,
                    cfg.sft.completion_field
                );
            };
            let text = tok
                .apply_chat_template_with_tools(&chat_messages(msgs), &row_tools(s)?, false)
                .with_context(|| format!("row {}", s.index))?;
            (tok.encode(&text, false)?, Vec::new(), Vec::new())
        }
        false => assistant_turns(tok, &s.prompt, &row_tools(s)?).with_context(|| {
            format!(
                "row {}: no `{}` column and no conversation with assistant turns",
                s.index, cfg.sft.completion_field
            )
        })?,
    };
    // TRL's defaults: a conversation trains on every token (`assistant_only_loss` keeps its
    // assistant turns alone), a prompt/completion row on its completion
    // (`completion_only_loss = false` adds the prompt). Trained on the whole sequence, the
    // first token is the only "prompt" (it has no prediction).
    let whole = match has_completion {
        true => cfg.sft.completion_only_loss == Some(false),
        false => lm_text.is_some() || !cfg.sft.assistant_only_loss,
    };
    let (prompt, completion, mask) = match whole {
        true => {
            let all: Vec<u32> = prompt.iter().chain(&completion).copied().collect();
            let rest = all[1.min(all.len())..].to_vec();
            let ones = vec![1u8; rest.len()];
            (all[..1.min(all.len())].to_vec(), rest, ones)
        }
        false => (prompt, completion, mask),
    };
    Ok(Row {
        index: s.index,
        prompt,
        completion,
        mask,
        ..Row::default()
    })
}

/// A row's prompt alone and its prompt followed by the completion column `field`, tokenised
/// as TRL 1.16's SFT and DPO trainers do: plain text as one string (`prompt + completion +
/// EOS`, with the tokenizer's special tokens), so tokens merge across the boundary as they do
/// at inference; a conversation rendered with the chat template, the prompt with the
/// generation prompt, prompt + completion (the `field` turns) without. The caller takes the
/// completion from where the two diverge.
fn prompt_and_full(
    tok: &grpo_rollout::Tokenizer,
    s: &Sample,
    prompt: &Prompt,
    completion: Option<&grpo_data::Value>,
    field: &str,
) -> Result<(Vec<u32>, Vec<u32>)> {
    let index = s.index;
    let at = || format!("row {index}");
    match (prompt, completion) {
        (Prompt::Conversation(p), Some(grpo_data::Value::Messages(turns))) => {
            let tools = row_tools(s)?;
            let template = tok.compile_chat_template().with_context(at)?;
            let render = |msgs: &[grpo_data::Message], generation: bool| -> Result<Vec<u32>> {
                let text = template.render_with_tools(&chat_messages(msgs), &tools, generation)?;
                Ok(tok.encode(&text, false)?)
            };
            let mut all = p.clone();
            all.extend(turns.iter().cloned());
            let prompt = render(p, true).with_context(at)?;
            let full = render(&all, false).with_context(at)?;
            if common_prefix(&prompt, &full) == full.len() {
                bail!(
                    "row {index}: the chat template renders nothing of `{field}` after the prompt"
                );
            }
            Ok((prompt, full))
        }
        (Prompt::Text(_), Some(grpo_data::Value::Messages(_))) => {
            bail!("row {index}: `{field}` is a conversation but the prompt is plain text")
        }
        (Prompt::Text(p), Some(v)) if !v.is_null() => {
            let c = v.as_text().unwrap_or_default();
            let prompt = tok.encode(p, true)?;
            let full = tok.encode(&with_eos(tok, &format!("{p}{c}")), true)?;
            Ok((prompt, full))
        }
        // A conversation prompt with a plain-text completion: the rendered prompt (whole: GRPO's
        // `rollout.max_prompt_length` is not SFT's or DPO's), then the completion's own tokens.
        (Prompt::Conversation(msgs), Some(v)) if !v.is_null() => {
            let text = tok
                .apply_chat_template_with_tools(&chat_messages(msgs), &row_tools(s)?, true)
                .with_context(at)?;
            let prompt = tok.encode(&text, false)?;
            let mut full = prompt.clone();
            full.extend(text_ids(tok, &v.as_text().unwrap_or_default())?);
            Ok((prompt, full))
        }
        _ => bail!("row {index}: column `{field}` is empty"),
    }
}

/// TRL's implicit prompt for preference rows without a prompt column: the row was read by
/// its chosen column (`s.prompt`); [`grpo_data::preference::extract_prompt`] splits chosen and
/// rejected into the prompt they share and the completions.
fn implicit_prompt(
    s: &Sample,
    rejected_field: &str,
) -> Result<(Prompt, Option<grpo_data::Value>, Option<grpo_data::Value>)> {
    use grpo_data::Value;
    let rejected = match s.get(rejected_field) {
        Some(Value::Messages(m)) => Prompt::Conversation(m.clone()),
        Some(v) if !v.is_null() => Prompt::Text(v.as_text().unwrap_or_default()),
        _ => bail!("row {}: column `{rejected_field}` is empty", s.index),
    };
    let Some((prompt, chosen, rejected)) =
        grpo_data::preference::extract_prompt(&s.prompt, &rejected)
    else {
        bail!(
            "row {}: without a prompt column, `chosen` and `{rejected_field}` must both be \
             non-empty conversations or both non-empty strings",
            s.index
        );
    };
    let value = |p: Prompt| match p {
        Prompt::Text(t) => Value::Str(t),
        Prompt::Conversation(m) => Value::Messages(m),
    };
    Ok((prompt, Some(value(chosen)), Some(value(rejected))))
}

/// A conversation as (prompt before the first assistant turn, the rest, assistant-token mask):
/// each assistant turn's tokens are those between the conversation rendered up to it with the
/// generation prompt and rendered through it.
fn assistant_turns(
    tok: &grpo_rollout::Tokenizer,
    p: &Prompt,
    tools: &[serde_json::Value],
) -> Result<(Vec<u32>, Vec<u32>, Vec<u8>)> {
    let Prompt::Conversation(msgs) = p else {
        bail!("the prompt is plain text");
    };
    // A template with `{% generation %}` blocks says itself which tokens are the assistant's
    // (TRL's way): the whole conversation, its first token the "prompt".
    if let Some((ids, mask)) = tok.assistant_tokens_mask(&chat_messages(msgs), tools)? {
        if ids.len() < 2 {
            bail!("the conversation renders to fewer than two tokens");
        }
        return Ok((ids[..1].to_vec(), ids[1..].to_vec(), mask[1..].to_vec()));
    }
    let turns: Vec<usize> = msgs
        .iter()
        .enumerate()
        .filter(|(_, m)| m.role == "assistant")
        .map(|(i, _)| i)
        .collect();
    let (Some(&first), Some(&last)) = (turns.first(), turns.last()) else {
        bail!("the conversation has no assistant turn");
    };
    // Parsed once: a conversation renders once per assistant turn, twice.
    let template = tok.compile_chat_template()?;
    let render = |upto: usize, generation_prompt: bool| -> Result<Vec<u32>> {
        let text =
            template.render_with_tools(&chat_messages(&msgs[..upto]), tools, generation_prompt)?;
        Ok(tok.encode(&text, false)?)
    };
    let prompt = render(first, true)?;
    let full = render(last + 1, false)?;
    if !full.starts_with(&prompt) {
        bail!("the chat template does not render the conversation as a prefix of itself");
    }
    let mut mask = vec![0u8; full.len() - prompt.len()];
    for &k in &turns {
        let start = render(k, true)?.len();
        let end = render(k + 1, false)?.len();
        for m in mask
            .iter_mut()
            .take(end.saturating_sub(prompt.len()))
            .skip(start.saturating_sub(prompt.len()))
        {
            *m = 1;
        }
    }
    Ok((prompt.clone(), full[prompt.len()..].to_vec(), mask))
}

/// A packed row's sequences (`Row::segments`) as rows of their own, each a one-token prompt
/// (its first token, which carries no loss in the packed row) and the rest as completion, with
/// the packed row's loss mask: the same tokens predicted from the same context.
fn unpacked(row: &Row) -> Vec<Row> {
    if row.segments.is_empty() {
        return vec![row.clone()];
    }
    let ids: Vec<u32> = row.prompt.iter().chain(&row.completion).copied().collect();
    let mut at = 0;
    let mut out = Vec::with_capacity(row.segments.len());
    for &len in &row.segments {
        if len >= 2 {
            out.push(Row {
                index: row.index,
                prompt: ids[at..at + 1].to_vec(),
                completion: ids[at + 1..at + len].to_vec(),
                mask: row.mask[at..at + len - 1].to_vec(),
                ..Row::default()
            });
        }
        at += len;
    }
    out
}

/// Rows as one packed row (TRL's `padding_free`): each row a sequence of its own positions,
/// attending only to itself; the loss mask the rows' (a row's first token carries none).
fn one_sequence(rows: &[Row]) -> Option<Row> {
    let seqs: Vec<(Vec<u32>, Vec<u8>)> = rows.iter().map(sequence_of).collect();
    let runs = seqs.iter().map(|(i, l)| (i.as_slice(), l.as_slice()));
    packed_row(rows.first().map_or(0, |r| r.index), runs, true)
}

/// Log-probs `(B, c)` of packed rows' tokens after the first, each sequence of a row on its
/// own positions and attending only to itself (`Row::segments`), the rows right-padded.
/// The mean of each `x` `(B, c)` over the tokens where its mask is 1 (`None` where the mask
/// holds none: TRL then logs 0 or skips the value), read from the device with one copy.
fn masked_means(pairs: &[(&Tensor, &Tensor)]) -> Result<Vec<Option<f64>>> {
    let mut parts = Vec::with_capacity(2 * pairs.len());
    for (x, mask) in pairs {
        let m = mask.detach().to_dtype(DType::F32)?;
        parts.push((x.detach().to_dtype(DType::F32)? * &m)?.sum_all()?);
        parts.push(m.sum_all()?);
    }
    let v: Vec<f64> = Tensor::stack(&parts, 0)?.to_dtype(DType::F64)?.to_vec1()?;
    Ok(v.chunks(2)
        .map(|c| (c[1] > 0.0).then(|| c[0] / c[1]))
        .collect())
}

/// 0/1 mask `(B, c)` of every token of each completion (right-padded to `c`), f32.
fn completion_mask(
    completions: &[&[u32]],
    c: usize,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let masks: Vec<Vec<u8>> = completions.iter().map(|x| vec![1u8; x.len()]).collect();
    let refs: Vec<&[u8]> = masks.iter().map(Vec::as_slice).collect();
    mask_tensor(&refs, c, DType::F32, device)
}

/// Per-token log-probs and statistics of packed rows (several sequences in a row, kept apart
/// by the attention bias), and the width.
fn packed_logps(
    model: &grpo_rollout::Transformer,
    pad: u32,
    rows: &[Row],
) -> Result<(TokenStats, usize)> {
    let l = rows
        .iter()
        .map(|r| r.prompt.len() + r.completion.len())
        .max()
        .unwrap_or(0)
        .max(2);
    let mut ids = Vec::with_capacity(rows.len() * l);
    let mut lens = Vec::with_capacity(rows.len());
    for r in rows {
        let n = r.prompt.len() + r.completion.len();
        ids.extend(r.prompt.iter().chain(&r.completion));
        ids.extend(std::iter::repeat_n(pad, l - n));
        lens.push(match r.segments.is_empty() {
            true => vec![n],
            false => r.segments.clone(),
        });
    }
    let dev = model.device();
    // An MoE policy's load-balancing loss counts every packed token, not the padding after.
    let weights = match grpo_rollout::moe::is_recording() {
        true => {
            let w: Vec<f32> = lens
                .iter()
                .flat_map(|s| {
                    let n: usize = s.iter().sum();
                    (0..l).map(move |j| f32::from(u8::from(j < n)))
                })
                .collect();
            Some(Tensor::from_vec(w, rows.len() * l, dev)?)
        }
        false => None,
    };
    let ids = Tensor::from_vec(ids, (rows.len(), l), dev)?;
    let (pos, bias) = grpo_rollout::model::packed_positions_and_bias(&lens, l, dev)?;
    let st = grpo_rollout::moe::with_rows(weights, || {
        model.logprobs_stats_with(&ids, &pos, &bias, l - 1)
    })?;
    Ok((st, l - 1))
}

/// `(B, c)` 0/1 mask of the completions' loss tokens, right-padded to `c`.
fn mask_tensor(
    masks: &[&[u8]],
    c: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let mut m = Vec::with_capacity(masks.len() * c);
    for row in masks {
        m.extend((0..c).map(|j| f32::from(row.get(j).copied().unwrap_or(0))));
    }
    Ok(Tensor::from_vec(m, (masks.len(), c), device)?.to_dtype(dtype)?)
}

impl Learner {
    /// Summed log-prob of each completion's loss tokens, `(B,)`.
    fn summed_logps(
        &self,
        model: &grpo_rollout::Transformer,
        prompts: &[&[u32]],
        completions: &[&[u32]],
    ) -> Result<Tensor> {
        let (lp, _, c) = completion_logps(
            model,
            self.tokenizer.pad_token_id,
            prompts,
            completions,
            1.0,
            false,
        )?;
        self.summed(&lp, completions, c)
    }

    /// The policy's summed log-probs `(2k,)` of a batch's chosen then rejected completions,
    /// with `dpo.use_weighting` WPO's pair weights `(k,)`, and the per-token statistics and
    /// completion-token mask `(2k, c)` of TRL's metrics, all from the same forward.
    fn policy_logps(
        &self,
        model: &grpo_rollout::Transformer,
        prompts: &[&[u32]],
        completions: &[&[u32]],
    ) -> Result<(Tensor, Option<Tensor>, TokenStats, Tensor)> {
        let pad = self.tokenizer.pad_token_id;
        let (st, sum_sq, c) = match self.cfg.dpo.use_weighting {
            true => {
                let (st, sum_sq, c) =
                    completion_logps_and_sum_sq(model, pad, prompts, completions)?;
                (st, Some(sum_sq), c)
            }
            false => {
                let (st, c) = completion_stats(model, pad, prompts, completions)?;
                (st, None, c)
            }
        };
        let lp = &st.logps;
        // Every completion token (LD-DPO's α enters neither WPO's weights nor the metrics).
        let mask = completion_mask(completions, c, lp.device())?.to_dtype(lp.dtype())?;
        let weights = match &sum_sq {
            Some(sq) => Some(grpo_core::preference::wpo_pair_weights(lp, sq, &mask)?),
            None => None,
        };
        Ok((self.summed(lp, completions, c)?, weights, st, mask))
    }

    /// Per-token log-probs `(B, c)` summed over each completion's tokens (LD-DPO's `ld_alpha`
    /// weighing each pair's tokens past the shorter completion), `(B,)`.
    fn summed(&self, lp: &Tensor, completions: &[&[u32]], c: usize) -> Result<Tensor> {
        let mask = match self.cfg.dpo.ld_alpha {
            // LD-DPO (TRL's `ld_alpha`): the completions are a batch's chosen then its rejected
            // ones; each pair's tokens past the shorter one's length count α.
            Some(alpha) if self.cfg.algorithm == Algorithm::Dpo => {
                let k = completions.len() / 2;
                let mut w = Vec::with_capacity(completions.len() * c);
                for (i, x) in completions.iter().enumerate() {
                    let other = completions[if i < k { i + k } else { i - k }].len();
                    let shared = x.len().min(other);
                    w.extend((0..c).map(|j| match j {
                        j if j < shared => 1.0,
                        j if j < x.len() => alpha,
                        _ => 0.0,
                    }));
                }
                Tensor::from_vec(w, (completions.len(), c), lp.device())?.to_dtype(lp.dtype())?
            }
            _ => completion_mask(completions, c, lp.device())?.to_dtype(lp.dtype())?,
        };
        Ok((lp * mask)?.sum(D::Minus1)?)
    }

    /// ORPO's, CPO's or TPO's loss on a micro-batch of pairs, as TRL's experimental trainers
    /// compute it: the chosen, the rejected (and TPO's gold) sequences in one forward; each
    /// completion's log-prob summed, or averaged over its tokens (ORPO; CPO's ipo and simpo;
    /// TPO's ipo and tpo-l); the NLL term the mean token NLL of the chosen sequences (ORPO:
    /// prompt and completion, every token after the first; CPO: the completion) or of TPO's
    /// gold completions.
    fn pair_loss(
        &self,
        model: &grpo_rollout::Transformer,
        part: &[Row],
    ) -> Result<grpo_core::preference::PairLossOutput> {
        let orpo = self.cfg.algorithm == Algorithm::Orpo;
        let tpo = self.cfg.algorithm == Algorithm::Tpo;
        let cpo = match tpo {
            true => self.cfg.tpo.cpo_config(),
            false => self.cfg.cpo.cpo_config(),
        };
        // TPO's NLL is on a third sequence, the gold completion (left out at tpo_alpha = 0).
        let with_gold = tpo && cpo.cpo_alpha != 0.0;
        let k = part.len();
        let rows = if with_gold { 3 * k } else { 2 * k };
        let seqs: Vec<(Vec<u32>, usize)> = part
            .iter()
            .map(|r| {
                let seq = r.prompt.iter().chain(&r.completion).copied().collect();
                (seq, r.prompt.len())
            })
            .chain(part.iter().map(|r| {
                let p = match r.rejected_prompt.is_empty() {
                    true => &r.prompt,
                    false => &r.rejected_prompt,
                };
                (p.iter().chain(&r.rejected).copied().collect(), p.len())
            }))
            .chain(part.iter().filter(|_| with_gold).map(|r| {
                let seq = r.prompt.iter().chain(&r.gold).copied().collect();
                (seq, r.prompt.len())
            }))
            .collect();
        // Every sequence whole after its first token: position t predicts token t + 1.
        let firsts: Vec<&[u32]> = seqs.iter().map(|(q, _)| &q[..1]).collect();
        let rests: Vec<&[u32]> = seqs.iter().map(|(q, _)| &q[1..]).collect();
        let pad = self.tokenizer.pad_token_id;
        let (lp, _, c) = completion_logps(model, pad, &firsts, &rests, 1.0, false)?;
        let (mut answer, mut nll) = (vec![0f32; 2 * k * c], vec![0f32; rows * c]);
        for (j, (q, plen)) in seqs.iter().enumerate() {
            let (start, end) = (plen.saturating_sub(1), q.len() - 1);
            if j < 2 * k {
                answer[j * c + start..j * c + end].fill(1.0);
            }
            // The NLL rows: ORPO's chosen sequences whole, CPO's chosen completions, TPO's
            // gold completions.
            let nll_row = match tpo {
                true => j >= 2 * k,
                false => j < k,
            };
            if nll_row {
                let from = if orpo { 0 } else { start };
                nll[j * c + from..j * c + end].fill(1.0);
            }
        }
        let (dt, dev) = (lp.dtype(), lp.device());
        let mask = |v: Vec<f32>, n: usize| -> Result<Tensor> {
            Ok(Tensor::from_vec(v, (n, c), dev)?.to_dtype(dt)?)
        };
        let answer = mask(answer, 2 * k)?;
        let mut logps = (&lp.narrow(0, 0, 2 * k)? * &answer)?.sum(D::Minus1)?;
        if orpo || cpo.loss_type.averages_log_probs() {
            logps = (logps / answer.sum(D::Minus1)?)?;
        }
        let (chosen, rejected) = (logps.narrow(0, 0, k)?, logps.narrow(0, k, k)?);
        // TRL's `CrossEntropyLoss` over the NLL tokens (CPO and TPO skip it at a zero weight).
        let nll = match orpo || cpo.cpo_alpha != 0.0 {
            true => {
                let nll = mask(nll, rows)?;
                ((&lp * &nll)?.sum_all()?.neg()? / nll.sum_all()?)?
            }
            false => Tensor::zeros((), dt, dev)?,
        };
        Ok(match orpo {
            true => grpo_core::preference::orpo_loss(&chosen, &rejected, &nll, self.cfg.orpo.beta)?,
            false => grpo_core::preference::cpo_loss(&chosen, &rejected, &nll, &cpo)?,
        })
    }

    /// PRM's loss on micro-batch `part`: the cross-entropy of the token classifier's logits
    /// against each labelled token's label, summed and divided by the step's `labelled` tokens
    /// (transformers' token-classification loss with `num_items_in_batch`); also how many of
    /// the part's labelled tokens the arg-max label gets right.
    fn prm_loss(
        &self,
        model: &grpo_rollout::Transformer,
        part: &[Row],
        labelled: f64,
    ) -> Result<(Tensor, f64)> {
        let seqs: Vec<&[u32]> = part.iter().map(|r| r.completion.as_slice()).collect();
        let z = model
            .token_logits(&seqs, self.tokenizer.pad_token_id)?
            .to_dtype(DType::F32)?;
        let (k, t, _) = z.dims3()?;
        let mut labels = Vec::with_capacity(k * t);
        for r in part {
            labels.extend(r.labels.iter().map(|&l| l.max(-1) as f32));
            labels.extend(std::iter::repeat_n(-1f32, t - r.labels.len()));
        }
        let labels = Tensor::from_vec(labels, (k, t), z.device())?;
        let on = labels.ge(0f32)?.to_dtype(DType::F32)?;
        let target = labels.maximum(0f32)?.to_dtype(DType::U32)?;
        let z = z.broadcast_sub(&z.max_keepdim(D::Minus1)?.detach())?;
        let ls = z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
        let nll = ls.gather(&target.unsqueeze(2)?, 2)?.squeeze(2)?.neg()?;
        let loss = ((nll * &on)?.sum_all()? / labelled.max(1.0))?;
        let right = ls.argmax(D::Minus1)?.eq(&target)?.to_dtype(DType::F32)?;
        let correct = (right * &on)?
            .sum_all()?
            .to_dtype(DType::F64)?
            .to_scalar::<f64>()?;
        Ok((loss, correct))
    }

    /// One SFT or DPO step over `rows`: the losses of the micro-batches, their gradients summed,
    /// clipped, one AdamW update. `dpo_ref`: cached reference log-probs by row index.
    pub fn supervised_step(
        &mut self,
        rows: &[Row],
        dpo_ref: &mut HashMap<u64, (f64, f64)>,
        train: bool,
    ) -> Result<Metrics> {
        let n = rows.len();
        if n == 0 {
            // Every row of the batch was dropped (see `rows`): nothing to learn from.
            return Ok(Metrics::new());
        }
        let micro = self.cfg.micro_batch().max(1);
        let chunks: Vec<(usize, usize)> = (0..n)
            .step_by(micro)
            .map(|a| (a, (a + micro).min(n)))
            .collect();
        let dpo = self.cfg.algorithm == Algorithm::Dpo;
        let kto = self.cfg.algorithm.is_unpaired();
        let bco = self.cfg.algorithm == Algorithm::Bco;
        // BCO's δ of each micro-batch, weighted by its share.
        let mut bco_delta = 0f64;
        // UDM: the undesirable rows' mean density-ratio weight, weighted by share.
        let mut udm_weight = 0f64;
        let reward = self.cfg.algorithm == Algorithm::Reward;
        let prm = self.cfg.algorithm == Algorithm::Prm;
        // PRM: the step's labelled tokens (transformers' `num_items_in_batch`).
        let labelled = labelled_tokens(rows);
        let pairs = self.cfg.algorithm.reference_free_pairs();
        // KTO's metrics over the step's rows: Σ rewards and log-probs and counts of desirable,
        // then undesirable rows, and the KL estimate weighted by micro-batch share.
        let (mut kto_sums, mut kto_kl) = ([0f64; 6], 0f64);
        // KTO's mean logits: (Σ micro-batch means, count) of the desirable, then undesirable side.
        let mut kto_logits = [0f64; 4];
        let total_tokens: f64 = rows
            .iter()
            .map(|r| r.mask.iter().map(|&m| f64::from(m)).sum::<f64>())
            .sum();
        let mut acc = HashMap::new();
        let mut m = Metrics::new();
        let mut add = |k: &str, v: f64, w: f64| *m.entry(k.to_string()).or_insert(0.0) += v * w;
        for &(a, b) in &chunks {
            let part = &rows[a..b];
            let share = (b - a) as f64 / n as f64;
            let model = if train {
                self.policy.model.clone()
            } else {
                self.policy.model.detached()
            };
            // An MoE policy's load-balancing loss (TRL's SFT, DPO, KTO, CPO and ORPO trainers
            // add it too): recorded by the policy's forward only.
            let aux = match train && !reward && !prm {
                true => self.aux_collector(chunks.len() as f64),
                false => None,
            };
            let loss = if dpo {
                let prompts: Vec<&[u32]> = part
                    .iter()
                    .chain(part)
                    .map(|r| r.prompt.as_slice())
                    .collect();
                let comps: Vec<&[u32]> = part
                    .iter()
                    .map(|r| r.completion.as_slice())
                    .chain(part.iter().map(|r| r.rejected.as_slice()))
                    .collect();
                let (pol, pair_weights, st, tok_mask) =
                    grpo_rollout::moe::recording(aux.clone(), || {
                        self.policy_logps(&model, &prompts, &comps)
                    })?;
                let k = b - a;
                // TRL's DPO token metrics, per micro-batch, averaged over the step's: the
                // entropy over both sides' tokens, the mean logit of each side's tokens, the
                // top-1 accuracy on the chosen side.
                let per = 1.0 / chunks.len() as f64;
                let half = |t: &Tensor, i: usize| t.narrow(0, i * k, k);
                let (chosen, rejected) = (half(&tok_mask, 0)?, half(&tok_mask, 1)?);
                let means = masked_means(&[
                    (&st.entropy, &tok_mask),
                    (&half(&st.mean_logits, 0)?, &chosen),
                    (&half(&st.mean_logits, 1)?, &rejected),
                    (&half(&st.top1, 0)?, &chosen),
                ])?;
                for (key, v) in [
                    "entropy",
                    "logits/chosen",
                    "logits/rejected",
                    "mean_token_accuracy",
                ]
                .into_iter()
                .zip(means)
                {
                    add(key, v.unwrap_or(0.0), per);
                }
                let missing = part.iter().any(|r| !dpo_ref.contains_key(&r.index));
                let (rc, rr) = if missing || !self.cfg.dpo.precompute_ref_log_probs {
                    let reference = self
                        .reference
                        .as_ref()
                        .context("DPO needs the reference model")?;
                    let r = self
                        .summed_logps(reference, &prompts, &comps)?
                        .detach()
                        .to_dtype(DType::F64)?;
                    let v: Vec<f64> = r.to_vec1()?;
                    if self.cfg.dpo.precompute_ref_log_probs {
                        for (i, row) in part.iter().enumerate() {
                            dpo_ref.insert(row.index, (v[i], v[k + i]));
                        }
                    }
                    (v[..k].to_vec(), v[k..].to_vec())
                } else {
                    part.iter().map(|r| dpo_ref[&r.index]).unzip()
                };
                let dt = pol.dtype();
                let dev = pol.device().clone();
                let rc = Tensor::from_vec(rc, k, &dev)?.to_dtype(dt)?;
                let rr = Tensor::from_vec(rr, k, &dev)?.to_dtype(dt)?;
                // Completion tokens of each pair's two sides (ipo, sigmoid_norm, sft).
                let count = |f: &dyn Fn(&Row) -> usize| -> Result<Tensor> {
                    let n: Vec<f64> = part.iter().map(|r| f(r) as f64).collect();
                    Ok(Tensor::from_vec(n, k, &dev)?.to_dtype(dt)?)
                };
                let nc = count(&|r| r.completion.len())?;
                let nr = count(&|r| r.rejected.len())?;
                let out = dpo_loss_with(
                    &DpoInputs {
                        policy_chosen: &pol.narrow(0, 0, k)?,
                        policy_rejected: &pol.narrow(0, k, k)?,
                        reference_chosen: &rc,
                        reference_rejected: &rr,
                        chosen_tokens: Some(&nc),
                        rejected_tokens: Some(&nr),
                        pair_weights: pair_weights.as_ref(),
                    },
                    &self.cfg.dpo.dpo_config(),
                )?;
                for (k, v) in out.metrics() {
                    add(k, v, share);
                }
                (out.loss * share)?
            } else if pairs {
                let out =
                    grpo_rollout::moe::recording(aux.clone(), || self.pair_loss(&model, part))?;
                for (k, v) in out.metrics() {
                    add(k, v, share);
                }
                (out.loss * share)?
            } else if prm {
                let (loss, correct) = self.prm_loss(&model, part, labelled)?;
                add("accuracy", correct / labelled.max(1.0), 1.0);
                loss
            } else if reward {
                // TRL's RewardTrainer: chosen and rejected scored in one batch.
                let seqs: Vec<&[u32]> = part
                    .iter()
                    .map(|r| r.completion.as_slice())
                    .chain(part.iter().map(|r| r.rejected.as_slice()))
                    .collect();
                let k = b - a;
                let scores = model
                    .sequence_scores(&seqs, Some(self.tokenizer.pad_token_id))?
                    .to_dtype(DType::F32)?;
                let margins: Vec<f32> = part.iter().map(|r| r.margin as f32).collect();
                let margin = Tensor::from_vec(margins, k, scores.device())?;
                let out = grpo_core::preference::reward_loss(
                    &scores.narrow(0, 0, k)?,
                    &scores.narrow(0, k, k)?,
                    Some(&margin),
                    self.cfg.reward.center_rewards_coefficient,
                )?;
                add("accuracy", out.accuracy, share);
                add("margin", out.margin, share);
                add("min_reward", out.min_reward, share);
                add("mean_reward", out.mean_reward, share);
                add("max_reward", out.max_reward, share);
                (out.loss * share)?
            } else if kto {
                let prompts: Vec<&[u32]> = part.iter().map(|r| r.prompt.as_slice()).collect();
                let comps: Vec<&[u32]> = part.iter().map(|r| r.completion.as_slice()).collect();
                let reference = self
                    .reference
                    .as_ref()
                    .context("KTO needs the reference model")?;
                let pad = self.tokenizer.pad_token_id;
                let (st, c) = grpo_rollout::moe::recording(aux.clone(), || {
                    completion_stats(&model, pad, &prompts, &comps)
                })?;
                let pol = self.summed(&st.logps, &comps, c)?;
                // KTOTrainer's token metrics, per micro-batch: the entropy over every
                // completion token, each side's mean logit where the side has tokens.
                let tok_mask = completion_mask(&comps, c, st.logps.device())?;
                let side = |want: bool| -> Result<Tensor> {
                    let rows: Vec<f32> = part
                        .iter()
                        .map(|r| f32::from(u8::from(r.desirable == want)))
                        .collect();
                    let rows = Tensor::from_vec(rows, (part.len(), 1), st.logps.device())?;
                    Ok(tok_mask.broadcast_mul(&rows)?)
                };
                let means = masked_means(&[
                    (&st.entropy, &tok_mask),
                    (&st.mean_logits, &side(true)?),
                    (&st.mean_logits, &side(false)?),
                ])?;
                add(
                    "entropy",
                    means[0].unwrap_or(0.0),
                    1.0 / chunks.len() as f64,
                );
                for (slot, v) in [(0, means[1]), (2, means[2])] {
                    if let Some(v) = v {
                        kto_logits[slot] += v;
                        kto_logits[slot + 1] += 1.0;
                    }
                }
                // The cache (`kto.precompute_ref_log_probs`) holds a row index's desirable
                // completion's reference log-prob first, its undesirable one's second.
                let slot = |r: &Row, v: &(f64, f64)| if r.desirable { v.0 } else { v.1 };
                let cached: Option<Vec<f64>> = part
                    .iter()
                    .map(|r| {
                        let v = dpo_ref.get(&r.index)?;
                        let x = slot(r, v);
                        (!x.is_nan()).then_some(x)
                    })
                    .collect();
                let precompute = self.cfg.kto.precompute_ref_log_probs;
                let refl = match cached.filter(|_| precompute) {
                    Some(v) => {
                        Tensor::from_vec(v, part.len(), pol.device())?.to_dtype(pol.dtype())?
                    }
                    None => {
                        let r = self
                            .summed_logps(reference, &prompts, &comps)?
                            .detach()
                            .to_dtype(pol.dtype())?;
                        if precompute {
                            let v: Vec<f64> = r.to_dtype(DType::F64)?.to_vec1()?;
                            for (row, x) in part.iter().zip(v) {
                                let e = dpo_ref.entry(row.index).or_insert((f64::NAN, f64::NAN));
                                match row.desirable {
                                    true => e.0 = x,
                                    false => e.1 = x,
                                }
                            }
                        }
                        r
                    }
                };
                let cfg = self.cfg.kto.kto_config();
                let desirable: Vec<bool> = part.iter().map(|r| r.desirable).collect();
                // TRL's KL estimate: each prompt with the completion of the row before it (the
                // first with the last), policy − reference, averaged, clamped at 0; no gradient.
                let kl = if bco {
                    0.0
                } else if cfg.loss_type.uses_kl() {
                    let k = comps.len();
                    let shifted: Vec<&[u32]> = (0..k).map(|i| comps[(i + k - 1) % k]).collect();
                    let p = self.summed_logps(&self.policy.model.detached(), &prompts, &shifted)?;
                    let r = self.summed_logps(reference, &prompts, &shifted)?;
                    let d = (p - r.to_dtype(pol.dtype()))?
                        .mean_all()?
                        .to_dtype(DType::F64)?
                        .to_scalar::<f64>()?;
                    d.max(0.0)
                } else {
                    0.0
                };
                let out = if bco {
                    // BCO's δ: the running mean of the implicit rewards, this micro-batch's
                    // merged in first while training (TRL's `running.update`).
                    let beta = cfg.beta;
                    let rewards: Vec<f64> = ((pol.detach() - &refl)? * beta)?
                        .to_dtype(DType::F64)?
                        .to_vec1()?;
                    let running = self.state.bco_running.get_or_insert_default();
                    if train {
                        running.update(&rewards);
                    }
                    let delta = running.mean;
                    bco_delta += delta * share;
                    let weights = self.udm_weights(part)?;
                    if let Some(w) = &weights {
                        let bad: Vec<f64> = w
                            .iter()
                            .zip(&desirable)
                            .filter(|p| !*p.1)
                            .map(|p| *p.0)
                            .collect();
                        if !bad.is_empty() {
                            udm_weight += bad.iter().sum::<f64>() / bad.len() as f64 * share;
                        }
                    }
                    bco_loss_weighted(&pol, &refl, &desirable, beta, delta, weights.as_deref())?
                } else {
                    kto_loss(&pol, &refl, &desirable, kl, &cfg)?
                };
                kto_kl += kl * share;
                for (slot, v) in kto_sums.iter_mut().zip([
                    out.chosen_rewards.0,
                    out.chosen_logps,
                    out.chosen_rewards.1 as f64,
                    out.rejected_rewards.0,
                    out.rejected_logps,
                    out.rejected_rewards.1 as f64,
                ]) {
                    *slot += v;
                }
                (out.loss * share)?
            } else {
                // TRL's `padding_free`: the micro-batch's rows as one sequence, kept apart.
                // A model with linear-attention layers carries a state along a row, which a
                // packed row's sequences must not share: it runs them padded, each on its own
                // (`bfd` packing's too: the same losses).
                let recurrent = model.cfg.recurrent();
                let flat: Vec<Row>;
                let part = match (recurrent, self.cfg.sft.padding_free) {
                    (true, _) if part.iter().any(|r| !r.segments.is_empty()) => {
                        flat = part.iter().flat_map(unpacked).collect();
                        &flat[..]
                    }
                    (false, true) if part.iter().all(|r| r.segments.is_empty()) => {
                        flat = one_sequence(part).into_iter().collect();
                        &flat[..]
                    }
                    _ => part,
                };
                let prompts: Vec<&[u32]> = part.iter().map(|r| r.prompt.as_slice()).collect();
                let comps: Vec<&[u32]> = part.iter().map(|r| r.completion.as_slice()).collect();
                let pad = self.tokenizer.pad_token_id;
                let (st, c) = grpo_rollout::moe::recording(aux.clone(), || {
                    match part.iter().any(|r| !r.segments.is_empty()) {
                        true => packed_logps(&model, pad, part),
                        false => completion_stats(&model, pad, &prompts, &comps),
                    }
                })?;
                let lp = &st.logps;
                let masks: Vec<&[u8]> = part.iter().map(|r| r.mask.as_slice()).collect();
                let mask = mask_tensor(&masks, c, lp.dtype(), lp.device())?;
                // TRL's SFT metrics: the mean entropy and top-1 accuracy over the loss
                // tokens of each micro-batch, averaged over the step's micro-batches.
                let per = 1.0 / chunks.len() as f64;
                let means = masked_means(&[(&st.entropy, &mask), (&st.top1, &mask)])?;
                add("entropy", means[0].unwrap_or(0.0), per);
                add("mean_token_accuracy", means[1].unwrap_or(0.0), per);
                sft_loss_typed(lp, &mask, Some(total_tokens), self.cfg.sft.loss_type)?
            };
            // The loss's value with TRL's `coef · aux / accumulation steps`.
            let loss = match &aux {
                Some(c) => {
                    let (loss, aux_loss) = c.add_to(loss)?;
                    add("aux_loss", aux_loss, 1.0 / chunks.len() as f64);
                    loss
                }
                None => loss,
            };
            let lv = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            if !lv.is_finite() {
                bail!("non-finite loss ({lv}) at step {}", self.state.step + 1);
            }
            add("loss", lv, 1.0);
            if train {
                let grads = self.policy.model.backward(&loss)?;
                drop(loss);
                self.opt.accumulate(&mut acc, &grads)?;
            }
        }
        if kto {
            // TRL's KTO metrics: means over the desirable and the undesirable rows.
            let [cr, cl, cn, rr, rl, rn] = kto_sums;
            match bco {
                true => {
                    if self.state.bco_udm.is_some() {
                        m.insert("udm/rejected_weight".into(), udm_weight);
                    }
                    m.insert("delta".into(), bco_delta)
                }
                false => m.insert("kl".into(), kto_kl),
            };
            if cn > 0.0 {
                m.insert("rewards/chosen".into(), cr / cn);
                m.insert("logps/chosen".into(), cl / cn);
            }
            if rn > 0.0 {
                m.insert("rewards/rejected".into(), rr / rn);
                m.insert("logps/rejected".into(), rl / rn);
            }
            if cn > 0.0 && rn > 0.0 {
                m.insert("rewards/margins".into(), cr / cn - rr / rn);
            }
            let [lc, nc, lr, nr] = kto_logits;
            if nc > 0.0 {
                m.insert("logits/chosen".into(), lc / nc);
            }
            if nr > 0.0 {
                m.insert("logits/rejected".into(), lr / nr);
            }
        }
        if train {
            let grad_norm = clip_grad_norm(&mut acc, self.cfg.optim.max_grad_norm)?;
            if !grad_norm.is_finite() {
                bail!("non-finite gradient norm at step {}", self.state.step + 1);
            }
            let lr = self.schedule.lr_at(self.state.optimizer_steps);
            self.opt.step(&acc, lr)?;
            self.state.optimizer_steps += 1;
            self.bema_after_update()?;
            m.insert("grad_norm".into(), grad_norm);
            m.insert("learning_rate".into(), lr);
            let tokens: usize = rows
                .iter()
                .map(|r| {
                    let rp =
                        match r.rejected.is_empty() || !self.cfg.algorithm.reference_free_pairs() {
                            true => 0,
                            false if r.rejected_prompt.is_empty() => r.prompt.len(),
                            false => r.rejected_prompt.len(),
                        };
                    r.prompt.len() + r.completion.len() + rp + r.rejected.len()
                })
                .sum();
            self.state.num_tokens += tokens as u64;
            m.insert("num_tokens".into(), self.state.num_tokens as f64);
        }
        Ok(m)
    }
}

/// SFT and DPO runs: the data stream → tokenised rows → one learner step each, with the GRPO
/// run's directory, logs, checkpoints, resume, progress, callbacks and evaluation.
pub fn run(
    setup: Setup,
    opts: &RunOptions,
    callbacks: &mut dyn Callbacks,
) -> Result<TrainingResult> {
    let (mut learner, run_dir) = crate::run_dir::open_run(&setup, opts)?;
    let mut loader = Loader::new(&setup, learner.state.step, learner.state.position)?;
    let mut dpo_ref: HashMap<u64, (f64, f64)> = HashMap::new();
    let mut ends = StepEnd::begin(&setup.cfg, opts, callbacks, &learner, &run_dir)?;
    let outcome = (|| -> Result<()> {
        if let Some((good, bad)) = learner.udm_fit(&setup).context(Stage::Learner)? {
            eprintln!(
                "BCO UDM classifier: accuracy {good:.3} on desirable prompts, {bad:.3} on undesirable ones"
            );
        }
        while let Some(batch) = loader.process().context(Stage::Data)? {
            let t0 = Instant::now();
            let rows = rows(&setup.cfg, &setup.tokenizer, &batch.samples).context(Stage::Data)?;
            if rows.is_empty() {
                let c = &setup.cfg;
                let (max, why) = match c.algorithm {
                    Algorithm::Dpo => (c.dpo.max_length, "a prompt fills it"),
                    Algorithm::Kto | Algorithm::Bco => (c.kto.max_length, "a prompt fills it"),
                    Algorithm::Reward => (c.reward.max_length, "a side of each pair is longer"),
                    Algorithm::Prm => (c.prm.max_length, "no labelled step is left"),
                    Algorithm::Orpo => (c.orpo.max_length, "a prompt fills it"),
                    Algorithm::Cpo => (c.cpo.max_length, "a prompt fills it"),
                    Algorithm::Tpo => (c.tpo.max_length, "a prompt fills it"),
                    _ => (
                        c.sft.max_length,
                        "a prompt fills it, or no loss token is left",
                    ),
                };
                eprintln!(
                    "step {}: all {} rows left nothing to train on within {}.max_length = \
                     {max} ({why}): no update at this step",
                    batch.step + 1,
                    batch.samples.len(),
                    c.algorithm,
                );
            }
            ends.step_begin(&learner);
            let m = learner
                .supervised_step(&rows, &mut dpo_ref, true)
                .context(Stage::Learner)?;
            learner.state.step = batch.step + 1;
            // TR-DPO (`reference.sync_ref_model`): the reference moves toward the policy.
            learner.sync_reference().context(Stage::Learner)?;
            learner.state.position = Some(batch.position);
            let secs = t0.elapsed().as_secs_f64();
            let eval = |l: &mut Learner| {
                let ev = setup.eval.as_ref()?;
                Some(evaluate(&setup, l, ev, &mut dpo_ref))
            };
            if ends
                .step_end(&mut learner, m, Vec::new(), None, secs, eval)
                .context(Stage::Learner)?
            {
                break;
            }
        }
        Ok(())
    })();
    match outcome {
        Ok(()) => ends.finish(&learner),
        Err(e) => Err(ends.fail(&mut learner, e)),
    }
}

/// The loss (and, for SFT, the perplexity; for DPO the reward metrics) on the eval split,
/// without updates: `eval/loss`, `eval/perplexity`, `eval/rewards/accuracies`, ...
pub fn evaluate(
    setup: &Setup,
    learner: &mut Learner,
    eval: &grpo_data::Dataset,
    dpo_ref: &mut HashMap<u64, (f64, f64)>,
) -> Result<Metrics> {
    let sc = grpo_data::StreamConfig {
        seed: setup.cfg.train.seed,
        shuffle: false,
        batch_size: setup.cfg.train.prompts_per_step,
        epochs: Some(1),
        ..Default::default()
    };
    let mut stream = grpo_data::SampleStream::new(eval.clone(), sc).map_err(|e| anyhow!("{e}"))?;
    // Each batch's metrics weigh 1, but PRM's as transformers' evaluation loop weighs them: the
    // loss by the batch's rows, the accuracy by its labelled tokens (TRL's `compute_accuracy`
    // over the whole split).
    let prm = setup.cfg.algorithm == Algorithm::Prm;
    let mut sums: Metrics = Metrics::new();
    let mut weights: Metrics = Metrics::new();
    let mut batches = 0.0;
    while let Some(samples) = stream.next_batch().map_err(|e| anyhow!("{e}"))? {
        let packing = setup.cfg.sft.eval_packing.unwrap_or(setup.cfg.sft.packing);
        let rows = match setup.cfg.algorithm {
            // Evaluation reads every step's label (TRL's `is_eval`).
            Algorithm::Prm => prm_rows(&setup.cfg, &setup.tokenizer, &samples, true)?,
            _ => rows_packed(&setup.cfg, &setup.tokenizer, &samples, packing)?,
        };
        if rows.is_empty() {
            continue;
        }
        let m = learner.supervised_step(&rows, dpo_ref, false)?;
        let labelled = labelled_tokens(&rows);
        for (k, v) in m {
            let w = match (prm, k.as_str()) {
                (true, "accuracy") => labelled,
                (true, _) => rows.len() as f64,
                (false, _) => 1.0,
            };
            *sums.entry(k.clone()).or_insert(0.0) += v * w;
            *weights.entry(k).or_insert(0.0) += w;
        }
        batches += 1.0;
    }
    let mut out = Metrics::new();
    for (k, v) in sums {
        let w = match prm {
            true => weights.get(&k).copied().unwrap_or(1.0),
            false => batches,
        };
        out.insert(format!("eval/{k}"), v / f64::max(w, 1e-12));
    }
    if setup.cfg.algorithm == Algorithm::Sft
        && let Some(l) = out.get("eval/loss").copied()
    {
        out.insert("eval/perplexity".into(), l.exp());
    }
    out.insert("step".into(), learner.state.step as f64);
    Ok(out)
}
