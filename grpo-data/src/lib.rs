//! Arrow in, prompts out: `grpo-data` turns Parquet, Arrow IPC, JSONL and CSV files into a
//! seeded, resumable, streaming source of prompts for GRPO training. It depends on no other
//! grpo-rs crate and not on candle.
//!
//! - [`Dataset`] opens files, directories or globs of shards as one table ([`Dataset::open`],
//!   or [`DataConfig::open`] for train/eval splits). One column holds the prompt (a string or
//!   a conversation of `{role, content}` messages); every other column rides along with its
//!   sample as a typed [`Value`], so a reward finds `answer`, `ground_truth`, `solution`, ... by
//!   name ([`Sample::get`]).
//! - [`SampleStream`] walks it in epochs with a seeded block shuffle, in batches of prompts;
//!   its [`Position`] (serde) goes into a checkpoint and [`SampleStream::resume`] continues
//!   with exactly the next sample. Memory is one shuffle window, never the whole file.
//! - [`packing::pack`] packs token sequences into fixed-length rows as TRL's `pack_dataset` does
//!   (best-fit decreasing, or wrapped); [`preference::extract_prompt`] splits preference rows
//!   without a prompt column as TRL does.
//! - [`synth::ArithmeticConfig`] makes the built-in `arithmetic` data; [`write_batches`]
//!   writes any format.
//!
//! Who feeds it: files on disk (or record batches). Who uses it: `grpo-cli`'s pipeline (the
//! `data` stage hands [`Sample`]s to the generator, rewards read their columns) and the
//! `grpo-cli data inspect | synth | bench` commands. Errors are one [`DataError`] enum whose
//! messages name the file and the column and row (or line) to fix.
//!
//! ```
//! use grpo_data::{Dataset, SampleStream, StreamConfig, synth::ArithmeticConfig};
//!
//! # fn main() -> Result<(), grpo_data::DataError> {
//! let dir = std::env::temp_dir().join(format!("grpo-data-doc-{}", std::process::id()));
//! std::fs::create_dir_all(&dir).ok();
//! let file = dir.join("math.jsonl");
//! let synth = ArithmeticConfig { n: 10, seed: 1, ..Default::default() };
//! synth.write(&file)?;
//!
//! let data = Dataset::open(&[file.to_string_lossy()], &Default::default())?;
//! data.require_column("answer", "accuracy reward")?;
//! let cfg = StreamConfig { seed: 7, batch_size: 4, epochs: Some(2), ..Default::default() };
//! let mut stream = SampleStream::new(data.clone(), cfg.clone())?;
//! let first = stream.next_batch()?.expect("10 rows");
//! assert_eq!(first.len(), 4);
//! assert!(first[0].get_text("answer").is_some());
//!
//! // Checkpoint the position, resume elsewhere: the same next sample.
//! let pos = stream.position();
//! let json = serde_json::to_string(&pos).expect("serialisable");
//! let mut resumed = SampleStream::resume(data, cfg, serde_json::from_str(&json).expect("ok"))?;
//! assert_eq!(stream.next_sample()?, resumed.next_sample()?);
//! # std::fs::remove_dir_all(&dir).ok();
//! # Ok(())
//! # }
//! ```
#![deny(missing_docs)]

mod config;
mod convert;
mod dataset;
mod error;
mod format;
pub mod packing;
pub mod preference;
pub mod rng;
mod sample;
mod stream;
pub mod synth;
mod write;

pub use config::{DataConfig, Splits};
pub use dataset::{DEFAULT_CHUNK_ROWS, Dataset, OpenOptions, Report};
pub use error::{DataError, Location, Result};
pub use format::{Compression, Format, format_from_name, resolve_paths};
pub use sample::{Message, Prompt, Sample, Value};
pub use stream::{DEFAULT_SHUFFLE_WINDOW, Position, SampleStream, StreamConfig};
pub use write::{WRITE_ROW_GROUP_ROWS, write_batches};

/// Re-exported so users can build record batches and schemas of the same Arrow version.
pub use arrow;
