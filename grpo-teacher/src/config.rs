//! `[teacher]`: the protocol's knobs (ATLAS's names) and its four prompt templates.

use std::path::PathBuf;

use grpo_rewards::RewardSpec;
use serde::{Deserialize, Serialize};

use crate::error::{Result, TeacherError};

/// The student's diagnostic prompt. Variables: `question`.
pub const DEFAULT_DIAGNOSTIC_TEMPLATE: &str = "Question: {{ question }}\n\nBefore solving, briefly describe what kind of problem this is, the steps it needs, and where you might go wrong. Your approach (be concise):";

/// The teacher's prompt. Variables: `question`, `approach` (the student's probe),
/// `capability` (0–1, two decimals), `style` (the guidance style chosen from the capability).
pub const DEFAULT_TEACHER_TEMPLATE: &str = "Question: {{ question }}\n\nA student's approach: {{ approach }}\n\nThe student's estimated capability is {{ capability }}, so give {{ style }}. Write your guidance inside <teaching></teaching> tags and do not state the final answer.";

/// The student's prompt with the teaching. Variables: `question`, `teaching`.
pub const DEFAULT_WITH_TEACHING_TEMPLATE: &str = "Question: {{ question }}\n\nA teacher's guidance:\n{{ teaching }}\n\nSolve the problem. Give your final answer inside <solution></solution> tags.";

/// The student's prompt without teaching (the baseline). Variables: `question`.
pub const DEFAULT_BASELINE_TEMPLATE: &str = "Question: {{ question }}\n\nSolve the problem. Give your final answer inside <solution></solution> tags.";

/// The protocol's configuration (`[teacher]` in a training config).
///
/// Every key has a default; a config with only `[teacher]` runs the protocol with the
/// reference model as the student and exact-match correctness against `answer_field`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherConfig {
    /// The student: a Hugging Face directory or a `.gguf` file. Absent → the reference model
    /// (the policy as loaded, frozen).
    pub student_model: Option<PathBuf>,
    /// Where the `student_model` runs (`cpu`, `cuda`, `cuda:N`). Absent → the policy's
    /// `model.device`.
    pub student_device: Option<grpo_rollout::DeviceSpec>,
    /// The `student_model`'s dtype (`f32`, `bf16`, `f16`). Absent → the policy's.
    pub student_dtype: Option<grpo_rollout::Dtype>,
    /// The frozen reference model writes the teaching instead of the policy (the policy then
    /// learns from those completions off-policy, corrected by the importance weights of
    /// `loss.vllm_importance_sampling_correction`).
    pub use_reference_teacher_model: bool,
    /// Most tokens of the student's diagnostic probe (ATLAS's `max_probe_tokens`). Default 50.
    pub max_probe_tokens: usize,
    /// Most tokens of each student solution (with and without teaching). Default 128.
    pub max_student_tokens: usize,
    /// The student's sampling temperature; 0 (the default) = greedy, which makes the baseline
    /// a property of the problem (it is computed once per problem either way).
    pub student_temperature: f64,
    /// The column holding the ground truth for exact-match correctness. Default `answer`.
    pub answer_field: String,
    /// The student's diagnostic prompt (minijinja; `question`).
    pub student_diagnostic_template: String,
    /// The teacher's prompt (`question`, `approach`, `capability`, `style`).
    pub teacher_adaptive_template: String,
    /// The student's prompt with teaching (`question`, `teaching`).
    pub student_with_teaching_template: String,
    /// The student's prompt without teaching (`question`).
    pub student_baseline_template: String,
    /// Penalty factor when teaching makes the student worse: reward = −m·|delta|. Default 2.
    pub degradation_penalty_multiplier: f32,
    /// Weight of the brevity bonus `100 / (100 + teaching_tokens)`. Default 1.
    pub efficiency_weight: f32,
    /// Fraction of problems written to `teacher_log.jsonl` with probe, teachings, both student
    /// answers and rewards. Default 0.
    pub logging_prob: f64,
    /// Replaces exact match: any grpo-rewards reward (an `accuracy` reward, a
    /// `judge_ensemble` of RIM-style judges, ...) scores each student answer; its value is the
    /// correctness (usually in [0, 1]).
    pub correctness: Option<RewardSpec>,
}

impl Default for TeacherConfig {
    fn default() -> Self {
        Self {
            student_model: None,
            student_device: None,
            student_dtype: None,
            use_reference_teacher_model: false,
            max_probe_tokens: 50,
            max_student_tokens: 128,
            student_temperature: 0.0,
            answer_field: "answer".into(),
            student_diagnostic_template: DEFAULT_DIAGNOSTIC_TEMPLATE.into(),
            teacher_adaptive_template: DEFAULT_TEACHER_TEMPLATE.into(),
            student_with_teaching_template: DEFAULT_WITH_TEACHING_TEMPLATE.into(),
            student_baseline_template: DEFAULT_BASELINE_TEMPLATE.into(),
            degradation_penalty_multiplier: 2.0,
            efficiency_weight: 1.0,
            logging_prob: 0.0,
            correctness: None,
        }
    }
}

