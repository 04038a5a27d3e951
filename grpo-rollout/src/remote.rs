//! Generation on an OpenAI-compatible server (vLLM in production, `grpo-cli serve` in tests):
//! the same [`Completion`]s as [`crate::generate()`], from `POST /v1/completions`, and weight
//! sync through vLLM's `POST /v1/load_lora_adapter` / `unload_lora_adapter`.
//!
//! The client is async-openai's, with its "bring your own types" (`byot`) methods: the request
//! is our own type carrying vLLM's extensions (prompts as token ids, `return_token_ids`,
//! `return_tokens_as_token_ids`, `logprobs`, `top_k`, `min_p`, ...) and the answer is read as
//! JSON, so every field vLLM adds is kept. Its transport is grpo-rewards' [`StatusAware`] (the
//! judges' too), which keeps a failed response's status and `Retry-After`; retries follow
//! [`RemoteConfig::retry_policy`], the judges' [`RetryPolicy`].
//!
//! Token ids come from vLLM's extensions: `return_token_ids` (a choice's `token_ids`), else
//! `return_tokens_as_token_ids` (log-prob tokens spelled `token_id:N`). A server that has
//! neither gets its text re-tokenised with our tokenizer; its log-probs are kept only when their
//! count matches the re-tokenised ids (otherwise `logprobs` is empty and the learner treats the
//! sample as on-policy). Prompts are sent as token ids, so the server never re-tokenises them.
//!
//! The recorded log-prob of a token is what the server returns: `grpo-cli serve` gives
//! `log_softmax(logits / temperature)` as local generation does; start vLLM with
//! `--logprobs-mode processed_logprobs` for the same quantity.
//!
//! Blocking API (a private current-thread tokio runtime), for the trainer's generator thread.

use std::collections::BTreeMap;
use std::path::Path;
use std::time::Duration;

use async_openai::Client;
use async_openai::config::{Config, OpenAIConfig};
use async_openai::error::OpenAIError;
use async_openai::middleware::HttpRequestFactory;
use candle_core::{Result, bail};
use grpo_rewards::http::{
    HttpFailure, RetryDecision, RetryPolicy, StatusAware, openai_client, retryable_status,
};
use serde::{Deserialize, Serialize};
use serde_json::{Value, json};

use crate::generate::{Completion, FinishReason, SamplingParams};
use crate::tokenizer::Tokenizer;

/// `d` of the first retry (see [`RemoteConfig::retry_policy`]).
pub const INITIAL_BACKOFF: Duration = Duration::from_secs(1);
/// The cap of `d` (see [`RemoteConfig::retry_policy`]).
pub const MAX_BACKOFF: Duration = Duration::from_secs(30);

/// Where the server is and how long to wait for it.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct RemoteConfig {
    /// The server's OpenAI base URL, e.g. `http://127.0.0.1:8000/v1`.
    pub base_url: String,
    /// Bearer token (vLLM's `--api-key`); empty = none.
    pub api_key: String,
    /// The served base model's name; empty = the first model `/v1/models` lists.
    pub model: String,
    /// Seconds one completions request may take.
    pub request_timeout: f64,
    /// Seconds a LoRA load/unload (or the first `/v1/models`) may take.
    pub sync_timeout: f64,
    /// Retries of a request that failed to connect or got 408, 409, 429 or 5xx, after waits of
    /// [`RemoteConfig::retry_policy`] (exponential backoff with equal jitter from 1 s, capped
    /// at 30 s, or the server's `Retry-After`). A request that timed out is not retried.
    pub max_retries: u32,
}

impl Default for RemoteConfig {
    fn default() -> Self {
        Self {
            base_url: "http://127.0.0.1:8000/v1".into(),
            api_key: String::new(),
            model: String::new(),
            request_timeout: 600.0,
            sync_timeout: 60.0,
            max_retries: 3,
        }
    }
}

