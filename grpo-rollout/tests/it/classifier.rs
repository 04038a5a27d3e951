//! Sequence classifiers (reward models) as `Transformer`s with a `score` head: made from a
//! causal LM, scored as transformers' `*ForSequenceClassification` scores (checked against the
//! transformers-written fixture through `ClassifierModel`, itself checked against transformers
//! in `scoring.rs`), trained (gradients reach the head and the decoder), saved and loaded as a
//! Hugging Face directory and as a PEFT adapter with `modules_to_save = ["score"]`.
#![cfg(feature = "rewards")]
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Tensor};
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::lora::{self, LoraConfig, SCORE_KEY};
use grpo_rollout::scoring::ClassifierModel;
use grpo_rollout::{Arch, TrainableModel};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap()
}

/// Rows of different lengths; row 1 ends with two pad ids (0) that are its own tokens.
fn rows() -> Vec<Vec<u32>> {
    vec![
        vec![5, 9, 2, 33, 7],
        vec![8, 3, 0, 0],
        vec![17],
        vec![40, 12, 6],
    ]
}

/// The rightmost non-pad position of each row, read off the classifier's per-position scores.
fn reference_scores(rm: &ClassifierModel, rows: &[Vec<u32>], pad: u32) -> Vec<f32> {
    let t = rows.iter().map(Vec::len).max().unwrap();
    let padded: Vec<Vec<u32>> = rows
        .iter()
        .map(|r| {
            let mut r = r.clone();
            r.resize(t, pad);
            r
        })
        .collect();
    let all = rm.scores(&padded).unwrap();
    padded
        .iter()
        .zip(all)
        .map(|(r, s)| s[r.iter().rposition(|&x| x != pad).unwrap_or(0)])
        .collect()
}

