//! The stages of a GRPO step and what flows between them:
//!
//! ```text
//! Loader ──PromptBatch──▶ Generator ──Rollouts──▶ Scorer ──Scored──▶ Learner
//! ```
//!
//! Each stage is a plain struct with a `process` method; [`crate::pipeline`] runs them on
//! threads (or in a plain loop, the reference semantics).

pub mod filter;
pub mod generator;
pub mod loader;
pub mod replay;
pub mod scorer;

pub use generator::{
    Generator, chat_messages, encode_prompt, episode_completions, render_prompt, reset_row,
    row_metadata,
};
pub use loader::{Loader, epochs_of};
pub use scorer::{PolicyScorer, Scorer};

use grpo_data::{Position, Sample};
use grpo_rewards::ScoredBatch;
use grpo_rollout::Completion;
use grpo_teacher::DiagnosticResult;

/// Prompts of one step, with the data position after them (what a checkpoint stores).
#[derive(Debug, Clone)]
pub struct PromptBatch {
    /// 0-based step index over the whole run.
    pub step: usize,
    /// 0-based index of the generation batch over the whole run, which seeds its sampling:
    /// the step, except with DAPO's dynamic sampling (`loss.filter_groups`), where a step may
    /// draw several batches (a merged step's is its last batch's).
    pub draw: usize,
    /// The samples.
    pub samples: Vec<Sample>,
    /// Stream position after this batch.
    pub position: Position,
}

impl PromptBatch {
    /// The epoch its rows were drawn from, as TRL's `state.epoch` counts it for the values
    /// given per epoch (online DPO's β, XPO's α, Nash-MD's mixture coefficient): a batch that
    /// ends an epoch still belongs to it.
    pub fn epoch(&self) -> u64 {
        match (self.position.index, self.position.epoch) {
            (0, e) if e > 0 => e - 1,
            (_, e) => e,
        }
    }
}

/// Completions of one step.
#[derive(Debug, Clone)]
pub struct Rollouts {
    /// The prompts.
    pub batch: PromptBatch,
    /// Prompt text as the model saw it (after the chat template).
    pub prompt_texts: Vec<String>,
    /// Prompt token ids (after left truncation).
    pub prompt_ids: Vec<Vec<u32>>,
    /// `num_generations` completions per prompt, grouped by prompt.
    pub completions: Vec<Completion>,
    /// The policy version that sampled them.
    pub version: usize,
    /// The policy weights at that version (for rewards that score with the policy).
    pub weights: std::sync::Arc<grpo_rollout::Transformer>,
    /// Seconds spent generating.
    pub seconds: f64,
    /// With `[teacher]`: each prompt's question and the student's diagnostic probe.
    pub teaching: Option<Vec<(String, DiagnosticResult)>>,
    /// Sampled by a model other than the policy (`teacher.use_reference_teacher_model`), by
    /// another engine (`rollout.backend = "openai"`) or, in the loss's view of a step with
    /// replayed groups (`loss.replay_buffer_size`), partly by older versions: off-policy
    /// whatever the staleness.
    pub sampled_by_other_model: bool,
    /// With an environment: what the episodes behind the completions add (the per-token
    /// model mask, the environment's rewards, their metrics). `None` for single-turn
    /// completions, whose every token is the model's.
    pub episodes: Option<EpisodeBatch>,
    /// Where the completions come from: the policy's samples, or (GKD's off-policy steps) the
    /// dataset's completions or the distillation teacher's samples.
    pub source: CompletionSource,
    /// ReMax's baselines (`loss.adv_estimator = "remax"`): each prompt's greedy completion
    /// and, once scored, its reward.
    pub greedy: Option<GreedyBaselines>,
}

/// ReMax's baselines: one greedy completion per prompt, in prompt order, and their combined
/// rewards (filled by the scorer; NaN when no reward could score one).
#[derive(Debug, Clone, Default)]
pub struct GreedyBaselines {
    /// The greedy completions.
    pub completions: Vec<Completion>,
    /// Their rewards.
    pub rewards: Vec<f32>,
}

