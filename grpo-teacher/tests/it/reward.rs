//! AdaptiveTeachingReward: reference values, properties, extraction, the reward over a batch
//! (exact match and a reward set as the correctness signal, with RIM info).
#![allow(clippy::unwrap_used, missing_docs)]

use std::sync::Arc;

use grpo_rewards::{AsyncReward, RewardInput, RewardOutput, RewardSet};
use grpo_teacher::reward::{
    FIELD_BASELINE_RESPONSE, FIELD_QUESTION, FIELD_STUDENT_RESPONSE, FIELD_TEACHING_TOKENS,
};
use grpo_teacher::{
    AdaptiveTeachingReward, Correctness, TeachingRewardParams, efficiency_bonus, exact_match,
    extract_solution, extract_teaching,
};
use proptest::prelude::*;

/// Reference values, computed by hand from ATLAS's formula
/// (delta < 0 → −m·|delta|; else delta·(1 + w·100/(100 + L))):
/// ```python
/// def r(w, b, L, m=2.0, e=1.0):
///     d = w - b
///     return -m * abs(d) if d < 0 else d * (1 + e * 100 / (100 + L))
/// [r(1,0,0), r(1,0,50), r(1,0,300), r(0,1,7), r(1,1,9), r(0,0,9), r(0.75,0.25,100),
///  r(0.2,0.7,10, m=3), r(1,0,100, e=0.5)]
/// # [2.0, 1.6666666666666667, 1.25, -2.0, 0.0, 0.0, 0.75, -1.5, 1.25]
/// ```
#[test]
fn reward_reference_values() {
    let p = TeachingRewardParams::default();
    let cases = [
        (p.reward(1.0, 0.0, 0), 2.0),
        (p.reward(1.0, 0.0, 50), 1.666_666_7),
        (p.reward(1.0, 0.0, 300), 1.25),
        (p.reward(0.0, 1.0, 7), -2.0),
        (p.reward(1.0, 1.0, 9), 0.0),
        (p.reward(0.0, 0.0, 9), 0.0),
        (p.reward(0.75, 0.25, 100), 0.75),
        (
            TeachingRewardParams {
                degradation_penalty_multiplier: 3.0,
                efficiency_weight: 1.0,
            }
            .reward(0.2, 0.7, 10),
            -1.5,
        ),
        (
            TeachingRewardParams {
                degradation_penalty_multiplier: 2.0,
                efficiency_weight: 0.5,
            }
            .reward(1.0, 0.0, 100),
            1.25,
        ),
    ];
    for (i, (got, want)) in cases.iter().enumerate() {
        assert!((got - want).abs() < 1e-6, "case {i}: {got} vs {want}");
    }
}

proptest! {
    /// For a fixed teaching length, the reward never decreases as delta grows.
    #[test]
    fn monotone_in_delta(
        b in 0.0f32..1.0, d1 in -1.0f32..1.0, d2 in -1.0f32..1.0, len in 0usize..5000,
        m in 0.0f32..5.0, e in 0.0f32..3.0,
    ) {
        let p = TeachingRewardParams { degradation_penalty_multiplier: m, efficiency_weight: e };
        let (lo, hi) = if d1 <= d2 { (d1, d2) } else { (d2, d1) };
        prop_assert!(p.reward(b + lo, b, len) <= p.reward(b + hi, b, len) + 1e-6);
    }

    /// Degradation costs exactly m·|delta|, whatever the length.
    #[test]
    fn penalty_branch(w in 0.0f32..1.0, b in 0.0f32..1.0, len in 0usize..5000, m in 0.0f32..5.0) {
        prop_assume!(w < b);
        let p = TeachingRewardParams { degradation_penalty_multiplier: m, efficiency_weight: 1.0 };
        prop_assert!((p.reward(w, b, len) + m * (b - w)).abs() < 1e-5);
    }

    /// The brevity bonus is in (0, 1], 1 only for an empty teaching, and shrinks with length.
    #[test]
    fn efficiency_bonus_in_unit_interval(len in 0usize..1_000_000, extra in 1usize..1000) {
        let b = efficiency_bonus(len);
        prop_assert!(b > 0.0 && b <= 1.0);
        prop_assert!(efficiency_bonus(len + extra) < b || b < 1e-3);
        prop_assert_eq!(efficiency_bonus(0), 1.0);
    }

    /// A helpful teaching earns between delta and delta·(1 + w).
    #[test]
    fn improvement_bounded(w in 0.0f32..1.0, b in 0.0f32..1.0, len in 0usize..5000, e in 0.0f32..3.0) {
        prop_assume!(w >= b);
        let p = TeachingRewardParams { degradation_penalty_multiplier: 2.0, efficiency_weight: e };
        let r = p.reward(w, b, len);
        let d = w - b;
        prop_assert!(r >= d - 1e-6 && r <= d * (1.0 + e) + 1e-6);
    }
}

#[test]
fn solution_extraction() {
    assert_eq!(extract_solution("<solution>42</solution>"), "42");
    assert_eq!(
        extract_solution("x <solution>\n  7 apples \n</solution> y"),
        "7 apples"
    );
    assert_eq!(
        extract_solution("<solution>1</solution> wait: <solution>2</solution>"),
        "2"
    );
    assert_eq!(extract_solution("no tags, 42"), "");
    assert_eq!(extract_solution("<solution>unclosed 42"), "");
    assert_eq!(extract_solution("<SOLUTION>42</SOLUTION>"), "");
    assert_eq!(extract_solution("<solution></solution>"), "");
    assert_eq!(
        extract_teaching("think... <teaching> add the tens </teaching>"),
        "add the tens"
    );
    assert_eq!(extract_teaching("  just a hint "), "just a hint");
    assert!(exact_match("Paris", " paris "));
    assert!(exact_match("ÉTÉ", "été"));
    assert!(!exact_match("", ""));
    assert!(!exact_match("42.0", "42"));
}

