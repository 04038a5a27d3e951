//! A scripted episode against a config's environment, without a model (`grpo-cli env`): the
//! prompt as `reset` leaves it (rendered by the model's chat template with the tools), then
//! each given assistant turn with the environment's answer, reward and metadata, then the
//! episode's rewards after `post_process` and its metrics. For environment authors: what the
//! trainer sends an environment and what it gets back, before a run.

use std::collections::BTreeMap;

use anyhow::{Result, anyhow, bail};
use grpo_data::{Dataset, Prompt};
use grpo_rollout::episode::{EpisodeEnd, Turn};
use grpo_rollout::{ChatMessage, Episode, FinishReason};
use serde::Serialize;
use serde_json::Value;

use crate::config::TrainConfig;
use crate::stages::{chat_messages, reset_row, row_metadata};

/// One scripted turn and the environment's answer.
#[derive(Debug, Clone, Serialize)]
pub struct PlayedTurn {
    /// The assistant's text, as given.
    pub assistant: String,
    /// The message the model would see next (`None`: none, or the episode ended).
    pub observation: Option<ChatMessage>,
    /// The turn's reward.
    pub reward: f32,
    /// Whether the environment ended the episode.
    pub terminated: bool,
    /// The episode's metadata after the turn.
    pub metadata: Value,
}

/// What [`play`] found.
#[derive(Debug, Clone, Serialize)]
pub struct Playthrough {
    /// The environment's name.
    pub environment: String,
    /// The row `reset` saw (its columns and prompt).
    pub row: Value,
    /// The prompt's messages after `reset`.
    pub messages: Vec<ChatMessage>,
    /// The tools' names, as the prompt offers them.
    pub tools: Vec<String>,
    /// The prompt rendered by the model's chat template (with the tools); `None` when the
    /// model's tokenizer could not be read.
    pub rendered: Option<String>,
    /// The turns taken (up to the one that ended the episode).
    pub turns: Vec<PlayedTurn>,
    /// Turns given after the episode had ended, not sent.
    pub unused_turns: usize,
    /// Each turn's reward after `post_process` (which may change them, e.g. a factory class's
    /// `get_reward` added to the last).
    pub rewards: Vec<f32>,
    /// The episode's `env` reward (`environment.reward` of `rewards`).
    pub reward: f32,
    /// `post_process`'s metrics.
    pub metrics: BTreeMap<String, f64>,
}

/// Plays `turns` against the environment of `cfg` on row `row` of its training data (or, for
/// an environment that owns its data, an empty user prompt): `reset`, one `step` per turn until
/// the environment ends the episode, `post_process`, `release`.
pub fn play(cfg: &TrainConfig, row: usize, turns: &[String]) -> Result<Playthrough> {
    let workers = grpo_rewards::python::PythonWorkers::new();
    let Some(env) = crate::setup::configured_environment(cfg, &workers)? else {
        bail!("config: no `[environment] type`: there is no environment to play");
    };
    let name = env.name().to_owned();
    let sample = match cfg.data.path.is_empty() {
        true if cfg.environment.owns_data() => {
            Dataset::empty_conversations(&cfg.data.prompt_field, 1)
                .and_then(|d| d.head(1))
                .map_err(|e| anyhow!("data: {e}"))?
        }
        true => bail!("config: `data.path` is required (the row to play)"),
        false => {
            let splits = cfg
                .data
                .open(cfg.train.seed)
                .map_err(|e| anyhow!("data: {e}"))?;
            let rows = splits
                .train
                .head(row + 1)
                .map_err(|e| anyhow!("data: {e}"))?;
            if rows.len() <= row {
                bail!(
                    "--row {row}: the training data has {} rows (0 to {})",
                    rows.len(),
                    rows.len().saturating_sub(1)
                );
            }
            rows
        }
    }
    .pop()
    .ok_or_else(|| anyhow!("data: no row"))?;
    let metadata = row_metadata(&sample);
    let reset_with = reset_row(&metadata, &sample.prompt);
    let reset = env
        .reset(&[&reset_with], 1)
        .map_err(|e| anyhow!("environment `{name}`: reset: {e}"))?
        .pop()
        .ok_or_else(|| anyhow!("environment `{name}`: reset answered no prompt"))?;
    let mut messages = match &sample.prompt {
        Prompt::Conversation(m) => chat_messages(m),
        other => vec![ChatMessage::new("user", other.text())],
    };
    reset.start_of(0).apply(&mut messages);
    let tools = env.tools_for(&metadata);
    let tool_names = tools
        .iter()
        .filter_map(|t| t["function"]["name"].as_str().map(str::to_owned))
        .collect();
    let rendered = grpo_rollout::loader::load_tokenizer(&cfg.model.path)
        .ok()
        .and_then(|t| {
            t.apply_chat_template_with_tools(&messages, &tools, true)
                .ok()
        });
    let mut meta = reset.episodes.first().cloned().unwrap_or(metadata);
    let mut log = messages.clone();
    let mut played = Vec::new();
    let mut unused = 0;
    for (k, text) in turns.iter().enumerate() {
        if played.last().is_some_and(|t: &PlayedTurn| t.terminated) {
            unused = turns.len() - k;
            break;
        }
        log.push(ChatMessage::new("assistant", text.clone()));
        let answer = env
            .step(&[log.as_slice()], &[&meta])
            .and_then(|r| r.validate(1, &name).map(|()| r))
            .map_err(|e| anyhow!("environment `{name}`: turn {}: {e}", k + 1))?;
        meta = answer.metadata[0].clone();
        let terminated = answer.terminateds[0];
        let observation = answer.observations[0].clone();
        if let (Some(o), false) = (&observation, terminated) {
            log.push(o.clone());
        }
        played.push(PlayedTurn {
            assistant: text.clone(),
            observation,
            reward: answer.rewards[0],
            terminated,
            metadata: meta.clone(),
        });
    }
    let mut episode = Episode {
        prompt_index: 0,
        sample_index: 0,
        token_ids: Vec::new(),
        is_model_token: Vec::new(),
        logprobs: Vec::new(),
        turns: played
            .iter()
            .map(|t| Turn {
                model_tokens: 0..0,
                finish_reason: FinishReason::Stop,
                reward: t.reward,
                observation_tokens: 0..0,
            })
            .collect(),
        end: match played.last().is_some_and(|t| t.terminated) {
            true => EpisodeEnd::Terminated,
            false => EpisodeEnd::MaxTurns,
        },
        messages: log,
        unshown_observation: None,
        metadata: meta.clone(),
        text: String::new(),
    };
    let post = env.post_process(std::slice::from_mut(&mut episode));
    // Whatever post_process said, the episode's resources go back.
    let released = env.release(&[&meta]);
    let metrics = post.map_err(|e| anyhow!("environment `{name}`: post_process: {e}"))?;
    released.map_err(|e| anyhow!("environment `{name}`: release: {e}"))?;
    let rewards = episode.rewards();
    Ok(Playthrough {
        environment: name,
        row: reset_with,
        messages,
        tools: tool_names,
        rendered,
        turns: played,
        unused_turns: unused,
        reward: cfg.environment.reward.of(&rewards),
        rewards,
        metrics,
    })
}
