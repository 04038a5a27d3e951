//! [`Dataset`]: the opened files (shards), cut into chunks that are read one at a time.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufRead, BufReader, Read, Seek, SeekFrom};
use std::path::{Path, PathBuf};
use std::sync::Arc;

use arrow::array::RecordBatch;
use arrow::datatypes::{Schema, SchemaRef};
use parquet::arrow::arrow_reader::{
    ArrowReaderMetadata, ArrowReaderOptions, ParquetRecordBatchReaderBuilder, RowSelection,
    RowSelector,
};
use parquet::file::metadata::PageIndexPolicy;

use crate::convert::{self, BatchCtx, Names, Numbering, PromptKind};
use crate::error::{DataError, Location, Result, io_err, show};
use crate::format::{self, Compression, Format};
use crate::rng::SeededRng;
use crate::sample::{Prompt, Sample};

/// Rows per chunk (the unit read from disk) unless [`OpenOptions::chunk_rows`] says otherwise.
pub const DEFAULT_CHUNK_ROWS: usize = 4096;

/// JSONL lines parsed at open to find the columns.
const JSONL_SCHEMA_LINES: usize = 100;

/// How to open files.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Force a format instead of telling it from each file's extension.
    pub format: Option<Format>,
    /// The prompt column (`prompt` by default).
    pub prompt_field: String,
    /// Rows per chunk, the unit of reading: a Parquet row group is read in pieces of at most this
    /// many rows; JSONL and CSV are cut every this many rows. Arrow IPC files are read by record
    /// batch (a batch is one chunk, whatever its size).
    pub chunk_rows: usize,
}

impl Default for OpenOptions {
    fn default() -> Self {
        OpenOptions {
            format: None,
            prompt_field: "prompt".to_string(),
            chunk_rows: DEFAULT_CHUNK_ROWS,
        }
    }
}

#[derive(Debug)]
enum ShardKind {
    Parquet(ArrowReaderMetadata),
    IpcFile,
    /// Uncompressed JSONL, read from byte offsets found by one scan at open.
    Jsonl,
    /// Held in memory: CSV, Arrow IPC streams, in-memory (synthetic) data.
    Batches(Vec<RecordBatch>),
    /// Compressed JSONL, decompressed into memory at open: (1-based line, text).
    Lines(Vec<(u64, String)>),
}

#[derive(Debug)]
struct Shard {
    path: PathBuf,
    kind: ShardKind,
    /// Arrow schema (for JSONL: inferred from the first lines).
    schema: SchemaRef,
    prompt_kind: PromptKind,
    numbering: Numbering,
    rows: u64,
}

/// A shard and its parts, each with its first row and row count.
type OpenedShard = (Shard, Vec<(Part, u64, u64)>);

#[derive(Debug, Clone, Copy)]
enum Part {
    Parquet { row_group: usize, offset: usize },
    IpcBatch { batch: usize },
    JsonlBytes { offset: u64, line: u64 },
    Batch { batch: usize, offset: usize },
    Lines { start: usize },
}

/// A run of consecutive rows of one shard, read in one go.
#[derive(Debug, Clone, Copy)]
pub(crate) struct Chunk {
    shard: usize,
    part: Part,
    /// Row in its file of the chunk's first row.
    file_row: u64,
    /// Dataset index of the chunk's first row.
    pub(crate) global: u64,
    /// Rows in the chunk.
    pub(crate) rows: u64,
}

#[derive(Debug)]
struct Inner {
    shards: Vec<Shard>,
    prompt_field: String,
}

/// A dataset: one or more files (shards) read as one table of prompts, or a split of it.
///
/// Opening reads metadata only (Parquet footers, Arrow IPC batch lengths, one line-count scan
/// of an uncompressed JSONL file); rows are read a chunk at a time when a
/// [`SampleStream`](crate::SampleStream) asks for them. CSV files, Arrow IPC *streams* and
/// compressed JSONL cannot be read from the middle and are held in memory (as Arrow batches or
/// text lines). Cloning is cheap (shared).
#[derive(Debug, Clone)]
pub struct Dataset {
    inner: Arc<Inner>,
    chunks: Arc<Vec<Chunk>>,
    /// Bit set over dataset indices of the rows in this split; `None` = every row of `chunks`.
    members: Option<Arc<Vec<u64>>>,
    len: u64,
    name: String,
}

fn parquet_err(path: &Path) -> impl Fn(parquet::errors::ParquetError) -> DataError + '_ {
    move |source| DataError::Parquet {
        path: path.to_path_buf(),
        source,
    }
}

