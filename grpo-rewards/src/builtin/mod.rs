//! Built-in rewards: [`Accuracy`], [`Format`], [`Overlong`], and the model-based
//! [`InverseLoss`], [`CoverageCe`], [`RewardModel`].

mod accuracy;
mod format;
mod model;
mod overlong;

pub use accuracy::{Accuracy, AccuracyConfig, answers_match, extract_answer, extract_boxed};
pub use format::{Format, FormatConfig};
pub use model::{
    CoverageCe, CoverageCeConfig, InverseLoss, InverseLossConfig, LanguageScorer, RewardModel,
    RewardModelConfig, ScorerError, ScoringModel, SequenceClassifier,
};
pub use overlong::{Overlong, OverlongConfig, overlong_penalty};