impl RemoteConfig {
    /// The judges' retry policy with `max_retries`, [`INITIAL_BACKOFF`] and [`MAX_BACKOFF`]:
    /// before retry `k` (0 for the first), a uniformly random wait between `d/2` and `d`,
    /// `d = min(1 s · 2^k, 30 s)`; when the failed response carried `Retry-After`
    /// (delta-seconds or an HTTP date) or `retry-after-ms`, exactly that wait instead, up to
    /// 10 minutes ([`grpo_rewards::http::MAX_RETRY_AFTER`]).
    pub fn retry_policy(&self) -> RetryPolicy {
        RetryPolicy::new(self.max_retries, INITIAL_BACKOFF, MAX_BACKOFF)
    }
}

/// A client of one OpenAI-compatible server.
#[derive(Debug)]
pub struct RemoteGenerator {
    cfg: RemoteConfig,
    base: String,
    client: Client<OpenAIConfig>,
    /// For the LoRA endpoints (see [`RemoteGenerator::post_text`]).
    http: reqwest::Client,
    transport: StatusAware,
    rt: tokio::runtime::Runtime,
    served: String,
    adapter: Option<String>,
}

fn err(msg: impl std::fmt::Display) -> candle_core::Error {
    candle_core::Error::msg(msg.to_string())
}

/// vLLM's `/v1/completions` request: OpenAI's fields plus vLLM's extensions (async-openai's own
/// request type has none of them), sent with `create_byot`. The sampling extensions are sent
/// only when used: plain OpenAI servers refuse them.
#[derive(Debug, Serialize)]
struct CompletionRequest<'a> {
    model: &'a str,
    /// Token ids, so the server never re-tokenises the prompts.
    prompt: &'a [Vec<u32>],
    n: usize,
    max_tokens: usize,
    temperature: f64,
    top_p: f64,
    /// OpenAI and vLLM take a signed 64-bit seed; `grpo-cli serve` reads the bits back.
    seed: i64,
    /// The sampled token's log-prob (no alternatives).
    logprobs: u32,
    return_tokens_as_token_ids: bool,
    return_token_ids: bool,
    #[serde(skip_serializing_if = "Option::is_none")]
    top_k: Option<usize>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_p: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    repetition_penalty: Option<f64>,
    #[serde(skip_serializing_if = "Option::is_none")]
    min_tokens: Option<usize>,
    #[serde(skip_serializing_if = "<[String]>::is_empty")]
    stop: &'a [String],
    #[serde(skip_serializing_if = "<[u32]>::is_empty")]
    stop_token_ids: &'a [u32],
    #[serde(skip_serializing_if = "BTreeMap::is_empty")]
    logit_bias: BTreeMap<String, f32>,
    /// vLLM's `{"regex": pattern}` ([`SamplingParams::regex`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    structured_outputs: Option<StructuredOutputs<'a>>,
}

/// vLLM's `structured_outputs` request field, as far as a regex.
#[derive(Debug, Serialize)]
struct StructuredOutputs<'a> {
    regex: &'a str,
}

impl<'a> CompletionRequest<'a> {
    /// `n` samples of each of `prompts` with `params`.
    fn new(model: &'a str, prompts: &'a [Vec<u32>], n: usize, params: &'a SamplingParams) -> Self {
        Self {
            model,
            prompt: prompts,
            n,
            max_tokens: params.max_new_tokens,
            temperature: params.temperature,
            top_p: params.top_p,
            seed: params.seed as i64,
            logprobs: 0,
            return_tokens_as_token_ids: true,
            return_token_ids: true,
            top_k: (params.top_k > 0).then_some(params.top_k),
            min_p: (params.min_p > 0.0).then_some(params.min_p),
            repetition_penalty: (params.repetition_penalty != 1.0)
                .then_some(params.repetition_penalty),
            min_tokens: (params.min_new_tokens > 0).then_some(params.min_new_tokens),
            stop: &params.stop,
            stop_token_ids: &params.stop_token_ids,
            logit_bias: params
                .logit_bias
                .iter()
                .map(|&(id, b)| (id.to_string(), b))
                .collect(),
            structured_outputs: params
                .regex
                .as_deref()
                .map(|regex| StructuredOutputs { regex }),
        }
    }
}

