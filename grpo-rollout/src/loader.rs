//! Loading a model (Hugging Face directory or GGUF file) and saving one as a Hugging Face
//! directory that transformers loads.

use std::collections::HashMap;
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Tensor, bail};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::model::{Transformer, WeightMap};
use crate::tokenizer::Tokenizer;

/// A model with its tokenizer, ready to generate or train.
#[derive(Debug, Clone)]
pub struct LoadedModel {
    /// The weights.
    pub model: Transformer,
    /// Tokenizer and chat template; `eos_token_ids` merges config.json,
    /// generation_config.json and the tokenizer's EOS.
    pub tokenizer: Tokenizer,
    /// Where it came from.
    pub source: PathBuf,
}

impl LoadedModel {
    /// TRL's `chat_template_path`: a Jinja file's template; or a model directory's template and
    /// EOS with TRL's `clone_chat_template` — the directory's tokens this vocabulary lacks
    /// added, the embeddings resized to the vocabulary rounded up to a multiple of 64 (new rows
    /// at the mean of the old ones), the rounding filled with `<extra_id_N>` tokens. Returns
    /// the ids of every token added (fillers included: TRL trains them all with LoRA's
    /// `trainable_token_indices`).
    pub fn clone_chat_template(&mut self, path: &Path) -> Result<Vec<u32>> {
        let mut added = self.tokenizer.set_chat_template_from(path)?;
        if path.is_dir() {
            let n = self.tokenizer.vocab_size().div_ceil(64) * 64;
            self.model.resize_token_embeddings(n)?;
            added.extend(self.tokenizer.pad_vocab_to(n));
        }
        Ok(added)
    }

    /// The model, refused when it is a sequence classifier (a reward model has a `score` head,
    /// no LM head: it scores texts, it does not generate or give token log-probs).
    pub fn causal(self) -> Result<Self> {
        if self.model.cfg.token_classification.is_some() {
            bail!(
                "{}: a token classifier (a process reward model, *ForTokenClassification) has no \
                 LM head: it labels the steps of a text, it does not generate",
                self.source.display()
            );
        }
        if self.model.score.is_some() {
            bail!(
                "{}: a sequence classifier (a reward model, *ForSequenceClassification) has no LM \
                 head: it scores texts (a GRPO run's `reward_model_path`), it does not generate",
                self.source.display()
            );
        }
        Ok(self)
    }
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(format!("{}: {e}", path.display()))
}

/// Loads `path`: a Hugging Face directory, or a `.gguf` file.
pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<LoadedModel> {
    if !path.exists() {
        bail!("{}: no such file or directory", path.display());
    }
    if path.is_dir() {
        load_hf_dir(path, dtype, device)
    } else if path.extension().and_then(|e| e.to_str()) == Some("gguf") {
        let (cfg, weights, tokenizer) = crate::gguf::load_gguf(path, dtype, device)?;
        let model = Transformer::from_weights_owned(&cfg, weights, dtype, device)?;
        Ok(LoadedModel {
            model,
            tokenizer,
            source: path.to_path_buf(),
        })
    } else {
        bail!(
            "{}: expected a Hugging Face model directory or a .gguf file",
            path.display()
        )
    }
}

/// The tokenizer (special tokens, chat template) of `path` — a Hugging Face directory, or a
/// `.gguf` file's metadata — without reading any weights.
pub fn load_tokenizer(path: &Path) -> Result<Tokenizer> {
    if path.is_dir() {
        return Tokenizer::from_hf_dir(path, &[]);
    }
    if path.extension().and_then(|e| e.to_str()) != Some("gguf") {
        bail!(
            "{}: expected a Hugging Face model directory or a .gguf file",
            path.display()
        )
    }
    let mut file = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    let content =
        candle_core::quantized::gguf_file::Content::read(&mut file).map_err(|e| io_err(path, e))?;
    crate::gguf::tokenizer_from_metadata(&content.metadata).map_err(|e| io_err(path, e))
}

