//! Model-based rewards on a tiny deterministic bigram scorer, against hand-computed values.
//!
//! Reference values come from this Python (plain `math`, same table and tokeniser):
//!
//! ```python
//! import math
//! L=[[1.0,0.0,-1.0,0.5],[0.2,0.3,0.1,-0.4],[2.0,-1.0,0.0,0.0],[0.0,0.0,0.0,1.5],[0.5,0.5,-0.5,0.0]]
//! BOS=4
//! def lsm(row,t):
//!     m=max(row); z=math.log(sum(math.exp(x-m) for x in row))+m; return row[t]-z
//! tok=lambda s:[ord(c)-97 for c in s if c in 'abcd']
//! def nll(p,c):
//!     P=tok(p);C=tok(c)
//!     if not C: return None
//!     ids=P+C; s=0
//!     for j in range(len(P),len(ids)):
//!         prev=ids[j-1] if j>0 else BOS
//!         s+=-lsm(L[prev],ids[j])
//!     return s/len(C)
//! def cov(c,a):
//!     C=tok(c);A=tok(a);m=min(len(C),len(A))
//!     if m==0: return 0.0
//!     ce=-sum(lsm(L[C[i]],A[i]) for i in range(m))/m
//!     return -ce*min(1,len(C)/len(A))
//! -nll("ab","cad"), -nll("","b"), -nll("dd","abcd")  # -0.96465822, -1.09004573, -1.85160831
//! cov("abca","cc"), cov("d","abc"), cov("bb","dcba")  # -2.05799815, -0.67081953, -0.80971451
//! ```

use std::sync::Arc;

use grpo_rewards::builtin::{
    CoverageCe, CoverageCeConfig, InverseLoss, LanguageScorer, RewardModel, RewardModelConfig,
    ScorerError, SequenceClassifier,
};
use grpo_rewards::{Reward, RewardInput, RewardsConfig, ScoringModels};

/// Bigram model over the vocabulary a, b, c, d; row 4 is the BOS row.
struct Bigram;

const TABLE: [[f32; 4]; 5] = [
    [1.0, 0.0, -1.0, 0.5],
    [0.2, 0.3, 0.1, -0.4],
    [2.0, -1.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 1.5],
    [0.5, 0.5, -0.5, 0.0],
];
const BOS: usize = 4;

fn log_softmax(row: &[f32; 4], t: u32) -> f32 {
    let m = row.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let z = row.iter().map(|x| (x - m).exp()).sum::<f32>().ln() + m;
    row[t as usize] - z
}

impl LanguageScorer for Bigram {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError> {
        Ok(text
            .chars()
            .filter(|c| ('a'..='d').contains(c))
            .map(|c| c as u32 - 'a' as u32)
            .collect())
    }

    fn completion_nll(&self, prompt: &str, completion: &str) -> Result<Option<f32>, ScorerError> {
        let p = self.tokenize(prompt)?;
        let c = self.tokenize(completion)?;
        if c.is_empty() {
            return Ok(None);
        }
        let ids: Vec<u32> = p.iter().chain(&c).copied().collect();
        let mut s = 0.0;
        for j in p.len()..ids.len() {
            let prev = if j == 0 { BOS } else { ids[j - 1] as usize };
            s -= log_softmax(&TABLE[prev], ids[j]);
        }
        Ok(Some(s / c.len() as f32))
    }

    fn aligned_log_probs(&self, text: &str, targets: &[u32]) -> Result<Vec<f32>, ScorerError> {
        let ids = self.tokenize(text)?;
        Ok(ids
            .iter()
            .zip(targets)
            .map(|(&t, &a)| log_softmax(&TABLE[t as usize], a))
            .collect())
    }
}

fn close(a: Option<f32>, b: f64) {
    let a = a.expect("a score");
    assert!((f64::from(a) - b).abs() < 1e-5, "{a} vs {b}");
}

#[test]
fn inverse_loss_matches_reference() {
    let r = InverseLoss::new(Arc::new(Bigram));
    let batch = [
        RewardInput::new("ab", "cad"),
        RewardInput::new("", "b"),
        RewardInput::new("dd", "abcd"),
        RewardInput::new("abc", ""),
    ];
    let out = r.score(&batch).unwrap();
    close(out.scores[0], -0.9646582200613016);
    close(out.scores[1], -1.0900457339193235);
    close(out.scores[2], -1.851608309555306);
    assert_eq!(out.scores[3], Some(0.0), "empty completion scores 0");
}

