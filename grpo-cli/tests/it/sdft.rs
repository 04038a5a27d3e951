//! SDFT (TRL's experimental SDFTTrainer, `algorithm = "sdft"`): the first step's loss equals
//! the top-k self-distillation of the policy shown each row's privileged context, computed here
//! directly from the model one completion at a time (TRL's defaults: k = 100, α = 0.5; the first
//! completion token skipped); `generate_from_teacher` samples after the teacher's prompt and
//! trains after the plain one; the EMA teacher resumes exactly; a row without a privileged
//! context is named; TRL's defaults; the refusals; the subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use grpo_core::distill::Divergence;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::stages::step_seed;
use grpo_trainer::{self as trainer, RunOptions};

use crate::common;
use common::{
    Fixture, assert_same_steps, completion_logits, eval_lines, first_scored_step, grpo_cli_ok,
    stopped_and_resumed,
};

/// A tiny model and 6 prompts, each with a privileged context.
fn fixture() -> Fixture {
    let f = Fixture::new().model("model", 5);
    let rows: String = (0..6)
        .map(|i| {
            format!(
                "{{\"prompt\": \"Name a colour ({i}):\", \"privileged_context\": \"Say red {i} times.\"}}\n"
            )
        })
        .collect();
    std::fs::write(f.root.join("prompts.jsonl"), rows).unwrap();
    f
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "sdft"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 3
max_completion_length = 6
[optim]
learning_rate = 5e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 2
per_device_train_batch_size = 6
save_steps = 1
shuffle_dataset = false
[sdft]
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("prompts.jsonl").display(),
    )
}

fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

fn run(cfg: TrainConfig, opts: RunOptions) -> trainer::TrainingResult {
    let s = trainer::setup(cfg).unwrap();
    trainer::run(s, &opts, &mut grpo_trainer::NoCallbacks).unwrap()
}

/// The top-k divergence at each completion token of one completion: the model after `prompt`
/// against the same model after `teacher_prompt`.
fn divergences(
    model: &grpo_rollout::Transformer,
    prompt: &[u32],
    teacher_prompt: &[u32],
    completion: &[u32],
    d: Divergence,
) -> Vec<f64> {
    let logits = |p: &[u32]| completion_logits(model, p, completion);
    d.of(&logits(prompt), &logits(teacher_prompt), 1.0)
        .unwrap()
        .to_vec1()
        .unwrap()
}

/// The first step of a run: its loss against the direct computation (TRL's template spelled
/// out here), with the first `skip` tokens left out. With `generate_from_teacher` the
/// completions are those the policy samples after the teacher's prompts.
fn first_step_matches(extra: &str, skip: usize, from_teacher: bool) {
    let f = fixture();
    let cfg = load(&f.root, "first", 1, extra);
    let s = trainer::setup(cfg.clone()).unwrap();
    let (mut learner, sc) = first_scored_step(&s, &f.root.join("first"));
    let r = &sc.rollouts;
    let tok = &s.tokenizer;
    let model = s.policy.model.detached();
    let teacher_ids: Vec<Vec<u32>> = r
        .batch
        .samples
        .iter()
        .map(|x| {
            let ctx = x.get_text("privileged_context").unwrap();
            tok.encode(&format!("{}\n\n{ctx}", x.prompt.text()), true)
                .unwrap()
        })
        .collect();
    if from_teacher {
        let params = cfg.rollout.sampling(step_seed(cfg.train.seed, 0));
        let want = grpo_rollout::generate(
            &model.for_decoding().unwrap(),
            tok,
            &teacher_ids,
            3,
            &params,
        )
        .unwrap();
        let got: Vec<&[u32]> = r
            .completions
            .iter()
            .map(|c| c.token_ids.as_slice())
            .collect();
        let want: Vec<&[u32]> = want.iter().map(|c| c.token_ids.as_slice()).collect();
        assert_eq!(got, want, "sampled after the teacher's prompts");
        // Trained after the plain prompts.
        for (x, ids) in r.batch.samples.iter().zip(&r.prompt_ids) {
            assert_eq!(ids, &tok.encode(&x.prompt.text(), true).unwrap());
        }
    }
    let d = Divergence::TopK {
        k: 100,
        beta: 0.5,
        add_tail: false,
    };
    let mut total = 0.0;
    for c in &r.completions {
        let v = divergences(
            &model,
            &r.prompt_ids[c.prompt_index],
            &teacher_ids[c.prompt_index],
            &c.token_ids,
            d,
        );
        let kept: Vec<f64> = v.into_iter().skip(skip).collect();
        if !kept.is_empty() {
            total += kept.iter().sum::<f64>() / kept.len() as f64;
        }
    }
    let want = total / r.completions.len() as f64;
    let m = learner.process(&sc).unwrap();
    assert!(
        (m["loss"] - want).abs() < 2e-5 * want.abs().max(1e-3),
        "loss {} vs {want}",
        m["loss"]
    );
    assert!(m["grad_norm"] > 0.0 && m.contains_key("sdft/distillation_loss"));
}

