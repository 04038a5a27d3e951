//! The generator stage: samples `num_generations` completions per prompt with the latest
//! policy version it was given (locally, or on the rollout server of `rollout.backend =
//! "openai"`).

use std::collections::BTreeMap;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::Device;
use grpo_data::Prompt;
use grpo_rollout::episode::{EpisodeEnd, EpisodeRequest, episode_metrics};
use grpo_rollout::model::DeviceCopies;
use grpo_rollout::remote::RemoteGenerator;
use grpo_rollout::{
    ChatMessage, Completion, Environment, Episode, EpisodeParams, EpisodePrompt, FinishReason,
    Tokenizer, Transformer, episode::generate_episodes_batch,
};
use grpo_teacher::TeachingProtocol;

use super::{CompletionSource, EpisodeBatch, PromptBatch, Rollouts, step_seed};
use crate::config::{Algorithm, EnvironmentReward, TrainConfig};
use crate::remote::RemoteSync;
use crate::setup::Setup;

/// Samples completions with the latest published policy.
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
    environment: Option<Arc<dyn Environment>>,
    /// Its own device (`Setup::rollout_device`), with the frozen weights already copied there.
    device: Option<(Device, DeviceCopies)>,
    /// GKD's `seq_kd`: the distillation teacher, which samples the off-policy steps.
    seq_kd_teacher: Option<Transformer>,
    /// The teacher's copy on `device` (made once: the learner reads the teacher on its own
    /// handle at the same time, and two threads must not share one).
    seq_kd_copies: DeviceCopies,
    /// XPO and Nash-MD: the frozen reference, which samples (or mixes into) each prompt's
    /// second completion.
    reference: Option<Transformer>,
    /// Its copy on `device` when it is not the policy's own base (a full fine-tune).
    reference_copies: DeviceCopies,
}

