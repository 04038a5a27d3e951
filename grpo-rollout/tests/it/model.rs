//! The transformer: gradients, finite differences, padding, KV cache, LoRA, saving.
#![allow(clippy::unwrap_used, clippy::needless_range_loop, missing_docs)]

use crate::common;

use std::collections::HashMap;

use candle_core::{DType, Device, Tensor, Var};
use grpo_rollout::config::{Arch, ModelConfig};
use grpo_rollout::init::{Preset, preset_config, random_weights};
use grpo_rollout::lora::{self, LoraConfig, TargetModules};
use grpo_rollout::model::{KvCache, Transformer, padded_positions_and_bias};
use grpo_rollout::policy::TrainableModel;

const VOCAB: usize = 61;

fn cfg(arch: Arch) -> ModelConfig {
    let mut c = preset_config(Preset::Tiny, arch, VOCAB, 1, 0);
    c.hidden_size = 32;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.intermediate_size = 48;
    // DeepSeek's latent attention: every head its key and value, queries of 4 + 4 (DeepSeek's
    // values narrower, zero-padded; GLM-4.7-Flash's as wide).
    if let Some(m) = c.mla.as_mut() {
        c.num_key_value_heads = 4;
        (m.qk_nope_head_dim, m.qk_rope_head_dim) = (4, 4);
        m.v_head_dim = if arch == Arch::Glm4MoeLite { 8 } else { 4 };
        (m.q_lora_rank, m.kv_lora_rank) = (m.q_lora_rank.map(|_| 16), 16);
    }
    // Mixtral's and OLMoE's experts are the MLP's width.
    if let (true, Some(m)) = (arch.experts_mlp_wide(), c.moe.as_mut()) {
        m.moe_intermediate_size = c.intermediate_size;
    }
    if arch == Arch::SmolLM3 {
        c.nope_layers = vec![1]; // of the two layers (transformers' default: every 4th)
    }
    if arch == Arch::Mistral {
        c.sliding_window = Some(5); // shorter than the batch's rows
    }
    if arch == Arch::Gemma3 {
        c.sliding_window = Some(5);
        c.sliding_layers = vec![0]; // a sliding layer and a full one
    }
    if arch == Arch::Gemma2 {
        c.sliding_window = Some(5);
        c.sliding_layers = vec![0];
        // Caps that bind on these small random weights.
        (c.attn_logit_softcapping, c.final_logit_softcapping) = (Some(0.5), Some(2.0));
    }
    if arch == Arch::Phi3 {
        c.sliding_window = Some(5); // beside 6 of 8 dimensions rotating (the preset's 0.75)
    }
    if arch == Arch::Gemma4 {
        // Sliding, full, sliding, full; the last two reusing the first two's keys and values
        // (beside the preset's per-layer inputs, keys as values on the full layers and their
        // double-wide MLPs); a window shorter than the rows.
        c.num_hidden_layers = 4;
        c.sliding_window = Some(5);
        c.sliding_layers = vec![0, 2];
        if let Some(g) = c.gemma4.as_mut() {
            g.kv_shared_layers = 2;
            g.global_head_dim = 16;
        }
    }
    if arch == Arch::GptOss {
        c.sliding_window = Some(5); // on layer 0, beside a global layer 1
        // Three of four experts a token: each expert gets rows of this small batch.
        if let Some(m) = c.moe.as_mut() {
            m.num_experts_per_tok = 3;
        }
    }
    c
}

/// Every architecture, the llama-like variants with what sets them apart.
const ARCHES: [Arch; 35] = Arch::ALL;

fn model(arch: Arch, dtype: DType, untied: bool) -> Transformer {
    let mut c = cfg(arch);
    c.tie_word_embeddings = !untied;
    // Exercise the llama bias path (o_proj too). Not on SmolLM3: in its NoPE layer a key bias
    // shifts a query's every score alike, which softmax cancels (its gradient is 0).
    if arch == Arch::Llama {
        c.attention_bias = true;
    }
    random_weights(&c, 3, dtype, &Device::Cpu).unwrap()
}

/// A left-padded batch: rows of different lengths.
fn batch() -> (Vec<Vec<u32>>, usize) {
    (
        vec![
            vec![5, 9, 2, 33, 7, 12, 40],
            vec![8, 3, 20, 11],
            vec![17, 6, 50, 4, 9],
        ],
        3,
    )
}

fn padded(rows: &[Vec<u32>]) -> (Tensor, Tensor) {
    grpo_rollout::generate::left_pad(rows, 0, &Device::Cpu).unwrap()
}

/// Σ w_bt · logp_bt over the last `t` tokens, with fixed pseudo-random weights.
fn loss(m: &Transformer, rows: &[Vec<u32>], t: usize) -> Tensor {
    let (ids, mask) = padded(rows);
    let (lp, ent) = m.completion_logprobs(&ids, &mask, t, 0.7, true).unwrap();
    let (b, t) = lp.dims2().unwrap();
    let w: Vec<f64> = (0..b * t)
        .map(|i| ((i * 37 % 11) as f64 - 5.0) / 5.0)
        .collect();
    let w = Tensor::from_vec(w, (b, t), &Device::Cpu)
        .unwrap()
        .to_dtype(lp.dtype())
        .unwrap();
    ((lp * &w).unwrap().sum_all().unwrap() + (ent.unwrap() * 0.1).unwrap().sum_all().unwrap())
        .unwrap()
}

#[test]
fn every_weight_gets_a_finite_nonzero_gradient() {
    for arch in ARCHES {
        for untied in [false, true] {
            let tm = TrainableModel::full(&model(arch, DType::F32, untied)).unwrap();
            let (rows, t) = batch();
            let grads = loss(&tm.model, &rows, t).backward().unwrap();
            assert!(!tm.vars.is_empty());
            for (name, v) in &tm.vars {
                let g = grads
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{arch:?}: no gradient reached `{name}`"));
                let g: Vec<f32> = g.flatten_all().unwrap().to_vec1().unwrap();
                assert!(
                    g.iter().all(|x| x.is_finite()),
                    "{arch:?} {name}: non-finite gradient"
                );
                assert!(
                    g.iter().any(|&x| x != 0.0),
                    "{arch:?} {name}: zero gradient"
                );
            }
        }
    }
}

fn nonzero_b(tm: &TrainableModel) {
    // B starts at 0 (as PEFT), which makes A's gradient 0: move B as one step would.
    for (name, v) in &tm.vars {
        if name.contains("lora_B") {
            let r = Tensor::randn(0f32, 0.05, v.shape(), &Device::Cpu)
                .unwrap()
                .to_dtype(v.dtype())
                .unwrap();
            v.set(&r).unwrap();
        }
    }
}

/// `base` with rank-4 adapters on its default targets, their `B` made nonzero.
fn adapted(base: &Transformer) -> TrainableModel {
    let lc = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        ..LoraConfig::default()
    };
    let tm = TrainableModel::lora(base, &lc, 5).unwrap();
    nonzero_b(&tm);
    tm
}

#[test]
fn lora_trains_only_adapters_and_every_factor_gets_a_gradient() {
    let base = model(Arch::Qwen2, DType::F32, false);
    let cfg = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.0,
        target_modules: TargetModules::Pattern(lora::ALL_LINEAR.into()),
        ..LoraConfig::default()
    };
    let tm = TrainableModel::lora(&base, &cfg, 1).unwrap();
    assert_eq!(tm.vars.len(), 2 * 7 * base.layers.len());
    // At init (B = 0) the adapted model equals the base.
    let (rows, t) = batch();
    let a = loss(&base, &rows, t).to_scalar::<f32>().unwrap();
    let b = loss(&tm.model, &rows, t).to_scalar::<f32>().unwrap();
    assert!((a - b).abs() < 1e-5, "{a} vs {b}");
    nonzero_b(&tm);
    let grads = loss(&tm.model, &rows, t).backward().unwrap();
    for (name, v) in &tm.vars {
        let g: Vec<f32> = grads
            .get(v.as_tensor())
            .unwrap_or_else(|| panic!("no gradient for {name}"))
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        assert!(
            g.iter().all(|x| x.is_finite()) && g.iter().any(|&x| x != 0.0),
            "{name}"
        );
    }
    // The frozen base receives none.
    for (name, w) in tm.model.weights() {
        assert!(grads.get(&w).is_none(), "base weight {name} got a gradient");
    }
}

