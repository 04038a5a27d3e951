//! Environments in the trainer: a guess-the-number environment trains a tiny model through
//! `fit_with(.. .environment(..))` (multi-turn completions, the `env` reward, `env/*`
//! metrics), and the learner's mask gives an episode's environment tokens exactly zero weight
//! in the loss gradient.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};

use candle_core::{DType, Device, Tensor, Var};
use grpo_core::loss::{LossInputs, policy_loss};
use grpo_data::synth::ArithmeticConfig;
use grpo_data::{Position, Prompt, Sample};
use grpo_rewards::ScoredBatch;
use grpo_rollout::env::{Environment, EnvironmentReturn};
use grpo_rollout::init::{Preset, init_model_dir, preset_config, random_weights};
use grpo_rollout::{Arch, ChatMessage, Completion, FinishReason};
use grpo_trainer::config::EnvironmentReward;
use grpo_trainer::learner::batch::StepBatch;
use grpo_trainer::stages::{EpisodeBatch, PromptBatch, Rollouts, Scored};
use grpo_trainer::{FitOptions, GrpoTrainer, TrainConfig};
use serde_json::Value;

fn model(root: &Path) -> PathBuf {
    let dir = root.join("model");
    init_model_dir(&dir, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    dir
}

fn config(root: &Path, out: &str) -> TrainConfig {
    let mut c = TrainConfig {
        output_dir: root.join(out),
        ..Default::default()
    };
    c.rollout.num_generations = 4;
    c.rollout.max_completion_length = 6;
    c.train.prompts_per_step = 2;
    c.train.per_device_train_batch_size = Some(4);
    c.train.save_steps = 0;
    c.train.num_completions_to_print = 100;
    c.optim.learning_rate = Some(1e-3);
    c.environment.max_turns = 3;
    c.environment.max_total_tokens = Some(80);
    c
}

fn arithmetic(n: u64) -> grpo_data::Dataset {
    ArithmeticConfig {
        n,
        seed: 7,
        digits: 1,
        steps: 1,
    }
    .dataset()
    .unwrap()
}

/// Guess the number: the target is the row's `answer`; each turn is answered "higher",
/// "lower", "correct" or "Say a number." The reward of a turn depends on its text only
/// (deterministic, and varied within a group).
#[derive(Default)]
struct GuessEnv {
    calls: AtomicUsize,
}

fn first_int(text: &str) -> Option<i64> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect::<String>()
        .parse()
        .ok()
}

impl Environment for GuessEnv {
    fn name(&self) -> &str {
        "guess"
    }

    fn step(
        &self,
        logs: &[&[ChatMessage]],
        metadata: &[&Value],
    ) -> candle_core::Result<EnvironmentReturn> {
        self.calls.fetch_add(1, Ordering::Relaxed);
        let mut out = EnvironmentReturn::empty(logs.len());
        for (i, (log, meta)) in logs.iter().zip(metadata).enumerate() {
            let target: i64 = meta["answer"]
                .as_str()
                .and_then(|a| a.trim().parse().ok())
                .unwrap_or(0);
            let last = &log.last().unwrap().content;
            let (obs, right) = match first_int(last) {
                Some(g) if g == target => ("correct", true),
                Some(g) if g < target => ("higher", false),
                Some(_) => ("lower", false),
                None => ("Say a number.", false),
            };
            out.observations[i] = Some(ChatMessage::new("user", obs));
            out.metadata[i] = (*meta).clone();
            out.rewards[i] = if right {
                1.0
            } else {
                (last.chars().count() % 3) as f32 * 0.25
            };
            out.terminateds[i] = right;
        }
        Ok(out)
    }

    fn post_process(
        &self,
        episodes: &mut [grpo_rollout::Episode],
    ) -> candle_core::Result<std::collections::BTreeMap<String, f64>> {
        Ok([("episodes_seen".to_string(), episodes.len() as f64)].into())
    }
}

#[test]
fn an_environment_trains_two_steps_on_multi_turn_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let cfg = config(dir.path(), "run");
    let env = GuessEnv::default();
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let r = t
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(4))
                .environment(env)
                .max_steps(2),
        )
        .unwrap();
    assert_eq!(r.total_steps, 2);
    assert_eq!(r.metrics.len(), 2);
    for m in &r.metrics {
        for k in [
            "env/turns_mean",
            "env/terminated_ratio",
            "env/reward_mean",
            "env/episodes_seen",
            "episodes/environment_tokens",
            "rewards/env/mean",
            "loss",
        ] {
            assert!(m.contains_key(k), "{k} missing from {m:?}");
            assert!(m[k].is_finite(), "{k} = {}", m[k]);
        }
        assert_eq!(m["env/episodes_seen"], 8.0);
        // A random model rarely guesses right: most episodes run several turns.
        assert!(m["env/turns_mean"] > 1.0, "{}", m["env/turns_mean"]);
        // Lengths count the model's tokens only: at most 3 turns of 6 tokens.
        assert!(m["completions/max_length"] <= 18.0, "{m:?}");
        assert!((m["reward"] - m["rewards/env/mean"]).abs() < 1e-6, "{m:?}");
    }
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.path().join("run/completions.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    assert_eq!(lines.len(), 16);
    let multi_turn = lines
        .iter()
        .filter(|l| {
            let text = l["completion"].as_str().unwrap();
            ["higher", "lower", "Say a number."]
                .iter()
                .any(|o| text.contains(o))
                && text.contains("<|im_start|>user")
        })
        .count();
    assert!(multi_turn > 0, "no multi-turn transcript in {lines:?}");
    for l in &lines {
        assert!(l["rewards"]["env"].is_number(), "{l}");
    }
}

