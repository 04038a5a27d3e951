//! `[bema]` (TRL's `BEMACallback`): the BEMA weights written to `RUN/bema` equal the formula
//! applied to the checkpoints' weights (`EMA_t = (1 − β_t) EMA + β_t θ_t`, BEMA = `EMA_t +
//! α_t (θ_t − θ_0)`, `β_t = (ρ + γt)^−κ`, `α_t = (ρ + γt)^−η`), for a full fine-tune and for
//! LoRA's adapters; `update_after` snapshots θ_0 late; the reference takes the BEMA weights with
//! `update_ref_model`; a resumed run writes the same BEMA model; the refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::{Device, Tensor};
use grpo_rewards::RewardInput;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{Fixture, stopped_and_resumed};

fn fixture() -> Fixture {
    let f = Fixture::new().model("model", 7);
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"Count to {i}:\"}}\n"))
        .collect();
    std::fs::write(f.root.join("prompts.jsonl"), rows).unwrap();
    f
}

fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let text = format!(
        r#"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 5
[optim]
learning_rate = 5e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 2
save_steps = 1
save_total_limit = 0
shuffle_dataset = false
[[rewards]]
type = "accuracy"
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("prompts.jsonl").display(),
    );
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, text).unwrap();
    let mut cfg = config::load(&p, &[]).unwrap();
    cfg.rewards.clear();
    cfg
}

/// Share of digits in a completion.
fn digits(batch: &[RewardInput]) -> Vec<f32> {
    batch
        .iter()
        .map(|x| {
            let n = x.completion.chars().count().max(1);
            x.completion.chars().filter(char::is_ascii_digit).count() as f32 / n as f32
        })
        .collect()
}

fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    let mut s = trainer::setup(cfg).unwrap();
    std::sync::Arc::get_mut(&mut s.rewards)
        .unwrap()
        .push_reward("digits", 1.0, std::sync::Arc::new(digits));
    trainer::run(s, &opts, &mut grpo_trainer::NoCallbacks).unwrap()
}

fn tensors(p: &Path) -> HashMap<String, Tensor> {
    candle_core::safetensors::load(p, &Device::Cpu).unwrap()
}

fn max_diff(a: &Tensor, b: &Tensor) -> f32 {
    (a - b)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar()
        .unwrap()
}

/// `(β_t, α_t)` at update `t` with TRL's defaults ρ = 10, γ = 1, κ = 0.5, η = 0.2.
fn factors(t: f64) -> (f64, f64) {
    ((10.0 + t).powf(-0.5), (10.0 + t).powf(-0.2))
}

/// BEMA weights of `key` after updates `from..=to` (one per step), θ_0 the weights at `from − 1`.
fn expected(weights: &[HashMap<String, Tensor>], key: &str, from: usize) -> Tensor {
    let theta0 = &weights[from - 1][key];
    let mut ema = theta0.clone();
    let mut bema = theta0.clone();
    for (t, w) in weights.iter().enumerate().skip(from) {
        let (b, a) = factors(t as f64);
        ema = ((&ema * (1.0 - b)).unwrap() + (&w[key] * b).unwrap()).unwrap();
        bema = (&ema + ((&w[key] - theta0).unwrap() * a).unwrap()).unwrap();
    }
    bema
}

const KEYS: [&str; 3] = [
    "model.layers.0.self_attn.q_proj.weight",
    "model.layers.1.mlp.up_proj.weight",
    "model.embed_tokens.weight",
];

