//! `[loss.filter_groups]`, DAPO's dynamic sampling (verl's `algorithm.filter_groups`): which
//! groups are kept, how a step is assembled from several generation batches, and runs that
//! draw more batches, agree with the sequential loop, resume exactly and refuse what has no
//! place.

use std::sync::Arc;

use candle_core::{DType, Device};
use grpo_data::{Position, Prompt, Sample};
use grpo_rewards::ScoredBatch;
use grpo_rollout::init::{Preset, preset_config, random_weights};
use grpo_rollout::{Arch, Completion, FinishReason};
use grpo_trainer::RunOptions;
use grpo_trainer::config::{Algorithm, FilterGroupsSection};
use grpo_trainer::stages::filter::{GroupFilter, kept_groups, metric_values};
use grpo_trainer::stages::{PromptBatch, Rollouts};

use crate::train::{assert_same, base_config, fixture, run, stopped_and_resumed};

#[test]
fn a_group_is_kept_when_its_values_differ() {
    let nan = f64::NAN;
    let v = [1.0, 1.0, 0.0, 1.0, nan, nan, 0.5, nan, 0.25, 0.75];
    // Groups of 2: equal, differing, unscored, one value and one unscored, differing.
    assert_eq!(kept_groups(&v, 2), [false, true, false, false, true]);
    // Groups of one completion are kept (verl keeps them), whatever their value.
    assert_eq!(kept_groups(&[0.0, 0.0, nan], 1), [true, true, true]);
    // Values equal but for rounding are not the same value: kept (the mean is not asked).
    assert_eq!(kept_groups(&[0.1, 0.1 + 1e-12], 2), [true]);
    assert_eq!(kept_groups(&[0.1, 0.1, 0.1], 3), [false]);
}

fn scores(rewards: &[f32], acc: &[Option<f64>]) -> ScoredBatch {
    ScoredBatch {
        names: vec!["correct".into(), "length".into()],
        per_function: vec![
            rewards.iter().map(|&r| Some(r)).collect(),
            rewards.iter().map(|_| Some(0.5)).collect(),
        ],
        info: vec![
            acc.iter()
                .map(|a| a.map(|a| serde_json::json!({ "acc": a, "pred": "7" })))
                .collect(),
            vec![None; rewards.len()],
        ],
        rewards: rewards.iter().map(|&r| r + 0.5).collect(),
        metrics: [
            ("rewards/correct/mean".to_string(), 99.0),
            ("judge/failures".to_string(), 1.0),
        ]
        .into(),
    }
}

#[test]
fn the_metric_is_the_reward_a_reward_or_a_logged_value() {
    let s = scores(&[1.0, 0.0], &[Some(1.0), None]);
    assert_eq!(metric_values(&s, "reward").unwrap(), [1.5, 0.5]);
    assert_eq!(metric_values(&s, "length").unwrap(), [0.5, 0.5]);
    let acc = metric_values(&s, "acc").unwrap();
    assert_eq!(acc[0], 1.0);
    assert!(acc[1].is_nan());
    // A name nothing gives: one line naming it and what there is.
    let e = metric_values(&s, "accuracy").unwrap_err().to_string();
    assert!(
        e.contains("`accuracy`") && e.contains("correct, length") && !e.contains('\n'),
        "{e}"
    );
}

