//! A TRL recipe as a config of ours: the flat YAML `trl grpo --config recipe.yaml` reads
//! (`GRPOConfig` with its `TrainingArguments`, `ModelConfig`, `ScriptArguments` and
//! `GRPOScriptArguments`; or `trl rloo`'s `RLOOConfig`, `trl sft`'s `SFTConfig`, `trl dpo`'s
//! `DPOConfig`, `trl kto`'s `KTOConfig`, `trl reward`'s `RewardConfig`, or the `PPOConfig` of TRL's PPO example script) translated key by key into the sections of a `grpo-cli train` config,
//! with TRL's defaults written out where ours differ, and a note for every key that has no
//! place here and why.
//!
//! `grpo-cli import-trl RECIPE.yaml` prints (or `--out` writes) the TOML.

use std::path::Path;

use anyhow::{Result, bail};
use serde_json::{Map, Value, json};

/// The translation: our config tree and a note per TRL key left out (or changed in meaning).
#[derive(Debug, Clone, Default)]
pub struct Imported {
    /// The config, as `grpo-cli train` reads it.
    pub tree: Value,
    /// `(TRL key, why)` for what does not carry over as written.
    pub notes: Vec<(String, String)>,
}

/// TrainingArguments' and ModelConfig's keys every trainer shares, where they live here.
pub const COMMON: &[(&str, &str)] = &[
    ("output_dir", "output_dir"),
    ("overwrite_output_dir", "overwrite_output_dir"),
    ("learning_rate", "optim.learning_rate"),
    ("optim", "optim.optim"),
    ("adam_beta1", "optim.adam_beta1"),
    ("adam_beta2", "optim.adam_beta2"),
    ("adam_epsilon", "optim.adam_epsilon"),
    ("weight_decay", "optim.weight_decay"),
    ("lr_scheduler_type", "optim.lr_scheduler_type"),
    ("lr_scheduler_kwargs", "optim.lr_scheduler_kwargs"),
    ("warmup_ratio", "optim.warmup_ratio"),
    ("max_grad_norm", "optim.max_grad_norm"),
    ("num_train_epochs", "train.num_train_epochs"),
    (
        "per_device_train_batch_size",
        "train.per_device_train_batch_size",
    ),
    ("gradient_checkpointing", "train.gradient_checkpointing"),
    ("activation_checkpointing", "train.gradient_checkpointing"),
    ("seed", "train.seed"),
    ("logging_steps", "train.logging_steps"),
    ("logging_dir", "train.logging_dir"),
    ("shuffle_dataset", "train.shuffle_dataset"),
    ("disable_dropout", "train.disable_dropout"),
    ("save_total_limit", "train.save_total_limit"),
    ("router_aux_loss_coef", "loss.router_aux_loss_coef"),
];

/// GRPOConfig's own keys that are ours under another section, same name and meaning.
pub const GRPO: &[(&str, &str)] = &[
    ("num_iterations", "optim.num_iterations"),
    ("log_completions", "train.log_completions"),
    ("num_completions_to_print", "train.num_completions_to_print"),
    ("num_generations", "rollout.num_generations"),
    ("num_generations_eval", "rollout.num_generations_eval"),
    ("max_completion_length", "rollout.max_completion_length"),
    ("temperature", "rollout.temperature"),
    ("top_p", "rollout.top_p"),
    ("top_k", "rollout.top_k"),
    ("min_p", "rollout.min_p"),
    ("repetition_penalty", "rollout.repetition_penalty"),
    (
        "vllm_structured_outputs_regex",
        "rollout.structured_outputs_regex",
    ),
    ("chat_template_kwargs", "model.chat_template_kwargs"),
    ("cast_lm_head_to_fp32", "model.cast_lm_head_to_fp32"),
    ("beta", "reference.beta"),
    ("sync_ref_model", "reference.sync_ref_model"),
    ("ref_model_mixup_alpha", "reference.ref_model_mixup_alpha"),
    ("ref_model_sync_steps", "reference.ref_model_sync_steps"),
    ("epsilon", "loss.epsilon"),
    ("epsilon_high", "loss.epsilon_high"),
    ("delta", "loss.delta"),
    ("sapo_temperature_pos", "loss.sapo_temperature_pos"),
    ("sapo_temperature_neg", "loss.sapo_temperature_neg"),
    ("vespo_k_pos", "loss.vespo_k_pos"),
    ("vespo_lambda_pos", "loss.vespo_lambda_pos"),
    ("vespo_k_neg", "loss.vespo_k_neg"),
    ("vespo_lambda_neg", "loss.vespo_lambda_neg"),
    (
        "importance_sampling_level",
        "loss.importance_sampling_level",
    ),
    (
        "multi_objective_aggregation",
        "loss.multi_objective_aggregation",
    ),
    ("scale_rewards", "loss.scale_rewards"),
    ("loss_type", "loss.loss_type"),
    (
        "mask_truncated_completions",
        "loss.mask_truncated_completions",
    ),
    ("replay_buffer_size", "loss.replay_buffer_size"),
    ("top_entropy_quantile", "loss.top_entropy_quantile"),
    ("entropy_coef", "loss.entropy_coef"),
    ("use_adaptive_entropy", "loss.use_adaptive_entropy"),
    ("entropy_coef_min", "loss.entropy_coef_min"),
    ("entropy_coef_max", "loss.entropy_coef_max"),
    ("entropy_coef_delta", "loss.entropy_coef_delta"),
    ("entropy_target", "loss.entropy_target"),
    (
        "vllm_importance_sampling_correction",
        "loss.vllm_importance_sampling_correction",
    ),
    (
        "vllm_importance_sampling_mode",
        "loss.vllm_importance_sampling_mode",
    ),
    (
        "vllm_importance_sampling_clip_min",
        "loss.vllm_importance_sampling_clip_min",
    ),
    (
        "vllm_importance_sampling_clip_max",
        "loss.vllm_importance_sampling_clip_max",
    ),
    (
        "vllm_importance_sampling_cap",
        "loss.vllm_importance_sampling_clip_max",
    ),
    (
        "off_policy_mask_threshold",
        "loss.off_policy_mask_threshold",
    ),
    ("use_bias_correction_kl", "loss.use_bias_correction_kl"),
    ("reward_weights", "reward_weights"),
    ("max_tool_calling_iterations", "environment.max_turns"),
];

