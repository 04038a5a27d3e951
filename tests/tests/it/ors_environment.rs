//! `[environment] type = "ors"`: grpo-rollout's client of Open Reward Standard servers
//! (`grpo_rollout::ors`) against a loopback ORS server (`grpo_tests::ors_server`), and a GRPO
//! run on it.
//!
//! With `ORS_URL` set the protocol tests run against that server instead:
//! `scripts/check_ors.sh` starts the `openreward` SDK's own server with the same two
//! environments (`scripts/ors_arith_server.py`) and runs them there. Assertions on what the
//! server counted (sessions, calls, resumed streams) need the loopback server and are skipped
//! then.

use std::path::Path;

use grpo_rollout::env::{AsyncEnvironment, Blocking, Environment};
use grpo_rollout::episode::{Episode, EpisodeEnd, Turn};
use grpo_rollout::ors::{
    OrsClient, OrsConfig, OrsEnvironment, SESSION_KEY, TaskSelection, task_rows,
};
use grpo_rollout::{ChatMessage, FinishReason};
use grpo_tests::ors_server::{OrsFault, OrsServer};
use serde_json::{Value, json};

/// The loopback server, or the one `ORS_URL` names.
struct Srv(Option<OrsServer>, String);

impl Srv {
    fn start() -> Self {
        match std::env::var("ORS_URL") {
            Ok(url) if !url.trim().is_empty() => Srv(None, url),
            _ => {
                let s = OrsServer::start().expect("loopback ORS server");
                let url = s.url();
                Srv(Some(s), url)
            }
        }
    }

    fn config(&self, env: &str) -> OrsConfig {
        OrsConfig {
            env_name: Some(env.into()),
            max_calls_per_turn: 8,
            ..OrsConfig::new(self.1.clone())
        }
    }
}

fn rt() -> tokio::runtime::Runtime {
    tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("tokio runtime")
}

fn call(name: &str, args: Value) -> String {
    format!(
        "<tool_call>{}</tool_call>",
        json!({ "name": name, "arguments": args })
    )
}

fn log(prompt: &str, turns: &[&str]) -> Vec<ChatMessage> {
    let mut m = vec![ChatMessage::new("user", prompt)];
    for (i, t) in turns.iter().enumerate() {
        if i > 0 {
            m.push(ChatMessage::new("tool", "(earlier)"));
        }
        m.push(ChatMessage::new("assistant", *t));
    }
    m
}

fn episode(prompt_index: usize, metadata: Value, messages: Vec<ChatMessage>) -> Episode {
    Episode {
        prompt_index,
        sample_index: 0,
        token_ids: Vec::new(),
        is_model_token: Vec::new(),
        logprobs: Vec::new(),
        turns: vec![Turn {
            model_tokens: 0..0,
            finish_reason: FinishReason::Eos,
            reward: 0.5,
            observation_tokens: 0..0,
        }],
        end: EpisodeEnd::Terminated,
        messages,
        unshown_observation: None,
        metadata,
        text: String::new(),
    }
}

/// Post-processes finished episodes with `metadata`: the environment closes their sessions.
fn close(env: &dyn Environment, metadata: impl IntoIterator<Item = Value>) {
    let mut eps: Vec<Episode> = metadata
        .into_iter()
        .map(|m| episode(0, m, Vec::new()))
        .collect();
    env.post_process(&mut eps)
        .expect("post_process closes the sessions");
}

