//! The values an answer parses to: numbers kept exact where LaTeX wrote them exactly
//! (integers, fractions of integers), decimals as floats, and expressions, relations, sets,
//! tuples and intervals as trees. Built the way `latex2sympy2_extended` builds its SymPy
//! objects, so that what counts as a plain number, an equation or a set is decided as there.

use std::fmt;

/// A parsed answer.
#[derive(Debug, Clone, PartialEq)]
pub enum Expr {
    /// An integer.
    Int(i128),
    /// A reduced fraction `num / den`, `den > 1`.
    Rat(i128, i128),
    /// A decimal number (`0.5`, `1000.00`).
    Float(f64),
    /// A variable (lower-cased, as `latex2sympy` names them; `x_1` keeps its subscript).
    Sym(String),
    /// π.
    Pi,
    /// Euler's number.
    E,
    /// +∞.
    Inf,
    /// A sum.
    Add(Vec<Expr>),
    /// A product.
    Mul(Vec<Expr>),
    /// A power.
    Pow(Box<Expr>, Box<Expr>),
    /// A function of its arguments (`sin`, `log` with its base second, `exp`, `abs`, ...).
    Func(Func, Vec<Expr>),
    /// `f(x)`: an undefined function.
    Apply(String, Vec<Expr>),
    /// `x · (1/100)` kept apart, as `convert_to_pct` does: `10\%`.
    Pct(Box<Expr>),
    /// `lhs op rhs`.
    Rel(Rel, Box<Expr>, Box<Expr>),
    /// A chain of relations (`1 < x < 2`).
    And(Vec<Expr>),
    /// A finite set, elements in the order written (`\{1, 2\}`, `1, 2`).
    Set(Vec<Expr>),
    /// An ordered tuple (`(1, 2, 3)`).
    Tuple(Vec<Expr>),
    /// An interval; `(a, b)` with `a < b` is an open interval.
    Interval {
        /// Lower end.
        lo: Box<Expr>,
        /// Upper end.
        hi: Box<Expr>,
        /// Whether the lower end is excluded.
        lopen: bool,
        /// Whether the upper end is excluded.
        ropen: bool,
    },
    /// A union of sets.
    Union(Vec<Expr>),
    /// ∅.
    EmptySet,
    /// ℝ.
    Reals,
    /// A matrix, by rows.
    Matrix(Vec<Vec<Expr>>),
    /// `\sum_{var=lo}^{hi} body` (`product`: `\prod`).
    Sum {
        /// The index variable.
        var: String,
        /// Its first value.
        lo: Box<Expr>,
        /// Its last value.
        hi: Box<Expr>,
        /// The summand.
        body: Box<Expr>,
        /// `\prod` rather than `\sum`.
        product: bool,
    },
}

/// Functions the parser knows.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[allow(missing_docs)]
pub enum Func {
    Sin,
    Cos,
    Tan,
    Cot,
    Sec,
    Csc,
    Asin,
    Acos,
    Atan,
    Sinh,
    Cosh,
    Tanh,
    /// `log(x, base)`.
    Log,
    Exp,
    Abs,
    Floor,
    Ceil,
    Factorial,
    Binom,
    Max,
    Min,
    Mod,
    Gcd,
    Lcm,
}

/// Relation operators.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
#[allow(missing_docs)]
pub enum Rel {
    Eq,
    Ne,
    Lt,
    Le,
    Gt,
    Ge,
}

impl Rel {
    /// The relation read right to left (`<` for `>`).
    pub fn flipped(self) -> Rel {
        match self {
            Rel::Lt => Rel::Gt,
            Rel::Gt => Rel::Lt,
            Rel::Le => Rel::Ge,
            Rel::Ge => Rel::Le,
            r => r,
        }
    }

    fn symbol(self) -> &'static str {
        match self {
            Rel::Eq => "=",
            Rel::Ne => "!=",
            Rel::Lt => "<",
            Rel::Le => "<=",
            Rel::Gt => ">",
            Rel::Ge => ">=",
        }
    }
}

fn gcd(a: i128, b: i128) -> i128 {
    let (mut a, mut b) = (a.unsigned_abs(), b.unsigned_abs());
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a as i128
}

/// An exact rational `num / den` (`den > 0`), the value of integer arithmetic.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Q(pub i128, pub i128);

