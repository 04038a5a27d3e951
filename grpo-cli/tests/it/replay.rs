//! `loss.replay_buffer_size` (TRL's GRPOWithReplayBufferTrainer): the buffer's rules, the
//! step the loss trains on, and runs that replay, resume exactly and refuse what has no place.

use grpo_core::advantages::{ScaleRewards, group_advantages};
use grpo_data::rng::SeededRng;
use grpo_rollout::{Completion, FinishReason};
use grpo_trainer::stages::replay::{REPLAY_FILE, ReplayBuffer, ReplayGroup};
use grpo_trainer::{self as trainer, RunOptions};

use crate::common::first_scored_step;
use crate::train::{assert_same, base_config, fixture, run, stopped_and_resumed};

fn group(score: f64, step: usize) -> ReplayGroup {
    ReplayGroup {
        score,
        step,
        row: step as u64,
        prompt_ids: vec![1, 2, step as u32],
        completions: (0..2)
            .map(|j| Completion {
                prompt_index: 0,
                sample_index: j,
                token_ids: vec![7, 8 + j as u32],
                text: format!("{step}/{j}"),
                logprobs: vec![-0.5, -1.0],
                finish_reason: FinishReason::Stop,
                top_logprobs: Vec::new(),
            })
            .collect(),
        model_masks: None,
        advantages: vec![0.7, -0.7],
    }
}

fn scores(b: &ReplayBuffer) -> Vec<f64> {
    b.groups().iter().map(|g| g.score).collect()
}

#[test]
fn the_buffer_keeps_the_best_groups_as_trls_heap() {
    let mut b = ReplayBuffer::new(3);
    for (i, s) in [0.5, 0.3, 0.8].into_iter().enumerate() {
        b.add(group(s, i));
    }
    assert_eq!(scores(&b), [0.5, 0.3, 0.8]);
    // Not above the lowest (0.3): left out; above it: the lowest leaves.
    b.add(group(0.3, 3));
    b.add(group(0.1, 4));
    assert_eq!(scores(&b), [0.5, 0.3, 0.8]);
    b.add(group(0.9, 5));
    assert_eq!(scores(&b), [0.5, 0.8, 0.9]);
    // Of equal lowest scores the oldest leaves.
    let mut b = ReplayBuffer::new(2);
    b.add(group(0.4, 0));
    b.add(group(0.4, 1));
    b.add(group(0.6, 2));
    let steps: Vec<usize> = b.groups().iter().map(|g| g.step).collect();
    assert_eq!(steps, [1, 2]);
    // Size 0 keeps nothing; a non-finite score is not kept.
    let mut b = ReplayBuffer::new(0);
    b.add(group(1.0, 0));
    assert!(b.groups().is_empty());
    let mut b = ReplayBuffer::new(2);
    b.add(group(f64::NAN, 0));
    assert!(b.groups().is_empty());
}

#[test]
fn draws_are_proportional_to_score_and_without_replacement() {
    let mut b = ReplayBuffer::new(4);
    b.add(group(1.0, 0));
    b.add(group(3.0, 1));
    // One draw: P(step 1) = 3 / 4 (4,000 draws: σ ≈ 0.007).
    let n = 4000;
    let hits = (0..n)
        .filter(|&i| b.sample(1, &mut SeededRng::new(i))[0].step == 1)
        .count();
    let p = hits as f64 / n as f64;
    assert!((p - 0.75).abs() < 0.03, "P(step 1) = {p}");
    // As many draws as groups: each once (torch.multinomial without replacement); the first
    // is still ∝ score.
    let mut first_is_1 = 0;
    for i in 0..n {
        let d = b.sample(2, &mut SeededRng::new(i));
        let mut steps: Vec<usize> = d.iter().map(|g| g.step).collect();
        first_is_1 += usize::from(steps[0] == 1);
        steps.sort();
        assert_eq!(steps, [0, 1]);
    }
    let p = first_is_1 as f64 / n as f64;
    assert!((p - 0.75).abs() < 0.03, "P(first = step 1) = {p}");
    // More draws than groups: with replacement, ∝ score.
    let d = b.sample(4000, &mut SeededRng::new(7));
    let p = d.iter().filter(|g| g.step == 1).count() as f64 / 4000.0;
    assert!((p - 0.75).abs() < 0.03, "with replacement: {p}");
    // The same stream draws the same groups; an empty buffer draws none.
    let a: Vec<usize> = b
        .sample(2, &mut SeededRng::new(3))
        .iter()
        .map(|g| g.step)
        .collect();
    let c: Vec<usize> = b
        .sample(2, &mut SeededRng::new(3))
        .iter()
        .map(|g| g.step)
        .collect();
    assert_eq!(a, c);
    assert!(
        ReplayBuffer::new(4)
            .sample(3, &mut SeededRng::new(0))
            .is_empty()
    );
}

