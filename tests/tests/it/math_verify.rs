//! math_verify natively (`grpo_rewards::builtin::math_verify`) against the verdicts of TRL
//! 1.16's own `accuracy_reward` with math-verify 0.9 (`scripts/gen_math_verify_reference.py`):
//! solutions as datasets hold them against completions as models write them.
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_rewards::builtin::math_verify::{describe, math_verify, parse_answer, parse_solution};
use grpo_rewards::{Message, RewardInput, RewardSet, RewardsConfig, ScoringModels};
use serde_json::Value;

/// The committed reference, or the file `MATH_VERIFY_REFERENCE` names (another seed of the
/// generator).
fn reference() -> Vec<Value> {
    let text = match std::env::var("MATH_VERIFY_REFERENCE") {
        Ok(path) => std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{path}: {e}")),
        Err(_) => include_str!("../data/math_verify_reference.json").to_string(),
    };
    let v: Value = serde_json::from_str(&text).unwrap();
    v["cases"].as_array().unwrap().clone()
}

#[test]
fn verdicts_equal_trls_accuracy_reward() {
    let cases = reference();
    let mut wrong = Vec::new();
    for c in &cases {
        let (solution, completion) = (
            c["solution"].as_str().unwrap(),
            c["completion"].as_str().unwrap(),
        );
        let want = c["reward"].as_f64().map(|r| r == 1.0);
        let got = math_verify(completion, solution);
        if got != want {
            wrong.push(format!(
                "solution {solution:?} completion {completion:?}: TRL {want:?} (gold {} answer {}), ours {got:?} (gold {} answer {})",
                c["gold_parsed"], c["answer_parsed"],
                describe(&parse_solution(solution)), describe(&parse_answer(completion)),
            ));
        }
    }
    assert!(
        wrong.is_empty(),
        "{} of {} differ:\n{}",
        wrong.len(),
        cases.len(),
        wrong.join("\n")
    );
}

fn chat(text: &str, solution: Option<&str>) -> RewardInput {
    let x =
        RewardInput::new("q", text).with_completion_messages(vec![Message::new("assistant", text)]);
    match solution {
        Some(s) => x.with_field("solution", s),
        None => x,
    }
}

fn rewards(toml_text: &str) -> RewardSet {
    let cfg: RewardsConfig = toml::from_str(toml_text).unwrap();
    cfg.build(&ScoringModels::default()).unwrap()
}

#[test]
fn math_verify_reward_scores_as_trls_accuracy_reward() {
    let set = rewards("[[rewards]]\ntype = \"math_verify\"\n");
    let batch = [
        chat(
            r"The answer is $\boxed{\dfrac{1}{2}}$.",
            Some(r"$\frac{1}{2}$"),
        ),
        chat("The answer is 0.5", Some(r"$\frac{1}{2}$")), // no LaTeX: TRL reads no answer
        chat(r"Final answer: $x = 3$", Some("3")),
        chat(r"\boxed{\{3, 1, 2\}}", Some(r"$\{1,2,3\}$")),
        chat(r"\boxed{(2, 1)}", Some(r"$(1, 2)$")), // a tuple is ordered
        chat(r"\boxed{5}", Some("no number here")), // nothing to compare with: skipped
    ];
    let scored = set.score(&batch).unwrap();
    assert_eq!(
        scored.per_function[0],
        vec![Some(1.0), Some(0.0), Some(1.0), Some(1.0), Some(0.0), None]
    );
    let info = scored.info[0][0].as_ref().unwrap();
    assert_eq!(info["gold_parsed"], "[1/2, \"\\\\frac{1}{2}\"]", "{info}");
    assert_eq!(
        scored.info[0][1].as_ref().unwrap()["answer_parsed"],
        "[unparseable]"
    );
    assert_eq!(
        scored.info[0][5].as_ref().unwrap()["gold_parsed"],
        "[unparseable]"
    );
}

#[test]
fn a_missing_solution_is_an_error_naming_the_column_or_skipped() {
    let set = rewards("[[rewards]]\ntype = \"math_verify\"\n");
    let e = set
        .score(&[chat(r"\boxed{1}", None)])
        .unwrap_err()
        .to_string();
    assert!(e.contains("`solution`") && e.contains("math_verify"), "{e}");
    let set = rewards("[[rewards]]\ntype = \"math_verify\"\nskip_missing = true\n");
    assert_eq!(
        set.score(&[chat(r"\boxed{1}", None)]).unwrap().per_function[0],
        vec![None]
    );
}

