//! GGUF (llama.cpp) files: weights dequantised to our layout, tokenizer and chat template from
//! the metadata.
//!
//! What is read:
//! - `general.architecture` (`llama`, `qwen2`, `qwen3`) and the `{arch}.*` hyper-parameters
//!   into a [`ModelConfig`]; the vocabulary size comes from `token_embd.weight`, biases and
//!   tied embeddings from which tensors are present (no `output.weight` = tied).
//! - every tensor, dequantised with candle's [`QTensor::dequantize`], renamed from llama.cpp's
//!   names (`blk.0.attn_q.weight`) to transformers' (`model.layers.0.self_attn.q_proj.weight`).
//!   llama.cpp's converter permutes the rows of the `llama` Q and K projections (weights and
//!   biases) for its interleaved RoPE; we undo that so the weights fit the "rotate half" RoPE
//!   of transformers (and of our model). `qwen2` / `qwen3` files are not permuted.
//! - `tokenizer.ggml.*` into a byte-level BPE `tokenizers::Tokenizer` (`tokenizer.ggml.model =
//!   gpt2`), with the pre-tokenizer named by `tokenizer.ggml.pre`, control tokens as special
//!   added tokens, and `tokenizer.chat_template`.
//!
//! [`QTensor::dequantize`]: candle_core::quantized::QTensor::dequantize

use std::collections::{HashMap, HashSet};
use std::fs::File;
use std::io::{Read, Seek};
use std::path::Path;

use candle_core::quantized::gguf_file::{Content, Value};
use candle_core::{DType, Device, Result, Tensor, bail};
use tokenizers::models::bpe::{BPE, Vocab};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::processors::template::TemplateProcessing;
use tokenizers::{AddedToken, PreTokenizerWrapper, SplitDelimiterBehavior};

use crate::config::{Arch, Llama3RopeScaling, ModelConfig};
use crate::model::WeightMap;
use crate::tokenizer::Tokenizer;

fn err(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(msg.to_string())
}

/// Reads a GGUF file: config, transformers-named weights (dequantised, converted to `dtype`, on
/// `device`) and tokenizer.
pub fn load_gguf(
    path: &Path,
    dtype: DType,
    device: &Device,
) -> Result<(ModelConfig, WeightMap, Tokenizer)> {
    let ctx = |e: candle_core::Error| err(format!("{}: {e}", path.display()));
    let mut file = File::open(path).map_err(|e| err(format!("{}: {e}", path.display())))?;
    let content = Content::read(&mut file).map_err(ctx)?;
    let mut cfg = config_from_gguf(&content).map_err(ctx)?;
    if content.tensor_infos.contains_key("rope_freqs.weight") {
        let factors: Vec<f32> = content
            .tensor(&mut file, "rope_freqs.weight", &Device::Cpu)
            .and_then(|q| q.dequantize(&Device::Cpu))
            .and_then(|t| t.flatten_all()?.to_vec1())
            .map_err(ctx)?;
        cfg.rope_scaling = Some(
            llama3_scaling_from_rope_freqs(&factors, cfg.rope_theta, cfg.head_dim).map_err(ctx)?,
        );
    }
    let weights = read_weights(&content, &mut file, &cfg, dtype, device).map_err(ctx)?;
    let tokenizer = tokenizer_from_metadata(&content.metadata).map_err(ctx)?;
    Ok((cfg, weights, tokenizer))
}

/// Any integer-typed metadata value as `u64` (files differ in the width they use).
fn as_u64(v: &Value) -> Option<u64> {
    match v {
        Value::U8(x) => Some(*x as u64),
        Value::U16(x) => Some(*x as u64),
        Value::U32(x) => Some(*x as u64),
        Value::U64(x) => Some(*x),
        Value::I8(x) => u64::try_from(*x).ok(),
        Value::I16(x) => u64::try_from(*x).ok(),
        Value::I32(x) => u64::try_from(*x).ok(),
        Value::I64(x) => u64::try_from(*x).ok(),
        _ => None,
    }
}

