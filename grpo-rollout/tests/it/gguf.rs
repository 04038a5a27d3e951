//! GGUF loading: a synthetic file written here (always runs), and parity with transformers on
//! SmolLM2-135M-Instruct Q4_1 (runs when `scripts/fetch-smollm2.sh` has fetched the file into
//! `models/`, or `GRPO_SMOLLM2_GGUF` names it; otherwise those tests print why and pass).
//!
//! `fixtures/smollm2_gguf_reference.json` was produced with transformers 5.23.0, gguf 0.17 and
//! torch 2.15 (CPU, float32) by this snippet (`d` = the directory holding the .gguf):
//!
//! ```python
//! import json, torch
//! from transformers import AutoTokenizer, AutoModelForCausalLM
//! d = "models"; f = "SmolLM2-135M-Instruct.Q4_1.gguf"
//! tok = AutoTokenizer.from_pretrained(d, gguf_file=f)
//! texts = ["Hello world!", " 123 4567 3.14159 x=42", "Café naïve 日本語 🦀 — ok",
//!          "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\n",
//!          "  leading spaces\n\ttabs\n\nnewlines  ", "don't I'll WE'RE"]
//! out = {"encode": [[t, tok.encode(t, add_special_tokens=True)] for t in texts]}
//! msgs = [{"role": "system", "content": "You are a concise assistant."},
//!         {"role": "user", "content": "What is 2+2?"},
//!         {"role": "assistant", "content": "4"},
//!         {"role": "user", "content": "And 3+3?"}]
//! out["chat_system"] = tok.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
//! q = [{"role": "user", "content": "What is the capital of France?"}]
//! out["chat_default_system"] = tok.apply_chat_template(q, tokenize=False, add_generation_prompt=True)
//! out["special"] = {"bos": tok.bos_token, "eos": tok.eos_token, "pad": tok.pad_token, "unk": tok.unk_token}
//! model = AutoModelForCausalLM.from_pretrained(d, gguf_file=f, torch_dtype=torch.float32).eval()
//! sd = model.state_dict()
//! def sl(name, rows, cols):
//!     t = sd[name]
//!     return t[rows[0]:rows[1], cols[0]:cols[1]].tolist() if t.dim() == 2 else t[cols[0]:cols[1]].tolist()
//! # key -> [row range, column range, values]; "name@k" is a second slice of "name".
//! out["weights"] = {
//!   "model.embed_tokens.weight": [[100, 102], [0, 16], sl("model.embed_tokens.weight", (100, 102), (0, 16))],
//!   "model.layers.0.self_attn.q_proj.weight": [[0, 4], [0, 16], sl("model.layers.0.self_attn.q_proj.weight", (0, 4), (0, 16))],
//!   "model.layers.0.self_attn.q_proj.weight@32": [[32, 34], [0, 16], sl("model.layers.0.self_attn.q_proj.weight", (32, 34), (0, 16))],
//!   "model.layers.0.self_attn.k_proj.weight": [[0, 4], [0, 16], sl("model.layers.0.self_attn.k_proj.weight", (0, 4), (0, 16))],
//!   "model.layers.0.self_attn.k_proj.weight@97": [[97, 99], [32, 48], sl("model.layers.0.self_attn.k_proj.weight", (97, 99), (32, 48))],
//!   "model.layers.29.self_attn.v_proj.weight": [[5, 7], [0, 16], sl("model.layers.29.self_attn.v_proj.weight", (5, 7), (0, 16))],
//!   "model.layers.3.mlp.down_proj.weight": [[0, 2], [64, 80], sl("model.layers.3.mlp.down_proj.weight", (0, 2), (64, 80))],
//!   "model.layers.0.input_layernorm.weight": [[0, 0], [0, 16], sl("model.layers.0.input_layernorm.weight", None, (0, 16))],
//!   "model.norm.weight": [[0, 0], [0, 16], sl("model.norm.weight", None, (0, 16))],
//! }
//! ids = tok(out["chat_default_system"], return_tensors="pt").input_ids
//! with torch.no_grad():
//!     logits = model(ids).logits[0, -1]
//! probe = sorted(set(torch.topk(logits, 20).indices.tolist()) | set(range(0, 49152, 499)))
//! out["logits"] = {"prompt_ids": ids[0].tolist(), "ids": probe,
//!                  "values": [logits[i].item() for i in probe], "argmax": int(logits.argmax())}
//! with torch.no_grad():
//!     g = model.generate(ids, max_new_tokens=24, do_sample=False)
//! out["greedy"] = {"ids": g[0, ids.shape[1]:].tolist(), "text": tok.decode(g[0, ids.shape[1]:])}
//! json.dump(out, open("smollm2_gguf_reference.json", "w"), ensure_ascii=False, indent=1)
//! ```