/// DAPO's dynamic sampling over episodes: every step's groups differ in the environment's
/// reward, its episodes' masks and metrics travel with the groups kept, and it trains.
#[test]
fn dynamic_sampling_keeps_episode_groups_whose_rewards_differ() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.loss.filter_groups.enable = true;
    cfg.loss.filter_groups.gen_batch_size = Some(1);
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let r = t
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(6))
                .environment(GuessEnv::default())
                .max_steps(3),
        )
        .unwrap();
    assert_eq!(r.metrics.len(), 3);
    for m in &r.metrics {
        assert_eq!(m["frac_reward_zero_std"], 0.0, "{m:?}");
        assert!(m["rewards/env/std"] > 0.0, "{m:?}");
        // Batches of one prompt: at least two per step of two prompts.
        assert!(m["filter_groups/num_gen_batches"] >= 2.0, "{m:?}");
        // Each batch's episodes counted four: the step's metric is their mean.
        assert_eq!(m["env/episodes_seen"], 4.0, "{m:?}");
        assert!(m["loss"].is_finite() && m["completions/max_length"] <= 18.0);
    }
    let lines = std::fs::read_to_string(dir.path().join("run/completions.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), 3 * 8);
}

#[test]
fn the_environment_reward_adds_to_the_reward_functions() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.environment.reward = EnvironmentReward::Last;
    cfg.environment.max_turns = 2;
    let r = GrpoTrainer::from_pretrained(&m, cfg)
        .unwrap()
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(2))
                .environment(GuessEnv::default())
                .reward("half", 1.0, |b: &[grpo_rewards::RewardInput]| {
                    vec![Some(0.5f32); b.len()]
                })
                .max_steps(1),
        )
        .unwrap();
    let m = &r.metrics[0];
    assert!(m["env/turns_mean"] <= 2.0);
    let want = m["rewards/env/mean"] + 0.5;
    assert!((m["reward"] - want).abs() < 1e-5, "{m:?}");
}

#[test]
fn environment_config_keys_parse_and_validate() {
    let cfg: TrainConfig = serde_json::from_value(serde_json::json!({
        "model": {"path": "m"},
        "environment": {"max_turns": 2, "reward": "last", "max_tokens_per_turn": 9}
    }))
    .unwrap();
    assert_eq!(cfg.environment.max_turns, 2);
    assert_eq!(cfg.environment.reward, EnvironmentReward::Last);
    assert_eq!(cfg.environment.tokens_per_turn(&cfg.rollout), 9);
    assert_eq!(
        cfg.environment.total_tokens(&cfg.rollout),
        4 * cfg.rollout.max_completion_length
    );
    assert_eq!(EnvironmentReward::Sum.of(&[1.0, 2.0]), 3.0);
    assert_eq!(EnvironmentReward::Last.of(&[1.0, 2.0]), 2.0);
    let mut bad = cfg.clone();
    bad.environment.max_turns = 0;
    assert!(
        bad.validate()
            .unwrap_err()
            .contains("environment.max_turns")
    );
    let unknown = serde_json::from_value::<TrainConfig>(serde_json::json!({
        "environment": {"turns": 2}
    }));
    assert!(unknown.is_err());
}

/// A scored step of two completions of 6 tokens: the first an episode whose tokens 2..4 are
/// the environment's (when `masks`), the second all the model's.
fn scored(masks: bool) -> Scored {
    let tok_cfg = preset_config(Preset::Tiny, Arch::Qwen2, 64, 1, 0);
    let weights = Arc::new(random_weights(&tok_cfg, 1, DType::F32, &Device::Cpu).unwrap());
    let completion = |i: usize| Completion {
        prompt_index: 0,
        sample_index: i,
        token_ids: vec![5, 6, 7, 8, 9, 10],
        text: String::new(),
        logprobs: vec![-1.0, -1.0, 0.0, 0.0, -1.0, -1.0],
        finish_reason: FinishReason::Stop,
        top_logprobs: Vec::new(),
    };
    let episodes = masks.then(|| EpisodeBatch {
        messages: vec![Vec::new(); 2],
        model_masks: vec![vec![true, true, false, false, true, true], vec![true; 6]],
        rewards: vec![1.0, 0.0],
        metadata: vec![Value::Null; 2],
        ..EpisodeBatch::default()
    });
    Scored {
        rollouts: Rollouts {
            batch: PromptBatch {
                step: 0,
                draw: 0,
                samples: vec![Sample {
                    index: 0,
                    prompt: Prompt::Text("p".into()),
                    columns: Vec::new(),
                }],
                position: Position {
                    epoch: 0,
                    index: 1,
                    seed: 0,
                    shuffle: false,
                    shuffle_window: 0,
                    dataset_len: 1,
                },
            },
            prompt_texts: vec!["p".into()],
            prompt_ids: vec![vec![3, 4]],
            completions: vec![completion(0), completion(1)],
            version: 0,
            weights,
            seconds: 0.0,
            teaching: None,
            sampled_by_other_model: false,
            episodes,
            source: Default::default(),
            greedy: None,
        },
        scores: ScoredBatch::default(),
        advantages: vec![1.0, -1.0],
        zero_std: vec![false, false],
        seconds: 0.0,
        batches_in_flight: 1,
        replay: None,
    }
}

/// d loss / d per-token log-prob, per token, with the mask of `s`.
fn token_grads(s: &Scored) -> (Vec<Vec<f32>>, usize) {
    let d = Device::Cpu;
    let batch = StepBatch::new(s, &[1], 2, false);
    let mask = batch.mask(0, 2, 6, &d).unwrap();
    let base = Tensor::new(
        &[
            [-1.0f32, -2.0, -0.5, -3.0, -1.5, -0.7],
            [-0.9, -1.1, -2.2, -0.3, -1.0, -2.0],
        ],
        &d,
    )
    .unwrap();
    let lp = Var::from_tensor(&base).unwrap();
    // Old and reference log-probs that differ from the policy's, and sampling log-probs for
    // the importance weights (0 at environment tokens, as episodes record them).
    let old = (&base - 0.3).unwrap();
    let refs = (&base + 0.2).unwrap();
    let sampled = Tensor::new(
        &[
            [-1.0f32, -1.0, 0.0, 0.0, -1.0, -1.0],
            [-1.0, -1.0, -1.0, -1.0, -1.0, -1.0],
        ],
        &d,
    )
    .unwrap();
    let mut cfg = TrainConfig::default();
    cfg.reference.beta = 0.1;
    let l = &cfg.loss;
    let iw = grpo_core::loss::importance_weights(
        &old,
        &sampled,
        &mask,
        l.vllm_importance_sampling_mode,
        l.vllm_importance_sampling_clip_min,
        l.vllm_importance_sampling_clip_max,
    )
    .unwrap();
    let adv = Tensor::new(&s.advantages[..], &d).unwrap();
    let out = policy_loss(
        &LossInputs {
            per_token_logps: lp.as_tensor(),
            old_per_token_logps: Some(&old),
            ref_per_token_logps: Some(&refs),
            advantages: &adv,
            completion_mask: &mask,
            num_items_in_batch: Some(batch.total_tokens as f64),
            importance_weights: Some(&iw),
            sampling_per_token_logps: None,
            entropies: None,
        },
        &cfg.loss_config(),
    )
    .unwrap();
    let grads = out.loss.backward().unwrap();
    let g = grads.get(lp.as_tensor()).unwrap().to_vec2::<f32>().unwrap();
    (g, batch.total_tokens)
}

