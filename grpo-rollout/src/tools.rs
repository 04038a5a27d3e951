//! Tools: the model calls them in its chat template's format and a [`ToolEnvironment`] runs
//! them between its turns.
//!
//! **The format** is the Hermes / Qwen convention that Qwen2.5's, Hermes' and most tool-using
//! chat templates define: the tools' JSON schemas go into the system prompt through the
//! template's `tools` variable (as transformers' `apply_chat_template(messages, tools=...)`
//! renders them), and the model calls one by writing
//! `<tool_call>{"name": "calculator", "arguments": {"expression": "12*7"}}</tool_call>` in its
//! turn ([`parse_tool_calls`]). The answer comes back as a `tool` message, which those
//! templates render as `<tool_response>...</tool_response>`.
//!
//! **An episode** with a [`ToolEnvironment`]: each model turn that calls tools gets one `tool`
//! message holding every call's result (one line per call, in order); a turn without a call
//! is the model's answer and ends the episode (terminated). A malformed call (not JSON, no
//! `name`, an unknown tool, arguments that are not an object) and a call that fails (an
//! exception, a non-zero exit, a timeout) are answered `error: ...`, which the model sees:
//! nothing crashes. The environment's turn rewards are 0; the run's reward functions score
//! the transcript. `post_process` reports `tool_calls_mean` and `tool_errors_mean` per
//! episode (the trainer logs them as `env/tool_calls_mean`, `env/tool_errors_mean`), and TRL's
//! `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls
//! per call).
//!
//! **Tools** implement [`Tool`]: a Rust closure ([`FnTool`]), and with the cargo feature
//! `rewards` a program (`CommandTool`: the arguments as JSON on stdin, each also a `{name}`
//! placeholder of `argv`; stdout is the answer) or a Python function (`PythonTool`, in
//! grpo-rewards' shared Python worker; its schema from its signature and docstring as
//! transformers' `get_json_schema`), both with per-call timeouts, built from `ToolConfig`.

use std::collections::BTreeMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{Result, bail};
use serde_json::{Value, json};

use crate::env::{Environment, EnvironmentReturn};
use crate::episode::Episode;
use crate::tokenizer::{ChatMessage, ToolCall};

/// Where a call starts in the model's text.
pub const CALL_OPEN: &str = "<tool_call>";
/// Where it ends.
pub const CALL_CLOSE: &str = "</tool_call>";
/// How an answer that is an error starts.
pub const ERROR_PREFIX: &str = "error: ";

/// Every tool call in `text`, in order: each `<tool_call>...</tool_call>` (an unclosed last
/// one runs to the end of the text) parsed as `{"name": ..., "arguments": {...}}` (arguments
/// given as a JSON string holding an object are accepted too; absent = `{}`). A call that
/// does not parse is an `Err` with the reason, one line.
pub fn parse_tool_calls(text: &str) -> Vec<std::result::Result<ToolCall, String>> {
    let mut out = Vec::new();
    let mut rest = text;
    while let Some(start) = rest.find(CALL_OPEN) {
        let after = &rest[start + CALL_OPEN.len()..];
        let (body, next) = match after.find(CALL_CLOSE) {
            Some(end) => (&after[..end], &after[end + CALL_CLOSE.len()..]),
            None => (after, ""),
        };
        out.push(parse_call(body.trim()));
        rest = next;
    }
    out
}

fn parse_call(body: &str) -> std::result::Result<ToolCall, String> {
    let shown: String = body.chars().take(40).collect();
    let v: Value = serde_json::from_str(body)
        .map_err(|e| format!("the tool call is not JSON ({e}): {shown}"))?;
    let Value::Object(mut m) = v else {
        return Err(format!(
            "the tool call must be a JSON object {{\"name\": ..., \"arguments\": {{...}}}}: {shown}"
        ));
    };
    let name = match m.remove("name") {
        Some(Value::String(s)) if !s.trim().is_empty() => s.trim().to_owned(),
        _ => return Err(format!("the tool call has no \"name\": {shown}")),
    };
    let arguments = match m.remove("arguments").or_else(|| m.remove("parameters")) {
        None | Some(Value::Null) => json!({}),
        Some(Value::Object(a)) => Value::Object(a),
        Some(Value::String(s)) => match serde_json::from_str::<Value>(&s) {
            Ok(v @ Value::Object(_)) => v,
            _ => {
                return Err(format!(
                    "the arguments of `{name}` must be a JSON object: {s}"
                ));
            }
        },
        Some(other) => {
            return Err(format!(
                "the arguments of `{name}` must be a JSON object, not {other}"
            ));
        }
    };
    Ok(ToolCall::new(name, arguments))
}

