//! A tape: a block's backward (a decoder layer's) without candle's autograd graph inside it.
//!
//! candle's `backward()` gives every graph edge a zeroed buffer and an add (`or_insert` then
//! `add`), even for a tensor used once, and an op node of [`crate::recompute`] a copy of its
//! output; on a GPU those are a memset, an add and an allocation per edge, device traffic of
//! several times the activations. While a tape records on this thread (a
//! [`crate::recompute::Recompute::taped`] block's forward), the fused ops compute on detached
//! inputs — no graph node — and push their inputs, output and backward here. The block's node
//! walks the tape backwards: each output's gradient goes through its op's backward; an input's
//! gradient is stored as it is when it is the first, added only when the input has one already
//! (a residual stream, a normalised row feeding three projections); each op's saved tensors
//! are freed once its backward has run.
//!
//! Gradient checkpointing uses it too: a recomputed block's ops record, and the tape is walked
//! ([`crate::recompute::Recompute::with_taped_recompute`]).
//!
//! The ops record themselves through [`apply_op1`] / [`apply_op2`] / [`apply_op3`] (a candle
//! `CustomOp` with its `bwd`), [`cat`] and [`flatten_all`], or [`taped`] (an explicit
//! backward; [`crate::recompute::Recompute::apply`] records this way). Anything else inside a
//! recording block breaks the tape, which the block notices and reports ([`Tape::broken`]):
//! an input that carries a graph of its own (built by an op that does not record), an output
//! that no later op consumes and that is not the block's output (consumed by an op that does
//! not record), a block output the tape did not produce.

use std::cell::RefCell;
use std::collections::hash_map::Entry as MapEntry;
use std::collections::{HashMap, HashSet};
use std::sync::Arc;

use candle_core::{CustomOp1, CustomOp2, CustomOp3, Result, Tensor, TensorId};

/// An op's backward: `(inputs, whether each needs a gradient, output, output's gradient)` →
/// one gradient per input (`None`: none). The inputs come detached: ask [`needs_grad`], not
/// `track_op`.
pub type TapeBackward =
    dyn Fn(&[Tensor], &[bool], &Tensor, &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

struct Entry {
    inputs: Vec<Tensor>,
    out: Tensor,
    backward: Arc<TapeBackward>,
}

/// What a block's forward recorded.
pub struct Tape {
    entries: Vec<Entry>,
    /// Tensors whose gradient the walk carries: the block's tracked inputs, its trainable
    /// weights, the outputs of recorded ops that depend on them.
    tracked: HashSet<TensorId>,
    /// Outputs not yet consumed by a later recorded op.
    unconsumed: HashSet<TensorId>,
    broken: Option<String>,
}

impl std::fmt::Debug for Tape {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Tape")
            .field("ops", &self.entries.len())
            .field("broken", &self.broken)
            .finish()
    }
}

thread_local! {
    static TAPE: RefCell<Option<Tape>> = const { RefCell::new(None) };
    /// The tracked set of the tape whose backward walks on this thread.
    static WALK: RefCell<Option<HashSet<TensorId>>> = const { RefCell::new(None) };
    /// Inside a recorded op's own forward or explicit backward: no tape on this thread.
    static SUSPENDED: std::cell::Cell<bool> = const { std::cell::Cell::new(false) };
}

/// True while a block's forward records on this thread (not inside a recorded op's own
/// computation).
pub fn recording() -> bool {
    !SUSPENDED.with(|s| s.get()) && TAPE.with(|t| t.borrow().is_some())
}

/// `f` as if no tape recorded or walked on this thread: what a recorded op's own forward and
/// an explicit backward compute is values, as a graph node's do, so the ops inside them neither
/// record nor take a tape's tensors for ones that need a gradient (a packed kernel is chosen
/// by `needs_grad` of its input, for one).
pub fn suspended<T>(f: impl FnOnce() -> T) -> T {
    struct Restore(bool);
    impl Drop for Restore {
        fn drop(&mut self) {
            SUSPENDED.with(|s| s.set(self.0));
        }
    }
    let _restore = Restore(SUSPENDED.with(|s| s.replace(true)));
    f()
}

