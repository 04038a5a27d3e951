//! `latex2sympy2_extended`'s `normalize_latex`: the clean-up applied to an extracted LaTeX
//! answer before it is parsed — `\boxed{}` contents taken out, `\left`/`\right`, `\dfrac`,
//! dollar signs and `\displaystyle` dropped, "and"/"or" made commas, trailing units and
//! `\text{...}` removed, and (for reference solutions) malformed `\frac12`, `\sqrt2`, `a/b`
//! repaired.

use std::sync::LazyLock;

use fancy_regex::{Captures, Regex};

/// Which normalizations run (`NormalizationConfig`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Normalization {
    pub basic_latex: bool,
    pub units: bool,
    pub malformed_operators: bool,
    pub nits: bool,
    pub boxed: Boxed,
}

/// What is taken out of `\boxed{}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Boxed {
    /// Every box's content, joined by commas.
    All,
    /// The last box's (and boxes just before it, separated by "and"/"or"/a comma).
    Last,
}

fn re(pattern: &str) -> Regex {
    Regex::new(pattern).unwrap_or_else(|e| panic!("math_verify pattern {pattern:?}: {e}"))
}

static LEFT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"\\m?left(\\\{|\{|\\\||\||\[|\(|\\rbracl|\\lgroup|\\lbrace|\\lbrack|\\vert|\\lvert|\\lceil|\\lfloor|\\vert|\\lvert|\\langle|\\llcorner|\\ulcorner)",
    )
});
static RIGHT: LazyLock<Regex> = LazyLock::new(|| {
    re(
        r"\\m?right(\\\}|\}|\\\||\||\]|\)|\\rbrack|\\rgroup|\\rbrace|\\rbrack|\\vert|\\rvert|\\rceil|\\rfloor|\\vert|\\rvert|\\rangle|\\lrcorner|\\urcorner)",
    )
});
static PERMUTATION: LazyLock<Regex> =
    LazyLock::new(|| re(r"\(([a-zA-Z0-9+\-*/\\ ]+?)\)_\{([a-zA-Z0-9+\-*/\\ ]+?)\}"));