/// A tool the model may call.
pub trait Tool: Send + Sync {
    /// Its name (what the model writes in a call).
    fn name(&self) -> &str;

    /// Its JSON schema as chat templates render it: `{"type": "function", "function":
    /// {"name", "description", "parameters": {"type": "object", "properties": {...},
    /// "required": [...]}}}` (transformers' `get_json_schema`).
    fn schema(&self) -> Value;

    /// Runs one call. `Err` is a failure the model is shown (as `error: {message}`).
    fn call(&self, arguments: &Value) -> std::result::Result<String, String>;
}

/// The schema of a tool named `name`: `parameters` is the JSON schema of its arguments.
pub fn function_schema(name: &str, description: &str, parameters: Value) -> Value {
    json!({
        "type": "function",
        "function": { "name": name, "description": description, "parameters": parameters },
    })
}

/// A tool written in Rust: a closure over the call's arguments.
pub struct FnTool<F> {
    name: String,
    schema: Value,
    f: F,
}

impl<F> std::fmt::Debug for FnTool<F> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("FnTool")
            .field("name", &self.name)
            .finish_non_exhaustive()
    }
}

impl<F> FnTool<F>
where
    F: Fn(&Value) -> std::result::Result<String, String> + Send + Sync,
{
    /// A tool `name` described by `description` and the JSON schema of its `parameters`.
    pub fn new(name: &str, description: &str, parameters: Value, f: F) -> Self {
        Self {
            name: name.to_owned(),
            schema: function_schema(name, description, parameters),
            f,
        }
    }
}

impl<F> Tool for FnTool<F>
where
    F: Fn(&Value) -> std::result::Result<String, String> + Send + Sync,
{
    fn name(&self) -> &str {
        &self.name
    }

    fn schema(&self) -> Value {
        self.schema.clone()
    }

    fn call(&self, arguments: &Value) -> std::result::Result<String, String> {
        (self.f)(arguments)
    }
}

/// Runs the tools a model calls: see the [module docs](self).
pub struct ToolEnvironment {
    name: String,
    tools: Vec<Arc<dyn Tool>>,
    max_calls_per_turn: usize,
    max_concurrent: usize,
}

impl std::fmt::Debug for ToolEnvironment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ToolEnvironment")
            .field("name", &self.name)
            .field("tools", &self.tool_names())
            .field("max_calls_per_turn", &self.max_calls_per_turn)
            .finish_non_exhaustive()
    }
}

impl ToolEnvironment {
    /// An environment named `tools` offering `tools` (at least one; names unique), at most 8
    /// calls run per turn and as many calls at once as the machine has cores.
    pub fn new(tools: Vec<Arc<dyn Tool>>) -> Result<Self> {
        if tools.is_empty() {
            bail!("a tool environment needs at least one tool");
        }
        let mut seen = std::collections::BTreeSet::new();
        for t in &tools {
            if t.name().trim().is_empty() {
                bail!("a tool has an empty name");
            }
            if !seen.insert(t.name().to_owned()) {
                bail!(
                    "two tools are named `{}`: tool names must be unique",
                    t.name()
                );
            }
        }
        Ok(Self {
            name: "tools".into(),
            tools,
            max_calls_per_turn: 8,
            max_concurrent: std::thread::available_parallelism().map_or(2, |n| n.get()),
        })
    }

    /// Calls past this many in one turn are answered with an error instead of run (≥ 1).
    pub fn with_max_calls_per_turn(mut self, n: usize) -> Self {
        self.max_calls_per_turn = n.max(1);
        self
    }

    /// Calls run at once over the batch (≥ 1).
    pub fn with_max_concurrent(mut self, n: usize) -> Self {
        self.max_concurrent = n.max(1);
        self
    }

    /// Renames the environment (errors and metrics name it).
    pub fn named(mut self, name: impl Into<String>) -> Self {
        self.name = name.into();
        self
    }

    /// The tools' names, in order.
    pub fn tool_names(&self) -> Vec<&str> {
        self.tools.iter().map(|t| t.name()).collect()
    }

