//! # grpo-core: the GRPO math
//!
//! One job: turn rewards into advantages and log-probs into a differentiable GRPO-family loss,
//! exactly as TRL 1.16's `GRPOTrainer` does, so results can be compared number for number.
//!
//! * [`advantages`] works on plain `&[f32]`: [`advantages::combine_rewards`] (weighted reward
//!   functions, `None` = no opinion), [`advantages::group_advantages`] (group / batch / no
//!   scaling), [`advantages::leave_one_out_advantages`] (RLOO),
//!   [`advantages::normalize_then_sum_advantages`] (GDPO) and TRL's reward metrics.
//! * [`loss`] works on candle [`Tensor`](candle_core::Tensor)s: [`loss::policy_loss`] for the
//!   grpo, bnpo, dr_grpo, dapo, cispo, sapo, luspo, vespo and gmpo objectives (with TRL's off-policy
//!   sequence mask, high-entropy token mask and entropy bonus), token- or sequence-level importance
//!   ratios, two-sided clipping, and the KL penalty to a reference model (TRL's k3 or verl's
//!   KL-loss estimates); [`cov`] verl's Clip-Cov and KL-Cov token selections for it.
//! * [`logprobs`] turns `(B, T, V)` logits into per-token log-probs and entropies in chunks.
//! * [`preference`] holds the objectives beside GRPO: SFT's masked token loss, DPO's and KTO's
//!   preference losses, the reference-free ORPO and CPO losses (SimPO, AlphaPO; TPO reuses
//!   CPO's) and the reward model's Bradley-Terry loss, with TRL's metrics;
//!   [`distill`] the on-policy distillation divergence (forward / reverse KL, generalized JSD);
//!   [`uld`] GOLD's universal logit distillation for a teacher with another tokenizer.
//! * [`estimators`] holds verl's advantage estimators on plain slices (REINFORCE++ and its
//!   baseline, OPO, GRPO pass@k, GPG, ReMax, the optimal token baseline) and its in-reward KL
//!   penalty with the adaptive controller.
//! * [`ppo`] is PPO with a value model (TRL's experimental `PPOTrainer`): per-token rewards,
//!   GAE and whitening on plain slices, the clipped policy and value losses on tensors.
//! * [`udm`] is BCO's underlying distribution matching: a balanced logistic regression of
//!   desirable against undesirable prompt embeddings, and the density-ratio weights it gives.
//! * [`fused`] holds the fused-CPU-kernel plumbing (and its off switch) shared with grpo-rollout;
//!   [`recompute`] the device-generic ops that keep only their inputs for backward (CUDA, bf16)
//!   and the gradient sink of gradient checkpointing; [`selfcheck`] runs each CUDA kernel set
//!   against its composition at first use and switches off a kernel that disagrees.
//! * [`quant`] quantizes tensors in blocks of 256 to one byte per value (bitsandbytes' dynamic
//!   maps): the 8-bit optimizer state of `optim = "adamw_8bit"`.
//! * `cuda` (cargo feature `cuda`) compiles, loads and launches our CUDA kernels — the head's
//!   log-softmax + gather and entropy here, the decoder's ops for grpo-rollout — with NVRTC at
//!   run time.
//!
//! The scorer (grpo-rewards, through grpo-cli) feeds rewards in; the learner in grpo-cli calls
//! the loss on log-probs that grpo-rollout's model computes. This crate depends on candle-core
//! only and is device-generic: every function runs wherever its input tensors live. Without
//! its default feature `candle` it is [`advantages`] alone, with no dependencies at all
//! (`grpo-core = { version = "0.1", default-features = false }`).
//!
//! ```
//! use candle_core::{Device, Tensor, Var};
//! use grpo_core::advantages::{combine_rewards, group_advantages, ScaleRewards};
//! use grpo_core::loss::{policy_loss, LossConfig, LossInputs};
//!
//! // Two prompts, two completions each; one reward function.
//! let rewards = combine_rewards(&[vec![Some(1.0), Some(0.0), Some(0.5), Some(0.5)]], &[1.0]);
//! let adv = group_advantages(&rewards, 2, ScaleRewards::Group);
//!
//! let dev = Device::Cpu;
//! let logp = Var::from_tensor(&Tensor::new(&[[-1.0f32, -2.0], [-0.5, -0.7],
//!                                             [-1.0, -1.0], [-3.0, -0.1]], &dev)?)?;
//! let mask = Tensor::new(&[[1f32, 1.0], [1.0, 0.0], [1.0, 1.0], [1.0, 1.0]], &dev)?;
//! let advantages = Tensor::new(adv.as_slice(), &dev)?;
//! let out = policy_loss(
//!     &LossInputs {
//!         per_token_logps: logp.as_tensor(),
//!         old_per_token_logps: None,
//!         ref_per_token_logps: None,
//!         advantages: &advantages,
//!         completion_mask: &mask,
//!         num_items_in_batch: None,
//!         importance_weights: None,
//!         sampling_per_token_logps: None,
//!         entropies: None,
//!     },
//!     &LossConfig::default(),
//! )?;
//! let grads = out.loss.backward()?;
//! // The rewarded completion's tokens are pushed up: d loss / d logp < 0.
//! let g = grads.get(logp.as_tensor()).expect("gradient").to_vec2::<f32>()?;
//! assert!(g[0][0] < 0.0 && g[1][0] > 0.0);
//! # Ok::<(), candle_core::Error>(())
//! ```
#![deny(missing_docs)]

pub mod advantages;
#[cfg(feature = "candle")]
pub mod cov;
#[cfg(feature = "cuda")]
pub mod cuda;
#[cfg(feature = "candle")]
pub mod distill;
pub mod estimators;
#[cfg(feature = "candle")]
pub mod fused;
#[cfg(feature = "candle")]
pub mod logprobs;
#[cfg(feature = "candle")]
pub mod loss;
#[cfg(feature = "candle")]
pub mod memlog;
pub mod ppo;
#[cfg(feature = "candle")]
pub mod preference;
#[cfg(feature = "candle")]
pub mod quant;
#[cfg(feature = "candle")]
pub mod recompute;
#[cfg(feature = "candle")]
pub mod selfcheck;
#[cfg(feature = "serde")]
mod serde_names;
#[cfg(feature = "candle")]
pub mod tape;
pub mod udm;
#[cfg(feature = "candle")]
pub mod uld;

pub use advantages::{
    ScaleRewards, combine_rewards, group_advantages, leave_one_out_advantages,
    leave_one_out_normalized,
};
#[cfg(feature = "candle")]
pub use logprobs::{entropy_from_logits, selective_log_softmax};
#[cfg(feature = "candle")]
pub use loss::{
    ImportanceSamplingLevel, LossConfig, LossInputs, LossMetrics, LossOutput, LossType, policy_loss,
};
