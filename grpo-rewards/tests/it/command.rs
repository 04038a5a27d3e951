//! `type = "command"` with real programs: `sh`, `true`, `yes`, `sleep`, and python3 when present.
#![cfg(all(unix, feature = "command"))]
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeMap;
use std::path::Path;
use std::process::Command;
use std::time::{Duration, Instant};

use grpo_rewards::command::{CommandConfig, CommandReward, CommandScore};
use grpo_rewards::{FieldValue, Reward, RewardInput, RewardOutput, RewardsConfig, ScoringModels};

fn config(argv: &[&str]) -> CommandConfig {
    CommandConfig {
        argv: argv.iter().map(|s| (*s).to_owned()).collect(),
        ..CommandConfig::default()
    }
}

/// `sh -c SCRIPT sh ARGS...`: `$1`... are the (placeholder) arguments.
fn sh(script: &str, args: &[&str]) -> CommandConfig {
    let mut argv = vec!["sh", "-c", script, "sh"];
    argv.extend_from_slice(args);
    config(&argv)
}

fn batch(completions: &[&str]) -> Vec<RewardInput> {
    completions
        .iter()
        .map(|c| RewardInput::new("the prompt", *c))
        .collect()
}

fn score(c: CommandConfig, inputs: &[RewardInput]) -> RewardOutput {
    CommandReward::new(c, "cmd").unwrap().score(inputs).unwrap()
}

fn counter(out: &RewardOutput, what: &str) -> f64 {
    out.counters[&format!("rewards/cmd/{what}")]
}

fn status(out: &RewardOutput, i: usize) -> &str {
    out.info[i].as_ref().unwrap()["status"].as_str().unwrap()
}

fn python() -> bool {
    let ok = Command::new("python3")
        .args(["-c", "pass"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping the python3 part: python3 is not available");
    }
    ok
}

#[test]
fn exit_status_scores_one_for_success_and_zero_otherwise() {
    let out = score(
        sh(r#"test "$1" = good"#, &["{completion}"]),
        &batch(&["good", "bad", "good"]),
    );
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0), Some(1.0)]);
    assert_eq!(counter(&out, "failures"), 0.0);
    assert_eq!(counter(&out, "timeouts"), 0.0);
    let info = out.info[1].as_ref().unwrap();
    assert_eq!(info["status"], "ok");
    assert_eq!(info["exit_code"], 1);
    // `true` and `false` themselves, the completion on their (unread) stdin.
    for (program, want) in [("true", 1.0), ("false", 0.0)] {
        let c = CommandConfig {
            stdin: true,
            ..config(&[program])
        };
        assert_eq!(score(c, &batch(&["x"])).scores, vec![Some(want)]);
    }
}

#[test]
fn stdout_scores_are_the_last_non_empty_line() {
    let c = CommandConfig {
        score: CommandScore::Stdout,
        ..sh(r#"echo noise; echo "$1"; echo; echo"#, &["{completion}"])
    };
    let out = score(c.clone(), &batch(&["0.25", "-3", "not a number"]));
    assert_eq!(out.scores, vec![Some(0.25), Some(-3.0), None]);
    assert_eq!(status(&out, 2), "unparseable");
    assert_eq!(counter(&out, "failures"), 1.0);
    // on_failure gives failures a score.
    let out = score(
        CommandConfig {
            on_failure: Some(-1.0),
            ..c
        },
        &batch(&["oops"]),
    );
    assert_eq!(out.scores, vec![Some(-1.0)]);
    // A program that prints a number but exits non-zero failed.
    let c = CommandConfig {
        score: CommandScore::Stdout,
        ..sh(r#"echo 1; echo "$1" >&2; exit 3"#, &["{completion}"])
    };
    let out = score(c, &batch(&["traceback"]));
    assert_eq!(out.scores, vec![None]);
    let info = out.info[0].as_ref().unwrap();
    assert_eq!(info["status"], "exit_code");
    assert_eq!(info["exit_code"], 3);
    assert_eq!(info["stderr"], "traceback");
}

#[test]
fn argv_placeholders_fill_the_prompt_the_completion_and_columns() {
    let c = sh(
        r#"test "$1" = "the prompt" && test "$2" = "--code=C" && test "$3" = 42 \
           && test "$4" = "$(printf 'assert a\nassert b')" && test "$5" = "{{literal}} {'k': 1}""#,
        &[
            "{prompt}",
            "--code={completion}",
            "{answer}",
            "{tests}",
            "{{literal}} {'k': 1}",
        ],
    );
    let x = RewardInput::new("the prompt", "C")
        .with_field("answer", 42i64)
        .with_field(
            "tests",
            FieldValue::StrList(vec!["assert a".into(), "assert b".into()]),
        );
    let wrong = x.clone().with_field("answer", "41");
    let out = score(c.clone(), &[x.clone(), wrong]);
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0)]);
    // A sample without the column is an error naming the column and the sample; nothing runs.
    let missing = RewardInput::new("p", "C").with_field("answer", 1i64);
    let err = CommandReward::new(c, "cmd")
        .unwrap()
        .score(&[x, missing])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("`cmd`") && err.contains("sample 1") && err.contains("`tests`"),
        "{err}"
    );
    assert!(err.contains("its columns: answer"), "{err}");
    assert!(!err.contains('\n'), "{err}");
}

