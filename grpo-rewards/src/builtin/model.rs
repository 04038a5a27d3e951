//! Rewards that need a local model, through small scoring traits the model crate implements.

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// The error a scoring model returns (the model crate boxes its candle error).
pub type ScorerError = Box<dyn std::error::Error + Send + Sync>;

/// A causal language model seen from the rewards: tokenise, and log-probabilities of tokens.
///
/// Implemented by `grpo-rollout` on its model (no candle here). Implementations compute the
/// log-softmax of the needed positions only; the batch methods default to a loop and may be
/// overridden with a batched forward pass.
pub trait LanguageScorer: Send + Sync {
    /// Token ids of `text` as the model sees it (BOS included when the model uses one).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError>;

    /// Mean negative log-likelihood (nats per token) of `completion`'s tokens given `prompt`:
    /// `−(1/n) Σ_j log p(c_j | prompt, c_<j)`. `None` when the completion has no tokens.
    fn completion_nll(&self, prompt: &str, completion: &str) -> Result<Option<f32>, ScorerError>;

    /// Runs the model on `text` alone (tokens `t_0..t_{n−1}`) and returns, for
    /// `i < min(n, targets.len())`, `log softmax(logits_i)[targets[i]]` where `logits_i` is the
    /// next-token distribution after `t_0..=t_i`.
    fn aligned_log_probs(&self, text: &str, targets: &[u32]) -> Result<Vec<f32>, ScorerError>;

    /// [`LanguageScorer::completion_nll`] for many pairs.
    fn completion_nll_batch(
        &self,
        pairs: &[(&str, &str)],
    ) -> Result<Vec<Option<f32>>, ScorerError> {
        pairs
            .iter()
            .map(|(p, c)| self.completion_nll(p, c))
            .collect()
    }
}

/// A sequence-classification model (a reward model with a scalar head).
///
/// Implemented by the model crate. [`RewardModel`] pads the batch and reads the score at each
/// row's last non-pad token.
pub trait SequenceClassifier: Send + Sync {
    /// Token ids of `text`.
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError>;
    /// The id used for right padding.
    fn pad_token_id(&self) -> u32;
    /// For a right-padded batch `(B, T)` of ids, the scalar head's output at every position
    /// `(B, T)`.
    fn position_scores(&self, padded: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ScorerError>;
}

fn scorer_err(reward: &str, e: ScorerError) -> RewardError {
    RewardError::Scorer {
        reward: reward.into(),
        message: e.to_string(),
    }
}

/// Which model scores an [`InverseLoss`] reward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ScoringModel {
    /// The frozen model as loaded ([`crate::ScoringModels::language`]): the default.
    #[default]
    Reference,
    /// The policy being trained, with the weights that sampled the completions
    /// ([`crate::ScoringModels::policy`], which the trainer keeps current).
    Policy,
}

/// Config of [`InverseLoss`] (`type = "inverse_loss"`).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InverseLossConfig {
    /// `"reference"` (default) or `"policy"`: which model's perplexity is inverted.
    #[serde(default)]
    pub model: ScoringModel,
}

/// Unsupervised: `−(mean NLL of the completion's tokens given the prompt)` under a scoring
/// model; an empty completion scores 0.
#[derive(Clone)]
pub struct InverseLoss {
    model: Arc<dyn LanguageScorer>,
}

impl std::fmt::Debug for InverseLoss {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("InverseLoss").finish_non_exhaustive()
    }
}

impl InverseLoss {
    /// Scores with `model`.
    pub fn new(model: Arc<dyn LanguageScorer>) -> Self {
        Self { model }
    }
}

