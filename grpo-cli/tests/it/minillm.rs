//! MiniLLM (TRL's experimental MiniLLMTrainer, `algorithm = "minillm"`): GRPO's step on the
//! student's samples with each token's advantage raised by the teacher's log-prob over the
//! student's, plus the single-step reverse KL. The first step's loss is TRL's formula from the
//! two models' logits; the student comes closer to the teacher through either term alone;
//! without rewards the teacher's terms train alone; resume is exact; the refusals; the
//! subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{Fixture, stopped_and_resumed};

/// A student, a teacher (another random model with the same tokenizer) and arithmetic prompts.
fn fixture() -> Fixture {
    Fixture::new()
        .model("student", 3)
        .model("teacher", 11)
        .arithmetic(40)
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "minillm"
output_dir = "{out}"
{extra}
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
"#,
        out = root.join(out).display(),
        model = root.join("student").display(),
        data = root.join("arith.jsonl").display(),
        teacher = root.join("teacher").display(),
    )
}

fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn load_err(root: &Path, extra: &str) -> String {
    let p = root.join("bad.toml");
    std::fs::write(&p, config_text(root, "bad", 1, extra)).unwrap();
    format!("{:#}", config::load(&p, &[]).unwrap_err())
}

fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    trainer::run(
        trainer::setup(cfg).unwrap(),
        &opts,
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap()
}

/// Row-wise `log_softmax(z / t)` of `(T, V)` logits, in f64.
fn log_softmax(z: &Tensor, t: f64) -> Vec<Vec<f64>> {
    let rows: Vec<Vec<f64>> = (z / t).unwrap().to_vec2().unwrap();
    rows.into_iter()
        .map(|r| {
            let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
            r.iter().map(|x| x - lse).collect()
        })
        .collect()
}

