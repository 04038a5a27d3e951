//! A LaTeX math parser giving [`Expr`]s the way `latex2sympy2_extended` reads them: single
//! letters are variables (lower-cased), juxtaposed numbers add (`2\frac{1}{2}` is 5/2),
//! `(a, b)` with `a < b` is an open interval and `(2, 1)` a tuple, a comma list is a set,
//! `1,000` alone is a thousand, `x = 3` an equation, `10\%` a percentage. What it does not
//! know is an error, as there: the answer then counts by its text only.

use super::expr::{Expr, Func, Q, Rel};

#[derive(Debug, Clone, PartialEq)]
enum Tok {
    Num(String),
    Letter(char),
    Cmd(String),
    Ch(char),
}

fn tokenize(s: &str) -> Result<Vec<Tok>, String> {
    let chars: Vec<char> = s.chars().collect();
    let mut out = Vec::new();
    let mut i = 0;
    while i < chars.len() {
        let c = chars[i];
        if c.is_whitespace() {
            i += 1;
        } else if c.is_ascii_digit()
            || (c == '.' && chars.get(i + 1).is_some_and(char::is_ascii_digit))
        {
            let start = i;
            while i < chars.len() && chars[i].is_ascii_digit() {
                i += 1;
            }
            if i < chars.len() && chars[i] == '.' {
                if !chars.get(i + 1).is_some_and(char::is_ascii_digit) {
                    return Err(format!("a number ends in '.' at {i}"));
                }
                i += 1;
                while i < chars.len() && chars[i].is_ascii_digit() {
                    i += 1;
                }
            }
            out.push(Tok::Num(chars[start..i].iter().collect()));
        } else if c.is_ascii_alphabetic() {
            out.push(Tok::Letter(c));
            i += 1;
        } else if c == '\\' {
            i += 1;
            let start = i;
            while i < chars.len() && chars[i].is_ascii_alphabetic() {
                i += 1;
            }
            if i == start {
                // \{ \} \% \, \; \: \! \| ...
                let Some(&d) = chars.get(i) else {
                    return Err("a lone backslash".into());
                };
                i += 1;
                match d {
                    ',' | ';' | ':' | '!' | ' ' => {}
                    // `\(` ... `\)` left by `\left(` read as parentheses.
                    '(' | ')' | '[' | ']' => out.push(Tok::Ch(d)),
                    _ => out.push(Tok::Cmd(d.to_string())),
                }
            } else {
                let name: String = chars[start..i].iter().collect();
                if name == "text"
                    || name == "textbf"
                    || name == "mbox"
                    || name == "textit"
                    || name == "textrm"
                {
                    // The braced text is one token.
                    while i < chars.len() && chars[i].is_whitespace() {
                        i += 1;
                    }
                    if chars.get(i) != Some(&'{') {
                        return Err("\\text without braces".into());
                    }
                    let mut depth = 0;
                    let start = i + 1;
                    loop {
                        let Some(&d) = chars.get(i) else {
                            return Err("unclosed \\text".into());
                        };
                        if d == '{' {
                            depth += 1;
                        } else if d == '}' {
                            depth -= 1;
                            if depth == 0 {
                                break;
                            }
                        }
                        i += 1;
                    }
                    out.push(Tok::Cmd(format!(
                        "text:{}",
                        chars[start..i].iter().collect::<String>()
                    )));
                    i += 1;
                } else if name == "begin" || name == "end" {
                    // \begin{pmatrix}: one token naming the environment (an array's column
                    // spec skipped).
                    let rest: String = chars[i..].iter().collect();
                    let Some(close) = rest.find('}').filter(|_| rest.starts_with('{')) else {
                        return Err(format!("\\{name} without its environment"));
                    };
                    let env = rest[1..close].to_string();
                    i += close + 1;
                    if name == "begin" && env == "array" && chars.get(i) == Some(&'{') {
                        while i < chars.len() && chars[i] != '}' {
                            i += 1;
                        }
                        i += 1;
                    }
                    out.push(Tok::Cmd(format!("{name}:{env}")));
                } else if SPACES.contains(&name.as_str()) {
                } else if KNOWN.contains(&name.as_str()) || GREEK.contains(&name.as_str()) {
                    out.push(Tok::Cmd(name));
                } else if let Some(known) = KNOWN
                    .iter()
                    .chain(GREEK)
                    .chain(SPACES)
                    .filter(|k| name.starts_with(**k))
                    .max_by_key(|k| k.len())
                {
                    // A lexer reads `\cdote` as `\cdot` then `e`, `\quadx` as a space then `x`.
                    if !SPACES.contains(known) {
                        out.push(Tok::Cmd(known.to_string()));
                    }
                    out.extend(name[known.len()..].chars().map(Tok::Letter));
                } else {
                    out.push(Tok::Cmd(name));
                }
            }
        } else if c == '!' && chars.get(i + 1) == Some(&'=') {
            out.push(Tok::Ch('≠'));
            i += 2;
        } else if c == '%' {
            out.push(Tok::Cmd("%".into()));
            i += 1;
        } else if "+-*/^_()[]{}|!,;=<>':&".contains(c)
            || c == '×'
            || c == '÷'
            || c == '·'
            || c == '≤'
            || c == '≥'
            || c == '≠'
            || c == 'π'
            || c == '∞'
        {
            out.push(Tok::Ch(c));
            i += 1;
        } else {
            return Err(format!("unexpected '{c}'"));
        }
    }
    Ok(out)
}

