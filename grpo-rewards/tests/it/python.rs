//! `type = "python"` rewards against a real interpreter (`GRPO_PYTHON`, else `python3`; the
//! tests skip with a message when there is none).
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::{Duration, Instant};

use grpo_rewards::{FieldValue, Message, RewardInput, RewardSet, RewardsConfig, ScoringModels};
use serde_json::{Value, json};

const REWARDS_PY: &str = r#"
import asyncio
import os
import sys
import time


def scored(prompts, completions, completion_ids, trainer_state, answer, weight, **kwargs):
    # Printing must not disturb the protocol: Python's stdout, fd 1, a child process.
    print("debug: scoring", len(completions), "completions")
    sys.stdout.write("more debug\n")
    os.write(1, b"raw write to fd 1\n")
    os.system("echo from a child process")
    out = []
    for c, a, ids, w in zip(completions, answer, completion_ids, weight):
        out.append((1.0 if str(a) in c else 0.0) * w + 0.5 * trainer_state.global_step + len(ids) / 8)
    return out


def shapes(prompts, completions, **kwargs):
    out = []
    for p, c in zip(prompts, completions):
        if isinstance(p, str) and isinstance(c, str):
            out.append(0.0)
        elif (
            isinstance(p, list)
            and all(isinstance(m, dict) and set(m) == {"role", "content"} for m in p)
            and isinstance(c, list)
            and len(c) == 1
            and set(c[0]) == {"role", "content"}
            and c[0]["role"] == "assistant"
        ):
            out.append(len(p) * 1000 + len(p[-1]["content"]) + (1 if p[0]["role"] == "system" else 0) * 100 + len(c[0]["content"]) / 1000)
        else:
            out.append(-1.0)
    return out


def maybe(completions, **kwargs):
    return [None if "?" in c else (float("nan") if "nan" in c else 1.0) for c in completions]


async def async_len(completions, **kwargs):
    await asyncio.sleep(0.01)
    return [float(len(c)) for c in completions]


def episode(completions, **kwargs):
    # A multi-turn episode's completion is its messages after the prompt.
    return [float(len(c)) + (0.5 if c[-1]["role"] == "assistant" and c[1]["role"] == "tool" else 0.0) for c in completions]


def pid(completions, **kwargs):
    return [os.getpid()] * len(completions)


def pid_again(completions, **kwargs):
    return [float(os.getpid())] * len(completions)


def boom(completions, **kwargs):
    return [helper(c) for c in completions]


def helper(c):
    return len(c) / 0  # LINE-BOOM


def hang_at_step_0(completions, trainer_state, **kwargs):
    if trainer_state.global_step == 0:
        time.sleep(30)
    return [float(os.getpid())] * len(completions)


def short(completions, **kwargs):
    return [1.0] * (len(completions) - 1)


def text(completions, **kwargs):
    return [1.0, "x"] + [2.0] * (len(completions) - 2)


def suicide(completions, **kwargs):
    os.kill(os.getpid(), 9)


def constant(completions, **kwargs):
    return [1.0] * len(completions)


def logs(completions, log_extra, log_metric, **kwargs):
    # TRL's logging callables: a completions-log column, a metric averaged over its calls.
    log_extra("length", [len(c) for c in completions])
    log_extra("odd", [object()] * len(completions))
    log_metric("my/metric", 1.0)
    log_metric("my/metric", 3.0)
    return [1.0] * len(completions)
"#;

/// The interpreter, or `None` (with a message) when there is none.
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

struct Fixture {
    py: String,
    dir: tempfile::TempDir,
}

impl Fixture {
    fn new() -> Option<Self> {
        let py = python()?;
        let dir = tempfile::tempdir().unwrap();
        std::fs::write(dir.path().join("rewards.py"), REWARDS_PY).unwrap();
        Some(Self { py, dir })
    }

    fn file(&self) -> PathBuf {
        self.dir.path().join("rewards.py")
    }

    /// A python reward spec for `function` of the fixture file.
    fn spec(&self, name: &str, function: &str) -> Value {
        json!({
            "type": "python", "name": name, "path": self.file(), "function": function,
            "python": self.py,
        })
    }

