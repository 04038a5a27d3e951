//! math_verify's `verify`: equations reduced to their right side when the other answer is a
//! value, relations compared as relations, sets element by element, intervals by their ends,
//! variables by name, numbers exactly (integers), to six decimals (where a decimal is
//! involved) or by value, and expressions with variables by their values at several points
//! (where math_verify asks SymPy's `simplify(a - b)` whether it is zero).

use std::cmp::Ordering;

use super::expr::{Expr, Func, Rel};
use super::extract::Extracted;
use super::latex::neg;

/// `verify(gold, target)`: whether any extraction of the answer matches any of the reference.
pub fn verify(gold: &[Extracted], answer: &[Extracted]) -> bool {
    gold.iter().any(|g| {
        answer.iter().any(|a| match (g, a) {
            (Extracted::Value(g), Extracted::Value(a)) => expr_eq(g, a),
            (Extracted::Text(g), Extracted::Text(a)) => {
                let (g, a) = (g.trim(), a.trim());
                !g.is_empty() && g == a
            }
            _ => false,
        })
    })
}

fn is_assignment(x: &Expr) -> bool {
    match x {
        Expr::Rel(Rel::Eq, lhs, _) => lhs.only_symbols(),
        Expr::And(v) => {
            x.is_equation() && matches!(v.first(), Some(Expr::Rel(_, lhs, _)) if lhs.only_symbols())
        }
        _ => false,
    }
}

fn first_relation(x: &Expr) -> &Expr {
    match x {
        Expr::And(v) if !v.is_empty() => &v[0],
        x => x,
    }
}

fn last_relation(x: &Expr) -> &Expr {
    match x {
        Expr::And(v) if !v.is_empty() => last_relation(&v[v.len() - 1]),
        x => x,
    }
}

fn sides(x: &Expr) -> Option<(&Expr, &Expr)> {
    match x {
        Expr::Rel(_, a, b) => Some((a, b)),
        _ => None,
    }
}

/// `a = b = c` as `a = c`.
fn assignment(x: &Expr) -> Expr {
    match (sides(first_relation(x)), sides(last_relation(x))) {
        (Some((lhs, _)), Some((_, rhs))) => {
            Expr::Rel(Rel::Eq, Box::new(lhs.clone()), Box::new(rhs.clone()))
        }
        _ => x.clone(),
    }
}

fn rhs(x: &Expr) -> Expr {
    sides(last_relation(x)).map_or_else(|| x.clone(), |(_, r)| r.clone())
}

fn has_symbols(x: &Expr) -> bool {
    let mut v = Vec::new();
    x.symbols(&mut v);
    !v.is_empty()
}

fn value(x: &Expr) -> Option<f64> {
    x.eval(&|_| f64::NAN).filter(|v| !v.is_nan())
}

fn neg_inf(x: &Expr) -> bool {
    value(x) == Some(f64::NEG_INFINITY)
}

fn pos_inf(x: &Expr) -> bool {
    value(x) == Some(f64::INFINITY)
}

/// `sympy_expr_eq(gold, pred)`.
pub fn expr_eq(gold: &Expr, pred: &Expr) -> bool {
    if contains_zoo(gold) {
        return false;
    }
    let (mut gold, mut pred) = (gold.clone(), pred.clone());
    let gold_assignment = is_assignment(&gold);
    let pred_assignment = is_assignment(&pred);
    let gold_equation = gold.is_equation();
    let pred_equation = pred.is_equation();
    if gold_assignment {
        gold = assignment(&gold);
    }
    if pred_assignment {
        pred = assignment(&pred);
    }
    if pred_equation && !gold_equation {
        pred = rhs(&pred);
    } else if gold_assignment && !pred_equation {
        gold = rhs(&gold);
    }
    if gold.is_relation()
        && pred.is_set()
        && let Some(s) = relation_as_set(&gold)
    {
        gold = s;
    }
    if structural_eq(&gold, &pred) {
        return true;
    }
    if gold.is_relation() && pred.is_relation() {
        return compare_relations(&gold, &pred);
    }
    match (matrix_value(&gold), matrix_value(&pred)) {
        (Some(a), Some(b)) => {
            return a.len() == b.len()
                && a.iter().zip(&b).all(|(x, y)| {
                    x.len() == y.len() && x.iter().zip(y).all(|(p, q)| expr_eq(p, q))
                });
        }
        (Some(_), None) | (None, Some(_)) => return false,
        _ => {}
    }
    let set_or_tuple = |x: &Expr| x.is_set() || matches!(x, Expr::Tuple(_));
    if set_or_tuple(&gold) || set_or_tuple(&pred) {
        return compare_sets(&gold, &pred);
    }
    if matches!(gold, Expr::Sym(_)) || matches!(pred, Expr::Sym(_)) {
        return compare_symbols(&gold, &pred);
    }
    numeric_eq(&gold, &pred) || symbolic_eq(&gold, &pred)
}

