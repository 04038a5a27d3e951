//! BCO's underlying distribution matching (UDM, TRL's `BCOTrainer` with an `embedding_func`):
//! a logistic-regression classifier tells the prompts of desirable rows from those of
//! undesirable rows by their embeddings, and each undesirable row's loss is weighted by the
//! density ratio `p / (1 − p)` of its prompt (clamped), so the two sides' prompts count as if
//! they came from one distribution.
//!
//! [`UdmClassifier::fit`] is scikit-learn's `LogisticRegression(class_weight="balanced")`:
//! L2 penalty with `C = 1` on the weights (not the intercept), each class weighted by
//! `n / (2 · n_class)`, fitted here to the optimum with L-BFGS in f64. Plain slices, no candle.
//!
//! ```
//! use grpo_core::udm::UdmClassifier;
//!
//! // Desirable prompts sit at x > 0, undesirable ones at x < 0.
//! let x = vec![vec![1.0f32], vec![2.0], vec![-1.0], vec![-2.0], vec![-3.0]];
//! let y = [true, true, false, false, false];
//! let c = UdmClassifier::fit(&x, &y).unwrap();
//! assert!(c.probability(&[2.0]) > 0.5 && c.probability(&[-2.0]) < 0.5);
//! assert_eq!(c.density_ratio(&[-30.0], 0.5, 10.0), 0.5);
//! ```

/// A fitted classifier of desirable (1) against undesirable (0) prompt embeddings.
#[derive(Debug, Clone, PartialEq)]
#[cfg_attr(feature = "serde", derive(serde::Serialize, serde::Deserialize))]
pub struct UdmClassifier {
    /// One weight per embedding dimension.
    pub coef: Vec<f64>,
    /// The intercept.
    pub intercept: f64,
}

/// `log(1 + e^x)` without overflow.
fn softplus(x: f64) -> f64 {
    if x > 0.0 {
        x + (-x).exp().ln_1p()
    } else {
        x.exp().ln_1p()
    }
}

fn sigmoid(x: f64) -> f64 {
    if x >= 0.0 {
        1.0 / (1.0 + (-x).exp())
    } else {
        let e = x.exp();
        e / (1.0 + e)
    }
}

impl UdmClassifier {
    /// Fits the classifier on embeddings `x` (rows of equal length) labelled `y` (true:
    /// desirable), as scikit-learn's `LogisticRegression(class_weight="balanced").fit`.
    /// Errors on empty input, rows of unequal lengths, non-finite values, or a single class.
    pub fn fit(x: &[Vec<f32>], y: &[bool]) -> Result<Self, String> {
        let n = x.len();
        if n == 0 || n != y.len() {
            return Err(format!(
                "UDM classifier: {n} embeddings, {} labels",
                y.len()
            ));
        }
        let d = x[0].len();
        if let Some(i) = x.iter().position(|r| r.len() != d) {
            return Err(format!(
                "UDM classifier: embedding {i} has {} values, the first {d}",
                x[i].len()
            ));
        }
        if x.iter().flatten().any(|v| !v.is_finite()) {
            return Err("UDM classifier: an embedding holds a non-finite value".into());
        }
        let pos = y.iter().filter(|&&b| b).count();
        if pos == 0 || pos == n {
            return Err(format!(
                "UDM classifier: it needs desirable and undesirable prompts, got {pos} of {n} desirable"
            ));
        }
        // "balanced": each class weighs n / (2 · its count).
        let (wp, wn) = (
            n as f64 / (2.0 * pos as f64),
            n as f64 / (2.0 * (n - pos) as f64),
        );
        let xs: Vec<Vec<f64>> = x
            .iter()
            .map(|r| r.iter().map(|&v| v as f64).collect())
            .collect();
        // Parameters: d weights, then the intercept.
        let objective = |p: &[f64], grad: &mut [f64]| -> f64 {
            let (w, b) = (&p[..d], p[d]);
            let mut f = 0.5 * w.iter().map(|v| v * v).sum::<f64>();
            grad[..d].copy_from_slice(w);
            grad[d] = 0.0;
            for (r, &label) in xs.iter().zip(y) {
                let z = r.iter().zip(w).map(|(a, b)| a * b).sum::<f64>() + b;
                let (s, t) = if label { (wp, 1.0) } else { (wn, 0.0) };
                // −[t log σ(z) + (1 − t) log(1 − σ(z))] = softplus(z) − t·z
                f += s * (softplus(z) - t * z);
                let g = s * (sigmoid(z) - t);
                for (gj, a) in grad[..d].iter_mut().zip(r) {
                    *gj += g * a;
                }
                grad[d] += g;
            }
            f
        };
        let p = lbfgs(objective, vec![0.0; d + 1], 10, 1000, 1e-10);
        Ok(Self {
            intercept: p[d],
            coef: p[..d].to_vec(),
        })
    }

