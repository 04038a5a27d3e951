//! SDPO (TRL's experimental SDPOTrainer, `algorithm = "sdpo"`): the first step's loss equals
//! the self-distillation of the policy reprompted with TRL's templates, computed here directly
//! from the model one completion at a time (sampled-token, full-logit and top-k modes, with
//! feedback rows); with `distillation_weight = 0` the steps are GRPO's (bnpo); nothing to learn
//! from (no successful sibling, no feedback) leaves the weights alone; the EMA teacher is
//! `(1 − r) · teacher + r · policy` after each update (full fine-tuning, and LoRA's adapters
//! from zero) and resumes exactly; TRL's defaults; the refusals; the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;
use std::path::Path;
use std::sync::Arc;

use candle_core::{DType, Device, Tensor};
use grpo_core::distill::Divergence;
use grpo_rewards::RewardInput;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, FitOptions, RunOptions, SdpoTrainer};

use crate::common;
use common::{
    Fixture, assert_same_steps, completion_logits, first_scored_step, grpo_cli_ok,
    stopped_and_resumed,
};

/// TRL's default templates, spelled out here (not read from the config).
const SOLUTION: &str = "\nCorrect solution:\n\n";
const FEEDBACK: &str = "\nThe following is feedback from your unsuccessful earlier attempt:\n\n";
const TAIL: &str = "\n\nCorrectly solve the original question.\n";

/// A tiny model and 8 prompts, the even ones with feedback in `privileged_context`.
fn fixture() -> Fixture {
    let f = Fixture::new().model("model", 3);
    let rows: String = (0..8)
        .map(|i| match i % 2 {
            0 => format!(
                "{{\"prompt\": \"Say something ({i}):\", \"privileged_context\": \"Too short ({i}).\"}}\n"
            ),
            _ => format!("{{\"prompt\": \"Say something ({i}):\"}}\n"),
        })
        .collect();
    std::fs::write(f.root.join("prompts.jsonl"), rows).unwrap();
    f
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "sdpo"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 4
max_completion_length = 6
[optim]
learning_rate = 5e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 2
per_device_train_batch_size = 8
save_steps = 1
shuffle_dataset = false
[[rewards]]
type = "accuracy"
[sdpo]
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("prompts.jsonl").display(),
    )
}

/// The config with `[sdpo]` lines `extra` (the reward comes in code).
fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra)).unwrap();
    let mut cfg = config::load(&p, &[]).unwrap();
    cfg.rewards.clear();
    cfg
}

/// 1 for a completion whose length in bytes is a multiple of 3, else 0: groups of both kinds.
fn parity(batch: &[RewardInput]) -> Vec<f32> {
    batch
        .iter()
        .map(|x| f32::from(u8::from(x.completion.len().is_multiple_of(3))))
        .collect()
}

fn zero(batch: &[RewardInput]) -> Vec<f32> {
    vec![0.0; batch.len()]
}

fn setup_with(cfg: TrainConfig, reward: fn(&[RewardInput]) -> Vec<f32>) -> trainer::Setup {
    let mut s = trainer::setup(cfg).unwrap();
    Arc::get_mut(&mut s.rewards)
        .unwrap()
        .push_reward("parity", 1.0, Arc::new(reward));
    s
}

fn fit(cfg: TrainConfig, opts: Option<RunOptions>) -> trainer::TrainingResult {
    let Some(opts) = opts else {
        let mut t = SdpoTrainer::from_config(cfg).unwrap();
        return t
            .fit_with(FitOptions::default().reward("parity", 1.0, parity))
            .unwrap();
    };
    let s = setup_with(cfg, parity);
    trainer::run(s, &opts, &mut grpo_trainer::NoCallbacks).unwrap()
}

