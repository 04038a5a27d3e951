//! Everything a run needs, loaded and checked before any work starts: the config, the model
//! (policy, reference, decoding copies share the frozen weights), tokenizer, data, rewards,
//! the teaching protocol and the rollout server.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};

use anyhow::{Context, Result, anyhow, bail};
use candle_core::Device;
use grpo_data::Dataset;
use grpo_rewards::RewardSet;
use grpo_rollout::remote::RemoteGenerator;
use grpo_rollout::{LoraConfig, Tokenizer, TrainableModel, Transformer};
use grpo_teacher::{LocalModel, TeachingProtocol};

use crate::config::{Algorithm, Backend, TrainConfig};
use crate::first_line;

/// Everything a run needs, built and checked before any work starts.
pub struct Setup {
    /// The config as given.
    pub cfg: TrainConfig,
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
    /// The policy scorer of `inverse_loss` rewards with `model = "policy"`.
    pub policy_scorer: Option<Arc<crate::stages::PolicyScorer>>,
    /// The environment of multi-turn episodes (set in code: `FitOptions::environment`,
    /// `Trainer::with_environment`); `None` = single-turn completions.
    pub environment: Option<Arc<dyn grpo_rollout::Environment>>,
    /// The local generator's own device: `rollout.device` when it is not the model's, or its own
    /// handle of the model's GPU when it overlaps the learner there ([`own_generator_handle`]).
    pub rollout_device: Option<Device>,
    /// On-policy distillation's teacher (`distillation.teacher_model_name_or_path`), frozen.
    pub distillation_teacher: Option<Transformer>,
    /// GOLD's ULD: the teacher's own tokenizer (`gold.teacher_tokenizer_name_or_path`, else
    /// the teacher model's).
    pub teacher_tokenizer: Option<Tokenizer>,
    /// The distillation teacher on a server (`[distillation.teacher_server]`).
    pub teacher_server: Option<Arc<Mutex<RemoteGenerator>>>,
    /// A*-PO's optimal value of each training prompt by row index (set by its stage 1 when the
    /// run starts).
    pub a2po_values: Option<Arc<std::collections::HashMap<u64, f64>>>,
    /// PPO's value model (`ppo.value_model_name_or_path`), trained beside the policy.
    pub value_model: Option<TrainableModel>,
    /// BCO's UDM embedding model and its tokenizer (`bco.embedding_model_name_or_path`), frozen.
    pub udm_embedder: Option<(Transformer, Tokenizer)>,
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
    let needs_lm = used_rewards(&cfg).iter().any(|r| match &r.kind {
        RewardKind::InverseLoss(c) => c.model == grpo_rewards::builtin::ScoringModel::Reference,
        RewardKind::CoverageCe(_) => true,
        _ => false,
    });
    let needs_rm = used_rewards(&cfg)
        .iter()
        .any(|r| matches!(r.kind, RewardKind::RewardModel(_)));
    let rm_path = cfg.reward_model_path.clone();
    let rewards = used_rewards(&cfg).to_vec();
    let compute_dtype = cfg.compute_dtype();
    let rm_dtype = cfg
        .reward_model_dtype
        .map_or_else(|| cfg.compute_dtype(), |d| d.dtype());
    let (rm_device, model_spec) = (cfg.reward_model_device, cfg.model.device);
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
            let device = side_device(rm_device, model_spec, model.device(), "reward_model_device")?;
            let rm = grpo_rollout::scoring::ClassifierModel::load(&path, rm_dtype, &device)
                .map_err(|e| anyhow!("reward model: {}", first_line(&e.to_string())))?;
            m.classifier = Some(Arc::new(rm));
        }
        m.step_classifiers =
            process_reward_models(&rewards, model_spec, model.device(), compute_dtype)?;
        Ok(m)
    })
}

/// The token classifiers the `process_reward_model` rewards among `rewards` name, each
/// directory loaded once: on the reward's `device` (absent: `model_spec`'s, `model`), in its
/// `dtype` (absent: `default_dtype`).
pub(crate) fn process_reward_models(
    rewards: &[grpo_rewards::RewardSpec],
    model_spec: grpo_rollout::DeviceSpec,
    model: &Device,
    default_dtype: candle_core::DType,
) -> Result<HashMap<std::path::PathBuf, Arc<dyn grpo_rewards::builtin::StepClassifier>>> {
    let mut out: HashMap<_, Arc<dyn grpo_rewards::builtin::StepClassifier>> = HashMap::new();
    for (i, r) in rewards.iter().enumerate() {
        let grpo_rewards::RewardKind::ProcessRewardModel(c) = &r.kind else {
            continue;
        };
        let Some(path) = &c.path else { continue };
        if out.contains_key(path) {
            continue;
        }
        let spec = c
            .device
            .as_deref()
            .map(str::parse::<grpo_rollout::DeviceSpec>)
            .transpose()
            .map_err(|e| anyhow!("config: rewards[{i}].device: {e}"))?;
        let dtype = match c.dtype.as_deref() {
            Some(d) => d
                .parse::<grpo_rollout::Dtype>()
                .map_err(|e| anyhow!("config: rewards[{i}].dtype: {e}"))?
                .dtype(),
            None => default_dtype,
        };
        let device = side_device(spec, model_spec, model, &format!("rewards[{i}].device"))?;
        let prm = grpo_rollout::scoring::TokenClassifierModel::load(path, dtype, &device)
            .map_err(|e| anyhow!("process reward model: {}", first_line(&e.to_string())))?;
        out.insert(path.clone(), Arc::new(prm));
    }
    Ok(out)
}