#[test]
fn environment_tokens_carry_exactly_zero_gradient() {
    let (g, total) = token_grads(&scored(true));
    assert_eq!(total, 10, "loss tokens count the model's only");
    for j in [2, 3] {
        assert_eq!(g[0][j], 0.0, "environment token {j}: {g:?}");
    }
    for j in [0, 1, 4, 5] {
        assert_ne!(g[0][j], 0.0, "model token {j}: {g:?}");
    }
    assert!(g[1].iter().all(|&x| x != 0.0), "{g:?}");
    // Without the episode mask the same tokens do carry gradient: the check can fail.
    let (g, total) = token_grads(&scored(false));
    assert_eq!(total, 12);
    assert!(g[0][2] != 0.0 && g[0][3] != 0.0, "{g:?}");
}

#[test]
fn a_reward_named_env_beside_an_environment_is_refused_in_one_line() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let err = GrpoTrainer::from_pretrained(&m, config(dir.path(), "run"))
        .unwrap()
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(2))
                .environment(GuessEnv::default())
                .reward("env", 1.0, |b: &[grpo_rewards::RewardInput]| {
                    vec![Some(0.0f32); b.len()]
                })
                .max_steps(1),
        )
        .unwrap_err();
    let line = grpo_trainer::error_line(&err);
    assert!(
        line.contains("environment `guess`") && line.contains("named `env`"),
        "{line}"
    );
    assert!(!line.contains('\n'), "{line}");
}

/// The interpreter for the Python environments, or `None` (the test then skips).
fn python() -> Option<String> {
    let py = std::env::var("GRPO_PYTHON").unwrap_or_else(|_| "python3".into());
    match std::process::Command::new(&py)
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

/// Guess the number in Python, NeMo RL's signature; `Breaks` answers one training step, then
/// crashes (`mode = "crash"`) or hangs (`mode = "hang"`).
const GUESS_PY: &str = r#"
import time


class Guess:
    def step(self, message_logs, metadata):
        out = {"observations": [], "rewards": [], "terminateds": []}
        for log, m in zip(message_logs, metadata):
            text = log[-1]["content"]
            digits = "".join(c for c in text if c.isdigit())[:4]
            target = int(m["answer"])
            if digits and int(digits) == target:
                out["observations"].append({"role": "user", "content": "correct"})
                out["rewards"].append(1.0)
                out["terminateds"].append(True)
            else:
                out["observations"].append({"role": "user", "content": "higher" if not digits or int(digits) < target else "lower"})
                out["rewards"].append(len(text) % 3 / 3.0)
                out["terminateds"].append(False)
        return out

    def global_post_process_and_metrics(self, episodes):
        return {"episodes_seen": len(episodes)}


class Breaks(Guess):
    def __init__(self, mode):
        self.mode = mode
        self.steps = 0

    def step(self, message_logs, metadata):
        if self.steps >= 1:
            if self.mode == "crash":
                raise RuntimeError("the sandbox is gone")
            time.sleep(60)
        return super().step(message_logs, metadata)

    def global_post_process_and_metrics(self, episodes):
        self.steps += 1
        return {}
"#;

fn python_config(root: &Path, out: &str, py: &str, class: &str, extra: &str) -> TrainConfig {
    let path = root.join("guess.py");
    std::fs::write(&path, GUESS_PY).unwrap();
    let mut c = config(root, out);
    c.environment = environment_section(&format!(
        "type = \"python\"\nmax_turns = 3\nmax_total_tokens = 80\n[python]\npath = {:?}\nclass = \"{class}\"\npython = {py:?}\n{extra}",
        path.display().to_string()
    ));
    c
}

/// `[environment]` from TOML.
fn environment_section(text: &str) -> grpo_trainer::config::EnvironmentSection {
    toml::from_str(text).unwrap()
}

fn timing_free(ms: &[grpo_trainer::Metrics]) -> Vec<Vec<(String, f64)>> {
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

#[test]
fn a_python_environment_from_the_config_trains_and_resumes_exactly() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let fit = |t: &mut GrpoTrainer| {
        t.fit_with(FitOptions::default().dataset(arithmetic(8)).max_steps(4))
            .unwrap()
    };
    let mut straight =
        GrpoTrainer::from_pretrained(&m, python_config(dir.path(), "straight", &py, "Guess", ""))
            .unwrap();
    let straight = fit(&mut straight);
    assert_eq!(straight.metrics.len(), 4);
    for m in &straight.metrics {
        assert_eq!(m["env/episodes_seen"], 8.0, "{m:?}");
        assert!(m["env/turns_mean"] >= 1.0);
        assert!(m.contains_key("rewards/env/mean"));
    }
    // Stopped after 2 steps, resumed: the same 4 steps.
    let cfg = python_config(dir.path(), "split", &py, "Guess", "");
    let mut first = GrpoTrainer::from_pretrained(&m, cfg.clone()).unwrap();
    first.options.stop_after = Some(2);
    let part1 = fit(&mut first);
    assert!(part1.interrupted);
    let mut second = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    second.options.resume = Some(None);
    let part2 = fit(&mut second);
    let mut joined = part1.metrics.clone();
    joined.extend(part2.metrics);
    assert_eq!(timing_free(&straight.metrics), timing_free(&joined));
}

#[test]
fn a_crashing_or_hanging_environment_ends_the_run_with_a_checkpoint() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    for (mode, extra, says) in [
        (
            "crash",
            "init = { mode = \"crash\" }\n",
            "RuntimeError: the sandbox is gone",
        ),
        (
            "hang",
            "init = { mode = \"hang\" }\ntimeout = 2\n",
            "did not return within 2 s",
        ),
    ] {
        let cfg = python_config(dir.path(), mode, &py, "Breaks", extra);
        let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
        let t0 = std::time::Instant::now();
        let err = t
            .fit_with(FitOptions::default().dataset(arithmetic(8)).max_steps(4))
            .unwrap_err();
        let line = grpo_trainer::error_line(&err);
        assert!(!line.contains('\n'), "{line}");
        assert!(
            line.contains("environment `Breaks`") && line.contains(says),
            "{line}"
        );
        assert!(line.contains("checkpoint"), "{line}");
        let ckpts = grpo_trainer::list_checkpoints(&dir.path().join(mode));
        assert_eq!(ckpts.last().map(|c| c.0), Some(1), "{line}");
        assert!(
            t0.elapsed().as_secs() < 50,
            "{mode} took {:?}",
            t0.elapsed()
        );
    }
}