/// Per-token values of one completion after `prompt` (under `student`) and `teacher_prompt`
/// (under `teacher`), from the models' logits: the divergence `mode`, or without one the gap
/// `log π − log π_T` of the sampled tokens.
fn per_token_pair(
    student: &grpo_rollout::Transformer,
    teacher: &grpo_rollout::Transformer,
    prompt: &[u32],
    teacher_prompt: &[u32],
    completion: &[u32],
    mode: Option<Divergence>,
) -> Vec<f64> {
    let (zs, zt) = (
        completion_logits(student, prompt, completion),
        completion_logits(teacher, teacher_prompt, completion),
    );
    match mode {
        Some(d) => d.of(&zs, &zt, 1.0).unwrap().to_vec1().unwrap(),
        None => {
            let lsm = |z: &Tensor| -> Vec<Vec<f64>> {
                let rows: Vec<Vec<f64>> = z.to_vec2().unwrap();
                rows.into_iter()
                    .map(|r| {
                        let m = r.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                        let lse = m + r.iter().map(|x| (x - m).exp()).sum::<f64>().ln();
                        r.iter().map(|x| x - lse).collect()
                    })
                    .collect()
            };
            let (ls, lt) = (lsm(&zs), lsm(&zt));
            completion
                .iter()
                .enumerate()
                .map(|(t, &tok)| ls[t][tok as usize] - lt[t][tok as usize])
                .collect()
        }
    }
}

/// The self-distillation values the loss averages: the divergence `mode`, or the sampled-token
/// term `sg(log π − log π_T) · log π` (the same model both sides: the live teacher at step 0).
fn per_token(
    model: &grpo_rollout::Transformer,
    prompt: &[u32],
    teacher_prompt: &[u32],
    completion: &[u32],
    mode: Option<Divergence>,
) -> Vec<f64> {
    let v = per_token_pair(model, model, prompt, teacher_prompt, completion, mode);
    if mode.is_some() {
        return v;
    }
    // The student's own log-probs of the sampled tokens.
    let ids: Vec<u32> = prompt.iter().chain(completion).copied().collect();
    let n = ids.len();
    let ids = Tensor::from_vec(ids, (1, n), &Device::Cpu).unwrap();
    let mask = Tensor::ones((1, n), DType::U32, &Device::Cpu).unwrap();
    let (lp, _) = model
        .completion_logprobs(&ids, &mask, completion.len(), 1.0, false)
        .unwrap();
    let lp: Vec<f32> = lp.flatten_all().unwrap().to_vec1().unwrap();
    v.iter().zip(lp).map(|(g, l)| g * f64::from(l)).collect()
}

/// Completion `i`'s teacher prompt by TRL's plan and templates (spelled out here: the first
/// successful sibling of its group of `g`, the row's feedback), and whether it has a
/// demonstration; `None` without a context.
fn teacher_prompt(
    sc: &grpo_trainer::stages::Scored,
    tok: &grpo_rollout::Tokenizer,
    i: usize,
    g: usize,
) -> Option<(Vec<u32>, bool)> {
    let r = &sc.rollouts;
    let group = (i / g) * g..(i / g) * g + g;
    let demo = group
        .clone()
        .find(|&j| j != i && sc.scores.rewards[j] >= 1.0);
    let sample = &r.batch.samples[r.completions[i].prompt_index];
    let feedback = sample.get_text("privileged_context");
    if demo.is_none() && feedback.is_none() {
        return None;
    }
    let mut text = sample.prompt.text();
    if let Some(j) = demo {
        let d = tok.decode(&r.completions[j].token_ids, true).unwrap();
        text += &format!("{SOLUTION}{d}\n\n");
    }
    if let Some(fb) = feedback {
        text += &format!("{FEEDBACK}{fb}\n\n");
    }
    text += TAIL;
    Some((tok.encode(&text, true).unwrap(), demo.is_some()))
}

