//! The training config: one schema, read from TOML or YAML, overridden with `--set a.b=value`,
//! validated once into [`TrainConfig`]. Names follow TRL's `GRPOConfig` where TRL has the
//! concept.
//!
//! Unknown keys are refused with the closest valid key; the resolved config is written to the
//! run directory without secrets (judges name the environment variable that holds a key,
//! never the key).

use std::collections::{BTreeMap, BTreeSet};
use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use grpo_core::advantages::{MultiObjectiveAggregation, ScaleRewards};
use grpo_core::estimators::{AdvEstimator, KlController, KlPenalty};
use grpo_core::loss::{
    ImportanceSamplingLevel, ImportanceSamplingMode, KlLossType, LossConfig, LossType,
};
use grpo_core::preference::{
    CpoConfig, CpoLossType, DpoConfig, DpoLossType, FDivergence, KtoConfig, KtoLossType,
    SftLossType,
};
use grpo_data::DataConfig;
use grpo_rewards::{RewardSpec, RewardsConfig};
use grpo_rollout::ors::OrsConfig;
use grpo_rollout::python_env::PythonEnvironmentConfig;
use grpo_rollout::tools::ToolConfig;
use grpo_rollout::{DeviceSpec, Dtype, LoraConfig, SamplingParams};
use grpo_teacher::TeacherConfig;
use serde::{Deserialize, Serialize};
use serde_json::Value;

pub use crate::optim::{ScheduleKind, ScheduleKwargs};

/// The objective the learner optimises (`algorithm`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Algorithm {
    /// GRPO: rewards, group advantages, the clipped policy loss (the default).
    #[default]
    Grpo,
    /// Supervised fine-tuning (`[sft]`).
    Sft,
    /// Direct preference optimisation (`[dpo]`).
    Dpo,
    /// Kahneman-Tversky optimisation on unpaired, labelled rows (`[kto]`).
    Kto,
    /// REINFORCE leave-one-out (TRL's RLOOTrainer): the GRPO pipeline with RLOO's advantages,
    /// the KL penalty in the reward and a sequence-level clipped loss (`[rloo]`).
    Rloo,
    /// A reward model (TRL's RewardTrainer): a sequence classifier trained on preference
    /// pairs with the Bradley-Terry loss (`[reward]`).
    Reward,
    /// On-policy distillation (TRL's DistillationTrainer): the policy samples completions and
    /// learns the teacher's next-token distributions on them (`[distillation]`).
    Distillation,
    /// Odds-ratio preference optimisation (TRL's ORPOTrainer): preference pairs, no reference
    /// model; the chosen sequences' NLL plus an odds-ratio term (`[orpo]`).
    Orpo,
    /// Contrastive preference optimisation (TRL's CPOTrainer) with its SimPO and AlphaPO loss
    /// types: preference pairs, no reference model (`[cpo]`).
    Cpo,
    /// Online DPO (TRL's OnlineDPOTrainer): the policy samples two completions per prompt, the
    /// rewards pick the chosen one, and DPO's loss against the frozen reference trains on the
    /// pair (`[online_dpo]`).
    OnlineDpo,
    /// Generalized knowledge distillation (TRL's GKDTrainer): distillation's `[distillation]`
    /// with GKD's defaults — each step on the student's own samples with probability
    /// `lmbda`, else on the dataset's completions (or the teacher's, `seq_kd`).
    Gkd,
    /// Triple preference optimisation (TRL's TPOTrainer): chosen, rejected and a gold
    /// reference completion; CPO's contrastive loss plus an NLL term on the gold one, no
    /// reference model (`[tpo]`).
    Tpo,
    /// A*-PO (TRL's A2POTrainer): the optimal value of each prompt estimated once from the
    /// reference's samples, then one sample per prompt whose log-ratio to the reference
    /// regresses onto its optimal advantage (`[a2po]`).
    A2po,
    /// Self-distillation policy optimisation (TRL's experimental SDPOTrainer): the policy
    /// samples a group per prompt; a teacher (the policy itself: live, its EMA or its start)
    /// shown a successful sibling completion (or the row's feedback) scores the same tokens,
    /// and the policy learns toward it, optionally blended with GRPO's loss (`[sdpo]`).
    Sdpo,
    /// Self-distillation fine-tuning (TRL's experimental SDFTTrainer): the policy samples; the
    /// policy itself shown each row's privileged context (`[sdft]`) scores the same tokens, and
    /// the policy learns toward it. No rewards.
    Sdft,
    /// Importance-weighted on-policy distillation (TRL's experimental IWOPDTrainer):
    /// distillation's `[distillation]` with the sampled-token IW-OPD objective by default.
    IwOpd,
    /// General online logit distillation (TRL's experimental GOLDTrainer): GKD's steps, and
    /// with `gold.use_uld_loss` a teacher with another tokenizer through universal logit
    /// distillation (`grpo_core::uld`, `[gold]`).
    Gold,
    /// Simple self-distillation (TRL's experimental SSDTrainer, "Embarrassingly Simple
    /// Self-Distillation Improves Code Generation"): the policy samples, and learns its own
    /// raw samples with plain cross-entropy; no reward, verifier or teacher (`[ssd]`).
    Ssd,
    /// Exploratory preference optimisation (TRL's experimental XPOTrainer): online DPO whose
    /// pair is one sample of the policy and one of the frozen reference, plus `α` times the
    /// policy's log-likelihood of the reference's sample (`[online_dpo]`, `[xpo]`).
    Xpo,
    /// Binary classifier optimisation (TRL's experimental BCOTrainer): KTO's unpaired, labelled
    /// rows (`[kto]`'s columns, `beta`, `max_length`), each row's implicit reward the logit of a
    /// classifier of desirable against undesirable, shifted by the running mean of the rewards.
    Bco,
    /// Nash mirror descent (TRL's experimental NashMDTrainer): the policy's sample against one
    /// from the geometric mixture of policy and reference; the probability that the policy's
    /// is preferred weighs a REINFORCE step, with a KL penalty to the reference
    /// (`[online_dpo]`, `[nash_md]`).
    NashMd,
    /// MiniLLM (TRL's experimental MiniLLMTrainer, "Knowledge Distillation of Large Language
    /// Models"): GRPO's step on the policy's samples where each token's advantage adds the
    /// teacher's log-prob minus the student's (the reverse KL as a reward, optionally
    /// discounted), plus the full-vocabulary reverse KL to the teacher at each token
    /// (`[minillm]`, the teacher from `[distillation]`).
    #[serde(rename = "minillm")]
    MiniLlm,
    /// A process reward model (TRL's experimental PRMTrainer): a token classifier (two labels)
    /// trained on step-wise supervision — each reasoning step of a completion labelled correct
    /// or not, the label read at the step's last token (`[prm]`).
    Prm,
    /// Proximal policy optimisation with a learned value model (TRL's experimental
    /// PPOTrainer): the rewards' score after each completion and a per-token KL penalty to the
    /// reference, generalized advantage estimation against the value model, then
    /// `num_ppo_epochs` passes of the clipped policy and value losses (`[ppo]`).
    Ppo,
}

impl Algorithm {
    /// Every algorithm.
    pub const ALL: [Algorithm; 24] = [
        Algorithm::Grpo,
        Algorithm::Sft,
        Algorithm::Dpo,
        Algorithm::Kto,
        Algorithm::Rloo,
        Algorithm::Reward,
        Algorithm::Distillation,
        Algorithm::Orpo,
        Algorithm::Cpo,
        Algorithm::OnlineDpo,
        Algorithm::Gkd,
        Algorithm::Tpo,
        Algorithm::A2po,
        Algorithm::Sdpo,
        Algorithm::Sdft,
        Algorithm::IwOpd,
        Algorithm::Gold,
        Algorithm::Ssd,
        Algorithm::Xpo,
        Algorithm::NashMd,
        Algorithm::Bco,
        Algorithm::MiniLlm,
        Algorithm::Prm,
        Algorithm::Ppo,
    ];

    /// Whether the run samples completions with the policy on the pipelined loop (GRPO, RLOO,
    /// on-policy distillation, online DPO).
    pub fn generates(self) -> bool {
        matches!(
            self,
            Algorithm::Grpo
                | Algorithm::Rloo
                | Algorithm::Distillation
                | Algorithm::OnlineDpo
                | Algorithm::Xpo
                | Algorithm::NashMd
                | Algorithm::Gkd
                | Algorithm::A2po
                | Algorithm::Sdpo
                | Algorithm::Sdft
                | Algorithm::IwOpd
                | Algorithm::Gold
                | Algorithm::Ssd
                | Algorithm::MiniLlm
                | Algorithm::Ppo
        )
    }

    /// Whether the step compares two completions of each prompt ranked by the rewards, against
    /// the frozen reference, with `[online_dpo]`'s β and EOS penalty: online DPO, XPO, Nash-MD.
    pub fn is_online_dpo(self) -> bool {
        matches!(
            self,
            Algorithm::OnlineDpo | Algorithm::Xpo | Algorithm::NashMd
        )
    }

    /// Whether the run trains on unpaired, labelled rows (`[kto]`'s): KTO and BCO.
    pub fn is_unpaired(self) -> bool {
        matches!(self, Algorithm::Kto | Algorithm::Bco)
    }

    /// Whether the run distils a teacher (`[distillation]`): on-policy distillation, GKD,
    /// IW-OPD or GOLD.
    pub fn is_distillation(self) -> bool {
        matches!(
            self,
            Algorithm::Distillation | Algorithm::Gkd | Algorithm::IwOpd | Algorithm::Gold
        )
    }

    /// Whether the run learns from rewards (GRPO, RLOO, online DPO; distillation only logs
    /// them).
    pub fn learns_from_rewards(self) -> bool {
        matches!(
            self,
            Algorithm::Grpo
                | Algorithm::Rloo
                | Algorithm::OnlineDpo
                | Algorithm::Xpo
                | Algorithm::NashMd
                | Algorithm::A2po
                | Algorithm::Sdpo
                | Algorithm::Ppo
        )
    }

    /// TRL 1.16's default learning rate of the algorithm's trainer: SFTConfig 2e-5,
    /// RewardConfig 1e-4, PRMConfig 1e-5, OnlineDPOConfig (XPOConfig, NashMDConfig), BCOConfig and TPOConfig
    /// 5e-7, GKDConfig 2e-5 (an SFTConfig),
    /// A2POConfig, SDPOConfig, SDFTConfig and SSDConfig 5e-5 (TrainingArguments'), PPOConfig
    /// 3e-6, the others (GRPO, RLOO, DPO, KTO, distillation, ORPO, CPO) 1e-6, GOLDConfig 1e-7.
    pub fn default_learning_rate(self) -> f64 {
        match self {
            Self::Gold => 1e-7,
            Self::Sft | Self::Gkd => 2e-5,
            Self::Prm => 1e-5,
            Self::Ppo => 3e-6,
            Self::A2po | Self::Sdpo | Self::Sdft | Self::Ssd => 5e-5,
            Self::Reward => 1e-4,
            Self::OnlineDpo | Self::Xpo | Self::NashMd | Self::Bco | Self::Tpo => 5e-7,
            _ => 1e-6,
        }
    }

    /// The config's spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Grpo => "grpo",
            Self::Sft => "sft",
            Self::Dpo => "dpo",
            Self::Kto => "kto",
            Self::Rloo => "rloo",
            Self::Reward => "reward",
            Self::Distillation => "distillation",
            Self::Orpo => "orpo",
            Self::Cpo => "cpo",
            Self::OnlineDpo => "online_dpo",
            Self::Gkd => "gkd",
            Self::Tpo => "tpo",
            Self::A2po => "a2po",
            Self::Sdpo => "sdpo",
            Self::Sdft => "sdft",
            Self::IwOpd => "iw_opd",
            Self::Gold => "gold",
            Self::Ssd => "ssd",
            Self::Xpo => "xpo",
            Self::NashMd => "nash_md",
            Self::Bco => "bco",
            Self::MiniLlm => "minillm",
            Self::Prm => "prm",
            Self::Ppo => "ppo",
        }
    }

    /// Whether the run trains on preference pairs without a reference model (ORPO, CPO, TPO).
    pub fn reference_free_pairs(self) -> bool {
        matches!(self, Algorithm::Orpo | Algorithm::Cpo | Algorithm::Tpo)
    }
}

impl std::str::FromStr for Algorithm {
    type Err = String;

    fn from_str(s: &str) -> std::result::Result<Self, String> {
        Self::ALL
            .into_iter()
            .find(|a| a.as_str() == s)
            .ok_or_else(|| {
                format!(
                    "unknown algorithm `{s}`; expected one of a2po, bco, cpo, distillation, dpo, gkd, gold, grpo, iw_opd, kto, minillm, nash_md, online_dpo, orpo, ppo, prm, reward, rloo, sdft, sdpo, sft, ssd, tpo, xpo"
                )
            })
    }
}

impl std::fmt::Display for Algorithm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.as_str())
    }
}

/// Where completions are sampled (`rollout.backend`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Backend {
    /// In this process, with the policy being trained (the default).
    #[default]
    Local,
    /// On an OpenAI-compatible server (vLLM, `grpo-cli serve`), LoRA weights synced each step.
    Openai,
}

/// A sink of `train.report_to` (TRL's name) beside `metrics.jsonl`, which is always written.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ReportTo {
    /// TensorBoard event files under `train.logging_dir`.
    Tensorboard,
}

/// A whole run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainConfig {
    /// `grpo` (default), `sft` or `dpo`: which objective the learner optimises.
    pub algorithm: Algorithm,
    /// Where the run directory goes (metrics, completions, checkpoints, resolved config).
    pub output_dir: PathBuf,
    /// Start over in an `output_dir` that holds another run: its files (metrics, completions,
    /// checkpoints, logs) are removed first (TRL's name). Without it such a directory is refused
    /// unless the run continues it with `--resume`.
    pub overwrite_output_dir: bool,
    /// The policy model.
    pub model: ModelSection,
    /// The frozen reference model and the KL penalty.
    pub reference: ReferenceSection,
    /// The prompts (grpo-data's `DataConfig`).
    pub data: DataConfig,
    /// Sampling completions.
    pub rollout: RolloutSection,
    /// Reward functions, combined by weight.
    pub rewards: Vec<RewardSpec>,
    /// TRL's `reward_weights`: one per reward, in order; overrides each `weight`.
    pub reward_weights: Option<Vec<f32>>,
    /// A `*ForSequenceClassification` directory for `type = "reward_model"` rewards.
    pub reward_model_path: Option<PathBuf>,
    /// Where the reward model runs (`cpu`, `cuda`, `cuda:N`). Absent → `model.device`.
    pub reward_model_device: Option<DeviceSpec>,
    /// The reward model's dtype (`f32`, `bf16`, `f16`). Absent → the policy's compute dtype.
    pub reward_model_dtype: Option<Dtype>,
    /// The GRPO objective (grpo-core).
    pub loss: LossSection,
    /// Optimizer and schedule.
    pub optim: OptimSection,
    /// Steps, batches, logging and saving.
    pub train: TrainSection,
    /// Stage channels and staleness.
    pub pipeline: PipelineSection,
    /// Multi-turn episodes against an environment: which one (`type = "tools"` or
    /// `"python"`, or one given in code), budgets and how its rewards count.
    pub environment: EnvironmentSection,
    /// Two-pass adaptive teaching (grpo-teacher): the policy is the teacher, rewarded by how
    /// much its guidance helps a student. Adds the `adaptive_teaching` reward.
    pub teacher: Option<TeacherConfig>,
    /// Supervised fine-tuning (`algorithm = "sft"`).
    pub sft: SftSection,
    /// Direct preference optimisation (`algorithm = "dpo"`).
    pub dpo: DpoSection,
    /// Kahneman-Tversky optimisation (`algorithm = "kto"`), and BCO's rows and β (`"bco"`).
    pub kto: KtoSection,
    /// BCO's underlying distribution matching (`algorithm = "bco"`, TRL's BCOConfig with an
    /// embedding function).
    pub bco: BcoSection,
    /// REINFORCE leave-one-out (`algorithm = "rloo"`).
    pub rloo: RlooSection,
    /// PPO with a value model (`algorithm = "ppo"`, TRL's PPOConfig).
    pub ppo: PpoSection,
    /// Reward-model training (`algorithm = "reward"`, TRL's RewardConfig).
    pub reward: RewardSection,
    /// On-policy distillation (`algorithm = "distillation"`, TRL's DistillationConfig).
    pub distillation: DistillationSection,
    /// Odds-ratio preference optimisation (`algorithm = "orpo"`, TRL's ORPOConfig).
    pub orpo: OrpoSection,
    /// Contrastive preference optimisation, SimPO and AlphaPO (`algorithm = "cpo"`, TRL's
    /// CPOConfig).
    pub cpo: CpoSection,
    /// Online DPO (`algorithm = "online_dpo"`, TRL's OnlineDPOConfig), and the settings XPO
    /// and Nash-MD share with it.
    pub online_dpo: OnlineDpoSection,
    /// XPO (`algorithm = "xpo"`, TRL's XPOConfig `alpha`).
    pub xpo: XpoSection,
    /// Nash-MD (`algorithm = "nash_md"`, TRL's NashMDConfig `mixture_coef`).
    pub nash_md: NashMdSection,
    /// Triple preference optimisation (`algorithm = "tpo"`, TRL's TPOConfig).
    pub tpo: TpoSection,
    /// A*-PO (`algorithm = "a2po"`, TRL's A2POConfig).
    pub a2po: A2poSection,
    /// Self-distillation policy optimisation (`algorithm = "sdpo"`, TRL's SDPOConfig).
    pub sdpo: SdpoSection,
    /// Self-distillation fine-tuning (`algorithm = "sdft"`, TRL's SDFTConfig).
    pub sdft: SdftSection,
    /// Simple self-distillation (`algorithm = "ssd"`, TRL's SSDConfig).
    pub ssd: SsdSection,
    /// MiniLLM (`algorithm = "minillm"`, TRL's MiniLLMConfig); its teacher is
    /// `distillation.teacher_model_name_or_path`.
    pub minillm: MiniLlmSection,
    /// Process reward models (`algorithm = "prm"`, TRL's PRMConfig).
    pub prm: PrmSection,
    /// TRL's `BEMACallback`: a bias-corrected EMA of the trained weights, written to
    /// `RUN/bema` at the end, optionally the reference model (any algorithm; on when present).
    pub bema: Option<BemaSection>,
    /// GOLD's universal logit distillation (`algorithm = "gold"`, TRL's GOLDConfig `uld_*`).
    pub gold: GoldSection,
    /// TRL's `MergeModelCallback`: the trained policy merged with a target model (by default
    /// the starting model) into `checkpoints/step-N/merged`, at the last checkpoint or at each.
    pub merge: Option<MergeSection>,
}

/// `[gold]`: TRL's GOLDTrainer's universal logit distillation (`grpo_core::uld`), for a
/// teacher whose tokenizer differs from the student's. Without `use_uld_loss` GOLD is GKD's
/// step with GOLD's defaults (the teacher then shares the student's tokenizer).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct GoldSection {
    /// The ULD loss (TRL's `use_uld_loss`, default false).
    pub use_uld_loss: bool,
    /// The teacher's tokenizer: a Hugging Face directory (default the teacher model's own).
    pub teacher_tokenizer_name_or_path: Option<PathBuf>,
    /// Align the two tokenisations by byte offsets (default true); false: position by
    /// position.
    pub use_extended_uld: bool,
    /// `observed` (default) or `bayesian`.
    pub uld_token_merge_strategy: UldMergeStrategy,
    /// The hybrid loss: the shared tokens compared directly (default false).
    pub uld_use_hybrid_loss: bool,
    /// The hybrid loss's weight of the shared tokens (with `uld_hybrid_unmatched_weight`;
    /// both absent: the shared share of the teacher's vocabulary).
    pub uld_hybrid_matched_weight: Option<f64>,
    /// The hybrid loss's weight of the other tokens.
    pub uld_hybrid_unmatched_weight: Option<f64>,
    /// The student's cross-entropy on its completion tokens (default 0).
    pub uld_crossentropy_weight: f64,
    /// The distillation term's weight (default 1).
    pub uld_distillation_weight: f64,
    /// Student softmax temperature (default 1).
    pub uld_student_temperature: f64,
    /// Teacher softmax temperature (default 1).
    pub uld_teacher_temperature: f64,
    /// Leave the student's EOS out (default true).
    pub uld_skip_student_eos: bool,
    /// Leave the teacher's EOS out (default true).
    pub uld_skip_teacher_eos: bool,
}

impl Default for GoldSection {
    fn default() -> Self {
        Self {
            use_uld_loss: false,
            teacher_tokenizer_name_or_path: None,
            use_extended_uld: true,
            uld_token_merge_strategy: UldMergeStrategy::Observed,
            uld_use_hybrid_loss: false,
            uld_hybrid_matched_weight: None,
            uld_hybrid_unmatched_weight: None,
            uld_crossentropy_weight: 0.0,
            uld_distillation_weight: 1.0,
            uld_student_temperature: 1.0,
            uld_teacher_temperature: 1.0,
            uld_skip_student_eos: true,
            uld_skip_teacher_eos: true,
        }
    }
}

/// `gold.uld_token_merge_strategy`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UldMergeStrategy {
    /// The first position's distribution times the later tokens' probabilities.
    #[default]
    Observed,
    /// The last position's distribution times the earlier tokens' probabilities.
    Bayesian,
}

impl GoldSection {
    /// grpo-core's ULD settings (with the hybrid loss's vocabulary match and β).
    pub fn uld_config(
        &self,
        hybrid: Option<(grpo_core::uld::VocabMatch, f64)>,
    ) -> grpo_core::uld::UldConfig {
        use grpo_core::uld::{Hybrid, MergeStrategy, UldConfig};
        UldConfig {
            student_temperature: self.uld_student_temperature,
            teacher_temperature: self.uld_teacher_temperature,
            skip_student_eos: self.uld_skip_student_eos,
            skip_teacher_eos: self.uld_skip_teacher_eos,
            extended: self.use_extended_uld,
            strategy: match self.uld_token_merge_strategy {
                UldMergeStrategy::Observed => MergeStrategy::Observed,
                UldMergeStrategy::Bayesian => MergeStrategy::Bayesian,
            },
            distillation_weight: self.uld_distillation_weight,
            hybrid: hybrid.map(|(vocab, beta)| Hybrid {
                vocab,
                beta,
                weights: self
                    .uld_hybrid_matched_weight
                    .zip(self.uld_hybrid_unmatched_weight),
            }),
        }
    }
}

impl TrainConfig {
    /// `[gold]`'s refusals (GOLDConfig's checks, and what ULD cannot take).
    fn check_gold(&self) -> std::result::Result<(), String> {
        let (g, d) = (&self.gold, &self.distillation);
        if !g.use_uld_loss {
            return Ok(());
        }
        if self.algorithm != Algorithm::Gold {
            return Err("`gold.use_uld_loss` is GOLD's: set `algorithm = \"gold\"`".into());
        }
        for (key, v) in [
            ("uld_crossentropy_weight", g.uld_crossentropy_weight),
            ("uld_distillation_weight", g.uld_distillation_weight),
        ] {
            if !(v >= 0.0 && v.is_finite()) {
                return Err(format!("`gold.{key}` must be >= 0, got {v}"));
            }
        }
        for (key, v) in [
            ("uld_student_temperature", g.uld_student_temperature),
            ("uld_teacher_temperature", g.uld_teacher_temperature),
        ] {
            if !(v > 0.0 && v.is_finite()) {
                return Err(format!("`gold.{key}` must be > 0, got {v}"));
            }
        }
        match (g.uld_hybrid_matched_weight, g.uld_hybrid_unmatched_weight) {
            (Some(a), Some(b)) if !(a >= 0.0 && b >= 0.0) => {
                return Err("`gold.uld_hybrid_matched_weight` and \
                            `gold.uld_hybrid_unmatched_weight` must be >= 0"
                    .into());
            }
            (Some(_), None) | (None, Some(_)) => {
                return Err("`gold.uld_hybrid_matched_weight` and \
                            `gold.uld_hybrid_unmatched_weight` are set together (or neither: \
                            adaptive weights)"
                    .into());
            }
            _ => {}
        }
        if d.teacher_server.is_some() {
            return Err("GOLD's ULD loss needs the teacher's logits: a local \
                        `distillation.teacher_model_name_or_path`, not \
                        `[distillation.teacher_server]`"
                .into());
        }
        if d.seq_kd {
            return Err(
                "`distillation.seq_kd` with `gold.use_uld_loss`: the teacher samples in \
                        its own tokens; leave seq_kd out"
                    .into(),
            );
        }
        if d.distillation_objective.is_some() || d.loss_top_k.is_some() {
            return Err("`gold.use_uld_loss` is its own objective: leave \
                        `distillation.distillation_objective` and `loss_top_k` out"
                .into());
        }
        Ok(())
    }
}

