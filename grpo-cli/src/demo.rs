//! `grpo-cli demo`: offline GRPO on arithmetic, from nothing, in a few minutes on 2 cores.
//!
//! 1. A random-weight model (`init-model --preset small`, ~2M parameters, llama layout) and
//!    synthetic one-digit arithmetic (`a + b`, `a - b`, `a * b`) with integer answers.
//! 2. A short supervised warm-up on built-in solved examples (`"What is 3 + 4?"` → `" 7"` +
//!    EOS): the random model learns the answer format and some arithmetic, not all of it.
//! 3. GRPO with the `accuracy` reward (the last number of the completion against `answer`),
//!    through the same trainer and run directory as `grpo-cli train`.
//!
//! The reward the demo prints is the mean accuracy of the sampled completions (temperature 1)
//! at the first and at the last GRPO steps. The warm-up is deliberately short so that GRPO
//! has something left to learn.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use candle_core::{DType, Device};
use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::{Arch, TrainableModel};

use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::optim::{AdamW, AdamWParams, clip_grad_norm};
use grpo_trainer::{RunOptions, TrainingResult, completion_logps};

/// Demo knobs.
#[derive(Debug, Clone)]
pub struct DemoOptions {
    /// Run directory.
    pub out: PathBuf,
    /// Supervised warm-up steps (batches of 32 examples).
    pub sft_steps: usize,
    /// GRPO steps.
    pub grpo_steps: usize,
    /// Seed of everything.
    pub seed: u64,
    /// Show progress.
    pub progress: bool,
    /// `cpu`, `cuda` or `cuda:N`.
    pub device: String,
}

impl Default for DemoOptions {
    fn default() -> Self {
        Self {
            out: PathBuf::from("runs/demo"),
            sft_steps: 400,
            grpo_steps: 120,
            seed: 0,
            progress: true,
            device: "cpu".into(),
        }
    }
}

/// Steps averaged for the first / last reward the demo prints (one step's 128 samples are noisy).
pub const REPORT_STEPS: usize = 20;

/// Distinct problems GRPO trains on. The reward is measured on the prompts being trained, as a
/// GRPO reward curve always is; with 64 problems each comes back about 15 times in 120 steps,
/// which is what lets a 2M-parameter model visibly improve within the demo's budget (with all
/// ~300 one-digit problems, each seen twice, the curve stays flat for hundreds of steps).
pub const GRPO_PROBLEMS: u64 = 64;

/// The config `grpo-cli demo` trains with (also `configs/quickstart.toml`).
pub const QUICKSTART: &str = include_str!("../../configs/quickstart.toml");

/// What the demo reports.
#[derive(Debug)]
pub struct DemoReport {
    /// The GRPO run.
    pub result: TrainingResult,
    /// Mean reward of the first [`REPORT_STEPS`] steps.
    pub first_reward: f64,
    /// Mean reward of the last [`REPORT_STEPS`] steps.
    pub last_reward: f64,
    /// Warm-up loss at the start and the end.
    pub sft_loss: (f64, f64),
}

/// Supervised warm-up: minimise −mean log p(answer tokens + EOS | prompt) on `examples`
/// (plain-text prompts with the tokenizer's special tokens; answers after a space).
/// Returns the loss of the first and last batches.
pub fn warm_up(
    model_dir: &Path,
    examples: &[(String, String)],
    steps: usize,
    lr: f64,
    seed: u64,
    device: &Device,
) -> Result<(f64, f64)> {
    warm_up_with(model_dir, examples, false, steps, lr, seed, device)
}

/// [`warm_up`] on chat-rendered examples: the prompt is text the chat template rendered
/// (tokenized as written), the completion the assistant's text, EOS after it. The learning rate
/// warms up linearly over the first 5% of steps, then decays as a cosine to 10% of `lr`.
pub fn warm_up_pairs(
    model_dir: &Path,
    examples: &[(String, String)],
    steps: usize,
    lr: f64,
    seed: u64,
    device: &Device,
) -> Result<(f64, f64)> {
    warm_up_with(model_dir, examples, true, steps, lr, seed, device)
}

