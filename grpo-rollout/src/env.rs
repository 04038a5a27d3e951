//! The environment seam: what a multi-turn episode talks to between the model's turns.
//!
//! It follows NeMo RL's `EnvironmentInterface`. After each model turn, [`generate_episodes`]
//! hands the environment the message logs of every episode still running (OpenAI-style
//! `{role, content}` messages: the prompt's messages, then the assistant turns and the
//! observations so far, the turn just sampled last) with each episode's metadata, in one batch
//! call ([`Environment::step`]). The environment answers, per episode, an [`EnvironmentReturn`]
//! row: an observation to show the model next (a `user`, `tool` or `environment` message, or
//! none), new metadata, the stop strings of the model's next turn, the turn's reward and
//! whether the episode is over. [`Environment::post_process`] then sees the finished episodes
//! of a whole batch at once (NeMo RL's `global_post_process_and_metrics`): it may adjust them
//! (e.g. rewards that depend on the group) and returns metrics. Before a batch's episodes start,
//! [`Environment::reset`] (TRL's `environment_factory` `reset`) may add text to each prompt and
//! give each episode its starting metadata (an environment with a session per episode opens
//! them there: `ors`).
//!
//! Generation calls the seam once per turn for the whole batch and waits for the answer.
//! [`Environment`] is the synchronous form. An environment that talks to the outside (an HTTP
//! sandbox, a judge, a database) implements `AsyncEnvironment` instead (feature `async`,
//! on with `remote`): its `step` is an `async fn` that may await every episode's request at
//! once, and `Blocking` runs it on a tokio runtime of its own wherever an [`Environment`]
//! is expected. Implementations are `Send + Sync` so one environment can serve several
//! generator threads.
//!
//! [`generate_episodes`]: crate::episode::generate_episodes

use std::collections::BTreeMap;

use candle_core::Result;
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::episode::Episode;
use crate::tokenizer::ChatMessage;

/// Roles an observation may have.
pub const OBSERVATION_ROLES: [&str; 3] = ["user", "tool", "environment"];

/// What an environment says before a prompt's episodes start ([`Environment::reset`], TRL's
/// `environment_factory` `reset`): text for the prompt and each episode's starting metadata.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentReset {
    /// Text appended to the prompt's last user message (a user message of its own when the
    /// prompt does not end with one), as TRL appends `reset()`'s return; `None` = the prompt
    /// as it is. Shared by the prompt's episodes unless [`Self::episode_starts`] gives each
    /// its own.
    pub observation: Option<String>,
    /// The starting metadata of each of the prompt's episodes, in order (what the first
    /// [`Environment::step`] sees: a session id, a seed); empty = the prompt's metadata for
    /// every episode.
    pub episodes: Vec<Value>,
    /// A conversation the task starts with (an ORS environment's `/messages`), added after the
    /// prompt's messages — in place of its last one when that is an empty user message (the
    /// rows of a task dataset) — before [`Self::observation`]. Empty = none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<ChatMessage>,
    /// Each episode's own start when the prompt's episodes do not share one (TRL resets each
    /// rollout's environment on its own: an environment that owns its data may give every
    /// instance another task): episode `j` starts from `episode_starts[j]` in place of
    /// [`Self::observation`] and [`Self::messages`]. Empty = the episodes share the prompt.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub episode_starts: Vec<EpisodeStart>,
}

/// How one episode's prompt starts: text appended to the prompt, a conversation added before
/// it (as [`EnvironmentReset::observation`] and [`EnvironmentReset::messages`]).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EpisodeStart {
    /// Text appended to the prompt's last user message; `None` = none.
    pub observation: Option<String>,
    /// A conversation added after the prompt's messages; empty = none.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub messages: Vec<ChatMessage>,
}

impl EpisodeStart {
    /// `messages` with [`Self::messages`] added (replacing an empty last user message), then
    /// [`Self::observation`] appended to the last user message (a new user message when the
    /// last one is not the user's).
    pub fn apply(&self, messages: &mut Vec<ChatMessage>) {
        if !self.messages.is_empty() {
            if messages
                .last()
                .is_some_and(|m| m.role == "user" && m.content.trim().is_empty())
            {
                messages.pop();
            }
            messages.extend(self.messages.iter().cloned());
        }
        let Some(text) = &self.observation else {
            return;
        };
        match messages.last_mut() {
            Some(m) if m.role == "user" => m.content.push_str(text),
            _ => messages.push(ChatMessage::new("user", text.clone())),
        }
    }
}

