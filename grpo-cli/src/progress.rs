//! Progress: an indicatif bar (step, the algorithm's metrics, loss, step time, ETA) when stderr is a terminal,
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

    /// The one-line summary of a step's metrics: those of the run's algorithm that it logs
    /// (GRPO's reward and KL, a reward model's accuracy, DPO's and KTO's margin, ...), then the
    /// loss and the step time.
    pub fn line(m: &grpo_trainer::Metrics) -> String {
        let mut parts: Vec<String> = [
            ("reward", "reward", 3),
            ("kl", "kl", 4),
            ("accuracy", "accuracy", 3),
            ("rewards/margins", "margin", 3),
            ("loss", "loss", 4),
        ]
        .iter()
        .filter_map(|&(k, label, digits)| {
            let v = m.get(k).copied().filter(|v| v.is_finite())?;
            Some(format!("{label} {v:.digits$}"))
        })
        .collect();
        if let Some(t) = m.get("step_time") {
            parts.push(format!("{t:.2} s/step"));
        }
        parts.join("  ")
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

#[cfg(test)]
mod tests {
    use super::Progress;

    #[test]
    fn the_line_shows_what_the_algorithm_logs() {
        let m = |kv: &[(&str, f64)]| kv.iter().map(|(k, v)| (k.to_string(), *v)).collect();
        assert_eq!(
            Progress::line(&m(&[
                ("reward", 0.5),
                ("kl", 0.01),
                ("loss", 0.2),
                ("step_time", 1.5)
            ])),
            "reward 0.500  kl 0.0100  loss 0.2000  1.50 s/step"
        );
        // A distillation run without rewards: no NaN reward, no KL.
        assert_eq!(
            Progress::line(&m(&[
                ("reward", f64::NAN),
                ("loss", 0.01),
                ("step_time", 0.08)
            ])),
            "loss 0.0100  0.08 s/step"
        );
        assert_eq!(
            Progress::line(&m(&[("accuracy", 1.0), ("loss", 0.1), ("step_time", 0.1)])),
            "accuracy 1.000  loss 0.1000  0.10 s/step"
        );
    }
}
