//! TRL's reward functions (`trl.rewards`) as built-ins: [`ThinkFormat`]
//! (`think_format_reward`), [`RepetitionPenalty`] (`get_repetition_penalty_reward`),
//! [`CosineScaled`] (`get_cosine_scaled_reward`) and [`ReasoningAccuracy`]
//! (`reasoning_accuracy_reward`). DAPO's `get_soft_overlong_punishment` is
//! [`Overlong`](super::Overlong).
//!
//! They read a completion as TRL does: its first message's content (`completion[0]["content"]`;
//! the text of a single-turn completion) and its token ids (`completion_ids`). Correctness is
//! decided as TRL decides it, by [`math_verify`](super::math_verify) ([`MathVerify`] is TRL's
//! `accuracy_reward` itself), or with `verifier = "accuracy"` by [`Accuracy`]'s comparison.

use serde::{Deserialize, Serialize};

use super::accuracy::{Accuracy, AccuracyConfig};
use super::math_verify;
use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// The text TRL's reward functions read: the completion's first message's content.
fn first_content(x: &RewardInput) -> &str {
    match x.completion_messages.as_deref() {
        Some([first, ..]) => &first.content,
        _ => &x.completion,
    }
}

/// Config of [`ThinkFormat`] (`type = "think_format"`): no keys.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ThinkFormatConfig {}

/// TRL's `think_format_reward`: 1 when the completion starts with `<think>`, holds no other
/// `<think>` and closes it with `</think>` (TRL's `^<think>(?!.*<think>)(.*?)</think>.*$`,
/// DOTALL), else 0.
#[derive(Debug, Clone, Default)]
pub struct ThinkFormat;

/// Whether `text` has TRL's think format.
pub fn think_format(text: &str) -> bool {
    text.strip_prefix("<think>")
        .is_some_and(|rest| !rest.contains("<think>") && rest.contains("</think>"))
}

impl Reward for ThinkFormat {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        Ok(RewardOutput::from_scores(
            batch
                .iter()
                .map(|x| Some(f32::from(u8::from(think_format(first_content(x))))))
                .collect(),
        ))
    }
}

/// Config of [`RepetitionPenalty`] (`type = "repetition_penalty"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RepetitionPenaltyConfig {
    /// Tokens per n-gram. Default 3.
    pub ngram_size: usize,
    /// The penalty of a wholly repetitive completion (≤ 0). Default −1.
    pub max_penalty: f64,
}

impl Default for RepetitionPenaltyConfig {
    fn default() -> Self {
        Self {
            ngram_size: 3,
            max_penalty: -1.0,
        }
    }
}

/// TRL's `get_repetition_penalty_reward`: `(1 − unique n-grams / n-grams) · max_penalty` over
/// the completion's token ids; 0 with fewer than `ngram_size` tokens or no repeated n-gram.
#[derive(Debug, Clone)]
pub struct RepetitionPenalty {
    config: RepetitionPenaltyConfig,
}

impl RepetitionPenalty {
    /// A validated repetition penalty; the error names the key.
    pub fn new(config: RepetitionPenaltyConfig) -> Result<Self> {
        if config.ngram_size == 0 {
            return Err(RewardError::config("ngram_size", "must be ≥ 1"));
        }
        if !(config.max_penalty.is_finite() && config.max_penalty <= 0.0) {
            return Err(RewardError::config(
                "max_penalty",
                format!("must be a finite number ≤ 0, got {}", config.max_penalty),
            ));
        }
        Ok(Self { config })
    }
}

/// The repetition penalty of `ids` ([`RepetitionPenalty`]).
pub fn repetition_penalty(ids: &[u32], ngram_size: usize, max_penalty: f64) -> f32 {
    if ngram_size == 0 || ids.len() < ngram_size {
        return 0.0;
    }
    let grams: Vec<&[u32]> = ids.windows(ngram_size).collect();
    let unique = grams.iter().collect::<std::collections::HashSet<_>>().len();
    let scaling = 1.0 - unique as f64 / grams.len() as f64;
    match scaling == 0.0 {
        true => 0.0,
        false => (scaling * max_penalty) as f32,
    }
}

