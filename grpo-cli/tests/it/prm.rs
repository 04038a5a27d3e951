//! Process reward models (TRL's experimental PRMTrainer, `algorithm = "prm"`): rows tokenised
//! as TRL's `tokenize_row`, the first step's loss recomputed one row at a time from the initial
//! model, a tiny run that learns to label steps, the trained model read back as a
//! `*ForTokenClassification` checkpoint, exact resume, LoRA with the head trained whole, the
//! refusals and the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use candle_core::{D, DType, Device};
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::config;
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{all_rows, eval_lines};

/// Step-wise rows: each step says "right" (label true) or "wrong" (false), in a pattern that
/// varies with the row.
fn steps(n: usize) -> String {
    (0..n)
        .map(|i| {
            let k = 1 + i % 3;
            let (mut texts, mut labels) = (Vec::new(), Vec::new());
            for j in 0..k {
                let ok = (i + j) % 2 == 0;
                texts.push(format!(
                    "\"step {j} is {}\"",
                    if ok { "right" } else { "wrong" }
                ));
                labels.push(ok.to_string());
            }
            format!(
                "{{\"prompt\": \"Problem {i}:\", \"completions\": [{}], \"labels\": [{}]}}\n",
                texts.join(", "),
                labels.join(", ")
            )
        })
        .collect()
}

fn fixture() -> tempfile::TempDir {
    let dir = tempfile::tempdir().unwrap();
    init_model_dir(&dir.path().join("model"), Preset::Tiny, Arch::Llama, 4).unwrap();
    std::fs::write(dir.path().join("steps.jsonl"), steps(24)).unwrap();
    dir
}

