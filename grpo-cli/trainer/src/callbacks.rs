//! Hooks into a run: [`Callbacks`], called on the learner's thread with the trainer's state
//! (TRL's `TrainerCallback` events; a hook that blocks holds the learner).

use std::collections::BTreeMap;

use crate::learner::TrainerState;
use crate::pipeline::TrainingResult;

/// Metrics of one step, by TRL's names.
pub type Metrics = BTreeMap<String, f64>;

/// Hooks into a run (all optional). `state.step` counts the steps done: in
/// [`Callbacks::on_step_begin`] the step about to run is `state.step + 1`.
pub trait Callbacks {
    /// Before the first step (after a resume, `state` is the checkpoint's).
    fn on_train_begin(&mut self, _state: &TrainerState) {}
    /// Before each step's optimizer work.
    fn on_step_begin(&mut self, _state: &TrainerState) {}
    /// After each step with its metrics.
    fn on_step_end(&mut self, _state: &TrainerState, _metrics: &Metrics) {}
    /// After an evaluation.
    fn on_evaluate(&mut self, _state: &TrainerState, _metrics: &Metrics) {}
    /// After the step that completed a pass over the training data.
    fn on_epoch_end(&mut self, _state: &TrainerState) {}
    /// After the last step.
    fn on_train_end(&mut self, _state: &TrainerState, _result: &TrainingResult) {}
}

/// No callbacks.
#[derive(Debug, Default)]
pub struct NoCallbacks;
impl Callbacks for NoCallbacks {}