#[test]
fn sequence_scores_match_the_transformers_classifier() {
    let dir = fixtures().join("tiny-qwen2-rm");
    let loaded = grpo_rollout::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let m = &loaded.model;
    assert!(m.cfg.sequence_classification && m.lm_head.is_none());
    assert_eq!(m.score.as_ref().unwrap().dims(), [1, m.cfg.hidden_size]);
    let rm = ClassifierModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let rows = rows();
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let got: Vec<f32> = m
        .sequence_scores(&refs, Some(0))
        .unwrap()
        .to_vec1()
        .unwrap();
    let want = reference_scores(&rm, &rows, 0);
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
    // Row 1's trailing pad ids are skipped: it is scored at its token 3 (index 1) ...
    let alone: Vec<f32> = m
        .sequence_scores(&[&[8, 3]], Some(0))
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!((alone[0] - got[1]).abs() < 1e-5);
    // ... and without a pad id at its last token, as if scored alone.
    let last: Vec<f32> = m.sequence_scores(&refs, None).unwrap().to_vec1().unwrap();
    let row1: Vec<f32> = m
        .sequence_scores(&[&rows[1]], None)
        .unwrap()
        .to_vec1()
        .unwrap();
    assert!((last[1] - row1[0]).abs() < 1e-5 && (last[1] - got[1]).abs() > 1e-6);
    // A causal LM has no head to score with.
    let lm = grpo_rollout::load(
        &fixtures().join("bench-qwen2-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let e = lm.model.sequence_scores(&refs, Some(0)).unwrap_err();
    assert!(e.to_string().contains("no score head"), "{e}");
}

/// PPO's value model reads the score head at every position: transformers' per-position
/// scores of the fixture, on each row's own tokens whatever the other rows' lengths.
#[test]
fn position_scores_match_the_transformers_classifier_at_every_token() {
    let dir = fixtures().join("tiny-qwen2-rm");
    let m = grpo_rollout::load(&dir, DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    let rm = ClassifierModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let rows = rows();
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let got = m.position_scores(&refs, 0).unwrap();
    assert_eq!(got.dims(), [4, 5]);
    let got: Vec<Vec<f32>> = got.to_vec2().unwrap();
    for (i, r) in rows.iter().enumerate() {
        let want = &rm.scores(std::slice::from_ref(r)).unwrap()[0];
        for j in 0..r.len() {
            assert!(
                (got[i][j] - want[j]).abs() < 1e-5,
                "row {i} position {j}: {} vs {}",
                got[i][j],
                want[j]
            );
        }
    }
    let lm = grpo_rollout::load(
        &fixtures().join("bench-qwen2-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap();
    let e = lm.model.position_scores(&refs, 0).unwrap_err();
    assert!(e.to_string().contains("no score head"), "{e}");
}

/// Mean pooling of the final hidden states (BCO's UDM embeddings): each row's, padded into
/// one batch, equals the row alone, and the mean of the per-position states the score head
/// reads (transformers' fixture: the score head is linear, so the head of the mean is the
/// mean of the per-position scores).
#[test]
fn mean_hidden_is_each_rows_own_mean() {
    let dir = fixtures().join("tiny-qwen2-rm");
    let m = grpo_rollout::load(&dir, DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    let rm = ClassifierModel::load(&dir, DType::F32, &Device::Cpu).unwrap();
    let rows = rows();
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let all = m.mean_hidden(&refs).unwrap();
    assert_eq!(all.dims(), [4, m.cfg.hidden_size]);
    let heads = m.score_rows(&all).unwrap().to_vec1::<f32>().unwrap();
    for (i, r) in rows.iter().enumerate() {
        let alone = m.mean_hidden(&[r]).unwrap();
        assert!(
            max_diff(&all.narrow(0, i, 1).unwrap(), &alone) < 1e-5,
            "row {i}"
        );
        let per_position = &rm.scores(std::slice::from_ref(r)).unwrap()[0];
        let mean = per_position.iter().sum::<f32>() / r.len() as f32;
        assert!(
            (heads[i] - mean).abs() < 1e-5,
            "row {i}: {} vs {mean}",
            heads[i]
        );
    }
    assert!(m.mean_hidden(&[&[1, 2], &[]]).is_err());
}

#[test]
fn a_causal_lm_becomes_a_classifier_that_trains_saves_and_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = tmp.path().join("base");
    init_model_dir(&base_dir, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    let base = grpo_rollout::load(&base_dir, DType::F32, &Device::Cpu).unwrap();
    let clf = base.model.clone().into_sequence_classifier(11).unwrap();
    let h = clf.cfg.hidden_size;
    let w: Vec<f32> = clf
        .score
        .as_ref()
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    assert_eq!(w.len(), h);
    let std = (w.iter().map(|x| x * x).sum::<f32>() / h as f32).sqrt();
    assert!((0.01..0.03).contains(&std), "N(0, 0.02²) head, std {std}");
    // The config's `initializer_range` (SmolLM2's is 1/24) sets the head's spread.
    let mut wide = base.model.clone();
    wide.cfg.initializer_range = Some(0.2);
    let w2: Vec<f32> = wide
        .into_sequence_classifier(11)
        .unwrap()
        .score
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap();
    let std2 = (w2.iter().map(|x| x * x).sum::<f32>() / h as f32).sqrt();
    assert!((0.1..0.3).contains(&std2), "N(0, 0.2²) head, std {std2}");
    // Seeded: the same seed, the same head; another, another.
    let again = base.model.clone().into_sequence_classifier(11).unwrap();
    assert_eq!(
        max_diff(clf.score.as_ref().unwrap(), again.score.as_ref().unwrap()),
        0.0
    );
    let other = base.model.clone().into_sequence_classifier(12).unwrap();
    assert!(max_diff(clf.score.as_ref().unwrap(), other.score.as_ref().unwrap()) > 0.0);

    // Training: the scores' gradient reaches the head and the decoder.
    let rows = rows();
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let pad = base.tokenizer.pad_token_id;
    let full = TrainableModel::full(&clf).unwrap();
    let names: Vec<&str> = full.vars.iter().map(|(k, _)| k.as_str()).collect();
    assert!(names.contains(&"score.weight") && !names.contains(&"lm_head.weight"));
    let s = full.model.sequence_scores(&refs, Some(pad)).unwrap();
    let grads = full.model.backward(&s.sum_all().unwrap()).unwrap();
    for (k, v) in &full.vars {
        if k == "score.weight" || k.ends_with("q_proj.weight") {
            let g = grads.get(v.as_tensor()).unwrap();
            assert!(
                g.abs()
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .to_scalar::<f32>()
                    .unwrap()
                    > 0.0,
                "{k}"
            );
        }
    }

    // A Hugging Face directory that transformers reads as a classifier, and back.
    let out = tmp.path().join("rm");
    grpo_rollout::save_hf_dir(&clf, &base.tokenizer, &out, DType::F32).unwrap();
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["architectures"][0], "Qwen2ForSequenceClassification");
    assert_eq!(cj["id2label"], serde_json::json!({"0": "LABEL_0"}));
    assert_eq!(cj["pad_token_id"], pad);
    let names = grpo_rollout::loader::read_safetensors(&out, &Device::Cpu).unwrap();
    assert!(names.contains_key("score.weight") && !names.contains_key("lm_head.weight"));
    let rm = ClassifierModel::load(&out, DType::F32, &Device::Cpu).unwrap();
    let want = reference_scores(&rm, &rows, pad);
    let got: Vec<f32> = clf
        .sequence_scores(&refs, Some(pad))
        .unwrap()
        .to_vec1()
        .unwrap();
    for (g, w) in got.iter().zip(&want) {
        assert!((g - w).abs() < 1e-5, "{got:?} vs {want:?}");
    }
    // GGUF has no classifier form here: a one-line refusal naming the file.
    let e = grpo_rollout::gguf::save_gguf(
        &clf,
        &base.tokenizer,
        &tmp.path().join("rm.gguf"),
        grpo_rollout::gguf::GgufType::F32,
        "rm",
    )
    .unwrap_err()
    .to_string();
    assert!(
        e.contains("rm.gguf") && e.contains("sequence classifier"),
        "{e}"
    );

    // LoRA: the head is trained whole beside the adapters (PEFT's modules_to_save), saved in
    // the adapter, and an adapter with a head makes a causal base a classifier again.
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        ..LoraConfig::default()
    };
    let adapted = TrainableModel::lora(&clf, &cfg, 5).unwrap();
    let (_, head) = adapted.vars.iter().find(|(k, _)| k == SCORE_KEY).unwrap();
    head.set(&(head.as_tensor() * 3.0).unwrap()).unwrap();
    for (k, v) in &adapted.vars {
        if k.ends_with("lora_B.weight") {
            v.set(&(v.ones_like().unwrap() * 0.01).unwrap()).unwrap();
        }
    }
    let trained: Vec<f32> = adapted
        .model
        .sequence_scores(&refs, Some(pad))
        .unwrap()
        .to_vec1()
        .unwrap();
    let ad = tmp.path().join("adapter");
    lora::save_peft(&adapted.model, &cfg, &ad, "base").unwrap();
    let ac: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ad.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(ac["task_type"], "SEQ_CLS");
    assert_eq!(ac["modules_to_save"], serde_json::json!(["score"]));
    let mut causal = grpo_rollout::load(&base_dir, DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    lora::load_peft(&mut causal, &ad).unwrap();
    assert!(causal.cfg.sequence_classification);
    let back: Vec<f32> = causal
        .sequence_scores(&refs, Some(pad))
        .unwrap()
        .to_vec1()
        .unwrap();
    let merged: Vec<f32> = lora::merge(&causal)
        .unwrap()
        .sequence_scores(&refs, Some(pad))
        .unwrap()
        .to_vec1()
        .unwrap();
    for ((a, b), c) in trained.iter().zip(&back).zip(&merged) {
        assert!(
            (a - b).abs() < 1e-5 && (a - c).abs() < 1e-4,
            "{trained:?} {back:?} {merged:?}"
        );
    }
    assert!(trained.iter().zip(&got).any(|(a, b)| (a - b).abs() > 1e-3));
}

/// A token classifier (a process reward model, transformers' `*ForTokenClassification`): made
/// from a causal LM with a seeded N(0, 0.02²) head and a zero bias; each position's logits are
/// `h · Wᵀ + b` of the decoder's hidden state, whatever the right padding of the batch; the
/// bias trains; saved as a Hugging Face directory with two labels and read back equal; refused
/// as a sequence classifier and as a causal LM.
#[test]
fn a_causal_lm_becomes_a_token_classifier_that_trains_saves_and_loads() {
    let tmp = tempfile::tempdir().unwrap();
    let base_dir = tmp.path().join("base");
    init_model_dir(&base_dir, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    let base = grpo_rollout::load(&base_dir, DType::F32, &Device::Cpu).unwrap();
    let clf = base.model.clone().into_token_classifier(2, 11).unwrap();
    assert_eq!(clf.cfg.token_classification, Some(2));
    assert!(clf.lm_head.is_none());
    let h = clf.cfg.hidden_size;
    let w = clf.score.as_ref().unwrap();
    assert_eq!(w.dims(), [2, h]);
    let wv: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
    let std = (wv.iter().map(|x| x * x).sum::<f32>() / wv.len() as f32).sqrt();
    assert!((0.01..0.03).contains(&std), "N(0, 0.02²) head, std {std}");
    let b: Vec<f32> = clf.score_bias.as_ref().unwrap().to_vec1().unwrap();
    assert_eq!(b, vec![0.0, 0.0]);

    // Each row's logits alone equal its rows in the padded batch, and equal h · Wᵀ + b.
    let rows = rows();
    let refs: Vec<&[u32]> = rows.iter().map(Vec::as_slice).collect();
    let mut moved = clf.clone();
    moved.score_bias = Some(Tensor::new(&[0.5f32, -0.25], &Device::Cpu).unwrap());
    let batch = moved.token_logits(&refs, 0).unwrap();
    assert_eq!(batch.dims(), [4, 5, 2]);
    for (i, r) in rows.iter().enumerate() {
        let alone = moved
            .token_logits(&[r.as_slice()], 0)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let part = batch.get(i).unwrap().narrow(0, 0, r.len()).unwrap();
        assert!(max_diff(&alone, &part) < 1e-5, "row {i}");
        let ids = Tensor::from_vec(r.clone(), (1, r.len()), &Device::Cpu).unwrap();
        let mask = ids.ones_like().unwrap();
        let hs = moved
            .forward_padded(&ids, &mask)
            .unwrap()
            .squeeze(0)
            .unwrap();
        let want = hs
            .matmul(&moved.score.as_ref().unwrap().t().unwrap())
            .unwrap()
            .broadcast_add(moved.score_bias.as_ref().unwrap())
            .unwrap();
        assert!(max_diff(&alone, &want) < 1e-5, "row {i}");
    }

    // Trainable: the head's weight and bias are variables and get gradients.
    let full = TrainableModel::full(&clf).unwrap();
    let names: Vec<&str> = full.vars.iter().map(|(k, _)| k.as_str()).collect();
    assert!(names.contains(&"score.weight") && names.contains(&"score.bias"));
    let z = full.model.token_logits(&refs, 0).unwrap();
    let loss = z.narrow(2, 1, 1).unwrap().sum_all().unwrap();
    let grads = full.model.backward(&loss).unwrap();
    let (_, bias) = full.vars.iter().find(|(k, _)| k == "score.bias").unwrap();
    let g: Vec<f32> = grads.get(bias.as_tensor()).unwrap().to_vec1().unwrap();
    // d Σ z[..., 1] / d b = [0, number of positions].
    assert_eq!(g, vec![0.0, 20.0]);

    // A Hugging Face directory with two labels, read back as the same token classifier.
    let out = tmp.path().join("prm");
    grpo_rollout::save_hf_dir(&moved, &base.tokenizer, &out, DType::F32).unwrap();
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(out.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["architectures"][0], "Qwen2ForTokenClassification");
    assert_eq!(
        cj["id2label"],
        serde_json::json!({"0": "LABEL_0", "1": "LABEL_1"})
    );
    let back = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(back.model.cfg.token_classification, Some(2));
    let again = back.model.token_logits(&refs, 0).unwrap();
    assert!(max_diff(&again, &batch) < 1e-6);
    assert!(ClassifierModel::load(&out, DType::F32, &Device::Cpu).is_err());
    let e = back.causal().unwrap_err().to_string();
    assert!(e.contains("token classifier"), "{e}");
    assert!(moved.clone().into_sequence_classifier(1).is_err());
    assert!(moved.clone().into_token_classifier(3, 1).is_err());
    assert!(
        base.model
            .clone()
            .into_sequence_classifier(1)
            .unwrap()
            .into_token_classifier(2, 1)
            .is_err()
    );
}
