//! The scorer stage: rewards of every completion (overlapping steps when a reward is an
//! async judge), then group advantages.

use std::sync::Arc;
use std::time::Instant;

use anyhow::{Context, Result, anyhow};
use crossbeam_channel::bounded;
use grpo_core::advantages::{
    MultiObjectiveAggregation, ScaleRewards, group_advantages, leave_one_out_normalized,
    normalize_then_sum_advantages, reward_stds,
};
use grpo_core::estimators::{
    AdvEstimator, EstimatorParams, estimate, remax_advantages, score_rows,
};
use grpo_data::Prompt;
use grpo_rewards::builtin::{LanguageScorer, ScorerError};
use grpo_rewards::{
    FieldValue, Message, RewardInput, RewardSet, ScoredBatch, combine_rewards, nan_mean, nan_std,
};
use grpo_rollout::Tokenizer;
use grpo_teacher::TeachingProtocol;

use super::filter::GroupFilter;
use super::replay::ReplayBuffer;
use super::{Rollouts, Scored};
use crate::setup::Setup;
use crate::teacher::{TeacherLog, add_student_passes};

/// ReMax's baseline of each completion: its prompt's greedy completion's reward.
pub fn greedy_baselines(r: &Rollouts) -> Result<Vec<f64>> {
    let g = r
        .greedy
        .as_ref()
        .filter(|g| g.rewards.len() == r.batch.samples.len())
        .context("loss.adv_estimator remax: the step has no scored greedy completions")?;
    Ok(r.completions
        .iter()
        .map(|c| f64::from(g.rewards[c.prompt_index]))
        .collect())
}

/// Each completion's loss tokens: its tokens, or an episode's model tokens.
pub fn loss_token_counts(r: &Rollouts) -> Vec<usize> {
    r.completions
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let n = c.token_ids.len();
            match r.episodes.as_ref().and_then(|e| e.model_masks.get(i)) {
                Some(m) => m.iter().take(n).filter(|&&x| x).count(),
                None => n,
            }
        })
        .collect()
}

/// The name of the environment's reward in a scored batch.
pub const ENV_REWARD: &str = "env";

/// Scores completions and computes advantages.
#[derive(Debug)]
pub struct Scorer {
    rewards: Arc<RewardSet>,
    scale_rewards: ScaleRewards,
    aggregation: MultiObjectiveAggregation,
    leave_one_out: bool,
    /// verl's `adv_estimator` (`grpo`: the branches above).
    estimator: AdvEstimator,
    /// REINFORCE++'s discount.
    gamma: f64,
    num_generations: usize,
    drop_zero_std: bool,
    seed: u64,
    tokenizer: Tokenizer,
    teaching: Option<Arc<TeachingProtocol>>,
    /// `teacher_log.jsonl`.
    teacher_log: Option<TeacherLog>,
    policy_scorer: Option<Arc<PolicyScorer>>,
    /// The run's environment, told when its episodes are scored.
    environment: Option<RunEnvironment>,
    /// `loss.replay_buffer_size`: the training run's replay buffer ([`super::replay`]).
    replay: Option<ReplayBuffer>,
    /// `loss.filter_groups`: the groups kept for the step being filled ([`super::filter`]),
    /// and the scoring seconds of its batches so far.
    filter: Option<(GroupFilter, f64)>,
}

/// The run's environment (Debug by its name).
#[derive(Clone)]
struct RunEnvironment(Arc<dyn grpo_rollout::Environment>);

impl std::fmt::Debug for RunEnvironment {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "environment `{}`", self.0.name())
    }
}