    /// The probability that embedding `x` is a desirable row's prompt (`predict_proba[:, 1]`).
    pub fn probability(&self, x: &[f32]) -> f64 {
        let z = self
            .coef
            .iter()
            .zip(x)
            .map(|(w, &v)| w * v as f64)
            .sum::<f64>()
            + self.intercept;
        sigmoid(z)
    }

    /// TRL's UDM weight of an undesirable row: `p / (1 − p + 1e-8)` clamped to `[min, max]`.
    pub fn density_ratio(&self, x: &[f32], min: f64, max: f64) -> f64 {
        let p = self.probability(x);
        (p / (1.0 - p + 1e-8)).clamp(min, max)
    }

    /// The share of `x` classified as `label` (scikit-learn's `score`, what TRL logs after the
    /// fit).
    pub fn accuracy(&self, x: &[Vec<f32>], label: bool) -> f64 {
        let hits = x
            .iter()
            .filter(|r| (self.probability(r) > 0.5) == label)
            .count();
        hits as f64 / x.len().max(1) as f64
    }
}

/// Minimises a smooth convex `f` (returning its value, writing its gradient) from `x0` with
/// L-BFGS (`m` correction pairs) and a backtracking Armijo line search, until the gradient's
/// largest entry is at most `tol · max(1, |f|)` or `max_iter` iterations.
fn lbfgs(
    mut f: impl FnMut(&[f64], &mut [f64]) -> f64,
    x0: Vec<f64>,
    m: usize,
    max_iter: usize,
    tol: f64,
) -> Vec<f64> {
    let n = x0.len();
    let mut x = x0;
    let mut g = vec![0.0; n];
    let mut fx = f(&x, &mut g);
    let (mut ss, mut ys): (Vec<Vec<f64>>, Vec<Vec<f64>>) = (Vec::new(), Vec::new());
    let dot = |a: &[f64], b: &[f64]| a.iter().zip(b).map(|(x, y)| x * y).sum::<f64>();
    let mut g_new = vec![0.0; n];
    for _ in 0..max_iter {
        let gmax = g.iter().fold(0.0f64, |a, v| a.max(v.abs()));
        if gmax <= tol * fx.abs().max(1.0) {
            break;
        }
        // The two-loop recursion: d = −H·g.
        let mut q = g.clone();
        let mut alphas = Vec::with_capacity(ss.len());
        for (s, y) in ss.iter().zip(&ys).rev() {
            let a = dot(s, &q) / dot(y, s);
            for (qi, yi) in q.iter_mut().zip(y) {
                *qi -= a * yi;
            }
            alphas.push(a);
        }
        if let (Some(s), Some(y)) = (ss.last(), ys.last()) {
            let gamma = dot(s, y) / dot(y, y);
            q.iter_mut().for_each(|v| *v *= gamma);
        }
        for ((s, y), a) in ss.iter().zip(&ys).zip(alphas.into_iter().rev()) {
            let b = dot(y, &q) / dot(y, s);
            for (qi, si) in q.iter_mut().zip(s) {
                *qi += (a - b) * si;
            }
        }
        let mut d: Vec<f64> = q.iter().map(|v| -v).collect();
        let mut slope = dot(&g, &d);
        if slope >= 0.0 {
            // Not a descent direction: restart from the gradient.
            d = g.iter().map(|v| -v).collect();
            slope = -dot(&g, &g);
            ss.clear();
            ys.clear();
        }
        let mut step = 1.0;
        let mut x_new: Vec<f64>;
        let mut f_new;
        loop {
            x_new = x.iter().zip(&d).map(|(a, b)| a + step * b).collect();
            f_new = f(&x_new, &mut g_new);
            if f_new <= fx + 1e-4 * step * slope || step < 1e-20 {
                break;
            }
            step *= 0.5;
        }
        let s: Vec<f64> = x_new.iter().zip(&x).map(|(a, b)| a - b).collect();
        let y: Vec<f64> = g_new.iter().zip(&g).map(|(a, b)| a - b).collect();
        let sy = dot(&s, &y);
        x = x_new;
        std::mem::swap(&mut g, &mut g_new);
        let improved = fx - f_new;
        fx = f_new;
        if sy > 1e-12 {
            ss.push(s);
            ys.push(y);
            if ss.len() > m {
                ss.remove(0);
                ys.remove(0);
            }
        }
        if improved <= 0.0 && step < 1e-20 {
            break;
        }
    }
    x
}
