//! The seam: a reward scores a batch of completions.

use std::future::Future;
use std::pin::Pin;

use crate::error::Result;
use crate::types::{RewardInput, RewardOutput};

/// A boxed, `Send` future (the return type of [`AsyncReward::score_async`]).
pub type BoxFuture<'a, T> = Pin<Box<dyn Future<Output = T> + Send + 'a>>;

/// A synchronous reward: scores a whole batch at once.
///
/// Any `Fn(&[RewardInput]) -> Vec<Option<f32>>` (or `-> Vec<f32>`) closure is a `Reward`:
///
/// ```
/// use grpo_rewards::{Reward, RewardInput};
/// let short = |batch: &[RewardInput]| -> Vec<f32> {
///     batch.iter().map(|x| if x.completion.len() < 10 { 1.0 } else { 0.0 }).collect()
/// };
/// let out = short.score(&[RewardInput::new("q", "ok")]).unwrap();
/// assert_eq!(out.scores, vec![Some(1.0)]);
/// ```
pub trait Reward: Send + Sync {
    /// One score per input (`None` = no opinion), plus optional per-sample info.
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput>;
}

impl<F, O> Reward for F
where
    F: Fn(&[RewardInput]) -> O + Send + Sync,
    O: Into<RewardOutput>,
{
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        Ok(self(batch).into())
    }
}

/// An asynchronous reward (LLM judges): scores a batch, typically with many requests in flight.
///
/// Runs on a tokio runtime. [`crate::RewardSet::score`] provides one for synchronous callers.
pub trait AsyncReward: Send + Sync {
    /// One score per input (`None` = no opinion), plus optional per-sample info.
    fn score_async<'a>(&'a self, batch: &'a [RewardInput]) -> BoxFuture<'a, Result<RewardOutput>>;
}
