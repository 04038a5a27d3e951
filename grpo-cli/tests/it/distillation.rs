//! On-policy distillation (TRL 1.16's DistillationTrainer, `algorithm = "distillation"`) on the
//! pipelined loop: a student distilled from itself has loss 0; a student distilled from another
//! model comes closer to it; rewards are logged, not trained on; resume is exact; the refusals;
//! the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;
use std::process::Command;

use candle_core::{DType, Device, Tensor};
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir_with};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{Fixture, assert_same_steps, divergence, eval_lines, stopped_and_resumed};

/// A student, a teacher (another random model with the same tokenizer) and arithmetic prompts.
fn fixture() -> Fixture {
    Fixture::new()
        .model("student", 3)
        .model("teacher", 11)
        .arithmetic(40)
}

fn config_text(root: &Path, out: &str, teacher: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "distillation"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 2
max_completion_length = 8
[optim]
learning_rate = 3e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
per_device_train_batch_size = 4
save_steps = 2
[distillation]
teacher_model_name_or_path = "{teacher}"
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("student").display(),
        data = root.join("arith.jsonl").display(),
        teacher = root.join(teacher).display(),
    )
}

fn load(root: &Path, out: &str, teacher: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, teacher, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    trainer::run(
        trainer::setup(cfg).unwrap(),
        &opts,
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

/// TRL's sparse supports (`loss_top_k`): the first step's loss is
/// `grpo_core::distill::sparse_divergence` of the student's and the teacher's logits, computed
/// one completion at a time with the completion's own tokens (the top-1 support's sampled
/// side), summed and divided by the step's tokens — at β = 1 and 0.5 with the top-1 support
/// (tail bucket; sampled and arg-max) and at β = 0 with the teacher's top 4 (renormalised).
#[test]
fn the_sparse_supports_first_step_is_their_divergence() {
    use grpo_core::distill::{ReverseTop1, sparse_divergence};
    let f = fixture();
    let teacher = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    let cases = [
        (1.0, 1, true, ReverseTop1::Sampled, ""),
        (
            0.5,
            1,
            true,
            ReverseTop1::Argmax,
            "reverse_kl_top_1_mode = \"argmax\"",
        ),
        (0.0, 4, false, ReverseTop1::Sampled, "loss_add_tail = false"),
    ];
    for (i, (beta, k, tail, reverse, extra)) in cases.into_iter().enumerate() {
        let out = format!("sparse-{i}");
        let extra = format!("beta = {beta}\nloss_top_k = {k}\n{extra}");
        let s = trainer::setup(load(&f.root, &out, "teacher", 1, &extra)).unwrap();
        let (mut learner, sc) = common::first_scored_step(&s, &f.root.join(&out));
        let r = &sc.rollouts;
        let student = s.policy.model.detached();
        let (mut sum, mut tokens) = (0.0, 0.0);
        for c in &r.completions {
            let p = &r.prompt_ids[c.prompt_index];
            let zs = common::completion_logits(&student, p, &c.token_ids);
            let zt = common::completion_logits(&teacher, p, &c.token_ids);
            let x = Tensor::new(c.token_ids.as_slice(), &Device::Cpu).unwrap();
            let d = sparse_divergence(&zs, &zt, Some(&x), (k, beta, tail, reverse), 1.0).unwrap();
            sum += d.sum_all().unwrap().to_scalar::<f64>().unwrap();
            tokens += c.token_ids.len() as f64;
        }
        let want = sum / tokens;
        let m = learner.process(&sc).unwrap();
        assert!(
            // f32 in the learner: 1e-4 relative, or 1e-7 absolute for the small β = 0.5 loss.
            want > 0.0 && (m["loss"] - want).abs() < 1e-4 * want + 1e-7,
            "case {i}: loss {} vs {want}",
            m["loss"]
        );
    }
}

#[test]
fn a_student_distilled_from_itself_has_loss_zero() {
    let f = fixture();
    let r = run(
        load(&f.root, "self", "student", 1, ""),
        RunOptions::default(),
    );
    let m = &r.metrics[0];
    assert!(
        m["loss"].abs() < 1e-7 && m["grad_norm"].abs() < 1e-6,
        "{m:?}"
    );
    assert!(
        m["entropy"] > 0.0 && m["completions/mean_length"] > 0.0,
        "{m:?}"
    );
    // No reward: the reward metrics say so (NaN), they do not pretend a score.
    assert!(m["reward"].is_nan());
}

#[test]
fn the_student_comes_closer_to_the_teacher() {
    let f = fixture();
    let (student, teacher) = (f.root.join("student"), f.root.join("teacher"));
    for beta in [1.0, 0.0, 0.5] {
        let out = format!("close-{beta}");
        let r = run(
            load(&f.root, &out, "teacher", 12, &format!("beta = {beta}")),
            RunOptions::default(),
        );
        assert_eq!(r.total_steps, 12);
        assert!(
            r.metrics
                .iter()
                .all(|m| m["loss"].is_finite() && m["loss"] > 0.0)
        );
        let trained = r.best_checkpoint_path.unwrap().join("model");
        let (before, after) = (
            divergence(&student, &teacher, beta),
            divergence(&trained, &teacher, beta),
        );
        assert!(after < 0.8 * before, "beta {beta}: {before} -> {after}");
    }
}

#[test]
fn rewards_are_logged_not_trained_on_and_resume_is_exact() {
    let f = fixture();
    let plain = run(
        load(&f.root, "plain", "teacher", 4, ""),
        RunOptions::default(),
    );
    let rewarded = run(
        load(
            &f.root,
            "rewarded",
            "teacher",
            4,
            "[[rewards]]\ntype = \"accuracy\"\n",
        ),
        RunOptions::default(),
    );
    for (a, b) in plain.metrics.iter().zip(&rewarded.metrics) {
        assert_eq!(a["loss"], b["loss"]);
        assert!(b.contains_key("rewards/accuracy/mean"));
    }
    let mut cfg = load(&f.root, "parts", "teacher", 4, "");
    cfg.train.save_steps = 0;
    let first = run(
        cfg.clone(),
        RunOptions {
            stop_after: Some(2),
            ..Default::default()
        },
    );
    assert!(first.interrupted);
    let rest = run(
        cfg,
        RunOptions {
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
    let all: Vec<f64> = plain.metrics.iter().map(|m| m["loss"]).collect();
    assert_eq!(joined, all);
}

/// Gradient checkpointing recomputes each layer in backward: the same steps as the plain run.
#[test]
fn gradient_checkpointing_gives_the_same_steps() {
    let f = fixture();
    let plain = run(
        load(&f.root, "plain", "teacher", 2, ""),
        RunOptions::default(),
    );
    let mut cfg = load(&f.root, "ckpt", "teacher", 2, "");
    cfg.train.gradient_checkpointing = true;
    let ckpt = run(cfg, RunOptions::default());
    assert_same_steps(&plain.metrics, &ckpt.metrics, &["loss", "grad_norm"]);
}

/// LoRA adapters on the student, gradient checkpointing and a one-step-stale pipeline.
#[test]
fn lora_checkpointing_and_staleness_run() {
    let f = fixture();
    let extra = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n\
                 [pipeline]\nmax_staleness = 1\n";
    let mut cfg = load(&f.root, "lora", "teacher", 3, extra);
    cfg.train.gradient_checkpointing = true;
    let r = run(cfg, RunOptions::default());
    for (s, m) in r.metrics.iter().enumerate() {
        assert!(m["loss"].is_finite() && m["loss"] > 0.0, "{m:?}");
        assert_eq!(m["policy_version"], s.saturating_sub(1) as f64);
    }
    assert!(r.metrics.iter().any(|m| m["grad_norm"] > 0.0));
    let ck = r.best_checkpoint_path.unwrap();
    assert!(ck.join("adapter/adapter_model.safetensors").exists());
}

/// An eval split reports the divergence from the teacher on the policy's samples of held-out
/// prompts (`eval/loss`, per token) and the student's entropy, without updates; distilled from
/// itself the student's eval loss is 0.
#[test]
fn the_eval_split_reports_the_divergence() {
    let f = fixture();
    let mut cfg = load(&f.root, "eval", "teacher", 4, "");
    cfg.data.eval_fraction = Some(0.25);
    cfg.train.eval_steps = 2;
    run(cfg, RunOptions::default());
    let evals = eval_lines(&f.root.join("eval"));
    assert_eq!(evals.len(), 2);
    for e in &evals {
        assert!(e["eval/loss"].as_f64().unwrap() > 0.0, "{e}");
        assert!(e["eval/entropy"].as_f64().unwrap() > 0.0, "{e}");
    }
    let mut cfg = load(&f.root, "eval-self", "student", 1, "");
    cfg.data.eval_fraction = Some(0.25);
    cfg.train.eval_steps = 1;
    cfg.optim.learning_rate = Some(0.0);
    run(cfg, RunOptions::default());
    let e = eval_lines(&f.root.join("eval-self")).remove(0);
    assert!(e["eval/loss"].as_f64().unwrap().abs() < 1e-7, "{e}");
}

#[test]
fn what_distillation_cannot_take_is_refused_in_one_line() {
    let f = fixture();
    init_model_dir_with(&f.root.join("digits"), Preset::Tiny, Arch::Qwen2, 5, true).unwrap();
    let e = trainer::setup(load(&f.root, "tok", "digits", 1, ""))
        .unwrap_err()
        .to_string();
    assert!(e.contains("tokenizer") && e.contains("digits"), "{e}");
    let e = trainer::setup(load(&f.root, "none", "nowhere", 1, ""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("distillation teacher") && e.contains("nowhere"),
        "{e}"
    );
    for (extra, want) in [
        ("beta = 1.5", "distillation.beta"),
        ("[reference]\nbeta = 0.04", "reference.beta"),
    ] {
        let p = f.root.join("bad.toml");
        std::fs::write(&p, config_text(&f.root, "bad", "teacher", 1, extra)).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want), "{e}");
    }
    let p = f.root.join("noteacher.toml");
    let text =
        config_text(&f.root, "nt", "teacher", 1, "").replace("teacher_model_name_or_path", "# ");
    std::fs::write(&p, text).unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("teacher_model_name_or_path"), "{e}");
}

/// A distillation config without `rollout.num_generations` samples one completion per prompt,
/// as TRL's DistillationTrainer; a value given is kept; GRPO keeps its group of 8.
#[test]
fn one_completion_per_prompt_unless_the_config_says_otherwise() {
    let f = fixture();
    let text = config_text(&f.root, "one", "teacher", 1, "").replace("num_generations = 2\n", "");
    let p = f.root.join("one.toml");
    std::fs::write(&p, &text).unwrap();
    assert_eq!(config::load(&p, &[]).unwrap().rollout.num_generations, 1);
    let given = load(&f.root, "two", "teacher", 1, "");
    assert_eq!(given.rollout.num_generations, 2);
    let grpo = text.replace("algorithm = \"distillation\"", "").replace(
        "[distillation]",
        "[[rewards]]\ntype = \"accuracy\"\n[distillation]",
    );
    std::fs::write(&p, grpo).unwrap();
    assert_eq!(config::load(&p, &[]).unwrap().rollout.num_generations, 8);
}

#[test]
fn the_distillation_subcommand() {
    let f = fixture();
    let text =
        config_text(&f.root, "cli", "teacher", 2, "").replace("algorithm = \"distillation\"", "");
    let p = f.root.join("cli.toml");
    std::fs::write(&p, text).unwrap();
    let out = Command::new(env!("CARGO_BIN_EXE_grpo-cli"))
        .args(["distillation", "--config", p.to_str().unwrap()])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(String::from_utf8_lossy(&out.stdout).contains("trained 2 steps; loss"));
}

/// Prompt/completion rows for GKD's off-policy steps, and conversations that end with the
/// assistant's turn (TRL's GKD `messages`).
fn write_gkd_data(root: &Path) {
    let mut rows = String::new();
    let mut chats = String::new();
    for i in 0..8 {
        rows.push_str(&format!(
            "{{\"prompt\": \"What is {i} + 2?\", \"completion\": \" It is {}.\"}}\n",
            i + 2
        ));
        chats.push_str(&format!(
            "{{\"messages\": [{{\"role\": \"user\", \"content\": \"Add {i} and 3.\"}}, \
             {{\"role\": \"assistant\", \"content\": \"The sum is {}.\"}}]}}\n",
            i + 3
        ));
    }
    std::fs::write(root.join("rows.jsonl"), rows).unwrap();
    std::fs::write(root.join("chats.jsonl"), chats).unwrap();
}

fn gkd_config(root: &Path, out: &str, data: &str, teacher: &str, extra: &str) -> TrainConfig {
    let text = config_text(root, out, teacher, 4, extra)
        .replace("algorithm = \"distillation\"", "algorithm = \"gkd\"")
        .replace(
            &root.join("arith.jsonl").display().to_string(),
            &root.join(data).display().to_string(),
        )
        .replace("num_generations = 2\n", "");
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, text).unwrap();
    let mut cfg = config::load(&p, &[]).unwrap();
    cfg.train.shuffle_dataset = Some(false);
    cfg
}

/// The completion tokens of `prompt` + `completion` (SFT's joint tokenisation, EOS added) and
/// the summed per-token divergence of `student` from `teacher` over them at temperature 1.
fn completion_divergence(
    student: &Path,
    teacher: &Path,
    prompt: &str,
    completion: &str,
    beta: f64,
) -> (f64, usize) {
    let s = grpo_rollout::load(student, DType::F32, &Device::Cpu).unwrap();
    let t = grpo_rollout::load(teacher, DType::F32, &Device::Cpu).unwrap();
    let eos = s.tokenizer.eos_token.clone().unwrap();
    let p = s.tokenizer.encode(prompt, true).unwrap();
    let full = s
        .tokenizer
        .encode(&format!("{prompt}{completion}{eos}"), true)
        .unwrap();
    let shared = p.iter().zip(&full).take_while(|(a, b)| a == b).count();
    let n = full.len() - shared;
    let len = full.len();
    let ids = Tensor::from_vec(full, (1, len), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, len), DType::U32, &Device::Cpu).unwrap();
    let h = s.model.completion_hidden(&ids, &mask, n).unwrap();
    let th = t.model.completion_hidden(&ids, &mask, n).unwrap();
    let (d, _) = s.model.distill_rows(&h, &t.model, &th, beta, 1.0).unwrap();
    (d.sum_all().unwrap().to_scalar::<f32>().unwrap() as f64, n)
}

