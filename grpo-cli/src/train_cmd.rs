//! `grpo-cli train`: run GRPO from a config file.

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use anyhow::Result;
use clap::Args;
use grpo_cli::trainer::{self, RunOptions};

/// `grpo-cli train`.
#[derive(Debug, Args)]
pub struct TrainArgs {
    /// The config (TOML, or YAML with a .yaml/.yml extension).
    #[arg(long)]
    pub config: PathBuf,
    /// Override a key: `--set optim.learning_rate=1e-5` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// Continue from the latest complete checkpoint of the run directory, or from DIR.
    #[arg(long, value_name = "DIR", num_args = 0..=1)]
    pub resume: Option<Option<PathBuf>>,
}

/// Ctrl-C sets the stop flag (the learner finishes its step, writes a checkpoint and the
/// process exits with 130); a second Ctrl-C exits at once.
pub fn install_ctrl_c() -> Arc<AtomicBool> {
    let stop = Arc::new(AtomicBool::new(false));
    let s = stop.clone();
    let _ = ctrlc::set_handler(move || {
        if s.swap(true, Ordering::SeqCst) {
            std::process::exit(130);
        }
        eprintln!("\nstopping after this step (checkpoint follows); Ctrl-C again to quit now");
    });
    stop
}

/// Runs the training; returns whether it was interrupted.
pub fn train(a: TrainArgs) -> Result<bool> {
    train_as(a, None)
}

/// [`train`] with `algorithm` forced (`grpo-cli sft` / `grpo-cli dpo`).
pub fn train_as(mut a: TrainArgs, algorithm: Option<&str>) -> Result<bool> {
    if let Some(alg) = algorithm {
        a.set.insert(0, format!("algorithm=\"{alg}\""));
    }
    let cfg = grpo_cli::config::load(&a.config, &a.set)?;
    let setup = trainer::setup(cfg)?;
    let opts = RunOptions {
        resume: a.resume,
        stop: install_ctrl_c(),
        progress: true,
        ..Default::default()
    };
    let out = setup.cfg.output_dir.clone();
    let r = trainer::run(setup, &opts, &mut grpo_cli::NoCallbacks)?;
    let key = if r.metrics.iter().any(|m| m.contains_key("reward")) {
        "reward"
    } else {
        "loss"
    };
    let first = r.metrics.first().and_then(|m| m.get(key).copied());
    let last = r.metrics.last().and_then(|m| m.get(key).copied());
    println!(
        "trained {} steps; {key} {} → {}; run directory {}",
        r.total_steps,
        first.map_or("n/a".into(), |v| format!("{v:.3}")),
        last.map_or("n/a".into(), |v| format!("{v:.3}")),
        out.display()
    );
    if let Some(c) = &r.best_checkpoint_path {
        println!("last checkpoint: {}", c.display());
    }
    Ok(r.interrupted)
}
