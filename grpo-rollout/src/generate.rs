//! Batched sampling with a KV cache: prompts × `num_generations` completions.
//!
//! Each prompt is prefilled once and its cache shared by its `G` samples; finished rows leave
//! the batch. Sampling follows transformers' `generate` (repetition penalty, then temperature,
//! top-k, top-p, min-p); each row has its own seeded ChaCha stream, so the same seed gives the
//! same tokens whatever the batch. The recorded log-prob of each sampled token is
//! `log_softmax(logits / temperature)` of the model's raw logits (no penalty, no filtering):
//! the "old" log-prob the learner's importance ratio compares with.

use candle_core::{DType, Device, Result, Tensor, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use rayon::prelude::*;

use crate::constrain::RegexConstraint;
use crate::model::{KvCache, Transformer, attention_mask_value, padded_positions_and_bias};
use crate::sample::{DeviceSampler, Pick, sample_row};
use crate::tokenizer::Tokenizer;
use regex_automata::util::primitives::StateID;

/// Sampling knobs (TRL / transformers names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SamplingParams {
    /// Maximum completion tokens.
    pub max_new_tokens: usize,
    /// EOS and stop tokens are suppressed until this many tokens exist.
    pub min_new_tokens: usize,
    /// 0 = greedy.
    pub temperature: f64,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Nucleus sampling mass; 1.0 = off.
    pub top_p: f64,
    /// Drop tokens below `min_p × p_max`; 0.0 = off.
    pub min_p: f64,
    /// transformers' repetition penalty over prompt and completion tokens; 1.0 = off.
    pub repetition_penalty: f64,
    /// Extra stop token ids (the tokenizer's EOS ids always stop).
    pub stop_token_ids: Vec<u32>,
    /// Stop strings; the completion's text ends before the first one.
    pub stop: Vec<String>,
    /// Seed of the per-row random streams.
    pub seed: u64,
    /// Most likely alternatives recorded per sampled token (OpenAI's `logprobs` /
    /// `top_logprobs`), each with `log_softmax(logits / temperature)`; 0 = none.
    pub top_logprobs: usize,
    /// OpenAI's `logit_bias`: `(token id, bias)` pairs added to the logits before the
    /// repetition penalty and sampling (+100 all but forces a token, -100 all but bans it). The
    /// recorded log-probs are the model's own and do not see it.
    #[serde(skip_serializing_if = "Vec::is_empty")]
    pub logit_bias: Vec<(u32, f32)>,
    /// vLLM's `structured_outputs.regex` (TRL's `vllm_structured_outputs_regex`): each
    /// completion's text matches this pattern (Rust `regex` syntax) from its first byte to its
    /// last; the stop tokens are allowed only where it has matched ([`crate::constrain`]).
    /// The recorded log-probs are the model's own and do not see the mask.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub regex: Option<String>,
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            max_new_tokens: 256,
            min_new_tokens: 0,
            temperature: 1.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            stop_token_ids: Vec::new(),
            stop: Vec::new(),
            seed: 0,
            top_logprobs: 0,
            logit_bias: Vec::new(),
            regex: None,
        }
    }
}

impl SamplingParams {
    /// Checks the values, naming the field to fix.
    pub fn validate(&self) -> Result<()> {
        if !(self.temperature >= 0.0 && self.temperature.is_finite()) {
            bail!("temperature must be >= 0, got {}", self.temperature);
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            bail!("top_p must be in (0, 1], got {}", self.top_p);
        }
        if !(0.0..=1.0).contains(&self.min_p) {
            bail!("min_p must be in [0, 1], got {}", self.min_p);
        }
        if self.repetition_penalty <= 0.0 {
            bail!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            );
        }
        if self.min_new_tokens > self.max_new_tokens {
            bail!(
                "min_new_tokens ({}) exceeds max_new_tokens ({})",
                self.min_new_tokens,
                self.max_new_tokens
            );
        }
        if let Some((id, b)) = self
            .logit_bias
            .iter()
            .find(|(_, b)| !(-100.0..=100.0).contains(b))
        {
            bail!("logit_bias of token {id} must be in [-100, 100], got {b}");
        }
        // (A `regex` is compiled, and a bad one refused, where generation starts.)
        Ok(())
    }
}

