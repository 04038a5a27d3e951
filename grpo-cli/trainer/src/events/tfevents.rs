//! TensorBoard event files with scalar summaries (`report_to = ["tensorboard"]`).
//!
//! An event file is a sequence of TFRecord records, each holding one serialized
//! `tensorflow.Event` protobuf:
//!
//! ```text
//! u64 little-endian  length of data
//! u32 little-endian  masked CRC32C of the 8 length bytes
//! [u8; length]       data
//! u32 little-endian  masked CRC32C of data
//! ```
//!
//! The first record is an `Event` whose `file_version` is `"brain.Event:2"`; every
//! later record written here is an `Event` with a `Summary` of `(tag, simple_value)`
//! pairs.
//!
//! Scalars are written in the classic `Summary.Value.simple_value` form, not the
//! newer tensor form (`metadata.plugin_data.plugin_name = "scalars"` plus a rank-0
//! `DT_FLOAT` tensor). `simple_value` is what `EventAccumulator.Scalars()` returns,
//! and the TensorBoard server converts it into the tensor form when it loads a file,
//! so the Scalars dashboard shows it as well. It is also what
//! `torch.utils.tensorboard.SummaryWriter.add_scalar` writes by default. Tensor-form
//! values, by contrast, only reach `EventAccumulator.Tensors()`, not `Scalars()`.
//! A protobuf `oneof` cannot hold both forms in one value, so only one is written.
//!
//! The protobuf messages are declared by hand below with `prost` derives; only the
//! fields used here are declared, and a reader skips all others.

use std::fs::{self, File, OpenOptions};
use std::io::{self, BufReader, BufWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::time::{SystemTime, UNIX_EPOCH};

use prost::Message;

/// The `file_version` of the first event in every file.
const FILE_VERSION: &str = "brain.Event:2";

/// Added to the rotated CRC by the TFRecord CRC mask.
const MASK_DELTA: u32 = 0xa282_ead8;

/// Bytes in a record's header: the u64 length and its u32 masked CRC.
const HEADER_LEN: u64 = 12;

/// Bytes in a record's footer: the u32 masked CRC of the data.
const FOOTER_LEN: u64 = 4;

/// `tensorflow.Event`, with the fields this module writes or reads.
#[derive(Clone, PartialEq, Message)]
struct Event {
    /// Seconds since the Unix epoch.
    #[prost(double, tag = "1")]
    wall_time: f64,
    /// Global step of the event.
    #[prost(int64, tag = "2")]
    step: i64,
    /// The `what` oneof: a file version or a summary (other kinds are skipped).
    #[prost(oneof = "EventWhat", tags = "3, 5")]
    what: Option<EventWhat>,
}

/// `tensorflow.Event.what`, the two members used here.
#[derive(Clone, PartialEq, prost::Oneof)]
enum EventWhat {
    /// Format version string, `"brain.Event:2"`; only in a file's first event.
    #[prost(string, tag = "3")]
    FileVersion(String),
    /// A set of summary values.
    #[prost(message, tag = "5")]
    Summary(Summary),
}

/// `tensorflow.Summary`.
#[derive(Clone, PartialEq, Message)]
struct Summary {
    /// The values of the summary.
    #[prost(message, repeated, tag = "1")]
    value: Vec<SummaryValue>,
}

/// `tensorflow.Summary.Value`, with only the `simple_value` member of its oneof.
#[derive(Clone, PartialEq, Message)]
struct SummaryValue {
    /// Name of the series, e.g. `train/loss`.
    #[prost(string, tag = "1")]
    tag: String,
    /// The `value` oneof. Being a oneof member, `simple_value` is written even when
    /// it is 0.0, which readers need in order to see that the field is set.
    #[prost(oneof = "SummaryValueKind", tags = "2")]
    value: Option<SummaryValueKind>,
}

/// `tensorflow.Summary.Value.value`, the member used here.
#[derive(Clone, PartialEq, prost::Oneof)]
enum SummaryValueKind {
    /// A scalar.
    #[prost(float, tag = "2")]
    SimpleValue(f32),
}

/// The TFRecord mask of a CRC32C: rotate right by 15 bits, then add a constant.
fn mask_crc(crc: u32) -> u32 {
    crc.rotate_right(15).wrapping_add(MASK_DELTA)
}

/// The masked CRC32C of `bytes`, as stored in TFRecord headers and footers.
fn masked_crc32c(bytes: &[u8]) -> u32 {
    mask_crc(crc32c::crc32c(bytes))
}

/// Seconds since the Unix epoch, with sub-second precision, for `wall_time`
/// (0.0 if the clock is set before the epoch).
pub fn unix_time_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0.0, |d| d.as_secs_f64())
}

