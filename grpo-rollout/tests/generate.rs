//! Generation: seeds, stop conditions, min_new_tokens, recorded log-probs.
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{DType, Device, Tensor};
use grpo_rollout::config::Arch;
use grpo_rollout::generate::{FinishReason, SamplingParams, generate, left_pad};
use grpo_rollout::init::{Preset, preset_config, random_weights, train_tokenizer};
use grpo_rollout::{Tokenizer, Transformer};

fn setup() -> (Transformer, Tokenizer) {
    let tok = train_tokenizer(400).unwrap();
    let cfg = preset_config(
        Preset::Tiny,
        Arch::Qwen2,
        tok.vocab_size(),
        tok.eos_token_ids[0],
        tok.pad_token_id,
    );
    let m = random_weights(&cfg, 11, DType::F32, &Device::Cpu).unwrap();
    (m.detached(), tok)
}

fn prompts(tok: &Tokenizer) -> Vec<Vec<u32>> {
    ["What is 3 + 4?", "Write about the sea", "alpha beta"]
        .iter()
        .map(|p| tok.encode(p, false).unwrap())
        .collect()
}

#[test]
fn same_seed_same_tokens_other_seed_other_tokens() {
    let (m, tok) = setup();
    let p = SamplingParams {
        max_new_tokens: 12,
        seed: 5,
        ..Default::default()
    };
    let a = generate(&m, &tok, &prompts(&tok), 4, &p).unwrap();
    let b = generate(&m, &tok, &prompts(&tok), 4, &p).unwrap();
    assert_eq!(a, b);
    assert_eq!(a.len(), 12);
    let c = generate(
        &m,
        &tok,
        &prompts(&tok),
        4,
        &SamplingParams {
            seed: 6,
            ..p.clone()
        },
    )
    .unwrap();
    assert_ne!(
        a.iter().map(|x| &x.token_ids).collect::<Vec<_>>(),
        c.iter().map(|x| &x.token_ids).collect::<Vec<_>>()
    );
    assert_eq!(
        a.iter()
            .map(|c| (c.prompt_index, c.sample_index))
            .collect::<Vec<_>>(),
        (0..3)
            .flat_map(|p| (0..4).map(move |s| (p, s)))
            .collect::<Vec<_>>()
    );
    assert!(
        a.iter()
            .all(|c| c.logprobs.len() == c.token_ids.len() && c.logprobs.iter().all(|l| *l <= 0.0))
    );
}

#[test]
fn recorded_logprobs_equal_the_full_forward() {
    let (m, tok) = setup();
    let p = SamplingParams {
        max_new_tokens: 10,
        min_new_tokens: 10,
        temperature: 0.8,
        top_k: 20,
        seed: 1,
        ..Default::default()
    };
    let pr = prompts(&tok);
    let out = generate(&m, &tok, &pr, 2, &p).unwrap();
    for c in &out {
        let mut ids = pr[c.prompt_index].clone();
        ids.extend(&c.token_ids);
        let (ids_t, mask) = left_pad(&[ids], tok.pad_token_id, &Device::Cpu).unwrap();
        let (lp, _) = m
            .completion_logprobs(&ids_t, &mask, c.token_ids.len(), 0.8, false)
            .unwrap();
        let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
        for (a, b) in lp.iter().zip(&c.logprobs) {
            assert!((a - b).abs() < 1e-4, "forward {a} vs sampling {b}");
        }
    }
}

#[test]
fn greedy_is_argmax_and_ignores_seed() {
    let (m, tok) = setup();
    let p = SamplingParams {
        max_new_tokens: 8,
        temperature: 0.0,
        ..Default::default()
    };
    let a = generate(&m, &tok, &prompts(&tok), 2, &p).unwrap();
    let b = generate(
        &m,
        &tok,
        &prompts(&tok),
        2,
        &SamplingParams {
            seed: 99,
            ..p.clone()
        },
    )
    .unwrap();
    assert_eq!(a, b);
    assert_eq!(a[0].token_ids, a[1].token_ids);
    // First greedy token is the argmax of the prompt's last logits.
    let pr = prompts(&tok);
    let (ids, mask) = left_pad(&pr[..1], tok.pad_token_id, &Device::Cpu).unwrap();
    let h = m.forward_padded(&ids, &mask).unwrap();
    let l = h.dim(1).unwrap();
    let logits = m
        .logits(&h.narrow(1, l - 1, 1).unwrap().squeeze(1).unwrap())
        .unwrap();
    let am = logits
        .argmax(candle_core::D::Minus1)
        .unwrap()
        .to_vec1::<u32>()
        .unwrap()[0];
    assert_eq!(a[0].token_ids[0], am);
}

