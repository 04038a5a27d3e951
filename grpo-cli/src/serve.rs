//! `grpo-cli serve`: an OpenAI-compatible server over grpo-rollout's generator.
//!
//! Endpoints (vLLM's names and JSON): `GET /v1/models`, `POST /v1/completions`,
//! `POST /v1/chat/completions`, `POST /v1/load_lora_adapter`, `POST /v1/unload_lora_adapter`,
//! plus `GET /health` and `GET /stats` (request, batch and rejection counters).
//!
//! HTTP handlers (axum on tokio) validate a request, resolve its model (the base or a loaded
//! LoRA adapter) and put it on a bounded queue; one engine thread takes every request waiting
//! there (up to `max_batch_requests`), groups those with the same model and sampling knobs, and
//! runs each group as one batched [`grpo_rollout::generate::generate_batch`] call. Each request
//! keeps its own seed and random streams, so its answer does not depend on what it was batched
//! with. A full queue answers 429 with `Retry-After`; a bad request answers 400 (404 for an
//! unknown model) with an OpenAI-style `{"error": {...}}` body naming the field, on one line.
//!
//! `stream: true` answers server-sent events as OpenAI and vLLM send them: the engine reports
//! every sampled token as the batch produces it ([`grpo_rollout::generate::generate_batch_with`]),
//! and the handler sends each choice's new text as a chunk, then `data: [DONE]`.

use std::collections::HashMap;
use std::convert::Infallible;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use axum::body::Body;
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_core::{DType, Device};
use grpo_rollout::generate::{Completion, FinishReason, PromptRequest, SamplingParams, TokenEvent};
use grpo_rollout::{ChatMessage, Tokenizer, Transformer};
use serde::Deserialize;
use serde_json::{Value, json};

/// How to run the server.
#[derive(Debug, Clone)]
pub struct ServeOptions {
    /// HF directory or .gguf file.
    pub model: PathBuf,
    /// Weight dtype.
    pub dtype: DType,
    /// Where the model runs.
    pub device: Device,
    /// The base model's name in requests (`model`) and in `/v1/models`.
    pub served_model_name: String,
    /// LoRA adapters loaded at start: `(name, PEFT directory)`.
    pub adapters: Vec<(String, PathBuf)>,
    /// Address to bind (port 0 picks a free port).
    pub addr: SocketAddr,
    /// Requests waiting for the engine at most; more are answered 429.
    pub max_queue: usize,
    /// Requests the engine takes into one batch at most.
    pub max_batch_requests: usize,
    /// Prompt + completion tokens per sequence at most (default: the model's
    /// `max_position_embeddings`).
    pub max_model_len: Option<usize>,
    /// `logprobs` / `top_logprobs` at most.
    pub max_logprobs: usize,
}

impl ServeOptions {
    /// Defaults for `model`: loopback port 8000, queue 256, batches of up to 64 requests.
    pub fn new(model: impl Into<PathBuf>) -> Self {
        let model = model.into();
        let served_model_name = model
            .file_stem()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_else(|| "model".into());
        Self {
            model,
            dtype: DType::F32,
            device: Device::Cpu,
            served_model_name,
            adapters: Vec::new(),
            addr: SocketAddr::from(([127, 0, 0, 1], 8000)),
            max_queue: 256,
            max_batch_requests: 64,
            max_model_len: None,
            max_logprobs: 20,
        }
    }
}

/// Counters of `GET /stats`.
#[derive(Debug, Default)]
struct Stats {
    requests: AtomicU64,
    batches: AtomicU64,
    generate_calls: AtomicU64,
    rejected_busy: AtomicU64,
    bad_requests: AtomicU64,
}

struct Shared {
    base_name: String,
    base: Arc<Transformer>,
    tokenizer: Tokenizer,
    adapters: RwLock<HashMap<String, (PathBuf, Arc<Transformer>)>>,
    queue: crossbeam_channel::Sender<Job>,
    max_model_len: usize,
    max_logprobs: usize,
    created: u64,
    stats: Stats,
    next_seed: AtomicU64,
    source: PathBuf,
}

/// One request for the engine: prompts × n samples with one model and one set of knobs.
struct Job {
    model: Arc<Transformer>,
    prompts: Vec<Vec<u32>>,
    n: usize,
    seed: u64,
    params: SamplingParams,
    reply: Reply,
}

/// Where a job's answer goes.
enum Reply {
    /// All completions at once.
    Whole(tokio::sync::oneshot::Sender<Result<Vec<Completion>, String>>),
    /// No sampling: each prompt's own tokens scored (`echo` with logprobs), with the `top`
    /// most likely tokens at each position.
    Score {
        top: usize,
        tx: tokio::sync::oneshot::Sender<Result<Vec<PromptScores>, String>>,
    },
    /// Piece by piece as tokens are sampled (`stream: true`); the channel closes when every
    /// choice has finished.
    Stream(tokio::sync::mpsc::UnboundedSender<Piece>),
}

/// A piece of a streamed answer.
#[derive(Debug)]
enum Piece {
    /// New text of choice `index` and the tokens it came from; `finish` on its last piece.
    Chunk {
        index: usize,
        text: String,
        token_ids: Vec<u32>,
        logprobs: Vec<f32>,
        top: Vec<Vec<(u32, f32)>>,
        finish: Option<FinishReason>,
    },
    /// Generation failed.
    Error(String),
}

/// The text a streamed choice has sent. A piece ends where the decoded text has grown, but
/// never inside a UTF-8 character (a trailing U+FFFD, an incomplete byte sequence, waits for
/// the next token) nor in the last `hold` bytes (they could still begin a stop string, which
/// the completion's text ends before); the last piece is the rest of the completion's text,
/// so the pieces add up to it.
#[derive(Debug)]
struct Deltas {
    sent: String,
    tokens: usize,
    hold: usize,
}

impl Deltas {
    fn new(hold: usize) -> Self {
        Self {
            sent: String::new(),
            tokens: 0,
            hold,
        }
    }

    /// The piece a new token makes, if any (tokens without new text wait for the next piece).
    fn step(&mut self, tok: &Tokenizer, e: &TokenEvent<'_>, index: usize) -> Option<Piece> {
        let (text, finish) = match e.finished {
            Some(c) => (
                c.text
                    .strip_prefix(self.sent.as_str())
                    .unwrap_or_default()
                    .to_string(),
                Some(c.finish_reason),
            ),
            None => {
                let text = tok.decode(e.token_ids, true).ok()?;
                let mut end = text
                    .trim_end_matches('\u{FFFD}')
                    .len()
                    .min(text.len().saturating_sub(self.hold));
                while !text.is_char_boundary(end) {
                    end -= 1;
                }
                if end <= self.sent.len() || !text.starts_with(self.sent.as_str()) {
                    return None;
                }
                (text[self.sent.len()..end].to_string(), None)
            }
        };
        self.sent.push_str(&text);
        let from = std::mem::replace(&mut self.tokens, e.token_ids.len());
        Some(Piece::Chunk {
            index,
            text,
            token_ids: e.token_ids[from..].to_vec(),
            logprobs: e.logprobs[from..].to_vec(),
            top: e.top_logprobs.get(from..).unwrap_or_default().to_vec(),
            finish,
        })
    }
}

