//! SFT and DPO on the shared learner: a tiny SFT run lowers the loss, a tiny DPO run raises the
//! reward margin and accuracy, assistant-only masks of conversations, exact resume, the
//! `sft` / `dpo` subcommands.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{eval_lines, first_rows, grpo_cli_ok};

fn write_data(root: &Path) {
    let mut sft = String::new();
    let mut dpo = String::new();
    let mut kto = String::new();
    for i in 0..16 {
        // Unpaired, labelled: the right answer is desirable, a wrong one is not.
        let (answer, good) = if i % 2 == 0 {
            (i + 1, true)
        } else {
            (i + 7, false)
        };
        kto.push_str(&format!(
            "{{\"prompt\": \"What is {i} + 1?\", \"completion\": \" {answer}\", \"label\": {good}}}\n"
        ));
        sft.push_str(&format!(
            "{{\"prompt\": \"What is {i} + 1?\", \"completion\": \" {}\"}}\n",
            i + 1
        ));
        dpo.push_str(&format!(
            "{{\"prompt\": \"Question {i}:\", \"chosen\": \" yes, gladly\", \"rejected\": \" no\"}}\n"
        ));
    }
    std::fs::write(root.join("sft.jsonl"), sft).unwrap();
    std::fs::write(root.join("dpo.jsonl"), dpo).unwrap();
    std::fs::write(root.join("kto.jsonl"), kto).unwrap();
    let chat = r#"{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "and then?"}, {"role": "assistant", "content": "goodbye now"}]}"#;
    std::fs::write(root.join("chat.jsonl"), format!("{chat}\n{chat}\n")).unwrap();
}

/// A temporary directory with a tiny `model` of `arch` and the test data files.
fn fixture(arch: Arch) -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, arch, 4).unwrap();
    write_data(dir.path());
    dir
}

fn config_text(root: &Path, name: &str, algorithm: &str, steps: usize, extra: &str) -> String {
    let data = match algorithm {
        "dpo" | "orpo" | "cpo" | "tpo" => "dpo.jsonl",
        "kto" | "bco" => "kto.jsonl",
        _ => "sft.jsonl",
    };
    format!(
        r#"
algorithm = "{algorithm}"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[optim]
learning_rate = 1e-2
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
per_device_train_batch_size = 2
save_steps = 2
{extra}
"#,
        out = root.join(name).display(),
        model = root.join("model").display(),
        data = root.join(data).display(),
    )
}

fn setup(root: &Path, name: &str, algorithm: &str, steps: usize, extra: &str) -> trainer::Setup {
    if !root.join("model").exists() {
        init_model_dir(&root.join("model"), Preset::Tiny, Arch::Llama, 4).unwrap();
        write_data(root);
    }
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, config_text(root, name, algorithm, steps, extra)).unwrap();
    trainer::setup(config::load(&p, &[]).unwrap()).unwrap()
}

/// The one-line error of loading a config with `extra` (a name under the test directory).
fn config_error(root: &Path, algorithm: &str, extra: &str) -> String {
    let bad = root.join("bad.toml");
    std::fs::write(&bad, config_text(root, "bad", algorithm, 1, extra)).unwrap();
    format!("{:#}", config::load(&bad, &[]).unwrap_err())
}

/// A setup from config `text` written to `path`.
fn setup_text(path: &Path, text: String) -> trainer::Setup {
    std::fs::write(path, text).unwrap();
    trainer::setup(config::load(path, &[]).unwrap()).unwrap()
}

fn run(s: trainer::Setup, opts: &RunOptions) -> grpo_trainer::TrainingResult {
    trainer::run(s, opts, &mut grpo_trainer::NoCallbacks).unwrap()
}

fn mean(ms: &[grpo_trainer::Metrics], k: &str) -> f64 {
    ms.iter().map(|m| m[k]).sum::<f64>() / ms.len() as f64
}

#[test]
fn a_tiny_sft_run_lowers_the_loss() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(
        setup(dir.path(), "sft", "sft", 24, ""),
        &RunOptions::default(),
    );
    assert_eq!(r.total_steps, 24);
    let (first, last) = (
        mean(&r.metrics[..4], "loss"),
        mean(&r.metrics[20..], "loss"),
    );
    assert!(last < 0.5 * first, "loss {first} -> {last}");
    assert!(r.metrics.iter().all(|m| m["grad_norm"].is_finite()));
    assert!(
        r.best_checkpoint_path
            .unwrap()
            .join("model/model.safetensors")
            .exists()
    );
}

#[test]
fn a_tiny_dpo_run_raises_the_margin_and_the_accuracy() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(
        setup(
            dir.path(),
            "dpo",
            "dpo",
            16,
            "[dpo]\nbeta = 0.5\nprecompute_ref_log_probs = true",
        ),
        &RunOptions::default(),
    );
    let m0 = &r.metrics[0];
    // The first step's policy is the reference: every reward is 0.
    assert!(m0["rewards/chosen"].abs() < 1e-5 && m0["rewards/margins"].abs() < 1e-5);
    assert!((m0["loss"] - std::f64::consts::LN_2).abs() < 1e-5, "{m0:?}");
    let last = r.metrics.last().unwrap();
    assert!(last["rewards/margins"] > 1.0, "{last:?}");
    assert_eq!(last["rewards/accuracies"], 1.0);
    assert!(last["loss"] < 0.3, "{last:?}");
    for k in ["rewards/rejected", "logps/chosen", "logps/rejected"] {
        assert!(last[k].is_finite(), "{k}");
    }
}

/// WPO (`use_weighting`): at the first step the policy is the reference, so each pair's
/// sigmoid loss is ln 2 and the step's loss is ln 2 times the mean pair weight — computed here
/// from the model's full softmax, row by row.
#[test]
fn dpo_wpo_weights_the_first_step_by_the_policy_probabilities() {
    let dir = tempfile::tempdir().unwrap();
    drop(setup(dir.path(), "first", "dpo", 1, ""));
    let text = config_text(dir.path(), "wpo", "dpo", 3, "[dpo]\nuse_weighting = true")
        .replace("prompts_per_step = 4", "prompts_per_step = 16");
    let s = setup_text(&dir.path().join("wpo.toml"), text);
    let samples = first_rows(&s.train, 16);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    let m = s.policy.model.detached();
    let weight = |prompt: &[u32], completion: &[u32]| -> f64 {
        let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
        let n = ids.len();
        let dev = candle_core::Device::Cpu;
        let t = candle_core::Tensor::from_vec(ids, (1, n), &dev).unwrap();
        let mask = candle_core::Tensor::ones((1, n), candle_core::DType::U32, &dev).unwrap();
        let k = completion.len();
        let h = m.forward_padded(&t, &mask).unwrap();
        let hs = h.dim(2).unwrap();
        let h = h.narrow(1, n - k - 1, k).unwrap().reshape((k, hs)).unwrap();
        let logits: Vec<Vec<f32>> = m.logits(&h).unwrap().to_vec2().unwrap();
        let mut sum = 0.0;
        for (j, z) in logits.iter().enumerate() {
            let z: Vec<f64> = z.iter().map(|&v| f64::from(v)).collect();
            let mx = z.iter().cloned().fold(f64::MIN, f64::max);
            let s1: f64 = z.iter().map(|v| (v - mx).exp()).sum();
            let s2: f64 = z.iter().map(|v| (2.0 * (v - mx)).exp()).sum();
            let logp = z[completion[j] as usize] - mx - s1.ln();
            sum += logp - (s2.ln() - 2.0 * s1.ln());
        }
        (sum / k as f64).exp()
    };
    let w: Vec<f64> = rows
        .iter()
        .map(|r| weight(&r.prompt, &r.completion) * weight(&r.prompt, &r.rejected))
        .collect();
    let want = std::f64::consts::LN_2 * w.iter().sum::<f64>() / w.len() as f64;
    let r = run(s, &RunOptions::default());
    let got = r.metrics[0]["loss"];
    assert!(
        (got - want).abs() < 1e-5 * want,
        "WPO first-step loss {got}, expected {want}"
    );
    assert!(
        (got - std::f64::consts::LN_2).abs() > 1e-3,
        "the weights changed nothing"
    );
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
    // aot sorts the pairs: WPO's per-pair weights are refused, as in TRL.
    let e = config_error(
        dir.path(),
        "dpo",
        "[dpo]\nuse_weighting = true\nloss_type = \"aot\"",
    );
    assert!(e.contains("use_weighting") && e.contains("aot"), "{e}");
}

#[test]
fn resume_is_exact_for_sft_and_dpo() {
    let dir = tempfile::tempdir().unwrap();
    // DPO with TR-DPO's reference sync: the synced reference is part of the checkpoint.
    let sync = "[reference]\nsync_ref_model = true\nref_model_mixup_alpha = 0.5\nref_model_sync_steps = 1\n";
    let lora = "[model.lora]\nr = 4\nlora_alpha = 8\n";
    for (alg, extra) in [
        ("sft", ""),
        ("dpo", ""),
        ("dpo", sync),
        ("kto", ""),
        ("orpo", ""),
        ("cpo", lora),
    ] {
        let tag = if extra.is_empty() {
            alg.to_string()
        } else {
            format!("{alg}-{}", extra.len())
        };
        let straight = run(
            setup(dir.path(), &format!("{tag}-all"), alg, 4, extra),
            &RunOptions::default(),
        );
        let name = format!("{tag}-parts");
        let first = run(
            setup(dir.path(), &name, alg, 4, extra),
            &RunOptions {
                stop_after: Some(2),
                ..Default::default()
            },
        );
        assert!(first.interrupted);
        let rest = run(
            setup(dir.path(), &name, alg, 4, extra),
            &RunOptions {
                resume: Some(None),
                ..Default::default()
            },
        );
        let joined: Vec<f64> = first
            .metrics
            .iter()
            .chain(&rest.metrics)
            .map(|m| m["loss"])
            .collect();
        let all: Vec<f64> = straight.metrics.iter().map(|m| m["loss"]).collect();
        assert_eq!(joined, all, "{tag}");
    }
}

