//! Every example config in `configs/` trains end to end on a tiny generated model: the keys
//! parse, the rewards build, two steps run. The judge config talks to the loopback server.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_tests::loopback::{LoopbackServer, ServerConfig};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions};

fn configs_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../configs")
}

fn fixture(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model");
    init_model_dir(&model, Preset::Tiny, Arch::Llama, 5).unwrap();
    let data = dir.join("arith.parquet");
    let synth = ArithmeticConfig {
        n: 32,
        seed: 2,
        digits: 1,
        steps: 1,
    };
    synth.write(&data).unwrap();
    (model, data)
}

fn quote(p: &Path) -> String {
    format!("\"{}\"", p.display())
}

/// `configs/{name}` on `model` and `data` for `steps` steps into `dir/{out}` (checkpoints at the
/// end), with `extra` overrides.
fn load_example(
    name: &str,
    dir: &Path,
    out: &str,
    (model, data): (&Path, &Path),
    steps: usize,
    extra: &[String],
) -> config::TrainConfig {
    let mut sets = vec![
        format!("output_dir={}", quote(&dir.join(out))),
        format!("model.path={}", quote(model)),
        format!("data.path=[{}]", quote(data)),
        format!("train.max_steps={steps}"),
        format!("train.save_steps={steps}"),
    ];
    sets.extend_from_slice(extra);
    config::load(&configs_dir().join(name), &sets).unwrap()
}

/// Runs a loaded setup to its end.
fn run_setup(s: trainer::Setup) -> grpo_trainer::TrainingResult {
    trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap()
}

fn train(name: &str, extra: &[String]) -> (tempfile::TempDir, grpo_trainer::TrainingResult) {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let mut sets = vec![
        format!("output_dir={}", quote(&dir.path().join("run"))),
        format!("model.path={}", quote(&model)),
        format!("data.path=[{}]", quote(&data)),
        "train.max_steps=2".to_string(),
        "train.prompts_per_step=2".to_string(),
        "rollout.num_generations=4".to_string(),
        "rollout.max_completion_length=6".to_string(),
    ];
    sets.extend_from_slice(extra);
    let cfg = config::load(&configs_dir().join(name), &sets).unwrap();
    // Drop the per-device batch so 2 × 4 completions fit any config's geometry.
    let mut cfg = cfg;
    cfg.train.per_device_train_batch_size = None;
    cfg.optim.gradient_accumulation_steps = None;
    let setup = trainer::setup(cfg).unwrap();
    let r = trainer::run(
        setup,
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.total_steps, 2, "{name}");
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()), "{name}");
    (dir, r)
}

#[test]
fn quickstart_config_trains() {
    let (_dir, r) = train("quickstart.toml", &[]);
    assert!(r.metrics[0].contains_key("rewards/accuracy/mean"));
}

#[test]
fn calculator_config_trains_with_the_tool_environment() {
    let (_dir, r) = train(
        "calculator.toml",
        &["environment.max_tokens_per_turn=6".into()],
    );
    for k in [
        "rewards/accuracy/mean",
        "env/tool_calls_mean",
        "env/turns_mean",
    ] {
        assert!(r.metrics[0].contains_key(k), "{k}");
    }
    // Its calculator is `expr`, called as the model calls it.
    let cfg = config::load(&configs_dir().join("calculator.toml"), &[]).unwrap();
    let workers = grpo_rewards::python::PythonWorkers::new();
    let tool = cfg.environment.tools[0].build(&workers).unwrap();
    let call = grpo_rollout::tools::parse_tool_calls(&grpo_cli::calculator::tool_call(37, 48));
    let args = &call[0].as_ref().unwrap().function.arguments;
    assert_eq!(tool.call(args).unwrap(), "1776");
    assert_eq!(
        tool.call(&serde_json::json!({"a": 7, "op": "-", "b": 9}))
            .unwrap(),
        "-2"
    );
    let e = tool
        .call(&serde_json::json!({"a": "x", "op": "*", "b": 9}))
        .unwrap_err();
    assert!(e.contains("exited with status"), "{e}");
}