impl EnvironmentReset {
    /// A prompt's reset from each episode's start and starting metadata: one shared start when
    /// they are all the same, else [`Self::episode_starts`].
    pub fn from_starts(starts: Vec<EpisodeStart>, episodes: Vec<Value>) -> Self {
        let shared = starts.windows(2).all(|w| w[0] == w[1]);
        match (shared, starts.first()) {
            (true, Some(first)) => Self {
                observation: first.observation.clone(),
                messages: first.messages.clone(),
                episodes,
                episode_starts: Vec::new(),
            },
            (true, None) => Self {
                episodes,
                ..Self::default()
            },
            (false, _) => Self {
                episodes,
                episode_starts: starts,
                ..Self::default()
            },
        }
    }

    /// Whether the prompt's episodes share one start.
    pub fn is_shared(&self) -> bool {
        self.episode_starts.is_empty()
    }

    /// Episode `j`'s start: its own, or the shared one.
    pub fn start_of(&self, j: usize) -> EpisodeStart {
        self.episode_starts
            .get(j)
            .cloned()
            .unwrap_or_else(|| self.shared_start())
    }

    /// The start the prompt's episodes share ([`Self::observation`], [`Self::messages`]).
    fn shared_start(&self) -> EpisodeStart {
        EpisodeStart {
            observation: self.observation.clone(),
            messages: self.messages.clone(),
        }
    }

    /// `messages` as the shared start leaves them ([`EpisodeStart::apply`]).
    pub fn apply(&self, messages: &mut Vec<ChatMessage>) {
        self.shared_start().apply(messages);
    }
}

/// `row` (a JSON object; anything else counts as an empty one) with `key` set to `value`: an
/// episode's starting metadata, its row and what the environment keeps for it (a session id).
pub fn row_with(row: &Value, key: &str, value: Value) -> Value {
    let mut o = match row {
        Value::Object(o) => o.clone(),
        _ => serde_json::Map::new(),
    };
    o.insert(key.to_owned(), value);
    Value::Object(o)
}

/// An environment's answer for a batch of episodes: every vector has one entry per episode, in
/// the order the episodes were given to [`Environment::step`].
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
pub struct EnvironmentReturn {
    /// The message the model sees before its next turn (role `user`, `tool` or
    /// `environment`), or `None`: the model's next turn follows its last one directly (after
    /// the chat template's end of turn and generation prompt).
    pub observations: Vec<Option<ChatMessage>>,
    /// Each episode's new metadata (replaces what it had; it goes to the next `step` and ends
    /// in [`Episode::metadata`]).
    pub metadata: Vec<Value>,
    /// Stop strings of each episode's next model turn; `None` keeps the sampling parameters'
    /// `stop`.
    pub next_stop_strings: Vec<Option<Vec<String>>>,
    /// The reward of the turn just taken (finite).
    pub rewards: Vec<f32>,
    /// Whether the episode is over (its observation, if any, is not shown to the model).
    pub terminateds: Vec<bool>,
}

impl EnvironmentReturn {
    /// An answer for `n` episodes: no observation, null metadata, default stop strings, reward
    /// 0, not terminated; fill in what the environment decides.
    pub fn empty(n: usize) -> Self {
        Self {
            observations: vec![None; n],
            metadata: vec![Value::Null; n],
            next_stop_strings: vec![None; n],
            rewards: vec![0.0; n],
            terminateds: vec![false; n],
        }
    }

