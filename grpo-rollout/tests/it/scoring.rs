//! The model as grpo-rewards' scoring models (feature `rewards`): `inverse_loss`,
//! `coverage_ce` and `reward_model` rewards against transformers (f32, ≤ 1e-4).
//!
//! Reference values: `fixtures/scoring_reference.json`, written by
//! `scripts/gen_scoring_reference.py` (transformers 5.23, torch 2.15, eager attention), which
//! also wrote the two tiny reward models `fixtures/tiny-qwen2-rm` (pad_token_id 0) and
//! `fixtures/tiny-llama-rm` (no pad_token_id). The language model is the committed
//! `fixtures/bench-qwen2-micro`. The snippet (from the script):
//! ```text
//! ids = lambda text: tok(text, add_special_tokens=False).input_ids
//! # inverse_loss (0 for an empty completion; empty prompt: c[0] is the context)
//! logits = model(input_ids=tensor([p + c])).logits[0].double()
//! inv = log_softmax(logits[len(p)-1:-1], -1).gather(-1, tensor(c)[:, None]).mean()
//! # coverage_ce (0 when min_len = 0)
//! logits = model(input_ids=tensor([c])).logits[0, :m].double()      # m = min(len(c), len(a))
//! cov = log_softmax(logits, -1).gather(-1, tensor(a[:m])[:, None]).mean() * min(1, len(c)/len(a))
//! # reward_model, as TRL: right padding, no special tokens, logits[:, 0]
//! inputs = tok(texts, return_tensors="pt", padding=True, padding_side="right", add_special_tokens=False)
//! scores = model(**inputs).logits[:, 0]    # pad_token_id None: each text alone
//! ```
#![cfg(feature = "rewards")]
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::Arc;

use candle_core::{DType, Device};
use grpo_rewards::builtin::{LanguageScorer, SequenceClassifier};
use grpo_rewards::{RewardInput, RewardsConfig, ScoringModels};
use grpo_rollout::scoring::{ClassifierModel, ModelScorer};
use serde_json::Value;

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn reference() -> Value {
    let text = std::fs::read_to_string(fixtures().join("scoring_reference.json")).unwrap();
    serde_json::from_str(&text).unwrap()
}

fn s(v: &Value) -> &str {
    v.as_str().unwrap()
}

fn ids(v: &Value) -> Vec<u32> {
    serde_json::from_value(v.clone()).unwrap()
}

fn scorer() -> ModelScorer {
    ModelScorer::load(
        &fixtures().join("bench-qwen2-micro"),
        DType::F32,
        &Device::Cpu,
    )
    .unwrap()
}

#[test]
fn inverse_loss_and_coverage_ce_match_transformers() {
    let r = reference();
    let triples = r["triples"].as_array().unwrap();
    // Small batches, so that the padded batched path runs with more than one chunk.
    let scorer = Arc::new(scorer().with_batch_size(2));
    for t in triples {
        assert_eq!(
            scorer.tokenize(s(&t["prompt"])).unwrap(),
            ids(&t["prompt_ids"])
        );
        assert_eq!(
            scorer.tokenize(s(&t["completion"])).unwrap(),
            ids(&t["completion_ids"])
        );
        assert_eq!(
            scorer.tokenize(s(&t["answer"])).unwrap(),
            ids(&t["answer_ids"])
        );
    }
    let cfg: RewardsConfig = serde_json::from_value(serde_json::json!({
        "rewards": [{"type": "inverse_loss"}, {"type": "coverage_ce"}]
    }))
    .unwrap();
    let set = cfg
        .build(&ScoringModels {
            language: Some(scorer.clone()),
            classifier: None,
            ..Default::default()
        })
        .unwrap();
    let batch: Vec<RewardInput> = triples
        .iter()
        .map(|t| {
            RewardInput::new(s(&t["prompt"]), s(&t["completion"]))
                .with_field("answer", s(&t["answer"]))
        })
        .collect();
    let scored = set.score(&batch).unwrap();
    let mut max = 0f64;
    for (k, name) in ["inverse_loss", "coverage_ce"].into_iter().enumerate() {
        for (t, got) in triples.iter().zip(&scored.per_function[k]) {
            let want = t[name].as_f64().unwrap();
            let got = f64::from(got.unwrap());
            max = max.max((got - want).abs());
            assert!(
                (got - want).abs() <= 1e-4,
                "{name} of {:?}/{:?}: ours {got}, transformers {want}",
                t["prompt"],
                t["completion"]
            );
        }
    }
    eprintln!("inverse_loss / coverage_ce: max |ours - transformers| = {max:e}");
    // The empty completion scores 0; the short completion is scaled by its coverage.
    assert_eq!(scored.per_function[0][2], Some(0.0));
    assert_eq!(scored.per_function[1][2], Some(0.0));

    // Batched and one-by-one NLLs agree, whatever the batch size.
    let pairs: Vec<(&str, &str)> = triples
        .iter()
        .map(|t| (s(&t["prompt"]), s(&t["completion"])))
        .collect();
    let whole = (*scorer)
        .clone()
        .with_batch_size(64)
        .nll_batch(&pairs)
        .unwrap();
    for (i, (p, c)) in pairs.iter().enumerate() {
        let one = scorer.completion_nll(p, c).unwrap();
        match (one, whole[i]) {
            (Some(a), Some(b)) => assert!((a - b).abs() < 1e-5, "{i}: {a} vs {b}"),
            (a, b) => assert_eq!(a, b, "{i}"),
        }
    }
    assert_eq!(whole[2], None, "an empty completion has no NLL");
    assert_eq!(scorer.completion_nll("x", "").unwrap(), None);
    assert_eq!(
        scorer.completion_nll("", "a").unwrap(),
        None,
        "one token, no context"
    );
    assert!(scorer.aligned_log_probs("", &[1, 2]).unwrap().is_empty());
    assert!(scorer.completion_nll_batch(&[]).unwrap().is_empty());
}