#[test]
fn ors_config_trains_against_an_ors_server() {
    use grpo_rollout::ors::{OrsClient, OrsConfig, TaskSelection, task_rows};
    let server = grpo_tests::ors_server::OrsServer::start().unwrap();
    let dir = tempfile::tempdir().unwrap();
    let tasks = dir.path().join("tasks.jsonl");
    let rows = tokio::runtime::Runtime::new()
        .unwrap()
        .block_on(async {
            let client = OrsClient::new(&OrsConfig::new(server.url()))?;
            task_rows(&client, "arith", "train", &TaskSelection::All, true).await
        })
        .unwrap();
    let text: String = rows.iter().map(|r| format!("{r}\n")).collect();
    std::fs::write(&tasks, text).unwrap();
    let (_dir, r) = train(
        "ors.toml",
        &[
            format!("environment.ors.url=\"{}\"", server.url()),
            format!("data.path=[{}]", quote(&tasks)),
        ],
    );
    assert!(
        r.metrics
            .iter()
            .all(|m| m.contains_key("env/ors_finished_ratio"))
    );
    // The probe session and one per episode (2 steps × 2 prompts × 4), all closed.
    assert_eq!(server.stats().created, 17);
    assert_eq!(server.live_sessions(), 0);
}

#[test]
fn smollm2_config_trains_with_lora_on_a_tiny_model() {
    // The config's model is the SmolLM2 GGUF; its LoRA / loss / reward keys are tested here on
    // the tiny model (the GGUF itself is covered by grpo-rollout's tests when present).
    let (_dir, r) = train(
        "smollm2-arithmetic.toml",
        &["rollout.max_completion_length=6".into()],
    );
    assert!(r.metrics[0].contains_key("rewards/answer_tag/mean"));
    let ck = r.best_checkpoint_path.unwrap();
    assert!(ck.join("adapter/adapter_model.safetensors").exists());
}

#[test]
fn judge_config_trains_against_the_loopback_server() {
    let server = LoopbackServer::start(ServerConfig::default()).unwrap();
    let cache = tempfile::tempdir().unwrap();
    let (_dir, r) = train(
        "judge.toml",
        &[
            format!("rewards[1].base_url=\"{}\"", server.base_url()),
            format!(
                "rewards[1].cache_path={}",
                quote(&cache.path().join("c.sqlite"))
            ),
            // Any variable that is set: the loopback server ignores the key.
            "rewards[1].api_key_env=\"CARGO_PKG_NAME\"".to_string(),
        ],
    );
    let m = &r.metrics[0];
    // The loopback judge answers 0.5 when the prompt carries no SCORE=: mean exactly 0.5.
    assert_eq!(m["rewards/clarity/mean"], 0.5);
    assert!(server.stats().requests >= 8);
}

fn python3() -> bool {
    let ok = std::process::Command::new("python3")
        .args(["-c", "pass"])
        .status()
        .is_ok_and(|s| s.success());
    if !ok {
        eprintln!("skipping: python3 is not available");
    }
    ok
}

/// code_reward.toml runs `scripts/...` relative to the repository root; the tests run
/// elsewhere, so they give the script's absolute path and the data's.
fn code_reward_sets() -> Vec<String> {
    let script = configs_dir().join("../scripts/run_python_tests.py");
    vec![
        format!(
            "data.path=[{}]",
            quote(&configs_dir().join("data/python_functions.jsonl"))
        ),
        format!("rewards[0].argv=[{}, \"{{tests}}\"]", quote(&script)),
    ]
}

#[test]
fn code_reward_config_trains_with_a_command_reward() {
    if !python3() {
        return;
    }
    // Its own argv[0] is the script, relative to the repository root, and executable.
    let cfg = config::load(&configs_dir().join("code_reward.toml"), &[]).unwrap();
    let grpo_rewards::RewardKind::Command(c) = &cfg.rewards[0].kind else {
        panic!("{:?}", cfg.rewards[0].kind)
    };
    #[cfg(unix)]
    {
        use std::os::unix::fs::PermissionsExt;
        let script = configs_dir().join("..").join(&c.argv[0]);
        let mode = std::fs::metadata(&script).unwrap().permissions().mode();
        assert!(mode & 0o111 != 0, "{} is not executable", script.display());
    }
    assert_eq!(c.columns(), vec!["tests".to_owned()]);

    let (_dir, r) = train("code_reward.toml", &code_reward_sets());
    for m in &r.metrics {
        // The tiny model writes no working code: every completion scores 0, none fails.
        assert_eq!(m["rewards/tests/mean"], 0.0, "{m:?}");
        assert_eq!(m["rewards/tests/failures"], 0.0, "{m:?}");
        assert_eq!(m["rewards/tests/timeouts"], 0.0, "{m:?}");
    }
}

#[test]
fn quiz_config_trains_without_a_dataset() {
    if !python3() {
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = fixture(dir.path());
    let sets = [
        format!("output_dir={}", quote(&dir.path().join("run"))),
        format!("model.path={}", quote(&model)),
        format!(
            "environment.python.path={}",
            quote(&configs_dir().join("quiz.py"))
        ),
        "train.max_steps=2".to_string(),
        "train.prompts_per_step=2".to_string(),
        "rollout.max_completion_length=6".to_string(),
    ];
    let cfg = config::load(&configs_dir().join("quiz.toml"), &sets).unwrap();
    assert!(cfg.data.path.is_empty());
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m["env/get_reward_mean"].is_finite(),
            "{m:?}"
        );
    }
}

