//! Reward modelling (TRL 1.16's RewardTrainer, `algorithm = "reward"`): rows tokenised as TRL
//! tokenises them, the first step's loss recomputed from the initial model, a tiny run that
//! learns to rank, exact resume, LoRA with the head trained whole, and the trained model read
//! back as a `*ForSequenceClassification` checkpoint (the `reward_model` reward's loader).
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device};
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_rollout::scoring::ClassifierModel;
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{all_rows, assert_same_steps, eval_lines};

/// Pairs: a polite answer is preferred to a curt one.
fn pairs(n: usize, margin: bool) -> String {
    (0..n)
        .map(|i| {
            let m = if margin {
                format!(", \"margin\": {}", i % 3)
            } else {
                String::new()
            };
            format!(
                "{{\"prompt\": \"Question {i}:\", \"chosen\": \" yes, gladly\", \"rejected\": \" no\"{m}}}\n"
            )
        })
        .collect()
}

fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, Arch::Llama, 4).unwrap();
    std::fs::write(dir.path().join("pairs.jsonl"), pairs(16, false)).unwrap();
    dir
}

fn config_text(root: &Path, name: &str, data: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "reward"
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

fn setup(root: &Path, name: &str, data: &str, steps: usize, extra: &str) -> trainer::Setup {
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, config_text(root, name, data, steps, extra)).unwrap();
    trainer::setup(config::load(&p, &[]).unwrap()).unwrap()
}

fn run(s: trainer::Setup, opts: &RunOptions) -> trainer::TrainingResult {
    trainer::run(s, opts, &mut trainer::NoCallbacks).unwrap()
}

#[test]
fn rows_are_tokenised_as_trl_tokenises_reward_pairs() {
    let dir = fixture();
    let root = dir.path();
    let s = setup(root, "rows", "pairs.jsonl", 1, "");
    let tok = &s.tokenizer;
    let eos = tok.eos_token.clone().unwrap();
    let rows = trainer::supervised::rows(&s.cfg, tok, &all_rows(&s.train)).unwrap();
    assert_eq!(rows.len(), 16);
    // Plain text: prompt + chosen + EOS as one string, with the tokenizer's special tokens.
    let r = &rows[3];
    assert!(r.prompt.is_empty());
    let want = |t: &str| tok.encode(&format!("Question 3:{t}{eos}"), true).unwrap();
    assert_eq!(r.completion, want(" yes, gladly"));
    assert_eq!(r.rejected, want(" no"));
    assert_eq!(r.margin, 0.0);

    // Conversations: prompt + chosen turns rendered whole by the chat template, no generation
    // prompt, no special tokens added; no prompt column: the columns are the whole sequences;
    // a `margin` column is read.
    let conv = |who: &str, what: &str| format!("{{\"role\": \"{who}\", \"content\": \"{what}\"}}");
    let line = format!(
        "{{\"prompt\": [{}], \"chosen\": [{}], \"rejected\": [{}], \"margin\": 1.5}}\n",
        conv("user", "hi"),
        conv("assistant", "hello there"),
        conv("assistant", "go away")
    );
    std::fs::write(root.join("conv.jsonl"), line.repeat(2)).unwrap();
    let whole = format!(
        "{{\"chosen\": [{}, {}], \"rejected\": [{}, {}]}}\n",
        conv("user", "hi"),
        conv("assistant", "hello there"),
        conv("user", "hi"),
        conv("assistant", "go away")
    );
    std::fs::write(root.join("whole.jsonl"), whole.repeat(2)).unwrap();
    let mut rendered = Vec::new();
    for (name, margin) in [("conv", 1.5), ("whole", 0.0)] {
        let s = setup(root, name, &format!("{name}.jsonl"), 1, "");
        let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap();
        let msgs = |reply: &str| {
            vec![
                grpo_rollout::ChatMessage::new("user", "hi"),
                grpo_rollout::ChatMessage::new("assistant", reply),
            ]
        };
        let render = |reply: &str| {
            let text = s
                .tokenizer
                .apply_chat_template(&msgs(reply), false)
                .unwrap();
            s.tokenizer.encode(&text, false).unwrap()
        };
        assert_eq!(rows[0].completion, render("hello there"), "{name}");
        assert_eq!(rows[0].rejected, render("go away"), "{name}");
        assert_eq!(rows[0].margin, margin);
        rendered.push(rows[0].completion.clone());
    }
    assert_eq!(rendered[0], rendered[1]);

    // `max_length` drops a pair with a longer side (TRL filters; it does not cut).
    let short = rows[3].rejected.len();
    let s = setup(
        root,
        "short",
        "pairs.jsonl",
        1,
        &format!("[reward]\nmax_length = {short}\n"),
    );
    let kept = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap();
    assert!(kept.len() < 16, "the longer chosen sides are dropped");
    assert!(
        kept.iter()
            .all(|r| r.completion.len() <= short && r.rejected.len() <= short)
    );

    // Bad rows are one line naming the row and the column.
    std::fs::write(
        root.join("bad.jsonl"),
        "{\"prompt\": \"a\", \"chosen\": \" b\", \"rejected\": \" c\", \"margin\": \"big\"}\n",
    )
    .unwrap();
    let s = setup(root, "bad", "bad.jsonl", 1, "");
    let e = format!(
        "{:#}",
        trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap_err()
    );
    assert!(e.contains("row 0") && e.contains("`margin`"), "{e}");
    let mixed = format!(
        "{{\"prompt\": [{}], \"chosen\": \" b\", \"rejected\": \" c\"}}\n",
        conv("user", "hi")
    );
    std::fs::write(root.join("mixed.jsonl"), mixed).unwrap();
    let s = setup(root, "mixed", "mixed.jsonl", 1, "");
    let e = format!(
        "{:#}",
        trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap_err()
    );
    assert!(
        e.contains("row 0") && e.contains("`chosen` is plain text"),
        "{e}"
    );
    // Missing columns and bad keys are refused before the run.
    std::fs::write(
        root.join("nochosen.jsonl"),
        "{\"prompt\": \"a\", \"completion\": \" b\"}\n",
    )
    .unwrap();
    let p = root.join("nochosen.toml");
    std::fs::write(&p, config_text(root, "nochosen", "nochosen.jsonl", 1, "")).unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap_err()
    );
    assert!(
        e.contains("chosen") && e.contains("reward.chosen_field"),
        "{e}"
    );
    for (extra, want) in [
        (
            "[reward]\ncenter_rewards_coefficient = -1.0\n",
            "center_rewards_coefficient",
        ),
        ("[reward]\nmax_lenght = 3\n", "max_length"),
        (
            "[model]\ncast_lm_head_to_fp32 = true\n",
            "cast_lm_head_to_fp32",
        ),
    ] {
        let text = config_text(root, "badkey", "pairs.jsonl", 1, "");
        let text = match extra.starts_with("[model]") {
            true => text.replace("[model]\n", extra),
            false => format!("{text}{extra}"),
        };
        std::fs::write(&p, text).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want), "{e}");
    }
}