/// `[merge]`: TRL's experimental `MergeModelCallback` with its `MergeConfig`, run natively
/// (`grpo_rollout::merge`, mergekit's methods): the checkpoint's policy (`policy_model_path`)
/// and `target_model_path` merged into the checkpoint's `merged/`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MergeSection {
    /// `linear`, `ties`, `dare_ties` or `slerp` (TRL's methods).
    pub method: MergeMethod,
    /// The other model (default `model.path`, the starting model, as TRL's
    /// `get_config_model_id`): a Hugging Face directory.
    pub target_model_path: Option<PathBuf>,
    /// The policy's weight (`linear`: 0.5; `ties`, `dare_ties`: 1.0).
    pub policy_model_weight: Option<f64>,
    /// The target's weight (`linear`: 0.5; `ties`, `dare_ties`: 1.0).
    pub target_model_weight: Option<f64>,
    /// The policy's density, a number or a gradient over the layers (`[1.0, 0.7, 0.1]`).
    pub policy_model_density: Option<grpo_rollout::merge::Setting>,
    /// The target's density (`[1.0]`).
    pub target_model_density: Option<grpo_rollout::merge::Setting>,
    /// TIES' normalisation (1.0).
    pub normalize: Option<f64>,
    /// SLERP's `t` (0.5): 0 the policy, 1 the target.
    pub t_values: Option<f64>,
    /// The merge's dtype (TRL's `float16`; `bfloat16`, `float32`).
    pub dtype: String,
    /// Merge at every checkpoint instead of only the last one.
    pub merge_at_every_checkpoint: bool,
}

impl Default for MergeSection {
    fn default() -> Self {
        Self {
            method: MergeMethod::Linear,
            target_model_path: None,
            policy_model_weight: None,
            target_model_weight: None,
            policy_model_density: None,
            target_model_density: None,
            normalize: None,
            t_values: None,
            dtype: "float16".into(),
            merge_at_every_checkpoint: false,
        }
    }
}

/// `merge.method`: TRL's `MergeConfig` methods.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MergeMethod {
    /// `(w_p θ_p + w_t θ_t) / (w_p + w_t)`.
    Linear,
    /// TIES with the policy as the base.
    Ties,
    /// DARE-TIES with the policy as the base.
    DareTies,
    /// SLERP from the policy toward the target.
    Slerp,
}

impl MergeSection {
    /// The mergekit configuration TRL's `MergeConfig.create()` builds for this method, with
    /// the policy at `policy` and the target at `target`.
    pub fn merge_config(&self, policy: &Path, target: &Path) -> grpo_rollout::merge::MergeConfig {
        use grpo_rollout::merge::{InputModel, MergeConfig, Method, Setting};
        let model = |p: &Path, params: Vec<(&str, Setting)>| InputModel {
            model: p.to_path_buf(),
            parameters: params
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
        };
        let num = Setting::Number;
        let (method, base, models, parameters) = match self.method {
            MergeMethod::Linear => (
                Method::Linear,
                None,
                vec![
                    model(
                        policy,
                        vec![("weight", num(self.policy_model_weight.unwrap_or(0.5)))],
                    ),
                    model(
                        target,
                        vec![("weight", num(self.target_model_weight.unwrap_or(0.5)))],
                    ),
                ],
                vec![],
            ),
            MergeMethod::Ties | MergeMethod::DareTies => (
                match self.method {
                    MergeMethod::Ties => Method::Ties,
                    _ => Method::DareTies,
                },
                Some(policy.to_path_buf()),
                vec![
                    model(
                        target,
                        vec![
                            (
                                "density",
                                self.target_model_density
                                    .clone()
                                    .unwrap_or(Setting::Gradient(vec![1.0])),
                            ),
                            ("weight", num(self.target_model_weight.unwrap_or(1.0))),
                        ],
                    ),
                    model(
                        policy,
                        vec![
                            (
                                "density",
                                self.policy_model_density
                                    .clone()
                                    .unwrap_or(Setting::Gradient(vec![1.0, 0.7, 0.1])),
                            ),
                            ("weight", num(self.policy_model_weight.unwrap_or(1.0))),
                        ],
                    ),
                ],
                vec![("normalize", num(self.normalize.unwrap_or(1.0)))],
            ),
            MergeMethod::Slerp => (
                Method::Slerp,
                Some(policy.to_path_buf()),
                vec![model(target, vec![])],
                vec![("t", num(self.t_values.unwrap_or(0.5)))],
            ),
        };
        MergeConfig {
            merge_method: method,
            base_model: base,
            models,
            parameters: parameters
                .into_iter()
                .map(|(k, v)| (k.to_string(), v))
                .collect(),
            dtype: Some(self.dtype.clone()),
            out_dtype: None,
            tokenizer_source: None,
            random_seed: None,
        }
    }
}

/// `[distillation]`: TRL's DistillationTrainer. The policy (the student) samples completions
/// with `[rollout]`'s settings; the loss at each completion token is the divergence of its
/// next-token distribution from the teacher's (`grpo_core::distill`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DistillationSection {
    /// The teacher: a Hugging Face directory or a GGUF file with the student's tokenizer.
    pub teacher_model_name_or_path: Option<PathBuf>,
    /// 0: forward KL(teacher ‖ student); 1 (the default, as TRL): reverse KL(student ‖
    /// teacher); between: the generalized JSD with the mixture `(1 − β) student + β teacher`.
    pub beta: f64,
    /// Where the teacher runs (default `model.device`).
    pub teacher_device: Option<DeviceSpec>,
    /// The teacher's dtype (default the policy's compute dtype).
    pub teacher_dtype: Option<Dtype>,
    /// GKD's λ: the share of steps trained on the student's own samples; the others train on
    /// the dataset's completions (or, with `seq_kd`, the teacher's samples). Absent: 1 for
    /// distillation (always on-policy), 0.5 for `algorithm = "gkd"` and `"gold"`.
    pub lmbda: Option<f64>,
    /// GKD's sequence-level KD: the off-policy steps train on the teacher's samples instead of
    /// the dataset's completions (default false).
    pub seq_kd: bool,
    /// The dataset's completion column for the off-policy steps (text or messages; a
    /// conversation prompt whose last turn is the assistant's needs none: that turn is the
    /// completion, as TRL's GKD reads `messages`). Default `completion`.
    pub completion_field: String,
    /// The objective: `jsd` (the divergence at `beta`; the default of distillation and GKD) or
    /// `iw_opd` (the sampled-token importance-weighted objective; `algorithm = "iw_opd"`'s
    /// default).
    pub distillation_objective: Option<DistillObjective>,
    /// IW-OPD's γ: early tokens weigh up to `1 + γ` (default 0.5).
    pub iw_opd_gamma: f64,
    /// IW-OPD's ε in the weights' normaliser (default 1e-8).
    pub iw_opd_epsilon: f64,
    /// The teacher on an OpenAI-compatible server (TRL's `use_teacher_server` /
    /// `teacher_model_server_url`, its ServerDistillationTrainer): the log-probs of the
    /// student's tokens (and with the `jsd` objective the teacher's top `loss_top_k`) come from
    /// the server's `echo` (vLLM, `grpo-cli serve`) instead of a local teacher.
    pub teacher_server: Option<TeacherServer>,
    /// The `jsd` objective's support (TRL's `loss_top_k`): 0 the whole vocabulary; k the
    /// teacher's top k (β = 0), the student's (β = 1) or their union, and at k = 1 with β > 0
    /// the teacher's top token and the sampled one. Absent: 1 for `algorithm = "iw_opd"` and
    /// with `[distillation.teacher_server]` (TRL's defaults there), else 0.
    pub loss_top_k: Option<usize>,
    /// A tail bucket holding the mass outside the support (TRL's `loss_add_tail`, default
    /// true); false renormalises both distributions over it.
    pub loss_add_tail: bool,
    /// The reverse side's token of the top-1 support (TRL's `reverse_kl_top_1_mode`):
    /// `sampled` (the default) or `argmax` (the student's most likely token).
    pub reverse_kl_top_1_mode: ReverseKlTop1Mode,
}

/// `distillation.reverse_kl_top_1_mode`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReverseKlTop1Mode {
    /// The completion's own token.
    #[default]
    Sampled,
    /// The student's most likely token.
    Argmax,
}

/// `[distillation.teacher_server]`: the teacher served by an OpenAI-compatible server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TeacherServer {
    /// The server's base URL, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Name of an environment variable holding the API key; unset or empty = no key.
    pub api_key_env: String,
    /// The served teacher; empty = the first one `/v1/models` lists.
    pub model: String,
    /// Seconds one scoring request may take.
    pub request_timeout: f64,
    /// Retries on connection errors and 408/409/429/5xx.
    pub max_retries: u32,
}

impl Default for TeacherServer {
    fn default() -> Self {
        let r = grpo_rollout::remote::RemoteConfig::default();
        Self {
            base_url: r.base_url,
            api_key_env: "OPENAI_API_KEY".into(),
            model: r.model,
            request_timeout: r.request_timeout,
            max_retries: r.max_retries,
        }
    }
}

impl TeacherServer {
    /// grpo-rollout's client config (the key read from `api_key_env`).
    pub fn remote_config(&self) -> grpo_rollout::remote::RemoteConfig {
        grpo_rollout::remote::RemoteConfig {
            base_url: self.base_url.clone(),
            api_key: std::env::var(&self.api_key_env).unwrap_or_default(),
            model: self.model.clone(),
            request_timeout: self.request_timeout,
            max_retries: self.max_retries,
            ..Default::default()
        }
    }
}

/// `distillation.distillation_objective`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum DistillObjective {
    /// The generalized JSD / KL over the vocabulary (`grpo_core::distill::generalized_jsd`).
    Jsd,
    /// IW-OPD: `−log π · w · (log π_T − log π_rollout)` at each sampled token
    /// (`grpo_core::distill::iw_opd_advantages`).
    IwOpd,
}

impl Default for DistillationSection {
    fn default() -> Self {
        Self {
            teacher_model_name_or_path: None,
            beta: 1.0,
            teacher_device: None,
            teacher_dtype: None,
            lmbda: None,
            seq_kd: false,
            completion_field: "completion".into(),
            distillation_objective: None,
            iw_opd_gamma: 0.5,
            iw_opd_epsilon: 1e-8,
            teacher_server: None,
            loss_top_k: None,
            loss_add_tail: true,
            reverse_kl_top_1_mode: ReverseKlTop1Mode::Sampled,
        }
    }
}

impl DistillationSection {
    /// The objective, resolved for the algorithm (see
    /// [`DistillationSection::distillation_objective`]).
    pub fn objective_for(&self, algorithm: Algorithm) -> DistillObjective {
        self.distillation_objective.unwrap_or(match algorithm {
            Algorithm::IwOpd => DistillObjective::IwOpd,
            _ => DistillObjective::Jsd,
        })
    }

    /// `loss_top_k`, resolved for the algorithm (see [`DistillationSection::loss_top_k`]).
    pub fn loss_top_k_for(&self, algorithm: Algorithm) -> usize {
        self.loss_top_k.unwrap_or(
            match algorithm == Algorithm::IwOpd || self.teacher_server.is_some() {
                true => 1,
                false => 0,
            },
        )
    }

    /// The `jsd` objective's divergence for the algorithm: over the vocabulary, or TRL's
    /// sparse support (`loss_top_k`, `loss_add_tail`, `reverse_kl_top_1_mode`).
    pub fn divergence_for(&self, algorithm: Algorithm) -> grpo_core::distill::Divergence {
        use grpo_core::distill::{Divergence, ReverseTop1};
        match self.loss_top_k_for(algorithm) {
            0 => Divergence::Full { beta: self.beta },
            k => Divergence::Sparse {
                k,
                beta: self.beta,
                add_tail: self.loss_add_tail,
                reverse: match self.reverse_kl_top_1_mode {
                    ReverseKlTop1Mode::Sampled => ReverseTop1::Sampled,
                    ReverseKlTop1Mode::Argmax => ReverseTop1::Argmax,
                },
            },
        }
    }

    /// λ, resolved for the algorithm (see [`DistillationSection::lmbda`]).
    pub fn lmbda_for(&self, algorithm: Algorithm) -> f64 {
        self.lmbda.unwrap_or(match algorithm {
            Algorithm::Gkd | Algorithm::Gold => 0.5,
            _ => 1.0,
        })
    }
}

/// `[reward]`: TRL's RewardTrainer. The model (a causal LM gets a fresh `score` head, a
/// `*ForSequenceClassification` checkpoint keeps its own) learns to score each pair's chosen
/// sequence above its rejected one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RewardSection {
    /// The preferred completion (or whole conversation) column.
    pub chosen_field: String,
    /// The dispreferred one.
    pub rejected_field: String,
    /// An optional per-pair margin column: the loss is `−log σ(r_c − r_r − margin)` where the
    /// data has it (TRL reads a column named `margin`).
    pub margin_field: String,
    /// Pairs with a chosen or rejected sequence longer than this are dropped (TRL filters, it
    /// does not cut). Default 1024.
    pub max_length: usize,
    /// `center · mean((r_c + r_r)²)` added to the loss, keeping scores near zero (default
    /// none, as in TRL).
    pub center_rewards_coefficient: Option<f64>,
    /// The EOS token appended to plain-text sequences (its text; default the tokenizer's).
    pub eos_token: Option<String>,
    /// The padding token (its text; default the tokenizer's, else its EOS). The saved model's
    /// `pad_token_id`: scores are read at each sequence's last token that is not it.
    pub pad_token: Option<String>,
}

impl Default for RewardSection {
    fn default() -> Self {
        Self {
            chosen_field: "chosen".into(),
            rejected_field: "rejected".into(),
            margin_field: "margin".into(),
            max_length: 1024,
            center_rewards_coefficient: None,
            eos_token: None,
            pad_token: None,
        }
    }
}

/// `[sft]`: TRL's SFTTrainer on prompt/completion rows or conversations.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SftSection {
    /// The completion column of prompt/completion data. When a row lacks it, the prompt must
    /// be a conversation and the loss covers its assistant turns.
    pub completion_field: String,
    /// Most prompt + completion tokens of a row: its start is kept, and a row with no loss
    /// token left is dropped (TRL's `keep_start`); with `packing`, the packed length. Default 1024.
    pub max_length: usize,
    /// Pack a step's rows into sequences of `max_length` tokens (TRL's `packing`), as
    /// `packing_strategy` says.
    pub packing: bool,
    /// bfd (default, TRL's): best-fit decreasing, each row kept whole (cut at `max_length`),
    /// its positions restarting at 0 and its attention kept inside it | bfd_split: rows longer
    /// than `max_length` cut into pieces that are packed too | wrapped: rows end to end, cut
    /// every `max_length` tokens (a row attends to the one before it).
    pub packing_strategy: PackingStrategy,
    /// Pack the eval split (TRL's name; absent = as `packing`).
    pub eval_packing: Option<bool>,
    /// TRL's `padding_free`: each micro-batch's rows run as one sequence, each row on its own
    /// positions and attending only to itself — no padding, the same loss. (Attention then
    /// spans the micro-batch's tokens, more work than padding when rows are many.)
    pub padding_free: bool,
    /// nll (default) | dft (TRL's names: dynamic fine-tuning weighs each token's NLL by its
    /// probability, as a constant).
    pub loss_type: SftLossType,
    /// Conversations (no completion column) train on their assistant turns only (TRL's name);
    /// default false, as TRL: every token after the first.
    pub assistant_only_loss: bool,
    /// Prompt/completion rows train on the completion only (TRL's name; absent = true, as
    /// TRL); false trains on the prompt's tokens too.
    pub completion_only_loss: Option<bool>,
    /// TRL's `eos_token`: the token that ends each completion and text (and the chat
    /// template's `eos_token`) in place of the tokenizer's; it must be in the vocabulary.
    pub eos_token: Option<String>,
    /// TRL's `pad_token`: the padding token of batches in place of the tokenizer's; it must be
    /// in the vocabulary (padded positions carry no loss, whatever the token).
    pub pad_token: Option<String>,
    /// TRL's language-modelling column: when `data.prompt_field` names it (e.g. both
    /// `"text"`) and a row has no completion, the row's plain text (EOS appended) trains on
    /// every token. Default `"text"`.
    pub dataset_text_field: String,
}

impl Default for SftSection {
    fn default() -> Self {
        Self {
            completion_field: "completion".into(),
            max_length: 1024,
            packing: false,
            packing_strategy: PackingStrategy::Bfd,
            eval_packing: None,
            padding_free: false,
            loss_type: SftLossType::Nll,
            assistant_only_loss: false,
            completion_only_loss: None,
            dataset_text_field: "text".into(),
            eos_token: None,
            pad_token: None,
        }
    }
}

/// `[sft] packing_strategy`: TRL's names.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PackingStrategy {
    /// Best-fit decreasing, rows whole (cut at `max_length`), attention inside each row.
    #[default]
    Bfd,
    /// Best-fit decreasing, long rows cut into pieces that are packed too (TRL's former name
    /// `bfd-requeue` is read too).
    #[serde(alias = "bfd-requeue")]
    BfdSplit,
    /// End to end, cut every `max_length` tokens.
    Wrapped,
}

impl PackingStrategy {
    /// The data crate's strategy.
    pub fn strategy(self) -> grpo_data::packing::Strategy {
        match self {
            Self::Bfd => grpo_data::packing::Strategy::Bfd,
            Self::BfdSplit => grpo_data::packing::Strategy::BfdSplit,
            Self::Wrapped => grpo_data::packing::Strategy::Wrapped,
        }
    }
}

/// `[bco]`: BCO's underlying distribution matching (UDM; TRL's BCOTrainer given an
/// `embedding_func`): with `embedding_model_name_or_path`, a logistic regression learns to tell
/// the desirable rows' prompts from the undesirable rows' by their embeddings (the model's
/// final hidden states averaged over the prompt's tokens), and each undesirable row's loss is
/// weighted by its prompt's density ratio `p / (1 − p)`, clamped. BCO's other keys are `[kto]`'s.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BcoSection {
    /// The embedding model (a causal LM directory or .gguf, with its own tokenizer); absent:
    /// no UDM (the default).
    pub embedding_model_name_or_path: Option<PathBuf>,
    /// Prompts drawn (with replacement) from each side to fit the classifier (default 1024).
    pub prompt_sample_size: usize,
    /// Smallest density-ratio weight (default 0.5).
    pub min_density_ratio: f64,
    /// Largest density-ratio weight (default 10).
    pub max_density_ratio: f64,
}

impl Default for BcoSection {
    fn default() -> Self {
        Self {
            embedding_model_name_or_path: None,
            prompt_sample_size: 1024,
            min_density_ratio: 0.5,
            max_density_ratio: 10.0,
        }
    }
}

impl BcoSection {
    /// Checks every value, naming the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.prompt_sample_size == 0 {
            return Err("`bco.prompt_sample_size` must be >= 1".into());
        }
        let (lo, hi) = (self.min_density_ratio, self.max_density_ratio);
        if !(lo.is_finite() && hi.is_finite() && lo >= 0.0 && lo <= hi) {
            return Err(format!(
                "`bco.min_density_ratio` ({lo}) and `bco.max_density_ratio` ({hi}) must be finite, \
                 >= 0 and in order"
            ));
        }
        Ok(())
    }
}

/// `[ppo]`: TRL's experimental PPOConfig. The policy samples (`[rollout]`, one completion per
/// prompt as TRL's, or more), the rewards score each completion, and a value model (a
/// sequence classifier read at every position) is trained beside the policy with the same
/// optimizer settings.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PpoSection {
    /// The value model's initial weights: a `*ForSequenceClassification` directory (TRL's
    /// examples start from the reward model), or a causal LM that gets a fresh one-label
    /// score head; default the policy's model (`model.path`) with a fresh head.
    pub value_model_name_or_path: Option<PathBuf>,
    /// Passes over each step's batch (default 4).
    pub num_ppo_epochs: usize,
    /// Optimizer updates per pass: the shuffled batch cut into this many mini-batches
    /// (default 1).
    pub num_mini_batches: usize,
    /// Whiten the per-token rewards over the batch before GAE (default false).
    pub whiten_rewards: bool,
    /// Weight of the per-token KL penalty to the reference in the reward (default 0.05).
    pub kl_coef: f64,
    /// `k1` (`log π − log π_ref`, the default) or `k3` (`(r − 1) − log r`, never negative).
    pub kl_estimator: grpo_core::ppo::KlEstimator,
    /// Clip range of the policy ratio (default 0.2).
    pub cliprange: f64,
    /// Weight of the value loss (default 0.1).
    pub vf_coef: f64,
    /// Clip range of the value estimates around their values at sampling (default 0.2).
    pub cliprange_value: f64,
    /// Discount factor (default 1).
    pub gamma: f64,
    /// GAE's λ (default 0.95).
    pub lam: f64,
    /// Subtracted from the score of a completion that ends without EOS (default none).
    pub missing_eos_penalty: Option<f64>,
}

impl Default for PpoSection {
    fn default() -> Self {
        Self {
            value_model_name_or_path: None,
            num_ppo_epochs: 4,
            num_mini_batches: 1,
            whiten_rewards: false,
            kl_coef: 0.05,
            kl_estimator: grpo_core::ppo::KlEstimator::K1,
            cliprange: 0.2,
            vf_coef: 0.1,
            cliprange_value: 0.2,
            gamma: 1.0,
            lam: 0.95,
            missing_eos_penalty: None,
        }
    }
}

impl PpoSection {
    /// Checks every value, naming the key.
    pub fn validate(&self) -> std::result::Result<(), String> {
        if self.num_ppo_epochs == 0 {
            return Err("`ppo.num_ppo_epochs` must be >= 1".into());
        }
        if self.num_mini_batches == 0 {
            return Err("`ppo.num_mini_batches` must be >= 1".into());
        }
        for (k, v) in [
            ("kl_coef", self.kl_coef),
            ("cliprange", self.cliprange),
            ("vf_coef", self.vf_coef),
            ("cliprange_value", self.cliprange_value),
        ] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(format!("`ppo.{k}` must be >= 0, got {v}"));
            }
        }
        for (k, v) in [("gamma", self.gamma), ("lam", self.lam)] {
            if !(0.0..=1.0).contains(&v) {
                return Err(format!("`ppo.{k}` must be in [0, 1], got {v}"));
            }
        }
        if let Some(p) = self.missing_eos_penalty
            && !p.is_finite()
        {
            return Err(format!("`ppo.missing_eos_penalty` must be finite, got {p}"));
        }
        Ok(())
    }
}

/// `[rloo]`: TRL's RLOOTrainer's own keys (the rest are GRPO's: `[rollout]`, `[loss]`
/// `epsilon` / `epsilon_high` / `mask_truncated_completions`, `[optim]`, `[train]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RlooSection {
    /// The KL penalty's coefficient in the reward (default 0.05; 0: no reference model).
    pub beta: f64,
    /// Centre the batch's advantages and divide by their standard deviation (default false).
    pub normalize_advantages: bool,
    /// Clip the combined reward to `[low, high]` before the KL penalty (default: none).
    pub reward_clip_range: Option<[f64; 2]>,
}

impl Default for RlooSection {
    fn default() -> Self {
        Self {
            beta: 0.05,
            normalize_advantages: false,
            reward_clip_range: None,
        }
    }
}

