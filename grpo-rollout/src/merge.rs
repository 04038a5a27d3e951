//! Model merging with mergekit's methods and configuration schema: `linear`,
//! `task_arithmetic`, `ties`, `dare_ties`, `dare_linear` and `slerp`, tensor by tensor over
//! Hugging Face directories of one architecture. What TRL's `MergeModelCallback` runs through
//! mergekit, and what `grpo-cli merge` runs from a mergekit YAML (or TOML) file.
//!
//! With base `θ_b`, the other models `θ_i`, their deltas `δ_i = θ_i − θ_b` and weights `w_i`:
//! * `linear`: `Σ w_i θ_i / Σ w_i` over `models` (`normalize`, default true; without it the
//!   plain weighted sum);
//! * `task_arithmetic`: `θ_b + λ Σ w_i δ_i` (`normalize` default false: divided by `Σ w_i`);
//! * `ties`: each `δ_i` trimmed to its `density` share of largest magnitudes, the sign of
//!   `Σ w_i δ_i` elected per element, and only the weighted deltas of that sign summed (with
//!   `normalize`, the default, divided by the weights of the models that agree);
//! * `dare_ties` / `dare_linear`: each `δ_i` keeps every element with probability `density`
//!   and is rescaled to its former L1 norm (`rescale`, default true); then TIES' sign election
//!   (`dare_ties`) or the plain weighted sum (`dare_linear`);
//! * `slerp`: the spherical interpolation at `t` from the base to the one other model, each
//!   tensor as one vector (linear where they are near collinear, `|cos| > 0.9995`).
//!
//! A parameter is a number (or a boolean), a gradient — a list interpolated over the layer
//! index, `t = i / (layers − 1)` inside `model.layers.{i}.` and 0 elsewhere, as mergekit — or
//! a list of `{filter, value}` whose first entry with a filter in the tensor's name (or
//! without a filter) gives the value. Per-model parameters fall back to the top-level
//! `parameters`. The arithmetic is in f32 (f64 for f64 weights); the output is the base's
//! dtype per tensor, or `dtype` / `out_dtype`.

use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

use candle_core::{DType, Device, Result, Tensor, bail};
use rand::{Rng, SeedableRng};
use serde::{Deserialize, Serialize};

/// The merge methods (mergekit's names).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Method {
    /// Weighted average of the models.
    Linear,
    /// Base plus the weighted deltas.
    TaskArithmetic,
    /// TIES: magnitude trimming and sign election.
    Ties,
    /// DARE's random drop with TIES' sign election.
    DareTies,
    /// DARE's random drop, deltas summed.
    DareLinear,
    /// Spherical interpolation between the base and one model.
    Slerp,
}

impl Method {
    /// The parameters the method reads (others are refused), and whether it needs a base.
    fn parameters(self) -> (&'static [&'static str], bool) {
        match self {
            Method::Linear => (&["weight", "normalize"], false),
            Method::Slerp => (&["t"], true),
            _ => (
                &[
                    "weight",
                    "density",
                    "normalize",
                    "rescale",
                    "lambda",
                    "int8_mask",
                ],
                true,
            ),
        }
    }

    /// Its defaults for `normalize` and `rescale` (mergekit's registry).
    fn defaults(self) -> (bool, bool) {
        match self {
            Method::Linear | Method::Ties => (true, false),
            Method::TaskArithmetic => (false, false),
            Method::DareTies | Method::DareLinear => (false, true),
            Method::Slerp => (false, false),
        }
    }
}

/// One parameter's setting (see the module).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum Setting {
    /// A boolean.
    Bool(bool),
    /// A number.
    Number(f64),
    /// A gradient over the layers.
    Gradient(Vec<f64>),
    /// Filtered values, the first matching one taken.
    Filtered(Vec<Conditional>),
}

/// One entry of a filtered setting.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Conditional {
    /// A substring of the tensor's name (absent or `*`: any tensor).
    #[serde(default)]
    pub filter: Option<String>,
    /// The value there.
    pub value: Setting,
}

