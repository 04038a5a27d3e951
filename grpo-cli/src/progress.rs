//! Progress: an indicatif bar (step, reward, kl, step time, ETA) when stderr is a terminal,
//! plain log lines otherwise. It is an event sink: the trainer's events thread drives it, so
//! drawing never holds the learner.

use std::io::IsTerminal;

use grpo_trainer::events::{Event, EventSink};
use indicatif::{ProgressBar, ProgressStyle};

/// Step progress of a run.
#[derive(Debug, Default)]
pub struct Progress {
    bar: Option<ProgressBar>,
    total: usize,
}

impl Progress {
    /// A progress display for `grpo-cli train` (and `sft`, `dpo`, `demo`).
    pub fn new() -> Self {
        Self::default()
    }

    /// The one-line summary of a step's metrics.
    pub fn line(m: &grpo_trainer::Metrics) -> String {
        let get = |k: &str| m.get(k).copied().unwrap_or(f64::NAN);
        format!(
            "reward {:.3}  kl {:.4}  loss {:.4}  {:.2} s/step",
            get("reward"),
            get("kl"),
            get("loss"),
            get("step_time")
        )
    }
}

impl EventSink for Progress {
    fn on_event(&mut self, event: &Event) -> anyhow::Result<()> {
        match event {
            Event::Begin { start, total } => {
                self.total = *total;
                if std::io::stderr().is_terminal() {
                    let bar = ProgressBar::new(*total as u64);
                    bar.set_position(*start as u64);
                    if let Ok(style) = ProgressStyle::with_template(
                        "{bar:30} {pos}/{len} steps  {msg}  [{elapsed_precise} < {eta_precise}]",
                    ) {
                        bar.set_style(style);
                    }
                    self.bar = Some(bar);
                }
            }
            Event::Step { step, metrics, .. } => {
                let msg = Self::line(metrics);
                match &self.bar {
                    Some(b) => {
                        b.set_position(*step as u64);
                        b.set_message(msg);
                    }
                    None => eprintln!("step {step}/{}  {msg}", self.total),
                }
            }
            Event::End => {
                if let Some(b) = self.bar.take() {
                    b.finish();
                }
            }
            _ => {}
        }
        Ok(())
    }
}
