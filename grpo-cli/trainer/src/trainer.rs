//! The library's front door: [`Trainer`] (`from_config` / `from_pretrained`, then `fit`),
//! typed by algorithm ([`GrpoTrainer`], [`SftTrainer`], [`DpoTrainer`], [`KtoTrainer`],
//! [`OrpoTrainer`], [`CpoTrainer`], [`BcoTrainer`], [`OnlineDpoTrainer`], [`XpoTrainer`], [`NashMdTrainer`],
//! [`RlooTrainer`], [`RewardTrainer`],
//! [`DistillationTrainer`], [`GkdTrainer`], [`TpoTrainer`], [`A2poTrainer`]) or chosen by name
//! ([`create_trainer`], [`get_algorithm`], [`list_algorithms`]).

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use grpo_rewards::{AsyncReward, Reward};
use grpo_rollout::Environment;

use crate::callbacks::Callbacks;
use crate::config::{Algorithm, TrainConfig};
use crate::pipeline::{RunOptions, TrainingResult};
use crate::setup::Setup;

/// What a [`Trainer`] type fixes about its algorithm.
pub trait TrainerKind {
    /// The algorithm, or `None` when it is chosen at run time ([`ByName`]).
    const ALGORITHM: Option<Algorithm>;
}

/// GRPO (rewards, advantages, clipped policy loss).
#[derive(Debug, Clone, Copy)]
pub struct Grpo;
/// Supervised fine-tuning (`[sft]`).
#[derive(Debug, Clone, Copy)]
pub struct Sft;
/// Direct preference optimisation (`[dpo]`).
#[derive(Debug, Clone, Copy)]
pub struct Dpo;
/// KTO (`[kto]`).
#[derive(Debug, Clone, Copy)]
pub struct Kto;
/// ORPO (`[orpo]`, TRL's ORPOTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Orpo;
/// CPO, SimPO and AlphaPO (`[cpo]`, TRL's CPOTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Cpo;
/// Online DPO (`[online_dpo]`, TRL's OnlineDPOTrainer, on the GRPO pipeline).
#[derive(Debug, Clone, Copy)]
pub struct OnlineDpo;
/// BCO (`[kto]`'s rows and β, TRL's BCOTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Bco;
/// XPO (`[online_dpo]` and `[xpo]`, TRL's XPOTrainer, on the GRPO pipeline).
#[derive(Debug, Clone, Copy)]
pub struct Xpo;
/// Nash-MD (`[online_dpo]` and `[nash_md]`, TRL's NashMDTrainer, on the GRPO pipeline).
#[derive(Debug, Clone, Copy)]
pub struct NashMd;
/// RLOO (`[rloo]`, on the GRPO pipeline).
#[derive(Debug, Clone, Copy)]
pub struct Rloo;
/// Reward modelling (`[reward]`, TRL's RewardTrainer).
#[derive(Debug, Clone, Copy)]
pub struct RewardModeling;
/// On-policy distillation (`[distillation]`, TRL's DistillationTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Distillation;
/// Generalized knowledge distillation (`[distillation]` with GKD's defaults, TRL's
/// GKDTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Gkd;
/// Triple preference optimisation (`[tpo]`, TRL's TPOTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Tpo;
/// A*-PO (`[a2po]`, TRL's A2POTrainer).
#[derive(Debug, Clone, Copy)]
pub struct A2po;
/// Self-distillation policy optimisation (`[sdpo]`, TRL's SDPOTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Sdpo;
/// Self-distillation fine-tuning (`[sdft]`, TRL's SDFTTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Sdft;
/// Importance-weighted on-policy distillation (`[distillation]`, TRL's IWOPDTrainer).
#[derive(Debug, Clone, Copy)]
pub struct IwOpd;
/// Simple self-distillation (`[ssd]`, TRL's SSDTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Ssd;
/// MiniLLM (`[minillm]`, TRL's MiniLLMTrainer).
#[derive(Debug, Clone, Copy)]
pub struct MiniLlm;
/// A process reward model (`[prm]`, TRL's PRMTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Prm;
/// PPO with a value model (`[ppo]`, TRL's PPOTrainer).
#[derive(Debug, Clone, Copy)]
pub struct Ppo;
/// GOLD (`algorithm = "gold"`).
#[derive(Debug, Clone, Copy)]
pub struct Gold;
/// The algorithm chosen at run time by name ([`create_trainer`]).
#[derive(Debug, Clone, Copy)]
pub struct ByName;