/// The commands the parser reads (a longer unknown name starting with one is that command
/// followed by letters).
const KNOWN: &[&str] = &[
    "cdot",
    "times",
    "div",
    "pm",
    "le",
    "leq",
    "leqslant",
    "ge",
    "geq",
    "geqslant",
    "lt",
    "gt",
    "neq",
    "ne",
    "in",
    "frac",
    "dfrac",
    "tfrac",
    "cfrac",
    "binom",
    "dbinom",
    "tbinom",
    "choose",
    "sqrt",
    "pi",
    "infty",
    "infin",
    "emptyset",
    "varnothing",
    "lfloor",
    "rfloor",
    "lceil",
    "rceil",
    "mathbb",
    "max",
    "min",
    "gcd",
    "lcm",
    "sin",
    "cos",
    "tan",
    "cot",
    "sec",
    "csc",
    "arcsin",
    "arccos",
    "arctan",
    "sinh",
    "cosh",
    "tanh",
    "log",
    "ln",
    "lg",
    "exp",
    "circ",
    "cup",
    "cap",
];

/// Spacing and sizing commands, read as nothing.
const SPACES: &[&str] = &[
    "quad",
    "qquad",
    "displaystyle",
    "left",
    "right",
    "bigl",
    "bigr",
    "Bigl",
    "Bigr",
    "big",
    "Big",
];

const GREEK: &[&str] = &[
    "alpha",
    "beta",
    "gamma",
    "delta",
    "epsilon",
    "varepsilon",
    "zeta",
    "eta",
    "theta",
    "vartheta",
    "iota",
    "kappa",
    "lambda",
    "mu",
    "nu",
    "xi",
    "rho",
    "sigma",
    "tau",
    "upsilon",
    "phi",
    "varphi",
    "chi",
    "psi",
    "omega",
    "Gamma",
    "Delta",
    "Theta",
    "Lambda",
    "Xi",
    "Sigma",
    "Upsilon",
    "Phi",
    "Psi",
    "Omega",
];

fn func_of(name: &str) -> Option<Func> {
    Some(match name {
        "sin" => Func::Sin,
        "cos" => Func::Cos,
        "tan" => Func::Tan,
        "cot" => Func::Cot,
        "sec" => Func::Sec,
        "csc" => Func::Csc,
        "arcsin" => Func::Asin,
        "arccos" => Func::Acos,
        "arctan" => Func::Atan,
        "sinh" => Func::Sinh,
        "cosh" => Func::Cosh,
        "tanh" => Func::Tanh,
        "log" | "ln" | "lg" => Func::Log,
        "exp" => Func::Exp,
        _ => return None,
    })
}

struct Parser {
    toks: Vec<Tok>,
    pos: usize,
    /// Inside `| ... |`: a `|` closes instead of opening.
    in_abs: usize,
}

type Res = Result<Expr, String>;

/// `-x`: a negative number stays a number (`-7`, `-\frac{1}{2}`).
pub(crate) fn neg(x: Expr) -> Expr {
    match x {
        Expr::Int(n) => Expr::Int(-n),
        Expr::Rat(n, d) => Expr::Rat(-n, d),
        Expr::Float(v) => Expr::Float(-v),
        Expr::Mul(v) if v.len() == 2 && v[0] == Expr::Int(-1) => {
            v.into_iter().nth(1).unwrap_or(Expr::Int(0))
        }
        x => Expr::Mul(vec![Expr::Int(-1), x]),
    }
}

/// `a / b`: two integers make a fraction; anything else stays a quotient (`1/0` too, SymPy's
/// `zoo`).
fn divide(a: Expr, b: Expr) -> Expr {
    if let (Expr::Int(p), Expr::Int(q)) = (&a, &b)
        && let Some(r) = Q::new(*p, *q)
    {
        return r.expr();
    }
    Expr::Mul(vec![a, Expr::Pow(Box::new(b), Box::new(Expr::Int(-1)))])
}

fn exact_literal(x: &Expr) -> Option<Q> {
    match x {
        Expr::Int(n) => Some(Q(*n, 1)),
        Expr::Rat(n, d) => Some(Q(*n, *d)),
        _ => None,
    }
}