/// TRL's MiniLLM loss of the first step, from each completion's logits alone: with the ratio
/// 1 (on-policy), each token's policy term is `−(A_i + γ-discounted (log π_T − log π_S))` at
/// `kd_temperature`, normalised by the loss type (dapo: the step's tokens; grpo: each
/// completion's tokens, the micro-batch's mean, divided by the accumulation steps); each
/// micro-batch adds the mean over its tokens of `Σ_v p_S (log p_S − log p_T)`. The logged loss
/// is what the micro-batches return, summed (grpo's scaled back by the accumulation steps, as
/// the learner logs it).
#[test]
fn the_first_steps_loss_is_trls_formula() {
    let f = fixture();
    let teacher = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    let cases: [(&str, f64, f64, bool, bool, bool); 5] = [
        ("dapo", 1.0, 0.0, true, true, true),
        ("dapo", 2.0, 0.7, false, true, true),
        ("grpo", 1.5, 0.5, true, true, true),
        ("dapo", 1.0, 0.0, true, false, true),
        ("dapo", 1.0, 0.0, true, true, false),
    ];
    for (i, (loss_type, kd, gamma, norm, rkl, single)) in cases.into_iter().enumerate() {
        let out = format!("formula-{i}");
        let extra = format!(
            "[[rewards]]\ntype = \"accuracy\"\n[loss]\nloss_type = \"{loss_type}\"\n\
             [minillm]\nkd_temperature = {kd}\ngamma = {gamma}\nlength_normalization = {norm}\n\
             rkl_advantage = {rkl}\nsingle_step_decomposition = {single}\n"
        );
        let cfg = load(&f.root, &out, 1, &extra);
        let micro = cfg.micro_batch();
        let s = trainer::setup(cfg).unwrap();
        let (mut learner, sc) = common::first_scored_step(&s, &f.root.join(&out));
        let r = &sc.rollouts;
        let student = s.policy.model.detached();
        let n = r.completions.len();
        let ga = n.div_ceil(micro) as f64;
        let total: f64 = r.completions.iter().map(|c| c.token_ids.len() as f64).sum();
        let mut want = 0.0;
        for chunk in (0..n).collect::<Vec<_>>().chunks(micro) {
            let (mut policy, mut kl_sum, mut tokens) = (0.0, 0.0, 0.0);
            for &i in chunk {
                let c = &r.completions[i];
                let p = &r.prompt_ids[c.prompt_index];
                let zs = common::completion_logits(&student, p, &c.token_ids);
                let zt = common::completion_logits(&teacher, p, &c.token_ids);
                let (ls, lt) = (log_softmax(&zs, kd), log_softmax(&zt, kd));
                let len = c.token_ids.len();
                let reward: Vec<f64> = (0..len)
                    .map(|j| {
                        let tok = c.token_ids[j] as usize;
                        if rkl { lt[j][tok] - ls[j][tok] } else { 0.0 }
                    })
                    .collect();
                let mut row = 0.0;
                for j in 0..len {
                    let rkl_adv = if gamma == 0.0 {
                        reward[j]
                    } else {
                        let num: f64 = (j..len).map(|k| gamma.powi(k as i32) * reward[k]).sum();
                        match norm {
                            true => num / (j..len).map(|k| gamma.powi(k as i32)).sum::<f64>(),
                            false => num,
                        }
                    };
                    row -= f64::from(sc.advantages[i]) + rkl_adv;
                    if single {
                        kl_sum += (0..ls[j].len())
                            .map(|v| ls[j][v].exp() * (ls[j][v] - lt[j][v]))
                            .sum::<f64>();
                    }
                }
                tokens += len as f64;
                policy += match loss_type {
                    "dapo" => row / total,
                    _ => row / len as f64 / chunk.len() as f64,
                };
            }
            // What the learner logs: dapo's as returned, grpo's scaled back by the steps.
            want += policy + kl_sum / tokens;
        }
        let m = learner.process(&sc).unwrap();
        assert!(
            (m["loss"] - want).abs() < 1e-4 * (1.0 + want.abs()),
            "case {i}: loss {} vs {want} (accumulation steps {ga})",
            m["loss"]
        );
        assert_eq!(m.contains_key("minillm/single_step_kl"), single, "{m:?}");
        assert!(m["rewards/accuracy/mean"].is_finite());
    }
}

/// A copy of `root/teacher`'s files in `root/name`.
fn teacher_copy(root: &Path, name: &str) -> std::path::PathBuf {
    let to = root.join(name);
    std::fs::create_dir_all(&to).unwrap();
    for e in std::fs::read_dir(root.join("teacher")).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), to.join(e.file_name())).unwrap();
    }
    to
}

/// The teacher of `root/teacher` at temperature `1 / k` saved as `root/name`: its final
/// norm's weight times `k` multiplies its logits by `k`.
fn sharpened(root: &Path, name: &str, k: f64) {
    let to = teacher_copy(root, name);
    let file = to.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    let norm = w.get_mut("model.norm.weight").unwrap();
    *norm = (&*norm * k).unwrap();
    candle_core::safetensors::save(&w, &file).unwrap();
}

/// The teacher of `root/teacher` with its vocabulary padded by `extra` rows of zeros (as
/// checkpoints pad theirs), saved as `root/name`: its logits there are 0.
fn widened(root: &Path, name: &str, extra: usize) {
    let to = teacher_copy(root, name);
    let file = to.join("model.safetensors");
    let mut w = candle_core::safetensors::load(&file, &Device::Cpu).unwrap();
    for key in ["model.embed_tokens.weight", "lm_head.weight"] {
        if let Some(t) = w.get_mut(key) {
            let pad = Tensor::zeros((extra, t.dim(1).unwrap()), t.dtype(), &Device::Cpu).unwrap();
            *t = Tensor::cat(&[&*t, &pad], 0).unwrap();
        }
    }
    candle_core::safetensors::save(&w, &file).unwrap();
    let cfg_path = to.join("config.json");
    let mut cfg: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&cfg_path).unwrap()).unwrap();
    let v = cfg["vocab_size"].as_u64().unwrap();
    cfg["vocab_size"] = serde_json::json!(v + extra as u64);
    std::fs::write(&cfg_path, cfg.to_string()).unwrap();
}

