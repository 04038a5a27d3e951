//! The `grpo-cli` binary: train language models with GRPO on candle.
//!
//! Subcommands arrive with the crates they drive (see README.md): `generate`, `logprobs` and
//! `init-model` drive the policy model (grpo-rollout); `advantages` computes GRPO advantages
//! from rewards given on the command line (grpo-core).

use std::process::ExitCode;

use anyhow::{Context, Result, bail};
use clap::{Parser, Subcommand};
use grpo_core::advantages::{ScaleRewards, group_advantages, leave_one_out_advantages};

mod model_cmd;

/// Train language models with GRPO (plus SFT and DPO) on candle: one fast binary.
#[derive(Debug, Parser)]
#[command(name = "grpo-cli", version, about, long_about = None)]
struct Cli {
    #[command(subcommand)]
    command: Option<Command>,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Sample completions from a model (HF directory or .gguf file).
    Generate(model_cmd::GenerateArgs),
    /// Log-probs of a completion's tokens given a prompt.
    Logprobs(model_cmd::LogprobsArgs),
    /// Write a random-weight model directory (byte-level BPE tokenizer, ChatML template).
    InitModel(model_cmd::InitModelArgs),
    /// Print GRPO advantages for a batch of rewards (grouped contiguously).
    Advantages {
        /// Comma-separated rewards; `nan` marks an unscorable completion.
        #[arg(long, value_delimiter = ',', allow_hyphen_values = true)]
        rewards: Vec<String>,
        /// Completions per prompt (TRL's num_generations).
        #[arg(long)]
        num_generations: usize,
        /// group | batch | none (TRL's scale_rewards), or `rloo` for leave-one-out.
        #[arg(long, default_value = "group")]
        scale_rewards: String,
    },
}

fn run(cli: Cli) -> Result<()> {
    match cli.command {
        None => {
            use clap::CommandFactory;
            Cli::command().print_help()?;
            println!();
            Ok(())
        }
        Some(Command::Generate(a)) => model_cmd::generate(a),
        Some(Command::Logprobs(a)) => model_cmd::logprobs(a),
        Some(Command::InitModel(a)) => model_cmd::init_model(a),
        Some(Command::Advantages {
            rewards,
            num_generations,
            scale_rewards,
        }) => {
            let rewards = rewards
                .iter()
                .enumerate()
                .map(|(i, r)| {
                    r.trim()
                        .parse::<f32>()
                        .with_context(|| format!("--rewards: value {i} `{r}` is not a number"))
                })
                .collect::<Result<Vec<f32>>>()?;
            if num_generations == 0 || rewards.len() % num_generations != 0 {
                bail!(
                    "--num-generations {num_generations} must be >= 1 and divide the number of rewards ({})",
                    rewards.len()
                );
            }
            let adv = if scale_rewards == "rloo" {
                leave_one_out_advantages(&rewards, num_generations)
            } else {
                let scale: ScaleRewards = scale_rewards
                    .parse()
                    .map_err(|e: String| anyhow::anyhow!("--scale-rewards: {e}"))?;
                group_advantages(&rewards, num_generations, scale)
            };
            let text: Vec<String> = adv.iter().map(|a| format!("{a}")).collect();
            println!("{}", text.join(","));
            Ok(())
        }
    }
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    match run(cli) {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e:#}");
            ExitCode::from(2)
        }
    }
}
