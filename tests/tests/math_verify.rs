//! math_verify natively (`grpo_rewards::builtin::math_verify`) against the verdicts of TRL
//! 1.16's own `accuracy_reward` with math-verify 0.9 (`scripts/gen_math_verify_reference.py`):
//! solutions as datasets hold them against completions as models write them.
#![allow(clippy::unwrap_used, missing_docs)]

use grpo_rewards::builtin::math_verify::{describe, math_verify, parse_answer, parse_solution};
use serde_json::Value;

fn reference() -> Vec<Value> {
    let v: Value = serde_json::from_str(include_str!("data/math_verify_reference.json")).unwrap();
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