/// A float metadata value as `f64`. An `f32` is widened through its shortest decimal form, so
/// `1e-5` stored as f32 reads back as `1e-5`, the value of the original `config.json`.
fn as_f64(v: &Value) -> Option<f64> {
    match v {
        Value::F32(x) => format!("{x}").parse().ok(),
        Value::F64(x) => Some(*x),
        other => as_u64(other).map(|x| x as f64),
    }
}

fn as_str(v: &Value) -> Option<&str> {
    match v {
        Value::String(s) => Some(s.as_str()),
        _ => None,
    }
}

fn as_bool(v: &Value) -> Option<bool> {
    match v {
        Value::Bool(b) => Some(*b),
        _ => None,
    }
}

fn md_u32(md: &HashMap<String, Value>, key: &str) -> Option<u32> {
    md.get(key).and_then(as_u64).map(|x| x as u32)
}

/// Builds the [`ModelConfig`] from a GGUF header (metadata and tensor shapes).
pub fn config_from_gguf(content: &Content) -> Result<ModelConfig> {
    let md = &content.metadata;
    let arch_name = md
        .get("general.architecture")
        .and_then(as_str)
        .ok_or_else(|| err("metadata `general.architecture` is missing"))?;
    let arch = Arch::parse(arch_name).map_err(|_| {
        err(format!(
            "GGUF architecture `{arch_name}` is not supported (supported: llama, qwen2, qwen3)"
        ))
    })?;
    let key = |k: &str| format!("{arch_name}.{k}");
    let req = |k: &str| -> Result<usize> {
        md.get(&key(k))
            .and_then(as_u64)
            .map(|x| x as usize)
            .ok_or_else(|| {
                err(format!(
                    "metadata `{}` is missing or not an integer",
                    key(k)
                ))
            })
    };
    let hidden_size = req("embedding_length")?;
    let num_attention_heads = req("attention.head_count")?;
    let num_key_value_heads = md
        .get(&key("attention.head_count_kv"))
        .and_then(as_u64)
        .map_or(num_attention_heads, |x| x as usize);
    let head_dim = md
        .get(&key("attention.key_length"))
        .and_then(as_u64)
        .map_or(hidden_size / num_attention_heads.max(1), |x| x as usize);
    let embed = content
        .tensor_infos
        .get("token_embd.weight")
        .ok_or_else(|| err("tensor `token_embd.weight` is missing"))?;
    let vocab_size = embed.shape.dims().first().copied().unwrap_or(0);
    if let Some(kind) = md.get(&key("rope.scaling.type")).and_then(as_str)
        && kind != "none"
    {
        bail!(
            "RoPE scaling `{kind}` ({}) is not supported",
            key("rope.scaling.type")
        );
    }
    let has = |name: &str| content.tensor_infos.contains_key(name);
    let cfg = ModelConfig {
        arch,
        vocab_size,
        hidden_size,
        intermediate_size: req("feed_forward_length")?,
        num_hidden_layers: req("block_count")?,
        num_attention_heads,
        num_key_value_heads,
        head_dim,
        rms_norm_eps: md
            .get(&key("attention.layer_norm_rms_epsilon"))
            .and_then(as_f64)
            .unwrap_or(1e-6),
        rope_theta: md
            .get(&key("rope.freq_base"))
            .and_then(as_f64)
            .unwrap_or(10_000.0),
        rope_scaling: None, // `load_gguf` reads it from `rope_freqs.weight`
        max_position_embeddings: md
            .get(&key("context_length"))
            .and_then(as_u64)
            .map_or(4096, |x| x as usize),
        tie_word_embeddings: !has("output.weight"),
        attention_bias: match arch {
            Arch::Qwen2 => true,
            Arch::Llama | Arch::Qwen3 => has("blk.0.attn_q.bias"),
        },
        mlp_bias: has("blk.0.ffn_gate.bias"),
        bos_token_id: md_u32(md, "tokenizer.ggml.bos_token_id"),
        eos_token_ids: md_u32(md, "tokenizer.ggml.eos_token_id")
            .into_iter()
            .collect(),
        pad_token_id: md_u32(md, "tokenizer.ggml.padding_token_id"),
    };
    cfg.validate()?;
    Ok(cfg)
}

