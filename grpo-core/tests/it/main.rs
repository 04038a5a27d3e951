//! grpo-core's integration tests, one module per subject, built as one test binary (one link
//! instead of one per file: less disk and build time).
#![allow(clippy::unwrap_used, missing_docs)]

mod cov;
mod distill;
mod dpo_variants;
mod estimators;
mod gmpo;
mod kl_loss;
mod loss_variants;
mod minillm;
mod orpo_cpo;
mod ppo;
mod preference;
mod properties;
mod reference;
mod udm;
mod uld;
