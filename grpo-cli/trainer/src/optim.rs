//! AdamW with saveable state, global-norm gradient clipping and the learning-rate schedules
//! of Hugging Face `transformers` (constant, linear, cosine, each with linear warm-up).
//!
//! candle-nn's AdamW keeps its moments private, so a checkpoint could not restore them and a
//! resumed run would differ; this one stores `m`, `v` and the step count as tensors.

use std::collections::HashMap;
use std::path::Path;

use anyhow::{Context, Result, bail};
use candle_core::backprop::GradStore;
use candle_core::{DType, Tensor, Var};
use grpo_core::quant::{Blockwise, dequantize, quantize};

/// AdamW hyper-parameters (PyTorch's `torch.optim.AdamW` semantics).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct AdamWParams {
    /// β1.
    pub beta1: f64,
    /// β2.
    pub beta2: f64,
    /// ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
}

/// How Adam's two moments of one variable are kept.
#[derive(Debug, Clone)]
enum Moments {
    /// Tensors of the variable's shape: bf16 for pure bf16 training (as PyTorch's AdamW keeps
    /// them in the parameter's dtype), f32 otherwise (f32/f64 and f16 variables, mixed
    /// precision).
    Full { m: Tensor, v: Tensor },
    /// bitsandbytes' 8-bit blockwise state (`optim = "adamw_8bit"`): one byte per value and an
    /// f32 maximum per block of 256, the first moment on the signed dynamic map, the second on
    /// the unsigned one ([`grpo_core::quant`]).
    Int8 { m: Blockwise, v: Blockwise },
}

/// bitsandbytes' `min_8bit_size`: variables with fewer values keep 32-bit moments.
pub const MIN_8BIT_SIZE: usize = 4096;

/// AdamW over named `Var`s.
#[derive(Debug)]
pub struct AdamW {
    params: AdamWParams,
    vars: Vec<(String, Var)>,
    /// First and second moments; each update computes in f32.
    moments: Vec<Moments>,
    /// The dtype each variable's gradients are summed in over micro-batches.
    sums: Vec<DType>,
    /// Whether weight decay applies to each variable ([`decays`]).
    decay: Vec<bool>,
    /// The signed and unsigned dynamic maps on the variables' device (8-bit state only).
    maps: Option<(Tensor, Tensor)>,
    /// f32 master copies of half-precision variables (mixed precision, TRL's `bf16 = true`):
    /// updates land here and the variable gets the rounded result.
    master: Vec<Option<Tensor>>,
    step: usize,
}

impl AdamW {
    /// Zero moments for `vars`.
    pub fn new(vars: Vec<(String, Var)>, params: AdamWParams) -> Result<Self> {
        let mut moments = Vec::with_capacity(vars.len());
        let mut sums = Vec::with_capacity(vars.len());
        for (_, var) in &vars {
            // bf16 has f32's exponent range; f16's does not: a second moment (1 − β2)·g² of a
            // gradient near 1e-3 is below its smallest value, and the update m / (0 + ε) blows
            // up. f16 variables keep f32 moments.
            let dt = if var.dtype() == DType::BF16 {
                DType::BF16
            } else {
                DType::F32
            };
            moments.push(Moments::Full {
                m: var.zeros_like()?.to_dtype(dt)?,
                v: var.zeros_like()?.to_dtype(dt)?,
            });
            sums.push(dt);
        }
        let master = vec![None; vars.len()];
        let decay = vars.iter().map(|(name, _)| decays(name)).collect();
        Ok(Self {
            params,
            vars,
            moments,
            sums,
            decay,
            maps: None,
            master,
            step: 0,
        })
    }

    /// Mixed precision: every half-precision variable gets an f32 master copy that the updates
    /// accumulate in, and f32 moments and gradient sums, as PyTorch's AMP keeps f32
    /// parameters for a bf16 forward. Without it a bf16 weight rounds each update to 8 bits of
    /// mantissa, and updates below its spacing are lost.
    pub fn with_master_weights(mut self) -> Result<Self> {
        for (i, (_, var)) in self.vars.iter().enumerate() {
            if is_half(var.dtype()) {
                self.master[i] = Some(var.as_tensor().to_dtype(DType::F32)?);
                if let Moments::Full { m, v } = &self.moments[i] {
                    self.moments[i] = Moments::Full {
                        m: m.to_dtype(DType::F32)?,
                        v: v.to_dtype(DType::F32)?,
                    };
                }
                self.sums[i] = DType::F32;
            }
        }
        Ok(self)
    }

