//! The GRPO trainer: the pipeline in one file.
//!
//! ```text
//! loader ──PromptBatch──▶ generator ──Rollouts──▶ scorer ──Scored──▶ learner
//! (grpo-data)            (grpo-rollout,          (grpo-rewards,      (grpo-core loss, backward,
//!                          policy version v)       advantages)         AdamW, checkpoints, metrics)
//!                            ▲                                          │
//!                            └────────── new weights, version v+1 ◀─────┘
//! ```
//!
//! Each stage is a plain struct with one `process` method. [`run`] wires them with
//! `crossbeam_channel::bounded` channels in `std::thread::scope` (the learner runs on the
//! calling thread); [`RunMode::Sequential`] calls the same methods in a plain loop, which is
//! how the tests check that the pipeline with `max_staleness = 0` computes exactly the
//! sequential algorithm. An error in any stage stops every stage (the channels close) and is
//! returned naming its stage.

use crate::first_line;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::{DType, Device, Tensor};
use crossbeam_channel::bounded;
use grpo_core::advantages::{group_advantages, reward_stds};
use grpo_core::loss::{LossInputs, LossType, policy_loss};
use grpo_data::{Dataset, Position, Prompt, Sample, SampleStream, StreamConfig};
use grpo_rewards::{FieldValue, Message, RewardInput, RewardSet, ScoredBatch};
use grpo_rollout::remote::RemoteGenerator;
use grpo_rollout::{ChatMessage, Completion, FinishReason, Tokenizer, TrainableModel, Transformer};
use grpo_teacher::{
    AdaptiveTeachingReward, Correctness, DiagnosticResult, LocalModel, TeachingProtocol,
    TeachingRewardParams,
};
use serde::{Deserialize, Serialize};

use crate::config::{self, Resolved, TrainConfig, parse_device};
use crate::optim::{AdamW, AdamWParams, Schedule, ScheduleKind, accumulate, clip_grad_norm};

/// Metrics of one step, by TRL's names.
pub type Metrics = BTreeMap<String, f64>;

/// Hooks into a run (all optional).
pub trait Callbacks {
    /// Before the first step.
    fn on_train_begin(&mut self, _total_steps: usize) {}
    /// After each optimizer step with its metrics.
    fn on_step_end(&mut self, _step: usize, _metrics: &Metrics) {}
    /// After an evaluation.
    fn on_evaluate(&mut self, _step: usize, _metrics: &Metrics) {}
    /// After the last step.
    fn on_train_end(&mut self, _result: &TrainingResult) {}
}

/// No callbacks.
#[derive(Debug, Default)]
pub struct NoCallbacks;
impl Callbacks for NoCallbacks {}

/// What [`run`] returns.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrainingResult {
    /// Every logged step's metrics, in order.
    pub metrics: Vec<Metrics>,
    /// The last checkpoint written (the best one is the last: GRPO has no validation loss).
    pub best_checkpoint_path: Option<PathBuf>,
    /// Steps done, counting steps of a resumed run's earlier part.
    pub total_steps: usize,
    /// Passes over the training prompts.
    pub total_epochs: f64,
    /// The run directory.
    pub run_dir: PathBuf,
    /// Whether a stop request (Ctrl-C) ended the run early.
    pub interrupted: bool,
}

/// How the stages are driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    /// Threads and bounded channels (the default).
    Pipelined,
    /// One thread, the stages called in turn: the reference semantics.
    Sequential,
}

/// Options of a run beyond the config.
#[derive(Debug, Clone)]
pub struct RunOptions {
    /// Resume from this checkpoint directory, or the latest in the run directory when `Some(None)`.
    pub resume: Option<Option<PathBuf>>,
    /// Threads or a plain loop.
    pub mode: RunMode,
    /// Set to stop after the current step (a checkpoint is written).
    pub stop: Arc<AtomicBool>,
    /// Stop (with a checkpoint) after this many steps of this invocation: used by tests to
    /// simulate a kill.
    pub stop_after: Option<usize>,
    /// Print progress lines / a bar.
    pub progress: bool,
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            resume: None,
            mode: RunMode::Pipelined,
            stop: Arc::new(AtomicBool::new(false)),
            stop_after: None,
            progress: false,
        }
    }
}

/// Everything a run needs, built and checked before any work starts.
pub struct Setup {
    /// The config as given.
    pub cfg: TrainConfig,
    /// Its validated form.
    pub res: Resolved,
    /// Device of the model.
    pub device: Device,
    /// The tokenizer.
    pub tokenizer: Tokenizer,
    /// The policy being trained.
    pub policy: TrainableModel,
    /// The frozen reference model (when beta > 0).
    pub reference: Option<Transformer>,
    /// The rewards.
    pub rewards: Arc<RewardSet>,
    /// Training prompts.
    pub train: Dataset,
    /// Evaluation prompts.
    pub eval: Option<Dataset>,
    /// Generation batches of the whole run.
    pub total_steps: usize,
    /// The teaching protocol, when the config has `[teacher]`.
    pub teaching: Option<Arc<TeachingProtocol>>,
    /// The frozen model that writes the teachings when `teacher.use_reference_teacher_model`.
    pub frozen_teacher: Option<Arc<Transformer>>,
    /// The server of `rollout.backend = "openai"` (connected at setup).
    pub remote: Option<Arc<Mutex<RemoteGenerator>>>,
}

impl std::fmt::Debug for Setup {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Setup")
            .field("model", &self.cfg.model.path)
            .field("total_steps", &self.total_steps)
            .finish_non_exhaustive()
    }
}

/// Loads the model, data and rewards and checks that they fit together.
///
/// `inverse_loss` and `coverage_ce` score with the model as loaded (the frozen reference, a
/// detached copy); `reward_model` loads `reward_model_path`.
pub fn setup(cfg: TrainConfig) -> Result<Setup> {
    use grpo_rewards::RewardKind;
    let needs_lm = used_rewards(&cfg).iter().any(|r| {
        matches!(
            r.kind,
            RewardKind::InverseLoss(_) | RewardKind::CoverageCe(_)
        )
    });
    let needs_rm = used_rewards(&cfg)
        .iter()
        .any(|r| matches!(r.kind, RewardKind::RewardModel(_)));
    let rm_path = cfg.reward_model_path.clone();
    let rm_dtype = cfg
        .reward_model_dtype
        .as_deref()
        .map(config::parse_dtype)
        .unwrap_or_else(|| cfg.compute_dtype());
    let rm_device = cfg.reward_model_device.clone();
    setup_with(cfg, move |model, tok| {
        let mut m = grpo_rewards::ScoringModels::default();
        if needs_lm {
            let scorer = grpo_rollout::scoring::ModelScorer::new(&model.detached(), tok.clone());
            m.language = Some(Arc::new(scorer));
        }
        if needs_rm {
            let path = rm_path.context(
                "config: a `reward_model` reward needs `reward_model_path` (a *ForSequenceClassification directory)",
            )?;
            let device = match &rm_device {
                Some(d) => {
                    config::parse_device(d).map_err(|e| anyhow!("reward_model_device: {e}"))?
                }
                None => model.device().clone(),
            };
            let rm = grpo_rollout::scoring::ClassifierModel::load(&path, rm_dtype, &device)
                .map_err(|e| anyhow!("reward model: {}", first_line(&e.to_string())))?;
            m.classifier = Some(Arc::new(rm));
        }
        Ok(m)
    })
}

/// The rewards the run scores with: the config's `[[rewards]]` for GRPO; none for SFT and DPO,
/// which never read them (a config shared with a GRPO run may keep its section).
fn used_rewards(cfg: &TrainConfig) -> &[grpo_rewards::RewardSpec] {
    if cfg.algorithm == "grpo" {
        &cfg.rewards
    } else {
        &[]
    }
}

/// Checks that the data has the columns SFT and DPO read: DPO's chosen and rejected
/// completions; SFT's completion, unless the prompts are conversations whose assistant turns
/// carry the loss.
pub fn supervised_columns(cfg: &TrainConfig, data: &Dataset) -> grpo_data::Result<()> {
    match cfg.algorithm.as_str() {
        "dpo" => {
            for col in [&cfg.dpo.chosen_field, &cfg.dpo.rejected_field] {
                data.require_column(col, "DPO (`dpo.chosen_field` / `dpo.rejected_field`)")?;
            }
        }
        "sft" if !data.conversation_prompts() => data.require_column(
            &cfg.sft.completion_field,
            "SFT (`sft.completion_field`, or conversational prompts with assistant turns)",
        )?,
        _ => {}
    }
    Ok(())
}