fn arrow_err(path: &Path, at: Location) -> impl Fn(arrow::error::ArrowError) -> DataError + '_ {
    move |source| DataError::Arrow {
        path: path.to_path_buf(),
        at,
        source,
    }
}

fn check_prompt(path: &Path, schema: &Schema, prompt_field: &str) -> Result<PromptKind> {
    match schema.field_with_name(prompt_field) {
        Ok(f) => convert::prompt_kind(path, prompt_field, f.data_type()),
        Err(_) => Err(DataError::NoPromptColumn {
            path: path.to_path_buf(),
            column: prompt_field.to_string(),
            found: schema.fields().iter().map(|f| f.name().clone()).collect(),
        }),
    }
}

fn open_file(path: &Path) -> Result<File> {
    File::open(path).map_err(|e| io_err(path, e))
}

fn open_parquet(path: &Path, prompt_field: &str) -> Result<OpenedShard> {
    let file = open_file(path)?;
    let options = ArrowReaderOptions::new().with_page_index_policy(PageIndexPolicy::Optional);
    let meta = ArrowReaderMetadata::load(&file, options).map_err(parquet_err(path))?;
    let schema = meta.schema().clone();
    let prompt_kind = check_prompt(path, &schema, prompt_field)?;
    let mut parts = Vec::new();
    let mut file_row = 0u64;
    for (rg, g) in meta.metadata().row_groups().iter().enumerate() {
        let n = u64::try_from(g.num_rows()).unwrap_or(0);
        parts.push((
            Part::Parquet {
                row_group: rg,
                offset: 0,
            },
            file_row,
            n,
        ));
        file_row += n;
    }
    Ok((
        Shard {
            path: path.to_path_buf(),
            kind: ShardKind::Parquet(meta),
            schema,
            prompt_kind,
            numbering: Numbering::Rows,
            rows: file_row,
        },
        parts,
    ))
}

fn is_ipc_file(path: &Path) -> Result<bool> {
    let mut head = [0u8; 6];
    let mut f = open_file(path)?;
    let n = f.read(&mut head).map_err(|e| io_err(path, e))?;
    if &head[..n.min(4)] == b"FEA1" {
        return Err(DataError::InvalidConfig(format!(
            "{}: Feather v1 is not supported; re-save it as Feather v2 / Arrow IPC",
            show(path)
        )));
    }
    Ok(&head[..n] == b"ARROW1")
}

fn open_ipc(path: &Path, prompt_field: &str) -> Result<OpenedShard> {
    let at = Location::Schema;
    let mut parts = Vec::new();
    let mut file_row = 0u64;
    let (kind, schema) = if is_ipc_file(path)? {
        let mut reader = arrow::ipc::reader::FileReader::try_new_buffered(open_file(path)?, None)
            .map_err(arrow_err(path, at))?;
        let schema = reader.schema();
        check_prompt(path, &schema, prompt_field)?;
        // One pass to learn batch lengths (one batch in memory at a time).
        for b in 0..reader.num_batches() {
            reader.set_index(b).map_err(arrow_err(path, at))?;
            let n = match reader.next() {
                Some(batch) => batch
                    .map_err(arrow_err(path, Location::Row(file_row)))?
                    .num_rows(),
                None => 0,
            } as u64;
            if n > 0 {
                parts.push((Part::IpcBatch { batch: b }, file_row, n));
            }
            file_row += n;
        }
        (ShardKind::IpcFile, schema)
    } else {
        let reader = arrow::ipc::reader::StreamReader::try_new_buffered(open_file(path)?, None)
            .map_err(arrow_err(path, at))?;
        let schema = reader.schema();
        check_prompt(path, &schema, prompt_field)?;
        let mut batches = Vec::new();
        for batch in reader {
            batches.push(batch.map_err(arrow_err(path, Location::Row(file_row)))?);
            file_row += batches.last().map_or(0, |b| b.num_rows() as u64);
        }
        (ShardKind::Batches(batches), schema)
    };
    let prompt_kind = check_prompt(path, &schema, prompt_field)?;
    if let ShardKind::Batches(batches) = &kind {
        parts = batch_parts(batches);
    }
    Ok((
        Shard {
            path: path.to_path_buf(),
            kind,
            schema,
            prompt_kind,
            numbering: Numbering::Rows,
            rows: file_row,
        },
        parts,
    ))
}

fn batch_parts(batches: &[RecordBatch]) -> Vec<(Part, u64, u64)> {
    let mut parts = Vec::new();
    let mut file_row = 0u64;
    for (b, batch) in batches.iter().enumerate() {
        let n = batch.num_rows() as u64;
        if n > 0 {
            parts.push((
                Part::Batch {
                    batch: b,
                    offset: 0,
                },
                file_row,
                n,
            ));
        }
        file_row += n;
    }
    parts
}