/// A scoring request: `echo` with the sampled token's log-prob, one greedy token (ignored):
/// the server's log-probs of the prompts' own tokens (vLLM's prompt log-probs; `grpo-cli
/// serve`'s `echo`).
#[derive(Debug, Serialize)]
struct EchoRequest<'a> {
    model: &'a str,
    prompt: &'a [Vec<u32>],
    max_tokens: usize,
    temperature: f64,
    echo: bool,
    logprobs: u32,
    return_tokens_as_token_ids: bool,
}

/// A sequence as a server scored it ([`RemoteGenerator::prompt_top_logprobs`]).
#[derive(Debug, Clone, PartialEq)]
pub struct SequenceScores {
    /// The log-prob of each token after the first.
    pub logprobs: Vec<f32>,
    /// At each of those positions the most likely tokens and their log-probs, most likely
    /// first (empty when none were asked for).
    pub top: Vec<Vec<(u32, f32)>>,
}

/// One position's `top_logprobs` entry (`{"token_id:N": logprob, ...}`): its `k` most likely
/// tokens, most likely first.
fn top_entries(entry: Option<&Value>, k: usize) -> std::result::Result<Vec<(u32, f32)>, String> {
    let map = entry
        .and_then(Value::as_object)
        .ok_or("a position without `top_logprobs`")?;
    let mut items = map
        .iter()
        .map(|(key, v)| {
            let id = key
                .strip_prefix("token_id:")
                .and_then(|x| x.parse::<u32>().ok())
                .ok_or_else(|| {
                    format!(
                        "`top_logprobs` key `{key}` is not `token_id:N` (the server must \
                         support `return_tokens_as_token_ids`)"
                    )
                })?;
            let lp = v
                .as_f64()
                .ok_or_else(|| format!("`top_logprobs` entry `{key}` is not a number"))?;
            Ok((id, lp as f32))
        })
        .collect::<std::result::Result<Vec<_>, String>>()?;
    items.sort_by(|a, b| b.1.total_cmp(&a.1).then(a.0.cmp(&b.0)));
    items.truncate(k);
    Ok(items)
}

/// One request to the server.
#[derive(Debug, Clone, Copy)]
enum Call<'a> {
    /// `GET /models`.
    Models,
    /// `POST /completions`.
    Completions(&'a CompletionRequest<'a>),
    /// `POST /completions` with `echo`.
    Echo(&'a EchoRequest<'a>),
    /// `POST` of this JSON to a LoRA endpoint.
    Lora(&'static str, &'a Value),
}

impl Call<'_> {
    fn describe(&self) -> (&'static str, &'static str) {
        match self {
            Call::Models => ("GET", "/models"),
            Call::Completions(_) | Call::Echo(_) => ("POST", "/completions"),
            Call::Lora(path, _) => ("POST", path),
        }
    }
}

/// A failed attempt, with its message.
#[derive(Debug)]
struct Failed {
    message: String,
    retryable: bool,
    retry_after: Option<Duration>,
}

impl RetryDecision for Failed {
    fn retryable(&self) -> bool {
        self.retryable
    }

    fn retry_after(&self) -> Option<Duration> {
        self.retry_after
    }
}

impl Failed {
    fn fatal(message: String) -> Self {
        Self {
            message,
            retryable: false,
            retry_after: None,
        }
    }

    /// What went wrong, for `what` (`METHOD URL`).
    fn of(what: &str, e: OpenAIError) -> Self {
        if let Some(f) = HttpFailure::of(&e) {
            let msg = serde_json::from_str::<Value>(&f.body)
                .ok()
                .and_then(|v| {
                    let m = v["error"]["message"].as_str().or(v["message"].as_str());
                    m.map(String::from)
                })
                .unwrap_or_else(|| f.body.chars().take(300).collect());
            return Self {
                message: format!("{what}: HTTP {}: {msg}", f.status),
                retryable: retryable_status(f.status),
                retry_after: f.retry_after,
            };
        }
        match e {
            // Connecting, sending, or reading the body failed.
            OpenAIError::Reqwest(e) => Self {
                message: format!("{what}: {e} (is the server running?)"),
                retryable: true,
                retry_after: None,
            },
            OpenAIError::JSONDeserialize(e, body) => Self::fatal(format!(
                "{what}: the answer is not the JSON expected ({e}): {}",
                body.chars().take(300).collect::<String>()
            )),
            other => Self::fatal(format!("{what}: {other}")),
        }
    }
}