/// A teacher whose vocabulary is padded past the student's is read over the student's tokens
/// (both terms): the first step equals the one with the unpadded teacher.
#[test]
fn a_teacher_with_a_padded_vocabulary_is_read_over_the_students() {
    let f = fixture();
    widened(&f.root, "wide", 16);
    let mut losses = Vec::new();
    for (name, teacher) in [("narrow", "teacher"), ("wide", "wide")] {
        let mut cfg = load(&f.root, name, 1, "[minillm]\nkd_temperature = 1.5\n");
        cfg.distillation.teacher_model_name_or_path = Some(f.root.join(teacher));
        let s = trainer::setup(cfg).unwrap();
        if name == "wide" {
            let t = s.distillation_teacher.as_ref().unwrap();
            assert_eq!(t.cfg.vocab_size, s.policy.model.cfg.vocab_size + 16);
        }
        let (mut learner, sc) = common::first_scored_step(&s, &f.root.join(name));
        losses.push(learner.process(&sc).unwrap()["loss"]);
    }
    assert!(
        (losses[0] - losses[1]).abs() < 1e-5 * losses[0].abs().max(1.0),
        "{losses:?}"
    );
}

/// The teacher's terms bring the student closer to a sharpened teacher (the reverse KL on
/// fixed text falls), with no reward to learn from: the single-step term alone and both terms.
/// (The reverse-KL advantage alone is a REINFORCE estimate of the same gradient, too noisy on
/// a dozen steps of a tiny model to move a fixed-text measure reliably; its gradient is checked
/// exactly in `the_first_update_follows_trls_gradient`.)
#[test]
fn the_student_comes_closer_to_the_teacher() {
    let f = fixture();
    sharpened(&f.root, "sharp", 4.0);
    let (student, teacher) = (f.root.join("student"), f.root.join("sharp"));
    let before = common::divergence(&student, &teacher, 1.0);
    for (name, extra) in [
        ("single", "[minillm]\nrkl_advantage = false\n"),
        ("both", ""),
    ] {
        let mut cfg = load(&f.root, name, 12, extra);
        cfg.distillation.teacher_model_name_or_path = Some(teacher.clone());
        cfg.rollout.num_generations = 4;
        let r = run(cfg, RunOptions::default());
        assert_eq!(r.total_steps, 12);
        assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
        let after = common::divergence(
            &r.best_checkpoint_path.unwrap().join("model"),
            &teacher,
            1.0,
        );
        assert!(after < 0.9 * before, "{name}: {before} -> {after}");
    }
}

