//! LoRA adapters: `y = W x + (alpha / r) · B A dropout(x)`, the base frozen, `A` and `B`
//! trainable; saved and loaded in PEFT's format so Python `peft` and vLLM read them.

use std::collections::{BTreeMap, HashMap};
use std::path::Path;
use std::sync::{Arc, Mutex, OnceLock};

use candle_core::{DType, Result, Tensor, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::config::NANOCHAT_MLP;
use crate::model::Transformer;

/// The modules LoRA can target.
pub const TARGET_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// Phi-3's fused modules (q, k, v as `qkv_proj`; gate, up as `gate_up_proj`, which GLM has
/// too), which PEFT adapts as one each: one `A` shared by the parts, `B` rows for each
/// ([`modules`]).
pub const FUSED_MODULES: [&str; 2] = ["qkv_proj", "gate_up_proj"];

/// One module as PEFT adapts it: its group (`self_attn` / `mlp`), its name, and the model's
/// linear maps it stands for (indices into [`crate::model::Layer::linears_mut`]).
#[derive(Debug, Clone, Copy)]
pub struct Module {
    /// `self_attn` or `mlp`.
    pub group: &'static str,
    /// PEFT's module name.
    pub name: &'static str,
    /// The parts, as (name, index into [`crate::model::Layer::linears_mut`]).
    pub parts: &'static [(&'static str, usize)],
}

const SEPARATE: [Module; 7] = [
    Module {
        group: "self_attn",
        name: "q_proj",
        parts: &[("q_proj", 0)],
    },
    Module {
        group: "self_attn",
        name: "k_proj",
        parts: &[("k_proj", 1)],
    },
    Module {
        group: "self_attn",
        name: "v_proj",
        parts: &[("v_proj", 2)],
    },
    Module {
        group: "self_attn",
        name: "o_proj",
        parts: &[("o_proj", 3)],
    },
    Module {
        group: "mlp",
        name: "gate_proj",
        parts: &[("gate_proj", 4)],
    },
    Module {
        group: "mlp",
        name: "up_proj",
        parts: &[("up_proj", 5)],
    },
    Module {
        group: "mlp",
        name: "down_proj",
        parts: &[("down_proj", 6)],
    },
];

const PHI3: [Module; 4] = [
    Module {
        group: "self_attn",
        name: "qkv_proj",
        parts: &[("q_proj", 0), ("k_proj", 1), ("v_proj", 2)],
    },
    Module {
        group: "self_attn",
        name: "o_proj",
        parts: &[("o_proj", 3)],
    },
    Module {
        group: "mlp",
        name: "gate_up_proj",
        parts: &[("gate_proj", 4), ("up_proj", 5)],
    },
    Module {
        group: "mlp",
        name: "down_proj",
        parts: &[("down_proj", 6)],
    },
];

const GLM: [Module; 6] = [
    SEPARATE[0],
    SEPARATE[1],
    SEPARATE[2],
    SEPARATE[3],
    PHI3[2],
    PHI3[3],
];

/// nanochat's: q, k, v, o, and its MLP's `fc1` / `fc2` in the up and down slots (no gate).
const NANOCHAT: [Module; 6] = [
    SEPARATE[0],
    SEPARATE[1],
    SEPARATE[2],
    SEPARATE[3],
    Module {
        group: "mlp",
        name: NANOCHAT_MLP[0],
        parts: &[(NANOCHAT_MLP[0], 5)],
    },
    Module {
        group: "mlp",
        name: NANOCHAT_MLP[1],
        parts: &[(NANOCHAT_MLP[1], 6)],
    },
];

/// LFM2's: q, k, v, its attention's `out_proj` and its MLP `feed_forward.w1` / `w3` / `w2` (the
/// convolutions' `in_proj` and `out_proj` are modules of their own: [`extra_sites`]).
const LFM2: [Module; 7] = [
    SEPARATE[0],
    SEPARATE[1],
    SEPARATE[2],
    Module {
        group: "self_attn",
        name: "out_proj",
        parts: &[("out_proj", 3)],
    },
    Module {
        group: "feed_forward",
        name: "w1",
        parts: &[("w1", 4)],
    },
    Module {
        group: "feed_forward",
        name: "w3",
        parts: &[("w3", 5)],
    },
    Module {
        group: "feed_forward",
        name: "w2",
        parts: &[("w2", 6)],
    },
];

/// DeepSeek's latent attention ([`crate::mla`]): the q slot's `q_proj`, its latent's
/// `kv_a_proj_with_mqa` and `kv_b_proj` in the k and v slots (`q_a_proj`, beside the slots, is
/// adapted as a module of its own).
const MLA_Q: [Module; 7] = [
    SEPARATE[0],
    Module {
        group: "self_attn",
        name: "kv_a_proj_with_mqa",
        parts: &[("kv_a_proj_with_mqa", 1)],
    },
    Module {
        group: "self_attn",
        name: "kv_b_proj",
        parts: &[("kv_b_proj", 2)],
    },
    SEPARATE[3],
    SEPARATE[4],
    SEPARATE[5],
    SEPARATE[6],
];

/// [`MLA_Q`] with a low-rank q: `q_b_proj` in the q slot.
const MLA_QB: [Module; 7] = [
    Module {
        group: "self_attn",
        name: "q_b_proj",
        parts: &[("q_b_proj", 0)],
    },
    MLA_Q[1],
    MLA_Q[2],
    MLA_Q[3],
    MLA_Q[4],
    MLA_Q[5],
    MLA_Q[6],
];

/// The modules of `cfg`'s model that LoRA can adapt in the layers' seven slots, in PEFT's
/// names: the seven projections, Phi-3's four (two of them fused), GLM's six (gate and up
/// fused), or DeepSeek's latent attention's maps with o and the MLP's.
pub fn modules(cfg: &crate::config::ModelConfig) -> &'static [Module] {
    match (cfg.arch, &cfg.mla) {
        (_, Some(m)) if m.q_lora_rank.is_some() => &MLA_QB,
        (_, Some(_)) => &MLA_Q,
        (crate::config::Arch::Phi3, _) => &PHI3,
        (crate::config::Arch::NanoChat, _) => &NANOCHAT,
        (a, _) if a.lfm2() => &LFM2,
        (a, _) if a.glm() => &GLM,
        _ => &SEPARATE,
    }
}

/// Which modules get adapters (PEFT's `target_modules` / `exclude_modules`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TargetModules {
    /// Module names: one matches a module whose full name (`model.layers.3.self_attn.q_proj`)
    /// equals it or ends with `.` + it (`q_proj`, `self_attn.q_proj`, ...).
    Names(Vec<String>),
    /// `"all-linear"` (every projection: the seven of [`TARGET_MODULES`]) or a regular
    /// expression that must match a module's whole name.
    Pattern(String),
}

impl TargetModules {
    fn names(v: &[&str]) -> Self {
        Self::Names(v.iter().map(|s| s.to_string()).collect())
    }
}

/// `layers_to_transform`: one layer index or a list of them.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Layers {
    /// One layer.
    One(usize),
    /// Several layers.
    Many(Vec<usize>),
}

impl Layers {
    fn contains(&self, i: usize) -> bool {
        match self {
            Self::One(l) => *l == i,
            Self::Many(v) => v.contains(&i),
        }
    }
}

fn bias_none() -> String {
    "none".into()
}

/// PEFT's `LoraConfig` defaults: r 8, lora_alpha 8, and for Llama, Mistral, Qwen2 and Qwen3
/// (PEFT's table of default targets) the query and value projections.
fn peft_r() -> usize {
    8
}

fn peft_alpha() -> f64 {
    8.0
}

fn peft_targets() -> TargetModules {
    TargetModules::names(&["q_proj", "v_proj"])
}

/// LoRA hyper-parameters, with PEFT's names, meanings and defaults (`Default` and absent keys:
/// r 8, lora_alpha 8, `q_proj` and `v_proj`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank (PEFT's default 8).
    #[serde(default = "peft_r")]
    pub r: usize,
    /// Scale numerator: the low-rank path is multiplied by `lora_alpha / r`
    /// (`lora_alpha / sqrt(r)` with `use_rslora`); PEFT's default 8.
    #[serde(default = "peft_alpha")]
    pub lora_alpha: f64,
    /// Dropout on the adapter's input during training.
    #[serde(default)]
    pub lora_dropout: f64,
    /// Which linear layers get adapters: names (any of [`TARGET_MODULES`], or longer suffixes
    /// of a module's full name), `"all-linear"`, or a regular expression on the full name.
    /// Absent: PEFT's default for these architectures, `["q_proj", "v_proj"]`.
    #[serde(default = "peft_targets")]
    pub target_modules: TargetModules,
    /// Modules left out even when `target_modules` matches them (same forms).
    #[serde(default)]
    pub exclude_modules: Option<TargetModules>,
    /// Rank-stabilised LoRA: scale `lora_alpha / sqrt(r)`.
    #[serde(default)]
    pub use_rslora: bool,
    /// DoRA: each output row of `W + scale·B·A` is renormalised to a trained magnitude.
    #[serde(default)]
    pub use_dora: bool,
    /// Base-layer biases trained and saved with the adapter: `"none"`, `"all"` (every linear
    /// layer's bias) or `"lora_only"` (the biases of the adapted layers).
    #[serde(default = "bias_none")]
    pub bias: String,
    /// A trainable bias on `lora_B` (PEFT's `lora_bias`).
    #[serde(default)]
    pub lora_bias: bool,
    /// Per-module ranks: the first key (in key order) that matches the end of a module's full
    /// name (as a regular expression) sets its rank.
    #[serde(default)]
    pub rank_pattern: BTreeMap<String, usize>,
    /// Per-module alphas, matched like `rank_pattern`.
    #[serde(default)]
    pub alpha_pattern: BTreeMap<String, f64>,
    /// Only these decoder layers get adapters (all when unset).
    #[serde(default)]
    pub layers_to_transform: Option<Layers>,
    /// PEFT's trainable tokens: these token ids' embedding rows are trained beside the
    /// adapters (a list, or `{embed_tokens = [...]}`; with a tied head its rows too). TRL sets
    /// it for the tokens `chat_template_path` adds.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub trainable_token_indices: Option<TokenIndices>,
    /// PEFT's `target_parameters`: a mixture of experts' stacked expert weights, adapted as
    /// PEFT's `ParamWrapper` does — `gate_up_proj` and/or `down_proj`, named as transformers 5
    /// holds them (`mlp.experts.gate_up_proj`; Granite MoE's `block_sparse_moe.experts.…`),
    /// matched as the end of `model.layers.N.….experts.{param}`. Each expert gets its own `A`
    /// and `B` (one `A` shared by its gate and up rows); no dropout, DoRA or `lora_bias` there.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub target_parameters: Vec<String>,
}

/// `trainable_token_indices`: PEFT's list (the embedding's) or map by layer name (only
/// `embed_tokens` here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum TokenIndices {
    /// The embedding's token ids.
    List(Vec<u32>),
    /// Token ids by layer name.
    ByLayer(BTreeMap<String, Vec<u32>>),
}

impl TokenIndices {
    /// The embedding's token ids, in order, without repeats; a layer other than the embedding is
    /// an error.
    pub fn embedding(&self) -> Result<Vec<u32>> {
        let raw = match self {
            Self::List(v) => v.clone(),
            Self::ByLayer(m) => {
                let mut out = Vec::new();
                for (k, v) in m {
                    if k.rsplit('.').next() != Some("embed_tokens") {
                        bail!(
                            "lora.trainable_token_indices: `{k}`: only the embedding (`embed_tokens`) takes trainable tokens here"
                        );
                    }
                    out.extend(v);
                }
                out
            }
        };
        let mut seen = std::collections::BTreeSet::new();
        Ok(raw.into_iter().filter(|i| seen.insert(*i)).collect())
    }
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: peft_r(),
            lora_alpha: peft_alpha(),
            lora_dropout: 0.0,
            target_modules: peft_targets(),
            exclude_modules: None,
            use_rslora: false,
            use_dora: false,
            bias: bias_none(),
            lora_bias: false,
            rank_pattern: BTreeMap::new(),
            alpha_pattern: BTreeMap::new(),
            layers_to_transform: None,
            trainable_token_indices: None,
            target_parameters: Vec::new(),
        }
    }
}

/// A `target_modules` / `exclude_modules` value, ready to match full module names.
enum Matcher {
    Names(Vec<String>),
    Regex(Regex),
}

