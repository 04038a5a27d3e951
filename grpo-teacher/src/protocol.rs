//! The two passes: the student's diagnostic probe, the teacher's guidance, and the student's
//! answers with and without the teaching (the baseline computed once per problem).

use std::collections::HashMap;
use std::path::Path;
use std::sync::Mutex;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device};
use grpo_rewards::builtin::LanguageScorer;
use grpo_rollout::scoring::ModelScorer;
use grpo_rollout::{ChatMessage, Completion, FinishReason, SamplingParams, Tokenizer, Transformer};
use serde::{Deserialize, Serialize};

use crate::config::{TeacherConfig, TemplateKind, Templates};
use crate::error::{Result, TeacherError};
use crate::reward::{extract_solution, extract_teaching};

/// A token of the probe whose probability under the student is below this marks a gap.
pub const GAP_PROBABILITY: f32 = 0.2;
/// At most this many gaps are reported.
pub const MAX_GAPS: usize = 5;

/// A model taking part in the protocol (the student, or the teacher outside the trainer):
/// detached weights, its tokenizer, and whether prompts go through its chat template.
#[derive(Debug, Clone)]
pub struct LocalModel {
    /// Detached weights (no autograd graph).
    pub model: Transformer,
    /// Its tokenizer and chat template.
    pub tokenizer: Tokenizer,
    /// Wrap prompts as one user turn in the chat template (when the model has one).
    pub chat_template: bool,
}

impl LocalModel {
    /// A detached copy of `model` with its tokenizer.
    pub fn new(model: &Transformer, tokenizer: Tokenizer, chat_template: bool) -> Self {
        Self {
            model: model.detached(),
            tokenizer,
            chat_template,
        }
    }

    /// Loads a Hugging Face directory or a `.gguf` file.
    pub fn load(path: &Path, dtype: DType, device: &Device, chat_template: bool) -> Result<Self> {
        let m = grpo_rollout::load(path, dtype, device).map_err(|e| TeacherError::Model {
            role: "student",
            message: format!("{}: {e}", path.display()),
        })?;
        Ok(Self::new(&m.model, m.tokenizer, chat_template))
    }

    /// The prompt text and ids for one user message: through the chat template (with the
    /// generation prompt) when enabled and present, else the plain text with special tokens.
    pub fn prompt(&self, user_text: &str) -> candle_core::Result<(String, Vec<u32>)> {
        if self.chat_template && self.tokenizer.chat_template.is_some() {
            let text = self
                .tokenizer
                .apply_chat_template(&[ChatMessage::new("user", user_text)], true)?;
            let ids = self.tokenizer.encode(&text, false)?;
            Ok((text, ids))
        } else {
            let ids = self.tokenizer.encode(user_text, true)?;
            Ok((user_text.to_owned(), ids))
        }
    }

    /// One completion per prompt (user texts), batched.
    pub fn answer(
        &self,
        user_texts: &[String],
        max_new_tokens: usize,
        temperature: f64,
        seed: u64,
    ) -> candle_core::Result<Vec<Completion>> {
        let ids = user_texts
            .iter()
            .map(|t| self.prompt(t).map(|(_, ids)| ids))
            .collect::<candle_core::Result<Vec<_>>>()?;
        let params = SamplingParams {
            max_new_tokens,
            temperature,
            seed,
            ..SamplingParams::default()
        };
        grpo_rollout::generate(&self.model, &self.tokenizer, &ids, 1, &params)
    }
}

/// How complete the probe was.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ResponseQuality {
    /// The student wrote nothing.
    Empty,
    /// The probe hit `max_tokens`.
    Truncated,
    /// The student ended the probe itself.
    Complete,
}

