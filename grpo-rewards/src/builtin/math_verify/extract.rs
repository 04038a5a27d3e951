//! math_verify's extraction: its regular expressions (LaTeX environments after "final answer
//! is", "answer:", in `\boxed{}`, or anywhere; plain numbers and arithmetic for reference
//! solutions) tried by priority, the match ending last first.

use std::sync::LazyLock;

use fancy_regex::Regex;

use super::expr::Expr;
use super::latex::parse_latex;
use super::normalize::{Boxed, Normalization, normalize};
use super::python::parse_python_arith;

/// One extraction target (`LatexExtractionConfig` / `ExprExtractionConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Target {
    /// LaTeX environments.
    Latex {
        /// Also LaTeX found without an "answer" anchor.
        anywhere: bool,
        /// Priority of `\boxed{}` (lower is tried first); `None` = boxes not sought.
        boxed_priority: Option<i32>,
        /// The normalization applied to what was found.
        normalization: Normalization,
    },
    /// Plain numbers and arithmetic.
    Expr,
}

/// What one extraction gives: a parsed value, or the text that could not be parsed.
#[derive(Debug, Clone, PartialEq)]
pub enum Extracted {
    /// A parsed value.
    Value(Expr),
    /// The extracted text (math_verify's fallback string).
    Text(String),
}

fn env_pattern(prefix: &str, boxed: bool) -> String {
    let percent = format!(r"(?P<{prefix}percent>(?:\\?%|[Pp]ercent|[Pp]ercentage|[Pp]ct))");
    let contents = [
        r"(?:[^$]|\$(?!\$))",
        r"(?:[^\\]|\\(?!\]))",
        r"(?:\\[$]|[^\n$])",
        r"(?:[^\\\n]|\\(?!\)))",
        r"[^\n\]\[]",
    ];
    let c: Vec<String> = contents
        .iter()
        .map(|x| {
            if boxed {
                format!(r"{x}*?\\boxed\{{{x}+?\}}{x}*?")
            } else {
                format!("{x}+?")
            }
        })
        .collect();
    let mut alts = vec![
        format!(
            r"(?<!\\)\$\$(?P<{prefix}latexDisplayDollar>{})(?<!\\)\$\$",
            c[0]
        ),
        format!(
            r"(?<!\\)\\\[(?P<{prefix}latexDisplayBracket>{})(?<!\\)\\\]",
            c[1]
        ),
        format!(
            r"(?<!\\|\d)\$(?P<{prefix}latexInlineDollar>{})(?<!\\)\$",
            c[2]
        ),
        format!(
            r"(?<!\\)\\\((?P<{prefix}latexInlineParenthesis>{})(?<!\\)\\\)",
            c[3]
        ),
        format!(r"\s\[(?P<{prefix}latexInlineBracket>{})\]\s", c[4]),
    ];
    if !boxed {
        let n = r"-?\d+(?:[.,]\d+)?";
        alts.push(format!(
            r"(?P<{prefix}latexFraction>-?\\frac\{{{n}\}}\{{{n}\}})"
        ));
    }
    format!(r"(?:(?:{})\s*{percent}?)", alts.join("|"))
}

fn next_groups(boxed: bool) -> String {
    (1..=5)
        .map(|i| {
            let lead = if boxed { r"\s*" } else { "" };
            format!(
                r"{lead}(?:\s*(?:,?and|,?or|,)\s*{})?",
                env_pattern(&format!("next{i}_"), boxed)
            )
        })
        .collect()
}

fn compile(p: &str) -> Regex {
    Regex::new(p).unwrap_or_else(|e| panic!("math_verify pattern: {e}"))
}

