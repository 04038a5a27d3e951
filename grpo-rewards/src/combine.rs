//! Several rewards → one reward per completion (`reward_weights`), and their metrics.

use std::collections::BTreeMap;
use std::sync::Arc;
#[cfg(feature = "judges")]
use std::sync::OnceLock;

use crate::error::{Result, RewardError};
#[cfg(feature = "judges")]
use crate::reward::AsyncReward;
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// TRL's combination: `r_i = Σ_k w_k · r_ik` over the functions `k` that gave a value for
/// completion `i`; a completion no function scored gets `NaN` (GRPO then gives it advantage 0).
///
/// `per_function[k][i]` is function `k`'s score of completion `i`. Functions and weights are
/// zipped; a missing weight counts as 1.
pub fn combine_rewards(per_function: &[Vec<Option<f32>>], weights: &[f32]) -> Vec<f32> {
    let n = per_function.iter().map(Vec::len).max().unwrap_or(0);
    (0..n)
        .map(|i| {
            let mut sum = 0.0f32;
            let mut any = false;
            for (k, scores) in per_function.iter().enumerate() {
                if let Some(Some(s)) = scores.get(i) {
                    if s.is_nan() {
                        continue;
                    }
                    sum += weights.get(k).copied().unwrap_or(1.0) * s;
                    any = true;
                }
            }
            if any { sum } else { f32::NAN }
        })
        .collect()
}

/// Mean of the present, non-NaN values (`NaN` when there are none).
pub fn nan_mean(values: &[Option<f32>]) -> f64 {
    let (sum, n) = values
        .iter()
        .flatten()
        .filter(|v| !v.is_nan())
        .fold((0.0f64, 0usize), |(s, n), &v| (s + f64::from(v), n + 1));
    if n == 0 { f64::NAN } else { sum / n as f64 }
}

/// Unbiased (n − 1) standard deviation of the present, non-NaN values, as PyTorch's
/// `nanstd`-style helper in TRL computes it: `NaN` for fewer than two values.
pub fn nan_std(values: &[Option<f32>]) -> f64 {
    let xs: Vec<f64> = values
        .iter()
        .flatten()
        .filter(|v| !v.is_nan())
        .map(|&v| f64::from(v))
        .collect();
    if xs.len() < 2 {
        return f64::NAN;
    }
    let mean = xs.iter().sum::<f64>() / xs.len() as f64;
    let var = xs.iter().map(|x| (x - mean).powi(2)).sum::<f64>() / (xs.len() - 1) as f64;
    var.sqrt()
}

/// The scores of a batch under a [`RewardSet`].
#[derive(Debug, Clone, Default)]
pub struct ScoredBatch {
    /// The reward functions' names, in order.
    pub names: Vec<String>,
    /// `per_function[k][i]`: function `k`'s score of completion `i`.
    pub per_function: Vec<Vec<Option<f32>>>,
    /// `info[k][i]`: function `k`'s info on completion `i` (explanations, per-judge scores).
    pub info: Vec<Vec<Option<serde_json::Value>>>,
    /// The combined reward per completion ([`combine_rewards`]); `NaN` = unscored.
    pub rewards: Vec<f32>,
    /// `rewards/{name}/mean`, `rewards/{name}/std` and the summed counters (`judge/failures`...).
    pub metrics: BTreeMap<String, f64>,
}

#[derive(Clone)]
enum Kind {
    Sync(Arc<dyn Reward>),
    #[cfg(feature = "judges")]
    Async(Arc<dyn AsyncReward>),
}

#[derive(Clone)]
struct Entry {
    name: String,
    weight: f32,
    kind: Kind,
}

/// Named, weighted rewards scored together.
///
/// ```
/// use grpo_rewards::{RewardInput, RewardSet, builtin::Accuracy};
/// let set = RewardSet::new()
///     .with_reward("accuracy", 1.0, Accuracy::default())
///     .with_reward("short", 0.5, |b: &[RewardInput]| -> Vec<f32> {
///         b.iter().map(|x| if x.completion_tokens < 50 { 1.0 } else { 0.0 }).collect()
///     });
/// let batch = [RewardInput::new("2+2?", "<answer>4</answer>").with_tokens(5).with_field("answer", "4")];
/// let scored = set.score(&batch).unwrap();
/// assert_eq!(scored.rewards, vec![1.5]);
/// assert_eq!(scored.metrics["rewards/accuracy/mean"], 1.0);
/// ```
#[derive(Default)]
pub struct RewardSet {
    // Shared with the tasks of `spawn_score` (which must never own the runtime: a runtime may
    // not be dropped from inside itself).
    entries: Arc<Vec<Entry>>,
    #[cfg(feature = "judges")]
    runtime: OnceLock<tokio::runtime::Runtime>,
}