/// A running server; dropping it stops the HTTP side (the engine thread ends with it).
#[derive(Debug)]
pub struct Server {
    /// The bound address.
    pub addr: SocketAddr,
    shutdown: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl Server {
    /// `http://ADDR/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// Blocks until the server stops (it runs until the process ends).
    pub fn wait(mut self) {
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        if let Some(tx) = self.shutdown.take() {
            let _ = tx.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

/// Loads the model and adapters, binds, and serves on background threads.
pub fn start(opts: ServeOptions) -> Result<Server> {
    if opts.max_queue == 0 || opts.max_batch_requests == 0 {
        anyhow::bail!("--max-queue and --max-batch-requests must be >= 1");
    }
    let loaded = grpo_rollout::load(&opts.model, opts.dtype, &opts.device)
        .and_then(grpo_rollout::LoadedModel::causal)
        .with_context(|| format!("--model {}", opts.model.display()))?;
    let base = Arc::new(loaded.model.for_decoding()?);
    let max_model_len = opts
        .max_model_len
        .unwrap_or(base.cfg.max_position_embeddings);
    let mut adapters = HashMap::new();
    for (name, dir) in &opts.adapters {
        let m = with_adapter(&base, dir).with_context(|| format!("--adapter {}", dir.display()))?;
        adapters.insert(name.clone(), (dir.clone(), Arc::new(m)));
    }
    let (tx, rx) = crossbeam_channel::bounded::<Job>(opts.max_queue);
    let shared = Arc::new(Shared {
        base_name: opts.served_model_name.clone(),
        base,
        tokenizer: loaded.tokenizer,
        adapters: RwLock::new(adapters),
        queue: tx,
        max_model_len,
        max_logprobs: opts.max_logprobs,
        created: SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| d.as_secs()),
        stats: Stats::default(),
        next_seed: AtomicU64::new(0x5eed_0000),
        source: opts.model.clone(),
    });
    {
        let shared = shared.clone();
        let max_batch = opts.max_batch_requests;
        std::thread::Builder::new()
            .name("grpo-serve-engine".into())
            .spawn(move || engine(&shared, &rx, max_batch))?;
    }
    let listener = std::net::TcpListener::bind(opts.addr)
        .with_context(|| format!("cannot bind {}", opts.addr))?;
    listener.set_nonblocking(true)?;
    let addr = listener.local_addr()?;
    let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
    let app = Router::new()
        .route("/health", get(|| async { StatusCode::OK }))
        .route("/stats", get(stats))
        .route("/v1/models", get(models))
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .route("/v1/load_lora_adapter", post(load_lora_adapter))
        .route("/v1/unload_lora_adapter", post(unload_lora_adapter))
        .with_state(shared);
    let rt = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .thread_name("grpo-serve-http")
        .build()?;
    let thread = std::thread::Builder::new()
        .name("grpo-serve".into())
        .spawn(move || {
            rt.block_on(async move {
                let Ok(listener) = tokio::net::TcpListener::from_std(listener) else {
                    return;
                };
                let _ = axum::serve(listener, app)
                    .with_graceful_shutdown(async {
                        let _ = stop_rx.await;
                    })
                    .await;
            });
        })?;
    Ok(Server {
        addr,
        shutdown: Some(stop_tx),
        thread: Some(thread),
    })
}

/// The base with a PEFT adapter attached (frozen weights shared with the base).
fn with_adapter(base: &Transformer, dir: &Path) -> Result<Transformer> {
    let mut m = base.clone();
    grpo_rollout::lora::load_peft(&mut m, dir).map_err(|e| anyhow!(one_line(&e)))?;
    Ok(m)
}

/// The log-probs of a prompt's own tokens under the model (from the raw logits, as vLLM's
/// prompt log-probs): for each token after the first, its log-prob and the `top` most likely
/// tokens there, best first.
#[derive(Debug, Clone, Default)]
struct PromptScores {
    logprobs: Vec<f32>,
    top: Vec<Vec<(u32, f32)>>,
}

/// Scores `prompt` under `model` (one teacher-forced forward, the logits a chunk of rows at a
/// time through the model's own log-prob path).
fn score_prompt(
    model: &Transformer,
    prompt: &[u32],
    top: usize,
) -> candle_core::Result<PromptScores> {
    use candle_core::{D, DType, Tensor};
    let n = prompt.len();
    if n < 2 {
        return Ok(PromptScores::default());
    }
    let dev = model.device();
    let ids = Tensor::from_slice(prompt, (1, n), dev)?;
    let mask = Tensor::ones((1, n), DType::U32, dev)?;
    let (h, targets, shape) = model.completion_rows(&ids, &mask, n - 1)?;
    let (lp, _) = model.rows_logprobs(&h, &targets, shape, 1.0, false)?;
    let logprobs: Vec<f32> = lp.flatten_all()?.to_dtype(DType::F32)?.to_vec1()?;
    let mut tops = Vec::with_capacity(n - 1);
    if top > 0 {
        let z = model.logits(&h)?.to_dtype(DType::F32)?;
        let z = z.broadcast_sub(&z.max_keepdim(D::Minus1)?)?;
        let ls = z.broadcast_sub(&z.exp()?.sum_keepdim(D::Minus1)?.log()?)?;
        let k = top.min(ls.dim(1)?);
        let idx = grpo_core::distill::topk_indices(&ls, k)?;
        let vals: Vec<Vec<f32>> = ls.gather(&idx, D::Minus1)?.to_vec2()?;
        let idx: Vec<Vec<u32>> = idx.to_vec2()?;
        for (i, v) in idx.into_iter().zip(vals) {
            tops.push(i.into_iter().zip(v).collect());
        }
    }
    Ok(PromptScores {
        logprobs,
        top: tops,
    })
}

/// A scoring job: each prompt's scores, or the first error.
fn score_job(shared: &Shared, job: Job) {
    shared.stats.requests.fetch_add(1, Ordering::Relaxed);
    let Reply::Score { top, tx } = job.reply else {
        return;
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        job.prompts
            .iter()
            .map(|p| score_prompt(&job.model, p, top))
            .collect::<candle_core::Result<Vec<_>>>()
    }));
    let _ = tx.send(match result {
        Ok(Ok(s)) => Ok(s),
        Ok(Err(e)) => Err(format!("scoring the prompt failed: {}", one_line(&e))),
        Err(_) => Err("scoring the prompt panicked".to_string()),
    });
}

/// The engine thread: batches of waiting requests, grouped by model and knobs.
fn engine(shared: &Shared, rx: &crossbeam_channel::Receiver<Job>, max_batch: usize) {
    while let Ok(first) = rx.recv() {
        let mut jobs = vec![first];
        while jobs.len() < max_batch {
            match rx.try_recv() {
                Ok(j) => jobs.push(j),
                Err(_) => break,
            }
        }
        shared.stats.batches.fetch_add(1, Ordering::Relaxed);
        // Scoring jobs (`echo`) run on their own; the others group by (model, knobs), in order
        // of arrival within a group.
        let (scores, jobs): (Vec<Job>, Vec<Job>) = jobs
            .into_iter()
            .partition(|j| matches!(j.reply, Reply::Score { .. }));
        for job in scores {
            score_job(shared, job);
        }
        let mut groups: Vec<Vec<Job>> = Vec::new();
        for job in jobs {
            match groups.iter_mut().find(|g| {
                Arc::ptr_eq(&g[0].model, &job.model) && same_knobs(&g[0].params, &job.params)
            }) {
                Some(g) => g.push(job),
                None => groups.push(vec![job]),
            }
        }
        for group in groups {
            run_group(shared, group);
        }
    }
}

fn same_knobs(a: &SamplingParams, b: &SamplingParams) -> bool {
    SamplingParams {
        seed: 0,
        ..a.clone()
    } == SamplingParams {
        seed: 0,
        ..b.clone()
    }
}

fn run_group(shared: &Shared, group: Vec<Job>) {
    shared.stats.generate_calls.fetch_add(1, Ordering::Relaxed);
    let mut reqs = Vec::new();
    let mut owner = Vec::new(); // (job, prompt index in job) per request
    for (j, job) in group.iter().enumerate() {
        for (p, ids) in job.prompts.iter().enumerate() {
            reqs.push(PromptRequest {
                ids,
                n: job.n,
                seed: job.seed,
                first_stream: (p * job.n) as u64,
            });
            owner.push((j, p));
        }
    }
    let model = group[0].model.clone();
    let params = group[0].params.clone();
    // Streamed jobs: what each of their choices has sent.
    let hold = params.stop.iter().map(String::len).max().unwrap_or(1);
    let mut deltas: Vec<Vec<Deltas>> = group
        .iter()
        .map(|job| match job.reply {
            Reply::Stream(_) => (0..job.prompts.len() * job.n)
                .map(|_| Deltas::new(hold.saturating_sub(1)))
                .collect(),
            Reply::Whole(_) | Reply::Score { .. } => Vec::new(),
        })
        .collect();
    let mut on_token = |e: TokenEvent<'_>| {
        let (j, p) = owner[e.prompt_index];
        let Reply::Stream(tx) = &group[j].reply else {
            return true;
        };
        let index = p * group[j].n + e.sample_index;
        if let Some(piece) = deltas[j][index].step(&shared.tokenizer, &e, index) {
            let _ = tx.send(piece);
        }
        // A client that has gone frees its rows.
        !tx.is_closed()
    };
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        grpo_rollout::generate::generate_batch_with(
            &model,
            &shared.tokenizer,
            &reqs,
            &params,
            &mut on_token,
        )
    }));
    let mut per_job: Vec<Vec<Completion>> = group.iter().map(|_| Vec::new()).collect();
    let outcome = match result {
        Ok(Ok(done)) => {
            for mut c in done {
                let (j, p) = owner[c.prompt_index];
                c.prompt_index = p;
                per_job[j].push(c);
            }
            Ok(())
        }
        Ok(Err(e)) => Err(format!("generation failed: {}", one_line(&e))),
        Err(_) => Err("generation panicked".to_string()),
    };
    for (job, comps) in group.into_iter().zip(per_job) {
        shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        match (job.reply, &outcome) {
            (Reply::Whole(tx), Ok(())) => {
                let _ = tx.send(Ok(comps));
            }
            (Reply::Whole(tx), Err(e)) => {
                let _ = tx.send(Err(e.clone()));
            }
            (Reply::Stream(_), Ok(())) => {}
            (Reply::Stream(tx), Err(e)) => {
                let _ = tx.send(Piece::Error(e.clone()));
            }
            (Reply::Score { .. }, _) => {}
        }
    }
}