/// `−Σ (A_i + rkl_t) log π_S(y_t) / N` plus each micro-batch's mean reverse KL, with the
/// graph of `model`'s weights: TRL's first-step loss, whose gradient the learner's must be.
fn reference_loss(
    model: &grpo_rollout::Transformer,
    teacher: &grpo_rollout::Transformer,
    sc: &grpo_trainer::stages::Scored,
    micro: usize,
    (kd, gamma, rkl, single): (f64, f64, bool, bool),
) -> Tensor {
    let r = &sc.rollouts;
    let n = r.completions.len();
    let total: f64 = r.completions.iter().map(|c| c.token_ids.len() as f64).sum();
    let log_softmax = |z: &Tensor, t: f64| {
        let z = (z / t).unwrap();
        let z = z
            .broadcast_sub(&z.max_keepdim(1).unwrap().detach())
            .unwrap();
        z.broadcast_sub(&z.exp().unwrap().sum_keepdim(1).unwrap().log().unwrap())
            .unwrap()
    };
    let mut loss = Tensor::zeros((), DType::F32, &Device::Cpu).unwrap();
    for chunk in (0..n).collect::<Vec<_>>().chunks(micro) {
        let (mut kl, mut tokens) = (Tensor::zeros((), DType::F32, &Device::Cpu).unwrap(), 0.0);
        for &i in chunk {
            let c = &r.completions[i];
            let ids: Vec<u32> = r.prompt_ids[c.prompt_index]
                .iter()
                .chain(&c.token_ids)
                .copied()
                .collect();
            let len = c.token_ids.len();
            let ids = Tensor::from_vec(ids.clone(), (1, ids.len()), &Device::Cpu).unwrap();
            let mask = ids.ones_like().unwrap();
            let zs = model
                .logits(&model.completion_hidden(&ids, &mask, len).unwrap())
                .unwrap();
            let zt = teacher
                .logits(&teacher.completion_hidden(&ids, &mask, len).unwrap())
                .unwrap()
                .detach();
            let idx = Tensor::new(c.token_ids.as_slice(), &Device::Cpu)
                .unwrap()
                .unsqueeze(1)
                .unwrap();
            let lp = log_softmax(&zs, 1.0)
                .gather(&idx, 1)
                .unwrap()
                .squeeze(1)
                .unwrap();
            let (ls, lt) = (log_softmax(&zs, kd), log_softmax(&zt, kd));
            let reward: Vec<f32> = (ls
                .gather(&idx, 1)
                .unwrap()
                .squeeze(1)
                .unwrap()
                .detach()
                .neg()
                .unwrap()
                + lt.gather(&idx, 1).unwrap().squeeze(1).unwrap())
            .unwrap()
            .to_vec1()
            .unwrap();
            let adv: Vec<f32> = (0..len)
                .map(|j| {
                    let rkl_adv = match (rkl, gamma == 0.0) {
                        (false, _) => 0.0,
                        (true, true) => f64::from(reward[j]),
                        (true, false) => {
                            let num: f64 = (j..len)
                                .map(|k| gamma.powi(k as i32) * f64::from(reward[k]))
                                .sum();
                            num / (j..len).map(|k| gamma.powi(k as i32)).sum::<f64>()
                        }
                    };
                    (f64::from(sc.advantages[i]) + rkl_adv) as f32
                })
                .collect();
            let adv = Tensor::from_vec(adv, len, &Device::Cpu).unwrap();
            loss = (loss - ((&lp * &adv).unwrap().sum_all().unwrap() / total).unwrap()).unwrap();
            if single {
                let per_token = (ls.exp().unwrap() * (&ls - &lt).unwrap())
                    .unwrap()
                    .sum(1)
                    .unwrap();
                kl = (kl + per_token.sum_all().unwrap()).unwrap();
            }
            tokens += len as f64;
        }
        loss = (loss + (kl / tokens).unwrap()).unwrap();
    }
    loss
}

