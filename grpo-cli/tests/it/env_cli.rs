//! `grpo-cli env`: scripted turns against a config's environment, without a model.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use serde_json::Value;

const LOCK_PY: &str = r#"
class Lock:
    def reset(self, answer, **kwargs):
        self.code, self.open = str(answer), False
        return " Open the lock with `try_code`."

    def try_code(self, code: str) -> str:
        """Tries a code on the lock.

        Args:
            code: the code to try
        """
        self.open = code.strip() == self.code
        return "open" if self.open else "closed"

    def get_reward(self):
        return 1.0 if self.open else 0.0
"#;

fn python3() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "pass"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping: no python3");
    }
    ok
}

fn cli(dir: &Path, args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .current_dir(dir)
        .output()
        .unwrap()
}

fn call(code: &str) -> String {
    format!(r#"<tool_call>{{"name": "try_code", "arguments": {{"code": "{code}"}}}}</tool_call>"#)
}

#[test]
fn env_plays_scripted_turns_against_a_factory_class() {
    if !python3() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init_model_dir(&d.join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    // A template that renders the tools' names.
    let cfg_path = d.join("model/tokenizer_config.json");
    let mut tc: Value = serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let template = tc["chat_template"].as_str().unwrap().to_owned();
    tc["chat_template"] = Value::String(format!(
        "{{% if tools %}}[tools:{{% for t in tools %}} {{{{ t.function.name }}}}{{% endfor %}}]{{% endif %}}{template}"
    ));
    std::fs::write(&cfg_path, tc.to_string()).unwrap();
    std::fs::write(d.join("lock.py"), LOCK_PY).unwrap();
    std::fs::write(
        d.join("rows.jsonl"),
        "{\"prompt\": [{\"role\": \"user\", \"content\": \"A lock.\"}], \"answer\": 7}\n\
         {\"prompt\": [{\"role\": \"user\", \"content\": \"Another.\"}], \"answer\": 3}\n",
    )
    .unwrap();
    std::fs::write(
        d.join("env.toml"),
        "[model]\npath = \"model\"\n[data]\npath = [\"rows.jsonl\"]\n[environment]\ntype = \"factory\"\n[environment.python]\npath = \"lock.py\"\nclass = \"Lock\"\n",
    )
    .unwrap();
    std::fs::write(d.join("turns.jsonl"), "\"I give up.\"\n\"never sent\"\n").unwrap();
    let (wrong, right) = (call("1"), call("3"));
    let args = [
        "env",
        "--config",
        "env.toml",
        "--row",
        "1",
        "--turn",
        &wrong,
        "--turn",
        &right,
        "--turns-file",
        "turns.jsonl",
    ];
    let out = cli(d, &[&args[..], &["--json"]].concat());
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(p["environment"], "Lock");
    assert_eq!(p["row"]["answer"], 3);
    assert_eq!(p["tools"], serde_json::json!(["try_code"]));
    assert_eq!(
        p["messages"][0]["content"],
        "Another. Open the lock with `try_code`."
    );
    let rendered = p["rendered"].as_str().unwrap();
    assert!(
        rendered.starts_with(
            "[tools: try_code]<|im_start|>user\nAnother. Open the lock with `try_code`.<|im_end|>"
        ),
        "{rendered}"
    );
    let turns = p["turns"].as_array().unwrap();
    assert_eq!(turns.len(), 3);
    assert_eq!(turns[0]["observation"]["content"], "closed");
    assert_eq!(turns[1]["observation"]["content"], "open");
    // A turn without a call ends the episode; the file's second turn is not sent.
    assert_eq!(turns[2]["terminated"], true);
    assert_eq!(p["unused_turns"], 1);
    // get_reward() goes to the last turn: the lock is open.
    assert_eq!(p["rewards"], serde_json::json!([0.0, 0.0, 1.0]));
    assert_eq!(p["reward"], 1.0);
    assert_eq!(p["metrics"]["get_reward_mean"], 1.0);

    // The text form.
    let out = cli(d, &args);
    let text = String::from_utf8_lossy(&out.stdout);
    assert!(out.status.success());
    for want in [
        "environment: Lock",
        "--- turn 2",
        "[tool] open",
        "1 turn(s) not sent",
        "env reward 1",
    ] {
        assert!(text.contains(want), "{want:?} in {text}");
    }

    // A row past the data, and a config without an environment: one line each.
    let out = cli(d, &["env", "--config", "env.toml", "--row", "5"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("--row 5: the training data has 2 rows"),
        "{e}"
    );
    std::fs::write(d.join("none.toml"), "[model]\npath = \"model\"\n[data]\npath = [\"rows.jsonl\"]\n[[rewards]]\ntype = \"accuracy\"\n").unwrap();
    let out = cli(d, &["env", "--config", "none.toml"]);
    let e = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && e.contains("no `[environment] type`"),
        "{e}"
    );
}

/// configs/quiz.toml: an environment that owns its data plays from an empty prompt.
#[test]
fn env_plays_the_quiz_example_without_data() {
    if !python3() {
        return;
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    let model = format!("model.path=\"{}\"", dir.path().join("model").display());
    let turn = r#"<tool_call>{"name": "answer", "arguments": {"value": 99}}</tool_call>"#;
    let out = cli(
        &root,
        &[
            "env",
            "--config",
            "configs/quiz.toml",
            "--set",
            &model,
            "--turn",
            turn,
            "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    let question = p["messages"][0]["content"].as_str().unwrap();
    assert!(
        question.starts_with("What is ") && question.ends_with("Answer with `answer`."),
        "{question}"
    );
    assert_eq!(p["turns"][0]["observation"]["content"], "wrong");
    assert_eq!(p["reward"], 0.0);
}

/// An ORS environment: the session's prompt, its tools and rewards, every session deleted.
#[test]
fn env_plays_an_ors_environment_and_closes_its_sessions() {
    let server = grpo_tests::ors_server::OrsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    init_model_dir(&d.join("model"), Preset::Tiny, Arch::Qwen2, 1).unwrap();
    std::fs::write(
        d.join("tasks.jsonl"),
        "{\"prompt\": [{\"role\": \"user\", \"content\": \"\"}], \"task_index\": 2}\n",
    )
    .unwrap();
    std::fs::write(
        d.join("ors.toml"),
        format!(
            "[model]\npath = \"model\"\n[data]\npath = [\"tasks.jsonl\"]\n[environment]\ntype = \"ors\"\nmax_turns = 3\n[environment.ors]\nurl = \"{}\"\nenv_name = \"arith\"\n",
            server.url()
        ),
    )
    .unwrap();
    let add = r#"<tool_call>{"name": "add", "arguments": {"x": 4, "y": 7}}</tool_call>"#;
    let submit = r#"<tool_call>{"name": "submit", "arguments": {"answer": "11"}}</tool_call>"#;
    let out = cli(
        d,
        &[
            "env", "--config", "ors.toml", "--turn", add, "--turn", submit, "--json",
        ],
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let p: Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(
        p["messages"][0]["content"],
        "What is 4 + 7? Use the `add` tool, then give the result to `submit`."
    );
    let mut tools: Vec<&str> = p["tools"]
        .as_array()
        .unwrap()
        .iter()
        .map(|t| t.as_str().unwrap())
        .collect();
    tools.sort_unstable();
    assert_eq!(tools, ["add", "boom", "submit"]);
    assert_eq!(p["turns"][0]["observation"]["content"], "11");
    assert_eq!(p["turns"][1]["terminated"], true);
    assert_eq!(p["reward"], 1.0);
    // The probe session and the episode's: both deleted.
    assert_eq!(server.live_sessions(), 0);
    assert_eq!((server.stats().created, server.stats().deleted), (2, 2));
}