#[test]
fn stop_conditions() {
    let (m, tok) = setup();
    let pr = prompts(&tok);
    // Length.
    let out = generate(
        &m,
        &tok,
        &pr,
        3,
        &SamplingParams {
            max_new_tokens: 5,
            stop_token_ids: vec![],
            ..Default::default()
        },
    )
    .unwrap();
    for c in &out {
        assert!(c.token_ids.len() <= 5);
        if c.finish_reason == FinishReason::Length {
            assert_eq!(c.token_ids.len(), 5);
        }
    }
    // EOS: make every token a stop token, so each completion is exactly one token.
    let all: Vec<u32> = (0..tok.vocab_size() as u32).collect();
    let out = generate(
        &m,
        &tok,
        &pr,
        2,
        &SamplingParams {
            max_new_tokens: 5,
            stop_token_ids: all.clone(),
            ..Default::default()
        },
    )
    .unwrap();
    assert!(
        out.iter()
            .all(|c| c.finish_reason == FinishReason::Eos && c.token_ids.len() == 1)
    );
    // min_new_tokens suppresses the stop tokens until it is reached.
    let out = generate(
        &m,
        &tok,
        &pr,
        2,
        &SamplingParams {
            max_new_tokens: 6,
            min_new_tokens: 4,
            stop_token_ids: all[..all.len() - 1].to_vec(),
            ..Default::default()
        },
    )
    .unwrap();
    for c in &out {
        assert!(c.token_ids.len() >= 4, "{:?}", c.token_ids);
        assert!(
            c.token_ids[..3].iter().all(|&t| t == all[all.len() - 1]),
            "only the non-stop token is allowed before min_new_tokens"
        );
    }
    // Stop string: generate freely, pick a piece of one completion's text as the stop string.
    let free = generate(
        &m,
        &tok,
        &pr[..1],
        1,
        &SamplingParams {
            max_new_tokens: 12,
            seed: 3,
            ..Default::default()
        },
    )
    .unwrap();
    let text = tok.decode(&free[0].token_ids, false).unwrap();
    let stop: String = text
        .chars()
        .skip(text.chars().count() / 2)
        .take(2)
        .collect();
    if !stop.trim().is_empty() {
        let out = generate(
            &m,
            &tok,
            &pr[..1],
            1,
            &SamplingParams {
                max_new_tokens: 12,
                seed: 3,
                stop: vec![stop.clone()],
                ..Default::default()
            },
        )
        .unwrap();
        assert_eq!(
            out[0].finish_reason,
            FinishReason::Stop,
            "stop {stop:?} in {text:?}"
        );
        assert!(!out[0].text.contains(&stop));
        assert!(out[0].token_ids.len() <= free[0].token_ids.len());
    }
}

#[test]
fn top_k_one_is_greedy_and_filters_hold() {
    let (m, tok) = setup();
    let pr = prompts(&tok);
    let greedy = generate(
        &m,
        &tok,
        &pr,
        1,
        &SamplingParams {
            max_new_tokens: 6,
            temperature: 0.0,
            ..Default::default()
        },
    )
    .unwrap();
    let k1 = generate(
        &m,
        &tok,
        &pr,
        1,
        &SamplingParams {
            max_new_tokens: 6,
            temperature: 1.0,
            top_k: 1,
            seed: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        greedy.iter().map(|c| &c.token_ids).collect::<Vec<_>>(),
        k1.iter().map(|c| &c.token_ids).collect::<Vec<_>>()
    );
    let tiny_p = generate(
        &m,
        &tok,
        &pr,
        1,
        &SamplingParams {
            max_new_tokens: 6,
            temperature: 1.0,
            top_p: 1e-6,
            seed: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        greedy.iter().map(|c| &c.token_ids).collect::<Vec<_>>(),
        tiny_p.iter().map(|c| &c.token_ids).collect::<Vec<_>>()
    );
    let min_p = generate(
        &m,
        &tok,
        &pr,
        1,
        &SamplingParams {
            max_new_tokens: 6,
            temperature: 1.0,
            min_p: 1.0,
            seed: 4,
            ..Default::default()
        },
    )
    .unwrap();
    assert_eq!(
        greedy.iter().map(|c| &c.token_ids).collect::<Vec<_>>(),
        min_p.iter().map(|c| &c.token_ids).collect::<Vec<_>>()
    );
}

#[test]
fn invalid_params_are_errors() {
    let (m, tok) = setup();
    for (p, field) in [
        (
            SamplingParams {
                top_p: 0.0,
                ..Default::default()
            },
            "top_p",
        ),
        (
            SamplingParams {
                temperature: -1.0,
                ..Default::default()
            },
            "temperature",
        ),
        (
            SamplingParams {
                min_new_tokens: 9,
                max_new_tokens: 3,
                ..Default::default()
            },
            "min_new_tokens",
        ),
    ] {
        let e = generate(&m, &tok, &prompts(&tok), 1, &p)
            .unwrap_err()
            .to_string();
        assert!(e.contains(field), "{e}");
    }
    let e = generate(&m, &tok, &[vec![]], 1, &SamplingParams::default())
        .unwrap_err()
        .to_string();
    assert!(e.contains("prompt 0"), "{e}");
    let _ = Tensor::zeros(1, DType::F32, &Device::Cpu);
}
