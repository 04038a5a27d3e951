//! File formats, told from extensions (or given), and resolving paths, directories and globs.

use std::fs;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::str::FromStr;

use serde::{Deserialize, Serialize};

use crate::error::{DataError, Result, io_err, show};

/// A dataset file format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    /// Apache Parquet (`.parquet`, `.pq`).
    Parquet,
    /// Arrow IPC, file or stream flavour (`.arrow`, `.feather`, `.ipc`); told apart by the
    /// `ARROW1` magic.
    Arrow,
    /// JSON lines, one object per line (`.jsonl`, `.ndjson`, plus `.gz` / `.zst`).
    Jsonl,
    /// Comma-separated values with a header row (`.csv`).
    Csv,
}

impl FromStr for Format {
    type Err = DataError;
    fn from_str(s: &str) -> Result<Self> {
        match s.to_ascii_lowercase().as_str() {
            "parquet" | "pq" => Ok(Format::Parquet),
            "arrow" | "ipc" | "feather" => Ok(Format::Arrow),
            "jsonl" | "ndjson" | "json" => Ok(Format::Jsonl),
            "csv" => Ok(Format::Csv),
            other => Err(DataError::InvalidConfig(format!(
                "format `{other}` (expected parquet, arrow, jsonl or csv)"
            ))),
        }
    }
}

/// Compression of a text file.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Compression {
    /// Plain.
    None,
    /// gzip (`.gz`).
    Gzip,
    /// Zstandard (`.zst`, `.zstd`).
    Zstd,
}

const EXTENSIONS: &[(&str, Format, Compression)] = &[
    (".parquet", Format::Parquet, Compression::None),
    (".pq", Format::Parquet, Compression::None),
    (".arrow", Format::Arrow, Compression::None),
    (".feather", Format::Arrow, Compression::None),
    (".ipc", Format::Arrow, Compression::None),
    (".jsonl", Format::Jsonl, Compression::None),
    (".ndjson", Format::Jsonl, Compression::None),
    (".jsonl.gz", Format::Jsonl, Compression::Gzip),
    (".ndjson.gz", Format::Jsonl, Compression::Gzip),
    (".jsonl.zst", Format::Jsonl, Compression::Zstd),
    (".jsonl.zstd", Format::Jsonl, Compression::Zstd),
    (".ndjson.zst", Format::Jsonl, Compression::Zstd),
    (".csv", Format::Csv, Compression::None),
];

/// The format a file name says, if any.
pub fn format_from_name(path: &Path) -> Option<(Format, Compression)> {
    let name = path.file_name()?.to_string_lossy().to_ascii_lowercase();
    EXTENSIONS
        .iter()
        .filter(|(ext, _, _)| name.ends_with(ext))
        .max_by_key(|(ext, _, _)| ext.len())
        .map(|&(_, f, c)| (f, c))
}

/// The format of `path`: `given` if set (compression then sniffed from the first bytes),
/// else from the extension.
pub(crate) fn detect(path: &Path, given: Option<Format>) -> Result<(Format, Compression)> {
    match given {
        Some(f) => {
            let c = if f == Format::Jsonl {
                sniff_compression(path)?
            } else {
                Compression::None
            };
            Ok((f, c))
        }
        None => format_from_name(path).ok_or_else(|| DataError::UnknownExtension {
            path: path.to_path_buf(),
            ext: extension(path),
        }),
    }
}

fn extension(path: &Path) -> String {
    let name = path
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    match name.find('.') {
        Some(i) if i > 0 => name[i..].to_string(),
        _ => String::new(),
    }
}

fn sniff_compression(path: &Path) -> Result<Compression> {
    let mut head = [0u8; 4];
    let mut f = fs::File::open(path).map_err(|e| io_err(path, e))?;
    let n = f.read(&mut head).map_err(|e| io_err(path, e))?;
    Ok(match &head[..n] {
        [0x1f, 0x8b, ..] => Compression::Gzip,
        [0x28, 0xb5, 0x2f, 0xfd] => Compression::Zstd,
        _ => Compression::None,
    })
}

/// Expand `specs` (files, directories, glob patterns) into a sorted, de-duplicated list of
/// files. A directory contributes every file below it whose extension names a format (that
/// format, when `format` is given); a glob contributes its matching files.
pub fn resolve_paths<S: AsRef<str>>(specs: &[S], format: Option<Format>) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    for spec in specs {
        let spec = spec.as_ref();
        let p = Path::new(spec);
        if p.is_dir() {
            let mut found = Vec::new();
            walk(p, format, &mut found)?;
            if found.is_empty() {
                return Err(DataError::NotFound {
                    path: format!("{spec} (a directory without data files)"),
                });
            }
            found.sort();
            out.extend(found);
        } else if p.is_file() {
            out.push(p.to_path_buf());
        } else if spec.contains(['*', '?', '[']) {
            let paths = glob::glob(spec)
                .map_err(|e| DataError::InvalidConfig(format!("glob `{spec}`: {}", e.msg)))?;
            let mut found = Vec::new();
            for entry in paths {
                let entry = entry.map_err(|e| {
                    let path = e.path().to_path_buf();
                    io_err(&path, std::io::Error::from(e))
                })?;
                if entry.is_file() {
                    found.push(entry);
                }
            }
            if found.is_empty() {
                return Err(DataError::NotFound {
                    path: spec.to_string(),
                });
            }
            found.sort();
            out.extend(found);
        } else {
            return Err(DataError::NotFound { path: show(p) });
        }
    }
    let mut seen = std::collections::HashSet::new();
    out.retain(|p| seen.insert(p.clone()));
    Ok(out)
}

fn walk(dir: &Path, format: Option<Format>, out: &mut Vec<PathBuf>) -> Result<()> {
    for entry in fs::read_dir(dir).map_err(|e| io_err(dir, e))? {
        let entry = entry.map_err(|e| io_err(dir, e))?;
        let path = entry.path();
        let name = entry.file_name();
        if name.to_string_lossy().starts_with('.') {
            continue;
        }
        if path.is_dir() {
            walk(&path, format, out)?;
        } else if let Some((f, _)) = format_from_name(&path)
            && format.is_none_or(|g| g == f)
        {
            out.push(path);
        }
    }
    Ok(())
}
