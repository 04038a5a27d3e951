//! # grpo-teacher: two-pass adaptive teaching (ATLAS) for GRPO
//!
//! One job: train a *teacher* model to write guidance that makes a *student* model solve
//! problems it could not solve alone. Per problem:
//!
//! 1. the student writes a short diagnostic probe ([`TeachingProtocol::probe_batch`] →
//!    [`DiagnosticResult`]);
//! 2. the teacher (the policy being trained) writes `num_generations` teachings from the
//!    problem and the probe ([`TeachingProtocol::teacher_prompt`]);
//! 3. the student answers with each teaching, and once without — the baseline, cached per
//!    problem ([`TeachingProtocol::student_passes`]);
//! 4. [`AdaptiveTeachingReward`] scores each teaching by how much it moved the student's
//!    correctness ([`extract_solution`] + exact match, or any grpo-rewards reward such as a
//!    RIM judge ensemble), penalising harm and rewarding brevity.
//!
//! The trainer in `grpo-cli` runs step 1–2 in its generator stage and step 3–4 in its scorer
//! stage when a `[teacher]` section ([`TeacherConfig`]) is present; the teacher then learns with
//! GRPO on these rewards like any policy. The models come from `grpo-rollout`; the reward is a
//! `grpo_rewards::AsyncReward`.
//!
//! ```
//! use grpo_teacher::{TeachingRewardParams, extract_solution, exact_match};
//!
//! let with = extract_solution("... so x = 4. <solution>4</solution>");
//! let without = extract_solution("I think it is <solution>5</solution>");
//! let (w, b) = (exact_match(&with, "4") as u8 as f32, exact_match(&without, "4") as u8 as f32);
//! // The teaching (60 tokens) turned a wrong answer into a right one:
//! let r = TeachingRewardParams::default().reward(w, b, 60);
//! assert!((r - (1.0 + 100.0 / 160.0)).abs() < 1e-6);
//! ```
#![deny(missing_docs)]

pub mod config;
mod error;
pub mod protocol;
pub mod reward;

pub use config::{TeacherConfig, TemplateKind, Templates};
pub use error::{Result, TeacherError};
pub use protocol::{
    DiagnosticResult, LocalModel, ResponseQuality, StudentAnswer, StudentPass, TeachingProtocol,
    guidance_style,
};
pub use reward::{
    AdaptiveTeachingReward, Correctness, TeachingRewardParams, efficiency_bonus, exact_match,
    extract_solution, extract_teaching,
};