#[test]
fn tasks_and_tools_come_from_the_server() {
    let srv = Srv::start();
    rt().block_on(async {
        let client = OrsClient::new(&srv.config("arith")).unwrap();
        let envs = client.list_environments().await.unwrap();
        assert_eq!(envs, ["arith", "arithfinal", "chat", "draw"]);
        assert_eq!(client.resolve_env(None).await.unwrap(), "arith");
        let e = client
            .resolve_env(Some("nope"))
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("no environment `nope`") && e.contains("arith, arithfinal, chat"),
            "{e}"
        );
        assert_eq!(client.num_tasks("arith", "train").await.unwrap(), 6);
        // The first four in one task_range request, as TRL's dataset rows.
        let rows = task_rows(&client, "arith", "train", &TaskSelection::First(4), true)
            .await
            .unwrap();
        assert_eq!(rows.len(), 4);
        assert_eq!(
            rows[3],
            json!({"prompt": [{"role": "user", "content": ""}], "task_index": 3, "ors_split": "train",
                   "a": 5, "b": 10, "level": "hard"})
        );
        // Scattered indices one by one; without metadata only prompt and index.
        let rows = task_rows(
            &client,
            "arith",
            "train",
            &TaskSelection::Indices(vec![5, 1]),
            false,
        )
        .await
        .unwrap();
        assert_eq!(rows[0]["task_index"], 5);
        assert_eq!(rows[1]["task_index"], 1);
        assert!(rows[0].get("a").is_none());
        let all = task_rows(&client, "arith", "test", &TaskSelection::All, true)
            .await
            .unwrap();
        assert_eq!(all.len(), 1);
        assert_eq!(all[0]["a"], 40);
        let e = task_rows(
            &client,
            "arith",
            "train",
            &TaskSelection::Indices(vec![6]),
            true,
        )
        .await
        .unwrap_err()
        .to_string();
        assert!(
            e.contains("task index 6 is out of range") && e.contains("6 tasks"),
            "{e}"
        );
        let e = client
            .num_tasks("arith", "valid")
            .await
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("/arith/num_tasks") && e.contains("HTTP 400") && e.contains("Invalid split"),
            "{e}"
        );

        // The tools the chat template renders, from a probe session's /task_tools.
        let env = OrsEnvironment::connect(&srv.config("arith")).await.unwrap();
        let tools = AsyncEnvironment::tools(&env);
        let names: Vec<&str> = tools
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap())
            .collect();
        assert_eq!(names, ["add", "boom", "submit"]);
        assert_eq!(tools[0]["type"], "function");
        assert_eq!(tools[0]["function"]["description"], "Adds two integers.");
        assert_eq!(
            tools[0]["function"]["parameters"]["required"],
            json!(["x", "y"])
        );
        // A tool without input gets an empty object schema.
        assert_eq!(tools[1]["function"]["parameters"]["type"], "object");
        assert!(env.tool_list().terminal_tool.is_none());
        let fin = OrsEnvironment::connect(&srv.config("arithfinal"))
            .await
            .unwrap();
        assert_eq!(AsyncEnvironment::tools(&fin).len(), 1);
        let t = fin.tool_list().terminal_tool.clone().unwrap();
        assert_eq!(
            (t.name.as_str(), t.arg.as_deref()),
            ("answer", Some("answer"))
        );
    });
    if let Some(s) = &srv.0 {
        // The two probe sessions were closed.
        assert_eq!(s.stats().created, 2);
        assert_eq!(s.live_sessions(), 0);
    }
}