/// Reads the weights of a Hugging Face directory: `model.safetensors`, or the shards listed
/// in `model.safetensors.index.json`.
pub fn read_safetensors(dir: &Path, device: &Device) -> Result<WeightMap> {
    let single = dir.join("model.safetensors");
    let index = dir.join("model.safetensors.index.json");
    let files: Vec<PathBuf> = if single.exists() {
        vec![single]
    } else if index.exists() {
        let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
        let v: Value = serde_json::from_str(&text)
            .map_err(|e| io_err(&index, format!("invalid JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(Value::as_object)
            .ok_or_else(|| io_err(&index, "field `weight_map` is missing"))?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(String::from))
            .collect();
        files.sort();
        files.dedup();
        files.into_iter().map(|f| dir.join(f)).collect()
    } else {
        bail!(
            "{}: no model.safetensors or model.safetensors.index.json",
            dir.display()
        )
    };
    let mut out = HashMap::new();
    for f in files {
        let part = candle_core::safetensors::load(&f, device).map_err(|e| io_err(&f, e))?;
        out.extend(part);
    }
    Ok(out)
}

/// [`read_safetensors`] in the model's layout ([`crate::layout::from_hf`]: Phi-3's fused maps
/// split, partial-rotary heads reordered).
/// A fine-grained FP8 checkpoint (`quantization_config.quant_method = "fp8"`) is read on the
/// CPU, dequantized into `dtype` ([`crate::layout::dequantize_fp8_weights`]) and moved to `device`.
pub fn read_model_weights(
    dir: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    device: &Device,
) -> Result<WeightMap> {
    let weights = language_model_weights(read_dense(dir, dtype, device)?);
    crate::layout::from_hf(cfg, weights).map_err(|e| io_err(dir, e))
}

/// [`read_safetensors`] on `device`, a fine-grained FP8 checkpoint read on the CPU and
/// dequantized into `dtype` first ([`crate::layout::dequantize_fp8_weights`]).
fn read_dense(dir: &Path, dtype: DType, device: &Device) -> Result<WeightMap> {
    let Some(block) = fp8_block(dir)? else {
        return read_safetensors(dir, device);
    };
    crate::layout::dequantize_fp8_weights(read_safetensors(dir, &Device::Cpu)?, block, dtype)
        .map_err(|e| io_err(dir, e))?
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(device)?)))
        .collect()
}

/// [`read_model_weights`] and, for a vision-language checkpoint, what it holds beside its
/// language model (on the CPU).
fn read_model_and_vision(
    dir: &Path,
    cfg: &ModelConfig,
    dtype: DType,
    device: &Device,
) -> Result<(WeightMap, Option<VisionLanguage>)> {
    let config = read_json(&dir.join("config.json"))?;
    let vl = match &config {
        Some(v) => crate::config::vision_language_text(v)?.is_some(),
        None => false,
    };
    if !vl {
        return Ok((read_model_weights(dir, cfg, dtype, device)?, None));
    }
    // Read on the CPU: the vision tower stays there; the language model moves to `device`.
    let (text, rest) = split_language_model(read_dense(dir, dtype, &Device::Cpu)?);
    // No prefix: the language model under a causal LM's names beside the others (Qwen2-VL's
    // and Qwen2.5-VL's files: `model.layers.*`, `lm_head.weight`, `visual.*`).
    let plain_names = rest.is_none();
    let (text, rest) = match rest {
        Some(r) => (text, Some(r)),
        None => {
            let (text, others): (WeightMap, WeightMap) = text
                .into_iter()
                .partition(|(k, _)| k.starts_with("model.") || k == "lm_head.weight");
            (text, Some((others, false)))
        }
    };
    let text = text
        .into_iter()
        .map(|(k, t)| Ok((k, t.to_device(device)?)))
        .collect::<Result<WeightMap>>()?;
    let text = crate::layout::from_hf(cfg, text).map_err(|e| io_err(dir, e))?;
    let (tensors, saved_names) = rest.unwrap_or_default();
    let mut files = Vec::new();
    for f in PROCESSOR_FILES {
        let p = dir.join(f);
        if p.exists() {
            files.push((
                f.to_string(),
                std::fs::read_to_string(&p).map_err(|e| io_err(&p, e))?,
            ));
        }
    }
    Ok((
        text,
        Some(VisionLanguage {
            config: config.unwrap_or_default(),
            tensors,
            saved_names,
            plain_names,
            files,
        }),
    ))
}

