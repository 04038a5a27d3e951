//! grpo-cli's integration tests, one module per subject, built as one test binary (one link
//! instead of one per file: less disk and build time).
#![allow(clippy::unwrap_used, missing_docs)]

mod a2po;
mod bema;
mod cli;
mod common;
mod data_cli;
mod distillation;
mod env_cli;
mod export;
mod faults;
mod filter_groups;
mod gold;
mod import_trl;
mod import_verl;
mod iw_opd;
mod merge;
mod minillm;
mod online_dpo;
mod ppo;
mod prm;
mod replay;
mod reward_model;
mod score_cli;
mod sdft;
mod sdpo;
mod serve;
mod ssd;
mod supervised;
mod train;
mod trl_trainers;
mod verl;
mod xpo_nash_md;
