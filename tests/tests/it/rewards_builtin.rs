//! Built-in rewards, the combination math and the configs.

use grpo_rewards::builtin::{
    Accuracy, AccuracyConfig, Format, FormatConfig, Overlong, OverlongConfig, answers_match,
    extract_answer, extract_boxed, latex_value, overlong_penalty,
};
use grpo_rewards::{
    FieldValue, Reward, RewardInput, RewardSet, RewardsConfig, ScoringModels, combine_rewards,
    nan_mean, nan_std,
};
use proptest::prelude::*;

#[test]
fn extraction_prefers_tags_then_boxed_then_last_number() {
    assert_eq!(
        extract_answer("x <answer> 42 </answer> 7").as_deref(),
        Some("42")
    );
    assert_eq!(
        extract_answer("<answer>1</answer> then <answer>2</answer>").as_deref(),
        Some("2")
    );
    assert_eq!(
        extract_answer("<solution>Paris</solution>").as_deref(),
        Some("Paris")
    );
    assert_eq!(
        extract_answer(r"so \boxed{\frac{1}{2}} done").as_deref(),
        Some(r"\frac{1}{2}")
    );
    assert_eq!(
        extract_answer(r"<answer>the value is \boxed{7}</answer>").as_deref(),
        Some("7")
    );
    assert_eq!(
        extract_answer("3 apples and 1,250 pears.").as_deref(),
        Some("1,250")
    );
    assert_eq!(extract_answer("it is -0.5 or 3/4").as_deref(), Some("3/4"));
    assert_eq!(extract_answer("no digits here"), None);
    assert_eq!(extract_boxed(r"\boxed{a{b}c"), None, "unbalanced");
    assert_eq!(extract_boxed(r"\boxed{a{b}c}").as_deref(), Some("a{b}c"));
}

#[test]
fn numbers_and_text_compare() {
    assert!(answers_match("1,000", "1000", 1e-6, 1e-6));
    assert!(answers_match("0.75", "3/4", 1e-6, 1e-6));
    assert!(answers_match(r"\frac{3}{4}", "0.75", 1e-6, 1e-6));
    assert!(answers_match("$5", "5.0", 1e-6, 1e-6));
    assert!(answers_match("50%", "50", 1e-6, 1e-6));
    assert!(!answers_match("5.1", "5", 1e-6, 1e-6));
    assert!(answers_match("5.1", "5", 0.2, 0.0));
    assert!(answers_match("  New   york ", "new York", 0.0, 0.0));
    assert!(!answers_match("Paris", "London", 0.0, 0.0));
}

#[test]
fn closed_form_latex_answers_compare_by_value() {
    let pi = std::f64::consts::PI;
    for (text, want) in [
        (r"2\sqrt{2}", 8f64.sqrt()),
        (r"\sqrt{8}", 8f64.sqrt()),
        (r"\sqrt2", 2f64.sqrt()),
        (r"\frac{\pi}{4}", pi / 4.0),
        (r"\dfrac{3\sqrt{3}}{2}", 1.5 * 3f64.sqrt()),
        (r"\frac12", 0.5),
        (r"\tfrac{1}{3}", 1.0 / 3.0),
        (r"2^{10}", 1024.0),
        (r"2^3", 8.0),
        (r"-\frac{1}{2}", -0.5),
        (r"\left(1+\sqrt{5}\right)/2", (1.0 + 5f64.sqrt()) / 2.0),
        (r"3 \cdot 4", 12.0),
        (r"6\div 4", 1.5),
        (r"3\pi", 3.0 * pi),
        (r"\sqrt[3]{27}", 3.0),
        (r"\sqrt[3]{-8}", -2.0),
        (r"$\frac{2}{4}$", 0.5),
        (r"2(3+1)", 8.0),
        (r"10^{-2}", 0.01),
        ("1.5.", 1.5),
    ] {
        let v = latex_value(text).unwrap_or_else(|| panic!("{text}"));
        assert!(
            (v - want).abs() < 1e-12 * want.abs().max(1.0),
            "{text}: {v} vs {want}"
        );
    }
    // Not closed-form numbers: a variable, a list, an interval, text, a command we do not know,
    // unbalanced braces, a division by zero.
    for text in [
        "x+1",
        "2,3",
        "(1,2)",
        "abc",
        r"\sin{1}",
        r"\frac{1}{2",
        r"\frac{1}{0}",
        r"90^\circ",
        r"\pink",
        "",
    ] {
        assert_eq!(latex_value(text), None, "{text}");
    }
    // Forms of one value are one answer; others are not.
    assert!(answers_match(r"\sqrt{8}", r"2\sqrt{2}", 1e-6, 1e-6));
    assert!(answers_match(r"\frac{2}{4}", r"\frac{1}{2}", 1e-6, 1e-6));
    assert!(answers_match(
        r"\frac{\sqrt{3}}{2}",
        "0.8660254",
        1e-6,
        1e-6
    ));
    assert!(!answers_match(r"\sqrt{2}", "1.41", 1e-6, 1e-6));
    assert!(!answers_match(r"2\sqrt{3}", r"3\sqrt{2}", 1e-6, 1e-6));
    assert!(!answers_match("x+1", "1+x", 1e-6, 1e-6));
    let acc = Accuracy::default();
    let out = acc
        .score(&[
            RewardInput::new("q", r"so \boxed{\frac{\sqrt{8}}{2}}")
                .with_field("answer", r"\sqrt{2}"),
            RewardInput::new("q", r"\boxed{\sqrt{3}}").with_field("answer", r"\sqrt{2}"),
        ])
        .unwrap();
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0)]);
}

