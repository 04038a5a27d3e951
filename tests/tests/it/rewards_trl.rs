//! TRL's reward functions as built-ins (`think_format`, `repetition_penalty`, `cosine_scaled`,
//! `reasoning_accuracy`) against what TRL 1.16's own functions return
//! (`scripts/gen_trl_rewards_reference.py`), and run unchanged in Python through a `type =
//! "python"` reward with `init` (a reward factory).
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_rewards::builtin::{
    CosineScaled, CosineScaledConfig, ReasoningAccuracy, ReasoningAccuracyConfig,
    RepetitionPenalty, RepetitionPenaltyConfig, ThinkFormat,
};
use grpo_rewards::{Message, Reward, RewardInput, RewardsConfig, ScoringModels};
use serde_json::Value;

fn reference() -> Value {
    serde_json::from_str(include_str!("../data/trl_rewards_reference.json"))
        .expect("reference JSON")
}

fn f(v: &Value, k: &str) -> f64 {
    v[k].as_f64().unwrap_or_else(|| panic!("{k} in {v}"))
}

fn s<'a>(v: &'a Value, k: &str) -> &'a str {
    v[k].as_str().unwrap_or_else(|| panic!("{k} in {v}"))
}

/// A conversational completion, as TRL gives its reward functions.
fn chat(text: &str) -> RewardInput {
    RewardInput::new("q", text).with_completion_messages(vec![Message::new("assistant", text)])
}

fn score(r: &dyn Reward, x: RewardInput) -> Option<f32> {
    r.score(&[x]).unwrap().scores[0]
}

#[test]
fn think_format_equals_trls() {
    let refs = reference();
    for case in refs["think_format"].as_array().unwrap() {
        let text = s(case, "completion");
        let want = f(case, "score") as f32;
        assert_eq!(score(&ThinkFormat, chat(text)), Some(want), "{text:?}");
        // A plain-text completion reads the same.
        assert_eq!(score(&ThinkFormat, RewardInput::new("q", text)), Some(want));
    }
}

#[test]
fn repetition_penalty_equals_trls() {
    let refs = reference();
    for case in refs["repetition_penalty"].as_array().unwrap() {
        let ids: Vec<u32> = serde_json::from_value(case["ids"].clone()).unwrap();
        let r = RepetitionPenalty::new(RepetitionPenaltyConfig {
            ngram_size: case["ngram_size"].as_u64().unwrap() as usize,
            max_penalty: f(case, "max_penalty"),
        })
        .unwrap();
        let got = score(&r, RewardInput::new("q", "c").with_ids(ids)).unwrap();
        let want = f(case, "score");
        assert!((f64::from(got) - want).abs() < 1e-6, "{case}: {got}");
    }
}

#[test]
fn cosine_scaled_equals_trls() {
    let refs = reference();
    for case in refs["cosine_scaled"].as_array().unwrap() {
        let r = CosineScaled::new(CosineScaledConfig {
            max_len: case["max_len"].as_u64().unwrap() as usize,
            min_value_wrong: f(case, "min_value_wrong"),
            max_value_wrong: f(case, "max_value_wrong"),
            min_value_correct: f(case, "min_value_correct"),
            max_value_correct: f(case, "max_value_correct"),
            ..toml::from_str("max_len = 1").unwrap()
        })
        .unwrap();
        let length = case["length"].as_u64().unwrap() as usize;
        let x = chat(s(case, "completion"))
            .with_ids(vec![1; length])
            .with_field("solution", s(case, "solution"));
        let got = score(&r, x).unwrap();
        let want = f(case, "score");
        assert!((f64::from(got) - want).abs() < 1e-6, "{case}: {got}");
    }
}

#[test]
fn reasoning_accuracy_equals_trls() {
    let refs = reference();
    let cases = refs["reasoning_accuracy"].as_array().unwrap();
    assert!(cases.iter().any(|c| f(c, "score") == 1.0));
    for case in cases {
        let r = ReasoningAccuracy::new(ReasoningAccuracyConfig {
            reasoning_delimiters: serde_json::from_value(case["reasoning_delimiters"].clone())
                .unwrap(),
            ..toml::from_str("").unwrap()
        })
        .unwrap();
        let x = chat(s(case, "completion")).with_field("solution", s(case, "solution"));
        assert_eq!(
            score(&r, x).map(f64::from),
            Some(f(case, "score")),
            "{case}"
        );
    }
}

