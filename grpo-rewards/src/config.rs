//! Reward configs as users write them (TOML/YAML/JSON), validated once into a [`RewardSet`].

use std::sync::Arc;

use serde::{Deserialize, Serialize};

use crate::builtin::{
    Accuracy, AccuracyConfig, CosineScaled, CosineScaledConfig, CoverageCe, CoverageCeConfig,
    Format, FormatConfig, InverseLoss, InverseLossConfig, LanguageScorer, MathVerify,
    MathVerifyConfig, Overlong, OverlongConfig, ProcessRewardModel, ProcessRewardModelConfig,
    ReasoningAccuracy, ReasoningAccuracyConfig, RepetitionPenalty, RepetitionPenaltyConfig,
    RewardModel, RewardModelConfig, ScoringModel, SequenceClassifier, StepClassifier, ThinkFormat,
    ThinkFormatConfig,
};
use crate::combine::RewardSet;
#[cfg(feature = "command")]
use crate::command::{CommandConfig, CommandReward};
use crate::error::{Result, RewardError};
#[cfg(feature = "judges")]
use crate::http::{HttpReward, HttpRewardConfig};
#[cfg(feature = "judges")]
use crate::judge::{EnsembleConfig, Judge, JudgeConfig, JudgeEnsemble};
use crate::python::{PythonConfig, PythonReward, PythonWorkers};

/// Which reward, with its keys (`type = "..."`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", rename_all = "snake_case")]
pub enum RewardKind {
    /// [`Accuracy`].
    Accuracy(AccuracyConfig),
    /// [`Format`].
    Format(FormatConfig),
    /// [`Overlong`].
    Overlong(OverlongConfig),
    /// [`MathVerify`] (TRL's `accuracy_reward`).
    MathVerify(MathVerifyConfig),
    /// [`ThinkFormat`] (TRL's `think_format_reward`).
    ThinkFormat(ThinkFormatConfig),
    /// [`RepetitionPenalty`] (TRL's `get_repetition_penalty_reward`).
    RepetitionPenalty(RepetitionPenaltyConfig),
    /// [`CosineScaled`] (TRL's `get_cosine_scaled_reward`).
    CosineScaled(CosineScaledConfig),
    /// [`ReasoningAccuracy`] (TRL's `reasoning_accuracy_reward`).
    ReasoningAccuracy(ReasoningAccuracyConfig),
    /// [`InverseLoss`] (needs a [`LanguageScorer`]).
    InverseLoss(InverseLossConfig),
    /// [`CoverageCe`] (needs a [`LanguageScorer`]).
    CoverageCe(CoverageCeConfig),
    /// [`RewardModel`] (needs a [`SequenceClassifier`]).
    RewardModel(RewardModelConfig),
    /// [`ProcessRewardModel`] (needs a [`StepClassifier`]).
    ProcessRewardModel(ProcessRewardModelConfig),
    /// One LLM judge (feature `judges`).
    #[cfg(feature = "judges")]
    Judge(JudgeConfig),
    /// An ensemble of LLM judges (feature `judges`).
    #[cfg(feature = "judges")]
    JudgeEnsemble(EnsembleConfig),
    /// A program run per completion (feature `command`).
    #[cfg(feature = "command")]
    Command(CommandConfig),
    /// A reward model behind an HTTP service, [`HttpReward`] (feature `judges`).
    #[cfg(feature = "judges")]
    Http(HttpRewardConfig),
    /// A Python function with TRL's reward signature ([`PythonReward`]).
    Python(PythonConfig),
}

impl RewardKind {
    /// The `type` tag.
    pub fn type_name(&self) -> &'static str {
        match self {
            RewardKind::Accuracy(_) => "accuracy",
            RewardKind::Format(_) => "format",
            RewardKind::Overlong(_) => "overlong",
            RewardKind::MathVerify(_) => "math_verify",
            RewardKind::ThinkFormat(_) => "think_format",
            RewardKind::RepetitionPenalty(_) => "repetition_penalty",
            RewardKind::CosineScaled(_) => "cosine_scaled",
            RewardKind::ReasoningAccuracy(_) => "reasoning_accuracy",
            RewardKind::InverseLoss(_) => "inverse_loss",
            RewardKind::CoverageCe(_) => "coverage_ce",
            RewardKind::RewardModel(_) => "reward_model",
            RewardKind::ProcessRewardModel(_) => "process_reward_model",
            #[cfg(feature = "judges")]
            RewardKind::Judge(_) => "judge",
            #[cfg(feature = "judges")]
            RewardKind::JudgeEnsemble(_) => "judge_ensemble",
            #[cfg(feature = "command")]
            RewardKind::Command(_) => "command",
            #[cfg(feature = "judges")]
            RewardKind::Http(_) => "http",
            RewardKind::Python(_) => "python",
        }
    }
}

