//! `grpo-cli data ...`: look into a dataset (`inspect`), make the built-in synthetic data
//! (`synth`), and measure reading speed and memory (`bench`). The work is grpo-data's.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{Result, bail};
use clap::{Args, Subcommand, ValueEnum};
use grpo_data::synth::ArithmeticConfig;
use grpo_data::{Dataset, Format, OpenOptions, Prompt, Sample, SampleStream, StreamConfig};

/// The `data` subcommands.
#[derive(Debug, Subcommand)]
pub enum DataCommand {
    /// Schema, row count, first samples, and what is wrong with the data for training.
    Inspect(InspectArgs),
    /// Write a synthetic dataset (Parquet, Arrow, JSONL or CSV, by --out's extension).
    Synth(SynthArgs),
    /// Read a dataset once through the shuffled stream; report rows/s and peak memory.
    Bench(BenchArgs),
    /// Write the tasks of an environment on an Open Reward Standard server as a JSONL dataset
    /// (TRL's `OpenRewardSpec.train_dataset`: an empty user prompt, `task_index`, the task's
    /// metadata) for `[environment] type = "ors"`.
    #[command(name = "ors-tasks")]
    OrsTasks(OrsTasksArgs),
}

/// `data ors-tasks`.
#[derive(Debug, Args)]
pub struct OrsTasksArgs {
    /// The server's base URL.
    #[arg(long)]
    url: String,
    /// The environment on the server (default: its first).
    #[arg(long = "env")]
    env_name: Option<String>,
    /// The split.
    #[arg(long, default_value = "train")]
    split: String,
    /// At most this many tasks, the first ones (default: all).
    #[arg(long, conflicts_with = "indices")]
    num_tasks: Option<usize>,
    /// These task indices (comma-separated).
    #[arg(long, value_delimiter = ',')]
    indices: Vec<usize>,
    /// Leave out the task specs' own keys (only `prompt` and `task_index`).
    #[arg(long)]
    no_metadata: bool,
    /// Environment variable holding an API key (sent as X-API-Key when set).
    #[arg(long, default_value = "OPENREWARD_API_KEY")]
    api_key_env: String,
    /// The JSONL file to write.
    #[arg(long)]
    out: PathBuf,
}

/// Where to read from and how.
#[derive(Debug, Args)]
pub struct SourceArgs {
    /// Files, directories or globs (quote globs: 'data/train-*.parquet').
    #[arg(required = true)]
    paths: Vec<String>,
    /// Format (parquet, arrow, jsonl, csv); default: from each file's extension.
    #[arg(long)]
    format: Option<String>,
    /// The prompt column.
    #[arg(long, default_value = "prompt")]
    prompt_field: String,
}

impl SourceArgs {
    fn open(&self) -> Result<Dataset> {
        let format = match &self.format {
            Some(f) => Some(f.parse::<Format>()?),
            None => None,
        };
        let opts = OpenOptions {
            format,
            prompt_field: self.prompt_field.clone(),
            ..Default::default()
        };
        Ok(Dataset::open(&self.paths, &opts)?)
    }
}

/// `data inspect`.
#[derive(Debug, Args)]
pub struct InspectArgs {
    #[command(flatten)]
    source: SourceArgs,
    /// The answer column supervised rewards read (reported if missing).
    #[arg(long, default_value = "answer")]
    answer_field: String,
    /// Samples to show.
    #[arg(long, default_value_t = 3)]
    head: usize,
    /// Problems to list.
    #[arg(long, default_value_t = 10)]
    max_issues: usize,
}

/// The synthetic data sets.
#[derive(Debug, Clone, Copy, ValueEnum)]
pub enum SynthKind {
    /// a + b, a - b, a * b and short multi-step word problems; columns prompt, answer.
    Arithmetic,
}