/// The entries of a matrix, or of sums and products of matrices (and numbers): SymPy's `doit`
/// on them. `None` for an expression without a matrix (or one whose shapes do not agree).
fn matrix_value(x: &Expr) -> Option<Vec<Vec<Expr>>> {
    type M = Vec<Vec<Expr>>;
    let shape = |m: &M| (m.len(), m.first().map_or(0, Vec::len));
    match x {
        Expr::Matrix(rows) => Some(rows.clone()),
        Expr::Add(v) => {
            let ms: Vec<M> = v.iter().map(matrix_value).collect::<Option<_>>()?;
            let (r, c) = shape(&ms[0]);
            if ms.iter().any(|m| shape(m) != (r, c)) {
                return None;
            }
            Some(
                (0..r)
                    .map(|i| {
                        (0..c)
                            .map(|j| Expr::Add(ms.iter().map(|m| m[i][j].clone()).collect()))
                            .collect()
                    })
                    .collect(),
            )
        }
        Expr::Mul(v) if v.iter().any(|f| matrix_value(f).is_some()) => {
            let mut acc: Option<M> = None;
            let mut scalars = Vec::new();
            for f in v {
                match matrix_value(f) {
                    Some(m) => {
                        acc = Some(match acc {
                            None => m,
                            Some(a) => {
                                let ((ar, ac), (br, bc)) = (shape(&a), shape(&m));
                                if ac != br {
                                    return None;
                                }
                                (0..ar)
                                    .map(|i| {
                                        (0..bc)
                                            .map(|j| {
                                                Expr::Add(
                                                    (0..ac)
                                                        .map(|k| {
                                                            Expr::Mul(vec![
                                                                a[i][k].clone(),
                                                                m[k][j].clone(),
                                                            ])
                                                        })
                                                        .collect(),
                                                )
                                            })
                                            .collect()
                                    })
                                    .collect()
                            }
                        })
                    }
                    None if f.is_set() || f.is_relation() => return None,
                    None => scalars.push(f.clone()),
                }
            }
            let m = acc?;
            let scaled = |e: Expr| {
                let mut factors = scalars.clone();
                factors.push(e);
                Expr::Mul(factors)
            };
            Some(
                m.into_iter()
                    .map(|row| row.into_iter().map(scaled).collect())
                    .collect(),
            )
        }
        _ => None,
    }
}

/// `\frac{1}{0}` (SymPy's `zoo`) as the reference makes every comparison fail.
fn contains_zoo(x: &Expr) -> bool {
    matches!(x, Expr::Mul(v) if v.len() == 2 && matches!(v[0], Expr::Int(_)) && matches!(&v[1], Expr::Pow(b, e) if **b == Expr::Int(0) && **e == Expr::Int(-1)))
}

