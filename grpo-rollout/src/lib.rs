//! # grpo-rollout: the policy
//!
//! One job: be the language model that GRPO trains. A Llama-family transformer of our own
//! (llama, qwen2, qwen3, mistral, smollm3, gemma2, gemma3_text, gemma4_text — with Gemma 4's own
//! pieces, [`gemma4`] —, hunyuan_v1_dense, olmo2, olmo3, phi3, granite, ernie4_5,
//! exaone4, glm, glm4, seed_oss, arcee, the hybrids qwen3_5_text (linear attention, [`delta`])
//! and lfm2 (short convolutions, [`shortconv`]), and the mixtures of experts qwen3_moe, qwen2_moe,
//! mixtral, olmoe, granitemoe, gpt_oss, glm4_moe, deepseek_v3, glm4_moe_lite, deepseek_v2 —
//! with DeepSeek's latent attention, [`mla`] —, qwen3_5_moe_text and lfm2_moe: [`moe`]) whose
//! every weight receives a gradient, loaded from a Hugging Face directory or a GGUF file, with
//! its tokenizer and chat template, batched KV-cache generation with TRL's sampling knobs, LoRA
//! adapters (with PEFT's trainable tokens), generation constrained to a regular expression
//! ([`constrain`]), and saving in Hugging Face / PEFT formats (a
//! family's own file layout: [`layout`]), and merging saved models with mergekit's methods
//! ([`merge`]). The same transformer
//! is a sequence classifier (a reward model) with a `score` head in place of the LM head
//! (`Transformer::into_sequence_classifier`, `Transformer::sequence_scores`), a token
//! classifier (a process reward model: `Transformer::into_token_classifier`,
//! `Transformer::token_logits`), and a distillation student (`Transformer::distill_rows`).
//!
//! Multi-turn episodes against an environment (NeMo RL's `EnvironmentInterface`): the seam in
//! [`mod@env`], generation that keeps each episode's KV cache across turns in [`episode`], and
//! the built-in tool environment (Hermes `<tool_call>` calls; command and Python tools with
//! the `rewards` feature) in [`tools`]; Python environments (NeMo RL's `step` signature, and
//! TRL's `environment_factory` classes) in `python_env` with the `rewards` feature.
//!
//! With the cargo feature `rewards`, the module `scoring` makes the model grpo-rewards' scoring models:
//! `ModelScorer` (a `LanguageScorer`, for `inverse_loss` / `coverage_ce`) and
//! `ClassifierModel` (a `SequenceClassifier` loaded from a `*ForSequenceClassification`
//! checkpoint, for `reward_model`).
//!
//! With the cargo feature `remote`, the module `remote` generates the same completions on an
//! OpenAI-compatible server (vLLM, or `grpo-cli serve`) and syncs LoRA weights to it, and `ors`
//! runs episodes against environments on an Open Reward Standard server (openreward's HTTP
//! protocol: sessions, tools, rewards).
//!
//! With the cargo feature `cuda`, the module `cuda` launches the decoder's own CUDA kernels
//! (`kernels.cu`: the [`fused`] ops on a GPU) and `flash` the tensor-core attention of training
//! and prefill lengths (`flash.cu`), both compiled at first use by `grpo_core::cuda`. Before
//! they serve any op on a GPU and dtype, [`selfcheck`] runs each against its composition
//! once; a kernel that disagrees is switched off and its composition runs. On a GPU the decode
//! step is captured once per batch size and replayed as a CUDA graph ([`graph`]).
#![deny(missing_docs)]

pub mod config;
pub mod constrain;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod delta;
pub mod device;
pub mod env;
pub mod episode;
#[cfg(feature = "cuda")]
pub mod flash;
pub mod fused;
pub mod gemma4;
pub mod generate;
pub mod gguf;
pub mod graph;
pub mod init;
pub mod layout;
pub mod loader;
pub mod lora;
pub mod merge;
pub mod mla;
pub mod model;
pub mod moe;
#[cfg(feature = "remote")]
pub mod ors;
pub mod policy;
#[cfg(feature = "rewards")]
pub mod python_env;
#[cfg(feature = "remote")]
pub mod remote;
pub mod sample;
#[cfg(feature = "rewards")]
pub mod scoring;
pub mod selfcheck;
pub mod shortconv;
pub mod tokenizer;
pub mod tools;

pub use config::{Arch, ModelConfig};
pub use device::{DeviceSpec, Dtype};
#[cfg(feature = "async")]
pub use env::{AsyncEnvironment, Blocking};
pub use env::{Environment, EnvironmentReset, EnvironmentReturn, EpisodeStart};
pub use episode::{Episode, EpisodeParams, EpisodePrompt, generate_episodes};
pub use generate::{
    Completion, FinishReason, GeometricMixture, SamplingParams, generate, generate_mixture,
};
pub use loader::{LoadedModel, load, save_hf_dir};
pub use lora::LoraConfig;
pub use model::{DistillTeacher, Transformer};
pub use policy::TrainableModel;
pub use tokenizer::{ChatMessage, FunctionCall, Tokenizer, ToolCall};
pub use tools::{Tool, ToolEnvironment};