impl Q {
    /// The reduced fraction; `None` when `den` is 0.
    pub fn new(num: i128, den: i128) -> Option<Q> {
        if den == 0 {
            return None;
        }
        let g = gcd(num, den).max(1);
        let s = if den < 0 { -1 } else { 1 };
        Some(Q(s * num / g, s * den / g))
    }
    fn add(self, o: Q) -> Option<Q> {
        let n = self
            .0
            .checked_mul(o.1)?
            .checked_add(o.0.checked_mul(self.1)?)?;
        Q::new(n, self.1.checked_mul(o.1)?)
    }
    fn mul(self, o: Q) -> Option<Q> {
        Q::new(self.0.checked_mul(o.0)?, self.1.checked_mul(o.1)?)
    }
    fn pow(self, e: i128) -> Option<Q> {
        if e < 0 {
            return Q::new(self.1, self.0)?.pow(-e);
        }
        let e = u32::try_from(e).ok().filter(|&e| e <= 256)?;
        Q::new(self.0.checked_pow(e)?, self.1.checked_pow(e)?)
    }
    /// Its value as a float.
    pub fn to_f64(self) -> f64 {
        self.0 as f64 / self.1 as f64
    }
    /// As an expression: an integer or a fraction.
    pub fn expr(self) -> Expr {
        if self.1 == 1 {
            Expr::Int(self.0)
        } else {
            Expr::Rat(self.0, self.1)
        }
    }
}

impl Expr {
    /// A fraction `n / d` reduced (an integer when `d` divides `n`); `None` for `d = 0`.
    pub fn rational(n: i128, d: i128) -> Option<Expr> {
        Q::new(n, d).map(Q::expr)
    }

    /// A plain number (integer, fraction, decimal) or ∞: SymPy's atomic `Number`.
    pub fn is_number(&self) -> bool {
        matches!(
            self,
            Expr::Int(_) | Expr::Rat(..) | Expr::Float(_) | Expr::Inf
        ) || matches!(self, Expr::Mul(v) if v.len() == 2 && v[0] == Expr::Int(-1) && v[1] == Expr::Inf)
    }

    /// A number, or a number written as a percentage.
    pub fn is_number_or_pct(&self) -> bool {
        match self {
            Expr::Pct(x) => x.is_number(),
            x => x.is_number(),
        }
    }

    /// A float, or a float written as a percentage.
    pub fn is_float_or_pct(&self) -> bool {
        matches!(self, Expr::Float(_))
            || matches!(self, Expr::Pct(x) if matches!(**x, Expr::Float(_)))
    }

    /// An integer, or an integer written as a percentage.
    pub fn is_int_or_pct(&self) -> bool {
        matches!(self, Expr::Int(_)) || matches!(self, Expr::Pct(x) if matches!(**x, Expr::Int(_)))
    }

    /// A relation or a chain of them.
    pub fn is_relation(&self) -> bool {
        match self {
            Expr::Rel(..) => true,
            Expr::And(v) => !v.is_empty() && v.iter().all(|x| matches!(x, Expr::Rel(..))),
            _ => false,
        }
    }

    /// An equation or a chain of them.
    pub fn is_equation(&self) -> bool {
        match self {
            Expr::Rel(Rel::Eq, ..) => true,
            Expr::And(v) => !v.is_empty() && v.iter().all(|x| matches!(x, Expr::Rel(Rel::Eq, ..))),
            _ => false,
        }
    }

    /// A set (finite, interval, union, ∅, ℝ).
    pub fn is_set(&self) -> bool {
        matches!(
            self,
            Expr::Set(_) | Expr::Interval { .. } | Expr::Union(_) | Expr::EmptySet | Expr::Reals
        )
    }

    /// Whether only variables (and powers −1 of them) make it up: the left side of an
    /// assignment such as `x = 3` (`latex2sympy`'s `is_expr_of_only_symbols`).
    pub fn only_symbols(&self) -> bool {
        match self {
            Expr::Sym(_) => true,
            Expr::Pow(b, e) if **e == Expr::Int(-1) => b.only_symbols(),
            Expr::Add(v) | Expr::Mul(v) | Expr::Func(_, v) | Expr::Tuple(v) | Expr::Apply(_, v) => {
                !v.is_empty() && v.iter().all(Expr::only_symbols)
            }
            Expr::Pow(b, e) => b.only_symbols() && e.only_symbols(),
            // `(p, q) = (3, 2)`: a pair of variables (an interval of them, as parsed).
            Expr::Interval { lo, hi, .. } => lo.only_symbols() && hi.only_symbols(),
            _ => false,
        }
    }

    /// The free variables' names.
    pub fn symbols(&self, out: &mut Vec<String>) {
        match self {
            Expr::Sym(s) => {
                if !out.contains(s) {
                    out.push(s.clone());
                }
            }
            Expr::Apply(name, args) => {
                let s = format!(
                    "{name}({})",
                    args.iter()
                        .map(Expr::to_string)
                        .collect::<Vec<_>>()
                        .join(",")
                );
                if !out.contains(&s) {
                    out.push(s);
                }
            }
            Expr::Sum {
                var, lo, hi, body, ..
            } => {
                lo.symbols(out);
                hi.symbols(out);
                let mut inner = Vec::new();
                body.symbols(&mut inner);
                for s in inner {
                    if &s != var && !out.contains(&s) {
                        out.push(s);
                    }
                }
            }
            _ => self.children().for_each(|c| c.symbols(out)),
        }
    }