#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::OnceLock;

use candle_core::quantized::gguf_file::{self, Value};
use candle_core::quantized::{GgmlDType, QTensor};
use candle_core::{DType, Device, Tensor};
use grpo_rollout::gguf::load_gguf;
use grpo_rollout::{Arch, ChatMessage, LoadedModel};
use serde_json::Value as Json;

// ---------------------------------------------------------------------------------------------
// Synthetic file (always runs)
// ---------------------------------------------------------------------------------------------

/// llama.cpp's `permute` (convert_hf_to_gguf.py), written independently of the loader with plain
/// index arithmetic: row `h·hd + j·2 + s` of the output is row `h·hd + s·hd/2 + j` of the input.
fn llama_cpp_permute(t: &Tensor, n_head: usize) -> Tensor {
    let dims = t.dims().to_vec();
    let rows = dims[0];
    let cols: usize = dims[1..].iter().product();
    let hd = rows / n_head;
    let half = hd / 2;
    let src: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
    let mut dst = vec![0f32; src.len()];
    for h in 0..n_head {
        for j in 0..half {
            for s in 0..2 {
                let to = h * hd + j * 2 + s;
                let from = h * hd + s * half + j;
                dst[to * cols..(to + 1) * cols]
                    .copy_from_slice(&src[from * cols..(from + 1) * cols]);
            }
        }
    }
    Tensor::from_vec(dst, dims, &Device::Cpu).unwrap()
}

fn seq(shape: &[usize], seed: f32) -> Tensor {
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n).map(|i| ((i as f32 + seed) * 0.37).sin()).collect();
    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
}

struct Synthetic {
    path: PathBuf,
    /// transformers name → original (un-permuted) tensor.
    originals: HashMap<String, Tensor>,
}

