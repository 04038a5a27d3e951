//! Regex-constrained generation (vLLM's `structured_outputs.regex`): token bytes against the
//! tokenizers' own decoding (byte-level BPE and SentencePiece), completions that match the
//! pattern whatever the seed and sampler, stop tokens only at a match, the model's own recorded
//! log-probs, constrained turns of an episode, and refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeSet;
use std::path::Path;

use candle_core::{DType, Device, Result};
use grpo_rollout::config::Arch;
use grpo_rollout::constrain::{RegexConstraint, gpt2_bytes, token_bytes};
use grpo_rollout::env::{Environment, EnvironmentReturn};
use grpo_rollout::episode::{EpisodeParams, EpisodePrompt, generate_episodes};
use grpo_rollout::generate::{
    Completion, FinishReason, SamplingParams, generate, left_pad, with_device_sampling,
};
use grpo_rollout::init::{Preset, preset_config, random_weights, train_tokenizer};
use grpo_rollout::{ChatMessage, Tokenizer, Transformer};
use proptest::prelude::*;
use serde_json::{Value, json};

fn setup() -> (Transformer, Tokenizer) {
    let tok = train_tokenizer(400).unwrap();
    let cfg = preset_config(
        Preset::Tiny,
        Arch::Qwen2,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    let m = random_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    (m.detached(), tok)
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    ["What is 3 + 4?", "Write about the sea", "alpha beta"]
        .iter()
        .map(|p| tok.encode(p, false).unwrap())
        .collect()
}

/// The whole-text matcher of `pattern` (the regex crate, independent of the DFA walk).
fn full(pattern: &str) -> regex::Regex {
    regex::Regex::new(&format!("^(?:{pattern})$")).unwrap()
}

fn constrained(pattern: &str, seed: u64) -> SamplingParams {
    SamplingParams {
        max_new_tokens: 24,
        temperature: 1.0,
        seed,
        regex: Some(pattern.into()),
        ..Default::default()
    }
}

fn concat(bytes: &[Option<Vec<u8>>], ids: &[u32]) -> Vec<u8> {
    ids.iter()
        .flat_map(|&i| bytes[i as usize].clone().unwrap())
        .collect()
}

#[test]
fn the_byte_table_is_tokenizers_byte_level_alphabet() {
    let table = gpt2_bytes();
    assert_eq!(table.len(), 256);
    let ours: BTreeSet<char> = table.iter().map(|&(_, c)| c).collect();
    let theirs: BTreeSet<char> = tokenizers::pre_tokenizers::byte_level::ByteLevel::alphabet()
        .into_iter()
        .collect();
    assert_eq!(ours, theirs);
    // GPT-2's mapping: printable bytes are themselves, space is 'Ġ', newline 'Ċ'.
    assert!(table.contains(&(b'a', 'a')));
    assert!(table.contains(&(b' ', 'Ġ')));
    assert!(table.contains(&(b'\n', 'Ċ')));
}

#[test]
fn byte_level_token_bytes_spell_the_encoded_text() {
    let tok = train_tokenizer(400).unwrap();
    let bytes = token_bytes(&tok, tok.vocab_size()).unwrap();
    for text in [
        "What is 3 + 4?\nSeven.",
        "  two spaces, a tab\tand ünïcödé — 東京 🎉",
        "alpha beta",
    ] {
        let ids = tok.encode(text, false).unwrap();
        assert_eq!(concat(&bytes, &ids), text.as_bytes(), "{text:?}");
    }
    // Special tokens carry no text.
    for id in &tok.eos_token_ids {
        assert!(bytes[*id as usize].is_none());
    }
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(64))]
    /// Any sequence of ordinary tokens: their bytes are what the tokenizer decodes them to
    /// (when those bytes are UTF-8; tokenizers replaces a broken sequence).
    #[test]
    fn byte_level_token_bytes_are_the_decoders(ids in proptest::collection::vec(0u32..400, 1..12)) {
        let tok = train_tokenizer(400).unwrap();
        let bytes = token_bytes(&tok, tok.vocab_size()).unwrap();
        let ids: Vec<u32> = ids.into_iter().filter(|&i| bytes[i as usize].is_some()).collect();
        let got = concat(&bytes, &ids);
        if let Ok(s) = String::from_utf8(got) {
            prop_assert_eq!(s, tok.decode(&ids, false).unwrap());
        }
    }
}

