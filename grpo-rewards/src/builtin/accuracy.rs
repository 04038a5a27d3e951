use std::sync::LazyLock;

use regex::Regex;
use serde::{Deserialize, Serialize};

use crate::error::{Result, RewardError};
use crate::reward::Reward;
use crate::types::{RewardInput, RewardOutput};

/// Config of [`Accuracy`] (`type = "accuracy"`).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default, deny_unknown_fields)]
pub struct AccuracyConfig {
    /// The sample field holding the reference answer. Default `"answer"`.
    pub answer_field: String,
    /// Absolute tolerance of the numeric comparison. Default `1e-6`.
    pub abs_tol: f64,
    /// Relative tolerance of the numeric comparison (of the reference's magnitude). Default `1e-6`.
    pub rel_tol: f64,
    /// Score `None` (no opinion) instead of failing when a sample has no answer field.
    /// Default `false`: a missing answer is an error naming the sample.
    pub skip_missing: bool,
}

impl Default for AccuracyConfig {
    fn default() -> Self {
        Self {
            answer_field: "answer".into(),
            abs_tol: 1e-6,
            rel_tol: 1e-6,
            skip_missing: false,
        }
    }
}

impl AccuracyConfig {
    /// Checks the values; the error names the field.
    pub fn validate(&self) -> Result<()> {
        if self.answer_field.trim().is_empty() {
            return Err(RewardError::config("answer_field", "must not be empty"));
        }
        for (name, v) in [("abs_tol", self.abs_tol), ("rel_tol", self.rel_tol)] {
            if !(v.is_finite() && v >= 0.0) {
                return Err(RewardError::config(
                    name,
                    format!("must be a finite number ≥ 0, got {v}"),
                ));
            }
        }
        Ok(())
    }
}

/// 1 when the completion's final answer equals the reference answer, else 0.
///
/// Of a multi-turn episode it reads the last assistant message only
/// ([`RewardInput::final_text`](crate::RewardInput::final_text)): numbers in tool results or
/// other observations are not the model's answer.
///
/// The final answer is the content of the last `<answer>…</answer>`, else the last
/// `<solution>…</solution>`, else the last `\boxed{…}` (balanced braces), else the last number
/// ([`extract_answer`]). A `\boxed{}` inside a tag is unwrapped. The reference is read the same
/// way, after the GSM8K marker `####` when present. Both are compared as numbers when both parse
/// (`1,000`, `3/4`, `$5`, `50%`, and closed-form LaTeX such as `2\sqrt{2}`: [`latex_value`]),
/// within `abs_tol + rel_tol·|reference|`; otherwise as trimmed, case-insensitive text with runs
/// of whitespace collapsed.
#[derive(Debug, Clone, Default)]
pub struct Accuracy {
    config: AccuracyConfig,
}

impl Accuracy {
    /// An accuracy reward with a validated config.
    pub fn new(config: AccuracyConfig) -> Result<Self> {
        config.validate()?;
        Ok(Self { config })
    }

    /// Whether `text`'s final answer equals sample `i`'s reference; `None` when the sample has
    /// no reference and `skip_missing` is set (else an error naming `reward` and the sample).
    pub(crate) fn correct(
        &self,
        i: usize,
        x: &RewardInput,
        text: &str,
        reward: &str,
    ) -> Result<Option<bool>> {
        let Some(reference) = x.field(&self.config.answer_field).and_then(|v| v.as_text()) else {
            if self.config.skip_missing {
                return Ok(None);
            }
            return Err(RewardError::Sample {
                reward: reward.into(),
                index: i,
                message: format!("no field `{}` (answer_field)", self.config.answer_field),
            });
        };
        let reference = reference_answer(&reference);
        Ok(Some(
            extract_answer(text)
                .map(|got| {
                    answers_match(&got, &reference, self.config.abs_tol, self.config.rel_tol)
                })
                .unwrap_or(false),
        ))
    }
}

impl Reward for Accuracy {
    fn score(&self, batch: &[RewardInput]) -> Result<RewardOutput> {
        let mut scores = Vec::with_capacity(batch.len());
        for (i, x) in batch.iter().enumerate() {
            let ok = self.correct(i, x, x.final_text(), "accuracy")?;
            scores.push(ok.map(|ok| if ok { 1.0 } else { 0.0 }));
        }
        Ok(RewardOutput::from_scores(scores))
    }
}

fn reference_answer(text: &str) -> String {
    let text = match text.rfind("####") {
        Some(p) => &text[p + 4..],
        None => text,
    };
    if (text.contains("<answer>") || text.contains("<solution>") || text.contains("\\boxed"))
        && let Some(a) = extract_answer(text)
    {
        return a;
    }
    text.trim().to_owned()
}

fn last_tag(text: &str, tag: &str) -> Option<String> {
    let open = format!("<{tag}>");
    let close = format!("</{tag}>");
    let start = text.rfind(&open)? + open.len();
    let end = text[start..].find(&close)? + start;
    Some(text[start..end].to_owned())
}

