//! `grpo-cli import-verl`: a verl launch script (verl's REINFORCE++ example, its variables,
//! quoting and continuations) and a verl config YAML (PPO) translated into configs of ours and
//! trained as they stand on verl-format data (`prompt` messages, `data_source`,
//! `reward_model.ground_truth`) with a verl `compute_score`; verl's defaults where the run is
//! silent; the refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::{self as trainer, RunOptions, config};
use serde_json::Value;

fn cli(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .current_dir(dir)
        .env("HOME", dir)
        .output()
        .unwrap()
}

fn stderr(o: &std::process::Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}

/// A tiny model, verl-format data (as verl's gsm8k preprocessing writes it) and a verl reward.
fn workspace(d: &Path) {
    init_model_dir(&d.join("models/tiny"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    std::fs::create_dir_all(d.join("data/gsm8k")).unwrap();
    let rows = |n: usize, split: &str| -> String {
        (0..n)
            .map(|i| {
                let (a, b) = (i, 2 * i + 1);
                serde_json::json!({
                    "data_source": "openai/gsm8k",
                    "prompt": [{"role": "user", "content": format!("What is {a} + {b}? Let's think step by step and output the final answer after \"####\".")}],
                    "ability": "math",
                    "reward_model": {"style": "rule", "ground_truth": (a + b).to_string()},
                    "extra_info": {"split": split, "index": i},
                })
                .to_string()
                    + "\n"
            })
            .collect()
    };
    std::fs::write(d.join("data/gsm8k/train.jsonl"), rows(16, "train")).unwrap();
    std::fs::write(d.join("data/gsm8k/test.jsonl"), rows(4, "test")).unwrap();
    // verl's gsm8k rule, partial credit for any digit so a tiny model's rewards vary.
    std::fs::write(
        d.join("my_reward.py"),
        "import re\n\ndef compute_score(data_source, solution_str, ground_truth, extra_info=None):\n    m = re.findall(r\"#### (\\-?[0-9\\.\\,]+)\", solution_str)\n    if m and m[-1].replace(',', '') == ground_truth:\n        return 1.0\n    return {\"score\": 0.1 * sum(c.isdigit() for c in solution_str), \"split\": extra_info[\"split\"]}\n",
    )
    .unwrap();
}

/// verl's examples/reinforce_plus_plus_trainer/run_qwen2-7b_math_rf.sh, as a user adapts it:
/// its variables, a quoted list, `$HOME`, `\` continuations, comments and `$@`.
const SCRIPT: &str = r#"set -x
# REINFORCE++ on gsm8k
gsm8k_train_path=$HOME/data/gsm8k/train.jsonl
gsm8k_test_path=$HOME/data/gsm8k/test.jsonl
train_files="['$gsm8k_train_path']"
test_files="['$gsm8k_test_path']"
MODEL=${MODEL_PATH:-$HOME/models/tiny}

python3 -m verl.trainer.main_ppo \
    algorithm.adv_estimator=reinforce_plus_plus \
    data.train_files="$train_files" \
    data.val_files="$test_files" \
    data.train_batch_size=4 \
    data.max_prompt_length=64 \
    data.max_response_length=8 \
    data.filter_overlong_prompts=True \
    data.truncation='error' \
    actor_rollout_ref.model.path=$MODEL \
    actor_rollout_ref.actor.optim.lr=3e-3 \
    actor_rollout_ref.model.use_remove_padding=True \
    actor_rollout_ref.actor.ppo_mini_batch_size=2 \
    actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4 \
    actor_rollout_ref.actor.use_dynamic_bsz=True \
    actor_rollout_ref.actor.ppo_max_token_len_per_gpu=64 \
    actor_rollout_ref.actor.use_kl_loss=False \
    actor_rollout_ref.actor.kl_loss_coef=0.001 \
    actor_rollout_ref.actor.kl_loss_type=mse \
    actor_rollout_ref.actor.entropy_coeff=0 \
    actor_rollout_ref.model.enable_gradient_checkpointing=True \
    actor_rollout_ref.actor.fsdp_config.param_offload=False \
    actor_rollout_ref.rollout.tensor_model_parallel_size=2 \
    actor_rollout_ref.rollout.name=vllm \
    actor_rollout_ref.rollout.n=4 \
    actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=16 \
    algorithm.use_kl_in_reward=True \
    custom_reward_function.path=$HOME/my_reward.py \
    trainer.critic_warmup=0 \
    trainer.logger='["console","wandb"]' \
    trainer.project_name='verl_grpo_example_gsm8k' \
    trainer.experiment_name='tiny_rf' \
    trainer.n_gpus_per_node=16 \
    trainer.save_freq=-1 \
    trainer.test_freq=2 \
    trainer.total_epochs=15 $@
"#;

#[test]
fn a_verl_script_translates_with_verls_defaults_and_trains() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    std::fs::write(d.join("run_rf.sh"), SCRIPT).unwrap();
    let o = cli(d, &["import-verl", "run_rf.sh", "--out", "rf.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let notes = stderr(&o);
    eprintln!("{notes}");
    let text = std::fs::read_to_string(d.join("rf.toml")).unwrap();
    let cfg: Value = serde_json::to_value(config::parse_toml_tree(&text).unwrap()).unwrap();
    let home = d.display().to_string();
    let get = |k: &str| {
        k.split('.')
            .try_fold(&cfg, |v, p| v.get(p))
            .cloned()
            .unwrap_or(Value::Null)
    };
    for (k, want) in [
        (
            "loss.adv_estimator",
            serde_json::json!("reinforce_plus_plus"),
        ),
        ("loss.use_kl_in_reward", serde_json::json!(true)),
        // Dynamic batch size: micro-batches by tokens.
        ("train.token_budget", serde_json::json!(64)),
        ("loss.kl_penalty", serde_json::json!("kl")),
        ("loss.kl_ctrl.kl_coef", serde_json::json!(0.001)),
        ("loss.kl_ctrl.type", serde_json::json!("fixed")),
        // verl's dual-clip (clip_ratio_c 3) is the two-sided clip; token-mean is dapo.
        ("loss.delta", serde_json::json!(3.0)),
        ("loss.loss_type", serde_json::json!("dapo")),
        ("loss.epsilon", serde_json::json!(0.2)),
        // verl's optimizer defaults, not ours.
        ("optim.weight_decay", serde_json::json!(0.01)),
        ("optim.lr_scheduler_type", serde_json::json!("constant")),
        ("optim.learning_rate", serde_json::json!(0.003)),
        ("optim.max_grad_norm", serde_json::json!(1.0)),
        // 4 prompts × 4 completions a step, 2 prompts (8 completions) an update, micro 4.
        ("train.prompts_per_step", serde_json::json!(4)),
        ("rollout.num_generations", serde_json::json!(4)),
        ("train.per_device_train_batch_size", serde_json::json!(4)),
        ("optim.steps_per_generation", serde_json::json!(4)),
        ("optim.gradient_accumulation_steps", serde_json::json!(2)),
        ("rollout.max_completion_length", serde_json::json!(8)),
        ("rollout.max_prompt_length", serde_json::json!(64)),
        ("rollout.top_k", serde_json::json!(0)),
        ("train.gradient_checkpointing", serde_json::json!(true)),
        ("train.eval_steps", serde_json::json!(2)),
        ("train.num_train_epochs", serde_json::json!(15.0)),
        (
            "output_dir",
            serde_json::json!("checkpoints/verl_grpo_example_gsm8k/tiny_rf"),
        ),
        (
            "model.path",
            serde_json::json!(format!("{home}/models/tiny")),
        ),
        (
            "data.path",
            serde_json::json!([format!("{home}/data/gsm8k/train.jsonl")]),
        ),
        (
            "rewards",
            serde_json::json!([{"type": "python", "name": "compute_score", "path": format!("{home}/my_reward.py"), "function": "compute_score", "signature": "verl"}]),
        ),
    ] {
        assert_eq!(get(k), want, "{k} in\n{text}");
    }
    for dropped in [
        "actor_rollout_ref.rollout.name",
        "actor_rollout_ref.actor.fsdp_config.param_offload",
        "trainer.n_gpus_per_node",
        "data.truncation",
    ] {
        assert!(notes.contains(dropped), "{dropped} not noted:\n{notes}");
    }
    // As it stands: 2 steps.
    let p = d.join("rf.toml");
    let mut c = config::load(&p, &["train.max_steps=2".into()]).unwrap();
    c.output_dir = d.join("run");
    let r = trainer::run(
        trainer::setup(c).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.metrics.len(), 2);
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m.contains_key("actor/reward_kl_penalty"),
            "{m:?}"
        );
        assert!(m["reward"] >= 0.0);
    }
    // The reward's dict keys reached the completions log.
    let log = std::fs::read_to_string(d.join("run/completions.jsonl")).unwrap();
    assert!(
        log.contains("\"split\":\"train\""),
        "{}",
        &log[..log.len().min(600)]
    );
}

/// A YAML of verl's config (nested, as a run's `.hydra/config.yaml`): PPO with a value model
/// (`adv_estimator: gae`), translated and trained.
#[test]
fn a_verl_yaml_with_gae_is_ppo() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    let yaml = format!(
        r#"algorithm:
  _target_: verl.trainer.config.AlgoConfig
  adv_estimator: gae
  gamma: 0.99
  lam: 0.95
  use_kl_in_reward: true
  kl_penalty: low_var_kl
  kl_ctrl:
    kl_coef: 0.02
data:
  train_files: {home}/data/gsm8k/train.jsonl
  val_files: {home}/data/gsm8k/test.jsonl
  train_batch_size: 4
  max_prompt_length: 64
  max_response_length: 8
actor_rollout_ref:
  model:
    path: {home}/models/tiny
    lora_rank: 8
    lora_alpha: 16
  actor:
    optim:
      lr: 1.0e-3
      lr_warmup_steps_ratio: 0.1
      lr_scheduler_type: cosine
      min_lr_ratio: 0.1
    ppo_mini_batch_size: 2
    ppo_epochs: 2
  rollout:
    n: 1
critic:
  model:
    path: {home}/models/tiny
  cliprange_value: 0.3
custom_reward_function:
  path: {home}/my_reward.py
trainer:
  default_local_dir: {home}/ppo_run
  total_training_steps: 2
"#,
        home = d.display()
    );
    std::fs::write(d.join("config.yaml"), yaml).unwrap();
    let o = cli(d, &["import-verl", "config.yaml", "--out", "ppo.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let text = std::fs::read_to_string(d.join("ppo.toml")).unwrap();
    let c = config::load(&d.join("ppo.toml"), &[]).unwrap();
    assert_eq!(c.algorithm, config::Algorithm::Ppo, "{text}");
    assert_eq!((c.ppo.gamma, c.ppo.lam, c.ppo.kl_coef), (0.99, 0.95, 0.02));
    assert_eq!(c.ppo.kl_estimator.as_str(), "k3");
    assert_eq!((c.ppo.num_ppo_epochs, c.ppo.num_mini_batches), (2, 2));
    assert_eq!(c.ppo.cliprange_value, 0.3);
    assert_eq!(c.model.lora.as_ref().unwrap().r, 8);
    assert_eq!(c.train.max_steps, Some(2));
    let r = trainer::run(
        trainer::setup(c).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.metrics.len(), 2);
    assert!(r.metrics.iter().all(|m| m["loss/value_avg"].is_finite()));
    assert!(
        text.contains("cosine_with_min_lr") && text.contains("min_lr_rate = 0.1"),
        "{text}"
    );
}

#[test]
fn what_cannot_be_translated_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for (args, want) in [
        (
            "algorithm.adv_estimator=my_estimator",
            "unknown adv_estimator `my_estimator`",
        ),
        (
            "algorithm.adv_estimator=grpo data.train_batch_size=6 actor_rollout_ref.actor.ppo_mini_batch_size=4",
            "must be a multiple of",
        ),
        (
            "algorithm.adv_estimator=grpo actor_rollout_ref.actor.policy_loss.loss_mode=bypass_mode",
            "not built here",
        ),
        (
            "algorithm.adv_estimator=grpo actor_rollout_ref.rollout.do_sample=False",
            "do_sample=False",
        ),
        (
            "algorithm.adv_estimator=grpo bad_token",
            "not a key=value override",
        ),
    ] {
        std::fs::write(
            d.join("run.sh"),
            format!("python3 -m verl.trainer.main_ppo {args} actor_rollout_ref.rollout.n=2\n"),
        )
        .unwrap();
        let o = cli(d, &["import-verl", "run.sh"]);
        assert!(!o.status.success());
        let e = stderr(&o);
        assert!(e.contains(want), "{args}: {e}");
        assert_eq!(e.trim_end().lines().count(), 1, "{e}");
    }
    std::fs::write(d.join("none.sh"), "echo hello\n").unwrap();
    let e = stderr(&cli(d, &["import-verl", "none.sh"]));
    assert!(e.contains("no `python3 -m verl.trainer.main_ppo"), "{e}");
}

/// verl's DAPO-style GMPO example (examples/gmpo_trainer/test_dapo_7b_math.sh), adapted to a
/// tiny model: shell arithmetic, `${X:-"..."}` defaults, `+` overrides, the dapo reward
/// manager's overlong buffer (an `overlong` reward weighted by its penalty factor), `geo_mean`
/// (gmpo) with `clip_ratio_low/high`, dynamic sampling (`filter_groups`, `gen_batch_size`); it
/// trains.
#[test]
fn verls_dapo_gmpo_script_translates_and_trains() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    workspace(d);
    let script = r#"#!/usr/bin/env bash
set -xeuo pipefail
project_name='DAPO'
exp_name='DAPO-tiny'
max_prompt_length=$((32 * 2))
max_response_length=$((4 * 2))
enable_overlong_buffer=True
overlong_buffer_len=$((2 * 2))
overlong_penalty_factor=1.0
train_prompt_bsz=4
n_resp_per_prompt=4
train_prompt_mini_bsz=2
max_num_gen_batches=10
RAY_DATA_HOME=${RAY_DATA_HOME:-"${HOME}"}
MODEL_PATH=${MODEL_PATH:-"${RAY_DATA_HOME}/models/tiny"}
TRAIN_FILE=${TRAIN_FILE:-"${RAY_DATA_HOME}/data/gsm8k/train.jsonl"}
loss_mode=geo_mean
python3 -m verl.trainer.main_ppo \
    data.train_files="${TRAIN_FILE}" \
    data.prompt_key=prompt \
    data.truncation='left' \
    data.max_prompt_length=${max_prompt_length} \
    data.max_response_length=${max_response_length} \
    data.train_batch_size=${train_prompt_bsz} \
    actor_rollout_ref.rollout.n=${n_resp_per_prompt} \
    algorithm.adv_estimator=grpo \
    actor_rollout_ref.actor.policy_loss.loss_mode=${loss_mode} \
    actor_rollout_ref.actor.clip_ratio_low=0.4 \
    actor_rollout_ref.actor.clip_ratio_high=0.4 \
    +actor_rollout_ref.model.override_config.max_position_embeddings=32768 \
    actor_rollout_ref.model.path="${MODEL_PATH}" \
    actor_rollout_ref.actor.optim.lr=1e-3 \
    actor_rollout_ref.actor.optim.lr_warmup_steps=10 \
    actor_rollout_ref.actor.optim.weight_decay=0.1 \
    actor_rollout_ref.actor.ppo_mini_batch_size=${train_prompt_mini_bsz} \
    actor_rollout_ref.actor.grad_clip=0.5 \
    actor_rollout_ref.actor.loss_agg_mode=token-mean \
    custom_reward_function.path=${HOME}/my_reward.py \
    reward_model.reward_manager=dapo \
    algorithm.filter_groups.enable=True \
    algorithm.filter_groups.metric=seq_reward \
    algorithm.filter_groups.max_num_gen_batches=${max_num_gen_batches} \
    data.gen_batch_size=$((train_prompt_bsz * 3)) \
    +reward_model.reward_kwargs.overlong_buffer_cfg.enable=${enable_overlong_buffer} \
    +reward_model.reward_kwargs.overlong_buffer_cfg.len=${overlong_buffer_len} \
    +reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor=${overlong_penalty_factor} \
    +reward_model.reward_kwargs.overlong_buffer_cfg.log=False \
    +reward_model.reward_kwargs.max_resp_len=${max_response_length} \
    trainer.project_name="${project_name}" \
    trainer.experiment_name="${exp_name}" \
    trainer.total_training_steps=2 \
    trainer.default_local_dir="${HOME}/dapo_run"
"#;
    std::fs::write(d.join("dapo.sh"), script).unwrap();
    let o = cli(d, &["import-verl", "dapo.sh", "--out", "dapo.toml"]);
    assert!(o.status.success(), "{}", stderr(&o));
    let c = config::load(&d.join("dapo.toml"), &[]).unwrap();
    let text = std::fs::read_to_string(d.join("dapo.toml")).unwrap();
    assert_eq!(c.loss.loss_type.as_str(), "gmpo", "{text}");
    assert_eq!(
        (c.loss.epsilon, c.loss.epsilon_high),
        (Some(0.4), Some(0.4))
    );
    assert_eq!(c.rollout.max_completion_length, 8);
    assert_eq!(c.rollout.max_prompt_length, 64);
    assert_eq!(c.optim.warmup_steps, 10);
    assert_eq!(c.optim.max_grad_norm, 0.5);
    assert_eq!(c.optim.weight_decay, 0.1);
    let f = &c.loss.filter_groups;
    assert!(f.enable, "{text}");
    assert_eq!(
        (f.metric.as_str(), f.max_num_gen_batches, f.gen_batch_size),
        ("reward", 10, Some(12))
    );
    let tree: Value = serde_json::to_value(config::parse_toml_tree(&text).unwrap()).unwrap();
    assert_eq!(
        tree["rewards"][1],
        serde_json::json!({"type": "overlong", "name": "overlong", "max_completion_length": 8, "overlong_buffer": 4, "weight": 1.0}),
        "{text}"
    );
    assert!(!text.contains("max_position_embeddings = "), "{text}");
    let r = trainer::run(
        trainer::setup(c).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.metrics.len(), 2);
    // The overlong reward scores every completion (8 tokens: the buffer's end, −1 × 1.0).
    for m in &r.metrics {
        assert!(m["loss"].is_finite());
        assert!(m.contains_key("rewards/overlong/mean"), "{m:?}");
        assert!(m["filter_groups/num_gen_batches"] >= 1.0, "{m:?}");
        assert_eq!(m["frac_reward_zero_std"], 0.0, "{m:?}");
    }
}
