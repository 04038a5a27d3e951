//! The training loop in one file.
//!
//! ```text
//! loader ──PromptBatch──▶ generator ──Rollouts──▶ scorer ──Scored──▶ learner ──Event──▶ sinks
//! (stages::loader)       (stages::generator,     (stages::scorer,    (learner::*)      (events::*:
//!                          policy version v)       rewards,             loss, AdamW       metrics, logs,
//!                            ▲                     advantages)          │                 checkpoints,
//!                            └──────── new weights, version v+1 ◀───────┘                 TensorBoard)
//! ```
//!
//! [`run`] wires the stages with `crossbeam_channel::bounded` channels in `std::thread::scope`;
//! the learner runs on the calling thread, and what follows each of its steps (logs,
//! checkpoints, callbacks, evaluation) is in `step_end`. [`RunMode::Sequential`]
//! calls the same stages in a plain loop, which is how the tests check that the pipeline with
//! `max_staleness = 0` computes exactly the sequential algorithm. With `loss.filter_groups`
//! (DAPO's dynamic sampling) a step may take several generation batches: the scorer tells the
//! generator, over one more channel, which batch closed a step. An error in any stage stops
//! every stage (the channels close) and is returned naming its stage. SFT and DPO run the
//! loader and the learner only ([`crate::learner::supervised::run`]).

use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use crossbeam_channel::{Receiver, bounded};
use grpo_rollout::Transformer;
use serde::{Deserialize, Serialize};

use crate::callbacks::{Callbacks, Metrics};

use crate::events::SharedSink;
use crate::learner::Learner;
use crate::setup::Setup;
use crate::stages::{Generator, Loader, PromptBatch, Rollouts, Scored, Scorer, Stage};
use crate::step_end::StepEnd;

/// What [`run`] returns.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct TrainingResult {
    /// Every step's metrics, in order.
    pub metrics: Vec<Metrics>,
    /// The last checkpoint written (the best one is the last: GRPO has no validation loss).
    pub best_checkpoint_path: Option<PathBuf>,
    /// Steps done, counting steps of a resumed run's earlier part.
    pub total_steps: usize,
    /// Passes over the training prompts.
    pub total_epochs: f64,
    /// The run directory.
    pub run_dir: PathBuf,
    /// Whether a stop request (Ctrl-C) ended the run early.
    pub interrupted: bool,
}

/// How the stages are driven.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RunMode {
    /// Threads and bounded channels (the default).
    Pipelined,
    /// One thread, the stages called in turn: the reference semantics.
    Sequential,
}

/// Options of a run beyond the config.
#[derive(Clone)]
pub struct RunOptions {
    /// Resume from this checkpoint directory, or the latest in the run directory when `Some(None)`.
    pub resume: Option<Option<PathBuf>>,
    /// Threads or a plain loop.
    pub mode: RunMode,
    /// Set to stop after the current step (a checkpoint is written).
    pub stop: Arc<AtomicBool>,
    /// Stop (with a checkpoint) after this many steps of this invocation: used by tests to
    /// simulate a kill.
    pub stop_after: Option<usize>,
    /// More event sinks beside the run's own (the command line's progress display).
    pub sinks: Vec<SharedSink>,
}

impl std::fmt::Debug for RunOptions {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RunOptions")
            .field("resume", &self.resume)
            .field("mode", &self.mode)
            .field("stop_after", &self.stop_after)
            .field("sinks", &self.sinks.len())
            .finish_non_exhaustive()
    }
}

impl Default for RunOptions {
    fn default() -> Self {
        Self {
            resume: None,
            mode: RunMode::Pipelined,
            stop: Arc::new(AtomicBool::new(false)),
            stop_after: None,
            sinks: Vec::new(),
        }
    }
}

/// What an environment run cannot have: a reward named `env`.
fn check_environment(setup: &Setup, name: &str) -> Result<()> {
    if setup
        .rewards
        .names()
        .contains(&crate::stages::scorer::ENV_REWARD)
    {
        bail!(
            "environment `{name}`: a reward is named `env`, the name of the environment's reward; rename it"
        );
    }
    Ok(())
}