fn open_csv(path: &Path, prompt_field: &str, chunk_rows: usize) -> Result<OpenedShard> {
    use arrow::csv::reader::{Format as CsvFormat, ReaderBuilder};
    let at = Location::Schema;
    let (schema, _) = CsvFormat::default()
        .with_header(true)
        .infer_schema(BufReader::new(open_file(path)?), Some(1000))
        .map_err(arrow_err(path, at))?;
    let schema = Arc::new(schema);
    let prompt_kind = check_prompt(path, &schema, prompt_field)?;
    let reader = ReaderBuilder::new(schema.clone())
        .with_header(true)
        .with_batch_size(chunk_rows)
        .build(BufReader::new(open_file(path)?))
        .map_err(arrow_err(path, at))?;
    let mut batches = Vec::new();
    let mut rows = 0u64;
    for batch in reader {
        let batch = batch.map_err(arrow_err(path, Numbering::Csv.at(rows)))?;
        rows += batch.num_rows() as u64;
        batches.push(batch);
    }
    let parts = batch_parts(&batches);
    Ok((
        Shard {
            path: path.to_path_buf(),
            kind: ShardKind::Batches(batches),
            schema,
            prompt_kind,
            numbering: Numbering::Csv,
            rows,
        },
        parts,
    ))
}

/// Columns of the first JSONL lines: an Arrow schema (for display) and a presence check.
fn jsonl_schema(path: &Path, first: &[(u64, String)], prompt_field: &str) -> Result<SchemaRef> {
    let mut values = Vec::with_capacity(first.len());
    for (line, text) in first {
        let v: serde_json::Value =
            serde_json::from_str(text).map_err(|e| DataError::MalformedJson {
                path: path.to_path_buf(),
                line: *line,
                message: e.to_string(),
            })?;
        if !v.is_object() {
            return Err(DataError::MalformedJson {
                path: path.to_path_buf(),
                line: *line,
                message: "expected a JSON object".to_string(),
            });
        }
        values.push(v);
    }
    // The schema is for display and column checks: rows are converted one by one, so a key
    // whose type differs between lines (text and conversation prompts mixed) is fine; it then
    // shows the first line's type.
    let schema = match arrow::json::reader::infer_json_schema_from_iterator(values.iter().map(Ok)) {
        Ok(schema) => schema,
        Err(_) => {
            let mut fields: Vec<arrow::datatypes::FieldRef> = Vec::new();
            for v in &values {
                if let Ok(one) =
                    arrow::json::reader::infer_json_schema_from_iterator(std::iter::once(Ok(v)))
                {
                    for f in one.fields() {
                        if !fields.iter().any(|g| g.name() == f.name()) {
                            fields.push(f.clone());
                        }
                    }
                }
            }
            Schema::new(fields)
        }
    };
    if schema.field_with_name(prompt_field).is_err() && !first.is_empty() {
        let mut found: Vec<String> = schema.fields().iter().map(|f| f.name().clone()).collect();
        found.sort();
        return Err(DataError::NoPromptColumn {
            path: path.to_path_buf(),
            column: prompt_field.to_string(),
            found,
        });
    }
    Ok(Arc::new(schema))
}