/// Why a completion ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// An EOS / stop token was sampled (it is the last token id).
    Eos,
    /// A stop string appeared.
    Stop,
    /// `max_new_tokens` reached.
    Length,
}

/// One sampled completion.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Completion {
    /// Which prompt.
    pub prompt_index: usize,
    /// Which of its `num_generations` samples.
    pub sample_index: usize,
    /// Sampled token ids (an EOS token, when sampled, is included).
    pub token_ids: Vec<u32>,
    /// Decoded text without special tokens, cut before a stop string.
    pub text: String,
    /// `log_softmax(logits / temperature)` of each sampled token.
    pub logprobs: Vec<f32>,
    /// Why it ended.
    pub finish_reason: FinishReason,
    /// With `top_logprobs` = k > 0: per token, the k most likely `(token, log-prob)`, best first.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub top_logprobs: Vec<Vec<(u32, f32)>>,
}

/// One prompt of a [`generate_batch`] call: how many samples, and their random streams (sample
/// `j` draws from ChaCha8 seeded with `seed`, stream `first_stream + j`).
#[derive(Debug, Clone, Copy)]
pub struct PromptRequest<'a> {
    /// Prompt token ids (at least one).
    pub ids: &'a [u32],
    /// Samples of this prompt.
    pub n: usize,
    /// Seed of its samples' streams.
    pub seed: u64,
    /// Stream of its first sample.
    pub first_stream: u64,
}

struct Row {
    prompt_index: usize,
    sample_index: usize,
    rng: ChaCha8Rng,
    seen: Vec<u32>,
    tokens: Vec<u32>,
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
    /// Its DFA state under a regex constraint (unused without one).
    state: StateID,
}

/// Samples `num_generations` completions for each prompt (token ids, no padding).
///
/// The model should be a detached copy ([`Transformer::detached`]) so no graph is recorded.
pub fn generate(
    model: &Transformer,
    tokenizer: &Tokenizer,
    prompts: &[Vec<u32>],
    num_generations: usize,
    params: &SamplingParams,
) -> Result<Vec<Completion>> {
    let requests: Vec<PromptRequest<'_>> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| PromptRequest {
            ids: p,
            n: num_generations,
            seed: params.seed,
            first_stream: (i * num_generations) as u64,
        })
        .collect();
    generate_batch(model, tokenizer, &requests, params)
}

/// [`generate`] with a sample count and random streams per prompt (what a server batching
/// independent requests needs: each request's samples do not depend on its batch). Completions
/// come back grouped by prompt (`prompt_index` = position in `requests`), then by sample.
/// `params.seed` is not used: each request carries its own.
pub fn generate_batch(
    model: &Transformer,
    tokenizer: &Tokenizer,
    requests: &[PromptRequest<'_>],
    params: &SamplingParams,
) -> Result<Vec<Completion>> {
    generate_batch_with(model, tokenizer, requests, params, &mut |_| true)
}

/// One sampled token of one row, as [`generate_batch_with`] reports it.
#[derive(Debug, Clone, Copy)]
pub struct TokenEvent<'a> {
    /// Which request (position in `requests`).
    pub prompt_index: usize,
    /// Which of its samples.
    pub sample_index: usize,
    /// The row's tokens so far, the new one last.
    pub token_ids: &'a [u32],
    /// Their recorded log-probs.
    pub logprobs: &'a [f32],
    /// Their top alternatives (empty without `top_logprobs`).
    pub top_logprobs: &'a [Vec<(u32, f32)>],
    /// The finished completion, when this token ended the row.
    pub finished: Option<&'a Completion>,
}

/// [`generate_batch`] that reports each token as it is sampled (what a streaming server
/// needs): after every decode step, `on_token` sees each row's new token, in row order. It
/// answers whether the row is still wanted; a row no longer wanted (its client has gone) leaves
/// the batch at once and has no completion in the result.
pub fn generate_batch_with(
    model: &Transformer,
    tokenizer: &Tokenizer,
    requests: &[PromptRequest<'_>],
    params: &SamplingParams,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
) -> Result<Vec<Completion>> {
    decode_loop(model, None, tokenizer, requests, params, on_token)
}

/// The geometric mixture of two models that [`generate_mixture`] samples from (TRL's
/// `GeometricMixtureWrapper`, Nash-MD's "mixture policy").
#[derive(Debug, Clone, Copy)]
pub struct GeometricMixture<'a> {
    /// The second model (Nash-MD: the frozen reference), with the same vocabulary.
    pub reference: &'a Transformer,
    /// Its weight `c` in `[0, 1]`: each next token is drawn from
    /// `log_softmax(c · reference logits + (1 − c) · model logits)`, which then goes through
    /// the sampling knobs as a model's logits would.
    pub coef: f64,
}