#[test]
fn code_reward_scores_correct_and_incorrect_solutions() {
    if !python3() {
        return;
    }
    let cfg = config::load(&configs_dir().join("code_reward.toml"), &code_reward_sets()).unwrap();
    let set = cfg
        .rewards_config()
        .build(&grpo_rewards::ScoringModels::default())
        .unwrap();
    let first = std::fs::read_to_string(configs_dir().join("data/python_functions.jsonl")).unwrap();
    let row: serde_json::Value = serde_json::from_str(first.lines().next().unwrap()).unwrap();
    let tests: Vec<String> = serde_json::from_value(row["tests"].clone()).unwrap();
    assert_eq!(tests[0], "assert add(1, 2) == 3");
    let input = |completion: &str| {
        grpo_rewards::RewardInput::new(row["prompt"].as_str().unwrap(), completion)
            .with_field("tests", grpo_rewards::FieldValue::StrList(tests.clone()))
    };
    let batch = [
        input("Here it is:\n```python\ndef add(a, b):\n    return a + b\n```\nDone."),
        input("def add(a, b):\n    return a + b\n"),
        // add(0, 0) == 0 still holds: one test of three.
        input("```python\ndef add(a, b):\n    return a - b\n```"),
        input("The sum of a and b is a + b."),
        input("```python\nimport os\nos._exit(3)\n```"),
    ];
    let scored = set.score(&batch).unwrap();
    let third = 1.0f32 / 3.0;
    assert_eq!(
        scored.per_function[0][..4],
        [Some(1.0), Some(1.0), Some(third), Some(0.0)]
    );
    // The interpreter exits before printing a score: a failure, scored on_failure = 0.
    assert_eq!(scored.per_function[0][4], Some(0.0));
    assert_eq!(scored.metrics["rewards/tests/failures"], 1.0);
    assert_eq!(scored.info[0][4].as_ref().unwrap()["status"], "exit_code");

    // Data without the `tests` column is refused before training, naming the placeholder.
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let mut sets = code_reward_sets();
    sets.push(format!("data.path=[{}]", quote(&data)));
    sets.push(format!("model.path={}", quote(&model)));
    sets.push(format!("output_dir={}", quote(&dir.path().join("run"))));
    let cfg = config::load(&configs_dir().join("code_reward.toml"), &sets).unwrap();
    let err = trainer::setup(cfg).map(|_| ()).unwrap_err().to_string();
    assert!(
        err.contains("no column `tests`") && err.contains("`{tests}` in `rewards[0].argv`"),
        "{err}"
    );
}

#[test]
fn unsupervised_config_trains_with_inverse_loss() {
    let (_dir, r) = train("unsupervised.yaml", &[]);
    let m = &r.metrics[0];
    // −mean NLL: negative, finite.
    assert!(m["rewards/inverse_loss/mean"] < 0.0, "{m:?}");
    assert!(m["kl"].is_finite());
}

#[test]
fn supervised_config_trains_with_coverage_ce() {
    let (_dir, r) = train("supervised.yaml", &[]);
    let m = &r.metrics[0];
    assert!(m["rewards/coverage_ce/mean"] <= 0.0, "{m:?}");
    assert!(m.contains_key("rewards/accuracy/mean"));
}