/// [`setup`] with the scoring models (for `inverse_loss`, `coverage_ce`, `reward_model`)
/// built by `models` from the loaded policy and tokenizer.
pub fn setup_with(
    cfg: TrainConfig,
    models: impl FnOnce(&Transformer, &Tokenizer) -> Result<grpo_rewards::ScoringModels>,
) -> Result<Setup> {
    let res = cfg.validate().map_err(|e| anyhow!("config: {e}"))?;
    let device =
        parse_device(&cfg.model.device).map_err(|e| anyhow!("config: `model.device`: {e}"))?;
    let dtype = cfg.compute_dtype();
    let splits = cfg
        .data
        .open(cfg.train.seed)
        .map_err(|e| anyhow!("data: {e}"))?;
    if splits.train.is_empty() {
        bail!("data: {:?} has no rows", cfg.data.path);
    }
    for spec in used_rewards(&cfg) {
        let needs = match &spec.kind {
            grpo_rewards::RewardKind::Accuracy(c) => Some(c.answer_field.clone()),
            grpo_rewards::RewardKind::CoverageCe(c) => Some(c.answer_field.clone()),
            _ => None,
        };
        if let Some(col) = needs {
            let who = format!("the `{}` reward", spec.kind.type_name());
            splits
                .train
                .require_column(&col, &who)
                .map_err(|e| anyhow!("data: {e}"))?;
        }
    }
    supervised_columns(&cfg, &splits.train).map_err(|e| anyhow!("data: {e}"))?;
    let loaded = grpo_rollout::load(&cfg.model.path, dtype, &device)
        .map_err(|e| anyhow!("model: {}", first_line(&e.to_string())))?;
    let scoring = models(&loaded.model, &loaded.tokenizer)?;
    let mut rewards = if used_rewards(&cfg).is_empty() {
        RewardSet::new()
    } else {
        cfg.rewards_config()
            .build(&scoring)
            .map_err(|e| anyhow!("config: {e}"))?
    };
    let (teaching, frozen_teacher) = match &cfg.teacher {
        None => (None, None),
        Some(t) => {
            let reward = teaching_reward(t, &scoring, &splits.train)?;
            rewards.push_async_reward("adaptive_teaching", 1.0, Arc::new(reward));
            let chat = cfg.rollout.chat_template;
            let student = match &t.student_model {
                Some(p) => {
                    let sdev = match &t.student_device {
                        Some(d) => config::parse_device(d)
                            .map_err(|e| anyhow!("teacher.student_device: {e}"))?,
                        None => device.clone(),
                    };
                    let sdtype = t
                        .student_dtype
                        .as_deref()
                        .map_or(dtype, config::parse_dtype);
                    LocalModel::load(p, sdtype, &sdev, chat)
                        .map_err(|e| anyhow!("teacher.student_model: {e}"))?
                }
                None => LocalModel::new(&loaded.model.detached(), loaded.tokenizer.clone(), chat),
            };
            let protocol =
                TeachingProtocol::new(t.clone(), student).map_err(|e| anyhow!("config: {e}"))?;
            let frozen = if t.use_reference_teacher_model {
                Some(Arc::new(loaded.model.detached()))
            } else {
                None
            };
            (Some(Arc::new(protocol)), frozen)
        }
    };
    let mut policy = match &cfg.model.lora {
        Some(l) => TrainableModel::lora(&loaded.model, l, cfg.train.seed)?,
        None => TrainableModel::full(&loaded.model)?,
    };
    if cfg.train.gradient_checkpointing {
        policy.model.enable_gradient_checkpointing();
    }
    // The loaded weights are never written in place (full fine-tuning trains its own copies),
    // so every frozen model shares them: the reference, the scorers, the teacher.
    let reference = if cfg.reference.beta > 0.0 || cfg.algorithm == "dpo" {
        Some(match &cfg.model.lora {
            // LoRA: the policy's own base with its adapters switched off, as TRL does with
            // peft: no copy at all.
            Some(_) => policy.model.without_adapters(),
            None => loaded.model.detached(),
        })
    } else {
        None
    };
    let remote = if cfg.rollout.backend == "openai" && cfg.algorithm == "grpo" {
        let g = RemoteGenerator::connect(cfg.rollout.openai.remote_config())
            .map_err(|e| anyhow!("rollout.openai ({}): {e}", cfg.rollout.openai.base_url))?;
        Some(Arc::new(Mutex::new(g)))
    } else {
        None
    };
    let total_steps = match cfg.train.max_steps {
        Some(n) => n,
        None => {
            let per_epoch = splits.train.len() as f64 / cfg.train.prompts_per_step as f64;
            ((per_epoch * cfg.train.num_train_epochs).ceil() as usize).max(1)
        }
    };
    Ok(Setup {
        res,
        device,
        tokenizer: loaded.tokenizer,
        policy,
        reference,
        rewards: Arc::new(rewards),
        train: splits.train,
        eval: splits.eval,
        total_steps,
        teaching,
        frozen_teacher,
        remote,
        cfg,
    })
}

/// The `adaptive_teaching` reward of a `[teacher]` section: exact match against
/// `answer_field` (which the data must have), or the `correctness` reward.
fn teaching_reward(
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

#[path = "supervised.rs"]
pub mod supervised;

// ---------------------------------------------------------------------------------------------
// What flows between the stages.

/// Prompts of one step, with the data position after them (what a checkpoint stores).
#[derive(Debug, Clone)]
pub struct PromptBatch {
    /// 0-based step index over the whole run.
    pub step: usize,
    /// The samples.
    pub samples: Vec<Sample>,
    /// Stream position after this batch.
    pub position: Position,
}

/// Completions of one step.
#[derive(Debug, Clone)]
pub struct Rollouts {
    /// The prompts.
    pub batch: PromptBatch,
    /// Prompt text as the model saw it (after the chat template).
    pub prompt_texts: Vec<String>,
    /// Prompt token ids (after left truncation).
    pub prompt_ids: Vec<Vec<u32>>,
    /// `num_generations` completions per prompt, grouped by prompt.
    pub completions: Vec<Completion>,
    /// The policy version that sampled them.
    pub version: usize,
    /// Seconds spent generating.
    pub seconds: f64,
    /// With `[teacher]`: each prompt's question and the student's diagnostic probe.
    pub teaching: Option<Vec<(String, DiagnosticResult)>>,
    /// Sampled by a model other than the policy (`teacher.use_reference_teacher_model`) or by
    /// another engine (`rollout.backend = "openai"`): off-policy whatever the staleness.
    pub sampled_by_other_model: bool,
}

/// The stage an error came from (attached as context to every stage error; `Display` is e.g.
/// `scorer stage`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Stage {
    /// The loader (grpo-data).
    Data,
    /// The generator (rollouts).
    Generator,
    /// The scorer (rewards, advantages).
    Scorer,
    /// The learner (loss, backward, optimizer, checkpoints, metrics).
    Learner,
}

impl std::fmt::Display for Stage {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Stage::Data => "data stage",
            Stage::Generator => "generator stage",
            Stage::Scorer => "scorer stage",
            Stage::Learner => "learner stage",
        })
    }
}

/// True when `e` (or a cause) says a device ran out of memory: CUDA's
/// `CUDA_ERROR_OUT_OF_MEMORY`, cuBLAS's `CUBLAS_STATUS_ALLOC_FAILED`, an allocator's "out of
/// memory".
pub fn is_out_of_memory(e: &anyhow::Error) -> bool {
    e.chain().any(|c| {
        let s = c.to_string();
        s.contains("OUT_OF_MEMORY") || s.contains("ALLOC_FAILED") || s.contains("out of memory")
    })
}

/// The one line a run that ran out of device memory ends with: where, the micro-batch, what
/// lowers memory, and the checkpoint to continue from.
pub fn out_of_memory_message(setup: &Setup, step: usize, checkpoint: Option<&Path>) -> String {
    let cfg = &setup.cfg;
    let mut ways = vec![format!(
        "a smaller `train.per_device_train_batch_size` (now {} completions per micro-batch)",
        setup.res.micro_batch
    )];
    if !cfg.train.gradient_checkpointing {
        ways.push("`train.gradient_checkpointing = true`".into());
    }
    if cfg.model.lora.is_none() {
        ways.push("LoRA adapters (`[model.lora]`)".into());
    }
    if cfg.model.dtype == "f32" {
        ways.push("`model.dtype = \"bf16\"`".into());
    }
    let tail = match checkpoint {
        Some(c) => format!(
            "; checkpoint {} saved (continue with --resume)",
            c.display()
        ),
        None => "; no step had completed, nothing saved".into(),
    };
    format!(
        "out of memory on {} in step {}: lower it with {}{tail}",
        cfg.model.device,
        step + 1,
        ways.join(", or ")
    )
}

/// Scored completions of one step.
#[derive(Debug, Clone)]
pub struct Scored {
    /// The rollouts.
    pub rollouts: Rollouts,
    /// Per-function scores, combined rewards and reward metrics.
    pub scores: ScoredBatch,
    /// One advantage per completion.
    pub advantages: Vec<f32>,
    /// Whether each completion's group had zero reward std.
    pub zero_std: Vec<bool>,
    /// Seconds spent scoring.
    pub seconds: f64,
    /// Most batches the scorer had in flight while scoring this one (1 = alone).
    pub batches_in_flight: usize,
}

// ---------------------------------------------------------------------------------------------
// Stages.

/// Hands out prompt batches from a resumable stream.
#[derive(Debug)]
pub struct Loader {
    stream: SampleStream,
    next_step: usize,
    total_steps: usize,
}

impl Loader {
    /// Starts at `position` (resume) or at the beginning.
    pub fn new(setup: &Setup, start_step: usize, position: Option<Position>) -> Result<Self> {
        let sc = StreamConfig {
            seed: setup.cfg.train.seed,
            shuffle: true,
            batch_size: setup.cfg.train.prompts_per_step,
            epochs: None,
            ..Default::default()
        };
        let stream = match position {
            Some(p) => SampleStream::resume(setup.train.clone(), sc, p),
            None => SampleStream::new(setup.train.clone(), sc),
        }
        .map_err(|e| anyhow!("{e}"))?;
        Ok(Self {
            stream,
            next_step: start_step,
            total_steps: setup.total_steps,
        })
    }

    /// The next batch, or None after the last step.
    pub fn process(&mut self) -> Result<Option<PromptBatch>> {
        if self.next_step >= self.total_steps {
            return Ok(None);
        }
        let samples = self
            .stream
            .next_batch()
            .map_err(|e| anyhow!("{e}"))?
            .context("the endless stream ended")?;
        let b = PromptBatch {
            step: self.next_step,
            samples,
            position: self.stream.position(),
        };
        self.next_step += 1;
        Ok(Some(b))
    }
}

/// Passes over the data at a stream position.
pub fn epochs_of(p: Option<Position>) -> f64 {
    p.map_or(0.0, |p| {
        p.epoch as f64 + p.index as f64 / p.dataset_len.max(1) as f64
    })
}

/// Samples completions with the latest published policy.
#[derive(Debug)]
pub struct Generator {
    tokenizer: Tokenizer,
    cfg: TrainConfig,
    model: Arc<Transformer>,
    version: usize,
    teaching: Option<Arc<TeachingProtocol>>,
    frozen_teacher: Option<Arc<Transformer>>,
    remote: Option<Arc<Mutex<RemoteGenerator>>>,
    /// The policy version (and its adapter directory) the server has.
    remote_synced: Option<(usize, PathBuf)>,
    /// The last decoding copy of an adapter model, whose transposed frozen base weights the
    /// next policy version reuses (see `Transformer::for_decoding_reusing`).
    decoding: Option<Transformer>,
}

impl Generator {
    /// With the policy weights at `version`.
    pub fn new(setup: &Setup, model: Arc<Transformer>, version: usize) -> Self {
        Self {
            tokenizer: setup.tokenizer.clone(),
            cfg: setup.cfg.clone(),
            model,
            version,
            teaching: setup.teaching.clone(),
            frozen_teacher: setup.frozen_teacher.clone(),
            remote: setup.remote.clone(),
            remote_synced: None,
            decoding: None,
        }
    }

    /// Installs new weights.
    pub fn publish(&mut self, model: Arc<Transformer>, version: usize) {
        self.model = model;
        self.version = version;
    }

    /// The current policy version.
    pub fn version(&self) -> usize {
        self.version
    }