/// Generation batch `draw` of `rewards.len() / 2` prompts (groups of 2), sampled by policy
/// version `version`; prompt `p`'s row index is `10 · draw + p`.
fn batch(
    weights: &Arc<grpo_rollout::Transformer>,
    draw: usize,
    version: usize,
    rewards: &[f32],
) -> (Rollouts, ScoredBatch) {
    let n = rewards.len() / 2;
    let samples: Vec<Sample> = (0..n)
        .map(|p| Sample {
            index: (10 * draw + p) as u64,
            prompt: Prompt::Text(format!("q{draw}.{p}")),
            columns: Vec::new(),
        })
        .collect();
    let completions: Vec<Completion> = (0..2 * n)
        .map(|i| Completion {
            prompt_index: i / 2,
            sample_index: i % 2,
            token_ids: vec![5, 6 + i as u32],
            text: format!("c{draw}.{i}"),
            logprobs: vec![-0.5, -1.0],
            finish_reason: FinishReason::Stop,
            top_logprobs: Vec::new(),
        })
        .collect();
    let r = Rollouts {
        batch: PromptBatch {
            step: draw,
            draw,
            samples,
            position: Position {
                epoch: 0,
                index: (n * (draw + 1)) as u64,
                seed: 0,
                shuffle: false,
                shuffle_window: 0,
                dataset_len: 100,
            },
        },
        prompt_texts: (0..n).map(|p| format!("q{draw}.{p}")).collect(),
        prompt_ids: (0..n).map(|p| vec![3, p as u32]).collect(),
        completions,
        version,
        weights: weights.clone(),
        seconds: 1.0,
        teaching: None,
        sampled_by_other_model: false,
        episodes: None,
        source: Default::default(),
        greedy: None,
    };
    let acc: Vec<Option<f64>> = rewards.iter().map(|&r| Some(f64::from(r))).collect();
    (r, scores(rewards, &acc))
}

#[test]
fn a_step_takes_the_first_groups_kept_over_several_batches() {
    let cfg = preset_config(Preset::Tiny, Arch::Qwen2, 64, 1, 0);
    let w = Arc::new(random_weights(&cfg, 1, DType::F32, &Device::Cpu).unwrap());
    let on = FilterGroupsSection {
        enable: true,
        ..Default::default()
    };
    // Steps of 2 groups, from step 5 on.
    let mut f = GroupFilter::new(&on, 2, 2, 5);
    // Batch 0 keeps its prompt 1; batch 1 none; batch 2 its prompts 0 and 2 (2 is surplus).
    let (r, s) = batch(&w, 0, 4, &[1.0, 1.0, 0.0, 1.0, 0.0, 0.0]);
    assert!(f.push(r, s).unwrap().is_none());
    let (r, s) = batch(&w, 1, 5, &[0.0, 0.0, 1.0, 1.0, 0.0, 0.0]);
    assert!(f.push(r, s).unwrap().is_none());
    assert_eq!(f.step(), 5);
    let (r, s) = batch(&w, 2, 5, &[1.0, 0.0, 0.0, 0.0, 0.0, 1.0]);
    let (r, s) = f.push(r, s).unwrap().expect("the step is complete");
    assert_eq!(f.step(), 6);
    let rows: Vec<u64> = r.batch.samples.iter().map(|s| s.index).collect();
    assert_eq!(rows, [1, 20]);
    assert_eq!(r.prompt_texts, ["q0.1", "q2.0"]);
    assert_eq!(r.prompt_ids, [vec![3, 1], vec![3, 0]]);
    let texts: Vec<&str> = r.completions.iter().map(|c| c.text.as_str()).collect();
    assert_eq!(texts, ["c0.2", "c0.3", "c2.0", "c2.1"]);
    let prompts: Vec<usize> = r.completions.iter().map(|c| c.prompt_index).collect();
    assert_eq!(prompts, [0, 0, 1, 1]);
    // The step is the one filled; the data position and seed index are its last batch's;
    // its version the oldest sampler's (for staleness); its seconds all batches'.
    assert_eq!((r.batch.step, r.batch.draw), (5, 2));
    assert_eq!(r.batch.position.index, 9);
    assert_eq!(r.version, 4);
    assert_eq!(r.seconds, 3.0);
    // The kept rows of every column, in order.
    assert_eq!(s.rewards, [0.5, 1.5, 1.5, 0.5]);
    assert_eq!(
        s.per_function[0],
        [Some(0.0), Some(1.0), Some(1.0), Some(0.0)]
    );
    let acc: Vec<f64> = s.info[0]
        .iter()
        .map(|v| v.as_ref().unwrap()["acc"].as_f64().unwrap())
        .collect();
    assert_eq!(acc, [0.0, 1.0, 1.0, 0.0]);
    assert_eq!(s.info[1], [None, None, None, None]);
    // Reward statistics of the step's groups; counters of all it drew; what was drawn.
    let m = &s.metrics;
    assert_eq!(m["rewards/correct/mean"], 0.5);
    assert_eq!(m["rewards/length/std"], 0.0);
    assert_eq!(m["judge/failures"], 3.0);
    assert_eq!(m["filter_groups/num_gen_batches"], 3.0);
    assert_eq!(m["filter_groups/kept_ratio"], 3.0 / 9.0);
    let drawn = (1.5 + 1.5 + 0.5 + 1.5 + 0.5 + 0.5)
        + (0.5 + 0.5 + 1.5 + 1.5 + 0.5 + 0.5)
        + (1.5 + 0.5 + 0.5 + 0.5 + 0.5 + 1.5);
    assert!((m["filter_groups/reward_drawn_mean"] - drawn / 18.0).abs() < 1e-6);
    // The next step starts afresh: one batch with both groups kept closes it.
    let (r, s) = batch(&w, 3, 6, &[1.0, 0.0, 0.0, 1.0]);
    let (r, s) = f.push(r, s).unwrap().unwrap();
    assert_eq!((r.batch.step, r.version), (6, 6));
    assert_eq!(s.metrics["filter_groups/num_gen_batches"], 1.0);
    assert_eq!(s.metrics["judge/failures"], 1.0);

    // On a logged value: `acc` differs where the reward does here.
    let by_acc = FilterGroupsSection {
        metric: "acc".into(),
        ..on.clone()
    };
    let mut f = GroupFilter::new(&by_acc, 1, 2, 0);
    let (r, s) = batch(&w, 0, 0, &[1.0, 1.0, 0.0, 1.0]);
    let (r, _) = f.push(r, s).unwrap().unwrap();
    assert_eq!(r.batch.samples[0].index, 1);

    // The limit on batches: verl's error, in one line naming the setting.
    let capped = FilterGroupsSection {
        max_num_gen_batches: 2,
        ..on
    };
    let mut f = GroupFilter::new(&capped, 2, 2, 0);
    let (r, s) = batch(&w, 0, 0, &[1.0, 1.0, 0.0, 1.0]);
    assert!(f.push(r, s).unwrap().is_none());
    let (r, s) = batch(&w, 1, 0, &[1.0, 1.0, 0.0, 0.0]);
    let e = f.push(r, s).unwrap_err().to_string();
    assert!(
        e.contains("max_num_gen_batches = 2") && e.contains("kept 1 of its 2") && !e.contains('\n'),
        "{e}"
    );
}