static TO_REMOVE: LazyLock<Regex> = LazyLock::new(|| {
    re(r#"\\mathrm\{th\}|\\!\s*|\\text\s*\{\s*\}|\\\$|\$|(?<!\\)["']|\\displaystyle"#)
});
/// (name, pattern, replacement) in the order `replace_in_latex` tries them.
const REPLACEMENTS: &[(&str, &str)] = &[
    (r"\\math(?:rm|it|bf)", r"\text"),
    (r"\\text(?:normal|bf|it|rm)", r"\text"),
    (r"\\(?:d|t|c)frac", r"\frac"),
    (r"\s\.", r" 0."),
    (r"\{\.", r"{0."),
    (r"\~\=", r"\approx"),
    (r"\s*\{\s*,\s*\}", r","),
    (r"(?<![a-zA-Z])(,?\s*(?:and|or))(?![a-zA-Z])", r","),
    (r"(,?\s*\\text\{\s*(?:and|or)\s*\})", r","),
    (r"(?<!\\)\\\s", r" "),
    (r"infinity", r"\infty"),
    (r",?(\\ldots)", r" "),
    (r"\s*\bpercentage\b", r"\%"),
    (r"\\text\{percentage\}", r"%"),
    (r"\s*\bpercent\b", r"\%"),
    (r"\\text\{percent\}", r"%"),
    (r"\s*\bpct\b", r"\%"),
    (r"\\text\{pct\}", r"%"),
    (r"((?<!\\)inf(?!inity))", r"\infty"),
    (r" sqrt", r"\sqrt"),
];
static REPLACE: LazyLock<Regex> = LazyLock::new(|| {
    re(&REPLACEMENTS
        .iter()
        .enumerate()
        .map(|(i, (p, _))| format!("(?P<r{i}>{p})"))
        .collect::<Vec<_>>()
        .join("|"))
});
static COMMAND_SLASH: LazyLock<Regex> = LazyLock::new(|| re(r"\\\\(?=[a-zA-Z])"));
static UNIT_SUPERSCRIPT: LazyLock<Regex> =
    LazyLock::new(|| re(r"(\\(?:text|mbox)\{.*?\})(\^\d|\{\^\d\})?$"));

/// The unit words `latex2sympy2_extended` strips after a number (its list, in its order:
/// "integer" "point" is one word there too).
const UNITS: &[&str] = &[
    "integerpoint",
    "feet",
    "sue",
    "digit",
    "pound",
    "meal",
    "edge",
    "student",
    "children ticket",
    "multiple",
    "east",
    "degree",
    "mph",
    "kmph",
    "ft",
    "m square",
    " m east",
    "sq m",
    "deg",
    "mile",
    "q .",
    "monkey",
    "prime",
    "ratio",
    "profit of rs",
    "rd",
    "o",
    "gm",
    "p . m",
    "lb",
    "tile",
    "per",
    "dm",
    "lt",
    "gain",
    "ab",
    "way",
    "west",
    "a .",
    "b .",
    "c .",
    "d .",
    "e .",
    "f .",
    "g .",
    "h .",
    "t",
    "h",
    "no change",
    "men",
    "soldier",
    "pie",
    "bc",
    "excess",
    "st",
    "inches",
    "noon",
    "cent",
    "by",
    "gal",
    "kmh",
    "c",
    "acre",
    "rise",
    "a . m",
    "th",
    "π r 2",
    "sq",
    "mark",
    "l",
    "toy",
    "coin",
    "sq . m",
    "gallon",
    "° f",
    "profit",
    "minw",
    "yr",
    "women",
    "am",
    "pm",
    "hr",
    "cu cm",
    "square",
    "v â € ™",
    "are",
    "rupee",
    "rounds",
    "cubic",
    "cc",
    "mtr",
    "s",
    "ohm",
    "number",
    "kmph",
    "day",
    "hour",
    "minute",
    "min",
    "second",
    "man",
    "woman",
    "sec",
    "cube",
    "mt",
    "sq inch",
    "mp",
    "∏ cm ³",
    "hectare",
    "more",
    "sec",
    "unit",
    "cu . m",
    "cm 2",
    "rs .",
    "rs",
    "kg",
    "g",
    "month",
    "km",
    "m",
    "cm",
    "mm",
    "apple",
    "liter",
    "loss",
    "yard",
    "pure",
    "year",
    "increase",
    "decrease",
    "d",
    "less",
    "Surface",
    "litre",
    "pi sq m",
    "s .",
    "metre",
    "meter",
    "inch",
];
static UNITS_RE: LazyLock<Regex> = LazyLock::new(|| {
    re(&format!(
        r"(\d|\}}|\s)\s*(?:(?:{})(?:s|es)?)\s*$",
        UNITS.join("|")
    ))
});
static MALFORMED: LazyLock<Vec<(Regex, &'static str)>> = LazyLock::new(|| {
    [
        (r"\^\s?\((.*?)\)", r"^{$1}"),
        (r"sqrt\s?\((.*?)\)", r"\sqrt{$1}"),
        (r"\\frac\s?(\d)\s?(\d+)", r"\frac{$1}{$2}"),
        (r"\\log_\s?(\d)\s?(\d+)", r"\log_{$1}{$2}"),
        (r"\\frac\s?\{(.*?)\}\s?(\d)", r"\frac{$1}{$2}"),
        (r"\\frac\s?(\d)\s?\{(.*?)\}", r"\frac{$1}{$2}"),
        (r"\\sqrt\s?(\d)", r"\sqrt{$1}"),
    ]
    .into_iter()
    .map(|(p, r)| (re(p), r))
    .collect()
});
static SEPARATOR: LazyLock<Regex> = LazyLock::new(|| re(r"\b(and|or)\b|,|;"));