/// RLOOConfig's own keys; its others are GRPOConfig's (but `beta`, RLOO's reward penalty).
pub const RLOO: &[(&str, &str)] = &[
    ("beta", "rloo.beta"),
    ("normalize_advantages", "rloo.normalize_advantages"),
    ("reward_clip_range", "rloo.reward_clip_range"),
];

/// SFTConfig's own keys.
pub const SFT: &[(&str, &str)] = &[
    ("max_length", "sft.max_length"),
    ("packing", "sft.packing"),
    ("packing_strategy", "sft.packing_strategy"),
    ("eval_packing", "sft.eval_packing"),
    ("padding_free", "sft.padding_free"),
    ("completion_only_loss", "sft.completion_only_loss"),
    ("assistant_only_loss", "sft.assistant_only_loss"),
    ("loss_type", "sft.loss_type"),
    ("dataset_text_field", "sft.dataset_text_field"),
    ("eos_token", "sft.eos_token"),
    ("pad_token", "sft.pad_token"),
    ("chat_template_path", "model.chat_template_path"),
];

/// DPOConfig's own keys.
pub const DPO: &[(&str, &str)] = &[
    ("beta", "dpo.beta"),
    ("loss_type", "dpo.loss_type"),
    ("loss_weights", "dpo.loss_weights"),
    ("label_smoothing", "dpo.label_smoothing"),
    ("f_divergence_type", "dpo.f_divergence_type"),
    ("f_alpha_divergence_coef", "dpo.f_alpha_divergence_coef"),
    ("discopop_tau", "dpo.discopop_tau"),
    ("ld_alpha", "dpo.ld_alpha"),
    ("use_weighting", "dpo.use_weighting"),
    ("max_length", "dpo.max_length"),
    ("precompute_ref_log_probs", "dpo.precompute_ref_log_probs"),
    ("sync_ref_model", "reference.sync_ref_model"),
    ("ref_model_mixup_alpha", "reference.ref_model_mixup_alpha"),
    ("ref_model_sync_steps", "reference.ref_model_sync_steps"),
];

/// KTOConfig's own keys.
pub const KTO: &[(&str, &str)] = &[
    ("beta", "kto.beta"),
    ("loss_type", "kto.loss_type"),
    ("desirable_weight", "kto.desirable_weight"),
    ("undesirable_weight", "kto.undesirable_weight"),
    ("max_length", "kto.max_length"),
    ("precompute_ref_log_probs", "kto.precompute_ref_log_probs"),
    ("sync_ref_model", "reference.sync_ref_model"),
    ("ref_model_mixup_alpha", "reference.ref_model_mixup_alpha"),
    ("ref_model_sync_steps", "reference.ref_model_sync_steps"),
];

/// RewardConfig's own keys.
pub const REWARD: &[(&str, &str)] = &[
    ("max_length", "reward.max_length"),
    (
        "center_rewards_coefficient",
        "reward.center_rewards_coefficient",
    ),
    ("eos_token", "reward.eos_token"),
    ("pad_token", "reward.pad_token"),
    ("chat_template_path", "model.chat_template_path"),
];

/// PPOConfig's keys with a place here (TRL's experimental PPOTrainer, as its example script
/// `examples/scripts/ppo/ppo.py` reads them).
pub const PPO: &[(&str, &str)] = &[
    ("num_ppo_epochs", "ppo.num_ppo_epochs"),
    ("num_mini_batches", "ppo.num_mini_batches"),
    ("whiten_rewards", "ppo.whiten_rewards"),
    ("kl_coef", "ppo.kl_coef"),
    ("kl_estimator", "ppo.kl_estimator"),
    ("cliprange", "ppo.cliprange"),
    ("vf_coef", "ppo.vf_coef"),
    ("cliprange_value", "ppo.cliprange_value"),
    ("gamma", "ppo.gamma"),
    ("lam", "ppo.lam"),
    ("missing_eos_penalty", "ppo.missing_eos_penalty"),
    ("response_length", "rollout.max_completion_length"),
    ("temperature", "rollout.temperature"),
];

/// PPOConfig's keys with no place here, and why.
const PPO_DROPPED: &[(&str, &str)] = &[
    (
        "local_rollout_forward_batch_size",
        "the rollout's forwards run per micro-batch (train.per_device_train_batch_size)",
    ),
    (
        "num_sample_generations",
        "completions are logged every step (train.log_completions)",
    ),
    ("stop_token", "generation stops at the model's EOS"),
    ("stop_token_id", "generation stops at the model's EOS"),
    ("dataset_num_proc", "rows are tokenised as they are read"),
    ("exp_name", "the run is named by output_dir"),
    ("model_adapter_name", "one adapter per run"),
    (
        "ref_adapter_name",
        "the reference is the base with the adapter off",
    ),
    ("world_size", "one process"),
    ("num_total_batches", "computed from total_episodes"),
    ("micro_batch_size", "computed"),
    ("local_batch_size", "computed"),
    ("batch_size", "computed"),
    ("local_mini_batch_size", "computed"),
    ("mini_batch_size", "computed"),
    (
        "max_steps",
        "PPOConfig trains for total_episodes (or num_train_epochs), not max_steps",
    ),
];