/// Whether an `inverse_loss` reward scores with the policy (`model = "policy"`).
fn scores_with_policy(cfg: &TrainConfig) -> bool {
    use grpo_rewards::RewardKind;
    use grpo_rewards::builtin::ScoringModel;
    used_rewards(cfg)
        .iter()
        .any(|r| matches!(&r.kind, RewardKind::InverseLoss(c) if c.model == ScoringModel::Policy))
}

/// The rewards the run scores with: the config's `[[rewards]]` for GRPO; none for SFT and DPO,
/// which never read them (a config shared with a GRPO run may keep its section).
fn used_rewards(cfg: &TrainConfig) -> &[grpo_rewards::RewardSpec] {
    if cfg.algorithm.generates() {
        &cfg.rewards
    } else {
        &[]
    }
}

/// Checks that `data` has the columns the run reads: the answer column of an `accuracy`,
/// `math_verify`, `coverage_ce`, `cosine_scaled` or `reasoning_accuracy` reward; the columns of a `command` reward's argv placeholders; DPO's chosen
/// and rejected completions; SFT's completion, unless the prompts are conversations whose
/// assistant turns carry the loss.
pub fn check_columns(cfg: &TrainConfig, data: &Dataset) -> grpo_data::Result<()> {
    for (i, spec) in used_rewards(cfg).iter().enumerate() {
        let needs = match &spec.kind {
            grpo_rewards::RewardKind::Accuracy(c) => Some(&c.answer_field),
            grpo_rewards::RewardKind::CoverageCe(c) => Some(&c.answer_field),
            grpo_rewards::RewardKind::CosineScaled(c) => Some(&c.answer_field),
            grpo_rewards::RewardKind::ReasoningAccuracy(c) => Some(&c.answer_field),
            grpo_rewards::RewardKind::MathVerify(c) => Some(&c.answer_field),
            grpo_rewards::RewardKind::Command(c) => {
                for col in c.columns() {
                    data.require_column(&col, &format!("`{{{col}}}` in `rewards[{i}].argv`"))?;
                }
                None
            }
            _ => None,
        };
        if let Some(col) = needs {
            data.require_column(col, &format!("the `{}` reward", spec.kind.type_name()))?;
        }
    }
    supervised_columns(cfg, data)
}

/// The column to read rows by when the prompt column is missing, as TRL reads such data:
/// DPO and KTO pairs by `chosen` (the prompt is their common beginning, see
/// `learner::supervised`), SFT conversations in `messages` or text in `sft.dataset_text_field`.
fn implied_prompt_field(cfg: &TrainConfig, found: &[String]) -> Option<String> {
    let has = |c: &str| found.iter().any(|f| f == c);
    match cfg.algorithm {
        Algorithm::Dpo if has(&cfg.dpo.chosen_field) && has(&cfg.dpo.rejected_field) => {
            Some(cfg.dpo.chosen_field.clone())
        }
        Algorithm::Kto | Algorithm::Bco if has("chosen") && has("rejected") => {
            Some("chosen".into())
        }
        Algorithm::Orpo | Algorithm::Cpo | Algorithm::Tpo
            if has(cfg.pair_fields().0) && has(cfg.pair_fields().1) =>
        {
            Some(cfg.pair_fields().0.to_string())
        }
        Algorithm::Reward if has(&cfg.reward.chosen_field) && has(&cfg.reward.rejected_field) => {
            Some(cfg.reward.chosen_field.clone())
        }
        Algorithm::Sft
        | Algorithm::Gkd
        | Algorithm::Distillation
        | Algorithm::IwOpd
        | Algorithm::Gold
            if has("messages") =>
        {
            Some("messages".into())
        }
        Algorithm::Sft if has(&cfg.sft.dataset_text_field) => {
            Some(cfg.sft.dataset_text_field.clone())
        }
        _ => None,
    }
}