impl Parser {
    fn peek(&self) -> Option<&Tok> {
        self.toks.get(self.pos)
    }
    fn is(&self, c: char) -> bool {
        self.peek() == Some(&Tok::Ch(c))
    }
    fn is_cmd(&self, name: &str) -> bool {
        matches!(self.peek(), Some(Tok::Cmd(n)) if n == name)
    }
    fn eat(&mut self, c: char) -> bool {
        if self.is(c) {
            self.pos += 1;
            true
        } else {
            false
        }
    }
    fn expect(&mut self, c: char) -> Result<(), String> {
        if self.eat(c) {
            Ok(())
        } else {
            Err(format!("expected '{c}' at token {}", self.pos))
        }
    }

    /// A comma (or semicolon) list of relations: one item, else a set.
    /// Items separated by `,` or `;` (inside brackets and braces `;` is a comma too).
    fn list(&mut self) -> Res {
        let mut items = vec![self.relation()?];
        while self.eat(',') || self.eat(';') {
            items.push(self.relation()?);
        }
        Ok(Self::items_value(items))
    }

    fn items_value(mut items: Vec<Expr>) -> Expr {
        if items.len() == 1 {
            return items.remove(0);
        }
        // `x = 1, 2, 3`: the relation holds the set of the values that follow it.
        if matches!(items[0], Expr::Rel(..)) && items[1..].iter().all(|x| !x.is_relation()) {
            let rest: Vec<Expr> = items.drain(1..).collect();
            if let Some(Expr::Rel(op, lhs, rhs)) = items.pop() {
                let mut values = vec![*rhs];
                values.extend(rest);
                return Expr::Rel(op, lhs, Box::new(Expr::Set(values)));
            }
        }
        Expr::Set(items)
    }

    /// The whole answer: `;` separates groups, each group of several items a tuple
    /// (`p=5,q=2;p=7,q=2` is a set of two pairs).
    fn top(&mut self) -> Res {
        let mut groups = vec![vec![self.relation()?]];
        loop {
            if self.eat(',') {
                let item = self.relation()?;
                groups.last_mut().ok_or("empty list")?.push(item);
            } else if self.eat(';') {
                groups.push(vec![self.relation()?]);
            } else {
                break;
            }
        }
        if groups.len() == 1 {
            return Ok(Self::items_value(groups.remove(0)));
        }
        Ok(Expr::Set(
            groups
                .into_iter()
                .map(|mut g| {
                    if g.len() == 1 {
                        g.remove(0)
                    } else {
                        Expr::Tuple(g)
                    }
                })
                .collect(),
        ))
    }

    fn rel_op(&self) -> Option<Rel> {
        match self.peek()? {
            Tok::Ch('=') => Some(Rel::Eq),
            Tok::Ch('<') => Some(Rel::Lt),
            Tok::Ch('>') => Some(Rel::Gt),
            Tok::Ch('≤') => Some(Rel::Le),
            Tok::Ch('≥') => Some(Rel::Ge),
            Tok::Ch('≠') => Some(Rel::Ne),
            Tok::Cmd(n) => match n.as_str() {
                "le" | "leq" | "leqslant" => Some(Rel::Le),
                "ge" | "geq" | "geqslant" => Some(Rel::Ge),
                "lt" => Some(Rel::Lt),
                "gt" => Some(Rel::Gt),
                "neq" | "ne" => Some(Rel::Ne),
                "in" => Some(Rel::Eq),
                _ => None,
            },
            _ => None,
        }
    }

    /// Sums joined by `\cup` (a union of sets).
    fn union(&mut self) -> Res {
        let mut parts = vec![self.sum()?];
        while self.eat_cmd("cup") {
            parts.push(self.sum()?);
        }
        Ok(if parts.len() == 1 {
            parts.remove(0)
        } else {
            Expr::Union(parts)
        })
    }

    fn relation(&mut self) -> Res {
        let mut first = self.union()?;
        let mut rels = Vec::new();
        let mut lhs = first.clone();
        loop {
            if self.eat_cmd("approx") {
                // `x \approx 11` is 11; after anything else the approximation is dropped.
                let rhs = self.union()?;
                if rels.is_empty() && first.only_symbols() {
                    first = rhs.clone();
                    lhs = rhs;
                }
                continue;
            }
            let Some(op) = self.rel_op() else { break };
            self.pos += 1;
            // `<=` and `>=` written as two characters.
            let op = match (op, self.peek()) {
                (Rel::Lt, Some(Tok::Ch('='))) => {
                    self.pos += 1;
                    Rel::Le
                }
                (Rel::Gt, Some(Tok::Ch('='))) => {
                    self.pos += 1;
                    Rel::Ge
                }
                _ => op,
            };
            let rhs = self.union()?;
            rels.push(Expr::Rel(op, Box::new(lhs), Box::new(rhs.clone())));
            lhs = rhs;
        }
        Ok(match rels.len() {
            0 => first,
            1 => rels.remove(0),
            _ => Expr::And(rels),
        })
    }