/// Whether `t` takes part in a differentiated computation: it carries a candle graph, or a
/// tape recording (or walking) on this thread carries its gradient. What an op asks where it
/// would ask `t.track_op()`: a recorded op's output carries no graph of its own.
pub fn needs_grad(t: &Tensor) -> bool {
    if t.track_op() {
        return true;
    }
    if SUSPENDED.with(|s| s.get()) {
        return false;
    }
    TAPE.with(|tape| {
        tape.borrow()
            .as_ref()
            .is_some_and(|tape| tape.tracked.contains(&t.id()))
    }) || WALK.with(|w| w.borrow().as_ref().is_some_and(|w| w.contains(&t.id())))
}

/// Runs `f` with a tape recording on this thread; `tracked` are the tensors whose gradients the
/// walk carries from the start (the block's tracked inputs and trainable weights). Returns
/// `f`'s result and the tape, whose [`Tape::broken`] says whether it holds the whole block.
pub fn record<T>(tracked: &[&Tensor], f: impl FnOnce() -> Result<T>) -> Result<(T, Tape)> {
    if recording() {
        candle_core::bail!("tape: a recording block inside another");
    }
    let tape = Tape {
        entries: Vec::new(),
        tracked: tracked.iter().map(|t| t.id()).collect(),
        unconsumed: HashSet::new(),
        broken: None,
    };
    // Recording stops when `f` returns, fails or unwinds.
    struct Recording;
    impl Drop for Recording {
        fn drop(&mut self) {
            TAPE.with(|t| t.borrow_mut().take());
        }
    }
    TAPE.with(|t| *t.borrow_mut() = Some(tape));
    let guard = Recording;
    let out = f();
    let tape = TAPE.with(|t| t.borrow_mut().take());
    drop(guard);
    let tape = tape.ok_or_else(|| candle_core::Error::msg("tape: the recording vanished"))?;
    Ok((out?, tape))
}

impl Tape {
    /// Why the tape does not hold the whole block ending in `y`, if it does not.
    pub fn broken(&self, y: &Tensor) -> Option<String> {
        if let Some(b) = &self.broken {
            return Some(b.clone());
        }
        if !self.tracked.contains(&y.id()) {
            return Some("the block's output was not produced by a recorded op".into());
        }
        if let Some(e) = self
            .entries
            .iter()
            .find(|e| e.out.id() != y.id() && self.unconsumed.contains(&e.out.id()))
        {
            return Some(format!(
                "an op that does not record consumed a recorded output of {:?}",
                e.out.dims()
            ));
        }
        None
    }