    /// Renders and tokenises a prompt (chat template for conversations), left-truncated.
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<(String, Vec<u32>)> {
        encode_prompt(&self.tokenizer, &self.cfg, prompt)
    }

    /// Generates `num_generations` completions per prompt, seeded by (seed, step). With
    /// `[teacher]`, the student first probes each problem and the prompts become the teacher's.
    pub fn process(&mut self, batch: PromptBatch) -> Result<Rollouts> {
        let t0 = Instant::now();
        let seed = step_seed(self.cfg.train.seed, batch.step as u64);
        let teaching = match &self.teaching {
            Some(tp) => Some(self.probe(tp, &batch, seed)?),
            None => None,
        };
        let mut prompt_texts = Vec::with_capacity(batch.samples.len());
        let mut prompt_ids = Vec::with_capacity(batch.samples.len());
        for (i, s) in batch.samples.iter().enumerate() {
            let prompt = match (&self.teaching, &teaching) {
                (Some(tp), Some(t)) => {
                    let (question, diag) = &t[i];
                    let user = tp
                        .teacher_prompt(question, diag)
                        .map_err(|e| anyhow!("row {}: {e}", s.index))?;
                    Prompt::Conversation(vec![grpo_data::Message {
                        role: "user".into(),
                        content: user,
                    }])
                }
                _ => s.prompt.clone(),
            };
            let (t, ids) = self
                .prompt_tokens(&prompt)
                .with_context(|| format!("prompt of row {}", s.index))?;
            if ids.is_empty() {
                bail!("row {}: the prompt is empty after tokenisation", s.index);
            }
            prompt_texts.push(t);
            prompt_ids.push(ids);
        }
        let params = self.cfg.rollout.sampling(seed);
        let g = self.cfg.rollout.num_generations;
        let completions = match self.remote.clone() {
            Some(remote) => {
                let mut server = remote
                    .lock()
                    .map_err(|_| anyhow!("the rollout server client is poisoned"))?;
                // The frozen teacher is the served base model; the policy is its synced adapter.
                let policy = self.frozen_teacher.is_none();
                if policy {
                    self.sync_remote(&mut server)?;
                }
                server
                    .generate(&self.tokenizer, &prompt_ids, g, &params, policy)
                    .map_err(|e| anyhow!("rollout.openai: {e}"))?
            }
            None => {
                let model = self.frozen_teacher.as_ref().unwrap_or(&self.model);
                let decoding = model.for_decoding_reusing(self.decoding.as_ref())?;
                let out =
                    grpo_rollout::generate(&decoding, &self.tokenizer, &prompt_ids, g, &params)?;
                // Only an adapter model's copy is worth keeping: its base never changes.
                let adapters = decoding
                    .layers
                    .iter()
                    .any(|l| l.linears().iter().any(|x| x.lora.is_some()));
                self.decoding = adapters.then_some(decoding);
                out
            }
        };
        Ok(Rollouts {
            batch,
            prompt_texts,
            prompt_ids,
            completions,
            version: self.version,
            seconds: t0.elapsed().as_secs_f64(),
            teaching,
            sampled_by_other_model: self.frozen_teacher.is_some() || self.remote.is_some(),
        })
    }

    /// Sends the current policy to the server when it has an older one: the LoRA adapter is
    /// saved in PEFT's format under `rollout.openai.adapter_dir` and loaded with
    /// `/v1/load_lora_adapter` (the previous one is unloaded and its directory removed).
    fn sync_remote(&mut self, server: &mut RemoteGenerator) -> Result<()> {
        if self.remote_synced.as_ref().map(|s| s.0) == Some(self.version) {
            return Ok(());
        }
        let lora = self
            .cfg
            .model
            .lora
            .as_ref()
            .context("rollout.backend = \"openai\" needs [model.lora]")?;
        let root = match self.cfg.rollout.openai.adapter_dir.as_str() {
            "" => self.cfg.output_dir.join("rollout_adapters"),
            d => PathBuf::from(d),
        };
        let dir = root.join(format!("step-{}", self.version));
        let base = self.cfg.model.path.display().to_string();
        grpo_rollout::lora::save_peft(&self.model, lora, &dir, &base)
            .with_context(|| format!("rollout.openai: writing the adapter to {}", dir.display()))?;
        server
            .sync_adapter(&format!("policy-step-{}", self.version), &dir)
            .map_err(|e| anyhow!("rollout.openai: {e}"))?;
        if let Some((_, old)) = self.remote_synced.replace((self.version, dir.clone()))
            && old != dir
        {
            let _ = std::fs::remove_dir_all(old);
        }
        Ok(())
    }

