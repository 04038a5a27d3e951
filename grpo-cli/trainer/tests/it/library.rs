//! The trainer as a library: a config built in code, `fit_with` a dataset and a reward
//! closure, callbacks in order, TensorBoard event files, algorithms by name.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};

use grpo_data::synth::ArithmeticConfig;
use grpo_rewards::RewardInput;
use grpo_rollout::Arch;
use grpo_rollout::init::{Preset, init_model_dir};
use grpo_trainer::events::tfevents::read_scalars;
use grpo_trainer::{
    Callbacks, FitOptions, GrpoTrainer, Metrics, TrainConfig, TrainerState, TrainingResult,
};

fn model(root: &Path) -> PathBuf {
    let dir = root.join("model");
    init_model_dir(&dir, Preset::Tiny, Arch::Qwen2, 3).unwrap();
    dir
}

/// A GRPO config built in code: no data files, no rewards (both come through `fit_with`).
fn config(root: &Path, out: &str) -> TrainConfig {
    let mut c = TrainConfig {
        output_dir: root.join(out),
        ..Default::default()
    };
    c.rollout.num_generations = 4;
    c.rollout.max_completion_length = 5;
    c.train.prompts_per_step = 2;
    c.train.per_device_train_batch_size = Some(4);
    c.train.save_steps = 0;
    c.optim.learning_rate = Some(1e-3);
    c
}

fn arithmetic(n: u64) -> grpo_data::Dataset {
    ArithmeticConfig {
        n,
        seed: 7,
        digits: 1,
        steps: 1,
    }
    .dataset()
    .unwrap()
}

/// Share of digits in a completion.
fn digits(batch: &[RewardInput]) -> Vec<f32> {
    batch
        .iter()
        .map(|x| {
            let n = x.completion.chars().count().max(1);
            x.completion.chars().filter(char::is_ascii_digit).count() as f32 / n as f32
        })
        .collect()
}

#[derive(Clone, Default)]
struct Recorder(Arc<Mutex<Vec<String>>>);

impl Recorder {
    fn push(&self, s: String) {
        self.0.lock().unwrap().push(s);
    }
    fn take(&self) -> Vec<String> {
        std::mem::take(&mut self.0.lock().unwrap())
    }
}

impl Callbacks for Recorder {
    fn on_train_begin(&mut self, s: &TrainerState) {
        self.push(format!("train_begin {}/{}", s.step, s.max_steps));
    }
    fn on_step_begin(&mut self, s: &TrainerState) {
        self.push(format!("step_begin {}", s.step));
    }
    fn on_step_end(&mut self, s: &TrainerState, m: &Metrics) {
        assert_eq!(m["step"], s.step as f64);
        assert!(m["reward"].is_finite(), "{m:?}");
        self.push(format!("step_end {}", s.step));
    }
    fn on_evaluate(&mut self, s: &TrainerState, m: &Metrics) {
        assert!(m.contains_key("eval/reward"), "{m:?}");
        self.push(format!("evaluate {}", s.step));
    }
    fn on_epoch_end(&mut self, s: &TrainerState) {
        self.push(format!("epoch_end {} {:.1}", s.step, s.epoch));
    }
    fn on_train_end(&mut self, s: &TrainerState, r: &TrainingResult) {
        assert_eq!(r.total_steps, s.step);
        self.push(format!("train_end {}", s.step));
    }
}