/// A canonical text for SymPy's structural `==`: sums and products in sorted order, sets
/// sorted without repeats; `2` and `2.0` differ.
fn canon(x: &Expr) -> String {
    let sorted = |v: &[Expr], sep: &str| {
        let mut parts: Vec<String> = v.iter().map(canon).collect();
        parts.sort();
        parts.join(sep)
    };
    match x {
        Expr::Float(v) => format!("f{v:e}"),
        Expr::Add(v) => format!("({})", sorted(v, "+")),
        Expr::Mul(v) => format!("({})", sorted(v, "*")),
        Expr::Set(v) => {
            let mut parts: Vec<String> = v.iter().map(canon).collect();
            parts.sort();
            parts.dedup();
            format!("{{{}}}", parts.join(","))
        }
        Expr::Pow(b, e) => format!("({})^({})", canon(b), canon(e)),
        Expr::Pct(x) => format!("pct({})", canon(x)),
        Expr::Func(f, v) => format!(
            "{f:?}({})",
            v.iter().map(canon).collect::<Vec<_>>().join(",")
        ),
        Expr::Rel(r, a, b) => format!("{}{r:?}{}", canon(a), canon(b)),
        Expr::And(v) => format!("and({})", sorted(v, ",")),
        Expr::Tuple(v) => format!("t({})", v.iter().map(canon).collect::<Vec<_>>().join(",")),
        Expr::Interval {
            lo,
            hi,
            lopen,
            ropen,
        } => format!(
            "i{}{},{}{}",
            *lopen || neg_inf(lo),
            canon(lo),
            canon(hi),
            *ropen || pos_inf(hi)
        ),
        Expr::Union(v) => format!("u({})", sorted(v, ",")),
        Expr::Sum {
            var,
            lo,
            hi,
            body,
            product,
        } => {
            format!(
                "{}[{var}:{},{}]({})",
                if *product { "prod" } else { "sum" },
                canon(lo),
                canon(hi),
                canon(body)
            )
        }
        Expr::Matrix(rows) => format!(
            "m({})",
            rows.iter()
                .map(|r| r.iter().map(canon).collect::<Vec<_>>().join(","))
                .collect::<Vec<_>>()
                .join(";")
        ),
        x => x.to_string(),
    }
}

fn structural_eq(a: &Expr, b: &Expr) -> bool {
    canon(a) == canon(b)
}

/// `compare_relational`: same relation with equal `lhs − rhs`, the flipped relation with
/// opposite ones, or equations with the same solution.
fn compare_relations(gold: &Expr, pred: &Expr) -> bool {
    match (gold, pred) {
        (Expr::And(g), Expr::And(p)) => {
            g.len() == p.len() && g.iter().zip(p).all(|(g, p)| compare_relations(g, p))
        }
        (Expr::Rel(gr, gl, grhs), Expr::Rel(pr, pl, prhs)) => {
            let diff = |a: &Expr, b: &Expr| Expr::Add(vec![a.clone(), neg(b.clone())]);
            if gr == pr && expr_eq(&diff(gl, grhs), &diff(pl, prhs)) {
                return true;
            }
            if *gr == Rel::Ne || *pr == Rel::Ne {
                // math_verify has no inverse of `!=`: the comparison fails.
                return false;
            }
            if gr.flipped() == *pr && expr_eq(&diff(gl, grhs), &diff(prhs, pl)) {
                return true;
            }
            *gr == Rel::Eq && *pr == Rel::Eq && same_equation(gold, pred)
        }
        _ => false,
    }
}

