//! The one error type of this crate: [`DataError`].

use std::fmt;
use std::path::{Path, PathBuf};

/// Where in a file a problem sits.
///
/// Rows count from 0 (the first data row is row 0, as in Arrow and pandas); JSONL and CSV lines
/// count from 1, as an editor shows them (a CSV header is line 1).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Location {
    /// The file's schema (no particular row).
    Schema,
    /// A 0-based row of a Parquet or Arrow file.
    Row(u64),
    /// A 1-based line of a JSONL file.
    Line(u64),
    /// A 0-based data row of a CSV file and its 1-based line (the header is line 1).
    CsvRow {
        /// 0-based data row.
        row: u64,
        /// 1-based line of that row in the file (for a file without quoted newlines).
        line: u64,
    },
}

impl fmt::Display for Location {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            Location::Schema => write!(f, "schema"),
            Location::Row(r) => write!(f, "row {r}"),
            Location::Line(l) => write!(f, "line {l}"),
            Location::CsvRow { row, line } => write!(f, "row {row} (line {line})"),
        }
    }
}

pub(crate) fn show(p: &Path) -> String {
    p.display().to_string()
}

/// Everything that can go wrong reading or writing a dataset. Each message is one line naming the
/// file and, where there is one, the column and row or line to fix.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum DataError {
    /// A path (file, directory or glob) that matches nothing.
    #[error("{path}: no such file, directory or matching glob")]
    NotFound {
        /// The path or pattern as given.
        path: String,
    },
    /// A file whose format cannot be told from its name and no `format` was given.
    #[error(
        "{}: unknown data format `{ext}` (use .parquet, .arrow, .feather, .ipc, .jsonl, .jsonl.gz, .jsonl.zst, .csv, or set `format`)",
        show(path)
    )]
    UnknownExtension {
        /// The file.
        path: PathBuf,
        /// Its extension (empty when it has none).
        ext: String,
    },
    /// The prompt column is not in the file.
    #[error("{}: no prompt column `{column}` (columns found: {})", show(path), found.join(", "))]
    NoPromptColumn {
        /// The file.
        path: PathBuf,
        /// The expected column (`prompt_field`).
        column: String,
        /// The columns the file has.
        found: Vec<String>,
    },
    /// A column a reward needs (e.g. `answer_field`) is not in the dataset.
    #[error("{}: no column `{column}` needed by {needed_by} (columns found: {})", show(path), found.join(", "))]
    MissingColumn {
        /// The (first) file lacking it.
        path: PathBuf,
        /// The missing column.
        column: String,
        /// Who asked for it (e.g. a reward's name).
        needed_by: String,
        /// The columns the file has.
        found: Vec<String>,
    },
    /// The prompt column holds neither a string nor a conversation (list of `{role, content}`).
    #[error(
        "{}: prompt column `{column}` at {at} has type {found}; expected a string or a list of {{role, content}}",
        show(path)
    )]
    WrongPromptType {
        /// The file.
        path: PathBuf,
        /// The prompt column.
        column: String,
        /// Schema (Arrow) or the row/line (JSONL).
        at: Location,
        /// The type found.
        found: String,
    },
    /// A null (or missing) prompt.
    #[error("{}: null prompt in column `{column}` at {at}", show(path))]
    NullPrompt {
        /// The file.
        path: PathBuf,
        /// The prompt column.
        column: String,
        /// The row or line.
        at: Location,
    },
    /// An empty (or all-whitespace) prompt, or an empty conversation.
    #[error("{}: empty prompt in column `{column}` at {at}", show(path))]
    EmptyPrompt {
        /// The file.
        path: PathBuf,
        /// The prompt column.
        column: String,
        /// The row or line.
        at: Location,
    },
    /// A conversation message without a role or a content.
    #[error(
        "{}: conversation in column `{column}` at {at}, message {message}: no `{missing}`",
        show(path)
    )]
    ConversationEntry {
        /// The file.
        path: PathBuf,
        /// The prompt column.
        column: String,
        /// The row or line ([`Location::Schema`] when the struct type lacks the field).
        at: Location,
        /// 0-based index of the message in the conversation.
        message: usize,
        /// `role` or `content`.
        missing: &'static str,
    },
    /// A JSONL line that is not a JSON object.
    #[error("{}: malformed JSON at line {line}: {message}", show(path))]
    MalformedJson {
        /// The file.
        path: PathBuf,
        /// 1-based line.
        line: u64,
        /// What the JSON parser said.
        message: String,
    },
    /// A dataset (or a split of it) without a single row.
    #[error("{what}: empty dataset (0 rows)")]
    EmptyDataset {
        /// The file(s) or split.
        what: String,
    },
    /// An I/O error on a file.
    #[error("{}: {source}", show(path))]
    Io {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: std::io::Error,
    },
    /// An error from the Parquet reader or writer.
    #[error("{}: parquet: {}", show(path), one_line(&source.to_string()))]
    Parquet {
        /// The file.
        path: PathBuf,
        /// The cause.
        #[source]
        source: parquet::errors::ParquetError,
    },
    /// An error from an Arrow reader or writer (IPC, CSV, JSON), with where it happened.
    #[error("{}: {at}: {}", show(path), one_line(&source.to_string()))]
    Arrow {
        /// The file.
        path: PathBuf,
        /// Where (schema, or the first row/line of the block being read).
        at: Location,
        /// The cause.
        #[source]
        source: arrow::error::ArrowError,
    },
    /// A bad option (batch size 0, eval fraction outside (0, 1), ...).
    #[error("invalid data option: {0}")]
    InvalidConfig(String),
    /// A stored [`crate::Position`] that does not fit the dataset or seed it is resumed on.
    #[error("cannot resume data position: {0}")]
    PositionMismatch(String),
}

fn one_line(s: &str) -> String {
    s.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// `Result` with [`DataError`].
pub type Result<T, E = DataError> = std::result::Result<T, E>;

pub(crate) fn io_err(path: &Path, source: std::io::Error) -> DataError {
    if source.kind() == std::io::ErrorKind::NotFound {
        DataError::NotFound { path: show(path) }
    } else {
        DataError::Io {
            path: path.to_path_buf(),
            source,
        }
    }
}