#[test]
fn fit_with_a_dataset_a_reward_closure_and_callbacks_in_order() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.train.eval_steps = 2;
    let calls = Arc::new(Mutex::new(0usize));
    let counted = calls.clone();
    let reward = move |b: &[RewardInput]| {
        *counted.lock().unwrap() += b.len();
        digits(b)
    };
    let rec = Recorder::default();
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    // 4 prompts, 2 per step: an epoch every 2 steps.
    let r = t
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(4))
                .eval_dataset(arithmetic(2))
                .reward("digits", 1.0, reward)
                .max_steps(4)
                .callbacks(rec.clone()),
        )
        .unwrap();
    assert_eq!(r.total_steps, 4);
    assert_eq!(r.metrics.len(), 4);
    assert_eq!(t.current_step(), 4);
    assert!((r.total_epochs - 2.0).abs() < 1e-9, "{}", r.total_epochs);
    // Training scores 4 steps × 2 prompts × 4 completions; evaluation scores more.
    assert!(*calls.lock().unwrap() >= 32);
    for m in &r.metrics {
        assert!(m.contains_key("rewards/digits/mean"), "{m:?}");
    }
    assert_eq!(
        rec.take(),
        [
            "train_begin 0/4",
            "step_begin 0",
            "step_end 1",
            "step_begin 1",
            "step_end 2",
            "evaluate 2",
            "epoch_end 2 1.0",
            "step_begin 2",
            "step_end 3",
            "step_begin 3",
            "step_end 4",
            "evaluate 4",
            "epoch_end 4 2.0",
            "train_end 4",
        ]
    );
    // The last checkpoint was written by the events thread before fit returned.
    let ckpt = r.best_checkpoint_path.unwrap();
    assert!(ckpt.ends_with("step-4"), "{}", ckpt.display());
    assert!(ckpt.join("trainer_state.json").is_file());
    // A trainer fits once.
    let again = t.fit().unwrap_err().to_string();
    assert!(again.contains("already been fitted"), "{again}");
}

#[test]
fn max_epochs_sets_the_steps_from_the_dataset_size() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut t = GrpoTrainer::from_pretrained(&m, config(dir.path(), "run")).unwrap();
    let r = t
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(6))
                .reward("digits", 1.0, digits)
                .max_epochs(1.0),
        )
        .unwrap();
    // 6 prompts, 2 per step.
    assert_eq!(r.total_steps, 3);
}

#[test]
fn fit_refuses_a_run_without_reward_or_with_a_bad_budget() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut t = GrpoTrainer::from_pretrained(&m, config(dir.path(), "a")).unwrap();
    let e = t
        .fit_with(FitOptions::default().dataset(arithmetic(4)).max_steps(1))
        .unwrap_err()
        .to_string();
    assert!(e.contains("no reward"), "{e}");
    let mut t = GrpoTrainer::from_pretrained(&m, config(dir.path(), "b")).unwrap();
    let e = t
        .fit_with(FitOptions::default().reward("d", 1.0, digits).max_steps(0))
        .unwrap_err()
        .to_string();
    assert!(e.contains("max_steps"), "{e}");
    // A reward name taken twice.
    let t = GrpoTrainer::from_pretrained(&m, config(dir.path(), "c"))
        .unwrap()
        .with_reward("d", 1.0, digits)
        .unwrap();
    let e = t.with_reward("d", 0.5, digits).unwrap_err().to_string();
    assert!(e.contains("`d`"), "{e}");
}

#[test]
fn tensorboard_scalars_match_the_metrics() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.train.report_to = vec![grpo_trainer::config::ReportTo::Tensorboard];
    cfg.train.logging_steps = 2;
    cfg.train.eval_steps = 3;
    let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    let r = t
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(8))
                .eval_dataset(arithmetic(2))
                .reward("digits", 1.0, digits)
                .max_steps(3),
        )
        .unwrap();
    let logs = dir.path().join("run").join("runs");
    let files: Vec<PathBuf> = std::fs::read_dir(&logs)
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert_eq!(files.len(), 1, "{files:?}");
    let name = files[0].file_name().unwrap().to_string_lossy().into_owned();
    assert!(name.starts_with("events.out.tfevents."), "{name}");
    let scalars = read_scalars(&files[0]).unwrap();
    let at = |step: i64, tag: &str| -> Option<f32> {
        scalars
            .iter()
            .find(|(s, t, _)| *s == step && t == tag)
            .map(|x| x.2)
    };
    // Logged steps: 2 (logging_steps) and 3 (the last); evaluation at 3.
    for step in [2usize, 3] {
        let mt = &r.metrics[step - 1];
        for key in ["reward", "loss", "learning_rate", "rewards/digits/mean"] {
            assert_eq!(
                at(step as i64, &format!("train/{key}")),
                Some(mt[key] as f32),
                "step {step} {key}"
            );
        }
    }
    assert_eq!(at(1, "train/reward"), None, "step 1 is not logged");
    assert!(at(3, "eval/reward").is_some(), "{scalars:?}");
    assert!(!scalars.iter().any(|(_, t, _)| t == "train/step"));

    // TensorBoard itself reads the file, where a Python with it is at hand.
    let python = std::env::var("TB_PYTHON").unwrap_or_else(|_| "python3".into());
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../scripts/check_tensorboard.py");
    match std::process::Command::new(&python)
        .arg(&script)
        .arg(&logs)
        .output()
    {
        Ok(out) if out.status.code() == Some(2) => {
            eprintln!("skipped the TensorBoard reader: {python} has no tensorboard package");
        }
        Ok(out) => {
            let text = String::from_utf8_lossy(&out.stdout);
            assert!(
                out.status.success(),
                "{text}{}",
                String::from_utf8_lossy(&out.stderr)
            );
            assert!(
                text.contains("train/reward: 2 points, last step 3"),
                "{text}"
            );
        }
        Err(e) => eprintln!("skipped the TensorBoard reader: {python}: {e}"),
    }
}