/// Llama 3 RoPE scaling recovered from llama.cpp's `rope_freqs.weight`: the factor by which
/// each of the `head_dim / 2` RoPE frequencies is divided (`convert_hf_to_gguf.py` writes
/// `1` for high frequencies, `factor` for low ones and a smooth blend between).
///
/// Every Llama 3.x release uses `low_freq_factor = 1`, `high_freq_factor = 4`; the factor is
/// the largest value and the original context length is solved from a blended frequency
/// (8192 when there is none). The result is checked to reproduce every factor of the file
/// (relative error 1e-3), else this fails rather than guess.
pub fn llama3_scaling_from_rope_freqs(
    factors: &[f32],
    rope_theta: f64,
    head_dim: usize,
) -> Result<Llama3RopeScaling> {
    let half = head_dim / 2;
    if factors.len() != half {
        bail!(
            "rope_freqs.weight has {} values, expected head_dim / 2 = {half}",
            factors.len()
        );
    }
    let factor = factors.iter().copied().fold(1f32, f32::max) as f64;
    let freq = |i: usize| 1.0 / rope_theta.powf(2.0 * i as f64 / head_dim as f64);
    let (low, high) = (1.0, 4.0);
    let mut old = 8192.0;
    if factor > 1.0 {
        let interior = factors
            .iter()
            .enumerate()
            .find(|(_, r)| (**r as f64) > 1.0 + 1e-4 && (**r as f64) < factor * (1.0 - 1e-4));
        if let Some((i, r)) = interior {
            // 1/r = (1 - s)/factor + s with s = (old / wavelen - low) / (high - low).
            let s = (1.0 / *r as f64 - 1.0 / factor) / (1.0 - 1.0 / factor);
            let wavelen = 2.0 * std::f64::consts::PI / freq(i);
            old = ((s * (high - low) + low) * wavelen).round();
        }
    }
    let scaling = Llama3RopeScaling {
        factor,
        low_freq_factor: low,
        high_freq_factor: high,
        original_max_position_embeddings: old as usize,
    };
    let low_wavelen = old / low;
    let high_wavelen = old / high;
    for (i, r) in factors.iter().enumerate() {
        let wavelen = 2.0 * std::f64::consts::PI / freq(i);
        let want = if wavelen < high_wavelen {
            1.0
        } else if wavelen > low_wavelen {
            factor
        } else {
            let s = (old / wavelen - low) / (high - low);
            1.0 / ((1.0 - s) / factor + s)
        };
        if ((*r as f64) - want).abs() > 1e-3 * want {
            bail!(
                "rope_freqs.weight[{i}] = {r} does not fit Llama 3 RoPE scaling ({scaling:?} gives {want}): unsupported RoPE scaling"
            );
        }
    }
    Ok(scaling)
}

/// The transformers name of a llama.cpp tensor name, or `None` if it is not one we know.
pub fn hf_tensor_name(gguf_name: &str) -> Option<String> {
    let fixed = match gguf_name {
        "token_embd.weight" => Some("model.embed_tokens.weight"),
        "output_norm.weight" => Some("model.norm.weight"),
        "output.weight" => Some("lm_head.weight"),
        _ => None,
    };
    if let Some(n) = fixed {
        return Some(n.to_string());
    }
    let rest = gguf_name.strip_prefix("blk.")?;
    let (layer, rest) = rest.split_once('.')?;
    let layer: usize = layer.parse().ok()?;
    let (module, suffix) = rest.rsplit_once('.')?;
    if suffix != "weight" && suffix != "bias" {
        return None;
    }
    let hf = match module {
        "attn_norm" => "input_layernorm",
        "attn_q" => "self_attn.q_proj",
        "attn_k" => "self_attn.k_proj",
        "attn_v" => "self_attn.v_proj",
        "attn_output" => "self_attn.o_proj",
        "attn_q_norm" => "self_attn.q_norm",
        "attn_k_norm" => "self_attn.k_norm",
        "ffn_norm" => "post_attention_layernorm",
        "ffn_gate" => "mlp.gate_proj",
        "ffn_up" => "mlp.up_proj",
        "ffn_down" => "mlp.down_proj",
        _ => return None,
    };
    Some(format!("model.layers.{layer}.{hf}.{suffix}"))
}