impl Scorer {
    /// For a run's rewards.
    pub fn new(setup: &Setup) -> Self {
        Self {
            rewards: setup.rewards.clone(),
            scale_rewards: setup.cfg.loss.scale_rewards,
            aggregation: setup.cfg.loss.multi_objective_aggregation,
            leave_one_out: setup.cfg.loss.use_leave_one_out_baseline,
            estimator: setup.cfg.loss.adv_estimator,
            gamma: setup.cfg.loss.gamma,
            num_generations: setup.cfg.rollout.num_generations,
            drop_zero_std: setup.cfg.loss.drop_zero_std_groups,
            seed: setup.cfg.train.seed,
            tokenizer: setup.tokenizer.clone(),
            teaching: setup.teaching.clone(),
            teacher_log: TeacherLog::of(&setup.cfg),
            policy_scorer: setup.policy_scorer.clone(),
            environment: setup.environment.clone().map(RunEnvironment),
            replay: None,
            filter: None,
        }
    }

    /// Keeps only groups whose rewards differ and closes a step once it has
    /// `train.prompts_per_step` of them (`loss.filter_groups`, when on; the training run's
    /// scorer), the first being step `start`.
    pub fn with_filter(mut self, setup: &Setup, start: usize) -> Self {
        let f = &setup.cfg.loss.filter_groups;
        if f.enable {
            let n = setup.cfg.train.prompts_per_step;
            self.filter = Some((GroupFilter::new(f, n, self.num_generations, start), 0.0));
        }
        self
    }

    /// With `loss.filter_groups`, a batch belongs to the step being filled when its scoring
    /// starts (what rewards see as the step).
    fn label_step(&self, r: &mut Rollouts) {
        if let Some((f, _)) = &self.filter {
            r.batch.step = f.step();
        }
    }

    /// Replays groups from `buffer` in place of groups whose rewards are all equal
    /// (`loss.replay_buffer_size`; the training run's scorer, not evaluation's).
    pub fn with_replay(mut self, buffer: ReplayBuffer) -> Self {
        self.replay = Some(buffer);
        self
    }

    /// Without the teaching log (evaluation).
    pub fn without_logs(mut self) -> Self {
        self.teacher_log = None;
        self
    }

    /// With TRL's group advantages whatever `loss.adv_estimator` (evaluation, which trains on
    /// nothing and samples no greedy baselines).
    pub fn group_advantages(mut self) -> Self {
        self.estimator = AdvEstimator::Grpo;
        self
    }

    /// Groups of `g` completions per prompt instead of `rollout.num_generations` (evaluation's
    /// `num_generations_eval`).
    pub fn with_num_generations(mut self, g: usize) -> Self {
        self.num_generations = g;
        self
    }

    /// Reward inputs of every completion. With `[teacher]` the student answers with each
    /// teaching and without (cached per problem) first, and the inputs carry both answers.
    pub fn inputs(&self, r: &Rollouts) -> Result<Vec<RewardInput>> {
        if let Some(p) = &self.policy_scorer {
            p.set(&r.weights);
        }
        let mut inputs = Self::plain_inputs(r);
        if let Some(tp) = &self.teaching {
            add_student_passes(tp, &self.tokenizer, self.seed, r, &mut inputs)?;
        }
        Ok(inputs)
    }

    fn plain_inputs(r: &Rollouts) -> Vec<RewardInput> {
        r.completions
            .iter()
            .enumerate()
            .map(|(i, c)| {
                let s = &r.batch.samples[c.prompt_index];
                // Not the end of the episode's own prompt the learner sees before it.
                let skip = r
                    .episodes
                    .as_ref()
                    .and_then(|e| e.own_prompt_tokens.get(i))
                    .map_or(0, |&k| k.min(c.token_ids.len()));
                // An episode's own prompt (after the environment's reset), as TRL's `prompts`.
                let own = r.episodes.as_ref().and_then(|e| e.prompt_messages.get(i));
                let x = row_input(r, s, r.prompt_text(i), &c.text, &c.token_ids[skip..], own);
                (i, x)
            })
            .map(|(i, x)| {
                let x = match r.episodes.as_ref().and_then(|e| e.messages.get(i)) {
                    Some(m) => x.with_completion_messages(
                        m.iter()
                            .map(|m| Message::new(m.role.clone(), m.content.clone()))
                            .collect(),
                    ),
                    None => x,
                };
                // An environment_factory instance: TRL's `environments` of Python rewards.
                let instance = r
                    .episodes
                    .as_ref()
                    .and_then(|e| e.metadata.get(i))
                    .and_then(|m| m.get(grpo_rollout::python_env::INSTANCE_KEY))
                    .and_then(|v| v.as_str());
                match instance {
                    Some(id) => x.with_environment_instance(id),
                    None => x,
                }
            })
            .collect()
    }

