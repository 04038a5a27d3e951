//! LoRA adapters: `y = W x + (alpha / r) · B A dropout(x)`, the base frozen, `A` and `B`
//! trainable; saved and loaded in PEFT's format so Python `peft` and vLLM read them.

use std::collections::HashMap;
use std::path::Path;
use std::sync::{Arc, Mutex};

use candle_core::{DType, Result, Tensor, bail};
use rand::{Rng, SeedableRng};
use rand_chacha::ChaCha8Rng;
use serde::{Deserialize, Serialize};

use crate::model::{Linear, Transformer};

/// The modules LoRA can target.
pub const TARGET_MODULES: [&str; 7] = [
    "q_proj",
    "k_proj",
    "v_proj",
    "o_proj",
    "gate_proj",
    "up_proj",
    "down_proj",
];

/// LoRA hyper-parameters (PEFT's names).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LoraConfig {
    /// Rank.
    pub r: usize,
    /// Scale numerator: the low-rank path is multiplied by `lora_alpha / r`.
    pub lora_alpha: f64,
    /// Dropout on the adapter's input during training.
    #[serde(default)]
    pub lora_dropout: f64,
    /// Which linear layers get adapters (any of [`TARGET_MODULES`]).
    pub target_modules: Vec<String>,
}

impl Default for LoraConfig {
    fn default() -> Self {
        Self {
            r: 16,
            lora_alpha: 32.0,
            lora_dropout: 0.0,
            target_modules: ["q_proj", "k_proj", "v_proj", "o_proj"]
                .map(String::from)
                .to_vec(),
        }
    }
}

impl LoraConfig {
    /// Checks the values, naming the field to fix.
    pub fn validate(&self) -> Result<()> {
        if self.r == 0 {
            bail!("lora.r must be >= 1");
        }
        if !(0.0..1.0).contains(&self.lora_dropout) {
            bail!(
                "lora.lora_dropout must be in [0, 1), got {}",
                self.lora_dropout
            );
        }
        if self.target_modules.is_empty() {
            bail!("lora.target_modules is empty: name at least one of {TARGET_MODULES:?}");
        }
        for m in &self.target_modules {
            if !TARGET_MODULES.contains(&m.as_str()) {
                bail!(
                    "lora.target_modules: unknown module `{m}`, expected any of {TARGET_MODULES:?}"
                );
            }
        }
        Ok(())
    }

    /// `lora_alpha / r`.
    pub fn scale(&self) -> f64 {
        self.lora_alpha / self.r as f64
    }
}

/// The low-rank pair of one linear layer.
#[derive(Debug, Clone)]
pub struct Lora {
    /// `(r, in)`, PEFT's `lora_A`.
    pub a: Tensor,
    /// `(out, r)`, PEFT's `lora_B`.
    pub b: Tensor,
    /// `alpha / r`.
    pub scale: f64,
    /// Dropout probability; applied only while `a` is a trainable variable (training).
    pub dropout: f64,
    rng: Arc<Mutex<ChaCha8Rng>>,
}

impl Lora {
    /// `scale · B A dropout(x)` for `x` of shape `(n, in)`.
    pub fn forward(&self, x: &Tensor) -> Result<Tensor> {
        let x = if self.dropout > 0.0 && self.a.is_variable() {
            let n = x.elem_count();
            let keep = 1.0 - self.dropout;
            let mask: Vec<f32> = {
                let mut rng = self
                    .rng
                    .lock()
                    .map_err(|_| candle_core::Error::msg("lora rng poisoned"))?;
                (0..n)
                    .map(|_| {
                        if rng.random::<f64>() < keep {
                            (1.0 / keep) as f32
                        } else {
                            0.0
                        }
                    })
                    .collect()
            };
            let mask = Tensor::from_vec(mask, x.shape(), x.device())?.to_dtype(x.dtype())?;
            (x * mask)?
        } else {
            x.clone()
        };
        x.matmul(&self.a.t()?)?.matmul(&self.b.t()?)? * self.scale
    }

    /// Applies `f` to `a` and `b`.
    pub fn map_tensors(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        Ok(Self {
            a: f(&self.a)?,
            b: f(&self.b)?,
            scale: self.scale,
            dropout: self.dropout,
            rng: self.rng.clone(),
        })
    }

    /// `scale · B A`, the update merged into `W`.
    pub fn delta(&self) -> Result<Tensor> {
        self.b.matmul(&self.a)? * self.scale
    }

    /// The dropout stream and its current state, so that a forward can be replayed with the
    /// same masks (gradient checkpointing recomputes a layer in backward).
    pub(crate) fn dropout_state(&self) -> Option<DropoutState> {
        if self.dropout <= 0.0 || !self.a.is_variable() {
            return None;
        }
        let state = self.rng.lock().ok()?.clone();
        Some((self.rng.clone(), state))
    }
}

