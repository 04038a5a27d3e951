//! Mixtures of experts (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite MoE, gpt-oss, GLM-4.5): the MoE MLP that takes a dense MLP's
//! place in a decoder layer ([`Moe`]), its checkpoints' names ([`MoeNames`]), and the
//! load-balancing loss TRL adds to an MoE model's training loss ([`AuxCollector`]:
//! transformers' `load_balancing_loss_func`, its gradient given to each layer's router in the
//! backward pass, inside gradient-checkpointed layers too).

use std::cell::RefCell;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor};
use grpo_core::recompute::Recompute;

use crate::config::{Arch, Routing};
use crate::model::{Linear, map_linear};

/// The tensor names of an MoE layer in the model: as its family's checkpoints store them
/// (transformers 5 writes this per-expert layout too, and fuses the experts only in memory),
/// Granite MoE's and gpt-oss's split from their fused files ([`crate::layout`]).
#[derive(Debug, Clone, Copy)]
pub struct MoeNames {
    block: &'static str,
    router: &'static str,
    parts: [&'static str; 3],
    shared: &'static str,
}

impl MoeNames {
    /// Mixtral's `block_sparse_moe` with `w1`/`w3`/`w2`; Qwen's `mlp` with gate/up/down; Granite
    /// MoE's `block_sparse_moe` with gate/up/down (the model's names: its files fuse them,
    /// [`crate::layout`]).
    pub fn of(arch: Arch) -> Self {
        match arch {
            Arch::Mixtral => MoeNames {
                block: "block_sparse_moe",
                router: "gate",
                parts: ["w1", "w3", "w2"],
                shared: "",
            },
            Arch::GraniteMoe => MoeNames {
                block: "block_sparse_moe",
                router: "gate",
                parts: ["gate_proj", "up_proj", "down_proj"],
                shared: "",
            },
            Arch::GptOss => MoeNames {
                block: "mlp",
                router: "router",
                parts: ["gate_proj", "up_proj", "down_proj"],
                shared: "",
            },
            _ => MoeNames {
                block: "mlp",
                router: "gate",
                parts: ["gate_proj", "up_proj", "down_proj"],
                // GLM-4.5's `n_shared_experts` are one MLP, `shared_experts`.
                shared: match arch.deepseek_moe() {
                    true => "shared_experts",
                    false => "shared_expert",
                },
            },
        }
    }

    /// The router's weight `(experts, hidden)`.
    pub fn router(&self, layer: usize) -> String {
        format!("model.layers.{layer}.{}.{}.weight", self.block, self.router)
    }

    /// The module holding layer `layer`'s experts (`model.layers.{layer}.mlp.experts`).
    pub fn experts_module(&self, layer: usize) -> String {
        format!("model.layers.{layer}.{}.experts", self.block)
    }

    /// Expert `e`'s gate, up and down weights.
    pub fn expert(&self, layer: usize, e: usize) -> [String; 3] {
        self.parts
            .map(|p| format!("model.layers.{layer}.{}.experts.{e}.{p}.weight", self.block))
    }

    /// The shared expert's gate, up and down weights (Qwen2-MoE's `shared_expert`, GLM-4.5's
    /// `shared_experts`).
    pub fn shared(&self, layer: usize) -> [String; 3] {
        ["gate_proj", "up_proj", "down_proj"]
            .map(|p| format!("{}.{p}.weight", self.shared_module(layer)))
    }

    /// The shared expert's module (`model.layers.{layer}.mlp.shared_expert`), as PEFT names
    /// its maps' adapters.
    pub fn shared_module(&self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp.{}", self.shared)
    }

    /// GLM-4.5's router's score offsets `(experts,)` (`e_score_correction_bias`).
    pub fn correction_bias(&self, layer: usize) -> String {
        format!(
            "model.layers.{layer}.{}.{}.e_score_correction_bias",
            self.block, self.router
        )
    }

    /// Whether transformers keeps the tensor `name` of an `arch` model in f32 whatever the
    /// model's dtype (`_keep_in_fp32_modules_strict`): DeepSeek's routers (GLM-4.5,
    /// DeepSeek-V2/V3, GLM-4.7-Flash) and their offsets.
    pub fn kept_in_f32(arch: Arch, name: &str) -> bool {
        Self::is_buffer(name) || (arch.deepseek_moe() && name.ends_with(".mlp.gate.weight"))
    }

