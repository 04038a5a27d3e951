//! `algorithm = "ssd"` (TRL's experimental SSDTrainer): the policy learns its own samples by
//! cross-entropy at temperature 1, stubs filtered; TRL's defaults, the refusals, resume and the
//! subcommand.

use std::path::Path;

use grpo_trainer::config::{self, TrainConfig};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common::{Fixture, assert_same_steps, first_scored_step, grpo_cli_ok, token_logps};

fn fixture() -> Fixture {
    Fixture::new().model("model", 4).arithmetic(24)
}

fn config_text(root: &Path, out: &str, steps: usize, extra: &str) -> String {
    format!(
        r#"
algorithm = "ssd"
output_dir = "{out}"
[model]
path = "{model}"
[data]
path = ["{data}"]
[rollout]
num_generations = 2
max_completion_length = 6
temperature = 0.7
[optim]
learning_rate = 1e-3
lr_scheduler_type = "constant"
[train]
max_steps = {steps}
prompts_per_step = 4
save_steps = 1
{extra}
"#,
        out = root.join(out).display(),
        model = root.join("model").display(),
        data = root.join("arith.jsonl").display(),
    )
}

fn load(root: &Path, out: &str, steps: usize, extra: &str) -> TrainConfig {
    let p = root.join(format!("{out}.toml"));
    std::fs::write(&p, config_text(root, out, steps, extra)).unwrap();
    config::load(&p, &[]).unwrap()
}

/// `−log p` of each completion token under `model` at temperature 1, one completion alone.
fn nll(model: &grpo_rollout::Transformer, prompt: &[u32], completion: &[u32]) -> Vec<f64> {
    token_logps(model, prompt, completion, 1.0)
        .into_iter()
        .map(|l| -l)
        .collect()
}

/// The first step's loss against TRL's: each micro-batch's mean token NLL over its kept
/// samples (0 when none), averaged over the update's micro-batches.
fn first_step_matches(micro: usize) {
    let f = fixture();
    let extra = format!("per_device_train_batch_size = {micro}");
    let s = trainer::setup(load(&f.root, "first", 1, &extra)).unwrap();
    let (mut learner, mut sc) = first_scored_step(&s, &f.root.join("first"));
    let n = sc.rollouts.completions.len();
    assert_eq!(n, 8);
    // Samples 1 and 6 are stubs (filtered); the others long enough to keep.
    for (i, c) in sc.rollouts.completions.iter_mut().enumerate() {
        c.text = match i {
            1 => "  ".into(),
            6 => "x = 1".into(),
            _ => "a long enough sample".into(),
        };
    }
    let model = s.policy.model.snapshot().unwrap();
    let mut chunk_means = Vec::new();
    for a in (0..n).step_by(micro) {
        let (mut sum, mut tokens) = (0.0, 0usize);
        for i in a..(a + micro).min(n) {
            if i == 1 || i == 6 {
                continue;
            }
            let c = &sc.rollouts.completions[i];
            let p = &sc.rollouts.prompt_ids[c.prompt_index];
            sum += nll(&model, p, &c.token_ids).iter().sum::<f64>();
            tokens += c.token_ids.len();
        }
        chunk_means.push(sum / tokens.max(1) as f64);
    }
    let want = chunk_means.iter().sum::<f64>() / chunk_means.len() as f64;
    let m = learner.process(&sc).unwrap();
    assert!(
        (m["loss"] - want).abs() < 1e-5 * want,
        "micro {micro}: loss {} vs {want}",
        m["loss"]
    );
    assert!((m["ssd/cross_entropy_loss"] - want).abs() < 1e-5 * want);
    assert_eq!(m["ssd/active_sample_ratio"], 6.0 / 8.0);
    // TRL's lengths after the filter: the two stubs count 0 tokens.
    let kept: Vec<f64> = (0..n)
        .map(|i| match i {
            1 | 6 => 0.0,
            _ => sc.rollouts.completions[i].token_ids.len() as f64,
        })
        .collect();
    assert_eq!(m["completions/min_length"], 0.0);
    assert_eq!(
        m["completions/max_length"],
        kept.iter().copied().fold(0.0, f64::max)
    );
    assert!((m["completions/mean_length"] - kept.iter().sum::<f64>() / 8.0).abs() < 1e-12);
    // The update lowers the samples' cross-entropy.
    let after = learner.policy().model.detached();
    let (mut before_sum, mut after_sum) = (0.0, 0.0);
    for (i, c) in sc.rollouts.completions.iter().enumerate() {
        if i == 1 || i == 6 {
            continue;
        }
        let p = &sc.rollouts.prompt_ids[c.prompt_index];
        before_sum += nll(&model, p, &c.token_ids).iter().sum::<f64>();
        after_sum += nll(&after, p, &c.token_ids).iter().sum::<f64>();
    }
    assert!(after_sum < before_sum, "{before_sum} -> {after_sum}");
}