#[test]
fn coverage_ce_matches_reference() {
    let r = CoverageCe::new(Arc::new(Bigram), CoverageCeConfig::default()).unwrap();
    let batch = [
        RewardInput::new("q", "abca").with_field("answer", "cc"),
        RewardInput::new("q", "d").with_field("answer", "abc"),
        RewardInput::new("q", "bb").with_field("answer", "dcba"),
        RewardInput::new("q", "").with_field("answer", "abc"),
        RewardInput::new("q", "xyz").with_field("answer", "abc"),
    ];
    let out = r.score(&batch).unwrap();
    close(out.scores[0], -2.0579981453041736);
    close(out.scores[1], -0.6708195260124397);
    close(out.scores[2], -0.8097145107172778);
    assert_eq!(out.scores[3], Some(0.0), "min_len 0 → 0");
    assert_eq!(out.scores[4], Some(0.0), "no tokens → 0");
}

#[test]
fn coverage_ce_names_missing_answer() {
    let r = CoverageCe::new(Arc::new(Bigram), CoverageCeConfig::default()).unwrap();
    let err = r
        .score(&[RewardInput::new("q", "ab")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("sample 0") && err.contains("answer"), "{err}");
}

/// Scores each position with the running sum of ids + 1; pad id is 0.
struct SumClassifier;

impl SequenceClassifier for SumClassifier {
    fn tokenize(&self, text: &str) -> Result<Vec<u32>, ScorerError> {
        Ok(text.bytes().map(|b| u32::from(b - b'0')).collect())
    }
    fn pad_token_id(&self) -> u32 {
        0
    }
    fn position_scores(&self, padded: &[Vec<u32>]) -> Result<Vec<Vec<f32>>, ScorerError> {
        Ok(padded
            .iter()
            .map(|row| {
                let mut s = 0.0;
                row.iter()
                    .enumerate()
                    .map(|(i, &t)| {
                        s += t as f32;
                        // Position-dependent so reading the wrong index shows.
                        s + i as f32 * 100.0
                    })
                    .collect()
            })
            .collect())
    }
}

#[test]
fn reward_model_reads_last_non_pad_token() {
    let rm = RewardModel::new(
        Arc::new(SumClassifier),
        RewardModelConfig {
            include_prompt: true,
            batch_size: 2,
        },
    )
    .unwrap();
    // "1"+"2" → ids [1,2] last index 1 → 3 + 100; "" + "" → all pad → None;
    // "1"+"23" → [1,2,3] → 6 + 200; "" + "5" → [5] padded alone → 5.
    let batch = [
        RewardInput::new("1", "2"),
        RewardInput::new("", ""),
        RewardInput::new("1", "23"),
        RewardInput::new("", "5"),
    ];
    let out = rm.score(&batch).unwrap();
    assert_eq!(out.scores, vec![Some(103.0), None, Some(206.0), Some(5.0)]);
}

#[test]
fn model_rewards_from_config_need_models() {
    let cfg: RewardsConfig = toml::from_str(
        r#"
        [[rewards]]
        type = "inverse_loss"
        [[rewards]]
        type = "coverage_ce"
        answer_field = "solution"
        "#,
    )
    .unwrap();
    let err = cfg
        .build(&ScoringModels::default())
        .unwrap_err()
        .to_string();
    assert!(err.contains("rewards[0].type"), "{err}");
    let models = ScoringModels {
        language: Some(Arc::new(Bigram)),
        classifier: None,
        ..Default::default()
    };
    let set = cfg.build(&models).unwrap();
    let out = set
        .score(&[RewardInput::new("ab", "cad").with_field("solution", "cc")])
        .unwrap();
    assert_eq!(out.names, vec!["inverse_loss", "coverage_ce"]);
    close(out.per_function[0][0], -0.9646582200613016);
}

#[test]
fn inverse_loss_with_the_policy_needs_a_policy_scorer() {
    let cfg: RewardsConfig = serde_json::from_value(serde_json::json!({
        "rewards": [{"type": "inverse_loss", "model": "policy"}]
    }))
    .unwrap();
    // The reference model alone does not do: the policy comes from a trainer.
    let only_reference = ScoringModels {
        language: Some(Arc::new(Bigram)),
        ..Default::default()
    };
    let err = cfg.build(&only_reference).unwrap_err().to_string();
    assert!(err.contains("rewards[0].model"), "{err}");
    let with_policy = ScoringModels {
        policy: Some(Arc::new(Bigram)),
        ..Default::default()
    };
    let set = cfg.build(&with_policy).unwrap();
    let out = set.score(&[RewardInput::new("ab", "cad")]).unwrap();
    assert!(
        out.rewards[0].is_finite() && out.rewards[0] < 0.0,
        "{:?}",
        out.rewards
    );
    let bad = serde_json::from_value::<RewardsConfig>(serde_json::json!({
        "rewards": [{"type": "inverse_loss", "model": "teacher"}]
    }))
    .unwrap_err()
    .to_string();
    assert!(bad.contains("reference") && bad.contains("policy"), "{bad}");
}
