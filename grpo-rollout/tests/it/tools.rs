//! Tools and Python environments: Hermes `<tool_call>` parsing, the `tools` variable of chat
//! templates (with transformers' `tojson`), the tool environment with Rust, command and
//! Python tools (real processes), malformed calls and failures as observations, Python
//! environments with NeMo RL's `step`, and episodes that render the tools into the prompt.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;
use std::sync::Arc;
use std::time::Instant;

use candle_core::{DType, Device};
use grpo_rewards::python::PythonWorkers;
use grpo_rollout::env::{Environment, TimeLimited};
use grpo_rollout::episode::{EpisodeParams, EpisodePrompt, generate_episodes};
use grpo_rollout::generate::SamplingParams;
use grpo_rollout::init::{
    CHATML_TOOLS_TEMPLATE, Preset, preset_config, random_weights, train_tokenizer,
};
use grpo_rollout::python_env::{PythonEnvironment, PythonEnvironmentConfig};
use grpo_rollout::tokenizer::ChatTemplate;
use grpo_rollout::tools::{FnTool, ToolConfig, ToolEnvironment, parse_tool_calls};
use grpo_rollout::{ChatMessage, Tool, ToolCall};
use serde_json::{Value, json};

fn python() -> Option<String> {
    let py = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into());
    match Command::new(&py)
        .args(["-c", "import sys; assert sys.version_info >= (3, 8)"])
        .output()
    {
        Ok(o) if o.status.success() => Some(py),
        _ => {
            eprintln!("skipped: no Python ≥ 3.8 at `{py}` (set GRPO_PYTHON to one)");
            None
        }
    }
}

fn calculator_schema() -> Value {
    json!({"type": "object", "properties": {"expression": {"type": "string"}}, "required": ["expression"]})
}

/// A calculator over `a op b` in Rust.
fn calculator() -> Arc<dyn Tool> {
    Arc::new(FnTool::new(
        "calculator",
        "Evaluates a op b.",
        calculator_schema(),
        |args: &Value| {
            let e = args["expression"].as_str().ok_or("no expression")?;
            let parts: Vec<&str> = e.split_whitespace().collect();
            let [a, op, b] = parts.as_slice() else {
                return Err(format!("cannot read `{e}`"));
            };
            let (a, b): (i64, i64) = (
                a.parse().map_err(|_| "bad a")?,
                b.parse().map_err(|_| "bad b")?,
            );
            Ok(match *op {
                "+" => a + b,
                "-" => a - b,
                "*" => a * b,
                _ => return Err(format!("unknown operator {op}")),
            }
            .to_string())
        },
    ))
}

#[test]
fn hermes_tool_calls_parse_with_their_reasons() {
    let text = "Let me compute.<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 7\"}}\n</tool_call> and <tool_call>{\"name\": \"lookup\", \"arguments\": \"{\\\"q\\\": 1}\"}</tool_call>";
    let calls = parse_tool_calls(text);
    assert_eq!(calls.len(), 2);
    assert_eq!(
        calls[0].as_ref().unwrap(),
        &ToolCall::new("calculator", json!({"expression": "12 * 7"}))
    );
    assert_eq!(
        calls[1].as_ref().unwrap(),
        &ToolCall::new("lookup", json!({"q": 1}))
    );
    assert!(parse_tool_calls("no call here").is_empty());
    // No arguments = {}; an unclosed last call runs to the end.
    assert_eq!(
        parse_tool_calls("<tool_call>{\"name\": \"now\"}")[0]
            .as_ref()
            .unwrap(),
        &ToolCall::new("now", json!({}))
    );
    let bad = |t: &str| parse_tool_calls(t)[0].clone().unwrap_err();
    assert!(
        bad("<tool_call>{name: x}</tool_call>").contains("not JSON"),
        "{}",
        bad("<tool_call>{name: x}</tool_call>")
    );
    assert!(bad("<tool_call>{\"arguments\": {}}</tool_call>").contains("no \"name\""));
    assert!(bad("<tool_call>[1, 2]</tool_call>").contains("JSON object"));
    assert!(
        bad("<tool_call>{\"name\": \"f\", \"arguments\": [1]}</tool_call>")
            .contains("must be a JSON object")
    );
}