/// The first step of a live-teacher run: its loss against the direct computation, and the
/// context metrics against the plan made here.
fn first_step_matches(extra: &str, mode: Option<Divergence>) {
    let f = fixture();
    let cfg = load(
        &f.root,
        "first",
        1,
        &format!("teacher_model_kind = \"live\"\ninclude_environment_feedback = true\n{extra}"),
    );
    let s = setup_with(cfg, parity);
    let (mut learner, sc) = first_scored_step(&s, &f.root.join("first"));
    let r = &sc.rollouts;
    let g = 4;
    let n = r.completions.len();
    assert_eq!(n, 8);
    let model = s.policy.model.detached();
    let tok = &s.tokenizer;
    let (mut total, mut active, mut with_demo) = (0.0, 0, 0);
    for (i, c) in r.completions.iter().enumerate() {
        let Some((teacher_ids, has_demo)) = teacher_prompt(&sc, tok, i, g) else {
            continue;
        };
        active += 1;
        with_demo += usize::from(has_demo);
        let v = per_token(
            &model,
            &r.prompt_ids[c.prompt_index],
            &teacher_ids,
            &c.token_ids,
            mode,
        );
        total += v.iter().sum::<f64>() / v.len() as f64;
    }
    assert!(
        with_demo > 0 && active < n,
        "a mixed step: {active} of {n} reprompted, {with_demo} with a demonstration"
    );
    let want = total / n as f64;
    let m = learner.process(&sc).unwrap();
    assert!(
        (m["loss"] - want).abs() < 2e-5 * want.abs().max(1e-3),
        "loss {} vs {want}",
        m["loss"]
    );
    assert_eq!(
        m["self_distillation/reprompt_sample_fraction"],
        active as f64 / n as f64
    );
    assert_eq!(
        m["self_distillation/success_sample_fraction"],
        with_demo as f64 / n as f64
    );
    assert_eq!(m["self_distillation/feedback_available_fraction"], 0.5);
    assert!(m["grad_norm"] > 0.0);
}

#[test]
fn the_first_step_is_the_policys_self_distillation_sampled_token() {
    first_step_matches("", None);
}

#[test]
fn the_first_step_is_the_policys_self_distillation_full_and_topk_logits() {
    first_step_matches(
        "distillation_mode = \"full_logits\"\ndistillation_alpha = 0.5",
        Some(Divergence::Full { beta: 0.5 }),
    );
    first_step_matches(
        "distillation_mode = \"topk_logits\"\ndistillation_topk = 5\ndistillation_add_tail = true\ndistillation_alpha = 1.0",
        Some(Divergence::TopK {
            k: 5,
            beta: 1.0,
            add_tail: true,
        }),
    );
}

/// With `distillation_weight = 0` SDPO's step is GRPO's (bnpo, no KL): the same completions,
/// losses and gradient norms.
#[test]
fn weight_zero_is_grpo() {
    let f = fixture();
    let sdpo = load(
        &f.root,
        "sdpo",
        3,
        "distillation_weight = 0.0\nteacher_model_kind = \"live\"",
    );
    let mut grpo = sdpo.clone();
    grpo.algorithm = grpo_trainer::Algorithm::Grpo;
    grpo.output_dir = f.root.join("grpo");
    grpo.loss.loss_type = grpo_core::loss::LossType::Bnpo;
    let mut sdpo = sdpo;
    sdpo.loss.loss_type = grpo_core::loss::LossType::Bnpo;
    // The same learning rate and dropout (SDPO's defaults differ).
    grpo.train.disable_dropout = Some(true);
    let a = fit(sdpo, None);
    let s = setup_with(grpo, parity);
    let b = trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap();
    assert_same_steps(&a.metrics, &b.metrics, &["loss", "grad_norm", "reward"]);
    assert!(a.metrics[0].contains_key("self_distillation/policy_loss"));
}