/// An environment given in code that never answers its second step.
struct Stalls(AtomicUsize);

impl Environment for Stalls {
    fn name(&self) -> &str {
        "stalls"
    }

    fn step(
        &self,
        logs: &[&[ChatMessage]],
        _: &[&Value],
    ) -> candle_core::Result<EnvironmentReturn> {
        if self.0.load(Ordering::SeqCst) > 0 {
            std::thread::sleep(std::time::Duration::from_secs(120));
        }
        let mut r = EnvironmentReturn::empty(logs.len());
        r.terminateds = vec![true; logs.len()];
        r.rewards = logs
            .iter()
            .map(|l| (l.last().unwrap().content.len() % 2) as f32)
            .collect();
        Ok(r)
    }

    fn post_process(
        &self,
        _: &mut [grpo_rollout::Episode],
    ) -> candle_core::Result<std::collections::BTreeMap<String, f64>> {
        self.0.fetch_add(1, Ordering::SeqCst);
        Ok(Default::default())
    }
}

#[test]
fn step_timeout_ends_a_run_whose_rust_environment_hangs() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.environment.step_timeout = 1.0;
    let err = GrpoTrainer::from_pretrained(&m, cfg)
        .unwrap()
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(8))
                .environment(Stalls(AtomicUsize::new(0)))
                .max_steps(3),
        )
        .unwrap_err();
    let line = grpo_trainer::error_line(&err);
    assert!(
        line.contains("environment `stalls`")
            && line.contains("did not return within 1 s (environment.step_timeout)")
            && line.contains("checkpoint"),
        "{line}"
    );
}

#[test]
fn a_tool_environment_from_the_config_renders_its_tools_and_runs() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    // The model's template renders tools (Qwen2.5's conventions).
    let tc = m.join("tokenizer_config.json");
    let mut j: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&tc).unwrap()).unwrap();
    j["chat_template"] = grpo_rollout::init::CHATML_TOOLS_TEMPLATE.into();
    std::fs::write(&tc, j.to_string()).unwrap();
    std::fs::write(
        dir.path().join("tools.py"),
        "def add(a: int, b: int):\n    \"\"\"Adds.\n\n    Args:\n        a: one\n        b: two\n    \"\"\"\n    return a + b\n",
    )
    .unwrap();
    let mut cfg = config(dir.path(), "run");
    cfg.environment = environment_section(&format!(
        r#"
type = "tools"
max_calls_per_turn = 2
max_turns = 3
max_total_tokens = 80

[[tools]]
type = "python"
path = {:?}
function = "add"
python = {py:?}

[[tools]]
type = "command"
name = "echo"
description = "Repeats its text."
argv = ["echo", "{{text}}"]
"#,
        dir.path().join("tools.py").display().to_string()
    ));
    let mut bad = cfg.clone();
    bad.model.path = m.clone();
    bad.model.path = m.clone();
    let r = GrpoTrainer::from_pretrained(&m, cfg)
        .unwrap()
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(4))
                .reward("len", 1.0, |b: &[grpo_rewards::RewardInput]| {
                    b.iter()
                        .map(|x| Some((x.completion.len() % 5) as f32))
                        .collect::<Vec<_>>()
                })
                .max_steps(1),
        )
        .unwrap();
    let metrics = &r.metrics[0];
    for k in [
        "env/tool_calls_mean",
        "env/tool_errors_mean",
        "env/turns_mean",
    ] {
        assert!(metrics.contains_key(k), "{k} missing from {metrics:?}");
    }
    // TRL's tool metrics: calls per completion, failed calls per call.
    let calls = metrics["env/tool_calls_mean"];
    assert_eq!(metrics["tools/call_frequency"], calls);
    let want = match calls > 0.0 {
        true => metrics["env/tool_errors_mean"] / calls,
        false => 0.0,
    };
    assert!((metrics["tools/failure_frequency"] - want).abs() < 1e-12);
    let line = std::fs::read_to_string(dir.path().join("run/completions.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(line.lines().next().unwrap()).unwrap();
    let prompt = first["prompt"].as_str().unwrap();
    assert!(
        prompt.contains("<tools>\n{\"type\": \"function\", \"function\": {\"name\": \"add\", \"description\": \"Adds.\"")
            && prompt.contains("\"name\": \"echo\""),
        "{prompt}"
    );
    // Config mistakes are one line naming the key.
    bad.environment.tools.clear();
    let e = bad.validate().unwrap_err();
    assert!(
        e.contains("needs at least one [[environment.tools]]"),
        "{e}"
    );
    bad.environment.kind = None;
    bad.environment.python = Some(toml::from_str("path = \"x.py\"\nclass = \"X\"\n").unwrap());
    let e = bad.validate().unwrap_err();
    assert!(e.contains("need `environment.type`"), "{e}");
    assert!(
        toml::from_str::<grpo_trainer::config::EnvironmentSection>("type = \"tool\"\n").is_err()
    );
}

/// On-policy distillation over multi-turn episodes: the student plays the environment, the
/// teacher's distributions are learnt on the student's turns only (the environment's tokens
/// carry no loss); the environment's rewards are logged.
#[test]
fn distillation_runs_over_multi_turn_episodes() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let teacher = dir.path().join("teacher");
    init_model_dir(&teacher, Preset::Tiny, Arch::Qwen2, 11).unwrap();
    let mut cfg = config(dir.path(), "distill");
    cfg.algorithm = grpo_trainer::Algorithm::Distillation;
    cfg.distillation.teacher_model_name_or_path = Some(teacher);
    let r = grpo_trainer::DistillationTrainer::from_pretrained(&m, cfg)
        .unwrap()
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(4))
                .environment(GuessEnv::default())
                .max_steps(2),
        )
        .unwrap();
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        assert!(m["loss"].is_finite() && m["loss"] > 0.0, "{m:?}");
        assert!(m["episodes/environment_tokens"] > 0.0, "{m:?}");
        assert!(m["rewards/env/mean"].is_finite(), "{m:?}");
    }
}