fn warm_up_with(
    model_dir: &Path,
    examples: &[(String, String)],
    chat: bool,
    steps: usize,
    lr: f64,
    seed: u64,
    device: &Device,
) -> Result<(f64, f64)> {
    let loaded = grpo_rollout::load(model_dir, DType::F32, device)?;
    let tok = loaded.tokenizer.clone();
    let policy = TrainableModel::full(&loaded.model)?;
    let mut opt = AdamW::new(
        policy.vars.clone(),
        AdamWParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.0,
        },
    )?;
    let eos = *tok
        .eos_token_ids
        .first()
        .context("the model has no EOS token")?;
    let encoded: Vec<(Vec<u32>, Vec<u32>)> = examples
        .iter()
        .map(|(p, a)| {
            let (p, mut c) = if chat {
                (tok.encode(p, false)?, tok.encode(a, false)?)
            } else {
                (tok.encode(p, true)?, tok.encode(&format!(" {a}"), false)?)
            };
            c.push(eos);
            Ok((p, c))
        })
        .collect::<Result<_>>()?;
    let batch = 32usize;
    let mut rng = grpo_data::rng::SeededRng::new(seed);
    let (mut first, mut last) = (f64::NAN, f64::NAN);
    for step in 0..steps {
        let idx: Vec<usize> = (0..batch)
            .map(|_| rng.below(encoded.len() as u64) as usize)
            .collect();
        let prompts: Vec<&[u32]> = idx.iter().map(|&i| encoded[i].0.as_slice()).collect();
        let comps: Vec<&[u32]> = idx.iter().map(|&i| encoded[i].1.as_slice()).collect();
        let (lp, _, c) = completion_logps(
            &policy.model,
            tok.pad_token_id,
            &prompts,
            &comps,
            1.0,
            false,
        )?;
        let mut m = Vec::with_capacity(batch * c);
        for co in &comps {
            m.extend((0..c).map(|j| if j < co.len() { 1f32 } else { 0f32 }));
        }
        let mask = candle_core::Tensor::from_vec(m, (batch, c), device)?;
        let loss =
            ((lp * &mask)?.sum_all()? / mask.sum_all()?.to_scalar::<f32>()? as f64)?.neg()?;
        let lv = loss.to_scalar::<f32>()? as f64;
        if step == 0 {
            first = lv;
        }
        last = lv;
        let grads = loss.backward()?;
        let mut acc = std::collections::HashMap::new();
        opt.accumulate(&mut acc, &grads)?;
        clip_grad_norm(&mut acc, 1.0)?;
        // Chat warm-ups (`warm_up_pairs`): linear warm-up, cosine decay to 10%.
        let lr_now = if chat {
            let w = (steps / 20).max(1);
            if step < w {
                lr * (step + 1) as f64 / w as f64
            } else {
                let t = (step - w) as f64 / (steps - w).max(1) as f64;
                lr * (0.1 + 0.9 * 0.5 * (1.0 + (std::f64::consts::PI * t).cos()))
            }
        } else {
            lr
        };
        opt.step(&acc, lr_now)?;
    }
    grpo_rollout::save_hf_dir(&policy.model.detached(), &tok, model_dir, DType::F32)?;
    Ok((first, last))
}

/// Makes the model and data, warms up, trains with GRPO.
pub fn run(opts: &DemoOptions) -> Result<DemoReport> {
    let out = &opts.out;
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let model_dir = out.join("model");
    init_model_dir(&model_dir, Preset::Small, Arch::Llama, opts.seed)?;
    let synth = ArithmeticConfig {
        n: GRPO_PROBLEMS,
        seed: opts.seed,
        digits: 1,
        steps: 1,
    };
    let data = out.join("arithmetic.parquet");
    synth.write(&data).map_err(|e| anyhow::anyhow!("{e}"))?;
    // Warm-up examples: another seeded draw of the same kind of problems. With one digit there
    // are only ~300 problems, so it overlaps GRPO's; the warm-up is short enough that the model
    // still gets most answers wrong (accuracy ~0.3 when GRPO starts).
    let warm = ArithmeticConfig {
        seed: opts.seed + 1,
        ..synth
    };
    let examples: Vec<(String, String)> = (0..2000).map(|i| warm.problem(i)).collect();
    let device = opts
        .device
        .parse::<grpo_rollout::DeviceSpec>()
        .and_then(|d| d.device())
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", opts.device))?;
    let sft_loss = warm_up(
        &model_dir,
        &examples,
        opts.sft_steps,
        3e-3,
        opts.seed,
        &device,
    )?;

    let result = grpo_stage(
        QUICKSTART,
        "configs/quickstart.toml",
        opts,
        &model_dir,
        &data,
    )?;
    let rewards: Vec<f64> = result.metrics.iter().map(|m| m["reward"]).collect();
    let k = REPORT_STEPS.min(rewards.len()).max(1);
    let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
    Ok(DemoReport {
        first_reward: mean(&rewards[..k.min(rewards.len())]),
        last_reward: mean(&rewards[rewards.len().saturating_sub(k)..]),
        result,
        sft_loss,
    })
}

/// Trains the GRPO stage of a demo: `config` (the text of `source`) with the demo's model,
/// data, steps, seed and device, in `opts.out/grpo`, started over each time.
pub(crate) fn grpo_stage(
    config: &str,
    source: &str,
    opts: &DemoOptions,
    model_dir: &Path,
    data: &Path,
) -> Result<TrainingResult> {
    let mut tree = config::parse_toml_tree(config)?;
    config::apply_sets(
        &mut tree,
        &[
            format!("output_dir={}", toml_str(&opts.out.join("grpo"))),
            format!("model.path={}", toml_str(model_dir)),
            format!("data.path=[{}]", toml_str(data)),
            format!("train.max_steps={}", opts.grpo_steps),
            format!("train.seed={}", opts.seed),
            format!("model.device={}", toml_str(Path::new(&opts.device))),
            // The demo makes its model and data afresh each time: its run starts over too.
            "overwrite_output_dir=true".into(),
        ],
    )?;
    let cfg: TrainConfig = config::from_tree(tree, source)?;
    let setup = grpo_trainer::setup(cfg)?;
    let mut ro = RunOptions::default();
    if opts.progress {
        ro.sinks.push(std::sync::Arc::new(std::sync::Mutex::new(
            crate::progress::Progress::new(),
        )));
    }
    grpo_trainer::run(setup, &ro, &mut grpo_trainer::NoCallbacks)
}

fn toml_str(p: &Path) -> String {
    toml::Value::String(p.display().to_string()).to_string()
}