impl Matcher {
    fn new(t: &TargetModules, field: &str) -> Result<Self> {
        Ok(match t {
            TargetModules::Pattern(p) if p == ALL_LINEAR => Self::Names(
                TARGET_MODULES
                    .iter()
                    .chain(&FUSED_MODULES)
                    .chain(&[SHARED_EXPERT_GATE])
                    .chain(&MLA_MODULES)
                    .chain(&NANOCHAT_MLP)
                    .chain(&GEMMA4_MODULES)
                    .chain(&crate::delta::LINEAR_NAMES)
                    .chain(&crate::shortconv::LINEAR_NAMES[..1])
                    .chain(&["w1", "w3", "w2"])
                    .map(|s| s.to_string())
                    .collect(),
            ),
            TargetModules::Pattern(p) => Self::Regex(anchored(&format!("^(?:{p})$"), field, p)?),
            TargetModules::Names(v) => Self::Names(v.clone()),
        })
    }

    fn matches(&self, name: &str) -> bool {
        match self {
            Self::Names(v) => v
                .iter()
                .any(|t| name == t || name.ends_with(&format!(".{t}"))),
            Self::Regex(r) => regex_matches(r, name),
        }
    }
}

/// Whether a `target_modules` / `exclude_modules` pattern matches the module `name`
/// (`model.layers.…`) under its own name or under the one a vision-language model gives its
/// language model's modules (`model.language_model.layers.…`, as PEFT sees them there).
fn regex_matches(re: &Regex, name: &str) -> bool {
    re.is_match(name)
        || name
            .strip_prefix("model.")
            .is_some_and(|rest| re.is_match(&format!("model.language_model.{rest}")))
}

fn anchored(re: &str, field: &str, key: &str) -> Result<Regex> {
    Regex::new(re).map_err(|e| {
        candle_core::Error::msg(format!(
            "lora.{field}: `{key}` is not a regular expression we can use: {}",
            e.to_string().lines().last().unwrap_or_default()
        ))
    })
}

/// `target_modules = "all-linear"`: every linear layer but the output head.
pub const ALL_LINEAR: &str = "all-linear";

/// Qwen2-MoE's shared expert's gate `(1, hidden)`, a linear module PEFT adapts too.
pub const SHARED_EXPERT_GATE: &str = "shared_expert_gate";

/// Module names `target_modules` may hold beside [`TARGET_MODULES`]: Qwen2-MoE's
/// [`SHARED_EXPERT_GATE`]; the router `gate` and Mixtral's `w1`, `w3`, `w2`, which PEFT turns
/// into `target_parameters` ([`LoraConfig::for_model`]); DeepSeek's latent attention's maps
/// ([`crate::mla`]); nanochat's MLP maps `fc1` and `fc2`.
const EXTRA_MODULES: [&str; 21] = [
    crate::shortconv::LINEAR_NAMES[0],
    crate::delta::LINEAR_NAMES[0],
    crate::delta::LINEAR_NAMES[1],
    crate::delta::LINEAR_NAMES[2],
    crate::delta::LINEAR_NAMES[3],
    crate::delta::LINEAR_NAMES[4],
    GEMMA4_MODULES[0],
    GEMMA4_MODULES[1],
    GEMMA4_MODULES[2],
    GEMMA4_MODULES[3],
    SHARED_EXPERT_GATE,
    "gate",
    "w1",
    "w3",
    "w2",
    MLA_MODULES[0],
    MLA_MODULES[1],
    MLA_MODULES[2],
    MLA_MODULES[3],
    NANOCHAT_MLP[0],
    NANOCHAT_MLP[1],
];

/// DeepSeek's latent attention's linear maps (beside `q_proj` and `o_proj`).
const MLA_MODULES: [&str; 4] = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj"];

/// Layer `i`'s maps beside its seven slots, as PEFT names them, each a module of its own:
/// DeepSeek's `self_attn.q_a_proj` ([`crate::mla`]); a shared expert's, Qwen2-MoE's
/// `mlp.shared_expert.{gate,up,down}_proj` and `mlp.shared_expert_gate`, GLM-4.5's
/// `mlp.shared_experts.{gate,up,down}_proj`.
fn extra_sites(
    layer: &mut crate::model::Layer,
    i: usize,
    arch: crate::config::Arch,
) -> Vec<(String, &mut crate::model::Linear)> {
    let mut out = Vec::new();
    if let Some((a, _)) = layer.mla.as_mut().and_then(|m| m.q_a.as_mut()) {
        out.push((format!("model.layers.{i}.self_attn.q_a_proj"), a));
    }
    // Gemma 4's per-layer-input maps and its experts' router (`nn.Linear`s to PEFT).
    if let Some(b) = layer.per_layer.as_mut() {
        out.push((
            format!("model.layers.{i}.per_layer_input_gate"),
            &mut b.gate,
        ));
        out.push((
            format!("model.layers.{i}.per_layer_projection"),
            &mut b.projection,
        ));
    }
    if let Some(b) = layer.experts.as_mut() {
        out.push((format!("model.layers.{i}.router.proj"), &mut b.moe.router));
    }
    // Qwen3.5's linear-attention maps, LFM2's convolutions'.
    if let Some(d) = layer.delta.as_mut() {
        let (module, names) = (d.module(), d.linear_names());
        for (n, l) in names.iter().zip(d.linears_mut()) {
            out.push((format!("model.layers.{i}.{module}.{n}"), l));
        }
    }
    let Some((e, g)) = layer.moe.as_mut().and_then(|m| m.shared.as_mut()) else {
        return out;
    };
    let p = crate::moe::MoeNames::of(arch).shared_module(i);
    out.extend([
        (format!("{p}.gate_proj"), &mut e.gate_proj),
        (format!("{p}.up_proj"), &mut e.up_proj),
        (format!("{p}.down_proj"), &mut e.down_proj),
    ]);
    if let Some(g) = g.as_mut() {
        out.push((format!("model.layers.{i}.mlp.{SHARED_EXPERT_GATE}"), g));
    }
    out
}

/// The linear maps outside the layers LoRA can adapt, by full name: Gemma 4's
/// `per_layer_model_projection`.
fn model_sites(model: &mut Transformer) -> Vec<(String, &mut crate::model::Linear)> {
    model
        .per_layer
        .as_mut()
        .map(|e| (GEMMA4_MODEL_PROJECTION.to_string(), &mut e.projection))
        .into_iter()
        .collect()
}

/// Gemma 4's linear maps beside the seven (PEFT's `all-linear` takes them): the per-layer
/// inputs' gate and projection, their model-level projection, the experts' router `proj`.
const GEMMA4_MODULES: [&str; 4] = [
    "per_layer_input_gate",
    "per_layer_projection",
    "per_layer_model_projection",
    "proj",
];

/// Gemma 4's model-level map of the per-layer inputs, as PEFT names it.
const GEMMA4_MODEL_PROJECTION: &str = "model.per_layer_model_projection";

/// The full name of a decoder projection, as PEFT matches it.
fn module_name(layer: usize, group: &str, module: &str) -> String {
    format!("model.layers.{layer}.{group}.{module}")
}

/// The experts' stacked weights PEFT's `target_parameters` can name, in the order transformers
/// registers them: when both are targeted PEFT wraps `gate_up_proj` first, so its tensors are
/// the inner wrapper's (`experts.base_layer.lora_A`) and `down_proj`'s the outer one's.
pub const EXPERT_PARAMETERS: [&str; 2] = ["gate_up_proj", "down_proj"];

/// The router's weight as PEFT's `target_parameters` names it (`mlp.gate.weight`): Qwen3-MoE's,
/// Qwen2-MoE's, Mixtral's, OLMoE's and GLM-4.5's routers are modules of their own in
/// transformers 5, not `nn.Linear`s, so PEFT adapts their weight as a parameter.
pub const ROUTER_PARAMETER: &str = "gate.weight";

/// PEFT's renames of `target_modules` on the mixtures of experts whose experts transformers 5
/// fuses when it loads their per-expert files (peft 0.21's `_MOE_TARGET_MODULE_MAPPING`,
/// for the families transformers converts as Qwen2-MoE's or Mixtral's): each name on the left,
/// once an `nn.Linear` of transformers 4, becomes the `target_parameters` entry on the right.
/// Empty for the other families.
fn moe_renames(arch: crate::config::Arch) -> &'static [(&'static str, &'static str)] {
    use crate::config::Arch;
    match arch {
        Arch::Qwen3Moe
        | Arch::Olmoe
        | Arch::Glm4Moe
        | Arch::DeepseekV3
        | Arch::Glm4MoeLite
        | Arch::DeepseekV2 => &[
            ("gate", ROUTER_PARAMETER),
            ("gate_proj", "gate_up_proj"),
            ("up_proj", "gate_up_proj"),
            ("down_proj", "down_proj"),
        ],
        Arch::Mixtral => &[
            ("gate", ROUTER_PARAMETER),
            ("w1", "gate_up_proj"),
            ("w3", "gate_up_proj"),
            ("w2", "down_proj"),
        ],
        _ => &[],
    }
}

/// The last names PEFT resolves a `target_modules` regular expression `re` to on `model`
/// (peft 0.21's `_resolve_string_target_modules`): those of the decoder's maps, routers and
/// experts' parameters whose full names it matches, and each renamed name whose transformers 4
/// form (`model.layers.N.mlp.experts.gate_proj`) it matches.
fn regex_leaves(
    model: &Transformer,
    re: &Regex,
    renames: &[(&'static str, &'static str)],
) -> Vec<String> {
    let arch = model.cfg.arch;
    let mut keys = Vec::new();
    for (i, l) in model.layers.iter().enumerate() {
        for m in modules(&model.cfg) {
            if !l.linears()[m.parts[0].1].is_absent() {
                keys.push(module_name(i, m.group, m.name));
            }
        }
        if l.moe.is_some() {
            let experts = experts_module(i, arch);
            keys.push(format!("model.layers.{i}.mlp.gate"));
            keys.extend(EXPERT_PARAMETERS.iter().map(|p| format!("{experts}.{p}")));
            // The experts' maps as transformers 4 named them.
            keys.extend(renames.iter().map(|(old, _)| format!("{experts}.{old}")));
        }
    }
    let mut out: Vec<String> = Vec::new();
    for k in keys.iter().filter(|k| regex_matches(re, k)) {
        let leaf = k.rsplit('.').next().unwrap_or(k).to_string();
        if !out.contains(&leaf) {
            out.push(leaf);
        }
    }
    out
}

/// Whether the family's router weight takes a `target_parameters` adapter
/// ([`ROUTER_PARAMETER`]).
fn router_adaptable(arch: crate::config::Arch) -> bool {
    use crate::config::Arch;
    matches!(
        arch,
        Arch::Qwen3Moe
            | Arch::Qwen2Moe
            | Arch::Qwen3_5Moe
            | Arch::Mixtral
            | Arch::Olmoe
            | Arch::Glm4Moe
            | Arch::DeepseekV3
            | Arch::Glm4MoeLite
            | Arch::DeepseekV2
    )
}

/// The model's maps an expert parameter stands for: `gate_up_proj`'s gate and up rows (one
/// shared `A`), `down_proj`'s down.
fn expert_parts(param: &str) -> &'static [&'static str] {
    match param {
        "gate_up_proj" => &["gate_proj", "up_proj"],
        _ => &["down_proj"],
    }
}

/// The full name of layer `layer`'s experts module as transformers 5 holds it in memory (where
/// PEFT's `target_parameters` match): `mlp.experts`, Granite MoE's `block_sparse_moe.experts`.
fn experts_module(layer: usize, arch: crate::config::Arch) -> String {
    let block = match arch {
        crate::config::Arch::GraniteMoe => "block_sparse_moe",
        _ => "mlp",
    };
    format!("model.layers.{layer}.{block}.experts")
}

/// The config resolved for matching: which modules get adapters, with which rank and alpha.
struct Resolved<'a> {
    cfg: &'a LoraConfig,
    target: Matcher,
    exclude: Option<Matcher>,
    rank: Vec<(Regex, usize)>,
    alpha: Vec<(Regex, f64)>,
}