#[test]
fn trl_rewards_from_the_config_and_their_refusals() {
    let cfg: RewardsConfig = toml::from_str(
        r#"
[[rewards]]
type = "think_format"
[[rewards]]
type = "repetition_penalty"
ngram_size = 2
max_penalty = -0.5
[[rewards]]
type = "cosine_scaled"
max_len = 10
[[rewards]]
type = "reasoning_accuracy"
answer_field = "answer"
reasoning_delimiters = ["</reasoning>"]
"#,
    )
    .unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    assert_eq!(
        set.names(),
        [
            "think_format",
            "repetition_penalty",
            "cosine_scaled",
            "reasoning_accuracy"
        ]
    );
    // The first message is what TRL reads (`completion[0]["content"]`): of an episode, the
    // model's first turn.
    let x = RewardInput::new("q", "<think>a</think> \\boxed{4}")
        .with_completion_messages(vec![
            Message::new("assistant", "<think>a</think> \\boxed{4}"),
            Message::new("tool", "ok"),
            Message::new("assistant", "done"),
        ])
        .with_ids(vec![5, 6, 5, 6, 5])
        .with_field("solution", "4")
        .with_field("answer", "4");
    let out = set.score(&[x]).unwrap();
    let got: Vec<Option<f32>> = out.per_function.iter().map(|s| s[0]).collect();
    let cosine = 0.5 + 0.25 * (1.0 + (0.5f64 * std::f64::consts::PI).cos());
    assert_eq!(got[0], Some(1.0));
    // 2-grams 56 65 56 65: half unique.
    assert_eq!(got[1], Some(-0.25));
    assert!(
        (f64::from(got[2].unwrap()) - cosine).abs() < 1e-6,
        "{got:?}"
    );
    // No `</reasoning>`: unfinished reasoning scores 0.
    assert_eq!(got[3], Some(0.0));
    // A missing reference column is an error naming the reward, or None with skip_missing.
    let r = CosineScaled::new(toml::from_str("max_len = 4").unwrap()).unwrap();
    let e = r.score(&[chat("\\boxed{1}")]).unwrap_err().to_string();
    assert!(e.contains("cosine_scaled") && e.contains("solution"), "{e}");
    let r = CosineScaled::new(toml::from_str("max_len = 4\nskip_missing = true").unwrap()).unwrap();
    assert_eq!(score(&r, chat("\\boxed{1}")), None);
    for (text, field) in [
        (
            "type = \"repetition_penalty\"\nmax_penalty = 0.5",
            "max_penalty",
        ),
        (
            "type = \"repetition_penalty\"\nngram_size = 0",
            "ngram_size",
        ),
        ("type = \"cosine_scaled\"\nmax_len = 0", "max_len"),
        (
            "type = \"reasoning_accuracy\"\nreasoning_delimiters = [\"\"]",
            "reasoning_delimiters",
        ),
    ] {
        let cfg: RewardsConfig = toml::from_str(&format!("[[rewards]]\n{text}")).unwrap();
        let e = cfg
            .build(&ScoringModels::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains(&format!("rewards[0].{field}")), "{e}");
    }
    // cosine_scaled needs its length: a missing max_len or an unknown key is a parse error.
    assert!(toml::from_str::<RewardsConfig>("[[rewards]]\ntype = \"cosine_scaled\"").is_err());
    assert!(
        toml::from_str::<RewardsConfig>("[[rewards]]\ntype = \"think_format\"\nx = 1").is_err()
    );
}