/// Which TRL trainer's recipe (`trl grpo`, `trl sft`, `trl dpo`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Trainer {
    /// `trl grpo`: GRPOConfig.
    Grpo,
    /// `trl rloo`: RLOOConfig (GRPOConfig's keys, its own `beta`, `normalize_advantages`,
    /// `reward_clip_range`; 2 generations by default).
    Rloo,
    /// `trl sft`: SFTConfig.
    Sft,
    /// `trl dpo`: DPOConfig.
    Dpo,
    /// `trl kto`: KTOConfig.
    Kto,
    /// `trl reward`: RewardConfig.
    Reward,
    /// PPOConfig, as TRL's example script `examples/scripts/ppo/ppo.py` reads it (there is no
    /// `trl ppo` subcommand).
    Ppo,
}

impl Trainer {
    /// From its name (`grpo`, `sft`, `dpo`).
    pub fn parse(name: &str) -> Result<Self> {
        Ok(match name {
            "grpo" => Trainer::Grpo,
            "rloo" => Trainer::Rloo,
            "sft" => Trainer::Sft,
            "dpo" => Trainer::Dpo,
            "kto" => Trainer::Kto,
            "reward" => Trainer::Reward,
            "ppo" => Trainer::Ppo,
            other => bail!(
                "--trainer {other}: expected grpo, rloo, sft, dpo, kto, reward (the `trl` subcommand the recipe is for) or ppo (examples/scripts/ppo/ppo.py's recipe)"
            ),
        })
    }

    /// The keys of its config, beside the shared ones.
    pub fn keys(self) -> impl Iterator<Item = &'static (&'static str, &'static str)> {
        let (own, grpo): (&'static [(&str, &str)], bool) = match self {
            Trainer::Grpo => (GRPO, false),
            Trainer::Rloo => (RLOO, true),
            Trainer::Sft => (SFT, false),
            Trainer::Dpo => (DPO, false),
            Trainer::Kto => (KTO, false),
            Trainer::Reward => (REWARD, false),
            Trainer::Ppo => (PPO, false),
        };
        let inherited = GRPO
            .iter()
            .filter(move |(k, _)| grpo && !own.iter().any(|(o, _)| o == k));
        own.iter().chain(inherited)
    }
}

/// TRL keys with no place here, and why (settings of machinery this binary does not have).
pub const DROPPED: &[(&str, &str)] = &[
    (
        "trust_remote_code",
        "no Python model code runs; the architectures are built in",
    ),
    ("remove_unused_columns", "rows keep every column"),
    ("ds3_gather_for_generation", "one process, no DeepSpeed"),
    (
        "pad_to_multiple_of",
        "batches are padded to their longest row",
    ),
    ("cache_implementation", "one KV cache implementation"),
    ("vllm_model_impl", "a colocated vLLM is not started"),
    ("vllm_enable_sleep_mode", "a colocated vLLM is not started"),
    ("vllm_group_port", "a colocated vLLM is not started"),
    (
        "vllm_gpu_memory_utilization",
        "a colocated vLLM is not started",
    ),
    ("vllm_max_model_length", "a colocated vLLM is not started"),
    (
        "vllm_tensor_parallel_size",
        "a colocated vLLM is not started",
    ),
    ("log_multimodal", "text only"),
    ("log_unique_prompts", "text only"),
    ("log_completions_hub_repo", "no hub uploads"),
    ("push_to_hub", "no hub uploads"),
    ("hub_model_id", "no hub uploads"),
    ("hub_strategy", "no hub uploads"),
    ("hub_private_repo", "no hub uploads"),
    (
        "use_transformers_continuous_batching",
        "the batched generator is always on",
    ),
    (
        "transformers_continuous_batching_config",
        "the batched generator is always on",
    ),
    (
        "use_transformers_paged",
        "the batched generator is always on",
    ),
    (
        "use_liger_kernel",
        "the fused kernels (RMSNorm, RoPE, SiLU·mul, log-softmax) are always on",
    ),
    ("torch_empty_cache_steps", "no PyTorch caching allocator"),
    (
        "gradient_checkpointing_kwargs",
        "checkpointing is per decoder layer",
    ),
    ("run_name", "the run is named by output_dir"),
    ("logging_strategy", "metrics are logged every logging_steps"),
    (
        "logging_first_step",
        "metrics are logged every logging_steps",
    ),
    (
        "dataloader_num_workers",
        "the data stage runs on its own thread",
    ),
    (
        "dataloader_pin_memory",
        "the data stage runs on its own thread",
    ),
    ("ddp_find_unused_parameters", "one process"),
    ("torch_compile", "no PyTorch"),
    (
        "model_revision",
        "models load from a local directory or GGUF file",
    ),
    (
        "attn_implementation",
        "attention is this project's own fused kernel",
    ),
    ("lora_task_type", "adapters are for causal LM"),
    ("dataset_config", "data is read from local files"),
    ("dataset_streaming", "files are always read in chunks"),
    (
        "ignore_data_skip",
        "a resumed run continues at its data position",
    ),
    ("bf16_full_eval", "evaluation runs in the model's dtype"),
    (
        "resume_from_checkpoint",
        "resume with `grpo-cli train --resume`",
    ),
    ("use_cpu", "the device is model.device (cpu by default)"),
    (
        "activation_checkpointing_kwargs",
        "checkpointing is per decoder layer",
    ),
    (
        "activation_offloading",
        "not built; train.gradient_checkpointing lowers activation memory",
    ),
    (
        "precompute_ref_batch_size",
        "the reference runs in the learner's micro-batches",
    ),
    (
        "dataset_kwargs",
        "rows are prepared as they are read (skip_prepare_dataset: not built)",
    ),
    (
        "truncation_mode",
        "rows keep their first max_length tokens (keep_start, TRL's only supported mode)",
    ),
];

/// TRL's `reward_funcs` names (`trl grpo`'s registry) as our rewards.
fn reward_of(name: &str) -> Option<Value> {
    Some(match name {
        "accuracy_reward" => json!({"type": "math_verify"}),
        "reasoning_accuracy_reward" => json!({"type": "reasoning_accuracy"}),
        "think_format_reward" => json!({"type": "think_format"}),
        // `trl grpo` builds it with these values.
        "get_soft_overlong_punishment" => json!({
            "type": "overlong", "name": "soft_overlong_punishment",
            "max_completion_length": 1280, "overlong_buffer": 256,
        }),
        dotted if dotted.contains('.') => {
            let (module, function) = dotted.rsplit_once('.')?;
            json!({"type": "python", "path": module, "function": function})
        }
        _ => return None,
    })
}

