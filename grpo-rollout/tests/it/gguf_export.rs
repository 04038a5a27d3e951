//! `save_gguf`: our models written as llama.cpp GGUF files read back (by our loader) with the
//! same tokenizer, template and log-probs — exactly for f32, within quantisation error
//! otherwise — for llama (Q/K permuted, Llama 3 RoPE scaling as `rope_freqs`), qwen2 (biases)
//! and qwen3 (q/k norms). When a Python with llama.cpp's `gguf` package is found
//! (`GRPO_GGUF_PYTHON`, else `python3`), it checks the file's keys, value types, tensor names,
//! shapes and types against what llama.cpp requires; otherwise that part skips with a message.
//! SmolLM2 (when fetched) round-trips too.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use grpo_rollout::config::{Llama3RopeScaling, ModelConfig, RopeScaling};
use grpo_rollout::gguf::{GgufType, permute_qk, save_gguf, unpermute_qk};
use grpo_rollout::init::{Preset, preset_config, random_weights, train_tokenizer};
use grpo_rollout::{Arch, ChatMessage, Tokenizer, Transformer};

fn tiny(arch: Arch, f: impl FnOnce(&mut ModelConfig)) -> (Transformer, Tokenizer) {
    let tok = train_tokenizer(400).unwrap();
    let mut cfg = preset_config(
        Preset::Tiny,
        arch,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    f(&mut cfg);
    (
        random_weights(&cfg, 9, DType::F32, &Device::Cpu).unwrap(),
        tok,
    )
}

fn logps(m: &Transformer) -> Vec<f32> {
    let rows: Vec<Vec<u32>> = vec![(3..40).collect(), (100..137).rev().collect()];
    let ids: Vec<u32> = rows.concat();
    let t = Tensor::from_vec(ids, (2, 37), &Device::Cpu).unwrap();
    let mask = Tensor::ones((2, 37), DType::U32, &Device::Cpu).unwrap();
    let (lp, _) = m.completion_logprobs(&t, &mask, 30, 1.0, false).unwrap();
    lp.flatten_all().unwrap().to_vec1().unwrap()
}

fn diff(a: &[f32], b: &[f32]) -> (f32, f32) {
    let d: Vec<f32> = a.iter().zip(b).map(|(x, y)| (x - y).abs()).collect();
    (
        d.iter().cloned().fold(0.0, f32::max),
        d.iter().sum::<f32>() / d.len() as f32,
    )
}

fn round_trip(
    m: &Transformer,
    tok: &Tokenizer,
    dir: &Path,
    ty: GgufType,
) -> (grpo_rollout::LoadedModel, Vec<(String, String)>, PathBuf) {
    let path = dir.join(format!("{:?}-{:?}.gguf", m.cfg.arch, ty));
    let written = save_gguf(m, tok, &path, ty, "test").unwrap();
    (
        grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap(),
        written,
        path,
    )
}

fn same_tokenizer(a: &Tokenizer, b: &Tokenizer) {
    for text in [
        "What is 3 + 4? The answer is 7.",
        "  spaces\tand\nlines 12345",
        "<|im_start|>user\nhi<|im_end|>",
        "naïve café",
    ] {
        assert_eq!(
            a.encode(text, true).unwrap(),
            b.encode(text, true).unwrap(),
            "{text:?}"
        );
        assert_eq!(
            a.encode(text, false).unwrap(),
            b.encode(text, false).unwrap(),
            "{text:?}"
        );
    }
    assert_eq!(a.eos_token_ids, b.eos_token_ids);
    let msgs = [ChatMessage::new("user", "Hello")];
    assert_eq!(
        a.apply_chat_template(&msgs, true).unwrap(),
        b.apply_chat_template(&msgs, true).unwrap()
    );
}

#[test]
fn f32_round_trips_exactly_for_every_arch() {
    let tmp = tempfile::tempdir().unwrap();
    let scaling = Llama3RopeScaling {
        factor: 8.0,
        low_freq_factor: 1.0,
        high_freq_factor: 4.0,
        original_max_position_embeddings: 32,
    };
    type Edit = Box<dyn FnOnce(&mut ModelConfig)>;
    let cases: Vec<(Arch, Edit)> = vec![
        (
            Arch::Llama,
            Box::new(move |c: &mut ModelConfig| {
                c.rope_scaling = Some(RopeScaling::Llama3(scaling))
            }),
        ),
        // Linear scaling goes in llama.cpp's `rope.scaling.*` metadata.
        (
            Arch::Qwen2,
            Box::new(|c: &mut ModelConfig| {
                c.rope_scaling = Some(RopeScaling::Linear { factor: 2.5 })
            }),
        ),
        (
            Arch::Llama,
            Box::new(|c: &mut ModelConfig| {
                c.tie_word_embeddings = false;
                c.attention_bias = true;
            }),
        ),
        (Arch::Qwen2, Box::new(|_: &mut ModelConfig| {})),
        (Arch::Qwen3, Box::new(|c: &mut ModelConfig| c.head_dim = 32)),
        // ERNIE 4.5's interleaved q/k rows as transformers (and llama.cpp) hold them.
        (Arch::Ernie45, Box::new(|_: &mut ModelConfig| {})),
    ];
    for (i, (arch, f)) in cases.into_iter().enumerate() {
        let (m, tok) = tiny(arch, f);
        let sub = tmp.path().join(i.to_string());
        let (back, written, path) = round_trip(&m, &tok, &sub, GgufType::F32);
        assert_eq!(back.model.cfg.arch, arch);
        assert_eq!(back.model.cfg.rope_scaling, m.cfg.rope_scaling);
        assert_eq!(
            back.model.cfg.tie_word_embeddings,
            m.cfg.tie_word_embeddings
        );
        assert_eq!(back.model.cfg.head_dim, m.cfg.head_dim);
        assert_eq!(back.model.cfg.attention_bias, m.cfg.attention_bias);
        let (max, _) = diff(&logps(&m), &logps(&back.model));
        assert!(max < 1e-5, "{arch:?}: {max}");
        same_tokenizer(&tok, &back.tokenizer);
        assert!(written.iter().all(|(_, t)| t == "F32"));
        assert_eq!(
            written.iter().any(|(n, _)| n == "output.weight"),
            !m.cfg.tie_word_embeddings
        );
        assert_eq!(
            written.iter().any(|(n, _)| n == "rope_freqs.weight"),
            matches!(m.cfg.rope_scaling, Some(RopeScaling::Llama3(_)))
        );
        llama_cpp_check(&path, &m.cfg);
    }
}

/// The row permutation is llama.cpp's: row `h·hd + 2i + j` of the file is row `h·hd + j·hd/2 + i`.
#[test]
fn permute_is_llama_cpps_and_unpermute_inverts_it() {
    let (n_head, hd, cols) = (3usize, 8usize, 5usize);
    let rows = n_head * hd;
    let t = Tensor::arange(0f32, (rows * cols) as f32, &Device::Cpu)
        .unwrap()
        .reshape((rows, cols))
        .unwrap();
    let p: Vec<Vec<f32>> = permute_qk(&t, n_head).unwrap().to_vec2().unwrap();
    let src: Vec<Vec<f32>> = t.to_vec2().unwrap();
    for h in 0..n_head {
        for i in 0..hd / 2 {
            for j in 0..2 {
                assert_eq!(p[h * hd + 2 * i + j], src[h * hd + j * hd / 2 + i]);
            }
        }
    }
    let back = unpermute_qk(&permute_qk(&t, n_head).unwrap(), n_head).unwrap();
    assert_eq!(back.to_vec2::<f32>().unwrap(), src);
}

#[test]
fn float_and_quantised_types_stay_within_their_error() {
    let tmp = tempfile::tempdir().unwrap();
    // Rows of 256 so that q4_k applies without fallback.
    let (m, tok) = tiny(Arch::Qwen2, |c| {
        c.hidden_size = 256;
        c.intermediate_size = 512;
        c.head_dim = 64;
    });
    let reference = logps(&m);
    let mut errs = Vec::new();
    for (ty, max_tol, mean_tol, matrices) in [
        (GgufType::F16, 2e-3, 5e-4, "F16"),
        (GgufType::BF16, 2e-2, 5e-3, "BF16"),
        (GgufType::Q8_0, 2e-2, 5e-3, "Q8_0"),
        (GgufType::Q4_0, 0.3, 0.08, "Q4_0"),
        (GgufType::Q4K, 0.3, 0.08, "Q4K"),
    ] {
        let (back, written, path) = round_trip(&m, &tok, tmp.path(), ty);
        let (max, mean) = diff(&reference, &logps(&back.model));
        eprintln!("{ty:?}: max {max:.5} mean {mean:.5}");
        assert!(
            max < max_tol && mean < mean_tol,
            "{ty:?}: max {max} mean {mean}"
        );
        for (name, t) in &written {
            let want = if name.ends_with("norm.weight") || name.ends_with(".bias") {
                "F32"
            } else if name == "token_embd.weight" && matches!(ty, GgufType::Q4_0 | GgufType::Q4K) {
                "Q8_0"
            } else {
                matrices
            };
            assert_eq!(t, want, "{ty:?} {name}");
        }
        same_tokenizer(&tok, &back.tokenizer);
        llama_cpp_check(&path, &m.cfg);
        errs.push(mean);
    }
    // More bits, less error.
    assert!(errs[0] < errs[2] && errs[2] < errs[3], "{errs:?}");
}

#[test]
fn rows_that_do_not_fill_blocks_fall_back_as_llama_quantize_does() {
    let tmp = tempfile::tempdir().unwrap();
    let (m, tok) = tiny(Arch::Llama, |_| {}); // rows of 64 and 128: no 256-blocks
    let (back, written, _) = round_trip(&m, &tok, tmp.path(), GgufType::Q4K);
    let t = |n: &str| written.iter().find(|(k, _)| k == n).unwrap().1.clone();
    assert_eq!(t("blk.0.attn_q.weight"), "Q5_0");
    assert_eq!(t("blk.0.ffn_down.weight"), "Q5_0");
    assert_eq!(t("blk.0.attn_norm.weight"), "F32");
    let (max, _) = diff(&logps(&m), &logps(&back.model));
    assert!(max < 0.25, "{max}");
}

#[test]
fn a_tokenizer_llama_cpp_cannot_split_the_same_way_is_refused() {
    let (m, mut tok) = tiny(Arch::Qwen2, |_| {});
    tok.inner
        .with_pre_tokenizer(Some(tokenizers::pre_tokenizers::whitespace::Whitespace {}));
    let tmp = tempfile::tempdir().unwrap();
    let e = save_gguf(&m, &tok, &tmp.path().join("x.gguf"), GgufType::F32, "x").unwrap_err();
    assert!(
        e.to_string()
            .contains("pre-tokenizer has no llama.cpp equivalent"),
        "{e}"
    );
}

#[test]
fn smollm2_round_trips_through_our_gguf() {
    let p =
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../models/SmolLM2-135M-Instruct.Q4_1.gguf");
    let p = std::env::var_os("GRPO_SMOLLM2_GGUF")
        .map(PathBuf::from)
        .unwrap_or(p);
    if !p.exists() {
        eprintln!(
            "skipping: {} not found (run scripts/fetch-smollm2.sh, or set GRPO_SMOLLM2_GGUF)",
            p.display()
        );
        return;
    }
    let orig = grpo_rollout::load(&p, DType::F32, &Device::Cpu).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (back, _, path) = round_trip(&orig.model, &orig.tokenizer, tmp.path(), GgufType::F32);
    let (max, _) = diff(&logps(&orig.model), &logps(&back.model));
    assert!(max < 1e-4, "{max}");
    same_tokenizer(&orig.tokenizer, &back.tokenizer);
    llama_cpp_check(&path, &orig.model.cfg);
    let (q8, _, _) = round_trip(&orig.model, &orig.tokenizer, tmp.path(), GgufType::Q8_0);
    // Natural text: log-probs of a sentence the model knows.
    let text = "The capital of France is Paris. The capital of Germany is Berlin. Water boils at 100 degrees Celsius at sea level.";
    let ids = orig.tokenizer.encode(text, false).unwrap();
    let n = ids.len();
    let lp = |m: &Transformer| -> Vec<f32> {
        let t = Tensor::from_vec(ids.clone(), (1, n), &Device::Cpu).unwrap();
        let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
        let (l, _) = m.completion_logprobs(&t, &mask, n - 1, 1.0, false).unwrap();
        l.flatten_all().unwrap().to_vec1().unwrap()
    };
    let (max, mean) = diff(&lp(&orig.model), &lp(&q8.model));
    eprintln!("SmolLM2 q8_0: max {max} mean {mean}");
    assert!(mean < 0.05, "{mean}");
}

/// Reads the file with llama.cpp's own Python reader (`gguf`) and checks what llama.cpp's loader
/// requires: key value types, tensor names and GGUF-order shapes, f32 norms and biases.
fn llama_cpp_check(path: &Path, cfg: &ModelConfig) {
    let python = std::env::var("GRPO_GGUF_PYTHON").unwrap_or_else(|_| "python3".into());
    let has = std::process::Command::new(&python)
        .args(["-c", "import gguf"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has {
        eprintln!(
            "skipping the llama.cpp reader check: `{python}` has no `gguf` package (pip install gguf, or set GRPO_GGUF_PYTHON)"
        );
        return;
    }
    let script = r#"
import sys, json
from gguf import GGUFReader, GGUFValueType as T
r = GGUFReader(sys.argv[1])
cfg = json.loads(sys.argv[2])
arch = r.fields["general.architecture"].contents()
assert arch == cfg["arch"], arch
def typ(k):
    f = r.fields[k]
    return f.types[0]
for k in ["context_length", "embedding_length", "block_count", "feed_forward_length", "attention.head_count", "attention.head_count_kv"]:
    assert typ(f"{arch}.{k}") == T.UINT32, k
for k in ["attention.layer_norm_rms_epsilon", "rope.freq_base"]:
    assert typ(f"{arch}.{k}") == T.FLOAT32, k
assert r.fields[f"{arch}.embedding_length"].contents() == cfg["hidden"]
assert r.fields["tokenizer.ggml.model"].contents() == "gpt2"
assert r.fields["tokenizer.ggml.pre"].contents() in ("gpt-2", "smollm", "llama-bpe", "qwen2")
tt = r.fields["tokenizer.ggml.token_type"]
assert tt.types == [T.ARRAY, T.INT32], tt.types
assert len(r.fields["tokenizer.ggml.tokens"].contents()) == cfg["vocab"]
assert len(r.fields["tokenizer.ggml.merges"].contents()) > 0
for k in ["tokenizer.ggml.bos_token_id", "tokenizer.ggml.eos_token_id", "tokenizer.ggml.padding_token_id"]:
    assert typ(k) == T.UINT32, k
t = {x.name: x for x in r.tensors}
assert t["token_embd.weight"].shape.tolist() == [cfg["hidden"], cfg["vocab"]]
q = t["blk.0.attn_q.weight"].shape.tolist()
assert q == [cfg["hidden"], cfg["heads"] * cfg["head_dim"]], q
for x in r.tensors:
    if x.name.endswith("norm.weight") or x.name.endswith(".bias") or x.name == "rope_freqs.weight":
        assert x.tensor_type.name == "F32", (x.name, x.tensor_type.name)
n = 2 + 9 * cfg["layers"] + (0 if cfg["tied"] else 1) + (3 * cfg["layers"] if cfg["qkv_bias"] else 0) \
    + (cfg["layers"] if cfg["o_bias"] else 0) + (2 * cfg["layers"] if arch == "qwen3" else 0) + (1 if cfg["rope_freqs"] else 0)
assert len(r.tensors) == n, (len(r.tensors), n)
print("ok")
"#;
    let c = serde_json::json!({
        "arch": cfg.arch.as_str(), "hidden": cfg.hidden_size, "vocab": cfg.vocab_size,
        "heads": cfg.num_attention_heads, "head_dim": cfg.head_dim, "layers": cfg.num_hidden_layers,
        "tied": cfg.tie_word_embeddings, "qkv_bias": cfg.attention_bias,
        "o_bias": cfg.attention_bias && cfg.arch == Arch::Llama,
        "rope_freqs": matches!(cfg.rope_scaling, Some(RopeScaling::Llama3(_))),
    });
    let out = std::process::Command::new(&python)
        .args(["-c", script, path.to_str().unwrap(), &c.to_string()])
        .output()
        .unwrap();
    assert!(
        out.status.success() && String::from_utf8_lossy(&out.stdout).contains("ok"),
        "llama.cpp's reader refused {}:\n{}",
        path.display(),
        String::from_utf8_lossy(&out.stderr)
    );
}

/// Gemma 2, Gemma 3 and OLMo 2 as llama.cpp's `gemma2`, `gemma3`, `olmo2`: the sublayer-output
/// norms as `post_attention_norm` / `post_ffw_norm` (Gemma's MLP-input norm `ffn_norm`), Gemma's
/// `1 + w` norms stored as llama.cpp holds them, its window, soft caps and (Gemma 3) global
/// RoPE scaling in metadata, OLMo 2's tied embeddings written as the `output.weight` llama.cpp
/// requires. Read back: the same config (sliding layers, caps, scales llama.cpp fixes) and
/// log-probs over sequences three times the window.
#[test]
fn gemma_and_olmo2_round_trip_as_llama_cpps_families() {
    let tmp = tempfile::tempdir().unwrap();
    type Edit = Box<dyn FnOnce(&mut ModelConfig)>;
    let cases: Vec<(Arch, Edit)> = vec![
        (
            Arch::Gemma2,
            Box::new(|c: &mut ModelConfig| {
                c.num_hidden_layers = 3;
                c.sliding_window = Some(12);
                c.sliding_layers = vec![0, 2];
                c.query_pre_attn_scalar = Some(c.head_dim as f64);
                c.attn_logit_softcapping = Some(4.0);
                c.final_logit_softcapping = Some(3.0);
            }),
        ),
        (
            Arch::Gemma3,
            Box::new(|c: &mut ModelConfig| {
                c.num_hidden_layers = 7;
                c.sliding_window = Some(12);
                c.sliding_layers = vec![0, 1, 2, 3, 4, 6];
                c.query_pre_attn_scalar = Some(c.head_dim as f64);
                c.rope_theta = 1e6;
                c.rope_scaling = Some(RopeScaling::Linear { factor: 2.0 });
            }),
        ),
        (Arch::Olmo2, Box::new(|_: &mut ModelConfig| {})),
        (
            Arch::Olmo2,
            Box::new(|c: &mut ModelConfig| c.tie_word_embeddings = false),
        ),
    ];
    for (i, (arch, f)) in cases.into_iter().enumerate() {
        let (m, tok) = tiny(arch, f);
        // Norm weights away from their initial 0 / 1, so that Gemma's offset shows.
        let m = m
            .map_tensors(&|t| match t.rank() {
                1 => t.affine(1.0, 0.0)? + t.ones_like()?.cumsum(0)?.affine(0.01, -0.2)?,
                _ => Ok(t.clone()),
            })
            .unwrap();
        let sub = tmp.path().join(i.to_string());
        let (back, written, _) = round_trip(&m, &tok, &sub, GgufType::F32);
        let (a, b) = (&m.cfg, &back.model.cfg);
        assert_eq!(b.arch, arch);
        assert_eq!(
            (b.sliding_window, &b.sliding_layers, b.local_rope_theta),
            (a.sliding_window, &a.sliding_layers, a.local_rope_theta),
            "{arch:?}"
        );
        assert_eq!(
            (b.attn_logit_softcapping, b.final_logit_softcapping),
            (a.attn_logit_softcapping, a.final_logit_softcapping)
        );
        assert_eq!(
            (b.query_pre_attn_scalar, b.activation, &b.rope_scaling),
            (a.query_pre_attn_scalar, a.activation, &a.rope_scaling)
        );
        let (max, _) = diff(&logps(&m), &logps(&back.model));
        assert!(max < 1e-5, "{arch:?}: {max}");
        same_tokenizer(&tok, &back.tokenizer);
        let names: Vec<&str> = written.iter().map(|(n, _)| n.as_str()).collect();
        for n in [
            "blk.0.post_attention_norm.weight",
            "blk.0.post_ffw_norm.weight",
        ] {
            assert!(names.contains(&n), "{arch:?}: {names:?}");
        }
        assert_eq!(
            names.contains(&"blk.0.ffn_norm.weight"),
            arch != Arch::Olmo2
        );
        assert_eq!(
            names.contains(&"blk.0.attn_norm.weight"),
            arch != Arch::Olmo2
        );
        assert_eq!(
            names.contains(&"blk.0.attn_q_norm.weight"),
            arch != Arch::Gemma2
        );
        // llama.cpp's gemma2 has no output matrix, its olmo2 always one.
        assert_eq!(names.contains(&"output.weight"), arch == Arch::Olmo2);
        // The file holds `1 + w` for Gemma's norms.
        let g = |n: &str| -> f32 {
            let mut f = std::fs::File::open(sub.join(format!("{arch:?}-F32.gguf"))).unwrap();
            let c = candle_core::quantized::gguf_file::Content::read(&mut f).unwrap();
            let t = c.tensor(&mut f, n, &Device::Cpu).unwrap();
            t.dequantize(&Device::Cpu)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()[0]
        };
        let w: Vec<f32> = m.layers[0]
            .mlp_out_norm
            .as_ref()
            .unwrap()
            .weight
            .to_vec1()
            .unwrap();
        let offset = if arch == Arch::Olmo2 { 0.0 } else { 1.0 };
        assert!((g("blk.0.post_ffw_norm.weight") - (w[0] + offset)).abs() < 1e-6);
    }
}

/// What llama.cpp computes otherwise is refused by name: Gemma's sliding layers and attention
/// scale are fixed by its architecture and layer count, Gemma 2 always caps and ties, Gemma 3's
/// local RoPE base is 10000 and it caps nothing; OLMo 2 and ERNIE 4.5 with biases.
#[test]
fn gemma_and_olmo2_that_llama_cpp_computes_otherwise_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let refusal = |arch: Arch, f: &dyn Fn(&mut ModelConfig)| -> String {
        let (m, tok) = tiny(arch, |c| {
            c.query_pre_attn_scalar = arch.gemma().then_some(c.head_dim as f64);
            f(c)
        });
        save_gguf(&m, &tok, &tmp.path().join("x.gguf"), GgufType::F32, "x")
            .unwrap_err()
            .to_string()
    };
    for (arch, f, want) in [
        (
            Arch::Gemma3,
            &(|c: &mut ModelConfig| {
                c.num_hidden_layers = 3;
                c.sliding_layers = vec![0, 2];
            }) as &dyn Fn(&mut ModelConfig),
            "sliding-window layers [0, 2] has no GGUF form (llama.cpp's gemma3 slides on layers [0, 1, 2])",
        ),
        (
            Arch::Gemma2,
            &|c: &mut ModelConfig| c.query_pre_attn_scalar = Some(256.0),
            "query_pre_attn_scalar = 256",
        ),
        (
            Arch::Gemma2,
            &|c: &mut ModelConfig| c.tie_word_embeddings = false,
            "tie_word_embeddings = false",
        ),
        (
            Arch::Gemma2,
            &|c: &mut ModelConfig| c.final_logit_softcapping = None,
            "always caps both",
        ),
        (
            Arch::Gemma3,
            &|c: &mut ModelConfig| c.local_rope_theta = Some(20_000.0),
            "rope_local_base_freq = Some(20000.0)",
        ),
        (
            Arch::Gemma3,
            &|c: &mut ModelConfig| c.final_logit_softcapping = Some(30.0),
            "soft cap (30)",
        ),
        (
            Arch::Olmo2,
            &|c: &mut ModelConfig| c.attention_bias = true,
            "olmo2 with attention_bias",
        ),
        (
            Arch::Ernie45,
            &|c: &mut ModelConfig| (c.attention_bias, c.mlp_bias) = (true, true),
            "ERNIE 4.5 with use_bias",
        ),
    ] {
        let e = refusal(arch, f);
        assert!(e.contains(want), "{arch:?}: {e}");
    }
}