/// What the diagnostic probe found out about the student on one task.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DiagnosticResult {
    /// How able the student is on this task, in [0, 1]. With a reference answer: the
    /// student's per-token (geometric-mean) probability of that answer as its solution,
    /// `exp(−NLL)` of the answer after the baseline prompt and `<solution>`. Without one: the
    /// `confidence_score`.
    pub capability_level: f32,
    /// How sure the student was of its own probe, in [0, 1]: `exp(mean log-prob)` of the probe's
    /// tokens under the student (1 for an empty probe).
    pub confidence_score: f32,
    /// The stretches of the probe the student was least sure of: runs of tokens whose
    /// probability was below [`GAP_PROBABILITY`], as text (at most [`MAX_GAPS`]).
    pub identified_gaps: Vec<String>,
    /// Empty, truncated or complete.
    pub response_quality: ResponseQuality,
    /// Tokens in the probe.
    pub probe_tokens: usize,
    /// The probe's text (the `approach` the teacher sees).
    pub probe: String,
}

/// The guidance style for a capability level: below 0.3 a step-by-step walkthrough; 0.3 to
/// 0.7 hints and scaffolding; 0.7 and above minimal guidance or verification.
pub fn guidance_style(capability: f32) -> &'static str {
    if capability < 0.3 {
        "a step-by-step walkthrough of the method"
    } else if capability < 0.7 {
        "hints and scaffolding, without solving it for them"
    } else {
        "minimal guidance: confirm or correct their approach"
    }
}

/// One answer of the student.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudentAnswer {
    /// The full response.
    pub response: String,
    /// The extracted `<solution>` (empty when missing).
    pub solution: String,
    /// Tokens generated.
    pub tokens: usize,
}

impl StudentAnswer {
    fn of(c: &Completion) -> Self {
        Self {
            solution: extract_solution(&c.text),
            response: c.text.clone(),
            tokens: c.token_ids.len(),
        }
    }
}

/// The student's two answers for one teaching.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StudentPass {
    /// With the teaching.
    pub with_teaching: StudentAnswer,
    /// Without (the problem's baseline).
    pub baseline: StudentAnswer,
}

/// The protocol: templates, the student, an optional teacher (for [`Self::generate_guidance`]),
/// and the per-problem baseline cache.
///
/// In the trainer the teacher is the policy being trained and generates in the generator
/// stage; this type then supplies the probes and prompts ([`Self::probe_batch`],
/// [`Self::teacher_prompt`]) and the student passes ([`Self::student_passes`]).
pub struct TeachingProtocol {
    cfg: TeacherConfig,
    templates: Templates,
    student: LocalModel,
    scorer: ModelScorer,
    teacher: Option<LocalModel>,
    baselines: Mutex<HashMap<String, StudentAnswer>>,
    baseline_runs: AtomicUsize,
}

impl std::fmt::Debug for TeachingProtocol {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TeachingProtocol")
            .field("cfg", &self.cfg)
            .field("teacher", &self.teacher.is_some())
            .finish_non_exhaustive()
    }
}

fn model_err(role: &'static str) -> impl Fn(candle_core::Error) -> TeacherError {
    move |e| TeacherError::Model {
        role,
        message: e.to_string(),
    }
}

impl TeachingProtocol {
    /// Checks `cfg` (templates included) and sets up the student.
    pub fn new(cfg: TeacherConfig, student: LocalModel) -> Result<Self> {
        let templates = cfg.validate()?;
        let scorer = ModelScorer::new(&student.model, student.tokenizer.clone());
        Ok(Self {
            cfg,
            templates,
            scorer,
            student,
            teacher: None,
            baselines: Mutex::new(HashMap::new()),
            baseline_runs: AtomicUsize::new(0),
        })
    }

    /// Adds a teacher for [`Self::generate_guidance`].
    pub fn with_teacher(mut self, teacher: LocalModel) -> Self {
        self.teacher = Some(teacher);
        self
    }

    /// The configuration.
    pub fn config(&self) -> &TeacherConfig {
        &self.cfg
    }

    /// The student.
    pub fn student(&self) -> &LocalModel {
        &self.student
    }

    /// Renders one of the four templates.
    pub fn render(&self, kind: TemplateKind, vars: &[(&str, &str)]) -> Result<String> {
        self.templates.render(kind, vars)
    }

    /// The student writes a diagnostic probe of at most `max_tokens` tokens on `task`
    /// (greedy). Errors: an empty task, `max_tokens < 1`.
    pub fn diagnostic_probe(&self, task: &str, max_tokens: usize) -> Result<DiagnosticResult> {
        self.diagnostic_probe_with_reference(task, None, max_tokens)
    }

