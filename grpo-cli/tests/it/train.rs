//! End-to-end GRPO runs on a tiny generated model and synthetic arithmetic data.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;

use grpo_rollout::Arch;
use grpo_rollout::init::Preset;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunMode, RunOptions};

use crate::common;
use common::Fixture;

pub(crate) fn fixture() -> Fixture {
    Fixture::new().model("model", 3).arithmetic(40)
}

pub(crate) fn base_config(root: &Path, out: &str, extra: &str) -> TrainConfig {
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 6
[[rewards]]
type = "accuracy"
[[rewards]]
type = "format"
name = "has_digit"
pattern = '(?s).*[0-9].*'
[optim]
learning_rate = 1e-3
lr_scheduler_type = "cosine"
warmup_steps = 1
[train]
max_steps = 4
prompts_per_step = 2
per_device_train_batch_size = 4
save_steps = 2
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("arith.jsonl").display(),
    );
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, text).unwrap();
    config::load(&p, &[]).unwrap()
}

fn strip_timing(ms: &[grpo_trainer::Metrics]) -> Vec<Vec<(String, f64)>> {
    ms.iter()
        .map(|m| {
            m.iter()
                .filter(|(k, _)| {
                    !k.starts_with("timing/")
                        && !["step_time", "tokens_per_s", "peak_rss_mib"].contains(&k.as_str())
                })
                .map(|(k, v)| (k.clone(), *v))
                .collect()
        })
        .collect()
}

pub(crate) fn run(cfg: TrainConfig, opts: RunOptions) -> grpo_trainer::TrainingResult {
    let setup = trainer::setup(cfg).unwrap();
    trainer::run(setup, &opts, &mut grpo_trainer::NoCallbacks).unwrap()
}

/// The metrics of a run of `cfg` stopped after `k` steps and resumed to the end.
pub(crate) fn stopped_and_resumed(cfg: TrainConfig, k: usize) -> Vec<grpo_trainer::Metrics> {
    let part1 = run(
        cfg.clone(),
        RunOptions {
            stop_after: Some(k),
            ..Default::default()
        },
    );
    let part2 = run(
        cfg,
        RunOptions {
            resume: Some(None),
            ..Default::default()
        },
    );
    let mut joined = part1.metrics;
    joined.extend(part2.metrics);
    joined
}

pub(crate) fn assert_same(a: &[grpo_trainer::Metrics], b: &[grpo_trainer::Metrics]) {
    let (a, b) = (strip_timing(a), strip_timing(b));
    assert_eq!(a.len(), b.len());
    for (x, y) in a.iter().zip(&b) {
        assert_eq!(x.len(), y.len(), "metric counts differ: {x:?} vs {y:?}");
        for ((k1, v1), (k2, v2)) in x.iter().zip(y) {
            assert_eq!(k1, k2);
            assert!(
                v1 == v2 || (v1.is_nan() && v2.is_nan()),
                "{k1}: {v1} vs {v2}"
            );
        }
    }
}