/// The first step's loss is TRL's loss of the initial model's scores on the step's pairs
/// (all four rows of the file: the order does not change a mean), recomputed here from the
/// model the trainer starts from, with margins and centring.
#[test]
fn the_first_step_is_trls_loss_of_the_initial_scores() {
    let dir = fixture();
    let root = dir.path();
    std::fs::write(root.join("four.jsonl"), pairs(4, true)).unwrap();
    let extra = "[reward]\ncenter_rewards_coefficient = 0.5\n";
    let s = setup(root, "four", "four.jsonl", 1, extra);
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap();
    let model = s.policy.model.detached();
    assert!(model.cfg.sequence_classification && model.lm_head.is_none());
    let seqs: Vec<&[u32]> = rows
        .iter()
        .map(|r| r.completion.as_slice())
        .chain(rows.iter().map(|r| r.rejected.as_slice()))
        .collect();
    let pad = s.tokenizer.pad_token_id;
    let sc: Vec<f32> = model
        .sequence_scores(&seqs, Some(pad))
        .unwrap()
        .to_vec1()
        .unwrap();
    let ln_sigmoid = |x: f64| -((-x).exp().ln_1p());
    let mut want = 0.0;
    for (i, r) in rows.iter().enumerate() {
        let (c, j) = (f64::from(sc[i]), f64::from(sc[i + 4]));
        want += -ln_sigmoid(c - j - r.margin) / 4.0 + 0.5 * (c + j).powi(2) / 4.0;
    }
    let margins: Vec<f64> = rows.iter().map(|r| r.margin).collect();
    assert!(margins.contains(&2.0) && margins.contains(&1.0));
    let r = run(s, &RunOptions::default());
    let m = &r.metrics[0];
    assert!((m["loss"] - want).abs() < 1e-5, "{} vs {want}", m["loss"]);
    let all: Vec<f64> = sc.iter().map(|&x| f64::from(x)).collect();
    let min = all.iter().copied().fold(f64::INFINITY, f64::min);
    // min_reward is the mean of the two micro-batches' minima (TRL logs per-batch values).
    assert!(m["min_reward"] >= min - 1e-6 && m["max_reward"] >= m["min_reward"]);
    let mean = all.iter().sum::<f64>() / 8.0;
    assert!((m["mean_reward"] - mean).abs() < 1e-5);
    let tokens: usize = seqs.iter().map(|x| x.len()).sum();
    assert_eq!(m["num_tokens"], tokens as f64);
}

