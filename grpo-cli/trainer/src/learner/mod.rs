//! The learner: the policy, its optimizer and the step that updates them. By concern:
//!
//! - [`batch`]: a step's completions as micro-batches, masks and log-probs;
//! - [`loss`]: the GRPO step (old / reference log-probs, off-policy weights, the loss and its
//!   gradients over the micro-batches);
//! - [`step`]: the optimizer update (clipping, schedule, AdamW) and the reference sync;
//! - [`metrics`]: the step's metrics by TRL's names;
//! - [`supervised`]: the SFT, DPO, KTO, ORPO, CPO and reward-model steps on the same learner;
//! - [`distill`]: on-policy distillation's step (the teacher's distributions on the policy's
//!   samples); `gold`: GOLD's universal logit distillation for a teacher with another
//!   tokenizer;
//! - [`minillm`]: MiniLLM's forward inside the GRPO step (the teacher's reverse-KL advantages
//!   and single-step term);
//! - [`a2po`]: A*-PO's value estimation (stage 1) and step (stage 2);
//! - [`online_dpo`]: online DPO's and XPO's step (two samples per prompt, the rewards pick the
//!   chosen one, DPO's loss against the reference); [`nash_md`]: Nash-MD's (the policy's
//!   sample against the policy–reference mixture's, a REINFORCE step on the preference);
//! - `bco_udm`: BCO's underlying distribution matching (the prompt classifier and its weights);
//! - [`ppo`]: PPO's step with its value model (the critic trained beside the policy, GAE);
//! - [`bema`]: the bias-corrected EMA of the weights (`[bema]`, TRL's `BEMACallback`);
//! - [`sdpo`]: SDPO's and SDFT's step (the policy distilled from itself shown a successful
//!   sibling, feedback or privileged context) and their EMA teacher.
//!
//! Checkpoints of the learner are in [`crate::checkpoint`].

pub mod a2po;
pub mod batch;
mod bco_udm;
pub mod bema;
pub mod distill;
mod gold;
pub mod loss;
pub mod metrics;
pub mod minillm;
pub mod nash_md;
pub mod online_dpo;
pub mod ppo;
pub mod sdpo;
pub mod ssd;
pub mod step;
pub mod supervised;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::Result;
use candle_core::Device;
use grpo_data::Position;
use grpo_rollout::model::DeviceCopies;
use grpo_rollout::{Tokenizer, TrainableModel, Transformer};
use serde::{Deserialize, Serialize};

use crate::config::TrainConfig;
use crate::optim::{AdamW, AdamWParams, Schedule};
use crate::setup::Setup;

/// The learner's persistent state besides the weights (what callbacks read, and what a
/// checkpoint's `trainer_state.json` holds).
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrainerState {
    /// Steps (generation batches) done.
    pub step: usize,
    /// Steps the run takes in all (TRL's `max_steps`).
    #[serde(default)]
    pub max_steps: usize,
    /// Data position after the last trained batch.
    pub position: Option<Position>,
    /// Prompt + completion tokens trained on so far (TRL's `num_tokens`).
    pub num_tokens: u64,
    /// Passes over the data.
    pub epoch: f64,
    /// Optimizer updates done (step × num_iterations × updates per step).
    pub optimizer_steps: usize,
    /// Adaptive entropy control (`loss.use_adaptive_entropy`): the coefficient after the last
    /// optimizer update (`None`: `loss.entropy_coef`, not yet adjusted).
    #[serde(default)]
    pub entropy_coef: Option<f64>,
    /// Adaptive entropy control: the mean entropy measured over the last optimizer update's
    /// tokens (`None`: not measured yet, TRL's `inf`: no bonus applies).
    #[serde(default)]
    pub last_entropy: Option<f64>,
    /// BCO: the running moments of the implicit rewards (its `delta` is their mean; TRL keeps
    /// them in `running.json`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bco_running: Option<grpo_core::preference::RunningMoments>,
    /// BCO's UDM classifier (`[bco] embedding_model_name_or_path`), fitted before the first
    /// step (TRL keeps it in `clf.pkl`).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub bco_udm: Option<grpo_core::udm::UdmClassifier>,
    /// `loss.use_kl_in_reward` with an adaptive `loss.kl_ctrl`: the coefficient after the last
    /// step (`None`: `kl_ctrl.kl_coef`, not yet moved).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub kl_ctrl_value: Option<f64>,
    /// DAPO's dynamic sampling (`loss.filter_groups`): the generation batches drawn through
    /// the last step trained (a resumed run draws on from there).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub draws: Option<usize>,
}