fn open_jsonl(
    path: &Path,
    compression: Compression,
    prompt_field: &str,
    chunk_rows: usize,
) -> Result<OpenedShard> {
    let file = open_file(path)?;
    let reader: Box<dyn BufRead> = match compression {
        Compression::None => Box::new(BufReader::with_capacity(1 << 20, file)),
        Compression::Gzip => Box::new(BufReader::new(flate2::read::MultiGzDecoder::new(file))),
        Compression::Zstd => Box::new(BufReader::new(
            zstd::stream::read::Decoder::new(file).map_err(|e| io_err(path, e))?,
        )),
    };
    let keep_all = compression != Compression::None;
    let mut lines = Vec::new();
    let mut first = Vec::new();
    let mut parts = Vec::new();
    let mut buf = Vec::new();
    let mut reader = reader;
    let (mut offset, mut line, mut rows) = (0u64, 0u64, 0u64);
    let mut in_chunk = 0usize;
    loop {
        buf.clear();
        let n = reader
            .read_until(b'\n', &mut buf)
            .map_err(|e| io_err(path, e))?;
        if n == 0 {
            break;
        }
        line += 1;
        let start = offset;
        offset += n as u64;
        if buf.iter().all(u8::is_ascii_whitespace) {
            continue;
        }
        if !keep_all && in_chunk == 0 {
            parts.push((
                Part::JsonlBytes {
                    offset: start,
                    line,
                },
                rows,
                0u64,
            ));
        }
        if first.len() < JSONL_SCHEMA_LINES || keep_all {
            let text = String::from_utf8(std::mem::take(&mut buf)).map_err(|_| {
                DataError::MalformedJson {
                    path: path.to_path_buf(),
                    line,
                    message: "not UTF-8".to_string(),
                }
            })?;
            if first.len() < JSONL_SCHEMA_LINES {
                first.push((line, text.clone()));
            }
            if keep_all {
                lines.push((line, text));
            }
        }
        rows += 1;
        if !keep_all {
            in_chunk += 1;
            if let Some(p) = parts.last_mut() {
                p.2 += 1;
            }
            if in_chunk == chunk_rows {
                in_chunk = 0;
            }
        }
    }
    let schema = jsonl_schema(path, &first, prompt_field)?;
    let kind = if keep_all {
        parts = (0..lines.len())
            .step_by(chunk_rows)
            .map(|s| {
                (
                    Part::Lines { start: s },
                    s as u64,
                    (lines.len() - s).min(chunk_rows) as u64,
                )
            })
            .collect();
        ShardKind::Lines(lines)
    } else {
        ShardKind::Jsonl
    };
    Ok((
        Shard {
            path: path.to_path_buf(),
            kind,
            schema,
            prompt_kind: PromptKind::Text,
            numbering: Numbering::Rows,
            rows,
        },
        parts,
    ))
}

impl Dataset {
    /// Open files, directories or globs (`data/train-*.parquet`) as one dataset. Shards are read
    /// in sorted path order; sample indices run across them.
    pub fn open<S: AsRef<str>>(paths: &[S], options: &OpenOptions) -> Result<Dataset> {
        if options.chunk_rows == 0 {
            return Err(DataError::InvalidConfig("chunk_rows must be >= 1".into()));
        }
        if paths.is_empty() {
            return Err(DataError::InvalidConfig("no data path given".into()));
        }
        let files = format::resolve_paths(paths, options.format)?;
        let mut shards = Vec::with_capacity(files.len());
        let mut parts_per_shard = Vec::with_capacity(files.len());
        for path in &files {
            let (fmt, compression) = format::detect(path, options.format)?;
            let pf = options.prompt_field.as_str();
            let (shard, parts) = match fmt {
                Format::Parquet => open_parquet(path, pf)?,
                Format::Arrow => open_ipc(path, pf)?,
                Format::Jsonl => open_jsonl(path, compression, pf, options.chunk_rows)?,
                Format::Csv => open_csv(path, pf, options.chunk_rows)?,
            };
            shards.push(shard);
            parts_per_shard.push(parts);
        }
        let name = match files.as_slice() {
            [one] => show(one),
            _ => paths
                .iter()
                .map(|p| p.as_ref().to_string())
                .collect::<Vec<_>>()
                .join(", "),
        };
        Self::build(
            shards,
            parts_per_shard,
            &options.prompt_field,
            options.chunk_rows,
            name,
        )
    }

    /// A dataset held in memory, from Arrow record batches (e.g. the
    /// [`arithmetic`](crate::synth) data). `name` stands for the file in messages.
    pub fn from_batches(
        name: &str,
        batches: Vec<RecordBatch>,
        prompt_field: &str,
        chunk_rows: usize,
    ) -> Result<Dataset> {
        let path = PathBuf::from(name);
        let Some(first) = batches.first() else {
            return Err(DataError::EmptyDataset {
                what: name.to_string(),
            });
        };
        let schema = first.schema();
        let prompt_kind = check_prompt(&path, &schema, prompt_field)?;
        let parts = batch_parts(&batches);
        let rows = batches.iter().map(|b| b.num_rows() as u64).sum();
        let shard = Shard {
            path,
            kind: ShardKind::Batches(batches),
            schema,
            prompt_kind,
            numbering: Numbering::Rows,
            rows,
        };
        Self::build(
            vec![shard],
            vec![parts],
            prompt_field,
            chunk_rows.max(1),
            name.to_string(),
        )
    }