    /// bitsandbytes' 8-bit AdamW (transformers' `optim = "adamw_8bit"`): the moments of every
    /// variable with at least [`MIN_8BIT_SIZE`] values in 8-bit blockwise state — 1 + 4/256
    /// bytes per value and moment where f32 takes 4 — except those `keep_32bit` names
    /// (transformers keeps embeddings' state in 32 bits). The update itself is AdamW's in f32.
    pub fn with_8bit_states(mut self, keep_32bit: impl Fn(&str) -> bool) -> Result<Self> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            if var.elem_count() < MIN_8BIT_SIZE || keep_32bit(name) {
                continue;
            }
            let n = var.elem_count();
            self.moments[i] = Moments::Int8 {
                m: Blockwise::zeros(n, var.device())?,
                v: Blockwise::zeros(n, var.device())?,
            };
            if self.maps.is_none() {
                self.maps = Some(maps(var.device())?);
            }
        }
        Ok(self)
    }

    /// Bytes the moments hold (both, every variable).
    pub fn state_bytes(&self) -> usize {
        self.moments
            .iter()
            .map(|mo| match mo {
                Moments::Full { m, v } => {
                    (m.elem_count() * m.dtype().size_in_bytes())
                        + (v.elem_count() * v.dtype().size_in_bytes())
                }
                Moments::Int8 { m, v } => m.bytes() + v.bytes(),
            })
            .sum()
    }

    /// The two moments of variable `i` in f32, in its shape.
    fn moments_f32(&self, i: usize) -> Result<(Tensor, Tensor)> {
        let shape = self.vars[i].1.shape();
        Ok(match &self.moments[i] {
            Moments::Full { m, v } => (m.to_dtype(DType::F32)?, v.to_dtype(DType::F32)?),
            Moments::Int8 { m, v } => {
                let (sm, um) = self.maps_or_err()?;
                (dequantize(m, sm, shape)?, dequantize(v, um, shape)?)
            }
        })
    }

    /// Stores f32 moments `m`, `v` of variable `i` in its kind and dtype.
    fn store_moments(&mut self, i: usize, m: &Tensor, v: &Tensor) -> Result<()> {
        let next = match &self.moments[i] {
            Moments::Full { m: old, .. } => Moments::Full {
                m: m.to_dtype(old.dtype())?,
                v: v.to_dtype(old.dtype())?,
            },
            Moments::Int8 { .. } => {
                let (sm, um) = self.maps_or_err()?;
                Moments::Int8 {
                    m: quantize(m, sm)?,
                    v: quantize(v, um)?,
                }
            }
        };
        self.moments[i] = next;
        Ok(())
    }

    fn maps_or_err(&self) -> Result<(&Tensor, &Tensor)> {
        match &self.maps {
            Some((s, u)) => Ok((s, u)),
            None => bail!("8-bit optimizer state without its maps"),
        }
    }

    /// The dtype gradients of variable `i` are summed in over micro-batches: f32, except for
    /// pure bf16 training, where it is bf16 (PyTorch accumulates `.grad` in the parameter's
    /// dtype) — half the memory of an f32 sum.
    fn sum_dtype(&self, i: usize) -> DType {
        self.sums[i]
    }

    /// [`accumulate`] in each variable's sum dtype ([`Self::with_master_weights`] says which).
    pub fn accumulate(&self, acc: &mut HashMap<String, Tensor>, grads: &GradStore) -> Result<()> {
        for (i, (name, var)) in self.vars.iter().enumerate() {
            if let Some(g) = grads.get(var.as_tensor()) {
                // Detached: the moments are built from these sums, and a gradient carrying a
                // graph would chain them (and what that graph holds) from step to step.
                let g = g.detach().to_dtype(self.sum_dtype(i))?;
                let sum = match acc.remove(name) {
                    Some(prev) => (prev.to_dtype(g.dtype())? + g)?,
                    None => g,
                };
                acc.insert(name.clone(), sum);
            }
        }
        Ok(())
    }

    /// Optimizer steps taken.
    pub fn step_count(&self) -> usize {
        self.step
    }

    /// The variables, in order.
    pub fn vars(&self) -> &[(String, Var)] {
        &self.vars
    }

    /// One update with learning rate `lr` from `grads` (missing gradients count as zero, as
    /// PyTorch skips parameters whose `.grad` is None; we skip them too).
    pub fn step(&mut self, grads: &HashMap<String, Tensor>, lr: f64) -> Result<()> {
        self.step += 1;
        let p = self.params;
        let t = self.step as i32;
        let bc1 = 1.0 - p.beta1.powi(t);
        let bc2 = 1.0 - p.beta2.powi(t);
        for i in 0..self.vars.len() {
            let (name, var) = &self.vars[i];
            let Some(g) = grads.get(name) else { continue };
            let g = g.to_dtype(DType::F32)?;
            let (m, v) = self.moments_f32(i)?;
            let m = ((m * p.beta1)? + (&g * (1.0 - p.beta1))?)?;
            let v = ((v * p.beta2)? + (g.sqr()? * (1.0 - p.beta2))?)?;
            let w = match &self.master[i] {
                Some(w) => w.clone(),
                None => var.as_tensor().to_dtype(DType::F32)?,
            };
            // PyTorch: p ← p·(1 − lr·wd); p ← p − lr/bc1 · m / (sqrt(v)/sqrt(bc2) + ε)
            let w = if p.weight_decay != 0.0 && self.decay[i] {
                (w * (1.0 - lr * p.weight_decay))?
            } else {
                w
            };
            let denom = ((v.sqrt()? / bc2.sqrt())? + p.eps)?;
            let upd = ((&m / denom)? * (lr / bc1))?;
            let w = (w - upd)?;
            var.set(&w.to_dtype(var.dtype())?)?;
            if self.master[i].is_some() {
                self.master[i] = Some(w);
            }
            self.store_moments(i, &m, &v)?;
        }
        Ok(())
    }

    /// Writes the moments and step to a safetensors file.
    pub fn save(&self, path: &Path) -> Result<()> {
        save_state(&self.state()?, path)
    }

    /// The moments, master weights and step as named tensors (what [`AdamW::save`] writes).
    /// They are never written in place, so the map stays this step's state while training
    /// goes on: a checkpoint writer can save it on another thread.
    pub fn state(&self) -> Result<HashMap<String, Tensor>> {
        let mut map: HashMap<String, Tensor> = HashMap::new();
        for (i, (name, _)) in self.vars.iter().enumerate() {
            match &self.moments[i] {
                Moments::Full { m, v } => {
                    map.insert(format!("{name}.exp_avg"), m.clone());
                    map.insert(format!("{name}.exp_avg_sq"), v.clone());
                }
                Moments::Int8 { m, v } => {
                    for (key, q) in [("exp_avg", m), ("exp_avg_sq", v)] {
                        map.insert(format!("{name}.{key}.q8"), q.codes.clone());
                        map.insert(format!("{name}.{key}.absmax"), q.absmax.clone());
                    }
                }
            }
            if let Some(w) = &self.master[i] {
                map.insert(format!("{name}.master"), w.clone());
            }
        }
        map.insert(
            "__step__".into(),
            Tensor::new(&[self.step as i64], &candle_core::Device::Cpu)?,
        );
        Ok(map)
    }

    /// Restores moments and step saved by [`AdamW::save`] for the same variables.
    pub fn load(&mut self, path: &Path) -> Result<()> {
        let device = self
            .vars
            .first()
            .map(|(_, v)| v.device().clone())
            .unwrap_or(candle_core::Device::Cpu);
        let map = candle_core::safetensors::load(path, &device)
            .with_context(|| format!("{}: cannot read optimizer state", path.display()))?;
        for i in 0..self.vars.len() {
            let (m, v) = self.saved_moments(&map, i, path)?;
            self.restore(i, m, v)?;
            let (name, var) = &self.vars[i];
            if self.master[i].is_some() {
                // A checkpoint without masters (saved without mixed precision): start them
                // from the weights.
                self.master[i] = Some(match map.get(&format!("{name}.master")) {
                    Some(w) => w.to_dtype(DType::F32)?,
                    None => var.as_tensor().to_dtype(DType::F32)?,
                });
            }
        }
        let step = map
            .get("__step__")
            .with_context(|| format!("{}: no `__step__`", path.display()))?
            .to_dtype(DType::I64)?
            .to_vec1::<i64>()?;
        self.step = step.first().copied().unwrap_or(0).max(0) as usize;
        Ok(())
    }
}

/// Whether weight decay applies to the parameter `name` (transformers' names), as transformers'
/// `Trainer` groups parameters for its optimizer (`get_decay_parameter_names`): not to a name
/// that, lowercased, contains `bias`, `layernorm` or `rmsnorm`, has a `norm` component, or a
/// component ending in `_norm` — biases and every normalisation weight (`input_layernorm`,
/// `model.norm`, Qwen3's `q_norm` / `k_norm`, a LoRA adapter's `lora_B.bias`) — and to every
/// other one (the projections, the embeddings, LoRA's factors and DoRA's magnitudes).
pub fn decays(name: &str) -> bool {
    let n = name.to_lowercase();
    let parts: Vec<&str> = n.split('.').collect();
    !(n.contains("bias")
        || n.contains("layernorm")
        || n.contains("rmsnorm")
        || parts.iter().any(|p| *p == "norm" || p.ends_with("_norm")))
}

/// A moment as a checkpoint holds it.
enum Saved {
    /// A tensor of the variable's shape.
    Full(Tensor),
    /// 8-bit blockwise, and whether on the signed map.
    Q8(Blockwise, bool),
}

impl AdamW {
    /// Variable `i`'s two moments as a saved state holds them (checked against its shape).
    fn saved_moments(
        &self,
        map: &HashMap<String, Tensor>,
        i: usize,
        path: &Path,
    ) -> Result<(Saved, Saved)> {
        let (name, var) = &self.vars[i];
        let mut out = Vec::with_capacity(2);
        for (key, signed) in [("exp_avg", true), ("exp_avg_sq", false)] {
            let full = format!("{name}.{key}");
            if let Some(t) = map.get(&full) {
                if t.dims() != var.dims() {
                    bail!(
                        "{}: `{full}` has shape {:?}, the model's is {:?}",
                        path.display(),
                        t.dims(),
                        var.dims()
                    );
                }
                out.push(Saved::Full(t.clone()));
                continue;
            }
            let q8 = format!("{full}.q8");
            let amax = format!("{full}.absmax");
            let (Some(codes), Some(absmax)) = (map.get(&q8), map.get(&amax)) else {
                bail!(
                    "{}: no `{full}` (a checkpoint of another model?)",
                    path.display()
                );
            };
            let blocks = var.elem_count().div_ceil(grpo_core::quant::BLOCK);
            if codes.dims() != [blocks * grpo_core::quant::BLOCK] || absmax.dims() != [blocks] {
                bail!(
                    "{}: `{q8}` / `{amax}` have shapes {:?} / {:?}; the model's {:?} needs [{}] / [{blocks}]",
                    path.display(),
                    codes.dims(),
                    absmax.dims(),
                    var.dims(),
                    blocks * grpo_core::quant::BLOCK
                );
            }
            let q = Blockwise {
                codes: codes.to_dtype(DType::U8)?,
                absmax: absmax.to_dtype(DType::F32)?,
            };
            out.push(Saved::Q8(q, signed));
        }
        let v = out.pop().context("two moments")?;
        let m = out.pop().context("two moments")?;
        Ok((m, v))
    }