    /// The student's diagnostic probes of a batch's problems.
    fn probe(
        &self,
        tp: &TeachingProtocol,
        batch: &PromptBatch,
        seed: u64,
    ) -> Result<Vec<(String, DiagnosticResult)>> {
        let field = &tp.config().answer_field;
        let questions: Vec<String> = batch.samples.iter().map(question_of).collect();
        let answers: Vec<Option<String>> =
            batch.samples.iter().map(|s| s.get_text(field)).collect();
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

/// Renders and tokenises a prompt as TRL does: a conversation through the chat template with
/// the generation prompt (when `rollout.chat_template`), plain text with the tokenizer's special
/// tokens; left-truncated to `rollout.max_prompt_length`.
pub fn encode_prompt(
    tokenizer: &Tokenizer,
    cfg: &TrainConfig,
    prompt: &Prompt,
) -> Result<(String, Vec<u32>)> {
    let (text, ids) = match prompt {
        Prompt::Conversation(msgs) if cfg.rollout.chat_template => {
            let text = tokenizer.apply_chat_template(&chat_messages(msgs), true)?;
            let ids = tokenizer.encode(&text, false)?;
            (text, ids)
        }
        other => {
            let text = other.text();
            let ids = tokenizer.encode(&text, true)?;
            (text, ids)
        }
    };
    let max = cfg.rollout.max_prompt_length;
    let ids = if max > 0 && ids.len() > max {
        ids[ids.len() - max..].to_vec()
    } else {
        ids
    };
    Ok((text, ids))
}

/// grpo-data's messages as the tokenizer's chat messages.
pub fn chat_messages(msgs: &[grpo_data::Message]) -> Vec<ChatMessage> {
    msgs.iter()
        .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
        .collect()
}

/// A per-step seed (SplitMix64 of seed and step), the same on any machine.
pub fn step_seed(seed: u64, step: u64) -> u64 {
    grpo_data::rng::mix(seed, 0x6e6e_7261_7465, step)
}

/// Scores completions and computes advantages.
#[derive(Debug)]
pub struct Scorer {
    rewards: Arc<RewardSet>,
    res: Resolved,
    num_generations: usize,
    drop_zero_std: bool,
    seed: u64,
    tokenizer: Tokenizer,
    teaching: Option<Arc<TeachingProtocol>>,
    /// `teacher_log.jsonl` and the fraction of problems written to it.
    teacher_log: Option<(PathBuf, f64)>,
}

impl Scorer {
    /// For a run's rewards.
    pub fn new(setup: &Setup) -> Self {
        Self {
            rewards: setup.rewards.clone(),
            res: setup.res.clone(),
            num_generations: setup.cfg.rollout.num_generations,
            drop_zero_std: setup.cfg.loss.drop_zero_std_groups,
            seed: setup.cfg.train.seed,
            tokenizer: setup.tokenizer.clone(),
            teaching: setup.teaching.clone(),
            teacher_log: setup
                .cfg
                .teacher
                .as_ref()
                .filter(|t| t.logging_prob > 0.0)
                .map(|t| {
                    (
                        setup.cfg.output_dir.join("teacher_log.jsonl"),
                        t.logging_prob,
                    )
                }),
        }
    }

    /// Without the teaching log (evaluation).
    pub fn without_logs(mut self) -> Self {
        self.teacher_log = None;
        self
    }

    /// Reward inputs of every completion. With `[teacher]` the student answers with each
    /// teaching and without (cached per problem) first, and the inputs carry both answers.
    pub fn inputs(&self, r: &Rollouts) -> Result<Vec<RewardInput>> {
        let mut inputs = Self::plain_inputs(r);
        let (Some(tp), Some(t)) = (&self.teaching, &r.teaching) else {
            return Ok(inputs);
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
        let seed = step_seed(self.seed, r.batch.step as u64) ^ 0x0073_7475_6465_6e74;
        let passes = tp
            .student_passes(&items, seed)
            .map_err(|e| anyhow!("{e}"))?;
        for ((x, pass), (teaching, item)) in inputs
            .iter_mut()
            .zip(passes)
            .zip(teachings.iter().zip(&items))
        {
            let n = self.tokenizer.encode(teaching, false)?.len();
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
        Ok(inputs)
    }

    fn plain_inputs(r: &Rollouts) -> Vec<RewardInput> {
        r.completions
            .iter()
            .map(|c| {
                let s = &r.batch.samples[c.prompt_index];
                let mut x =
                    RewardInput::new(r.prompt_texts[c.prompt_index].clone(), c.text.clone())
                        .with_tokens(c.token_ids.len());
                if let Prompt::Conversation(m) = &s.prompt {
                    x = x.with_messages(
                        m.iter()
                            .map(|m| Message::new(m.role.clone(), m.content.clone()))
                            .collect(),
                    );
                }
                for (k, v) in &s.columns {
                    x = x.with_field(k.to_string(), to_field(v));
                }
                x
            })
            .collect()
    }

    /// Scores one step.
    pub fn process(&mut self, rollouts: Rollouts) -> Result<Scored> {
        let t0 = Instant::now();
        let inputs = self.inputs(&rollouts)?;
        let scores = self.rewards.score(&inputs).map_err(|e| anyhow!("{e}"))?;
        self.finish(rollouts, &inputs, scores, t0.elapsed().as_secs_f64(), 1)
    }

    /// Whether batches can usefully overlap in scoring (some reward is an async judge).
    pub fn overlaps(&self) -> bool {
        self.rewards.has_async()
    }

    /// Starts scoring a step in the background; `on_done` gets the scores.
    pub fn start(
        &self,
        inputs: Vec<RewardInput>,
        on_done: impl FnOnce(grpo_rewards::Result<ScoredBatch>) + Send + 'static,
    ) -> Result<grpo_rewards::ScoreTask> {
        self.rewards
            .spawn_score(inputs, on_done)
            .map_err(|e| anyhow!("{e}"))
    }

    /// Advantages of a scored step.
    pub fn finish(
        &self,
        rollouts: Rollouts,
        inputs: &[RewardInput],
        scores: ScoredBatch,
        seconds: f64,
        batches_in_flight: usize,
    ) -> Result<Scored> {
        self.log_teaching(&rollouts, inputs, &scores)?;
        let g = self.num_generations;
        let advantages = group_advantages(&scores.rewards, g, self.res.scale_rewards);
        let stds = reward_stds(&scores.rewards, g, self.res.scale_rewards);
        let zero_std: Vec<bool> = (0..scores.rewards.len())
            .map(|i| {
                let gi = i / g;
                let group = &scores.rewards[gi * g..(gi + 1) * g];
                let s = stds.get(i).copied().unwrap_or(f64::NAN);
                self.drop_zero_std && (s.abs() <= 1e-8 || group.iter().all(|r| r.is_nan()))
            })
            .collect();
        Ok(Scored {
            rollouts,
            scores,
            advantages,
            zero_std,
            seconds,
            batches_in_flight,
        })
    }

    /// Writes `logging_prob` of the step's problems to `teacher_log.jsonl`: probe, each
    /// teaching with the student's answers and its reward (and judges' verdicts).
    fn log_teaching(&self, r: &Rollouts, inputs: &[RewardInput], sc: &ScoredBatch) -> Result<()> {
        let (Some((path, prob)), Some(t)) = (&self.teacher_log, &r.teaching) else {
            return Ok(());
        };
        let mut lines = String::new();
        for (p, (question, diag)) in t.iter().enumerate() {
            let u = grpo_data::rng::mix(
                self.seed,
                0x006c_6f67,
                (r.batch.step as u64) << 20 | p as u64,
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
                    "reward": finite(f64::from(sc.rewards[i])),
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

    /// The pipeline's scorer stage: scores the rollouts arriving on `input` and sends them on
    /// `output` in order. With async judges up to `max_in_flight` steps are scored at once, so
    /// the judges keep requests in flight across steps (each judge's `max_concurrent` and rate
    /// limits still bound them all); otherwise one step at a time. Stops when `input` closes or
    /// `output`'s receiver is gone; dropping unfinished work cancels it.
    pub fn run_stage(
        &mut self,
        input: &crossbeam_channel::Receiver<Rollouts>,
        output: &crossbeam_channel::Sender<Scored>,
        max_in_flight: usize,
    ) -> Result<()> {
        if !self.overlaps() {
            for r in input.iter() {
                if output.send(self.process(r)?).is_err() {
                    break;
                }
            }
            return Ok(());
        }
        struct Pending {
            rollouts: Rollouts,
            inputs: Vec<RewardInput>,
            started: Instant,
            in_flight: usize,
            result: Option<grpo_rewards::Result<ScoredBatch>>,
            _task: grpo_rewards::ScoreTask,
        }
        let max_in_flight = max_in_flight.max(1);
        // Each task reports once and at most `max_in_flight` are pending: never blocks.
        let (done_tx, done_rx) = bounded::<(u64, grpo_rewards::Result<ScoredBatch>)>(max_in_flight);
        let mut pending: std::collections::VecDeque<(u64, Pending)> = Default::default();
        let mut next_id = 0u64;
        let mut open = true;
        loop {
            // Hand on the finished steps at the front, in order.
            while pending.front().is_some_and(|(_, p)| p.result.is_some()) {
                let Some((_, p)) = pending.pop_front() else {
                    break;
                };
                let scores = match p.result {
                    Some(r) => r.map_err(|e| anyhow!("{e}"))?,
                    None => continue,
                };
                let dt = p.started.elapsed().as_secs_f64();
                let scored = self.finish(p.rollouts, &p.inputs, scores, dt, p.in_flight)?;
                if output.send(scored).is_err() {
                    return Ok(());
                }
            }
            if !open && pending.is_empty() {
                return Ok(());
            }
            let record = |pending: &mut std::collections::VecDeque<(u64, Pending)>,
                          id: u64,
                          r: grpo_rewards::Result<ScoredBatch>| {
                if let Some((_, p)) = pending.iter_mut().find(|(i, _)| *i == id) {
                    p.result = Some(r);
                }
            };
            if open && pending.len() < max_in_flight {
                crossbeam_channel::select! {
                    recv(input) -> msg => match msg {
                        Ok(r) => {
                            let id = next_id;
                            next_id += 1;
                            let tx = done_tx.clone();
                            let started = Instant::now();
                            let inputs = self.inputs(&r)?;
                            let task = self.start(inputs.clone(), move |res| {
                                let _ = tx.send((id, res));
                            })?;
                            let n = pending.len() + 1;
                            for (_, p) in pending.iter_mut() {
                                p.in_flight = p.in_flight.max(n);
                            }
                            pending.push_back((id, Pending {
                                rollouts: r,
                                inputs,
                                started,
                                in_flight: n,
                                result: None,
                                _task: task,
                            }));
                        }
                        Err(_) => open = false,
                    },
                    recv(done_rx) -> msg => {
                        if let Ok((id, r)) = msg {
                            record(&mut pending, id, r);
                        }
                    }
                }
            } else if let Ok((id, r)) = done_rx.recv() {
                record(&mut pending, id, r);
            }
        }
    }
}

fn to_field(v: &grpo_data::Value) -> FieldValue {
    match v {
        grpo_data::Value::Null => FieldValue::Null,
        grpo_data::Value::Bool(b) => FieldValue::Bool(*b),
        grpo_data::Value::Int(i) => FieldValue::Int(*i),
        grpo_data::Value::Float(f) => FieldValue::Float(*f),
        grpo_data::Value::Str(s) => FieldValue::Str(s.clone()),
        grpo_data::Value::StrList(l) => FieldValue::StrList(l.clone()),
        grpo_data::Value::Messages(m) => FieldValue::StrList(
            m.iter()
                .map(|m| format!("{}: {}", m.role, m.content))
                .collect(),
        ),
    }
}

/// The learner's persistent state besides the weights.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps (generation batches) done.
    pub step: usize,
    /// Data position after the last trained batch.
    pub position: Option<Position>,
    /// Prompt + completion tokens trained on so far (TRL's `num_tokens`).
    pub num_tokens: u64,
    /// Passes over the data.
    pub epoch: f64,
    /// Optimizer updates done (step × num_iterations).
    pub optimizer_steps: usize,
}

/// Computes the loss, updates the weights, writes metrics and checkpoints.
pub struct Learner {
    cfg: TrainConfig,
    res: Resolved,
    device: Device,
    tokenizer: Tokenizer,
    policy: TrainableModel,
    reference: Option<Transformer>,
    opt: AdamW,
    schedule: Schedule,
    /// Progress so far.
    pub state: TrainerState,
    run_dir: PathBuf,
    metrics_file: Option<std::fs::File>,
    completions_file: Option<std::fs::File>,
    base_model: String,
    /// Checkpoints written, oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// True while a step has changed weights it has not finished: a checkpoint then would mix
    /// two steps.
    updating: bool,
}

impl std::fmt::Debug for Learner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learner")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

const STATE_FILE: &str = "trainer_state.json";
const OPT_FILE: &str = "optimizer.safetensors";
const REF_FILE: &str = "reference.safetensors";

impl Learner {
    /// Takes the policy out of `setup`.
    pub fn new(setup: &Setup, run_dir: &Path) -> Result<Self> {
        let o = &setup.cfg.optim;
        let opt = AdamW::new(
            setup.policy.vars.clone(),
            AdamWParams {
                beta1: o.adam_beta1,
                beta2: o.adam_beta2,
                eps: o.adam_epsilon,
                weight_decay: o.weight_decay,
            },
        )?;
        let opt = if setup.cfg.train.bf16 {
            opt.with_master_weights()?
        } else {
            opt
        };
        let total_updates = setup.total_steps * o.num_iterations;
        let warmup = if o.warmup_steps > 0 {
            o.warmup_steps
        } else {
            (o.warmup_ratio * total_updates as f64).ceil() as usize
        };
        let kind = match o.lr_scheduler_type.as_str() {
            "constant" => ScheduleKind::Constant,
            "cosine" => ScheduleKind::Cosine,
            _ => ScheduleKind::Linear,
        };
        Ok(Self {
            cfg: setup.cfg.clone(),
            res: setup.res.clone(),
            device: setup.device.clone(),
            tokenizer: setup.tokenizer.clone(),
            policy: setup.policy.clone(),
            reference: setup.reference.clone(),
            opt,
            schedule: Schedule {
                kind,
                lr: o.learning_rate,
                warmup,
                total: total_updates,
            },
            state: TrainerState::default(),
            run_dir: run_dir.to_path_buf(),
            metrics_file: None,
            completions_file: None,
            base_model: setup.cfg.model.path.display().to_string(),
            checkpoints: Vec::new(),
            updating: false,
        })
    }

    /// A detached copy of the current policy for the generator: the trainable weights copied
    /// (for LoRA only the adapters), the frozen ones shared.
    pub fn publish(&self) -> Result<Arc<Transformer>> {
        Ok(Arc::new(self.policy.model.snapshot_trainable()?))
    }

    /// Opens metrics.jsonl and completions.jsonl for appending.
    pub fn open_logs(&mut self) -> Result<()> {
        let open = |name: &str| -> Result<std::fs::File> {
            let p = self.run_dir.join(name);
            std::fs::OpenOptions::new()
                .create(true)
                .append(true)
                .open(&p)
                .with_context(|| format!("{}: cannot open", p.display()))
        };
        self.metrics_file = Some(open("metrics.jsonl")?);
        if self.cfg.train.log_completions {
            self.completions_file = Some(open("completions.jsonl")?);
        }
        Ok(())
    }

    fn logps(
        &self,
        model: &Transformer,
        prompts: &[&[u32]],
        completions: &[&[u32]],
        with_entropy: bool,
    ) -> Result<(Tensor, Option<Tensor>, usize)> {
        completion_logps(
            model,
            self.tokenizer.pad_token_id,
            prompts,
            completions,
            self.cfg.rollout.temperature,
            with_entropy,
        )
    }

    /// One step: old and reference log-probs, `num_iterations` optimizer updates over the
    /// micro-batches, metrics. Returns the step's metrics.
    pub fn process(&mut self, s: &Scored) -> Result<Metrics> {
        let t0 = Instant::now();
        let r = &s.rollouts;
        let n = r.completions.len();
        let eos: Vec<u32> = self.tokenizer.eos_token_ids.clone();
        let prompts: Vec<&[u32]> = r
            .completions
            .iter()
            .map(|c| r.prompt_ids[c.prompt_index].as_slice())
            .collect();
        let comps: Vec<&[u32]> = r
            .completions
            .iter()
            .map(|c| c.token_ids.as_slice())
            .collect();
        // Completion mask rows: 1 on real tokens; 0 for masked truncations / dropped groups.
        let keep: Vec<bool> = r
            .completions
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let truncated = c.finish_reason == FinishReason::Length
                    && c.token_ids.last().is_none_or(|t| !eos.contains(t));
                let masked = self.cfg.loss.mask_truncated_completions && truncated;
                !masked && !s.zero_std[i]
            })
            .collect();
        let lens: Vec<usize> = r.completions.iter().map(|c| c.token_ids.len()).collect();
        let total_tokens: usize = (0..n).filter(|&i| keep[i]).map(|i| lens[i]).sum();

        let micro = self.res.micro_batch;
        let chunks: Vec<(usize, usize)> = (0..n)
            .step_by(micro)
            .map(|a| (a, (a + micro).min(n)))
            .collect();
        let ga = chunks.len() as f64;
        let mask_of = |a: usize, b: usize, c: usize| -> Result<Tensor> {
            let mut m = Vec::with_capacity((b - a) * c);
            for i in a..b {
                let k = if keep[i] { lens[i] } else { 0 };
                m.extend((0..c).map(|j| if j < k { 1f32 } else { 0f32 }));
            }
            Ok(Tensor::from_vec(m, (b - a, c), &self.device)?)
        };

        // Off-policy samples: with `max_staleness` > 0 the generator may have sampled with an
        // older version than the learner's current one. Then the old log-probs come from the
        // current policy and TRL's importance-sampling correction weighs each sample by its
        // ratio to the sampling log-probs recorded at generation.
        let staleness = self.state.step.saturating_sub(r.version);
        // Samples of another model (the frozen teacher of `use_reference_teacher_model`) are
        // off-policy whatever the staleness.
        let correct = (self.cfg.pipeline.max_staleness > 0 || r.sampled_by_other_model)
            && self.cfg.loss.vllm_importance_sampling_correction;
        // Old-policy log-probs (num_iterations > 1 or off-policy correction) and reference
        // log-probs, no graph.
        let need_old = self.cfg.optim.num_iterations > 1 || correct;
        let frozen = if need_old {
            Some(self.policy.model.detached())
        } else {
            None
        };
        let mut old: Vec<Option<Tensor>> = Vec::new();
        let mut refs: Vec<Option<Tensor>> = Vec::new();
        for &(a, b) in &chunks {
            old.push(match &frozen {
                Some(m) => Some(
                    self.logps(m, &prompts[a..b], &comps[a..b], false)?
                        .0
                        .detach(),
                ),
                None => None,
            });
            refs.push(match &self.reference {
                Some(m) => Some(
                    self.logps(m, &prompts[a..b], &comps[a..b], false)?
                        .0
                        .detach(),
                ),
                None => None,
            });
        }

        let mut is_weights: Vec<Option<Tensor>> = Vec::new();
        let mut is_stats: Vec<(f64, f64, f64)> = Vec::new();
        let mut logp_diff: (f64, f64, f64) = (0.0, 0.0, 0.0); // (sum, count, max)
        for (ci, &(a, b)) in chunks.iter().enumerate() {
            let (true, Some(old_lp)) = (correct, old[ci].as_ref()) else {
                is_weights.push(None);
                continue;
            };
            let c = old_lp.dim(1)?;
            let old_rows: Vec<Vec<f32>> = old_lp.to_dtype(DType::F32)?.to_vec2()?;
            let mut sampled = Vec::with_capacity((b - a) * c);
            for (comp, old_row) in r.completions[a..b].iter().zip(&old_rows) {
                // A server that gave no usable log-probs (see grpo_rollout::remote): weight 1.
                if comp.logprobs.len() != comp.token_ids.len() {
                    sampled.extend(old_row);
                    continue;
                }
                sampled.extend((0..c).map(|j| comp.logprobs.get(j).copied().unwrap_or(0.0)));
            }
            let sampled =
                Tensor::from_vec(sampled, (b - a, c), &self.device)?.to_dtype(old_lp.dtype())?;
            let mask = mask_of(a, b, c)?;
            let l = &self.cfg.loss;
            let w = grpo_core::loss::importance_weights(
                old_lp,
                &sampled,
                &mask,
                self.res.importance_sampling_mode,
                l.vllm_importance_sampling_clip_min,
                l.vllm_importance_sampling_clip_max,
            )?;
            is_stats.push(grpo_core::loss::importance_weight_stats(&w, &mask)?);
            let d: Vec<Vec<f64>> = (old_lp - &sampled)?
                .abs()?
                .to_dtype(DType::F64)?
                .to_vec2()?;
            let m: Vec<Vec<f32>> = mask.to_vec2()?;
            for (dr, mr) in d.iter().zip(&m) {
                for (dv, mv) in dr.iter().zip(mr) {
                    if *mv > 0.5 && dv.is_finite() {
                        logp_diff.0 += dv;
                        logp_diff.1 += 1.0;
                        logp_diff.2 = logp_diff.2.max(*dv);
                    }
                }
            }
            is_weights.push(Some(w));
        }

        let mut sums: BTreeMap<&str, (f64, f64)> = BTreeMap::new();
        let mut add = |k: &'static str, v: f64| {
            let e = sums.entry(k).or_insert((0.0, 0.0));
            e.0 += v;
            e.1 += 1.0;
        };
        let mut last_grad_norm = 0.0;
        let mut last_lr = 0.0;
        let dapo_like = matches!(self.res.loss.loss_type, LossType::Dapo | LossType::Cispo);
        for _iter in 0..self.cfg.optim.num_iterations {
            let mut acc: HashMap<String, Tensor> = HashMap::new();
            for (ci, &(a, b)) in chunks.iter().enumerate() {
                let (lp, ent, c) =
                    self.logps(&self.policy.model, &prompts[a..b], &comps[a..b], true)?;
                let mask = mask_of(a, b, c)?;
                let adv = Tensor::from_slice(&s.advantages[a..b], b - a, &self.device)?;
                let out = policy_loss(
                    &LossInputs {
                        per_token_logps: &lp,
                        old_per_token_logps: old[ci].as_ref(),
                        ref_per_token_logps: refs[ci].as_ref(),
                        advantages: &adv,
                        completion_mask: &mask,
                        num_items_in_batch: Some(total_tokens as f64),
                        importance_weights: is_weights[ci].as_ref(),
                    },
                    &self.res.loss,
                )?;
                let loss = if dapo_like {
                    out.loss
                } else {
                    (out.loss / ga)?
                };
                let lv = loss.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                if !lv.is_finite() {
                    bail!("non-finite loss ({lv}) at step {}", r.batch.step);
                }
                add("loss", if dapo_like { lv } else { lv * ga });
                if let Some(e) = ent {
                    let msum = mask.sum_all()?.to_dtype(DType::F64)?.to_scalar::<f64>()?;
                    if msum > 0.0 {
                        let es = (e.detach() * &mask)?
                            .sum_all()?
                            .to_dtype(DType::F64)?
                            .to_scalar::<f64>()?;
                        add("entropy", es / msum);
                    }
                }
                if self.reference.is_some() {
                    add("kl", out.metrics.kl);
                }
                add("clip_ratio/low_mean", out.metrics.clip_ratio_low_mean);
                add("clip_ratio/high_mean", out.metrics.clip_ratio_high_mean);
                add("clip_ratio/region_mean", out.metrics.clip_ratio_region_mean);
                let grads = self.policy.model.backward(&loss)?;
                accumulate(&mut acc, self.opt.vars(), &grads)?;
            }
            last_grad_norm = clip_grad_norm(&mut acc, self.cfg.optim.max_grad_norm)?;
            if !last_grad_norm.is_finite() {
                bail!("non-finite gradient norm at step {}", r.batch.step);
            }
            last_lr = self.schedule.lr_at(self.state.optimizer_steps);
            self.updating = true;
            self.opt.step(&acc, last_lr)?;
            self.state.optimizer_steps += 1;
        }
        // Loss summed over micro-batches gives the step's loss; other metrics are means.
        let mut m = Metrics::new();
        for (k, (sum, cnt)) in &sums {
            let v = if *k == "loss" {
                sum / self.cfg.optim.num_iterations as f64
            } else {
                sum / cnt.max(1.0)
            };
            m.insert((*k).to_string(), v);
        }
        if self.reference.is_none() {
            m.insert("kl".into(), 0.0);
        }
        m.insert("grad_norm".into(), last_grad_norm);
        m.insert("learning_rate".into(), last_lr);

        // Reference sync (TR-DPO): ref ← α·policy + (1 − α)·ref every ref_model_sync_steps.
        self.state.step = r.batch.step + 1;
        if self.cfg.reference.sync_ref_model
            && self
                .state
                .step
                .is_multiple_of(self.cfg.reference.ref_model_sync_steps)
            && let Some(reference) = &self.reference
        {
            let alpha = self.cfg.reference.ref_model_mixup_alpha;
            let merged = merged_policy(&self.policy)?;
            let pw: HashMap<String, Tensor> = merged.weights().into_iter().collect();
            let mut new_w = HashMap::new();
            for (k, rw) in reference.weights() {
                let p = pw.get(&k).with_context(|| format!("policy has no `{k}`"))?;
                new_w.insert(k, ((p * alpha)? + (rw * (1.0 - alpha))?)?);
            }
            self.reference = Some(Transformer::from_weights(
                &reference.cfg,
                &new_w,
                reference.dtype(),
                reference.device(),
            )?);
        }

        // Step metrics.
        let sc = &s.scores;
        let stats = grpo_core::advantages::reward_stats(
            &sc.per_function,
            &self.reward_weights(sc),
            self.cfg.rollout.num_generations,
            self.res.scale_rewards,
        );
        m.insert("reward".into(), stats.reward);
        m.insert("reward_std".into(), stats.reward_std);
        m.insert("frac_reward_zero_std".into(), stats.frac_reward_zero_std);
        for (k, v) in &sc.metrics {
            m.insert(k.clone(), *v);
        }
        let lf: Vec<f64> = lens.iter().map(|&l| l as f64).collect();
        let truncated: Vec<bool> = r
            .completions
            .iter()
            .map(|c| c.finish_reason == FinishReason::Length)
            .collect();
        m.insert("completions/mean_length".into(), mean(&lf));
        m.insert(
            "completions/min_length".into(),
            lf.iter().copied().fold(f64::INFINITY, f64::min),
        );
        m.insert(
            "completions/max_length".into(),
            lf.iter().copied().fold(0.0, f64::max),
        );
        m.insert(
            "completions/clipped_ratio".into(),
            truncated.iter().filter(|&&t| t).count() as f64 / n.max(1) as f64,
        );
        let term: Vec<f64> = lf
            .iter()
            .zip(&truncated)
            .filter(|(_, t)| !**t)
            .map(|(l, _)| *l)
            .collect();
        m.insert(
            "completions/mean_terminated_length".into(),
            if term.is_empty() { 0.0 } else { mean(&term) },
        );
        let prompt_tokens: usize = prompts.iter().map(|p| p.len()).sum();
        self.state.num_tokens += (prompt_tokens + lens.iter().sum::<usize>()) as u64;
        m.insert("num_tokens".into(), self.state.num_tokens as f64);
        m.insert("step".into(), self.state.step as f64);
        m.insert("policy_version".into(), r.version as f64);
        if self.cfg.pipeline.max_staleness > 0 {
            // One policy version per batch: the mean and the max over its samples are equal.
            m.insert("staleness/mean".into(), staleness as f64);
            m.insert("staleness/max".into(), staleness as f64);
        }
        if !is_stats.is_empty() {
            let k = is_stats.len() as f64;
            let min = is_stats.iter().map(|s| s.0).fold(f64::INFINITY, f64::min);
            let mean = is_stats.iter().map(|s| s.1).sum::<f64>() / k;
            let max = is_stats
                .iter()
                .map(|s| s.2)
                .fold(f64::NEG_INFINITY, f64::max);
            m.insert("sampling/importance_sampling_ratio/min".into(), min);
            m.insert("sampling/importance_sampling_ratio/mean".into(), mean);
            m.insert("sampling/importance_sampling_ratio/max".into(), max);
            m.insert(
                "sampling/sampling_logp_difference/mean".into(),
                logp_diff.0 / logp_diff.1.max(1.0),
            );
            m.insert("sampling/sampling_logp_difference/max".into(), logp_diff.2);
        }
        let train_s = t0.elapsed().as_secs_f64();
        m.insert("timing/generate_s".into(), r.seconds);
        m.insert("timing/score_s".into(), s.seconds);
        m.insert(
            "scoring/batches_in_flight".into(),
            s.batches_in_flight as f64,
        );
        m.insert("timing/train_s".into(), train_s);
        self.state.position = Some(r.batch.position);
        self.updating = false;
        Ok(m)
    }

    fn reward_weights(&self, sc: &ScoredBatch) -> Vec<f32> {
        // The set's weights, in the order of its names.
        let w = self
            .cfg
            .reward_weights
            .clone()
            .unwrap_or_else(|| self.cfg.rewards.iter().map(|r| r.weight).collect());
        if w.len() == sc.per_function.len() {
            w
        } else {
            vec![1.0; sc.per_function.len()]
        }
    }

    /// Appends a metrics line.
    pub fn log_metrics(&mut self, m: &Metrics) -> Result<()> {
        if let Some(f) = &mut self.metrics_file {
            let line = serde_json::to_string(&finite_json(m))?;
            writeln!(f, "{line}").context("metrics.jsonl: write failed")?;
        }
        Ok(())
    }

    /// Appends the first `num_completions_to_print` completions of a step.
    pub fn log_completions(&mut self, s: &Scored) -> Result<()> {
        let Some(f) = &mut self.completions_file else {
            return Ok(());
        };
        let r = &s.rollouts;
        for (i, c) in r
            .completions
            .iter()
            .enumerate()
            .take(self.cfg.train.num_completions_to_print)
        {
            let mut rewards = serde_json::Map::new();
            for (k, name) in s.scores.names.iter().enumerate() {
                let v = s.scores.per_function[k][i];
                rewards.insert(
                    name.clone(),
                    v.map_or(serde_json::Value::Null, |x| serde_json::json!(x)),
                );
            }
            let info: serde_json::Map<String, serde_json::Value> = s
                .scores
                .names
                .iter()
                .zip(&s.scores.info)
                .filter_map(|(n, inf)| inf.get(i).cloned().flatten().map(|v| (n.clone(), v)))
                .collect();
            let line = serde_json::json!({
                "step": r.batch.step + 1,
                "prompt": r.prompt_texts[c.prompt_index],
                "completion": c.text,
                "rewards": rewards,
                "info": info,
                "reward": finite(s.scores.rewards[i] as f64),
                "advantage": s.advantages[i],
                "finish_reason": c.finish_reason,
            });
            writeln!(f, "{line}").context("completions.jsonl: write failed")?;
        }
        Ok(())
    }

    /// Writes `checkpoints/step-N` atomically (a temporary directory renamed) and prunes old
    /// ones beyond `save_total_limit`.
    pub fn save_checkpoint(&mut self) -> Result<PathBuf> {
        let root = self.run_dir.join("checkpoints");
        std::fs::create_dir_all(&root)
            .with_context(|| format!("{}: cannot create", root.display()))?;
        let name = format!("step-{}", self.state.step);
        let tmp = root.join(format!(".tmp-{name}"));
        let dst = root.join(&name);
        if tmp.exists() {
            std::fs::remove_dir_all(&tmp).ok();
        }
        std::fs::create_dir_all(&tmp)?;
        let dtype = self.policy.model.dtype();
        match &self.policy.lora {
            Some(l) => {
                grpo_rollout::lora::save_peft(
                    &self.policy.model,
                    l,
                    &tmp.join("adapter"),
                    &self.base_model,
                )?;
            }
            None => {
                grpo_rollout::save_hf_dir(
                    &self.policy.model.detached(),
                    &self.tokenizer,
                    &tmp.join("model"),
                    dtype,
                )?;
            }
        }
        self.opt.save(&tmp.join(OPT_FILE))?;
        if self.cfg.reference.sync_ref_model
            && let Some(r) = &self.reference
        {
            let map: HashMap<String, Tensor> = r.weights().into_iter().collect();
            candle_core::safetensors::save(&map, tmp.join(REF_FILE))?;
        }
        std::fs::write(
            tmp.join(STATE_FILE),
            serde_json::to_vec_pretty(&self.state)?,
        )?;
        std::fs::write(
            tmp.join("config.json"),
            serde_json::to_vec_pretty(&self.cfg.redacted_json())?,
        )?;
        if dst.exists() {
            std::fs::remove_dir_all(&dst)?;
        }
        std::fs::rename(&tmp, &dst)
            .with_context(|| format!("{}: cannot rename into place", dst.display()))?;
        self.checkpoints.retain(|p| p != &dst);
        self.checkpoints.push(dst.clone());
        let limit = self.cfg.train.save_total_limit;
        if limit > 0 {
            let mut all = list_checkpoints(&self.run_dir);
            while all.len() > limit {
                let (_, old) = all.remove(0);
                std::fs::remove_dir_all(&old).ok();
                self.checkpoints.retain(|p| p != &old);
            }
        }
        Ok(dst)
    }

    /// Restores weights, optimizer, reference and state from a checkpoint.
    pub fn load_checkpoint(&mut self, dir: &Path) -> Result<()> {
        let state: TrainerState =
            serde_json::from_slice(&std::fs::read(dir.join(STATE_FILE)).with_context(|| {
                format!("{}: not a checkpoint (no {STATE_FILE})", dir.display())
            })?)
            .with_context(|| format!("{}: invalid {STATE_FILE}", dir.display()))?;
        let dtype = self.policy.model.dtype();
        let weights: HashMap<String, Tensor> = match &self.policy.lora {
            Some(_) => {
                let p = dir.join("adapter").join("adapter_model.safetensors");
                let raw = candle_core::safetensors::load(&p, &self.device)
                    .with_context(|| format!("{}: cannot read the adapter", p.display()))?;
                // PEFT keys carry the `base_model.model.` prefix and no adapter name.
                let mut m = HashMap::new();
                // Our LoRA variables are named by their PEFT keys.
                for (k, _) in self.opt.vars() {
                    let t = raw
                        .get(k)
                        .with_context(|| format!("{}: no `{k}`", p.display()))?;
                    m.insert(k.clone(), t.clone());
                }
                m
            }
            None => {
                let d = dir.join("model");
                grpo_rollout::loader::read_safetensors(&d, &self.device)?
                    .into_iter()
                    .collect()
            }
        };
        for (k, var) in self.opt.vars() {
            let t = weights
                .get(k)
                .with_context(|| format!("{}: checkpoint has no weight `{k}`", dir.display()))?;
            if t.dims() != var.dims() {
                bail!(
                    "{}: `{k}` has shape {:?}, the model's is {:?}",
                    dir.display(),
                    t.dims(),
                    var.dims()
                );
            }
            var.set(&t.to_dtype(dtype)?)?;
        }
        // Tied heads: the model shares the embedding tensor with its var, so nothing else to do.
        self.opt.load(&dir.join(OPT_FILE))?;
        if self.cfg.reference.sync_ref_model
            && let Some(r) = &self.reference
        {
            let p = dir.join(REF_FILE);
            let map = candle_core::safetensors::load(&p, &self.device)
                .with_context(|| format!("{}: cannot read", p.display()))?;
            self.reference = Some(Transformer::from_weights(
                &r.cfg,
                &map,
                r.dtype(),
                r.device(),
            )?);
        }
        self.state = state;
        Ok(())
    }

    /// The trained policy (adapters unmerged).
    pub fn policy(&self) -> &TrainableModel {
        &self.policy
    }
}

fn merged_policy(p: &TrainableModel) -> Result<Transformer> {
    Ok(match &p.lora {
        Some(_) => grpo_rollout::lora::merge(&p.model.detached())?,
        None => p.model.detached(),
    })
}

/// Per-token log-probs `(B, C)` of completions (right-padded to `C`, the longest) after
/// left-padded prompts under `model`, with logits divided by `temperature`; entropies when
/// asked. Returns `C` too. Differentiable when the model's weights are `Var`s.
///
/// When rows share a prompt (a GRPO group, DPO's chosen and rejected), each distinct prompt
/// is run once and its keys and values serve all its rows
/// ([`Transformer::shared_prompt_logprobs`]); otherwise every row runs prompt + completion.
pub fn completion_logps(
    model: &Transformer,
    pad: u32,
    prompts: &[&[u32]],
    completions: &[&[u32]],
    temperature: f64,
    with_entropy: bool,
) -> Result<(Tensor, Option<Tensor>, usize)> {
    let p = prompts.iter().map(|x| x.len()).max().unwrap_or(0);
    let c = completions
        .iter()
        .map(|x| x.len())
        .max()
        .unwrap_or(0)
        .max(1);
    let b = prompts.len();
    let device = model.device();
    let mut distinct: Vec<&[u32]> = Vec::new();
    let mut index: HashMap<&[u32], u32> = HashMap::new();
    let prompt_of: Vec<u32> = prompts
        .iter()
        .map(|pr| {
            *index.entry(pr).or_insert_with(|| {
                distinct.push(pr);
                (distinct.len() - 1) as u32
            })
        })
        .collect();
    // Rows padded to `width`: prompts on the left, completions on the right.
    let push = |ids: &mut Vec<u32>, mask: &mut Vec<u32>, row: &[u32], width: usize, left: bool| {
        let fill = width - row.len();
        if left {
            ids.extend(std::iter::repeat_n(pad, fill));
            mask.extend(std::iter::repeat_n(0u32, fill));
        }
        ids.extend(row);
        mask.extend(std::iter::repeat_n(1u32, row.len()));
        if !left {
            ids.extend(std::iter::repeat_n(pad, fill));
            mask.extend(std::iter::repeat_n(0u32, fill));
        }
    };
    if distinct.len() < b && prompts.iter().all(|pr| !pr.is_empty()) {
        let u = distinct.len();
        let (mut pids, mut pmask) = (Vec::with_capacity(u * p), Vec::with_capacity(u * p));
        for pr in &distinct {
            push(&mut pids, &mut pmask, pr, p, true);
        }
        let (mut cids, mut cmask) = (Vec::with_capacity(b * c), Vec::with_capacity(b * c));
        for co in completions {
            push(&mut cids, &mut cmask, co, c, false);
        }
        let (lp, ent) = model.shared_prompt_logprobs(
            &Tensor::from_vec(pids, (u, p), device)?,
            &Tensor::from_vec(pmask, (u, p), device)?,
            &prompt_of,
            &Tensor::from_vec(cids, (b, c), device)?,
            &Tensor::from_vec(cmask, (b, c), device)?,
            temperature,
            with_entropy,
        )?;
        return Ok((lp, ent, c));
    }
    let mut ids = Vec::with_capacity(b * (p + c));
    let mut mask = Vec::with_capacity(b * (p + c));
    for (pr, co) in prompts.iter().zip(completions) {
        push(&mut ids, &mut mask, pr, p, true);
        push(&mut ids, &mut mask, co, c, false);
    }
    let ids = Tensor::from_vec(ids, (b, p + c), device)?;
    let mask = Tensor::from_vec(mask, (b, p + c), device)?;
    let (lp, ent) = model.completion_logprobs(&ids, &mask, c, temperature, with_entropy)?;
    Ok((lp, ent, c))
}

/// Complete checkpoints of a run directory, oldest (lowest step) first.
pub fn list_checkpoints(run_dir: &Path) -> Vec<(usize, PathBuf)> {
    let mut out = Vec::new();
    if let Ok(rd) = std::fs::read_dir(run_dir.join("checkpoints")) {
        for e in rd.flatten() {
            let name = e.file_name().to_string_lossy().to_string();
            if let Some(n) = name
                .strip_prefix("step-")
                .and_then(|n| n.parse::<usize>().ok())
                && e.path().join(STATE_FILE).exists()
            {
                out.push((n, e.path()));
            }
        }
    }
    out.sort();
    out
}

fn mean(v: &[f64]) -> f64 {
    if v.is_empty() {
        f64::NAN
    } else {
        v.iter().sum::<f64>() / v.len() as f64
    }
}

fn finite(x: f64) -> serde_json::Value {
    if x.is_finite() {
        serde_json::json!(x)
    } else {
        serde_json::Value::Null
    }
}

fn finite_json(m: &Metrics) -> serde_json::Value {
    serde_json::Value::Object(m.iter().map(|(k, v)| (k.clone(), finite(*v))).collect())
}

/// Peak resident memory of this process in MiB (Linux; NaN elsewhere).
pub fn peak_rss_mib() -> f64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|s| {
            s.lines().find(|l| l.starts_with("VmHWM:")).and_then(|l| {
                l.split_whitespace()
                    .nth(1)
                    .and_then(|k| k.parse::<f64>().ok())
            })
        })
        .map_or(f64::NAN, |kb| kb / 1024.0)
}

// ---------------------------------------------------------------------------------------------
// The run.

/// What a run writes into its directory (`--overwrite` / `overwrite_output_dir` removes these).
pub const RUN_FILES: &[&str] = &[
    "config.json",
    "metrics.jsonl",
    "completions.jsonl",
    "teacher_log.jsonl",
    "checkpoints",
    "rollout_adapters",
    "curves.png",
];

/// The files of an earlier run in `run_dir`: those of [`RUN_FILES`] that hold something (an
/// empty file or folder, or `config.json` alone, is what a run that failed before its first
/// step leaves, and does not count).
pub fn run_files(run_dir: &Path) -> Vec<String> {
    RUN_FILES
        .iter()
        .filter(|&&name| name != "config.json")
        .filter(|&&name| {
            let p = run_dir.join(name);
            match std::fs::metadata(&p) {
                Ok(m) if m.is_dir() => std::fs::read_dir(&p).is_ok_and(|mut d| d.next().is_some()),
                Ok(m) => m.len() > 0,
                Err(_) => false,
            }
        })
        .map(|&name| {
            if run_dir.join(name).is_dir() {
                format!("{name}/")
            } else {
                name.to_string()
            }
        })
        .collect()
}

/// Checks the run directory against how the run starts, before any work, and returns the
/// checkpoint to continue from:
/// - a fresh start refuses a directory holding another run's files ([`run_files`]) unless
///   `overwrite_output_dir`;
/// - `resume = Some(None)` takes the run directory's latest complete checkpoint;
/// - `resume = Some(Some(dir))` takes `dir`; a checkpoint of another directory starts this one
///   afresh, so the same rule as a fresh start applies.
pub fn check_run_dir(
    cfg: &TrainConfig,
    resume: Option<&Option<PathBuf>>,
) -> Result<Option<PathBuf>> {
    let run_dir = &cfg.output_dir;
    let checkpoint = match resume {
        None => None,
        Some(None) => Some(
            list_checkpoints(run_dir)
                .pop()
                .map(|(_, p)| p)
                .with_context(|| {
                    format!(
                        "--resume: no complete checkpoint in {}",
                        run_dir.join("checkpoints").display()
                    )
                })?,
        ),
        Some(Some(dir)) => {
            if !dir.join(STATE_FILE).is_file() {
                bail!(
                    "--resume {}: not a complete checkpoint (no {STATE_FILE})",
                    dir.display()
                );
            }
            Some(dir.clone())
        }
    };
    let continues_this_run = checkpoint
        .as_deref()
        .is_some_and(|c| own_checkpoint(run_dir, c));
    if !continues_this_run && !cfg.overwrite_output_dir {
        let found = run_files(run_dir);
        if !found.is_empty() {
            bail!(
                "{}: holds another run ({}); continue it with --resume or start over with --overwrite (config: overwrite_output_dir = true)",
                run_dir.display(),
                found.join(", ")
            );
        }
    }
    Ok(checkpoint)
}

/// Whether `checkpoint` is one of `run_dir`'s own (`run_dir/checkpoints/step-N`).
fn own_checkpoint(run_dir: &Path, checkpoint: &Path) -> bool {
    let (Ok(root), Ok(c)) = (
        run_dir.join("checkpoints").canonicalize(),
        checkpoint.canonicalize(),
    ) else {
        return false;
    };
    c.parent() == Some(root.as_path())
}

/// Creates the run directory (with the resolved `config.json`), builds the learner and, with
/// `--resume`, restores the checkpoint; opens the logs. Shared by GRPO, SFT and DPO.
///
/// The directory holds one run: a fresh start into a directory with another run's files is
/// refused ([`check_run_dir`]) or, with `overwrite_output_dir`, clears them first. Continuing
/// from a checkpoint of step k drops what the directory holds after step k (lines of
/// `metrics.jsonl`, `completions.jsonl` and `teacher_log.jsonl`, later checkpoints), so the
/// files read like one uninterrupted run and a later `--resume` cannot pick a checkpoint of an
/// abandoned continuation.
pub fn open_run(setup: &Setup, opts: &RunOptions) -> Result<(Learner, PathBuf)> {
    let run_dir = setup.cfg.output_dir.clone();
    let checkpoint = check_run_dir(&setup.cfg, opts.resume.as_ref())?;
    let own = checkpoint
        .as_deref()
        .is_some_and(|c| own_checkpoint(&run_dir, c));
    if !own && setup.cfg.overwrite_output_dir {
        for name in RUN_FILES {
            let p = run_dir.join(name);
            let removed = if p.is_dir() {
                std::fs::remove_dir_all(&p)
            } else {
                std::fs::remove_file(&p)
            };
            match removed {
                Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                    return Err(e)
                        .with_context(|| format!("--overwrite: cannot remove {}", p.display()));
                }
                _ => {}
            }
        }
    }
    std::fs::create_dir_all(&run_dir)
        .with_context(|| format!("{}: cannot create the run directory", run_dir.display()))?;
    std::fs::write(
        run_dir.join("config.json"),
        serde_json::to_vec_pretty(&setup.cfg.redacted_json())?,
    )
    .with_context(|| format!("{}: cannot write config.json", run_dir.display()))?;

