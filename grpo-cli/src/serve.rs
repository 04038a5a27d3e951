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
//! unknown model) with an OpenAI-style `{"error": {...}}` body naming the field.

use std::collections::HashMap;
use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
use std::time::{SystemTime, UNIX_EPOCH};

use anyhow::{Context, Result, anyhow};
use axum::extract::State;
use axum::extract::rejection::JsonRejection;
use axum::http::{HeaderValue, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::{Json, Router};
use candle_core::{DType, Device};
use grpo_rollout::generate::{Completion, FinishReason, PromptRequest, SamplingParams};
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
    reply: tokio::sync::oneshot::Sender<Result<Vec<Completion>, String>>,
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
    grpo_rollout::lora::load_peft(&mut m, dir).map_err(|e| anyhow!("{e}"))?;
    Ok(m)
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
        // Group by (model, knobs); order of arrival is kept within a group.
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
    let result = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
        grpo_rollout::generate::generate_batch(&model, &shared.tokenizer, &reqs, &params)
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
        Ok(Err(e)) => Err(format!("generation failed: {e}")),
        Err(_) => Err("generation panicked".to_string()),
    };
    for (job, comps) in group.into_iter().zip(per_job) {
        shared.stats.requests.fetch_add(1, Ordering::Relaxed);
        let _ = job.reply.send(match &outcome {
            Ok(()) => Ok(comps),
            Err(e) => Err(e.clone()),
        });
    }
}

// ---------------------------------------------------------------------------------------------
// Errors.

/// An OpenAI-style error response.
struct ApiError {
    status: StatusCode,
    message: String,
    param: Option<&'static str>,
}

