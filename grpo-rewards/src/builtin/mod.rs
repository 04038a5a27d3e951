//! Built-in rewards: [`Accuracy`], [`Format`], [`Overlong`], TRL's reward functions
//! ([`MathVerify`], [`ThinkFormat`], [`RepetitionPenalty`], [`CosineScaled`],
//! [`ReasoningAccuracy`], on a native [`math_verify`]), and the
//! model-based [`InverseLoss`], [`CoverageCe`], [`RewardModel`], [`ProcessRewardModel`].

mod accuracy;
mod format;
pub mod math_verify;
mod model;
mod overlong;
mod trl;

pub use accuracy::{
    Accuracy, AccuracyConfig, answers_match, extract_answer, extract_boxed, latex_value,
};
pub use format::{Format, FormatConfig};
pub use model::{
    CoverageCe, CoverageCeConfig, InverseLoss, InverseLossConfig, LanguageScorer,
    ProcessRewardModel, ProcessRewardModelConfig, RewardModel, RewardModelConfig, ScorerError,
    ScoringModel, SequenceClassifier, StepAggregation, StepClassifier,
};
pub use overlong::{Overlong, OverlongConfig, overlong_penalty};
pub use trl::{
    CosineScaled, CosineScaledConfig, MathVerify, MathVerifyConfig, ReasoningAccuracy,
    ReasoningAccuracyConfig, RepetitionPenalty, RepetitionPenaltyConfig, ThinkFormat,
    ThinkFormatConfig, Verifier, after_reasoning, cosine_scaled, repetition_penalty, think_format,
};