impl std::fmt::Debug for Generator {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Generator")
            .field("version", &self.version)
            .field("environment", &self.environment.as_ref().map(|e| e.name()))
            .finish_non_exhaustive()
    }
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
            environment: setup.environment.clone(),
            device: setup
                .rollout_device
                .clone()
                .map(|d| (d, DeviceCopies::default())),
            seq_kd_teacher: match setup.cfg.distillation.seq_kd {
                true => setup.distillation_teacher.clone(),
                false => None,
            },
            seq_kd_copies: DeviceCopies::default(),
            reference: match setup.cfg.algorithm {
                Algorithm::Xpo | Algorithm::NashMd => setup.reference.clone(),
                _ => None,
            },
            reference_copies: DeviceCopies::default(),
        }
    }

    /// Samples `g` completions per prompt instead of `rollout.num_generations` (evaluation's
    /// `num_generations_eval`).
    pub fn with_num_generations(mut self, g: usize) -> Self {
        self.cfg.rollout.num_generations = g;
        self
    }

    /// Samples every completion with the policy: XPO's and Nash-MD's second samples (the
    /// reference's, the mixture's) and ReMax's greedy baselines left out (evaluation).
    pub fn policy_only(mut self) -> Self {
        self.reference = None;
        self.cfg.loss.adv_estimator = grpo_core::estimators::AdvEstimator::Grpo;
        self
    }

    /// Samples with its own model here, never on the rollout server (A*-PO's value estimation
    /// samples the frozen reference).
    pub fn local(mut self) -> Self {
        self.remote = None;
        self
    }

    /// Samples on the model's own device: no copy onto `rollout.device` or onto the overlapped
    /// generator's own handle of the GPU (for sampling before training, where no learner runs
    /// beside it).
    pub fn on_model_device(mut self) -> Self {
        self.device = None;
        self
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
        let out = self.rollouts(batch);
        // A generation is a phase: its KV caches and decode buffers go back to the driver.
        let device = match &self.device {
            Some((device, _)) => device.clone(),
            None => self.model.device().clone(),
        };
        grpo_core::memlog::release_unused(&device);
        out
    }

    fn rollouts(&mut self, batch: PromptBatch) -> Result<Rollouts> {
        if let Some(env) = self.environment.clone() {
            return self.episodes(batch, env.as_ref());
        }
        let t0 = Instant::now();
        let seed = step_seed(self.cfg.train.seed, batch.draw as u64);
        let (teaching, prompts) = self.step_prompts(&batch, seed)?;
        let mut prompt_texts = Vec::with_capacity(batch.samples.len());
        let mut prompt_ids = Vec::with_capacity(batch.samples.len());
        for (s, prompt) in batch.samples.iter().zip(&prompts) {
            let (t, ids) = self
                .prompt_tokens(prompt)
                .with_context(|| format!("prompt of row {}", s.index))?;
            if ids.is_empty() {
                bail!("row {}: the prompt is empty after tokenisation", s.index);
            }
            prompt_texts.push(t);
            prompt_ids.push(ids);
        }
        // SDFT's `generate_from_teacher`: sampled after the teacher's prompt (the privileged
        // context shown), trained after the plain one.
        let from_teacher =
            self.cfg.algorithm == Algorithm::Sdft && self.cfg.sdft.generate_from_teacher;
        let teacher_ids: Vec<Vec<u32>> = match from_teacher {
            true => batch
                .samples
                .iter()
                .map(|s| {
                    let p = crate::learner::sdpo::sdft_teacher_prompt(s, &self.cfg.sdft)?;
                    Ok(self.prompt_tokens(&p)?.1)
                })
                .collect::<Result<_>>()?,
            false => Vec::new(),
        };
        let sample_ids = match from_teacher {
            true => &teacher_ids,
            false => &prompt_ids,
        };
        let params = self.cfg.rollout.sampling(seed);
        let g = self.cfg.rollout.num_generations;
        let source = self.completion_source(batch.step);
        let completions = match (source, self.remote.clone()) {
            (CompletionSource::Dataset, _) => {
                dataset_completions(&self.tokenizer, &self.cfg, &batch, &prompt_texts, g)?
            }
            (CompletionSource::Teacher, _) => {
                let teacher = self
                    .seq_kd_teacher
                    .as_ref()
                    .context("distillation.seq_kd needs the distillation teacher")?;
                // On the generator's own device (`rollout.device`, or its own handle of the
                // learner's GPU) the teacher samples from its copy there, as the policy does.
                let moved;
                let teacher = match &self.device {
                    Some((device, _)) => {
                        moved = teacher.to_device_reusing(device, &mut self.seq_kd_copies)?;
                        &moved
                    }
                    None => teacher,
                };
                let decoding = teacher.for_decoding_reusing(None)?;
                grpo_rollout::generate(&decoding, &self.tokenizer, sample_ids, g, &params)?
            }
            (CompletionSource::Policy, remote) => match remote {
                // XPO on the rollout server: the synced adapter samples the policy's completion,
                // the served base model (the frozen reference) the second one.
                Some(remote) if self.cfg.algorithm == Algorithm::Xpo => {
                    let (server, _) = self.synced_server(&remote)?;
                    let tok = &self.tokenizer;
                    let contrast = grpo_rollout::SamplingParams {
                        seed: contrast_seed(params.seed),
                        ..params.clone()
                    };
                    let sample = |p, use_adapter| {
                        server
                            .generate(tok, sample_ids, 1, p, use_adapter)
                            .map_err(|e| anyhow!("rollout.openai: {e}"))
                    };
                    interleave_pairs(sample(&params, true)?, sample(&contrast, false)?)
                }
                Some(remote) => {
                    let (server, policy) = self.synced_server(&remote)?;
                    server
                        .generate(&self.tokenizer, sample_ids, g, &params, policy)
                        .map_err(|e| anyhow!("rollout.openai: {e}"))?
                }
                None => {
                    let model = self.frozen_teacher.clone().unwrap_or(self.model.clone());
                    let decoding = self.decoding_copy(&model)?;
                    grpo_core::memlog::log("generator: decoding copy", decoding.device());
                    let out = match self.reference.is_some() {
                        true => self.contrast_pairs(&decoding, sample_ids, &params, &batch)?,
                        false => grpo_rollout::generate(
                            &decoding,
                            &self.tokenizer,
                            sample_ids,
                            g,
                            &params,
                        )?,
                    };
                    grpo_core::memlog::log("generator: generated", decoding.device());
                    out
                }
            },
        };
        let other = self.frozen_teacher.is_some() || self.remote.is_some() || from_teacher;
        // ReMax: each prompt's greedy completion by the policy (verl samples it with
        // do_sample=False), its baseline.
        let greedy = match self.cfg.loss.adv_estimator {
            // (The config refuses `remax` with any algorithm but GRPO.)
            grpo_core::estimators::AdvEstimator::Remax => {
                let model = self.model.clone();
                let decoding = self.decoding_copy(&model)?;
                let argmax = grpo_rollout::SamplingParams {
                    top_k: 1,
                    ..params.clone()
                };
                Some(super::GreedyBaselines {
                    completions: grpo_rollout::generate(
                        &decoding,
                        &self.tokenizer,
                        sample_ids,
                        1,
                        &argmax,
                    )?,
                    rewards: Vec::new(),
                })
            }
            _ => None,
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
            sampled_by_other_model: other || source != CompletionSource::Policy,
            episodes: None,
            source,
            greedy,
        })
    }

    /// XPO and Nash-MD: each prompt's first completion is the policy's, its second the frozen
    /// reference's (XPO) or the geometric mixture's of both (Nash-MD, `nash_md.mixture_coef`
    /// of the batch's epoch). The policy draws one sample per prompt from the step's seed, as
    /// [`grpo_rollout::generate`] does; the second model from [`contrast_seed`] (so a rollout
    /// server, which draws what `generate` draws, gives the same pairs).
    fn contrast_pairs(
        &mut self,
        policy: &Transformer,
        prompts: &[Vec<u32>],
        params: &grpo_rollout::SamplingParams,
        batch: &PromptBatch,
    ) -> Result<Vec<Completion>> {
        use grpo_rollout::generate::{PromptRequest, generate_batch, generate_mixture};
        let reference = self
            .reference
            .as_ref()
            .context("XPO and Nash-MD need the reference model")?;
        // On the generator's own device the reference samples from its copy there: for an
        // adapter model the policy's frozen base, whose copies the policy's decoding made.
        let moved;
        let reference = match &mut self.device {
            Some((device, copies)) => {
                let copies = match self.cfg.model.lora.is_some() {
                    true => copies,
                    false => &mut self.reference_copies,
                };
                moved = reference.to_device_reusing(device, copies)?;
                &moved
            }
            None => reference,
        };
        let requests = |seed: u64| -> Vec<PromptRequest<'_>> {
            prompts
                .iter()
                .enumerate()
                .map(|(i, ids)| PromptRequest {
                    ids,
                    n: 1,
                    seed,
                    first_stream: i as u64,
                })
                .collect()
        };
        let tok = &self.tokenizer;
        let mine = generate_batch(policy, tok, &requests(params.seed), params)?;
        let second = requests(contrast_seed(params.seed));
        let theirs = match self.cfg.algorithm {
            Algorithm::NashMd => {
                let coef = self.cfg.nash_md.mixture_coef.at(batch.epoch());
                let mixture = grpo_rollout::GeometricMixture { reference, coef };
                generate_mixture(policy, mixture, tok, &second, params)?
            }
            _ => generate_batch(&reference.for_decoding()?, tok, &second, params)?,
        };
        Ok(interleave_pairs(mine, theirs))
    }

    /// GKD: the step's completions come from the policy with probability `distillation.lmbda`
    /// (a coin seeded by the run's seed and the step, so a resumed run draws the same), else
    /// from the teacher (`seq_kd`) or the dataset. Every other algorithm: the policy.
    fn completion_source(&self, step: usize) -> CompletionSource {
        let cfg = &self.cfg;
        if !cfg.algorithm.is_distillation() {
            return CompletionSource::Policy;
        }
        let lmbda = cfg.distillation.lmbda_for(cfg.algorithm);
        if lmbda >= 1.0 {
            return CompletionSource::Policy;
        }
        let bits = grpo_data::rng::mix(cfg.train.seed, 0x676b_645f_6c6d_6264, step as u64);
        let u = (bits >> 11) as f64 / (1u64 << 53) as f64;
        match (u < lmbda, cfg.distillation.seq_kd) {
            (true, _) => CompletionSource::Policy,
            (false, true) => CompletionSource::Teacher,
            (false, false) => CompletionSource::Dataset,
        }
    }

    /// The copy of `model` that samples: on `rollout.device` when it has one, with the
    /// decoding transposes on the CPU. An adapter model's copy is kept, so the next version
    /// reuses what its frozen base needs (its copy on the device, its transposes).
    fn decoding_copy(&mut self, model: &Transformer) -> Result<Transformer> {
        let moved;
        let model = match &mut self.device {
            Some((device, copies)) => {
                moved = model.to_device_reusing(device, copies)?;
                &moved
            }
            None => model,
        };
        let adapters = model
            .layers
            .iter()
            .any(|l| l.linears().iter().any(|x| x.lora.is_some()));
        if adapters && !model.device().is_cpu() {
            // On a GPU a decode step is bound by kernel launches, and unmerged adapters add
            // three per adapted map: generate from the merged weights (as TRL's vLLM path
            // does). The copy lives for this generation only. On the CPU the unmerged
            // adapters reuse the base's transposes instead (merging would transpose every
            // adapted weight again at each version).
            self.decoding = None;
            return Ok(grpo_rollout::lora::merged_for_decoding(model)?);
        }
        let decoding = model.for_decoding_reusing(self.decoding.as_ref())?;
        self.decoding = adapters.then(|| decoding.clone());
        Ok(decoding)
    }

    /// The step's prompts: each row's own (for distillation, a conversation that ends with
    /// the assistant's turn without that turn: TRL's GKD reads `messages` so), or with
    /// `[teacher]` (after the student's probe of each problem, returned beside them) the
    /// teacher prompt as one user turn.
    #[allow(clippy::type_complexity)]
    fn step_prompts(
        &self,
        batch: &PromptBatch,
        seed: u64,
    ) -> Result<(
        Option<Vec<(String, grpo_teacher::DiagnosticResult)>>,
        Vec<Prompt>,
    )> {
        let Some(tp) = &self.teaching else {
            let distill = self.cfg.algorithm.is_distillation();
            return Ok((
                None,
                batch
                    .samples
                    .iter()
                    .map(|s| match distill {
                        true => split_last_assistant(&s.prompt).0,
                        false => s.prompt.clone(),
                    })
                    .collect(),
            ));
        };
        let probes = crate::teacher::probe(tp, batch, seed)?;
        let prompts = batch
            .samples
            .iter()
            .zip(&probes)
            .map(|(s, (question, diag))| {
                let user = tp
                    .teacher_prompt(question, diag)
                    .map_err(|e| anyhow!("row {}: {e}", s.index))?;
                Ok(Prompt::Conversation(vec![grpo_data::Message::new(
                    "user", user,
                )]))
            })
            .collect::<Result<_>>()?;
        Ok((Some(probes), prompts))
    }

    /// The rollout server, locked, and whether the policy samples there: its adapter synced to
    /// this version; with a frozen teacher the served base model samples instead (`false`).
    fn synced_server<'a>(
        &mut self,
        remote: &'a Mutex<RemoteGenerator>,
    ) -> Result<(std::sync::MutexGuard<'a, RemoteGenerator>, bool)> {
        let mut server = remote
            .lock()
            .map_err(|_| anyhow!("the rollout server client is poisoned"))?;
        let policy = self.frozen_teacher.is_none();
        if policy {
            self.remote_sync
                .sync(&mut server, &self.model, self.version)?;
        }
        Ok((server, policy))
    }

    /// `num_generations` multi-turn episodes per prompt against `env` (local generation with
    /// the policy), as completions whose tokens are the whole transcript after the prompt,
    /// with the model mask and the environment's rewards beside them.
    fn episodes(&mut self, batch: PromptBatch, env: &dyn Environment) -> Result<Rollouts> {
        let t0 = Instant::now();
        let seed = step_seed(self.cfg.train.seed, batch.draw as u64);
        // With `[teacher]` the teacher's episode starts from the teacher prompt: its guidance is
        // the episode (its turns and the environment's answers), which the student then reads.
        let (teaching, step_prompts) = self.step_prompts(&batch, seed)?;
        let g = self.cfg.rollout.num_generations;
        let metadata: Vec<serde_json::Value> = batch.samples.iter().map(row_metadata).collect();
        // The environment's say before the episodes (TRL's `reset`): text for each prompt, each
        // episode's starting metadata (an ORS session).
        let reset_rows: Vec<serde_json::Value> = metadata
            .iter()
            .zip(&step_prompts)
            .map(|(m, p)| reset_row(m, p))
            .collect();
        let resets = env
            .reset(&reset_rows.iter().collect::<Vec<_>>(), g)
            .map_err(|e| {
                anyhow!(
                    "environment `{}`: reset: {}",
                    env.name(),
                    crate::first_line(&e.to_string())
                )
            })?;
        if resets.len() != metadata.len() {
            bail!(
                "environment `{}`: reset answered {} prompts of {}",
                env.name(),
                resets.len(),
                metadata.len()
            );
        }
        // One request per prompt whose episodes share its start; one per episode where the
        // environment gave each its own (TRL resets each rollout's environment on its own).
        let mut prompts: Vec<EpisodePrompt> = Vec::new();
        let mut texts: Vec<String> = Vec::new();
        // Per request: (its prompt, its first episode, episodes).
        let mut plan: Vec<(usize, usize, usize)> = Vec::new();
        for (p, (((s, prompt), metadata), reset)) in batch
            .samples
            .iter()
            .zip(step_prompts)
            .zip(metadata)
            .zip(resets)
            .enumerate()
        {
            let base = match prompt {
                Prompt::Conversation(m) => chat_messages(&m),
                other => vec![ChatMessage::new("user", other.text())],
            };
            let tools = env.tools_for(&metadata);
            let starts: Vec<(usize, usize)> = match reset.is_shared() {
                true => vec![(0, g)],
                false => (0..g).map(|j| (j, 1)).collect(),
            };
            for (j, n) in starts {
                let mut messages = base.clone();
                reset.start_of(j).apply(&mut messages);
                let (mut ep, text) = EpisodePrompt::rendered(
                    &self.tokenizer,
                    messages,
                    tools.clone(),
                    metadata.clone(),
                )
                .map_err(|e| anyhow!("prompt of row {}: {e}", s.index))?;
                ep.episode_metadata = match n == g {
                    true => reset.episodes.clone(),
                    false => reset.episodes.get(j).cloned().into_iter().collect(),
                };
                // As single-turn prompts (and TRL): the last max_prompt_length tokens are kept.
                let max = self.cfg.rollout.max_prompt_length;
                if max > 0 && ep.ids.len() > max {
                    ep.ids.drain(..ep.ids.len() - max);
                }
                prompts.push(ep);
                texts.push(text);
                plan.push((p, j, n));
            }
        }
        let env_cfg = self.cfg.environment.clone();
        let params = EpisodeParams {
            sampling: self.cfg.rollout.sampling(seed),
            max_turns: env_cfg.max_turns,
            max_tokens_per_turn: env_cfg.tokens_per_turn(&self.cfg.rollout),
            max_total_tokens: env_cfg.total_tokens(&self.cfg.rollout),
        };
        // Episode j of prompt p draws from stream p·g + j, whichever request it is in.
        let requests: Vec<EpisodeRequest<'_>> = prompts
            .iter()
            .zip(&plan)
            .map(|(prompt, &(p, j, n))| EpisodeRequest {
                prompt,
                n,
                seed: params.sampling.seed,
                first_stream: (p * g + j) as u64,
            })
            .collect();
        let generated = match self.remote.clone() {
            // The policy's turns on the rollout server (its synced adapter).
            Some(remote) => {
                let (server, policy) = self.synced_server(&remote)?;
                grpo_rollout::episode::generate_episodes_remote(
                    &server,
                    &self.tokenizer,
                    env,
                    &requests,
                    &params,
                    policy,
                )
            }
            None => {
                let model = self.frozen_teacher.clone().unwrap_or(self.model.clone());
                let decoding = self.decoding_copy(&model)?;
                generate_episodes_batch(&decoding, &self.tokenizer, env, &requests, &params)
            }
        };
        let mut episodes = generated.map_err(|e| {
            anyhow!(
                "environment `{}`: {}",
                env.name(),
                crate::first_line(&e.to_string())
            )
        })?;
        // Each episode's own prompt, then its place in its prompt's group.
        let origins: Vec<EpisodeOrigin> = episodes
            .iter()
            .map(|e| EpisodeOrigin {
                request: e.prompt_index,
                messages: prompts[e.prompt_index].messages.len(),
                text: texts[e.prompt_index].clone(),
            })
            .collect();
        for e in &mut episodes {
            let (p, j, _) = plan[e.prompt_index];
            e.prompt_index = p;
            e.sample_index += j;
        }
        let post = env.post_process(&mut episodes).map_err(|e| {
            anyhow!(
                "environment `{}`: post_process: {}",
                env.name(),
                crate::first_line(&e.to_string())
            )
        })?;
        // A prompt's tokens for the learner: what its episodes' prompts share; an episode's
        // own rest of its prompt goes before its tokens as the environment's.
        let mut prompt_ids: Vec<Vec<u32>> = vec![Vec::new(); batch.samples.len()];
        let mut prompt_texts: Vec<String> = vec![String::new(); batch.samples.len()];
        for (r, &(p, j, _)) in plan.iter().enumerate() {
            let ids = &prompts[r].ids;
            if j == 0 {
                prompt_ids[p] = ids.clone();
                prompt_texts[p] = texts[r].clone();
            } else {
                let shared = prompt_ids[p]
                    .iter()
                    .zip(ids)
                    .take_while(|(a, b)| a == b)
                    .count();
                prompt_ids[p].truncate(shared);
            }
        }
        if let Some(p) = prompt_ids.iter().position(Vec::is_empty) {
            bail!(
                "environment `{}`: the episodes of row {} start with different prompts that share \
                 no first token; give them a common start (a chat template, a system prompt)",
                env.name(),
                batch.samples[p].index
            );
        }
        let mut own_prompt_tokens = Vec::with_capacity(episodes.len());
        for (e, o) in episodes.iter_mut().zip(&origins) {
            let rest = &prompts[o.request].ids[prompt_ids[e.prompt_index].len()..];
            if !rest.is_empty() {
                prepend_environment_tokens(e, rest);
            }
            own_prompt_tokens.push(rest.len());
        }
        let (completions, mut info) = episode_completions(
            &episodes,
            &origins.iter().map(|o| o.messages).collect::<Vec<_>>(),
            env_cfg.reward,
            post,
        );
        info.prompt_texts = origins.iter().map(|o| o.text.clone()).collect();
        info.own_prompt_tokens = own_prompt_tokens;
        info.prompt_messages = episodes
            .iter()
            .zip(&origins)
            .map(|(e, o)| e.messages[..o.messages.min(e.messages.len())].to_vec())
            .collect();
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
            episodes: Some(info),
            source: CompletionSource::Policy,
            greedy: None,
        })
    }
}

