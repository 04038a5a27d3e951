//! # grpo-trainer: the trainer as a library
//!
//! One job: train a policy with GRPO (or PPO, RLOO, online DPO, XPO, Nash-MD, A*-PO, SDPO, SDFT, SSD,
//! distillation, GKD, IW-OPD, GOLD, MiniLLM, SFT, DPO, KTO, BCO, ORPO, CPO, TPO, a reward model, a
//! process reward model) from a typed config, on the CPU or CUDA,
//! writing a run directory (metrics, completions, checkpoints with exact resume). No command
//! line, no server, no progress bar: the `grpo-cli` binary is a thin layer over this crate.
//!
//! Where things live (read [`pipeline`] first: it is the whole loop in one short file):
//!
//! | module | its job |
//! |---|---|
//! | [`config`] | the schema (TOML / YAML / JSON, TRL's names), `--set` overrides, validation once |
//! | [`trl_import`] | a TRL recipe (`trl grpo --config recipe.yaml`) translated into that schema |
//! | [`verl_import`] | a verl run (a `verl.trainer.main_ppo` launch script or config YAML) translated into that schema |
//! | [`mod@setup`] | load model, data, rewards, teacher and rollout server; check they fit |
//! | [`pipeline`] | the stages on threads over bounded channels; shutdown and errors |
//! | [`stages`] | what flows between stages, and the loader, generator (completions, or multi-turn episodes against an environment given in code) and scorer |
//! | [`learner`] | batch assembly, the GRPO loss (and MiniLLM's teacher terms), PPO's value model and GAE, the optimizer step, metrics; SFT / DPO / KTO / BCO / ORPO / CPO / reward / PRM steps; distillation (and IW-OPD), self-distillation (SDPO, SDFT), BEMA |
//! | [`events`] | metrics / completions logs, checkpoint writes, TensorBoard, progress: sinks on their own thread |
//! | [`checkpoint`], [`run_dir`] | checkpoint files and resume; what a run directory may hold |
//! | [`teacher`], [`remote`] | the two-pass teaching glue; LoRA sync to an OpenAI-compatible server |
//! | [`callbacks`], [`optim`], [`eval`] | user hooks; AdamW and schedules; evaluation |
//! | [`playthrough`] | a scripted episode against the config's environment, without a model (`grpo-cli env`) |
//! | [`score`] | a file of completions scored with the config's rewards, without training (`grpo-cli score`) |
//!
//! ```no_run
//! use grpo_trainer::{FitOptions, GrpoTrainer, config::TrainConfig};
//!
//! let mut cfg = TrainConfig::default();
//! cfg.data.path = vec!["data/arith.parquet".into()];
//! cfg.rewards = serde_json::from_value(serde_json::json!([{"type": "accuracy"}])).unwrap();
//! let mut trainer = GrpoTrainer::from_pretrained("models/tiny", cfg).unwrap();
//! let result = trainer.fit_with(FitOptions::default().max_steps(10)).unwrap();
//! // SFT, DPO and KTO the same way: SftTrainer::from_pretrained(..), DpoTrainer::from_pretrained(..),
//! // or grpo_trainer::create_trainer("sft", "models/tiny", cfg).
//! println!("{} steps, last reward {:?}", result.total_steps, result.metrics.last().map(|m| m["reward"]));
//! ```
#![deny(missing_docs)]

pub mod callbacks;
pub mod checkpoint;
pub mod config;
pub mod eval;
pub mod events;
pub mod failure;
pub mod learner;
pub mod optim;
pub mod pipeline;
pub mod playthrough;
pub mod remote;
pub mod run_dir;
pub mod score;
pub mod setup;
pub mod stages;
mod step_end;
pub mod teacher;
mod trainer;
pub mod trl_import;
pub mod verl_import;

pub use callbacks::{Callbacks, Metrics, NoCallbacks};
pub use checkpoint::list_checkpoints;
pub use config::{Algorithm, TrainConfig};
pub use events::{Event, EventSink};
pub use learner::metrics::peak_rss_mib;
pub use learner::{Learner, TrainerState, batch::completion_logps, supervised};
pub use pipeline::{RunMode, RunOptions, TrainingResult, run};
pub use setup::{Setup, setup, setup_with};
pub use trainer::{
    A2po, A2poTrainer, AnyTrainer, Bco, BcoTrainer, ByName, Cpo, CpoTrainer, Distillation,
    DistillationTrainer, Dpo, DpoTrainer, FitOptions, Gkd, GkdTrainer, Gold, GoldTrainer, Grpo,
    GrpoTrainer, IwOpd, IwOpdTrainer, Kto, KtoTrainer, MiniLlm, MiniLlmTrainer, NashMd,
    NashMdTrainer, OnlineDpo, OnlineDpoTrainer, Orpo, OrpoTrainer, Ppo, PpoTrainer, Prm,
    PrmTrainer, RewardModeling, RewardTrainer, Rloo, RlooTrainer, Sdft, SdftTrainer, Sdpo,
    SdpoTrainer, Sft, SftTrainer, Ssd, SsdTrainer, Tpo, TpoTrainer, Trainer, TrainerKind, Xpo,
    XpoTrainer, create_trainer, get_algorithm, list_algorithms,
};

/// The first line of a message (error texts from candle and others may carry a backtrace or
/// detail after it; a user-facing line leaves that out).
pub fn first_line(s: &str) -> String {
    s.lines().next().unwrap_or("").to_string()
}

/// An error and its causes on one line, each cause's first line once, joined by `: `.
pub fn error_line(e: &anyhow::Error) -> String {
    let mut parts: Vec<String> = Vec::new();
    for cause in e.chain() {
        let first = first_line(&cause.to_string()).trim().to_string();
        if !first.is_empty() && !parts.iter().any(|p| p.contains(&first)) {
            parts.push(first);
        }
    }
    parts.join(": ")
}
