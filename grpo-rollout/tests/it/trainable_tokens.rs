//! PEFT's trainable tokens (a LoRA config's `trainable_token_indices`): the named embedding
//! rows are trained beside the adapters — through the tied head too — start at the base's
//! rows, receive the gradient alone, and survive saving (PEFT's key and config), loading,
//! merging and the decoding copy.
#![allow(clippy::unwrap_used, missing_docs)]

use candle_core::{DType, Device, Tensor};
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::lora::{self, LoraConfig, TOKENS_KEY, TokenIndices};
use grpo_rollout::{Arch, SamplingParams, TrainableModel};

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

#[test]
fn trainable_tokens_train_save_load_merge_and_decode() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("base");
    init_model_dir(&dir, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    let base = grpo_rollout::load(&dir, DType::F32, &Device::Cpu).unwrap();
    assert!(base.model.lm_head.is_none(), "the tiny model ties its head");
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        trainable_token_indices: Some(TokenIndices::List(vec![7, 3, 7])),
        ..LoraConfig::default()
    };
    let p = TrainableModel::lora(&base.model, &cfg, 1).unwrap();
    let (_, delta) = p.vars.iter().find(|(k, _)| k == TOKENS_KEY).unwrap();
    // Repeats dropped, order kept; the rows start as the base's.
    let idx = Tensor::new(&[7u32, 3], &Device::Cpu).unwrap();
    let rows = base.model.embed_tokens.index_select(&idx, 0).unwrap();
    assert_eq!(max_diff(delta.as_tensor(), &rows), 0.0);

    // A row without tokens 3 and 7, and one with token 3.
    let plain = Tensor::new(&[[5u32, 9, 12, 40, 11]], &Device::Cpu).unwrap();
    let with3 = Tensor::new(&[[5u32, 3, 12, 40, 11]], &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, 5), DType::U32, &Device::Cpu).unwrap();
    let logits = |m: &grpo_rollout::Transformer, ids: &Tensor| {
        let h = m.forward_padded(ids, &mask).unwrap();
        m.logits(&h.reshape((5, m.cfg.hidden_size)).unwrap())
            .unwrap()
    };
    let before = logits(&p.model, &plain);
    assert!(max_diff(&before, &logits(&base.model, &plain)) < 1e-6);
    delta.set(&(delta.as_tensor() + 0.5).unwrap()).unwrap();
    // The trained rows change the input of token 3 and, tied, the head's columns 3 and 7 only.
    let after = logits(&p.model, &plain);
    let other: Vec<u32> = (0..p.model.cfg.vocab_size as u32)
        .filter(|&i| i != 3 && i != 7)
        .collect();
    let cols = Tensor::new(other.as_slice(), &Device::Cpu).unwrap();
    assert!(
        max_diff(
            &after.index_select(&cols, 1).unwrap(),
            &before.index_select(&cols, 1).unwrap()
        ) < 1e-6
    );
    assert!(max_diff(&after, &before) > 1e-3);
    assert!(max_diff(&logits(&p.model, &with3), &logits(&base.model, &with3)) > 1e-3);
    // The gradient reaches the trained rows (the base embedding is frozen).
    let g = p
        .model
        .backward(&logits(&p.model, &with3).sqr().unwrap().sum_all().unwrap())
        .unwrap();
    let gd = g.get(delta.as_tensor()).unwrap();
    assert!(
        gd.abs()
            .unwrap()
            .sum_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap()
            > 0.0
    );
    assert!(
        !p.vars
            .iter()
            .any(|(k, _)| k.ends_with("embed_tokens.weight"))
    );

    // Saved in PEFT's format, loaded onto a fresh base, merged, and in the decoding copy: the
    // same model.
    let ad = tmp.path().join("adapter");
    lora::save_peft(&p.model, &cfg, &ad, "base").unwrap();
    let ac: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ad.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(ac["trainable_token_indices"], serde_json::json!([7, 3, 7]));
    let file =
        candle_core::safetensors::load(ad.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(file[TOKENS_KEY].dims(), [2, p.model.cfg.hidden_size]);
    let mut fresh = grpo_rollout::load(&dir, DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    lora::load_peft(&mut fresh, &ad).unwrap();
    assert!(max_diff(&logits(&fresh, &with3), &logits(&p.model, &with3)) < 1e-5);
    let merged = lora::merge(&fresh).unwrap();
    assert!(merged.token_delta.is_none());
    assert!(max_diff(&logits(&merged, &with3), &logits(&p.model, &with3)) < 1e-4);
    let params = SamplingParams {
        max_new_tokens: 6,
        min_new_tokens: 6,
        temperature: 0.0,
        ..SamplingParams::default()
    };
    let prompt = vec![vec![5u32, 3, 12]];
    let a = grpo_rollout::generate(&p.model, &base.tokenizer, &prompt, 1, &params).unwrap();
    let b = grpo_rollout::generate(&merged, &base.tokenizer, &prompt, 1, &params).unwrap();
    assert_eq!(a[0].token_ids, b[0].token_ids);
    // An index outside the vocabulary, or a layer other than the embedding, is refused.
    let bad = LoraConfig {
        trainable_token_indices: Some(TokenIndices::List(vec![100_000])),
        ..cfg.clone()
    };
    let e = TrainableModel::lora(&base.model, &bad, 1)
        .unwrap_err()
        .to_string();
    assert!(e.contains("outside the vocabulary"), "{e}");
    let bad = TokenIndices::ByLayer([("lm_head".to_string(), vec![1])].into());
    assert!(bad.embedding().unwrap_err().to_string().contains("lm_head"));
}

/// An adapter PEFT 0.21 wrote (`scripts/gen_trainers_reference.py`: LoRA on q_proj and v_proj
/// with `trainable_token_indices = [3, 7]`, every trained tensor random) gives PEFT's logits,
/// adapted and merged.
#[test]
fn a_peft_adapter_with_trainable_tokens_gives_pefts_logits() {
    let fix = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fix.join("trainers_reference.json")).unwrap(),
    )
    .unwrap();
    let p = &r["peft"];
    let dev = Device::Cpu;
    let mut m = grpo_rollout::load(&fix.join("bench-qwen2-micro"), DType::F32, &dev)
        .unwrap()
        .model;
    let cfg = lora::load_peft(&mut m, &fix.join("peft-trainable-tokens")).unwrap();
    assert_eq!(
        cfg.trainable_token_indices,
        Some(TokenIndices::List(vec![3, 7]))
    );
    let rows: Vec<Vec<u32>> = serde_json::from_value(p["rows"].clone()).unwrap();
    let (b, l) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, l), &dev).unwrap();
    let mask = Tensor::ones((b, l), DType::U32, &dev).unwrap();
    let logits = |m: &grpo_rollout::Transformer| {
        let h = m.forward_padded(&ids, &mask).unwrap();
        m.logits(&h.reshape((b * l, m.cfg.hidden_size)).unwrap())
            .unwrap()
            .reshape((b, l, m.cfg.vocab_size))
            .unwrap()
    };
    let want = |k: &str| {
        let v: Vec<Vec<Vec<f32>>> = serde_json::from_value(p[k].clone()).unwrap();
        Tensor::new(v, &dev).unwrap()
    };
    let d = max_diff(&logits(&m), &want("logits"));
    assert!(d < 1e-4, "adapted: max |ours - PEFT| = {d}");
    let merged = lora::merge(&m).unwrap();
    let d = max_diff(&logits(&merged), &want("merged_logits"));
    assert!(d < 1e-4, "merged: max |ours - PEFT| = {d}");
}