#[test]
fn conversations_train_on_assistant_turns_only() {
    let dir = fixture(Arch::Qwen2);
    let text = config_text(dir.path(), "chat", "sft", 2, "").replace("sft.jsonl", "chat.jsonl")
        + "\n[sft]\nmax_length = 512\nassistant_only_loss = true\n";
    let text = text.replace("[data]\n", "[data]\nprompt_field = \"messages\"\n");
    let s = setup_text(&dir.path().join("chat.toml"), text);
    let samples = first_rows(&s.train, 2);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    let r = &rows[0];
    let kept: Vec<u32> = r
        .completion
        .iter()
        .zip(&r.mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect();
    let dropped: Vec<u32> = r
        .completion
        .iter()
        .zip(&r.mask)
        .filter(|(_, m)| **m == 0)
        .map(|(t, _)| *t)
        .collect();
    let kept = s.tokenizer.decode(&kept, false).unwrap();
    let dropped = s.tokenizer.decode(&dropped, false).unwrap();
    assert!(
        kept.contains("hello friend") && kept.contains("goodbye now"),
        "{kept:?}"
    );
    assert!(
        !kept.contains("and then?") && !kept.contains("hi there"),
        "{kept:?}"
    );
    assert!(dropped.contains("and then?"), "{dropped:?}");
    let prompt = s.tokenizer.decode(&r.prompt, false).unwrap();
    assert!(
        prompt.contains("hi there") && !prompt.contains("hello friend"),
        "{prompt:?}"
    );
    // And it trains.
    let res = run(s, &RunOptions::default());
    assert!(res.metrics.iter().all(|m| m["loss"].is_finite()));
}

#[test]
fn sft_and_dpo_subcommands() {
    let dir = fixture(Arch::Llama);
    for alg in ["sft", "dpo", "kto", "orpo", "cpo"] {
        // The config says grpo; the subcommand decides.
        let text =
            config_text(dir.path(), alg, alg, 2, "").replace(&format!("algorithm = \"{alg}\""), "");
        let p = dir.path().join(format!("{alg}.toml"));
        std::fs::write(&p, text).unwrap();
        let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
            .args([alg, "--config", p.to_str().unwrap()])
            .output()
            .unwrap();
        let stdout = String::from_utf8_lossy(&out.stdout);
        assert!(
            out.status.success(),
            "{alg}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        assert!(stdout.contains("trained 2 steps; loss"), "{stdout}");
        let metrics = std::fs::read_to_string(dir.path().join(alg).join("metrics.jsonl")).unwrap();
        assert_eq!(metrics.lines().count(), 2);
        // The same curves as GRPO runs, with the algorithm's metrics.
        let run_dir = dir.path().join(alg);
        let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
            .args(["plot", run_dir.to_str().unwrap()])
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let png = std::fs::read(run_dir.join("curves.png")).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
    }
}

#[test]
fn the_library_api_builds_fits_and_resumes_any_algorithm() {
    let dir = tempfile::tempdir().unwrap();
    let s = setup(dir.path(), "api-seed", "sft", 4, "");
    let cfg = s.cfg.clone();
    drop(s);
    assert_eq!(
        grpo_trainer::list_algorithms(),
        vec![
            "a2po",
            "bco",
            "cpo",
            "distillation",
            "dpo",
            "gkd",
            "gold",
            "grpo",
            "iw_opd",
            "kto",
            "minillm",
            "nash_md",
            "online_dpo",
            "orpo",
            "ppo",
            "prm",
            "reward",
            "rloo",
            "sdft",
            "sdpo",
            "sft",
            "ssd",
            "tpo",
            "xpo"
        ]
    );
    assert!(
        grpo_trainer::create_trainer("trpo", dir.path().join("model"), cfg.clone())
            .unwrap_err()
            .to_string()
            .contains("expected one of a2po, bco, cpo, distillation, dpo, gkd, gold, grpo, iw_opd, kto, minillm, nash_md, online_dpo, orpo, ppo, prm, reward, rloo, sdft, sdpo, sft, ssd, tpo, xpo")
    );
    let mut c = cfg.clone();
    c.output_dir = dir.path().join("api-all");
    let mut t = grpo_trainer::create_trainer("sft", dir.path().join("model"), c).unwrap();
    assert_eq!((t.current_step(), t.total_steps()), (0, 4));
    assert!(t.save_checkpoint(dir.path().join("early")).is_err());
    let all = t.fit().unwrap();
    assert_eq!(t.current_step(), 4);
    t.save_checkpoint(dir.path().join("saved")).unwrap();
    let mut u = grpo_trainer::SftTrainer::from_config(cfg.clone()).unwrap();
    u.load_checkpoint(dir.path().join("saved")).unwrap();
    assert_eq!(u.current_step(), 4);
    assert!(
        t.fit()
            .unwrap_err()
            .to_string()
            .contains("already been fitted")
    );

    // The typed trainers: DPO sets its algorithm whatever the config says.
    let mut c = cfg.clone();
    c.algorithm = grpo_trainer::Algorithm::Grpo;
    c.data.path = vec![dir.path().join("dpo.jsonl").display().to_string()];
    c.output_dir = dir.path().join("api-dpo");
    c.train.max_steps = Some(1);
    let r = grpo_trainer::DpoTrainer::from_pretrained(dir.path().join("model"), c)
        .unwrap()
        .fit()
        .unwrap();
    assert!(r.metrics[0].contains_key("rewards/margins"));
    let mut c = cfg.clone();
    c.data.path = vec![dir.path().join("kto.jsonl").display().to_string()];
    c.output_dir = dir.path().join("api-kto");
    c.train.max_steps = Some(1);
    let r = grpo_trainer::KtoTrainer::from_pretrained(dir.path().join("model"), c)
        .unwrap()
        .fit()
        .unwrap();
    assert!(r.metrics[0].contains_key("kl"));

    // fit_on: another dataset than the config's (4 rows), steps from its size (16 rows / 4).
    let mut c = cfg.clone();
    c.output_dir = dir.path().join("api-fit-on");
    c.train.max_steps = None;
    c.data.path = vec![dir.path().join("dpo.jsonl").display().to_string()];
    c.data.max_samples = Some(4);
    let data = grpo_data::DataConfig {
        path: vec![dir.path().join("dpo.jsonl").display().to_string()],
        ..Default::default()
    }
    .open(0)
    .unwrap();
    let mut t = grpo_trainer::DpoTrainer::from_pretrained(dir.path().join("model"), c).unwrap();
    assert_eq!(t.total_steps(), 1);
    let r = t.fit_on(data.train, None).unwrap();
    assert_eq!(r.total_steps, 4);
    assert!(r.metrics[3]["rewards/accuracies"].is_finite());

    // load_checkpoint: continue an SFT run from step 2, exactly.
    let mut c = cfg.clone();
    c.output_dir = dir.path().join("api-all");
    let mut t = grpo_trainer::SftTrainer::from_config(c).unwrap();
    let ck = dir.path().join("api-all/checkpoints/step-2");
    t.load_checkpoint(&ck).unwrap();
    assert_eq!(t.current_step(), 2);
    let rest = t.fit().unwrap();
    let a: Vec<f64> = all.metrics[2..].iter().map(|m| m["loss"]).collect();
    let b: Vec<f64> = rest.metrics.iter().map(|m| m["loss"]).collect();
    assert_eq!(a, b);
    let bad = grpo_trainer::SftTrainer::from_config(cfg)
        .unwrap()
        .load_checkpoint(dir.path().join("nowhere"))
        .unwrap_err()
        .to_string();
    assert!(
        bad.contains("trainer_state.json") && bad.contains("not a complete checkpoint"),
        "{bad}"
    );
}

#[test]
fn sft_eval_split_and_packing() {
    let dir = tempfile::tempdir().unwrap();
    // Eval loss and perplexity every 2 steps on a held-out quarter of the rows.
    drop(setup(dir.path(), "first", "sft", 1, ""));
    let text = config_text(dir.path(), "eval", "sft", 4, "eval_steps = 2")
        .replace("[data]\n", "[data]\neval_fraction = 0.25\n");
    let s = setup_text(&dir.path().join("eval.toml"), text);
    run(s, &RunOptions::default());
    let evals = eval_lines(&dir.path().join("eval"));
    assert_eq!(evals.len(), 2);
    for e in &evals {
        let (l, ppl) = (
            e["eval/loss"].as_f64().unwrap(),
            e["eval/perplexity"].as_f64().unwrap(),
        );
        assert!(l > 0.0 && (ppl - l.exp()).abs() < 1e-9 * ppl, "{e}");
    }
    // The model learns, so the held-out loss falls too.
    assert!(evals[1]["eval/loss"].as_f64() < evals[0]["eval/loss"].as_f64());

    // Packing (TRL's strategies) is tested in `sft_packing_strategies`.
}

fn loss_tokens(rows: &[trainer::supervised::Row]) -> usize {
    rows.iter()
        .map(|r| r.mask.iter().filter(|&&m| m == 1).count())
        .sum()
}

fn tokens(rows: &[trainer::supervised::Row]) -> usize {
    rows.iter()
        .map(|r| r.prompt.len() + r.completion.len())
        .sum()
}

#[test]
fn sft_packing_strategies() {
    let dir = tempfile::tempdir().unwrap();
    let s = setup(dir.path(), "plain", "sft", 3, "");
    let samples = first_rows(&s.train, 8);
    let plain = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    let longest = plain
        .iter()
        .map(|r| r.prompt.len() + r.completion.len())
        .max()
        .unwrap();
    let with = |strategy: &str, max: usize| {
        let mut c = s.cfg.clone();
        c.sft.packing = true;
        c.sft.max_length = max;
        c.sft.packing_strategy = toml::from_str::<toml::Value>(&format!("v = \"{strategy}\""))
            .unwrap()["v"]
            .clone()
            .try_into()
            .unwrap();
        trainer::supervised::rows(&c, &s.tokenizer, &samples).unwrap()
    };
    // bfd: whole rows, fewer sequences, every loss token kept (a completion never starts a row).
    let bfd = with("bfd", 2 * longest);
    assert!(bfd.len() < plain.len() && bfd.len() >= plain.len().div_ceil(2));
    for r in &bfd {
        let n = r.prompt.len() + r.completion.len();
        assert!(
            n <= 2 * longest && r.segments.iter().sum::<usize>() == n,
            "{r:?}"
        );
    }
    assert_eq!(tokens(&bfd), tokens(&plain));
    assert_eq!(loss_tokens(&bfd), loss_tokens(&plain));
    // bfd_split: rows of 4, no token lost; bfd cuts each row at 4 instead.
    let split = with("bfd_split", 4);
    assert_eq!(tokens(&split), tokens(&plain));
    assert!(split.iter().all(|r| r.segments.iter().sum::<usize>() <= 4));
    let cut = with("bfd", 4);
    assert_eq!(tokens(&cut), 4 * plain.len());
    // wrapped: end to end, full rows but the last, one sequence each.
    let wrapped = with("wrapped", 16);
    assert_eq!(wrapped.len(), tokens(&plain).div_ceil(16));
    assert!(wrapped.iter().all(|r| r.segments.is_empty()));
    assert_eq!(tokens(&wrapped), tokens(&plain));
    // A completion token that lands first in a wrapped row has no prediction: its loss goes.
    let lost = loss_tokens(&plain) - loss_tokens(&wrapped);
    assert!(lost < wrapped.len(), "{lost}");

    // Training: bfd packs rows that attend only to themselves, on their own positions, so a
    // step's loss and update are the unpacked step's (up to float rounding), in fewer rows.
    let plain_run = run(s, &RunOptions::default());
    let packed = setup(
        dir.path(),
        "bfd",
        "sft",
        3,
        &format!("[sft]\npacking = true\nmax_length = {}\n", 2 * longest),
    );
    assert_eq!(
        packed.cfg.sft.packing_strategy,
        config::PackingStrategy::Bfd
    );
    let packed_run = run(packed, &RunOptions::default());
    // TRL's padding_free: each micro-batch as one sequence of kept-apart rows, the same too.
    let free = setup(dir.path(), "free", "sft", 3, "[sft]\npadding_free = true\n");
    let free_run = run(free, &RunOptions::default());
    for (name, other) in [("bfd", &packed_run), ("padding_free", &free_run)] {
        for (a, b) in plain_run.metrics.iter().zip(&other.metrics) {
            for k in ["loss", "grad_norm", "num_tokens"] {
                let (x, y) = (a[k], b[k]);
                assert!(
                    (x - y).abs() <= 1e-4 * x.abs(),
                    "{k}: unpacked {x}, {name} {y}"
                );
            }
        }
    }
    // eval_packing packs the eval split alone: the same eval loss.
    let eval_extra =
        |packed: bool| format!("eval_steps = 1\n[sft]\neval_packing = {packed}\nmax_length = 64\n");
    let eval_loss = |name: &str, packed: bool| {
        let text = config_text(dir.path(), name, "sft", 1, &eval_extra(packed))
            .replace("[data]\n", "[data]\neval_fraction = 0.25\n");
        let p = dir.path().join(format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        run(
            trainer::setup(config::load(&p, &[]).unwrap()).unwrap(),
            &RunOptions::default(),
        );
        let log = std::fs::read_to_string(dir.path().join(name).join("metrics.jsonl")).unwrap();
        log.lines()
            .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap())
            .find_map(|v| v.get("eval/loss").and_then(serde_json::Value::as_f64))
            .unwrap()
    };
    let (a, b) = (
        eval_loss("eval_plain", false),
        eval_loss("eval_packed", true),
    );
    assert!(
        (a - b).abs() <= 1e-5 * a,
        "eval loss unpacked {a}, packed {b}"
    );
    // A strategy TRL does not have is refused, naming the choices.
    let e = config_error(dir.path(), "sft", "[sft]\npacking_strategy = \"ffd\"\n");
    assert!(e.contains("ffd") && e.contains("bfd_split"), "{e}");
}

/// A model with recurrent layers (Qwen3.5, LFM2 and their mixtures of experts) carries a state
/// along a row: `bfd` packing and `padding_free` run each sequence padded on its own, so a
/// step's loss, gradient norm and token count are the unpacked run's.
#[test]
fn sft_packing_on_linear_attention_models_trains_as_unpacked() {
    for arch in [Arch::Qwen3_5, Arch::Qwen3_5Moe, Arch::Lfm2, Arch::Lfm2Moe] {
        let dir = fixture(arch);
        let plain = run(
            setup(dir.path(), "plain", "sft", 3, ""),
            &RunOptions::default(),
        );
        let packed = run(
            setup(
                dir.path(),
                "bfd",
                "sft",
                3,
                "[sft]\npacking = true\nmax_length = 64\n",
            ),
            &RunOptions::default(),
        );
        let free = run(
            setup(dir.path(), "free", "sft", 3, "[sft]\npadding_free = true\n"),
            &RunOptions::default(),
        );
        for (name, other) in [("bfd", &packed), ("padding_free", &free)] {
            assert_eq!(plain.metrics.len(), other.metrics.len());
            for (a, b) in plain.metrics.iter().zip(&other.metrics) {
                for k in ["loss", "grad_norm", "num_tokens"] {
                    let (x, y) = (a[k], b[k]);
                    assert!(
                        (x - y).abs() <= 1e-4 * x.abs(),
                        "{arch:?} {k}: unpacked {x}, {name} {y}"
                    );
                }
            }
        }
    }
}

#[test]
fn dpo_on_conversations() {
    let dir = fixture(Arch::Qwen2);
    let mut rows = String::new();
    for i in 0..8 {
        rows.push_str(&format!(
            r#"{{"prompt": [{{"role": "user", "content": "Question {i}?"}}], "chosen": [{{"role": "assistant", "content": "yes, gladly"}}], "rejected": [{{"role": "assistant", "content": "no"}}]}}"#
        ));
        rows.push('\n');
    }
    std::fs::write(dir.path().join("dpo.jsonl"), rows).unwrap();
    let p = dir.path().join("conv.toml");
    std::fs::write(
        &p,
        config_text(dir.path(), "conv", "dpo", 10, "") + "[dpo]\nbeta = 0.5\n",
    )
    .unwrap();
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    let sample = first_rows(&s.train, 1);
    let row = &trainer::supervised::rows(&s.cfg, &s.tokenizer, &sample).unwrap()[0];
    // The prompt through the chat template with the generation prompt; each completion is the
    // assistant turn the template renders after it.
    let prompt = s.tokenizer.decode(&row.prompt, false).unwrap();
    assert!(
        prompt.contains("Question 0?") && prompt.ends_with("<|im_start|>assistant\n"),
        "{prompt:?}"
    );
    let chosen = s.tokenizer.decode(&row.completion, false).unwrap();
    let rejected = s.tokenizer.decode(&row.rejected, false).unwrap();
    assert!(chosen.starts_with("yes, gladly<|im_end|>"), "{chosen:?}");
    assert!(rejected.starts_with("no<|im_end|>"), "{rejected:?}");
    let r = run(s, &RunOptions::default());
    let last = r.metrics.last().unwrap();
    assert_eq!(last["rewards/accuracies"], 1.0, "{last:?}");
    assert!(last["rewards/margins"] > r.metrics[0]["rewards/margins"]);
}

#[test]
fn sft_ignores_the_rewards_section_and_checks_its_columns_before_the_run() {
    let dir = fixture(Arch::Llama);
    // A GRPO-style `[[rewards]]` section whose column the SFT data lacks: SFT never reads it.
    let extra = "\n[[rewards]]\ntype = \"accuracy\"\nanswer_field = \"solution\"\n";
    let p = dir.path().join("with-rewards.toml");
    std::fs::write(
        &p,
        config_text(dir.path(), "with-rewards", "sft", 1, "") + extra,
    )
    .unwrap();
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    assert!(s.rewards.is_empty(), "SFT builds no rewards");
    let r = run(s, &RunOptions::default());
    assert!(r.metrics[0]["loss"].is_finite());

    // Text prompts without the completion column: refused at setup, in one line naming the
    // column and the file, before the run directory exists.
    let lines: String = (0..8)
        .map(|i| {
            format!(
                "{{\"prompt\": \"What is {i} + 1?\", \"answer\": \"{}\"}}\n",
                i + 1
            )
        })
        .collect();
    std::fs::write(dir.path().join("no-completion.jsonl"), lines).unwrap();
    let text = config_text(dir.path(), "no-completion", "sft", 2, "")
        .replace("sft.jsonl", "no-completion.jsonl");
    let p = dir.path().join("no-completion.toml");
    std::fs::write(&p, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["sft", "--config", p.to_str().unwrap()])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert_eq!(err.trim().lines().count(), 1, "{err}");
    assert!(
        err.contains("`completion`") && err.contains("no-completion.jsonl"),
        "{err}"
    );
    assert!(!dir.path().join("no-completion").exists());
}

/// TRL 1.16's DPO loss types from the config: one name or a weighted list (MPO: sigmoid,
/// bco_pair and sft), the length-normalised ones (token counts from the rows), an
/// f-divergence; a `label_smoothing` no chosen type uses is refused.
#[test]
fn dpo_loss_types_from_the_config_train() {
    let dir = tempfile::tempdir().unwrap();
    for (name, extra) in [
        ("ipo", "loss_type = \"ipo\""),
        (
            "mpo",
            "loss_type = [\"sigmoid\", \"bco_pair\", \"sft\"]\nloss_weights = [0.8, 0.2, 1.0]",
        ),
        ("robust", "loss_type = \"robust\"\nlabel_smoothing = 0.1"),
        (
            "js",
            "loss_type = \"sigmoid_norm\"\nf_divergence_type = \"js_divergence\"",
        ),
    ] {
        let r = run(
            setup(
                dir.path(),
                name,
                "dpo",
                8,
                &format!("[dpo]\nbeta = 0.5\n{extra}"),
            ),
            &RunOptions::default(),
        );
        let (first, last) = (&r.metrics[0], r.metrics.last().unwrap());
        assert!(
            first["loss"].is_finite() && last["loss"].is_finite(),
            "{name}"
        );
        assert!(
            last["rewards/margins"] > first["rewards/margins"],
            "{name}: {first:?} -> {last:?}"
        );
    }
    let text = config_text(dir.path(), "bad", "dpo", 2, "") + "[dpo]\nlabel_smoothing = 0.1\n";
    std::fs::write(dir.path().join("bad.toml"), text).unwrap();
    let e = grpo_trainer::config::load(&dir.path().join("bad.toml"), &[]).unwrap_err();
    assert!(
        format!("{e:#}").contains("TRL 1.16's sigmoid ignores it"),
        "{e:#}"
    );
}

/// `sft.loss_type = "dft"` (TRL's name) trains with the probability-weighted NLL, not the NLL;
/// `train.disable_dropout` defaults to TRL's per algorithm (on for DPO only).
#[test]
fn sft_dft_loss_and_per_algorithm_dropout_default() {
    let dir = tempfile::tempdir().unwrap();
    let nll = run(
        setup(dir.path(), "nll", "sft", 3, ""),
        &RunOptions::default(),
    );
    let dft = run(
        setup(dir.path(), "dft", "sft", 3, "[sft]\nloss_type = \"dft\""),
        &RunOptions::default(),
    );
    for (a, b) in nll.metrics.iter().zip(&dft.metrics) {
        assert!(
            b["loss"].is_finite() && b["loss"] < a["loss"],
            "{a:?} {b:?}"
        );
    }
    let mut cfg = grpo_trainer::TrainConfig::default();
    for (alg, off) in [("grpo", false), ("sft", false), ("dpo", true)] {
        cfg.algorithm = alg.parse().unwrap();
        assert_eq!(cfg.dropout_disabled(), off, "{alg}");
    }
    cfg.train.disable_dropout = Some(false);
    assert!(!cfg.dropout_disabled());
}

/// TRL's SFT defaults: a conversation trains on every token after the first
/// (`assistant_only_loss = false`), a prompt/completion row on its completion unless
/// `completion_only_loss = false`, which adds the prompt.
#[test]
fn sft_loss_masks_follow_trl_defaults() {
    let dir = fixture(Arch::Qwen2);
    let rows_of = |name: &str, data: &str, prompt_field: &str, extra: &str| {
        let text = config_text(dir.path(), name, "sft", 2, "").replace("sft.jsonl", data)
            + &format!("\n[sft]\nmax_length = 512\n{extra}");
        let text = text.replace(
            "[data]\n",
            &format!("[data]\nprompt_field = \"{prompt_field}\"\n"),
        );
        let p = dir.path().join(format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
        let samples = first_rows(&s.train, 1);
        let r = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap()[0].clone();
        let text = s.tokenizer.decode(&r.completion, false).unwrap();
        (r, text)
    };
    // A conversation: all of it after the first token.
    let (r, text) = rows_of("conv_all", "chat.jsonl", "messages", "");
    assert_eq!(r.prompt.len(), 1);
    assert!(r.mask.iter().all(|&m| m == 1));
    for part in ["hi there", "hello friend", "and then?", "goodbye now"] {
        assert!(text.contains(part), "{part}: {text:?}");
    }
    // As TRL renders it: the whole conversation, a trailing user turn too.
    let trailing = r#"{"messages": [{"role": "user", "content": "hi there"}, {"role": "assistant", "content": "hello friend"}, {"role": "user", "content": "one more"}]}"#;
    std::fs::write(dir.path().join("trailing.jsonl"), format!("{trailing}\n")).unwrap();
    let (r, text) = rows_of("conv_trailing", "trailing.jsonl", "messages", "");
    assert!(r.mask.iter().all(|&m| m == 1));
    assert!(text.ends_with("one more<|im_end|>\n"), "{text:?}");
    // Prompt/completion: the completion alone by default, everything with the switch off.
    let (only, _) = rows_of("pc_only", "sft.jsonl", "prompt", "");
    assert!(only.prompt.len() > 1 && only.mask.iter().all(|&m| m == 1));
    let (all, text) = rows_of(
        "pc_all",
        "sft.jsonl",
        "prompt",
        "completion_only_loss = false\n",
    );
    assert_eq!(all.prompt.len(), 1);
    assert_eq!(
        all.completion.len(),
        only.prompt.len() - 1 + only.completion.len()
    );
    assert!(
        text.contains("What is 0 + 1?") || text.contains("+ 1?"),
        "{text:?}"
    );
}

/// TRL's language-modelling rows: `data.prompt_field` naming `sft.dataset_text_field` ("text"
/// by default), no completion column, every token trained; the run lowers its loss.
#[test]
fn sft_trains_language_modelling_text_rows() {
    let dir = fixture(Arch::Qwen2);
    let lines: String = (0..8)
        .map(|i| format!("{{\"text\": \"the number {i} comes before {}\"}}\n", i + 1))
        .collect();
    std::fs::write(dir.path().join("text.jsonl"), lines).unwrap();
    let text = config_text(dir.path(), "lm", "sft", 12, "")
        .replace("sft.jsonl", "text.jsonl")
        .replace("[data]\n", "[data]\nprompt_field = \"text\"\n");
    let s = setup_text(&dir.path().join("lm.toml"), text);
    let samples = first_rows(&s.train, 1);
    let r = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap()[0].clone();
    assert_eq!(r.prompt.len(), 1);
    assert!(r.mask.iter().all(|&m| m == 1));
    let decoded = s.tokenizer.decode(&r.completion, false).unwrap();
    assert!(decoded.contains("comes before"), "{decoded:?}");
    let res = run(s, &RunOptions::default());
    let (first, last) = (res.metrics[0]["loss"], res.metrics.last().unwrap()["loss"]);
    assert!(last < first, "{first} -> {last}");
}

/// TRL's `dpo.ld_alpha` (LD-DPO): α = 1 is plain DPO exactly; below 1 the tokens of the longer
/// completion past the shorter one's length count less (the chosen " yes, gladly" is longer
/// than the rejected " no", so its summed log-prob rises toward 0); outside [0, 1] it is refused.
#[test]
fn dpo_ld_alpha_discounts_the_longer_completions_tail() {
    let dir = tempfile::tempdir().unwrap();
    let go = |name: &str, extra: &str| {
        run(
            setup(
                dir.path(),
                name,
                "dpo",
                3,
                &format!("[dpo]\nbeta = 0.5\n{extra}"),
            ),
            &RunOptions::default(),
        )
    };
    let plain = go("plain", "");
    let one = go("one", "ld_alpha = 1.0");
    let half = go("half", "ld_alpha = 0.5");
    for (a, b) in plain.metrics.iter().zip(&one.metrics) {
        assert_eq!(a["loss"], b["loss"]);
        assert_eq!(a["logps/chosen"], b["logps/chosen"]);
    }
    let (p0, h0) = (&plain.metrics[0], &half.metrics[0]);
    assert!(h0["logps/chosen"] > p0["logps/chosen"], "{p0:?} {h0:?}");
    assert_eq!(h0["logps/rejected"], p0["logps/rejected"]);
    let text = config_text(dir.path(), "bad", "dpo", 2, "") + "[dpo]\nld_alpha = 1.5\n";
    std::fs::write(dir.path().join("bad.toml"), text).unwrap();
    let e = grpo_trainer::config::load(&dir.path().join("bad.toml"), &[]).unwrap_err();
    assert!(format!("{e:#}").contains("`dpo.ld_alpha`"), "{e:#}");
}

/// `max_length` as TRL applies it (`keep_start`, its only supported truncation): a row is cut
/// to its first `max_length` tokens, and a row left with nothing to learn from — an SFT row
/// whose loss tokens are all cut, a DPO pair whose prompt alone fills `max_length` — is
/// dropped; a step whose rows are all dropped makes no update.
#[test]
fn max_length_keeps_the_start_and_drops_rows_with_nothing_left() {
    let dir = tempfile::tempdir().unwrap();
    let s = setup(dir.path(), "sft", "sft", 2, "");
    let samples = first_rows(&s.train, 4);
    let full = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    let p = full.iter().map(|r| r.prompt.len()).min().unwrap();
    let longest = full
        .iter()
        .map(|r| r.prompt.len() + r.completion.len())
        .max()
        .unwrap();
    assert!(
        full.iter().all(|r| r.completion.len() >= 2),
        "the fixture's completions"
    );
    for max in [p + 1, p + 2, longest] {
        let mut c = s.cfg.clone();
        c.sft.max_length = max;
        let cut = trainer::supervised::rows(&c, &s.tokenizer, &samples).unwrap();
        // Rows whose prompt fits keep their start, up to max tokens in all.
        let kept: Vec<_> = full.iter().filter(|r| r.prompt.len() < max).collect();
        assert_eq!(cut.len(), kept.len(), "max_length {max}");
        for (a, b) in kept.iter().zip(&cut) {
            assert_eq!(a.prompt, b.prompt);
            let n = (max - a.prompt.len()).min(a.completion.len());
            assert_eq!(b.completion, a.completion[..n], "max_length {max}");
            assert!(b.prompt.len() + b.completion.len() <= max);
        }
    }
    // A max_length no prompt fits in: every row dropped; the steps make no update.
    let text = config_text(
        dir.path(),
        "none",
        "sft",
        2,
        &format!("[sft]\nmax_length = {p}\n"),
    );
    let path = dir.path().join("none.toml");
    std::fs::write(&path, text).unwrap();
    let setup_none = trainer::setup(config::load(&path, &[]).unwrap()).unwrap();
    let before = setup_none.policy.model.weights();
    let r = run(setup_none, &RunOptions::default());
    assert_eq!(r.total_steps, 2);
    assert!(
        r.metrics.iter().all(|m| !m.contains_key("loss")),
        "{:?}",
        r.metrics
    );
    let saved = candle_core::safetensors::load(
        dir.path()
            .join("none/checkpoints/step-2/model/model.safetensors"),
        &candle_core::Device::Cpu,
    )
    .unwrap();
    for (name, w) in before {
        let a: Vec<f32> = w.flatten_all().unwrap().to_vec1().unwrap();
        let b: Vec<f32> = saved[&name].flatten_all().unwrap().to_vec1().unwrap();
        assert_eq!(a, b, "{name} changed without a row to learn from");
    }
    // DPO: a pair whose prompt fills max_length is dropped, the others cut at the start.
    let d = setup(dir.path(), "dpo", "dpo", 1, "");
    let samples = first_rows(&d.train, 4);
    let full = trainer::supervised::rows(&d.cfg, &d.tokenizer, &samples).unwrap();
    let p = full[0].prompt.len();
    let mut c = d.cfg.clone();
    c.dpo.max_length = p + 1;
    let cut = trainer::supervised::rows(&c, &d.tokenizer, &samples).unwrap();
    assert!(!cut.is_empty());
    for r in &cut {
        assert!(r.prompt.len() < p + 1 && r.completion.len() == p + 1 - r.prompt.len());
        assert!(r.rejected.len() <= p + 1 - r.prompt.len());
    }
    c.dpo.max_length = full.iter().map(|r| r.prompt.len()).min().unwrap();
    assert!(
        trainer::supervised::rows(&c, &d.tokenizer, &samples)
            .unwrap()
            .is_empty()
    );
}

/// TR-DPO (`reference.sync_ref_model`, TRL's DPO keys): with α = 1 and a sync after every
/// step the reference is the policy at each step's start, so every step's rewards are 0 and
/// its loss ln 2; without the sync the second step's are not.
#[test]
fn dpo_syncs_its_reference_as_tr_dpo() {
    let dir = tempfile::tempdir().unwrap();
    let sync = "[reference]\nsync_ref_model = true\nref_model_mixup_alpha = 1.0\nref_model_sync_steps = 1\n";
    let lora = format!(
        "{sync}[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n"
    );
    for (name, extra) in [("synced", sync.to_string()), ("synced-lora", lora)] {
        let synced = run(
            setup(dir.path(), name, "dpo", 3, &extra),
            &RunOptions::default(),
        );
        for m in &synced.metrics {
            assert!(m["rewards/chosen"].abs() < 1e-6, "{name}: {m:?}");
            assert!(
                (m["loss"] - std::f64::consts::LN_2).abs() < 1e-5,
                "{name}: {m:?}"
            );
        }
    }
    let fixed = run(
        setup(dir.path(), "fixed", "dpo", 3, ""),
        &RunOptions::default(),
    );
    assert!(
        fixed.metrics[1]["rewards/margins"].abs() > 1e-4,
        "{:?}",
        fixed.metrics[1]
    );
    // A precomputed reference cannot follow the sync.
    let e = config_error(
        dir.path(),
        "dpo",
        &format!("{sync}[dpo]\nprecompute_ref_log_probs = true\n"),
    );
    assert!(
        e.contains("sync_ref_model") && e.contains("precompute_ref_log_probs"),
        "{e}"
    );
}

/// `model.chat_template_path` (TRL's `chat_template_path`): conversations render with the
/// given Jinja template; a bad path stops the run before it starts, naming the key.
#[test]
fn chat_template_path_renders_the_rows() {
    let dir = fixture(Arch::Qwen2);
    let jinja = dir.path().join("plain.jinja");
    std::fs::write(
        &jinja,
        "{% for m in messages %}{{ m.role }}:\n{{ m.content }}\n{% endfor %}{% if add_generation_prompt %}assistant:\n{% endif %}",
    )
    .unwrap();
    let conf = |path: &std::path::Path| {
        let text = config_text(dir.path(), "tpl", "sft", 1, "")
            .replace("sft.jsonl", "chat.jsonl")
            .replace("[data]\n", "[data]\nprompt_field = \"messages\"\n")
            .replace(
                "[model]\n",
                &format!("[model]\nchat_template_path = \"{}\"\n", path.display()),
            );
        let p = dir.path().join("tpl.toml");
        std::fs::write(&p, text).unwrap();
        trainer::setup(config::load(&p, &[]).unwrap())
    };
    let s = conf(&jinja).unwrap();
    let samples = first_rows(&s.train, 1);
    let r = &trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap()[0];
    let ids: Vec<u32> = r.prompt.iter().chain(&r.completion).copied().collect();
    let text = s.tokenizer.decode(&ids, false).unwrap();
    assert!(
        text.starts_with("user:\nhi there\nassistant:\nhello friend\n"),
        "{text:?}"
    );
    let e = format!("{:#}", conf(&dir.path().join("missing.jinja")).unwrap_err());
    assert!(
        e.contains("model.chat_template_path") && e.contains("missing.jinja"),
        "{e}"
    );
}

/// `chat_template_path` naming a model directory whose tokens this model lacks: TRL's
/// `clone_chat_template` — the tokens added, the embeddings grown to a multiple of 64 (fillers
/// `<extra_id_N>`), its EOS; the run trains and saves the grown model. With LoRA the new rows
/// would stay untrained: refused, naming the tokens.
#[test]
fn chat_template_path_adds_a_directorys_missing_tokens() {
    let dir = fixture(Arch::Qwen2);
    let source = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../grpo-rollout/tests/fixtures/clone-source");
    let conf = |name: &str, extra: &str| {
        let text = config_text(dir.path(), name, "sft", 2, extra)
            .replace("sft.jsonl", "chat.jsonl")
            .replace("[data]\n", "[data]\nprompt_field = \"messages\"\n")
            .replace(
                "[model]\n",
                &format!("[model]\nchat_template_path = \"{}\"\n", source.display()),
            );
        let p = dir.path().join(format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        trainer::setup(config::load(&p, &[]).unwrap())
    };
    let before = grpo_rollout::Tokenizer::from_hf_dir(&dir.path().join("model"), &[]).unwrap();
    let s = conf("clone", "").unwrap();
    let n = (before.vocab_size() + 4).div_ceil(64) * 64;
    assert_eq!(s.tokenizer.vocab_size(), n);
    assert_eq!(s.policy.model.cfg.vocab_size, n);
    let eot = s.tokenizer.inner.token_to_id("<|eot|>").unwrap();
    assert_eq!(s.tokenizer.eos_token_ids, vec![eot]);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &first_rows(&s.train, 1)).unwrap();
    assert!(
        rows[0].completion.contains(&eot),
        "turns end with the cloned template's <|eot|>"
    );
    let r = run(s, &RunOptions::default());
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
    let saved = r.best_checkpoint_path.unwrap().join("model");
    let m = grpo_rollout::load(&saved, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    assert_eq!(m.model.embed_tokens.dims()[0], n);
    assert_eq!(m.tokenizer.inner.token_to_id("<|eot|>"), Some(eot));
    assert_eq!(
        m.tokenizer.inner.token_to_id("<extra_id_0>"),
        Some(before.vocab_size() as u32 + 4)
    );
    // With LoRA the added tokens' rows are trained as TRL trains them (PEFT's
    // trainable_token_indices): saved in the adapter, and `export --format merged` replays the
    // run's chat_template_path on the base before merging.
    let lora = "[model.lora]\nr = 2\nlora_alpha = 4\ntarget_modules = [\"q_proj\"]\n";
    let text = config_text(dir.path(), "clone-lora", "sft", 2, "")
        .replace("sft.jsonl", "chat.jsonl")
        .replace("[data]\n", "[data]\nprompt_field = \"messages\"\n")
        .replace(
            "[model]\n",
            &format!("[model]\nchat_template_path = \"{}\"\n", source.display()),
        )
        + lora;
    let p = dir.path().join("clone-lora.toml");
    std::fs::write(&p, text).unwrap();
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    let ids = s
        .cfg
        .model
        .lora
        .as_ref()
        .unwrap()
        .trainable_token_indices
        .clone()
        .unwrap();
    let ids = ids.embedding().unwrap();
    assert_eq!(
        ids.len(),
        n - before.vocab_size(),
        "the four added tokens and the fillers"
    );
    assert!(ids.contains(&eot));
    assert!(
        s.policy
            .vars
            .iter()
            .any(|(k, _)| k == grpo_rollout::lora::TOKENS_KEY)
    );
    let r = run(s, &RunOptions::default());
    let ck = r.best_checkpoint_path.unwrap();
    let ac: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert!(
        ac["trainable_token_indices"]["embed_tokens"]
            .as_array()
            .unwrap()
            .len()
            == ids.len()
    );
    let out = dir.path().join("clone-merged");
    let o = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["export", "--checkpoint"])
        .arg(&ck)
        .args(["--format", "merged", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let merged =
        grpo_rollout::load(&out, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    assert_eq!(merged.model.cfg.vocab_size, n);
    assert_eq!(merged.tokenizer.inner.token_to_id("<|eot|>"), Some(eot));
    // <|eot|> ends every assistant turn: its row moved away from the mean it started at.
    let rows = merged
        .model
        .embed_tokens
        .narrow(0, 0, before.vocab_size())
        .unwrap();
    let mean = rows.mean_keepdim(0).unwrap();
    let row = merged
        .model
        .embed_tokens
        .narrow(0, eot as usize, 1)
        .unwrap();
    let moved = (row - mean)
        .unwrap()
        .abs()
        .unwrap()
        .max_all()
        .unwrap()
        .to_scalar::<f32>()
        .unwrap();
    assert!(moved > 1e-4, "{moved}");
}

/// Tokenisation as TRL 1.16's SFT and DPO trainers do it: plain text is tokenised as one
/// string (prompt + completion + EOS, with the tokenizer's special tokens), so tokens merge
/// across the boundary; the completion starts where the prompt alone and prompt + completion
/// diverge — also when a chat template renders the prompt alone differently (an empty thought
/// block after the generation prompt, as Gemma's and Qwen3's do).
#[test]
fn rows_are_tokenised_jointly_and_split_where_trl_splits_them() {
    let dir = fixture(Arch::Qwen2);
    let rows_of = |algorithm: &str, lines: &str, model_extra: &str| {
        let file = dir.path().join(format!("{algorithm}-joint.jsonl"));
        std::fs::write(&file, lines).unwrap();
        let data = if algorithm == "dpo" {
            "dpo.jsonl"
        } else {
            "sft.jsonl"
        };
        let text = config_text(dir.path(), "joint", algorithm, 1, "")
            .replace(data, file.file_name().unwrap().to_str().unwrap())
            .replace("[model]\n", &format!("[model]\n{model_extra}"));
        let p = dir.path().join("joint.toml");
        std::fs::write(&p, text).unwrap();
        let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
        let samples = first_rows(&s.train, 1);
        (
            trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap(),
            s.tokenizer,
        )
    };
    // A prompt that ends with a space: " 4" is one word for the tokenizer when joined.
    let (rows, tok) = rows_of(
        "sft",
        "{\"prompt\": \"What is 2 + 2? Answer: \", \"completion\": \"4\"}\n",
        "",
    );
    let r = &rows[0];
    let joint = tok
        .encode("What is 2 + 2? Answer: 4<|im_end|>", true)
        .unwrap();
    let ids: Vec<u32> = r.prompt.iter().chain(&r.completion).copied().collect();
    assert_eq!(ids, joint);
    let alone = tok.encode("What is 2 + 2? Answer: ", true).unwrap();
    assert!(
        alone.starts_with(&r.prompt),
        "the prompt is a prefix of the prompt alone"
    );
    assert!(
        r.prompt.len() < alone.len(),
        "' 4' merges: the split moves back into the prompt"
    );
    assert_eq!(r.mask, vec![1; r.completion.len()]);
    // DPO: both completions after the prompt both share.
    let (rows, _) = rows_of(
        "dpo",
        "{\"prompt\": \"Pick: \", \"chosen\": \"yes\", \"rejected\": \"no\"}\n",
        "",
    );
    let r = &rows[0];
    let chosen: Vec<u32> = r.prompt.iter().chain(&r.completion).copied().collect();
    let rejected: Vec<u32> = r.prompt.iter().chain(&r.rejected).copied().collect();
    assert_eq!(chosen, tok.encode("Pick: yes<|im_end|>", true).unwrap());
    assert_eq!(rejected, tok.encode("Pick: no<|im_end|>", true).unwrap());
    // A template whose generation prompt adds an empty thought block that the rendered
    // conversation does not have: the completion starts where they diverge.
    let jinja = dir.path().join("think.jinja");
    std::fs::write(
        &jinja,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}<|im_end|>\n{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n<think>\n\n</think>\n\n{% endif %}",
    )
    .unwrap();
    let conv = "{\"prompt\": [{\"role\": \"user\", \"content\": \"hi\"}], \"completion\": [{\"role\": \"assistant\", \"content\": \"hello\"}]}\n";
    let (rows, tok) = rows_of(
        "sft",
        conv,
        &format!("chat_template_path = \"{}\"\n", jinja.display()),
    );
    let r = &rows[0];
    let full = tok
        .encode(
            "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\nhello<|im_end|>\n",
            false,
        )
        .unwrap();
    let ids: Vec<u32> = r.prompt.iter().chain(&r.completion).copied().collect();
    assert_eq!(ids, full);
    assert_eq!(
        tok.decode(&r.completion, false).unwrap(),
        "hello<|im_end|>\n",
        "the completion starts after `assistant\\n`, where the two renderings part"
    );
}

/// DPO data without a prompt column (TRL's implicit prompt, e.g. ultrafeedback_binarized):
/// the prompt is the common beginning of `chosen` and `rejected`, found as TRL finds it, and
/// the run trains as with an explicit prompt.
#[test]
fn dpo_rows_without_a_prompt_column_share_their_beginning() {
    let dir = fixture(Arch::Qwen2);
    let conv = |answer: &str| {
        format!(
            r#"[{{"role": "user", "content": "What color is the sky?"}}, {{"role": "assistant", "content": "{answer}"}}]"#
        )
    };
    let lines: String = (0..4)
        .map(|_| {
            format!(
                "{{\"chosen\": {}, \"rejected\": {}}}\n",
                conv("It is blue."),
                conv("It is green.")
            )
        })
        .collect();
    std::fs::write(dir.path().join("implicit.jsonl"), lines).unwrap();
    let row = r#"{"prompt": [{"role": "user", "content": "What color is the sky?"}], "chosen": [{"role": "assistant", "content": "It is blue."}], "rejected": [{"role": "assistant", "content": "It is green."}]}"#;
    let explicit = format!("{row}\n").repeat(4);
    std::fs::write(dir.path().join("explicit.jsonl"), explicit).unwrap();
    let setup_of = |name: &str, file: &str| {
        let text = config_text(dir.path(), name, "dpo", 2, "").replace("dpo.jsonl", file);
        let p = dir.path().join(format!("{name}.toml"));
        std::fs::write(&p, text).unwrap();
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap()
    };
    let (a, b) = (
        setup_of("implicit", "implicit.jsonl"),
        setup_of("explicit", "explicit.jsonl"),
    );
    let ra = trainer::supervised::rows(&a.cfg, &a.tokenizer, &first_rows(&a.train, 1)).unwrap();
    let rb = trainer::supervised::rows(&b.cfg, &b.tokenizer, &first_rows(&b.train, 1)).unwrap();
    assert_eq!(
        (&ra[0].prompt, &ra[0].completion, &ra[0].rejected),
        (&rb[0].prompt, &rb[0].completion, &rb[0].rejected)
    );
    let (x, y) = (
        run(a, &RunOptions::default()),
        run(b, &RunOptions::default()),
    );
    for (m, n) in x.metrics.iter().zip(&y.metrics) {
        assert_eq!(m["loss"], n["loss"]);
    }
    // Without a prompt column and without both completion columns: the usual one-line error.
    std::fs::write(dir.path().join("neither.jsonl"), "{\"chosen\": \"a\"}\n").unwrap();
    let text =
        config_text(dir.path(), "neither", "dpo", 1, "").replace("dpo.jsonl", "neither.jsonl");
    let p = dir.path().join("neither.toml");
    std::fs::write(&p, text).unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap_err()
    );
    assert!(e.contains("no prompt column"), "{e}");
}

/// SFT data in TRL's conversational (`messages`) and language-modelling (`text`) formats
/// trains without naming the column, as TRL finds them.
#[test]
fn sft_finds_messages_and_text_columns_as_trl_does() {
    let dir = fixture(Arch::Qwen2);
    std::fs::write(
        dir.path().join("text.jsonl"),
        "{\"text\": \"the sky is blue\"}\n".repeat(4),
    )
    .unwrap();
    for (file, column) in [("chat.jsonl", "messages"), ("text.jsonl", "text")] {
        let text = config_text(dir.path(), column, "sft", 1, "").replace("sft.jsonl", file);
        let p = dir.path().join(format!("{column}.toml"));
        std::fs::write(&p, text).unwrap();
        let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
        assert_eq!(s.cfg.data.prompt_field, column);
        let r = run(s, &RunOptions::default());
        assert!(r.metrics[0]["loss"].is_finite());
    }
}

/// `assistant_only_loss` with a template that marks assistant output with `{% generation %}`
/// (TRL's training templates): the loss tokens are exactly those the blocks produced, as
/// transformers' `return_assistant_tokens_mask` marks them.
#[test]
fn assistant_only_loss_follows_generation_blocks() {
    let dir = fixture(Arch::Qwen2);
    let jinja = dir.path().join("train.jinja");
    std::fs::write(
        &jinja,
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{% if m.role == 'assistant' %}{% generation %}{{ m.content }}<|im_end|>{% endgeneration %}\n{% else %}{{ m.content }}<|im_end|>\n{% endif %}{% endfor %}",
    )
    .unwrap();
    let text = config_text(dir.path(), "gen", "sft", 1, "")
        .replace("sft.jsonl", "chat.jsonl")
        .replace(
            "[model]\n",
            &format!("[model]\nchat_template_path = \"{}\"\n", jinja.display()),
        )
        + "\n[sft]\nmax_length = 512\nassistant_only_loss = true\n";
    let s = setup_text(&dir.path().join("gen.toml"), text);
    let r = &trainer::supervised::rows(&s.cfg, &s.tokenizer, &first_rows(&s.train, 1)).unwrap()[0];
    let kept: Vec<u32> = r
        .completion
        .iter()
        .zip(&r.mask)
        .filter(|(_, m)| **m == 1)
        .map(|(t, _)| *t)
        .collect();
    assert_eq!(
        s.tokenizer.decode(&kept, false).unwrap(),
        "hello friend<|im_end|>goodbye now<|im_end|>"
    );
    let all: Vec<u32> = r.prompt.iter().chain(&r.completion).copied().collect();
    assert!(
        s.tokenizer
            .decode(&all, false)
            .unwrap()
            .starts_with("<|im_start|>user\nhi there")
    );
}

/// Tool-calling SFT rows (TRL's format): messages with `tool_calls`, tool turns, and a `tools`
/// column reach the chat template as transformers hands them to it.
#[test]
fn tool_calling_rows_render_their_calls_and_tools() {
    let dir = fixture(Arch::Qwen2);
    let row = r#"{"messages": [{"role": "user", "content": "Weather in Paris?"}, {"role": "assistant", "content": null, "tool_calls": [{"type": "function", "function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]}, {"role": "tool", "content": "sunny", "name": "get_weather"}, {"role": "assistant", "content": "It is sunny."}], "tools": [{"type": "function", "function": {"name": "get_weather"}}]}"#;
    std::fs::write(dir.path().join("tools.jsonl"), format!("{row}\n")).unwrap();
    let jinja = dir.path().join("tools.jinja");
    std::fs::write(
        &jinja,
        "{% if tools %}<tools>{% for t in tools %}{{ t.function.name }}{% endfor %}</tools>\n{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}{% if m.name %}:{{ m.name }}{% endif %}\n{% if m.tool_calls %}{% for c in m.tool_calls %}<call>{{ c.function.name }}({{ c.function.arguments | tojson }})</call>{% endfor %}{% else %}{{ m.content }}{% endif %}<|im_end|>\n{% endfor %}",
    )
    .unwrap();
    let text = config_text(dir.path(), "tools", "sft", 1, "")
        .replace("sft.jsonl", "tools.jsonl")
        .replace(
            "[model]\n",
            &format!("[model]\nchat_template_path = \"{}\"\n", jinja.display()),
        );
    let s = setup_text(&dir.path().join("tools.toml"), text);
    let r = &trainer::supervised::rows(&s.cfg, &s.tokenizer, &first_rows(&s.train, 1)).unwrap()[0];
    let ids: Vec<u32> = r.prompt.iter().chain(&r.completion).copied().collect();
    assert_eq!(
        s.tokenizer.decode(&ids, false).unwrap(),
        // (trim_blocks eats the newline after `{% endif %}`, as jinja2 does.)
        "<tools>get_weather</tools>\n<|im_start|>userWeather in Paris?<|im_end|>\n<|im_start|>assistant<call>get_weather({\"city\": \"Paris\"})</call><|im_end|>\n<|im_start|>tool:get_weathersunny<|im_end|>\n<|im_start|>assistantIt is sunny.<|im_end|>\n"
    );
    // A `tools` cell that is not a list of schemas is named.
    std::fs::write(
        dir.path().join("tools.jsonl"),
        r#"{"messages": [{"role": "user", "content": "hi"}], "tools": "nope"}"#.to_string() + "\n",
    )
    .unwrap();
    let p = dir.path().join("tools.toml");
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        trainer::supervised::rows(&s.cfg, &s.tokenizer, &first_rows(&s.train, 1)).unwrap_err()
    );
    assert!(e.contains("`tools`"), "{e}");
}

/// TRL's SFTConfig `eos_token` / `pad_token`: completions end with the given token; one the
/// vocabulary lacks is refused, naming the key.
#[test]
fn sft_eos_and_pad_tokens() {
    let dir = tempfile::tempdir().unwrap();
    let s = setup(
        dir.path(),
        "eos",
        "sft",
        1,
        "[sft]\neos_token = \"<|endoftext|>\"\npad_token = \"<|im_start|>\"\n",
    );
    let eos = s.tokenizer.inner.token_to_id("<|endoftext|>").unwrap();
    assert_eq!(
        s.tokenizer.pad_token_id,
        s.tokenizer.inner.token_to_id("<|im_start|>").unwrap()
    );
    let r = &trainer::supervised::rows(&s.cfg, &s.tokenizer, &first_rows(&s.train, 1)).unwrap()[0];
    assert_eq!(r.completion.last(), Some(&eos));
    assert!(run(s, &RunOptions::default()).metrics[0]["loss"].is_finite());
    let p = dir.path().join("bad.toml");
    std::fs::write(
        &p,
        config_text(
            dir.path(),
            "bad",
            "sft",
            1,
            "[sft]\neos_token = \"<nope>\"\n",
        ),
    )
    .unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap_err()
    );
    assert!(e.contains("sft.eos_token") && e.contains("<nope>"), "{e}");
}

/// KTO (TRL 1.16's KTOTrainer) on unpaired, labelled rows: the first step, where the policy is
/// the reference, has loss 1/2 and KL 0; training raises the desirable completions' reward over
/// the undesirable ones'; apo_zero_unpaired trains too; what cannot work is refused.
#[test]
fn a_tiny_kto_run_separates_desirable_from_undesirable() {
    let dir = tempfile::tempdir().unwrap();
    let r = run(
        // Shuffled (KTO's default is file order, as TRL's): at this high learning rate the
        // alternating rows in order overshoot at the last step.
        setup(
            dir.path(),
            "kto",
            "kto",
            16,
            "shuffle_dataset = true\n[kto]\nbeta = 0.5\n",
        ),
        &RunOptions::default(),
    );
    let m0 = &r.metrics[0];
    assert!((m0["loss"] - 0.5).abs() < 1e-6, "{m0:?}");
    assert!(
        m0["kl"].abs() < 1e-6 && m0["rewards/chosen"].abs() < 1e-6,
        "{m0:?}"
    );
    let last = r.metrics.last().unwrap();
    assert!(last["rewards/margins"] > 0.5, "{last:?}");
    assert!(last["loss"] < 0.45, "{last:?}");
    for k in [
        "rewards/rejected",
        "logps/chosen",
        "logps/rejected",
        "grad_norm",
    ] {
        assert!(last[k].is_finite(), "{k}");
    }
    // Reference log-probs precomputed (cached by row, over two epochs): the same run.
    let plain = run(
        setup(dir.path(), "kto-fly", "kto", 8, ""),
        &RunOptions::default(),
    );
    let cached = run(
        setup(
            dir.path(),
            "kto-cached",
            "kto",
            8,
            "[kto]\nprecompute_ref_log_probs = true\n",
        ),
        &RunOptions::default(),
    );
    for (a, b) in plain.metrics.iter().zip(&cached.metrics) {
        assert!(
            (a["loss"] - b["loss"]).abs() < 1e-9,
            "{} vs {}",
            a["loss"],
            b["loss"]
        );
    }
    let apo = run(
        setup(
            dir.path(),
            "apo",
            "kto",
            4,
            "[kto]\nloss_type = \"apo_zero_unpaired\"\n",
        ),
        &RunOptions::default(),
    );
    assert!((apo.metrics[0]["loss"] - 0.5).abs() < 1e-6);
    // The KL estimate pairs each prompt with another row's completion: a micro-batch of one
    // has none.
    let bad = dir.path().join("one.toml");
    let text = config_text(dir.path(), "one", "kto", 1, "").replace(
        "per_device_train_batch_size = 2",
        "per_device_train_batch_size = 1",
    );
    std::fs::write(&bad, text).unwrap();
    let e = format!("{:#}", config::load(&bad, &[]).unwrap_err());
    assert!(e.contains("per_device_train_batch_size"), "{e}");
    // A label that is not a boolean is named with its row.
    std::fs::write(
        dir.path().join("kto.jsonl"),
        "{\"prompt\": \"a\", \"completion\": \" b\", \"label\": \"yes\"}\n".repeat(4),
    )
    .unwrap();
    let s = setup(dir.path(), "badlabel", "kto", 1, "");
    let e = format!(
        "{:#}",
        trainer::supervised::rows(&s.cfg, &s.tokenizer, &first_rows(&s.train, 1)).unwrap_err()
    );
    assert!(e.contains("row 0") && e.contains("`label`"), "{e}");
}

/// KTO on preference pairs (TRL unpairs them): each pair gives a desirable row (chosen) and an
/// undesirable one (rejected), the batch's chosen first; training separates them.
#[test]
fn kto_unpairs_preference_rows() {
    let dir = tempfile::tempdir().unwrap();
    drop(setup(dir.path(), "first", "kto", 1, ""));
    let text = config_text(dir.path(), "paired", "kto", 12, "[kto]\nbeta = 0.5\n")
        .replace("kto.jsonl", "dpo.jsonl");
    let s = setup_text(&dir.path().join("paired.toml"), text);
    let samples = first_rows(&s.train, 2);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    assert_eq!(rows.len(), 4);
    assert_eq!(
        rows.iter().map(|r| r.desirable).collect::<Vec<_>>(),
        vec![true, true, false, false]
    );
    let yes = s.tokenizer.decode(&rows[0].completion, false).unwrap();
    let no = s.tokenizer.decode(&rows[2].completion, false).unwrap();
    assert!(
        yes.starts_with(" yes, gladly") && no.starts_with(" no"),
        "{yes:?} / {no:?}"
    );
    assert_eq!(rows[0].prompt, rows[2].prompt);
    let r = run(s, &RunOptions::default());
    assert!((r.metrics[0]["loss"] - 0.5).abs() < 1e-6);
    assert!(
        r.metrics.last().unwrap()["rewards/margins"] > 0.5,
        "{:?}",
        r.metrics.last()
    );
}

/// ORPO and CPO's SimPO learn the preference without a reference model (none is loaded):
/// the margin and the accuracy rise, the chosen side's NLL falls, on the CPU and with LoRA
/// and gradient checkpointing.
#[test]
fn orpo_and_simpo_runs_raise_the_margin_without_a_reference_model() {
    let dir = tempfile::tempdir().unwrap();
    let simpo = "[cpo]\nloss_type = \"simpo\"\nbeta = 2.0\nsimpo_gamma = 0.5\n";
    let lora = "gradient_checkpointing = true\n[model.lora]\nr = 8\nlora_alpha = 16\n\
                target_modules = \"all-linear\"\n";
    for (alg, extra) in [
        ("orpo", "[orpo]\nbeta = 0.5\n".to_string()),
        ("cpo", simpo.to_string()),
        ("orpo", format!("{lora}[orpo]\nbeta = 0.5\n")),
    ] {
        let s = setup(
            dir.path(),
            &format!("{alg}-{}", extra.len()),
            alg,
            16,
            &extra,
        );
        assert!(s.reference.is_none(), "{alg} keeps no reference model");
        let r = run(s, &RunOptions::default());
        let (m0, last) = (&r.metrics[0], r.metrics.last().unwrap());
        assert!(
            last["rewards/margins"] > m0["rewards/margins"] + 0.1,
            "{alg}: {m0:?} -> {last:?}"
        );
        assert_eq!(last["rewards/accuracies"], 1.0, "{alg}: {last:?}");
        assert!(
            last["nll_loss"] < m0["nll_loss"],
            "{alg}: {m0:?} -> {last:?}"
        );
        assert!(last["loss"] < m0["loss"], "{alg}");
        if alg == "orpo" {
            assert!(last["log_odds_chosen"] > m0["log_odds_chosen"], "{last:?}");
        }
    }
}

/// The held-out split reports ORPO's metrics under `eval/`.
#[test]
fn orpo_eval_split_reports_its_metrics() {
    let dir = tempfile::tempdir().unwrap();
    drop(setup(dir.path(), "first", "orpo", 1, ""));
    let text = config_text(dir.path(), "eval", "orpo", 4, "eval_steps = 2")
        .replace("[data]\n", "[data]\neval_fraction = 0.25\n");
    run(
        setup_text(&dir.path().join("eval.toml"), text),
        &RunOptions::default(),
    );
    let evals = eval_lines(&dir.path().join("eval"));
    assert_eq!(evals.len(), 2);
    for e in &evals {
        for k in [
            "eval/loss",
            "eval/rewards/accuracies",
            "eval/nll_loss",
            "eval/log_odds_ratio",
        ] {
            assert!(e[k].as_f64().is_some_and(f64::is_finite), "{k}: {e}");
        }
    }
}

/// ORPO's and CPO's settings are checked before anything loads, in one line each; a pair
/// whose completion is missing names its row.
#[test]
fn orpo_and_cpo_refuse_bad_settings_and_rows_in_one_line() {
    let dir = fixture(Arch::Llama);
    let cases = [
        ("orpo", "[orpo]\nbeta = 0.0\n", "`orpo.beta` must be > 0"),
        (
            "orpo",
            "[reference]\nbeta = 0.1\n",
            "orpo has no reference model",
        ),
        (
            "cpo",
            "[cpo]\nloss_type = \"alphapo\"\ncpo_alpha = 1.0\n",
            "is simpo with `cpo_alpha = 0`",
        ),
        (
            "cpo",
            "[cpo]\nloss_type = \"hinge\"\nlabel_smoothing = 0.1\n",
            "does not apply to loss_type hinge",
        ),
        (
            "cpo",
            "[cpo]\nloss_type = \"dpo\"\n",
            "unknown variant `dpo`",
        ),
        (
            "cpo",
            "[cpo]\nchosen_field = \"rejected\"\n",
            "`cpo.chosen_field` and `cpo.rejected_field` must differ",
        ),
    ];
    for (alg, extra, want) in cases {
        let e = config_error(dir.path(), alg, extra);
        assert!(
            e.contains(want) && !e.trim().contains('\n'),
            "{alg} {extra}: {e}"
        );
    }
    // A missing column is named before the run; an empty completion names its row.
    let text = config_text(
        dir.path(),
        "cols",
        "orpo",
        1,
        "[orpo]\nrejected_field = \"worse\"\n",
    );
    std::fs::write(dir.path().join("cols.toml"), text).unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&dir.path().join("cols.toml"), &[]).unwrap()).unwrap_err()
    );
    assert!(e.contains("worse") && e.contains("ORPO"), "{e}");
    std::fs::write(
        dir.path().join("dpo.jsonl"),
        "{\"prompt\": \"a\", \"chosen\": \" b\", \"rejected\": \" c\"}\n\
         {\"prompt\": \"a\", \"chosen\": null, \"rejected\": \" c\"}\n",
    )
    .unwrap();
    let text = config_text(dir.path(), "rows", "cpo", 1, "")
        .replace("prompts_per_step = 4", "prompts_per_step = 2")
        .replace("[train]\n", "[train]\nshuffle_dataset = false\n");
    let s = setup_text(&dir.path().join("rows.toml"), text);
    let e = format!(
        "{:#}",
        trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err()
    );
    assert!(e.contains("row 1: column `chosen` is empty"), "{e}");
}