    /// Whether a checkpoint tensor is a constant of the model rather than a weight to train
    /// (GLM-4.5's `e_score_correction_bias`, a buffer in transformers).
    pub fn is_buffer(name: &str) -> bool {
        // Gemma 4's `layer_scalar` too: a buffer of the checkpoint, not trained.
        name.ends_with(".e_score_correction_bias") || name.ends_with(".layer_scalar")
    }

    /// Qwen2-MoE's shared expert's gate `(1, hidden)`.
    pub fn shared_gate(&self, layer: usize) -> String {
        format!("model.layers.{layer}.mlp.shared_expert_gate.weight")
    }

    /// The bias of the map whose weight is `weight` (gpt-oss's router and experts).
    pub fn bias_of(weight: &str) -> String {
        format!("{}.bias", weight.strip_suffix(".weight").unwrap_or(weight))
    }
}

/// One expert of an MoE layer: a gated MLP of its own.
#[derive(Debug, Clone)]
pub struct Expert {
    /// Gate `(width, hidden)`.
    pub gate_proj: Linear,
    /// Up `(width, hidden)`.
    pub up_proj: Linear,
    /// Down `(hidden, width)`.
    pub down_proj: Linear,
}

impl Expert {
    /// Gate, up and down.
    pub fn linears(&self) -> [&Linear; 3] {
        [&self.gate_proj, &self.up_proj, &self.down_proj]
    }

    pub(crate) fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Expert {
            gate_proj: map_linear(&self.gate_proj, f)?,
            up_proj: map_linear(&self.up_proj, f)?,
            down_proj: map_linear(&self.down_proj, f)?,
        })
    }
}

/// A sparse mixture-of-experts MLP (Qwen3-MoE, Qwen2-MoE, Mixtral, OLMoE, Granite MoE, gpt-oss,
/// GLM-4.5), computed as transformers does: the router's logits → each token's `top_k` experts
/// and their weights ([`Routing`]: a softmax in f32, or GLM-4.5's grouped sigmoid scores) →
/// the experts' outputs weighted; Qwen2-MoE adds a shared expert times
/// `sigmoid(shared_expert_gate · h)`, GLM-4.5 its shared experts as they are. Each expert runs
/// once on the rows routed to it (gathered, then put back in place): the gradient reaches the
/// router through the chosen weights and each expert through its own rows.
#[derive(Debug, Clone)]
pub struct Moe {
    /// The router `(experts, hidden)` (the checkpoints' `gate`).
    pub router: Linear,
    /// The experts.
    pub experts: Vec<Expert>,
    /// Experts per token.
    pub top_k: usize,
    /// Renormalise the chosen probabilities.
    pub norm_topk_prob: bool,
    /// The shared expert, with Qwen2-MoE's gate `(1, hidden)`.
    pub shared: Option<(Expert, Option<Linear>)>,
    /// How the logits choose and weight the experts.
    pub routing: Routing,
    /// GLM-4.5's `e_score_correction_bias` `(experts,)`, in f32 (f64 in an f64 model): added
    /// to the scores to choose the experts, not to weight them; a constant, never trained.
    pub correction_bias: Option<Tensor>,
    /// Gemma 4's `per_expert_scale` `(experts,)`: each chosen weight (after renormalising)
    /// times its expert's scale (a trained weight).
    pub expert_scale: Option<Tensor>,
}

/// `1 / (1 + exp(−x))`.
pub(crate) fn sigmoid(x: &Tensor) -> Result<Tensor> {
    (x.neg()?.exp()? + 1.0)?.recip()
}

/// The softmax of each row of `z` `(N, experts)`, the graph kept.
fn softmax_rows(z: &Tensor) -> Result<Tensor> {
    let z = z.broadcast_sub(&z.max_keepdim(1)?.detach())?.exp()?;
    z.broadcast_div(&z.sum_keepdim(1)?)
}

/// Which experts `(N, groups · per)` lie in each row's `topk_group` best groups, of the groups'
/// scores `(N, groups)` (ranked on the device: 0 the best).
fn best_groups(group_scores: &Tensor, per: usize, topk_group: usize) -> Result<Tensor> {
    let (n, groups) = group_scores.dims2()?;
    group_scores
        .arg_sort_last_dim(false)?
        .arg_sort_last_dim(true)?
        .to_dtype(group_scores.dtype())?
        .lt(topk_group as f64)?
        .unsqueeze(2)?
        .broadcast_as((n, groups, per))?
        .reshape((n, groups * per))
}