/// [`generate_batch`] from the geometric mixture of `model` and `mixture.reference`: both
/// models decode each row in lockstep (each with its own KV cache) and every token is drawn
/// from `log_softmax(c · reference + (1 − c) · model)` of their logits. The recorded log-probs
/// are the mixture's. `c = 0` samples as `model` alone does (the same tokens for the same
/// seeds), `c = 1` as the reference alone.
pub fn generate_mixture(
    model: &Transformer,
    mixture: GeometricMixture<'_>,
    tokenizer: &Tokenizer,
    requests: &[PromptRequest<'_>],
    params: &SamplingParams,
) -> Result<Vec<Completion>> {
    let c = mixture.coef;
    if !(0.0..=1.0).contains(&c) {
        bail!("the mixture coefficient must be in [0, 1], got {c}");
    }
    let (v, rv) = (model.cfg.vocab_size, mixture.reference.cfg.vocab_size);
    if v != rv {
        bail!(
            "a geometric mixture needs one vocabulary: the model has {v} tokens, the reference {rv}"
        );
    }
    decode_loop(
        model,
        Some(mixture),
        tokenizer,
        requests,
        params,
        &mut |_| true,
    )
}

/// The decode loop of [`generate_batch_with`] and [`generate_mixture`].
fn decode_loop(
    model: &Transformer,
    mixture: Option<GeometricMixture<'_>>,
    tokenizer: &Tokenizer,
    requests: &[PromptRequest<'_>],
    params: &SamplingParams,
    on_token: &mut dyn FnMut(TokenEvent<'_>) -> bool,
) -> Result<Vec<Completion>> {
    params.validate()?;
    if let Some(i) = requests.iter().position(|r| r.ids.is_empty()) {
        bail!("prompt {i} is empty: a prompt needs at least one token");
    }
    // Prompts without samples take no part.
    let live: Vec<usize> = (0..requests.len()).filter(|&i| requests[i].n > 0).collect();
    if live.is_empty() {
        return Ok(Vec::new());
    }
    let prompts: Vec<&[u32]> = live.iter().map(|&i| requests[i].ids).collect();
    let counts: Vec<usize> = live.iter().map(|&i| requests[i].n).collect();
    let decoding = model.for_decoding()?;
    let model = &decoding;
    let device = model.device().clone();
    let vocab = model.cfg.vocab_size;
    let stop_ids = stop_ids(tokenizer, params);
    let pad = tokenizer.pad_token_id;
    let mut constraint = RegexConstraint::for_params(params, tokenizer, vocab, &stop_ids)?;
    let start = constraint
        .as_ref()
        .map_or(StateID::ZERO, RegexConstraint::start);

    // Prefill each prompt once, its cache shared across its samples.
    let mut state = prefill(model, pad, &prompts, &counts, params.max_new_tokens)?;
    // The mixture's second model decodes the same rows beside it.
    let mut second = match mixture {
        Some(m) => {
            let reference = m.reference.for_decoding()?;
            let s = prefill(&reference, pad, &prompts, &counts, params.max_new_tokens)?;
            Some((reference, s, crate::graph::Decoder::default(), m.coef))
        }
        None => None,
    };
    // A row of the batch: `None` once it has finished and until the batch is compacted.
    let mut rows: Vec<Option<Row>> = Vec::with_capacity(counts.iter().sum());
    for (p, &i) in live.iter().enumerate() {
        let req = &requests[i];
        for j in 0..req.n {
            rows.push(Some(Row {
                prompt_index: i,
                sample_index: j,
                rng: row_rng(req.seed, req.first_stream + j as u64),
                seen: prompts[p].to_vec(),
                tokens: Vec::new(),
                logprobs: Vec::new(),
                top: Vec::new(),
                state: start,
            }));
        }
    }
    let mut sampler = if device_sampling(&device) {
        let seen: Vec<&[u32]> = rows.iter().flatten().map(|r| r.seen.as_slice()).collect();
        Some(DeviceSampler::new(
            params, vocab, &stop_ids, &seen, &device,
        )?)
    } else {
        None
    };
    let mut done: Vec<Completion> = Vec::with_capacity(rows.len());
    let retire = retire_every(&device, rows.len());
    // On a GPU, steps replay a CUDA graph captured after one eager step at each batch size.
    let mut decoder = crate::graph::Decoder::default();

    loop {
        // Each row draws one uniform per step from its own stream (none when greedy), so the
        // result depends neither on the batch nor on where the sampling runs.
        // (Finished rows still in the batch draw nothing; what they sample is dropped.)
        let draws: Vec<f32> = rows
            .iter_mut()
            .map(|r| r.as_mut().map_or(0.5, |r| draw_uniform(&mut r.rng, params)))
            .collect();
        // Under a regex, each row's allowed set (its slot); a complete text ends however short.
        let slots = match constraint.as_mut() {
            Some(c) => c.slots(rows.iter().map(|r| r.as_ref().map(|r| r.state))),
            None => Vec::new(),
        };
        let short: Vec<bool> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.as_ref()
                    .is_some_and(|r| r.tokens.len() < params.min_new_tokens)
                    && constraint
                        .as_ref()
                        .is_none_or(|c| !c.allowed(slots[i]).only_stop)
            })
            .collect();
        let seen: Vec<&[u32]> = rows
            .iter()
            .map(|r| r.as_ref().map_or(&[][..], |r| r.seen.as_slice()))
            .collect();
        let mixed = match &second {
            Some((_, s, _, c)) => Some(mixed_logits(&state.logits, &s.logits, vocab, *c)?),
            None => None,
        };
        let (picks, sampled) = pick_tokens(
            mixed.as_ref().unwrap_or(&state.logits),
            params,
            vocab,
            &stop_ids,
            sampler.as_mut(),
            &seen,
            &draws,
            &short,
            constraint.as_mut().map(|c| (c, slots.as_slice())),
        )?;
        // Finished rows (and rows no longer wanted) retire: out of the batch (and the cache)
        // once `retire` of them have finished; the rest go on.
        for (slot, (tok, lp_tok, top)) in rows.iter_mut().zip(picks) {
            let Some(mut row) = slot.take() else {
                continue;
            };
            row.tokens.push(tok);
            row.logprobs.push(lp_tok);
            if params.top_logprobs > 0 {
                row.top.push(top);
            }
            row.seen.push(tok);
            if let Some(c) = &constraint {
                row.state = c.advance(row.state, tok);
            }
            let mut reason = None;
            if stop_ids.binary_search(&tok).is_ok() && row.tokens.len() >= params.min_new_tokens {
                reason = Some(FinishReason::Eos);
            } else if !params.stop.is_empty() {
                let text = tokenizer.decode(&row.tokens, false)?;
                if contains_stop(&text, &params.stop) {
                    reason = Some(FinishReason::Stop);
                }
            }
            if reason.is_none() && row.tokens.len() >= params.max_new_tokens {
                reason = Some(FinishReason::Length);
            }
            match reason {
                Some(reason) => {
                    let c = finish(row, reason, tokenizer, params)?;
                    on_token(TokenEvent {
                        prompt_index: c.prompt_index,
                        sample_index: c.sample_index,
                        token_ids: &c.token_ids,
                        logprobs: &c.logprobs,
                        top_logprobs: &c.top_logprobs,
                        finished: Some(&c),
                    });
                    done.push(c);
                }
                None => {
                    let wanted = on_token(TokenEvent {
                        prompt_index: row.prompt_index,
                        sample_index: row.sample_index,
                        token_ids: &row.tokens,
                        logprobs: &row.logprobs,
                        top_logprobs: &row.top,
                        finished: None,
                    });
                    if wanted {
                        *slot = Some(row);
                    }
                }
            }
        }
        let keep: Vec<u32> = (0..rows.len() as u32)
            .filter(|&i| rows[i as usize].is_some())
            .collect();
        if keep.is_empty() {
            break;
        }
        let mut step_ids = match sampled {
            Some(ids) => ids,
            None => {
                let ids: Vec<u32> = rows
                    .iter()
                    .map(|r| {
                        r.as_ref()
                            .and_then(|r| r.tokens.last().copied())
                            .unwrap_or(pad)
                    })
                    .collect();
                Tensor::from_vec(ids, rows.len(), &device)?
            }
        };
        if rows.len() - keep.len() >= retire {
            decoder.resize(&mut state)?;
            let keep_t = Tensor::new(keep.as_slice(), &device)?;
            state.keep_rows(&keep_t)?;
            step_ids = step_ids.index_select(&keep_t, 0)?;
            if let Some(s) = sampler.as_mut() {
                s.select_rows(&keep_t)?;
            }
            if let Some((_, s, d, _)) = second.as_mut() {
                d.resize(s)?;
                s.keep_rows(&keep_t)?;
            }
            rows.retain(Option::is_some);
            // The larger cache just freed goes back to the driver before the next step's
            // graph (its memory the driver's, not the pool's) is captured at the new size.
            grpo_core::memlog::release_unused(&device);
        }
        decoder.step(model, &mut state, &step_ids)?;
        if let Some((reference, s, d, _)) = second.as_mut() {
            d.step(reference, s, &step_ids)?;
        }
    }
    done.sort_by_key(|c| (c.prompt_index, c.sample_index));
    Ok(done)
}

/// `log_softmax(c · reference + (1 − c) · model)` over the first `vocab` columns, in f32.
fn mixed_logits(model: &Tensor, reference: &Tensor, vocab: usize, c: f64) -> Result<Tensor> {
    let m = model.narrow(1, 0, vocab)?.to_dtype(DType::F32)?;
    let r = reference.narrow(1, 0, vocab)?.to_dtype(DType::F32)?;
    let z = ((m * (1.0 - c))? + (r * c)?)?;
    let shifted = z.broadcast_sub(&z.max_keepdim(1)?)?;
    shifted.broadcast_sub(&shifted.exp()?.sum_keepdim(1)?.log()?)
}

/// The tokenizer's EOS ids and `params.stop_token_ids`, sorted, without repeats.
pub(crate) fn stop_ids(tokenizer: &Tokenizer, params: &SamplingParams) -> Vec<u32> {
    let mut stop_ids: Vec<u32> = tokenizer.eos_token_ids.clone();
    stop_ids.extend(&params.stop_token_ids);
    stop_ids.sort_unstable();
    stop_ids.dedup();
    stop_ids
}

/// Whether `text` contains one of the (non-empty) stop strings.
pub(crate) fn contains_stop(text: &str, stop: &[String]) -> bool {
    stop.iter()
        .any(|s| !s.is_empty() && text.contains(s.as_str()))
}

/// A row's random stream: ChaCha8 seeded with `seed`, stream `stream`.
pub(crate) fn row_rng(seed: u64, stream: u64) -> ChaCha8Rng {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    rng.set_stream(stream);
    rng
}

/// A row's uniform draw for one step (none, 0, when greedy).
pub(crate) fn draw_uniform(rng: &mut ChaCha8Rng, params: &SamplingParams) -> f32 {
    if params.temperature > 0.0 {
        rng.random::<f32>()
    } else {
        0.0
    }
}

/// The device side of a batch of rows being decoded.
pub(crate) struct DecodeState {
    /// Every row's keys and values.
    pub(crate) cache: KvCache,
    /// `(rows, cached)` f32: 0 for a row's real keys, the mask value for its padding.
    pub(crate) key_bias: Tensor,
    /// `(rows, 1)` u32: the position of each row's next input token.
    pub(crate) next_pos: Tensor,
    /// `(rows, V)`: the logits each row's next token is drawn from.
    pub(crate) logits: Tensor,
}

/// Prefills each prompt once (left padded, in one forward) and repeats its cache, key bias,
/// next position and last logits `counts[p]` times; the cache has room for `reserve` more
/// positions.
pub(crate) fn prefill(
    model: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    counts: &[usize],
    reserve: usize,
) -> Result<DecodeState> {
    let device = model.device().clone();
    let lp = prompts.iter().map(|p| p.len()).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(prompts.len() * lp);
    let mut mask = Vec::with_capacity(prompts.len() * lp);
    for p in prompts {
        for _ in p.len()..lp {
            ids.push(pad);
            mask.push(0u32);
        }
        ids.extend(p.iter());
        mask.extend(std::iter::repeat_n(1u32, p.len()));
    }
    let n_prompts = prompts.len();
    let ids_t = Tensor::from_vec(ids, (n_prompts, lp), &device)?;
    let mask_t = Tensor::from_vec(mask, (n_prompts, lp), &device)?;
    let (positions, bias) = padded_positions_and_bias(&mask_t, &device)?;
    let mut cache = KvCache::with_capacity(lp + reserve);
    let hidden = model.forward_hidden(&ids_t, &positions, &bias, Some(&mut cache))?;
    let last = hidden.narrow(1, lp - 1, 1)?.squeeze(1)?;
    let logits = model.logits(&last)?;

    // Share each prompt's cache across its samples.
    let expand: Vec<u32> = (0..n_prompts)
        .flat_map(|p| std::iter::repeat_n(p as u32, counts[p]))
        .collect();
    let expand_t = Tensor::new(expand.as_slice(), &device)?;
    let cache = cache.select_rows(&expand_t)?;
    let logits = logits.index_select(&expand_t, 0)?;
    // Each row's key bias (its prompt's padding masked) and next position, kept on the device
    // and grown there.
    let neg = attention_mask_value(DType::F32);
    let key_bias = mask_t
        .eq(0u32)?
        .to_dtype(DType::F32)?
        .affine(neg, 0.0)?
        .index_select(&expand_t, 0)?;
    let lens: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
    let next_pos = Tensor::new(lens.as_slice(), &device)?
        .index_select(&expand_t, 0)?
        .unsqueeze(1)?;
    Ok(DecodeState {
        cache,
        key_bias,
        next_pos,
        logits,
    })
}

impl DecodeState {
    /// Keeps these rows (indices into the current rows), in this order.
    pub(crate) fn keep_rows(&mut self, keep: &Tensor) -> Result<()> {
        self.cache.keep_rows(keep)?;
        self.key_bias = self.key_bias.index_select(keep, 0)?;
        self.next_pos = self.next_pos.index_select(keep, 0)?;
        Ok(())
    }

    /// One decode step: feeds each row's token `ids` `(rows,)` at its next position (the new
    /// key always visible) and leaves the logits of the token after it.
    pub(crate) fn decode_step(&mut self, model: &Transformer, ids: &Tensor) -> Result<()> {
        let hidden = self.decode_layers(model, ids)?;
        self.logits = model.logits(&hidden)?;
        Ok(())
    }

    /// The decoder layers of [`Self::decode_step`]: the rows' hidden states `(rows, H)` of
    /// `ids`, their keys and values added to the cache, positions and key bias grown.
    fn decode_layers(&mut self, model: &Transformer, ids: &Tensor) -> Result<Tensor> {
        let n = ids.dim(0)?;
        let device = model.device();
        self.key_bias = Tensor::cat(
            &[&self.key_bias, &Tensor::zeros((n, 1), DType::F32, device)?],
            1,
        )?;
        let s = self.key_bias.dim(1)?;
        let hidden = model.forward_hidden(
            &ids.reshape((n, 1))?,
            &self.next_pos,
            &self.key_bias.reshape((n, 1, 1, s))?,
            Some(&mut self.cache),
        )?;
        self.next_pos = (&self.next_pos + 1.0)?;
        hidden.squeeze(1)
    }
}

/// Picks every row's next token from `logits`: with the device sampler when there is one,
/// else on the host (rows in parallel). `seen` are the rows' tokens so far (repetition
/// penalty), `draws` their uniforms, `short` whether a row's stop ids are still suppressed,
/// `constraint` a regex constraint and each row's slot in it.
/// Returns the picks and, from the device sampler, the sampled ids on the device.
#[allow(clippy::too_many_arguments)]
pub(crate) fn pick_tokens(
    logits: &Tensor,
    params: &SamplingParams,
    vocab: usize,
    stop_ids: &[u32],
    sampler: Option<&mut DeviceSampler>,
    seen: &[&[u32]],
    draws: &[f32],
    short: &[bool],
    constraint: Option<(&mut RegexConstraint, &[usize])>,
) -> Result<(Vec<Pick>, Option<Tensor>)> {
    match sampler {
        Some(s) => {
            let mask = match constraint {
                Some((c, slots)) => Some(c.device_mask(slots, logits.device())?),
                None => None,
            };
            let (ids, picks) = s.step(logits, draws, short, mask.as_ref())?;
            Ok((picks, Some(ids)))
        }
        None => {
            let host: Vec<Vec<f32>> = logits.to_dtype(DType::F32)?.to_vec2()?;
            let allowed: Vec<Option<&crate::constrain::Allowed>> = match &constraint {
                Some((c, slots)) => slots.iter().map(|&s| Some(c.allowed(s))).collect(),
                None => vec![None; host.len()],
            };
            let picks = seen
                .par_iter()
                .zip(host.par_iter())
                .zip(draws.par_iter().zip(short.par_iter()))
                .zip(allowed.par_iter())
                .map(|(((seen, l), (&u, &short)), &allow)| {
                    let suppress: &[u32] = if short { stop_ids } else { &[] };
                    sample_row(&l[..vocab.min(l.len())], params, seen, suppress, allow, u)
                })
                .collect();
            Ok((picks, None))
        }
    }
}

/// Where a decode step's time goes (`grpo-cli bench-model`): medians per step, in
/// milliseconds, of the decoder layers (with the KV-cache writes), the output head, and the
/// sampling (with its copy of the picks to the host), each phase waited for on the device.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct DecodeBreakdown {
    /// The layers' forward of one token per row.
    pub layers_ms: f64,
    /// The output head (hidden → logits).
    pub head_ms: f64,
    /// Choosing the next tokens (device or host sampler, as generation would).
    pub sample_ms: f64,
}