impl RemoteGenerator {
    /// Connects: `GET /v1/models` (within `sync_timeout`) and picks the base model.
    pub fn connect(cfg: RemoteConfig) -> Result<Self> {
        if !(cfg.request_timeout > 0.0 && cfg.sync_timeout > 0.0) {
            bail!("request_timeout and sync_timeout must be > 0 seconds");
        }
        let base = cfg.base_url.trim_end_matches('/').to_string();
        if !(base.starts_with("http://") || base.starts_with("https://")) {
            bail!("base_url `{}`: expected http://HOST:PORT/v1", cfg.base_url);
        }
        // async-openai would panic on a key that cannot be a header value (a newline, say).
        if reqwest::header::HeaderValue::from_str(&format!("Bearer {}", cfg.api_key)).is_err() {
            bail!("api_key: not a valid HTTP header value (a control character?)");
        }
        let rt = tokio::runtime::Builder::new_current_thread()
            .enable_all()
            .build()
            .map_err(|e| err(format!("tokio runtime: {e}")))?;
        let mut g = Self {
            client: openai_client(&base, &cfg.api_key),
            http: reqwest::Client::new(),
            transport: StatusAware::default(),
            cfg,
            base,
            rt,
            served: String::new(),
            adapter: None,
        };
        let models = g.call(Call::Models, g.cfg.sync_timeout)?;
        let ids: Vec<String> = models["data"]
            .as_array()
            .map(|a| {
                a.iter()
                    .filter_map(|m| m["id"].as_str().map(String::from))
                    .collect()
            })
            .unwrap_or_default();
        g.served = if g.cfg.model.is_empty() {
            ids.first()
                .cloned()
                .ok_or_else(|| err(format!("{}/models lists no model", g.base)))?
        } else if ids.contains(&g.cfg.model) {
            g.cfg.model.clone()
        } else {
            bail!(
                "model `{}` is not served at {} (it serves: {})",
                g.cfg.model,
                g.base,
                ids.join(", ")
            );
        };
        Ok(g)
    }

    /// The served base model's name.
    pub fn served_model(&self) -> &str {
        &self.served
    }

    /// The adapter requests currently go to, if any.
    pub fn adapter(&self) -> Option<&str> {
        self.adapter.as_deref()
    }

    /// Loads the PEFT adapter in `dir` under `name` (`/v1/load_lora_adapter`), then unloads the
    /// previous one; later [`Self::generate`] calls with `use_adapter` use it.
    pub fn sync_adapter(&mut self, name: &str, dir: &Path) -> Result<()> {
        let path =
            std::fs::canonicalize(dir).map_err(|e| err(format!("{}: {e}", dir.display())))?;
        let load_body = json!({"lora_name": name, "lora_path": path.display().to_string()});
        let load = || {
            self.call(
                Call::Lora("/load_lora_adapter", &load_body),
                self.cfg.sync_timeout,
            )
        };
        // A name the server already has (a resumed run re-syncing its last version, say) is
        // unloaded and loaded again, so the server holds these weights.
        let loaded = match load() {
            Err(e) if e.to_string().contains("HTTP 400") && e.to_string().contains("already") => {
                self.call(
                    Call::Lora("/unload_lora_adapter", &json!({"lora_name": name})),
                    self.cfg.sync_timeout,
                )
                .and_then(|_| load())
            }
            other => other,
        };
        loaded.map_err(|e| err(format!("LoRA sync of `{name}` failed: {e}")))?;
        if let Some(old) = self.adapter.replace(name.to_string())
            && old != name
        {
            self.call(
                Call::Lora("/unload_lora_adapter", &json!({"lora_name": old})),
                self.cfg.sync_timeout,
            )
            .map_err(|e| err(format!("unloading LoRA `{old}` failed: {e}")))?;
        }
        Ok(())
    }

