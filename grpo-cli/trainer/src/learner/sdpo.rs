//! SDPO (TRL's experimental `SDPOTrainer`, self-distillation policy optimisation, Hübotter et
//! al.): the policy samples a group per prompt; each completion whose group holds a successful
//! sibling (combined reward ≥ `sdpo.success_reward_threshold`), or whose row carries feedback,
//! gets a **teacher context** — its prompt reprompted with that demonstration and feedback
//! ([`plan_reprompts`], [`format_template`]). The teacher (the policy itself: live, its EMA or
//! its start, `sdpo.teacher_model_kind`) scores the completion's tokens after that context,
//! and the policy, after the plain prompt, learns toward it. SDFT (TRL's experimental
//! `SDFTTrainer`) is the same step with every completion's context its row's privileged
//! context in `sdft.teacher_prompt_template` ([`sdft_teacher_prompt`]), no rewards:
//!
//! - `sampled_token` (default): `sg(log π − log π_T) · log π` at each sampled token;
//! - `full_logits` / `topk_logits`: the divergence of the next-token distributions
//!   (`grpo_core::distill::Divergence`), over the vocabulary or the student's top k;
//!
//! times `min(π / π_old, distillation_is_clip)` when the step has old log-probs, averaged over
//! each completion's tokens, then over the micro-batch's completions (those without a context
//! count 0). With `distillation_weight` < 1 GRPO's clipped loss (TRL's SDPO formulas: grpo,
//! bnpo, dr_grpo or dapo, per micro-batch) is blended in. The EMA teacher follows the policy
//! after each optimizer update (`Learner::sdpo_after_update`).

use std::collections::{BTreeMap, HashMap};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use candle_core::{D, DType, Tensor};
use grpo_core::distill::Divergence;
use grpo_core::loss::LossType;
use grpo_data::Prompt;
use grpo_rollout::Transformer;

use super::Learner;
use super::batch::{StepBatch, padded_batch, rewards_or_zero};
use super::metrics::OffPolicyStats;
use crate::callbacks::Metrics;
use crate::config::{Algorithm, SdftSection, SdpoMode, SdpoSection, SdpoTeacher, SelfDistill};
use crate::stages::Scored;

/// The checkpoint file of the EMA teacher (its weights, or with LoRA its adapters).
pub const TEACHER_FILE: &str = "sdpo_teacher.safetensors";

/// Python's `str.format` with named fields only: `{name}` replaced by `field(name)`, `{{` and
/// `}}` as braces. An unknown field, a lone brace or an unclosed one is an error naming it.
pub fn format_template(
    template: &str,
    field: &dyn Fn(&str) -> Option<&'static str>,
) -> std::result::Result<String, String> {
    format_with(template, &|name| field(name).map(str::to_string))
}

/// [`format_template`] with owned values.
fn format_with(
    template: &str,
    field: &dyn Fn(&str) -> Option<String>,
) -> std::result::Result<String, String> {
    let mut out = String::with_capacity(template.len());
    let mut rest = template;
    while let Some(i) = rest.find(['{', '}']) {
        out.push_str(&rest[..i]);
        let (c, after) = (rest.as_bytes()[i], &rest[i + 1..]);
        if after.as_bytes().first() == Some(&c) {
            out.push(char::from(c));
            rest = &after[1..];
            continue;
        }
        if c == b'}' {
            return Err("a single `}` (write `}}` for a brace)".into());
        }
        let end = after
            .find('}')
            .ok_or_else(|| "an unclosed `{` (write `{{` for a brace)".to_string())?;
        let name = &after[..end];
        let v = field(name).ok_or_else(|| format!("unknown field `{{{name}}}`"))?;
        out.push_str(&v);
        rest = &after[end + 1..];
    }
    out.push_str(rest);
    Ok(out)
}

/// One completion's teacher context: the sibling whose text is the demonstration, and whether
/// the row's feedback is shown.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Reprompt {
    /// The successful sibling (an index into the step's completions).
    pub demo: Option<usize>,
    /// The row's feedback goes into the context.
    pub feedback: bool,
}

impl Reprompt {
    /// SDFT's context: every completion is shown its row's privileged context (in SDPO's terms,
    /// the row's feedback, without a demonstration).
    pub fn privileged() -> Self {
        Self {
            demo: None,
            feedback: true,
        }
    }

    /// Whether the completion trains on the self-distillation term at all.
    pub fn active(&self) -> bool {
        self.demo.is_some() || self.feedback
    }
}

