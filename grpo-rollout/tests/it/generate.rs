//! Generation: seeds, stop conditions, min_new_tokens, recorded log-probs, per-token reports
//! (streaming) and logit_bias.
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{DType, Device, Tensor};
use grpo_rollout::config::Arch;
use grpo_rollout::generate::{
    FinishReason, PromptRequest, SamplingParams, generate, generate_batch_with, left_pad,
};
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

#[test]
fn batched_requests_equal_each_request_alone() {
    use grpo_rollout::generate::{PromptRequest, generate_batch};
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let p = SamplingParams {
        max_new_tokens: 10,
        ..Default::default()
    };
    let reqs = [
        PromptRequest {
            ids: &ps[0],
            n: 3,
            seed: 7,
            first_stream: 0,
        },
        PromptRequest {
            ids: &ps[1],
            n: 0,
            seed: 1,
            first_stream: 0,
        },
        PromptRequest {
            ids: &ps[2],
            n: 2,
            seed: 9,
            first_stream: 0,
        },
    ];
    let all = generate_batch(&m, &tok, &reqs, &p).unwrap();
    assert_eq!(
        all.iter()
            .map(|c| (c.prompt_index, c.sample_index))
            .collect::<Vec<_>>(),
        vec![(0, 0), (0, 1), (0, 2), (2, 0), (2, 1)]
    );
    for (i, r) in reqs.iter().enumerate() {
        let alone = generate(
            &m,
            &tok,
            &[r.ids.to_vec()],
            r.n,
            &SamplingParams {
                seed: r.seed,
                ..p.clone()
            },
        )
        .unwrap();
        let batched: Vec<_> = all.iter().filter(|c| c.prompt_index == i).collect();
        assert_eq!(alone.len(), batched.len());
        for (a, b) in alone.iter().zip(batched) {
            assert_eq!(a.token_ids, b.token_ids, "request {i}");
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "request {i}: {x} vs {y}");
            }
        }
    }
    // `generate` is `generate_batch` with streams p·n + j.
    let g = generate(
        &m,
        &tok,
        &ps,
        2,
        &SamplingParams {
            seed: 4,
            ..p.clone()
        },
    )
    .unwrap();
    let reqs: Vec<_> = ps
        .iter()
        .enumerate()
        .map(|(i, x)| PromptRequest {
            ids: x,
            n: 2,
            seed: 4,
            first_stream: 2 * i as u64,
        })
        .collect();
    assert_eq!(g, generate_batch(&m, &tok, &reqs, &p).unwrap());
}

#[test]
fn top_logprobs_are_the_best_alternatives_of_the_full_distribution() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let p = SamplingParams {
        max_new_tokens: 6,
        temperature: 0.7,
        top_logprobs: 3,
        seed: 2,
        ..Default::default()
    };
    let out = generate(&m, &tok, &ps[..1], 2, &p).unwrap();
    for c in &out {
        assert_eq!(c.top_logprobs.len(), c.token_ids.len());
        // Reference: the full forward's log_softmax(logits / T) at each completion position.
        let mut ids = ps[0].clone();
        ids.extend(&c.token_ids);
        let n = ids.len();
        let t = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
        let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
        let hidden = m.forward_padded(&t, &mask).unwrap();
        let logits = m.logits(&hidden.squeeze(0).unwrap()).unwrap();
        let logits: Vec<Vec<f32>> = logits.to_vec2().unwrap();
        for (k, top) in c.top_logprobs.iter().enumerate() {
            let row: Vec<f32> = logits[ps[0].len() - 1 + k]
                .iter()
                .map(|z| z / 0.7)
                .collect();
            let mx = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
            let lse = mx + row.iter().map(|z| (z - mx).exp()).sum::<f32>().ln();
            let mut order: Vec<usize> = (0..row.len()).collect();
            order.sort_by(|a, b| row[*b].total_cmp(&row[*a]));
            assert_eq!(top.len(), 3);
            for (j, &(id, lp)) in top.iter().enumerate() {
                assert_eq!(id as usize, order[j], "position {k}");
                assert!((lp - (row[order[j]] - lse)).abs() < 1e-4);
            }
            assert!(c.logprobs[k] <= top[0].1 + 1e-6);
        }
    }
    // Off by default.
    let plain = generate(
        &m,
        &tok,
        &ps[..1],
        1,
        &SamplingParams {
            top_logprobs: 0,
            ..p
        },
    )
    .unwrap();
    assert!(plain[0].top_logprobs.is_empty());
}

