//! A*-PO (TRL's experimental A2POTrainer, `algorithm = "a2po"`): stage 1 estimates each
//! prompt's optimal value from the reference's samples and leaves out the prompts whose samples
//! all scored 0; stage 2 regresses `β2 · log(π/π_ref)` onto `r − V*`. The first step (policy =
//! reference) has loss mean((r − V*)²); every step's loss is the loss of its logged implicit
//! reward and advantage; a run raises the reward; TRL's defaults; resume; the refusals; the
//! subcommand.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::Path;

use grpo_rewards::RewardInput;
use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, A2poTrainer, FitOptions, RunOptions};

use crate::common;
use common::{Fixture, assert_same_steps, grpo_cli_ok, stopped_and_resumed};

/// A tiny model and 12 prompts: "Say a digit (i)" for i < 12.
fn fixture() -> Fixture {
    let f = Fixture::new().model("model", 3);
    let rows: String = (0..12)
        .map(|i| format!("{{\"prompt\": \"Say a digit ({i}):\"}}\n"))
        .collect();
    std::fs::write(f.root.join("prompts.jsonl"), rows).unwrap();
    f
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "a2po"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
max_completion_length = 6
[optim]
learning_rate = 5e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
per_device_train_batch_size = 4
save_steps = 2
shuffle_dataset = false
[[rewards]]
type = "accuracy"
[a2po]
num_value_samples = 4
beta2 = 0.05
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
    // The reward comes in code (`digits`); a config file must name one.
    let mut cfg = config::load(&p, &[]).unwrap();
    cfg.rewards.clear();
    cfg
}

/// Share of digits in a completion; prompts 8..12 ("(8)" ... "(11)") score 0 whatever the
/// completion, so stage 1 leaves them out.
fn digits(batch: &[RewardInput]) -> Vec<f32> {
    batch
        .iter()
        .map(|x| {
            if ["(8)", "(9)", "(10)", "(11)"]
                .iter()
                .any(|p| x.prompt.contains(p))
            {
                return 0.0;
            }
            let n = x.completion.chars().count().max(1);
            x.completion.chars().filter(char::is_ascii_digit).count() as f32 / n as f32 + 0.01
        })
        .collect()
}

/// A run of `cfg` with the `digits` reward given in code.
fn fit(cfg: TrainConfig, opts: Option<RunOptions>) -> trainer::TrainingResult {
    let Some(opts) = opts else {
        let mut t = A2poTrainer::from_config(cfg).unwrap();
        return t
            .fit_with(FitOptions::default().reward("digits", 1.0, digits))
            .unwrap();
    };
    let mut s = trainer::setup(cfg).unwrap();
    std::sync::Arc::get_mut(&mut s.rewards)
        .unwrap()
        .push_reward("digits", 1.0, std::sync::Arc::new(digits));
    trainer::run(s, &opts, &mut grpo_trainer::NoCallbacks).unwrap()
}