    /// Checks that every vector answers `n` episodes, rewards are finite and observations have
    /// an observation role; errors name `env`.
    pub fn validate(&self, n: usize, env: &str) -> Result<()> {
        let lens = [
            ("observations", self.observations.len()),
            ("metadata", self.metadata.len()),
            ("next_stop_strings", self.next_stop_strings.len()),
            ("rewards", self.rewards.len()),
            ("terminateds", self.terminateds.len()),
        ];
        if let Some((what, len)) = lens.iter().find(|(_, len)| *len != n) {
            candle_core::bail!(
                "environment `{env}` returned {len} {what} for {n} episodes: step must answer every episode it is given"
            );
        }
        if let Some((i, r)) = self
            .rewards
            .iter()
            .enumerate()
            .find(|(_, r)| !r.is_finite())
        {
            candle_core::bail!(
                "environment `{env}` returned reward {r} for episode {i}: rewards must be finite"
            );
        }
        for (i, o) in self.observations.iter().enumerate() {
            if let Some(m) = o
                && !OBSERVATION_ROLES.contains(&m.role.as_str())
            {
                candle_core::bail!(
                    "environment `{env}` returned an observation with role `{}` for episode {i}: use one of user, tool, environment",
                    m.role
                );
            }
        }
        Ok(())
    }
}

/// A multi-turn environment (NeMo RL's `EnvironmentInterface`). See the [module docs](self).
pub trait Environment: Send + Sync {
    /// The name errors and metrics use (by default the type's name).
    fn name(&self) -> &str {
        std::any::type_name::<Self>()
    }

    /// The JSON schemas of the tools the model may call, rendered into the prompt by the chat
    /// template's `tools` variable (a [`crate::tools::ToolEnvironment`]'s tools). Episode
    /// prompts must be made with them ([`crate::EpisodePrompt::rendered`]). Default none.
    fn tools(&self) -> Vec<Value> {
        Vec::new()
    }

    /// The tools a prompt with `metadata` (its row) is rendered with: by default
    /// [`Self::tools`]; an environment that routes rows to several (TRL's dict of
    /// `environment_factory`) shows each row only its own.
    fn tools_for(&self, metadata: &Value) -> Vec<Value> {
        let _ = metadata;
        self.tools()
    }

    /// Answers one turn of a batch of episodes: `logs[i]` is episode `i`'s message log, its
    /// last message the model's turn just sampled (role `assistant`), and `metadata[i]` its
    /// metadata (the prompt's at the first turn, then what the previous `step` returned). The
    /// answer has one entry per episode ([`EnvironmentReturn`]). An error stops the generation
    /// call and is reported with the environment's name.
    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn>;

    /// Called once for a batch of prompts before their episodes start (TRL's
    /// `environment_factory` `reset`, batched): `metadata[p]` is prompt `p`'s (its dataset
    /// row), `n` the episodes each prompt gets. Returns one [`EnvironmentReset`] per prompt:
    /// text the prompt gains (or each episode's own, [`EnvironmentReset::episode_starts`]) and
    /// each episode's starting metadata (an environment that keeps a session per episode opens
    /// them here and puts their ids there). The caller renders the prompts after it
    /// ([`EnvironmentReset::start_of`]). By default nothing changes.
    fn reset(&self, metadata: &[&Value], n: usize) -> Result<Vec<EnvironmentReset>> {
        let _ = n;
        Ok(vec![EnvironmentReset::default(); metadata.len()])
    }

    /// Post-processes a whole batch of finished episodes (NeMo RL's
    /// `global_post_process_and_metrics`): may change them (rewards, metadata) and returns
    /// metrics by name. The caller runs it once over everything a training step collected.
    /// By default nothing changes and there are no metrics.
    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        let _ = episodes;
        Ok(BTreeMap::new())
    }

    /// Called once a batch's episodes have been scored (their rewards computed), with each
    /// episode's last metadata: what they held may go (an `environment_factory` class's
    /// instances go back to its pool; reward functions read them until then). By default
    /// nothing.
    fn release(&self, metadata: &[&Value]) -> Result<()> {
        let _ = metadata;
        Ok(())
    }
}

/// An environment whose `step` and `post_process` calls may take at most `limit`: a call
/// still running then is an error naming the environment (and the limit's config key,
/// `environment.step_timeout`), so a hanging environment ends the run instead of stalling it.
/// The call runs on a thread of its own, which is left behind when it does not return (a
/// Rust thread cannot be stopped from outside).
pub struct TimeLimited {
    inner: std::sync::Arc<dyn Environment>,
    limit: std::time::Duration,
}

impl std::fmt::Debug for TimeLimited {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TimeLimited")
            .field("inner", &self.inner.name())
            .field("limit", &self.limit)
            .finish()
    }
}