#[test]
fn teacher_config_trains_with_a_tiny_student() {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let student = dir.path().join("student");
    init_model_dir(&student, Preset::Tiny, Arch::Qwen2, 9).unwrap();
    let run_dir = dir.path().join("run");
    let sets = vec![
        format!("output_dir={}", quote(&run_dir)),
        format!("model.path={}", quote(&model)),
        format!("data.path=[{}]", quote(&data)),
        format!("teacher.student_model={}", quote(&student)),
        "teacher.logging_prob=1.0".to_string(),
        "teacher.max_probe_tokens=4".to_string(),
        "teacher.max_student_tokens=6".to_string(),
        "train.max_steps=3".to_string(),
        "train.prompts_per_step=2".to_string(),
        "rollout.num_generations=4".to_string(),
        "rollout.max_completion_length=8".to_string(),
    ];
    let cfg = config::load(&configs_dir().join("teacher.toml"), &sets).unwrap();
    let setup = trainer::setup(cfg).unwrap();
    let protocol = setup.teaching.clone().unwrap();
    let r = trainer::run(
        setup,
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.total_steps, 3);
    for m in &r.metrics {
        assert!(m["loss"].is_finite());
        assert!(m["rewards/adaptive_teaching/mean"].is_finite(), "{m:?}");
        for k in [
            "teacher/with_teaching_accuracy",
            "teacher/baseline_accuracy",
            "teacher/degradation_rate",
            "teacher/mean_teaching_tokens",
        ] {
            assert!(m[k].is_finite(), "{k}: {m:?}");
        }
    }
    // Every problem logged (logging_prob 1): the reward is the formula of the logged answers.
    let log = std::fs::read_to_string(run_dir.join("teacher_log.jsonl")).unwrap();
    let mut problems = std::collections::BTreeSet::new();
    let params = grpo_teacher::TeachingRewardParams::default();
    let lines: Vec<serde_json::Value> = log
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 3 * 2);
    for v in &lines {
        let q = v["question"].as_str().unwrap();
        problems.insert(q.to_owned());
        assert!(v["diagnostic"]["probe_tokens"].as_u64().unwrap() <= 4);
        let teachings = v["teachings"].as_array().unwrap();
        assert_eq!(teachings.len(), 4);
        for t in teachings {
            let info = &t["info"]["adaptive_teaching"];
            let w = info["with_teaching"].as_f64().unwrap() as f32;
            let b = info["baseline"].as_f64().unwrap() as f32;
            let n = info["teaching_tokens"].as_u64().unwrap() as usize;
            let want = params.reward(w, b, n);
            assert!((t["reward"].as_f64().unwrap() as f32 - want).abs() < 1e-5);
            // The student's answer scored by exact match of its <solution>.
            let sol = t["student_solution"].as_str().unwrap();
            assert_eq!(
                sol,
                grpo_teacher::extract_solution(t["student_response"].as_str().unwrap())
            );
        }
    }
    // The student's baseline was computed once per distinct problem.
    assert_eq!(protocol.baseline_runs(), problems.len());
}

#[test]
fn teacher_config_with_smollm2_as_the_student() {
    let gguf = match std::env::var_os("GRPO_SMOLLM2_GGUF") {
        Some(p) => PathBuf::from(p),
        None => configs_dir().join("../models/SmolLM2-135M-Instruct.Q4_1.gguf"),
    };
    if !gguf.exists() {
        eprintln!(
            "skipping: {} not found (run scripts/fetch-smollm2.sh, or set GRPO_SMOLLM2_GGUF)",
            gguf.display()
        );
        return;
    }
    let (_dir, r) = train(
        "teacher.toml",
        &[
            format!("teacher.student_model={}", quote(&gguf)),
            "teacher.max_probe_tokens=8".to_string(),
            "teacher.max_student_tokens=12".to_string(),
            "teacher.logging_prob=0.0".to_string(),
        ],
    );
    assert!(r.metrics[0]["teacher/baseline_accuracy"].is_finite());
}

