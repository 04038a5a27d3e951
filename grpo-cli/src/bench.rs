//! `grpo-cli bench`: the GRPO step workload of `bench/README.md`, run by our trainer,
//! reported with the keys of `trl_grpo_bench.py`.
//!
//! Workload: prompts `"Write about {w[i%12]} and {w[(i*5)%12]} number {i}:"` (plain text), 4
//! prompts × 8 generations per step, temperature 1, exactly 64 completion tokens (EOS
//! suppressed until 64), reward = fraction of the completion's characters that are `a`,
//! β = 0.04 (a frozen reference model is evaluated), dapo, ε = 0.2, lr 1e-5, one optimizer step
//! per generation batch, f32 on the CPU. Device, dtype, micro-batch, LoRA rank and gradient
//! checkpointing can be changed (the GPU comparison, `scripts/bench-gpu-vs-trl.sh`).

use std::path::Path;

use anyhow::{Context, Result, anyhow};
use grpo_rewards::RewardInput;
use grpo_trainer::{GrpoTrainer, TrainConfig};

/// Bench knobs (defaults = the shared workload).
#[derive(Debug, Clone)]
pub struct BenchOptions {
    /// Optimizer steps (the first is warm-up and excluded from the median).
    pub steps: usize,
    /// Prompts per step.
    pub prompts: usize,
    /// Generations per prompt.
    pub generations: usize,
    /// Completion tokens.
    pub completion: usize,
    /// KL coefficient.
    pub beta: f64,
    /// Train LoRA adapters of this rank (α = 2r, every projection) instead of every weight.
    pub lora_r: Option<usize>,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
    /// `f32`, `bf16` or `f16`.
    pub dtype: String,
    /// Completions per micro-batch (`train.per_device_train_batch_size`); `None` = the step.
    pub micro_batch: Option<usize>,
    /// `train.gradient_checkpointing`.
    pub gradient_checkpointing: bool,
    /// `pipeline.max_staleness`: with 1 or more, generation of the next step overlaps the
    /// learner's step (off-policy by up to that many versions, corrected as configured).
    pub max_staleness: usize,
    /// `optim.optim` by transformers' name (`adamw_torch`, `adamw_8bit`, ...).
    pub optim: String,
}