    /// ReMax's greedy completions' rewards (`loss.adv_estimator = "remax"`), scored with the
    /// run's rewards as the step's completions are; their metrics are not the step's.
    fn score_greedy(&self, r: &mut Rollouts) -> Result<()> {
        let Some(greedy) = r.greedy.as_ref().filter(|g| g.rewards.is_empty()) else {
            return Ok(());
        };
        let inputs: Vec<RewardInput> = greedy
            .completions
            .iter()
            .map(|c| {
                let s = &r.batch.samples[c.prompt_index];
                row_input(
                    r,
                    s,
                    &r.prompt_texts[c.prompt_index],
                    &c.text,
                    &c.token_ids,
                    None,
                )
            })
            .collect();
        let scores = self
            .rewards
            .score(&inputs)
            .map_err(|e| anyhow!("ReMax's greedy baselines: {e}"))?;
        if let Some(g) = r.greedy.as_mut() {
            g.rewards = scores.rewards;
        }
        Ok(())
    }

    /// Scores one step (a scorer without `loss.filter_groups`).
    pub fn process(&mut self, rollouts: Rollouts) -> Result<Scored> {
        self.process_batch(rollouts)?.context(
            "the scorer keeps groups for a later step (loss.filter_groups): use process_batch",
        )
    }

    /// Scores one generation batch: the step, or with `loss.filter_groups` the step once its
    /// groups are all kept (None before).
    pub fn process_batch(&mut self, mut rollouts: Rollouts) -> Result<Option<Scored>> {
        let t0 = Instant::now();
        self.label_step(&mut rollouts);
        let inputs = self.inputs(&rollouts)?;
        let scores = self.rewards.score(&inputs).map_err(|e| anyhow!("{e}"))?;
        self.finish(rollouts, &inputs, scores, t0.elapsed().as_secs_f64(), 1)
    }

    /// Whether batches can usefully overlap in scoring (some reward is an async judge, and no
    /// reward scores with the policy, whose weights change from step to step).
    pub fn overlaps(&self) -> bool {
        self.rewards.has_async() && self.policy_scorer.is_none()
    }

    /// Starts scoring a step in the background; `on_done` gets the scores.
    pub fn start(
        &self,
        inputs: Vec<RewardInput>,
        on_done: impl FnOnce(grpo_rewards::Result<ScoredBatch>) + Send + 'static,
    ) -> Result<grpo_rewards::ScoreTask> {
        self.rewards
            .spawn_score(inputs, on_done)
            .map_err(|e| anyhow!("{e}"))
    }