fn config_text(root: &Path, name: &str, data: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "prm"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[optim]
learning_rate = 1e-3
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

fn load(root: &Path, name: &str, data: &str, steps: usize, extra: &str) -> config::TrainConfig {
    let p = root.join(format!("{name}.toml"));
    std::fs::write(&p, config_text(root, name, data, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn setup(root: &Path, name: &str, data: &str, steps: usize, extra: &str) -> trainer::Setup {
    trainer::setup(load(root, name, data, steps, extra)).unwrap()
}

fn run(s: trainer::Setup, opts: &RunOptions) -> trainer::TrainingResult {
    trainer::run(s, opts, &mut trainer::NoCallbacks).unwrap()
}

/// TRL's `tokenize_row` written out over the tokenizer: BOS (when the tokenizer has one) +
/// prompt, then each step + separator, its label at its last token.
fn trl_row(
    tok: &grpo_rollout::Tokenizer,
    prompt: &str,
    steps: &[&str],
    labels: &[i64],
    sep: &str,
) -> (Vec<u32>, Vec<i64>) {
    let mut ids: Vec<u32> = tok
        .bos_token
        .as_deref()
        .and_then(|t| tok.inner.token_to_id(t))
        .into_iter()
        .collect();
    ids.extend(tok.encode(prompt, false).unwrap());
    let mut lab = vec![-100; ids.len()];
    for (s, &l) in steps.iter().zip(labels) {
        let mut t = tok.encode(s, false).unwrap();
        t.extend(tok.encode(sep, false).unwrap());
        lab.extend(std::iter::repeat_n(-100, t.len() - 1));
        lab.push(l);
        ids.extend(t);
    }
    (ids, lab)
}

/// The steps of row 5 of [`steps`].
const ROW5: [&str; 3] = ["step 0 is wrong", "step 1 is right", "step 2 is wrong"];

#[test]
fn rows_are_tokenised_as_trls_tokenize_row() {
    let dir = fixture();
    let root = dir.path();
    let rows_of = |extra: &str, data: &str| {
        let s = setup(root, "rows", data, 1, extra);
        trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)).unwrap()
    };
    let s = setup(root, "tok", "steps.jsonl", 1, "");
    let tok = &s.tokenizer;
    let rows = rows_of("", "steps.jsonl");
    assert_eq!(rows.len(), 24);
    // Row 5: three steps, labels false, true, false.
    let r = &rows[5];
    let (ids, labels) = trl_row(tok, "Problem 5:", &ROW5, &[0, 1, 0], "\n");
    assert_eq!(r.completion, ids);
    assert_eq!(r.labels, labels);
    assert_eq!(r.labels.iter().filter(|&&l| l >= 0).count(), 3);
    assert!(r.prompt.is_empty());

    // The last step only while training; evaluation reads every step's label.
    let last = rows_of("[prm]\ntrain_on_last_step_only = true", "steps.jsonl");
    let (_, want) = trl_row(tok, "Problem 5:", &ROW5, &[-100, -100, 0], "\n");
    assert_eq!(last[5].labels, want);
    let s = setup(
        root,
        "eval",
        "steps.jsonl",
        1,
        "[prm]\ntrain_on_last_step_only = true",
    );
    let ev =
        trainer::supervised::prm_rows(&s.cfg, &s.tokenizer, &all_rows(&s.train), true).unwrap();
    assert_eq!(ev[5].labels, labels);

    // Another separator; the steps cut by max_completion_length, the whole by max_length.
    let sep = rows_of("[prm]\nstep_separator = \" | \"", "steps.jsonl");
    let (ids, labels) = trl_row(tok, "Problem 5:", &ROW5, &[0, 1, 0], " | ");
    assert_eq!(
        (sep[5].completion.clone(), sep[5].labels.clone()),
        (ids.clone(), labels.clone())
    );
    let (plain_ids, plain_labels) = trl_row(tok, "Problem 5:", &ROW5, &[0, 1, 0], "\n");
    let bos = usize::from(tok.bos_token.is_some());
    let prompt_len = bos + tok.encode("Problem 5:", false).unwrap().len();
    let first = tok.encode("step 0 is wrong", false).unwrap().len()
        + tok.encode("\n", false).unwrap().len();
    let keep = first + 2;
    let cut = rows_of(
        &format!("[prm]\nmax_completion_length = {keep}"),
        "steps.jsonl",
    );
    let c5 = cut.iter().find(|r| r.index == 5).unwrap();
    assert_eq!(c5.completion, plain_ids[..prompt_len + keep].to_vec());
    assert_eq!(c5.labels, plain_labels[..prompt_len + keep].to_vec());
    assert_eq!(c5.labels.iter().filter(|&&l| l >= 0).count(), 1);
    let short = rows_of("[prm]\nmax_length = 6", "steps.jsonl");
    assert!(short.iter().all(|r| r.completion.len() <= 6));
    // Rows whose labelled tokens were all cut away are dropped.
    assert!(short.len() < 24);
    assert!(short.iter().all(|r| r.labels.iter().any(|&l| l >= 0)));

    // Labels as 0 / 1 and as strings; the refusals name the row and the column.
    std::fs::write(
        root.join("forms.jsonl"),
        "{\"prompt\": \"P\", \"completions\": [\"a\", \"b\"], \"labels\": [1, 0]}\n\
         {\"prompt\": \"P\", \"completions\": [\"a\", \"b\"], \"labels\": [\"True\", \"false\"]}\n",
    )
    .unwrap();
    let forms = rows_of("", "forms.jsonl");
    assert_eq!(forms[0].labels, forms[1].labels);
    assert_eq!(
        forms[0]
            .labels
            .iter()
            .filter(|&&l| l >= 0)
            .copied()
            .collect::<Vec<_>>(),
        vec![1, 0]
    );
    for (line, want) in [
        (
            "{\"prompt\": \"P\", \"completions\": [\"a\", \"b\"], \"labels\": [true]}",
            "has 2 steps but `labels` has 1 labels",
        ),
        (
            "{\"prompt\": \"P\", \"completions\": \"a\", \"labels\": [true]}",
            "column `completions` must be a list of strings",
        ),
        (
            "{\"prompt\": \"P\", \"completions\": [\"a\"], \"labels\": [\"maybe\"]}",
            "column `labels` must be a list of booleans",
        ),
        (
            "{\"prompt\": [{\"role\": \"user\", \"content\": \"P\"}], \"completions\": [\"a\"], \"labels\": [true]}",
            "plain-text prompts",
        ),
    ] {
        std::fs::write(root.join("bad.jsonl"), format!("{line}\n")).unwrap();
        let s = setup(root, "bad", "bad.jsonl", 1, "");
        let e = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train))
            .unwrap_err()
            .to_string();
        assert!(e.contains(want) && e.contains("row 0"), "{e}");
    }
}