fn replace_all(re: &Regex, text: &str, with: &str) -> String {
    // A pattern that gives up on a pathological input leaves the text as it was.
    re.try_replacen(text, 0, with)
        .map(|s| s.into_owned())
        .unwrap_or_else(|_| text.to_string())
}

/// `extract_boxed_content`: the contents of `\boxed{}` / `\fbox{}`, right to left.
pub fn extract_boxed(text: &str, mode: Boxed) -> String {
    let bytes = text.as_bytes();
    let closing = |open: usize, max: usize| -> Option<usize> {
        let mut depth = 1;
        let mut i = open;
        while i + 1 < max {
            i += 1;
            match bytes[i] {
                b'{' => depth += 1,
                b'}' => {
                    depth -= 1;
                    if depth == 0 {
                        return Some(i);
                    }
                }
                _ => {}
            }
        }
        None
    };
    let mut results: Vec<String> = Vec::new();
    let mut current = text.len();
    let mut max = text.len();
    let mut last_start: Option<usize> = None;
    loop {
        let boxed = text[..current].rfind("\\boxed");
        let fbox = text[..current].rfind("\\fbox");
        let (start, len) = match (boxed, fbox) {
            (None, None) => break,
            (Some(b), Some(f)) if f > b => (f, 5),
            (Some(b), _) => (b, 6),
            (None, Some(f)) => (f, 5),
        };
        let mut next = start + len;
        while next < max && (bytes[next] as char).is_ascii_whitespace() {
            next += 1;
        }
        if next >= max {
            break;
        }
        if bytes[next] == b'{' {
            let Some(end) = closing(next, max) else {
                if results.is_empty() {
                    results.push(text[next..].to_string());
                }
                break;
            };
            let content = text[next + 1..end].trim().to_string();
            if mode == Boxed::Last
                && let Some(last) = last_start
            {
                let previous = results.last().cloned().unwrap_or_default();
                let between = text.get(end + 1..last).unwrap_or("");
                let between_chars = between.chars().count();
                let allowed = between_chars < 10
                    || (previous != content
                        && between_chars < 70
                        && SEPARATOR.is_match(between).unwrap_or(false));
                if !allowed {
                    break;
                }
            }
            if results.last() != Some(&content) {
                results.push(content);
            }
            last_start = Some(start);
            max = start;
        } else {
            if results.is_empty() {
                results.push(text[next..].to_string());
            }
            break;
        }
        current = start;
    }
    if results.is_empty() {
        return text.to_string();
    }
    results.reverse();
    results.join(",")
}

fn fix_fracs(text: &str) -> String {
    let parts: Vec<&str> = text.split("\\frac").collect();
    let mut out = parts[0].to_string();
    for part in &parts[1..] {
        let part = part.trim_start();
        out.push_str("\\frac");
        let chars: Vec<char> = part.chars().collect();
        if chars.first() == Some(&'{') {
            out.push_str(part);
        } else if chars.len() < 2 {
            return text.to_string();
        } else {
            let (a, b) = (chars[0], chars[1]);
            let post: String = chars[2..].iter().collect();
            if b != '{' {
                out.push_str(&format!("{{{a}}}{{{b}}}{post}"));
            } else {
                out.push_str(&format!("{{{a}}}{b}{post}"));
            }
        }
    }
    out
}

fn fix_a_slash_b(text: &str) -> String {
    let parts: Vec<&str> = text.split('/').collect();
    if parts.len() != 2 {
        return text.to_string();
    }
    // Python's int() takes surrounding spaces, underscores between digits and a sign; the
    // round trip then demands the text be exactly "a/b".
    match (parts[0].parse::<i64>(), parts[1].parse::<i64>()) {
        (Ok(a), Ok(b)) if text == format!("{a}/{b}") => format!("\\frac{{{a}}}{{{b}}}"),
        _ => text.to_string(),
    }
}