impl Setting {
    /// The value for the tensor `name` at layer position `t` (None: no entry matched).
    fn resolve(&self, name: &str, t: f64) -> Option<f64> {
        match self {
            Setting::Bool(b) => Some(f64::from(u8::from(*b))),
            Setting::Number(x) => Some(*x),
            Setting::Gradient(v) if v.is_empty() => None,
            Setting::Gradient(v) => {
                let scaled = t * (v.len() - 1) as f64;
                let i0 = scaled as usize;
                let i1 = (i0 + 1).min(v.len() - 1);
                let frac = scaled - i0 as f64;
                Some((1.0 - frac) * v[i0] + frac * v[i1])
            }
            Setting::Filtered(conds) => conds
                .iter()
                .find(|c| match c.filter.as_deref() {
                    None | Some("*") => true,
                    Some(f) => name.contains(f),
                })
                .and_then(|c| c.value.resolve(name, t)),
        }
    }
}

/// One input model.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct InputModel {
    /// A Hugging Face directory.
    pub model: PathBuf,
    /// Its parameters (`weight`, `density`).
    #[serde(default)]
    pub parameters: BTreeMap<String, Setting>,
}

/// A merge (mergekit's configuration schema; `slices`, `tokenizer` and LoRA inputs are not
/// part of it here).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MergeConfig {
    /// The method.
    pub merge_method: Method,
    /// The base model (required by all but `linear`).
    #[serde(default)]
    pub base_model: Option<PathBuf>,
    /// The models to merge (with or without the base among them).
    #[serde(default)]
    pub models: Vec<InputModel>,
    /// Top-level parameters: the method's, and defaults for the models'.
    #[serde(default)]
    pub parameters: BTreeMap<String, Setting>,
    /// The dtype the weights are read in (`float32`, `float16`, `bfloat16`, `float64`).
    #[serde(default)]
    pub dtype: Option<String>,
    /// The output's dtype (default `dtype`, else each tensor's base dtype).
    #[serde(default)]
    pub out_dtype: Option<String>,
    /// Where the tokenizer and config come from: `base` (the default; the first model for
    /// `linear` without a base) or a model's path.
    #[serde(default)]
    pub tokenizer_source: Option<String>,
    /// DARE's random drops' seed (mergekit's `--random-seed`).
    #[serde(default)]
    pub random_seed: Option<u64>,
}

/// A dtype name (mergekit's spellings): float64, or what [`crate::Dtype`] reads.
fn parse_dtype(s: &str) -> Result<DType> {
    match s {
        "float64" | "f64" => Ok(DType::F64),
        _ => s
            .parse::<crate::Dtype>()
            .map(|d| d.dtype())
            .map_err(|e| candle_core::Error::Msg(format!("merge: unknown dtype `{s}` ({e})"))),
    }
}

impl MergeConfig {
    /// Checks the method's contract and parameters; returns (base index, input paths).
    fn plan(&self) -> Result<(Option<usize>, Vec<PathBuf>)> {
        let (known, needs_base) = self.merge_method.parameters();
        let method = serde_json::to_value(self.merge_method)
            .ok()
            .and_then(|v| v.as_str().map(String::from))
            .unwrap_or_default();
        for (where_, params) in std::iter::once(("parameters", &self.parameters)).chain(
            self.models
                .iter()
                .map(|m| ("a model's parameters", &m.parameters)),
        ) {
            if let Some(bad) = params.keys().find(|k| !known.contains(&k.as_str())) {
                bail!(
                    "merge: `{bad}` in {where_} is not a parameter of `{method}` (it takes {})",
                    known.join(", ")
                );
            }
        }
        if self.models.is_empty() {
            bail!("merge: `models` is empty");
        }
        let mut inputs: Vec<PathBuf> = self.models.iter().map(|m| m.model.clone()).collect();
        let base = match (&self.base_model, needs_base) {
            (None, true) => bail!("merge: `{method}` needs `base_model`"),
            (None, false) => None,
            (Some(b), _) => match inputs.iter().position(|m| same_path(m, b)) {
                Some(i) => Some(i),
                None if needs_base => {
                    inputs.push(b.clone());
                    Some(inputs.len() - 1)
                }
                None => bail!(
                    "merge: `linear` averages `models`; its base_model {} is not one of them \
                     (list it there with a weight)",
                    b.display()
                ),
            },
        };
        if self.merge_method == Method::Slerp && inputs.len() != 2 {
            bail!(
                "merge: `slerp` takes the base and exactly one other model, got {} models",
                inputs.len()
            );
        }
        Ok((base, inputs))
    }

