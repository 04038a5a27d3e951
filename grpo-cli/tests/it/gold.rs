//! GOLD (TRL's experimental GOLDTrainer, `algorithm = "gold"`): with `gold.use_uld_loss` a
//! teacher whose tokenizer splits digits (the student's does not) reads each completion as text,
//! and the first step's loss equals the ULD objective computed directly one completion at a
//! time — the teacher's tokens and both sides' byte offsets from the tokenizers' own encodings,
//! logits from unpadded passes — for the `observed` and `bayesian` merges, the hybrid loss and
//! the student's cross-entropy; one small update lowers that objective on the step's
//! completions; without ULD GOLD is GKD's step at the sampling temperature; TRL's defaults; the
//! refusals; the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use candle_core::{DType, Device, Tensor};
use grpo_core::uld::{UldConfig, UldSide, uld_loss};
use grpo_rollout::tokenizer::Tokenizer;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{Fixture, assert_same_steps, first_scored_step, grpo_cli_ok};

/// A student, a teacher (another random model whose tokenizer splits digits) and arithmetic.
fn fixture() -> Fixture {
    let f = Fixture::new().model("student", 3).arithmetic(40);
    grpo_rollout::init::init_model_dir_with(
        &f.root.join("teacher"),
        grpo_rollout::init::Preset::Tiny,
        grpo_rollout::Arch::Qwen2,
        11,
        true,
    )
    .unwrap();
    f
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str, gold: &str) -> String {
    format!(
        r#"
algorithm = "gold"
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
[distillation]
teacher_model_name_or_path = "{teacher}"
lmbda = 1.0
{extra}
[gold]
{gold}
"#,
        out = root.join(out).display(),
        model = root.join("student").display(),
        data = root.join("arith.jsonl").display(),
        teacher = root.join("teacher").display(),
    )
}

fn load(root: &Path, out: &str, steps: usize, extra: &str, gold: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra, gold)).unwrap();
    config::load(&p, &[]).unwrap()
}

/// Logits rows at positions `P − 1 … P + n − 1` of prompt + completion (one unpadded pass, a
/// token appended so the last completion token's row is scored).
fn rows(m: &grpo_rollout::Transformer, prompt: &[u32], completion: &[u32]) -> Tensor {
    let ids: Vec<u32> = prompt
        .iter()
        .chain(completion)
        .chain([&0])
        .copied()
        .collect();
    let l = ids.len();
    let ids = Tensor::from_vec(ids, (1, l), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, l), DType::U32, &Device::Cpu).unwrap();
    let h = m
        .completion_hidden(&ids, &mask, completion.len() + 1)
        .unwrap();
    m.logits(&h).unwrap()
}

/// The ULD objective of `student` on the completions, computed one at a time (the ULD mean
/// over completions plus `ce_weight` × the student's mean token cross-entropy): the teacher's
/// tokens from its tokenizer's encoding of the decoded texts, the teacher's byte offsets from
/// that encoding's offsets, the student's from decoding growing prefixes.
fn objective(
    student: &grpo_rollout::Transformer,
    stok: &Tokenizer,
    teacher: &grpo_rollout::Transformer,
    ttok: &Tokenizer,
    completions: &[(Vec<u32>, Vec<u32>)],
    cfg: &UldConfig,
    ce_weight: f64,
) -> f64 {
    let teos = ttok.eos_token_ids[0];
    let (mut uld, mut ce, mut tokens) = (0.0, 0.0, 0.0);
    for (p, x) in completions {
        let prompt = stok.decode(p, false).unwrap();
        let text = stok.decode(x, false).unwrap();
        let mut tp = ttok.encode(&prompt, true).unwrap();
        if tp.last() == Some(&teos) {
            tp.pop();
        }
        let enc = ttok.inner.encode(text.as_str(), false).unwrap();
        let mut tx = enc.get_ids().to_vec();
        let mut toffs = normalized(enc.get_offsets(), enc.get_tokens());
        tx.push(teos);
        toffs.push((text.len(), text.len()));
        // The student's: each sampled token's byte-level piece, one byte per character (TRL's
        // `piece_byte_len`).
        let mut at = 0;
        let soffs: Vec<(usize, usize)> = x
            .iter()
            .map(|&t| {
                let n = stok.inner.id_to_token(t).unwrap().chars().count();
                at += n;
                (at - n, at)
            })
            .collect();
        let zs = rows(student, p, x);
        let zt = rows(teacher, &tp, &tx);
        let z: Vec<Vec<f32>> = zs.to_vec2().unwrap();
        for (j, &t) in x.iter().enumerate() {
            let m = z[j].iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
            let lse = m + z[j]
                .iter()
                .map(|v| (f64::from(*v) - m).exp())
                .sum::<f64>()
                .ln();
            ce += lse - f64::from(z[j][t as usize]);
            tokens += 1.0;
        }
        let sample = (
            UldSide {
                logits: zs,
                ids: x.clone(),
                offsets: soffs,
            },
            UldSide {
                logits: zt,
                ids: tx,
                offsets: toffs,
            },
        );
        uld += f64::from(
            uld_loss(&[sample], cfg)
                .unwrap()
                .loss
                .to_scalar::<f32>()
                .unwrap(),
        );
    }
    uld / completions.len() as f64 + ce_weight * ce / tokens
}

