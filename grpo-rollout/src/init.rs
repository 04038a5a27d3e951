//! Random-weight models for tests, demos and benchmarks (`grpo-cli init-model`): a Hugging
//! Face directory with a byte-level BPE tokenizer trained (with the `tokenizers` crate) on text
//! embedded in the binary, and a ChatML chat template. No download involved.

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Result, Tensor};
use rand::SeedableRng;
use rand_chacha::ChaCha8Rng;
use rand_distr::{Distribution, Normal};
use tokenizers::models::bpe::{BPE, BpeTrainerBuilder};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::digits::Digits;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::{AddedToken, TokenizerBuilder};

use crate::config::{Arch, ModelConfig};
use crate::model::Transformer;
use crate::tokenizer::Tokenizer;

/// transformers' ChatML template (as Qwen and SmolLM2 ship it, without a default system turn).
pub const CHATML_TEMPLATE: &str = "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\n' + message['content'] + '<|im_end|>' + '\n' }}{% endfor %}{% if add_generation_prompt %}{{ '<|im_start|>assistant\n' }}{% endif %}";

/// ChatML with tools, on Qwen2.5's conventions: with `tools`, a system turn lists their JSON
/// schemas in `<tools></tools>` and asks for `<tool_call>{"name": ..., "arguments": ...}
/// </tool_call>`; an assistant turn's `tool_calls` are written that way after its text; `tool`
/// messages are a `user` turn of `<tool_response>` blocks (consecutive ones share it).
pub const CHATML_TOOLS_TEMPLATE: &str = concat!(
    "{%- if tools %}",
    "{{- '<|im_start|>system\\n' }}",
    "{%- if messages[0]['role'] == 'system' %}{{- messages[0]['content'] + '\\n\\n' }}{%- endif %}",
    "{{- '# Tools\\n\\nYou may call one or more functions to assist with the user query.\\n\\nYou are provided with function signatures within <tools></tools> XML tags:\\n<tools>' }}",
    "{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}",
    "{{- '\\n</tools>\\n\\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\\n<tool_call>\\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\\n</tool_call><|im_end|>\\n' }}",
    "{%- elif messages[0]['role'] == 'system' %}",
    "{{- '<|im_start|>system\\n' + messages[0]['content'] + '<|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- for message in messages %}",
    "{%- if message.role == 'user' or (message.role == 'assistant' and not message.tool_calls) %}",
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- elif message.role == 'assistant' %}",
    "{{- '<|im_start|>assistant' }}",
    "{%- if message.content %}{{- '\\n' + message.content }}{%- endif %}",
    "{%- for tool_call in message.tool_calls %}",
    "{%- if tool_call.function is defined %}{%- set tool_call = tool_call.function %}{%- endif %}",
    "{{- '\\n<tool_call>\\n{\"name\": \"' + tool_call.name + '\", \"arguments\": ' }}{{- tool_call.arguments | tojson }}{{- '}\\n</tool_call>' }}",
    "{%- endfor %}",
    "{{- '<|im_end|>\\n' }}",
    "{%- elif message.role == 'tool' %}",
    "{%- if loop.index0 == 0 or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}",
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}",
    "{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}",
    "{%- elif message.role != 'system' %}",
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}",
    "{%- endif %}",
    "{%- endfor %}",
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}",
);

/// Special tokens of the generated tokenizers: pad, ChatML start, ChatML end (= EOS).
pub const SPECIAL_TOKENS: [&str; 3] = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"];

/// Model size presets.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Preset {
    /// ~0.1M parameters: unit tests.
    Tiny,
    /// ~2M parameters: demos and end-to-end tests.
    Small,
}

impl std::str::FromStr for Preset {
    type Err = String;
    fn from_str(s: &str) -> std::result::Result<Self, String> {
        match s {
            "tiny" => Ok(Preset::Tiny),
            "small" => Ok(Preset::Small),
            o => Err(format!("unknown preset `{o}`: expected tiny or small")),
        }
    }
}