#[test]
fn reward_model_scores_match_transformers() {
    let r = reference();
    let texts = r["rm_texts"].as_array().unwrap();
    let batch: Vec<RewardInput> = texts
        .iter()
        .map(|t| RewardInput::new(s(&t[0]), s(&t[1])))
        .chain([RewardInput::new("", "")])
        .collect();
    let mut max = 0f64;
    for (name, want) in r["reward_models"].as_object().unwrap() {
        let rm = ClassifierModel::load(&fixtures().join(name), DType::F32, &Device::Cpu).unwrap();
        assert_eq!(
            rm.checkpoint_pad_token_id(),
            (name == "tiny-qwen2-rm").then_some(0),
            "{name}"
        );
        let cfg: RewardsConfig = serde_json::from_value(serde_json::json!({
            "rewards": [{"type": "reward_model", "batch_size": 3}]
        }))
        .unwrap();
        let set = cfg
            .build(&ScoringModels {
                language: None,
                classifier: Some(Arc::new(rm)),
                ..Default::default()
            })
            .unwrap();
        let got = &set.score(&batch).unwrap().per_function[0];
        let want: Vec<f64> = serde_json::from_value(want.clone()).unwrap();
        assert_eq!(got.len(), want.len() + 1);
        for (i, (g, w)) in got.iter().zip(&want).enumerate() {
            let g = f64::from(g.unwrap());
            max = max.max((g - w).abs());
            assert!(
                (g - w).abs() <= 1e-4,
                "{name} text {i}: ours {g}, transformers {w}"
            );
        }
        assert_eq!(got[want.len()], None, "an empty text has no score");
    }
    eprintln!("reward_model: max |ours - transformers| = {max:e}");
}

#[test]
fn a_causal_lm_is_not_a_reward_model() {
    // The message is the first line (with RUST_BACKTRACE set, candle appends a backtrace).
    let err = |dir: &Path| {
        let e = ClassifierModel::load(dir, DType::F32, &Device::Cpu)
            .unwrap_err()
            .to_string();
        e.lines().next().unwrap_or_default().to_owned()
    };
    let dir = fixtures().join("bench-qwen2-micro");
    let e = err(&dir);
    assert!(
        e.contains("config.json")
            && e.contains("not a sequence-classification checkpoint")
            && e.contains("Qwen2ForCausalLM"),
        "{e}"
    );

    // A classifier config whose weights lack the head names the weights file.
    let tmp = std::env::temp_dir().join(format!("grpo-rm-nohead-{}", std::process::id()));
    std::fs::create_dir_all(&tmp).unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "model.safetensors",
    ] {
        std::fs::copy(dir.join(f), tmp.join(f)).unwrap();
    }
    let mut cfg: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("config.json")).unwrap()).unwrap();
    cfg["architectures"] = serde_json::json!(["Qwen2ForSequenceClassification"]);
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let e = err(&tmp);
    assert!(
        e.contains("model.safetensors") && e.contains("score.weight"),
        "{e}"
    );
    cfg["num_labels"] = serde_json::json!(3);
    std::fs::write(tmp.join("config.json"), cfg.to_string()).unwrap();
    let e = err(&tmp);
    assert!(e.contains("num_labels = 3"), "{e}");
    std::fs::remove_dir_all(&tmp).ok();
}

#[test]
fn position_scores_do_not_depend_on_trailing_padding() {
    let rm =
        ClassifierModel::load(&fixtures().join("tiny-qwen2-rm"), DType::F32, &Device::Cpu).unwrap();
    let pad = rm.pad_token_id();
    let a = vec![5u32, 9, 17, 40];
    let alone = rm.position_scores(std::slice::from_ref(&a)).unwrap();
    let mut padded = a.clone();
    padded.extend([pad, pad, pad]);
    let batch = rm.position_scores(&[padded, vec![7; 7]]).unwrap();
    for j in 0..a.len() {
        assert!((alone[0][j] - batch[0][j]).abs() < 1e-5);
    }
    assert!(rm.position_scores(&[]).unwrap().is_empty());
    assert!(rm.position_scores(&[vec![1, 2], vec![1]]).is_err());
}