/// `[kto]`: TRL's KTOTrainer on unpaired rows (prompt, completion, label) against the frozen
/// reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KtoSection {
    /// β (default 0.1).
    pub beta: f64,
    /// kto (default) | apo_zero_unpaired.
    pub loss_type: KtoLossType,
    /// The weight of desirable rows' losses (default 1).
    pub desirable_weight: f64,
    /// The weight of undesirable rows' losses (default 1).
    pub undesirable_weight: f64,
    /// The completion column.
    pub completion_field: String,
    /// The label column: true (desirable) or false (undesirable).
    pub label_field: String,
    /// Most prompt + completion tokens of a row: its start is kept, and a row whose prompt
    /// alone fills it is dropped. Default 1024.
    pub max_length: usize,
    /// Compute each row's reference log-probs once (cached by row, reused every epoch); the KL
    /// estimate's mismatched pairs still run the reference, as they change with the batch.
    pub precompute_ref_log_probs: bool,
}

impl Default for KtoSection {
    fn default() -> Self {
        Self {
            beta: 0.1,
            loss_type: KtoLossType::Kto,
            desirable_weight: 1.0,
            undesirable_weight: 1.0,
            completion_field: "completion".into(),
            label_field: "label".into(),
            max_length: 1024,
            precompute_ref_log_probs: false,
        }
    }
}

impl KtoSection {
    /// grpo-core's options.
    pub fn kto_config(&self) -> KtoConfig {
        KtoConfig {
            beta: self.beta,
            desirable_weight: self.desirable_weight,
            undesirable_weight: self.undesirable_weight,
            loss_type: self.loss_type,
        }
    }
}

/// `[orpo]`: TRL's ORPOTrainer (odds-ratio preference optimisation) on preference pairs, no
/// reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OrpoSection {
    /// λ of the paper, the odds-ratio term's weight (TRL's `beta`, default 0.1).
    pub beta: f64,
    /// The preferred completion's column.
    pub chosen_field: String,
    /// The dispreferred completion's column.
    pub rejected_field: String,
    /// Most prompt + completion tokens of each side: the completion is cut to fit after its
    /// prompt, and a pair with nothing left of a completion is dropped. Default 1024.
    pub max_length: usize,
}

impl Default for OrpoSection {
    fn default() -> Self {
        Self {
            beta: 0.1,
            chosen_field: "chosen".into(),
            rejected_field: "rejected".into(),
            max_length: 1024,
        }
    }
}

/// CPO's `loss_type` as the config spells it: grpo-core's types and TRL's `alphapo` (simpo
/// without the behaviour-cloning term).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum CpoLoss {
    /// CPO's sigmoid loss on summed log-probs (the default).
    #[default]
    Sigmoid,
    /// SLiC's hinge loss.
    Hinge,
    /// IPO on token-averaged log-probs.
    Ipo,
    /// SimPO on token-averaged log-probs with the target margin `simpo_gamma`.
    Simpo,
    /// AlphaPO: simpo with `cpo_alpha = 0` and the reward shape `alpha`.
    Alphapo,
}

/// `[cpo]`: TRL's CPOTrainer (contrastive preference optimisation; SimPO and AlphaPO as its
/// loss types) on preference pairs, no reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct CpoSection {
    /// β (default 0.1); ipo's τ.
    pub beta: f64,
    /// sigmoid (default) | hinge | ipo | simpo | alphapo.
    pub loss_type: CpoLoss,
    /// Label smoothing ε of sigmoid and simpo (default 0).
    pub label_smoothing: f64,
    /// The behaviour-cloning term's weight (the chosen completions' NLL): default 1, 0 with
    /// `alphapo` (which refuses another value).
    pub cpo_alpha: Option<f64>,
    /// SimPO's target reward margin γ (default 0.5).
    pub simpo_gamma: f64,
    /// AlphaPO's reward shape α: 0 (default) rewards the log-prob, otherwise
    /// `(1 − p^(−α)) / α`; every loss type takes it.
    pub alpha: f64,
    /// The preferred completion's column.
    pub chosen_field: String,
    /// The dispreferred completion's column.
    pub rejected_field: String,
    /// Most prompt + completion tokens of each side (as `orpo.max_length`). Default 1024.
    pub max_length: usize,
}

impl Default for CpoSection {
    fn default() -> Self {
        Self {
            beta: 0.1,
            loss_type: CpoLoss::Sigmoid,
            label_smoothing: 0.0,
            cpo_alpha: None,
            simpo_gamma: 0.5,
            alpha: 0.0,
            chosen_field: "chosen".into(),
            rejected_field: "rejected".into(),
            max_length: 1024,
        }
    }
}

impl CpoSection {
    /// grpo-core's CPO options (`alphapo` resolved to simpo without the NLL term).
    pub fn cpo_config(&self) -> CpoConfig {
        let (loss_type, bc) = match self.loss_type {
            CpoLoss::Sigmoid => (CpoLossType::Sigmoid, 1.0),
            CpoLoss::Hinge => (CpoLossType::Hinge, 1.0),
            CpoLoss::Ipo => (CpoLossType::Ipo, 1.0),
            CpoLoss::Simpo => (CpoLossType::Simpo, 1.0),
            CpoLoss::Alphapo => (CpoLossType::Simpo, 0.0),
        };
        CpoConfig {
            beta: self.beta,
            label_smoothing: self.label_smoothing,
            loss_type,
            cpo_alpha: self.cpo_alpha.unwrap_or(bc),
            simpo_gamma: self.simpo_gamma,
            alpha: self.alpha,
        }
    }
}

/// `[a2po]`: TRL's A2POTrainer (A*-PO, optimal advantage regression).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct A2poSection {
    /// Stage 1: samples of the reference per prompt that estimate its optimal value (default
    /// 8).
    pub num_value_samples: usize,
    /// Stage 1's KL temperature: `V* = β1 · log mean exp(r / β1)` (default 0.5).
    pub beta1: f64,
    /// Stage 2's KL temperature: `β2 · log(π / π_ref)` regresses onto `r − V*` (default 1e-3).
    pub beta2: f64,
    /// Leave out the training prompts whose reference samples all scored 0 (default true).
    pub filter_all_incorrect: bool,
}

impl Default for A2poSection {
    fn default() -> Self {
        Self {
            num_value_samples: 8,
            beta1: 0.5,
            beta2: 1e-3,
            filter_all_incorrect: true,
        }
    }
}

/// SDPO's `distillation_mode`: which divergence the self-distillation term takes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SdpoMode {
    /// At each sampled token, `sg(log π − log π_teacher) · log π`: the reverse KL's estimate on
    /// the sampled tokens (the default).
    #[default]
    SampledToken,
    /// The divergence of the whole next-token distributions (`distillation_alpha`: 0 forward
    /// KL, 1 reverse KL, between the generalized JSD).
    FullLogits,
    /// The same over the student's `distillation_topk` most likely tokens.
    TopkLogits,
}

/// SDPO's `teacher_model_kind`: which weights score the reprompted context.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum SdpoTeacher {
    /// The policy's exponential moving average (`teacher_update_rate` each
    /// `teacher_sync_steps` optimizer updates; with LoRA, of the adapters, starting at zero as
    /// TRL's; the default).
    #[default]
    Ema,
    /// The current policy (detached).
    Live,
    /// The policy as the run started (with LoRA: the adapters switched off).
    Base,
}

/// `[sdpo]`: TRL's experimental SDPOTrainer (self-distillation policy optimisation). Each
/// completion whose group holds a successful sibling (reward ≥ `success_reward_threshold`), or
/// whose row carries feedback, gets a teacher context: its prompt reprompted with that solution
/// and feedback. The teacher scores the completion's tokens after that context; the loss pulls
/// the policy's distribution (after the plain prompt) toward it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SdpoSection {
    /// The loss is `(1 − w) · policy loss + w · self-distillation loss` (default 1: pure
    /// self-distillation; 0: GRPO's clipped loss alone).
    pub distillation_weight: f64,
    /// The divergence's interpolation: 0 forward KL, 1 reverse KL (the default; the only one
    /// `sampled_token` takes), between the generalized JSD.
    pub distillation_alpha: f64,
    /// `sampled_token` (default), `full_logits` or `topk_logits`.
    pub distillation_mode: SdpoMode,
    /// The support of `topk_logits` (required there, refused elsewhere).
    pub distillation_topk: Option<usize>,
    /// Each token's distillation loss times `min(π / π_old, c)` when the step has old
    /// log-probs (several updates per generation); 0 turns it off (TRL's `None`). Default 2.
    pub distillation_is_clip: f64,
    /// `topk_logits`: one more bucket holding the mass outside the support (default false:
    /// both distributions renormalised over it).
    pub distillation_add_tail: bool,
    /// `ema` (default), `live` or `base`.
    pub teacher_model_kind: SdpoTeacher,
    /// The EMA's rate: `teacher ← (1 − r) · teacher + r · policy` (default 0.05).
    pub teacher_update_rate: f64,
    /// Optimizer updates between EMA updates (default 1).
    pub teacher_sync_steps: usize,
    /// Reprompt with a successful sibling completion (default true).
    pub use_successful_as_teacher: bool,
    /// The combined reward a completion needs to count as a successful demonstration
    /// (default 1.0).
    pub success_reward_threshold: f64,
    /// A completion is never its own demonstration (default true).
    pub dont_reprompt_on_self_success: bool,
    /// The teacher context keeps its last this many tokens (default 10240).
    pub max_reprompt_len: usize,
    /// The reprompt: `{prompt}` (the user's last message, or the text prompt), `{solution}`,
    /// `{feedback}` (Python `str.format` fields; `{{`/`}}` for braces).
    pub reprompt_template: String,
    /// `{solution}`: formats `{successful_previous_attempt}` (the demonstration's text).
    pub solution_template: String,
    /// `{feedback}`: formats `{feedback_raw}` (the row's feedback).
    pub feedback_template: String,
    /// Reprompt with the row's feedback (`feedback_field`) when it has any (default false).
    pub include_environment_feedback: bool,
    /// Use the feedback only where no successful demonstration exists (default false).
    pub environment_feedback_only_without_solution: bool,
    /// Drop `<think>…</think>` blocks from the demonstration (default false).
    pub remove_thinking_from_demonstration: bool,
    /// The dataset column holding each row's feedback (TRL's `privileged_context`).
    pub feedback_field: String,
    /// The live teacher's log-probs from the rollout server (its synced adapter's `echo`)
    /// instead of a local forward: `rollout.backend = "openai"`, `teacher_model_kind =
    /// "live"`, `sampled_token`, `distillation_weight = 1` (default false).
    pub use_teacher_server: bool,
}

impl Default for SdpoSection {
    fn default() -> Self {
        Self {
            distillation_weight: 1.0,
            distillation_alpha: 1.0,
            distillation_mode: SdpoMode::SampledToken,
            distillation_topk: None,
            distillation_is_clip: 2.0,
            distillation_add_tail: false,
            teacher_model_kind: SdpoTeacher::Ema,
            teacher_update_rate: 0.05,
            teacher_sync_steps: 1,
            use_successful_as_teacher: true,
            success_reward_threshold: 1.0,
            dont_reprompt_on_self_success: true,
            max_reprompt_len: 10240,
            reprompt_template:
                "{prompt}{solution}{feedback}\n\nCorrectly solve the original question.\n".into(),
            solution_template: "\nCorrect solution:\n\n{successful_previous_attempt}\n\n".into(),
            feedback_template:
                "\nThe following is feedback from your unsuccessful earlier attempt:\n\n{feedback_raw}\n\n"
                    .into(),
            include_environment_feedback: false,
            environment_feedback_only_without_solution: false,
            remove_thinking_from_demonstration: false,
            feedback_field: "privileged_context".into(),
            use_teacher_server: false,
        }
    }
}

/// `[sdft]`: TRL's experimental SDFTTrainer (self-distillation fine-tuning, "Self-Distillation
/// Enables Continual Learning"). The policy samples completions; the teacher — the policy
/// itself shown each row's privileged context in `teacher_prompt_template` — scores the same
/// tokens, and the policy, after the plain prompt, learns toward it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SdftSection {
    /// The divergence's interpolation (default 0.5): 0 forward KL, 1 reverse KL, between the
    /// generalized JSD.
    pub distillation_alpha: f64,
    /// `topk_logits` (default), `full_logits` or `sampled_token` (reverse KL only).
    pub distillation_mode: SdpoMode,
    /// The support of `topk_logits` (default 100).
    pub distillation_topk: Option<usize>,
    /// The importance clip of the distillation term with old log-probs; 0 turns it off.
    /// Default 2.
    pub distillation_is_clip: f64,
    /// `topk_logits`: a bucket for the mass outside the support (default false).
    pub distillation_add_tail: bool,
    /// The first this many completion tokens carry no loss (default 0).
    pub num_loss_tokens_to_skip: usize,
    /// `base` (default: the policy as it started), `live` or `ema`.
    pub teacher_model_kind: SdpoTeacher,
    /// The EMA's rate (default 0.05; 1 resyncs the teacher every `teacher_sync_steps`).
    pub teacher_update_rate: f64,
    /// Optimizer updates between EMA updates (default 1).
    pub teacher_sync_steps: usize,
    /// Sample from the teacher's prompt (the privileged context shown) instead of the plain one
    /// (default false).
    pub generate_from_teacher: bool,
    /// The teacher's prompt: `{prompt}` (the user's last message, or the text prompt) and
    /// `{privileged_context}`, both required (Python `str.format` fields).
    pub teacher_prompt_template: String,
    /// The dataset column of each row's privileged context (TRL's `privileged_context`).
    pub privileged_context_field: String,
    /// The live teacher's log-probs from the rollout server, as SDPO's (default false).
    pub use_teacher_server: bool,
}

impl Default for SdftSection {
    fn default() -> Self {
        Self {
            distillation_alpha: 0.5,
            distillation_mode: SdpoMode::TopkLogits,
            distillation_topk: Some(100),
            distillation_is_clip: 2.0,
            distillation_add_tail: false,
            num_loss_tokens_to_skip: 0,
            teacher_model_kind: SdpoTeacher::Base,
            teacher_update_rate: 0.05,
            teacher_sync_steps: 1,
            generate_from_teacher: false,
            teacher_prompt_template: "{prompt}\n\n{privileged_context}".into(),
            privileged_context_field: "privileged_context".into(),
            use_teacher_server: false,
        }
    }
}

/// `[ssd]`: TRL's experimental SSDTrainer (simple self-distillation). The policy samples
/// completions (TRL: one per prompt) and is fine-tuned on them with cross-entropy at
/// temperature 1; sampling's `rollout.temperature`, `top_k` and `top_p` are the paper's
/// training-time T and truncation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct SsdSection {
    /// Leave out empty completions and one-line stubs (no newline and under 10 characters
    /// once stripped), as the paper's minimal syntactic filter (default true).
    pub filter_empty: bool,
}

impl Default for SsdSection {
    fn default() -> Self {
        Self { filter_empty: true }
    }
}

/// `[minillm]`: TRL's experimental MiniLLMConfig. The policy (the student) samples as GRPO's;
/// the teacher (`distillation.teacher_model_name_or_path`, on `distillation.teacher_device` in
/// `distillation.teacher_dtype`) scores the same tokens; the loss is GRPO's with per-token
/// advantages plus the single-step reverse KL.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct MiniLlmSection {
    /// Add the reverse-KL advantage `log π_T − log π_S` (discounted by `gamma`) to each
    /// token's reward advantage (default true).
    pub rkl_advantage: bool,
    /// Add the single-step decomposition: the reverse KL `KL(π_S ‖ π_T)` over the whole
    /// vocabulary at each completion token, averaged over the micro-batch's tokens (default
    /// true).
    pub single_step_decomposition: bool,
    /// The temperature both distributions are read at for the two terms above (default 1;
    /// GRPO's own log-probs stay at `rollout.temperature`).
    pub kd_temperature: f64,
    /// Discount of the later tokens' reverse-KL rewards in each token's advantage (default 0:
    /// the token's own only).
    pub gamma: f64,
    /// With `gamma > 0`, divide each advantage by its discounted count of tokens (default
    /// true).
    pub length_normalization: bool,
}

impl Default for MiniLlmSection {
    fn default() -> Self {
        Self {
            rkl_advantage: true,
            single_step_decomposition: true,
            kd_temperature: 1.0,
            gamma: 0.0,
            length_normalization: true,
        }
    }
}

/// `[prm]`: TRL's experimental PRMTrainer. The model (a causal LM gets a fresh two-label token
/// classification head, a `*ForTokenClassification` checkpoint keeps its own) learns to label
/// each step of a completion: rows hold the prompt, the completion's steps (a list of strings)
/// and one boolean label per step.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PrmSection {
    /// The steps column: a list of strings (TRL's `completions`).
    pub completions_field: String,
    /// The labels column: a list of booleans (or 0 / 1), one per step (TRL's `labels`).
    pub labels_field: String,
    /// Appended to each step before tokenising; the step's label is read at its last token
    /// (default `"\n"`).
    pub step_separator: String,
    /// Train on the last step's label only (the others are ignored; evaluation keeps every
    /// step's). Default false.
    pub train_on_last_step_only: bool,
    /// Sequences (prompt + steps) are cut to this many tokens (default 1024; TRL's `None`: 0
    /// here, no cut).
    pub max_length: usize,
    /// The steps (joined) are cut to this many tokens before the prompt is put in front
    /// (default none).
    pub max_completion_length: Option<usize>,
}

impl Default for PrmSection {
    fn default() -> Self {
        Self {
            completions_field: "completions".into(),
            labels_field: "labels".into(),
            step_separator: "\n".into(),
            train_on_last_step_only: false,
            max_length: 1024,
            max_completion_length: None,
        }
    }
}

/// `[bema]`: TRL's `BEMACallback` (Block & Zhang, "EMA Without the Lag: Bias-Corrected Iterate
/// Averaging"). After every `update_freq` optimizer updates `t` (counted past `update_after`)
/// the EMA of the trained weights moves, `EMA ← (1 − β_t) EMA + β_t θ_t` with
/// `β_t = max((lag + multiplier·t)^−ema_power, min_ema_multiplier)`, and the BEMA weights
/// become `EMA + α_t (θ_t − θ_0)` with `α_t = (lag + multiplier·t)^−bias_power`; `θ_0` and the
/// EMA start as the weights at `update_after`. The BEMA model is written to `RUN/bema` when the
/// run ends; with `update_ref_model` it also replaces the reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct BemaSection {
    /// Optimizer updates between BEMA updates (default 400).
    pub update_freq: usize,
    /// `κ`, the EMA's decay power (default 0.5; 0 turns the EMA off).
    pub ema_power: f64,
    /// `η`, the bias correction's decay power (default 0.2).
    pub bias_power: f64,
    /// `ρ`, the schedule's initial offset (default 10).
    pub lag: f64,
    /// `τ`, optimizer updates before the first snapshot (default 0).
    pub update_after: usize,
    /// `γ`, the schedule's step multiplier (default 1).
    pub multiplier: f64,
    /// The EMA's smallest decay factor (default 0).
    pub min_ema_multiplier: f64,
    /// Where `θ_0`, the EMA and the BEMA weights live (default `cpu`, as TRL's: off the
    /// training device).
    pub device: DeviceSpec,
    /// Replace the reference model with the BEMA weights every `ref_model_update_freq`
    /// updates past `ref_model_update_after` (TRL's experimental DPO callback; default false).
    pub update_ref_model: bool,
    /// Updates between reference replacements (default 400).
    pub ref_model_update_freq: usize,
    /// Updates before the first reference replacement (default 0).
    pub ref_model_update_after: usize,
}

impl Default for BemaSection {
    fn default() -> Self {
        Self {
            update_freq: 400,
            ema_power: 0.5,
            bias_power: 0.2,
            lag: 10.0,
            update_after: 0,
            multiplier: 1.0,
            min_ema_multiplier: 0.0,
            device: DeviceSpec::Cpu,
            update_ref_model: false,
            ref_model_update_freq: 400,
            ref_model_update_after: 0,
        }
    }
}

/// The self-distillation settings an SDPO or SDFT run trains with (its section's keys).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SelfDistill {
    /// The divergence (see [`SdpoMode`]).
    pub mode: SdpoMode,
    /// Its interpolation.
    pub alpha: f64,
    /// The top-k support.
    pub topk: Option<usize>,
    /// The importance clip (0: off).
    pub is_clip: f64,
    /// The top-k tail bucket.
    pub add_tail: bool,
    /// Which weights teach.
    pub teacher: SdpoTeacher,
    /// The EMA's rate.
    pub update_rate: f64,
    /// Optimizer updates between EMA updates.
    pub sync_steps: usize,
    /// The self-distillation term's weight (SDFT: 1).
    pub weight: f64,
    /// Completion tokens without loss at the start (SDPO: 0).
    pub skip: usize,
    /// The live teacher's log-probs come from the rollout server.
    pub teacher_server: bool,
}

/// TPO's `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum TpoLoss {
    /// The Bradley-Terry loss on the summed log-probs (the default).
    #[default]
    #[serde(rename = "sigmoid")]
    Sigmoid,
    /// SLiC's hinge loss.
    #[serde(rename = "hinge")]
    Hinge,
    /// IPO on token-averaged log-probs.
    #[serde(rename = "ipo")]
    Ipo,
    /// TPO-L: token-averaged, with the target margin `tpo_l_gamma`.
    #[serde(rename = "tpo-l")]
    TpoL,
}

/// `[tpo]`: TRL's TPOTrainer (triple preference optimisation) on rows with a chosen, a
/// rejected and a gold (reference) completion; no reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct TpoSection {
    /// β (default 0.01); ipo's τ.
    pub beta: f64,
    /// sigmoid (default) | hinge | ipo | tpo-l.
    pub loss_type: TpoLoss,
    /// Label smoothing ε of sigmoid and tpo-l (default 0).
    pub label_smoothing: f64,
    /// The weight of the NLL term on the gold completion (default 1; 0 leaves it out and does
    /// not run the gold sequence).
    pub tpo_alpha: f64,
    /// TPO-L's target reward margin γ (default 0.5).
    pub tpo_l_gamma: f64,
    /// The preferred completion's column.
    pub chosen_field: String,
    /// The dispreferred completion's column.
    pub rejected_field: String,
    /// The gold completion's column (TRL's `reference`).
    pub reference_field: String,
    /// Most prompt + completion tokens of each completion, the start kept (TRL's
    /// `keep_start`); a row whose prompt alone fills it is dropped. Default 1024.
    pub max_length: usize,
}

impl Default for TpoSection {
    fn default() -> Self {
        Self {
            beta: 0.01,
            loss_type: TpoLoss::Sigmoid,
            label_smoothing: 0.0,
            tpo_alpha: 1.0,
            tpo_l_gamma: 0.5,
            chosen_field: "chosen".into(),
            rejected_field: "rejected".into(),
            reference_field: "reference".into(),
            max_length: 1024,
        }
    }
}

impl TpoSection {
    /// TPO's loss as grpo-core's CPO loss: the same contrastive loss types (tpo-l is SimPO's
    /// with γ = `tpo_l_gamma`), the NLL term on the gold completion weighted by `tpo_alpha`.
    pub fn cpo_config(&self) -> CpoConfig {
        CpoConfig {
            beta: self.beta,
            label_smoothing: self.label_smoothing,
            loss_type: match self.loss_type {
                TpoLoss::Sigmoid => CpoLossType::Sigmoid,
                TpoLoss::Hinge => CpoLossType::Hinge,
                TpoLoss::Ipo => CpoLossType::Ipo,
                TpoLoss::TpoL => CpoLossType::Simpo,
            },
            cpo_alpha: self.tpo_alpha,
            simpo_gamma: self.tpo_l_gamma,
            alpha: 0.0,
        }
    }
}

/// TRL's OnlineDPOConfig `beta` (and XPO's `alpha`, Nash-MD's `mixture_coef`): one value, or
/// one per epoch (the last for the epochs after).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum EpochValues {
    /// One value for the whole run.
    One(f64),
    /// The value of epoch 0, 1, ...; the last one for the rest.
    PerEpoch(Vec<f64>),
}

impl EpochValues {
    /// The value at `epoch` (0-based).
    pub fn at(&self, epoch: u64) -> f64 {
        match self {
            Self::One(b) => *b,
            Self::PerEpoch(v) => {
                let i = usize::try_from(epoch).unwrap_or(usize::MAX);
                v.get(i).or(v.last()).copied().unwrap_or(0.1)
            }
        }
    }