#[test]
fn the_first_step_is_the_top_k_self_distillation_of_the_privileged_prompt() {
    first_step_matches("", 0, false);
    first_step_matches("num_loss_tokens_to_skip = 1", 1, false);
}

#[test]
fn generate_from_teacher_samples_after_the_teachers_prompt() {
    first_step_matches("generate_from_teacher = true", 0, true);
}

#[test]
fn the_ema_teacher_resumes_exactly() {
    let f = fixture();
    let extra = "teacher_model_kind = \"ema\"\nteacher_update_rate = 0.5";
    let all = run(load(&f.root, "all", 4, extra), RunOptions::default());
    let cfg = load(&f.root, "parts", 4, extra);
    let joined = stopped_and_resumed(2, |o| run(cfg.clone(), o));
    assert_same_steps(
        &joined,
        &all.metrics,
        &["loss", "grad_norm", "self_distillation/distillation_loss"],
    );
    // The eval split reports the loss and the self-distillation term, no updates: a run with
    // an eval every 2 steps trains as one without.
    let mut cfg = load(&f.root, "eval", 4, extra);
    cfg.data.eval_fraction = Some(0.34);
    cfg.train.eval_steps = 2;
    let with_eval = run(cfg, RunOptions::default());
    let evals = eval_lines(&f.root.join("eval"));
    assert_eq!(evals.len(), 2);
    for e in &evals {
        let (l, d) = (
            e["eval/loss"].as_f64().unwrap(),
            e["eval/self_distillation/distillation_loss"]
                .as_f64()
                .unwrap(),
        );
        assert!(l > 0.0 && d > 0.0, "{e}");
    }
    assert!(with_eval.metrics[0]["loss"].is_finite());
    // The base teacher (the default) gives other steps after the first.
    let base = run(load(&f.root, "base", 4, ""), RunOptions::default());
    assert!((base.metrics[0]["loss"] - all.metrics[0]["loss"]).abs() < 1e-9);
    assert!((base.metrics[3]["loss"] - all.metrics[3]["loss"]).abs() > 1e-9);
}

#[test]
fn trls_defaults_the_refusals_a_missing_context_and_the_subcommand() {
    let f = fixture();
    let text = config_text(&f.root, "d", 1, "").replace("learning_rate = 5e-3\n", "");
    let p = f.root.join("d.toml");
    std::fs::write(&p, &text).unwrap();
    let c = config::load(&p, &[]).unwrap();
    assert_eq!(c.learning_rate(), 5e-5);
    assert!(c.dropout_disabled());
    let d = &c.sdft;
    assert_eq!(d.distillation_mode, config::SdpoMode::TopkLogits);
    assert_eq!(
        (
            d.distillation_topk,
            d.distillation_alpha,
            d.distillation_is_clip
        ),
        (Some(100), 0.5, 2.0)
    );
    assert_eq!(d.teacher_model_kind, config::SdpoTeacher::Base);
    assert_eq!(
        d.teacher_prompt_template,
        "{prompt}\n\n{privileged_context}"
    );
    assert!(!d.generate_from_teacher && d.num_loss_tokens_to_skip == 0);
    assert!(c.rewards.is_empty(), "SDFT needs no reward");
    for (set, want) in [
        (
            "sdft.teacher_prompt_template=\"{prompt}\"",
            "must contain both",
        ),
        (
            "sdft.teacher_prompt_template=\"{prompt}{ctx}\"",
            "unknown field `{ctx}`",
        ),
        (
            "sdft.distillation_mode=\"sampled_token\"",
            "is the reverse KL only",
        ),
        ("sdft.distillation_topk=0", "`sdft.distillation_topk` >= 1"),
        (
            "sdft.teacher_update_rate=1.5",
            "`sdft.teacher_update_rate` must be in (0, 1]",
        ),
        ("reference.beta=0.1", "SDFT's loss has no KL term"),
    ] {
        let e = format!("{:#}", config::load(&p, &[set.to_string()]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{set}: {e}");
    }
    // One completion per prompt is allowed (no groups to compare).
    let sets = [
        "rollout.num_generations=1",
        "train.per_device_train_batch_size=2",
    ];
    config::load(&p, &sets.map(String::from)).unwrap();
    // A row without its privileged context is named.
    let rows = "{\"prompt\": \"a\", \"privileged_context\": \"b\"}\n{\"prompt\": \"c\"}\n";
    std::fs::write(f.root.join("holes.jsonl"), rows).unwrap();
    let mut cfg = config::load(&p, &[]).unwrap();
    cfg.data.path = vec![f.root.join("holes.jsonl").display().to_string()];
    let s = trainer::setup(cfg).unwrap();
    let e = format!(
        "{:#}",
        trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err()
    );
    assert!(
        e.contains("row 1") && e.contains("`privileged_context`"),
        "{e}"
    );
    // The subcommand.
    std::fs::write(&p, text.replace("algorithm = \"sdft\"", "")).unwrap();
    grpo_cli_ok(&["sdft", "--config", p.to_str().unwrap()]);
    let metrics = std::fs::read_to_string(f.root.join("d/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1);
    assert!(metrics.contains("sdft/distillation_loss"), "{metrics}");
}