/// Computes the loss and updates the weights; its state is what checkpoints hold.
pub struct Learner {
    pub(crate) cfg: TrainConfig,
    pub(crate) device: Device,
    pub(crate) tokenizer: Tokenizer,
    pub(crate) policy: TrainableModel,
    pub(crate) reference: Option<Transformer>,
    /// On-policy distillation's frozen teacher; SDPO's `base` or EMA teacher.
    pub(crate) distillation_teacher: Option<Transformer>,
    /// The rollout server (`rollout.backend = "openai"`), which SDPO's `use_teacher_server`
    /// scores on.
    pub(crate) remote:
        Option<std::sync::Arc<std::sync::Mutex<grpo_rollout::remote::RemoteGenerator>>>,
    /// GOLD's ULD: the teacher's tokenizer and the loss's settings.
    pub(crate) gold: Option<(Tokenizer, grpo_core::uld::UldConfig)>,
    /// IW-OPD's teacher on a server.
    pub(crate) teacher_server:
        Option<std::sync::Arc<std::sync::Mutex<grpo_rollout::remote::RemoteGenerator>>>,
    /// SDPO's EMA teacher of a LoRA policy: its adapter tensors by PEFT key.
    pub(crate) sdpo_shadow: Option<std::collections::HashMap<String, candle_core::Tensor>>,
    /// `[bema]`'s state.
    pub(crate) bema: Option<bema::Bema>,
    /// `loss.replay_buffer_size`: the replay buffer after the last step trained (what a
    /// checkpoint keeps; a resumed run's scorer starts from it).
    pub replay_buffer: Option<crate::stages::replay::ReplayBuffer>,
    /// A*-PO's optimal values by row index.
    pub(crate) a2po_values: Option<std::sync::Arc<std::collections::HashMap<u64, f64>>>,
    /// PPO's value model and its optimizer.
    pub(crate) critic: Option<ppo::Critic>,
    /// BCO's UDM embedding model and its tokenizer.
    pub(crate) udm_embedder: Option<(Transformer, Tokenizer)>,
    pub(crate) opt: AdamW,
    pub(crate) schedule: Schedule,
    /// The reward set's weights, in its order (for the reward metrics).
    pub(crate) reward_weights: Vec<f32>,
    /// Progress so far.
    pub state: TrainerState,
    pub(crate) run_dir: PathBuf,
    pub(crate) base_model: String,
    /// Checkpoints written (or queued to the writer), oldest first.
    pub checkpoints: Vec<PathBuf>,
    /// True while a step has changed weights it has not finished: a checkpoint then would mix
    /// two steps.
    pub(crate) updating: bool,
    /// The generator's own device (`Setup::rollout_device`), where published copies are made,
    /// with the frozen weights already moved there.
    publish_to: Option<(Device, std::sync::Mutex<DeviceCopies>)>,
}

impl std::fmt::Debug for Learner {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Learner")
            .field("state", &self.state)
            .finish_non_exhaustive()
    }
}

impl Learner {
    /// The load-balancing loss's collector for one micro-batch of an update of `ga`
    /// micro-batches (TRL's `router_aux_loss_coef · aux / gradient_accumulation_steps`), or
    /// `None` when the policy has no experts or the coefficient is 0.
    pub(crate) fn aux_collector(
        &self,
        ga: f64,
    ) -> Option<std::sync::Arc<grpo_rollout::moe::AuxCollector>> {
        let moe = self.policy.model.cfg.moe.as_ref()?;
        let coef = self
            .cfg
            .loss
            .router_aux_loss_coef
            .unwrap_or(moe.router_aux_loss_coef);
        (coef != 0.0).then(|| grpo_rollout::moe::AuxCollector::new(coef / ga))
    }