    /// Variable `i`'s moments from a checkpoint: 8-bit state into 8-bit state as it is (so a
    /// resumed run continues bit for bit), otherwise through f32 (a run may resume with
    /// another `optim`: f32 state quantized, 8-bit state dequantized).
    fn restore(&mut self, i: usize, m: Saved, v: Saved) -> Result<()> {
        if let (Moments::Int8 { .. }, Saved::Q8(qm, _), Saved::Q8(qv, _)) =
            (&self.moments[i], &m, &v)
        {
            self.moments[i] = Moments::Int8 {
                m: qm.clone(),
                v: qv.clone(),
            };
            return Ok(());
        }
        let shape = self.vars[i].1.shape().clone();
        let quantized = |s: &Saved| matches!(s, Saved::Q8(..));
        let int8 = matches!(self.moments[i], Moments::Int8 { .. });
        if self.maps.is_none() && (int8 || quantized(&m) || quantized(&v)) {
            self.maps = Some(maps(self.vars[i].1.device())?);
        }
        let mut f32s = Vec::with_capacity(2);
        for s in [m, v] {
            f32s.push(match s {
                Saved::Full(t) => t.to_dtype(DType::F32)?,
                Saved::Q8(q, signed) => {
                    let (sm, um) = self.maps_or_err()?;
                    dequantize(&q, if signed { sm } else { um }, &shape)?
                }
            });
        }
        self.store_moments(i, &f32s[0], &f32s[1])
    }
}

/// bitsandbytes' signed and unsigned dynamic maps on `device`.
fn maps(device: &candle_core::Device) -> Result<(Tensor, Tensor)> {
    let map = |signed| Tensor::new(grpo_core::quant::dynamic_map(signed).as_slice(), device);
    Ok((map(true)?, map(false)?))
}

/// Writes an optimizer state ([`AdamW::state`]) to a safetensors file.
pub fn save_state(state: &HashMap<String, Tensor>, path: &Path) -> Result<()> {
    candle_core::safetensors::save(state, path)
        .with_context(|| format!("{}: cannot write optimizer state", path.display()))
}

fn is_half(d: DType) -> bool {
    matches!(d, DType::BF16 | DType::F16)
}

/// Sums gradients of `vars` from several backward passes (accumulation), in f32.
pub fn accumulate(
    acc: &mut HashMap<String, Tensor>,
    vars: &[(String, Var)],
    grads: &GradStore,
) -> Result<()> {
    for (name, var) in vars {
        if let Some(g) = grads.get(var.as_tensor()) {
            let g = g.detach().to_dtype(DType::F32)?;
            let sum = match acc.remove(name) {
                Some(prev) => (prev + g)?,
                None => g,
            };
            acc.insert(name.clone(), sum);
        }
    }
    Ok(())
}

/// Global L2 norm of the gradients; when `max_norm > 0` and the norm exceeds it, scales them
/// by `max_norm / (norm + 1e-6)` (PyTorch's `clip_grad_norm_`). Returns the norm before
/// clipping. The squares are summed in the order of the names, not the map's (random) order,
/// so that identical runs give identical norms to the bit.
pub fn clip_grad_norm(grads: &mut HashMap<String, Tensor>, max_norm: f64) -> Result<f64> {
    let mut names: Vec<&String> = grads.keys().collect();
    names.sort();
    if names.is_empty() {
        return Ok(0.0);
    }
    // Each tensor's sum of squares stays on the device; they are added in name order (so a
    // run is reproducible to the bit) and the total crosses to the host once. Half-precision
    // gradients (pure bf16 sums them in bf16) are squared and summed in f32.
    let sums = names
        .into_iter()
        .map(|n| {
            let g = &grads[n];
            let g = match is_half(g.dtype()) {
                true => g.to_dtype(DType::F32)?,
                false => g.clone(),
            };
            g.sqr()?.sum_all()?.to_dtype(DType::F64)
        })
        .collect::<candle_core::Result<Vec<_>>>()?;
    let total = Tensor::stack(&sums, 0)?.sum_all()?.to_scalar::<f64>()?;
    let norm = total.sqrt();
    if max_norm > 0.0 && norm.is_finite() {
        let coef = max_norm / (norm + 1e-6);
        if coef < 1.0 {
            for g in grads.values_mut() {
                *g = (&*g * coef)?;
            }
        }
    }
    Ok(norm)
}

/// The learning-rate schedule.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    /// The shape, as `transformers`' `get_scheduler` names it.
    pub kind: ScheduleKind,
    /// Peak learning rate.
    pub lr: f64,
    /// Warm-up steps.
    pub warmup: usize,
    /// Total optimizer steps.
    pub total: usize,
    /// The shape's own parameters (`optim.lr_scheduler_kwargs`).
    pub kwargs: ScheduleKwargs,
}

/// Schedule shapes (`optim.lr_scheduler_type`, `transformers`' `SchedulerType` names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ScheduleKind {
    /// Flat, no warm-up (transformers' `constant` ignores the warm-up too).
    Constant,
    /// Warm-up then flat.
    ConstantWithWarmup,
    /// Warm-up then linear decay to 0 at `total`.
    Linear,
    /// Warm-up then a cosine to 0 at `total` (`num_cycles` waves, default half of one).
    Cosine,
    /// Warm-up then `num_cycles` (default 1) cosines from the peak to 0, each restarting hard.
    CosineWithRestarts,
    /// Warm-up then `(lr − lr_end) · remaining^power + lr_end` (defaults 1e-7 and 1).
    Polynomial,
    /// Warm-up then `1 / sqrt((step + timescale − warmup) / timescale)` (timescale: the
    /// warm-up, or 10,000 without one).
    InverseSqrt,
    /// As `cosine`, to `min_lr` (or `min_lr_rate` × the peak) instead of 0.
    CosineWithMinLr,
    /// Warm-up, `num_stable_steps` flat, then `num_decay_steps` of decay to `min_lr_ratio` ×
    /// the peak (`warmup_type`, `decay_type`: linear, cosine or 1-sqrt).
    WarmupStableDecay,
}

impl ScheduleKind {
    /// transformers' spelling.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Constant => "constant",
            Self::ConstantWithWarmup => "constant_with_warmup",
            Self::Linear => "linear",
            Self::Cosine => "cosine",
            Self::CosineWithRestarts => "cosine_with_restarts",
            Self::Polynomial => "polynomial",
            Self::InverseSqrt => "inverse_sqrt",
            Self::CosineWithMinLr => "cosine_with_min_lr",
            Self::WarmupStableDecay => "warmup_stable_decay",
        }
    }
}

/// `optim.lr_scheduler_kwargs` (TRL's / transformers' `lr_scheduler_kwargs`): each shape's
/// own parameters, by transformers' names. A key the chosen shape does not take is refused.
#[derive(Debug, Clone, Default, PartialEq, serde::Serialize, serde::Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct ScheduleKwargs {
    /// cosine, cosine_with_min_lr, warmup_stable_decay (0.5); cosine_with_restarts (1).
    pub num_cycles: Option<f64>,
    /// polynomial: the final learning rate (1e-7).
    pub lr_end: Option<f64>,
    /// polynomial: the power (1).
    pub power: Option<f64>,
    /// inverse_sqrt: the time scale.
    pub timescale: Option<usize>,
    /// cosine_with_min_lr: the floor, absolute.
    pub min_lr: Option<f64>,
    /// cosine_with_min_lr: the floor as a fraction of the peak.
    pub min_lr_rate: Option<f64>,
    /// warmup_stable_decay: decay steps (required).
    pub num_decay_steps: Option<usize>,
    /// warmup_stable_decay: flat steps (default: what warm-up and decay leave of the total).
    pub num_stable_steps: Option<usize>,
    /// warmup_stable_decay: linear (default), cosine or 1-sqrt.
    pub warmup_type: Option<String>,
    /// warmup_stable_decay: cosine (default), linear or 1-sqrt.
    pub decay_type: Option<String>,
    /// warmup_stable_decay: the floor as a fraction of the peak (0).
    pub min_lr_ratio: Option<f64>,
}