/// `generate_batch_with` reports every token of every row as it is sampled (the row's tokens
/// grow by one each time, the last report carries the completion), and a row its caller no
/// longer wants leaves the batch without changing the others.
#[test]
fn per_token_reports_and_dropped_rows() {
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let reqs: Vec<PromptRequest<'_>> = ps
        .iter()
        .map(|ids| PromptRequest {
            ids,
            n: 2,
            seed: 9,
            first_stream: 0,
        })
        .collect();
    let p = SamplingParams {
        max_new_tokens: 10,
        top_logprobs: 1,
        ..Default::default()
    };
    let mut seen: std::collections::HashMap<(usize, usize), Vec<u32>> = Default::default();
    let mut finished = Vec::new();
    let all = generate_batch_with(&m, &tok, &reqs, &p, &mut |e| {
        let row = seen.entry((e.prompt_index, e.sample_index)).or_default();
        assert_eq!(
            e.token_ids[..row.len()],
            row[..],
            "a row's tokens only grow"
        );
        assert_eq!(e.token_ids.len(), row.len() + 1, "one report per token");
        assert_eq!(e.logprobs.len(), e.token_ids.len());
        assert_eq!(e.top_logprobs.len(), e.token_ids.len());
        *row = e.token_ids.to_vec();
        if let Some(c) = e.finished {
            assert_eq!(c.token_ids, e.token_ids);
            finished.push(c.clone());
        }
        true
    })
    .unwrap();
    finished.sort_by_key(|c| (c.prompt_index, c.sample_index));
    assert_eq!(finished, all);
    assert_eq!(all.len(), 6);

    // Dropping row (1, 0) after 3 tokens: it has no completion; the others are unchanged.
    let fewer = generate_batch_with(&m, &tok, &reqs, &p, &mut |e| {
        !(e.prompt_index == 1 && e.sample_index == 0 && e.token_ids.len() == 3)
    })
    .unwrap();
    let kept: Vec<_> = all
        .iter()
        .filter(|c| (c.prompt_index, c.sample_index) != (1, 0))
        .cloned()
        .collect();
    assert!(
        all.iter()
            .any(|c| (c.prompt_index, c.sample_index) == (1, 0) && c.token_ids.len() > 3)
    );
    assert_eq!(fewer, kept);
}

/// `logit_bias`: -100 bans the greedy token, +100 forces a token at every step, and a
/// bias outside [-100, 100] is refused naming the field.
#[test]
fn logit_bias_bans_and_forces() {
    let (m, tok) = setup();
    let ps = &prompts(&tok)[..1];
    let greedy = SamplingParams {
        max_new_tokens: 6,
        temperature: 0.0,
        ..Default::default()
    };
    let plain = generate(&m, &tok, ps, 1, &greedy)
        .unwrap()
        .remove(0)
        .token_ids;
    let banned = generate(
        &m,
        &tok,
        ps,
        1,
        &SamplingParams {
            logit_bias: vec![(plain[0], -100.0)],
            ..greedy.clone()
        },
    )
    .unwrap()
    .remove(0)
    .token_ids;
    assert!(!banned.contains(&plain[0]), "{banned:?}");
    let x = tok.encode("a", false).unwrap()[0];
    for temperature in [0.0, 1.0] {
        let forced = generate(
            &m,
            &tok,
            ps,
            1,
            &SamplingParams {
                temperature,
                logit_bias: vec![(x, 100.0)],
                ..greedy.clone()
            },
        )
        .unwrap()
        .remove(0);
        assert_eq!(forced.token_ids, vec![x; 6]);
        // The recorded log-probs are the model's own, not the biased ones.
        assert!(
            forced.logprobs.iter().all(|&lp| lp < -0.01),
            "{:?}",
            forced.logprobs
        );
    }
    let err = SamplingParams {
        logit_bias: vec![(x, 101.0)],
        ..greedy
    }
    .validate()
    .unwrap_err()
    .to_string();
    assert!(err.starts_with("logit_bias"), "{err}");
}