    /// The answer to one parsed call.
    fn answer(&self, call: &std::result::Result<ToolCall, String>) -> String {
        let call = match call {
            Ok(c) => c,
            Err(e) => return format!("{ERROR_PREFIX}{e}"),
        };
        let Some(tool) = self.tools.iter().find(|t| t.name() == call.function.name) else {
            return format!(
                "{ERROR_PREFIX}unknown tool `{}`; the tools are: {}",
                call.function.name,
                self.tool_names().join(", ")
            );
        };
        match tool.call(&call.function.arguments) {
            Ok(text) => text,
            Err(e) => format!("{ERROR_PREFIX}{e}"),
        }
    }
}

impl Environment for ToolEnvironment {
    fn name(&self) -> &str {
        &self.name
    }

    fn tools(&self) -> Vec<Value> {
        self.tools.iter().map(|t| t.schema()).collect()
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let n = logs.len();
        let mut ret = EnvironmentReturn::empty(n);
        ret.metadata = metadata.iter().map(|m| (*m).clone()).collect();
        // Every call of every episode, then run them all (bounded concurrency).
        let mut jobs: Vec<(usize, std::result::Result<ToolCall, String>)> = Vec::new();
        for (i, log) in logs.iter().enumerate() {
            let text = log.last().map_or("", |m| m.content.as_str());
            let calls = parse_tool_calls(text);
            if calls.is_empty() {
                ret.terminateds[i] = true;
                continue;
            }
            let max = self.max_calls_per_turn;
            for (k, c) in calls.into_iter().enumerate() {
                let c = if k < max {
                    c
                } else {
                    Err(format!(
                        "more than {max} tool calls in one turn; this one was not run"
                    ))
                };
                jobs.push((i, c));
            }
        }
        let answers = run_all(&jobs, self.max_concurrent, |(_, c)| self.answer(c));
        let mut per_episode: BTreeMap<usize, Vec<(Option<&str>, String)>> = BTreeMap::new();
        for ((i, c), a) in jobs.iter().zip(answers) {
            let name = c.as_ref().ok().map(|c| c.function.name.as_str());
            per_episode.entry(*i).or_default().push((name, a));
        }
        for (i, answers) in per_episode {
            let content = answers
                .iter()
                .map(|(_, a)| a.as_str())
                .collect::<Vec<_>>()
                .join("\n");
            let mut msg = ChatMessage::new("tool", content);
            if let [(Some(name), _)] = answers.as_slice() {
                msg.name = Some((*name).to_owned());
            }
            ret.observations[i] = Some(msg);
        }
        Ok(ret)
    }

    fn post_process(&self, episodes: &mut [Episode]) -> Result<BTreeMap<String, f64>> {
        Ok(tool_metrics(episodes))
    }
}

/// The tool-use metrics of finished episodes: `tool_calls_mean` and `tool_errors_mean` per
/// episode (calls in assistant turns, `error: ` lines in tool messages), and TRL's
/// `tools/call_frequency` (calls per completion) and `tools/failure_frequency` (failed calls
/// per call).
pub fn tool_metrics(episodes: &[Episode]) -> BTreeMap<String, f64> {
    let n = episodes.len().max(1) as f64;
    let (mut calls, mut errors) = (0usize, 0usize);
    for e in episodes.iter() {
        for m in &e.messages {
            match m.role.as_str() {
                "assistant" => calls += parse_tool_calls(&m.content).len(),
                "tool" => {
                    errors += m
                        .content
                        .lines()
                        .filter(|l| l.starts_with(ERROR_PREFIX))
                        .count();
                }
                _ => {}
            }
        }
    }
    BTreeMap::from([
        ("tool_calls_mean".to_owned(), calls as f64 / n),
        ("tool_errors_mean".to_owned(), errors as f64 / n),
        // TRL's names (logged as they are): calls per completion, failures per call.
        ("tools/call_frequency".to_owned(), calls as f64 / n),
        (
            "tools/failure_frequency".to_owned(),
            if calls == 0 {
                0.0
            } else {
                errors as f64 / calls as f64
            },
        ),
    ])
}

/// `f` over `jobs` on at most `threads` threads, answers in order.
fn run_all<J: Sync, F: Fn(&J) -> String + Sync>(jobs: &[J], threads: usize, f: F) -> Vec<String> {
    let threads = threads.min(jobs.len());
    if threads <= 1 {
        return jobs.iter().map(&f).collect();
    }
    let next = AtomicUsize::new(0);
    let mut out: Vec<Option<String>> = vec![None; jobs.len()];
    std::thread::scope(|s| {
        let handles: Vec<_> = (0..threads)
            .map(|_| {
                s.spawn(|| {
                    let mut done = Vec::new();
                    loop {
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= jobs.len() {
                            break;
                        }
                        done.push((i, f(&jobs[i])));
                    }
                    done
                })
            })
            .collect();
        for h in handles {
            match h.join() {
                Ok(done) => {
                    for (i, a) in done {
                        out[i] = Some(a);
                    }
                }
                Err(panic) => std::panic::resume_unwind(panic),
            }
        }
    });
    out.into_iter().map(Option::unwrap_or_default).collect()
}