/// The error that ends a run of `cfg`.
fn run_error(cfg: grpo_trainer::TrainConfig) -> String {
    let setup = grpo_trainer::setup(cfg).unwrap();
    let e = grpo_trainer::run(
        setup,
        &RunOptions::default(),
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap_err();
    format!("{e:#}")
}

const FILTER: &str = "[loss.filter_groups]\nenable = true\n";

#[test]
fn a_run_draws_until_its_groups_differ_and_matches_the_sequential_loop() {
    let f = fixture();
    let seq = run(
        base_config(&f.root, "seq", FILTER),
        RunOptions {
            mode: grpo_trainer::RunMode::Sequential,
            ..Default::default()
        },
    );
    assert_eq!(seq.total_steps, 4);
    assert_eq!(seq.metrics.len(), 4);
    for m in &seq.metrics {
        // Every group trained on varies: no zero-std group, an advantage everywhere.
        assert_eq!(m["frac_reward_zero_std"], 0.0, "{m:?}");
        assert!(m["filter_groups/num_gen_batches"] >= 1.0);
        assert!(m["filter_groups/kept_ratio"] > 0.0 && m["filter_groups/kept_ratio"] <= 1.0);
    }
    let draws: f64 = seq
        .metrics
        .iter()
        .map(|m| m["filter_groups/num_gen_batches"])
        .sum();
    assert!(draws > 4.0, "no step drew a second batch: {draws}");
    let piped = run(base_config(&f.root, "piped", FILTER), RunOptions::default());
    assert_same(&seq.metrics, &piped.metrics);
    // Without the filter the same data gives flat groups.
    let plain = run(base_config(&f.root, "plain", ""), RunOptions::default());
    assert!(
        plain
            .metrics
            .iter()
            .any(|m| m["frac_reward_zero_std"] > 0.0)
    );
}

#[test]
fn a_filtered_run_resumes_exactly_and_a_stale_generator_stays_within_bounds() {
    let f = fixture();
    let extra = format!("{FILTER}gen_batch_size = 3\n");
    let mut cfg = base_config(&f.root, "straight", &extra);
    cfg.train.max_steps = Some(5);
    let straight = run(cfg, RunOptions::default());
    assert_eq!(straight.metrics.len(), 5);
    let mut cfg = base_config(&f.root, "killed", &extra);
    cfg.train.max_steps = Some(5);
    assert_same(&straight.metrics, &stopped_and_resumed(cfg, 2));
    let state: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(
            f.root
                .join("straight/checkpoints/step-4/trainer_state.json"),
        )
        .unwrap(),
    )
    .unwrap();
    let draws: f64 = straight.metrics[..4]
        .iter()
        .map(|m| m["filter_groups/num_gen_batches"])
        .sum();
    assert_eq!(state["draws"].as_f64(), Some(draws), "{state}");
    // Resumed with its steps done: it ends at once, drawing nothing.
    let mut cfg = base_config(&f.root, "straight", &extra);
    cfg.train.max_steps = Some(5);
    let again = run(
        cfg,
        RunOptions {
            resume: Some(None),
            ..Default::default()
        },
    );
    assert!(again.metrics.is_empty());
    // A generator a version behind: two runs agree, and no step learns from samples more
    // than one version old.
    let stale = format!("{extra}[pipeline]\nmax_staleness = 1\n");
    let a = run(
        base_config(&f.root, "stale_a", &stale),
        RunOptions::default(),
    );
    let b = run(
        base_config(&f.root, "stale_b", &stale),
        RunOptions::default(),
    );
    assert_same(&a.metrics, &b.metrics);
    for m in &a.metrics {
        assert!(m["staleness/max"] <= 1.0, "{m:?}");
        assert_eq!(m["frac_reward_zero_std"], 0.0);
    }
}