    fn values(&self) -> Vec<f64> {
        match self {
            Self::One(b) => vec![*b],
            Self::PerEpoch(v) => v.clone(),
        }
    }
}

/// Refuses an empty list, or a value that is not finite or fails `ok` (`want` says the rule).
fn epoch_values(
    key: &str,
    v: &EpochValues,
    ok: impl Fn(f64) -> bool,
    want: &str,
) -> std::result::Result<(), String> {
    if matches!(v, EpochValues::PerEpoch(v) if v.is_empty()) {
        return Err(format!("`{key}` is an empty list"));
    }
    match v.values().into_iter().find(|&x| !(x.is_finite() && ok(x))) {
        Some(x) => Err(format!("`{key}` must be {want}, got {x}")),
        None => Ok(()),
    }
}

/// Online DPO's `loss_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnlineDpoLoss {
    /// `−log σ(β Δ)` (the default).
    #[default]
    Sigmoid,
    /// `(Δ − 1/(2β))²`, on the summed log-probs.
    Ipo,
}

/// `[online_dpo]`: TRL's OnlineDPOTrainer on the GRPO pipeline: two completions per prompt,
/// the rewards (`[[rewards]]`: functions, a reward model, LLM judges) pick the chosen one.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct OnlineDpoSection {
    /// β, or a list: one per epoch, the last for the rest (default 0.1).
    pub beta: EpochValues,
    /// sigmoid (default) | ipo.
    pub loss_type: OnlineDpoLoss,
    /// Subtracted from the reward of a completion without an EOS token (TRL's name); absent:
    /// none.
    pub missing_eos_penalty: Option<f64>,
}

impl Default for OnlineDpoSection {
    fn default() -> Self {
        Self {
            beta: EpochValues::One(0.1),
            loss_type: OnlineDpoLoss::Sigmoid,
            missing_eos_penalty: None,
        }
    }
}

/// `[xpo]`: TRL's XPOTrainer. Each prompt's pair is one sample of the policy and one of the
/// frozen reference, ranked by the rewards as online DPO's pairs; the loss is online DPO's
/// plus `α · Σ log π(y_ref)`, which lowers the policy's likelihood of the reference's samples
/// (exploration).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct XpoSection {
    /// α, or a list: one per epoch, the last for the rest (default 1e-5).
    pub alpha: EpochValues,
}

impl Default for XpoSection {
    fn default() -> Self {
        Self {
            alpha: EpochValues::One(1e-5),
        }
    }
}

/// `[nash_md]`: TRL's NashMDTrainer. Each prompt's pair is one sample of the policy and one of
/// the geometric mixture `log_softmax(c · reference logits + (1 − c) · policy logits)`; with
/// `p = σ(r_policy − r_mixture)` the loss is `β · Σ sg(log π − log π_ref) log π −
/// (p − ½) Σ log π` on the policy's sample.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct NashMdSection {
    /// The reference's weight `c` in the mixture, in [0, 1], or a list: one per epoch, the
    /// last for the rest (default 0.5).
    pub mixture_coef: EpochValues,
}

impl Default for NashMdSection {
    fn default() -> Self {
        Self {
            mixture_coef: EpochValues::One(0.5),
        }
    }
}

/// `[dpo]`: TRL's DPOTrainer against the frozen reference model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DpoSection {
    /// The β of the loss (default 0.1).
    pub beta: f64,
    /// TRL 1.16's loss types, one name or a list (default `sigmoid`); a list is summed with
    /// `loss_weights` (MPO-style combinations).
    #[serde(deserialize_with = "one_or_many")]
    pub loss_type: Vec<DpoLossType>,
    /// One weight per loss type (default 1 each).
    pub loss_weights: Option<Vec<f64>>,
    /// Label smoothing ε of robust, exo_pair, aot and aot_unpaired (default 0; TRL 1.16's
    /// sigmoid ignores it, so it is refused there).
    pub label_smoothing: f64,
    /// reverse_kl (default) | forward_kl | js_divergence | alpha_divergence (f-DPO).
    pub f_divergence_type: FDivergence,
    /// α of the α-divergence (default 0.5).
    pub f_alpha_divergence_coef: f64,
    /// DiscoPOP's τ (default 0.05).
    pub discopop_tau: f64,
    /// LD-DPO's α in [0, 1] (TRL's `ld_alpha`): each pair's tokens past the shorter
    /// completion's length count α in the summed log-probs; absent = 1 (plain DPO).
    pub ld_alpha: Option<f64>,
    /// WPO (TRL's `use_weighting`): each pair's loss weighted by how likely both completions
    /// are under the policy's own sampling (`grpo_core::preference::wpo_pair_weights`);
    /// default false. Not with aot / aot_unpaired.
    pub use_weighting: bool,
    /// The preferred completion's column.
    pub chosen_field: String,
    /// The dispreferred completion's column.
    pub rejected_field: String,
    /// Most prompt + completion tokens of a row: its start is kept, and a pair whose prompt
    /// alone fills it is dropped (TRL's `keep_start`). Default 1024.
    pub max_length: usize,
    /// Compute each pair's reference log-probs once (cached by row, reused every epoch) instead
    /// of at every step.
    pub precompute_ref_log_probs: bool,
}

impl DpoSection {
    /// grpo-core's DPO options.
    pub fn dpo_config(&self) -> DpoConfig {
        DpoConfig {
            loss_type: self.loss_type.clone(),
            loss_weights: self.loss_weights.clone(),
            beta: self.beta,
            label_smoothing: self.label_smoothing,
            f_divergence_type: self.f_divergence_type,
            f_alpha_divergence_coef: self.f_alpha_divergence_coef,
            discopop_tau: self.discopop_tau,
            use_weighting: self.use_weighting,
        }
    }
}

/// TRL's `loss_type`: one name or a list of names.
fn one_or_many<'de, D: serde::Deserializer<'de>>(d: D) -> Result<Vec<DpoLossType>, D::Error> {
    struct V;
    impl<'de> serde::de::Visitor<'de> for V {
        type Value = Vec<DpoLossType>;
        fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
            f.write_str("a DPO loss type or a list of them")
        }
        fn visit_str<E: serde::de::Error>(self, v: &str) -> Result<Self::Value, E> {
            v.parse().map(|t| vec![t]).map_err(E::custom)
        }
        fn visit_seq<A: serde::de::SeqAccess<'de>>(
            self,
            mut seq: A,
        ) -> Result<Self::Value, A::Error> {
            let mut out = Vec::new();
            while let Some(name) = seq.next_element::<String>()? {
                out.push(name.parse().map_err(serde::de::Error::custom)?);
            }
            Ok(out)
        }
    }
    d.deserialize_any(V)
}

impl Default for DpoSection {
    fn default() -> Self {
        Self {
            beta: 0.1,
            loss_type: vec![DpoLossType::Sigmoid],
            loss_weights: None,
            label_smoothing: 0.0,
            f_divergence_type: FDivergence::ReverseKl,
            f_alpha_divergence_coef: 0.5,
            discopop_tau: 0.05,
            ld_alpha: None,
            use_weighting: false,
            chosen_field: "chosen".into(),
            rejected_field: "rejected".into(),
            max_length: 1024,
            precompute_ref_log_probs: false,
        }
    }
}

impl Default for TrainConfig {
    fn default() -> Self {
        Self {
            output_dir: PathBuf::from("runs/grpo"),
            overwrite_output_dir: false,
            model: ModelSection::default(),
            reference: ReferenceSection::default(),
            data: DataConfig::default(),
            rollout: RolloutSection::default(),
            rewards: Vec::new(),
            reward_weights: None,
            reward_model_path: None,
            reward_model_device: None,
            reward_model_dtype: None,
            loss: LossSection::default(),
            optim: OptimSection::default(),
            train: TrainSection::default(),
            pipeline: PipelineSection::default(),
            environment: EnvironmentSection::default(),
            teacher: None,
            algorithm: Algorithm::Grpo,
            sft: SftSection::default(),
            dpo: DpoSection::default(),
            kto: KtoSection::default(),
            orpo: OrpoSection::default(),
            cpo: CpoSection::default(),
            online_dpo: OnlineDpoSection::default(),
            xpo: XpoSection::default(),
            nash_md: NashMdSection::default(),
            tpo: TpoSection::default(),
            a2po: A2poSection::default(),
            sdpo: SdpoSection::default(),
            sdft: SdftSection::default(),
            ssd: SsdSection::default(),
            minillm: MiniLlmSection::default(),
            prm: PrmSection::default(),
            bema: None,
            merge: None,
            gold: GoldSection::default(),
            rloo: RlooSection::default(),
            ppo: PpoSection::default(),
            bco: BcoSection::default(),
            reward: RewardSection::default(),
            distillation: DistillationSection::default(),
        }
    }
}

/// `[environment]`: multi-turn episodes: which environment (`type`), and how they run.
///
/// `type = "tools"` is the built-in tool environment (`[[environment.tools]]`: commands and
/// Python functions the model calls in the Hermes `<tool_call>` format), `type = "python"` a
/// Python class with NeMo RL's `step` (`[environment.python]`). Without `type` the trainer
/// runs episodes only when given an environment in code (`FitOptions::environment`,
/// `Trainer::with_environment`); else these keys are unused and generation is single-turn.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct EnvironmentSection {
    /// The environment the config builds: `tools` or `python`; absent = none (or one given in
    /// code).
    #[serde(rename = "type")]
    pub kind: Option<EnvironmentKind>,
    /// Model turns per episode at most (>= 1). Default 4.
    pub max_turns: usize,
    /// Tokens one model turn may sample; absent = `rollout.max_completion_length`.
    pub max_tokens_per_turn: Option<usize>,
    /// Tokens after the prompt (model and environment tokens) an episode may hold; absent =
    /// 4 × `rollout.max_completion_length`.
    pub max_total_tokens: Option<usize>,
    /// How the per-turn rewards make the episode's `env` reward: `sum` (default) or `last`.
    pub reward: EnvironmentReward,
    /// Seconds one call of the environment (a turn's `step` for the whole batch, or its
    /// post-processing) may take before the run ends with a checkpoint and an error naming
    /// it. Default 600.
    pub step_timeout: f64,
    /// `type = "tools"`: the tools (`[[environment.tools]]`, `type = "command"` or
    /// `"python"`).
    pub tools: Vec<ToolConfig>,
    /// `type = "tools"`: calls run per model turn at most (later ones are answered with an
    /// error). Default 8.
    pub max_calls_per_turn: usize,
    /// `type = "python"`: the class (`path`, `class`, `init`, `python`, `timeout`, `name`).
    pub python: Option<PythonEnvironmentConfig>,
    /// `type = "factory"` with several classes (TRL's dict of `environment_factory`): one
    /// `[environment.factories.NAME]` table (the keys of `[environment.python]`) per
    /// environment, each row picking one by its `environment` column.
    pub factories: BTreeMap<String, PythonEnvironmentConfig>,
    /// `type = "ors"`: the Open Reward Standard server (`[environment.ors]`: `url`,
    /// `env_name`, `split`, `secrets`, ...; see `grpo_rollout::ors::OrsConfig`).
    pub ors: Option<OrsConfig>,
}

/// `environment.type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvironmentKind {
    /// The built-in tool environment.
    Tools,
    /// A Python class.
    Python,
    /// An environment on an Open Reward Standard server.
    Ors,
    /// A Python class with TRL's `environment_factory` interface (`[environment.python]`):
    /// an instance per episode, `reset(**row)`, public methods as tools, `get_reward()`.
    Factory,
}

impl Default for EnvironmentSection {
    fn default() -> Self {
        Self {
            kind: None,
            max_turns: 4,
            max_tokens_per_turn: None,
            max_total_tokens: None,
            reward: EnvironmentReward::Sum,
            step_timeout: 600.0,
            tools: Vec::new(),
            max_calls_per_turn: 8,
            python: None,
            factories: BTreeMap::new(),
            ors: None,
        }
    }
}

impl EnvironmentSection {
    /// Whether the environment may own the run's data (TRL's `environment_factory` without a
    /// `train_dataset`): a single factory class, whose `reset` gives every prompt.
    pub fn owns_data(&self) -> bool {
        self.kind == Some(EnvironmentKind::Factory) && self.factories.is_empty()
    }

    /// Checks that `type` and its keys go together.
    fn validate_kind(&self) -> Result<(), String> {
        if !(self.step_timeout.is_finite() && self.step_timeout > 0.0) {
            return Err(format!(
                "`environment.step_timeout` must be a number of seconds > 0, got {}",
                self.step_timeout
            ));
        }
        if self.max_calls_per_turn == 0 {
            return Err("`environment.max_calls_per_turn` must be >= 1".into());
        }
        match self.kind {
            Some(EnvironmentKind::Tools) if self.tools.is_empty() => Err(
                "`environment.type = \"tools\"` needs at least one [[environment.tools]]".into(),
            ),
            Some(EnvironmentKind::Python) if self.python.is_none() => Err(
                "`environment.type = \"python\"` needs [environment.python] with `path` and `class`"
                    .into(),
            ),
            Some(EnvironmentKind::Factory) if self.python.is_none() == self.factories.is_empty() => {
                Err(
                    "`environment.type = \"factory\"` needs [environment.python] (one class) or \
                     [environment.factories.NAME] tables (several, routed by the `environment` \
                     column), not both"
                        .into(),
                )
            }
            Some(k) if k != EnvironmentKind::Factory && !self.factories.is_empty() => Err(
                "`environment.factories` are used with `environment.type = \"factory\"`".into(),
            ),
            Some(k) if k != EnvironmentKind::Tools && !self.tools.is_empty() => Err(
                "`environment.tools` are used with `environment.type = \"tools\"`".into(),
            ),
            Some(k)
                if !matches!(k, EnvironmentKind::Python | EnvironmentKind::Factory)
                    && self.python.is_some() =>
            {
                Err(
                    "`environment.python` is used with `environment.type = \"python\"` or \"factory\""
                        .into(),
                )
            }
            Some(EnvironmentKind::Ors) if self.ors.is_none() => Err(
                "`environment.type = \"ors\"` needs [environment.ors] with the server's `url`"
                    .into(),
            ),
            Some(k) if k != EnvironmentKind::Ors && self.ors.is_some() => Err(
                "`environment.ors` is used with `environment.type = \"ors\"`".into(),
            ),
            Some(EnvironmentKind::Ors) => self
                .ors
                .as_ref()
                .map_or(Ok(()), |o| o.validate().map_err(|e| e.to_string())),
            None if !self.tools.is_empty() || self.python.is_some() || self.ors.is_some() => Err(
                "`environment.tools` / `environment.python` / `environment.ors` need \
                 `environment.type` (\"tools\", \"python\", \"factory\" or \"ors\")"
                    .into(),
            ),
            _ => {
                let mut names = std::collections::BTreeSet::new();
                for (i, t) in self.tools.iter().enumerate() {
                    if !names.insert(t.name()) {
                        return Err(format!(
                            "`environment.tools[{i}]`: a tool named `{}` exists already",
                            t.name()
                        ));
                    }
                }
                Ok(())
            }
        }
    }

    /// `max_tokens_per_turn` with its default filled in from `rollout`.
    pub fn tokens_per_turn(&self, rollout: &RolloutSection) -> usize {
        self.max_tokens_per_turn
            .unwrap_or(rollout.max_completion_length)
    }

    /// `max_total_tokens` with its default filled in from `rollout`.
    pub fn total_tokens(&self, rollout: &RolloutSection) -> usize {
        self.max_total_tokens
            .unwrap_or(4 * rollout.max_completion_length)
    }
}

/// How an episode's per-turn rewards become its `env` reward (`environment.reward`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum EnvironmentReward {
    /// The sum of the turns' rewards (NeMo RL's `total_reward`).
    #[default]
    Sum,
    /// The last turn's reward.
    Last,
}

impl EnvironmentReward {
    /// The episode reward of `turn_rewards` (0 without turns).
    pub fn of(self, turn_rewards: &[f32]) -> f32 {
        match self {
            Self::Sum => turn_rewards.iter().sum(),
            Self::Last => turn_rewards.last().copied().unwrap_or(0.0),
        }
    }
}

/// `[model]`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ModelSection {
    /// A Hugging Face model directory or a .gguf file.
    pub path: PathBuf,
    /// `f32` (default), `bf16` or `f16`.
    pub dtype: Dtype,
    /// `cpu` (default), `cuda` or `cuda:N` (needs a build with `--features cuda`).
    pub device: DeviceSpec,
    /// Train LoRA adapters instead of every weight.
    pub lora: Option<LoraConfig>,
    /// Extra variables for every chat template rendering (TRL's `chat_template_kwargs`,
    /// e.g. `{ enable_thinking = false }` for Qwen3).
    pub chat_template_kwargs: serde_json::Map<String, serde_json::Value>,
    /// TRL's `cast_lm_head_to_fp32` (the ScaleRL recipe): with a bf16 / f16 compute dtype, the
    /// output head of the policy, the reference and the generator is kept and computed in f32
    /// (`Transformer::cast_head_to_f32`). Default false.
    pub cast_lm_head_to_fp32: bool,
    /// TRL's `chat_template_path`: the chat template of a Jinja file, or of a model directory
    /// (its template and EOS token), in place of the model's own. Absent: the model's.
    pub chat_template_path: Option<PathBuf>,
}

impl Default for ModelSection {
    fn default() -> Self {
        Self {
            path: PathBuf::new(),
            dtype: Dtype::F32,
            device: DeviceSpec::Cpu,
            lora: None,
            chat_template_kwargs: serde_json::Map::new(),
            cast_lm_head_to_fp32: false,
            chat_template_path: None,
        }
    }
}

/// `[reference]`: TRL's KL and reference-sync options.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct ReferenceSection {
    /// KL coefficient; 0 (TRL's default) skips the reference model entirely.
    pub beta: f64,
    /// TR-DPO style: every `ref_model_sync_steps`, ref ← α·policy + (1 − α)·ref.
    pub sync_ref_model: bool,
    /// α of the sync.
    pub ref_model_mixup_alpha: f64,
    /// Steps between syncs.
    pub ref_model_sync_steps: usize,
}

impl Default for ReferenceSection {
    fn default() -> Self {
        Self {
            beta: 0.0,
            sync_ref_model: false,
            ref_model_mixup_alpha: 0.6,
            ref_model_sync_steps: 512,
        }
    }
}

/// `[rollout]`: how completions are sampled.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct RolloutSection {
    /// Completions per prompt (the group).
    pub num_generations: usize,
    /// Completions per prompt when evaluating (TRL's name); absent = `num_generations`.
    pub num_generations_eval: Option<usize>,
    /// Prompts longer than this many tokens keep their last tokens (left truncation); 0 = off,
    /// the default (TRL 1.16 has no `max_prompt_length`: prompts are not cut).
    pub max_prompt_length: usize,
    /// New tokens per completion at most.
    pub max_completion_length: usize,
    /// EOS suppressed until this many tokens.
    pub min_completion_length: usize,
    /// Sampling temperature (> 0); log-probs use logits / temperature, as TRL.
    pub temperature: f64,
    /// Nucleus mass.
    pub top_p: f64,
    /// Keep the k most likely tokens; 0 = off.
    pub top_k: usize,
    /// Drop tokens below min_p × the top probability; 0 = off.
    pub min_p: f64,
    /// CTRL-style repetition penalty; 1 = off.
    pub repetition_penalty: f64,
    /// Stop strings (the completion ends after the first one).
    pub stop: Vec<String>,
    /// TRL's `vllm_structured_outputs_regex`: every completion's text matches this regular
    /// expression (Rust `regex` syntax) from its first byte to its last, EOS allowed only
    /// where it has matched; absent = unconstrained. The local backend masks the tokens that
    /// cannot continue a match; the openai backend sends it as vLLM's `structured_outputs`.
    pub structured_outputs_regex: Option<String>,
    /// Render conversational prompts with the model's chat template (string prompts are used
    /// as they are, as TRL does).
    pub chat_template: bool,
    /// Where completions are sampled: `local` (this process) or `openai` (an OpenAI-compatible
    /// server such as vLLM or `grpo-cli serve`, LoRA weights synced each step).
    pub backend: Backend,
    /// `[rollout.openai]`: the server of `backend = "openai"`.
    pub openai: OpenAiRollout,
    /// Where the local backend samples (`cpu`, `cuda`, `cuda:N`); absent = `model.device`.
    /// A device of its own (`cuda:1` beside a learner on `cuda:0`) keeps a copy of the policy
    /// there, updated at every publish (a LoRA run's frozen base is copied once).
    pub device: Option<DeviceSpec>,
}

/// `[rollout.openai]`: generation on an OpenAI-compatible server.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OpenAiRollout {
    /// The server's base URL.
    pub base_url: String,
    /// Name of an environment variable holding the API key (vLLM's `--api-key`); unset or
    /// empty = no key.
    pub api_key_env: String,
    /// The served base model; empty = the first one `/v1/models` lists.
    pub model: String,
    /// Seconds a completions request may take.
    pub request_timeout: f64,
    /// Seconds a LoRA load may take (also the first contact).
    pub sync_timeout: f64,
    /// Retries on connection errors and 429/502/503/504.
    pub max_retries: u32,
    /// Where the adapters to sync are written (the server must read the same path); empty =
    /// `OUTPUT_DIR/rollout_adapters`.
    pub adapter_dir: String,
}

impl Default for OpenAiRollout {
    fn default() -> Self {
        let r = grpo_rollout::remote::RemoteConfig::default();
        Self {
            base_url: r.base_url,
            api_key_env: "OPENAI_API_KEY".into(),
            model: r.model,
            request_timeout: r.request_timeout,
            sync_timeout: r.sync_timeout,
            max_retries: r.max_retries,
            adapter_dir: String::new(),
        }
    }
}

impl OpenAiRollout {
    /// grpo-rollout's client config (the key read from `api_key_env`).
    pub fn remote_config(&self) -> grpo_rollout::remote::RemoteConfig {
        grpo_rollout::remote::RemoteConfig {
            base_url: self.base_url.clone(),
            api_key: std::env::var(&self.api_key_env).unwrap_or_default(),
            model: self.model.clone(),
            request_timeout: self.request_timeout,
            sync_timeout: self.sync_timeout,
            max_retries: self.max_retries,
        }
    }
}

impl Default for RolloutSection {
    fn default() -> Self {
        Self {
            num_generations: 8,
            num_generations_eval: None,
            max_prompt_length: 0,
            max_completion_length: 512,
            min_completion_length: 0,
            temperature: 1.0,
            top_p: 1.0,
            top_k: 0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            stop: Vec::new(),
            structured_outputs_regex: None,
            chat_template: true,
            backend: Backend::Local,
            openai: OpenAiRollout::default(),
            device: None,
        }
    }
}

impl RolloutSection {
    /// grpo-rollout's sampling parameters for one generation call.
    pub fn sampling(&self, seed: u64) -> SamplingParams {
        SamplingParams {
            max_new_tokens: self.max_completion_length,
            min_new_tokens: self.min_completion_length,
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repetition_penalty,
            stop_token_ids: Vec::new(),
            stop: self.stop.clone(),
            seed,
            top_logprobs: 0,
            logit_bias: Vec::new(),
            regex: self.structured_outputs_regex.clone(),
        }
    }
}