/// The engine's answer to a job: 500 with its error, 503 when the engine dropped it.
async fn engine_answer<T>(
    rx: tokio::sync::oneshot::Receiver<Result<T, String>>,
) -> Result<T, ApiError> {
    match rx.await {
        Ok(Ok(c)) => Ok(c),
        Ok(Err(e)) => Err(ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: e,
            param: None,
        }),
        Err(_) => Err(ApiError {
            status: StatusCode::SERVICE_UNAVAILABLE,
            message: "the engine dropped the request".into(),
            param: None,
        }),
    }
}

/// A candle error on one line, for a user: without the backtrace candle appends when
/// `RUST_BACKTRACE` is set, with contexts joined by `: `.
fn one_line(e: &candle_core::Error) -> String {
    use candle_core::Error as E;
    match e {
        E::WithBacktrace { inner, .. } => one_line(inner),
        E::Context { inner, context } => format!("{context}: {}", one_line(inner)),
        E::WithPath { inner, path } => format!("{}: {}", path.display(), one_line(inner)),
        E::WrappedContext { wrapped, context } => format!("{context}: {wrapped}"),
        other => other
            .to_string()
            .split_whitespace()
            .collect::<Vec<_>>()
            .join(" "),
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// An OpenAI-style error response.
struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<String>,
}

impl ApiError {
    fn bad(param: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param.into()),
        }
    }

    /// The `{"error": {...}}` body.
    fn body(&self) -> Value {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            s if s.is_server_error() => "InternalServerError",
            _ => "BadRequestError",
        };
        json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }})
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut r = (self.status, Json(self.body())).into_response();
        if self.status == StatusCode::TOO_MANY_REQUESTS {
            r.headers_mut()
                .insert(header::RETRY_AFTER, HeaderValue::from_static("1"));
        }
        r
    }
}

fn json_body<T>(shared: &Shared, body: Result<Json<T>, JsonRejection>) -> Result<T, ApiError> {
    body.map(|Json(b)| b).map_err(|e| {
        shared.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
        ApiError {
            status: StatusCode::BAD_REQUEST,
            message: format!("invalid request body: {}", e.body_text()),
            param: None,
        }
    })
}

