//! A loopback Open Reward Standard (ORS) server: the HTTP protocol of the `openreward` SDK's
//! `Server` (sessions opened by a server-sent event stream, tools run as event streams that
//! resume by `task_id`, `X-Session-ID`, `X-Secrets`), holding four small environments. The same
//! environments, on the SDK's own server, are `scripts/ors_arith_server.py`:
//!
//! - `arith`: tasks `{a, b, level}`; tools `add` (x + y as text), `submit` (reward 1 when the
//!   answer is a + b, else 0; finishes the episode), `boom` (raises: an `error` event); its
//!   `score_group` gives 1 to a candidate whose last assistant text holds a + b, else 0.
//! - `arithfinal`: the same tasks; tool `add` and a hidden `@terminal` tool `answer` grading a
//!   plain answer (1 when its last integer is a + b).
//! - `chat`: `arithfinal` whose prompt is a conversation (`/messages`: a system message, a user
//!   message, an assistant turn with reasoning and a tool call, a user turn with its result).
//! - `draw`: `arithfinal` whose prompt starts with the session's draw number (how many `draw`
//!   sessions were opened before it, plus one): each session of a task a prompt of its own.
//!
//! `/messages` of the others is their prompt as one user message, as the SDK serves it.
//!
//! Binds `127.0.0.1:0`, runs on its own thread, stops when dropped. Counts sessions and calls,
//! and takes one-shot faults ([`OrsFault`]).

// A handler's early answer is a whole `Response` in `Err`: a test fixture, not a hot path.
#![allow(clippy::result_large_err)]

use std::collections::{BTreeMap, VecDeque};
use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use axum::Router;
use axum::body::{Body, Bytes};
use axum::extract::{Path, State};
use axum::http::{HeaderMap, StatusCode, header};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use base64::Engine as _;
use serde_json::{Value, json};

/// A one-shot fault, taken by the next request whose path ends with its route.
#[derive(Debug, Clone, PartialEq)]
pub enum OrsFault {
    /// Answer this status (with a JSON `detail`).
    Status(u16),
    /// An event stream that sends its `task_id`, runs the task, then breaks off before the
    /// result (the client must resume with the `task_id`).
    BreakAfterTaskId,
}

/// What the server saw.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct OrsStats {
    /// Sessions created (`/create`).
    pub created: usize,
    /// Sessions deleted (`/delete` of a live one).
    pub deleted: usize,
    /// Tools run, by name, in order (a resumed stream runs its tool once).
    pub calls: Vec<String>,
    /// `score_group` requests.
    pub group_scores: usize,
    /// The secrets of the sessions created (decoded `X-Secrets` values).
    pub secrets: Vec<BTreeMap<String, String>>,
    /// Resumed event streams.
    pub resumed: usize,
    /// Keep-alive pings of live sessions.
    pub pings: usize,
    /// `/messages` requests answered.
    pub messages: usize,
}

#[derive(Debug)]
struct Session {
    env: String,
    task: Value,
    secrets: BTreeMap<String, String>,
    /// `draw`: how many `draw` sessions were opened before this one, plus one.
    draw: u64,
    finished: bool,
    dead: bool,
}

#[derive(Debug, Default)]
struct Shared {
    sessions: Mutex<BTreeMap<String, Session>>,
    results: Mutex<BTreeMap<String, Result<String, String>>>,
    faults: Mutex<VecDeque<(String, OrsFault)>>,
    stats: Mutex<OrsStats>,
    next: Mutex<u64>,
    draws: Mutex<u64>,
}

impl Shared {
    fn id(&self, prefix: &str) -> String {
        let mut n = lock(&self.next);
        *n += 1;
        format!("{prefix}-{:04}", *n)
    }

    fn fault(&self, path: &str) -> Option<OrsFault> {
        let mut q = lock(&self.faults);
        let i = q
            .iter()
            .position(|(route, _)| path.ends_with(route.as_str()))?;
        q.remove(i).map(|(_, f)| f)
    }
}