/// `[loss]`: grpo-core's options (β lives in `[reference]`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct LossSection {
    /// grpo | bnpo | dr_grpo | dapo (default) | cispo | sapo | luspo | vespo | gmpo.
    pub loss_type: LossType,
    /// Lower clip ε; absent: TRL's default for the loss type (0.2; gmpo 0.4, in log space).
    pub epsilon: Option<f64>,
    /// Upper clip ε (default: `epsilon`).
    pub epsilon_high: Option<f64>,
    /// Two-sided GRPO cap on the ratio.
    pub delta: Option<f64>,
    /// token (default) | sequence.
    pub importance_sampling_level: ImportanceSamplingLevel,
    /// Multiply the KL by the importance ratio (TRL's `use_bias_correction_kl`).
    pub use_bias_correction_kl: bool,
    /// The KL estimate of `reference.beta`'s term: k3 (TRL's, default) | verl's
    /// `actor.kl_loss_type`: k1 (kl) | abs | k2 (mse) | low_var_kl, with `+` for k2's gradient.
    pub kl_loss_type: KlLossType,
    /// group (default) | batch | none (TRL's booleans: true = group, false = none).
    pub scale_rewards: ScaleRewards,
    /// sum_then_normalize (default) | normalize_then_sum (GDPO: each reward normalised in its
    /// group, the weighted sum normalised over the batch; `scale_rewards` does not apply).
    pub multi_objective_aggregation: MultiObjectiveAggregation,
    /// NeMo RL's `use_leave_one_out_baseline`: each completion's baseline is the mean of the
    /// other completions of its group (RLOO), and with `scale_rewards = "group"` the centred
    /// reward is divided by the other completions' std (NeMo's `normalize_rewards`); `"none"`
    /// leaves it unscaled. `"batch"` does not combine with it.
    pub use_leave_one_out_baseline: bool,
    /// Exclude completions cut at max_completion_length from the loss.
    pub mask_truncated_completions: bool,
    /// Drop groups whose rewards are all equal (DAPO's dynamic sampling) from the loss.
    pub drop_zero_std_groups: bool,
    /// TRL's `GRPOWithReplayBufferTrainer`: keep the best this many groups whose rewards vary
    /// (by Σ|advantage| × reward std) and train on one of them, drawn ∝ its score, in the
    /// place of each group whose rewards are all equal (0: off; `algorithm = "grpo"`).
    pub replay_buffer_size: usize,
    /// Correct off-policy samples (a generator up to `pipeline.max_staleness` versions behind)
    /// with the importance ratio of the learner's policy to the sampling policy (TRL's name).
    pub vllm_importance_sampling_correction: bool,
    /// token_truncate | token_mask | sequence_truncate | sequence_mask (default).
    pub vllm_importance_sampling_mode: ImportanceSamplingMode,
    /// Lower bound of the ratio (none by default).
    pub vllm_importance_sampling_clip_min: Option<f64>,
    /// Upper bound of the ratio (3.0); TRL's deprecated `vllm_importance_sampling_cap` is
    /// read as this.
    #[serde(alias = "vllm_importance_sampling_cap")]
    pub vllm_importance_sampling_clip_max: f64,
    /// sapo: temperature for tokens with a positive advantage (1.0).
    pub sapo_temperature_pos: f64,
    /// sapo: temperature for tokens with a non-positive advantage (1.05).
    pub sapo_temperature_neg: f64,
    /// vespo: power k for non-negative advantages (2.0).
    pub vespo_k_pos: f64,
    /// vespo: decay λ for non-negative advantages (3.0).
    pub vespo_lambda_pos: f64,
    /// vespo: power k for negative advantages (3.0).
    pub vespo_k_neg: f64,
    /// vespo: decay λ for negative advantages (2.0).
    pub vespo_lambda_neg: f64,
    /// DeepSeek-V3.2's off-policy sequence mask: drop negative-advantage sequences whose mean
    /// log-prob gap to the sampling policy exceeds this (none: off).
    pub off_policy_mask_threshold: Option<f64>,
    /// Keep only the top ρ quantile of tokens by entropy in the policy loss (1.0: all).
    pub top_entropy_quantile: f64,
    /// Entropy bonus coefficient (0.0: none); the starting value with adaptive control.
    pub entropy_coef: f64,
    /// Skywork-OR1's adaptive entropy control of `entropy_coef`.
    pub use_adaptive_entropy: bool,
    /// Adaptive control: lower bound of the coefficient (0.0).
    pub entropy_coef_min: f64,
    /// Adaptive control: upper bound of the coefficient (1.0).
    pub entropy_coef_max: f64,
    /// Adaptive control: step of the coefficient per optimizer update (0.005).
    pub entropy_coef_delta: f64,
    /// Adaptive control: the bonus applies while the mean entropy is at or below this (0.2).
    pub entropy_target: f64,
    /// TRL's `router_aux_loss_coef`: the weight of a mixture-of-experts model's load-balancing
    /// loss in the training loss (divided by the micro-batches of the update, as TRL does);
    /// absent: the model config's `router_aux_loss_coef` (0.001 by default), 0: off. An error
    /// on a model without experts.
    pub router_aux_loss_coef: Option<f64>,
    /// verl's `algorithm.adv_estimator`: grpo (default: TRL's group advantages, with
    /// `scale_rewards`) | rloo | reinforce_plus_plus | reinforce_plus_plus_baseline | opo |
    /// grpo_passk | gpg | remax (grpo-core's `estimators`; `algorithm = "grpo"`).
    pub adv_estimator: AdvEstimator,
    /// verl's `algorithm.gamma`: REINFORCE++'s discount per token (default 1).
    pub gamma: f64,
    /// verl's `algorithm.use_kl_in_reward`: each token's reward is `−β · KL(π_old ‖ π_ref)`,
    /// the completion's score added on its last token, before the advantages (β from
    /// `kl_ctrl`; needs the reference model, which is loaded for it).
    pub use_kl_in_reward: bool,
    /// verl's `algorithm.kl_penalty`: kl (default) | abs | mse | low_var_kl.
    pub kl_penalty: KlPenalty,
    /// verl's `algorithm.kl_ctrl`: the in-reward KL coefficient, fixed or adaptive.
    pub kl_ctrl: KlCtrlSection,
    /// DAPO's dynamic sampling (verl's `algorithm.filter_groups`): draw more prompts until the
    /// step has `train.prompts_per_step` groups whose rewards differ.
    pub filter_groups: FilterGroupsSection,
    /// verl's `actor.policy_loss`: Clip-Cov or KL-Cov on the clipped token loss.
    pub policy_loss: PolicyLossSection,
}

/// `[loss.policy_loss]`: verl's `actor.policy_loss` (`grpo_core::cov`): the clipped token loss
/// (`vanilla`), Clip-Cov or KL-Cov (Cui et al. 2025).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct PolicyLossSection {
    /// vanilla (default) | clip_cov | kl_cov.
    pub loss_mode: PolicyLossMode,
    /// Clip-Cov: the share of the micro-batch's tokens whose gradient may be dropped (0.0002).
    pub clip_cov_ratio: f64,
    /// Clip-Cov: the covariance's lower bound (1.0).
    pub clip_cov_lb: f64,
    /// Clip-Cov: the covariance's upper bound (5.0).
    pub clip_cov_ub: f64,
    /// KL-Cov: the share of the micro-batch's tokens penalised (0.0002).
    pub kl_cov_ratio: f64,
    /// KL-Cov: the coefficient of `|log ratio|` (0.1, verl's default).
    pub ppo_kl_coef: f64,
}

/// verl's policy-loss modes that rework the clipped token loss.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum PolicyLossMode {
    /// The clipped loss of `loss.loss_type`.
    Vanilla,
    /// Clip-Cov.
    ClipCov,
    /// KL-Cov.
    KlCov,
}

impl Default for PolicyLossSection {
    fn default() -> Self {
        Self {
            loss_mode: PolicyLossMode::Vanilla,
            clip_cov_ratio: 0.0002,
            clip_cov_lb: 1.0,
            clip_cov_ub: 5.0,
            kl_cov_ratio: 0.0002,
            ppo_kl_coef: 0.1,
        }
    }
}

impl PolicyLossSection {
    /// grpo-core's setting (Clip-Cov's seed 0: the learner seeds each micro-batch).
    pub fn cov(&self) -> grpo_core::cov::CovLoss {
        use grpo_core::cov::CovLoss;
        match self.loss_mode {
            PolicyLossMode::Vanilla => CovLoss::Off,
            PolicyLossMode::ClipCov => CovLoss::ClipCov {
                ratio: self.clip_cov_ratio,
                lb: self.clip_cov_lb,
                ub: self.clip_cov_ub,
                seed: 0,
            },
            PolicyLossMode::KlCov => CovLoss::KlCov {
                ratio: self.kl_cov_ratio,
                coef: self.ppo_kl_coef,
            },
        }
    }
}

/// `[loss.filter_groups]`: DAPO's dynamic sampling (verl's `algorithm.filter_groups`). The
/// generator samples batches of `gen_batch_size` prompts, the scorer keeps the groups whose
/// `metric` is not the same for every completion, and a step trains on the first
/// `train.prompts_per_step` groups kept (`crate::stages::filter`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FilterGroupsSection {
    /// On or off (default off).
    pub enable: bool,
    /// What must differ within a group: `reward` (the combined reward, default), a reward's
    /// name (its score), or a value the rewards log per completion (a verl reward's dict key,
    /// such as `acc`).
    pub metric: String,
    /// The most generation batches one step may draw; 0 (default): no limit. A step that
    /// reaches it without enough groups stops the run with a checkpoint (verl's error).
    pub max_num_gen_batches: usize,
    /// verl's `data.gen_batch_size`: prompts per generation batch (default: the step's
    /// `train.prompts_per_step`).
    pub gen_batch_size: Option<usize>,
}

impl Default for FilterGroupsSection {
    fn default() -> Self {
        Self {
            enable: false,
            metric: "reward".into(),
            max_num_gen_batches: 0,
            gen_batch_size: None,
        }
    }
}

/// `[loss.kl_ctrl]`: verl's `algorithm.kl_ctrl` (the in-reward KL coefficient).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct KlCtrlSection {
    /// fixed (default) | adaptive.
    #[serde(rename = "type")]
    pub kind: KlCtrlKind,
    /// β at the start (default 0.001).
    pub kl_coef: f64,
    /// The adaptive controller's target KL (default 0.1).
    pub target_kl: f64,
    /// The adaptive controller's horizon in completions (default 10000).
    pub horizon: f64,
}

/// Whether the in-reward KL coefficient moves.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum KlCtrlKind {
    /// β stays `kl_coef`.
    Fixed,
    /// β moves toward `target_kl` (Ziegler et al. 2019).
    Adaptive,
}

impl Default for KlCtrlSection {
    fn default() -> Self {
        Self {
            kind: KlCtrlKind::Fixed,
            kl_coef: 0.001,
            target_kl: 0.1,
            horizon: 10000.0,
        }
    }
}

impl KlCtrlSection {
    /// The controller at the run's start.
    pub fn controller(&self) -> KlController {
        KlController {
            value: self.kl_coef,
            adaptive: (self.kind == KlCtrlKind::Adaptive).then_some((self.target_kl, self.horizon)),
        }
    }
}

impl Default for LossSection {
    fn default() -> Self {
        Self {
            loss_type: LossType::Dapo,
            epsilon: None,
            epsilon_high: None,
            delta: None,
            importance_sampling_level: ImportanceSamplingLevel::Token,
            use_bias_correction_kl: false,
            kl_loss_type: KlLossType::default(),
            scale_rewards: ScaleRewards::Group,
            multi_objective_aggregation: MultiObjectiveAggregation::SumThenNormalize,
            use_leave_one_out_baseline: false,
            mask_truncated_completions: false,
            drop_zero_std_groups: false,
            replay_buffer_size: 0,
            vllm_importance_sampling_correction: true,
            vllm_importance_sampling_mode: ImportanceSamplingMode::SequenceMask,
            vllm_importance_sampling_clip_min: None,
            vllm_importance_sampling_clip_max: 3.0,
            sapo_temperature_pos: 1.0,
            sapo_temperature_neg: 1.05,
            vespo_k_pos: 2.0,
            vespo_lambda_pos: 3.0,
            vespo_k_neg: 3.0,
            vespo_lambda_neg: 2.0,
            off_policy_mask_threshold: None,
            top_entropy_quantile: 1.0,
            entropy_coef: 0.0,
            use_adaptive_entropy: false,
            entropy_coef_min: 0.0,
            entropy_coef_max: 1.0,
            entropy_coef_delta: 0.005,
            entropy_target: 0.2,
            router_aux_loss_coef: None,
            adv_estimator: AdvEstimator::Grpo,
            gamma: 1.0,
            use_kl_in_reward: false,
            kl_penalty: KlPenalty::Kl,
            kl_ctrl: KlCtrlSection::default(),
            filter_groups: FilterGroupsSection::default(),
            policy_loss: PolicyLossSection::default(),
        }
    }
}

/// `[optim]`: AdamW, the schedule, clipping, accumulation.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct OptimSection {
    /// Peak learning rate; absent: TRL's default for the algorithm
    /// ([`Algorithm::default_learning_rate`]).
    pub learning_rate: Option<f64>,
    /// AdamW β1.
    pub adam_beta1: f64,
    /// AdamW β2.
    pub adam_beta2: f64,
    /// AdamW ε.
    pub adam_epsilon: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// transformers' names: linear (default) | constant | constant_with_warmup | cosine |
    /// cosine_with_restarts | polynomial | inverse_sqrt | cosine_with_min_lr |
    /// warmup_stable_decay.
    pub lr_scheduler_type: ScheduleKind,
    /// The shape's own parameters (TRL's `lr_scheduler_kwargs`), e.g. `{ num_cycles = 2 }`.
    pub lr_scheduler_kwargs: ScheduleKwargs,
    /// Warm-up as a fraction of the total steps.
    pub warmup_ratio: f64,
    /// Warm-up steps (wins over `warmup_ratio` when > 0).
    pub warmup_steps: usize,
    /// Global-norm gradient clipping; 0 = off.
    pub max_grad_norm: f64,
    /// Micro-batches per optimizer step (TRL's name). Default: all completions of a step in one
    /// micro-batch, or `num_completions / per_device_train_batch_size`.
    pub gradient_accumulation_steps: Option<usize>,
    /// Optimizer passes over each generation batch (TRL's μ).
    pub num_iterations: usize,
    /// transformers' `optim`: `adamw_torch` (the default; `adamw_torch_fused` and
    /// `paged_adamw_32bit` are the same update here) or bitsandbytes' 8-bit AdamW
    /// (`adamw_8bit`, `adamw_bnb_8bit`, `paged_adamw_8bit`): the moments in one byte per value.
    pub optim: OptimName,
    /// TRL's `steps_per_generation`: the generation batch is cut into this many micro-batches
    /// and `gradient_accumulation_steps` of them (default 1, TRL's) make one optimizer update,
    /// so each batch feeds `steps_per_generation / gradient_accumulation_steps` updates in
    /// turn. Absent: one update per batch (TRL's default, `gradient_accumulation_steps`).
    pub steps_per_generation: Option<usize>,
}

impl Default for OptimSection {
    fn default() -> Self {
        Self {
            learning_rate: None,
            adam_beta1: 0.9,
            adam_beta2: 0.999,
            adam_epsilon: 1e-8,
            weight_decay: 0.0,
            lr_scheduler_type: ScheduleKind::Linear,
            lr_scheduler_kwargs: ScheduleKwargs::default(),
            warmup_ratio: 0.0,
            warmup_steps: 0,
            max_grad_norm: 1.0,
            gradient_accumulation_steps: None,
            num_iterations: 1,
            steps_per_generation: None,
            optim: OptimName::default(),
        }
    }
}

/// `optim.optim`: the optimizer, by transformers' `OptimizerNames`. Every one is AdamW;
/// they differ in how its moments are kept.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum OptimName {
    /// PyTorch's AdamW, f32 moments (bf16 in pure bf16 training).
    #[default]
    #[serde(rename = "adamw_torch")]
    AdamwTorch,
    /// PyTorch's fused AdamW (transformers 5's default): the same update.
    #[serde(rename = "adamw_torch_fused")]
    AdamwTorchFused,
    /// bitsandbytes' paged 32-bit AdamW: the same update (paging to host memory is not built).
    #[serde(rename = "paged_adamw_32bit")]
    PagedAdamw32bit,
    /// bitsandbytes' 8-bit AdamW ([`crate::optim::AdamW::with_8bit_states`]).
    #[serde(rename = "adamw_8bit")]
    Adamw8bit,
    /// The same (transformers' other name for it).
    #[serde(rename = "adamw_bnb_8bit")]
    AdamwBnb8bit,
    /// bitsandbytes' paged 8-bit AdamW: the 8-bit update (paging is not built).
    #[serde(rename = "paged_adamw_8bit")]
    PagedAdamw8bit,
}

impl OptimName {
    /// Whether the moments are kept in 8 bits.
    pub fn eight_bit(self) -> bool {
        matches!(
            self,
            Self::Adamw8bit | Self::AdamwBnb8bit | Self::PagedAdamw8bit
        )
    }
}

/// `[train]`: how long, how big, how often.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TrainSection {
    /// Optimizer steps; when absent, `num_train_epochs` passes over the data decide.
    pub max_steps: Option<usize>,
    /// Passes over the training prompts (used when `max_steps` is absent).
    pub num_train_epochs: f64,
    /// Prompts per generation batch (each gets `num_generations` completions).
    pub prompts_per_step: usize,
    /// Completions per micro-batch (the memory bound; TRL's name). Default: the whole step.
    pub per_device_train_batch_size: Option<usize>,
    /// TRL AsyncGRPO's `token_budget` (verl's `use_dynamic_bsz` with
    /// `ppo_max_token_len_per_gpu`): micro-batches formed by padded tokens instead of
    /// completions — each holds as many consecutive completions as keep `rows × (longest
    /// prompt + longest completion)` within this many tokens (one longer completion alone).
    /// GRPO, RLOO and MiniLLM; absent = `per_device_train_batch_size`.
    pub token_budget: Option<usize>,
    /// Seed of data order, sampling and adapter init.
    pub seed: u64,
    /// Write metrics every this many steps.
    pub logging_steps: usize,
    /// Checkpoint every this many steps (0 = only at the end).
    pub save_steps: usize,
    /// Keep the last N checkpoints (0 = keep all).
    pub save_total_limit: usize,
    /// Evaluate on the eval split every this many steps (0 = never).
    pub eval_steps: usize,
    /// Write completions.jsonl.
    pub log_completions: bool,
    /// Completions per step written to completions.jsonl.
    pub num_completions_to_print: usize,
    /// Gradient checkpointing (TRL's name): keep only each decoder layer's input and output
    /// in the forward, recompute one layer at a time in backward. Same gradients, less memory,
    /// about one more forward pass of time.
    pub gradient_checkpointing: bool,
    /// Mixed precision (TRL's name): the model computes in bf16 while the optimizer keeps f32
    /// master weights and f32 AdamW moments. `model.dtype = "bf16"` without it trains pure
    /// bf16 weights (half the weight memory, but each update is rounded to bf16).
    pub bf16: bool,
    /// Where metrics go beside `metrics.jsonl` (TRL's name): `["tensorboard"]` writes
    /// TensorBoard event files under `logging_dir`. Default: none.
    pub report_to: Vec<ReportTo>,
    /// TensorBoard's log directory (TRL's name); empty = `OUTPUT_DIR/runs`.
    pub logging_dir: String,
    /// Shuffle the training rows (TRL's name; seeded by `seed`); `false` reads them in file
    /// order, epoch after epoch. Absent: TRL's default of the algorithm — shuffled, but KTO's
    /// rows in file order (its `train_sampling_strategy = "sequential"`: each row's KL
    /// completion is its predecessor's). See [`TrainConfig::shuffles`].
    pub shuffle_dataset: Option<bool>,
    /// Train without dropout (TRL's name): the model has none of its own; this zeroes LoRA's
    /// `lora_dropout` while training (the saved adapter config keeps its value). Absent: TRL's
    /// default of the algorithm, on for DPO, off for GRPO and SFT.
    pub disable_dropout: Option<bool>,
}

impl Default for TrainSection {
    fn default() -> Self {
        Self {
            max_steps: None,
            num_train_epochs: 1.0,
            prompts_per_step: 4,
            per_device_train_batch_size: None,
            token_budget: None,
            seed: 42,
            logging_steps: 1,
            save_steps: 0,
            save_total_limit: 2,
            eval_steps: 0,
            log_completions: true,
            num_completions_to_print: 4,
            gradient_checkpointing: false,
            bf16: false,
            report_to: Vec::new(),
            logging_dir: String::new(),
            shuffle_dataset: None,
            disable_dropout: None,
        }
    }
}

/// `[pipeline]`: bounded channels between the stages.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct PipelineSection {
    /// Prompt batches queued between the loader and the generator.
    pub data_capacity: usize,
    /// Rollout batches queued between the generator and the scorer.
    pub rollout_capacity: usize,
    /// Scored batches queued between the scorer and the learner.
    pub scored_capacity: usize,
    /// Policy versions the generator may run ahead of the learner (0 = on-policy, equal to
    /// the sequential algorithm).
    pub max_staleness: usize,
    /// Steps the scorer may have in flight at once when a reward is an async judge, so judges
    /// keep requests going across steps (each judge's `max_concurrent` still bounds them all).
    /// Useful with `max_staleness >= 1`, when the generator runs ahead.
    pub scoring_batches: usize,
    /// Events (metrics, completions, checkpoints) queued for the events thread before the
    /// learner waits for it.
    pub events_capacity: usize,
}

impl Default for PipelineSection {
    fn default() -> Self {
        Self {
            data_capacity: 2,
            rollout_capacity: 1,
            scored_capacity: 1,
            max_staleness: 0,
            scoring_batches: 2,
            events_capacity: 8,
        }
    }
}

/// Reads a config file (TOML by default; `.yaml`/`.yml` as YAML; `.json` as JSON) into a
/// generic tree.
pub fn read_tree(path: &Path) -> Result<Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("{}: cannot read the config", path.display()))?;
    parse_tree(&text, path)
}

/// Parses TOML text into a generic tree.
pub fn parse_toml_tree(text: &str) -> Result<Value> {
    parse_tree(text, Path::new("config.toml"))
}

fn parse_tree(text: &str, path: &Path) -> Result<Value> {
    let ext = path.extension().and_then(|e| e.to_str()).unwrap_or("");
    let v: Value = match ext {
        "yaml" | "yml" => serde_norway::from_str(text)
            .map_err(|e| anyhow::anyhow!("{}: invalid YAML: {e}", path.display()))?,
        "json" => serde_json::from_str(text)
            .map_err(|e| anyhow::anyhow!("{}: invalid JSON: {e}", path.display()))?,
        _ => {
            let t: toml::Value = toml::from_str(text).map_err(|e| {
                let first = e.to_string().lines().next().unwrap_or("").to_string();
                anyhow::anyhow!("{}: invalid TOML: {first}", path.display())
            })?;
            serde_json::to_value(t)?
        }
    };
    if v.is_null() {
        return Ok(Value::Object(Default::default()));
    }
    if !v.is_object() {
        bail!("{}: the config must be a table of sections", path.display());
    }
    Ok(v)
}

/// Applies `a.b=value` overrides. The value is read as a TOML value (`3`, `1e-5`, `true`,
/// `"text"`, `[1, 2]`), and as a plain string when it does not parse.
pub fn apply_sets(tree: &mut Value, sets: &[String]) -> Result<()> {
    for s in sets {
        let (key, raw) = s.split_once('=').with_context(|| {
            format!("--set {s}: expected KEY=VALUE, e.g. optim.learning_rate=1e-5")
        })?;
        let key = key.trim();
        let value: Value = match toml::from_str::<toml::Table>(&format!("v = {raw}")) {
            Ok(mut t) => {
                serde_json::to_value(t.remove("v").unwrap_or(toml::Value::String(raw.into())))?
            }
            Err(_) => Value::String(raw.to_string()),
        };
        let mut node = &mut *tree;
        let parts: Vec<&str> = key.split('.').collect();
        for (i, part) in parts.iter().enumerate() {
            // `name[3]` addresses an element of a list (e.g. `rewards[1].weight`).
            let (name, index) = match part.split_once('[') {
                Some((n, rest)) => {
                    let idx = rest
                        .strip_suffix(']')
                        .and_then(|x| x.parse::<usize>().ok())
                        .with_context(|| format!("--set {s}: bad index in `{part}`"))?;
                    (n, Some(idx))
                }
                None => (*part, None),
            };
            if name.is_empty() {
                bail!("--set {s}: empty key segment in `{key}`");
            }
            let last = i + 1 == parts.len();
            let section = parts[..i].join(".");
            let obj = node
                .as_object_mut()
                .with_context(|| format!("--set {s}: `{section}` is not a section"))?;
            let next: &mut Value = match index {
                None if last => {
                    obj.insert(name.to_string(), value.clone());
                    break;
                }
                None => obj
                    .entry(name.to_string())
                    .or_insert_with(|| Value::Object(Default::default())),
                Some(idx) => {
                    let list = obj
                        .get_mut(name)
                        .and_then(Value::as_array_mut)
                        .with_context(|| format!("--set {s}: `{name}` is not a list"))?;
                    let len = list.len();
                    let slot = list.get_mut(idx).with_context(|| {
                        format!("--set {s}: `{name}` has {len} entries, no index {idx}")
                    })?;
                    if last {
                        *slot = value.clone();
                        break;
                    }
                    slot
                }
            };
            node = next;
        }
    }
    Ok(())
}