    let mut learner = Learner::new(setup, &run_dir)?;
    if let Some(dir) = checkpoint {
        learner.load_checkpoint(&dir)?;
        let step = learner.state.step;
        for log in ["metrics.jsonl", "completions.jsonl", "teacher_log.jsonl"] {
            truncate_log(&run_dir.join(log), step)?;
        }
        for (n, later) in list_checkpoints(&run_dir) {
            if n > step {
                std::fs::remove_dir_all(&later)
                    .with_context(|| format!("{}: cannot remove", later.display()))?;
            }
        }
    }
    learner.open_logs()?;
    Ok((learner, run_dir))
}

/// Trains per `setup`, writing the run directory; returns the logged metrics.
pub fn run(
    setup: Setup,
    opts: &RunOptions,
    callbacks: &mut dyn Callbacks,
) -> Result<TrainingResult> {
    if setup.cfg.algorithm != "grpo" {
        return supervised::run(setup, opts, callbacks);
    }
    let (mut learner, run_dir) = open_run(&setup, opts)?;
    let start = learner.state.step;
    let mut loader = Loader::new(&setup, start, learner.state.position)?;
    let first = learner.publish()?;
    let mut generator = Generator::new(&setup, first, start);
    let mut scorer = Scorer::new(&setup);
    let total = setup.total_steps;
    callbacks.on_train_begin(total);
    let mut result = TrainingResult {
        run_dir: run_dir.clone(),
        ..Default::default()
    };
    let mut progress = crate::progress::Progress::new(opts.progress, start, total);
    let eval = setup.eval.clone();
    let mut on_step = |learner: &mut Learner,
                       scored: &Scored,
                       mut m: Metrics,
                       epochs: f64,
                       t_step: f64|
     -> Result<bool> {
        m.insert("epoch".into(), epochs);
        m.insert("step_time".into(), t_step);
        m.insert(
            "tokens_per_s".into(),
            scored
                .rollouts
                .completions
                .iter()
                .map(|c| c.token_ids.len())
                .sum::<usize>() as f64
                / t_step.max(1e-9),
        );
        m.insert("peak_rss_mib".into(), peak_rss_mib());
        learner.state.epoch = epochs;
        let step = learner.state.step;
        if step.is_multiple_of(setup.cfg.train.logging_steps) || step == total {
            learner.log_metrics(&m)?;
            learner.log_completions(scored)?;
        }
        progress.step(step, &m);
        callbacks.on_step_end(step, &m);
        if setup.cfg.train.eval_steps > 0
            && step.is_multiple_of(setup.cfg.train.eval_steps)
            && let Some(ev) = &eval
        {
            let em = evaluate(&setup, learner, ev)?;
            learner.log_metrics(&em)?;
            callbacks.on_evaluate(step, &em);
        }
        result.metrics.push(m);
        let save_now =
            setup.cfg.train.save_steps > 0 && step.is_multiple_of(setup.cfg.train.save_steps);
        let stop =
            opts.stop.load(Ordering::SeqCst) || opts.stop_after.is_some_and(|k| step - start >= k);
        if save_now || step == total || stop {
            result.best_checkpoint_path = Some(learner.save_checkpoint()?);
        }
        Ok(stop)
    };

    let outcome: Result<()> = match opts.mode {
        RunMode::Sequential => (|| {
            while let Some(batch) = loader.process().context(Stage::Data)? {
                let t0 = Instant::now();
                let rollouts = generator.process(batch).context(Stage::Generator)?;
                let scored = scorer.process(rollouts).context(Stage::Scorer)?;
                let m = learner.process(&scored).context(Stage::Learner)?;
                generator.publish(
                    learner.publish().context(Stage::Learner)?,
                    learner.state.step,
                );
                let epochs = epochs_of(learner.state.position);
                let stop = on_step(&mut learner, &scored, m, epochs, t0.elapsed().as_secs_f64())
                    .context(Stage::Learner)?;
                if stop {
                    result.interrupted = true;
                    break;
                }
            }
            Ok(())
        })(),
        RunMode::Pipelined => {
            let p = &setup.cfg.pipeline;
            let (data_tx, data_rx) = bounded::<PromptBatch>(p.data_capacity);
            let (roll_tx, roll_rx) = bounded::<Rollouts>(p.rollout_capacity);
            let (scored_tx, scored_rx) = bounded::<Scored>(p.scored_capacity);
            // Every version goes to the generator in order (it takes version step − k for the
            // batch of `step`, so runs are reproducible); k + 1 slots keep the learner from
            // waiting on a generator that is ahead.
            let (weights_tx, weights_rx) =
                bounded::<(Arc<Transformer>, usize)>(p.max_staleness + 1);
            let halt = Arc::new(AtomicBool::new(false));
            let staleness = p.max_staleness;
            std::thread::scope(|scope| {
                let h1 = halt.clone();
                let loader_h = scope.spawn(move || -> Result<()> {
                    while !h1.load(Ordering::SeqCst) {
                        match loader.process().context(Stage::Data)? {
                            Some(b) => {
                                if data_tx.send(b).is_err() {
                                    break;
                                }
                            }
                            None => break,
                        }
                    }
                    Ok(())
                });
                let h2 = halt.clone();
                let gen_h = scope.spawn(move || -> Result<()> {
                    for batch in data_rx.iter() {
                        // On-policy within `staleness` versions: wait for the learner's weights.
                        while batch.step > generator.version() + staleness {
                            match weights_rx.recv() {
                                Ok((w, v)) => generator.publish(w, v),
                                Err(_) => return Ok(()),
                            }
                        }
                        if h2.load(Ordering::SeqCst) {
                            break;
                        }
                        let r = generator.process(batch).context(Stage::Generator)?;
                        if roll_tx.send(r).is_err() {
                            break;
                        }
                    }
                    Ok(())
                });
                let scoring_batches = p.scoring_batches;
                let scorer_h = scope.spawn(move || -> Result<()> {
                    scorer
                        .run_stage(&roll_rx, &scored_tx, scoring_batches)
                        .context(Stage::Scorer)
                });
                // Learner on this thread.
                let mut learn = || -> Result<()> {
                    let mut t_last = Instant::now();
                    for scored in scored_rx.iter() {
                        let m = learner.process(&scored).context(Stage::Learner)?;
                        let v = learner.state.step;
                        if v < total {
                            let w = learner.publish()?;
                            // The generator may have stopped (error): ignore a closed channel.
                            let _ = weights_tx.send((w, v));
                        }
                        let epochs = epochs_of(learner.state.position);
                        let dt = t_last.elapsed().as_secs_f64();
                        t_last = Instant::now();
                        if on_step(&mut learner, &scored, m, epochs, dt).context(Stage::Learner)? {
                            result.interrupted = true;
                            return Ok(());
                        }
                    }
                    Ok(())
                };
                let learn_res = learn();
                halt.store(true, Ordering::SeqCst);
                drop(scored_rx);
                drop(weights_tx);
                let mut first_err = learn_res.err();
                for (h, stage) in [
                    (loader_h, Stage::Data),
                    (gen_h, Stage::Generator),
                    (scorer_h, Stage::Scorer),
                ] {
                    match h.join() {
                        Ok(Ok(())) => {}
                        Ok(Err(e)) => {
                            if first_err.is_none() {
                                first_err = Some(e);
                            }
                        }
                        Err(_) => {
                            if first_err.is_none() {
                                first_err = Some(anyhow!("panicked").context(stage));
                            }
                        }
                    }
                }
                match first_err {
                    Some(e) => Err(e),
                    None => Ok(()),
                }
            })
        }
    };
    if let Err(e) = outcome {
        progress.finish();
        // The learner is between two steps when another stage fails, or when it ran out of
        // memory before changing a weight: keep its progress.
        let stage = e.downcast_ref::<Stage>().copied();
        let oom = is_out_of_memory(&e);
        let saved = learner
            .checkpoints
            .last()
            .is_some_and(|p| p.ends_with(format!("step-{}", learner.state.step)));
        if oom {
            let mut ckpt = None;
            if learner.state.step > start && !learner.updating {
                ckpt = match saved {
                    true => learner.checkpoints.last().cloned(),
                    false => learner.save_checkpoint().ok(),
                };
            }
            return Err(anyhow!(out_of_memory_message(
                &setup,
                learner.state.step,
                ckpt.as_deref()
            )));
        }
        if stage != Some(Stage::Learner)
            && learner.state.step > start
            && !saved
            && let Ok(dir) = learner.save_checkpoint()
        {
            return Err(e.context(format!(
                "run stopped after step {}; checkpoint {} saved (continue with --resume)",
                learner.state.step,
                dir.display()
            )));
        }
        return Err(e);
    }
    progress.finish();
    result.total_steps = learner.state.step;
    result.total_epochs = learner.state.epoch;
    callbacks.on_train_end(&result);
    Ok(result)
}