/// Checks that the data has the columns SFT and DPO read.
pub fn supervised_columns(cfg: &TrainConfig, data: &Dataset) -> grpo_data::Result<()> {
    match cfg.algorithm {
        Algorithm::Dpo => {
            for col in [&cfg.dpo.chosen_field, &cfg.dpo.rejected_field] {
                data.require_column(col, "DPO (`dpo.chosen_field` / `dpo.rejected_field`)")?;
            }
        }
        // GKD's off-policy steps read the dataset's completions (unless the teacher samples
        // them): a completion column, or conversations that end with the assistant's turn.
        Algorithm::Distillation | Algorithm::Gkd | Algorithm::IwOpd | Algorithm::Gold
            if cfg.distillation.lmbda_for(cfg.algorithm) < 1.0
                && !cfg.distillation.seq_kd
                && !data.conversation_prompts() =>
        {
            data.require_column(
                &cfg.distillation.completion_field,
                "the off-policy steps of distillation.lmbda < 1 (`distillation.completion_field`, \
                 or conversation prompts ending with the assistant's turn)",
            )?
        }
        Algorithm::Orpo | Algorithm::Cpo | Algorithm::Tpo => {
            let a = cfg.algorithm;
            let (chosen, rejected) = cfg.pair_fields();
            let gold = (a == Algorithm::Tpo).then_some(cfg.tpo.reference_field.as_str());
            for col in [chosen, rejected].into_iter().chain(gold) {
                data.require_column(
                    col,
                    &format!(
                        "{} (`{a}.chosen_field` / `{a}.rejected_field`{})",
                        a.as_str().to_uppercase(),
                        if gold.is_some() {
                            " / `tpo.reference_field`"
                        } else {
                            ""
                        }
                    ),
                )?;
            }
        }
        Algorithm::Prm => {
            for col in [&cfg.prm.completions_field, &cfg.prm.labels_field] {
                data.require_column(
                    col,
                    "process reward modelling (`prm.completions_field` / `prm.labels_field`)",
                )?;
            }
        }
        Algorithm::Reward => {
            for col in [&cfg.reward.chosen_field, &cfg.reward.rejected_field] {
                data.require_column(
                    col,
                    "reward modelling (`reward.chosen_field` / `reward.rejected_field`)",
                )?;
            }
        }
        // Unpaired rows, or preference rows that KTO and BCO unpair (as TRL does).
        Algorithm::Kto | Algorithm::Bco
            if !(data.require_column("chosen", "").is_ok()
                && data.require_column("rejected", "").is_ok()) =>
        {
            for col in [&cfg.kto.completion_field, &cfg.kto.label_field] {
                data.require_column(
                    col,
                    "KTO (`kto.completion_field` / `kto.label_field`, or `chosen` / `rejected` pairs)",
                )?;
            }
        }
        // Language-modelling text (`data.prompt_field` = `sft.dataset_text_field`) needs no
        // completion column; plain prompts otherwise do.
        Algorithm::Sft
            if !data.conversation_prompts()
                && cfg.data.prompt_field != cfg.sft.dataset_text_field =>
        {
            data.require_column(
                &cfg.sft.completion_field,
                "SFT (`sft.completion_field`, conversational prompts with assistant turns, or \
                 language-modelling text: `data.prompt_field` = `sft.dataset_text_field`)",
            )?
        }
        _ => {}
    }
    Ok(())
}

/// Generation batches of a run over `rows` training rows: `train.max_steps`, else
/// `num_train_epochs` passes of `prompts_per_step` rows (at least one step).
pub fn total_steps(cfg: &TrainConfig, rows: u64) -> usize {
    match cfg.train.max_steps {
        Some(n) => n,
        None => {
            let per_epoch = rows as f64 / cfg.train.prompts_per_step as f64;
            ((per_epoch * cfg.train.num_train_epochs).ceil() as usize).max(1)
        }
    }
}