    /// Advantages of a scored step; with `loss.filter_groups`, of the step once the batch
    /// completes it (None before).
    pub fn finish(
        &mut self,
        mut rollouts: Rollouts,
        inputs: &[RewardInput],
        mut scores: ScoredBatch,
        mut seconds: f64,
        batches_in_flight: usize,
    ) -> Result<Option<Scored>> {
        if let Some(e) = &rollouts.episodes {
            self.add_environment_reward(&mut scores, &e.rewards)?;
            // Scored: what the episodes held (environment instances) may go.
            if let Some(RunEnvironment(env)) = &self.environment {
                env.release(&e.metadata.iter().collect::<Vec<_>>())
                    .map_err(|err| {
                        anyhow!(
                            "environment `{}`: release: {}",
                            env.name(),
                            crate::first_line(&err.to_string())
                        )
                    })?;
            }
        }
        if let Some(log) = &self.teacher_log {
            log.write(&rollouts, inputs, &scores)?;
        }
        let g = self.num_generations;
        self.score_greedy(&mut rollouts)?;
        if let Some((filter, secs)) = self.filter.as_mut() {
            *secs += seconds;
            match filter.push(rollouts, scores)? {
                Some((r, s)) => (rollouts, scores, seconds) = (r, s, std::mem::take(secs)),
                None => return Ok(None),
            }
        }
        let advantages = if self.estimator != AdvEstimator::Grpo {
            // verl's estimators on each completion's score over its loss tokens (the learner
            // forms them again when a KL penalty is in the reward or tokens differ).
            let rows = score_rows(&scores.rewards, &loss_token_counts(&rollouts));
            let params = EstimatorParams {
                gamma: self.gamma,
                scale_rewards: self.scale_rewards,
            };
            let adv = match self.estimator {
                AdvEstimator::Remax => remax_advantages(&rows, &greedy_baselines(&rollouts)?),
                // The learner weighs each token by the old policy's path variance; here (logs,
                // zero-std) the baseline with equal weights: the group's mean return.
                e if e.optimal_token() => {
                    let plain = EstimatorParams {
                        scale_rewards: ScaleRewards::None,
                        ..params
                    };
                    estimate(AdvEstimator::Grpo, &rows, g, &plain)
                }
                e => estimate(e, &rows, g, &params),
            };
            adv.map_err(|e| anyhow!("loss.adv_estimator {}: {e}", self.estimator.as_str()))?
                .iter()
                .map(|row| (row.iter().sum::<f64>() / row.len().max(1) as f64) as f32)
                .collect()
        } else if self.leave_one_out {
            let normalize = self.scale_rewards != ScaleRewards::None;
            leave_one_out_normalized(&scores.rewards, g, normalize)
        } else if self.aggregation == MultiObjectiveAggregation::NormalizeThenSum {
            normalize_then_sum_advantages(&scores.per_function, &self.weights(&scores), g)
        } else {
            group_advantages(&scores.rewards, g, self.scale_rewards)
        };
        let stds = reward_stds(&scores.rewards, g, self.scale_rewards);
        let zero_std: Vec<bool> = (0..scores.rewards.len())
            .map(|i| {
                let gi = i / g;
                let group = &scores.rewards[gi * g..(gi + 1) * g];
                let s = stds.get(i).copied().unwrap_or(f64::NAN);
                self.drop_zero_std && (s.abs() <= 1e-8 || group.iter().all(|r| r.is_nan()))
            })
            .collect();
        let mut scored = Scored {
            rollouts,
            scores,
            advantages,
            zero_std,
            seconds,
            batches_in_flight,
            replay: None,
        };
        if let Some(buffer) = self.replay.as_mut() {
            let replay = buffer.replay(&scored, g, self.seed)?;
            let step = scored.rollouts.batch.step;
            scored
                .scores
                .metrics
                .extend(ReplayBuffer::metrics(step, &replay));
            scored.replay = Some(replay);
        }
        Ok(Some(scored))
    }

    /// Adds the environment's rewards as one more function, `env` (weight 1), and combines
    /// the rewards again.
    fn add_environment_reward(&self, scores: &mut ScoredBatch, env: &[f32]) -> Result<()> {
        let n = scores.rewards.len().max(env.len());
        if scores.per_function.iter().any(|f| f.len() != env.len()) {
            return Err(anyhow!(
                "the environment's rewards cover {} completions, the reward functions' {n}",
                env.len()
            ));
        }
        let column: Vec<Option<f32>> = env.iter().map(|&r| Some(r)).collect();
        scores
            .metrics
            .insert("rewards/env/mean".into(), nan_mean(&column));
        scores
            .metrics
            .insert("rewards/env/std".into(), nan_std(&column));
        scores.names.push(ENV_REWARD.into());
        scores.per_function.push(column);
        scores.info.push(vec![None; env.len()]);
        scores.rewards = combine_rewards(&scores.per_function, &self.weights(scores));
        Ok(())
    }

    /// The weight of each reward function of `scores`: the reward set's, then 1 for the
    /// environment's.
    fn weights(&self, scores: &ScoredBatch) -> Vec<f32> {
        let mut weights = self.rewards.weights();
        weights.resize(scores.per_function.len(), 1.0);
        weights
    }

