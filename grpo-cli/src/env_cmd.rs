//! `grpo-cli env`: a scripted episode against a config's `[environment]`, without a model —
//! the prompt after `reset`, the tools, each turn's observation and reward, the episode's
//! rewards after `post_process` (grpo-trainer's `playthrough`).

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use grpo_trainer::playthrough::{Playthrough, play};

/// `grpo-cli env`.
#[derive(Debug, Args)]
pub struct EnvArgs {
    /// The training config (TOML or YAML) whose `[environment]` and data to use.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a key: `--set environment.max_turns=2` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The training row to start from (0-based, in file order).
    #[arg(long, default_value_t = 0)]
    pub row: usize,
    /// An assistant turn, as the model would write it (repeatable, in order).
    #[arg(long = "turn", value_name = "TEXT")]
    pub turns: Vec<String>,
    /// A file of assistant turns, one JSON string per line (after any --turn).
    #[arg(long, value_name = "FILE.jsonl")]
    pub turns_file: Option<PathBuf>,
    /// Print one JSON object instead of text.
    #[arg(long)]
    pub json: bool,
}

/// Runs `grpo-cli env`.
pub fn env(a: EnvArgs) -> Result<()> {
    let cfg = grpo_trainer::config::load(&a.config, &a.set)?;
    let mut turns = a.turns.clone();
    if let Some(path) = &a.turns_file {
        let text = std::fs::read_to_string(path)
            .with_context(|| format!("--turns-file {}", path.display()))?;
        for (i, line) in text.lines().enumerate() {
            if line.trim().is_empty() {
                continue;
            }
            let turn: String = serde_json::from_str(line).with_context(|| {
                format!(
                    "--turns-file {}: line {}: expected a JSON string",
                    path.display(),
                    i + 1
                )
            })?;
            turns.push(turn);
        }
    }
    let p = play(&cfg, a.row, &turns)?;
    match a.json {
        true => println!("{}", serde_json::to_string(&p)?),
        false => print_text(&p),
    }
    Ok(())
}

fn print_text(p: &Playthrough) {
    println!("environment: {}", p.environment);
    println!("row: {}", p.row);
    println!("tools: {}", p.tools.join(", "));
    println!("--- prompt after reset");
    match &p.rendered {
        Some(text) => println!("{text}"),
        None => {
            for m in &p.messages {
                println!("[{}] {}", m.role, m.content);
            }
        }
    }
    for (k, t) in p.turns.iter().enumerate() {
        println!("--- turn {}", k + 1);
        println!("[assistant] {}", t.assistant);
        match &t.observation {
            Some(o) if !t.terminated => println!("[{}] {}", o.role, o.content),
            Some(o) => println!("(ended; not shown) [{}] {}", o.role, o.content),
            None => println!("(no observation)"),
        }
        println!(
            "reward {}  terminated {}  metadata {}",
            t.reward, t.terminated, t.metadata
        );
    }
    if p.unused_turns > 0 {
        println!(
            "--- {} turn(s) not sent: the episode had ended",
            p.unused_turns
        );
    }
    println!("--- after post_process");
    println!("turn rewards {:?}  env reward {}", p.rewards, p.reward);
    for (k, v) in &p.metrics {
        println!("{k} {v}");
    }
}