#[test]
fn accuracy_scores_one_or_zero_and_reads_gsm8k_answers() {
    let acc = Accuracy::default();
    let batch = [
        RewardInput::new("q", "<answer>72</answer>")
            .with_field("answer", "Natalia sold ... #### 72"),
        RewardInput::new("q", "I think 71").with_field("answer", FieldValue::Int(72)),
        RewardInput::new("q", r"\boxed{PARIS}").with_field("answer", "paris"),
        RewardInput::new("q", "nothing").with_field("answer", FieldValue::Float(2.5)),
    ];
    let out = acc.score(&batch).unwrap();
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0), Some(1.0), Some(0.0)]);

    let err = acc
        .score(&[RewardInput::new("q", "1")])
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("sample 0") && err.contains("answer_field"),
        "{err}"
    );
    let lenient = Accuracy::new(AccuracyConfig {
        skip_missing: true,
        ..AccuracyConfig::default()
    })
    .unwrap();
    assert_eq!(
        lenient.score(&[RewardInput::new("q", "1")]).unwrap().scores,
        vec![None]
    );
}

#[test]
fn format_must_match_whole_completion() {
    let f = Format::default();
    let out = f
        .score(&[
            RewardInput::new("", "<think>a\nb</think>\n<answer>1</answer>"),
            RewardInput::new("", "<think>a</think><answer>1</answer> trailing"),
            RewardInput::new("", "<answer>1</answer>"),
        ])
        .unwrap();
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0), Some(0.0)]);
    let f = Format::new(&FormatConfig {
        pattern: "a|b".into(),
    })
    .unwrap();
    // Anchoring wraps the alternation, so "ab" does not match.
    let out = f
        .score(&[RewardInput::new("", "a"), RewardInput::new("", "ab")])
        .unwrap();
    assert_eq!(out.scores, vec![Some(1.0), Some(0.0)]);
    let err = Format::new(&FormatConfig {
        pattern: "(".into(),
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("`pattern`"), "{err}");
}

#[test]
fn overlong_is_dapo_soft_punishment() {
    // L_max = 100, L_cache = 20: 0 up to 80, linear to −1 at 100, −1 beyond.
    assert_eq!(overlong_penalty(0, 100, 20), 0.0);
    assert_eq!(overlong_penalty(80, 100, 20), 0.0);
    assert_eq!(overlong_penalty(90, 100, 20), -0.5);
    assert_eq!(overlong_penalty(100, 100, 20), -1.0);
    assert_eq!(overlong_penalty(101, 100, 20), -1.0);
    assert_eq!(overlong_penalty(100, 100, 0), 0.0);
    assert_eq!(overlong_penalty(101, 100, 0), -1.0);
    let r = Overlong::new(OverlongConfig {
        max_completion_length: 100,
        overlong_buffer: 20,
    })
    .unwrap();
    let out = r
        .score(&[RewardInput::new("", "").with_tokens(95)])
        .unwrap();
    assert_eq!(out.scores, vec![Some(-0.75)]);
    let err = Overlong::new(OverlongConfig {
        max_completion_length: 10,
        overlong_buffer: 20,
    })
    .unwrap_err()
    .to_string();
    assert!(err.contains("`overlong_buffer`"), "{err}");
}