/// The tasks of a split.
pub fn tasks(split: &str) -> Option<Vec<Value>> {
    match split {
        "train" => Some(
            (0..6)
                .map(|i| {
                    json!({ "a": 2 + i, "b": 3 * i + 1, "level": if i < 3 { "easy" } else { "hard" } })
                })
                .collect(),
        ),
        "test" => Some(vec![json!({ "a": 40, "b": 2, "level": "easy" })]),
        _ => None,
    }
}

fn add_schema() -> Value {
    json!({"properties": {"x": {"title": "X", "type": "integer"}, "y": {"title": "Y", "type": "integer"}},
           "required": ["x", "y"], "title": "AddInput", "type": "object"})
}

fn answer_schema() -> Value {
    json!({"properties": {"answer": {"title": "Answer", "type": "string"}},
           "required": ["answer"], "title": "Answer", "type": "object"})
}

fn tool_list(env: &str) -> Value {
    let add =
        json!({"name": "add", "description": "Adds two integers.", "input_schema": add_schema()});
    let blocks = json!(["text", "image", "reasoning", "tool_call", "tool_result"]);
    match env {
        "arith" => json!({
            "tools": [add,
                {"name": "boom", "description": "Always fails.", "input_schema": null},
                {"name": "submit", "description": "Submits the final answer.", "input_schema": answer_schema()}],
            "terminal_tool": null, "supports_score_group": true, "message_block_types": blocks}),
        _ => json!({
            "tools": [add],
            "terminal_tool": {"name": "answer", "arg": "answer", "description": "Grades the final answer."},
            "supports_score_group": false, "message_block_types": blocks}),
    }
}

fn detail(status: u16, text: &str) -> Response {
    (
        StatusCode::from_u16(status).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
        axum::Json(json!({ "detail": text })),
    )
        .into_response()
}

fn known(env: &str) -> Result<String, Response> {
    match env.to_lowercase().as_str() {
        e @ ("arith" | "arithfinal" | "chat" | "draw") => Ok(e.to_owned()),
        _ => Err(detail(404, &format!("unknown environment '{env}'"))),
    }
}

fn sid_of(h: &HeaderMap) -> Result<String, Response> {
    h.get("x-session-id")
        .and_then(|v| v.to_str().ok())
        .map(|s| s.trim().to_owned())
        .ok_or_else(|| detail(400, "X-Session-ID header is required"))
}

fn event(name: &str, data: &str) -> String {
    let mut out = format!("event: {name}\r\n");
    for line in data.split('\n') {
        out.push_str(&format!("data: {line}\r\n"));
    }
    out.push_str("\r\n");
    out
}

/// An event stream answering `outcome` (a JSON text or an error), started or resumed by
/// `task_id`; the result goes in 16-character chunks, with a keep-alive comment first.
fn stream(
    s: &Shared,
    path: &str,
    task_id: Option<&str>,
    run: impl FnOnce() -> Result<String, String>,
) -> Response {
    let id = match task_id {
        Some(id) => {
            lock(&s.stats).resumed += 1;
            id.to_owned()
        }
        None => {
            let id = s.id("task");
            let outcome = run();
            lock(&s.results).insert(id.clone(), outcome);
            id
        }
    };
    let Some(outcome) = lock(&s.results).get(&id).cloned() else {
        return sse_body(event("error", "unknown task_id"));
    };
    let mut text = String::from(": ping\r\n\r\n");
    text.push_str(&event("task_id", &id));
    if s.fault(path) == Some(OrsFault::BreakAfterTaskId) {
        // The head and the task id go out; a moment later the connection breaks.
        let parts = futures_util::stream::unfold(Some(text), |state| async move {
            match state {
                Some(text) => Some((Ok::<_, std::io::Error>(Bytes::from(text)), None)),
                None => {
                    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
                    Some((Err(std::io::Error::other("the stream breaks off")), None))
                }
            }
        });
        return (
            [(header::CONTENT_TYPE, "text/event-stream")],
            Body::from_stream(parts),
        )
            .into_response();
    }
    match outcome {
        Err(e) => text.push_str(&event("error", &e)),
        Ok(result) => {
            let chars: Vec<char> = result.chars().collect();
            let chunks: Vec<String> = chars.chunks(16).map(|c| c.iter().collect()).collect();
            for (i, c) in chunks.iter().enumerate() {
                let name = if i + 1 == chunks.len() {
                    "end"
                } else {
                    "chunk"
                };
                text.push_str(&event(name, c));
            }
            if chunks.is_empty() {
                text.push_str(&event("end", ""));
            }
        }
    }
    sse_body(text)
}

