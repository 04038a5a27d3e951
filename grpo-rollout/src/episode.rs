//! Multi-turn episodes: the model and an [`Environment`] take turns, on a KV cache kept
//! across turns.
//!
//! Each prompt (token ids and the message log they render) gets `n` episodes. An episode is a
//! sequence of turns: the model samples a turn (until an EOS / stop token, a stop string, or
//! the turn's budget), the environment answers it ([`Environment::step`], one batch call for
//! every running episode), and its observation goes into the conversation through the chat
//! template; then the model's next turn. It ends when the environment says so
//! ([`EpisodeEnd::Terminated`]), after `max_turns` model turns ([`EpisodeEnd::MaxTurns`]), or
//! when the tokens after the prompt reach `max_total_tokens` ([`EpisodeEnd::MaxTotalTokens`]).
//!
//! **Tokens of an observation.** The template renders the conversation with the observation and
//! the generation prompt of the next assistant turn; the tokens added are those of the text
//! past what the episode's tokens already hold (the previous rendering, the model's turn as
//! sampled). For ChatML after a turn that ended with `<|im_end|>` that is
//! `"\n<|im_start|>user\n{observation}<|im_end|>\n<|im_start|>assistant\n"`; after a turn cut
//! by its budget the template's `<|im_end|>` comes first. A template that renders earlier turns
//! differently once the conversation grows (e.g. one that drops past reasoning) cannot extend
//! the tokens and is an error. The assistant message holds the text of the sampled tokens
//! (special tokens kept, a closing EOS token left to the template; a stop string and anything
//! the last token carried past it stay), so the conversation continues from exactly what the
//! model produced.
//!
//! **Batching.** As in [`mod@crate::generate`], each prompt is prefilled once and its cache shared
//! by its samples; each episode samples from its own seeded stream, so its tokens do not depend
//! on its batch. Turns are synchronous: an episode whose turn is over leaves the decode batch
//! (its cache rows set aside), and when every running episode's turn is over the environment
//! answers them all; the rows that go on are joined back (a row that left earlier has masked
//! slots up to the others' length), and all their observations are appended in one forward —
//! right-padded within the chunk, the padding masked, positions continuing each row's own — so
//! the history is never prefilled again. The next turn samples from each row's logits at its
//! last real token.
//!
//! **For the learner.** [`Episode::token_ids`] is everything after the prompt;
//! [`Episode::is_model_token`] marks the tokens the model sampled (the loss is on those only);
//! [`Episode::logprobs`] is aligned with both (the sampling log-prob, `log_softmax(logits /
//! temperature)` of the raw logits as in [`mod@crate::generate`], at model tokens; 0 at the
//! environment's). A full forward over prompt + `token_ids` gives the same log-probs at the
//! model tokens (tested).

use std::collections::BTreeMap;
use std::ops::Range;

use candle_core::{DType, Result, Tensor, bail};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::constrain::RegexConstraint;
use crate::env::Environment;
use crate::generate::{
    DecodeState, FinishReason, SamplingParams, contains_stop, device_sampling, draw_uniform,
    pick_tokens, prefill, retire_every, row_rng, stop_ids,
};
use crate::graph::Decoder;
use crate::model::{KvCache, Transformer, attention_mask_value};
use crate::sample::DeviceSampler;
use crate::tokenizer::{ChatMessage, ChatTemplate, Tokenizer};
use regex_automata::util::primitives::StateID;

/// A prompt of an episode: its token ids and the message log they render.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct EpisodePrompt {
    /// Token ids of `messages` rendered by the chat template with the generation prompt (at
    /// least one). [`Self::from_messages`] makes them.
    pub ids: Vec<u32>,
    /// The conversation so far (system, user, ...).
    pub messages: Vec<ChatMessage>,
    /// What the environment's first `step` sees as this prompt's episodes' metadata (the task:
    /// an answer, a test suite, a seed).
    pub metadata: Value,
    /// The tools' JSON schemas the template rendered (the environment's
    /// [`Environment::tools_for`] this prompt's metadata); empty = none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub tools: Vec<Value>,
    /// The starting metadata of each of this prompt's episodes (episode `j` of a request
    /// starts with `episode_metadata[j]`; from [`crate::env::EnvironmentReset::episodes`]);
    /// empty, or shorter than the request, = [`Self::metadata`].
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub episode_metadata: Vec<Value>,
}

impl EpisodePrompt {
    /// Renders `messages` through the tokenizer's chat template with the generation prompt
    /// and tokenizes the text (special tokens as written, none added), as transformers'
    /// `apply_chat_template(..., add_generation_prompt=True, tokenize=True)` does.
    pub fn from_messages(
        tokenizer: &Tokenizer,
        messages: Vec<ChatMessage>,
        metadata: Value,
    ) -> Result<Self> {
        Self::rendered(tokenizer, messages, Vec::new(), metadata).map(|(p, _)| p)
    }