    /// [`Self::diagnostic_probe`], with the task's reference answer for `capability_level`.
    pub fn diagnostic_probe_with_reference(
        &self,
        task: &str,
        reference: Option<&str>,
        max_tokens: usize,
    ) -> Result<DiagnosticResult> {
        let mut v = self.probe_batch(&[(task, reference)], max_tokens, 0)?;
        v.pop()
            .ok_or_else(|| TeacherError::Missing("the probe produced nothing".into()))
    }

    /// Probes many tasks at once (`(task, reference answer)` pairs), seeded.
    pub fn probe_batch(
        &self,
        tasks: &[(&str, Option<&str>)],
        max_tokens: usize,
        seed: u64,
    ) -> Result<Vec<DiagnosticResult>> {
        const CALL: &str = "diagnostic_probe";
        if max_tokens < 1 {
            return Err(TeacherError::MaxTokens {
                call: CALL,
                min: 1,
                got: max_tokens,
            });
        }
        if tasks.iter().any(|(t, _)| t.trim().is_empty()) {
            return Err(TeacherError::EmptyTask { call: CALL });
        }
        let prompts = tasks
            .iter()
            .map(|(t, _)| self.render(TemplateKind::Diagnostic, &[("question", t)]))
            .collect::<Result<Vec<_>>>()?;
        let probes = self
            .student
            .answer(&prompts, max_tokens, self.cfg.student_temperature, seed)
            .map_err(model_err("student"))?;
        // Capability: the student's probability of the reference answer as its solution.
        let mut pairs = Vec::new();
        let mut which = Vec::new();
        for (i, (t, r)) in tasks.iter().enumerate() {
            if let Some(r) = r.filter(|r| !r.trim().is_empty()) {
                let user = self.render(TemplateKind::Baseline, &[("question", t)])?;
                let (text, _) = self.student.prompt(&user).map_err(model_err("student"))?;
                pairs.push((format!("{text}<solution>"), r.trim().to_owned()));
                which.push(i);
            }
        }
        let refs: Vec<(&str, &str)> = pairs
            .iter()
            .map(|(p, c)| (p.as_str(), c.as_str()))
            .collect();
        let nll = self
            .scorer
            .completion_nll_batch(&refs)
            .map_err(|e| TeacherError::Model {
                role: "student",
                message: e.to_string(),
            })?;
        let mut capability: Vec<Option<f32>> = vec![None; tasks.len()];
        for (i, n) in which.into_iter().zip(nll) {
            capability[i] = n.map(|n| (-n).exp().clamp(0.0, 1.0));
        }
        probes
            .iter()
            .zip(capability)
            .map(|(c, cap)| {
                let confidence = if c.logprobs.is_empty() {
                    1.0
                } else {
                    let mean = c.logprobs.iter().map(|&l| f64::from(l)).sum::<f64>()
                        / c.logprobs.len() as f64;
                    mean.exp().clamp(0.0, 1.0) as f32
                };
                let gaps = self.gaps(c)?;
                let quality = if c.text.trim().is_empty() {
                    ResponseQuality::Empty
                } else if c.finish_reason == FinishReason::Length {
                    ResponseQuality::Truncated
                } else {
                    ResponseQuality::Complete
                };
                Ok(DiagnosticResult {
                    capability_level: cap.unwrap_or(confidence),
                    confidence_score: confidence,
                    identified_gaps: gaps,
                    response_quality: quality,
                    probe_tokens: c.token_ids.len(),
                    probe: c.text.trim().to_owned(),
                })
            })
            .collect()
    }

    fn gaps(&self, c: &Completion) -> Result<Vec<String>> {
        let threshold = GAP_PROBABILITY.ln();
        let mut gaps = Vec::new();
        let mut run: Vec<u32> = Vec::new();
        let n = c.logprobs.len().min(c.token_ids.len());
        for i in 0..=n {
            let low = i < n && c.logprobs[i] < threshold;
            if low {
                run.push(c.token_ids[i]);
            } else if !run.is_empty() {
                let text = self
                    .student
                    .tokenizer
                    .decode(&run, true)
                    .map_err(model_err("student"))?;
                let text = text.trim();
                if !text.is_empty() && gaps.len() < MAX_GAPS {
                    gaps.push(text.to_owned());
                }
                run.clear();
            }
        }
        Ok(gaps)
    }