/// Writes a one-layer model (hidden 8, 2 query heads, 1 KV head, head_dim 4) in llama.cpp's
/// naming and layout, with a small byte-level BPE vocabulary.
fn write_synthetic(arch: &str, tied: bool) -> Synthetic {
    let (h, nh, nkv, hd, ffn) = (8usize, 2usize, 1usize, 4usize, 16usize);
    let tokens: Vec<&str> = vec![
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "a",
        "b",
        "c",
        "Ġ",
        "ab",
        "Ġab",
        "1",
        "2",
    ];
    let merges = ["a b", "Ġ ab"];
    let vocab = tokens.len();
    let mut hf: Vec<(&str, String, Tensor)> = Vec::new(); // (gguf name, hf name, original)
    let mut add = |g: String, n: String, t: Tensor| hf.push((Box::leak(g.into_boxed_str()), n, t));
    add(
        "token_embd.weight".into(),
        "model.embed_tokens.weight".into(),
        seq(&[vocab, h], 1.0),
    );
    add(
        "output_norm.weight".into(),
        "model.norm.weight".into(),
        seq(&[h], 2.0),
    );
    if !tied {
        add(
            "output.weight".into(),
            "lm_head.weight".into(),
            seq(&[vocab, h], 3.0),
        );
    }
    let p = "model.layers.0";
    add(
        "blk.0.attn_norm.weight".into(),
        format!("{p}.input_layernorm.weight"),
        seq(&[h], 4.0),
    );
    add(
        "blk.0.ffn_norm.weight".into(),
        format!("{p}.post_attention_layernorm.weight"),
        seq(&[h], 5.0),
    );
    add(
        "blk.0.attn_q.weight".into(),
        format!("{p}.self_attn.q_proj.weight"),
        seq(&[nh * hd, h], 6.0),
    );
    add(
        "blk.0.attn_k.weight".into(),
        format!("{p}.self_attn.k_proj.weight"),
        seq(&[nkv * hd, h], 7.0),
    );
    add(
        "blk.0.attn_v.weight".into(),
        format!("{p}.self_attn.v_proj.weight"),
        seq(&[nkv * hd, h], 8.0),
    );
    add(
        "blk.0.attn_output.weight".into(),
        format!("{p}.self_attn.o_proj.weight"),
        seq(&[h, nh * hd], 9.0),
    );
    add(
        "blk.0.ffn_gate.weight".into(),
        format!("{p}.mlp.gate_proj.weight"),
        seq(&[ffn, h], 10.0),
    );
    add(
        "blk.0.ffn_up.weight".into(),
        format!("{p}.mlp.up_proj.weight"),
        seq(&[ffn, h], 11.0),
    );
    add(
        "blk.0.ffn_down.weight".into(),
        format!("{p}.mlp.down_proj.weight"),
        seq(&[h, ffn], 12.0),
    );
    if arch == "qwen2" {
        add(
            "blk.0.attn_q.bias".into(),
            format!("{p}.self_attn.q_proj.bias"),
            seq(&[nh * hd], 13.0),
        );
        add(
            "blk.0.attn_k.bias".into(),
            format!("{p}.self_attn.k_proj.bias"),
            seq(&[nkv * hd], 14.0),
        );
        add(
            "blk.0.attn_v.bias".into(),
            format!("{p}.self_attn.v_proj.bias"),
            seq(&[nkv * hd], 15.0),
        );
    }
    if arch == "qwen3" {
        add(
            "blk.0.attn_q_norm.weight".into(),
            format!("{p}.self_attn.q_norm.weight"),
            seq(&[hd], 16.0),
        );
        add(
            "blk.0.attn_k_norm.weight".into(),
            format!("{p}.self_attn.k_norm.weight"),
            seq(&[hd], 17.0),
        );
    }
    let qtensors: Vec<(&str, QTensor)> = hf
        .iter()
        .map(|(g, _, t)| {
            let stored = match (arch, *g) {
                ("llama", "blk.0.attn_q.weight") => llama_cpp_permute(t, nh),
                ("llama", "blk.0.attn_k.weight") => llama_cpp_permute(t, nkv),
                _ => t.clone(),
            };
            (*g, QTensor::quantize(&stored, GgmlDType::F32).unwrap())
        })
        .collect();
    let s = |x: &str| Value::String(x.to_string());
    let md: Vec<(String, Value)> = vec![
        ("general.architecture".into(), s(arch)),
        (format!("{arch}.embedding_length"), Value::U32(h as u32)),
        (format!("{arch}.block_count"), Value::U32(1)),
        (
            format!("{arch}.feed_forward_length"),
            Value::U32(ffn as u32),
        ),
        (
            format!("{arch}.attention.head_count"),
            Value::U32(nh as u32),
        ),
        (
            format!("{arch}.attention.head_count_kv"),
            Value::U32(nkv as u32),
        ),
        (
            format!("{arch}.attention.key_length"),
            Value::U32(hd as u32),
        ),
        (format!("{arch}.rope.freq_base"), Value::F32(100000.0)),
        (
            format!("{arch}.attention.layer_norm_rms_epsilon"),
            Value::F32(1e-5),
        ),
        (format!("{arch}.context_length"), Value::U32(64)),
        ("tokenizer.ggml.model".into(), s("gpt2")),
        ("tokenizer.ggml.pre".into(), s("smollm")),
        (
            "tokenizer.ggml.tokens".into(),
            Value::Array(tokens.iter().map(|t| s(t)).collect()),
        ),
        (
            "tokenizer.ggml.token_type".into(),
            Value::Array(
                (0..vocab)
                    .map(|i| Value::I32(if i < 3 { 3 } else { 1 }))
                    .collect(),
            ),
        ),
        (
            "tokenizer.ggml.merges".into(),
            Value::Array(merges.iter().map(|m| s(m)).collect()),
        ),
        ("tokenizer.ggml.bos_token_id".into(), Value::U32(1)),
        ("tokenizer.ggml.eos_token_id".into(), Value::U32(2)),
        ("tokenizer.ggml.padding_token_id".into(), Value::U32(0)),
        (
            "tokenizer.chat_template".into(),
            s(
                "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}",
            ),
        ),
    ];
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = qtensors.iter().map(|(n, q)| (*n, q)).collect();
    let path = std::env::temp_dir().join(format!(
        "grpo-gguf-synthetic-{arch}-{tied}-{}.gguf",
        std::process::id()
    ));
    let mut f = std::fs::File::create(&path).unwrap();
    gguf_file::write(&mut f, &md_refs, &t_refs).unwrap();
    let originals = hf.into_iter().map(|(_, n, t)| (n, t)).collect();
    Synthetic { path, originals }
}

fn max_abs_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_scalar()
        .unwrap()
}