/// Undoes llama.cpp's Q/K row permutation (`convert_hf_to_gguf.py`'s `LlamaModel.permute`).
///
/// llama.cpp views the rows of each head as `(2, head_dim / 2)` and stores them transposed,
/// `(head_dim / 2, 2)`, interleaving the two RoPE halves. Here the stored rows are viewed as
/// `(n_head, head_dim / 2, 2)` and swapped back. Works on a weight `(rows, cols)` or a bias
/// `(rows,)`; `n_head` is the number of heads of this projection (the KV heads for K).
pub fn unpermute_qk(t: &Tensor, n_head: usize) -> Result<Tensor> {
    let dims = t.dims().to_vec();
    let rows = dims.first().copied().unwrap_or(0);
    if n_head == 0 || !rows.is_multiple_of(2 * n_head) {
        bail!(
            "cannot un-permute {dims:?} for {n_head} heads: rows must be a multiple of 2 × heads"
        );
    }
    let half = rows / n_head / 2;
    let cols: usize = dims[1..].iter().product();
    t.reshape((n_head, half, 2, cols))?
        .transpose(1, 2)?
        .contiguous()?
        .reshape(dims)
}

fn read_weights<R: Read + Seek>(
    content: &Content,
    reader: &mut R,
    cfg: &ModelConfig,
    dtype: DType,
    device: &Device,
) -> Result<WeightMap> {
    let mut names: Vec<&String> = content.tensor_infos.keys().collect();
    names.sort();
    let mut out = WeightMap::new();
    for name in names {
        if name == "rope_freqs.weight" {
            continue; // read into the config's RoPE scaling
        }
        let hf = hf_tensor_name(name)
            .ok_or_else(|| err(format!("tensor `{name}` has no transformers name")))?;
        let q = content
            .tensor(reader, name, &Device::Cpu)
            .map_err(|e| err(format!("tensor `{name}`: {e}")))?;
        let mut t = q.dequantize(&Device::Cpu)?;
        if cfg.arch == Arch::Llama {
            if hf.contains(".self_attn.q_proj.") {
                t = unpermute_qk(&t, cfg.num_attention_heads)?;
            } else if hf.contains(".self_attn.k_proj.") {
                t = unpermute_qk(&t, cfg.num_key_value_heads)?;
            }
        }
        out.insert(hf, t.to_dtype(dtype)?.to_device(device)?);
    }
    Ok(out)
}

/// GPT-2's reversible map from bytes to printable characters, in which byte-level BPE
/// vocabularies are spelled (`Ġ` is the space).
fn byte_alphabet() -> [char; 256] {
    let mut table = ['\0'; 256];
    let printable =
        |b: u32| (33..=126).contains(&b) || (161..=172).contains(&b) || (174..=255).contains(&b);
    let mut next = 256u32;
    for b in 0..256u32 {
        let c = if printable(b) {
            b
        } else {
            let c = next;
            next += 1;
            c
        };
        table[b as usize] = char::from_u32(c).unwrap_or('\0');
    }
    table
}