    /// [`Self::from_messages`] with the `tools` variable of the template (an environment's
    /// [`Environment::tools`]), also returning the rendered text.
    pub fn rendered(
        tokenizer: &Tokenizer,
        messages: Vec<ChatMessage>,
        tools: Vec<Value>,
        metadata: Value,
    ) -> Result<(Self, String)> {
        let text = tokenizer.apply_chat_template_with_tools(&messages, &tools, true)?;
        let ids = tokenizer.encode(&text, false)?;
        if ids.is_empty() {
            bail!("episode prompt renders to no tokens: give it at least one message");
        }
        let p = Self {
            ids,
            messages,
            metadata,
            tools,
            episode_metadata: Vec::new(),
        };
        Ok((p, text))
    }
}

/// One prompt of a [`generate_episodes_batch`] call: how many episodes, and their random
/// streams (episode `j` draws from ChaCha8 seeded with `seed`, stream `first_stream + j`).
#[derive(Debug, Clone, Copy)]
pub struct EpisodeRequest<'a> {
    /// The prompt.
    pub prompt: &'a EpisodePrompt,
    /// Episodes of this prompt.
    pub n: usize,
    /// Seed of its episodes' streams.
    pub seed: u64,
    /// Stream of its first episode.
    pub first_stream: u64,
}

impl<'a> EpisodeRequest<'a> {
    /// `n` episodes of each prompt, episode `j` of prompt `p` on stream `p · n + j` of `seed`
    /// (what [`generate_episodes`] runs).
    pub fn grouped(prompts: &'a [EpisodePrompt], n: usize, seed: u64) -> Vec<Self> {
        prompts
            .iter()
            .enumerate()
            .map(|(i, prompt)| EpisodeRequest {
                prompt,
                n,
                seed,
                first_stream: (i * n) as u64,
            })
            .collect()
    }
}

/// Sampling and budgets of multi-turn generation.
#[derive(Debug, Clone, PartialEq)]
pub struct EpisodeParams {
    /// Sampling of every model turn. `max_new_tokens` is not used (a turn's budget is
    /// `max_tokens_per_turn`); `min_new_tokens` holds per turn; `stop` is each episode's stop
    /// strings until the environment gives others; `top_logprobs` is not recorded.
    pub sampling: SamplingParams,
    /// Model turns per episode at most (≥ 1).
    pub max_turns: usize,
    /// Tokens one model turn may sample (≥ 1).
    pub max_tokens_per_turn: usize,
    /// Tokens after the prompt (model and environment tokens) an episode may hold (≥ 1): a
    /// turn's budget is cut to what is left, and an observation that would leave no room for
    /// the model's next turn ends the episode instead.
    pub max_total_tokens: usize,
}

impl Default for EpisodeParams {
    fn default() -> Self {
        Self {
            sampling: SamplingParams::default(),
            max_turns: 4,
            max_tokens_per_turn: 256,
            max_total_tokens: 1024,
        }
    }
}

impl EpisodeParams {
    /// Checks the values, naming the field to fix.
    pub fn validate(&self) -> Result<()> {
        if self.max_turns == 0 {
            bail!("max_turns must be >= 1");
        }
        if self.max_tokens_per_turn == 0 {
            bail!("max_tokens_per_turn must be >= 1");
        }
        if self.max_total_tokens == 0 {
            bail!("max_total_tokens must be >= 1");
        }
        if self.sampling.min_new_tokens > self.max_tokens_per_turn {
            bail!(
                "min_new_tokens ({}) exceeds max_tokens_per_turn ({})",
                self.sampling.min_new_tokens,
                self.max_tokens_per_turn
            );
        }
        self.turn_sampling().validate()
    }

    /// The sampling parameters of one turn.
    fn turn_sampling(&self) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_tokens_per_turn,
            top_logprobs: 0,
            ..self.sampling.clone()
        }
    }
}

/// Why an episode ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum EpisodeEnd {
    /// The environment said it was over.
    Terminated,
    /// `max_turns` model turns were taken.
    MaxTurns,
    /// `max_total_tokens` was reached (or the next observation would have reached it).
    MaxTotalTokens,
}

/// One turn of an episode: the model's tokens and what the environment answered.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Turn {
    /// The model's tokens of this turn (indices into [`Episode::token_ids`]).
    pub model_tokens: Range<usize>,
    /// Why the model's turn ended (`length`: the turn's budget).
    pub finish_reason: FinishReason,
    /// The environment's reward for it.
    pub reward: f32,
    /// The tokens appended after it (the observation rendered by the chat template, with the
    /// next generation prompt); empty when the episode ended here.
    pub observation_tokens: Range<usize>,
}

