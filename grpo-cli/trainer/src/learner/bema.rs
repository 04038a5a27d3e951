//! BEMA (TRL's `BEMACallback`; Block & Zhang, "EMA Without the Lag: Bias-Corrected Iterate
//! Averaging"): a bias-corrected exponential moving average of the trained weights, kept off the
//! training device (`bema.device`), written to `RUN/bema` when the run ends (a model directory,
//! or a PEFT adapter for LoRA) and, with `bema.update_ref_model`, put in the reference model's
//! place every `ref_model_update_freq` updates (TRL's experimental DPO callback). Its state is in
//! every checkpoint (`bema.safetensors`), so a resumed run averages as one that never stopped.

use std::collections::HashMap;
use std::path::PathBuf;

use anyhow::{Context, Result};
use candle_core::{DType, Device, Tensor, Var};
use grpo_rollout::Transformer;

use super::Learner;
use crate::config::BemaSection;

/// The checkpoint file of the BEMA state.
pub const BEMA_FILE: &str = "bema.safetensors";

/// The BEMA state: per trained weight `θ_0`, the EMA and the BEMA weights, in f32 (f64 for f64
/// models) on `bema.device`.
#[derive(Debug, Clone)]
pub struct Bema {
    cfg: BemaSection,
    device: Device,
    names: Vec<String>,
    theta0: Vec<Tensor>,
    ema: Vec<Tensor>,
    running: Vec<Tensor>,
}

/// A copy of `t` on `device` in `dtype` that later in-place updates of `t` do not reach.
fn owned_copy(t: &Tensor, device: &Device, dtype: DType) -> Result<Tensor> {
    let t = t.to_dtype(dtype)?;
    Ok(match t.device().same_device(device) {
        true => t.copy()?,
        false => t.to_device(device)?,
    })
}

impl Bema {
    /// The state at the start of training: `θ_0`, the EMA and the BEMA weights all the current
    /// weights `vars` (TRL's `on_train_begin`).
    pub fn start(cfg: &BemaSection, vars: &[(String, Var)]) -> Result<Self> {
        let device = cfg
            .device
            .device()
            .map_err(|e| anyhow::anyhow!("config: `bema.device`: {e}"))?;
        let dtype = match vars.first().map(|(_, v)| v.dtype()) {
            Some(DType::F64) => DType::F64,
            _ => DType::F32,
        };
        let theta0 = vars
            .iter()
            .map(|(_, v)| owned_copy(v.as_tensor(), &device, dtype))
            .collect::<Result<Vec<_>>>()?;
        Ok(Self {
            cfg: cfg.clone(),
            device,
            names: vars.iter().map(|(n, _)| n.clone()).collect(),
            ema: theta0.clone(),
            running: theta0.clone(),
            theta0,
        })
    }

    /// `lag + multiplier · t`.
    fn age(&self, t: usize) -> f64 {
        self.cfg.lag + self.cfg.multiplier * t as f64
    }

    /// The EMA's decay factor at update `t`: `max(age^−ema_power, min_ema_multiplier)`.
    pub fn beta(&self, t: usize) -> f64 {
        self.age(t)
            .powf(-self.cfg.ema_power)
            .max(self.cfg.min_ema_multiplier)
    }

    /// The bias correction's factor at update `t`: `age^−bias_power`.
    pub fn alpha(&self, t: usize) -> f64 {
        self.age(t).powf(-self.cfg.bias_power)
    }

    /// After optimizer update `step` (TRL's `global_step`) with weights `vars`: at
    /// `update_after` the snapshot of `θ_0` and the EMA; every `update_freq` updates past it
    /// the EMA and the BEMA weights. Returns whether the BEMA weights changed.
    pub fn after_update(&mut self, step: usize, vars: &[(String, Var)]) -> Result<bool> {
        let after = self.cfg.update_after;
        if step < after {
            return Ok(false);
        }
        let dtype = self.theta0.first().map_or(DType::F32, Tensor::dtype);
        if step == after {
            for (i, (_, v)) in vars.iter().enumerate() {
                let now = owned_copy(v.as_tensor(), &self.device, dtype)?;
                self.theta0[i] = now.clone();
                self.ema[i] = now;
            }
            return Ok(false);
        }
        if !(step - after).is_multiple_of(self.cfg.update_freq) {
            return Ok(false);
        }
        let (beta, alpha) = (self.beta(step), self.alpha(step));
        for (i, (_, v)) in vars.iter().enumerate() {
            let now = owned_copy(v.as_tensor(), &self.device, dtype)?;
            self.ema[i] = ((&self.ema[i] * (1.0 - beta))? + (&now * beta)?)?;
            self.running[i] = (&self.ema[i] + ((&now - &self.theta0[i])? * alpha)?)?;
        }
        Ok(true)
    }