/// TRL's own reward factories run unchanged: `function(**init)` is the reward.
#[test]
fn trls_reward_factories_run_in_python_with_init() {
    let python = std::env::var("TRL_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_trl = std::process::Command::new(&python)
        .args(["-c", "import trl.rewards, math_verify"])
        .status()
        .is_ok_and(|s| s.success());
    let dir = tempfile::tempdir().unwrap();
    // Without TRL, a factory of our own shows the same path.
    let path = dir.path().join("factories.py");
    std::fs::write(
        &path,
        r#"
def get_length_reward(scale, offset=0.0):
    def length_reward(completion_ids, **kwargs):
        return [scale * len(ids) + offset for ids in completion_ids]
    return length_reward

def not_a_factory(scale):
    return 3
"#,
    )
    .unwrap();
    let cfg: RewardsConfig = toml::from_str(&format!(
        "[[rewards]]\ntype = \"python\"\npath = {:?}\nfunction = \"get_length_reward\"\ninit = {{ scale = 0.5, offset = 1.0 }}\n",
        path.display().to_string()
    ))
    .unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    let out = set
        .score(&[
            RewardInput::new("q", "c").with_ids(vec![1, 2, 3, 4]),
            RewardInput::new("q", "c").with_ids(vec![1]),
        ])
        .unwrap();
    assert_eq!(out.per_function[0], vec![Some(3.0), Some(1.5)]);
    for (function, init, says) in [
        ("not_a_factory", "{ scale = 1.0 }", "returned a int"),
        ("get_length_reward", "{ nope = 1 }", "TypeError"),
        ("get_length_reward", "3", "must be a table"),
    ] {
        let text = format!(
            "[[rewards]]\ntype = \"python\"\npath = {:?}\nfunction = \"{function}\"\ninit = {init}\n",
            path.display().to_string()
        );
        let cfg: RewardsConfig = toml::from_str(&text).unwrap();
        let e = cfg
            .build(&ScoringModels::default())
            .unwrap_err()
            .to_string();
        assert!(e.contains("rewards[0].init") && e.contains(says), "{e}");
    }
    if !has_trl {
        eprintln!("skipping TRL's own factories: {python} has no trl + math_verify (TRL_PYTHON)");
        return;
    }
    let cfg: RewardsConfig = toml::from_str(&format!(
        r#"
[[rewards]]
type = "python"
name = "trl_cosine"
path = "trl.rewards"
function = "get_cosine_scaled_reward"
python = {python:?}
init = {{ max_len = 10 }}
[[rewards]]
type = "cosine_scaled"
max_len = 10
[[rewards]]
type = "python"
name = "trl_repetition"
path = "trl.rewards"
function = "get_repetition_penalty_reward"
python = {python:?}
init = {{ ngram_size = 2 }}
[[rewards]]
type = "repetition_penalty"
ngram_size = 2
[[rewards]]
type = "python"
name = "trl_accuracy"
path = "trl.rewards"
function = "accuracy_reward"
python = {python:?}
"#
    ))
    .unwrap();
    let set = cfg.build(&ScoringModels::default()).unwrap();
    let batch: Vec<RewardInput> = [("\\boxed{4}", 3), ("\\boxed{5}", 7), ("So \\boxed{4}", 12)]
        .iter()
        .map(|(t, n)| {
            chat(t)
                .with_ids((0..*n).map(|i| i % 3).collect())
                .with_field("solution", "4")
        })
        .collect();
    let out = set.score(&batch).unwrap();
    for i in 0..batch.len() {
        for (a, b) in [(0, 1), (2, 3)] {
            let (x, y) = (
                out.per_function[a][i].unwrap(),
                out.per_function[b][i].unwrap(),
            );
            assert!((x - y).abs() < 1e-6, "row {i}: TRL {x}, ours {y}");
        }
        // TRL's accuracy_reward logs its parses with `log_extra`: they are the row's info.
        let info = out.info[4][i].as_ref().unwrap();
        assert_eq!(info["solution"], "4", "{info}");
        assert!(info["gold_parsed"].as_str().is_some(), "{info}");
    }
    assert_eq!(
        out.per_function[4],
        [Some(1.0), Some(0.0), Some(1.0)],
        "math_verify's verdicts"
    );
}
