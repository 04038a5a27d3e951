//! PPO's step (TRL's experimental `PPOTrainer`): a value model (the critic, a sequence
//! classifier read at every position) is trained beside the policy.
//!
//! Before the update, with no graph: each completion's log-probs under the policy that
//! sampled it and under the reference (both at `rollout.temperature`), the critic's estimate
//! of every state, and its score (the rewards, less `missing_eos_penalty` without EOS; an
//! unscored completion counts 0). grpo-core's [`ppo_targets`] turns them into per-token
//! rewards, GAE advantages and returns. Then `num_ppo_epochs` passes over the batch, each
//! shuffled and cut into `num_mini_batches` mini-batches, one optimizer update each (policy and
//! critic clipped together, as TRL's one optimizer over both): the clipped policy loss plus
//! `vf_coef ×` the clipped value loss per micro-batch.

use std::collections::HashMap;
use std::time::Instant;

use anyhow::{Context, Result, anyhow, bail};
use candle_core::{DType, Tensor};
use grpo_core::ppo::{PpoLossInputs, PpoParams, PpoRollout, PpoTargets, ppo_loss, ppo_targets};
use grpo_rollout::{TrainableModel, Transformer};

use super::Learner;
use super::batch::StepBatch;
use super::metrics::OffPolicyStats;
use crate::callbacks::Metrics;
use crate::optim::{AdamW, clip_grad_norm};
use crate::stages::Scored;

/// A checkpoint's value model (a Hugging Face sequence-classifier directory).
pub const VALUE_DIR: &str = "value_model";
/// A checkpoint's value model's AdamW state.
pub(crate) const VALUE_OPT_FILE: &str = "value_optimizer.safetensors";
/// The critic's gradients' prefix when they are clipped with the policy's.
const PREFIX: &str = "value_model.";

/// PPO's value model and its optimizer (the policy's settings).
pub struct Critic {
    pub(crate) model: TrainableModel,
    pub(crate) opt: AdamW,
}

impl std::fmt::Debug for Critic {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Critic")
            .field("vars", &self.model.vars.len())
            .finish_non_exhaustive()
    }
}

impl Critic {
    /// Restores the value model's weights and AdamW state from checkpoint `dir`.
    pub(crate) fn restore(&mut self, dir: &std::path::Path) -> Result<()> {
        let d = dir.join(VALUE_DIR);
        let m = &self.model.model;
        let weights = grpo_rollout::loader::read_model_weights(&d, &m.cfg, m.dtype(), m.device())
            .with_context(|| format!("{}: cannot read PPO's value model", d.display()))?;
        crate::checkpoint::set_vars(&self.model.vars, &weights.into_iter().collect(), &d)?;
        self.opt.load(&dir.join(VALUE_OPT_FILE))
    }

    /// The critic's estimates `(b, width)` of the states of completions `rows` (indices into
    /// `batch`): before each token, and after the last; positions past a row's last state hold
    /// its last (masked out by the caller). With the graph.
    fn values(
        &self,
        batch: &StepBatch<'_>,
        rows: &[usize],
        width: usize,
        pad: u32,
    ) -> Result<Tensor> {
        let seqs: Vec<Vec<u32>> = rows
            .iter()
            .map(|&i| [batch.prompts[i], batch.completions[i]].concat())
            .collect();
        let refs: Vec<&[u32]> = seqs.iter().map(Vec::as_slice).collect();
        let all = self.model.model.position_scores(&refs, pad)?;
        let t = all.dim(1)?;
        let mut at = Vec::with_capacity(rows.len() * width);
        for (k, &i) in rows.iter().enumerate() {
            let p = batch.prompts[i].len();
            if p == 0 {
                bail!(
                    "PPO: completion {i} has an empty prompt (the value model reads the state before its first token)"
                );
            }
            let last = p + batch.completions[i].len() - 1;
            at.extend((0..width).map(|j| (k * t + (p - 1 + j).min(last)) as u32));
        }
        let at = Tensor::from_vec(at, rows.len() * width, all.device())?;
        Ok(all
            .flatten_all()?
            .index_select(&at, 0)?
            .reshape((rows.len(), width))?)
    }
}

impl Learner {
    /// PPO's critic (a PPO learner always has one).
    fn critic(&self) -> Result<&Critic> {
        self.critic.as_ref().context("PPO needs its value model")
    }