/// TRL's `_normalize_byte_offsets` of a byte-level encoding: a span that overlaps the one
/// before (a character's bytes split across tokens share its span) starts where that one ended
/// and covers its piece's bytes (one per character of a byte-level piece).
fn normalized(offsets: &[(usize, usize)], tokens: &[String]) -> Vec<(usize, usize)> {
    let mut cursor = 0;
    offsets
        .iter()
        .enumerate()
        .map(|(i, &(start, end))| {
            let len = tokens[i].chars().count();
            let next = offsets.get(i + 1).map(|o| o.0);
            let (mut s, mut e) = (start, end);
            if (start < cursor || next.is_some_and(|n| n < end) || len == end - start)
                && start.max(cursor) + len <= end
            {
                s = start.max(cursor);
                e = s + len;
            }
            cursor = e;
            (s, e)
        })
        .collect()
}

/// The scored step's (prompt, completion) pairs.
fn pairs(sc: &grpo_trainer::stages::Scored) -> Vec<(Vec<u32>, Vec<u32>)> {
    let r = &sc.rollouts;
    r.completions
        .iter()
        .map(|c| (r.prompt_ids[c.prompt_index].clone(), c.token_ids.clone()))
        .collect()
}

#[test]
fn the_first_step_is_the_uld_objective_and_an_update_lowers_it() {
    let f = fixture();
    let teacher = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu).unwrap();
    let cases = [
        ("", 0.0),
        (
            "uld_token_merge_strategy = \"bayesian\"\nuld_skip_student_eos = false",
            0.0,
        ),
        (
            "uld_use_hybrid_loss = true\nuld_crossentropy_weight = 0.3",
            0.3,
        ),
        (
            "uld_use_hybrid_loss = true\nuld_hybrid_matched_weight = 0.2\n\
             uld_hybrid_unmatched_weight = 0.7\nuse_extended_uld = false",
            0.0,
        ),
    ];
    for (i, (gold, ce_weight)) in cases.into_iter().enumerate() {
        let out = format!("uld-{i}");
        let gold = format!("use_uld_loss = true\n{gold}");
        let mut cfg = load(&f.root, &out, 1, "", &gold);
        cfg.train.per_device_train_batch_size = Some(8);
        cfg.optim.learning_rate = Some(3e-4);
        let s = trainer::setup(cfg).unwrap();
        let uld = s
            .cfg
            .gold
            .uld_config(s.cfg.gold.uld_use_hybrid_loss.then(|| {
                let v = |t: &Tokenizer| t.inner.get_vocab(true).into_iter().collect();
                (
                    grpo_core::uld::VocabMatch::new(&v(&s.tokenizer), &v(&teacher.tokenizer)),
                    s.cfg.distillation.beta,
                )
            }));
        let (mut learner, sc) = first_scored_step(&s, &f.root.join(&out));
        let c = pairs(&sc);
        // The texts tokenise differently: some completion has digits the teacher splits.
        let student = s.policy.model.snapshot().unwrap();
        let obj = |m: &grpo_rollout::Transformer| {
            objective(
                m,
                &s.tokenizer,
                &teacher.model,
                &teacher.tokenizer,
                &c,
                &uld,
                ce_weight,
            )
        };
        let want = obj(&student);
        let m = learner.process(&sc).unwrap();
        assert!(
            want > 0.0 && (m["loss"] - want).abs() < 1e-4 * want,
            "case {i}: loss {} vs {want}",
            m["loss"]
        );
        assert_eq!(
            m.contains_key("matched_loss"),
            s.cfg.gold.uld_use_hybrid_loss,
            "case {i}"
        );
        let after = obj(&learner.policy().model.detached());
        assert!(after < want, "case {i}: {want} -> {after}");
    }
}