/// Text the tokenizer is trained on: plain English, arithmetic and chat words.
pub fn training_corpus() -> Vec<String> {
    let prose = [
        "The quick brown fox jumps over the lazy dog.",
        "Group relative policy optimization samples several answers for each question, scores them, and moves the model toward the better ones.",
        "A reward tells the learner how good an answer was; the advantage tells it how much better than its siblings.",
        "What is the capital of France? The capital of France is Paris.",
        "Please answer the question. Think step by step, then give the final answer.",
        "The answer is 42. The result is correct. That is not right, try again.",
        "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu",
        "Write about the sea and the sky. Write a short story about a cat.",
        "She said hello to the world, and the world said hello back.",
        "Numbers: zero one two three four five six seven eight nine ten.",
        "user assistant system: You are a helpful assistant.",
        "<answer>7</answer> <solution>12</solution> \\boxed{3}",
    ];
    let mut out: Vec<String> = prose.iter().map(|s| s.to_string()).collect();
    for a in 0..30u32 {
        for b in (0..30u32).step_by(7) {
            out.push(format!("What is {a} + {b}? The answer is {}.", a + b));
            out.push(format!("Compute {a} * {b} = {}", a * b));
            out.push(format!("{a} - {b} = {}", a as i64 - b as i64));
        }
    }
    out
}

/// Trains a byte-level BPE tokenizer of at most `vocab_size` entries on [`training_corpus`].
pub fn train_tokenizer(vocab_size: usize) -> Result<Tokenizer> {
    train_tokenizer_with(vocab_size, false)
}

/// [`train_tokenizer`], with every digit its own token when `split_digits` (as Llama's and
/// Qwen's tokenizers split numbers): a number is then a few of ten tokens, which a tiny model
/// learns to copy far more easily than BPE's merged digit groups.
pub fn train_tokenizer_with(vocab_size: usize, split_digits: bool) -> Result<Tokenizer> {
    let err = |e: tokenizers::Error| candle_core::Error::msg(format!("tokenizer training: {e}"));
    let specials: Vec<AddedToken> = SPECIAL_TOKENS
        .iter()
        .map(|t| AddedToken::from(*t, true))
        .collect();
    let mut trainer = BpeTrainerBuilder::new()
        .vocab_size(vocab_size)
        .min_frequency(0)
        .show_progress(false)
        .special_tokens(specials)
        .initial_alphabet(ByteLevel::alphabet().into_iter().collect())
        .build();
    let mut tok = TokenizerBuilder::new()
        .with_model(BPE::default())
        .with_normalizer(None::<tokenizers::NormalizerWrapper>)
        .with_pre_tokenizer(Some(pre_tokenizer(split_digits)))
        .with_post_processor(Some(ByteLevel::default().trim_offsets(false)))
        .with_decoder(Some(ByteLevel::default()))
        .build()
        .map_err(err)?;
    tok.train(&mut trainer, training_corpus().into_iter())
        .map_err(err)?;
    let inner: tokenizers::Tokenizer = tok.into();
    let id = |t: &str| inner.token_to_id(t).unwrap_or(0);
    Ok(Tokenizer {
        eos_token_ids: vec![id("<|im_end|>")],
        pad_token_id: id("<|endoftext|>"),
        chat_template_kwargs: serde_json::Map::new(),
        inner,
        chat_template: Some(CHATML_TEMPLATE.to_string()),
        bos_token: None,
        eos_token: Some("<|im_end|>".to_string()),
    })
}

/// Byte-level pre-tokenization, after splitting digits apart when `split_digits`.
fn pre_tokenizer(split_digits: bool) -> PreTokenizerWrapper {
    let bytes = ByteLevel::default().add_prefix_space(false);
    if split_digits {
        PreTokenizerWrapper::Sequence(Sequence::new(vec![
            PreTokenizerWrapper::Digits(Digits::new(true)),
            PreTokenizerWrapper::ByteLevel(bytes),
        ]))
    } else {
        PreTokenizerWrapper::ByteLevel(bytes)
    }
}