/// Trains per `setup`, writing the run directory; returns the metrics of every step.
pub fn run(
    mut setup: Setup,
    opts: &RunOptions,
    callbacks: &mut dyn Callbacks,
) -> Result<TrainingResult> {
    if setup.train.is_empty() {
        bail!(
            "no training data: set `data.path`, or pass a dataset to fit (an `[environment] type = \"factory\"` class owns the data with `train.max_steps` set)"
        );
    }
    if !setup.cfg.algorithm.generates() {
        return crate::learner::supervised::run(setup, opts, callbacks);
    }
    if let Some(env) = setup.environment.take() {
        check_environment(&setup, env.name())?;
        // A hanging environment ends the run (with a checkpoint) instead of stalling it.
        let limit = std::time::Duration::from_secs_f64(setup.cfg.environment.step_timeout);
        setup.environment = Some(Arc::new(grpo_rollout::env::TimeLimited::new(env, limit)));
    }
    let needs_reward = setup.cfg.algorithm.learns_from_rewards();
    if needs_reward && setup.rewards.is_empty() && setup.environment.is_none() {
        bail!(
            "no reward: add [[rewards]] to the config, or a reward function to the trainer (with_reward, or fit with FitOptions::reward)"
        );
    }
    if setup.cfg.algorithm == crate::config::Algorithm::A2po {
        crate::learner::a2po::stage_one(&mut setup).context(Stage::Generator)?;
    }
    let (mut learner, run_dir) = crate::run_dir::open_run(&setup, opts)?;
    let start = learner.state.step;
    // DAPO's dynamic sampling (`loss.filter_groups`): a step draws generation batches until
    // it has its groups, so batches are counted apart from steps.
    let filtering = setup.cfg.loss.filter_groups.enable;
    let first_draw = match filtering {
        true => learner.state.draws.unwrap_or(start),
        false => start,
    };
    let mut loader = Loader::new(&setup, first_draw, learner.state.position)?;
    let mut generator = Generator::new(&setup, learner.publish()?, start);
    let mut scorer = Scorer::new(&setup).with_filter(&setup, start);
    if let Some(buffer) = learner.replay_buffer.clone() {
        scorer = scorer.with_replay(buffer);
    }
    let mut ends = StepEnd::begin(&setup.cfg, opts, callbacks, &learner, &run_dir)?;
    // After each step: logs, callbacks, evaluation, checkpoint; true = stop here.
    let after = |ends: &mut StepEnd<'_>, learner: &mut Learner, s: &Scored, m, secs| {
        let completions =
            crate::events::completion_lines(s, setup.cfg.train.num_completions_to_print);
        let tokens = s
            .rollouts
            .completions
            .iter()
            .map(|c| c.token_ids.len())
            .sum();
        ends.step_end(
            learner,
            m,
            completions,
            Some(tokens),
            secs,
            |l: &mut Learner| {
                let ev = setup.eval.as_ref()?;
                Some(crate::eval::evaluate(&setup, l, ev))
            },
        )
        .context(Stage::Learner)
    };
    let outcome: Result<()> = match opts.mode {
        // A resumed run with its steps done.
        _ if start >= setup.total_steps => Ok(()),
        RunMode::Sequential => (|| {
            let mut t0 = Instant::now();
            while let Some(batch) = loader.process().context(Stage::Data)? {
                let rollouts = generator.process(batch).context(Stage::Generator)?;
                let Some(scored) = scorer.process_batch(rollouts).context(Stage::Scorer)? else {
                    continue;
                };
                ends.step_begin(&learner);
                let m = learner.process(&scored).context(Stage::Learner)?;
                let w = learner.publish().context(Stage::Learner)?;
                generator.publish(w, learner.state.step);
                let secs = t0.elapsed().as_secs_f64();
                t0 = Instant::now();
                if after(&mut ends, &mut learner, &scored, m, secs)?
                    || learner.state.step >= setup.total_steps
                {
                    break;
                }
            }
            Ok(())
        })(),
        RunMode::Pipelined => {
            let p = &setup.cfg.pipeline;
            let (data_tx, data_rx) = bounded::<PromptBatch>(p.data_capacity);
            let (roll_tx, roll_rx) = bounded::<Rollouts>(p.rollout_capacity);
            let (scored_tx, scored_rx) = bounded::<Scored>(p.scored_capacity);
            // With `loss.filter_groups`: whether each scored batch closed a step.
            let (closed_tx, closed_rx) = match filtering {
                true => {
                    let (tx, rx) = crossbeam_channel::unbounded::<bool>();
                    (Some(tx), Some(rx))
                }
                false => (None, None),
            };
            // Every version goes to the generator in order (it takes version step − k for the
            // batch of `step`, so runs are reproducible); k + 1 slots keep the learner from
            // waiting on a generator that is ahead.
            let (weights_tx, weights_rx) =
                bounded::<(Arc<Transformer>, usize)>(p.max_staleness + 1);
            let halt = AtomicBool::new(false);
            let (staleness, scoring_batches) = (p.max_staleness, p.scoring_batches);
            let total = setup.total_steps;
            std::thread::scope(|scope| {
                let halt = &halt;
                let loader_h = scope.spawn(move || -> Result<()> {
                    while !halt.load(Ordering::SeqCst) {
                        let Some(b) = loader.process().context(Stage::Data)? else {
                            break;
                        };
                        if data_tx.send(b).is_err() {
                            break;
                        }
                    }
                    Ok(())
                });
                let gen_h = scope.spawn(move || -> Result<()> {
                    // With `loss.filter_groups` a batch's step is known once it is scored: the
                    // scorer tells each batch's outcome, and a batch is generated only when
                    // the latest step it could feed (each batch in flight closing one) is
                    // within `staleness` versions.
                    let mut drawn = Drawn {
                        closed: start,
                        in_flight: 0,
                    };
                    for batch in data_rx.iter() {
                        // On-policy within `staleness` versions: wait for the learner's weights.
                        loop {
                            let feeds = match &closed_rx {
                                None => batch.step,
                                Some(rx) => {
                                    rx.try_iter().for_each(|c| drawn.heard(c));
                                    drawn.closed + drawn.in_flight
                                }
                            };
                            if feeds <= generator.version() + staleness {
                                break;
                            }
                            let next = match &closed_rx {
                                None => weights_rx.recv().ok(),
                                Some(rx) => crossbeam_channel::select! {
                                    recv(weights_rx) -> w => w.ok(),
                                    recv(rx) -> c => {
                                        let Ok(c) = c else {
                                            return Ok(());
                                        };
                                        drawn.heard(c);
                                        continue;
                                    }
                                },
                            };
                            let Some((w, v)) = next else {
                                return Ok(());
                            };
                            generator.publish(w, v);
                        }
                        if halt.load(Ordering::SeqCst) {
                            break;
                        }
                        let r = generator.process(batch).context(Stage::Generator)?;
                        if roll_tx.send(r).is_err() {
                            break;
                        }
                        drawn.in_flight += 1;
                    }
                    Ok(())
                });
                let scorer_h = scope.spawn(move || -> Result<()> {
                    scorer
                        .run_stage(&roll_rx, &scored_tx, scoring_batches, closed_tx.as_ref())
                        .context(Stage::Scorer)
                });
                // The learner, on this thread.
                let mut learn = |scored_rx: Receiver<Scored>| -> Result<()> {
                    let mut t_last = Instant::now();
                    for scored in scored_rx.iter() {
                        ends.step_begin(&learner);
                        let m = learner.process(&scored).context(Stage::Learner)?;
                        let v = learner.state.step;
                        if v < total {
                            // The generator may have stopped (error): ignore a closed channel.
                            let _ = weights_tx.send((learner.publish()?, v));
                        }
                        let secs = t_last.elapsed().as_secs_f64();
                        t_last = Instant::now();
                        if after(&mut ends, &mut learner, &scored, m, secs)? || v >= total {
                            return Ok(());
                        }
                    }
                    Ok(())
                };
                let learned = learn(scored_rx);
                halt.store(true, Ordering::SeqCst);
                drop(weights_tx);
                first_error(
                    learned,
                    [
                        (loader_h.join(), Stage::Data),
                        (gen_h.join(), Stage::Generator),
                        (scorer_h.join(), Stage::Scorer),
                    ],
                )
            })
        }
    };
    match outcome {
        Ok(()) => ends.finish(&learner),
        Err(e) => Err(ends.fail(&mut learner, e)),
    }
}

/// What the generator knows of its batches under `loss.filter_groups`: the steps they closed
/// (from the run's first) and those sent but not yet scored.
struct Drawn {
    closed: usize,
    in_flight: usize,
}

impl Drawn {
    /// The scorer's word on the oldest batch in flight: whether it closed a step.
    fn heard(&mut self, closed_a_step: bool) {
        self.in_flight -= 1;
        self.closed += usize::from(closed_a_step);
    }
}

/// The learner's error, else the first stage's (a panic named by its stage).
fn first_error<const N: usize>(
    learned: Result<()>,
    joined: [(std::thread::Result<Result<()>>, Stage); N],
) -> Result<()> {
    let mut first = learned.err();
    for (j, stage) in joined {
        let e = match j {
            Ok(r) => r.err(),
            Err(_) => Some(anyhow!("panicked").context(stage)),
        };
        if first.is_none() {
            first = e;
        }
    }
    first.map_or(Ok(()), Err)
}