/// A TRL `environment_factory` class: a lock whose code is the row's `answer`.
const LOCK_PY: &str = r#"
class Lock:
    made = 0

    def __init__(self, penalty=0.25):
        Lock.made += 1
        self.penalty = penalty

    def reset(self, prompt, answer, **kwargs):
        # TRL passes the whole row: the prompt too.
        assert isinstance(prompt, (list, str)), prompt
        self.code = str(answer)
        self.tries = 0
        self.open = False
        return " Open the lock with `try_code`."

    def try_code(self, code: str) -> str:
        """Tries a code on the lock.

        Args:
            code: the code to try
        """
        self.tries += 1
        self.open = code.strip() == self.code
        return "open" if self.open else "closed"

    def instances(self) -> int:
        """How many locks were ever made."""
        return Lock.made

    def jam(self) -> str:
        """Jams the lock."""
        raise RuntimeError("jammed")

    def get_reward(self):
        return 1.0 if self.open else -self.penalty * self.tries

    def _private(self):
        return "not a tool"


class NoReset:
    def try_code(self, code: str) -> str:
        return code


class BadReset(Lock):
    def reset(self, **kwargs):
        return 42


class Moody(Lock):
    def reset(self, prompt, answer, **kwargs):
        super().reset(prompt, answer)
        Moody.made += 1
        return " mood %d" % (Moody.made % 2)


class Quiz:
    """Owns its data: each instance draws its own sum at reset."""

    drawn = 0

    def reset(self, **kwargs):
        # TRL's placeholder row: an empty user message.
        assert kwargs == {"prompt": [{"role": "user", "content": ""}]}, kwargs
        Quiz.drawn += 1
        self.a, self.b = Quiz.drawn % 7, (Quiz.drawn * 3) % 5
        self.said = None
        return "What is %d + %d? Answer with `answer`." % (self.a, self.b)

    def answer(self, value: int) -> str:
        """Answers the question.

        Args:
            value: the sum
        """
        self.said = value
        return "right" if value == self.a + self.b else "wrong"

    def get_reward(self):
        return 1.0 if self.said == self.a + self.b else 0.0


def own_prompt(prompts, completions, **kwargs):
    # Each completion's own prompt, its reset text included (TRL's `prompts`).
    return [1.0 if p[-1]["content"].startswith("What is ") else 0.0 for p in prompts]


class Dial:
    def __init__(self, penalty=0.0):
        pass

    def reset(self, answer, **kwargs):
        # The routing column is the trainer's: TRL does not pass it.
        assert "environment" not in kwargs, kwargs
        self.target, self.at = int(answer), 0
        return " Turn the dial to the answer with `spin`."

    def spin(self, steps: int) -> str:
        """Turns the dial.

        Args:
            steps: how far to turn it
        """
        self.at += steps
        return str(self.at)

    def get_reward(self):
        return 2.0 if self.at == self.target else 0.0
"#;

fn factory(
    root: &Path,
    py: &str,
    class: &str,
) -> candle_core::Result<grpo_rollout::python_env::PythonFactoryEnvironment> {
    let path = root.join("lock.py");
    std::fs::write(&path, LOCK_PY).unwrap();
    let cfg: grpo_rollout::python_env::PythonEnvironmentConfig = toml::from_str(&format!(
        "path = {:?}\nclass = \"{class}\"\npython = {py:?}\ninit = {{ penalty = 0.5 }}",
        path.display().to_string()
    ))
    .unwrap();
    let workers = Box::leak(Box::new(grpo_rewards::python::PythonWorkers::new()));
    grpo_rollout::python_env::PythonFactoryEnvironment::new(&cfg, workers)
}

fn call(name: &str, args: Value) -> String {
    format!(
        "<tool_call>{}</tool_call>",
        serde_json::json!({ "name": name, "arguments": args })
    )
}

fn turn(text: &str) -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("user", "q"),
        ChatMessage::new("assistant", text),
    ]
}

fn finished(
    prompt_index: usize,
    metadata: Value,
    messages: Vec<ChatMessage>,
) -> grpo_rollout::Episode {
    grpo_rollout::Episode {
        prompt_index,
        sample_index: 0,
        token_ids: Vec::new(),
        is_model_token: Vec::new(),
        logprobs: Vec::new(),
        turns: vec![grpo_rollout::episode::Turn {
            model_tokens: 0..0,
            finish_reason: FinishReason::Eos,
            reward: 0.0,
            observation_tokens: 0..0,
        }],
        end: grpo_rollout::episode::EpisodeEnd::Terminated,
        messages,
        unshown_observation: None,
        metadata,
        text: String::new(),
    }
}

#[test]
fn an_environment_factory_class_gets_an_instance_per_episode() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let env = factory(dir.path(), &py, "Lock").unwrap();
    // Public methods but reset and get_reward are the tools, with their schemas.
    let tools = env.tools();
    let names: Vec<&str> = tools
        .iter()
        .map(|t| t["function"]["name"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["instances", "jam", "try_code"]);
    assert_eq!(
        tools[2]["function"]["parameters"]["properties"]["code"]["type"],
        "string"
    );
    assert_eq!(
        tools[2]["function"]["description"],
        "Tries a code on the lock."
    );
    let rows = [
        serde_json::json!({"answer": 7, "prompt": "p"}),
        serde_json::json!({"answer": 3, "prompt": [{"role": "user", "content": "q"}]}),
    ];
    let resets = env.reset(&rows.iter().collect::<Vec<_>>(), 2).unwrap();
    assert_eq!(
        resets[0].observation.as_deref(),
        Some(" Open the lock with `try_code`.")
    );
    let meta: Vec<Value> = resets.iter().flat_map(|r| r.episodes.clone()).collect();
    assert_eq!(meta[2]["answer"], 3);
    let ids: std::collections::BTreeSet<&str> = meta
        .iter()
        .map(|m| m["_env_instance"].as_str().unwrap())
        .collect();
    assert_eq!(ids.len(), 4);
    // Each episode talks to its own instance: the same call opens one lock, not another.
    let logs = [
        turn(&call("try_code", serde_json::json!({"code": "7"}))),
        turn(&format!(
            "{}{}",
            call("try_code", serde_json::json!({"code": "1"})),
            call("jam", serde_json::json!({}))
        )),
        turn("I give up."),
        turn(&format!(
            "{}{}",
            call("instances", serde_json::json!({})),
            call("reset", serde_json::json!({"answer": 1}))
        )),
    ];
    let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let m: Vec<&Value> = meta.iter().collect();
    let r = env.step(&l, &m).unwrap();
    r.validate(4, "lock").unwrap();
    let obs = |i: usize| r.observations[i].as_ref().map(|o| o.content.clone());
    assert_eq!(obs(0).as_deref(), Some("open"));
    assert_eq!(
        r.observations[0].as_ref().unwrap().name.as_deref(),
        Some("try_code")
    );
    let o1 = obs(1).unwrap();
    assert!(
        o1.starts_with("closed\nerror: raised RuntimeError: jammed"),
        "{o1}"
    );
    assert_eq!(obs(2), None);
    assert_eq!(r.terminateds, [false, false, true, false]);
    // Four instances for four episodes; `reset` is not a tool.
    let o3 = obs(3).unwrap();
    assert!(o3.starts_with("4\nerror: unknown tool `reset`"), "{o3}");
    // get_reward goes to the last turn; the instances go back to the pool.
    let mut eps: Vec<_> = meta
        .iter()
        .zip(&logs)
        .enumerate()
        .map(|(i, (m, l))| finished(i / 2, m.clone(), l.clone()))
        .collect();
    let metrics = env.post_process(&mut eps).unwrap();
    let rewards: Vec<f32> = eps.iter().map(|e| e.turns[0].reward).collect();
    assert_eq!(rewards, [1.0, -0.5, 0.0, 0.0]);
    assert_eq!(metrics["get_reward_mean"], 0.125);
    assert!(metrics.contains_key("tools/call_frequency"));
    // Scored: the instances go back to the pool; the next batch reuses the four.
    env.release(&meta.iter().collect::<Vec<_>>()).unwrap();
    let resets = env.reset(&[&rows[0]], 4).unwrap();
    let meta: Vec<Value> = resets[0].episodes.clone();
    let logs = [turn(&call("instances", serde_json::json!({})))];
    let r = env.step(&[logs[0].as_slice()], &[&meta[0]]).unwrap();
    assert_eq!(r.observations[0].as_ref().unwrap().content, "4");
}