// ---------------------------------------------------------------------------------------------
// Requests.

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Ids(Vec<u32>),
    IdLists(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum StopInput {
    One(String),
    Many(Vec<String>),
}

/// Knobs shared by both endpoints (OpenAI's, plus vLLM's extensions).
#[derive(Debug, Default, Deserialize)]
struct Knobs {
    model: Option<String>,
    n: Option<usize>,
    max_tokens: Option<usize>,
    max_completion_tokens: Option<usize>,
    temperature: Option<f64>,
    top_p: Option<f64>,
    top_k: Option<i64>,
    min_p: Option<f64>,
    repetition_penalty: Option<f64>,
    frequency_penalty: Option<f64>,
    presence_penalty: Option<f64>,
    stop: Option<StopInput>,
    stop_token_ids: Option<Vec<u32>>,
    seed: Option<i64>,
    min_tokens: Option<usize>,
    stream: Option<bool>,
    best_of: Option<usize>,
    return_tokens_as_token_ids: Option<bool>,
    return_token_ids: Option<bool>,
    stream_options: Option<Value>,
    logit_bias: Option<Value>,
    /// vLLM's structured outputs: `{"regex": ...}` or `{"choice": [...]}`.
    structured_outputs: Option<Value>,
    /// vLLM's older names of the same.
    guided_regex: Option<String>,
    guided_choice: Option<Vec<String>>,
    /// Every other field: refused unless it cannot change the answer ([`refuse_unsupported`]).
    #[serde(flatten)]
    other: serde_json::Map<String, Value>,
}

/// Fields accepted and ignored: they do not change an answer.
const INERT_FIELDS: [&str; 7] = [
    "user",
    "metadata",
    "store",
    "service_tier",
    "parallel_tool_calls",
    "prompt_cache_key",
    "safety_identifier",
];

/// Refuses a field this server does not implement (`tools`, `response_format`, `suffix`, a
/// misspelt knob, ...) rather than answer something other than what was asked. A field that
/// asks for nothing (`null`, `tools: []`, `tool_choice: "none"`, `response_format: {"type":
/// "text"}`) and [`INERT_FIELDS`] pass.
fn refuse_unsupported(other: &serde_json::Map<String, Value>) -> Result<(), ApiError> {
    for (name, v) in other {
        let inert = v.is_null()
            || INERT_FIELDS.contains(&name.as_str())
            || match name.as_str() {
                "tools" | "functions" => v.as_array().is_some_and(Vec::is_empty),
                "tool_choice" | "function_call" => matches!(v.as_str(), Some("none" | "auto")),
                "response_format" => v["type"] == "text",
                _ => false,
            };
        if !inert {
            return Err(ApiError::bad(
                name.clone(),
                format!("`{}` is not supported by this server", name.escape_debug()),
            ));
        }
    }
    Ok(())
}

/// OpenAI's `logit_bias`: `{"TOKEN_ID": bias}` with biases in [-100, 100].
fn logit_bias(v: &Value, vocab: usize) -> Result<Vec<(u32, f32)>, ApiError> {
    let bad = |m: String| ApiError::bad("logit_bias", m);
    let Value::Object(map) = v else {
        return Err(bad(format!(
            "`logit_bias` must map token ids to biases, got {v}"
        )));
    };
    let mut out = Vec::with_capacity(map.len());
    for (k, b) in map {
        let id = k
            .trim()
            .parse::<u32>()
            .ok()
            .filter(|&id| (id as usize) < vocab)
            .ok_or_else(|| {
                bad(format!(
                    "`logit_bias`: key {k:?} is not a token id of this model (0..{vocab})"
                ))
            })?;
        let b = b
            .as_f64()
            .filter(|b| (-100.0..=100.0).contains(b))
            .ok_or_else(|| {
                bad(format!(
                    "`logit_bias`: the bias of token {k:?} must be a number in [-100, 100], got {b}"
                ))
            })?;
        out.push((id, b as f32));
    }
    out.sort_by_key(|&(id, _)| id);
    Ok(out)
}

/// `stream: true` and its `stream_options`.
#[derive(Debug, Clone, Copy, Default)]
struct StreamOptions {
    /// A last chunk with `usage` (and `choices: []`).
    include_usage: bool,
    /// vLLM's `continuous_usage_stats`: `usage` on every chunk (with `include_usage`).
    continuous_usage: bool,
}

/// `Some` when the answer is streamed.
fn stream_options(k: &Knobs) -> Result<Option<StreamOptions>, ApiError> {
    let stream = k.stream == Some(true);
    let mut o = StreamOptions::default();
    if let Some(v) = &k.stream_options {
        if !stream {
            return Err(ApiError::bad(
                "stream_options",
                "`stream_options` is only allowed with `stream: true`",
            ));
        }
        let Value::Object(map) = v else {
            return Err(ApiError::bad(
                "stream_options",
                format!("`stream_options` must be an object, got {v}"),
            ));
        };
        for (key, x) in map {
            let flag = match x {
                Value::Null => false,
                Value::Bool(b) => *b,
                _ => {
                    return Err(ApiError::bad(
                        "stream_options",
                        format!(
                            "`stream_options.{}` must be a boolean, got {x}",
                            key.escape_debug()
                        ),
                    ));
                }
            };
            match key.as_str() {
                "include_usage" => o.include_usage = flag,
                "continuous_usage_stats" => o.continuous_usage = flag,
                // OpenAI's padding against side channels: nothing to pad here.
                "include_obfuscation" => {}
                _ => {
                    return Err(ApiError::bad(
                        "stream_options",
                        format!("`stream_options.{}` is not supported", key.escape_debug()),
                    ));
                }
            }
        }
    }
    o.continuous_usage &= o.include_usage;
    Ok(stream.then_some(o))
}

#[derive(Debug, Deserialize)]
struct CompletionRequest {
    prompt: Option<PromptInput>,
    logprobs: Option<usize>,
    echo: Option<bool>,
    #[serde(flatten)]
    knobs: Knobs,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
enum Content {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
struct ContentPart {
    #[serde(rename = "type")]
    kind: String,
    text: Option<String>,
}

#[derive(Debug, Deserialize)]
struct Message {
    role: String,
    content: Option<Content>,
}

#[derive(Debug, Deserialize)]
struct ChatRequest {
    messages: Vec<Message>,
    logprobs: Option<bool>,
    top_logprobs: Option<usize>,
    add_generation_prompt: Option<bool>,
    #[serde(flatten)]
    knobs: Knobs,
}

/// Checks the knobs; returns (model, n, params without top_logprobs, default-seeded).
fn sampling(
    shared: &Shared,
    k: &Knobs,
    default_max_tokens: usize,
) -> Result<(Arc<Transformer>, String, usize, u64, SamplingParams), ApiError> {
    refuse_unsupported(&k.other)?;
    let name = k.model.clone().unwrap_or_else(|| shared.base_name.clone());
    let model = if name == shared.base_name {
        shared.base.clone()
    } else {
        let map = shared.adapters.read().map_err(|_| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: "adapter table poisoned".into(),
            param: None,
        })?;
        match map.get(&name) {
            Some((_, m)) => m.clone(),
            None => {
                return Err(ApiError {
                    status: StatusCode::NOT_FOUND,
                    message: format!("The model `{name}` does not exist."),
                    param: Some("model".into()),
                });
            }
        }
    };
    let n = k.n.unwrap_or(1);
    if n == 0 || n > 256 {
        return Err(ApiError::bad(
            "n",
            format!("`n` must be in 1..=256, got {n}"),
        ));
    }
    if let Some(b) = k.best_of
        && b != n
    {
        return Err(ApiError::bad(
            "best_of",
            "`best_of` other than `n` is not supported",
        ));
    }
    for (field, v) in [
        ("frequency_penalty", k.frequency_penalty),
        ("presence_penalty", k.presence_penalty),
    ] {
        if v.is_some_and(|x| x != 0.0) {
            return Err(ApiError::bad(
                field,
                format!("`{field}` is not supported (use repetition_penalty)"),
            ));
        }
    }
    let max_new_tokens = k
        .max_completion_tokens
        .or(k.max_tokens)
        .unwrap_or(default_max_tokens);
    if max_new_tokens == 0 {
        return Err(ApiError::bad("max_tokens", "`max_tokens` must be >= 1"));
    }
    let regex = structured_regex(k)?;
    let top_k = match k.top_k {
        None => 0,
        Some(x) if x <= 0 => 0, // vLLM: 0 or -1 disables it
        Some(x) => x as usize,
    };
    let params = SamplingParams {
        max_new_tokens,
        min_new_tokens: k.min_tokens.unwrap_or(0),
        temperature: k.temperature.unwrap_or(1.0),
        top_k,
        top_p: k.top_p.unwrap_or(1.0),
        min_p: k.min_p.unwrap_or(0.0),
        repetition_penalty: k.repetition_penalty.unwrap_or(1.0),
        stop_token_ids: k.stop_token_ids.clone().unwrap_or_default(),
        stop: match &k.stop {
            None => Vec::new(),
            Some(StopInput::One(s)) => vec![s.clone()],
            Some(StopInput::Many(v)) => v.clone(),
        },
        seed: 0,
        top_logprobs: 0,
        logit_bias: match &k.logit_bias {
            Some(v) => logit_bias(v, shared.base.cfg.vocab_size)?,
            None => Vec::new(),
        },
        regex,
    };
    if let Err(e) = params.validate() {
        let msg = one_line(&e);
        let field = [
            "temperature",
            "top_p",
            "min_p",
            "repetition_penalty",
            "min_new_tokens",
        ]
        .into_iter()
        .find(|f| msg.starts_with(f))
        .map(|f| {
            if f == "min_new_tokens" {
                "min_tokens"
            } else {
                f
            }
        })
        .unwrap_or("request");
        return Err(ApiError::bad(field, format!("`{field}`: {msg}")));
    }
    let seed = match k.seed {
        Some(s) => s as u64,
        None => shared.next_seed.fetch_add(1, Ordering::Relaxed),
    };
    Ok((model, name, n, seed, params))
}

/// The pattern a request constrains its completions to: vLLM's `structured_outputs.regex`, or
/// `structured_outputs.choice` as the alternation of its strings, or the older `guided_regex` /
/// `guided_choice`. Other kinds of structured output (`json`, `grammar`, ...) are refused by
/// name, as is a pattern that does not compile.
fn structured_regex(k: &Knobs) -> Result<Option<String>, ApiError> {
    let choice = |field: &str, v: &[String]| -> Result<String, ApiError> {
        if v.is_empty() {
            return Err(ApiError::bad(field, format!("`{field}` is empty")));
        }
        let alts: Vec<String> = v.iter().map(|c| regex::escape(c)).collect();
        Ok(format!("(?:{})", alts.join("|")))
    };
    let mut found: Vec<(&str, String)> = Vec::new();
    if let Some(so) = k.structured_outputs.as_ref().filter(|v| !v.is_null()) {
        let Some(obj) = so.as_object() else {
            return Err(ApiError::bad(
                "structured_outputs",
                "`structured_outputs` must be an object such as {\"regex\": \"...\"}",
            ));
        };
        for (key, v) in obj {
            if v.is_null() || (key == "disable_any_whitespace" && v == &Value::Bool(false)) {
                continue;
            }
            let field = format!("structured_outputs.{key}");
            match key.as_str() {
                "regex" => match v.as_str() {
                    Some(p) => found.push(("structured_outputs.regex", p.to_string())),
                    None => {
                        return Err(ApiError::bad(
                            field,
                            "`structured_outputs.regex` must be a string",
                        ));
                    }
                },
                "choice" => {
                    let list: Option<Vec<String>> = v
                        .as_array()
                        .and_then(|a| a.iter().map(|x| x.as_str().map(str::to_string)).collect());
                    match list {
                        Some(l) => found.push(("structured_outputs.choice", choice(&field, &l)?)),
                        None => {
                            return Err(ApiError::bad(
                                field,
                                "`structured_outputs.choice` must be a list of strings",
                            ));
                        }
                    }
                }
                _ => {
                    return Err(ApiError::bad(
                        field.clone(),
                        format!(
                            "`{}` is not supported by this server (regex and choice are)",
                            field.escape_debug()
                        ),
                    ));
                }
            }
        }
    }
    if let Some(p) = &k.guided_regex {
        found.push(("guided_regex", p.clone()));
    }
    if let Some(c) = &k.guided_choice {
        found.push(("guided_choice", choice("guided_choice", c)?));
    }
    match found.len() {
        0 => Ok(None),
        1 => {
            let (field, pattern) = found.pop().expect("one");
            grpo_rollout::constrain::check_pattern(&pattern)
                .map_err(|e| ApiError::bad(field, format!("`{field}`: {e}")))?;
            Ok(Some(pattern))
        }
        _ => {
            let names: Vec<&str> = found.iter().map(|(f, _)| *f).collect();
            Err(ApiError::bad(
                names[1],
                format!(
                    "only one structured output per request, got {}",
                    names.join(" and ")
                ),
            ))
        }
    }
}

impl Shared {
    fn check_length(
        &self,
        prompt_len: usize,
        max_new: usize,
        what: &'static str,
    ) -> Result<(), ApiError> {
        if prompt_len == 0 {
            return Err(ApiError::bad(what, format!("`{what}` is empty")));
        }
        if prompt_len + max_new > self.max_model_len {
            return Err(ApiError::bad(
                what,
                format!(
                    "This model's maximum context length is {} tokens. However, you requested {} tokens ({} in the prompt, {} in the completion).",
                    self.max_model_len,
                    prompt_len + max_new,
                    prompt_len,
                    max_new
                ),
            ));
        }
        Ok(())
    }

    /// Puts a job on the queue (429 when it is full).
    fn submit(&self, job: Job) -> Result<(), ApiError> {
        self.queue.try_send(job).map_err(|e| match e {
            crossbeam_channel::TrySendError::Full(_) => {
                self.stats.rejected_busy.fetch_add(1, Ordering::Relaxed);
                ApiError {
                    status: StatusCode::TOO_MANY_REQUESTS,
                    message: format!(
                        "server busy: {} requests queued (--max-queue); retry later",
                        self.queue.len()
                    ),
                    param: None,
                }
            }
            crossbeam_channel::TrySendError::Disconnected(_) => ApiError {
                status: StatusCode::SERVICE_UNAVAILABLE,
                message: "the engine has stopped".into(),
                param: None,
            },
        })
    }

    /// Queues a job and waits for its completions.
    async fn run(
        &self,
        model: Arc<Transformer>,
        prompts: Vec<Vec<u32>>,
        n: usize,
        seed: u64,
        params: SamplingParams,
    ) -> Result<Vec<Completion>, ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(Job {
            model,
            prompts,
            n,
            seed,
            params,
            reply: Reply::Whole(tx),
        })?;
        engine_answer(rx).await
    }

    /// Scores `prompts`' own tokens under `model` on the engine (`echo`), with the `top` most
    /// likely tokens at each position.
    async fn score(
        &self,
        model: Arc<Transformer>,
        prompts: Vec<Vec<u32>>,
        top: usize,
    ) -> Result<Vec<PromptScores>, ApiError> {
        let (tx, rx) = tokio::sync::oneshot::channel();
        self.submit(Job {
            model,
            prompts,
            n: 1,
            seed: 0,
            params: SamplingParams::default(),
            reply: Reply::Score { top, tx },
        })?;
        engine_answer(rx).await
    }

    /// Queues a job whose pieces come as its tokens are sampled.
    fn run_streamed(
        &self,
        model: Arc<Transformer>,
        prompts: Vec<Vec<u32>>,
        n: usize,
        seed: u64,
        params: SamplingParams,
    ) -> Result<tokio::sync::mpsc::UnboundedReceiver<Piece>, ApiError> {
        let (tx, rx) = tokio::sync::mpsc::unbounded_channel();
        self.submit(Job {
            model,
            prompts,
            n,
            seed,
            params,
            reply: Reply::Stream(tx),
        })?;
        Ok(rx)
    }

    fn token_text(&self, id: u32, as_ids: bool) -> String {
        if as_ids {
            format!("token_id:{id}")
        } else {
            self.tokenizer.decode(&[id], false).unwrap_or_default()
        }
    }

    fn bad<T>(&self, r: Result<T, ApiError>) -> Result<T, ApiError> {
        if r.is_err() {
            self.stats.bad_requests.fetch_add(1, Ordering::Relaxed);
        }
        r
    }
}

fn finish_reason(r: FinishReason) -> &'static str {
    match r {
        FinishReason::Eos | FinishReason::Stop => "stop",
        FinishReason::Length => "length",
    }
}

