//! AdaptiveTeachingReward: how much a teaching helped the student, with a penalty for harm and
//! a bonus for brevity; plus solution extraction and exact-match correctness.

use std::collections::{BTreeMap, HashMap};
use std::sync::{Arc, OnceLock};

use grpo_rewards::{AsyncReward, BoxFuture, RewardInput, RewardOutput, RewardSet};
use regex::Regex;
use serde_json::{Value, json};

/// The field of a [`RewardInput`] holding the student's full answer *with* the teaching.
pub const FIELD_STUDENT_RESPONSE: &str = "student_response";
/// The field holding the student's full answer *without* teaching (the baseline).
pub const FIELD_BASELINE_RESPONSE: &str = "baseline_response";
/// The field holding the number of tokens of the teaching (the `<teaching>` part).
pub const FIELD_TEACHING_TOKENS: &str = "teaching_tokens";
/// The field holding the problem text (the question the student answers).
pub const FIELD_QUESTION: &str = "question";

fn solution_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"(?s)<solution>(.*?)</solution>").expect("valid regex"))
}

fn teaching_re() -> &'static Regex {
    static RE: OnceLock<Regex> = OnceLock::new();
    RE.get_or_init(|| Regex::new(r"(?s)<teaching>(.*?)</teaching>").expect("valid regex"))
}

/// The answer inside the last `<solution>…</solution>` pair, trimmed; the empty string when
/// there is no complete pair.
///
/// ```
/// use grpo_teacher::extract_solution;
/// assert_eq!(extract_solution("so <solution> 42 </solution>"), "42");
/// assert_eq!(extract_solution("<solution>1</solution> no, <solution>2</solution>"), "2");
/// assert_eq!(extract_solution("the answer is 42"), "");
/// ```
pub fn extract_solution(text: &str) -> String {
    solution_re()
        .captures_iter(text)
        .last()
        .and_then(|c| c.get(1))
        .map(|m| m.as_str().trim().to_owned())
        .unwrap_or_default()
}

/// The teaching inside the first `<teaching>…</teaching>` pair, or the whole completion
/// (trimmed) when the teacher did not use the tags.
pub fn extract_teaching(text: &str) -> &str {
    teaching_re()
        .captures(text)
        .and_then(|c| c.get(1))
        .map_or(text, |m| m.as_str())
        .trim()
}

/// Case-insensitive exact match of an extracted solution with the ground truth (both
/// trimmed). An empty solution never matches.
pub fn exact_match(solution: &str, truth: &str) -> bool {
    let s = solution.trim();
    !s.is_empty() && s.to_lowercase() == truth.trim().to_lowercase()
}

/// The reward's two constants.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TeachingRewardParams {
    /// Penalty factor for degradation (default 2).
    pub degradation_penalty_multiplier: f32,
    /// Weight of the brevity bonus (default 1).
    pub efficiency_weight: f32,
}

impl Default for TeachingRewardParams {
    fn default() -> Self {
        Self {
            degradation_penalty_multiplier: 2.0,
            efficiency_weight: 1.0,
        }
    }
}

impl TeachingRewardParams {
    /// The reward of one teaching: `delta = with − without`;
    /// `delta < 0` → `−m·|delta|`; otherwise `delta·(1 + w·100/(100 + teaching_tokens))`.
    ///
    /// ```
    /// use grpo_teacher::TeachingRewardParams;
    /// let p = TeachingRewardParams::default();
    /// assert_eq!(p.reward(1.0, 0.0, 0), 2.0); // helped, with the full brevity bonus
    /// assert_eq!(p.reward(1.0, 0.0, 100), 1.5);
    /// assert_eq!(p.reward(0.0, 1.0, 10), -2.0); // harmed
    /// assert_eq!(p.reward(1.0, 1.0, 10), 0.0); // no change
    /// ```
    pub fn reward(&self, with: f32, without: f32, teaching_tokens: usize) -> f32 {
        let delta = with - without;
        if delta < 0.0 {
            -self.degradation_penalty_multiplier * delta.abs()
        } else {
            delta * (1.0 + self.efficiency_weight * efficiency_bonus(teaching_tokens))
        }
    }
}

/// `100 / (100 + teaching_tokens)`: 1 for an empty teaching, halving at 100 tokens; always in
/// (0, 1].
pub fn efficiency_bonus(teaching_tokens: usize) -> f32 {
    (100.0 / (100.0 + teaching_tokens as f64)) as f32
}

