//! `generate`, `logprobs` and `init-model`: the policy model from the command line.

use std::path::PathBuf;

use anyhow::{Context, Result, bail};
use candle_core::{DType, Device, Tensor};
use clap::Args;
use grpo_rollout::init::Preset;
use grpo_rollout::{Arch, ChatMessage, SamplingParams};

/// Model location and numeric type, shared by the model subcommands.
#[derive(Debug, Args)]
pub struct ModelArgs {
    /// A Hugging Face model directory or a .gguf file.
    #[arg(long)]
    pub model: PathBuf,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    pub dtype: String,
    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    pub device: String,
    /// A PEFT LoRA adapter directory to apply.
    #[arg(long)]
    pub adapter: Option<PathBuf>,
}

/// `grpo-cli generate`.
#[derive(Debug, Args)]
pub struct GenerateArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The prompt text.
    #[arg(long)]
    prompt: String,
    /// Wrap the prompt as a user turn with the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Completions to sample.
    #[arg(short = 'n', long, default_value_t = 1)]
    n: usize,
    /// Maximum new tokens.
    #[arg(long, default_value_t = 128)]
    max_new_tokens: usize,
    /// Sampling temperature (0 = greedy).
    #[arg(long, default_value_t = 1.0)]
    temperature: f64,
    /// Nucleus sampling mass.
    #[arg(long, default_value_t = 1.0)]
    top_p: f64,
    /// Keep the k most likely tokens (0 = off).
    #[arg(long, default_value_t = 0)]
    top_k: usize,
    /// Random seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Constrain each completion to match this regular expression from its first byte to its
    /// last (vLLM's `structured_outputs.regex`; Rust `regex` syntax).
    #[arg(long)]
    regex: Option<String>,
    /// Print JSON lines (text, token ids, log-probs, finish reason).
    #[arg(long)]
    json: bool,
}

/// `grpo-cli logprobs`.
#[derive(Debug, Args)]
pub struct LogprobsArgs {
    #[command(flatten)]
    model: ModelArgs,
    /// The conditioning text.
    #[arg(long)]
    prompt: String,
    /// The text whose tokens are scored.
    #[arg(long)]
    completion: String,
    /// Print `{"tokens": [...], "logprobs": [...]}`.
    #[arg(long)]
    json: bool,
}

/// `grpo-cli chat-template`.
#[derive(Debug, Args)]
pub struct ChatTemplateArgs {
    /// A model (directory or .gguf file): its tokenizer's chat template and special tokens.
    #[arg(
        long,
        conflicts_with = "template",
        required_unless_present = "template"
    )]
    model: Option<PathBuf>,
    /// A Jinja template file instead of a model's.
    #[arg(long)]
    template: Option<PathBuf>,
    /// The conversation: a JSON list of `{role, content, ...}` messages, or `@FILE`.
    #[arg(long)]
    messages: String,
    /// Tool schemas: a JSON list, or `@FILE`.
    #[arg(long)]
    tools: Option<String>,
    /// Extra template variables: a JSON object, or `@FILE` (e.g. `{"enable_thinking": false}`).
    #[arg(long)]
    kwargs: Option<String>,
    /// End with the generation prompt (the assistant's turn opened).
    #[arg(long)]
    add_generation_prompt: bool,
    /// `bos_token` for the template (with `--template`; a model's own otherwise).
    #[arg(long)]
    bos_token: Option<String>,
    /// `eos_token` for the template (with `--template`; a model's own otherwise).
    #[arg(long)]
    eos_token: Option<String>,
    /// Print `{"text": ..., "generation_spans": [[start, end], ...]}` (byte offsets of the
    /// `{% generation %}` blocks' output), and `"ids"` with `--model`.
    #[arg(long)]
    json: bool,
}

/// `grpo-cli init-model`.
#[derive(Debug, Args)]
pub struct InitModelArgs {
    /// Output directory.
    #[arg(long)]
    out: PathBuf,
    /// tiny or small.
    #[arg(long, default_value = "tiny")]
    preset: String,
    /// llama, qwen2, qwen3, qwen3_5_text, mistral, ministral3, smollm3, gemma2, gemma3_text, gemma4_text,
    /// hunyuan_v1_dense, olmo2, olmo3, phi3, granite, ernie4_5, exaone4, glm, glm4, seed_oss, arcee,
    /// nanochat, qwen3_moe, qwen2_moe, mixtral, olmoe, granitemoe, gpt_oss, glm4_moe, deepseek_v3,
    /// glm4_moe_lite, deepseek_v2, qwen3_5_moe_text, lfm2 or lfm2_moe.
    #[arg(long, default_value = "qwen2")]
    arch: String,
    /// Weight seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
}

