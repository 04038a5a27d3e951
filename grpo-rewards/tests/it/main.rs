//! grpo-rewards's integration tests, one module per subject, built as one test binary (one link
//! instead of one per file: less disk and build time).
#![allow(clippy::unwrap_used, missing_docs)]

mod command;
mod process_reward_model;
mod python;