#[test]
fn stdin_mode_pipes_the_completion() {
    let c = CommandConfig {
        stdin: true,
        ..sh(r#"test "$(cat)" = "hello world""#, &[])
    };
    let out = score(c, &batch(&["hello world", "bye"]));
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0)]);
    // A long completion the program never reads does not hold the run up.
    let c = CommandConfig {
        stdin: true,
        timeout: 5.0,
        ..config(&["true"])
    };
    let long = "x".repeat(4 << 20);
    let t = Instant::now();
    assert_eq!(score(c, &batch(&[&long])).scores, vec![Some(1.0)]);
    assert!(t.elapsed() < Duration::from_secs(3));
}

#[test]
fn file_mode_writes_the_completion_in_a_fresh_directory_per_sample() {
    let log = tempfile::tempdir().unwrap();
    let c = CommandConfig {
        file: Some("solution.py".into()),
        env: BTreeMap::from([("LOG".into(), log.path().display().to_string())]),
        ..sh(
            r#"[ ! -e marker ] && touch marker && pwd > "$LOG/$$" && test "$(cat solution.py)" = "print(1)""#,
            &[],
        )
    };
    let out = score(c, &batch(&["print(1)", "print(2)", "print(1)"]));
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0), Some(1.0)]);
    let dirs: std::collections::BTreeSet<String> = std::fs::read_dir(log.path())
        .unwrap()
        .map(|e| std::fs::read_to_string(e.unwrap().path()).unwrap())
        .collect();
    assert_eq!(dirs.len(), 3, "{dirs:?}");
    for d in &dirs {
        assert!(!Path::new(d.trim()).exists(), "{d} was not removed");
    }
    // A file in a subdirectory.
    let c = CommandConfig {
        file: Some("src/main.rs".into()),
        ..sh(r#"test "$(cat src/main.rs)" = "fn main() {}""#, &[])
    };
    assert_eq!(score(c, &batch(&["fn main() {}"])).scores, vec![Some(1.0)]);
}

