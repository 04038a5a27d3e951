//! Model hyper-parameters, read from a Hugging Face `config.json` (or built from GGUF metadata).

use std::path::Path;

use candle_core::{Result, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// The architectures this crate implements.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Arch {
    /// Llama 2 / 3.x, SmolLM / SmolLM2 (optional attention and MLP biases, llama3 RoPE scaling).
    Llama,
    /// Qwen2 / Qwen2.5: biases on q, k and v.
    Qwen2,
    /// Qwen3: RMSNorm on each head's q and k, explicit head_dim, no biases.
    Qwen3,
    /// Mistral: llama's layers without biases, sliding-window attention (`sliding_window`).
    Mistral,
    /// SmolLM3: llama's layers, every `no_rope_layer_interval`-th without RoPE (NoPE).
    SmolLM3,
    /// Gemma 3 (text, `gemma3_text`): RMSNorms scaled by `1 + w`, each sublayer's output
    /// normalised before its residual add, q/k norms, GELU-tanh MLP, embeddings scaled by
    /// `sqrt(hidden)`, sliding-window layers with a RoPE base of their own.
    #[serde(rename = "gemma3_text")]
    Gemma3,
    /// Gemma 2: Gemma 3's layers without q/k norms, every other layer sliding-window, the
    /// attention scores and the final logits soft-capped (`cap · tanh(x / cap)`).
    Gemma2,
    /// OLMo 2: no pre-norms — each sublayer's output normalised before its residual add — and
    /// RMSNorms over all heads' q and k.
    Olmo2,
    /// IBM Granite 3.x (`granite`): llama's layers with four scalars — the embeddings times
    /// `embedding_multiplier`, the attention scores times `attention_multiplier` (in place of
    /// `head_dim^-1/2`), each sublayer's output times `residual_multiplier` before its residual
    /// add, the logits divided by `logits_scaling`.
    Granite,
    /// Phi-3 / Phi-3.5 / Phi-4 (`phi3`): llama's layers with q, k, v stored as one `qkv_proj`
    /// and gate, up as one `gate_up_proj` (split on load, joined on save: [`crate::layout`]),
    /// partial rotary embeddings (`partial_rotary_factor`, Phi-4-mini), LongRoPE, a window on
    /// every layer when `sliding_window` is set.
    Phi3,
    /// Qwen3-MoE (`qwen3_moe`): Qwen3's attention, a mixture-of-experts MLP ([`MoeConfig`]).
    #[serde(rename = "qwen3_moe")]
    Qwen3Moe,
    /// Qwen2-MoE / Qwen1.5-MoE (`qwen2_moe`): Qwen2's attention (q/k/v biases), experts plus a
    /// shared expert behind a sigmoid gate.
    #[serde(rename = "qwen2_moe")]
    Qwen2Moe,
    /// Mixtral (`mixtral`): Mistral's attention, a mixture of experts (`block_sparse_moe`, the
    /// experts' `w1`/`w3`/`w2` = gate/up/down) whose top-k weights always sum to 1.
    Mixtral,
    /// OLMoE (`olmoe`): llama's layers with RMSNorms over all heads' q and k (OLMo 2's, before
    /// the heads are split, but with the pre-norms), experts `intermediate_size` wide.
    Olmoe,
    /// IBM Granite MoE (`granitemoe`, granite-3.x-1b-a400m / 3b-a800m): Granite's layers and
    /// multipliers, a mixture of experts `intermediate_size` wide whose chosen logits are
    /// softmaxed (the renormalised probabilities), stored fused per layer: `input_linear`
    /// `(experts, 2 · width, hidden)` (gate rows, then up), `output_linear`, `router.layer`.
    #[serde(rename = "granitemoe")]
    GraniteMoe,
    /// Baidu ERNIE 4.5 (`ernie4_5`, ERNIE-4.5-0.3B): llama's layers whose RoPE rotates
    /// adjacent pairs of each head's dimensions (`(2i, 2i + 1)`: the model reorders q and k to
    /// its rotate-half layout, [`crate::layout`]), `use_bias` on every projection.
    #[serde(rename = "ernie4_5")]
    Ernie45,
    /// LG EXAONE 4.0 (`exaone4`, EXAONE-4.0-1.2B / 32B): OLMo 2's layers (no pre-norms, each
    /// sublayer's output normalised) with Qwen3's per-head q/k norms; with a `sliding_window`,
    /// the sliding layers (`layer_types`, else `sliding_window_pattern`) rotate and the global
    /// ones do not (NoPE).
    Exaone4,
    /// OpenAI gpt-oss (`gpt_oss`, gpt-oss-20b / 120b): biased attention projections with a
    /// learned sink per head (an extra logit in each softmax's denominator), sliding-window and
    /// global layers alternating, YaRN RoPE, a mixture of experts with a biased router and
    /// biased experts whose gate/up is a clamped SwiGLU ([`Activation::ClampedSwiglu`]). Its
    /// experts are stored fused and transposed, `gate_up_proj` `(experts, hidden, 2 · width)`
    /// with gate and up columns interleaved, or MXFP4-quantized (`*_blocks`, `*_scales`),
    /// dequantized on load ([`crate::layout`]).
    #[serde(rename = "gpt_oss")]
    GptOss,
    /// Zhipu GLM-4 (`glm`, glm-4-9b-chat-hf, glm-edge): q/k/v biased (`attention_bias`), gate
    /// and up stored as one `gate_up_proj` (split on load, joined on save: [`crate::layout`]),
    /// RoPE on adjacent pairs of the first half of each head (`partial_rotary_factor` 0.5).
    Glm,
    /// Zhipu GLM-4-0414 (`glm4`, GLM-4-9B-0414, GLM-4-32B-0414, GLM-Z1): GLM's layers with each
    /// sublayer's output normalised before its residual add (`post_self_attn_layernorm`,
    /// `post_mlp_layernorm`) beside the pre-norms.
    Glm4,
    /// AllenAI OLMo 3 (`olmo3`, Olmo-3-7B / 32B, Think, RL-Zero): OLMo 2's layers with a sliding
    /// window on three layers of four (`layer_types`), the global layers' RoPE scaled
    /// (`rope_scaling`, YaRN in the released configs) and the sliding ones' not (Gemma 3's
    /// local RoPE, same base).
    Olmo3,
    /// ByteDance Seed-OSS (`seed_oss`, Seed-OSS-36B): llama's layers with q/k/v biased
    /// (`attention_bias`, default true) and o only with `attention_out_bias`.
    #[serde(rename = "seed_oss")]
    SeedOss,
    /// Arcee AFM (`arcee`, AFM-4.5B): llama's layers with an MLP without gate, `down(act(up))`,
    /// the activation ReLU² (`relu2`).
    Arcee,
    /// Karpathy's nanochat (`nanochat`, karpathy/nanochat-d32): llama's attention with q and k
    /// RMS-normalised per head after RoPE, an MLP without gate (`mlp.fc1` → ReLU² → `mlp.fc2`),
    /// every RMSNorm without weights (the layers', q's and k's, the final one, and one more on
    /// the embeddings before the first layer), the logits soft-capped (`final_logit_softcapping`,
    /// default 15).
    #[serde(rename = "nanochat")]
    NanoChat,
    /// Zhipu GLM-4.5 / 4.6 (`glm4_moe`, GLM-4.5-Air): q/k/v biased (`attention_bias`), half of
    /// each head rotating (rotate-half pairs), optional per-head q/k norms (`use_qk_norm`), the
    /// first `first_k_dense_replace` layers dense and the others a mixture of experts routed
    /// as DeepSeek-V3's ([`Routing::SigmoidGroups`]) beside `n_shared_experts` always-on
    /// experts (`mlp.shared_experts`).
    #[serde(rename = "glm4_moe")]
    Glm4Moe,
    /// DeepSeek-V3 (`deepseek_v3`: DeepSeek-V3 / R1, Kimi K2, Moonlight): multi-head latent
    /// attention ([`MlaConfig`]) and GLM-4.5's mixture of experts (DeepSeek-V3's router, shared
    /// experts, the first `first_k_dense_replace` layers dense).
    #[serde(rename = "deepseek_v3")]
    DeepseekV3,
    /// Zhipu GLM-4.7-Flash (`glm4_moe_lite`): DeepSeek-V3's layers, the dense layers named by
    /// `mlp_layer_types`.
    #[serde(rename = "glm4_moe_lite")]
    Glm4MoeLite,
    /// DeepSeek-V2 (`deepseek_v2`: DeepSeek-V2, V2-Lite, Coder-V2): DeepSeek-V3's latent attention
    /// (RoPE on adjacent pairs) and experts routed by softmax probabilities, greedily or within
    /// the best groups ([`Routing::Greedy`]).
    #[serde(rename = "deepseek_v2")]
    DeepseekV2,
    /// Mistral's Ministral 3 (`ministral3`: Ministral-3-3B/8B/14B, the language model of their
    /// `mistral3` vision-language checkpoints): Mistral's layers with YaRN and an attention
    /// temperature past the pre-training length (`llama_4_scaling_beta`, [`YarnRopeScaling`]).
    #[serde(rename = "ministral3")]
    Ministral3,
    /// Google Gemma 4 (`gemma4_text`, the language model of the `gemma4` checkpoints): Gemma 3's
    /// sublayer output norms, scaled embeddings and GELU-tanh, plain `w` RMSNorms, q/k norms
    /// and values RMS-normalised without weight, attention scores unscaled, sliding and full
    /// layers with heads of their own (`per_layer_config`), the full layers' proportional RoPE,
    /// and what [`crate::gemma4::Gemma4Config`] holds: keys reused as values, the last layers
    /// reusing earlier layers' keys and values, per-layer embeddings, a scalar per layer.
    #[serde(rename = "gemma4_text")]
    Gemma4,
    /// Tencent Hunyuan dense (`hunyuan_v1_dense`: Hunyuan-0.5B/1.8B/4B/7B-Instruct): llama's
    /// layers with q and k RMS-normalised per head after RoPE (`query_layernorm`,
    /// `key_layernorm`, weighted), its RoPE base stretched by a fixed NTK `alpha`.
    #[serde(rename = "hunyuan_v1_dense")]
    HunyuanDense,
    /// Alibaba Qwen3.5 (`qwen3_5_text`, the language model of the `qwen3_5` checkpoints:
    /// Qwen3.5-0.8B … 27B): three layers in four with linear attention (the gated delta rule,
    /// [`crate::delta`]), the others with Qwen3's attention whose `q_proj` also gives a gate on
    /// each head's output (`sigmoid`), RoPE on a quarter of each head, `1 + w` RMSNorms.
    #[serde(rename = "qwen3_5_text")]
    Qwen3_5,
    /// Alibaba Qwen3.5's mixtures of experts (`qwen3_5_moe_text`, the language model of the
    /// `qwen3_5_moe` checkpoints: Qwen3.5-35B-A3B, 122B-A10B, 397B-A17B): Qwen3.5's layers with
    /// an MoE MLP in every layer — a softmax router whose chosen weights are renormalised, and
    /// Qwen2-MoE's shared expert weighted by `sigmoid(shared_expert_gate · h)`.
    #[serde(rename = "qwen3_5_moe_text")]
    Qwen3_5Moe,
    /// Liquid AI's LFM2 (`lfm2`: LFM2-350M … 2.6B, LFM2.5): gated short convolutions in most
    /// layers ([`crate::shortconv`]), grouped-query attention with per-head q/k RMSNorms in the
    /// others; its files name the norms `operator_norm` / `ffn_norm` / `q_layernorm` /
    /// `k_layernorm` / `embedding_norm`, the MLP `feed_forward.w1` / `w3` / `w2`, the attention's
    /// output `out_proj` ([`crate::layout`]).
    #[serde(rename = "lfm2")]
    Lfm2,
    /// Liquid AI's LFM2 mixtures of experts (`lfm2_moe`: LFM2-8B-A1B): LFM2's layers, the first
    /// `num_dense_layers` with LFM2's MLP, the others with experts chosen by `sigmoid(logit) +
    /// expert_bias` ([`Routing::Sigmoid`]); its files hold each expert's `w1` / `w3` / `w2`.
    #[serde(rename = "lfm2_moe")]
    Lfm2Moe,
}

/// nanochat's MLP maps, its up and down ([`Arch::mlp_names`]): `mlp.fc1`, `mlp.fc2`.
pub const NANOCHAT_MLP: [&str; 2] = ["fc1", "fc2"];

/// The MLP's gate activation.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Activation {
    /// SiLU (`silu` / `swish`): Llama, Qwen, Mistral, SmolLM.
    #[default]
    Silu,
    /// GELU, tanh approximation (`gelu_pytorch_tanh`): Gemma.
    GeluPytorchTanh,
    /// ReLU squared (`relu2`): Arcee's MLP without gate.
    Relu2,
    /// gpt-oss's experts: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`,
    /// `(u + 1) · g · sigmoid(alpha · g)` (`swiglu_alpha` 1.702, `swiglu_limit` 7).
    ClampedSwiglu {
        /// The sigmoid's gain (`swiglu_alpha`).
        alpha: f64,
        /// The clamp (`swiglu_limit`).
        limit: f64,
    },
}

impl Arch {
    /// Every architecture.
    pub const ALL: [Arch; 35] = [
        Arch::Llama,
        Arch::Qwen2,
        Arch::Qwen3,
        Arch::Mistral,
        Arch::SmolLM3,
        Arch::Gemma3,
        Arch::Gemma2,
        Arch::Olmo2,
        Arch::Granite,
        Arch::Phi3,
        Arch::Qwen3Moe,
        Arch::Qwen2Moe,
        Arch::Mixtral,
        Arch::Olmoe,
        Arch::GraniteMoe,
        Arch::Ernie45,
        Arch::Exaone4,
        Arch::GptOss,
        Arch::Glm,
        Arch::Glm4,
        Arch::Olmo3,
        Arch::SeedOss,
        Arch::Arcee,
        Arch::Glm4Moe,
        Arch::DeepseekV3,
        Arch::Glm4MoeLite,
        Arch::DeepseekV2,
        Arch::NanoChat,
        Arch::Ministral3,
        Arch::Gemma4,
        Arch::HunyuanDense,
        Arch::Qwen3_5,
        Arch::Qwen3_5Moe,
        Arch::Lfm2,
        Arch::Lfm2Moe,
    ];