/// The config of a preset for `arch` and a vocabulary size.
pub fn preset_config(
    preset: Preset,
    arch: Arch,
    vocab_size: usize,
    eos: u32,
    pad: u32,
) -> ModelConfig {
    let (hidden, layers, heads, kv, inter) = match preset {
        Preset::Tiny => (64, 2, 4, 2, 128),
        Preset::Small => (192, 4, 6, 2, 512),
    };
    ModelConfig {
        arch,
        vocab_size,
        hidden_size: hidden,
        intermediate_size: inter,
        num_hidden_layers: layers,
        num_attention_heads: heads,
        // DeepSeek's latent attention gives every head its key and value.
        num_key_value_heads: if arch.mla() { heads } else { kv },
        head_dim: hidden / heads,
        rms_norm_eps: 1e-6,
        rope_theta: 10_000.0,
        // Ministral 3's YaRN and attention temperature are part of its attention (its
        // transformers class needs them): Ministral3Config's defaults.
        rope_scaling: (arch == Arch::Ministral3).then_some({
            crate::config::RopeScaling::Yarn(crate::config::YarnRopeScaling {
                factor: 16.0,
                original_max_position_embeddings: 16_384,
                beta_fast: 32.0,
                beta_slow: 1.0,
                truncate: true,
                attention_factor: 1.0,
                mscale_all_dim: Some(1.0),
                llama_4_scaling_beta: Some(0.1),
            })
        }),
        max_position_embeddings: 2048,
        // gpt-oss's head is its own.
        tie_word_embeddings: arch != Arch::GptOss,
        attention_bias: matches!(
            arch,
            Arch::Qwen2 | Arch::Qwen2Moe | Arch::GptOss | Arch::SeedOss | Arch::Glm4Moe
        ) || arch.glm(),
        mlp_bias: false,
        attention_out_bias: false,
        use_qk_norm: false,
        bos_token_id: None,
        eos_token_ids: vec![eos],
        pad_token_id: Some(pad),
        sequence_classification: false,
        token_classification: None,
        initializer_range: None,
        // transformers' defaults: Mistral's 4096-position window, SmolLM3's NoPE every 4th layer.
        sliding_window: match arch {
            Arch::Mistral | Arch::Gemma2 | Arch::Gemma3 | Arch::Exaone4 | Arch::Olmo3 => Some(4096),
            // gpt-oss's 128 positions, every other layer.
            Arch::GptOss => Some(128),
            Arch::Gemma4 => Some(512),
            _ => None,
        },
        // Gemma 2's: every other layer from the first; EXAONE 4's: all but every 4th, which
        // rotates nothing (the others: all of them).
        sliding_layers: match arch {
            Arch::Gemma2 | Arch::GptOss if layers > 1 => (0..layers).step_by(2).collect(),
            Arch::Exaone4 | Arch::Olmo3 if layers >= 4 => {
                (0..layers).filter(|i| (i + 1) % 4 != 0).collect()
            }
            // Gemma 4: sliding and full layers alternating (the last one full).
            Arch::Gemma4 => (0..layers).step_by(2).collect(),
            _ => Vec::new(),
        },
        nope_layers: match arch {
            Arch::SmolLM3 | Arch::Exaone4 => crate::config::nope_every(layers, 4),
            _ => Vec::new(),
        },
        // Gemma 3's: GELU-tanh, scores scaled by 256^-1/2, a local RoPE base of 10000 on the
        // sliding layers (every layer but each 6th: here all of them, with a window of 4096).
        activation: match arch {
            Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4 => {
                crate::config::Activation::GeluPytorchTanh
            }
            Arch::Arcee | Arch::NanoChat => crate::config::Activation::Relu2,
            Arch::GptOss => crate::config::Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0,
            },
            _ => crate::config::Activation::Silu,
        },
        query_pre_attn_scalar: match arch {
            a if a.gemma() => Some(256.0),
            Arch::Gemma4 => Some(1.0),
            _ => None,
        },
        local_rope_theta: arch.local_rope().then_some(10_000.0),
        // Phi-4-mini's three quarters of each head rotating, GLM's half.
        partial_rotary_factor: match arch {
            Arch::Phi3 => Some(0.75),
            a if a.glm() || a == Arch::Glm4Moe => Some(0.5),
            // Qwen3.5's quarter.
            a if a.qwen3_5() => Some(0.25),
            _ => None,
        },
        // Gemma 2's soft caps (transformers' defaults).
        attn_logit_softcapping: (arch == Arch::Gemma2).then_some(50.0),
        // nanochat's cap on the logits (transformers' default).
        final_logit_softcapping: match arch {
            Arch::Gemma2 => Some(30.0),
            Arch::NanoChat => Some(15.0),
            _ => None,
        },
        // Four experts, two per token (the tiny Qwen3-MoE: a dense second layer too); Qwen2-MoE's
        // shared expert.
        moe: arch.moe().then(|| crate::config::MoeConfig {
            num_experts: 4,
            num_experts_per_tok: 2,
            // Mixtral's, OLMoE's, Granite MoE's and gpt-oss's experts are `intermediate_size`
            // wide.
            moe_intermediate_size: if arch.experts_mlp_wide() {
                inter
            } else {
                inter / 2
            },
            // Mixtral's and Granite MoE's always; Qwen3-MoE's released models set it (Qwen2-MoE's
            // and OLMoE's do not).
            norm_topk_prob: !matches!(arch, Arch::Qwen2Moe | Arch::Olmoe),
            decoder_sparse_step: 1,
            mlp_only_layers: match (preset, arch) {
                (Preset::Tiny, Arch::Qwen3Moe) => vec![1],
                // GLM-4.5's first layer is dense (`first_k_dense_replace` 1, as GLM-4.5-Air's).
                (_, a) if a.deepseek_moe() => vec![0],
                // LFM2-MoE's dense first layer (`num_dense_layers`).
                (_, Arch::Lfm2Moe) => vec![0],
                _ => Vec::new(),
            },
            // GLM-4.5's and DeepSeek-V3's one shared expert is an expert's width.
            shared_expert_intermediate_size: match arch {
                Arch::Qwen2Moe | Arch::Qwen3_5Moe => Some(inter),
                a if a.deepseek_moe() => Some(inter / 2),
                _ => None,
            },
            router_aux_loss_coef: match arch.deepseek_moe() || arch == Arch::Lfm2Moe {
                true => 0.0,
                false => arch.default_router_aux_loss_coef(),
            },
            // GLM-4.5-Air's routing: one group, unscaled weights; DeepSeek-V3's: groups (two
            // of two experts here, one taken), scaled by 2.5; GLM-4.7-Flash's: 1.8.
            routing: match arch {
                // LFM2-MoE's sigmoid router with its offsets, scaled as LFM2-8B-A1B's.
                Arch::Lfm2Moe => crate::config::Routing::Sigmoid {
                    routed_scaling_factor: 1.0,
                    expert_bias: true,
                },
                Arch::Glm4Moe => crate::config::Routing::SigmoidGroups {
                    n_group: 1,
                    topk_group: 1,
                    routed_scaling_factor: 1.0,
                },
                Arch::DeepseekV3 => crate::config::Routing::SigmoidGroups {
                    n_group: 2,
                    topk_group: 1,
                    routed_scaling_factor: 2.5,
                },
                Arch::Glm4MoeLite => crate::config::Routing::SigmoidGroups {
                    n_group: 1,
                    topk_group: 1,
                    routed_scaling_factor: 1.8,
                },
                // DeepSeek-V2's group-limited greedy routing (two groups, one taken).
                Arch::DeepseekV2 => crate::config::Routing::Greedy {
                    n_group: 2,
                    topk_group: 1,
                    routed_scaling_factor: 1.0,
                    group_limited: true,
                },
                _ => crate::config::Routing::Softmax,
            },
        }),
        // DeepSeek's latent attention: a low-rank q and a latent half the width, each head's
        // query half rotated; DeepSeek's values narrower than its queries, GLM-4.7-Flash's as
        // wide.
        // (DeepSeek-V2-Lite's one `q_proj`.)
        mla: arch.mla().then(|| crate::config::MlaConfig {
            q_lora_rank: (arch != Arch::DeepseekV2).then_some(hidden / 2),
            kv_lora_rank: hidden / 2,
            qk_nope_head_dim: hidden / heads / 2,
            qk_rope_head_dim: hidden / heads / 2,
            v_head_dim: match arch {
                Arch::DeepseekV3 | Arch::DeepseekV2 => hidden / heads / 2,
                _ => hidden / heads,
            },
            rope_interleave: true,
        }),
        // Granite 3's kind of scalars (granite-3.x-2b: 12, 1/64, 0.22, 8), the attention's for
        // this head size.
        // Gemma 4's pieces, each switched on: full layers twice as wide with one key/value
        // head reused as values, the last two layers sharing keys and values (the small
        // preset), per-layer inputs 8 wide, double-wide sharing MLPs.
        gemma4: (arch == Arch::Gemma4).then(|| crate::gemma4::Gemma4Config {
            global_head_dim: 2 * hidden / heads,
            global_kv_heads: 1,
            global_rope_theta: 1_000_000.0,
            global_rope_fraction: 0.25,
            global_rope_factor: 1.0,
            k_eq_v: true,
            kv_shared_layers: if layers >= 4 { 2 } else { 0 },
            per_layer_input: Some((vocab_size, 8)),
            double_wide_mlp: true,
            experts: None,
        }),
        // Qwen3.5's linear attention on three layers of four (the tiny preset: the first of
        // two), two key heads serving four value heads.
        linear_attention: arch.qwen3_5().then(|| crate::delta::DeltaConfig {
            layers: (0..layers)
                .filter(|i| (i + 1) % 4 != 0 && i + 1 != layers)
                .collect(),
            key_heads: 2,
            value_heads: 4,
            key_dim: hidden / heads,
            value_dim: hidden / heads,
            conv_kernel: 4,
        }),
        // LFM2's convolutions: the tiny preset's first layer, the small one's first and third
        // (attention in the others), a kernel of 3, no biases (as LFM2's releases).
        short_conv: arch.lfm2().then(|| crate::shortconv::ShortConvConfig {
            layers: (0..layers.saturating_sub(1))
                .filter(|i| *i != 1 || layers < 4)
                .collect(),
            kernel: 3,
            bias: false,
        }),
        granite: (arch.attention() == Arch::Granite).then(|| crate::config::GraniteScalars {
            embedding_multiplier: 12.0,
            attention_multiplier: 1.0 / (hidden / heads) as f64,
            residual_multiplier: 0.22,
            logits_scaling: 8.0,
        }),
    }
}