pub(crate) fn set(tree: &mut Value, dotted: &str, v: Value) {
    let mut node = tree;
    let parts: Vec<&str> = dotted.split('.').collect();
    for p in &parts[..parts.len() - 1] {
        if !node.get(*p).is_some_and(Value::is_object) {
            node[*p] = Value::Object(Map::new());
        }
        node = &mut node[*p];
    }
    node[parts[parts.len() - 1]] = v;
}

fn dtype_of(v: &Value) -> Option<&'static str> {
    match v.as_str()? {
        "bfloat16" | "bf16" => Some("bf16"),
        "float16" | "fp16" | "half" => Some("f16"),
        "float32" | "fp32" | "float" => Some("f32"),
        _ => None,
    }
}

fn as_u64(v: Option<&Value>) -> Option<u64> {
    v.and_then(|v| {
        v.as_u64().or_else(|| {
            v.as_f64()
                .filter(|f| f.fract() == 0.0 && *f >= 0.0)
                .map(|f| f as u64)
        })
    })
}

/// The data files of a local dataset for a split: the file itself, or the files of a dataset
/// directory (a Hub snapshot's `data/train-00000-of-00001.parquet`, `train.jsonl`, a `train/`
/// folder) whose name starts with the split's.
pub fn split_files(dataset: &Path, split: &str) -> Vec<String> {
    if dataset.is_file() {
        return vec![dataset.display().to_string()];
    }
    let mut found = Vec::new();
    let mut stack = vec![dataset.to_path_buf()];
    while let Some(dir) = stack.pop() {
        let Ok(entries) = std::fs::read_dir(&dir) else {
            continue;
        };
        for e in entries.flatten() {
            let p = e.path();
            let name = e.file_name().to_string_lossy().to_string();
            if name.starts_with('.') {
                continue;
            }
            if p.is_dir() {
                stack.push(p);
                continue;
            }
            // `save_to_disk`'s own metadata sits beside its data.
            let metadata = matches!(
                name.as_str(),
                "state.json" | "dataset_info.json" | "dataset_dict.json"
            );
            let data = !metadata
                && ["parquet", "arrow", "jsonl", "json", "csv"]
                    .iter()
                    .any(|ext| name.ends_with(&format!(".{ext}")));
            let in_split_dir = p
                .parent()
                .and_then(|d| d.file_name())
                .is_some_and(|d| d.to_string_lossy() == split);
            let named = name.starts_with(&format!("{split}-"))
                || name.starts_with(&format!("{split}."))
                || name.starts_with(&format!("{split}_"));
            if data && (named || in_split_dir) {
                found.push(p.display().to_string());
            }
        }
    }
    found.sort();
    found
}

/// GRPO's generation batch: TRL's `generation_batch_size` / `steps_per_generation` over
/// `num_generations` prompts, and `max_steps` in generation batches.
fn grpo_batch(
    recipe: &Map<String, Value>,
    tree: &mut Value,
    default_generations: u64,
) -> Result<()> {
    let get = |k: &str| recipe.get(k).filter(|v| !v.is_null());
    let per_device = as_u64(get("per_device_train_batch_size")).unwrap_or(8);
    let accumulation = as_u64(get("gradient_accumulation_steps")).unwrap_or(1);
    let generations = as_u64(get("num_generations")).unwrap_or(default_generations);
    set(tree, "rollout.num_generations", json!(generations));
    let (batch, steps_per_generation) = match (
        as_u64(get("generation_batch_size")),
        as_u64(get("steps_per_generation")),
    ) {
        (Some(_), Some(_)) => bail!(
            "`generation_batch_size` and `steps_per_generation` are mutually exclusive (TRL refuses both)"
        ),
        (Some(b), None) => {
            if b % per_device != 0 {
                bail!(
                    "`generation_batch_size` ({b}) must be divisible by `per_device_train_batch_size` ({per_device}), as TRL requires"
                );
            }
            (b, b / per_device)
        }
        (None, Some(s)) => (per_device * s, s),
        (None, None) => (per_device * accumulation, accumulation),
    };
    if batch % generations != 0 {
        bail!(
            "the generation batch ({batch} = per_device_train_batch_size × steps_per_generation) must be divisible by `num_generations` ({generations}), as TRL requires"
        );
    }
    set(tree, "train.prompts_per_step", json!(batch / generations));
    set(
        tree,
        "optim.steps_per_generation",
        json!(steps_per_generation),
    );
    set(
        tree,
        "optim.gradient_accumulation_steps",
        json!(accumulation),
    );
    if let Some(m) = as_u64(get("max_steps")).filter(|&m| m > 0) {
        // TRL counts optimizer steps; a step here is one generation batch, which feeds
        // steps_per_generation / gradient_accumulation_steps of them.
        let updates_per_batch = (steps_per_generation / accumulation.max(1)).max(1);
        set(
            tree,
            "train.max_steps",
            json!(m.div_ceil(updates_per_batch)),
        );
    }
    Ok(())
}