    /// The `model_type` string of `config.json`.
    pub fn as_str(self) -> &'static str {
        match self {
            Arch::Llama => "llama",
            Arch::Qwen2 => "qwen2",
            Arch::Qwen3 => "qwen3",
            Arch::Mistral => "mistral",
            Arch::SmolLM3 => "smollm3",
            Arch::Gemma3 => "gemma3_text",
            Arch::Gemma2 => "gemma2",
            Arch::Olmo2 => "olmo2",
            Arch::Phi3 => "phi3",
            Arch::Granite => "granite",
            Arch::Qwen3Moe => "qwen3_moe",
            Arch::Qwen2Moe => "qwen2_moe",
            Arch::Mixtral => "mixtral",
            Arch::Olmoe => "olmoe",
            Arch::GraniteMoe => "granitemoe",
            Arch::Ernie45 => "ernie4_5",
            Arch::Exaone4 => "exaone4",
            Arch::GptOss => "gpt_oss",
            Arch::Glm => "glm",
            Arch::Glm4 => "glm4",
            Arch::Olmo3 => "olmo3",
            Arch::SeedOss => "seed_oss",
            Arch::Arcee => "arcee",
            Arch::Glm4Moe => "glm4_moe",
            Arch::DeepseekV3 => "deepseek_v3",
            Arch::Glm4MoeLite => "glm4_moe_lite",
            Arch::DeepseekV2 => "deepseek_v2",
            Arch::NanoChat => "nanochat",
            Arch::Ministral3 => "ministral3",
            Arch::Gemma4 => "gemma4_text",
            Arch::HunyuanDense => "hunyuan_v1_dense",
            Arch::Qwen3_5 => "qwen3_5_text",
            Arch::Qwen3_5Moe => "qwen3_5_moe_text",
            Arch::Lfm2 => "lfm2",
            Arch::Lfm2Moe => "lfm2_moe",
        }
    }

    /// The dense family whose attention this architecture's layers have (a mixture-of-experts
    /// family's; the architecture itself otherwise, OLMoE's own included).
    pub fn attention(self) -> Self {
        match self {
            Arch::Qwen3Moe => Arch::Qwen3,
            Arch::Qwen2Moe => Arch::Qwen2,
            Arch::Mixtral | Arch::Ministral3 => Arch::Mistral,
            Arch::GraniteMoe => Arch::Granite,
            Arch::Qwen3_5Moe => Arch::Qwen3_5,
            Arch::Lfm2Moe => Arch::Lfm2,
            a => a,
        }
    }

    /// Whether the layers are Qwen3.5's (linear attention and gated full attention, `1 + w`
    /// norms): Qwen3.5 and its mixtures of experts.
    pub fn qwen3_5(self) -> bool {
        self.attention() == Arch::Qwen3_5
    }

    /// Whether the layers are LFM2's (short convolutions and attention, its own names): LFM2
    /// and its mixtures of experts.
    pub fn lfm2(self) -> bool {
        self.attention() == Arch::Lfm2
    }

    /// Whether the MLPs are mixtures of experts ([`MoeConfig`]).
    pub fn moe(self) -> bool {
        matches!(
            self,
            Arch::Qwen3Moe
                | Arch::Qwen2Moe
                | Arch::Mixtral
                | Arch::Olmoe
                | Arch::GraniteMoe
                | Arch::GptOss
                | Arch::Glm4Moe
                | Arch::DeepseekV3
                | Arch::Glm4MoeLite
                | Arch::DeepseekV2
                | Arch::Qwen3_5Moe
                | Arch::Lfm2Moe
        )
    }

    /// Whether the attention is DeepSeek's multi-head latent attention ([`MlaConfig`]).
    pub fn mla(self) -> bool {
        matches!(
            self,
            Arch::DeepseekV3 | Arch::Glm4MoeLite | Arch::DeepseekV2
        )
    }

    /// Whether the mixture of experts is DeepSeek's (GLM-4.5, DeepSeek-V3, GLM-4.7-Flash,
    /// DeepSeek-V2): `n_routed_experts`, shared experts `mlp.shared_experts` without a gate,
    /// the dense layers first, no load-balancing loss in transformers; routed by
    /// [`Routing::SigmoidGroups`] (DeepSeek-V2: [`Routing::Greedy`]).
    pub fn deepseek_moe(self) -> bool {
        matches!(
            self,
            Arch::Glm4Moe | Arch::DeepseekV3 | Arch::Glm4MoeLite | Arch::DeepseekV2
        )
    }

    /// transformers' default `router_aux_loss_coef` of an MoE family: OLMoE's 0.01, the
    /// others' 0.001.
    pub fn default_router_aux_loss_coef(self) -> f64 {
        match self {
            Arch::Olmoe => 0.01,
            _ => 0.001,
        }
    }

    /// Whether the experts are `intermediate_size` wide (Mixtral, OLMoE, Granite MoE, gpt-oss:
    /// no `moe_intermediate_size`).
    pub fn experts_mlp_wide(self) -> bool {
        matches!(
            self,
            Arch::Mixtral | Arch::Olmoe | Arch::GraniteMoe | Arch::GptOss
        )
    }

    /// Whether the shared expert's output is weighted by `sigmoid(shared_expert_gate · h)`
    /// (Qwen2-MoE, Qwen3.5's MoE); GLM-4.5's shared experts are added as they are.
    pub fn gated_shared_expert(self) -> bool {
        matches!(self, Arch::Qwen2Moe | Arch::Qwen3_5Moe)
    }

    /// Whether the router and each expert's maps have biases (gpt-oss).
    pub fn biased_experts(self) -> bool {
        self == Arch::GptOss
    }

    /// Whether a fused `gate_up_proj`'s outputs alternate gate, up (gpt-oss), rather than
    /// all gates then all ups.
    pub fn interleaved_gate_up(self) -> bool {
        self == Arch::GptOss
    }

    /// Whether each attention head has a learned sink (`self_attn.sinks`: gpt-oss).
    pub fn attention_sinks(self) -> bool {
        self == Arch::GptOss
    }

    /// Whether the family's attention has no sliding window (llama, Granite, ERNIE 4.5, GLM,
    /// Arcee): a `sliding_window` in its config is not read, nor written.
    pub fn windowless(self) -> bool {
        matches!(
            self,
            Arch::Llama
                | Arch::Granite
                | Arch::GraniteMoe
                | Arch::Ernie45
                | Arch::Glm
                | Arch::Glm4
                | Arch::Arcee
                | Arch::Glm4Moe
                | Arch::DeepseekV3
                | Arch::Glm4MoeLite
                | Arch::DeepseekV2
                | Arch::Qwen3_5
                | Arch::Qwen3_5Moe
                | Arch::Lfm2
                | Arch::Lfm2Moe
        )
    }

    /// Whether the MLP has a gate (`down(act(gate) · up)`); Arcee's and nanochat's are
    /// `down(act(up))`.
    pub fn gated_mlp(self) -> bool {
        !matches!(self, Arch::Arcee | Arch::NanoChat)
    }

    /// Whether RoPE turns each position by −θ (nanochat's `rotate_half` returns `(x2, −x1)`,
    /// the other families' `(−x2, x1)`).
    pub fn inverse_rope(self) -> bool {
        self == Arch::NanoChat
    }

    /// Whether every RMSNorm is without weights (nanochat's: `x / rms(x)`, nothing stored,
    /// nothing trained).
    pub fn weightless_norms(self) -> bool {
        self == Arch::NanoChat
    }

    /// The dense MLP's up and down maps' names in the checkpoint (`up_proj` / `down_proj`;
    /// nanochat's `fc1` / `fc2`).
    pub fn mlp_names(self) -> [&'static str; 2] {
        match self {
            Arch::NanoChat => NANOCHAT_MLP,
            _ => ["up_proj", "down_proj"],
        }
    }

    /// Whether the layers are llama's: q/k rows permuted in llama.cpp's files, and
    /// `attention_bias` (where the family has it) also biases `o_proj`.
    pub fn llama_like(self) -> bool {
        matches!(
            self,
            Arch::Llama
                | Arch::Mistral
                | Arch::Mixtral
                | Arch::Ministral3
                | Arch::SmolLM3
                | Arch::Granite
                | Arch::GraniteMoe
                | Arch::Arcee
        )
    }

    /// Whether each sublayer's output is normalised before its residual add (Gemma, OLMo 2,
    /// EXAONE 4, GLM-4-0414).
    pub fn output_norms(self) -> bool {
        self.gemma() || self.post_norms_only() || matches!(self, Arch::Glm4 | Arch::Gemma4)
    }

    /// Whether the layers have no pre-norms and normalise each sublayer's output before its
    /// residual add (OLMo 2, EXAONE 4).
    pub fn post_norms_only(self) -> bool {
        matches!(self, Arch::Olmo2 | Arch::Olmo3 | Arch::Exaone4)
    }

    /// Whether q and k are RMS-normalised over all heads' width, before the heads are split
    /// (OLMo 2, OLMo 3, OLMoE).
    pub fn full_qk_norm(self) -> bool {
        matches!(self, Arch::Olmo2 | Arch::Olmo3 | Arch::Olmoe)
    }

    /// Whether the sliding-window layers rotate with a RoPE of their own, unscaled (Gemma 3's
    /// `rope_local_base_freq`, OLMo 3's `sliding_attention` parameters).
    pub fn local_rope(self) -> bool {
        matches!(self, Arch::Gemma3 | Arch::Olmo3)
    }

    /// Whether q and k are RMS-normalised per head (`head_dim` weights: Qwen3, Gemma 3,
    /// EXAONE 4), not over all heads (OLMo 2, OLMoE).
    pub fn head_qk_norm(self) -> bool {
        matches!(
            self.attention(),
            Arch::Qwen3
                | Arch::Gemma3
                | Arch::Gemma4
                | Arch::Exaone4
                | Arch::NanoChat
                | Arch::HunyuanDense
                | Arch::Qwen3_5
                | Arch::Lfm2
        )
    }

    /// Whether q and k are normalised after RoPE with weights of their own (Hunyuan's): the
    /// order matters then, as a weight need not be equal on a rotated pair's two dimensions.
    pub fn qk_norm_after_rope(self) -> bool {
        self == Arch::HunyuanDense
    }

    /// Whether `attention_bias` also biases `o_proj` (Qwen's and Phi-3's leave it unbiased).
    pub fn biases_o_proj(self) -> bool {
        self.llama_like()
            || self.gemma()
            || self == Arch::Gemma4
            || matches!(
                self,
                Arch::Olmo2
                    | Arch::Olmo3
                    | Arch::Olmoe
                    | Arch::Ernie45
                    | Arch::Exaone4
                    | Arch::GptOss
                    | Arch::DeepseekV3
                    | Arch::Glm4MoeLite
                    | Arch::DeepseekV2
                    | Arch::NanoChat
                    | Arch::HunyuanDense
                    | Arch::Qwen3_5
                    | Arch::Qwen3_5Moe
            )
    }

    /// Whether transformers rotates adjacent pairs `(2i, 2i + 1)` of each head (GLM's
    /// `rotate_half`: ERNIE 4.5, GLM), not `(i, i + head_dim / 2)`.
    pub fn interleaved_rope(self) -> bool {
        matches!(self, Arch::Ernie45 | Arch::Glm | Arch::Glm4)
    }

    /// GLM or GLM-4-0414: gate and up fused in `gate_up_proj` (q, k, v apart), half of each
    /// head rotating by default.
    pub fn glm(self) -> bool {
        matches!(self, Arch::Glm | Arch::Glm4)
    }

    /// Gemma 2 or 3: `1 + w` RMSNorms, the sublayers' outputs normalised, embeddings scaled
    /// by `sqrt(hidden)`, GELU-tanh by default, `query_pre_attn_scalar`.
    pub fn gemma(self) -> bool {
        matches!(self, Arch::Gemma2 | Arch::Gemma3)
    }

    /// Parses a `model_type`, or fails naming it and listing the supported ones.
    pub fn parse(model_type: &str) -> Result<Self> {
        match model_type {
            "llama" => Ok(Arch::Llama),
            "qwen2" => Ok(Arch::Qwen2),
            "qwen3" => Ok(Arch::Qwen3),
            "mistral" => Ok(Arch::Mistral),
            "smollm3" => Ok(Arch::SmolLM3),
            "gemma3_text" => Ok(Arch::Gemma3),
            "gemma2" => Ok(Arch::Gemma2),
            "olmo2" => Ok(Arch::Olmo2),
            "phi3" => Ok(Arch::Phi3),
            "granite" => Ok(Arch::Granite),
            "qwen3_moe" => Ok(Arch::Qwen3Moe),
            "qwen2_moe" => Ok(Arch::Qwen2Moe),
            "mixtral" => Ok(Arch::Mixtral),
            "olmoe" => Ok(Arch::Olmoe),
            "granitemoe" => Ok(Arch::GraniteMoe),
            "ernie4_5" => Ok(Arch::Ernie45),
            "exaone4" => Ok(Arch::Exaone4),
            "gpt_oss" => Ok(Arch::GptOss),
            "glm" => Ok(Arch::Glm),
            "glm4" => Ok(Arch::Glm4),
            "olmo3" => Ok(Arch::Olmo3),
            "seed_oss" => Ok(Arch::SeedOss),
            "arcee" => Ok(Arch::Arcee),
            "glm4_moe" => Ok(Arch::Glm4Moe),
            "deepseek_v3" => Ok(Arch::DeepseekV3),
            "glm4_moe_lite" => Ok(Arch::Glm4MoeLite),
            "deepseek_v2" => Ok(Arch::DeepseekV2),
            "nanochat" => Ok(Arch::NanoChat),
            "ministral3" => Ok(Arch::Ministral3),
            "gemma4_text" => Ok(Arch::Gemma4),
            "hunyuan_v1_dense" => Ok(Arch::HunyuanDense),
            "qwen3_5_text" => Ok(Arch::Qwen3_5),
            "qwen3_5_moe_text" => Ok(Arch::Qwen3_5Moe),
            "lfm2" => Ok(Arch::Lfm2),
            "lfm2_moe" => Ok(Arch::Lfm2Moe),
            other => bail!(
                "unsupported model_type `{other}`: supported are llama, qwen2, qwen3, qwen3_5_text, mistral, ministral3, smollm3, gemma2, gemma3_text, gemma4_text, olmo2, phi3, granite, qwen3_moe, qwen2_moe, mixtral, olmoe, granitemoe, ernie4_5, exaone4, gpt_oss, glm, glm4, olmo3, seed_oss, arcee, glm4_moe, deepseek_v3, glm4_moe_lite, deepseek_v2, nanochat, hunyuan_v1_dense, qwen3_5_moe_text, lfm2, lfm2_moe (and the language models of the vision-language gemma3, gemma4, mistral3, qwen2_vl, qwen2_5_vl, qwen3_vl, qwen3_5 and qwen3_5_moe)"
            ),
        }
    }
}

/// Llama 3.x RoPE frequency scaling (`rope_scaling.rope_type = "llama3"`).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Llama3RopeScaling {
    /// Scale factor for low frequencies.
    pub factor: f64,
    /// Below this (in wavelength units of the original context) frequencies are scaled fully.
    pub low_freq_factor: f64,
    /// Above this frequencies are kept.
    pub high_freq_factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

/// YaRN RoPE scaling (`rope_type = "yarn"`, Qwen2.5 / Qwen3 long-context configs), with
/// transformers' defaults resolved.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct YarnRopeScaling {
    /// Context extension factor (interpolated frequencies are divided by it).
    pub factor: f64,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
    /// Rotations above which a frequency is extrapolated (kept); default 32.
    pub beta_fast: f64,
    /// Rotations below which a frequency is interpolated; default 1.
    pub beta_slow: f64,
    /// Whether the ramp's ends are rounded to whole dimensions (default true).
    pub truncate: bool,
    /// The factor on cos and sin: the config's `attention_factor`, else `0.1 ln(factor) + 1`
    /// (or its `mscale` / `mscale_all_dim` ratio), as transformers resolves it.
    pub attention_factor: f64,
    /// DeepSeek's `mscale_all_dim`, which also scales its attention scores
    /// ([`ModelConfig::attention_scale`] of a multi-head latent attention).
    #[serde(default)]
    pub mscale_all_dim: Option<f64>,
    /// Ministral 3's attention temperature (`llama_4_scaling_beta`): queries at position `p`
    /// times `1 + beta · ln(1 + ⌊p / original_max_position_embeddings⌋)` — 1 within the
    /// pre-training length, past which positions are refused
    /// ([`crate::model::Transformer::rope_at`]; a beta of 0 scales nothing).
    #[serde(default)]
    pub llama_4_scaling_beta: Option<f64>,
}

/// RoPE scaling of `rope_scaling` (transformers 4) or `rope_parameters` (transformers 5), each
/// computed as transformers' `modeling_rope_utils` does.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// Llama 3.x.
    Llama3(Llama3RopeScaling),
    /// Every frequency divided by `factor` (positions interpolated).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Dynamic NTK: transformers rescales only for sequences beyond `max_position_embeddings`
    /// (refused here: [`crate::model::Transformer::rope_at`]), so the frequencies are the
    /// unscaled ones; kept to write the config back.
    Dynamic {
        /// The factor of the rescaling beyond `max_position_embeddings`.
        factor: f64,
    },
    /// YaRN.
    Yarn(YarnRopeScaling),
    /// LongRoPE (Phi-3.5, Phi-4-mini): each rotary frequency divided by its `short_factor`.
    /// transformers switches every position to the `long_factor`s once a sequence passes
    /// `original_max_position_embeddings`; such sequences are refused here
    /// ([`crate::model::Transformer::rope_at`]).
    LongRope(LongRopeScaling),
}

/// LongRoPE's factors (`rope_type = "longrope"`, also the older `su` / `yarn` names of Phi-3
/// configs), with transformers' attention factor resolved.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LongRopeScaling {
    /// One divisor per rotary frequency for sequences within the original context.
    pub short_factor: Vec<f64>,
    /// One divisor per rotary frequency past it (kept to write the config back).
    pub long_factor: Vec<f64>,
    /// The config's `factor`, if given (else the ratio of the two context lengths is used).
    pub factor: Option<f64>,
    /// The factor on cos and sin: `attention_factor`, else `sqrt(1 + ln s / ln original)` with
    /// `s` the factor (1 when `s <= 1`).
    pub attention_factor: f64,
    /// Whether `attention_factor` was given (written back only then).
    pub attention_factor_given: bool,
    /// The context length the model was pre-trained with.
    pub original_max_position_embeddings: usize,
}

impl RopeScaling {
    /// Parses a `rope_scaling` / `rope_parameters` object (`rope_type`, or the older `type`);
    /// `None` for `default`. `max_position_embeddings` is transformers' default for a missing
    /// `original_max_position_embeddings`.
    pub fn from_hf_json(s: &Value, max_position_embeddings: usize) -> Result<Option<Self>> {
        let kind = s
            .get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default");
        // Phi-3's older names of LongRoPE (transformers renames them so).
        let kind = match kind {
            "su" | "yarn" if s.get("short_factor").is_some() => "longrope",
            k => k,
        };
        let num = |k: &str| s.get(k).filter(|x| !x.is_null()).and_then(Value::as_f64);
        let f = |k: &str| {
            num(k).ok_or_else(|| {
                candle_core::Error::msg(format!("rope_scaling.{k} is missing (rope_type `{kind}`)"))
            })
        };
        Ok(match kind {
            "default" => None,
            "llama3" => Some(RopeScaling::Llama3(Llama3RopeScaling {
                factor: f("factor")?,
                low_freq_factor: f("low_freq_factor")?,
                high_freq_factor: f("high_freq_factor")?,
                original_max_position_embeddings: f("original_max_position_embeddings")? as usize,
            })),
            "linear" => Some(RopeScaling::Linear {
                factor: f("factor")?,
            }),
            "dynamic" => Some(RopeScaling::Dynamic {
                factor: f("factor")?,
            }),
            "yarn" => {
                let original = num("original_max_position_embeddings")
                    .map_or(max_position_embeddings, |x| x as usize);
                // DeepSeek-V3's layout: no factor, the ratio of the two lengths.
                let factor = num("factor")
                    .unwrap_or(max_position_embeddings as f64 / original.max(1) as f64);
                let mscale = |scale: f64, m: f64| match scale <= 1.0 {
                    true => 1.0,
                    false => 0.1 * m * scale.ln() + 1.0,
                };
                let attention_factor = match (
                    num("attention_factor"),
                    num("mscale"),
                    num("mscale_all_dim"),
                ) {
                    (Some(a), _, _) => a,
                    (None, Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        mscale(factor, m) / mscale(factor, all)
                    }
                    _ => mscale(factor, 1.0),
                };
                // transformers' `or`: a 0 (or null) falls back to the default too.
                let beta = |k: &str, d: f64| num(k).filter(|x| *x != 0.0).unwrap_or(d);
                Some(RopeScaling::Yarn(YarnRopeScaling {
                    factor,
                    original_max_position_embeddings: original,
                    beta_fast: beta("beta_fast", 32.0),
                    beta_slow: beta("beta_slow", 1.0),
                    truncate: s.get("truncate").and_then(Value::as_bool).unwrap_or(true),
                    attention_factor,
                    mscale_all_dim: num("mscale_all_dim").filter(|m| *m != 0.0),
                    llama_4_scaling_beta: num("llama_4_scaling_beta"),
                }))
            }
            "longrope" => {
                let list = |k: &str| -> Result<Vec<f64>> {
                    let a = s.get(k).and_then(Value::as_array).ok_or_else(|| {
                        candle_core::Error::msg(format!(
                            "rope_scaling.{k} is missing or not a list (rope_type `longrope`)"
                        ))
                    })?;
                    a.iter()
                        .enumerate()
                        .map(|(i, x)| {
                            x.as_f64().ok_or_else(|| {
                                candle_core::Error::msg(format!(
                                    "rope_scaling.{k}[{i}] must be a number, not {x}"
                                ))
                            })
                        })
                        .collect()
                };
                let original = num("original_max_position_embeddings")
                    .map_or(max_position_embeddings, |x| x as usize);
                let factor = num("factor");
                let scale =
                    factor.unwrap_or(max_position_embeddings as f64 / original.max(1) as f64);
                let attention_factor = match num("attention_factor") {
                    Some(a) => a,
                    None if scale <= 1.0 => 1.0,
                    None => (1.0 + scale.ln() / (original as f64).ln()).sqrt(),
                };
                Some(RopeScaling::LongRope(LongRopeScaling {
                    short_factor: list("short_factor")?,
                    long_factor: list("long_factor")?,
                    factor,
                    attention_factor,
                    attention_factor_given: num("attention_factor").is_some(),
                    original_max_position_embeddings: original,
                }))
            }
            other => bail!(
                "rope_scaling type `{other}` is not supported (supported: default, linear, dynamic, yarn, llama3, longrope)"
            ),
        })
    }