impl Moe {
    /// Every linear map: the router, the experts', the shared expert's and its gate.
    pub fn linears(&self) -> Vec<&Linear> {
        let mut out = vec![&self.router];
        out.extend(self.experts.iter().flat_map(Expert::linears));
        if let Some((e, g)) = &self.shared {
            out.extend(e.linears());
            out.extend(g);
        }
        out
    }

    pub(crate) fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Moe {
            router: map_linear(&self.router, f)?,
            experts: self
                .experts
                .iter()
                .map(|e| e.map(f))
                .collect::<Result<_>>()?,
            top_k: self.top_k,
            norm_topk_prob: self.norm_topk_prob,
            shared: match &self.shared {
                Some((e, g)) => {
                    Some((e.map(f)?, g.as_ref().map(|g| map_linear(g, f)).transpose()?))
                }
                None => None,
            },
            routing: self.routing,
            // The offsets keep their precision (f32) whatever `f` casts the weights to.
            correction_bias: match &self.correction_bias {
                Some(b) => Some(f(b)?.to_dtype(b.dtype())?),
                None => None,
            },
            expert_scale: self.expert_scale.as_ref().map(f).transpose()?,
        })
    }

    /// Each row's experts `(N, top_k)` (best first), their weights `(N, top_k)` and every
    /// expert's probability `(N, experts)`, in f32 (f64 for an f64 model) with the graph back
    /// to the router, of the router's logits `(N, experts)`.
    pub fn route(&self, logits: &Tensor) -> Result<(Tensor, Tensor, Tensor)> {
        let z = match logits.dtype() {
            DType::F64 => logits.clone(),
            _ => logits.to_dtype(DType::F32)?,
        };
        if let Routing::SigmoidGroups {
            n_group,
            topk_group,
            routed_scaling_factor,
        } = self.routing
        {
            return self.route_groups(&z, n_group, topk_group, routed_scaling_factor);
        }
        if let Routing::Sigmoid {
            routed_scaling_factor,
            ..
        } = self.routing
        {
            return self.route_sigmoid(&z, routed_scaling_factor);
        }
        if let Routing::Greedy {
            n_group,
            topk_group,
            routed_scaling_factor,
            group_limited,
        } = self.routing
        {
            let groups = group_limited.then_some((n_group, topk_group));
            return self.route_greedy(&z, groups, routed_scaling_factor);
        }
        let probs = softmax_rows(&z)?;
        let top = probs
            .detach()
            .arg_sort_last_dim(false)?
            .narrow(1, 0, self.top_k)?
            .contiguous()?;
        let mut w = probs.gather(&top, 1)?;
        if self.norm_topk_prob {
            w = w.broadcast_div(&w.sum_keepdim(1)?)?;
        }
        if let Some(s) = &self.expert_scale {
            let chosen = s
                .index_select(&top.flatten_all()?, 0)?
                .reshape(top.shape())?
                .to_dtype(w.dtype())?;
            w = (w * chosen)?;
        }
        Ok((top, w, probs))
    }

    /// [`Routing::Sigmoid`] of the logits `z` (f32 or f64): the experts chosen by score plus
    /// the `expert_bias` (where the layer has one), weighted by their scores (renormalised with
    /// transformers' 1e-6), times `scale`.
    fn route_sigmoid(&self, z: &Tensor, scale: f64) -> Result<(Tensor, Tensor, Tensor)> {
        let scores = sigmoid(z)?;
        let choice = match &self.correction_bias {
            Some(b) => scores.detach().broadcast_add(&b.to_dtype(z.dtype())?)?,
            None => scores.detach(),
        };
        let (top, w) = self.chosen(&scores, &choice, 1e-6, scale)?;
        Ok((top, w, scores))
    }

    /// The `top_k` experts of each row by `choice` `(N, experts)` and their weights from
    /// `scores` (renormalised with `eps` when `norm_topk_prob`), times `scale`.
    fn chosen(
        &self,
        scores: &Tensor,
        choice: &Tensor,
        eps: f64,
        scale: f64,
    ) -> Result<(Tensor, Tensor)> {
        let top = choice
            .arg_sort_last_dim(false)?
            .narrow(1, 0, self.top_k)?
            .contiguous()?;
        let mut w = scores.gather(&top, 1)?;
        if self.norm_topk_prob {
            w = w.broadcast_div(&(w.sum_keepdim(1)? + eps)?)?;
        }
        if scale != 1.0 {
            w = (w * scale)?;
        }
        Ok((top, w))
    }

    /// [`Routing::SigmoidGroups`] of the logits `z` (f32 or f64), all on the device: the
    /// groups ranked by their two best offset scores, the experts outside the best
    /// `topk_group` masked out, the `top_k` best offset scores chosen, their plain scores the
    /// weights (the graph back to the router through them).
    fn route_groups(
        &self,
        z: &Tensor,
        n_group: usize,
        topk_group: usize,
        scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let scores = sigmoid(z)?;
        let bias = self
            .correction_bias
            .as_ref()
            .ok_or_else(|| candle_core::Error::msg("the router has no e_score_correction_bias"))?;
        let choice = scores.detach().broadcast_add(&bias.to_dtype(z.dtype())?)?;
        let (n, e) = choice.dims2()?;
        let choice = match n_group > 1 {
            false => choice,
            true => {
                let per = e / n_group;
                let (sorted, _) = choice.reshape((n, n_group, per))?.sort_last_dim(false)?;
                // Groups scored by their two best.
                let keep = best_groups(&sorted.narrow(2, 0, 2)?.sum(2)?, per, topk_group)?;
                keep.where_cond(&choice, &(choice.zeros_like()? - f64::INFINITY)?)?
            }
        };
        let (top, w) = self.chosen(&scores, &choice, 1e-20, scale)?;
        Ok((top, w, scores))
    }

    /// [`Routing::Greedy`] of the logits `z` (f32 or f64), on the device: the softmax
    /// probabilities; with `groups` `(n_group, topk_group)` the groups ranked by their best
    /// probability and the experts outside the best `topk_group` given probability 0; the
    /// `top_k` most probable chosen, weighted by those probabilities times `scale`.
    fn route_greedy(
        &self,
        z: &Tensor,
        groups: Option<(usize, usize)>,
        scale: f64,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        let probs = softmax_rows(z)?;
        let (n, e) = probs.dims2()?;
        let scores = match groups {
            Some((n_group, topk_group)) if n_group > 1 => {
                let per = e / n_group;
                // Groups scored by their best.
                let best = probs.detach().reshape((n, n_group, per))?.max(2)?;
                let keep = best_groups(&best, per, topk_group)?;
                keep.where_cond(&probs, &probs.zeros_like()?)?
            }
            _ => probs.clone(),
        };
        let top = scores
            .detach()
            .arg_sort_last_dim(false)?
            .narrow(1, 0, self.top_k)?
            .contiguous()?;
        let mut w = scores.gather(&top, 1)?;
        if scale != 1.0 {
            w = (w * scale)?;
        }
        Ok((top, w, probs))
    }

    /// The router's logits of rows `h`: in the rows' dtype for the softmax routers and
    /// LFM2-MoE's, in f32
    /// (f64 in an f64 model) for DeepSeek's, as transformers computes them.
    fn logits(&self, h: &Tensor) -> Result<Tensor> {
        match self.routing {
            Routing::Softmax | Routing::Sigmoid { .. } => self.router.forward(h),
            Routing::SigmoidGroups { .. } | Routing::Greedy { .. } => {
                let dt = match h.dtype() {
                    DType::F64 => DType::F64,
                    _ => DType::F32,
                };
                // A LoRA adapter (PEFT's `target_parameters` `gate.weight`) shifts the weight.
                let w = match &self.router.lora {
                    Some(l) => (self.router.weight.to_dtype(dt)? + l.delta()?.to_dtype(dt)?)?,
                    None => self.router.weight.to_dtype(dt)?,
                };
                h.to_dtype(dt)?.matmul(&w.t()?)
            }
        }
    }

    /// The MLP of normalised rows `h` `(N, hidden)` with the gate activation `act(gate, up)`:
    /// each expert runs on its rows gathered (one host read of the routing, `N · top_k` ids),
    /// the outputs put back in (row, choice) order and summed with their weights. With `aux`,
    /// the rows' load-balancing statistics go to its collector and the output carries the
    /// loss's gradient to the router ([`AuxCollector`]).
    pub fn forward(
        &self,
        h: &Tensor,
        act: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
        aux: Option<&AuxRows>,
    ) -> Result<Tensor> {
        self.forward_routed(h, h, act, aux)
    }

    /// [`Self::forward`] with the router reading rows of its own, `routed` (Gemma 4's router
    /// normalises and scales the residual stream itself; its experts take another norm of it).
    pub fn forward_routed(
        &self,
        h: &Tensor,
        routed: &Tensor,
        act: &dyn Fn(&Tensor, &Tensor) -> Result<Tensor>,
        aux: Option<&AuxRows>,
    ) -> Result<Tensor> {
        let (n, hidden) = h.dims2()?;
        let k = self.top_k;
        let (top, w, probs) = self.route(&self.logits(routed)?)?;
        let top: Vec<u32> = top.flatten_all()?.to_vec1()?;
        let mut rows: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        let mut slots: Vec<Vec<u32>> = vec![Vec::new(); self.experts.len()];
        for (p, &e) in top.iter().enumerate() {
            let e = e as usize;
            rows[e].push((p / k) as u32);
            slots[e].push(p as u32);
        }
        let dev = h.device();
        let mlp = |e: &Expert, x: &Tensor| -> Result<Tensor> {
            e.down_proj
                .forward(&act(&e.gate_proj.forward(x)?, &e.up_proj.forward(x)?)?)
        };
        let mut outs = Vec::new();
        let mut order = Vec::with_capacity(n * k);
        for (e, expert) in self.experts.iter().enumerate() {
            if rows[e].is_empty() {
                continue;
            }
            let idx = Tensor::new(rows[e].as_slice(), dev)?;
            outs.push(mlp(expert, &h.index_select(&idx, 0)?)?);
            order.extend_from_slice(&slots[e]);
        }
        let mut back = vec![0u32; n * k];
        for (j, &p) in order.iter().enumerate() {
            back[p as usize] = j as u32;
        }
        let y = Tensor::cat(&outs, 0)?
            .index_select(&Tensor::new(back, dev)?, 0)?
            .reshape((n, k, hidden))?;
        let w = w.to_dtype(y.dtype())?.unsqueeze(2)?;
        let mut out = y.broadcast_mul(&w)?.sum(1)?;
        if let Some((e, g)) = &self.shared {
            let y = mlp(e, h)?;
            out = match g {
                Some(g) => (out + y.broadcast_mul(&sigmoid(&g.forward(h)?)?)?)?,
                None => (out + y)?,
            };
        }
        // GLM-4.5's router has no load-balancing loss (transformers computes none).
        match aux {
            Some(a) if self.routing == Routing::Softmax => a.tap(out, &probs, &top, k),
            _ => Ok(out),
        }
    }
}