fn check_synthetic(arch: &str, tied: bool) {
    let syn = write_synthetic(arch, tied);
    let (cfg, weights, tok) = load_gguf(&syn.path, DType::F32, &Device::Cpu).unwrap();
    std::fs::remove_file(&syn.path).ok();
    assert_eq!(cfg.arch, Arch::parse(arch).unwrap());
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim
        ),
        (8, 2, 1, 4)
    );
    assert_eq!(
        (cfg.intermediate_size, cfg.num_hidden_layers, cfg.vocab_size),
        (16, 1, 11)
    );
    assert_eq!(cfg.rope_theta, 100000.0);
    assert_eq!(cfg.rms_norm_eps, 1e-5);
    assert_eq!(cfg.max_position_embeddings, 64);
    assert_eq!(cfg.tie_word_embeddings, tied);
    assert_eq!(cfg.attention_bias, arch == "qwen2");
    assert_eq!(
        (
            cfg.bos_token_id,
            cfg.eos_token_ids.clone(),
            cfg.pad_token_id
        ),
        (Some(1), vec![2], Some(0))
    );

    let mut got: Vec<&String> = weights.keys().collect();
    let mut want: Vec<&String> = syn.originals.keys().collect();
    got.sort();
    want.sort();
    assert_eq!(got, want, "names round-trip");
    for (name, orig) in &syn.originals {
        let w = &weights[name];
        assert_eq!(w.dims(), orig.dims(), "{name}");
        assert_eq!(
            max_abs_diff(w, orig),
            0.0,
            "{arch}: {name} differs from the original"
        );
    }
    // The model builds from the map and runs.
    let model =
        grpo_rollout::Transformer::from_weights(&cfg, &weights, DType::F32, &Device::Cpu).unwrap();
    let ids = Tensor::new(&[[3u32, 4, 6, 7]], &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, 4), DType::U32, &Device::Cpu).unwrap();
    let hidden = model.forward_padded(&ids, &mask).unwrap();
    assert_eq!(hidden.dims(), &[1, 4, 8]);

    // Tokenizer: BPE merges, specials matched whole, digits split one by one.
    assert_eq!(
        tok.encode("ab ab<|im_end|>12", false).unwrap(),
        vec![7, 8, 2, 9, 10]
    );
    assert_eq!(tok.decode(&[7, 8, 2], true).unwrap(), "ab ab");
    assert_eq!(tok.eos_token_ids, vec![2]);
    assert_eq!(tok.pad_token_id, 0);
    assert_eq!(tok.bos_token.as_deref(), Some("<|im_start|>"));
    let chat = tok
        .apply_chat_template(&[ChatMessage::new("user", "ab")], false)
        .unwrap();
    assert_eq!(chat, "<|im_start|>user\nab<|im_end|>\n");
}

#[test]
fn synthetic_llama_unpermutes_q_and_k_and_round_trips_names() {
    check_synthetic("llama", true);
    check_synthetic("llama", false);
}

#[test]
fn synthetic_qwen2_and_qwen3_are_not_permuted() {
    check_synthetic("qwen2", true);
    check_synthetic("qwen3", false);
}

#[test]
fn unpermute_inverts_llama_cpp_permute() {
    let w = seq(&[3 * 8, 5], 0.5);
    let p = llama_cpp_permute(&w, 3);
    assert!(max_abs_diff(&w, &p) > 0.0);
    let back = grpo_rollout::gguf::unpermute_qk(&p, 3).unwrap();
    assert_eq!(max_abs_diff(&w, &back), 0.0);
    let b = seq(&[2 * 6], 0.1);
    let back = grpo_rollout::gguf::unpermute_qk(&llama_cpp_permute(&b, 2), 2).unwrap();
    assert_eq!(max_abs_diff(&b, &back), 0.0);
}

// ---------------------------------------------------------------------------------------------
// SmolLM2-135M-Instruct Q4_1 against transformers (needs the file)
// ---------------------------------------------------------------------------------------------

fn smollm2_path() -> Option<PathBuf> {
    let p = match std::env::var_os("GRPO_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if p.exists() {
        Some(p)
    } else {
        eprintln!(
            "skipping: {} not found (run scripts/fetch-smollm2.sh, or set GRPO_SMOLLM2_GGUF)",
            p.display()
        );
        None
    }
}

fn reference() -> Json {
    let text = include_str!("../fixtures/smollm2_gguf_reference.json");
    serde_json::from_str(text).unwrap()
}