/// Equations in the same variables whose `lhs − rhs` are multiples of each other (`2x+4y-3=0`
/// and `y = -x/2 + 3/4`): the same solutions, where math_verify asks SymPy to solve both.
fn same_equation(gold: &Expr, pred: &Expr) -> bool {
    let side = |x: &Expr| -> Option<(Expr, Vec<String>)> {
        let (l, r) = sides(x)?;
        let f = Expr::Add(vec![l.clone(), neg(r.clone())]);
        let mut names = Vec::new();
        f.symbols(&mut names);
        names.sort();
        Some((f, names))
    };
    let (Some((f, a)), Some((g, b))) = (side(gold), side(pred)) else {
        return false;
    };
    if a != b || a.is_empty() {
        return false;
    }
    let mut ratio: Option<f64> = None;
    let mut agreed = 0;
    for k in 0..POINTS.len() {
        let at = |name: &str| {
            let i = a.iter().position(|n| n == name).unwrap_or(0);
            POINTS[(k + 2 * i) % POINTS.len()] + i as f64 * 0.1173
        };
        let (Some(x), Some(y)) = (f.eval(&at), g.eval(&at)) else {
            continue;
        };
        if !x.is_finite() || !y.is_finite() || y.abs() < 1e-12 || x.abs() < 1e-12 {
            continue;
        }
        let r = x / y;
        match ratio {
            None => ratio = Some(r),
            Some(r0) if close(r0, r, 1e-9) => {}
            Some(_) => return false,
        }
        agreed += 1;
    }
    agreed >= 3
}

/// `as_set()` of a relation between a variable and a number (or a chain of two).
fn relation_as_set(x: &Expr) -> Option<Expr> {
    // `|x|` in place of the variable: the set of |x|, mirrored (`1 \le |z| \le 2` is
    // [−2, −1] ∪ [1, 2]).
    let abs_of_variable = |x: &Expr| matches!(x, Expr::Func(Func::Abs, v) if v.len() == 1 && matches!(v[0], Expr::Sym(_) | Expr::Apply(..)));
    let on_abs = match x {
        Expr::And(v) => v
            .iter()
            .all(|r| matches!(r, Expr::Rel(_, a, b) if abs_of_variable(a) || abs_of_variable(b))),
        Expr::Rel(_, a, b) => abs_of_variable(a) || abs_of_variable(b),
        _ => false,
    };
    let one = |r: &Expr| -> Option<(f64, bool, f64, bool, Option<Expr>)> {
        let Expr::Rel(op, a, b) = r else { return None };
        let variable = |x: &Expr| {
            matches!(x, Expr::Sym(_) | Expr::Apply(..)) || (on_abs && abs_of_variable(x))
        };
        let (op, c) = match (&**a, &**b) {
            (v, c) if variable(v) && !has_symbols(c) => (*op, c.clone()),
            (c, v) if variable(v) && !has_symbols(c) => (op.flipped(), c.clone()),
            _ => return None,
        };
        let v = value(&c)?;
        Some(match op {
            Rel::Lt => (f64::NEG_INFINITY, true, v, true, None),
            Rel::Le => (f64::NEG_INFINITY, true, v, false, None),
            Rel::Gt => (v, true, f64::INFINITY, true, None),
            Rel::Ge => (v, false, f64::INFINITY, true, None),
            Rel::Eq => (v, false, v, false, Some(Expr::Set(vec![c]))),
            Rel::Ne => return None,
        })
    };
    let parts: Vec<_> = match x {
        Expr::And(v) => v.iter().map(one).collect::<Option<_>>()?,
        r => vec![one(r)?],
    };
    if parts.len() == 1
        && let Some(set) = &parts[0].4
    {
        return Some(set.clone());
    }
    if parts.iter().any(|p| p.4.is_some()) {
        return None;
    }
    let (mut lo, mut lopen, mut hi, mut ropen) = (f64::NEG_INFINITY, true, f64::INFINITY, true);
    for &(a, ao, b, bo, _) in &parts {
        if a > lo || (a == lo && ao) {
            (lo, lopen) = (a, ao);
        }
        if b < hi || (b == hi && bo) {
            (hi, ropen) = (b, bo);
        }
    }
    let end = |v: f64| {
        if v == f64::INFINITY {
            Expr::Inf
        } else if v == f64::NEG_INFINITY {
            neg(Expr::Inf)
        } else if v.fract() == 0.0 && v.abs() < 1e15 {
            Expr::Int(v as i128)
        } else {
            Expr::Float(v)
        }
    };
    // SymPy's intervals are open at infinity.
    let interval = |lo: f64, lopen: bool, hi: f64, ropen: bool| Expr::Interval {
        lo: Box::new(end(lo)),
        hi: Box::new(end(hi)),
        lopen: lopen || lo == f64::NEG_INFINITY,
        ropen: ropen || hi == f64::INFINITY,
    };
    if on_abs {
        // |x| in [lo, hi] (clipped at 0): x in [−hi, −lo] ∪ [lo, hi], one interval when lo ≤ 0.
        if hi < 0.0 || (hi == 0.0 && ropen) {
            return Some(Expr::EmptySet);
        }
        if lo < 0.0 || (lo == 0.0 && !lopen) {
            return Some(interval(-hi, ropen, hi, ropen));
        }
        return Some(Expr::Union(vec![
            interval(-hi, ropen, -lo, lopen),
            interval(lo, lopen, hi, ropen),
        ]));
    }
    Some(interval(lo, lopen, hi, ropen))
}