/// Central differences in f64 against autograd, on several elements of each kind of weight.
#[test]
fn finite_differences_match_autograd_in_f64() {
    let (rows, t) = batch();
    for arch in [Arch::Llama, Arch::Qwen3] {
        let tm = TrainableModel::full(&model(arch, DType::F64, true)).unwrap();
        let grads = loss(&tm.model, &rows, t).backward().unwrap();
        let kinds = [
            "model.embed_tokens.weight",
            "model.layers.0.self_attn.q_proj.weight",
            "model.layers.1.self_attn.k_proj.weight",
            "model.layers.0.self_attn.v_proj.weight",
            "model.layers.1.self_attn.o_proj.weight",
            "model.layers.0.mlp.gate_proj.weight",
            "model.layers.1.mlp.up_proj.weight",
            "model.layers.0.mlp.down_proj.weight",
            "model.layers.0.input_layernorm.weight",
            "model.layers.1.post_attention_layernorm.weight",
            "model.norm.weight",
            "lm_head.weight",
        ];
        let extra: &[&str] = match arch {
            Arch::Llama => &[
                "model.layers.0.self_attn.q_proj.bias",
                "model.layers.1.self_attn.o_proj.bias",
            ],
            _ => &[
                "model.layers.0.self_attn.q_norm.weight",
                "model.layers.1.self_attn.k_norm.weight",
            ],
        };
        for name in kinds.iter().chain(extra) {
            let (_, v) = tm
                .vars
                .iter()
                .find(|(n, _)| n == name)
                .unwrap_or_else(|| panic!("{name}"));
            check_fd(
                &tm.model,
                v,
                grads.get(v.as_tensor()).unwrap(),
                &rows,
                t,
                name,
            );
        }
    }
    // LoRA factors.
    let base = model(Arch::Qwen2, DType::F64, false);
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        lora_dropout: 0.0,
        target_modules: TargetModules::Names(vec!["q_proj".into(), "down_proj".into()]),
        ..LoraConfig::default()
    };
    let tm = TrainableModel::lora(&base, &cfg, 5).unwrap();
    nonzero_b(&tm);
    let grads = loss(&tm.model, &rows, t).backward().unwrap();
    for (name, v) in tm.vars.iter().take(4) {
        check_fd(
            &tm.model,
            v,
            grads.get(v.as_tensor()).unwrap(),
            &rows,
            t,
            name,
        );
    }
}

fn check_fd(m: &Transformer, v: &Var, g: &Tensor, rows: &[Vec<u32>], t: usize, name: &str) {
    let g: Vec<f64> = g.flatten_all().unwrap().to_vec1().unwrap();
    let orig: Vec<f64> = v.flatten_all().unwrap().to_vec1().unwrap();
    // The three largest-gradient elements and one arbitrary one.
    let mut idx: Vec<usize> = (0..g.len()).collect();
    idx.sort_by(|&a, &b| g[b].abs().total_cmp(&g[a].abs()));
    let mut picks = idx[..3.min(idx.len())].to_vec();
    picks.push(g.len() / 2);
    let h = 1e-5;
    for &i in &picks {
        let mut p = orig.clone();
        p[i] += h;
        v.set(&Tensor::from_vec(p.clone(), v.shape(), &Device::Cpu).unwrap())
            .unwrap();
        let up = loss(m, rows, t).to_scalar::<f64>().unwrap();
        p[i] -= 2.0 * h;
        v.set(&Tensor::from_vec(p, v.shape(), &Device::Cpu).unwrap())
            .unwrap();
        let down = loss(m, rows, t).to_scalar::<f64>().unwrap();
        v.set(&Tensor::from_vec(orig.clone(), v.shape(), &Device::Cpu).unwrap())
            .unwrap();
        let fd = (up - down) / (2.0 * h);
        let rel = (fd - g[i]).abs() / (fd.abs().max(g[i].abs()).max(1e-6));
        assert!(
            rel < 1e-4 || (fd - g[i]).abs() < 1e-9,
            "{name}[{i}]: autograd {} vs finite difference {fd} (rel {rel:e})",
            g[i]
        );
    }
}

/// Each row's last `t` log-probs in a left-padded batch against the row alone, within `tol`.
fn assert_batch_equals_rows_alone(m: &Transformer, tol: f32, what: &str) {
    let (rows, t) = batch();
    let (ids, mask) = padded(&rows);
    let (lp, _) = m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap();
    let lp: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    for (r, row) in rows.iter().enumerate() {
        let (ids, mask) = padded(std::slice::from_ref(row));
        let (alone, _) = m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap();
        let alone: Vec<f32> = alone.flatten_all().unwrap().to_vec1().unwrap();
        for j in 0..t {
            assert!(
                (lp[r][j] - alone[j]).abs() < tol,
                "{what}, row {r} pos {j}: {} in the batch, {} alone",
                lp[r][j],
                alone[j]
            );
        }
    }
}

#[test]
fn left_padded_batch_equals_rows_alone() {
    for arch in ARCHES {
        let m = model(arch, DType::F32, false);
        assert_batch_equals_rows_alone(&m, 1e-5, &format!("{arch:?}"));
    }
}

#[test]
fn half_precision_left_padded_batch_equals_rows_alone() {
    // The masks' −1e9 is −inf in f16: a padded position, whose every key is masked, turned NaN
    // and spread to its row's real positions through its keys and values (frozen passes and
    // passes with a graph alike).
    for (dtype, tol) in [(DType::F16, 1e-2), (DType::BF16, 5e-2)] {
        let frozen = model(Arch::Qwen2, dtype, false);
        let trainable = TrainableModel::full(&frozen).unwrap();
        for (what, m) in [("frozen", &frozen), ("with a graph", &trainable.model)] {
            assert_batch_equals_rows_alone(m, tol, &format!("{dtype:?} {what}"));
        }
    }
}

/// Logits `(B, V)` of positions 1.. of a left-padded batch from passes over a KV cache: the
/// first 2 positions prefilled, then one token at a time.
fn cached_logits(m: &Transformer, ids: &Tensor, mask: &Tensor) -> Vec<Tensor> {
    let (b, l) = ids.dims2().unwrap();
    let mask_v: Vec<Vec<u32>> = mask.to_vec2().unwrap();
    let (pos, bias) =
        padded_positions_and_bias(&mask.narrow(1, 0, 2).unwrap(), &Device::Cpu).unwrap();
    let mut cache = KvCache::default();
    let h = m
        .forward_hidden(&ids.narrow(1, 0, 2).unwrap(), &pos, &bias, Some(&mut cache))
        .unwrap();
    let mut step_logits = vec![
        m.logits(&h.narrow(1, 1, 1).unwrap().squeeze(1).unwrap())
            .unwrap(),
    ];
    let pos_all: Vec<Vec<u32>> = padded_positions_and_bias(mask, &Device::Cpu)
        .unwrap()
        .0
        .to_vec2()
        .unwrap();
    for j in 2..l {
        let p: Vec<u32> = (0..b).map(|r| pos_all[r][j]).collect();
        let bias: Vec<f32> = (0..b)
            .flat_map(|r| {
                (0..=j)
                    .map(|k| if mask_v[r][k] == 1 { 0.0 } else { -1e9 })
                    .collect::<Vec<_>>()
            })
            .collect();
        let h = m
            .forward_hidden(
                &ids.narrow(1, j, 1).unwrap(),
                &Tensor::from_vec(p, (b, 1), &Device::Cpu).unwrap(),
                &Tensor::from_vec(bias, (b, 1, 1, j + 1), &Device::Cpu).unwrap(),
                Some(&mut cache),
            )
            .unwrap();
        step_logits.push(m.logits(&h.squeeze(1).unwrap()).unwrap());
    }
    assert_eq!(cache.len(), l);
    step_logits
}

/// Largest |a − b| over two lists of tensors.
fn max_diff(a: &[Tensor], b: &[Tensor]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| {
            (x - y)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0f32, f32::max)
}

/// Whether two tensors are views of one storage.
fn same_storage(a: &Tensor, b: &Tensor) -> bool {
    let (sa, _) = a.storage_and_layout();
    let (sb, _) = b.storage_and_layout();
    std::ptr::eq(&*sa, &*sb)
}

