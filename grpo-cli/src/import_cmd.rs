//! `grpo-cli import-trl` and `import-verl`: a TRL recipe (`trl grpo|sft|dpo --config recipe.yaml`)
//! or a verl run (a `verl.trainer.main_ppo` launch script, or its config YAML) as a config of ours
//! (grpo-trainer's `trl_import` and `verl_import`), checked by loading it as `grpo-cli train`
//! would.

use std::path::PathBuf;

use anyhow::{Context, Result};
use clap::Args;
use grpo_trainer::{trl_import, verl_import};

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
    write_checked(&imported, &text, &a.recipe, a.out.as_deref())
}

/// `grpo-cli import-verl`.
#[derive(Debug, Args)]
pub struct ImportVerlArgs {
    /// The verl run: a shell script whose `python3 -m verl.trainer.main_ppo` command takes
    /// `key=value` overrides, or a YAML (or JSON) of verl's config (a run's `.hydra/config.yaml`).
    pub run: PathBuf,
    /// Write the TOML here instead of printing it.
    #[arg(long)]
    pub out: Option<PathBuf>,
}

/// Runs `grpo-cli import-verl`.
pub fn import_verl(a: ImportVerlArgs) -> Result<()> {
    let env = |k: &str| std::env::var(k).ok();
    let shown = a.run.display().to_string();
    let ext = a.run.extension().and_then(|e| e.to_str()).unwrap_or("");
    let (overrides, mut notes) = if matches!(ext, "yaml" | "yml" | "json") {
        let tree = grpo_trainer::config::read_tree(&a.run)?;
        (verl_import::yaml_overrides(&tree), Vec::new())
    } else {
        let text = std::fs::read_to_string(&a.run)
            .with_context(|| format!("{shown}: cannot read the script"))?;
        verl_import::script_overrides(&text, &env).map_err(|e| anyhow::anyhow!("{shown}: {e:#}"))?
    };
    let mut imported =
        verl_import::translate(&overrides, &env).map_err(|e| anyhow::anyhow!("{shown}: {e:#}"))?;
    notes.append(&mut imported.notes);
    imported.notes = notes;
    let text = trl_import::render(
        &imported,
        &format!("Translated from the verl run {shown} by `grpo-cli import-verl`."),
    )?;
    write_checked(&imported, &text, &a.run, a.out.as_deref())
}

/// Checks `text` as `grpo-cli train` would load it, then writes it to `out` (the notes on
/// stderr) or prints it.
fn write_checked(
    imported: &trl_import::Imported,
    text: &str,
    source: &std::path::Path,
    out: Option<&std::path::Path>,
) -> Result<()> {
    // What `grpo-cli train` would say of it (model and data are read when training starts).
    let tree = grpo_trainer::config::parse_toml_tree(text)?;
    grpo_trainer::config::from_tree(tree, &source.display().to_string()).map_err(|e| {
        anyhow::anyhow!(
            "{}: the translation is not a valid config: {e:#}",
            source.display()
        )
    })?;
    match out {
        Some(out) => {
            std::fs::write(out, text).with_context(|| format!("--out {}", out.display()))?;
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