/// The loaded model, shared by the tests of this file (`None` when the file is absent).
fn smollm2() -> Option<&'static LoadedModel> {
    static MODEL: OnceLock<Option<LoadedModel>> = OnceLock::new();
    MODEL
        .get_or_init(|| {
            smollm2_path().map(|p| grpo_rollout::load(&p, DType::F32, &Device::Cpu).unwrap())
        })
        .as_ref()
}

fn ids_of(v: &Json) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

#[test]
fn smollm2_tokenizer_matches_transformers() {
    let Some(m) = smollm2() else { return };
    let r = reference();
    for case in r["encode"].as_array().unwrap() {
        let text = case[0].as_str().unwrap();
        let want = ids_of(&case[1]);
        assert_eq!(
            m.tokenizer.encode(text, true).unwrap(),
            want,
            "encoding {text:?}"
        );
        // Decoding gives the text back (byte-level BPE is lossless).
        assert_eq!(m.tokenizer.decode(&want, false).unwrap(), text);
    }
    let sp = &r["special"];
    assert_eq!(m.tokenizer.bos_token.as_deref(), sp["bos"].as_str());
    assert_eq!(m.tokenizer.eos_token.as_deref(), sp["eos"].as_str());
    assert_eq!(
        m.tokenizer
            .inner
            .id_to_token(m.tokenizer.pad_token_id)
            .as_deref(),
        sp["pad"].as_str()
    );
    assert_eq!(m.tokenizer.eos_token_ids, vec![2]);
    assert_eq!(m.tokenizer.vocab_size(), 49152);
}

#[test]
fn smollm2_weights_match_transformers() {
    let Some(path) = smollm2_path() else { return };
    let (cfg, weights, _) = load_gguf(&path, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(cfg.arch, Arch::Llama);
    assert_eq!(
        (
            cfg.hidden_size,
            cfg.num_hidden_layers,
            cfg.intermediate_size
        ),
        (576, 30, 1536)
    );
    assert_eq!(
        (
            cfg.num_attention_heads,
            cfg.num_key_value_heads,
            cfg.head_dim
        ),
        (9, 3, 64)
    );
    assert_eq!((cfg.vocab_size, cfg.max_position_embeddings), (49152, 8192));
    assert_eq!((cfg.rope_theta, cfg.rms_norm_eps), (100000.0, 1e-5));
    assert!(cfg.tie_word_embeddings && !cfg.attention_bias && !cfg.mlp_bias);
    assert!(!weights.contains_key("lm_head.weight"));
    assert_eq!(weights.len(), 2 + 30 * 9);
    let r = reference();
    let mut worst = 0f32;
    for (key, v) in r["weights"].as_object().unwrap() {
        let name = key.split('@').next().unwrap();
        let (rows, cols) = (ids_of(&v[0]), ids_of(&v[1]));
        let want: Vec<f32> = v[2]
            .as_array()
            .unwrap()
            .iter()
            .flat_map(|x| match x {
                Json::Array(row) => row
                    .iter()
                    .map(|y| y.as_f64().unwrap() as f32)
                    .collect::<Vec<_>>(),
                y => vec![y.as_f64().unwrap() as f32],
            })
            .collect();
        let w = &weights[name];
        let got: Vec<f32> = if w.rank() == 2 {
            w.narrow(0, rows[0] as usize, (rows[1] - rows[0]) as usize)
                .unwrap()
                .narrow(1, cols[0] as usize, (cols[1] - cols[0]) as usize)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        } else {
            w.narrow(0, cols[0] as usize, (cols[1] - cols[0]) as usize)
                .unwrap()
                .to_vec1()
                .unwrap()
        };
        assert_eq!(got.len(), want.len(), "{key}");
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(d <= 1e-5, "{key}: max abs diff {d}");
        worst = worst.max(d);
    }
    eprintln!("weights: max abs diff vs transformers = {worst:e}");
}

#[test]
fn smollm2_chat_template_matches_transformers() {
    let Some(m) = smollm2() else { return };
    let r = reference();
    let msgs = [
        ChatMessage::new("system", "You are a concise assistant."),
        ChatMessage::new("user", "What is 2+2?"),
        ChatMessage::new("assistant", "4"),
        ChatMessage::new("user", "And 3+3?"),
    ];
    assert_eq!(
        m.tokenizer.apply_chat_template(&msgs, true).unwrap(),
        r["chat_system"].as_str().unwrap()
    );
    let q = [ChatMessage::new("user", "What is the capital of France?")];
    assert_eq!(
        m.tokenizer.apply_chat_template(&q, true).unwrap(),
        r["chat_default_system"].as_str().unwrap()
    );
}

fn last_logits(model: &grpo_rollout::Transformer, ids: &[u32]) -> Tensor {
    let dev = Device::Cpu;
    let input = Tensor::new(ids, &dev).unwrap().unsqueeze(0).unwrap();
    let mask = Tensor::ones((1, ids.len()), DType::U32, &dev).unwrap();
    let hidden = model.forward_padded(&input, &mask).unwrap();
    let last = hidden
        .narrow(1, ids.len() - 1, 1)
        .unwrap()
        .reshape((1, model.cfg.hidden_size))
        .unwrap();
    model.logits(&last).unwrap().squeeze(0).unwrap()
}

#[test]
fn smollm2_logits_and_greedy_answer_match_transformers() {
    let Some(m) = smollm2() else { return };
    let r = reference();
    let q = [ChatMessage::new("user", "What is the capital of France?")];
    let prompt = m.tokenizer.apply_chat_template(&q, true).unwrap();
    let mut ids = m.tokenizer.encode(&prompt, true).unwrap();
    assert_eq!(ids, ids_of(&r["logits"]["prompt_ids"]));

    let logits: Vec<f32> = last_logits(&m.model, &ids).to_vec1().unwrap();
    let probe = ids_of(&r["logits"]["ids"]);
    let want: Vec<f32> = r["logits"]["values"]
        .as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_f64().unwrap() as f32)
        .collect();
    let d = probe
        .iter()
        .zip(&want)
        .map(|(&i, &w)| (logits[i as usize] - w).abs())
        .fold(0f32, f32::max);
    eprintln!(
        "last-position logits: max abs diff vs transformers over {} ids = {d:e}",
        probe.len()
    );
    assert!(d < 1e-4, "logits differ from transformers by {d}");
    let argmax = logits
        .iter()
        .enumerate()
        .fold((0, f32::MIN), |b, (i, &x)| if x > b.1 { (i, x) } else { b })
        .0;
    assert_eq!(argmax as u64, r["logits"]["argmax"].as_u64().unwrap());

    // Greedy decoding, a full forward per token (no KV cache needed for this check).
    let start = ids.len();
    for _ in 0..24 {
        let next = last_logits(&m.model, &ids)
            .argmax(0)
            .unwrap()
            .to_scalar::<u32>()
            .unwrap();
        ids.push(next);
        if m.tokenizer.eos_token_ids.contains(&next) {
            break;
        }
    }
    let answer = m.tokenizer.decode(&ids[start..], true).unwrap();
    eprintln!("greedy answer: {answer:?}");
    assert!(answer.contains("Paris"), "{answer}");
    assert_eq!(ids[start..].to_vec(), ids_of(&r["greedy"]["ids"]));
}

