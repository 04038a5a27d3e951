//! The HTTP plumbing shared by the LLM judges and grpo-rollout's `remote` client (generation
//! on vLLM): one retry policy ([`RetryPolicy`], built with backon), the `Retry-After` parser
//! ([`retry_after`]), and the async-openai transport ([`StatusAware`]) that keeps a failed
//! response's status and `Retry-After`, which async-openai's own errors drop; and the
//! `type = "http"` reward ([`HttpReward`]), a reward model behind an HTTP service.
//!
//! Behind the `judges` feature.

mod retry;
mod reward;
mod transport;

pub use retry::{
    FailedAttempt, MAX_RETRY_AFTER, RetryDecision, RetryPolicy, next_wait, retry_after,
    retry_after_at, retry_after_ms, retryable_status,
};
pub use reward::{HttpReward, HttpRewardConfig, RESERVED_KEYS};
pub use transport::{HttpFailure, StatusAware, openai_client};

/// An error and its causes on one line (`a: b: c`), each cause left out when the text before
/// already holds it (reqwest repeats its causes). For a request error, drop the URL first
/// (`reqwest::Error::without_url`) where the message names it once.
pub fn error_chain(e: &dyn std::error::Error) -> String {
    let mut message = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let text = s.to_string();
        if !message.contains(&text) {
            message.push_str(": ");
            message.push_str(&text);
        }
        source = s.source();
    }
    message
}

/// The first 200 characters of `s`, for messages.
pub(crate) fn snippet(s: &str) -> String {
    let mut out: String = s.chars().take(200).collect();
    if s.chars().count() > 200 {
        out.push('…');
    }
    out
}