    fn sum(&mut self) -> Res {
        let mut sign_pm = false;
        let mut terms = Vec::new();
        let mut first = true;
        loop {
            let mut negative = false;
            let mut plus_minus = false;
            loop {
                if self.eat('+') {
                } else if self.eat('-') {
                    negative = !negative;
                } else if self.is_cmd("pm") {
                    self.pos += 1;
                    plus_minus = true;
                } else {
                    break;
                }
            }
            if !first && !negative && !plus_minus && terms.len() == terms.len() && self.pos > 0 {
                // a term must follow an operator; handled by `term` erroring on nothing
            }
            let t = self.term()?;
            let t = if negative { neg(t) } else { t };
            if plus_minus {
                sign_pm = true;
                terms.push((t, true));
            } else {
                terms.push((t, false));
            }
            first = false;
            if !(self.is('+') || self.is('-') || self.is_cmd("pm")) {
                break;
            }
        }
        if sign_pm {
            // a ± b: the set {a − b, a + b}.
            let build = |signs: &[(Expr, bool)], minus: bool| -> Expr {
                let v: Vec<Expr> = signs
                    .iter()
                    .map(|(t, pm)| {
                        if *pm && minus {
                            neg(t.clone())
                        } else {
                            t.clone()
                        }
                    })
                    .collect();
                if v.len() == 1 {
                    v.into_iter().next().unwrap_or(Expr::Int(0))
                } else {
                    Expr::Add(v)
                }
            };
            return Ok(Expr::Set(vec![build(&terms, false), build(&terms, true)]));
        }
        let mut v: Vec<Expr> = terms.into_iter().map(|(t, _)| t).collect();
        Ok(if v.len() == 1 {
            v.remove(0)
        } else {
            Expr::Add(v)
        })
    }

    fn starts_factor(&self) -> bool {
        match self.peek() {
            Some(Tok::Num(_) | Tok::Letter(_)) => true,
            Some(Tok::Ch('|')) => self.in_abs == 0,
            Some(Tok::Ch(c)) => matches!(c, '(' | '[' | '{' | 'π' | '∞'),
            Some(Tok::Cmd(n)) => {
                !matches!(
                    n.as_str(),
                    "cdot"
                        | "times"
                        | "div"
                        | "pm"
                        | "le"
                        | "leq"
                        | "leqslant"
                        | "ge"
                        | "geq"
                        | "geqslant"
                        | "lt"
                        | "gt"
                        | "neq"
                        | "ne"
                        | "in"
                        | "}"
                        | "%"
                        | "rfloor"
                        | "rceil"
                        | "cup"
                        | "cap"
                        | "circ"
                        | "to"
                        | "approx"
                        | "mid"
                        | "vert"
                        | "rvert"
                        | "\\"
                ) && !n.starts_with("end:")
                    && self.rel_op().is_none()
            }
            None => false,
        }
    }

    /// Factors joined by `\cdot`, `\times`, `*`, `/`, `\div` and by juxtaposition.
    fn term(&mut self) -> Res {
        self.term_of(false)
    }

    /// A product or quotient of juxtaposed factors (`arg`: a function's argument without
    /// parentheses, which stops before another function: `\cos \pi / 3` is cos(π/3)).
    fn term_of(&mut self, arg: bool) -> Res {
        let factor = |p: &mut Self| if arg { p.implicit_arg() } else { p.implicit() };
        let mut acc = factor(self)?;
        loop {
            if self.eat('*')
                || self.eat('×')
                || self.eat('·')
                || self.eat_cmd("cdot")
                || self.eat_cmd("times")
            {
                let rhs = factor(self)?;
                acc = match acc {
                    Expr::Mul(mut v) => {
                        v.push(rhs);
                        Expr::Mul(v)
                    }
                    a => Expr::Mul(vec![a, rhs]),
                };
            } else if self.eat('/') || self.eat('÷') || self.eat(':') || self.eat_cmd("div") {
                let rhs = factor(self)?;
                acc = divide(acc, rhs);
            } else {
                return Ok(acc);
            }
        }
    }

    fn eat_cmd(&mut self, name: &str) -> bool {
        if self.is_cmd(name) {
            self.pos += 1;
            true
        } else {
            false
        }
    }

    /// Juxtaposed factors: `2x`, `3\sqrt{2}`; numbers next to numbers add (`2\frac12`, `4 2`).
    fn implicit(&mut self) -> Res {
        if self.eat('-') {
            return Ok(neg(self.implicit()?));
        }
        if self.eat('+') {
            return self.implicit();
        }
        let mut factors = vec![self.postfix()?];
        while self.starts_factor() {
            factors.push(self.postfix()?);
        }
        Ok(juxtaposed(factors))
    }