/// Runs configs/teacher.toml for `steps` steps on the tiny fixture with extra `--set`s.
fn train_teacher(dir: &Path, name: &str, extra: &[String]) -> grpo_trainer::TrainingResult {
    let (model, data) = (dir.join("model"), dir.join("arith.parquet"));
    if !model.exists() {
        fixture(dir);
    }
    let mut sets = vec![
        format!("output_dir={}", quote(&dir.join(name))),
        format!("model.path={}", quote(&model)),
        format!("data.path=[{}]", quote(&data)),
        "teacher.student_model=\"\"".to_string(),
        "teacher.max_probe_tokens=4".to_string(),
        "teacher.max_student_tokens=6".to_string(),
        "train.max_steps=3".to_string(),
        "train.prompts_per_step=2".to_string(),
        "train.num_completions_to_print=8".to_string(),
        "rollout.num_generations=4".to_string(),
        "rollout.max_completion_length=8".to_string(),
        "pipeline.max_staleness=0".to_string(),
    ];
    sets.extend_from_slice(extra);
    let mut cfg = config::load(&configs_dir().join("teacher.toml"), &sets).unwrap();
    // No student path: the reference model (the policy as loaded) is the student.
    cfg.teacher.as_mut().unwrap().student_model = None;
    let setup = trainer::setup(cfg).unwrap();
    trainer::run(
        setup,
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

/// `[teacher]` with DAPO's dynamic sampling on a value the teaching reward logs (each
/// teaching's length: a tiny student earns the same teaching reward everywhere): the teaching
/// of each prompt travels with its group, and it trains.
#[test]
fn teacher_config_with_dynamic_sampling() {
    let dir = tempfile::tempdir().unwrap();
    let sets = [
        "loss.filter_groups.enable=true".to_string(),
        "loss.filter_groups.metric=\"teaching_tokens\"".to_string(),
        "loss.filter_groups.max_num_gen_batches=20".to_string(),
    ];
    let r = train_teacher(dir.path(), "filtered", &sets);
    assert_eq!(r.metrics.len(), 3);
    for m in &r.metrics {
        assert!(m["filter_groups/num_gen_batches"] >= 1.0);
        for k in [
            "loss",
            "teacher/with_teaching_accuracy",
            "rewards/adaptive_teaching/mean",
        ] {
            assert!(m[k].is_finite(), "{k}: {m:?}");
        }
    }
}

/// An environment that answers the teacher's first turn once ("Check your guidance.") and
/// ends the episode at its second, rewarding the second turn's length parity.
struct Review;

impl grpo_rollout::Environment for Review {
    fn name(&self) -> &str {
        "review"
    }

    fn step(
        &self,
        logs: &[&[grpo_rollout::ChatMessage]],
        _: &[&serde_json::Value],
    ) -> candle_core::Result<grpo_rollout::EnvironmentReturn> {
        let mut out = grpo_rollout::EnvironmentReturn::empty(logs.len());
        for (i, log) in logs.iter().enumerate() {
            let turns = log.iter().filter(|m| m.role == "assistant").count();
            if turns >= 2 {
                out.terminateds[i] = true;
                out.rewards[i] = (log.last().unwrap().content.len() % 2) as f32;
            } else {
                out.observations[i] = Some(grpo_rollout::ChatMessage::new(
                    "user",
                    "Check your guidance.",
                ));
            }
        }
        Ok(out)
    }
}

/// `[teacher]` with an environment: the teacher's guidance is a multi-turn episode (its turns
/// and the environment's answers) written from the teacher prompt, which the student then
/// reads; the teaching reward and the environment's reward both count.
#[test]
fn teacher_config_runs_with_an_environment() {
    let dir = tempfile::tempdir().unwrap();
    fixture(dir.path());
    let sets = vec![
        format!("output_dir={}", quote(&dir.path().join("env"))),
        format!("model.path={}", quote(&dir.path().join("model"))),
        format!("data.path=[{}]", quote(&dir.path().join("arith.parquet"))),
        "teacher.max_probe_tokens=4".to_string(),
        "teacher.max_student_tokens=6".to_string(),
        "teacher.logging_prob=1.0".to_string(),
        "train.max_steps=2".to_string(),
        "train.prompts_per_step=2".to_string(),
        "train.num_completions_to_print=8".to_string(),
        "rollout.num_generations=4".to_string(),
        "rollout.max_completion_length=6".to_string(),
        "environment.max_turns=2".to_string(),
        "environment.max_total_tokens=80".to_string(),
    ];
    let mut cfg = config::load(&configs_dir().join("teacher.toml"), &sets).unwrap();
    cfg.teacher.as_mut().unwrap().student_model = None;
    let mut setup = trainer::setup(cfg).unwrap();
    setup.environment = Some(std::sync::Arc::new(Review));
    let r = trainer::run(
        setup,
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap();
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["loss"].is_finite(), "{m:?}");
        for k in [
            "rewards/adaptive_teaching/mean",
            "rewards/env/mean",
            "env/turns_mean",
            "teacher/baseline_accuracy",
        ] {
            assert!(m[k].is_finite(), "{k}: {m:?}");
        }
        assert!(m["env/turns_mean"] > 1.0, "{m:?}");
    }
    // The teacher's episodes start from the teacher prompt, and the environment's answer is
    // part of the guidance the student read.
    let lines = completions(&dir.path().join("env"));
    assert!(!lines.is_empty());
    for l in &lines {
        assert!(
            l["completion"]
                .as_str()
                .unwrap()
                .contains("Check your guidance."),
            "{l}"
        );
    }
    let log = std::fs::read_to_string(dir.path().join("env/teacher_log.jsonl")).unwrap();
    assert!(log.contains("Check your guidance."));
}

fn completions(run: &Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(run.join("completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

#[test]
fn teacher_with_a_rim_judge_ensemble_as_correctness() {
    let server = LoopbackServer::start(ServerConfig::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let url = server.base_url();
    let judge = |name: &str, score: &str| {
        format!(
            "{{ name = \"{name}\", weight = 1.0, base_url = \"{url}\", model = \"loopback\", \
             template = \"Grade {{{{ completion }}}} for {{{{ prompt }}}} SCORE={score}\" }}"
        )
    };
    let r = train_teacher(
        dir.path(),
        "rim",
        &[
            "teacher.correctness.type=\"judge_ensemble\"".into(),
            "teacher.correctness.mode=\"weighted\"".into(),
            format!(
                "teacher.correctness.judges=[{}, {}]",
                judge("helpfulness", "0.8"),
                judge("process", "0.4")
            ),
        ],
    );
    // Both answers get the same verdicts (0.6 weighted): delta 0, reward 0, no degradation.
    for m in &r.metrics {
        assert_eq!(
            m["teacher/with_teaching_accuracy"], 0.6000000238418579,
            "{m:?}"
        );
        assert_eq!(m["rewards/adaptive_teaching/mean"], 0.0);
        assert_eq!(m["teacher/degradation_rate"], 0.0);
    }
    let lines = completions(&dir.path().join("rim"));
    assert!(!lines.is_empty());
    for l in &lines {
        let info = &l["info"]["adaptive_teaching"];
        let score = |j: &str| info["rim_rewards"][j].as_f64().unwrap() as f32;
        assert_eq!(score("helpfulness"), 0.8);
        assert_eq!(score("process"), 0.4);
        assert!(
            info["rim_explanations"]["process"]
                .as_str()
                .unwrap()
                .starts_with("judged")
        );
    }
    // The judges saw the student's answers to the problem (the question, not the teacher's
    // prompt): 2 per teaching (with and without; baselines scored once per problem per step).
    let s = server.stats();
    assert!(s.requests >= 3 * 2 * (4 + 1) * 2, "{}", s.requests);
    let body = s.bodies[0]["messages"][0]["content"]
        .as_str()
        .unwrap()
        .to_owned();
    assert!(
        body.starts_with("Grade ") && body.contains(" for "),
        "{body}"
    );
}

#[test]
fn use_reference_teacher_model_samples_from_the_frozen_teacher() {
    let dir = tempfile::tempdir().unwrap();
    let text = |name: &str| -> Vec<String> {
        completions(&dir.path().join(name))
            .iter()
            .map(|l| l["completion"].as_str().unwrap().to_owned())
            .collect()
    };
    // A format reward besides the teaching reward (which is 0 while the random student never
    // answers right), so that the policy has something to learn.
    let sets = |lr: &str, frozen: bool| {
        vec![
            format!("optim.learning_rate={lr}"),
            // 1 when the teaching holds a digit: it varies within a group.
            r#"rewards=[{type="format", pattern='(?s).*\d.*'}]"#.into(),
            format!("teacher.use_reference_teacher_model={frozen}"),
        ]
    };
    // The frozen reference writes every teaching: the same as a policy that never moves.
    let frozen_run = train_teacher(dir.path(), "frozen", &sets("0.05", true));
    // The frozen teacher's samples are corrected as off-policy even with staleness 0: the ratio
    // is 1 while the policy still equals the reference, and moves once the policy does.
    let ratio = |m: &grpo_trainer::Metrics| m["sampling/importance_sampling_ratio/mean"];
    assert!((ratio(&frozen_run.metrics[0]) - 1.0).abs() < 1e-4);
    assert!((ratio(&frozen_run.metrics[2]) - 1.0).abs() > 1e-4);
    train_teacher(dir.path(), "still", &sets("0.0", false));
    train_teacher(dir.path(), "moving", &sets("0.05", false));
    let (frozen, still, moving) = (text("frozen"), text("still"), text("moving"));
    assert_eq!(frozen.len(), 3 * 8);
    assert_eq!(frozen, still);
    // The first step is sampled before any update either way; later ones by the moved policy.
    assert_eq!(frozen[..8], moving[..8]);
    assert_ne!(frozen[8..], moving[8..]);
}

#[test]
fn reward_model_config_trains_a_classifier_on_its_pairs() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = fixture(dir.path());
    let data = configs_dir().join("data/preference_pairs.jsonl");
    let cfg = load_example(
        "reward_model.toml",
        dir.path(),
        "run",
        (&model, &data),
        2,
        &[],
    );
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Reward);
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 2);
    assert!(
        r.metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m.contains_key("accuracy"))
    );
    let ck = r.best_checkpoint_path.unwrap().join("model");
    grpo_rollout::scoring::ClassifierModel::load(
        &ck,
        candle_core::DType::F32,
        &candle_core::Device::Cpu,
    )
    .unwrap();
}

#[test]
fn distillation_and_minillm_configs_train_the_student_on_its_samples() {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let teacher = dir.path().join("teacher");
    init_model_dir(&teacher, Preset::Tiny, Arch::Llama, 9).unwrap();
    let teacher_set = format!(
        "distillation.teacher_model_name_or_path={}",
        quote(&teacher)
    );
    let cfg = load_example(
        "distillation.toml",
        dir.path(),
        "run",
        (&model, &data),
        2,
        std::slice::from_ref(&teacher_set),
    );
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Distillation);
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["loss"].is_finite() && m["loss"] > 0.0, "{m:?}");
        assert!(m.contains_key("rewards/accuracy/mean"));
    }
    // `configs/minillm.toml`: the same teacher, GRPO's rewards trained on.
    let cfg = load_example(
        "minillm.toml",
        dir.path(),
        "minillm",
        (&model, &data),
        2,
        &[teacher_set],
    );
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::MiniLlm);
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m["minillm/single_step_kl"] > 0.0,
            "{m:?}"
        );
        assert!(m.contains_key("rewards/accuracy/mean"));
    }
}

