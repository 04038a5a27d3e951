//! Multi-turn episodes against a guess-the-number environment: turn order, termination, the
//! budgets, the token mask, observation tokens as the chat template renders them, recorded
//! log-probs against one forward over the whole episode, shared prefill, device sampling and
//! environment errors.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::BTreeSet;
use std::sync::Mutex;

use candle_core::{DType, Device, Result};
use grpo_rollout::config::Arch;
use grpo_rollout::env::{Environment, EnvironmentReturn};
use grpo_rollout::episode::{
    Episode, EpisodeEnd, EpisodeParams, EpisodePrompt, EpisodeRequest, Turn, episode_metrics,
    generate_episodes, generate_episodes_batch,
};
use grpo_rollout::generate::{FinishReason, SamplingParams, left_pad, with_device_sampling};
use grpo_rollout::init::{Preset, preset_config, random_weights, train_tokenizer};
use grpo_rollout::{ChatMessage, Tokenizer, Transformer};
use serde_json::{Value, json};

fn setup() -> (Transformer, Tokenizer) {
    setup_arch(Arch::Qwen2)
}

fn setup_arch(arch: Arch) -> (Transformer, Tokenizer) {
    let tok = train_tokenizer(400).unwrap();
    let cfg = preset_config(
        Preset::Tiny,
        arch,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    let m = random_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    (m.detached(), tok)
}

fn prompts(tok: &Tokenizer) -> Vec<EpisodePrompt> {
    [
        (3, "Guess my number."),
        (42, "What is 3 + 4? Guess."),
        (7, "alpha"),
    ]
    .iter()
    .map(|(target, text)| {
        EpisodePrompt::from_messages(
            tok,
            vec![
                ChatMessage::new("system", "You are a helpful assistant."),
                ChatMessage::new("user", *text),
            ],
            json!({ "target": target }),
        )
        .unwrap()
    })
    .collect()
}

/// The first integer in `text`.
fn parse_guess(text: &str) -> Option<i64> {
    let start = text.find(|c: char| c.is_ascii_digit())?;
    let digits: String = text[start..]
        .chars()
        .take_while(char::is_ascii_digit)
        .collect();
    digits.parse().ok()
}

/// The environment's verdict on a turn: observation, reward, whether the guess was right. (The
/// reminder's length varies with the turn's, so that observations of one batch differ.)
fn verdict(text: &str, target: i64) -> (String, f32, bool) {
    match parse_guess(text) {
        Some(g) if g == target => ("correct".into(), 1.0, true),
        Some(g) if g < target => ("higher".into(), 0.0, false),
        Some(_) => ("lower".into(), 0.0, false),
        None => {
            let please = " please".repeat(text.len() % 4);
            (format!("Say a number{please}."), -0.1, false)
        }
    }
}

/// Guess the number: the model's turn is parsed for an integer; the answer is "higher",
/// "lower" or "correct"; the episode ends when right or after `max_guesses`.
struct GuessEnv {
    max_guesses: u64,
    /// Fail (an error) at this call.
    fail_at: Option<usize>,
    /// Stop strings given for the next turn.
    next_stop: Option<Vec<String>>,
    /// The role of the observations.
    role: &'static str,
    /// Every call's logs.
    calls: Mutex<Vec<Vec<Vec<ChatMessage>>>>,
}

impl GuessEnv {
    fn new(max_guesses: u64) -> Self {
        Self {
            max_guesses,
            fail_at: None,
            next_stop: None,
            role: "user",
            calls: Mutex::new(Vec::new()),
        }
    }
}

impl Environment for GuessEnv {
    fn name(&self) -> &str {
        "guess-the-number"
    }

    fn step(&self, logs: &[&[ChatMessage]], metadata: &[&Value]) -> Result<EnvironmentReturn> {
        let mut calls = self.calls.lock().unwrap();
        calls.push(logs.iter().map(|l| l.to_vec()).collect());
        if self.fail_at == Some(calls.len()) {
            candle_core::bail!("the sandbox is down");
        }
        let mut out = EnvironmentReturn::empty(logs.len());
        for (i, (log, meta)) in logs.iter().zip(metadata).enumerate() {
            let target = meta["target"].as_i64().unwrap();
            let guesses = meta["guesses"].as_u64().unwrap_or(0) + 1;
            let last = log.last().unwrap();
            assert_eq!(last.role, "assistant");
            let (obs, reward, right) = verdict(&last.content, target);
            out.observations[i] = Some(ChatMessage::new(self.role, obs));
            out.metadata[i] = json!({ "target": target, "guesses": guesses });
            out.next_stop_strings[i] = self.next_stop.clone();
            out.rewards[i] = reward;
            out.terminateds[i] = right || guesses >= self.max_guesses;
        }
        Ok(out)
    }
}

fn params(max_turns: usize, per_turn: usize, total: usize) -> EpisodeParams {
    EpisodeParams {
        sampling: SamplingParams {
            temperature: 0.9,
            seed: 3,
            ..Default::default()
        },
        max_turns,
        max_tokens_per_turn: per_turn,
        max_total_tokens: total,
    }
}

/// Whether the model closed turn `t` itself: it ended with the tokenizer's EOS (ChatML's
/// `<|im_end|>`; another stop id is part of the turn's text).
fn closed_by_eos(ep: &Episode, t: &Turn, tok: &Tokenizer) -> bool {
    t.finish_reason == FinishReason::Eos
        && tok
            .eos_token_ids
            .contains(&ep.token_ids[t.model_tokens.end - 1])
}

/// What the ChatML template adds after a model turn: its end (unless the model sampled it),
/// the observation, the next generation prompt.
fn expected_observation(closed: bool, role: &str, obs: &str) -> String {
    let end = if closed { "\n" } else { "<|im_end|>\n" };
    format!("{end}<|im_start|>{role}\n{obs}<|im_end|>\n<|im_start|>assistant\n")
}

/// The structure every episode must have: turns tile the tokens (model tokens, then the
/// observation's), the mask marks exactly the model's tokens, log-probs sit on them, the
/// messages alternate, observation tokens are the template's, rewards are the verdicts.
fn check_episode(ep: &Episode, prompt: &EpisodePrompt, tok: &Tokenizer) {
    let n = ep.token_ids.len();
    assert_eq!(ep.is_model_token.len(), n);
    assert_eq!(ep.logprobs.len(), n);
    assert!(!ep.turns.is_empty());
    let mut at = 0;
    let mut model_positions = BTreeSet::new();
    for (k, t) in ep.turns.iter().enumerate() {
        assert_eq!(t.model_tokens.start, at, "turn {k}");
        assert!(!t.model_tokens.is_empty());
        assert_eq!(t.observation_tokens.start, t.model_tokens.end);
        at = t.observation_tokens.end;
        model_positions.extend(t.model_tokens.clone());
        let last = k + 1 == ep.turns.len();
        assert_eq!(t.observation_tokens.is_empty(), last, "turn {k}");
    }
    assert_eq!(at, n);
    for i in 0..n {
        assert_eq!(
            ep.is_model_token[i],
            model_positions.contains(&i),
            "token {i}"
        );
        if ep.is_model_token[i] {
            assert!(ep.logprobs[i] <= 0.0 && ep.logprobs[i].is_finite());
        } else {
            assert_eq!(ep.logprobs[i], 0.0);
        }
    }
    // Messages: the prompt's, then assistant / observation alternating, an assistant last.
    let p = prompt.messages.len();
    assert_eq!(&ep.messages[..p], prompt.messages.as_slice());
    let rest = &ep.messages[p..];
    assert_eq!(rest.len(), 2 * ep.turns.len() - 1);
    let target = prompt.metadata["target"].as_i64().unwrap();
    for (k, t) in ep.turns.iter().enumerate() {
        let msg = &rest[2 * k];
        assert_eq!(msg.role, "assistant");
        // The assistant message is the turn's text, a closing EOS left out.
        let ids = &ep.token_ids[t.model_tokens.clone()];
        let closed = closed_by_eos(ep, t, tok);
        let body = if closed { &ids[..ids.len() - 1] } else { ids };
        assert_eq!(msg.content, tok.decode(body, false).unwrap());
        let (obs, reward, _) = verdict(&msg.content, target);
        assert_eq!(t.reward, reward, "turn {k}: {:?}", msg.content);
        if let Some(o) = rest.get(2 * k + 1) {
            assert_eq!(o.content, obs);
            let text = expected_observation(closed, &o.role, &obs);
            assert_eq!(
                &ep.token_ids[t.observation_tokens.clone()],
                tok.encode(&text, false).unwrap().as_slice(),
                "turn {k}: observation tokens are the template's {text:?}"
            );
        }
    }
    assert_eq!(ep.text, tok.decode(&ep.token_ids, false).unwrap());
}

#[test]
fn turns_alternate_and_end_when_the_environment_says() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let env = GuessEnv::new(3);
    let eps = generate_episodes(&m, &tok, &env, &ps, 3, &params(5, 8, 500)).unwrap();
    assert_eq!(eps.len(), 9);
    assert_eq!(
        eps.iter()
            .map(|e| (e.prompt_index, e.sample_index))
            .collect::<Vec<_>>(),
        (0..3)
            .flat_map(|p| (0..3).map(move |s| (p, s)))
            .collect::<Vec<_>>()
    );
    for ep in &eps {
        check_episode(ep, &ps[ep.prompt_index], &tok);
        assert_eq!(ep.end, EpisodeEnd::Terminated);
        assert!(ep.terminated());
        let right = ep.rewards().last() == Some(&1.0);
        assert!(right || ep.num_turns() == 3, "{:?}", ep.rewards());
        assert!(ep.num_turns() <= 3);
        // The verdict on the last turn was not shown; the metadata counts the guesses.
        assert!(ep.unshown_observation.is_some());
        assert_eq!(ep.metadata["guesses"], json!(ep.num_turns()));
    }
    // The environment saw, at call k, the episodes still running, each log ending with the
    // model's k-th turn, in prompt, sample order.
    let calls = env.calls.lock().unwrap();
    assert_eq!(calls.len(), 3);
    for (k, call) in calls.iter().enumerate() {
        let running: Vec<&Episode> = eps.iter().filter(|e| e.num_turns() > k).collect();
        assert_eq!(call.len(), running.len(), "call {k}");
        for (log, ep) in call.iter().zip(running) {
            let p = ps[ep.prompt_index].messages.len();
            assert_eq!(log.as_slice(), &ep.messages[..p + 2 * k + 1]);
        }
    }
    let metrics = episode_metrics(&eps);
    assert_eq!(metrics["episodes/terminated"], 1.0);
    let turns = eps.iter().map(|e| e.num_turns()).sum::<usize>() as f64 / 9.0;
    assert!((metrics["episodes/turns"] - turns).abs() < 1e-12);
}