    /// Powers, factorials, percentages and degrees after an atom.
    fn postfix(&mut self) -> Res {
        let mut x = self.atom()?;
        loop {
            if self.eat('^') {
                if self.is_cmd("circ") {
                    self.pos += 1;
                    continue;
                }
                if self.is('{')
                    && matches!(self.toks.get(self.pos + 1), Some(Tok::Cmd(n)) if n == "circ")
                    && self.toks.get(self.pos + 2) == Some(&Tok::Ch('}'))
                {
                    self.pos += 3;
                    continue;
                }
                let e = self.exponent()?;
                x = if x == Expr::E {
                    Expr::Func(Func::Exp, vec![e])
                } else {
                    Expr::Pow(Box::new(x), Box::new(e))
                };
            } else if self.eat('!') {
                x = Expr::Func(Func::Factorial, vec![x]);
            } else if self.is_cmd("%") {
                if !x.is_number() {
                    return Err("a percent of a non-number".into());
                }
                self.pos += 1;
                x = Expr::Pct(Box::new(x));
            } else if self.is('\'') {
                return Err("a prime".into());
            } else {
                return Ok(x);
            }
        }
    }

    /// `^{...}` or `^2` / `^x` / `^\pi`.
    fn exponent(&mut self) -> Res {
        if self.eat('{') {
            let e = self.list()?;
            self.expect('}')?;
            return Ok(e);
        }
        match self.peek().cloned() {
            Some(Tok::Num(n)) => {
                // `2^10` is 2^1 · 0: only the first digit.
                self.pos += 1;
                let mut digits = n.chars();
                let first = digits.next().ok_or("empty number")?;
                let rest: String = digits.collect();
                if !rest.is_empty() {
                    self.toks.insert(self.pos, Tok::Num(rest));
                }
                Ok(Expr::Int(i128::from(
                    first.to_digit(10).ok_or("not a digit")?,
                )))
            }
            Some(Tok::Letter(_) | Tok::Cmd(_)) => self.atom(),
            _ => Err("a power without an exponent".into()),
        }
    }

    fn group(&mut self) -> Res {
        self.expect('{')?;
        let x = self.list()?;
        self.expect('}')?;
        Ok(x)
    }

    fn atom(&mut self) -> Res {
        let tok = self.peek().cloned().ok_or("unexpected end")?;
        self.pos += 1;
        match tok {
            Tok::Num(s) => {
                if s.contains('.') {
                    s.parse::<f64>().map(Expr::Float).map_err(|e| e.to_string())
                } else {
                    let t = s.trim_start_matches('0');
                    if t.len() > 36 {
                        return Ok(Expr::Float(s.parse::<f64>().map_err(|e| e.to_string())?));
                    }
                    Ok(Expr::Int(if t.is_empty() {
                        0
                    } else {
                        t.parse::<i128>().map_err(|e| e.to_string())?
                    }))
                }
            }
            Tok::Letter(c) => {
                if c == 'e' && !self.is('_') {
                    return Ok(Expr::E);
                }
                if matches!(c, 'f' | 'g' | 'h') && self.is('(') {
                    self.pos += 1;
                    let args = self.list()?;
                    self.expect(')')?;
                    let args = match args {
                        Expr::Set(v) => v,
                        a => vec![a],
                    };
                    return Ok(Expr::Apply(c.to_string(), args));
                }
                let name = c.to_ascii_lowercase().to_string();
                self.subscripted(name)
            }
            Tok::Ch('π') => Ok(Expr::Pi),
            Tok::Ch('∞') => Ok(Expr::Inf),
            Tok::Ch('(') | Tok::Ch('[') => self.bracketed(tok == Tok::Ch('(')),
            Tok::Ch('{') => {
                let x = self.list()?;
                self.expect('}')?;
                Ok(x)
            }
            Tok::Ch('|') => {
                self.in_abs += 1;
                let x = self.sum();
                self.in_abs -= 1;
                let x = x?;
                self.expect('|')?;
                Ok(Expr::Func(Func::Abs, vec![x]))
            }
            Tok::Cmd(name) => self.command(&name),
            Tok::Ch(c) => Err(format!("unexpected '{c}'")),
        }
    }

    fn subscripted(&mut self, name: String) -> Res {
        if self.eat('_') {
            let sub = match self.peek().cloned() {
                Some(Tok::Ch('{')) => {
                    self.pos += 1;
                    let start = self.pos;
                    let mut depth = 1;
                    while depth > 0 {
                        match self.peek() {
                            Some(Tok::Ch('{')) => depth += 1,
                            Some(Tok::Ch('}')) => depth -= 1,
                            None => return Err("unclosed subscript".into()),
                            _ => {}
                        }
                        self.pos += 1;
                    }
                    let inner = &self.toks[start..self.pos - 1];
                    let text: String = inner.iter().map(tok_text).collect();
                    if inner.len() == 1 {
                        text
                    } else {
                        format!("{{{text}}}")
                    }
                }
                Some(Tok::Num(n)) => {
                    self.pos += 1;
                    n[..1].to_string()
                }
                Some(t) => {
                    self.pos += 1;
                    tok_text(&t)
                }
                None => return Err("a subscript without its index".into()),
            };
            return Ok(Expr::Sym(format!("{name}_{sub}")));
        }
        Ok(Expr::Sym(name))
    }