    /// `num_generations` completions per prompt, from the synced adapter (`use_adapter`) or the
    /// base model. Completions come back grouped by prompt, as [`crate::generate()`]'s do.
    pub fn generate(
        &self,
        tokenizer: &Tokenizer,
        prompts: &[Vec<u32>],
        num_generations: usize,
        params: &SamplingParams,
        use_adapter: bool,
    ) -> Result<Vec<Completion>> {
        params.validate()?;
        if prompts.is_empty() || num_generations == 0 {
            return Ok(Vec::new());
        }
        let model = self.model_name(use_adapter)?;
        let request = CompletionRequest::new(model, prompts, num_generations, params);
        let resp = self.call(Call::Completions(&request), self.cfg.request_timeout)?;
        parse_completions(&resp, tokenizer, prompts.len(), num_generations, params)
    }

    /// One completion per `(prompt, params)`, all requests in flight at once (a multi-turn
    /// episode's turns: each its own context, stop strings, budget and seed), in order.
    pub fn generate_each(
        &self,
        tokenizer: &Tokenizer,
        requests: &[(Vec<u32>, SamplingParams)],
        use_adapter: bool,
    ) -> Result<Vec<Completion>> {
        for (_, p) in requests {
            p.validate()?;
        }
        let model = self.model_name(use_adapter)?;
        let bodies: Vec<CompletionRequest<'_>> = requests
            .iter()
            .map(|(ids, p)| CompletionRequest::new(model, std::slice::from_ref(ids), 1, p))
            .collect();
        let timeout = self.cfg.request_timeout;
        let answers = self.rt.block_on(futures_util::future::join_all(
            bodies
                .iter()
                .map(|b| self.call_async(Call::Completions(b), timeout)),
        ));
        let mut out = Vec::with_capacity(requests.len());
        for ((ids, p), answer) in requests.iter().zip(answers) {
            let resp = answer.map_err(|f| err(f.message))?;
            let mut c = parse_completions(&resp, tokenizer, 1, 1, p)?;
            match c.pop() {
                Some(one) if c.is_empty() => out.push(one),
                _ => bail!(
                    "the server answered {} choices for one prompt of {} tokens",
                    c.len() + 1,
                    ids.len()
                ),
            }
        }
        Ok(out)
    }

    /// The served base model's (or with `use_adapter` the synced adapter's) log-probs of each
    /// of `sequences`' own tokens after the first (raw logits, temperature 1; `echo` with
    /// `max_tokens` 1, the generated token dropped): a teacher on a server. A sequence of one
    /// token has none.
    pub fn prompt_logprobs(
        &self,
        sequences: &[Vec<u32>],
        use_adapter: bool,
    ) -> Result<Vec<Vec<f32>>> {
        Ok(self
            .prompt_top_logprobs(sequences, 0, use_adapter)?
            .into_iter()
            .map(|s| s.logprobs)
            .collect())
    }