/// `algorithm = "gkd"` takes TRL's GKDConfig defaults where the config is silent.
#[test]
fn gkd_takes_trls_defaults() {
    let f = fixture();
    write_gkd_data(&f.root);
    let text = config_text(&f.root, "d", "teacher", 1, "")
        .replace("algorithm = \"distillation\"", "algorithm = \"gkd\"")
        .replace("num_generations = 2\nmax_completion_length = 8\n", "")
        .replace("learning_rate = 3e-3\n", "")
        .replace(
            &f.root.join("arith.jsonl").display().to_string(),
            &f.root.join("rows.jsonl").display().to_string(),
        );
    std::fs::write(f.root.join("d.toml"), text).unwrap();
    let c = config::load(&f.root.join("d.toml"), &[]).unwrap();
    assert_eq!(c.distillation.lmbda_for(c.algorithm), 0.5);
    assert_eq!(c.distillation.beta, 0.5);
    assert!(!c.distillation.seq_kd);
    assert_eq!(c.rollout.temperature, 0.9);
    assert_eq!(c.rollout.num_generations, 1);
    assert_eq!(c.rollout.max_completion_length, 128);
    assert_eq!(c.learning_rate(), 2e-5);
    assert!(c.dropout_disabled());
}

/// λ = 0: every step trains on the dataset's completions; the first step's loss is the
/// divergence over those completions' tokens (joint tokenisation, EOS), at temperature 1.
#[test]
fn gkd_off_policy_steps_train_on_the_datasets_completions() {
    let f = fixture();
    write_gkd_data(&f.root);
    let mut cfg = gkd_config(
        &f.root,
        "offp",
        "rows.jsonl",
        "teacher",
        "lmbda = 0.0\nbeta = 0.5\n",
    );
    cfg.rollout.temperature = 0.7; // sampling only: GKD's divergence is at temperature 1
    let r = run(cfg, RunOptions::default());
    let (mut sum, mut tokens) = (0.0, 0);
    for i in 0..4 {
        let (d, n) = completion_divergence(
            &f.root.join("student"),
            &f.root.join("teacher"),
            &format!("What is {i} + 2?"),
            &format!(" It is {}.", i + 2),
            0.5,
        );
        sum += d;
        tokens += n;
    }
    let m0 = &r.metrics[0];
    let want = sum / tokens as f64;
    assert!(
        (m0["loss"] - want).abs() < 1e-5 * want.max(1.0),
        "loss {} vs {want}",
        m0["loss"]
    );
    assert!(r.metrics.iter().all(|m| m["on_policy"] == 0.0));
    let logged = std::fs::read_to_string(f.root.join("offp/completions.jsonl")).unwrap();
    assert!(logged.contains("It is 2."), "{logged}");
}

