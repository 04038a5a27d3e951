//! `[merge]` (TRL's `MergeModelCallback`) and `grpo-cli merge`: the last checkpoint (or each,
//! with `merge_at_every_checkpoint`) gets `merged/`, the policy merged with the starting model
//! as TRL's `MergeConfig` says — linear at 0.5 / 0.5 in float16 by default, a LoRA policy's
//! merged weights; `grpo-cli merge` runs a mergekit YAML; the refusals.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::path::Path;

use candle_core::{DType, Device, Tensor};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{Fixture, grpo_cli_ok};

fn fixture() -> Fixture {
    let f = Fixture::new().model("model", 7).model("other", 9);
    let rows: String = (0..8)
        .map(|i| format!("{{\"prompt\": \"Count to {i}:\", \"completion\": \" {i}\"}}\n"))
        .collect();
    std::fs::write(f.root.join("rows.jsonl"), rows).unwrap();
    f
}

fn load(root: &Path, out: &str, extra: &str) -> TrainConfig {
    let text = format!(
        r#"
algorithm = "sft"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[optim]
learning_rate = 5e-2
[train]
max_steps = 2
per_device_train_batch_size = 4
save_steps = 1
save_total_limit = 0
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("rows.jsonl").display(),
    );
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, text).unwrap();
    config::load(&p, &[]).unwrap()
}

fn run(cfg: TrainConfig) {
    let s = trainer::setup(cfg).unwrap();
    trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap();
}

fn weights(dir: &Path) -> HashMap<String, Tensor> {
    grpo_rollout::loader::read_safetensors(dir, &Device::Cpu).unwrap()
}

/// The largest difference between `got` and `want(name)`, both read in f32.
fn max_diff(got: &HashMap<String, Tensor>, want: impl Fn(&str) -> Tensor) -> f32 {
    got.iter()
        .map(|(k, t)| {
            let a = t.to_dtype(DType::F32).unwrap();
            let b = want(k).to_dtype(DType::F32).unwrap();
            (a - b)
                .unwrap()
                .abs()
                .unwrap()
                .max_all()
                .unwrap()
                .to_scalar::<f32>()
                .unwrap()
        })
        .fold(0.0, f32::max)
}