impl TimeLimited {
    /// `inner` with calls limited to `limit`.
    pub fn new(inner: std::sync::Arc<dyn Environment>, limit: std::time::Duration) -> Self {
        Self { inner, limit }
    }

    fn run<T: Send + 'static>(
        &self,
        what: &str,
        f: impl FnOnce(&dyn Environment) -> Result<T> + Send + 'static,
    ) -> Result<T> {
        let env = self.inner.clone();
        let (tx, rx) = std::sync::mpsc::channel();
        std::thread::Builder::new()
            .name("grpo-environment".into())
            .spawn(move || {
                let out = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&*env)));
                let _ = tx.send(out);
            })
            .map_err(|e| candle_core::Error::msg(format!("cannot start a thread: {e}")))?;
        match rx.recv_timeout(self.limit) {
            Ok(Ok(out)) => out,
            Ok(Err(panic)) => {
                let why = panic
                    .downcast_ref::<&str>()
                    .map(|s| (*s).to_owned())
                    .or_else(|| panic.downcast_ref::<String>().cloned())
                    .unwrap_or_else(|| "a panic".into());
                candle_core::bail!("{what} panicked: {why}")
            }
            Err(_) => candle_core::bail!(
                "{what} did not return within {} s (environment.step_timeout)",
                self.limit.as_secs_f64()
            ),
        }
    }
}

impl Environment for TimeLimited {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn tools(&self) -> Vec<Value> {
        self.inner.tools()
    }

    fn tools_for(&self, metadata: &Value) -> Vec<Value> {
        self.inner.tools_for(metadata)
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let logs: Vec<Vec<ChatMessage>> = logs.iter().map(|l| l.to_vec()).collect();
        let metadata: Vec<Value> = metadata.iter().map(|m| (*m).clone()).collect();
        self.run("step", move |env| {
            let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
            let m: Vec<&Value> = metadata.iter().collect();
            env.step(&l, &m)
        })
    }

    fn reset(&self, metadata: &[&Value], n: usize) -> Result<Vec<EnvironmentReset>> {
        let metadata: Vec<Value> = metadata.iter().map(|m| (*m).clone()).collect();
        self.run("reset", move |env| {
            let m: Vec<&Value> = metadata.iter().collect();
            env.reset(&m, n)
        })
    }

    fn release(&self, metadata: &[&Value]) -> Result<()> {
        let metadata: Vec<Value> = metadata.iter().map(|m| (*m).clone()).collect();
        self.run("release", move |env| {
            let m: Vec<&Value> = metadata.iter().collect();
            env.release(&m)
        })
    }

    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        let mut owned = episodes.to_vec();
        let (owned, metrics) = self.run("post_process", move |env| {
            let m = env.post_process(&mut owned)?;
            Ok((owned, m))
        })?;
        episodes.clone_from_slice(&owned);
        Ok(metrics)
    }
}

/// An environment whose calls await the outside (feature `async`): the same calls as
/// [`Environment`], as futures. `step` sees the whole batch, so it can send every episode's
/// request at once (e.g. `futures::future::join_all` over an HTTP client's calls) instead of one
/// after another. Wrap it in [`Blocking`] to use it wherever an [`Environment`] is expected
/// (`generate_episodes`, the trainer).
///
/// Implementations may write `async fn step(&self, logs: &[&[ChatMessage]], metadata:
/// &[&Value]) -> Result<EnvironmentReturn>` as long as the future is `Send`.
#[cfg(feature = "async")]
pub trait AsyncEnvironment: Send + Sync {
    /// As [`Environment::name`].
    fn name(&self) -> &str {
        std::any::type_name::<Self>()
    }

    /// As [`Environment::tools`].
    fn tools(&self) -> Vec<Value> {
        Vec::new()
    }

    /// As [`Environment::tools_for`].
    fn tools_for(&self, metadata: &Value) -> Vec<Value> {
        let _ = metadata;
        self.tools()
    }

    /// As [`Environment::step`], awaited.
    fn step(
        &self,
        logs: &[&[ChatMessage]],
        metadata: &[&Value],
    ) -> impl std::future::Future<Output = Result<EnvironmentReturn>> + Send;