    /// Takes the policy out of `setup`.
    pub fn new(setup: &Setup, run_dir: &Path) -> Result<Self> {
        if let Some(c) = setup.cfg.loss.router_aux_loss_coef
            && c != 0.0
            && setup.policy.model.cfg.moe.is_none()
        {
            anyhow::bail!(
                "loss.router_aux_loss_coef = {c}, but {} is not a mixture-of-experts model: there is no load-balancing loss to weight",
                setup.policy.model.cfg.arch.as_str()
            );
        }
        if let Some(c) = setup.cfg.loss.router_aux_loss_coef
            && c != 0.0
            && let Some(m) = &setup.policy.model.cfg.moe
            && m.routing != grpo_rollout::config::Routing::Softmax
        {
            anyhow::bail!(
                "loss.router_aux_loss_coef = {c}, but {}'s router has no load-balancing loss (transformers computes none for it)",
                setup.policy.model.cfg.arch.as_str()
            );
        }
        let o = &setup.cfg.optim;
        let opt = new_optimizer(&setup.cfg, setup.policy.vars.clone())?;
        let total_updates = setup.total_steps * o.num_iterations * setup.cfg.updates_per_step();
        let warmup = if o.warmup_steps > 0 {
            o.warmup_steps
        } else {
            (o.warmup_ratio * total_updates as f64).ceil() as usize
        };
        let bema = match &setup.cfg.bema {
            Some(c) if c.update_ref_model && setup.reference.is_none() => anyhow::bail!(
                "`bema.update_ref_model`: this run has no reference model to replace (it has one with `reference.beta` > 0, DPO, KTO, online DPO, A*-PO or RLOO's `rloo.beta` > 0)"
            ),
            Some(c) => Some(bema::Bema::start(c, opt.vars())?),
            None => None,
        };
        let critic = Self::critic_of(setup)?;
        let mut learner = Self {
            cfg: setup.cfg.clone(),
            device: setup.device.clone(),
            tokenizer: setup.tokenizer.clone(),
            policy: setup.policy.clone(),
            reference: setup.reference.clone(),
            distillation_teacher: setup.distillation_teacher.clone(),
            gold: gold_state(setup),
            teacher_server: setup.teacher_server.clone(),
            remote: setup.remote.clone(),
            sdpo_shadow: None,
            bema,
            replay_buffer: (setup.cfg.loss.replay_buffer_size > 0).then(|| {
                crate::stages::replay::ReplayBuffer::new(setup.cfg.loss.replay_buffer_size)
            }),
            a2po_values: setup.a2po_values.clone(),
            critic,
            udm_embedder: setup.udm_embedder.clone(),
            opt,
            schedule: Schedule {
                kind: o.lr_scheduler_type,
                lr: setup.cfg.learning_rate(),
                warmup,
                total: total_updates,
                kwargs: o.lr_scheduler_kwargs.clone(),
            },
            reward_weights: setup.rewards.weights(),
            state: TrainerState {
                max_steps: setup.total_steps,
                ..Default::default()
            },
            run_dir: run_dir.to_path_buf(),
            base_model: setup.cfg.model.path.display().to_string(),
            checkpoints: Vec::new(),
            updating: false,
            publish_to: setup
                .rollout_device
                .clone()
                .map(|d| (d, std::sync::Mutex::new(DeviceCopies::default()))),
        };
        if setup
            .cfg
            .self_distill()
            .is_some_and(|d| d.teacher == crate::config::SdpoTeacher::Ema)
            && let Some(cfg) = &learner.policy.lora
        {
            let start = sdpo::lora_ema_start(&learner.policy.model, cfg)?;
            learner.set_lora_teacher(start)?;
        }
        Ok(learner)
    }

