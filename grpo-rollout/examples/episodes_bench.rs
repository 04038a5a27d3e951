//! Multi-turn generation throughput against single-turn `generate` of the same length.
//!
//! `RAYON_NUM_THREADS=1 cargo run --release -p grpo-rollout --example episodes_bench [-- REPEATS]`
//!
//! For the tiny and small presets (random weights, f32, CPU): 4 prompts × 8 samples.
//! Multi-turn: `generate_episodes` with `TURNS` turns of `PER_TURN` sampled tokens (EOS
//! suppressed, so every turn runs to its budget) against an environment that answers every
//! turn with a short user message (appended through the chat template: `obs tok` tokens per
//! episode) and never ends an episode. Single-turn: one `generate` call sampling the same
//! number of tokens (`TURNS × PER_TURN`), and one sampling as many tokens as an episode holds
//! after its prompt (sampled + observation tokens: the same total length). Prints tokens per
//! second (best of REPEATS, interleaved) and the ratios multi / single.

use std::time::Instant;

use candle_core::{DType, Device, Result};
use grpo_rollout::config::Arch;
use grpo_rollout::env::{Environment, EnvironmentReturn};
use grpo_rollout::episode::{EpisodeParams, EpisodePrompt, generate_episodes};
use grpo_rollout::generate::{SamplingParams, generate};
use grpo_rollout::init::{Preset, preset_config, random_weights, train_tokenizer};
use grpo_rollout::{ChatMessage, Tokenizer, Transformer};
use serde_json::Value;

const PROMPTS: usize = 4;
const SAMPLES: usize = 8;

/// Answers every turn with the same short message; never ends an episode.
struct Echo;

impl Environment for Echo {
    fn name(&self) -> &str {
        "echo"
    }

    fn step(&self, logs: &[&[ChatMessage]], _: &[&Value]) -> Result<EnvironmentReturn> {
        let mut out = EnvironmentReturn::empty(logs.len());
        for o in &mut out.observations {
            *o = Some(ChatMessage::new("user", "Go on."));
        }
        Ok(out)
    }
}

fn model(preset: Preset) -> Result<(Transformer, Tokenizer)> {
    let vocab = match preset {
        Preset::Tiny => 512,
        Preset::Small => 1024,
    };
    let tok = train_tokenizer(vocab)?;
    let cfg = preset_config(
        preset,
        Arch::Qwen2,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    let m = random_weights(&cfg, 1, DType::F32, &Device::Cpu)?.detached();
    Ok((m.for_decoding()?, tok))
}

fn main() -> Result<()> {
    let repeats: usize = std::env::args()
        .nth(1)
        .and_then(|a| a.parse().ok())
        .unwrap_or(5);
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        eprintln!(
            "note: RAYON_NUM_THREADS is not set: candle then counts the CPUs on every matmul (slow)"
        );
    }
    println!(
        "{PROMPTS} prompts x {SAMPLES} samples, best of {repeats}; sampled = model tokens per \
         second, sequence = all tokens after the prompt per second"
    );
    println!(
        "{:<6} {:>11} {:>7} | {:>14} {:>14} {:>6} | {:>15} {:>15} {:>6}",
        "preset",
        "turns x tok",
        "obs tok",
        "single sampled",
        "multi sampled",
        "ratio",
        "single sequence",
        "multi sequence",
        "ratio"
    );
    for preset in [Preset::Tiny, Preset::Small] {
        let (m, tok) = model(preset)?;
        let texts = [
            "What is 3 + 4?",
            "Write about the sea",
            "alpha beta",
            "Think step by step.",
        ];
        let prompts: Vec<EpisodePrompt> = texts
            .iter()
            .map(|t| {
                EpisodePrompt::from_messages(&tok, vec![ChatMessage::new("user", *t)], Value::Null)
            })
            .collect::<Result<_>>()?;
        let ids: Vec<Vec<u32>> = prompts.iter().map(|p| p.ids.clone()).collect();
        for (turns, per_turn) in [(4usize, 16usize), (4, 64), (8, 32)] {
            let sampled = turns * per_turn;
            let multi = EpisodeParams {
                sampling: SamplingParams {
                    min_new_tokens: per_turn,
                    seed: 1,
                    ..Default::default()
                },
                max_turns: turns,
                max_tokens_per_turn: per_turn,
                max_total_tokens: 4 * sampled,
            };
            let e = generate_episodes(&m, &tok, &Echo, &prompts, SAMPLES, &multi)?;
            assert!(e.iter().all(|e| e.num_model_tokens() == sampled));
            let length = e[0].token_ids.len();
            assert!(e.iter().all(|e| e.token_ids.len() == length));
            let single = |n: usize| SamplingParams {
                max_new_tokens: n,
                min_new_tokens: n,
                seed: 1,
                ..Default::default()
            };
            let (same_sampled, same_length) = (single(sampled), single(length));
            let mut best = [f64::INFINITY; 3];
            for _ in 0..repeats {
                let t = Instant::now();
                generate(&m, &tok, &ids, SAMPLES, &same_sampled)?;
                best[0] = best[0].min(t.elapsed().as_secs_f64());
                let t = Instant::now();
                generate_episodes(&m, &tok, &Echo, &prompts, SAMPLES, &multi)?;
                best[1] = best[1].min(t.elapsed().as_secs_f64());
                let t = Instant::now();
                generate(&m, &tok, &ids, SAMPLES, &same_length)?;
                best[2] = best[2].min(t.elapsed().as_secs_f64());
            }
            let rows = (PROMPTS * SAMPLES) as f64;
            let rate = |tokens: usize, secs: f64| rows * tokens as f64 / secs;
            let (s1, m1) = (rate(sampled, best[0]), rate(sampled, best[1]));
            let (s2, m2) = (rate(length, best[2]), rate(length, best[1]));
            println!(
                "{:<6} {:>11} {:>7} | {:>14.0} {:>14.0} {:>6.2} | {:>15.0} {:>15.0} {:>6.2}",
                format!("{preset:?}").to_lowercase(),
                format!("{turns} x {per_turn}"),
                length - sampled,
                s1,
                m1,
                m1 / s1,
                s2,
                m2,
                m2 / s2
            );
        }
    }
    Ok(())
}