    /// The teacher's prompt (the user message) for `task` after its probe.
    pub fn teacher_prompt(&self, task: &str, d: &DiagnosticResult) -> Result<String> {
        let capability = format!("{:.2}", d.capability_level);
        self.render(
            TemplateKind::Teacher,
            &[
                ("question", task),
                ("approach", &d.probe),
                ("capability", &capability),
                ("style", guidance_style(d.capability_level)),
            ],
        )
    }

    /// The teacher (given with [`Self::with_teacher`]) writes guidance of at most
    /// `max_tokens` tokens for `task` in the style the diagnostic calls for (greedy); returns
    /// the `<teaching>` part. Errors: an empty task, `max_tokens < 10`, no teacher.
    pub fn generate_guidance(
        &self,
        task: &str,
        diagnostic: &DiagnosticResult,
        max_tokens: usize,
    ) -> Result<String> {
        const CALL: &str = "generate_guidance";
        if task.trim().is_empty() {
            return Err(TeacherError::EmptyTask { call: CALL });
        }
        if max_tokens < 10 {
            return Err(TeacherError::MaxTokens {
                call: CALL,
                min: 10,
                got: max_tokens,
            });
        }
        let teacher = self.teacher.as_ref().ok_or_else(|| {
            TeacherError::Missing(
                "generate_guidance: no teacher model (TeachingProtocol::with_teacher)".into(),
            )
        })?;
        let prompt = self.teacher_prompt(task, diagnostic)?;
        let out = teacher
            .answer(&[prompt], max_tokens, 0.0, 0)
            .map_err(model_err("teacher"))?;
        Ok(out
            .first()
            .map(|c| extract_teaching(&c.text).to_owned())
            .unwrap_or_default())
    }

    /// The student answers each `(task, teaching)` with the teaching, and each distinct task
    /// without it — the baseline, computed once per task over the protocol's life and cached.
    /// All generations of a call run as one batch.
    pub fn student_passes(&self, items: &[(&str, &str)], seed: u64) -> Result<Vec<StudentPass>> {
        let mut prompts = Vec::with_capacity(items.len());
        for (task, teaching) in items {
            prompts.push(self.render(
                TemplateKind::WithTeaching,
                &[("question", task), ("teaching", teaching)],
            )?);
        }
        let mut missing: Vec<&str> = Vec::new();
        {
            let cache = self.baselines.lock().map_err(|_| {
                TeacherError::Missing("the baseline cache was poisoned by a panic".into())
            })?;
            for (task, _) in items {
                if !cache.contains_key(*task) && !missing.contains(task) {
                    missing.push(task);
                }
            }
        }
        for task in &missing {
            prompts.push(self.render(TemplateKind::Baseline, &[("question", task)])?);
        }
        let out = self
            .student
            .answer(
                &prompts,
                self.cfg.max_student_tokens,
                self.cfg.student_temperature,
                seed,
            )
            .map_err(model_err("student"))?;
        let mut cache = self.baselines.lock().map_err(|_| {
            TeacherError::Missing("the baseline cache was poisoned by a panic".into())
        })?;
        for (task, c) in missing.iter().zip(&out[items.len()..]) {
            cache.insert((*task).to_owned(), StudentAnswer::of(c));
            self.baseline_runs.fetch_add(1, Ordering::Relaxed);
        }
        items
            .iter()
            .zip(&out)
            .map(|((task, _), c)| {
                let baseline = cache.get(*task).cloned().ok_or_else(|| {
                    TeacherError::Missing(format!("no baseline for task {task:?}"))
                })?;
                Ok(StudentPass {
                    with_teaching: StudentAnswer::of(c),
                    baseline,
                })
            })
            .collect()
    }

    /// How many baselines the student has generated (one per distinct task).
    pub fn baseline_runs(&self) -> usize {
        self.baseline_runs.load(Ordering::Relaxed)
    }
}