#[test]
fn the_first_step_is_the_cross_entropy_of_the_kept_samples() {
    first_step_matches(8);
    first_step_matches(2);
}

#[test]
fn two_steps_resumed_equal_four() {
    let f = fixture();
    let straight = {
        let s = trainer::setup(load(&f.root, "straight", 4, "")).unwrap();
        trainer::run(s, &RunOptions::default(), &mut grpo_trainer::NoCallbacks).unwrap()
    };
    let cfg = load(&f.root, "killed", 4, "");
    let resumed = crate::common::stopped_and_resumed(2, |opts| {
        let s = trainer::setup(cfg.clone()).unwrap();
        trainer::run(s, &opts, &mut grpo_trainer::NoCallbacks).unwrap()
    });
    assert_eq!((straight.metrics.len(), resumed.len()), (4, 4));
    assert_same_steps(
        &straight.metrics,
        &resumed,
        &[
            "loss",
            "ssd/cross_entropy_loss",
            "grad_norm",
            "completions/mean_length",
        ],
    );
    assert!(straight.metrics.iter().all(|m| m["loss"].is_finite()));
}

#[test]
fn trls_defaults_the_refusals_and_the_subcommand() {
    let f = fixture();
    let text = config_text(&f.root, "d", 1, "")
        .replace("learning_rate = 1e-3\n", "")
        .replace("num_generations = 2\n", "");
    let p = f.root.join("d.toml");
    std::fs::write(&p, &text).unwrap();
    let c = config::load(&p, &[]).unwrap();
    assert_eq!(c.learning_rate(), 5e-5);
    assert!(c.dropout_disabled());
    assert_eq!(
        c.rollout.num_generations, 1,
        "SSD samples one completion per prompt"
    );
    assert!(c.ssd.filter_empty);
    assert!(c.rewards.is_empty(), "SSD needs no reward");
    for (set, want) in [
        ("reference.beta=0.1", "no KL term"),
        ("loss.drop_zero_std_groups=true", "SSD learns every sample"),
        ("loss.replay_buffer_size=4", "loss.replay_buffer_size"),
        ("ssd.filter=true", "filter_empty"),
    ] {
        let e = format!("{:#}", config::load(&p, &[set.to_string()]).unwrap_err());
        assert!(e.contains(want) && !e.trim().contains('\n'), "{set}: {e}");
    }
    // The subcommand.
    std::fs::write(&p, text.replace("algorithm = \"ssd\"", "")).unwrap();
    grpo_cli_ok(&["ssd", "--config", p.to_str().unwrap()]);
    let metrics = std::fs::read_to_string(f.root.join("d/metrics.jsonl")).unwrap();
    assert_eq!(metrics.lines().count(), 1);
    assert!(
        metrics.contains("ssd/cross_entropy_loss") && metrics.contains("ssd/active_sample_ratio"),
        "{metrics}"
    );
}