/// TRL's SDPO context plan over one step's completions (`g` per prompt, in groups, their
/// combined `rewards`; `has_feedback[i]`: completion `i`'s row carries non-blank feedback): per
/// completion its demonstration (the first successful sibling, itself excluded with
/// `dont_reprompt_on_self_success`) and whether feedback is used; and the metrics
/// `self_distillation/{success_group_fraction, success_sample_fraction,
/// feedback_available_fraction, feedback_used_fraction, reprompt_sample_fraction}`.
pub fn plan_reprompts(
    rewards: &[f64],
    g: usize,
    has_feedback: &[bool],
    cfg: &SdpoSection,
) -> (Vec<Reprompt>, BTreeMap<String, f64>) {
    let n = rewards.len();
    let g = g.max(1);
    let ok = |j: usize| rewards[j] >= cfg.success_reward_threshold;
    let mut plan = Vec::with_capacity(n);
    let (mut groups_ok, mut with_solution, mut fb_avail, mut fb_used) = (0usize, 0, 0, 0);
    for i in 0..n {
        let group = (i / g) * g..((i / g) * g + g).min(n);
        if i % g == 0 && group.clone().any(ok) {
            groups_ok += 1;
        }
        let demo = match cfg.use_successful_as_teacher {
            true => group
                .clone()
                .find(|&j| !(cfg.dont_reprompt_on_self_success && j == i) && ok(j)),
            false => None,
        };
        let fb = has_feedback.get(i).copied().unwrap_or(false);
        fb_avail += usize::from(fb);
        let feedback = cfg.include_environment_feedback
            && fb
            && (!cfg.environment_feedback_only_without_solution || demo.is_none());
        fb_used += usize::from(feedback);
        with_solution += usize::from(demo.is_some());
        plan.push(Reprompt { demo, feedback });
    }
    let total = n.max(1) as f64;
    let groups = (n / g).max(1) as f64;
    let active = plan.iter().filter(|p| p.active()).count() as f64;
    let metrics = [
        ("success_group_fraction", groups_ok as f64 / groups),
        ("success_sample_fraction", with_solution as f64 / total),
        ("feedback_available_fraction", fb_avail as f64 / total),
        ("feedback_used_fraction", fb_used as f64 / total),
        ("reprompt_sample_fraction", active / total),
    ]
    .into_iter()
    .map(|(k, v)| (format!("self_distillation/{k}"), v))
    .collect();
    (plan, metrics)
}

/// `text` without its `<think>…</think>` blocks (an unclosed one stays), trimmed: TRL's
/// `remove_thinking_from_demonstration`.
pub fn without_thinking(text: &str) -> String {
    let mut out = String::with_capacity(text.len());
    let mut rest = text;
    while let Some(a) = rest.find("<think>") {
        match rest[a..].find("</think>") {
            Some(b) => {
                out.push_str(&rest[..a]);
                rest = &rest[a + b + "</think>".len()..];
            }
            None => break,
        }
    }
    out.push_str(rest);
    out.trim().to_string()
}

/// The reprompt of one completion: the solution and feedback texts in their templates, then
/// the reprompt template around the prompt's text (a conversation: its last turn, which must
/// be the user's; the turns before it are kept as they are).
pub fn reprompt(
    prompt: &Prompt,
    solution: Option<&str>,
    feedback: Option<&str>,
    cfg: &SdpoSection,
) -> Result<Prompt> {
    let fill = |t: &str, key: &'static str, v: &str| -> Result<String> {
        format_with(t, &|name| (name == key).then(|| v.to_string()))
            .map_err(|e| anyhow::anyhow!("sdpo template: {e}"))
    };
    let solution = match solution {
        Some(s) => fill(&cfg.solution_template, "successful_previous_attempt", s)?,
        None => String::new(),
    };
    let feedback = match feedback {
        Some(f) => fill(&cfg.feedback_template, "feedback_raw", f)?,
        None => String::new(),
    };
    let text = |p: &str| -> Result<String> {
        format_with(&cfg.reprompt_template, &|name| match name {
            "prompt" => Some(p.to_string()),
            "solution" => Some(solution.clone()),
            "feedback" => Some(feedback.clone()),
            _ => None,
        })
        .map_err(|e| anyhow::anyhow!("sdpo.reprompt_template: {e}"))
    };
    with_user_text(prompt, &text)
}

/// `prompt` with its text replaced by `text(its text)`: a text prompt whole, a conversation's
/// last turn, which must be the user's (the turns before it kept), as TRL's self-distillation
/// trainers build the teacher's prompt.
fn with_user_text(prompt: &Prompt, text: &dyn Fn(&str) -> Result<String>) -> Result<Prompt> {
    Ok(match prompt {
        Prompt::Text(t) => Prompt::Text(text(t)?),
        Prompt::Conversation(msgs) => {
            let Some((last, before)) = msgs.split_last() else {
                bail!(
                    "the teacher's prompt rewrites the last user turn; the conversation is empty"
                );
            };
            if last.role != "user" {
                bail!(
                    "the teacher's prompt rewrites the last user turn, but the conversation ends with a `{}` turn",
                    last.role
                );
            }
            let mut turns = before.to_vec();
            turns.push(grpo_data::Message::new("user", text(&last.content)?));
            Prompt::Conversation(turns)
        }
    })
}