fn now_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs())
}

fn request_id(prefix: &str, shared: &Shared) -> String {
    format!(
        "{prefix}-{:x}{:x}",
        now_secs(),
        shared.stats.requests.load(Ordering::Relaxed)
            + shared.stats.bad_requests.load(Ordering::Relaxed)
    )
}

// ---------------------------------------------------------------------------------------------
// Handlers.

async fn stats(State(s): State<Arc<Shared>>) -> Json<Value> {
    let st = &s.stats;
    Json(json!({
        "requests": st.requests.load(Ordering::Relaxed),
        "batches": st.batches.load(Ordering::Relaxed),
        "generate_calls": st.generate_calls.load(Ordering::Relaxed),
        "rejected_busy": st.rejected_busy.load(Ordering::Relaxed),
        "bad_requests": st.bad_requests.load(Ordering::Relaxed),
        "queued": s.queue.len(),
    }))
}

async fn models(State(s): State<Arc<Shared>>) -> Json<Value> {
    let mut data = vec![json!({
        "id": s.base_name,
        "object": "model",
        "created": s.created,
        "owned_by": "grpo-rs",
        "root": s.source.display().to_string(),
        "parent": null,
        "max_model_len": s.max_model_len,
    })];
    if let Ok(map) = s.adapters.read() {
        let mut names: Vec<_> = map.iter().collect();
        names.sort_by(|a, b| a.0.cmp(b.0));
        for (name, (dir, _)) in names {
            data.push(json!({
                "id": name,
                "object": "model",
                "created": s.created,
                "owned_by": "grpo-rs",
                "root": dir.display().to_string(),
                "parent": s.base_name,
                "max_model_len": s.max_model_len,
            }));
        }
    }
    Json(json!({"object": "list", "data": data}))
}

