//! `grpo-cli score`: a file of completions scored with a config's rewards, without training.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use serde_json::Value;

fn cli(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

const ROWS: &str = r#"{"prompt": [{"role": "user", "content": "What is half of one?"}], "completion": [{"role": "assistant", "content": "<think>1/2</think>The answer is $\\boxed{\\frac{1}{2}}$."}], "solution": "$0.5$"}
{"prompt": [{"role": "user", "content": "What is 2 + 3?"}], "completion": [{"role": "assistant", "content": "It is 5."}], "solution": "5"}
{"prompt": [{"role": "user", "content": "Name the set."}], "completion": [{"role": "assistant", "content": "<think>ok</think>\\boxed{\\{3, 1, 2\\}}"}], "solution": "$\\{1, 2, 3\\}$"}
{"prompt": [{"role": "user", "content": "Nothing to compare with."}], "completion": [{"role": "assistant", "content": "\\boxed{7}"}], "solution": "no number"}
"#;

#[test]
fn score_reads_a_file_and_reports_each_reward() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init_model_dir(&d.join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    std::fs::write(d.join("rows.jsonl"), ROWS).unwrap();
    std::fs::write(
        d.join("rewards.toml"),
        "[model]\npath = \"model\"\n[[rewards]]\ntype = \"math_verify\"\n[[rewards]]\ntype = \"think_format\"\nweight = 0.5\n\
         [[rewards]]\ntype = \"overlong\"\nmax_completion_length = 12\noverlong_buffer = 4\n",
    )
    .unwrap();
    let out = cli(
        d,
        &[
            "score",
            "--config",
            "rewards.toml",
            "--data",
            "rows.jsonl",
            "--out",
            "scored.jsonl",
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let summary: Value = serde_json::from_slice(&out.stdout).unwrap();
    // math_verify: right, no LaTeX answer, right, skipped (TRL's verdicts).
    assert_eq!(summary["math_verify"]["scored"], 3);
    assert!(
        (summary["math_verify"]["mean"].as_f64().unwrap() - 2.0 / 3.0).abs() < 1e-9,
        "{summary}"
    );
    assert_eq!(summary["think_format"]["mean"].as_f64(), Some(0.5));
    assert_eq!(summary["rows"], 4);
    let rows: Vec<Value> = std::fs::read_to_string(d.join("scored.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(rows.len(), 4);
    assert_eq!(rows[0]["rewards"]["math_verify"], 1.0);
    assert_eq!(rows[1]["rewards"]["math_verify"], 0.0);
    assert_eq!(rows[3]["rewards"]["math_verify"], Value::Null);
    assert_eq!(
        rows[0]["info"]["math_verify"]["answer_parsed"],
        "[1/2, \"\\\\frac{1}{2}\"]"
    );
    // Token counts from the model's tokenizer: the long first answer passes L_max − L_cache.
    let tok = grpo_rollout::loader::load_tokenizer(&d.join("model")).unwrap();
    let first = r"<think>1/2</think>The answer is $\boxed{\frac{1}{2}}$.";
    let n = tok.encode(first, false).unwrap().len() as f64;
    let want = if n <= 8.0 {
        0.0
    } else if n >= 12.0 {
        -1.0
    } else {
        (8.0 - n) / 4.0
    };
    assert_eq!(rows[0]["rewards"]["overlong"].as_f64(), Some(want));
    // The combined reward: the weighted sum of what scored.
    let r0 = rows[0]["rewards"].as_object().unwrap();
    let sum = r0["math_verify"].as_f64().unwrap()
        + 0.5 * r0["think_format"].as_f64().unwrap()
        + r0["overlong"].as_f64().unwrap();
    assert!((rows[0]["reward"].as_f64().unwrap() - sum).abs() < 1e-6);

    // The table.
    let out = cli(
        d,
        &["score", "--config", "rewards.toml", "--data", "rows.jsonl"],
    );
    let table = String::from_utf8(out.stdout).unwrap();
    assert!(
        table.contains("math_verify") && table.contains("3/4") && table.contains("(combined)"),
        "{table}"
    );
}

#[test]
fn score_names_what_is_missing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(
        d.join("rows.jsonl"),
        "{\"prompt\": \"q\", \"answer\": \"a\"}\n",
    )
    .unwrap();
    std::fs::write(
        d.join("r.toml"),
        "[model]\npath = \"nowhere\"\n[[rewards]]\ntype = \"math_verify\"\n",
    )
    .unwrap();
    let out = cli(d, &["score", "--config", "r.toml", "--data", "rows.jsonl"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("rows.jsonl") && e.contains("completion"), "{e}");
    std::fs::write(
        d.join("rows.jsonl"),
        "{\"prompt\": \"q\", \"completion\": \"\\\\boxed{1}\"}\n",
    )
    .unwrap();
    let out = cli(d, &["score", "--config", "r.toml", "--data", "rows.jsonl"]);
    assert_eq!(out.status.code(), Some(2));
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(e.contains("solution") && e.contains("math_verify"), "{e}");
    std::fs::write(d.join("r.toml"), "[model]\npath = \"nowhere\"\n").unwrap();
    let out = cli(d, &["score", "--config", "r.toml", "--data", "rows.jsonl"]);
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("[[rewards]]"));
}

/// A run's `completions.jsonl` carries each row's columns: scored again as it stands, it gives
/// the rewards the run logged.
#[test]
fn a_runs_completions_log_scores_as_logged() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init_model_dir(&d.join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"What is {i} + {i}? Put it in \\\\boxed{{}}.\", \"solution\": \"${}$\"}}\n", 2 * i))
        .collect();
    std::fs::write(d.join("rows.jsonl"), rows).unwrap();
    std::fs::write(
        d.join("run.toml"),
        "output_dir = \"run\"\n[model]\npath = \"model\"\n[data]\npath = [\"rows.jsonl\"]\n\
         [rollout]\nnum_generations = 2\nmax_completion_length = 12\nchat_template = false\n\
         [train]\nmax_steps = 2\nprompts_per_step = 4\nlog_completions = true\nnum_completions_to_print = 8\n\
         [[rewards]]\ntype = \"math_verify\"\n[[rewards]]\ntype = \"overlong\"\nmax_completion_length = 12\noverlong_buffer = 6\n",
    )
    .unwrap();
    let run = cli(d, &["train", "--config", "run.toml"]);
    assert!(
        run.status.success(),
        "{}",
        String::from_utf8_lossy(&run.stderr)
    );
    let log = d.join("run/completions.jsonl");
    let logged: Vec<Value> = std::fs::read_to_string(&log)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(logged.len(), 16);
    assert!(
        logged.iter().all(|l| l["solution"].is_string()),
        "{:?}",
        logged[0]
    );
    let out = cli(
        d,
        &[
            "score",
            "--config",
            "run.toml",
            "--data",
            "run/completions.jsonl",
            "--out",
            "again.jsonl",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let again: Vec<Value> = std::fs::read_to_string(d.join("again.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for (a, b) in logged.iter().zip(&again) {
        assert_eq!(a["rewards"], b["rewards"], "{a} / {b}");
    }
}