impl Resolved<'_> {
    /// `(r, scale)` of the adapter on `model.layers.{layer}.{group}.{module}`, if it gets one.
    fn adapter(&self, layer: usize, group: &str, module: &str) -> Option<(usize, f64)> {
        self.adapter_at(layer, &module_name(layer, group, module))
    }

    /// [`Self::adapter`] of the module of layer `layer` whose full name is `name`.
    /// [`Self::adapter_at`] of a module outside the layers: none with `layers_to_transform`
    /// (PEFT matches no module without a layer index then).
    fn adapter_outside(&self, name: &str) -> Option<(usize, f64)> {
        let name = name.to_string();
        if self.exclude.as_ref().is_some_and(|e| e.matches(&name))
            || !self.target.matches(&name)
            || self.cfg.layers_to_transform.is_some()
        {
            return None;
        }
        Some(self.rank_and_scale(&name))
    }

    fn adapter_at(&self, layer: usize, name: &str) -> Option<(usize, f64)> {
        let name = name.to_string();
        if self.exclude.as_ref().is_some_and(|e| e.matches(&name)) || !self.target.matches(&name) {
            return None;
        }
        if let Some(l) = &self.cfg.layers_to_transform
            && !l.contains(layer)
        {
            return None;
        }
        Some(self.rank_and_scale(&name))
    }

    /// `(r, scale)` for the full name `name`: the first rank and alpha patterns that match its
    /// end, else the config's.
    fn rank_and_scale(&self, name: &str) -> (usize, f64) {
        let r = self
            .rank
            .iter()
            .find(|(re, _)| re.is_match(name))
            .map_or(self.cfg.r, |(_, r)| *r);
        let alpha = self
            .alpha
            .iter()
            .find(|(re, _)| re.is_match(name))
            .map_or(self.cfg.lora_alpha, |(_, a)| *a);
        (r, self.cfg.scale_for(r, alpha))
    }

    /// `(r, scale)` of the adapter on the experts' `param` of layer `layer`, if
    /// `target_parameters` names it (PEFT matches them in every layer, whatever
    /// `layers_to_transform` and `exclude_modules` say; rank and alpha patterns apply).
    fn expert_adapter(
        &self,
        layer: usize,
        arch: crate::config::Arch,
        param: &str,
    ) -> Option<(usize, f64)> {
        self.parameter_adapter(&format!("{}.{param}", experts_module(layer, arch)))
    }

    /// `(r, scale)` of the adapter on layer `layer`'s router weight, if `target_parameters`
    /// names it ([`ROUTER_PARAMETER`], matched as the end of `model.layers.N.mlp.gate.weight`).
    fn router_adapter(&self, layer: usize) -> Option<(usize, f64)> {
        self.parameter_adapter(&format!("model.layers.{layer}.mlp.{ROUTER_PARAMETER}"))
    }

    /// `(r, scale)` of the adapter on the parameter whose full name is `key`, if a
    /// `target_parameters` entry is it or its end.
    fn parameter_adapter(&self, key: &str) -> Option<(usize, f64)> {
        let hit = self
            .cfg
            .target_parameters
            .iter()
            .any(|t| key == t || key.ends_with(&format!(".{t}")));
        hit.then(|| self.rank_and_scale(key))
    }
}

impl LoraConfig {
    /// Checks the values, naming the field to fix.
    pub fn validate(&self) -> Result<()> {
        self.resolve().map(|_| ())
    }

    fn resolve(&self) -> Result<Resolved<'_>> {
        if self.r == 0 {
            bail!("lora.r must be >= 1");
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            bail!(
                "lora.lora_dropout must be in [0, 1), got {}",
                self.lora_dropout
            );
        }
        let names = |field: &str, t: &TargetModules| -> Result<()> {
            let TargetModules::Names(v) = t else {
                return Ok(());
            };
            if v.is_empty() && field == "target_modules" && self.target_parameters.is_empty() {
                bail!("lora.target_modules is empty: name at least one of {TARGET_MODULES:?}");
            }
            for m in v {
                let last = m.rsplit('.').next().unwrap_or(m);
                if ["lm_head", "embed_tokens"].contains(&last) {
                    bail!(
                        "lora.{field}: `{m}`: LoRA on the embeddings or the output head is not supported (only {TARGET_MODULES:?})"
                    );
                }
                if !TARGET_MODULES.contains(&last)
                    && !FUSED_MODULES.contains(&last)
                    && !EXTRA_MODULES.contains(&last)
                {
                    bail!(
                        "lora.{field}: unknown module `{m}`, expected any of {TARGET_MODULES:?} (Phi-3: qkv_proj, o_proj, gate_up_proj, down_proj), or \"{ALL_LINEAR}\""
                    );
                }
            }
            Ok(())
        };
        names("target_modules", &self.target_modules)?;
        if let Some(e) = &self.exclude_modules {
            names("exclude_modules", e)?;
        }
        let target = Matcher::new(&self.target_modules, "target_modules")?;
        if let Matcher::Regex(re) = &target {
            for other in ["lm_head", "model.embed_tokens"] {
                if re.is_match(other) {
                    bail!(
                        "lora.target_modules: the pattern matches `{other}`: LoRA on the embeddings or the output head is not supported"
                    );
                }
            }
            if self.layers_to_transform.is_some() {
                bail!(
                    "lora.layers_to_transform cannot be used when target_modules is a regular expression (as in peft)"
                );
            }
        }
        if !["none", "all", "lora_only"].contains(&self.bias.as_str()) {
            bail!(
                "lora.bias must be \"none\", \"all\" or \"lora_only\", got \"{}\"",
                self.bias
            );
        }
        if self.lora_bias && self.use_dora {
            bail!("lora.lora_bias cannot be used with lora.use_dora (as in peft)");
        }
        for t in &self.target_parameters {
            let last = t.rsplit('.').next().unwrap_or(t);
            let router = t == ROUTER_PARAMETER || t.ends_with(&format!(".{ROUTER_PARAMETER}"));
            if !EXPERT_PARAMETERS.contains(&last) && !router {
                bail!(
                    "lora.target_parameters: `{t}`: expected a mixture of experts' `gate_up_proj` or `down_proj` (e.g. \"mlp.experts.gate_up_proj\"), or its router's `{ROUTER_PARAMETER}`"
                );
            }
        }
        if !self.target_parameters.is_empty() {
            for (set, what) in [
                (self.lora_dropout != 0.0, "lora_dropout != 0"),
                (self.use_dora, "use_dora"),
                (self.lora_bias, "lora_bias"),
            ] {
                if set {
                    bail!("lora.target_parameters does not work with {what} (as in peft)");
                }
            }
        }
        let rank = self
            .rank_pattern
            .iter()
            .map(|(k, &r)| {
                if r == 0 {
                    bail!("lora.rank_pattern: `{k}` must be >= 1");
                }
                Ok((
                    anchored(&format!(r"^(?:.*\.)?(?:{k})$"), "rank_pattern", k)?,
                    r,
                ))
            })
            .collect::<Result<_>>()?;
        let alpha = self
            .alpha_pattern
            .iter()
            .map(|(k, &a)| {
                Ok((
                    anchored(&format!(r"^(?:.*\.)?(?:{k})$"), "alpha_pattern", k)?,
                    a,
                ))
            })
            .collect::<Result<_>>()?;
        Ok(Resolved {
            cfg: self,
            target,
            exclude: self
                .exclude_modules
                .as_ref()
                .map(|e| Matcher::new(e, "exclude_modules"))
                .transpose()?,
            rank,
            alpha,
        })
    }

    /// The low-rank path's scale for rank `r` and alpha `alpha`: `alpha / r`, or
    /// `alpha / sqrt(r)` with `use_rslora`.
    pub fn scale_for(&self, r: usize, alpha: f64) -> f64 {
        if self.use_rslora {
            alpha / (r as f64).sqrt()
        } else {
            alpha / r as f64
        }
    }

    /// This config for a model of `arch`: PEFT's default targets there when `target_modules`
    /// is the default (`["q_proj", "v_proj"]`, which Phi-3 does not have: its `["qkv_proj"]`).
    pub fn for_arch(&self, arch: crate::config::Arch) -> Self {
        let mut c = self.clone();
        if arch == crate::config::Arch::Phi3 && c.target_modules == peft_targets() {
            c.target_modules = TargetModules::names(&["qkv_proj"]);
        }
        c
    }

    /// This config for `model` as PEFT 0.21 resolves it on transformers 5 ([`Self::for_arch`]
    /// first). On Qwen3-MoE, OLMoE, GLM-4.5 and Mixtral, whose per-expert files transformers 5
    /// fuses on load, PEFT turns the `target_modules` names of the router and the experts'
    /// maps into `target_parameters` (peft's `_MOE_TARGET_MODULE_MAPPING`): `gate` → the router's `gate.weight`,
    /// `gate_proj` and `up_proj` (Mixtral's `w1`, `w3`) → the experts' `gate_up_proj`, at
    /// twice the rank and alpha (`rank_pattern` / `alpha_pattern` `.*\.gate_up_proj`), `down_proj`
    /// (`w2`) → `down_proj`; one of gate and up without the other is an error. So these names
    /// adapt the experts, not a dense layer's MLP nor GLM-4.5's shared experts. `"all-linear"`
    /// and a regular expression are first resolved to the last names of what they match (the
    /// former: the attention's maps and every renamed name).
    pub fn for_model(&self, model: &Transformer) -> Result<Self> {
        let mut c = self.for_arch(model.cfg.arch);
        // DeepSeek's latent attention has no `v_proj`: the default targets there are its
        // query map and `kv_b_proj` (PEFT has no default for it and asks for targets).
        if let Some(m) = model.layers.iter().find_map(|l| l.mla.as_ref())
            && c.target_modules == peft_targets()
        {
            c.target_modules = TargetModules::names(&[m.q_name(), "kv_b_proj"]);
        }
        let renames = moe_renames(model.cfg.arch);
        if renames.is_empty() {
            return Ok(c);
        }
        let targets: Vec<String> = match &c.target_modules {
            TargetModules::Names(v) => v.clone(),
            TargetModules::Pattern(p) if p == ALL_LINEAR => {
                // The attention's maps (DeepSeek's latent attention's own).
                let mut v: Vec<String> = modules(&model.cfg)
                    .iter()
                    .filter(|m| m.group == "self_attn")
                    .map(|m| m.name.to_string())
                    .collect();
                if model.cfg.mla.is_some_and(|m| m.q_lora_rank.is_some()) {
                    v.push("q_a_proj".into());
                }
                v.extend(renames.iter().map(|(old, _)| old.to_string()));
                v
            }
            TargetModules::Pattern(p) => {
                let re = anchored(&format!("^(?:{p})$"), "target_modules", p)?;
                let found = regex_leaves(model, &re, renames);
                if found.is_empty() {
                    return Ok(c);
                }
                found
            }
        };
        let mut params = c.target_parameters.clone();
        let mut kept = Vec::new();
        let mut fused: Vec<&str> = Vec::new();
        for t in targets {
            let Some(&(old, new)) = renames
                .iter()
                .find(|(old, _)| t == *old || t.ends_with(&format!(".{old}")))
            else {
                kept.push(t);
                continue;
            };
            if !params.iter().any(|p| p == new) {
                params.push(new.to_string());
            }
            if new == EXPERT_PARAMETERS[0] && !fused.contains(&old) {
                fused.push(old);
            }
        }
        let pair: Vec<&str> = renames
            .iter()
            .filter(|(_, new)| *new == EXPERT_PARAMETERS[0])
            .map(|(old, _)| *old)
            .collect();
        if !fused.is_empty() && fused.len() < pair.len() {
            let missing: Vec<&&str> = pair.iter().filter(|o| !fused.contains(o)).collect();
            bail!(
                "lora.target_modules: `{}` cannot be adapted without `{}` on {}: transformers 5 fuses them into the experts' gate_up_proj (as PEFT converts them)",
                fused.join("`, `"),
                missing
                    .iter()
                    .map(|s| s.to_string())
                    .collect::<Vec<_>>()
                    .join("`, `"),
                model.cfg.arch.as_str()
            );
        }
        if fused.len() == pair.len() {
            let key = format!(r".*\.{}", EXPERT_PARAMETERS[0]);
            c.rank_pattern.insert(key.clone(), c.r * pair.len());
            c.alpha_pattern
                .insert(key, c.lora_alpha * pair.len() as f64);
        }
        c.target_modules = TargetModules::Names(kept);
        c.target_parameters = params;
        Ok(c)
    }

    /// The scale of a module without a rank or alpha pattern.
    pub fn scale(&self) -> f64 {
        self.scale_for(self.r, self.lora_alpha)
    }
}

/// The low-rank pair of one linear layer, with DoRA's magnitude and LoRA's bias when used.
#[derive(Debug, Clone)]
pub struct Lora {
    /// `(r, in)`, PEFT's `lora_A`.
    pub a: Tensor,
    /// `(out, r)`, PEFT's `lora_B`.
    pub b: Tensor,
    /// `(out,)` bias of `lora_B` (`lora_bias`).
    pub b_bias: Option<Tensor>,
    /// `(out,)` DoRA magnitude (PEFT's `lora_magnitude_vector`).
    pub magnitude: Option<Tensor>,
    /// `alpha / r` (or `alpha / sqrt(r)`).
    pub scale: f64,
    /// Dropout probability; applied only while `a` is a trainable variable (training).
    pub dropout: f64,
    rng: Arc<Mutex<ChaCha8Rng>>,
    /// DoRA's row norms `‖W + scale·B·A‖` for frozen factors (inference), computed once;
    /// reset whenever the factors are replaced ([`set_factors`], [`Self::map_tensors`]).
    norm: OnceLock<Tensor>,
}