/// How the student's answers are judged correct.
#[derive(Clone)]
pub enum Correctness {
    /// [`exact_match`] of the extracted solution against this field (1 or 0); no opinion when a
    /// sample lacks the field.
    ExactMatch {
        /// The ground-truth column.
        answer_field: String,
    },
    /// Any grpo-rewards rewards (an accuracy reward, a RIM-style judge ensemble...), scoring
    /// each student answer as a completion of the question; the combined value is the
    /// correctness.
    Rewards(Arc<RewardSet>),
}

impl std::fmt::Debug for Correctness {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Correctness::ExactMatch { answer_field } => {
                write!(f, "ExactMatch({answer_field})")
            }
            Correctness::Rewards(set) => write!(f, "Rewards({set:?})"),
        }
    }
}

/// ATLAS's AdaptiveTeachingReward as a grpo-rewards [`AsyncReward`].
///
/// Each input is one teaching (the completion); its fields carry the student's answers with
/// ([`FIELD_STUDENT_RESPONSE`]) and without ([`FIELD_BASELINE_RESPONSE`]) the teaching, the
/// teaching's length ([`FIELD_TEACHING_TOKENS`]) and the sample's columns (the ground truth).
/// The score is [`TeachingRewardParams::reward`] of the two correctness values; `None` when
/// correctness cannot be decided (no ground truth, judges without an answer).
///
/// Info per teaching: `with_teaching`, `baseline`, `delta`, `teaching_tokens`, and with judge
/// ensembles `rim_rewards` / `rim_explanations` (per judge, for the answer with teaching).
/// Counters (means over the batch): `teacher/with_teaching_accuracy`,
/// `teacher/baseline_accuracy`, `teacher/degradation_rate`, `teacher/mean_teaching_tokens`.
#[derive(Debug, Clone)]
pub struct AdaptiveTeachingReward {
    /// The constants.
    pub params: TeachingRewardParams,
    /// The correctness signal.
    pub correctness: Correctness,
}

impl AdaptiveTeachingReward {
    /// Exact match against `answer_field`.
    pub fn exact_match(params: TeachingRewardParams, answer_field: impl Into<String>) -> Self {
        Self {
            params,
            correctness: Correctness::ExactMatch {
                answer_field: answer_field.into(),
            },
        }
    }