    /// The pipeline's scorer stage: scores the rollouts arriving on `input` and sends them on
    /// `output` in order. With async judges up to `max_in_flight` steps are scored at once, so
    /// the judges keep requests in flight across steps (each judge's `max_concurrent` and rate
    /// limits still bound them all); otherwise one step at a time. With `loss.filter_groups`,
    /// `closed` hears for each batch, in order, whether it closed a step. Stops when `input`
    /// closes or `output`'s receiver is gone; dropping unfinished work cancels it.
    pub fn run_stage(
        &mut self,
        input: &crossbeam_channel::Receiver<Rollouts>,
        output: &crossbeam_channel::Sender<Scored>,
        max_in_flight: usize,
        closed: Option<&crossbeam_channel::Sender<bool>>,
    ) -> Result<()> {
        // Hands a batch's outcome on; false = stop.
        let hand_on = |out: Option<Scored>| -> bool {
            if let Some(tx) = closed {
                // The generator may have stopped: a closed channel is not an error.
                let _ = tx.send(out.is_some());
            }
            match out {
                Some(s) => output.send(s).is_ok(),
                None => true,
            }
        };
        if !self.overlaps() {
            for r in input.iter() {
                if !hand_on(self.process_batch(r)?) {
                    break;
                }
            }
            return Ok(());
        }
        struct Pending {
            rollouts: Rollouts,
            inputs: Vec<RewardInput>,
            started: Instant,
            in_flight: usize,
            result: Option<grpo_rewards::Result<ScoredBatch>>,
            _task: grpo_rewards::ScoreTask,
        }
        let max_in_flight = max_in_flight.max(1);
        // Each task reports once and at most `max_in_flight` are pending: never blocks.
        let (done_tx, done_rx) = bounded::<(u64, grpo_rewards::Result<ScoredBatch>)>(max_in_flight);
        let mut pending: std::collections::VecDeque<(u64, Pending)> = Default::default();
        let mut next_id = 0u64;
        let mut open = true;
        loop {
            // Hand on the finished steps at the front, in order.
            while pending.front().is_some_and(|(_, p)| p.result.is_some()) {
                let Some((_, p)) = pending.pop_front() else {
                    break;
                };
                let scores = match p.result {
                    Some(r) => r.map_err(|e| anyhow!("{e}"))?,
                    None => continue,
                };
                let dt = p.started.elapsed().as_secs_f64();
                let scored = self.finish(p.rollouts, &p.inputs, scores, dt, p.in_flight)?;
                if !hand_on(scored) {
                    return Ok(());
                }
            }
            if !open && pending.is_empty() {
                return Ok(());
            }
            let record = |pending: &mut std::collections::VecDeque<(u64, Pending)>,
                          id: u64,
                          r: grpo_rewards::Result<ScoredBatch>| {
                if let Some((_, p)) = pending.iter_mut().find(|(i, _)| *i == id) {
                    p.result = Some(r);
                }
            };
            if open && pending.len() < max_in_flight {
                crossbeam_channel::select! {
                    recv(input) -> msg => match msg {
                        Ok(mut r) => {
                            self.label_step(&mut r);
                            let id = next_id;
                            next_id += 1;
                            let tx = done_tx.clone();
                            let started = Instant::now();
                            let inputs = self.inputs(&r)?;
                            let task = self.start(inputs.clone(), move |res| {
                                let _ = tx.send((id, res));
                            })?;
                            let n = pending.len() + 1;
                            for (_, p) in pending.iter_mut() {
                                p.in_flight = p.in_flight.max(n);
                            }
                            pending.push_back((id, Pending {
                                rollouts: r,
                                inputs,
                                started,
                                in_flight: n,
                                result: None,
                                _task: task,
                            }));
                        }
                        Err(_) => open = false,
                    },
                    recv(done_rx) -> msg => {
                        if let Ok((id, r)) = msg {
                            record(&mut pending, id, r);
                        }
                    }
                }
            } else if let Ok((id, r)) = done_rx.recv() {
                record(&mut pending, id, r);
            }
        }
    }
}