/// Conversations that end with the assistant's turn: the prompt is the conversation before
/// it, the completion that turn (TRL's GKD); a student distilled from itself has loss 0 on the
/// dataset's completions and on the teacher's samples (`seq_kd`).
#[test]
fn gkd_reads_conversations_and_seq_kd_samples_with_the_teacher() {
    let f = fixture();
    write_gkd_data(&f.root);
    let r = run(
        gkd_config(&f.root, "chat", "chats.jsonl", "teacher", "lmbda = 0.0\n"),
        RunOptions::default(),
    );
    let logged = std::fs::read_to_string(f.root.join("chat/completions.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(logged.lines().next().unwrap()).unwrap();
    assert_eq!(first["completion"], "The sum is 3.", "{first}");
    assert!(
        !first["prompt"].as_str().unwrap().contains("The sum is"),
        "the answer is not in the prompt: {first}"
    );
    assert!(r.metrics[0]["loss"] > 0.0);
    for (name, extra) in [
        ("self", "lmbda = 0.0\n"),
        ("seqkd", "lmbda = 0.0\nseq_kd = true\n"),
    ] {
        let r = run(
            gkd_config(&f.root, name, "chats.jsonl", "student", extra),
            RunOptions::default(),
        );
        for m in &r.metrics {
            assert!(m["loss"].abs() < 1e-6, "{name}: {m:?}");
            assert_eq!(m["on_policy"], 0.0);
        }
    }
    // The teacher's samples are not the dataset's answers.
    let logged = std::fs::read_to_string(f.root.join("seqkd/completions.jsonl")).unwrap();
    let first: serde_json::Value = serde_json::from_str(logged.lines().next().unwrap()).unwrap();
    assert_ne!(first["completion"], "The sum is 3.");
}

/// λ = 0.5 mixes both kinds of step by a coin seeded per step, so a resumed run draws the
/// same; λ = 1 is on-policy distillation (at temperature 1 the same steps as
/// `algorithm = "distillation"`).
#[test]
fn gkd_mixes_steps_by_lmbda_resumes_exactly_and_lmbda_one_is_distillation() {
    let f = fixture();
    write_gkd_data(&f.root);
    let mut cfg = gkd_config(&f.root, "mix", "rows.jsonl", "teacher", "lmbda = 0.5\n");
    cfg.train.max_steps = Some(8);
    cfg.train.save_steps = 0;
    // With seed 0 the coins of steps 2 and 7 come up on-policy (u = 0.008 and 0.36).
    cfg.train.seed = 0;
    let all = run(cfg.clone(), RunOptions::default());
    let kinds: Vec<f64> = all.metrics.iter().map(|m| m["on_policy"]).collect();
    assert!(kinds.contains(&0.0) && kinds.contains(&1.0), "{kinds:?}");
    cfg.output_dir = f.root.join("mix-parts");
    let joined = stopped_and_resumed(3, |o| run(cfg.clone(), o));
    assert_same_steps(&joined, &all.metrics, &["loss", "on_policy"]);

    let mut g = gkd_config(
        &f.root,
        "one",
        "rows.jsonl",
        "teacher",
        "lmbda = 1.0\nbeta = 1.0\n",
    );
    g.rollout.temperature = 1.0;
    let mut d = g.clone();
    d.algorithm = grpo_trainer::Algorithm::Distillation;
    d.output_dir = f.root.join("one-d");
    let (a, b) = (run(g, RunOptions::default()), run(d, RunOptions::default()));
    assert!(!a.metrics[0].contains_key("on_policy"));
    assert_same_steps(&a.metrics, &b.metrics, &["loss", "grad_norm"]);
}

#[test]
fn gkd_refuses_a_bad_lmbda_and_data_without_completions() {
    let f = fixture();
    write_gkd_data(&f.root);
    let p = f.root.join("bad.toml");
    let text = config_text(&f.root, "bad", "teacher", 1, "lmbda = 1.5\n")
        .replace("algorithm = \"distillation\"", "algorithm = \"gkd\"");
    std::fs::write(&p, text).unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("`distillation.lmbda` must be in [0, 1]"), "{e}");
    // Arithmetic prompts have no completion column: GKD's off-policy steps need one.
    let text = config_text(&f.root, "nocol", "teacher", 1, "")
        .replace("algorithm = \"distillation\"", "algorithm = \"gkd\"");
    std::fs::write(&p, text).unwrap();
    let e = format!(
        "{:#}",
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap_err()
    );
    assert!(e.contains("completion") && e.contains("lmbda"), "{e}");
}