#[test]
fn algorithms_by_name() {
    assert_eq!(
        grpo_trainer::list_algorithms(),
        [
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
    assert_eq!(
        grpo_trainer::get_algorithm("sft").unwrap(),
        grpo_trainer::Algorithm::Sft
    );
    let e = grpo_trainer::get_algorithm("trpo").unwrap_err().to_string();
    for name in [
        "ppo",
        "grpo",
        "sft",
        "dpo",
        "kto",
        "rloo",
        "sdft",
        "ssd",
        "sdpo",
        "orpo",
        "cpo",
        "online_dpo",
        "xpo",
        "nash_md",
        "minillm",
        "prm",
    ] {
        assert!(e.contains(name), "{e}");
    }
}

/// Fails on the event of step 2.
struct FailAt2;

impl grpo_trainer::EventSink for FailAt2 {
    fn on_event(&mut self, e: &grpo_trainer::Event) -> anyhow::Result<()> {
        match e {
            grpo_trainer::Event::Step { step: 2, .. } => anyhow::bail!("disk full (test)"),
            _ => Ok(()),
        }
    }
}

#[test]
fn a_failing_sink_stops_the_run_and_loses_no_step() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.pipeline.events_capacity = 1;
    let mut t = GrpoTrainer::from_pretrained(&m, cfg.clone()).unwrap();
    t.options.sinks.push(Arc::new(Mutex::new(FailAt2)));
    let fit = |t: &mut GrpoTrainer| {
        t.fit_with(
            FitOptions::default()
                .dataset(arithmetic(16))
                .reward("digits", 1.0, digits)
                .max_steps(6),
        )
    };
    let e = fit(&mut t).unwrap_err();
    let text = format!("{e:#}");
    assert!(text.contains("disk full (test)"), "{text}");
    // The error surfaces at one of the learner's next sends (step 2 or 3); the other sinks
    // kept going, and the learner (sound, between two steps) was saved there.
    let run = dir.path().join("run");
    let ckpts = grpo_trainer::list_checkpoints(&run);
    let k = ckpts.last().unwrap().0;
    assert!((2..=3).contains(&k), "{ckpts:?}");
    assert!(
        text.contains(&format!("checkpoint {}", ckpts.last().unwrap().1.display())),
        "{text}"
    );
    let lines = std::fs::read_to_string(run.join("metrics.jsonl")).unwrap();
    assert_eq!(lines.lines().count(), k, "{lines}");
    // The run continues from there.
    let mut again = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
    again.options.resume = Some(None);
    let r = fit(&mut again).unwrap();
    assert_eq!(r.total_steps, 6);
    assert_eq!(r.metrics.len(), 6 - k);
}

/// An asynchronous reward of the user's: 1 for completions with an even number of chars.
struct EvenLength;

impl grpo_rewards::AsyncReward for EvenLength {
    fn score_async<'a>(
        &'a self,
        batch: &'a [RewardInput],
    ) -> grpo_rewards::BoxFuture<'a, grpo_rewards::Result<grpo_rewards::RewardOutput>> {
        Box::pin(async move {
            let s: Vec<Option<f32>> = batch
                .iter()
                .map(|x| Some((x.completion.chars().count() % 2 == 0) as u8 as f32))
                .collect();
            Ok(s.into())
        })
    }
}