#[test]
fn environment_factory_classes_are_checked_in_one_line() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let e = factory(dir.path(), &py, "NoReset").unwrap_err().to_string();
    assert!(
        e.contains("class:") && e.contains("no `reset(self, **kwargs)`"),
        "{e}"
    );
    let e = factory(dir.path(), &py, "Nope").unwrap_err().to_string();
    assert!(
        e.contains("no function `Nope`") || e.contains("Nope"),
        "{e}"
    );
    // A reset that returns no text, and a row without the column reset needs (the TypeError,
    // with the hint).
    for (class, row, n, want) in [
        (
            "BadReset",
            serde_json::json!({"answer": 1, "prompt": "p"}),
            1,
            &["reset returned a int"][..],
        ),
        (
            "Lock",
            serde_json::json!({"question": 1, "prompt": "p"}),
            1,
            &["TypeError", "answer"][..],
        ),
    ] {
        let env = factory(dir.path(), &py, class).unwrap();
        let e = env.reset(&[&row], n).unwrap_err().to_string();
        assert!(want.iter().all(|w| e.contains(w)), "{e}");
    }
}

#[test]
fn instances_whose_reset_texts_differ_give_their_episodes_their_own_prompts() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let env = factory(dir.path(), &py, "Moody").unwrap();
    let rows = [
        serde_json::json!({"answer": 1, "prompt": "p"}),
        serde_json::json!({"answer": 2, "prompt": "q"}),
    ];
    let resets = env.reset(&rows.iter().collect::<Vec<_>>(), 2).unwrap();
    for (r, row) in resets.iter().zip(&rows) {
        assert!(!r.is_shared());
        assert_eq!(r.observation, None);
        let texts: Vec<Option<String>> = r
            .episode_starts
            .iter()
            .map(|s| s.observation.clone())
            .collect();
        let mut sorted = texts.clone();
        sorted.sort();
        assert_eq!(
            sorted,
            [Some(" mood 0".to_owned()), Some(" mood 1".to_owned())]
        );
        assert_eq!(r.episodes.len(), 2);
        assert_eq!(r.episodes[1]["answer"], row["answer"]);
        let mut m = vec![ChatMessage::new("user", "Q.")];
        r.start_of(1).apply(&mut m);
        assert_eq!(
            Some(m[0].content.clone()),
            texts[1].clone().map(|t| format!("Q.{t}"))
        );
    }
    // Instances that agree share one start.
    let lock = factory(dir.path(), &py, "Lock").unwrap();
    let resets = lock.reset(&[&rows[0]], 3).unwrap();
    assert!(resets[0].is_shared() && resets[0].observation.is_some());
}

const QUIZ_CONFIG: &str = r#"
output_dir = "{out}"
[model]
path = "{model}"
[rollout]
num_generations = 4
max_completion_length = 6
[train]
max_steps = 2
prompts_per_step = 2
per_device_train_batch_size = 4
save_steps = 0
num_completions_to_print = 100
[optim]
learning_rate = 1e-3
[pipeline]
max_staleness = 1
[environment]
type = "factory"
max_turns = 2
max_total_tokens = 80
[environment.python]
path = "{path}"
class = "Quiz"
python = "{py}"
[[rewards]]
type = "python"
name = "own_prompt"
path = "{path}"
function = "own_prompt"
python = "{py}"
"#;

#[test]
fn an_environment_that_owns_its_data_trains_without_a_dataset() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let path = dir.path().join("quiz.py");
    std::fs::write(&path, LOCK_PY).unwrap();
    let text = QUIZ_CONFIG
        .replace("{out}", &dir.path().join("run").display().to_string())
        .replace("{model}", &m.display().to_string())
        .replace("{path}", &path.display().to_string())
        .replace("{py}", &py);
    let file = dir.path().join("quiz.toml");
    std::fs::write(&file, &text).unwrap();
    // No `data.path`: TRL's placeholder rows, a prompt each from the instance's reset.
    let cfg = grpo_trainer::config::load(&file, &[]).unwrap();
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let r = t.fit().unwrap();
    assert_eq!(r.total_steps, 2);
    // The first batch was sampled by the policy the learner holds: the learner's log-probs of
    // the model's tokens, after the episode's own prompt, are the sampler's.
    let first = &r.metrics[0];
    assert!(
        first["sampling/sampling_logp_difference/max"] < 1e-3,
        "{first:?}"
    );
    for m in &r.metrics {
        assert!(m["env/get_reward_mean"].is_finite(), "{m:?}");
        assert_eq!(m["rewards/own_prompt/mean"], 1.0, "{m:?}");
    }
    let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("run/completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 16);
    // Every episode has its own task: the four of a group were asked four sums.
    for group in lines.chunks(4) {
        let prompts: std::collections::BTreeSet<&str> = group
            .iter()
            .map(|l| l["prompt"].as_str().unwrap())
            .collect();
        assert_eq!(prompts.len(), 4, "{prompts:?}");
        for p in prompts {
            assert!(p.contains("<|im_start|>user\nWhat is "), "{p}");
        }
    }
    // Without max_steps the run has no length; another environment cannot own the data.
    for (edit, says) in [
        (
            text.replace("max_steps = 2\n", ""),
            "`train.max_steps` is required",
        ),
        (
            text.replace("type = \"factory\"", "type = \"python\""),
            "`data.path` is required",
        ),
    ] {
        std::fs::write(&file, edit).unwrap();
        let e = grpo_trainer::config::load(&file, &[])
            .unwrap_err()
            .to_string();
        assert!(e.contains(says), "{e}");
    }
}