fn sse_body(text: String) -> Response {
    ([(header::CONTENT_TYPE, "text/event-stream")], text).into_response()
}

fn task_of(v: &Value) -> (i64, i64) {
    (
        v["a"].as_i64().unwrap_or_default(),
        v["b"].as_i64().unwrap_or_default(),
    )
}

fn text_output(text: &str, reward: Option<f64>, finished: bool) -> String {
    json!({"ok": true, "output": {"blocks": [{"text": text, "detail": null, "type": "text"}],
           "metadata": null, "reward": reward, "finished": finished}})
    .to_string()
}

fn refused(error: &str, reason: &str) -> String {
    json!({"ok": false, "error": error, "reason": reason}).to_string()
}

/// Runs tool `name` of a session.
fn run_tool(s: &Shared, sid: &str, name: &str, input: &Value) -> Result<String, String> {
    let mut sessions = lock(&s.sessions);
    let Some(session) = sessions.get_mut(sid) else {
        return Err("Active environment not found".into());
    };
    if session.dead {
        return Err("the session is dead".into());
    }
    if session.finished {
        return Ok(refused(
            &format!("the episode is finished; '{name}' was not run"),
            "episode_finished",
        ));
    }
    let tools: &[&str] = match session.env.as_str() {
        "arith" => &["add", "submit", "boom"],
        _ => &["add", "answer"],
    };
    if !tools.contains(&name) {
        return Ok(refused(
            &format!("'{name}' is not a valid tool"),
            "not_found",
        ));
    }
    lock(&s.stats).calls.push(name.to_owned());
    let (a, b) = task_of(&session.task);
    let answer = || input.get("answer").and_then(Value::as_str).map(str::trim);
    let graded = |session: &mut Session| {
        session.finished = true;
        answer() == Some((a + b).to_string().as_str())
    };
    Ok(match (session.env.as_str(), name) {
        (_, "add") => match (
            input.get("x").and_then(Value::as_i64),
            input.get("y").and_then(Value::as_i64),
        ) {
            (Some(x), Some(y)) => text_output(&(x + y).to_string(), None, false),
            _ => refused(
                "Tool input validation error: x and y must be integers",
                "input_validation",
            ),
        },
        ("arith", "submit") if answer().is_some() => {
            let right = graded(session);
            text_output(
                if right { "correct" } else { "wrong" },
                Some(if right { 1.0 } else { 0.0 }),
                true,
            )
        }
        ("arith", "boom") => {
            session.dead = true;
            return Err("boom".into());
        }
        ("arithfinal" | "chat" | "draw", "answer") if answer().is_some() => {
            session.finished = true;
            let last = answer().and_then(|t| {
                t.split(|c: char| !(c.is_ascii_digit() || c == '-'))
                    .rfind(|w| w.parse::<i64>().is_ok())
                    .map(str::to_owned)
            });
            let right = last == Some((a + b).to_string());
            text_output("graded", Some(if right { 1.0 } else { 0.0 }), true)
        }
        ("arith", "submit") | ("arithfinal" | "chat" | "draw", "answer") => refused(
            "Tool input validation error: answer is required",
            "input_validation",
        ),
        _ => refused(&format!("'{name}' is not a valid tool"), "not_found"),
    })
}

type St = State<Arc<Shared>>;

/// A lock, through a panicked holder (a test that failed must not hang the others).
fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(std::sync::PoisonError::into_inner)
}

async fn list_environments() -> Response {
    axum::Json(json!(["arith", "arithfinal", "chat", "draw"])).into_response()
}

/// A text block.
fn text(t: &str) -> Value {
    json!({ "text": t, "detail": null, "type": "text" })
}