/// Every key path the schema knows (from the serialized defaults), for suggestions.
fn known_keys() -> BTreeSet<String> {
    fn walk(prefix: &str, v: &Value, out: &mut BTreeSet<String>) {
        if let Value::Object(m) = v {
            for (k, child) in m {
                let p = if prefix.is_empty() {
                    k.clone()
                } else {
                    format!("{prefix}.{k}")
                };
                out.insert(p.clone());
                walk(&p, child, out);
            }
        }
    }
    let mut out = BTreeSet::new();
    let mut defaults = serde_json::to_value(TrainConfig::default()).unwrap_or(Value::Null);
    if let Value::Object(m) = &mut defaults {
        // Optional sections serialize as null; list their keys too.
        if let Some(l) = m.get_mut("model").and_then(|s| s.get_mut("lora")) {
            *l = serde_json::to_value(LoraConfig::default()).unwrap_or(Value::Null);
        }
        if let Some(t) = m.get_mut("teacher") {
            *t = serde_json::to_value(TeacherConfig::default()).unwrap_or(Value::Null);
        }
    }
    walk("", &defaults, &mut out);
    out
}

/// The closest known key to `unknown` (same section first), if any is near.
pub fn closest_key(unknown: &str) -> Option<String> {
    let keys = known_keys();
    let section = unknown.rsplit_once('.').map(|(s, _)| s).unwrap_or("");
    let leaf = unknown.rsplit('.').next().unwrap_or(unknown);
    let mut best: Option<(f64, String)> = None;
    for k in &keys {
        let k_section = k.rsplit_once('.').map(|(s, _)| s).unwrap_or("");
        let k_leaf = k.rsplit('.').next().unwrap_or(k);
        let mut score = strsim::jaro_winkler(leaf, k_leaf);
        if k_section == section {
            score += 0.1;
        }
        if best.as_ref().is_none_or(|(s, _)| score > *s) {
            best = Some((score, k.clone()));
        }
    }
    best.filter(|(s, _)| *s > 0.75).map(|(_, k)| k)
}

/// The defaults of the trainer `algorithm` names where TRL's config for it differs from
/// GRPOConfig's, as `(section, key, value)`: one completion per prompt for distillation, GKD,
/// A*-PO and SSD, two at temperature 0.9 for online DPO, GKDConfig's β, temperature and
/// `max_new_tokens`, and PPOConfig's one completion of at most 53 tokens at temperature 0.7.
fn trainer_defaults(algorithm: &str) -> Vec<(&'static str, &'static str, Value)> {
    use serde_json::json;
    match algorithm {
        "distillation" | "a2po" | "ssd" => vec![("rollout", "num_generations", json!(1))],
        "iw_opd" => vec![
            ("rollout", "num_generations", json!(1)),
            ("rollout", "top_p", json!(0.95)),
            ("rollout", "max_completion_length", json!(512)),
        ],
        "gkd" => vec![
            ("rollout", "num_generations", json!(1)),
            ("rollout", "temperature", json!(0.9)),
            ("rollout", "max_completion_length", json!(128)),
            ("distillation", "beta", json!(0.5)),
        ],
        "gold" => vec![
            ("rollout", "num_generations", json!(1)),
            ("rollout", "temperature", json!(0.9)),
            ("rollout", "top_p", json!(0.95)),
            ("rollout", "max_completion_length", json!(128)),
            ("distillation", "beta", json!(0.5)),
        ],
        "ppo" => vec![
            ("rollout", "num_generations", json!(1)),
            ("rollout", "temperature", json!(0.7)),
            ("rollout", "max_completion_length", json!(53)),
        ],
        "online_dpo" | "xpo" | "nash_md" => vec![
            ("rollout", "num_generations", json!(2)),
            ("rollout", "temperature", json!(0.9)),
        ],
        _ => Vec::new(),
    }
}

/// Writes [`trainer_defaults`] of the tree's algorithm into the keys the config leaves out.
fn fill_trainer_defaults(tree: &mut Value) {
    let algorithm = tree
        .get("algorithm")
        .and_then(Value::as_str)
        .unwrap_or_default()
        .to_string();
    let Some(root) = tree.as_object_mut() else {
        return;
    };
    for (section, key, value) in trainer_defaults(&algorithm) {
        let table = root
            .entry(section)
            .or_insert_with(|| Value::Object(Default::default()));
        if let Some(t) = table.as_object_mut() {
            t.entry(key).or_insert(value);
        }
    }
}

/// Deserializes the tree, refusing unknown keys with a suggestion, then validates.
pub fn from_tree(tree: Value, source: &str) -> Result<TrainConfig> {
    if tree.get("model_name_or_path").is_some() && tree.get("model").is_none() {
        bail!(
            "{source}: this is a TRL recipe (`model_name_or_path`, flat keys): translate it with \
             `grpo-cli import-trl {source} --out grpo.toml`, then train that"
        );
    }
    let mut tree = tree;
    fill_trainer_defaults(&mut tree);
    let mut unknown: Vec<String> = Vec::new();
    let mut note = |path: serde_ignored::Path<'_>| unknown.push(path.to_string());
    // serde_path_to_error names the section of a type or missing-field error
    // (`model.lora: missing field `lora_alpha``).
    let cfg: TrainConfig =
        serde_path_to_error::deserialize(serde_ignored::Deserializer::new(tree, &mut note))
            .map_err(|e| {
                let path = e.path().to_string();
                let inner = e.into_inner();
                if path.is_empty() || path == "." {
                    anyhow::anyhow!("{source}: {inner}")
                } else {
                    anyhow::anyhow!("{source}: {path}: {inner}")
                }
            })?;
    if let Some(key) = unknown.first() {
        // serde_ignored reports list indices as `?`-free numbers; rewards entries are checked by
        // their own schema.
        let hint = closest_key(key)
            .map(|k| format!(" (did you mean `{k}`?)"))
            .unwrap_or_default();
        bail!("{source}: unknown key `{key}`{hint}");
    }
    cfg.validate()
        .map_err(|e| anyhow::anyhow!("{source}: {e}"))?;
    // A config file is a whole run; in the library, `fit` may bring the data and the rewards.
    // An environment that owns its data (TRL's `environment_factory` without a dataset) runs
    // on empty prompts for `max_steps`.
    if cfg.data.path.is_empty() {
        match cfg.environment.owns_data() {
            true if cfg.train.max_steps.is_none_or(|s| s == 0) => bail!(
                "{source}: `train.max_steps` is required without `data.path`: the environment \
                 owns the data (its `reset` gives each prompt), so the steps set the run's length"
            ),
            true => {}
            false => bail!(
                "{source}: `data.path` is required (Parquet, Arrow IPC, JSONL or CSV files; only a \
                 single `[environment] type = \"factory\"` class may own the data)"
            ),
        }
    }
    // An environment's turn rewards are a reward of their own (`env`).
    if cfg.algorithm.learns_from_rewards()
        && cfg.rewards.is_empty()
        && cfg.teacher.is_none()
        && cfg.environment.kind.is_none()
    {
        bail!(
            "{source}: `rewards`: at least one reward is required, e.g. [[rewards]] type = \"accuracy\", \
             or an [environment] type whose rewards are the run's"
        );
    }
    Ok(cfg)
}

/// Reads `path`, applies `sets`, validates.
pub fn load(path: &Path, sets: &[String]) -> Result<TrainConfig> {
    let mut tree = read_tree(path)?;
    apply_sets(&mut tree, sets)?;
    from_tree(tree, &path.display().to_string())
}

impl TrainConfig {
    /// ORPO's or CPO's chosen and rejected columns (`[orpo]` or `[cpo]`, by the algorithm).
    pub fn pair_fields(&self) -> (&str, &str) {
        match self.algorithm {
            Algorithm::Cpo => (&self.cpo.chosen_field, &self.cpo.rejected_field),
            Algorithm::Tpo => (&self.tpo.chosen_field, &self.tpo.rejected_field),
            _ => (&self.orpo.chosen_field, &self.orpo.rejected_field),
        }
    }

    /// Whether the training rows are shuffled: `train.shuffle_dataset`, else TRL's default
    /// (KTO and BCO read their rows in order, every other trainer shuffles).
    pub fn shuffles(&self) -> bool {
        self.train
            .shuffle_dataset
            .unwrap_or(!self.algorithm.is_unpaired())
    }

    /// The peak learning rate: `optim.learning_rate`, else TRL's default for the algorithm.
    pub fn learning_rate(&self) -> f64 {
        self.optim
            .learning_rate
            .unwrap_or_else(|| self.algorithm.default_learning_rate())
    }

    /// The rewards as grpo-rewards' config.
    pub fn rewards_config(&self) -> RewardsConfig {
        RewardsConfig {
            rewards: self.rewards.clone(),
            reward_weights: self.reward_weights.clone(),
        }
    }