/// The first update against TRL's gradient, computed here by autograd from the models'
/// logits: the learner's `grad_norm` is its norm, and AdamW's first step (`−lr · g / (|g| +
/// ε)`, clipping only scales `g`) moves every weight against its sign — for the reverse-KL
/// advantage alone (discounted), the single-step term alone, and both.
#[test]
fn the_first_update_follows_trls_gradient() {
    let f = fixture();
    let teacher = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu)
        .unwrap()
        .model;
    for (i, (kd, gamma, rkl, single)) in [
        (1.0, 0.0, true, false),
        (1.5, 0.8, true, false),
        (1.0, 0.0, false, true),
        (2.0, 0.0, true, true),
    ]
    .into_iter()
    .enumerate()
    {
        let out = format!("grad-{i}");
        let extra = format!(
            "[[rewards]]\ntype = \"accuracy\"\n[minillm]\nkd_temperature = {kd}\ngamma = {gamma}\n\
             rkl_advantage = {rkl}\nsingle_step_decomposition = {single}\n"
        );
        let cfg = load(&f.root, &out, 1, &extra);
        let micro = cfg.micro_batch();
        let s = trainer::setup(cfg).unwrap();
        let (mut learner, sc) = common::first_scored_step(&s, &f.root.join(&out));
        let before: Vec<Vec<f32>> = s
            .policy
            .vars
            .iter()
            .map(|(_, v)| v.flatten_all().unwrap().to_vec1().unwrap())
            .collect();
        let loss = reference_loss(
            &s.policy.model,
            &teacher,
            &sc,
            micro,
            (kd, gamma, rkl, single),
        );
        let grads = s.policy.model.backward(&loss).unwrap();
        let g: Vec<Vec<f32>> = s
            .policy
            .vars
            .iter()
            .map(|(_, v)| match grads.get(v.as_tensor()) {
                Some(g) => g.flatten_all().unwrap().to_vec1().unwrap(),
                None => vec![0.0; v.elem_count()],
            })
            .collect();
        let norm = g
            .iter()
            .flatten()
            .map(|x| f64::from(*x).powi(2))
            .sum::<f64>()
            .sqrt();
        let m = learner.process(&sc).unwrap();
        assert!(
            norm > 0.0 && (m["grad_norm"] - norm).abs() < 1e-3 * norm,
            "case {i}: grad_norm {} vs {norm}",
            m["grad_norm"]
        );
        let (mut checked, mut wrong) = (0, 0);
        for (((_, v), b), g) in s.policy.vars.iter().zip(&before).zip(&g) {
            let after: Vec<f32> = v.flatten_all().unwrap().to_vec1().unwrap();
            for ((a, b), g) in after.iter().zip(b).zip(g) {
                if f64::from(g.abs()) > 1e-4 * norm {
                    checked += 1;
                    if (a - b) * g >= 0.0 {
                        wrong += 1;
                    }
                }
            }
        }
        assert!(
            checked > 100 && wrong == 0,
            "case {i}: {wrong} of {checked} weights moved with the gradient"
        );
    }
}

/// Without rewards (TRL's placeholder reward of 1 for every completion) the reward advantages
/// are 0 and one completion per prompt is allowed; the teacher's terms train alone.
#[test]
fn without_rewards_the_teachers_terms_train_alone() {
    let f = fixture();
    let cfg = load(&f.root, "alone", 2, "");
    assert!(cfg.rewards.is_empty());
    let s = trainer::setup(cfg).unwrap();
    let (_, sc) = common::first_scored_step(&s, &f.root.join("alone-first"));
    assert!(
        sc.advantages.iter().all(|&a| a == 0.0),
        "{:?}",
        sc.advantages
    );
    let mut one = load(&f.root, "one", 2, "");
    one.rollout.num_generations = 1;
    one.validate().unwrap();
    let r = run(one, RunOptions::default());
    assert!(
        r.metrics
            .iter()
            .all(|m| m["loss"].is_finite() && m["grad_norm"] > 0.0)
    );
}