impl std::fmt::Debug for RewardSet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut l = f.debug_list();
        for e in self.entries.iter() {
            let kind = match e.kind {
                Kind::Sync(_) => "sync",
                #[cfg(feature = "judges")]
                Kind::Async(_) => "async",
            };
            l.entry(&format_args!("{} (weight {}, {kind})", e.name, e.weight));
        }
        l.finish()
    }
}

impl RewardSet {
    /// An empty set.
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds a synchronous reward (or closure) named `name` with weight `weight`.
    pub fn with_reward(
        mut self,
        name: impl Into<String>,
        weight: f32,
        r: impl Reward + 'static,
    ) -> Self {
        self.push(name, weight, Kind::Sync(Arc::new(r)));
        self
    }

    #[cfg(feature = "judges")]
    /// Adds an asynchronous reward (an LLM judge) named `name` with weight `weight`.
    pub fn with_async_reward(
        mut self,
        name: impl Into<String>,
        weight: f32,
        r: impl AsyncReward + 'static,
    ) -> Self {
        self.push(name, weight, Kind::Async(Arc::new(r)));
        self
    }

    /// Adds a shared synchronous reward.
    pub fn push_reward(&mut self, name: impl Into<String>, weight: f32, r: Arc<dyn Reward>) {
        self.push(name, weight, Kind::Sync(r));
    }

    #[cfg(feature = "judges")]
    /// Adds a shared asynchronous reward.
    pub fn push_async_reward(
        &mut self,
        name: impl Into<String>,
        weight: f32,
        r: Arc<dyn AsyncReward>,
    ) {
        self.push(name, weight, Kind::Async(r));
    }

    fn push(&mut self, name: impl Into<String>, weight: f32, kind: Kind) {
        Arc::make_mut(&mut self.entries).push(Entry {
            name: name.into(),
            weight,
            kind,
        });
    }

    /// The names, in order.
    pub fn names(&self) -> Vec<&str> {
        self.entries.iter().map(|e| e.name.as_str()).collect()
    }

    /// The weights (`reward_weights`), in order.
    pub fn weights(&self) -> Vec<f32> {
        self.entries.iter().map(|e| e.weight).collect()
    }

    /// Number of reward functions.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when no reward was added.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    #[cfg(feature = "judges")]
    /// Scores `batch` from async code: synchronous rewards run inline, the asynchronous ones
    /// concurrently.
    pub async fn score_async(&self, batch: &[RewardInput]) -> Result<ScoredBatch> {
        score_entries(&self.entries, batch).await
    }

    /// True when some reward is asynchronous (an LLM judge): scoring then waits on the network
    /// and several batches can usefully be in flight at once ([`RewardSet::spawn_score`]).
    pub fn has_async(&self) -> bool {
        #[cfg(feature = "judges")]
        return self
            .entries
            .iter()
            .any(|e| matches!(e.kind, Kind::Async(_)));
        #[cfg(not(feature = "judges"))]
        false
    }

    #[cfg(feature = "judges")]
    /// Starts scoring `batch` on the set's runtime and returns at once, so that the requests of
    /// several batches are in flight together (each judge's `max_concurrent`, rate limits and
    /// cache are shared by all of them). `on_done` receives the result, exactly once, on a
    /// runtime thread (a panicking reward becomes an error); it should only hand the result on
    /// (e.g. send it on a channel). Dropping the returned [`ScoreTask`] cancels the scoring.
    ///
    /// ```
    /// use grpo_rewards::{RewardInput, RewardSet};
    /// let set = RewardSet::new().with_reward("len", 1.0, |b: &[RewardInput]| -> Vec<f32> {
    ///     b.iter().map(|x| x.completion.len() as f32).collect()
    /// });
    /// let (tx, rx) = std::sync::mpsc::channel();
    /// let task = set.spawn_score(vec![RewardInput::new("q", "abc")], move |r| {
    ///     let _ = tx.send(r);
    /// }).unwrap();
    /// let scored = rx.recv().unwrap().unwrap();
    /// assert_eq!(scored.rewards, vec![3.0]);
    /// drop(task);
    /// ```
    pub fn spawn_score(
        &self,
        batch: Vec<RewardInput>,
        on_done: impl FnOnce(Result<ScoredBatch>) + Send + 'static,
    ) -> Result<ScoreTask> {
        use futures_util::FutureExt;
        let entries = self.entries.clone();
        let handle = self.runtime()?.spawn(async move {
            let scored = std::panic::AssertUnwindSafe(score_entries(&entries, &batch))
                .catch_unwind()
                .await
                .unwrap_or_else(|p| {
                    let what = p
                        .downcast_ref::<&str>()
                        .map(|s| (*s).to_owned())
                        .or_else(|| p.downcast_ref::<String>().cloned())
                        .unwrap_or_else(|| "no message".into());
                    Err(RewardError::Runtime {
                        message: format!("a reward panicked: {what}"),
                    })
                });
            on_done(scored);
        });
        Ok(ScoreTask(handle))
    }