/// The first step's loss: the cross-entropy of each labelled token's label under the fresh
/// two-label head, summed over the step's rows (each scored alone, unpadded, in f64) and
/// divided by the step's labelled tokens; two micro-batches of two rows.
#[test]
fn the_first_steps_loss_is_the_token_cross_entropy() {
    let dir = fixture();
    let root = dir.path();
    let s = setup(root, "first", "steps.jsonl", 1, "");
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)[..4]).unwrap();
    let model = s.policy.model.detached();
    // A fresh head: weights N(0, 0.02²), bias 0.
    let bias: Vec<f32> = model.score_bias.as_ref().unwrap().to_vec1().unwrap();
    assert_eq!(bias, vec![0.0, 0.0]);
    let w = model.score.as_ref().unwrap();
    assert_eq!(w.dims(), [2, model.cfg.hidden_size]);
    let (mut sum, mut n, mut right) = (0.0, 0.0, 0.0);
    for r in &rows {
        let z = model
            .token_logits(&[r.completion.as_slice()], 0)
            .unwrap()
            .squeeze(0)
            .unwrap()
            .to_dtype(DType::F64)
            .unwrap();
        let ls = z
            .broadcast_sub(
                &z.exp()
                    .unwrap()
                    .sum_keepdim(D::Minus1)
                    .unwrap()
                    .log()
                    .unwrap(),
            )
            .unwrap()
            .to_vec2::<f64>()
            .unwrap();
        for (t, &l) in r.labels.iter().enumerate() {
            if l >= 0 {
                sum -= ls[t][l as usize];
                n += 1.0;
                let best = usize::from(ls[t][1] > ls[t][0]);
                right += f64::from(u8::from(best == l as usize));
            }
        }
    }
    let mut learner = trainer::Learner::new(&s, &root.join("first")).unwrap();
    let m = learner
        .supervised_step(&rows, &mut Default::default(), true)
        .unwrap();
    assert!(
        (m["loss"] - sum / n).abs() < 1e-5 * (sum / n),
        "loss {} vs {}",
        m["loss"],
        sum / n
    );
    assert!((m["accuracy"] - right / n).abs() < 1e-9, "{m:?}");
    assert!(m["grad_norm"] > 0.0);
}