    fn build(&self, specs: Vec<Value>) -> grpo_rewards::Result<RewardSet> {
        let cfg: RewardsConfig = serde_json::from_value(json!({ "rewards": specs })).unwrap();
        cfg.build(&ScoringModels::default())
    }
}

fn batch(step: usize) -> Vec<RewardInput> {
    vec![
        RewardInput::new("What is 2+3?", "It is 5.")
            .with_ids(vec![1, 2, 3])
            .with_field("answer", "5")
            .with_field("weight", 2.0)
            .at_step(step),
        RewardInput::new("What is 7*6?", "Maybe 41")
            .with_ids(vec![4; 10])
            .with_field("answer", 42i64)
            .with_field("weight", 1i64)
            .at_step(step),
        RewardInput::new("Name a colour", "réd — ünïcode \"quoted\"\nnew line")
            .with_field("answer", "réd")
            .with_field("weight", 0.5)
            .at_step(step),
    ]
}

fn weight(x: &RewardInput) -> f64 {
    match x.field("weight").unwrap() {
        FieldValue::Float(f) => *f,
        FieldValue::Int(i) => *i as f64,
        other => panic!("{other:?}"),
    }
}

/// `scored` of rewards.py, in Rust.
fn scored_in_rust(b: &[RewardInput]) -> Vec<Option<f32>> {
    b.iter()
        .map(|x| {
            let a = x.field("answer").unwrap().as_text().unwrap();
            let hit = if x.completion.contains(&a) { 1.0 } else { 0.0 };
            Some(
                (hit * weight(x) + 0.5 * x.global_step as f64 + x.completion_ids.len() as f64 / 8.0)
                    as f32,
            )
        })
        .collect()
}

fn one_line(e: &grpo_rewards::RewardError) -> String {
    let s = e.to_string();
    eprintln!("error: {s}");
    assert!(!s.contains('\n'), "not one line: {s}");
    s
}

#[test]
fn log_extra_and_log_metric_reach_the_info_and_the_metrics() {
    let Some(f) = Fixture::new() else { return };
    let set = f
        .build(vec![f.spec("logs", "logs"), f.spec("constant", "constant")])
        .unwrap();
    let b = batch(0);
    let out = set.score(&b).unwrap();
    assert_eq!(out.metrics["my/metric"], 2.0);
    for (i, x) in b.iter().enumerate() {
        let info = out.info[0][i].as_ref().unwrap();
        assert_eq!(info["length"], json!(x.completion.chars().count()));
        assert!(
            info["odd"].as_str().unwrap().starts_with("<object"),
            "{info}"
        );
        // The other reward logged nothing.
        assert_eq!(out.info[1].get(i).cloned().flatten(), None);
    }
}

#[test]
fn a_function_reads_columns_and_the_step_and_may_print() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("scored", "scored")]).unwrap();
    for step in [0, 3] {
        let b = batch(step);
        let out = set.score(&b).unwrap();
        assert_eq!(out.per_function[0], scored_in_rust(&b), "step {step}");
        assert_eq!(out.metrics["rewards/scored/worker_restarts"], 0.0);
    }
    // Sanity: the first completion contains its answer, the second does not.
    assert_eq!(scored_in_rust(&batch(0))[..2], [Some(2.375), Some(1.25)]);
}

#[test]
fn conversational_prompts_arrive_as_message_lists() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("shapes", "shapes")]).unwrap();
    let conv = vec![
        RewardInput::new("templated", "Four.").with_messages(vec![
            Message::new("system", "Be brief."),
            Message::new("user", "2+2?"),
        ]),
        RewardInput::new("templated", "fünf").with_messages(vec![Message::new("user", "Hi")]),
    ];
    let out = set.score(&conv).unwrap();
    assert_eq!(
        out.per_function[0],
        vec![Some(2104.005f64 as f32), Some(1002.004f64 as f32)]
    );
    let plain = set.score(&batch(0)).unwrap();
    assert_eq!(plain.per_function[0], vec![Some(0.0); 3]);
}