impl TrainerKind for Grpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Grpo);
}
impl TrainerKind for Sft {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Sft);
}
impl TrainerKind for Dpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Dpo);
}
impl TrainerKind for Kto {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Kto);
}
impl TrainerKind for Orpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Orpo);
}
impl TrainerKind for Cpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Cpo);
}
impl TrainerKind for OnlineDpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::OnlineDpo);
}
impl TrainerKind for Bco {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Bco);
}
impl TrainerKind for Xpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Xpo);
}
impl TrainerKind for NashMd {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::NashMd);
}
impl TrainerKind for Rloo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Rloo);
}
impl TrainerKind for RewardModeling {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Reward);
}
impl TrainerKind for Distillation {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Distillation);
}
impl TrainerKind for Gkd {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Gkd);
}
impl TrainerKind for Tpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Tpo);
}
impl TrainerKind for A2po {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::A2po);
}
impl TrainerKind for Sdpo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Sdpo);
}
impl TrainerKind for Sdft {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Sdft);
}
impl TrainerKind for Ssd {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Ssd);
}
impl TrainerKind for MiniLlm {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::MiniLlm);
}
impl TrainerKind for Prm {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Prm);
}
impl TrainerKind for Ppo {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Ppo);
}
impl TrainerKind for IwOpd {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::IwOpd);
}
impl TrainerKind for Gold {
    const ALGORITHM: Option<Algorithm> = Some(Algorithm::Gold);
}
impl TrainerKind for ByName {
    const ALGORITHM: Option<Algorithm> = None;
}

/// A trainer whose algorithm was chosen by name.
pub type AnyTrainer = Trainer<ByName>;
/// A GRPO trainer.
pub type GrpoTrainer = Trainer<Grpo>;
/// An SFT trainer.
pub type SftTrainer = Trainer<Sft>;
/// A DPO trainer.
pub type DpoTrainer = Trainer<Dpo>;
/// A KTO trainer.
pub type KtoTrainer = Trainer<Kto>;
/// An ORPO trainer: preference pairs, no reference model.
pub type OrpoTrainer = Trainer<Orpo>;
/// A CPO trainer (also SimPO and AlphaPO, by `cpo.loss_type`): preference pairs, no reference
/// model.
pub type CpoTrainer = Trainer<Cpo>;
/// An online DPO trainer: pairs of the policy's own samples, ranked by the rewards.
pub type OnlineDpoTrainer = Trainer<OnlineDpo>;
/// A BCO trainer: KTO's unpaired, labelled rows, each row's implicit reward a binary
/// classifier's logit shifted by the running mean of the rewards.
pub type BcoTrainer = Trainer<Bco>;
/// An XPO trainer: online DPO on pairs of a policy sample and a reference sample, with the
/// exploration term on the reference's.
pub type XpoTrainer = Trainer<Xpo>;
/// A Nash-MD trainer: the policy's samples against the policy–reference mixture's, a
/// REINFORCE step on the preference with a KL penalty.
pub type NashMdTrainer = Trainer<NashMd>;
/// An RLOO trainer.
pub type RlooTrainer = Trainer<Rloo>;
/// A reward-model trainer: a sequence classifier learns to score chosen above rejected.
pub type RewardTrainer = Trainer<RewardModeling>;
/// An on-policy distillation trainer: the policy learns a teacher's distributions on its own
/// samples.
pub type DistillationTrainer = Trainer<Distillation>;

/// A GKD trainer: the student learns the teacher's distributions on its own samples (a share
/// `lmbda` of the steps) and on the dataset's completions or the teacher's samples.
pub type GkdTrainer = Trainer<Gkd>;

/// A GOLD trainer: GKD's steps, and with `gold.use_uld_loss` a teacher with another tokenizer
/// through universal logit distillation.
pub type GoldTrainer = Trainer<Gold>;