#[test]
fn templates_render_tools_and_tool_calls_as_transformers_does() {
    let t = ChatTemplate::new(CHATML_TOOLS_TEMPLATE, None, Some("<|im_end|>")).unwrap();
    let tools = vec![json!({
        "type": "function",
        "function": {"name": "calculator", "description": "Evaluates a op b.", "parameters": calculator_schema()},
    })];
    let mut call = ChatMessage::new("assistant", "");
    call.tool_calls = Some(vec![ToolCall::new(
        "calculator",
        json!({"expression": "2 * 3", "exact": true}),
    )]);
    let messages = vec![
        ChatMessage::new("system", "Be brief."),
        ChatMessage::new("user", "2*3?"),
        call,
        ChatMessage::tool("calculator", "6"),
        ChatMessage::tool("calculator", "again"),
    ];
    let out = t.render_with_tools(&messages, &tools, true).unwrap();
    // What transformers' apply_chat_template(messages, tools=tools, add_generation_prompt=True,
    // tokenize=False) gives for this template: json.dumps spacing, keys in their order.
    let expected = "<|im_start|>system\nBe brief.\n\n# Tools\n\nYou may call one or more functions to assist with the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"calculator\", \"description\": \"Evaluates a op b.\", \"parameters\": {\"type\": \"object\", \"properties\": {\"expression\": {\"type\": \"string\"}}, \"required\": [\"expression\"]}}}\n</tools>\n\nFor each function call, return a json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n{\"name\": <function-name>, \"arguments\": <args-json-object>}\n</tool_call><|im_end|>\n<|im_start|>user\n2*3?<|im_end|>\n<|im_start|>assistant\n<tool_call>\n{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2 * 3\", \"exact\": true}}\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n6\n</tool_response>\n<tool_response>\nagain\n</tool_response><|im_end|>\n<|im_start|>assistant\n";
    assert_eq!(out, expected);
    // No tools: `tools` is None, the plain branch.
    let plain = t.render(&messages[..2], false).unwrap();
    assert_eq!(
        plain,
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n2*3?<|im_end|>\n"
    );
    // tojson(indent=2) as json.dumps(indent=2); no HTML escaping.
    let t2 = ChatTemplate::new(
        "{{ messages[0].tool_calls[0].function.arguments | tojson(indent=2) }}|{{ messages[0].content | tojson }}",
        None,
        None,
    )
    .unwrap();
    let mut m = ChatMessage::new("assistant", "<a&b>");
    m.tool_calls = Some(vec![ToolCall::new("f", json!({"b": [1, 2], "a": {}}))]);
    let r = t2.render(&[m], false).unwrap();
    assert_eq!(
        r,
        "{\n  \"b\": [\n    1,\n    2\n  ],\n  \"a\": {}\n}|\"<a&b>\""
    );
}

fn log(last: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "What is 12 * 7?"),
        ChatMessage::new("assistant", last),
    ]
}

fn step(env: &dyn Environment, lasts: &[&str]) -> grpo_rollout::EnvironmentReturn {
    let logs: Vec<Vec<ChatMessage>> = lasts.iter().map(|l| log(l)).collect();
    let refs: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let meta = vec![json!({"answer": 84}); lasts.len()];
    let mrefs: Vec<&Value> = meta.iter().collect();
    let r = env.step(&refs, &mrefs).unwrap();
    r.validate(lasts.len(), env.name()).unwrap();
    r
}

