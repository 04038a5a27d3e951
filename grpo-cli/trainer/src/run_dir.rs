//! The run directory: what a run writes there, the refusal to mix two runs in one directory
//! (`--overwrite` / `overwrite_output_dir`, `--resume`), and the truncation of the logs of a run
//! continued from a checkpoint.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};

use crate::checkpoint::{STATE_FILE, list_checkpoints};
use crate::config::TrainConfig;
use crate::learner::Learner;
use crate::pipeline::RunOptions;
use crate::setup::Setup;

/// What a run writes into its directory (`--overwrite` / `overwrite_output_dir` removes these).
pub const RUN_FILES: &[&str] = &[
    "config.json",
    "metrics.jsonl",
    "completions.jsonl",
    "teacher_log.jsonl",
    "checkpoints",
    "rollout_adapters",
    "bema",
    "runs",
    "curves.png",
];

/// The files of an earlier run in `run_dir`: those of [`RUN_FILES`] that hold something (an
/// empty file or folder, or `config.json` alone, is what a run that failed before its first
/// step leaves, and does not count).
pub fn run_files(run_dir: &Path) -> Vec<String> {
    RUN_FILES
        .iter()
        .filter(|&&name| name != "config.json")
        .filter(|&&name| {
            let p = run_dir.join(name);
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => std::fs::read_dir(&p).is_ok_and(|mut d| d.next().is_some()),
                Ok(m) => m.len() > 0,
                Err(_) => false,
            }
        })
        .map(|&name| {
            if run_dir.join(name).is_dir() {
                format!("{name}/")
            } else {
                name.to_string()
            }
        })
        .collect()
}

/// Checks the run directory against how the run starts, before any work, and returns the
/// checkpoint to continue from:
/// - a fresh start refuses a directory holding another run's files ([`run_files`]) unless
///   `overwrite_output_dir`;
/// - `resume = Some(None)` takes the run directory's latest complete checkpoint;
/// - `resume = Some(Some(dir))` takes `dir`; a checkpoint of another directory starts this one
///   afresh, so the same rule as a fresh start applies.
pub fn check_run_dir(
    cfg: &TrainConfig,
    resume: Option<&Option<PathBuf>>,
) -> Result<Option<PathBuf>> {
    let run_dir = &cfg.output_dir;
    let checkpoint = match resume {
        None => None,
        Some(None) => Some(
            list_checkpoints(run_dir)
                .pop()
                .map(|(_, p)| p)
                .with_context(|| {
                    format!(
                        "--resume: no complete checkpoint in {}",
                        run_dir.join("checkpoints").display()
                    )
                })?,
        ),
        Some(Some(dir)) => {
            if !dir.join(STATE_FILE).is_file() {
                bail!(
                    "--resume {}: not a complete checkpoint (no {STATE_FILE})",
                    dir.display()
                );
            }
            Some(dir.clone())
        }
    };
    let continues_this_run = checkpoint
        .as_deref()
        .is_some_and(|c| own_checkpoint(run_dir, c));
    if !continues_this_run && !cfg.overwrite_output_dir {
        let found = run_files(run_dir);
        if !found.is_empty() {
            bail!(
                "{}: holds another run ({}); continue it with --resume or start over with --overwrite (config: overwrite_output_dir = true)",
                run_dir.display(),
                found.join(", ")
            );
        }
    }
    Ok(checkpoint)
}

/// Whether `checkpoint` is one of `run_dir`'s own (`run_dir/checkpoints/step-N`).
fn own_checkpoint(run_dir: &Path, checkpoint: &Path) -> bool {
    let (Ok(root), Ok(c)) = (
        run_dir.join("checkpoints").canonicalize(),
        checkpoint.canonicalize(),
    ) else {
        return false;
    };
    c.parent() == Some(root.as_path())
}

/// Creates the run directory (with the resolved `config.json`), builds the learner and, with
/// `--resume`, restores the checkpoint. Shared by GRPO, SFT and DPO.
///
/// The directory holds one run: a fresh start into a directory with another run's files is
/// refused ([`check_run_dir`]) or, with `overwrite_output_dir`, clears them first. Continuing
/// from a checkpoint of step k drops what the directory holds after step k (lines of
/// `metrics.jsonl`, `completions.jsonl` and `teacher_log.jsonl`, later checkpoints), so the
/// files read like one uninterrupted run and a later `--resume` cannot pick a checkpoint of an
/// abandoned continuation.
pub fn open_run(setup: &Setup, opts: &RunOptions) -> Result<(Learner, PathBuf)> {
    let run_dir = setup.cfg.output_dir.clone();
    let checkpoint = check_run_dir(&setup.cfg, opts.resume.as_ref())?;
    let own = checkpoint
        .as_deref()
        .is_some_and(|c| own_checkpoint(&run_dir, c));
    if !own && setup.cfg.overwrite_output_dir {
        for name in RUN_FILES {
            let p = run_dir.join(name);
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            match removed {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e)
                        .with_context(|| format!("--overwrite: cannot remove {}", p.display()));
                }
                _ => {}
            }
        }
    }
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("{}: cannot create the run directory", run_dir.display()))?;
    std::fs::write(
        run_dir.join("config.json"),
        serde_json::to_vec_pretty(&setup.cfg.redacted_json())?,
    )
    .with_context(|| format!("{}: cannot write config.json", run_dir.display()))?;

    let mut learner = Learner::new(setup, &run_dir)?;
    if let Some(dir) = checkpoint {
        learner.load_checkpoint(&dir)?;
        let step = learner.state.step;
        for log in ["metrics.jsonl", "completions.jsonl", "teacher_log.jsonl"] {
            truncate_log(&run_dir.join(log), step)?;
        }
        for (n, later) in list_checkpoints(&run_dir) {
            if n > step {
                std::fs::remove_dir_all(&later)
                    .with_context(|| format!("{}: cannot remove", later.display()))?;
            }
        }
    }
    Ok((learner, run_dir))
}

/// Trains per `setup`, writing the run directory; returns the logged metrics.
/// Keeps the lines of a JSON-lines log whose `step` is at most `keep_until_step`.
fn truncate_log(path: &Path, keep_until_step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_f64()))
                .is_some_and(|s| s as usize <= keep_until_step)
        })
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("{}: cannot rewrite", path.display()))?;
    Ok(())
}