/// One entry of `rewards`: a name, a weight and the reward's own keys.
///
/// ```toml
/// [[rewards]]
/// type = "accuracy"
/// weight = 1.0
/// answer_field = "answer"
/// ```
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RewardSpec {
    /// Name in metrics (`rewards/{name}/mean`); defaults to the `type`.
    #[serde(default)]
    pub name: Option<String>,
    /// Weight in the sum (overridden by `reward_weights`). Default 1.
    #[serde(default = "one")]
    pub weight: f32,
    /// The reward.
    #[serde(flatten)]
    pub kind: RewardKind,
}

fn one() -> f32 {
    1.0
}

/// The rewards section of a training config.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct RewardsConfig {
    /// The reward functions.
    #[serde(default)]
    pub rewards: Vec<RewardSpec>,
    /// TRL's `reward_weights`: one weight per reward, in order; overrides each `weight`.
    #[serde(default)]
    pub reward_weights: Option<Vec<f32>>,
}

/// The local models that model-based rewards score with (the model crate provides them).
#[derive(Clone, Default)]
pub struct ScoringModels {
    /// For `inverse_loss` and `coverage_ce`.
    pub language: Option<Arc<dyn LanguageScorer>>,
    /// For `inverse_loss` with `model = "policy"`: the policy being trained (the trainer
    /// swaps in the weights that sampled each batch).
    pub policy: Option<Arc<dyn LanguageScorer>>,
    /// For `reward_model`.
    pub classifier: Option<Arc<dyn SequenceClassifier>>,
    /// For `process_reward_model`, by the reward's `path` (as the config spells it).
    pub step_classifiers: std::collections::HashMap<std::path::PathBuf, Arc<dyn StepClassifier>>,
}

impl std::fmt::Debug for ScoringModels {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ScoringModels")
            .field("language", &self.language.is_some())
            .field("policy", &self.policy.is_some())
            .field("classifier", &self.classifier.is_some())
            .field("step_classifiers", &self.step_classifiers.len())
            .finish()
    }
}

impl RewardsConfig {
    /// Validates every entry and builds the [`RewardSet`]. Errors name the field, e.g.
    /// `rewards[1].timeout_secs`.
    pub fn build(&self, models: &ScoringModels) -> Result<RewardSet> {
        self.build_with(models, &PythonWorkers::new())
    }