impl Reward for InverseLoss {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let pairs: Vec<(&str, &str)> = batch
            .iter()
            .filter(|x| !x.completion.is_empty())
            .map(|x| (x.prompt.as_str(), x.completion.as_str()))
            .collect();
        let nll = self
            .model
            .completion_nll_batch(&pairs)
            .map_err(|e| scorer_err("inverse_loss", e))?;
        if nll.len() != pairs.len() {
            return Err(RewardError::Scorer {
                reward: "inverse_loss".into(),
                message: format!(
                    "completion_nll_batch gave {} values for {} pairs",
                    nll.len(),
                    pairs.len()
                ),
            });
        }
        let mut nll = nll.into_iter();
        let scores = batch
            .iter()
            .map(|x| {
                if x.completion.is_empty() {
                    Some(0.0)
                } else {
                    Some(nll.next().flatten().map_or(0.0, |v| -v))
                }
            })
            .collect();
        Ok(RewardOutput::from_scores(scores))
    }
}

/// Config of [`CoverageCe`] (`type = "coverage_ce"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CoverageCeConfig {
    /// The sample field with the reference answer. Default `"answer"`.
    pub answer_field: String,
}

impl Default for CoverageCeConfig {
    fn default() -> Self {
        Self {
            answer_field: "answer".into(),
        }
    }
}

/// Supervised: the completion is scored alone; its next-token log-probs at positions
/// `0..min_len` are read at the answer's tokens:
/// `CE = −(1/min_len) Σ_{i<min_len} log softmax(logits_i)[a_i]`,
/// `reward = −CE · min(1, n_completion / n_answer)`, and 0 when `min_len = 0`
/// (`min_len = min(n_completion, n_answer)`).
#[derive(Clone)]
pub struct CoverageCe {
    model: Arc<dyn LanguageScorer>,
    config: CoverageCeConfig,
}

impl std::fmt::Debug for CoverageCe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("CoverageCe")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl CoverageCe {
    /// Scores with `model`.
    pub fn new(model: Arc<dyn LanguageScorer>, config: CoverageCeConfig) -> Result<Self> {
        if config.answer_field.trim().is_empty() {
            return Err(RewardError::config("answer_field", "must not be empty"));
        }
        Ok(Self { model, config })
    }
}

impl Reward for CoverageCe {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let mut scores = Vec::with_capacity(batch.len());
        for (i, x) in batch.iter().enumerate() {
            let answer = x
                .field(&self.config.answer_field)
                .and_then(|v| v.as_text())
                .ok_or_else(|| RewardError::Sample {
                    reward: "coverage_ce".into(),
                    index: i,
                    message: format!("no field `{}` (answer_field)", self.config.answer_field),
                })?;
            let err = |e| scorer_err("coverage_ce", e);
            let answer_ids = self.model.tokenize(&answer).map_err(err)?;
            let completion_ids = if x.completion.is_empty() {
                Vec::new()
            } else {
                self.model.tokenize(&x.completion).map_err(err)?
            };
            let min_len = completion_ids.len().min(answer_ids.len());
            if min_len == 0 {
                scores.push(Some(0.0));
                continue;
            }
            let lp = self
                .model
                .aligned_log_probs(&x.completion, &answer_ids[..min_len])
                .map_err(err)?;
            if lp.len() != min_len {
                return Err(RewardError::Scorer {
                    reward: "coverage_ce".into(),
                    message: format!(
                        "aligned_log_probs gave {} values, expected {min_len}",
                        lp.len()
                    ),
                });
            }
            let ce = -lp.iter().map(|&v| f64::from(v)).sum::<f64>() / min_len as f64;
            let coverage = (completion_ids.len() as f64 / answer_ids.len() as f64).min(1.0);
            scores.push(Some((-ce * coverage) as f32));
        }
        Ok(RewardOutput::from_scores(scores))
    }
}

/// Config of [`RewardModel`] (`type = "reward_model"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardModelConfig {
    /// Score `prompt + completion` (default `true`) or the completion alone.
    pub include_prompt: bool,
    /// Rows per forward pass. Default 8.
    pub batch_size: usize,
}