impl ScheduleKwargs {
    /// The keys given, with transformers' names.
    fn given(&self) -> Vec<&'static str> {
        let mut out = Vec::new();
        let mut add = |set: bool, name| {
            if set {
                out.push(name);
            }
        };
        add(self.num_cycles.is_some(), "num_cycles");
        add(self.lr_end.is_some(), "lr_end");
        add(self.power.is_some(), "power");
        add(self.timescale.is_some(), "timescale");
        add(self.min_lr.is_some(), "min_lr");
        add(self.min_lr_rate.is_some(), "min_lr_rate");
        add(self.num_decay_steps.is_some(), "num_decay_steps");
        add(self.num_stable_steps.is_some(), "num_stable_steps");
        add(self.warmup_type.is_some(), "warmup_type");
        add(self.decay_type.is_some(), "decay_type");
        add(self.min_lr_ratio.is_some(), "min_lr_ratio");
        out
    }
}

/// The three curves of warmup_stable_decay.
fn wsd_curve(name: &str, progress: f64, warmup: bool) -> f64 {
    use std::f64::consts::PI;
    match (name, warmup) {
        ("cosine", true) => 0.5 * (1.0 - (PI * progress).cos()),
        ("1-sqrt", true) => 1.0 - (1.0 - progress).sqrt(),
        ("linear", true) => progress,
        ("linear", false) => 1.0 - progress,
        ("1-sqrt", false) => 1.0 - progress.sqrt(),
        _ => f64::NAN, // "cosine" decay is computed by the caller (it takes num_cycles)
    }
}

impl Schedule {
    /// Checks `kwargs` against the shape and the peak learning rate, naming the key to fix.
    pub fn validate(&self) -> std::result::Result<(), String> {
        let k = &self.kwargs;
        let takes: &[&str] = match self.kind {
            ScheduleKind::Constant | ScheduleKind::ConstantWithWarmup | ScheduleKind::Linear => &[],
            ScheduleKind::Cosine | ScheduleKind::CosineWithRestarts => &["num_cycles"],
            ScheduleKind::Polynomial => &["lr_end", "power"],
            ScheduleKind::InverseSqrt => &["timescale"],
            ScheduleKind::CosineWithMinLr => &["num_cycles", "min_lr", "min_lr_rate"],
            ScheduleKind::WarmupStableDecay => &[
                "num_decay_steps",
                "num_stable_steps",
                "warmup_type",
                "decay_type",
                "min_lr_ratio",
                "num_cycles",
            ],
        };
        if let Some(bad) = k.given().into_iter().find(|g| !takes.contains(g)) {
            return Err(format!(
                "`optim.lr_scheduler_kwargs.{bad}` does not apply to lr_scheduler_type = \"{}\"{}",
                self.kind.as_str(),
                match takes.is_empty() {
                    true => " (it takes no kwargs)".to_string(),
                    false => format!(" (it takes {})", takes.join(", ")),
                }
            ));
        }
        if self.kind == ScheduleKind::Constant && self.warmup > 0 {
            return Err(
                "`optim.lr_scheduler_type = \"constant\"` has no warm-up (as in \
                        transformers, which ignores it): use \"constant_with_warmup\", or set \
                        `warmup_ratio` and `warmup_steps` to 0"
                    .into(),
            );
        }
        match self.kind {
            ScheduleKind::Polynomial => {
                let end = k.lr_end.unwrap_or(1e-7);
                if end >= self.lr {
                    return Err(format!(
                        "`optim.lr_scheduler_kwargs.lr_end` ({end}) must be below the learning rate ({})",
                        self.lr
                    ));
                }
            }
            ScheduleKind::CosineWithMinLr => {
                match (k.min_lr, k.min_lr_rate) {
                    (Some(_), Some(_)) => {
                        return Err("`optim.lr_scheduler_kwargs`: set one of min_lr and min_lr_rate, not both".into());
                    }
                    (None, None) => {
                        return Err("lr_scheduler_type = \"cosine_with_min_lr\" needs \
                                `optim.lr_scheduler_kwargs.min_lr` or `min_lr_rate`"
                            .into());
                    }
                    _ => {}
                }
            }
            ScheduleKind::WarmupStableDecay => {
                if k.num_decay_steps.is_none() {
                    return Err("lr_scheduler_type = \"warmup_stable_decay\" needs \
                                `optim.lr_scheduler_kwargs.num_decay_steps`"
                        .into());
                }
                for (key, v) in [
                    ("warmup_type", &k.warmup_type),
                    ("decay_type", &k.decay_type),
                ] {
                    if let Some(v) = v
                        && !["linear", "cosine", "1-sqrt"].contains(&v.as_str())
                    {
                        return Err(format!(
                            "`optim.lr_scheduler_kwargs.{key}` must be linear, cosine or 1-sqrt, got {v:?}"
                        ));
                    }
                }
            }
            _ => {}
        }
        Ok(())
    }