#[test]
fn pipeline_with_staleness_0_equals_the_sequential_loop() {
    let f = fixture();
    let seq = run(
        base_config(&f.root, "seq", ""),
        RunOptions {
            mode: RunMode::Sequential,
            ..Default::default()
        },
    );
    let pipe = run(base_config(&f.root, "pipe", ""), RunOptions::default());
    assert_eq!(seq.total_steps, 4);
    assert_same(&seq.metrics, &pipe.metrics);
    // The weights moved: the policy version advanced and the loss is computed.
    let last = seq.metrics.last().unwrap();
    for key in [
        "reward",
        "reward_std",
        "rewards/accuracy/mean",
        "rewards/accuracy/std",
        "rewards/has_digit/mean",
        "frac_reward_zero_std",
        "kl",
        "entropy",
        "clip_ratio/low_mean",
        "clip_ratio/high_mean",
        "clip_ratio/region_mean",
        "clip_ratio/low_min",
        "clip_ratio/high_max",
        "completions/mean_length",
        "completions/clipped_ratio",
        "loss",
        "grad_norm",
        "learning_rate",
        "step_time",
        "num_tokens",
        "epoch",
        "timing/generate_s",
        "timing/score_s",
        "timing/train_s",
        "tokens_per_s",
        "peak_rss_mib",
    ] {
        assert!(last.contains_key(key), "metric {key} missing");
    }
    for m in &seq.metrics {
        let (lo, mid, hi) = (
            m["completions/min_terminated_length"],
            m["completions/mean_terminated_length"],
            m["completions/max_terminated_length"],
        );
        assert!(
            lo <= mid && mid <= hi && hi <= m["completions/max_length"],
            "{m:?}"
        );
    }
    assert!(
        seq.metrics.iter().any(|m| m["grad_norm"] > 0.0),
        "some step has a gradient"
    );
    assert_eq!(last["policy_version"], 3.0);
    // Run directory.
    let dir = f.root.join("seq");
    let lines = std::fs::read_to_string(dir.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 4);
    let comp = std::fs::read_to_string(dir.join("completions.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(comp.lines().next().unwrap()).unwrap();
    for k in ["prompt", "completion", "rewards", "advantage", "reward"] {
        assert!(first.get(k).is_some(), "completions.jsonl lacks {k}");
    }
    // save_steps 2 over 4 steps, save_total_limit 2: step-2 and step-4.
    let cks = trainer::list_checkpoints(&dir);
    let names: Vec<usize> = cks.iter().map(|(n, _)| *n).collect();
    assert_eq!(names, vec![2, 4]);
    let ck = &cks[1].1;
    for file in [
        "model/model.safetensors",
        "model/config.json",
        "optimizer.safetensors",
        "trainer_state.json",
        "config.json",
    ] {
        assert!(ck.join(file).exists(), "checkpoint lacks {file}");
    }
    // No half checkpoint left behind.
    let leftovers: Vec<_> = std::fs::read_dir(dir.join("checkpoints"))
        .unwrap()
        .flatten()
        .filter(|e| e.file_name().to_string_lossy().starts_with(".tmp"))
        .collect();
    assert!(leftovers.is_empty());
}

#[test]
fn resume_reproduces_the_uninterrupted_run() {
    let f = fixture();
    let extra = "[reference]\nbeta = 0.04\n";
    let mut straight_cfg = base_config(&f.root, "straight", extra);
    straight_cfg.train.max_steps = Some(6);
    let straight = run(straight_cfg, RunOptions::default());
    assert!(straight.metrics.last().unwrap()["kl"] > 0.0);

    let mut cfg = base_config(&f.root, "killed", extra);
    cfg.train.max_steps = Some(6);
    cfg.train.save_steps = 0;
    let part1 = run(
        cfg.clone(),
        RunOptions {
            stop_after: Some(3),
            ..Default::default()
        },
    );
    assert!(part1.interrupted);
    assert_eq!(part1.total_steps, 3);
    let part2 = run(
        cfg,
        RunOptions {
            resume: Some(None),
            ..Default::default()
        },
    );
    assert_eq!(part2.total_steps, 6);
    let mut joined = part1.metrics.clone();
    joined.extend(part2.metrics.clone());
    assert_same(&straight.metrics, &joined);
    // metrics.jsonl reads like one run.
    let text = std::fs::read_to_string(f.root.join("killed/metrics.jsonl")).unwrap();
    let steps: Vec<f64> = text
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_f64()
                .unwrap()
        })
        .collect();
    assert_eq!(steps, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
}

#[test]
fn lora_with_several_iterations_trains_and_resumes() {
    let f = fixture();
    let extra = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n";
    let mut cfg = base_config(&f.root, "lora", extra);
    cfg.optim.num_iterations = 2;
    cfg.optim.gradient_accumulation_steps = Some(2);
    cfg.train.max_steps = Some(4);
    let straight = run(cfg.clone(), RunOptions::default());
    let ck = straight.best_checkpoint_path.clone().unwrap();
    assert!(ck.join("adapter/adapter_model.safetensors").exists());
    assert!(ck.join("adapter/adapter_config.json").exists());
    // Two updates per step: the ratio leaves 1 on the second pass.
    assert!(straight.metrics.iter().all(|m| m["grad_norm"].is_finite()));

    cfg.output_dir = f.root.join("lora2");
    cfg.train.save_steps = 0;
    let p1 = run(
        cfg.clone(),
        RunOptions {
            stop_after: Some(2),
            ..Default::default()
        },
    );
    let p2 = run(
        cfg,
        RunOptions {
            resume: Some(None),
            ..Default::default()
        },
    );
    let mut joined = p1.metrics;
    joined.extend(p2.metrics);
    assert_same(&straight.metrics, &joined);
}

fn cli(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn bad_inputs_fail_before_any_work_with_one_line() {
    let f = fixture();
    let _ = base_config(&f.root, "bad", "");
    let cfg = f.root.join("bad.toml").display().to_string();
    let cases: Vec<(Vec<String>, &str)> = vec![
        (
            vec!["--set".into(), "optim.lerning_rate=1".into()],
            "did you mean `optim.learning_rate`",
        ),
        (
            vec!["--set".into(), "loss.loss_type=ppo".into()],
            "loss.loss_type: unknown loss_type `ppo`: expected one of grpo",
        ),
        (
            vec!["--set".into(), "model.path=/nonexistent/model".into()],
            "/nonexistent/model",
        ),
        (
            vec!["--set".into(), "rollout.num_generations=1".into()],
            "`rollout.num_generations`",
        ),
        (
            vec![
                "--set".into(),
                "rewards=[{type = \"accuracy\", answer_field = \"solution\"}]".into(),
            ],
            "solution",
        ),
        (
            vec![
                "--set".into(),
                "data.path=[\"/nonexistent/d.jsonl\"]".into(),
            ],
            "/nonexistent/d.jsonl",
        ),
        (
            vec!["--set".into(), "rewards=[{type = \"shout\"}]".into()],
            "shout",
        ),
        (
            vec!["--set".into(), "model.lora={r = 0}".into()],
            "lora.r must be >= 1",
        ),
        (
            vec!["--set".into(), "optim.learning_rate=\"fast\"".into()],
            "optim.learning_rate: invalid type",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["train", "--config", cfg.as_str()];
        args.extend(extra.iter().map(String::as_str));
        let (code, _, err) = cli(&args);
        assert_eq!(code, 2, "{extra:?}: {err}");
        assert_eq!(err.trim().lines().count(), 1, "{extra:?}: one line: {err}");
        assert!(err.contains(needle), "{extra:?}: `{needle}` not in: {err}");
    }
    assert!(!f.root.join("bad/checkpoints").exists());
    let (code, _, err) = cli(&["train", "--config", "/nonexistent.toml"]);
    assert_eq!(code, 2);
    assert!(err.contains("/nonexistent.toml"), "{err}");
}

#[test]
fn train_subcommand_runs_and_saves_the_resolved_config() {
    let f = fixture();
    let _ = base_config(&f.root, "cli", "");
    let cfg = f.root.join("cli.toml").display().to_string();
    let (code, out, err) = cli(&["train", "--config", &cfg, "--set", "train.max_steps=2"]);
    assert_eq!(code, 0, "{err}");
    assert!(out.contains("trained 2 steps"), "{out}");
    let saved: serde_json::Value =
        serde_json::from_slice(&std::fs::read(f.root.join("cli/config.json")).unwrap()).unwrap();
    assert_eq!(saved["train"]["max_steps"], 2);
    assert_eq!(saved["optim"]["learning_rate"], 1e-3);
}

/// Starts `grpo-cli train` on run `name` with no periodic checkpoints, sends `signal` (`INT`,
/// `TERM`) once two steps are logged, and returns the exit code and the checkpoints left.
fn stop_with_signal(f: &Fixture, name: &str, signal: &str) -> (Option<i32>, Vec<(usize, PathBuf)>) {
    let _ = base_config(&f.root, name, "");
    let cfg = f.root.join(format!("{name}.toml")).display().to_string();
    let mut child = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args([
            "train",
            "--config",
            &cfg,
            "--set",
            "train.max_steps=100000",
            "--set",
            "train.save_steps=0",
        ])
        .stdout(std::process::Stdio::null())
        .stderr(std::process::Stdio::null())
        .spawn()
        .unwrap();
    let metrics = f.root.join(name).join("metrics.jsonl");
    let t0 = std::time::Instant::now();
    while std::fs::read_to_string(&metrics).map_or(0, |t| t.lines().count()) < 2 {
        assert!(t0.elapsed().as_secs() < 120, "no step within 2 minutes");
        std::thread::sleep(std::time::Duration::from_millis(50));
    }
    let st = Command::new("kill")
        .args([&format!("-{signal}"), &child.id().to_string()])
        .status()
        .unwrap();
    assert!(st.success());
    let status = child.wait().unwrap();
    (status.code(), trainer::list_checkpoints(&f.root.join(name)))
}

fn logged_steps(run_dir: &Path) -> Vec<usize> {
    std::fs::read_to_string(run_dir.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_f64()
                .unwrap() as usize
        })
        .collect()
}

#[test]
fn ctrl_c_writes_a_checkpoint_and_exits_130() {
    let f = fixture();
    let (code, cks) = stop_with_signal(&f, "intr", "INT");
    assert_eq!(code, Some(130));
    assert_eq!(cks.len(), 1, "one checkpoint at the stop");
    assert!(cks[0].0 >= 2);
}

/// SIGTERM (`kill`, `timeout`, `docker stop`, schedulers) stops like Ctrl-C: the step finishes,
/// a checkpoint is written although `save_steps = 0`, the exit code is 143 (128 + 15), and
/// `--resume` continues the run.
#[test]
fn sigterm_writes_a_checkpoint_exits_143_and_resumes() {
    let f = fixture();
    let (code, cks) = stop_with_signal(&f, "term", "TERM");
    assert_eq!(code, Some(143));
    assert_eq!(cks.len(), 1, "one checkpoint at the stop");
    let stopped = cks[0].0;
    assert!(stopped >= 2);
    assert_eq!(
        logged_steps(&f.root.join("term")),
        (1..=stopped).collect::<Vec<_>>()
    );
    let cfg = f.root.join("term.toml").display().to_string();
    let until = format!("train.max_steps={}", stopped + 2);
    let (code, out, err) = cli(&["train", "--config", &cfg, "--resume", "--set", &until]);
    assert_eq!(code, 0, "{err}");
    assert!(
        out.contains(&format!("trained {} steps", stopped + 2)),
        "{out}"
    );
    assert_eq!(
        logged_steps(&f.root.join("term")),
        (1..=stopped + 2).collect::<Vec<_>>()
    );
}

/// A run directory holds one run: a second run into it is refused (naming both ways out) before
/// any work, `--overwrite` starts over without the old run's files, and `--resume` (latest or
/// an explicit checkpoint) only ever continues this run.
#[test]
fn a_used_run_directory_is_refused_overwritten_or_resumed() {
    let f = fixture();
    let dir = f.root.join("reuse");
    let cfg = base_config(&f.root, "reuse", "");
    let first = run(cfg.clone(), RunOptions::default());
    assert_eq!(first.total_steps, 4);
    assert_eq!(
        trainer::list_checkpoints(&dir)
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>(),
        vec![2, 4]
    );

    // Again without --resume: refused, one line, the run untouched.
    let toml = f.root.join("reuse.toml").display().to_string();
    let (code, _, err) = cli(&["train", "--config", &toml]);
    assert_eq!(code, 2, "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    for needle in [
        dir.display().to_string().as_str(),
        "--resume",
        "--overwrite",
        "metrics.jsonl",
        "checkpoints/",
    ] {
        assert!(err.contains(needle), "`{needle}` not in: {err}");
    }
    let e = trainer::run(
        trainer::setup(cfg.clone()).unwrap(),
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("overwrite_output_dir"), "{e}");
    assert_eq!(logged_steps(&dir), vec![1, 2, 3, 4]);

    // Overwrite, stopped after 3 of 6 steps: only the new run's files remain...
    let mut over = cfg.clone();
    over.overwrite_output_dir = true;
    over.train.max_steps = Some(6);
    over.train.save_steps = 0;
    let part = run(
        over.clone(),
        RunOptions {
            stop_after: Some(3),
            ..Default::default()
        },
    );
    assert!(part.interrupted);
    assert_eq!(logged_steps(&dir), vec![1, 2, 3]);
    assert_eq!(
        trainer::list_checkpoints(&dir)
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>(),
        vec![3]
    );
    // ... and --resume continues this run, not the old one's step 4.
    let rest = run(
        over.clone(),
        RunOptions {
            resume: Some(None),
            ..Default::default()
        },
    );
    assert_eq!(rest.total_steps, 6);
    assert_eq!(logged_steps(&dir), vec![1, 2, 3, 4, 5, 6]);
    let steps_of = |p: &Path| -> Vec<usize> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| {
                serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                    .as_f64()
                    .unwrap() as usize
            })
            .collect()
    };
    let mut c_steps = steps_of(&dir.join("completions.jsonl"));
    c_steps.dedup();
    assert_eq!(c_steps, vec![1, 2, 3, 4, 5, 6]);

    // Continuing from the earlier checkpoint of step 3 drops what came after it (lines and the
    // checkpoint of step 6), so a later --resume cannot pick the abandoned step 6.
    let mut short = over.clone();
    short.train.max_steps = Some(4);
    let again = run(
        short,
        RunOptions {
            resume: Some(Some(dir.join("checkpoints/step-3"))),
            ..Default::default()
        },
    );
    assert_eq!(again.total_steps, 4);
    assert_eq!(logged_steps(&dir), vec![1, 2, 3, 4]);
    let mut c_steps = steps_of(&dir.join("completions.jsonl"));
    c_steps.dedup();
    assert_eq!(c_steps, vec![1, 2, 3, 4]);
    assert_eq!(
        trainer::list_checkpoints(&dir)
            .iter()
            .map(|c| c.0)
            .collect::<Vec<_>>(),
        vec![3, 4]
    );

    // A checkpoint of another directory starts a fresh one: allowed into an empty directory,
    // refused into a used one.
    let mut fork = cfg.clone();
    fork.output_dir = f.root.join("fork");
    let from = RunOptions {
        resume: Some(Some(dir.join("checkpoints/step-3"))),
        ..Default::default()
    };
    let forked = run(fork.clone(), from.clone());
    assert_eq!(forked.total_steps, 4);
    assert_eq!(logged_steps(&f.root.join("fork")), vec![4]);
    let e = trainer::run(
        trainer::setup(fork).unwrap(),
        &from,
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("holds another run"), "{e}");
}