/// A tiny run learns to label the steps (held-out accuracy from chance to near 1); its
/// checkpoint is a `*ForTokenClassification` model with a two-label head and bias, which loads
/// back as a token classifier (and is refused as a causal LM); 2 steps + resume + 2 = 4.
#[test]
fn a_prm_learns_to_label_steps_and_its_checkpoint_reads_back() {
    let dir = fixture();
    let root = dir.path();
    let mut cfg = load(root, "learn", "steps.jsonl", 30, "");
    cfg.data.eval_fraction = Some(0.25);
    cfg.train.eval_steps = 15;
    cfg.train.save_steps = 30;
    let s0 = trainer::setup(cfg.clone()).unwrap();
    let held_out = all_rows(s0.eval.as_ref().unwrap());
    let r = run(trainer::setup(cfg.clone()).unwrap(), &RunOptions::default());
    assert_eq!(r.total_steps, 30);
    let evals = eval_lines(&root.join("learn"));
    let acc: Vec<f64> = evals
        .iter()
        .map(|e| e["eval/accuracy"].as_f64().unwrap())
        .collect();
    assert!(*acc.last().unwrap() > 0.9, "{acc:?}");
    assert!(
        evals.last().unwrap()["eval/loss"].as_f64().unwrap() < 0.3,
        "{evals:?}"
    );
    let ck = r.best_checkpoint_path.unwrap().join("model");
    let cfg_json: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ck.join("config.json")).unwrap()).unwrap();
    assert_eq!(cfg_json["architectures"][0], "LlamaForTokenClassification");
    assert_eq!(cfg_json["id2label"].as_object().unwrap().len(), 2);
    let w = candle_core::safetensors::load(ck.join("model.safetensors"), &Device::Cpu).unwrap();
    assert_eq!(w["score.bias"].dims(), [2]);
    assert!(!w.contains_key("lm_head.weight"));
    let loaded = grpo_rollout::load(&ck, DType::F32, &Device::Cpu).unwrap();
    assert_eq!(loaded.model.cfg.token_classification, Some(2));
    // The last evaluation, recomputed with the checkpoint of the same step as transformers'
    // evaluation loop forms it: each batch's mean token cross-entropy weighted by its rows,
    // the accuracy over every labelled token of the split.
    let (mut loss_sum, mut n_rows, mut right, mut labelled) = (0.0, 0.0, 0.0, 0.0);
    for chunk in held_out.chunks(cfg.train.prompts_per_step) {
        let rows = trainer::supervised::prm_rows(&s0.cfg, &s0.tokenizer, chunk, true).unwrap();
        let (mut ce, mut lab) = (0.0, 0.0);
        for row in &rows {
            let z = loaded
                .model
                .token_logits(&[row.completion.as_slice()], 0)
                .unwrap()
                .squeeze(0)
                .unwrap()
                .to_dtype(DType::F64)
                .unwrap();
            let z: Vec<Vec<f64>> = z.to_vec2().unwrap();
            for (t, &l) in row.labels.iter().enumerate() {
                if l < 0 {
                    continue;
                }
                let m = z[t][0].max(z[t][1]);
                let lse = m + ((z[t][0] - m).exp() + (z[t][1] - m).exp()).ln();
                ce -= z[t][l as usize] - lse;
                lab += 1.0;
                right += f64::from(u8::from(usize::from(z[t][1] > z[t][0]) == l as usize));
            }
        }
        loss_sum += ce / lab * rows.len() as f64;
        n_rows += rows.len() as f64;
        labelled += lab;
    }
    let last = evals.last().unwrap();
    let (el, ea) = (
        last["eval/loss"].as_f64().unwrap(),
        last["eval/accuracy"].as_f64().unwrap(),
    );
    assert!(
        (el - loss_sum / n_rows).abs() < 1e-4 * el.max(1e-3),
        "{el} vs {}",
        loss_sum / n_rows
    );
    assert!(
        (ea - right / labelled).abs() < 1e-9,
        "{ea} vs {}",
        right / labelled
    );
    let tok = loaded.tokenizer.clone();
    let prm_model = loaded.model.clone();
    let e = loaded.causal().unwrap_err().to_string();
    assert!(e.contains("token classifier"), "{e}");

    // The trained model as a `process_reward_model` reward: each step's P(correct) read where
    // training put its label (TRL's row for the same steps), aggregated; a solution with a
    // wrong step scores below one without.
    use grpo_rewards::Reward;
    use grpo_rewards::builtin::{ProcessRewardModel, ProcessRewardModelConfig, StepAggregation};
    let clf = std::sync::Arc::new(
        grpo_rollout::scoring::TokenClassifierModel::load(&ck, DType::F32, &Device::Cpu).unwrap(),
    );
    let steps = ["step 0 is right", "step 1 is wrong", "step 2 is right"];
    let (ids, labels) = trl_row(&tok, "Problem 3:", &steps, &[1, 1, 1], "\n");
    let z = prm_model
        .token_logits(&[ids.as_slice()], 0)
        .unwrap()
        .squeeze(0)
        .unwrap();
    let e = z.exp().unwrap();
    let p: Vec<Vec<f32>> = e
        .broadcast_div(&e.sum_keepdim(D::Minus1).unwrap())
        .unwrap()
        .to_vec2()
        .unwrap();
    let probs: Vec<f32> = labels
        .iter()
        .enumerate()
        .filter(|(_, l)| **l >= 0)
        .map(|(t, _)| p[t][1])
        .collect();
    assert_eq!(probs.len(), 3);
    assert!(
        probs[1] < 0.5 && probs[0] > 0.5 && probs[2] > 0.5,
        "{probs:?}"
    );
    let input = |c: &str| grpo_rewards::RewardInput::new("Problem 3:", c);
    let text = format!("{}\n{}\n{}\n", steps[0], steps[1], steps[2]);
    for (agg, want) in [
        (
            StepAggregation::Min,
            probs.iter().copied().fold(1.0f32, f32::min),
        ),
        (StepAggregation::Last, probs[2]),
        (StepAggregation::Mean, probs.iter().sum::<f32>() / 3.0),
        (StepAggregation::Prod, probs.iter().product()),
    ] {
        let r = ProcessRewardModel::new(
            clf.clone(),
            ProcessRewardModelConfig {
                aggregation: agg,
                ..Default::default()
            },
        )
        .unwrap();
        let out = r
            .score(&[
                input(&text),
                input("step 0 is right\nstep 1 is right"),
                input(""),
            ])
            .unwrap();
        let got = out.scores[0].unwrap();
        assert!((got - want).abs() < 1e-5, "{agg:?}: {got} vs {want}");
        if agg == StepAggregation::Min {
            assert!(out.scores[1].unwrap() > got, "{:?}", out.scores);
        }
        // No step: no score.
        assert_eq!(out.scores[2], None);
    }

    // A GRPO run rewarded by it.
    let p = root.join("grpo.toml");
    std::fs::write(
        &p,
        format!(
            "output_dir = \"{out}\"\n[model]\npath = \"{model}\"\n[data]\npath = [\"{data}\"]\n\
             [rollout]\nnum_generations = 2\nmax_completion_length = 6\n[train]\nmax_steps = 2\n\
             prompts_per_step = 2\n[[rewards]]\ntype = \"process_reward_model\"\npath = \"{ck}\"\n\
             aggregation = \"mean\"\ndevice = \"cpu\"\ndtype = \"f32\"\n",
            out = root.join("grpo").display(),
            model = root.join("model").display(),
            data = root.join("steps.jsonl").display(),
            ck = ck.display()
        ),
    )
    .unwrap();
    let r = run(
        trainer::setup(config::load(&p, &[]).unwrap()).unwrap(),
        &RunOptions::default(),
    );
    for m in &r.metrics {
        let v = m["rewards/process_reward_model/mean"];
        assert!((0.0..=1.0).contains(&v), "{m:?}");
    }
    // `grpo-cli score`'s library call with the same reward (mean of the steps) on a file.
    let rows = format!(
        "{{\"prompt\": \"Problem 3:\", \"completion\": {}}}\n",
        serde_json::json!(text)
    );
    std::fs::write(root.join("scored.jsonl"), rows).unwrap();
    let scored = trainer::score::score_file(
        &config::load(&p, &[]).unwrap(),
        &root.join("scored.jsonl"),
        "completion",
        8,
    )
    .unwrap();
    let got = scored.rows[0]["rewards"]["process_reward_model"]
        .as_f64()
        .unwrap();
    let mean = f64::from(probs.iter().sum::<f32>() / 3.0);
    assert!((got - mean).abs() < 1e-5, "{got} vs {mean}");

    let whole = run(
        setup(root, "whole", "steps.jsonl", 4, ""),
        &RunOptions::default(),
    );
    let mut parts = load(root, "parts", "steps.jsonl", 4, "");
    parts.train.save_steps = 0;
    let joined =
        common::stopped_and_resumed(2, |o| run(trainer::setup(parts.clone()).unwrap(), &o));
    let losses = |m: &[grpo_trainer::Metrics]| m.iter().map(|m| m["loss"]).collect::<Vec<_>>();
    assert_eq!(losses(&whole.metrics), losses(&joined));
}