/// `configs/ppo.toml`: one sample per prompt, the value model beside the policy, TRL's
/// metrics; the checkpoint holds the value model.
#[test]
fn the_ppo_config_trains_the_policy_and_its_value_model() {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let cfg = load_example("ppo.toml", dir.path(), "ppo", (&model, &data), 2, &[]);
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Ppo);
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["loss"].is_finite() && m["loss/value_avg"] > 0.0, "{m:?}");
        assert!(m.contains_key("objective/rlhf_reward") && m.contains_key("rewards/accuracy/mean"));
    }
    let ck = r.best_checkpoint_path.unwrap();
    assert!(ck.join("model/config.json").exists() && ck.join("value_model/config.json").exists());
}

/// `configs/reinforce_pp.toml`: verl's REINFORCE++ with the KL in the reward; the step logs
/// verl's in-reward KL metrics.
#[test]
fn the_reinforce_pp_config_trains_with_the_kl_in_the_reward() {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let cfg = load_example(
        "reinforce_pp.toml",
        dir.path(),
        "rf",
        (&model, &data),
        2,
        &[],
    );
    assert_eq!(
        cfg.loss.adv_estimator,
        grpo_core::estimators::AdvEstimator::ReinforcePlusPlus
    );
    let s = trainer::setup(cfg).unwrap();
    assert!(
        s.reference.is_some(),
        "the in-reward KL loads the reference"
    );
    let r = run_setup(s);
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["loss"].is_finite(), "{m:?}");
        assert_eq!(m["actor/reward_kl_penalty_coeff"], 0.001);
    }
}