fn teaching_input(
    question: &str,
    with: &str,
    without: &str,
    tokens: i64,
    answer: Option<&str>,
) -> RewardInput {
    let mut x = RewardInput::new("teacher prompt", "<teaching>hint</teaching>")
        .with_field(FIELD_QUESTION, question)
        .with_field(FIELD_STUDENT_RESPONSE, with)
        .with_field(FIELD_BASELINE_RESPONSE, without)
        .with_field(FIELD_TEACHING_TOKENS, tokens);
    if let Some(a) = answer {
        x = x.with_field("answer", a);
    }
    x
}

fn score(r: &AdaptiveTeachingReward, batch: &[RewardInput]) -> RewardOutput {
    let rt = tokio::runtime::Builder::new_current_thread()
        .build()
        .unwrap();
    rt.block_on(r.score_async(batch)).unwrap()
}

#[test]
fn exact_match_reward_over_a_batch() {
    let r = AdaptiveTeachingReward::exact_match(TeachingRewardParams::default(), "answer");
    let batch = vec![
        // helped: wrong → right, 50 tokens
        teaching_input(
            "q1",
            "<solution>4</solution>",
            "<solution>5</solution>",
            50,
            Some("4"),
        ),
        // harmed: right → wrong
        teaching_input(
            "q1",
            "<solution>3</solution>",
            "<solution>4</solution>",
            10,
            Some("4"),
        ),
        // no change (both right)
        teaching_input(
            "q2",
            "<solution>B</solution>",
            "<solution>b</solution>",
            10,
            Some("b"),
        ),
        // no tags: wrong
        teaching_input("q2", "b", "<solution>b</solution>", 10, Some("b")),
        // no ground truth: no opinion
        teaching_input("q3", "<solution>1</solution>", "", 10, None),
    ];
    let out = score(&r, &batch);
    let want = [
        Some(1.0 + 100.0 / 150.0),
        Some(-2.0),
        Some(0.0),
        Some(-2.0),
        None,
    ];
    for (i, (g, w)) in out.scores.iter().zip(want).enumerate() {
        match (g, w) {
            (Some(g), Some(w)) => assert!((g - w).abs() < 1e-6, "{i}: {g} vs {w}"),
            (None, None) => {}
            _ => panic!("{i}: {g:?} vs {w:?}"),
        }
    }
    // Accuracies over the 4 decidable teachings: with 2/4, baseline 3/4 (1 + 0 + 1 + 1).
    assert_eq!(out.counters["teacher/with_teaching_accuracy"], 0.5);
    assert_eq!(out.counters["teacher/baseline_accuracy"], 0.75);
    assert_eq!(out.counters["teacher/degradation_rate"], 0.5);
    assert_eq!(out.counters["teacher/mean_teaching_tokens"], 18.0);
    let info = out.info[0].as_ref().unwrap();
    assert_eq!(info["with_teaching"], 1.0);
    assert_eq!(info["baseline"], 0.0);
    assert_eq!(info["teaching_tokens"], 50);
}

#[test]
fn a_reward_set_replaces_exact_match_and_its_judges_are_logged() {
    // A stand-in for a RIM judge ensemble: an async reward that gives each answer the number
    // after "score=" and reports it as two judges' verdicts, in the ensemble's info layout.
    struct Rim;
    impl AsyncReward for Rim {
        fn score_async<'a>(
            &'a self,
            batch: &'a [RewardInput],
        ) -> grpo_rewards::BoxFuture<'a, grpo_rewards::Result<RewardOutput>> {
            Box::pin(async move {
                let mut out = RewardOutput::default();
                for x in batch {
                    assert_eq!(x.prompt, "the question");
                    let s: f32 = x
                        .completion
                        .split("score=")
                        .nth(1)
                        .and_then(|v| v.trim().parse().ok())
                        .unwrap_or(0.0);
                    out.scores.push(Some(s));
                    out.info.push(Some(serde_json::json!({"judges": {
                        "helpfulness": {"score": s, "explanation": "clear"},
                        "process": {"score": s, "explanation": "sound"},
                    }})));
                }
                out.counters.insert("judge/failures".into(), 0.0);
                Ok(out)
            })
        }
    }
    let set = RewardSet::new().with_async_reward("rim", 1.0, Rim);
    let r = AdaptiveTeachingReward {
        params: TeachingRewardParams::default(),
        correctness: Correctness::Rewards(Arc::new(set)),
    };
    let batch = vec![
        teaching_input("the question", "score=0.9", "score=0.4", 100, None),
        teaching_input("the question", "score=0.2", "score=0.4", 100, None),
    ];
    let out = score(&r, &batch);
    let a = out.scores[0].unwrap();
    let b = out.scores[1].unwrap();
    assert!((a - 0.5 * 1.5).abs() < 1e-6, "{a}");
    assert!((b + 2.0 * 0.2).abs() < 1e-6, "{b}");
    let info = out.info[0].as_ref().unwrap();
    assert_eq!(
        info["rim_rewards"]["helpfulness"],
        serde_json::json!(0.9f32)
    );
    assert_eq!(info["rim_explanations"]["process"], "sound");
    assert!(out.counters.contains_key("judge/failures"));
}