#[test]
fn the_buffer_round_trips_through_its_file() {
    let f = crate::common::Fixture::new();
    let mut b = ReplayBuffer::new(3);
    for (i, s) in [0.2, 0.9, 0.5].into_iter().enumerate() {
        b.add(group(s, i));
    }
    b.save(&f.root).unwrap();
    assert_eq!(ReplayBuffer::load(&f.root, 2, 3).unwrap(), b);
    // A smaller size keeps the best.
    assert_eq!(
        scores(&ReplayBuffer::load(&f.root, 2, 2).unwrap()),
        [0.9, 0.5]
    );
    // Groups of another size, or a broken file: one line naming the file.
    let e = format!("{:#}", ReplayBuffer::load(&f.root, 4, 3).unwrap_err());
    assert!(
        e.contains(REPLAY_FILE) && e.contains("num_generations is 4"),
        "{e}"
    );
    std::fs::write(f.root.join(REPLAY_FILE), "{").unwrap();
    let e = format!("{:#}", ReplayBuffer::load(&f.root, 2, 3).unwrap_err());
    assert!(
        e.contains(REPLAY_FILE) && e.contains("not a replay buffer"),
        "{e}"
    );
}

/// The first step of a run with `extra`, its rewards set to `rewards` (one group varying, one
/// flat) and its group advantages recomputed.
fn forced_step(
    f: &crate::common::Fixture,
    out: &str,
    rewards: &[f32],
) -> (grpo_trainer::Learner, grpo_trainer::stages::Scored) {
    let mut cfg = base_config(&f.root, out, "");
    cfg.loss.replay_buffer_size = 4;
    // The first step updates (no warm-up from 0).
    cfg.optim.warmup_steps = 0;
    let s = trainer::setup(cfg).unwrap();
    let (learner, mut sc) = first_scored_step(&s, &f.root.join(out));
    assert_eq!(sc.rollouts.completions.len(), rewards.len());
    sc.scores.rewards = rewards.to_vec();
    sc.scores.per_function = vec![rewards.iter().map(|&r| Some(r)).collect()];
    sc.advantages = group_advantages(rewards, 4, ScaleRewards::Group);
    (learner, sc)
}

fn weights(l: &grpo_trainer::Learner) -> Vec<(String, Vec<f32>)> {
    l.policy()
        .model
        .weights()
        .into_iter()
        .map(|(k, t)| (k, t.flatten_all().unwrap().to_vec1::<f32>().unwrap()))
        .collect()
}

#[test]
fn a_flat_group_trains_on_a_kept_one_and_metrics_describe_the_fresh_step() {
    let f = fixture();
    let rewards = [1.0, 0.0, 0.0, 1.0, 0.5, 0.5, 0.5, 0.5];
    let (mut with_replay, mut sc) = forced_step(&f, "a", &rewards);
    let mut buffer = ReplayBuffer::new(4);
    let rep = buffer.replay(&sc, 4, 11).unwrap();
    // Group 0 varies: kept, with TRL's score Σ|A| × std (std = 0.5774, |A| = 0.866 each).
    let kept = &rep.buffer.groups()[0];
    let std = (1.0f64 / 3.0).sqrt();
    let want = std * 4.0 * (0.5 / (std + 1e-4));
    assert!((kept.score - want).abs() < 1e-4, "{} vs {want}", kept.score);
    assert_eq!(kept.completions, sc.rollouts.completions[..4]);
    // Group 1 is flat: replaced by the only kept group, from this very step (as TRL adds
    // before it draws).
    assert_eq!(rep.replaced, [(1, 0)]);
    let t = rep.trained.as_deref().unwrap();
    assert!(t.rollouts.sampled_by_other_model && !sc.rollouts.sampled_by_other_model);
    let p1 = t.rollouts.completions[4].prompt_index;
    assert_eq!(t.rollouts.prompt_ids[p1], sc.rollouts.prompt_ids[0]);
    for j in 0..4 {
        let (a, b) = (&t.rollouts.completions[4 + j], &sc.rollouts.completions[j]);
        assert_eq!((&a.token_ids, &a.logprobs), (&b.token_ids, &b.logprobs));
        assert_eq!(a.prompt_index, p1);
        assert_eq!(t.advantages[4 + j], sc.advantages[j]);
    }
    assert_eq!(t.rollouts.completions[..4], sc.rollouts.completions[..4]);
    let metrics = ReplayBuffer::metrics(0, &rep);
    assert_eq!(
        metrics,
        [
            ("replay/replaced_groups".to_string(), 1.0),
            ("replay/buffer_groups".to_string(), 1.0),
            ("replay/mean_age".to_string(), 0.0),
        ]
    );

    // The learner trains on the trained view: the same update as that view alone...
    let trained = t.clone();
    sc.scores.metrics.extend(metrics);
    sc.replay = Some(rep);
    let m = with_replay.process(&sc).unwrap();
    let (mut alone, _) = forced_step(&f, "b", &rewards);
    alone.process(&trained).unwrap();
    assert!(weights(&with_replay) == weights(&alone));
    // ... not the fresh step's.
    let (mut fresh, sc_fresh) = forced_step(&f, "c", &rewards);
    fresh.process(&sc_fresh).unwrap();
    assert!(weights(&with_replay) != weights(&fresh));
    // Its metrics describe the step as generated (TRL's): one flat group of two.
    assert_eq!(m["frac_reward_zero_std"], 0.5);
    assert_eq!(m["replay/replaced_groups"], 1.0);
    assert_eq!(
        with_replay.replay_buffer.as_ref().unwrap().groups().len(),
        1
    );

    // Every group flat and nothing kept: nothing replaced, no trained view.
    let mut empty = ReplayBuffer::new(4);
    let rep = empty.replay(&sc_fresh_flat(&sc_fresh), 4, 11).unwrap();
    assert!(rep.trained.is_none() && rep.replaced.is_empty());
    assert!(rep.buffer.groups().is_empty());
}

