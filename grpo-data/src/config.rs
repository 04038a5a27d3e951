//! [`DataConfig`]: the `[data]` section of a run's config, opened into train and eval datasets.

use serde::{Deserialize, Serialize};

use crate::dataset::{DEFAULT_CHUNK_ROWS, Dataset, OpenOptions};
use crate::error::{DataError, Result};
use crate::format::Format;

/// Where the prompts come from and how to split them. Field names follow TRL / HF datasets.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct DataConfig {
    /// Files, directories or globs of shards, read as one dataset.
    pub path: Vec<String>,
    /// Force a format (`parquet`, `arrow`, `jsonl`, `csv`) instead of the extension's.
    pub format: Option<Format>,
    /// The prompt column.
    pub prompt_field: String,
    /// The reference-answer column supervised rewards read ([`Dataset::require_column`]).
    pub answer_field: String,
    /// Use only the first `max_samples` rows (before the eval split).
    pub max_samples: Option<u64>,
    /// Hold out this fraction (0 < f < 1) of the rows, chosen by the seed, for evaluation.
    pub eval_fraction: Option<f64>,
    /// Or: separate evaluation files (same format rules as `path`).
    pub eval_path: Vec<String>,
    /// Rows per read chunk ([`OpenOptions::chunk_rows`]).
    pub chunk_rows: usize,
}

impl Default for DataConfig {
    fn default() -> Self {
        DataConfig {
            path: Vec::new(),
            format: None,
            prompt_field: "prompt".into(),
            answer_field: "answer".into(),
            max_samples: None,
            eval_fraction: None,
            eval_path: Vec::new(),
            chunk_rows: DEFAULT_CHUNK_ROWS,
        }
    }
}

/// The opened datasets.
#[derive(Debug, Clone)]
pub struct Splits {
    /// Training samples.
    pub train: Dataset,
    /// Evaluation samples, if an eval split or eval files were configured.
    pub eval: Option<Dataset>,
}

impl DataConfig {
    /// The options to open files with.
    pub fn open_options(&self) -> OpenOptions {
        OpenOptions {
            format: self.format,
            prompt_field: self.prompt_field.clone(),
            chunk_rows: self.chunk_rows,
        }
    }

    /// Open the train (and eval) datasets; `seed` picks the eval rows for `eval_fraction`.
    pub fn open(&self, seed: u64) -> Result<Splits> {
        if self.eval_fraction.is_some() && !self.eval_path.is_empty() {
            return Err(DataError::InvalidConfig(
                "set eval_fraction or eval_path, not both".into(),
            ));
        }
        let opts = self.open_options();
        let all = Dataset::open(&self.path, &opts)?.take(self.max_samples)?;
        if !self.eval_path.is_empty() {
            let eval = Dataset::open(&self.eval_path, &opts)?;
            return Ok(Splits {
                train: all,
                eval: Some(eval),
            });
        }
        match self.eval_fraction {
            Some(f) => {
                let (train, eval) = all.split_eval(f, seed)?;
                Ok(Splits {
                    train,
                    eval: Some(eval),
                })
            }
            None => Ok(Splits {
                train: all,
                eval: None,
            }),
        }
    }
}
