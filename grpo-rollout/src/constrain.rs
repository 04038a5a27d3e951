//! Regex-constrained sampling: vLLM's `structured_outputs.regex` (TRL's
//! `vllm_structured_outputs_regex`). Every completion's text is a match of the whole pattern, or
//! a prefix of one when `max_new_tokens` cuts it short.
//!
//! The pattern becomes a byte-level DFA (regex-automata; anchored at the completion's start,
//! every match kept so that a match may still grow, `$` at the completion's end). Each token's
//! bytes come from the tokenizer's decoder: byte-level BPE maps characters back through GPT-2's
//! byte table, SentencePiece reads `▁` as a space and `<0xHH>` byte-fallback tokens as their
//! byte. A row carries its DFA state; at each step a token is allowed when its bytes keep the
//! DFA alive, and the stop tokens (EOS and `stop_token_ids`) only where the text so far is a
//! full match. Special tokens other than the stop tokens are never allowed. A state's allowed
//! set is computed the first time a row reaches it and kept for the rest of the generation.
//!
//! The recorded log-probs stay the model's own (`log_softmax(logits / temperature)`), as with
//! the other sampling filters: the mask changes what is drawn, not what is recorded.

use std::collections::{HashMap, HashSet};

use candle_core::{Device, Result, Tensor, bail};
use rayon::prelude::*;
use regex_automata::dfa::{Automaton, StartKind, dense};
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};
use serde_json::Value;

use crate::tokenizer::Tokenizer;

/// The most memory the pattern's DFA may take (a larger one is refused in one line).
pub const DFA_SIZE_LIMIT: usize = 64 << 20;

/// Each token id's bytes as the completion's text holds them (`None`: a special token, which
/// carries no text, or an id past the tokenizer's vocabulary).
pub fn token_bytes(tokenizer: &Tokenizer, vocab: usize) -> Result<Vec<Option<Vec<u8>>>> {
    let inner = &tokenizer.inner;
    let decoder = match inner.get_decoder() {
        Some(d) => serde_json::to_value(d).map_err(candle_core::Error::wrap)?,
        None => bail!(
            "a regex constraint needs the tokenizer's decoder to know each token's bytes; this tokenizer has none"
        ),
    };
    let mut types = Vec::new();
    decoder_types(&decoder, &mut types);
    let has = |t: &str| types.iter().any(|x| x == t);
    let byte_level = has("ByteLevel");
    let sentencepiece = has("Metaspace")
        || (has("Replace") && decoder.to_string().contains('\u{2581}'))
        || has("ByteFallback");
    if !byte_level && !sentencepiece {
        bail!(
            "a regex constraint needs a byte-level BPE or SentencePiece tokenizer; this one's decoder is {}",
            types.first().map_or("unknown", String::as_str)
        );
    }
    let byte_of: HashMap<char, u8> = gpt2_bytes().into_iter().map(|(b, c)| (c, b)).collect();
    let special: std::collections::HashSet<u32> = inner
        .get_added_tokens_decoder()
        .into_iter()
        .filter(|(_, t)| t.special)
        .map(|(id, _)| id)
        .collect();
    Ok((0..vocab as u32)
        .map(|id| {
            if special.contains(&id) {
                return None;
            }
            let token = inner.id_to_token(id)?;
            Some(if byte_level {
                // As tokenizers' ByteLevel decoder: every character through the byte table,
                // or the token's own UTF-8 when one is not in it.
                token
                    .chars()
                    .map(|c| byte_of.get(&c).copied())
                    .collect::<Option<Vec<u8>>>()
                    .unwrap_or_else(|| token.as_bytes().to_vec())
            } else {
                sentencepiece_bytes(&token)
            })
        })
        .collect())
}

/// Every `"type"` in a decoder's JSON, outermost first.
fn decoder_types(v: &Value, out: &mut Vec<String>) {
    match v {
        Value::Object(o) => {
            if let Some(Value::String(t)) = o.get("type") {
                out.push(t.clone());
            }
            for x in o.values() {
                decoder_types(x, out);
            }
        }
        Value::Array(a) => a.iter().for_each(|x| decoder_types(x, out)),
        _ => {}
    }
}

/// A SentencePiece piece's bytes: `<0xHH>` is that byte, `▁` a space.
fn sentencepiece_bytes(token: &str) -> Vec<u8> {
    if let Some(hex) = token
        .strip_prefix("<0x")
        .and_then(|s| s.strip_suffix('>'))
        .filter(|h| h.len() == 2)
        && let Ok(b) = u8::from_str_radix(hex, 16)
    {
        return vec![b];
    }
    token.replace('\u{2581}', " ").into_bytes()
}

/// GPT-2's table of the character that stands for each byte in a byte-level BPE vocabulary:
/// printable Latin-1 bytes stand for themselves, the other 68 for U+0100 onwards in order.
pub fn gpt2_bytes() -> Vec<(u8, char)> {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    let mut next = 256u32;
    (0..=255u8)
        .map(|b| {
            if printable(b) {
                (b, char::from(b))
            } else {
                let c = char::from_u32(next).expect("U+0100..U+0143 are characters");
                next += 1;
                (b, c)
            }
        })
        .collect()
}