    /// `( ... )` or `[ ... ]`: a value, an interval of two ends, a tuple of more.
    fn bracketed(&mut self, round: bool) -> Res {
        let x = self.list()?;
        let close_round = if self.eat(')') {
            true
        } else if self.eat(']') {
            false
        } else {
            return Err("unclosed bracket".into());
        };
        match x {
            Expr::Set(items) if items.len() == 2 => {
                let (lo, hi) = (items[0].clone(), items[1].clone());
                // An interval that would be empty is a pair, as `convert_interval` decides.
                let empty = match (lo.eval(&|_| f64::NAN), hi.eval(&|_| f64::NAN)) {
                    (Some(a), Some(b)) => {
                        (round && close_round && b <= a) || (!round && !close_round && b < a)
                    }
                    _ => false,
                };
                if !empty {
                    Ok(Expr::Interval {
                        lo: Box::new(lo),
                        hi: Box::new(hi),
                        lopen: round,
                        ropen: close_round,
                    })
                } else {
                    Ok(Expr::Tuple(items))
                }
            }
            Expr::Set(items) => Ok(Expr::Tuple(items)),
            x => Ok(x),
        }
    }

    fn command(&mut self, name: &str) -> Res {
        if let Some(text) = name.strip_prefix("text:") {
            let t = text.trim();
            let t = t
                .strip_prefix('(')
                .and_then(|t| t.strip_suffix(')'))
                .unwrap_or(t)
                .trim();
            if t.is_empty() {
                return Err("empty text".into());
            }
            return Ok(Expr::Sym(t.to_lowercase()));
        }
        if let Some(f) = func_of(name) {
            return self.function(name, f);
        }
        if GREEK.contains(&name) {
            return self.subscripted(name.to_lowercase());
        }
        match name {
            "pi" => Ok(Expr::Pi),
            "infty" | "infin" => Ok(Expr::Inf),
            "emptyset" | "varnothing" => Ok(Expr::EmptySet),
            "{" => {
                if self.eat_cmd("}") {
                    return Ok(Expr::EmptySet);
                }
                let x = self.list()?;
                if !self.eat_cmd("}") {
                    return Err("unclosed \\{".into());
                }
                Ok(Expr::Set(match x {
                    Expr::Set(v) => v,
                    x => vec![x],
                }))
            }
            "frac" | "dfrac" | "tfrac" | "cfrac" => {
                let a = self.group()?;
                let b = self.group()?;
                Ok(divide(a, b))
            }
            "binom" | "dbinom" | "tbinom" | "choose" => {
                let a = self.group()?;
                let b = self.group()?;
                let x = Expr::Func(Func::Binom, vec![a, b]);
                Ok(x.exact().map_or(x, Q::expr))
            }
            "sqrt" => {
                let index = if self.eat('[') {
                    let i = self.sum()?;
                    self.expect(']')?;
                    Some(i)
                } else {
                    None
                };
                if !self.is('{') {
                    return Err("\\sqrt without braces".into());
                }
                let x = self.group()?;
                let e = match index {
                    None => Expr::Rat(1, 2),
                    Some(Expr::Int(n)) => Expr::rational(1, n).ok_or("a zeroth root")?,
                    Some(i) => divide(Expr::Int(1), i),
                };
                Ok(Expr::Pow(Box::new(x), Box::new(e)))
            }
            "lfloor" | "lceil" => {
                let x = self.sum()?;
                let close = if name == "lfloor" { "rfloor" } else { "rceil" };
                if !self.eat_cmd(close) {
                    return Err(format!("unclosed \\{name}"));
                }
                Ok(Expr::Func(
                    if name == "lfloor" {
                        Func::Floor
                    } else {
                        Func::Ceil
                    },
                    vec![x],
                ))
            }
            "mathbb" => {
                let x = self.group()?;
                if x == Expr::Sym("r".into()) {
                    Ok(Expr::Reals)
                } else {
                    Err("an unknown \\mathbb".into())
                }
            }
            "sum" | "prod" => {
                // \sum_{k=0}^{n} body: the index, its bounds, then the summand (a term).
                self.expect('_')?;
                self.expect('{')?;
                let Some(Tok::Letter(v)) = self.peek().cloned() else {
                    return Err("a sum without its index".into());
                };
                self.pos += 1;
                self.expect('=')?;
                let lo = self.sum()?;
                self.expect('}')?;
                self.expect('^')?;
                let hi = self.exponent()?;
                let body = self.term()?;
                Ok(Expr::Sum {
                    var: v.to_ascii_lowercase().to_string(),
                    lo: Box::new(lo),
                    hi: Box::new(hi),
                    body: Box::new(body),
                    product: name == "prod",
                })
            }
            "max" | "min" | "gcd" | "lcm" => {
                self.expect('(')?;
                let x = self.list()?;
                self.expect(')')?;
                let args = match x {
                    Expr::Set(v) => v,
                    x => vec![x],
                };
                let f = match name {
                    "max" => Func::Max,
                    "min" => Func::Min,
                    "gcd" => Func::Gcd,
                    _ => Func::Lcm,
                };
                Ok(Expr::Func(f, args))
            }
            "%" => Err("a percent sign without a number".into()),
            n if n.starts_with("begin:") => self.matrix(&n["begin:".len()..]),
            _ => Err(format!("unknown command \\{name}")),
        }
    }