#[test]
fn combination_and_metrics() {
    // TRL: rewards = nansum(rewards_per_func * weights, dim=1); all-NaN rows → NaN.
    let per = vec![
        vec![Some(1.0), None, Some(0.0), None],
        vec![Some(0.5), Some(2.0), None, None],
    ];
    let r = combine_rewards(&per, &[2.0, 0.5]);
    assert_eq!(r[..3], [2.25, 1.0, 0.0]);
    assert!(r[3].is_nan());
    // nanmean / unbiased nanstd as TRL logs them.
    let xs = [Some(1.0), None, Some(2.0), Some(4.0)];
    assert!((nan_mean(&xs) - 7.0 / 3.0).abs() < 1e-12);
    // torch.tensor([1.,2.,4.]).std() = 1.5275252
    assert!((nan_std(&xs) - 1.527_525_231_651_946_6).abs() < 1e-9);
    assert!(nan_std(&[Some(1.0)]).is_nan());
    assert!(nan_mean(&[None]).is_nan());

    let set = RewardSet::new()
        .with_reward("a", 1.0, |b: &[RewardInput]| -> Vec<Option<f32>> {
            b.iter()
                .map(|x| (!x.completion.is_empty()).then_some(1.0))
                .collect()
        })
        .with_reward("b", 0.5, |b: &[RewardInput]| -> Vec<f32> {
            vec![2.0; b.len()]
        });
    let s = set
        .score(&[RewardInput::new("", "x"), RewardInput::new("", "")])
        .unwrap();
    assert_eq!(s.rewards, vec![2.0, 1.0]);
    assert_eq!(s.metrics["rewards/a/mean"], 1.0);
    assert!(s.metrics["rewards/a/std"].is_nan());
    assert_eq!(s.metrics["rewards/b/std"], 0.0);

    let bad =
        RewardSet::new().with_reward("short", 1.0, |_: &[RewardInput]| -> Vec<f32> { vec![] });
    let err = bad
        .score(&[RewardInput::new("", "")])
        .unwrap_err()
        .to_string();
    assert!(err.contains("`short` returned 0 scores for 1"), "{err}");
}

#[test]
fn configs_parse_from_toml_and_errors_name_the_field() {
    let cfg: RewardsConfig = toml::from_str(
        r#"
        reward_weights = [1.0, 0.1, 0.5]
        [[rewards]]
        type = "accuracy"
        [[rewards]]
        type = "format"
        name = "think_format"
        pattern = '(?s)<think>.*</think>.*'
        [[rewards]]
        type = "overlong"
        max_completion_length = 64
        overlong_buffer = 16
        "#,
    )
    .unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    assert_eq!(set.names(), vec!["accuracy", "think_format", "overlong"]);
    assert_eq!(set.weights(), vec![1.0, 0.1, 0.5]);
    let s = set
        .score(&[RewardInput::new("", "<think>x</think> 4")
            .with_tokens(56)
            .with_field("answer", "4")])
        .unwrap();
    assert_eq!(s.rewards, vec![1.0 + 0.1 - 0.5 * 0.5]);

    // An unknown key inside a reward is refused.
    let err = toml::from_str::<RewardsConfig>(
        r#"
        [[rewards]]
        type = "accuracy"
        answer_feild = "x"
        "#,
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("answer_feild"), "{err}");

    for (text, field) in [
        (
            "[[rewards]]\ntype = \"overlong\"\nmax_completion_length = 8\noverlong_buffer = 9",
            "rewards[0].overlong_buffer",
        ),
        (
            "reward_weights = [1.0, 2.0]\n[[rewards]]\ntype = \"accuracy\"",
            "reward_weights",
        ),
        (
            "[[rewards]]\ntype = \"accuracy\"\n[[rewards]]\ntype = \"accuracy\"",
            "rewards[1].name",
        ),
        (
            "[[rewards]]\ntype = \"accuracy\"\n[[rewards]]\ntype = \"judge\"\nbase_url = \"localhost:1\"\nmodel = \"m\"\ntemplate = \"t\"",
            "rewards[1].base_url",
        ),
        (
            "[[rewards]]\ntype = \"judge\"\nbase_url = \"http://127.0.0.1:1\"\nmodel = \"m\"\ntemplate = \"t\"\ntimeout_secs = 0",
            "rewards[0].timeout_secs",
        ),
        (
            "[[rewards]]\ntype = \"judge_ensemble\"\nmode = \"escalate\"\n[[rewards.judges]]\nbase_url = \"http://127.0.0.1:1\"\nmodel = \"m\"\ntemplate = \"t\"",
            "rewards[0].strong",
        ),
    ] {
        let cfg: RewardsConfig = toml::from_str(text).unwrap();
        let err = cfg
            .build(&ScoringModels::default())
            .unwrap_err()
            .to_string();
        assert!(
            err.contains(&format!("`{field}`")),
            "expected {field} in: {err}"
        );
    }
}