/// The conversation of a session's task, as `/messages` serves it.
fn conversation(env: &str, session: &Session) -> Value {
    let (a, b) = task_of(&session.task);
    match env {
        "chat" => json!([
            {"role": "system", "blocks": [text("You add numbers.")], "detail": null},
            {"role": "user", "blocks": [text(&format!("a = {a}, b = {b}."))], "detail": null},
            {"role": "assistant", "blocks": [
                {"type": "reasoning", "text": "easy", "signature": null, "detail": null},
                text("Let me add."),
                {"type": "tool_call", "id": "c1", "name": "add", "input": {"x": a, "y": b}, "detail": null}
            ], "detail": null},
            {"role": "user", "blocks": [
                {"type": "tool_result", "tool_call_id": "c1", "blocks": [text(&(a + b).to_string())], "is_error": false, "detail": null},
                text("What is a + b?")
            ], "detail": null}
        ]),
        _ => {
            json!([{ "role": "user", "blocks": [text(&prompt_text(env, session))], "detail": null }])
        }
    }
}

/// The `/prompt` text of a session's task.
fn prompt_text(env: &str, session: &Session) -> String {
    let (a, b) = task_of(&session.task);
    let mut text = match env {
        "arith" => {
            format!("What is {a} + {b}? Use the `add` tool, then give the result to `submit`.")
        }
        "chat" => format!("[system] You add numbers. [user] a = {a}, b = {b}. What is a + b?"),
        "draw" => format!(
            "Draw {}: what is {a} + {b}? Answer with the number.",
            session.draw
        ),
        _ => format!("What is {a} + {b}? Answer with the number."),
    };
    if let Some(t) = session.secrets.get("token") {
        text.push_str(&format!(" (token {t})"));
    }
    text
}

async fn messages(
    State(s): St,
    uri: axum::http::Uri,
    Path(env): Path<String>,
    h: HeaderMap,
) -> Response {
    if let Some(OrsFault::Status(c)) = s.fault(uri.path()) {
        return detail(c, "Not Found");
    }
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    let sessions = lock(&s.sessions);
    let Some(session) = sessions.get(&sid) else {
        return detail(404, "Active environment not found");
    };
    lock(&s.stats).messages += 1;
    let env = known(&env).unwrap_or_default();
    axum::Json(conversation(&env, session)).into_response()
}

async fn tools(Path(env): Path<String>) -> Response {
    match known(&env) {
        Ok(e) => axum::Json(tool_list(&e)).into_response(),
        Err(r) => r,
    }
}

async fn task_tools(State(s): St, Path(env): Path<String>, h: HeaderMap) -> Response {
    let (env, sid) = match (known(&env), sid_of(&h)) {
        (Ok(e), Ok(sid)) => (e, sid),
        (Err(r), _) | (_, Err(r)) => return r,
    };
    if !lock(&s.sessions).contains_key(&sid) {
        return detail(404, "Active environment not found");
    }
    axum::Json(tool_list(&env)).into_response()
}

fn split_tasks(body: &Value) -> Result<Vec<Value>, Response> {
    body.get("split")
        .and_then(Value::as_str)
        .and_then(tasks)
        .ok_or_else(|| detail(400, "Invalid split"))
}

async fn num_tasks(Path(env): Path<String>, axum::Json(body): axum::Json<Value>) -> Response {
    if let Err(r) = known(&env) {
        return r;
    }
    match split_tasks(&body) {
        Ok(t) => axum::Json(json!({ "num_tasks": t.len() })).into_response(),
        Err(r) => r,
    }
}

async fn task(Path(env): Path<String>, axum::Json(body): axum::Json<Value>) -> Response {
    let env = match known(&env) {
        Ok(e) => e,
        Err(r) => return r,
    };
    let t = match split_tasks(&body) {
        Ok(t) => t,
        Err(r) => return r,
    };
    match body["index"].as_u64().and_then(|i| t.get(i as usize)) {
        Some(task) => axum::Json(json!({ "task": task, "env_name": env })).into_response(),
        None => detail(400, "Invalid index"),
    }
}

async fn task_range(Path(env): Path<String>, axum::Json(body): axum::Json<Value>) -> Response {
    let env = match known(&env) {
        Ok(e) => e,
        Err(r) => return r,
    };
    let t = match split_tasks(&body) {
        Ok(t) => t,
        Err(r) => return r,
    };
    let start = body["start"].as_u64().unwrap_or(0) as usize;
    let stop = body["stop"]
        .as_u64()
        .map_or(t.len(), |s| s as usize)
        .min(t.len());
    let tasks: Vec<Value> = t.get(start..stop.max(start)).unwrap_or(&[]).to_vec();
    axum::Json(json!({ "tasks": tasks, "env_name": env })).into_response()
}

