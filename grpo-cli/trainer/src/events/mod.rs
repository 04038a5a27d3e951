//! Side work off the learner's thread. The learner sends [`Event`]s on a bounded channel to
//! one thread that hands each to every [`EventSink`] in turn: `metrics.jsonl`,
//! `completions.jsonl`, checkpoint writes ([`crate::checkpoint::CheckpointWriter`]),
//! TensorBoard files (`train.report_to = ["tensorboard"]`), and whatever the caller adds
//! (the command line's progress bar). A full channel makes the learner wait (back-pressure,
//! so memory stays bounded); a sink's error stops the run at the learner's next send.

pub mod tensorboard;
pub mod tfevents;

use std::fs::File;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;

use anyhow::{Context, Result, anyhow};
use crossbeam_channel::{Sender, bounded};

use crate::callbacks::Metrics;
use crate::checkpoint::CheckpointJob;

/// What the learner reports.
#[derive(Debug)]
pub enum Event {
    /// Before the first step of this invocation.
    Begin {
        /// Steps done already (a resumed run's checkpoint).
        start: usize,
        /// Steps of the whole run.
        total: usize,
    },
    /// A finished step's metrics; `logged` when `train.logging_steps` says to write them.
    Step {
        /// Steps done.
        step: usize,
        /// The step's metrics.
        metrics: Metrics,
        /// Whether the step is one of the logged ones.
        logged: bool,
    },
    /// The lines of `completions.jsonl` for a logged step.
    Completions(Vec<serde_json::Value>),
    /// Evaluation metrics (`eval/...`).
    Eval {
        /// Steps done.
        step: usize,
        /// The metrics.
        metrics: Metrics,
    },
    /// A checkpoint to write.
    Checkpoint(Box<CheckpointJob>),
    /// The run ended (normally or not).
    End,
}

/// A consumer of [`Event`]s, run on the events thread.
pub trait EventSink: Send {
    /// Handles one event; an error stops the run.
    fn on_event(&mut self, event: &Event) -> Result<()>;
}

/// A sink shared with the caller (so it can be kept in [`crate::RunOptions`] and cloned).
pub type SharedSink = Arc<Mutex<dyn EventSink>>;

/// The events thread and the channel to it.
#[derive(Debug)]
pub struct EventBus {
    tx: Option<Sender<Event>>,
    handle: Option<JoinHandle<()>>,
    failed: Arc<Mutex<Option<anyhow::Error>>>,
}

impl EventBus {
    /// Starts the thread over `sinks`, with room for `capacity` events in flight. A sink that
    /// fails is dropped and its error kept; the other sinks (the checkpoint writer among them)
    /// go on receiving events, so a failing log never costs a checkpoint.
    pub fn start(mut sinks: Vec<Box<dyn EventSink>>, capacity: usize) -> Result<Self> {
        let (tx, rx) = bounded::<Event>(capacity.max(1));
        let failed = Arc::new(Mutex::new(None));
        let first_error = failed.clone();
        let handle = std::thread::Builder::new()
            .name("grpo-events".into())
            .spawn(move || {
                for event in rx.iter() {
                    sinks.retain_mut(|sink| match sink.on_event(&event) {
                        Ok(()) => true,
                        Err(e) => {
                            let mut f = first_error.lock().unwrap_or_else(|p| p.into_inner());
                            f.get_or_insert(e);
                            false
                        }
                    });
                }
            })
            .context("cannot start the events thread")?;
        Ok(Self {
            tx: Some(tx),
            handle: Some(handle),
            failed,
        })
    }

    fn take_error(&self) -> Option<anyhow::Error> {
        self.failed.lock().unwrap_or_else(|p| p.into_inner()).take()
    }

    /// Queues an event (waits while the channel is full). When a sink has failed, the event
    /// still goes to the others and the failed sink's error is returned.
    pub fn send(&mut self, event: Event) -> Result<()> {
        let sent = self.tx.as_ref().is_some_and(|tx| tx.send(event).is_ok());
        if let Some(e) = self.take_error() {
            return Err(e);
        }
        if sent {
            return Ok(());
        }
        self.join()?;
        Err(anyhow!("the events thread has stopped"))
    }

    /// Sends [`Event::End`], waits until every queued event is handled and returns the first
    /// sink error.
    pub fn finish(mut self) -> Result<()> {
        if let Some(tx) = &self.tx {
            let _ = tx.send(Event::End);
        }
        self.join()?;
        match self.take_error() {
            Some(e) => Err(e),
            None => Ok(()),
        }
    }

    fn join(&mut self) -> Result<()> {
        self.tx = None;
        match self.handle.take() {
            Some(h) => h.join().map_err(|_| anyhow!("the events thread panicked")),
            None => Ok(()),
        }
    }
}