impl Lora {
    fn trainable(&self) -> bool {
        self.a.is_variable()
            || self.b.is_variable()
            || self.magnitude.as_ref().is_some_and(|m| m.is_variable())
    }

    /// The adapter's contribution for rows `x` `(n, in)`, added to the base layer's output:
    /// `scale · (B A dropout(x) + b_B)`; with DoRA, `(m/‖W + scale·B·A‖ - 1) · x Wᵀ +
    /// m/‖·‖ · scale · B A dropout(x)` (the norm per output row, detached as in PEFT). `xw` is
    /// `x Wᵀ` without the bias.
    pub fn forward(&self, x: &Tensor, xw: &Tensor, weight: &Tensor) -> Result<Tensor> {
        let dropped = self.dropout > 0.0 && self.a.is_variable();
        let x = if dropped {
            let n = x.elem_count();
            let keep = 1.0 - self.dropout;
            let mask: Vec<f32> = {
                let mut rng = self
                    .rng
                    .lock()
                    .map_err(|_| candle_core::Error::msg("lora rng poisoned"))?;
                (0..n)
                    .map(|_| {
                        if rng.random::<f64>() < keep {
                            (1.0 / keep) as f32
                        } else {
                            0.0
                        }
                    })
                    .collect()
            };
            let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
            (x * mask)?
        } else {
            x.clone()
        };
        let mut low = crate::fused::matmul(&crate::fused::matmul(&x, &self.a.t()?)?, &self.b.t()?)?;
        if let Some(bb) = &self.b_bias {
            low = low.broadcast_add(bb)?;
        }
        let low = (low * self.scale)?;
        let Some(m) = &self.magnitude else {
            return Ok(low);
        };
        let s = m.broadcast_div(&self.dora_norm(weight)?)?;
        // With dropout PEFT applies the magnitude to the dropped input's base output too.
        let base = if dropped {
            crate::fused::frozen_linear(&x, weight)?
        } else {
            xw.clone()
        };
        base.broadcast_mul(&(&s - 1.0)?)? + low.broadcast_mul(&s)?
    }

    /// The whole adapted projection `x Wᵀ + bias + scale · (x Aᵀ) Bᵀ` as one graph node, for
    /// a plain adapter (no active dropout, no `lora_bias`, no DoRA) on a frozen base `weight`:
    /// `None` otherwise (the caller composes). The composition leaves three output-sized
    /// tensors in the graph per projection until backward ends (the base product, the low-rank
    /// product, its scaled copy), where backward needs none of them: this node keeps only its
    /// inputs and its output, and its backward forms `dx = g W + s (g B) A`, `dA = s (g B)ᵀ x`,
    /// `dB = s gᵀ (x Aᵀ)` (the `(n, r)` product recomputed) — never the frozen weight's
    /// gradient. `GRPO_FUSED=0` composes.
    pub fn fused_projection(
        &self,
        x: &Tensor,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<Option<Tensor>> {
        let plain = self.b_bias.is_none()
            && self.magnitude.is_none()
            && !(self.dropout > 0.0 && self.a.is_variable());
        if !plain
            || weight.track_op()
            || bias.is_some_and(|b| b.track_op())
            || x.rank() != 2
            || !grpo_core::fused::enabled()
            || !(x.track_op() || self.trainable())
        {
            return Ok(None);
        }
        use crate::fused::matmul;
        let s = self.scale;
        let (wf, wb) = (weight.detach(), weight.detach());
        let bias = bias.map(|b| b.detach());
        let node = grpo_core::recompute::Recompute::explicit(
            "lora_projection",
            move |a, _| {
                let (x, la, lb) = (&a[0], &a[1], &a[2]);
                let mut y = matmul(x, &wf.t()?)?;
                if let Some(b) = &bias {
                    y = y.broadcast_add(b)?;
                }
                y + (matmul(&matmul(x, &la.t()?)?, &lb.t()?)? * s)?
            },
            move |a, g| {
                let (x, la, lb) = (&a[0], &a[1], &a[2]);
                let gb = (matmul(g, lb)? * s)?; // (n, r)
                let dx = (matmul(g, &wb)? + matmul(&gb, la)?)?;
                let da = matmul(&gb.t()?, x)?;
                let u = matmul(x, &la.t()?)?;
                let db = (matmul(&g.t()?, &u)? * s)?;
                Ok(vec![Some(dx), Some(da), Some(db)])
            },
        );
        Ok(Some(node.apply(&[x, &self.a, &self.b])?))
    }

    /// `‖W + scale·B·A‖` per output row, without gradient.
    fn dora_norm(&self, weight: &Tensor) -> Result<Tensor> {
        if let Some(n) = self.norm.get() {
            return Ok(n.clone());
        }
        let w = (weight.detach() + (self.b.detach().matmul(&self.a.detach())? * self.scale)?)?;
        let n = w.sqr()?.sum(1)?.sqrt()?;
        if !self.trainable() {
            let _ = self.norm.set(n.clone());
        }
        Ok(n)
    }

    /// Applies `f` to every tensor.
    pub fn map_tensors(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            a: f(&self.a)?,
            b: f(&self.b)?,
            b_bias: self.b_bias.as_ref().map(f).transpose()?,
            magnitude: self.magnitude.as_ref().map(f).transpose()?,
            scale: self.scale,
            dropout: self.dropout,
            rng: self.rng.clone(),
            norm: OnceLock::new(),
        })
    }

    /// `scale · B A`, the low-rank update of `W`.
    pub fn delta(&self) -> Result<Tensor> {
        self.b.matmul(&self.a)? * self.scale
    }

    /// The dropout stream and its current state, so that a forward can be replayed with the
    /// same masks (gradient checkpointing recomputes a layer in backward).
    pub(crate) fn dropout_state(&self) -> Option<DropoutState> {
        if self.dropout <= 0.0 || !self.a.is_variable() {
            return None;
        }
        let state = self.rng.lock().ok()?.clone();
        Some((self.rng.clone(), state))
    }

    /// The base layer with the adapter folded in, as PEFT's `merge_and_unload`:
    /// `W + scale·B·A` (DoRA: each row rescaled to `m / ‖W + scale·B·A‖`), and
    /// `bias + scale·b_B` with `lora_bias`.
    pub fn merged(
        &self,
        weight: &Tensor,
        bias: Option<&Tensor>,
    ) -> Result<(Tensor, Option<Tensor>)> {
        let dt = weight.dtype();
        let mut w = (weight + self.delta()?.to_dtype(dt)?)?;
        if let Some(m) = &self.magnitude {
            let s = m.broadcast_div(&self.dora_norm(weight)?)?;
            w = w.broadcast_mul(&s.to_dtype(dt)?.unsqueeze(1)?)?;
        }
        let bias = match (&self.b_bias, bias) {
            (None, b) => b.cloned(),
            (Some(bb), Some(b)) => Some((b + (bb * self.scale)?.to_dtype(b.dtype())?)?),
            (Some(_), None) => bail!(
                "lora_bias: the adapted layer has no bias to merge the adapter's bias into (as in peft)"
            ),
        };
        Ok((w, bias))
    }
}

/// A LoRA dropout stream and a saved state of it.
pub(crate) type DropoutState = (Arc<Mutex<ChaCha8Rng>>, ChaCha8Rng);

/// Runs `f` with each stream set to its saved state, then puts the streams back where they were.
pub(crate) fn replay_dropout<T>(saved: &[DropoutState], f: impl FnOnce() -> T) -> Result<T> {
    fn lock(m: &Mutex<ChaCha8Rng>) -> Result<std::sync::MutexGuard<'_, ChaCha8Rng>> {
        m.lock()
            .map_err(|_| candle_core::Error::msg("lora rng poisoned"))
    }
    let mut now = Vec::with_capacity(saved.len());
    for (rng, state) in saved {
        let mut g = lock(rng)?;
        now.push(std::mem::replace(&mut *g, state.clone()));
    }
    let out = f();
    for ((rng, _), state) in saved.iter().zip(now) {
        *lock(rng)? = state;
    }
    Ok(out)
}

/// PEFT key of a LoRA factor: `base_model.model.model.layers.{i}.{group}.{module}.lora_{A,B}.weight`.
pub fn peft_key(layer: usize, group: &str, module: &str, factor: char) -> String {
    format!("{}.lora_{factor}.weight", peft_prefix(layer, group, module))
}

fn peft_prefix(layer: usize, group: &str, module: &str) -> String {
    format!("base_model.model.{}", module_name(layer, group, module))
}

/// Visits every adapter tensor of `model` with its key: `lora_A.weight`, `lora_B.weight`,
/// `lora_B.bias` (`lora_bias`), `lora_magnitude_vector` (DoRA), and the base biases that `bias`
/// trains (`{module}.base_layer.bias` on adapted layers, `{module}.bias` on the others, as PEFT
/// names them). The keys are PEFT's, except on a fused module ([`FUSED_MODULES`]): there `A`
/// is the module's (one tensor, shared by its parts: a replaced `A` is given to every part)
/// and the rest each part's, under the part's name (`…self_attn.q_proj.lora_B.weight`, rows in
/// the model's order); [`to_peft_layout`] joins them as PEFT saves them.
fn visit(
    model: &mut Transformer,
    bias: &str,
    f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
) -> Result<()> {
    let arch = model.cfg.arch;
    let mods = modules(&model.cfg);
    for (i, layer) in model.layers.iter_mut().enumerate() {
        let lins = layer.linears_mut();
        for m in mods {
            let p = peft_prefix(i, m.group, m.name);
            let (_, first) = m.parts[0];
            let adapted = lins[first].lora.is_some();
            if let Some(l) = lins[first].lora.as_mut() {
                f(format!("{p}.lora_A.weight"), &mut l.a)?;
                let a = l.a.clone();
                for &(_, j) in &m.parts[1..] {
                    if let Some(l) = lins[j].lora.as_mut() {
                        l.a = a.clone();
                    }
                }
            }
            for &(part, j) in m.parts {
                visit_part(&peft_prefix(i, m.group, part), lins[j], adapted, bias, f)?;
            }
        }
        // The shared expert's maps, each a module of its own.
        for (name, lin) in extra_sites(layer, i, arch) {
            let q = format!("base_model.model.{name}");
            let adapted = lin.lora.is_some();
            if let Some(l) = lin.lora.as_mut() {
                f(format!("{q}.lora_A.weight"), &mut l.a)?;
            }
            visit_part(&q, lin, adapted, bias, f)?;
        }
        // The experts' adapters (`target_parameters`), per expert: `A` of `gate_up_proj` shared
        // by the gate and up maps, `B` for each; [`to_peft_layout`] stacks them as PEFT does.
        if let Some(moe) = layer.moe.as_mut() {
            if let Some(l) = moe.router.lora.as_mut() {
                let q = format!("base_model.model.model.layers.{i}.mlp.gate");
                f(format!("{q}.lora_A.weight"), &mut l.a)?;
                f(format!("{q}.lora_B.weight"), &mut l.b)?;
                l.norm = OnceLock::new();
            }
            let p = format!("base_model.model.{}", experts_module(i, arch));
            for (e, x) in moe.experts.iter_mut().enumerate() {
                let q = format!("{p}.{e}");
                if let Some(l) = x.gate_proj.lora.as_mut() {
                    f(format!("{q}.gate_up_proj.lora_A.weight"), &mut l.a)?;
                    let a = l.a.clone();
                    if let Some(u) = x.up_proj.lora.as_mut() {
                        u.a = a;
                    }
                }
                for (part, lin) in [
                    ("gate_proj", &mut x.gate_proj),
                    ("up_proj", &mut x.up_proj),
                    ("down_proj", &mut x.down_proj),
                ] {
                    if let Some(l) = lin.lora.as_mut() {
                        if part == "down_proj" {
                            f(format!("{q}.down_proj.lora_A.weight"), &mut l.a)?;
                        }
                        f(format!("{q}.{part}.lora_B.weight"), &mut l.b)?;
                        l.norm = OnceLock::new();
                    }
                }
            }
        }
    }
    for (name, lin) in model_sites(model) {
        let q = format!("base_model.model.{name}");
        let adapted = lin.lora.is_some();
        if let Some(l) = lin.lora.as_mut() {
            f(format!("{q}.lora_A.weight"), &mut l.a)?;
        }
        visit_part(&q, lin, adapted, bias, f)?;
    }
    // PEFT's trainable tokens of the embedding (tied to the head when it is).
    if let Some(d) = model.token_delta.as_mut() {
        f(TOKENS_KEY.to_string(), &mut d.delta)?;
    }
    // A sequence classifier's head is trained whole beside the adapters (PEFT's
    // `modules_to_save = ["score"]`, as TRL advises for reward models).
    if let Some(s) = model.score.as_mut() {
        f(SCORE_KEY.to_string(), s)?;
    }
    // A token classifier's head has a bias, trained with it.
    if let Some(b) = model.score_bias.as_mut() {
        f(SCORE_BIAS_KEY.to_string(), b)?;
    }
    Ok(())
}