/// Sampling with tensor ops on the device (what CUDA runs; here forced on the CPU) gives the
/// completions the host sampler gives, for every knob: the same draws from the same streams,
/// the same masks and positions grown on the device, rows leaving the batch as they finish.
#[test]
fn device_sampling_equals_host_sampling() {
    use grpo_rollout::generate::with_device_sampling;
    let (m, tok) = setup();
    let ps = prompts(&tok);
    // Stop ids common enough that rows finish at different steps.
    let base = SamplingParams {
        max_new_tokens: 12,
        seed: 4,
        stop_token_ids: (20..60).collect(),
        ..Default::default()
    };
    let cases = [
        base.clone(),
        SamplingParams {
            temperature: 0.0,
            ..base.clone()
        },
        SamplingParams {
            temperature: 0.7,
            top_k: 9,
            top_p: 0.9,
            min_p: 0.02,
            repetition_penalty: 1.2,
            min_new_tokens: 3,
            top_logprobs: 2,
            logit_bias: vec![(5, 2.0)],
            ..base.clone()
        },
    ];
    for p in cases {
        let host = with_device_sampling(false, || generate(&m, &tok, &ps, 3, &p)).unwrap();
        let dev = with_device_sampling(true, || generate(&m, &tok, &ps, 3, &p)).unwrap();
        assert_eq!(host.len(), dev.len());
        let lens: std::collections::BTreeSet<usize> =
            host.iter().map(|c| c.token_ids.len()).collect();
        assert!(lens.len() > 1 || p.temperature == 0.0, "{lens:?}");
        for (h, d) in host.iter().zip(&dev) {
            assert_eq!(h.token_ids, d.token_ids, "{p:?}");
            assert_eq!(h.finish_reason, d.finish_reason);
            for (a, b) in h.logprobs.iter().zip(&d.logprobs) {
                assert!((a - b).abs() < 1e-4, "{a} vs {b}");
            }
            assert_eq!(h.top_logprobs.len(), d.top_logprobs.len());
            for (a, b) in h
                .top_logprobs
                .iter()
                .flatten()
                .zip(d.top_logprobs.iter().flatten())
            {
                assert_eq!(a.0, b.0);
                assert!((a.1 - b.1).abs() < 1e-4);
            }
        }
    }
}

/// Finished rows may stay in the decode batch until several have finished (what a GPU does: a
/// compaction copies the whole KV cache): the completions are those of retiring each row at
/// once, with the host sampler and the device one, every knob on.
#[test]
fn retiring_finished_rows_late_changes_nothing() {
    use grpo_rollout::generate::{with_device_sampling, with_retire_every};
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let base = SamplingParams {
        max_new_tokens: 14,
        seed: 9,
        stop_token_ids: (20..60).collect(),
        ..Default::default()
    };
    let knobs = SamplingParams {
        temperature: 0.8,
        top_k: 12,
        top_p: 0.95,
        repetition_penalty: 1.3,
        min_new_tokens: 2,
        top_logprobs: 1,
        ..base.clone()
    };
    for p in [base, knobs] {
        for device in [false, true] {
            let run = |k: usize| {
                with_device_sampling(device, || {
                    with_retire_every(k, || generate(&m, &tok, &ps, 4, &p))
                })
                .unwrap()
            };
            let eager = run(1);
            let lens: std::collections::BTreeSet<usize> =
                eager.iter().map(|c| c.token_ids.len()).collect();
            assert!(
                lens.len() > 2,
                "rows should finish at several steps: {lens:?}"
            );
            for k in [3, 1000] {
                let late = run(k);
                assert_eq!(late.len(), eager.len());
                for (a, b) in eager.iter().zip(&late) {
                    let what = format!("device {device}, retire every {k}, {p:?}");
                    assert_eq!(a.token_ids, b.token_ids, "{what}");
                    assert_eq!(a.finish_reason, b.finish_reason, "{what}");
                    assert_eq!(a.text, b.text, "{what}");
                    for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                        assert!((x - y).abs() < 1e-5, "{what}: {x} vs {y}");
                    }
                    assert_eq!(a.top_logprobs.len(), b.top_logprobs.len(), "{what}");
                }
            }
        }
    }
}