/// A TPO trainer: chosen, rejected and gold completions, no reference model.
pub type TpoTrainer = Trainer<Tpo>;

/// An A*-PO trainer: optimal advantage regression against the reference.
pub type A2poTrainer = Trainer<A2po>;

/// An SDPO trainer: the policy learns from itself shown a successful sibling completion (or
/// the row's feedback).
pub type SdpoTrainer = Trainer<Sdpo>;

/// An SDFT trainer: the policy learns toward itself shown each row's privileged context.
pub type SdftTrainer = Trainer<Sdft>;

/// An SSD trainer: the policy learns its own samples by cross-entropy.
pub type SsdTrainer = Trainer<Ssd>;

/// An IW-OPD trainer: on-policy distillation with the importance-weighted sampled-token
/// objective.
pub type IwOpdTrainer = Trainer<IwOpd>;

/// A MiniLLM trainer: GRPO on the student's samples with the teacher's reverse KL in each
/// token's advantage and in the loss.
pub type MiniLlmTrainer = Trainer<MiniLlm>;

/// A process-reward-model trainer: a token classifier learns to label each step of a
/// completion.
pub type PrmTrainer = Trainer<Prm>;

/// A PPO trainer: the policy and a value model trained together on the policy's samples,
/// with GAE advantages and a KL penalty to the reference in the reward.
pub type PpoTrainer = Trainer<Ppo>;

/// The algorithms [`create_trainer`] knows, sorted.
pub fn list_algorithms() -> Vec<&'static str> {
    let mut v: Vec<&str> = Algorithm::ALL.iter().map(|a| a.as_str()).collect();
    v.sort_unstable();
    v
}

/// The algorithm of a name (`"grpo"`, `"sft"`, `"dpo"`), or an error listing them.
pub fn get_algorithm(name: &str) -> Result<Algorithm> {
    name.parse().map_err(|e: String| anyhow!(e))
}

/// A trainer of any algorithm, by name: `cfg.algorithm` is set to it and the model loaded from
/// `path`.
pub fn create_trainer(
    algorithm: &str,
    path: impl AsRef<Path>,
    mut cfg: TrainConfig,
) -> Result<AnyTrainer> {
    cfg.algorithm = get_algorithm(algorithm)?;
    cfg.model.path = path.as_ref().to_path_buf();
    Trainer::build(cfg)
}

/// What [`Trainer::fit_with`] takes, as NeMo RL's `fit(dataset, reward_fn, max_steps,
/// max_epochs, callbacks)`: each left unset keeps what the config says.
///
/// ```no_run
/// use grpo_rewards::RewardInput;
/// use grpo_trainer::{Callbacks, FitOptions, GrpoTrainer, Metrics, TrainerState, config};
///
/// struct Print;
/// impl Callbacks for Print {
///     fn on_step_end(&mut self, state: &TrainerState, m: &Metrics) {
///         println!("step {}/{}: reward {:.3}", state.step, state.max_steps, m["reward"]);
///     }
/// }
///
/// // Any closure over a batch is a reward (None = no score for that sample).
/// let short = |b: &[RewardInput]| -> Vec<f32> {
///     b.iter().map(|x| if x.completion.len() < 40 { 1.0 } else { 0.0 }).collect()
/// };
/// let cfg = config::load("configs/quickstart.toml".as_ref(), &[])?;
/// let mut trainer = GrpoTrainer::from_pretrained("runs/demo/model", cfg)?;
/// let result = trainer.fit_with(
///     FitOptions::default()
///         .reward("short", 0.5, short) // beside the config's [[rewards]]
///         .max_steps(5)
///         .callbacks(Print),
/// )?;
/// println!("{} steps, checkpoint {:?}", result.total_steps, result.best_checkpoint_path);
/// # Ok::<(), anyhow::Error>(())
/// ```
#[derive(Default)]
pub struct FitOptions {
    dataset: Option<grpo_data::Dataset>,
    eval_dataset: Option<grpo_data::Dataset>,
    rewards: Vec<(String, f32, RewardFn)>,
    max_steps: Option<usize>,
    max_epochs: Option<f64>,
    callbacks: Option<Box<dyn Callbacks>>,
    environment: Option<Arc<dyn Environment>>,
}

