//! Every format round-trips: written with the Arrow writers, read back equal.

use crate::common;

use common::*;
use grpo_data::arrow::ipc::writer::StreamWriter;
use grpo_data::{Dataset, Format, OpenOptions, Prompt, Value};

fn round_trip(name: &str, with_list: bool) {
    let dir = tmp();
    let batches = vec![typed_batch(0, 7, with_list), typed_batch(7, 6, with_list)];
    let path = write(&dir.path().join(name), batches);
    // Small chunks so that reading crosses chunk and batch boundaries.
    let d = Dataset::open(&[path.to_string_lossy()], &opts(4)).expect("open");
    assert_eq!(d.len(), 13, "{name}");
    assert_eq!(read_all(&d), typed_expected(0, 13, with_list), "{name}");
}

#[test]
fn parquet_round_trips() {
    round_trip("t.parquet", true);
}

#[test]
fn arrow_ipc_file_round_trips() {
    round_trip("t.arrow", true);
    round_trip("t.feather", true);
}

#[test]
fn arrow_ipc_stream_round_trips() {
    let dir = tmp();
    let path = dir.path().join("s.ipc");
    let b1 = typed_batch(0, 5, true);
    let file = std::fs::File::create(&path).expect("create");
    let mut w = StreamWriter::try_new(file, &b1.schema()).expect("writer");
    w.write(&b1).expect("write");
    w.write(&typed_batch(5, 4, true)).expect("write");
    w.finish().expect("finish");
    let d = Dataset::open(&[path.to_string_lossy()], &opts(3)).expect("open");
    assert_eq!(read_all(&d), typed_expected(0, 9, true));
}

#[test]
fn jsonl_round_trips_plain_gz_zst() {
    for name in ["t.jsonl", "t.jsonl.gz", "t.jsonl.zst"] {
        round_trip(name, true);
    }
}

#[test]
fn csv_round_trips() {
    // CSV has no lists; empty cells read as null.
    round_trip("t.csv", false);
}

#[test]
fn conversation_prompts_round_trip_parquet_and_jsonl() {
    for name in ["c.parquet", "c.jsonl", "c.arrow"] {
        let dir = tmp();
        let path = write(&dir.path().join(name), vec![conversation_batch(5)]);
        let d = open(&path).expect("open");
        assert_eq!(read_all(&d), conversation_expected(5), "{name}");
        assert!(d.conversation_prompts(), "{name}");
        let text = write(
            &dir.path().join(format!("t-{name}")),
            vec![typed_batch(0, 3, false)],
        );
        assert!(!open(&text).expect("open").conversation_prompts(), "{name}");
    }
}

#[test]
fn jsonl_hand_written_values_and_blank_lines() {
    let dir = tmp();
    let path = write_text(
        &dir.path().join("h.jsonl"),
        concat!(
            r#"{"prompt": "a", "answer": "1", "k": 2, "x": 1.5, "ok": true, "tags": ["p", "q"], "z": null, "o": {"u": 1}}"#,
            "\n\n",
            r#"{"prompt": [{"role": "user", "content": "hi"}], "answer": 3}"#,
            "\n",
        ),
    );
    let d = open(&path).expect("open");
    assert_eq!(d.len(), 2);
    let s = read_all(&d);
    assert_eq!(s[0].prompt, Prompt::Text("a".into()));
    assert_eq!(s[0].get("answer"), Some(&Value::Str("1".into())));
    assert_eq!(s[0].get("k"), Some(&Value::Int(2)));
    assert_eq!(s[0].get("x"), Some(&Value::Float(1.5)));
    assert_eq!(s[0].get("ok"), Some(&Value::Bool(true)));
    assert_eq!(
        s[0].get("tags"),
        Some(&Value::StrList(vec!["p".into(), "q".into()]))
    );
    assert_eq!(s[0].get("z"), Some(&Value::Null));
    assert_eq!(s[0].get("o"), Some(&Value::Str(r#"{"u":1}"#.into())));
    assert!(matches!(s[1].prompt, Prompt::Conversation(ref m) if m[0].content == "hi"));
    assert_eq!(s[1].get_text("answer").as_deref(), Some("3"));
    assert_eq!(s[1].index, 1);
}

#[test]
fn directory_and_glob_of_shards_read_as_one_dataset() {
    let dir = tmp();
    let sub = dir.path().join("data");
    std::fs::create_dir(&sub).expect("mkdir");
    write(
        &sub.join("train-00000.parquet"),
        vec![typed_batch(0, 4, true)],
    );
    write(
        &sub.join("train-00001.parquet"),
        vec![typed_batch(4, 3, true)],
    );
    write_text(&sub.join("README.md"), "not data");
    let by_dir = Dataset::open(&[sub.to_string_lossy()], &opts(2)).expect("dir");
    assert_eq!(by_dir.files().len(), 2);
    assert_eq!(read_all(&by_dir), typed_expected(0, 7, true));
    let pattern = format!("{}/train-*.parquet", sub.display());
    let by_glob = Dataset::open(&[pattern], &OpenOptions::default()).expect("glob");
    assert_eq!(read_all(&by_glob), typed_expected(0, 7, true));
}

#[test]
fn explicit_format_overrides_extension() {
    let dir = tmp();
    let path = write(
        &dir.path().join("t.jsonl.gz"),
        vec![typed_batch(0, 3, true)],
    );
    let renamed = dir.path().join("t.data");
    std::fs::rename(&path, &renamed).expect("rename");
    let o = OpenOptions {
        format: Some(Format::Jsonl),
        ..Default::default()
    };
    let d = Dataset::open(&[renamed.to_string_lossy()], &o).expect("open");
    assert_eq!(read_all(&d), typed_expected(0, 3, true));
}

#[test]
fn require_column_checks_answer_field() {
    let dir = tmp();
    let path = write(&dir.path().join("t.parquet"), vec![typed_batch(0, 3, true)]);
    let d = open(&path).expect("open");
    d.require_column("answer", "accuracy").expect("has answer");
    let e = d
        .require_column("solution", "accuracy")
        .expect_err("no solution");
    let msg = e.to_string();
    assert!(
        msg.contains("no column `solution` needed by accuracy"),
        "{msg}"
    );
    assert!(msg.contains("prompt, answer, n"), "{msg}");
}