/// `--device`: `cpu`, `cuda` or `cuda:N`.
pub fn device(s: &str) -> Result<Device> {
    s.parse::<grpo_rollout::DeviceSpec>()
        .and_then(|d| d.device())
        .map_err(|e| anyhow::anyhow!("--device {s}: {e}"))
}

fn load(args: &ModelArgs) -> Result<grpo_rollout::LoadedModel> {
    let dtype = grpo_cli::parse_dtype_arg(&args.dtype)?;
    let mut m = grpo_rollout::load(&args.model, dtype, &device(&args.device)?)
        .and_then(grpo_rollout::LoadedModel::causal)
        .with_context(|| format!("--model {}", args.model.display()))?;
    if let Some(dir) = &args.adapter {
        grpo_rollout::lora::load_peft(&mut m.model, dir)
            .with_context(|| format!("--adapter {}", dir.display()))?;
    }
    Ok(m)
}

pub fn generate(a: GenerateArgs) -> Result<()> {
    if a.n == 0 {
        bail!("-n: must be >= 1 (the number of completions to sample)");
    }
    if a.max_new_tokens == 0 {
        bail!("--max-new-tokens: must be >= 1");
    }
    let m = load(&a.model)?;
    let text = if a.chat {
        m.tokenizer
            .apply_chat_template(&[ChatMessage::new("user", a.prompt.clone())], true)?
    } else {
        a.prompt.clone()
    };
    let ids = m.tokenizer.encode(&text, false)?;
    if ids.is_empty() {
        bail!("--prompt: the prompt encodes to no tokens");
    }
    let params = SamplingParams {
        max_new_tokens: a.max_new_tokens,
        temperature: a.temperature,
        top_p: a.top_p,
        top_k: a.top_k,
        seed: a.seed,
        regex: a.regex.clone(),
        ..Default::default()
    };
    params.validate().map_err(|e| anyhow::anyhow!("{e}"))?;
    let model = m.model.detached();
    let out = grpo_rollout::generate(&model, &m.tokenizer, &[ids], a.n, &params)?;
    for c in out {
        if a.json {
            println!("{}", serde_json::to_string(&c)?);
        } else {
            println!("{}", c.text);
        }
    }
    Ok(())
}

/// A JSON argument, or `@FILE` holding it.
fn json_arg(what: &str, arg: &str) -> Result<serde_json::Value> {
    let text = match arg.strip_prefix('@') {
        Some(path) => std::fs::read_to_string(path)
            .with_context(|| format!("--{what}: cannot read {path}"))?,
        None => arg.to_string(),
    };
    serde_json::from_str(&text).with_context(|| format!("--{what}: not valid JSON"))
}

/// Renders a conversation with a chat template as transformers' `apply_chat_template` does
/// (`{% generation %}` blocks reported as byte spans): to check a template, or a model's.
pub fn chat_template(a: ChatTemplateArgs) -> Result<()> {
    let messages: Vec<ChatMessage> = serde_json::from_value(json_arg("messages", &a.messages)?)
        .context("--messages: a list of {role, content} messages")?;
    let tools: Vec<serde_json::Value> = match &a.tools {
        Some(t) => serde_json::from_value(json_arg("tools", t)?).context("--tools: a JSON list")?,
        None => Vec::new(),
    };
    let kwargs = match &a.kwargs {
        Some(k) => match json_arg("kwargs", k)? {
            serde_json::Value::Object(m) => m,
            _ => bail!("--kwargs: a JSON object"),
        },
        None => serde_json::Map::new(),
    };
    let tokenizer = match &a.model {
        Some(path) => Some(grpo_rollout::loader::load_tokenizer(path)?),
        None => None,
    };
    let source = match (&a.template, &tokenizer) {
        (Some(p), _) => std::fs::read_to_string(p)
            .with_context(|| format!("--template: cannot read {}", p.display()))?,
        (None, Some(t)) => t
            .chat_template
            .clone()
            .with_context(|| "--model: the model has no chat template")?,
        (None, None) => bail!("give --model or --template"),
    };
    let bos = a
        .bos_token
        .clone()
        .or_else(|| tokenizer.as_ref()?.bos_token.clone());
    let eos = a
        .eos_token
        .clone()
        .or_else(|| tokenizer.as_ref()?.eos_token.clone());
    let template =
        grpo_rollout::tokenizer::ChatTemplate::new(&source, bos.as_deref(), eos.as_deref())?
            .with_kwargs(&kwargs);
    let (text, spans) =
        template.render_tracked_with_tools(&messages, &tools, a.add_generation_prompt)?;
    if !a.json {
        print!("{text}");
        return Ok(());
    }
    let mut out = serde_json::json!({
        "text": text,
        "generation_spans": spans.iter().map(|r| [r.start, r.end]).collect::<Vec<_>>(),
    });
    if let Some(t) = &tokenizer {
        out["ids"] = serde_json::json!(t.encode(&text, false)?);
    }
    println!("{out}");
    Ok(())
}