fn sort_key(x: &Expr) -> (u8, f64, String) {
    let x = if x.is_equation() && is_assignment(x) {
        rhs(x)
    } else {
        x.clone()
    };
    match value(&x) {
        Some(v) => (0, v, String::new()),
        None => (1, 0.0, canon(&x)),
    }
}

fn sorted(v: &[Expr]) -> Vec<Expr> {
    let mut v = v.to_vec();
    v.sort_by(|a, b| {
        let (ka, kb) = (sort_key(a), sort_key(b));
        ka.0.cmp(&kb.0)
            .then(ka.1.partial_cmp(&kb.1).unwrap_or(Ordering::Equal))
            .then(ka.2.cmp(&kb.2))
    });
    v
}

/// A finite set's elements without structural repeats, as SymPy's `FiniteSet` keeps them.
fn distinct(v: &[Expr]) -> Vec<Expr> {
    let mut out: Vec<Expr> = Vec::new();
    for x in v {
        if !out.iter().any(|y| structural_eq(x, y)) {
            out.push(x.clone());
        }
    }
    out
}

/// How one side of a set comparison is held: a finite set as written (math_verify's own
/// `FiniteSet`, with the order written), one made of a single value, or a tuple.
#[derive(Clone, Copy, PartialEq)]
enum Kind {
    Written,
    Wrapped,
    Tuple,
}

fn deep_compare(gold: (&[Expr], Kind), pred: (&[Expr], Kind)) -> bool {
    let (g, gk) = gold;
    let (p, pk) = pred;
    let (g, p) = (
        if gk == Kind::Tuple {
            g.to_vec()
        } else {
            distinct(g)
        },
        if pk == Kind::Tuple {
            p.to_vec()
        } else {
            distinct(p)
        },
    );
    if g.len() != p.len() {
        return false;
    }
    let (g, p) = if gk != Kind::Tuple {
        (sorted(&g), sorted(&p))
    } else if pk == Kind::Written {
        (g, p)
    } else if pk == Kind::Wrapped {
        (g, sorted(&p))
    } else {
        (g, p)
    };
    g.iter().zip(&p).all(|(a, b)| expr_eq(a, b))
}

fn interval_parts(x: &Expr) -> Option<(&Expr, &Expr, bool, bool)> {
    match x {
        Expr::Interval {
            lo,
            hi,
            lopen,
            ropen,
        } => Some((lo, hi, *lopen || neg_inf(lo), *ropen || pos_inf(hi))),
        _ => None,
    }
}

fn finite_values(v: &[Expr]) -> Option<Vec<f64>> {
    let mut vals: Vec<f64> = v.iter().map(value).collect::<Option<_>>()?;
    vals.sort_by(|a, b| a.partial_cmp(b).unwrap_or(Ordering::Equal));
    vals.dedup();
    Some(vals)
}