/// A vocabulary resized before the adapter (TRL's `clone_chat_template` with LoRA): PEFT saves the
/// resized embedding (and the tied head's copies) with the adapter. Loaded onto the base of the
/// original size, it gives PEFT's logits, new tokens included; and our adapter of a resized
/// model carries its embedding the same way, so the original base loads it back.
#[test]
fn adapters_of_a_resized_vocabulary_carry_their_embedding() {
    let fix = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    let r: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fix.join("trainers_reference.json")).unwrap(),
    )
    .unwrap();
    let p = &r["peft"];
    let dev = Device::Cpu;
    let base_dir = fix.join("bench-qwen2-micro");
    let rows: Vec<Vec<u32>> = serde_json::from_value(p["resized_rows"].clone()).unwrap();
    let (b, l) = (rows.len(), rows[0].len());
    let ids = Tensor::from_vec(rows.concat(), (b, l), &dev).unwrap();
    let mask = Tensor::ones((b, l), DType::U32, &dev).unwrap();
    let logits = |m: &grpo_rollout::Transformer| {
        let h = m.forward_padded(&ids, &mask).unwrap();
        m.logits(&h.reshape((b * l, m.cfg.hidden_size)).unwrap())
            .unwrap()
            .reshape((b, l, m.cfg.vocab_size))
            .unwrap()
    };
    let mut m = grpo_rollout::load(&base_dir, DType::F32, &dev)
        .unwrap()
        .model;
    assert_eq!(m.cfg.vocab_size, 300);
    lora::load_peft(&mut m, &fix.join("peft-trainable-tokens-resized")).unwrap();
    assert_eq!(m.cfg.vocab_size, 320);
    let want: Vec<Vec<Vec<f32>>> = serde_json::from_value(p["resized_logits"].clone()).unwrap();
    let d = max_diff(&logits(&m), &Tensor::new(want, &dev).unwrap());
    assert!(d < 1e-4, "max |ours - PEFT| = {d}");

    // Ours: save the adapted resized model against the original base, load it back.
    let tmp = tempfile::tempdir().unwrap();
    let cfg = LoraConfig {
        r: 2,
        lora_alpha: 4.0,
        target_modules: lora::TargetModules::Names(vec!["q_proj".into()]),
        trainable_token_indices: Some(TokenIndices::List(vec![300, 305])),
        ..LoraConfig::default()
    };
    let ad = tmp.path().join("adapter");
    lora::save_peft(&m, &cfg, &ad, base_dir.to_str().unwrap()).unwrap();
    let file = candle_core::safetensors::load(ad.join("adapter_model.safetensors"), &dev).unwrap();
    assert_eq!(
        file["base_model.model.model.embed_tokens.token_adapter.base_layer.weight"].dims(),
        [320, m.cfg.hidden_size]
    );
    let mut back = grpo_rollout::load(&base_dir, DType::F32, &dev)
        .unwrap()
        .model;
    lora::load_peft(&mut back, &ad).unwrap();
    assert!(max_diff(&logits(&back), &logits(&m)) < 1e-5);
}