async fn create_session(State(s): St, uri: axum::http::Uri) -> Response {
    if let Some(OrsFault::Status(c)) = s.fault(uri.path()) {
        return detail(c, "injected fault");
    }
    let sid = s.id("session");
    sse_body(event("task_id", &sid) + &event("end", ""))
}

async fn create(State(s): St, h: HeaderMap, axum::Json(body): axum::Json<Value>) -> Response {
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    if lock(&s.sessions).contains_key(&sid) {
        return detail(400, "Session already exists");
    }
    let env = match known(body["env_name"].as_str().unwrap_or("arith")) {
        Ok(e) => e,
        Err(r) => return r,
    };
    let task = match body.get("task_spec").filter(|v| !v.is_null()) {
        Some(spec) => spec.clone(),
        None => {
            let t = match split_tasks(&body) {
                Ok(t) => t,
                Err(r) => return r,
            };
            match body["index"].as_u64().and_then(|i| t.get(i as usize)) {
                Some(task) => task.clone(),
                None => return detail(400, "Invalid index"),
            }
        }
    };
    let secrets: BTreeMap<String, String> = h
        .get("x-secrets")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| base64::engine::general_purpose::STANDARD.decode(v).ok())
        .and_then(|b| serde_json::from_slice::<Value>(&b).ok())
        .and_then(|v| v.as_object().cloned())
        .map(|o| {
            o.into_iter()
                .map(|(k, v)| (k, v["value"].as_str().unwrap_or_default().to_owned()))
                .collect()
        })
        .unwrap_or_default();
    {
        let mut st = lock(&s.stats);
        st.created += 1;
        st.secrets.push(secrets.clone());
    }
    let draw = {
        let mut d = lock(&s.draws);
        *d += u64::from(env == "draw");
        *d
    };
    lock(&s.sessions).insert(
        sid.clone(),
        Session {
            env,
            task,
            secrets,
            draw,
            finished: false,
            dead: false,
        },
    );
    axum::Json(json!({ "sid": sid })).into_response()
}

async fn prompt(State(s): St, Path(env): Path<String>, h: HeaderMap) -> Response {
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    let sessions = lock(&s.sessions);
    let Some(session) = sessions.get(&sid) else {
        return detail(404, "Active environment not found");
    };
    let env = known(&env).unwrap_or_default();
    axum::Json(json!([text(&prompt_text(&env, session))])).into_response()
}

