//! `grpo-cli import-trl`: a TRL recipe (the YAML `trl grpo --config` reads) translated into a
//! config of ours, trained as it stands, and compared with what TRL's own parser makes of the
//! same recipe (`scripts/trl_recipe_values.py`, with `TRL_PYTHON`).
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::trl_import::{self, Trainer};
use serde_json::Value;

fn cli(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A tiny model and a dataset laid out as a Hub snapshot (`data/train-….jsonl`, `test`).
fn workspace(d: &Path) {
    init_model_dir(&d.join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    std::fs::create_dir_all(d.join("math/data")).unwrap();
    let rows = |n: usize, offset: usize| -> String {
        (0..n)
            .map(|i| {
                let (a, b) = (i + offset, 2 * i + 1);
                format!(
                    "{{\"prompt\": [{{\"role\": \"user\", \"content\": \"What is {a} + {b}?\"}}], \"solution\": \"${}$\"}}\n",
                    a + b
                )
            })
            .collect()
    };
    std::fs::write(d.join("math/data/train-00000-of-00001.jsonl"), rows(16, 0)).unwrap();
    std::fs::write(d.join("math/data/test-00000-of-00001.jsonl"), rows(4, 50)).unwrap();
}

const RECIPE: &str = r#"# trl grpo --config recipe.yaml
model_name_or_path: model
dtype: float32
dataset_name: math
dataset_test_split: test
reward_funcs:
  - accuracy_reward
  - think_format_reward
reward_weights: [1.0, 0.5]
output_dir: run
learning_rate: 1.0e-5
lr_scheduler_type: cosine
warmup_steps: 0.1
per_device_train_batch_size: 4
gradient_accumulation_steps: 2
num_generations: 4
max_completion_length: 8
max_steps: 4
bf16: false
gradient_checkpointing: false
logging_steps: 1
save_strategy: "no"
eval_strategy: steps
eval_steps: 2
loss_type: grpo
beta: 0.04
epsilon_high: 0.28
scale_rewards: batch
temperature: 0.9
use_peft: true
lora_r: 8
lora_target_modules: [q_proj, v_proj]
report_to: [wandb]
use_liger_kernel: true
seed: 7
"#;

#[test]
fn a_trl_recipe_translates_and_trains() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    std::fs::write(d.join("recipe.yaml"), RECIPE).unwrap();
    let out = cli(d, &["import-trl", "recipe.yaml", "--out", "grpo.toml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let notes = stderr(&out);
    assert!(
        notes.contains("report_to") && notes.contains("wandb"),
        "{notes}"
    );
    assert!(notes.contains("use_liger_kernel"), "{notes}");
    let text = std::fs::read_to_string(d.join("grpo.toml")).unwrap();
    assert!(
        text.starts_with("# Translated from the TRL recipe"),
        "{text}"
    );
    let cfg = grpo_trainer::config::load(&d.join("grpo.toml"), &[]).unwrap();
    // TRL's generation batch: per_device_train_batch_size × gradient_accumulation_steps = 8
    // completions, 2 prompts of 4; each feeds one update of two micro-batches.
    assert_eq!(cfg.train.prompts_per_step, 2);
    assert_eq!(cfg.rollout.num_generations, 4);
    assert_eq!(cfg.optim.steps_per_generation, Some(2));
    assert_eq!(cfg.optim.gradient_accumulation_steps, Some(2));
    assert_eq!(cfg.train.max_steps, Some(4));
    assert_eq!(cfg.optim.warmup_ratio, 0.1);
    assert_eq!(cfg.model.lora.as_ref().unwrap().r, 8);
    assert_eq!(cfg.model.lora.as_ref().unwrap().lora_alpha, 32.0); // TRL's ModelConfig default
    assert_eq!(
        cfg.data.path,
        vec!["math/data/train-00000-of-00001.jsonl".to_string()]
    );
    assert_eq!(
        cfg.data.eval_path,
        vec!["math/data/test-00000-of-00001.jsonl".to_string()]
    );
    let types: Vec<&str> = cfg.rewards.iter().map(|r| r.kind.type_name()).collect();
    assert_eq!(types, ["math_verify", "think_format"]);

    let run = cli(d, &["train", "--config", "grpo.toml"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let metrics = std::fs::read_to_string(d.join("run/metrics.jsonl")).unwrap();
    let train_lines: Vec<Value> = metrics
        .lines()
        .map(|l| serde_json::from_str::<Value>(l).unwrap())
        .filter(|m| m.get("rewards/math_verify/mean").is_some())
        .collect();
    assert_eq!(train_lines.len(), 4, "{metrics}");
    assert!(
        metrics.contains("eval/"),
        "the test split is evaluated every 2 steps: {metrics}"
    );
}

#[test]
fn a_trl_recipe_given_to_train_says_how_to_translate_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("recipe.yaml"), RECIPE).unwrap();
    let out = cli(d, &["train", "--config", "recipe.yaml"]);
    assert_eq!(out.status.code(), Some(2));
    let e = stderr(&out);
    assert!(
        e.contains("TRL recipe") && e.contains("grpo-cli import-trl recipe.yaml"),
        "{e}"
    );
}

#[test]
fn recipes_trl_refuses_are_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (recipe, says) in [
        ("model_name_or_path: m\n", "names no reward"),
        ("reward_funcs: [accuracy_reward]\n", "model_name_or_path"),
        (
            "model_name_or_path: m\nreward_funcs: [my_reward]\n",
            "`my_reward`",
        ),
        (
            "model_name_or_path: m\nreward_funcs: [accuracy_reward]\nper_device_train_batch_size: 3\nnum_generations: 2\n",
            "divisible by `num_generations`",
        ),
        (
            "model_name_or_path: m\nreward_funcs: [accuracy_reward]\ngeneration_batch_size: 8\nsteps_per_generation: 2\n",
            "mutually exclusive",
        ),
        (
            "model_name_or_path: m\nreward_funcs: [accuracy_reward]\nuse_vllm: true\nvllm_mode: server\n",
            "needs `use_peft: true`",
        ),
    ] {
        std::fs::write(d.join("r.yaml"), recipe).unwrap();
        let out = cli(d, &["import-trl", "r.yaml"]);
        assert_eq!(out.status.code(), Some(2), "{recipe}");
        let e = stderr(&out);
        assert!(
            e.contains("r.yaml") && e.contains(says) && e.trim().lines().count() == 1,
            "{recipe}: {e}"
        );
    }
}

/// Generation on a vLLM server (`vllm_mode: server`) is the `openai` rollout backend; a Hub
/// id and unknown keys are named, not fetched or guessed.
#[test]
fn vllm_servers_hub_ids_and_unknown_keys() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let recipe = "model_name_or_path: Qwen/Qwen2.5-0.5B-Instruct\ndataset_name: trl-lib/DeepMath-103K\n\
                  reward_funcs: [reasoning_accuracy_reward, my_rewards.length_reward]\nuse_vllm: true\n\
                  vllm_mode: server\nvllm_server_host: 10.0.0.2\nvllm_server_port: 8001\nuse_peft: true\n\
                  vllm_structured_outputs_regex: '(A|B)\\.'\nno_such_key: 1\n";
    std::fs::write(d.join("r.yaml"), recipe).unwrap();
    let out = cli(d, &["import-trl", "r.yaml"]);
    assert!(out.status.success(), "{}", stderr(&out));
    let text = String::from_utf8(out.stdout).unwrap();
    let tree: toml::Table = toml::from_str(&text).unwrap();
    assert_eq!(tree["rollout"]["backend"].as_str(), Some("openai"));
    assert_eq!(
        tree["rollout"]["openai"]["base_url"].as_str(),
        Some("http://10.0.0.2:8001/v1")
    );
    assert_eq!(
        tree["rollout"]["structured_outputs_regex"].as_str(),
        Some("(A|B)\\.")
    );
    let rewards = tree["rewards"].as_array().unwrap();
    assert_eq!(rewards[0]["type"].as_str(), Some("reasoning_accuracy"));
    assert_eq!(rewards[1]["type"].as_str(), Some("python"));
    assert_eq!(rewards[1]["path"].as_str(), Some("my_rewards"));
    assert_eq!(rewards[1]["function"].as_str(), Some("length_reward"));
    for said in [
        "Qwen/Qwen2.5-0.5B-Instruct",
        "trl-lib/DeepMath-103K",
        "no_such_key",
    ] {
        assert!(text.contains(said), "{said}: {text}");
    }
}

/// Every key the translation carries over has the value TRL's own parser gives the same recipe
/// (its defaults included), for two recipes: the one above and one of defaults only.
#[test]
fn translated_values_equal_trls_parsed_recipe() {
    let Some(python) = trl_python() else { return };
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/trl_recipe_values.py");
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    let minimal = "model_name_or_path: model\ndataset_name: math\nreward_funcs: [accuracy_reward]\noutput_dir: run\n";
    for recipe in [RECIPE, minimal, KITCHEN_SINK] {
        std::fs::write(d.join("recipe.yaml"), recipe).unwrap();
        let trl = Command::new(&python)
            .arg(&script)
            .arg("recipe.yaml")
            .current_dir(d)
            .output()
            .unwrap();
        assert!(trl.status.success(), "{}", stderr(&trl));
        let trl: Value = serde_json::from_slice(&trl.stdout).unwrap();
        let out = cli(d, &["import-trl", "recipe.yaml", "--out", "grpo.toml"]);
        assert!(out.status.success(), "{}", stderr(&out));
        let cfg = grpo_trainer::config::load(&d.join("grpo.toml"), &[]).unwrap();
        let mut differ = carried_over(&trl, &cfg, Trainer::Grpo);
        // The generation batch and its split.
        let batch = trl["generation_batch_size"].as_u64().unwrap();
        let n = cfg.train.prompts_per_step as u64 * cfg.rollout.num_generations as u64;
        if batch != n {
            differ.push(format!("generation_batch_size: TRL {batch}, ours {n}"));
        }
        if trl["steps_per_generation"].as_u64() != cfg.optim.steps_per_generation.map(|s| s as u64)
        {
            differ.push(format!(
                "steps_per_generation: TRL {}",
                trl["steps_per_generation"]
            ));
        }
        if trl["bf16"].as_bool() != Some(cfg.train.bf16) {
            differ.push(format!(
                "bf16: TRL {}, ours {}",
                trl["bf16"], cfg.train.bf16
            ));
        }
        if trl["save_steps"].as_f64() != Some(cfg.train.save_steps as f64)
            && trl["save_strategy"] == "steps"
        {
            differ.push(format!(
                "save_steps: TRL {}, ours {}",
                trl["save_steps"], cfg.train.save_steps
            ));
        }
        assert!(
            differ.is_empty(),
            "recipe:\n{recipe}\n{}",
            differ.join("\n")
        );
    }
}

/// The keys the translation carries over whose values differ from TRL's parse.
fn carried_over(
    trl: &Value,
    cfg: &grpo_trainer::config::TrainConfig,
    trainer: Trainer,
) -> Vec<String> {
    let ours = serde_json::to_value(cfg).unwrap();
    let mut differ = Vec::new();
    for (key, path) in trl_import::COMMON.iter().chain(trainer.keys()) {
        let Some(want) = trl.get(*key) else { continue };
        let got = path
            .split('.')
            .try_fold(&ours, |v, k| v.get(k))
            .unwrap_or(&Value::Null);
        if !same(key, want, got) {
            differ.push(format!("{key}: TRL {want}, ours ({path}) {got}"));
        }
    }
    differ
}

fn trl_python() -> Option<String> {
    let python = std::env::var("TRL_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_trl = Command::new(&python)
        .args(["-c", "import trl.scripts.grpo"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_trl {
        eprintln!("skipping: {python} has no trl (TRL_PYTHON)");
        return None;
    }
    Some(python)
}

const SFT_RECIPE: &str = r#"# trl sft --config sft.yaml
model_name_or_path: model
dataset_name: pairs.jsonl
output_dir: sft-run
learning_rate: 1.0e-4
per_device_train_batch_size: 2
gradient_accumulation_steps: 2
max_steps: 2
max_length: 64
packing: true
completion_only_loss: true
bf16: false
gradient_checkpointing: false
logging_steps: 1
save_strategy: "no"
dataset_num_proc: 4
"#;

const DPO_RECIPE: &str = r#"# trl dpo --config dpo.yaml
model_name_or_path: model
dataset_name: pairs.jsonl
output_dir: dpo-run
per_device_train_batch_size: 2
max_steps: 2
beta: 0.2
loss_type: [sigmoid, sft]
loss_weights: [1.0, 0.5]
max_length: 64
bf16: false
logging_steps: 1
save_strategy: "no"
"#;

const KTO_RECIPE: &str = r#"# trl kto --config kto.yaml
model_name_or_path: model
dataset_name: pairs.jsonl
output_dir: kto-run
per_device_train_batch_size: 4
max_steps: 2
beta: 0.2
desirable_weight: 1.5
max_length: 64
bf16: false
logging_steps: 1
save_strategy: "no"
"#;

const REWARD_RECIPE: &str = r#"# trl reward --config reward.yaml
model_name_or_path: model
dataset_name: pairs.jsonl
output_dir: reward-run
per_device_train_batch_size: 2
max_steps: 2
center_rewards_coefficient: 0.01
max_length: 64
bf16: false
logging_steps: 1
save_strategy: "no"
"#;

/// `trl sft`, `trl dpo`, `trl kto` and `trl reward` recipes (`--trainer`): translated with their own keys and defaults,
/// trained, and (with `TRL_PYTHON`) equal to what TRL's parser makes of them.
#[test]
fn sft_dpo_kto_and_reward_recipes_translate_train_and_equal_trls_parse() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init_model_dir(&d.join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    let rows: String = (0..8)
        .map(|i| {
            format!(
                "{{\"prompt\": \"What is {i} + 1?\", \"completion\": \" {}\", \"chosen\": \" {}\", \"rejected\": \" {}\", \"label\": {}}}\n",
                i + 1,
                i + 1,
                i + 2,
                i % 2 == 0
            )
        })
        .collect();
    std::fs::write(d.join("pairs.jsonl"), rows).unwrap();
    let python = trl_python();
    for (trainer, name, recipe, algorithm, rows_per_step) in [
        (Trainer::Sft, "sft", SFT_RECIPE, "sft", 4),
        (Trainer::Dpo, "dpo", DPO_RECIPE, "dpo", 2),
        (Trainer::Kto, "kto", KTO_RECIPE, "kto", 4),
        (Trainer::Reward, "reward", REWARD_RECIPE, "reward", 2),
    ] {
        let file = format!("{name}.yaml");
        std::fs::write(d.join(&file), recipe).unwrap();
        let out = cli(
            d,
            &["import-trl", &file, "--trainer", name, "--out", "ours.toml"],
        );
        assert!(out.status.success(), "{name}: {}", stderr(&out));
        let cfg = grpo_trainer::config::load(&d.join("ours.toml"), &[]).unwrap();
        assert_eq!(serde_json::to_value(cfg.algorithm).unwrap(), algorithm);
        assert_eq!(cfg.train.prompts_per_step, rows_per_step, "{name}");
        let run = cli(d, &["train", "--config", "ours.toml"]);
        assert!(run.status.success(), "{name}: {}", stderr(&run));
        let metrics = std::fs::read_to_string(d.join(format!("{name}-run/metrics.jsonl"))).unwrap();
        assert_eq!(
            metrics.lines().filter(|l| l.contains("\"loss\"")).count(),
            2,
            "{metrics}"
        );
        if let Some(python) = &python {
            let script =
                Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/trl_recipe_values.py");
            let trl = Command::new(python)
                .arg(&script)
                .args(["--trainer", name, &file])
                .current_dir(d)
                .output()
                .unwrap();
            assert!(trl.status.success(), "{}", stderr(&trl));
            let trl: Value = serde_json::from_slice(&trl.stdout).unwrap();
            let differ = carried_over(&trl, &cfg, trainer);
            assert!(differ.is_empty(), "{name}:\n{}", differ.join("\n"));
            // Defaults too: the recipe with the model and data alone.
            std::fs::write(
                d.join("bare.yaml"),
                "model_name_or_path: model\ndataset_name: pairs.jsonl\n",
            )
            .unwrap();
            let out = cli(
                d,
                &[
                    "import-trl",
                    "bare.yaml",
                    "--trainer",
                    name,
                    "--out",
                    "bare.toml",
                ],
            );
            assert!(out.status.success(), "{name}: {}", stderr(&out));
            let bare = grpo_trainer::config::load(&d.join("bare.toml"), &[]).unwrap();
            let trl = Command::new(python)
                .arg(&script)
                .args(["--trainer", name, "bare.yaml"])
                .current_dir(d)
                .output()
                .unwrap();
            let trl: Value = serde_json::from_slice(&trl.stdout).unwrap();
            let differ = carried_over(&trl, &bare, trainer);
            assert!(differ.is_empty(), "{name} defaults:\n{}", differ.join("\n"));
            assert_eq!(
                trl["learning_rate"].as_f64(),
                Some(bare.learning_rate()),
                "{name}"
            );
        }
    }
}

/// Most of GRPOConfig's keys away from their defaults.
const KITCHEN_SINK: &str = r#"model_name_or_path: model
dataset_name: math
reward_funcs: [think_format_reward]
output_dir: run
num_train_epochs: 2
optim: adamw_torch
adam_beta1: 0.8
adam_beta2: 0.99
adam_epsilon: 1.0e-6
weight_decay: 0.01
max_grad_norm: 0.5
lr_scheduler_type: cosine_with_restarts
lr_scheduler_kwargs: {num_cycles: 2}
warmup_steps: 3
num_iterations: 2
seed: 3
shuffle_dataset: false
disable_dropout: true
save_total_limit: 3
save_steps: 20
log_completions: true
num_completions_to_print: 2
num_generations: 4
num_generations_eval: 2
per_device_train_batch_size: 4
steps_per_generation: 4
gradient_accumulation_steps: 2
top_p: 0.9
top_k: 20
min_p: 0.05
repetition_penalty: 1.1
chat_template_kwargs: {enable_thinking: false}
cast_lm_head_to_fp32: true
sync_ref_model: true
ref_model_mixup_alpha: 0.5
ref_model_sync_steps: 64
beta: 0.01
epsilon: 0.3
epsilon_high: 0.35
delta: 4.0
importance_sampling_level: sequence
scale_rewards: none
loss_type: dr_grpo
mask_truncated_completions: true
top_entropy_quantile: 0.2
entropy_coef: 0.01
use_adaptive_entropy: true
entropy_coef_min: 0.001
entropy_coef_max: 0.1
entropy_coef_delta: 0.002
entropy_target: 0.3
sapo_temperature_pos: 0.9
sapo_temperature_neg: 1.2
vespo_k_pos: 1.5
vespo_lambda_pos: 2.5
vespo_k_neg: 2.5
vespo_lambda_neg: 1.5
vllm_importance_sampling_mode: sequence_truncate
vllm_importance_sampling_clip_min: 0.5
vllm_importance_sampling_clip_max: 2.0
off_policy_mask_threshold: 0.5
use_bias_correction_kl: false
max_tool_calling_iterations: 3
bf16: false
"#;

/// Values equal as TRL and we hold them: numbers by value, an absent setting as TRL's `None`
/// (or an empty table / list), enums by name, `optim` by the update it makes.
fn same(key: &str, want: &Value, got: &Value) -> bool {
    let empty = |v: &Value| {
        v.is_null()
            || v.as_object().is_some_and(|m| m.is_empty())
            || v.as_array().is_some_and(|a| a.is_empty())
    };
    let empty = |v: &Value| {
        empty(v)
            || v.as_object()
                .is_some_and(|m| m.values().all(Value::is_null))
    };
    if empty(want) && empty(got) {
        return true;
    }
    // Ours unset means TRL's default; keeping every checkpoint is `None` there, 0 here.
    match (key, want, got) {
        ("shuffle_dataset", Value::Bool(true), Value::Null)
        | ("disable_dropout", Value::Bool(false), Value::Null)
        | ("save_total_limit", Value::Null, Value::Number(_)) => {
            return got.as_u64().unwrap_or(0) == 0;
        }
        ("epsilon", Value::Number(e), Value::Null) => return e.as_f64() == Some(0.2),
        _ => {}
    }
    match (want, got) {
        (Value::Array(a), b) if a.len() == 1 && !b.is_array() => same(key, &a[0], b),
        (Value::Object(a), Value::Object(b)) => {
            let set = |m: &serde_json::Map<String, Value>| {
                m.iter()
                    .filter(|(_, v)| !v.is_null())
                    .map(|(k, v)| (k.clone(), v.clone()))
                    .collect::<Vec<_>>()
            };
            let (a, b) = (set(a), set(b));
            a.len() == b.len()
                && a.iter()
                    .zip(&b)
                    .all(|((ka, va), (kb, vb))| ka == kb && same(ka, va, vb))
        }
        (Value::Number(a), Value::Number(b)) => {
            (a.as_f64().unwrap() - b.as_f64().unwrap()).abs() < 1e-12
        }
        (Value::String(a), Value::String(b)) => {
            a.to_lowercase() == b.to_lowercase()
                || (key == "optim" && a == "adamw_torch_fused" && b == "adamw_torch")
        }
        // TRL leaves these unset when they take another key's value.
        (Value::Null, _)
            if matches!(
                key,
                "epsilon_high"
                    | "num_generations_eval"
                    | "router_aux_loss_coef"
                    | "min_p"
                    | "num_completions_to_print"
                    | "max_tool_calling_iterations"
                    | "vllm_importance_sampling_cap"
                    | "delta"
                    | "vllm_importance_sampling_clip_min"
                    | "off_policy_mask_threshold"
                    | "logging_dir"
            ) =>
        {
            true
        }
        (a, b) => a == b,
    }
}

/// `trl rloo` recipes: RLOO's own `beta` and defaults (2 generations), GRPO's batch logic.
#[test]
fn rloo_recipes_translate_train_and_equal_trls_parse() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    let recipe = "model_name_or_path: model\ndataset_name: math\nreward_funcs: [accuracy_reward]\noutput_dir: rloo-run\n\
                  max_completion_length: 8\nmax_steps: 2\nbf16: false\nlogging_steps: 1\nsave_strategy: \"no\"\n\
                  beta: 0.1\nnormalize_advantages: true\n";
    std::fs::write(d.join("rloo.yaml"), recipe).unwrap();
    let out = cli(
        d,
        &[
            "import-trl",
            "rloo.yaml",
            "--trainer",
            "rloo",
            "--out",
            "rloo.toml",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let cfg = grpo_trainer::config::load(&d.join("rloo.toml"), &[]).unwrap();
    assert_eq!(serde_json::to_value(cfg.algorithm).unwrap(), "rloo");
    assert_eq!(cfg.rollout.num_generations, 2); // RLOOConfig's default
    assert_eq!(cfg.train.prompts_per_step, 4); // 8 completions per generation batch
    assert_eq!(cfg.rloo.beta, 0.1);
    assert!(cfg.rloo.normalize_advantages);
    let run = cli(d, &["train", "--config", "rloo.toml"]);
    assert!(run.status.success(), "{}", stderr(&run));
    if let Some(python) = trl_python() {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/trl_recipe_values.py");
        let trl = Command::new(&python)
            .arg(&script)
            .args(["--trainer", "rloo", "rloo.yaml"])
            .current_dir(d)
            .output()
            .unwrap();
        assert!(trl.status.success(), "{}", stderr(&trl));
        let trl: Value = serde_json::from_slice(&trl.stdout).unwrap();
        let differ = carried_over(&trl, &cfg, Trainer::Rloo);
        assert!(differ.is_empty(), "{}", differ.join("\n"));
        assert_eq!(trl["generation_batch_size"].as_u64(), Some(8));
    }
}

/// A recipe of TRL's PPO example script (`examples/scripts/ppo/ppo.py`: PPOConfig with
/// `sft_model_path` and `reward_model_path`): PPO's keys carry over, the reward model scores
/// and starts the value model, `total_episodes` gives the steps, the script's batch keys are
/// noted; the translation trains.
#[test]
fn ppo_recipes_translate_and_train() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    let m = grpo_rollout::load(
        &d.join("model"),
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let rm = m.model.into_sequence_classifier(7).unwrap();
    grpo_rollout::save_hf_dir(&rm, &m.tokenizer, &d.join("rm"), candle_core::DType::F32).unwrap();
    let recipe = "model_name_or_path: model\nsft_model_path: model\nreward_model_path: rm\n\
                  dataset_name: math\noutput_dir: ppo-run\nper_device_train_batch_size: 2\n\
                  gradient_accumulation_steps: 2\ntotal_episodes: 8\nnum_ppo_epochs: 2\n\
                  kl_coef: 0.1\nkl_estimator: k3\nresponse_length: 8\ntemperature: 0.9\n\
                  missing_eos_penalty: 1.0\nlocal_rollout_forward_batch_size: 1\n\
                  num_sample_generations: 0\nstop_token: eos\nbf16: false\nsave_strategy: \"no\"\nlogging_steps: 1\n";
    std::fs::write(d.join("ppo.yaml"), recipe).unwrap();
    let out = cli(
        d,
        &[
            "import-trl",
            "ppo.yaml",
            "--trainer",
            "ppo",
            "--out",
            "ppo.toml",
        ],
    );
    assert!(out.status.success(), "{}", stderr(&out));
    let notes = stderr(&out);
    for k in [
        "stop_token",
        "local_rollout_forward_batch_size",
        "gradient_accumulation_steps",
    ] {
        assert!(notes.contains(k), "{k}: {notes}");
    }
    let cfg = grpo_trainer::config::load(&d.join("ppo.toml"), &[]).unwrap();
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Ppo);
    assert_eq!(cfg.train.prompts_per_step, 4);
    assert_eq!(cfg.rollout.num_generations, 1);
    assert_eq!(cfg.train.max_steps, Some(2)); // 8 episodes of 4
    assert_eq!(
        (cfg.rollout.max_completion_length, cfg.rollout.temperature),
        (8, 0.9)
    );
    assert_eq!(cfg.ppo.num_ppo_epochs, 2);
    assert_eq!(cfg.ppo.kl_coef, 0.1);
    assert_eq!(cfg.ppo.kl_estimator, grpo_core::ppo::KlEstimator::K3);
    assert_eq!(cfg.ppo.missing_eos_penalty, Some(1.0));
    assert_eq!(
        cfg.ppo.value_model_name_or_path.as_deref(),
        Some(Path::new("rm"))
    );
    assert_eq!(cfg.learning_rate(), 3e-6); // PPOConfig's
    let types: Vec<&str> = cfg.rewards.iter().map(|r| r.kind.type_name()).collect();
    assert_eq!(types, ["reward_model"]);
    let run = cli(d, &["train", "--config", "ppo.toml"]);
    assert!(run.status.success(), "{}", stderr(&run));
    let metrics = std::fs::read_to_string(d.join("ppo-run/metrics.jsonl")).unwrap();
    assert_eq!(
        metrics
            .lines()
            .filter(|l| l.contains("loss/value_avg"))
            .count(),
        2,
        "{metrics}"
    );
    // Without a reward model there is nothing to score with.
    std::fs::write(
        d.join("norm.yaml"),
        "model_name_or_path: model\ndataset_name: math\n",
    )
    .unwrap();
    let out = cli(d, &["import-trl", "norm.yaml", "--trainer", "ppo"]);
    assert!(
        !out.status.success() && stderr(&out).contains("reward_model_path"),
        "{}",
        stderr(&out)
    );
}