/// transformers' load-balancing loss over one micro-batch's forward passes, as TRL adds it to
/// an MoE model's loss (`router_aux_loss_coef · aux / gradient_accumulation_steps`): over
/// every MoE layer's non-padding rows `r` (weights `w_r`), `T_e` the (row, choice) pairs routed
/// to expert `e` and `P_e` the sum of its router probabilities,
/// `aux = E · Σ_e T_e P_e / R²` with `R = Σ w_r` over the layers. `T` is constant, so the
/// gradient is `scale · E · T_e / R²` on each `P_e`: the layers' outputs carry it to their
/// routers in the backward pass that follows the forward (`AuxRows::tap`), once every layer
/// has counted its rows.
#[derive(Debug)]
pub struct AuxCollector {
    /// The loss's factor in the training loss (the coefficient over the accumulation steps).
    scale: f64,
    sums: Mutex<AuxSums>,
}

#[derive(Debug, Default)]
struct AuxSums {
    /// `T_e` (weighted).
    counts: Vec<f64>,
    /// `P_e`.
    probs: Vec<f64>,
    /// `R`.
    rows: f64,
}

impl AuxCollector {
    /// An empty collector whose loss enters the training loss times `scale`.
    pub fn new(scale: f64) -> Arc<Self> {
        Arc::new(AuxCollector {
            scale,
            sums: Mutex::new(AuxSums::default()),
        })
    }