/// Decodes `steps` tokens for `counts[p]` samples of each prompt as generation does (prefill
/// once per prompt, the same sampler), timing each phase of each step on its own
/// ([`DecodeBreakdown`]). A measuring tool: the waits it adds cost a little of the overlap a
/// real generation has.
pub fn decode_breakdown(
    model: &Transformer,
    prompts: &[&[u32]],
    counts: &[usize],
    steps: usize,
    params: &SamplingParams,
) -> Result<DecodeBreakdown> {
    let model = model.for_decoding()?;
    let device = model.device().clone();
    let vocab = model.cfg.vocab_size;
    let mut state = prefill(&model, 0, prompts, counts, steps + 1)?;
    let rows: Vec<Vec<u32>> = prompts
        .iter()
        .zip(counts)
        .flat_map(|(p, &c)| std::iter::repeat_n(p.to_vec(), c))
        .collect();
    let seen: Vec<&[u32]> = rows.iter().map(|r| r.as_slice()).collect();
    let mut sampler = if device_sampling(&device) {
        Some(DeviceSampler::new(params, vocab, &[], &seen, &device)?)
    } else {
        None
    };
    let n = rows.len();
    let mut rng = row_rng(params.seed, 0);
    let (mut layers, mut head, mut sample) = (Vec::new(), Vec::new(), Vec::new());
    let ms = |t: std::time::Instant| t.elapsed().as_secs_f64() * 1e3;
    for _ in 0..steps {
        let draws: Vec<f32> = (0..n).map(|_| draw_uniform(&mut rng, params)).collect();
        let short = vec![false; n];
        let t = std::time::Instant::now();
        let (picks, sampled) = pick_tokens(
            &state.logits,
            params,
            vocab,
            &[],
            sampler.as_mut(),
            &seen,
            &draws,
            &short,
            None,
        )?;
        let ids = match sampled {
            Some(ids) => ids,
            None => Tensor::from_vec(picks.iter().map(|p| p.0).collect(), n, &device)?,
        };
        device.synchronize()?;
        sample.push(ms(t));
        let t = std::time::Instant::now();
        let hidden = state.decode_layers(&model, &ids)?;
        device.synchronize()?;
        layers.push(ms(t));
        let t = std::time::Instant::now();
        state.logits = model.logits(&hidden)?;
        device.synchronize()?;
        head.push(ms(t));
    }
    let median = |mut v: Vec<f64>| {
        v.sort_by(f64::total_cmp);
        v.get(v.len() / 2).copied().unwrap_or(f64::NAN)
    };
    Ok(DecodeBreakdown {
        layers_ms: median(layers),
        head_ms: median(head),
        sample_ms: median(sample),
    })
}