#[test]
fn rust_rewards_through_with_reward_score_what_the_logs_show() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "run");
    cfg.train.num_completions_to_print = 100;
    cfg.data.path = vec![];
    let steps_seen = Arc::new(Mutex::new(Vec::new()));
    let seen = steps_seen.clone();
    let digits_and_step = move |b: &[RewardInput]| -> Vec<Option<f32>> {
        seen.lock().unwrap().push(b[0].global_step);
        assert!(
            b.iter()
                .all(|x| x.completion_ids.len() == x.completion_tokens)
        );
        digits(b).into_iter().map(Some).collect()
    };
    let mut t = GrpoTrainer::from_pretrained(&m, cfg)
        .unwrap()
        .with_reward("digits", 2.0, digits_and_step)
        .unwrap()
        .with_async_reward("even", 0.5, EvenLength)
        .unwrap();
    let r = t
        .fit_with(FitOptions::default().dataset(arithmetic(4)).max_steps(2))
        .unwrap();
    assert_eq!(
        *steps_seen.lock().unwrap(),
        [0, 1],
        "trainer_state.global_step"
    );
    let lines: Vec<serde_json::Value> =
        std::fs::read_to_string(dir.path().join("run/completions.jsonl"))
            .unwrap()
            .lines()
            .map(|l| serde_json::from_str(l).unwrap())
            .collect();
    assert_eq!(lines.len(), 16);
    for l in &lines {
        let text = l["completion"].as_str().unwrap();
        let d = digits(&[RewardInput::new("", text)])[0];
        let e = (text.chars().count() % 2 == 0) as u8 as f32;
        let got = |k: &str| l["rewards"][k].as_f64().unwrap() as f32;
        assert!((got("digits") - d).abs() < 1e-6 && got("even") == e, "{l}");
        let total = l["reward"].as_f64().unwrap() as f32;
        assert!((total - (2.0 * d + 0.5 * e)).abs() < 1e-5, "{l}");
    }
    for (s, m) in r.metrics.iter().enumerate() {
        let of_step: Vec<f64> = lines
            .iter()
            .filter(|l| l["step"] == s as u64 + 1)
            .map(|l| l["rewards"]["even"].as_f64().unwrap())
            .collect();
        let mean = of_step.iter().sum::<f64>() / of_step.len() as f64;
        assert!((m["rewards/even/mean"] - mean).abs() < 1e-6, "{m:?}");
    }
}

/// `rollout.num_generations_eval` (TRL's name): evaluation samples that many completions per
/// prompt; training keeps `num_generations`.
#[test]
fn evaluation_samples_num_generations_eval_per_prompt() {
    let dir = tempfile::tempdir().unwrap();
    let m = model(dir.path());
    let mut cfg = config(dir.path(), "eval_g");
    cfg.train.eval_steps = 2;
    cfg.rollout.num_generations_eval = Some(3);
    let sizes = Arc::new(Mutex::new(Vec::new()));
    let seen = sizes.clone();
    let reward = move |b: &[RewardInput]| {
        seen.lock().unwrap().push(b.len());
        digits(b)
    };
    GrpoTrainer::from_pretrained(&m, cfg)
        .unwrap()
        .fit_with(
            FitOptions::default()
                .dataset(arithmetic(4))
                .eval_dataset(arithmetic(2))
                .reward("digits", 1.0, reward)
                .max_steps(4),
        )
        .unwrap();
    let sizes = sizes.lock().unwrap().clone();
    let g = config(dir.path(), "x").rollout.num_generations;
    // Each training step scores 2 prompts × g; each evaluation (steps 2 and 4) 2 prompts × 3.
    assert_eq!(
        sizes.iter().filter(|&&n| n == 2 * g).count(),
        4,
        "{sizes:?}"
    );
    assert_eq!(sizes.iter().filter(|&&n| n == 6).count(), 2, "{sizes:?}");
    let mut bad = config(dir.path(), "bad");
    bad.rollout.num_generations_eval = Some(0);
    let e = GrpoTrainer::from_pretrained(&m, bad)
        .unwrap_err()
        .to_string();
    assert!(e.contains("num_generations_eval"), "{e}");
}