impl Default for RewardModelConfig {
    fn default() -> Self {
        Self {
            include_prompt: true,
            batch_size: 8,
        }
    }
}

/// A sequence-classification reward model: the score at the last non-pad token of each
/// (right-padded) row. A row that is all padding (empty text) scores `None`.
#[derive(Clone)]
pub struct RewardModel {
    model: Arc<dyn SequenceClassifier>,
    config: RewardModelConfig,
}

impl std::fmt::Debug for RewardModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RewardModel")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl RewardModel {
    /// Scores with `model`.
    pub fn new(model: Arc<dyn SequenceClassifier>, config: RewardModelConfig) -> Result<Self> {
        if config.batch_size == 0 {
            return Err(RewardError::config("batch_size", "must be > 0"));
        }
        Ok(Self { model, config })
    }
}

impl Reward for RewardModel {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let err = |e| scorer_err("reward_model", e);
        let pad = self.model.pad_token_id();
        let mut scores = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(self.config.batch_size) {
            let mut rows = Vec::with_capacity(chunk.len());
            for x in chunk {
                let text = if self.config.include_prompt {
                    format!("{}{}", x.prompt, x.completion)
                } else {
                    x.completion.clone()
                };
                rows.push(self.model.tokenize(&text).map_err(err)?);
            }
            let width = rows.iter().map(Vec::len).max().unwrap_or(0);
            for r in &mut rows {
                r.resize(width, pad);
            }
            let out = self.model.position_scores(&rows).map_err(err)?;
            if out.len() != rows.len() {
                return Err(RewardError::Scorer {
                    reward: "reward_model".into(),
                    message: format!("position_scores gave {} rows for {}", out.len(), rows.len()),
                });
            }
            for (ids, s) in rows.iter().zip(&out) {
                let last = ids.iter().rposition(|&t| t != pad);
                scores.push(last.and_then(|j| s.get(j).copied()));
            }
        }
        Ok(RewardOutput::from_scores(scores))
    }
}

/// A token-classification model with two labels (a process reward model, as `grpo-cli prm`
/// trains one): the probability of the "correct" label at each position.
///
/// Implemented by the model crate.
pub trait StepClassifier: Send + Sync {
    /// Token ids of `text`, without special tokens (as the model was trained on its steps).
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError>;
    /// The id put before the prompt, when the tokenizer has one.
    fn bos_token_id(&self) -> Option<u32>;
    /// The id used for right padding.
    fn pad_token_id(&self) -> u32;
    /// For a right-padded batch `(B, T)` of ids, `P(label 1)` at every position `(B, T)`.
    fn step_probabilities(&self, padded: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ScorerError>;
}

/// How [`ProcessRewardModel`] turns its steps' probabilities into one reward.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum StepAggregation {
    /// The weakest step's (a solution is as good as its worst step; the default).
    #[default]
    Min,
    /// The last step's.
    Last,
    /// The mean over the steps.
    Mean,
    /// The product (the probability that every step is correct, the steps taken apart).
    Prod,
}

/// Config of [`ProcessRewardModel`] (`type = "process_reward_model"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ProcessRewardModelConfig {
    /// The `*ForTokenClassification` directory (read by whoever builds the model).
    pub path: Option<std::path::PathBuf>,
    /// Where the trainer runs it (`cpu`, `cuda`, `cuda:N`); absent: the policy's device.
    pub device: Option<String>,
    /// The trainer's dtype for it (`f32`, `bf16`, `f16`); absent: the policy's compute dtype.
    pub dtype: Option<String>,
    /// The completion is cut into steps at each separator, as the model was trained (default
    /// `"\n"`); empty steps are skipped.
    pub step_separator: String,
    /// How the steps' probabilities make the reward (default `min`).
    pub aggregation: StepAggregation,
    /// Rows per forward pass. Default 8.
    pub batch_size: usize,
}

