//! `grpo-cli import-verl`: a verl run (`python3 -m verl.trainer.main_ppo key=value ...` in a shell
//! script, or a YAML of verl's config) as a config of ours.
//!
//! verl is configured by Hydra: its defaults (`ppo_trainer.yaml`) with dotted overrides. The
//! translation starts from verl's defaults for every key it carries over (verl's defaults are
//! not ours: a constant learning rate, weight decay 0.01, dual-clip at 3, ...), applies the
//! overrides, and writes each key where it lives here; what has no place here is listed in the
//! notes, with the reason.

use std::collections::BTreeMap;
use std::path::Path;

use anyhow::{Result, bail};
use serde_json::{Map, Value, json};

use crate::trl_import::{Imported, set};

/// Dotted keys and their values, in the run's order.
pub type Overrides = Vec<(String, Value)>;
/// `(key, why)` for what does not carry over as written.
pub type Notes = Vec<(String, String)>;

/// verl's defaults (its generated `ppo_trainer.yaml`) for the keys translated here.
const DEFAULTS: &[(&str, &str)] = &[
    ("algorithm.adv_estimator", "gae"),
    ("algorithm.gamma", "1.0"),
    ("algorithm.lam", "1.0"),
    ("algorithm.norm_adv_by_std_in_grpo", "true"),
    ("algorithm.use_kl_in_reward", "false"),
    ("algorithm.kl_penalty", "kl"),
    ("algorithm.kl_ctrl.type", "fixed"),
    ("algorithm.kl_ctrl.kl_coef", "0.001"),
    ("algorithm.kl_ctrl.horizon", "10000"),
    ("algorithm.kl_ctrl.target_kl", "0.1"),
    ("data.train_files", "~/data/rlhf/gsm8k/train.parquet"),
    ("data.val_files", "~/data/rlhf/gsm8k/test.parquet"),
    ("data.prompt_key", "prompt"),
    ("data.max_prompt_length", "512"),
    ("data.max_response_length", "512"),
    ("data.train_batch_size", "1024"),
    ("data.shuffle", "true"),
    ("data.truncation", "error"),
    ("data.train_max_samples", "-1"),
    (
        "actor_rollout_ref.model.path",
        "~/models/deepseek-llm-7b-chat",
    ),
    (
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        "true",
    ),
    ("actor_rollout_ref.model.lora_rank", "0"),
    ("actor_rollout_ref.model.lora_alpha", "16"),
    ("actor_rollout_ref.model.target_modules", "all-linear"),
    ("actor_rollout_ref.actor.optim.lr", "1e-6"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps_ratio", "0.0"),
    ("actor_rollout_ref.actor.optim.lr_warmup_steps", "-1"),
    ("actor_rollout_ref.actor.optim.weight_decay", "0.01"),
    ("actor_rollout_ref.actor.optim.betas", "[0.9, 0.999]"),
    ("actor_rollout_ref.actor.optim.clip_grad", "1.0"),
    ("actor_rollout_ref.actor.optim.min_lr_ratio", "0.0"),
    ("actor_rollout_ref.actor.optim.num_cycles", "0.5"),
    (
        "actor_rollout_ref.actor.optim.lr_scheduler_type",
        "constant",
    ),
    ("actor_rollout_ref.actor.ppo_mini_batch_size", "256"),
    ("actor_rollout_ref.actor.ppo_epochs", "1"),
    ("actor_rollout_ref.actor.clip_ratio", "0.2"),
    ("actor_rollout_ref.actor.clip_ratio_low", "0.2"),
    ("actor_rollout_ref.actor.clip_ratio_high", "0.2"),
    ("actor_rollout_ref.actor.clip_ratio_c", "3.0"),
    ("actor_rollout_ref.actor.tau_pos", "1.0"),
    ("actor_rollout_ref.actor.tau_neg", "1.05"),
    ("actor_rollout_ref.actor.policy_loss.loss_mode", "vanilla"),
    (
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
        "0.0002",
    ),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_lb", "1.0"),
    ("actor_rollout_ref.actor.policy_loss.clip_cov_ub", "5.0"),
    ("actor_rollout_ref.actor.policy_loss.kl_cov_ratio", "0.0002"),
    ("actor_rollout_ref.actor.policy_loss.ppo_kl_coef", "0.1"),
    ("actor_rollout_ref.actor.loss_agg_mode", "token-mean"),
    ("actor_rollout_ref.actor.entropy_coeff", "0"),
    ("actor_rollout_ref.actor.use_kl_loss", "false"),
    ("actor_rollout_ref.actor.kl_loss_coef", "0.001"),
    ("actor_rollout_ref.actor.kl_loss_type", "low_var_kl"),
    ("actor_rollout_ref.rollout.n", "1"),
    ("actor_rollout_ref.rollout.temperature", "1.0"),
    ("actor_rollout_ref.rollout.top_p", "1.0"),
    ("actor_rollout_ref.rollout.top_k", "-1"),
    ("actor_rollout_ref.rollout.do_sample", "true"),
    ("critic.cliprange_value", "0.5"),
    ("custom_reward_function.name", "compute_score"),
    ("reward_model.enable", "false"),
    ("trainer.total_epochs", "30"),
    ("trainer.project_name", "verl_examples"),
    ("trainer.experiment_name", "gsm8k"),
    ("trainer.save_freq", "-1"),
    ("trainer.test_freq", "-1"),
    ("trainer.val_before_train", "true"),
    (
        "trainer.default_local_dir",
        "checkpoints/${trainer.project_name}/${trainer.experiment_name}",
    ),
];

/// Key prefixes with no place here, and why.
const DROPPED: &[(&str, &str)] = &[
    (
        "actor_rollout_ref.actor.fsdp_config.",
        "FSDP: one process here",
    ),
    (
        "actor_rollout_ref.ref.",
        "the reference runs in the learner's micro-batches (the policy as loaded; a LoRA policy's base with the adapters off)",
    ),
    (
        "actor_rollout_ref.actor.megatron.",
        "Megatron: one process here",
    ),
    (
        "actor_rollout_ref.actor.checkpoint.",
        "checkpoints hold the model, the optimizer and the trainer state",
    ),
    (
        "actor_rollout_ref.actor.profiler.",
        "profiling: run `grpo-cli bench`",
    ),
    (
        "actor_rollout_ref.actor.ulysses_sequence_parallel_size",
        "one process here",
    ),
    ("actor_rollout_ref.actor.use_torch_compile", "no PyTorch"),
    (
        "actor_rollout_ref.actor.calculate_sum_pi_squared",
        "Σπ² is computed whenever loss.adv_estimator needs it",
    ),
    ("actor_rollout_ref.actor.strategy", "one process here"),
    (
        "actor_rollout_ref.actor.shuffle",
        "mini-batches are taken in order",
    ),
    (
        "actor_rollout_ref.actor.data_loader_seed",
        "mini-batches are taken in order",
    ),
    (
        "actor_rollout_ref.actor.entropy_from_logits_with_chunking",
        "log-probs and entropies are always computed in chunks",
    ),
    (
        "actor_rollout_ref.actor.entropy_checkpointing",
        "log-probs and entropies are always computed in chunks",
    ),
    (
        "actor_rollout_ref.actor.calculate_entropy",
        "entropies are computed when a metric or the loss reads them",
    ),
    (
        "actor_rollout_ref.actor.use_fused_kernels",
        "the fused kernels are always on",
    ),
    (
        "actor_rollout_ref.model.use_remove_padding",
        "padding never reaches the loss",
    ),
    (
        "actor_rollout_ref.model.use_fused_kernels",
        "the fused kernels are always on",
    ),
    (
        "actor_rollout_ref.model.use_liger",
        "the fused kernels are always on",
    ),
    (
        "actor_rollout_ref.model.use_shm",
        "models load from a local directory or GGUF file",
    ),
    (
        "actor_rollout_ref.model.trust_remote_code",
        "no Python model code runs; the architectures are built in",
    ),
    (
        "actor_rollout_ref.model.external_lib",
        "no Python model code runs; the architectures are built in",
    ),
    (
        "actor_rollout_ref.model.enable_activation_offload",
        "not built; gradient checkpointing lowers activation memory",
    ),
    (
        "actor_rollout_ref.model.override_config",
        "the model's config.json is read as it is",
    ),
    (
        "actor_rollout_ref.rollout.name",
        "the generator is built in (or a server: `rollout.backend = \"openai\"`)",
    ),
    (
        "actor_rollout_ref.rollout.mode",
        "the generator is built in",
    ),
    (
        "actor_rollout_ref.rollout.tensor_model_parallel_size",
        "one process here",
    ),
    (
        "actor_rollout_ref.rollout.gpu_memory_utilization",
        "the generator shares the learner's weights; no separate engine",
    ),
    (
        "actor_rollout_ref.rollout.enforce_eager",
        "the generator is built in",
    ),
    (
        "actor_rollout_ref.rollout.free_cache_engine",
        "the generator is built in",
    ),
    (
        "actor_rollout_ref.rollout.enable_chunked_prefill",
        "the generator is built in",
    ),
    (
        "actor_rollout_ref.rollout.enable_prefix_caching",
        "a group's completions share their prompt's forward",
    ),
    (
        "actor_rollout_ref.rollout.max_num_batched_tokens",
        "the generator is built in",
    ),
    (
        "actor_rollout_ref.rollout.max_num_seqs",
        "the generator is built in",
    ),
    (
        "actor_rollout_ref.rollout.load_format",
        "the generator shares the learner's weights",
    ),
    (
        "actor_rollout_ref.rollout.layered_summon",
        "the generator shares the learner's weights",
    ),
    (
        "actor_rollout_ref.rollout.log_prob_",
        "log-probs are computed in the learner's micro-batches",
    ),
    (
        "actor_rollout_ref.rollout.dtype",
        "the generator computes in the model's dtype (`model.dtype`)",
    ),
    (
        "actor_rollout_ref.rollout.prompt_length",
        "from data.max_prompt_length",
    ),
    (
        "actor_rollout_ref.rollout.response_length",
        "from data.max_response_length",
    ),
    (
        "actor_rollout_ref.hybrid_engine",
        "the generator shares the learner's weights",
    ),
    ("actor_rollout_ref.nccl_timeout", "one process here"),
    ("data.tokenizer", "the model's tokenizer is used"),
    ("data.use_shm", "files are read in chunks"),
    (
        "data.reward_fn_key",
        "verl rewards read the `data_source` column",
    ),
    (
        "data.val_batch_size",
        "evaluation runs the eval split in steps of prompts_per_step",
    ),
    (
        "data.return_raw_input_ids",
        "prompts are rendered and tokenized here",
    ),
    (
        "data.return_raw_chat",
        "prompts are rendered and tokenized here",
    ),
    (
        "data.return_full_prompt",
        "prompts are rendered and tokenized here",
    ),
    (
        "data.dataloader_num_workers",
        "the data stage runs on its own thread",
    ),
    (
        "data.filter_overlong_prompts",
        "prompts past max_prompt_length keep their last tokens (`rollout.max_prompt_length`)",
    ),
    (
        "data.filter_overlong_prompts_workers",
        "the data stage runs on its own thread",
    ),
    ("data.trust_remote_code", "no Python data code runs"),
    ("data.validation_shuffle", "the eval split is read in order"),
    ("data.val_max_samples", "the eval split is read whole"),
    (
        "critic.",
        "only PPO (adv_estimator = gae) has a value model",
    ),
    ("trainer.n_gpus_per_node", "one process here"),
    ("trainer.nnodes", "one process here"),
    ("trainer.device", "the device is `model.device`"),
    (
        "trainer.critic_warmup",
        "the value model trains from the first step",
    ),
    ("trainer.balance_batch", "one process here"),
    (
        "trainer.logger",
        "metrics go to OUTPUT_DIR/metrics.jsonl (and TensorBoard with train.report_to = [\"tensorboard\"])",
    ),
    (
        "trainer.log_val_generations",
        "evaluation completions are logged in eval_completions.jsonl",
    ),
    (
        "trainer.resume_mode",
        "resume with `grpo-cli train --resume`",
    ),
    (
        "trainer.resume_from_path",
        "resume with `grpo-cli train --resume DIR`",
    ),
    (
        "trainer.default_hdfs_dir",
        "checkpoints are written under output_dir",
    ),
    (
        "trainer.del_local_ckpt_after_load",
        "checkpoints are written under output_dir",
    ),
    ("trainer.esi_redundant_time", "one process here"),
    ("trainer.ray_wait_register_center_timeout", "no Ray"),
    ("trainer.use_legacy_worker_impl", "no Ray"),
    (
        "trainer.rollout_data_dir",
        "completions are logged in OUTPUT_DIR/completions.jsonl",
    ),
    (
        "trainer.validation_data_dir",
        "evaluation completions are logged in eval_completions.jsonl",
    ),
    (
        "trainer.max_critic_ckpt_to_keep",
        "train.save_total_limit keeps whole checkpoints",
    ),
    ("ray_init.", "no Ray"),
    ("ray_kwargs.", "no Ray"),
    ("global_profiler.", "profiling: run `grpo-cli bench`"),
    ("transfer_queue.", "no Ray"),
    ("reward_model.enable_resource_pool", "one process here"),
    ("reward_model.n_gpus_per_node", "one process here"),
    ("reward_model.nnodes", "one process here"),
    ("reward_model.strategy", "one process here"),
    (
        "reward_model.micro_batch_size",
        "the reward model scores each step's completions at once",
    ),
    (
        "reward_model.reward_manager",
        "verl's naive manager is what runs: one score per completion",
    ),
    (
        "reward_model.model.input_tokenizer",
        "the reward model's own tokenizer",
    ),
    ("reward_model.model.fsdp_config.", "FSDP: one process here"),
];

/// The overrides of a verl launch script: the `key=value` arguments of its `verl.trainer.main_ppo`
/// command, after the script's variables (and the environment's) are expanded and its line
/// continuations joined. `env` reads an environment variable the script does not set.
pub fn script_overrides(
    text: &str,
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<(Overrides, Notes)> {
    let joined = text.replace("\\\r\n", " ").replace("\\\n", " ");
    let mut vars: BTreeMap<String, String> = BTreeMap::new();
    let mut notes = Vec::new();
    for line in joined.lines() {
        let line = line.trim();
        if line.starts_with('#') || line.is_empty() {
            continue;
        }
        if line.contains("main_ppo") || line.contains("main_dapo") {
            let words = shell_words(line, &vars, env, &mut notes)?;
            let Some(at) = words
                .iter()
                .position(|w| w.contains("main_ppo") || w.contains("main_dapo"))
            else {
                continue;
            };
            let mut out = Vec::new();
            let mut args = words[at + 1..].iter();
            while let Some(w) = args.next() {
                if w == "$@" || w == "$*" || w.is_empty() {
                    continue;
                }
                if let Some(flag) = w.strip_prefix("--") {
                    let (name, _) = flag.split_once('=').unwrap_or((flag, ""));
                    if !flag.contains('=') {
                        args.next();
                    }
                    notes.push((
                        format!("--{name}"),
                        "verl's own config file is not read: its defaults are `ppo_trainer.yaml`'s (import the YAML itself for another)".into(),
                    ));
                    continue;
                }
                let Some((k, v)) = w.split_once('=') else {
                    if let Some(k) = w.strip_prefix('~') {
                        out.push((k.to_string(), Value::Null));
                        continue;
                    }
                    bail!("`{w}`: not a key=value override of verl's config");
                };
                let k = k.trim_start_matches('+');
                out.push((k.to_string(), hydra_value(v)));
            }
            return Ok((out, notes));
        }
        if let Some((name, value)) = assignment(line) {
            let words = shell_words(value, &vars, env, &mut notes)?;
            vars.insert(name.to_string(), words.join(" "));
        }
    }
    bail!("no `python3 -m verl.trainer.main_ppo ...` command in the script")
}

/// `NAME=value` or `export NAME=value` (a whole-line shell assignment).
fn assignment(line: &str) -> Option<(&str, &str)> {
    let line = line.strip_prefix("export ").unwrap_or(line).trim_start();
    let (name, value) = line.split_once('=')?;
    let ok = name
        .chars()
        .next()
        .is_some_and(|c| c == '_' || c.is_ascii_alphabetic())
        && name.chars().all(|c| c == '_' || c.is_ascii_alphanumeric());
    ok.then_some((name, value))
}

/// A shell line's words: quotes removed, `$NAME`, `${NAME}` and `${NAME:-default}` expanded
/// (outside single quotes), a `#` word and what follows it dropped.
fn shell_words(
    line: &str,
    vars: &BTreeMap<String, String>,
    env: &dyn Fn(&str) -> Option<String>,
    notes: &mut Vec<(String, String)>,
) -> Result<Vec<String>> {
    let mut words = Vec::new();
    let mut cur = String::new();
    let mut in_word = false;
    let chars: Vec<char> = line.chars().collect();
    let mut i = 0;
    let mut lookup = |name: &str, default: Option<&str>| -> String {
        if let Some(v) = vars.get(name).cloned().or_else(|| env(name)) {
            return v;
        }
        match default {
            // The default is itself expanded (`${MODEL:-$HOME/models/x}`).
            Some(d) => shell_words(&format!("\"{d}\""), vars, env, &mut Vec::new())
                .ok()
                .and_then(|w| w.into_iter().next())
                .unwrap_or_else(|| d.to_string()),
            None => {
                notes.push((
                    format!("${name}"),
                    "not set in the script nor in the environment: left as written".into(),
                ));
                format!("${name}")
            }
        }
    };
    let mut expand = |i: &mut usize, out: &mut String| {
        // At a `$`: a name, `{name}`, `{name:-default}`, `((arithmetic))`, `@`, `*`.
        let start = *i + 1;
        match chars.get(start) {
            Some('(') if chars.get(start + 1) == Some(&'(') => {
                let mut depth = 0i32;
                let mut end = None;
                for (j, &c) in chars.iter().enumerate().skip(start) {
                    match c {
                        '(' => depth += 1,
                        ')' => {
                            depth -= 1;
                            if depth == 0 {
                                end = Some(j);
                                break;
                            }
                        }
                        _ => {}
                    }
                }
                let Some(end) = end else {
                    out.push('$');
                    *i += 1;
                    return;
                };
                // `$((a * 2))`: the text between the doubled parentheses.
                let inner: String = chars[start + 2..end.saturating_sub(1)].iter().collect();
                let mut value = |name: &str| lookup(name, Some("0"));
                match arithmetic(&inner, &mut value) {
                    Some(v) => out.push_str(&v.to_string()),
                    None => out.extend(&chars[*i..=end]),
                }
                *i = end + 1;
            }
            Some('{') => {
                // The matching `}` (a default may hold `${...}` of its own).
                let mut depth = 0i32;
                let close = chars[start..]
                    .iter()
                    .position(|&c| {
                        depth += i32::from(c == '{') - i32::from(c == '}');
                        depth == 0
                    })
                    .map(|p| start + p);
                let Some(close) = close else {
                    out.push('$');
                    *i += 1;
                    return;
                };
                let inner: String = chars[start + 1..close].iter().collect();
                let (name, default) = match inner.split_once(":-") {
                    Some((n, d)) => (n.to_string(), Some(d.to_string())),
                    None => (inner.clone(), None),
                };
                out.push_str(&lookup(&name, default.as_deref()));
                *i = close + 1;
            }
            Some('@') | Some('*') => {
                out.push('$');
                out.push(chars[start]);
                *i = start + 1;
            }
            Some(c) if *c == '_' || c.is_ascii_alphabetic() => {
                let mut end = start;
                while end < chars.len() && (chars[end] == '_' || chars[end].is_ascii_alphanumeric())
                {
                    end += 1;
                }
                let name: String = chars[start..end].iter().collect();
                out.push_str(&lookup(&name, None));
                *i = end;
            }
            _ => {
                out.push('$');
                *i += 1;
            }
        }
    };
    while i < chars.len() {
        let c = chars[i];
        match c {
            ' ' | '\t' => {
                if in_word {
                    words.push(std::mem::take(&mut cur));
                    in_word = false;
                }
                i += 1;
            }
            '#' if !in_word => break,
            '\'' => {
                in_word = true;
                let close = chars[i + 1..].iter().position(|&c| c == '\'');
                let Some(close) = close else {
                    bail!("an unclosed ' in `{line}`");
                };
                cur.extend(&chars[i + 1..i + 1 + close]);
                i += close + 2;
            }
            '"' => {
                in_word = true;
                i += 1;
                loop {
                    match chars.get(i) {
                        None => bail!("an unclosed \" in `{line}`"),
                        Some('"') => {
                            i += 1;
                            break;
                        }
                        Some('\\') if matches!(chars.get(i + 1), Some('"' | '\\' | '$' | '`')) => {
                            cur.push(chars[i + 1]);
                            i += 2;
                        }
                        Some('$') => expand(&mut i, &mut cur),
                        Some(&ch) => {
                            cur.push(ch);
                            i += 1;
                        }
                    }
                }
            }
            '\\' => {
                in_word = true;
                if let Some(&n) = chars.get(i + 1) {
                    cur.push(n);
                }
                i += 2;
            }
            '$' => {
                in_word = true;
                expand(&mut i, &mut cur);
            }
            _ => {
                in_word = true;
                cur.push(c);
                i += 1;
            }
        }
    }
    if in_word {
        words.push(cur);
    }
    Ok(words)
}

/// The shell's integer arithmetic (`$((1024 * 8))`, `$((a + b))`): `+ - * / %`, parentheses,
/// unary minus, variables by name (with or without `$`); `None` when it cannot be read.
fn arithmetic(text: &str, var: &mut dyn FnMut(&str) -> String) -> Option<i64> {
    fn sum(t: &[char], i: &mut usize, var: &mut dyn FnMut(&str) -> String) -> Option<i64> {
        let mut v = product(t, i, var)?;
        loop {
            skip(t, i);
            match t.get(*i) {
                Some('+') => {
                    *i += 1;
                    v = v.checked_add(product(t, i, var)?)?;
                }
                Some('-') => {
                    *i += 1;
                    v = v.checked_sub(product(t, i, var)?)?;
                }
                _ => return Some(v),
            }
        }
    }
    fn product(t: &[char], i: &mut usize, var: &mut dyn FnMut(&str) -> String) -> Option<i64> {
        let mut v = atom(t, i, var)?;
        loop {
            skip(t, i);
            match t.get(*i) {
                Some('*') => {
                    *i += 1;
                    v = v.checked_mul(atom(t, i, var)?)?;
                }
                Some('/') => {
                    *i += 1;
                    v = v.checked_div(atom(t, i, var)?)?;
                }
                Some('%') => {
                    *i += 1;
                    v = v.checked_rem(atom(t, i, var)?)?;
                }
                _ => return Some(v),
            }
        }
    }
    fn atom(t: &[char], i: &mut usize, var: &mut dyn FnMut(&str) -> String) -> Option<i64> {
        skip(t, i);
        match t.get(*i)? {
            '(' => {
                *i += 1;
                let v = sum(t, i, var)?;
                skip(t, i);
                (t.get(*i) == Some(&')')).then(|| *i += 1)?;
                Some(v)
            }
            '-' => {
                *i += 1;
                atom(t, i, var)?.checked_neg()
            }
            '+' => {
                *i += 1;
                atom(t, i, var)
            }
            c if c.is_ascii_digit() => {
                let s = *i;
                while t.get(*i).is_some_and(char::is_ascii_digit) {
                    *i += 1;
                }
                t[s..*i].iter().collect::<String>().parse().ok()
            }
            c if *c == '$' || *c == '_' || c.is_ascii_alphabetic() => {
                if *c == '$' {
                    *i += 1;
                }
                let braced = t.get(*i) == Some(&'{');
                if braced {
                    *i += 1;
                }
                let s = *i;
                while t
                    .get(*i)
                    .is_some_and(|c| *c == '_' || c.is_ascii_alphanumeric())
                {
                    *i += 1;
                }
                let name: String = t[s..*i].iter().collect();
                if braced {
                    (t.get(*i) == Some(&'}')).then(|| *i += 1)?;
                }
                let text = var(&name);
                if text.trim() == name {
                    return None;
                }
                arithmetic(&text, var)
            }
            _ => None,
        }
    }
    fn skip(t: &[char], i: &mut usize) {
        while t.get(*i).is_some_and(|c| c.is_whitespace()) {
            *i += 1;
        }
    }
    let t: Vec<char> = text.chars().collect();
    let mut i = 0;
    let v = sum(&t, &mut i, var)?;
    skip(&t, &mut i);
    (i == t.len()).then_some(v)
}

/// A Hydra override's value: booleans, null, numbers, `[a, b]` lists (elements parsed the same
/// way, quotes removed), else the text.
pub fn hydra_value(v: &str) -> Value {
    let t = v.trim();
    if let Some(inner) = t.strip_prefix('[').and_then(|s| s.strip_suffix(']')) {
        let mut items = Vec::new();
        let (mut depth, mut quote, mut cur) = (0i32, None::<char>, String::new());
        for c in inner.chars() {
            match (c, quote) {
                ('\'' | '"', None) => quote = Some(c),
                (q, Some(open)) if q == open => quote = None,
                ('[', None) => {
                    depth += 1;
                    cur.push(c);
                }
                (']', None) => {
                    depth -= 1;
                    cur.push(c);
                }
                (',', None) if depth == 0 => items.push(std::mem::take(&mut cur)),
                _ => cur.push(c),
            }
        }
        if !cur.trim().is_empty() || !items.is_empty() {
            items.push(cur);
        }
        return Value::Array(items.iter().map(|s| hydra_value(s)).collect());
    }
    for q in ['\'', '"'] {
        if let Some(s) = t.strip_prefix(q).and_then(|s| s.strip_suffix(q)) {
            return json!(s);
        }
    }
    match t.to_ascii_lowercase().as_str() {
        "true" => return json!(true),
        "false" => return json!(false),
        "null" | "none" | "~" => return Value::Null,
        _ => {}
    }
    if let Ok(i) = t.parse::<i64>() {
        return json!(i);
    }
    if let Ok(f) = t.parse::<f64>()
        && f.is_finite()
    {
        return json!(f);
    }
    json!(t)
}

/// A verl config YAML (nested tables) as dotted keys; `_target_` entries are left out.
pub fn yaml_overrides(tree: &Value) -> Vec<(String, Value)> {
    fn walk(prefix: &str, v: &Value, out: &mut Vec<(String, Value)>) {
        match v {
            Value::Object(m) if !m.is_empty() => {
                for (k, x) in m {
                    if k == "_target_" {
                        continue;
                    }
                    let key = match prefix {
                        "" => k.clone(),
                        p => format!("{p}.{k}"),
                    };
                    walk(&key, x, out);
                }
            }
            _ => out.push((prefix.to_string(), v.clone())),
        }
    }
    let mut out = Vec::new();
    walk("", tree, &mut out);
    out
}

/// `${a.b}` and `${oc.select:a.b,default}` in string values resolved from the other keys.
fn resolve(keys: &mut BTreeMap<String, Value>) {
    for _ in 0..4 {
        let snapshot = keys.clone();
        for v in keys.values_mut() {
            let Some(s) = v.as_str() else { continue };
            if !s.contains("${") {
                continue;
            }
            let mut out = String::new();
            let mut rest = s;
            while let Some(at) = rest.find("${") {
                out.push_str(&rest[..at]);
                let Some(end) = rest[at..].find('}') else {
                    out.push_str(&rest[at..]);
                    rest = "";
                    break;
                };
                let inner = &rest[at + 2..at + end];
                let (key, default) = match inner.strip_prefix("oc.select:") {
                    Some(sel) => match sel.split_once(',') {
                        Some((k, d)) => (k.trim(), Some(d.trim())),
                        None => (sel.trim(), None),
                    },
                    None => (inner.trim(), None),
                };
                match snapshot.get(key) {
                    Some(Value::String(x)) => out.push_str(x),
                    Some(Value::Null) | None => match default {
                        Some(d) => out.push_str(d),
                        None => out.push_str(&rest[at..at + end + 1]),
                    },
                    Some(x) => out.push_str(&x.to_string()),
                }
                rest = &rest[at + end + 1..];
            }
            out.push_str(rest);
            *v = hydra_value(&out);
        }
    }
}

/// `~/x` with the home directory.
fn home(p: &str, env: &dyn Fn(&str) -> Option<String>) -> String {
    match (p.strip_prefix("~/"), env("HOME")) {
        (Some(rest), Some(h)) => format!("{h}/{rest}"),
        _ => p.to_string(),
    }
}

/// Translates verl's overrides (dotted keys, later ones winning) into a config of ours.
pub fn translate(
    overrides: &[(String, Value)],
    env: &dyn Fn(&str) -> Option<String>,
) -> Result<Imported> {
    let mut keys: BTreeMap<String, Value> = DEFAULTS
        .iter()
        .map(|(k, v)| (k.to_string(), hydra_value(v)))
        .collect();
    let mut given: Vec<String> = Vec::new();
    for (k, v) in overrides {
        match v {
            // `~key`: back to verl's default.
            Value::Null if !keys.contains_key(k) => {
                keys.remove(k);
            }
            _ => {
                keys.insert(k.clone(), v.clone());
            }
        }
        given.push(k.clone());
    }
    resolve(&mut keys);
    let mut tree = Value::Object(Map::new());
    let mut notes: Vec<(String, String)> = Vec::new();
    let mut handled: Vec<&str> = Vec::new();
    let take = |k: &'static str, handled: &mut Vec<&'static str>| -> Value {
        handled.push(k);
        keys.get(k).cloned().unwrap_or(Value::Null)
    };
    let num = |v: &Value, k: &str| -> Result<f64> {
        v.as_f64()
            .ok_or_else(|| anyhow::anyhow!("`{k}`: expected a number, got {v}"))
    };
    let int = |v: &Value, k: &str| -> Result<i64> {
        v.as_i64()
            .or_else(|| v.as_f64().filter(|f| f.fract() == 0.0).map(|f| f as i64))
            .ok_or_else(|| anyhow::anyhow!("`{k}`: expected an integer, got {v}"))
    };
    let text = |v: &Value| -> String {
        match v {
            Value::String(s) => s.clone(),
            other => other.to_string(),
        }
    };
    let truthy = |v: &Value| v.as_bool().unwrap_or(false);

    // The algorithm.
    let estimator = text(&take("algorithm.adv_estimator", &mut handled));
    let ppo = estimator == "gae";
    match estimator.as_str() {
        "gae" => {
            tree["algorithm"] = json!("ppo");
        }
        other => {
            let e: grpo_core::estimators::AdvEstimator = other
                .parse()
                .map_err(|e: String| anyhow::anyhow!("algorithm.adv_estimator: {e}"))?;
            set(&mut tree, "loss.adv_estimator", json!(e.as_str()));
        }
    }
    let gamma = num(&take("algorithm.gamma", &mut handled), "algorithm.gamma")?;
    let lam = num(&take("algorithm.lam", &mut handled), "algorithm.lam")?;
    let norm = truthy(&take("algorithm.norm_adv_by_std_in_grpo", &mut handled));
    let kl_in_reward = truthy(&take("algorithm.use_kl_in_reward", &mut handled));
    let kl_penalty = text(&take("algorithm.kl_penalty", &mut handled));
    let ctrl_type = text(&take("algorithm.kl_ctrl.type", &mut handled));
    let kl_coef = num(
        &take("algorithm.kl_ctrl.kl_coef", &mut handled),
        "algorithm.kl_ctrl.kl_coef",
    )?;
    let horizon = num(
        &take("algorithm.kl_ctrl.horizon", &mut handled),
        "algorithm.kl_ctrl.horizon",
    )?;
    let target_kl = num(
        &take("algorithm.kl_ctrl.target_kl", &mut handled),
        "algorithm.kl_ctrl.target_kl",
    )?;
    if ppo {
        set(&mut tree, "ppo.gamma", json!(gamma));
        set(&mut tree, "ppo.lam", json!(lam));
        set(
            &mut tree,
            "ppo.kl_coef",
            json!(if kl_in_reward { kl_coef } else { 0.0 }),
        );
        let est = match kl_penalty.as_str() {
            "kl" | "k1" => "k1",
            "low_var_kl" | "k3" => "k3",
            other => bail!(
                "algorithm.kl_penalty={other}: PPO's in-reward KL here is k1 (kl) or k3 (low_var_kl)"
            ),
        };
        set(&mut tree, "ppo.kl_estimator", json!(est));
        if kl_penalty == "low_var_kl" {
            notes.push((
                "algorithm.kl_penalty".into(),
                "PPO's k3 here is not clamped to ±10 as verl's low_var_kl".into(),
            ));
        }
        if kl_in_reward && ctrl_type == "adaptive" {
            notes.push((
                "algorithm.kl_ctrl.type".into(),
                "PPO's KL coefficient is fixed here (TRL's PPOTrainer): kl_coef".into(),
            ));
        }
        set(&mut tree, "ppo.whiten_rewards", json!(false));
        let vclip = take("critic.cliprange_value", &mut handled);
        set(
            &mut tree,
            "ppo.cliprange_value",
            json!(num(&vclip, "critic.cliprange_value")?),
        );
        if let Some(p) = keys.get("critic.model.path").filter(|v| !v.is_null()) {
            handled.push("critic.model.path");
            set(
                &mut tree,
                "ppo.value_model_name_or_path",
                json!(home(&text(p), env)),
            );
        }
        notes.push(("critic.optim".into(), "the value model trains with the policy's [optim] settings, its loss weighted by ppo.vf_coef (0.1): verl's critic has its own optimizer".into()));
    } else {
        set(&mut tree, "loss.gamma", json!(gamma));
        if !norm {
            set(&mut tree, "loss.scale_rewards", json!("none"));
        }
        if kl_in_reward {
            set(&mut tree, "loss.use_kl_in_reward", json!(true));
            let p: grpo_core::estimators::KlPenalty = kl_penalty
                .parse()
                .map_err(|e: String| anyhow::anyhow!("algorithm.kl_penalty: {e}"))?;
            set(&mut tree, "loss.kl_penalty", json!(p.as_str()));
            set(&mut tree, "loss.kl_ctrl.type", json!(ctrl_type));
            set(&mut tree, "loss.kl_ctrl.kl_coef", json!(kl_coef));
            set(&mut tree, "loss.kl_ctrl.target_kl", json!(target_kl));
            set(&mut tree, "loss.kl_ctrl.horizon", json!(horizon));
        }
    }

    // The model.
    let model = home(
        &text(&take("actor_rollout_ref.model.path", &mut handled)),
        env,
    );
    set(&mut tree, "model.path", json!(model));
    if !Path::new(&model).exists() {
        notes.push(("actor_rollout_ref.model.path".into(), format!("`{model}` is not a local directory or .gguf file: download it first (nothing is fetched from the Hub)")));
    }
    let gc = truthy(&take(
        "actor_rollout_ref.model.enable_gradient_checkpointing",
        &mut handled,
    ));
    set(&mut tree, "train.gradient_checkpointing", json!(gc));
    let rank = int(
        &take("actor_rollout_ref.model.lora_rank", &mut handled),
        "lora_rank",
    )?;
    let alpha = take("actor_rollout_ref.model.lora_alpha", &mut handled);
    let targets = take("actor_rollout_ref.model.target_modules", &mut handled);
    if rank > 0 {
        set(&mut tree, "model.lora.r", json!(rank));
        set(&mut tree, "model.lora.lora_alpha", alpha);
        set(&mut tree, "model.lora.target_modules", targets);
        if let Some(x) = keys
            .get("actor_rollout_ref.model.exclude_modules")
            .filter(|v| !v.is_null())
        {
            handled.push("actor_rollout_ref.model.exclude_modules");
            set(&mut tree, "model.lora.exclude_modules", x.clone());
        }
    }

    // The optimizer.
    let lr = num(
        &take("actor_rollout_ref.actor.optim.lr", &mut handled),
        "optim.lr",
    )?;
    set(&mut tree, "optim.learning_rate", json!(lr));
    let wd = take("actor_rollout_ref.actor.optim.weight_decay", &mut handled);
    set(
        &mut tree,
        "optim.weight_decay",
        json!(num(&wd, "optim.weight_decay")?),
    );
    let betas = take("actor_rollout_ref.actor.optim.betas", &mut handled);
    match betas.as_array().map(Vec::as_slice) {
        Some([b1, b2]) => {
            set(
                &mut tree,
                "optim.adam_beta1",
                json!(num(b1, "optim.betas")?),
            );
            set(
                &mut tree,
                "optim.adam_beta2",
                json!(num(b2, "optim.betas")?),
            );
        }
        _ => bail!("`actor_rollout_ref.actor.optim.betas`: expected [beta1, beta2], got {betas}"),
    }
    // `actor.grad_clip` (verl's older name) when the run gives it, else `optim.clip_grad`.
    let clip = take("actor_rollout_ref.actor.optim.clip_grad", &mut handled);
    let clip = match given
        .iter()
        .any(|g| g == "actor_rollout_ref.actor.grad_clip")
    {
        true => take("actor_rollout_ref.actor.grad_clip", &mut handled),
        false => clip,
    };
    set(
        &mut tree,
        "optim.max_grad_norm",
        json!(num(&clip, "optim.clip_grad")?),
    );
    let warmup_steps = int(
        &take(
            "actor_rollout_ref.actor.optim.lr_warmup_steps",
            &mut handled,
        ),
        "lr_warmup_steps",
    )?;
    let warmup_ratio = num(
        &take(
            "actor_rollout_ref.actor.optim.lr_warmup_steps_ratio",
            &mut handled,
        ),
        "lr_warmup_steps_ratio",
    )?;
    let warm = warmup_steps > 0 || warmup_ratio > 0.0;
    if warmup_steps > 0 {
        set(&mut tree, "optim.warmup_steps", json!(warmup_steps));
    } else if warmup_ratio > 0.0 {
        set(&mut tree, "optim.warmup_ratio", json!(warmup_ratio));
    }
    let style = keys
        .get("actor_rollout_ref.actor.optim.warmup_style")
        .filter(|v| !v.is_null())
        .cloned();
    handled.push("actor_rollout_ref.actor.optim.warmup_style");
    let sched = match style {
        Some(s) => text(&s),
        None => text(&take(
            "actor_rollout_ref.actor.optim.lr_scheduler_type",
            &mut handled,
        )),
    };
    handled.push("actor_rollout_ref.actor.optim.lr_scheduler_type");
    let min_lr = num(
        &take("actor_rollout_ref.actor.optim.min_lr_ratio", &mut handled),
        "min_lr_ratio",
    )?;
    let cycles = num(
        &take("actor_rollout_ref.actor.optim.num_cycles", &mut handled),
        "num_cycles",
    )?;
    match sched.as_str() {
        "constant" => set(
            &mut tree,
            "optim.lr_scheduler_type",
            json!(if warm {
                "constant_with_warmup"
            } else {
                "constant"
            }),
        ),
        "cosine" => {
            set(
                &mut tree,
                "optim.lr_scheduler_type",
                json!("cosine_with_min_lr"),
            );
            set(
                &mut tree,
                "optim.lr_scheduler_kwargs",
                json!({"min_lr_rate": min_lr, "num_cycles": cycles}),
            );
        }
        other => bail!(
            "actor_rollout_ref.actor.optim.lr_scheduler_type={other}: verl's are constant and cosine"
        ),
    }
    handled.push("actor_rollout_ref.actor.optim.total_training_steps");
    handled.push("actor_rollout_ref.actor.optim.optimizer");
    handled.push("actor_rollout_ref.actor.optim.optimizer_impl");
    if let Some(o) = keys
        .get("actor_rollout_ref.actor.optim.optimizer")
        .map(text)
        .filter(|o| o != "AdamW")
    {
        bail!(
            "actor_rollout_ref.actor.optim.optimizer={o}: the optimizer here is AdamW (optim.optim = \"adamw_8bit\" for 8-bit)"
        );
    }

    // The batch: train_batch_size prompts per step, n completions each, ppo_mini_batch_size
    // prompts per update, micro-batches of ppo_micro_batch_size_per_gpu completions.
    let n = int(
        &take("actor_rollout_ref.rollout.n", &mut handled),
        "rollout.n",
    )?
    .max(1) as u64;
    let train = int(
        &take("data.train_batch_size", &mut handled),
        "data.train_batch_size",
    )? as u64;
    let mini = int(
        &take("actor_rollout_ref.actor.ppo_mini_batch_size", &mut handled),
        "ppo_mini_batch_size",
    )? as u64;
    if train == 0 || mini == 0 || !train.is_multiple_of(mini) {
        bail!(
            "data.train_batch_size ({train}) must be a multiple of actor_rollout_ref.actor.ppo_mini_batch_size ({mini}), as verl requires"
        );
    }
    let micro = match keys
        .get("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu")
        .filter(|v| !v.is_null())
    {
        Some(m) => int(m, "ppo_micro_batch_size_per_gpu")? as u64,
        None => mini * n,
    };
    handled.push("actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu");
    handled.push("actor_rollout_ref.actor.ppo_micro_batch_size");
    if micro == 0 || !(mini * n).is_multiple_of(micro) {
        bail!(
            "ppo_mini_batch_size × rollout.n ({}) must be a multiple of ppo_micro_batch_size_per_gpu ({micro})",
            mini * n
        );
    }
    set(&mut tree, "train.prompts_per_step", json!(train));
    set(&mut tree, "rollout.num_generations", json!(n));
    set(&mut tree, "train.per_device_train_batch_size", json!(micro));
    // Dynamic batch size: micro-batches by padded tokens (`train.token_budget`).
    let dynamic = truthy(&take(
        "actor_rollout_ref.actor.use_dynamic_bsz",
        &mut handled,
    ));
    let max_tokens = take(
        "actor_rollout_ref.actor.ppo_max_token_len_per_gpu",
        &mut handled,
    );
    if dynamic {
        let budget = match max_tokens.is_null() {
            true => 16384,
            false => int(&max_tokens, "ppo_max_token_len_per_gpu")?,
        };
        if budget <= 0 {
            bail!("actor_rollout_ref.actor.ppo_max_token_len_per_gpu must be > 0, got {budget}");
        }
        if ppo {
            notes.push((
                "actor_rollout_ref.actor.use_dynamic_bsz".into(),
                "PPO's micro-batches are counted in completions (`train.per_device_train_batch_size`)".into(),
            ));
        } else {
            set(&mut tree, "train.token_budget", json!(budget));
        }
    }
    let epochs = int(
        &take("actor_rollout_ref.actor.ppo_epochs", &mut handled),
        "ppo_epochs",
    )?;
    if ppo {
        set(&mut tree, "ppo.num_ppo_epochs", json!(epochs));
        set(&mut tree, "ppo.num_mini_batches", json!(train / mini));
    } else {
        set(&mut tree, "optim.num_iterations", json!(epochs));
        set(
            &mut tree,
            "optim.steps_per_generation",
            json!(train * n / micro),
        );
        set(
            &mut tree,
            "optim.gradient_accumulation_steps",
            json!(mini * n / micro),
        );
    }

    // The policy loss.
    let clip_ratio = take("actor_rollout_ref.actor.clip_ratio", &mut handled);
    let low = take("actor_rollout_ref.actor.clip_ratio_low", &mut handled);
    let high = take("actor_rollout_ref.actor.clip_ratio_high", &mut handled);
    let low = if low.is_null() {
        clip_ratio.clone()
    } else {
        low
    };
    let high = if high.is_null() {
        clip_ratio.clone()
    } else {
        high
    };
    if given
        .iter()
        .any(|g| g == "actor_rollout_ref.actor.clip_ratio")
        && !given
            .iter()
            .any(|g| g.starts_with("actor_rollout_ref.actor.clip_ratio_"))
    {
        notes.push(("actor_rollout_ref.actor.clip_ratio".into(), "verl's loss reads clip_ratio_low and clip_ratio_high (both 0.2 by default), not clip_ratio: translated as verl uses it".into()));
    }
    let c = num(
        &take("actor_rollout_ref.actor.clip_ratio_c", &mut handled),
        "clip_ratio_c",
    )?;
    let mode = text(&take(
        "actor_rollout_ref.actor.policy_loss.loss_mode",
        &mut handled,
    ));
    let agg = text(&take("actor_rollout_ref.actor.loss_agg_mode", &mut handled));
    let loss_type = match agg.as_str() {
        "token-mean" => "dapo",
        "seq-mean-token-mean" => "grpo",
        "seq-mean-token-sum" => "luspo",
        "seq-mean-token-sum-norm" => "dr_grpo",
        other => bail!(
            "actor_rollout_ref.actor.loss_agg_mode={other}: verl's are token-mean, seq-mean-token-mean, seq-mean-token-sum and seq-mean-token-sum-norm"
        ),
    };
    if ppo {
        set(
            &mut tree,
            "ppo.cliprange",
            json!(num(&low, "clip_ratio_low")?),
        );
        if num(&high, "clip_ratio_high")? != num(&low, "clip_ratio_low")? {
            notes.push((
                "actor_rollout_ref.actor.clip_ratio_high".into(),
                "PPO's clip is symmetric here (TRL's cliprange): clip_ratio_low".into(),
            ));
        }
        if agg != "token-mean" {
            notes.push((
                "actor_rollout_ref.actor.loss_agg_mode".into(),
                "PPO's losses are token means here (TRL's PPOTrainer)".into(),
            ));
        }
        if mode != "vanilla" {
            bail!(
                "actor_rollout_ref.actor.policy_loss.loss_mode={mode} with adv_estimator=gae: PPO's policy loss here is the vanilla clipped one"
            );
        }
        notes.push((
            "actor_rollout_ref.actor.clip_ratio_c".into(),
            "PPO's policy loss here has no dual clip (TRL's PPOTrainer)".into(),
        ));
    } else {
        set(
            &mut tree,
            "loss.epsilon",
            json!(num(&low, "clip_ratio_low")?),
        );
        set(
            &mut tree,
            "loss.epsilon_high",
            json!(num(&high, "clip_ratio_high")?),
        );
        let mut lt = loss_type;
        match mode.as_str() {
            "vanilla" => {
                // Dual-clip: for A < 0 the ratio is capped at clip_ratio_c, which is TRL's
                // two-sided clip `delta` (for A > 0 a cap above 1 + ε never binds).
                set(&mut tree, "loss.delta", json!(c));
            }
            "gspo" => set(&mut tree, "loss.importance_sampling_level", json!("sequence")),
            "sapo" => {
                lt = "sapo";
                let p = take("actor_rollout_ref.actor.tau_pos", &mut handled);
                let q = take("actor_rollout_ref.actor.tau_neg", &mut handled);
                set(&mut tree, "loss.sapo_temperature_pos", json!(num(&p, "tau_pos")?));
                set(&mut tree, "loss.sapo_temperature_neg", json!(num(&q, "tau_neg")?));
                notes.push(("actor_rollout_ref.actor.loss_agg_mode".into(), "sapo averages each sequence's tokens, then the sequences (TRL's sapo)".into()));
            }
            "geo_mean" => {
                lt = "gmpo";
                notes.push(("actor_rollout_ref.actor.loss_agg_mode".into(), "geo_mean is TRL's gmpo: one term per sequence".into()));
            }
            "cispo" => lt = "cispo",
            "clip_cov" | "kl_cov" => {
                set(&mut tree, "loss.policy_loss.loss_mode", json!(mode));
                let keys: &[&'static str] = match mode.as_str() {
                    "clip_cov" => &[
                        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
                        "actor_rollout_ref.actor.policy_loss.clip_cov_lb",
                        "actor_rollout_ref.actor.policy_loss.clip_cov_ub",
                    ],
                    _ => &[
                        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
                        "actor_rollout_ref.actor.policy_loss.ppo_kl_coef",
                    ],
                };
                for &k in keys {
                    let v = num(&take(k, &mut handled), k)?;
                    let ours = format!("loss.policy_loss.{}", k.rsplit('.').next().unwrap_or(k));
                    set(&mut tree, &ours, json!(v));
                }
            }
            "gpg" => notes.push(("actor_rollout_ref.actor.policy_loss.loss_mode".into(), "gpg's −log π · A is the clipped-ratio loss here: the same gradient while the ratio is 1 (one epoch, on-policy), clipped beyond".into())),
            other => bail!("actor_rollout_ref.actor.policy_loss.loss_mode={other}: not built here (vanilla, gspo, sapo, geo_mean, cispo, gpg, clip_cov and kl_cov are)"),
        }
        set(&mut tree, "loss.loss_type", json!(lt));
    }
    handled.push("actor_rollout_ref.actor.tau_pos");
    handled.push("actor_rollout_ref.actor.tau_neg");
    handled.extend([
        "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
        "actor_rollout_ref.actor.policy_loss.clip_cov_lb",
        "actor_rollout_ref.actor.policy_loss.clip_cov_ub",
        "actor_rollout_ref.actor.policy_loss.kl_cov_ratio",
        "actor_rollout_ref.actor.policy_loss.ppo_kl_coef",
    ]);
    if !ppo && mode == "vanilla" {
        handled.push("actor_rollout_ref.actor.clip_ratio_c");
    }
    let ent = num(
        &take("actor_rollout_ref.actor.entropy_coeff", &mut handled),
        "entropy_coeff",
    )?;
    if ent != 0.0 {
        if ppo {
            bail!(
                "actor_rollout_ref.actor.entropy_coeff with adv_estimator=gae: PPO here has no entropy bonus (TRL's PPOTrainer)"
            );
        }
        set(&mut tree, "loss.entropy_coef", json!(ent));
    }
    let kl_loss = truthy(&take("actor_rollout_ref.actor.use_kl_loss", &mut handled));
    let kl_loss_coef = num(
        &take("actor_rollout_ref.actor.kl_loss_coef", &mut handled),
        "kl_loss_coef",
    )?;
    let kl_loss_type = text(&take("actor_rollout_ref.actor.kl_loss_type", &mut handled));
    if kl_loss {
        if ppo {
            bail!(
                "actor_rollout_ref.actor.use_kl_loss with adv_estimator=gae: PPO's KL here is in the reward (algorithm.use_kl_in_reward)"
            );
        }
        set(&mut tree, "reference.beta", json!(kl_loss_coef));
        // verl's `k3` is its clamped low_var_kl; here `k3` is TRL's, unclamped.
        let ours = match kl_loss_type.as_str() {
            "k3" => "low_var_kl".to_string(),
            "k3+" => "low_var_kl+".to_string(),
            other => other.to_string(),
        };
        if let Err(e) = ours.parse::<grpo_core::loss::KlLossType>() {
            bail!("actor_rollout_ref.actor.kl_loss_type={kl_loss_type}: {e}");
        }
        set(&mut tree, "loss.kl_loss_type", json!(ours));
    }

    // Sampling.
    let temp = num(
        &take("actor_rollout_ref.rollout.temperature", &mut handled),
        "rollout.temperature",
    )?;
    set(&mut tree, "rollout.temperature", json!(temp));
    let top_p = num(
        &take("actor_rollout_ref.rollout.top_p", &mut handled),
        "rollout.top_p",
    )?;
    set(&mut tree, "rollout.top_p", json!(top_p));
    let top_k = int(
        &take("actor_rollout_ref.rollout.top_k", &mut handled),
        "rollout.top_k",
    )?;
    set(&mut tree, "rollout.top_k", json!(top_k.max(0)));
    if !truthy(&take("actor_rollout_ref.rollout.do_sample", &mut handled)) {
        bail!(
            "actor_rollout_ref.rollout.do_sample=False: training samples its completions (a group of greedy completions would be identical)"
        );
    }
    for (k, ours) in [(
        "actor_rollout_ref.rollout.val_kwargs.n",
        "rollout.num_generations_eval",
    )] {
        if let Some(v) = keys.get(k).filter(|v| !v.is_null()) {
            handled.push(k);
            set(&mut tree, ours, v.clone());
        }
    }
    for k in ["temperature", "top_p", "top_k", "do_sample"] {
        let key = format!("actor_rollout_ref.rollout.val_kwargs.{k}");
        if given.contains(&key) {
            notes.push((key, "evaluation samples as training does".into()));
        }
    }
    let max_prompt = int(
        &take("data.max_prompt_length", &mut handled),
        "data.max_prompt_length",
    )?;
    let max_response = int(
        &take("data.max_response_length", &mut handled),
        "data.max_response_length",
    )?;
    set(&mut tree, "rollout.max_prompt_length", json!(max_prompt));
    set(
        &mut tree,
        "rollout.max_completion_length",
        json!(max_response),
    );
    match text(&take("data.truncation", &mut handled)).as_str() {
        "left" => {}
        "error" => notes.push(("data.truncation".into(), format!("a prompt longer than {max_prompt} tokens keeps its last {max_prompt} (verl's `error` stops the run)"))),
        other => notes.push(("data.truncation".into(), format!("`{other}`: a longer prompt keeps its last tokens here"))),
    }

    // Data.
    let files = |v: &Value| -> Vec<String> {
        match v {
            Value::Array(a) => a.iter().map(|x| home(&text(x), env)).collect(),
            Value::Null => Vec::new(),
            x => vec![home(&text(x), env)],
        }
    };
    let train_files = files(&take("data.train_files", &mut handled));
    for f in &train_files {
        if !Path::new(f).exists() {
            notes.push(("data.train_files".into(), format!("`{f}` does not exist yet (verl's examples write it with their data preprocessing scripts)")));
        }
    }
    set(&mut tree, "data.path", json!(train_files));
    let val = files(&take("data.val_files", &mut handled));
    let test_freq = int(
        &take("trainer.test_freq", &mut handled),
        "trainer.test_freq",
    )?;
    if test_freq > 0 && !val.is_empty() {
        set(&mut tree, "data.eval_path", json!(val));
        set(&mut tree, "train.eval_steps", json!(test_freq));
    }
    if truthy(&take("trainer.val_before_train", &mut handled)) && test_freq > 0 {
        notes.push((
            "trainer.val_before_train".into(),
            "evaluation runs every train.eval_steps steps, not before the first".into(),
        ));
    }
    let prompt_key = text(&take("data.prompt_key", &mut handled));
    set(&mut tree, "data.prompt_field", json!(prompt_key));
    set(
        &mut tree,
        "train.shuffle_dataset",
        json!(truthy(&take("data.shuffle", &mut handled))),
    );
    if let Some(s) = keys.get("data.seed").filter(|v| !v.is_null()) {
        handled.push("data.seed");
        set(&mut tree, "train.seed", s.clone());
    }
    handled.push("data.seed");
    let max_samples = int(
        &take("data.train_max_samples", &mut handled),
        "train_max_samples",
    )?;
    if max_samples > 0 {
        set(&mut tree, "data.max_samples", json!(max_samples));
    }

    // Rewards: a reward model, a custom compute_score, else verl's rule-based default by
    // data_source.
    let rm = truthy(&take("reward_model.enable", &mut handled));
    let custom = keys
        .get("custom_reward_function.path")
        .filter(|v| !v.is_null())
        .map(text);
    handled.push("custom_reward_function.path");
    let fname = text(&take("custom_reward_function.name", &mut handled));
    if rm {
        let path = keys
            .get("reward_model.model.path")
            .map(text)
            .unwrap_or_default();
        handled.push("reward_model.model.path");
        tree["reward_model_path"] = json!(home(&path, env));
        tree["rewards"] = json!([{"type": "reward_model"}]);
        if custom.is_some() {
            notes.push(("custom_reward_function.path".into(), "with reward_model.enable the reward model scores alone here (verl's managers combine them their own way)".into()));
        }
    } else if let Some(p) = custom {
        let p = home(&p, env);
        tree["rewards"] = json!([{"type": "python", "name": "compute_score", "path": p, "function": fname, "signature": "verl"}]);
        if keys
            .keys()
            .any(|k| k.starts_with("custom_reward_function.reward_kwargs."))
        {
            bail!(
                "custom_reward_function.reward_kwargs: extra keyword arguments to compute_score are not passed here; give them defaults in the function"
            );
        }
    } else {
        tree["rewards"] = json!([{"type": "python", "name": "compute_score", "path": "verl.utils.reward_score", "function": "default_compute_score", "signature": "verl"}]);
        notes.push(("custom_reward_function".into(), "none given: verl's rule-based scores by data_source (`verl.utils.reward_score.default_compute_score`), which needs verl installed for python3 (or give a `type = \"python\"` path of your own)".into()));
    }

    // DAPO's reward manager adds its soft overlong punishment to the score: the `overlong`
    // reward, weighted by the penalty factor.
    let manager = keys
        .get("reward_model.reward_manager")
        .map(text)
        .unwrap_or_else(|| "naive".into());
    handled.push("reward_model.reward_manager");
    let ob = "reward_model.reward_kwargs.overlong_buffer_cfg.";
    if keys.get(&format!("{ob}enable")).is_some_and(truthy) {
        if manager != "dapo" {
            notes.push((format!("{ob}enable"), format!("only verl's dapo reward manager reads it (reward_manager is {manager}): left out")));
        } else {
            let len = keys
                .get(&format!("{ob}len"))
                .map(|v| int(v, "overlong_buffer_cfg.len"))
                .transpose()?;
            let factor = keys
                .get(&format!("{ob}penalty_factor"))
                .map(|v| num(v, "overlong_buffer_cfg.penalty_factor"))
                .transpose()?
                .unwrap_or(1.0);
            let max_len = match keys.get("reward_model.reward_kwargs.max_resp_len") {
                Some(v) => int(v, "reward_kwargs.max_resp_len")?,
                None => max_response,
            };
            let Some(len) = len else {
                bail!("{ob}len: the overlong buffer needs its length");
            };
            if let Some(r) = tree["rewards"].as_array_mut() {
                r.push(json!({"type": "overlong", "name": "overlong", "max_completion_length": max_len, "overlong_buffer": len, "weight": factor}));
            }
        }
    }
    handled.extend([
        "reward_model.reward_kwargs.overlong_buffer_cfg.enable",
        "reward_model.reward_kwargs.overlong_buffer_cfg.len",
        "reward_model.reward_kwargs.overlong_buffer_cfg.penalty_factor",
        "reward_model.reward_kwargs.overlong_buffer_cfg.log",
        "reward_model.reward_kwargs.max_resp_len",
    ]);
    // DAPO's dynamic sampling: more generation batches until the step's groups all differ.
    let filter = truthy(&take("algorithm.filter_groups.enable", &mut handled));
    let metric = take("algorithm.filter_groups.metric", &mut handled);
    let max_gen = take("algorithm.filter_groups.max_num_gen_batches", &mut handled);
    let gen_batch = take("data.gen_batch_size", &mut handled);
    if filter {
        set(&mut tree, "loss.filter_groups.enable", json!(true));
        let metric = match &metric {
            Value::Null => {
                notes.push((
                    "algorithm.filter_groups.metric".into(),
                    "none given (verl needs one): the combined reward".into(),
                ));
                "reward".to_string()
            }
            m => text(m),
        };
        let ours = match metric.as_str() {
            "seq_reward" => "reward".to_string(),
            "seq_final_reward" => {
                if kl_in_reward {
                    notes.push(("algorithm.filter_groups.metric".into(), "seq_final_reward: the groups are picked on the reward before the in-reward KL penalty, which the learner adds after".into()));
                }
                "reward".to_string()
            }
            other => {
                notes.push(("algorithm.filter_groups.metric".into(), format!("`{other}` is read from what the rewards log per completion (a verl reward's dict key): a reward that returns a plain number logs none, and the run stops naming the metric; `reward` is the combined reward")));
                other.to_string()
            }
        };
        set(&mut tree, "loss.filter_groups.metric", json!(ours));
        if !max_gen.is_null() {
            let n = int(&max_gen, "algorithm.filter_groups.max_num_gen_batches")?;
            set(
                &mut tree,
                "loss.filter_groups.max_num_gen_batches",
                json!(n.max(0)),
            );
        }
        if !gen_batch.is_null() {
            let n = int(&gen_batch, "data.gen_batch_size")?;
            if n < 1 {
                bail!("data.gen_batch_size={n}: must be at least 1");
            }
            set(&mut tree, "loss.filter_groups.gen_batch_size", json!(n));
        }
    } else if !gen_batch.is_null()
        && gen_batch
            != keys
                .get("data.train_batch_size")
                .cloned()
                .unwrap_or(Value::Null)
    {
        notes.push((
            "data.gen_batch_size".into(),
            "without algorithm.filter_groups a step trains on data.train_batch_size prompts".into(),
        ));
    }

    // The run.
    let out = text(&take("trainer.default_local_dir", &mut handled));
    handled.push("trainer.project_name");
    handled.push("trainer.experiment_name");
    tree["output_dir"] = json!(out);
    if let Some(s) = keys
        .get("trainer.total_training_steps")
        .filter(|v| !v.is_null())
    {
        handled.push("trainer.total_training_steps");
        set(
            &mut tree,
            "train.max_steps",
            json!(int(s, "trainer.total_training_steps")?),
        );
    }
    handled.push("trainer.total_training_steps");
    let epochs = take("trainer.total_epochs", &mut handled);
    set(
        &mut tree,
        "train.num_train_epochs",
        json!(num(&epochs, "trainer.total_epochs")?),
    );
    let save = int(
        &take("trainer.save_freq", &mut handled),
        "trainer.save_freq",
    )?;
    set(&mut tree, "train.save_steps", json!(save.max(0)));
    if let Some(k) = keys
        .get("trainer.max_actor_ckpt_to_keep")
        .filter(|v| !v.is_null())
    {
        set(&mut tree, "train.save_total_limit", k.clone());
    }
    handled.push("trainer.max_actor_ckpt_to_keep");

    // Whatever else the run gave.
    for k in &given {
        if handled.iter().any(|h| h == k) || notes.iter().any(|(n, _)| n == k) {
            continue;
        }
        if let Some((_, why)) = DROPPED.iter().find(|(p, _)| k.starts_with(p)) {
            notes.push((k.clone(), (*why).to_string()));
        } else {
            notes.push((
                k.clone(),
                "not a key of verl's config that this translation knows: left out".into(),
            ));
        }
    }
    notes.sort();
    notes.dedup();
    Ok(Imported { tree, notes })
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn env(k: &str) -> Option<String> {
        match k {
            "HOME" => Some("/home/u".into()),
            "SET" => Some("from-env".into()),
            _ => None,
        }
    }

    #[test]
    fn hydra_values_parse_as_hydra_reads_them() {
        assert_eq!(hydra_value("True"), json!(true));
        assert_eq!(hydra_value("false"), json!(false));
        assert_eq!(hydra_value("null"), Value::Null);
        assert_eq!(hydra_value("3e-6"), json!(3e-6));
        assert_eq!(hydra_value("-1"), json!(-1));
        assert_eq!(hydra_value("'error'"), json!("error"));
        assert_eq!(hydra_value("token-mean"), json!("token-mean"));
        assert_eq!(
            hydra_value("['/a/b.parquet', \"/c,d.parquet\"]"),
            json!(["/a/b.parquet", "/c,d.parquet"])
        );
        assert_eq!(hydra_value("[0.9, 0.999]"), json!([0.9, 0.999]));
        assert_eq!(hydra_value("[]"), json!([]));
    }

    #[test]
    fn scripts_expand_variables_quotes_and_continuations() {
        let script = r#"#!/bin/bash
set -x
export DATA=$HOME/data   # a comment
N=4
name="run 1"
python3 -m verl.trainer.main_ppo --config-path=cfg \
  data.train_files="['$DATA/a.parquet', '${DATA}/b.parquet']" \
  actor_rollout_ref.rollout.n=$N \
  trainer.experiment_name="$name" \
  trainer.project_name='$NOT_EXPANDED' \
  model.x=${UNSET:-fallback/$N} model.y=$SET \
  +trainer.extra=1 ++trainer.more=2 ~trainer.gone \
  trainer.logger=['console'] $@ # trailing comment
"#;
        let (o, notes) = script_overrides(script, &env).unwrap();
        let m: BTreeMap<String, Value> = o.into_iter().collect();
        assert_eq!(
            m["data.train_files"],
            json!(["/home/u/data/a.parquet", "/home/u/data/b.parquet"])
        );
        assert_eq!(m["actor_rollout_ref.rollout.n"], json!(4));
        assert_eq!(m["trainer.experiment_name"], json!("run 1"));
        assert_eq!(m["trainer.project_name"], json!("$NOT_EXPANDED"));
        assert_eq!(m["model.x"], json!("fallback/4"));
        assert_eq!(m["model.y"], json!("from-env"));
        assert_eq!(m["trainer.extra"], json!(1));
        assert_eq!(m["trainer.more"], json!(2));
        assert_eq!(m["trainer.gone"], Value::Null);
        assert_eq!(m["trainer.logger"], json!(["console"]));
        assert!(notes.iter().any(|(k, _)| k == "--config-path"), "{notes:?}");
    }

    #[test]
    fn shell_arithmetic_evaluates_as_bash() {
        let script = "L=$((1024 * 2))\nB=$(( (L + 512) / 4 - -1 ))\npython3 -m recipe.dapo.main_dapo a=$((L*2)) b=$B c=$((${L} % 1000)) d=$((UNSET + 3)) e=$((2 +))\n";
        let (o, _) = script_overrides(script, &env).unwrap();
        let m: BTreeMap<String, Value> = o.into_iter().collect();
        assert_eq!(m["a"], json!(4096));
        assert_eq!(m["b"], json!(641));
        assert_eq!(m["c"], json!(48));
        assert_eq!(m["d"], json!(3));
        // What cannot be read stays as written.
        assert_eq!(m["e"], json!("$((2 +))"));
    }

    #[test]
    fn interpolations_resolve_and_defaults_are_verls() {
        let t = translate(
            &[
                ("algorithm.adv_estimator".into(), json!("grpo")),
                ("actor_rollout_ref.rollout.n".into(), json!(2)),
                ("data.train_batch_size".into(), json!(8)),
                (
                    "actor_rollout_ref.actor.ppo_mini_batch_size".into(),
                    json!(8),
                ),
                ("trainer.experiment_name".into(), json!("exp")),
                (
                    "actor_rollout_ref.actor.clip_ratio_high".into(),
                    json!(0.28),
                ),
                (
                    "actor_rollout_ref.actor.optim.lr_warmup_steps".into(),
                    json!(5),
                ),
                ("algorithm.norm_adv_by_std_in_grpo".into(), json!(false)),
                ("some.unknown".into(), json!(1)),
            ],
            &env,
        )
        .unwrap();
        assert_eq!(t.tree["output_dir"], json!("checkpoints/verl_examples/exp"));
        assert_eq!(t.tree["loss"]["epsilon_high"], json!(0.28));
        assert_eq!(t.tree["loss"]["scale_rewards"], json!("none"));
        assert_eq!(
            t.tree["optim"]["lr_scheduler_type"],
            json!("constant_with_warmup")
        );
        assert_eq!(t.tree["optim"]["warmup_steps"], json!(5));
        assert_eq!(
            t.tree["model"]["path"],
            json!("/home/u/models/deepseek-llm-7b-chat")
        );
        // One micro-batch of 16 completions per update, one update per step.
        assert_eq!(t.tree["optim"]["steps_per_generation"], json!(1));
        assert_eq!(t.tree["train"]["per_device_train_batch_size"], json!(16));
        assert!(
            t.notes
                .iter()
                .any(|(k, why)| k == "some.unknown" && why.contains("left out"))
        );
        assert_eq!(
            t.tree["rewards"][0]["function"],
            json!("default_compute_score")
        );
    }

    fn grpo_with(extra: &[(&str, Value)]) -> Result<Imported> {
        let mut keys: Vec<(String, Value)> = vec![
            ("algorithm.adv_estimator".into(), json!("grpo")),
            ("actor_rollout_ref.rollout.n".into(), json!(2)),
            ("data.train_batch_size".into(), json!(8)),
            (
                "actor_rollout_ref.actor.ppo_mini_batch_size".into(),
                json!(8),
            ),
        ];
        keys.extend(extra.iter().map(|(k, v)| (k.to_string(), v.clone())));
        translate(&keys, &env)
    }

    #[test]
    fn the_kl_loss_type_is_verls_and_its_k3_is_low_var_kl() {
        for (verl, ours) in [
            ("k3", "low_var_kl"),
            ("low_var_kl", "low_var_kl"),
            ("k3+", "low_var_kl+"),
            ("mse", "mse"),
            ("k1+", "k1+"),
        ] {
            let t = grpo_with(&[
                ("actor_rollout_ref.actor.use_kl_loss", json!(true)),
                ("actor_rollout_ref.actor.kl_loss_coef", json!(0.01)),
                ("actor_rollout_ref.actor.kl_loss_type", json!(verl)),
            ])
            .unwrap();
            assert_eq!(t.tree["loss"]["kl_loss_type"], json!(ours), "{verl}");
            assert_eq!(t.tree["reference"]["beta"], json!(0.01));
        }
        let e = grpo_with(&[
            ("actor_rollout_ref.actor.use_kl_loss", json!(true)),
            ("actor_rollout_ref.actor.kl_loss_type", json!("full")),
        ])
        .unwrap_err()
        .to_string();
        assert!(e.contains("kl_loss_type=full") && !e.contains('\n'), "{e}");
    }

    #[test]
    fn clip_cov_and_kl_cov_carry_their_settings() {
        let t = grpo_with(&[
            (
                "actor_rollout_ref.actor.policy_loss.loss_mode",
                json!("clip_cov"),
            ),
            (
                "actor_rollout_ref.actor.policy_loss.clip_cov_ratio",
                json!(0.001),
            ),
        ])
        .unwrap();
        let p = &t.tree["loss"]["policy_loss"];
        assert_eq!(p["loss_mode"], json!("clip_cov"));
        assert_eq!(
            (&p["clip_cov_ratio"], &p["clip_cov_lb"], &p["clip_cov_ub"]),
            (&json!(0.001), &json!(1.0), &json!(5.0))
        );
        // No dual clip: verl's clip_cov ignores clip_ratio_c.
        assert!(t.tree["loss"].get("delta").is_none());
        let t = grpo_with(&[(
            "actor_rollout_ref.actor.policy_loss.loss_mode",
            json!("kl_cov"),
        )])
        .unwrap();
        let p = &t.tree["loss"]["policy_loss"];
        assert_eq!(
            (&p["loss_mode"], &p["kl_cov_ratio"], &p["ppo_kl_coef"]),
            (&json!("kl_cov"), &json!(0.0002), &json!(0.1))
        );
    }

    #[test]
    fn dynamic_sampling_translates_with_its_metric() {
        let t = grpo_with(&[("algorithm.filter_groups.enable", json!(true))]).unwrap();
        assert_eq!(t.tree["loss"]["filter_groups"]["metric"], json!("reward"));
        assert!(
            t.notes
                .iter()
                .any(|(k, why)| k == "algorithm.filter_groups.metric" && why.contains("none given"))
        );
        let t = grpo_with(&[
            ("algorithm.filter_groups.enable", json!(true)),
            ("algorithm.filter_groups.metric", json!("acc")),
            ("algorithm.filter_groups.max_num_gen_batches", json!(-1)),
            ("data.gen_batch_size", json!(24)),
        ])
        .unwrap();
        let f = &t.tree["loss"]["filter_groups"];
        assert_eq!(
            (
                &f["metric"],
                &f["max_num_gen_batches"],
                &f["gen_batch_size"]
            ),
            (&json!("acc"), &json!(0), &json!(24))
        );
        assert!(
            t.notes
                .iter()
                .any(|(_, why)| why.contains("a verl reward's dict key"))
        );
        // Without the filter a larger generation batch is noted, not translated.
        let t = grpo_with(&[("data.gen_batch_size", json!(24))]).unwrap();
        assert!(t.tree["loss"].get("filter_groups").is_none());
        assert!(t.notes.iter().any(|(k, _)| k == "data.gen_batch_size"));
    }
}