/// This machine's host name for the event file name, with characters other than
/// ASCII letters, digits, `.`, `-` and `_` replaced by `_`; `localhost` if unknown.
fn hostname() -> String {
    let raw = fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| fs::read_to_string("/etc/hostname"))
        .ok()
        .or_else(|| std::env::var("HOSTNAME").ok())
        .or_else(|| std::env::var("COMPUTERNAME").ok())
        .unwrap_or_default();
    let name: String = raw
        .trim()
        .chars()
        .map(|c| {
            if c.is_ascii_alphanumeric() || matches!(c, '.' | '-' | '_') {
                c
            } else {
                '_'
            }
        })
        .collect();
    if name.is_empty() {
        "localhost".to_owned()
    } else {
        name
    }
}

/// Writes scalar summaries to a new TensorBoard event file.
///
/// Records go through a buffer: call [`EventWriter::flush`] to make them visible to
/// TensorBoard. Dropping the writer flushes too, ignoring errors.
#[derive(Debug)]
pub struct EventWriter {
    /// Path of the event file.
    path: PathBuf,
    /// Buffered handle on the event file.
    writer: BufWriter<File>,
}

impl EventWriter {
    /// Creates the directory if needed and a new event file in it; writes the
    /// file_version record.
    ///
    /// The file is named `events.out.tfevents.{unix_seconds}.{hostname}`. If that
    /// name is taken (another writer in the same directory in the same second), a
    /// suffix `.1`, `.2`, ... is added; an existing file is never overwritten.
    /// The file_version record is flushed before this returns.
    pub fn create(dir: &Path) -> io::Result<Self> {
        fs::create_dir_all(dir).map_err(|e| with_path(e, dir))?;
        let now = unix_time_now();
        let base = format!("events.out.tfevents.{}.{}", now as u64, hostname());
        let mut suffix = 0u32;
        let (path, file) = loop {
            let name = if suffix == 0 {
                base.clone()
            } else {
                format!("{base}.{suffix}")
            };
            let path = dir.join(name);
            match OpenOptions::new().write(true).create_new(true).open(&path) {
                Ok(file) => break (path, file),
                Err(e) if e.kind() == io::ErrorKind::AlreadyExists && suffix < 10_000 => {
                    suffix += 1;
                }
                Err(e) => return Err(with_path(e, &path)),
            }
        };
        let mut writer = Self {
            path,
            writer: BufWriter::new(file),
        };
        writer.write_event(&Event {
            wall_time: now,
            step: 0,
            what: Some(EventWhat::FileVersion(FILE_VERSION.to_owned())),
        })?;
        writer.flush()?;
        Ok(writer)
    }

    /// Path of the event file this writer appends to.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// One Event holding every (tag, value) pair at `step`; non-finite values are
    /// written as they are (NaN is a valid float).
    ///
    /// Values are stored as `f32` (`simple_value` is a protobuf `float`), so finite
    /// values beyond the `f32` range become infinities. `wall_time` is in seconds
    /// since the Unix epoch (see [`unix_time_now`]). Nothing is written when
    /// `scalars` is empty.
    pub fn add_scalars<'a>(
        &mut self,
        step: i64,
        wall_time: f64,
        scalars: impl IntoIterator<Item = (&'a str, f64)>,
    ) -> io::Result<()> {
        let value: Vec<SummaryValue> = scalars
            .into_iter()
            .map(|(tag, value)| SummaryValue {
                tag: tag.to_owned(),
                value: Some(SummaryValueKind::SimpleValue(value as f32)),
            })
            .collect();
        if value.is_empty() {
            return Ok(());
        }
        self.write_event(&Event {
            wall_time,
            step,
            what: Some(EventWhat::Summary(Summary { value })),
        })
    }