#[test]
fn a_right_guess_ends_the_episode_with_its_reward() {
    let (m, tok) = setup();
    // "7" and the EOS all but forced: turns say "7", "77", ... or nothing.
    let seven = tok.encode("7", false).unwrap();
    assert_eq!(seven.len(), 1);
    let mut p = params(4, 4, 200);
    p.sampling.logit_bias = vec![(seven[0], 100.0), (tok.eos_token_ids[0], 100.0)];
    let ps = prompts(&tok);
    let eps = generate_episodes(&m, &tok, &GuessEnv::new(10), &ps[2..], 8, &p).unwrap();
    let mut right = 0;
    for ep in &eps {
        check_episode(ep, &ps[2], &tok);
        let last = &ep.messages[ep.messages.len() - 1].content;
        if ep.terminated() {
            assert_eq!(last, "7");
            assert_eq!(ep.rewards().last(), Some(&1.0));
            assert_eq!(ep.unshown_observation.as_ref().unwrap().content, "correct");
            right += 1;
        } else {
            assert_eq!(ep.end, EpisodeEnd::MaxTurns);
            assert_eq!(ep.num_turns(), 4);
            assert!(ep.rewards().iter().all(|&r| r < 1.0));
        }
    }
    assert!(right > 0 && right < eps.len(), "{right} of {}", eps.len());
}