    /// The current policy for the generator, detached: the trainable weights copied (for LoRA
    /// only the adapters), the frozen ones shared — or, for a full fine-tune at
    /// `pipeline.max_staleness = 0`, every weight shared ([`Self::shares_published_weights`]).
    /// When the generator has a device of its own (`rollout.device`, or its own handle of the
    /// GPU when it overlaps the learner: [`crate::setup::own_generator_handle`]), the copies
    /// are made there, the frozen weights moved once.
    ///
    /// On CUDA, candle queues work on the calling thread's default stream, and the generator
    /// runs on another thread (another stream, which does not wait for this one): the copies
    /// (and the optimizer's writes) are waited for here, before another thread can read them.
    pub fn publish(&self) -> Result<Arc<Transformer>> {
        let snapshot = match &self.publish_to {
            _ if self.shares_published_weights() => self.policy.model.detached(),
            Some((device, copies)) => {
                let mut copies = copies.lock().unwrap_or_else(|e| e.into_inner());
                self.policy.model.snapshot_onto(device, &mut copies)?
            }
            None => self.policy.model.snapshot_trainable()?,
        };
        snapshot.device().synchronize()?;
        Ok(Arc::new(snapshot))
    }

    /// Whether [`Self::publish`] hands out the learner's own weights instead of a copy: a full
    /// fine-tune at `max_staleness = 0`, where nothing samples or scores with a version while
    /// the next update writes the weights (the generator waits for each version before its
    /// batch, the learner for that batch before its update; evaluation and checkpoints run
    /// between updates on this thread). Saves a copy of every weight for the whole run; the
    /// generator's packed q/k/v and gate/up copy then lives for a generation only.
    pub fn shares_published_weights(&self) -> bool {
        self.cfg.pipeline.max_staleness == 0 && self.policy.lora.is_none()
    }

    /// The trained policy (adapters unmerged).
    pub fn policy(&self) -> &TrainableModel {
        &self.policy
    }

    /// What a checkpoint's `trainer_state.json` would hold now.
    pub fn state(&self) -> &TrainerState {
        &self.state
    }
}

/// AdamW over `vars` with the config's settings: f32 master weights under `train.bf16`,
/// 8-bit moments under `optim = "adamw_8bit"` (the embeddings' in 32 bits, as transformers
/// keeps them under bitsandbytes).
pub(crate) fn new_optimizer(
    cfg: &TrainConfig,
    vars: Vec<(String, candle_core::Var)>,
) -> Result<AdamW> {
    let o = &cfg.optim;
    let opt = AdamW::new(
        vars,
        AdamWParams {
            beta1: o.adam_beta1,
            beta2: o.adam_beta2,
            eps: o.adam_epsilon,
            weight_decay: o.weight_decay,
        },
    )?;
    let opt = if cfg.train.bf16 {
        opt.with_master_weights()?
    } else {
        opt
    };
    Ok(match o.optim.eight_bit() {
        true => opt.with_8bit_states(|name| name.ends_with("embed_tokens.weight"))?,
        false => opt,
    })
}

/// GOLD's ULD state: the teacher's tokenizer and the loss's settings, the hybrid loss's
/// vocabulary match built once from both tokenizers.
fn gold_state(setup: &Setup) -> Option<(Tokenizer, grpo_core::uld::UldConfig)> {
    let g = &setup.cfg.gold;
    let tok = setup.teacher_tokenizer.clone()?;
    if !(setup.cfg.algorithm == crate::config::Algorithm::Gold && g.use_uld_loss) {
        return None;
    }
    let hybrid = g.uld_use_hybrid_loss.then(|| {
        let vocab = grpo_core::uld::VocabMatch::new(
            &setup.tokenizer.inner.get_vocab(true).into_iter().collect(),
            &tok.inner.get_vocab(true).into_iter().collect(),
        );
        (vocab, setup.cfg.distillation.beta)
    });
    let cfg = g.uld_config(hybrid);
    Some((tok, cfg))
}