impl Default for BenchOptions {
    fn default() -> Self {
        Self {
            steps: 6,
            prompts: 4,
            generations: 8,
            completion: 64,
            beta: 0.04,
            lora_r: None,
            device: "cpu".into(),
            dtype: "f32".into(),
            micro_batch: None,
            gradient_checkpointing: false,
            max_staleness: 0,
            optim: "adamw_torch".into(),
        }
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    if v.is_empty() {
        return f64::NAN;
    }
    v.sort_by(f64::total_cmp);
    let n = v.len();
    if n % 2 == 1 {
        v[n / 2]
    } else {
        (v[n / 2 - 1] + v[n / 2]) / 2.0
    }
}

/// Runs the workload on the model directory and returns the JSON line.
pub fn run(model: &Path, opts: &BenchOptions) -> Result<serde_json::Value> {
    let work = std::env::temp_dir().join(format!("grpo-bench-{}", std::process::id()));
    std::fs::create_dir_all(&work)?;
    let words = [
        "alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta", "iota", "kappa",
        "lambda", "mu",
    ];
    let data = work.join("prompts.jsonl");
    let mut lines = String::new();
    for i in 0..256 {
        let p = format!(
            "Write about {} and {} number {i}:",
            words[i % 12],
            words[(i * 5) % 12]
        );
        lines.push_str(&serde_json::json!({ "prompt": p }).to_string());
        lines.push('\n');
    }
    std::fs::write(&data, lines).with_context(|| format!("{}: cannot write", data.display()))?;

    let mut cfg = TrainConfig {
        output_dir: work.join("run"),
        // A scratch directory of this process.
        overwrite_output_dir: true,
        ..Default::default()
    };
    cfg.model.path = model.to_path_buf();
    cfg.model.device = opts
        .device
        .parse()
        .map_err(|e| anyhow!("--device {}: {e}", opts.device))?;
    cfg.model.dtype = opts
        .dtype
        .parse()
        .map_err(|e| anyhow!("--dtype {}: {e}", opts.dtype))?;
    cfg.train.per_device_train_batch_size = opts.micro_batch;
    cfg.train.gradient_checkpointing = opts.gradient_checkpointing;
    cfg.pipeline.max_staleness = opts.max_staleness;
    cfg.optim.optim = serde_json::from_value(serde_json::json!(opts.optim))
        .map_err(|e| anyhow!("--optim {}: {e}", opts.optim))?;
    if let Some(r) = opts.lora_r {
        cfg.model.lora = Some(grpo_rollout::LoraConfig {
            r,
            lora_alpha: 2.0 * r as f64,
            target_modules: grpo_rollout::lora::TargetModules::Pattern(
                grpo_rollout::lora::ALL_LINEAR.into(),
            ),
            ..Default::default()
        });
    }
    cfg.data.path = vec![data.display().to_string()];
    cfg.rollout.num_generations = opts.generations;
    cfg.rollout.max_completion_length = opts.completion;
    cfg.rollout.min_completion_length = opts.completion;
    cfg.rollout.max_prompt_length = 0;
    cfg.reference.beta = opts.beta;
    cfg.optim.learning_rate = Some(1e-5);
    cfg.train.max_steps = Some(opts.steps);
    cfg.train.prompts_per_step = opts.prompts;
    cfg.train.seed = 0;
    cfg.train.save_steps = 0;
    cfg.train.save_total_limit = 1;
    cfg.train.log_completions = false;
    let frac_a = |b: &[RewardInput]| -> Vec<f32> {
        b.iter()
            .map(|x| {
                let n = x.completion.chars().count().max(1);
                x.completion.chars().filter(|&c| c == 'a').count() as f32 / n as f32
            })
            .collect()
    };
    let res = GrpoTrainer::from_config(cfg)
        .and_then(|t| t.with_reward("frac_a", 1.0, frac_a))
        .and_then(|mut t| t.fit());
    std::fs::remove_dir_all(&work).ok();
    let times = res?.metrics;
    let all: Vec<f64> = times.iter().map(|m| m["step_time"]).collect();
    let steady = |k: &str| -> f64 {
        median(
            times
                .iter()
                .skip(1)
                .map(|m| m.get(k).copied().unwrap_or(f64::NAN))
                .collect(),
        )
    };
    let med = if all.len() > 1 {
        median(all[1..].to_vec())
    } else {
        median(all.clone())
    };
    let tokens = opts.prompts * opts.generations * opts.completion;
    let threads = std::thread::available_parallelism().map_or(1, |n| n.get());
    Ok(serde_json::json!({
        "impl": "grpo-rs",
        "version": env!("CARGO_PKG_VERSION"),
        "threads": threads,
        "step_s_median": (med * 1e4).round() / 1e4,
        "step_s_all": all.iter().map(|t| (t * 1e4).round() / 1e4).collect::<Vec<_>>(),
        "completion_tokens_per_step": tokens,
        "tokens_per_s": (tokens as f64 / med * 10.0).round() / 10.0,
        "generate_s_median": steady("timing/generate_s"),
        "score_s_median": steady("timing/score_s"),
        "train_s_median": steady("timing/train_s"),
        "peak_rss_mib": times.last().map(|m| m["peak_rss_mib"]),
        "completion_length": opts.completion,
        "lora_r": opts.lora_r,
        "max_staleness": opts.max_staleness,
        "optim": opts.optim,
        // Decode steps captured as CUDA graphs (0: every step ran eagerly).
        "decode_graphs": grpo_rollout::graph::captures(),
    }))
}