#[test]
fn packed_projections_are_views_and_decode_as_the_separate_maps() {
    let (rows, _) = batch();
    let (ids, mask) = padded(&rows);
    // Qwen3 takes the pack's columns apart for its q/k norms; the others attend from the pack.
    for arch in ARCHES {
        let base = model(arch, DType::F32, false);
        // Built packed: q, k, v (and gate, up) are consecutive row blocks of one tensor.
        for l in &base.layers {
            let (q, k, v) = (&l.q_proj.weight, &l.k_proj.weight, &l.v_proj.weight);
            // An MoE layer has no dense gate/up to pack, Arcee's MLP no gate; DeepSeek's latent
            // attention's maps take different inputs (never packed).
            // Gemma 4's layers without values (or keys) of their own neither; Qwen3.5's linear
            // layers have no q, k, v, its gated q holds the gate rows too.
            let gate_up = l.moe.is_none() && arch.gated_mlp();
            let apart = l.mla.is_some()
                || l.v_from_k
                || l.kv_source.is_some()
                || l.delta.is_some()
                || l.attn_gate;
            assert!(
                (l.qkv.is_some() || apart) && (l.gate_up.is_some() || !gate_up),
                "{arch:?}: not packed"
            );
            assert!(!gate_up || same_storage(&l.gate_proj.weight, &l.up_proj.weight));
            if apart {
                continue;
            }
            assert!(same_storage(q, k) && same_storage(k, v));
            assert_eq!(k.layout().start_offset(), q.elem_count());
            assert!(!gate_up || same_storage(&l.gate_proj.weight, &l.up_proj.weight));
            if let (Some(bq), Some(bv)) = (&l.q_proj.bias, &l.v_proj.bias) {
                assert!(same_storage(bq, bv), "{arch:?}: biases not packed");
            }
        }
        // The same weights, each in a tensor of its own and unpacked: the separate path.
        let mut sep = base.clone();
        for l in sep.layers.iter_mut() {
            l.qkv = None;
            l.gate_up = None;
            for lin in l.linears_mut() {
                lin.weight = lin.weight.force_contiguous().unwrap();
                lin.bias = lin.bias.as_ref().map(|b| b.force_contiguous().unwrap());
            }
        }
        let packed = cached_logits(&base, &ids, &mask);
        let separate = cached_logits(&sep, &ids, &mask);
        let d = max_diff(&packed, &separate);
        assert!(d < 1e-5, "{arch:?}: packed vs separate {d}");
        // A CPU decoding copy: transposes of the packs, none of the packed parts.
        let dec = base.for_decoding().unwrap();
        let d = max_diff(&cached_logits(&dec, &ids, &mask), &separate);
        assert!(d < 1e-5, "{arch:?}: decoding copy vs separate {d}");
        // (Qwen3.5's and LFM2's first layers are recurrent: no q, k, v.)
        if arch.mla() || base.cfg.recurrent_layer(0) {
            continue;
        }
        let l0 = &dec.layers[0];
        assert!(l0.qkv.as_ref().unwrap().linear.weight_t.is_some());
        assert!(
            l0.moe.is_some()
                || !arch.gated_mlp()
                || l0.gate_up.as_ref().unwrap().linear.weight_t.is_some()
        );
        assert!(l0.q_proj.weight_t.is_none() && l0.o_proj.weight_t.is_some());
        // A deep copy stays packed, in storage of its own.
        // (Gemma 4's layer 1 has no values of its own: its layer 0.)
        let j = if arch == Arch::Gemma4 { 0 } else { 1 };
        let snap = base.snapshot().unwrap();
        let (a, b) = (&snap.layers[j].q_proj.weight, &snap.layers[j].v_proj.weight);
        assert!(snap.layers[j].qkv.is_some() && same_storage(a, b));
        assert!(!same_storage(a, &base.layers[j].q_proj.weight));
        // A replaced part makes its pack stale: not used, and packed again on request.
        let mut stale = base.clone();
        let w = &stale.layers[0].k_proj.weight;
        stale.layers[0].k_proj.weight = (w * 1.0).unwrap();
        let d = max_diff(&cached_logits(&stale, &ids, &mask), &separate);
        assert!(d < 1e-5, "{arch:?}: stale pack {d}");
        stale.pack_projections().unwrap();
        let l0 = &stale.layers[0];
        assert!(same_storage(&l0.q_proj.weight, &l0.k_proj.weight));
        assert!(!same_storage(
            &l0.q_proj.weight,
            &base.layers[0].q_proj.weight
        ));
        // Parts that cannot share a storage stay apart (no error).
        let mut mixed = base.clone();
        let v = &mixed.layers[0].v_proj.weight;
        mixed.layers[0].v_proj.weight = v.to_dtype(DType::F64).unwrap();
        mixed.pack_projections().unwrap();
        let packed_one = mixed.layers[1].qkv.is_some() || mixed.layers[1].v_from_k;
        assert!(mixed.layers[0].qkv.is_none() && packed_one);
        // LoRA adapters on packed parts: a pass over a cache equals the full forward.
        let tm = adapted(&base);
        assert!(
            tm.model.layers[0].qkv.is_some(),
            "the LoRA base is not packed"
        );
        let adapted = tm
            .model
            .snapshot_trainable()
            .unwrap()
            .for_decoding()
            .unwrap();
        let (b, l) = ids.dims2().unwrap();
        let full = tm.model.detached().forward_padded(&ids, &mask).unwrap();
        let full = tm
            .model
            .logits(&full.reshape((b * l, base.cfg.hidden_size)).unwrap())
            .unwrap()
            .reshape((b, l, VOCAB))
            .unwrap();
        let want: Vec<Tensor> = (1..l)
            .map(|j| full.narrow(1, j, 1).unwrap().squeeze(1).unwrap())
            .collect();
        // Only the last position is real in every row.
        let got = cached_logits(&adapted, &ids, &mask);
        let d = max_diff(&got[l - 2..], &want[l - 2..]);
        assert!(
            d < 1e-4,
            "{arch:?}: LoRA pass over a cache vs full forward {d}"
        );
        // Full fine-tuning: the trainable model is not packed (its weights are Vars); its
        // published snapshots are.
        let full_ft = TrainableModel::full(&base).unwrap();
        let l0 = &full_ft.model.layers[0];
        assert!(l0.qkv.is_none());
        // Each Var holds its own elements, not a copy of its pack.
        assert!(!same_storage(&l0.q_proj.weight, &l0.k_proj.weight));
        assert_eq!(l0.k_proj.weight.layout().start_offset(), 0);
        let snap = full_ft.model.snapshot_trainable().unwrap();
        assert!(snap.layers[0].qkv.is_some());
        let d = max_diff(&cached_logits(&snap, &ids, &mask), &separate);
        assert!(d < 1e-5, "{arch:?}: published full fine-tune {d}");
        // Published onto the generator's device (here the model's own): the same snapshot, and
        // a later write to the variables does not reach it.
        let mut copies = grpo_rollout::model::DeviceCopies::default();
        let onto = full_ft
            .model
            .snapshot_onto(&Device::Cpu, &mut copies)
            .unwrap();
        assert!(onto.layers[0].qkv.is_some() && copies.is_empty());
        for (_, v) in &full_ft.vars {
            v.set(&v.as_tensor().zeros_like().unwrap()).unwrap();
        }
        let d = max_diff(&cached_logits(&onto, &ids, &mask), &separate);
        assert!(d < 1e-5, "{arch:?}: published onto its device {d}");
    }
}

#[test]
fn incremental_decoding_matches_the_full_forward() {
    for arch in ARCHES {
        let m = model(arch, DType::F32, false).detached();
        let (rows, _) = batch();
        let (ids, mask) = padded(&rows);
        let full = m.forward_padded(&ids, &mask).unwrap();
        let (b, l) = ids.dims2().unwrap();
        let full_logits = m
            .logits(&full.reshape((b * l, m.cfg.hidden_size)).unwrap())
            .unwrap()
            .reshape((b, l, VOCAB))
            .unwrap();
        let mask_v: Vec<Vec<u32>> = mask.to_vec2().unwrap();
        let step_logits = cached_logits(&m, &ids, &mask);
        for (k, sl) in step_logits.iter().enumerate() {
            let j = k + 1;
            let want = full_logits.narrow(1, j, 1).unwrap().squeeze(1).unwrap();
            let diff = max_diff(std::slice::from_ref(sl), &[want]);
            // Rows that are still padding at j produce unused values; compare real positions.
            assert!(
                diff < 1e-4 || (0..b).any(|r| mask_v[r][j] == 0),
                "{arch:?} position {j}: {diff}"
            );
            for r in 0..b {
                if mask_v[r][j] == 1 {
                    let a: Vec<f32> = sl.get(r).unwrap().to_vec1().unwrap();
                    let w: Vec<f32> = full_logits
                        .get(r)
                        .unwrap()
                        .get(j)
                        .unwrap()
                        .to_vec1()
                        .unwrap();
                    let d = a
                        .iter()
                        .zip(&w)
                        .map(|(x, y)| (x - y).abs())
                        .fold(0f32, f32::max);
                    assert!(d < 1e-4, "{arch:?} row {r} position {j}: {d}");
                }
            }
        }
    }
}