    /// The `rope_scaling` object of `config.json` (what [`Self::from_hf_json`] reads back).
    pub fn to_hf_json(&self) -> Value {
        match self {
            RopeScaling::Llama3(s) => serde_json::json!({
                "rope_type": "llama3",
                "factor": s.factor,
                "low_freq_factor": s.low_freq_factor,
                "high_freq_factor": s.high_freq_factor,
                "original_max_position_embeddings": s.original_max_position_embeddings,
            }),
            RopeScaling::Linear { factor } => {
                serde_json::json!({"rope_type": "linear", "factor": factor})
            }
            RopeScaling::Dynamic { factor } => {
                serde_json::json!({"rope_type": "dynamic", "factor": factor})
            }
            RopeScaling::Yarn(y) => {
                let mut v = serde_json::json!({
                    "rope_type": "yarn",
                    "factor": y.factor,
                    "original_max_position_embeddings": y.original_max_position_embeddings,
                    "beta_fast": y.beta_fast,
                    "beta_slow": y.beta_slow,
                    "truncate": y.truncate,
                    "attention_factor": y.attention_factor,
                });
                if let Some(m) = y.mscale_all_dim {
                    v["mscale_all_dim"] = m.into();
                }
                if let Some(b) = y.llama_4_scaling_beta {
                    v["llama_4_scaling_beta"] = b.into();
                }
                v
            }
            RopeScaling::LongRope(l) => {
                let mut v = serde_json::json!({
                    "rope_type": "longrope",
                    "short_factor": l.short_factor,
                    "long_factor": l.long_factor,
                });
                let o = v.as_object_mut().expect("a JSON object");
                if let Some(f) = l.factor {
                    o.insert("factor".into(), f.into());
                }
                if l.attention_factor_given {
                    o.insert("attention_factor".into(), l.attention_factor.into());
                }
                v
            }
        }
    }
}

/// Everything the transformer needs to know about its shape.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Architecture family.
    pub arch: Arch,
    /// Vocabulary size (rows of the embedding).
    pub vocab_size: usize,
    /// Residual width.
    pub hidden_size: usize,
    /// MLP width.
    pub intermediate_size: usize,
    /// Number of decoder layers.
    pub num_hidden_layers: usize,
    /// Query heads.
    pub num_attention_heads: usize,
    /// Key/value heads (grouped-query attention when fewer than query heads).
    pub num_key_value_heads: usize,
    /// Per-head width.
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base.
    pub rope_theta: f64,
    /// RoPE scaling, if any.
    pub rope_scaling: Option<RopeScaling>,
    /// Maximum positions (for RoPE tables).
    pub max_position_embeddings: usize,
    /// Output projection shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// Biases on q, k, v (qwen2 always; llama when `attention_bias`), and on o (llama only).
    pub attention_bias: bool,
    /// Biases in the MLP (llama's `mlp_bias`).
    pub mlp_bias: bool,
    /// Seed-OSS's bias on o (`attention_out_bias`); the other families' o bias follows
    /// `attention_bias` ([`Self::o_proj_bias`]).
    #[serde(default)]
    pub attention_out_bias: bool,
    /// GLM-4.5's per-head RMSNorms on q and k (`use_qk_norm`, as Qwen3's); the families that
    /// always have them say so themselves ([`Self::head_qk_norm`]).
    #[serde(default)]
    pub use_qk_norm: bool,
    /// BOS token id, if the model has one.
    pub bos_token_id: Option<u32>,
    /// EOS token ids from config.json (generation_config.json may add more).
    pub eos_token_ids: Vec<u32>,
    /// Padding token id, if declared.
    pub pad_token_id: Option<u32>,
    /// A `*ForSequenceClassification` checkpoint (a reward model): a `score` head `(1,
    /// hidden)` in place of the LM head ([`crate::Transformer::score`]).
    #[serde(default)]
    pub sequence_classification: bool,
    /// A `*ForTokenClassification` checkpoint (a process reward model): its number of labels;
    /// a `score` head `(num_labels, hidden)` with a bias in place of the LM head
    /// ([`crate::Transformer::token_logits`]).
    #[serde(default)]
    pub token_classification: Option<usize>,
    /// transformers' `initializer_range` (the std of new weights, e.g. a reward model's fresh
    /// `score` head); `None`: not in the config (0.02, transformers' default, is used).
    #[serde(default)]
    pub initializer_range: Option<f64>,
    /// Sliding-window attention (`sliding_window`, where the config switches it on): a query
    /// attends to itself and the `w − 1` cache positions before it only.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// The layers that have the window (Qwen's / SmolLM3's `layer_types`); empty: all of them.
    #[serde(default)]
    pub sliding_layers: Vec<usize>,
    /// Layers that apply no RoPE (SmolLM3's `no_rope_layers` zeros); empty: all rotate.
    #[serde(default)]
    pub nope_layers: Vec<usize>,
    /// The MLP's gate activation.
    #[serde(default)]
    pub activation: Activation,
    /// Attention scores scaled by `query_pre_attn_scalar^-1/2` (Gemma) instead of
    /// `head_dim^-1/2`.
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// The RoPE base of the sliding-window layers, unscaled (Gemma 3's
    /// `rope_local_base_freq`); `None`: every layer uses `rope_theta` and `rope_scaling`.
    #[serde(default)]
    pub local_rope_theta: Option<f64>,
    /// The share of each head's dimensions that rotate (`partial_rotary_factor`, Phi-4-mini's
    /// 0.75); `None`: all of them. See [`Self::rotary_dim`].
    #[serde(default)]
    pub partial_rotary_factor: Option<f64>,
    /// Gemma 2's cap on the attention scores: `cap · tanh(s / cap)` before the mask.
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Gemma 2's cap on the output logits, `cap · tanh(z / cap)`.
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// Granite's four scalars (transformers' defaults 1).
    #[serde(default)]
    pub granite: Option<GraniteScalars>,
    /// The mixture-of-experts MLPs' shape (the MoE families).
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// DeepSeek's multi-head latent attention (its `head_dim` is a query head's width, its
    /// key/value heads as many as the query heads).
    #[serde(default)]
    pub mla: Option<MlaConfig>,
    /// Gemma 4's layers ([`Arch::Gemma4`]; `head_dim`, `num_key_value_heads` and `rope_theta`
    /// are then its sliding layers').
    #[serde(default)]
    pub gemma4: Option<crate::gemma4::Gemma4Config>,
    /// Qwen3.5's linear-attention layers ([`Arch::Qwen3_5`]).
    #[serde(default)]
    pub linear_attention: Option<crate::delta::DeltaConfig>,
    /// LFM2's convolution layers ([`Arch::Lfm2`]).
    #[serde(default)]
    pub short_conv: Option<crate::shortconv::ShortConvConfig>,
}

/// IBM Granite's multipliers ([`Arch::Granite`], [`Arch::GraniteMoe`]).
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct GraniteScalars {
    /// The embeddings' factor.
    pub embedding_multiplier: f64,
    /// The attention scores' scale (in place of `head_dim^-1/2`).
    pub attention_multiplier: f64,
    /// Each sublayer's output factor before its residual add.
    pub residual_multiplier: f64,
    /// The logits' divisor.
    pub logits_scaling: f64,
}

/// A mixture-of-experts MLP's shape ([`Arch::Qwen3Moe`], [`Arch::Qwen2Moe`], [`Arch::Mixtral`],
/// [`Arch::Olmoe`], [`Arch::GraniteMoe`]):
/// a router (`gate`) scores the experts for each token, the `num_experts_per_tok` best take
/// it, their outputs weighted by the router's softmax probabilities (renormalised over the
/// chosen ones when `norm_topk_prob`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_experts`, Mixtral's `num_local_experts`).
    pub num_experts: usize,
    /// Experts each token is routed to.
    pub num_experts_per_tok: usize,
    /// Each expert's MLP width (`moe_intermediate_size`; Mixtral's `intermediate_size`).
    pub moe_intermediate_size: usize,
    /// The chosen experts' probabilities renormalised to sum to 1 (Mixtral: always).
    pub norm_topk_prob: bool,
    /// Every `decoder_sparse_step`-th layer is an MoE layer (1: all of them).
    pub decoder_sparse_step: usize,
    /// Layers with a dense MLP (`intermediate_size` wide) instead.
    pub mlp_only_layers: Vec<usize>,
    /// Qwen2-MoE's shared expert's width (`shared_expert_intermediate_size`).
    pub shared_expert_intermediate_size: Option<usize>,
    /// The load-balancing loss's weight the config declares (`router_aux_loss_coef`; 0 for
    /// GLM-4.5, whose transformers model has no such loss).
    pub router_aux_loss_coef: f64,
    /// How the router's logits choose and weight the experts.
    #[serde(default)]
    pub routing: Routing,
}

/// DeepSeek's multi-head latent attention ([`Arch::DeepseekV3`], [`Arch::Glm4MoeLite`]): q from
/// `q_proj`, or through a low-rank `q_a_proj` → `q_a_layernorm` → `q_b_proj`; keys and values
/// from one latent per token — `kv_a_proj_with_mqa` gives `kv_lora_rank` latent dimensions
/// (normalised by `kv_a_layernorm`, then `kv_b_proj` makes each head's key part without RoPE and
/// its value) and `qk_rope_head_dim` rotated key dimensions shared by every head. A head's
/// query and key are `qk_nope_head_dim + qk_rope_head_dim` wide (the model's `head_dim`; the
/// RoPE on the last `qk_rope_head_dim`, adjacent pairs with `rope_interleave`), its value
/// `v_head_dim`.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MlaConfig {
    /// `q_a_proj`'s rank; `None`: one `q_proj`.
    pub q_lora_rank: Option<usize>,
    /// The latent's width.
    pub kv_lora_rank: usize,
    /// Each head's query/key dimensions without RoPE.
    pub qk_nope_head_dim: usize,
    /// Each head's query/key dimensions with RoPE (the key's shared by the heads).
    pub qk_rope_head_dim: usize,
    /// Each head's value width.
    pub v_head_dim: usize,
    /// The RoPE dimensions pair as `(2i, 2i + 1)` (DeepSeek's checkpoints), not `(i, i + r/2)`.
    pub rope_interleave: bool,
}

impl MlaConfig {
    /// Reads the attention fields of a DeepSeek-V3 / GLM-4.7-Flash `config.json`, with
    /// transformers' defaults.
    fn from_hf_json(v: &Value, arch: Arch) -> Result<Self> {
        let int = |k: &str, default: usize| -> Result<usize> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                    candle_core::Error::msg(format!("field `{k}` must be an integer, not {x}"))
                }),
            }
        };
        let glm = arch == Arch::Glm4MoeLite;
        let q_lora_rank = match v.get("q_lora_rank") {
            Some(Value::Null) => None,
            _ => Some(int("q_lora_rank", if glm { 768 } else { 1536 })?),
        };
        Ok(MlaConfig {
            q_lora_rank,
            kv_lora_rank: int("kv_lora_rank", 512)?,
            qk_nope_head_dim: int("qk_nope_head_dim", if glm { 192 } else { 128 })?,
            qk_rope_head_dim: int("qk_rope_head_dim", 64)?,
            v_head_dim: int("v_head_dim", if glm { 256 } else { 128 })?,
            // DeepSeek-V2 always rotates adjacent pairs (its config has no such field).
            rope_interleave: arch == Arch::DeepseekV2
                || v.get("rope_interleave")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
        })
    }

    fn validate(&self) -> Result<()> {
        for (k, x) in [
            ("kv_lora_rank", self.kv_lora_rank),
            ("qk_rope_head_dim", self.qk_rope_head_dim),
            ("v_head_dim", self.v_head_dim),
            ("q_lora_rank", self.q_lora_rank.unwrap_or(1)),
        ] {
            if x == 0 {
                bail!("field `{k}` must be > 0");
            }
        }
        if !self.qk_rope_head_dim.is_multiple_of(2) || !self.qk_nope_head_dim.is_multiple_of(2) {
            bail!(
                "qk_rope_head_dim ({}) and qk_nope_head_dim ({}) must be even",
                self.qk_rope_head_dim,
                self.qk_nope_head_dim
            );
        }
        if self.v_head_dim > self.qk_head_dim() {
            bail!(
                "v_head_dim ({}) wider than a query head (qk_nope_head_dim + qk_rope_head_dim = {}) is not supported",
                self.v_head_dim,
                self.qk_head_dim()
            );
        }
        Ok(())
    }

    /// A query / key head's width, `qk_nope_head_dim + qk_rope_head_dim`.
    pub fn qk_head_dim(&self) -> usize {
        self.qk_nope_head_dim + self.qk_rope_head_dim
    }

    /// The fields of `config.json`.
    fn write(&self, obj: &mut serde_json::Map<String, Value>) {
        obj.insert("q_lora_rank".into(), self.q_lora_rank.into());
        obj.insert("kv_lora_rank".into(), self.kv_lora_rank.into());
        obj.insert("qk_nope_head_dim".into(), self.qk_nope_head_dim.into());
        obj.insert("qk_rope_head_dim".into(), self.qk_rope_head_dim.into());
        obj.insert("v_head_dim".into(), self.v_head_dim.into());
        obj.insert("rope_interleave".into(), self.rope_interleave.into());
        // transformers' `head_dim` of these configs is the RoPE's width.
        obj.insert("head_dim".into(), self.qk_rope_head_dim.into());
    }
}

/// How an MoE router turns its logits into each token's experts and their weights.
#[derive(Debug, Clone, Copy, PartialEq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Routing {
    /// DeepSeek-V2's router: the logits in f32, a softmax over every expert, the
    /// `num_experts_per_tok` most probable chosen — among the `topk_group` of `n_group` groups
    /// with the highest best probability when `group_limited` (`topk_method =
    /// "group_limited_greedy"`; the other experts' probabilities set to 0, as transformers masks
    /// them) — weighted by their probabilities (never renormalised) times
    /// `routed_scaling_factor`.
    Greedy {
        /// Groups the experts are split into (`n_group`).
        n_group: usize,
        /// Groups each token may take experts from (`topk_group`).
        topk_group: usize,
        /// The chosen weights' factor.
        routed_scaling_factor: f64,
        /// `topk_method = "group_limited_greedy"`.
        group_limited: bool,
    },
    /// A softmax over all experts (in f32); the `num_experts_per_tok` most probable chosen,
    /// weighted by their probabilities (renormalised when `norm_topk_prob`): Qwen, Mixtral,
    /// OLMoE, Granite MoE, gpt-oss.
    #[default]
    Softmax,
    /// LFM2-MoE's router: each expert's score `sigmoid(logit)` (the logits in the model's
    /// dtype), the experts chosen by score plus the layer's `expert_bias` (with
    /// `use_expert_bias`; a constant the checkpoint holds), weighted by their scores (divided by
    /// their sum plus 1e-6 when `norm_topk_prob`) times `routed_scaling_factor`.
    Sigmoid {
        /// The chosen weights' factor (`routed_scaling_factor`).
        routed_scaling_factor: f64,
        /// `use_expert_bias`.
        expert_bias: bool,
    },
    /// DeepSeek-V3's router (`noaux_tc`), as GLM-4.5 has it: the logits in f32, each
    /// expert's score `sigmoid(logit)`; the experts are chosen by score plus the layer's
    /// `e_score_correction_bias` (a constant the checkpoint holds, never trained), among the
    /// `topk_group` of `n_group` groups whose two best such sums are highest; weighted by their
    /// scores (divided by their sum plus 1e-20 when `norm_topk_prob`) times
    /// `routed_scaling_factor`.
    SigmoidGroups {
        /// Groups the experts are split into, in order (`n_group`).
        n_group: usize,
        /// Groups each token may take experts from (`topk_group`).
        topk_group: usize,
        /// The chosen weights' factor (`routed_scaling_factor`).
        routed_scaling_factor: f64,
    },
}