/// The teacher's tokenizer really differs: it splits a number the student's keeps whole.
#[test]
fn the_teacher_tokenises_digits_apart() {
    let f = fixture();
    let s = grpo_rollout::load(&f.root.join("student"), DType::F32, &Device::Cpu).unwrap();
    let t = grpo_rollout::load(&f.root.join("teacher"), DType::F32, &Device::Cpu).unwrap();
    let text = "12 + 345 = 357";
    let (a, b) = (
        s.tokenizer.encode(text, false).unwrap(),
        t.tokenizer.encode(text, false).unwrap(),
    );
    assert_ne!(a.len(), b.len(), "{a:?} {b:?}");
}

/// Without ULD, GOLD is GKD's step at the sampling temperature (GKD's is 1): at temperature
/// 1 the same steps.
#[test]
fn without_uld_gold_is_gkds_step() {
    let f = fixture();
    std::fs::remove_dir_all(f.root.join("teacher")).unwrap();
    grpo_rollout::init::init_model_dir(
        &f.root.join("teacher"),
        grpo_rollout::init::Preset::Tiny,
        grpo_rollout::Arch::Qwen2,
        11,
    )
    .unwrap();
    let run = |cfg: TrainConfig| {
        let s = trainer::setup(cfg).unwrap();
        trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap()
    };
    let extra = "[rollout]\n";
    let _ = extra;
    let mut a = load(&f.root, "g", 2, "", "");
    a.rollout.temperature = 1.0;
    let mut b = load(&f.root, "k", 2, "", "");
    b.algorithm = grpo_trainer::Algorithm::Gkd;
    b.rollout.temperature = 1.0;
    b.output_dir = f.root.join("k");
    let (a, b) = (run(a), run(b));
    assert_same_steps(&a.metrics, &b.metrics, &["loss", "grad_norm"]);
}

#[test]
fn trls_defaults_the_refusals_and_the_subcommand() {
    let f = fixture();
    let text = config_text(&f.root, "d", 1, "", "use_uld_loss = true")
        .replace("num_generations = 2\n", "")
        .replace("max_completion_length = 8\n", "")
        .replace("learning_rate = 3e-3\n", "")
        .replace("lmbda = 1.0\n", "");
    let p = f.root.join("d.toml");
    std::fs::write(&p, &text).unwrap();
    let c = config::load(&p, &[]).unwrap();
    assert_eq!(
        (c.rollout.num_generations, c.rollout.max_completion_length),
        (1, 128)
    );
    assert_eq!((c.rollout.temperature, c.rollout.top_p), (0.9, 0.95));
    assert_eq!((c.learning_rate(), c.distillation.beta), (1e-7, 0.5));
    assert_eq!(c.distillation.lmbda_for(c.algorithm), 0.5);
    assert!(c.dropout_disabled());
    let g = &c.gold;
    assert!(g.use_extended_uld && g.uld_skip_student_eos && g.uld_skip_teacher_eos);
    assert_eq!(
        (g.uld_distillation_weight, g.uld_crossentropy_weight),
        (1.0, 0.0)
    );
    for (set, want) in [
        (
            "gold.uld_student_temperature=0.0",
            "`gold.uld_student_temperature` must be > 0",
        ),
        (
            "gold.uld_crossentropy_weight=-1.0",
            "`gold.uld_crossentropy_weight` must be >= 0",
        ),
        ("gold.uld_hybrid_matched_weight=0.5", "are set together"),
        (
            "gold.uld_token_merge_strategy=\"mean\"",
            "uld_token_merge_strategy",
        ),
        ("distillation.seq_kd=true", "leave seq_kd out"),
        ("algorithm=\"gkd\"", "is GOLD's"),
    ] {
        let e = format!("{:#}", config::load(&p, &[set.to_string()]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{set}: {e}");
    }
    let text = text.replace("algorithm = \"gold\"", "");
    std::fs::write(&p, text).unwrap();
    let sets = [
        "rollout.max_completion_length=6",
        "train.max_steps=1",
        "distillation.lmbda=1.0",
    ];
    let mut args = vec!["gold", "--config", p.to_str().unwrap()];
    for s in &sets {
        args.extend(["--set", s]);
    }
    grpo_cli_ok(&args);
    let metrics = std::fs::read_to_string(f.root.join("d/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1);
}