#[test]
fn llama3_rope_scaling_is_recovered_from_rope_freqs() {
    // What convert_hf_to_gguf.py writes for Llama 3.2 (theta 5e5, head_dim 64, factor 32,
    // low 1, high 4, original context 8192), computed here independently.
    let (theta, hd, factor, low, high, old) = (500000f64, 64usize, 32f64, 1f64, 4f64, 8192f64);
    let freqs: Vec<f64> = (0..hd / 2)
        .map(|i| 1.0 / theta.powf(2.0 * i as f64 / hd as f64))
        .collect();
    let factors: Vec<f32> = freqs
        .iter()
        .map(|f| {
            let wavelen = 2.0 * std::f64::consts::PI / f;
            if wavelen < old / high {
                1.0
            } else if wavelen > old / low {
                factor as f32
            } else {
                let s = (old / wavelen - low) / (high - low);
                (1.0 / ((1.0 - s) / factor + s)) as f32
            }
        })
        .collect();
    let s = grpo_rollout::gguf::llama3_scaling_from_rope_freqs(&factors, theta, hd).unwrap();
    assert_eq!(s.factor, 32.0);
    assert_eq!(
        (
            s.low_freq_factor,
            s.high_freq_factor,
            s.original_max_position_embeddings
        ),
        (1.0, 4.0, 8192)
    );
    // And the model's frequencies are the file's: freq / factor.
    let cfg = grpo_rollout::ModelConfig {
        arch: Arch::Llama,
        vocab_size: 10,
        hidden_size: 128,
        intermediate_size: 16,
        num_hidden_layers: 1,
        num_attention_heads: 2,
        num_key_value_heads: 2,
        head_dim: hd,
        rms_norm_eps: 1e-5,
        rope_theta: theta,
        rope_scaling: Some(grpo_rollout::config::RopeScaling::Llama3(s)),
        max_position_embeddings: 16,
        tie_word_embeddings: true,
        attention_bias: false,
        mlp_bias: false,
        attention_out_bias: false,
        use_qk_norm: false,
        mla: None,
        gemma4: None,
        linear_attention: None,
        short_conv: None,
        bos_token_id: None,
        eos_token_ids: vec![],
        pad_token_id: None,
        sequence_classification: false,
        token_classification: None,
        initializer_range: None,
        sliding_window: None,
        sliding_layers: vec![],
        nope_layers: vec![],
        activation: Default::default(),
        query_pre_attn_scalar: None,
        local_rope_theta: None,
        partial_rotary_factor: None,
        attn_logit_softcapping: None,
        final_logit_softcapping: None,
        granite: None,
        moe: None,
    };
    let inv = grpo_rollout::model::rope_inv_freq(&cfg);
    for ((got, f), r) in inv.iter().zip(&freqs).zip(&factors) {
        let want = f / *r as f64;
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    }
    // Factors that are not Llama 3's are refused.
    let mut bad = factors.clone();
    bad[0] = 3.0;
    assert!(grpo_rollout::gguf::llama3_scaling_from_rope_freqs(&bad, theta, hd).is_err());
}

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// Log-probs of each reference row's tokens after the first, as the reference lists them.
fn row_logprobs(model: &grpo_rollout::Transformer, rows: &[Vec<u32>]) -> Vec<Vec<f64>> {
    rows.iter()
        .map(|r| {
            let ids = Tensor::new(r.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(0)
                .unwrap();
            let mask = ids.ones_like().unwrap();
            let (lp, _) = model
                .completion_logprobs(&ids, &mask, r.len() - 1, 1.0, false)
                .unwrap();
            lp.to_dtype(DType::F64)
                .unwrap()
                .flatten_all()
                .unwrap()
                .to_vec1()
                .unwrap()
        })
        .collect()
}

fn worst(a: &[Vec<f64>], b: &Json) -> f64 {
    let b: Vec<Vec<f64>> = serde_json::from_value(b.clone()).unwrap();
    a.iter()
        .flatten()
        .zip(b.iter().flatten())
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f64::max)
}