#[cfg(feature = "rewards")]
pub use self::configured::{CommandTool, PythonTool, ToolConfig};

#[cfg(feature = "rewards")]
mod configured {
    use std::collections::BTreeMap;

    use candle_core::Result;
    use grpo_rewards::command::{CommandConfig, CommandReward, CommandScore};
    use grpo_rewards::python::{PythonConfig, PythonKind, PythonObject, PythonWorkers};
    use grpo_rewards::{FieldValue, RewardInput};
    use serde::{Deserialize, Serialize};
    use serde_json::{Value, json};

    use super::{Tool, function_schema};

    /// A tool from the config (`[[environment.tools]]`), by `type`.
    ///
    /// ```toml
    /// [[environment.tools]]
    /// type = "command"
    /// name = "calculator"
    /// description = "Evaluates an arithmetic expression."
    /// parameters = { type = "object", properties = { expression = { type = "string" } }, required = ["expression"] }
    /// argv = ["python3", "calculator.py"]   # the arguments as JSON on stdin
    /// timeout = 5
    ///
    /// [[environment.tools]]
    /// type = "python"
    /// path = "tools.py"
    /// function = "lookup"                   # schema from its signature and docstring
    /// ```
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(tag = "type", rename_all = "lowercase")]
    pub enum ToolConfig {
        /// A program ([`CommandTool`]).
        Command(CommandToolConfig),
        /// A Python function ([`PythonTool`]).
        Python(PythonToolConfig),
    }

    /// `type = "command"`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct CommandToolConfig {
        /// The tool's name.
        pub name: String,
        /// What it does (shown to the model in the tools' schemas).
        #[serde(default)]
        pub description: String,
        /// JSON schema of its arguments (default: an object with no properties).
        #[serde(default = "no_parameters")]
        pub parameters: Value,
        /// The program and its arguments, no shell; `{name}` placeholders take the call's
        /// argument `name` (a string as it is, anything else as JSON).
        pub argv: Vec<String>,
        /// Seconds a call may run before it is killed (its answer then an error). Default 10.
        #[serde(default = "default_timeout")]
        pub timeout: f64,
        /// Address space a call may use, in MiB (unix).
        #[serde(default)]
        pub max_memory_mb: Option<u64>,
        /// Extra environment variables of the program.
        #[serde(default)]
        pub env: BTreeMap<String, String>,
    }

    /// `type = "python"`.
    #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
    #[serde(deny_unknown_fields)]
    pub struct PythonToolConfig {
        /// A `.py` file or a module name.
        pub path: String,
        /// The function (called with the call's arguments as keyword arguments; an `async def`
        /// is awaited).
        pub function: String,
        /// The tool's name; default the function's.
        #[serde(default)]
        pub name: Option<String>,
        /// Replaces the description taken from the docstring.
        #[serde(default)]
        pub description: Option<String>,
        /// The interpreter. Default `python3`.
        #[serde(default = "default_python")]
        pub python: String,
        /// Seconds a call may take. Default 10.
        #[serde(default = "default_timeout")]
        pub timeout: f64,
    }

    fn no_parameters() -> Value {
        json!({"type": "object", "properties": {}})
    }

    fn default_timeout() -> f64 {
        10.0
    }

    fn default_python() -> String {
        "python3".into()
    }

    impl ToolConfig {
        /// The tool's name as configured (a Python tool without `name`: its function's).
        pub fn name(&self) -> &str {
            match self {
                Self::Command(c) => &c.name,
                Self::Python(p) => p.name.as_deref().unwrap_or(&p.function),
            }
        }

        /// Builds the tool (a Python tool loads its function in `workers`' worker). Errors
        /// name the field to fix.
        pub fn build(&self, workers: &PythonWorkers) -> Result<Box<dyn Tool>> {
            let fail = |field: &str, e: &dyn std::fmt::Display| {
                candle_core::Error::msg(format!("tool `{}`: {field}: {e}", self.name()))
            };
            Ok(match self {
                Self::Command(c) => Box::new(CommandTool::new(c).map_err(|e| fail("argv", &e))?),
                Self::Python(p) => {
                    Box::new(PythonTool::new(p, workers).map_err(|e| fail("python", &e))?)
                }
            })
        }
    }

    /// A program as a tool: see the [module docs](super).
    #[derive(Debug)]
    pub struct CommandTool {
        name: String,
        schema: Value,
        command: CommandReward,
    }

    impl CommandTool {
        /// Resolves the program and checks the config.
        pub fn new(c: &CommandToolConfig) -> grpo_rewards::Result<Self> {
            if !c.parameters.is_object() {
                return Err(grpo_rewards::RewardError::config(
                    "parameters",
                    "must be a JSON schema object, e.g. { type = \"object\", properties = {...} }",
                ));
            }
            let command = CommandReward::new(
                CommandConfig {
                    argv: c.argv.clone(),
                    stdin: true,
                    score: CommandScore::Stdout,
                    timeout: c.timeout,
                    max_concurrent: 64,
                    max_memory_mb: c.max_memory_mb,
                    env: c.env.clone(),
                    ..CommandConfig::default()
                },
                c.name.clone(),
            )?;
            Ok(Self {
                name: c.name.clone(),
                schema: function_schema(&c.name, &c.description, c.parameters.clone()),
                command,
            })
        }
    }

    impl Tool for CommandTool {
        fn name(&self) -> &str {
            &self.name
        }

        fn schema(&self) -> Value {
            self.schema.clone()
        }

        fn call(&self, arguments: &Value) -> std::result::Result<String, String> {
            let mut input = RewardInput::new("", arguments.to_string());
            if let Value::Object(m) = arguments {
                for (k, v) in m {
                    let text = match v {
                        Value::String(s) => s.clone(),
                        other => other.to_string(),
                    };
                    input.fields.insert(k.clone(), FieldValue::Str(text));
                }
            }
            let out = self.command.output(&input).map_err(|e| e.to_string())?;
            let last_err = || {
                out.stderr
                    .lines()
                    .rev()
                    .find(|l| !l.trim().is_empty())
                    .unwrap_or("")
                    .trim()
                    .to_owned()
            };
            match out.status {
                "ok" => Ok(out.stdout.trim_end().to_owned()),
                "timeout" => Err(format!(
                    "`{}` did not finish within its timeout and was stopped",
                    self.name
                )),
                "exit_code" => Err(format!(
                    "`{}` exited with status {}{}",
                    self.name,
                    out.exit_code.unwrap_or(-1),
                    match last_err() {
                        e if e.is_empty() => String::new(),
                        e => format!(": {e}"),
                    }
                )),
                other => Err(format!("`{}` failed ({other}) {}", self.name, last_err())),
            }
        }
    }

    /// A Python function as a tool: see the [module docs](super).
    #[derive(Debug)]
    pub struct PythonTool {
        name: String,
        schema: Value,
        object: PythonObject,
    }

    impl PythonTool {
        /// Loads the function in `workers`' worker and takes its schema.
        pub fn new(c: &PythonToolConfig, workers: &PythonWorkers) -> grpo_rewards::Result<Self> {
            let object = PythonObject::load(
                &PythonConfig {
                    path: c.path.clone(),
                    function: c.function.clone(),
                    python: c.python.clone(),
                    timeout: c.timeout,
                    init: None,
                    signature: Default::default(),
                },
                PythonKind::Tool,
                workers,
            )?;
            let mut schema = object.loaded().clone();
            let name = c.name.clone().unwrap_or_else(|| c.function.clone());
            if let Some(f) = schema.get_mut("function").and_then(Value::as_object_mut) {
                f.insert("name".into(), name.clone().into());
                if let Some(d) = &c.description {
                    f.insert("description".into(), d.clone().into());
                }
            } else {
                return Err(grpo_rewards::RewardError::config(
                    "function",
                    format!("{}: the worker gave no schema for it", object.describe()),
                ));
            }
            Ok(Self {
                name,
                schema,
                object,
            })
        }
    }

    impl Tool for PythonTool {
        fn name(&self) -> &str {
            &self.name
        }

        fn schema(&self) -> Value {
            self.schema.clone()
        }

        fn call(&self, arguments: &Value) -> std::result::Result<String, String> {
            let result = self
                .object
                .request("tool", json!({ "arguments": arguments }))
                .map_err(|e| format!("`{}` {e}", self.name))?;
            Ok(match result {
                Value::String(s) => s,
                other => other.to_string(),
            })
        }
    }
}
