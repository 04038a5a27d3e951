use serde::{Deserialize, Serialize};

use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// Config of [`Overlong`] (`type = "overlong"`), DAPO's soft overlong punishment.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct OverlongConfig {
    /// `L_max`: the length (in completion tokens) at which the penalty reaches −1; usually
    /// `max_completion_length`.
    pub max_completion_length: usize,
    /// `L_cache`: the width of the linear ramp before `L_max`. DAPO uses 4096 of 20480.
    pub overlong_buffer: usize,
}

impl OverlongConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.max_completion_length == 0 {
            return Err(RewardError::config("max_completion_length", "must be > 0"));
        }
        if self.overlong_buffer > self.max_completion_length {
            return Err(RewardError::config(
                "overlong_buffer",
                format!(
                    "must be ≤ max_completion_length ({}), got {}",
                    self.max_completion_length, self.overlong_buffer
                ),
            ));
        }
        Ok(())
    }
}

/// DAPO's penalty for a completion of `len` tokens: 0 up to `L_max − L_cache`, then
/// `(L_max − L_cache − len) / L_cache` down to −1 at `L_max`, and −1 beyond.
pub fn overlong_penalty(len: usize, max_len: usize, buffer: usize) -> f32 {
    let expected = max_len.saturating_sub(buffer);
    if len <= expected {
        0.0
    } else if len > max_len || buffer == 0 {
        -1.0
    } else {
        ((expected as f64 - len as f64) / buffer as f64) as f32
    }
}

/// DAPO's soft overlong punishment on `completion_tokens` ([`overlong_penalty`]).
#[derive(Debug, Clone)]
pub struct Overlong {
    config: OverlongConfig,
}

impl Overlong {
    /// A validated overlong reward.
    pub fn new(config: OverlongConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }
}

impl Reward for Overlong {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let c = &self.config;
        Ok(RewardOutput::from_scores(
            batch
                .iter()
                .map(|x| {
                    Some(overlong_penalty(
                        x.completion_tokens,
                        c.max_completion_length,
                        c.overlong_buffer,
                    ))
                })
                .collect(),
        ))
    }
}