    fn sums(&self) -> std::sync::MutexGuard<'_, AuxSums> {
        self.sums.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// The loss `E · Σ_e T_e P_e / R²` of what was recorded (0 when nothing was).
    pub fn loss(&self) -> f64 {
        let s = self.sums();
        if s.rows <= 0.0 {
            return 0.0;
        }
        let dot: f64 = s.counts.iter().zip(&s.probs).map(|(t, p)| t * p).sum();
        s.counts.len() as f64 * dot / (s.rows * s.rows)
    }

    /// `loss + scale · aux` (the value only: the gradient is in the graph already) and the
    /// recorded `aux`.
    pub fn add_to(&self, loss: Tensor) -> Result<(Tensor, f64)> {
        let aux = self.loss();
        Ok(((loss + self.scale * aux)?, aux))
    }

    /// `∂(scale · aux)/∂P_e` for every expert.
    fn gradient(&self) -> Vec<f64> {
        let s = self.sums();
        if s.rows <= 0.0 {
            return vec![0.0; s.counts.len()];
        }
        let f = self.scale * s.counts.len() as f64 / (s.rows * s.rows);
        s.counts.iter().map(|t| f * t).collect()
    }

    fn add(&self, counts: &[f64], probs: &[f64], rows: f64) {
        let mut s = self.sums();
        if s.counts.is_empty() {
            s.counts = vec![0.0; counts.len()];
            s.probs = vec![0.0; probs.len()];
        }
        for (a, b) in s.counts.iter_mut().zip(counts) {
            *a += b;
        }
        for (a, b) in s.probs.iter_mut().zip(probs) {
            *a += b;
        }
        s.rows += rows;
    }
}