/// Without `optim.learning_rate` each algorithm takes its TRL trainer's default, and the run's
/// resolved config records it; a value given is kept.
#[test]
fn learning_rate_defaults_follow_each_trl_trainer() {
    use grpo_trainer::Algorithm;
    for (a, want) in [
        (Algorithm::Grpo, 1e-6),
        (Algorithm::Rloo, 1e-6),
        (Algorithm::Sft, 2e-5),
        (Algorithm::Dpo, 1e-6),
        (Algorithm::Kto, 1e-6),
        (Algorithm::Reward, 1e-4),
        (Algorithm::Distillation, 1e-6),
    ] {
        let mut c = TrainConfig {
            algorithm: a,
            ..Default::default()
        };
        assert_eq!(c.learning_rate(), want, "{a}");
        c.optim.learning_rate = Some(3e-3);
        assert_eq!(c.learning_rate(), 3e-3, "{a}");
    }
}

/// An MoE policy's training loss carries TRL's load-balancing term (`router_aux_loss_coef`,
/// the model config's 0.001 by default): logged as `aux_loss`, its gradient moves the routers;
/// 0 switches it off; on a dense model a coefficient is an error.
#[test]
fn moe_policy_adds_the_load_balancing_loss() {
    let dir = tempfile::tempdir().unwrap();
    let m = dir.path().join("moe");
    init_model_dir(&m, Preset::Tiny, Arch::Qwen3Moe, 3).unwrap();
    let run = |name: &str, coef: Option<f64>| {
        let mut cfg = config(dir.path(), name);
        cfg.loss.router_aux_loss_coef = coef;
        cfg.train.save_steps = 1;
        let mut t = GrpoTrainer::from_pretrained(&m, cfg).unwrap();
        let r = t
            .fit_with(
                FitOptions::default()
                    .dataset(arithmetic(4))
                    .reward("digits", 1.0, digits)
                    .max_steps(1),
            )
            .unwrap();
        let ckpt = r.best_checkpoint_path.unwrap();
        let model = grpo_rollout::load(
            &ckpt.join("model"),
            candle_core::DType::F32,
            &candle_core::Device::Cpu,
        )
        .unwrap()
        .model;
        let router = model.layers[0].moe.as_ref().unwrap().router.weight.clone();
        (r.metrics[0].clone(), router)
    };
    let (with, r_with) = run("default", None);
    let aux = with["aux_loss"];
    // Near-uniform routing of 4 experts, 2 per token: about E · Σ (2/E)(1/E) = 2.
    assert!(aux > 1.5 && aux < 3.0, "aux_loss {aux}");
    let (off, r_off) = run("off", Some(0.0));
    assert!(!off.contains_key("aux_loss"), "{off:?}");
    let (big, r_big) = run("big", Some(50.0));
    assert!(big.contains_key("aux_loss"));
    let diff = |a: &candle_core::Tensor, b: &candle_core::Tensor| -> f32 {
        (a - b)
            .unwrap()
            .abs()
            .unwrap()
            .max_all()
            .unwrap()
            .to_scalar()
            .unwrap()
    };
    // The term moves the routers, the more the larger its weight.
    assert!(
        diff(&r_big, &r_off) > diff(&r_with, &r_off),
        "{} vs {}",
        diff(&r_big, &r_off),
        diff(&r_with, &r_off)
    );
    assert!(diff(&r_big, &r_off) > 0.0);
    // A dense model has no such loss.
    let dense = model(dir.path());
    let mut cfg = config(dir.path(), "dense");
    cfg.loss.router_aux_loss_coef = Some(0.01);
    let e = GrpoTrainer::from_pretrained(&dense, cfg)
        .and_then(|mut t| {
            t.fit_with(
                FitOptions::default()
                    .dataset(arithmetic(4))
                    .reward("digits", 1.0, digits)
                    .max_steps(1),
            )
        })
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("router_aux_loss_coef") && e.contains("not a mixture-of-experts"),
        "{e}"
    );
}