/// PPO's batch: a step is `per_device_train_batch_size × gradient_accumulation_steps` prompts,
/// one completion each, in micro-batches of the first; `total_episodes` (completions in all)
/// gives the steps, else `num_train_epochs` (TRL's `total_episodes = epochs × rows`).
fn ppo_batch(
    recipe: &Map<String, Value>,
    tree: &mut Value,
    notes: &mut Vec<(String, String)>,
) -> Result<()> {
    let get = |k: &str| recipe.get(k).filter(|v| !v.is_null());
    let per_device = as_u64(get("per_device_train_batch_size")).unwrap_or(8);
    let accumulation = as_u64(get("gradient_accumulation_steps")).unwrap_or(1);
    let batch = per_device * accumulation;
    set(tree, "train.prompts_per_step", json!(batch));
    set(tree, "rollout.num_generations", json!(1));
    if accumulation > 1 {
        notes.push((
            "gradient_accumulation_steps".into(),
            format!(
                "a step holds per_device_train_batch_size × gradient_accumulation_steps = {batch} prompts (train.prompts_per_step); its updates are ppo.num_mini_batches per epoch"
            ),
        ));
    }
    if let Some(e) = as_u64(get("total_episodes")).filter(|&e| e > 0) {
        set(tree, "train.max_steps", json!(e.div_ceil(batch.max(1))));
    }
    Ok(())
}

/// PPO's models as TRL's example script loads them: the policy and its reference from
/// `sft_model_path` (else `model_name_or_path`), the reward model and the value model's start
/// from `reward_model_path`.
fn ppo_models(
    recipe: &Map<String, Value>,
    tree: &mut Value,
    notes: &mut Vec<(String, String)>,
) -> Result<()> {
    let get = |k: &str| recipe.get(k).and_then(Value::as_str);
    if let Some(sft) = get("sft_model_path") {
        set(tree, "model.path", json!(sft));
        if get("model_name_or_path").is_some_and(|m| m != sft) {
            notes.push((
                "model_name_or_path".into(),
                "the policy is sft_model_path, and its tokenizer is sft_model_path's (TRL's example reads the tokenizer from model_name_or_path)".into(),
            ));
        }
    }
    let Some(rm) = get("reward_model_path") else {
        bail!(
            "the recipe names no `reward_model_path` (PPOConfig's reward model, which TRL's example also starts the value model from): PPO needs one"
        );
    };
    tree["reward_model_path"] = json!(rm);
    tree["rewards"] = json!([{"type": "reward_model"}]);
    set(tree, "ppo.value_model_name_or_path", json!(rm));
    Ok(())
}

