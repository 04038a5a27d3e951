//! Workspace integration tests for grpo-rs, and helpers they share.
//!
//! [`loopback`] is an OpenAI-compatible chat-completions server on `127.0.0.1:0` with knobs
//! for latency and faults, used by the judge tests, the judge benchmark
//! (`cargo run --release -p grpo-tests --example judge_bench`) and later end-to-end runs; its
//! `POST /rewards` is the scoring service of the `type = "http"` reward tests. [`ors_server`]
//! is an Open Reward Standard environment server for the `[environment] type = "ors"` tests.

pub mod loopback;
pub mod ors_server;