/// ORPO's rows as TRL tokenises them: without a prompt column the prompt is the pair's common
/// beginning; every prompt keeps its tokens, the completions end with EOS and are cut to fit
/// `max_length` after their prompt; a pair left without a completion token is dropped.
#[test]
fn orpo_rows_keep_the_prompt_and_cut_the_completions() {
    let dir = fixture(Arch::Llama);
    std::fs::write(
        dir.path().join("implicit.jsonl"),
        "{\"chosen\": \"Question: yes indeed\", \"rejected\": \"Question: no\"}\n",
    )
    .unwrap();
    let text = config_text(dir.path(), "rows", "orpo", 1, "[orpo]\nmax_length = 8\n").replace(
        &dir.path().join("dpo.jsonl").display().to_string(),
        &dir.path().join("implicit.jsonl").display().to_string(),
    );
    let s = setup_text(&dir.path().join("rows.toml"), text);
    let samples = first_rows(&s.train, 1);
    let tok = &s.tokenizer;
    let rows = trainer::supervised::rows(&s.cfg, tok, &samples).unwrap();
    assert_eq!(rows.len(), 1);
    let r = &rows[0];
    let eos = tok.eos_token_ids[0];
    let prompt = tok.encode("Question:", false).unwrap();
    assert_eq!(r.prompt, prompt);
    assert!(r.rejected_prompt.is_empty(), "both sides share the prompt");
    for side in [&r.completion, &r.rejected] {
        assert!(r.prompt.len() + side.len() <= 8);
    }
    let whole = |c: &str| {
        let mut ids = tok.encode(&format!("Question:{c}"), false).unwrap()[prompt.len()..].to_vec();
        ids.push(eos);
        ids
    };
    assert_eq!(r.rejected, whole(" no")[..r.rejected.len()]);
    assert_eq!(r.completion, whole(" yes indeed")[..8 - prompt.len()]);
    // A prompt that fills max_length leaves nothing to score: the pair is dropped.
    let mut cfg = s.cfg.clone();
    cfg.orpo.max_length = prompt.len();
    assert!(
        trainer::supervised::rows(&cfg, tok, &samples)
            .unwrap()
            .is_empty()
    );
}