#[test]
fn sentencepiece_token_bytes_spell_the_text() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let m =
        grpo_rollout::load(&dir.join("spm-llama-micro.gguf"), DType::F32, &Device::Cpu).unwrap();
    let tok = &m.tokenizer;
    let bytes = token_bytes(tok, tok.vocab_size()).unwrap();
    let reference: Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("spm_gguf_reference.json")).unwrap(),
    )
    .unwrap();
    let mut checked = 0;
    for case in reference["texts"].as_array().unwrap() {
        let text = case["text"].as_str().unwrap();
        if text.contains('[') || text.contains("<s>") {
            continue;
        }
        let ids: Vec<u32> = tok.encode(text, false).unwrap();
        let got = String::from_utf8(concat(&bytes, &ids)).unwrap();
        // SentencePiece's dummy prefix is a space before the first word, which decoding strips.
        assert!(
            got == text || got == format!(" {text}"),
            "{text:?} spelt {got:?}"
        );
        checked += 1;
    }
    assert!(checked >= 5);
    // Byte-fallback pieces (`<0x00>`... at ids 3..259) are one byte each.
    for b in 0..=255u8 {
        let id = tok.inner.token_to_id(&format!("<0x{b:02X}>")).unwrap();
        assert_eq!(bytes[id as usize].as_deref(), Some(&[b][..]));
    }
}

#[test]
fn completions_match_the_pattern_and_end_at_a_match() {
    let (m, tok) = setup();
    let pr = prompts(&tok);
    for pattern in [
        "[0-9]{2,4}",
        "(yes|no|maybe)",
        "The answer is (A|B|C)\\.",
        "[a-z]{1,3}( [a-z]{1,3}){0,2}",
    ] {
        let re = full(pattern);
        let mut texts = BTreeSet::new();
        for seed in 0..3 {
            let out = generate(&m, &tok, &pr, 4, &constrained(pattern, seed)).unwrap();
            assert_eq!(out.len(), 12);
            for c in &out {
                assert_eq!(c.finish_reason, FinishReason::Eos, "{pattern}: {c:?}");
                assert!(tok.eos_token_ids.contains(c.token_ids.last().unwrap()));
                assert!(re.is_match(&c.text), "{pattern}: {:?}", c.text);
                texts.insert(c.text.clone());
            }
        }
        // The constraint shapes the draw, it does not pick one text.
        assert!(texts.len() > 1, "{pattern}: always {texts:?}");
    }
}

#[test]
fn a_completion_cut_by_the_length_is_a_prefix_of_a_match() {
    let (m, tok) = setup();
    // Unbounded: the length cuts most completions; each is then a prefix of a match.
    let p = SamplingParams {
        max_new_tokens: 6,
        ..constrained("x[0-9]+(,[0-9]+)*", 2)
    };
    let out = generate(&m, &tok, &prompts(&tok), 4, &p).unwrap();
    let prefix = regex::Regex::new("^x([0-9]+(,[0-9]*)*)?$").unwrap();
    let mut cut = 0;
    for c in &out {
        assert!(prefix.is_match(&c.text), "{:?}", c.text);
        if c.finish_reason == FinishReason::Length {
            cut += 1;
        } else {
            assert!(full("x[0-9]+(,[0-9]+)*").is_match(&c.text), "{:?}", c.text);
        }
    }
    assert!(cut > 0);
}

