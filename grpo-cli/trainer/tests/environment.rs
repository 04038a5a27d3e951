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
    c.optim.learning_rate = 1e-3;
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
        model_masks: vec![vec![true, true, false, false, true, true], vec![true; 6]],
        rewards: vec![1.0, 0.0],
        metrics: Default::default(),
    });
    Scored {
        rollouts: Rollouts {
            batch: PromptBatch {
                step: 0,
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
        },
        scores: ScoredBatch::default(),
        advantages: vec![1.0, -1.0],
        zero_std: vec![false, false],
        seconds: 0.0,
        batches_in_flight: 1,
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