    /// Flushes buffered records to the file.
    pub fn flush(&mut self) -> io::Result<()> {
        self.writer.flush().map_err(|e| with_path(e, &self.path))
    }

    /// Appends `event` as one TFRecord record.
    fn write_event(&mut self, event: &Event) -> io::Result<()> {
        let data = event.encode_to_vec();
        let len = (data.len() as u64).to_le_bytes();
        let mut header = [0u8; HEADER_LEN as usize];
        header[..8].copy_from_slice(&len);
        header[8..].copy_from_slice(&masked_crc32c(&len).to_le_bytes());
        let footer = masked_crc32c(&data).to_le_bytes();
        self.writer
            .write_all(&header)
            .and_then(|()| self.writer.write_all(&data))
            .and_then(|()| self.writer.write_all(&footer))
            .map_err(|e| with_path(e, &self.path))
    }
}

impl Drop for EventWriter {
    fn drop(&mut self) {
        // Best effort: there is no way to report an error from drop.
        let _ = self.writer.flush();
    }
}

/// Reads every scalar of an event file back as (step, tag, value), checking both
/// CRCs of every record (a corrupt record is an error naming the file and the byte
/// offset).
///
/// Only `simple_value` scalars are returned, in file order; other events and
/// values are skipped. A truncated last record is an error too, also of kind
/// [`io::ErrorKind::InvalidData`].
pub fn read_scalars(path: &Path) -> io::Result<Vec<(i64, String, f32)>> {
    let mut scalars = Vec::new();
    for event in read_events(path)? {
        if let Some(EventWhat::Summary(summary)) = event.what {
            for value in summary.value {
                if let Some(SummaryValueKind::SimpleValue(v)) = value.value {
                    scalars.push((event.step, value.tag, v));
                }
            }
        }
    }
    Ok(scalars)
}

/// Reads and decodes every record of an event file, checking both CRCs.
fn read_events(path: &Path) -> io::Result<Vec<Event>> {
    let file = File::open(path).map_err(|e| with_path(e, path))?;
    let file_len = file.metadata().map_err(|e| with_path(e, path))?.len();
    let mut reader = BufReader::new(file);
    let corrupt = |offset: u64, what: &str| {
        io::Error::new(
            io::ErrorKind::InvalidData,
            format!(
                "{}: corrupt record at byte offset {offset}: {what}",
                path.display()
            ),
        )
    };

    let mut events = Vec::new();
    let mut offset = 0u64;
    loop {
        let mut header = [0u8; HEADER_LEN as usize];
        match read_full(&mut reader, &mut header).map_err(|e| with_path(e, path))? {
            0 => break,
            n if n < header.len() => return Err(corrupt(offset, "truncated header")),
            _ => {}
        }
        let (len_bytes, len_crc) = header.split_at(8);
        if masked_crc32c(len_bytes).to_le_bytes() != len_crc {
            return Err(corrupt(offset, "length CRC mismatch"));
        }
        let mut len_le = [0u8; 8];
        len_le.copy_from_slice(len_bytes);
        let len = u64::from_le_bytes(len_le);
        let remaining = file_len.saturating_sub(offset + HEADER_LEN);
        if len.saturating_add(FOOTER_LEN) > remaining {
            return Err(corrupt(
                offset,
                &format!("length {len} runs past the end of the file"),
            ));
        }
        let data_len = usize::try_from(len)
            .map_err(|_| corrupt(offset, &format!("length {len} does not fit in memory")))?;
        let mut data = vec![0u8; data_len];
        let mut footer = [0u8; FOOTER_LEN as usize];
        let complete = read_full(&mut reader, &mut data).map_err(|e| with_path(e, path))?
            == data.len()
            && read_full(&mut reader, &mut footer).map_err(|e| with_path(e, path))? == footer.len();
        if !complete {
            return Err(corrupt(offset, "truncated data"));
        }
        if masked_crc32c(&data).to_le_bytes() != footer {
            return Err(corrupt(offset, "data CRC mismatch"));
        }
        let event = Event::decode(data.as_slice())
            .map_err(|e| corrupt(offset, &format!("invalid Event protobuf: {e}")))?;
        events.push(event);
        offset += HEADER_LEN + len + FOOTER_LEN;
    }
    Ok(events)
}