    /// As [`Environment::reset`], awaited. By default nothing changes.
    fn reset(
        &self,
        metadata: &[&Value],
        n: usize,
    ) -> impl std::future::Future<Output = Result<Vec<EnvironmentReset>>> + Send {
        let _ = n;
        let out = vec![EnvironmentReset::default(); metadata.len()];
        async move { Ok(out) }
    }

    /// As [`Environment::release`], awaited. By default nothing.
    fn release(&self, metadata: &[&Value]) -> impl std::future::Future<Output = Result<()>> + Send {
        let _ = metadata;
        async { Ok(()) }
    }

    /// As [`Environment::post_process`], awaited. By default nothing changes and there are no
    /// metrics.
    fn post_process(
        &self,
        episodes: &mut [Episode],
    ) -> impl std::future::Future<Output = Result<BTreeMap<String, f64>>> + Send {
        let _ = episodes;
        async { Ok(BTreeMap::new()) }
    }
}

/// An [`AsyncEnvironment`] as an [`Environment`] (feature `async`): each call is driven to its
/// end on a multi-threaded tokio runtime the wrapper owns (two worker threads, which also run
/// the tasks the environment spawns, its timers and its sockets). Called from inside another
/// tokio runtime, the call is driven from a scoped thread of its own, so it never nests
/// runtimes.
#[cfg(feature = "async")]
pub struct Blocking<E> {
    inner: E,
    runtime: tokio::runtime::Runtime,
}

#[cfg(feature = "async")]
impl<E: AsyncEnvironment> std::fmt::Debug for Blocking<E> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Blocking")
            .field("inner", &self.inner.name())
            .finish_non_exhaustive()
    }
}

#[cfg(feature = "async")]
impl<E: AsyncEnvironment> Blocking<E> {
    /// `inner` with a runtime of its own.
    pub fn new(inner: E) -> Result<Self> {
        let runtime = runtime()
            .map_err(|e| candle_core::Error::msg(format!("environment `{}`: {e}", inner.name())))?;
        Ok(Self { inner, runtime })
    }

    /// The environment `make` builds (e.g. one that connects to a server first), built on the
    /// runtime it will then run on.
    pub fn build(make: impl std::future::Future<Output = Result<E>> + Send) -> Result<Self> {
        let runtime =
            runtime().map_err(|e| candle_core::Error::msg(format!("environment: {e}")))?;
        let inner = drive(&runtime, make)?;
        Ok(Self { inner, runtime })
    }

    /// The wrapped environment.
    pub fn inner(&self) -> &E {
        &self.inner
    }

    fn block_on<T: Send>(&self, fut: impl std::future::Future<Output = T> + Send) -> T {
        drive(&self.runtime, fut)
    }
}

/// The runtime a [`Blocking`] owns: two worker threads, timers and sockets.
#[cfg(feature = "async")]
fn runtime() -> std::result::Result<tokio::runtime::Runtime, String> {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .thread_name("grpo-environment-async")
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a tokio runtime: {e}"))
}

/// `fut` driven to its end on `runtime`; from inside another tokio runtime, on a scoped thread
/// of its own, so runtimes never nest.
#[cfg(feature = "async")]
fn drive<T: Send>(
    runtime: &tokio::runtime::Runtime,
    fut: impl std::future::Future<Output = T> + Send,
) -> T {
    if tokio::runtime::Handle::try_current().is_err() {
        return runtime.block_on(fut);
    }
    std::thread::scope(|s| match s.spawn(|| runtime.block_on(fut)).join() {
        Ok(out) => out,
        Err(panic) => std::panic::resume_unwind(panic),
    })
}

#[cfg(feature = "async")]
impl<E: AsyncEnvironment> Environment for Blocking<E> {
    fn name(&self) -> &str {
        self.inner.name()
    }

    fn tools(&self) -> Vec<Value> {
        self.inner.tools()
    }

    fn tools_for(&self, metadata: &Value) -> Vec<Value> {
        self.inner.tools_for(metadata)
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        self.block_on(self.inner.step(logs, metadata))
    }

    fn reset(&self, metadata: &[&Value], n: usize) -> Result<Vec<EnvironmentReset>> {
        self.block_on(self.inner.reset(metadata, n))
    }

    fn release(&self, metadata: &[&Value]) -> Result<()> {
        self.block_on(self.inner.release(metadata))
    }

    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        self.block_on(self.inner.post_process(episodes))
    }
}