    /// Recorded ops.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    /// True when nothing was recorded.
    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The walk: `grad` as `y`'s gradient, back through every recorded op in reverse order.
    /// Returns the gradients of the tensors given to [`record`] as tracked (those that got one),
    /// by id. Consumes the tape: each op's tensors are dropped once its backward has run.
    pub fn backward(self, y: &Tensor, grad: &Tensor) -> Result<HashMap<TensorId, Tensor>> {
        if grad.dims() != y.dims() {
            candle_core::bail!("tape: gradient {:?} for {:?}", grad.dims(), y.dims());
        }
        let Tape {
            mut entries,
            tracked,
            ..
        } = self;
        // The ops' backwards ask `needs_grad` of their inputs (the tape's own tensors carry no
        // graph): the tracked set answers while the walk runs.
        struct Walking;
        impl Drop for Walking {
            fn drop(&mut self) {
                WALK.with(|w| *w.borrow_mut() = None);
            }
        }
        if WALK.with(|w| w.borrow().is_some()) {
            candle_core::bail!("tape: a walk inside another");
        }
        WALK.with(|w| *w.borrow_mut() = Some(tracked.clone()));
        let _walking = Walking;
        let mut grads: HashMap<TensorId, Tensor> = HashMap::new();
        grads.insert(y.id(), grad.detach());
        while let Some(e) = entries.pop() {
            let Some(g) = grads.remove(&e.out.id()) else {
                continue;
            };
            let needs: Vec<bool> = e.inputs.iter().map(|t| tracked.contains(&t.id())).collect();
            // Detached (a leaf's or weight's graph is not the backward's business, and a
            // gradient computed from it would keep it alive), the needed ones told to
            // `needs_grad` under their detached ids.
            let detached: Vec<Tensor> = e.inputs.iter().map(|t| t.detach()).collect();
            WALK.with(|w| {
                if let Some(w) = w.borrow_mut().as_mut() {
                    w.extend(
                        detached
                            .iter()
                            .zip(&needs)
                            .filter(|p| *p.1)
                            .map(|p| p.0.id()),
                    );
                }
            });
            let gs = (e.backward)(&detached, &needs, &e.out, &g)?;
            drop(g);
            for ((inp, need), gi) in e.inputs.iter().zip(&needs).zip(gs) {
                let (Some(gi), true) = (gi, *need) else {
                    continue;
                };
                // Detached, as candle's backward detaches each gradient it passes on: a
                // gradient formed from a recomputation's variables carries that local graph,
                // and one kept (a weight's, into the optimizer's moments) would keep it alive
                // step after step.
                let gi = gi.detach();
                match grads.entry(inp.id()) {
                    MapEntry::Vacant(v) => {
                        v.insert(gi);
                    }
                    MapEntry::Occupied(mut o) => {
                        let sum = (o.get() + &gi)?;
                        *o.get_mut() = sum;
                    }
                }
            }
        }
        Ok(grads)
    }
}

/// An op application: while a tape records, `forward` runs on the inputs detached (no graph
/// node) and is recorded with `backward`; `None` when no tape records (the caller builds its
/// graph node as usual).
pub fn taped(
    inputs: &[&Tensor],
    forward: impl FnOnce(&[Tensor]) -> Result<Tensor>,
    backward: Arc<TapeBackward>,
) -> Result<Option<Tensor>> {
    if !recording() {
        return Ok(None);
    }
    let detached: Vec<Tensor> = inputs.iter().map(|t| t.detach()).collect();
    let out = suspended(|| forward(&detached))?;
    TAPE.with(|t| {
        let mut t = t.borrow_mut();
        let Some(tape) = t.as_mut() else {
            return;
        };
        let mut depends = false;
        for inp in inputs {
            if tape.tracked.contains(&inp.id()) {
                depends = true;
                tape.unconsumed.remove(&inp.id());
            } else if inp.track_op() && tape.broken.is_none() {
                tape.broken = Some("an input carries a graph built outside the tape".into());
            }
        }
        if out.track_op() && tape.broken.is_none() {
            tape.broken = Some("a recorded op built a graph node".into());
        }
        if depends {
            tape.tracked.insert(out.id());
            tape.unconsumed.insert(out.id());
            tape.entries.push(Entry {
                inputs: inputs.iter().map(|t| (*t).clone()).collect(),
                out: out.clone(),
                backward,
            });
        }
    });
    Ok(Some(out))
}

/// `Tensor::cat(ts, dim)`, recorded while a tape records (its backward: each part's slice of
/// the gradient, contiguous).
pub fn cat(ts: &[&Tensor], dim: usize) -> Result<Tensor> {
    if !recording() {
        return Tensor::cat(ts, dim);
    }
    let sizes = ts.iter().map(|t| t.dim(dim)).collect::<Result<Vec<_>>>()?;
    let y = taped(
        ts,
        |d| Tensor::cat(d, dim),
        Arc::new(move |_, needs, _, g| {
            let mut at = 0;
            let mut out = Vec::with_capacity(sizes.len());
            for (n, need) in sizes.iter().zip(needs) {
                out.push(match need {
                    true => Some(g.narrow(dim, at, *n)?.contiguous()?),
                    false => None,
                });
                at += n;
            }
            Ok(out)
        }),
    )?;
    y.ok_or_else(|| candle_core::Error::msg("tape: stopped recording"))
}