/// No successful sibling and no feedback: the loss is 0 and nothing moves.
#[test]
fn nothing_to_distill_leaves_the_weights() {
    let f = fixture();
    let cfg = load(&f.root, "none", 2, "teacher_model_kind = \"live\"");
    let s = setup_with(cfg, zero);
    let r = trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap();
    for m in &r.metrics {
        assert_eq!(m["loss"], 0.0, "{m:?}");
        assert_eq!(m["grad_norm"], 0.0);
        assert_eq!(m["self_distillation/reprompt_sample_fraction"], 0.0);
        assert_eq!(m["self_distillation/feedback_available_fraction"], 0.5);
    }
}

fn safetensors(p: &Path) -> HashMap<String, Tensor> {
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

/// The EMA teacher of a full fine-tune: `t_k = 0.95 · t_{k−1} + 0.05 · w_k` from the loaded
/// weights; 2 steps + resume + 2 equal 4.
#[test]
fn the_ema_teacher_follows_the_weights_and_resumes() {
    let f = fixture();
    let r = fit(load(&f.root, "ema", 2, ""), None);
    assert_eq!(r.metrics.len(), 2);
    let w0 = safetensors(&f.root.join("model/model.safetensors"));
    let ck = |k: usize, file: &str| {
        safetensors(&f.root.join(format!("ema/checkpoints/step-{k}/{file}")))
    };
    let (w1, t1) = (
        ck(1, "model/model.safetensors"),
        ck(1, "sdpo_teacher.safetensors"),
    );
    let (w2, t2) = (
        ck(2, "model/model.safetensors"),
        ck(2, "sdpo_teacher.safetensors"),
    );
    for key in [
        "model.layers.0.self_attn.q_proj.weight",
        "model.layers.1.mlp.down_proj.weight",
        "model.norm.weight",
    ] {
        let want1 = ((&w0[key] * 0.95).unwrap() + (&w1[key] * 0.05).unwrap()).unwrap();
        assert!(max_diff(&t1[key], &want1) < 1e-6, "{key} step 1");
        let want2 = ((&t1[key] * 0.95).unwrap() + (&w2[key] * 0.05).unwrap()).unwrap();
        assert!(max_diff(&t2[key], &want2) < 1e-6, "{key} step 2");
        assert!(max_diff(&w1[key], &w0[key]) > 0.0, "{key} trained");
    }
    let all = fit(load(&f.root, "all", 4, ""), None);
    let cfg = load(&f.root, "parts", 4, "");
    let joined = stopped_and_resumed(2, |o| fit(cfg.clone(), Some(o)));
    assert_same_steps(
        &joined,
        &all.metrics,
        &["loss", "grad_norm", "self_distillation/distillation_loss"],
    );
}

/// With LoRA the EMA teacher's adapters start at zero (the teacher is the base model: the same
/// first step as the live teacher, whose fresh adapters are zero too) and follow the policy's
/// as `a_k = 0.95 · a_{k−1} + 0.05 · θ_k`; it resumes exactly.
#[test]
fn the_lora_ema_teacher_starts_at_zero_and_resumes() {
    let f = fixture();
    let lora = "[model.lora]\nr = 4\nlora_alpha = 8\ntarget_modules = \"all-linear\"\n";
    let cfg = |out: &str, steps: usize, extra: &str| {
        let p = f.root.join(format!("{out}.toml"));
        let text =
            config_text(&f.root, out, steps, extra).replace("[data]", &format!("{lora}[data]"));
        std::fs::write(&p, text).unwrap();
        let mut c = config::load(&p, &[]).unwrap();
        c.rewards.clear();
        c
    };
    let ema = fit(cfg("lema", 2, ""), None);
    let live = fit(cfg("llive", 1, "teacher_model_kind = \"live\""), None);
    assert!((ema.metrics[0]["loss"] - live.metrics[0]["loss"]).abs() < 1e-9);
    let ck = |k: usize, file: &str| {
        safetensors(&f.root.join(format!("lema/checkpoints/step-{k}/{file}")))
    };
    let (a1, t1) = (
        ck(1, "adapter/adapter_model.safetensors"),
        ck(1, "sdpo_teacher.safetensors"),
    );
    let (a2, t2) = (
        ck(2, "adapter/adapter_model.safetensors"),
        ck(2, "sdpo_teacher.safetensors"),
    );
    assert!(!t1.is_empty() && t1.keys().all(|k| k.contains("lora_")));
    for (key, t) in &t1 {
        let want1 = (&a1[key] * 0.05).unwrap();
        assert!(max_diff(t, &want1) < 1e-7, "{key} step 1");
        let want2 = ((t * 0.95).unwrap() + (&a2[key] * 0.05).unwrap()).unwrap();
        assert!(max_diff(&t2[key], &want2) < 1e-7, "{key} step 2");
    }
    let all = fit(cfg("lall", 4, ""), None);
    let c = cfg("lparts", 4, "");
    let joined = stopped_and_resumed(2, |o| fit(c.clone(), Some(o)));
    assert_same_steps(&joined, &all.metrics, &["loss", "grad_norm"]);
}

#[test]
fn trls_defaults_the_refusals_and_the_subcommand() {
    let f = fixture().arithmetic(8);
    let text = config_text(&f.root, "d", 1, "")
        .replace("learning_rate = 5e-3\n", "")
        .replace("prompts.jsonl", "arith.jsonl");
    let p = f.root.join("d.toml");
    std::fs::write(&p, &text).unwrap();
    let c = config::load(&p, &[]).unwrap();
    assert_eq!(c.learning_rate(), 5e-5);
    assert!(c.dropout_disabled());
    let d = &c.sdpo;
    assert_eq!(
        (
            d.distillation_weight,
            d.distillation_alpha,
            d.distillation_is_clip
        ),
        (1.0, 1.0, 2.0)
    );
    assert_eq!(d.teacher_model_kind, config::SdpoTeacher::Ema);
    assert_eq!((d.teacher_update_rate, d.teacher_sync_steps), (0.05, 1));
    assert_eq!(d.success_reward_threshold, 1.0);
    assert_eq!(d.max_reprompt_len, 10240);
    for (set, want) in [
        (
            "sdpo.distillation_weight=1.5",
            "`sdpo.distillation_weight` must be in [0, 1]",
        ),
        ("sdpo.distillation_alpha=0.5", "is the reverse KL only"),
        (
            "sdpo.distillation_mode=\"topk_logits\"",
            "needs `sdpo.distillation_topk`",
        ),
        ("sdpo.distillation_topk=4", "leave it out"),
        (
            "sdpo.teacher_update_rate=0.0",
            "`sdpo.teacher_update_rate` must be in (0, 1]",
        ),
        (
            "sdpo.reprompt_template=\"{question}\"",
            "`sdpo.reprompt_template`: unknown field `{question}`",
        ),
        ("reference.beta=0.1", "leave `reference.beta` at 0"),
        ("loss.loss_type=\"cispo\"", "SDPO's policy term takes"),
        (
            "loss.drop_zero_std_groups=true",
            "SDPO distils every completion",
        ),
    ] {
        let set = match set {
            "loss.loss_type=\"cispo\"" => {
                vec![set.to_string(), "sdpo.distillation_weight=0.5".to_string()]
            }
            _ => vec![set.to_string()],
        };
        let e = format!("{:#}", config::load(&p, &set).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{set:?}: {e}");
    }
    let text = text.replace("algorithm = \"sdpo\"", "");
    std::fs::write(&p, text).unwrap();
    grpo_cli_ok(&["sdpo", "--config", p.to_str().unwrap()]);
    let metrics = std::fs::read_to_string(f.root.join("d/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1);
    assert!(
        metrics.contains("self_distillation/reprompt_sample_fraction"),
        "{metrics}"
    );
}

/// With two passes over each generation the step has old log-probs, and each token's
/// distillation loss is weighed by `min(π / π_old, distillation_is_clip)`: at a clip of 0.5
/// below every ratio (≈ 1) the loss is half the unclipped one (AdamW's first moves hardly
/// depend on the gradient's scale, so both runs see nearly the same weights in the second
/// pass); a single pass has no old log-probs and no clip.
#[test]
fn old_log_probs_clip_the_distillation_weights() {
    let f = fixture();
    let extra = "teacher_model_kind = \"live\"\n";
    let mut off = load(
        &f.root,
        "off",
        1,
        &format!("{extra}distillation_is_clip = 0.0"),
    );
    let mut half = load(
        &f.root,
        "half",
        1,
        &format!("{extra}distillation_is_clip = 0.5"),
    );
    let mut one = load(&f.root, "one", 1, extra);
    for c in [&mut off, &mut half] {
        c.optim.num_iterations = 2;
    }
    // One pass: no old log-probs, the clip never applies.
    one.sdpo.distillation_is_clip = 0.5;
    let (off, half, one) = (fit(off, None), fit(half, None), fit(one, None));
    let (a, b) = (off.metrics[0]["loss"], half.metrics[0]["loss"]);
    assert!(a.abs() > 1e-6);
    // (AdamW's ε makes the first moves of parameters with tiny gradients differ slightly.)
    assert!((b - 0.5 * a).abs() < 2e-2 * a.abs(), "{b} vs half of {a}");
    let plain = fit(
        load(
            &f.root,
            "plain",
            1,
            &format!("{extra}distillation_is_clip = 0.0"),
        ),
        None,
    );
    assert!((one.metrics[0]["loss"] - plain.metrics[0]["loss"]).abs() < 1e-12);
}

/// One update moves the policy toward the fixed `base` teacher: on the step's own completions
/// (those with a context) the objective each mode's gradient descends falls — for
/// `sampled_token` `½ (log π − log π_T)²` (its gradient is `(log π − log π_T) ∇ log π`), for the
/// logit modes their divergence.
#[test]
fn an_update_moves_the_policy_toward_the_teacher() {
    for (extra, mode) in [
        ("", None),
        (
            "distillation_mode = \"full_logits\"\ndistillation_alpha = 0.0",
            Some(Divergence::Full { beta: 0.0 }),
        ),
        (
            "distillation_mode = \"topk_logits\"\ndistillation_topk = 4",
            Some(Divergence::TopK {
                k: 4,
                beta: 1.0,
                add_tail: false,
            }),
        ),
    ] {
        let f = fixture();
        let mut cfg = load(
            &f.root,
            "toward",
            1,
            &format!("teacher_model_kind = \"base\"\ninclude_environment_feedback = true\n{extra}"),
        );
        cfg.optim.learning_rate = Some(1e-5);
        let s = setup_with(cfg, parity);
        let (mut learner, sc) = first_scored_step(&s, &f.root.join("toward"));
        let teacher = s.policy.model.snapshot().unwrap();
        let tok = &s.tokenizer;
        let objective = |model: &grpo_rollout::Transformer| -> f64 {
            let r = &sc.rollouts;
            let (mut sum, mut n) = (0.0, 0.0);
            for (i, c) in r.completions.iter().enumerate() {
                let Some((tp, _)) = teacher_prompt(&sc, tok, i, 4) else {
                    continue;
                };
                let p = &r.prompt_ids[c.prompt_index];
                let v: Vec<f64> = match mode {
                    Some(_) => per_token_pair(model, &teacher, p, &tp, &c.token_ids, mode),
                    None => per_token_pair(model, &teacher, p, &tp, &c.token_ids, None)
                        .into_iter()
                        .map(|g| 0.5 * g * g)
                        .collect(),
                };
                sum += v.iter().sum::<f64>();
                n += v.len() as f64;
            }
            sum / n
        };
        let before = objective(&teacher);
        learner.process(&sc).unwrap();
        let after = objective(&learner.policy().model.detached());
        eprintln!("{extra:?}: {before} -> {after}");
        assert!(after < before * 0.99, "{extra:?}: {before} -> {after}");
    }
}
