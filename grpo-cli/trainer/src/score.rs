//! A file of completions scored with a config's rewards, without training (`grpo-cli score`):
//! try a reward on real answers — math_verify on a model's outputs, a judge's prompt, a Python
//! function — before a run depends on it.
//!
//! Each row gives a prompt (the config's `data.prompt_field`: text or a conversation), a
//! completion (text, or TRL's conversational `[{"role": "assistant", "content": ...}]`) and the
//! columns the rewards read (`solution`, `answer`, ...). Token ids come from the model's
//! tokenizer (`model.path`), as in training; model-based rewards load their models as a run does.

use std::path::Path;
use std::sync::Arc;

use anyhow::{Context, Result, anyhow, bail};
use grpo_data::{Dataset, OpenOptions, Prompt, Value as DataValue};
use grpo_rewards::{Message, RewardInput, RewardKind, ScoringModels, nan_mean, nan_std};
use serde_json::{Value, json};

use crate::config::TrainConfig;
use crate::stages::scorer::to_field;

/// What scoring a file gives.
#[derive(Debug, Clone)]
pub struct ScoredFile {
    /// The rewards' names, in order.
    pub names: Vec<String>,
    /// Per row: `index`, `reward` (the combined reward, `null` when no function scored it),
    /// `rewards` (each function's score) and `info` (each function's details).
    pub rows: Vec<Value>,
    /// Per reward: `mean`, `std` (over the rows it scored) and `scored` (how many); and the
    /// combined reward's (`reward`).
    pub summary: Value,
}

/// Mean, std (one value: 0) and count of the values a reward gave.
fn stats(values: &[Option<f32>]) -> Value {
    let scored = values.iter().flatten().filter(|v| !v.is_nan()).count();
    if scored == 0 {
        return json!({"mean": null, "std": null, "scored": 0});
    }
    let std = if scored == 1 { 0.0 } else { nan_std(values) };
    json!({"mean": nan_mean(values), "std": std, "scored": scored})
}

