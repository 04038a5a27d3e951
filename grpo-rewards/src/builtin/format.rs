use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// Config of [`Format`] (`type = "format"`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct FormatConfig {
    /// A regex (Rust `regex` syntax) that must match the WHOLE completion. Default
    /// `(?s)<think>.*?</think>\s*<answer>.*?</answer>`.
    pub pattern: String,
}

impl Default for FormatConfig {
    fn default() -> Self {
        Self {
            pattern: r"(?s)<think>.*?</think>\s*<answer>.*?</answer>".into(),
        }
    }
}

/// 1 when `pattern` matches the whole completion, else 0.
#[derive(Debug, Clone)]
pub struct Format {
    whole: Regex,
}

impl Format {
    /// Compiles the pattern (anchored at both ends); a bad pattern is an error naming `pattern`.
    pub fn new(config: &FormatConfig) -> Result<Self> {
        // Check the pattern alone first so the error message shows the user's own text.
        Regex::new(&config.pattern).map_err(|e| RewardError::config("pattern", e.to_string()))?;
        let whole = Regex::new(&format!(r"\A(?:{})\z", config.pattern))
            .map_err(|e| RewardError::config("pattern", e.to_string()))?;
        Ok(Self { whole })
    }
}

impl Default for Format {
    #[allow(clippy::expect_used)]
    fn default() -> Self {
        Self::new(&FormatConfig::default()).expect("the default pattern compiles")
    }
}

impl Reward for Format {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        Ok(RewardOutput::from_scores(
            batch
                .iter()
                .map(|x| {
                    Some(if self.whole.is_match(&x.completion) {
                        1.0
                    } else {
                        0.0
                    })
                })
                .collect(),
        ))
    }
}