#[test]
fn a_tiny_reward_model_learns_to_rank_and_is_a_reward_model_checkpoint() {
    let dir = fixture();
    let root = dir.path();
    let r = run(
        setup(root, "rm", "pairs.jsonl", 16, ""),
        &RunOptions::default(),
    );
    let m0 = &r.metrics[0];
    // A fresh N(0, 0.02²) head ranks at random: the loss starts near ln 2, then falls.
    assert!(m0["loss"] > 0.4 && m0["accuracy"] < 1.0, "{m0:?}");
    let last = r.metrics.last().unwrap();
    assert_eq!(last["accuracy"], 1.0, "{last:?}");
    assert!(last["margin"] > 1.0 && last["loss"] < 0.3, "{last:?}");
    for k in ["min_reward", "mean_reward", "max_reward", "grad_norm"] {
        assert!(last[k].is_finite(), "{k}");
    }
    // The checkpoint is a `*ForSequenceClassification` directory that the `reward_model`
    // reward loads, and it ranks every training pair.
    let ck = r.best_checkpoint_path.unwrap().join("model");
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cj["architectures"][0], "LlamaForSequenceClassification");
    let rm = ClassifierModel::load(&ck, DType::F32, &Device::Cpu).unwrap();
    let s = setup(root, "again", "pairs.jsonl", 1, "");
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap();
    let pad = rm.checkpoint_pad_token_id().unwrap();
    assert_eq!(pad, s.tokenizer.pad_token_id);
    let score = |ids: &[u32]| {
        let all = rm.scores(&[ids.to_vec()]).unwrap();
        all[0][ids.iter().rposition(|&x| x != pad).unwrap_or(0)]
    };
    for r in &rows {
        assert!(score(&r.completion) > score(&r.rejected) + 0.5);
    }
    // A causal-LM algorithm refuses a classifier in one line.
    let p = root.join("sft-on-rm.toml");
    let text = config_text(root, "sftrm", "pairs.jsonl", 1, "")
        .replace("algorithm = \"reward\"", "algorithm = \"dpo\"")
        .replace(
            &root.join("model").display().to_string(),
            &ck.display().to_string(),
        );
    std::fs::write(&p, text).unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap_err()
    );
    assert!(
        e.contains("sequence classifier") && e.contains("algorithm = \"reward\""),
        "{e}"
    );
    // Starting from the trained classifier keeps its head: the first loss is the trained one.
    let text = config_text(root, "more", "pairs.jsonl", 1, "").replace(
        &root.join("model").display().to_string(),
        &ck.display().to_string(),
    );
    let p = root.join("more.toml");
    std::fs::write(&p, text).unwrap();
    let more = run(
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap(),
        &RunOptions::default(),
    );
    assert!(more.metrics[0]["loss"] < 0.3, "{:?}", more.metrics[0]);
}