#[test]
fn the_last_checkpoint_gets_trls_linear_merge() {
    let f = fixture();
    run(load(&f.root, "lin", "[merge]\n"));
    let ck = f.root.join("lin/checkpoints");
    assert!(
        !ck.join("step-1/merged").exists(),
        "only the last checkpoint merges"
    );
    let merged = weights(&ck.join("step-2/merged"));
    let (policy, start) = (
        weights(&ck.join("step-2/model")),
        weights(&f.root.join("model")),
    );
    assert!(merged.values().all(|t| t.dtype() == DType::F16));
    // (θ_policy + θ_start) / 2 in float16, as TRL's default MergeConfig.
    let d = max_diff(&merged, |k| {
        ((&policy[k] + &start[k]).unwrap() * 0.5).unwrap()
    });
    assert!(d < 2e-3, "max diff {d}");
    // The policy moved: the merge is not the start.
    let moved = max_diff(&policy, |k| start[k].clone());
    assert!(moved > 1e-2, "{moved}");
    let cfg: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("step-2/merged/config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(cfg["torch_dtype"], "float16");
    assert!(ck.join("step-2/merged/tokenizer.json").exists());
    grpo_rollout::load(&ck.join("step-2/merged"), DType::F32, &Device::Cpu).unwrap();
}

/// LoRA, every checkpoint: the policy (base + adapter, merged) at weight 1 and the target
/// (another model) at 0 gives the policy's merged weights, which `grpo-cli export --format
/// merged` also writes.
#[test]
fn a_lora_policy_merges_at_every_checkpoint() {
    let f = fixture();
    let lora = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n";
    let extra = format!(
        "[merge]\nmerge_at_every_checkpoint = true\npolicy_model_weight = 1.0\n\
         target_model_weight = 0.0\ndtype = \"float32\"\ntarget_model_path = \"{}\"\n{lora}",
        f.root.join("other").display()
    );
    run(load(&f.root, "lora", &extra));
    for step in [1, 2] {
        let ck = f.root.join(format!("lora/checkpoints/step-{step}"));
        assert!(ck.join("adapter").exists() && !ck.join("merged/.policy-merged").exists());
        assert!(!ck.join(".policy-merged").exists());
        let out = f.root.join(format!("export-{step}"));
        grpo_cli_ok(&[
            "export",
            "--checkpoint",
            ck.to_str().unwrap(),
            "--format",
            "merged",
            "--out",
            out.to_str().unwrap(),
        ]);
        let (merged, exported) = (weights(&ck.join("merged")), weights(&out));
        let d = max_diff(&merged, |k| exported[k].clone());
        assert!(d < 1e-6, "step {step}: {d}");
        let base = weights(&f.root.join("model"));
        assert!(
            max_diff(&merged, |k| base[k].clone()) > 1e-4,
            "the adapter is merged in"
        );
    }
}

#[test]
fn grpo_cli_merge_runs_a_mergekit_yaml() {
    let f = fixture();
    let yml = f.root.join("m.yml");
    std::fs::write(
        &yml,
        format!(
            "merge_method: slerp\nbase_model: {a}\nmodels:\n  - model: {a}\n  - model: {b}\n\
             parameters:\n  t:\n    - filter: self_attn\n      value: [0.0, 1.0]\n    - value: 0.0\n\
             dtype: float32\n",
            a = f.root.join("model").display(),
            b = f.root.join("other").display()
        ),
    )
    .unwrap();
    let out = f.root.join("m-out");
    let o = grpo_cli_ok(&[
        "merge",
        "--config",
        yml.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(String::from_utf8_lossy(&o.stdout).contains("merged"));
    let (m, a, b) = (
        weights(&out),
        weights(&f.root.join("model")),
        weights(&f.root.join("other")),
    );
    // t = 0 outside the attention: the base; the last layer's attention at t = 1: the other.
    let last = m
        .keys()
        .filter_map(|k| k.split('.').nth(2)?.parse::<usize>().ok())
        .max()
        .unwrap();
    for (k, t) in &m {
        let want = if k.contains("self_attn") && k.contains(&format!("layers.{last}.")) {
            &b[k]
        } else if k.contains("self_attn") && k.contains("layers.0.") {
            &a[k]
        } else if k.contains("self_attn") {
            continue;
        } else {
            &a[k]
        };
        let d = (t - want)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar::<f32>()
            .unwrap();
        assert!(d < 1e-6, "{k}: {d}");
    }
    // A bad file is one line naming it and the field.
    std::fs::write(&yml, "merge_method: karcher\nmodels: []\n").unwrap();
    let o = std::process::Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args([
            "merge",
            "--config",
            yml.to_str().unwrap(),
            "--out",
            out.to_str().unwrap(),
        ])
        .output()
        .unwrap();
    let e = String::from_utf8_lossy(&o.stderr);
    assert!(
        !o.status.success()
            && e.contains("m.yml")
            && e.contains("merge_method")
            && e.trim().lines().count() == 1,
        "{e}"
    );
}

#[test]
fn what_merge_cannot_take_is_refused() {
    let f = fixture();
    for (extra, want) in [
        (
            "[merge]\nmethod = \"ties\"\nt_values = 0.3\n",
            "`merge.t_values` is slerp's only setting",
        ),
        (
            "[merge]\nmethod = \"slerp\"\nt_values = 1.5\n",
            "`merge.t_values` must be in [0, 1]",
        ),
        (
            "[merge]\ndtype = \"int8\"\n",
            "`merge.dtype` must be float16, bfloat16 or float32",
        ),
        (
            "[merge]\ntarget_model_path = \"/nonexistent\"\n",
            "has no config.json",
        ),
        ("[merge]\nmethod = \"karcher\"\n", "merge.method"),
        ("[merge]\npush_to_hub = true\n", "push_to_hub"),
    ] {
        let p = f.root.join("bad.toml");
        let text = std::fs::read_to_string(f.root.join("lin.toml")).unwrap_or_else(|_| {
            load(&f.root, "lin", "");
            std::fs::read_to_string(f.root.join("lin.toml")).unwrap()
        });
        std::fs::write(&p, format!("{text}\n{extra}")).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{extra}: {e}");
    }
}