/// [`visit`] of one map `lin` under its PEFT prefix `q` (its module's, or its part's in a fused
/// module), but `A`: `lora_B`, its bias, DoRA's magnitude, and the base bias `bias` trains
/// (`adapted`: whether the module has an adapter).
fn visit_part(
    q: &str,
    lin: &mut crate::model::Linear,
    adapted: bool,
    bias: &str,
    f: &mut dyn FnMut(String, &mut Tensor) -> Result<()>,
) -> Result<()> {
    if let Some(l) = lin.lora.as_mut() {
        f(format!("{q}.lora_B.weight"), &mut l.b)?;
        if let Some(t) = l.b_bias.as_mut() {
            f(format!("{q}.lora_B.bias"), t)?;
        }
        if let Some(t) = l.magnitude.as_mut() {
            f(format!("{q}.lora_magnitude_vector"), t)?;
        }
        l.norm = OnceLock::new();
    }
    let trained = match bias {
        "all" => true,
        "lora_only" => adapted,
        _ => false,
    };
    if let (true, Some(b)) = (trained, lin.bias.as_mut()) {
        let key = match adapted {
            true => format!("{q}.base_layer.bias"),
            false => format!("{q}.bias"),
        };
        f(key, b)?;
    }
    Ok(())
}

/// The suffixes of a fused module's per-part tensors ([`visit`]).
const PART_TENSORS: [&str; 3] = ["lora_B.weight", "lora_B.bias", "lora_magnitude_vector"];

/// Adapter tensors by [`factors`]' keys in PEFT's layout: a fused module's parts joined
/// (`qkv_proj.lora_B.weight` = q, k, v rows; q and k rows back in transformers' order).
pub fn to_peft_layout(
    cfg: &crate::config::ModelConfig,
    tensors: Vec<(String, Tensor)>,
) -> Result<Vec<(String, Tensor)>> {
    let fused = crate::layout::fused_parts(cfg);
    let reordered = crate::layout::qk_reordered_apart(cfg);
    if fused.is_empty() && cfg.moe.is_none() && !reordered {
        return Ok(tensors);
    }
    let mut map: HashMap<String, Tensor> = tensors.into_iter().collect();
    stack_expert_adapters(cfg, &mut map)?;
    if reordered {
        reorder_qk_rows(cfg, &mut map, false)?;
    }
    for i in 0..cfg.num_hidden_layers {
        for f in &fused {
            for suffix in PART_TENSORS {
                let keys: Vec<String> = f
                    .parts
                    .iter()
                    .map(|p| format!("{}.{suffix}", peft_prefix(i, f.group, p.0)))
                    .collect();
                if !keys.iter().all(|k| map.contains_key(k)) {
                    continue;
                }
                let rows: Vec<Tensor> = keys.iter().filter_map(|k| map.remove(k)).collect();
                map.insert(
                    format!("{}.{suffix}", peft_prefix(i, f.group, f.name)),
                    f.join(cfg, &rows)?,
                );
            }
        }
    }
    let mut out: Vec<(String, Tensor)> = map.into_iter().collect();
    out.sort_by(|a, b| a.0.cmp(&b.0));
    Ok(out)
}

/// PEFT's adapter tensors (keys without adapter names) in [`factors`]' layout: a fused module's
/// `lora_B` rows, `lora_B` bias and DoRA magnitude split into its parts (the inverse of
/// [`to_peft_layout`]). A fused tensor of the wrong size is an error naming it.
pub fn from_peft_layout(
    cfg: &crate::config::ModelConfig,
    mut map: HashMap<String, Tensor>,
) -> Result<HashMap<String, Tensor>> {
    split_expert_adapters(cfg, &mut map)?;
    if crate::layout::qk_reordered_apart(cfg) {
        reorder_qk_rows(cfg, &mut map, true)?;
    }
    for i in 0..cfg.num_hidden_layers {
        for f in crate::layout::fused_parts(cfg) {
            for suffix in PART_TENSORS {
                let key = format!("{}.{suffix}", peft_prefix(i, f.group, f.name));
                let Some(t) = map.remove(&key) else {
                    continue;
                };
                for (part, piece) in f.split(cfg, &t, &format!("adapter tensor `{key}`"))? {
                    map.insert(format!("{}.{suffix}", peft_prefix(i, f.group, part)), piece);
                }
            }
        }
    }
    Ok(map)
}

/// A family whose q and k rows the model reorders ([`crate::layout::rotary_order`]: ERNIE 4.5's
/// and GLM's interleaved RoPE) as maps of their own: the rows of its q / k adapters' `lora_B`, `lora_B`
/// bias, DoRA magnitude and trained base biases, to the model's order (`to_model`) or back to
/// transformers' (PEFT's).
fn reorder_qk_rows(
    cfg: &crate::config::ModelConfig,
    map: &mut HashMap<String, Tensor>,
    to_model: bool,
) -> Result<()> {
    for i in 0..cfg.num_hidden_layers {
        for part in ["q_proj", "k_proj"] {
            let p = peft_prefix(i, "self_attn", part);
            for suffix in PART_TENSORS.iter().chain(&["base_layer.bias", "bias"]) {
                let key = format!("{p}.{suffix}");
                if let Some(t) = map.remove(&key) {
                    let t = match part {
                        "q_proj" => crate::layout::q_rows(cfg, &t, to_model),
                        _ => crate::layout::reorder_heads(cfg, &t, to_model),
                    }
                    .map_err(|e| candle_core::Error::msg(format!("adapter tensor `{key}`: {e}")))?;
                    map.insert(key, t);
                }
            }
        }
    }
    Ok(())
}

/// Where PEFT keeps the adapter of layer `i`'s experts' `param`: under the experts module, or
/// its `base_layer` for `gate_up_proj` when `down_proj` is adapted too (PEFT wraps the first
/// registered parameter first, [`EXPERT_PARAMETERS`]).
fn expert_peft_prefix(
    cfg: &crate::config::ModelConfig,
    i: usize,
    param: &str,
    both: bool,
) -> String {
    let p = format!("base_model.model.{}", experts_module(i, cfg.arch));
    match both && param == EXPERT_PARAMETERS[0] {
        true => format!("{p}.base_layer"),
        false => p,
    }
}

/// The experts' per-expert adapters ([`visit`]'s keys) stacked as PEFT's ParamWrapper holds
/// them: `lora_A` `(r · experts, in)` with expert `e`'s rows at `e·r…`, `lora_B`
/// `(out, r · experts)` whose column `j·experts + e` is expert `e`'s column `j`; `gate_up_proj`'s
/// `B` rows are the gate's, then the up's (gpt-oss's alternate, gate first, as its fused
/// `gate_up_proj`'s outputs do).
fn stack_expert_adapters(
    cfg: &crate::config::ModelConfig,
    map: &mut HashMap<String, Tensor>,
) -> Result<()> {
    let Some(m) = &cfg.moe else {
        return Ok(());
    };
    for i in (0..cfg.num_hidden_layers).filter(|i| m.sparse(*i)) {
        let p = format!("base_model.model.{}", experts_module(i, cfg.arch));
        let present: Vec<&str> = EXPERT_PARAMETERS
            .into_iter()
            .filter(|q| map.contains_key(&format!("{p}.0.{q}.lora_A.weight")))
            .collect();
        let both = present.len() == EXPERT_PARAMETERS.len();
        for param in present {
            let parts = expert_parts(param);
            let mut a = Vec::with_capacity(m.num_experts);
            let mut b = Vec::with_capacity(m.num_experts);
            for e in 0..m.num_experts {
                let mut take = |k: String| {
                    map.remove(&k).ok_or_else(|| {
                        candle_core::Error::msg(format!("adapter tensor `{k}` is missing"))
                    })
                };
                a.push(take(format!("{p}.{e}.{param}.lora_A.weight"))?);
                let rows = parts
                    .iter()
                    .map(|part| take(format!("{p}.{e}.{part}.lora_B.weight")))
                    .collect::<Result<Vec<_>>>()?;
                // gpt-oss's gate and up outputs alternate.
                b.push(match cfg.arch.interleaved_gate_up() {
                    true => crate::layout::interleave_rows(&rows)?,
                    false => Tensor::cat(&rows, 0)?,
                });
            }
            let b = Tensor::stack(&b, 2)?;
            let (out, r, e) = b.dims3()?;
            let q = expert_peft_prefix(cfg, i, param, both);
            map.insert(format!("{q}.lora_A.weight"), Tensor::cat(&a, 0)?);
            map.insert(format!("{q}.lora_B.weight"), b.reshape((out, r * e))?);
        }
    }
    Ok(())
}

/// PEFT's stacked expert adapters split per expert (the inverse of [`stack_expert_adapters`]).
/// One adapter alone under the experts module is told apart by its shape (`gate_up_proj`:
/// `A` over `hidden`, `B` over twice the experts' width); a shape that fits neither, or a rank
/// that does not divide by the expert count, is an error naming the tensor.
fn split_expert_adapters(
    cfg: &crate::config::ModelConfig,
    map: &mut HashMap<String, Tensor>,
) -> Result<()> {
    let Some(m) = &cfg.moe else {
        return Ok(());
    };
    let (h, w, n) = (cfg.hidden_size, m.moe_intermediate_size, m.num_experts);
    for i in (0..cfg.num_hidden_layers).filter(|i| m.sparse(*i)) {
        let inner = expert_peft_prefix(cfg, i, EXPERT_PARAMETERS[0], true);
        let outer = expert_peft_prefix(cfg, i, EXPERT_PARAMETERS[1], true);
        let both = map.contains_key(&format!("{inner}.lora_A.weight"));
        let mut found = Vec::new();
        if both {
            found.push((inner, EXPERT_PARAMETERS[0]));
            found.push((outer, EXPERT_PARAMETERS[1]));
        } else if let (Some(a), Some(b)) = (
            map.get(&format!("{outer}.lora_A.weight")),
            map.get(&format!("{outer}.lora_B.weight")),
        ) {
            let param = match (a.dim(1)?, b.dim(0)?) {
                (x, y) if x == h && y == 2 * w => EXPERT_PARAMETERS[0],
                (x, y) if x == w && y == h => EXPERT_PARAMETERS[1],
                _ => bail!(
                    "adapter tensors `{outer}.lora_A.weight` {:?} / `lora_B.weight` {:?} fit neither the experts' gate_up_proj nor their down_proj",
                    a.dims(),
                    b.dims()
                ),
            };
            found.push((outer, param));
        }
        let p = format!("base_model.model.{}", experts_module(i, cfg.arch));
        for (q, param) in found {
            let (ka, kb) = (format!("{q}.lora_A.weight"), format!("{q}.lora_B.weight"));
            let missing =
                |k: &str| candle_core::Error::msg(format!("adapter tensor `{k}` is missing"));
            let a = map.remove(&ka).ok_or_else(|| missing(&ka))?;
            let b = map.remove(&kb).ok_or_else(|| missing(&kb))?;
            let rows = a.dim(0)?;
            if !rows.is_multiple_of(n) || b.rank() != 2 || b.dim(1)? != rows {
                bail!(
                    "adapter tensors `{ka}` {:?} / `{kb}` {:?} are not the stacked factors of {n} experts",
                    a.dims(),
                    b.dims()
                );
            }
            let r = rows / n;
            let out = b.dim(0)?;
            let (want_in, want_out) = match param == EXPERT_PARAMETERS[0] {
                true => (h, 2 * w),
                false => (w, h),
            };
            if (a.dim(1)?, out) != (want_in, want_out) {
                bail!(
                    "adapter tensors `{ka}` {:?} / `{kb}` {:?} do not fit the experts' {param} ({want_out} × {want_in} per expert)",
                    a.dims(),
                    [out, rows]
                );
            }
            let b = b.reshape((out, r, n))?;
            for e in 0..n {
                map.insert(
                    format!("{p}.{e}.{param}.lora_A.weight"),
                    a.narrow(0, e * r, r)?.contiguous()?,
                );
                let be = b.narrow(2, e, 1)?.squeeze(2)?;
                let parts = expert_parts(param);
                let rows = out / parts.len();
                for (j, part) in parts.iter().enumerate() {
                    // gpt-oss's gate and up outputs alternate.
                    let bj = match cfg.arch.interleaved_gate_up() {
                        true => crate::layout::deinterleave_rows(&be, parts.len(), j)?,
                        false => be.narrow(0, j * rows, rows)?.contiguous()?,
                    };
                    map.insert(format!("{p}.{e}.{part}.lora_B.weight"), bj);
                }
            }
        }
    }
    Ok(())
}