/// `configs/dapo.toml`: dynamic sampling, clip-higher, the overlong punishment, no KL. The tiny
/// model never answers right, so the test filters on the combined reward (the overlong
/// punishment varies with its lengths) instead of the accuracy.
#[test]
fn the_dapo_config_trains_on_groups_whose_rewards_differ() {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let cfg = load_example(
        "dapo.toml",
        dir.path(),
        "dapo",
        (&model, &data),
        2,
        &["loss.filter_groups.metric=\"reward\"".to_string()],
    );
    let f = &cfg.loss.filter_groups;
    assert!(f.enable && f.gen_batch_size == Some(12) && f.max_num_gen_batches == 10);
    assert_eq!(
        (cfg.loss.epsilon, cfg.loss.epsilon_high),
        (Some(0.2), Some(0.28))
    );
    let s = trainer::setup(cfg).unwrap();
    assert!(s.reference.is_none(), "beta 0: no reference");
    let r = run_setup(s);
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["loss"].is_finite(), "{m:?}");
        assert_eq!(m["frac_reward_zero_std"], 0.0, "{m:?}");
        assert!(
            m.contains_key("rewards/overlong/mean") && m["filter_groups/num_gen_batches"] >= 1.0
        );
    }
}

/// `configs/orpo.toml` and `configs/simpo.toml` train on the example preference pairs without a
/// reference model; `configs/bco.toml` on the same pairs unpaired, against its reference.
#[test]
fn orpo_simpo_and_bco_configs_train_on_the_example_pairs() {
    for (name, algorithm) in [
        ("orpo.toml", grpo_trainer::Algorithm::Orpo),
        ("simpo.toml", grpo_trainer::Algorithm::Cpo),
        ("bco.toml", grpo_trainer::Algorithm::Bco),
    ] {
        let dir = tempfile::tempdir().unwrap();
        let (model, _) = fixture(dir.path());
        let data = configs_dir().join("data/preference_pairs.jsonl");
        let cfg = load_example(name, dir.path(), "run", (&model, &data), 2, &[]);
        assert_eq!(cfg.algorithm, algorithm);
        let s = trainer::setup(cfg).unwrap();
        // BCO has a reference; ORPO and SimPO none.
        assert_eq!(
            s.reference.is_some(),
            algorithm == grpo_trainer::Algorithm::Bco,
            "{name}"
        );
        let r = run_setup(s);
        assert_eq!(r.total_steps, 2);
        for m in &r.metrics {
            assert!(
                m["loss"].is_finite() && m["rewards/margins"].is_finite(),
                "{name}: {m:?}"
            );
        }
    }
}