#[test]
fn an_episode_arrives_as_its_messages_after_the_prompt() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("episode", "episode")]).unwrap();
    let x = RewardInput::new("templated", "transcript")
        .with_messages(vec![Message::new("user", "12*7?")])
        .with_completion_messages(vec![
            Message::new("assistant", "<tool_call>{}</tool_call>"),
            Message::new("tool", "84"),
            Message::new("assistant", "84"),
        ]);
    let out = set.score(&[x]).unwrap();
    assert_eq!(out.per_function[0], vec![Some(3.5)]);
}

#[test]
fn accuracy_reads_an_episodes_last_assistant_message() {
    let cfg: RewardsConfig =
        serde_json::from_value(json!({ "rewards": [{"type": "accuracy"}] })).unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    let ep = |last: &str| {
        RewardInput::new("p", "transcript with 84 in the tool result")
            .with_field("answer", "84")
            .with_completion_messages(vec![
                Message::new("assistant", "<tool_call>{\"name\": \"calc\"}</tool_call>"),
                Message::new("tool", "84"),
                Message::new("assistant", last),
            ])
    };
    let out = set
        .score(&[ep("It is 84."), ep("It is 85."), ep("")])
        .unwrap();
    assert_eq!(out.per_function[0], vec![Some(1.0), Some(0.0), Some(0.0)]);
}

#[test]
fn none_and_nan_are_no_opinion_and_async_functions_are_awaited() {
    let Some(f) = Fixture::new() else { return };
    let set = f
        .build(vec![f.spec("maybe", "maybe"), f.spec("len", "async_len")])
        .unwrap();
    let b = vec![
        RewardInput::new("p", "yes"),
        RewardInput::new("p", "why?"),
        RewardInput::new("p", "nan"),
    ];
    let out = set.score(&b).unwrap();
    assert_eq!(out.per_function[0], vec![Some(1.0), None, None]);
    assert_eq!(out.per_function[1], vec![Some(3.0), Some(4.0), Some(3.0)]);
    assert_eq!(out.rewards, vec![4.0, 4.0, 3.0]);
}

#[test]
fn python_rewards_share_one_worker() {
    let Some(f) = Fixture::new() else { return };
    let set = f
        .build(vec![
            f.spec("a", "pid"),
            f.spec("b", "pid"),
            f.spec("c", "pid_again"),
        ])
        .unwrap();
    let out = set.score(&batch(0)).unwrap();
    let pid = out.per_function[0][0].unwrap();
    assert!(pid > 0.0 && pid != std::process::id() as f32);
    for k in 0..3 {
        assert_eq!(out.per_function[k], vec![Some(pid); 3], "reward {k}");
    }
    // Still the same process at the next step.
    assert_eq!(set.score(&batch(1)).unwrap().per_function[2][0], Some(pid));
}

#[test]
fn an_exception_is_one_line_with_its_file_and_line() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("boom", "boom")]).unwrap();
    let line = REWARDS_PY
        .lines()
        .position(|l| l.contains("LINE-BOOM"))
        .unwrap()
        + 1;
    let e = one_line(&set.score(&batch(0)).unwrap_err());
    let at = format!("{}:{line}", f.file().canonicalize().unwrap().display());
    for part in [
        "python reward `boom`",
        "`boom`",
        "ZeroDivisionError",
        "division by zero",
        at.as_str(),
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    // The worker survives an exception.
    let e2 = one_line(&set.score(&batch(0)).unwrap_err());
    assert_eq!(e, e2);
}

#[test]
fn a_call_past_the_timeout_fails_and_the_next_call_works() {
    let Some(f) = Fixture::new() else { return };
    let mut spec = f.spec("slow", "hang_at_step_0");
    spec["timeout"] = json!(1);
    let set = f.build(vec![spec]).unwrap();
    let t0 = Instant::now();
    let e = one_line(&set.score(&batch(0)).unwrap_err());
    let took = t0.elapsed();
    assert!(
        took >= Duration::from_millis(900) && took < Duration::from_secs(10),
        "{took:?}"
    );
    for part in [
        "python reward `slow`",
        "`hang_at_step_0`",
        "1 s",
        "`timeout`",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
    // A new worker answers the next call.
    let out = set.score(&batch(1)).unwrap();
    assert!(out.per_function[0][0].unwrap() > 0.0);
    assert_eq!(out.metrics["rewards/slow/worker_restarts"], 0.0);
}

#[test]
fn a_wrong_length_or_a_non_numeric_return_names_the_function_and_sample() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("short", "short")]).unwrap();
    let e = one_line(&set.score(&batch(0)).unwrap_err());
    assert!(e.contains("python reward `short`"), "{e}");
    assert!(
        e.contains("`short`") && e.contains("returned 2 scores for 3 completions"),
        "{e}"
    );

    let set = f.build(vec![f.spec("text", "text")]).unwrap();
    let e = one_line(&set.score(&batch(0)).unwrap_err());
    for part in ["python reward `text`", "`text`", "str", "sample 1", "'x'"] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
}