enum RewardFn {
    Sync(Arc<dyn Reward>),
    Async(Arc<dyn AsyncReward>),
}

impl std::fmt::Debug for FitOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FitOptions")
            .field("dataset_rows", &self.dataset.as_ref().map(|d| d.len()))
            .field(
                "rewards",
                &self.rewards.iter().map(|r| &r.0).collect::<Vec<_>>(),
            )
            .field("max_steps", &self.max_steps)
            .field("max_epochs", &self.max_epochs)
            .finish_non_exhaustive()
    }
}

impl FitOptions {
    /// Train on these prompts instead of the config's `data` files.
    pub fn dataset(mut self, train: grpo_data::Dataset) -> Self {
        self.dataset = Some(train);
        self
    }

    /// Evaluate on these prompts (with `train.eval_steps`).
    pub fn eval_dataset(mut self, eval: grpo_data::Dataset) -> Self {
        self.eval_dataset = Some(eval);
        self
    }

    /// Adds a reward function (GRPO), weighted as the config's rewards are: any
    /// `Fn(&[RewardInput]) -> Vec<Option<f32>>` or a [`Reward`].
    pub fn reward(
        mut self,
        name: impl Into<String>,
        weight: f32,
        f: impl Reward + 'static,
    ) -> Self {
        self.rewards
            .push((name.into(), weight, RewardFn::Sync(Arc::new(f))));
        self
    }

    /// Adds an asynchronous reward (an [`AsyncReward`], e.g. a judge of your own).
    pub fn async_reward(
        mut self,
        name: impl Into<String>,
        weight: f32,
        f: impl AsyncReward + 'static,
    ) -> Self {
        self.rewards
            .push((name.into(), weight, RewardFn::Async(Arc::new(f))));
        self
    }

    /// Steps to train (overrides `train.max_steps`).
    pub fn max_steps(mut self, n: usize) -> Self {
        self.max_steps = Some(n);
        self
    }

    /// Passes over the data (overrides `train.num_train_epochs`; used when no `max_steps`).
    pub fn max_epochs(mut self, epochs: f64) -> Self {
        self.max_epochs = Some(epochs);
        self
    }

    /// Hooks called during the run (replaces [`Trainer::with_callbacks`]'s).
    pub fn callbacks(mut self, cb: impl Callbacks + 'static) -> Self {
        self.callbacks = Some(Box::new(cb));
        self
    }

    /// Generates multi-turn episodes against `env` (GRPO, local or on the rollout server) instead of
    /// single-turn completions (replaces [`Trainer::with_environment`]'s). The `[environment]`
    /// config keys set the budgets; its rewards become the `env` reward.
    pub fn environment(mut self, env: impl Environment + 'static) -> Self {
        self.environment = Some(Arc::new(env));
        self
    }
}

/// A run: a validated setup (model, data, rewards or preference pairs) plus run options,
/// trained by [`Trainer::fit`]. One builder and one learner for the three algorithms.
pub struct Trainer<K = Grpo> {
    setup: Option<Setup>,
    /// Resume, threading, stop and event-sink options.
    pub options: RunOptions,
    callbacks: Box<dyn Callbacks>,
    step: usize,
    last_checkpoint: Option<std::path::PathBuf>,
    kind: std::marker::PhantomData<K>,
}

impl<K> std::fmt::Debug for Trainer<K> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Trainer")
            .field("setup", &self.setup)
            .field("step", &self.step)
            .finish_non_exhaustive()
    }
}

impl<K: TrainerKind> Trainer<K> {
    /// Loads the model and data of `cfg` (with `algorithm` set to this trainer's) and checks
    /// them.
    pub fn from_config(mut cfg: TrainConfig) -> Result<Self> {
        if let Some(a) = K::ALGORITHM {
            cfg.algorithm = a;
        }
        Self::build(cfg)
    }

    /// `cfg` with `model.path = path` (NeMo RL's `from_pretrained(...)`).
    pub fn from_pretrained(path: impl AsRef<Path>, mut cfg: TrainConfig) -> Result<Self> {
        cfg.model.path = path.as_ref().to_path_buf();
        Self::from_config(cfg)
    }
}

