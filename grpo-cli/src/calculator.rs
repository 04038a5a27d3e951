//! `grpo-cli demo --task calculator`: a tiny model, episodes against a calculator tool for
//! arithmetic it cannot do alone, offline, in a few minutes on 2 cores.
//!
//! A 2M-parameter model warmed up from scratch learns to write calls and copy numbers, but
//! not to multiply: calling the calculator is the only way to score, and GRPO learns to call
//! it instead of guessing (the reward rises; figures in the README). The steps:
//!
//! 1. A random-weight model (`init-model --preset small`, digits as single tokens) and
//!    two-digit multiplication problems (`a = 37, b = 48. What is a * b?`, answer `1776`).
//! 2. A short supervised warm-up on transcripts of two kinds, half each: the model calls the
//!    calculator (`<tool_call>{"name": "calculator", "arguments": {"a": 37, "op": "*", "b":
//!    48}}</tool_call>`), reads the tool's answer and repeats it; or it answers at once with a
//!    guess (`About 1800.`, never right). The choice between calling and guessing is left a
//!    coin flip.
//! 3. GRPO with `configs/calculator.toml`: episodes against the built-in tool environment
//!    (`[environment] type = "tools"`, the calculator a command tool running `expr`), the
//!    `accuracy` reward on the last assistant message. Calling the tool and repeating its
//!    answer is the only way to score.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};
use grpo_data::rng::SeededRng;
use grpo_rollout::init::{Preset, init_model_dir_with};
use grpo_rollout::{Arch, ChatMessage};
use grpo_trainer::TrainingResult;

use crate::demo::{DemoOptions, grpo_stage, warm_up_pairs};

/// The config `grpo-cli demo --task calculator` trains with.
pub const CALCULATOR: &str = include_str!("../../configs/calculator.toml");

/// Steps averaged for the first / last figures the demo prints: GRPO learns to call the tool
/// within its first ten steps.
pub const REPORT_STEPS: usize = 10;

/// Distinct problems GRPO trains on.
pub const PROBLEMS: u64 = 256;

/// What the calculator demo reports.
#[derive(Debug)]
pub struct CalculatorReport {
    /// The GRPO run.
    pub result: TrainingResult,
    /// Mean reward of the first and last [`REPORT_STEPS`] steps.
    pub reward: (f64, f64),
    /// Mean tool calls per episode, first and last steps.
    pub tool_calls: (f64, f64),
    /// Warm-up loss at the start and the end.
    pub sft_loss: (f64, f64),
}

/// Problem `i` of a seeded stream: two two-digit numbers.
fn problem(rng: &mut SeededRng) -> (u64, u64) {
    (10 + rng.below(90), 10 + rng.below(90))
}

/// The question names its operands as the call's arguments do: copying a number into the call
/// is then finding the digits after the same name. With `What is 37 * 48?` the model (warmed up
/// from scratch) learned to copy `b`, which follows the `*` in both, but not `a` after 1,500
/// warm-up steps; with the names it copies both after 600.
fn question(a: u64, b: u64) -> String {
    format!("a = {a}, b = {b}. What is a * b?")
}

/// The model's call, as the warm-up writes it.
pub fn tool_call(a: u64, b: u64) -> String {
    format!(
        "<tool_call>{{\"name\": \"calculator\", \"arguments\": {{\"a\": {a}, \"op\": \"*\", \"b\": {b}}}}}</tool_call>"
    )
}

/// Writes the GRPO problems as JSONL (`prompt` as a conversation, `answer`).
fn write_problems(path: &Path, seed: u64) -> Result<()> {
    let mut rng = SeededRng::new(seed);
    let mut out = String::new();
    for _ in 0..PROBLEMS {
        let (a, b) = problem(&mut rng);
        let row = serde_json::json!({
            "prompt": [{"role": "user", "content": question(a, b)}],
            "answer": (a * b).to_string(),
        });
        out.push_str(&row.to_string());
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("{}: cannot write", path.display()))
}