/// A LoRA dropout stream and a saved state of it.
pub(crate) type DropoutState = (Arc<Mutex<ChaCha8Rng>>, ChaCha8Rng);

/// Runs `f` with each stream set to its saved state, then puts the streams back where they were.
pub(crate) fn replay_dropout<T>(saved: &[DropoutState], f: impl FnOnce() -> T) -> Result<T> {
    fn lock(m: &Mutex<ChaCha8Rng>) -> Result<std::sync::MutexGuard<'_, ChaCha8Rng>> {
        m.lock()
            .map_err(|_| candle_core::Error::msg("lora rng poisoned"))
    }
    let mut now = Vec::with_capacity(saved.len());
    for (rng, state) in saved {
        let mut g = lock(rng)?;
        now.push(std::mem::replace(&mut *g, state.clone()));
    }
    let out = f();
    for ((rng, _), state) in saved.iter().zip(now) {
        *lock(rng)? = state;
    }
    Ok(out)
}

fn module<'a>(
    layer: &'a mut crate::model::Layer,
    name: &str,
) -> Option<(&'static str, &'a mut Linear)> {
    Some(match name {
        "q_proj" => ("self_attn", &mut layer.q_proj),
        "k_proj" => ("self_attn", &mut layer.k_proj),
        "v_proj" => ("self_attn", &mut layer.v_proj),
        "o_proj" => ("self_attn", &mut layer.o_proj),
        "gate_proj" => ("mlp", &mut layer.gate_proj),
        "up_proj" => ("mlp", &mut layer.up_proj),
        "down_proj" => ("mlp", &mut layer.down_proj),
        _ => return None,
    })
}

/// PEFT key of a LoRA factor: `base_model.model.model.layers.{i}.{group}.{module}.lora_{A,B}.weight`.
pub fn peft_key(layer: usize, group: &str, module: &str, factor: char) -> String {
    format!("base_model.model.model.layers.{layer}.{group}.{module}.lora_{factor}.weight")
}

/// Adds fresh adapters to `model`: `A` Kaiming-uniform (PEFT's default, bound `1/sqrt(in)`),
/// `B` zero, so the adapted model starts equal to the base. Returns the adapter tensors by
/// PEFT key.
pub fn attach(
    model: &mut Transformer,
    cfg: &LoraConfig,
    seed: u64,
) -> Result<Vec<(String, Tensor)>> {
    cfg.validate()?;
    let mut rng = ChaCha8Rng::seed_from_u64(seed);
    let (dtype, device) = (model.dtype(), model.device().clone());
    let drop_rng = Arc::new(Mutex::new(ChaCha8Rng::seed_from_u64(
        seed ^ 0x9e37_79b9_7f4a_7c15,
    )));
    let mut out = Vec::new();
    for (i, layer) in model.layers.iter_mut().enumerate() {
        for m in &cfg.target_modules {
            let Some((group, lin)) = module(layer, m) else {
                continue;
            };
            let (o, inp) = lin.weight.dims2()?;
            let bound = 1.0 / (inp as f64).sqrt();
            let a: Vec<f32> = (0..cfg.r * inp)
                .map(|_| rng.random_range(-bound..bound) as f32)
                .collect();
            let a = Tensor::from_vec(a, (cfg.r, inp), &device)?.to_dtype(dtype)?;
            let b = Tensor::zeros((o, cfg.r), dtype, &device)?;
            out.push((peft_key(i, group, m, 'A'), a.clone()));
            out.push((peft_key(i, group, m, 'B'), b.clone()));
            lin.lora = Some(Lora {
                a,
                b,
                scale: cfg.scale(),
                dropout: cfg.lora_dropout,
                rng: drop_rng.clone(),
            });
        }
    }
    Ok(out)
}

/// Replaces the adapters' factors by the tensors in `tensors` (PEFT keys), e.g. `Var`s.
pub fn set_factors(model: &mut Transformer, tensors: &HashMap<String, Tensor>) -> Result<()> {
    for (i, layer) in model.layers.iter_mut().enumerate() {
        for m in TARGET_MODULES {
            let Some((group, lin)) = module(layer, m) else {
                continue;
            };
            if let Some(l) = lin.lora.as_mut() {
                for (f, slot) in [('A', &mut l.a), ('B', &mut l.b)] {
                    let k = peft_key(i, group, m, f);
                    let t = tensors.get(&k).ok_or_else(|| {
                        candle_core::Error::msg(format!("adapter tensor `{k}` is missing"))
                    })?;
                    if t.dims() != slot.dims() {
                        bail!(
                            "adapter tensor `{k}` has shape {:?}, expected {:?}",
                            t.dims(),
                            slot.dims()
                        );
                    }
                    *slot = t.clone();
                }
            }
        }
    }
    Ok(())
}