/// Random weights with transformers' initialisation (normal, std 0.02; norms 1; biases 0).
/// Norm weights get a small seeded jitter so that tests see every parameter matter.
pub fn random_weights(
    cfg: &ModelConfig,
    seed: u64,
    dtype: DType,
    device: &Device,
) -> Result<Transformer> {
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let normal = Normal::new(0.0f32, 0.02).map_err(|e| candle_core::Error::msg(e.to_string()))?;
    let h = cfg.hidden_size;
    let q = cfg.num_attention_heads * cfg.head_dim;
    // Qwen3.5's gate rows after the query rows.
    let qr = if cfg.arch.qwen3_5() { 2 * q } else { q };
    let kv = cfg.num_key_value_heads * cfg.head_dim;
    let im = cfg.intermediate_size;
    let mut shapes: Vec<(String, Vec<usize>, bool)> = vec![(
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab_size, h],
        false,
    )];
    let olmo = cfg.arch.post_norms_only();
    for i in 0..cfg.num_hidden_layers {
        let p = format!("model.layers.{i}");
        if !olmo {
            shapes.push((format!("{p}.input_layernorm.weight"), vec![h], true));
        }
        if let Some(m) = &cfg.mla {
            // DeepSeek's latent attention; `attention_bias` biases q_a, kv_a and o.
            let a = format!("{p}.self_attn");
            let heads = cfg.num_attention_heads;
            let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
            let mut maps = vec![
                ("kv_a_proj_with_mqa", vec![kv_a, h], true),
                (
                    "kv_b_proj",
                    vec![heads * (m.qk_nope_head_dim + m.v_head_dim), m.kv_lora_rank],
                    false,
                ),
                ("o_proj", vec![h, heads * m.v_head_dim], true),
            ];
            match m.q_lora_rank {
                Some(r) => {
                    maps.push(("q_a_proj", vec![r, h], true));
                    maps.push(("q_b_proj", vec![q, r], false));
                    shapes.push((format!("{a}.q_a_layernorm.weight"), vec![r], true));
                }
                None => maps.push(("q_proj", vec![q, h], false)),
            }
            shapes.push((
                format!("{a}.kv_a_layernorm.weight"),
                vec![m.kv_lora_rank],
                true,
            ));
            for (n, shape, biased) in maps {
                if biased && cfg.attention_bias {
                    shapes.push((format!("{a}.{n}.bias"), vec![shape[0]], false));
                }
                shapes.push((format!("{a}.{n}.weight"), shape, false));
            }
        } else if let Some(d) = cfg.linear_attention.as_ref().filter(|d| d.is_linear(i)) {
            // Qwen3.5's linear attention.
            let l = format!("{p}.linear_attn");
            let (c, vw, nv) = (d.conv_width(), d.values_width(), d.value_heads);
            for (n, o, inp) in [
                ("in_proj_qkv", c, h),
                ("in_proj_z", vw, h),
                ("in_proj_b", nv, h),
                ("in_proj_a", nv, h),
                ("out_proj", h, vw),
            ] {
                shapes.push((format!("{l}.{n}.weight"), vec![o, inp], false));
            }
            shapes.push((
                format!("{l}.conv1d.weight"),
                vec![c, 1, d.conv_kernel],
                false,
            ));
            shapes.push((format!("{l}.A_log"), vec![nv], false));
            shapes.push((format!("{l}.dt_bias"), vec![nv], false));
            shapes.push((format!("{l}.norm.weight"), vec![d.value_dim], false));
        } else if let Some(sc) = cfg.short_conv.as_ref().filter(|c| c.is_conv(i)) {
            // LFM2's short convolution.
            let l = format!("{p}.conv");
            let mut maps = vec![
                (format!("{l}.in_proj.weight"), vec![3 * h, h]),
                (format!("{l}.out_proj.weight"), vec![h, h]),
                (format!("{l}.conv.weight"), vec![h, 1, sc.kernel]),
            ];
            if sc.bias {
                for n in ["in_proj", "out_proj", "conv"] {
                    let rows = if n == "in_proj" { 3 * h } else { h };
                    maps.push((format!("{l}.{n}.bias"), vec![rows]));
                }
            }
            shapes.extend(maps.into_iter().map(|(n, s)| (n, s, false)));
        } else {
            shapes.push((format!("{p}.self_attn.q_proj.weight"), vec![qr, h], false));
            shapes.push((format!("{p}.self_attn.k_proj.weight"), vec![kv, h], false));
            shapes.push((format!("{p}.self_attn.v_proj.weight"), vec![kv, h], false));
            shapes.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q], false));
        }
        if cfg.attention_bias && cfg.mla.is_none() {
            shapes.push((format!("{p}.self_attn.q_proj.bias"), vec![qr], false));
            shapes.push((format!("{p}.self_attn.k_proj.bias"), vec![kv], false));
            shapes.push((format!("{p}.self_attn.v_proj.bias"), vec![kv], false));
        }
        if cfg.o_proj_bias() && cfg.mla.is_none() {
            shapes.push((format!("{p}.self_attn.o_proj.bias"), vec![h], false));
        }
        if cfg.arch.attention_sinks() {
            let heads = cfg.num_attention_heads;
            shapes.push((format!("{p}.self_attn.sinks"), vec![heads], false));
        }
        if cfg.head_qk_norm() && !cfg.recurrent_layer(i) {
            shapes.push((
                format!("{p}.self_attn.q_norm.weight"),
                vec![cfg.head_dim],
                true,
            ));
            shapes.push((
                format!("{p}.self_attn.k_norm.weight"),
                vec![cfg.head_dim],
                true,
            ));
        }
        if cfg.arch == Arch::Olmoe {
            shapes.push((format!("{p}.self_attn.q_norm.weight"), vec![q], true));
            shapes.push((format!("{p}.self_attn.k_norm.weight"), vec![kv], true));
        }
        shapes.push((
            format!("{p}.post_attention_layernorm.weight"),
            vec![h],
            true,
        ));
        if cfg.arch.gemma() {
            for n in ["pre_feedforward_layernorm", "post_feedforward_layernorm"] {
                shapes.push((format!("{p}.{n}.weight"), vec![h], true));
            }
        }
        if cfg.arch == Arch::Glm4 {
            for n in ["post_self_attn_layernorm", "post_mlp_layernorm"] {
                shapes.push((format!("{p}.{n}.weight"), vec![h], true));
            }
        }
        if olmo {
            shapes.push((
                format!("{p}.post_feedforward_layernorm.weight"),
                vec![h],
                true,
            ));
            if cfg.arch.full_qk_norm() {
                shapes.push((format!("{p}.self_attn.q_norm.weight"), vec![q], true));
                shapes.push((format!("{p}.self_attn.k_norm.weight"), vec![kv], true));
            }
        }
        match cfg.moe.as_ref().filter(|m| m.sparse(i)) {
            Some(m) => {
                let names = crate::moe::MoeNames::of(cfg.arch);
                let e = m.num_experts;
                let mi = m.moe_intermediate_size;
                let mut maps = vec![(names.router(i), vec![e, h])];
                for x in 0..e {
                    let [g, u, d] = names.expert(i, x);
                    maps.extend([(g, vec![mi, h]), (u, vec![mi, h]), (d, vec![h, mi])]);
                }
                for (name, shape) in maps {
                    // gpt-oss's router and experts are biased.
                    if cfg.arch.biased_experts() {
                        let b = crate::moe::MoeNames::bias_of(&name);
                        shapes.push((b, vec![shape[0]], false));
                    }
                    shapes.push((name, shape, false));
                }
                // GLM-4.5's router's constant score offsets (LFM2-MoE's `expert_bias`).
                if matches!(
                    m.routing,
                    crate::config::Routing::SigmoidGroups { .. }
                        | crate::config::Routing::Sigmoid {
                            expert_bias: true,
                            ..
                        }
                ) {
                    shapes.push((names.correction_bias(i), vec![e], false));
                }
                if let Some(si) = m.shared_expert_intermediate_size {
                    let [g, u, d] = names.shared(i);
                    shapes.push((g, vec![si, h], false));
                    shapes.push((u, vec![si, h], false));
                    shapes.push((d, vec![h, si], false));
                    if cfg.arch.gated_shared_expert() {
                        shapes.push((names.shared_gate(i), vec![1, h], false));
                    }
                }
            }
            None => {
                // Arcee's and nanochat's MLPs have no gate.
                let gated = cfg.arch.gated_mlp();
                let [up, down] = cfg.arch.mlp_names();
                let maps = [("gate_proj", im, h), (up, im, h), (down, h, im)];
                for (n, o, i) in maps.into_iter().filter(|m| gated || m.0 != "gate_proj") {
                    shapes.push((format!("{p}.mlp.{n}.weight"), vec![o, i], false));
                    if cfg.mlp_bias {
                        shapes.push((format!("{p}.mlp.{n}.bias"), vec![o], false));
                    }
                }
            }
        }
    }
    shapes.push(("model.norm.weight".into(), vec![h], true));
    if cfg.sequence_classification {
        shapes.push(("score.weight".into(), vec![1, h], false));
    } else if let Some(n) = cfg.token_classification {
        shapes.push(("score.weight".into(), vec![n, h], false));
        shapes.push(("score.bias".into(), vec![n], false));
    } else if !cfg.tie_word_embeddings {
        shapes.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], false));
    }
    if cfg.gemma4.is_some() {
        shapes = gemma4_shapes(cfg);
    }
    // nanochat's norms hold no weights.
    if cfg.arch.weightless_norms() {
        shapes.retain(|(name, _, _)| !name.ends_with("norm.weight"));
    }
    // Norms scale by 1 (Gemma's store `1 + w` as `w`: 0).
    let unit = if cfg.unit_offset_norms() { 0.0 } else { 1.0 };
    let mut map = HashMap::new();
    for (name, shape, is_norm) in shapes {
        let n: usize = shape.iter().product();
        // Qwen3.5's gated norm scales by its weight (1) and its `dt_bias` starts at 1, as
        // transformers initialises it.
        let around = match name.ends_with("linear_attn.norm.weight") || name.ends_with("dt_bias") {
            true => Some(1.0),
            false => is_norm.then_some(unit),
        };
        let data: Vec<f32> = (0..n)
            .map(|_| {
                let x = normal.sample(&mut rng);
                match around {
                    Some(u) => u + 5.0 * x,
                    None => x,
                }
            })
            .collect();
        map.insert(name, Tensor::from_vec(data, shape, device)?);
    }
    Transformer::from_weights(cfg, &map, dtype, device)
}

