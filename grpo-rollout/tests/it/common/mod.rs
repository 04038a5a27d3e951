//! Fixtures and helpers shared by grpo-rollout's test binaries (each uses some of them).
#![allow(dead_code)]

use candle_core::{Device, Tensor};

/// GRPO's shared-prompt batch: two distinct prompts (left-padded ids and mask), four
/// completions (right-padded ids and mask) and the prompt each completion continues.
pub struct SharedPromptBatch {
    pub pids: Tensor,
    pub pmask: Tensor,
    pub prompt_of: Vec<u32>,
    pub cid: Tensor,
    pub cmask: Tensor,
}

pub fn shared_prompt_batch() -> SharedPromptBatch {
    let dev = Device::Cpu;
    let prompts: Vec<Vec<u32>> = vec![vec![5, 9, 2, 33], vec![8, 3, 20, 11, 44, 1, 7]];
    let (pids, pmask) = grpo_rollout::generate::left_pad(&prompts, 0, &dev).unwrap();
    let comps: Vec<Vec<u32>> = vec![vec![12, 40, 3], vec![9, 9, 27, 5], vec![31], vec![4, 22]];
    let cl = comps.iter().map(|c| c.len()).max().unwrap();
    let (mut cid, mut cmask) = (Vec::new(), Vec::new());
    for c in &comps {
        for j in 0..cl {
            cid.push(c.get(j).copied().unwrap_or(0));
            cmask.push(u32::from(j < c.len()));
        }
    }
    SharedPromptBatch {
        pids,
        pmask,
        prompt_of: vec![0, 1, 1, 0],
        cid: Tensor::from_vec(cid, (comps.len(), cl), &dev).unwrap(),
        cmask: Tensor::from_vec(cmask, (comps.len(), cl), &dev).unwrap(),
    }
}

/// The fixtures directory.
pub fn fixtures() -> std::path::PathBuf {
    std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures")
}

/// A reference JSON file of the fixtures directory.
pub fn reference(file: &str) -> serde_json::Value {
    let text = std::fs::read_to_string(fixtures().join(file)).unwrap();
    serde_json::from_str(&text).unwrap()
}

/// The log-probs `(B, t)` of the reference's `rows` left-padded, their last `t` tokens, as the
/// reference scripts compute them (per-row position ids).
pub fn padded_logprobs(m: &grpo_rollout::Transformer, r: &serde_json::Value) -> Tensor {
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let (ids, mask) = grpo_rollout::generate::left_pad(&rows, 0, &Device::Cpu).unwrap();
    let t = r["t"].as_u64().unwrap() as usize;
    m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap().0
}

/// A tensor's values as f64, flattened.
pub fn to_f64(t: &Tensor) -> Vec<f64> {
    t.to_dtype(candle_core::DType::F64)
        .unwrap()
        .flatten_all()
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The largest absolute difference of two equally long slices.
pub fn max_diff_f64(a: &[f64], b: &[f64]) -> f64 {
    assert_eq!(a.len(), b.len());
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0f64, f64::max)
}

/// The gradient of the trainable weight `name` in `grads`, as f64.
pub fn var_grad(
    tm: &grpo_rollout::TrainableModel,
    grads: &candle_core::backprop::GradStore,
    name: &str,
) -> Vec<f64> {
    let v = &tm.vars.iter().find(|(n, _)| n == name).unwrap().1;
    let g = grads
        .get(v.as_tensor())
        .unwrap_or_else(|| panic!("no gradient reached {name}"));
    to_f64(g)
}

/// The model's greedy continuation of `prompt`, `n` tokens, through the KV cache (no stop
/// token: transformers' `generate(do_sample=False, eos_token_id=None)`).
pub fn greedy(m: &grpo_rollout::LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let params = grpo_rollout::SamplingParams {
        max_new_tokens: n,
        temperature: 0.0,
        stop_token_ids: Vec::new(),
        ..Default::default()
    };
    let prompts = [prompt.to_vec()];
    let out = grpo_rollout::generate(&m.model, &m.tokenizer, &prompts, 1, &params).unwrap();
    out[0].token_ids.clone()
}

