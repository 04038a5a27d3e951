//! The model as grpo-rewards' scoring traits (cargo feature `rewards`).
//!
//! * [`ModelScorer`] (a causal LM + tokenizer) implements [`LanguageScorer`], used by the
//!   `inverse_loss` and `coverage_ce` rewards.
//! * [`ClassifierModel`] (a Hugging Face `*ForSequenceClassification` checkpoint) implements
//!   [`SequenceClassifier`], used by the `reward_model` reward.
//!
//! Both hold detached weights (no autograd graph) and are `Send + Sync` without locks: a forward
//! pass only reads the weights, so several reward threads may score at once.
//!
//! **Tokenization convention** (the same as `grpo-cli logprobs` and TRL's reward-model
//! scoring): texts are encoded **without special tokens** (no BOS/EOS added); the chat template,
//! when used, already put them into the prompt text. A prompt/completion pair is the prompt's
//! ids followed by the completion's ids (each encoded alone).
//!
//! ```no_run
//! # fn main() -> candle_core::Result<()> {
//! use std::sync::Arc;
//! use candle_core::{DType, Device};
//! use grpo_rewards::ScoringModels;
//! use grpo_rollout::scoring::{ClassifierModel, ModelScorer};
//!
//! let dev = Device::Cpu;
//! let reference = ModelScorer::load("models/tiny".as_ref(), DType::F32, &dev)?;
//! let rm = ClassifierModel::load("models/tiny-rm".as_ref(), DType::F32, &dev)?;
//! let models = ScoringModels {
//!     language: Some(Arc::new(reference)),
//!     classifier: Some(Arc::new(rm)),
//!     ..Default::default()
//! };
//! // RewardsConfig::build(&models) then wires `inverse_loss`, `coverage_ce`, `reward_model`.
//! # Ok(()) }
//! ```

use std::path::Path;

use candle_core::{DType, Device, Result, Tensor, bail};
use grpo_rewards::builtin::{LanguageScorer, ScorerError, SequenceClassifier};
use serde_json::Value;

use crate::config::ModelConfig;
use crate::generate::left_pad;
use crate::loader::read_model_weights;
use crate::model::Transformer;
use crate::tokenizer::Tokenizer;

/// Default number of pairs per padded forward pass in [`ModelScorer`].
pub const DEFAULT_SCORER_BATCH: usize = 16;

/// `log softmax(logits(h_i))[targets_i]` for hidden states `h` `(N, H)`, a chunk of rows at a
/// time (`grpo_core::logprobs::chunk_rows_on`). Returns `(N,)` f32.
fn hidden_logprobs(model: &Transformer, h: &Tensor, targets: &Tensor) -> Result<Tensor> {
    let n = h.dim(0)?;
    let rows = grpo_core::logprobs::chunk_rows_on(model.cfg.vocab_size, h.device());
    let mut out = Vec::new();
    let mut start = 0;
    while start < n {
        let k = rows.min(n - start);
        let logits = model.logits(&h.narrow(0, start, k)?)?;
        out.push(grpo_core::logprobs::selective_log_softmax(
            &logits,
            &targets.narrow(0, start, k)?,
        )?);
        start += k;
    }
    Tensor::cat(&out, 0)?.to_dtype(DType::F32)
}

/// A causal language model with its tokenizer, as a [`LanguageScorer`].
///
/// * `completion_nll(prompt, completion)`: the mean NLL of the completion's ids given the
///   prompt's ids (see the module docs for the tokenization). A completion that encodes to no
///   tokens gives `None`. With an empty prompt the first completion token has no context: it is
///   taken as the context and the remaining tokens are scored (`None` if there are none).
/// * `completion_nll_batch`: pairs sorted by length and run [`DEFAULT_SCORER_BATCH`] (see
///   [`ModelScorer::with_batch_size`]) at a time as one left-padded forward pass; log-probs are
///   formed at the completion positions only, in chunks ([`Transformer::completion_logprobs`]).
/// * `aligned_log_probs(text, targets)`: `text` alone, no special tokens.
#[derive(Debug, Clone)]
pub struct ModelScorer {
    model: Transformer,
    tokenizer: Tokenizer,
    batch_size: usize,
}

impl ModelScorer {
    /// Scores with `model`'s weights, detached (storage shared with `model`: pass
    /// `model.snapshot()?` for a reference frozen while a learner updates the same tensors).
    pub fn new(model: &Transformer, tokenizer: Tokenizer) -> Self {
        Self {
            model: model.detached(),
            tokenizer,
            batch_size: DEFAULT_SCORER_BATCH,
        }
    }

    /// Loads a model directory or `.gguf` file (see [`crate::load`]).
    pub fn load(path: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let m = crate::load(path, dtype, device)?;
        Ok(Self::new(&m.model, m.tokenizer))
    }