proptest! {
    #[test]
    fn combine_is_weighted_nansum(
        rows in proptest::collection::vec(
            proptest::collection::vec(proptest::option::of(-10.0f32..10.0), 5), 1..4),
        weights in proptest::collection::vec(-2.0f32..2.0, 3),
    ) {
        let r = combine_rewards(&rows, &weights);
        prop_assert_eq!(r.len(), 5);
        for (i, &got) in r.iter().enumerate() {
            let present: Vec<(usize, f32)> = rows.iter().enumerate().filter_map(|(k, row)| row[i].map(|v| (k, v))).collect();
            if present.is_empty() {
                prop_assert!(got.is_nan());
            } else {
                let want: f32 = present.iter().map(|&(k, v)| weights.get(k).copied().unwrap_or(1.0) * v).sum();
                prop_assert!((got - want).abs() <= 1e-4 * (1.0 + want.abs()));
            }
        }
    }

    #[test]
    fn nan_stats_ignore_missing(xs in proptest::collection::vec(proptest::option::of(-100.0f32..100.0), 0..20)) {
        let present: Vec<f64> = xs.iter().flatten().map(|&v| f64::from(v)).collect();
        let m = nan_mean(&xs);
        let s = nan_std(&xs);
        if present.is_empty() { prop_assert!(m.is_nan()); } else {
            prop_assert!((m - present.iter().sum::<f64>() / present.len() as f64).abs() < 1e-9);
        }
        if present.len() < 2 { prop_assert!(s.is_nan()); } else { prop_assert!(s >= 0.0); }
    }

    #[test]
    fn extraction_finds_tagged_and_boxed_integers(n in -1_000_000i64..1_000_000, noise in "[a-z ]{0,20}") {
        let tagged = format!("{noise} 123 <answer>{n}</answer> {noise}");
        prop_assert_eq!(extract_answer(&tagged), Some(n.to_string()));
        let boxed = format!("{noise} 9 \\boxed{{{n}}} {noise}");
        prop_assert_eq!(extract_answer(&boxed), Some(n.to_string()));
        let last = format!("{noise} 5 then {n}{noise}");
        prop_assert_eq!(extract_answer(&last), Some(n.to_string()));
        let with_decimals = format!("{}.0", n);
        prop_assert!(answers_match(&n.to_string(), &with_decimals, 1e-6, 1e-6));
    }

    #[test]
    fn overlong_is_monotone_and_bounded(max_len in 1usize..5000, frac in 0.0f64..=1.0, a in 0usize..6000, b in 0usize..6000) {
        let buffer = (max_len as f64 * frac) as usize;
        let (lo, hi) = if a <= b { (a, b) } else { (b, a) };
        let p_lo = overlong_penalty(lo, max_len, buffer);
        let p_hi = overlong_penalty(hi, max_len, buffer);
        prop_assert!((-1.0..=0.0).contains(&p_lo) && (-1.0..=0.0).contains(&p_hi));
        prop_assert!(p_hi <= p_lo, "not monotone: {} → {}, {} → {}", lo, p_lo, hi, p_hi);
        if hi > max_len { prop_assert_eq!(p_hi, -1.0); }
        if lo <= max_len - buffer { prop_assert_eq!(p_lo, 0.0); }
    }
}