#[test]
fn the_bema_model_is_the_formula_over_the_weights() {
    let f = fixture();
    let r = run(
        load(&f.root, "full", 3, "[bema]\nupdate_freq = 1"),
        RunOptions::default(),
    );
    assert_eq!(r.total_steps, 3);
    let mut weights = vec![tensors(&f.root.join("model/model.safetensors"))];
    for k in 1..=3 {
        weights
            .push(tensors(&f.root.join(format!(
                "full/checkpoints/step-{k}/model/model.safetensors"
            ))));
    }
    let got = tensors(&f.root.join("full/bema/model.safetensors"));
    for key in KEYS {
        let want = expected(&weights, key, 1);
        assert!(max_diff(&got[key], &want) < 1e-6, "{key}");
        assert!(
            max_diff(&got[key], &weights[3][key]) > 1e-5,
            "{key}: not the last weights"
        );
    }
    // `update_after = 1`: θ_0 and the EMA are the weights after update 1; updates 2 and 3
    // average.
    run(
        load(
            &f.root,
            "late",
            3,
            "[bema]\nupdate_freq = 1\nupdate_after = 1",
        ),
        RunOptions::default(),
    );
    let got = tensors(&f.root.join("late/bema/model.safetensors"));
    for key in KEYS {
        let want = expected(&weights, key, 2);
        assert!(max_diff(&got[key], &want) < 1e-6, "{key} late");
    }
    // Stopped after 2 steps and resumed: the same BEMA model (the state is in checkpoints).
    let cfg = load(&f.root, "parts", 3, "[bema]\nupdate_freq = 1");
    stopped_and_resumed(2, |o| run(cfg.clone(), o));
    let parts = tensors(&f.root.join("parts/bema/model.safetensors"));
    let all = tensors(&f.root.join("full/bema/model.safetensors"));
    for key in KEYS {
        assert!(max_diff(&parts[key], &all[key]) < 1e-7, "{key} resumed");
    }
    // With updates every 400 steps nothing moves in 3: the BEMA model is the loaded one.
    run(load(&f.root, "rare", 3, "[bema]"), RunOptions::default());
    let got = tensors(&f.root.join("rare/bema/model.safetensors"));
    for key in KEYS {
        assert!(max_diff(&got[key], &weights[0][key]) < 1e-7, "{key} rare");
    }
}

#[test]
fn lora_averages_the_adapters() {
    let f = fixture();
    let lora = "[model.lora]\nr = 4\nlora_alpha = 8\n[bema]\nupdate_freq = 1";
    run(load(&f.root, "lora", 2, lora), RunOptions::default());
    let adapter = |k: usize| {
        tensors(&f.root.join(format!(
            "lora/checkpoints/step-{k}/adapter/adapter_model.safetensors"
        )))
    };
    let (a1, a2) = (adapter(1), adapter(2));
    let got = tensors(&f.root.join("lora/bema/adapter_model.safetensors"));
    assert!(f.root.join("lora/bema/adapter_config.json").exists());
    let key = a1
        .keys()
        .find(|k| k.contains("lora_B"))
        .unwrap()
        .to_string();
    // θ_0 = B's zeros at the start.
    let zeros = a1[&key].zeros_like().unwrap();
    let weights = vec![
        HashMap::from([(key.clone(), zeros)]),
        HashMap::from([(key.clone(), a1[&key].clone())]),
        HashMap::from([(key.clone(), a2[&key].clone())]),
    ];
    let want = expected(&weights, &key, 1);
    assert!(max_diff(&got[&key], &want) < 1e-6, "{key}");
    assert!(max_diff(&got[&key], &a2[&key]) > 1e-6);
}

/// With `update_ref_model` the reference takes the BEMA weights after each due update: the
/// checkpoint's reference is the BEMA state's weights, and the KL moves off the plain run's.
#[test]
fn the_reference_takes_the_bema_weights() {
    let f = fixture();
    let extra = "[reference]\nbeta = 0.1\n[bema]\nupdate_freq = 1\nupdate_ref_model = true\nref_model_update_freq = 1";
    let r = run(load(&f.root, "ref", 2, extra), RunOptions::default());
    let ck = f.root.join("ref/checkpoints/step-1");
    let reference = tensors(&ck.join("reference.safetensors"));
    let state = tensors(&ck.join("bema.safetensors"));
    for key in KEYS {
        assert!(
            max_diff(&reference[key], &state[&format!("bema/{key}")]) < 1e-7,
            "{key}"
        );
    }
    let plain = run(
        load(&f.root, "plain", 2, "[reference]\nbeta = 0.1"),
        RunOptions::default(),
    );
    assert!((r.metrics[0]["kl"] - plain.metrics[0]["kl"]).abs() < 1e-9);
    assert!((r.metrics[1]["kl"] - plain.metrics[1]["kl"]).abs() > 1e-9);
}