/// `sympy_compare_sets`.
fn compare_sets(gold: &Expr, pred: &Expr) -> bool {
    let wrap = |x: &Expr| -> (Expr, Option<Kind>) {
        match x {
            Expr::Set(_) => (x.clone(), Some(Kind::Written)),
            Expr::Tuple(_) => (x.clone(), Some(Kind::Tuple)),
            x if x.is_set() => (x.clone(), None),
            x => (Expr::Set(vec![x.clone()]), Some(Kind::Wrapped)),
        }
    };
    let (a, ak) = wrap(gold);
    let (b, bk) = wrap(pred);
    if let (Some(ia), Some(ib)) = (interval_parts(&a), interval_parts(&b)) {
        return ia.2 == ib.2 && ia.3 == ib.3 && expr_eq(ia.0, ib.0) && expr_eq(ia.1, ib.1);
    }
    if structural_eq(&a, &b) {
        return true;
    }
    // Unions of intervals: the same intervals, in order of their lower ends.
    if let (Expr::Union(x), Expr::Union(y)) = (&a, &b) {
        let ordered = |v: &[Expr]| -> Option<Vec<Expr>> {
            let mut v = v.to_vec();
            if v.iter().any(|i| interval_parts(i).is_none()) {
                return None;
            }
            v.sort_by(|p, q| {
                let lo = |i: &Expr| {
                    interval_parts(i)
                        .and_then(|(l, ..)| value(l))
                        .unwrap_or(f64::NAN)
                };
                lo(p).partial_cmp(&lo(q)).unwrap_or(Ordering::Equal)
            });
            Some(v)
        };
        if let (Some(x), Some(y)) = (ordered(x), ordered(y)) {
            return x.len() == y.len() && x.iter().zip(&y).all(|(p, q)| compare_sets(p, q));
        }
    }
    // Equal sets of numbers (the symmetric difference is empty): by value.
    if let (Expr::Set(x), Expr::Set(y)) = (&a, &b)
        && let (Some(x), Some(y)) = (finite_values(x), finite_values(y))
        && x == y
    {
        return true;
    }
    let elements = |x: &Expr| -> Vec<Expr> {
        match x {
            Expr::Set(v) | Expr::Tuple(v) => v.clone(),
            _ => Vec::new(),
        }
    };
    match (ak, bk) {
        (Some(ak), Some(bk)) => deep_compare((&elements(&a), ak), (&elements(&b), bk)),
        (None, Some(bk)) => match interval_parts(&a) {
            Some((lo, hi, true, true)) if elements(&b).len() == 2 => deep_compare(
                (&[lo.clone(), hi.clone()], Kind::Tuple),
                (&elements(&b), bk),
            ),
            _ => false,
        },
        (Some(ak), None) => match interval_parts(&b) {
            Some((lo, hi, true, true)) if elements(&a).len() == 2 => deep_compare(
                (&elements(&a), ak),
                (&[lo.clone(), hi.clone()], Kind::Tuple),
            ),
            _ => false,
        },
        (None, None) => false,
    }
}

fn has_float(x: &Expr) -> bool {
    match x {
        Expr::Float(_) => true,
        Expr::Set(v) | Expr::Tuple(v) | Expr::Add(v) | Expr::Mul(v) => v.iter().any(has_float),
        Expr::Pow(a, b) => has_float(a) || has_float(b),
        Expr::Pct(a) => has_float(a),
        _ => false,
    }
}

/// `sympy_compare_symbols`.
fn compare_symbols(gold: &Expr, pred: &Expr) -> bool {
    let concat = |v: &[Expr]| -> Option<String> {
        v.iter()
            .map(|x| match x {
                Expr::Sym(s) => Some(s.clone()),
                Expr::E => Some("e".to_string()),
                _ => None,
            })
            .collect()
    };
    match (gold, pred) {
        (Expr::Sym(s), Expr::E) | (Expr::E, Expr::Sym(s)) if s.to_lowercase() == "e" => true,
        (Expr::Sym(s), Expr::Mul(v)) | (Expr::Mul(v), Expr::Sym(s)) if concat(v).is_some() => {
            concat(v).is_some_and(|c| c.to_lowercase() == s.to_lowercase())
        }
        (Expr::Sym(a), Expr::Sym(b)) => {
            let norm = |s: &str| {
                if s.chars().count() > 1 {
                    s.to_lowercase()
                } else {
                    s.to_string()
                }
            };
            norm(a) == norm(b)
        }
        (a, b) => canon(a) == canon(b),
    }
}