    /// Pairs per forward pass in `completion_nll_batch` (at least 1).
    pub fn with_batch_size(mut self, batch_size: usize) -> Self {
        self.batch_size = batch_size.max(1);
        self
    }

    /// The model.
    pub fn model(&self) -> &Transformer {
        &self.model
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// Context and scored ids of a pair, per the conventions above; `None` = nothing to score.
    fn pair_ids(&self, prompt: &str, completion: &str) -> Result<Option<(Vec<u32>, usize)>> {
        let mut ids = self.tokenizer.encode(prompt, false)?;
        let c = self.tokenizer.encode(completion, false)?;
        let scored = if ids.is_empty() {
            c.len().saturating_sub(1)
        } else {
            c.len()
        };
        if scored == 0 {
            return Ok(None);
        }
        ids.extend(c);
        Ok(Some((ids, scored)))
    }

    /// Mean NLL of each pair's completion (see [`ModelScorer`]).
    pub fn nll_batch(&self, pairs: &[(&str, &str)]) -> Result<Vec<Option<f32>>> {
        let mut rows = Vec::with_capacity(pairs.len());
        for (i, (p, c)) in pairs.iter().enumerate() {
            if let Some((ids, n)) = self.pair_ids(p, c)? {
                rows.push((i, ids, n));
            }
        }
        // Similar lengths together: less padding.
        rows.sort_by_key(|(_, ids, _)| ids.len());
        let mut out = vec![None; pairs.len()];
        for chunk in rows.chunks(self.batch_size) {
            let ids: Vec<Vec<u32>> = chunk.iter().map(|(_, ids, _)| ids.clone()).collect();
            let t = chunk.iter().map(|(_, _, n)| *n).max().unwrap_or(0);
            let (input, mask) = left_pad(&ids, self.tokenizer.pad_token_id, self.model.device())?;
            let (lp, _) = self
                .model
                .completion_logprobs(&input, &mask, t, 1.0, false)?;
            let lp: Vec<Vec<f32>> = lp.to_dtype(DType::F32)?.to_vec2()?;
            for ((i, _, n), row) in chunk.iter().zip(&lp) {
                let sum: f64 = row[t - n..].iter().map(|&v| f64::from(v)).sum();
                out[*i] = Some((-sum / *n as f64) as f32);
            }
        }
        Ok(out)
    }

    /// `log softmax(logits_i)[targets[i]]` for `i < min(n, targets.len())` on `text` alone.
    pub fn aligned(&self, text: &str, targets: &[u32]) -> Result<Vec<f32>> {
        let ids = self.tokenizer.encode(text, false)?;
        let k = ids.len().min(targets.len());
        if k == 0 {
            return Ok(Vec::new());
        }
        let dev = self.model.device();
        let input = Tensor::from_vec(ids[..k].to_vec(), (1, k), dev)?;
        let mask = Tensor::ones((1, k), DType::U32, dev)?;
        let h = self
            .model
            .forward_padded(&input, &mask)?
            .reshape((k, self.model.cfg.hidden_size))?;
        let tg = Tensor::from_vec(targets[..k].to_vec(), k, dev)?;
        hidden_logprobs(&self.model, &h, &tg)?.to_vec1()
    }
}

impl LanguageScorer for ModelScorer {
    fn tokenize(&self, text: &str) -> std::result::Result<Vec<u32>, ScorerError> {
        Ok(self.tokenizer.encode(text, false)?)
    }

    fn completion_nll(
        &self,
        prompt: &str,
        completion: &str,
    ) -> std::result::Result<Option<f32>, ScorerError> {
        Ok(self.nll_batch(&[(prompt, completion)])?[0])
    }

    fn aligned_log_probs(
        &self,
        text: &str,
        targets: &[u32],
    ) -> std::result::Result<Vec<f32>, ScorerError> {
        Ok(self.aligned(text, targets)?)
    }

