//! `grpo-cli data synth | inspect | bench` end to end, through the binary.

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