/// A DFA state's allowed tokens.
#[derive(Debug, Clone)]
pub struct Allowed {
    /// Bit `i` set: token `i` may be sampled.
    pub bits: Vec<u64>,
    /// Whether only stop tokens are allowed (the text is complete): `min_new_tokens` does not
    /// hold them back then.
    pub only_stop: bool,
}

impl Allowed {
    /// Whether token `id` may be sampled.
    pub fn allows(&self, id: usize) -> bool {
        self.bits
            .get(id / 64)
            .is_some_and(|w| w >> (id % 64) & 1 == 1)
    }
}

/// A compiled pattern over one tokenizer's vocabulary (see the module's documentation).
pub struct RegexConstraint {
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    /// The states from which some continuation (possibly none) completes a match. (The DFA's
    /// own dead state is not enough: it reports a match one byte late, so the byte after a
    /// complete text leads to a state that is not dead yet has no future.) Indexed by the
    /// state's id.
    live: Vec<bool>,
    tokens: Vec<Option<Vec<u8>>>,
    stop_ids: Vec<u32>,
    /// The slot of each DFA state reached so far.
    slots: HashMap<StateID, usize>,
    allowed: Vec<Allowed>,
    /// `(slots, V)` u8 on the sampling device, 1 where allowed (built as slots appear).
    table: Option<Tensor>,
}

impl std::fmt::Debug for RegexConstraint {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegexConstraint")
            .field("states_seen", &self.allowed.len())
            .field("vocab", &self.tokens.len())
            .finish()
    }
}

impl RegexConstraint {
    /// Compiles `pattern` (Rust `regex` syntax) for the `vocab` token ids of `tokenizer`;
    /// `stop_ids` end a completion (allowed only where the pattern has matched).
    pub fn new(
        pattern: &str,
        tokenizer: &Tokenizer,
        vocab: usize,
        stop_ids: &[u32],
    ) -> Result<Self> {
        let dfa = compile(pattern).map_err(candle_core::Error::msg)?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|e| candle_core::Error::msg(format!("regex `{pattern}`: {e}")))?;
        let live = live_states(&dfa, start);
        Ok(Self {
            dfa,
            start,
            live,
            tokens: token_bytes(tokenizer, vocab)?,
            stop_ids: stop_ids.to_vec(),
            slots: HashMap::new(),
            allowed: Vec::new(),
            table: None,
        })
    }

    /// The constraint of `params.regex` (none without one), compiled once per generation.
    pub fn for_params(
        params: &crate::generate::SamplingParams,
        tokenizer: &Tokenizer,
        vocab: usize,
        stop_ids: &[u32],
    ) -> Result<Option<Self>> {
        params
            .regex
            .as_deref()
            .map(|p| Self::new(p, tokenizer, vocab, stop_ids))
            .transpose()
    }

    /// Each batch row's slot ([`Self::slot`]): its state, or the start for a row that has
    /// finished and only waits to leave the batch.
    pub fn slots(&mut self, states: impl Iterator<Item = Option<StateID>>) -> Vec<usize> {
        states.map(|s| self.slot(s.unwrap_or(self.start))).collect()
    }

    /// The state of an empty completion.
    pub fn start(&self) -> StateID {
        self.start
    }

    /// The state after `token` (a stop token or a special one leaves it as it is).
    pub fn advance(&self, state: StateID, token: u32) -> StateID {
        match self.tokens.get(token as usize) {
            Some(Some(bytes)) => bytes.iter().fold(state, |s, &b| self.dfa.next_state(s, b)),
            _ => state,
        }
    }

    /// Whether text that led to `state` matches the whole pattern.
    pub fn is_match(&self, state: StateID) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(state))
    }

    /// Whether text that led to `state` can still become a match.
    fn alive(&self, state: StateID) -> bool {
        self.live.get(state.as_usize()).copied().unwrap_or(false)
    }

    /// The slot of `state`'s allowed set, computed the first time.
    pub fn slot(&mut self, state: StateID) -> usize {
        if let Some(&s) = self.slots.get(&state) {
            return s;
        }
        let v = self.tokens.len();
        // One word of 64 tokens per task: the vocabulary is walked on every core.
        let keeps = |bytes: &[u8]| {
            let mut s = state;
            bytes.iter().all(|&b| {
                s = self.dfa.next_state(s, b);
                self.alive(s)
            })
        };
        let mut bits: Vec<u64> = self
            .tokens
            .par_chunks(64)
            .enumerate()
            .map(|(w, chunk)| {
                let mut word = 0u64;
                for (j, bytes) in chunk.iter().enumerate() {
                    let id = (w * 64 + j) as u32;
                    if let Some(b) = bytes
                        && !b.is_empty()
                        && self.stop_ids.binary_search(&id).is_err()
                        && keeps(b)
                    {
                        word |= 1 << j;
                    }
                }
                word
            })
            .collect();
        let any = bits.iter().any(|&w| w != 0);
        // Stop tokens where the text is a match, and where nothing can continue it (a pattern
        // that needs bytes no token has): the row ends rather than draw from nothing.
        if self.is_match(state) || !any {
            for &id in &self.stop_ids {
                if (id as usize) < v {
                    bits[id as usize / 64] |= 1 << (id % 64);
                }
            }
        }
        let slot = self.allowed.len();
        self.allowed.push(Allowed {
            bits,
            only_stop: !any,
        });
        self.slots.insert(state, slot);
        slot
    }

    /// The allowed set of a slot.
    pub fn allowed(&self, slot: usize) -> &Allowed {
        &self.allowed[slot]
    }

    /// `(rows, V)` u8 on `device`, 1 where each row's slot allows a token (one gather from a
    /// table of the slots seen, grown as new ones appear).
    pub fn device_mask(&mut self, slots: &[usize], device: &Device) -> Result<Tensor> {
        let v = self.tokens.len();
        let have = self.table.as_ref().map_or(0, |t| t.dim(0).unwrap_or(0));
        if have < self.allowed.len() {
            let mut fresh = Vec::with_capacity((self.allowed.len() - have) * v);
            for a in &self.allowed[have..] {
                fresh.extend((0..v).map(|i| u8::from(a.allows(i))));
            }
            let fresh = Tensor::from_vec(fresh, (self.allowed.len() - have, v), device)?;
            self.table = Some(match self.table.take() {
                Some(t) => Tensor::cat(&[t, fresh], 0)?,
                None => fresh,
            });
        }
        let idx: Vec<u32> = slots.iter().map(|&s| s as u32).collect();
        let idx = Tensor::from_vec(idx, slots.len(), device)?;
        let table = self.table.as_ref().expect("a slot exists for every row");
        table.index_select(&idx, 0)
    }
}