/// `Some(weight_block_size)` when the directory's `config.json` says its weights are
/// fine-grained FP8 (at the top, as vision-language checkpoints say it too).
fn fp8_block(dir: &Path) -> Result<Option<Option<(usize, usize)>>> {
    let Some(v) = read_json(&dir.join("config.json"))? else {
        return Ok(None);
    };
    let q = v.get("quantization_config").or_else(|| {
        v.get("text_config")
            .and_then(|t| t.get("quantization_config"))
    });
    let Some(q) = q.filter(|q| q.get("quant_method").and_then(Value::as_str) == Some("fp8")) else {
        return Ok(None);
    };
    let block = match q.get("weight_block_size") {
        None | Some(Value::Null) => None,
        Some(Value::Array(b)) if b.len() == 2 => match (b[0].as_u64(), b[1].as_u64()) {
            (Some(n), Some(k)) if n > 0 && k > 0 => Some((n as usize, k as usize)),
            _ => bail!(
                "{}: quantization_config.weight_block_size must be two positive integers, not {b:?}",
                dir.join("config.json").display()
            ),
        },
        Some(x) => bail!(
            "{}: quantization_config.weight_block_size must be two positive integers, not {x}",
            dir.join("config.json").display()
        ),
    };
    Ok(Some(block))
}

/// What a vision-language checkpoint holds beside its language model, kept on the CPU with the
/// model so that it is written back whole ([`save_hf_dir`]): its `config.json`, the vision
/// tower's and projector's tensors as read, and whether its files name the language model as
/// transformers saves it (`language_model.model.*`) or as transformers 5 holds it in memory
/// (`model.language_model.*`).
#[derive(Debug)]
pub struct VisionLanguage {
    /// The checkpoint's `config.json`.
    pub config: Value,
    /// The tensors that are not the language model's.
    pub tensors: WeightMap,
    /// `language_model.model.*` / `language_model.lm_head.weight` (else
    /// `model.language_model.*` / `lm_head.weight`).
    pub saved_names: bool,
    /// The language model under a causal LM's names (`model.layers.*`, `lm_head.weight`)
    /// beside the others (Qwen2-VL's and Qwen2.5-VL's `visual.*`).
    pub plain_names: bool,
    /// The image (and video) processor's files, by name, as read ([`PROCESSOR_FILES`]).
    pub files: Vec<(String, String)>,
}

/// The files of a vision-language checkpoint's processor, written back beside it.
pub const PROCESSOR_FILES: [&str; 3] = [
    "preprocessor_config.json",
    "processor_config.json",
    "video_preprocessor_config.json",
];

impl VisionLanguage {
    /// The checkpoint's name of a causal LM's tensor `name`.
    pub fn file_name(&self, name: &str) -> String {
        if self.plain_names {
            return name.to_string();
        }
        match (self.saved_names, name.strip_prefix("model.")) {
            (true, _) => format!("language_model.{name}"),
            (false, Some(rest)) => format!("model.language_model.{rest}"),
            (false, None) => name.to_string(),
        }
    }
}

/// A vision-language checkpoint's language model under a causal LM's names (Gemma 3's and
/// Mistral 3's, as transformers saves them — `language_model.model.*`,
/// `language_model.lm_head.weight` — or as transformers 5 names them in memory —
/// `model.language_model.*`, `lm_head.weight`), the vision tower and projector left out. A
/// causal LM's weights pass unchanged.
pub fn language_model_weights(weights: WeightMap) -> WeightMap {
    split_language_model(weights).0
}

/// [`language_model_weights`], and the others (the vision tower, the projector) with the
/// naming the checkpoint uses (`true`: `language_model.model.*`); `None` for a causal LM's.
fn split_language_model(weights: WeightMap) -> (WeightMap, Option<(WeightMap, bool)>) {
    let saved = weights.keys().any(|k| k.starts_with("language_model."));
    if !saved
        && !weights
            .keys()
            .any(|k| k.starts_with("model.language_model."))
    {
        return (weights, None);
    }
    let (mut text, mut rest) = (WeightMap::new(), WeightMap::new());
    for (k, t) in weights {
        if let Some(r) = k.strip_prefix("language_model.") {
            text.insert(r.to_string(), t);
        } else if let Some(r) = k.strip_prefix("model.language_model.") {
            text.insert(format!("model.{r}"), t);
        } else if k == "lm_head.weight" {
            text.insert(k, t);
        } else {
            rest.insert(k, t);
        }
    }
    (text, Some((rest, saved)))
}

fn read_json(path: &Path) -> Result<Option<Value>> {
    if !path.exists() {
        return Ok(None);
    }
    let text = std::fs::read_to_string(path).map_err(|e| io_err(path, e))?;
    serde_json::from_str(&text)
        .map(Some)
        .map_err(|e| io_err(path, format!("invalid JSON: {e}")))
}