#[test]
fn episodes_get_a_session_each_call_tools_in_it_and_close_it() {
    let srv = Srv::start();
    let env = Blocking::build(OrsEnvironment::connect(&srv.config("arith"))).unwrap();
    // Two prompts (tasks 2 and 0), two episodes each.
    let rows = [
        json!({"task_index": 2, "answer": "x"}),
        json!({"task_index": 0}),
    ];
    let resets = env.reset(&rows.iter().collect::<Vec<_>>(), 2).unwrap();
    assert_eq!(resets.len(), 2);
    let p0 = "What is 4 + 7? Use the `add` tool, then give the result to `submit`.";
    assert_eq!(resets[0].observation.as_deref(), Some(p0));
    assert_eq!(
        resets[1].observation.as_deref(),
        Some("What is 2 + 1? Use the `add` tool, then give the result to `submit`.")
    );
    // TRL's convention: the prompt's text goes after the last user message's.
    let mut messages = vec![ChatMessage::new("user", "")];
    resets[0].apply(&mut messages);
    assert_eq!(messages[0].content, p0);
    let mut sids = Vec::new();
    let mut metadata = Vec::new();
    for r in &resets {
        assert_eq!(r.episodes.len(), 2);
        for m in &r.episodes {
            sids.push(m[SESSION_KEY].as_str().unwrap().to_owned());
            metadata.push(m.clone());
        }
    }
    // The row's columns are kept beside the session.
    assert_eq!(metadata[0]["answer"], "x");
    let distinct: std::collections::BTreeSet<&String> = sids.iter().collect();
    assert_eq!(distinct.len(), 4);

    // Turn 1: a call, a right submission, an answer without a call, a tool that raises.
    let logs = [
        log(p0, &[&call("add", json!({"x": 4, "y": 7}))]),
        log(
            p0,
            &[&format!(
                "Sure. {}",
                call("submit", json!({"answer": "11"}))
            )],
        ),
        log("q", &["I do not know."]),
        log("q", &[&call("boom", json!({}))]),
    ];
    let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let m: Vec<&Value> = metadata.iter().collect();
    let r = env.step(&l, &m).unwrap();
    r.validate(4, "ors").unwrap();
    let obs = |i: usize| r.observations[i].as_ref().map(|o| o.content.clone());
    assert_eq!(obs(0).as_deref(), Some("11"));
    assert_eq!(r.observations[0].as_ref().unwrap().role, "tool");
    assert_eq!(
        r.observations[0].as_ref().unwrap().name.as_deref(),
        Some("add")
    );
    assert_eq!((r.rewards[0], r.terminateds[0]), (0.0, false));
    assert_eq!(obs(1).as_deref(), Some("correct"));
    assert_eq!((r.rewards[1], r.terminateds[1]), (1.0, true));
    assert_eq!(r.metadata[1]["_ors_finished"], true);
    assert_eq!(obs(2), None);
    assert_eq!((r.rewards[2], r.terminateds[2]), (0.0, true));
    assert_eq!(obs(3).as_deref(), Some("error: boom"));
    assert!(r.terminateds[3]);

    // Turn 2 of episode 0: a bad call, an unknown tool, bad input and a wrong answer, in order.
    let turn = format!(
        "{}{}{}{}",
        "<tool_call>{not json</tool_call>",
        call("nope", json!({})),
        call("add", json!({"x": "a"})),
        call("submit", json!({"answer": "12"}))
    );
    let logs = [log(p0, &[&call("add", json!({"x": 4, "y": 7})), &turn])];
    let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let r2 = env.step(&l, &[&metadata[0]]).unwrap();
    let text = r2.observations[0].as_ref().unwrap().content.clone();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 4, "{text}");
    assert!(lines[0].starts_with("error: "), "{text}");
    assert_eq!(lines[1], "error: 'nope' is not a valid tool");
    assert!(
        lines[2].starts_with("error: ") && lines[2].contains("validation"),
        "{text}"
    );
    assert_eq!(lines[3], "wrong");
    assert_eq!((r2.rewards[0], r2.terminateds[0]), (0.0, true));
    assert!(r2.observations[0].as_ref().unwrap().name.is_none());
    if let Some(s) = &srv.0 {
        // The episodes' calls run at once (any order between episodes); turn 2 after them.
        let calls = s.stats().calls;
        let mut first: Vec<&str> = calls[..3].iter().map(String::as_str).collect();
        first.sort_unstable();
        assert_eq!(first, ["add", "boom", "submit"]);
        assert_eq!(calls[3..], ["add", "submit"]);
    }

    // post_process: the tool metrics, and every session closed.
    let mut episodes: Vec<Episode> = metadata
        .iter()
        .zip(&logs_all(p0))
        .enumerate()
        .map(|(i, (m, l))| episode(i / 2, m.clone(), l.clone()))
        .collect();
    episodes[1].metadata["_ors_finished"] = json!(true);
    let metrics = env.post_process(&mut episodes).unwrap();
    assert_eq!(metrics["ors_finished_ratio"], 0.25);
    assert_eq!(metrics["ors_close_failures"], 0.0);
    assert_eq!(metrics["tool_calls_mean"], 0.75);
    if let Some(s) = &srv.0 {
        assert_eq!(s.live_sessions(), 0);
        // The probe session, then the four episodes'.
        assert_eq!(s.stats().created, 5);
        assert_eq!(s.stats().deleted, 5);
    }
}

/// The four episodes' transcripts for post_process.
fn logs_all(p0: &str) -> Vec<Vec<ChatMessage>> {
    vec![
        log(p0, &[&call("add", json!({"x": 4, "y": 7}))]),
        log(p0, &[&call("submit", json!({"answer": "11"}))]),
        log("q", &["I do not know."]),
        log("q", &[&call("boom", json!({}))]),
    ]
}