    fn build(
        shards: Vec<Shard>,
        parts_per_shard: Vec<Vec<(Part, u64, u64)>>,
        prompt_field: &str,
        chunk_rows: usize,
        name: String,
    ) -> Result<Dataset> {
        let mut chunks = Vec::new();
        let mut global = 0u64;
        for (s, parts) in parts_per_shard.into_iter().enumerate() {
            for (part, file_row, rows) in parts {
                // Split Parquet row groups and in-memory batches into chunk_rows pieces.
                let split = matches!(part, Part::Parquet { .. } | Part::Batch { .. });
                let step = if split {
                    chunk_rows as u64
                } else {
                    rows.max(1)
                };
                let mut off = 0u64;
                while off < rows {
                    let n = step.min(rows - off);
                    let part = match part {
                        Part::Parquet { row_group, .. } => Part::Parquet {
                            row_group,
                            offset: off as usize,
                        },
                        Part::Batch { batch, .. } => Part::Batch {
                            batch,
                            offset: off as usize,
                        },
                        other => other,
                    };
                    chunks.push(Chunk {
                        shard: s,
                        part,
                        file_row: file_row + off,
                        global: global + file_row + off,
                        rows: n,
                    });
                    off += n;
                }
            }
            global += shards[s].rows;
        }
        if global == 0 {
            return Err(DataError::EmptyDataset { what: name });
        }
        Ok(Dataset {
            inner: Arc::new(Inner {
                shards,
                prompt_field: prompt_field.to_string(),
            }),
            chunks: Arc::new(chunks),
            members: None,
            len: global,
            name,
        })
    }

    /// A dataset of no rows with a text `prompt_field` column: the placeholder of a trainer
    /// built without data files, whose rows are given later (the trainer's `fit` with a
    /// dataset). Nothing can be streamed from it.
    pub fn empty(prompt_field: &str) -> Dataset {
        use arrow::datatypes::{DataType, Field};
        let schema = Arc::new(Schema::new(vec![Field::new(
            prompt_field,
            DataType::Utf8,
            true,
        )]));
        let shard = Shard {
            path: PathBuf::from("(no data)"),
            kind: ShardKind::Batches(vec![RecordBatch::new_empty(schema.clone())]),
            schema,
            prompt_kind: PromptKind::Text,
            numbering: Numbering::Rows,
            rows: 0,
        };
        Dataset {
            inner: Arc::new(Inner {
                shards: vec![shard],
                prompt_field: prompt_field.to_string(),
            }),
            chunks: Arc::new(Vec::new()),
            members: None,
            len: 0,
            name: "(no data)".into(),
        }
    }

    /// `rows` rows whose `prompt_field` is a conversation of one empty user message: TRL's
    /// placeholder dataset for an environment that owns its data (its `reset` gives each
    /// episode its prompt).
    pub fn empty_conversations(prompt_field: &str, rows: usize) -> Result<Dataset> {
        let name = "(empty prompts)";
        let line = serde_json::json!({ prompt_field: [{ "role": "user", "content": "" }] });
        let schema =
            arrow::json::reader::infer_json_schema_from_iterator(std::iter::once(Ok(line.clone())))
                .map_err(|source| DataError::Arrow {
                    path: PathBuf::from(name),
                    at: Location::Row(0),
                    source,
                })?;
        let text = format!("{line}\n").repeat(rows);
        let batches = arrow::json::ReaderBuilder::new(Arc::new(schema))
            .with_batch_size(rows.max(1))
            .build(std::io::Cursor::new(text))
            .and_then(|r| r.collect::<std::result::Result<Vec<_>, _>>())
            .map_err(|source| DataError::Arrow {
                path: PathBuf::from(name),
                at: Location::Row(0),
                source,
            })?;
        Self::from_batches(name, batches, prompt_field, rows.max(1))
    }

    /// Number of samples (rows) in this dataset or split.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Never true for an opened dataset (opening an empty one fails); kept for clippy's sake.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The files, in the order their rows are numbered.
    pub fn files(&self) -> Vec<&Path> {
        self.inner.shards.iter().map(|s| s.path.as_path()).collect()
    }

    /// A name for messages: the file, or the paths given.
    pub fn name(&self) -> &str {
        &self.name
    }

    /// The prompt column's name.
    pub fn prompt_field(&self) -> &str {
        &self.inner.prompt_field
    }

    /// The Arrow schema of the first file (JSONL: inferred from its first 100 lines).
    pub fn schema(&self) -> SchemaRef {
        self.inner.shards[0].schema.clone()
    }

    /// Rows of each file: `(path, rows)`.
    pub fn file_rows(&self) -> Vec<(&Path, u64)> {
        self.inner
            .shards
            .iter()
            .map(|s| (s.path.as_path(), s.rows))
            .collect()
    }