/// `data synth`.
#[derive(Debug, Args)]
pub struct SynthArgs {
    /// Which data set.
    kind: SynthKind,
    /// Number of problems.
    #[arg(long, default_value_t = 1000)]
    n: u64,
    /// Seed (same seed → same file).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Digits per operand (1-9).
    #[arg(long, default_value_t = 2)]
    digits: u32,
    /// Most operations per word problem (1-8; 1 = no word problems).
    #[arg(long, default_value_t = 3)]
    steps: u32,
    /// Output file: .parquet, .jsonl, .jsonl.gz, .jsonl.zst, .arrow or .csv.
    #[arg(long)]
    out: PathBuf,
}

/// `data bench`.
#[derive(Debug, Args)]
pub struct BenchArgs {
    #[command(flatten)]
    source: SourceArgs,
    /// Prompts per batch.
    #[arg(long, default_value_t = 64)]
    batch_size: usize,
    /// Shuffle window in rows.
    #[arg(long, default_value_t = grpo_data::DEFAULT_SHUFFLE_WINDOW)]
    shuffle_window: usize,
    /// Read in file order instead of shuffled.
    #[arg(long)]
    no_shuffle: bool,
}

/// Run a `data` subcommand.
pub fn run(cmd: DataCommand) -> Result<()> {
    match cmd {
        DataCommand::Inspect(a) => inspect(a),
        DataCommand::Synth(a) => synth(a),
        DataCommand::Bench(a) => bench(a),
        DataCommand::OrsTasks(a) => ors_tasks(a),
    }
}