async fn call(
    State(s): St,
    uri: axum::http::Uri,
    h: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> Response {
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    if !lock(&s.sessions).contains_key(&sid) {
        return detail(404, "Active environment not found");
    }
    let name = body["name"].as_str().unwrap_or_default().to_owned();
    let input = body.get("input").cloned().unwrap_or(json!({}));
    let shared = s.clone();
    stream(&s, uri.path(), body["task_id"].as_str(), move || {
        run_tool(&shared, &sid, &name, &input)
    })
}

async fn score_group(
    State(s): St,
    uri: axum::http::Uri,
    Path(env): Path<String>,
    h: HeaderMap,
    axum::Json(body): axum::Json<Value>,
) -> Response {
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    let task = match lock(&s.sessions).get(&sid) {
        Some(session) => session.task.clone(),
        None => return detail(404, "Active environment not found"),
    };
    if known(&env).ok().as_deref() != Some("arith") {
        return detail(
            404,
            &format!("Environment '{env}' does not implement score_group"),
        );
    }
    lock(&s.stats).group_scores += 1;
    let (a, b) = task_of(&task);
    let want = (a + b).to_string();
    let scores: Vec<Value> = body["candidates"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|c| {
            let last = c["messages"]
                .as_array()
                .into_iter()
                .flatten()
                .filter(|m| m["role"] == "assistant")
                .filter_map(|m| m["blocks"].as_array())
                .filter_map(|b| b.iter().rev().find_map(|b| b["text"].as_str()))
                .next_back();
            let r = if last.is_some_and(|t| t.contains(&want)) {
                1.0
            } else {
                0.0
            };
            json!({ "reward": r, "metadata": null })
        })
        .collect();
    let result = json!({ "scores": scores }).to_string();
    stream(&s, uri.path(), body["task_id"].as_str(), move || Ok(result))
}

async fn delete(State(s): St, h: HeaderMap) -> Response {
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    if lock(&s.sessions).remove(&sid).is_some() {
        lock(&s.stats).deleted += 1;
    }
    axum::Json(json!({ "sid": sid })).into_response()
}

async fn ping(State(s): St, h: HeaderMap) -> Response {
    let sid = match sid_of(&h) {
        Ok(sid) => sid,
        Err(r) => return r,
    };
    if !lock(&s.sessions).contains_key(&sid) {
        return detail(404, "Active environment not found");
    }
    lock(&s.stats).pings += 1;
    axum::Json(json!({ "status": "ok" })).into_response()
}

async fn delete_session(h: HeaderMap) -> Response {
    match sid_of(&h) {
        Ok(sid) => axum::Json(json!({ "sid": sid })).into_response(),
        Err(r) => r,
    }
}

/// The server (see the [module docs](self)).
pub struct OrsServer {
    addr: SocketAddr,
    shared: Arc<Shared>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    thread: Option<std::thread::JoinHandle<()>>,
}

impl std::fmt::Debug for OrsServer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("OrsServer")
            .field("addr", &self.addr)
            .finish()
    }
}

impl OrsServer {
    /// Starts a server on `127.0.0.1:0`.
    pub fn start() -> std::io::Result<Self> {
        let shared = Arc::new(Shared::default());
        let std_listener = std::net::TcpListener::bind("127.0.0.1:0")?;
        std_listener.set_nonblocking(true)?;
        let addr = std_listener.local_addr()?;
        let (stop_tx, stop_rx) = tokio::sync::oneshot::channel::<()>();
        let state = shared.clone();
        let thread = std::thread::Builder::new()
            .name("loopback-ors".into())
            .spawn(move || {
                let Ok(rt) = tokio::runtime::Builder::new_current_thread()
                    .enable_all()
                    .build()
                else {
                    return;
                };
                rt.block_on(async move {
                    let Ok(listener) = tokio::net::TcpListener::from_std(std_listener) else {
                        return;
                    };
                    let app = Router::new()
                        .route("/list_environments", get(list_environments))
                        .route("/create_session", post(create_session))
                        .route("/create", post(create))
                        .route("/delete", post(delete))
                        .route("/delete_session", post(delete_session))
                        .route("/ping", post(ping))
                        .route("/{env}/tools", get(tools))
                        .route("/{env}/task_tools", get(task_tools))
                        .route("/{env}/num_tasks", post(num_tasks))
                        .route("/{env}/task", post(task))
                        .route("/{env}/task_range", post(task_range))
                        .route("/{env}/prompt", get(prompt))
                        .route("/{env}/messages", get(messages))
                        .route("/{env}/call", post(call))
                        .route("/{env}/score_group", post(score_group))
                        .with_state(state);
                    tokio::select! {
                        _ = axum::serve(listener, app).into_future() => {}
                        _ = stop_rx => {}
                    }
                });
            })?;
        Ok(Self {
            addr,
            shared,
            stop: Some(stop_tx),
            thread: Some(thread),
        })
    }

    /// `http://127.0.0.1:PORT`.
    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// A copy of the statistics.
    pub fn stats(&self) -> OrsStats {
        lock(&self.shared.stats).clone()
    }

    /// Sessions alive now.
    pub fn live_sessions(&self) -> usize {
        lock(&self.shared.sessions).len()
    }

    /// Queues a one-shot fault for the next request whose path ends with `route`.
    pub fn push_fault(&self, route: &str, fault: OrsFault) {
        lock(&self.shared.faults).push_back((route.to_owned(), fault));
    }
}

impl Drop for OrsServer {
    fn drop(&mut self) {
        if let Some(s) = self.stop.take() {
            let _ = s.send(());
        }
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}