fn logprobs_of(m: &Transformer) -> Vec<f32> {
    let (rows, t) = batch();
    let (ids, mask) = padded(&rows);
    m.completion_logprobs(&ids, &mask, t, 1.0, false)
        .unwrap()
        .0
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

#[test]
fn peft_round_trip_and_merge() {
    let dir = std::env::temp_dir().join(format!("grpo-peft-{}", std::process::id()));
    let base = model(Arch::Llama, DType::F32, false);
    let cfg = LoraConfig {
        r: 4,
        lora_alpha: 16.0,
        lora_dropout: 0.1,
        target_modules: TargetModules::Names(vec![
            "q_proj".into(),
            "v_proj".into(),
            "up_proj".into(),
        ]),
        ..LoraConfig::default()
    };
    let tm = TrainableModel::lora(&base, &cfg, 2).unwrap();
    nonzero_b(&tm);
    let adapted = tm.model.detached();
    let want = logprobs_of(&adapted);
    assert!(
        want.iter()
            .zip(logprobs_of(&base))
            .any(|(a, b)| (a - b).abs() > 1e-4),
        "the adapter changes the model"
    );
    lora::save_peft(&adapted, &cfg, &dir, "tiny").unwrap();
    // PEFT's files and key names.
    let keys = candle_core::safetensors::load(dir.join("adapter_model.safetensors"), &Device::Cpu)
        .unwrap();
    assert!(keys.contains_key("base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"));
    assert!(keys.contains_key("base_model.model.model.layers.1.mlp.up_proj.lora_B.weight"));
    let conf: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(conf["peft_type"], "LORA");
    assert_eq!(conf["r"], 4);
    let mut reloaded = base.clone();
    let back = lora::load_peft(&mut reloaded, &dir).unwrap();
    assert_eq!(back, cfg);
    assert_eq!(
        logprobs_of(&reloaded),
        want,
        "identical log-probs after the round trip"
    );
    let merged = lora::merge(&reloaded).unwrap();
    for (a, b) in logprobs_of(&merged).iter().zip(&want) {
        assert!((a - b).abs() < 1e-5, "merged {a} vs adapted {b}");
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn lora_dropout_is_training_only_and_seeded() {
    let base = model(Arch::Qwen2, DType::F32, false);
    let cfg = LoraConfig {
        r: 4,
        lora_alpha: 8.0,
        lora_dropout: 0.5,
        target_modules: TargetModules::Names(vec!["q_proj".into()]),
        ..LoraConfig::default()
    };
    let tm = TrainableModel::lora(&base, &cfg, 2).unwrap();
    nonzero_b(&tm);
    let (rows, t) = batch();
    let a = loss(&tm.model, &rows, t).to_scalar::<f32>().unwrap();
    let b = loss(&tm.model, &rows, t).to_scalar::<f32>().unwrap();
    assert_ne!(a, b, "dropout draws a new mask each training forward");
    let d = tm.model.detached();
    assert_eq!(
        loss(&d, &rows, t).to_scalar::<f32>().unwrap(),
        loss(&d, &rows, t).to_scalar::<f32>().unwrap()
    );
}

#[test]
fn hf_directory_round_trip() {
    let dir = std::env::temp_dir().join(format!("grpo-hf-{}", std::process::id()));
    let tok = grpo_rollout::init::train_tokenizer(300).unwrap();
    let mut c = cfg(Arch::Qwen3);
    c.vocab_size = tok.vocab_size();
    c.tie_word_embeddings = false;
    let m = random_weights(&c, 9, DType::F32, &Device::Cpu).unwrap();
    grpo_rollout::save_hf_dir(&m, &tok, &dir, DType::F32).unwrap();
    let back = grpo_rollout::load(&dir, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg.arch, Arch::Qwen3);
    let rows = vec![vec![5u32, 9, 2, 33, 7], vec![8, 3, 20]];
    let (ids, mask) = padded(&rows);
    let a = m
        .completion_logprobs(&ids, &mask, 2, 1.0, false)
        .unwrap()
        .0
        .to_vec2::<f32>()
        .unwrap();
    let b = back
        .model
        .completion_logprobs(&ids, &mask, 2, 1.0, false)
        .unwrap()
        .0
        .to_vec2::<f32>()
        .unwrap();
    assert_eq!(a, b);
    assert_eq!(back.tokenizer.eos_token_ids, tok.eos_token_ids);
    assert!(back.tokenizer.chat_template.is_some());
    // bf16 on disk loads into f32 within bf16 precision.
    let dir16 = dir.join("bf16");
    grpo_rollout::save_hf_dir(&m, &tok, &dir16, DType::BF16).unwrap();
    let b16 = grpo_rollout::load(&dir16, DType::F32, &Device::Cpu).unwrap();
    let c16 = b16
        .model
        .completion_logprobs(&ids, &mask, 2, 1.0, false)
        .unwrap()
        .0
        .to_vec2::<f32>()
        .unwrap();
    for (x, y) in a.iter().flatten().zip(c16.iter().flatten()) {
        assert!((x - y).abs() < 5e-2);
    }
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn bad_inputs_name_the_problem() {
    let c = cfg(Arch::Qwen2);
    let mut w: HashMap<String, Tensor> = random_weights(&c, 1, DType::F32, &Device::Cpu)
        .unwrap()
        .weights()
        .into_iter()
        .collect();
    w.remove("model.layers.1.mlp.up_proj.weight");
    let e = Transformer::from_weights(&c, &w, DType::F32, &Device::Cpu)
        .unwrap_err()
        .to_string();
    assert!(e.contains("model.layers.1.mlp.up_proj.weight"), "{e}");
    let e = grpo_rollout::load(
        std::path::Path::new("/nonexistent/model"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("/nonexistent/model"), "{e}");
    let m = model(Arch::Qwen2, DType::F32, false);
    let (ids, mask) = padded(&batch().0);
    assert!(m.completion_logprobs(&ids, &mask, 0, 1.0, false).is_err());
}

/// What the learner publishes is immune to the optimizer's in-place updates that follow, for a
/// full fine-tune and for LoRA (whose frozen base is shared, not copied).
#[test]
fn published_snapshots_never_see_later_updates() {
    let base = model(Arch::Qwen2, DType::F32, false);
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        lora_dropout: 0.0,
        target_modules: TargetModules::Names(vec!["q_proj".into(), "v_proj".into()]),
        ..LoraConfig::default()
    };
    let (rows, t) = batch();
    for tm in [
        TrainableModel::full(&base).unwrap(),
        TrainableModel::lora(&base, &cfg, 1).unwrap(),
    ] {
        nonzero_b(&tm);
        let snap = tm.model.snapshot_trainable().unwrap();
        let before = loss(&snap, &rows, t).to_scalar::<f32>().unwrap();
        assert_eq!(
            before,
            loss(&tm.model, &rows, t).to_scalar::<f32>().unwrap()
        );
        // The optimizer writes every trainable weight in place.
        for (_, v) in &tm.vars {
            v.set(&(v.as_tensor() * 1.5).unwrap()).unwrap();
        }
        let moved = loss(&tm.model, &rows, t).to_scalar::<f32>().unwrap();
        assert_ne!(moved, before, "the update changed the live model");
        assert_eq!(loss(&snap, &rows, t).to_scalar::<f32>().unwrap(), before);
    }
}

/// Rows sharing prompts: each distinct prompt runs once and its keys and values serve its rows.
/// Log-probs, entropies and every gradient equal the rows run alone (prompt + completion), for
/// each architecture, a full fine-tune and LoRA, prompts and completions of different lengths.
#[test]
fn shared_prompts_equal_rows_run_alone_with_gradients() {
    let dev = Device::Cpu;
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 2, 33], vec![8, 3, 20, 11, 44, 1, 7], vec![17, 6]];
    let prompt_of: Vec<u32> = vec![0, 0, 1, 2, 1, 0];
    let comps: Vec<Vec<u32>> = vec![
        vec![12, 40, 3],
        vec![9, 9, 27, 5, 60],
        vec![31],
        vec![4, 22, 8, 19],
        vec![2, 14, 56, 38, 6],
        vec![50, 1],
    ];
    let temp = 0.7;
    let w = |r: usize, j: usize| ((r * 13 + j * 7) % 9) as f64 / 4.0 - 1.0;
    for arch in ARCHES {
        for use_lora in [false, true] {
            let base = model(arch, DType::F64, arch == Arch::Qwen3);
            let tm = if use_lora {
                adapted(&base)
            } else {
                TrainableModel::full(&base).unwrap()
            };
            let m = &tm.model;
            // Rows alone.
            let mut alone_lp = Vec::new();
            let mut alone_ent = Vec::new();
            let mut alone_loss = Tensor::zeros((), DType::F64, &dev).unwrap();
            for (r, c) in comps.iter().enumerate() {
                let mut ids = prompts[prompt_of[r] as usize].clone();
                ids.extend(c);
                let n = ids.len();
                let ids = Tensor::from_vec(ids, (1, n), &dev).unwrap();
                let mask = Tensor::ones((1, n), DType::U32, &dev).unwrap();
                let (lp, ent) = m
                    .completion_logprobs(&ids, &mask, c.len(), temp, true)
                    .unwrap();
                let ent = ent.unwrap();
                let wr: Vec<f64> = (0..c.len()).map(|j| w(r, j)).collect();
                let wr = Tensor::from_vec(wr, (1, c.len()), &dev).unwrap();
                let l = ((&lp * &wr).unwrap().sum_all().unwrap()
                    + (&ent * 0.1).unwrap().sum_all().unwrap())
                .unwrap();
                alone_loss = (alone_loss + l).unwrap();
                alone_lp.push(lp.flatten_all().unwrap().to_vec1::<f64>().unwrap());
                alone_ent.push(ent.flatten_all().unwrap().to_vec1::<f64>().unwrap());
            }
            // Shared.
            let (pids, pmask) = padded(&prompts);
            let cmax = comps.iter().map(Vec::len).max().unwrap();
            let mut cids = Vec::new();
            let mut cm = Vec::new();
            let mut wv = Vec::new();
            for (r, c) in comps.iter().enumerate() {
                for j in 0..cmax {
                    cids.push(c.get(j).copied().unwrap_or(0));
                    cm.push(u32::from(j < c.len()));
                    wv.push(if j < c.len() { w(r, j) } else { 0.0 });
                }
            }
            let b = comps.len();
            let cids = Tensor::from_vec(cids, (b, cmax), &dev).unwrap();
            let cm = Tensor::from_vec(cm, (b, cmax), &dev).unwrap();
            let (lp, ent) = m
                .shared_prompt_logprobs(&pids, &pmask, &prompt_of, &cids, &cm, temp, true)
                .unwrap();
            let ent = ent.unwrap();
            let lpv: Vec<Vec<f64>> = lp.to_vec2().unwrap();
            let entv: Vec<Vec<f64>> = ent.to_vec2().unwrap();
            for r in 0..b {
                let n = comps[r].len();
                for j in 0..n {
                    let (a, s) = (alone_lp[r][j], lpv[r][j]);
                    assert!(
                        (a - s).abs() < 1e-10,
                        "{arch:?} lora={use_lora} row {r} token {j}: alone {a}, shared {s}"
                    );
                    let (a, s) = (alone_ent[r][j], entv[r][j]);
                    assert!(
                        (a - s).abs() < 1e-10,
                        "{arch:?} entropy row {r} token {j}: {a} vs {s}"
                    );
                }
                assert!(lpv[r].iter().chain(&entv[r]).all(|x| x.is_finite()));
            }
            let wt = Tensor::from_vec(wv.clone(), (b, cmax), &dev).unwrap();
            let entw: Vec<f64> = wv
                .iter()
                .zip(cm.flatten_all().unwrap().to_vec1::<u32>().unwrap())
                .map(|(_, k)| 0.1 * f64::from(k))
                .collect();
            let entw = Tensor::from_vec(entw, (b, cmax), &dev).unwrap();
            let shared_loss = ((&lp * &wt).unwrap().sum_all().unwrap()
                + (&ent * &entw).unwrap().sum_all().unwrap())
            .unwrap();
            let la = alone_loss.to_scalar::<f64>().unwrap();
            let ls = shared_loss.to_scalar::<f64>().unwrap();
            assert!(
                (la - ls).abs() < 1e-9 * la.abs().max(1.0),
                "{arch:?}: loss {la} vs {ls}"
            );
            let ga = alone_loss.backward().unwrap();
            let gs = shared_loss.backward().unwrap();
            for (name, v) in &tm.vars {
                let a: Vec<f64> = ga
                    .get(v.as_tensor())
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let s: Vec<f64> = gs
                    .get(v.as_tensor())
                    .unwrap_or_else(|| panic!("{arch:?} lora={use_lora}: no gradient reached `{name}` through the shared path"))
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                let scale = a.iter().fold(0f64, |m, x| m.max(x.abs()));
                assert!(scale > 0.0, "{name}: zero gradient");
                let err = a
                    .iter()
                    .zip(&s)
                    .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    err < 1e-9 * scale,
                    "{arch:?} lora={use_lora} `{name}`: gradient differs by {err} (scale {scale})"
                );
            }
        }
    }
    // Bad input names the problem.
    let m = model(Arch::Qwen2, DType::F32, false);
    let (pids, pmask) = padded(&prompts);
    let cids = Tensor::zeros((2, 3), DType::U32, &dev).unwrap();
    let cm = Tensor::ones((2, 3), DType::U32, &dev).unwrap();
    let e = m
        .shared_prompt_logprobs(&pids, &pmask, &[0, 3], &cids, &cm, 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("prompt index 3 out of range"), "{e}");
    let e = m
        .shared_prompt_logprobs(&pids, &pmask, &[0], &cids, &cm, 1.0, false)
        .unwrap_err()
        .to_string();
    assert!(e.contains("1 prompt indices"), "{e}");
}

/// Rows that hold several sequences end to end (packed SFT rows) give each sequence what it
/// gets alone, log-probs and gradients: positions restart and attention stays inside it.
#[test]
fn packed_rows_equal_their_sequences_alone_with_gradients() {
    use grpo_rollout::model::packed_positions_and_bias;
    let dev = Device::Cpu;
    let seqs: Vec<Vec<u32>> = vec![
        vec![5, 9, 2, 33, 7],
        vec![8, 3],
        vec![17, 6, 50, 4],
        vec![12, 40, 3, 9, 9, 27],
        vec![31, 2, 14],
    ];
    // Two packed rows of 10 (the second right-padded): [0, 1, 4] and [3, 2].
    let rows: Vec<Vec<usize>> = vec![vec![0, 1, 4], vec![3, 2]];
    let l = 10;
    let w = |s: usize, j: usize| ((s * 13 + j * 7) % 9) as f64 / 4.0 - 1.0;
    for (dtype, tol) in [(DType::F64, 1e-10), (DType::F32, 2e-5)] {
        for arch in [Arch::Llama, Arch::Qwen3] {
            let base = model(arch, dtype, arch == Arch::Qwen3);
            let tm = TrainableModel::full(&base).unwrap();
            let m = &tm.model;
            let mut alone = Tensor::zeros((), dtype, &dev).unwrap();
            let mut alone_lp = Vec::new();
            for (s, ids) in seqs.iter().enumerate() {
                let n = ids.len();
                let t = Tensor::from_vec(ids.clone(), (1, n), &dev).unwrap();
                let mask = Tensor::ones((1, n), DType::U32, &dev).unwrap();
                let (lp, _) = m.completion_logprobs(&t, &mask, n - 1, 1.0, false).unwrap();
                let wv: Vec<f64> = (1..n).map(|j| w(s, j)).collect();
                let wt = Tensor::from_vec(wv, (1, n - 1), &dev)
                    .unwrap()
                    .to_dtype(dtype)
                    .unwrap();
                alone = (alone + (&lp * &wt).unwrap().sum_all().unwrap()).unwrap();
                alone_lp.push(
                    lp.to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1::<f64>()
                        .unwrap(),
                );
            }
            let (mut ids, mut wv, mut lens) = (Vec::new(), Vec::new(), Vec::new());
            for r in &rows {
                let mut row: Vec<u32> = r.iter().flat_map(|&s| seqs[s].clone()).collect();
                let mut rw = Vec::new();
                for &s in r {
                    // Token j of a sequence is predicted from j - 1; its first token is not.
                    rw.push(0.0);
                    rw.extend((1..seqs[s].len()).map(|j| w(s, j)));
                }
                lens.push(r.iter().map(|&s| seqs[s].len()).collect::<Vec<_>>());
                row.resize(l, 0);
                rw.resize(l, 0.0);
                ids.extend(row);
                wv.extend(rw[1..].iter().copied());
            }
            let ids = Tensor::from_vec(ids, (rows.len(), l), &dev).unwrap();
            let (pos, bias) = packed_positions_and_bias(&lens, l, &dev).unwrap();
            let (lp, _) = m
                .logprobs_with(&ids, &pos, &bias, l - 1, 1.0, false)
                .unwrap();
            let lpv: Vec<Vec<f64>> = lp.to_dtype(DType::F64).unwrap().to_vec2().unwrap();
            for (r, row) in rows.iter().enumerate() {
                let mut at = 0;
                for &s in row {
                    for j in 1..seqs[s].len() {
                        let (a, p) = (alone_lp[s][j - 1], lpv[r][at + j - 1]);
                        assert!(
                            (a - p).abs() < tol,
                            "{arch:?} {dtype:?} seq {s} token {j}: alone {a}, packed {p}"
                        );
                    }
                    at += seqs[s].len();
                }
            }
            let wt = Tensor::from_vec(wv, (rows.len(), l - 1), &dev)
                .unwrap()
                .to_dtype(dtype)
                .unwrap();
            let packed = (&lp * &wt).unwrap().sum_all().unwrap();
            let ga = alone.backward().unwrap();
            let gp = packed.backward().unwrap();
            for (name, v) in &tm.vars {
                let f = |g: &candle_core::backprop::GradStore| -> Vec<f64> {
                    g.get(v.as_tensor())
                        .unwrap()
                        .to_dtype(DType::F64)
                        .unwrap()
                        .flatten_all()
                        .unwrap()
                        .to_vec1()
                        .unwrap()
                };
                let (a, p) = (f(&ga), f(&gp));
                let scale = a.iter().fold(0f64, |m, x| m.max(x.abs()));
                let err = a
                    .iter()
                    .zip(&p)
                    .fold(0f64, |m, (x, y)| m.max((x - y).abs()));
                assert!(
                    scale > 0.0 && err < 50.0 * tol * scale.max(1.0),
                    "{arch:?} {dtype:?} `{name}`: gradient differs by {err} (scale {scale})"
                );
            }
        }
    }
    // A row's sequences must fit it.
    let e = packed_positions_and_bias(&[vec![4, 7]], 10, &dev)
        .unwrap_err()
        .to_string();
    assert!(e.contains("packed row 0") && e.contains("row of 10"), "{e}");
}

/// WPO's ingredients from one forward: the log-probs are `completion_logprobs`'s, and
/// `log Σ_v p_v²` is that of the full softmax of each position's logits.
#[test]
fn log_sum_sq_probs_equal_the_full_softmax() {
    let (rows, t) = batch();
    for dtype in [DType::F64, DType::F32, DType::BF16] {
        let m = model(Arch::Qwen2, dtype, true);
        let (ids, mask) = padded(&rows);
        let (lp, _) = m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap();
        let (stats, lss) = m.completion_stats_and_sum_sq(&ids, &mask, t).unwrap();
        let lp2 = stats.logps;
        let f =
            |x: &Tensor| -> Vec<Vec<f64>> { x.to_dtype(DType::F64).unwrap().to_vec2().unwrap() };
        assert_eq!(f(&lp), f(&lp2), "{dtype:?}");
        // The full logits of the positions that predict the last t tokens, softmaxed in f64.
        let want_rows = full_log_sum_sq(&m, &ids, &mask, t, 1.0);
        let got = f(&lss);
        let tol = if dtype == DType::F64 { 1e-12 } else { 1e-4 };
        for (i, &want) in want_rows.iter().enumerate() {
            let g = got[i / t][i % t];
            assert!(
                (g - want).abs() < tol * want.abs().max(1.0),
                "{dtype:?} row {i}: {g} vs {want}"
            );
            // log Σp² ≤ log max p ≤ 0.
            assert!(g <= 1e-6);
        }
    }
}

/// `log Σ_v p_v²` at `temperature` of each position predicting the last `t` tokens, from the
/// full logits softmaxed in f64, row by row.
fn full_log_sum_sq(
    m: &grpo_rollout::Transformer,
    ids: &Tensor,
    mask: &Tensor,
    t: usize,
    temperature: f64,
) -> Vec<f64> {
    let hidden = m.forward_padded(ids, mask).unwrap();
    let (b, l, h) = hidden.dims3().unwrap();
    let rows_h = hidden
        .narrow(1, l - t - 1, t)
        .unwrap()
        .reshape((b * t, h))
        .unwrap();
    let logits: Vec<Vec<f64>> = m
        .logits(&rows_h)
        .unwrap()
        .to_dtype(DType::F64)
        .unwrap()
        .to_vec2()
        .unwrap();
    logits
        .iter()
        .map(|z| {
            let z: Vec<f64> = z.iter().map(|v| v / temperature).collect();
            let mx = z.iter().cloned().fold(f64::MIN, f64::max);
            let s1: f64 = z.iter().map(|v| (v - mx).exp()).sum();
            let s2: f64 = z.iter().map(|v| (2.0 * (v - mx)).exp()).sum();
            s2.ln() - 2.0 * s1.ln()
        })
        .collect()
}

/// The optimal token baseline's inputs at a sampling temperature: the log-probs are
/// `completion_logprobs`'s at that temperature, and `log Σ_v p_v²` that of the softmax of the
/// logits divided by it.
#[test]
fn log_probs_and_sum_sq_at_a_temperature() {
    let (rows, t) = batch();
    let m = model(Arch::Qwen2, DType::F64, true);
    let (ids, mask) = padded(&rows);
    let f = |x: &Tensor| -> Vec<Vec<f64>> { x.to_dtype(DType::F64).unwrap().to_vec2().unwrap() };
    for temp in [1.0, 0.7] {
        let (lp, _) = m.completion_logprobs(&ids, &mask, t, temp, false).unwrap();
        let (lp2, lss) = m
            .completion_logprobs_and_sum_sq(&ids, &mask, t, temp)
            .unwrap();
        assert_eq!(f(&lp), f(&lp2), "T = {temp}");
        let got = f(&lss);
        for (i, &want) in full_log_sum_sq(&m, &ids, &mask, t, temp).iter().enumerate() {
            let g = got[i / t][i % t];
            assert!(
                (g - want).abs() < 1e-12 * want.abs().max(1.0),
                "T = {temp} row {i}: {g} vs {want}"
            );
        }
    }
}

/// TRL's `cast_lm_head_to_fp32`: a bf16 model's head kept and computed in f32 — logits are the
/// f32 product of the (bf16) hidden states and the f32 head, tied or not; a trainable copy
/// keeps the f32 head as its variable and trains it; decoding copies keep it.
#[test]
fn an_f32_head_beside_bf16_layers() {
    let (rows, t) = batch();
    let (ids, mask) = padded(&rows);
    for untied in [true, false] {
        let mut m = model(Arch::Qwen2, DType::BF16, untied);
        m.cast_head_to_f32().unwrap();
        assert_eq!((m.dtype(), m.head().dtype()), (DType::BF16, DType::F32));
        let hidden = m.forward_padded(&ids, &mask).unwrap();
        assert_eq!(
            hidden.dtype(),
            DType::BF16,
            "the embedding lookup keeps the layers' dtype"
        );
        let (b, l, h) = hidden.dims3().unwrap();
        let rows_h = hidden.reshape((b * l, h)).unwrap();
        let logits = m.logits(&rows_h).unwrap();
        assert_eq!(logits.dtype(), DType::F32);
        let want = rows_h
            .to_dtype(DType::F32)
            .unwrap()
            .matmul(&m.head().t().unwrap())
            .unwrap();
        let d: f32 = (&logits - &want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(d < 1e-5, "untied={untied}: {d}");
        // The same logits from a decoding copy (few-row products as head · hᵀ).
        let dec = m.for_decoding().unwrap();
        let few = rows_h.narrow(0, 0, 3).unwrap();
        let a: Vec<Vec<f32>> = dec.logits(&few).unwrap().to_vec2().unwrap();
        let w: Vec<Vec<f32>> = want.narrow(0, 0, 3).unwrap().to_vec2().unwrap();
        for (x, y) in a.iter().flatten().zip(w.iter().flatten()) {
            assert!((x - y).abs() < 1e-4, "decoding copy: {x} vs {y}");
        }
        // A trainable copy: the head variable is f32 and gets an f32 gradient.
        let tm = TrainableModel::full(&m).unwrap();
        assert_eq!(tm.model.head().dtype(), DType::F32);
        let (lp, _) = tm
            .model
            .completion_logprobs(&ids, &mask, t, 1.0, false)
            .unwrap();
        assert_eq!(lp.dtype(), DType::F32);
        let g = lp.sum_all().unwrap().backward().unwrap();
        let name = if untied {
            "lm_head.weight"
        } else {
            "model.embed_tokens.weight"
        };
        let (_, v) = tm.vars.iter().find(|(n, _)| n == name).unwrap();
        assert_eq!(v.dtype(), DType::F32);
        let gh = g.get(v.as_tensor()).expect("a gradient for the f32 head");
        assert_eq!(gh.dtype(), DType::F32);
        let norm: f32 = gh.sqr().unwrap().sum_all().unwrap().to_scalar().unwrap();
        assert!(norm > 0.0);
    }
}

/// Merging LoRA into a decoding copy (which keeps transposed weights for few-row products)
/// gives the adapted model's outputs: no transpose of an old weight survives the merge.
#[test]
fn merging_a_decoding_copy_gives_the_adapted_model() {
    let (rows, _) = batch();
    let (ids, mask) = padded(&rows);
    let tm = adapted(&model(Arch::Qwen2, DType::F64, false));
    let adapted = tm.model.detached();
    let want = adapted.forward_padded(&ids, &mask).unwrap();
    let merged = lora::merge(&adapted.for_decoding().unwrap()).unwrap();
    let got = merged.forward_padded(&ids, &mask).unwrap();
    let d = (&want - &got)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap();
    assert!(d < 1e-10, "merged decoding copy differs by {d}");
}

/// Gradient checkpointing and layer segments give the plain forward's log-probs and gradients
/// (f32, 1e-6 relative) for full fine-tuning and for LoRA with dropout (the recomputation
/// replays the same masks), on both the padded-batch path and the shared-prompt path; the
/// autograd graph is a few nodes per layer instead of dozens, and the segments' own graphs are
/// freed by the backward, before the loss is dropped.
#[test]
fn gradient_checkpointing_gives_the_same_gradients() {
    let dev = Device::Cpu;
    let common::SharedPromptBatch {
        pids,
        pmask,
        prompt_of,
        cid,
        cmask,
    } = common::shared_prompt_batch();
    for arch in ARCHES {
        for use_lora in [false, true] {
            for shared in [false, true] {
                let base = model(arch, DType::F32, arch == Arch::Qwen2);
                // 0: plain, 1: gradient checkpointing, 2: layer segments.
                let run = |mode: u8| {
                    let mut tm = if use_lora {
                        let lc = LoraConfig {
                            r: 4,
                            lora_alpha: 8.0,
                            // "all-linear" is the experts' and router's parameters on the
                            // families PEFT converts, which take no dropout (as in PEFT).
                            lora_dropout: match arch {
                                Arch::Qwen3Moe
                                | Arch::Olmoe
                                | Arch::Glm4Moe
                                | Arch::Mixtral
                                | Arch::DeepseekV3
                                | Arch::Glm4MoeLite
                                | Arch::DeepseekV2 => 0.0,
                                _ => 0.2,
                            },
                            // Qwen2-MoE's shared expert and its gate included.
                            target_modules: grpo_rollout::lora::TargetModules::Pattern(
                                "all-linear".into(),
                            ),
                            ..Default::default()
                        };
                        let tm = TrainableModel::lora(&base, &lc, 5).unwrap();
                        // B = 0 at init: set it the same way in both runs.
                        for (name, v) in &tm.vars {
                            if name.contains("lora_B") {
                                let n = v.elem_count();
                                let b = Tensor::arange(0u32, n as u32, &dev)
                                    .unwrap()
                                    .to_dtype(DType::F32)
                                    .unwrap()
                                    .sin()
                                    .unwrap()
                                    .affine(0.05, 0.0)
                                    .unwrap()
                                    .reshape(v.shape())
                                    .unwrap();
                                v.set(&b).unwrap();
                            }
                        }
                        tm
                    } else {
                        TrainableModel::full(&base).unwrap()
                    };
                    match mode {
                        1 => tm.model.enable_gradient_checkpointing(),
                        2 => tm.model.enable_layer_segments(),
                        _ => {}
                    }
                    let (lp, ent) = if shared {
                        tm.model
                            .shared_prompt_logprobs(
                                &pids, &pmask, &prompt_of, &cid, &cmask, 0.7, true,
                            )
                            .unwrap()
                    } else {
                        let (rows, t) = batch();
                        let (ids, mask) = padded(&rows);
                        tm.model
                            .completion_logprobs(&ids, &mask, t, 0.7, true)
                            .unwrap()
                    };
                    let ent = ent.unwrap();
                    let l = ((&lp * 0.3).unwrap().sum_all().unwrap()
                        - (ent.sqr().unwrap() * 0.1).unwrap().sum_all().unwrap())
                    .unwrap();
                    let nodes = l.sorted_nodes().len();
                    let live = grpo_core::recompute::live_segments();
                    assert_eq!(live > 0, mode == 2, "{live} segments alive before backward");
                    let grads = tm.model.backward(&l).unwrap();
                    assert_eq!(grpo_core::recompute::live_segments(), 0);
                    let g: Vec<(String, Tensor)> = tm
                        .vars
                        .iter()
                        .map(|(n, v)| {
                            let g = grads.get(v.as_tensor()).unwrap_or_else(|| {
                                panic!("{arch:?} lora={use_lora}: no gradient for {n}")
                            });
                            (n.clone(), g.clone())
                        })
                        .collect();
                    (lp, g, nodes)
                };
                let (lp0, g0, n0) = run(0);
                for mode in [1, 2] {
                    let (lp1, g1, n1) = run(mode);
                    let what = format!("{arch:?} lora={use_lora} shared={shared} mode={mode}");
                    let d = (&lp0 - &lp1).unwrap().abs().unwrap().max_all().unwrap();
                    assert!(d.to_scalar::<f32>().unwrap() < 1e-6, "{what}: log-probs");
                    for ((name, a), (_, b)) in g0.iter().zip(&g1) {
                        let scale = a
                            .abs()
                            .unwrap()
                            .max_all()
                            .unwrap()
                            .to_scalar::<f32>()
                            .unwrap();
                        let d = (a - b).unwrap().abs().unwrap().max_all().unwrap();
                        let d = d.to_scalar::<f32>().unwrap();
                        assert!(scale > 0.0, "{what}: zero gradient for {name}");
                        assert!(
                            d <= 1e-6 * scale.max(1e-3),
                            "{what}: {name} differs by {d} ({scale})"
                        );
                    }
                    assert!(n1 < n0 / 2, "{what}: {n1} graph nodes vs {n0}");
                }
            }
        }
    }
}

#[test]
fn a_lora_reference_shares_the_base_and_the_decoding_copy_reuses_its_transposes() {
    let base = model(Arch::Llama, DType::F32, false);
    let tm = adapted(&base);
    // The reference is the base with adapters off: its log-probs are the base's, its weights
    // the base's own tensors.
    let reference = tm.model.without_adapters();
    assert_eq!(logprobs_of(&reference), logprobs_of(&base));
    assert_ne!(logprobs_of(&tm.model), logprobs_of(&base));
    for ((_, a), (_, b)) in reference.weights().iter().zip(base.weights()) {
        assert_eq!(a.id(), b.id(), "the reference copied a base weight");
    }
    // Two published versions: the second decoding copy takes the first's transposes.
    let d1 = tm
        .model
        .snapshot_trainable()
        .unwrap()
        .for_decoding()
        .unwrap();
    for (_, v) in &tm.vars {
        v.set(&(v.as_tensor() * 1.5).unwrap()).unwrap();
    }
    let d2 = tm
        .model
        .snapshot_trainable()
        .unwrap()
        .for_decoding_reusing(Some(&d1))
        .unwrap();
    for (l1, l2) in d1.layers.iter().zip(&d2.layers) {
        // The packed maps' transposes, and those of o and down.
        let mut pairs = vec![
            (
                &l1.qkv.as_ref().unwrap().linear,
                &l2.qkv.as_ref().unwrap().linear,
            ),
            (
                &l1.gate_up.as_ref().unwrap().linear,
                &l2.gate_up.as_ref().unwrap().linear,
            ),
        ];
        pairs.push((&l1.o_proj, &l2.o_proj));
        pairs.push((&l1.down_proj, &l2.down_proj));
        for (a, b) in pairs {
            let (ta, tb) = (a.weight_t.as_ref().unwrap(), b.weight_t.as_ref().unwrap());
            assert_eq!(ta.id(), tb.id(), "a frozen weight was transposed again");
        }
    }
    assert_eq!(logprobs_of(&d2), logprobs_of(&tm.model));
}

/// Compacting a KV cache in place, a layer at a time, keeps what `select_rows` keeps: the next
/// step over either gives the same hidden states, rows reordered and repeated too.
#[test]
fn kv_cache_keep_rows_equals_select_rows() {
    let m = model(Arch::Qwen2, DType::F32, false).detached();
    let (rows, _) = batch();
    let (ids, mask) = padded(&rows);
    let (pos, bias) = padded_positions_and_bias(&mask, &Device::Cpu).unwrap();
    let mut cache = KvCache::default();
    m.forward_hidden(&ids, &pos, &bias, Some(&mut cache))
        .unwrap();
    let (b, l) = ids.dims2().unwrap();
    assert_eq!(b, 3);
    let keep = Tensor::new(&[2u32, 0, 2], &Device::Cpu).unwrap();
    let selected = cache.select_rows(&keep).unwrap();
    let mut kept = cache.clone();
    kept.keep_rows(&keep).unwrap();
    assert_eq!(kept.len(), selected.len());
    let step = |mut c: KvCache| {
        let next = Tensor::new(&[[7u32], [8], [9]], &Device::Cpu).unwrap();
        let p = Tensor::new(&[[l as u32], [l as u32], [l as u32]], &Device::Cpu).unwrap();
        let keep_v: Vec<u32> = keep.to_vec1().unwrap();
        let mask_v: Vec<Vec<u32>> = mask.to_vec2().unwrap();
        let bias: Vec<f32> = keep_v
            .iter()
            .flat_map(|&r| {
                let mut row: Vec<f32> = mask_v[r as usize]
                    .iter()
                    .map(|&x| if x == 1 { 0.0 } else { -1e9 })
                    .collect();
                row.push(0.0);
                row
            })
            .collect();
        let bias = Tensor::from_vec(bias, (3, 1, 1, l + 1), &Device::Cpu).unwrap();
        m.forward_hidden(&next, &p, &bias, Some(&mut c))
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1::<f32>()
            .unwrap()
    };
    assert_eq!(step(kept), step(selected));
}

/// The merged decoding copy (what a GPU generator samples from with LoRA) gives the adapted
/// model's log-probs, with no adapter left and its q/k/v and gate/up packed from the merged
/// weights (not the base's pack, which would drop the adapters silently).
#[test]
fn the_merged_decoding_copy_decodes_as_the_adapted_model() {
    for arch in [Arch::Llama, Arch::Qwen2] {
        let base = model(arch, DType::F32, false);
        let tm = adapted(&base);
        let snap = tm.model.snapshot_trainable().unwrap();
        let merged = grpo_rollout::lora::merged_for_decoding(&snap).unwrap();
        assert!(
            merged
                .layers
                .iter()
                .all(|l| l.linears().iter().all(|x| x.lora.is_none()))
        );
        let (a, b) = (logprobs_of(&merged), logprobs_of(&tm.model));
        let d = a
            .iter()
            .zip(&b)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(d < 1e-4, "{arch:?}: {d}");
        assert_ne!(logprobs_of(&base), b, "the adapters change the model");
    }
}

/// `ModelConfig::num_parameters` counts what the model holds, for every architecture, tied and
/// untied, with attention and MLP biases (ERNIE's one `use_bias` sets both).
#[test]
fn num_parameters_counts_every_weight() {
    for arch in ARCHES {
        for untied in [false, true] {
            let mut c = cfg(arch);
            c.tie_word_embeddings = !untied;
            c.attention_bias = true;
            c.mlp_bias = true;
            let m = grpo_rollout::init::random_weights(&c, 1, DType::F32, &Device::Cpu).unwrap();
            // GLM-4.5's router offsets are buffers, which transformers does not count either.
            let held: usize = m
                .weights()
                .iter()
                .filter(|(n, _)| !grpo_rollout::moe::MoeNames::is_buffer(n))
                .map(|(_, t)| t.elem_count())
                .sum();
            assert_eq!(c.num_parameters(), held, "{arch:?} untied {untied}");
        }
    }
}

/// A fine-grained FP8 checkpoint (`fixtures/fp8-qwen3-micro`: every layer matrix float8_e4m3 in
/// 16 × 16 tiles with its `weight_scale_inv`, `scripts/gen_fp8_reference.py`) loads dequantized
/// with the log-probs transformers gives it (`FineGrainedFP8Config(dequantize=True)`), in f32 and
/// bf16; saved, it is dense, without `quantization_config`.
#[test]
fn fp8_checkpoints_load_dequantized_as_transformers() {
    let fixtures = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("fp8_reference.json")).unwrap(),
    )
    .unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let want: Vec<f64> = serde_json::from_value::<Vec<Vec<f64>>>(r["logprobs"].clone())
        .unwrap()
        .concat();
    let lp = |m: &Transformer| -> Vec<f64> {
        let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
        let (lp, _) = m.completion_logprobs(&ids, &mask, 31, 1.0, false).unwrap();
        lp.to_dtype(DType::F64)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap()
    };
    let dir = fixtures.join("fp8-qwen3-micro");
    for (dtype, tol) in [(DType::F32, 2e-5), (DType::BF16, 0.15)] {
        let m = grpo_rollout::load(&dir, dtype, &Device::Cpu).unwrap();
        let got = lp(&m.model);
        let d = got
            .iter()
            .zip(&want)
            .map(|(a, b)| (a - b).abs())
            .fold(0f64, f64::max);
        assert!(d < tol, "{dtype:?}: {d}");
        if dtype == DType::F32 {
            let tmp = tempfile::tempdir().unwrap();
            grpo_rollout::save_hf_dir(&m.model, &m.tokenizer, tmp.path(), DType::F32).unwrap();
            let cj = std::fs::read_to_string(tmp.path().join("config.json")).unwrap();
            assert!(!cj.contains("quantization_config"));
            let back = grpo_rollout::load(tmp.path(), DType::F32, &Device::Cpu).unwrap();
            let again = lp(&back.model);
            assert!(again.iter().zip(&got).all(|(a, b)| (a - b).abs() < 1e-6));
        }
    }
    assert!(want.iter().any(|x| *x < -8.0));
}