impl ApiError {
    fn bad(param: &'static str, message: impl Into<String>) -> Self {
        Self {
            status: StatusCode::BAD_REQUEST,
            message: message.into(),
            param: Some(param),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let kind = match self.status {
            StatusCode::NOT_FOUND => "NotFoundError",
            StatusCode::TOO_MANY_REQUESTS => "RateLimitError",
            s if s.is_server_error() => "InternalServerError",
            _ => "BadRequestError",
        };
        let body = json!({"error": {
            "message": self.message,
            "type": kind,
            "param": self.param,
            "code": self.status.as_u16(),
        }});
        let mut r = (self.status, Json(body)).into_response();
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
                    param: Some("model"),
                });
            }
        }
    };
    if k.stream == Some(true) {
        return Err(ApiError::bad(
            "stream",
            "`stream`: streaming is not supported; send stream=false",
        ));
    }
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
    };
    if let Err(e) = params.validate() {
        let msg = e.to_string();
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
        let job = Job {
            model,
            prompts,
            n,
            seed,
            params,
            reply: tx,
        };
        if let Err(e) = self.queue.try_send(job) {
            return Err(match e {
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
            });
        }
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

fn finish_reason(c: &Completion) -> &'static str {
    match c.finish_reason {
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
) -> Result<Json<Value>, ApiError> {
    let req = json_body(&s, body)?;
    let (model, name, n, seed, mut params) = s.bad(sampling(&s, &req.knobs, 16))?;
    if req.echo == Some(true) {
        return s.bad(Err(ApiError::bad("echo", "`echo` is not supported")));
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
    let prompts: Vec<Vec<u32>> = match req.prompt {
        None => return s.bad(Err(ApiError::bad("prompt", "`prompt` is required"))),
        Some(PromptInput::Text(t)) => vec![encode(&s, &t)?],
        Some(PromptInput::Texts(v)) => v.iter().map(|t| encode(&s, t)).collect::<Result<_, _>>()?,
        Some(PromptInput::Ids(v)) => vec![v],
        Some(PromptInput::IdLists(v)) => v,
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
    let as_ids = req.knobs.return_tokens_as_token_ids == Some(true);
    let with_ids = req.knobs.return_token_ids == Some(true);
    let want_lp = req.logprobs.is_some();
    let prompt_tokens: usize = prompts.iter().map(Vec::len).sum();
    let comps = s.run(model, prompts.clone(), n, seed, params).await?;
    let mut completion_tokens = 0;
    let choices: Vec<Value> = comps
        .iter()
        .enumerate()
        .map(|(i, c)| {
            completion_tokens += c.token_ids.len();
            let logprobs = if want_lp {
                let tokens: Vec<String> = c
                    .token_ids
                    .iter()
                    .map(|&t| s.token_text(t, as_ids))
                    .collect();
                let mut offsets = Vec::with_capacity(tokens.len());
                let mut at = 0usize;
                for &t in &c.token_ids {
                    offsets.push(at);
                    at += s.tokenizer.decode(&[t], true).map_or(0, |x| x.len());
                }
                let top: Vec<Value> = c
                    .token_ids
                    .iter()
                    .enumerate()
                    .map(|(k, &t)| {
                        let mut m = serde_json::Map::new();
                        m.insert(s.token_text(t, as_ids), json!(c.logprobs[k]));
                        if let Some(alts) = c.top_logprobs.get(k) {
                            for &(a, lp) in alts {
                                m.insert(s.token_text(a, as_ids), json!(lp));
                            }
                        }
                        Value::Object(m)
                    })
                    .collect();
                json!({
                    "tokens": tokens,
                    "token_logprobs": c.logprobs,
                    "top_logprobs": top,
                    "text_offset": offsets,
                })
            } else {
                Value::Null
            };
            let mut choice = json!({
                "index": i,
                "text": c.text,
                "logprobs": logprobs,
                "finish_reason": finish_reason(c),
            });
            if with_ids {
                choice["token_ids"] = json!(c.token_ids);
                choice["prompt_token_ids"] = json!(prompts[c.prompt_index]);
            }
            choice
        })
        .collect();
    Ok(Json(envelope(
        &s,
        "text_completion",
        &name,
        choices,
        prompt_tokens,
        completion_tokens,
    )))
}

/// The body around the choices (OpenAI's `id`, `object`, `created`, `model`, `usage`).
fn envelope(
    s: &Shared,
    object: &str,
    model: &str,
    choices: Vec<Value>,
    prompt_tokens: usize,
    completion_tokens: usize,
) -> Value {
    let prefix = if object == "chat.completion" {
        "chatcmpl"
    } else {
        "cmpl"
    };
    json!({
        "id": request_id(prefix, s),
        "object": object,
        "created": now_secs(),
        "model": model,
        "choices": choices,
        "usage": {
            "prompt_tokens": prompt_tokens,
            "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
        },
    })
}

fn encode(s: &Shared, text: &str) -> Result<Vec<u32>, ApiError> {
    s.tokenizer
        .encode(text, true)
        .map_err(|e| ApiError::bad("prompt", format!("`prompt`: cannot tokenise: {e}")))
}

async fn chat_completions(
    State(s): State<Arc<Shared>>,
    body: Result<Json<ChatRequest>, JsonRejection>,
) -> Result<Json<Value>, ApiError> {
    let req = json_body(&s, body)?;
    let (model, name, n, seed, mut params) = s.bad(sampling(&s, &req.knobs, 1 << 30))?;
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
        .map_err(|e| ApiError::bad("messages", format!("`messages`: {e}")));
    let rendered = s.bad(rendered)?;
    let ids = s
        .tokenizer
        .encode(&rendered, false)
        .map_err(|e| ApiError::bad("messages", format!("`messages`: cannot tokenise: {e}")))?;
    // Without max_tokens, the completion may fill the context.
    if params.max_new_tokens == 1 << 30 {
        params.max_new_tokens = s.max_model_len.saturating_sub(ids.len()).max(1);
        params.min_new_tokens = params.min_new_tokens.min(params.max_new_tokens);
    }
    s.bad(s.check_length(ids.len(), params.max_new_tokens, "messages"))?;
    let as_ids = req.knobs.return_tokens_as_token_ids == Some(true);
    let with_ids = req.knobs.return_token_ids == Some(true);
    let prompt_tokens = ids.len();
    let comps = s.run(model, vec![ids.clone()], n, seed, params).await?;
    let mut completion_tokens = 0;
    let entry = |t: u32, lp: f32| {
        let text = s.token_text(t, as_ids);
        let bytes: Vec<u8> = text.as_bytes().to_vec();
        json!({"token": text, "logprob": lp, "bytes": bytes})
    };
    let choices: Vec<Value> = comps
        .iter()
        .enumerate()
        .map(|(i, c)| {
            completion_tokens += c.token_ids.len();
            let logprobs = if req.logprobs == Some(true) {
                let content: Vec<Value> = c
                    .token_ids
                    .iter()
                    .enumerate()
                    .map(|(k, &t)| {
                        let mut e = entry(t, c.logprobs[k]);
                        let alts: Vec<Value> = c
                            .top_logprobs
                            .get(k)
                            .map(|a| a.iter().map(|&(x, lp)| entry(x, lp)).collect())
                            .unwrap_or_default();
                        e["top_logprobs"] = Value::Array(alts);
                        e
                    })
                    .collect();
                json!({"content": content})
            } else {
                Value::Null
            };
            let mut choice = json!({
                "index": i,
                "message": {"role": "assistant", "content": c.text},
                "logprobs": logprobs,
                "finish_reason": finish_reason(c),
            });
            if with_ids {
                choice["token_ids"] = json!(c.token_ids);
            }
            choice
        })
        .collect();
    let mut out = envelope(
        &s,
        "chat.completion",
        &name,
        choices,
        prompt_tokens,
        completion_tokens,
    );
    if with_ids {
        out["prompt_token_ids"] = json!(ids);
    }
    Ok(Json(out))
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
            param: Some("lora_name"),
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
