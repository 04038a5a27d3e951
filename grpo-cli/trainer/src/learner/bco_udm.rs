//! BCO's underlying distribution matching (`[bco] embedding_model_name_or_path`, TRL's
//! BCOTrainer with an `embedding_func`): before the first step, prompts drawn from the
//! desirable and the undesirable rows are embedded (the embedding model's final hidden states
//! averaged over the prompt's tokens) and grpo-core's [`UdmClassifier`] is fitted on them; each
//! micro-batch's undesirable rows then weigh their loss by the density ratio of their prompt.
//! The classifier is part of the trainer state, so a checkpoint holds it and a resumed run
//! keeps it (TRL saves its `clf.pkl` and skips the fit on resume).

use anyhow::{Context, Result, anyhow};
use grpo_core::udm::UdmClassifier;

use super::Learner;
use super::supervised::Row;
use crate::setup::Setup;

impl Learner {
    /// Fits the UDM classifier when this BCO run has an embedding model and no classifier yet
    /// (a resumed run keeps its own): `bco.prompt_sample_size` prompts drawn with replacement
    /// (seed `train.seed`) from each side of the training rows. Returns the classifier's
    /// accuracy on each side's sample (what TRL logs), or `None` when there is nothing to fit.
    pub(crate) fn udm_fit(&mut self, setup: &Setup) -> Result<Option<(f64, f64)>> {
        if self.udm_embedder.is_none() || self.state.bco_udm.is_some() {
            return Ok(None);
        }
        let samples = setup
            .train
            .head(setup.train.len() as usize)
            .map_err(|e| anyhow!("training data: {e}"))?;
        let (good, bad): (Vec<_>, Vec<_>) =
            super::supervised::rows(&self.cfg, &self.tokenizer, &samples)?
                .into_iter()
                .partition(|r| r.desirable);
        let good: Vec<Vec<u32>> = good.into_iter().map(|r| r.prompt).collect();
        let bad: Vec<Vec<u32>> = bad.into_iter().map(|r| r.prompt).collect();
        if good.is_empty() || bad.is_empty() {
            anyhow::bail!(
                "bco.embedding_model_name_or_path: UDM needs desirable and undesirable rows, the \
                 training data has {} and {}",
                good.len(),
                bad.len()
            );
        }
        let mut rng = grpo_data::rng::SeededRng::new(self.cfg.train.seed);
        let mut draw = |side: &[Vec<u32>]| -> Vec<Vec<u32>> {
            let n = side.len().min(self.cfg.bco.prompt_sample_size);
            (0..n)
                .map(|_| side[rng.below(side.len() as u64) as usize].clone())
                .collect()
        };
        let (good, bad) = (draw(&good), draw(&bad));
        let eg = self.udm_embed(&good.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
        let eb = self.udm_embed(&bad.iter().map(Vec::as_slice).collect::<Vec<_>>())?;
        let labels: Vec<bool> = (0..eg.len() + eb.len()).map(|i| i < eg.len()).collect();
        let all: Vec<Vec<f32>> = eg.iter().chain(&eb).cloned().collect();
        let clf = UdmClassifier::fit(&all, &labels)
            .map_err(|e| anyhow!("bco.embedding_model_name_or_path: {e}"))?;
        let acc = (clf.accuracy(&eg, true), clf.accuracy(&eb, false));
        self.state.bco_udm = Some(clf);
        Ok(Some(acc))
    }

    /// The embeddings of prompts given as the policy's token ids: decoded, encoded with the
    /// embedding model's tokenizer (no special tokens added, as TRL's), mean-pooled final hidden
    /// states, a micro-batch at a time.
    fn udm_embed(&self, prompts: &[&[u32]]) -> Result<Vec<Vec<f32>>> {
        let (model, tok) = self
            .udm_embedder
            .as_ref()
            .context("BCO's UDM needs its embedding model")?;
        let mut out = Vec::with_capacity(prompts.len());
        for chunk in prompts.chunks(self.cfg.micro_batch().max(1)) {
            let ids = chunk
                .iter()
                .map(|p| {
                    let text = self.tokenizer.decode(p, false)?;
                    let ids = tok.encode(&text, false)?;
                    match ids.is_empty() {
                        true => Ok(vec![tok.pad_token_id]),
                        false => Ok(ids),
                    }
                })
                .collect::<Result<Vec<Vec<u32>>>>()?;
            let refs: Vec<&[u32]> = ids.iter().map(Vec::as_slice).collect();
            out.extend(model.mean_hidden(&refs)?.to_vec2::<f32>()?);
        }
        Ok(out)
    }

    /// Each row's UDM weight: 1 for a desirable row, its prompt's clamped density ratio for an
    /// undesirable one; `None` without UDM.
    pub(crate) fn udm_weights(&self, part: &[Row]) -> Result<Option<Vec<f64>>> {
        let Some(clf) = &self.state.bco_udm else {
            return Ok(None);
        };
        if self.udm_embedder.is_none() {
            return Ok(None);
        }
        let bad: Vec<&[u32]> = part
            .iter()
            .filter(|r| !r.desirable)
            .map(|r| r.prompt.as_slice())
            .collect();
        let e = match bad.is_empty() {
            true => Vec::new(),
            false => self.udm_embed(&bad)?,
        };
        let b = &self.cfg.bco;
        let mut e = e.iter();
        Ok(Some(
            part.iter()
                .map(|r| match r.desirable {
                    true => 1.0,
                    false => e.next().map_or(1.0, |x| {
                        clf.density_ratio(x, b.min_density_ratio, b.max_density_ratio)
                    }),
                })
                .collect(),
        ))
    }
}