#[test]
fn the_tool_environment_answers_calls_and_shows_errors_to_the_model() {
    let env = ToolEnvironment::new(vec![calculator()])
        .unwrap()
        .with_max_calls_per_turn(2);
    assert_eq!(env.tools()[0]["function"]["name"], "calculator");
    let r = step(
        &env,
        &[
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"12 * 7\"}}</tool_call>",
            "The answer is 84.",
            "<tool_call>{\"name\": \"search\", \"arguments\": {}}</tool_call>",
            "<tool_call>{oops}</tool_call>",
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1 / 2\"}}</tool_call>",
            "<tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"1 + 1\"}}</tool_call><tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"2 + 2\"}}</tool_call><tool_call>{\"name\": \"calculator\", \"arguments\": {\"expression\": \"3 + 3\"}}</tool_call>",
        ],
    );
    let obs = |i: usize| r.observations[i].clone();
    assert_eq!(obs(0).unwrap(), ChatMessage::tool("calculator", "84"));
    assert!(!r.terminateds[0]);
    // No call: the model answered; the episode is over.
    assert!(r.terminateds[1] && obs(1).is_none());
    assert_eq!(
        obs(2).unwrap().content,
        "error: unknown tool `search`; the tools are: calculator"
    );
    assert!(
        obs(3)
            .unwrap()
            .content
            .starts_with("error: the tool call is not JSON")
    );
    assert_eq!(obs(4).unwrap().content, "error: unknown operator /");
    // Three calls, two allowed: one tool message, a line per call, the third refused.
    let o5 = obs(5).unwrap();
    assert_eq!(o5.role, "tool");
    assert_eq!(o5.name, None);
    let lines: Vec<&str> = o5.content.lines().collect();
    assert_eq!(lines[..2], ["2", "4"]);
    assert!(lines[2].starts_with("error: more than 2 tool calls"));
    assert!(r.rewards.iter().all(|&x| x == 0.0));
    assert_eq!(r.metadata[0], json!({"answer": 84}));
    // Two tools of one name are refused.
    let e = ToolEnvironment::new(vec![calculator(), calculator()]).unwrap_err();
    assert!(e.to_string().contains("two tools are named `calculator`"));
}

fn write(dir: &Path, name: &str, text: &str) -> String {
    let p = dir.join(name);
    std::fs::write(&p, text).unwrap();
    p.display().to_string()
}

#[test]
fn command_tools_run_a_real_program_with_a_timeout() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let calc = write(
        dir.path(),
        "calc.py",
        "import json, sys\nargs = json.load(sys.stdin)\nexpr = args['expression']\nif expr == 'crash':\n    sys.stderr.write('bad input\\n'); sys.exit(3)\nif expr == 'hang':\n    import time; time.sleep(30)\nprint(eval(expr, {'__builtins__': {}}))\n",
    );
    let cfg: ToolConfig = toml::from_str(&format!(
        r#"
type = "command"
name = "calculator"
description = "Evaluates an arithmetic expression."
parameters = {{ type = "object", properties = {{ expression = {{ type = "string" }} }}, required = ["expression"] }}
argv = ["{py}", "{calc}"]
timeout = 1
"#
    ))
    .unwrap();
    let workers = PythonWorkers::new();
    let tool = cfg.build(&workers).unwrap();
    assert_eq!(tool.schema()["function"]["parameters"], calculator_schema());
    assert_eq!(
        tool.call(&json!({"expression": "123 * 45"})).unwrap(),
        "5535"
    );
    let e = tool.call(&json!({"expression": "crash"})).unwrap_err();
    assert_eq!(e, "`calculator` exited with status 3: bad input");
    let t0 = Instant::now();
    let e = tool.call(&json!({"expression": "hang"})).unwrap_err();
    assert!(e.contains("did not finish within its timeout"), "{e}");
    assert!(t0.elapsed().as_secs_f64() < 10.0);
    // `{name}` placeholders take the arguments.
    let echo: ToolConfig =
        toml::from_str("type = \"command\"\nname = \"echo\"\nargv = [\"echo\", \"got {word}\"]\n")
            .unwrap();
    let echo = echo.build(&workers).unwrap();
    assert_eq!(echo.call(&json!({"word": "hi"})).unwrap(), "got hi");
    // A program that does not exist is a config error naming the tool.
    let missing: ToolConfig =
        toml::from_str("type = \"command\"\nname = \"x\"\nargv = [\"/no/such/program\"]\n")
            .unwrap();
    let e = missing.build(&workers).err().unwrap().to_string();
    assert!(e.starts_with("tool `x`: argv"), "{e}");
    // Unknown keys are refused.
    assert!(
        toml::from_str::<ToolConfig>(
            "type = \"command\"\nname = \"x\"\nargv = [\"echo\"]\ntimout = 3\n"
        )
        .is_err()
    );
}