/// Mean reward (and per-function means) on the eval split, sampled with the current policy.
pub fn evaluate(setup: &Setup, learner: &Learner, eval: &Dataset) -> Result<Metrics> {
    let model = learner.publish()?;
    let mut generator = Generator::new(setup, model, learner.state.step);
    let mut scorer = Scorer::new(setup).without_logs();
    let sc = StreamConfig {
        seed: setup.cfg.train.seed,
        shuffle: false,
        batch_size: setup.cfg.train.prompts_per_step,
        epochs: Some(1),
        ..Default::default()
    };
    let mut stream = SampleStream::new(eval.clone(), sc).map_err(|e| anyhow!("eval data: {e}"))?;
    let mut sums: BTreeMap<String, (f64, f64)> = BTreeMap::new();
    while let Some(samples) = stream.next_batch().map_err(|e| anyhow!("eval data: {e}"))? {
        let batch = PromptBatch {
            step: usize::MAX / 2,
            samples,
            position: stream.position(),
        };
        let r = generator.process(batch)?;
        let s = scorer.process(r)?;
        for (i, name) in s.scores.names.iter().enumerate() {
            for v in s.scores.per_function[i].iter().flatten() {
                let e = sums
                    .entry(format!("eval/rewards/{name}/mean"))
                    .or_insert((0.0, 0.0));
                e.0 += *v as f64;
                e.1 += 1.0;
            }
        }
        for v in s.scores.rewards.iter().filter(|v| !v.is_nan()) {
            let e = sums.entry("eval/reward".into()).or_insert((0.0, 0.0));
            e.0 += *v as f64;
            e.1 += 1.0;
        }
    }
    let mut m: Metrics = sums
        .into_iter()
        .map(|(k, (s, c))| (k, s / c.max(1.0)))
        .collect();
    if let Some(a) = m.get("eval/rewards/accuracy/mean").copied() {
        m.insert("eval/accuracy".into(), a);
    }
    m.insert("step".into(), learner.state.step as f64);
    Ok(m)
}

/// Keeps the lines of a JSON-lines log whose `step` is at most `keep_until_step`.
fn truncate_log(path: &Path, keep_until_step: usize) -> Result<()> {
    let Ok(text) = std::fs::read_to_string(path) else {
        return Ok(());
    };
    let kept: Vec<&str> = text
        .lines()
        .filter(|l| {
            serde_json::from_str::<serde_json::Value>(l)
                .ok()
                .and_then(|v| v.get("step").and_then(|s| s.as_f64()))
                .is_some_and(|s| s as usize <= keep_until_step)
        })
        .collect();
    let mut out = kept.join("\n");
    if !out.is_empty() {
        out.push('\n');
    }
    std::fs::write(path, out).with_context(|| format!("{}: cannot rewrite", path.display()))?;
    Ok(())
}