/// SDFT's teacher prompt of a row: `sdft.teacher_prompt_template` around the prompt's text and
/// the row's privileged context (text, or a conversation's non-empty contents one per line);
/// a row without one is an error naming it.
pub fn sdft_teacher_prompt(sample: &grpo_data::Sample, cfg: &SdftSection) -> Result<Prompt> {
    let field = &cfg.privileged_context_field;
    let context = match sample.get(field) {
        Some(grpo_data::Value::Messages(m)) => m
            .iter()
            .map(|m| m.content.as_str())
            .filter(|c| !c.is_empty())
            .collect::<Vec<_>>()
            .join("\n"),
        Some(v) => v.as_text().unwrap_or_default(),
        None => String::new(),
    };
    if sample.get(field).is_none_or(grpo_data::Value::is_null) {
        bail!(
            "row {}: `{field}` is missing or null: SDFT's teacher prompt needs each row's privileged context (`sdft.privileged_context_field`)",
            sample.index
        );
    }
    let text = |p: &str| -> Result<String> {
        format_with(&cfg.teacher_prompt_template, &|name| match name {
            "prompt" => Some(p.to_string()),
            "privileged_context" => Some(context.clone()),
            _ => None,
        })
        .map_err(|e| anyhow::anyhow!("sdft.teacher_prompt_template: {e}"))
    };
    with_user_text(&sample.prompt, &text)
}

/// One micro-batch's values, read once the step's updates are done.
struct Part {
    /// The distillation loss per token over the micro-batch's context tokens (TRL's metric).
    distill: Option<Tensor>,
    /// The policy term (`distillation_weight` < 1).
    policy: Option<Tensor>,
    /// Σ entropy · mask and Σ mask.
    entropy: (Tensor, Tensor),
}

impl Learner {
    /// The run's self-distillation settings (an SDPO or SDFT learner has them).
    fn self_distill(&self) -> Result<SelfDistill> {
        self.cfg
            .self_distill()
            .context("a self-distillation step in a run of another algorithm")
    }

    /// The self-distillation teacher now: the policy (live), or the frozen / EMA copy setup
    /// made.
    fn sdpo_teacher(&self) -> Result<Transformer> {
        match self.self_distill()?.teacher {
            SdpoTeacher::Live => Ok(self.policy.model.detached()),
            _ => self
                .distillation_teacher
                .clone()
                .context("SDPO's teacher model is missing"),
        }
    }

    /// The teacher context's tokens of every completion of `s` (a completion without one keeps
    /// its own prompt: its loss is masked), cut to their last `sdpo.max_reprompt_len`.
    fn teacher_prompts(&self, s: &Scored, plan: &[Reprompt]) -> Result<Vec<Vec<u32>>> {
        let d = &self.cfg.sdpo;
        let r = &s.rollouts;
        let mut out = Vec::with_capacity(plan.len());
        for (i, (c, p)) in r.completions.iter().zip(plan).enumerate() {
            if !p.active() {
                out.push(r.prompt_ids[c.prompt_index].clone());
                continue;
            }
            let sample = &r.batch.samples[c.prompt_index];
            let solution = match p.demo {
                Some(j) => {
                    let t = self.tokenizer.decode(&r.completions[j].token_ids, true)?;
                    Some(match d.remove_thinking_from_demonstration {
                        true => without_thinking(&t),
                        false => t,
                    })
                }
                None => None,
            };
            let feedback = match p.feedback {
                true => sample.get_text(&d.feedback_field),
                false => None,
            };
            let prompt = reprompt(&sample.prompt, solution.as_deref(), feedback.as_deref(), d)
                .with_context(|| format!("SDPO teacher context of completion {i}"))?;
            let (_, ids) = crate::stages::render_prompt(&self.tokenizer, &self.cfg, &prompt)?;
            let keep = ids.len().min(d.max_reprompt_len);
            out.push(ids[ids.len() - keep..].to_vec());
        }
        Ok(out)
    }

    /// SDFT's teacher context of every completion of `s`: its row's [`sdft_teacher_prompt`],
    /// rendered and cut to its last `rollout.max_prompt_length` tokens as TRL's prompts are.
    fn sdft_teacher_prompts(&self, s: &Scored) -> Result<Vec<Vec<u32>>> {
        let r = &s.rollouts;
        let mut per_row = Vec::with_capacity(r.batch.samples.len());
        for sample in &r.batch.samples {
            let p = sdft_teacher_prompt(sample, &self.cfg.sdft)?;
            let (_, ids) = crate::stages::encode_prompt(&self.tokenizer, &self.cfg, &p)?;
            per_row.push(ids);
        }
        Ok(r.completions
            .iter()
            .map(|c| per_row[c.prompt_index].clone())
            .collect())
    }