#[test]
fn max_turns_ends_episodes_the_environment_does_not() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let eps = generate_episodes(&m, &tok, &GuessEnv::new(100), &ps, 2, &params(3, 6, 500)).unwrap();
    for ep in &eps {
        check_episode(ep, &ps[ep.prompt_index], &tok);
        if ep.terminated() {
            assert_eq!(ep.rewards().last(), Some(&1.0));
        } else {
            assert_eq!(ep.end, EpisodeEnd::MaxTurns);
            assert_eq!(ep.num_turns(), 3);
            assert!(ep.turns.iter().all(|t| t.model_tokens.len() <= 6));
        }
    }
    assert!(eps.iter().any(|e| e.end == EpisodeEnd::MaxTurns));
}

#[test]
fn max_total_tokens_cuts_turns_and_refuses_observations_that_do_not_fit() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let total = 40;
    let eps =
        generate_episodes(&m, &tok, &GuessEnv::new(100), &ps, 3, &params(20, 9, total)).unwrap();
    for ep in &eps {
        check_episode(ep, &ps[ep.prompt_index], &tok);
        assert!(ep.token_ids.len() <= total);
        for t in &ep.turns {
            assert!(t.model_tokens.len() <= 9.min(total - t.model_tokens.start));
        }
        if ep.terminated() {
            continue;
        }
        assert_eq!(ep.end, EpisodeEnd::MaxTotalTokens);
        let last = ep.turns.last().unwrap();
        if ep.token_ids.len() < total {
            // The observation would have left no room for the model.
            let obs = ep.unshown_observation.as_ref().unwrap();
            let text = expected_observation(closed_by_eos(ep, last, &tok), &obs.role, &obs.content);
            let need = tok.encode(&text, false).unwrap().len();
            assert!(ep.token_ids.len() + need >= total);
        }
    }
    assert!(eps.iter().any(|e| e.end == EpisodeEnd::MaxTotalTokens));
}