#[cfg(unix)]
#[test]
fn a_killed_worker_is_restarted_once_and_a_worker_dying_twice_fails_the_call() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("pid", "pid")]).unwrap();
    let first = set.score(&batch(0)).unwrap().per_function[0][0].unwrap() as u32;
    let status = Command::new("kill")
        .args(["-9", &first.to_string()])
        .status()
        .unwrap();
    assert!(status.success());
    // Wait until it is gone (its parent, this process, has not reaped it: it is a zombie).
    let stat = Path::new("/proc").join(first.to_string()).join("stat");
    let t0 = Instant::now();
    while t0.elapsed() < Duration::from_secs(5) {
        match std::fs::read_to_string(&stat) {
            Ok(s) if !s.contains(") Z") => std::thread::sleep(Duration::from_millis(10)),
            _ => break,
        }
    }
    let out = set.score(&batch(1)).unwrap();
    let second = out.per_function[0][0].unwrap() as u32;
    assert_ne!(first, second);
    assert_eq!(out.metrics["rewards/pid/worker_restarts"], 1.0);
    let out = set.score(&batch(2)).unwrap();
    assert_eq!(out.per_function[0][0], Some(second as f32));
    assert_eq!(out.metrics["rewards/pid/worker_restarts"], 0.0);

    let set = f.build(vec![f.spec("suicide", "suicide")]).unwrap();
    let e = one_line(&set.score(&batch(0)).unwrap_err());
    for part in [
        "python reward `suicide`",
        "`suicide`",
        "died twice",
        "signal: 9",
    ] {
        assert!(e.contains(part), "{part:?} not in {e}");
    }
}

#[test]
fn a_bad_path_function_or_interpreter_is_a_config_error_at_build() {
    let Some(f) = Fixture::new() else { return };
    let ok = f.spec("ok", "constant");
    let err = |spec: Value| -> String {
        let e = f.build(vec![ok.clone(), spec]).unwrap_err();
        assert!(
            matches!(e, grpo_rewards::RewardError::Config { .. }),
            "{e:?}"
        );
        one_line(&e)
    };

    let mut s = f.spec("x", "constant");
    s["path"] = json!(f.dir.path().join("missing.py"));
    let e = err(s);
    assert!(
        e.contains("`rewards[1].path`") && e.contains("missing.py"),
        "{e}"
    );

    let e = err(f.spec("x", "acurracy"));
    assert!(e.contains("`rewards[1].function`"), "{e}");
    assert!(
        e.contains("no function `acurracy`") && e.contains("scored"),
        "{e}"
    );

    let bad = f.dir.path().join("bad.py");
    std::fs::write(&bad, "x = 1\ndef f(:\n    pass\n").unwrap();
    let mut s = f.spec("x", "f");
    s["path"] = json!(bad);
    let e = err(s);
    assert!(
        e.contains("`rewards[1].path`") && e.contains("SyntaxError"),
        "{e}"
    );
    assert!(e.contains("bad.py:2"), "{e}");

    let raising = f.dir.path().join("raising.py");
    std::fs::write(
        &raising,
        "import json\nraise RuntimeError('no model here')\n",
    )
    .unwrap();
    let mut s = f.spec("x", "f");
    s["path"] = json!(raising);
    let e = err(s);
    assert!(e.contains("`rewards[1].path`"), "{e}");
    assert!(
        e.contains("RuntimeError: no model here") && e.contains("raising.py:2"),
        "{e}"
    );

    let mut s = f.spec("x", "f");
    s["path"] = json!("no_such_module_grpo_test");
    let e = err(s);
    assert!(
        e.contains("`rewards[1].path`") && e.contains("no module named"),
        "{e}"
    );

    let mut s = f.spec("x", "constant");
    s["python"] = json!("/nonexistent/python3");
    let e = err(s);
    assert!(
        e.contains("`rewards[1].python`") && e.contains("cannot start"),
        "{e}"
    );

    let mut s = f.spec("x", "constant");
    s["timeout"] = json!(0);
    let e = err(s);
    assert!(e.contains("`rewards[1].timeout`"), "{e}");

    // Unknown keys are refused when the config is read.
    let mut s = f.spec("x", "constant");
    s["timeot"] = json!(1);
    let e = serde_json::from_value::<RewardsConfig>(json!({ "rewards": [s] })).unwrap_err();
    assert!(e.to_string().contains("timeot"), "{e}");
}

