//! grpo-rollout's integration tests, one module per subject, built as one test binary (one link
//! instead of one per file: less disk and build time).
#![allow(clippy::unwrap_used, missing_docs)]

mod architectures;
mod chat_template;
mod classifier;
mod common;
mod constrain;
mod distill;
mod episodes;
mod fused;
mod gemma4;
mod generate;
mod gguf;
mod gguf_export;
mod gguf_spm;
mod hunyuan;
mod lfm2;
mod merge;
mod model;
mod moe;
mod parity;
mod peft;
mod qwen3_5;
mod remote;
mod rope_scaling;
mod scoring;
mod tools;
mod trainable_tokens;