    /// `\begin{pmatrix} a & b \\ c & d \end{pmatrix}` (and bmatrix, matrix, array...).
    fn matrix(&mut self, env: &str) -> Res {
        if !env.ends_with("matrix") && env != "array" {
            return Err(format!("unknown environment {env}"));
        }
        let end = format!("end:{env}");
        let mut rows: Vec<Vec<Expr>> = vec![vec![]];
        loop {
            if self.eat_cmd(&end) {
                break;
            }
            if self.eat_cmd("\\") {
                // A row break; a trailing one before \end adds no row.
                if !self.is_cmd(&end) {
                    rows.push(Vec::new());
                }
                continue;
            }
            if self.peek().is_none() {
                return Err(format!("unclosed {env}"));
            }
            let cell = self.sum()?;
            rows.last_mut().ok_or("no row")?.push(cell);
            if !self.eat('&') && !self.is_cmd("\\") && !self.is_cmd(&end) {
                return Err("a matrix cell ends in neither & nor \\\\".into());
            }
        }
        let cols = rows.first().map_or(0, Vec::len);
        if cols == 0 || rows.iter().any(|r| r.len() != cols) {
            return Err("a ragged matrix".into());
        }
        Ok(Expr::Matrix(rows))
    }

    /// `\sin x`, `\sin(x)`, `\sin^2 x`, `\log_2 8`, `\ln x`.
    fn function(&mut self, name: &str, f: Func) -> Res {
        let mut base = match name {
            "ln" => None,
            "log" | "lg" => Some(Expr::Int(10)),
            _ => None,
        };
        let mut power = None;
        loop {
            if self.eat('_') && f == Func::Log {
                base = Some(self.exponent()?);
            } else if self.eat('^') {
                power = Some(self.exponent()?);
            } else {
                break;
            }
        }
        let arg = if self.eat('(') {
            let x = self.list()?;
            self.expect(')')?;
            x
        } else if self.is('{') {
            self.group()?
        } else {
            self.term_of(true)?
        };
        let (mut f, mut args) = (f, vec![arg]);
        if f == Func::Log
            && let Some(b) = base
        {
            args.push(b);
        }
        if let Some(p) = power {
            if p == Expr::Int(-1) {
                f = match f {
                    Func::Sin => Func::Asin,
                    Func::Cos => Func::Acos,
                    Func::Tan => Func::Atan,
                    f => return Ok(Expr::Pow(Box::new(Expr::Func(f, args)), Box::new(p))),
                };
                return Ok(Expr::Func(f, args));
            }
            return Ok(Expr::Pow(Box::new(Expr::Func(f, args)), Box::new(p)));
        }
        Ok(Expr::Func(f, args))
    }

    /// The argument of `\sin 2x`: the juxtaposed factors that follow.
    fn implicit_arg(&mut self) -> Res {
        if self.eat('-') {
            return Ok(neg(self.implicit_arg()?));
        }
        if self.eat('+') {
            return self.implicit_arg();
        }
        let mut factors = vec![self.postfix()?];
        while self.starts_factor()
            && !matches!(self.peek(), Some(Tok::Cmd(n)) if func_of(n).is_some())
        {
            factors.push(self.postfix()?);
        }
        Ok(juxtaposed(factors))
    }
}

/// Factors written side by side, folded from the right as `convert_postfix_list` does: an
/// integer before a positive integer or fraction is a mixed number (`2\frac{1}{2}` = 5/2,
/// `4 2` = 6, `-1 \frac{1}{2}` = −3/2); anything else multiplies.
fn juxtaposed(mut factors: Vec<Expr>) -> Expr {
    let Some(mut acc) = factors.pop() else {
        return Expr::Int(0);
    };
    while let Some(f) = factors.pop() {
        acc = match (&f, exact_literal(&acc)) {
            (Expr::Int(n), Some(q)) if q.0 > 0 => {
                let sum = n.checked_mul(q.1).and_then(|whole| {
                    if *n < 0 {
                        whole.checked_sub(q.0)
                    } else {
                        whole.checked_add(q.0)
                    }
                });
                sum.and_then(|sum| Q::new(sum, q.1))
                    .map_or(Expr::Mul(vec![f.clone(), acc.clone()]), Q::expr)
            }
            _ => match acc {
                Expr::Mul(mut v) => {
                    v.insert(0, f);
                    Expr::Mul(v)
                }
                acc => Expr::Mul(vec![f, acc]),
            },
        };
    }
    acc
}

