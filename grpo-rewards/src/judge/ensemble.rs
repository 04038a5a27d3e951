//! Several judges as one reward.

use std::sync::Arc;

use serde_json::json;

use super::config::{EnsembleConfig, EnsembleMode};
use super::{Judge, JudgeCache, Verdict, counters_of};
use crate::error::{Result, RewardError};
use crate::reward::{AsyncReward, BoxFuture};
use crate::types::{RewardInput, RewardOutput};

/// Judges combined by weights (ArGen) or with escalation (RIM).
///
/// * `weighted`: the weighted mean `Σ w_j s_j / Σ w_j` over the judges that answered;
///   `None` when none did.
/// * `escalate`: the cheap `judges` first; when their scores' population standard deviation
///   exceeds `escalation_std`, or none of them answered, the `strong` judge is asked and its
///   score is the reward (the cheap mean when it fails too); otherwise the cheap mean.
///
/// Info per completion: `judges` (each judge's score, raw score, explanation, error),
/// `cheap_std` and `escalated` (escalate mode), `strong` (when asked).
#[derive(Debug)]
pub struct JudgeEnsemble {
    mode: EnsembleMode,
    judges: Vec<(Arc<Judge>, f32)>,
    strong: Option<Arc<Judge>>,
    escalation_std: f32,
}

impl JudgeEnsemble {
    /// Builds every judge (a judge without `cache_path` shares `shared_cache` when given).
    pub fn new(config: EnsembleConfig, shared_cache: Option<Arc<JudgeCache>>) -> Result<Self> {
        config.validate_at("")?;
        let mut names = std::collections::BTreeSet::new();
        for (i, j) in config.judges.iter().enumerate() {
            if !names.insert(j.judge.name.clone()) {
                return Err(RewardError::config(
                    format!("judges[{i}].name"),
                    format!(
                        "`{}` is used twice; judge names must be unique",
                        j.judge.name
                    ),
                ));
            }
        }
        let build = |c: &super::JudgeConfig| -> Result<Arc<Judge>> {
            match (&shared_cache, &c.cache_path) {
                (Some(cache), None) => Judge::with_cache(c.clone(), cache.clone()).map(Arc::new),
                _ => Judge::new(c.clone()).map(Arc::new),
            }
        };
        let judges = config
            .judges
            .iter()
            .map(|j| Ok((build(&j.judge)?, j.weight)))
            .collect::<Result<Vec<_>>>()?;
        let strong = config.strong.as_ref().map(build).transpose()?;
        Ok(Self {
            mode: config.mode,
            judges,
            strong,
            escalation_std: config.escalation_std,
        })
    }

    /// From judges already built (weighted mode).
    pub fn weighted(judges: Vec<(Arc<Judge>, f32)>) -> Self {
        Self {
            mode: EnsembleMode::Weighted,
            judges,
            strong: None,
            escalation_std: 0.0,
        }
    }

    /// From judges already built (escalate mode).
    pub fn escalating(cheap: Vec<Arc<Judge>>, strong: Arc<Judge>, escalation_std: f32) -> Self {
        Self {
            mode: EnsembleMode::Escalate,
            judges: cheap.into_iter().map(|j| (j, 1.0)).collect(),
            strong: Some(strong),
            escalation_std,
        }
    }

    /// The judges with their weights.
    pub fn judges(&self) -> &[(Arc<Judge>, f32)] {
        &self.judges
    }

    /// The strong judge, in escalate mode.
    pub fn strong(&self) -> Option<&Arc<Judge>> {
        self.strong.as_ref()
    }

    async fn one(
        &self,
        x: &RewardInput,
    ) -> Result<(Option<f32>, serde_json::Value, Vec<Verdict>, bool)> {
        let verdicts =
            futures_util::future::join_all(self.judges.iter().map(|(j, _)| j.judge(x))).await;
        let verdicts = verdicts.into_iter().collect::<Result<Vec<_>>>()?;
        let mut per = serde_json::Map::new();
        for ((j, _), v) in self.judges.iter().zip(&verdicts) {
            per.insert(j.name().to_owned(), v.to_json());
        }
        let mut info = serde_json::Map::new();
        info.insert("judges".into(), serde_json::Value::Object(per));
        let mut all = verdicts;
        let (score, escalated) = match self.mode {
            EnsembleMode::Weighted => {
                let (mut num, mut den) = (0.0f64, 0.0f64);
                for ((_, w), v) in self.judges.iter().zip(&all) {
                    if let Some(s) = v.score {
                        num += f64::from(*w) * f64::from(s);
                        den += f64::from(*w);
                    }
                }
                ((den > 0.0).then(|| (num / den) as f32), false)
            }
            EnsembleMode::Escalate => {
                let cheap: Vec<f64> = all.iter().filter_map(|v| v.score).map(f64::from).collect();
                let mean =
                    (!cheap.is_empty()).then(|| cheap.iter().sum::<f64>() / cheap.len() as f64);
                let std = mean.map(|m| {
                    (cheap.iter().map(|s| (s - m).powi(2)).sum::<f64>() / cheap.len() as f64).sqrt()
                });
                info.insert("cheap_std".into(), json!(std));
                let escalate = std.is_none_or(|s| s > f64::from(self.escalation_std));
                info.insert("escalated".into(), json!(escalate));
                match (&self.strong, escalate) {
                    (Some(strong), true) => {
                        let v = strong.judge(x).await?;
                        info.insert("strong".into(), v.to_json());
                        let s = v.score.or(mean.map(|m| m as f32));
                        all.push(v);
                        (s, true)
                    }
                    _ => (mean.map(|m| m as f32), false),
                }
            }
        };
        Ok((score, serde_json::Value::Object(info), all, escalated))
    }
}

impl AsyncReward for JudgeEnsemble {
    fn score_async<'a>(&'a self, batch: &'a [RewardInput]) -> BoxFuture<'a, Result<RewardOutput>> {
        Box::pin(async move {
            let results = futures_util::future::join_all(batch.iter().map(|x| self.one(x))).await;
            let mut out = RewardOutput::default();
            let mut verdicts = Vec::new();
            let mut escalations = 0.0;
            for r in results {
                let (score, info, vs, esc) = r?;
                out.scores.push(score);
                out.info.push(Some(info));
                verdicts.extend(vs);
                if esc {
                    escalations += 1.0;
                }
            }
            let refs: Vec<&Verdict> = verdicts.iter().collect();
            out.counters = counters_of(&refs);
            if self.mode == EnsembleMode::Escalate {
                out.counters.insert("judge/escalations".into(), escalations);
            }
            Ok(out)
        })
    }
}
