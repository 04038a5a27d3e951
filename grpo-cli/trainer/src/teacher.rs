//! The glue of two-pass adaptive teaching (`[teacher]`, crate grpo-teacher): the policy is the
//! teacher. The generator has the student probe each problem first and prompts the policy
//! with the teacher prompt; the scorer has the student answer with each teaching and without,
//! and the `adaptive_teaching` reward scores the difference; `teacher_log.jsonl` keeps a sample
//! of it.

use std::io::Write;
use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use grpo_data::{Dataset, Prompt, Sample};
use grpo_rewards::{FieldValue, RewardInput, ScoredBatch};
use grpo_rollout::Tokenizer;
use grpo_teacher::{
    AdaptiveTeachingReward, Correctness, DiagnosticResult, TeachingProtocol, TeachingRewardParams,
};

use crate::stages::{PromptBatch, Rollouts, step_seed};

/// `answer_field` (which the data must have), or the `correctness` reward.
pub(crate) fn teaching_reward(
    t: &grpo_teacher::TeacherConfig,
    scoring: &grpo_rewards::ScoringModels,
    train: &Dataset,
) -> Result<AdaptiveTeachingReward> {
    let params = TeachingRewardParams {
        degradation_penalty_multiplier: t.degradation_penalty_multiplier,
        efficiency_weight: t.efficiency_weight,
    };
    Ok(match &t.correctness {
        None => {
            train
                .require_column(
                    &t.answer_field,
                    "`teacher.answer_field` (exact-match correctness)",
                )
                .map_err(|e| anyhow!("data: {e}"))?;
            AdaptiveTeachingReward::exact_match(params, &t.answer_field)
        }
        Some(spec) => {
            let set = grpo_rewards::RewardsConfig {
                rewards: vec![spec.clone()],
                reward_weights: None,
            }
            .build(scoring)
            .map_err(|e| anyhow!("config: teacher.correctness: {e}"))?;
            AdaptiveTeachingReward {
                params,
                correctness: Correctness::Rewards(Arc::new(set)),
            }
        }
    })
}

/// The student's diagnostic probes of a batch's problems.
pub fn probe(
    tp: &TeachingProtocol,
    batch: &PromptBatch,
    seed: u64,
) -> Result<Vec<(String, DiagnosticResult)>> {
    let field = &tp.config().answer_field;
    let questions: Vec<String> = batch.samples.iter().map(question_of).collect();
    let answers: Vec<Option<String>> = batch.samples.iter().map(|s| s.get_text(field)).collect();
    for (q, s) in questions.iter().zip(&batch.samples) {
        if q.trim().is_empty() {
            bail!("row {}: the problem text is empty", s.index);
        }
    }
    let tasks: Vec<(&str, Option<&str>)> = questions
        .iter()
        .zip(&answers)
        .map(|(q, a)| (q.as_str(), a.as_deref()))
        .collect();
    let diags = tp
        .probe_batch(
            &tasks,
            tp.config().max_probe_tokens,
            seed ^ 0x0070_726f_6265,
        )
        .map_err(|e| anyhow!("{e}"))?;
    Ok(questions.into_iter().zip(diags).collect())
}

/// The problem a teacher teaches: a plain prompt's text, or a conversation's last user turn.
pub fn question_of(s: &Sample) -> String {
    match &s.prompt {
        Prompt::Text(t) => t.clone(),
        Prompt::Conversation(m) => m
            .iter()
            .rev()
            .find(|m| m.role == "user")
            .map(|m| m.content.clone())
            .unwrap_or_else(|| s.prompt.text()),
    }
}