/// Log-probs of an episode's tokens from one forward over prompt + tokens.
fn full_forward_logprobs(
    m: &Transformer,
    tok: &Tokenizer,
    prompt: &[u32],
    ep: &Episode,
) -> Vec<f32> {
    let mut ids = prompt.to_vec();
    ids.extend(&ep.token_ids);
    let (ids_t, mask) = left_pad(&[ids], tok.pad_token_id, &Device::Cpu).unwrap();
    let (lp, _) = m
        .completion_logprobs(&ids_t, &mask, ep.token_ids.len(), 0.9, false)
        .unwrap();
    lp.flatten_all().unwrap().to_vec1().unwrap()
}

#[test]
fn recorded_logprobs_equal_one_forward_over_the_whole_episode() {
    for (arch, device) in [
        (Arch::Qwen2, false),
        (Arch::Qwen2, true),
        (Arch::Llama, false),
        (Arch::Qwen3, false),
    ] {
        let (m, tok) = setup_arch(arch);
        let ps = prompts(&tok);
        let mut p = params(4, 7, 500);
        p.sampling.repetition_penalty = 1.1;
        // Turns end at different steps, some with the EOS, some with another stop id.
        p.sampling.stop_token_ids = (20..40).collect();
        p.sampling.logit_bias = vec![(tok.eos_token_ids[0], 3.0)];
        let eps = with_device_sampling(device, || {
            generate_episodes(&m, &tok, &GuessEnv::new(100), &ps, 4, &p)
        })
        .unwrap();
        // The batch must have mixed things up: turns of different lengths (rows left the
        // decode batch at different steps) and, at one turn, observations of different
        // lengths appended in the same forward.
        let mut mixed_turns = false;
        let mut mixed_observations = false;
        for k in 0..4 {
            let turns: Vec<_> = eps.iter().filter_map(|e| e.turns.get(k)).collect();
            let model: BTreeSet<usize> = turns.iter().map(|t| t.model_tokens.len()).collect();
            let obs: BTreeSet<usize> = turns
                .iter()
                .filter(|t| !t.observation_tokens.is_empty())
                .map(|t| t.observation_tokens.len())
                .collect();
            mixed_turns |= model.len() > 1;
            mixed_observations |= obs.len() > 1;
        }
        assert!(mixed_turns && mixed_observations);
        assert!(eps.iter().any(|e| e.num_turns() >= 3));
        let ends: BTreeSet<String> = eps
            .iter()
            .flat_map(|e| e.turns.iter().map(|t| format!("{:?}", t.finish_reason)))
            .collect();
        assert_eq!(ends.len(), 2, "{ends:?}");
        let mut worst = 0f32;
        for ep in &eps {
            check_episode(ep, &ps[ep.prompt_index], &tok);
            let full = full_forward_logprobs(&m, &tok, &ps[ep.prompt_index].ids, ep);
            for (i, (&a, &b)) in full.iter().zip(&ep.logprobs).enumerate() {
                if ep.is_model_token[i] {
                    worst = worst.max((a - b).abs());
                    assert!(
                        (a - b).abs() < 1e-4,
                        "episode ({}, {}) token {i}: forward {a} vs sampling {b}",
                        ep.prompt_index,
                        ep.sample_index
                    );
                }
            }
        }
        eprintln!("{arch:?}, device sampling {device}: max |Δ log-prob| {worst:e}");
    }
}