fn tok_text(t: &Tok) -> String {
    match t {
        Tok::Num(s) => s.clone(),
        Tok::Letter(c) => c.to_string(),
        Tok::Cmd(n) => n.clone(),
        Tok::Ch(c) => c.to_string(),
    }
}

/// Parses normalized LaTeX math; the error says where it stopped.
pub fn parse_latex(latex: &str) -> Result<Expr, String> {
    let s = latex.trim();
    // `1,000` (and only a whole number so written) is a thousand.
    if is_comma_number(s) {
        // `convert_number`: "0,042" is a decimal.
        let n: String = if s.starts_with('0') {
            s.replace(',', ".")
        } else {
            s.chars().filter(|&c| c != ',').collect()
        };
        return parse_latex(&n);
    }
    let toks = tokenize(s)?;
    if toks.is_empty() {
        return Err("empty".into());
    }
    let mut p = Parser {
        toks,
        pos: 0,
        in_abs: 0,
    };
    let x = p.top()?;
    if p.pos != p.toks.len() {
        return Err(format!("unexpected {:?}", p.toks[p.pos]));
    }
    Ok(x)
}

fn is_comma_number(s: &str) -> bool {
    let s = s.strip_prefix('-').unwrap_or(s);
    let (int, frac) = s.split_once('.').map_or((s, None), |(a, b)| (a, Some(b)));
    if frac.is_some_and(|f| f.is_empty() || !f.bytes().all(|b| b.is_ascii_digit())) {
        return false;
    }
    let mut groups = int.split(',');
    let Some(head) = groups.next() else {
        return false;
    };
    let rest: Vec<&str> = groups.collect();
    (1..=3).contains(&head.len())
        && head.bytes().all(|b| b.is_ascii_digit())
        && !rest.is_empty()
        && rest
            .iter()
            .all(|g| g.len() == 3 && g.bytes().all(|b| b.is_ascii_digit()))
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    fn p(s: &str) -> String {
        parse_latex(s)
            .map(|x| x.to_string())
            .unwrap_or_else(|e| format!("ERR {e}"))
    }

    #[test]
    fn reads_latex_as_latex2sympy_does() {
        assert_eq!(p("1,000"), "1000");
        assert_eq!(p("2,50"), "{2, 50}");
        assert_eq!(p("\\frac{2}{4}"), "1/2");
        assert_eq!(p("2\\frac{1}{2}"), "5/2");
        assert_eq!(p("4 2"), "6");
        assert_eq!(p("(1,2]"), "(1, 2]");
        assert_eq!(p("(2,1)"), "(2, 1)");
        assert_eq!(p("x=5"), "x = 5");
        assert_eq!(p("1<x<2"), "1 < x & x < 2");
        assert_eq!(p("A"), "a");
        assert_eq!(p("6\\div2"), "3");
        assert_eq!(p("\\cos \\pi / 3"), "cos(pi*(3)**(-1))");
        assert_eq!(p("\\ln(9) / 2"), "log(9)*(2)**(-1)");
        assert_eq!(p("-\\frac{1}{2}"), "-1/2");
        assert_eq!(p("10\\%"), "10*(1/100)");
        assert_eq!(
            p(r"\begin{pmatrix}1 & 2 \\ 3 & 4\end{pmatrix}"),
            "Matrix([[1, 2], [3, 4]])"
        );
        assert_eq!(p("x != 3"), "x != 3");
        assert_eq!(p("7:32"), "7/32");
        assert_eq!(p(r"x \approx 11"), "11");
        assert_eq!(p(r"x = 1/3 \approx 0.33"), "x = 1/3");
        assert_eq!(p("p=5,q=2;p=7,q=2"), "{(p = 5, q = 2), (p = 7, q = 2)}");
        assert_eq!(p("(0;0;1)"), "(0, 0, 1)");
        assert_eq!(p(r"(1,2) \cup (3,4)"), "(1, 2) U (3, 4)");
        assert_eq!(p(r"1 \le |z| \le 2"), "1 <= abs(z) & abs(z) <= 2");
        assert_eq!(p(r"\sum_{k=1}^{3} k^2"), "Sum((k)**(2), (k, 1, 3))");
        assert!(p("\\frac12").starts_with("ERR"));
        assert!(p("\\sqrt 5").starts_with("ERR"));
        assert!(p("3.").starts_with("ERR"));
    }
}