fn fix_sqrt(text: &str) -> String {
    if !text.contains("\\sqrt") {
        return text.to_string();
    }
    let parts: Vec<&str> = text.split("\\sqrt").collect();
    let mut out = parts[0].to_string();
    for part in &parts[1..] {
        let part = part.trim_start();
        match part.chars().next() {
            Some(c) if c != '{' && c != '[' => {
                out.push_str(&format!("\\sqrt{{{c}}}{}", &part[c.len_utf8()..]));
            }
            _ => {
                out.push_str("\\sqrt");
                out.push_str(part);
            }
        }
    }
    out
}

/// `normalize_latex(text, config)`.
pub fn normalize(text: &str, config: Normalization) -> String {
    let mut text = extract_boxed(text, config.boxed);
    if config.basic_latex {
        text = text.replace(r"\mathrm{T}", "T");
        text = text.replace(r"\mathrm{d}", "d").replace(r"{\rm d}", "d");
        text = text
            .replace(r"\left[\begin{matrix}", r"\begin{bmatrix}")
            .replace(r"\end{matrix}\right]", r"\end{bmatrix}");
        text = replace_all(&LEFT, &text, "$1");
        text = replace_all(&RIGHT, &text, "$1");
        text = replace_all(&PERMUTATION, &text, r"\frac{($1)!}{(($1)-($2))!}");
        text = replace_all(&TO_REMOVE, &text, "");
        text = REPLACE
            .try_replacen(&text, 0, |caps: &Captures<'_>| {
                (0..REPLACEMENTS.len())
                    .find(|i| caps.name(&format!("r{i}")).is_some())
                    .map_or("", |i| REPLACEMENTS[i].1)
                    .to_string()
            })
            .map(|s| s.into_owned())
            .unwrap_or(text.clone());
        text = text.replace(['\n', '\t'], " ");
        if !text.contains("matrix") {
            text = replace_all(&COMMAND_SLASH, &text, r"\");
        }
    }
    if config.units {
        let stripped = replace_all(&UNIT_SUPERSCRIPT, &text, "").trim().to_string();
        if !stripped.is_empty() && stripped != text {
            text = stripped;
        }
        for _ in 0..2 {
            let stripped = replace_all(&UNITS_RE, &text, "$1");
            if !stripped.is_empty() && stripped != text {
                text = stripped;
            }
        }
    }
    if config.nits {
        if text.starts_with('.') {
            text = format!("0{text}");
        }
        if text == "0.5" {
            text = r"\frac{1}{2}".into();
        }
    }
    if config.malformed_operators {
        for (re, with) in MALFORMED.iter() {
            text = replace_all(re, &text, with);
        }
        text = text.replace(" sqrt", "\\sqrt");
        text = fix_sqrt(&text);
        text = fix_fracs(&text);
        text = fix_a_slash_b(&text);
    }
    text
}

#[cfg(test)]
mod tests {
    use super::*;

    const ALL: Normalization = Normalization {
        basic_latex: true,
        units: true,
        malformed_operators: true,
        nits: true,
        boxed: Boxed::All,
    };

    #[test]
    fn normalizes_as_latex2sympy2_extended() {
        assert_eq!(
            extract_boxed(r"a \boxed{1} and \boxed{2}", Boxed::All),
            "1,2"
        );
        assert_eq!(
            extract_boxed(r"\boxed{\frac{1}{2}}", Boxed::Last),
            r"\frac{1}{2}"
        );
        assert_eq!(normalize(r"\dfrac{3}{4}", ALL), r"\frac{3}{4}");
        assert_eq!(normalize(r"5 \text{ cm}", ALL), "5");
        assert_eq!(normalize(r"\frac12", ALL), r"\frac{1}{2}");
        assert_eq!(normalize("3/4", ALL), r"\frac{3}{4}");
        assert_eq!(normalize(r"\sqrt2", ALL), r"\sqrt{2}");
        assert_eq!(normalize(r"\left(1, 2\right)", ALL), "(1, 2)");
        assert_eq!(normalize("2 and 5", ALL), "2, 5");
        assert_eq!(normalize("10 percent", ALL), r"10\%");
    }
}