#[test]
fn plot_writes_a_png_of_the_curves() {
    let f = fixture();
    let mut cfg = base_config(&f.root, "plot", "");
    cfg.train.max_steps = Some(3);
    let r = run(cfg, RunOptions::default());
    let png = grpo_cli::plot::plot_run(&r.run_dir).unwrap();
    let bytes = std::fs::read(&png).unwrap();
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
    assert!(
        bytes.len() > 10_000,
        "a real picture, {} bytes",
        bytes.len()
    );
    let e = grpo_cli::plot::plot_run(&f.root).unwrap_err().to_string();
    assert!(e.contains("metrics.jsonl"), "{e}");
}

#[test]
fn demo_runs_end_to_end_in_miniature() {
    let dir = tempfile::tempdir().unwrap();
    let r = grpo_cli::demo::run(&grpo_cli::demo::DemoOptions {
        out: dir.path().join("demo"),
        sft_steps: 3,
        grpo_steps: 2,
        seed: 1,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(r.result.total_steps, 2);
    assert!(r.sft_loss.0.is_finite() && r.sft_loss.1.is_finite());
    for reward in [r.first_reward, r.last_reward] {
        assert!(
            (0.0..=1.0).contains(&reward),
            "reward {reward} outside [0, 1]"
        );
    }
    assert!(dir.path().join("demo/grpo/metrics.jsonl").exists());
    // The demo starts over in its directory each time.
    let again = grpo_cli::demo::run(&grpo_cli::demo::DemoOptions {
        out: dir.path().join("demo"),
        sft_steps: 1,
        grpo_steps: 1,
        seed: 1,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(again.result.total_steps, 1);
    assert_eq!(logged_steps(&dir.path().join("demo/grpo")), vec![1]);
}

#[test]
fn calculator_demo_runs_end_to_end_in_miniature() {
    let dir = tempfile::tempdir().unwrap();
    let r = grpo_cli::calculator::run(&grpo_cli::demo::DemoOptions {
        out: dir.path().join("calc"),
        sft_steps: 2,
        grpo_steps: 1,
        seed: 1,
        progress: false,
        ..Default::default()
    })
    .unwrap();
    assert_eq!(r.result.total_steps, 1);
    assert!(r.sft_loss.0.is_finite() && r.sft_loss.1.is_finite());
    let m = &r.result.metrics[0];
    for k in [
        "rewards/accuracy/mean",
        "env/tool_calls_mean",
        "env/turns_mean",
    ] {
        assert!(m.contains_key(k), "{k} missing from {m:?}");
    }
    // The problems: a conversation and its product.
    let line = std::fs::read_to_string(dir.path().join("calc/multiplication.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let q = row["prompt"][0]["content"].as_str().unwrap();
    // `a = 37, b = 48. What is a * b?`
    let (a, b) = q
        .trim_start_matches("a = ")
        .trim_end_matches(". What is a * b?")
        .split_once(", b = ")
        .unwrap();
    let product: u64 = a.parse::<u64>().unwrap() * b.parse::<u64>().unwrap();
    assert_eq!(row["answer"], product.to_string());
}

#[test]
fn eval_split_is_scored_every_eval_steps_and_reference_sync_runs() {
    let f = fixture();
    let extra = "[reference]\nbeta = 0.04\nsync_ref_model = true\nref_model_sync_steps = 2\nref_model_mixup_alpha = 0.5\n";
    let mut cfg = base_config(&f.root, "eval", extra);
    cfg.data.eval_fraction = Some(0.25);
    cfg.train.eval_steps = 2;
    cfg.train.max_steps = Some(4);
    let (r, evals) = crate::common::run_with_evals(cfg);
    assert_eq!(evals.len(), 2, "eval at steps 2 and 4");
    for e in evals.iter() {
        let acc = e["eval/accuracy"];
        assert!((0.0..=1.0).contains(&acc));
        assert!(e.contains_key("eval/reward"));
    }
    // The synced reference is saved with the checkpoint for exact resume.
    let ck = r.best_checkpoint_path.unwrap();
    assert!(ck.join("reference.safetensors").exists());
    let lines = std::fs::read_to_string(f.root.join("eval/metrics.jsonl")).unwrap();
    assert!(lines.contains("eval/accuracy"));
}

#[test]
fn staleness_1_is_reproducible_off_policy_and_corrected() {
    let f = fixture();
    let extra = "[pipeline]\nmax_staleness = 1\n";
    let a = run(
        base_config(&f.root, "stale_a", extra),
        RunOptions::default(),
    );
    let b = run(
        base_config(&f.root, "stale_b", extra),
        RunOptions::default(),
    );
    // Fixed lag: the batch of step s is sampled with version max(0, s - 1), whatever the timing.
    assert_same(&a.metrics, &b.metrics);
    for (s, m) in a.metrics.iter().enumerate() {
        assert_eq!(m["policy_version"], s.saturating_sub(1) as f64, "step {s}");
        let lag = if s == 0 { 0.0 } else { 1.0 };
        assert_eq!(m["staleness/max"], lag, "step {s}");
        assert_eq!(m["staleness/mean"], lag, "step {s}");
        let (lo, mean, hi) = (
            m["sampling/importance_sampling_ratio/min"],
            m["sampling/importance_sampling_ratio/mean"],
            m["sampling/importance_sampling_ratio/max"],
        );
        assert!(
            lo <= mean && mean <= hi && lo >= 0.0 && hi <= 3.0,
            "step {s}: {lo} {mean} {hi}"
        );
        if s == 0 {
            // Sampled by the very policy the learner holds: the ratio is 1 up to the rounding
            // between incremental decoding and the full forward.
            assert!(
                (lo - 1.0).abs() < 1e-3 && (hi - 1.0).abs() < 1e-3,
                "{lo} {hi}"
            );
            assert!(m["sampling/sampling_logp_difference/max"] < 1e-3);
        }
    }
    // Later batches really are off-policy: the learner moved since they were sampled.
    assert!(
        a.metrics[1..]
            .iter()
            .any(|m| m["sampling/sampling_logp_difference/max"] > 1e-4)
    );
    // And the pipeline is not the on-policy algorithm any more.
    let on = run(base_config(&f.root, "on_policy", ""), RunOptions::default());
    assert_ne!(strip_timing(&on.metrics), strip_timing(&a.metrics));
}

#[test]
fn bad_importance_sampling_options_are_refused() {
    let f = fixture();
    let _ = base_config(&f.root, "isbad", "");
    for (set, needle) in [
        (
            "loss.vllm_importance_sampling_mode=\"per_token\"",
            "loss.vllm_importance_sampling_mode: unknown importance sampling mode `per_token`",
        ),
        (
            "loss.vllm_importance_sampling_clip_max=0.0",
            "`loss.vllm_importance_sampling_clip_max`",
        ),
    ] {
        let e = config::load(&f.root.join("isbad.toml"), &[set.to_string()]).unwrap_err();
        assert!(format!("{e:#}").contains(needle), "{set}: {e:#}");
    }
}

/// The learner's log-probs: rows that share a prompt (a GRPO group) run it once, and give what
/// each row run alone gives, log-probs and entropies, completions of different lengths.
#[test]
fn completion_logps_of_a_group_equal_each_row_alone() {
    use candle_core::{DType, Device};
    let mut cfg = grpo_rollout::init::preset_config(Preset::Tiny, Arch::Qwen2, 300, 2, 0);
    cfg.hidden_size = 64;
    let m = grpo_rollout::init::random_weights(&cfg, 9, DType::F32, &Device::Cpu).unwrap();
    let p0: Vec<u32> = vec![11, 12, 13, 14, 15];
    let p1: Vec<u32> = vec![200, 7];
    let prompts: Vec<&[u32]> = vec![&p0, &p1, &p0, &p0, &p1];
    let comps: Vec<Vec<u32>> = vec![
        vec![40, 41, 42],
        vec![50],
        vec![60, 61, 62, 63, 64, 65],
        vec![],
        vec![70, 71],
    ];
    let crefs: Vec<&[u32]> = comps.iter().map(Vec::as_slice).collect();
    let (lp, ent, c) = trainer::completion_logps(&m, 0, &prompts, &crefs, 0.9, true).unwrap();
    assert_eq!(c, 6);
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    let ent: Vec<Vec<f32>> = ent.unwrap().to_vec2().unwrap();
    for (r, co) in comps.iter().enumerate() {
        if co.is_empty() {
            continue;
        }
        let (a, ea, _) =
            trainer::completion_logps(&m, 0, &prompts[r..=r], &crefs[r..=r], 0.9, true).unwrap();
        let a: Vec<f32> = a.flatten_all().unwrap().to_vec1().unwrap();
        let ea: Vec<f32> = ea.unwrap().flatten_all().unwrap().to_vec1().unwrap();
        for j in 0..co.len() {
            assert!(
                (a[j] - lp[r][j]).abs() < 1e-5,
                "row {r} token {j}: {} vs {}",
                a[j],
                lp[r][j]
            );
            assert!((ea[j] - ent[r][j]).abs() < 1e-5, "row {r} entropy {j}");
        }
    }
    assert!(
        lp.iter()
            .flatten()
            .chain(ent.iter().flatten())
            .all(|x| x.is_finite())
    );
}

/// TRL 1.16's loss variants run end to end and log TRL's metrics for them: sapo and vespo
/// without clip ratios (vespo with its weight), luspo with them; the entropy options change the
/// loss; adaptive entropy control moves the coefficient one `entropy_coef_delta` per optimizer
/// update toward the target and checkpoints it.
#[test]
fn trl_loss_variants_and_entropy_control_train_and_log() {
    let f = fixture();
    let finite = |m: &grpo_trainer::Metrics, k: &str| {
        let v = m.get(k).copied().unwrap_or(f64::NAN);
        assert!(v.is_finite(), "{k} = {v}");
        v
    };
    for (lt, clipped) in [
        ("sapo", false),
        ("luspo", true),
        ("vespo", false),
        ("gmpo", true),
    ] {
        let extra = format!("[loss]\nloss_type = \"{lt}\"\n");
        let r = run(base_config(&f.root, lt, &extra), RunOptions::default());
        for m in &r.metrics {
            finite(m, "loss");
            assert_eq!(m.contains_key("clip_ratio/region_mean"), clipped, "{lt}");
            if lt == "gmpo" {
                // On-policy every sequence's weight is exp(0) = 1: nothing is clipped.
                assert_eq!(m["clip_ratio/high_max"], 0.0, "{m:?}");
            }
            if lt == "vespo" {
                let phi = finite(m, "vespo/phi_seq_mean");
                // On-policy (ratio 1): φ(1) = 1 for every sequence.
                assert!((phi - 1.0).abs() < 1e-4, "{phi}");
            }
        }
    }
    let base = run(base_config(&f.root, "plain", ""), RunOptions::default());
    let masked = run(
        base_config(
            &f.root,
            "topent",
            "[loss]\ntop_entropy_quantile = 0.5\nentropy_coef = 0.01\n",
        ),
        RunOptions::default(),
    );
    assert_ne!(base.metrics[0]["loss"], masked.metrics[0]["loss"]);
    assert!(masked.metrics[0].contains_key("policy_loss"));
    assert!(!base.metrics[0].contains_key("entropy_coef"));

    // Every entropy is below 100 (target reached: the coefficient grows), above 0 (shrinks).
    for (target, sign) in [(100.0, 1.0), (0.0, -1.0)] {
        let extra = format!(
            "[loss]\nuse_adaptive_entropy = true\nentropy_coef = 0.05\nentropy_coef_delta = \
             0.01\nentropy_target = {target:?}\n"
        );
        let name = format!("adaptive{}", target as u32);
        let r = run(base_config(&f.root, &name, &extra), RunOptions::default());
        for (s, m) in r.metrics.iter().enumerate() {
            let want = 0.05 + sign * 0.01 * (s + 1) as f64;
            assert!((m["entropy_coef"] - want).abs() < 1e-12, "step {s}: {m:?}");
            finite(m, "policy_loss");
        }
        // The controller's state is checkpointed: a run stopped after 2 steps and resumed
        // logs the same coefficients.
        let mut cfg = base_config(&f.root, &format!("{name}_killed"), &extra);
        cfg.train.save_steps = 0;
        let stop = RunOptions {
            stop_after: Some(2),
            ..Default::default()
        };
        let part1 = run(cfg.clone(), stop);
        let resume = RunOptions {
            resume: Some(None),
            ..Default::default()
        };
        let part2 = run(cfg, resume);
        let coefs = |ms: &[grpo_trainer::Metrics]| -> Vec<f64> {
            ms.iter().map(|m| m["entropy_coef"]).collect()
        };
        let mut joined = coefs(&part1.metrics);
        joined.extend(coefs(&part2.metrics));
        assert_eq!(joined, coefs(&r.metrics));
    }

    // The off-policy sequence mask against the sampling log-probs of a stale generator.
    let r = run(
        base_config(
            &f.root,
            "opsm",
            "[pipeline]\nmax_staleness = 1\n[loss]\noff_policy_mask_threshold = 0.0\n",
        ),
        RunOptions::default(),
    );
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
    // GMPO off-policy: a stale generator's samples, its log-space clip at TRL's 0.4 default,
    // the sequence-level importance weights.
    let cfg = base_config(
        &f.root,
        "gmpo_stale",
        "[pipeline]\nmax_staleness = 1\n[loss]\nloss_type = \"gmpo\"\n",
    );
    let lc = cfg.loss_config();
    assert_eq!((lc.epsilon_low, lc.epsilon_high), (0.4, 0.4));
    let r = run(cfg, RunOptions::default());
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
    // GSPO-token with a stale generator and the high-entropy mask (where it differs from GSPO).
    let cfg = base_config(
        &f.root,
        "gspo_token",
        "[pipeline]\nmax_staleness = 1\n[loss]\nimportance_sampling_level = \"sequence_token\"\n\
         top_entropy_quantile = 0.5\n",
    );
    assert_eq!(
        cfg.loss_config().importance_sampling_level,
        grpo_core::loss::ImportanceSamplingLevel::SequenceToken
    );
    let r = run(cfg, RunOptions::default());
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
    for (set, needle) in [
        ("loss.loss_type=\"ppo\"", "sapo, luspo, vespo, gmpo"),
        (
            "loss.importance_sampling_level=\"tokens\"",
            "expected token, sequence or sequence_token",
        ),
        (
            "loss.loss_type=\"gmpo\"\nloss.importance_sampling_level=\"sequence_token\"",
            "importance_sampling_level = \"sequence_token\" does not apply to loss_type gmpo",
        ),
        (
            "loss.loss_type=\"gmpo\"\nloss.vllm_importance_sampling_mode=\"token_mask\"",
            "weighs whole sequences",
        ),
        (
            "loss.loss_type=\"gmpo\"\nloss.delta=2.0",
            "does not apply to loss_type gmpo",
        ),
        ("loss.top_entropy_quantile=2.0", "top_entropy_quantile"),
        (
            "loss.use_adaptive_entropy=true",
            "`loss.use_adaptive_entropy` needs",
        ),
    ] {
        let mut sets: Vec<String> = set.split('\n').map(String::from).collect();
        if set.contains("adaptive") {
            sets.push("loss.entropy_coef_max=-1.0".into());
        }
        let e = config::load(&f.root.join("plain.toml"), &sets).unwrap_err();
        assert!(format!("{e:#}").contains(needle), "{set}: {e:#}");
    }
}

/// `[model] chat_template_kwargs` (TRL's name) reaches every chat template rendering of the run.
#[test]
fn chat_template_kwargs_reach_the_run_tokenizer() {
    let f = fixture();
    let cfg = base_config(
        &f.root,
        "kwargs",
        "[model.chat_template_kwargs]\nenable_thinking = false\nstyle = \"terse\"\n",
    );
    let setup = trainer::setup(cfg).unwrap();
    let mut tok = setup.tokenizer.clone();
    assert_eq!(
        tok.chat_template_kwargs.get("enable_thinking"),
        Some(&serde_json::Value::Bool(false))
    );
    tok.chat_template =
        Some("{{ messages[0]['content'] }}|{{ style }}|{{ enable_thinking }}".into());
    let text = tok
        .apply_chat_template(&[grpo_rollout::ChatMessage::new("user", "q")], true)
        .unwrap();
    // Rendered as jinja2 renders Python values.
    assert_eq!(text, "q|terse|False");
}

/// `train.shuffle_dataset = false` (TRL's name) trains on the rows in file order; the default
/// shuffles them (seeded).
#[test]
fn shuffle_dataset_false_reads_rows_in_file_order() {
    let f = fixture();
    let rows: Vec<String> = std::fs::read_to_string(f.root.join("arith.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["prompt"].as_str().unwrap().to_string()
        })
        .collect();
    let order = |name: &str, extra: &str| -> Vec<usize> {
        let mut cfg = base_config(&f.root, name, extra);
        cfg.train.num_completions_to_print = 100;
        run(cfg, RunOptions::default());
        let text = std::fs::read_to_string(f.root.join(name).join("completions.jsonl")).unwrap();
        let mut seen: Vec<usize> = Vec::new();
        for l in text.lines() {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            let p = v["prompt"].as_str().unwrap();
            let i = rows.iter().position(|r| p.contains(r.as_str())).unwrap();
            if seen.last() != Some(&i) {
                seen.push(i);
            }
        }
        seen
    };
    assert_eq!(
        order("in_order", "shuffle_dataset = false\n"),
        (0..8).collect::<Vec<_>>()
    );
    assert_ne!(order("shuffled", ""), (0..8).collect::<Vec<_>>());
}

/// `train.disable_dropout` (TRL's name) trains LoRA as with `lora_dropout = 0` (the saved
/// adapter config keeps the configured value); TRL's deprecated `vllm_importance_sampling_cap`
/// is read as `vllm_importance_sampling_clip_max`.
#[test]
fn disable_dropout_trains_lora_without_dropout() {
    let f = fixture();
    let lora = |p: f64| {
        format!(
            "[model.lora]\nr = 4\nlora_alpha = 8\nlora_dropout = {p:?}\ntarget_modules = [\"q_proj\", \"v_proj\"]\n"
        )
    };
    let runs: Vec<_> = [
        ("no_dropout", lora(0.0), false),
        ("disabled", lora(0.5), true),
        ("dropout", lora(0.5), false),
    ]
    .into_iter()
    .map(|(name, extra, disable)| {
        let mut cfg = base_config(&f.root, name, &extra);
        cfg.train.max_steps = Some(2);
        cfg.train.disable_dropout = Some(disable);
        run(cfg, RunOptions::default())
    })
    .collect();
    assert_same(&runs[0].metrics, &runs[1].metrics);
    assert_ne!(
        strip_timing(&runs[1].metrics),
        strip_timing(&runs[2].metrics)
    );
    let ck = runs[1].best_checkpoint_path.clone().unwrap();
    let adapter = std::fs::read_to_string(ck.join("adapter/adapter_config.json")).unwrap();
    assert!(adapter.contains("\"lora_dropout\": 0.5"), "{adapter}");

    let _ = base_config(&f.root, "cap", "");
    let cfg = config::load(
        &f.root.join("cap.toml"),
        &["loss.vllm_importance_sampling_cap=2.5".into()],
    )
    .unwrap();
    assert_eq!(cfg.loss.vllm_importance_sampling_clip_max, 2.5);
}

/// TRL's `steps_per_generation`: with `gradient_accumulation_steps` equal to it, one update
/// per batch exactly as the default; with `gradient_accumulation_steps = 1` (TRL's default)
/// each batch feeds that many updates, the later ones off the old log-probs.
#[test]
fn steps_per_generation_splits_a_batch_into_updates() {
    let f = fixture();
    struct Updates(std::rc::Rc<std::cell::RefCell<Vec<usize>>>);
    impl grpo_trainer::Callbacks for Updates {
        fn on_step_end(&mut self, s: &grpo_trainer::TrainerState, _: &grpo_trainer::Metrics) {
            self.0.borrow_mut().push(s.optimizer_steps);
        }
    }
    let go = |name: &str, spg: Option<usize>, ga: Option<usize>| {
        let seen = std::rc::Rc::new(std::cell::RefCell::new(Vec::new()));
        let mut cfg = base_config(&f.root, name, "");
        (
            cfg.optim.steps_per_generation,
            cfg.optim.gradient_accumulation_steps,
        ) = (spg, ga);
        let setup = trainer::setup(cfg).unwrap();
        let r = trainer::run(setup, &RunOptions::default(), &mut Updates(seen.clone())).unwrap();
        let updates = seen.borrow().clone();
        (r, updates)
    };
    let (plain, u0) = go("spg_plain", None, None);
    let (same, u1) = go("spg_same", Some(2), Some(2));
    assert_same(&plain.metrics, &same.metrics);
    assert_eq!((u0, u1), (vec![1, 2, 3, 4], vec![1, 2, 3, 4]));
    let (split, u2) = go("spg_split", Some(2), None);
    assert_eq!(u2, vec![2, 4, 6, 8]);
    assert_ne!(strip_timing(&plain.metrics), strip_timing(&split.metrics));
    assert!(split.metrics.iter().all(|m| m["loss"].is_finite()));
    for (set, needle) in [
        ("optim.steps_per_generation=3", "must divide"),
        ("optim.steps_per_generation=0", "must be >= 1"),
    ] {
        let e = config::load(&f.root.join("spg_plain.toml"), &[set.into()]).unwrap_err();
        assert!(format!("{e:#}").contains(needle), "{set}: {e:#}");
    }
}

/// TRL's `cast_lm_head_to_fp32` on a bf16 model: the head trains in f32 beside bf16 layers
/// (the checkpoint holds it in f32), a synced reference keeps it, and resume is exact.
#[test]
fn an_f32_head_on_a_bf16_model_trains_syncs_and_resumes() {
    let f = fixture();
    let extra = "[reference]\nbeta = 0.04\nsync_ref_model = true\nref_model_sync_steps = 2\n";
    let with_head = |out: &str| {
        let mut c = base_config(&f.root, out, extra);
        c.model.dtype = grpo_rollout::Dtype::Bf16;
        c.model.cast_lm_head_to_fp32 = true;
        c
    };
    let straight = run(with_head("f32head"), RunOptions::default());
    assert!(straight.metrics.iter().all(|m| m["loss"].is_finite()));
    let mut cfg = with_head("f32head-parts");
    cfg.train.save_steps = 0;
    assert_same(&straight.metrics, &stopped_and_resumed(cfg, 2));
    let saved = candle_core::safetensors::load(
        f.root
            .join("f32head/checkpoints/step-4/model/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    let head = saved
        .get("lm_head.weight")
        .or_else(|| saved.get("model.embed_tokens.weight"))
        .unwrap();
    assert_eq!(head.dtype(), candle_core::DType::F32);
    assert_eq!(
        saved["model.layers.0.mlp.up_proj.weight"].dtype(),
        candle_core::DType::BF16
    );
}

/// RLOO (TRL 1.16's RLOOTrainer) on the GRPO pipeline: the KL penalty is 0 while the policy
/// is the reference and then changes the advantages; the sequence clip ratios are logged;
/// resume is exact; what RLOO cannot use is refused.
#[test]
fn rloo_trains_with_the_kl_in_the_reward_and_resumes() {
    let f = fixture();
    let with_rloo = |out: &str| {
        let mut c = base_config(&f.root, out, "");
        c.algorithm = grpo_trainer::Algorithm::Rloo;
        c.rloo.beta = 0.1;
        c
    };
    let straight = run(with_rloo("rloo"), RunOptions::default());
    let m = &straight.metrics;
    assert_eq!(m.len(), 4);
    for k in [
        "loss",
        "kl",
        "reward",
        "clip_ratio/region_mean",
        "entropy",
        "grad_norm",
    ] {
        assert!(m.iter().all(|x| x[k].is_finite()), "{k}: {m:?}");
    }
    // Step 1 runs at learning rate 0 (one warm-up step): steps 1 and 2 see the reference.
    for x in &m[..2] {
        assert!(x["loss"].abs() < 1e-6, "{x:?}");
        assert!(x["kl"].abs() < 1e-6, "{x:?}");
    }
    // Step 2 updated the policy (with advantages the penalty did not change yet: KL 0), so
    // step 3 samples the same completions with and without the penalty; there the KL is not 0
    // and the penalised advantages, so the gradient, differ from the unpenalised ones (β = 0:
    // no reference model). (The loss itself is 0 either way: leave-one-out advantages sum to 0
    // over a group, and ρ = 1 with one update per batch.)
    assert!(m[2]["kl"].abs() > 1e-7, "{:?}", m[2]);
    let mut c = with_rloo("rloo-nokl");
    c.rloo.beta = 0.0;
    let free = run(c, RunOptions::default());
    let (a, b) = (&free.metrics[2], &m[2]);
    assert_eq!(a["reward"], b["reward"]);
    assert!(a["loss"].abs() < 1e-6 && b["loss"].abs() < 1e-6);
    let (ga, gb) = (a["grad_norm"], b["grad_norm"]);
    assert!(
        (ga - gb).abs() > 1e-6 * ga.max(gb),
        "grad norms {ga} and {gb}"
    );
    let mut cfg = with_rloo("rloo-parts");
    cfg.train.save_steps = 0;
    assert_same(&straight.metrics, &stopped_and_resumed(cfg, 2));
    // One generation has no leave-one-out baseline; the KL penalty is `rloo.beta`.
    let mut c = with_rloo("bad");
    c.rollout.num_generations = 1;
    let e = c.validate().unwrap_err();
    assert!(e.contains("num_generations"), "{e}");
    let mut c = with_rloo("bad");
    c.reference.beta = 0.04;
    assert!(c.validate().unwrap_err().contains("rloo.beta"));
    // Its loss is per sequence: a token-level off-policy correction is refused.
    let mut c = with_rloo("bad");
    c.loss.vllm_importance_sampling_mode = grpo_core::loss::ImportanceSamplingMode::TokenTruncate;
    assert!(c.validate().unwrap_err().contains("sequence_mask"));
}

/// RLOO on the pipelined loop with `max_staleness = 1`: step s samples with version s − 1, each
/// sequence is weighed by its sampling ratio (sequence_mask, TRL's default mode), runs are
/// reproducible, and the correction changes the update once the samples are off-policy.
#[test]
fn rloo_overlaps_generation_with_staleness_and_corrects_it() {
    let f = fixture();
    let stale = |out: &str, correct: bool| {
        let mut c = base_config(&f.root, out, "");
        c.algorithm = grpo_trainer::Algorithm::Rloo;
        c.rloo.beta = 0.1;
        c.pipeline.max_staleness = 1;
        c.loss.vllm_importance_sampling_correction = correct;
        c
    };
    let a = run(stale("rloo-stale-a", true), RunOptions::default());
    let b = run(stale("rloo-stale-b", true), RunOptions::default());
    assert_same(&a.metrics, &b.metrics);
    for (s, m) in a.metrics.iter().enumerate() {
        assert_eq!(m["policy_version"], s.saturating_sub(1) as f64, "step {s}");
        let (lo, hi) = (
            m["sampling/importance_sampling_ratio/min"],
            m["sampling/importance_sampling_ratio/max"],
        );
        assert!(
            lo >= 0.0 && hi <= 3.0 && m["loss"].is_finite(),
            "step {s}: {m:?}"
        );
    }
    let off = run(stale("rloo-stale-off", false), RunOptions::default());
    let differs = a.metrics.iter().zip(&off.metrics).any(|(x, y)| {
        let (g, h) = (x["grad_norm"], y["grad_norm"]);
        (g - h).abs() > 1e-6 * g.max(h)
    });
    let off_policy = a.metrics[1..]
        .iter()
        .any(|m| m["sampling/sampling_logp_difference/max"] > 1e-4);
    assert!(off_policy, "later batches are sampled by an older policy");
    assert!(differs, "the correction changed no update");
}

/// A full fine-tune at `max_staleness = 0` publishes its own weights (no copy: an update
/// written into the learner's variables shows in the published version), at staleness 1 a
/// copy (the generator samples while the learner updates).
#[test]
fn a_full_fine_tune_at_staleness_0_publishes_its_own_weights() {
    let f = fixture();
    for (staleness, shared) in [(0usize, true), (1, false)] {
        let cfg = base_config(
            &f.root,
            &format!("share{staleness}"),
            &format!("[pipeline]\nmax_staleness = {staleness}\n"),
        );
        let setup = trainer::setup(cfg).unwrap();
        let (learner, _) = trainer::run_dir::open_run(&setup, &RunOptions::default()).unwrap();
        assert_eq!(learner.shares_published_weights(), shared);
        let published = learner.publish().unwrap();
        let name = "model.layers.0.mlp.down_proj.weight";
        let (_, var) = learner
            .policy()
            .vars
            .iter()
            .find(|(n, _)| n == name)
            .unwrap();
        let before: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        var.set(&(var.as_tensor() * 2.0).unwrap()).unwrap();
        let (_, w) = published
            .weights()
            .into_iter()
            .find(|(n, _)| n == name)
            .unwrap();
        let seen: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let doubled: Vec<f32> = before.iter().map(|x| x * 2.0).collect();
        assert_eq!(seen == doubled, shared, "staleness {staleness}");
        assert_eq!(seen == before, !shared, "staleness {staleness}");
    }
}

/// `optim.optim = "adamw_8bit"` (bitsandbytes' 8-bit AdamW): a GRPO run trains, its
/// checkpoint holds the 8-bit state (bytes and block maxima, the embeddings' moments in f32
/// as transformers keeps them), and a stopped run resumes to the same metrics; TRL's other
/// names for it parse, an unknown one is refused naming the key.
#[test]
fn adamw_8bit_trains_checkpoints_its_state_and_resumes() {
    let f = fixture();
    let eight = |out: &str| {
        let mut c = base_config(&f.root, out, "");
        c.optim.optim = grpo_trainer::config::OptimName::Adamw8bit;
        c
    };
    let straight = run(eight("adam8"), RunOptions::default());
    assert!(straight.metrics.iter().all(|m| m["loss"].is_finite()));
    let ck = straight.best_checkpoint_path.clone().unwrap();
    let state = std::fs::read_dir(&ck)
        .unwrap()
        .map(|e| e.unwrap().path())
        .find(|p| p.to_string_lossy().contains("optim"))
        .expect("an optimizer state file");
    let saved = candle_core::safetensors::load(&state, &candle_core::Device::Cpu).unwrap();
    let q8: Vec<&String> = saved
        .keys()
        .filter(|k| k.ends_with(".exp_avg.q8"))
        .collect();
    assert!(!q8.is_empty(), "8-bit moments saved: {:?}", saved.keys());
    for k in &q8 {
        assert_eq!(saved[*k].dtype(), candle_core::DType::U8);
    }
    assert_eq!(
        saved["model.embed_tokens.weight.exp_avg"].dtype(),
        candle_core::DType::F32
    );
    let mut cfg = eight("adam8-parts");
    cfg.train.save_steps = 0;
    assert_same(&straight.metrics, &stopped_and_resumed(cfg, 2));
    // The 8-bit run follows the 32-bit one closely on this tiny model (same data, seed).
    let plain = run(base_config(&f.root, "adam32", ""), RunOptions::default());
    let (a, b) = (
        straight.metrics.last().unwrap()["loss"],
        plain.metrics.last().unwrap()["loss"],
    );
    assert!(
        (a - b).abs() < 0.05 * b.abs().max(1.0),
        "8-bit {a} vs 32-bit {b}"
    );
    // transformers' names, from a config or --set; an unknown one is refused naming the key.
    let file = f.root.join("adam32.toml");
    for name in [
        "adamw_8bit",
        "adamw_bnb_8bit",
        "paged_adamw_8bit",
        "adamw_torch_fused",
    ] {
        let c = config::load(&file, &[format!("optim.optim={name}")]).unwrap();
        assert_eq!(c.optim.optim.eight_bit(), name.contains("8bit"), "{name}");
    }
    let e = config::load(&file, &["optim.optim=lion_8bit".into()])
        .unwrap_err()
        .to_string();
    assert!(e.contains("optim.optim") && e.contains("adamw_8bit"), "{e}");
}

/// `train.token_budget` (TRL AsyncGRPO's, verl's dynamic batch size): micro-batches formed by
/// padded tokens, of unequal sizes, weigh each completion as one micro-batch of the whole step
/// does, so every step's gradient (and so the run) is the same.
#[test]
fn a_token_budget_changes_the_micro_batches_not_the_run() {
    let f = fixture();
    for loss in ["grpo", "dapo", "dr_grpo"] {
        let extra = |budget: &str| format!("{budget}\n[loss]\nloss_type = \"{loss}\"");
        let mut whole = base_config(&f.root, &format!("whole-{loss}"), &extra(""));
        whole.train.per_device_train_batch_size = Some(8);
        let a = run(whole, RunOptions::default()).metrics;
        assert_eq!(a.len(), 4);
        // Rows of 12 padded tokens here: micro-batches of 3 + 3 + 2 completions, then 5 + 3.
        for budget in [36, 60] {
            let budgeted = base_config(
                &f.root,
                &format!("budget-{loss}-{budget}"),
                &extra(&format!("token_budget = {budget}")),
            );
            assert_eq!(budgeted.train.token_budget, Some(budget));
            let b = run(budgeted, RunOptions::default()).metrics;
            common::assert_same_steps(&a, &b, &["reward", "grad_norm", "completions/mean_length"]);
        }
    }
}