/// A `target_modules` list that names modules `arch` does not have as PEFT sees them: Phi-3's
/// q/k/v and gate/up (fused there), or the fused names on the other families.
fn check_targets(cfg: &LoraConfig, arch: crate::config::Arch) -> Result<()> {
    let v = match &cfg.target_modules {
        TargetModules::Names(v) => v,
        TargetModules::Pattern(_) => return Ok(()),
    };
    let phi3 = arch == crate::config::Arch::Phi3;
    for m in v {
        let last = m.rsplit('.').next().unwrap_or(m);
        if phi3 && ["q_proj", "k_proj", "v_proj", "gate_proj", "up_proj"].contains(&last) {
            bail!(
                "lora.target_modules: `{m}`: Phi-3 stores q, k, v as one `qkv_proj` and gate, up as one `gate_up_proj` (as PEFT adapts them): name qkv_proj, o_proj, gate_up_proj, down_proj, or \"{ALL_LINEAR}\""
            );
        }
        if arch.glm() && ["qkv_proj", "gate_proj", "up_proj"].contains(&last) {
            bail!(
                "lora.target_modules: `{m}`: {} stores gate and up as one `gate_up_proj` (as PEFT adapts it) and q, k, v apart: name q_proj, k_proj, v_proj, o_proj, gate_up_proj, down_proj, or \"{ALL_LINEAR}\"",
                arch.as_str()
            );
        }
        if arch.glm() && last == "gate_up_proj" {
            continue;
        }
        let nanochat = arch == crate::config::Arch::NanoChat;
        if nanochat && ["gate_proj", "up_proj", "down_proj"].contains(&last) {
            bail!(
                "lora.target_modules: `{m}`: nanochat's MLP is `fc1` → ReLU² → `fc2` (no gate): name q_proj, k_proj, v_proj, o_proj, fc1, fc2, or \"{ALL_LINEAR}\""
            );
        }
        if !nanochat && NANOCHAT_MLP.contains(&last) {
            bail!(
                "lora.target_modules: `{m}`: only nanochat names its MLP fc1 / fc2; {} has {TARGET_MODULES:?}",
                arch.as_str()
            );
        }
        if !phi3 && FUSED_MODULES.contains(&last) {
            bail!(
                "lora.target_modules: `{m}`: only Phi-3 has fused projections; {} has {TARGET_MODULES:?}",
                arch.as_str()
            );
        }
    }
    Ok(())
}

/// The PEFT key of a sequence classifier's `score` head, trained whole (`modules_to_save`).
pub const SCORE_KEY: &str = "base_model.model.score.weight";

/// A token classifier's head bias in a PEFT adapter file (saved with [`SCORE_KEY`]).
pub const SCORE_BIAS_KEY: &str = "base_model.model.score.bias";

/// The PEFT key of the embedding's trainable tokens (`trainable_token_indices`).
pub const TOKENS_KEY: &str =
    "base_model.model.model.embed_tokens.token_adapter.trainable_tokens_delta";

/// Adds fresh adapters to `model` as PEFT initialises them: `A` Kaiming-uniform (bound
/// `1/sqrt(in)`), `B` and `lora_B`'s bias zero, DoRA's magnitude the row norms of `W`, so the
/// adapted model starts equal to the base. Returns the trainable tensors by PEFT key
/// (including the base biases `cfg.bias` trains).
pub fn attach(
    model: &mut Transformer,
    cfg: &LoraConfig,
    seed: u64,
) -> Result<Vec<(String, Tensor)>> {
    let resolved = cfg.resolve()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (dtype, device) = (model.dtype(), model.device().clone());
    let drop_rng = Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(
        seed ^ 0x9e37_79b9_7f4a_7c15,
    )));
    check_targets(cfg, model.cfg.arch)?;
    let arch = model.cfg.arch;
    let mut any = false;
    let mut any_param = false;
    let mods = modules(&model.cfg);
    for (i, layer) in model.layers.iter_mut().enumerate() {
        let lins = layer.linears_mut();
        for m in mods {
            // An MoE layer has no dense MLP (PEFT matches no module there either).
            if lins[m.parts[0].1].is_absent() {
                continue;
            }
            let Some((r, scale)) = resolved.adapter(i, m.group, m.name) else {
                continue;
            };
            any = true;
            // One `A` for the module (its parts share their input), `B` for each part.
            let inp = lins[m.parts[0].1].weight.dim(1)?;
            let a = fresh_a(&mut rng, r, inp, dtype, &device)?;
            for &(_, j) in m.parts {
                let lin = &mut *lins[j];
                lin.lora = Some(fresh_lora(lin, a.clone(), scale, cfg, &drop_rng)?);
            }
        }
        // The shared expert's maps, each a module of its own (PEFT's `nn.Linear`s).
        for (name, lin) in extra_sites(layer, i, arch) {
            let Some((r, scale)) = resolved.adapter_at(i, &name) else {
                continue;
            };
            any = true;
            let a = fresh_a(&mut rng, r, lin.weight.dim(1)?, dtype, &device)?;
            lin.lora = Some(fresh_lora(lin, a, scale, cfg, &drop_rng)?);
        }
        // The experts' stacked weights (`target_parameters`), as PEFT's ParamWrapper adapts
        // them: per expert an `A` (Kaiming-uniform over its input, as PEFT's stacked `lora_A`
        // rows) and a zero `B`; gate and up share their `A` (one `gate_up_proj`).
        let Some(moe) = layer.moe.as_mut() else {
            continue;
        };
        for param in EXPERT_PARAMETERS {
            let Some((r, scale)) = resolved.expert_adapter(i, arch, param) else {
                continue;
            };
            any = true;
            any_param = true;
            for x in moe.experts.iter_mut() {
                let parts: Vec<&mut crate::model::Linear> = match param {
                    "gate_up_proj" => vec![&mut x.gate_proj, &mut x.up_proj],
                    _ => vec![&mut x.down_proj],
                };
                let inp = parts[0].weight.dim(1)?;
                let bound = 1.0 / (inp as f64).sqrt();
                let a: Vec<f32> = (0..r * inp)
                    .map(|_| rng.random_range(-bound..bound) as f32)
                    .collect();
                let a = Tensor::from_vec(a, (r, inp), &device)?.to_dtype(dtype)?;
                for lin in parts {
                    let o = lin.weight.dim(0)?;
                    lin.lora = Some(Lora {
                        a: a.clone(),
                        b: Tensor::zeros((o, r), dtype, &device)?,
                        b_bias: None,
                        magnitude: None,
                        scale,
                        dropout: 0.0,
                        rng: drop_rng.clone(),
                        norm: OnceLock::new(),
                    });
                }
            }
        }
        // The router's weight (`target_parameters` `gate.weight`): one `A`/`B` pair.
        if let Some((r, scale)) = resolved.router_adapter(i)
            && router_adaptable(arch)
        {
            any = true;
            any_param = true;
            // (DeepSeek's router weight is f32 in any model: its adapter too.)
            let (inp, dt) = (moe.router.weight.dim(1)?, moe.router.weight.dtype());
            let a = fresh_a(&mut rng, r, inp, dt, &device)?;
            moe.router.lora = Some(fresh_lora(&moe.router, a, scale, cfg, &drop_rng)?);
        }
    }
    for (name, lin) in model_sites(model) {
        let Some((r, scale)) = resolved.adapter_outside(&name) else {
            continue;
        };
        any = true;
        let a = fresh_a(&mut rng, r, lin.weight.dim(1)?, dtype, &device)?;
        lin.lora = Some(fresh_lora(lin, a, scale, cfg, &drop_rng)?);
    }
    if !cfg.target_parameters.is_empty() && !any_param {
        if cfg
            .target_parameters
            .iter()
            .any(|t| t.ends_with(ROUTER_PARAMETER))
            && !router_adaptable(arch)
        {
            bail!(
                "lora.target_parameters: {}'s router takes no `{ROUTER_PARAMETER}` adapter here (only the routers transformers 5 holds as a parameter: Qwen3-MoE's, Qwen2-MoE's, Mixtral's, OLMoE's, GLM-4.5's, DeepSeek-V2/V3's, GLM-4.7-Flash's)",
                arch.as_str()
            );
        }
        bail!(
            "lora.target_parameters {:?}: no experts' weight of this {} model matches (they are a mixture of experts' `{}.gate_up_proj` / `down_proj`)",
            cfg.target_parameters,
            arch.as_str(),
            experts_module(0, arch).trim_start_matches("model.layers.0."),
        );
    }
    if !any {
        bail!(
            "lora.target_modules: no module of the model matches (with exclude_modules and layers_to_transform)"
        );
    }
    // Trainable tokens start at their rows of the embedding (PEFT copies them).
    model.token_delta = match &cfg.trainable_token_indices {
        None => None,
        Some(t) => {
            let indices = t.embedding()?;
            let v = model.cfg.vocab_size as u32;
            if let Some(bad) = indices.iter().find(|&&i| i >= v) {
                bail!(
                    "lora.trainable_token_indices: token {bad} is outside the vocabulary ({v} tokens)"
                );
            }
            let idx = Tensor::from_vec(indices.clone(), indices.len(), model.device())?;
            let delta = model.embed_tokens.detach().index_select(&idx, 0)?.copy()?;
            Some(crate::model::TokenDelta { indices, delta })
        }
    };
    Ok(factors(model, cfg))
}

/// A fresh `A` `(r, inp)`, Kaiming-uniform as PEFT draws it (bound `1/sqrt(inp)`).
fn fresh_a(
    rng: &mut ChaCha8Rng,
    r: usize,
    inp: usize,
    dtype: DType,
    device: &candle_core::Device,
) -> Result<Tensor> {
    let bound = 1.0 / (inp as f64).sqrt();
    let a: Vec<f32> = (0..r * inp)
        .map(|_| rng.random_range(-bound..bound) as f32)
        .collect();
    Tensor::from_vec(a, (r, inp), device)?.to_dtype(dtype)
}

/// A fresh adapter of `lin` with `A` = `a`: `B` zero (so the map starts as the base), `lora_B`'s
/// bias zero with `lora_bias`, DoRA's magnitude the row norms of `W` with `use_dora`.
fn fresh_lora(
    lin: &crate::model::Linear,
    a: Tensor,
    scale: f64,
    cfg: &LoraConfig,
    drop_rng: &Arc<Mutex<ChaCha8Rng>>,
) -> Result<Lora> {
    let (dtype, device) = (lin.weight.dtype(), lin.weight.device());
    let (o, r) = (lin.weight.dim(0)?, a.dim(0)?);
    Ok(Lora {
        a,
        b: Tensor::zeros((o, r), dtype, device)?,
        b_bias: cfg
            .lora_bias
            .then(|| Tensor::zeros(o, dtype, device))
            .transpose()?,
        magnitude: cfg
            .use_dora
            .then(|| lin.weight.detach().sqr()?.sum(1)?.sqrt())
            .transpose()?,
        scale,
        dropout: cfg.lora_dropout,
        rng: drop_rng.clone(),
        norm: OnceLock::new(),
    })
}

/// Replaces the adapter tensors by those in `tensors` (PEFT keys, as [`factors`] lists them),
/// e.g. `Var`s.
pub fn set_factors(
    model: &mut Transformer,
    cfg: &LoraConfig,
    tensors: &HashMap<String, Tensor>,
) -> Result<()> {
    visit(model, &cfg.bias, &mut |k, slot| {
        let t = tensors
            .get(&k)
            .ok_or_else(|| candle_core::Error::msg(format!("adapter tensor `{k}` is missing")))?;
        if t.dims() != slot.dims() {
            bail!(
                "adapter tensor `{k}` has shape {:?}, expected {:?}",
                t.dims(),
                slot.dims()
            );
        }
        *slot = t.clone();
        Ok(())
    })
}

/// The adapter tensors by PEFT key: the factors, `lora_B` biases, DoRA magnitudes and the
/// base biases `cfg.bias` trains. On a fused module (Phi-3's) `A` is the module's and the
/// rest each part's, under the part's name ([`to_peft_layout`] joins them).
pub fn factors(model: &Transformer, cfg: &LoraConfig) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    let mut m = model.clone();
    visit(&mut m, &cfg.bias, &mut |k, t| {
        out.push((k, t.clone()));
        Ok(())
    })
    .expect("collecting cannot fail");
    out
}