/// The FP8 tiles in general: a weight whose sides are not multiples of the block takes partial
/// last tiles (DeepSeek's ⌈N/128⌉ × ⌈K/128⌉ scales), against the per-element product written out;
/// a per-tensor scale; E8M0 (u8) scales as powers of two; a grid that does not fit is named.
#[test]
fn fp8_tiles_scale_their_own_elements() {
    use grpo_rollout::layout::dequantize_fp8;
    let (n, k, bn, bk) = (5usize, 7usize, 2usize, 3usize);
    let vals: Vec<f32> = (0..n * k).map(|i| ((i % 9) as f32 - 4.0) * 0.5).collect();
    let w = Tensor::from_vec(vals.clone(), (n, k), &Device::Cpu)
        .unwrap()
        .to_dtype(DType::F8E4M3)
        .unwrap();
    let (sn, sk) = (n.div_ceil(bn), k.div_ceil(bk));
    let scales: Vec<f32> = (0..sn * sk).map(|i| 0.25 * (i + 1) as f32).collect();
    let s = Tensor::from_vec(scales.clone(), (sn, sk), &Device::Cpu).unwrap();
    let got: Vec<Vec<f32>> = dequantize_fp8(&w, &s, Some((bn, bk)), DType::F32, "w")
        .unwrap()
        .to_vec2()
        .unwrap();
    for i in 0..n {
        for j in 0..k {
            // These halves are exact in float8_e4m3.
            let want = vals[i * k + j] * scales[(i / bn) * sk + j / bk];
            assert_eq!(got[i][j], want, "({i}, {j})");
        }
    }
    let one = Tensor::new(&[3.0f32], &Device::Cpu).unwrap();
    let got: Vec<Vec<f32>> = dequantize_fp8(&w, &one, None, DType::F32, "w")
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!(got[1][2], vals[k + 2] * 3.0);
    let e8m0 = Tensor::from_vec(vec![127u8 + 2; sn * sk], (sn, sk), &Device::Cpu).unwrap();
    let got: Vec<Vec<f32>> = dequantize_fp8(&w, &e8m0, Some((bn, bk)), DType::F32, "w")
        .unwrap()
        .to_vec2()
        .unwrap();
    assert_eq!(got[4][6], vals[4 * k + 6] * 4.0);
    let e = dequantize_fp8(&w, &s, Some((4, 4)), DType::F32, "weight `x`")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("weight `x`") && e.contains("needs 2 × 2 scales, not 3 × 3"),
        "{e}"
    );
    let e = dequantize_fp8(&w, &s, None, DType::F32, "weight `x`")
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("does not divide") && e.contains("weight_block_size"),
        "{e}"
    );
}