/// Where an episode came from: its request, its prompt's messages and rendered text.
struct EpisodeOrigin {
    request: usize,
    messages: usize,
    text: String,
}

/// The seed of XPO's and Nash-MD's second samples, from the step's: another stream of draws
/// than the policy's own samples, so a pair's two completions never share their draws.
fn contrast_seed(seed: u64) -> u64 {
    grpo_data::rng::mix(seed, 0x7870_6f5f_7061_6972, 0)
}

/// XPO's and Nash-MD's pairs in step order: each prompt's policy sample, then its other sample
/// (as the prompt's second).
fn interleave_pairs(mine: Vec<Completion>, theirs: Vec<Completion>) -> Vec<Completion> {
    mine.into_iter()
        .zip(theirs)
        .flat_map(|(a, mut b)| {
            b.sample_index = 1;
            [a, b]
        })
        .collect()
}

/// `e` with `rest` (the end of its own prompt past what its group's prompts share) before its
/// tokens, as the environment's: not the model's, log-prob 0, the turns moved after it.
fn prepend_environment_tokens(e: &mut Episode, rest: &[u32]) {
    let k = rest.len();
    e.token_ids.splice(0..0, rest.iter().copied());
    e.is_model_token.splice(0..0, std::iter::repeat_n(false, k));
    e.logprobs.splice(0..0, std::iter::repeat_n(0.0, k));
    for t in &mut e.turns {
        t.model_tokens = t.model_tokens.start + k..t.model_tokens.end + k;
        t.observation_tokens = t.observation_tokens.start + k..t.observation_tokens.end + k;
    }
}

