//! Plain arithmetic as SymPy's `parse_expr(..., evaluate=False)` reads it (`3 + 4`, `2^10`,
//! `(1+2)/3`): numbers, `+ - * / ^ **` and parentheses; anything else is not Python and does
//! not parse.

use super::expr::Expr;
use super::latex::neg;

struct P<'a> {
    s: &'a [u8],
    i: usize,
}

impl P<'_> {
    fn ws(&mut self) {
        while self.i < self.s.len() && self.s[self.i].is_ascii_whitespace() {
            self.i += 1;
        }
    }
    fn eat(&mut self, t: &str) -> bool {
        self.ws();
        if self.s[self.i..].starts_with(t.as_bytes()) {
            self.i += t.len();
            true
        } else {
            false
        }
    }
    fn sum(&mut self) -> Option<Expr> {
        let mut terms = vec![self.product()?];
        loop {
            if self.eat("+") {
                terms.push(self.product()?);
            } else if self.eat("-") {
                terms.push(neg(self.product()?));
            } else {
                break;
            }
        }
        Some(if terms.len() == 1 {
            terms.remove(0)
        } else {
            Expr::Add(terms)
        })
    }
    fn product(&mut self) -> Option<Expr> {
        let mut acc = self.unary()?;
        loop {
            self.ws();
            if self.s[self.i..].starts_with(b"**") {
                return Some(acc);
            }
            if self.eat("*") {
                let rhs = self.unary()?;
                acc = Expr::Mul(vec![acc, rhs]);
            } else if self.eat("/") {
                let rhs = self.unary()?;
                acc = Expr::Mul(vec![acc, Expr::Pow(Box::new(rhs), Box::new(Expr::Int(-1)))]);
            } else {
                return Some(acc);
            }
        }
    }
    fn unary(&mut self) -> Option<Expr> {
        if self.eat("-") {
            return Some(neg(self.unary()?));
        }
        if self.eat("+") {
            return self.unary();
        }
        self.power()
    }
    fn power(&mut self) -> Option<Expr> {
        let base = self.atom()?;
        if self.eat("**") {
            let e = self.unary()?;
            return Some(Expr::Pow(Box::new(base), Box::new(e)));
        }
        Some(base)
    }
    fn atom(&mut self) -> Option<Expr> {
        self.ws();
        if self.eat("(") {
            let x = self.sum()?;
            return self.eat(")").then_some(x);
        }
        let start = self.i;
        while self.i < self.s.len() && (self.s[self.i].is_ascii_digit() || self.s[self.i] == b'.') {
            self.i += 1;
        }
        let text = std::str::from_utf8(&self.s[start..self.i]).ok()?;
        if text.is_empty() {
            return None;
        }
        if text.contains('.') {
            text.parse::<f64>().ok().map(Expr::Float)
        } else {
            if text.len() > 1 && text.starts_with('0') {
                // Python refuses leading zeros.
                return None;
            }
            text.parse::<i128>().ok().map(Expr::Int)
        }
    }
}

/// `parse_expr(text.replace("^", "**"), evaluate=False)`; `None` where Python would not parse it.
pub fn parse_python_arith(text: &str) -> Option<Expr> {
    let text = text.replace('^', "**");
    let mut p = P {
        s: text.as_bytes(),
        i: 0,
    };
    let x = p.sum()?;
    p.ws();
    (p.i == p.s.len()).then_some(x)
}