    /// The critic from the setup's value model, with an optimizer like the policy's.
    pub(crate) fn critic_of(setup: &crate::setup::Setup) -> Result<Option<Critic>> {
        let Some(model) = setup.value_model.clone() else {
            return Ok(None);
        };
        let opt = super::new_optimizer(&setup.cfg, model.vars.clone())?;
        Ok(Some(Critic { model, opt }))
    }

    /// One PPO step over the scored completions `s` (see the module's documentation). TRL's
    /// metrics: `objective/kl`, `objective/entropy`, `objective/non_score_reward`,
    /// `objective/rlhf_reward`, `objective/scores`, `policy/approxkl_avg`,
    /// `policy/clipfrac_avg`, `loss/policy_avg`, `loss/value_avg`, `val/clipfrac_avg`,
    /// `policy/entropy_avg`, `val/ratio`, `val/ratio_var`, `val/num_eos_tokens`, beside the
    /// step's completion and reward metrics.
    pub(crate) fn ppo_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let (batch, reference) = self.single_turn_batch(s, "PPO")?;
        let step = s.rollouts.batch.step;
        let c = self.cfg.ppo.clone();
        let pad = self.tokenizer.pad_token_id;
        let n = batch.completions.len();
        let has_eos = super::online_dpo::contains_eos(&batch, &self.tokenizer.eos_token_ids);
        let scores: Vec<f32> = (0..n)
            .map(|i| {
                let r = s.scores.rewards.get(i).copied().unwrap_or(f32::NAN);
                let r = if r.is_nan() { 0.0 } else { r };
                match (has_eos[i], c.missing_eos_penalty) {
                    (false, Some(p)) => r - p as f32,
                    _ => r,
                }
            })
            .collect();
        // The rollout's log-probs and values, no graph.
        let frozen = self.policy.model.detached();
        let (mut old, mut refs, mut values) = (Vec::new(), Vec::new(), Vec::new());
        let critic = self.critic()?;
        for &(a, b) in &batch.chunks {
            let (p, cc) = (&batch.prompts[a..b], &batch.completions[a..b]);
            for (model, out) in [(&frozen, &mut old), (&reference, &mut refs)] {
                let lp = self.logps(model, p, cc, false)?.0.detach();
                out.extend(rows_of(&lp, &batch.lens[a..b], 0)?);
            }
            let rows: Vec<usize> = (a..b).collect();
            let w = batch.lens[a..b].iter().max().copied().unwrap_or(0) + 1;
            let v = critic.values(&batch, &rows, w, pad)?.detach();
            values.extend(rows_of(&v, &batch.lens[a..b], 1)?);
        }
        drop(frozen);
        let params = PpoParams {
            kl_coef: c.kl_coef,
            kl_estimator: c.kl_estimator,
            whiten_rewards: c.whiten_rewards,
            gamma: c.gamma,
            lam: c.lam,
        };
        let targets = ppo_targets(
            &PpoRollout {
                logprobs: &old,
                ref_logprobs: &refs,
                values: &values,
                scores: &scores,
            },
            &params,
        )
        .map_err(|e| anyhow!("step {}: {e}", step + 1))?;
        let width = targets.width;
        let old_t = padded(&old, width, &self.device)?;

