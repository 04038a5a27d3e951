//! A loopback OpenAI-compatible chat-completions server for tests and benchmarks, which also
//! answers `POST /rewards` as the scoring service of a `type = "http"` reward.
//!
//! Binds `127.0.0.1:0` only, runs on its own thread (so sync and async tests can both use it)
//! and stops when dropped. Knobs: latency, a queue of one-shot faults (429 with `Retry-After`,
//! any status, hangs, malformed bodies), a default fault applied to every request, refusing the
//! JSON-schema `response_format`, and the reply content as a function of the request.

use std::collections::VecDeque;
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use axum::Router;
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::post;
use serde_json::{Value, json};

/// One way to answer badly.
#[derive(Debug, Clone, PartialEq)]
pub enum Fault {
    /// 429 with `Retry-After: secs` (fractional seconds allowed; `None` = no header).
    RateLimited {
        /// The `Retry-After` value in seconds.
        retry_after: Option<f64>,
    },
    /// 429 with this exact `Retry-After` header value (e.g. an HTTP date).
    RateLimitedRaw {
        /// The header value, sent as is.
        retry_after: String,
    },
    /// An error status (500, 503, 400...) with a small JSON error body.
    Status(u16),
    /// Never answer (until the server is dropped).
    Hang,
    /// 200 with a body that is not JSON.
    Malformed,
    /// 200 with a valid completion whose content is this text (e.g. no score in it); on
    /// `/rewards`, 200 with this text as the whole body.
    Content(String),
    /// This status with the request's headers in the body, on one line as `name: value; ...` (a
    /// careless server that echoes the API key back).
    EchoHeaders(u16),
}

/// The reply content for a request (the parsed JSON body).
pub type ReplyFn = Arc<dyn Fn(&Value) -> String + Send + Sync>;

/// The answer of `POST /rewards` to a request (the parsed JSON body).
pub type RewardsFn = Arc<dyn Fn(&Value) -> Value + Send + Sync>;

/// What the server does.
#[derive(Clone)]
pub struct ServerConfig {
    /// Delay before every answer.
    pub latency: Duration,
    /// Answer 400 to requests carrying a `response_format` (servers without structured output).
    pub reject_response_format: bool,
    /// Applied to every request when the one-shot queue is empty.
    pub default_fault: Option<Fault>,
    /// The reply content; default [`score_from_prompt`].
    pub reply: ReplyFn,
    /// The answer of `POST /rewards`; default [`rewards_from_completions`].
    pub rewards: RewardsFn,
}

impl std::fmt::Debug for ServerConfig {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ServerConfig")
            .field("latency", &self.latency)
            .field("reject_response_format", &self.reject_response_format)
            .field("default_fault", &self.default_fault)
            .finish_non_exhaustive()
    }
}

impl Default for ServerConfig {
    fn default() -> Self {
        Self {
            latency: Duration::ZERO,
            reject_response_format: false,
            default_fault: None,
            reply: Arc::new(score_from_prompt),
            rewards: Arc::new(rewards_from_completions),
        }
    }
}

/// The default reply: `{"score": S, "explanation": "..."}` where `S` is the number after the
/// last `SCORE=` in the last message (0.5 when absent).
pub fn score_from_prompt(request: &Value) -> String {
    let text = last_message(request);
    let score = text
        .rfind("SCORE=")
        .map(|p| &text[p + 6..])
        .map(|rest| {
            rest.chars()
                .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == '-')
                .collect::<String>()
        })
        .and_then(|s| s.parse::<f64>().ok())
        .unwrap_or(0.5);
    json!({"score": score, "explanation": format!("judged {} chars", text.len())}).to_string()
}

/// The default answer of `POST /rewards`: `{"rewards": [...]}` with, per completion, the
/// number after its last `SCORE=` (`null` when there is none). A conversational completion
/// (`[{"role": "assistant", "content": ...}]`) is read from its last message's content.
pub fn rewards_from_completions(request: &Value) -> Value {
    let rewards: Vec<Value> = request["completions"]
        .as_array()
        .map(Vec::as_slice)
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let text = match c {
                Value::Array(m) => m
                    .last()
                    .and_then(|m| m["content"].as_str())
                    .unwrap_or_default(),
                other => other.as_str().unwrap_or_default(),
            };
            text.rfind("SCORE=")
                .map(|p| {
                    text[p + 6..]
                        .chars()
                        .take_while(|c| c.is_ascii_digit() || *c == '.' || *c == '-')
                        .collect::<String>()
                })
                .and_then(|s| s.parse::<f64>().ok())
                .map_or(Value::Null, Value::from)
        })
        .collect();
    json!({ "rewards": rewards })
}

