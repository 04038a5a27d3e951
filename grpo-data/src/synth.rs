//! Built-in synthetic data: `arithmetic` (a + b, a − b, a × b, short word problems).

use std::sync::Arc;

use arrow::array::{RecordBatch, StringArray};
use arrow::datatypes::{DataType, Field, Schema, SchemaRef};

use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::rng::{SeededRng, mix};

/// Knobs of the `arithmetic` data set.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ArithmeticConfig {
    /// Number of problems.
    pub n: u64,
    /// Seed: problem `i` depends only on (seed, i), so the first k problems of a larger set are
    /// the same as a set of k.
    pub seed: u64,
    /// Digits per operand (1..=9): operands are drawn from `[0, 10^digits)`.
    pub digits: u32,
    /// Most operations in a word problem (1..=8); with 1 there are no word problems, only
    /// `a + b`, `a - b`, `a * b`.
    pub steps: u32,
}

impl Default for ArithmeticConfig {
    fn default() -> Self {
        ArithmeticConfig {
            n: 1000,
            seed: 0,
            digits: 2,
            steps: 3,
        }
    }
}

const NAMES: &[&str] = &[
    "Ava", "Ben", "Chloe", "Dan", "Ema", "Farid", "Grace", "Hugo", "Ines", "Jon", "Kira", "Leo",
];
const ITEMS: &[&str] = &[
    "apples", "marbles", "stickers", "books", "coins", "pencils", "shells", "cards",
];

impl ArithmeticConfig {
    fn check(&self) -> Result<()> {
        if !(1..=9).contains(&self.digits) {
            return Err(DataError::InvalidConfig(format!(
                "digits {} must be in 1..=9",
                self.digits
            )));
        }
        if !(1..=8).contains(&self.steps) {
            return Err(DataError::InvalidConfig(format!(
                "steps {} must be in 1..=8",
                self.steps
            )));
        }
        Ok(())
    }

    /// Problem `i`: `(prompt, answer)`. The answer is an integer, written as text.
    pub fn problem(&self, i: u64) -> (String, String) {
        let mut r = SeededRng::new(mix(self.seed, 0xa417, i));
        let max = 10u64.pow(self.digits) - 1;
        let kinds = if self.steps >= 2 { 4 } else { 3 };
        let a = r.range(0, max) as i64;
        let b = r.range(0, max) as i64;
        match r.below(kinds) {
            0 => (format!("What is {a} + {b}?"), (a + b).to_string()),
            1 => (format!("What is {a} - {b}?"), (a - b).to_string()),
            2 => (format!("What is {a} * {b}?"), (a * b).to_string()),
            _ => self.word_problem(&mut r, max),
        }
    }

    fn word_problem(&self, r: &mut SeededRng, max: u64) -> (String, String) {
        let name = NAMES[r.below(NAMES.len() as u64) as usize];
        let item = ITEMS[r.below(ITEMS.len() as u64) as usize];
        let steps = r.range(2, u64::from(self.steps));
        let mut have = r.range(1, max.max(1)) as i64;
        let mut text = format!("{name} has {have} {item}.");
        for s in 0..steps {
            let then = if s == 0 { "" } else { " Then" };
            match r.below(3) {
                0 => {
                    let k = r.range(1, max.max(1)) as i64;
                    have += k;
                    text.push_str(&format!("{then} {name} gets {k} more."));
                }
                1 if have > 0 => {
                    let k = r.range(1, have as u64) as i64;
                    have -= k;
                    text.push_str(&format!("{then} {name} gives away {k}."));
                }
                _ => {
                    let k = r.range(2, 4) as i64;
                    have *= k;
                    let times = ["", "", "doubles", "triples", "quadruples"][k as usize];
                    text.push_str(&format!("{then} {name} {times} the {item}."));
                }
            }
        }
        text.push_str(&format!(" How many {item} does {name} have now?"));
        (text, have.to_string())
    }

    /// The Arrow schema: `prompt: Utf8, answer: Utf8`.
    pub fn schema() -> SchemaRef {
        Arc::new(Schema::new(vec![
            Field::new("prompt", DataType::Utf8, false),
            Field::new("answer", DataType::Utf8, false),
        ]))
    }

    /// Writes the problems to `path` (Parquet, Arrow IPC, JSONL or CSV by its extension, as
    /// [`crate::write_batches`]); returns the rows written.
    pub fn write(&self, path: &std::path::Path) -> Result<u64> {
        crate::write_batches(path, None, Self::schema(), self.batches(8192)?)
    }

    /// The problems as record batches of up to `batch_rows` rows, made lazily (for writing a
    /// large file without holding it).
    pub fn batches(
        &self,
        batch_rows: usize,
    ) -> Result<impl Iterator<Item = Result<RecordBatch>> + '_> {
        self.check()?;
        let step = batch_rows.max(1) as u64;
        let schema = Self::schema();
        Ok((0..self.n).step_by(step as usize).map(move |start| {
            let end = (start + step).min(self.n);
            let (p, a): (Vec<String>, Vec<String>) = (start..end).map(|i| self.problem(i)).unzip();
            RecordBatch::try_new(
                schema.clone(),
                vec![
                    Arc::new(StringArray::from(p)),
                    Arc::new(StringArray::from(a)),
                ],
            )
            .map_err(|source| DataError::Arrow {
                path: "arithmetic".into(),
                at: crate::error::Location::Row(start),
                source,
            })
        }))
    }

    /// The problems as an in-memory [`Dataset`] named `arithmetic`.
    pub fn dataset(&self) -> Result<Dataset> {
        let batches = self
            .batches(crate::dataset::DEFAULT_CHUNK_ROWS)?
            .collect::<Result<Vec<_>>>()?;
        Dataset::from_batches(
            "arithmetic",
            batches,
            "prompt",
            crate::dataset::DEFAULT_CHUNK_ROWS,
        )
    }
}