    /// Whether every file's prompt column holds conversations (lists of `{role, content}`
    /// messages) rather than text. For JSONL, as its schema shows them (from its first 100
    /// lines).
    pub fn conversation_prompts(&self) -> bool {
        let pf = self.inner.prompt_field.as_str();
        self.inner.shards.iter().all(|s| {
            s.schema.field_with_name(pf).is_ok_and(|f| {
                convert::prompt_kind(&s.path, pf, f.data_type())
                    .is_ok_and(|k| k == PromptKind::Conversation)
            })
        })
    }

    /// Check that every file has column `column`, e.g. the `answer_field` a supervised reward
    /// (`needed_by`) reads. For JSONL, "has" means one of its first 100 lines has the key.
    pub fn require_column(&self, column: &str, needed_by: &str) -> Result<()> {
        for s in &self.inner.shards {
            if s.schema.field_with_name(column).is_err() && column != self.inner.prompt_field {
                return Err(DataError::MissingColumn {
                    path: s.path.clone(),
                    column: column.to_string(),
                    needed_by: needed_by.to_string(),
                    found: s.schema.fields().iter().map(|f| f.name().clone()).collect(),
                });
            }
        }
        Ok(())
    }

    fn is_member(&self, global: u64) -> bool {
        match &self.members {
            None => true,
            Some(bits) => bits
                .get((global / 64) as usize)
                .is_some_and(|w| w >> (global % 64) & 1 == 1),
        }
    }

    pub(crate) fn num_chunks(&self) -> usize {
        self.chunks.len()
    }

    /// Rows of this split in each chunk.
    pub(crate) fn chunk_counts(&self) -> Vec<u64> {
        match &self.members {
            None => self.chunks.iter().map(|c| c.rows).collect(),
            Some(_) => self
                .chunks
                .iter()
                .map(|c| {
                    (c.global..c.global + c.rows)
                        .filter(|&g| self.is_member(g))
                        .count() as u64
                })
                .collect(),
        }
    }

    /// Keep the first `max` samples (in file order); `None` or a larger `max` keeps all.
    pub fn take(&self, max: Option<u64>) -> Result<Dataset> {
        let Some(max) = max else {
            return Ok(self.clone());
        };
        if max == 0 {
            return Err(DataError::InvalidConfig("max_samples must be >= 1".into()));
        }
        if max >= self.len {
            return Ok(self.clone());
        }
        let counts = self.chunk_counts();
        let mut chunks = Vec::new();
        let mut kept = 0u64;
        for (c, &n) in self.chunks.iter().zip(&counts) {
            if kept + n <= max {
                chunks.push(*c);
                kept += n;
                if kept == max {
                    break;
                }
            } else {
                // Cut this chunk after the (max - kept)-th member row.
                let mut need = max - kept;
                let mut rows = 0u64;
                for g in c.global..c.global + c.rows {
                    rows += 1;
                    if self.is_member(g) {
                        need -= 1;
                        if need == 0 {
                            break;
                        }
                    }
                }
                chunks.push(Chunk { rows, ..*c });
                kept = max;
                break;
            }
        }
        Ok(Dataset {
            chunks: Arc::new(chunks),
            len: kept,
            ..self.clone()
        })
    }

    /// This dataset without the rows whose index ([`Sample::index`]) is in `rows` (indices it
    /// does not hold are ignored). Keeps a bit set of its rows: `len / 8` bytes.
    pub fn without_rows(&self, rows: &HashSet<u64>) -> Dataset {
        let total = self.chunks.last().map_or(0, |c| c.global + c.rows);
        let mut bits = match &self.members {
            Some(m) => m.as_ref().clone(),
            None => {
                let mut b = vec![0u64; total.div_ceil(64) as usize];
                for c in self.chunks.iter() {
                    for g in c.global..c.global + c.rows {
                        b[(g / 64) as usize] |= 1 << (g % 64);
                    }
                }
                b
            }
        };
        let mut len = self.len;
        for &g in rows {
            if let Some(w) = bits.get_mut((g / 64) as usize)
                && *w >> (g % 64) & 1 == 1
            {
                *w &= !(1 << (g % 64));
                len -= 1;
            }
        }
        Dataset {
            members: Some(Arc::new(bits)),
            len,
            ..self.clone()
        }
    }