/// `t.flatten_all()`, recorded while a tape records.
pub fn flatten_all(t: &Tensor) -> Result<Tensor> {
    if !recording() {
        return t.flatten_all();
    }
    let shape = t.shape().clone();
    let y = taped(
        &[t],
        |d| d[0].flatten_all(),
        Arc::new(move |_, _, _, g| Ok(vec![Some(g.reshape(shape.clone())?)])),
    )?;
    y.ok_or_else(|| candle_core::Error::msg("tape: stopped recording"))
}

/// `a.apply_op1(c)`, recorded while a tape records.
pub fn apply_op1<C: CustomOp1 + Send + Sync + 'static>(a: &Tensor, c: C) -> Result<Tensor> {
    if !recording() {
        return a.apply_op1(c);
    }
    let c = Arc::new(c);
    let op = c.clone();
    let y = taped(
        &[a],
        |d| d[0].apply_op1_no_bwd(&*c),
        Arc::new(move |x, _, y, g| Ok(vec![op.bwd(&x[0], y, g)?])),
    )?;
    y.ok_or_else(|| candle_core::Error::msg("tape: stopped recording"))
}

/// `a.apply_op2(b, c)`, recorded while a tape records.
pub fn apply_op2<C: CustomOp2 + Send + Sync + 'static>(
    a: &Tensor,
    b: &Tensor,
    c: C,
) -> Result<Tensor> {
    if !recording() {
        return a.apply_op2(b, c);
    }
    let c = Arc::new(c);
    let op = c.clone();
    let y = taped(
        &[a, b],
        |d| d[0].apply_op2_no_bwd(&d[1], &*c),
        Arc::new(move |x, _, y, g| {
            let (ga, gb) = op.bwd(&x[0], &x[1], y, g)?;
            Ok(vec![ga, gb])
        }),
    )?;
    y.ok_or_else(|| candle_core::Error::msg("tape: stopped recording"))
}