/// Folds every adapter into its base layer as PEFT's `merge_and_unload` does (see
/// [`Lora::merged`]) and removes the adapters.
pub fn merge(model: &Transformer) -> Result<Transformer> {
    let mut m = model.detached();
    m.merge_token_delta()?;
    let arch = m.cfg.arch;
    let mods = modules(&m.cfg);
    for (i, layer) in m.layers.iter_mut().enumerate() {
        let lins = layer.linears_mut();
        for module in mods {
            for &(part, j) in module.parts {
                let lin = &mut *lins[j];
                if let Some(l) = lin.lora.take() {
                    let (w, b) = l.merged(&lin.weight, lin.bias.as_ref()).map_err(|e| {
                        candle_core::Error::msg(format!(
                            "{}: {e}",
                            module_name(i, module.group, part)
                        ))
                    })?;
                    lin.weight = w;
                    lin.bias = b;
                }
            }
        }
        for (name, lin) in extra_sites(layer, i, arch) {
            merge_into(&name, lin)?;
        }
        if let Some(moe) = layer.moe.as_mut() {
            let router = &mut moe.router;
            if let Some(l) = router.lora.take() {
                router.weight = (&router.weight + l.delta()?.to_dtype(router.weight.dtype())?)?;
            }
            for x in moe.experts.iter_mut() {
                for lin in [&mut x.gate_proj, &mut x.up_proj, &mut x.down_proj] {
                    if let Some(l) = lin.lora.take() {
                        lin.weight = (&lin.weight + l.delta()?.to_dtype(lin.weight.dtype())?)?;
                    }
                }
            }
        }
    }
    for (name, lin) in model_sites(&mut m) {
        merge_into(&name, lin)?;
    }
    Ok(m)
}

/// The map `name`'s adapter, if any, folded into its weight and bias ([`Lora::merged`]).
fn merge_into(name: &str, lin: &mut crate::model::Linear) -> Result<()> {
    if let Some(l) = lin.lora.take() {
        let (w, b) = l
            .merged(&lin.weight, lin.bias.as_ref())
            .map_err(|e| candle_core::Error::msg(format!("{name}: {e}")))?;
        lin.weight = w;
        lin.bias = b;
    }
    Ok(())
}

/// A decoding copy ([`Transformer::for_decoding`]) with every adapter folded into its base
/// ([`merge`]), as TRL merges a peft model before it hands the weights to vLLM: a decode step
/// then runs one product per packed map instead of the base's and each adapter's two more
/// (on the 0.77B model, 28 layers × 7 × 3 launches per token). It costs a copy of the adapted
/// weights for as long as it lives: make one per policy version, drop it after generating.
pub fn merged_for_decoding(model: &Transformer) -> Result<Transformer> {
    merge(model)?.for_decoding()
}

