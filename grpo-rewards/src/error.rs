//! The crate's one error type.

use std::path::PathBuf;

/// Everything that can go wrong while building or running a reward.
///
/// Each variant names the thing to fix: the config field, the judge, the HTTP status, the sample.
/// No variant ever carries an API key: keys are read from the environment at the last moment
/// and only the *name* of the variable appears in messages.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum RewardError {
    /// A config value is invalid; `field` is its dotted path (e.g. `rewards[2].timeout_secs`).
    #[error("invalid reward config: `{field}`: {message}")]
    Config {
        /// Dotted path of the offending field.
        field: String,
        /// What is wrong and what is expected.
        message: String,
    },
    /// The environment variable that should hold a judge's API key is not set.
    #[error("judge `{judge}`: environment variable `{var}` (api_key_env) is not set")]
    MissingApiKey {
        /// The judge's name.
        judge: String,
        /// The variable's name (never its value).
        var: String,
    },
    /// A judge's prompt template failed to compile or to render.
    #[error("judge `{judge}`: template: {message}")]
    Template {
        /// The judge's name.
        judge: String,
        /// minijinja's message, with line information when it has one.
        message: String,
    },
    /// The judge server answered with an HTTP error status.
    #[error("judge `{judge}`: HTTP {status}: {message}")]
    Http {
        /// The judge's name.
        judge: String,
        /// The HTTP status code.
        status: u16,
        /// The start of the response body.
        message: String,
    },
    /// The request never got an HTTP answer (connection refused or reset, TLS, DNS).
    #[error("judge `{judge}`: request failed: {message}")]
    Transport {
        /// The judge's name.
        judge: String,
        /// The transport error.
        message: String,
    },
    /// The judge failed `failures` requests in a row past their retries
    /// (`max_consecutive_failures`): it is taken to be down.
    #[error(
        "judge `{judge}` is down: {failures} requests in a row failed after their retries (max_consecutive_failures); last error: {last}"
    )]
    JudgeDown {
        /// The judge's name.
        judge: String,
        /// Consecutive failed requests.
        failures: u32,
        /// The last request's error.
        last: String,
    },
    /// The request took longer than `timeout_secs`.
    #[error("judge `{judge}`: no answer within {seconds} s (timeout_secs)")]
    Timeout {
        /// The judge's name.
        judge: String,
        /// The configured per-request timeout.
        seconds: f64,
    },
    /// The server's body was not a chat completion, or the reply held no score.
    #[error("judge `{judge}`: could not read a score: {message}")]
    Parse {
        /// The judge's name.
        judge: String,
        /// What was expected and (the start of) what came.
        message: String,
    },
    /// The persistent judge cache could not be opened, read or written.
    #[error("judge cache `{}`: {message}", path.display())]
    Cache {
        /// The cache file.
        path: PathBuf,
        /// SQLite's message.
        message: String,
    },
    /// A sample lacks what a reward needs (e.g. the answer field).
    #[error("reward `{reward}`: sample {index}: {message}")]
    Sample {
        /// The reward's name.
        reward: String,
        /// Index of the completion in the batch.
        index: usize,
        /// What is missing or malformed.
        message: String,
    },
    /// A scoring model (implemented by the model crate) failed.
    #[error("reward `{reward}`: scoring model: {message}")]
    Scorer {
        /// The reward's name.
        reward: String,
        /// The model's error.
        message: String,
    },
    /// The async runtime could not be used (e.g. a blocking call from inside a runtime).
    #[error("reward runtime: {message}")]
    Runtime {
        /// What went wrong.
        message: String,
    },
    /// A `type = "python"` reward failed: the function raised, returned something other than
    /// one number (or `None`) per completion, ran past its `timeout`, or its worker died twice.
    #[error("python reward `{reward}`: {message}")]
    Python {
        /// The reward's name.
        reward: String,
        /// What happened, naming the function, the sample or the exception's `file:line`.
        message: String,
    },
    /// A reward function returned the wrong number of scores.
    #[error("reward `{reward}` returned {got} scores for {expected} completions")]
    LengthMismatch {
        /// The reward's name.
        reward: String,
        /// Completions in the batch.
        expected: usize,
        /// Scores returned.
        got: usize,
    },
    /// An `http` reward's service failed: no answer past the retries, an error status, or an
    /// answer that is not one reward per sample. `url` never carries the token.
    #[error("reward `{reward}`: POST {url}: {message}")]
    Service {
        /// The reward's name.
        reward: String,
        /// The service's URL (a password in it shown as `***`).
        url: String,
        /// What went wrong (the status and the first line of the body, the connection error...).
        message: String,
    },
}

impl RewardError {
    /// A [`RewardError::Config`] for `field`.
    pub fn config(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self::Config {
            field: field.into(),
            message: message.into(),
        }
    }
}

/// `Result` with [`RewardError`].
pub type Result<T, E = RewardError> = std::result::Result<T, E>;