/// Reads until `buf` is full or the input ends; returns the number of bytes read.
fn read_full(reader: &mut impl Read, buf: &mut [u8]) -> io::Result<usize> {
    let mut filled = 0;
    while filled < buf.len() {
        match reader.read(&mut buf[filled..]) {
            Ok(0) => break,
            Ok(n) => filled += n,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
            Err(e) => return Err(e),
        }
    }
    Ok(filled)
}

/// `err` with `path` prepended to its message, keeping its kind.
fn with_path(err: io::Error, path: &Path) -> io::Error {
    io::Error::new(err.kind(), format!("{}: {err}", path.display()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::process::Command;
    use std::sync::atomic::{AtomicUsize, Ordering};

    /// A fresh directory under the system temp dir, removed on drop.
    struct TempDir(PathBuf);

    impl TempDir {
        fn new(name: &str) -> Self {
            static COUNTER: AtomicUsize = AtomicUsize::new(0);
            let n = COUNTER.fetch_add(1, Ordering::Relaxed);
            let dir = std::env::temp_dir().join(format!(
                "tensorboard-rs-test-{name}-{}-{n}",
                std::process::id()
            ));
            let _ = fs::remove_dir_all(&dir);
            fs::create_dir_all(&dir).unwrap();
            TempDir(dir)
        }
    }

    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = fs::remove_dir_all(&self.0);
        }
    }

    /// Scalars at several steps, with values that must survive exactly: 0.0 (only
    /// present on the wire because `simple_value` is a oneof member), -0.0,
    /// non-finite values, the f32 extremes and an out-of-range f64.
    fn sample() -> Vec<(i64, Vec<(&'static str, f64)>)> {
        vec![
            (0, vec![("train/loss", 2.5), ("train/reward", 0.0)]),
            (1, vec![("train/loss", 2.25), ("train/reward", -0.0)]),
            (
                2,
                vec![
                    ("train/loss", f64::NAN),
                    ("train/reward", f64::INFINITY),
                    ("train/kl", f64::NEG_INFINITY),
                ],
            ),
            (
                10,
                vec![
                    ("train/loss", 1.0e-45),
                    ("train/reward", f64::from(f32::MAX)),
                    ("train/kl", 1.0e300),
                ],
            ),
            (1_000_000_000_000, vec![("eval/accuracy", 0.1)]),
        ]
    }

    /// Writes `sample()` into `dir` and returns the event file's path.
    fn write_sample(dir: &Path) -> PathBuf {
        let mut writer = EventWriter::create(dir).unwrap();
        for (step, scalars) in sample() {
            writer
                .add_scalars(step, 1_700_000_000.0 + step as f64, scalars)
                .unwrap();
        }
        writer.flush().unwrap();
        writer.path().to_path_buf()
    }

    /// `sample()` as the flat (step, tag, value) list `read_scalars` returns.
    fn expected() -> Vec<(i64, String, f32)> {
        sample()
            .into_iter()
            .flat_map(|(step, scalars)| {
                scalars
                    .into_iter()
                    .map(move |(tag, v)| (step, tag.to_owned(), v as f32))
            })
            .collect()
    }

    /// Equality that treats two NaNs as equal and tells 0.0 from -0.0.
    fn same(a: &[(i64, String, f32)], b: &[(i64, String, f32)]) -> bool {
        a.len() == b.len()
            && a.iter().zip(b).all(|(x, y)| {
                x.0 == y.0
                    && x.1 == y.1
                    && (x.2.to_bits() == y.2.to_bits() || (x.2.is_nan() && y.2.is_nan()))
            })
    }

    #[test]
    fn masked_crc32c_matches_reference_values() {
        // The standard CRC32C check value.
        assert_eq!(crc32c::crc32c(b"123456789"), 0xE306_9283);
        // Masked by hand: rotr(0xE3069283, 15) = 0x2507C60D; + 0xA282EAD8.
        assert_eq!(0xE306_9283u32.rotate_right(15), 0x2507_C60D);
        assert_eq!(masked_crc32c(b"123456789"), 0xC78A_B0E5);
        // The masked values below come from tensorboard's own Python
        // implementation (tensorboard.compat.tensorflow_stub.pywrap_tensorflow
        // .masked_crc32c, tensorboard 2.21.0).
        assert_eq!(masked_crc32c(b""), 0xA282_EAD8);
        assert_eq!(masked_crc32c(&24u64.to_le_bytes()), 0x224B_7FA3);
        let all_bytes: Vec<u8> = (0..=255u8).collect();
        assert_eq!(masked_crc32c(&all_bytes), 0xD31A_2360);
    }

    #[test]
    fn round_trip() {
        let dir = TempDir::new("round-trip");
        let path = write_sample(&dir.0);
        let got = read_scalars(&path).unwrap();
        assert!(same(&got, &expected()), "{got:?}");
        // Out-of-range values saturate to infinity, NaN stays NaN.
        assert_eq!(got[9].2, f32::INFINITY);
        assert!(got[4].2.is_nan());
    }

    #[test]
    fn file_layout() {
        let tmp = TempDir::new("layout");
        let dir = tmp.0.join("nested/run");
        let writer = EventWriter::create(&dir).unwrap();
        let path = writer.path().to_path_buf();
        drop(writer);
        assert_eq!(path.parent(), Some(dir.as_path()));
        let name = path.file_name().unwrap().to_str().unwrap();
        let rest = name.strip_prefix("events.out.tfevents.").unwrap();
        let (secs, host) = rest.split_once('.').unwrap();
        assert!(secs.parse::<u64>().unwrap() > 1_600_000_000, "{name}");
        assert!(!host.is_empty(), "{name}");

        // The first record is the file_version event, and nothing else is there.
        let events = read_events(&path).unwrap();
        assert_eq!(events.len(), 1);
        assert_eq!(
            events[0].what,
            Some(EventWhat::FileVersion("brain.Event:2".to_owned()))
        );
        assert!(events[0].wall_time > 1.6e9);

        // A second writer in the same second gets its own file.
        let other = EventWriter::create(&dir).unwrap();
        assert_ne!(other.path(), path.as_path());
    }

    #[test]
    fn drop_flushes_and_empty_scalars_write_nothing() {
        let dir = TempDir::new("drop");
        let mut writer = EventWriter::create(&dir.0).unwrap();
        let path = writer.path().to_path_buf();
        writer.add_scalars(3, 1.0, []).unwrap();
        writer.add_scalars(4, 1.0, [("a", 1.5)]).unwrap();
        drop(writer);
        assert_eq!(read_events(&path).unwrap().len(), 2);
        assert_eq!(read_scalars(&path).unwrap(), vec![(4, "a".to_owned(), 1.5)]);
    }

    #[test]
    fn corrupt_record_names_file_and_offset() {
        let dir = TempDir::new("corrupt");
        let path = write_sample(&dir.0);
        let bytes = fs::read(&path).unwrap();
        let first_len = u64::from_le_bytes(bytes[..8].try_into().unwrap());
        // Start of the second record (the step-0 scalars).
        let second = (HEADER_LEN + first_len + FOOTER_LEN) as usize;

        let check = |index: usize, reason: &str| {
            let mut bad = bytes.clone();
            bad[index] ^= 0x01;
            fs::write(&path, &bad).unwrap();
            let err = read_scalars(&path).unwrap_err();
            assert_eq!(err.kind(), io::ErrorKind::InvalidData);
            let msg = err.to_string();
            assert!(msg.contains(&path.display().to_string()), "{msg}");
            assert!(msg.contains(&format!("byte offset {second}:")), "{msg}");
            assert!(msg.contains(reason), "{msg}");
        };
        // A byte of the data, of the length, of each CRC.
        check(second + HEADER_LEN as usize + 3, "data CRC mismatch");
        check(second + 1, "length CRC mismatch");
        check(second + 9, "length CRC mismatch");
        let second_len = u64::from_le_bytes(bytes[second..second + 8].try_into().unwrap());
        check(
            second + (HEADER_LEN + second_len) as usize,
            "data CRC mismatch",
        );

        // A truncated last record.
        fs::write(&path, &bytes[..bytes.len() - 2]).unwrap();
        let msg = read_scalars(&path).unwrap_err().to_string();
        assert!(msg.contains("runs past the end of the file"), "{msg}");
        fs::write(&path, &bytes[..second + 5]).unwrap();
        let msg = read_scalars(&path).unwrap_err().to_string();
        assert!(
            msg.contains(&format!("byte offset {second}: truncated header")),
            "{msg}"
        );
    }

    /// Reads the files with TensorBoard's own `EventAccumulator`; skipped when the
    /// Python interpreter (`TB_PYTHON`, default `python3`) or its `tensorboard`
    /// package is missing.
    #[test]
    fn tensorboard_event_accumulator_reads_the_scalars() {
        let python = std::env::var("TB_PYTHON").unwrap_or_else(|_| "python3".to_owned());
        let module = "tensorboard.backend.event_processing.event_accumulator";
        match Command::new(&python)
            .args(["-c", &format!("import {module}")])
            .output()
        {
            Err(e) => {
                println!("skipping EventAccumulator check: cannot run {python}: {e}");
                return;
            }
            Ok(out) if !out.status.success() => {
                println!("skipping EventAccumulator check: {python} cannot import {module}");
                return;
            }
            Ok(_) => {}
        }

        let dir = TempDir::new("accumulator");
        write_sample(&dir.0);
        let script = format!(
            "import sys\n\
             from {module} import EventAccumulator\n\
             acc = EventAccumulator(sys.argv[1], size_guidance={{'scalars': 0}})\n\
             acc.Reload()\n\
             for tag in acc.Tags()['scalars']:\n\
             \x20   for e in acc.Scalars(tag):\n\
             \x20       print(e.step, tag, repr(e.value), sep='\\t')\n"
        );
        let out = Command::new(&python)
            .arg("-c")
            .arg(&script)
            .arg(&dir.0)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let stdout = String::from_utf8(out.stdout).unwrap();
        let mut got: Vec<(i64, String, f32)> = stdout
            .lines()
            .map(|line| {
                let mut fields = line.split('\t');
                let step = fields.next().unwrap().parse().unwrap();
                let tag = fields.next().unwrap().to_owned();
                let value = fields.next().unwrap().parse::<f64>().unwrap() as f32;
                (step, tag, value)
            })
            .collect();
        let mut want = expected();
        // EventAccumulator groups by tag; compare in (tag, step) order.
        got.sort_by(|a, b| (&a.1, a.0).cmp(&(&b.1, b.0)));
        want.sort_by(|a, b| (&a.1, a.0).cmp(&(&b.1, b.0)));
        assert!(same(&got, &want), "EventAccumulator read {got:?}");
        println!(
            "EventAccumulator ({python}) read all {} scalars back",
            got.len()
        );
    }
}