/// TPO's rows: without a prompt column the prompt `chosen` and `rejected` share is stripped
/// from the gold column too (which must start with it, else the row is named); a missing gold
/// column is named before the run; a tiny run learns the preference with no reference model,
/// and `tpo_alpha = 0` trains without the gold sequence.
#[test]
fn tpo_rows_runs_and_refusals() {
    let dir = fixture(Arch::Llama);
    std::fs::write(
        dir.path().join("implicit.jsonl"),
        "{\"chosen\": \"Question: yes\", \"rejected\": \"Question: no\", \"reference\": \"Question: yes indeed\"}\n\
         {\"chosen\": \"Q: a\", \"rejected\": \"Q: b\", \"reference\": \"Other: a\"}\n",
    )
    .unwrap();
    let implicit = dir.path().join("implicit.jsonl").display().to_string();
    let dpo = dir.path().join("dpo.jsonl").display().to_string();
    let text = config_text(dir.path(), "rows", "tpo", 1, "").replace(&dpo, &implicit);
    let s = setup_text(&dir.path().join("rows.toml"), text);
    let samples = first_rows(&s.train, 2);
    let tok = &s.tokenizer;
    let r = &trainer::supervised::rows(&s.cfg, tok, &samples[..1]).unwrap()[0];
    let prompt = tok.encode("Question:", false).unwrap();
    assert_eq!(r.prompt, prompt);
    let mut gold = tok.encode("Question: yes indeed", false).unwrap()[prompt.len()..].to_vec();
    gold.extend(tok.eos_token_ids.first());
    assert_eq!(r.gold, gold);
    let e = format!(
        "{:#}",
        trainer::supervised::rows(&s.cfg, tok, &samples[1..]).unwrap_err()
    );
    assert!(
        e.contains("row 1") && e.contains("`reference` does not start with the prompt"),
        "{e}"
    );

    // The DPO rows have no gold column: named before the run.
    let text = config_text(dir.path(), "nogold", "tpo", 1, "");
    std::fs::write(dir.path().join("nogold.toml"), text).unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&dir.path().join("nogold.toml"), &[]).unwrap()).unwrap_err()
    );
    assert!(e.contains("reference") && e.contains("TPO"), "{e}");

    let mut triples = String::new();
    for i in 0..16 {
        triples.push_str(&format!(
            "{{\"prompt\": \"Question {i}:\", \"chosen\": \" yes, gladly\", \"rejected\": \" no\", \
             \"reference\": \" yes, gladly!\"}}\n"
        ));
    }
    std::fs::write(dir.path().join("triples.jsonl"), triples).unwrap();
    let data = dir.path().join("triples.jsonl").display().to_string();
    for (name, extra) in [
        ("tpo", "[tpo]\nbeta = 0.5\n"),
        ("tpo0", "[tpo]\nbeta = 0.5\ntpo_alpha = 0.0\n"),
    ] {
        let text = config_text(dir.path(), name, "tpo", 12, extra).replace(&dpo, &data);
        let s = setup_text(&dir.path().join(format!("{name}.toml")), text);
        assert!(s.reference.is_none());
        let r = run(s, &RunOptions::default());
        let (m0, last) = (&r.metrics[0], r.metrics.last().unwrap());
        assert!(
            last["rewards/margins"] > m0["rewards/margins"] + 0.1,
            "{name}: {m0:?} -> {last:?}"
        );
        assert_eq!(last["rewards/accuracies"], 1.0, "{name}");
        assert_eq!(m0["nll_loss"] == 0.0, name == "tpo0", "{name}: {m0:?}");
    }
    // The subcommand (the config says nothing of the algorithm).
    let text = config_text(dir.path(), "cli", "tpo", 2, "")
        .replace(&dpo, &data)
        .replace("algorithm = \"tpo\"", "");
    let p = dir.path().join("cli.toml");
    std::fs::write(&p, text).unwrap();
    grpo_cli_ok(&["tpo", "--config", p.to_str().unwrap()]);
    let metrics = std::fs::read_to_string(dir.path().join("cli/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);
    let e = config_error(dir.path(), "tpo", "[tpo]\nloss_type = \"simpo\"\n");
    assert!(e.contains("unknown variant `simpo`"), "{e}");
    let e = config_error(dir.path(), "tpo", "[tpo]\nreference_field = \"chosen\"\n");
    assert!(e.contains("must differ"), "{e}");
}

/// An MoE policy's SFT (padded and packed), DPO, KTO and ORPO losses carry TRL's
/// load-balancing term (the model config's `router_aux_loss_coef` by default), logged as
/// `aux_loss`; `loss.router_aux_loss_coef = 0` switches it off.
#[test]
fn moe_supervised_runs_add_the_load_balancing_loss() {
    let dir = fixture(Arch::Mixtral);
    let cases = [
        ("sft", ""),
        ("sft-packed", "[sft]\npacking = true\nmax_length = 64\n"),
        ("dpo", ""),
        ("kto", ""),
        ("orpo", ""),
    ];
    for (name, extra) in cases {
        let alg = name.split('-').next().unwrap();
        let r = run(
            setup(dir.path(), name, alg, 1, extra),
            &RunOptions::default(),
        );
        let aux = r.metrics[0]
            .get("aux_loss")
            .copied()
            .unwrap_or_else(|| panic!("{name}: no aux_loss in {:?}", r.metrics[0]));
        // Near-uniform routing of 4 experts, 2 per token: about E · Σ (2/E)(1/E) = 2.
        assert!(aux > 1.5 && aux < 3.0, "{name}: aux_loss {aux}");
    }
    let r = run(
        setup(
            dir.path(),
            "off",
            "sft",
            1,
            "[loss]\nrouter_aux_loss_coef = 0.0\n",
        ),
        &RunOptions::default(),
    );
    assert!(!r.metrics[0].contains_key("aux_loss"));
}

/// TRL's BCO loss of KTO rows from the policy's and the reference's summed log-probs and `δ`:
/// the mean of `−log σ(±(β(π − π_ref) − δ))` by label.
fn bco_trl_loss(
    policy: &grpo_rollout::Transformer,
    reference: &grpo_rollout::Transformer,
    rows: &[trainer::supervised::Row],
    beta: f64,
    delta: f64,
) -> (f64, Vec<f64>) {
    let sum = |m: &grpo_rollout::Transformer, r: &trainer::supervised::Row| -> f64 {
        common::token_logps(m, &r.prompt, &r.completion, 1.0)
            .iter()
            .sum()
    };
    let rewards: Vec<f64> = rows
        .iter()
        .map(|r| beta * (sum(policy, r) - sum(reference, r)))
        .collect();
    let loss = rows
        .iter()
        .zip(&rewards)
        .map(|(r, x)| {
            let s = if r.desirable { 1.0 } else { -1.0 };
            (1.0 + (-s * (x - delta)).exp()).ln()
        })
        .sum::<f64>()
        / rows.len() as f64;
    (loss, rewards)
}

/// BCO's underlying distribution matching (`[bco] embedding_model_name_or_path`, TRL's
/// BCOTrainer with an `embedding_func`): each undesirable row's loss is weighted by its
/// prompt's density ratio. With the ratio pinned (`min = max = 3`), the first step (at the
/// reference: every row's loss ln 2, one desirable and one undesirable row per micro-batch)
/// has loss 2·ln 2; unpinned, the step's logged weight is the classifier's odds on those rows'
/// prompts embedded here (decoded, re-encoded, mean-pooled), the classifier is in the
/// checkpoint's state and a resumed run keeps it (the same steps); a bad value is refused.
#[test]
fn bco_udm_weighs_undesirable_rows_by_their_prompts_density_ratio() {
    let dir = tempfile::tempdir().unwrap();
    let plain = run(
        setup(dir.path(), "plain", "bco", 1, "[kto]\nbeta = 0.5\n"),
        &RunOptions::default(),
    );
    let model = dir.path().join("model");
    let udm = |lo: f64, hi: f64| {
        format!(
            "[kto]\nbeta = 0.5\n[bco]\nembedding_model_name_or_path = \"{}\"\n\
             prompt_sample_size = 64\nmin_density_ratio = {lo}\nmax_density_ratio = {hi}\n",
            model.display()
        )
    };
    let pinned = run(
        setup(dir.path(), "pinned", "bco", 1, &udm(3.0, 3.0)),
        &RunOptions::default(),
    );
    let ln2 = std::f64::consts::LN_2;
    assert!((plain.metrics[0]["loss"] - ln2).abs() < 1e-6);
    assert!(!plain.metrics[0].contains_key("udm/rejected_weight"));
    let m = &pinned.metrics[0];
    assert!((m["loss"] - 2.0 * ln2).abs() < 1e-6, "{m:?}");
    assert!((m["udm/rejected_weight"] - 3.0).abs() < 1e-9);

    // Unpinned: TRL's bounds.
    let s = setup(dir.path(), "udm", "bco", 4, &udm(0.5, 10.0));
    let samples = first_rows(&s.train, 4);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    let r = run(s, &RunOptions::default());
    let ck = r.best_checkpoint_path.unwrap();
    let state: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("trainer_state.json")).unwrap())
            .unwrap();
    let clf: grpo_core::udm::UdmClassifier =
        serde_json::from_value(state["bco_udm"].clone()).unwrap();
    let emb =
        grpo_rollout::load(&model, candle_core::DType::F32, &candle_core::Device::Cpu).unwrap();
    let weights: Vec<f64> = rows
        .iter()
        .filter(|r| !r.desirable)
        .map(|r| {
            let text = emb.tokenizer.decode(&r.prompt, false).unwrap();
            let ids = emb.tokenizer.encode(&text, false).unwrap();
            let e: Vec<f32> = emb
                .model
                .mean_hidden(&[&ids])
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_vec1()
                .unwrap();
            clf.density_ratio(&e, 0.5, 10.0)
        })
        .collect();
    assert_eq!(weights.len(), 2);
    let want = weights.iter().sum::<f64>() / 2.0;
    let got = r.metrics[0]["udm/rejected_weight"];
    assert!((got - want).abs() < 1e-4 * want, "{got} vs {want}");
    assert!(weights.iter().all(|w| (0.5..=10.0).contains(w)));
    // Stopped after 2 steps and resumed: the classifier comes back with the state.
    let text = config_text(dir.path(), "udm-parts", "bco", 4, &udm(0.5, 10.0));
    let p = dir.path().join("udm-parts.toml");
    std::fs::write(&p, &text).unwrap();
    let parts = common::stopped_and_resumed(2, |o| {
        run(trainer::setup(config::load(&p, &[]).unwrap()).unwrap(), &o)
    });
    common::assert_same_steps(
        &r.metrics,
        &parts,
        &["loss", "udm/rejected_weight", "delta"],
    );
    let e = config_error(dir.path(), "bco", &udm(2.0, 1.0));
    assert!(
        e.contains("bco.min_density_ratio") && e.lines().count() == 1,
        "{e}"
    );
}