impl Default for ProcessRewardModelConfig {
    fn default() -> Self {
        Self {
            path: None,
            device: None,
            dtype: None,
            step_separator: "\n".into(),
            aggregation: StepAggregation::Min,
            batch_size: 8,
        }
    }
}

/// A process reward model as a reward: the completion cut into steps at
/// `step_separator`, the row built as the model was trained (TRL's PRMTrainer `tokenize_row`:
/// BOS, the prompt, each step followed by the separator, no special tokens), the probability
/// that each step is correct read at its last token, aggregated. A completion without a step
/// scores `None`.
#[derive(Clone)]
pub struct ProcessRewardModel {
    model: Arc<dyn StepClassifier>,
    config: ProcessRewardModelConfig,
}

impl std::fmt::Debug for ProcessRewardModel {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ProcessRewardModel")
            .field("config", &self.config)
            .finish_non_exhaustive()
    }
}

impl ProcessRewardModel {
    /// Scores with `model`.
    pub fn new(model: Arc<dyn StepClassifier>, config: ProcessRewardModelConfig) -> Result<Self> {
        if config.batch_size == 0 {
            return Err(RewardError::config("batch_size", "must be > 0"));
        }
        if config.step_separator.is_empty() {
            return Err(RewardError::config(
                "step_separator",
                "must not be empty (the completion is cut into steps at it)",
            ));
        }
        Ok(Self { model, config })
    }

    /// The row of `prompt` + `steps` and the position of each step's last token.
    fn row(&self, prompt: &str, steps: &[&str]) -> Result<(Vec<u32>, Vec<usize>), ScorerError> {
        let sep = self.model.tokenize(&self.config.step_separator)?;
        let mut ids: Vec<u32> = self.model.bos_token_id().into_iter().collect();
        ids.extend(self.model.tokenize(prompt)?);
        let mut ends = Vec::with_capacity(steps.len());
        for s in steps {
            ids.extend(self.model.tokenize(s)?);
            ids.extend_from_slice(&sep);
            ends.push(ids.len() - 1);
        }
        Ok((ids, ends))
    }
}

impl Reward for ProcessRewardModel {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let err = |e| scorer_err("process_reward_model", e);
        let pad = self.model.pad_token_id();
        let mut scores = Vec::with_capacity(batch.len());
        for chunk in batch.chunks(self.config.batch_size) {
            let mut rows = Vec::with_capacity(chunk.len());
            let mut ends = Vec::with_capacity(chunk.len());
            for x in chunk {
                let steps: Vec<&str> = x
                    .completion
                    .split(self.config.step_separator.as_str())
                    .filter(|s| !s.is_empty())
                    .collect();
                let (ids, e) = self.row(&x.prompt, &steps).map_err(err)?;
                rows.push(ids);
                ends.push(e);
            }
            let width = rows.iter().map(Vec::len).max().unwrap_or(0);
            for r in &mut rows {
                r.resize(width, pad);
            }
            let out = self.model.step_probabilities(&rows).map_err(err)?;
            if out.len() != rows.len() {
                return Err(RewardError::Scorer {
                    reward: "process_reward_model".into(),
                    message: format!(
                        "step_probabilities gave {} rows for {}",
                        out.len(),
                        rows.len()
                    ),
                });
            }
            for (p, e) in out.iter().zip(&ends) {
                let steps: Vec<f32> = e.iter().filter_map(|&j| p.get(j).copied()).collect();
                scores.push(match steps.is_empty() {
                    true => None,
                    false => Some(match self.config.aggregation {
                        StepAggregation::Min => steps.iter().copied().fold(f32::INFINITY, f32::min),
                        StepAggregation::Last => steps[steps.len() - 1],
                        StepAggregation::Mean => steps.iter().sum::<f32>() / steps.len() as f32,
                        StepAggregation::Prod => steps.iter().product(),
                    }),
                });
            }
        }
        Ok(RewardOutput::from_scores(scores))
    }
}