    /// The learning rate for optimizer step `step` (0-based), as the HF `LambdaLR` of
    /// `transformers.get_scheduler(kind, warmup, total, **kwargs)` gives it.
    pub fn lr_at(&self, step: usize) -> f64 {
        use std::f64::consts::PI;
        let s = step as f64;
        let k = &self.kwargs;
        let (w, total) = (self.warmup as f64, self.total as f64);
        let ramp = || s / w.max(1.0);
        let span = (total - w).max(1.0);
        let progress = (s - w) / span;
        let cosine = |cycles: f64| 0.5 * (1.0 + (PI * cycles * 2.0 * progress).cos());
        let f = match self.kind {
            ScheduleKind::Constant => 1.0,
            _ if self.kind != ScheduleKind::WarmupStableDecay && step < self.warmup => ramp(),
            ScheduleKind::ConstantWithWarmup => 1.0,
            ScheduleKind::Linear => ((total - s) / span).max(0.0),
            ScheduleKind::Cosine => cosine(k.num_cycles.unwrap_or(0.5)).max(0.0),
            ScheduleKind::CosineWithRestarts => {
                if progress >= 1.0 {
                    0.0
                } else {
                    let cycles = k.num_cycles.unwrap_or(1.0).trunc();
                    (0.5 * (1.0 + (PI * ((cycles * progress) % 1.0)).cos())).max(0.0)
                }
            }
            ScheduleKind::Polynomial => {
                let end = k.lr_end.unwrap_or(1e-7);
                if s > total {
                    end / self.lr
                } else {
                    let remaining = 1.0 - (s - w) / (total - w).max(1.0);
                    ((self.lr - end) * remaining.powf(k.power.unwrap_or(1.0)) + end) / self.lr
                }
            }
            ScheduleKind::InverseSqrt => {
                let t = k
                    .timescale
                    .unwrap_or(if self.warmup > 0 { self.warmup } else { 10_000 })
                    as f64;
                1.0 / ((s + t - w) / t).sqrt()
            }
            ScheduleKind::CosineWithMinLr => {
                let rate = k
                    .min_lr_rate
                    .unwrap_or_else(|| k.min_lr.unwrap_or(0.0) / self.lr);
                (cosine(k.num_cycles.unwrap_or(0.5)) * (1.0 - rate) + rate).max(0.0)
            }
            ScheduleKind::WarmupStableDecay => {
                let decay = k.num_decay_steps.unwrap_or(0);
                let stable = k
                    .num_stable_steps
                    .unwrap_or_else(|| self.total.saturating_sub(self.warmup + decay));
                let floor = k.min_lr_ratio.unwrap_or(0.0);
                let warm = k.warmup_type.as_deref().unwrap_or("linear");
                let down = k.decay_type.as_deref().unwrap_or("cosine");
                if step < self.warmup {
                    let p = ramp();
                    (wsd_curve(warm, p, true) * (1.0 - floor) + floor).max(0.0)
                } else if step < self.warmup + stable {
                    1.0
                } else if step < self.warmup + stable + decay {
                    let p = (s - w - stable as f64) / (decay.max(1) as f64);
                    let c = match down {
                        "cosine" => {
                            0.5 * (1.0 + (PI * k.num_cycles.unwrap_or(0.5) * 2.0 * p).cos())
                        }
                        other => wsd_curve(other, p, false),
                    };
                    (c * (1.0 - floor) + floor).max(0.0)
                } else {
                    floor
                }
            }
        };
        self.lr * f
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::Device;

    /// PyTorch's AdamW defaults (β 0.9 / 0.999, ε 1e-8) with weight decay `wd`.
    fn torch_params(weight_decay: f64) -> AdamWParams {
        AdamWParams {
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay,
        }
    }

    /// Reference from PyTorch 2.x:
    /// ```python
    /// import torch
    /// p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0]))
    /// opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    /// for g in ([0.5, -1.0, 2.0], [0.1, 0.2, -0.3], [1.0, 1.0, 1.0]):
    ///     p.grad = torch.tensor(g); opt.step()
    /// print(p.tolist())
    /// ```
    #[test]
    fn adamw_matches_pytorch() {
        let dev = Device::Cpu;
        let var = Var::from_slice(&[1.0f32, -2.0, 3.0], 3, &dev).unwrap();
        let mut opt = AdamW::new(
            vec![("p".into(), var.clone())],
            AdamWParams {
                beta1: 0.9,
                beta2: 0.99,
                eps: 1e-8,
                weight_decay: 0.01,
            },
        )
        .unwrap();
        for g in [[0.5f32, -1.0, 2.0], [0.1, 0.2, -0.3], [1.0, 1.0, 1.0]] {
            let mut m = HashMap::new();
            m.insert("p".to_string(), Tensor::new(&g, &dev).unwrap());
            opt.step(&m, 0.1).unwrap();
        }
        let got = var.as_tensor().to_vec1::<f32>().unwrap();
        let want = REFERENCE_ADAMW;
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-5, "{got:?} vs {want:?}");
        }
    }

    const REFERENCE_ADAMW: [f32; 3] = [0.731_942_06, -1.859_604_2, 2.769_154];

    /// A bf16 gradient's norm is summed in f32: 4096 squares of 0.01 summed in bf16 would stop
    /// growing far below the true 0.4096 (bf16 keeps 8 bits of mantissa).
    #[test]
    fn the_norm_of_bf16_gradients_is_summed_in_f32() {
        let g = Tensor::full(0.01f32, 4096, &Device::Cpu)
            .unwrap()
            .to_dtype(DType::BF16)
            .unwrap();
        let mut grads = HashMap::from([("p".to_string(), g)]);
        let norm = clip_grad_norm(&mut grads, 0.0).unwrap();
        // 0.01 in bf16 is 0.010009765625.
        let want = (4096.0f64 * 0.010_009_765_625f64.powi(2)).sqrt();
        assert!((norm - want).abs() < 1e-6, "{norm} vs {want}");
    }

    /// Pure f16 keeps f32 moments: small gradients' second moments underflow f16 (1e-3² ·
    /// 0.001 is below its smallest subnormal), and with f16 moments the step would be
    /// m / ε ≈ 1e5 times the learning rate.
    #[test]
    fn pure_f16_steps_small_gradients_like_f32() {
        let dev = Device::Cpu;
        let params = torch_params(0.0);
        let init = [1.0f32, -2.0, 0.5, 3.0];
        let g = [1e-3f32, -2e-4, 5e-4, 1e-5];
        let run = |dt: DType| -> Vec<f32> {
            let var =
                Var::from_tensor(&Tensor::new(&init, &dev).unwrap().to_dtype(dt).unwrap()).unwrap();
            let mut opt = AdamW::new(vec![("p".into(), var.clone())], params).unwrap();
            for _ in 0..3 {
                let gt = Tensor::new(&g, &dev).unwrap().to_dtype(dt).unwrap();
                let store = (var.as_tensor() * &gt)
                    .unwrap()
                    .sum_all()
                    .unwrap()
                    .backward()
                    .unwrap();
                let mut acc = HashMap::new();
                opt.accumulate(&mut acc, &store).unwrap();
                opt.step(&acc, 1e-3).unwrap();
            }
            assert_eq!(opt.state().unwrap()["p.exp_avg_sq"].dtype(), DType::F32);
            let w = var.as_tensor().to_dtype(DType::F32).unwrap();
            w.to_vec1::<f32>().unwrap()
        };
        let (half, full) = (run(DType::F16), run(DType::F32));
        for (h, f) in half.iter().zip(&full) {
            // Three steps of ≈ 1e-3 each, to within f16's spacing at the weight.
            assert!(
                (h - f).abs() <= 2e-3 * f.abs().max(1.0),
                "{half:?} vs {full:?}"
            );
        }
    }

    /// Pure bf16 (no master weights) keeps its moments and gradient sums in bf16, as PyTorch's
    /// AdamW does for a bf16 parameter; reference from PyTorch 2.x on the CPU:
    /// ```python
    /// p = torch.nn.Parameter(torch.tensor([1.0, -2.0, 3.0, 0.015625, 7.5], dtype=torch.bfloat16))
    /// opt = torch.optim.AdamW([p], lr=0.1, betas=(0.9, 0.99), eps=1e-8, weight_decay=0.01)
    /// for g in ([0.5, -1.0, 2.0, 0.01, -3.0], [0.1, 0.2, -0.3, 0.02, 1.0],
    ///           [1.0, 1.0, 1.0, -0.5, 0.25]):
    ///     p.grad = torch.tensor(g, dtype=torch.bfloat16); opt.step()
    /// ```
    /// (PyTorch rounds to bf16 after each of its in-place ops, we after the f32 update: the
    /// results agree to a bf16 step.)
    #[test]
    fn pure_bf16_keeps_bf16_moments_as_pytorch() {
        let dev = Device::Cpu;
        let init = Tensor::new(&[1.0f32, -2.0, 3.0, 0.015625, 7.5], &dev).unwrap();
        let var = Var::from_tensor(&init.to_dtype(DType::BF16).unwrap()).unwrap();
        let params = AdamWParams {
            beta1: 0.9,
            beta2: 0.99,
            eps: 1e-8,
            weight_decay: 0.01,
        };
        let mut opt = AdamW::new(vec![("p".into(), var.clone())], params).unwrap();
        let grads = [
            [0.5f32, -1.0, 2.0, 0.01, -3.0],
            [0.1, 0.2, -0.3, 0.02, 1.0],
            [1.0, 1.0, 1.0, -0.5, 0.25],
        ];
        for g in grads {
            // Through `accumulate` (one micro-batch): the sum stays bf16.
            let gt = Tensor::new(&g, &dev)
                .unwrap()
                .to_dtype(DType::BF16)
                .unwrap();
            let store = (var.as_tensor() * &gt)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let mut acc = HashMap::new();
            opt.accumulate(&mut acc, &store).unwrap();
            assert_eq!(acc["p"].dtype(), DType::BF16);
            opt.step(&acc, 0.1).unwrap();
        }
        let state = opt.state().unwrap();
        assert_eq!(state["p.exp_avg"].dtype(), DType::BF16);
        assert_eq!(state["p.exp_avg_sq"].dtype(), DType::BF16);
        let f = |t: &Tensor| t.to_dtype(DType::F32).unwrap().to_vec1::<f32>().unwrap();
        let close = |got: &[f32], want: &[f32]| {
            for (a, b) in got.iter().zip(want) {
                assert!(
                    (a - b).abs() <= 1e-2 * b.abs().max(0.05),
                    "{got:?} vs {want:?}"
                );
            }
        };
        close(
            &f(var.as_tensor()),
            &[0.730_468_75, -1.859_375, 2.781_25, -0.119_628_906, 7.656_25],
        );
        close(
            &f(&state["p.exp_avg"]),
            &[
                0.149_414_06,
                0.036_621_094,
                0.235_351_56,
                -0.047_363_28,
                -0.128_906_25,
            ],
        );
        close(
            &f(&state["p.exp_avg_sq"]),
            &[
                0.012_573_242,
                0.020_141_602,
                0.050_048_828,
                0.002_502_441,
                0.098_144_53,
            ],
        );
        // Mixed precision keeps them in f32.
        let mixed = AdamW::new(vec![("p".into(), var.clone())], params)
            .unwrap()
            .with_master_weights()
            .unwrap();
        assert_eq!(mixed.state().unwrap()["p.exp_avg"].dtype(), DType::F32);
    }

    /// Mixed precision: a bf16 variable with an f32 master follows the f32 trajectory (to bf16
    /// rounding), where pure bf16 loses updates below its spacing; the master survives a save
    /// and load.
    #[test]
    fn master_weights_keep_small_updates_and_round_trip() {
        let dev = Device::Cpu;
        let params = torch_params(0.0);
        let init = [1.0f32, -2.0, 300.0];
        let make = |dtype: DType| {
            Var::from_tensor(&Tensor::new(&init, &dev).unwrap().to_dtype(dtype).unwrap()).unwrap()
        };
        let (f32v, pure, mixed) = (make(DType::F32), make(DType::BF16), make(DType::BF16));
        let mut o32 = AdamW::new(vec![("p".into(), f32v.clone())], params).unwrap();
        let mut opure = AdamW::new(vec![("p".into(), pure.clone())], params).unwrap();
        let mut omix = AdamW::new(vec![("p".into(), mixed.clone())], params)
            .unwrap()
            .with_master_weights()
            .unwrap();
        let dir = tempfile::tempdir().unwrap();
        for step in 0..200 {
            let g = Tensor::new(&[0.3f32, -0.7, 1.0], &dev).unwrap();
            for o in [&mut o32, &mut opure, &mut omix] {
                let mut m = HashMap::new();
                m.insert("p".to_string(), g.to_dtype(o.vars()[0].1.dtype()).unwrap());
                o.step(&m, 1e-4).unwrap();
            }
            if step == 100 {
                // Save and reload into a fresh optimizer: the master comes back.
                let p = dir.path().join("opt.safetensors");
                omix.save(&p).unwrap();
                let mut fresh = AdamW::new(vec![("p".into(), mixed.clone())], params)
                    .unwrap()
                    .with_master_weights()
                    .unwrap();
                fresh.load(&p).unwrap();
                omix = fresh;
            }
        }
        let f = |v: &Var| {
            v.as_tensor()
                .to_dtype(DType::F32)
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let (a, b, c) = (f(&f32v), f(&pure), f(&mixed));
        // 200 steps of ~1e-4 moved the f32 weights by ~0.02; 300 in bf16 has spacing 2.
        assert!((a[2] - 300.0).abs() > 0.01, "{a:?}");
        assert_eq!(b[2], 300.0, "pure bf16 should lose the updates: {b:?}");
        for (x, y) in a.iter().zip(&c) {
            assert!((x - y).abs() <= x.abs() * 8e-3, "mixed {c:?} vs f32 {a:?}");
        }
        let master = omix.master[0].as_ref().unwrap().to_vec1::<f32>().unwrap();
        for (x, y) in a.iter().zip(&master) {
            assert!((x - y).abs() < 1e-5, "master {master:?} vs f32 {a:?}");
        }
    }

    /// bitsandbytes 0.50.2's `AdamW(optim_bits=8)` on the CPU, three steps, with its CPU
    /// table quantizer replaced by the nearest-entry rule (its CUDA kernel's, and ours; see
    /// `scripts/gen_adamw8bit_reference.py`): its maps to the bit, its parameters to f32
    /// rounding, and its 8-bit state (bytes and block maxima); the small parameter in 32 bits.
    #[test]
    fn adamw_8bit_matches_bitsandbytes() {
        let r: serde_json::Value =
            serde_json::from_str(include_str!("../tests/fixtures/adamw8bit_reference.json"))
                .unwrap();
        let floats = |v: &serde_json::Value| -> Vec<f32> {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_f64().unwrap() as f32)
                .collect()
        };
        for (key, signed) in [("signed_map", true), ("unsigned_map", false)] {
            let want = floats(&r[key]);
            let got = grpo_core::quant::dynamic_map(signed);
            assert_eq!(
                got.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                want.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
                "{key}"
            );
        }
        let dev = Device::Cpu;
        let params = AdamWParams {
            beta1: r["betas"][0].as_f64().unwrap(),
            beta2: r["betas"][1].as_f64().unwrap(),
            eps: r["eps"].as_f64().unwrap(),
            weight_decay: r["weight_decay"].as_f64().unwrap(),
        };
        // The script's integer formulas, in the same f64 arithmetic then rounded to f32.
        let initial = |n: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7919 + salt) % 2001) as f64 - 1000.0) / 1000.0)
                .map(|x| x as f32)
                .collect()
        };
        let grad = |n: usize, step: usize, salt: usize| -> Vec<f32> {
            (0..n)
                .map(|i| {
                    let u = (((i * 104729 + step * 7727 + salt) % 4001) as f64 - 2000.0) / 2000.0;
                    let scale = match (i * 31 + step) % 97 {
                        0 => 10.0,
                        _ => 0.01 * (1 + i % 5) as f64,
                    };
                    (u * scale) as f32
                })
                .collect()
        };
        let mut vars = Vec::new();
        for name in ["big", "small"] {
            let p = &r["params"][name];
            let shape: Vec<usize> = p["shape"]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as usize)
                .collect();
            let salt = p["salt"].as_u64().unwrap() as usize;
            let n = shape.iter().product();
            let t = Tensor::from_vec(initial(n, salt), shape.as_slice(), &dev).unwrap();
            vars.push((name.to_string(), Var::from_tensor(&t).unwrap(), n, salt));
        }
        let named = vars
            .iter()
            .map(|(n, v, ..)| (n.clone(), v.clone()))
            .collect();
        let mut opt = AdamW::new(named, params)
            .unwrap()
            .with_8bit_states(|_| false)
            .unwrap();
        // The small one keeps 32-bit moments, as bitsandbytes' min_8bit_size says.
        assert!(matches!(opt.moments[0], Moments::Int8 { .. }));
        assert!(matches!(opt.moments[1], Moments::Full { .. }));
        let lr = r["lr"].as_f64().unwrap();
        for step in 1..=r["steps"].as_u64().unwrap() as usize {
            let mut g = HashMap::new();
            for (name, var, n, salt) in &vars {
                let t = Tensor::from_vec(grad(*n, step, *salt), var.shape(), &dev).unwrap();
                g.insert(name.clone(), t);
            }
            opt.step(&g, lr).unwrap();
        }
        for (name, var, ..) in &vars {
            let want = floats(&r["params"][name]["final"]);
            let got: Vec<f32> = var.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            let worst = got
                .iter()
                .zip(&want)
                .map(|(a, b)| (a - b).abs())
                .fold(0f32, f32::max);
            // Three steps of at most lr (1e-3) each: equal up to f32 rounding.
            assert!(worst < 5e-7, "{name}: parameters differ by up to {worst}");
        }
        // The 8-bit state: the same block maxima and bytes.
        let Moments::Int8 { m, v } = &opt.moments[0] else {
            unreachable!()
        };
        let st = &r["big_state"];
        for (q, codes, absmax) in [(m, "m_codes", "m_absmax"), (v, "v_codes", "v_absmax")] {
            let want_a = floats(&st[absmax]);
            let got_a: Vec<f32> = q.absmax.to_vec1().unwrap();
            for (a, b) in got_a.iter().zip(&want_a) {
                assert!(
                    (a - b).abs() <= 1e-6 * b.abs().max(1e-3),
                    "{absmax}: {a} vs {b}"
                );
            }
            let want_c: Vec<i64> = st[codes]
                .as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_i64().unwrap())
                .collect();
            let got_c: Vec<u8> = q.codes.to_vec1().unwrap();
            let n = want_c.len();
            let got_c: Vec<i64> = got_c[..n].iter().map(|b| *b as i64).collect();
            assert_eq!(got_c, want_c, "{codes}");
        }
    }

    /// 8-bit state: about a quarter of f32's; a checkpoint restores it to the bit (a resumed
    /// run continues exactly), and a run may resume across `optim` kinds.
    #[test]
    fn adamw_8bit_state_is_small_and_resumes_exactly() {
        let dev = Device::Cpu;
        let params = torch_params(0.0);
        let init: Vec<f32> = (0..5000)
            .map(|i| ((i * 37) % 101) as f32 / 50.0 - 1.0)
            .collect();
        let mk = |eight: bool| {
            let v = Var::from_tensor(&Tensor::from_vec(init.clone(), (50, 100), &dev).unwrap())
                .unwrap();
            let o = AdamW::new(vec![("w".into(), v.clone())], params).unwrap();
            let o = match eight {
                true => o.with_8bit_states(|_| false).unwrap(),
                false => o,
            };
            (v, o)
        };
        let grad = |s: usize| {
            let g: Vec<f32> = (0..5000)
                .map(|i| (((i * 13 + s * 7) % 97) as f32 - 48.0) / 480.0)
                .collect();
            let mut m = HashMap::new();
            m.insert(
                "w".to_string(),
                Tensor::from_vec(g, (50, 100), &dev).unwrap(),
            );
            m
        };
        let (v8, mut o8) = mk(true);
        let (_, mut o32) = mk(false);
        // 2 moments × 5,000 values: 40,000 bytes in f32, 2 × (5,120 + 20 × 4) in 8 bits.
        assert_eq!(o32.state_bytes(), 40_000);
        assert_eq!(o8.state_bytes(), 2 * (5_120 + 80));
        for s in 0..4 {
            o8.step(&grad(s), 1e-2).unwrap();
            o32.step(&grad(s), 1e-2).unwrap();
        }
        let dir = tempfile::tempdir().unwrap();
        let p8 = dir.path().join("o8.safetensors");
        let p32 = dir.path().join("o32.safetensors");
        o8.save(&p8).unwrap();
        o32.save(&p32).unwrap();
        let saved8 = o8.moments_f32(0).unwrap();
        let saved32 = o32.moments_f32(0).unwrap();
        // Resumed 8-bit: the same bits as going on.
        let (r8v, mut r8) = mk(true);
        r8v.set(v8.as_tensor()).unwrap();
        r8.load(&p8).unwrap();
        for s in 4..7 {
            o8.step(&grad(s), 1e-2).unwrap();
            r8.step(&grad(s), 1e-2).unwrap();
        }
        let bits = |v: &Var| -> Vec<u32> {
            let x: Vec<f32> = v.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
            x.iter().map(|f| f.to_bits()).collect()
        };
        assert_eq!(
            bits(&v8),
            bits(&r8v),
            "a resumed 8-bit run continues to the bit"
        );
        // The 8-bit run tracks the f32 one: the moments' rounding moves a weight by a small
        // part of the 4 steps' travel.
        let a: Vec<f32> = v8.as_tensor().flatten_all().unwrap().to_vec1().unwrap();
        let w32 = {
            let (w, mut o) = mk(false);
            for s in 0..7 {
                o.step(&grad(s), 1e-2).unwrap();
            }
            w.as_tensor()
                .flatten_all()
                .unwrap()
                .to_vec1::<f32>()
                .unwrap()
        };
        let worst = a
            .iter()
            .zip(&w32)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(
            worst < 0.07 * 7.0 * 1e-2,
            "8-bit vs f32 after 7 steps: {worst}"
        );
        // Across kinds: 8-bit state into an f32 optimizer (dequantized, the same values), f32
        // state into an 8-bit one (quantized: within each block's code spacing).
        let flat = |t: &Tensor| -> Vec<f32> { t.flatten_all().unwrap().to_vec1().unwrap() };
        let (_, mut x32) = mk(false);
        x32.load(&p8).unwrap();
        assert!(matches!(x32.moments[0], Moments::Full { .. }));
        let (m, v) = x32.moments_f32(0).unwrap();
        assert_eq!(flat(&m), flat(&saved8.0));
        assert_eq!(flat(&v), flat(&saved8.1));
        let (_, mut x8) = mk(true);
        x8.load(&p32).unwrap();
        assert!(matches!(x8.moments[0], Moments::Int8 { .. }));
        let (m, v) = x8.moments_f32(0).unwrap();
        for (got, want) in [(flat(&m), flat(&saved32.0)), (flat(&v), flat(&saved32.1))] {
            let top = want.iter().fold(0f32, |a, x| a.max(x.abs()));
            for (a, b) in got.iter().zip(&want) {
                assert!((a - b).abs() <= 0.008 * top, "{a} vs {b}");
            }
        }
        // A checkpoint of another shape names the tensor.
        let bad = AdamW::new(
            vec![(
                "w".into(),
                Var::from_tensor(&Tensor::zeros((60, 100), DType::F32, &dev).unwrap()).unwrap(),
            )],
            params,
        )
        .unwrap()
        .with_8bit_states(|_| false)
        .unwrap()
        .load(&p8)
        .unwrap_err()
        .to_string();
        assert!(bad.contains("w.exp_avg.q8"), "{bad}");
    }

    /// transformers' `get_decay_parameter_names` on Qwen3 / Llama / PEFT names (its regexes:
    /// `bias`, `layernorm`, `rmsnorm`, `(?:^|\.)norm(?:$|\.)`, `_norm(?:$|\.)`), and an update
    /// that decays only those.
    #[test]
    fn weight_decay_skips_biases_and_norms_as_transformers() {
        for (name, want) in [
            ("model.embed_tokens.weight", true),
            ("model.layers.0.self_attn.q_proj.weight", true),
            ("model.layers.0.self_attn.q_proj.bias", false),
            ("model.layers.0.input_layernorm.weight", false),
            ("model.layers.0.post_attention_layernorm.weight", false),
            ("model.layers.0.self_attn.q_norm.weight", false),
            ("model.layers.0.self_attn.k_norm.weight", false),
            ("model.norm.weight", false),
            ("lm_head.weight", true),
            (
                "base_model.model.model.layers.0.mlp.up_proj.lora_A.weight",
                true,
            ),
            (
                "base_model.model.model.layers.0.mlp.up_proj.lora_B.bias",
                false,
            ),
            (
                "base_model.model.model.layers.0.self_attn.v_proj.lora_magnitude_vector",
                true,
            ),
            ("score.weight", true),
            ("normalizer.weight", true),
        ] {
            assert_eq!(decays(name), want, "{name}");
        }
        let dev = Device::Cpu;
        let params = torch_params(0.5);
        let v = |x: f32| Var::from_tensor(&Tensor::new(&[x], &dev).unwrap()).unwrap();
        let (w, n) = (v(2.0), v(2.0));
        let mut o = AdamW::new(
            vec![
                ("model.layers.0.mlp.up_proj.weight".into(), w.clone()),
                ("model.norm.weight".into(), n.clone()),
            ],
            params,
        )
        .unwrap();
        let mut g = HashMap::new();
        for name in ["model.layers.0.mlp.up_proj.weight", "model.norm.weight"] {
            g.insert(name.to_string(), Tensor::new(&[0f32], &dev).unwrap());
        }
        o.step(&g, 0.1).unwrap();
        let at = |v: &Var| v.as_tensor().to_vec1::<f32>().unwrap()[0];
        // A zero gradient: only the decay moves a weight (2 · (1 − 0.1 · 0.5) = 1.9).
        assert!((at(&w) - 1.9).abs() < 1e-6, "{}", at(&w));
        assert_eq!(at(&n), 2.0);
    }

    #[test]
    fn schedules_match_transformers() {
        // transformers.get_linear_schedule_with_warmup(opt, 2, 10) and
        // get_cosine_schedule_with_warmup(opt, 2, 10): lr before each of steps 0..=10.
        let lin = Schedule {
            kind: ScheduleKind::Linear,
            lr: 1.0,
            warmup: 2,
            total: 10,
            kwargs: ScheduleKwargs::default(),
        };
        let got: Vec<f64> = (0..11).map(|s| lin.lr_at(s)).collect();
        let want = [
            0.0, 0.5, 1.0, 0.875, 0.75, 0.625, 0.5, 0.375, 0.25, 0.125, 0.0,
        ];
        for (a, b) in got.iter().zip(want) {
            assert!((a - b).abs() < 1e-12, "{got:?}");
        }
        let cos = Schedule {
            kind: ScheduleKind::Cosine,
            ..lin.clone()
        };
        let want_cos = [
            0.0,
            0.5,
            1.0,
            0.961_939_766_255_643_4,
            0.853_553_390_593_273_7,
            0.691_341_716_182_544_9,
            0.5,
            0.308_658_283_817_455_14,
            0.146_446_609_406_726_27,
            0.038_060_233_744_356_63,
            0.0,
        ];
        for (s, b) in want_cos.iter().enumerate() {
            assert!((cos.lr_at(s) - b).abs() < 1e-12, "cosine at {s}");
        }
        let c = Schedule {
            kind: ScheduleKind::ConstantWithWarmup,
            ..lin.clone()
        };
        assert_eq!(c.lr_at(1), 0.5);
        assert_eq!(c.lr_at(9), 1.0);
    }

    /// The other transformers shapes, at steps where their formulas give round values.
    #[test]
    fn every_transformers_schedule_shape() {
        let at = |kind, warmup, total, kwargs: ScheduleKwargs, steps: &[usize]| -> Vec<f64> {
            let s = Schedule {
                kind,
                lr: 2.0,
                warmup,
                total,
                kwargs,
            };
            s.validate().unwrap();
            steps.iter().map(|&t| s.lr_at(t)).collect()
        };
        let close = |got: Vec<f64>, want: &[f64], what: &str| {
            for (a, b) in got.iter().zip(want) {
                assert!((a - b).abs() < 1e-12, "{what}: {got:?} vs {want:?}");
            }
        };
        let kw = ScheduleKwargs::default;
        // constant: no warm-up at all.
        close(
            at(ScheduleKind::Constant, 0, 10, kw(), &[0, 5, 10]),
            &[2.0; 3],
            "constant",
        );
        // cosine with 1 cycle: back to the peak at the end.
        let one = ScheduleKwargs {
            num_cycles: Some(1.0),
            ..kw()
        };
        close(
            at(ScheduleKind::Cosine, 0, 8, one.clone(), &[0, 2, 4, 6, 8]),
            &[2.0, 1.0, 0.0, 1.0, 2.0],
            "cosine 1 cycle",
        );
        // cosine with 2 hard restarts over 8 steps after 2 of warm-up: peaks at 2 and 6.
        let two = ScheduleKwargs {
            num_cycles: Some(2.0),
            ..kw()
        };
        close(
            at(
                ScheduleKind::CosineWithRestarts,
                2,
                10,
                two,
                &[1, 2, 4, 6, 8, 10, 11],
            ),
            &[1.0, 2.0, 1.0, 2.0, 1.0, 0.0, 0.0],
            "cosine_with_restarts",
        );
        // polynomial, power 2, lr_end 0.5: (2 − 0.5)·r² + 0.5 with r the remaining fraction.
        let poly = ScheduleKwargs {
            power: Some(2.0),
            lr_end: Some(0.5),
            ..kw()
        };
        close(
            at(ScheduleKind::Polynomial, 2, 6, poly, &[1, 2, 4, 6, 9]),
            &[1.0, 2.0, 1.5 * 0.25 + 0.5, 0.5, 0.5],
            "polynomial",
        );
        // inverse_sqrt, warm-up 4 (the time scale): 1/sqrt(step/4) after it.
        close(
            at(ScheduleKind::InverseSqrt, 4, 100, kw(), &[2, 4, 16, 36]),
            &[1.0, 2.0, 1.0, 2.0 / 3.0],
            "inverse_sqrt",
        );
        // cosine_with_min_lr: half a cosine from 2 down to min_lr 0.5.
        let floor = ScheduleKwargs {
            min_lr: Some(0.5),
            ..kw()
        };
        close(
            at(ScheduleKind::CosineWithMinLr, 0, 4, floor, &[0, 2, 4]),
            &[2.0, 1.25, 0.5],
            "cosine_with_min_lr",
        );
        // warmup_stable_decay: 2 warm-up (linear from the floor), 3 flat, 4 linear decay to 0.25·peak.
        let wsd = ScheduleKwargs {
            num_decay_steps: Some(4),
            decay_type: Some("linear".into()),
            min_lr_ratio: Some(0.25),
            ..kw()
        };
        close(
            at(
                ScheduleKind::WarmupStableDecay,
                2,
                9,
                wsd,
                &[0, 1, 2, 4, 5, 7, 9, 12],
            ),
            &[0.5, 1.25, 2.0, 2.0, 2.0, 1.25, 0.5, 0.5],
            "warmup_stable_decay",
        );
        // What does not fit is refused, naming the key.
        let bad = |kind, warmup, kwargs| {
            Schedule {
                kind,
                lr: 1.0,
                warmup,
                total: 10,
                kwargs,
            }
            .validate()
            .unwrap_err()
        };
        assert!(bad(ScheduleKind::Linear, 0, one.clone()).contains("num_cycles"));
        assert!(bad(ScheduleKind::Constant, 3, kw()).contains("constant_with_warmup"));
        assert!(bad(ScheduleKind::CosineWithMinLr, 0, kw()).contains("min_lr"));
        assert!(bad(ScheduleKind::WarmupStableDecay, 0, kw()).contains("num_decay_steps"));
        let end = ScheduleKwargs {
            lr_end: Some(1.0),
            ..kw()
        };
        assert!(bad(ScheduleKind::Polynomial, 0, end).contains("lr_end"));
    }

    #[test]
    fn clipping_scales_to_the_max_norm() {
        let dev = Device::Cpu;
        let mut g = HashMap::new();
        g.insert("a".to_string(), Tensor::new(&[3.0f32, 0.0], &dev).unwrap());
        g.insert("b".to_string(), Tensor::new(&[4.0f32], &dev).unwrap());
        let n = clip_grad_norm(&mut g, 1.0).unwrap();
        assert!((n - 5.0).abs() < 1e-6);
        let a = g["a"].to_vec1::<f32>().unwrap();
        assert!((a[0] - 0.6).abs() < 1e-5);
    }

    /// The norm does not depend on the map's iteration order (each `HashMap` has its own random
    /// order): one large gradient among small ones whose squares vanish next to 1 in f64 when
    /// added after it, so every order would give different last bits.
    #[test]
    fn the_norm_is_the_same_to_the_bit_whatever_the_map_order() {
        let dev = Device::Cpu;
        let build = || {
            let mut g = HashMap::new();
            g.insert("z_big".to_string(), Tensor::new(&[1.0f32], &dev).unwrap());
            for i in 0..16 {
                g.insert(
                    format!("small_{i:02}"),
                    Tensor::new(&[1e-8f32], &dev).unwrap(),
                );
            }
            g
        };
        // In name order: the sixteen small squares first, then the large one.
        let small = f64::from(1e-8f32 * 1e-8f32);
        let want = ((0..16).fold(0f64, |t, _| t + small) + 1.0).sqrt();
        assert!(want > 1.0, "the small squares count when summed first");
        for _ in 0..32 {
            let n = clip_grad_norm(&mut build(), 0.0).unwrap();
            assert_eq!(n.to_bits(), want.to_bits(), "{n} vs {want}");
        }
    }
}