/// `data ors-tasks`: the rows of `grpo_rollout::ors::task_rows`, a nested value (an object, a
/// list that is not of strings) written as its JSON text, which the data loader reads as a
/// string column.
fn ors_tasks(a: OrsTasksArgs) -> Result<()> {
    use grpo_rollout::ors::{OrsClient, OrsConfig, TaskSelection, task_rows};
    use serde_json::Value;
    if a.out.extension().and_then(|e| e.to_str()) != Some("jsonl") {
        bail!("--out {}: write a .jsonl file", a.out.display());
    }
    let cfg = OrsConfig {
        api_key_env: Some(a.api_key_env.clone()),
        split: a.split.clone(),
        ..OrsConfig::new(a.url.clone())
    };
    let which = match (a.num_tasks, a.indices.is_empty()) {
        (Some(n), _) => TaskSelection::First(n),
        (None, false) => TaskSelection::Indices(a.indices.clone()),
        (None, true) => TaskSelection::All,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()?;
    let rows = runtime.block_on(async {
        let client = OrsClient::new(&cfg)?;
        let env = client.resolve_env(a.env_name.as_deref()).await?;
        task_rows(&client, &env, &a.split, &which, !a.no_metadata).await
    })?;
    let flat = |v: Value| match v {
        Value::Object(_) => Value::String(v.to_string()),
        Value::Array(ref items) if !items.iter().all(Value::is_string) => {
            Value::String(v.to_string())
        }
        other => other,
    };
    let mut text = String::new();
    for row in rows {
        let Value::Object(o) = row else { continue };
        let o: serde_json::Map<String, Value> = o
            .into_iter()
            .map(|(k, v)| {
                let v = if k == "prompt" { v } else { flat(v) };
                (k, v)
            })
            .collect();
        text.push_str(&Value::Object(o).to_string());
        text.push('\n');
    }
    let n = text.lines().count();
    std::fs::write(&a.out, text).map_err(|e| anyhow::anyhow!("--out {}: {e}", a.out.display()))?;
    println!(
        "wrote {n} tasks of split `{}` to {}",
        a.split,
        a.out.display()
    );
    Ok(())
}

fn sample_json(s: &Sample) -> serde_json::Value {
    let mut m = serde_json::Map::new();
    m.insert("index".into(), s.index.into());
    m.insert(
        "prompt".into(),
        serde_json::to_value(&s.prompt).unwrap_or(serde_json::Value::Null),
    );
    for (k, v) in &s.columns {
        m.insert(
            k.to_string(),
            serde_json::to_value(v).unwrap_or(serde_json::Value::Null),
        );
    }
    serde_json::Value::Object(m)
}

fn inspect(a: InspectArgs) -> Result<()> {
    let data = a.source.open()?;
    println!("dataset: {}", data.name());
    for (path, rows) in data.file_rows() {
        println!("  file {}  rows {rows}", path.display());
    }
    println!("rows: {}", data.len());
    println!("schema (first file):");
    for f in data.schema().fields() {
        let mark = if f.name() == data.prompt_field() {
            "  <- prompt"
        } else if f.name() == &a.answer_field {
            "  <- answer"
        } else {
            ""
        };
        let null = if f.is_nullable() { ", nullable" } else { "" };
        println!("  {}: {}{null}{mark}", f.name(), f.data_type());
    }
    let report = data.validate(a.max_issues)?;
    match data.head(a.head) {
        Ok(head) => {
            println!("first {} samples:", head.len());
            for s in &head {
                println!("  {}", sample_json(s));
            }
        }
        Err(e) => println!("first samples: cannot show ({e})"),
    }
    println!(
        "prompts: {} text, {} conversations",
        report.rows - report.bad_rows - report.conversations,
        report.conversations
    );
    let mut problems = Vec::new();
    if let Err(e) = data.require_column(&a.answer_field, "supervised rewards") {
        problems.push(format!("warning: {e}"));
    }
    for (col, n) in &report.nulls {
        if *n > 0 {
            problems.push(format!(
                "warning: column `{col}` is null in {n} of {} rows",
                report.rows
            ));
        }
    }
    for issue in &report.issues {
        problems.push(format!("error: {issue}"));
    }
    if report.bad_rows as usize > report.issues.len() {
        problems.push(format!("... {} bad rows in all", report.bad_rows));
    }
    if problems.is_empty() {
        println!("ok: ready for training");
    } else {
        println!("problems:");
        for p in &problems {
            println!("  {p}");
        }
    }
    if report.bad_rows > 0 {
        bail!(
            "{}: {} of {} rows cannot be trained on (first: {})",
            data.name(),
            report.bad_rows,
            report.rows,
            report.issues.first().map_or("", String::as_str)
        );
    }
    Ok(())
}

fn synth(a: SynthArgs) -> Result<()> {
    let SynthKind::Arithmetic = a.kind;
    let cfg = ArithmeticConfig {
        n: a.n,
        seed: a.seed,
        digits: a.digits,
        steps: a.steps,
    };
    let start = Instant::now();
    let rows = cfg.write(&a.out)?;
    println!(
        "wrote {rows} arithmetic problems to {} in {:.2}s",
        a.out.display(),
        start.elapsed().as_secs_f64()
    );
    Ok(())
}

fn bench(a: BenchArgs) -> Result<()> {
    let start = Instant::now();
    let data = a.source.open()?;
    let opened = start.elapsed().as_secs_f64();
    let cfg = StreamConfig {
        shuffle: !a.no_shuffle,
        batch_size: a.batch_size,
        epochs: Some(1),
        shuffle_window: a.shuffle_window,
        ..Default::default()
    };
    let mut stream = SampleStream::new(data.clone(), cfg)?;
    let t = Instant::now();
    let (mut rows, mut bytes) = (0u64, 0u64);
    while let Some(batch) = stream.next_batch()? {
        for s in &batch {
            rows += 1;
            bytes += match &s.prompt {
                Prompt::Text(t) => t.len(),
                Prompt::Conversation(m) => m.iter().map(|m| m.content.len()).sum(),
            } as u64;
        }
    }
    let secs = t.elapsed().as_secs_f64();
    if rows != data.len() {
        bail!("read {rows} rows, expected {}", data.len());
    }
    let peak_mib = grpo_cli::trainer::peak_rss_mib();
    if peak_mib.is_nan() {
        bail!("VmHWM not found in /proc/self/status");
    }
    println!(
        "{}: {rows} rows ({} shuffle, window {}) in {secs:.3}s = {:.0} rows/s, {:.1} MB prompt text; open {opened:.3}s; peak RSS (VmHWM) {:.1} MiB",
        data.name(),
        if a.no_shuffle { "no" } else { "block" },
        a.shuffle_window,
        rows as f64 / secs,
        bytes as f64 / 1e6,
        peak_mib
    );
    Ok(())
}