#[test]
fn a_terminal_tool_grades_a_plain_answer() {
    let srv = Srv::start();
    let env = Blocking::build(OrsEnvironment::connect(&srv.config("arithfinal"))).unwrap();
    let rows = [json!({"task_index": 1})];
    let resets = env.reset(&[&rows[0]], 4).unwrap();
    assert_eq!(
        resets[0].observation.as_deref(),
        Some("What is 3 + 4? Answer with the number.")
    );
    let logs = [
        log("q", &["  7 "]),
        log("q", &["8"]),
        log("q", &[&call("add", json!({"x": 3, "y": 4}))]),
        log("q", &["3 + 4 = 7."]),
    ];
    let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let m: Vec<&Value> = resets[0].episodes.iter().collect();
    let r = env.step(&l, &m).unwrap();
    assert_eq!(r.rewards, [1.0, 0.0, 0.0, 1.0]);
    assert_eq!(r.terminateds, [true, true, false, true]);
    assert_eq!(r.observations[0], None);
    assert_eq!(r.observations[2].as_ref().unwrap().content, "7");
    close(&env, m.iter().map(|m| (*m).clone()));
    if let Some(s) = &srv.0 {
        let mut calls = s.stats().calls;
        calls.sort_unstable();
        assert_eq!(calls, ["add", "answer", "answer", "answer"]);
        assert_eq!(s.live_sessions(), 0);
    }
}

#[test]
fn sessions_of_one_task_that_give_different_prompts_start_their_own_episodes() {
    let srv = Srv::start();
    let env = Blocking::build(OrsEnvironment::connect(&srv.config("draw"))).unwrap();
    let rows = [json!({"task_index": 1}), json!({"task_index": 0})];
    let resets = env.reset(&rows.iter().collect::<Vec<_>>(), 3).unwrap();
    let client = OrsClient::new(&srv.config("draw")).unwrap();
    let rt = rt();
    let mut metadata = Vec::new();
    for (r, sum) in resets.iter().zip(["3 + 4", "2 + 1"]) {
        assert!(!r.is_shared());
        assert_eq!((r.episode_starts.len(), r.episodes.len()), (3, 3));
        let texts: std::collections::BTreeSet<&str> = r
            .episode_starts
            .iter()
            .map(|s| s.observation.as_deref().unwrap())
            .collect();
        assert_eq!(texts.len(), 3, "{texts:?}");
        for (start, m) in r.episode_starts.iter().zip(&r.episodes) {
            let t = start.observation.as_deref().unwrap();
            assert!(
                t.starts_with("Draw ") && t.contains(&format!("what is {sum}?")),
                "{t}"
            );
            // Each episode starts from its own session's prompt.
            let sid = m[SESSION_KEY].as_str().unwrap();
            assert_eq!(rt.block_on(client.prompt("draw", sid)).unwrap(), t);
            metadata.push(m.clone());
        }
    }
    close(&env, metadata);
    if let Some(s) = &srv.0 {
        assert_eq!(s.live_sessions(), 0);
    }
}

#[test]
fn a_conversation_prompt_keeps_its_roles() {
    let srv = Srv::start();
    let env = Blocking::build(OrsEnvironment::connect(&srv.config("chat"))).unwrap();
    let resets = env.reset(&[&json!({"task_index": 2})], 2).unwrap();
    let r = &resets[0];
    assert_eq!(r.observation, None);
    let got: Vec<(&str, &str)> = r
        .messages
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(
        got,
        [
            ("system", "You add numbers."),
            ("user", "a = 4, b = 7."),
            (
                "assistant",
                "<think>easy</think>\nLet me add.\n<tool_call>{\"name\":\"add\",\"arguments\":{\"x\":4,\"y\":7}}</tool_call>"
            ),
            ("user", "11\nWhat is a + b?"),
        ]
    );
    // The dataset's empty user message gives way to the conversation.
    let mut messages = vec![ChatMessage::new("user", "")];
    r.apply(&mut messages);
    assert_eq!(messages.len(), 4);
    assert_eq!(messages[0].role, "system");
    // The model's plain answer is graded by the terminal tool.
    let logs = [log("q", &["It is 11."]), log("q", &["12"])];
    let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let m: Vec<&Value> = r.episodes.iter().collect();
    let out = env.step(&l, &m).unwrap();
    assert_eq!(out.rewards, [1.0, 0.0]);
    close(&env, m.iter().map(|m| (*m).clone()));
    if let Some(s) = &srv.0 {
        assert_eq!(s.stats().messages, 2);
        assert_eq!(s.live_sessions(), 0);
    }
}

