//! On-policy distillation's per-token divergence through the model (`Transformer::distill_rows`):
//! equal to `grpo_core::distill::generalized_jsd` of the two models' full logits (itself checked
//! against TRL's definition), values and the student's gradients, on the plain path (f32) and
//! the recomputing one (bf16); a teacher with extra vocabulary rows is read over the student's.
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{DType, Device, Tensor};
use grpo_core::distill::generalized_jsd;
use grpo_rollout::init::{Preset, preset_config, random_weights};
use grpo_rollout::{Arch, TrainableModel, Transformer};

const VOCAB: usize = 61;

fn model(seed: u64, dtype: DType) -> Transformer {
    let mut c = preset_config(Preset::Tiny, Arch::Qwen2, VOCAB, 1, 0);
    c.hidden_size = 32;
    c.num_attention_heads = 4;
    c.num_key_value_heads = 2;
    c.head_dim = 8;
    c.intermediate_size = 48;
    random_weights(&c, seed, dtype, &Device::Cpu).unwrap()
}

/// Two left-padded rows: a prompt then a 3-token completion.
fn batch() -> (Tensor, Tensor) {
    let d = Device::Cpu;
    let ids = Tensor::new(&[[0u32, 7, 9, 12, 5, 33, 2], [4, 8, 15, 16, 23, 42, 1]], &d).unwrap();
    let mask = Tensor::new(&[[0u32, 1, 1, 1, 1, 1, 1], [1, 1, 1, 1, 1, 1, 1]], &d).unwrap();
    (ids, mask)
}

fn max_diff(a: &Tensor, b: &Tensor) -> f64 {
    (a.to_dtype(DType::F64).unwrap() - b.to_dtype(DType::F64).unwrap())
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f64>()
        .unwrap()
}

#[test]
fn distill_rows_equal_the_divergence_of_the_full_logits() {
    let (ids, mask) = batch();
    for (dtype, tol) in [(DType::F32, 1e-5), (DType::BF16, 2e-2)] {
        let student = TrainableModel::full(&model(1, dtype)).unwrap();
        let teacher = model(2, dtype);
        let s = &student.model;
        for (beta, t) in [(0.0, 1.0), (1.0, 1.0), (0.5, 1.0), (0.2, 0.7)] {
            let h = s.completion_hidden(&ids, &mask, 3).unwrap();
            let th = teacher.completion_hidden(&ids, &mask, 3).unwrap();
            let (div, ent) = s.distill_rows(&h, &teacher, &th, beta, t).unwrap();
            assert_eq!(div.dims(), [6]);
            let zs = s.logits(&h).unwrap();
            let zt = teacher.logits(&th).unwrap();
            let want = generalized_jsd(&zs, &zt, beta, t).unwrap();
            assert!(
                max_diff(&div, &want) < tol,
                "{dtype:?} beta {beta}: {div} vs {want}"
            );
            let want_ent =
                grpo_core::logprobs::entropy_from_logits(&(zs.detach() / t).unwrap()).unwrap();
            assert!(max_diff(&ent, &want_ent) < tol);
            // The student's gradients equal those of the direct composition.
            let g1 = s.backward(&div.sum_all().unwrap()).unwrap();
            let g2 = s.backward(&want.sum_all().unwrap()).unwrap();
            for (name, v) in &student.vars {
                let (a, b) = (g1.get(v.as_tensor()), g2.get(v.as_tensor()));
                match (a, b) {
                    (Some(a), Some(b)) => {
                        let scale = max_diff(b, &b.zeros_like().unwrap()).max(1e-3);
                        assert!(max_diff(a, b) / scale < tol * 10.0, "{dtype:?} {name}");
                    }
                    (None, None) => {}
                    _ => panic!("{name}: a gradient on one path only"),
                }
            }
        }
    }
    // A teacher with padding rows past the student's vocabulary is read over the student's;
    // a smaller one is refused.
    let student = model(1, DType::F32);
    let mut wide = model(2, DType::F32);
    let narrow_teacher = wide.clone();
    wide.resize_token_embeddings(VOCAB + 64).unwrap();
    let h = student.completion_hidden(&ids, &mask, 3).unwrap();
    let th = wide.completion_hidden(&ids, &mask, 3).unwrap();
    let (a, _) = student.distill_rows(&h, &wide, &th, 0.5, 1.0).unwrap();
    let (b, _) = student
        .distill_rows(&h, &narrow_teacher, &th, 0.5, 1.0)
        .unwrap();
    assert!(max_diff(&a, &b) < 1e-6);
    let mut small = model(2, DType::F32);
    small.resize_token_embeddings(VOCAB - 1).unwrap();
    let e = student.distill_rows(&h, &small, &th, 0.5, 1.0).unwrap_err();
    assert!(e.to_string().contains("smaller than the student's"), "{e}");
    // A student distilled from itself diverges by 0.
    let (z, _) = student.distill_rows(&h, &student, &h, 0.5, 1.0).unwrap();
    assert!(max_diff(&z, &z.zeros_like().unwrap()) < 1e-6);
}