    /// A parameter for input `i` (its own, else the top-level one), at tensor `name` / `t`.
    fn param(&self, i: usize, key: &str, name: &str, t: f64) -> Option<f64> {
        self.models
            .get(i)
            .and_then(|m| m.parameters.get(key))
            .and_then(|s| s.resolve(name, t))
            .or_else(|| self.parameters.get(key).and_then(|s| s.resolve(name, t)))
    }
}

/// Two paths naming the same directory.
fn same_path(a: &Path, b: &Path) -> bool {
    match (a.canonicalize(), b.canonicalize()) {
        (Ok(x), Ok(y)) => x == y,
        _ => a == b,
    }
}

/// The layer position `t` of a tensor: `i / (layers − 1)` for `…layers.{i}.…`, else 0.
fn layer_t(name: &str, layers: usize) -> f64 {
    match layer_index(name) {
        Some(i) if layers > 1 => i as f64 / (layers - 1) as f64,
        Some(_) => 1.0,
        None => 0.0,
    }
}

fn layer_index(name: &str) -> Option<usize> {
    let at = name.find("layers.")? + "layers.".len();
    let rest = &name[at..];
    let end = rest.find('.')?;
    rest[..end].parse().ok()
}

/// Merges the weights of `inputs` (tensor maps, one per input in `cfg`'s order with the base
/// appended when it is not among `models`) into one map.
pub fn merge_weights(
    cfg: &MergeConfig,
    inputs: &[HashMap<String, Tensor>],
) -> Result<HashMap<String, Tensor>> {
    let (base, paths) = cfg.plan()?;
    if inputs.len() != paths.len() {
        bail!(
            "merge: {} weight maps for {} input models",
            inputs.len(),
            paths.len()
        );
    }
    let load_dtype = cfg.dtype.as_deref().map(parse_dtype).transpose()?;
    let out_dtype = cfg.out_dtype.as_deref().map(parse_dtype).transpose()?;
    let reference = &inputs[base.unwrap_or(0)];
    let layers = reference
        .keys()
        .filter_map(|n| layer_index(n))
        .max()
        .map_or(0, |m| m + 1);
    let mut names: Vec<&String> = reference.keys().collect();
    names.sort();
    let mut out = HashMap::new();
    for name in names {
        let base_dtype = reference[name].dtype();
        let mut rows = Vec::with_capacity(inputs.len());
        for (k, m) in inputs.iter().enumerate() {
            let t = m.get(name.as_str()).ok_or_else(|| {
                candle_core::Error::Msg(format!(
                    "merge: tensor `{name}` is missing from {}",
                    paths[k].display()
                ))
            })?;
            if t.dims() != reference[name].dims() {
                bail!(
                    "merge: tensor `{name}` is {:?} in {} but {:?} in {}",
                    t.dims(),
                    paths[k].display(),
                    reference[name].dims(),
                    paths[base.unwrap_or(0)].display()
                );
            }
            let t = match load_dtype {
                Some(d) => t.to_dtype(d)?,
                None => t.clone(),
            };
            rows.push(t);
        }
        // mergekit's precision: linear and slerp in f32 (f64 for f64), the task-arithmetic
        // family in the weights' own dtype.
        let work = match (rows[0].dtype(), cfg.merge_method) {
            (DType::F64, _) => DType::F64,
            (d @ (DType::F16 | DType::BF16), m) if !matches!(m, Method::Linear | Method::Slerp) => {
                d
            }
            _ => DType::F32,
        };
        let merged = if !rows[0].dtype().is_float() {
            rows[base.unwrap_or(0)].clone()
        } else {
            merge_tensor(cfg, base, name, layer_t(name, layers), &rows, work)?
        };
        let dt = out_dtype.or(load_dtype).unwrap_or(base_dtype);
        let dt = if merged.dtype().is_float() {
            dt
        } else {
            merged.dtype()
        };
        out.insert(name.clone(), merged.to_dtype(dt)?);
    }
    Ok(out)
}

