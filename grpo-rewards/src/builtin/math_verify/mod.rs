//! math_verify (Hugging Face's Math-Verify 0.9) natively: what TRL's `accuracy_reward`,
//! `reasoning_accuracy_reward` and `get_cosine_scaled_reward` use to decide whether a
//! completion's answer equals the reference solution.
//!
//! - [`parse_solution`]: math_verify's `parse(solution)`: LaTeX (`$...$`, `\[...\]`,
//!   `\boxed{}`, a bare `\frac{a}{b}`) or a plain number / arithmetic, the last one written.
//! - [`parse_answer`]: what TRL reads from a completion: LaTeX only, a `\boxed{}` first, else
//!   one after "final answer is" / "answer:" / "answer"; LaTeX elsewhere does not count.
//! - [`verify`]: equal values (integers exactly, decimals to six places, expressions in
//!   variables by their values), equations against their right side, sets in any order,
//!   tuples and intervals in order; and the extracted texts, equal, count too.
//!
//! [`math_verify`] puts them together as TRL does: `None` when the solution holds nothing to
//! compare with. `scripts/gen_math_verify_reference.py` records math_verify's own verdicts on
//! solutions and completions in the forms datasets and models write them;
//! `tests/tests/it/math_verify.rs` checks these against them.

mod compare;
mod expr;
mod extract;
mod latex;
mod normalize;
mod python;

pub use compare::verify;
pub use expr::{Expr, Func, Rel};
pub use extract::{Extracted, parse_answer, parse_solution};
pub use latex::parse_latex;

/// TRL's verdict on one completion: `Some(true)` when its answer matches the solution,
/// `Some(false)` when not (or it states none), `None` when nothing could be read from the
/// solution (TRL skips the row).
pub fn math_verify(completion: &str, solution: &str) -> Option<bool> {
    let gold = parse_solution(solution);
    if gold.is_empty() {
        return None;
    }
    Some(verify(&gold, &parse_answer(completion)))
}

/// What was extracted, as math_verify logs it (`gold_parsed`, `answer_parsed`).
pub fn describe(extracted: &[Extracted]) -> String {
    let parts: Vec<String> = extracted
        .iter()
        .map(|e| match e {
            Extracted::Value(x) => x.to_string(),
            Extracted::Text(t) => format!("{t:?}"),
        })
        .collect();
    format!("[{}]", parts.join(", "))
}