thread_local! {
    static DEVICE_SAMPLING: std::cell::Cell<Option<bool>> = const { std::cell::Cell::new(None) };
    static RETIRE_EVERY: std::cell::Cell<Option<usize>> = const { std::cell::Cell::new(None) };
}

/// How many finished rows a decode batch of `rows` keeps before it is compacted (finished rows
/// dropped from the batch and the KV cache). On the CPU at once: a row costs its arithmetic. On
/// a GPU once a quarter of the batch has finished: a decode step there costs its launches more
/// than its rows, and each compaction copies the whole KV cache (and holds two for a moment).
/// [`with_retire_every`] overrides it on this thread. Which rows finish when is the same
/// either way (each row samples from its own stream).
pub fn retire_every(device: &Device, rows: usize) -> usize {
    RETIRE_EVERY
        .with(|c| c.get())
        .unwrap_or(if device.is_cpu() { 1 } else { rows / 4 })
        .max(1)
}

/// Runs `f` with decode batches compacted once `k` rows have finished, on this thread (tests
/// run the GPU policy on the CPU with it).
pub fn with_retire_every<T>(k: usize, f: impl FnOnce() -> T) -> T {
    let prev = RETIRE_EVERY.with(|c| c.replace(Some(k)));
    let out = f();
    RETIRE_EVERY.with(|c| c.set(prev));
    out
}