/// One tensor's merge: `rows` are the inputs' copies of tensor `name`.
fn merge_tensor(
    cfg: &MergeConfig,
    base: Option<usize>,
    name: &str,
    t: f64,
    rows: &[Tensor],
    work: DType,
) -> Result<Tensor> {
    let shape = rows[0].shape().clone();
    let vecs: Vec<Vec<f64>> = rows
        .iter()
        .map(|r| r.flatten_all()?.to_dtype(DType::F64)?.to_vec1::<f64>())
        .collect::<candle_core::Result<_>>()?;
    // Arithmetic in the working precision: each value rounded through `work`.
    let round = |x: f64| -> f64 {
        match work {
            DType::F64 => x,
            DType::F16 => half::f16::from_f64(x).to_f64(),
            DType::BF16 => half::bf16::from_f64(x).to_f64(),
            _ => x as f32 as f64,
        }
    };
    let (def_normalize, def_rescale) = cfg.merge_method.defaults();
    let flag = |key: &str, default: bool| -> bool {
        cfg.parameters
            .get(key)
            .and_then(|s| s.resolve(name, t))
            .map_or(default, |v| v != 0.0)
    };
    let weight = |i: usize| -> Result<f64> {
        cfg.param(i, "weight", name, t).ok_or_else(|| {
            candle_core::Error::Msg(format!(
                "merge: model {} has no `weight` for tensor `{name}`",
                i + 1
            ))
        })
    };
    let n = vecs[0].len();
    let result: Vec<f64> = match cfg.merge_method {
        Method::Linear => {
            // As mergekit: the weights in the working dtype, accumulated model by model.
            let w: Vec<f64> = (0..vecs.len())
                .map(|i| weight(i).map(&round))
                .collect::<Result<_>>()?;
            let total = round(w.iter().sum::<f64>());
            let normalize = flag("normalize", def_normalize);
            (0..n)
                .map(|j| {
                    let s = vecs
                        .iter()
                        .zip(&w)
                        .fold(0.0, |acc, (v, w)| round(acc + round(v[j] * w)));
                    if normalize { round(s / total) } else { s }
                })
                .collect()
        }
        Method::Slerp => {
            let b = base.unwrap_or(0);
            let tt = cfg
                .parameters
                .get("t")
                .and_then(|s| s.resolve(name, t))
                .ok_or_else(|| {
                    candle_core::Error::Msg(format!(
                        "merge: `slerp` has no `t` for tensor `{name}`"
                    ))
                })?;
            slerp(tt, &vecs[b], &vecs[1 - b])
                .into_iter()
                .map(round)
                .collect()
        }
        method => {
            let b = base.expect("planned: the method has a base");
            let normalize = flag("normalize", def_normalize);
            let rescale = flag("rescale", def_rescale);
            let lambda = cfg
                .parameters
                .get("lambda")
                .and_then(|s| s.resolve(name, t))
                .unwrap_or(1.0);
            let mut deltas = Vec::new();
            let mut weights = Vec::new();
            for (i, v) in vecs.iter().enumerate() {
                if i == b {
                    continue;
                }
                let mut d: Vec<f64> = v.iter().zip(&vecs[b]).map(|(x, y)| round(x - y)).collect();
                let density = cfg.param(i, "density", name, t).unwrap_or(1.0);
                match method {
                    Method::Ties => magnitude_trim(&mut d, density, rescale, &round),
                    Method::DareTies | Method::DareLinear => {
                        let seed = cfg.random_seed.unwrap_or(0) ^ name_hash(name) ^ (i as u64);
                        random_drop(&mut d, density, rescale, seed, &round)
                    }
                    _ => {}
                }
                deltas.push(d);
                // The weights in the deltas' dtype, as mergekit's tensor of them.
                weights.push(round(weight(i)?));
            }
            if deltas.is_empty() {
                return rows[b].to_dtype(work);
            }
            let consensus = matches!(method, Method::Ties | Method::DareTies);
            let wsum = round(weights.iter().sum::<f64>());
            (0..n)
                .map(|j| {
                    let wd: Vec<f64> = deltas
                        .iter()
                        .zip(&weights)
                        .map(|(d, w)| round(d[j] * w))
                        .collect();
                    let (mixed, divisor) = if consensus {
                        // The elected sign: that of the weighted deltas' sum (≥ 0: positive).
                        let elected = if round(wd.iter().sum::<f64>()) >= 0.0 {
                            1.0
                        } else {
                            -1.0
                        };
                        let mut mixed = 0.0;
                        let mut div = 0.0;
                        for (x, w) in wd.iter().zip(&weights) {
                            if sign(*x) == elected {
                                mixed += x;
                                div += w;
                            }
                        }
                        let div = round(div);
                        (round(mixed), if div == 0.0 { 1.0 } else { div })
                    } else {
                        let s = round(wd.iter().sum::<f64>());
                        (s, if wsum.abs() < 1e-8 { 1.0 } else { wsum })
                    };
                    let mut m = mixed;
                    if normalize {
                        m = round(m / divisor);
                    }
                    if lambda != 1.0 {
                        m = round(m * lambda);
                    }
                    round(vecs[b][j] + m)
                })
                .collect()
        }
    };
    Tensor::from_vec(result, shape, &Device::Cpu)?.to_dtype(work)
}