/// llama.cpp's own converter's files of DeepSeek-V3 (`deepseek2`: the latent attention with
/// `attn_k_b` / `attn_v_b`, YaRN, a sigmoid router in 4 groups of which 2 are taken, the
/// offsets, a leading dense layer) and GLM-4.5 (`glm4moe`, with its next-token-prediction layer
/// after the model's) read as the transformers models they were converted from: the config,
/// and the log-probs of two rows against transformers' and llama.cpp's
/// (`scripts/gen_deepseek_gguf_reference.py`, llama.cpp of llama-cpp-python 0.3.36).
#[test]
fn llama_cpp_converted_deepseek_and_glm4moe_read_as_transformers() {
    use grpo_rollout::config::{RopeScaling, Routing};
    for name in ["deepseekv3", "glm4moe"] {
        let text = std::fs::read_to_string(fixtures().join(format!("{name}_gguf_reference.json")))
            .unwrap();
        let r: Json = serde_json::from_str(&text).unwrap();
        let path = fixtures().join(format!("{name}-llama-micro.gguf"));
        let m = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
        let c = &m.model.cfg;
        // Three layers: GLM-4.5's fourth (`nextn_predict_layers`) is not the model's.
        assert_eq!(c.num_hidden_layers, 3, "{name}");
        let moe = c.moe.as_ref().unwrap();
        assert_eq!(moe.mlp_only_layers, vec![0], "{name}");
        assert_eq!(moe.shared_expert_intermediate_size, Some(16), "{name}");
        assert!(moe.norm_topk_prob);
        match name {
            "deepseekv3" => {
                assert_eq!(c.arch, Arch::DeepseekV3);
                let mla = c.mla.unwrap();
                assert_eq!(
                    (mla.q_lora_rank, mla.kv_lora_rank, mla.qk_nope_head_dim),
                    (Some(16), 16, 8)
                );
                assert_eq!(
                    (mla.qk_rope_head_dim, mla.v_head_dim, c.head_dim),
                    (8, 12, 16)
                );
                assert_eq!(
                    moe.routing,
                    Routing::SigmoidGroups {
                        n_group: 4,
                        topk_group: 2,
                        routed_scaling_factor: 2.5
                    }
                );
                let Some(RopeScaling::Yarn(y)) = &c.rope_scaling else {
                    panic!("{:?}", c.rope_scaling)
                };
                assert_eq!(
                    (
                        y.factor,
                        y.original_max_position_embeddings,
                        y.mscale_all_dim
                    ),
                    (4.0, 16, Some(0.707))
                );
            }
            _ => {
                assert_eq!(c.arch, Arch::Glm4Moe);
                assert!(c.use_qk_norm && c.attention_bias);
                assert_eq!((c.rotary_dim(), c.num_key_value_heads), (8, 2));
            }
        }
        let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
        let ours = row_logprobs(&m.model, &rows);
        let (t, l) = (
            worst(&ours, &r["transformers_logprobs"]),
            worst(&ours, &r["llama_cpp_logprobs"]),
        );
        eprintln!("{name}: transformers {t:.2e}, llama.cpp {l:.2e}");
        assert!(t < 2e-5 && l < 5e-5, "{name}: {t} {l}");
        // Far from uniform: a wrong router or RoPE shows.
        assert!(ours.iter().flatten().any(|x| *x < -8.0));
    }
}