/// A finished episode.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Episode {
    /// Which prompt (position in the requests).
    pub prompt_index: usize,
    /// Which of its episodes.
    pub sample_index: usize,
    /// Every token after the prompt: the model's turns and the environment's observations.
    pub token_ids: Vec<u32>,
    /// Per token: sampled by the model (true) or added for the environment (false).
    pub is_model_token: Vec<bool>,
    /// Per token: the sampling log-prob at model tokens, 0 at the others.
    pub logprobs: Vec<f32>,
    /// The turns, in order.
    pub turns: Vec<Turn>,
    /// Why it ended.
    pub end: EpisodeEnd,
    /// The prompt's messages, then each assistant turn and each observation shown (what
    /// `token_ids` holds).
    pub messages: Vec<ChatMessage>,
    /// The environment's last observation when the episode ended before the model saw it.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub unshown_observation: Option<ChatMessage>,
    /// The environment's last metadata.
    pub metadata: Value,
    /// `token_ids` decoded, special tokens kept: the transcript after the prompt.
    pub text: String,
}

impl Episode {
    /// Model turns taken.
    pub fn num_turns(&self) -> usize {
        self.turns.len()
    }

    /// Each turn's reward.
    pub fn rewards(&self) -> Vec<f32> {
        self.turns.iter().map(|t| t.reward).collect()
    }

    /// The sum of the turns' rewards (NeMo RL's `total_reward`).
    pub fn total_reward(&self) -> f32 {
        self.turns.iter().map(|t| t.reward).sum()
    }

    /// Whether the environment ended it (rather than a budget).
    pub fn terminated(&self) -> bool {
        self.end == EpisodeEnd::Terminated
    }

    /// Tokens the model sampled.
    pub fn num_model_tokens(&self) -> usize {
        self.is_model_token.iter().filter(|&&m| m).count()
    }
}

/// Summary metrics of a batch of episodes (means over episodes): `episodes/turns`,
/// `episodes/terminated` (fraction), `episodes/max_turns` and `episodes/max_total_tokens`
/// (fraction ended by each budget), `episodes/model_tokens`, `episodes/environment_tokens`,
/// `episodes/total_reward`.
pub fn episode_metrics(episodes: &[Episode]) -> BTreeMap<String, f64> {
    let mut out = BTreeMap::new();
    if episodes.is_empty() {
        return out;
    }
    let n = episodes.len() as f64;
    let mean = |f: &dyn Fn(&Episode) -> f64| episodes.iter().map(f).sum::<f64>() / n;
    let ended = |e: EpisodeEnd| mean(&|x: &Episode| f64::from(u8::from(x.end == e)));
    out.insert("episodes/turns".into(), mean(&|e| e.num_turns() as f64));
    out.insert("episodes/terminated".into(), ended(EpisodeEnd::Terminated));
    out.insert("episodes/max_turns".into(), ended(EpisodeEnd::MaxTurns));
    out.insert(
        "episodes/max_total_tokens".into(),
        ended(EpisodeEnd::MaxTotalTokens),
    );
    out.insert(
        "episodes/model_tokens".into(),
        mean(&|e| e.num_model_tokens() as f64),
    );
    out.insert(
        "episodes/environment_tokens".into(),
        mean(&|e| (e.token_ids.len() - e.num_model_tokens()) as f64),
    );
    out.insert(
        "episodes/total_reward".into(),
        mean(&|e| f64::from(e.total_reward())),
    );
    out
}

/// An episode being generated.
struct Live {
    prompt_index: usize,
    sample_index: usize,
    rng: ChaCha8Rng,
    prompt_len: usize,
    /// Prompt and episode tokens (repetition penalty).
    seen: Vec<u32>,
    tokens: Vec<u32>,
    is_model: Vec<bool>,
    logprobs: Vec<f32>,
    turns: Vec<Turn>,
    messages: Vec<ChatMessage>,
    metadata: Value,
    /// The chat template's text of the conversation before the current model turn (with the
    /// generation prompt): what the tokens held when the turn began.
    rendered: String,
    /// `rendered` and the current turn as sampled: what the tokens hold now.
    holds: String,
    /// Stop strings of the current turn.
    stop: Vec<String>,
    /// Where the current turn began in `tokens`.
    turn_start: usize,
    /// The current turn's DFA state under a regex constraint (unused without one).
    dfa: StateID,
    /// Tokens the current turn may sample.
    budget: usize,
    /// Why the current turn ended.
    finish: Option<FinishReason>,
    end: Option<EpisodeEnd>,
    unshown: Option<ChatMessage>,
}

/// Rows that left the decode batch together: their cache rows and key bias.
struct Parked {
    cache: KvCache,
    key_bias: Tensor,
    /// Which episodes, in row order.
    rows: Vec<usize>,
}

/// Runs `num_generations` episodes of each prompt against `env` (episode `j` of prompt `p`
/// draws from stream `p · num_generations + j` of `params.sampling.seed`). Episodes come back
/// grouped by prompt, then by sample. See the [module docs](self).
///
/// The model should be a detached copy ([`Transformer::detached`]) so no graph is recorded.
pub fn generate_episodes(
    model: &Transformer,
    tokenizer: &Tokenizer,
    env: &dyn Environment,
    prompts: &[EpisodePrompt],
    num_generations: usize,
    params: &EpisodeParams,
) -> Result<Vec<Episode>> {
    let requests = EpisodeRequest::grouped(prompts, num_generations, params.sampling.seed);
    generate_episodes_batch(model, tokenizer, env, &requests, params)
}