/// The LaTeX patterns with their priorities, for these options.
fn latex_patterns(anywhere: bool, boxed_priority: Option<i32>) -> Vec<(Regex, i32)> {
    let latex = format!("(?:{}{})", env_pattern("first_", false), next_groups(false));
    let mut v = vec![
        (format!(r"(?i:final answer is):?\s*{latex}\.?\s?I hope"), 0),
        (
            format!(r"(?i:final answer.{{0,100}}?)\s+is:?\s*{latex}"),
            50,
        ),
        (format!(r"(?i:answer):.{{0,50}}?{latex}"), 100),
        (format!(r"(?i:answer).{{0,50}}?{latex}"), 200),
    ];
    if anywhere {
        v.push((latex, 300));
    }
    if let Some(p) = boxed_priority {
        v.push((
            format!("{}{}", env_pattern("first_", true), next_groups(true)),
            p,
        ));
        v.push((r"(?P<first_latexBoxed>\\boxed\{.+\})".to_string(), p));
    }
    v.into_iter()
        .map(|(p, prio)| (compile(&format!("(?s){p}")), prio))
        .collect()
}

fn expr_patterns() -> Vec<(Regex, i32)> {
    let number = r"(?<!\d)(?:(?P<integer1>-?[1-9]\d{0,2}(?:[ ,]\d{3})+)(?P<decimal1>\.\d+)?|(?P<integer2>-?\d+)(?P<decimal2>[.,]\d+)|(?P<decimal3>\.\d+)|(?P<integer3>-?\d+))(?P<percent>\s*(?:%|[Pp]ercent|\s*[Pp]ercentage|\s*[Pp]ct))?";
    let ops = r"\+\-\*×/\^\(\)÷";
    let all = format!(r"[\d\.\s{ops}]");
    let expr = format!(r"(?P<expr>-?\(?-?\d{all}*[{ops}]{all}+\)?)");
    let currency = r"\$€£¥₹₽₪₩₫฿₡₢₣₤₥₦₧₨₩₪₫₭₮₯₰₱₲₳₴₵₶₷₸₹₺₻₼₽₾₿";
    let prefix = r"(?:^|\s|=)(?:\*\*)?";
    let suffix = r"(?:\*\*)?(?:\.|,|:|\s|\)|\$|$)";
    let with_expr = format!("(?:{prefix}{expr}{suffix})");
    let with_number = format!("(?:{prefix}[{currency}]?{number})");
    let either = format!("(?:{with_expr}|{with_number})");
    [
        (format!(r"(?i:final answer is):?\s*{either}\.?\s?I hope"), 0),
        (format!(r"(?i:final answer.{{0,100}}?)\s+is:?{either}"), 50),
        (
            format!(r"(?i:answer):(?:.{{0,100}}=\s*|.{{0,50}}?){either}(?!\s*=)"),
            100,
        ),
        (
            format!(r"(?i:answer)(?:.{{0,100}}=\s*|.{{0,50}}?){either}(?!\s*=)"),
            200,
        ),
        (with_expr, 300),
        (with_number, 300),
    ]
    .into_iter()
    .map(|(p, prio)| (compile(&p), prio))
    .collect()
}

struct Compiled {
    patterns: Vec<(Regex, i32, Target)>,
}

impl Compiled {
    fn new(targets: &[Target]) -> Self {
        let mut patterns = Vec::new();
        for t in targets {
            let list = match t {
                Target::Latex {
                    anywhere,
                    boxed_priority,
                    ..
                } => latex_patterns(*anywhere, *boxed_priority),
                Target::Expr => expr_patterns(),
            };
            patterns.extend(list.into_iter().map(|(r, p)| (r, p, *t)));
        }
        // Stable, as Python's sort: same priority keeps the targets' order.
        patterns.sort_by_key(|(_, p, _)| *p);
        Compiled { patterns }
    }
}

/// The reference solution's targets: `parse(solution)` with math_verify's defaults.
pub const SOLUTION_TARGETS: [Target; 2] = [
    Target::Latex {
        anywhere: true,
        boxed_priority: Some(50),
        normalization: Normalization {
            basic_latex: true,
            units: true,
            malformed_operators: true,
            nits: true,
            boxed: Boxed::All,
        },
    },
    Target::Expr,
];