/// [`setup`] with the scoring models (for `inverse_loss`, `coverage_ce`, `reward_model`)
/// built by `models` from the loaded policy and tokenizer.
pub fn setup_with(
    mut cfg: TrainConfig,
    models: impl FnOnce(&Transformer, &Tokenizer) -> Result<grpo_rewards::ScoringModels>,
) -> Result<Setup> {
    // The resolved learning rate (TRL's default for the algorithm when absent) is what the
    // run directory's config.json records.
    cfg.optim.learning_rate = Some(cfg.learning_rate());
    cfg.validate().map_err(|e| anyhow!("config: {e}"))?;
    let device = cfg
        .model
        .device
        .device()
        .map_err(|e| anyhow!("config: `model.device`: {e}"))?;
    // A spec equal to the model's is the model's device itself (two handles of one GPU are
    // two devices to candle) — except for a generator that overlaps the learner on one GPU,
    // which gets a handle of its own.
    let rollout_device = match cfg.rollout.device {
        Some(spec) if spec != cfg.model.device => Some(
            spec.device()
                .map_err(|e| anyhow!("config: `rollout.device`: {e}"))?,
        ),
        _ if own_generator_handle(&cfg, std::env::var("GRPO_GENERATOR_HANDLE").ok()) => Some(
            cfg.model
                .device
                .device()
                .map_err(|e| anyhow!("config: `model.device`: {e}"))?,
        ),
        _ => None,
    };
    let dtype = cfg.compute_dtype();
    // Without data files the rows come later, from `fit` with a dataset — or, for an
    // environment that owns its data and a run of `max_steps`, each step's prompts are empty
    // user messages that its `reset` fills (TRL's placeholder dataset).
    let splits = match cfg.data.path.is_empty() {
        true if cfg.environment.owns_data() && cfg.train.max_steps.is_some_and(|s| s > 0) => {
            grpo_data::Splits {
                train: Dataset::empty_conversations(
                    &cfg.data.prompt_field,
                    cfg.train.prompts_per_step,
                )
                .map_err(|e| anyhow!("data: {e}"))?,
                eval: None,
            }
        }
        true => grpo_data::Splits {
            train: Dataset::empty(&cfg.data.prompt_field),
            eval: None,
        },
        false => {
            let opened = cfg.data.open(cfg.train.seed);
            let implied = match &opened {
                Err(grpo_data::DataError::NoPromptColumn { found, .. }) => {
                    implied_prompt_field(&cfg, found)
                }
                _ => None,
            };
            let splits = match implied {
                Some(column) => {
                    cfg.data.prompt_field = column;
                    cfg.data.open(cfg.train.seed)
                }
                None => opened,
            }
            .map_err(|e| anyhow!("data: {e}"))?;
            if splits.train.is_empty() {
                bail!("data: {:?} has no rows", cfg.data.path);
            }
            check_columns(&cfg, &splits.train).map_err(|e| anyhow!("data: {e}"))?;
            splits
        }
    };
    let mut loaded = grpo_rollout::load(&cfg.model.path, dtype, &device)
        .map_err(|e| anyhow!("model: {}", first_line(&e.to_string())))?;
    grpo_core::memlog::log("setup: model loaded", &device);
    loaded.tokenizer.chat_template_kwargs = cfg.model.chat_template_kwargs.clone();
    // TRL's SFTConfig and RewardConfig `eos_token` / `pad_token`: tokens of the vocabulary,
    // by their text.
    let special = match cfg.algorithm {
        Algorithm::Sft => Some((&cfg.sft.eos_token, &cfg.sft.pad_token)),
        Algorithm::Reward => Some((&cfg.reward.eos_token, &cfg.reward.pad_token)),
        _ => None,
    };
    if let Some((eos_token, pad_token)) = special {
        let tok = &mut loaded.tokenizer;
        let section = cfg.algorithm;
        let id = |t: &str, key: &str| {
            tok.inner
                .token_to_id(t)
                .ok_or_else(|| anyhow!("`{section}.{key}`: {t:?} is not in the model's vocabulary"))
        };
        if let Some(t) = eos_token {
            let eos = id(t, "eos_token")?;
            tok.eos_token = Some(t.clone());
            tok.eos_token_ids = vec![eos];
        }
        if let Some(t) = pad_token {
            tok.pad_token_id = id(t, "pad_token")?;
        }
    }
    // A reward model is a sequence classifier: a causal LM gets a fresh `score` head (as
    // transformers' `AutoModelForSequenceClassification` makes one, seeded by `train.seed`);
    // a classifier checkpoint keeps its own. Every other algorithm needs an LM head.
    // A process reward model is a token classifier with two labels, made the same way.
    match (cfg.algorithm, loaded.model.score.is_some()) {
        (Algorithm::Reward, _) => {
            loaded.model = loaded
                .model
                .into_sequence_classifier(cfg.train.seed)
                .map_err(|e| anyhow!("model {}: {e}", cfg.model.path.display()))?;
        }
        (Algorithm::Prm, _) => {
            loaded.model = loaded
                .model
                .into_token_classifier(2, cfg.train.seed)
                .map_err(|e| anyhow!("model {}: {e}", cfg.model.path.display()))?;
        }
        (a, true) if loaded.model.cfg.token_classification.is_some() => bail!(
            "model: {} is a token classifier (a process reward model, no LM head); algorithm = \
             \"{a}\" trains a causal LM (a process reward model trains with algorithm = \"prm\")",
            cfg.model.path.display()
        ),
        (a, true) => bail!(
            "model: {} is a sequence classifier (a reward model, no LM head); algorithm = \"{a}\" \
             trains a causal LM (a reward model trains with algorithm = \"reward\")",
            cfg.model.path.display()
        ),
        _ => {}
    }
    if let Some(p) = cfg.model.chat_template_path.clone() {
        let added = loaded
            .clone_chat_template(&p)
            .map_err(|e| anyhow!("`model.chat_template_path`: {e}"))?;
        // With LoRA the added tokens' rows are trained as TRL trains them: PEFT's
        // `trainable_token_indices` on the embedding (extended, when the config has some).
        if let (false, Some(l)) = (added.is_empty(), cfg.model.lora.as_mut()) {
            let mut ids = match &l.trainable_token_indices {
                Some(t) => t
                    .embedding()
                    .map_err(|e| anyhow!("config: model.lora.{e}"))?,
                None => Vec::new(),
            };
            ids.extend(
                added
                    .iter()
                    .filter(|i| !ids.contains(i))
                    .copied()
                    .collect::<Vec<_>>(),
            );
            l.trainable_token_indices = Some(grpo_rollout::lora::TokenIndices::ByLayer(
                [("embed_tokens".to_string(), ids)].into(),
            ));
        }
    }
    if cfg.model.cast_lm_head_to_fp32 {
        // Before anything shares the weights: the policy, its reference, the generator's
        // copies and the scorers all read this head.
        loaded.model.cast_head_to_f32()?;
    }
    let mut scoring = models(&loaded.model, &loaded.tokenizer)?;
    let policy_scorer = match scores_with_policy(&cfg) && scoring.policy.is_none() {
        true => {
            let p = Arc::new(crate::stages::PolicyScorer::new(loaded.tokenizer.clone()));
            scoring.policy = Some(p.clone());
            Some(p)
        }
        false => None,
    };
    // One Python worker per interpreter for the run: rewards, tools and environments.
    let python_workers = grpo_rewards::python::PythonWorkers::new();
    let mut rewards = if used_rewards(&cfg).is_empty() {
        RewardSet::new()
    } else {
        cfg.rewards_config()
            .build_with(&scoring, &python_workers)
            .map_err(|e| anyhow!("config: {e}"))?
    };
    let environment = configured_environment(&cfg, &python_workers)?;
    let (teaching, frozen_teacher) = match &cfg.teacher {
        None => (None, None),
        Some(t) => {
            let reward = crate::teacher::teaching_reward(t, &scoring, &splits.train)?;
            rewards.push_async_reward("adaptive_teaching", 1.0, Arc::new(reward));
            let chat = cfg.rollout.chat_template;
            let student = match &t.student_model {
                Some(p) => {
                    let sdev = side_device(
                        t.student_device,
                        cfg.model.device,
                        &device,
                        "teacher.student_device",
                    )?;
                    let sdtype = t.student_dtype.map_or(dtype, |d| d.dtype());
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
        // TRL's `disable_dropout` zeroes every dropout module, LoRA's included; the saved
        // adapter config keeps the configured value, as PEFT's does.
        Some(l) if cfg.dropout_disabled() => {
            let off = LoraConfig {
                lora_dropout: 0.0,
                ..l.clone()
            };
            let mut p = TrainableModel::lora(&loaded.model, &off, cfg.train.seed)?;
            p.lora = Some(l.for_model(&loaded.model)?);
            p
        }
        Some(l) => TrainableModel::lora(&loaded.model, l, cfg.train.seed)?,
        None => TrainableModel::full(&loaded.model)?,
    };
    if cfg.train.gradient_checkpointing {
        policy.model.enable_gradient_checkpointing();
    } else if cfg.model.lora.is_none()
        && grpo_rollout::model::layer_segments_wanted(policy.model.device())
    {
        // A full fine-tune's weight gradients then never coexist with all its activations.
        policy.model.enable_layer_segments();
    }
    // The loaded weights are never written in place (full fine-tuning trains its own copies),
    // so every frozen model shares them: the reference, the scorers, the teacher.
    let reference = if (cfg.reference.beta > 0.0 && cfg.algorithm != Algorithm::Reward)
        || matches!(
            cfg.algorithm,
            Algorithm::Dpo | Algorithm::Kto | Algorithm::Bco | Algorithm::A2po
        )
        || cfg.algorithm.is_online_dpo()
        || (cfg.algorithm == Algorithm::Rloo && cfg.rloo.beta > 0.0)
        || (cfg.algorithm == Algorithm::Grpo && cfg.loss.use_kl_in_reward)
        || cfg.algorithm == Algorithm::Ppo
    {
        Some(match &cfg.model.lora {
            // LoRA: the policy's own base with its adapters switched off, as TRL does with
            // peft: no copy at all.
            Some(_) => policy.model.without_adapters(),
            None => loaded.model.detached(),
        })
    } else {
        None
    };
    grpo_core::memlog::log("setup: policy and reference ready", &device);
    let remote = if cfg.rollout.backend == Backend::Openai && cfg.algorithm.generates() {
        let g = RemoteGenerator::connect(cfg.rollout.openai.remote_config())
            .map_err(|e| anyhow!("rollout.openai ({}): {e}", cfg.rollout.openai.base_url))?;
        Some(Arc::new(Mutex::new(g)))
    } else {
        None
    };
    let teacher_server = match (
        &cfg.distillation.teacher_server,
        cfg.algorithm.is_distillation(),
    ) {
        (Some(t), true) => {
            let g = RemoteGenerator::connect(t.remote_config())
                .map_err(|e| anyhow!("distillation.teacher_server ({}): {e}", t.base_url))?;
            Some(Arc::new(Mutex::new(g)))
        }
        _ => None,
    };
    let mut teacher_tokenizer = None;
    let distillation_teacher = match cfg.algorithm {
        a if a.is_distillation() && teacher_server.is_some() => None,
        a if a.is_distillation() || a == Algorithm::MiniLlm => {
            let (t, tok) = distillation_teacher(&cfg, &policy.model, &loaded.tokenizer)?;
            teacher_tokenizer = tok;
            Some(t)
        }
        // SDPO's and SDFT's teacher is the policy itself: as it starts (`base`; with LoRA, its adapters
        // off) or its EMA (full fine-tuning: a copy that starts as the loaded weights, which
        // nothing writes in place; LoRA: adapters the learner keeps).
        Algorithm::Sdpo | Algorithm::Sdft => match (
            cfg.self_distill().map(|d| d.teacher).unwrap_or_default(),
            &cfg.model.lora,
        ) {
            (crate::config::SdpoTeacher::Live, _) | (crate::config::SdpoTeacher::Ema, Some(_)) => {
                None
            }
            (_, Some(_)) => Some(policy.model.without_adapters()),
            (_, None) => Some(loaded.model.detached()),
        },
        _ => None,
    };
    let value_model = match cfg.algorithm {
        Algorithm::Ppo => Some(value_model(&cfg, &loaded.model, &loaded.tokenizer)?),
        _ => None,
    };
    let udm_embedder = match (&cfg.bco.embedding_model_name_or_path, cfg.algorithm) {
        (Some(p), Algorithm::Bco) => {
            let m = grpo_rollout::load(p, cfg.compute_dtype(), &device).map_err(|e| {
                anyhow!(
                    "bco.embedding_model_name_or_path {}: {}",
                    p.display(),
                    first_line(&e.to_string())
                )
            })?;
            Some((m.model, m.tokenizer))
        }
        _ => None,
    };
    let total_steps = total_steps(&cfg, splits.train.len());
    Ok(Setup {
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
        policy_scorer,
        environment,
        rollout_device,
        distillation_teacher,
        teacher_tokenizer,
        teacher_server,
        a2po_values: None,
        value_model,
        udm_embedder,
        cfg,
    })
}

/// Whether two tokenizers encode a probe text alike: a second model that reads the policy's
/// token ids (a distillation teacher, PPO's value model) must share its tokenizer.
fn encode_alike(a: &Tokenizer, b: &Tokenizer) -> Result<bool> {
    let probe = "The two models read the same tokens: 12 + 30 = 42.";
    Ok(a.encode(probe, false)? == b.encode(probe, false)?)
}

/// PPO's value model: `ppo.value_model_name_or_path` (a sequence classifier as saved, a causal
/// LM with a fresh one-label head), else the policy's model with a fresh head; on the policy's
/// device and in its dtype, every weight trainable. It reads the policy's tokens, so its
/// vocabulary must cover them and its tokenizer encode as the policy's does.
fn value_model(
    cfg: &TrainConfig,
    policy: &Transformer,
    tokenizer: &Tokenizer,
) -> Result<TrainableModel> {
    let (model, path) = match &cfg.ppo.value_model_name_or_path {
        Some(p) => {
            let loaded = grpo_rollout::load(p, policy.dtype(), policy.device()).map_err(|e| {
                anyhow!(
                    "ppo.value_model_name_or_path {}: {}",
                    p.display(),
                    first_line(&e.to_string())
                )
            })?;
            if !encode_alike(&loaded.tokenizer, tokenizer)? {
                bail!(
                    "ppo.value_model_name_or_path {}: its tokenizer encodes text differently from \
                     the policy's (the value model reads the policy's tokens)",
                    p.display()
                );
            }
            (loaded.model, p.clone())
        }
        None => (policy.detached(), cfg.model.path.clone()),
    };
    let (vv, pv) = (model.cfg.vocab_size, policy.cfg.vocab_size);
    if vv < pv {
        bail!(
            "ppo.value_model_name_or_path {}: its vocabulary has {vv} tokens, the policy's {pv}",
            path.display()
        );
    }
    if model.cfg.token_classification.is_some() {
        bail!(
            "ppo.value_model_name_or_path {}: a token classifier; the value model is a sequence \
             classifier (*ForSequenceClassification, one label) or a causal LM",
            path.display()
        );
    }
    let model = model
        .into_sequence_classifier(cfg.train.seed)
        .map_err(|e| anyhow!("ppo value model {}: {e}", path.display()))?;
    if let Some(score) = &model.score
        && score.dim(0)? != 1
    {
        bail!(
            "ppo.value_model_name_or_path {}: a classifier with {} labels; the value model has one",
            path.display(),
            score.dim(0)?
        );
    }
    let mut value = TrainableModel::full(&model)?;
    if cfg.train.gradient_checkpointing {
        value.model.enable_gradient_checkpointing();
    } else if grpo_rollout::model::layer_segments_wanted(value.model.device()) {
        value.model.enable_layer_segments();
    }
    Ok(value)
}

/// Loads `distillation.teacher_model_name_or_path` on `distillation.teacher_device` (default
/// the model's) in `distillation.teacher_dtype` (default the compute dtype). It must be a causal
/// LM whose vocabulary covers the student's; its tokenizer must encode as the student's does
/// (the completions are the student's tokens).
fn distillation_teacher(
    cfg: &TrainConfig,
    student: &Transformer,
    tokenizer: &Tokenizer,
) -> Result<(Transformer, Option<Tokenizer>)> {
    let d = &cfg.distillation;
    let path = d
        .teacher_model_name_or_path
        .as_ref()
        .context("`distillation.teacher_model_name_or_path` is required")?;
    let device = side_device(
        d.teacher_device,
        cfg.model.device,
        student.device(),
        "distillation.teacher_device",
    )?;
    let dtype = d
        .teacher_dtype
        .map_or_else(|| cfg.compute_dtype(), |t| t.dtype());
    let teacher = grpo_rollout::load(path, dtype, &device)
        .and_then(grpo_rollout::LoadedModel::causal)
        .map_err(|e| anyhow!("distillation teacher: {}", first_line(&e.to_string())))?;
    // GOLD's ULD: a teacher with a tokenizer of its own.
    if cfg.algorithm == Algorithm::Gold && cfg.gold.use_uld_loss {
        let tok = match &cfg.gold.teacher_tokenizer_name_or_path {
            Some(p) => grpo_rollout::loader::load_tokenizer(p).map_err(|e| {
                anyhow!(
                    "gold.teacher_tokenizer_name_or_path {}: {}",
                    p.display(),
                    first_line(&e.to_string())
                )
            })?,
            None => teacher.tokenizer,
        };
        return Ok((teacher.model, Some(tok)));
    }
    let (tv, sv) = (teacher.model.cfg.vocab_size, student.cfg.vocab_size);
    if tv < sv {
        bail!(
            "distillation teacher {}: its vocabulary has {tv} tokens, the student's {sv}: the two \
             must share the student's tokenizer",
            path.display()
        );
    }
    if !encode_alike(&teacher.tokenizer, tokenizer)? {
        bail!(
            "distillation teacher {}: its tokenizer encodes text differently from the student's \
             (the teacher scores the student's tokens, so they must share a tokenizer)",
            path.display()
        );
    }
    Ok((teacher.model, None))
}

/// Whether the local generator samples through a candle device of its own on the model's GPU:
/// when it overlaps the learner there (`pipeline.max_staleness >= 1`, no other
/// `rollout.device`). candle keeps one cuBLAS handle per device, and cuBLAS advises against
/// one handle shared by threads that run at once (its workspace is chosen per stream, and
/// both threads issue on the per-thread default stream, one stream value); torch keeps a
/// handle per thread. Each version is then published onto the generator's device (a
/// device-to-device copy of the trainable weights, the copy a stale version needs anyway; a
/// LoRA run also keeps one copy of its frozen base there). `GRPO_GENERATOR_HANDLE=shared`
/// (`env`) keeps the one handle.
pub fn own_generator_handle(cfg: &TrainConfig, env: Option<String>) -> bool {
    use crate::config::Backend;
    matches!(cfg.model.device, grpo_rollout::DeviceSpec::Cuda(_))
        && cfg.rollout.device.is_none_or(|d| d == cfg.model.device)
        && cfg.rollout.backend == Backend::Local
        && cfg.pipeline.max_staleness >= 1
        && cfg.algorithm.generates()
        && env.as_deref() != Some("shared")
}

/// The device of a side model (reward model, student, distillation teacher): its own `spec`,
/// else the model's. A spec equal to `model.device` is the model's device itself (two candle
/// handles of one GPU are two devices).
fn side_device(
    spec: Option<grpo_rollout::DeviceSpec>,
    model_spec: grpo_rollout::DeviceSpec,
    model: &Device,
    key: &str,
) -> Result<Device> {
    match spec {
        Some(s) if s != model_spec => s.device().map_err(|e| anyhow!("config: `{key}`: {e}")),
        _ => Ok(model.clone()),
    }
}

/// The environment `[environment] type` names, built (`None` without `type`).
pub fn configured_environment(
    cfg: &TrainConfig,
    workers: &grpo_rewards::python::PythonWorkers,
) -> Result<Option<Arc<dyn grpo_rollout::Environment>>> {
    use crate::config::EnvironmentKind;
    let env = &cfg.environment;
    Ok(match env.kind {
        None => None,
        Some(_) if !cfg.algorithm.generates() => {
            bail!(
                "environment.type: only GRPO and RLOO run episodes (algorithm = {:?})",
                cfg.algorithm
            )
        }
        Some(EnvironmentKind::Tools) => {
            let mut tools: Vec<Arc<dyn grpo_rollout::Tool>> = Vec::new();
            for (i, t) in env.tools.iter().enumerate() {
                let tool = t
                    .build(workers)
                    .map_err(|e| anyhow!("config: environment.tools[{i}]: {e}"))?;
                tools.push(Arc::from(tool));
            }
            let e = grpo_rollout::ToolEnvironment::new(tools)
                .map_err(|e| anyhow!("config: environment.tools: {e}"))?
                .with_max_calls_per_turn(env.max_calls_per_turn);
            Some(Arc::new(e))
        }
        Some(EnvironmentKind::Python) => {
            let Some(p) = &env.python else {
                bail!("config: environment.type = \"python\" needs [environment.python]");
            };
            let e = grpo_rollout::python_env::PythonEnvironment::new(p, workers)
                .map_err(|e| anyhow!("config: environment.python: {e}"))?;
            Some(Arc::new(e))
        }
        Some(EnvironmentKind::Factory) => {
            use grpo_rollout::python_env::{PythonFactoryEnvironment, PythonFactoryRouter};
            let build = |key: &str, p| -> Result<PythonFactoryEnvironment> {
                Ok(PythonFactoryEnvironment::new(p, workers)
                    .map_err(|e| anyhow!("config: {key}: {e}"))?
                    .with_max_calls_per_turn(env.max_calls_per_turn))
            };
            match &env.python {
                // One class, or several routed by the rows' `environment` column.
                Some(p) => Some(Arc::new(build("environment.python", p)?)),
                None => {
                    let envs = env
                        .factories
                        .iter()
                        .map(|(name, p)| {
                            Ok((
                                name.clone(),
                                build(&format!("environment.factories.{name}"), p)?,
                            ))
                        })
                        .collect::<Result<_>>()?;
                    let e = PythonFactoryRouter::new(envs)
                        .map_err(|e| anyhow!("config: environment.factories: {e}"))?;
                    Some(Arc::new(e))
                }
            }
        }
        Some(EnvironmentKind::Ors) => {
            let Some(o) = &env.ors else {
                bail!("config: environment.type = \"ors\" needs [environment.ors]");
            };
            let mut o = o.clone();
            o.max_calls_per_turn = env.max_calls_per_turn;
            let e = grpo_rollout::Blocking::build(grpo_rollout::ors::OrsEnvironment::connect(&o))
                .map_err(|e| anyhow!("config: environment.ors: {e}"))?;
            Some(Arc::new(e))
        }
    })
}

#[cfg(test)]
mod tests {
    use super::own_generator_handle;
    use crate::config::{Algorithm, Backend, TrainConfig};
    use grpo_rollout::DeviceSpec;

    /// The overlapped generator on one GPU gets a handle of its own, and only it.
    #[test]
    fn an_overlapped_generator_on_one_gpu_gets_its_own_handle() {
        let overlapped = || {
            let mut c = TrainConfig::default();
            c.model.device = DeviceSpec::Cuda(0);
            c.pipeline.max_staleness = 1;
            c
        };
        assert!(own_generator_handle(&overlapped(), None));
        // The same GPU named again is still the one GPU.
        let mut c = overlapped();
        c.rollout.device = Some(DeviceSpec::Cuda(0));
        assert!(own_generator_handle(&c, None));
        // Not: the switch, the CPU, on-policy, another device, a server, no generation.
        assert!(!own_generator_handle(&overlapped(), Some("shared".into())));
        let mut c = overlapped();
        c.model.device = DeviceSpec::Cpu;
        assert!(!own_generator_handle(&c, None));
        let mut c = overlapped();
        c.pipeline.max_staleness = 0;
        assert!(!own_generator_handle(&c, None));
        let mut c = overlapped();
        c.rollout.device = Some(DeviceSpec::Cuda(1));
        assert!(!own_generator_handle(&c, None));
        let mut c = overlapped();
        c.rollout.backend = Backend::Openai;
        assert!(!own_generator_handle(&c, None));
        let mut c = overlapped();
        c.algorithm = Algorithm::Sft;
        assert!(!own_generator_handle(&c, None));
    }
}