#[test]
fn grpo_trains_on_an_environment_factory_class_from_the_config() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let path = dir.path().join("lock.py");
    std::fs::write(&path, LOCK_PY).unwrap();
    let mut cfg = config(dir.path(), "run");
    cfg.environment = environment_section(&format!(
        "type = \"factory\"\nmax_turns = 2\nmax_total_tokens = 60\n[python]\npath = {:?}\nclass = \"Lock\"\npython = {py:?}\n",
        path.display().to_string()
    ));
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let r = t
        .fit_with(FitOptions::default().dataset(arithmetic(4)).max_steps(2))
        .unwrap();
    assert_eq!(r.total_steps, 2);
    for m in &r.metrics {
        for k in [
            "env/get_reward_mean",
            "rewards/env/mean",
            "env/tool_calls_mean",
        ] {
            assert!(
                m.get(k).is_some_and(|v| v.is_finite()),
                "{k} missing from {m:?}"
            );
        }
    }
    let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("run/completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 16);
    for l in &lines {
        let p = l["prompt"].as_str().unwrap();
        assert!(
            p.contains(" Open the lock with `try_code`.<|im_end|>"),
            "{p}"
        );
    }
}

#[test]
fn several_environment_factory_classes_route_by_the_environment_column() {
    use grpo_rollout::python_env::PythonFactoryRouter;
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let envs = std::collections::BTreeMap::from([
        (
            "lock".to_string(),
            factory(dir.path(), &py, "Lock").unwrap(),
        ),
        (
            "dial".to_string(),
            factory(dir.path(), &py, "Dial").unwrap(),
        ),
    ]);
    let env = PythonFactoryRouter::new(envs).unwrap();
    let names = |tools: Vec<Value>| -> Vec<String> {
        tools
            .iter()
            .map(|t| t["function"]["name"].as_str().unwrap().to_owned())
            .collect()
    };
    let rows = [
        serde_json::json!({"answer": 7, "environment": "lock", "prompt": "p"}),
        serde_json::json!({"answer": 3, "environment": "dial", "prompt": "p"}),
    ];
    // Each prompt shows its own environment's tools only.
    assert_eq!(
        names(env.tools_for(&rows[0])),
        ["instances", "jam", "try_code"]
    );
    assert_eq!(names(env.tools_for(&rows[1])), ["spin"]);
    assert_eq!(names(env.tools()).len(), 4);
    let resets = env.reset(&rows.iter().collect::<Vec<_>>(), 2).unwrap();
    assert_eq!(
        resets[0].observation.as_deref(),
        Some(" Open the lock with `try_code`.")
    );
    assert_eq!(
        resets[1].observation.as_deref(),
        Some(" Turn the dial to the answer with `spin`.")
    );
    let meta: Vec<Value> = resets.iter().flat_map(|r| r.episodes.clone()).collect();
    assert_eq!(meta[3]["_env_name"], "dial");
    let logs = [
        turn(&call("try_code", serde_json::json!({"code": "7"}))),
        turn("no"),
        turn(&call("spin", serde_json::json!({"steps": 3}))),
        turn(&call("try_code", serde_json::json!({"code": "3"}))),
    ];
    let l: Vec<&[ChatMessage]> = logs.iter().map(Vec::as_slice).collect();
    let m: Vec<&Value> = meta.iter().collect();
    let r = env.step(&l, &m).unwrap();
    r.validate(4, "factories").unwrap();
    assert_eq!(r.observations[0].as_ref().unwrap().content, "open");
    assert_eq!(r.observations[2].as_ref().unwrap().content, "3");
    // A dial episode cannot call the lock's tool.
    let o3 = &r.observations[3].as_ref().unwrap().content;
    assert!(o3.starts_with("error: unknown tool `try_code`"), "{o3}");
    assert_eq!(r.terminateds, [false, true, false, false]);
    let mut eps: Vec<_> = meta
        .iter()
        .zip(&logs)
        .enumerate()
        .map(|(i, (m, l))| finished(i / 2, m.clone(), l.clone()))
        .collect();
    let metrics = env.post_process(&mut eps).unwrap();
    let rewards: Vec<f32> = eps.iter().map(|e| e.turns[0].reward).collect();
    assert_eq!(rewards, [1.0, 0.0, 2.0, 0.0]);
    assert_eq!(metrics["lock_get_reward_mean"], 0.5);
    assert_eq!(metrics["dial_get_reward_mean"], 1.0);
    // A row routed nowhere is refused, naming the choices.
    for (row, want) in [
        (
            serde_json::json!({"answer": 1, "environment": "maze"}),
            "names `maze`",
        ),
        (serde_json::json!({"answer": 1}), "no `environment` column"),
    ] {
        let e = env.reset(&[&row], 1).unwrap_err().to_string();
        assert!(e.contains(want) && e.contains("dial, lock"), "{e}");
    }
}