pub fn logprobs(a: LogprobsArgs) -> Result<()> {
    let m = load(&a.model)?;
    let p = m.tokenizer.encode(&a.prompt, false)?;
    let c = m.tokenizer.encode(&a.completion, false)?;
    if p.is_empty() {
        bail!("--prompt: encodes to no tokens (the first completion token needs a context)");
    }
    if c.is_empty() {
        bail!("--completion: encodes to no tokens");
    }
    let mut ids = p.clone();
    ids.extend(&c);
    let dev = m.model.device().clone();
    let n = ids.len();
    let ids_t = Tensor::from_vec(ids, (1, n), &dev)?;
    let mask = Tensor::ones((1, n), DType::U32, &dev)?;
    let (lp, _) = m
        .model
        .detached()
        .completion_logprobs(&ids_t, &mask, c.len(), 1.0, false)?;
    let lp: Vec<f32> = lp.to_dtype(DType::F32)?.flatten_all()?.to_vec1()?;
    let tokens: Vec<String> = c
        .iter()
        .map(|&t| m.tokenizer.inner.id_to_token(t).unwrap_or_default())
        .collect();
    if a.json {
        println!(
            "{}",
            serde_json::json!({"tokens": tokens, "token_ids": c, "logprobs": lp})
        );
    } else {
        for (t, l) in tokens.iter().zip(&lp) {
            println!("{l:>10.4}  {t:?}");
        }
        println!("{:>10.4}  (sum)", lp.iter().sum::<f32>());
    }
    Ok(())
}

pub fn init_model(a: InitModelArgs) -> Result<()> {
    let preset: Preset = a
        .preset
        .parse()
        .map_err(|e: String| anyhow::anyhow!("--preset: {e}"))?;
    let arch = Arch::parse(&a.arch).map_err(|e| anyhow::anyhow!("--arch: {e}"))?;
    let cfg = grpo_rollout::init::init_model_dir(&a.out, preset, arch, a.seed)?;
    println!(
        "wrote {} ({} {}, {} parameters, vocab {})",
        a.out.display(),
        a.preset,
        arch.as_str(),
        cfg.num_parameters(),
        cfg.vocab_size
    );
    Ok(())
}

/// `grpo-cli merge`.
#[derive(Debug, Args)]
pub struct MergeArgs {
    /// A mergekit merge configuration: YAML (`.yml`, `.yaml`) or TOML (`.toml`), with
    /// `merge_method`, `base_model`, `models`, `parameters`, `dtype`, `out_dtype`,
    /// `tokenizer_source`.
    #[arg(long)]
    config: PathBuf,
    /// Where to write the merged model directory.
    #[arg(long)]
    out: PathBuf,
    /// DARE's random drops' seed (overrides the file's `random_seed`).
    #[arg(long)]
    random_seed: Option<u64>,
}

/// `grpo-cli merge`: mergekit's `mergekit-yaml CONFIG OUT`.
pub fn merge(a: MergeArgs) -> Result<()> {
    let mut cfg = grpo_cli::read_merge_config(&a.config)?;
    if a.random_seed.is_some() {
        cfg.random_seed = a.random_seed;
    }
    let n = grpo_rollout::merge::merge_dirs(&cfg, &a.out)
        .map_err(|e| anyhow::anyhow!("{}: {e}", a.config.display()))?;
    println!("merged {n} tensors into {}", a.out.display());
    Ok(())
}