const LLAMA3_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const QWEN2_SPLIT: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The pre-tokenizer for llama.cpp's `tokenizer.ggml.pre`, as in the model's own
/// `tokenizer.json` (and llama.cpp's `llama-vocab.cpp`); plus whether to NFC-normalise first.
fn pre_tokenizer(pre: &str) -> Result<(PreTokenizerWrapper, bool)> {
    let byte_level =
        |use_regex: bool| PreTokenizerWrapper::ByteLevel(ByteLevel::new(false, true, use_regex));
    let split = |re: &str| -> Result<PreTokenizerWrapper> {
        let s = Split::new(
            SplitPattern::Regex(re.to_string()),
            SplitDelimiterBehavior::Isolated,
            false,
        )
        .map_err(|e| err(format!("pre-tokenizer regex: {e}")))?;
        Ok(PreTokenizerWrapper::Split(s))
    };
    Ok(match pre {
        "default" | "gpt-2" | "gpt2" => (byte_level(true), false),
        // SmolLM / SmolLM2: digits one by one, then GPT-2's split.
        "smollm" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                PreTokenizerWrapper::Digits(Digits::new(true)),
                byte_level(true),
            ])),
            false,
        ),
        "llama3" | "llama-v3" | "llama-bpe" | "smaug-bpe" | "falcon3" | "dbrx" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(LLAMA3_SPLIT)?,
                byte_level(false),
            ])),
            false,
        ),
        "qwen2" | "deepseek-r1-qwen" => (
            PreTokenizerWrapper::Sequence(Sequence::new(vec![
                split(QWEN2_SPLIT)?,
                byte_level(false),
            ])),
            true,
        ),
        other => bail!(
            "tokenizer.ggml.pre `{other}` is not supported (supported: default, gpt2, smollm, llama-bpe/llama3, qwen2)"
        ),
    })
}

fn string_list<'a>(md: &'a HashMap<String, Value>, key: &str) -> Result<Vec<&'a str>> {
    let v = md
        .get(key)
        .ok_or_else(|| err(format!("metadata `{key}` is missing")))?;
    let Value::Array(items) = v else {
        bail!("metadata `{key}` is not an array")
    };
    items
        .iter()
        .map(|x| as_str(x).ok_or_else(|| err(format!("metadata `{key}` holds a non-string"))))
        .collect()
}