    /// [`Self::prompt_logprobs`] with, at each of those positions, the server's `top` most
    /// likely tokens and their log-probs (`logprobs: top` with `return_tokens_as_token_ids`:
    /// vLLM's and `grpo-cli serve`'s `token_id:N` keys), most likely first.
    pub fn prompt_top_logprobs(
        &self,
        sequences: &[Vec<u32>],
        top: u32,
        use_adapter: bool,
    ) -> Result<Vec<SequenceScores>> {
        if sequences.is_empty() {
            return Ok(Vec::new());
        }
        let request = EchoRequest {
            model: self.model_name(use_adapter)?,
            prompt: sequences,
            max_tokens: 1,
            temperature: 0.0,
            echo: true,
            logprobs: top,
            return_tokens_as_token_ids: true,
        };
        let resp = self.call(Call::Echo(&request), self.cfg.request_timeout)?;
        let choices = resp["choices"]
            .as_array()
            .ok_or_else(|| err("the server's echo answer has no `choices`"))?;
        if choices.len() != sequences.len() {
            bail!(
                "the server answered {} choices for {} sequences",
                choices.len(),
                sequences.len()
            );
        }
        let mut out = Vec::with_capacity(sequences.len());
        for (i, (c, seq)) in choices.iter().zip(sequences).enumerate() {
            let lps = c["logprobs"]["token_logprobs"].as_array().ok_or_else(|| {
                err(format!(
                    "choice {i}: no `logprobs.token_logprobs` (does the server support `echo`?)"
                ))
            })?;
            if lps.len() < seq.len() {
                bail!(
                    "choice {i}: {} log-probs for a sequence of {} tokens (the server did not echo it)",
                    lps.len(),
                    seq.len()
                );
            }
            let logprobs = lps[1..seq.len()]
                .iter()
                .enumerate()
                .map(|(k, v)| {
                    v.as_f64()
                        .map(|x| x as f32)
                        .ok_or_else(|| err(format!("choice {i}: token {} has no log-prob", k + 1)))
                })
                .collect::<Result<Vec<f32>>>()?;
            let tops = match top {
                0 => Vec::new(),
                _ => {
                    let all = c["logprobs"]["top_logprobs"]
                        .as_array()
                        .ok_or_else(|| err(format!("choice {i}: no `logprobs.top_logprobs`")))?;
                    (1..seq.len())
                        .map(|k| top_entries(all.get(k), top as usize))
                        .collect::<std::result::Result<Vec<_>, String>>()
                        .map_err(|e| err(format!("choice {i}: {e}")))?
                }
            };
            out.push(SequenceScores {
                logprobs,
                top: tops,
            });
        }
        Ok(out)
    }

    /// The name to request: the synced adapter's, or the served base model's.
    fn model_name(&self, use_adapter: bool) -> Result<&str> {
        Ok(match (&self.adapter, use_adapter) {
            (Some(a), true) => a.as_str(),
            (None, true) => bail!("no adapter synced yet"),
            _ => self.served.as_str(),
        })
    }

    /// One request with retries ([`RemoteConfig::retry_policy`]), each attempt within
    /// `timeout` seconds; the JSON answer (a LoRA endpoint's plain text becomes a string).
    fn call(&self, call: Call<'_>, timeout: f64) -> Result<Value> {
        self.rt
            .block_on(self.call_async(call, timeout))
            .map_err(|f| err(f.message))
    }

    /// [`Self::call`], awaited on the client's runtime.
    async fn call_async(&self, call: Call<'_>, timeout: f64) -> std::result::Result<Value, Failed> {
        let (method, path) = call.describe();
        let what = format!("{method} {}{path}", self.base);
        let limit = Duration::from_secs_f64(timeout);
        let attempt = || async {
            let answer = async {
                match call {
                    Call::Models => self.client.models().list_byot::<Value>().await,
                    Call::Completions(request) => {
                        self.client
                            .completions()
                            .create_byot::<_, Value>(request)
                            .await
                    }
                    Call::Echo(request) => {
                        self.client
                            .completions()
                            .create_byot::<_, Value>(request)
                            .await
                    }
                    Call::Lora(path, body) => self.post_text(path, body).await.map(Value::String),
                }
            };
            match tokio::time::timeout(limit, answer).await {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(e)) => Err(Failed::of(&what, e)),
                Err(_) => Err(Failed::fatal(format!(
                    "{what}: no answer within {timeout} s (timed out)"
                ))),
            }
        };
        self.cfg.retry_policy().retry(attempt, |_, _| {}).await
    }

    /// `POST`s `body` to `path` (vLLM's `/load_lora_adapter` or `/unload_lora_adapter`) and
    /// returns the answer's text.
    ///
    /// Not through async-openai's byot methods: they can address the path, but they parse
    /// every 2xx body as JSON (and log a body that is not at error level), while vLLM (and
    /// `grpo-cli serve`) answer these two endpoints with plain text ("Success: LoRA adapter
    /// ... added successfully."). So this is a reqwest request with the client's own URL and
    /// headers (the key), sent through the same transport as the byot calls ([`StatusAware`]:
    /// the status and `Retry-After` of a failure) and retried by the same policy.
    async fn post_text(
        &self,
        path: &str,
        body: &Value,
    ) -> std::result::Result<String, OpenAIError> {
        let config = self.client.config();
        let (http, url, headers, body) = (
            self.http.clone(),
            config.url(path),
            config.headers(),
            body.clone(),
        );
        let request = HttpRequestFactory::new(move || {
            let r = http
                .post(&url)
                .headers(headers.clone())
                .json(&body)
                .build()
                .map_err(OpenAIError::Reqwest);
            async move { r }
        });
        let response = self.transport.send(request).await?;
        response.text().await.map_err(OpenAIError::Reqwest)
    }
}