#[test]
fn a_module_name_on_the_python_path_works_and_a_bad_signature_is_explained() {
    let Some(f) = Fixture::new() else { return };
    // `json.dumps` imports (a module name), but is no reward function.
    let mut s = f.spec("dumps", "dumps");
    s["path"] = json!("json");
    let set = f.build(vec![s]).unwrap();
    let e = one_line(&set.score(&batch(0)).unwrap_err());
    assert!(e.contains("TypeError") && e.contains("**kwargs"), "{e}");
}

/// The README's example (the first python and toml blocks of its `type = "python"` section).
#[test]
fn the_readme_example_runs() {
    let Some(f) = Fixture::new() else { return };
    let readme = include_str!("../../../README.md");
    let section = &readme[readme.find("#### `type = \"python\"`").unwrap()..];
    let block = |lang: &str| {
        let start = section.find(&format!("```{lang}\n")).unwrap() + lang.len() + 4;
        &section[start..start + section[start..].find("```").unwrap()]
    };
    let file = f.dir.path().join("readme_rewards.py");
    std::fs::write(&file, block("python")).unwrap();
    let mut cfg: RewardsConfig = toml::from_str(block("toml")).unwrap();
    assert_eq!(cfg.rewards.len(), 2);
    for spec in &mut cfg.rewards {
        let mut v = serde_json::to_value(&*spec).unwrap();
        v["path"] = json!(file);
        v["python"] = json!(f.py);
        *spec = serde_json::from_value(v).unwrap();
    }
    let set = cfg.build(&ScoringModels::default()).unwrap();
    let b = |step| {
        vec![
            RewardInput::new("2+2?", "<think>easy</think><answer> 4 </answer>")
                .with_ids(vec![7; 512])
                .with_field("answer", 4i64)
                .at_step(step),
            RewardInput::new("2+3?", "<answer>6</answer>")
                .with_ids(vec![7; 256])
                .with_field("answer", "5")
                .at_step(step),
        ]
    };
    let early = set.score(&b(0)).unwrap();
    assert_eq!(
        early.per_function,
        vec![vec![Some(1.0), Some(0.0)], vec![None, None]]
    );
    let late = set.score(&b(50)).unwrap();
    assert_eq!(late.per_function[1], vec![Some(-0.5), Some(-0.25)]);
    assert_eq!(late.rewards, vec![1.0 - 0.05, -0.025]);
}

/// Worker overhead per call: 256 completions, a function returning constants (median of 300
/// calls), with GSM8K-sized texts and 200 token ids each, then with tiny ones.
/// `cargo test --release -p grpo-rewards --test it python::overhead -- --ignored --nocapture`
#[test]
#[ignore = "benchmark"]
fn overhead_per_call_for_256_completions() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![f.spec("constant", "constant")]).unwrap();
    let prompt = "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. How many clips did Natalia sell altogether in April and May?";
    let completion = "<think>".to_owned()
        + &"Let me think step by step. ".repeat(30)
        + "</think><answer>72</answer>";
    let large: Vec<RewardInput> = (0..256)
        .map(|i| {
            RewardInput::new(prompt, completion.clone())
                .with_ids((0..200).map(|t| 1000 + t + i).collect())
                .with_field("answer", "72")
                .at_step(5)
        })
        .collect();
    let tiny: Vec<RewardInput> = (0..256)
        .map(|_| RewardInput::new("2+2?", "4").with_field("answer", "4"))
        .collect();
    for (what, b) in [
        (
            format!(
                "{} B prompt, {} B completion, 200 ids",
                prompt.len(),
                completion.len()
            ),
            &large,
        ),
        ("tiny texts, no ids".to_owned(), &tiny),
    ] {
        for _ in 0..20 {
            set.score(b).unwrap();
        }
        let mut times: Vec<f64> = (0..300)
            .map(|_| {
                let t0 = Instant::now();
                set.score(b).unwrap();
                t0.elapsed().as_secs_f64() * 1e3
            })
            .collect();
        times.sort_by(f64::total_cmp);
        eprintln!(
            "python reward overhead, 256 completions ({what}): median {:.2} ms, p90 {:.2} ms",
            times[times.len() / 2],
            times[times.len() * 9 / 10]
        );
    }
}