    fn children(&self) -> Box<dyn Iterator<Item = &Expr> + '_> {
        match self {
            Expr::Add(v)
            | Expr::Mul(v)
            | Expr::Func(_, v)
            | Expr::And(v)
            | Expr::Set(v)
            | Expr::Tuple(v)
            | Expr::Union(v) => Box::new(v.iter()),
            Expr::Pow(a, b) | Expr::Rel(_, a, b) => Box::new([&**a, &**b].into_iter()),
            Expr::Interval { lo, hi, .. } => Box::new([&**lo, &**hi].into_iter()),
            Expr::Matrix(rows) => Box::new(rows.iter().flatten()),
            Expr::Pct(x) => Box::new(std::iter::once(&**x)),
            _ => Box::new(std::iter::empty()),
        }
    }

    /// The exact value of integer arithmetic (integers, fractions, percentages, sums,
    /// products, integer powers, factorials, binomials); `None` otherwise.
    pub fn exact(&self) -> Option<Q> {
        match self {
            Expr::Int(n) => Some(Q(*n, 1)),
            Expr::Rat(n, d) => Some(Q(*n, *d)),
            Expr::Pct(x) => x.exact()?.mul(Q(1, 100)),
            Expr::Add(v) => v.iter().try_fold(Q(0, 1), |acc, x| acc.add(x.exact()?)),
            Expr::Mul(v) => v.iter().try_fold(Q(1, 1), |acc, x| acc.mul(x.exact()?)),
            Expr::Pow(b, e) => {
                let e = e.exact()?;
                let b = b.exact()?;
                if e.1 != 1 {
                    // A perfect root: 4^(1/2).
                    let r = e.1;
                    let root = |n: i128| -> Option<i128> {
                        if n < 0 {
                            return None;
                        }
                        let guess = (n as f64).powf(1.0 / r as f64).round() as i128;
                        (guess.checked_pow(u32::try_from(r).ok()?)? == n).then_some(guess)
                    };
                    return Q::new(root(b.0)?, root(b.1)?)?.pow(e.0);
                }
                if b.0 == 0 && e.0 < 0 {
                    return None;
                }
                b.pow(e.0)
            }
            Expr::Func(Func::Factorial, v) => {
                let n = v.first()?.exact()?;
                if n.1 != 1 || !(0..=33).contains(&n.0) {
                    return None;
                }
                Some(Q((1..=n.0).product(), 1))
            }
            Expr::Func(Func::Binom, v) => {
                let (n, k) = (v.first()?.exact()?, v.get(1)?.exact()?);
                if n.1 != 1 || k.1 != 1 || k.0 < 0 || n.0 < 0 || k.0 > n.0 || n.0 > 120 {
                    return None;
                }
                let mut c: i128 = 1;
                for i in 0..k.0 {
                    c = c.checked_mul(n.0 - i)? / (i + 1);
                }
                Some(Q(c, 1))
            }
            Expr::Func(Func::Abs, v) => v.first()?.exact().map(|q| Q(q.0.abs(), q.1)),
            _ => None,
        }
    }

    /// The real value with the variables given by `var`; `None` where undefined.
    pub fn eval(&self, var: &dyn Fn(&str) -> f64) -> Option<f64> {
        let v = match self {
            Expr::Int(n) => *n as f64,
            Expr::Rat(n, d) => *n as f64 / *d as f64,
            Expr::Float(x) => *x,
            Expr::Sym(s) => var(s),
            Expr::Pi => std::f64::consts::PI,
            Expr::E => std::f64::consts::E,
            Expr::Inf => f64::INFINITY,
            Expr::Add(v) => v.iter().map(|x| x.eval(var)).sum::<Option<f64>>()?,
            Expr::Mul(v) => v.iter().map(|x| x.eval(var)).product::<Option<f64>>()?,
            Expr::Pow(b, e) => {
                let (b, e) = (b.eval(var)?, e.eval(var)?);
                if b == 0.0 && e < 0.0 {
                    // 1/0: SymPy's complex infinity equals nothing.
                    return None;
                }
                if b < 0.0 && e.fract() != 0.0 {
                    // An odd root of a negative number: SymPy's principal root is complex.
                    return None;
                }
                b.powf(e)
            }
            Expr::Pct(x) => x.eval(var)? / 100.0,
            Expr::Sum {
                var: index,
                lo,
                hi,
                body,
                product,
            } => {
                let (lo, hi) = (lo.eval(var)?, hi.eval(var)?);
                if lo.fract() != 0.0 || hi.fract() != 0.0 || hi - lo > 100_000.0 {
                    return None;
                }
                let mut acc = if *product { 1.0 } else { 0.0 };
                let mut k = lo;
                while k <= hi {
                    let at = |name: &str| if name == index { k } else { var(name) };
                    let term = body.eval(&at)?;
                    acc = if *product { acc * term } else { acc + term };
                    k += 1.0;
                }
                acc
            }
            Expr::Apply(..) => {
                let mut names = Vec::new();
                self.symbols(&mut names);
                var(&names[0])
            }
            Expr::Func(f, args) => {
                let a = args.first()?.eval(var)?;
                match f {
                    Func::Sin => a.sin(),
                    Func::Cos => a.cos(),
                    Func::Tan => a.tan(),
                    Func::Cot => 1.0 / a.tan(),
                    Func::Sec => 1.0 / a.cos(),
                    Func::Csc => 1.0 / a.sin(),
                    Func::Asin => a.asin(),
                    Func::Acos => a.acos(),
                    Func::Atan => a.atan(),
                    Func::Sinh => a.sinh(),
                    Func::Cosh => a.cosh(),
                    Func::Tanh => a.tanh(),
                    Func::Log => {
                        let base = args
                            .get(1)
                            .map_or(Some(std::f64::consts::E), |b| b.eval(var))?;
                        if a <= 0.0 {
                            return None;
                        }
                        a.ln() / base.ln()
                    }
                    Func::Exp => a.exp(),
                    Func::Abs => a.abs(),
                    Func::Floor => a.floor(),
                    Func::Ceil => a.ceil(),
                    Func::Factorial | Func::Binom | Func::Gcd | Func::Lcm => self.exact()?.to_f64(),
                    Func::Max | Func::Min => {
                        let vals = args
                            .iter()
                            .map(|x| x.eval(var))
                            .collect::<Option<Vec<_>>>()?;
                        let it = vals.into_iter();
                        if *f == Func::Max {
                            it.fold(f64::NEG_INFINITY, f64::max)
                        } else {
                            it.fold(f64::INFINITY, f64::min)
                        }
                    }
                    Func::Mod => a.rem_euclid(args.get(1)?.eval(var)?),
                }
            }
            _ => return None,
        };
        (!v.is_nan()).then_some(v)
    }
}

