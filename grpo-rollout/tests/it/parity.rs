//! Log-probs against transformers on the same weights (f32, ≤ 1e-4).
//!
//! Reference values: `fixtures/transformers_logprobs.json`, produced by
//! `scripts/gen_rollout_reference.py` (transformers 5.23, eager attention) from
//!   * `init-{llama,qwen2,qwen3}`: `grpo-cli init-model --preset tiny --arch A --seed 1`
//!     (regenerated here: the generator is deterministic), and
//!   * `bench-qwen2-micro`: `bench/make_tiny_model.py DIR --hidden 32 --layers 2
//!     --heads 4 --kv-heads 2 --vocab 300`, kept in `fixtures/`.
//!
//! The snippet (from the script):
//! ```text
//! model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32, attn_implementation="eager")
//! ids = left-padded ROWS (pad 0); mask = 0/1; pos = (mask.cumsum(-1) - 1).clamp(min=0)
//! logits = model(input_ids=ids, attention_mask=mask, position_ids=pos).logits
//! logits = logits[:, -T-1:-1, :] / TEMPERATURE
//! lp = log_softmax(logits.double(), -1).gather(-1, ids[:, -T:].unsqueeze(-1)).squeeze(-1)
//! ```
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};

use candle_core::{DType, Device};
use grpo_rollout::config::Arch;
use grpo_rollout::generate::left_pad;
use grpo_rollout::init::{Preset, init_model_dir};

fn fixtures() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

fn check(dir: &Path, want: &serde_json::Value, reference: &serde_json::Value) {
    let m = grpo_rollout::load(dir, DType::F32, &Device::Cpu).unwrap();
    let rows: Vec<Vec<u32>> = serde_json::from_value(reference["rows"].clone()).unwrap();
    let t = reference["t"].as_u64().unwrap() as usize;
    let temp = reference["temperature"].as_f64().unwrap();
    let (ids, mask) = left_pad(&rows, 0, &Device::Cpu).unwrap();
    let (lp, _) = m
        .model
        .completion_logprobs(&ids, &mask, t, temp, false)
        .unwrap();
    let got: Vec<Vec<f32>> = lp.to_vec2().unwrap();
    let want: Vec<Vec<f64>> = serde_json::from_value(want.clone()).unwrap();
    assert_eq!(got.len(), want.len(), "{}: rows", dir.display());
    for (g, w) in got.iter().zip(&want) {
        assert_eq!(g.len(), w.len(), "{}: positions per row", dir.display());
    }
    let mut max = 0f64;
    for (g, w) in got.iter().flatten().zip(want.iter().flatten()) {
        max = max.max((*g as f64 - w).abs());
    }
    eprintln!("{}: max |ours - transformers| = {max:e}", dir.display());
    assert!(
        max <= 1e-4,
        "{}: max |ours - transformers| = {max:e}",
        dir.display()
    );
}

#[test]
fn logprobs_match_transformers() {
    let text = std::fs::read_to_string(fixtures().join("transformers_logprobs.json")).unwrap();
    let reference: serde_json::Value = serde_json::from_str(&text).unwrap();
    let models = reference["models"].as_object().unwrap();
    assert!(models.len() >= 4);
    for (name, want) in models {
        let dir = if let Some(arch) = name.strip_prefix("init-") {
            let d = std::env::temp_dir().join(format!("grpo-parity-{name}-{}", std::process::id()));
            init_model_dir(&d, Preset::Tiny, Arch::parse(arch).unwrap(), 1).unwrap();
            d
        } else {
            fixtures().join(name)
        };
        check(&dir, want, &reference);
        if name.starts_with("init-") {
            std::fs::remove_dir_all(&dir).ok();
        }
    }
}
