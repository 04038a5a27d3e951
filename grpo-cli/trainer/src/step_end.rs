//! What happens after every learner step, for GRPO, SFT and DPO alike: timing and memory
//! metrics, the events (metrics, completions, checkpoints, progress) to the events thread,
//! callbacks, evaluation, and the stop decision. Also how a failed run ends: its events
//! flushed and, where a step completed since the last checkpoint, a checkpoint written.

use std::path::Path;
use std::sync::atomic::Ordering;

use anyhow::{Result, anyhow};

use crate::callbacks::{Callbacks, Metrics};
use crate::checkpoint::CheckpointWriter;
use crate::config::{ReportTo, TrainConfig};
use crate::events::tensorboard::TensorBoardSink;
use crate::events::{CompletionsLog, Event, EventBus, EventSink, MetricsLog, Shared};
use crate::failure::{is_out_of_memory, out_of_memory_message};
use crate::learner::Learner;
use crate::learner::metrics::peak_rss_mib;
use crate::pipeline::{RunOptions, TrainingResult};
use crate::stages::{Stage, epochs_of};

/// The run's bookkeeping between steps.
pub(crate) struct StepEnd<'a> {
    cfg: &'a TrainConfig,
    opts: &'a RunOptions,
    callbacks: &'a mut dyn Callbacks,
    bus: Option<EventBus>,
    start: usize,
    total: usize,
    result: TrainingResult,
    /// A sink failed: the learner itself is sound (between two steps).
    sink_failed: bool,
}

impl<'a> StepEnd<'a> {
    /// Starts the events thread with the run's sinks and calls `on_train_begin`.
    pub(crate) fn begin(
        cfg: &'a TrainConfig,
        opts: &'a RunOptions,
        callbacks: &'a mut dyn Callbacks,
        learner: &Learner,
        run_dir: &Path,
    ) -> Result<Self> {
        let mut sinks: Vec<Box<dyn EventSink>> = vec![
            Box::new(MetricsLog::open(run_dir)?),
            Box::new(CheckpointWriter),
        ];
        if cfg.train.log_completions {
            sinks.push(Box::new(CompletionsLog::open(run_dir)?));
        }
        if cfg.train.report_to.contains(&ReportTo::Tensorboard) {
            sinks.push(Box::new(TensorBoardSink::create(&TensorBoardSink::dir(
                cfg,
            ))?));
        }
        sinks.extend(opts.sinks.iter().map(|s| Box::new(Shared(s.clone())) as _));
        let mut bus = EventBus::start(sinks, cfg.pipeline.events_capacity)?;
        let (start, total) = (learner.state.step, learner.state.max_steps);
        bus.send(Event::Begin { start, total })?;
        callbacks.on_train_begin(&learner.state);
        Ok(Self {
            cfg,
            opts,
            callbacks,
            bus: Some(bus),
            start,
            total,
            sink_failed: false,
            result: TrainingResult {
                run_dir: run_dir.to_path_buf(),
                ..Default::default()
            },
        })
    }

    fn send(&mut self, e: Event) -> Result<()> {
        let sent = match &mut self.bus {
            Some(b) => b.send(e),
            None => Err(anyhow!("the events thread has stopped")),
        };
        self.sink_failed |= sent.is_err();
        sent
    }

    /// Before a step.
    pub(crate) fn step_begin(&mut self, learner: &Learner) {
        self.callbacks.on_step_begin(&learner.state);
    }