/// The content of the request's last message.
pub fn last_message(request: &Value) -> String {
    request["messages"]
        .as_array()
        .and_then(|m| m.last())
        .and_then(|m| m["content"].as_str())
        .unwrap_or_default()
        .to_owned()
}

/// What the server saw.
#[derive(Debug, Clone, Default)]
pub struct ServerStats {
    /// Requests received.
    pub requests: u64,
    /// Requests answered 200 with a completion (or, on `/rewards`, with rewards).
    pub completions: u64,
    /// Most requests in flight at once.
    pub max_in_flight: u64,
    /// Requests that carried a `response_format`.
    pub with_response_format: u64,
    /// Arrival times, in order.
    pub arrivals: Vec<Instant>,
    /// `Authorization` headers seen (distinct).
    pub authorizations: Vec<String>,
    /// The JSON bodies received, in order (the first 10,000).
    pub bodies: Vec<Value>,
    /// The headers of each request, as `(lower-case name, value)`, in the order of `bodies`.
    pub headers: Vec<Vec<(String, String)>>,
}

struct Shared {
    config: Mutex<ServerConfig>,
    faults: Mutex<VecDeque<Fault>>,
    stats: Mutex<ServerStats>,
    in_flight: AtomicU64,
}

/// A running loopback server; stops when dropped.
pub struct LoopbackServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for LoopbackServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("LoopbackServer")
            .field("addr", &self.addr)
            .finish_non_exhaustive()
    }
}

impl LoopbackServer {
    /// Starts a server on `127.0.0.1:0` with `config`.
    pub fn start(config: ServerConfig) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            config: Mutex::new(config),
            faults: Mutex::new(VecDeque::new()),
            stats: Mutex::new(ServerStats::default()),
            in_flight: AtomicU64::new(0),
        });
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let app_state = shared.clone();
        let (ready_tx, ready_rx) = std::sync::mpsc::channel::<std::io::Result<()>>();
        let thread = std::thread::Builder::new()
            .name("loopback-openai".into())
            .spawn(move || {
                let rt = match tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                {
                    Ok(rt) => rt,
                    Err(e) => {
                        let _ = ready_tx.send(Err(e));
                        return;
                    }
                };
                rt.block_on(async move {
                    let listener = match tokio::net::TcpListener::from_std(std_listener) {
                        Ok(l) => l,
                        Err(e) => {
                            let _ = ready_tx.send(Err(e));
                            return;
                        }
                    };
                    let _ = ready_tx.send(Ok(()));
                    let app = Router::new()
                        .route("/v1/chat/completions", post(chat))
                        .route("/chat/completions", post(chat))
                        .route("/rewards", post(rewards))
                        .with_state(app_state);
                    tokio::select! {
                        _ = axum::serve(listener, app).into_future() => {}
                        _ = stop_rx => {}
                    }
                });
                // Dropping the runtime cancels hung handlers.
            })?;
        ready_rx
            .recv()
            .map_err(|_| std::io::Error::other("the server thread died"))??;
        Ok(Self {
            addr,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT/v1`.
    pub fn base_url(&self) -> String {
        format!("http://{}/v1", self.addr)
    }

    /// `http://127.0.0.1:PORT/rewards`: the scoring service of a `type = "http"` reward.
    pub fn rewards_url(&self) -> String {
        format!("http://{}/rewards", self.addr)
    }

    /// Queues one-shot faults, used by the next requests in order.
    pub fn push_faults(&self, faults: impl IntoIterator<Item = Fault>) {
        if let Ok(mut q) = self.shared.faults.lock() {
            q.extend(faults);
        }
    }

    /// Changes the config of a running server.
    pub fn update(&self, f: impl FnOnce(&mut ServerConfig)) {
        if let Ok(mut c) = self.shared.config.lock() {
            f(&mut c);
        }
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> ServerStats {
        self.shared
            .stats
            .lock()
            .map(|s| s.clone())
            .unwrap_or_default()
    }

    /// Clears the statistics.
    pub fn reset_stats(&self) {
        if let Ok(mut s) = self.shared.stats.lock() {
            *s = ServerStats::default();
        }
    }
}

impl Drop for LoopbackServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

struct InFlight<'a>(&'a AtomicU64);
impl Drop for InFlight<'_> {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

/// What every route does first: counts the request, records it, picks its fault and waits the
/// latency. Returns the body, the config, the fault and the in-flight guard.
async fn admit<'a>(
    shared: &'a Shared,
    headers: &HeaderMap,
    body: &[u8],
) -> (Value, ServerConfig, Option<Fault>, InFlight<'a>) {
    let now = shared.in_flight.fetch_add(1, Ordering::SeqCst) + 1;
    let guard = InFlight(&shared.in_flight);
    let request: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    let config = shared.config.lock().map(|c| c.clone()).unwrap_or_default();
    let fault = shared
        .faults
        .lock()
        .ok()
        .and_then(|mut q| q.pop_front())
        .or(config.default_fault.clone());
    if let Ok(mut s) = shared.stats.lock() {
        s.requests += 1;
        s.max_in_flight = s.max_in_flight.max(now);
        s.arrivals.push(Instant::now());
        if request.get("response_format").is_some() {
            s.with_response_format += 1;
        }
        if let Some(a) = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            && !s.authorizations.iter().any(|x| x == a)
        {
            s.authorizations.push(a.to_owned());
        }
        if s.bodies.len() < 10_000 {
            s.bodies.push(request.clone());
            s.headers.push(header_pairs(headers));
        }
    }
    if !config.latency.is_zero() {
        tokio::time::sleep(config.latency).await;
    }
    (request, config, fault, guard)
}