/// Translates a TRL recipe (the YAML's top-level table).
pub fn translate(
    recipe: &Map<String, Value>,
    base_dir: &Path,
    trainer: Trainer,
) -> Result<Imported> {
    let mut tree = Value::Object(Map::new());
    let mut notes: Vec<(String, String)> = Vec::new();
    let get = |k: &str| recipe.get(k).filter(|v| !v.is_null());
    let truthy = |k: &str| get(k).and_then(Value::as_bool).unwrap_or(false);
    let mut handled: Vec<&str> = Vec::new();

    for (trl, ours) in COMMON.iter().chain(trainer.keys()) {
        if let Some(v) = get(trl) {
            set(&mut tree, ours, v.clone());
            handled.push(trl);
        }
    }
    let generates = matches!(trainer, Trainer::Grpo | Trainer::Rloo);
    match trainer {
        Trainer::Grpo => {}
        Trainer::Rloo => tree["algorithm"] = json!("rloo"),
        Trainer::Sft => tree["algorithm"] = json!("sft"),
        Trainer::Dpo => tree["algorithm"] = json!("dpo"),
        Trainer::Kto => tree["algorithm"] = json!("kto"),
        Trainer::Reward => tree["algorithm"] = json!("reward"),
        Trainer::Ppo => tree["algorithm"] = json!("ppo"),
    }
    for (trl, why) in DROPPED {
        if get(trl).is_some() {
            notes.push(((*trl).to_string(), (*why).to_string()));
            handled.push(trl);
        }
    }

    // The model.
    match get("model_name_or_path").and_then(Value::as_str) {
        Some(m) => {
            set(&mut tree, "model.path", json!(m));
            let p = base_dir.join(m);
            if !Path::new(m).exists() && !p.exists() {
                notes.push((
                    "model_name_or_path".into(),
                    format!("`{m}` is not a local directory or .gguf file: download it first (nothing is fetched from the Hub) and set model.path"),
                ));
            }
        }
        None => {
            bail!("the recipe has no `model_name_or_path` (TRL's ModelConfig): nothing to train")
        }
    }
    handled.push("model_name_or_path");
    let dtype = get("dtype").or_else(|| get("torch_dtype")).or_else(|| {
        get("model_init_kwargs").and_then(|k| k.get("dtype").or_else(|| k.get("torch_dtype")))
    });
    if let Some(d) = dtype {
        match dtype_of(d) {
            Some(t) => set(&mut tree, "model.dtype", json!(t)),
            None => notes.push((
                "dtype".into(),
                format!("{d}: the weights load in model.dtype (default f32)"),
            )),
        }
    }
    handled.extend(["dtype", "torch_dtype", "model_init_kwargs"]);

    // TRL's precision default: bf16 unless fp16.
    let fp16 = truthy("fp16");
    let bf16 = get("bf16").and_then(Value::as_bool).unwrap_or(!fp16);
    set(&mut tree, "train.bf16", json!(bf16));
    if fp16 {
        notes.push((
            "fp16".into(),
            "fp16 mixed precision is not built: the model computes in model.dtype".into(),
        ));
    }
    handled.extend(["bf16", "fp16"]);
    // TRL's defaults (GRPOConfig's and TrainingArguments') where ours differ.
    if get("gradient_checkpointing").is_none() && get("activation_checkpointing").is_none() {
        set(&mut tree, "train.gradient_checkpointing", json!(true));
    }
    for (k, ours, default) in [
        ("logging_steps", "train.logging_steps", json!(10)),
        (
            "per_device_train_batch_size",
            "train.per_device_train_batch_size",
            json!(8),
        ),
        ("num_train_epochs", "train.num_train_epochs", json!(3.0)),
        ("save_total_limit", "train.save_total_limit", json!(0)),
    ] {
        if get(k).is_none() {
            set(&mut tree, ours, default);
        }
    }
    if get("output_dir").is_none() {
        set(&mut tree, "output_dir", json!("trainer_output"));
    }
    if get("learning_rate").is_none() {
        let lr = match trainer {
            Trainer::Sft => 2e-5,
            Trainer::Reward => 1e-4,
            Trainer::Ppo => 3e-6,
            _ => 1e-6,
        };
        set(&mut tree, "optim.learning_rate", json!(lr));
    }
    // transformers 5's order of training rows.
    match get("train_sampling_strategy").and_then(Value::as_str) {
        Some(s) if get("shuffle_dataset").is_none() => {
            set(&mut tree, "train.shuffle_dataset", json!(s != "sequential"));
        }
        _ => {}
    }
    handled.push("train_sampling_strategy");
    match trainer {
        Trainer::Grpo | Trainer::Rloo if get("log_completions").is_none() => {
            set(&mut tree, "train.log_completions", json!(false));
        }
        // DPOConfig, KTOConfig and RewardConfig turn dropout off; KTO reads its rows in order.
        Trainer::Dpo | Trainer::Kto | Trainer::Reward => {
            if get("disable_dropout").is_none() {
                set(&mut tree, "train.disable_dropout", json!(true));
            }
            if trainer == Trainer::Kto
                && get("train_sampling_strategy").is_none()
                && get("shuffle_dataset").is_none()
            {
                set(&mut tree, "train.shuffle_dataset", json!(false));
            }
        }
        // SFTConfig reads its rows in order.
        Trainer::Sft if get("shuffle_dataset").is_none() => {
            set(&mut tree, "train.shuffle_dataset", json!(false));
        }
        _ => {}
    }
    // transformers 5's warmup_steps: a whole number of steps, or below 1 a share of them.
    if let Some(w) = get("warmup_steps").and_then(Value::as_f64) {
        if w > 0.0 && w < 1.0 {
            set(&mut tree, "optim.warmup_ratio", json!(w));
        } else {
            set(&mut tree, "optim.warmup_steps", json!(w as u64));
        }
    }
    handled.push("warmup_steps");

    if trainer == Trainer::Ppo {
        ppo_batch(recipe, &mut tree, &mut notes)?;
        handled.extend(["total_episodes", "num_train_epochs"]);
    } else if generates {
        grpo_batch(
            recipe,
            &mut tree,
            if trainer == Trainer::Rloo { 2 } else { 8 },
        )?;
    } else {
        // A step is one optimizer update: per_device_train_batch_size ×
        // gradient_accumulation_steps rows (pairs for DPO), in micro-batches of the first.
        let per_device = as_u64(get("per_device_train_batch_size")).unwrap_or(8);
        let accumulation = as_u64(get("gradient_accumulation_steps")).unwrap_or(1);
        set(
            &mut tree,
            "train.prompts_per_step",
            json!(per_device * accumulation),
        );
        set(
            &mut tree,
            "optim.gradient_accumulation_steps",
            json!(accumulation),
        );
        if let Some(m) = as_u64(get("max_steps")).filter(|&m| m > 0) {
            set(&mut tree, "train.max_steps", json!(m));
        }
    }
    handled.extend([
        "generation_batch_size",
        "steps_per_generation",
        "gradient_accumulation_steps",
    ]);
    handled.push("max_steps");

    // Saving and evaluation strategies.
    let strategy = |k: &str| get(k).and_then(Value::as_str).unwrap_or("no").to_string();
    let save = get("save_strategy")
        .and_then(Value::as_str)
        .unwrap_or("steps")
        .to_string();
    match save.as_str() {
        // TrainingArguments' default: every 500 steps.
        "steps" => set(
            &mut tree,
            "train.save_steps",
            json!(as_u64(get("save_steps")).unwrap_or(500)),
        ),
        "no" => {}
        other => notes.push((
            "save_strategy".into(),
            format!("\"{other}\": checkpoints come at the end (and every train.save_steps steps)"),
        )),
    }
    let evaluates = strategy("eval_strategy") != "no" || strategy("evaluation_strategy") != "no";
    if evaluates {
        let every = as_u64(get("eval_steps"))
            .or(as_u64(get("logging_steps")))
            .unwrap_or(10);
        set(&mut tree, "train.eval_steps", json!(every));
    }
    handled.extend([
        "save_steps",
        "save_strategy",
        "eval_strategy",
        "evaluation_strategy",
        "eval_steps",
    ]);

    if let Some(r) = get("report_to") {
        let list: Vec<String> = match r {
            Value::String(s) => vec![s.clone()],
            Value::Array(a) => a
                .iter()
                .filter_map(|x| x.as_str().map(String::from))
                .collect(),
            _ => Vec::new(),
        };
        let kept: Vec<&String> = list.iter().filter(|s| *s == "tensorboard").collect();
        set(&mut tree, "train.report_to", json!(kept));
        let others: Vec<&String> = list
            .iter()
            .filter(|s| !matches!(s.as_str(), "tensorboard" | "none"))
            .collect();
        if !others.is_empty() {
            notes.push((
                "report_to".into(),
                format!(
                    "{others:?}: metrics go to metrics.jsonl (and TensorBoard with \"tensorboard\")"
                ),
            ));
        }
        handled.push("report_to");
    }

    // Generation on a vLLM server.
    if generates && truthy("use_vllm") {
        let mode = get("vllm_mode")
            .and_then(Value::as_str)
            .unwrap_or("colocate");
        if mode == "server" {
            if !truthy("use_peft") {
                bail!(
                    "`use_vllm` with `vllm_mode: server` needs `use_peft: true` here: the policy reaches the server as a LoRA adapter each step (full-weight sync to vLLM is not built)"
                );
            }
            let url = get("vllm_server_base_url")
                .and_then(Value::as_str)
                .map(str::to_string)
                .unwrap_or_else(|| {
                    let host = get("vllm_server_host")
                        .and_then(Value::as_str)
                        .unwrap_or("0.0.0.0");
                    let host = if host == "0.0.0.0" { "127.0.0.1" } else { host };
                    let port = as_u64(get("vllm_server_port")).unwrap_or(8000);
                    format!("http://{host}:{port}")
                });
            set(&mut tree, "rollout.backend", json!("openai"));
            set(
                &mut tree,
                "rollout.openai.base_url",
                json!(format!("{}/v1", url.trim_end_matches('/'))),
            );
            if let Some(t) = get("vllm_server_timeout") {
                set(&mut tree, "rollout.openai.sync_timeout", t.clone());
            }
        } else {
            notes.push(("use_vllm".into(), "vllm_mode \"colocate\": generation runs on the built-in batched generator (rollout.backend = \"local\")".into()));
        }
    }
    handled.extend([
        "use_vllm",
        "vllm_mode",
        "vllm_server_base_url",
        "vllm_server_host",
        "vllm_server_port",
        "vllm_server_timeout",
    ]);
    if let Some(k) = get("generation_kwargs")
        .and_then(Value::as_object)
        .filter(|_| generates)
    {
        for (name, v) in k {
            match name.as_str() {
                "stop" => set(&mut tree, "rollout.stop", v.clone()),
                "min_tokens" | "min_new_tokens" => set(&mut tree, "rollout.min_completion_length", v.clone()),
                other => notes.push((format!("generation_kwargs.{other}"), "not a sampler setting here (temperature, top_p, top_k, min_p, repetition_penalty, stop, min_tokens are)".into())),
            }
        }
    }
    handled.push("generation_kwargs");

    // LoRA: TRL's ModelConfig (use_peft and its lora_* keys, with their defaults).
    if truthy("use_peft") {
        let mut lora = json!({
            "r": get("lora_r").cloned().unwrap_or(json!(16)),
            "lora_alpha": get("lora_alpha").cloned().unwrap_or(json!(32)),
            "lora_dropout": get("lora_dropout").cloned().unwrap_or(json!(0.05)),
        });
        if let Some(t) = get("lora_target_modules") {
            // One string other than "all-linear" is a regular expression in PEFT, as here.
            lora["target_modules"] = t.clone();
        }
        if let Some(t) = get("lora_target_parameters") {
            lora["target_parameters"] = t.clone();
        }
        if truthy("use_rslora") {
            lora["use_rslora"] = json!(true);
        }
        if truthy("use_dora") {
            lora["use_dora"] = json!(true);
        }
        set(&mut tree, "model.lora", lora);
        if get("lora_modules_to_save").is_some() {
            notes.push(("lora_modules_to_save".into(), "whole modules beside the adapters are not trained here (lora.trainable_token_indices trains embedding rows)".into()));
        }
    } else {
        for k in [
            "lora_r",
            "lora_alpha",
            "lora_dropout",
            "lora_target_modules",
            "lora_target_parameters",
            "lora_modules_to_save",
            "use_rslora",
            "use_dora",
        ] {
            if get(k).is_some() {
                notes.push((k.into(), "use_peft is false: full fine-tuning".into()));
            }
        }
    }
    handled.extend([
        "use_peft",
        "lora_r",
        "lora_alpha",
        "lora_dropout",
        "lora_target_modules",
        "lora_target_parameters",
        "lora_modules_to_save",
        "use_rslora",
        "use_dora",
    ]);
    for k in ["load_in_4bit", "load_in_8bit"] {
        if truthy(k) {
            notes.push((k.into(), "quantized loading through bitsandbytes is not built: the base loads in model.dtype (a GGUF file loads its quantized weights)".into()));
        }
    }
    handled.extend([
        "load_in_4bit",
        "load_in_8bit",
        "bnb_4bit_quant_type",
        "use_bnb_nested_quant",
        "bnb_4bit_quant_storage",
    ]);

    // The data: ScriptArguments' dataset_name (a local file or dataset directory) and splits.
    let train_split = get("dataset_train_split")
        .and_then(Value::as_str)
        .unwrap_or("train");
    let test_split = get("dataset_test_split")
        .and_then(Value::as_str)
        .unwrap_or("test");
    if let Some(name) = get("dataset_name").and_then(Value::as_str) {
        let local = [Path::new(name).to_path_buf(), base_dir.join(name)]
            .into_iter()
            .find(|p| p.exists());
        match local {
            Some(p) => {
                let files = split_files(&p, train_split);
                if files.is_empty() {
                    set(&mut tree, "data.path", json!([name]));
                    notes.push((
                        "dataset_train_split".into(),
                        format!(
                            "no `{train_split}` files under `{name}`: data.path reads all of it"
                        ),
                    ));
                } else {
                    set(&mut tree, "data.path", json!(files));
                }
                if evaluates {
                    let eval = split_files(&p, test_split);
                    if eval.is_empty() {
                        notes.push((
                            "dataset_test_split".into(),
                            format!("no `{test_split}` files under `{name}`: no evaluation"),
                        ));
                        set(&mut tree, "train.eval_steps", json!(0));
                    } else {
                        set(&mut tree, "data.eval_path", json!(eval));
                    }
                }
            }
            None => {
                set(&mut tree, "data.path", json!([name]));
                notes.push(("dataset_name".into(), format!("`{name}` is not a local file or directory: download the dataset first (nothing is fetched from the Hub) and set data.path")));
            }
        }
    } else if get("datasets").is_some() {
        notes.push((
            "datasets".into(),
            "dataset mixtures are not read: set data.path to the files".into(),
        ));
    }
    handled.extend([
        "dataset_name",
        "dataset_train_split",
        "dataset_test_split",
        "datasets",
    ]);

    if trainer == Trainer::Ppo {
        ppo_models(recipe, &mut tree, &mut notes)?;
        handled.extend(["sft_model_path", "reward_model_path"]);
        for (trl, why) in PPO_DROPPED {
            if get(trl).is_some() {
                notes.push(((*trl).to_string(), (*why).to_string()));
                handled.push(trl);
            }
        }
    }
    // Rewards: reward_funcs and reward_model_name_or_path, as `trl grpo` builds them.
    if !generates {
        for k in recipe.keys() {
            if !handled.contains(&k.as_str()) {
                notes.push((k.clone(), format!("not a key of TRL's {trainer:?}Config, ModelConfig or ScriptArguments that this translation knows: left out")));
            }
        }
        return Ok(Imported { tree, notes });
    }
    let mut rewards = Vec::new();
    if let Some(rm) = get("reward_model_name_or_path").and_then(Value::as_str) {
        tree["reward_model_path"] = json!(rm);
        rewards.push(json!({"type": "reward_model"}));
    }
    let funcs: Vec<String> = match get("reward_funcs") {
        Some(Value::String(s)) => vec![s.clone()],
        Some(Value::Array(a)) => a
            .iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect(),
        _ => Vec::new(),
    };
    for f in &funcs {
        match reward_of(f) {
            Some(r) => rewards.push(r),
            None => bail!(
                "reward_funcs: `{f}` is not one of accuracy_reward, reasoning_accuracy_reward, think_format_reward, get_soft_overlong_punishment, nor a dotted import path (TRL refuses it too)"
            ),
        }
    }
    if rewards.is_empty() {
        bail!(
            "the recipe names no reward (`reward_funcs` or `reward_model_name_or_path`): GRPO needs one"
        );
    }
    tree["rewards"] = Value::Array(rewards);
    handled.extend(["reward_funcs", "reward_model_name_or_path"]);

    for k in recipe.keys() {
        if !handled.contains(&k.as_str()) {
            notes.push((k.clone(), "not a key of TRL's GRPOConfig, ModelConfig or ScriptArguments that this translation knows: left out".into()));
        }
    }
    Ok(Imported { tree, notes })
}