/// TRL's answer target: LaTeX only, `\boxed{}` first, nothing without an anchor, units removed.
pub const ANSWER_TARGETS: [Target; 1] = [Target::Latex {
    anywhere: false,
    boxed_priority: Some(0),
    normalization: Normalization {
        basic_latex: true,
        units: true,
        malformed_operators: false,
        nits: false,
        boxed: Boxed::All,
    },
}];

static SOLUTION: LazyLock<Compiled> = LazyLock::new(|| Compiled::new(&SOLUTION_TARGETS));
static ANSWER: LazyLock<Compiled> = LazyLock::new(|| Compiled::new(&ANSWER_TARGETS));

type Groups = Vec<(String, Option<String>)>;

/// `extract_latex`: the environments a match holds, normalized and parsed.
fn extract_latex(groups: &Groups, normalization: Normalization) -> (Option<Expr>, String) {
    let get = |name: &str| {
        groups
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.clone())
    };
    let found = |prefix: &str| {
        groups
            .iter()
            .find(|(n, v)| n.starts_with(prefix) && v.as_deref().is_some_and(|v| !v.is_empty()))
            .map(|(n, v)| (n.clone(), v.clone().unwrap_or_default()))
    };
    let mut all = Vec::new();
    if let Some(first) = found("first_latex") {
        all.push(first);
    }
    for i in 1..=5 {
        if let Some(next) = found(&format!("next{i}_latex")) {
            all.push(next);
        }
    }
    let mut exprs = Vec::new();
    let mut texts = Vec::new();
    for (name, latex) in &all {
        let mut parts = name.split('_');
        let prefix = parts.next().unwrap_or("");
        let group = parts.next().unwrap_or("");
        let percent = get(&format!("{prefix}_percent")).is_some_and(|p| !p.is_empty());
        let mut config = normalization;
        if group == "latexBoxed" {
            config.boxed = Boxed::Last;
        }
        let text = normalize(latex, config);
        let parsed =
            parse_latex_retrying(&text).map(|x| if percent { Expr::Pct(Box::new(x)) } else { x });
        texts.push(text);
        exprs.push(parsed);
    }
    if exprs.is_empty() {
        return (None, String::new());
    }
    if exprs.len() > 1 && exprs.iter().all(Option::is_some) {
        let mut elements = Vec::new();
        for x in exprs.into_iter().flatten() {
            match x {
                Expr::Set(v) => elements.extend(v),
                x => elements.push(x),
            }
        }
        return (Some(Expr::Set(elements)), texts.join(" and "));
    }
    (exprs.swap_remove(0), texts.swap_remove(0))
}

/// `parse_latex_cached`: a failed parse is retried on the part after the last `=` of a chain
/// of three or more sides (no commas).
fn parse_latex_retrying(latex: &str) -> Option<Expr> {
    match parse_latex(latex) {
        Ok(x) => Some(x),
        Err(_) => {
            let last = last_equation_side(latex);
            if last != latex {
                parse_latex(last).ok()
            } else {
                None
            }
        }
    }
}

/// `get_last_eq`: the last side of `a = b = c` (a `=` not after `\`, `<`, `!`, `>`).
pub fn last_equation_side(latex: &str) -> &str {
    if latex.contains(',') || latex.contains(';') {
        return latex;
    }
    let bytes = latex.as_bytes();
    let splits: Vec<usize> = (0..bytes.len())
        .filter(|&i| {
            bytes[i] == b'=' && (i == 0 || !matches!(bytes[i - 1], b'\\' | b'<' | b'!' | b'>'))
        })
        .collect();
    if splits.len() >= 2 {
        &latex[splits[splits.len() - 1] + 1..]
    } else {
        latex
    }
}