impl MoeConfig {
    /// Reads the MoE fields of a `config.json` with transformers' defaults per family.
    fn from_hf_json(v: &Value, arch: Arch, intermediate_size: usize) -> Result<Self> {
        let int = |k: &str, default: usize| -> Result<usize> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_u64().map(|x| x as usize).ok_or_else(|| {
                    candle_core::Error::msg(format!("field `{k}` must be an integer, not {x}"))
                }),
            }
        };
        let (experts, k, width) = match arch {
            Arch::Qwen3Moe => (128, 8, 768),
            Arch::Glm4Moe => (128, 8, 1408),
            Arch::DeepseekV3 => (256, 8, 2048),
            Arch::Glm4MoeLite => (64, 4, 1536),
            Arch::DeepseekV2 => (64, 6, 1407),
            Arch::Qwen2Moe => (60, 4, 1408),
            Arch::Qwen3_5Moe => (256, 8, 512),
            Arch::Lfm2Moe => (32, 4, 1792),
            Arch::Olmoe => (64, 8, intermediate_size),
            Arch::GptOss => (128, 4, intermediate_size),
            _ => (8, 2, intermediate_size),
        };
        let num_experts = match v.get("num_experts").filter(|x| !x.is_null()) {
            Some(_) => int("num_experts", experts)?,
            // GLM-4.5's name (transformers maps `num_local_experts` to it).
            None if arch.deepseek_moe() && v.get("num_local_experts").is_none() => {
                int("n_routed_experts", experts)?
            }
            None => int("num_local_experts", experts)?,
        };
        let num_experts_per_tok = int("num_experts_per_tok", k)?;
        if num_experts == 0 || num_experts_per_tok == 0 || num_experts_per_tok > num_experts {
            bail!(
                "num_experts_per_tok = {num_experts_per_tok} must be from 1 to num_experts ({num_experts})"
            );
        }
        // (Qwen3.5's MoE: every layer sparse, the chosen weights always renormalised.)
        let decoder_sparse_step = match arch.deepseek_moe() || arch == Arch::Qwen3_5Moe {
            true => 1,
            false => int("decoder_sparse_step", 1)?,
        };
        if decoder_sparse_step == 0 {
            bail!("field `decoder_sparse_step` must be > 0");
        }
        let mlp_only_layers = match v.get("mlp_only_layers") {
            // LFM2-MoE's first `num_dense_layers`.
            _ if arch == Arch::Lfm2Moe => (0..int("num_dense_layers", 2)?).collect(),
            // GLM-4.7-Flash's `mlp_layer_types` (default: the first layer dense).
            _ if arch == Arch::Glm4MoeLite => match v.get("mlp_layer_types") {
                None | Some(Value::Null) => vec![0],
                Some(Value::Array(t)) => t
                    .iter()
                    .enumerate()
                    .filter_map(|(i, x)| match x.as_str() {
                        Some("dense") => Some(Ok(i)),
                        Some("sparse") => None,
                        _ => Some(Err(candle_core::Error::msg(format!(
                            "field `mlp_layer_types[{i}]` must be \"dense\" or \"sparse\", not {x}"
                        )))),
                    })
                    .collect::<Result<_>>()?,
                Some(x) => bail!("field `mlp_layer_types` must be a list, not {x}"),
            },
            // GLM-4.5's and DeepSeek-V3's first `first_k_dense_replace` layers are dense.
            _ if arch == Arch::Qwen3_5Moe => Vec::new(),
            _ if arch.deepseek_moe() => {
                let k = match arch {
                    Arch::DeepseekV3 => 3,
                    Arch::DeepseekV2 => 0,
                    _ => 1,
                };
                (0..int("first_k_dense_replace", k)?).collect()
            }
            None | Some(Value::Null) => Vec::new(),
            Some(Value::Array(a)) => a
                .iter()
                .map(|x| {
                    x.as_u64().map(|x| x as usize).ok_or_else(|| {
                        candle_core::Error::msg(format!(
                            "field `mlp_only_layers` must list layer indices, not {x}"
                        ))
                    })
                })
                .collect::<Result<_>>()?,
            Some(x) => bail!("field `mlp_only_layers` must be a list, not {x}"),
        };
        if let Some(j) = v.get("router_jitter_noise").and_then(Value::as_f64)
            && j != 0.0
        {
            bail!(
                "router_jitter_noise = {j} is not supported (only 0: no noise on the router's input)"
            );
        }
        let moe_intermediate_size = match arch.experts_mlp_wide() {
            true => intermediate_size,
            false => int("moe_intermediate_size", width)?,
        };
        if moe_intermediate_size == 0 {
            bail!("field `moe_intermediate_size` must be > 0");
        }
        let routing = match arch {
            a if a.deepseek_moe() => {
                // transformers' defaults: DeepSeek-V3's 8 groups of which 4, scaled by 2.5;
                // GLM-4.7-Flash's one group, 1.8; GLM-4.5's one group, 1.
                let (groups, topk, scale) = match a {
                    Arch::DeepseekV3 => (8, 4, 2.5),
                    Arch::Glm4MoeLite => (1, 1, 1.8),
                    _ => (1, 1, 1.0),
                };
                // DeepSeek-V2's configs may write null groups.
                let int = |k: &str, d: usize| match v.get(k) {
                    Some(Value::Null) => Ok(d),
                    _ => int(k, d),
                };
                let n_group = int("n_group", groups)?;
                let topk_group = int("topk_group", topk)?;
                let routed_scaling_factor = match v.get("routed_scaling_factor") {
                    None | Some(Value::Null) => scale,
                    Some(x) => x.as_f64().ok_or_else(|| {
                        candle_core::Error::msg(format!(
                            "field `routed_scaling_factor` must be a number, not {x}"
                        ))
                    })?,
                };
                match a {
                    Arch::DeepseekV2 => Routing::Greedy {
                        n_group,
                        topk_group,
                        routed_scaling_factor,
                        group_limited: match v.get("topk_method").and_then(Value::as_str) {
                            None | Some("greedy") => false,
                            Some("group_limited_greedy") => true,
                            Some(m) => bail!(
                                "topk_method `{m}` is not supported for deepseek_v2 (greedy or group_limited_greedy)"
                            ),
                        },
                    },
                    _ => Routing::SigmoidGroups {
                        n_group,
                        topk_group,
                        routed_scaling_factor,
                    },
                }
            }
            Arch::Lfm2Moe => Routing::Sigmoid {
                routed_scaling_factor: match v.get("routed_scaling_factor") {
                    None | Some(Value::Null) => 1.0,
                    Some(x) => x.as_f64().ok_or_else(|| {
                        candle_core::Error::msg(format!(
                            "field `routed_scaling_factor` must be a number, not {x}"
                        ))
                    })?,
                },
                expert_bias: v
                    .get("use_expert_bias")
                    .and_then(Value::as_bool)
                    .unwrap_or(true),
            },
            _ => Routing::Softmax,
        };
        Ok(MoeConfig {
            num_experts,
            num_experts_per_tok,
            moe_intermediate_size,
            // Mixtral's, Granite MoE's and gpt-oss's (a softmax over the chosen logits) always
            // sum to 1.
            norm_topk_prob: matches!(
                arch,
                Arch::Mixtral | Arch::GraniteMoe | Arch::GptOss | Arch::Qwen3_5Moe
            ) || v
                .get("norm_topk_prob")
                .and_then(Value::as_bool)
                // Glm4MoeConfig's, DeepseekV3Config's and Lfm2MoeConfig's default
                // renormalises (DeepSeek-V2's router never does).
                .unwrap_or(
                    (arch.deepseek_moe() && arch != Arch::DeepseekV2) || arch == Arch::Lfm2Moe,
                ),
            decoder_sparse_step,
            mlp_only_layers,
            shared_expert_intermediate_size: match arch {
                Arch::Qwen2Moe => Some(int("shared_expert_intermediate_size", 5632)?),
                Arch::Qwen3_5Moe => Some(int("shared_expert_intermediate_size", 512)?),
                // GLM-4.5's and DeepSeek-V3's `n_shared_experts` experts' width, as one MLP.
                a if a.deepseek_moe() => {
                    Some(int("n_shared_experts", 1)? * moe_intermediate_size).filter(|w| *w > 0)
                }
                _ => None,
            },
            router_aux_loss_coef: match arch {
                // transformers' GLM-4.5, DeepSeek-V3 and LFM2-MoE compute no load-balancing
                // loss.
                a if a.deepseek_moe() || a == Arch::Lfm2Moe => 0.0,
                _ => v
                    .get("router_aux_loss_coef")
                    .and_then(Value::as_f64)
                    .unwrap_or(arch.default_router_aux_loss_coef()),
            },
            routing,
        })
    }

    /// Whether layer `i` routes through experts (transformers' rule: not in
    /// `mlp_only_layers`, and `i + 1` a multiple of `decoder_sparse_step`).
    pub fn sparse(&self, i: usize) -> bool {
        !self.mlp_only_layers.contains(&i) && (i + 1).is_multiple_of(self.decoder_sparse_step)
    }

    /// Checks the routing's shape against the experts (GLM-4.5's groups) and that GLM-4.5's
    /// dense layers are the first ones (`first_k_dense_replace`).
    fn validate(&self, arch: Arch) -> Result<()> {
        if let Routing::Greedy {
            n_group,
            topk_group,
            group_limited: true,
            ..
        } = self.routing
            && (n_group == 0
                || !self.num_experts.is_multiple_of(n_group)
                || topk_group == 0
                || topk_group > n_group)
        {
            bail!(
                "n_group = {n_group}, topk_group = {topk_group}: the {} experts must split into n_group equal groups, of which 1 to n_group are taken",
                self.num_experts
            );
        }
        if let Routing::SigmoidGroups {
            n_group,
            topk_group,
            ..
        } = self.routing
        {
            let e = self.num_experts;
            if n_group == 0 || !e.is_multiple_of(n_group) {
                bail!("n_group = {n_group} must divide the {e} experts into equal groups");
            }
            if topk_group == 0 || topk_group > n_group {
                bail!("topk_group = {topk_group} must be from 1 to n_group ({n_group})");
            }
            if e / n_group < 2 {
                bail!(
                    "n_group = {n_group} leaves {} expert(s) per group: a group is scored by its two best experts",
                    e / n_group
                );
            }
            if self.num_experts_per_tok > topk_group * (e / n_group) {
                bail!(
                    "num_experts_per_tok = {} is more than the {} experts of topk_group ({topk_group}) groups",
                    self.num_experts_per_tok,
                    topk_group * (e / n_group)
                );
            }
        }
        if matches!(arch, Arch::Glm4Moe | Arch::DeepseekV3 | Arch::DeepseekV2)
            && (self.decoder_sparse_step != 1
                || self
                    .mlp_only_layers
                    .iter()
                    .enumerate()
                    .any(|(i, l)| i != *l))
        {
            bail!(
                "{}'s dense layers are its first `first_k_dense_replace` ones (mlp_only_layers {:?}, decoder_sparse_step {} cannot be written)",
                arch.as_str(),
                self.mlp_only_layers,
                self.decoder_sparse_step
            );
        }
        Ok(())
    }

    /// The fields of `config.json` for `arch`.
    fn write(&self, arch: Arch, obj: &mut serde_json::Map<String, Value>, layers: usize) {
        if let Routing::Sigmoid {
            routed_scaling_factor,
            expert_bias,
        } = self.routing
        {
            for (k, x) in [
                ("num_experts", Value::from(self.num_experts)),
                ("num_experts_per_tok", self.num_experts_per_tok.into()),
                ("moe_intermediate_size", self.moe_intermediate_size.into()),
                ("norm_topk_prob", self.norm_topk_prob.into()),
                ("num_dense_layers", self.mlp_only_layers.len().into()),
                ("use_expert_bias", expert_bias.into()),
                ("routed_scaling_factor", routed_scaling_factor.into()),
                ("output_router_logits", false.into()),
            ] {
                obj.insert(k.into(), x);
            }
            return;
        }
        if let Routing::SigmoidGroups {
            n_group,
            topk_group,
            routed_scaling_factor,
        }
        | Routing::Greedy {
            n_group,
            topk_group,
            routed_scaling_factor,
            ..
        } = self.routing
        {
            if let Routing::Greedy { group_limited, .. } = self.routing {
                let method = match group_limited {
                    true => "group_limited_greedy",
                    false => "greedy",
                };
                obj.insert("topk_method".into(), method.into());
            }
            let shared = self
                .shared_expert_intermediate_size
                .map_or(0, |w| w / self.moe_intermediate_size);
            for (k, x) in [
                ("n_routed_experts", Value::from(self.num_experts)),
                ("num_experts_per_tok", self.num_experts_per_tok.into()),
                ("moe_intermediate_size", self.moe_intermediate_size.into()),
                ("norm_topk_prob", self.norm_topk_prob.into()),
                ("n_shared_experts", shared.into()),
                ("n_group", n_group.into()),
                ("topk_group", topk_group.into()),
                ("routed_scaling_factor", routed_scaling_factor.into()),
                ("output_router_logits", false.into()),
            ] {
                obj.insert(k.into(), x);
            }
            // GLM-4.7-Flash lists each layer's kind; the others count the dense ones.
            match arch {
                Arch::Glm4MoeLite => {
                    let kinds: Vec<&str> = (0..layers)
                        .map(|i| if self.sparse(i) { "sparse" } else { "dense" })
                        .collect();
                    obj.insert("mlp_layer_types".into(), kinds.into());
                }
                _ => {
                    let dense = self.mlp_only_layers.len();
                    obj.insert("first_k_dense_replace".into(), dense.into());
                }
            }
            return;
        }
        let experts = match arch {
            Arch::Mixtral | Arch::GraniteMoe | Arch::GptOss => "num_local_experts",
            _ => "num_experts",
        };
        obj.insert(experts.into(), self.num_experts.into());
        obj.insert(
            "num_experts_per_tok".into(),
            self.num_experts_per_tok.into(),
        );
        obj.insert(
            "router_aux_loss_coef".into(),
            self.router_aux_loss_coef.into(),
        );
        obj.insert("output_router_logits".into(), false.into());
        if matches!(arch, Arch::Mixtral | Arch::GraniteMoe | Arch::GptOss) {
            return;
        }
        // Qwen3.5's MoE config has no such fields (every layer sparse, always renormalised).
        if arch == Arch::Qwen3_5Moe {
            obj.insert(
                "moe_intermediate_size".into(),
                self.moe_intermediate_size.into(),
            );
            if let Some(s) = self.shared_expert_intermediate_size {
                obj.insert("shared_expert_intermediate_size".into(), s.into());
            }
            return;
        }
        obj.insert("norm_topk_prob".into(), self.norm_topk_prob.into());
        if arch == Arch::Olmoe {
            return;
        }
        obj.insert(
            "moe_intermediate_size".into(),
            self.moe_intermediate_size.into(),
        );
        obj.insert(
            "decoder_sparse_step".into(),
            self.decoder_sparse_step.into(),
        );
        obj.insert(
            "mlp_only_layers".into(),
            self.mlp_only_layers.clone().into(),
        );
        if let Some(s) = self.shared_expert_intermediate_size {
            obj.insert("shared_expert_intermediate_size".into(), s.into());
        }
    }
}

/// EXAONE 4's sliding layers from `sliding_window_pattern`: every layer but each n-th (an
/// integer, default 4; 0: none), or a string of `L` (local: sliding) and `G` (global) repeated
/// from layer 0 (`"LLLG"`).
fn exaone_sliding_layers(pattern: Option<&Value>, layers: usize) -> Result<Vec<usize>> {
    match pattern {
        None | Some(Value::Null) => {
            Ok((0..layers).filter(|i| !(i + 1).is_multiple_of(4)).collect())
        }
        Some(Value::Number(n)) => match n.as_u64() {
            Some(0) => Ok(Vec::new()),
            Some(every) => Ok((0..layers)
                .filter(|i| !(i + 1).is_multiple_of(every as usize))
                .collect()),
            None => bail!(
                "field `sliding_window_pattern` must be a non-negative integer or a string of L and G, not {n}"
            ),
        },
        Some(Value::String(s)) if !s.is_empty() && s.chars().all(|c| c == 'L' || c == 'G') => {
            let kinds: Vec<char> = s.chars().collect();
            Ok((0..layers)
                .filter(|i| kinds[i % kinds.len()] == 'L')
                .collect())
        }
        Some(x) => bail!(
            "field `sliding_window_pattern` must be a non-negative integer or a string of L and G, not {x}"
        ),
    }
}

/// Every `every`-th of `layers` layers (1-based: the `every − 1`-th, ...): SmolLM3's NoPE
/// layers from `no_rope_layer_interval` (llama.cpp's smollm3 fixes it at 4).
pub fn nope_every(layers: usize, every: usize) -> Vec<usize> {
    (0..layers)
        .filter(|i| (i + 1).is_multiple_of(every))
        .collect()
}

fn ids(v: Option<&Value>) -> Vec<u32> {
    match v {
        Some(Value::Number(n)) => n.as_u64().map(|x| vec![x as u32]).unwrap_or_default(),
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_u64().map(|x| x as u32))
            .collect(),
        _ => Vec::new(),
    }
}

/// LFM2's MLP width as `Lfm2MLP` derives it: `intermediate_size` (or `block_ff_dim`), with
/// `block_auto_adjust_ff_dim` (default true) two thirds of it, times `block_ffn_dim_multiplier`
/// (default 1; `null`: no more) rounded up to a multiple of `block_multiple_of` (default 256).
fn lfm2_mlp_width(v: &Value) -> Result<usize> {
    let width = v
        .get("intermediate_size")
        .or(v.get("block_ff_dim"))
        .and_then(Value::as_u64)
        .ok_or_else(|| {
            candle_core::Error::msg("field `intermediate_size` is missing or not an integer")
        })? as usize;
    if !v
        .get("block_auto_adjust_ff_dim")
        .and_then(Value::as_bool)
        .unwrap_or(true)
    {
        return Ok(width);
    }
    let width = 2 * width / 3;
    let multiplier = match v.get("block_ffn_dim_multiplier") {
        Some(Value::Null) => return Ok(width),
        None => 1.0,
        Some(x) => x.as_f64().ok_or_else(|| {
            candle_core::Error::msg(format!(
                "field `block_ffn_dim_multiplier` must be a number, not {x}"
            ))
        })?,
    };
    let multiple = v
        .get("block_multiple_of")
        .and_then(Value::as_u64)
        .unwrap_or(256)
        .max(1) as usize;
    Ok(((multiplier * width as f64) as usize).div_ceil(multiple) * multiple)
}

/// The language model's config of a vision-language `config.json` — Gemma 3's (`gemma3`,
/// gemma-3-4b-it and larger: its `text_config`, a `gemma3_text`), Gemma 4's (`gemma4`: a
/// `gemma4_text`), Mistral 3's (`mistral3`: Ministral 3, Mistral Small 3.1+: a `ministral3` or
/// `mistral`), Qwen's (`qwen2_vl`, `qwen2_5_vl`: a `qwen2`; `qwen3_vl`: a `qwen3`;
/// [`qwen_vl_text`]; `qwen3_5`, `qwen3_5_moe`: their text models), LFM2-VL's (`lfm2_vl`: an
/// `lfm2`) — with the keys transformers reads at the top (`tie_word_embeddings`, the
/// token ids, `quantization_config`) taking their top-level values; `None` for any other
/// config.
pub fn vision_language_text(v: &Value) -> Result<Option<Value>> {
    let default = match v.get("model_type").and_then(Value::as_str) {
        Some("gemma3") => "gemma3_text",
        Some("mistral3") => "mistral",
        Some("gemma4") => "gemma4_text",
        Some("qwen3_5") => "qwen3_5_text",
        Some("qwen3_5_moe") => "qwen3_5_moe_text",
        Some("lfm2_vl") => "lfm2",
        Some(t @ ("qwen2_vl" | "qwen2_5_vl" | "qwen3_vl")) => return qwen_vl_text(v, t).map(Some),
        _ => return Ok(None),
    };
    let Some(Value::Object(text)) = v.get("text_config") else {
        bail!(
            "field `text_config` is missing or not an object: a vision-language `{}` config names its language model (a `{default}`) there",
            v["model_type"].as_str().unwrap_or_default()
        );
    };
    let mut text = text.clone();
    text.entry("model_type")
        .or_insert_with(|| Value::String(default.into()));
    // transformers writes a sub-config's values that equal its class's defaults not at all
    // (gemma-3-4b-it's `text_config` names six fields): the class's defaults for the sizes.
    let sizes: &[(&str, u64)] = match text["model_type"].as_str() {
        Some("gemma3_text") => &[
            ("vocab_size", 262_208),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 26),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
        ],
        Some("gemma4_text") => &[
            ("vocab_size", 262_144),
            ("hidden_size", 2304),
            ("intermediate_size", 9216),
            ("num_hidden_layers", 30),
            ("num_attention_heads", 8),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
        ],
        Some("ministral3") => &[
            ("vocab_size", 131_072),
            ("hidden_size", 4096),
            ("intermediate_size", 14_336),
            ("num_hidden_layers", 34),
            ("num_attention_heads", 32),
            ("num_key_value_heads", 8),
            ("head_dim", 128),
        ],
        Some("qwen3_5_text") => &[
            ("vocab_size", 248_320),
            ("hidden_size", 4096),
            ("intermediate_size", 12_288),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 16),
            ("num_key_value_heads", 4),
            ("head_dim", 256),
        ],
        // (No dense width: every layer has experts.)
        Some("qwen3_5_moe_text") => &[
            ("vocab_size", 248_320),
            ("hidden_size", 2048),
            ("num_hidden_layers", 40),
            ("num_attention_heads", 16),
            ("num_key_value_heads", 2),
            ("head_dim", 256),
        ],
        Some("lfm2") => &[
            ("vocab_size", 65_536),
            ("hidden_size", 2560),
            ("intermediate_size", 12_288),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 32),
            ("num_key_value_heads", 8),
        ],
        // MistralConfig's (its `head_dim` defaults to hidden / heads).
        _ => &[
            ("vocab_size", 32_000),
            ("hidden_size", 4096),
            ("intermediate_size", 14_336),
            ("num_hidden_layers", 32),
            ("num_attention_heads", 32),
            ("num_key_value_heads", 8),
        ],
    };
    for (k, x) in sizes {
        text.entry(*k).or_insert_with(|| (*x).into());
    }
    take_top_level(v, &mut text);
    Ok(Some(Value::Object(text)))
}

/// The keys transformers reads at the top of a vision-language config (`tie_word_embeddings`,
/// the token ids, `quantization_config`), set into its language model's `text` where given.
fn take_top_level(v: &Value, text: &mut serde_json::Map<String, Value>) {
    for k in [
        "tie_word_embeddings",
        "eos_token_id",
        "bos_token_id",
        "pad_token_id",
        "quantization_config",
    ] {
        if let Some(x) = v.get(k).filter(|x| !x.is_null()) {
            text.insert(k.into(), x.clone());
        }
    }
}