#[test]
fn trls_defaults_and_the_refusals() {
    let f = fixture();
    let text = config_text(&f.root, "d", 1, "")
        .replace("learning_rate = 5e-3\n", "")
        .replace("num_value_samples = 4\nbeta2 = 0.05\n", "");
    std::fs::write(f.root.join("d.toml"), text).unwrap();
    let c = config::load(&f.root.join("d.toml"), &[]).unwrap();
    assert_eq!(c.rollout.num_generations, 1);
    assert_eq!(c.learning_rate(), 5e-5);
    assert_eq!(
        (c.a2po.num_value_samples, c.a2po.beta1, c.a2po.beta2),
        (8, 0.5, 1e-3)
    );
    assert!(c.a2po.filter_all_incorrect);
    for (set, want) in [
        ("a2po.beta1=0.0", "`a2po.beta1` must be > 0"),
        (
            "a2po.num_value_samples=0",
            "`a2po.num_value_samples` must be >= 1",
        ),
        ("reference.beta=0.1", "leave `reference.beta` at 0"),
        (
            "loss.drop_zero_std_groups=true",
            "regresses every completion",
        ),
    ] {
        let p = f.root.join("bad.toml");
        std::fs::write(&p, config_text(&f.root, "bad", 1, "")).unwrap();
        let e = format!("{:#}", config::load(&p, &[set.to_string()]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{set}: {e}");
    }
}

/// Stage 1 leaves out the four prompts whose samples all scored 0 (12 → 8 rows: 2 steps an
/// epoch); the first step, at the reference, has loss mean((r − V*)²) and implicit reward 0;
/// each later step (one completion a micro-batch of one) has loss (implicit − advantage)².
#[test]
fn stage_one_filters_and_the_loss_regresses_onto_the_optimal_advantage() {
    let f = fixture();
    let mut cfg = load(&f.root, "run", 4, "");
    cfg.train.max_steps = None;
    cfg.train.num_train_epochs = 2.0;
    let r = fit(cfg, None);
    assert_eq!(r.total_steps, 4, "8 prompts left, 4 a step, 2 epochs");
    let m0 = &r.metrics[0];
    assert!(m0["implicit_reward"].abs() < 1e-9, "{m0:?}");
    assert!(m0["v_star"] > 0.0);
    let logged = std::fs::read_to_string(f.root.join("run/completions.jsonl")).unwrap();
    assert!(
        !logged.contains("(8)") && !logged.contains("(11)"),
        "filtered prompts trained"
    );
    // One completion per micro-batch: the loss is the squared error of the logged means.
    let mut cfg = load(&f.root, "one", 4, "");
    (
        cfg.train.prompts_per_step,
        cfg.train.per_device_train_batch_size,
    ) = (1, Some(1));
    let r = fit(cfg, None);
    for (s, m) in r.metrics.iter().enumerate() {
        let want = (m["implicit_reward"] - m["advantage"]).powi(2);
        assert!(
            (m["loss"] - want).abs() < 1e-6 * want.max(1.0),
            "step {s}: {} vs {want} ({m:?})",
            m["loss"]
        );
    }
    assert!(
        r.metrics[3]["implicit_reward"].abs() > 0.0,
        "the policy moved"
    );
}

#[test]
fn a2po_raises_the_reward_and_resumes_exactly() {
    let f = fixture();
    let mut cfg = load(&f.root, "learn", 30, "");
    cfg.train.save_steps = 0;
    cfg.train.shuffle_dataset = Some(true);
    let r = fit(cfg, None);
    let mean = |ms: &[grpo_trainer::Metrics]| {
        ms.iter().map(|m| m["reward"]).sum::<f64>() / ms.len() as f64
    };
    let (first, last) = (mean(&r.metrics[..8]), mean(&r.metrics[22..]));
    eprintln!("reward {first} -> {last}");
    assert!(last > first + 0.05, "reward {first} -> {last}");

    let all = fit(load(&f.root, "all", 4, ""), None);
    let cfg = load(&f.root, "parts", 4, "");
    let joined = stopped_and_resumed(2, |o| fit(cfg.clone(), Some(o)));
    assert_eq!(joined.len(), 4);
    assert_same_steps(
        &joined,
        &all.metrics,
        &["loss", "v_star", "implicit_reward"],
    );
}

/// With the accuracy reward a random model answers nothing right: every prompt would be left
/// out, which is refused in one line; the subcommand runs without the filter.
#[test]
fn every_prompt_filtered_is_refused_and_the_subcommand_runs() {
    let f = fixture();
    // An answer no 6-token sample of a random model writes.
    let rows: String = (0..4)
        .map(|i| format!("{{\"prompt\": \"What is {i} + 1?\", \"answer\": \"-98765.4321\"}}\n"))
        .collect();
    std::fs::write(f.root.join("arith.jsonl"), rows).unwrap();
    let text = config_text(&f.root, "acc", 2, "").replace("prompts.jsonl", "arith.jsonl");
    let p = f.root.join("acc.toml");
    std::fs::write(&p, text).unwrap();
    let s = trainer::setup(config::load(&p, &[]).unwrap()).unwrap();
    let e = format!(
        "{:#}",
        trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap_err()
    );
    assert!(
        e.contains("every training prompt") && e.contains("filter_all_incorrect"),
        "{e}"
    );
    let text = std::fs::read_to_string(&p)
        .unwrap()
        .replace("algorithm = \"a2po\"", "")
        .replace("[a2po]", "[a2po]\nfilter_all_incorrect = false");
    std::fs::write(&p, text).unwrap();
    grpo_cli_ok(&["a2po", "--config", p.to_str().unwrap()]);
    let metrics = std::fs::read_to_string(f.root.join("acc/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 2);
    assert!(metrics.contains("v_star"), "{metrics}");
}
