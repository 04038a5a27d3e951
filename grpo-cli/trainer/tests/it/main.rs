//! grpo-trainer's integration tests, one module per subject, built as one test binary (one link
//! instead of one per file: less disk and build time).
#![allow(clippy::unwrap_used, missing_docs)]

mod advantages_and_scoring;
mod environment;
mod library;
mod python_reward;
