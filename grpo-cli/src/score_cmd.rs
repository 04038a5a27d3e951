//! `grpo-cli score`: a file of completions scored with a config's rewards, without training
//! (grpo-trainer's `score`).

use std::io::Write;
use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;

/// `grpo-cli score`.
#[derive(Debug, Args)]
pub struct ScoreArgs {
    /// The training config whose `[[rewards]]` (and `data.prompt_field`, model) to use.
    #[arg(long)]
    pub config: PathBuf,
    /// Override a key: `--set rewards.0.answer_field=answer` (repeatable).
    #[arg(long = "set", value_name = "KEY=VALUE")]
    pub set: Vec<String>,
    /// The completions: JSONL, Parquet, Arrow or CSV with the prompt, the completion and the
    /// columns the rewards read.
    #[arg(long)]
    pub data: PathBuf,
    /// The completion column.
    #[arg(long, default_value = "completion")]
    pub completion_field: String,
    /// Rows per call of the rewards.
    #[arg(long, default_value_t = 64)]
    pub batch: usize,
    /// Write each row's scores and info here (JSONL).
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// Print the summary as one JSON object.
    #[arg(long)]
    pub json: bool,
}

/// Runs `grpo-cli score`.
pub fn score(a: ScoreArgs) -> Result<()> {
    use grpo_trainer::config::{apply_sets, from_tree, read_tree};
    let mut tree = read_tree(&a.config)?;
    apply_sets(&mut tree, &a.set)?;
    // A rewards-only config needs no training data: the file scored stands in.
    if tree.pointer("/data/path").is_none() {
        if !tree.get("data").is_some_and(serde_json::Value::is_object) {
            tree["data"] = serde_json::json!({});
        }
        tree["data"]["path"] = serde_json::json!([a.data.display().to_string()]);
    }
    let cfg = from_tree(tree, &a.config.display().to_string())?;
    let scored = grpo_trainer::score::score_file(&cfg, &a.data, &a.completion_field, a.batch)
        .map_err(|e| anyhow::anyhow!("{}: {e:#}", a.data.display()))?;
    if let Some(out) = &a.out {
        let mut f = std::io::BufWriter::new(
            std::fs::File::create(out).with_context(|| format!("--out {}", out.display()))?,
        );
        for row in &scored.rows {
            writeln!(f, "{row}")?;
        }
        f.flush()?;
    }
    if a.json {
        println!("{}", scored.summary);
        return Ok(());
    }
    let rows = scored.summary["rows"].as_u64().unwrap_or(0);
    println!(
        "{:<24} {:>9} {:>9} {:>9}",
        "reward", "mean", "std", "scored"
    );
    let line = |name: &str, s: &serde_json::Value| {
        let num = |k: &str| s[k].as_f64().map_or("-".to_string(), |v| format!("{v:.4}"));
        println!(
            "{name:<24} {:>9} {:>9} {:>9}",
            num("mean"),
            num("std"),
            format!("{}/{rows}", s["scored"])
        );
    };
    for name in &scored.names {
        line(name, &scored.summary[name]);
    }
    line("(combined)", &scored.summary["reward"]);
    Ok(())
}