impl Rollouts {
    /// Completion `i`'s prompt as the model saw it: its episode's own (the environment's
    /// `reset` text included), else its row's.
    pub fn prompt_text(&self, i: usize) -> &str {
        self.episodes
            .as_ref()
            .and_then(|e| e.prompt_texts.get(i))
            .unwrap_or(&self.prompt_texts[self.completions[i].prompt_index])
    }
}

/// Where a step's completions come from.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CompletionSource {
    /// Sampled by the policy (or, with `teacher.use_reference_teacher_model`, the frozen
    /// teacher; or on a rollout server).
    #[default]
    Policy,
    /// The dataset's completion column (GKD with `distillation.lmbda` < 1).
    Dataset,
    /// Sampled by the distillation teacher (GKD's `seq_kd`).
    Teacher,
}

/// What multi-turn episodes add to a step's completions (one entry per completion, in order).
#[derive(Debug, Clone, Default)]
pub struct EpisodeBatch {
    /// Per completion, per token: sampled by the model (true) or added for the environment
    /// (false). The loss, the KL and the importance ratios weigh only the model's tokens.
    pub model_masks: Vec<Vec<bool>>,
    /// Per completion: the environment's reward (`environment.reward` of its turns' rewards,
    /// after the environment's `post_process`).
    pub rewards: Vec<f32>,
    /// Per completion: the episode's messages after the prompt (assistant turns and
    /// observations), which rewards see as `completion_messages`.
    pub messages: Vec<Vec<grpo_rollout::ChatMessage>>,
    /// Per completion: the episode's last metadata (what [`grpo_rollout::Environment::release`]
    /// gets once the batch is scored; an `environment_factory` instance's id).
    pub metadata: Vec<serde_json::Value>,
    /// Per completion: its episode's prompt as rendered (the environment's `reset` text
    /// included; episodes of one row may differ), which rewards see as `prompts`; empty = the
    /// step's [`Rollouts::prompt_texts`].
    pub prompt_texts: Vec<String>,
    /// Per completion: its episode's prompt messages (after `reset`); empty = the row's.
    pub prompt_messages: Vec<Vec<grpo_rollout::ChatMessage>>,
    /// Per completion: how many of its first tokens are the end of its episode's own prompt
    /// (past what its row's episodes share; environment tokens for the learner), which
    /// rewards do not see as `completion_ids`; empty = none.
    pub own_prompt_tokens: Vec<usize>,
    /// Metrics of the episodes: `env/turns_mean`, `env/terminated_ratio`, `env/reward_mean`,
    /// the environment's `post_process` metrics as `env/{name}`, and `episodes/*`.
    pub metrics: std::collections::BTreeMap<String, f64>,
}

/// The stage an error came from (attached as context to every stage error; `Display` is e.g.
/// `scorer stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The loader (grpo-data).
    Data,
    /// The generator (rollouts).
    Generator,
    /// The scorer (rewards, advantages).
    Scorer,
    /// The learner (loss, backward, optimizer, checkpoints, metrics).
    Learner,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Data => "data stage",
            Stage::Generator => "generator stage",
            Stage::Scorer => "scorer stage",
            Stage::Learner => "learner stage",
        })
    }
}

/// Scored completions of one step.
#[derive(Debug, Clone)]
pub struct Scored {
    /// The rollouts.
    pub rollouts: Rollouts,
    /// Per-function scores, combined rewards and reward metrics.
    pub scores: ScoredBatch,
    /// One advantage per completion.
    pub advantages: Vec<f32>,
    /// Whether each completion's group had zero reward std.
    pub zero_std: Vec<bool>,
    /// Seconds spent scoring.
    pub seconds: f64,
    /// Most batches the scorer had in flight while scoring this one (1 = alone).
    pub batches_in_flight: usize,
    /// With `loss.replay_buffer_size`: the groups replaced, the step the loss trains on and
    /// the buffer after this step ([`replay`]). Everything else here is the step as generated.
    pub replay: Option<replay::Replay>,
}

impl Scored {
    /// The step the loss trains on: with replayed groups, [`replay::Replay::trained`]; else
    /// this one.
    pub fn trained(&self) -> &Scored {
        self.replay
            .as_ref()
            .and_then(|r| r.trained.as_deref())
            .unwrap_or(self)
    }
}

/// A per-step seed of the run's seed and the step, the same on any machine.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    grpo_data::rng::mix(seed, 0x6e6e_7261_7465, step)
}