/// Gemma 4's weights: name, shape, whether a norm (or the scalar: around 1).
fn gemma4_shapes(cfg: &ModelConfig) -> Vec<(String, Vec<usize>, bool)> {
    let h = cfg.hidden_size;
    let n = cfg.num_hidden_layers;
    let mut out: Vec<(String, Vec<usize>, bool)> = vec![(
        "model.embed_tokens.weight".into(),
        vec![cfg.vocab_size, h],
        false,
    )];
    let width = cfg.gemma4.as_ref().and_then(|g| g.per_layer_input);
    if let Some((vocab, w)) = width {
        out.push((
            "model.embed_tokens_per_layer.weight".into(),
            vec![vocab, n * w],
            false,
        ));
        out.push((
            "model.per_layer_model_projection.weight".into(),
            vec![n * w, h],
            false,
        ));
        out.push((
            "model.per_layer_projection_norm.weight".into(),
            vec![w],
            true,
        ));
    }
    for i in 0..n {
        let p = format!("model.layers.{i}");
        let (nkv, hd) = cfg.layer_heads(i);
        let (q, kv) = (cfg.num_attention_heads * hd, nkv * hd);
        let im = cfg.layer_intermediate(i);
        let own_kv = cfg.kv_source(i).is_none();
        let own_v = own_kv
            && !cfg
                .gemma4
                .as_ref()
                .is_some_and(|g| g.k_eq_v && !cfg.windowed(i));
        for norm in [
            "input_layernorm",
            "post_attention_layernorm",
            "pre_feedforward_layernorm",
            "post_feedforward_layernorm",
        ] {
            out.push((format!("{p}.{norm}.weight"), vec![h], true));
        }
        let a = format!("{p}.self_attn");
        let mut maps = vec![("q_proj", q, h), ("o_proj", h, q)];
        out.push((format!("{a}.q_norm.weight"), vec![hd], true));
        if own_kv {
            maps.push(("k_proj", kv, h));
            out.push((format!("{a}.k_norm.weight"), vec![hd], true));
        }
        if own_v {
            maps.push(("v_proj", kv, h));
        }
        for (name, o, inp) in maps {
            out.push((format!("{a}.{name}.weight"), vec![o, inp], false));
            if cfg.attention_bias {
                out.push((format!("{a}.{name}.bias"), vec![o], false));
            }
        }
        for (name, o, inp) in [
            ("gate_proj", im, h),
            ("up_proj", im, h),
            ("down_proj", h, im),
        ] {
            out.push((format!("{p}.mlp.{name}.weight"), vec![o, inp], false));
            if cfg.mlp_bias {
                out.push((format!("{p}.mlp.{name}.bias"), vec![o], false));
            }
        }
        if let Some((_, w)) = width {
            out.push((
                format!("{p}.per_layer_input_gate.weight"),
                vec![w, h],
                false,
            ));
            out.push((
                format!("{p}.per_layer_projection.weight"),
                vec![h, w],
                false,
            ));
            out.push((
                format!("{p}.post_per_layer_input_norm.weight"),
                vec![h],
                true,
            ));
        }
        out.push((format!("{p}.layer_scalar"), vec![1], true));
        if let Some(e) = cfg.gemma4.as_ref().and_then(|g| g.experts) {
            let (n, w) = (e.num_experts, e.width);
            out.push((format!("{p}.router.proj.weight"), vec![n, h], false));
            out.push((format!("{p}.router.scale"), vec![h], true));
            out.push((format!("{p}.router.per_expert_scale"), vec![n], true));
            for x in 0..n {
                let [g, u, d] = crate::gemma4::expert_names(i, x);
                out.push((g, vec![w, h], false));
                out.push((u, vec![w, h], false));
                out.push((d, vec![h, w], false));
            }
            for norm in [
                "post_feedforward_layernorm_1",
                "pre_feedforward_layernorm_2",
                "post_feedforward_layernorm_2",
            ] {
                out.push((format!("{p}.{norm}.weight"), vec![h], true));
            }
        }
    }
    out.push(("model.norm.weight".into(), vec![h], true));
    if !cfg.tie_word_embeddings {
        out.push(("lm_head.weight".into(), vec![cfg.vocab_size, h], false));
    }
    out
}