#[test]
fn greedy_takes_the_best_allowed_token() {
    let (m, tok) = setup();
    let pr = prompts(&tok);
    let p = SamplingParams {
        temperature: 0.0,
        ..constrained("(yes|no)", 0)
    };
    let out = generate(&m, &tok, &pr[..1], 1, &p).unwrap();
    let c = &out[0];
    assert!(c.text == "yes" || c.text == "no", "{:?}", c.text);
    // The first token is the argmax of the prompt's logits over the tokens that begin a match.
    let bytes = token_bytes(&tok, m.cfg.vocab_size).unwrap();
    let starts = |id: usize| {
        bytes[id]
            .as_ref()
            .is_some_and(|b| !b.is_empty() && (b"yes".starts_with(b) || b"no".starts_with(b)))
    };
    let (ids, mask) = left_pad(&pr[..1], tok.pad_token_id, &Device::Cpu).unwrap();
    let h = m.forward_padded(&ids, &mask).unwrap();
    let l = h.dim(1).unwrap();
    let logits: Vec<f32> = m
        .logits(&h.narrow(1, l - 1, 1).unwrap().squeeze(1).unwrap())
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let best = (0..logits.len())
        .filter(|&i| starts(i))
        .max_by(|&a, &b| logits[a].total_cmp(&logits[b]))
        .unwrap();
    assert_eq!(c.token_ids[0], best as u32);
}

#[test]
fn the_device_sampler_draws_what_the_host_draws() {
    let (m, tok) = setup();
    let pr = prompts(&tok);
    for p in [
        constrained("[0-9]{2,4}", 4),
        SamplingParams {
            top_k: 20,
            top_p: 0.9,
            repetition_penalty: 1.3,
            min_new_tokens: 2,
            ..constrained("(yes|no|maybe)( (yes|no))?", 5)
        },
    ] {
        let host = with_device_sampling(false, || generate(&m, &tok, &pr, 3, &p)).unwrap();
        let device = with_device_sampling(true, || generate(&m, &tok, &pr, 3, &p)).unwrap();
        let ids = |v: &[Completion]| v.iter().map(|c| c.token_ids.clone()).collect::<Vec<_>>();
        assert_eq!(ids(&host), ids(&device));
        for (a, b) in host.iter().zip(&device) {
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-5);
            }
        }
    }
}

#[test]
fn a_complete_match_ends_before_min_new_tokens() {
    let (m, tok) = setup();
    let p = SamplingParams {
        min_new_tokens: 8,
        ..constrained("(yes|no)", 1)
    };
    for c in generate(&m, &tok, &prompts(&tok), 3, &p).unwrap() {
        assert_eq!(c.finish_reason, FinishReason::Eos);
        assert!(c.text == "yes" || c.text == "no", "{:?}", c.text);
    }
    // An open pattern still holds EOS back until min_new_tokens.
    let p = SamplingParams {
        min_new_tokens: 5,
        max_new_tokens: 12,
        ..constrained("[a-z ]+", 1)
    };
    for c in generate(&m, &tok, &prompts(&tok), 3, &p).unwrap() {
        assert!(c.token_ids.len() >= 5, "{c:?}");
    }
}

#[test]
fn recorded_logprobs_are_the_models_own() {
    let (m, tok) = setup();
    let pr = prompts(&tok);
    let out = generate(&m, &tok, &pr, 2, &constrained("[0-9]{2,4}", 7)).unwrap();
    let mut forced = 0;
    for c in &out {
        let mut ids = pr[c.prompt_index].clone();
        ids.extend(&c.token_ids);
        let (ids_t, mask) = left_pad(&[ids], tok.pad_token_id, &Device::Cpu).unwrap();
        let (lp, _) = m
            .completion_logprobs(&ids_t, &mask, c.token_ids.len(), 1.0, false)
            .unwrap();
        let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
        for (a, b) in lp.iter().zip(&c.logprobs) {
            assert!((a - b).abs() < 1e-4, "forward {a} vs sampling {b}");
        }
        // A forced EOS (after four digits) is recorded with the model's probability, not 1.
        forced += usize::from(*c.logprobs.last().unwrap() < -1e-3);
    }
    assert!(forced > 0);
}

#[test]
fn bad_patterns_and_tokenizers_are_refused_in_one_line() {
    let (m, tok) = setup();
    let err = generate(&m, &tok, &prompts(&tok), 1, &constrained("(unclosed", 0))
        .unwrap_err()
        .to_string();
    // (A backtrace may follow the message's one line.)
    assert_eq!(
        err.lines().next().unwrap(),
        "regex `(unclosed`: unclosed group"
    );
    let mut bare = tok.clone();
    bare.inner.with_decoder(None::<tokenizers::DecoderWrapper>);
    let err = RegexConstraint::new("[0-9]+", &bare, m.cfg.vocab_size, &tok.eos_token_ids)
        .unwrap_err()
        .to_string();
    assert!(err.contains("decoder"), "{err}");
}