    fn completion_nll_batch(
        &self,
        pairs: &[(&str, &str)],
    ) -> std::result::Result<Vec<Option<f32>>, ScorerError> {
        Ok(self.nll_batch(pairs)?)
    }
}

/// A Hugging Face `LlamaForSequenceClassification` / `Qwen2ForSequenceClassification` /
/// `Qwen3ForSequenceClassification` checkpoint: the decoder (`model.*` weights) and a linear
/// `score` head `(num_labels = 1, hidden)` without bias, as a [`SequenceClassifier`].
///
/// The reward of a text is the head's output at its last non-pad token, as transformers'
/// `GenericForSequenceClassification` picks it: the rightmost position whose id is not
/// `pad_token_id` (config.json). When the config has no `pad_token_id`, transformers takes the
/// last position (and refuses batches of more than one row); here padding then uses an id
/// outside the vocabulary, so each row's score is its last token's, as if scored alone.
/// Texts are encoded without special tokens (TRL's convention); the batch is right-padded with
/// position ids from 0, as transformers does for right padding.
#[derive(Debug, Clone)]
pub struct ClassifierModel {
    /// The decoder with its `score` head ([`Transformer::score`]).
    model: Transformer,
    tokenizer: Tokenizer,
    pad_token_id: Option<u32>,
}

/// The padding id used when the checkpoint defines none (never a real token).
const NO_PAD: u32 = u32::MAX;

impl ClassifierModel {
    /// Loads a `*ForSequenceClassification` directory: `config.json` (`architectures`,
    /// `num_labels` = 1, `pad_token_id`), `model.safetensors` (or shards) with `model.*` and
    /// `score.weight`, `tokenizer.json`. Anything else is a one-line error naming the file.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let cfg_path = dir.join("config.json");
        let text = std::fs::read_to_string(&cfg_path)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", cfg_path.display())))?;
        let v: Value = serde_json::from_str(&text).map_err(|e| {
            candle_core::Error::msg(format!("{}: invalid JSON: {e}", cfg_path.display()))
        })?;
        let archs: Vec<&str> = v
            .get("architectures")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_str).collect())
            .unwrap_or_default();
        if !archs
            .iter()
            .any(|a| a.ends_with("ForSequenceClassification"))
        {
            bail!(
                "{}: not a sequence-classification checkpoint (architectures = {archs:?}; expected LlamaForSequenceClassification, Qwen2ForSequenceClassification or Qwen3ForSequenceClassification)",
                cfg_path.display()
            );
        }
        // `sequence_classification` (from `architectures`): the decoder reads `score.weight`
        // in place of an LM head.
        let cfg = ModelConfig::from_hf_json(&v)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", cfg_path.display())))?;
        let num_labels = v
            .get("num_labels")
            .and_then(Value::as_u64)
            .or_else(|| {
                v.get("id2label")
                    .and_then(Value::as_object)
                    .map(|m| m.len() as u64)
            })
            .unwrap_or(1) as usize;
        if num_labels != 1 {
            bail!(
                "{}: num_labels = {num_labels}; a reward model needs a single score (num_labels = 1)",
                cfg_path.display()
            );
        }
        let weights = read_model_weights(dir, &cfg, dtype, device)?;
        let wfile = dir.join("model.safetensors");
        let Some(score) = weights.get("score.weight") else {
            bail!(
                "{}: no `score.weight` (the sequence-classification head)",
                wfile.display()
            );
        };
        if score.dims() != [1, cfg.hidden_size] {
            bail!(
                "{}: `score.weight` has shape {:?}, expected [1, {}]",
                wfile.display(),
                score.dims(),
                cfg.hidden_size
            );
        }
        let model = Transformer::from_weights(&cfg, &weights, dtype, device)
            .map_err(|e| candle_core::Error::msg(format!("{}: {e}", wfile.display())))?;
        let tokenizer = Tokenizer::from_hf_dir(dir, &[])?;
        Ok(Self {
            model,
            tokenizer,
            pad_token_id: cfg.pad_token_id,
        })
    }

    /// From parts: the decoder, the head `(1, hidden)` and the padding id (`None` = the
    /// checkpoint has none).
    pub fn from_parts(
        model: &Transformer,
        score: Tensor,
        tokenizer: Tokenizer,
        pad_token_id: Option<u32>,
    ) -> Result<Self> {
        if score.dims() != [1, model.cfg.hidden_size] {
            bail!(
                "score head has shape {:?}, expected [1, {}]",
                score.dims(),
                model.cfg.hidden_size
            );
        }
        let mut model = model.detached();
        model.score = Some(score.detach());
        model.lm_head = None;
        model.cfg.sequence_classification = true;
        Ok(Self {
            model,
            tokenizer,
            pad_token_id,
        })
    }

    /// Overrides the padding id (`None`: no padding token, see [`ClassifierModel`]).
    pub fn with_pad_token_id(mut self, pad: Option<u32>) -> Self {
        self.pad_token_id = pad;
        self
    }

    /// The checkpoint's padding id.
    pub fn checkpoint_pad_token_id(&self) -> Option<u32> {
        self.pad_token_id
    }

    /// The tokenizer.
    pub fn tokenizer(&self) -> &Tokenizer {
        &self.tokenizer
    }

    /// The head's output at every position of a right-padded batch `(B, T)`.
    pub fn scores(&self, padded: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let b = padded.len();
        let t = padded.first().map_or(0, Vec::len);
        if padded.iter().any(|r| r.len() != t) {
            bail!("position_scores: rows of different lengths (expected a padded batch)");
        }
        if b == 0 || t == 0 {
            return Ok(vec![Vec::new(); b]);
        }
        let flat: Vec<u32> = padded
            .iter()
            .flatten()
            .map(|&id| if id == NO_PAD { 0 } else { id })
            .collect();
        let dev = self.model.device();
        let input = Tensor::from_vec(flat, (b, t), dev)?;
        // Trailing padding is never attended by the real tokens (causal), so every position is
        // marked real: position ids run 0..T as transformers' are for right padding, and a pad
        // id inside the text is attended as transformers does with the tokenizer's mask.
        let mask = Tensor::ones((b, t), DType::U32, dev)?;
        let h = self
            .model
            .forward_padded(&input, &mask)?
            .reshape((b * t, self.model.cfg.hidden_size))?;
        self.model
            .score_rows(&h)?
            .reshape((b, t))?
            .to_dtype(DType::F32)?
            .to_vec2()
    }
}

