//! `grpo-cli train`: run GRPO from a config file.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};

use anyhow::{Context, Result};
use clap::Args;
use grpo_cli::trainer::{self, RunOptions};
use std::sync::Mutex;

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
    /// Start over in a run directory that holds another run, removing its files first (the
    /// config's `overwrite_output_dir = true`). Continuing the directory's own run with
    /// `--resume` keeps them.
    #[arg(long)]
    pub overwrite: bool,
}

/// SIGINT (Ctrl-C) and SIGTERM (what `kill`, `timeout`, `docker stop` and batch schedulers
/// send) set the stop flag: the learner finishes its step, writes a checkpoint and the process
/// exits with 128 + the signal's number (130 for SIGINT, 143 for SIGTERM), as a process killed by
/// it would. A second signal exits at once with that code. Returns the flag and the signal
/// received (0 while none).
pub fn install_stop_signals() -> Result<(Arc<AtomicBool>, Arc<AtomicI32>)> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    let stop = Arc::new(AtomicBool::new(false));
    let received = Arc::new(AtomicI32::new(0));
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .context("cannot install the SIGINT / SIGTERM handlers")?;
    let (s, r) = (stop.clone(), received.clone());
    std::thread::spawn(move || {
        for sig in signals.forever() {
            if s.swap(true, Ordering::SeqCst) {
                std::process::exit(128 + sig);
            }
            r.store(sig, Ordering::SeqCst);
            let name = if sig == SIGINT { "Ctrl-C" } else { "SIGTERM" };
            // Never panic here (stderr may be closed): the message is a courtesy.
            let _ = writeln!(
                std::io::stderr(),
                "\n{name}: stopping after this step (checkpoint follows); send it again to quit now"
            );
        }
    });
    Ok((stop, received))
}

/// Runs the training; returns the exit code (0, or 128 + the signal that stopped it).
pub fn train(a: TrainArgs) -> Result<u8> {
    train_as(a, None)
}

/// [`train`] with `algorithm` forced (`grpo-cli sft` / `grpo-cli dpo`).
pub fn train_as(mut a: TrainArgs, algorithm: Option<&str>) -> Result<u8> {
    if let Some(alg) = algorithm {
        a.set.insert(0, format!("algorithm=\"{alg}\""));
    }
    if a.overwrite {
        a.set.push("overwrite_output_dir=true".into());
    }
    let cfg = trainer::config::load(&a.config, &a.set)?;
    // Before the model loads: a used run directory is refused at once.
    trainer::run_dir::check_run_dir(&cfg, a.resume.as_ref())?;
    let setup = trainer::setup(cfg)?;
    let (stop, signal) = install_stop_signals()?;
    let opts = RunOptions {
        resume: a.resume,
        stop,
        sinks: vec![Arc::new(Mutex::new(grpo_cli::progress::Progress::new()))],
        ..Default::default()
    };
    let out = setup.cfg.output_dir.clone();
    let r = trainer::run(setup, &opts, &mut trainer::NoCallbacks)?;
    let key = if r
        .metrics
        .iter()
        .any(|m| m.get("reward").is_some_and(|v| v.is_finite()))
    {
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
    Ok(match signal.load(Ordering::SeqCst) {
        _ if !r.interrupted => 0,
        0 => 130,
        sig => u8::try_from(128 + sig).unwrap_or(130),
    })
}