impl Drop for EventBus {
    fn drop(&mut self) {
        let _ = self.join();
    }
}

/// A shared sink as a sink.
#[derive(Clone)]
pub(crate) struct Shared(pub SharedSink);

impl EventSink for Shared {
    fn on_event(&mut self, event: &Event) -> Result<()> {
        self.0
            .lock()
            .map_err(|_| anyhow!("an event sink panicked"))?
            .on_event(event)
    }
}

/// A JSON-lines file opened for appending.
#[derive(Debug)]
struct JsonLines {
    path: PathBuf,
    file: File,
}

impl JsonLines {
    fn open(path: &Path) -> Result<Self> {
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        Ok(Self {
            path: path.to_path_buf(),
            file,
        })
    }

    fn write(&mut self, v: &serde_json::Value) -> Result<()> {
        writeln!(self.file, "{v}").with_context(|| format!("{}: write failed", self.path.display()))
    }
}

/// `metrics.jsonl`: one line per logged step and per evaluation (non-finite values as null).
#[derive(Debug)]
pub struct MetricsLog(JsonLines);

impl MetricsLog {
    /// Appends to `run_dir/metrics.jsonl`.
    pub fn open(run_dir: &Path) -> Result<Self> {
        Ok(Self(JsonLines::open(&run_dir.join("metrics.jsonl"))?))
    }
}

impl EventSink for MetricsLog {
    fn on_event(&mut self, event: &Event) -> Result<()> {
        match event {
            Event::Step {
                metrics,
                logged: true,
                ..
            }
            | Event::Eval { metrics, .. } => self.0.write(&finite_json(metrics)),
            _ => Ok(()),
        }
    }
}

/// `completions.jsonl`: the first `train.num_completions_to_print` completions of each logged
/// step with their rewards (`train.log_completions`).
#[derive(Debug)]
pub struct CompletionsLog(JsonLines);

impl CompletionsLog {
    /// Appends to `run_dir/completions.jsonl`.
    pub fn open(run_dir: &Path) -> Result<Self> {
        Ok(Self(JsonLines::open(&run_dir.join("completions.jsonl"))?))
    }
}

impl EventSink for CompletionsLog {
    fn on_event(&mut self, event: &Event) -> Result<()> {
        if let Event::Completions(lines) = event {
            for l in lines {
                self.0.write(l)?;
            }
        }
        Ok(())
    }
}

/// A number for JSON: non-finite values become null.
pub fn finite(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::Value::Null
    }
}

/// Metrics as a JSON object (non-finite values as null).
pub fn finite_json(m: &Metrics) -> serde_json::Value {
    serde_json::Value::Object(m.iter().map(|(k, v)| (k.clone(), finite(*v))).collect())
}

/// The `completions.jsonl` lines of a scored GRPO step: prompt, completion, each reward
/// function's score and info, the combined reward and the advantage.
pub fn completion_lines(s: &crate::stages::Scored, max: usize) -> Vec<serde_json::Value> {
    let r = &s.rollouts;
    r.completions
        .iter()
        .enumerate()
        .take(max)
        .map(|(i, c)| {
            let rewards: serde_json::Map<String, serde_json::Value> = s
                .scores
                .names
                .iter()
                .enumerate()
                .map(|(k, name)| {
                    let v = s.scores.per_function[k][i];
                    (
                        name.clone(),
                        v.map_or(serde_json::Value::Null, |x| serde_json::json!(x)),
                    )
                })
                .collect();
            let info: serde_json::Map<String, serde_json::Value> = s
                .scores
                .names
                .iter()
                .zip(&s.scores.info)
                .filter_map(|(n, inf)| inf.get(i).cloned().flatten().map(|v| (n.clone(), v)))
                .collect();
            let mut line = serde_json::json!({
                "step": r.batch.step + 1,
                "prompt": r.prompt_text(i),
                "completion": c.text,
                "rewards": rewards,
                "info": info,
                "reward": finite(s.scores.rewards[i] as f64),
                "advantage": s.advantages[i],
                "finish_reason": c.finish_reason,
            });
            // The row's other columns (`solution`, `answer`, ...), so the line can be scored
            // again as it stands (`grpo-cli score --data completions.jsonl`).
            if let (Some(obj), Some(sample)) =
                (line.as_object_mut(), r.batch.samples.get(c.prompt_index))
            {
                for (k, v) in &sample.columns {
                    if !obj.contains_key(k.as_ref()) {
                        obj.insert(
                            k.to_string(),
                            serde_json::to_value(v).unwrap_or(serde_json::Value::Null),
                        );
                    }
                }
            }
            line
        })
        .collect()
}
