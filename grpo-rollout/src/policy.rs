//! The trainable policy: a [`Transformer`] whose trainable weights are candle `Var`s.
//!
//! Full fine-tuning makes every weight a `Var`; LoRA keeps the base as plain (frozen) tensors
//! and makes only the adapter tensors `Var`s (`A`, `B`, and DoRA magnitudes, `lora_B` biases and
//! base biases when the config trains them). The learner reads [`TrainableModel::vars`]
//! for its optimizer; generation and the reference model use [`Transformer::detached`] /
//! [`Transformer::snapshot`], which carry no autograd graph.

use std::collections::HashMap;

use candle_core::{Result, Tensor, Var};

use crate::lora::{self, LoraConfig};
use crate::model::Transformer;

/// A model plus the variables an optimizer updates.
#[derive(Debug, Clone)]
pub struct TrainableModel {
    /// The model; its trainable tensors are the `Var`s below (shared storage).
    pub model: Transformer,
    /// Trainable variables by name (transformers names, or PEFT keys for LoRA).
    pub vars: Vec<(String, Var)>,
    /// The LoRA configuration, when training adapters.
    pub lora: Option<LoraConfig>,
}

impl TrainableModel {
    /// Every weight trainable (full fine-tuning): copied into new `Var`s. The model's
    /// constants ([`crate::moe::MoeNames::is_buffer`]) are not weights and stay as they are.
    pub fn full(base: &Transformer) -> Result<Self> {
        let mut vars = Vec::new();
        let mut map = HashMap::new();
        for (name, t) in base.weights() {
            // A constant of the model (GLM-4.5's router offsets) stays out of the optimizer.
            if crate::moe::MoeNames::is_buffer(&name) {
                map.insert(name, t);
                continue;
            }
            // A storage of its own (`make_var` copies the elements the layout holds: a packed
            // weight's view becomes a tensor of its size, not of its pack's).
            let v = Var::from_tensor(&t.detach())?;
            map.insert(name.clone(), v.as_tensor().clone());
            vars.push((name, v));
        }
        let model = Transformer::from_weights_like(base, &map)?;
        Ok(Self {
            model,
            vars,
            lora: None,
        })
    }

    /// LoRA: the base frozen (detached), fresh adapters as `Var`s (`B = 0`, so the adapted
    /// model starts equal to the base). The default targets become the architecture's, and
    /// the names of a mixture of experts' maps become its `target_parameters` as PEFT makes
    /// them ([`LoraConfig::for_model`]).
    pub fn lora(base: &Transformer, cfg: &LoraConfig, seed: u64) -> Result<Self> {
        let cfg = &cfg.for_model(base)?;
        let mut model = base.detached();
        for l in model.layers.iter_mut() {
            for lin in l.adaptable_mut() {
                lin.lora = None;
            }
        }
        let init = lora::attach(&mut model, cfg, seed)?;
        Self::with_adapters(model, cfg.clone(), init)
    }

    /// LoRA from an existing adapted model (e.g. loaded with [`lora::load_peft`]).
    pub fn from_adapted(model: &Transformer, cfg: &LoraConfig) -> Result<Self> {
        let model = model.detached();
        let init = lora::factors(&model, cfg);
        Self::with_adapters(model, cfg.clone(), init)
    }

    fn with_adapters(
        mut model: Transformer,
        cfg: LoraConfig,
        init: Vec<(String, Tensor)>,
    ) -> Result<Self> {
        let mut vars = Vec::new();
        let mut map = HashMap::new();
        for (k, t) in init {
            let v = Var::from_tensor(&t.detach().copy()?)?;
            map.insert(k.clone(), v.as_tensor().clone());
            vars.push((k, v));
        }
        lora::set_factors(&mut model, &cfg, &map)?;
        Ok(Self {
            model,
            vars,
            lora: Some(cfg),
        })
    }

    /// Number of trainable scalars.
    pub fn num_trainable(&self) -> usize {
        self.vars.iter().map(|(_, v)| v.elem_count()).sum()
    }
}