    /// Whether the reference takes the BEMA weights after update `step`.
    pub fn reference_due(&self, step: usize) -> bool {
        let (after, freq) = (
            self.cfg.ref_model_update_after,
            self.cfg.ref_model_update_freq,
        );
        self.cfg.update_ref_model && step >= after && (step - after).is_multiple_of(freq)
    }

    /// The BEMA weights by the names of `vars` (the variables [`Self::start`] took, in
    /// order), each in its variable's dtype and on its device.
    pub fn weights_like(&self, vars: &[(String, Var)]) -> Result<HashMap<String, Tensor>> {
        self.running
            .iter()
            .zip(vars)
            .map(|(t, (n, v))| Ok((n.clone(), t.to_dtype(v.dtype())?.to_device(v.device())?)))
            .collect()
    }

    /// The whole state for a checkpoint: `theta0/NAME`, `ema/NAME`, `bema/NAME`.
    pub fn state(&self) -> HashMap<String, Tensor> {
        let mut out = HashMap::new();
        for (i, n) in self.names.iter().enumerate() {
            out.insert(format!("theta0/{n}"), self.theta0[i].clone());
            out.insert(format!("ema/{n}"), self.ema[i].clone());
            out.insert(format!("bema/{n}"), self.running[i].clone());
        }
        out
    }

    /// Restores [`Self::state`].
    pub fn restore(&mut self, map: &HashMap<String, Tensor>) -> Result<()> {
        for (i, n) in self.names.iter().enumerate() {
            let get = |k: String| -> Result<Tensor> {
                let t = map.get(&k).with_context(|| format!("no `{k}`"))?;
                Ok(t.to_device(&self.device)?)
            };
            self.theta0[i] = get(format!("theta0/{n}"))?;
            self.ema[i] = get(format!("ema/{n}"))?;
            self.running[i] = get(format!("bema/{n}"))?;
        }
        Ok(())
    }
}

impl Learner {
    /// After each optimizer update: the BEMA update, and the reference replaced when due.
    pub(crate) fn bema_after_update(&mut self) -> Result<()> {
        let step = self.state.optimizer_steps;
        let Some(b) = self.bema.as_mut() else {
            return Ok(());
        };
        b.after_update(step, self.opt.vars())?;
        if b.reference_due(step)
            && let Some(r) = &self.reference
        {
            let mut w: HashMap<String, Tensor> = r.weights().into_iter().collect();
            w.extend(b.weights_like(self.opt.vars())?);
            self.reference = Some(Transformer::from_weights_like(r, &w)?);
        }
        Ok(())
    }

    /// The BEMA model as a plain model (full fine-tuning) or the policy with the BEMA
    /// adapters (LoRA).
    fn bema_model(&self, b: &Bema) -> Result<Transformer> {
        let model = self.policy.model.detached();
        match &self.policy.lora {
            Some(cfg) => {
                let mut m = model;
                grpo_rollout::lora::set_factors(&mut m, cfg, &b.weights_like(self.opt.vars())?)?;
                Ok(m)
            }
            None => {
                let mut w: HashMap<String, Tensor> = model.weights().into_iter().collect();
                w.extend(b.weights_like(self.opt.vars())?);
                Ok(Transformer::from_weights_like(&model, &w)?)
            }
        }
    }

    /// Writes the BEMA model to `RUN/bema` (TRL's `on_train_end`): a model directory, or the
    /// adapter of a LoRA run. `None` without `[bema]`.
    pub fn save_bema(&self) -> Result<Option<PathBuf>> {
        let Some(b) = &self.bema else {
            return Ok(None);
        };
        let dir = self.run_dir.join("bema");
        let model = self.bema_model(b)?;
        match &self.policy.lora {
            Some(cfg) => grpo_rollout::lora::save_peft(&model, cfg, &dir, &self.base_model)?,
            None => grpo_rollout::save_hf_dir(&model, &self.tokenizer, &dir, model.dtype())?,
        }
        Ok(Some(dir))
    }
}