impl Reward for RepetitionPenalty {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let c = &self.config;
        Ok(RewardOutput::from_scores(
            batch
                .iter()
                .map(|x| {
                    Some(repetition_penalty(
                        &x.completion_ids,
                        c.ngram_size,
                        c.max_penalty,
                    ))
                })
                .collect(),
        ))
    }
}

/// The [`Accuracy`] that decides correctness, from a config's accuracy keys.
/// How a completion's answer is judged against the reference (`verifier`).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Verifier {
    /// math_verify, as TRL (LaTeX answers only: `\boxed{}`, or after "answer"; equal values,
    /// equations, sets, intervals; `None` when the solution holds nothing to compare with).
    #[default]
    MathVerify,
    /// [`Accuracy`]'s comparison (tags, `\boxed{}`, else the last number; within
    /// `abs_tol`/`rel_tol`).
    Accuracy,
}

/// The correctness check behind TRL's rewards.
#[derive(Debug, Clone)]
enum Correctness {
    MathVerify { field: String, skip_missing: bool },
    Accuracy(Accuracy),
}

impl Correctness {
    fn new(
        verifier: Verifier,
        answer_field: &str,
        abs_tol: f64,
        rel_tol: f64,
        skip_missing: bool,
    ) -> Result<Self> {
        let accuracy = Accuracy::new(AccuracyConfig {
            answer_field: answer_field.to_owned(),
            abs_tol,
            rel_tol,
            skip_missing,
        })?;
        Ok(match verifier {
            Verifier::Accuracy => Correctness::Accuracy(accuracy),
            Verifier::MathVerify => Correctness::MathVerify {
                field: answer_field.to_owned(),
                skip_missing,
            },
        })
    }

    /// Whether `text` answers sample `i` correctly; `None` with no reference to compare with.
    fn correct(&self, i: usize, x: &RewardInput, text: &str, reward: &str) -> Result<Option<bool>> {
        match self {
            Correctness::Accuracy(a) => a.correct(i, x, text, reward),
            Correctness::MathVerify {
                field,
                skip_missing,
            } => Ok(reference(i, x, field, *skip_missing, reward)?
                .and_then(|solution| math_verify::math_verify(text, &solution))),
        }
    }
}

/// Sample `i`'s reference text; `None` when it has none and `skip_missing` is set.
fn reference(
    i: usize,
    x: &RewardInput,
    field: &str,
    skip_missing: bool,
    reward: &str,
) -> Result<Option<String>> {
    match x.field(field).and_then(|v| v.as_text()) {
        Some(t) => Ok(Some(t)),
        None if skip_missing => Ok(None),
        None => Err(RewardError::Sample {
            reward: reward.into(),
            index: i,
            message: format!("no field `{field}` (answer_field)"),
        }),
    }
}

/// Config of [`MathVerify`] (`type = "math_verify"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MathVerifyConfig {
    /// The column of the reference solution (TRL's `solution`). Default `"solution"`.
    #[serde(default = "solution")]
    pub answer_field: String,
    /// `None` for a row without the column instead of an error naming it.
    #[serde(default)]
    pub skip_missing: bool,
}

impl Default for MathVerifyConfig {
    fn default() -> Self {
        Self {
            answer_field: solution(),
            skip_missing: false,
        }
    }
}

/// TRL's `accuracy_reward`: 1 when math_verify finds the completion's answer equal to the
/// reference solution, 0 when not (or the completion states no LaTeX answer), `None` when
/// nothing can be read from the solution (TRL skips the row). The info of each completion
/// holds what was read on both sides (TRL's `gold_parsed` and `answer_parsed` columns).
#[derive(Debug, Clone)]
pub struct MathVerify {
    config: MathVerifyConfig,
}

impl MathVerify {
    /// A validated `math_verify` reward; the error names the key.
    pub fn new(config: MathVerifyConfig) -> Result<Self> {
        if config.answer_field.trim().is_empty() {
            return Err(RewardError::config("answer_field", "must not be empty"));
        }
        Ok(Self { config })
    }
}