/// The decode step as a CUDA graph replays it (its buffers written in place, the cached length
/// read from a tensor, the bias spanning the cache), run on the CPU: the same tokens and
/// log-probs as the eager step, through rows finishing at different steps and the batch
/// compacting (a new "capture" per batch size), with the host sampler and the device one.
#[test]
fn decode_steps_as_a_graph_replays_them_change_nothing() {
    use grpo_rollout::generate::{with_device_sampling, with_retire_every};
    use grpo_rollout::graph::{captures, replayed_on_the_host};
    let (m32, tok) = setup();
    let ps = prompts(&tok);
    let p = SamplingParams {
        max_new_tokens: 14,
        seed: 4,
        stop_token_ids: (20..60).collect(),
        temperature: 0.9,
        top_p: 0.95,
        repetition_penalty: 1.2,
        min_new_tokens: 1,
        ..Default::default()
    };
    // f16 too: its bias buffer is clamped and kept in f16. And Qwen3, whose per-head q/k norms
    // go before the packed cache pass.
    let m16 = random_weights(&m32.cfg, 11, DType::F16, &Device::Cpu)
        .unwrap()
        .detached();
    let qwen3 = {
        let cfg = preset_config(
            Preset::Tiny,
            Arch::Qwen3,
            tok.vocab_size(),
            tok.eos_token_ids[0],
            tok.pad_token_id,
        );
        random_weights(&cfg, 12, DType::F32, &Device::Cpu)
            .unwrap()
            .detached()
    };
    for (m, device) in [(&m32, false), (&m32, true), (&m16, true), (&qwen3, true)] {
        let run = || {
            with_device_sampling(device, || {
                with_retire_every(3, || generate(m, &tok, &ps, 4, &p))
            })
            .unwrap()
        };
        let eager = run();
        let before = captures();
        let graphed = replayed_on_the_host(run);
        // One per batch size: the first and at least one after a compaction.
        assert!(captures() >= before + 2, "{} captures", captures() - before);
        let lens: std::collections::BTreeSet<usize> =
            eager.iter().map(|c| c.token_ids.len()).collect();
        assert!(
            lens.len() > 2,
            "rows should finish at several steps: {lens:?}"
        );
        assert_eq!(graphed.len(), eager.len());
        for (a, b) in eager.iter().zip(&graphed) {
            assert_eq!(a.token_ids, b.token_ids, "device sampler {device}");
            assert_eq!(a.logprobs, b.logprobs, "device sampler {device}");
            assert_eq!(a.finish_reason, b.finish_reason);
        }
    }
}