async fn completions(
    State(s): State<Arc<Shared>>,
    body: Result<Json<CompletionRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let mut req = json_body(&s, body)?;
    let echo = req.echo == Some(true);
    // `echo` with `max_tokens: 0` scores the prompt alone (vLLM's, and lm-evaluation-harness's
    // log-likelihood requests).
    let generate =
        !(echo && req.knobs.max_tokens == Some(0) && req.knobs.max_completion_tokens.is_none());
    if !generate {
        req.knobs.max_tokens = Some(1);
    }
    let (model, name, n, seed, mut params) = s.bad(sampling(&s, &req.knobs, 16))?;
    let stream = s.bad(stream_options(&req.knobs))?;
    if echo && stream.is_some() {
        return s.bad(Err(ApiError::bad(
            "echo",
            "`echo` with `stream` is not supported",
        )));
    }
    if let Some(k) = req.logprobs {
        if k > s.max_logprobs {
            return s.bad(Err(ApiError::bad(
                "logprobs",
                format!("`logprobs` must be <= {}, got {k}", s.max_logprobs),
            )));
        }
        params.top_logprobs = k;
    }
    let vocab = s.base.cfg.vocab_size as u32;
    // The prompts' texts as given (token prompts: decoded), for `echo`.
    let (prompts, prompt_texts): (Vec<Vec<u32>>, Vec<Option<String>>) = match req.prompt {
        None => return s.bad(Err(ApiError::bad("prompt", "`prompt` is required"))),
        Some(PromptInput::Text(t)) => (vec![encode(&s, &t)?], vec![Some(t)]),
        Some(PromptInput::Texts(v)) => (
            v.iter().map(|t| encode(&s, t)).collect::<Result<_, _>>()?,
            v.into_iter().map(Some).collect(),
        ),
        Some(PromptInput::Ids(v)) => (vec![v], vec![None]),
        Some(PromptInput::IdLists(v)) => {
            let n = v.len();
            (v, vec![None; n])
        }
    };
    if prompts.is_empty() {
        return s.bad(Err(ApiError::bad("prompt", "`prompt` is an empty list")));
    }
    for p in &prompts {
        s.bad(s.check_length(p.len(), params.max_new_tokens, "prompt"))?;
        if let Some(&bad) = p.iter().find(|&&t| t >= vocab) {
            return s.bad(Err(ApiError::bad(
                "prompt",
                format!("`prompt`: token id {bad} is out of the vocabulary (size {vocab})"),
            )));
        }
    }
    let shape = Shape {
        chat: false,
        logprobs: req.logprobs.is_some(),
        as_ids: req.knobs.return_tokens_as_token_ids == Some(true),
        with_ids: req.knobs.return_token_ids == Some(true),
    };
    if let Some(opts) = stream {
        let rx = s.run_streamed(model, prompts.clone(), n, seed, params)?;
        return Ok(Streamer::new(&s, shape, name, prompts, n, opts).respond(rx));
    }
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let scores = match echo && shape.logprobs {
        true => Some(
            s.score(model.clone(), prompts.clone(), req.logprobs.unwrap_or(0))
                .await?,
        ),
        false => None,
    };
    let comps = match generate {
        true => s.run(model, prompts.clone(), n, seed, params).await?,
        // Scoring alone: one empty choice per prompt and sample, as vLLM answers.
        false => (0..prompts.len())
            .flat_map(|p| {
                (0..n).map(move |j| Completion {
                    prompt_index: p,
                    sample_index: j,
                    token_ids: Vec::new(),
                    text: String::new(),
                    logprobs: Vec::new(),
                    finish_reason: grpo_rollout::FinishReason::Length,
                    top_logprobs: Vec::new(),
                })
            })
            .collect(),
    };
    let mut completion_tokens = 0;
    let choices: Vec<Value> = comps
        .iter()
        .enumerate()
        .map(|(i, c)| {
            completion_tokens += c.token_ids.len();
            let p = c.prompt_index;
            let echoed = match echo {
                true => prompt_texts[p]
                    .clone()
                    .unwrap_or_else(|| s.tokenizer.decode(&prompts[p], false).unwrap_or_default()),
                false => String::new(),
            };
            let logprobs = match &scores {
                Some(sc) => shape.echoed_logprobs(&s, &prompts[p], &sc[p], c),
                None => shape.logprobs(&s, &c.token_ids, &c.logprobs, &c.top_logprobs, &mut 0),
            };
            let mut choice = json!({
                "index": i,
                "text": format!("{echoed}{}", c.text),
                "logprobs": logprobs,
                "finish_reason": finish_reason(c.finish_reason),
            });
            if shape.with_ids {
                choice["token_ids"] = json!(c.token_ids);
                choice["prompt_token_ids"] = json!(prompts[c.prompt_index]);
            }
            choice
        })
        .collect();
    let mut out = envelope(&s, "text_completion", &name, now_secs(), choices);
    out["usage"] = usage(prompt_tokens, completion_tokens);
    Ok(Json(out).into_response())
}

/// What an answer holds besides the text: which endpoint's format, log-probs, tokens spelled
/// `token_id:N`, and `token_ids`.
#[derive(Debug, Clone, Copy)]
struct Shape {
    chat: bool,
    logprobs: bool,
    as_ids: bool,
    with_ids: bool,
}

impl Shape {
    /// A choice's `logprobs` for `ids` (null unless asked for): chat's `{"content": [...]}` or
    /// completions' `tokens` / `token_logprobs` / `top_logprobs` / `text_offset`, the offsets
    /// counted from `offset` (which moves past these tokens).
    fn logprobs(
        &self,
        s: &Shared,
        ids: &[u32],
        lps: &[f32],
        tops: &[Vec<(u32, f32)>],
        offset: &mut usize,
    ) -> Value {
        if !self.logprobs {
            return Value::Null;
        }
        if self.chat {
            let entry = |t: u32, lp: f32| {
                let text = s.token_text(t, self.as_ids);
                let bytes: Vec<u8> = text.as_bytes().to_vec();
                json!({"token": text, "logprob": lp, "bytes": bytes})
            };
            let content: Vec<Value> = ids
                .iter()
                .enumerate()
                .map(|(k, &t)| {
                    let mut e = entry(t, lps[k]);
                    let alts: Vec<Value> = tops
                        .get(k)
                        .map(|a| a.iter().map(|&(x, lp)| entry(x, lp)).collect())
                        .unwrap_or_default();
                    e["top_logprobs"] = Value::Array(alts);
                    e
                })
                .collect();
            return json!({ "content": content });
        }
        let tokens: Vec<String> = ids.iter().map(|&t| s.token_text(t, self.as_ids)).collect();
        let mut offsets = Vec::with_capacity(ids.len());
        for &t in ids {
            offsets.push(*offset);
            *offset += s.tokenizer.decode(&[t], true).map_or(0, |x| x.len());
        }
        let top: Vec<Value> = ids
            .iter()
            .enumerate()
            .map(|(k, &t)| {
                let mut m = serde_json::Map::new();
                m.insert(s.token_text(t, self.as_ids), json!(lps[k]));
                if let Some(alts) = tops.get(k) {
                    for &(a, lp) in alts {
                        m.insert(s.token_text(a, self.as_ids), json!(lp));
                    }
                }
                Value::Object(m)
            })
            .collect();
        json!({
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": top,
            "text_offset": offsets,
        })
    }
}