/// Whether generation on `device` samples with tensor ops there ([`DeviceSampler`]): off the
/// CPU, unless [`with_device_sampling`] says otherwise on this thread.
pub fn device_sampling(device: &Device) -> bool {
    DEVICE_SAMPLING
        .with(|c| c.get())
        .unwrap_or(!device.is_cpu())
}

/// Runs `f` with device-side sampling forced on or off on this thread (tests run the device
/// path on the CPU with it).
pub fn with_device_sampling<T>(on: bool, f: impl FnOnce() -> T) -> T {
    let prev = DEVICE_SAMPLING.with(|c| c.replace(Some(on)));
    let out = f();
    DEVICE_SAMPLING.with(|c| c.set(prev));
    out
}

fn finish(
    row: Row,
    reason: FinishReason,
    tokenizer: &Tokenizer,
    params: &SamplingParams,
) -> Result<Completion> {
    let mut text = tokenizer.decode(&row.tokens, true)?;
    if reason == FinishReason::Stop {
        cut_at_stop(&mut text, &params.stop);
    }
    Ok(Completion {
        prompt_index: row.prompt_index,
        sample_index: row.sample_index,
        token_ids: row.tokens,
        text,
        logprobs: row.logprobs,
        finish_reason: reason,
        top_logprobs: row.top,
    })
}

/// Cuts `text` before the first of the (non-empty) stop strings it contains.
pub(crate) fn cut_at_stop(text: &mut String, stop: &[String]) {
    let cut = stop
        .iter()
        .filter(|s| !s.is_empty())
        .filter_map(|s| text.find(s.as_str()))
        .min();
    if let Some(c) = cut {
        text.truncate(c);
    }
}

/// Left-pads token rows into `(B, L)` ids and a 0/1 attention mask (u32), with `pad` ids.
pub fn left_pad(rows: &[Vec<u32>], pad: u32, device: &Device) -> Result<(Tensor, Tensor)> {
    let l = rows.iter().map(Vec::len).max().unwrap_or(0);
    let mut ids = Vec::with_capacity(rows.len() * l);
    let mut mask = Vec::with_capacity(rows.len() * l);
    for r in rows {
        ids.extend(std::iter::repeat_n(pad, l - r.len()));
        mask.extend(std::iter::repeat_n(0u32, l - r.len()));
        ids.extend(r);
        mask.extend(std::iter::repeat_n(1u32, r.len()));
    }
    Ok((
        Tensor::from_vec(ids, (rows.len(), l), device)?,
        Tensor::from_vec(mask, (rows.len(), l), device)?,
    ))
}
