//! Progress: an indicatif bar (step, reward, kl, step time, ETA) when stderr is a terminal,
//! plain log lines otherwise.

use std::io::IsTerminal;

use indicatif::{ProgressBar, ProgressStyle};

use crate::trainer::Metrics;

/// Step progress of a run.
#[derive(Debug)]
pub struct Progress {
    bar: Option<ProgressBar>,
    lines: bool,
    total: usize,
}

impl Progress {
    /// `enabled = false` prints nothing (library use, tests).
    pub fn new(enabled: bool, start: usize, total: usize) -> Self {
        if !enabled {
            return Self {
                bar: None,
                lines: false,
                total,
            };
        }
        if std::io::stderr().is_terminal() {
            let bar = ProgressBar::new(total as u64);
            bar.set_position(start as u64);
            if let Ok(style) = ProgressStyle::with_template(
                "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
            ) {
                bar.set_style(style);
            }
            Self {
                bar: Some(bar),
                lines: false,
                total,
            }
        } else {
            Self {
                bar: None,
                lines: true,
                total,
            }
        }
    }

    /// Reports a finished step.
    pub fn step(&mut self, step: usize, m: &Metrics) {
        let get = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        let msg = format!(
            "reward {:.3}  kl {:.4}  loss {:.4}  {:.2} s/step",
            get("reward"),
            get("kl"),
            get("loss"),
            get("step_time")
        );
        if let Some(b) = &self.bar {
            b.set_position(step as u64);
            b.set_message(msg);
        } else if self.lines {
            eprintln!("step {step}/{}  {msg}", self.total);
        }
    }

    /// Clears the bar.
    pub fn finish(&mut self) {
        if let Some(b) = self.bar.take() {
            b.finish();
        }
    }
}