/// torch's `sign`: −1, 0 or 1.
fn sign(x: f64) -> f64 {
    if x > 0.0 {
        1.0
    } else if x < 0.0 {
        -1.0
    } else {
        0.0
    }
}

/// A stable hash of a tensor name (DARE's per-tensor seeds).
fn name_hash(name: &str) -> u64 {
    name.bytes().fold(0xcbf2_9ce4_8422_2325u64, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x0000_0100_0000_01b3)
    })
}

/// TIES' trim: keeps the `max(1, ⌊density · n⌋)` largest magnitudes (ties at the threshold by
/// index), zeroes the rest; with `rescale` the kept ones scaled back to the former L1 norm.
fn magnitude_trim(d: &mut [f64], density: f64, rescale: bool, round: &dyn Fn(f64) -> f64) {
    if density >= 1.0 {
        return;
    }
    if density <= 0.0 || d.is_empty() {
        d.iter_mut().for_each(|x| *x = 0.0);
        return;
    }
    let k = ((density * d.len() as f64) as usize).max(1);
    let mut mags: Vec<f64> = d.iter().map(|x| x.abs()).collect();
    let (_, &mut threshold, _) = mags.select_nth_unstable_by(k - 1, |a, b| b.total_cmp(a));
    let above = d.iter().filter(|x| x.abs() > threshold).count();
    let mut equal_left = k - above;
    let mask: Vec<bool> = d
        .iter()
        .map(|x| {
            let m = x.abs();
            if m > threshold {
                true
            } else if m == threshold && equal_left > 0 {
                equal_left -= 1;
                true
            } else {
                false
            }
        })
        .collect();
    apply_mask(d, &mask, rescale, round);
}

/// DARE's drop: keeps each element with probability `density` (a seeded Bernoulli).
fn random_drop(d: &mut [f64], density: f64, rescale: bool, seed: u64, round: &dyn Fn(f64) -> f64) {
    if density >= 1.0 {
        return;
    }
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let mask: Vec<bool> = d.iter().map(|_| rng.random::<f64>() < density).collect();
    apply_mask(d, &mask, rescale, round);
}