    /// Split off an evaluation set of `round(fraction · len)` samples (at least 1, and at least
    /// 1 left for training), chosen by `seed` (same seed → same split on any machine). Returns
    /// `(train, eval)`. Each keeps a bit set of its rows: `len / 8` bytes.
    pub fn split_eval(&self, fraction: f64, seed: u64) -> Result<(Dataset, Dataset)> {
        if !(fraction > 0.0 && fraction < 1.0) {
            return Err(DataError::InvalidConfig(format!(
                "eval fraction {fraction} must be in (0, 1)"
            )));
        }
        if self.members.is_some() {
            return Err(DataError::InvalidConfig(
                "split_eval on a dataset that is already a split".into(),
            ));
        }
        if self.len < 2 {
            return Err(DataError::InvalidConfig(format!(
                "{}: {} row(s) cannot be split into train and eval",
                self.name, self.len
            )));
        }
        let n = self.len;
        let k = ((fraction * n as f64).round() as u64).clamp(1, n - 1);
        // Floyd's sampling of k distinct indices in [0, n): O(k) memory, portable RNG.
        let mut rng = SeededRng::new(crate::rng::mix(seed, 0x0005_e117_e7a1_u64, 0));
        let mut picked = HashSet::with_capacity(k as usize);
        for j in (n - k)..n {
            let t = rng.below(j + 1);
            if !picked.insert(t) {
                picked.insert(j);
            }
        }
        // Rows of this dataset are the chunks' ranges; index i (0-based in order) → global.
        let words = (self.chunks.last().map_or(0, |c| c.global + c.rows)).div_ceil(64) as usize;
        let mut train = vec![0u64; words];
        let mut eval = vec![0u64; words];
        let mut i = 0u64;
        for c in self.chunks.iter() {
            for g in c.global..c.global + c.rows {
                let bits = if picked.contains(&i) {
                    &mut eval
                } else {
                    &mut train
                };
                bits[(g / 64) as usize] |= 1 << (g % 64);
                i += 1;
            }
        }
        let mk = |bits: Vec<u64>, len: u64, suffix: &str| Dataset {
            members: Some(Arc::new(bits)),
            len,
            name: format!("{} ({suffix})", self.name),
            ..self.clone()
        };
        Ok((mk(train, n - k, "train split"), mk(eval, k, "eval split")))
    }

    /// Read chunk `c`: every row, converted (or the error for that row). Rows outside this
    /// split are left out.
    pub(crate) fn read_chunk_rows(&self, c: usize) -> Result<Vec<Result<Sample>>> {
        let chunk = self.chunks[c];
        let shard = &self.inner.shards[chunk.shard];
        let path = shard.path.as_path();
        let pf = self.inner.prompt_field.as_str();
        let mut names = Names::default();
        let ctx = |file_row: u64, global: u64| BatchCtx {
            path,
            prompt_field: pf,
            kind: shard.prompt_kind,
            numbering: shard.numbering,
            file_row,
            global,
        };
        let rows = chunk.rows as usize;
        let mut out = Vec::with_capacity(rows);
        match (&shard.kind, chunk.part) {
            (ShardKind::Parquet(meta), Part::Parquet { row_group, offset }) => {
                let rg_rows =
                    usize::try_from(meta.metadata().row_group(row_group).num_rows()).unwrap_or(0);
                let mut sel = Vec::with_capacity(3);
                if offset > 0 {
                    sel.push(RowSelector::skip(offset));
                }
                sel.push(RowSelector::select(rows));
                let rest = rg_rows.saturating_sub(offset + rows);
                if rest > 0 {
                    sel.push(RowSelector::skip(rest));
                }
                let reader = ParquetRecordBatchReaderBuilder::new_with_metadata(
                    open_file(path)?,
                    meta.clone(),
                )
                .with_row_groups(vec![row_group])
                .with_row_selection(RowSelection::from(sel))
                .with_batch_size(rows)
                .build()
                .map_err(parquet_err(path))?;
                let mut file_row = chunk.file_row;
                let mut global = chunk.global;
                for batch in reader {
                    let batch = batch.map_err(arrow_err(path, Location::Row(file_row)))?;
                    let n = batch.num_rows() as u64;
                    out.extend(convert::batch_rows(
                        &batch,
                        &ctx(file_row, global),
                        &mut names,
                    )?);
                    file_row += n;
                    global += n;
                }
            }
            (ShardKind::IpcFile, Part::IpcBatch { batch }) => {
                let at = Location::Row(chunk.file_row);
                let mut reader =
                    arrow::ipc::reader::FileReader::try_new_buffered(open_file(path)?, None)
                        .map_err(arrow_err(path, at))?;
                reader.set_index(batch).map_err(arrow_err(path, at))?;
                if let Some(b) = reader.next() {
                    let b = b.map_err(arrow_err(path, at))?;
                    let b = b.slice(0, rows.min(b.num_rows()));
                    out.extend(convert::batch_rows(
                        &b,
                        &ctx(chunk.file_row, chunk.global),
                        &mut names,
                    )?);
                }
            }
            (ShardKind::Batches(batches), Part::Batch { batch, offset }) => {
                let b = &batches[batch];
                let b = b.slice(offset, rows.min(b.num_rows().saturating_sub(offset)));
                out.extend(convert::batch_rows(
                    &b,
                    &ctx(chunk.file_row, chunk.global),
                    &mut names,
                )?);
            }
            (ShardKind::Jsonl, Part::JsonlBytes { offset, line }) => {
                let mut file = open_file(path)?;
                file.seek(SeekFrom::Start(offset))
                    .map_err(|e| io_err(path, e))?;
                let mut reader = BufReader::with_capacity(1 << 16, file);
                let mut line = line;
                let mut buf = String::new();
                let mut global = chunk.global;
                while out.len() < rows {
                    buf.clear();
                    let n = reader.read_line(&mut buf).map_err(|e| match e.kind() {
                        std::io::ErrorKind::InvalidData => DataError::MalformedJson {
                            path: path.to_path_buf(),
                            line,
                            message: "not UTF-8".to_string(),
                        },
                        _ => io_err(path, e),
                    })?;
                    if n == 0 {
                        break;
                    }
                    if !buf.trim().is_empty() {
                        out.push(convert::json_line(path, line, &buf, pf, global, &mut names));
                        global += 1;
                    }
                    line += 1;
                }
            }
            (ShardKind::Lines(lines), Part::Lines { start }) => {
                for (i, (line, text)) in lines[start..].iter().take(rows).enumerate() {
                    out.push(convert::json_line(
                        path,
                        *line,
                        text,
                        pf,
                        chunk.global + i as u64,
                        &mut names,
                    ));
                }
            }
            _ => unreachable!("chunk part does not match its shard kind"),
        }
        if self.members.is_some() {
            let mut g = chunk.global;
            out.retain(|r| {
                let keep = self.is_member(g);
                g += 1;
                let _ = r;
                keep
            });
        }
        Ok(out)
    }