fn close(a: f64, b: f64, rel: f64) -> bool {
    a == b
        || (a.is_finite() && b.is_finite() && (a - b).abs() <= rel * a.abs().max(b.abs()).max(1.0))
}

fn round6(v: f64) -> f64 {
    // Python's round half to even on the decimal value; ties are as rare here as there.
    (v * 1e6).round_ties_even() / 1e6
}

/// `sympy_numeric_eq`.
fn numeric_eq(a: &Expr, b: &Expr) -> bool {
    if a.is_number_or_pct() || b.is_number_or_pct() {
        if a.is_float_or_pct() || b.is_float_or_pct() {
            return match (value(a), value(b)) {
                // Beyond 1e9 a double holds no six decimals: an irrational value is not a
                // decimal there (SymPy evaluates it to more digits than the decimal has).
                (Some(x), Some(y)) if x.abs().max(y.abs()) >= 1e9 => {
                    let exact = |e: &Expr| e.is_float_or_pct() || e.exact().is_some();
                    exact(a) && exact(b) && round6(x) == round6(y)
                }
                (Some(x), Some(y)) if x.is_finite() && y.is_finite() => round6(x) == round6(y),
                (Some(x), Some(y)) => x == y,
                _ => false,
            };
        }
        if a.is_int_or_pct() && b.is_int_or_pct() {
            let strip = |x: &Expr| match x {
                Expr::Pct(v) => (**v).clone(),
                v => v.clone(),
            };
            return strip(a) == strip(b);
        }
        return match (a.exact(), b.exact()) {
            (Some(x), Some(y)) => x == y,
            _ => match (value(a), value(b)) {
                (Some(x), Some(y)) => close(x, y, 1e-12),
                _ => structural_eq(a, b),
            },
        };
    }
    if has_symbols(a) || has_symbols(b) {
        return false;
    }
    match (value(a), value(b)) {
        (Some(x), Some(y)) => close(x, y, 1e-13),
        _ => false,
    }
}

/// Points at which expressions in variables are compared: SymPy proves `a − b = 0`
/// symbolically; equal values at several generic points say the same of the expressions
/// answers hold.
const POINTS: [f64; 5] = [0.5377, 1.8339, 2.2588, 0.8622, 1.3188];

/// `sympy_symbolic_eq`: `simplify(a − b)` is zero.
fn symbolic_eq(a: &Expr, b: &Expr) -> bool {
    let mut names = Vec::new();
    a.symbols(&mut names);
    b.symbols(&mut names);
    let tol = if has_float(a) || has_float(b) {
        1e-14
    } else {
        1e-11
    };
    if names.is_empty() {
        return match (value(a), value(b)) {
            (Some(x), Some(y)) if tol < 1e-10 && x.abs().max(y.abs()) >= 1e9 => {
                let exact = |e: &Expr| has_float(e) || e.exact().is_some();
                exact(a) && exact(b) && x == y
            }
            (Some(x), Some(y)) if x.is_finite() && y.is_finite() => close(x, y, tol),
            _ => false,
        };
    }
    let mut agreed = 0;
    for k in 0..POINTS.len() {
        let at = |name: &str| {
            let i = names.iter().position(|n| n == name).unwrap_or(0);
            POINTS[(k + 2 * i) % POINTS.len()] + i as f64 * 0.1173
        };
        match (a.eval(&at), b.eval(&at)) {
            // Infinite at a point on both sides (`x + \infty` against `\infty`) agrees.
            (Some(x), Some(y)) if (x.is_finite() && y.is_finite()) || x == y => {
                if !close(x, y, tol.max(1e-11)) {
                    return false;
                }
                agreed += 1;
            }
            _ => {}
        }
    }
    agreed >= 2
}