/// Writes a random-weight model directory (`grpo-cli init-model`). Returns its config.
pub fn init_model_dir(out: &Path, preset: Preset, arch: Arch, seed: u64) -> Result<ModelConfig> {
    init_model_dir_with(out, preset, arch, seed, false)
}

/// [`init_model_dir`] with the tokenizer's digits split apart when `split_digits`
/// ([`train_tokenizer_with`]).
pub fn init_model_dir_with(
    out: &Path,
    preset: Preset,
    arch: Arch,
    seed: u64,
    split_digits: bool,
) -> Result<ModelConfig> {
    let vocab = match preset {
        Preset::Tiny => 512,
        Preset::Small => 1024,
    };
    let tokenizer = train_tokenizer_with(vocab, split_digits)?;
    let cfg = preset_config(
        preset,
        arch,
        tokenizer.vocab_size(),
        tokenizer.eos_token_ids[0],
        tokenizer.pad_token_id,
    );
    let model = random_weights(&cfg, seed, DType::F32, &Device::Cpu)?;
    crate::loader::save_hf_dir(&model, &tokenizer, out, DType::F32)?;
    Ok(cfg)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn pieces(tok: &Tokenizer, text: &str) -> Vec<String> {
        let ids = tok.encode(text, false).unwrap();
        ids.iter()
            .map(|&i| tok.inner.id_to_token(i).unwrap_or_default())
            .collect()
    }

    #[test]
    fn split_digits_makes_each_digit_a_token_and_round_trips() {
        let plain = train_tokenizer(400).unwrap();
        let split = train_tokenizer_with(400, true).unwrap();
        let text = "What is 17 * 85? It is 1445.";
        // BPE merges digit groups the corpus holds ("17"); split keeps them apart.
        assert!(
            pieces(&plain, "1785").len() < 4,
            "{:?}",
            pieces(&plain, "1785")
        );
        assert_eq!(pieces(&split, "1785"), ["1", "7", "8", "5"]);
        for tok in [&plain, &split] {
            let ids = tok.encode(text, false).unwrap();
            assert_eq!(tok.decode(&ids, false).unwrap(), text);
            assert!(tok.vocab_size() <= 400);
        }
    }
}