    /// The teacher contexts of the completions of `s` (groups of `g`): which have one, the
    /// context metrics (SDPO's), and each one's teacher prompt tokens (none when the
    /// self-distillation term is off).
    #[allow(clippy::type_complexity)]
    fn contexts(
        &self,
        s: &Scored,
        g: usize,
    ) -> Result<(Vec<Reprompt>, BTreeMap<String, f64>, Vec<Vec<u32>>)> {
        let r = &s.rollouts;
        let n = r.completions.len();
        if self.cfg.algorithm == Algorithm::Sdft {
            // Every completion has its row's privileged context.
            return Ok((
                vec![Reprompt::privileged(); n],
                BTreeMap::new(),
                self.sdft_teacher_prompts(s)?,
            ));
        }
        let d = &self.cfg.sdpo;
        let rewards = rewards_or_zero(&s.scores.rewards, n);
        let has_feedback: Vec<bool> = r
            .completions
            .iter()
            .map(|c| {
                r.batch.samples[c.prompt_index]
                    .get_text(&d.feedback_field)
                    .is_some_and(|t| !t.trim().is_empty())
            })
            .collect();
        let (plan, m) = plan_reprompts(&rewards, g, &has_feedback, d);
        let tp = match d.distillation_weight > 0.0 {
            true => self.teacher_prompts(s, &plan)?,
            false => Vec::new(),
        };
        Ok((plan, m, tp))
    }

    /// Evaluation: the summed micro-batch losses, the summed per-token distillation loss (TRL's
    /// metric, per micro-batch) and the micro-batches of scored completions `s` (groups of
    /// `g`) under the current policy, without gradients.
    pub(crate) fn self_distill_eval(&self, s: &Scored, g: usize) -> Result<(f64, f64, f64)> {
        let (plan, _, teacher_prompts) = self.contexts(s, g)?;
        let eos = &self.tokenizer.eos_token_ids;
        let batch = StepBatch::new(
            s,
            eos,
            self.cfg.micro_batch(),
            self.cfg.loss.mask_truncated_completions,
        );
        let model = self.policy.model.detached();
        let (mut loss, mut distill, mut parts) = (0.0, 0.0, 0.0);
        for &range in &batch.chunks {
            let (l, p) =
                self.sdpo_part(&model, s, &batch, range, None, &plan, &teacher_prompts, 1.0)?;
            loss += l.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            if let Some(d) = p.distill {
                distill += d.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            }
            parts += 1.0;
        }
        Ok((loss, distill, parts))
    }