/// A collector and the weights `(N,)` of one forward call's rows (0 for padding; a shared
/// prompt's rows count once per completion that follows them).
#[derive(Debug, Clone)]
pub struct AuxRows {
    collector: Arc<AuxCollector>,
    weights: Tensor,
}

thread_local! {
    static COLLECTOR: RefCell<Option<Arc<AuxCollector>>> = const { RefCell::new(None) };
    static ROWS: RefCell<Option<Tensor>> = const { RefCell::new(None) };
    static REPLAY: RefCell<bool> = const { RefCell::new(false) };
}

fn scoped<S: 'static, T>(
    key: &'static std::thread::LocalKey<RefCell<S>>,
    value: S,
    f: impl FnOnce() -> T,
) -> T {
    let old = key.with(|c| c.replace(value));
    let out = f();
    key.with(|c| *c.borrow_mut() = old);
    out
}

/// Runs `f` (the policy's training forward of one micro-batch) with `collector` recording
/// the MoE layers' load-balancing statistics of the padded or shared-prompt row batches the
/// model's log-prob functions pass (their masks give each row's weight).
pub fn recording<T>(collector: Option<Arc<AuxCollector>>, f: impl FnOnce() -> T) -> T {
    scoped(&COLLECTOR, collector, f)
}

/// Whether a collector is recording.
pub fn is_recording() -> bool {
    COLLECTOR.with(|c| c.borrow().is_some())
}

/// Runs `f` with `weights` `(N,)` (f32, 0 for padding) as the weights of the rows of its
/// forward calls: for forwards the log-prob functions do not weigh themselves (packed rows,
/// `Transformer::logprobs_stats_with`).
pub fn with_rows<T>(weights: Option<Tensor>, f: impl FnOnce() -> T) -> T {
    scoped(&ROWS, weights, f)
}

/// A backward pass's recomputation of a layer (gradient checkpointing): its rows were
/// counted in the forward pass already.
pub(crate) fn replaying<T>(f: impl FnOnce() -> T) -> T {
    scoped(&REPLAY, true, f)
}

/// The collector and row weights a forward call's layers record with, if any.
pub(crate) fn current() -> Option<AuxRows> {
    let collector = COLLECTOR.with(|c| c.borrow().clone())?;
    let weights = ROWS.with(|r| r.borrow().clone())?;
    Some(AuxRows { collector, weights })
}

impl AuxRows {
    /// Counts the rows (unless replaying) and returns `out` through a node whose backward
    /// also hands `P_e`'s gradient to the router's probabilities `probs` `(N, experts)`.
    fn tap(&self, out: Tensor, probs: &Tensor, top: &[u32], k: usize) -> Result<Tensor> {
        let w = self.weights.to_dtype(probs.dtype())?;
        let p_sum = w.unsqueeze(0)?.matmul(probs)?.squeeze(0)?;
        if !REPLAY.with(|r| *r.borrow()) {
            let wv: Vec<f64> = self.weights.to_dtype(DType::F64)?.to_vec1()?;
            let mut counts = vec![0.0; probs.dim(1)?];
            for (p, &e) in top.iter().enumerate() {
                counts[e as usize] += wv[p / k];
            }
            let ps: Vec<f64> = p_sum.detach().to_dtype(DType::F64)?.to_vec1()?;
            self.collector.add(&counts, &ps, wv.iter().sum());
        }
        let c = self.collector.clone();
        Recompute::explicit(
            "moe_load_balancing",
            |a, _| Ok(a[0].clone()),
            move |a, g| {
                let grad = Tensor::new(c.gradient(), a[1].device())?.to_dtype(a[1].dtype())?;
                Ok(vec![Some(g.clone()), Some(grad)])
            },
        )
        .apply(&[&out, &p_sum])
    }
}