/// [`generate_episodes`] with an episode count and random streams per prompt: an episode's
/// tokens do not depend on what it is batched with. `params.sampling.seed` is not used.
pub fn generate_episodes_batch(
    model: &Transformer,
    tokenizer: &Tokenizer,
    env: &dyn Environment,
    requests: &[EpisodeRequest<'_>],
    params: &EpisodeParams,
) -> Result<Vec<Episode>> {
    let live = live_requests(requests, params)?;
    if live.is_empty() {
        return Ok(Vec::new());
    }
    let sp = params.turn_sampling();
    let decoding = model.for_decoding()?;
    let model = &decoding;
    let stop_ids = stop_ids(tokenizer, &sp);
    let pad = tokenizer.pad_token_id;
    // Each model turn is constrained on its own, as each generation call of a server is.
    let mut constraint =
        RegexConstraint::for_params(&sp, tokenizer, model.cfg.vocab_size, &stop_ids)?;
    let template = tokenizer.compile_chat_template()?;
    let tools: Vec<&[Value]> = requests.iter().map(|r| r.prompt.tools.as_slice()).collect();
    let mut eps = start_episodes(env, &template, requests, &live, &sp)?;
    let prompts: Vec<&[u32]> = live
        .iter()
        .map(|&i| requests[i].prompt.ids.as_slice())
        .collect();
    let counts: Vec<usize> = live.iter().map(|&i| requests[i].n).collect();
    // Room for the whole episode, as generate makes room for the whole completion (the cache
    // grows if padding between turns takes more).
    let mut state = prefill(model, pad, &prompts, &counts, params.max_total_tokens)?;
    let mut running: Vec<usize> = (0..eps.len()).collect();

    for turn in 1..=params.max_turns {
        begin_turn(&mut eps, &running, params);
        let parked = model_turn(
            model,
            tokenizer,
            &sp,
            &stop_ids,
            constraint.as_mut(),
            &mut eps,
            &running,
            state,
        )?;
        let turn_ctx = TurnContext {
            env,
            tokenizer,
            template: &template,
            tools: &tools,
            params,
        };
        let chunks = turn_ctx.answer(&mut eps, &mut running, turn)?;
        if chunks.is_empty() {
            break;
        }
        let (cache, key_bias, order) = rejoin(parked, &chunks, params.max_tokens_per_turn)?;
        let chunk_rows: Vec<(&[u32], usize)> = order
            .iter()
            .map(|e| {
                let ep = &eps[*e];
                let c = &chunks[e];
                // Position of the chunk's first token (the turn's last).
                let start = ep.prompt_len + ep.tokens.len() - c.len();
                (c.as_slice(), start)
            })
            .collect();
        state = append_chunk(model, cache, key_bias, &chunk_rows, pad)?;
        running = order;
    }
    finish_episodes(eps, tokenizer)
}

/// Checks `params` and the prompts; the requests with episodes to run.
fn live_requests(requests: &[EpisodeRequest<'_>], params: &EpisodeParams) -> Result<Vec<usize>> {
    params.validate()?;
    if let Some(i) = requests.iter().position(|r| r.prompt.ids.is_empty()) {
        bail!("episode prompt {i} is empty: a prompt needs at least one token");
    }
    Ok((0..requests.len()).filter(|&i| requests[i].n > 0).collect())
}

/// The episodes of `requests` (those in `live`), before their first turn.
fn start_episodes(
    env: &dyn Environment,
    template: &ChatTemplate<'_>,
    requests: &[EpisodeRequest<'_>],
    live: &[usize],
    sp: &SamplingParams,
) -> Result<Vec<Live>> {
    // The text each prompt's tokens hold.
    let mut eps: Vec<Live> = Vec::new();
    for &i in live {
        let req = &requests[i];
        let tools = env.tools_for(&req.prompt.metadata);
        if req.prompt.tools != tools {
            bail!(
                "episode prompt {i} was rendered with other tools than environment `{}` offers ({} against {}): make it with EpisodePrompt::rendered(.., env.tools_for(&metadata), ..)",
                env.name(),
                req.prompt.tools.len(),
                tools.len()
            );
        }
        let rendered = template
            .render_with_tools(&req.prompt.messages, &tools, true)
            .map_err(|e| candle_core::Error::msg(format!("episode prompt {i}: {e}")))?;
        for j in 0..req.n {
            eps.push(Live {
                prompt_index: i,
                sample_index: j,
                rng: row_rng(req.seed, req.first_stream + j as u64),
                prompt_len: req.prompt.ids.len(),
                seen: req.prompt.ids.clone(),
                tokens: Vec::new(),
                is_model: Vec::new(),
                logprobs: Vec::new(),
                turns: Vec::new(),
                messages: req.prompt.messages.clone(),
                metadata: req
                    .prompt
                    .episode_metadata
                    .get(j)
                    .unwrap_or(&req.prompt.metadata)
                    .clone(),
                rendered: rendered.clone(),
                holds: String::new(),
                stop: sp.stop.clone(),
                turn_start: 0,
                budget: 0,
                finish: None,
                end: None,
                unshown: None,
                dfa: StateID::ZERO,
            });
        }
    }
    Ok(eps)
}

/// Sets up the turn of every running episode: where it starts, its budget.
fn begin_turn(eps: &mut [Live], running: &[usize], params: &EpisodeParams) {
    for &e in running {
        let ep = &mut eps[e];
        ep.turn_start = ep.tokens.len();
        ep.budget = params
            .max_tokens_per_turn
            .min(params.max_total_tokens - ep.tokens.len());
        ep.finish = None;
    }
}

/// What a turn's end needs: the environment, the template and the budgets.
struct TurnContext<'a> {
    env: &'a dyn Environment,
    tokenizer: &'a Tokenizer,
    template: &'a ChatTemplate<'a>,
    /// The tools each prompt (by position in the requests) was rendered with.
    tools: &'a [&'a [Value]],
    params: &'a EpisodeParams,
}

impl TurnContext<'_> {
    /// Ends turn `turn` of the `running` episodes (sorted here: the environment sees them in
    /// prompt, sample order): their assistant messages, the environment's answer, and the
    /// observations' tokens appended to the episodes that go on. Returns, per episode that
    /// goes on, the tokens the model must read next (the turn's last token, never fed, then
    /// the observation's); episodes that end are marked so.
    fn answer(
        &self,
        eps: &mut [Live],
        running: &mut [usize],
        turn: usize,
    ) -> Result<BTreeMap<usize, Vec<u32>>> {
        let (env, tokenizer, params) = (self.env, self.tokenizer, self.params);
        running.sort_unstable();
        for &e in running.iter() {
            close_turn(tokenizer, &mut eps[e])?;
        }
        let answer = {
            let logs: Vec<&[ChatMessage]> = running
                .iter()
                .map(|&e| eps[e].messages.as_slice())
                .collect();
            let metadata: Vec<&Value> = running.iter().map(|&e| &eps[e].metadata).collect();
            env.step(&logs, &metadata).map_err(|err| {
                candle_core::Error::msg(format!(
                    "environment `{}` failed at turn {turn}: {err}",
                    env.name()
                ))
            })?
        };
        answer.validate(running.len(), env.name())?;
        let mut chunks: BTreeMap<usize, Vec<u32>> = BTreeMap::new();
        for (k, &e) in running.iter().enumerate() {
            let ep = &mut eps[e];
            let observation = answer.observations[k].clone();
            let at = ep.tokens.len();
            ep.turns.push(Turn {
                model_tokens: ep.turn_start..at,
                finish_reason: ep.finish.unwrap_or(FinishReason::Length),
                reward: answer.rewards[k],
                observation_tokens: at..at,
            });
            ep.metadata = answer.metadata[k].clone();
            let end = if answer.terminateds[k] {
                Some(EpisodeEnd::Terminated)
            } else if turn == params.max_turns {
                Some(EpisodeEnd::MaxTurns)
            } else if at >= params.max_total_tokens {
                Some(EpisodeEnd::MaxTotalTokens)
            } else {
                None
            };
            if end.is_some() {
                ep.end = end;
                ep.unshown = observation;
                continue;
            }
            // The observation's tokens: the conversation rendered with it and the next
            // generation prompt, past what the tokens hold.
            let mut messages = ep.messages.clone();
            messages.extend(observation.iter().cloned());
            let next =
                self.template
                    .render_with_tools(&messages, self.tools[ep.prompt_index], true)?;
            let Some(delta) = next.strip_prefix(ep.holds.as_str()) else {
                bail!(
                    "chat template: the conversation with the observation of turn {turn} (prompt {}, episode {}) does not continue the text the model has seen; multi-turn episodes need a template that renders earlier turns unchanged as the conversation grows",
                    ep.prompt_index,
                    ep.sample_index
                );
            };
            let ids = tokenizer.encode(delta, false)?;
            if at + ids.len() >= params.max_total_tokens {
                ep.end = Some(EpisodeEnd::MaxTotalTokens);
                ep.unshown = observation;
                continue;
            }
            // The turn's last token was never fed to the model: it leads the chunk.
            let mut chunk = Vec::with_capacity(ids.len() + 1);
            chunk.push(ep.tokens[at - 1]);
            chunk.extend(&ids);
            ep.tokens.extend(&ids);
            ep.seen.extend(&ids);
            ep.is_model.extend(std::iter::repeat_n(false, ids.len()));
            ep.logprobs.extend(std::iter::repeat_n(0.0, ids.len()));
            if let Some(t) = ep.turns.last_mut() {
                t.observation_tokens = at..at + ids.len();
            }
            ep.messages = messages;
            ep.rendered = next;
            if let Some(stop) = &answer.next_stop_strings[k] {
                ep.stop = stop.clone();
            }
            chunks.insert(e, chunk);
        }
        Ok(chunks)
    }
}