    /// Checks every value, naming the key to fix.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let r = &self.rollout;
        if self.model.path.as_os_str().is_empty() {
            return Err("`model.path` is required (an HF model directory or a .gguf file)".into());
        }
        if self.train.bf16 && self.model.dtype == Dtype::F16 {
            return Err(
                "`train.bf16 = true` computes in bf16: `model.dtype` must be f32 or bf16, not f16"
                    .into(),
            );
        }
        if let Some(l) = &self.model.lora {
            l.validate().map_err(|e| format!("`model.lora`: {e}"))?;
        }
        if r.num_generations_eval == Some(0) {
            return Err("`rollout.num_generations_eval` must be >= 1".into());
        }
        // Distillation trains on each completion alone (TRL samples one per prompt).
        if r.num_generations < 2
            && !self.algorithm.is_distillation()
            && !matches!(
                self.algorithm,
                Algorithm::A2po
                    | Algorithm::Sdft
                    | Algorithm::Ssd
                    | Algorithm::MiniLlm
                    | Algorithm::Ppo
            )
        {
            return Err(format!(
                "`rollout.num_generations` must be >= 2 (a group needs two completions to compare), got {}",
                r.num_generations
            ));
        }
        if r.max_completion_length == 0 {
            return Err("`rollout.max_completion_length` must be >= 1".into());
        }
        let env = &self.environment;
        if env.max_turns == 0 {
            return Err("`environment.max_turns` must be >= 1".into());
        }
        if env.max_tokens_per_turn == Some(0) || env.max_total_tokens == Some(0) {
            return Err(
                "`environment.max_tokens_per_turn` and `environment.max_total_tokens` must be >= 1"
                    .into(),
            );
        }
        env.validate_kind()?;
        if self.loss.use_leave_one_out_baseline
            && self.loss.multi_objective_aggregation == MultiObjectiveAggregation::NormalizeThenSum
        {
            return Err("`loss.use_leave_one_out_baseline` and `loss.multi_objective_aggregation = \"normalize_then_sum\"` are two different baselines: choose one".into());
        }
        if self.loss.use_leave_one_out_baseline && self.loss.scale_rewards == ScaleRewards::Batch {
            return Err(
                "`loss.use_leave_one_out_baseline = true` scales by the group (`scale_rewards = \"group\"`) or not at all (`\"none\"`), not by the batch"
                    .into(),
            );
        }
        self.check_estimator()?;
        self.check_filter_groups()?;
        if self.loss.policy_loss.loss_mode != PolicyLossMode::Vanilla
            && self.algorithm != Algorithm::Grpo
        {
            return Err(format!(
                "`loss.policy_loss.loss_mode` reworks GRPO's clipped token loss; algorithm `{}` has its own: leave it at vanilla",
                self.algorithm
            ));
        }
        if self.loss.replay_buffer_size > 0 && self.algorithm != Algorithm::Grpo {
            return Err(format!(
                "`loss.replay_buffer_size` replays groups of GRPO's loss (TRL's GRPOWithReplayBufferTrainer); algorithm `{}` has no place for them: leave it at 0",
                serde_json::to_value(self.algorithm)
                    .ok()
                    .and_then(|v| v.as_str().map(str::to_string))
                    .unwrap_or_default()
            ));
        }
        if r.temperature.is_nan() || r.temperature <= 0.0 {
            return Err(format!(
                "`rollout.temperature` must be > 0 for GRPO sampling, got {}",
                r.temperature
            ));
        }
        if let Some(budget) = self.train.token_budget {
            if budget == 0 {
                return Err("`train.token_budget` must be >= 1 (tokens per micro-batch)".into());
            }
            if !matches!(
                self.algorithm,
                Algorithm::Grpo | Algorithm::Rloo | Algorithm::MiniLlm
            ) {
                return Err(format!(
                    "`train.token_budget` forms the micro-batches of GRPO, RLOO and MiniLLM; {} micro-batches by `train.per_device_train_batch_size`",
                    self.algorithm
                ));
            }
        }
        if let Some(p) = &r.structured_outputs_regex {
            grpo_rollout::constrain::check_pattern(p)
                .map_err(|e| format!("`rollout.structured_outputs_regex`: {e}"))?;
        }
        self.rollout
            .sampling(0)
            .validate()
            .map_err(|e| format!("`rollout`: {e}"))?;
        match r.backend {
            Backend::Local => {}
            Backend::Openai => {
                if let Some(d) = r.device {
                    return Err(format!(
                        "`rollout.device = \"{d}\"`: the openai backend samples on its server; rollout.device is for the local backend"
                    ));
                }
                if self.model.lora.is_none() && self.algorithm.generates() {
                    return Err("`rollout.backend = \"openai\"` syncs the policy to the server as a LoRA adapter: set `[model.lora]` (full-weight sync is not built; see README, Scaling out)".into());
                }
                let o = &r.openai;
                if !(o.base_url.starts_with("http://") || o.base_url.starts_with("https://")) {
                    return Err(format!(
                        "`rollout.openai.base_url`: expected http://HOST:PORT/v1, got `{}`",
                        o.base_url
                    ));
                }
                if !(o.request_timeout > 0.0 && o.sync_timeout > 0.0) {
                    return Err(
                        "`rollout.openai.request_timeout` and `sync_timeout` must be > 0 (seconds)"
                            .into(),
                    );
                }
            }
        }
        if let Some(t) = &self.teacher {
            t.validate().map_err(|e| e.to_string())?;
        }
        if self.algorithm == Algorithm::Dpo {
            let d = &self.dpo;
            if !(d.beta > 0.0 && d.beta.is_finite()) {
                return Err(format!("`dpo.beta` must be > 0, got {}", d.beta));
            }
            d.dpo_config()
                .validate()
                .map_err(|e| format!("`dpo`: {e}"))?;
            if let Some(a) = d.ld_alpha
                && !(0.0..=1.0).contains(&a)
            {
                return Err(format!("`dpo.ld_alpha` must be in [0, 1], got {a}"));
            }
        }
        if self.algorithm == Algorithm::Orpo {
            let b = self.orpo.beta;
            if !(b > 0.0 && b.is_finite()) {
                return Err(format!("`orpo.beta` must be > 0, got {b}"));
            }
        }
        if self.algorithm == Algorithm::Cpo {
            let c = &self.cpo;
            if c.loss_type == CpoLoss::Alphapo && c.cpo_alpha.is_some_and(|a| a != 0.0) {
                return Err(
                    "`cpo.loss_type = \"alphapo\"` is simpo with `cpo_alpha = 0`: for a \
                            behaviour-cloning term use loss_type = \"simpo\" with `alpha`"
                        .into(),
                );
            }
            c.cpo_config()
                .validate()
                .map_err(|e| format!("`cpo`: {e}"))?;
        }
        if self.algorithm == Algorithm::Tpo {
            let t = &self.tpo;
            t.cpo_config()
                .validate()
                .map_err(|e| format!("`tpo`: {}", e.replace("cpo_alpha", "tpo_alpha")))?;
            if t.reference_field == t.chosen_field || t.reference_field == t.rejected_field {
                return Err(
                    "`tpo.reference_field` must differ from the chosen and rejected columns".into(),
                );
            }
        }
        if self.algorithm.is_online_dpo() {
            self.check_online_dpo()?;
        }
        if self.algorithm == Algorithm::Sdpo {
            self.check_sdpo()?;
        }
        if self.algorithm == Algorithm::Sdft {
            self.check_sdft()?;
        }
        if self.algorithm == Algorithm::Ssd {
            self.check_ssd()?;
        }
        if self.algorithm == Algorithm::MiniLlm {
            self.check_minillm()?;
        }
        if self.algorithm == Algorithm::Prm {
            self.check_prm()?;
        }
        if self.algorithm == Algorithm::Ppo {
            self.check_ppo()?;
        }
        if self.algorithm == Algorithm::Bco {
            self.bco.validate()?;
        }
        if let Some(m) = &self.merge {
            if !matches!(m.dtype.as_str(), "float16" | "bfloat16" | "float32") {
                return Err(format!(
                    "`merge.dtype` must be float16, bfloat16 or float32, got `{}`",
                    m.dtype
                ));
            }
            let target = m.target_model_path.as_ref().unwrap_or(&self.model.path);
            if !target.join("config.json").exists() {
                return Err(format!(
                    "`[merge]` merges with a Hugging Face directory: {} has no config.json \
                     (set `merge.target_model_path`)",
                    target.display()
                ));
            }
            let slerp = m.method == MergeMethod::Slerp;
            let weights = m.policy_model_weight.is_some()
                || m.target_model_weight.is_some()
                || m.policy_model_density.is_some()
                || m.target_model_density.is_some()
                || m.normalize.is_some();
            if (slerp && weights) || (!slerp && m.t_values.is_some()) {
                return Err(
                    "`merge.t_values` is slerp's only setting; the weights, densities and \
                     `normalize` are the other methods'"
                        .into(),
                );
            }
            if let Some(t) = m.t_values
                && !(0.0..=1.0).contains(&t)
            {
                return Err(format!("`merge.t_values` must be in [0, 1], got {t}"));
            }
        }
        if let Some(b) = &self.bema {
            if b.update_freq == 0 || b.ref_model_update_freq == 0 {
                return Err(
                    "`bema.update_freq` and `bema.ref_model_update_freq` must be >= 1".into(),
                );
            }
            for (key, v) in [
                ("ema_power", b.ema_power),
                ("bias_power", b.bias_power),
                ("min_ema_multiplier", b.min_ema_multiplier),
            ] {
                if !(v >= 0.0 && v.is_finite()) {
                    return Err(format!("`bema.{key}` must be >= 0, got {v}"));
                }
            }
            if !(b.lag + b.multiplier > 0.0 && b.multiplier >= 0.0 && b.lag.is_finite()) {
                return Err(format!(
                    "`bema.lag` + `bema.multiplier` · t must stay > 0 (lag {}, multiplier {})",
                    b.lag, b.multiplier
                ));
            }
            if b.update_ref_model && self.model.lora.is_some() {
                return Err(
                    "`bema.update_ref_model` with LoRA: the reference is the base \
                            model with the adapters off, which the BEMA of the adapters cannot \
                            replace; leave it out"
                        .into(),
                );
            }
        }
        if self.algorithm == Algorithm::A2po {
            let a = &self.a2po;
            if a.num_value_samples == 0 {
                return Err("`a2po.num_value_samples` must be >= 1".into());
            }
            for (key, v) in [("beta1", a.beta1), ("beta2", a.beta2)] {
                if !(v > 0.0 && v.is_finite()) {
                    return Err(format!("`a2po.{key}` must be > 0, got {v}"));
                }
            }
            if self.reference.beta != 0.0 {
                return Err("A*-PO's KL temperatures are `a2po.beta1` / `beta2`; leave \
                            `reference.beta` at 0"
                    .into());
            }
            if self.teacher.is_some() || self.environment.kind.is_some() {
                return Err("A*-PO trains on single-turn completions: `[teacher]` and \
                            `[environment]` are not supported with it"
                    .into());
            }
            if self.loss.drop_zero_std_groups {
                return Err(
                    "`loss.drop_zero_std_groups` drops groups by their rewards; A*-PO \
                            regresses every completion (one per prompt by default)"
                        .into(),
                );
            }
        }
        if self.algorithm.reference_free_pairs() {
            let (chosen, rejected) = self.pair_fields();
            if chosen == rejected {
                return Err(format!(
                    "`{a}.chosen_field` and `{a}.rejected_field` must differ",
                    a = self.algorithm
                ));
            }
            if self.reference.beta != 0.0 || self.reference.sync_ref_model {
                return Err(format!(
                    "{} has no reference model: leave `reference.beta` at 0 and \
                     `reference.sync_ref_model` off",
                    self.algorithm
                ));
            }
        }
        if matches!(self.algorithm, Algorithm::Grpo | Algorithm::MiniLlm)
            && self.loss.loss_type == LossType::Gmpo
            && self.loss.vllm_importance_sampling_correction
            && !matches!(
                self.loss.vllm_importance_sampling_mode,
                ImportanceSamplingMode::SequenceMask | ImportanceSamplingMode::SequenceTruncate
            )
        {
            return Err(
                "`loss.loss_type = \"gmpo\"` weighs whole sequences: its off-policy \
                        correction needs `loss.vllm_importance_sampling_mode` = \"sequence_mask\" \
                        or \"sequence_truncate\" (or `vllm_importance_sampling_correction = false`)"
                    .into(),
            );
        }
        if self.algorithm == Algorithm::Rloo {
            let r = &self.rloo;
            if !(r.beta >= 0.0 && r.beta.is_finite()) {
                return Err(format!("`rloo.beta` must be >= 0, got {}", r.beta));
            }
            if let Some([lo, hi]) = r.reward_clip_range
                && (lo > hi || lo.is_nan() || hi.is_nan())
            {
                return Err(format!(
                    "`rloo.reward_clip_range` must be [low, high] with low <= high, got [{lo}, {hi}]"
                ));
            }
            if self.rollout.num_generations < 2 {
                return Err("`rollout.num_generations` must be >= 2 for RLOO: each completion's baseline is the mean of the others".into());
            }
            if self.reference.beta != 0.0 {
                return Err(
                    "RLOO's KL penalty is `rloo.beta` (in the reward); leave `reference.beta` at 0"
                        .into(),
                );
            }
            if self.loss.vllm_importance_sampling_correction
                && !matches!(
                    self.loss.vllm_importance_sampling_mode,
                    ImportanceSamplingMode::SequenceMask | ImportanceSamplingMode::SequenceTruncate
                )
            {
                return Err("RLOO's loss is per sequence: its off-policy correction needs \
                            `loss.vllm_importance_sampling_mode` = \"sequence_mask\" or \
                            \"sequence_truncate\" (or `vllm_importance_sampling_correction = false`)"
                    .into());
            }
        }
        let precomputed = match self.algorithm {
            Algorithm::Dpo => Some(("dpo", self.dpo.precompute_ref_log_probs)),
            Algorithm::Kto | Algorithm::Bco => Some(("kto", self.kto.precompute_ref_log_probs)),
            _ => None,
        };
        if let Some((section, true)) = precomputed
            && self.reference.sync_ref_model
        {
            return Err(format!(
                "`reference.sync_ref_model` moves the reference, so \
                 `{section}.precompute_ref_log_probs` would go stale: set one of them to false"
            ));
        }
        if let Some((section, true)) = precomputed
            && self.bema.as_ref().is_some_and(|b| b.update_ref_model)
        {
            return Err(format!(
                "`bema.update_ref_model` moves the reference, so \
                 `{section}.precompute_ref_log_probs` would go stale: set one of them to false"
            ));
        }
        if self.algorithm == Algorithm::Bco {
            let k = &self.kto;
            if k.loss_type != KtoLossType::Kto
                || k.desirable_weight != 1.0
                || k.undesirable_weight != 1.0
            {
                return Err(
                    "BCO's loss is its own: `kto.loss_type`, `kto.desirable_weight` and \
                            `kto.undesirable_weight` do not apply to it"
                        .into(),
                );
            }
        }
        if self.algorithm.is_unpaired() {
            let k = &self.kto;
            if !(k.beta > 0.0 && k.beta.is_finite()) {
                return Err(format!("`kto.beta` must be > 0, got {}", k.beta));
            }
            for (key, w) in [
                ("desirable_weight", k.desirable_weight),
                ("undesirable_weight", k.undesirable_weight),
            ] {
                if !(w >= 0.0 && w.is_finite()) {
                    return Err(format!("`kto.{key}` must be >= 0, got {w}"));
                }
            }
            if self.algorithm == Algorithm::Kto && k.loss_type.uses_kl() && self.micro_batch() < 2 {
                return Err("`kto.loss_type = \"kto\"` estimates the KL term from the other rows of \
                            a micro-batch: `train.per_device_train_batch_size` must be > 1 (as in TRL)"
                    .into());
            }
        }
        if (self.algorithm == Algorithm::Sft && self.sft.max_length < 2)
            || (self.algorithm == Algorithm::Dpo && self.dpo.max_length < 2)
            || (self.algorithm.is_unpaired() && self.kto.max_length < 2)
            || (self.algorithm == Algorithm::Orpo && self.orpo.max_length < 2)
            || (self.algorithm == Algorithm::Cpo && self.cpo.max_length < 2)
            || (self.algorithm == Algorithm::Tpo && self.tpo.max_length < 2)
            || (self.algorithm == Algorithm::Reward && self.reward.max_length < 1)
        {
            if self.algorithm == Algorithm::Reward {
                return Err("`reward.max_length` must be >= 1".into());
            }
            if self.algorithm == Algorithm::Bco {
                return Err("`kto.max_length` (BCO's) must be >= 2".into());
            }
            return Err(format!("`{}.max_length` must be >= 2", self.algorithm));
        }
        let loss = self.loss_config();
        loss.validate().map_err(|e| format!("`loss`: {e}"))?;
        let l = &self.loss;
        if let Some(c) = l.router_aux_loss_coef
            && !c.is_finite()
        {
            return Err(format!(
                "`loss.router_aux_loss_coef` must be a finite number, not {c}"
            ));
        }
        if l.use_adaptive_entropy {
            let ok = |v: f64| v.is_finite() && v >= 0.0;
            let valid = ok(l.entropy_coef_min)
                && ok(l.entropy_coef_delta)
                && ok(l.entropy_target)
                && l.entropy_coef_max.is_finite()
                && l.entropy_coef_max >= l.entropy_coef_min;
            if !valid {
                return Err("`loss.use_adaptive_entropy` needs finite `entropy_coef_min` <= `entropy_coef_max` and `entropy_coef_delta`, `entropy_target` >= 0".into());
            }
        }
        if self.algorithm.is_distillation() {
            let d = &self.distillation;
            if let Some(l) = d.lmbda
                && !(0.0..=1.0).contains(&l)
            {
                return Err(format!("`distillation.lmbda` must be in [0, 1], got {l}"));
            }
            match (&d.teacher_model_name_or_path, &d.teacher_server) {
                (None, None) => {
                    return Err(
                        "`distillation.teacher_model_name_or_path` is required (the teacher model)"
                            .into(),
                    );
                }
                (Some(_), Some(_)) => {
                    return Err("`distillation.teacher_model_name_or_path` and \
                                `[distillation.teacher_server]` both name the teacher: keep one"
                        .into());
                }
                (None, Some(_)) => {
                    let k = d.loss_top_k_for(self.algorithm);
                    if d.objective_for(self.algorithm) == DistillObjective::Jsd {
                        if k == 0 {
                            return Err("`[distillation.teacher_server]` gives the teacher's top \
                                        tokens only: `distillation.loss_top_k` must be at least \
                                        1 (0 is the whole vocabulary)"
                                .into());
                        }
                        if d.beta > 0.0 && k != 1 {
                            return Err(format!(
                                "`[distillation.teacher_server]` with `distillation.beta` > 0 \
                                 takes the top-1 support: `distillation.loss_top_k` must be 1, \
                                 got {k} (a larger support needs beta = 0)"
                            ));
                        }
                    }
                    if d.reverse_kl_top_1_mode == ReverseKlTop1Mode::Argmax {
                        return Err("`distillation.reverse_kl_top_1_mode = \"argmax\"` needs a \
                                    local teacher (the server scores the sampled tokens only)"
                            .into());
                    }
                    if self.rollout.temperature != 1.0 {
                        return Err(format!(
                            "`[distillation.teacher_server]` scores at temperature 1 (the \
                             server's prompt log-probs): `rollout.temperature` must be 1, got {}",
                            self.rollout.temperature
                        ));
                    }
                    if d.seq_kd {
                        return Err("`distillation.seq_kd` samples with a local teacher; with \
                                    `[distillation.teacher_server]` leave it out"
                            .into());
                    }
                }
                (Some(_), None) => {}
            }
            if !(0.0..=1.0).contains(&d.beta) {
                return Err(format!(
                    "`distillation.beta` must be in [0, 1], got {}",
                    d.beta
                ));
            }
            if self.reference.beta != 0.0 || self.reference.sync_ref_model {
                return Err(
                    "distillation has no reference model: leave `reference.beta` at 0 (its \
                            divergence is `distillation.beta`)"
                        .into(),
                );
            }
            if self.teacher.is_some() {
                return Err(
                    "`[teacher]` (two-pass teaching) and distillation cannot be combined".into(),
                );
            }
            if self.loss.drop_zero_std_groups {
                return Err("`loss.drop_zero_std_groups` drops groups by their rewards; distillation trains on every completion".into());
            }
            if d.objective_for(self.algorithm) == DistillObjective::IwOpd
                && d.reverse_kl_top_1_mode == ReverseKlTop1Mode::Argmax
            {
                return Err(
                    "`distillation.reverse_kl_top_1_mode = \"argmax\"` does not apply to \
                            the `iw_opd` objective (it trains on the sampled tokens)"
                        .into(),
                );
            }
            if !(d.iw_opd_gamma >= 0.0 && d.iw_opd_gamma.is_finite()) {
                return Err(format!(
                    "`distillation.iw_opd_gamma` must be >= 0, got {}",
                    d.iw_opd_gamma
                ));
            }
            if !(d.iw_opd_epsilon > 0.0 && d.iw_opd_epsilon.is_finite()) {
                return Err(format!(
                    "`distillation.iw_opd_epsilon` must be > 0, got {}",
                    d.iw_opd_epsilon
                ));
            }
            self.check_gold()?;
        }
        if self.algorithm == Algorithm::Reward {
            if let Some(c) = self.reward.center_rewards_coefficient
                && !(c >= 0.0 && c.is_finite())
            {
                return Err(format!(
                    "`reward.center_rewards_coefficient` must be >= 0, got {c}"
                ));
            }
            if self.model.cast_lm_head_to_fp32 {
                return Err("`model.cast_lm_head_to_fp32` casts an LM head; a reward model has none (its `score` head is trained in the model's dtype)".into());
            }
            if self.reward.chosen_field == self.reward.rejected_field {
                return Err("`reward.chosen_field` and `reward.rejected_field` must differ".into());
            }
        }
        if self.reference.sync_ref_model {
            if self.algorithm == Algorithm::Reward {
                return Err("`reference.sync_ref_model` does not apply to a reward model (no reference model)".into());
            }
            if self.algorithm == Algorithm::Sft {
                return Err("`reference.sync_ref_model` applies to GRPO and DPO; SFT has no reference model".into());
            }
            // GRPO keeps a reference only when beta > 0; DPO always has one (`dpo.beta`).
            if self.reference.beta == 0.0 && self.algorithm == Algorithm::Grpo {
                return Err("`reference.sync_ref_model` needs `reference.beta` > 0 (no reference model is kept when beta = 0)".into());
            }
            if !(0.0..=1.0).contains(&self.reference.ref_model_mixup_alpha) {
                return Err("`reference.ref_model_mixup_alpha` must be in [0, 1]".into());
            }
            if self.reference.ref_model_sync_steps == 0 {
                return Err("`reference.ref_model_sync_steps` must be >= 1".into());
            }
        }
        let o = &self.optim;
        let lr = self.learning_rate();
        if !lr.is_finite() || lr < 0.0 {
            return Err(format!("`optim.learning_rate` must be >= 0, got {lr}"));
        }
        for (k, v) in [("adam_beta1", o.adam_beta1), ("adam_beta2", o.adam_beta2)] {
            if !(0.0..1.0).contains(&v) {
                return Err(format!("`optim.{k}` must be in [0, 1), got {v}"));
            }
        }
        if o.adam_epsilon.is_nan() || o.adam_epsilon <= 0.0 {
            return Err("`optim.adam_epsilon` must be > 0".into());
        }
        crate::optim::Schedule {
            kind: o.lr_scheduler_type,
            lr,
            warmup: usize::from(o.warmup_steps > 0 || o.warmup_ratio > 0.0),
            total: 0,
            kwargs: o.lr_scheduler_kwargs.clone(),
        }
        .validate()?;
        if !(0.0..1.0).contains(&o.warmup_ratio) {
            return Err("`optim.warmup_ratio` must be in [0, 1)".into());
        }
        if o.max_grad_norm < 0.0 {
            return Err("`optim.max_grad_norm` must be >= 0 (0 = off)".into());
        }
        if o.num_iterations == 0 {
            return Err("`optim.num_iterations` must be >= 1".into());
        }
        let t = &self.train;
        if t.prompts_per_step == 0 {
            return Err("`train.prompts_per_step` must be >= 1".into());
        }
        if t.max_steps == Some(0) {
            return Err("`train.max_steps` must be >= 1".into());
        }
        if t.max_steps.is_none() && (t.num_train_epochs.is_nan() || t.num_train_epochs <= 0.0) {
            return Err("`train.num_train_epochs` must be > 0 (or set `train.max_steps`)".into());
        }
        if t.logging_steps == 0 {
            return Err("`train.logging_steps` must be >= 1".into());
        }
        let n = self.completions_per_step();
        if let Some(spg) = o.steps_per_generation {
            let ga = o.gradient_accumulation_steps.unwrap_or(1);
            if spg == 0 || ga == 0 {
                return Err("`optim.steps_per_generation` and `optim.gradient_accumulation_steps` must be >= 1".into());
            }
            if !self.algorithm.generates() {
                return Err(
                    "`optim.steps_per_generation` is for runs that generate (GRPO, RLOO, distillation); SFT, DPO, KTO and reward models take one update per step"
                        .into(),
                );
            }
            if !n.is_multiple_of(spg) || !spg.is_multiple_of(ga) {
                return Err(format!(
                    "`optim.steps_per_generation` ({spg}) must divide prompts_per_step × num_generations ({n}) and be a multiple of `optim.gradient_accumulation_steps` ({ga})"
                ));
            }
            if let Some(b) = t.per_device_train_batch_size
                && b * spg != n
            {
                return Err(format!(
                    "`train.per_device_train_batch_size` ({b}) × `optim.steps_per_generation` ({spg}) must equal prompts_per_step × num_generations ({n})"
                ));
            }
        }
        match (t.per_device_train_batch_size, o.gradient_accumulation_steps) {
            _ if o.steps_per_generation.is_some() => {}
            (Some(0), _) => return Err("`train.per_device_train_batch_size` must be >= 1".into()),
            (_, Some(0)) => return Err("`optim.gradient_accumulation_steps` must be >= 1".into()),
            (Some(b), Some(ga)) if b * ga != n => {
                return Err(format!(
                    "`train.per_device_train_batch_size` ({b}) × `optim.gradient_accumulation_steps` ({ga}) must equal prompts_per_step × num_generations ({n})"
                ));
            }
            (None, Some(ga)) if !n.is_multiple_of(ga) => {
                return Err(format!(
                    "`optim.gradient_accumulation_steps` ({ga}) must divide prompts_per_step × num_generations ({n})"
                ));
            }
            _ => {}
        }
        let micro = self.micro_batch();
        if micro > n {
            return Err(format!(
                "`train.per_device_train_batch_size` ({micro}) is larger than a step's {n} completions"
            ));
        }
        let p = &self.pipeline;
        if p.data_capacity == 0 || p.rollout_capacity == 0 || p.scored_capacity == 0 {
            return Err("`pipeline.*_capacity` must be >= 1 (channels are bounded)".into());
        }
        if p.events_capacity == 0 {
            return Err("`pipeline.events_capacity` must be >= 1".into());
        }
        if p.scoring_batches == 0 {
            return Err("`pipeline.scoring_batches` must be >= 1".into());
        }
        let l = &self.loss;
        let max = l.vllm_importance_sampling_clip_max;
        if max.is_nan()
            || max <= 0.0
            || l.vllm_importance_sampling_clip_min
                .is_some_and(|m| m.is_nan() || m >= max)
        {
            return Err("`loss.vllm_importance_sampling_clip_max` must be > 0 and above `loss.vllm_importance_sampling_clip_min`".into());
        }
        Ok(())
    }

    /// grpo-core's loss options (β from `[reference]`).
    pub fn loss_config(&self) -> LossConfig {
        let l = &self.loss;
        LossConfig {
            loss_type: l.loss_type,
            epsilon_low: l.epsilon.unwrap_or(l.loss_type.default_epsilon()),
            epsilon_high: l
                .epsilon_high
                .or(l.epsilon)
                .unwrap_or(l.loss_type.default_epsilon()),
            delta: l.delta,
            beta: self.reference.beta,
            kl_importance_correction: l.use_bias_correction_kl,
            kl_loss_type: l.kl_loss_type,
            importance_sampling_level: l.importance_sampling_level,
            max_completion_length: self.rollout.max_completion_length,
            sapo_temperature_pos: l.sapo_temperature_pos,
            sapo_temperature_neg: l.sapo_temperature_neg,
            vespo_k_pos: l.vespo_k_pos,
            vespo_lambda_pos: l.vespo_lambda_pos,
            vespo_k_neg: l.vespo_k_neg,
            vespo_lambda_neg: l.vespo_lambda_neg,
            off_policy_mask_threshold: l.off_policy_mask_threshold,
            top_entropy_quantile: l.top_entropy_quantile,
            entropy_coef: l.entropy_coef,
            cov: l.policy_loss.cov(),
        }
    }

    /// The self-distillation settings of an SDPO or SDFT run (`None` for the others).
    pub fn self_distill(&self) -> Option<SelfDistill> {
        match self.algorithm {
            Algorithm::Sdpo => {
                let d = &self.sdpo;
                Some(SelfDistill {
                    mode: d.distillation_mode,
                    alpha: d.distillation_alpha,
                    topk: d.distillation_topk,
                    is_clip: d.distillation_is_clip,
                    add_tail: d.distillation_add_tail,
                    teacher: d.teacher_model_kind,
                    update_rate: d.teacher_update_rate,
                    sync_steps: d.teacher_sync_steps,
                    weight: d.distillation_weight,
                    skip: 0,
                    teacher_server: d.use_teacher_server,
                })
            }
            Algorithm::Sdft => {
                let d = &self.sdft;
                Some(SelfDistill {
                    mode: d.distillation_mode,
                    alpha: d.distillation_alpha,
                    topk: d.distillation_topk,
                    is_clip: d.distillation_is_clip,
                    add_tail: d.distillation_add_tail,
                    teacher: d.teacher_model_kind,
                    update_rate: d.teacher_update_rate,
                    sync_steps: d.teacher_sync_steps,
                    weight: 1.0,
                    skip: d.num_loss_tokens_to_skip,
                    teacher_server: d.use_teacher_server,
                })
            }
            _ => None,
        }
    }

    /// The divergence and teacher settings SDPO and SDFT share, under `section`'s name.
    fn check_self_distill(&self, section: &str) -> std::result::Result<(), String> {
        let Some(d) = self.self_distill() else {
            return Ok(());
        };
        if !(0.0..=1.0).contains(&d.alpha) {
            return Err(format!(
                "`{section}.distillation_alpha` must be in [0, 1], got {}",
                d.alpha
            ));
        }
        match (d.mode, d.topk) {
            (SdpoMode::SampledToken, _) if d.alpha != 1.0 => {
                return Err(format!(
                    "`{section}.distillation_mode = \"sampled_token\"` is the reverse KL only: \
                     `{section}.distillation_alpha` must be 1, got {}",
                    d.alpha
                ));
            }
            (SdpoMode::TopkLogits, None | Some(0)) => {
                return Err(format!(
                    "`{section}.distillation_mode = \"topk_logits\"` needs \
                     `{section}.distillation_topk` >= 1"
                ));
            }
            _ => {}
        }
        if !(d.is_clip >= 0.0 && d.is_clip.is_finite()) {
            return Err(format!(
                "`{section}.distillation_is_clip` must be >= 0 (0: off), got {}",
                d.is_clip
            ));
        }
        if !(d.update_rate > 0.0 && d.update_rate <= 1.0) {
            return Err(format!(
                "`{section}.teacher_update_rate` must be in (0, 1], got {}",
                d.update_rate
            ));
        }
        if d.sync_steps == 0 {
            return Err(format!("`{section}.teacher_sync_steps` must be >= 1"));
        }
        let name = section.to_uppercase();
        if d.teacher_server {
            let why = if self.rollout.backend != Backend::Openai {
                Some("`rollout.backend = \"openai\"` (the server that samples)".to_string())
            } else if d.teacher != SdpoTeacher::Live {
                Some(format!(
                    "`{section}.teacher_model_kind = \"live\"` (the server holds the live policy)"
                ))
            } else if d.mode != SdpoMode::SampledToken {
                Some(format!(
                    "`{section}.distillation_mode = \"sampled_token\"` (the server gives the sampled tokens' log-probs)"
                ))
            } else if d.weight != 1.0 {
                Some(format!("`{section}.distillation_weight = 1`"))
            } else if self.rollout.temperature != 1.0 {
                Some("`rollout.temperature = 1` (the server scores at temperature 1)".to_string())
            } else if self.pipeline.max_staleness != 0
                || self.optim.num_iterations != 1
                || self.updates_per_step() != 1
            {
                Some("one update per generation at `pipeline.max_staleness = 0` (the server's adapter is then the live policy)".to_string())
            } else {
                None
            };
            if let Some(why) = why {
                return Err(format!("`{section}.use_teacher_server` needs {why}"));
            }
        }
        if self.loss.router_aux_loss_coef.is_some_and(|c| c != 0.0) {
            return Err(format!(
                "`loss.router_aux_loss_coef`: {name}'s loss has no load-balancing term (as TRL's); \
                 leave it out"
            ));
        }
        if self.reference.beta != 0.0 {
            return Err(format!(
                "{name}'s loss has no KL term (TRL's {name} reads no `beta`): leave \
                 `reference.beta` at 0"
            ));
        }
        if self.teacher.is_some() || self.environment.kind.is_some() {
            return Err(format!(
                "{name} trains on single-turn completions: `[teacher]` and `[environment]` are \
                 not supported with it"
            ));
        }
        if self.loss.drop_zero_std_groups {
            return Err(format!(
                "`loss.drop_zero_std_groups` drops groups by their rewards; {name} distils \
                 every completion"
            ));
        }
        Ok(())
    }

    /// What SSD cannot have: it learns its samples by cross-entropy alone.
    fn check_ssd(&self) -> std::result::Result<(), String> {
        if self.reference.beta != 0.0 {
            return Err(
                "SSD's loss is plain cross-entropy, no KL term: leave `reference.beta` at 0".into(),
            );
        }
        if self.teacher.is_some() || self.environment.kind.is_some() {
            return Err(
                "SSD trains on single-turn samples: `[teacher]` and `[environment]` are not \
                 supported with it"
                    .into(),
            );
        }
        if self.loss.drop_zero_std_groups {
            return Err(
                "`loss.drop_zero_std_groups` drops groups by their rewards; SSD learns every \
                 sample (rewards are only logged)"
                    .into(),
            );
        }
        Ok(())
    }

    /// PRM's settings: a classifier has no reference model and no LM head; the two columns.
    fn check_prm(&self) -> std::result::Result<(), String> {
        if self.reference.beta != 0.0 || self.reference.sync_ref_model {
            return Err(
                "a process reward model has no reference model: leave `reference.beta` \
                        at 0 and `reference.sync_ref_model` off"
                    .into(),
            );
        }
        if self.model.cast_lm_head_to_fp32 {
            return Err(
                "`model.cast_lm_head_to_fp32` casts an LM head; a process reward model \
                        has none (its `score` head is trained in the model's dtype)"
                    .into(),
            );
        }
        let p = &self.prm;
        if p.completions_field == p.labels_field {
            return Err("`prm.completions_field` and `prm.labels_field` must differ".into());
        }
        if p.max_completion_length == Some(0) {
            return Err("`prm.max_completion_length` must be >= 1 (absent: no cut)".into());
        }
        Ok(())
    }

    /// MiniLLM's settings: its teacher (a local model: both terms read its whole
    /// distribution), `[minillm]`'s values, the loss types that take per-token advantages.
    fn check_minillm(&self) -> std::result::Result<(), String> {
        let d = &self.distillation;
        if d.teacher_server.is_some() {
            return Err(
                "MiniLLM reads the teacher's whole next-token distribution: \
                        `[distillation.teacher_server]` gives its top tokens only; name a local \
                        `distillation.teacher_model_name_or_path`"
                    .into(),
            );
        }
        if d.teacher_model_name_or_path.is_none() {
            return Err(
                "MiniLLM needs its teacher: `distillation.teacher_model_name_or_path`".into(),
            );
        }
        let m = &self.minillm;
        if !(m.kd_temperature.is_finite() && m.kd_temperature > 0.0) {
            return Err(format!(
                "`minillm.kd_temperature` must be > 0, got {}",
                m.kd_temperature
            ));
        }
        if !(m.gamma.is_finite() && m.gamma >= 0.0) {
            return Err(format!("`minillm.gamma` must be >= 0, got {}", m.gamma));
        }
        if m.rkl_advantage && matches!(self.loss.loss_type, LossType::Gmpo | LossType::Vespo) {
            return Err(format!(
                "`loss.loss_type = \"{}\"` weighs whole sequences; MiniLLM's reverse-KL \
                 advantages are per token (set `minillm.rkl_advantage = false`, or another loss \
                 type)",
                self.loss.loss_type.as_str()
            ));
        }
        Ok(())
    }

    /// PPO's settings: `[ppo]`'s values, its batch split into mini-batches, and what its
    /// step does not take (GRPO's KL weight, passes and replay; episodes).
    /// verl's estimators and in-reward KL (`loss.adv_estimator`, `loss.use_kl_in_reward`).
    fn check_estimator(&self) -> std::result::Result<(), String> {
        let l = &self.loss;
        let est = l.adv_estimator;
        let name = est.as_str();
        if est == AdvEstimator::Grpo && !l.use_kl_in_reward {
            return Ok(());
        }
        let what = match est {
            AdvEstimator::Grpo => "`loss.use_kl_in_reward`".to_string(),
            _ => format!("`loss.adv_estimator = \"{name}\"`"),
        };
        if self.algorithm != Algorithm::Grpo {
            return Err(format!(
                "{what} forms GRPO's advantages (verl's estimators): it needs algorithm = \"grpo\"; algorithm `{}` has its own",
                self.algorithm.as_str()
            ));
        }
        if est != AdvEstimator::Grpo {
            if l.use_leave_one_out_baseline {
                return Err(format!(
                    "{what} and `loss.use_leave_one_out_baseline` are two different baselines: choose one (verl's leave-one-out is adv_estimator = \"rloo\")"
                ));
            }
            if l.multi_objective_aggregation == MultiObjectiveAggregation::NormalizeThenSum {
                return Err(format!(
                    "{what} reads the combined reward; `loss.multi_objective_aggregation = \"normalize_then_sum\"` is another advantage: choose one"
                ));
            }
        }
        if l.replay_buffer_size > 0 {
            return Err(format!(
                "{what} and `loss.replay_buffer_size` do not combine: the replay buffer reuses TRL's group advantages"
            ));
        }
        if est == AdvEstimator::GrpoPassk && l.scale_rewards == ScaleRewards::Batch {
            return Err("`loss.adv_estimator = \"grpo_passk\"` divides by its group's std (`scale_rewards = \"group\"`) or by nothing (`\"none\"`), not by the batch's".into());
        }
        if est == AdvEstimator::Remax {
            // The greedy baseline is a second, single-turn generation by the local policy.
            if self.environment.kind.is_some() {
                return Err("`loss.adv_estimator = \"remax\"`: its greedy baseline is one single-turn completion per prompt; multi-turn episodes ([environment]) are not built for it".into());
            }
            if self.teacher.is_some() {
                return Err("`loss.adv_estimator = \"remax\"` and [teacher] do not combine: the teaching passes would need greedy baselines of their own".into());
            }
            if self.rollout.backend != Backend::Local {
                return Err("`loss.adv_estimator = \"remax\"` samples its greedy baselines with the local generator: use rollout.backend = \"local\"".into());
            }
        }
        if !(l.gamma.is_finite() && (0.0..=1.0).contains(&l.gamma)) {
            return Err(format!("`loss.gamma` must be in [0, 1], got {}", l.gamma));
        }
        let varies = est.optimal_token()
            || (est.per_token()
                && (l.use_kl_in_reward
                    || (est == AdvEstimator::ReinforcePlusPlus && l.gamma != 1.0)));
        if varies && matches!(l.loss_type, LossType::Gmpo | LossType::Vespo) {
            return Err(format!(
                "{what} gives each token its own advantage; `loss.loss_type = \"{}\"` weighs whole sequences and takes one per completion",
                l.loss_type.as_str()
            ));
        }
        if l.use_kl_in_reward {
            let k = &l.kl_ctrl;
            if !(k.kl_coef.is_finite() && k.kl_coef >= 0.0) {
                return Err(format!(
                    "`loss.kl_ctrl.kl_coef` must be >= 0, got {}",
                    k.kl_coef
                ));
            }
            if k.kind == KlCtrlKind::Adaptive
                && !(k.target_kl > 0.0 && k.horizon > 0.0 && k.target_kl.is_finite())
            {
                return Err(format!(
                    "`loss.kl_ctrl` adaptive needs target_kl > 0 and horizon > 0, got {} and {}",
                    k.target_kl, k.horizon
                ));
            }
        }
        Ok(())
    }

    /// DAPO's dynamic sampling (`[loss.filter_groups]`).
    fn check_filter_groups(&self) -> std::result::Result<(), String> {
        let f = &self.loss.filter_groups;
        if !f.enable {
            return Ok(());
        }
        if !matches!(self.algorithm, Algorithm::Grpo | Algorithm::Rloo) {
            return Err(format!(
                "`loss.filter_groups` picks GRPO's groups by their rewards; algorithm `{}` trains otherwise: leave it off",
                self.algorithm
            ));
        }
        if self.loss.replay_buffer_size > 0 {
            return Err("`loss.filter_groups` and `loss.replay_buffer_size` are two answers to groups whose rewards are all equal: choose one".into());
        }
        if f.gen_batch_size == Some(0) {
            return Err("`loss.filter_groups.gen_batch_size` must be at least 1".into());
        }
        match f.metric.as_str() {
            "" => return Err("`loss.filter_groups.metric` is empty: `reward`, a reward's name or a value the rewards log".into()),
            "seq_final_reward" => return Err("`loss.filter_groups.metric = \"seq_final_reward\"`: verl's in-reward KL penalty joins the reward in the learner, after the groups are picked; filter on `reward`".into()),
            _ => {}
        }
        Ok(())
    }

    /// Prompts per generation batch: `loss.filter_groups.gen_batch_size` with dynamic
    /// sampling, else the step's.
    pub fn prompts_per_draw(&self) -> usize {
        let f = &self.loss.filter_groups;
        match (f.enable, f.gen_batch_size) {
            (true, Some(n)) => n,
            _ => self.train.prompts_per_step,
        }
    }

    fn check_ppo(&self) -> std::result::Result<(), String> {
        self.ppo.validate()?;
        if self.reference.beta != 0.0 {
            return Err(
                "PPO's KL penalty is `ppo.kl_coef` (in the reward); leave `reference.beta` at 0"
                    .into(),
            );
        }
        if self.optim.num_iterations != 1 || self.optim.steps_per_generation.is_some() {
            return Err("PPO's passes over a batch are `ppo.num_ppo_epochs` and its updates                         `ppo.num_mini_batches`; leave `optim.num_iterations` at 1 and                         `optim.steps_per_generation` out"
                .into());
        }
        if self.teacher.is_some() || self.environment.kind.is_some() {
            return Err("PPO trains on single-turn completions: `[teacher]` and                         `[environment]` are not supported with it"
                .into());
        }
        if self.loss.replay_buffer_size > 0 || self.loss.drop_zero_std_groups {
            return Err("PPO learns from every completion's own score: leave                         `loss.replay_buffer_size` and `loss.drop_zero_std_groups` out"
                .into());
        }
        let n = self.completions_per_step();
        if !n.is_multiple_of(self.ppo.num_mini_batches) {
            return Err(format!(
                "`ppo.num_mini_batches` = {} must divide the step's {n} completions                  (`train.prompts_per_step` × `rollout.num_generations`)",
                self.ppo.num_mini_batches
            ));
        }
        Ok(())
    }

    /// `[sdft]`'s settings (TRL's `SDFTConfig.__post_init__`).
    fn check_sdft(&self) -> std::result::Result<(), String> {
        self.check_self_distill("sdft")?;
        let t = &self.sdft.teacher_prompt_template;
        crate::learner::sdpo::format_template(t, &|name| {
            ["prompt", "privileged_context"]
                .contains(&name)
                .then_some("")
        })
        .map_err(|e| format!("`sdft.teacher_prompt_template`: {e}"))?;
        if !(t.contains("{prompt}") && t.contains("{privileged_context}")) {
            return Err(
                "`sdft.teacher_prompt_template` must contain both `{prompt}` and \
                 `{privileged_context}`"
                    .into(),
            );
        }
        Ok(())
    }

    /// `[sdpo]`'s settings (TRL's `SDPOConfig.__post_init__` and the trainer's refusals).
    fn check_sdpo(&self) -> std::result::Result<(), String> {
        self.check_self_distill("sdpo")?;
        let d = &self.sdpo;
        if !(0.0..=1.0).contains(&d.distillation_weight) {
            return Err(format!(
                "`sdpo.distillation_weight` must be in [0, 1], got {}",
                d.distillation_weight
            ));
        }
        if d.distillation_mode != SdpoMode::TopkLogits && d.distillation_topk.is_some() {
            return Err("`sdpo.distillation_topk` is read by `distillation_mode = \
                        \"topk_logits\"` only; leave it out"
                .into());
        }
        if d.max_reprompt_len == 0 {
            return Err("`sdpo.max_reprompt_len` must be >= 1".into());
        }
        for (key, template, fields) in [
            (
                "reprompt_template",
                &d.reprompt_template,
                &["prompt", "solution", "feedback"][..],
            ),
            (
                "solution_template",
                &d.solution_template,
                &["successful_previous_attempt"][..],
            ),
            (
                "feedback_template",
                &d.feedback_template,
                &["feedback_raw"][..],
            ),
        ] {
            crate::learner::sdpo::format_template(template, &|name| {
                fields.contains(&name).then_some("")
            })
            .map_err(|e| format!("`sdpo.{key}`: {e}"))?;
        }
        if d.distillation_weight < 1.0
            && !matches!(
                self.loss.loss_type,
                LossType::Grpo | LossType::Bnpo | LossType::DrGrpo | LossType::Dapo
            )
        {
            return Err(format!(
                "SDPO's policy term takes `loss.loss_type` grpo, bnpo, dr_grpo or dapo, got {}",
                self.loss.loss_type.as_str()
            ));
        }
        Ok(())
    }

    /// Online DPO's, XPO's and Nash-MD's settings.
    fn check_online_dpo(&self) -> std::result::Result<(), String> {
        let name = match self.algorithm {
            Algorithm::Xpo => "XPO",
            Algorithm::NashMd => "Nash-MD",
            _ => "online DPO",
        };
        let o = &self.online_dpo;
        epoch_values("online_dpo.beta", &o.beta, |b| b > 0.0, "> 0")?;
        if let Some(p) = o.missing_eos_penalty
            && !(p >= 0.0 && p.is_finite())
        {
            return Err(format!(
                "`online_dpo.missing_eos_penalty` must be >= 0, got {p}"
            ));
        }
        if self.rollout.num_generations != 2 {
            return Err(format!(
                "{name} compares two completions per prompt: `rollout.num_generations` \
                 must be 2, got {}",
                self.rollout.num_generations
            ));
        }
        if !self.micro_batch().is_multiple_of(2) {
            return Err(format!(
                "{name} keeps each prompt's two completions in one micro-batch: \
                 `train.per_device_train_batch_size` must be even, got {}",
                self.micro_batch()
            ));
        }
        if self.reference.beta != 0.0 {
            return Err(format!(
                "{name}'s beta is `online_dpo.beta`; leave `reference.beta` at 0"
            ));
        }
        if self.teacher.is_some() || self.environment.kind.is_some() {
            return Err(format!(
                "{name} trains on single-turn completions: `[teacher]` and `[environment]` \
                 are not supported with it"
            ));
        }
        if self.loss.drop_zero_std_groups {
            return Err(format!(
                "`loss.drop_zero_std_groups` drops groups by their rewards; {name} trains on \
                 every pair (a tie keeps the first completion as chosen)"
            ));
        }
        if self.algorithm == Algorithm::OnlineDpo {
            return Ok(());
        }
        if self.algorithm == Algorithm::NashMd && self.rollout.backend == Backend::Openai {
            return Err(
                "Nash-MD samples from the mixture of the policy's and the reference's logits, \
                 in this process: leave `rollout.backend` at \"local\""
                    .into(),
            );
        }
        if self.algorithm == Algorithm::Xpo {
            epoch_values("xpo.alpha", &self.xpo.alpha, |a| a >= 0.0, ">= 0")?;
        } else {
            epoch_values(
                "nash_md.mixture_coef",
                &self.nash_md.mixture_coef,
                |c| (0.0..=1.0).contains(&c),
                "in [0, 1]",
            )?;
            if o.loss_type != OnlineDpoLoss::Sigmoid {
                return Err(
                    "Nash-MD's loss is its own, not DPO's: `online_dpo.loss_type` does not \
                     apply to it"
                        .into(),
                );
            }
        }
        Ok(())
    }

    /// What one step trains on: prompts × generations completions (GRPO), or
    /// `prompts_per_step` rows (SFT, DPO).
    pub fn completions_per_step(&self) -> usize {
        match self.algorithm {
            Algorithm::Grpo
            | Algorithm::Rloo
            | Algorithm::Distillation
            | Algorithm::OnlineDpo
            | Algorithm::Xpo
            | Algorithm::NashMd
            | Algorithm::Gkd
            | Algorithm::A2po
            | Algorithm::Sdpo
            | Algorithm::Sdft
            | Algorithm::IwOpd
            | Algorithm::Gold
            | Algorithm::Ssd
            | Algorithm::MiniLlm
            | Algorithm::Ppo => self.train.prompts_per_step * self.rollout.num_generations,
            Algorithm::Sft
            | Algorithm::Dpo
            | Algorithm::Kto
            | Algorithm::Bco
            | Algorithm::Reward
            | Algorithm::Orpo
            | Algorithm::Cpo
            | Algorithm::Tpo
            | Algorithm::Prm => self.train.prompts_per_step,
        }
    }

    /// Completions (rows) per micro-batch: `per_device_train_batch_size`, else the step split
    /// into `gradient_accumulation_steps`, else the whole step.
    pub fn micro_batch(&self) -> usize {
        let n = self.completions_per_step();
        if let Some(spg) = self.optim.steps_per_generation {
            return (n / spg.max(1)).max(1);
        }
        match (
            self.train.per_device_train_batch_size,
            self.optim.gradient_accumulation_steps,
        ) {
            (Some(b), _) => b.max(1),
            (None, Some(ga)) => (n / ga.max(1)).max(1),
            (None, None) => n,
        }
    }

    /// Whether dropout is off while training: `train.disable_dropout`, else TRL's default of
    /// the algorithm (DPOConfig's, MiniLLMConfig's and PRMConfig's true, GRPOConfig's false, none in
    /// SFTConfig).
    pub fn dropout_disabled(&self) -> bool {
        self.train.disable_dropout.unwrap_or(matches!(
            self.algorithm,
            Algorithm::Prm
                | Algorithm::Dpo
                | Algorithm::Kto
                | Algorithm::Bco
                | Algorithm::Reward
                | Algorithm::Orpo
                | Algorithm::Cpo
                | Algorithm::OnlineDpo
                | Algorithm::Xpo
                | Algorithm::NashMd
                | Algorithm::Gkd
                | Algorithm::Tpo
                | Algorithm::Sdpo
                | Algorithm::Sdft
                | Algorithm::IwOpd
                | Algorithm::Gold
                | Algorithm::Ssd
                | Algorithm::MiniLlm
                | Algorithm::Ppo
        ))
    }

    /// Optimizer updates per step: `steps_per_generation / gradient_accumulation_steps` with
    /// TRL's `steps_per_generation`, else 1.
    pub fn updates_per_step(&self) -> usize {
        match self.optim.steps_per_generation {
            Some(spg) => (spg / self.optim.gradient_accumulation_steps.unwrap_or(1).max(1)).max(1),
            None => 1,
        }
    }

    /// The config as JSON with secrets removed (judge `api_key` values are never stored, but a
    /// key-looking field is blanked anyway).
    pub fn redacted_json(&self) -> Value {
        fn scrub(v: &mut Value) {
            match v {
                Value::Object(m) => {
                    for (k, child) in m.iter_mut() {
                        let lk = k.to_ascii_lowercase();
                        if (lk.contains("api_key") && !lk.ends_with("_env"))
                            || lk == "authorization"
                            || lk.contains("secret")
                            || lk == "password"
                        {
                            *child = Value::String("<redacted>".into());
                        } else {
                            scrub(child);
                        }
                    }
                }
                Value::Array(a) => a.iter_mut().for_each(scrub),
                _ => {}
            }
        }
        let mut v = serde_json::to_value(self).unwrap_or(Value::Null);
        scrub(&mut v);
        v
    }
}