/// The states reachable from `start` from which a match is reachable: a state whose text is
/// a full match (at the end of input), and every state with a byte into one of those.
fn live_states(dfa: &dense::DFA<Vec<u32>>, start: StateID) -> Vec<bool> {
    let doomed = |s: StateID| dfa.is_dead_state(s) || dfa.is_quit_state(s);
    let mut seen = HashSet::from([start]);
    let mut order = vec![start];
    let mut into: HashMap<StateID, Vec<StateID>> = HashMap::new();
    let mut i = 0;
    while i < order.len() {
        let s = order[i];
        i += 1;
        for b in 0..=255u8 {
            let t = dfa.next_state(s, b);
            if doomed(t) {
                continue;
            }
            into.entry(t).or_default().push(s);
            if seen.insert(t) {
                order.push(t);
            }
        }
    }
    let mut live: HashSet<StateID> = order
        .iter()
        .copied()
        .filter(|&s| dfa.is_match_state(dfa.next_eoi_state(s)))
        .collect();
    let mut stack: Vec<StateID> = live.iter().copied().collect();
    while let Some(t) = stack.pop() {
        for &s in into.get(&t).map_or(&[][..], Vec::as_slice) {
            if live.insert(s) {
                stack.push(s);
            }
        }
    }
    let mut flags = vec![false; order.iter().map(|s| s.as_usize() + 1).max().unwrap_or(0)];
    for s in live {
        flags[s.as_usize()] = true;
    }
    flags
}

/// Checks that `pattern` compiles; the error, one line, names it and says why.
pub fn check_pattern(pattern: &str) -> std::result::Result<(), String> {
    compile(pattern).map(|_| ())
}

/// The pattern's DFA: anchored, every match kept (a matched prefix may still grow), a clear
/// error for a pattern that does not parse or is too large.
fn compile(pattern: &str) -> std::result::Result<dense::DFA<Vec<u32>>, String> {
    dense::Builder::new()
        .configure(
            dense::Config::new()
                .start_kind(StartKind::Anchored)
                .match_kind(MatchKind::All)
                .dfa_size_limit(Some(DFA_SIZE_LIMIT))
                .determinize_size_limit(Some(DFA_SIZE_LIMIT))
                .unicode_word_boundary(true),
        )
        .build(pattern)
        .map_err(|e| {
            // The parser's own message ("unclosed group", ...) where it has one.
            let why = match regex_automata::util::syntax::parse(pattern) {
                Err(p) => p
                    .to_string()
                    .lines()
                    .find_map(|l| l.strip_prefix("error: "))
                    .map_or_else(|| p.to_string().replace('\n', " "), str::to_string),
                Ok(_) => {
                    let mut msg = e.to_string();
                    let mut src = std::error::Error::source(&e);
                    while let Some(s) = src {
                        msg = format!("{msg}: {s}");
                        src = s.source();
                    }
                    msg.replace('\n', " ")
                }
            };
            format!("regex `{pattern}`: {why}")
        })
}