/// The first replay is checked against the eager step: replays whose logits are spoiled are
/// caught, and the generation is the eager one (the graph dropped at its first replay).
#[test]
fn a_replay_that_differs_from_the_eager_step_is_dropped() {
    use grpo_rollout::graph::{captures, replayed_on_the_host, with_corrupted_replays};
    let (m, tok) = setup();
    let ps = prompts(&tok);
    let p = SamplingParams {
        max_new_tokens: 10,
        seed: 2,
        temperature: 0.8,
        ..Default::default()
    };
    let eager = generate(&m, &tok, &ps, 3, &p).unwrap();
    let before = captures();
    let spoiled =
        replayed_on_the_host(|| with_corrupted_replays(|| generate(&m, &tok, &ps, 3, &p))).unwrap();
    assert!(captures() > before, "nothing was captured");
    for (a, b) in eager.iter().zip(&spoiled) {
        assert_eq!(a.token_ids, b.token_ids);
        assert_eq!(a.logprobs, b.logprobs);
    }
}

/// LoRA: sampling from the merged decoding copy (a GPU generator's) draws the tokens the
/// unmerged adapters draw, seeded, at temperature 1.
#[test]
fn the_merged_lora_copy_samples_the_adapted_models_tokens() {
    use grpo_rollout::lora::{LoraConfig, merged_for_decoding};
    use grpo_rollout::policy::TrainableModel;
    let (m, tok) = setup();
    let tm = TrainableModel::lora(
        &m,
        &LoraConfig {
            r: 4,
            lora_alpha: 8.0,
            ..LoraConfig::default()
        },
        3,
    )
    .unwrap();
    for (name, v) in &tm.vars {
        if name.contains("lora_B") {
            let n = v.elem_count();
            let vals: Vec<f32> = (0..n).map(|j| 0.3 * ((j * 5 + 1) as f32).sin()).collect();
            v.set(&Tensor::from_vec(vals, v.shape(), &Device::Cpu).unwrap())
                .unwrap();
        }
    }
    let snap = tm.model.snapshot_trainable().unwrap();
    let p = SamplingParams {
        max_new_tokens: 10,
        seed: 7,
        ..Default::default()
    };
    let ids = |model: &Transformer| -> Vec<Vec<u32>> {
        generate(model, &tok, &prompts(&tok), 2, &p)
            .unwrap()
            .into_iter()
            .map(|c| c.token_ids)
            .collect()
    };
    let adapted = ids(&snap.for_decoding().unwrap());
    assert_eq!(ids(&merged_for_decoding(&snap).unwrap()), adapted);
    assert_ne!(
        ids(&m.for_decoding().unwrap()),
        adapted,
        "the adapters change the samples"
    );
}

/// Full-forward logits `(L, V)` of one unpadded sequence.
fn sequence_logits(m: &Transformer, ids: &[u32]) -> Vec<Vec<f32>> {
    let (ids_t, mask) = left_pad(&[ids.to_vec()], 0, &Device::Cpu).unwrap();
    let h = m.forward_padded(&ids_t, &mask).unwrap().squeeze(0).unwrap();
    m.logits(&h).unwrap().to_vec2().unwrap()
}