/// Writes `adapter_config.json` and `adapter_model.safetensors` (f32) in PEFT's format.
pub fn save_peft(
    model: &Transformer,
    cfg: &LoraConfig,
    dir: &Path,
    base_model: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", dir.display())))?;
    let cfg = &cfg.for_model(model)?;
    // PEFT saves "all-linear" as the names of the modules it matched: the model's (no gate in
    // Arcee's MLP, no dense MLP in an all-MoE model).
    let present = |m: &&Module| {
        model
            .layers
            .iter()
            .any(|l| !l.linears()[m.parts[0].1].is_absent())
    };
    let targets = match &cfg.target_modules {
        TargetModules::Pattern(p) if p == ALL_LINEAR => {
            let mut names: Vec<&str> = modules(&model.cfg)
                .iter()
                .filter(present)
                .map(|m| m.name)
                .collect();
            // The shared expert's maps (and Qwen2-MoE's gate) are linear modules too.
            let shared = model
                .layers
                .iter()
                .find_map(|l| l.moe.as_ref()?.shared.as_ref());
            if let Some((_, gate)) = shared {
                let gate = gate.as_ref().map(|_| SHARED_EXPERT_GATE);
                for n in ["gate_proj", "up_proj", "down_proj"]
                    .into_iter()
                    .chain(gate)
                {
                    if !names.contains(&n) {
                        names.push(n);
                    }
                }
            }
            // Gemma 4's per-layer-input maps and its experts' router, as PEFT names them.
            let experts = model.layers.iter().any(|l| l.experts.is_some());
            names.extend(GEMMA4_MODULES.iter().filter(|m| match **m {
                "proj" => experts,
                _ => model.per_layer.is_some(),
            }));
            // Qwen3.5's linear-attention maps, LFM2's convolutions'.
            if let Some(d) = model.layers.iter().find_map(|l| l.delta.as_ref()) {
                for n in d.linear_names() {
                    if !names.contains(n) {
                        names.push(n);
                    }
                }
            }
            serde_json::json!(names)
        }
        t => serde_json::json!(t),
    };
    // A vision-language model: the same modules, of its language model only (PEFT would match
    // the vision tower's same-named modules too).
    let targets = match (&model.vision, targets.as_array()) {
        (Some(_), Some(names)) => {
            let names: Vec<String> = names
                .iter()
                .filter_map(|n| n.as_str().map(regex::escape))
                .collect();
            serde_json::json!(format!(
                r"model\.language_model\..*\.(?:{})",
                names.join("|")
            ))
        }
        _ => targets,
    };
    let classifier = model.score.is_some();
    let config = serde_json::json!({
        "trainable_token_indices": cfg.trainable_token_indices,
        "peft_type": "LORA",
        "task_type": match (classifier, model.cfg.token_classification.is_some()) {
            (true, true) => "TOKEN_CLS",
            (true, false) => "SEQ_CLS",
            (false, _) => "CAUSAL_LM",
        },
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": targets,
        "target_parameters": match cfg.target_parameters.is_empty() {
            true => serde_json::Value::Null,
            false => serde_json::json!(cfg.target_parameters),
        },
        "exclude_modules": cfg.exclude_modules,
        "bias": cfg.bias,
        "lora_bias": cfg.lora_bias,
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": if classifier { serde_json::json!(["score"]) } else { serde_json::Value::Null },
        "use_rslora": cfg.use_rslora,
        "use_dora": cfg.use_dora,
        "layers_to_transform": cfg.layers_to_transform,
        "layers_pattern": null,
        "rank_pattern": cfg.rank_pattern,
        "alpha_pattern": cfg.alpha_pattern,
        "revision": null,
    });
    let path = dir.join("adapter_config.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let mut tensors: HashMap<String, Tensor> = to_peft_layout(&model.cfg, factors(model, cfg))?
        .into_iter()
        .map(|(k, t)| Ok((k, t.detach().to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    // PEFT's `save_embedding_layers = "auto"`: a vocabulary resized since the base (TRL's
    // `clone_chat_template`) travels with the adapter, so a base of the original size loads it.
    let base_vocab = std::fs::read_to_string(Path::new(base_model).join("config.json"))
        .ok()
        .and_then(|t| serde_json::from_str::<serde_json::Value>(&t).ok())
        .and_then(|v| v.get("vocab_size").and_then(serde_json::Value::as_u64));
    if base_vocab.is_some_and(|v| v as usize != model.cfg.vocab_size) {
        let (embed, head) = match model.token_delta.is_some() {
            true => (EMBED_KEYS[0], HEAD_KEYS[0]),
            false => (EMBED_KEYS[1], HEAD_KEYS[1]),
        };
        tensors.insert(
            embed.into(),
            model.embed_tokens.detach().to_dtype(DType::F32)?,
        );
        if let Some(h) = &model.lm_head {
            tensors.insert(head.into(), h.detach().to_dtype(DType::F32)?);
        }
    }
    // A vision-language model's language model under the names PEFT gives it there
    // (transformers 5's `model.language_model.*`).
    let tensors: HashMap<String, Tensor> = match model.vision.is_some() {
        true => tensors
            .into_iter()
            .map(|(k, t)| (vision_language_key(&k), t))
            .collect(),
        false => tensors,
    };
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors"))
}

/// The PEFT key of a vision-language model's language-model tensor:
/// `base_model.model.model.layers.*` as `base_model.model.model.language_model.layers.*` (the
/// head's keys unchanged).
fn vision_language_key(key: &str) -> String {
    match key.strip_prefix("base_model.model.model.") {
        Some(rest) => format!("base_model.model.model.language_model.{rest}"),
        None => key.to_string(),
    }
}

/// A PEFT key of an adapter trained on a vision-language model under the causal LM's name:
/// `model.language_model.*` (transformers 5) and `language_model.model.*` (transformers 4)
/// as `model.*`, `language_model.lm_head` as `lm_head`.
fn causal_key(key: &str) -> String {
    let b = "base_model.model.";
    let Some(rest) = key.strip_prefix(b) else {
        return key.to_string();
    };
    if let Some(r) = rest.strip_prefix("model.language_model.") {
        format!("{b}model.{r}")
    } else if let Some(r) = rest.strip_prefix("language_model.") {
        format!("{b}{r}")
    } else {
        key.to_string()
    }
}

/// Where PEFT saves a resized embedding (with trainable tokens, without).
const EMBED_KEYS: [&str; 2] = [
    "base_model.model.model.embed_tokens.token_adapter.base_layer.weight",
    "base_model.model.model.embed_tokens.weight",
];
/// Where PEFT saves a resized output head (with trainable tokens tied to it, without).
const HEAD_KEYS: [&str; 2] = [
    "base_model.model.lm_head.token_adapter.base_layer.weight",
    "base_model.model.lm_head.weight",
];
/// PEFT's trainable tokens of a head tied to the embedding: the embedding's, saved again.
const TIED_HEAD_TOKENS_KEY: &str = "base_model.model.lm_head.token_adapter.trainable_tokens_delta";

/// `init_lora_weights` values that only choose how a new adapter starts.
const INIT_ONLY: [&str; 4] = ["gaussian", "eva", "orthogonal", "loftq"];

/// Fields of PEFT's `LoraConfig` that do not change what a saved adapter computes here.
const IGNORED: [&str; 13] = [
    "task_type",
    "base_model_name_or_path",
    "revision",
    "inference_mode",
    "auto_mapping",
    "peft_version",
    "loftq_config",
    "eva_config",
    "corda_config",
    "runtime_config",
    "megatron_config",
    "megatron_core",
    "ensure_weight_tying",
];

/// Reads PEFT's `adapter_config.json` (already parsed): every option we support is taken, any
/// other that is set is refused, naming it and the file.
pub fn config_from_peft(v: &serde_json::Value, path: &Path) -> Result<LoraConfig> {
    let p = path.display();
    let obj = v
        .as_object()
        .ok_or_else(|| candle_core::Error::msg(format!("{p}: not a JSON object")))?;
    if obj.get("peft_type").and_then(|x| x.as_str()) != Some("LORA") {
        bail!("{p}: peft_type must be LORA");
    }
    let field = |k: &str| {
        obj.get(k)
            .filter(|x| !x.is_null())
            .ok_or_else(|| candle_core::Error::msg(format!("{p}: field `{k}` is missing")))
    };
    let bad = |k: &str, why: &str| -> candle_core::Error {
        candle_core::Error::msg(format!("{p}: `{k}`: {why}"))
    };
    fn parse<T: serde::de::DeserializeOwned>(
        p: &std::path::Display<'_>,
        k: &str,
        x: &serde_json::Value,
    ) -> Result<T> {
        serde_json::from_value(x.clone())
            .map_err(|e| candle_core::Error::msg(format!("{p}: `{k}`: {e}")))
    }
    let target_parameters: Vec<String> = match obj.get("target_parameters") {
        None | Some(serde_json::Value::Null) => Vec::new(),
        Some(x) => parse(&p, "target_parameters", x)?,
    };
    // PEFT leaves `target_modules` unset when only parameters are targeted.
    let target_modules = match obj.get("target_modules").filter(|x| !x.is_null()) {
        None if !target_parameters.is_empty() => TargetModules::Names(Vec::new()),
        _ => parse(&p, "target_modules", field("target_modules")?)?,
    };
    let mut cfg = LoraConfig {
        r: field("r")?
            .as_u64()
            .ok_or_else(|| bad("r", "expected a positive integer"))? as usize,
        lora_alpha: field("lora_alpha")?
            .as_f64()
            .ok_or_else(|| bad("lora_alpha", "expected a number"))?,
        target_modules,
        target_parameters,
        ..LoraConfig::default()
    };
    // An option that is unset, false or empty changes nothing: peft's defaults.
    let unset = |x: &serde_json::Value| match x {
        serde_json::Value::Null | serde_json::Value::Bool(false) => true,
        serde_json::Value::Array(a) => a.is_empty(),
        serde_json::Value::Object(o) => o.is_empty(),
        serde_json::Value::String(s) => s.is_empty(),
        _ => false,
    };
    for (k, x) in obj {
        match k.as_str() {
            "peft_type" | "r" | "lora_alpha" | "target_modules" | "target_parameters" => {}
            _ if IGNORED.contains(&k.as_str()) => {}
            "lora_dropout" => cfg.lora_dropout = x.as_f64().unwrap_or(0.0),
            _ if unset(x) => {}
            "exclude_modules" => cfg.exclude_modules = Some(parse(&p, k, x)?),
            "bias" => cfg.bias = parse(&p, k, x)?,
            "use_rslora" => cfg.use_rslora = parse(&p, k, x)?,
            "use_dora" => cfg.use_dora = parse(&p, k, x)?,
            "lora_bias" => cfg.lora_bias = parse(&p, k, x)?,
            "rank_pattern" => cfg.rank_pattern = parse(&p, k, x)?,
            "alpha_pattern" => cfg.alpha_pattern = parse(&p, k, x)?,
            "layers_to_transform" => cfg.layers_to_transform = Some(parse(&p, k, x)?),
            "trainable_token_indices" => {
                let t: TokenIndices = parse(&p, k, x)?;
                t.embedding().map_err(|e| bad(k, &e.to_string()))?;
                cfg.trainable_token_indices = Some(t);
            }
            "layers_pattern" => {
                let ok = match x {
                    serde_json::Value::String(s) => s == "layers",
                    serde_json::Value::Array(a) => a.iter().any(|s| s == "layers"),
                    _ => false,
                };
                if !ok {
                    return Err(bad(
                        k,
                        "only \"layers\" (model.layers.N) names the decoder layers of our models",
                    ));
                }
            }
            "qalora_group_size" => {}
            "init_lora_weights" => match x {
                serde_json::Value::Bool(true) => {}
                serde_json::Value::String(s) if INIT_ONLY.contains(&s.to_lowercase().as_str()) => {}
                _ => {
                    return Err(bad(
                        k,
                        &format!(
                            "{x} is not supported: that initialisation changes the base weights; convert the adapter to plain LoRA with peft (save_pretrained(path_initial_model_for_weight_conversion=...))"
                        ),
                    ));
                }
            },
            // A reward model's head, trained whole beside the adapters (see `load_peft`).
            "modules_to_save" if x == &serde_json::json!(["score"]) => {}
            "modules_to_save" => {
                return Err(bad(
                    k,
                    "full copies of base modules in an adapter are not supported (except a sequence classifier's [\"score\"])",
                ));
            }
            _ => {
                return Err(bad(
                    k,
                    &format!(
                        "{x} is not supported (LoRA options supported: r, lora_alpha, lora_dropout, target_modules, target_parameters, exclude_modules, use_rslora, use_dora, bias, lora_bias, rank_pattern, alpha_pattern, layers_to_transform)"
                    ),
                ));
            }
        }
    }
    cfg.validate()
        .map_err(|e| candle_core::Error::msg(format!("{p}: {e}")))?;
    Ok(cfg)
}

/// PEFT 0.21's conversion on load of an adapter written before transformers 5 fused a
/// converted family's experts ([`LoraConfig::for_model`]): per-expert factors
/// (`….experts.{e}.gate_proj.lora_A.weight`; Mixtral's `block_sparse_moe.experts.{e}.w1…`)
/// become the model's, gate and up joined into one adapter of their two ranks — `A` their `A`s
/// stacked, gate first, each `B` beside zeros (PEFT's block-diagonal `B`) — and down kept; the
/// router's factors move to `mlp.gate`; the dense layers' MLP factors, which the converted
/// config no longer targets, are dropped, as PEFT drops them. A gate without its up (or the
/// reverse) is an error naming the expert.
fn convert_v4_experts(model: &Transformer, map: &mut HashMap<String, Tensor>) -> Result<()> {
    let arch = model.cfg.arch;
    let renames = moe_renames(arch);
    let Some(m) = model.cfg.moe.as_ref().filter(|_| !renames.is_empty()) else {
        return Ok(());
    };
    let old = |new: &str| -> Vec<&str> {
        renames
            .iter()
            .filter(|(_, n)| *n == new)
            .map(|(o, _)| *o)
            .collect()
    };
    let (pair, down) = (old(EXPERT_PARAMETERS[0]), old(EXPERT_PARAMETERS[1])[0]);
    let layer_key = |i: usize, rest: &str| format!("base_model.model.model.layers.{i}.{rest}");
    for i in 0..model.cfg.num_hidden_layers {
        if !m.sparse(i) {
            for n in ["gate_proj", "up_proj", "down_proj"] {
                for kind in ["lora_A", "lora_B"] {
                    map.remove(&layer_key(i, &format!("mlp.{n}.{kind}.weight")));
                }
            }
            continue;
        }
        for kind in ["lora_A", "lora_B"] {
            let router = |b: &str| layer_key(i, &format!("{b}.gate.{kind}.weight"));
            if let Some(t) = map.remove(&router("block_sparse_moe")) {
                map.insert(router("mlp"), t);
            }
        }
        let internal = format!("base_model.model.{}", experts_module(i, arch));
        for e in 0..m.num_experts {
            let mut take = |name: &str, kind: &str| {
                ["mlp", "block_sparse_moe"].iter().find_map(|b| {
                    map.remove(&layer_key(
                        i,
                        &format!("{b}.experts.{e}.{name}.{kind}.weight"),
                    ))
                })
            };
            let (ag, bg) = (take(pair[0], "lora_A"), take(pair[0], "lora_B"));
            let (au, bu) = (take(pair[1], "lora_A"), take(pair[1], "lora_B"));
            let (ad, bd) = (take(down, "lora_A"), take(down, "lora_B"));
            match (ag, bg, au, bu) {
                (Some(ag), Some(bg), Some(au), Some(bu)) => {
                    let (rg, ru) = (ag.dim(0)?, au.dim(0)?);
                    let zeros = |rows: usize, cols: usize| {
                        Tensor::zeros((rows, cols), bg.dtype(), bg.device())
                    };
                    let bg2 = Tensor::cat(&[&bg, &zeros(bg.dim(0)?, ru)?], 1)?;
                    let bu2 = Tensor::cat(&[&zeros(bu.dim(0)?, rg)?, &bu], 1)?;
                    let q = format!("{internal}.{e}");
                    map.insert(
                        format!("{q}.gate_up_proj.lora_A.weight"),
                        Tensor::cat(&[&ag, &au], 0)?,
                    );
                    map.insert(format!("{q}.gate_proj.lora_B.weight"), bg2);
                    map.insert(format!("{q}.up_proj.lora_B.weight"), bu2);
                }
                (None, None, None, None) => {}
                _ => bail!(
                    "layer {i}, expert {e}: the adapter's `{}` and `{}` factors must all be there (transformers 5 fuses them into gate_up_proj)",
                    pair[0],
                    pair[1]
                ),
            }
            if let (Some(a), Some(b)) = (ad, bd) {
                map.insert(format!("{internal}.{e}.down_proj.lora_A.weight"), a);
                map.insert(format!("{internal}.{e}.down_proj.lora_B.weight"), b);
            }
        }
    }
    Ok(())
}

/// Reads a PEFT adapter directory and attaches it to `model` (replacing any adapters): the
/// factors, DoRA magnitudes and `lora_B` biases, and any base-layer biases the file holds
/// (trained with `bias = "all"` / `"lora_only"`), which replace the model's.
pub fn load_peft(model: &mut Transformer, dir: &Path) -> Result<LoraConfig> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| candle_core::Error::msg(format!("{}: invalid JSON: {e}", path.display())))?;
    // An adapter of a mixture of experts written before transformers 5 fused the experts
    // names them as modules: converted as PEFT 0.21 converts it on load.
    let cfg = config_from_peft(&v, &path)?
        .for_model(model)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let file = dir.join("adapter_model.safetensors");
    let mut loaded: HashMap<String, Tensor> =
        candle_core::safetensors::load(&file, model.device())?
            .into_iter()
            .map(|(k, t)| (causal_key(&k), t))
            .collect();
    // A resized vocabulary saved with the adapter (PEFT's `save_embedding_layers`): the
    // embedding (and an untied head) replace the base's; a tied head's copies are the
    // embedding's.
    let take =
        |m: &mut HashMap<String, Tensor>, keys: &[&str]| keys.iter().find_map(|k| m.remove(*k));
    if let Some(e) = take(&mut loaded, &EMBED_KEYS) {
        let h = model.cfg.hidden_size;
        if e.rank() != 2 || e.dim(1)? != h {
            bail!(
                "{}: the saved embedding has shape {:?}, expected (vocab, {h})",
                file.display(),
                e.dims()
            );
        }
        let (dtype, dev) = (model.dtype(), model.device().clone());
        model.cfg.vocab_size = e.dim(0)?;
        model.embed_tokens = e.to_dtype(model.embed_tokens.dtype())?.to_device(&dev)?;
        // A tied head's saved copy is the embedding itself.
        let head = take(&mut loaded, &HEAD_KEYS);
        match (&model.lm_head, head) {
            (Some(_), Some(t)) => model.lm_head = Some(t.to_dtype(dtype)?.to_device(&dev)?),
            (Some(_), None) => bail!(
                "{}: the embedding is resized but the untied output head is not saved",
                file.display()
            ),
            (None, _) => {}
        }
    }
    if model.lm_head.is_none() {
        loaded.remove(TIED_HEAD_TOKENS_KEY);
    }
    // An adapter that carries a `score` head makes a causal base a classifier, whose head the
    // file then sets: a sequence classifier (a reward model, `task_type = "SEQ_CLS"`), or with
    // the head's bias a token classifier of as many labels as the head has rows (a process
    // reward model, `"TOKEN_CLS"`).
    let score_keys = [SCORE_KEY, "base_model.model.score.default.weight"];
    let bias_keys = [SCORE_BIAS_KEY, "base_model.model.score.default.bias"];
    if model.score.is_none()
        && let Some(w) = score_keys.iter().find_map(|k| loaded.get(*k))
    {
        *model = match bias_keys.iter().any(|k| loaded.contains_key(*k)) {
            true => model.clone().into_token_classifier(w.dim(0)?, 0)?,
            false => model.clone().into_sequence_classifier(0)?,
        };
    }
    attach(model, &cfg, 0)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let (dtype, dev) = (model.dtype(), model.device().clone());
    // PEFT may save keys with the adapter name (`lora_A.default.weight`); accept both.
    let tensors: HashMap<String, Tensor> = loaded
        .into_iter()
        .map(|(k, t)| {
            let k = k
                .replace(".default.", ".")
                .replace("lora_magnitude_vector.weight", "lora_magnitude_vector");
            let k = k.strip_suffix(".default").map(String::from).unwrap_or(k);
            Ok((k, t.to_dtype(dtype)?.to_device(&dev)?))
        })
        .collect::<Result<_>>()?;
    let in_file =
        |e: candle_core::Error| candle_core::Error::msg(format!("{}: {e}", file.display()));
    let mut tensors = tensors;
    convert_v4_experts(model, &mut tensors).map_err(in_file)?;
    let mut tensors = from_peft_layout(&model.cfg, tensors).map_err(in_file)?;
    // A classifier base with an adapter that did not train its head keeps the base's head.
    if let (Some(s), false) = (&model.score, tensors.contains_key(SCORE_KEY)) {
        tensors.insert(SCORE_KEY.to_string(), s.clone());
    }
    if let (Some(b), false) = (&model.score_bias, tensors.contains_key(SCORE_BIAS_KEY)) {
        tensors.insert(SCORE_BIAS_KEY.to_string(), b.clone());
    }
    set_factors(model, &LoraConfig::default(), &tensors).map_err(in_file)?;
    for (k, _) in factors(model, &LoraConfig::default()) {
        tensors.remove(&k);
    }
    // The rest must be base-layer biases.
    visit(model, "all", &mut |k, slot| {
        if !k.ends_with("bias") || k.ends_with("lora_B.bias") {
            return Ok(());
        }
        let plain = k.replace(".base_layer.bias", ".bias");
        let other = k.replace(".bias", ".base_layer.bias");
        for key in [&k, &plain, &other] {
            if let Some(t) = tensors.remove(key.as_str()) {
                if t.dims() != slot.dims() {
                    bail!(
                        "adapter tensor `{key}` has shape {:?}, expected {:?}",
                        t.dims(),
                        slot.dims()
                    );
                }
                *slot = t;
            }
        }
        Ok(())
    })
    .map_err(in_file)?;
    if let Some(k) = tensors.keys().min() {
        return Err(in_file(candle_core::Error::msg(format!(
            "tensor `{k}` is not a LoRA tensor of this model (only q/k/v/o/gate/up/down_proj adapters (a shared expert's too), the experts' gate_up_proj/down_proj (target_parameters), DoRA magnitudes, lora_B and base-layer biases are supported)"
        ))));
    }
    Ok(cfg)
}