/// Builds the tokenizer (byte-level BPE, special tokens, chat template) from GGUF metadata.
pub fn tokenizer_from_metadata(md: &HashMap<String, Value>) -> Result<Tokenizer> {
    let model = md
        .get("tokenizer.ggml.model")
        .and_then(as_str)
        .unwrap_or("");
    if model != "gpt2" {
        bail!(
            "tokenizer.ggml.model `{model}` is not supported: only byte-level BPE (`gpt2`) vocabularies load from GGUF; use the Hugging Face directory"
        );
    }
    let tokens = string_list(md, "tokenizer.ggml.tokens")?;
    let merges = string_list(md, "tokenizer.ggml.merges")?;
    let token_types: Vec<i64> = match md.get("tokenizer.ggml.token_type") {
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x {
                Value::I32(v) => *v as i64,
                other => as_u64(other).map_or(1, |v| v as i64),
            })
            .collect(),
        _ => Vec::new(),
    };
    let table = byte_alphabet();
    let alphabet: HashSet<char> = table.iter().copied().collect();
    let spelled = |t: &str| t.chars().all(|c| alphabet.contains(&c));
    // A token that is not spelled in the byte alphabet (a literal space, say) is respelled.
    let vocab: Vocab = tokens
        .iter()
        .enumerate()
        .map(|(i, t)| {
            let key = if spelled(t) {
                t.to_string()
            } else {
                t.bytes().map(|b| table[b as usize]).collect()
            };
            (key, i as u32)
        })
        .collect();
    let merges = merges
        .iter()
        .map(|m| {
            m.split_once(' ')
                .map(|(a, b)| (a.to_string(), b.to_string()))
                .ok_or_else(|| {
                    err(format!(
                        "merge `{m}` is not two tokens separated by a space"
                    ))
                })
        })
        .collect::<Result<Vec<_>>>()?;
    let bpe = BPE::builder()
        .vocab_and_merges(vocab, merges)
        .build()
        .map_err(|e| err(format!("BPE: {e}")))?;
    let mut inner = tokenizers::Tokenizer::new(bpe);
    let pre = md
        .get("tokenizer.ggml.pre")
        .and_then(as_str)
        .unwrap_or("default");
    let (pre_tok, nfc) = pre_tokenizer(pre)?;
    inner.with_pre_tokenizer(Some(pre_tok));
    if nfc {
        inner.with_normalizer(Some(tokenizers::normalizers::NFC));
    }
    inner.with_decoder(Some(tokenizers::decoders::byte_level::ByteLevel::default()));

    // Control tokens (type 3) are special; user-defined ones (type 4, like `<think>`) are matched
    // whole but not special. A control token not spelled in the byte alphabet is a llama.cpp
    // mislabel and is left out.
    let mut special = Vec::new();
    let mut user = Vec::new();
    for (t, ty) in tokens.iter().zip(&token_types) {
        match ty {
            3 if spelled(t) => {
                special.push(AddedToken::from(t.to_string(), true).normalized(false))
            }
            4 if spelled(t) => user.push(AddedToken::from(t.to_string(), false).normalized(false)),
            _ => {}
        }
    }
    inner.add_special_tokens(&special);
    inner.add_tokens(&user);

    let token_of = |key: &str| -> Option<(u32, String)> {
        let id = md_u32(md, key)?;
        tokens.get(id as usize).map(|t| (id, t.to_string()))
    };
    let bos = token_of("tokenizer.ggml.bos_token_id");
    let eos = token_of("tokenizer.ggml.eos_token_id");
    let flag = |k: &str| md.get(k).and_then(as_bool).unwrap_or(false);
    let (add_bos, add_eos) = (
        flag("tokenizer.ggml.add_bos_token"),
        flag("tokenizer.ggml.add_eos_token"),
    );
    let with_bos = bos.as_ref().filter(|_| add_bos);
    let with_eos = eos.as_ref().filter(|_| add_eos);
    if with_bos.is_some() || with_eos.is_some() {
        let mut single = Vec::new();
        let mut pair = Vec::new();
        let mut specials = Vec::new();
        if let Some((id, t)) = with_bos {
            single.push(t.clone());
            pair.push(t.clone());
            specials.push((t.clone(), *id));
        }
        single.push("$A".to_string());
        pair.push("$A".to_string());
        if let Some((id, t)) = with_eos {
            single.push(t.clone());
            pair.push(t.clone());
            specials.push((t.clone(), *id));
        }
        if let Some((_, t)) = with_bos {
            pair.push(format!("{t}:1"));
        }
        pair.push("$B:1".to_string());
        if let Some((_, t)) = with_eos {
            pair.push(format!("{t}:1"));
        }
        let post = TemplateProcessing::builder()
            .try_single(single)
            .and_then(|b| b.try_pair(pair))
            .map_err(|e| err(format!("post-processor: {e}")))?
            .special_tokens(specials)
            .build()
            .map_err(|e| err(format!("post-processor: {e}")))?;
        inner.with_post_processor(Some(post));
    }

    let mut eos_token_ids: Vec<u32> = [
        "tokenizer.ggml.eos_token_id",
        "tokenizer.ggml.eot_token_id",
        "tokenizer.ggml.eom_token_id",
    ]
    .iter()
    .filter_map(|k| md_u32(md, k))
    .collect();
    eos_token_ids.sort_unstable();
    eos_token_ids.dedup();
    let pad_token_id = md_u32(md, "tokenizer.ggml.padding_token_id")
        .or_else(|| eos.as_ref().map(|(id, _)| *id))
        .unwrap_or(0);
    Ok(Tokenizer {
        inner,
        chat_template: md
            .get("tokenizer.chat_template")
            .and_then(as_str)
            .map(str::to_string),
        bos_token: bos.map(|(_, t)| t),
        eos_token: eos.map(|(_, t)| t),
        eos_token_ids,
        pad_token_id,
    })
}