/// Nash-MD's geometric mixture: every recorded log-prob is the mixture's,
/// `log_softmax((c·z_ref + (1 − c)·z_model) / T)` at the sampled token, where the logits are
/// each model's full forward of the sequence so far; `c = 0` samples the model's own tokens and
/// `c = 1` the reference's; the same holds through rows leaving the batch, with the device
/// sampler, and with decode steps replayed as graphs.
#[test]
fn the_geometric_mixture_samples_from_both_models_logits() {
    use grpo_rollout::generate::{
        GeometricMixture, PromptRequest, generate_batch, generate_mixture, with_device_sampling,
        with_retire_every,
    };
    use grpo_rollout::graph::replayed_on_the_host;
    let (m, tok) = setup();
    let r = random_weights(&m.cfg, 29, DType::F32, &Device::Cpu)
        .unwrap()
        .detached();
    let ps = prompts(&tok);
    let p = SamplingParams {
        max_new_tokens: 10,
        seed: 3,
        temperature: 0.8,
        stop_token_ids: (20..60).collect(),
        ..Default::default()
    };
    let requests: Vec<PromptRequest<'_>> = ps
        .iter()
        .enumerate()
        .map(|(i, ids)| PromptRequest {
            ids,
            n: 3,
            seed: 3,
            first_stream: 3 * i as u64,
        })
        .collect();
    let mix = |c: f64| GeometricMixture {
        reference: &r,
        coef: c,
    };
    // The ends: the model alone, the reference alone.
    for (c, alone) in [(0.0, &m), (1.0, &r)] {
        let mixed = generate_mixture(&m, mix(c), &tok, &requests, &p).unwrap();
        let single = generate_batch(alone, &tok, &requests, &p).unwrap();
        assert_eq!(mixed.len(), single.len());
        for (a, b) in mixed.iter().zip(&single) {
            assert_eq!(a.token_ids, b.token_ids, "c = {c}");
            for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                assert!((x - y).abs() < 1e-4, "c = {c}: {x} vs {y}");
            }
        }
    }
    let c = 0.3;
    let out = generate_mixture(&m, mix(c), &tok, &requests, &p).unwrap();
    let lens: std::collections::BTreeSet<usize> = out.iter().map(|c| c.token_ids.len()).collect();
    assert!(
        lens.len() > 1,
        "rows should finish at several steps: {lens:?}"
    );
    assert_ne!(
        out.iter().map(|c| &c.token_ids).collect::<Vec<_>>(),
        generate_batch(&m, &tok, &requests, &p)
            .unwrap()
            .iter()
            .map(|c| &c.token_ids)
            .collect::<Vec<_>>(),
        "the mixture samples other tokens than the model alone"
    );
    for o in &out {
        let mut ids = ps[o.prompt_index].clone();
        let n = ids.len();
        ids.extend(&o.token_ids);
        let (zm, zr) = (sequence_logits(&m, &ids), sequence_logits(&r, &ids));
        for (j, (&tok_id, &lp)) in o.token_ids.iter().zip(&o.logprobs).enumerate() {
            let z: Vec<f64> = zm[n - 1 + j]
                .iter()
                .zip(&zr[n - 1 + j])
                .map(|(a, b)| (c * *b as f64 + (1.0 - c) * *a as f64) / 0.8)
                .collect();
            let max = z.iter().cloned().fold(f64::MIN, f64::max);
            let lse = max + z.iter().map(|v| (v - max).exp()).sum::<f64>().ln();
            let want = z[tok_id as usize] - lse;
            assert!(
                (want - lp as f64).abs() < 1e-4,
                "row ({}, {}), token {j}: {want} vs {lp}",
                o.prompt_index,
                o.sample_index
            );
        }
    }
    // Late retirement, the device sampler and graph replays change nothing.
    for device in [false, true] {
        let run = || {
            with_device_sampling(device, || {
                with_retire_every(3, || generate_mixture(&m, mix(c), &tok, &requests, &p))
            })
            .unwrap()
        };
        for other in [run(), replayed_on_the_host(run)] {
            assert_eq!(other.len(), out.len());
            for (a, b) in out.iter().zip(&other) {
                assert_eq!(a.token_ids, b.token_ids, "device sampler {device}");
                for (x, y) in a.logprobs.iter().zip(&b.logprobs) {
                    assert!((x - y).abs() < 1e-4, "{x} vs {y}");
                }
            }
        }
    }
    // Refusals.
    let e = generate_mixture(&m, mix(1.5), &tok, &requests, &p).unwrap_err();
    assert!(e.to_string().contains("[0, 1]"), "{e}");
    let mut cfg = m.cfg.clone();
    cfg.vocab_size += 8;
    let other = random_weights(&cfg, 3, DType::F32, &Device::Cpu).unwrap();
    let e = generate_mixture(
        &m,
        GeometricMixture {
            reference: &other,
            coef: 0.5,
        },
        &tok,
        &requests,
        &p,
    )
    .unwrap_err();
    assert!(e.to_string().contains("one vocabulary"), "{e}");
}