/// The DeepSeek-V3 fixture written again with metadata `edit`ed, read back.
fn read_edited(edit: impl FnOnce(&mut HashMap<String, Value>)) -> String {
    let src = fixtures().join("deepseekv3-llama-micro.gguf");
    let mut f = std::fs::File::open(&src).unwrap();
    let c = gguf_file::Content::read(&mut f).unwrap();
    let mut md = c.metadata.clone();
    edit(&mut md);
    let tensors: Vec<(String, QTensor)> = c
        .tensor_infos
        .keys()
        .map(|n| (n.clone(), c.tensor(&mut f, n, &Device::Cpu).unwrap()))
        .collect();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("x.gguf");
    let mut w = std::fs::File::create(&out).unwrap();
    let md_refs: Vec<(&str, &Value)> = md.iter().map(|(k, v)| (k.as_str(), v)).collect();
    let t_refs: Vec<(&str, &QTensor)> = tensors.iter().map(|(k, v)| (k.as_str(), v)).collect();
    gguf_file::write(&mut w, &md_refs, &t_refs).unwrap();
    drop(w);
    match load_gguf(&out, DType::F32, &Device::Cpu) {
        Ok(_) => "loaded".into(),
        Err(e) => e.to_string(),
    }
}

/// A `deepseek2` file llama.cpp computes as no transformers model does is refused by its key:
/// another gating function, YaRN without `yarn_log_multiplier` (llama.cpp then scales the
/// scores by the RoPE factor's square), linear scaling, a softmax router with groups (llama.cpp
/// ranks groups by their best two) or renormalised (DeepSeek-V2 never is).
#[test]
fn deepseek2_files_llama_cpp_computes_otherwise_are_refused() {
    assert_eq!(read_edited(|_| {}), "loaded");
    let e = read_edited(|m| {
        m.insert("deepseek2.expert_gating_func".into(), Value::U32(3));
    });
    assert!(e.contains("deepseek2.expert_gating_func` = 3"), "{e}");
    let e = read_edited(|m| {
        m.remove("deepseek2.rope.scaling.yarn_log_multiplier");
    });
    assert!(e.contains("yarn_log_multiplier` is missing"), "{e}");
    let e = read_edited(|m| {
        m.insert(
            "deepseek2.rope.scaling.type".into(),
            Value::String("linear".into()),
        );
    });
    assert!(e.contains("rope.scaling.type` = linear"), "{e}");
    let e = read_edited(|m| {
        m.insert("deepseek2.expert_gating_func".into(), Value::U32(1));
    });
    assert!(
        e.contains("expert_group_count` = 4 with a softmax router"),
        "{e}"
    );
    let e = read_edited(|m| {
        m.insert("deepseek2.expert_gating_func".into(), Value::U32(1));
        m.remove("deepseek2.expert_group_count");
    });
    assert!(
        e.contains("expert_weights_norm` = true with a softmax"),
        "{e}"
    );
    // Without the key, llama.cpp's fallback: softmax (GLM-4.7-Flash's shape aside).
    let e = read_edited(|m| {
        m.remove("deepseek2.expert_gating_func");
    });
    assert!(e.contains("with a softmax router"), "{e}");
}
