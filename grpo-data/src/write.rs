//! Writing record batches in any of the supported formats (for `data synth` and tests).

use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use arrow::array::RecordBatch;
use arrow::datatypes::SchemaRef;
use parquet::arrow::ArrowWriter;
use parquet::basic::{Compression as PqCompression, ZstdLevel};
use parquet::file::properties::WriterProperties;

use crate::error::{DataError, Location, Result, io_err};
use crate::format::{Compression, Format, format_from_name};

/// Rows per Parquet row group written by [`write_batches`].
pub const WRITE_ROW_GROUP_ROWS: usize = 65_536;

/// Write `batches` (all of `schema`) to `path` in `format`, or the format its extension names
/// (`.parquet` zstd-compressed, `.arrow`/`.feather`/`.ipc` as an IPC file, `.jsonl` plain or
/// `.jsonl.gz`/`.jsonl.zst`, `.csv`). Batches are written as they come: memory is one batch.
/// Returns the number of rows written.
pub fn write_batches<I>(
    path: &Path,
    format: Option<Format>,
    schema: SchemaRef,
    batches: I,
) -> Result<u64>
where
    I: IntoIterator<Item = Result<RecordBatch>>,
{
    let (fmt, compression) = match (format, format_from_name(path)) {
        (Some(f), Some((g, c))) if f == g => (f, c),
        (Some(f), _) => (f, Compression::None),
        (None, Some(fc)) => fc,
        (None, None) => {
            return Err(DataError::UnknownExtension {
                path: path.to_path_buf(),
                ext: path
                    .extension()
                    .map(|e| format!(".{}", e.to_string_lossy()))
                    .unwrap_or_default(),
            });
        }
    };
    let file = File::create(path).map_err(|e| io_err(path, e))?;
    let mut rows = 0u64;
    let arrow_err = |rows: u64| {
        move |source| DataError::Arrow {
            path: path.to_path_buf(),
            at: Location::Row(rows),
            source,
        }
    };
    match fmt {
        Format::Parquet => {
            let props = WriterProperties::builder()
                .set_compression(PqCompression::ZSTD(ZstdLevel::default()))
                .set_max_row_group_row_count(Some(WRITE_ROW_GROUP_ROWS))
                .build();
            let pq = |source| DataError::Parquet {
                path: path.to_path_buf(),
                source,
            };
            let mut w = ArrowWriter::try_new(file, schema, Some(props)).map_err(pq)?;
            for b in batches {
                let b = b?;
                w.write(&b).map_err(pq)?;
                rows += b.num_rows() as u64;
            }
            w.close().map_err(pq)?;
        }
        Format::Arrow => {
            let mut w = arrow::ipc::writer::FileWriter::try_new_buffered(file, &schema)
                .map_err(arrow_err(0))?;
            for b in batches {
                let b = b?;
                w.write(&b).map_err(arrow_err(rows))?;
                rows += b.num_rows() as u64;
            }
            w.finish().map_err(arrow_err(rows))?;
        }
        Format::Csv => {
            let mut w = arrow::csv::Writer::new(BufWriter::new(file));
            for b in batches {
                let b = b?;
                w.write(&b).map_err(arrow_err(rows))?;
                rows += b.num_rows() as u64;
            }
            w.into_inner().flush().map_err(|e| io_err(path, e))?;
        }
        Format::Jsonl => {
            let out = BufWriter::new(file);
            match compression {
                Compression::None => {
                    let out = jsonl(out, batches, &mut rows, path)?;
                    finish_buf(out, path)?;
                }
                Compression::Gzip => {
                    let enc = flate2::write::GzEncoder::new(out, flate2::Compression::default());
                    let enc = jsonl(enc, batches, &mut rows, path)?;
                    finish_buf(enc.finish().map_err(|e| io_err(path, e))?, path)?;
                }
                Compression::Zstd => {
                    let enc =
                        zstd::stream::write::Encoder::new(out, 3).map_err(|e| io_err(path, e))?;
                    let enc = jsonl(enc, batches, &mut rows, path)?;
                    finish_buf(enc.finish().map_err(|e| io_err(path, e))?, path)?;
                }
            }
        }
    }
    Ok(rows)
}

fn finish_buf(mut w: BufWriter<File>, path: &Path) -> Result<()> {
    w.flush().map_err(|e| io_err(path, e))?;
    w.into_inner()
        .map_err(|e| io_err(path, e.into_error()))?
        .sync_all()
        .map_err(|e| io_err(path, e))
}

fn jsonl<W: Write, I>(w: W, batches: I, rows: &mut u64, path: &Path) -> Result<W>
where
    I: IntoIterator<Item = Result<RecordBatch>>,
{
    let mut jw = arrow::json::WriterBuilder::new()
        .with_explicit_nulls(true)
        .build::<_, arrow::json::writer::LineDelimited>(w);
    for b in batches {
        let b = b?;
        jw.write(&b).map_err(|source| DataError::Arrow {
            path: path.to_path_buf(),
            at: Location::Row(*rows),
            source,
        })?;
        *rows += b.num_rows() as u64;
    }
    jw.finish().map_err(|source| DataError::Arrow {
        path: path.to_path_buf(),
        at: Location::Row(*rows),
        source,
    })?;
    Ok(jw.into_inner())
}