/// TRL 1.16's own `_chunked_divergence_loss` (the DistillationTrainer's loss, run by
/// `scripts/gen_trainers_reference.py` with transformers' models): bench-qwen2-micro distilled
/// from micro-teacher on fixed rows, the mean divergence over completion tokens and the
/// student's mean entropy, for β = 0, 1, 0.5 and 0.25 at temperature 0.7.
#[test]
fn distill_rows_match_trls_divergence_loss() {
    let fix = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fix.join("trainers_reference.json")).unwrap(),
    )
    .unwrap();
    let d = &r["distill"];
    let dev = Device::Cpu;
    let s = grpo_rollout::load(&fix.join("bench-qwen2-micro"), DType::F32, &dev)
        .unwrap()
        .model;
    let t = grpo_rollout::load(&fix.join("micro-teacher"), DType::F32, &dev)
        .unwrap()
        .model;
    let rows: Vec<(Vec<u32>, Vec<u32>)> = d["rows"]
        .as_array()
        .unwrap()
        .iter()
        .map(|r| serde_json::from_value(r.clone()).unwrap())
        .collect();
    let p = rows.iter().map(|(a, _)| a.len()).max().unwrap();
    let c = rows.iter().map(|(_, b)| b.len()).max().unwrap();
    let (mut ids, mut att, mut cm) = (Vec::new(), Vec::new(), Vec::new());
    for (a, b) in &rows {
        ids.extend(std::iter::repeat_n(0u32, p - a.len()));
        ids.extend(a.iter().chain(b));
        ids.extend(std::iter::repeat_n(0u32, c - b.len()));
        att.extend(std::iter::repeat_n(0u32, p - a.len()));
        att.extend(std::iter::repeat_n(1u32, a.len() + b.len()));
        att.extend(std::iter::repeat_n(0u32, c - b.len()));
        cm.extend(std::iter::repeat_n(1f32, b.len()));
        cm.extend(std::iter::repeat_n(0f32, c - b.len()));
    }
    let n = rows.len();
    let ids = Tensor::from_vec(ids, (n, p + c), &dev).unwrap();
    let att = Tensor::from_vec(att, (n, p + c), &dev).unwrap();
    let cm = Tensor::from_vec(cm, n * c, &dev).unwrap();
    let h = s.completion_hidden(&ids, &att, c).unwrap();
    let th = t.completion_hidden(&ids, &att, c).unwrap();
    let tokens = cm.sum_all().unwrap().to_scalar::<f32>().unwrap();
    for case in d["cases"].as_array().unwrap() {
        let (beta, temp) = (
            case["beta"].as_f64().unwrap(),
            case["temperature"].as_f64().unwrap(),
        );
        let (div, ent) = s.distill_rows(&h, &t, &th, beta, temp).unwrap();
        let mean = |x: &Tensor| {
            (x * &cm)
                .unwrap()
                .sum_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
                / tokens
        };
        let (loss, entropy) = (mean(&div) as f64, mean(&ent) as f64);
        let (want, want_ent) = (
            case["loss"].as_f64().unwrap(),
            case["entropy"].as_f64().unwrap(),
        );
        assert!(
            (loss - want).abs() < 1e-6 + 1e-4 * want,
            "beta {beta} T {temp}: ours {loss}, TRL {want}"
        );
        assert!((entropy - want_ent).abs() < 1e-4, "{entropy} vs {want_ent}");
    }
}