/// LoRA: the adapters and the whole head (weight and bias, PEFT's `modules_to_save`) train;
/// the adapter's config says `TOKEN_CLS`.
#[test]
fn lora_trains_the_adapters_and_the_whole_head() {
    let dir = fixture();
    let root = dir.path();
    let extra = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n";
    let r = run(
        setup(root, "lora", "steps.jsonl", 2, extra),
        &RunOptions::default(),
    );
    assert!(
        r.metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["grad_norm"] > 0.0)
    );
    let ad = r.best_checkpoint_path.unwrap().join("adapter");
    let c: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(ad.join("adapter_config.json")).unwrap())
            .unwrap();
    assert_eq!(c["task_type"], "TOKEN_CLS");
    assert_eq!(c["modules_to_save"], serde_json::json!(["score"]));
    let w =
        candle_core::safetensors::load(ad.join("adapter_model.safetensors"), &Device::Cpu).unwrap();
    let bias = &w["base_model.model.score.bias"];
    assert_eq!(bias.dims(), [2]);
    // Trained: no longer the fresh head's zeros.
    let b: Vec<f32> = bias.to_vec1().unwrap();
    assert!(b.iter().any(|&x| x != 0.0), "{b:?}");
    // Exported merged: a token classifier with the trained head, whose logits are the
    // adapted model's.
    let ck = ad.parent().unwrap();
    let out = root.join("merged");
    common::grpo_cli_ok(&[
        "export",
        "--checkpoint",
        ck.to_str().unwrap(),
        "--format",
        "merged",
        "--out",
        out.to_str().unwrap(),
    ]);
    let merged = grpo_rollout::load(&out, DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    assert_eq!(merged.cfg.token_classification, Some(2));
    let mb: Vec<f32> = merged.score_bias.as_ref().unwrap().to_vec1().unwrap();
    for (x, y) in mb.iter().zip(&b) {
        assert!((x - y).abs() < 1e-6, "{mb:?} vs {b:?}");
    }
    let s = setup(root, "probe", "steps.jsonl", 1, "");
    let rows = trainer::supervised::rows(&s.cfg, &s.tokenizer, &all_rows(&s.train)[..2]).unwrap();
    let mut adapted = grpo_rollout::load(&root.join("model"), DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    grpo_rollout::lora::load_peft(&mut adapted, &ad).unwrap();
    assert_eq!(adapted.cfg.token_classification, Some(2));
    for r in &rows {
        let a = adapted.token_logits(&[r.completion.as_slice()], 0).unwrap();
        let m = merged.token_logits(&[r.completion.as_slice()], 0).unwrap();
        let d: f32 = (a - m)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap();
        assert!(d < 1e-4, "{d}");
    }
}

#[test]
fn what_a_prm_cannot_take_is_refused_in_one_line() {
    let dir = fixture();
    let root = dir.path();
    for (extra, want) in [
        ("[reference]\nbeta = 0.1", "reference.beta"),
        (
            "[prm]\nmax_completion_length = 0",
            "prm.max_completion_length",
        ),
        ("[prm]\nlabels_field = \"completions\"", "must differ"),
        ("[prm]\nstep_sep = \"\\n\"", "unknown"),
    ] {
        let p = root.join("bad.toml");
        std::fs::write(&p, config_text(root, "bad", "steps.jsonl", 1, extra)).unwrap();
        let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
        assert!(e.contains(want), "{extra}: {e}");
    }
    std::fs::write(
        root.join("nolabels.jsonl"),
        "{\"prompt\": \"P\", \"completions\": [\"a\"]}\n",
    )
    .unwrap();
    let e = trainer::setup(load(root, "nl", "nolabels.jsonl", 1, ""))
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("labels") && e.contains("prm.labels_field"),
        "{e}"
    );
    // A token classifier is not a causal LM for GRPO.
    let r = run(
        setup(root, "ck", "steps.jsonl", 2, ""),
        &RunOptions::default(),
    );
    let ck = r.best_checkpoint_path.unwrap().join("model");
    let p = root.join("grpo.toml");
    std::fs::write(
        &p,
        config_text(
            root,
            "grpo",
            "steps.jsonl",
            1,
            "[[rewards]]\ntype = \"overlong\"\nmax_completion_length = 8\noverlong_buffer = 2",
        )
        .replace("algorithm = \"prm\"", "")
        .replace(
            &root.join("model").display().to_string(),
            &ck.display().to_string(),
        ),
    )
    .unwrap();
    let e = trainer::setup(config::load(&p, &[]).unwrap())
        .unwrap_err()
        .to_string();
    assert!(e.contains("token classifier"), "{e}");
    // A `process_reward_model` reward needs a path to a token classifier.
    for (reward, want) in [
        ("", "needs `path`"),
        (
            &format!("path = \"{}\"", root.join("model").display()) as &str,
            "not a token-classification checkpoint",
        ),
        (
            &format!(
                "path = \"{}\"\ndevice = \"tpu\"",
                root.join("model").display()
            ) as &str,
            "rewards[0].device",
        ),
        (
            &format!(
                "path = \"{}\"\ndtype = \"f8\"",
                root.join("model").display()
            ) as &str,
            "rewards[0].dtype",
        ),
    ] {
        std::fs::write(
            &p,
            config_text(
                root,
                "grpo",
                "steps.jsonl",
                1,
                &format!("[[rewards]]\ntype = \"process_reward_model\"\n{reward}"),
            )
            .replace("algorithm = \"prm\"", ""),
        )
        .unwrap();
        let e = match config::load(&p, &[]) {
            Err(e) => format!("{e:#}"),
            Ok(c) => trainer::setup(c).unwrap_err().to_string(),
        };
        assert!(e.contains(want), "{e}");
    }
}

#[test]
fn the_prm_subcommand() {
    let dir = fixture();
    let root = dir.path();
    let p = root.join("cli.toml");
    std::fs::write(
        &p,
        config_text(root, "cli", "steps.jsonl", 2, "").replace("algorithm = \"prm\"", ""),
    )
    .unwrap();
    let out = common::grpo_cli_ok(&["prm", "--config", p.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("trained 2 steps"));
}