/// The reward input of one completion (`text`, `ids`) of row `s` after its prompt: the prompt
/// text, its messages (`own`: an episode's own, after the environment's reset) when the row is
/// conversational, the row's columns.
fn row_input(
    r: &Rollouts,
    s: &grpo_data::Sample,
    prompt_text: &str,
    text: &str,
    ids: &[u32],
    own: Option<&Vec<grpo_rollout::ChatMessage>>,
) -> RewardInput {
    let mut x = RewardInput::new(prompt_text, text.to_string())
        .with_ids(ids.to_vec())
        .at_step(r.batch.step);
    if let Prompt::Conversation(m) = &s.prompt {
        let messages = match own {
            Some(own) => own
                .iter()
                .map(|m| Message::new(m.role.clone(), m.content.clone()))
                .collect(),
            None => m
                .iter()
                .map(|m| Message::new(m.role.clone(), m.content.clone()))
                .collect(),
        };
        x = x.with_messages(messages);
    }
    for (k, v) in &s.columns {
        x = x.with_field(k.to_string(), to_field(v));
    }
    x
}

/// A data column's value as the rewards see it.
pub(crate) fn to_field(v: &grpo_data::Value) -> FieldValue {
    match v {
        grpo_data::Value::Null => FieldValue::Null,
        grpo_data::Value::Bool(b) => FieldValue::Bool(*b),
        grpo_data::Value::Int(i) => FieldValue::Int(*i),
        grpo_data::Value::Float(f) => FieldValue::Float(*f),
        grpo_data::Value::Str(s) => FieldValue::Str(s.clone()),
        grpo_data::Value::StrList(l) => FieldValue::StrList(l.clone()),
        grpo_data::Value::Messages(m) => FieldValue::StrList(
            m.iter()
                .map(|m| format!("{}: {}", m.role, m.content))
                .collect(),
        ),
    }
}

/// `inverse_loss` with `model = "policy"`: scores with the policy weights that sampled the
/// batch being scored (the scorer installs them before each step; steps are then scored one at
/// a time).
pub struct PolicyScorer {
    tokenizer: Tokenizer,
    current: std::sync::RwLock<Option<grpo_rollout::scoring::ModelScorer>>,
}

impl std::fmt::Debug for PolicyScorer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PolicyScorer").finish_non_exhaustive()
    }
}

impl PolicyScorer {
    /// With no weights yet.
    pub fn new(tokenizer: Tokenizer) -> Self {
        Self {
            tokenizer,
            current: std::sync::RwLock::new(None),
        }
    }

    /// Scores with `weights` from now on.
    pub fn set(&self, weights: &grpo_rollout::Transformer) {
        let scorer = grpo_rollout::scoring::ModelScorer::new(weights, self.tokenizer.clone());
        *self.current.write().unwrap_or_else(|p| p.into_inner()) = Some(scorer);
    }

    fn with<T>(
        &self,
        f: impl FnOnce(&grpo_rollout::scoring::ModelScorer) -> Result<T, ScorerError>,
    ) -> Result<T, ScorerError> {
        let guard = self.current.read().unwrap_or_else(|p| p.into_inner());
        match guard.as_ref() {
            Some(s) => f(s),
            None => Err("the policy scorer has no weights yet".into()),
        }
    }
}

impl LanguageScorer for PolicyScorer {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError> {
        self.with(|s| s.tokenize(text))
    }

    fn completion_nll(&self, prompt: &str, completion: &str) -> Result<Option<f32>, ScorerError> {
        self.with(|s| s.completion_nll(prompt, completion))
    }

    fn aligned_log_probs(&self, text: &str, targets: &[u32]) -> Result<Vec<f32>, ScorerError> {
        self.with(|s| s.aligned_log_probs(text, targets))
    }

    fn completion_nll_batch(
        &self,
        pairs: &[(&str, &str)],
    ) -> Result<Vec<Option<f32>>, ScorerError> {
        self.with(|s| s.completion_nll_batch(pairs))
    }
}