/// Answers every turn with "again" until three turns have passed.
struct Again;

impl Environment for Again {
    fn name(&self) -> &str {
        "again"
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let mut out = EnvironmentReturn::empty(logs.len());
        for (i, meta) in metadata.iter().enumerate() {
            let turns = meta["turns"].as_u64().unwrap_or(0) + 1;
            out.observations[i] = Some(ChatMessage::new("user", "again"));
            out.metadata[i] = json!({ "turns": turns });
            out.terminateds[i] = turns >= 3;
        }
        Ok(out)
    }
}

#[test]
fn each_turn_of_an_episode_is_constrained_on_its_own() {
    let (m, tok) = setup();
    let ps: Vec<EpisodePrompt> = ["Guess my number.", "Pick one."]
        .iter()
        .map(|t| {
            EpisodePrompt::from_messages(&tok, vec![ChatMessage::new("user", *t)], json!({}))
                .unwrap()
        })
        .collect();
    let params = EpisodeParams {
        sampling: constrained("[0-9]{1,2}", 3),
        max_turns: 5,
        max_tokens_per_turn: 8,
        max_total_tokens: 400,
    };
    let re = full("[0-9]{1,2}");
    let eps = generate_episodes(&m, &tok, &Again, &ps, 3, &params).unwrap();
    assert_eq!(eps.len(), 6);
    for ep in &eps {
        assert_eq!(ep.turns.len(), 3);
        let answers: Vec<&ChatMessage> = ep
            .messages
            .iter()
            .filter(|m| m.role == "assistant")
            .collect();
        assert_eq!(answers.len(), 3);
        for (t, a) in ep.turns.iter().zip(answers) {
            assert_eq!(t.finish_reason, FinishReason::Eos);
            assert!(re.is_match(&a.content), "{:?}", a.content);
        }
    }
}

/// SmolLM2-135M-Instruct (when `scripts/fetch-smollm2.sh` has fetched it): a real byte-level
/// vocabulary of 49,152 tokens, Unicode classes, and the chat template's end-of-turn token.
#[test]
fn smollm2_completions_match_unicode_patterns() {
    let path = match std::env::var_os("GRPO_SMOLLM2_GGUF") {
        Some(p) => std::path::PathBuf::from(p),
        None => {
            Path::new(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf")
        }
    };
    if !path.exists() {
        eprintln!(
            "skipping: {} not found (run scripts/fetch-smollm2.sh)",
            path.display()
        );
        return;
    }
    let m = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    let tok = &m.tokenizer;
    let model = m.model.detached();
    let bytes = token_bytes(tok, m.model.cfg.vocab_size).unwrap();
    for (i, b) in bytes.iter().enumerate() {
        if let Some(b) = b
            && let Ok(s) = std::str::from_utf8(b)
        {
            assert_eq!(tok.decode(&[i as u32], false).unwrap(), s, "token {i}");
        }
    }
    let prompt = tok
        .apply_chat_template(&[ChatMessage::new("user", "Name a colour.")], true)
        .unwrap();
    let ids = tok.encode(&prompt, false).unwrap();
    for pattern in [r"\w+( \w+)?\.", "(Red|Green|Blue)", r"[A-Z][a-z]{2,8}"] {
        let re = full(pattern);
        for seed in 0..2 {
            let p = SamplingParams {
                max_new_tokens: 24,
                seed,
                regex: Some(pattern.into()),
                ..Default::default()
            };
            for c in generate(&model, tok, std::slice::from_ref(&ids), 4, &p).unwrap() {
                if c.finish_reason == FinishReason::Eos {
                    assert!(
                        re.is_match(&c.text),
                        "{pattern}: {:?} {:?}",
                        c.text,
                        c.token_ids
                    );
                }
            }
        }
    }
}