impl Reward for MathVerify {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let mut out = RewardOutput::default();
        for (i, x) in batch.iter().enumerate() {
            let field = &self.config.answer_field;
            let Some(solution) = reference(i, x, field, self.config.skip_missing, "math_verify")?
            else {
                out.scores.push(None);
                out.info.push(None);
                continue;
            };
            let gold = math_verify::parse_solution(&solution);
            if gold.is_empty() {
                out.scores.push(None);
                out.info.push(Some(serde_json::json!({
                    "gold_parsed": "[unparseable]", "answer_parsed": "[skipped]",
                })));
                continue;
            }
            let answer = math_verify::parse_answer(first_content(x));
            let ok = math_verify::verify(&gold, &answer);
            out.scores.push(Some(f32::from(u8::from(ok))));
            out.info.push(Some(serde_json::json!({
                "gold_parsed": math_verify::describe(&gold),
                "answer_parsed": if answer.is_empty() { "[unparseable]".to_string() } else { math_verify::describe(&answer) },
            })));
        }
        Ok(out)
    }
}

fn solution() -> String {
    "solution".into()
}

fn tolerance() -> f64 {
    1e-6
}

/// Config of [`CosineScaled`] (`type = "cosine_scaled"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct CosineScaledConfig {
    /// `L_max`: the length (completion tokens) the schedule runs over. Required.
    pub max_len: usize,
    /// A wrong completion's reward at length 0. Default −1.
    #[serde(default = "minus_one")]
    pub min_value_wrong: f64,
    /// A wrong completion's reward at `max_len` and beyond. Default −0.5.
    #[serde(default = "minus_half")]
    pub max_value_wrong: f64,
    /// A correct completion's reward at `max_len` and beyond. Default 0.5.
    #[serde(default = "half")]
    pub min_value_correct: f64,
    /// A correct completion's reward at length 0. Default 1.
    #[serde(default = "plus_one")]
    pub max_value_correct: f64,
    /// The column of the reference answer (TRL's `solution`). Default `"solution"`.
    #[serde(default = "solution")]
    pub answer_field: String,
    /// How correctness is decided: `"math_verify"` (TRL's, the default) or `"accuracy"`.
    #[serde(default)]
    pub verifier: Verifier,
    /// As [`AccuracyConfig::abs_tol`] (with `verifier = "accuracy"`). Default 1e-6.
    #[serde(default = "tolerance")]
    pub abs_tol: f64,
    /// As [`AccuracyConfig::rel_tol`] (with `verifier = "accuracy"`). Default 1e-6.
    #[serde(default = "tolerance")]
    pub rel_tol: f64,
    /// As [`AccuracyConfig::skip_missing`]: `None` for a row without the column.
    #[serde(default)]
    pub skip_missing: bool,
}

fn minus_one() -> f64 {
    -1.0
}
fn minus_half() -> f64 {
    -0.5
}
fn half() -> f64 {
    0.5
}
fn plus_one() -> f64 {
    1.0
}

/// TRL's `get_cosine_scaled_reward` ("Demystifying Long Chain-of-Thought Reasoning", App.
/// C.1): with `p = min(len / max_len, 1)`, `lo + ½(hi − lo)(1 + cos πp)` where a correct
/// completion has `(lo, hi) = (min_value_correct, max_value_correct)` — shorter is better —
/// and a wrong one `(max_value_wrong, min_value_wrong)` — shorter is penalised more. `len` is
/// the completion's token count; correctness is math_verify's on the completion's first
/// message (TRL's `accuracy_reward`; a solution it cannot read scores `None`), or
/// [`Accuracy`]'s with `verifier = "accuracy"`.
#[derive(Debug, Clone)]
pub struct CosineScaled {
    config: CosineScaledConfig,
    accuracy: Correctness,
}

impl CosineScaled {
    /// A validated cosine-scaled reward; the error names the key.
    pub fn new(config: CosineScaledConfig) -> Result<Self> {
        if config.max_len == 0 {
            return Err(RewardError::config("max_len", "must be ≥ 1"));
        }
        for (k, v) in [
            ("min_value_wrong", config.min_value_wrong),
            ("max_value_wrong", config.max_value_wrong),
            ("min_value_correct", config.min_value_correct),
            ("max_value_correct", config.max_value_correct),
        ] {
            if !v.is_finite() {
                return Err(RewardError::config(k, format!("must be finite, got {v}")));
            }
        }
        let accuracy = Correctness::new(
            config.verifier,
            &config.answer_field,
            config.abs_tol,
            config.rel_tol,
            config.skip_missing,
        )?;
        Ok(Self { config, accuracy })
    }
}