impl fmt::Display for Expr {
    /// SymPy's way of printing, near enough for logs (`3*sqrt(2)` is `3*2**(1/2)` here).
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let join = |v: &[Expr], sep: &str| {
            v.iter()
                .map(|x| x.to_string())
                .collect::<Vec<_>>()
                .join(sep)
        };
        match self {
            Expr::Int(n) => write!(f, "{n}"),
            Expr::Rat(n, d) => write!(f, "{n}/{d}"),
            Expr::Float(x) => write!(f, "{x}"),
            Expr::Sym(s) => write!(f, "{s}"),
            Expr::Pi => write!(f, "pi"),
            Expr::E => write!(f, "E"),
            Expr::Inf => write!(f, "oo"),
            Expr::Add(v) => write!(f, "({})", join(v, " + ")),
            Expr::Mul(v) => write!(f, "{}", join(v, "*")),
            Expr::Pow(b, e) => write!(f, "({b})**({e})"),
            Expr::Func(func, v) => write!(
                f,
                "{}({})",
                format!("{func:?}").to_lowercase(),
                join(v, ", ")
            ),
            Expr::Apply(name, v) => write!(f, "{name}({})", join(v, ", ")),
            Expr::Pct(x) => write!(f, "{x}*(1/100)"),
            Expr::Rel(r, a, b) => write!(f, "{a} {} {b}", r.symbol()),
            Expr::And(v) => write!(f, "{}", join(v, " & ")),
            Expr::Set(v) => write!(f, "{{{}}}", join(v, ", ")),
            Expr::Tuple(v) => write!(f, "({})", join(v, ", ")),
            Expr::Interval {
                lo,
                hi,
                lopen,
                ropen,
            } => {
                write!(
                    f,
                    "{}{lo}, {hi}{}",
                    if *lopen { "(" } else { "[" },
                    if *ropen { ")" } else { "]" }
                )
            }
            Expr::Union(v) => write!(f, "{}", join(v, " U ")),
            Expr::Sum {
                var,
                lo,
                hi,
                body,
                product,
            } => {
                write!(
                    f,
                    "{}({body}, ({var}, {lo}, {hi}))",
                    if *product { "Product" } else { "Sum" }
                )
            }
            Expr::Matrix(rows) => write!(
                f,
                "Matrix([{}])",
                rows.iter()
                    .map(|r| format!("[{}]", join(r, ", ")))
                    .collect::<Vec<_>>()
                    .join(", ")
            ),
            Expr::EmptySet => write!(f, "EmptySet"),
            Expr::Reals => write!(f, "Reals"),
        }
    }
}