/// `configs/prm.toml` trains a token classifier on the example step-wise rows, with its eval
/// split.
#[test]
fn prm_config_trains_a_token_classifier_on_the_example_steps() {
    let dir = tempfile::tempdir().unwrap();
    let (model, _) = fixture(dir.path());
    let data = configs_dir().join("data/prm_steps.jsonl");
    let extra = ["train.eval_steps=2".to_string()];
    let cfg = load_example("prm.toml", dir.path(), "run", (&model, &data), 2, &extra);
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Prm);
    let s = trainer::setup(cfg).unwrap();
    assert_eq!(s.policy.model.cfg.token_classification, Some(2));
    let r = run_setup(s);
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && (0.0..=1.0).contains(&m["accuracy"]),
            "{m:?}"
        );
    }
    let ck = r.best_checkpoint_path.unwrap().join("model");
    assert!(
        std::fs::read_to_string(ck.join("config.json"))
            .unwrap()
            .contains("ForTokenClassification")
    );
}

/// `configs/online_dpo.toml` trains pairs of samples ranked by the accuracy reward.
#[test]
fn online_dpo_config_trains_on_ranked_pairs() {
    let (_dir, r) = train(
        "online_dpo.toml",
        &[
            "rollout.num_generations=2".to_string(),
            "train.per_device_train_batch_size=4".to_string(),
        ],
    );
    for m in &r.metrics {
        assert!(
            m["objective/scores_margin"] >= 0.0 && m["beta"] == 0.1,
            "{m:?}"
        );
    }
}

/// `configs/xpo.toml` and `configs/nash_md.toml` train pairs of a policy sample and a
/// reference (or mixture) sample.
#[test]
fn xpo_and_nash_md_configs_train_on_contrasted_pairs() {
    for (name, key) in [
        ("xpo.toml", "loss/xpo"),
        ("nash_md.toml", "rewards/probabilities"),
    ] {
        let (_dir, r) = train(
            name,
            &[
                "rollout.num_generations=2".to_string(),
                "train.per_device_train_batch_size=4".to_string(),
            ],
        );
        for m in &r.metrics {
            assert!(m[key].is_finite() && m["beta"] == 0.1, "{name}: {m:?}");
        }
    }
}

/// `configs/gkd.toml` (teacher samples on its off-policy steps), `configs/a2po.toml` (stage 1
/// over the prompts, then the regression), `configs/sdft.toml`, `configs/ssd.toml` and
/// `configs/sdpo.toml` train on the arithmetic fixture.
#[test]
fn gkd_a2po_and_self_distillation_configs_train() {
    let dir = tempfile::tempdir().unwrap();
    let (model, data) = fixture(dir.path());
    let teacher = dir.path().join("teacher");
    init_model_dir(&teacher, Preset::Tiny, Arch::Llama, 9).unwrap();
    let teacher_set = format!(
        "distillation.teacher_model_name_or_path={}",
        quote(&teacher)
    );
    let cfg = load_example(
        "gkd.toml",
        dir.path(),
        "gkd",
        (&model, &data),
        3,
        &[teacher_set],
    );
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Gkd);
    let r = run_setup(trainer::setup(cfg).unwrap());
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m.contains_key("on_policy"),
            "{m:?}"
        );
    }
    // A random model solves nothing: stage 1 would leave every problem out, so keep them.
    let keep = ["a2po.filter_all_incorrect=false".to_string()];
    let cfg = load_example("a2po.toml", dir.path(), "a2po", (&model, &data), 3, &keep);
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::A2po);
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 3);
    for m in &r.metrics {
        assert!(m["loss"].is_finite() && m["v_star"].is_finite(), "{m:?}");
    }
    let cfg = load_example("sdft.toml", dir.path(), "sdft", (&model, &data), 3, &[]);
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Sdft);
    let r = run_setup(trainer::setup(cfg).unwrap());
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m.contains_key("sdft/distillation_loss"),
            "{m:?}"
        );
    }
    let cfg = load_example("ssd.toml", dir.path(), "ssd", (&model, &data), 3, &[]);
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Ssd);
    let r = run_setup(trainer::setup(cfg).unwrap());
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m.contains_key("ssd/cross_entropy_loss"),
            "{m:?}"
        );
    }
    let cfg = load_example("sdpo.toml", dir.path(), "sdpo", (&model, &data), 3, &[]);
    assert_eq!(cfg.algorithm, grpo_trainer::Algorithm::Sdpo);
    let r = run_setup(trainer::setup(cfg).unwrap());
    assert_eq!(r.total_steps, 3);
    for m in &r.metrics {
        assert!(
            m["loss"].is_finite() && m.contains_key("self_distillation/reprompt_sample_fraction"),
            "{m:?}"
        );
    }
}