/// verl's reward-function convention (`signature = "verl"`): gsm8k's rule as verl writes it.
const VERL_PY: &str = r#####"
import re


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    m = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    answer = m[-1].replace(",", "") if m else None
    score = 1.0 if answer == ground_truth else 0.0
    if data_source == "dict":
        return {"score": score + extra_info["bonus"], "acc": answer == ground_truth, "pred": answer}
    return score


def no_score(data_source, solution_str, ground_truth, extra_info=None):
    return {"acc": 1}


def trl_style(prompts, completions, **kwargs):
    return [0.0] * len(completions)
"#####;

fn verl_spec(f: &Fixture, function: &str) -> Value {
    let p = f.dir.path().join("verl_rewards.py");
    std::fs::write(&p, VERL_PY).unwrap();
    json!({"type": "python", "name": function, "path": p, "function": function,
           "python": f.py, "signature": "verl"})
}

fn verl_row(completion: &str, source: &str, gt: &str, bonus: f64) -> RewardInput {
    // Nested columns reach the rewards as their JSON text, as the data loader passes them.
    RewardInput::new("q", completion)
        .with_field("data_source", source)
        .with_field(
            "reward_model",
            json!({"ground_truth": gt, "style": "rule"}).to_string(),
        )
        .with_field(
            "extra_info",
            json!({"bonus": bonus, "index": 1}).to_string(),
        )
}

#[test]
fn verls_compute_score_is_called_per_completion_with_the_rows_ground_truth() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![verl_spec(&f, "compute_score")]).unwrap();
    let b = vec![
        verl_row("so #### 1,000", "openai/gsm8k", "1000", 0.0),
        verl_row("#### 7 then #### 8", "openai/gsm8k", "7", 0.0),
        verl_row("#### 3", "dict", "3", 0.25),
        verl_row("no answer", "dict", "3", 0.5),
    ];
    let out = set.score(&b).unwrap();
    assert_eq!(
        out.per_function[0],
        [Some(1.0), Some(0.0), Some(1.25), Some(0.5)]
    );
    // A dict's keys are logged as columns of its completion.
    let info = out.info[0][2].as_ref().unwrap();
    assert_eq!(info["acc"], json!(true));
    assert_eq!(info["pred"], json!("3"));
    assert_eq!(out.info[0][3].as_ref().unwrap()["pred"], Value::Null);
    // A plain `ground_truth` column serves when there is no `reward_model`.
    let row = RewardInput::new("q", "#### 4").with_field("ground_truth", "4");
    assert_eq!(set.score(&[row]).unwrap().per_function[0], [Some(1.0)]);
}

#[test]
fn verl_convention_failures_are_one_line() {
    let Some(f) = Fixture::new() else { return };
    let set = f.build(vec![verl_spec(&f, "compute_score")]).unwrap();
    let e = set.score(&[RewardInput::new("q", "#### 4")]).unwrap_err();
    assert!(one_line(&e).contains("no `reward_model` column"), "{e}");
    let set = f.build(vec![verl_spec(&f, "no_score")]).unwrap();
    let e = set.score(&[verl_row("x", "s", "1", 0.0)]).unwrap_err();
    assert!(one_line(&e).contains("without \"score\""), "{e}");
    let set = f.build(vec![verl_spec(&f, "trl_style")]).unwrap();
    let e = set.score(&[verl_row("x", "s", "1", 0.0)]).unwrap_err();
    assert!(one_line(&e).contains("once per completion"), "{e}");
}