    /// One SDPO or SDFT step over the scored completions `s`.
    pub(crate) fn sdpo_step(&mut self, s: &Scored, t0: Instant) -> Result<Metrics> {
        let r = &s.rollouts;
        if r.episodes.is_some() {
            bail!("self-distillation trains on single-turn completions, not environment episodes");
        }
        let sdft = self.cfg.algorithm == Algorithm::Sdft;
        let (plan, ctx_metrics, teacher_prompts) =
            self.contexts(s, self.cfg.rollout.num_generations)?;
        let eos = self.tokenizer.eos_token_ids.clone();
        let batch = StepBatch::new(
            s,
            &eos,
            self.cfg.micro_batch(),
            self.cfg.loss.mask_truncated_completions,
        );
        // TRL keeps old log-probs only when a generation feeds several optimizer updates (and
        // SDFT none when it samples from the teacher's prompt).
        let updates = self.cfg.updates_per_step();
        let need_old = (self.cfg.optim.num_iterations > 1 || updates > 1)
            && !(sdft && self.cfg.sdft.generate_from_teacher);
        // (No reference: SDPO and SDFT refuse `reference.beta`.)
        let (old, _) = self.frozen_logps(&batch, need_old)?;
        let chunk_of: HashMap<(usize, usize), usize> = batch
            .chunks
            .iter()
            .enumerate()
            .map(|(i, &c)| (c, i))
            .collect();
        let mut parts: Vec<Part> = Vec::new();
        let (loss, grad_norm, lr) = self.chunked_updates(&batch.chunks, r.batch.step, |l, c| {
            let ci = chunk_of[&c.range];
            let ga = c.update.len().max(1) as f64;
            let (loss, part) = l.sdpo_part(
                &l.policy.model,
                s,
                &batch,
                c.range,
                old[ci].as_ref(),
                &plan,
                &teacher_prompts,
                ga,
            )?;
            parts.push(part);
            Ok(loss)
        })?;
        self.state.step = r.batch.step + 1;
        let mut m = Metrics::new();
        m.insert("loss".into(), loss);
        let mean_of = |v: Vec<Tensor>| -> Result<Option<f64>> {
            if v.is_empty() {
                return Ok(None);
            }
            let x: Vec<f64> = Tensor::cat(&v, 0)?.to_vec1()?;
            Ok(Some(x.iter().sum::<f64>() / x.len() as f64))
        };
        let wide = |t: &Tensor| t.to_dtype(DType::F64)?.reshape(1);
        let distill: Vec<Tensor> = parts
            .iter()
            .filter_map(|p| p.distill.as_ref().map(wide))
            .collect::<candle_core::Result<_>>()?;
        if let Some(v) = mean_of(distill)? {
            m.insert("self_distillation/distillation_loss".into(), v);
            let name = self.cfg.algorithm.as_str();
            m.insert(format!("{name}/distillation_loss"), v);
        }
        let policy: Vec<Tensor> = parts
            .iter()
            .filter_map(|p| p.policy.as_ref().map(wide))
            .collect::<candle_core::Result<_>>()?;
        if let Some(v) = mean_of(policy)? {
            m.insert("self_distillation/policy_loss".into(), v);
        }
        let (mut es, mut ms) = (0.0, 0.0);
        for p in &parts {
            es += p.entropy.0.to_dtype(DType::F64)?.to_scalar::<f64>()?;
            ms += p.entropy.1.to_dtype(DType::F64)?.to_scalar::<f64>()?;
        }
        if ms > 0.0 {
            m.insert("entropy".into(), es / ms);
        }
        m.extend(ctx_metrics);
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

    /// Micro-batch `[a, b)`'s loss under `model` (the policy, with its graph; or a detached
    /// copy to evaluate), divided by the update's `ga` micro-batches as TRL's `compute_loss`,
    /// and its metric values.
    #[allow(clippy::too_many_arguments)]
    fn sdpo_part(
        &self,
        model: &Transformer,
        s: &Scored,
        batch: &StepBatch<'_>,
        (a, b): (usize, usize),
        old: Option<&Tensor>,
        plan: &[Reprompt],
        teacher_prompts: &[Vec<u32>],
        ga: f64,
    ) -> Result<(Tensor, Part)> {
        let d = self.self_distill()?;
        let w = d.weight;
        let temperature = self.cfg.rollout.temperature;
        let pad = self.tokenizer.pad_token_id;
        let (p, c) = (&batch.prompts[a..b], &batch.completions[a..b]);
        let divergence = match d.mode {
            SdpoMode::SampledToken => None,
            SdpoMode::FullLogits => Some(Divergence::Full { beta: d.alpha }),
            SdpoMode::TopkLogits => Some(Divergence::TopK {
                k: d.topk.unwrap_or(1),
                beta: d.alpha,
                add_tail: d.add_tail,
            }),
        };
        let teacher = match w > 0.0 {
            true => Some(self.sdpo_teacher()?),
            false => None,
        };
        let tp: Vec<&[u32]> = match w > 0.0 {
            true => teacher_prompts[a..b].iter().map(Vec::as_slice).collect(),
            false => Vec::new(),
        };
        // The student's log-probs (and, for the logit modes, its divergence from the teacher
        // at the same rows) from one forward. (TRL's self-distillation trainers add no MoE
        // load-balancing loss.)
        let (lp, ent, div, width) = match (&teacher, divergence) {
            (Some(t), Some(div)) => {
                let (ids, mask, width) = padded_batch(pad, p, c, &self.device)?;
                let (h, tg, shape) = model.completion_rows(&ids, &mask, width)?;
                let (lp, ent) = model.rows_logprobs(&h, &tg, shape, temperature, true)?;
                let (tids, tmask, _) = padded_batch(pad, &tp, c, t.device())?;
                let th = t.completion_hidden(&tids, &tmask, width)?.detach();
                let (dv, _) = model.distill_rows(&h, t, &th, div, temperature)?;
                (lp, ent, Some(dv.reshape(shape)?), width)
            }
            _ => {
                let (lp, ent, width) = self.logps(model, p, c, true)?;
                (lp, ent, None, width)
            }
        };
        let mask = batch
            .mask(a, b, width, &self.device)?
            .to_dtype(lp.dtype())?;
        let active: Vec<f32> = plan[a..b]
            .iter()
            .map(|x| f32::from(u8::from(x.active())))
            .collect();
        let active = Tensor::from_vec(active, (b - a, 1), &self.device)?.to_dtype(lp.dtype())?;
        let mut loss_mask = mask.broadcast_mul(&active)?;
        if d.skip > 0 {
            // SDFT's `num_loss_tokens_to_skip`: the first tokens carry no distillation loss.
            let kept: Vec<f32> = (0..width)
                .map(|j| f32::from(u8::from(j >= d.skip)))
                .collect();
            let kept = Tensor::from_vec(kept, (1, width), &self.device)?.to_dtype(lp.dtype())?;
            loss_mask = loss_mask.broadcast_mul(&kept)?;
        }
        // Per completion: Σ x · m / max(Σ m, 1), averaged over the micro-batch.
        let seq_mean = |x: &Tensor, m: &Tensor| -> Result<Tensor> {
            let num = (x * m)?.sum(D::Minus1)?;
            let den = m.sum(D::Minus1)?.maximum(1.0)?;
            Ok((num / den)?.mean_all()?)
        };
        let token_mean = |x: &Tensor, m: &Tensor| -> Result<Tensor> {
            Ok(((x * m)?.sum_all()? / m.sum_all()?.maximum(1.0)?)?)
        };
        let (distill, distill_metric) = match &teacher {
            Some(t) => {
                let per_token = match div {
                    Some(dv) => dv.to_dtype(lp.dtype())?,
                    None => {
                        let tlp = match d.teacher_server {
                            true => {
                                let server = self
                                    .remote
                                    .as_ref()
                                    .context("`use_teacher_server` needs the rollout server")?;
                                super::batch::served_logps(
                                    server,
                                    &tp,
                                    c,
                                    width,
                                    true,
                                    &self.device,
                                )
                                .context("use_teacher_server")?
                            }
                            false => self.logps(t, &tp, c, false)?.0.detach(),
                        };
                        let tlp = tlp.to_device(lp.device())?.to_dtype(lp.dtype())?;
                        ((lp.detach() - tlp)? * &lp)?
                    }
                };
                let per_token = match old {
                    Some(o) if d.is_clip > 0.0 => {
                        let ratio = (lp.detach() - o.to_dtype(lp.dtype())?)?
                            .clamp(-20.0, 20.0)?
                            .exp()?
                            .minimum(d.is_clip)?;
                        (per_token * ratio)?
                    }
                    _ => per_token,
                };
                let metric = token_mean(&per_token.detach(), &loss_mask)?;
                (Some(seq_mean(&per_token, &loss_mask)?), Some(metric))
            }
            None => (None, None),
        };
        let policy = match w < 1.0 {
            true => Some(self.sdpo_policy_loss(&lp, old, &mask, &s.advantages[a..b])?),
            false => None,
        };
        let loss = match (&distill, &policy) {
            (Some(dl), None) => dl.clone(),
            (None, Some(pl)) => pl.clone(),
            (Some(dl), Some(pl)) => ((pl * (1.0 - w))? + (dl * w)?)?,
            (None, None) => bail!("self-distillation: neither term is on"),
        };
        let loss = (loss / ga)?;
        let entropy = match &ent {
            Some(e) => ((e.detach() * &mask)?.sum_all()?, mask.sum_all()?),
            None => {
                let z = Tensor::zeros((), DType::F32, &self.device)?;
                (z.clone(), z)
            }
        };
        Ok((
            loss,
            Part {
                distill: distill_metric,
                policy: policy.as_ref().map(Tensor::detach),
                entropy,
            },
        ))
    }

    /// TRL's SDPO policy term of one micro-batch: the clipped ratio against the old log-probs
    /// (this pass's own, detached, when the step has none), at `loss.importance_sampling_level`
    /// (token, sequence or GSPO-token), reduced
    /// by `loss.loss_type` over the micro-batch (grpo: per completion then mean; bnpo and dapo:
    /// per token; dr_grpo: over `B · max_completion_length`).
    fn sdpo_policy_loss(
        &self,
        lp: &Tensor,
        old: Option<&Tensor>,
        mask: &Tensor,
        advantages: &[f32],
    ) -> Result<Tensor> {
        let lc = self.cfg.loss_config();
        let rows = lp.dim(0)?;
        let old = match old {
            Some(o) => o.to_dtype(lp.dtype())?,
            None => lp.detach(),
        };
        let log_ratio = grpo_core::loss::log_importance_weights(
            lc.importance_sampling_level,
            lp,
            &old.detach(),
            mask,
        )?;
        let adv = Tensor::from_slice(advantages, (rows, 1), lp.device())?.to_dtype(lp.dtype())?;
        let c1 = log_ratio.exp()?;
        let c2 = c1.clamp(1.0 - lc.epsilon_low, 1.0 + lc.epsilon_high)?;
        let per_token = c1
            .broadcast_mul(&adv)?
            .minimum(&c2.broadcast_mul(&adv)?)?
            .neg()?
            .broadcast_as(mask.shape())?;
        let summed = (&per_token * mask)?;
        Ok(match lc.loss_type {
            LossType::Grpo => {
                (summed.sum(D::Minus1)? / mask.sum(D::Minus1)?.maximum(1.0)?)?.mean_all()?
            }
            LossType::DrGrpo => {
                (summed.sum_all()? / (rows as f64 * lc.max_completion_length as f64))?
            }
            _ => (summed.sum_all()? / mask.sum_all()?.maximum(1.0)?)?,
        })
    }

    /// After each optimizer update of an SDPO run with the EMA teacher: every
    /// `sdpo.teacher_sync_steps` updates, `teacher ← (1 − r) · teacher + r · policy` (TRL's
    /// `SyncTeacherModelCallback`), or with LoRA the same on the adapters, whose EMA started
    /// at zero (TRL's `PEFTAdapterEMACallback`).
    pub(crate) fn sdpo_after_update(&mut self) -> Result<()> {
        let Some(d) = self.cfg.self_distill() else {
            return Ok(());
        };
        if d.teacher != SdpoTeacher::Ema || !self.state.optimizer_steps.is_multiple_of(d.sync_steps)
        {
            return Ok(());
        }
        let rate = d.update_rate;
        match (&self.policy.lora, self.sdpo_shadow.take()) {
            (Some(cfg), Some(shadow)) => {
                let now: HashMap<String, Tensor> =
                    grpo_rollout::lora::factors(&self.policy.model, cfg)
                        .into_iter()
                        .collect();
                let mut next = HashMap::with_capacity(shadow.len());
                for (k, old) in shadow {
                    let cur = now
                        .get(&k)
                        .with_context(|| format!("the policy has no adapter tensor `{k}`"))?;
                    let v = ((&old * (1.0 - rate))? + (cur.detach() * rate)?)?;
                    next.insert(k, v);
                }
                self.set_lora_teacher(next)?;
            }
            _ => {
                let teacher = self
                    .distillation_teacher
                    .as_ref()
                    .context("SDPO's EMA teacher is missing")?;
                self.distillation_teacher =
                    Some(super::step::ema_into(teacher, &self.policy, rate)?);
            }
        }
        Ok(())
    }

    /// Makes the LoRA EMA teacher the policy's base with the adapter tensors `shadow`.
    pub(crate) fn set_lora_teacher(&mut self, shadow: HashMap<String, Tensor>) -> Result<()> {
        let cfg = self
            .policy
            .lora
            .as_ref()
            .context("an adapter teacher needs a LoRA policy")?;
        let mut t = self.policy.model.detached();
        grpo_rollout::lora::set_factors(&mut t, cfg, &shadow)?;
        self.distillation_teacher = Some(t);
        self.sdpo_shadow = Some(shadow);
        Ok(())
    }

    /// The EMA teacher's state for a checkpoint: its weights, or with LoRA its adapters.
    pub(crate) fn sdpo_teacher_state(&self) -> Option<HashMap<String, Tensor>> {
        if self.cfg.self_distill()?.teacher != SdpoTeacher::Ema {
            return None;
        }
        match (&self.sdpo_shadow, &self.distillation_teacher) {
            (Some(s), _) => Some(s.clone()),
            (None, Some(t)) => Some(t.weights().into_iter().collect()),
            _ => None,
        }
    }

    /// Restores [`Self::sdpo_teacher_state`] from a checkpoint's tensors.
    pub(crate) fn restore_sdpo_teacher(&mut self, map: HashMap<String, Tensor>) -> Result<()> {
        if self.sdpo_shadow.is_some() {
            return self.set_lora_teacher(map);
        }
        let t = self
            .distillation_teacher
            .as_ref()
            .context("SDPO's EMA teacher is missing")?;
        self.distillation_teacher = Some(Transformer::from_weights_like(t, &map)?);
        Ok(())
    }
}

/// The LoRA EMA teacher's starting adapters, as TRL's `PEFTAdapterEMACallback` makes them:
/// zeros (the teacher starts as the base model). DoRA magnitudes start at the policy's own
/// (a zero magnitude would zero every adapted weight); a policy that trains anything besides
/// its adapters (trained biases, trainable tokens) is refused, as TRL refuses an EMA
/// teacher for it.
pub(crate) fn lora_ema_start(
    model: &Transformer,
    cfg: &grpo_rollout::LoraConfig,
) -> Result<HashMap<String, Tensor>> {
    let mut out = HashMap::new();
    for (k, t) in grpo_rollout::lora::factors(model, cfg) {
        if !k.contains("lora_") {
            bail!(
                "`teacher_model_kind = \"ema\"` with LoRA needs pure adapter training: \
                 `{k}` is trained too (use `live` or `base`, or `lora.bias = \"none\"`)"
            );
        }
        let v = match k.contains("lora_magnitude_vector") {
            true => t.detach().copy()?,
            false => t.detach().zeros_like()?,
        };
        out.insert(k, v);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn cfg() -> SdpoSection {
        SdpoSection::default()
    }

    #[test]
    fn templates_format_as_python_does() {
        let f = |name: &str| match name {
            "a" => Some("x"),
            "b" => Some("{y}"),
            _ => None,
        };
        assert_eq!(format_template("{a}-{b}!", &f).unwrap(), "x-{y}!");
        assert_eq!(format_template("{{a}} {a}}}", &f).unwrap(), "{a} x}");
        assert_eq!(format_template("plain", &f).unwrap(), "plain");
        for (bad, want) in [
            ("{c}", "unknown field `{c}`"),
            ("{}", "unknown field `{}`"),
            ("{a", "unclosed"),
            ("a}", "single `}`"),
        ] {
            let e = format_template(bad, &f).unwrap_err();
            assert!(e.contains(want), "{bad}: {e}");
        }
        // TRL's default reprompt of a text prompt with a solution and no feedback.
        let p = reprompt(&Prompt::Text("Q?".into()), Some("42"), None, &cfg()).unwrap();
        assert_eq!(
            p,
            Prompt::Text(
                "Q?\nCorrect solution:\n\n42\n\n\n\nCorrectly solve the original question.\n"
                    .into()
            )
        );
    }

    #[test]
    fn a_conversation_reprompts_its_last_user_turn() {
        let sys = grpo_data::Message::new("system", "Be brief.");
        let user = grpo_data::Message::new("user", "Q?");
        let mut c = cfg();
        c.reprompt_template = "{prompt}|{solution}|{feedback}".into();
        c.feedback_template = "F:{feedback_raw}".into();
        let p = Prompt::Conversation(vec![sys.clone(), user]);
        let got = reprompt(&p, None, Some("wrong sign"), &c).unwrap();
        assert_eq!(
            got,
            Prompt::Conversation(vec![
                sys.clone(),
                grpo_data::Message::new("user", "Q?||F:wrong sign")
            ])
        );
        let ends_with_assistant =
            Prompt::Conversation(vec![sys, grpo_data::Message::new("assistant", "A")]);
        let e = reprompt(&ends_with_assistant, Some("x"), None, &c).unwrap_err();
        assert!(
            e.to_string().contains("ends with a `assistant` turn"),
            "{e}"
        );
    }

    #[test]
    fn thinking_blocks_leave_the_demonstration() {
        assert_eq!(
            without_thinking(" <think>a\nb</think> 42 <think>c</think>!"),
            "42 !"
        );
        assert_eq!(without_thinking("x <think>open"), "x <think>open");
    }

    #[test]
    fn the_plan_picks_the_first_successful_sibling_as_trl() {
        // Two groups of 3: group 0 has successes at 1 and 2; group 1 none.
        let rewards = [0.0, 1.0, 1.5, 0.2, 0.9, f64::NAN];
        let fb = [false, false, false, true, false, true];
        let (plan, m) = plan_reprompts(&rewards, 3, &fb, &cfg());
        let demos: Vec<Option<usize>> = plan.iter().map(|p| p.demo).collect();
        assert_eq!(demos, [Some(1), Some(2), Some(1), None, None, None]);
        assert!(
            plan.iter().all(|p| !p.feedback),
            "feedback is off by default"
        );
        assert_eq!(m["self_distillation/success_group_fraction"], 0.5);
        assert_eq!(m["self_distillation/success_sample_fraction"], 0.5);
        assert_eq!(
            m["self_distillation/feedback_available_fraction"],
            2.0 / 6.0
        );
        assert_eq!(m["self_distillation/feedback_used_fraction"], 0.0);
        assert_eq!(m["self_distillation/reprompt_sample_fraction"], 0.5);
        // A completion may be its own demonstration; feedback only without a solution.
        let mut c = cfg();
        c.dont_reprompt_on_self_success = false;
        c.include_environment_feedback = true;
        c.environment_feedback_only_without_solution = true;
        let fb = [true, true, false, true, false, false];
        let (plan, m) = plan_reprompts(&rewards, 3, &fb, &c);
        let got: Vec<(Option<usize>, bool)> = plan.iter().map(|p| (p.demo, p.feedback)).collect();
        assert_eq!(
            got,
            [
                (Some(1), false),
                (Some(1), false),
                (Some(1), false),
                (None, true),
                (None, false),
                (None, false)
            ]
        );
        assert_eq!(m["self_distillation/feedback_used_fraction"], 1.0 / 6.0);
        assert_eq!(m["self_distillation/reprompt_sample_fraction"], 4.0 / 6.0);
        // Without successful demonstrations only feedback reprompts.
        c.use_successful_as_teacher = false;
        let (plan, m) = plan_reprompts(&rewards, 3, &fb, &c);
        assert!(plan.iter().all(|p| p.demo.is_none()));
        assert_eq!(
            m["self_distillation/success_group_fraction"], 0.5,
            "still counted"
        );
        assert_eq!(plan.iter().filter(|p| p.feedback).count(), 3);
    }
}