/// Which template, for errors and rendering.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum TemplateKind {
    /// `student_diagnostic_template`.
    Diagnostic,
    /// `teacher_adaptive_template`.
    Teacher,
    /// `student_with_teaching_template`.
    WithTeaching,
    /// `student_baseline_template`.
    Baseline,
}

impl TemplateKind {
    /// The config key.
    pub fn key(self) -> &'static str {
        match self {
            TemplateKind::Diagnostic => "student_diagnostic_template",
            TemplateKind::Teacher => "teacher_adaptive_template",
            TemplateKind::WithTeaching => "student_with_teaching_template",
            TemplateKind::Baseline => "student_baseline_template",
        }
    }

    /// The variables the template may use.
    pub fn variables(self) -> &'static [&'static str] {
        match self {
            TemplateKind::Diagnostic | TemplateKind::Baseline => &["question"],
            TemplateKind::Teacher => &["question", "approach", "capability", "style"],
            TemplateKind::WithTeaching => &["question", "teaching"],
        }
    }

    const ALL: [TemplateKind; 4] = [
        TemplateKind::Diagnostic,
        TemplateKind::Teacher,
        TemplateKind::WithTeaching,
        TemplateKind::Baseline,
    ];
}

/// The four templates, compiled and checked.
#[derive(Debug)]
pub struct Templates {
    env: minijinja::Environment<'static>,
}

impl Templates {
    /// Compiles the config's templates; a template that does not compile, or that uses a
    /// variable it is not given (a typo), is an error naming its key.
    pub fn new(cfg: &TeacherConfig) -> Result<Self> {
        let mut env = minijinja::Environment::new();
        env.set_undefined_behavior(minijinja::UndefinedBehavior::Strict);
        for kind in TemplateKind::ALL {
            let source = match kind {
                TemplateKind::Diagnostic => &cfg.student_diagnostic_template,
                TemplateKind::Teacher => &cfg.teacher_adaptive_template,
                TemplateKind::WithTeaching => &cfg.student_with_teaching_template,
                TemplateKind::Baseline => &cfg.student_baseline_template,
            };
            env.add_template_owned(kind.key(), source.clone())
                .map_err(|e| TeacherError::Template {
                    key: kind.key(),
                    message: e.to_string(),
                })?;
            let t = env
                .get_template(kind.key())
                .map_err(|e| TeacherError::Template {
                    key: kind.key(),
                    message: e.to_string(),
                })?;
            let mut unknown: Vec<String> = t
                .undeclared_variables(false)
                .into_iter()
                .filter(|v| !kind.variables().contains(&v.as_str()))
                .collect();
            unknown.sort();
            if !unknown.is_empty() {
                return Err(TeacherError::Template {
                    key: kind.key(),
                    message: format!(
                        "unknown variable(s) {}; this template gets {}",
                        unknown.join(", "),
                        kind.variables().join(", ")
                    ),
                });
            }
        }
        Ok(Self { env })
    }

    /// Renders `kind` with `vars` (name, value) pairs.
    pub fn render(&self, kind: TemplateKind, vars: &[(&str, &str)]) -> Result<String> {
        let ctx: std::collections::BTreeMap<String, String> = vars
            .iter()
            .map(|(k, v)| ((*k).to_owned(), (*v).to_owned()))
            .collect();
        self.env
            .get_template(kind.key())
            .and_then(|t| t.render(ctx))
            .map_err(|e| TeacherError::Template {
                key: kind.key(),
                message: e.to_string(),
            })
    }
}

impl TeacherConfig {
    /// Checks the values; the error names the key (prefixed `teacher.`).
    pub fn validate(&self) -> Result<Templates> {
        let bad = |key: &'static str, message: String| Err(TeacherError::Config { key, message });
        if self.max_probe_tokens < 1 {
            return bad("max_probe_tokens", "must be >= 1".into());
        }
        if self.max_student_tokens < 1 {
            return bad("max_student_tokens", "must be >= 1".into());
        }
        if !(self.student_temperature >= 0.0 && self.student_temperature.is_finite()) {
            return bad(
                "student_temperature",
                format!(
                    "must be >= 0 (0 = greedy), got {}",
                    self.student_temperature
                ),
            );
        }
        if !(0.0..=1.0).contains(&self.logging_prob) {
            return bad(
                "logging_prob",
                format!("must be in [0, 1], got {}", self.logging_prob),
            );
        }
        if !(self.degradation_penalty_multiplier >= 0.0
            && self.degradation_penalty_multiplier.is_finite())
        {
            return bad(
                "degradation_penalty_multiplier",
                "must be a finite number >= 0".into(),
            );
        }
        if !(self.efficiency_weight >= 0.0 && self.efficiency_weight.is_finite()) {
            return bad("efficiency_weight", "must be a finite number >= 0".into());
        }
        if self.correctness.is_none() && self.answer_field.trim().is_empty() {
            return bad("answer_field", "must name a column".into());
        }
        Templates::new(self)
    }
}