/// Episodes as completions (the tokens after the prompt, the transcript as text, the sampling
/// log-probs with 0 at environment tokens; `length` when a budget cut the episode or its last
/// turn) and what the learner and the scorer need beside them: the model masks, each
/// episode's `env` reward by `reward`, and the metrics (`post` are the environment's
/// `post_process` metrics, logged as `env/{name}`). `prompt_messages[i]` is the number of
/// messages of episode `i`'s prompt (its messages after them are its completion's).
pub fn episode_completions(
    episodes: &[Episode],
    prompt_messages: &[usize],
    reward: EnvironmentReward,
    post: BTreeMap<String, f64>,
) -> (Vec<Completion>, EpisodeBatch) {
    let completions = episodes
        .iter()
        .map(|e| Completion {
            prompt_index: e.prompt_index,
            sample_index: e.sample_index,
            token_ids: e.token_ids.clone(),
            text: e.text.clone(),
            logprobs: e.logprobs.clone(),
            finish_reason: match e.end {
                EpisodeEnd::MaxTotalTokens => FinishReason::Length,
                _ => e
                    .turns
                    .last()
                    .map_or(FinishReason::Length, |t| t.finish_reason),
            },
            top_logprobs: Vec::new(),
        })
        .collect();
    let rewards: Vec<f32> = episodes.iter().map(|e| reward.of(&e.rewards())).collect();
    let n = episodes.len().max(1) as f64;
    let mut metrics = episode_metrics(episodes);
    metrics.insert(
        "env/turns_mean".into(),
        episodes.iter().map(|e| e.num_turns() as f64).sum::<f64>() / n,
    );
    metrics.insert(
        "env/terminated_ratio".into(),
        episodes.iter().filter(|e| e.terminated()).count() as f64 / n,
    );
    metrics.insert(
        "env/reward_mean".into(),
        rewards.iter().map(|&r| f64::from(r)).sum::<f64>() / n,
    );
    // An environment's own metrics under `env/`; a name with a `/` (a family of its own, such
    // as TRL's `tools/...`) as it is.
    for (k, v) in post {
        match k.contains('/') {
            true => metrics.insert(k, v),
            false => metrics.insert(format!("env/{k}"), v),
        };
    }
    let info = EpisodeBatch {
        metadata: episodes.iter().map(|e| e.metadata.clone()).collect(),
        model_masks: episodes.iter().map(|e| e.is_model_token.clone()).collect(),
        messages: episodes
            .iter()
            .enumerate()
            .map(|(i, e)| {
                let skip = prompt_messages.get(i).copied().unwrap_or(0);
                e.messages.iter().skip(skip).cloned().collect()
            })
            .collect(),
        rewards,
        metrics,
        ..EpisodeBatch::default()
    };
    (completions, info)
}