/// `a.apply_op3(b, c, op)`, recorded while a tape records.
pub fn apply_op3<C: CustomOp3 + Send + Sync + 'static>(
    a: &Tensor,
    b: &Tensor,
    c: &Tensor,
    op: C,
) -> Result<Tensor> {
    if !recording() {
        return a.apply_op3(b, c, op);
    }
    let op = Arc::new(op);
    let bw = op.clone();
    let y = taped(
        &[a, b, c],
        |d| d[0].apply_op3_no_bwd(&d[1], &d[2], &*op),
        Arc::new(move |x, _, y, g| {
            let (ga, gb, gc) = bw.bwd(&x[0], &x[1], &x[2], y, g)?;
            Ok(vec![ga, gb, gc])
        }),
    )?;
    y.ok_or_else(|| candle_core::Error::msg("tape: stopped recording"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device, Var};

    /// `a · b` elementwise, recorded with its backward.
    fn mul(a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let y = taped(
            &[a, b],
            |x| x[0].mul(&x[1]),
            Arc::new(|x, needs, _, g| {
                Ok(vec![
                    needs[0].then(|| g.mul(&x[1])).transpose()?,
                    needs[1].then(|| g.mul(&x[0])).transpose()?,
                ])
            }),
        )?;
        Ok(y.expect("recording"))
    }

    /// `a + b`, recorded.
    fn add(a: &Tensor, b: &Tensor) -> Result<Tensor> {
        let y = taped(
            &[a, b],
            |x| x[0].add(&x[1]),
            Arc::new(|_, _, _, g| Ok(vec![Some(g.clone()), Some(g.clone())])),
        )?;
        Ok(y.expect("recording"))
    }

    #[test]
    fn the_walk_gives_autograds_gradients_with_a_tensor_used_twice() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::new(&[1.5f64, -2.0, 0.25], &dev)?;
        let w = Var::new(&[0.5f64, 3.0, -1.0], &dev)?;
        let c = Tensor::new(&[2.0f64, 2.0, 2.0], &dev)?; // a constant: no gradient
        let g = Tensor::new(&[1.0f64, -1.0, 0.5], &dev)?;
        // z = (x·w + x)·c: x reaches z along two paths.
        let (z, tape) = record(&[x.as_tensor(), w.as_tensor()], || {
            let y = mul(&x, &w)?;
            mul(&add(&y, &x)?, &c)
        })?;
        assert_eq!(tape.broken(&z), None);
        assert_eq!(tape.len(), 3);
        assert!(!z.track_op(), "a recorded output carries no graph");
        let grads = tape.backward(&z, &g)?;
        let plain = ((x.mul(&w)? + x.as_tensor())? * &c)?;
        let want = (plain * &g)?.sum_all()?.backward()?;
        for v in [&x, &w] {
            let (a, b) = (&grads[&v.id()], want.get(v).expect("autograd"));
            assert_eq!(a.to_vec1::<f64>()?, b.to_vec1::<f64>()?);
        }
        assert!(!grads.contains_key(&c.id()), "a constant got a gradient");
        Ok(())
    }

    #[test]
    fn an_op_outside_the_tape_breaks_it() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::new(&[1.0f64, 2.0], &dev)?;
        // A recorded output consumed by a plain candle op.
        let (z, tape) = record(&[x.as_tensor()], || {
            let y = mul(&x, &x)?;
            let y2 = (&y * 3.0)?;
            add(&y2, &y2)
        })?;
        assert!(tape.broken(&z).is_some(), "{tape:?}");
        // A graph built outside the tape fed to a recorded op.
        let (z, tape) = record(&[x.as_tensor()], || mul(&x.exp()?, &x))?;
        assert!(tape.broken(&z).is_some(), "{tape:?}");
        // The block's output not recorded.
        let (z, tape) = record(&[x.as_tensor()], || mul(&x, &x)?.exp())?;
        assert!(tape.broken(&z).is_some(), "{tape:?}");
        Ok(())
    }

    #[test]
    fn a_recorded_ops_own_computation_sees_no_tape() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::new(&[1.0f64, 2.0], &dev)?;
        let (z, tape) = record(&[x.as_tensor()], || {
            let y = mul(&x, &x)?;
            assert!(needs_grad(&y), "a recorded output needs its gradient");
            let z = taped(
                &[&y],
                |d| {
                    // What a node's forward would see: no recording, no tracked input.
                    assert!(!recording() && !needs_grad(&d[0]));
                    d[0].exp()
                },
                Arc::new(|x, _, out, g| {
                    assert!(needs_grad(&x[0]), "the walk answers for the op's inputs");
                    Ok(vec![Some(g.mul(out)?)])
                }),
            )?;
            Ok(z.expect("recording"))
        })?;
        assert_eq!(tape.broken(&z), None);
        let grads = tape.backward(&z, &Tensor::ones(2, DType::F64, &dev)?)?;
        // d exp(x²)/dx = 2x·exp(x²).
        let want = (x.as_tensor() * 2.0)?.mul(&x.sqr()?.exp()?)?;
        assert_eq!(grads[&x.id()].to_vec1::<f64>()?, want.to_vec1::<f64>()?);
        Ok(())
    }

    #[test]
    fn recording_ends_on_error_and_panic_and_does_not_nest() {
        let dev = Device::Cpu;
        let x = Var::new(&[1.0f64], &dev).expect("var");
        let r = record(&[x.as_tensor()], || -> Result<()> {
            assert!(recording());
            assert!(record(&[], || Ok(())).is_err(), "nested recording");
            candle_core::bail!("failed")
        });
        assert!(r.is_err());
        assert!(!recording());
        let r = std::panic::catch_unwind(|| {
            let _ = record(&[], || -> Result<()> { panic!("inside") });
        });
        assert!(r.is_err());
        assert!(!recording(), "a panic left the tape recording");
        assert!(!needs_grad(&Tensor::new(&[1.0f64], &dev).expect("tensor")));
    }
}