impl<K> Trainer<K> {
    fn build(cfg: TrainConfig) -> Result<Self> {
        Ok(Self {
            setup: Some(crate::setup::setup(cfg)?),
            options: RunOptions::default(),
            callbacks: Box::new(crate::callbacks::NoCallbacks),
            step: 0,
            last_checkpoint: None,
            kind: std::marker::PhantomData,
        })
    }

    fn setup_mut(&mut self) -> Result<&mut Setup> {
        self.setup
            .as_mut()
            .ok_or_else(|| anyhow!("this trainer has already been fitted"))
    }

    /// Sets the callbacks.
    pub fn with_callbacks(mut self, cb: impl Callbacks + 'static) -> Self {
        self.callbacks = Box::new(cb);
        self
    }

    /// Adds a reward function (GRPO) beside the config's, with its weight: any
    /// `Fn(&[RewardInput]) -> Vec<Option<f32>>` or a [`Reward`]. Its metrics are
    /// `rewards/{name}/mean|std`.
    ///
    /// ```no_run
    /// use grpo_rewards::RewardInput;
    /// use grpo_trainer::{FitOptions, GrpoTrainer, config};
    ///
    /// // 1 when the completion names the dataset's `answer` column, at every step.
    /// let mentions_answer = |batch: &[RewardInput]| -> Vec<Option<f32>> {
    ///     batch
    ///         .iter()
    ///         .map(|x| {
    ///             let answer = x.field("answer")?.as_text()?;
    ///             Some(x.completion.contains(answer.as_str()) as u8 as f32)
    ///         })
    ///         .collect()
    /// };
    /// let cfg = config::load("configs/quickstart.toml".as_ref(), &[])?;
    /// let result = GrpoTrainer::from_pretrained("runs/demo/model", cfg)?
    ///     .with_reward("mentions_answer", 1.0, mentions_answer)?
    ///     .fit_with(FitOptions::default().max_steps(10))?;
    /// # Ok::<(), anyhow::Error>(())
    /// ```
    pub fn with_reward(
        mut self,
        name: impl Into<String>,
        weight: f32,
        f: impl Reward + 'static,
    ) -> Result<Self> {
        self.push_reward(name.into(), weight, RewardFn::Sync(Arc::new(f)))?;
        Ok(self)
    }

    /// Adds an asynchronous reward (an [`AsyncReward`]) beside the config's.
    pub fn with_async_reward(
        mut self,
        name: impl Into<String>,
        weight: f32,
        f: impl AsyncReward + 'static,
    ) -> Result<Self> {
        self.push_reward(name.into(), weight, RewardFn::Async(Arc::new(f)))?;
        Ok(self)
    }

    /// Generates multi-turn episodes against `env` instead of single-turn completions (GRPO;
    /// replaces an `[environment] type` the config built): the model and the environment take turns (see
    /// `grpo_rollout::episode`), the loss is on the model's tokens only, and the environment's
    /// rewards (`environment.reward`: their sum or the last) are the `env` reward, weight 1,
    /// beside the run's reward functions. Budgets come from the `[environment]` config keys.
    pub fn with_environment(mut self, env: impl Environment + 'static) -> Result<Self> {
        self.set_environment(Arc::new(env))?;
        Ok(self)
    }

    fn set_environment(&mut self, env: Arc<dyn Environment>) -> Result<()> {
        let s = self.setup_mut()?;
        if !s.cfg.algorithm.generates() {
            bail!(
                "environment `{}`: only GRPO and RLOO run episodes",
                env.name()
            );
        }
        s.environment = Some(env);
        Ok(())
    }

    fn push_reward(&mut self, name: String, weight: f32, f: RewardFn) -> Result<()> {
        let s = self.setup_mut()?;
        if !s.cfg.algorithm.generates() {
            bail!("reward `{name}`: only GRPO and RLOO score completions with rewards");
        }
        let set = Arc::get_mut(&mut s.rewards)
            .context("the reward set is in use; add rewards before fit()")?;
        if set.names().contains(&name.as_str()) {
            bail!("reward `{name}`: a reward of that name exists already");
        }
        match f {
            RewardFn::Sync(r) => set.push_reward(name, weight, r),
            RewardFn::Async(r) => set.push_async_reward(name, weight, r),
        }
        Ok(())
    }