/// The translation as TOML: the notes as comments on top, the config below.
pub fn to_toml(imported: &Imported, source: &str) -> Result<String> {
    render(
        imported,
        &format!("Translated from the TRL recipe {source} by `grpo-cli import-trl`."),
    )
}

/// The translation as TOML under a `header` comment line: the notes as comments on top, the
/// config below.
pub fn render(imported: &Imported, header: &str) -> Result<String> {
    let mut out = format!("# {header}\n");
    if imported.notes.is_empty() {
        out.push_str("# Every key carried over.\n");
    } else {
        out.push_str("# Left out or changed:\n");
        for (k, why) in &imported.notes {
            out.push_str(&format!("#   {k}: {why}\n"));
        }
    }
    out.push('\n');
    // Plain keys first, then the tables, as TOML requires.
    let table: toml::Table = serde_json::from_value(imported.tree.clone())?;
    out.push_str(&toml::to_string(&table)?);
    Ok(out)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_replay_buffers_size_carries_over() {
        // GRPOWithReplayBufferConfig's one key beyond GRPOConfig's.
        let recipe: Map<String, Value> =
            serde_json::from_value(json!({"model_name_or_path": "m", "reward_funcs": ["accuracy_reward"], "replay_buffer_size": 16}))
                .unwrap();
        let out = translate(&recipe, Path::new("."), Trainer::Grpo).unwrap();
        assert_eq!(out.tree["loss"]["replay_buffer_size"], json!(16));
        assert!(
            out.notes.iter().all(|(k, _)| k != "replay_buffer_size"),
            "{:?}",
            out.notes
        );
    }

    #[test]
    fn sft_and_dpo_keys_without_a_place_are_noted_with_the_reason() {
        let recipe: Map<String, Value> = serde_json::from_value(json!({
            "model_name_or_path": "m", "activation_offloading": true, "truncation_mode": "keep_start",
            "dataset_kwargs": {"skip_prepare_dataset": true}, "precompute_ref_batch_size": 8,
        }))
        .unwrap();
        for trainer in [Trainer::Sft, Trainer::Dpo] {
            let out = translate(&recipe, Path::new("."), trainer).unwrap();
            for k in [
                "activation_offloading",
                "truncation_mode",
                "dataset_kwargs",
                "precompute_ref_batch_size",
            ] {
                let (_, why) = out.notes.iter().find(|(n, _)| n == k).unwrap();
                assert!(!why.contains("left out"), "{k}: {why}");
            }
        }
    }

    #[test]
    fn split_files_reads_hub_snapshots_and_saved_datasets() {
        let dir = tempfile::tempdir().unwrap();
        let d = dir.path();
        for f in [
            "hub/data/train-00000-of-00002.parquet",
            "hub/data/train-00001-of-00002.parquet",
            "hub/data/test-00000-of-00001.parquet",
            "hub/README.md",
            "saved/train/data-00000-of-00001.arrow",
            "saved/train/state.json",
            "saved/train/dataset_info.json",
            "saved/dataset_dict.json",
            "flat/train.jsonl",
            "flat/validation.jsonl",
        ] {
            let p = d.join(f);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, "").unwrap();
        }
        let names = |v: Vec<String>| -> Vec<String> {
            v.iter()
                .map(|p| {
                    p.strip_prefix(&format!("{}/", d.display()))
                        .unwrap()
                        .to_string()
                })
                .collect()
        };
        assert_eq!(
            names(split_files(&d.join("hub"), "train")),
            [
                "hub/data/train-00000-of-00002.parquet",
                "hub/data/train-00001-of-00002.parquet"
            ]
        );
        assert_eq!(
            names(split_files(&d.join("hub"), "test")),
            ["hub/data/test-00000-of-00001.parquet"]
        );
        assert_eq!(
            names(split_files(&d.join("saved"), "train")),
            ["saved/train/data-00000-of-00001.arrow"]
        );
        assert_eq!(
            names(split_files(&d.join("flat"), "validation")),
            ["flat/validation.jsonl"]
        );
        assert!(split_files(&d.join("flat"), "test").is_empty());
        assert_eq!(split_files(&d.join("flat/train.jsonl"), "ignored").len(), 1);
    }
}