#[test]
fn a_server_without_messages_gives_the_prompt_text() {
    let Some(server) = OrsServer::start().ok() else {
        return;
    };
    let cfg = OrsConfig {
        env_name: Some("arith".into()),
        ..OrsConfig::new(server.url())
    };
    let env = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    // An older server: /messages is not found once, and not asked again.
    server.push_fault("/messages", OrsFault::Status(404));
    let want = "What is 3 + 4? Use the `add` tool, then give the result to `submit`.";
    for _ in 0..2 {
        let r = env.reset(&[&json!({"task_index": 1})], 1).unwrap();
        assert_eq!(r[0].observation.as_deref(), Some(want));
        assert!(r[0].messages.is_empty());
        close(&env, r[0].episodes.clone());
    }
    assert_eq!(server.stats().messages, 0);
    // A one-message conversation is the prompt text, as before; switched off, none is asked.
    let env = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    let r = env.reset(&[&json!({"task_index": 1})], 1).unwrap();
    assert_eq!(r[0].observation.as_deref(), Some(want));
    assert_eq!(server.stats().messages, 1);
    let cfg = OrsConfig {
        prompt_messages: false,
        ..cfg
    };
    let off = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    let r2 = off.reset(&[&json!({"task_index": 1})], 1).unwrap();
    assert_eq!(r2[0].observation.as_deref(), Some(want));
    assert_eq!(server.stats().messages, 1);
    close(&env, r[0].episodes.clone());
    close(&off, r2[0].episodes.clone());
    assert_eq!(server.live_sessions(), 0);
}

#[test]
fn group_scores_add_to_the_last_turn() {
    let srv = Srv::start();
    let mut cfg = srv.config("arith");
    cfg.score_group = true;
    cfg.score_group_weight = 2.0;
    let env = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    let rows = [json!({"task_index": 0}), json!({"task_index": 2})];
    let resets = env.reset(&rows.iter().collect::<Vec<_>>(), 2).unwrap();
    // Task 0 is 2 + 1 = 3, task 2 is 4 + 7 = 11.
    let answers = [["It is 3.", "It is 4."], ["11", "I give up"]];
    let mut eps = Vec::new();
    for (p, r) in resets.iter().enumerate() {
        for (j, m) in r.episodes.iter().enumerate() {
            let mut messages = vec![
                ChatMessage::new("user", "q"),
                ChatMessage::new("assistant", call("add", json!({"x": 1, "y": 2}))),
                ChatMessage::new("tool", "3"),
                ChatMessage::new("assistant", answers[p][j]),
            ];
            if j == 1 {
                // Only the last assistant turn counts: an earlier right one does not.
                messages[1] = ChatMessage::new("assistant", "3 or 11");
            }
            eps.push(episode(p, m.clone(), messages));
        }
    }
    env.post_process(&mut eps).unwrap();
    let rewards: Vec<f32> = eps.iter().map(|e| e.turns[0].reward).collect();
    assert_eq!(rewards, [2.5, 0.5, 2.5, 0.5]);
    if let Some(s) = &srv.0 {
        assert_eq!(s.stats().group_scores, 2);
        assert_eq!(s.live_sessions(), 0);
    }
    // An environment that does not score groups is refused at connection.
    let mut cfg = srv.config("arithfinal");
    cfg.score_group = true;
    let e = rt()
        .block_on(OrsEnvironment::connect(&cfg))
        .unwrap_err()
        .to_string();
    assert!(e.contains("does not score groups"), "{e}");
}