impl TrainConfig {
    /// The dtype the model is loaded and computes in: bf16 with `train.bf16`, else
    /// `model.dtype`.
    pub fn compute_dtype(&self) -> candle_core::DType {
        if self.train.bf16 {
            candle_core::DType::BF16
        } else {
            self.model.dtype.dtype()
        }
    }
}

#[cfg(test)]
mod tests {

    /// Every config key is in the README: as `section.key`, as `key =` in a config example,
    /// or as `` `key` `` in a table (the README is the user's reference of the schema).
    #[test]
    fn every_config_key_is_in_the_readme() {
        let readme = include_str!("../../../README.md");
        let mut missing = Vec::new();
        for k in known_keys() {
            let leaf = k.rsplit('.').next().unwrap_or(&k);
            let as_assignment = readme.lines().any(|l| {
                let t = l.trim_start_matches(['#', ' ']);
                t.starts_with(&format!("{leaf} =")) || t.starts_with(&format!("{leaf}="))
            });
            // A nested table's keys may be listed by name beside their parent key.
            let word = |w: &str| {
                readme
                    .split(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                    .any(|x| x == w)
            };
            let listed = k
                .rsplit('.')
                .nth(1)
                .is_some_and(|parent| readme.contains(&format!("{parent} =")) && word(leaf));
            let found = readme.contains(k.as_str())
                || as_assignment
                || readme.contains(&format!("`{leaf}`"))
                || listed;
            if !found {
                missing.push(k);
            }
        }
        assert!(
            missing.is_empty(),
            "config keys missing from README.md: {missing:?}"
        );
    }
    use super::*;

    fn minimal() -> Value {
        serde_json::json!({
            "model": {"path": "m"},
            "data": {"path": ["d.jsonl"]},
            "rewards": [{"type": "accuracy"}],
        })
    }

    #[test]
    fn unknown_key_names_the_closest() {
        let mut t = minimal();
        t["optim"] = serde_json::json!({"lerning_rate": 1e-5});
        let e = from_tree(t, "c.toml").unwrap_err().to_string();
        assert!(e.contains("unknown key `optim.lerning_rate`"), "{e}");
        assert!(e.contains("did you mean `optim.learning_rate`"), "{e}");
    }

    #[test]
    fn sets_override_and_parse_values() {
        let mut t = minimal();
        apply_sets(
            &mut t,
            &[
                "optim.learning_rate=3e-5".into(),
                "rollout.stop=[\"\\n\"]".into(),
                "output_dir=runs/x".into(),
                "model.lora={r = 2, lora_alpha = 8, target_modules = [\"q_proj\"]}".into(),
                "model.lora.r=4".into(),
                "rewards[0].answer_field=\"solution\"".into(),
            ],
        )
        .unwrap();
        let c = from_tree(t, "c").unwrap();
        assert_eq!(c.optim.learning_rate, Some(3e-5));
        assert_eq!(c.rollout.stop, vec!["\n".to_string()]);
        assert_eq!(c.output_dir, PathBuf::from("runs/x"));
        assert_eq!(c.model.lora.as_ref().map(|l| l.r), Some(4));
        let j = serde_json::to_value(&c.rewards[0]).unwrap();
        assert_eq!(j["answer_field"], "solution");
        let mut t = minimal();
        let e = apply_sets(&mut t, &["rewards[3].weight=2".into()]).unwrap_err();
        assert!(e.to_string().contains("no index 3"), "{e}");
    }

    #[test]
    fn lora_takes_peft_options() {
        let toml = r#"
r = 8
lora_alpha = 16
target_modules = "all-linear"
exclude_modules = ["model.layers.0.mlp.down_proj"]
use_rslora = true
use_dora = true
bias = "lora_only"
rank_pattern = { q_proj = 4, 'layers\.1\..*' = 2 }
alpha_pattern = { v_proj = 8 }
layers_to_transform = [0, 1]
"#;
        let mut t = minimal();
        t["model"]["lora"] = parse_toml_tree(toml).unwrap();
        let c = from_tree(t, "c").unwrap();
        let l = c.model.lora.unwrap();
        assert_eq!(
            l.target_modules,
            grpo_rollout::lora::TargetModules::Pattern("all-linear".into())
        );
        assert!(l.use_rslora && l.use_dora && l.bias == "lora_only");
        assert_eq!(l.rank_pattern.get("layers\\.1\\..*"), Some(&2));
        assert_eq!(l.alpha_pattern.get("v_proj"), Some(&8.0));
        assert_eq!(
            l.layers_to_transform,
            Some(grpo_rollout::lora::Layers::Many(vec![0, 1]))
        );
        // An empty section takes PEFT's LoraConfig defaults (r 8, alpha 8, q_proj and v_proj).
        let mut t = minimal();
        t["model"]["lora"] = serde_json::json!({});
        let l = from_tree(t, "c").unwrap().model.lora.unwrap();
        assert_eq!((l.r, l.lora_alpha), (8, 8.0));
        assert_eq!(
            l.target_modules,
            grpo_rollout::lora::TargetModules::Names(vec!["q_proj".into(), "v_proj".into()])
        );
        // A single layer, as peft also writes it.
        let mut t = minimal();
        t["model"]["lora"] = parse_toml_tree(
            "r = 8\nlora_alpha = 16\ntarget_modules = [\"q_proj\"]\nlayers_to_transform = 1",
        )
        .unwrap();
        let l = from_tree(t, "c").unwrap().model.lora.unwrap();
        assert_eq!(
            l.layers_to_transform,
            Some(grpo_rollout::lora::Layers::One(1))
        );
        // Bad values name the option.
        for (bad, field) in [
            ("bias = \"every\"", "bias"),
            ("use_dora = true\nlora_bias = true", "lora_bias"),
            ("use_qalora = true", "use_qalora"),
        ] {
            let mut t = minimal();
            t["model"]["lora"] = parse_toml_tree(&format!(
                "r = 8\nlora_alpha = 16\ntarget_modules = [\"q_proj\"]\n{bad}"
            ))
            .unwrap();
            let e = from_tree(t, "c").unwrap_err().to_string();
            assert!(e.contains(field), "{bad}: {e}");
        }
    }

    #[test]
    fn a_structured_outputs_regex_is_checked_and_reaches_sampling() {
        let mut t = minimal();
        t["rollout"] = serde_json::json!({"structured_outputs_regex": "(yes"});
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert_eq!(
            e,
            "c: `rollout.structured_outputs_regex`: regex `(yes`: unclosed group"
        );
        let mut t = minimal();
        t["rollout"] = serde_json::json!({"structured_outputs_regex": "(yes|no)"});
        let c = from_tree(t, "c").unwrap();
        assert_eq!(c.rollout.sampling(3).regex.as_deref(), Some("(yes|no)"));
    }

    #[test]
    fn a_token_budget_is_checked() {
        let mut t = minimal();
        t["train"] = serde_json::json!({"token_budget": 0});
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert!(e.contains("`train.token_budget` must be >= 1"), "{e}");
        let mut t = minimal();
        t["train"] = serde_json::json!({"token_budget": 512});
        assert_eq!(from_tree(t, "c").unwrap().train.token_budget, Some(512));
        let mut t = minimal();
        t["algorithm"] = serde_json::json!("online_dpo");
        t["train"] = serde_json::json!({"token_budget": 512});
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert!(
            e.contains("`train.token_budget`") && e.contains("online"),
            "{e}"
        );
    }

    #[test]
    fn batch_geometry_is_checked() {
        let mut t = minimal();
        apply_sets(
            &mut t,
            &[
                "train.per_device_train_batch_size=5".into(),
                "optim.gradient_accumulation_steps=3".into(),
            ],
        )
        .unwrap();
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert!(e.contains("per_device_train_batch_size"), "{e}");
    }

    #[test]
    fn side_models_take_their_own_device_and_dtype() {
        let mut t = minimal();
        t["reward_model_device"] = "cpu".into();
        t["reward_model_dtype"] = "bf16".into();
        t["teacher"] = serde_json::json!({"student_device": "cpu", "student_dtype": "f16"});
        let c = from_tree(t, "c").unwrap();
        assert_eq!(c.reward_model_dtype, Some(Dtype::Bf16));
        let teacher = c.teacher.unwrap();
        assert_eq!(teacher.student_device, Some(DeviceSpec::Cpu));
        assert_eq!(teacher.student_dtype, Some(Dtype::F16));
        for (key, value, named) in [
            (
                "reward_model_device",
                "tpu",
                "reward_model_device: expected cpu, cuda or cuda:N, got `tpu`",
            ),
            ("reward_model_dtype", "f8", "reward_model_dtype: "),
        ] {
            let mut t = minimal();
            t[key] = value.into();
            let e = from_tree(t, "c").unwrap_err().to_string();
            assert!(e.contains(named), "{e}");
        }
        let mut t = minimal();
        t["teacher"] = serde_json::json!({"student_dtype": "int4"});
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert!(
            e.contains("teacher.student_dtype: expected f32, bf16 or f16, got `int4`"),
            "{e}"
        );
    }

    #[test]
    fn the_generator_takes_a_device_of_its_own() {
        let mut t = minimal();
        t["rollout"] = serde_json::json!({"device": "cuda:1"});
        let c = from_tree(t, "c").unwrap();
        assert_eq!(c.rollout.device, Some(DeviceSpec::Cuda(1)));
        assert_eq!(c.model.device, DeviceSpec::Cpu);
        let mut t = minimal();
        t["rollout"] = serde_json::json!({"device": "gpu"});
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert!(
            e.contains("rollout.device: expected cpu, cuda or cuda:N, got `gpu`"),
            "{e}"
        );
        // The openai backend samples on its server.
        let mut t = minimal();
        t["model"]["lora"] =
            serde_json::json!({"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"]});
        t["rollout"] = serde_json::json!({"device": "cpu", "backend": "openai"});
        let e = from_tree(t, "c").unwrap_err().to_string();
        assert!(
            e.contains("rollout.device") && e.contains("local backend"),
            "{e}"
        );
    }

    #[test]
    fn yaml_and_toml_read_the_same() {
        let toml_text =
            "output_dir = \"r\"\n[model]\npath = \"m\"\n[optim]\nlearning_rate = 2e-5\n";
        let yaml_text = "output_dir: r\nmodel:\n  path: m\noptim:\n  learning_rate: 2.0e-5\n";
        let a = parse_tree(toml_text, Path::new("a.toml")).unwrap();
        let b = parse_tree(yaml_text, Path::new("a.yaml")).unwrap();
        assert_eq!(a, b);
    }
}