impl Shape {
    /// A completions choice's `logprobs` with the prompt echoed: the prompt's tokens first (the
    /// first one's log-prob and alternatives null, as vLLM's), then the completion's, the text
    /// offsets running over both.
    fn echoed_logprobs(
        &self,
        s: &Shared,
        prompt: &[u32],
        scores: &PromptScores,
        c: &Completion,
    ) -> Value {
        let mut offset = 0;
        let head = self.logprobs(s, &prompt[..prompt.len().min(1)], &[0.0], &[], &mut offset);
        let rest = match prompt.len() > 1 {
            true => self.logprobs(s, &prompt[1..], &scores.logprobs, &scores.top, &mut offset),
            false => Value::Null,
        };
        let tail = self.logprobs(s, &c.token_ids, &c.logprobs, &c.top_logprobs, &mut offset);
        let mut out = json!({
            "tokens": [],
            "token_logprobs": [],
            "top_logprobs": [],
            "text_offset": [],
        });
        for (k, part) in [head, rest, tail].into_iter().enumerate() {
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let Some(items) = part.get(key).and_then(Value::as_array) else {
                    continue;
                };
                let list = out[key].as_array_mut().expect("built above");
                for (i, item) in items.iter().enumerate() {
                    // The first prompt token has no log-prob: null, as vLLM's.
                    let null = k == 0 && i == 0 && matches!(key, "token_logprobs" | "top_logprobs");
                    list.push(if null { Value::Null } else { item.clone() });
                }
            }
        }
        out
    }
}

/// The body around the choices (OpenAI's `id`, `object`, `created`, `model`).
fn envelope(s: &Shared, object: &str, model: &str, created: u64, choices: Vec<Value>) -> Value {
    let prefix = if object.starts_with("chat.") {
        "chatcmpl"
    } else {
        "cmpl"
    };
    json!({
        "id": request_id(prefix, s),
        "object": object,
        "created": created,
        "model": model,
        "choices": choices,
    })
}

fn usage(prompt_tokens: usize, completion_tokens: usize) -> Value {
    json!({
        "prompt_tokens": prompt_tokens,
        "completion_tokens": completion_tokens,
        "total_tokens": prompt_tokens + completion_tokens,
    })
}

/// A streamed answer: OpenAI's chunks (`text_completion` or `chat.completion.chunk` objects
/// with one `id` and `created`) as server-sent events, then `data: [DONE]`.
struct Streamer {
    shared: Arc<Shared>,
    shape: Shape,
    opts: StreamOptions,
    /// The first chunk's envelope (`id`, `object`, `created`, `model`), reused by every chunk.
    head: Value,
    prompts: Vec<Vec<u32>>,
    n: usize,
    /// Per choice: whether a chunk has been sent, and its text offset so far.
    started: Vec<bool>,
    offsets: Vec<usize>,
    finished: usize,
    completion_tokens: usize,
}

/// Where a [`Streamer`] is.
enum StreamPhase {
    /// Chat's opening chunks (`delta.role`) are still to send.
    Opening,
    Pieces,
    Done,
}

impl Streamer {
    fn new(
        s: &Arc<Shared>,
        shape: Shape,
        model: String,
        prompts: Vec<Vec<u32>>,
        n: usize,
        opts: StreamOptions,
    ) -> Self {
        let object = if shape.chat {
            "chat.completion.chunk"
        } else {
            "text_completion"
        };
        let choices = prompts.len() * n;
        Self {
            shared: s.clone(),
            shape,
            opts,
            head: envelope(s, object, &model, now_secs(), Vec::new()),
            prompts,
            n,
            started: vec![false; choices],
            offsets: vec![0; choices],
            finished: 0,
            completion_tokens: 0,
        }
    }

    /// The `text/event-stream` response; events are sent as pieces arrive.
    fn respond(self, rx: tokio::sync::mpsc::UnboundedReceiver<Piece>) -> Response {
        let first = if self.shape.chat {
            StreamPhase::Opening
        } else {
            StreamPhase::Pieces
        };
        let events =
            futures_util::stream::unfold((self, rx, first), |(mut st, mut rx, phase)| async move {
                let (text, next) = match phase {
                    StreamPhase::Done => return None,
                    StreamPhase::Opening => (st.opening(), StreamPhase::Pieces),
                    StreamPhase::Pieces => match rx.recv().await {
                        Some(Piece::Chunk {
                            index,
                            text,
                            token_ids,
                            logprobs,
                            top,
                            finish,
                        }) => (
                            st.chunk(index, &text, &token_ids, &logprobs, &top, finish),
                            StreamPhase::Pieces,
                        ),
                        Some(Piece::Error(e)) => (st.error(e), StreamPhase::Done),
                        None => (st.close(), StreamPhase::Done),
                    },
                };
                Some((Ok::<_, Infallible>(text), (st, rx, next)))
            });
        let mut r = Response::new(Body::from_stream(events));
        let h = r.headers_mut();
        h.insert(
            header::CONTENT_TYPE,
            HeaderValue::from_static("text/event-stream"),
        );
        h.insert(header::CACHE_CONTROL, HeaderValue::from_static("no-cache"));
        r
    }

    fn event(v: &Value) -> String {
        format!("data: {v}\n\n")
    }

    /// A chunk with these choices (and running usage with `continuous_usage_stats`).
    fn envelope(&self, choices: Vec<Value>) -> Value {
        let mut v = self.head.clone();
        v["choices"] = Value::Array(choices);
        if self.opts.continuous_usage {
            v["usage"] = usage(self.prompt_tokens(), self.completion_tokens);
        }
        v
    }

    fn prompt_tokens(&self) -> usize {
        self.prompts.iter().map(Vec::len).sum()
    }

    /// Chat: each choice opens with `delta: {"role": "assistant", "content": ""}`.
    fn opening(&mut self) -> String {
        let mut out = String::new();
        for i in 0..self.started.len() {
            let choice = json!({
                "index": i,
                "delta": {"role": "assistant", "content": ""},
                "logprobs": null,
                "finish_reason": null,
            });
            let mut v = self.envelope(vec![choice]);
            if self.shape.with_ids && i == 0 {
                v["prompt_token_ids"] = json!(self.prompts[0]);
            }
            out.push_str(&Self::event(&v));
        }
        out
    }

    fn chunk(
        &mut self,
        index: usize,
        text: &str,
        ids: &[u32],
        lps: &[f32],
        tops: &[Vec<(u32, f32)>],
        finish: Option<FinishReason>,
    ) -> String {
        self.completion_tokens += ids.len();
        if finish.is_some() {
            self.finished += 1;
        }
        let logprobs = self
            .shape
            .logprobs(&self.shared, ids, lps, tops, &mut self.offsets[index]);
        let mut choice = if self.shape.chat {
            json!({"index": index, "delta": {"content": text}})
        } else {
            json!({"index": index, "text": text})
        };
        choice["logprobs"] = logprobs;
        choice["finish_reason"] = json!(finish.map(finish_reason));
        if self.shape.with_ids {
            choice["token_ids"] = json!(ids);
            if !self.shape.chat && !self.started[index] {
                choice["prompt_token_ids"] = json!(self.prompts[index / self.n]);
            }
        }
        self.started[index] = true;
        Self::event(&self.envelope(vec![choice]))
    }