/// The finished episodes, in the order they were started.
fn finish_episodes(eps: Vec<Live>, tokenizer: &Tokenizer) -> Result<Vec<Episode>> {
    eps.into_iter()
        .map(|ep| {
            let text = tokenizer.decode(&ep.tokens, false)?;
            Ok(Episode {
                prompt_index: ep.prompt_index,
                sample_index: ep.sample_index,
                token_ids: ep.tokens,
                is_model_token: ep.is_model,
                logprobs: ep.logprobs,
                turns: ep.turns,
                end: ep.end.unwrap_or(EpisodeEnd::MaxTurns),
                messages: ep.messages,
                unshown_observation: ep.unshown,
                metadata: ep.metadata,
                text,
            })
        })
        .collect()
}

/// [`generate_episodes_batch`] with the model's turns sampled on an OpenAI-compatible server
/// (`/v1/completions` with the conversation's token ids as the prompt, one request per running
/// episode per turn, all of a turn's requests in flight at once), from the synced adapter
/// (`use_adapter`) or the served base model. The chat template, the environment and the
/// budgets work as locally, so the tokens trained on are exactly the tokens sampled: each
/// turn's token ids and log-probs come from the server (vLLM's `return_token_ids`), the
/// observations' from our template. A server that returns no log-probs leaves 0 at the turn's
/// tokens. Each request's seed is drawn from the episode's own stream.
#[cfg(feature = "remote")]
pub fn generate_episodes_remote(
    server: &crate::remote::RemoteGenerator,
    tokenizer: &Tokenizer,
    env: &dyn Environment,
    requests: &[EpisodeRequest<'_>],
    params: &EpisodeParams,
    use_adapter: bool,
) -> Result<Vec<Episode>> {
    use rand::RngCore;

    let live = live_requests(requests, params)?;
    if live.is_empty() {
        return Ok(Vec::new());
    }
    let sp = params.turn_sampling();
    let template = tokenizer.compile_chat_template()?;
    let tools: Vec<&[Value]> = requests.iter().map(|r| r.prompt.tools.as_slice()).collect();
    let mut eps = start_episodes(env, &template, requests, &live, &sp)?;
    let mut running: Vec<usize> = (0..eps.len()).collect();
    for turn in 1..=params.max_turns {
        begin_turn(&mut eps, &running, params);
        let batch: Vec<(Vec<u32>, SamplingParams)> = running
            .iter()
            .map(|&e| {
                let ep = &mut eps[e];
                let mut ids = requests[ep.prompt_index].prompt.ids.clone();
                ids.extend(&ep.tokens);
                let p = SamplingParams {
                    max_new_tokens: ep.budget,
                    stop: ep.stop.clone(),
                    seed: ep.rng.next_u64() >> 1,
                    ..sp.clone()
                };
                (ids, p)
            })
            .collect();
        let sampled = server.generate_each(tokenizer, &batch, use_adapter)?;
        for (&e, c) in running.iter().zip(sampled) {
            let ep = &mut eps[e];
            let n = c.token_ids.len().min(ep.budget);
            ep.tokens.extend(&c.token_ids[..n]);
            ep.seen.extend(&c.token_ids[..n]);
            ep.is_model.extend(std::iter::repeat_n(true, n));
            if c.logprobs.len() >= n {
                ep.logprobs.extend(&c.logprobs[..n]);
            } else {
                ep.logprobs.extend(std::iter::repeat_n(0.0, n));
            }
            ep.finish = Some(c.finish_reason);
            if n == 0 {
                bail!(
                    "rollout server: an empty turn for prompt {} episode {} (turn {turn})",
                    ep.prompt_index,
                    ep.sample_index
                );
            }
        }
        let turn_ctx = TurnContext {
            env,
            tokenizer,
            template: &template,
            tools: &tools,
            params,
        };
        let chunks = turn_ctx.answer(&mut eps, &mut running, turn)?;
        if chunks.is_empty() {
            break;
        }
        running = chunks.into_keys().collect();
    }
    finish_episodes(eps, tokenizer)
}

/// Samples one turn of every running episode. An episode whose turn is over leaves the batch
/// (its cache rows and key bias set aside at once); the returned groups hold the rows in the
/// order they left. Finished rows stay in the decode batch (their tokens unused) until
/// `retire_every` of them have finished, then the batch is compacted: on a GPU that keeps the
/// batch size, and so a captured decode step ([`crate::graph`]), for many steps. Under a regex
/// constraint each episode's turn starts from the pattern's start.
#[allow(clippy::too_many_arguments)]
fn model_turn(
    model: &Transformer,
    tokenizer: &Tokenizer,
    sp: &SamplingParams,
    stop_ids: &[u32],
    mut constraint: Option<&mut RegexConstraint>,
    eps: &mut [Live],
    running: &[usize],
    mut state: DecodeState,
) -> Result<Vec<Parked>> {
    if let Some(c) = &constraint {
        for &e in running {
            eps[e].dfa = c.start();
        }
    }
    let device = model.device().clone();
    let vocab = model.cfg.vocab_size;
    // A row of the batch: its episode, `None` once its turn is over and until a compaction.
    let mut rows: Vec<Option<usize>> = running.iter().map(|&e| Some(e)).collect();
    let mut sampler = if device_sampling(&device) {
        let seen: Vec<&[u32]> = running.iter().map(|&e| eps[e].seen.as_slice()).collect();
        Some(DeviceSampler::new(sp, vocab, stop_ids, &seen, &device)?)
    } else {
        None
    };
    let retire = retire_every(&device, rows.len());
    let mut decoder = Decoder::default();
    let mut parked = Vec::new();
    loop {
        // Rows whose turn is over draw nothing; what they sample is dropped.
        let draws: Vec<f32> = rows
            .iter()
            .map(|r| r.map_or(0.5, |e| draw_uniform(&mut eps[e].rng, sp)))
            .collect();
        // Under a regex, each row's allowed set (its slot); a complete text ends however short.
        let slots = match constraint.as_deref_mut() {
            Some(c) => c.slots(rows.iter().map(|r| r.map(|e| eps[e].dfa))),
            None => Vec::new(),
        };
        let short: Vec<bool> = rows
            .iter()
            .enumerate()
            .map(|(i, r)| {
                r.is_some_and(|e| eps[e].tokens.len() - eps[e].turn_start < sp.min_new_tokens)
                    && constraint
                        .as_deref()
                        .is_none_or(|c| !c.allowed(slots[i]).only_stop)
            })
            .collect();
        let (picks, sampled) = {
            let seen: Vec<&[u32]> = rows
                .iter()
                .map(|r| r.map_or(&[][..], |e| eps[e].seen.as_slice()))
                .collect();
            pick_tokens(
                &state.logits,
                sp,
                vocab,
                stop_ids,
                sampler.as_mut(),
                &seen,
                &draws,
                &short,
                constraint.as_deref_mut().map(|c| (c, slots.as_slice())),
            )?
        };
        let mut out: Vec<u32> = Vec::new();
        for (i, (slot, (tok, lp, _))) in rows.iter().zip(picks).enumerate() {
            let Some(e) = *slot else {
                continue;
            };
            let ep = &mut eps[e];
            ep.tokens.push(tok);
            ep.is_model.push(true);
            ep.logprobs.push(lp);
            ep.seen.push(tok);
            if let Some(c) = constraint.as_deref() {
                ep.dfa = c.advance(ep.dfa, tok);
            }
            let n = ep.tokens.len() - ep.turn_start;
            let mut reason = None;
            if stop_ids.binary_search(&tok).is_ok() && n >= sp.min_new_tokens {
                reason = Some(FinishReason::Eos);
            } else if !ep.stop.is_empty() {
                let text = tokenizer.decode(&ep.tokens[ep.turn_start..], false)?;
                if contains_stop(&text, &ep.stop) {
                    reason = Some(FinishReason::Stop);
                }
            }
            if reason.is_none() && n >= ep.budget {
                reason = Some(FinishReason::Length);
            }
            ep.finish = reason;
            if reason.is_some() {
                out.push(i as u32);
            }
        }
        if out.len() == rows.len() {
            // Everyone left at this step (none had before): the batch is set aside whole.
            decoder.release(&mut state)?;
            parked.push(Parked {
                cache: state.cache,
                key_bias: state.key_bias,
                rows: rows.into_iter().flatten().collect(),
            });
            return Ok(parked);
        }
        if !out.is_empty() {
            let out_t = Tensor::new(out.as_slice(), &device)?;
            let key_bias = decoder.key_bias(&state)?;
            parked.push(Parked {
                cache: state.cache.select_rows(&out_t)?,
                key_bias: key_bias.index_select(&out_t, 0)?,
                rows: out.iter().filter_map(|&i| rows[i as usize]).collect(),
            });
            for &i in &out {
                rows[i as usize] = None;
            }
        }
        let keep: Vec<u32> = (0..rows.len() as u32)
            .filter(|&i| rows[i as usize].is_some())
            .collect();
        if keep.is_empty() {
            return Ok(parked);
        }
        let mut step_ids = match sampled {
            Some(ids) => ids,
            None => {
                let ids: Vec<u32> = rows
                    .iter()
                    .map(|r| r.map_or(0, |e| *eps[e].tokens.last().unwrap_or(&0)))
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
            rows.retain(Option::is_some);
        }
        decoder.step(model, &mut state, &step_ids)?;
    }
}

/// The assistant message of the turn just sampled joins the episode's messages; `holds`
/// becomes the text its tokens hold.
fn close_turn(tokenizer: &Tokenizer, ep: &mut Live) -> Result<()> {
    let turn = &ep.tokens[ep.turn_start..];
    // A closing EOS token is the template's to render (ChatML's `<|im_end|>`).
    let (body, closing) = match turn.split_last() {
        Some((&last, body))
            if ep.finish == Some(FinishReason::Eos) && tokenizer.eos_token_ids.contains(&last) =>
        {
            (body, Some(last))
        }
        _ => (turn, None),
    };
    let content = tokenizer.decode(body, false)?;
    ep.holds.clear();
    ep.holds.push_str(&ep.rendered);
    ep.holds.push_str(&content);
    if let Some(id) = closing {
        ep.holds.push_str(&tokenizer.decode(&[id], false)?);
    }
    ep.messages.push(ChatMessage::new("assistant", content));
    Ok(())
}

/// Joins the parked rows that go on (those in `chunks`) back into one cache, in the order
/// they left; returns it, their key bias and that order. Rows that left earlier get masked
/// slots up to the longest.
fn rejoin(
    parked: Vec<Parked>,
    chunks: &BTreeMap<usize, Vec<u32>>,
    reserve: usize,
) -> Result<(KvCache, Tensor, Vec<usize>)> {
    let mut caches = Vec::new();
    let mut biases = Vec::new();
    let mut order = Vec::new();
    for p in parked {
        let keep: Vec<u32> = (0..p.rows.len() as u32)
            .filter(|&i| chunks.contains_key(&p.rows[i as usize]))
            .collect();
        if keep.is_empty() {
            continue;
        }
        order.extend(keep.iter().map(|&i| p.rows[i as usize]));
        if keep.len() == p.rows.len() {
            caches.push(p.cache);
            biases.push(p.key_bias);
        } else {
            let keep_t = Tensor::new(keep.as_slice(), p.key_bias.device())?;
            caches.push(p.cache.select_rows(&keep_t)?);
            biases.push(p.key_bias.index_select(&keep_t, 0)?);
        }
    }
    if caches.len() == 1
        && let (Some(cache), Some(bias)) = (caches.pop(), biases.pop())
    {
        return Ok((cache, bias, order));
    }
    let len = caches.iter().map(KvCache::len).max().unwrap_or(0);
    let longest_chunk = chunks.values().map(Vec::len).max().unwrap_or(0);
    let cache = KvCache::concat_rows(&caches, len + longest_chunk + reserve)?;
    let neg = attention_mask_value(DType::F32);
    let biases = biases
        .into_iter()
        .map(|b| {
            let (n, s) = b.dims2()?;
            if s == len {
                return Ok(b);
            }
            let masked = Tensor::full(neg as f32, (n, len - s), b.device())?;
            Tensor::cat(&[&b, &masked], 1)
        })
        .collect::<Result<Vec<_>>>()?;
    Ok((cache, Tensor::cat(&biases, 0)?, order))
}

/// Feeds every row's chunk (`(tokens, position of the first)`) in one forward: right-padded,
/// the padding masked for every later query; returns the decode state for the next turn, with
/// each row's logits at its last real token.
fn append_chunk(
    model: &Transformer,
    mut cache: KvCache,
    key_bias: Tensor,
    rows: &[(&[u32], usize)],
    pad: u32,
) -> Result<DecodeState> {
    let device = model.device().clone();
    let b = rows.len();
    let lc = rows.iter().map(|(c, _)| c.len()).max().unwrap_or(0);
    let neg = attention_mask_value(DType::F32) as f32;
    let mut ids = Vec::with_capacity(b * lc);
    let mut pos = Vec::with_capacity(b * lc);
    let mut chunk_bias = Vec::with_capacity(b * lc * lc);
    let mut key_cols = Vec::with_capacity(b * lc);
    let mut last = Vec::with_capacity(b);
    let mut next = Vec::with_capacity(b);
    for (r, (chunk, start)) in rows.iter().enumerate() {
        let n = chunk.len();
        for j in 0..lc {
            ids.push(chunk.get(j).copied().unwrap_or(pad));
            // Padding takes the first position (its outputs are never used).
            pos.push((start + if j < n { j } else { 0 }) as u32);
            key_cols.push(if j < n { 0.0 } else { neg });
        }
        for q in 0..lc {
            for k in 0..lc {
                chunk_bias.push(if k > q || k >= n { neg } else { 0.0 });
            }
        }
        last.push((r * lc + n - 1) as u32);
        next.push((start + n) as u32);
    }
    let s = key_bias.dim(1)?;
    let ids = Tensor::from_vec(ids, (b, lc), &device)?;
    let pos = Tensor::from_vec(pos, (b, lc), &device)?;
    let past = key_bias
        .reshape((b, 1, 1, s))?
        .broadcast_as((b, 1, lc, s))?
        .contiguous()?;
    let chunk_bias = Tensor::from_vec(chunk_bias, (b, 1, lc, lc), &device)?;
    let bias = Tensor::cat(&[&past, &chunk_bias], 3)?;
    let hidden = model.forward_hidden(&ids, &pos, &bias, Some(&mut cache))?;
    let hs = hidden.dim(2)?;
    let last = Tensor::from_vec(last, b, &device)?;
    let h = hidden.reshape((b * lc, hs))?.index_select(&last, 0)?;
    let logits = model.logits(&h)?;
    let key_cols = Tensor::from_vec(key_cols, (b, lc), &device)?;
    Ok(DecodeState {
        cache,
        key_bias: Tensor::cat(&[&key_bias, &key_cols], 1)?,
        next_pos: Tensor::from_vec(next, (b, 1), &device)?,
        logits,
    })
}