const TOOLS_PY: &str = r#"
import asyncio
import time


def add(a: int, b: int, scale: float = 1.0) -> float:
    """Adds two integers.

    Args:
        a: The first number.
        b: The second number.
        scale: A factor applied to the sum.
    """
    return (a + b) * scale


def shout(text: str):
    """Upper-cases text."""
    return {"text": text.upper()}


async def later(x: int):
    """Waits, then answers."""
    await asyncio.sleep(0.01)
    return "later %d" % x


def broken(x: int):
    """Fails."""
    raise ValueError("no good: %d" % x)


def slow():
    """Hangs."""
    time.sleep(30)
"#;

#[test]
fn python_tools_take_their_schema_from_the_signature_and_fail_as_observations() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "tools.py", TOOLS_PY);
    let workers = PythonWorkers::new();
    let tool = |function: &str, timeout: f64| {
        let cfg: ToolConfig = serde_json::from_value(json!({
            "type": "python", "path": path, "function": function, "python": py, "timeout": timeout,
        }))
        .unwrap();
        cfg.build(&workers).unwrap()
    };
    let add = tool("add", 10.0);
    assert_eq!(
        add.schema(),
        json!({"type": "function", "function": {
            "name": "add",
            "description": "Adds two integers.",
            "parameters": {"type": "object", "properties": {
                "a": {"type": "integer", "description": "The first number."},
                "b": {"type": "integer", "description": "The second number."},
                "scale": {"type": "number", "description": "A factor applied to the sum."},
            }, "required": ["a", "b"]},
        }})
    );
    assert_eq!(add.call(&json!({"a": 2, "b": 3})).unwrap(), "5.0");
    assert_eq!(
        tool("shout", 10.0).call(&json!({"text": "hi"})).unwrap(),
        "{\"text\": \"HI\"}"
    );
    assert_eq!(
        tool("later", 10.0).call(&json!({"x": 4})).unwrap(),
        "later 4"
    );
    let e = tool("broken", 10.0).call(&json!({"x": 4})).unwrap_err();
    assert!(
        e.starts_with("`broken` raised ValueError: no good: 4 at "),
        "{e}"
    );
    // Wrong arguments are the model's mistake: an observation.
    let e = add.call(&json!({"a": 2})).unwrap_err();
    assert!(e.contains("TypeError"), "{e}");
    let t0 = Instant::now();
    let e = tool("slow", 0.5).call(&json!({})).unwrap_err();
    assert!(e.contains("did not return within 0.5 s"), "{e}");
    assert!(t0.elapsed().as_secs_f64() < 10.0);
    // The worker came back: the other tools still answer.
    assert_eq!(add.call(&json!({"a": 1, "b": 1, "scale": 2})).unwrap(), "4");
    // A missing function is a config error.
    let cfg: ToolConfig = serde_json::from_value(json!({
        "type": "python", "path": path, "function": "nope", "python": py,
    }))
    .unwrap();
    let e = cfg.build(&workers).err().unwrap().to_string();
    assert!(e.contains("has no function `nope`"), "{e}");
}

const GUESS_PY: &str = r#"
from collections import namedtuple

EnvironmentReturn = namedtuple(
    "EnvironmentReturn", ["observations", "metadata", "next_stop_strings", "rewards", "terminateds"]
)