/// The cosine schedule of [`CosineScaled`] for a completion of `len` tokens.
pub fn cosine_scaled(len: usize, correct: bool, c: &CosineScaledConfig) -> f32 {
    let progress = (len as f64 / c.max_len as f64).min(1.0);
    let cosine = (progress * std::f64::consts::PI).cos();
    let (lo, hi) = match correct {
        true => (c.min_value_correct, c.max_value_correct),
        false => (c.max_value_wrong, c.min_value_wrong),
    };
    (lo + 0.5 * (hi - lo) * (1.0 + cosine)) as f32
}

impl Reward for CosineScaled {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let mut scores = Vec::with_capacity(batch.len());
        for (i, x) in batch.iter().enumerate() {
            let correct = self
                .accuracy
                .correct(i, x, first_content(x), "cosine_scaled")?;
            scores.push(correct.map(|ok| cosine_scaled(x.completion_tokens, ok, &self.config)));
        }
        Ok(RewardOutput::from_scores(scores))
    }
}

/// Config of [`ReasoningAccuracy`] (`type = "reasoning_accuracy"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReasoningAccuracyConfig {
    /// Where reasoning ends; the first one the completion holds counts. Default
    /// `["</think>"]`.
    #[serde(default = "think_end")]
    pub reasoning_delimiters: Vec<String>,
    /// The column of the reference answer (TRL's `solution`). Default `"solution"`.
    #[serde(default = "solution")]
    pub answer_field: String,
    /// How correctness is decided: `"math_verify"` (TRL's, the default) or `"accuracy"`.
    #[serde(default)]
    pub verifier: Verifier,
    /// As [`AccuracyConfig::abs_tol`] (with `verifier = "accuracy"`). Default 1e-6.
    #[serde(default = "tolerance")]
    pub abs_tol: f64,
    /// As [`AccuracyConfig::rel_tol`] (with `verifier = "accuracy"`). Default 1e-6.
    #[serde(default = "tolerance")]
    pub rel_tol: f64,
    /// As [`AccuracyConfig::skip_missing`]: `None` for a row without the column.
    #[serde(default)]
    pub skip_missing: bool,
}

fn think_end() -> Vec<String> {
    vec!["</think>".into()]
}

/// TRL's `reasoning_accuracy_reward`: the answer is what follows the last occurrence of the
/// first delimiter (in `reasoning_delimiters` order) the completion holds; a completion with
/// none scores 0 (unfinished reasoning); else math_verify's verdict on that answer (or
/// [`Accuracy`]'s with `verifier = "accuracy"`).
#[derive(Debug, Clone)]
pub struct ReasoningAccuracy {
    delimiters: Vec<String>,
    accuracy: Correctness,
}

impl ReasoningAccuracy {
    /// A validated reasoning-accuracy reward; the error names the key.
    pub fn new(config: ReasoningAccuracyConfig) -> Result<Self> {
        if config.reasoning_delimiters.is_empty()
            || config.reasoning_delimiters.iter().any(String::is_empty)
        {
            return Err(RewardError::config(
                "reasoning_delimiters",
                "must hold at least one delimiter, none empty",
            ));
        }
        let accuracy = Correctness::new(
            config.verifier,
            &config.answer_field,
            config.abs_tol,
            config.rel_tol,
            config.skip_missing,
        )?;
        Ok(Self {
            delimiters: config.reasoning_delimiters,
            accuracy,
        })
    }
}

/// What follows the reasoning of `text`: after the last occurrence of the first of
/// `delimiters` it holds; `None` when it holds none.
pub fn after_reasoning<'a>(text: &'a str, delimiters: &[String]) -> Option<&'a str> {
    let d = delimiters.iter().find(|d| text.contains(d.as_str()))?;
    text.rfind(d.as_str()).map(|p| &text[p + d.len()..])
}

impl Reward for ReasoningAccuracy {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let mut scores = Vec::with_capacity(batch.len());
        for (i, x) in batch.iter().enumerate() {
            let score = match after_reasoning(first_content(x), &self.delimiters) {
                None => Some(0.0),
                Some(answer) => self
                    .accuracy
                    .correct(i, x, answer, "reasoning_accuracy")?
                    .map(|ok| f32::from(u8::from(ok))),
            };
            scores.push(score);
        }
        Ok(RewardOutput::from_scores(scores))
    }
}
