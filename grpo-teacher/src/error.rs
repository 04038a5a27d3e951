//! The crate's one error type.

/// Everything that can go wrong in the teaching protocol; each variant names what to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum TeacherError {
    /// A `[teacher]` value is invalid.
    #[error("invalid teacher config: `teacher.{key}`: {message}")]
    Config {
        /// The key.
        key: &'static str,
        /// What is wrong and what is expected.
        message: String,
    },
    /// A template failed to compile or to render.
    #[error("`teacher.{key}`: {message}")]
    Template {
        /// The template's key.
        key: &'static str,
        /// minijinja's message.
        message: String,
    },
    /// The task (the problem text) is empty.
    #[error("{call}: the task is empty")]
    EmptyTask {
        /// `diagnostic_probe` or `generate_guidance`.
        call: &'static str,
    },
    /// A token budget below the minimum.
    #[error("{call}: max_tokens must be >= {min}, got {got}")]
    MaxTokens {
        /// `diagnostic_probe` or `generate_guidance`.
        call: &'static str,
        /// The minimum (1 for the probe, 10 for guidance).
        min: usize,
        /// The value given.
        got: usize,
    },
    /// A teaching step needs a model that was not given (e.g. guidance without a teacher).
    #[error("{0}")]
    Missing(String),
    /// The student or teacher model failed (generation, tokenisation, scoring).
    #[error("{role} model: {message}")]
    Model {
        /// `student` or `teacher`.
        role: &'static str,
        /// The model's error.
        message: String,
    },
    /// The correctness reward failed.
    #[error(transparent)]
    Reward(#[from] grpo_rewards::RewardError),
}

/// `Result` with [`TeacherError`].
pub type Result<T, E = TeacherError> = std::result::Result<T, E>;