/// Loads a Hugging Face directory (config, weights, tokenizer, generation config).
pub fn load_hf_dir(dir: &Path, dtype: DType, device: &Device) -> Result<LoadedModel> {
    let cfg = ModelConfig::from_hf_file(&dir.join("config.json"))?;
    let (weights, vision) = read_model_and_vision(dir, &cfg, dtype, device)?;
    let mut model = Transformer::from_weights_owned(&cfg, weights, dtype, device)
        .map_err(|e| io_err(dir, e))?;
    model.vision = vision.map(std::sync::Arc::new);
    let mut eos = cfg.eos_token_ids.clone();
    if let Some(g) = read_json(&dir.join("generation_config.json"))? {
        match g.get("eos_token_id") {
            Some(Value::Number(n)) => eos.extend(n.as_u64().map(|x| x as u32)),
            Some(Value::Array(a)) => {
                eos.extend(a.iter().filter_map(|x| x.as_u64().map(|x| x as u32)))
            }
            _ => {}
        }
    }
    let mut tokenizer = Tokenizer::from_hf_dir(dir, &eos)?;
    if let Some(p) = cfg.pad_token_id {
        tokenizer.pad_token_id = p;
    }
    Ok(LoadedModel {
        model,
        tokenizer,
        source: dir.to_path_buf(),
    })
}

/// Writes a Hugging Face directory: `config.json`, `model.safetensors` (in `dtype`; an f32
/// head of a half-precision model stays f32),
/// `generation_config.json`, `tokenizer.json`, `tokenizer_config.json` (with the chat
/// template) and `chat_template.jinja`. LoRA adapters, if any, must be merged first.
pub fn save_hf_dir(
    model: &Transformer,
    tokenizer: &Tokenizer,
    dir: &Path,
    dtype: DType,
) -> Result<()> {
    std::fs::create_dir_all(dir).map_err(|e| io_err(dir, e))?;
    if model.layers.iter().any(|l| l.has_adapters()) {
        bail!(
            "the model has LoRA adapters: merge them (lora::merge) or save the adapter (lora::save_peft)"
        );
    }
    let mut cfg = model.cfg.clone();
    cfg.eos_token_ids = tokenizer.eos_token_ids.clone();
    cfg.pad_token_id = Some(tokenizer.pad_token_id);
    let dtype_name = match dtype {
        DType::BF16 => "bfloat16",
        DType::F16 => "float16",
        _ => "float32",
    };
    let mut cj = cfg.to_hf_json();
    if let Some(o) = cj.as_object_mut() {
        o.insert("torch_dtype".into(), dtype_name.into());
    }
    // A vision-language checkpoint: its own config around the language model's.
    if let Some(vl) = &model.vision {
        cj = vision_language_config(&vl.config, cj, dtype_name);
    }
    let write = |name: &str, v: &Value| -> Result<()> {
        let p = dir.join(name);
        std::fs::write(&p, serde_json::to_string_pretty(v).unwrap_or_default())
            .map_err(|e| io_err(&p, e))
    };
    write("config.json", &cj)?;
    write(
        "generation_config.json",
        &serde_json::json!({
            "eos_token_id": tokenizer.eos_token_ids,
            "pad_token_id": tokenizer.pad_token_id,
            "bos_token_id": cfg.bos_token_id,
        }),
    )?;
    // An f32 head beside half-precision layers (`cast_head_to_f32`) is saved in f32, as
    // transformers saves a model whose lm_head was cast.
    let head = match model.lm_head {
        Some(_) => "lm_head.weight",
        None => "model.embed_tokens.weight",
    };
    let cast_head = model.head().dtype() == DType::F32 && model.dtype() != DType::F32;
    let mut tensors: HashMap<String, Tensor> = crate::layout::to_hf(&model.cfg, model.weights())?
        .into_iter()
        .map(|(k, t)| {
            // DeepSeek's routers and their offsets stay in f32, as transformers saves them.
            let kept = crate::moe::MoeNames::kept_in_f32(model.cfg.arch, &k);
            let dt = if (cast_head && k == head) || (kept && dtype != DType::F64) {
                DType::F32
            } else {
                dtype
            };
            let name = match &model.vision {
                Some(vl) => vl.file_name(&k),
                None => k,
            };
            Ok((name, t.detach().to_dtype(dt)?.to_device(&Device::Cpu)?))
        })
        .collect::<Result<_>>()?;
    // The vision tower and projector as read, their floats in the export's dtype; the
    // processor's files.
    if let Some(vl) = &model.vision {
        for (name, text) in &vl.files {
            let p = dir.join(name);
            std::fs::write(&p, text).map_err(|e| io_err(&p, e))?;
        }
        for (k, t) in &vl.tensors {
            let t = match t.dtype().is_float() {
                true => t.to_dtype(dtype)?,
                false => t.clone(),
            };
            tensors.insert(k.clone(), t);
        }
    }
    let st = dir.join("model.safetensors");
    candle_core::safetensors::save(&tensors, &st).map_err(|e| io_err(&st, e))?;
    save_tokenizer(tokenizer, dir)
}

