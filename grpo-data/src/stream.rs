//! [`SampleStream`]: epochs of seeded, block-shuffled samples in batches, resumable from a
//! [`Position`].

use serde::{Deserialize, Serialize};

use crate::dataset::Dataset;
use crate::error::{DataError, Result};
use crate::rng::{SeededRng, mix};
use crate::sample::Sample;

/// Rows held in memory for shuffling unless [`StreamConfig::shuffle_window`] says otherwise.
pub const DEFAULT_SHUFFLE_WINDOW: usize = 65_536;

/// How to walk a dataset.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct StreamConfig {
    /// Shuffle seed: the same seed gives the same order on any machine (TRL's `seed`).
    pub seed: u64,
    /// Shuffle (train) or read in file order (eval).
    pub shuffle: bool,
    /// Prompts per batch (≥ 1). Batches run across epoch boundaries; only the very last batch
    /// of a finite stream can be shorter.
    pub batch_size: usize,
    /// Passes over the data; `None` = endless.
    pub epochs: Option<u64>,
    /// Shuffle buffer in rows (≥ 1): chunks are taken in a seeded random order and grouped
    /// into windows of at least this many rows; each window is read and shuffled in memory.
    /// Memory ≈ (shuffle_window + one chunk) samples.
    pub shuffle_window: usize,
}

impl Default for StreamConfig {
    fn default() -> Self {
        StreamConfig {
            seed: 42,
            shuffle: true,
            batch_size: 8,
            epochs: Some(1),
            shuffle_window: DEFAULT_SHUFFLE_WINDOW,
        }
    }
}

impl StreamConfig {
    fn check(&self) -> Result<()> {
        if self.batch_size == 0 {
            return Err(DataError::InvalidConfig("batch_size must be >= 1".into()));
        }
        if self.shuffle_window == 0 {
            return Err(DataError::InvalidConfig(
                "shuffle_window must be >= 1".into(),
            ));
        }
        if self.epochs == Some(0) {
            return Err(DataError::InvalidConfig("epochs must be >= 1".into()));
        }
        Ok(())
    }
}

/// Where a stream is: what a checkpoint stores to continue with exactly the next sample.
///
/// The order of an epoch is a pure function of (`seed`, `epoch`, the dataset's chunking and
/// `shuffle_window`), so `epoch` and `index` are the whole state; the rest is there to refuse
/// resuming on a different dataset or configuration.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Position {
    /// 0-based epoch.
    pub epoch: u64,
    /// How many samples of this epoch were already handed out.
    pub index: u64,
    /// The shuffle seed.
    pub seed: u64,
    /// Whether the stream shuffles.
    pub shuffle: bool,
    /// The shuffle window, in rows.
    pub shuffle_window: u64,
    /// Samples per epoch of the dataset it was taken on.
    pub dataset_len: u64,
}

#[derive(Debug)]
struct Window {
    /// Index in the epoch of the window's first sample.
    start: u64,
    rows: u64,
    chunks: Vec<usize>,
}

/// An iterator of samples over epochs: seeded block shuffle, batching, resume.
///
/// # Shuffle and memory
///
/// Each epoch, the dataset's chunks (runs of ≤ `chunk_rows` consecutive rows: Parquet
/// row-group pieces read with a `RowSelection`, Arrow IPC record batches, JSONL line ranges)
/// are put in a seeded random order and grouped into windows of ≥ `shuffle_window` rows. A
/// window is read, shuffled with a seed derived from (seed, epoch, window) and handed out. Every
/// sample appears exactly once per epoch. Memory: one window of samples (`shuffle_window` +
/// at most one chunk of rows) plus a few bytes per chunk for the order: a 10 GB Parquet file is
/// never loaded whole.
#[derive(Debug)]
pub struct SampleStream {
    dataset: Dataset,
    cfg: StreamConfig,
    counts: Vec<u64>,
    epoch: u64,
    index: u64,
    windows: Vec<Window>,
    windows_epoch: Option<u64>,
    current: Option<usize>,
    buffer: std::vec::IntoIter<Sample>,
}

impl SampleStream {
    /// A stream from the start (epoch 0, index 0).
    pub fn new(dataset: Dataset, cfg: StreamConfig) -> Result<Self> {
        cfg.check()?;
        if dataset.is_empty() {
            return Err(DataError::EmptyDataset {
                what: dataset.name().to_string(),
            });
        }
        let counts = dataset.chunk_counts();
        Ok(SampleStream {
            dataset,
            cfg,
            counts,
            epoch: 0,
            index: 0,
            windows: Vec::new(),
            windows_epoch: None,
            current: None,
            buffer: Vec::new().into_iter(),
        })
    }

