//! `train.report_to = ["tensorboard"]`: every logged step's metrics and every evaluation as
//! TensorBoard scalars under `train.logging_dir` (default `OUTPUT_DIR/runs`), tagged as the
//! Hugging Face Trainer tags them: `train/<metric>` and `eval/<metric>`.

use std::path::{Path, PathBuf};

use anyhow::{Context, Result};

use super::tfevents::{EventWriter, unix_time_now};
use super::{Event, EventSink};
use crate::config::TrainConfig;

/// Writes TensorBoard event files.
#[derive(Debug)]
pub struct TensorBoardSink {
    writer: EventWriter,
}

impl TensorBoardSink {
    /// The log directory of a run: `train.logging_dir`, or `OUTPUT_DIR/runs`.
    pub fn dir(cfg: &TrainConfig) -> PathBuf {
        match cfg.train.logging_dir.as_str() {
            "" => cfg.output_dir.join("runs"),
            d => PathBuf::from(d),
        }
    }

    /// A new event file in `dir`.
    pub fn create(dir: &Path) -> Result<Self> {
        let writer = EventWriter::create(dir).with_context(|| {
            format!("{}: cannot create a TensorBoard event file", dir.display())
        })?;
        Ok(Self { writer })
    }

    /// The event file.
    pub fn path(&self) -> &Path {
        self.writer.path()
    }
}

/// The tag of a metric: `eval/...` as it is, everything else under `train/`.
pub fn tag(metric: &str) -> String {
    if metric.starts_with("eval/") {
        metric.to_string()
    } else {
        format!("train/{metric}")
    }
}

impl EventSink for TensorBoardSink {
    fn on_event(&mut self, event: &Event) -> Result<()> {
        let (step, metrics) = match event {
            Event::Step {
                step,
                metrics,
                logged: true,
            }
            | Event::Eval { step, metrics } => (step, metrics),
            Event::End => {
                return self
                    .writer
                    .flush()
                    .with_context(|| format!("{}: write failed", self.path().display()));
            }
            _ => return Ok(()),
        };
        let now = unix_time_now();
        let tags: Vec<(String, f64)> = metrics
            .iter()
            .filter(|(k, _)| k.as_str() != "step")
            .map(|(k, v)| (tag(k), *v))
            .collect();
        self.writer
            .add_scalars(
                *step as i64,
                now,
                tags.iter().map(|(k, v)| (k.as_str(), *v)),
            )
            .and_then(|()| self.writer.flush())
            .with_context(|| format!("{}: write failed", self.path().display()))
    }
}
