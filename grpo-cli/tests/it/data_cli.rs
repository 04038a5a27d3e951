//! `grpo-cli data synth | inspect | bench | ors-tasks` end to end, through the binary.

use std::process::Command;

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .output()
        .expect("run grpo-cli");
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn synth_then_inspect_then_bench() {
    let dir = tempfile::tempdir().expect("tmp");
    for ext in ["parquet", "jsonl"] {
        let file = dir.path().join(format!("math.{ext}"));
        let f = file.to_str().expect("utf8 path");
        let (code, out, err) = cli(&[
            "data",
            "synth",
            "arithmetic",
            "--n",
            "50",
            "--seed",
            "3",
            "--digits",
            "3",
            "--steps",
            "2",
            "--out",
            f,
        ]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("wrote 50 arithmetic problems"), "{out}");
        let (code, out, err) = cli(&["data", "inspect", f]);
        assert_eq!(code, 0, "{err}");
        assert!(out.contains("rows: 50"), "{out}");
        assert!(
            out.contains("prompt: Utf8") && out.contains("<- prompt"),
            "{out}"
        );
        assert!(out.contains("\"answer\":"), "{out}");
        assert!(out.contains("ok: ready for training"), "{out}");
        let (code, out, err) = cli(&["data", "bench", f, "--batch-size", "8"]);
        assert_eq!(code, 0, "{err}");
        assert!(
            out.contains("50 rows") && out.contains("rows/s") && out.contains("VmHWM"),
            "{out}"
        );
    }
}

#[test]
fn inspect_reports_bad_rows_and_exits_2() {
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("bad.jsonl");
    std::fs::write(
        &file,
        "{\"prompt\": \"a\", \"answer\": \"1\"}\n{\"prompt\": null, \"answer\": \"2\"}\n{\"prompt\": \"c\", \"answer\": null}\n",
    )
    .expect("write");
    let (code, out, err) = cli(&["data", "inspect", file.to_str().expect("utf8")]);
    assert_eq!(code, 2);
    assert!(
        out.contains("null prompt in column `prompt` at line 2"),
        "{out}"
    );
    assert!(
        out.contains("column `answer` is null in 1 of 3 rows"),
        "{out}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("1 of 3 rows cannot be trained on"), "{err}");
}

#[test]
fn errors_are_one_line_with_exit_code_2() {
    let (code, _, err) = cli(&["data", "inspect", "/nonexistent/x.parquet"]);
    assert_eq!(code, 2);
    assert_eq!(
        err.trim(),
        "error: /nonexistent/x.parquet: no such file, directory or matching glob"
    );
    let dir = tempfile::tempdir().expect("tmp");
    let out = dir.path().join("x.txt");
    let (code, _, err) = cli(&[
        "data",
        "synth",
        "arithmetic",
        "--out",
        out.to_str().expect("utf8"),
    ]);
    assert_eq!(code, 2);
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("unknown data format `.txt`"), "{err}");
}

#[test]
fn ors_tasks_writes_a_dataset_the_loader_reads() {
    let server = grpo_tests::ors_server::OrsServer::start().expect("loopback ORS server");
    let url = server.url();
    let dir = tempfile::tempdir().expect("tmp");
    let file = dir.path().join("tasks.jsonl");
    let f = file.to_str().expect("utf8 path");
    let (code, out, err) = cli(&[
        "data",
        "ors-tasks",
        "--url",
        &url,
        "--env",
        "arith",
        "--num-tasks",
        "4",
        "--out",
        f,
    ]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("wrote 4 tasks of split `train`"), "{out}");
    let rows: Vec<serde_json::Value> = std::fs::read_to_string(&file)
        .expect("read")
        .lines()
        .map(|l| serde_json::from_str(l).expect("json line"))
        .collect();
    assert_eq!(rows.len(), 4);
    assert_eq!(
        rows[1],
        serde_json::json!({"prompt": [{"role": "user", "content": ""}], "task_index": 1, "ors_split": "train",
                           "a": 3, "b": 4, "level": "easy"})
    );
    // The loader reads it: a conversation prompt and the task's columns.
    let (code, out, err) = cli(&["data", "inspect", f]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("task_index"), "{out}");
    // Chosen indices of another split, without the task specs' keys.
    let (code, _, err) = cli(&[
        "data",
        "ors-tasks",
        "--url",
        &url,
        "--split",
        "test",
        "--indices",
        "0",
        "--no-metadata",
        "--out",
        f,
    ]);
    assert_eq!(code, 0, "{err}");
    let text = std::fs::read_to_string(&file).expect("read");
    assert_eq!(
        text.trim(),
        r#"{"prompt":[{"role":"user","content":""}],"task_index":0,"ors_split":"test"}"#
    );
    // Failures in one line: a file type, an index out of range, an unknown environment.
    let (code, _, err) = cli(&["data", "ors-tasks", "--url", &url, "--out", "x.csv"]);
    assert_ne!(code, 0);
    assert!(err.contains("write a .jsonl file"), "{err}");
    let (code, _, err) = cli(&[
        "data",
        "ors-tasks",
        "--url",
        &url,
        "--indices",
        "0,6",
        "--out",
        f,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("task index 6 is out of range"), "{err}");
    let (code, _, err) = cli(&[
        "data",
        "ors-tasks",
        "--url",
        &url,
        "--env",
        "nope",
        "--out",
        f,
    ]);
    assert_ne!(code, 0);
    assert!(err.contains("no environment `nope`"), "{err}");
}