#[test]
fn resume_is_exact_and_lora_trains_the_head_whole() {
    let dir = fixture();
    let root = dir.path();
    let lora = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n";
    for (tag, extra) in [("full", ""), ("lora", lora)] {
        let straight = run(
            setup(root, &format!("{tag}-all"), "pairs.jsonl", 4, extra),
            &RunOptions::default(),
        );
        let name = format!("{tag}-parts");
        let first = run(
            setup(root, &name, "pairs.jsonl", 4, extra),
            &RunOptions {
                stop_after: Some(2),
                ..Default::default()
            },
        );
        assert!(first.interrupted);
        let rest = run(
            setup(root, &name, "pairs.jsonl", 4, extra),
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
    // LoRA: the adapter holds the head (PEFT's modules_to_save) and learns to rank; exported
    // merged, it is a classifier checkpoint.
    let r = run(
        setup(root, "lora-long", "pairs.jsonl", 16, lora),
        &RunOptions::default(),
    );
    let last = r.metrics.last().unwrap();
    assert_eq!(last["accuracy"], 1.0, "{last:?}");
    let ck = r.best_checkpoint_path.unwrap();
    let ac: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(ck.join("adapter/adapter_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(ac["task_type"], "SEQ_CLS");
    assert_eq!(ac["modules_to_save"], serde_json::json!(["score"]));
    let out = root.join("merged");
    let o = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["export", "--checkpoint"])
        .arg(&ck)
        .args(["--format", "merged", "--out"])
        .arg(&out)
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    let rm = ClassifierModel::load(&out, DType::F32, &Device::Cpu).unwrap();
    let s = setup(root, "probe", "pairs.jsonl", 1, "");
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap();
    let pad = s.tokenizer.pad_token_id;
    let score = |ids: &[u32]| {
        let all = rm.scores(&[ids.to_vec()]).unwrap();
        all[0][ids.iter().rposition(|&x| x != pad).unwrap_or(0)]
    };
    assert!(
        rows.iter()
            .all(|r| score(&r.completion) > score(&r.rejected))
    );
    // GGUF has no classifier form: refused in one line.
    let o = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["export", "--checkpoint"])
        .arg(&ck)
        .args(["--format", "gguf", "--out"])
        .arg(root.join("rm.gguf"))
        .output()
        .unwrap();
    assert!(!o.status.success());
    assert!(String::from_utf8_lossy(&o.stderr).contains("sequence classifier"));
}

/// An eval split is scored as TRL evaluates a reward model: `eval/loss`, `eval/accuracy`,
/// `eval/margin`, ... on held-out pairs, without updates; the accuracy rises as the model
/// learns.
#[test]
fn the_eval_split_reports_trls_reward_metrics() {
    let dir = fixture();
    let root = dir.path();
    let text = config_text(root, "eval", "pairs.jsonl", 8, "eval_steps = 4")
        .replace("[data]\n", "[data]\neval_fraction = 0.25\n");
    let p = root.join("eval.toml");
    std::fs::write(&p, text).unwrap();
    run(
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap(),
        &RunOptions::default(),
    );
    let evals = eval_lines(&root.join("eval"));
    assert_eq!(evals.len(), 2);
    for k in [
        "eval/accuracy",
        "eval/margin",
        "eval/min_reward",
        "eval/mean_reward",
        "eval/max_reward",
    ] {
        assert!(
            evals.iter().all(|e| e[k].as_f64().unwrap().is_finite()),
            "{k}"
        );
    }
    assert_eq!(
        evals[1]["eval/accuracy"].as_f64(),
        Some(1.0),
        "{:?}",
        evals[1]
    );
    assert!(evals[1]["eval/loss"].as_f64() < evals[0]["eval/loss"].as_f64());
}

/// Gradient checkpointing recomputes each layer in backward: the same losses and gradient
/// norms as the plain run.
#[test]
fn gradient_checkpointing_gives_the_same_steps() {
    let dir = fixture();
    let root = dir.path();
    let plain = run(
        setup(root, "plain", "pairs.jsonl", 3, ""),
        &RunOptions::default(),
    );
    let ckpt = run(
        setup(
            root,
            "ckpt",
            "pairs.jsonl",
            3,
            "gradient_checkpointing = true",
        ),
        &RunOptions::default(),
    );
    assert_same_steps(
        &plain.metrics,
        &ckpt.metrics,
        &["loss", "grad_norm", "accuracy"],
    );
}

#[test]
fn the_reward_subcommand() {
    let dir = fixture();
    let root = dir.path();
    // No learning rate: TRL RewardConfig's 1e-4, recorded in the run's config.json.
    let text = config_text(root, "cli", "pairs.jsonl", 2, "")
        .replace("algorithm = \"reward\"", "")
        .replace("learning_rate = 1e-2\n", "");
    let p = root.join("cli.toml");
    std::fs::write(&p, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["reward", "--config", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(stdout.contains("trained 2 steps; loss"), "{stdout}");
    let metrics = std::fs::read_to_string(root.join("cli/metrics.jsonl")).unwrap();
    assert!(metrics.lines().count() == 2 && metrics.contains("\"accuracy\""));
    let cj: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(root.join("cli/config.json")).unwrap())
            .unwrap();
    assert_eq!(cj["optim"]["learning_rate"], 1e-4);
    // A reward model scores; it does not generate: one line, exit 2.
    let rm =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../grpo-rollout/tests/fixtures/tiny-qwen2-rm");
    for args in [
        vec!["generate", "--prompt", "hi"],
        vec!["logprobs", "--prompt", "hi", "--completion", " there"],
    ] {
        let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
            .args(&args)
            .arg("--model")
            .arg(&rm)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{err}");
        assert!(
            err.contains("sequence classifier") && err.contains("tiny-qwen2-rm"),
            "{err}"
        );
    }
}
