//! The generator stage: samples `num_generations` completions per prompt with the latest
//! policy version it was given (locally, or on the rollout server of `rollout.backend =
//! "openai"`).

use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use grpo_data::Prompt;
use grpo_rollout::remote::RemoteGenerator;
use grpo_rollout::{ChatMessage, Tokenizer, Transformer};
use grpo_teacher::TeachingProtocol;

use super::{PromptBatch, Rollouts, step_seed};
use crate::config::TrainConfig;
use crate::remote::RemoteSync;
use crate::setup::Setup;

/// Samples completions with the latest published policy.
#[derive(Debug)]
pub struct Generator {
    tokenizer: Tokenizer,
    cfg: TrainConfig,
    model: Arc<Transformer>,
    version: usize,
    teaching: Option<Arc<TeachingProtocol>>,
    frozen_teacher: Option<Arc<Transformer>>,
    remote: Option<Arc<Mutex<RemoteGenerator>>>,
    /// What the server has of the policy.
    remote_sync: RemoteSync,
    /// The last decoding copy of an adapter model, whose transposed frozen base weights the
    /// next policy version reuses (see `Transformer::for_decoding_reusing`).
    decoding: Option<Transformer>,
}

impl Generator {
    /// With the policy weights at `version`.
    pub fn new(setup: &Setup, model: Arc<Transformer>, version: usize) -> Self {
        Self {
            tokenizer: setup.tokenizer.clone(),
            cfg: setup.cfg.clone(),
            model,
            version,
            teaching: setup.teaching.clone(),
            frozen_teacher: setup.frozen_teacher.clone(),
            remote: setup.remote.clone(),
            remote_sync: RemoteSync::new(&setup.cfg),
            decoding: None,
        }
    }

    /// Installs new weights.
    pub fn publish(&mut self, model: Arc<Transformer>, version: usize) {
        self.model = model;
        self.version = version;
    }

    /// The current policy version.
    pub fn version(&self) -> usize {
        self.version
    }

    /// Renders and tokenises a prompt (chat template for conversations), left-truncated.
    pub fn prompt_tokens(&self, prompt: &Prompt) -> Result<(String, Vec<u32>)> {
        encode_prompt(&self.tokenizer, &self.cfg, prompt)
    }

    /// Generates `num_generations` completions per prompt, seeded by (seed, step). With
    /// `[teacher]`, the student first probes each problem and the prompts become the teacher's.
    pub fn process(&mut self, batch: PromptBatch) -> Result<Rollouts> {
        let t0 = Instant::now();
        let seed = step_seed(self.cfg.train.seed, batch.step as u64);
        let teaching = match &self.teaching {
            Some(tp) => Some(crate::teacher::probe(tp, &batch, seed)?),
            None => None,
        };
        let mut prompt_texts = Vec::with_capacity(batch.samples.len());
        let mut prompt_ids = Vec::with_capacity(batch.samples.len());
        for (i, s) in batch.samples.iter().enumerate() {
            let prompt = match (&self.teaching, &teaching) {
                (Some(tp), Some(t)) => {
                    let (question, diag) = &t[i];
                    let user = tp
                        .teacher_prompt(question, diag)
                        .map_err(|e| anyhow!("row {}: {e}", s.index))?;
                    Prompt::Conversation(vec![grpo_data::Message {
                        role: "user".into(),
                        content: user,
                    }])
                }
                _ => s.prompt.clone(),
            };
            let (t, ids) = self
                .prompt_tokens(&prompt)
                .with_context(|| format!("prompt of row {}", s.index))?;
            if ids.is_empty() {
                bail!("row {}: the prompt is empty after tokenisation", s.index);
            }
            prompt_texts.push(t);
            prompt_ids.push(ids);
        }
        let params = self.cfg.rollout.sampling(seed);
        let g = self.cfg.rollout.num_generations;
        let completions = match self.remote.clone() {
            Some(remote) => {
                let mut server = remote
                    .lock()
                    .map_err(|_| anyhow!("the rollout server client is poisoned"))?;
                // The frozen teacher is the served base model; the policy is its synced adapter.
                let policy = self.frozen_teacher.is_none();
                if policy {
                    self.remote_sync
                        .sync(&mut server, &self.model, self.version)?;
                }
                server
                    .generate(&self.tokenizer, &prompt_ids, g, &params, policy)
                    .map_err(|e| anyhow!("rollout.openai: {e}"))?
            }
            None => {
                let model = self.frozen_teacher.as_ref().unwrap_or(&self.model);
                let decoding = model.for_decoding_reusing(self.decoding.as_ref())?;
                let out =
                    grpo_rollout::generate(&decoding, &self.tokenizer, &prompt_ids, g, &params)?;
                // Only an adapter model's copy is worth keeping: its base never changes.
                let adapters = decoding
                    .layers
                    .iter()
                    .any(|l| l.linears().iter().any(|x| x.lora.is_some()));
                self.decoding = adapters.then_some(decoding);
                out
            }
        };
        Ok(Rollouts {
            batch,
            prompt_texts,
            prompt_ids,
            completions,
            version: self.version,
            weights: self.model.clone(),
            seconds: t0.elapsed().as_secs_f64(),
            teaching,
            sampled_by_other_model: self.frozen_teacher.is_some() || self.remote.is_some(),
        })
    }
}

/// Renders and tokenises a prompt as TRL does: a conversation through the chat template with
/// the generation prompt (when `rollout.chat_template`), plain text with the tokenizer's special
/// tokens; left-truncated to `rollout.max_prompt_length`.
pub fn encode_prompt(
    tokenizer: &Tokenizer,
    cfg: &TrainConfig,
    prompt: &Prompt,
) -> Result<(String, Vec<u32>)> {
    let (text, ids) = match prompt {
        Prompt::Conversation(msgs) if cfg.rollout.chat_template => {
            let text = tokenizer.apply_chat_template(&chat_messages(msgs), true)?;
            let ids = tokenizer.encode(&text, false)?;
            (text, ids)
        }
        other => {
            let text = other.text();
            let ids = tokenizer.encode(&text, true)?;
            (text, ids)
        }
    };
    let max = cfg.rollout.max_prompt_length;
    let ids = if max > 0 && ids.len() > max {
        ids[ids.len() - max..].to_vec()
    } else {
        ids
    };
    Ok((text, ids))
}

/// grpo-data's messages as the tokenizer's chat messages.
pub fn chat_messages(msgs: &[grpo_data::Message]) -> Vec<ChatMessage> {
    msgs.iter()
        .map(|m| ChatMessage::new(m.role.clone(), m.content.clone()))
        .collect()
}