/// A reward reading `environments` in another interpreter's worker is told so in one line.
#[test]
fn environments_read_from_another_interpreter_say_where_the_instances_are() {
    let Some(py) = python() else { return };
    // The same interpreter named another way: a worker of its own.
    let out = std::process::Command::new(&py)
        .args(["-c", "import sys; print(sys.executable)"])
        .output()
        .unwrap();
    let other = String::from_utf8_lossy(&out.stdout).trim().to_owned();
    if other.is_empty() || other == py {
        eprintln!("skipped: {py} has no other name");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let path = dir.path().join("lock.py");
    std::fs::write(&path, LOCK_PY).unwrap();
    let rewards = dir.path().join("rewards.py");
    std::fs::write(
        &rewards,
        "def code(environments, **kwargs):\n    return [float(e.code) for e in environments]\n",
    )
    .unwrap();
    let mut cfg = config(dir.path(), "run");
    cfg.rewards = serde_json::from_value(serde_json::json!([{
        "type": "python", "name": "code", "path": rewards.display().to_string(),
        "function": "code", "python": other,
    }]))
    .unwrap();
    cfg.environment = environment_section(&format!(
        "type = \"factory\"\nmax_turns = 1\n[python]\npath = {:?}\nclass = \"Lock\"\npython = {py:?}\n",
        path.display().to_string()
    ));
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let e = t
        .fit_with(FitOptions::default().dataset(arithmetic(2)).max_steps(1))
        .unwrap_err();
    let e = format!("{e:#}");
    assert!(
        e.contains("is not in this Python worker") && e.contains("environment's `python`"),
        "{e}"
    );
}

#[test]
fn grpo_trains_on_routed_environment_factory_classes_from_the_config() {
    let Some(py) = python() else { return };
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let path = dir.path().join("lock.py");
    std::fs::write(&path, LOCK_PY).unwrap();
    let data = dir.path().join("mixed.jsonl");
    let rows: String = (0..4)
        .map(|i| {
            let env = if i % 2 == 0 { "lock" } else { "dial" };
            format!(
                "{}\n",
                serde_json::json!({"prompt": format!("Task {i}."), "answer": i + 2, "environment": env})
            )
        })
        .collect();
    std::fs::write(&data, rows).unwrap();
    let mut cfg = config(dir.path(), "run");
    // A reward function as TRL's examples write them: it reads the episode's instance.
    let rewards = dir.path().join("rewards.py");
    std::fs::write(
        &rewards,
        "def code(environments, **kwargs):\n    return [float(e.code) if hasattr(e, 'code') else float(e.target) for e in environments]\n",
    )
    .unwrap();
    cfg.rewards = serde_json::from_value(serde_json::json!([{
        "type": "python", "name": "code", "path": rewards.display().to_string(),
        "function": "code", "python": py,
    }]))
    .unwrap();
    let p = path.display().to_string();
    cfg.environment = environment_section(&format!(
        "type = \"factory\"\nmax_turns = 2\nmax_total_tokens = 60\n\
         [factories.lock]\npath = {p:?}\nclass = \"Lock\"\npython = {py:?}\n\
         [factories.dial]\npath = {p:?}\nclass = \"Dial\"\npython = {py:?}\n"
    ));
    let dataset = grpo_data::Dataset::open(
        &[data.display().to_string()],
        &grpo_data::OpenOptions::default(),
    )
    .unwrap();
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let r = t
        .fit_with(FitOptions::default().dataset(dataset).max_steps(2))
        .unwrap();
    assert_eq!(r.total_steps, 2);
    let lines: Vec<Value> = std::fs::read_to_string(dir.path().join("run/completions.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    for l in &lines {
        let p = l["prompt"].as_str().unwrap();
        assert!(
            p.contains("Open the lock") || p.contains("Turn the dial"),
            "{p}"
        );
    }
    // Each completion's reward function saw its own episode's instance: the row's answer.
    for l in &lines {
        let p = l["prompt"].as_str().unwrap();
        let i: f64 = p.split("Task ").nth(1).unwrap()[..1].parse().unwrap();
        assert_eq!(l["rewards"]["code"].as_f64(), Some(i + 2.0), "{l}");
    }
    // Both environments ran.
    assert!(
        lines
            .iter()
            .any(|l| l["prompt"].as_str().unwrap().contains("dial"))
    );
    assert!(
        lines
            .iter()
            .any(|l| l["prompt"].as_str().unwrap().contains("lock"))
    );
    // Both tables, or neither, is one line naming the keys.
    let both = format!(
        "type = \"factory\"\n[python]\npath = {p:?}\nclass = \"Lock\"\n[factories.dial]\npath = {p:?}\nclass = \"Dial\"\n"
    );
    let mut c = config(dir.path(), "bad");
    c.environment = environment_section(&both);
    let e = GrpoTrainer::from_pretrained(&m, c).unwrap_err().to_string();
    assert!(e.contains("not both"), "{e}");
}

/// `loss.replay_buffer_size`: a flat group replaced by a kept episode group trains with that
/// group's model-token masks (its environment tokens stay out of the loss).
#[test]
fn a_replayed_episode_group_keeps_its_model_token_masks() {
    let one = scored(true);
    // Two groups of two: the episodes of `scored(true)`, then the same prompt again with all
    // of its tokens the model's.
    let mut s = one.clone();
    let r = &mut s.rollouts;
    r.prompt_ids.push(vec![3, 5]);
    r.prompt_texts.push("q".into());
    r.batch.samples.push(r.batch.samples[0].clone());
    for c in one.rollouts.completions.iter() {
        r.completions.push(Completion {
            prompt_index: 1,
            ..c.clone()
        });
    }
    let e = r.episodes.as_mut().unwrap();
    e.model_masks.extend([vec![true; 6], vec![true; 6]]);
    e.messages.extend([Vec::new(), Vec::new()]);
    e.rewards.extend([0.0, 0.0]);
    e.metadata.extend([Value::Null, Value::Null]);
    s.scores.rewards = vec![1.0, 0.0, 0.5, 0.5];
    s.advantages = vec![0.7, -0.7, 0.0, 0.0];
    s.zero_std = vec![false; 4];
    let mut buffer = grpo_trainer::stages::replay::ReplayBuffer::new(2);
    let rep = buffer.replay(&s, 2, 5).unwrap();
    assert_eq!(rep.replaced, [(1, 0)]);
    let t = rep.trained.unwrap();
    let masks = &t.rollouts.episodes.as_ref().unwrap().model_masks;
    assert_eq!(masks[2], masks[0]);
    assert_eq!(masks[3], masks[1]);
    assert_eq!(masks[2], [true, true, false, false, true, true]);
    assert_eq!(t.rollouts.prompt_ids[1], [3, 4]);
    assert_eq!(&t.advantages[2..], [0.7, -0.7]);
    // The learner's loss mask of the replayed group: the kept group's environment tokens out.
    let batch = StepBatch::new(&t, &[], 4, false);
    let m = batch.mask(0, 4, 6, &Device::Cpu).unwrap();
    let m: Vec<Vec<f32>> = m.to_vec2().unwrap();
    assert_eq!(m[2], m[0]);
    assert_eq!(m[2], [1.0, 1.0, 0.0, 0.0, 1.0, 1.0]);
    // The fresh step is untouched.
    assert_eq!(
        s.rollouts.episodes.as_ref().unwrap().model_masks[2],
        vec![true; 6]
    );
}