    /// After a step (`learner.state.step` is the step just done): adds the step's timing and
    /// memory, logs, calls back, evaluates (`eval` gives the metrics), checkpoints. Returns true
    /// when the run should stop here.
    pub(crate) fn step_end(
        &mut self,
        learner: &mut Learner,
        mut m: Metrics,
        completions: Vec<serde_json::Value>,
        tokens: Option<usize>,
        seconds: f64,
        eval: impl FnOnce(&mut Learner) -> Option<Result<Metrics>>,
    ) -> Result<bool> {
        let before = learner.state.epoch;
        learner.state.epoch = epochs_of(learner.state.position);
        let step = learner.state.step;
        m.insert("step".into(), step as f64);
        m.insert("epoch".into(), learner.state.epoch);
        m.insert("step_time".into(), seconds);
        if let Some(t) = tokens {
            m.insert("tokens_per_s".into(), t as f64 / seconds.max(1e-9));
        }
        m.insert("peak_rss_mib".into(), peak_rss_mib());
        let logged = step.is_multiple_of(self.cfg.train.logging_steps) || step == self.total;
        self.send(Event::Step {
            step,
            metrics: m.clone(),
            logged,
        })?;
        if logged && !completions.is_empty() {
            self.send(Event::Completions(completions))?;
        }
        self.callbacks.on_step_end(&learner.state, &m);
        let t = &self.cfg.train;
        if t.eval_steps > 0
            && step.is_multiple_of(t.eval_steps)
            && let Some(em) = eval(learner)
        {
            let em = em?;
            self.send(Event::Eval {
                step,
                metrics: em.clone(),
            })?;
            self.callbacks.on_evaluate(&learner.state, &em);
        }
        if learner.state.epoch.floor() > before.floor() {
            self.callbacks.on_epoch_end(&learner.state);
        }
        self.result.metrics.push(m);
        let save_now = t.save_steps > 0 && step.is_multiple_of(t.save_steps);
        let stop = self.opts.stop.load(Ordering::SeqCst)
            || self.opts.stop_after.is_some_and(|k| step - self.start >= k);
        if save_now || step == self.total || stop {
            let mut job = learner.checkpoint_job()?;
            // TRL's MergeModelCallback: at every checkpoint, or at the end of training.
            if let Some(m) = &self.cfg.merge
                && (m.merge_at_every_checkpoint || (step == self.total && !stop))
            {
                let target = m
                    .target_model_path
                    .clone()
                    .unwrap_or_else(|| self.cfg.model.path.clone());
                job.merge = Some((m.clone(), target));
            }
            self.result.best_checkpoint_path = Some(job.dir.clone());
            self.send(Event::Checkpoint(Box::new(job)))?;
        }
        self.result.interrupted = stop;
        Ok(stop)
    }

    /// After the last step: waits for the events thread (every checkpoint written) and calls
    /// `on_train_end`.
    pub(crate) fn finish(mut self, learner: &Learner) -> Result<TrainingResult> {
        if let Some(bus) = self.bus.take() {
            bus.finish()?;
        }
        let mut result = std::mem::take(&mut self.result);
        if !result.interrupted {
            learner.save_bema()?;
        }
        result.total_steps = learner.state.step;
        result.total_epochs = learner.state.epoch;
        self.callbacks.on_train_end(&learner.state, &result);
        Ok(result)
    }

    /// Ends a failed run. The learner is between two steps when another stage failed, or when
    /// it ran out of memory before changing a weight: its progress since the last checkpoint
    /// is saved. Out of device memory becomes one line naming what lowers memory.
    pub(crate) fn fail(mut self, learner: &mut Learner, e: anyhow::Error) -> anyhow::Error {
        let flushed = match self.bus.take() {
            Some(bus) => bus.finish(),
            None => Ok(()),
        };
        let e = match flushed {
            Err(sink) if e.downcast_ref::<Stage>() != Some(&Stage::Learner) => sink,
            _ => e,
        };
        let stage = e.downcast_ref::<Stage>().copied();
        let step = learner.state.step;
        let saved = learner
            .checkpoints
            .last()
            .filter(|p| p.ends_with(format!("step-{step}")) && p.exists())
            .cloned();
        let progressed = step > self.start && !learner.updating;
        if is_out_of_memory(&e) {
            let ckpt = match (progressed, saved) {
                (true, Some(p)) => Some(p),
                (true, None) => learner.save_checkpoint().ok(),
                (false, _) => None,
            };
            return anyhow!(out_of_memory_message(self.cfg, step, ckpt.as_deref()));
        }
        if (stage != Some(Stage::Learner) || self.sink_failed)
            && progressed
            && saved.is_none()
            && let Ok(dir) = learner.save_checkpoint()
        {
            return e.context(format!(
                "run stopped after step {step}; checkpoint {} saved (continue with --resume)",
                dir.display()
            ));
        }
        e
    }
}