/// Has the student answer each completion's teaching and the problem alone (cached per
/// problem), and adds both answers to the reward inputs.
pub fn add_student_passes(
    tp: &TeachingProtocol,
    tokenizer: &Tokenizer,
    run_seed: u64,
    r: &Rollouts,
    inputs: &mut [RewardInput],
) -> Result<()> {
    let Some(t) = &r.teaching else {
        return Ok(());
    };
    use grpo_teacher::reward::{
        FIELD_BASELINE_RESPONSE, FIELD_QUESTION, FIELD_STUDENT_RESPONSE, FIELD_TEACHING_TOKENS,
    };
    let teachings: Vec<&str> = r
        .completions
        .iter()
        .map(|c| grpo_teacher::extract_teaching(&c.text))
        .collect();
    let items: Vec<(&str, &str)> = r
        .completions
        .iter()
        .zip(&teachings)
        .map(|(c, teaching)| (t[c.prompt_index].0.as_str(), *teaching))
        .collect();
    let seed = step_seed(run_seed, r.batch.draw as u64) ^ 0x0073_7475_6465_6e74;
    let passes = tp
        .student_passes(&items, seed)
        .map_err(|e| anyhow!("{e}"))?;
    for ((x, pass), (teaching, item)) in inputs
        .iter_mut()
        .zip(passes)
        .zip(teachings.iter().zip(&items))
    {
        let n = tokenizer.encode(teaching, false)?.len();
        x.fields.insert(FIELD_QUESTION.into(), item.0.into());
        x.fields
            .insert(FIELD_TEACHING_TOKENS.into(), FieldValue::Int(n as i64));
        x.fields.insert(
            FIELD_STUDENT_RESPONSE.into(),
            pass.with_teaching.response.into(),
        );
        x.fields.insert(
            FIELD_BASELINE_RESPONSE.into(),
            pass.baseline.response.into(),
        );
        x.fields.insert(
            "student_solution".into(),
            pass.with_teaching.solution.into(),
        );
        x.fields
            .insert("baseline_solution".into(), pass.baseline.solution.into());
    }
    Ok(())
}

/// `teacher_log.jsonl`: `logging_prob` of each step's problems, drawn by the run's seed.
#[derive(Debug, Clone)]
pub struct TeacherLog {
    /// The file.
    pub path: PathBuf,
    /// The fraction of problems written.
    pub prob: f64,
    /// The run's seed.
    pub seed: u64,
}

impl TeacherLog {
    /// The log of a `[teacher]` section with `logging_prob > 0`, in `output_dir`.
    pub fn of(cfg: &crate::config::TrainConfig) -> Option<Self> {
        let t = cfg.teacher.as_ref().filter(|t| t.logging_prob > 0.0)?;
        Some(Self {
            path: cfg.output_dir.join("teacher_log.jsonl"),
            prob: t.logging_prob,
            seed: cfg.train.seed,
        })
    }

    /// Writes `logging_prob` of the step's problems to `teacher_log.jsonl`: probe, each
    /// teaching with the student's answers and its reward (and judges' verdicts).
    pub fn write(&self, r: &Rollouts, inputs: &[RewardInput], sc: &ScoredBatch) -> Result<()> {
        let (path, prob) = (&self.path, &self.prob);
        let Some(t) = &r.teaching else {
            return Ok(());
        };
        let mut lines = String::new();
        for (p, (question, diag)) in t.iter().enumerate() {
            let u = grpo_data::rng::mix(
                self.seed,
                0x006c_6f67,
                (r.batch.draw as u64) << 20 | p as u64,
            );
            if (u >> 11) as f64 / (1u64 << 53) as f64 >= *prob {
                continue;
            }
            let field = |x: &RewardInput, k: &str| x.field(k).and_then(FieldValue::as_text);
            let mut teachings = Vec::new();
            let mut baseline = None;
            for (i, c) in r
                .completions
                .iter()
                .enumerate()
                .filter(|(_, c)| c.prompt_index == p)
            {
                let x = &inputs[i];
                baseline = baseline.or_else(|| field(x, "baseline_response"));
                let info: serde_json::Map<String, serde_json::Value> = sc
                    .names
                    .iter()
                    .zip(&sc.info)
                    .filter_map(|(n, inf)| inf[i].clone().map(|v| (n.clone(), v)))
                    .collect();
                teachings.push(serde_json::json!({
                    "teaching": c.text,
                    "student_response": field(x, "student_response"),
                    "student_solution": field(x, "student_solution"),
                    "reward": crate::events::finite(f64::from(sc.rewards[i])),
                    "info": info,
                }));
            }
            let line = serde_json::json!({
                "step": r.batch.step + 1,
                "question": question,
                "diagnostic": diag,
                "baseline_response": baseline,
                "teachings": teachings,
            });
            lines.push_str(&line.to_string());
            lines.push('\n');
        }
        if lines.is_empty() {
            return Ok(());
        }
        let mut f = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(path)
            .with_context(|| format!("{}: cannot open", path.display()))?;
        f.write_all(lines.as_bytes())
            .with_context(|| format!("{}: write failed", path.display()))
    }
}