#[test]
fn a_step_that_cannot_fill_stops_the_run_and_bad_settings_are_refused() {
    let f = fixture();
    // A reward every completion earns alike: no group ever differs.
    let mut cfg = base_config(
        &f.root,
        "flat",
        &format!("{FILTER}max_num_gen_batches = 2\n"),
    );
    cfg.rewards.truncate(0);
    cfg.rewards.push(
        serde_json::from_value(serde_json::json!({"type": "format", "pattern": "(?s).*"})).unwrap(),
    );
    let e = run_error(cfg);
    assert!(
        e.contains("max_num_gen_batches = 2") && e.contains("step 1"),
        "{e}"
    );
    // A metric no reward gives: the run stops naming it.
    let cfg = base_config(
        &f.root,
        "unknown",
        "[loss.filter_groups]\nenable = true\nmetric = \"acc\"\n",
    );
    let e = run_error(cfg);
    assert!(
        e.contains("`acc`") && e.contains("accuracy, has_digit"),
        "{e}"
    );

    // Refused before the run, in one line each.
    let refused = |edit: &dyn Fn(&mut grpo_trainer::TrainConfig), want: &str| {
        let mut cfg = base_config(&f.root, "r", FILTER);
        edit(&mut cfg);
        let e = cfg.validate().unwrap_err();
        assert!(e.contains(want) && !e.contains('\n'), "{e}");
    };
    base_config(&f.root, "ok", FILTER).validate().unwrap();
    refused(&|c| c.algorithm = Algorithm::OnlineDpo, "online_dpo");
    refused(&|c| c.loss.replay_buffer_size = 2, "replay_buffer_size");
    refused(
        &|c| c.loss.filter_groups.metric = "seq_final_reward".into(),
        "filter on `reward`",
    );
    refused(
        &|c| c.loss.filter_groups.gen_batch_size = Some(0),
        "gen_batch_size",
    );
    let unknown = "[loss.filter_groups]\nenable = true\nmax_gen_batches = 3\n";
    let p = f.root.join("unknown_key.toml");
    std::fs::write(&p, unknown).unwrap();
    let e = format!("{:#}", grpo_trainer::config::load(&p, &[]).unwrap_err());
    assert!(e.contains("max_gen_batches"), "{e}");
}