    /// [`Self::build`] with the Python worker processes to use (a trainer shares them with
    /// its Python tools and environments: one worker per interpreter for the run).
    pub fn build_with(
        &self,
        models: &ScoringModels,
        python_workers: &PythonWorkers,
    ) -> Result<RewardSet> {
        if self.rewards.is_empty() {
            return Err(RewardError::config("rewards", "needs at least one reward"));
        }
        if let Some(w) = &self.reward_weights
            && w.len() != self.rewards.len()
        {
            return Err(RewardError::config(
                "reward_weights",
                format!("has {} weights for {} rewards", w.len(), self.rewards.len()),
            ));
        }
        let mut set = RewardSet::new();
        let mut names = std::collections::BTreeSet::new();
        for (i, spec) in self.rewards.iter().enumerate() {
            let p = format!("rewards[{i}].");
            let at = |e: RewardError| match e {
                RewardError::Config { field, message } => RewardError::Config {
                    field: if field.starts_with("rewards[") {
                        field
                    } else {
                        format!("{p}{field}")
                    },
                    message,
                },
                other => other,
            };
            let name = spec
                .name
                .clone()
                .unwrap_or_else(|| spec.kind.type_name().to_owned());
            if name.trim().is_empty() || name.contains('/') {
                return Err(RewardError::config(
                    format!("{p}name"),
                    "must be non-empty and contain no `/`",
                ));
            }
            if !names.insert(name.clone()) {
                return Err(RewardError::config(
                    format!("{p}name"),
                    format!("`{name}` is used twice; give each reward a distinct name"),
                ));
            }
            let weight = self.reward_weights.as_ref().map_or(spec.weight, |w| w[i]);
            if !weight.is_finite() {
                return Err(RewardError::config(format!("{p}weight"), "must be finite"));
            }
            let need_lm = || {
                models.language.clone().ok_or_else(|| {
                    RewardError::config(
                        format!("{p}type"),
                        format!(
                            "`{}` needs a scoring language model, and none was given",
                            spec.kind.type_name()
                        ),
                    )
                })
            };
            match &spec.kind {
                RewardKind::Accuracy(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(Accuracy::new(c.clone()).map_err(at)?),
                ),
                RewardKind::Format(c) => {
                    set.push_reward(name, weight, Arc::new(Format::new(c).map_err(at)?))
                }
                RewardKind::Overlong(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(Overlong::new(c.clone()).map_err(at)?),
                ),
                RewardKind::MathVerify(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(MathVerify::new(c.clone()).map_err(at)?),
                ),
                RewardKind::ThinkFormat(_) => set.push_reward(name, weight, Arc::new(ThinkFormat)),
                RewardKind::RepetitionPenalty(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(RepetitionPenalty::new(c.clone()).map_err(at)?),
                ),
                RewardKind::CosineScaled(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(CosineScaled::new(c.clone()).map_err(at)?),
                ),
                RewardKind::ReasoningAccuracy(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(ReasoningAccuracy::new(c.clone()).map_err(at)?),
                ),
                RewardKind::InverseLoss(c) => {
                    let model = match c.model {
                        ScoringModel::Reference => need_lm()?,
                        ScoringModel::Policy => models.policy.clone().ok_or_else(|| {
                            RewardError::config(
                                format!("{p}model"),
                                "`policy` scores with the policy being trained, which only a trainer provides (ScoringModels::policy)",
                            )
                        })?,
                    };
                    set.push_reward(name, weight, Arc::new(InverseLoss::new(model)))
                }
                RewardKind::CoverageCe(c) => set.push_reward(
                    name,
                    weight,
                    Arc::new(CoverageCe::new(need_lm()?, c.clone()).map_err(at)?),
                ),
                RewardKind::RewardModel(c) => {
                    let m = models.classifier.clone().ok_or_else(|| {
                        RewardError::config(
                            format!("{p}type"),
                            "`reward_model` needs a sequence classifier, and none was given",
                        )
                    })?;
                    set.push_reward(
                        name,
                        weight,
                        Arc::new(RewardModel::new(m, c.clone()).map_err(at)?),
                    )
                }
                RewardKind::ProcessRewardModel(c) => {
                    let path = c.path.as_ref().ok_or_else(|| {
                        RewardError::config(
                            format!("{p}path"),
                            "a `process_reward_model` reward needs `path` (a *ForTokenClassification directory, e.g. one `grpo-cli prm` trained)",
                        )
                    })?;
                    let m = models.step_classifiers.get(path).cloned().ok_or_else(|| {
                        RewardError::config(
                            format!("{p}path"),
                            format!("no process reward model was loaded from {}", path.display()),
                        )
                    })?;
                    set.push_reward(
                        name,
                        weight,
                        Arc::new(ProcessRewardModel::new(m, c.clone()).map_err(at)?),
                    )
                }
                #[cfg(feature = "judges")]
                RewardKind::Judge(c) => {
                    c.validate_at(&p)?;
                    let mut c = c.clone();
                    // `name` of the entry names the judge too (in logs, errors and info).
                    if spec.name.is_some() {
                        c.name = name.clone();
                    }
                    set.push_async_reward(name, weight, Arc::new(Judge::new(c).map_err(at)?))
                }
                #[cfg(feature = "judges")]
                RewardKind::JudgeEnsemble(c) => {
                    c.validate_at(&p)?;
                    set.push_async_reward(
                        name,
                        weight,
                        Arc::new(JudgeEnsemble::new(c.clone(), None).map_err(at)?),
                    )
                }
                #[cfg(feature = "command")]
                RewardKind::Command(c) => {
                    let r = CommandReward::new(c.clone(), name.clone()).map_err(at)?;
                    set.push_reward(name, weight, Arc::new(r))
                }
                #[cfg(feature = "judges")]
                RewardKind::Http(c) => set.push_async_reward(
                    name.clone(),
                    weight,
                    Arc::new(HttpReward::new(name, c).map_err(at)?),
                ),
                RewardKind::Python(c) => {
                    let r = PythonReward::new(&name, c, python_workers).map_err(at)?;
                    set.push_reward(name, weight, Arc::new(r))
                }
            }
        }
        Ok(set)
    }
}