/// Reads an OpenAI `/v1/completions` answer into completions (choice `i` is prompt `i / n`,
/// sample `i % n`, as OpenAI and vLLM order them).
pub fn parse_completions(
    resp: &Value,
    tokenizer: &Tokenizer,
    n_prompts: usize,
    n: usize,
    params: &SamplingParams,
) -> Result<Vec<Completion>> {
    let Some(choices) = resp["choices"].as_array() else {
        bail!("the answer has no `choices`: {}", snippet(resp));
    };
    if choices.len() != n_prompts * n {
        bail!(
            "the answer has {} choices, expected {} prompts × n = {n}",
            choices.len(),
            n_prompts
        );
    }
    let mut out = Vec::with_capacity(choices.len());
    for (pos, c) in choices.iter().enumerate() {
        let i = c["index"].as_u64().map_or(pos, |x| x as usize);
        if i >= n_prompts * n {
            bail!("choice index {i} is out of range");
        }
        let text = c["text"].as_str().unwrap_or_default().to_string();
        let lp = &c["logprobs"];
        let mut logprobs: Vec<f32> = lp["token_logprobs"]
            .as_array()
            .map(|a| {
                a.iter()
                    .map(|x| x.as_f64().map_or(f32::NAN, |v| v as f32))
                    .collect()
            })
            .unwrap_or_default();
        let from_tokens: Option<Vec<u32>> = lp["tokens"].as_array().and_then(|a| {
            a.iter()
                .map(|t| t.as_str()?.strip_prefix("token_id:")?.parse().ok())
                .collect()
        });
        let token_ids: Vec<u32> = match (c["token_ids"].as_array(), from_tokens) {
            (Some(a), _) => a
                .iter()
                .map(|x| x.as_u64().map(|v| v as u32))
                .collect::<Option<_>>()
                .ok_or_else(|| err(format!("choice {i}: `token_ids` holds a non-integer")))?,
            (None, Some(ids)) => ids,
            (None, None) => tokenizer.encode(&text, false)?,
        };
        if logprobs.len() != token_ids.len() || logprobs.iter().any(|x| !x.is_finite()) {
            logprobs.clear();
        }
        let finish_reason = match c["finish_reason"].as_str() {
            Some("length") => FinishReason::Length,
            _ => {
                let last = token_ids.last().copied();
                let is_eos = last.is_some_and(|t| {
                    tokenizer.eos_token_ids.contains(&t) || params.stop_token_ids.contains(&t)
                });
                if is_eos || params.stop.is_empty() {
                    FinishReason::Eos
                } else {
                    FinishReason::Stop
                }
            }
        };
        out.push(Completion {
            prompt_index: i / n,
            sample_index: i % n,
            token_ids,
            text,
            logprobs,
            finish_reason,
            top_logprobs: Vec::new(),
        });
    }
    out.sort_by_key(|c| (c.prompt_index, c.sample_index));
    Ok(out)
}

fn snippet(v: &Value) -> String {
    v.to_string().chars().take(300).collect()
}