/// The content of the last `\boxed{…}` (or `\fbox{…}`), braces balanced; `None` if there is
/// none or it is not closed.
pub fn extract_boxed(text: &str) -> Option<String> {
    let (pos, skip) = [("\\boxed{", 7usize), ("\\fbox{", 6)]
        .iter()
        .filter_map(|(pat, n)| text.rfind(pat).map(|p| (p, *n)))
        .max_by_key(|(p, _)| *p)?;
    let body = &text[pos + skip..];
    let mut depth = 1usize;
    for (i, c) in body.char_indices() {
        match c {
            '{' => depth += 1,
            '}' => {
                depth -= 1;
                if depth == 0 {
                    return Some(body[..i].to_owned());
                }
            }
            _ => {}
        }
    }
    None
}

#[allow(clippy::unwrap_used)] // a constant pattern, exercised by the tests
static NUMBER: LazyLock<Regex> = LazyLock::new(|| {
    Regex::new(r"-?(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?(?:[eE][-+]?\d+)?(?:/\d+)?|-?\.\d+").unwrap()
});

/// The final answer of a completion: the last `<answer>`, else `<solution>`, else `\boxed{}`,
/// else the last number; `None` when there is none. Tags and boxes are trimmed; a box inside a
/// tag is unwrapped.
pub fn extract_answer(text: &str) -> Option<String> {
    for tag in ["answer", "solution"] {
        if let Some(inner) = last_tag(text, tag) {
            let inner = extract_boxed(&inner).unwrap_or(inner);
            return Some(inner.trim().to_owned());
        }
    }
    if let Some(b) = extract_boxed(text) {
        return Some(b.trim().to_owned());
    }
    NUMBER.find_iter(text).last().map(|m| m.as_str().to_owned())
}

fn parse_number(s: &str) -> Option<f64> {
    let mut t: String = s.trim().chars().filter(|c| !c.is_whitespace()).collect();
    for p in ["$", "\\$"] {
        if let Some(rest) = t.strip_prefix(p) {
            t = rest.to_owned();
        }
    }
    let mut t = t.trim_end_matches('.').to_owned();
    let percent = t.ends_with('%') || t.ends_with("\\%");
    if percent {
        t = t.trim_end_matches('%').trim_end_matches('\\').to_owned();
    }
    if let Some(inner) = t.strip_prefix("\\frac{").and_then(|r| r.strip_suffix('}'))
        && let Some((a, b)) = inner.split_once("}{")
    {
        t = format!("{a}/{b}");
    }
    let plain = |x: &str| -> Option<f64> {
        let ok = !x.is_empty()
            && x.chars()
                .all(|c| c.is_ascii_digit() || ",.-+eE".contains(c));
        if !ok {
            return None;
        }
        let v: f64 = x.replace(',', "").parse().ok()?;
        v.is_finite().then_some(v)
    };
    let v = match t.split_once('/') {
        Some((a, b)) => {
            let d = plain(b)?;
            if d == 0.0 {
                return None;
            }
            plain(a)? / d
        }
        None => plain(&t)?,
    };
    Some(v)
}

fn normalise_text(s: &str) -> String {
    s.split_whitespace()
        .collect::<Vec<_>>()
        .join(" ")
        .to_lowercase()
}

/// True when `got` equals `reference`: numerically within `abs_tol + rel_tol·|reference|` when
/// both are numbers ([`latex_value`]: plain numbers and closed-form LaTeX such as `2\sqrt{2}`,
/// `\frac{\pi}{4}`, `3^{2}`), else as trimmed, case-insensitive text (whitespace runs
/// collapsed).
pub fn answers_match(got: &str, reference: &str, abs_tol: f64, rel_tol: f64) -> bool {
    let value = |s: &str| parse_number(s).or_else(|| latex_value(s));
    match (value(got), value(reference)) {
        (Some(a), Some(b)) => (a - b).abs() <= abs_tol + rel_tol * b.abs(),
        _ => normalise_text(got) == normalise_text(reference),
    }
}

/// The value of a closed-form numeric LaTeX expression: numbers, `+ - * /`, `\cdot`, `\times`,
/// `\div`, `^`, parentheses and braces (`\left( \right)` too), `\frac` / `\dfrac` /
/// `\tfrac` (`\frac12` too), `\sqrt{x}`, `\sqrt[n]{x}`, `\sqrt2`, `\pi`, implicit
/// products (`2\sqrt{3}`, `3\pi`); a number's `\%` or `%` is dropped, as plain numbers' (`50%`
/// equals `50`). `None` for anything else (a variable, a list, text) or a value that is not
/// finite.
pub fn latex_value(s: &str) -> Option<f64> {
    let mut t: String = s.trim().trim_matches('$').to_owned();
    for (from, to) in [
        ("\\left", ""),
        ("\\right", ""),
        ("\\!", ""),
        ("\\,", ""),
        ("\\;", ""),
        ("\\ ", ""),
        ("\\cdot", "*"),
        ("\\times", "*"),
        ("\\div", "/"),
        ("\\dfrac", "\\frac"),
        ("\\tfrac", "\\frac"),
        ("π", "\\pi"),
    ] {
        t = t.replace(from, to);
    }
    let t: Vec<char> = t.chars().filter(|c| !c.is_whitespace()).collect();
    let t: Vec<char> = match t.last() {
        Some('.') => t[..t.len() - 1].to_vec(),
        _ => t,
    };
    let mut p = LatexParser { s: &t, i: 0 };
    let v = p.expr()?;
    (p.i == t.len() && v.is_finite()).then_some(v)
}