/// A row's columns as JSON: what an environment's first `step` sees as an episode's metadata.
pub fn row_metadata(sample: &grpo_data::Sample) -> serde_json::Value {
    serde_json::Value::Object(
        sample
            .columns
            .iter()
            .map(|(k, v)| (k.to_string(), json_value(v)))
            .collect(),
    )
}

/// The row `reset` sees, as TRL's `reset(**row)` does: the columns ([`row_metadata`]) and the
/// prompt (a list of `{role, content}` messages, or the text) when no column is named `prompt`.
pub fn reset_row(metadata: &serde_json::Value, prompt: &Prompt) -> serde_json::Value {
    let mut row = metadata.clone();
    if let serde_json::Value::Object(o) = &mut row
        && !o.contains_key("prompt")
    {
        let prompt = match prompt {
            Prompt::Conversation(msgs) => serde_json::Value::Array(
                msgs.iter()
                    .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
                    .collect(),
            ),
            other => serde_json::Value::String(other.text()),
        };
        o.insert("prompt".into(), prompt);
    }
    row
}

/// A data column's value as JSON (an episode's metadata).
fn json_value(v: &grpo_data::Value) -> serde_json::Value {
    use serde_json::Value as J;
    match v {
        grpo_data::Value::Null => J::Null,
        grpo_data::Value::Bool(b) => J::Bool(*b),
        grpo_data::Value::Int(i) => J::from(*i),
        grpo_data::Value::Float(f) => J::from(*f),
        grpo_data::Value::Str(s) => J::String(s.clone()),
        grpo_data::Value::StrList(l) => J::from(l.clone()),
        grpo_data::Value::Messages(m) => J::Array(
            m.iter()
                .map(|m| serde_json::json!({ "role": m.role, "content": m.content }))
                .collect(),
        ),
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
    let (text, ids) = render_prompt(tokenizer, cfg, prompt)?;
    let max = cfg.rollout.max_prompt_length;
    let ids = if max > 0 && ids.len() > max {
        ids[ids.len() - max..].to_vec()
    } else {
        ids
    };
    Ok((text, ids))
}

/// [`encode_prompt`] without the truncation: the rendered text and all its tokens.
pub fn render_prompt(
    tokenizer: &Tokenizer,
    cfg: &TrainConfig,
    prompt: &Prompt,
) -> Result<(String, Vec<u32>)> {
    Ok(match prompt {
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
    })
}

/// A conversation that ends with the assistant's turn as (the conversation before it, that
/// turn); any other prompt as it is, without one.
fn split_last_assistant(p: &Prompt) -> (Prompt, Option<grpo_data::Message>) {
    if let Prompt::Conversation(m) = p
        && let Some((last, rest)) = m.split_last()
        && !rest.is_empty()
        && last.role == "assistant"
    {
        return (Prompt::Conversation(rest.to_vec()), Some(last.clone()));
    }
    (p.clone(), None)
}

/// The dataset's completions of a step's prompts (GKD's off-policy steps), `g` copies each:
/// the row's `distillation.completion_field` (text: after the prompt text, with EOS, as SFT
/// tokenises prompt + completion; messages: the rest of the rendered conversation), or the
/// final assistant turn of a conversation prompt (TRL's GKD). The tokens are those of the
/// whole sequence after where it and the prompt alone part, cut at
/// `rollout.max_completion_length`.
fn dataset_completions(
    tok: &Tokenizer,
    cfg: &TrainConfig,
    batch: &PromptBatch,
    prompt_texts: &[String],
    g: usize,
) -> Result<Vec<Completion>> {
    let field = &cfg.distillation.completion_field;
    let mut out = Vec::with_capacity(batch.samples.len() * g);
    for (i, (s, prompt_text)) in batch.samples.iter().zip(prompt_texts).enumerate() {
        let (prompt, last) = split_last_assistant(&s.prompt);
        let value = s.get(field).filter(|v| !v.is_null()).cloned();
        let full = match (&prompt, value, last) {
            (Prompt::Conversation(p), Some(grpo_data::Value::Messages(turns)), _) => {
                let mut all = p.clone();
                all.extend(turns);
                tok.apply_chat_template(&chat_messages(&all), false)?
            }
            (Prompt::Conversation(p), None, Some(turn)) => {
                let mut all = p.clone();
                all.push(turn);
                tok.apply_chat_template(&chat_messages(&all), false)?
            }
            (_, Some(grpo_data::Value::Messages(_)), _) => bail!(
                "row {}: `{field}` is a conversation but the prompt is plain text",
                s.index
            ),
            (_, Some(v), _) => {
                let text = v.as_text().unwrap_or_default();
                let eos = tok.eos_token.as_deref().unwrap_or("");
                match text.ends_with(eos) {
                    true => format!("{prompt_text}{text}"),
                    false => format!("{prompt_text}{text}{eos}"),
                }
            }
            (_, None, _) => bail!(
                "row {}: no completion for distillation's off-policy step: column `{field}` is \
                 empty and the prompt does not end with an assistant turn",
                s.index
            ),
        };
        let conversation = matches!(prompt, Prompt::Conversation(_)) && cfg.rollout.chat_template;
        let prompt_ids = tok.encode(prompt_text, !conversation)?;
        let full_ids = tok.encode(&full, !conversation)?;
        let shared = prompt_ids
            .iter()
            .zip(&full_ids)
            .take_while(|(a, b)| a == b)
            .count();
        let mut ids = full_ids[shared..].to_vec();
        if ids.is_empty() {
            bail!(
                "row {}: the completion renders to no tokens after the prompt",
                s.index
            );
        }
        let max = cfg.rollout.max_completion_length;
        let finish_reason = match ids.len() > max {
            true => {
                ids.truncate(max);
                FinishReason::Length
            }
            false if ids.last().is_some_and(|t| tok.eos_token_ids.contains(t)) => FinishReason::Eos,
            false => FinishReason::Stop,
        };
        let text = tok.decode(&ids, true)?;
        for j in 0..g {
            out.push(Completion {
                prompt_index: i,
                sample_index: j,
                token_ids: ids.clone(),
                text: text.clone(),
                logprobs: Vec::new(),
                finish_reason,
                top_logprobs: Vec::new(),
            });
        }
    }
    Ok(out)
}

/// grpo-data's messages as the tokenizer's chat messages.
pub fn chat_messages(msgs: &[grpo_data::Message]) -> Vec<ChatMessage> {
    msgs.iter()
        .map(|m| ChatMessage {
            extra: m.extra.clone(),
            ..ChatMessage::new(m.role.clone(), m.content.clone())
        })
        .collect()
}
