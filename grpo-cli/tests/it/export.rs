//! `grpo-cli export`: a LoRA checkpoint merged into its base as a Hugging Face directory gives
//! the log-probs of base + adapter; full-weight checkpoints export as they are; bad requests
//! are one-line errors.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device};
use grpo_data::synth::ArithmeticConfig;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions};

fn train(root: &Path, name: &str, extra: &str) -> std::path::PathBuf {
    if !root.join("model").exists() {
        init_model_dir(&root.join("model"), Preset::Tiny, Arch::Qwen2, 6).unwrap();
        let synth = ArithmeticConfig {
            n: 16,
            seed: 3,
            digits: 1,
            steps: 1,
        };
        synth.write(&root.join("d.jsonl")).unwrap();
    }
    let text = format!(
        "output_dir = \"{out}\"\n[model]\npath = \"{model}\"\n{extra}\n[data]\npath = [\"{data}\"]\n[rollout]\nnum_generations = 4\nmax_completion_length = 6\n[[rewards]]\ntype = \"format\"\npattern = '(?s).*\\d.*'\n[optim]\nlearning_rate = 5e-2\n[train]\nmax_steps = 3\nprompts_per_step = 2\n",
        out = root.join(name).display(),
        model = root.join("model").display(),
        data = root.join("d.jsonl").display(),
    );
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, text).unwrap();
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    let r = trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap();
    r.best_checkpoint_path.unwrap()
}

fn export(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .arg("export")
        .args(args)
        .output()
        .unwrap()
}

fn logps(model: &grpo_rollout::Transformer) -> Vec<f32> {
    let prompt: Vec<u32> = (5..21).collect();
    let completion: Vec<u32> = (30..42).collect();
    let (lp, _, _) =
        trainer::completion_logps(model, 0, &[&prompt], &[&completion], 1.0, false).unwrap();
    lp.flatten_all().unwrap().to_vec1().unwrap()
}

fn max_diff(a: &[f32], b: &[f32]) -> f32 {
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

#[test]
fn a_lora_checkpoint_exports_merged() {
    let dir = tempfile::tempdir().unwrap();
    let ck = train(
        dir.path(),
        "lora",
        "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\", \"up_proj\"]",
    );
    let out = dir.path().join("merged");
    let o = export(&[
        "--checkpoint",
        ck.to_str().unwrap(),
        "--format",
        "merged",
        "--out",
        out.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let merged = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    let mut adapted =
        grpo_rollout::load(&dir.path().join("model"), DType::F32, &Device::Cpu).unwrap();
    let base = logps(&adapted.model);
    grpo_rollout::lora::load_peft(&mut adapted.model, &ck.join("adapter")).unwrap();
    let (a, m) = (logps(&adapted.model), logps(&merged.model));
    assert!(max_diff(&a, &m) < 1e-5, "{}", max_diff(&a, &m));
    assert!(max_diff(&a, &base) > 1e-4, "the adapter learned nothing");
    assert!(out.join("tokenizer.json").exists() && out.join("config.json").exists());

    // The same checkpoint as GGUF: f32 reads back as the merged model, q8_0 within its error.
    for (quant, tol) in [(None, 1e-5), (Some("q8_0"), 0.05)] {
        let path = dir
            .path()
            .join(format!("m-{}.gguf", quant.unwrap_or("f32")));
        let mut args = vec![
            "--checkpoint",
            ck.to_str().unwrap(),
            "--format",
            "gguf",
            "--out",
            path.to_str().unwrap(),
        ];
        if let Some(q) = quant {
            args.extend(["--quant", q]);
        }
        let o = export(&args);
        assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
        assert!(String::from_utf8_lossy(&o.stdout).contains("tensors"));
        let g = grpo_rollout::load(&path, DType::F32, &Device::Cpu).unwrap();
        let d = max_diff(&a, &logps(&g.model));
        assert!(d < tol, "{quant:?}: {d}");
    }
    let o = export(&[
        "--checkpoint",
        ck.to_str().unwrap(),
        "--format",
        "gguf",
        "--quant",
        "q2_k",
        "--out",
        "x.gguf",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("unknown quantisation `q2_k`"));
}

#[test]
fn full_checkpoints_export_and_bad_requests_fail_clearly() {
    let dir = tempfile::tempdir().unwrap();
    let ck = train(dir.path(), "full", "");
    let out = dir.path().join("hf");
    let o = export(&[
        "--checkpoint",
        ck.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        "--dtype",
        "bf16",
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let a = grpo_rollout::load(&ck.join("model"), DType::F32, &Device::Cpu).unwrap();
    let b = grpo_rollout::load(&out, DType::F32, &Device::Cpu).unwrap();
    // bf16 storage: close to the f32 checkpoint, not equal.
    let d = max_diff(&logps(&a.model), &logps(&b.model));
    assert!(d < 0.05, "{d}");
    for (args, want) in [
        (vec!["--format", "merged"], "no LoRA adapter to merge"),
        (
            vec!["--format", "gguf"],
            "a GGUF export is one file ending in .gguf",
        ),
        (vec!["--quant", "q8_0"], "--quant: only with --format gguf"),
        (vec!["--format", "onnx"], "unknown format `onnx`"),
    ] {
        let mut all = vec![
            "--checkpoint",
            ck.to_str().unwrap(),
            "--out",
            "/nonexistent/x",
        ];
        all.extend(args);
        let o = export(&all);
        assert!(!o.status.success());
        let err = String::from_utf8_lossy(&o.stderr);
        assert!(err.contains(want) && err.lines().count() == 1, "{err}");
    }
    // A model directory exports as it is (here to an f16 GGUF).
    let g = dir.path().join("base-f16.gguf");
    let o = export(&[
        "--checkpoint",
        dir.path().join("model").to_str().unwrap(),
        "--format",
        "gguf",
        "--dtype",
        "f16",
        "--out",
        g.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let base = grpo_rollout::load(&dir.path().join("model"), DType::F32, &Device::Cpu).unwrap();
    let d = max_diff(
        &logps(&base.model),
        &logps(
            &grpo_rollout::load(&g, DType::F32, &Device::Cpu)
                .unwrap()
                .model,
        ),
    );
    assert!(d < 5e-3, "{d}");
    // A run directory is not a checkpoint.
    let run_dir = dir.path().join("full");
    let o = export(&[
        "--checkpoint",
        run_dir.to_str().unwrap(),
        "--out",
        "/nonexistent/x",
    ]);
    assert!(String::from_utf8_lossy(&o.stderr).contains("no `model/` or `adapter/` directory"));
}