/// `reasoning_accuracy` and `cosine_scaled` judge as TRL's do (math_verify) unless
/// `verifier = "accuracy"` asks for the lenient comparison.
#[test]
fn trls_rewards_verify_with_math_verify_unless_told_otherwise() {
    let bare = chat("<think>hmm</think>The answer is 12", Some("12"));
    let latex = chat(
        r"<think>hmm</think>The answer is $\boxed{2\sqrt{2}}$",
        Some(r"$\sqrt{8}$"),
    );
    let score = |toml_text: &str, x: &RewardInput| {
        rewards(toml_text)
            .score(std::slice::from_ref(x))
            .unwrap()
            .per_function[0][0]
    };
    let reasoning = "[[rewards]]\ntype = \"reasoning_accuracy\"\n";
    assert_eq!(score(reasoning, &bare), Some(0.0)); // math_verify reads no LaTeX answer
    assert_eq!(score(reasoning, &latex), Some(1.0)); // √8 = 2√2 symbolically
    let lenient = "[[rewards]]\ntype = \"reasoning_accuracy\"\nverifier = \"accuracy\"\n";
    assert_eq!(score(lenient, &bare), Some(1.0));
    let cosine = "[[rewards]]\ntype = \"cosine_scaled\"\nmax_len = 10\n";
    assert_eq!(score(cosine, &bare), Some(-1.0)); // wrong at length 0: min_value_wrong
    let unreadable = chat(r"\boxed{1}", Some("no number"));
    assert_eq!(score(cosine, &unreadable), None);
    let e = toml::from_str::<RewardsConfig>(
        "[[rewards]]\ntype = \"cosine_scaled\"\nmax_len = 1\nverifier = \"sympy\"\n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("verifier") || e.contains("math_verify"), "{e}");
}

/// TRL's `accuracy_reward` itself, run in Python through a `type = "python"` reward, beside the
/// built-in on every 10th reference case (skipped without a Python that has trl and
/// math_verify: `TRL_PYTHON`).
#[test]
fn trls_accuracy_reward_run_in_python_agrees() {
    let python = std::env::var("TRL_PYTHON").unwrap_or_else(|_| "python3".into());
    let has_trl = std::process::Command::new(&python)
        .args(["-c", "import trl.rewards, math_verify"])
        .status()
        .is_ok_and(|s| s.success());
    if !has_trl {
        eprintln!("skipping: {python} has no trl + math_verify (TRL_PYTHON)");
        return;
    }
    let set = rewards(&format!(
        "[[rewards]]\ntype = \"python\"\nname = \"trl\"\npath = \"trl.rewards\"\nfunction = \"accuracy_reward\"\npython = {python:?}\ntimeout = 600\n[[rewards]]\ntype = \"math_verify\"\n"
    ));
    let batch: Vec<RewardInput> = reference()
        .iter()
        .step_by(10)
        .map(|c| chat(c["completion"].as_str().unwrap(), c["solution"].as_str()))
        .collect();
    let out = set.score(&batch).unwrap();
    for (i, x) in batch.iter().enumerate() {
        assert_eq!(
            out.per_function[0][i],
            out.per_function[1][i],
            "{:?} / {:?}",
            x.completion,
            x.field("solution")
        );
    }
}

/// A long reasoning trace (many formulas, the answer boxed at the end) is read as TRL reads it,
/// and quickly: no pattern gives up on its length.
#[test]
fn long_completions_are_read_whole() {
    let mut text = String::from("<think>\n");
    for i in 0..400 {
        text.push_str(&format!("Step {i}: since $x_{{{i}}} = \\frac{{{i}}}{{2}}$ and \\( y = {i}^2 \\), the answer so far is {i}.\n"));
    }
    text.push_str("</think>\nTherefore the final answer is $\\boxed{\\frac{7}{3}}$.");
    assert!(text.len() > 30_000);
    let start = std::time::Instant::now();
    assert_eq!(math_verify(&text, r"$\frac{14}{6}$"), Some(true));
    assert_eq!(math_verify(&text, "2.5"), Some(false));
    // Without the box the formulas after the last "answer" (within 50 characters; joined by
    // "and") count, as in TRL: the set of the next step's two equations.
    let unboxed = text.replace(
        "Therefore the final answer is $\\boxed{\\frac{7}{3}}$.",
        "Done.",
    );
    assert_eq!(math_verify(&unboxed, "399"), Some(false));
    assert_eq!(math_verify(&unboxed, r"$\frac{399}{2}$"), Some(false));
    assert_eq!(
        math_verify(&unboxed, r"$y = 399^2, x_{399} = \frac{399}{2}$"),
        Some(true)
    );
    assert!(
        start.elapsed().as_secs_f64() < 20.0,
        "{:?}",
        start.elapsed()
    );
}

mod never_panics {
    use super::*;
    use proptest::prelude::*;

    /// Pieces models and datasets write, glued at random: the verifier answers (or declines)
    /// on anything, without panicking or overflowing — a reward must not end a run.
    fn piece() -> impl Strategy<Value = String> {
        prop::sample::select(vec![
            "$",
            "$$",
            "\\boxed{",
            "}",
            "{",
            "\\frac",
            "\\sqrt",
            "[",
            "]",
            "(",
            ")",
            "\\(",
            "\\)",
            "\\[",
            "\\]",
            "1",
            "0",
            "9",
            "12",
            "999999999999999999999999",
            "3.5",
            ".",
            ",",
            ";",
            ":",
            "=",
            "<",
            ">",
            "\\le",
            "!=",
            "!",
            "^",
            "_",
            "x",
            "y",
            "e",
            "i",
            "\\pi",
            "\\infty",
            "-",
            "+",
            "*",
            "/",
            "\\cdot",
            "\\times",
            "%",
            "\\%",
            "\\text{",
            "cm",
            "\\begin{pmatrix}",
            "\\end{pmatrix}",
            "&",
            "\\\\",
            "|",
            "\\cup",
            "\\approx",
            "\\pm",
            "\\log_",
            "\\ln",
            "\\sin",
            "answer",
            "final answer is",
            " ",
            "\n",
            "\\quad",
            "\\left(",
            "\\right)",
            "\\{",
            "\\}",
            "####",
            "and",
            "or",
            "10^{",
            "2^{100}",
            "\\binom{",
            "\\dfrac",
            "99999999999999999999999999999999999",
            "170141183460469231731687303715884105727",
            "-",
        ])
        .prop_map(str::to_string)
    }

    #[test]
    fn on_numbers_past_i128() {
        let big = "99999999999999999999999999999999999";
        for text in [
            format!("{big} \\frac{{{big}}}{{7}}"),
            format!("-{big} \\frac{{{big}}}{{3}}"),
            format!("({big})^{{99}}"),
            format!("{big}!"),
            format!("\\binom{{{big}}}{{3}}"),
            format!("\\frac{{{big}{big}}}{{{big}}}"),
            format!("{big} \\cdot {big} \\cdot {big}"),
            format!("\\sqrt[{big}]{{{big}}}"),
        ] {
            let _ = math_verify(&format!("\\boxed{{{text}}}"), &format!("${text}$"));
        }
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(5000))]
        #[test]
        fn on_random_latex(gold in prop::collection::vec(piece(), 0..14), pred in prop::collection::vec(piece(), 0..14)) {
            let (gold, pred) = (gold.concat(), pred.concat());
            let _ = math_verify(&pred, &gold);
            let _ = math_verify(&format!("\\boxed{{{pred}}}"), &format!("${gold}$"));
        }
    }
}

/// A 200 kB completion of formulas, anchors and unclosed boxes is judged in bounded time.
#[test]
fn adversarial_lengths_stay_fast() {
    let mut text = String::new();
    for i in 0..2_000 {
        text.push_str(&format!(
            "answer: ${i}$ and the answer is \\boxed{{{i} $$ \\[ {i}"
        ));
    }
    assert!(text.len() > 50_000);
    let start = std::time::Instant::now();
    // The last boxed answer is the one read (TRL's math_verify gives up after its 10 s parsing
    // timeout on this text and scores 0).
    assert_eq!(math_verify(&text, "$1999$"), Some(true));
    assert_eq!(math_verify(&text, "$0$"), Some(false));
    let _ = math_verify(&text, &text);
    assert!(
        start.elapsed().as_secs_f64() < 30.0,
        "{:?}",
        start.elapsed()
    );
}