/// `grpo-cli export`.
#[derive(Debug, Args)]
pub struct ExportArgs {
    /// A checkpoint directory (`RUN/checkpoints/step-N`): `model/` (full weights) or `adapter/`
    /// (PEFT LoRA, merged into its base); or a model (HF directory or .gguf file).
    #[arg(long)]
    checkpoint: PathBuf,
    /// `hf`: a Hugging Face model directory of the checkpoint's weights (an adapter merged in);
    /// `merged`: the same, for LoRA checkpoints only; `gguf`: one llama.cpp GGUF file.
    #[arg(long, default_value = "hf")]
    format: String,
    /// Where to write the model directory (a `.gguf` file for `--format gguf`).
    #[arg(long)]
    out: PathBuf,
    /// Weight dtype of the export: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// GGUF only: quantise the matrices, q8_0, q4_0 or q4_k (norms and biases stay f32).
    #[arg(long)]
    quant: Option<String>,
    /// The base model of a LoRA checkpoint (default: `model.path` of the checkpoint's config).
    #[arg(long)]
    base: Option<PathBuf>,
    /// Where the weights are loaded and an adapter merged: `cpu`, `cuda` or `cuda:N`.
    #[arg(long, default_value = "cpu")]
    device: String,
}

/// Writes a checkpoint as a Hugging Face model directory (config, safetensors, tokenizer files).
pub fn export(a: ExportArgs) -> Result<()> {
    let dtype = grpo_cli::parse_dtype_arg(&a.dtype)?;
    let dev = device(&a.device)?;
    let gguf_type = match (a.format.as_str(), &a.quant) {
        ("hf" | "merged", None) => None,
        ("hf" | "merged", Some(_)) => {
            bail!("--quant: only with --format gguf (safetensors exports are f32, bf16 or f16)")
        }
        ("gguf", q) => {
            if a.out.extension().and_then(|e| e.to_str()) != Some("gguf") {
                bail!(
                    "--out {}: a GGUF export is one file ending in .gguf",
                    a.out.display()
                );
            }
            let ty = match q {
                Some(q) => match q.as_str() {
                    "q8_0" | "q4_0" | "q4_k" => q.as_str(),
                    o => bail!("--quant: unknown quantisation `{o}`, expected q8_0, q4_0 or q4_k"),
                },
                None => a.dtype.as_str(),
            };
            Some(grpo_rollout::gguf::GgufType::parse(ty).map_err(|e| anyhow::anyhow!("{e}"))?)
        }
        (o, _) => bail!("--format: unknown format `{o}`, expected hf, merged or gguf"),
    };
    let ck = &a.checkpoint;
    let is_model = ck.join("model.safetensors").is_file()
        || ck.join("model.safetensors.index.json").is_file()
        || ck.extension().and_then(|e| e.to_str()) == Some("gguf");
    let (model, tokenizer) = if is_model {
        if a.format == "merged" {
            bail!(
                "--format merged: {} is a model, not a LoRA checkpoint",
                ck.display()
            );
        }
        let m = grpo_rollout::load(ck, DType::F32, &dev)
            .with_context(|| format!("{}", ck.display()))?;
        (m.model, m.tokenizer)
    } else if ck.join("adapter").is_dir() {
        let base = match &a.base {
            Some(b) => b.clone(),
            None => {
                let cfg_path = ck.join("config.json");
                let text = std::fs::read_to_string(&cfg_path).with_context(|| {
                    format!("{}: cannot read (or pass --base)", cfg_path.display())
                })?;
                let v: serde_json::Value = serde_json::from_str(&text)
                    .with_context(|| format!("{}: invalid JSON", cfg_path.display()))?;
                PathBuf::from(v["model"]["path"].as_str().with_context(|| {
                    format!("{}: no `model.path` (pass --base)", cfg_path.display())
                })?)
            }
        };
        let mut m = grpo_rollout::load(&base, DType::F32, &dev)
            .with_context(|| format!("base model {}", base.display()))?;
        // The run's `model.chat_template_path` (its template, and a model directory's added
        // tokens, which the adapter's trainable tokens may index) applies to the base again.
        let run_cfg: Option<serde_json::Value> = std::fs::read_to_string(ck.join("config.json"))
            .ok()
            .and_then(|t| serde_json::from_str(&t).ok());
        if let Some(p) = run_cfg
            .as_ref()
            .and_then(|v| v["model"]["chat_template_path"].as_str())
        {
            m.clone_chat_template(std::path::Path::new(p))
                .with_context(|| format!("the run's model.chat_template_path {p}"))?;
        }
        grpo_rollout::lora::load_peft(&mut m.model, &ck.join("adapter"))
            .with_context(|| format!("{}", ck.join("adapter").display()))?;
        (grpo_rollout::lora::merge(&m.model)?, m.tokenizer)
    } else if ck.join("model").is_dir() {
        if a.format == "merged" {
            bail!(
                "--format merged: {} holds full weights, no LoRA adapter to merge (use --format hf)",
                ck.display()
            );
        }
        let m = grpo_rollout::load(&ck.join("model"), DType::F32, &dev)
            .with_context(|| format!("{}", ck.join("model").display()))?;
        (m.model, m.tokenizer)
    } else {
        bail!(
            "--checkpoint {}: no `model/` or `adapter/` directory (is it a checkpoint?)",
            ck.display()
        );
    };
    if let Some(ty) = gguf_type {
        let name = ck
            .file_name()
            .map(|n| n.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        let written = grpo_rollout::gguf::save_gguf(&model, &tokenizer, &a.out, ty, &name)
            .with_context(|| format!("--out {}", a.out.display()))?;
        let mut counts: std::collections::BTreeMap<&str, usize> = Default::default();
        for (_, t) in &written {
            *counts.entry(t.as_str()).or_default() += 1;
        }
        let summary: Vec<String> = counts.iter().map(|(t, n)| format!("{n} {t}")).collect();
        println!(
            "wrote {} ({} tensors: {})",
            a.out.display(),
            written.len(),
            summary.join(", ")
        );
        return Ok(());
    }
    grpo_rollout::save_hf_dir(&model, &tokenizer, &a.out, dtype)?;
    println!("wrote {}", a.out.display());
    Ok(())
}

/// `grpo-cli serve`.
#[derive(Debug, Args)]
pub struct ServeArgs {
    /// A Hugging Face model directory or a .gguf file.
    #[arg(long)]
    model: PathBuf,
    /// Weight dtype: f32, bf16 or f16.
    #[arg(long, default_value = "f32")]
    dtype: String,
    /// `cpu`, `cuda` or `cuda:N` (CUDA needs a build with `--features cuda`).
    #[arg(long, default_value = "cpu")]
    device: String,
    /// A PEFT LoRA adapter to serve next to the base, as `NAME=DIR` or `DIR` (named after the
    /// directory); repeatable. More can be loaded at run time (`/v1/load_lora_adapter`).
    #[arg(long)]
    adapter: Vec<String>,
    /// The base model's name in requests and in /v1/models (default: the model's file name).
    #[arg(long)]
    served_model_name: Option<String>,
    /// Address to listen on.
    #[arg(long, default_value = "127.0.0.1")]
    host: String,
    /// Port (0 = any free port).
    #[arg(long, default_value_t = 8000)]
    port: u16,
    /// Requests waiting at most; more are answered 429 with Retry-After.
    #[arg(long, default_value_t = 256)]
    max_queue: usize,
    /// Requests batched into one generation pass at most.
    #[arg(long, default_value_t = 64)]
    max_batch_requests: usize,
    /// Prompt + completion tokens per sequence at most (default: max_position_embeddings).
    #[arg(long)]
    max_model_len: Option<usize>,
}

pub fn serve(a: ServeArgs) -> Result<()> {
    let mut o = grpo_cli::serve::ServeOptions::new(&a.model);
    o.dtype = grpo_cli::parse_dtype_arg(&a.dtype)?;
    o.device = device(&a.device)?;
    if let Some(n) = a.served_model_name {
        o.served_model_name = n;
    }
    for spec in &a.adapter {
        let (name, dir) = match spec.split_once('=') {
            Some((n, d)) if !n.is_empty() => (n.to_string(), PathBuf::from(d)),
            _ => {
                let d = PathBuf::from(spec);
                let n = d
                    .file_name()
                    .map(|x| x.to_string_lossy().into_owned())
                    .with_context(|| format!("--adapter {spec}: cannot name it (use NAME=DIR)"))?;
                (n, d)
            }
        };
        o.adapters.push((name, dir));
    }
    o.addr = format!("{}:{}", a.host, a.port)
        .parse()
        .with_context(|| format!("--host {} --port {}: not an address", a.host, a.port))?;
    o.max_queue = a.max_queue;
    o.max_batch_requests = a.max_batch_requests;
    o.max_model_len = a.max_model_len;
    let name = o.served_model_name.clone();
    let server = grpo_cli::serve::start(o)?;
    println!("serving `{name}` on {}", server.base_url());
    server.wait();
    Ok(())
}