/// A vision-language checkpoint's `config.json` with its language model's config `text` in
/// `text_config`, the keys transformers reads at the top from it (`tie_word_embeddings`, the
/// token ids) and the export's dtype; FP8 weights were dequantized on load: no
/// `quantization_config`.
fn vision_language_config(config: &Value, mut text: Value, dtype: &str) -> Value {
    let mut out = config.clone();
    let (Some(o), Some(t)) = (out.as_object_mut(), text.as_object_mut()) else {
        return out;
    };
    // Qwen's language models are their own classes, with the multimodal RoPE's sections (read
    // as plain RoPE: [`crate::config::qwen_vl_text`]) written back as read.
    if let Some(kind @ ("qwen2_vl" | "qwen2_5_vl" | "qwen3_vl")) =
        config.get("model_type").and_then(Value::as_str)
    {
        t.insert("model_type".into(), format!("{kind}_text").into());
        let source = config.get("text_config").unwrap_or(config);
        let mrope = ["rope_parameters", "rope_scaling"]
            .iter()
            .find_map(|k| source.get(*k).filter(|r| r.get("mrope_section").is_some()));
        if let (Some(Value::Object(m)), None) = (mrope, t.get("rope_scaling")) {
            let mut r = serde_json::Map::new();
            r.insert("rope_type".into(), "default".into());
            for k in ["mrope_section", "mrope_interleaved", "type"] {
                if let Some(x) = m.get(k) {
                    r.insert(k.into(), x.clone());
                }
            }
            if let Some(theta) = t.remove("rope_theta") {
                r.insert("rope_theta".into(), theta);
            }
            t.insert("rope_parameters".into(), Value::Object(r));
        }
        // A released config's language model fields at the top move into `text_config`.
        if config.get("text_config").is_none() {
            let keep = [
                "architectures",
                "model_type",
                "vision_config",
                "transformers_version",
            ];
            let tokens = |k: &String| k.ends_with("_token_id") || k.ends_with("_token_index");
            o.retain(|k, _| keep.contains(&k.as_str()) || tokens(k));
        }
    }
    for k in [
        "architectures",
        "torch_dtype",
        "dtype",
        "quantization_config",
    ] {
        t.remove(k);
    }
    for k in [
        "tie_word_embeddings",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
    ] {
        if let Some(x) = t.get(k) {
            o.insert(k.into(), x.clone());
        }
    }
    o.remove("quantization_config");
    o.insert("torch_dtype".into(), dtype.into());
    o.insert("dtype".into(), dtype.into());
    o.insert("text_config".into(), text);
    out
}

/// Writes `tokenizer.json`, `tokenizer_config.json` and `chat_template.jinja`.
pub fn save_tokenizer(tokenizer: &Tokenizer, dir: &Path) -> Result<()> {
    let tj = dir.join("tokenizer.json");
    tokenizer
        .inner
        .save(&tj, false)
        .map_err(|e| io_err(&tj, e))?;
    let pad = tokenizer.inner.id_to_token(tokenizer.pad_token_id);
    let mut tc = serde_json::json!({
        "tokenizer_class": "PreTrainedTokenizerFast",
        "model_max_length": 1_000_000,
        "eos_token": tokenizer.eos_token,
        "bos_token": tokenizer.bos_token,
        "pad_token": pad,
        "clean_up_tokenization_spaces": false,
    });
    if let (Some(t), Some(o)) = (&tokenizer.chat_template, tc.as_object_mut()) {
        o.insert("chat_template".into(), t.clone().into());
        let p = dir.join("chat_template.jinja");
        std::fs::write(&p, t).map_err(|e| io_err(&p, e))?;
    }
    let p = dir.join("tokenizer_config.json");
    std::fs::write(&p, serde_json::to_string_pretty(&tc).unwrap_or_default())
        .map_err(|e| io_err(&p, e))
}