    /// After the last piece: the usage chunk (with `include_usage`), then `[DONE]`.
    fn close(&mut self) -> String {
        if self.finished < self.started.len() {
            return self.error("the engine dropped the request".into());
        }
        let mut out = String::new();
        if self.opts.include_usage {
            let mut v = self.head.clone();
            v["usage"] = usage(self.prompt_tokens(), self.completion_tokens);
            out.push_str(&Self::event(&v));
        }
        out.push_str("data: [DONE]\n\n");
        out
    }

    /// An error once the answer has begun: an `{"error": ...}` event, then `[DONE]`.
    fn error(&self, message: String) -> String {
        let e = ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message,
            param: None,
        };
        format!("{}data: [DONE]\n\n", Self::event(&e.body()))
    }
}

fn encode(s: &Shared, text: &str) -> Result<Vec<u32>, ApiError> {
    s.tokenizer.encode(text, true).map_err(|e| {
        ApiError::bad(
            "prompt",
            format!("`prompt`: cannot tokenise: {}", one_line(&e)),
        )
    })
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Response, ApiError> {
    let req = json_body(&s, body)?;
    let (model, name, n, seed, mut params) = s.bad(sampling(&s, &req.knobs, 1 << 30))?;
    let stream = s.bad(stream_options(&req.knobs))?;
    let top = req.top_logprobs.unwrap_or(0);
    if top > s.max_logprobs {
        return s.bad(Err(ApiError::bad(
            "top_logprobs",
            format!("`top_logprobs` must be <= {}, got {top}", s.max_logprobs),
        )));
    }
    if top > 0 && req.logprobs != Some(true) {
        return s.bad(Err(ApiError::bad(
            "top_logprobs",
            "`top_logprobs` needs `logprobs: true`",
        )));
    }
    params.top_logprobs = top;
    if req.messages.is_empty() {
        return s.bad(Err(ApiError::bad("messages", "`messages` is empty")));
    }
    let mut msgs = Vec::with_capacity(req.messages.len());
    for (i, m) in req.messages.iter().enumerate() {
        let text = match &m.content {
            None => String::new(),
            Some(Content::Text(t)) => t.clone(),
            Some(Content::Parts(parts)) => {
                let mut t = String::new();
                for p in parts {
                    if p.kind != "text" {
                        return s.bad(Err(ApiError::bad(
                            "messages",
                            format!("`messages[{i}].content`: part type `{}` is not supported (text only)", p.kind),
                        )));
                    }
                    t.push_str(p.text.as_deref().unwrap_or(""));
                }
                t
            }
        };
        msgs.push(ChatMessage::new(m.role.clone(), text));
    }
    let rendered = s
        .tokenizer
        .apply_chat_template(&msgs, req.add_generation_prompt.unwrap_or(true))
        .map_err(|e| ApiError::bad("messages", format!("`messages`: {}", one_line(&e))));
    let rendered = s.bad(rendered)?;
    let ids = s.tokenizer.encode(&rendered, false).map_err(|e| {
        ApiError::bad(
            "messages",
            format!("`messages`: cannot tokenise: {}", one_line(&e)),
        )
    })?;
    // Without max_tokens, the completion may fill the context.
    if params.max_new_tokens == 1 << 30 {
        params.max_new_tokens = s.max_model_len.saturating_sub(ids.len()).max(1);
        params.min_new_tokens = params.min_new_tokens.min(params.max_new_tokens);
    }
    s.bad(s.check_length(ids.len(), params.max_new_tokens, "messages"))?;
    let shape = Shape {
        chat: true,
        logprobs: req.logprobs == Some(true),
        as_ids: req.knobs.return_tokens_as_token_ids == Some(true),
        with_ids: req.knobs.return_token_ids == Some(true),
    };
    if let Some(opts) = stream {
        let rx = s.run_streamed(model, vec![ids.clone()], n, seed, params)?;
        return Ok(Streamer::new(&s, shape, name, vec![ids], n, opts).respond(rx));
    }
    let prompt_tokens = ids.len();
    let comps = s.run(model, vec![ids.clone()], n, seed, params).await?;
    let mut completion_tokens = 0;
    let choices: Vec<Value> = comps
        .iter()
        .enumerate()
        .map(|(i, c)| {
            completion_tokens += c.token_ids.len();
            let mut choice = json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": shape.logprobs(&s, &c.token_ids, &c.logprobs, &c.top_logprobs, &mut 0),
                "finish_reason": finish_reason(c.finish_reason),
            });
            if shape.with_ids {
                choice["token_ids"] = json!(c.token_ids);
            }
            choice
        })
        .collect();
    let mut out = envelope(&s, "chat.completion", &name, now_secs(), choices);
    out["usage"] = usage(prompt_tokens, completion_tokens);
    if shape.with_ids {
        out["prompt_token_ids"] = json!(ids);
    }
    Ok(Json(out).into_response())
}

#[derive(Debug, Deserialize)]
struct LoadLora {
    lora_name: String,
    lora_path: String,
    #[serde(default)]
    load_inplace: bool,
}

#[derive(Debug, Deserialize)]
struct UnloadLora {
    lora_name: String,
}

async fn load_lora_adapter(
    State(s): State<Arc<Shared>>,
    body: Result<Json<LoadLora>, JsonRejection>,
) -> Result<Response, ApiError> {
    let req = json_body(&s, body)?;
    if req.lora_name.is_empty() || req.lora_name == s.base_name {
        return s.bad(Err(ApiError::bad(
            "lora_name",
            format!(
                "`lora_name` must be non-empty and differ from the base model `{}`",
                s.base_name
            ),
        )));
    }
    let exists = s
        .adapters
        .read()
        .map(|m| m.contains_key(&req.lora_name))
        .unwrap_or(false);
    if exists && !req.load_inplace {
        return s.bad(Err(ApiError::bad(
            "lora_name",
            format!(
                "The lora adapter '{}' has already been loaded.",
                req.lora_name
            ),
        )));
    }
    let dir = PathBuf::from(&req.lora_path);
    let base = s.base.clone();
    let d2 = dir.clone();
    let loaded = tokio::task::spawn_blocking(move || with_adapter(&base, &d2))
        .await
        .map_err(|e| ApiError {
            status: StatusCode::INTERNAL_SERVER_ERROR,
            message: format!("adapter loading panicked: {e}"),
            param: None,
        })?;
    let model = s.bad(loaded.map_err(|e| {
        ApiError::bad("lora_path", format!("`lora_path` {}: {e:#}", dir.display()))
    }))?;
    if let Ok(mut m) = s.adapters.write() {
        m.insert(req.lora_name.clone(), (dir, Arc::new(model)));
    }
    Ok((
        StatusCode::OK,
        format!(
            "Success: LoRA adapter '{}' added successfully.",
            req.lora_name
        ),
    )
        .into_response())
}

async fn unload_lora_adapter(
    State(s): State<Arc<Shared>>,
    body: Result<Json<UnloadLora>, JsonRejection>,
) -> Result<Response, ApiError> {
    let req = json_body(&s, body)?;
    let removed = s
        .adapters
        .write()
        .map(|mut m| m.remove(&req.lora_name).is_some())
        .unwrap_or(false);
    if !removed {
        return s.bad(Err(ApiError {
            status: StatusCode::NOT_FOUND,
            message: format!("The lora adapter '{}' cannot be found.", req.lora_name),
            param: Some("lora_name".into()),
        }));
    }
    Ok((
        StatusCode::OK,
        format!(
            "Success: LoRA adapter '{}' removed successfully.",
            req.lora_name
        ),
    )
        .into_response())
}
