//! The workspace's end-to-end tests (grpo-tests), one module per subject, built as one test
//! binary (one link instead of one per file: less disk and build time).
#![allow(clippy::unwrap_used, missing_docs)]

mod async_environment;
mod cuda_kernels_emulated;
mod example_configs;
mod grpo_bandit;
mod math_verify;
mod ors_environment;
mod pipeline_judge;
mod rewards_builtin;
mod rewards_judge;
mod rewards_model;
mod rewards_trl;
mod rollout_openai;