/// The language model of Qwen's vision-language configs: `qwen2_vl` / `qwen2_5_vl`
/// (Qwen2-VL, Qwen2.5-VL: a `qwen2`, its fields at the top in the released configs, in
/// `text_config` as transformers 5 writes them) and `qwen3_vl` (Qwen3-VL: a `qwen3` in
/// `text_config`). Their multimodal RoPE (`mrope_section`, interleaved or not) turns a text
/// token by its position on each of its three axes alike — plain RoPE, as read here (images
/// are not). The class defaults transformers gives an unwritten field are filled in.
pub fn qwen_vl_text(v: &Value, model_type: &str) -> Result<Value> {
    let family = match model_type {
        "qwen3_vl" => "qwen3",
        _ => "qwen2",
    };
    let mut text = match v.get("text_config") {
        Some(Value::Object(t)) => t.clone(),
        // Qwen2-VL's and Qwen2.5-VL's released configs: the language model's fields at the top.
        None | Some(Value::Null) if family == "qwen2" => {
            let mut t = v.as_object().cloned().unwrap_or_default();
            t.remove("vision_config");
            t
        }
        _ => bail!(
            "field `text_config` is missing or not an object: a vision-language `{model_type}` config names its language model (a `{family}`) there"
        ),
    };
    text.insert("model_type".into(), family.into());
    // The class defaults of the sizes and the RoPE base (Qwen2_5_VLTextConfig's,
    // Qwen3VLTextConfig's).
    let defaults: &[(&str, Value)] = match family {
        "qwen3" => &[
            ("vocab_size", Value::from(151_936)),
            ("hidden_size", Value::from(4096)),
            ("intermediate_size", Value::from(22_016)),
            ("num_hidden_layers", Value::from(32)),
            ("num_attention_heads", Value::from(32)),
            ("num_key_value_heads", Value::from(32)),
            ("head_dim", Value::from(128)),
            ("max_position_embeddings", Value::from(128_000)),
        ],
        _ => &[
            ("vocab_size", Value::from(152_064)),
            ("hidden_size", Value::from(8192)),
            ("intermediate_size", Value::from(29_568)),
            ("num_hidden_layers", Value::from(80)),
            ("num_attention_heads", Value::from(64)),
            ("num_key_value_heads", Value::from(8)),
            ("max_position_embeddings", Value::from(32_768)),
        ],
    };
    for (k, x) in defaults {
        text.entry(*k).or_insert_with(|| x.clone());
    }
    let theta_default = match family {
        "qwen3" => 5_000_000.0,
        _ => 1_000_000.0,
    };
    // mrope's keys taken out: what remains is the RoPE of every text position.
    let mut theta = text.get("rope_theta").and_then(Value::as_f64);
    for key in ["rope_scaling", "rope_parameters"] {
        let Some(Value::Object(r)) = text.get_mut(key) else {
            continue;
        };
        let mrope = r.remove("mrope_section").is_some()
            | r.remove("mrope_interleaved").is_some()
            | (r.get("type").and_then(Value::as_str) == Some("mrope"));
        if r.get("type").and_then(Value::as_str) == Some("mrope") {
            r.remove("type");
        }
        if let Some(t) = r.get("rope_theta").and_then(Value::as_f64) {
            theta = Some(t);
        }
        let kind = r
            .get("rope_type")
            .and_then(Value::as_str)
            .unwrap_or("default");
        if mrope && kind == "default" {
            text.remove(key);
        }
    }
    text.insert("rope_theta".into(), theta.unwrap_or(theta_default).into());
    take_top_level(v, &mut text);
    Ok(Value::Object(text))
}