/// The adapters' factors by PEFT key.
pub fn factors(model: &Transformer) -> Vec<(String, Tensor)> {
    let mut out = Vec::new();
    for (i, layer) in model.layers.iter().enumerate() {
        let mut layer = layer.clone();
        for m in TARGET_MODULES {
            let Some((group, lin)) = module(&mut layer, m) else {
                continue;
            };
            if let Some(l) = &lin.lora {
                out.push((peft_key(i, group, m, 'A'), l.a.clone()));
                out.push((peft_key(i, group, m, 'B'), l.b.clone()));
            }
        }
    }
    out
}

/// Folds every adapter into its base weight (`W += scale · B A`) and removes the adapters.
pub fn merge(model: &Transformer) -> Result<Transformer> {
    let mut m = model.detached();
    for layer in m.layers.iter_mut() {
        for name in TARGET_MODULES {
            let Some((_, lin)) = module(layer, name) else {
                continue;
            };
            if let Some(l) = lin.lora.take() {
                lin.weight = (&lin.weight + l.delta()?.to_dtype(lin.weight.dtype())?)?;
            }
        }
    }
    Ok(m)
}

/// Writes `adapter_config.json` and `adapter_model.safetensors` (f32) in PEFT's format.
pub fn save_peft(
    model: &Transformer,
    cfg: &LoraConfig,
    dir: &Path,
    base_model: &str,
) -> Result<()> {
    std::fs::create_dir_all(dir)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", dir.display())))?;
    let config = serde_json::json!({
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model,
        "r": cfg.r,
        "lora_alpha": cfg.lora_alpha,
        "lora_dropout": cfg.lora_dropout,
        "target_modules": cfg.target_modules,
        "bias": "none",
        "fan_in_fan_out": false,
        "inference_mode": true,
        "init_lora_weights": true,
        "modules_to_save": null,
        "use_rslora": false,
        "use_dora": false,
        "layers_to_transform": null,
        "layers_pattern": null,
        "rank_pattern": {},
        "alpha_pattern": {},
        "revision": null,
    });
    let path = dir.join("adapter_config.json");
    std::fs::write(
        &path,
        serde_json::to_string_pretty(&config).unwrap_or_default(),
    )
    .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let tensors: HashMap<String, Tensor> = factors(model)
        .into_iter()
        .map(|(k, t)| Ok((k, t.detach().to_dtype(DType::F32)?)))
        .collect::<Result<_>>()?;
    candle_core::safetensors::save(&tensors, dir.join("adapter_model.safetensors"))
}

/// Reads a PEFT adapter directory and attaches it to `model` (replacing any adapters).
pub fn load_peft(model: &mut Transformer, dir: &Path) -> Result<LoraConfig> {
    let path = dir.join("adapter_config.json");
    let text = std::fs::read_to_string(&path)
        .map_err(|e| candle_core::Error::msg(format!("{}: {e}", path.display())))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| candle_core::Error::msg(format!("{}: invalid JSON: {e}", path.display())))?;
    if v.get("peft_type").and_then(|x| x.as_str()) != Some("LORA") {
        bail!("{}: peft_type must be LORA", path.display());
    }
    let field = |k: &str| {
        v.get(k).ok_or_else(|| {
            candle_core::Error::msg(format!("{}: field `{k}` is missing", path.display()))
        })
    };
    let targets = match field("target_modules")? {
        serde_json::Value::Array(a) => a
            .iter()
            .filter_map(|x| x.as_str().map(String::from))
            .collect(),
        serde_json::Value::String(s) => vec![s.clone()],
        _ => bail!("{}: target_modules must be a list", path.display()),
    };
    let cfg = LoraConfig {
        r: field("r")?.as_u64().unwrap_or(0) as usize,
        lora_alpha: field("lora_alpha")?.as_f64().unwrap_or(0.0),
        lora_dropout: v
            .get("lora_dropout")
            .and_then(|x| x.as_f64())
            .unwrap_or(0.0),
        target_modules: targets,
    };
    cfg.validate()?;
    attach(model, &cfg, 0)?;
    let file = dir.join("adapter_model.safetensors");
    let loaded = candle_core::safetensors::load(&file, model.device())?;
    let (dtype, dev) = (model.dtype(), model.device().clone());
    // PEFT may save keys with the adapter name (`lora_A.default.weight`); accept both.
    let tensors: HashMap<String, Tensor> = loaded
        .into_iter()
        .map(|(k, t)| {
            Ok((
                k.replace(".default.weight", ".weight"),
                t.to_dtype(dtype)?.to_device(&dev)?,
            ))
        })
        .collect::<Result<_>>()?;
    set_factors(model, &tensors)?;
    Ok(cfg)
}
