//! GGUF files with a SentencePiece vocabulary (`tokenizer.ggml.model = llama`, as llama.cpp
//! writes Llama 2, Mistral and TinyLlama models) against llama.cpp itself.
//!
//! Reference values: `fixtures/spm_gguf_reference.json`, with the file
//! `fixtures/spm-llama-micro.gguf` (a SentencePiece BPE vocabulary of 900 trained on the
//! README, byte fallback, `[INST]` / `[/INST]` as control tokens; a one-layer random llama), by
//! `scripts/gen_spm_gguf_reference.py` with llama-cpp-python 0.3.36: the ids llama.cpp gives
//! each text (BOS added, special tokens parsed) and the log-probs its model gives a completion.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("spm_gguf_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The fixture file, loaded.
fn micro() -> grpo_rollout::LoadedModel {
    grpo_rollout::load(
        &fixtures().join("spm-llama-micro.gguf"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

#[test]
fn tokenises_as_llama_cpp_and_decodes_back() {
    let r = reference();
    let m = micro();
    let tok = &m.tokenizer;
    let cases = r["texts"].as_array().unwrap();
    assert!(cases.len() >= 10);
    let mut fell_back = false;
    for c in cases {
        let text = c["text"].as_str().unwrap();
        let want = ids(&c["ids"]);
        let got = tok.encode(text, true).unwrap();
        assert_eq!(got, want, "{text:?}");
        // Byte tokens (`<0xE4>`...) are ids 3..259 here: the CJK and emoji text uses them.
        fell_back |= got.iter().any(|i| (3..259).contains(i));
        // Text without control tokens decodes back to itself.
        if !text.contains('[') && !text.contains("<s>") {
            assert_eq!(tok.decode(&got, true).unwrap(), text);
        }
    }
    assert!(fell_back, "no text needed the byte fallback");
    assert_eq!(tok.bos_token.as_deref(), Some("<s>"));
    assert_eq!(tok.eos_token_ids, vec![2]);
}

#[test]
fn logprobs_match_llama_cpp() {
    let r = reference();
    let m = micro();
    let (p, c) = (ids(&r["prompt_ids"]), ids(&r["completion_ids"]));
    // The prompt's and completion's ids as we make them are llama.cpp's.
    assert_eq!(
        m.tokenizer
            .encode(r["prompt"].as_str().unwrap(), true)
            .unwrap(),
        p
    );
    assert_eq!(
        m.tokenizer
            .encode(r["completion"].as_str().unwrap(), false)
            .unwrap(),
        c
    );
    let row: Vec<u32> = [p.as_slice(), &c].concat();
    let n = row.len();
    let ids = Tensor::from_vec(row, (1, n), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let (lp, _) = m
        .model
        .completion_logprobs(&ids, &mask, c.len(), 1.0, false)
        .unwrap();
    let got: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    let want: Vec<f64> = serde_json::from_value(r["logprobs"].clone()).unwrap();
    assert_eq!(got.len(), want.len());
    let d = got
        .iter()
        .zip(&want)
        .map(|(a, b)| (*a as f64 - b).abs())
        .fold(0f64, f64::max);
    eprintln!("max |ours - llama.cpp| = {d:e}");
    assert!(d < 1e-4, "max |ours - llama.cpp| = {d:e}");
}

/// The model exports as a Hugging Face directory, and as GGUF again (llama.cpp's `llama`
/// tokenizer: scores from the merges' ranks, byte / unknown / control types), each reading
/// back with llama.cpp's ids for every text and the same log-probs.
#[test]
fn exports_to_hf_and_to_gguf_with_the_same_ids() {
    let r = reference();
    let m = micro();
    let tmp = tempfile::tempdir().unwrap();
    grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, tmp.path(), DType::F32).unwrap();
    let hf = grpo_rollout::load(tmp.path(), DType::F32, &Device::Cpu).unwrap();
    let path = tmp.path().join("again.gguf");
    grpo_rollout::gguf::save_gguf(
        &m.model,
        &m.tokenizer,
        &path,
        grpo_rollout::gguf::GgufType::F32,
        "again",
    )
    .unwrap();
    let again = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
    for back in [&hf, &again] {
        for c in r["texts"].as_array().unwrap() {
            let text = c["text"].as_str().unwrap();
            assert_eq!(
                back.tokenizer.encode(text, true).unwrap(),
                ids(&c["ids"]),
                "{text:?}"
            );
        }
    }
    // The same vocabulary and types as the file llama.cpp wrote (scores: the same order).
    let md = |p: &Path| {
        let mut f = std::fs::File::open(p).unwrap();
        candle_core::quantized::gguf_file::Content::read(&mut f)
            .unwrap()
            .metadata
    };
    let (a, b) = (md(&fixtures().join("spm-llama-micro.gguf")), md(&path));
    for k in [
        "tokenizer.ggml.model",
        "tokenizer.ggml.tokens",
        "tokenizer.ggml.token_type",
    ] {
        assert_eq!(format!("{:?}", a[k]), format!("{:?}", b[k]), "{k}");
    }
    assert!(!b.contains_key("tokenizer.ggml.merges"));
}