        let lr = self.schedule.lr_at(step);
        let micro = self.cfg.micro_batch();
        let mini = n / c.num_mini_batches;
        let mut stats: HashMap<&str, Vec<f64>> = HashMap::new();
        let (mut grad_norm, mut loss_sum, mut updates) = (0.0, 0.0, 0.0);
        for epoch in 0..c.num_ppo_epochs {
            let seed = crate::stages::step_seed(self.cfg.train.seed, step as u64) ^ epoch as u64;
            let mut order: Vec<usize> = (0..n).collect();
            grpo_data::rng::SeededRng::new(seed).shuffle(&mut order);
            for mb in order.chunks(mini.max(1)) {
                let parts = mb.chunks(micro.max(1)).count() as f64;
                let (mut pacc, mut vacc) = (HashMap::new(), HashMap::new());
                let mut losses = Vec::new();
                for rows in mb.chunks(micro.max(1)) {
                    let out = self.ppo_part(&batch, rows, &targets, &old_t)?;
                    let loss = (out.0.loss.clone() / parts)?;
                    losses.push(loss.detach().to_dtype(DType::F64)?);
                    let critic = self.critic()?;
                    let grads = Transformer::backward_through(
                        &loss,
                        &[&self.policy.model, &critic.model.model],
                    )?;
                    drop(loss);
                    self.opt.accumulate(&mut pacc, &grads)?;
                    critic.opt.accumulate(&mut vacc, &grads)?;
                    drop(grads);
                    let l = &out.0;
                    for (k, v) in [
                        ("policy/approxkl_avg", l.approxkl),
                        ("policy/clipfrac_avg", l.pg_clipfrac),
                        ("loss/policy_avg", l.pg_loss),
                        ("loss/value_avg", l.vf_loss),
                        ("val/clipfrac_avg", l.vf_clipfrac),
                        ("val/ratio", l.ratio_mean),
                        ("policy/entropy_avg", out.1),
                    ] {
                        stats.entry(k).or_default().push(v);
                    }
                }
                let total = Tensor::stack(&losses, 0)?.sum_all()?.to_scalar::<f64>()?;
                if !total.is_finite() {
                    bail!("non-finite loss ({total}) at step {}", step + 1);
                }
                loss_sum += total;
                updates += 1.0;
                grad_norm = self.ppo_update(pacc, vacc, lr, step)?;
            }
        }
        self.state.step = step + 1;
        let mut m = Metrics::new();
        m.insert("loss".into(), loss_sum / f64::max(updates, 1.0));
        let mean = |v: &[f64]| v.iter().sum::<f64>() / v.len().max(1) as f64;
        for (k, v) in &stats {
            m.insert((*k).to_string(), mean(v));
        }
        if let Some(r) = stats.get("val/ratio") {
            let mu = mean(r);
            let var = r.iter().map(|x| (x - mu).powi(2)).sum::<f64>() / (r.len().max(2) - 1) as f64;
            m.insert("val/ratio_var".into(), var);
        }
        self.ppo_batch_metrics(&targets, &old, &scores, &batch, &mut m);
        self.end_step(
            s,
            &batch,
            &OffPolicyStats::default(),
            (grad_norm, lr),
            t0,
            &mut m,
        );
        Ok(m)
    }

    /// One micro-batch's PPO loss (with the policy's and the critic's graphs) over completions
    /// `rows`, and its tokens' mean entropy.
    fn ppo_part(
        &self,
        batch: &StepBatch<'_>,
        rows: &[usize],
        t: &PpoTargets,
        old: &Tensor,
    ) -> Result<(grpo_core::ppo::PpoLoss, f64)> {
        let width = t.width;
        let dev = &self.device;
        let prompts: Vec<&[u32]> = rows.iter().map(|&i| batch.prompts[i]).collect();
        let completions: Vec<&[u32]> = rows.iter().map(|&i| batch.completions[i]).collect();
        let (lp, ent, w) = self.logps(&self.policy.model, &prompts, &completions, true)?;
        let lp = lp.pad_with_zeros(1, 0, width - w)?;
        let v = self
            .critic()?
            .values(batch, rows, width, self.tokenizer.pad_token_id)?;
        let idx = Tensor::from_vec(
            rows.iter().map(|&i| i as u32).collect::<Vec<_>>(),
            rows.len(),
            dev,
        )?;
        let pick = |flat: &[f32]| -> Result<Tensor> {
            let all = Tensor::from_slice(flat, (flat.len() / width, width), dev)?;
            Ok(all.index_select(&idx, 0)?)
        };
        let mask = |f: &dyn Fn(usize, usize) -> bool| -> Result<Tensor> {
            let m: Vec<f32> = rows
                .iter()
                .flat_map(|&i| (0..width).map(move |j| (i, j)))
                .map(|(i, j)| f32::from(u8::from(f(i, j))))
                .collect();
            Ok(Tensor::from_vec(m, (rows.len(), width), dev)?)
        };
        let tm = mask(&|i, j| t.is_token(i, j))?;
        let vm = mask(&|i, j| t.has_value(i, j))?;
        let out = ppo_loss(
            &PpoLossInputs {
                logprobs: &lp,
                old_logprobs: &old.index_select(&idx, 0)?,
                advantages: &pick(&t.advantages)?,
                token_mask: &tm,
                values: &v,
                old_values: &pick(&t.values)?,
                returns: &pick(&t.returns)?,
                value_mask: &vm,
            },
            self.cfg.ppo.cliprange,
            self.cfg.ppo.cliprange_value,
            self.cfg.ppo.vf_coef,
        )?;
        let entropy = match ent {
            Some(e) => {
                let e = e
                    .detach()
                    .to_dtype(DType::F32)?
                    .pad_with_zeros(1, 0, width - w)?;
                let count = tm.sum_all()?.to_scalar::<f32>()?.max(1.0);
                ((e * &tm)?.sum_all()?.to_scalar::<f32>()? / count) as f64
            }
            None => 0.0,
        };
        Ok((out, entropy))
    }

    /// One optimizer update of the policy and the critic: their gradients clipped together to
    /// `optim.max_grad_norm`, then each AdamW at `lr`. Returns the joint norm before clipping.
    fn ppo_update(
        &mut self,
        policy: HashMap<String, Tensor>,
        critic: HashMap<String, Tensor>,
        lr: f64,
        step: usize,
    ) -> Result<f64> {
        let mut all = policy;
        all.extend(critic.into_iter().map(|(k, g)| (format!("{PREFIX}{k}"), g)));
        let norm = clip_grad_norm(&mut all, self.cfg.optim.max_grad_norm)?;
        if !norm.is_finite() {
            bail!("non-finite gradient norm at step {}", step + 1);
        }
        let (critic, policy): (HashMap<_, _>, HashMap<_, _>) =
            all.into_iter().partition(|(k, _)| k.starts_with(PREFIX));
        let critic: HashMap<String, Tensor> = critic
            .into_iter()
            .map(|(k, g)| (k[PREFIX.len()..].to_string(), g))
            .collect();
        self.updating = true;
        self.critic
            .as_mut()
            .context("PPO needs its value model")?
            .opt
            .step(&critic, lr)?;
        self.apply_update(&policy, lr)?;
        Ok(norm)
    }

    /// TRL's per-batch metrics of the rollout: the KL to the reference and the sampled
    /// tokens' negative log-probs summed per completion, the penalty, the scores, EOS tokens.
    fn ppo_batch_metrics(
        &self,
        t: &PpoTargets,
        old: &[Vec<f32>],
        scores: &[f32],
        batch: &StepBatch<'_>,
        m: &mut Metrics,
    ) {
        let n = old.len().max(1) as f64;
        let kl =
            t.kl.chunks(t.width)
                .map(|r| r.iter().map(|&x| x as f64).sum::<f64>())
                .sum::<f64>()
                / n;
        let entropy = old
            .iter()
            .map(|r| -r.iter().map(|&x| x as f64).sum::<f64>())
            .sum::<f64>()
            / n;
        let score = scores.iter().map(|&x| x as f64).sum::<f64>() / n;
        let non_score = -self.cfg.ppo.kl_coef * kl;
        m.insert("objective/kl".into(), kl);
        m.insert("objective/entropy".into(), entropy);
        m.insert("objective/non_score_reward".into(), non_score);
        m.insert("objective/rlhf_reward".into(), non_score + score);
        m.insert("objective/scores".into(), score);
        let eos = &self.tokenizer.eos_token_ids;
        let count = batch
            .completions
            .iter()
            .map(|c| c.iter().filter(|x| eos.contains(x)).count())
            .sum::<usize>();
        m.insert("val/num_eos_tokens".into(), count as f64);
    }
}

/// The first `lens[i] + extra` entries of each row of `(b, w)` (f32 on the host).
fn rows_of(t: &Tensor, lens: &[usize], extra: usize) -> Result<Vec<Vec<f32>>> {
    let all: Vec<Vec<f32>> = t.to_dtype(DType::F32)?.to_vec2()?;
    Ok(all
        .into_iter()
        .zip(lens)
        .map(|(mut r, &l)| {
            r.truncate(l + extra);
            r
        })
        .collect())
}

/// Rows of different lengths as one `(N, width)` tensor, zero-padded.
fn padded(rows: &[Vec<f32>], width: usize, dev: &candle_core::Device) -> Result<Tensor> {
    let mut flat = Vec::with_capacity(rows.len() * width);
    for r in rows {
        flat.extend(r.iter().copied().take(width));
        flat.extend(std::iter::repeat_n(0.0, width - r.len().min(width)));
    }
    Ok(Tensor::from_vec(flat, (rows.len(), width), dev)?)
}