impl SequenceClassifier for ClassifierModel {
    fn tokenize(&self, text: &str) -> std::result::Result<Vec<u32>, ScorerError> {
        Ok(self.tokenizer.encode(text, false)?)
    }

    fn pad_token_id(&self) -> u32 {
        self.pad_token_id.unwrap_or(NO_PAD)
    }

    fn position_scores(
        &self,
        padded: &[Vec<u32>],
    ) -> std::result::Result<Vec<Vec<f32>>, ScorerError> {
        Ok(self.scores(padded)?)
    }
}

/// A process reward model (a two-label `*ForTokenClassification` checkpoint, e.g. one
/// `grpo-cli prm` trained) for the `process_reward_model` reward: `P(label 1)` at each position
/// of right-padded rows. Texts are encoded without special tokens and rows start with the
/// tokenizer's BOS when it has one, as the model was trained (TRL's PRMTrainer).
#[derive(Debug, Clone)]
pub struct TokenClassifierModel {
    model: Transformer,
    tokenizer: Tokenizer,
    bos: Option<u32>,
}

impl TokenClassifierModel {
    /// Loads a `*ForTokenClassification` directory with two labels; anything else is a
    /// one-line error naming the directory.
    pub fn load(dir: &Path, dtype: DType, device: &Device) -> Result<Self> {
        let loaded = crate::load(dir, dtype, device)?;
        match loaded.model.cfg.token_classification {
            Some(2) => {}
            Some(n) => bail!(
                "{}: a token classifier with {n} labels; a process reward model has two (incorrect, correct)",
                dir.display()
            ),
            None => bail!(
                "{}: not a token-classification checkpoint (expected *ForTokenClassification with two labels, as `grpo-cli prm` writes)",
                dir.display()
            ),
        }
        Ok(Self::new(loaded.model, loaded.tokenizer))
    }

    /// From a token classifier with two labels and its tokenizer.
    pub fn new(model: Transformer, tokenizer: Tokenizer) -> Self {
        let bos = tokenizer
            .bos_token
            .as_deref()
            .and_then(|t| tokenizer.inner.token_to_id(t));
        Self {
            model: model.detached(),
            tokenizer,
            bos,
        }
    }

    /// `P(label 1)` at every position of a right-padded batch `(B, T)`.
    pub fn probabilities(&self, padded: &[Vec<u32>]) -> Result<Vec<Vec<f32>>> {
        let t = padded.first().map_or(0, Vec::len);
        if padded.iter().any(|r| r.len() != t) {
            bail!("step_probabilities: rows of different lengths (expected a padded batch)");
        }
        if padded.is_empty() || t == 0 {
            return Ok(vec![Vec::new(); padded.len()]);
        }
        let rows: Vec<&[u32]> = padded.iter().map(Vec::as_slice).collect();
        let z = self
            .model
            .token_logits(&rows, self.tokenizer.pad_token_id)?
            .to_dtype(DType::F32)?;
        let z = z.broadcast_sub(&z.max_keepdim(candle_core::D::Minus1)?)?;
        let e = z.exp()?;
        let p = e
            .narrow(2, 1, 1)?
            .squeeze(2)?
            .div(&e.sum(candle_core::D::Minus1)?)?;
        p.to_vec2()
    }
}

#[cfg(feature = "rewards")]
impl grpo_rewards::builtin::StepClassifier for TokenClassifierModel {
    fn tokenize(&self, text: &str) -> std::result::Result<Vec<u32>, ScorerError> {
        Ok(self.tokenizer.encode(text, false)?)
    }

    fn bos_token_id(&self) -> Option<u32> {
        self.bos
    }

    fn pad_token_id(&self) -> u32 {
        self.tokenizer.pad_token_id
    }

    fn step_probabilities(
        &self,
        padded: &[Vec<u32>],
    ) -> std::result::Result<Vec<Vec<f32>>, ScorerError> {
        Ok(self.probabilities(padded)?)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scorers_are_send_and_sync() {
        fn check<T: Send + Sync + 'static>() {}
        check::<ModelScorer>();
        check::<ClassifierModel>();
        check::<TokenClassifierModel>();
    }
}