/// Zeroes the unmasked elements; with `rescale` scales the rest to the former L1 norm `rescaled_masked_tensor`, eps 1e-7).
/// (mergekit's `rescaled_masked_tensor`, eps 1e-7), the norms and their ratio rounded to the
/// working dtype as its 0-d tensors are.
fn apply_mask(d: &mut [f64], mask: &[bool], rescale: bool, round: &dyn Fn(f64) -> f64) {
    let before = round(d.iter().map(|x| x.abs()).sum::<f64>());
    for (x, keep) in d.iter_mut().zip(mask) {
        if !keep {
            *x = 0.0;
        }
    }
    if rescale {
        let after = round(d.iter().map(|x| x.abs()).sum::<f64>());
        if before >= 1e-7 && after >= 1e-7 {
            let s = round(before / after);
            d.iter_mut().for_each(|x| *x = round(*x * s));
        }
    }
}

/// mergekit's `slerp` of one tensor: the angle between the two flattened tensors (each
/// normalised), the interpolation applied to the originals; linear when `|cos| > 0.9995`.
fn slerp(t: f64, a: &[f64], b: &[f64]) -> Vec<f64> {
    let eps = 1e-8;
    let norm = |v: &[f64]| v.iter().map(|x| x * x).sum::<f64>().sqrt();
    let (na, nb) = (norm(a), norm(b));
    let na = if na > eps { na } else { 1.0 };
    let nb = if nb > eps { nb } else { 1.0 };
    let dot = a
        .iter()
        .zip(b)
        .map(|(x, y)| (x / na) * (y / nb))
        .sum::<f64>()
        .clamp(-1.0, 1.0);
    let (ca, cb) = if dot.abs() > 0.9995 {
        (1.0 - t, t)
    } else {
        let theta = dot.acos();
        let s = theta.sin();
        (((1.0 - t) * theta).sin() / s, (t * theta).sin() / s)
    };
    a.iter().zip(b).map(|(x, y)| ca * x + cb * y).collect()
}

/// Runs a merge of Hugging Face directories into `out`: the merged `model.safetensors`, and
/// the config, tokenizer and generation files of `tokenizer_source` (the base, or the first
/// model). Returns the number of tensors written.
pub fn merge_dirs(cfg: &MergeConfig, out: &Path) -> Result<usize> {
    let (base, paths) = cfg.plan()?;
    let mut inputs = Vec::with_capacity(paths.len());
    for p in &paths {
        inputs.push(crate::loader::read_safetensors(p, &Device::Cpu)?);
    }
    let merged = merge_weights(cfg, &inputs)?;
    drop(inputs);
    std::fs::create_dir_all(out)
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", out.display())))?;
    let source = match cfg.tokenizer_source.as_deref() {
        None | Some("base") => paths[base.unwrap_or(0)].clone(),
        Some(p) => PathBuf::from(p),
    };
    for f in [
        "config.json",
        "generation_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "special_tokens_map.json",
        "chat_template.jinja",
        "vocab.json",
        "merges.txt",
        "tokenizer.model",
    ] {
        let from = source.join(f);
        if from.exists() {
            std::fs::copy(&from, out.join(f))
                .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", from.display())))?;
        }
    }
    // The config's dtype follows the output's.
    let cfg_path = out.join("config.json");
    if let (Some(dt), Ok(text)) = (
        cfg.out_dtype.as_deref().or(cfg.dtype.as_deref()),
        std::fs::read_to_string(&cfg_path),
    ) && let Ok(mut v) = serde_json::from_str::<serde_json::Value>(&text)
    {
        let name = match parse_dtype(dt)? {
            DType::F16 => "float16",
            DType::BF16 => "bfloat16",
            DType::F64 => "float64",
            _ => "float32",
        };
        for key in ["torch_dtype", "dtype"] {
            if let Some(o) = v.as_object_mut()
                && o.contains_key(key)
            {
                o.insert(key.into(), name.into());
            }
        }
        std::fs::write(
            &cfg_path,
            serde_json::to_string_pretty(&v).unwrap_or_default(),
        )
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", cfg_path.display())))?;
    }
    let file = out.join("model.safetensors");
    candle_core::safetensors::save(&merged, &file)
        .map_err(|e| candle_core::Error::Msg(format!("{}: {e}", file.display())))?;
    Ok(merged.len())
}