/// Warm-up pairs (prompt text, completion text without EOS) over `n` problems of another
/// seeded stream, rendered by the model's chat template as the episodes render them. Half
/// call the calculator: the call (twice), then the answer after the tool's result (four times:
/// its few tokens would otherwise be a sliver of the loss next to the call's); half guess the product
/// rounded to hundreds, never the right one (so guessing never pays), as `About 1800.` (a
/// form of its own: a bare number after the tool's answer is always a copy of it).
fn warm_up_examples(
    tok: &grpo_rollout::Tokenizer,
    n: usize,
    seed: u64,
) -> Result<Vec<(String, String)>> {
    let mut rng = SeededRng::new(seed ^ 0x5eed);
    let mut out = Vec::with_capacity(5 * n);
    for _ in 0..n {
        let (a, b) = problem(&mut rng);
        let user = vec![ChatMessage::new("user", question(a, b))];
        let prompt = tok.apply_chat_template(&user, true)?;
        if rng.below(2) == 0 {
            let call = tool_call(a, b);
            for _ in 0..2 {
                out.push((prompt.clone(), call.clone()));
            }
            let mut conv = user;
            conv.push(ChatMessage::new("assistant", call));
            conv.push(ChatMessage::tool("calculator", (a * b).to_string()));
            let after = tok.apply_chat_template(&conv, true)?;
            for _ in 0..4 {
                out.push((after.clone(), (a * b).to_string()));
            }
        } else {
            out.push((prompt, format!("About {}.", guess(a * b))));
        }
    }
    Ok(out)
}

/// A guess at `product`: rounded to hundreds, and never right.
pub fn guess(product: u64) -> u64 {
    let g = (product + 50) / 100 * 100;
    if g == product { g + 100 } else { g }
}

/// Makes the model and data, warms up, trains with GRPO against the calculator.
pub fn run(opts: &DemoOptions) -> Result<CalculatorReport> {
    let out = &opts.out;
    std::fs::create_dir_all(out).with_context(|| format!("{}: cannot create", out.display()))?;
    let model_dir = out.join("model");
    // Digits as single tokens: the reply copies the tool's answer digit by digit.
    init_model_dir_with(&model_dir, Preset::Small, Arch::Llama, opts.seed, true)?;
    let data = out.join("multiplication.jsonl");
    write_problems(&data, opts.seed)?;
    let device = opts
        .device
        .parse::<grpo_rollout::DeviceSpec>()
        .and_then(|d| d.device())
        .map_err(|e| anyhow::anyhow!("--device {}: {e}", opts.device))?;
    let tok = grpo_rollout::load(
        &model_dir,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )?
    .tokenizer;
    let examples = warm_up_examples(&tok, 2000, opts.seed)?;
    let sft_loss = warm_up_pairs(
        &model_dir,
        &examples,
        opts.sft_steps,
        2e-3,
        opts.seed,
        &device,
    )?;

    let result = grpo_stage(
        CALCULATOR,
        "configs/calculator.toml",
        opts,
        &model_dir,
        &data,
    )?;
    let series = |k: &str| -> (f64, f64) {
        let v: Vec<f64> = result
            .metrics
            .iter()
            .filter_map(|m| m.get(k).copied())
            .collect();
        let n = REPORT_STEPS.min(v.len()).max(1);
        let mean = |s: &[f64]| s.iter().sum::<f64>() / s.len().max(1) as f64;
        (
            mean(&v[..n.min(v.len())]),
            mean(&v[v.len().saturating_sub(n)..]),
        )
    };
    Ok(CalculatorReport {
        reward: series("reward"),
        tool_calls: series("env/tool_calls_mean"),
        result,
        sft_loss,
    })
}

/// The default run directory of the calculator demo.
pub fn default_out() -> PathBuf {
    PathBuf::from("runs/calculator")
}