#[test]
fn env_adds_variables() {
    let c = CommandConfig {
        env: BTreeMap::from([("GRPO_TEST_VAR".into(), "bar".into())]),
        ..sh(r#"test "$GRPO_TEST_VAR" = "$1""#, &["{completion}"])
    };
    assert_eq!(
        score(c, &batch(&["bar", "baz"])).scores,
        vec![Some(1.0), Some(0.0)]
    );
}

#[test]
fn a_timeout_kills_the_process_group_and_is_counted() {
    let c = CommandConfig {
        timeout: 0.5,
        max_concurrent: 2,
        // The grandchild `sleep` dies with the shell.
        ..sh("sleep 10 & sleep 10", &["{completion}"])
    };
    let t = Instant::now();
    let out = score(c.clone(), &batch(&["a", "b"]));
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
    assert_eq!(out.scores, vec![None, None]);
    assert_eq!(counter(&out, "timeouts"), 2.0);
    assert_eq!(counter(&out, "failures"), 0.0);
    assert_eq!(status(&out, 0), "timeout");
    let out = score(
        CommandConfig {
            on_failure: Some(0.0),
            ..c
        },
        &batch(&["a"]),
    );
    assert_eq!(out.scores, vec![Some(0.0)]);
    // A program that ends while a background child still holds its stdout: scored at once,
    // the child killed with its group.
    let c = CommandConfig {
        timeout: 20.0,
        ..sh("sleep 10 & exit 0", &["{completion}"])
    };
    let t = Instant::now();
    let out = score(c, &batch(&["a"]));
    assert_eq!(out.scores, vec![Some(1.0)]);
    assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
}

#[test]
fn a_process_that_escapes_the_group_and_holds_stdout_is_a_failure() {
    if Command::new("setsid").arg("true").status().is_err() {
        eprintln!("skipping: setsid is not available");
        return;
    }
    // `setsid` puts `sleep` in a session of its own, out of reach of the group kill; it keeps
    // stdout open, so the run waits for it no longer than a grace second.
    let c = CommandConfig {
        timeout: 20.0,
        ..sh(
            r#"setsid sh -c 'touch escaped; exec sleep 3' &
               while [ ! -e escaped ]; do sleep 0.01; done"#,
            &["{completion}"],
        )
    };
    let t = Instant::now();
    let out = score(c, &batch(&["a"]));
    assert!(
        t.elapsed() < Duration::from_millis(2500),
        "{:?}",
        t.elapsed()
    );
    assert_eq!(out.scores, vec![None]);
    assert_eq!(status(&out, 0), "output_held");
    assert_eq!(counter(&out, "failures"), 1.0);
}

#[test]
fn an_output_flood_is_cut_and_counted() {
    for mode in [CommandScore::ExitStatus, CommandScore::Stdout] {
        let c = CommandConfig {
            max_output_bytes: 1000,
            timeout: 20.0,
            score: mode,
            ..config(&["yes", "{completion}"])
        };
        let t = Instant::now();
        let out = score(c, &batch(&["flood"]));
        assert!(t.elapsed() < Duration::from_secs(3), "{:?}", t.elapsed());
        assert_eq!(out.scores, vec![None]);
        assert_eq!(status(&out, 0), "output_limit");
        assert_eq!(counter(&out, "failures"), 1.0);
        assert_eq!(counter(&out, "timeouts"), 0.0);
    }
    // Up to the cap is fine.
    let c = CommandConfig {
        max_output_bytes: 10,
        score: CommandScore::Stdout,
        ..sh(r#"printf '%s\n' "$1""#, &["{completion}"])
    };
    assert_eq!(
        score(c, &batch(&["12345678"])).scores,
        vec![Some(12345678.0)]
    );
}

#[test]
fn a_crash_is_counted() {
    let out = score(sh("kill -9 $$", &["{completion}"]), &batch(&["x", "y"]));
    assert_eq!(out.scores, vec![None, None]);
    assert_eq!(counter(&out, "failures"), 2.0);
    let info = out.info[0].as_ref().unwrap();
    assert_eq!(info["status"], "signal");
    assert_eq!(info["signal"], 9);
    // A completion that cannot be an argument (a NUL byte) fails alone.
    let out = score(
        config(&["echo", "{completion}"]),
        &batch(&["ok", "bad\0arg"]),
    );
    assert_eq!(out.scores, vec![Some(1.0), None]);
    assert_eq!(status(&out, 1), "not_started");
    assert_eq!(counter(&out, "failures"), 1.0);
}

/// The most intervals `[start, end]` open at one instant.
fn max_overlap(log: &Path) -> usize {
    let mut events = Vec::new();
    for e in std::fs::read_dir(log).unwrap() {
        let p = e.unwrap().path();
        let t: u128 = std::fs::read_to_string(&p).unwrap().trim().parse().unwrap();
        let start = p.extension().unwrap() == "start";
        // Ends sort before starts at the same instant.
        events.push((t, start));
    }
    events.sort();
    let (mut open, mut most) = (0usize, 0usize);
    for (_, start) in events {
        if start {
            open += 1;
            most = most.max(open);
        } else {
            open -= 1;
        }
    }
    most
}

#[test]
fn max_concurrent_bounds_the_programs_running_at_once() {
    let log = tempfile::tempdir().unwrap();
    let c = CommandConfig {
        max_concurrent: 2,
        env: BTreeMap::from([("LOG".into(), log.path().display().to_string())]),
        ..sh(
            r#"date +%s%N > "$LOG/$1.start"; sleep 0.3; date +%s%N > "$LOG/$1.end""#,
            &["{completion}"],
        )
    };
    let reward = CommandReward::new(c, "cmd").unwrap();
    let names: Vec<String> = (0..6).map(|i| format!("a{i}")).collect();
    let names: Vec<&str> = names.iter().map(String::as_str).collect();
    let out = reward.score(&batch(&names)).unwrap();
    assert_eq!(out.scores, vec![Some(1.0); 6]);
    assert_eq!(max_overlap(log.path()), 2);
    // Two batches scored at once share the bound.
    std::fs::remove_dir_all(log.path()).unwrap();
    std::fs::create_dir(log.path()).unwrap();
    std::thread::scope(|s| {
        for b in ["b", "c"] {
            let reward = &reward;
            s.spawn(move || {
                let names: Vec<String> = (0..4).map(|i| format!("{b}{i}")).collect();
                let names: Vec<&str> = names.iter().map(String::as_str).collect();
                assert_eq!(reward.score(&batch(&names)).unwrap().scores.len(), 4);
            });
        }
    });
    assert_eq!(std::fs::read_dir(log.path()).unwrap().count(), 16);
    assert!(max_overlap(log.path()) <= 2);
}

#[test]
fn the_cpu_limit_kills_a_busy_loop() {
    let c = CommandConfig {
        max_cpu_seconds: Some(1),
        timeout: 30.0,
        ..sh("while :; do :; done", &["{completion}"])
    };
    let t = Instant::now();
    let out = score(c, &batch(&["spin"]));
    assert!(t.elapsed() < Duration::from_secs(20), "{:?}", t.elapsed());
    assert_eq!(out.scores, vec![None]);
    assert_eq!(status(&out, 0), "signal");
    assert_eq!(counter(&out, "failures"), 1.0);
    assert_eq!(counter(&out, "timeouts"), 0.0);
}

#[test]
fn the_memory_limit_fails_a_large_allocation() {
    if !python() {
        return;
    }
    let c = CommandConfig {
        stdin: true,
        ..config(&["python3", "-c", "b = bytearray(1 << 30); print(len(b))"])
    };
    // Without a limit 1 GiB of (untouched) zeros is fine; with 200 MiB of address space the
    // allocation raises MemoryError and python exits 1.
    assert_eq!(score(c.clone(), &batch(&["x"])).scores, vec![Some(1.0)]);
    let out = score(
        CommandConfig {
            max_memory_mb: Some(200),
            ..c
        },
        &batch(&["x"]),
    );
    assert_eq!(out.scores, vec![Some(0.0)]);
    let info = out.info[0].as_ref().unwrap();
    assert!(
        info["stderr"].as_str().unwrap().contains("MemoryError"),
        "{info}"
    );
}

#[test]
fn python_scores_from_stdout() {
    if !python() {
        return;
    }
    let c = CommandConfig {
        stdin: true,
        score: CommandScore::Stdout,
        ..config(&[
            "python3",
            "-c",
            "import sys; t = sys.stdin.read(); print(sum(c in 'aeiou' for c in t) / len(t))",
        ])
    };
    let out = score(c, &batch(&["aaaa", "abcd"]));
    assert_eq!(out.scores, vec![Some(1.0), Some(0.25)]);
}

fn build_error(spec: serde_json::Value) -> String {
    let rewards: RewardsConfig =
        serde_json::from_value(serde_json::json!({ "rewards": [spec] })).unwrap();
    let err = rewards
        .build(&ScoringModels::default())
        .unwrap_err()
        .to_string();
    assert!(!err.contains('\n'), "{err}");
    err
}

#[test]
fn bad_configs_are_one_line_errors_naming_the_field() {
    let err = build_error(serde_json::json!({"type": "command"}));
    assert!(err.contains("`rewards[0].argv`"), "{err}");
    let err = build_error(serde_json::json!({"type": "command", "argv": []}));
    assert!(err.contains("`rewards[0].argv`"), "{err}");
    let err = build_error(
        serde_json::json!({"type": "command", "argv": ["grpo-no-such-program", "{completion}"]}),
    );
    assert!(
        err.contains("`rewards[0].argv`") && err.contains("grpo-no-such-program"),
        "{err}"
    );
    assert!(err.contains("not found on PATH"), "{err}");
    let err = build_error(
        serde_json::json!({"type": "command", "argv": ["./no/such/checker.py", "{completion}"]}),
    );
    assert!(
        err.contains("`rewards[0].argv`") && err.contains("does not exist"),
        "{err}"
    );
    let err = build_error(serde_json::json!({"type": "command", "argv": ["{completion}"]}));
    assert!(err.contains("placeholder"), "{err}");
    let err = build_error(serde_json::json!({"type": "command", "argv": ["true"]}));
    assert!(
        err.contains("`rewards[0].argv`") && err.contains("never sees the completion"),
        "{err}"
    );
    let err = build_error(
        serde_json::json!({"type": "command", "argv": ["true"], "file": "../escape.py"}),
    );
    assert!(err.contains("`rewards[0].file`"), "{err}");
    let err = build_error(
        serde_json::json!({"type": "command", "argv": ["true"], "stdin": true, "timeout": 0}),
    );
    assert!(err.contains("`rewards[0].timeout`"), "{err}");
    let err = build_error(
        serde_json::json!({"type": "command", "argv": ["true"], "stdin": true, "max_concurrent": 0}),
    );
    assert!(err.contains("`rewards[0].max_concurrent`"), "{err}");
    // Unknown keys are refused by serde, naming the key.
    let err = serde_json::from_value::<RewardsConfig>(serde_json::json!({"rewards": [
        {"type": "command", "argv": ["true"], "stdin": true, "timout": 3}
    ]}))
    .unwrap_err()
    .to_string();
    assert!(err.contains("timout"), "{err}");
}

#[test]
fn a_config_builds_into_a_named_reward_with_its_counters() {
    let rewards: RewardsConfig = serde_json::from_value(serde_json::json!({"rewards": [{
        "type": "command",
        "name": "checker",
        "argv": ["sh", "-c", "test \"$1\" = yes", "sh", "{completion}"],
        "timeout_secs": 5,
        "max_concurrent": 2,
        "on_failure": 0.0,
    }]}))
    .unwrap();
    let set = rewards.build(&ScoringModels::default()).unwrap();
    let scored = set.score(&batch(&["yes", "no", "yes", "yes"])).unwrap();
    assert_eq!(scored.rewards, vec![1.0, 0.0, 1.0, 1.0]);
    assert_eq!(scored.metrics["rewards/checker/mean"], 0.75);
    assert_eq!(scored.metrics["rewards/checker/timeouts"], 0.0);
    assert_eq!(scored.metrics["rewards/checker/failures"], 0.0);
}

/// 256 completions through `true` at `max_concurrent = 2`: the median of 5 runs.
/// `cargo test -p grpo-rewards --release --test it command:: -- --ignored --nocapture`
#[test]
#[ignore = "benchmark"]
fn bench_256_true_at_max_concurrent_2() {
    let reward = CommandReward::new(
        CommandConfig {
            max_concurrent: 2,
            stdin: true,
            ..config(&["true"])
        },
        "cmd",
    )
    .unwrap();
    let inputs = batch(&["x"; 256]);
    let median = |reward: &CommandReward, what: &str| {
        let mut secs: Vec<f64> = (0..5)
            .map(|_| {
                let t = Instant::now();
                let out = reward.score(&inputs).unwrap();
                assert_eq!(out.scores, vec![Some(1.0); 256]);
                t.elapsed().as_secs_f64()
            })
            .collect();
        secs.sort_by(f64::total_cmp);
        let median = secs[2];
        eprintln!(
            "256 × `true` at max_concurrent 2{what}: median {median:.3} s ({:.2} ms per program); runs {secs:?}",
            median * 1000.0 / 256.0
        );
        median
    };
    let plain = median(&reward, "");
    // With limits std forks (pre_exec) instead of posix_spawn.
    let limited = CommandReward::new(
        CommandConfig {
            max_concurrent: 2,
            stdin: true,
            max_cpu_seconds: Some(5),
            max_memory_mb: Some(512),
            ..config(&["true"])
        },
        "cmd",
    )
    .unwrap();
    median(&limited, " with CPU and memory limits");
    assert!(plain <= 1.0, "{plain} s");
}