class Guess:
    def __init__(self, bonus=0.0):
        self.bonus = bonus

    def step(self, message_logs, metadata):
        obs, meta, rewards, done = [], [], [], []
        for log, m in zip(message_logs, metadata):
            text = log[-1]["content"]
            digits = "".join(c for c in text if c.isdigit())
            guesses = m.get("guesses", 0) + 1
            target = m["target"]
            if digits and int(digits) == target:
                obs.append({"role": "user", "content": "correct"})
                rewards.append(1.0 + self.bonus)
                done.append(True)
            else:
                obs.append({"role": "user", "content": "higher" if not digits or int(digits) < target else "lower"})
                rewards.append(0.0)
                done.append(False)
            meta.append(dict(m, guesses=guesses))
        return EnvironmentReturn(obs, meta, [None] * len(obs), rewards, done)

    def global_post_process_and_metrics(self, episodes):
        for e in episodes:
            e["rewards"] = [r + 10.0 for r in e["rewards"]]
        return episodes, {"episodes_seen": len(episodes), "mean_turns": sum(len(e["rewards"]) for e in episodes) / len(episodes)}


class Crashes:
    def step(self, message_logs, metadata):
        raise RuntimeError("the sandbox is gone")


class Hangs:
    def step(self, message_logs, metadata):
        import time
        time.sleep(30)


class WrongLength:
    def step(self, message_logs, metadata):
        return {"observations": [None], "rewards": [0.0], "terminateds": [True, True]}
"#;

fn tiny() -> (grpo_rollout::Transformer, grpo_rollout::Tokenizer) {
    let mut tok = train_tokenizer(400).unwrap();
    tok.chat_template = Some(CHATML_TOOLS_TEMPLATE.into());
    let cfg = preset_config(
        Preset::Tiny,
        grpo_rollout::Arch::Qwen2,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    let m = random_weights(&cfg, 5, DType::F32, &Device::Cpu).unwrap();
    (m.detached(), tok)
}

fn params() -> EpisodeParams {
    EpisodeParams {
        sampling: SamplingParams {
            temperature: 1.0,
            seed: 3,
            ..SamplingParams::default()
        },
        max_turns: 3,
        max_tokens_per_turn: 5,
        max_total_tokens: 60,
    }
}

#[test]
fn python_environments_run_episodes_with_nemo_rl_step() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let path = write(dir.path(), "guess.py", GUESS_PY);
    let workers = PythonWorkers::new();
    let cfg = |class: &str, timeout: f64| PythonEnvironmentConfig {
        path: path.clone(),
        class: class.into(),
        init: (class == "Guess").then(|| json!({"bonus": 0.5})),
        python: py.clone(),
        timeout,
        name: None,
    };
    let env = PythonEnvironment::new(&cfg("Guess", 30.0), &workers).unwrap();
    assert_eq!(env.name(), "Guess");
    let (model, tok) = tiny();
    let prompts: Vec<EpisodePrompt> = [3, 1]
        .iter()
        .map(|t| {
            EpisodePrompt::from_messages(
                &tok,
                vec![ChatMessage::new("user", "Guess my number.")],
                json!({"target": t}),
            )
            .unwrap()
        })
        .collect();
    let mut eps = generate_episodes(&model, &tok, &env, &prompts, 2, &params()).unwrap();
    assert_eq!(eps.len(), 4);
    for e in &eps {
        // Every turn was answered: the guess count in the metadata is the turn count, the
        // observations are the class's (role user).
        assert_eq!(e.metadata["guesses"], json!(e.num_turns()));
        for m in e.messages.iter().skip(1) {
            assert!(
                m.role == "assistant"
                    || (m.role == "user"
                        && ["higher", "lower", "correct"].contains(&m.content.as_str())),
                "{m:?}"
            );
        }
        for t in &e.turns {
            assert!(t.reward == 0.0 || t.reward == 1.5);
        }
    }
    let before: Vec<Vec<f32>> = eps.iter().map(|e| e.rewards()).collect();
    let metrics = env.post_process(&mut eps).unwrap();
    assert_eq!(metrics["episodes_seen"], 4.0);
    let turns = eps.iter().map(|e| e.num_turns()).sum::<usize>() as f64 / 4.0;
    assert!((metrics["mean_turns"] - turns).abs() < 1e-9);
    for (e, b) in eps.iter().zip(before) {
        let want: Vec<f32> = b.iter().map(|r| r + 10.0).collect();
        assert_eq!(e.rewards(), want);
    }

    // A crash, a wrong answer, a hang: one-line errors naming the environment's method.
    let crash = PythonEnvironment::new(&cfg("Crashes", 30.0), &workers).unwrap();
    let e = generate_episodes(&model, &tok, &crash, &prompts, 2, &params())
        .unwrap_err()
        .to_string();
    assert!(e.contains("RuntimeError: the sandbox is gone"), "{e}");
    assert!(e.contains("Crashes"), "{e}");
    let first = e.lines().next().unwrap();
    assert!(first.starts_with("environment `Crashes` failed at turn 1: step: raised RuntimeError: the sandbox is gone at "), "{e}");
    let wrong = PythonEnvironment::new(&cfg("WrongLength", 30.0), &workers).unwrap();
    let e = generate_episodes(&model, &tok, &wrong, &prompts, 2, &params())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("step returned 1 observations for 4 episodes"),
        "{e}"
    );
    let hang = PythonEnvironment::new(&cfg("Hangs", 0.5), &workers).unwrap();
    let t0 = Instant::now();
    let e = generate_episodes(&model, &tok, &hang, &prompts, 2, &params())
        .unwrap_err()
        .to_string();
    assert!(e.contains("did not return within 0.5 s"), "{e}");
    assert!(t0.elapsed().as_secs_f64() < 20.0);
    // Config errors name the field.
    let e = PythonEnvironment::new(&cfg("Nope", 1.0), &workers)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("has no function `Nope`") || e.contains("`Nope`"),
        "{e}"
    );
    let e = PythonEnvironment::new(
        &PythonEnvironmentConfig {
            init: Some(json!([1])),
            ..cfg("Guess", 1.0)
        },
        &workers,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("init"), "{e}");
}