/// `extract_expr`: a number (thousands separators dropped, a percent kept) or arithmetic.
fn extract_expr(groups: &Groups) -> (Option<Expr>, String) {
    let get = |name: &str| {
        groups
            .iter()
            .find(|(n, _)| n == name)
            .and_then(|(_, v)| v.clone())
    };
    let first = |prefix: &str| {
        groups
            .iter()
            .filter(|(n, _)| n.starts_with(prefix))
            .find_map(|(_, v)| v.clone().filter(|v| !v.is_empty()))
            .unwrap_or_default()
    };
    let expr = get("expr").unwrap_or_default();
    let integer = first("integer");
    let decimal = first("decimal");
    let percent = get("percent").is_some_and(|p| !p.is_empty());
    if !integer.is_empty() || !decimal.is_empty() {
        let digits: String = integer.chars().filter(|&c| c != ',' && c != ' ').collect();
        let mut int = digits.trim_start_matches('0').to_string();
        if int.is_empty() {
            int = "0".into();
        }
        let decimal = decimal.replace(',', ".");
        let text = format!("{int}{decimal}");
        let value = number_value(&text).map(|x| if percent { Expr::Pct(Box::new(x)) } else { x });
        return (value, text);
    }
    if !expr.is_empty()
        && let Some(x) = parse_python_arith(&expr.replace('\n', " "))
    {
        return (Some(x), expr);
    }
    (None, expr)
}

/// SymPy's `Number(text)`: an integer, or a float where there is a decimal point.
fn number_value(text: &str) -> Option<Expr> {
    if text.contains('.') {
        text.parse::<f64>().ok().map(Expr::Float)
    } else {
        match text.parse::<i128>() {
            Ok(n) => Some(Expr::Int(n)),
            // "-0" lost its digits: `lstrip("0")` of "-0..." keeps the sign.
            Err(_) => text.parse::<f64>().ok().map(Expr::Float),
        }
    }
}

/// `extract_target_from_pred` followed by `parse`'s fallback: the parsed values (the first
/// that parses, or with `first_match_only` the first tried) and the first text tried.
fn extract(text: &str, compiled: &Compiled, first_match_only: bool) -> Vec<Extracted> {
    let mut extracted = Vec::new();
    let mut fallbacks: Vec<String> = Vec::new();
    let mut match_found = false;
    let patterns = &compiled.patterns;
    let mut i = 0;
    while i < patterns.len() {
        let priority = patterns[i].1;
        let mut j = i;
        let mut matches: Vec<(usize, usize, Target, Groups)> = Vec::new();
        while j < patterns.len() && patterns[j].1 == priority {
            let (re, _, target) = &patterns[j];
            let names: Vec<Option<&str>> = re.capture_names().collect();
            for caps in re.captures_iter(text) {
                // A pattern that gives up (its backtracking limit) has no more matches.
                let Ok(caps) = caps else { break };
                let Some(m) = caps.get(0) else { continue };
                let groups: Groups = names
                    .iter()
                    .enumerate()
                    .filter_map(|(k, n)| {
                        n.map(|n| (n.to_string(), caps.get(k).map(|g| g.as_str().to_string())))
                    })
                    .collect();
                matches.push((m.start(), m.end(), *target, groups));
            }
            j += 1;
        }
        // The match ending last first; of those ending together, the longest.
        matches.sort_by(|a, b| b.1.cmp(&a.1).then(a.0.cmp(&b.0)));
        for (_, _, target, groups) in &matches {
            let (value, fallback) = match target {
                Target::Latex { normalization, .. } => extract_latex(groups, *normalization),
                Target::Expr => extract_expr(groups),
            };
            match_found = true;
            if !fallback.is_empty() {
                fallbacks.push(fallback);
            }
            if let Some(v) = value {
                extracted.push(Extracted::Value(v));
                break;
            }
            if first_match_only {
                break;
            }
        }
        if !extracted.is_empty() || (match_found && first_match_only) {
            break;
        }
        i = j;
    }
    if let Some(f) = fallbacks.into_iter().next() {
        extracted.push(Extracted::Text(f));
    }
    extracted
}

/// `parse(solution)`: what math_verify reads from a reference solution.
pub fn parse_solution(text: &str) -> Vec<Extracted> {
    extract(text, &SOLUTION, false)
}

/// What TRL's `accuracy_reward` reads from a completion: LaTeX only, `\boxed{}` first, the
/// first match only.
pub fn parse_answer(text: &str) -> Vec<Extracted> {
    extract(text, &ANSWER, true)
}