#[test]
fn secrets_reach_the_session_from_the_environment_variable_named() {
    let Ok(home) = std::env::var("HOME") else {
        return;
    };
    let srv = Srv::start();
    let mut cfg = srv.config("arith");
    cfg.secrets.insert("token".into(), "HOME".into());
    let env = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    let resets = env.reset(&[&json!({"task_index": 0})], 1).unwrap();
    let text = resets[0].observation.clone().unwrap();
    assert!(text.ends_with(&format!("(token {home})")), "{text}");
    if let Some(s) = &srv.0 {
        assert_eq!(s.stats().secrets.last().unwrap()["token"], home);
    }
    close(&env, resets[0].episodes.clone());
    // A secret whose variable is not set is refused, naming both.
    cfg.secrets
        .insert("key".into(), "GRPO_TEST_UNSET_VARIABLE_41".into());
    let e = OrsClient::new(&cfg).unwrap_err().to_string();
    assert!(
        e.contains("environment.ors.secrets.key") && e.contains("GRPO_TEST_UNSET_VARIABLE_41"),
        "{e}"
    );
}

#[test]
fn bad_rows_and_bad_servers_fail_in_one_line() {
    let srv = Srv::start();
    let env = Blocking::build(OrsEnvironment::connect(&srv.config("arith"))).unwrap();
    let e = env
        .reset(&[&json!({"prompt": "p"})], 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("prompt 0") && e.contains("`task_index`") && e.contains("`task_spec`"),
        "{e}"
    );
    let e = env
        .reset(&[&json!({"task_index": "two"})], 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("must hold a task index"), "{e}");
    let e = env
        .reset(&[&json!({"task_index": 99})], 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("POST /create") && e.contains("Invalid index"),
        "{e}"
    );
    // A row naming its split (an eval split beside the config's).
    let r = env
        .reset(&[&json!({"task_index": 0, "ors_split": "test"})], 1)
        .unwrap();
    assert!(
        r[0].observation
            .as_deref()
            .unwrap()
            .starts_with("What is 40 + 2?")
    );
    close(&env, r[0].episodes.clone());
    // A task spec given whole.
    let spec = json!({"task_spec": "{\"a\": 20, \"b\": 22}"});
    let r = env.reset(&[&spec], 1).unwrap();
    assert!(
        r[0].observation
            .as_deref()
            .unwrap()
            .starts_with("What is 20 + 22?")
    );
    close(&env, r[0].episodes.clone());
    // A step without reset names the cause.
    let logs = [log("q", &["hi"])];
    let e = env
        .step(&[logs[0].as_slice()], &[&json!({})])
        .unwrap_err()
        .to_string();
    assert!(e.contains("no ORS session"), "{e}");
    if let Some(s) = &srv.0 {
        assert_eq!(s.live_sessions(), 0);
    }
    // Nobody listening: the server and the route in one line, after the retries.
    let closed = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let url = format!("http://{}", closed.local_addr().unwrap());
    drop(closed);
    let cfg = OrsConfig {
        max_retries: 1,
        ..OrsConfig::new(url.clone())
    };
    let e = rt()
        .block_on(OrsEnvironment::connect(&cfg))
        .unwrap_err()
        .to_string();
    let first = e.lines().next().unwrap_or_default();
    assert!(
        first.contains(&url) && first.contains("GET /list_environments"),
        "{e}"
    );
    for (bad, key) in [
        (OrsConfig::new("localhost:8080"), "environment.ors.url"),
        (
            OrsConfig {
                timeout: 0.0,
                ..OrsConfig::new("http://x")
            },
            "environment.ors.timeout",
        ),
        (
            OrsConfig {
                max_concurrent: 0,
                ..OrsConfig::new("http://x")
            },
            "environment.ors.max_concurrent",
        ),
    ] {
        let e = bad.validate().unwrap_err().to_string();
        assert!(e.contains(key), "{e}");
    }
}

#[test]
fn broken_streams_resume_and_unavailable_answers_are_retried() {
    let Some(server) = OrsServer::start().ok() else {
        return;
    };
    let cfg = OrsConfig {
        env_name: Some("arith".into()),
        max_calls_per_turn: 8,
        ..OrsConfig::new(server.url())
    };
    server.push_fault("/create_session", OrsFault::Status(503));
    let env = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    let r = env.reset(&[&json!({"task_index": 3})], 1).unwrap();
    server.push_fault("/call", OrsFault::BreakAfterTaskId);
    let logs = [log("q", &[&call("add", json!({"x": 20, "y": 22}))])];
    let m = r[0].episodes[0].clone();
    let out = env.step(&[logs[0].as_slice()], &[&m]).unwrap();
    assert_eq!(out.observations[0].as_ref().unwrap().content, "42");
    let st = server.stats();
    // The tool ran once; its result came from the resumed stream.
    assert_eq!(st.calls, ["add"]);
    assert_eq!(st.resumed, 1);
    // A 500 is the environment's own error: not retried.
    server.push_fault("/create_session", OrsFault::Status(500));
    let e = env
        .reset(&[&json!({"task_index": 3})], 1)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("HTTP 500") && e.contains("injected fault"),
        "{e}"
    );
    close(&env, [m]);
    assert_eq!(server.live_sessions(), 0);
}

