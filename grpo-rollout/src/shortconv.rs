//! LFM2's gated short convolutions ([`crate::config::Arch::Lfm2`], `lfm2`): the token mixer of
//! its `conv` layers, in place of attention. `in_proj` gives three rows per channel, `B`, `C`,
//! `x`; `B · x` runs through a causal depthwise convolution of `conv_L_cache` taps (with
//! `conv_bias`, a bias on every map too); `C` gates its output; `out_proj` maps it back. No
//! state beyond the last `kernel − 1` convolution inputs, which a generation cache keeps.

use candle_core::{DType, Result, Tensor, bail};
use serde::{Deserialize, Serialize};
use serde_json::Value;

use crate::model::Linear;

/// The shape of an LFM2 model's convolution layers.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShortConvConfig {
    /// The layers with a short convolution (`layer_types` `conv`); the others have attention.
    pub layers: Vec<usize>,
    /// `conv_L_cache`: the convolution's taps.
    pub kernel: usize,
    /// `conv_bias`: biases on `in_proj`, the convolution and `out_proj`.
    pub bias: bool,
}

impl ShortConvConfig {
    /// Reads the fields of an `lfm2` config: `layer_types` (`conv` / `full_attention`), else
    /// `full_attn_idxs` (transformers' default: every layer attention), `conv_L_cache` (3),
    /// `conv_bias` (false).
    pub fn from_hf_json(v: &Value, num_layers: usize) -> Result<Self> {
        let layers = match crate::delta::layers_of_type(v, num_layers, "conv")? {
            Some(l) => l,
            None => match v.get("full_attn_idxs").filter(|t| !t.is_null()) {
                Some(Value::Array(a)) => {
                    let full: Vec<u64> = a.iter().filter_map(Value::as_u64).collect();
                    if full.len() != a.len() {
                        bail!("field `full_attn_idxs` must list layer indices, not {a:?}");
                    }
                    (0..num_layers)
                        .filter(|i| !full.contains(&(*i as u64)))
                        .collect()
                }
                Some(x) => bail!("field `full_attn_idxs` must be a list, not {x}"),
                None => Vec::new(),
            },
        };
        let kernel = match v.get("conv_L_cache") {
            None | Some(Value::Null) => 3,
            Some(x) => x.as_u64().filter(|k| *k > 0).ok_or_else(|| {
                candle_core::Error::msg(format!(
                    "field `conv_L_cache` must be a positive integer, not {x}"
                ))
            })? as usize,
        };
        let bias = v.get("conv_bias").and_then(Value::as_bool).unwrap_or(false);
        Ok(Self {
            layers,
            kernel,
            bias,
        })
    }

    /// Writes the fields back as transformers reads them.
    pub fn write_hf_json(&self, obj: &mut serde_json::Map<String, Value>, num_layers: usize) {
        let types: Vec<&str> = (0..num_layers)
            .map(|i| match self.is_conv(i) {
                true => "conv",
                false => "full_attention",
            })
            .collect();
        obj.insert("layer_types".into(), types.into());
        obj.insert("conv_L_cache".into(), self.kernel.into());
        obj.insert("conv_bias".into(), self.bias.into());
    }

    /// Whether layer `i` has a convolution.
    pub fn is_conv(&self, i: usize) -> bool {
        self.layers.contains(&i)
    }

    /// One convolution layer's parameters for `hidden` channels.
    pub fn parameters(&self, hidden: usize) -> usize {
        let b = usize::from(self.bias);
        3 * hidden * hidden
            + 3 * hidden * b
            + hidden * self.kernel
            + hidden * b
            + hidden * hidden
            + hidden * b
    }
}

/// The names of a convolution layer's linear maps after `conv.`.
pub const LINEAR_NAMES: [&str; 2] = ["in_proj", "out_proj"];

/// One convolution layer's weights.
#[derive(Debug, Clone)]
pub struct ShortConv {
    /// `B`, `C`, `x` `(3 · hidden, hidden)`.
    pub in_proj: Linear,
    /// `(hidden, hidden)`.
    pub out_proj: Linear,
    /// The depthwise convolution `(hidden, 1, kernel)`, as the files hold it.
    pub conv: Tensor,
    /// Its bias `(hidden,)` (`conv_bias`).
    pub conv_bias: Option<Tensor>,
}

impl ShortConv {
    /// The two linear maps, in [`LINEAR_NAMES`]' order.
    pub fn linears(&self) -> [&Linear; 2] {
        [&self.in_proj, &self.out_proj]
    }

    /// The two linear maps, mutable.
    pub fn linears_mut(&mut self) -> [&mut Linear; 2] {
        [&mut self.in_proj, &mut self.out_proj]
    }

    /// The tensors besides the linear maps, by their names after `conv.`.
    pub fn tensors(&self) -> Vec<(&'static str, &Tensor)> {
        let mut out = vec![("conv.weight", &self.conv)];
        out.extend(self.conv_bias.iter().map(|b| ("conv.bias", b)));
        out
    }

    /// The mixer with `f` applied to every tensor.
    pub fn map(&self, f: &dyn Fn(&Tensor) -> Result<Tensor>) -> Result<Self> {
        let lin = |l: &Linear| crate::model::map_linear(l, f);
        Ok(Self {
            in_proj: lin(&self.in_proj)?,
            out_proj: lin(&self.out_proj)?,
            conv: f(&self.conv)?,
            conv_bias: self.conv_bias.as_ref().map(f).transpose()?,
        })
    }

    /// The mixer's output rows `(B·L, hidden)` for normalised input rows `h` `(B·L, hidden)`
    /// of `b` rows of `l` positions after `past` (the last `kernel − 1` convolution inputs `(B,
    /// kernel − 1, hidden)` of a generation cache; `None`: zeros), with the inputs to keep.
    /// `tokens` `(B·L, 1)` is 1 at real tokens and 0 at padding (`None`: all real): padding rows
    /// are zeroed before `in_proj`, as transformers zeroes them.
    pub fn run(
        &self,
        h: &Tensor,
        b: usize,
        l: usize,
        tokens: Option<&Tensor>,
        past: Option<&Tensor>,
    ) -> Result<(Tensor, Tensor)> {
        let h = crate::delta::padding_zeroed(h, tokens)?;
        let hidden = h.dim(1)?;
        let bcx = self.in_proj.forward(&h)?;
        let gate_b = bcx.narrow(1, 0, hidden)?;
        let gate_c = bcx.narrow(1, hidden, hidden)?;
        let x = bcx.narrow(1, 2 * hidden, hidden)?;
        let bx = (gate_b * x)?.reshape((b, l, hidden))?;
        let (mut conv, kept) = crate::delta::causal_conv(&bx, past, &self.conv)?;
        if let Some(bias) = &self.conv_bias {
            conv = conv.broadcast_add(bias)?;
        }
        let y = (gate_c * conv.reshape((b * l, hidden))?)?;
        Ok((self.out_proj.forward(&y)?, kept))
    }
}

/// A placeholder beside a convolution layer's cached inputs in a generation cache's slot (which
/// holds two tensors per layer, rows first): one f32 zero per row.
pub fn no_state(b: usize, device: &candle_core::Device) -> Result<Tensor> {
    Tensor::zeros((b, 1), DType::F32, device)
}