/// BCO (TRL's experimental BCOTrainer) on KTO's rows: at the reference the loss is ln 2 and δ
/// 0; each step's loss is TRL's with δ the running mean of every implicit reward seen (this
/// step's merged in first), checked from the models' log-probs after an update; the logged δ
/// is that mean; training separates desirable from undesirable; resume is exact (the running
/// moments are in the checkpoint); what does not apply is refused.
#[test]
fn bco_learns_with_the_running_mean_of_its_rewards() {
    let dir = tempfile::tempdir().unwrap();
    let extra = "[kto]\nbeta = 0.5\n";
    let s = setup(dir.path(), "bco-exact", "bco", 2, extra);
    assert!(!s.cfg.shuffles(), "BCO reads its rows in order, as TRL's");
    let reference = s.reference.clone().unwrap();
    let samples = first_rows(&s.train, 4);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &samples).unwrap();
    let mut learner = trainer::Learner::new(&s, &dir.path().join("bco-exact")).unwrap();
    let mut seen: Vec<f64> = Vec::new();
    for step in 0..3 {
        // Two micro-batches of two rows: each merges its rewards into the running mean before
        // its loss (TRL's order); the step's loss and δ are the micro-batches' means.
        let policy = learner.policy().model.detached();
        let (mut want, mut delta) = (0.0, 0.0);
        for part in rows.chunks(2) {
            let (_, rewards) = bco_trl_loss(&policy, &reference, part, 0.5, 0.0);
            seen.extend(&rewards);
            let d = seen.iter().sum::<f64>() / seen.len() as f64;
            want += bco_trl_loss(&policy, &reference, part, 0.5, d).0 / 2.0;
            delta += d / 2.0;
        }
        let last_mean = seen.iter().sum::<f64>() / seen.len() as f64;
        let m = learner
            .supervised_step(&rows, &mut Default::default(), true)
            .unwrap();
        assert!(
            (m["loss"] - want).abs() < 1e-5 * want.max(1.0),
            "step {step}: loss {} vs TRL's {want}",
            m["loss"]
        );
        assert!(
            (m["delta"] - delta).abs() < 1e-5,
            "step {step}: δ {} vs {delta}",
            m["delta"]
        );
        let running = learner.state().bco_running.unwrap();
        assert!((running.mean - last_mean).abs() < 1e-5);
        assert!((running.count - seen.len() as f64).abs() < 1e-9);
        if step == 0 {
            assert!((want - std::f64::consts::LN_2).abs() < 1e-6);
        } else {
            assert!(delta.abs() > 1e-4, "the rewards moved: δ {delta}");
        }
    }

    let r = run(
        setup(dir.path(), "bco", "bco", 12, extra),
        &RunOptions::default(),
    );
    assert!((r.metrics[0]["loss"] - std::f64::consts::LN_2).abs() < 1e-6);
    let last = r.metrics.last().unwrap();
    assert!(last["rewards/margins"] > 0.5, "{last:?}");
    for k in [
        "rewards/chosen",
        "rewards/rejected",
        "logps/chosen",
        "logits/chosen",
        "delta",
    ] {
        assert!(last[k].is_finite(), "{k}: {last:?}");
    }
    // Stopped after 3 steps and resumed: the same steps, δ included.
    let stop = RunOptions {
        stop_after: Some(3),
        ..Default::default()
    };
    let cfg_text = config_text(dir.path(), "bco-parts", "bco", 6, extra);
    let p = dir.path().join("bco-parts.toml");
    std::fs::write(&p, &cfg_text).unwrap();
    let mut joined = run(
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap(),
        &stop,
    )
    .metrics;
    let resume = RunOptions {
        resume: Some(None),
        ..Default::default()
    };
    joined.extend(
        run(
            trainer::setup(config::load(&p, &[]).unwrap()).unwrap(),
            &resume,
        )
        .metrics,
    );
    assert_eq!(joined.len(), 6);
    for (a, b) in joined.iter().zip(&r.metrics) {
        for k in ["loss", "delta", "rewards/margins"] {
            assert!(
                (a[k] - b[k]).abs() < 1e-6 * b[k].abs().max(1.0),
                "{k}: {} vs {}",
                a[k],
                b[k]
            );
        }
    }
    for (extra, want) in [
        (
            "[kto]\nloss_type = \"apo_zero_unpaired\"\n",
            "do not apply to it",
        ),
        ("[kto]\ndesirable_weight = 2.0\n", "do not apply to it"),
        ("[kto]\nbeta = 0.0\n", "`kto.beta` must be > 0"),
        (
            "[kto]\nmax_length = 1\n",
            "`kto.max_length` (BCO's) must be >= 2",
        ),
    ] {
        let e = config_error(dir.path(), "bco", extra);
        assert!(e.contains(want) && !e.trim().contains('\n'), "{extra}: {e}");
    }
}