    /// Scores a batch of teachings (see the type's docs).
    pub async fn score_batch(&self, batch: &[RewardInput]) -> grpo_rewards::Result<RewardOutput> {
        let text = |x: &RewardInput, f: &str| {
            x.field(f)
                .and_then(grpo_rewards::FieldValue::as_text)
                .unwrap_or_default()
        };
        let with: Vec<String> = batch
            .iter()
            .map(|x| text(x, FIELD_STUDENT_RESPONSE))
            .collect();
        let without: Vec<String> = batch
            .iter()
            .map(|x| text(x, FIELD_BASELINE_RESPONSE))
            .collect();
        let (with_c, without_c, with_info, counters) = match &self.correctness {
            Correctness::ExactMatch { answer_field } => {
                let judge = |responses: &[String]| -> Vec<Option<f32>> {
                    batch
                        .iter()
                        .zip(responses)
                        .map(|(x, r)| {
                            let truth = x.field(answer_field)?.as_text()?;
                            Some(f32::from(u8::from(exact_match(
                                &extract_solution(r),
                                &truth,
                            ))))
                        })
                        .collect()
                };
                (
                    judge(&with),
                    judge(&without),
                    vec![None; batch.len()],
                    BTreeMap::new(),
                )
            }
            Correctness::Rewards(set) => {
                let inputs = |responses: &[String]| -> Vec<RewardInput> {
                    batch
                        .iter()
                        .zip(responses)
                        .map(|(x, r)| {
                            let mut y = x.clone();
                            y.prompt = text(x, FIELD_QUESTION);
                            y.prompt_messages = None;
                            y.completion = r.clone();
                            y.completion_tokens = 0;
                            y
                        })
                        .collect()
                };
                let scored_with = set.score_async(&inputs(&with)).await?;
                // The baseline is the same for every teaching of a problem: score each once.
                let mut unique: HashMap<(String, String), usize> = HashMap::new();
                let mut firsts = Vec::new();
                let slot: Vec<usize> = batch
                    .iter()
                    .zip(&without)
                    .enumerate()
                    .map(|(i, (x, r))| {
                        let n = unique.len();
                        *unique
                            .entry((text(x, FIELD_QUESTION), r.clone()))
                            .or_insert_with(|| {
                                firsts.push(i);
                                n
                            })
                    })
                    .collect();
                let base_inputs: Vec<RewardInput> = inputs(&without)
                    .into_iter()
                    .enumerate()
                    .filter(|(i, _)| firsts.contains(i))
                    .map(|(_, x)| x)
                    .collect();
                let scored_without = set.score_async(&base_inputs).await?;
                let value = |v: f32| (!v.is_nan()).then_some(v);
                let with_c = scored_with.rewards.iter().map(|&v| value(v)).collect();
                let without_c = slot
                    .iter()
                    .map(|&k| scored_without.rewards.get(k).copied().and_then(value))
                    .collect();
                let info = (0..batch.len())
                    .map(|i| rim_info(&scored_with.names, &scored_with.info, i))
                    .collect();
                let mut counters = BTreeMap::new();
                for m in [&scored_with.metrics, &scored_without.metrics] {
                    for (k, v) in m.iter().filter(|(k, _)| k.starts_with("judge/")) {
                        *counters.entry(k.clone()).or_insert(0.0) += v;
                    }
                }
                (with_c, without_c, info, counters)
            }
        };
        let mut out = RewardOutput {
            counters,
            ..Default::default()
        };
        let (mut n_with, mut sum_with, mut n_base, mut sum_base) = (0usize, 0f64, 0usize, 0f64);
        let (mut n_delta, mut degraded, mut tokens) = (0usize, 0usize, 0f64);
        for (i, x) in batch.iter().enumerate() {
            let t = match x.field(FIELD_TEACHING_TOKENS) {
                Some(grpo_rewards::FieldValue::Int(n)) => (*n).max(0) as usize,
                Some(grpo_rewards::FieldValue::Float(f)) => f.max(0.0) as usize,
                _ => x.completion_tokens,
            };
            tokens += t as f64;
            let (w, b) = (with_c[i], without_c[i]);
            if let Some(w) = w {
                n_with += 1;
                sum_with += f64::from(w);
            }
            if let Some(b) = b {
                n_base += 1;
                sum_base += f64::from(b);
            }
            let score = match (w, b) {
                (Some(w), Some(b)) => {
                    n_delta += 1;
                    if w < b {
                        degraded += 1;
                    }
                    Some(self.params.reward(w, b, t))
                }
                _ => None,
            };
            let mut info = json!({
                "with_teaching": w,
                "baseline": b,
                "delta": w.zip(b).map(|(w, b)| w - b),
                "teaching_tokens": t,
            });
            if let (Some(Value::Object(extra)), Value::Object(m)) = (&with_info[i], &mut info) {
                m.extend(extra.clone());
            }
            out.scores.push(score);
            out.info.push(Some(info));
        }
        let mean = |s: f64, n: usize| if n == 0 { f64::NAN } else { s / n as f64 };
        out.counters.insert(
            "teacher/with_teaching_accuracy".into(),
            mean(sum_with, n_with),
        );
        out.counters
            .insert("teacher/baseline_accuracy".into(), mean(sum_base, n_base));
        out.counters.insert(
            "teacher/degradation_rate".into(),
            mean(degraded as f64, n_delta),
        );
        out.counters.insert(
            "teacher/mean_teaching_tokens".into(),
            mean(tokens, batch.len()),
        );
        Ok(out)
    }
}

/// Per-judge scores and explanations (`rim_rewards`, `rim_explanations`) from the info of
/// judge ensembles (`{"judges": {name: {score, explanation}}, "strong": {...}}`) and single
/// judges (`{score, explanation}`, named by the reward), for completion `i`.
fn rim_info(names: &[String], info: &[Vec<Option<Value>>], i: usize) -> Option<Value> {
    let mut rewards = serde_json::Map::new();
    let mut explanations = serde_json::Map::new();
    let mut add = |name: &str, v: &Value| {
        if let Some(s) = v.get("score") {
            rewards.insert(name.to_owned(), s.clone());
        }
        if let Some(e) = v.get("explanation") {
            explanations.insert(name.to_owned(), e.clone());
        }
    };
    for (k, per_fn) in info.iter().enumerate() {
        let Some(Some(v)) = per_fn.get(i) else {
            continue;
        };
        if let Some(Value::Object(judges)) = v.get("judges") {
            for (name, verdict) in judges {
                add(name, verdict);
            }
            if let Some(strong) = v.get("strong") {
                add("strong", strong);
            }
        } else if v.get("score").is_some() {
            add(names.get(k).map_or("reward", String::as_str), v);
        }
    }
    (!rewards.is_empty()).then(|| {
        json!({
            "rim_rewards": Value::Object(rewards),
            "rim_explanations": Value::Object(explanations),
        })
    })
}

impl AsyncReward for AdaptiveTeachingReward {
    fn score_async<'a>(
        &'a self,
        batch: &'a [RewardInput],
    ) -> BoxFuture<'a, grpo_rewards::Result<RewardOutput>> {
        Box::pin(self.score_batch(batch))
    }
}