/// A Rust environment that never answers.
struct Stuck;

impl Environment for Stuck {
    fn name(&self) -> &str {
        "stuck"
    }

    fn step(
        &self,
        _: &[&[ChatMessage]],
        _: &[&Value],
    ) -> candle_core::Result<grpo_rollout::EnvironmentReturn> {
        std::thread::sleep(std::time::Duration::from_secs(30));
        candle_core::bail!("woke up")
    }
}

#[test]
fn a_time_limit_ends_a_hanging_step() {
    let env = TimeLimited::new(Arc::new(Stuck), std::time::Duration::from_millis(300));
    let logs = [log("hi")];
    let refs: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let t0 = Instant::now();
    let e = env.step(&refs, &[&Value::Null]).unwrap_err().to_string();
    assert!(
        e.contains("step did not return within 0.3 s (environment.step_timeout)"),
        "{e}"
    );
    assert!(t0.elapsed().as_secs_f64() < 5.0);
    assert_eq!(env.name(), "stuck");
}

#[test]
fn episodes_render_the_environments_tools_into_the_prompt() {
    let (model, tok) = tiny();
    let env = ToolEnvironment::new(vec![calculator()]).unwrap();
    let messages = vec![ChatMessage::new("user", "What is 12 * 7?")];
    let (p, text) =
        EpisodePrompt::rendered(&tok, messages.clone(), env.tools(), json!({})).unwrap();
    assert!(
        text.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"calculator\""),
        "{text}"
    );
    assert_eq!(p.ids, tok.encode(&text, false).unwrap());
    let eps =
        generate_episodes(&model, &tok, &env, std::slice::from_ref(&p), 3, &params()).unwrap();
    // A random model makes no call: each episode is one turn, ended by the environment.
    for e in &eps {
        assert_eq!(e.num_turns(), 1);
        assert!(e.terminated());
    }
    // A prompt rendered without the tools is refused.
    let bare = EpisodePrompt::from_messages(&tok, messages, json!({})).unwrap();
    let e = generate_episodes(&model, &tok, &env, &[bare], 2, &params())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("rendered with other tools than environment `tools` offers"),
        "{e}"
    );
}