/// Our LoRA `all-linear` on `base` adapts and names the same modules as PEFT's adapter at
/// `peft`, with tensors of PEFT's names and shapes.
pub fn all_linear_like_peft(base: &grpo_rollout::Transformer, peft: &std::path::Path) {
    let lcfg = grpo_rollout::lora::LoraConfig {
        target_modules: grpo_rollout::lora::TargetModules::Pattern("all-linear".into()),
        r: 2,
        ..Default::default()
    };
    let tm = grpo_rollout::TrainableModel::lora(base, &lcfg, 3).unwrap();
    let dir = tempfile::tempdir().unwrap();
    grpo_rollout::lora::save_peft(&tm.model, tm.lora.as_ref().unwrap(), dir.path(), "base")
        .unwrap();
    let targets = |d: &std::path::Path| -> Vec<String> {
        let text = std::fs::read_to_string(d.join("adapter_config.json")).unwrap();
        let v: serde_json::Value = serde_json::from_str(&text).unwrap();
        let mut t: Vec<String> = serde_json::from_value(v["target_modules"].clone()).unwrap();
        t.sort();
        t
    };
    assert_eq!(targets(dir.path()), targets(peft));
    let tensors = |d: &std::path::Path| {
        candle_core::safetensors::load(d.join("adapter_model.safetensors"), &Device::Cpu).unwrap()
    };
    let (ours, theirs) = (tensors(dir.path()), tensors(peft));
    let mut k: Vec<&String> = ours.keys().collect();
    k.sort();
    let mut want_k: Vec<&String> = theirs.keys().collect();
    want_k.sort();
    assert_eq!(k, want_k);
    for (name, t) in &theirs {
        assert_eq!(t.dims(), ours[name].dims(), "{name}");
    }
}

/// transformers' gradient of a layer's fused experts (`….experts.gate_up_proj` `(experts, 2 ·
/// width, hidden)`, gate rows first, or `….experts.down_proj`), named as the model names the
/// layer's tensors, as the model's per-expert `gate_proj` / `up_proj` / `down_proj` gradients;
/// `None` for another name.
pub fn fused_expert_grads(
    name: &str,
    g: &[f64],
    experts: usize,
) -> Option<Vec<(String, Vec<f64>)>> {
    if let Some(block) = name.strip_suffix(".experts.gate_up_proj") {
        let half = g.len() / experts / 2;
        let mut out = Vec::new();
        for (x, rows) in g.chunks(2 * half).enumerate() {
            for (part, want) in ["gate_proj", "up_proj"].iter().zip(rows.chunks(half)) {
                out.push((format!("{block}.experts.{x}.{part}.weight"), want.to_vec()));
            }
        }
        return Some(out);
    }
    let block = name.strip_suffix(".experts.down_proj")?;
    Some(
        g.chunks(g.len() / experts)
            .enumerate()
            .map(|(x, want)| {
                (
                    format!("{block}.experts.{x}.down_proj.weight"),
                    want.to_vec(),
                )
            })
            .collect(),
    )
}

/// Gradients by the model's tensor names.
pub type Grads = Vec<(String, Vec<f64>)>;

/// `got` within `tol` of `want`'s largest entry (or of 1).
pub fn close(got: &[f64], want: &[f64], tol: f64, what: &str) {
    let scale = want.iter().fold(0f64, |m, x| m.max(x.abs()));
    let d = max_diff_f64(got, want);
    assert!(d <= tol * scale.max(1.0), "{what}: {d} of {scale}");
}

/// The gradients of the padded rows' log-prob sum ([`padded_logprobs`]) against the
/// reference's `key` (transformers' tensor names), with and without gradient checkpointing,
/// each within `tol` of its largest entry; `as_model` gives a transformers tensor's gradient as
/// the model's (name, gradient) pairs.
pub fn check_grads(
    model: &grpo_rollout::Transformer,
    r: &serde_json::Value,
    key: &str,
    tol: f64,
    as_model: &dyn Fn(&str, Vec<f64>) -> Grads,
) {
    let serde_json::Value::Object(want) = &r[key] else {
        panic!("{key}")
    };
    for checkpointing in [false, true] {
        let mut tm = grpo_rollout::TrainableModel::full(model).unwrap();
        if checkpointing {
            tm.model.enable_gradient_checkpointing();
        }
        let loss = padded_logprobs(&tm.model, r).sum_all().unwrap();
        let grads = tm.model.backward(&loss).unwrap();
        for (name, g) in want {
            let g: Vec<f64> = serde_json::from_value(g.clone()).unwrap();
            for (n, want) in as_model(name, g) {
                let what = format!("{key} {n} ({checkpointing})");
                close(&var_grad(&tm, &grads, &n), &want, tol, &what);
            }
        }
    }
}

/// The log-probs (f64) of the last `t` tokens of each of the reference's `rows`, run alone.
pub fn logprobs_alone(m: &grpo_rollout::Transformer, r: &serde_json::Value) -> Vec<Vec<f64>> {
    let rows: Vec<Vec<u32>> = serde_json::from_value(r["rows"].clone()).unwrap();
    let t = r["t"].as_u64().unwrap() as usize;
    rows.iter()
        .map(|row| {
            let (ids, mask) =
                grpo_rollout::generate::left_pad(std::slice::from_ref(row), 0, &Device::Cpu)
                    .unwrap();
            to_f64(&m.completion_logprobs(&ids, &mask, t, 1.0, false).unwrap().0)
        })
        .collect()
}