#[test]
fn device_sampling_equals_host_sampling() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let mut p = params(3, 6, 300);
    p.sampling.top_k = 20;
    p.sampling.min_new_tokens = 2;
    p.sampling.repetition_penalty = 1.2;
    let run = |device| {
        with_device_sampling(device, || {
            generate_episodes(&m, &tok, &GuessEnv::new(100), &ps, 3, &p)
        })
        .unwrap()
    };
    let (host, dev) = (run(false), run(true));
    for (h, d) in host.iter().zip(&dev) {
        assert_eq!(h.token_ids, d.token_ids);
        assert_eq!(h.turns.len(), d.turns.len());
        for (a, b) in h.logprobs.iter().zip(&d.logprobs) {
            assert!((a - b).abs() < 1e-4);
        }
        assert!(h.turns.iter().all(|t| t.model_tokens.len() >= 2));
    }
}

/// Finished rows kept in the decode batch until several have finished (a GPU's policy), and the
/// decode steps as a CUDA graph replays them (run on the host): the same episodes, tokens and
/// turns as compacting at every finish with eager steps, log-probs to 1e-5.
#[test]
fn late_compaction_and_graph_replayed_steps_change_no_episode() {
    use grpo_rollout::generate::with_retire_every;
    use grpo_rollout::graph::{captures, replayed_on_the_host};
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let mut p = params(3, 12, 300);
    p.sampling.repetition_penalty = 1.2;
    // Turns that end on any of many tokens, so rows leave the batch at different steps.
    p.sampling.stop_token_ids = (20..60).collect();
    for device in [false, true] {
        let run = |k: usize| {
            with_device_sampling(device, || {
                with_retire_every(k, || {
                    generate_episodes(&m, &tok, &GuessEnv::new(100), &ps, 4, &p)
                })
            })
            .unwrap()
        };
        let eager = run(1);
        let lens: BTreeSet<usize> = eager
            .iter()
            .flat_map(|e| e.turns.iter().map(|t| t.model_tokens.len()))
            .collect();
        assert!(
            lens.len() > 2,
            "turns should end at several steps: {lens:?}"
        );
        let late = run(3);
        let before = captures();
        let graphed = replayed_on_the_host(|| run(3));
        assert!(captures() > before, "no step was replayed as a graph");
        for other in [&late, &graphed] {
            assert_eq!(other.len(), eager.len());
            for (a, b) in eager.iter().zip(other) {
                assert_eq!(a.token_ids, b.token_ids, "device sampler {device}");
                assert_eq!(a.turns.len(), b.turns.len());
                // A batch of another size may round a product differently.
                for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                    assert!((x - y).abs() < 1e-5, "device sampler {device}: {x} vs {y}");
                }
            }
        }
    }
}

#[test]
fn a_group_shares_its_prefill_and_equals_its_prompts_run_alone() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let p = params(3, 6, 300);
    let env = GuessEnv::new(100);
    let all = generate_episodes(&m, &tok, &env, &ps, 3, &p).unwrap();
    assert_eq!(all.len(), 9);
    for (i, prompt) in ps.iter().enumerate() {
        let req = EpisodeRequest {
            prompt,
            n: 3,
            seed: p.sampling.seed,
            first_stream: 3 * i as u64,
        };
        let alone = generate_episodes_batch(&m, &tok, &env, &[req], &p).unwrap();
        let batched: Vec<&Episode> = all.iter().filter(|e| e.prompt_index == i).collect();
        assert_eq!(alone.len(), batched.len());
        for (a, b) in alone.iter().zip(batched) {
            assert_eq!(a.sample_index, b.sample_index);
            assert_eq!(a.token_ids, b.token_ids, "prompt {i}");
            assert_eq!(a.is_model_token, b.is_model_token);
            assert_eq!(a.messages, b.messages);
            assert_eq!(a.end, b.end);
            assert_eq!(a.rewards(), b.rewards());
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "prompt {i}: {x} vs {y}");
            }
        }
    }
    // A request without episodes takes no part; the others keep their streams.
    let reqs = [
        EpisodeRequest {
            prompt: &ps[0],
            n: 3,
            seed: p.sampling.seed,
            first_stream: 0,
        },
        EpisodeRequest {
            prompt: &ps[1],
            n: 0,
            seed: 9,
            first_stream: 0,
        },
    ];
    let some = generate_episodes_batch(&m, &tok, &env, &reqs, &p).unwrap();
    assert_eq!(some.len(), 3);
    for (a, b) in some.iter().zip(&all[..3]) {
        assert_eq!(a.token_ids, b.token_ids);
    }
}