#[test]
fn the_refusals() {
    let f = fixture();
    for (extra, want) in [
        ("[bema]\nupdate_freq = 0", "`bema.update_freq` and"),
        ("[bema]\nema_power = -1.0", "`bema.ema_power` must be >= 0"),
        ("[bema]\nlag = -1.0", "must stay > 0"),
        (
            "[model.lora]\nr = 4\n[bema]\nupdate_ref_model = true",
            "`bema.update_ref_model` with LoRA",
        ),
    ] {
        let p = f.root.join("bad.toml");
        let cfg_text = format!(
            "output_dir = \"{}\"\n[model]\npath = \"{}\"\n[data]\npath = [\"{}\"]\n[[rewards]]\ntype = \"accuracy\"\n{extra}\n",
            f.root.join("bad").display(),
            f.root.join("model").display(),
            f.root.join("prompts.jsonl").display()
        );
        std::fs::write(&p, cfg_text).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{extra}: {e}");
    }
    // No reference to replace.
    let cfg = load(&f.root, "noref", 1, "[bema]\nupdate_ref_model = true");
    let mut s = trainer::setup(cfg).unwrap();
    std::sync::Arc::get_mut(&mut s.rewards)
        .unwrap()
        .push_reward("digits", 1.0, std::sync::Arc::new(digits));
    let e = format!(
        "{:#}",
        trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err()
    );
    assert!(e.contains("no reference model to replace"), "{e}");
}

/// The supervised trainers too: SFT's BEMA model is the formula over its checkpoints; DPO's
/// reference takes the BEMA weights.
#[test]
fn sft_and_dpo_keep_bema() {
    let f = fixture();
    let sft: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"Count to {i}:\", \"completion\": \" 1 2 {i}\"}}\n"))
        .collect();
    let dpo: String = (0..8)
        .map(|i| {
            format!(
                "{{\"prompt\": \"Count to {i}:\", \"chosen\": \" 1 2 {i}\", \"rejected\": \" no\"}}\n"
            )
        })
        .collect();
    std::fs::write(f.root.join("sft.jsonl"), sft).unwrap();
    std::fs::write(f.root.join("dpo.jsonl"), dpo).unwrap();
    let cfg = |algorithm: &str, out: &str, extra: &str| {
        let text = format!(
            "algorithm = \"{algorithm}\"\noutput_dir = \"{}\"\n[model]\npath = \"{}\"\n[data]\npath = [\"{}\"]\n[optim]\nlearning_rate = 5e-3\n[train]\nmax_steps = 2\nprompts_per_step = 4\nsave_steps = 1\nsave_total_limit = 0\n{extra}\n",
            f.root.join(out).display(),
            f.root.join("model").display(),
            f.root.join(format!("{algorithm}.jsonl")).display(),
        );
        let p = f.root.join(format!("{out}.toml"));
        std::fs::write(&p, text).unwrap();
        config::load(&p, &[]).unwrap()
    };
    let s = trainer::setup(cfg("sft", "sft-run", "[bema]\nupdate_freq = 1")).unwrap();
    trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap();
    let mut weights = vec![tensors(&f.root.join("model/model.safetensors"))];
    for k in 1..=2 {
        weights.push(tensors(&f.root.join(format!(
            "sft-run/checkpoints/step-{k}/model/model.safetensors"
        ))));
    }
    let got = tensors(&f.root.join("sft-run/bema/model.safetensors"));
    for key in KEYS {
        assert!(
            max_diff(&got[key], &expected(&weights, key, 1)) < 1e-6,
            "sft {key}"
        );
    }
    let extra = "[bema]\nupdate_freq = 1\nupdate_ref_model = true\nref_model_update_freq = 1";
    let s = trainer::setup(cfg("dpo", "dpo-run", extra)).unwrap();
    trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap();
    let ck = f.root.join("dpo-run/checkpoints/step-2");
    let (reference, state) = (
        tensors(&ck.join("reference.safetensors")),
        tensors(&ck.join("bema.safetensors")),
    );
    for key in KEYS {
        assert!(
            max_diff(&reference[key], &state[&format!("bema/{key}")]) < 1e-7,
            "dpo {key}"
        );
    }
}