fn sc_fresh_flat(sc: &grpo_trainer::stages::Scored) -> grpo_trainer::stages::Scored {
    let mut s = sc.clone();
    s.scores.rewards = vec![0.25; s.scores.rewards.len()];
    s.advantages = vec![0.0; s.advantages.len()];
    s
}

#[test]
fn a_run_replays_groups_and_resumes_exactly() {
    let f = fixture();
    let extra = "[loss]\nreplay_buffer_size = 3\n";
    let mut straight_cfg = base_config(&f.root, "straight", extra);
    straight_cfg.train.max_steps = Some(6);
    let straight = run(straight_cfg, RunOptions::default());
    let replaced: f64 = straight
        .metrics
        .iter()
        .map(|m| m["replay/replaced_groups"])
        .sum();
    assert!(replaced > 0.0, "no group was replayed");
    assert!(
        straight
            .metrics
            .iter()
            .all(|m| m["replay/buffer_groups"] <= 3.0)
    );
    assert!(
        straight
            .metrics
            .iter()
            .any(|m| m.contains_key("replay/mean_age")),
        "mean_age is logged when a group is replayed"
    );
    let ckpts: Vec<_> = std::fs::read_dir(f.root.join("straight/checkpoints"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    assert!(!ckpts.is_empty());
    for c in &ckpts {
        assert!(c.join(REPLAY_FILE).exists(), "{}", c.display());
    }

    let mut cfg = base_config(&f.root, "killed", extra);
    cfg.train.max_steps = Some(6);
    assert_same(&straight.metrics, &stopped_and_resumed(cfg.clone(), 3));

    // A broken buffer file: the resume fails naming it.
    let mut cfg2 = base_config(&f.root, "broken", extra);
    cfg2.train.max_steps = Some(6);
    run(
        cfg2.clone(),
        RunOptions {
            stop_after: Some(2),
            ..Default::default()
        },
    );
    std::fs::write(
        f.root.join("broken/checkpoints/step-2").join(REPLAY_FILE),
        "[",
    )
    .unwrap();
    let setup = trainer::setup(cfg2).unwrap();
    let e = trainer::run(
        setup,
        &RunOptions {
            resume: Some(None),
            ..Default::default()
        },
        &mut grpo_trainer::NoCallbacks,
    )
    .unwrap_err();
    let e = format!("{e:#}");
    assert!(e.contains(REPLAY_FILE), "{e}");
}

#[test]
fn replay_outside_grpo_is_refused_in_one_line() {
    let f = crate::common::Fixture::new();
    let mut cfg = base_config(&f.root, "r", "[loss]\nreplay_buffer_size = 2\n");
    cfg.validate().unwrap();
    cfg.algorithm = grpo_trainer::config::Algorithm::Rloo;
    let e = cfg.validate().unwrap_err();
    assert!(
        e.contains("loss.replay_buffer_size") && e.contains("rloo") && !e.contains('\n'),
        "{e}"
    );
}

#[test]
fn the_pipeline_replays_as_the_sequential_loop_and_with_staleness_reproducibly() {
    let f = fixture();
    let extra = "[loss]\nreplay_buffer_size = 3\n";
    let seq = run(
        base_config(&f.root, "seq", extra),
        RunOptions {
            mode: grpo_trainer::RunMode::Sequential,
            ..Default::default()
        },
    );
    let piped = run(base_config(&f.root, "piped", extra), RunOptions::default());
    assert_same(&seq.metrics, &piped.metrics);
    // A step with replayed groups is corrected as off-policy: its importance-sampling
    // metrics are logged; a step without is on-policy and has none.
    for m in &seq.metrics {
        assert_eq!(
            m["replay/replaced_groups"] > 0.0,
            m.contains_key("sampling/importance_sampling_ratio/mean"),
            "{m:?}"
        );
    }
    assert!(
        seq.metrics
            .iter()
            .any(|m| m["replay/replaced_groups"] > 0.0)
    );
    // With a generator a version behind, the buffer travels with each step: two runs agree.
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
    assert!(a.metrics.iter().any(|m| m["replay/replaced_groups"] > 0.0));
}