#[test]
fn stop_strings_from_the_environment_hold_for_the_next_turn() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let mut env = GuessEnv::new(100);
    env.next_stop = Some(vec!["e".into()]);
    env.role = "tool";
    let eps = generate_episodes(&m, &tok, &env, &ps, 3, &params(3, 12, 400)).unwrap();
    let mut stopped = 0;
    for ep in &eps {
        check_episode(ep, &ps[ep.prompt_index], &tok);
        for (k, t) in ep.turns.iter().enumerate() {
            let mut ids = &ep.token_ids[t.model_tokens.clone()];
            if t.finish_reason == FinishReason::Eos {
                ids = &ids[..ids.len() - 1];
            }
            let text = tok.decode(ids, false).unwrap();
            if t.finish_reason == FinishReason::Stop {
                assert!(k > 0, "the first turn has no stop strings");
                assert!(text.contains('e'));
                // It stopped at the first token that completed "e".
                let before = &ep.token_ids[t.model_tokens.start..t.model_tokens.end - 1];
                assert!(!tok.decode(before, false).unwrap().contains('e'));
                stopped += 1;
            } else if k > 0 {
                assert!(!text.contains('e'), "{text:?}");
            }
        }
    }
    assert!(stopped > 0);
}

#[test]
fn environment_errors_name_the_environment() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let p = params(4, 5, 300);
    let mut env = GuessEnv::new(100);
    env.fail_at = Some(2);
    let e = generate_episodes(&m, &tok, &env, &ps, 2, &p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("environment `guess-the-number` failed at turn 2")
            && e.contains("the sandbox is down"),
        "{e}"
    );

    let mut env = GuessEnv::new(100);
    env.role = "assistant";
    let e = generate_episodes(&m, &tok, &env, &ps, 2, &p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("guess-the-number") && e.contains("role `assistant`"),
        "{e}"
    );

    /// Answers one episode too few.
    struct Short;
    impl Environment for Short {
        fn step(&self, logs: &[&[ChatMessage]], _: &[&Value]) -> Result<EnvironmentReturn> {
            Ok(EnvironmentReturn::empty(logs.len() - 1))
        }
    }
    let e = generate_episodes(&m, &tok, &Short, &ps, 2, &p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("Short") && e.contains("returned 5 observations for 6 episodes"),
        "{e}"
    );

    /// A NaN reward.
    struct NanReward;
    impl Environment for NanReward {
        fn name(&self) -> &str {
            "nan"
        }
        fn step(&self, logs: &[&[ChatMessage]], _: &[&Value]) -> Result<EnvironmentReturn> {
            let mut r = EnvironmentReturn::empty(logs.len());
            r.rewards[0] = f32::NAN;
            Ok(r)
        }
    }
    let e = generate_episodes(&m, &tok, &NanReward, &ps, 2, &p)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("environment `nan`") && e.contains("finite"),
        "{e}"
    );
}

#[test]
fn no_observation_continues_with_another_assistant_turn() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    /// Never answers, never ends.
    struct Silent;
    impl Environment for Silent {
        fn step(&self, logs: &[&[ChatMessage]], meta: &[&Value]) -> Result<EnvironmentReturn> {
            let mut r = EnvironmentReturn::empty(logs.len());
            r.metadata = meta.iter().map(|v| (*v).clone()).collect();
            Ok(r)
        }
    }
    let eps = generate_episodes(&m, &tok, &Silent, &ps, 2, &params(3, 5, 300)).unwrap();
    for ep in &eps {
        assert_eq!(ep.end, EpisodeEnd::MaxTurns);
        assert_eq!(ep.num_turns(), 3);
        let p = ps[ep.prompt_index].messages.len();
        assert!(ep.messages[p..].iter().all(|m| m.role == "assistant"));
        for t in &ep.turns[..2] {
            let end = if closed_by_eos(ep, t, &tok) {
                "\n"
            } else {
                "<|im_end|>\n"
            };
            let text = format!("{end}<|im_start|>assistant\n");
            assert_eq!(
                &ep.token_ids[t.observation_tokens.clone()],
                tok.encode(&text, false).unwrap().as_slice()
            );
        }
        let full = full_forward_logprobs(&m, &tok, &ps[ep.prompt_index].ids, ep);
        for (i, (&a, &b)) in full.iter().zip(&ep.logprobs).enumerate() {
            if ep.is_model_token[i] {
                assert!((a - b).abs() < 1e-4);
            }
        }
    }
}