    #[cfg(feature = "judges")]
    fn runtime(&self) -> Result<&tokio::runtime::Runtime> {
        if let Some(rt) = self.runtime.get() {
            return Ok(rt);
        }
        let rt = tokio::runtime::Builder::new_multi_thread()
            .worker_threads(2)
            .thread_name("grpo-rewards")
            .enable_all()
            .build()
            .map_err(|e| RewardError::Runtime {
                message: format!("cannot start the tokio runtime: {e}"),
            })?;
        let _ = self.runtime.set(rt);
        self.runtime.get().ok_or_else(|| RewardError::Runtime {
            message: "runtime vanished".into(),
        })
    }

    /// Scores `batch` from synchronous code (the pipeline's scorer thread). When the set has
    /// asynchronous rewards this drives them on a runtime the set owns (2 worker threads,
    /// created on first use). Call [`RewardSet::score_async`] instead from inside a runtime.
    pub fn score(&self, batch: &[RewardInput]) -> Result<ScoredBatch> {
        if !self.has_async() {
            let mut results = Vec::with_capacity(self.entries.len());
            for e in self.entries.iter() {
                #[allow(irrefutable_let_patterns)]
                if let Kind::Sync(r) = &e.kind {
                    results.push(r.score(batch)?);
                }
            }
            return assemble(&self.entries, batch.len(), results);
        }
        #[cfg(feature = "judges")]
        {
            if tokio::runtime::Handle::try_current().is_ok() {
                return Err(RewardError::Runtime {
                    message: "RewardSet::score was called inside a tokio runtime; use score_async"
                        .into(),
                });
            }
            let rt = self.runtime()?;
            rt.block_on(self.score_async(batch))
        }
        #[cfg(not(feature = "judges"))]
        unreachable!("no asynchronous rewards without the `judges` feature")
    }
}

#[cfg(feature = "judges")]
async fn score_entries(entries: &[Entry], batch: &[RewardInput]) -> Result<ScoredBatch> {
    let futures = entries.iter().map(|e| async move {
        match &e.kind {
            Kind::Sync(r) => r.score(batch),
            Kind::Async(r) => r.score_async(batch).await,
        }
    });
    let outputs = futures_util::future::join_all(futures).await;
    let mut results = Vec::with_capacity(outputs.len());
    for o in outputs {
        results.push(o?);
    }
    assemble(entries, batch.len(), results)
}

#[cfg(feature = "judges")]
/// A batch being scored by [`RewardSet::spawn_score`]; dropping it cancels the scoring.
#[derive(Debug)]
#[cfg(feature = "judges")]
pub struct ScoreTask(tokio::task::JoinHandle<()>);

#[cfg(feature = "judges")]
impl ScoreTask {
    /// Whether the scoring has ended (its `on_done` has run or it was cancelled).
    pub fn is_finished(&self) -> bool {
        self.0.is_finished()
    }
}

#[cfg(feature = "judges")]
impl Drop for ScoreTask {
    fn drop(&mut self) {
        self.0.abort();
    }
}

fn assemble(entries: &[Entry], n: usize, results: Vec<RewardOutput>) -> Result<ScoredBatch> {
    let mut out = ScoredBatch::default();
    for (e, r) in entries.iter().zip(results) {
        if r.scores.len() != n {
            return Err(RewardError::LengthMismatch {
                reward: e.name.clone(),
                expected: n,
                got: r.scores.len(),
            });
        }
        let mut info = r.info;
        info.resize(n, None);
        out.metrics
            .insert(format!("rewards/{}/mean", e.name), nan_mean(&r.scores));
        out.metrics
            .insert(format!("rewards/{}/std", e.name), nan_std(&r.scores));
        for (k, v) in r.counters {
            *out.metrics.entry(k).or_insert(0.0) += v;
        }
        out.names.push(e.name.clone());
        out.per_function.push(r.scores);
        out.info.push(info);
    }
    out.rewards = combine_rewards(
        &out.per_function,
        &entries.iter().map(|e| e.weight).collect::<Vec<_>>(),
    );
    // One reward per completion, also from an empty set: NaN, as for any completion no function
    // scored.
    out.rewards.resize(n, f32::NAN);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// An empty set still gives one reward per completion: NaN, unscored.
    #[test]
    fn an_empty_set_leaves_every_completion_unscored() {
        let batch = [RewardInput::new("p", "a"), RewardInput::new("p", "b")];
        let out = RewardSet::new().score(&batch).unwrap();
        assert!(out.per_function.is_empty());
        assert_eq!(out.rewards.len(), 2);
        assert!(out.rewards.iter().all(|r| r.is_nan()));
    }
}
