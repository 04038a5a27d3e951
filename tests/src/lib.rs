//! # grpo-tests: workspace integration tests
//!
//! End-to-end checks that cross crate boundaries live in `tests/tests/`; shared helpers (tiny
//! generated models, loopback servers) live here as later crates need them. Nothing in this
//! package is published.
#![deny(missing_docs)]