    /// A stream continuing at `position` (from [`SampleStream::position`] of an earlier run):
    /// the next sample is exactly the one the earlier stream would have given next.
    pub fn resume(dataset: Dataset, cfg: StreamConfig, position: Position) -> Result<Self> {
        let mut s = Self::new(dataset, cfg)?;
        let p = position;
        let mismatch = |what: &str, stored: String, now: String| {
            Err(DataError::PositionMismatch(format!(
                "the checkpoint's {what} is {stored} but this run's is {now}"
            )))
        };
        if p.seed != s.cfg.seed {
            return mismatch("seed", p.seed.to_string(), s.cfg.seed.to_string());
        }
        if p.shuffle != s.cfg.shuffle {
            return mismatch("shuffle", p.shuffle.to_string(), s.cfg.shuffle.to_string());
        }
        if p.shuffle_window != s.cfg.shuffle_window as u64 {
            return mismatch(
                "shuffle_window",
                p.shuffle_window.to_string(),
                s.cfg.shuffle_window.to_string(),
            );
        }
        if p.dataset_len != s.dataset.len() {
            return mismatch(
                "dataset length",
                p.dataset_len.to_string(),
                s.dataset.len().to_string(),
            );
        }
        if p.index > p.dataset_len {
            return Err(DataError::PositionMismatch(format!(
                "index {} is past the dataset length {}",
                p.index, p.dataset_len
            )));
        }
        s.epoch = p.epoch;
        s.index = p.index;
        Ok(s)
    }

    /// The current position, to store in a checkpoint.
    pub fn position(&self) -> Position {
        Position {
            epoch: self.epoch,
            index: self.index,
            seed: self.cfg.seed,
            shuffle: self.cfg.shuffle,
            shuffle_window: self.cfg.shuffle_window as u64,
            dataset_len: self.dataset.len(),
        }
    }

    /// Samples per epoch.
    pub fn epoch_len(&self) -> u64 {
        self.dataset.len()
    }

    /// The dataset walked.
    pub fn dataset(&self) -> &Dataset {
        &self.dataset
    }

    fn plan_epoch(&mut self) {
        if self.windows_epoch == Some(self.epoch) {
            return;
        }
        let mut order: Vec<usize> = (0..self.dataset.num_chunks())
            .filter(|&c| self.counts[c] > 0)
            .collect();
        if self.cfg.shuffle {
            SeededRng::new(mix(self.cfg.seed, self.epoch, 0)).shuffle(&mut order);
        }
        self.windows.clear();
        let mut start = 0u64;
        let mut cur = Window {
            start,
            rows: 0,
            chunks: Vec::new(),
        };
        for c in order {
            cur.rows += self.counts[c];
            cur.chunks.push(c);
            if cur.rows >= self.cfg.shuffle_window as u64 {
                start += cur.rows;
                let next = Window {
                    start,
                    rows: 0,
                    chunks: Vec::new(),
                };
                self.windows.push(std::mem::replace(&mut cur, next));
            }
        }
        if cur.rows > 0 {
            self.windows.push(cur);
        }
        self.windows_epoch = Some(self.epoch);
        self.current = None;
    }

    fn load_window(&mut self, w: usize) -> Result<()> {
        let window = &self.windows[w];
        let mut samples = Vec::with_capacity(window.rows as usize);
        for &c in &window.chunks {
            samples.extend(self.dataset.read_chunk(c)?);
        }
        if samples.len() as u64 != window.rows {
            return Err(DataError::PositionMismatch(format!(
                "{}: a chunk read {} rows where {} were counted at open (did a file change?)",
                self.dataset.name(),
                samples.len(),
                window.rows
            )));
        }
        if self.cfg.shuffle {
            SeededRng::new(mix(self.cfg.seed, self.epoch, w as u64 + 1)).shuffle(&mut samples);
        }
        let skip = (self.index - window.start) as usize;
        let mut it = samples.into_iter();
        if skip > 0 {
            it.nth(skip - 1);
        }
        self.buffer = it;
        self.current = Some(w);
        Ok(())
    }

    /// The next sample, `None` when the last epoch is done.
    pub fn next_sample(&mut self) -> Result<Option<Sample>> {
        loop {
            if self.index >= self.dataset.len() {
                if self.cfg.epochs.is_some_and(|e| self.epoch + 1 >= e) {
                    return Ok(None);
                }
                self.epoch += 1;
                self.index = 0;
            }
            if self.cfg.epochs.is_some_and(|e| self.epoch >= e) {
                return Ok(None);
            }
            self.plan_epoch();
            let w = self
                .windows
                .partition_point(|w| w.start + w.rows <= self.index);
            if self.current != Some(w) {
                self.load_window(w)?;
            }
            match self.buffer.next() {
                Some(s) => {
                    self.index += 1;
                    return Ok(Some(s));
                }
                None => {
                    // Window exhausted; the next loop turn moves on.
                    self.current = None;
                    if self
                        .windows
                        .get(w)
                        .is_none_or(|x| x.start + x.rows > self.index)
                    {
                        return Err(DataError::PositionMismatch(format!(
                            "{}: ran out of rows at epoch {} index {}",
                            self.dataset.name(),
                            self.epoch,
                            self.index
                        )));
                    }
                }
            }
        }
    }

    /// The next batch of up to `batch_size` samples, `None` when the stream is done.
    pub fn next_batch(&mut self) -> Result<Option<Vec<Sample>>> {
        let mut batch = Vec::with_capacity(self.cfg.batch_size);
        while batch.len() < self.cfg.batch_size {
            match self.next_sample()? {
                Some(s) => batch.push(s),
                None => break,
            }
        }
        Ok(if batch.is_empty() { None } else { Some(batch) })
    }
}

impl Iterator for SampleStream {
    type Item = Result<Sample>;
    fn next(&mut self) -> Option<Self::Item> {
        self.next_sample().transpose()
    }
}