#[test]
fn a_template_that_rewrites_past_turns_is_refused() {
    let (m, mut tok) = setup();
    let ps = prompts(&tok);
    // Renders every assistant turn as "..." whatever the model said.
    tok.chat_template = Some(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{% if m['role'] == 'assistant' %}...{% else %}{{ m['content'] }}{% endif %}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
            .into(),
    );
    let e = generate_episodes(&m, &tok, &GuessEnv::new(100), &ps, 2, &params(3, 5, 300))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("chat template") && e.contains("does not continue the text"),
        "{e}"
    );
}

#[test]
fn invalid_params_are_errors() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let env = GuessEnv::new(3);
    for (p, want) in [
        (params(0, 5, 100), "max_turns"),
        (params(2, 0, 100), "max_tokens_per_turn"),
        (params(2, 5, 0), "max_total_tokens"),
        (
            EpisodeParams {
                sampling: SamplingParams {
                    min_new_tokens: 6,
                    ..Default::default()
                },
                ..params(2, 5, 100)
            },
            "min_new_tokens (6) exceeds max_tokens_per_turn (5)",
        ),
    ] {
        let e = generate_episodes(&m, &tok, &env, &ps, 1, &p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(want), "{e}");
    }
    let empty = EpisodePrompt {
        ids: Vec::new(),
        messages: Vec::new(),
        metadata: Value::Null,
        tools: Vec::new(),
        episode_metadata: Vec::new(),
    };
    let e = generate_episodes(&m, &tok, &env, &[empty], 1, &params(2, 5, 100))
        .unwrap_err()
        .to_string();
    assert!(e.contains("episode prompt 0 is empty"), "{e}");
}

#[test]
fn a_reset_shares_equal_starts_and_keeps_differing_ones_per_episode() {
    use grpo_rollout::env::{EnvironmentReset, EpisodeStart};
    let start = |o: Option<&str>, m: &[(&str, &str)]| EpisodeStart {
        observation: o.map(str::to_owned),
        messages: m.iter().map(|(r, c)| ChatMessage::new(*r, *c)).collect(),
    };
    let meta = vec![json!({"s": 1}), json!({"s": 2})];
    let same = EnvironmentReset::from_starts(vec![start(Some(" go"), &[]); 2], meta.clone());
    assert!(same.is_shared());
    assert_eq!(same.observation.as_deref(), Some(" go"));
    assert_eq!(same.episodes, meta);
    let mut m = vec![ChatMessage::new("user", "Q.")];
    same.apply(&mut m);
    assert_eq!(m[0].content, "Q. go");
    // Different starts: each episode its own; a conversation replaces an empty user message.
    let own = [
        start(Some("A"), &[]),
        start(None, &[("system", "S"), ("user", "B")]),
    ];
    let each = EnvironmentReset::from_starts(own.to_vec(), meta);
    assert!(!each.is_shared());
    assert_eq!(each.observation, None);
    assert_eq!(each.start_of(0), own[0]);
    assert_eq!(each.start_of(1), own[1]);
    let mut m = vec![ChatMessage::new("user", "")];
    each.start_of(1).apply(&mut m);
    let roles: Vec<(&str, &str)> = m
        .iter()
        .map(|m| (m.role.as_str(), m.content.as_str()))
        .collect();
    assert_eq!(roles, [("system", "S"), ("user", "B")]);
    let mut m = vec![ChatMessage::new("user", "")];
    each.start_of(0).apply(&mut m);
    assert_eq!(m[0].content, "A");
    // No episodes: nothing to share.
    assert!(EnvironmentReset::from_starts(Vec::new(), Vec::new()).is_shared());
}