impl ModelConfig {
    /// Reads `config.json` from a Hugging Face model directory.
    pub fn from_hf_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            candle_core::Error::msg(format!("{}: invalid JSON: {e}", path.display()))
        })?;
        Self::from_hf_json(&v)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))
    }

    /// Parses the JSON of a Hugging Face `config.json` (transformers 4.x and 5.x layouts); a
    /// vision-language checkpoint's gives its language model's ([`vision_language_text`]).
    pub fn from_hf_json(v: &Value) -> Result<Self> {
        if let Some(text) = vision_language_text(v)? {
            return Self::from_hf_json(&text);
        }
        let model_type = v
            .get("model_type")
            .and_then(Value::as_str)
            .ok_or_else(|| candle_core::Error::msg("field `model_type` is missing"))?;
        let arch = Arch::parse(model_type)?;
        // Quantized checkpoints: gpt-oss's MXFP4 experts are dequantized on load
        // ([`crate::layout::dequantize_mxfp4`]); other methods' packed weights are refused.
        if let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) {
            let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
            // Fine-grained FP8 (DeepSeek-V3's, the Qwen3 and Ministral 3 FP8 uploads):
            // dequantized on load ([`crate::layout::dequantize_fp8`]).
            if !(arch == Arch::GptOss && method == "mxfp4") && method != "fp8" {
                bail!(
                    "quantization_config.quant_method `{method}` is not supported for {model_type}: load the model's unquantized weights (fp8 and gpt_oss's mxfp4 experts are read, dequantized)"
                );
            }
        }
        let req = |k: &str| -> Result<usize> {
            v.get(k)
                .and_then(Value::as_u64)
                .map(|x| x as usize)
                .ok_or_else(|| {
                    candle_core::Error::msg(format!("field `{k}` is missing or not an integer"))
                })
        };
        let hidden_size = req("hidden_size")?;
        let num_attention_heads = req("num_attention_heads")?;
        let num_key_value_heads = v
            .get("num_key_value_heads")
            .and_then(Value::as_u64)
            .map(|x| x as usize)
            .unwrap_or(num_attention_heads);
        // DeepSeek's latent attention: every head has its key and value.
        let mla = match arch.mla() {
            true => Some(MlaConfig::from_hf_json(v, arch)?),
            false => None,
        };
        if mla.is_some() && num_key_value_heads != num_attention_heads {
            bail!(
                "num_key_value_heads = {num_key_value_heads} is not supported for {model_type} (its latent attention gives each of the {num_attention_heads} heads its key and value)"
            );
        }
        let head_dim = mla
            .map(|m| m.qk_head_dim())
            .or_else(|| {
                v.get("head_dim")
                    .and_then(Value::as_u64)
                    .map(|x| x as usize)
            })
            // transformers' defaults: Qwen3Config's 128, else hidden / heads.
            .unwrap_or(match arch {
                Arch::Qwen3
                | Arch::Ernie45
                | Arch::Glm
                | Arch::Glm4
                | Arch::SeedOss
                | Arch::Ministral3 => 128,
                // Qwen3-MoE's has no default of its own: hidden / heads, as for the others.
                Arch::Gemma2 | Arch::Gemma3 | Arch::Gemma4 => 256,
                Arch::GptOss => 64,
                _ => hidden_size / num_attention_heads.max(1),
            });
        // transformers 5 moved rope_theta / rope_scaling into `rope_parameters`; Gemma 3's
        // and OLMo 3's hold one set per layer type (`full_attention`, `sliding_attention`).
        let mut rope_params = v.get("rope_parameters").filter(|p| !p.is_null());
        let mut local_params = None;
        // Gemma 4: the sliding layers' RoPE is the model's; the full layers' is read with the
        // rest of its fields ([`crate::gemma4::Gemma4Config`]).
        if arch == Arch::Gemma4
            && let Some(p) = rope_params
        {
            rope_params = p.get("sliding_attention");
            if let Some(kind) = rope_params
                .and_then(|p| p.get("rope_type"))
                .and_then(Value::as_str)
                .filter(|k| *k != "default")
            {
                bail!(
                    "rope_parameters.sliding_attention.rope_type `{kind}` is not supported (only default)"
                );
            }
            if let Some(s) = v.get("rope_scaling").filter(|s| !s.is_null()) {
                bail!(
                    "rope_scaling = {s} is not supported for gemma4_text (its RoPE parameters are per layer type, in rope_parameters)"
                );
            }
        }
        if arch.local_rope()
            && let Some(p) = rope_params
            && p.get("full_attention").is_some()
        {
            (rope_params, local_params) = (p.get("full_attention"), p.get("sliding_attention"));
        }
        let rope_theta = v
            .get("rope_theta")
            .or_else(|| rope_params.and_then(|p| p.get("rope_theta")))
            .and_then(Value::as_f64)
            // transformers' `default_theta` (SmolLM3Config's 2e6, Gemma 3's 1e6, else 10000).
            .unwrap_or(match arch {
                Arch::SmolLM3 => 2_000_000.0,
                Arch::Gemma3 | Arch::Mixtral | Arch::Ministral3 | Arch::Lfm2 | Arch::Lfm2Moe => {
                    1_000_000.0
                }
                Arch::Ernie45 | Arch::Olmo3 => 500_000.0,
                Arch::GptOss => 150_000.0,
                _ => 10_000.0,
            });
        // The sliding layers' own RoPE is unscaled (Gemma 3, OLMo 3).
        if arch.local_rope()
            && let Some(kind) = local_params
                .and_then(|p| p.get("rope_type"))
                .and_then(Value::as_str)
                .filter(|k| *k != "default")
        {
            bail!(
                "rope_parameters.sliding_attention.rope_type `{kind}` is not supported (only default)"
            );
        }
        // Gemma 3's sliding-window layers: their own base (`rope_local_base_freq`), unscaled.
        let local_rope_theta = match arch {
            Arch::Gemma3 => Some(
                v.get("rope_local_base_freq")
                    .or_else(|| local_params.and_then(|p| p.get("rope_theta")))
                    .and_then(Value::as_f64)
                    .unwrap_or(10_000.0),
            ),
            // OLMo 3's sliding layers: their own base; without one, transformers 5 gives them
            // Olmo3Config's default 500000, whatever the top-level `rope_theta` (which it spends
            // on the global layers).
            Arch::Olmo3 => Some(
                local_params
                    .and_then(|p| p.get("rope_theta"))
                    .and_then(Value::as_f64)
                    .unwrap_or(500_000.0),
            ),
            _ => None,
        };
        let max_position_embeddings = v
            .get("max_position_embeddings")
            .and_then(Value::as_u64)
            // transformers' defaults per architecture.
            .unwrap_or(match arch {
                Arch::Llama
                | Arch::Olmo2
                | Arch::Olmo3
                | Arch::Granite
                | Arch::GraniteMoe
                | Arch::Exaone4
                | Arch::HunyuanDense => 2048,
                Arch::Arcee => 4096,
                Arch::NanoChat => 2048,
                Arch::Phi3 | Arch::Olmoe => 4096,
                Arch::Qwen2
                | Arch::Qwen3
                | Arch::SmolLM3
                | Arch::Qwen3Moe
                | Arch::Qwen2Moe
                | Arch::Qwen3_5
                | Arch::Qwen3_5Moe => 32768,
                Arch::Mistral | Arch::Gemma3 | Arch::Mixtral | Arch::Gemma4 => 4096 * 32,
                Arch::Ministral3 => 262_144,
                Arch::Ernie45 | Arch::GptOss | Arch::Glm | Arch::Glm4 | Arch::Glm4Moe => 131_072,
                Arch::DeepseekV3 => 4096,
                Arch::DeepseekV2 => 2048,
                Arch::Glm4MoeLite => 202_752,
                Arch::Gemma2 => 8192,
                Arch::SeedOss => 524_288,
                Arch::Lfm2 | Arch::Lfm2Moe => 128_000,
            }) as usize;
        let mut rope_dict = v
            .get("rope_scaling")
            .filter(|s| !s.is_null())
            .or(rope_params)
            .cloned();
        // gpt-oss's default RoPE is YaRN (GptOssConfig's `rope_parameters`).
        if arch == Arch::GptOss && rope_dict.is_none() {
            rope_dict = Some(serde_json::json!({
                "rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
                "truncate": false, "original_max_position_embeddings": 4096
            }));
        }
        // Ministral 3's default is YaRN with its attention temperature (Ministral3Config's).
        if arch == Arch::Ministral3 && rope_dict.is_none() {
            rope_dict = Some(serde_json::json!({
                "rope_type": "yarn", "factor": 16.0, "original_max_position_embeddings": 16384,
                "beta_fast": 32.0, "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                "llama_4_scaling_beta": 0.1
            }));
        }
        // Phi-3's pre-training length is a top-level field (default 4096) that transformers
        // puts into the RoPE parameters over theirs.
        if arch == Arch::Phi3
            && let Some(Value::Object(o)) = rope_dict.as_mut()
        {
            let original = v
                .get("original_max_position_embeddings")
                .and_then(Value::as_u64)
                .unwrap_or(4096);
            o.insert("original_max_position_embeddings".into(), original.into());
        }
        // Hunyuan's fixed NTK `alpha` (labelled `dynamic`): the base times
        // `alpha^(head_dim / (head_dim − 2))`, the same at every length (transformers'
        // `ntk_alpha`): read as that base.
        let mut rope_theta = rope_theta;
        if arch == Arch::HunyuanDense
            && let Some(alpha) = rope_dict
                .as_ref()
                .and_then(|d| d.get("alpha"))
                .and_then(Value::as_f64)
                .filter(|a| *a != 0.0)
        {
            let d = head_dim as f64;
            rope_theta *= alpha.powf(d / (d - 2.0));
            rope_dict = None;
        }
        let mut rope_scaling = match &rope_dict {
            Some(s) => RopeScaling::from_hf_json(s, max_position_embeddings)?,
            None => None,
        };
        // Only Ministral 3's attention reads `llama_4_scaling_beta`, which it requires (with the
        // pre-training length of YaRN's parameters).
        match rope_scaling.as_mut() {
            Some(RopeScaling::Yarn(y)) if arch != Arch::Ministral3 => y.llama_4_scaling_beta = None,
            Some(RopeScaling::Yarn(_)) => {}
            _ if arch == Arch::Ministral3 => bail!(
                "ministral3 with rope_parameters.rope_type other than yarn is not supported (its attention reads llama_4_scaling_beta and original_max_position_embeddings from YaRN's parameters)"
            ),
            _ => {}
        }
        // Partial rotary embeddings: a top-level `partial_rotary_factor` (transformers 4's Phi-3
        // configs) or one in the RoPE parameters (transformers 5).
        let partial_rotary_factor = v
            .get("partial_rotary_factor")
            .or_else(|| {
                rope_dict
                    .as_ref()
                    .and_then(|d| d.get("partial_rotary_factor"))
            })
            .and_then(Value::as_f64)
            // GLM's default: half of each head rotates; Qwen3.5's a quarter.
            .or((arch.glm() || arch == Arch::Glm4Moe).then_some(0.5))
            .or(arch.qwen3_5().then_some(0.25))
            .filter(|p| *p != 1.0);
        if let Some(p) = partial_rotary_factor
            && !(arch == Arch::Phi3 || arch.glm() || arch == Arch::Glm4Moe || arch.qwen3_5())
        {
            bail!(
                "partial_rotary_factor = {p} is not supported for {model_type} (only phi3's, glm's, glm4's, glm4_moe's and Qwen3.5's)"
            );
        }
        let flag = |k: &str, default: bool| v.get(k).and_then(Value::as_bool).unwrap_or(default);
        // What these architectures may switch that the model does not implement: refused by
        // name rather than computed differently from transformers.
        let act_key = match v.get("hidden_activation").filter(|x| !x.is_null()) {
            Some(_) => "hidden_activation",
            None => "hidden_act",
        };
        let num = |k: &str, default: f64| -> Result<f64> {
            match v.get(k) {
                None | Some(Value::Null) => Ok(default),
                Some(x) => x.as_f64().ok_or_else(|| {
                    candle_core::Error::msg(format!("field `{k}` must be a number, not {x}"))
                }),
            }
        };
        let activation = match v.get(act_key).and_then(Value::as_str) {
            // gpt-oss's experts ignore `hidden_act`: their SwiGLU is clamped.
            _ if arch == Arch::GptOss => Activation::ClampedSwiglu {
                alpha: num("swiglu_alpha", 1.702)?,
                limit: num("swiglu_limit", 7.0)?,
            },
            None if arch.gemma() || arch == Arch::Gemma4 => Activation::GeluPytorchTanh,
            None if matches!(arch, Arch::Arcee | Arch::NanoChat) => Activation::Relu2,
            None | Some("silu" | "swish") => Activation::Silu,
            Some("gelu_pytorch_tanh") => Activation::GeluPytorchTanh,
            Some("relu2") => Activation::Relu2,
            Some(act) => bail!(
                "{act_key} `{act}` is not supported (the MLP takes silu, gelu_pytorch_tanh or relu2)"
            ),
        };
        // Gemma 2's soft-capping (transformers' defaults 50 and 30; null switches it off),
        // nanochat's of the logits (default 15); elsewhere refused by name.
        let softcap = |k: &str, default: f64| -> Result<Option<f64>> {
            let capped =
                arch == Arch::Gemma2 || (arch == Arch::NanoChat && k == "final_logit_softcapping");
            // Gemma 4's logits: capped where the config says so (default none).
            let gemma4 = arch == Arch::Gemma4 && k == "final_logit_softcapping";
            match (capped || gemma4, v.get(k)) {
                (true, None) if gemma4 => Ok(None),
                (true, None) => Ok(Some(default)),
                (_, None | Some(Value::Null)) => Ok(None),
                (true, Some(x)) => match x.as_f64().filter(|c| *c > 0.0) {
                    Some(c) => Ok(Some(c)),
                    None => bail!("field `{k}` must be a positive number or null, not {x}"),
                },
                (_, Some(x)) => {
                    bail!(
                        "{k} = {x} is not supported for {model_type} (Gemma 2's, Gemma 4's and nanochat's soft-capping)"
                    )
                }
            }
        };
        let attn_logit_softcapping = softcap("attn_logit_softcapping", 50.0)?;
        let final_logit_softcapping = softcap(
            "final_logit_softcapping",
            if arch == Arch::NanoChat { 15.0 } else { 30.0 },
        )?;
        if let Some(c) = v.get("clip_qkv").filter(|c| !c.is_null()) {
            bail!("clip_qkv = {c} is not supported (only null: q, k and v unclipped)");
        }
        if arch == Arch::DeepseekV2 && flag("mlp_bias", false) {
            bail!(
                "mlp_bias = true is not supported for deepseek_v2 (biased dense and shared-expert MLPs)"
            );
        }
        if flag("use_bidirectional_attention", false) {
            bail!("use_bidirectional_attention = true is not supported (a causal language model)");
        }
        let num_hidden_layers = req("num_hidden_layers")?;
        // SmolLM3's NoPE layers: `no_rope_layers` (1 = RoPE) or every
        // `no_rope_layer_interval`-th layer (default 4), as transformers fills them in.
        let mut nope_layers: Vec<usize> = match arch {
            Arch::SmolLM3 => match v.get("no_rope_layers").filter(|x| !x.is_null()) {
                Some(list) => {
                    let list = list.as_array().filter(|a| a.len() >= num_hidden_layers);
                    let Some(list) = list else {
                        bail!(
                            "field `no_rope_layers` must list 0 or 1 for each of the {num_hidden_layers} layers"
                        );
                    };
                    let mut out = Vec::new();
                    for (i, x) in list.iter().take(num_hidden_layers).enumerate() {
                        match x.as_u64() {
                            Some(0) => out.push(i),
                            Some(1) => {}
                            _ => bail!("field `no_rope_layers[{i}]` must be 0 or 1, not {x}"),
                        }
                    }
                    out
                }
                None => {
                    let every = v
                        .get("no_rope_layer_interval")
                        .and_then(Value::as_u64)
                        .unwrap_or(4) as usize;
                    if every == 0 {
                        bail!("field `no_rope_layer_interval` must be > 0");
                    }
                    nope_every(num_hidden_layers, every)
                }
            },
            _ => Vec::new(),
        };
        // Sliding-window attention, where the config switches it on: Mistral's `sliding_window`
        // (every layer, default 4096, null = none); Qwen2/Qwen3's and SmolLM3's with
        // `use_sliding_window`, on the layers `layer_types` names (else Qwen's from
        // `max_window_layers` on, SmolLM3's NoPE layers).
        let qwen_like = matches!(arch.attention(), Arch::Qwen2 | Arch::Qwen3 | Arch::SmolLM3);
        let window = match v.get("sliding_window") {
            // Qwen2-MoE's configs write 0 when `use_sliding_window` is off.
            Some(w) if qwen_like && w.as_u64() == Some(0) && !flag("use_sliding_window", false) => {
                None
            }
            Some(Value::Null) => None,
            Some(w) => Some(w.as_u64().filter(|w| *w > 0).ok_or_else(|| {
                candle_core::Error::msg(format!(
                    "field `sliding_window` must be a positive integer or null, not {w}"
                ))
            })? as usize),
            None if matches!(
                arch,
                Arch::Mistral | Arch::Gemma2 | Arch::Gemma3 | Arch::Exaone4 | Arch::Olmo3
            ) =>
            {
                Some(4096)
            }
            None if arch == Arch::Gemma4 => Some(512),
            None if arch == Arch::GptOss => Some(128),
            // Mixtral's default is none.
            None => None,
        };
        // The layers `layer_types` names sliding, where it is given.
        let listed: Option<Vec<usize>> = v.get("layer_types").and_then(Value::as_array).map(|t| {
            (0..num_hidden_layers)
                .filter(|i| t.get(*i).and_then(Value::as_str) == Some("sliding_attention"))
                .collect()
        });
        let sliding_layers: Vec<usize> = match arch {
            // A stray `sliding_window` is ignored, as transformers ignores it.
            a if a.windowless() => Vec::new(),
            // Qwen3-MoE's window (when switched on) is on every layer.
            Arch::Mistral | Arch::Ministral3 | Arch::Phi3 | Arch::Mixtral | Arch::Qwen3Moe => {
                (0..num_hidden_layers).collect()
            }
            // OLMo 3: `layer_types`, else every layer but each 4th.
            Arch::Olmo3 => listed.unwrap_or_else(|| {
                (0..num_hidden_layers)
                    .filter(|i| !(i + 1).is_multiple_of(4))
                    .collect()
            }),
            // Gemma 3: `layer_types`, else every layer but each `sliding_window_pattern`-th (6).
            Arch::Gemma3 => match listed {
                Some(t) => t,
                None => {
                    let every = v
                        .get("sliding_window_pattern")
                        .and_then(Value::as_u64)
                        .unwrap_or(6) as usize;
                    (0..num_hidden_layers)
                        .filter(|i| every == 0 || !(i + 1).is_multiple_of(every))
                        .collect()
                }
            },
            // Gemma 4: `layer_types`, else every layer but each 6th; the last layer is always
            // full (transformers forces it).
            Arch::Gemma4 => {
                let mut t = listed.unwrap_or_else(|| {
                    (0..num_hidden_layers)
                        .filter(|i| !(i + 1).is_multiple_of(6))
                        .collect()
                });
                t.retain(|i| i + 1 != num_hidden_layers);
                t
            }
            // EXAONE 4: `layer_types`, else `sliding_window_pattern`.
            Arch::Exaone4 => match listed {
                Some(t) => t,
                None => exaone_sliding_layers(v.get("sliding_window_pattern"), num_hidden_layers)?,
            },
            // Gemma 2 and gpt-oss: `layer_types`, else every other layer from the first.
            Arch::Gemma2 | Arch::GptOss => {
                listed.unwrap_or_else(|| (0..num_hidden_layers).step_by(2).collect())
            }
            _ if qwen_like && !flag("use_sliding_window", false) => Vec::new(),
            _ => match listed {
                Some(t) => t,
                None if arch == Arch::SmolLM3 => nope_layers.clone(),
                None => {
                    let from = v
                        .get("max_window_layers")
                        .and_then(Value::as_u64)
                        .unwrap_or(28) as usize;
                    (from.min(num_hidden_layers)..num_hidden_layers).collect()
                }
            },
        };
        // EXAONE 4 with a window: its global layers without RoPE.
        if arch == Arch::Exaone4 && window.is_some() {
            nope_layers = (0..num_hidden_layers)
                .filter(|i| !sliding_layers.contains(i))
                .collect();
        }
        if (arch.gemma() || matches!(arch, Arch::Olmo3 | Arch::Gemma4)) && window.is_none() {
            bail!(
                "sliding_window = null is not supported for {model_type} (its sliding layers come with the window)"
            );
        }
        let (sliding_window, sliding_layers) = match window {
            Some(w) if !sliding_layers.is_empty() => {
                let all = sliding_layers.len() == num_hidden_layers;
                (Some(w), if all { Vec::new() } else { sliding_layers })
            }
            _ => (None, Vec::new()),
        };
        let gemma4 = match arch {
            Arch::Gemma4 => {
                let full: Vec<usize> = (0..num_hidden_layers)
                    .filter(|i| !sliding_layers.contains(i))
                    .collect();
                Some(crate::gemma4::Gemma4Config::from_hf_json(
                    v,
                    num_hidden_layers,
                    &full,
                    head_dim,
                    num_key_value_heads,
                )?)
            }
            _ => None,
        };
        // Qwen3.5's MoE config has no dense width (every layer sparse): the experts'.
        let intermediate_size = match (arch, v.get("intermediate_size")) {
            (Arch::Qwen3_5Moe, None | Some(Value::Null)) => v
                .get("moe_intermediate_size")
                .and_then(Value::as_u64)
                .map_or(512, |x| x as usize),
            (Arch::Lfm2, _) => lfm2_mlp_width(v)?,
            _ => req("intermediate_size")?,
        };
        let cfg = ModelConfig {
            arch,
            vocab_size: req("vocab_size")?,
            hidden_size,
            intermediate_size,
            num_hidden_layers,
            num_attention_heads,
            num_key_value_heads,
            head_dim,
            // (LFM2's is `norm_eps`.)
            rms_norm_eps: v
                .get(match arch.lfm2() {
                    true => "norm_eps",
                    false => "rms_norm_eps",
                })
                .and_then(Value::as_f64)
                // transformers' defaults: OLMo's, Phi3Config's, Mixtral's 1e-5, the others' 1e-6.
                .unwrap_or(match arch {
                    Arch::Olmo2
                    | Arch::Olmo3
                    | Arch::Olmoe
                    | Arch::Phi3
                    | Arch::Mixtral
                    | Arch::Ministral3
                    | Arch::Ernie45
                    | Arch::Exaone4
                    | Arch::GptOss
                    | Arch::Arcee
                    | Arch::Glm4Moe
                    | Arch::Glm4MoeLite
                    | Arch::Lfm2
                    | Arch::Lfm2Moe => 1e-5,
                    // GlmConfig's and Glm4Config's.
                    Arch::Glm | Arch::Glm4 => 1.5625e-7,
                    _ => 1e-6,
                }),
            rope_theta,
            rope_scaling,
            max_position_embeddings,
            // transformers' defaults: SmolLM3Config, the Gemma configs and Lfm2Config tie (LFM2's
            // older configs as `tie_embedding`), the others do not.
            tie_word_embeddings: v
                .get("tie_word_embeddings")
                .or(v.get("tie_embedding").filter(|_| arch.lfm2()))
                .and_then(Value::as_bool)
                .unwrap_or(matches!(
                    arch,
                    Arch::SmolLM3
                        | Arch::Gemma2
                        | Arch::Gemma3
                        | Arch::Gemma4
                        | Arch::Ernie45
                        | Arch::Lfm2
                        | Arch::Lfm2Moe
                )),
            attention_bias: match arch {
                Arch::Qwen2 => true,
                // transformers 5's Qwen2-MoE names it `qkv_bias` (4's always has them).
                Arch::Qwen2Moe => flag("qkv_bias", true),
                // (LFM2's attention has no biases: `conv_bias` is its convolutions'.)
                Arch::Mistral
                | Arch::Ministral3
                | Arch::Phi3
                | Arch::Mixtral
                | Arch::Exaone4
                | Arch::Lfm2
                | Arch::Lfm2Moe => false,
                // ERNIE 4.5's `use_bias`: every projection's.
                Arch::Ernie45 => flag("use_bias", false),
                // gpt-oss's default biases q, k, v and o; GLM's and Seed-OSS's q, k and v.
                Arch::GptOss | Arch::Glm | Arch::Glm4 | Arch::SeedOss => {
                    flag("attention_bias", true)
                }
                Arch::Llama
                | Arch::Granite
                | Arch::GraniteMoe
                | Arch::Qwen3
                | Arch::Qwen3Moe
                | Arch::SmolLM3
                | Arch::Gemma2
                | Arch::Gemma3
                | Arch::Gemma4
                | Arch::Olmo2
                | Arch::Olmo3
                | Arch::Olmoe
                | Arch::Arcee
                | Arch::Glm4Moe
                | Arch::DeepseekV3
                | Arch::Glm4MoeLite
                | Arch::DeepseekV2
                | Arch::NanoChat
                | Arch::HunyuanDense
                | Arch::Qwen3_5
                | Arch::Qwen3_5Moe => flag("attention_bias", false),
            },
            mlp_bias: match arch {
                Arch::Ernie45 => flag("use_bias", false),
                _ => {
                    matches!(
                        arch,
                        Arch::Llama | Arch::Granite | Arch::SmolLM3 | Arch::SeedOss | Arch::Arcee
                    ) && flag("mlp_bias", false)
                }
            },
            attention_out_bias: arch == Arch::SeedOss && flag("attention_out_bias", false),
            use_qk_norm: arch == Arch::Glm4Moe && flag("use_qk_norm", false),
            granite: match arch {
                Arch::Granite | Arch::GraniteMoe => {
                    let m = |k: &str| -> Result<f64> {
                        match v.get(k) {
                            None | Some(Value::Null) => Ok(1.0),
                            Some(x) => x.as_f64().ok_or_else(|| {
                                candle_core::Error::msg(format!(
                                    "field `{k}` must be a number, not {x}"
                                ))
                            }),
                        }
                    };
                    Some(GraniteScalars {
                        embedding_multiplier: m("embedding_multiplier")?,
                        attention_multiplier: m("attention_multiplier")?,
                        residual_multiplier: m("residual_multiplier")?,
                        logits_scaling: m("logits_scaling")?,
                    })
                }
                _ => None,
            },
            bos_token_id: ids(v.get("bos_token_id")).first().copied(),
            eos_token_ids: ids(v.get("eos_token_id")),
            pad_token_id: ids(v.get("pad_token_id")).first().copied(),
            sequence_classification: v
                .get("architectures")
                .and_then(Value::as_array)
                .is_some_and(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .any(|a| a.ends_with("ForSequenceClassification"))
                }),
            token_classification: v
                .get("architectures")
                .and_then(Value::as_array)
                .is_some_and(|a| {
                    a.iter()
                        .filter_map(Value::as_str)
                        .any(|a| a.ends_with("ForTokenClassification"))
                })
                .then(|| {
                    // transformers saves `id2label`; `num_labels` where a config spells it.
                    v.get("id2label")
                        .and_then(Value::as_object)
                        .map(|m| m.len())
                        .or_else(|| {
                            v.get("num_labels")
                                .and_then(Value::as_u64)
                                .map(|n| n as usize)
                        })
                        .unwrap_or(2)
                }),
            initializer_range: v.get("initializer_range").and_then(Value::as_f64),
            sliding_window,
            sliding_layers,
            nope_layers,
            activation,
            query_pre_attn_scalar: match arch {
                Arch::Gemma2 | Arch::Gemma3 => Some(
                    v.get("query_pre_attn_scalar")
                        .and_then(Value::as_f64)
                        .unwrap_or(256.0),
                ),
                // Gemma 4's scores are unscaled (its q and k are normalised).
                Arch::Gemma4 => Some(1.0),
                _ => None,
            },
            local_rope_theta,
            partial_rotary_factor,
            attn_logit_softcapping,
            final_logit_softcapping,
            moe: match arch.moe() {
                true => Some(MoeConfig::from_hf_json(v, arch, intermediate_size)?),
                false => None,
            },
            mla,
            gemma4,
            linear_attention: match arch.qwen3_5() {
                true => Some(crate::delta::DeltaConfig::from_hf_json(
                    v,
                    num_hidden_layers,
                )?),
                false => None,
            },
            short_conv: match arch.lfm2() {
                true => Some(crate::shortconv::ShortConvConfig::from_hf_json(
                    v,
                    num_hidden_layers,
                )?),
                false => None,
            },
        };
        cfg.validate()?;
        Ok(cfg)
    }

    /// Checks the shape arithmetic (heads divide evenly, sizes non-zero).
    pub fn validate(&self) -> Result<()> {
        if self.arch == Arch::Gemma4 && self.gemma4.is_none() {
            bail!("gemma4_text needs its Gemma 4 fields (ModelConfig::gemma4)");
        }
        if let Some(g) = &self.gemma4
            && !self.num_attention_heads.is_multiple_of(g.global_kv_heads)
        {
            bail!(
                "num_attention_heads = {} is not a multiple of the full layers' num_key_value_heads = {}",
                self.num_attention_heads,
                g.global_kv_heads
            );
        }
        if self.arch == Arch::Ministral3 && !matches!(self.rope_scaling, Some(RopeScaling::Yarn(_)))
        {
            bail!(
                "ministral3 needs YaRN RoPE parameters (its attention reads llama_4_scaling_beta and original_max_position_embeddings from them)"
            );
        }
        for (k, x) in [
            ("vocab_size", self.vocab_size),
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_hidden_layers", self.num_hidden_layers),
            ("num_attention_heads", self.num_attention_heads),
            ("num_key_value_heads", self.num_key_value_heads),
            ("head_dim", self.head_dim),
        ] {
            if x == 0 {
                bail!("config field `{k}` must be > 0");
            }
        }
        // ERNIE 4.5 has one `use_bias` for all its projections.
        if self.arch == Arch::Ernie45 && self.attention_bias != self.mlp_bias {
            bail!(
                "ernie4_5 has one use_bias for every projection: attention_bias ({}) and mlp_bias ({}) must agree",
                self.attention_bias,
                self.mlp_bias
            );
        }
        if self.arch == Arch::Ernie45 && self.partial_rotary_factor.is_some() {
            bail!(
                "partial_rotary_factor is not supported with {}'s interleaved RoPE",
                self.arch.as_str()
            );
        }
        if !self
            .num_attention_heads
            .is_multiple_of(self.num_key_value_heads)
        {
            bail!(
                "num_attention_heads ({}) must be a multiple of num_key_value_heads ({})",
                self.num_attention_heads,
                self.num_key_value_heads
            );
        }
        if !self.head_dim.is_multiple_of(2) {
            bail!("head_dim ({}) must be even for RoPE", self.head_dim);
        }
        if let Some(m) = &self.moe {
            m.validate(self.arch)?;
        }
        if let Some(m) = &self.mla {
            m.validate()?;
        }
        if let Some(m) = &self.moe
            && self.arch.experts_mlp_wide()
            && m.moe_intermediate_size != self.intermediate_size
        {
            bail!(
                "{}'s experts are intermediate_size ({}) wide, not {}",
                self.arch.as_str(),
                self.intermediate_size,
                m.moe_intermediate_size
            );
        }
        let r = self.rotary_dim();
        if let Some(p) = self.partial_rotary_factor
            && (r == 0 || !r.is_multiple_of(2) || r > self.head_dim)
        {
            bail!(
                "partial_rotary_factor = {p} rotates {r} of head_dim {} dimensions: it must be an even number from 2 to head_dim",
                self.head_dim
            );
        }
        if let Some(RopeScaling::LongRope(l)) = &self.rope_scaling {
            for (k, f) in [
                ("short_factor", &l.short_factor),
                ("long_factor", &l.long_factor),
            ] {
                if f.len() != r / 2 {
                    bail!(
                        "rope_scaling.{k} has {} values, expected {} (one per rotary frequency: head_dim × partial_rotary_factor / 2)",
                        f.len(),
                        r / 2
                    );
                }
            }
        }
        Ok(())
    }

    /// The Hugging Face `config.json` for this model (what transformers reads back).
    pub fn to_hf_json(&self) -> Value {
        let mut v = serde_json::json!({
            "architectures": [format!(
                "{}{}",
                match self.arch {
                    Arch::Llama => "Llama",
                    Arch::Qwen2 => "Qwen2",
                    Arch::Qwen3 => "Qwen3",
                    Arch::Mistral => "Mistral",
                    Arch::Ministral3 => "Ministral3",
                    Arch::SmolLM3 => "SmolLM3",
                    Arch::Gemma3 => "Gemma3",
                    Arch::Gemma2 => "Gemma2",
                    Arch::Olmo2 => "Olmo2",
                    Arch::Phi3 => "Phi3",
                    Arch::Granite => "Granite",
                    Arch::Qwen3Moe => "Qwen3Moe",
                    Arch::Qwen2Moe => "Qwen2Moe",
                    Arch::Mixtral => "Mixtral",
                    Arch::Olmoe => "Olmoe",
                    Arch::GraniteMoe => "GraniteMoe",
                    Arch::Ernie45 => "Ernie4_5",
                    Arch::Exaone4 => "Exaone4",
                    Arch::GptOss => "GptOss",
                    Arch::Glm => "Glm",
                    Arch::Glm4 => "Glm4",
                    Arch::Olmo3 => "Olmo3",
                    Arch::SeedOss => "SeedOss",
                    Arch::Arcee => "Arcee",
                    Arch::Glm4Moe => "Glm4Moe",
                    Arch::DeepseekV3 => "DeepseekV3",
                    Arch::Glm4MoeLite => "Glm4MoeLite",
                    Arch::DeepseekV2 => "DeepseekV2",
                    Arch::NanoChat => "NanoChat",
                    Arch::Gemma4 => "Gemma4",
                    Arch::HunyuanDense => "HunYuanDenseV1",
                    Arch::Qwen3_5 => "Qwen3_5",
                    Arch::Qwen3_5Moe => "Qwen3_5Moe",
                    Arch::Lfm2 => "Lfm2",
                    Arch::Lfm2Moe => "Lfm2Moe",
                },
                match (self.sequence_classification, self.token_classification) {
                    (true, _) => "ForSequenceClassification",
                    (false, Some(_)) => "ForTokenClassification",
                    (false, None) => "ForCausalLM",
                }
            )],
            "model_type": self.arch.as_str(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_hidden_layers,
            "num_attention_heads": self.num_attention_heads,
            "num_key_value_heads": self.num_key_value_heads,
            "head_dim": self.head_dim,
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
            "use_cache": true,
        });
        let obj = v.as_object_mut().expect("a JSON object");
        if self.arch == Arch::Qwen3_5Moe {
            obj.remove("intermediate_size");
        }
        match &self.rope_scaling {
            Some(s) => {
                obj.insert("rope_scaling".into(), s.to_hf_json());
            }
            // gpt-oss's default is YaRN: an unscaled RoPE is written as such.
            None if self.arch == Arch::GptOss => {
                let plain =
                    serde_json::json!({"rope_type": "default", "rope_theta": self.rope_theta});
                obj.insert("rope_scaling".into(), plain);
            }
            None => {}
        }
        if let Some(r) = self.initializer_range {
            obj.insert("initializer_range".into(), r.into());
        }
        if self.sequence_classification {
            // transformers' `num_labels = 1`, as its configs save it.
            obj.insert("id2label".into(), serde_json::json!({"0": "LABEL_0"}));
            obj.insert("label2id".into(), serde_json::json!({"LABEL_0": 0}));
        }
        if let Some(n) = self.token_classification {
            let id2label: serde_json::Map<String, Value> = (0..n)
                .map(|i| (i.to_string(), Value::from(format!("LABEL_{i}"))))
                .collect();
            let label2id: serde_json::Map<String, Value> = (0..n)
                .map(|i| (format!("LABEL_{i}"), Value::from(i)))
                .collect();
            obj.insert("id2label".into(), Value::Object(id2label));
            obj.insert("label2id".into(), Value::Object(label2id));
        }
        if matches!(
            self.arch,
            Arch::Llama
                | Arch::Granite
                | Arch::GraniteMoe
                | Arch::SmolLM3
                | Arch::Gemma2
                | Arch::Gemma3
                | Arch::Olmo2
                | Arch::Olmoe
                | Arch::GptOss
                | Arch::Glm
                | Arch::Glm4
                | Arch::Olmo3
                | Arch::SeedOss
                | Arch::Arcee
                | Arch::Glm4Moe
                | Arch::DeepseekV3
                | Arch::Glm4MoeLite
                | Arch::DeepseekV2
                | Arch::NanoChat
        ) {
            obj.insert("attention_bias".into(), self.attention_bias.into());
        }
        if let Some(m) = &self.mla {
            m.write(obj);
        }
        if self.arch == Arch::Glm4Moe {
            obj.insert("use_qk_norm".into(), self.use_qk_norm.into());
        }
        if matches!(
            self.arch,
            Arch::Llama | Arch::Granite | Arch::SmolLM3 | Arch::SeedOss | Arch::Arcee
        ) {
            obj.insert("mlp_bias".into(), self.mlp_bias.into());
        }
        if self.arch == Arch::SeedOss {
            obj.insert("attention_out_bias".into(), self.attention_out_bias.into());
            // The model has no dropout (README): written as such.
            obj.insert("attention_dropout".into(), 0.0.into());
            obj.insert("residual_dropout".into(), 0.0.into());
        }
        if self.arch == Arch::Ernie45 {
            obj.insert("use_bias".into(), self.attention_bias.into());
        }
        if let Some(m) = &self.moe {
            m.write(self.arch, obj, self.num_hidden_layers);
        }
        if self.arch == Arch::Qwen2Moe {
            obj.insert("qkv_bias".into(), self.attention_bias.into());
        }
        if let Some(g) = &self.granite {
            obj.insert("embedding_multiplier".into(), g.embedding_multiplier.into());
            obj.insert("attention_multiplier".into(), g.attention_multiplier.into());
            obj.insert("residual_multiplier".into(), g.residual_multiplier.into());
            obj.insert("logits_scaling".into(), g.logits_scaling.into());
        }
        let act = match self.activation {
            Activation::Silu => "silu",
            Activation::GeluPytorchTanh => "gelu_pytorch_tanh",
            Activation::Relu2 => "relu2",
            Activation::ClampedSwiglu { alpha, limit } => {
                obj.insert("swiglu_alpha".into(), alpha.into());
                obj.insert("swiglu_limit".into(), limit.into());
                "silu"
            }
        };
        obj.insert("hidden_act".into(), act.into());
        if self.arch.gemma() {
            obj.insert("hidden_activation".into(), act.into());
            // An integer in transformers' (strictly typed) Gemma configs.
            let scalar = self.query_pre_attn_scalar.unwrap_or(256.0);
            let scalar: Value = match scalar.fract() == 0.0 {
                true => (scalar as i64).into(),
                false => scalar.into(),
            };
            obj.insert("query_pre_attn_scalar".into(), scalar);
        }
        if self.arch == Arch::Gemma3 {
            obj.insert("rope_local_base_freq".into(), self.local_rope_theta.into());
        }
        if let Some(d) = &self.linear_attention {
            d.write_hf_json(obj, self.num_hidden_layers);
        }
        // LFM2's: its layers, its norms' epsilon as `norm_eps`, the MLP's width as it is.
        if self.arch.lfm2() {
            let none = crate::shortconv::ShortConvConfig {
                layers: Vec::new(),
                kernel: 3,
                bias: false,
            };
            let c = self.short_conv.as_ref().unwrap_or(&none);
            c.write_hf_json(obj, self.num_hidden_layers);
            if let Some(eps) = obj.remove("rms_norm_eps") {
                obj.insert("norm_eps".into(), eps);
            }
            if self.arch == Arch::Lfm2 {
                obj.insert("block_auto_adjust_ff_dim".into(), false.into());
            }
        }
        if let Some(g) = &self.gemma4 {
            obj.insert("hidden_activation".into(), act.into());
            let full: Vec<usize> = (0..self.num_hidden_layers)
                .filter(|i| !self.windowed(*i))
                .collect();
            g.write_hf_json(obj, &full, self.rope_theta);
            obj.insert(
                "final_logit_softcapping".into(),
                self.final_logit_softcapping.into(),
            );
        }
        // OLMo 3's RoPE per layer type: the global layers' scaled, the sliding ones' not.
        if self.arch == Arch::Olmo3 {
            let mut full = match obj.remove("rope_scaling") {
                Some(Value::Object(o)) => o,
                _ => serde_json::Map::from_iter([("rope_type".to_string(), "default".into())]),
            };
            full.insert("rope_theta".into(), self.rope_theta.into());
            let local = self.local_rope_theta.unwrap_or(self.rope_theta);
            obj.insert(
                "rope_parameters".into(),
                serde_json::json!({
                    "full_attention": full,
                    "sliding_attention": {"rope_type": "default", "rope_theta": local},
                }),
            );
        }
        if self.arch == Arch::NanoChat {
            obj.insert(
                "final_logit_softcapping".into(),
                self.final_logit_softcapping.into(),
            );
        }
        if self.arch == Arch::Gemma2 {
            obj.insert(
                "attn_logit_softcapping".into(),
                self.attn_logit_softcapping.into(),
            );
            obj.insert(
                "final_logit_softcapping".into(),
                self.final_logit_softcapping.into(),
            );
        }
        if self.arch == Arch::SmolLM3 {
            let rope: Vec<u32> = (0..self.num_hidden_layers)
                .map(|i| u32::from(self.uses_rope(i)))
                .collect();
            obj.insert("no_rope_layers".into(), rope.into());
        }
        if let Some(RopeScaling::LongRope(l)) = &self.rope_scaling {
            obj.insert(
                "original_max_position_embeddings".into(),
                l.original_max_position_embeddings.into(),
            );
        }
        match self.partial_rotary_factor {
            Some(p) => {
                obj.insert("partial_rotary_factor".into(), p.into());
            }
            // GLM's and GLM-4.5's default is half: every dimension rotating is written as such.
            None if self.arch.glm() || self.arch == Arch::Glm4Moe || self.arch.qwen3_5() => {
                obj.insert("partial_rotary_factor".into(), 1.0.into());
            }
            None => {}
        }
        match (self.arch, self.sliding_window) {
            (Arch::Mistral | Arch::Ministral3 | Arch::Phi3 | Arch::Mixtral, w) => {
                obj.insert("sliding_window".into(), w.into());
            }
            // EXAONE 4's and gpt-oss's default is a window: none is written as null, every
            // layer global.
            (Arch::Exaone4 | Arch::GptOss, None) => {
                obj.insert("sliding_window".into(), Value::Null);
                let types = vec!["full_attention"; self.num_hidden_layers];
                obj.insert("layer_types".into(), types.into());
            }
            (a, _) if a.windowless() => {}
            (_, None) => {}
            (arch, Some(w)) => {
                let types: Vec<&str> = (0..self.num_hidden_layers)
                    .map(|i| match self.windowed(i) {
                        true => "sliding_attention",
                        false => "full_attention",
                    })
                    .collect();
                // Gemma, EXAONE and gpt-oss always window their sliding layers; the others
                // switch it on.
                if !arch.gemma()
                    && !matches!(
                        arch,
                        Arch::Exaone4 | Arch::GptOss | Arch::Olmo3 | Arch::Gemma4
                    )
                {
                    obj.insert("use_sliding_window".into(), true.into());
                }
                obj.insert("sliding_window".into(), w.into());
                obj.insert("layer_types".into(), types.into());
            }
        }
        // `null` when there is none: transformers' defaults (1 for llama, 128000 for SmolLM3)
        // would name a token the model does not have.
        obj.insert("bos_token_id".into(), self.bos_token_id.into());
        match self.eos_token_ids.as_slice() {
            [] => {}
            [e] => {
                obj.insert("eos_token_id".into(), (*e).into());
            }
            many => {
                obj.insert("eos_token_id".into(), many.to_vec().into());
            }
        }
        if let Some(p) = self.pad_token_id {
            obj.insert("pad_token_id".into(), p.into());
        }
        v
    }

    /// The dimensions of each head that RoPE rotates: `head_dim`, or `head_dim ×
    /// partial_rotary_factor` (the first ones, in transformers' layout; the model keeps each
    /// head's dimensions reordered so its rotation pairs are `head_dim / 2` apart, see
    /// [`crate::layout`]).
    pub fn rotary_dim(&self) -> usize {
        if let Some(m) = &self.mla {
            return m.qk_rope_head_dim;
        }
        match self.partial_rotary_factor {
            Some(p) => (self.head_dim as f64 * p) as usize,
            None => self.head_dim,
        }
    }

    /// [`Self::num_parameters`] of a Gemma 4 model (its layers differ from one another).
    fn gemma4_parameters(&self) -> usize {
        let h = self.hidden_size;
        let n = self.num_hidden_layers;
        let bias = usize::from(self.attention_bias);
        let mut total = self.vocab_size * h + h;
        if !self.tie_word_embeddings {
            total += self.vocab_size * h;
        }
        let width = self.gemma4.as_ref().and_then(|g| g.per_layer_input);
        if let Some((vocab, w)) = width {
            total += vocab * n * w + n * w * h + w;
        }
        for i in 0..n {
            let (nkv, hd) = self.layer_heads(i);
            let (q, kv) = (self.num_attention_heads * hd, nkv * hd);
            // Four norms, q and o with q's norm, the MLP.
            total += 4 * h + 2 * q * h + hd + bias * (q + h);
            total += 3 * h * self.layer_intermediate(i);
            if self.kv_source(i).is_none() {
                total += kv * h + hd + bias * kv;
                if !self
                    .gemma4
                    .as_ref()
                    .is_some_and(|g| g.k_eq_v && !self.windowed(i))
                {
                    total += kv * h + bias * kv;
                }
            }
            if let Some((_, w)) = width {
                total += 2 * w * h + h;
            }
            if self.mlp_bias {
                total += 2 * self.layer_intermediate(i) + h;
            }
            if let Some(e) = self.gemma4.as_ref().and_then(|g| g.experts) {
                // Router (map, scale, per-expert scales), experts, three norms.
                total += e.num_experts * h + h + e.num_experts;
                total += e.num_experts * 3 * h * e.width + 3 * h;
            }
        }
        total
    }

    /// Layer `i`'s key/value heads and head width (Gemma 4's full layers have their own).
    pub fn layer_heads(&self, i: usize) -> (usize, usize) {
        match &self.gemma4 {
            Some(g) if !self.windowed(i) => (g.global_kv_heads, g.global_head_dim),
            _ => (self.num_key_value_heads, self.head_dim),
        }
    }

    /// The layer whose keys and values layer `i` attends over instead of its own (Gemma 4's
    /// `num_kv_shared_layers`).
    pub fn kv_source(&self, i: usize) -> Option<usize> {
        let g = self.gemma4.as_ref()?;
        let n = self.num_hidden_layers;
        let sliding: Vec<usize> = (0..n).filter(|j| self.windowed(*j)).collect();
        g.kv_source(n, &sliding, i)
    }

    /// Layer `i`'s MLP width (Gemma 4's KV-sharing layers' twice `intermediate_size` with
    /// `use_double_wide_mlp`).
    pub fn layer_intermediate(&self, i: usize) -> usize {
        match &self.gemma4 {
            Some(g) if g.double_wide_mlp && self.kv_source(i).is_some() => {
                2 * self.intermediate_size
            }
            _ => self.intermediate_size,
        }
    }

    /// Whether layer `i` rotates its queries and keys (all but SmolLM3's NoPE layers).
    pub fn uses_rope(&self, i: usize) -> bool {
        !self.nope_layers.contains(&i)
    }

    /// Whether layer `i` has the sliding window ([`Self::sliding_window`]).
    pub fn windowed(&self, i: usize) -> bool {
        self.sliding_window.is_some()
            && (self.sliding_layers.is_empty() || self.sliding_layers.contains(&i))
    }

    /// The RoPE of layer `i`'s own: Gemma 3's sliding-window layers rotate with
    /// [`Self::local_rope_theta`], unscaled.
    pub fn local_rope(&self, i: usize) -> bool {
        self.local_rope_theta.is_some() && self.windowed(i)
    }

    /// The attention scores' scale: Granite's `attention_multiplier`,
    /// `query_pre_attn_scalar^-1/2`, else `head_dim^-1/2`.
    pub fn attention_scale(&self) -> f64 {
        if let Some(g) = &self.granite {
            return g.attention_multiplier;
        }
        // DeepSeek's YaRN also scales the scores, by `mscale(factor, mscale_all_dim)²`.
        if self.mla.is_some()
            && let Some(RopeScaling::Yarn(y)) = &self.rope_scaling
            && let Some(all) = y.mscale_all_dim
        {
            let m = match y.factor <= 1.0 {
                true => 1.0,
                false => 0.1 * all * y.factor.ln() + 1.0,
            };
            return m * m / (self.head_dim as f64).sqrt();
        }
        1.0 / self
            .query_pre_attn_scalar
            .unwrap_or(self.head_dim as f64)
            .sqrt()
    }

    /// Whether layer `i` mixes its tokens with a recurrent mixer — Qwen3.5's linear attention,
    /// LFM2's short convolution — rather than attention.
    pub fn recurrent_layer(&self, i: usize) -> bool {
        self.linear_attention
            .as_ref()
            .is_some_and(|d| d.is_linear(i))
            || self.short_conv.as_ref().is_some_and(|c| c.is_conv(i))
    }

    /// Whether some layer is recurrent ([`Self::recurrent_layer`]): a state runs along each
    /// row, so rows cannot share a prompt's keys and values or be packed together.
    pub fn recurrent(&self) -> bool {
        self.linear_attention.is_some() || self.short_conv.is_some()
    }

    /// Gemma's RMSNorms scale by `1 + w` (their weights are stored as `w`).
    pub fn unit_offset_norms(&self) -> bool {
        self.arch.gemma() || self.arch.qwen3_5()
    }

    /// Whether o_proj has a bias: `attention_bias` on the families that bias o with it
    /// ([`Arch::biases_o_proj`]), Seed-OSS's own `attention_out_bias`.
    pub fn o_proj_bias(&self) -> bool {
        match self.arch {
            Arch::SeedOss => self.attention_out_bias,
            a => self.attention_bias && a.biases_o_proj(),
        }
    }

    /// Whether q and k are RMS-normalised per head (`head_dim` weights): the families that
    /// always are ([`Arch::head_qk_norm`]), GLM-4.5 with `use_qk_norm`.
    pub fn head_qk_norm(&self) -> bool {
        self.arch.head_qk_norm() || self.use_qk_norm
    }

    /// Values the generation KV cache holds per token, over all layers: each KV head's key and
    /// value, or with `latent` DeepSeek's latent and shared rotated key (`kv_lora_rank +
    /// qk_rope_head_dim` per layer: [`crate::mla::latent_cache`]). Times the dtype's size: the
    /// cache's bytes per token of each row.
    pub fn kv_cache_values_per_token(&self, latent: bool) -> usize {
        if let Some(m) = self.mla.as_ref().filter(|_| latent) {
            return self.num_hidden_layers * (m.kv_lora_rank + m.qk_rope_head_dim);
        }
        // Gemma 4's sharing layers cache nothing; its full layers their own heads.
        (0..self.num_hidden_layers)
            .filter(|i| self.kv_source(*i).is_none())
            .map(|i| {
                let (kv, hd) = self.layer_heads(i);
                2 * kv * hd
            })
            .sum()
    }

    /// Number of parameters (tied embeddings counted once).
    pub fn num_parameters(&self) -> usize {
        if self.gemma4.is_some() {
            return self.gemma4_parameters();
        }
        let h = self.hidden_size;
        let q = self.num_attention_heads * self.head_dim;
        let kv = self.num_key_value_heads * self.head_dim;
        // Gate, up and down (Arcee: up and down).
        let maps = if self.arch.gated_mlp() { 3 } else { 2 };
        let mut layer = maps * h * self.intermediate_size + 2 * h;
        match &self.mla {
            // The latent attention's maps and its two norms; `attention_bias` biases q_a,
            // kv_a and o.
            Some(m) => {
                let heads = self.num_attention_heads;
                let kv_a = m.kv_lora_rank + m.qk_rope_head_dim;
                layer += match m.q_lora_rank {
                    Some(r) => r * h + r + heads * m.qk_head_dim() * r,
                    None => heads * m.qk_head_dim() * h,
                };
                layer += kv_a * h + m.kv_lora_rank;
                layer += heads * (m.qk_nope_head_dim + m.v_head_dim) * m.kv_lora_rank;
                layer += heads * m.v_head_dim * h;
                if self.attention_bias {
                    layer += m.q_lora_rank.unwrap_or(0) + kv_a + h;
                }
            }
            None => {
                layer += h * q + 2 * h * kv + q * h;
                if self.attention_bias {
                    layer += q + 2 * kv;
                }
                if self.o_proj_bias() {
                    layer += h;
                }
            }
        }
        let mlp_bias = match self.mlp_bias {
            true => (maps - 1) * self.intermediate_size + h,
            false => 0,
        };
        layer += mlp_bias;
        if self.head_qk_norm() {
            layer += 2 * self.head_dim;
        }

        if self.arch.gemma() || self.arch == Arch::Glm4 {
            layer += 2 * h; // the sublayers' output norms
        }
        if matches!(self.arch, Arch::Olmo2 | Arch::Olmo3) {
            layer += q + kv; // q/k norms over all heads; the output norms replace the pre-norms
        }
        if self.arch == Arch::Olmoe {
            layer += q + kv; // q/k norms over all heads
        }
        if self.arch.attention_sinks() {
            layer += self.num_attention_heads;
        }
        // nanochat's norms hold no weights: the pre-norms', q's and k's, the final one.
        let final_norm = match self.arch.weightless_norms() {
            true => {
                layer -= 2 * h + 2 * self.head_dim;
                0
            }
            false => h,
        };
        let mut n = self.vocab_size * h + self.num_hidden_layers * layer + final_norm;
        // An MoE layer's router and experts in place of the dense MLP.
        if let Some(m) = &self.moe {
            let sparse = (0..self.num_hidden_layers).filter(|i| m.sparse(*i)).count();
            let mut moe = h * m.num_experts
                + 3 * h * m.moe_intermediate_size * m.num_experts
                + m.shared_expert_intermediate_size.map_or(0, |s| {
                    3 * h * s
                        + if self.arch.gated_shared_expert() {
                            h
                        } else {
                            0
                        }
                });
            if self.arch.biased_experts() {
                // The router's bias; each expert's gate, up and down biases.
                moe += m.num_experts * (1 + 2 * m.moe_intermediate_size + h);
            }
            n = n + sparse * moe - sparse * (3 * h * self.intermediate_size + mlp_bias);
        }
        // Qwen3.5: the linear layers' mixers in place of attention; the full layers' gate rows.
        if let Some(d) = &self.linear_attention {
            let bias = usize::from(self.attention_bias);
            let attn = 2 * h * q + 2 * h * kv + bias * (q + 2 * kv) + 2 * self.head_dim;
            let attn = attn + usize::from(self.o_proj_bias()) * h;
            let linear = d.layers.len();
            let full = self.num_hidden_layers - linear;
            n = n + linear * d.parameters(h) + full * (h * q + bias * q) - linear * attn;
        }
        // LFM2: the convolution layers' mixers in place of attention.
        if let Some(c) = &self.short_conv {
            let bias = usize::from(self.attention_bias);
            let attn = 2 * h * q + 2 * h * kv + bias * (q + 2 * kv) + 2 * self.head_dim;
            let attn = attn + usize::from(self.o_proj_bias()) * h;
            n = n + c.layers.len() * c.parameters(h) - c.layers.len() * attn;
        }
        if !self.tie_word_embeddings {
            n += self.vocab_size * h;
        }
        n
    }

    /// Floating-point operations of one forward pass's matrix products: `rows` token rows
    /// through every layer's projections, `attention_pairs` (query, key) pairs scored and
    /// mixed per head (summed over the batch: `B · L · S` for `L` queries over `S` keys), and
    /// `head_rows` rows through the output head. A backward pass with every weight trainable
    /// costs twice this (input and weight gradients). Benchmarks divide it by the time taken
    /// to report a GFLOP/s rate against the machine's matmul rate.
    pub fn matmul_flops(&self, rows: usize, attention_pairs: usize, head_rows: usize) -> f64 {
        let h = self.hidden_size as f64;
        let q = (self.num_attention_heads * self.head_dim) as f64;
        let kv = (self.num_key_value_heads * self.head_dim) as f64;
        let mlp = |i: usize| match &self.moe {
            // The router, the experts each row goes to, the shared expert.
            Some(m) if m.sparse(i) => {
                let e =
                    (m.num_experts + 3 * m.num_experts_per_tok * m.moe_intermediate_size) as f64;
                let gate = usize::from(self.arch.gated_shared_expert());
                let shared = m
                    .shared_expert_intermediate_size
                    .map_or(0, |s| 3 * s + gate) as f64;
                h * (e + shared)
            }
            _ => 3.0 * h * self.intermediate_size as f64,
        };
        let Some(g) = &self.gemma4 else {
            let per_row: f64 = (0..self.num_hidden_layers)
                .map(|i| h * q + 2.0 * h * kv + q * h + mlp(i))
                .sum();
            let layers = self.num_hidden_layers as f64;
            return 2.0 * rows as f64 * per_row
                + 2.0 * 2.0 * attention_pairs as f64 * q * layers
                + 2.0 * head_rows as f64 * h * self.vocab_size as f64;
        };
        // Gemma 4: each layer's own heads, keys and values only where it makes them, its MLP
        // width, the per-layer inputs' maps, the experts beside the MLP.
        let width = g.per_layer_input.map_or(0.0, |(_, w)| w as f64);
        let layers = self.num_hidden_layers as f64;
        let mut per_row = h * layers * width;
        let mut q_all = 0.0;
        for i in 0..self.num_hidden_layers {
            let (nkv, hd) = self.layer_heads(i);
            let q = (self.num_attention_heads * hd) as f64;
            let kv = (nkv * hd) as f64;
            let own = match self.kv_source(i) {
                Some(_) => 0.0,
                None if g.k_eq_v && !self.windowed(i) => 1.0,
                None => 2.0,
            };
            per_row += 2.0 * h * q + own * h * kv + 3.0 * h * self.layer_intermediate(i) as f64;
            per_row += 2.0 * h * width;
            if let Some(e) = &g.experts {
                per_row += h * (e.num_experts + 3 * e.top_k * e.width) as f64;
            }
            q_all += q;
        }
        2.0 * rows as f64 * per_row
            + 2.0 * 2.0 * attention_pairs as f64 * q_all
            + 2.0 * head_rows as f64 * h * self.vocab_size as f64
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn matmul_flops_count_each_product() {
        let v = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 100, "hidden_size": 8,
            "intermediate_size": 12, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "tie_word_embeddings": true
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        // Per row and layer: q 8x8, k and v 8x4 each, o 8x8, gate/up/down 8x12 each: 480
        // multiply-adds. Attention: q·k and p·v over 8 query dims per pair: 16.
        assert_eq!(c.matmul_flops(1, 0, 0), 2.0 * 480.0 * 2.0);
        assert_eq!(c.matmul_flops(0, 1, 0), 2.0 * 16.0 * 2.0);
        assert_eq!(c.matmul_flops(0, 0, 1), 2.0 * 800.0);
        assert_eq!(
            c.matmul_flops(3, 5, 7),
            3.0 * 1920.0 + 5.0 * 64.0 + 7.0 * 1600.0
        );
    }

    #[test]
    fn parses_qwen2_and_round_trips() {
        let v = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 2048, "hidden_size": 256,
            "intermediate_size": 768, "num_hidden_layers": 4, "num_attention_heads": 4,
            "num_key_value_heads": 2, "rope_theta": 10000.0, "tie_word_embeddings": true,
            "eos_token_id": 2, "rms_norm_eps": 1e-6
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.head_dim, 64);
        assert!(c.attention_bias);
        assert_eq!(c.eos_token_ids, vec![2]);
        let back = ModelConfig::from_hf_json(&c.to_hf_json()).unwrap();
        assert_eq!(back, c);
    }

    /// gemma-3-4b-it's `config.json` as transformers 4.50 wrote it: a `text_config` of the six
    /// values that differ from Gemma3TextConfig's defaults, the token ids at the top. The
    /// language model's config takes the class's defaults for the rest; a Mistral 3 text model
    /// without `head_dim` takes hidden / heads.
    #[test]
    fn vision_language_configs_take_their_text_class_defaults() {
        let v = serde_json::json!({
            "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
            "boi_token_index": 255999, "eoi_token_index": 256000, "eos_token_id": [1, 106],
            "image_token_index": 262144, "mm_tokens_per_image": 256,
            "text_config": {"hidden_size": 2560, "intermediate_size": 10240,
                "model_type": "gemma3_text", "num_hidden_layers": 34,
                "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024},
            "vision_config": {"hidden_size": 1152, "model_type": "siglip_vision_model"}
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.arch, Arch::Gemma3);
        assert_eq!(
            (
                c.vocab_size,
                c.hidden_size,
                c.num_hidden_layers,
                c.num_attention_heads
            ),
            (262_208, 2560, 34, 8)
        );
        assert_eq!((c.num_key_value_heads, c.head_dim), (4, 256));
        assert_eq!(
            (c.sliding_window, c.query_pre_attn_scalar),
            (Some(1024), Some(256.0))
        );
        assert_eq!(c.eos_token_ids, vec![1, 106]);
        assert!(c.tie_word_embeddings);
        let v = serde_json::json!({
            "model_type": "mistral3",
            "text_config": {"hidden_size": 5120, "intermediate_size": 32768,
                "num_hidden_layers": 40, "vocab_size": 131072, "sliding_window": null}
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(
            (c.arch, c.head_dim, c.num_key_value_heads),
            (Arch::Mistral, 160, 8)
        );
        let mut v = v;
        v["text_config"]["num_attention_heads"] = 40.into();
        assert_eq!(ModelConfig::from_hf_json(&v).unwrap().head_dim, 128);
    }

    #[test]
    fn unknown_model_type_lists_the_supported_ones() {
        let v = serde_json::json!({"model_type": "gpt2"});
        let e = ModelConfig::from_hf_json(&v).unwrap_err().to_string();
        assert!(
            e.contains("gpt2")
                && e.contains("llama, qwen2, qwen3, qwen3_5_text, mistral, ministral3, smollm3"),
            "{e}"
        );
    }

    #[test]
    fn another_activation_is_refused_by_name_and_windowed_layers_are_found() {
        let base = serde_json::json!({
            "model_type": "qwen2", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 4, "num_attention_heads": 2, "max_position_embeddings": 64,
        });
        let with = |k: &str, x: Value| {
            let mut v = base.clone();
            v[k] = x;
            v
        };
        let e = ModelConfig::from_hf_json(&with("hidden_act", "gelu".into()))
            .unwrap_err()
            .to_string();
        assert!(e.contains("hidden_act `gelu`"), "{e}");
        assert!(ModelConfig::from_hf_json(&with("hidden_act", "silu".into())).is_ok());
        let windowed = |v: &Value| {
            let c = ModelConfig::from_hf_json(v).unwrap();
            let layers: Vec<usize> = (0..4).filter(|i| c.windowed(*i)).collect();
            assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
            (c.sliding_window, layers)
        };
        // Qwen2.5's saved configs: a window, switched off.
        let mut v = with("sliding_window", 32.into());
        v["max_window_layers"] = 2.into();
        assert_eq!(windowed(&v), (None, vec![]));
        // On: the layers from max_window_layers, or those layer_types names.
        v["use_sliding_window"] = true.into();
        assert_eq!(windowed(&v), (Some(32), vec![2, 3]));
        v["max_window_layers"] = 4.into();
        assert_eq!(windowed(&v), (None, vec![]));
        v["max_window_layers"] = 0.into();
        assert_eq!(windowed(&v), (Some(32), vec![0, 1, 2, 3]));
        v["layer_types"] = serde_json::json!(vec!["full_attention"; 4]);
        assert_eq!(windowed(&v), (None, vec![]));
        v["layer_types"][3] = "sliding_attention".into();
        assert_eq!(windowed(&v), (Some(32), vec![3]));
    }

    #[test]
    fn llama3_rope_scaling_and_transformers5_layout() {
        let v = serde_json::json!({
            "model_type": "llama", "vocab_size": 10, "hidden_size": 8, "intermediate_size": 16,
            "num_hidden_layers": 1, "num_attention_heads": 2,
            "rope_parameters": {"rope_theta": 500000.0, "rope_type": "llama3", "factor": 8.0,
                "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 8192},
            "eos_token_id": [1, 2]
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.rope_theta, 500000.0);
        assert!(matches!(c.rope_scaling, Some(RopeScaling::Llama3(s)) if s.factor == 8.0));
        assert_eq!(c.eos_token_ids, vec![1, 2]);
        assert_eq!(c.num_key_value_heads, 2);
    }

    /// DeepSeek-V3's and GLM-4.7-Flash's shapes from transformers' defaults (a config.json
    /// naming only the sizes), and DeepSeek-V2-Lite's: the parameters transformers counts
    /// (671,026,404,352, 29,943,390,976 and 15,706,484,224; the router offsets are buffers),
    /// the latent attention's heads.
    #[test]
    fn deepseek_v3_and_glm_4_7_flash_defaults_count_as_transformers() {
        let v = serde_json::json!({
            "model_type": "deepseek_v3", "vocab_size": 129280, "hidden_size": 7168,
            "intermediate_size": 18432, "num_hidden_layers": 61, "num_attention_heads": 128
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.num_parameters(), 671_026_404_352);
        assert_eq!(
            (c.head_dim, c.rotary_dim(), c.num_key_value_heads),
            (192, 64, 128)
        );
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.num_experts_per_tok), (256, 8));
        assert_eq!(m.mlp_only_layers, vec![0, 1, 2]);
        assert_eq!(
            m.routing,
            Routing::SigmoidGroups {
                n_group: 8,
                topk_group: 4,
                routed_scaling_factor: 2.5
            }
        );
        let v = serde_json::json!({
            "model_type": "glm4_moe_lite", "vocab_size": 154880, "hidden_size": 2048,
            "intermediate_size": 10240, "num_hidden_layers": 47, "num_attention_heads": 20
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.num_parameters(), 29_943_390_976);
        assert_eq!(c.mla.unwrap().v_head_dim, 256);
        assert_eq!(c.moe.as_ref().unwrap().mlp_only_layers, vec![0]);
        // What it writes reads back the same.
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
        // DeepSeek-V2-Lite's shape (one q_proj, 64 experts, 6 per token, greedy): its
        // 15,706,484,224 parameters.
        let v = serde_json::json!({
            "model_type": "deepseek_v2", "vocab_size": 102400, "hidden_size": 2048,
            "intermediate_size": 10944, "num_hidden_layers": 27, "num_attention_heads": 16,
            "num_key_value_heads": 16, "q_lora_rank": null, "kv_lora_rank": 512,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128,
            "n_routed_experts": 64, "n_shared_experts": 2, "num_experts_per_tok": 6,
            "moe_intermediate_size": 1408, "first_k_dense_replace": 1, "n_group": 1,
            "topk_group": 1, "topk_method": "greedy"
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.num_parameters(), 15_706_484_224);
        assert!(matches!(
            c.moe.as_ref().unwrap().routing,
            Routing::Greedy {
                group_limited: false,
                ..
            }
        ));
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
    }

    /// openai/gpt-oss-20b's config.json (its MXFP4 `quantization_config` included): the
    /// fields as transformers resolves them, and its 20,914,757,184 parameters.
    /// nanochat d20 as a converted checkpoint's config names it (a top-level `rope_theta`, the
    /// activation and the cap left to their defaults): 561M parameters, none in the norms.
    #[test]
    fn parses_nanochat_d20() {
        let v = serde_json::json!({
            "architectures": ["NanoChatForCausalLM"], "model_type": "nanochat",
            "vocab_size": 65536, "hidden_size": 1280, "intermediate_size": 5120,
            "num_hidden_layers": 20, "num_attention_heads": 10, "num_key_value_heads": 10,
            "max_position_embeddings": 2048, "rope_theta": 10000.0
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.arch, Arch::NanoChat);
        assert_eq!(c.num_parameters(), 560_988_160);
        assert_eq!(c.activation, Activation::Relu2);
        assert_eq!(c.final_logit_softcapping, Some(15.0));
        assert_eq!(c.attn_logit_softcapping, None);
        assert!(!c.tie_word_embeddings && !c.attention_bias);
        assert!(c.head_qk_norm() && c.arch.inverse_rope() && c.arch.weightless_norms());
        let mut capped = v.clone();
        capped["attn_logit_softcapping"] = 30.0.into();
        let e = ModelConfig::from_hf_json(&capped).unwrap_err().to_string();
        assert!(e.contains("attn_logit_softcapping"), "{e}");
    }

    #[test]
    fn parses_gpt_oss_20b() {
        let types: Vec<&str> = (0..24)
            .map(|i| ["sliding_attention", "full_attention"][i % 2])
            .collect();
        let v = serde_json::json!({
            "architectures": ["GptOssForCausalLM"], "attention_bias": true,
            "attention_dropout": 0.0, "eos_token_id": 200002, "experts_per_token": 4,
            "head_dim": 64, "hidden_act": "silu", "hidden_size": 2880,
            "initial_context_length": 4096, "initializer_range": 0.02,
            "intermediate_size": 2880, "layer_types": types,
            "max_position_embeddings": 131072, "model_type": "gpt_oss",
            "num_attention_heads": 64, "num_experts_per_tok": 4, "num_hidden_layers": 24,
            "num_key_value_heads": 8, "num_local_experts": 32, "output_router_logits": false,
            "pad_token_id": 199999,
            "quantization_config": {"modules_to_not_convert": ["model.layers.*.self_attn",
                "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"],
                "quant_method": "mxfp4"},
            "rms_norm_eps": 1e-05,
            "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0,
                "original_max_position_embeddings": 4096, "rope_type": "yarn",
                "truncate": false},
            "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128,
            "swiglu_limit": 7.0, "tie_word_embeddings": false, "use_cache": true,
            "vocab_size": 201088
        });
        let c = ModelConfig::from_hf_json(&v).unwrap();
        assert_eq!(c.arch, Arch::GptOss);
        assert_eq!(c.num_parameters(), 20_914_757_184);
        assert!(c.attention_bias && !c.tie_word_embeddings);
        assert_eq!(c.sliding_window, Some(128));
        assert!((0..24).all(|i| c.windowed(i) == (i % 2 == 0)));
        assert_eq!(
            c.activation,
            Activation::ClampedSwiglu {
                alpha: 1.702,
                limit: 7.0
            }
        );
        let Some(RopeScaling::Yarn(y)) = c.rope_scaling else {
            panic!("{:?}", c.rope_scaling)
        };
        assert!(!y.truncate && y.factor == 32.0 && y.original_max_position_embeddings == 4096);
        let m = c.moe.as_ref().unwrap();
        assert_eq!((m.num_experts, m.num_experts_per_tok), (32, 4));
        assert_eq!(m.moe_intermediate_size, 2880);
        assert!(m.norm_topk_prob);
        assert_eq!(m.router_aux_loss_coef, 0.9);
        // What it writes reads back the same.
        assert_eq!(ModelConfig::from_hf_json(&c.to_hf_json()).unwrap(), c);
        // Another quantization method is refused by name.
        let mut q = v.clone();
        q["quantization_config"]["quant_method"] = "gptq".into();
        let e = ModelConfig::from_hf_json(&q).unwrap_err().to_string();
        assert!(e.contains("quant_method `gptq`"), "{e}");
    }
}
