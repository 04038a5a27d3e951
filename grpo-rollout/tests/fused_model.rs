//! The whole decoder with fused kernels against the same decoder on plain compositions: equal
//! log-probs, entropies and gradients for every weight (llama with biases, qwen2, qwen3).
//! One test in its own binary, because it flips the process-wide fused switch.
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{DType, Device, Tensor};
use grpo_rollout::config::Arch;
use grpo_rollout::init::{Preset, preset_config, random_weights};
use grpo_rollout::policy::TrainableModel;

fn max_abs(t: &Tensor) -> f64 {
    t.abs()
        .unwrap()
        .flatten_all()
        .unwrap()
        .max(0)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

#[test]
fn fused_and_composed_decoders_agree() {
    let rows = vec![
        vec![5u32, 9, 2, 33, 7, 12, 40],
        vec![8, 3, 20, 11],
        vec![17, 6, 50, 4, 9],
    ];
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    for arch in Arch::ALL {
        for dtype in [DType::F64, DType::F32] {
            let mut c = preset_config(Preset::Tiny, arch, 61, 1, 0);
            c.nope_layers = match arch {
                Arch::SmolLM3 => vec![0],
                _ => vec![],
            };
            c.sliding_window =
                matches!(arch, Arch::Mistral | Arch::Gemma2 | Arch::Gemma3).then_some(4);
            c.sliding_layers = match arch {
                Arch::Gemma2 | Arch::Gemma3 => vec![1],
                _ => vec![],
            };
            if arch == Arch::Gemma2 {
                // Caps that bind on these small random weights.
                (c.attn_logit_softcapping, c.final_logit_softcapping) = (Some(0.5), Some(2.0));
            }
            c.hidden_size = 32;
            c.num_attention_heads = 4;
            c.num_key_value_heads = 2;
            c.head_dim = 8;
            // DeepSeek's latent attention: every head its key and value, queries of 4 + 4.
            if let Some(m) = c.mla.as_mut() {
                c.num_key_value_heads = 4;
                (m.qk_nope_head_dim, m.qk_rope_head_dim) = (4, 4);
                m.v_head_dim = if arch == Arch::Glm4MoeLite { 8 } else { 4 };
                (m.q_lora_rank, m.kv_lora_rank) = (m.q_lora_rank.map(|_| 16), 16);
            }
            c.intermediate_size = 48;
            // Mixtral's and OLMoE's experts are the MLP's width.
            if let Some(m) = c.moe.as_mut() {
                m.moe_intermediate_size = if arch.experts_mlp_wide() { 48 } else { 24 };
            }
            c.attention_bias = arch != Arch::Qwen3;
            // ERNIE 4.5's one `use_bias` biases the MLP too.
            c.mlp_bias = arch == Arch::Ernie45;
            let base = random_weights(&c, 5, dtype, &Device::Cpu).unwrap();
            let mut outs = Vec::new();
            for on in [true, false] {
                grpo_core::fused::set_enabled(on);
                let tm = TrainableModel::full(&base).unwrap();
                let (lp, ent) = tm
                    .model
                    .completion_logprobs(&ids, &mask, 3, 0.7, true)
                    .unwrap();
                let ent = ent.unwrap();
                let loss =
                    ((&lp * 0.3).unwrap().sum_all().unwrap() - ent.sum_all().unwrap()).unwrap();
                let grads = loss.backward().unwrap();
                let g: Vec<(String, Tensor)> = tm
                    .vars
                    .iter()
                    .map(|(n, v)| {
                        // An expert no token was routed to has no gradient (both paths).
                        let g = match grads.get(v.as_tensor()) {
                            Some(g) => g.clone(),
                            None if n.contains(".experts.") => v.zeros_like().unwrap(),
                            None => panic!("{arch:?}: no gradient for `{n}`"),
                        };
                        (n.clone(), g)
                    })
                    .collect();
                outs.push((lp, ent, g));
            }
            grpo_core::fused::set_enabled(true);
            let tol = if dtype == DType::F64 { 1e-10 } else { 1e-4 };
            let (a, b) = (&outs[0], &outs[1]);
            assert!(
                max_abs(&(&a.0 - &b.0).unwrap()) < tol,
                "{arch:?} {dtype:?} log-probs"
            );
            assert!(
                max_abs(&(&a.1 - &b.1).unwrap()) < tol,
                "{arch:?} {dtype:?} entropies"
            );
            for ((name, ga), (_, gb)) in a.2.iter().zip(&b.2) {
                let scale = max_abs(gb).max(1e-3);
                let d = max_abs(&(ga - gb).unwrap());
                assert!(
                    d / scale < tol,
                    "{arch:?} {dtype:?} gradient of {name}: {d} (scale {scale})"
                );
            }
        }
    }
}