#[test]
fn open_sessions_are_kept_alive_until_closed() {
    let Some(server) = OrsServer::start().ok() else {
        return;
    };
    let cfg = OrsConfig {
        env_name: Some("arith".into()),
        ping_interval: 0.1,
        ..OrsConfig::new(server.url())
    };
    let env = Blocking::build(OrsEnvironment::connect(&cfg)).unwrap();
    let r = env.reset(&[&json!({"task_index": 1})], 2).unwrap();
    // Pings run between the calls, on the environment's runtime.
    std::thread::sleep(std::time::Duration::from_millis(550));
    let pinged = server.stats().pings;
    // About ten; at least one round even on a loaded machine.
    assert!(pinged >= 2, "{pinged} pings of 2 sessions in 0.55 s");
    close(&env, r[0].episodes.clone());
    let after = server.stats().pings;
    std::thread::sleep(std::time::Duration::from_millis(350));
    // Closed sessions are not pinged (one round may have been in flight).
    assert!(
        server.stats().pings <= after + 2,
        "{after} {:?}",
        server.stats()
    );
    let cfg = OrsConfig {
        ping_interval: -1.0,
        ..OrsConfig::new(server.url())
    };
    let e = cfg.validate().unwrap_err().to_string();
    assert!(e.contains("environment.ors.ping_interval"), "{e}");
}

fn write_tasks(url: &str, path: &Path) {
    let client = OrsClient::new(&OrsConfig::new(url)).expect("client");
    let rows = rt()
        .block_on(task_rows(
            &client,
            "arith",
            "train",
            &TaskSelection::All,
            true,
        ))
        .expect("task rows");
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(path, text).expect("tasks.jsonl");
}

#[test]
fn grpo_trains_on_an_ors_environment_and_closes_every_session() {
    use grpo_rollout::Arch;
    use grpo_rollout::init::{Preset, init_model_dir};
    let Some(server) = OrsServer::start().ok() else {
        return;
    };
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model");
    init_model_dir(&model, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    let data = dir.path().join("tasks.jsonl");
    write_tasks(&server.url(), &data);
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 2
max_completion_length = 6
[train]
prompts_per_step = 2
save_steps = 0
num_completions_to_print = 100
[environment]
type = "ors"
max_turns = 2
max_total_tokens = 60
[environment.ors]
url = "{url}"
env_name = "arith"
"#,
        out = dir.path().join("run").display(),
        model = model.display(),
        data = data.display(),
        url = server.url(),
    );
    let cfg: grpo_trainer::TrainConfig = toml::from_str(&text).unwrap();
    let mut t = grpo_trainer::GrpoTrainer::from_pretrained(&model, cfg).unwrap();
    let r = t
        .fit_with(grpo_trainer::FitOptions::default().max_steps(2))
        .unwrap();
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        for k in [
            "env/ors_finished_ratio",
            "env/tool_calls_mean",
            "rewards/env/mean",
        ] {
            assert!(
                m.get(k).is_some_and(|v| v.is_finite()),
                "{k} missing from {m:?}"
            );
        }
    }
    // The probe session, and one per episode (2 steps × 2 prompts × 2 episodes), all closed.
    let st = server.stats();
    assert_eq!(st.created, 1 + 8);
    assert_eq!(st.deleted, 9);
    assert_eq!(server.live_sessions(), 0);
    // The prompts the model saw are the server's, in the tools' template.
    let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("run/completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 8);
    for l in &lines {
        // The dataset's empty user message holds the task's prompt.
        let p = l["prompt"].as_str().unwrap();
        assert!(
            p.contains("<|im_start|>user\nWhat is ") && p.contains("Use the `add` tool"),
            "{p}"
        );
    }
}