    /// Read chunk `c` as samples; the first bad row is the error.
    pub(crate) fn read_chunk(&self, c: usize) -> Result<Vec<Sample>> {
        self.read_chunk_rows(c)?.into_iter().collect()
    }

    /// The first `n` samples in file order (fails on the first bad row among them).
    pub fn head(&self, n: usize) -> Result<Vec<Sample>> {
        let mut out = Vec::with_capacity(n.min(self.len as usize));
        for c in 0..self.chunks.len() {
            if out.len() >= n {
                break;
            }
            for s in self.read_chunk_rows(c)? {
                if out.len() >= n {
                    break;
                }
                out.push(s?);
            }
        }
        Ok(out)
    }

    /// Read every row once, a chunk at a time, and report what is wrong for training: rows with
    /// a null/empty/ill-typed prompt or a broken conversation (the first `max_issues` of them),
    /// and nulls per column. Memory: one chunk.
    pub fn validate(&self, max_issues: usize) -> Result<Report> {
        let mut report = Report::default();
        for c in 0..self.chunks.len() {
            let rows = match self.read_chunk_rows(c) {
                Ok(rows) => rows,
                Err(e) => {
                    // A whole chunk failed (e.g. a type clash in the middle of a file).
                    report.bad_rows += self.chunks[c].rows;
                    if report.issues.len() < max_issues {
                        report.issues.push(e.to_string());
                    }
                    continue;
                }
            };
            for r in rows {
                report.rows += 1;
                match r {
                    Ok(s) => {
                        if let Prompt::Conversation(_) = s.prompt {
                            report.conversations += 1;
                        }
                        for (k, v) in &s.columns {
                            let e = report.nulls.entry(k.to_string()).or_insert(0);
                            if v.is_null() {
                                *e += 1;
                            }
                        }
                    }
                    Err(e) => {
                        report.bad_rows += 1;
                        if report.issues.len() < max_issues {
                            report.issues.push(e.to_string());
                        }
                    }
                }
            }
        }
        Ok(report)
    }
}

/// What [`Dataset::validate`] found.
#[derive(Debug, Clone, Default)]
pub struct Report {
    /// Rows read.
    pub rows: u64,
    /// Rows that cannot be trained on (bad prompt), all counted.
    pub bad_rows: u64,
    /// Rows whose prompt is a conversation.
    pub conversations: u64,
    /// The first problems, one line each.
    pub issues: Vec<String>,
    /// Null cells per non-prompt column (0 for columns without nulls).
    pub nulls: std::collections::BTreeMap<String, u64>,
}