/// Scores every row of `data` with `cfg`'s rewards, `batch` rows per call.
pub fn score_file(
    cfg: &TrainConfig,
    data: &Path,
    completion_field: &str,
    batch: usize,
) -> Result<ScoredFile> {
    if cfg.rewards.is_empty() {
        bail!("the config has no [[rewards]] to score with");
    }
    let options = OpenOptions {
        prompt_field: cfg.data.prompt_field.clone(),
        ..OpenOptions::default()
    };
    let path = data.display().to_string();
    let dataset = Dataset::open(&[path.as_str()], &options).map_err(|e| anyhow!("{e}"))?;
    dataset
        .require_column(completion_field, "grpo-cli score (--completion-field)")
        .map_err(|e| anyhow!("{e}"))?;
    let samples = dataset
        .head(dataset.len() as usize)
        .map_err(|e| anyhow!("{e}"))?;

    // Token ids as in training: the model's tokenizer, when the model is there.
    let tokenizer = grpo_rollout::loader::load_tokenizer(&cfg.model.path).ok();
    let mut models = ScoringModels::default();
    let needs = |f: &dyn Fn(&RewardKind) -> bool| cfg.rewards.iter().any(|r| f(&r.kind));
    if needs(&|k| matches!(k, RewardKind::InverseLoss(_) | RewardKind::CoverageCe(_))) {
        let device = cfg
            .model
            .device
            .device()
            .map_err(|e| anyhow!("model.device: {e}"))?;
        let scorer = grpo_rollout::scoring::ModelScorer::load(
            &cfg.model.path,
            cfg.model.dtype.dtype(),
            &device,
        )
        .map_err(|e| anyhow!("model.path {}: {e}", cfg.model.path.display()))?;
        models.language = Some(Arc::new(scorer));
    }
    if needs(&|k| matches!(k, RewardKind::RewardModel(_))) {
        let rm = cfg
            .reward_model_path
            .as_ref()
            .context("a `reward_model` reward needs `reward_model_path` (a *ForSequenceClassification directory)")?;
        let device = cfg
            .reward_model_device
            .unwrap_or(cfg.model.device)
            .device()
            .map_err(|e| anyhow!("reward_model_device: {e}"))?;
        let dtype = cfg
            .reward_model_dtype
            .map_or(cfg.model.dtype.dtype(), |d| d.dtype());
        let classifier = grpo_rollout::scoring::ClassifierModel::load(rm, dtype, &device)
            .map_err(|e| anyhow!("reward_model_path {}: {e}", rm.display()))?;
        models.classifier = Some(Arc::new(classifier));
    }
    if cfg
        .rewards
        .iter()
        .any(|r| matches!(r.kind, RewardKind::ProcessRewardModel(_)))
    {
        let device = cfg
            .model
            .device
            .device()
            .map_err(|e| anyhow!("model.device: {e}"))?;
        models.step_classifiers = crate::setup::process_reward_models(
            &cfg.rewards,
            cfg.model.device,
            &device,
            cfg.model.dtype.dtype(),
        )?;
    }
    let workers = grpo_rewards::python::PythonWorkers::new();
    let set = cfg
        .rewards_config()
        .build_with(&models, &workers)
        .map_err(|e| anyhow!("config: {e}"))?;

    let mut rows = Vec::with_capacity(samples.len());
    let mut names = Vec::new();
    let mut per: Vec<Vec<Option<f32>>> = Vec::new();
    let mut combined: Vec<Option<f32>> = Vec::new();
    for chunk in samples.chunks(batch.max(1)) {
        let mut inputs = Vec::with_capacity(chunk.len());
        for s in chunk {
            let completion = s.get(completion_field).unwrap_or(&DataValue::Null);
            let (text, messages) = match completion {
                DataValue::Messages(m) => (
                    m.iter()
                        .map(|m| m.content.as_str())
                        .collect::<Vec<_>>()
                        .join("\n"),
                    Some(
                        m.iter()
                            .map(|m| Message::new(m.role.clone(), m.content.clone()))
                            .collect::<Vec<_>>(),
                    ),
                ),
                v => (v.as_text().unwrap_or_default(), None),
            };
            let mut x = RewardInput::new(s.prompt.text(), text.clone());
            if let Some(t) = &tokenizer {
                let ids = t
                    .encode(&text, false)
                    .map_err(|e| anyhow!("row {}: tokenizing the completion: {e}", s.index))?;
                x = x.with_ids(ids);
            }
            if let Prompt::Conversation(m) = &s.prompt {
                x = x.with_messages(
                    m.iter()
                        .map(|m| Message::new(m.role.clone(), m.content.clone()))
                        .collect(),
                );
            }
            if let Some(m) = messages {
                x = x.with_completion_messages(m);
            }
            for (k, v) in &s.columns {
                if k.as_ref() != completion_field {
                    x = x.with_field(k.to_string(), to_field(v));
                }
            }
            inputs.push(x);
        }
        let scored = set.score(&inputs).map_err(|e| anyhow!("{e}"))?;
        if names.is_empty() {
            names = scored.names.clone();
            per = vec![Vec::new(); names.len()];
        }
        for (i, s) in chunk.iter().enumerate() {
            let mut rewards = serde_json::Map::new();
            let mut info = serde_json::Map::new();
            for (k, name) in names.iter().enumerate() {
                let v = scored.per_function[k][i];
                rewards.insert(name.clone(), v.map_or(Value::Null, |v| json!(v)));
                per[k].push(v);
                if let Some(Some(extra)) = scored.info.get(k).and_then(|f| f.get(i)) {
                    info.insert(name.clone(), extra.clone());
                }
            }
            let r = scored.rewards[i];
            combined.push(Some(r));
            rows.push(json!({
                "index": s.index,
                "reward": if r.is_nan() { Value::Null } else { json!(r) },
                "rewards": rewards,
                "info": info,
            }));
        }
    }
    let mut summary = serde_json::Map::new();
    for (k, name) in names.iter().enumerate() {
        summary.insert(name.clone(), stats(&per[k]));
    }
    summary.insert("reward".into(), stats(&combined));
    summary.insert("rows".into(), json!(samples.len()));
    Ok(ScoredFile {
        names,
        rows,
        summary: Value::Object(summary),
    })
}
