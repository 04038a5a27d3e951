//! `grpo-cli import-trl`: a TRL recipe (`trl grpo|sft|dpo --config recipe.yaml`) as a config of ours
//! (grpo-trainer's `trl_import`), checked by loading it as `grpo-cli train` would.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use grpo_trainer::trl_import;

/// `grpo-cli import-trl`.
#[derive(Debug, Args)]
pub struct ImportTrlArgs {
    /// The TRL recipe: the YAML (or JSON) `trl grpo --config` reads.
    pub recipe: PathBuf,
    /// Write the TOML here instead of printing it.
    #[arg(long)]
    pub out: Option<PathBuf>,
    /// The `trl` subcommand the recipe is for: grpo, rloo, sft, dpo, kto or reward; or ppo (TRL's
    /// PPO example script's recipe).
    #[arg(long, default_value = "grpo")]
    pub trainer: String,
}

/// Runs `grpo-cli import-trl`.
pub fn import_trl(a: ImportTrlArgs) -> Result<()> {
    let tree = grpo_trainer::config::read_tree(&a.recipe)?;
    let recipe = tree
        .as_object()
        .context("the recipe must be a table of keys")?;
    let base = a.recipe.parent().map(PathBuf::from).unwrap_or_default();
    let trainer = trl_import::Trainer::parse(&a.trainer)?;
    let imported = trl_import::translate(recipe, &base, trainer)
        .map_err(|e| anyhow::anyhow!("{}: {e:#}", a.recipe.display()))?;
    let text = trl_import::to_toml(&imported, &a.recipe.display().to_string())?;
    // What `grpo-cli train` would say of it (model and data are read when training starts).
    let tree = grpo_trainer::config::parse_toml_tree(&text)?;
    grpo_trainer::config::from_tree(tree, &a.recipe.display().to_string()).map_err(|e| {
        anyhow::anyhow!(
            "{}: the translation is not a valid config: {e:#}",
            a.recipe.display()
        )
    })?;
    match &a.out {
        Some(out) => {
            std::fs::write(out, &text).with_context(|| format!("--out {}", out.display()))?;
            for (k, why) in &imported.notes {
                eprintln!("{k}: {why}");
            }
            eprintln!(
                "wrote {} ({} key(s) left out or changed, listed on top)",
                out.display(),
                imported.notes.len()
            );
        }
        None => print!("{text}"),
    }
    Ok(())
}
