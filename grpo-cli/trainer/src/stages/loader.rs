//! The loader stage: prompt batches from grpo-data's seeded, resumable stream.

use anyhow::{Context, Result, anyhow};
use grpo_data::{Position, SampleStream, StreamConfig};

use super::PromptBatch;
use crate::setup::Setup;

/// Hands out prompt batches from a resumable stream.
#[derive(Debug)]
pub struct Loader {
    stream: SampleStream,
    next_step: usize,
    /// None with DAPO's dynamic sampling (`loss.filter_groups`): a step draws as many
    /// batches as it needs, and the run ends when the learner has its steps.
    total_steps: Option<usize>,
}

impl Loader {
    /// Starts at `position` (resume) or at the beginning; `start` is the step, or with
    /// `loss.filter_groups` the generation batch, to begin with.
    pub fn new(setup: &Setup, start: usize, position: Option<Position>) -> Result<Self> {
        let drawing = setup.cfg.loss.filter_groups.enable;
        let sc = StreamConfig {
            seed: setup.cfg.train.seed,
            shuffle: setup.cfg.shuffles(),
            batch_size: setup.cfg.prompts_per_draw(),
            epochs: None,
            ..Default::default()
        };
        let stream = match position {
            Some(p) => SampleStream::resume(setup.train.clone(), sc, p),
            None => SampleStream::new(setup.train.clone(), sc),
        }
        .map_err(|e| anyhow!("{e}"))?;
        Ok(Self {
            stream,
            next_step: start,
            total_steps: (!drawing).then_some(setup.total_steps),
        })
    }

    /// The next batch, or None after the last step.
    pub fn process(&mut self) -> Result<Option<PromptBatch>> {
        if self.total_steps.is_some_and(|t| self.next_step >= t) {
            return Ok(None);
        }
        let samples = self
            .stream
            .next_batch()
            .map_err(|e| anyhow!("{e}"))?
            .context("the endless stream ended")?;
        let b = PromptBatch {
            step: self.next_step,
            draw: self.next_step,
            samples,
            position: self.stream.position(),
        };
        self.next_step += 1;
        Ok(Some(b))
    }
}

/// Passes over the data at a stream position.
pub fn epochs_of(p: Option<Position>) -> f64 {
    p.map_or(0.0, |p| {
        p.epoch as f64 + p.index as f64 / p.dataset_len.max(1) as f64
    })
}