    /// Steps the run will take.
    pub fn total_steps(&self) -> usize {
        self.setup.as_ref().map_or(self.step, |s| s.total_steps)
    }

    /// Steps done: 0 before [`Self::fit`], the checkpoint's step after
    /// [`Self::load_checkpoint`], the last step after `fit`.
    pub fn current_step(&self) -> usize {
        self.step
    }

    /// Continues from a checkpoint directory (`checkpoints/step-N`) when [`Self::fit`] runs:
    /// weights, optimizer, schedule, data position and step, exactly.
    pub fn load_checkpoint(&mut self, dir: impl AsRef<Path>) -> Result<()> {
        let dir = dir.as_ref();
        let st = crate::checkpoint::read_state(dir)?;
        self.step = st.step;
        self.options.resume = Some(Some(dir.to_path_buf()));
        Ok(())
    }

    /// [`Self::fit`] on `train` (and `eval`) instead of the config's files (NeMo RL's
    /// `fit(dataset)`); without `train.max_steps` the steps follow the new dataset's size.
    pub fn fit_on(
        &mut self,
        train: grpo_data::Dataset,
        eval: Option<grpo_data::Dataset>,
    ) -> Result<TrainingResult> {
        let mut o = FitOptions::default().dataset(train);
        o.eval_dataset = eval;
        self.fit_with(o)
    }

    /// Trains with what `opts` gives (dataset, reward functions, step or epoch budget,
    /// callbacks) in place of the config's, as NeMo RL's `fit(...)`.
    pub fn fit_with(&mut self, opts: FitOptions) -> Result<TrainingResult> {
        for (name, weight, f) in opts.rewards {
            self.push_reward(name, weight, f)?;
        }
        if let Some(cb) = opts.callbacks {
            self.callbacks = cb;
        }
        if let Some(env) = opts.environment {
            self.set_environment(env)?;
        }
        let s = self.setup_mut()?;
        if let Some(train) = opts.dataset {
            if train.is_empty() {
                bail!("fit: the training dataset has no rows");
            }
            crate::setup::check_columns(&s.cfg, &train).map_err(|e| anyhow!("fit: {e}"))?;
            s.train = train;
        }
        if opts.eval_dataset.is_some() {
            s.eval = opts.eval_dataset;
        }
        if opts.max_steps == Some(0) || opts.max_epochs.is_some_and(|e| e.is_nan() || e <= 0.0) {
            bail!("fit: max_steps must be >= 1 and max_epochs > 0");
        }
        if opts.max_steps.is_some() {
            s.cfg.train.max_steps = opts.max_steps;
        }
        if let Some(e) = opts.max_epochs {
            s.cfg.train.num_train_epochs = e;
        }
        s.total_steps = crate::setup::total_steps(&s.cfg, s.train.len());
        self.fit()
    }

    /// Trains to the end (or to a stop request) and returns the metrics; checkpoints go to the
    /// run directory (`checkpoints/step-N`, see [`TrainingResult::best_checkpoint_path`]).
    /// A trainer fits once.
    pub fn fit(&mut self) -> Result<TrainingResult> {
        let setup = self
            .setup
            .take()
            .ok_or_else(|| anyhow!("this trainer has already been fitted"))?;
        let r = crate::pipeline::run(setup, &self.options, self.callbacks.as_mut())?;
        self.step = r.total_steps;
        self.last_checkpoint = r.best_checkpoint_path.clone();
        Ok(r)
    }

    /// Writes the trainer's state after [`Self::fit`] (weights or adapter, optimizer, schedule
    /// and data position: the checkpoint `fit` ended with) to `dir`, which
    /// [`Self::load_checkpoint`] and `--resume DIR` read.
    pub fn save_checkpoint(&self, dir: impl AsRef<Path>) -> Result<()> {
        let src = self
            .last_checkpoint
            .as_ref()
            .ok_or_else(|| anyhow!("save_checkpoint: nothing to save before fit() has run"))?;
        crate::checkpoint::copy_dir(src, dir.as_ref())
    }
}