fn header_pairs(headers: &HeaderMap) -> Vec<(String, String)> {
    headers
        .iter()
        .map(|(k, v)| {
            (
                k.as_str().to_owned(),
                String::from_utf8_lossy(v.as_bytes()).into_owned(),
            )
        })
        .collect()
}

fn error_response(status: u16, msg: &str) -> Response {
    let code = StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR);
    (
        code,
        [(header::CONTENT_TYPE, "application/json")],
        json!({"error": {"message": msg, "type": "loopback_error", "param": null, "code": null}})
            .to_string(),
    )
        .into_response()
}

/// The answer to a fault: `Err(response)` to send as is, `Ok(Some(text))` for
/// [`Fault::Content`], `Ok(None)` when there is no fault.
async fn apply_fault(
    fault: Option<Fault>,
    headers: &HeaderMap,
) -> Result<Option<String>, Response> {
    match fault {
        None => Ok(None),
        Some(Fault::Content(text)) => Ok(Some(text)),
        Some(Fault::RateLimited { retry_after }) => {
            let mut r = error_response(429, "rate limited, slow down");
            if let Some(s) = retry_after
                && let Ok(v) = header::HeaderValue::from_str(&format!("{s}"))
            {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            Err(r)
        }
        Some(Fault::RateLimitedRaw { retry_after }) => {
            let mut r = error_response(429, "rate limited, slow down");
            if let Ok(v) = header::HeaderValue::from_str(&retry_after) {
                r.headers_mut().insert(header::RETRY_AFTER, v);
            }
            Err(r)
        }
        Some(Fault::Status(code)) => Err(error_response(code, "injected failure")),
        Some(Fault::Hang) => {
            tokio::time::sleep(Duration::from_secs(3600)).await;
            Err(error_response(504, "hung"))
        }
        Some(Fault::Malformed) => Err((
            StatusCode::OK,
            [(header::CONTENT_TYPE, "application/json")],
            "{\"choices\": [ this is not json",
        )
            .into_response()),
        Some(Fault::EchoHeaders(code)) => {
            let code = StatusCode::from_u16(code).unwrap_or(StatusCode::BAD_REQUEST);
            let text = header_pairs(headers)
                .iter()
                .map(|(k, v)| format!("{k}: {v}"))
                .collect::<Vec<_>>()
                .join("; ");
            Err((code, text).into_response())
        }
    }
}

async fn chat(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let (request, config, fault, _guard) = admit(&shared, &headers, &body).await;
    if config.reject_response_format && request.get("response_format").is_some() {
        return error_response(400, "response_format is not supported by this server");
    }
    let content = match apply_fault(fault, &headers).await {
        Err(response) => return response,
        Ok(Some(text)) => text,
        Ok(None) => (config.reply)(&request),
    };
    if let Ok(mut s) = shared.stats.lock() {
        s.completions += 1;
    }
    let model = request["model"].as_str().unwrap_or("loopback").to_owned();
    let body = json!({
        "id": "chatcmpl-loopback",
        "object": "chat.completion",
        "created": 0,
        "model": model,
        "choices": [{
            "index": 0,
            "message": {"role": "assistant", "content": content},
            "finish_reason": "stop",
            "logprobs": null
        }],
        "usage": {"prompt_tokens": 10, "completion_tokens": 10, "total_tokens": 20}
    });
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body.to_string(),
    )
        .into_response()
}

async fn rewards(State(shared): State<Arc<Shared>>, headers: HeaderMap, body: Bytes) -> Response {
    let (request, config, fault, _guard) = admit(&shared, &headers, &body).await;
    let body = match apply_fault(fault, &headers).await {
        Err(response) => return response,
        Ok(Some(text)) => text,
        Ok(None) => (config.rewards)(&request).to_string(),
    };
    if let Ok(mut s) = shared.stats.lock() {
        s.completions += 1;
    }
    (
        StatusCode::OK,
        [(header::CONTENT_TYPE, "application/json")],
        body,
    )
        .into_response()
}