/// A recursive-descent evaluator over the characters of a LaTeX expression.
struct LatexParser<'a> {
    s: &'a [char],
    i: usize,
}

impl LatexParser<'_> {
    fn peek(&self) -> Option<char> {
        self.s.get(self.i).copied()
    }

    fn eat(&mut self, word: &str) -> bool {
        let w: Vec<char> = word.chars().collect();
        let end = self.i + w.len();
        // A command is not the start of a longer one (`\pi` is not `\pink`).
        let whole =
            !word.starts_with('\\') || self.s.get(end).is_none_or(|c| !c.is_ascii_alphabetic());
        if self.s.get(self.i..end) == Some(&w[..]) && whole {
            self.i = end;
            return true;
        }
        false
    }

    fn expr(&mut self) -> Option<f64> {
        let mut v = self.term()?;
        loop {
            if self.eat("+") {
                v += self.term()?;
            } else if self.eat("-") {
                v -= self.term()?;
            } else {
                return Some(v);
            }
        }
    }

    fn term(&mut self) -> Option<f64> {
        let mut v = self.unary()?;
        loop {
            if self.eat("*") {
                v *= self.unary()?;
            } else if self.eat("/") {
                v /= self.unary()?;
            } else if self.starts_atom() {
                v *= self.power()?;
            } else {
                return Some(v);
            }
        }
    }

    fn unary(&mut self) -> Option<f64> {
        if self.eat("-") {
            return self.unary().map(|v| -v);
        }
        if self.eat("+") {
            return self.unary();
        }
        self.power()
    }

    fn power(&mut self) -> Option<f64> {
        let base = self.atom()?;
        if self.eat("^") {
            // `2^{10}`, `2^3` (one digit), `2^-1` is not LaTeX: `2^{-1}`.
            let e = match self.peek() {
                Some('{') => self.atom()?,
                Some(c) if c.is_ascii_digit() => {
                    self.i += 1;
                    f64::from(c.to_digit(10)?)
                }
                _ => self.atom()?,
            };
            return Some(base.powf(e));
        }
        Some(base)
    }

    fn starts_atom(&self) -> bool {
        match self.peek() {
            Some(c) if c.is_ascii_digit() || c == '(' || c == '{' || c == '.' => true,
            Some('\\') => ["\\frac", "\\sqrt", "\\pi"].iter().any(|w| {
                let w: Vec<char> = w.chars().collect();
                self.s.get(self.i..self.i + w.len()) == Some(&w[..])
            }),
            _ => false,
        }
    }

    /// One argument of `\frac` / `\sqrt`: a braced expression, or a single digit or command.
    fn argument(&mut self) -> Option<f64> {
        match self.peek()? {
            '{' => self.atom(),
            c if c.is_ascii_digit() => {
                self.i += 1;
                c.to_digit(10).map(f64::from)
            }
            _ => self.atom(),
        }
    }

    fn atom(&mut self) -> Option<f64> {
        for (open, close) in [("(", ")"), ("{", "}"), ("[", "]")] {
            if self.eat(open) {
                let v = self.expr()?;
                return self.eat(close).then_some(v);
            }
        }
        if self.eat("\\frac") {
            let a = self.argument()?;
            let b = self.argument()?;
            return Some(a / b);
        }
        if self.eat("\\sqrt") {
            let n = match self.eat("[") {
                true => {
                    let n = self.expr()?;
                    self.eat("]").then_some(n)?
                }
                false => 2.0,
            };
            let x = self.argument()?;
            return Some(match n == 2.0 {
                true => x.sqrt(),
                false if x < 0.0 && n.fract() == 0.0 && n % 2.0 == 1.0 => -(-x).powf(1.0 / n),
                false => x.powf(1.0 / n),
            });
        }
        if self.eat("\\pi") {
            return Some(std::f64::consts::PI);
        }
        // A number: digits with one decimal point.
        let start = self.i;
        while self.peek().is_some_and(|c| c.is_ascii_digit() || c == '.') {
            self.i += 1;
        }
        let text: String = self.s[start..self.i].iter().collect();
        if text.is_empty() || text.matches('.').count() > 1 {
            return None;
        }
        let v: f64 = text.parse().ok()?;
        // A number's percent sign, dropped as plain numbers' is.
        let _ = self.eat("\\%") || self.eat("%");
        Some(v)
    }
}