/// Stopped after 2 steps and resumed: the same 4 steps as one run; LoRA with a one-step-stale
/// generator runs.
#[test]
fn resume_is_exact_and_lora_with_staleness_runs() {
    let f = fixture();
    let extra = "[[rewards]]\ntype = \"accuracy\"\n[minillm]\ngamma = 0.9\n";
    let whole = run(load(&f.root, "whole", 4, extra), RunOptions::default());
    let mut cfg = load(&f.root, "parts", 4, extra);
    cfg.train.save_steps = 0;
    let parts = stopped_and_resumed(2, |o| run(cfg.clone(), o));
    let losses = |m: &[grpo_trainer::Metrics]| m.iter().map(|m| m["loss"]).collect::<Vec<_>>();
    assert_eq!(losses(&whole.metrics), losses(&parts));
    let lora = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = [\"q_proj\", \"v_proj\"]\n\
                [pipeline]\nmax_staleness = 1\n";
    let r = run(
        load(&f.root, "lora", 3, &format!("{extra}{lora}")),
        RunOptions::default(),
    );
    assert!(r.metrics.iter().all(|m| m["loss"].is_finite()));
    assert!(
        r.best_checkpoint_path
            .unwrap()
            .join("adapter/adapter_model.safetensors")
            .exists()
    );
}

#[test]
fn what_minillm_cannot_take_is_refused_in_one_line() {
    let f = fixture();
    for (extra, want) in [
        ("[minillm]\nkd_temperature = 0.0", "minillm.kd_temperature"),
        ("[minillm]\ngamma = -0.5", "minillm.gamma"),
        ("[loss]\nloss_type = \"gmpo\"", "rkl_advantage = false"),
        ("[loss]\nloss_type = \"vespo\"", "per token"),
        ("[minillm]\nbeta = 1.0", "unknown field"),
    ] {
        let e = load_err(&f.root, extra);
        assert!(e.contains(want), "{extra}: {e}");
        assert_eq!(e.trim().lines().count(), 1, "{e}");
    }
    // gmpo without the per-token advantages is fine.
    load(
        &f.root,
        "gmpo",
        1,
        "[loss]\nloss_type = \"gmpo\"\n[minillm]\nrkl_advantage = false\n",
    );
    let p = f.root.join("noteacher.toml");
    let text = config_text(&f.root, "nt", 1, "").replace("teacher_model_name_or_path", "# ");
    std::fs::write(&p, text).unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("distillation.teacher_model_name_or_path"), "{e}");
    let p = f.root.join("server.toml");
    let text = config_text(&f.root, "sv", 1, "").replace(
        "teacher_model_name_or_path = ",
        "teacher_server = { base_url = \"http://127.0.0.1:9\", model = \"t\" }\n# ",
    );
    std::fs::write(&p, text).unwrap();
    let e = format!("{:#}", config::load(&p, &[]).unwrap_err());
    assert!(e.contains("teacher_server"), "{e}");
}

#[test]
fn the_minillm_subcommand() {
    let f = fixture();
    let text = config_text(&f.root, "cli", 2, "").replace("algorithm = \"minillm\"", "");
    let p = f.root.join("cli.toml");
    std::fs::write(&p, text).unwrap();
    let out = common::grpo_cli_ok(&["minillm", "--config", p.to_str().unwrap()]);
    assert!(String::from_utf8_lossy(&out.stdout).contains("trained 2 steps; loss"));
    let metrics = std::fs::read_to_string(f.root.join("cli/metrics.jsonl")).unwrap();
    assert!(metrics.contains("minillm/single_step_kl"), "{metrics}");
}

/// A student taught by itself: the reverse-KL advantages and the single-step term are 0, so the
/// first step is GRPO's own (same samples, loss and gradient norm).
#[test]
fn a_student_taught_by_itself_takes_grpos_first_step() {
    let f = fixture();
    // A reward that varies between samples: advantages that are not all 0.
    let extra = "[[rewards]]\ntype = \"format\"\npattern = '(?s).*[0-9].*'\n";
    let mut mini = load(&f.root, "self", 1, extra);
    mini.distillation.teacher_model_name_or_path = Some(f.root.join("student"));
    mini.rollout.num_generations = 4;
    mini.train.prompts_per_step = 8;
    mini.train.per_device_train_batch_size = Some(8);
    let mut grpo = mini.clone();
    grpo.algorithm = grpo_trainer::Algorithm::Grpo;
    grpo.output_dir = f.root.join("grpo");
    let a = run(mini, RunOptions::default()).metrics.remove(0);
    let b = run(grpo, RunOptions::default()).metrics.remove(0);
    assert!(a["minillm/single_step_kl"].abs() < 1e-7, "{a:?}");
    assert!(b["grad_norm"] > 0.0 && b["loss"] != 0.0, "{b:?}");
    for k in ["loss", "grad_norm", "reward"] {
        assert!(
            (a[k] - b[k]).abs() <= 1e-6 * b[k].abs().max(1.0),
            "{k}: {} vs {}",
            a[k],
            b[k]
        );
    }
}
