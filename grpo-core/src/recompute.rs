//! Ops that keep only their inputs for backward, on every device and dtype.
//!
//! A composition of candle ops keeps every intermediate in the autograd graph until backward
//! (and candle's backward keeps a gradient for each node until it ends). The CPU kernels of
//! [`crate::fused`] avoid that for f32/f64 on the CPU; this module does it everywhere else
//! (CUDA, bf16, f16) without writing a kernel per device: the forward runs the composition on
//! detached inputs (no graph: its intermediates are freed at once) and the result enters the
//! graph as **one** candle `CustomOp` node whose inputs are the op's inputs. Its backward either
//! recomputes the composition on those inputs with a local graph and differentiates it
//! ([`Recompute::new`]: what gradient checkpointing does, here per op), or applies a given
//! formula ([`Recompute::explicit`]: e.g. a frozen weight's linear map, whose backward is one
//! matmul). The composition runs on candle's own kernels for the device (built by
//! candle-kernels with nvcc at build time for CUDA), so nothing is compiled at run time.
//!
//! [`Recompute::with_params`] extends this to a block with trainable weights inside (a whole
//! decoder layer: gradient checkpointing): the weights' gradients, formed during the block's
//! recomputation, go to a [`GradSink`] that the caller merges into the gradient store after
//! `backward()`.
//!
//! [`Recompute::segment`] is the same node without the recomputation: the block's graph is built
//! once, in the forward, and kept *inside the node*; its backward differentiates that graph and
//! drops it. candle's `backward()` keeps every activation of a graph alive until it returns (the
//! loss owns the whole graph), so all activations and all weight gradients coexist at its end;
//! with a decoder layer per segment each layer's activations are freed as soon as its gradients
//! are formed, as PyTorch frees a node's saved tensors.
//!
//! The cost: one copy of the op's output (the forward result is moved into the graph node by a
//! device copy, since candle offers no way to adopt a storage) and, for [`Recompute::new`], one
//! more forward of the composition in backward.

use std::cell::Cell;
use std::sync::{Arc, Mutex};

use candle_core::backprop::GradStore;
use candle_core::{CpuStorage, CustomOp1, CustomOp2, CustomOp3, Layout, Result, Shape, Tensor};
use candle_core::{Storage, Var};

/// A composition: inputs → output. The flag is true when it runs under a local graph (in
/// backward); a block with trainable weights uses its detached weights when it is false.
pub type ForwardFn = dyn Fn(&[Tensor], bool) -> Result<Tensor> + Send + Sync;

/// An explicit backward: `(inputs, output gradient)` → one gradient per input (`None` for an
/// input that needs none).
pub type BackwardFn = dyn Fn(&[Tensor], &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync;

thread_local! {
    static IN_RECOMPUTE: Cell<bool> = const { Cell::new(false) };
}

/// True while this thread recomputes a block in backward: nested recompute ops are pointless
/// there (the local graph lives for one block only), so callers use plain compositions.
pub fn in_recompute() -> bool {
    IN_RECOMPUTE.with(|c| c.get())
}

/// Gradients of trainable weights formed inside recomputed blocks, waiting to be merged into
/// the gradient store of the `backward()` that ran them.
#[derive(Debug, Default)]
pub struct GradSink {
    grads: Mutex<Vec<(Tensor, Tensor)>>,
}

impl GradSink {
    /// An empty sink, shared by the blocks of one model.
    pub fn new() -> Arc<Self> {
        Arc::new(Self::default())
    }

    fn push(&self, var: Tensor, grad: Tensor) -> Result<()> {
        self.grads
            .lock()
            .map_err(|_| candle_core::Error::msg("gradient sink poisoned"))?
            .push((var, grad));
        Ok(())
    }

    /// Moves every gradient into `store`, adding to what the store holds for the same weight.
    pub fn drain_into(&self, store: &mut GradStore) -> Result<()> {
        let grads = std::mem::take(
            &mut *self
                .grads
                .lock()
                .map_err(|_| candle_core::Error::msg("gradient sink poisoned"))?,
        );
        for (var, g) in grads {
            let sum = match store.remove(&var) {
                Some(old) => (old + g)?,
                None => g,
            };
            store.insert(&var, sum);
        }
        Ok(())
    }

    /// Drops whatever is waiting (a backward that failed half-way).
    pub fn clear(&self) {
        if let Ok(mut g) = self.grads.lock() {
            g.clear();
        }
    }

    /// True when nothing is waiting.
    pub fn is_empty(&self) -> bool {
        self.grads.lock().map(|g| g.is_empty()).unwrap_or(true)
    }
}

enum Backward {
    Recompute,
    Explicit(Arc<BackwardFn>),
    /// The graph built in the forward, kept by the node ([`Recompute::segment`]).
    Retained,
    /// The ops recorded on a tape in the forward, kept by the node ([`Recompute::taped`]); a
    /// block whose tape broke keeps its graph instead, as a segment.
    Taped,
}

static TAPE_FALLBACKS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many [`Recompute::taped`] blocks in the process fell back to a segment, or taped
/// recomputations ([`Recompute::with_taped_recompute`]) to a local graph, because an op inside
/// them did not record (told once on stderr with the reason, the first time).
pub fn tape_fallbacks() -> usize {
    TAPE_FALLBACKS.load(std::sync::atomic::Ordering::SeqCst)
}

/// Segments whose graph is alive (built by a forward, not yet differentiated or dropped).
static LIVE_SEGMENTS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// How many [`Recompute::segment`] graphs are alive in the process: each forward adds one per
/// segment, its backward (or dropping the graph that holds it) removes it.
pub fn live_segments() -> usize {
    LIVE_SEGMENTS.load(std::sync::atomic::Ordering::SeqCst)
}

static TIMING: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
/// (backward?, seconds) of each timed segment pass.
static TIMES: Mutex<Vec<(bool, f64)>> = Mutex::new(Vec::new());

/// Times every segment's forward and backward from now on (each waited for on its device
/// before and after: slower, for a breakdown only), or stops. `bench-model` uses it to split
/// the learner's time between the decoder layers and the rest (embedding, head, loss).
pub fn set_segment_timing(on: bool) {
    TIMING.store(on, std::sync::atomic::Ordering::SeqCst);
}

/// The segment times recorded since the last call: `(forwards, backwards)`, seconds each.
pub fn take_segment_times() -> (Vec<f64>, Vec<f64>) {
    let all = std::mem::take(&mut *TIMES.lock().unwrap_or_else(|e| e.into_inner()));
    let pick = |bwd: bool| all.iter().filter(|t| t.0 == bwd).map(|t| t.1).collect();
    (pick(false), pick(true))
}

/// `f`, timed when segment timing is on.
fn timed<T>(bwd: bool, device: &candle_core::Device, f: impl FnOnce() -> Result<T>) -> Result<T> {
    if !TIMING.load(std::sync::atomic::Ordering::SeqCst) {
        return f();
    }
    device.synchronize()?;
    let t = std::time::Instant::now();
    let out = f()?;
    device.synchronize()?;
    TIMES
        .lock()
        .unwrap_or_else(|e| e.into_inner())
        .push((bwd, t.elapsed().as_secs_f64()));
    Ok(out)
}

/// A segment's graph: the leaves its inputs became and its tracked output — or, for a taped
/// block, its output and tape.
struct Local {
    leaves: Vec<Tensor>,
    y: Tensor,
    tape: Option<crate::tape::Tape>,
}

impl Local {
    fn new(leaves: Vec<Tensor>, y: Tensor, tape: Option<crate::tape::Tape>) -> Self {
        LIVE_SEGMENTS.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        Self { leaves, y, tape }
    }
}

impl Drop for Local {
    fn drop(&mut self) {
        LIVE_SEGMENTS.fetch_sub(1, std::sync::atomic::Ordering::SeqCst);
    }
}

/// An op (or block) whose graph node keeps only its inputs; see the module docs.
pub struct Recompute {
    name: &'static str,
    forward: Arc<ForwardFn>,
    backward: Backward,
    params: Vec<Tensor>,
    sink: Option<Arc<GradSink>>,
    /// [`Recompute::new`]'s recomputation records on a tape ([`Recompute::with_taped_recompute`]).
    taped_recompute: bool,
}

impl std::fmt::Debug for Recompute {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Recompute")
            .field("name", &self.name)
            .finish()
    }
}

impl Recompute {
    fn with(name: &'static str, forward: Arc<ForwardFn>, backward: Backward) -> Self {
        Self {
            name,
            forward,
            backward,
            params: Vec::new(),
            sink: None,
            taped_recompute: false,
        }
    }

    /// Backward by recomputing `forward` with a local graph.
    pub fn new(
        name: &'static str,
        forward: impl Fn(&[Tensor], bool) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Self {
        Self::with(name, Arc::new(forward), Backward::Recompute)
    }

    /// Backward by an explicit formula (nothing recomputed).
    pub fn explicit(
        name: &'static str,
        forward: impl Fn(&[Tensor], bool) -> Result<Tensor> + Send + Sync + 'static,
        backward: impl Fn(&[Tensor], &Tensor) -> Result<Vec<Option<Tensor>>> + Send + Sync + 'static,
    ) -> Self {
        Self::with(
            name,
            Arc::new(forward),
            Backward::Explicit(Arc::new(backward)),
        )
    }

    /// A block whose graph is built once, in the forward (`forward` called with the flag true,
    /// on leaves for its tracked inputs), and kept by the node; backward differentiates it and
    /// frees it. No recomputation: the same activations as the plain composition, freed a block
    /// at a time during backward. One backward per forward.
    pub fn segment(
        name: &'static str,
        forward: impl Fn(&[Tensor], bool) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Self {
        Self::with(name, Arc::new(forward), Backward::Retained)
    }

    /// [`Recompute::segment`] whose forward records its ops on a tape ([`crate::tape`]) instead
    /// of building a graph: its backward walks the tape (no zeroed buffer and add per graph
    /// edge, no copy of each op's output). Every op inside must record (the fused ops do); if
    /// one does not, the block says so once on stderr and runs as a segment.
    pub fn taped(
        name: &'static str,
        forward: impl Fn(&[Tensor], bool) -> Result<Tensor> + Send + Sync + 'static,
    ) -> Self {
        Self::with(name, Arc::new(forward), Backward::Taped)
    }

    /// Trainable weights (candle `Var`s) that `forward` uses when its flag is true: their
    /// gradients from the recomputation (or the segment's graph) go to `sink`. For
    /// [`Recompute::new`], [`Recompute::segment`] and [`Recompute::taped`].
    pub fn with_params(mut self, params: Vec<Tensor>, sink: Arc<GradSink>) -> Self {
        self.params = params;
        self.sink = Some(sink);
        self
    }

    /// For [`Recompute::new`] (gradient checkpointing of a block whose ops all record): the
    /// backward's recomputation records on a tape and walks it ([`crate::tape`]) instead of
    /// differentiating the plain composition under a local graph — the ops keep their
    /// graph-node paths (flash attention, no probabilities or MLP products kept), no zeroed
    /// buffer and add per edge. A tape that breaks falls back to the local graph (said once
    /// on stderr).
    pub fn with_taped_recompute(mut self) -> Self {
        self.taped_recompute = true;
        self
    }

    /// `forward` on the inputs detached (no copy: the tape carries gradients by tensor id, where
    /// a local graph's variables copy each tracked input) while a tape records, the tracked
    /// inputs and the weights its start: `(leaves, output, tape)`, or `None` where an op did
    /// not record (counted, and told once on stderr: "{name}: {fallback} (...)").
    fn record_forward(
        &self,
        args: &[&Tensor],
        fallback: &str,
    ) -> Result<Option<(Vec<Tensor>, Tensor, crate::tape::Tape)>> {
        let leaves: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
        let mut start: Vec<&Tensor> = (leaves.iter().zip(args))
            .filter(|(_, a)| a.track_op())
            .map(|(l, _)| l)
            .collect();
        start.extend(self.params.iter());
        let (y, tape) = crate::tape::record(&start, || (self.forward)(&leaves, true))?;
        match tape.broken(&y) {
            None => Ok(Some((leaves, y, tape))),
            Some(why) => {
                if TAPE_FALLBACKS.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                    eprintln!(
                        "{}: {fallback} (its ops' tape is incomplete: {why})",
                        self.name
                    );
                }
                Ok(None)
            }
        }
    }

    /// Runs the op on up to three inputs. Without a tracked input or a trainable weight the
    /// plain result is returned (no node, no copy).
    pub fn apply(self, args: &[&Tensor]) -> Result<Tensor> {
        if crate::tape::recording() && self.params.is_empty() {
            // Inside a taped block: this op records itself instead of becoming a node.
            let fwd = self.forward.clone();
            let back: Option<Arc<crate::tape::TapeBackward>> = match &self.backward {
                // Both compute values, as a node's backward does (no tape inside them).
                Backward::Explicit(f) => {
                    let f = f.clone();
                    Some(Arc::new(move |x, _, _, g| {
                        crate::tape::suspended(|| f(x, g))
                    }))
                }
                Backward::Recompute => {
                    let f = fwd.clone();
                    Some(Arc::new(move |x, needs, _, g| {
                        crate::tape::suspended(|| recompute_grads(&*f, x, needs, g))
                    }))
                }
                _ => None,
            };
            if let Some(back) = back
                && let Some(y) = crate::tape::taped(args, |d| fwd(d, false), back)?
            {
                return Ok(y);
            }
        }
        let tracked = args.iter().any(|a| a.track_op());
        let (y, local) = match self.backward {
            Backward::Taped if tracked || !self.params.is_empty() => {
                let taped = timed(false, args[0].device(), || {
                    self.record_forward(args, "runs as a segment")
                })?;
                match taped {
                    Some((leaves, y, tape)) => (y.clone(), Some(Local::new(leaves, y, Some(tape)))),
                    None => {
                        let leaves = leaves(args)?;
                        let y = timed(false, args[0].device(), || (self.forward)(&leaves, true))?;
                        (y.detach(), Some(Local::new(leaves, y, None)))
                    }
                }
            }
            Backward::Retained if tracked || !self.params.is_empty() => {
                let leaves = leaves(args)?;
                let y = timed(false, args[0].device(), || (self.forward)(&leaves, true))?;
                (y.detach(), Some(Local::new(leaves, y, None)))
            }
            _ => {
                let detached: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
                ((self.forward)(&detached, false)?, None)
            }
        };
        if !tracked && self.params.is_empty() {
            return Ok(y);
        }
        // A node is recorded only when an input is tracked: a block whose inputs are all
        // frozen (LoRA's first layer) gets a one-element anchor variable as an extra input.
        let anchor;
        let mut inputs: Vec<&Tensor> = args.to_vec();
        if !tracked {
            anchor = Var::zeros(1, y.dtype(), y.device())?.into_inner();
            inputs.push(&anchor);
        }
        let y = if y.is_contiguous() && y.layout().start_offset() == 0 {
            y
        } else {
            y.copy()?
        };
        let node = Node {
            op: self,
            out: Mutex::new(Some(y)),
            local: Mutex::new(local),
            n_args: args.len(),
        };
        match inputs.as_slice() {
            [a] => a.apply_op1(node),
            [a, b] => a.apply_op2(b, node),
            [a, b, c] => a.apply_op3(b, c, node),
            _ => candle_core::bail!("{}: recompute ops take 1 to 3 inputs", node.op.name),
        }
    }
}

/// The graph node: holds the forward result until candle asks for it (then only the node's
/// own copy exists) and the recipe for backward.
struct Node {
    op: Recompute,
    out: Mutex<Option<Tensor>>,
    /// A segment's graph until its backward.
    local: Mutex<Option<Local>>,
    n_args: usize,
}

/// `y`'s graph differentiated with `grad` as `y`'s gradient: `backward()` of a one-element
/// node whose own backward hands `grad` to `y` (what `(y · grad).sum().backward()` gives,
/// without its four `y`-sized products and sums).
pub fn seeded_backward(y: &Tensor, grad: &Tensor) -> Result<GradStore> {
    if grad.dims() != y.dims() {
        candle_core::bail!(
            "seeded backward: gradient {:?} for {:?}",
            grad.dims(),
            y.dims()
        );
    }
    y.apply_op1(Seed(grad.detach()))?.backward()
}

/// The one-element node of [`seeded_backward`].
struct Seed(Tensor);

impl CustomOp1 for Seed {
    fn name(&self) -> &'static str {
        "seed"
    }
    fn cpu_fwd(&self, s: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let shape = Shape::from(());
        Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        s: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        use candle_core::backend::{BackendDevice, BackendStorage};
        let shape = Shape::from(());
        Ok((s.device().zeros_impl(&shape, s.dtype())?, shape))
    }
    fn bwd(&self, _: &Tensor, _: &Tensor, _: &Tensor) -> Result<Option<Tensor>> {
        Ok(Some(self.0.clone()))
    }
}

/// A recomputed op's input gradients on a tape ([`crate::tape`]): `forward` run again on
/// leaves (variables where `needs`) under a local graph, differentiated with `grad`.
fn recompute_grads(
    forward: &ForwardFn,
    inputs: &[Tensor],
    needs: &[bool],
    grad: &Tensor,
) -> Result<Vec<Option<Tensor>>> {
    let leaves = inputs
        .iter()
        .zip(needs)
        .map(|(t, n)| {
            if *n {
                Ok(Var::from_tensor(t)?.into_inner())
            } else {
                Ok(t.clone())
            }
        })
        .collect::<Result<Vec<_>>>()?;
    let was = IN_RECOMPUTE.with(|c| c.replace(true));
    let grads = (forward)(&leaves, true).and_then(|y| seeded_backward(&y, grad));
    IN_RECOMPUTE.with(|c| c.set(was));
    let grads = grads?;
    Ok(leaves
        .iter()
        .zip(needs)
        .map(|(l, n)| if *n { grads.get(l).cloned() } else { None })
        .collect())
}

/// Fresh leaves for a local graph: a variable for each tracked input, the detached tensor for
/// the others (both share the input's storage).
fn leaves(args: &[&Tensor]) -> Result<Vec<Tensor>> {
    args.iter()
        .map(|a| {
            if a.track_op() {
                Ok(Var::from_tensor(&a.detach())?.into_inner())
            } else {
                Ok(a.detach())
            }
        })
        .collect()
}

impl Node {
    fn take(&self) -> Result<Tensor> {
        self.out
            .lock()
            .map_err(|_| candle_core::Error::msg("recompute node poisoned"))?
            .take()
            .ok_or_else(|| candle_core::Error::msg(format!("{}: forward ran twice", self.op.name)))
    }

    fn storage(&self) -> Result<(Storage, Shape)> {
        let y = self.take()?;
        let (st, l) = y.storage_and_layout();
        Ok((st.try_clone(l)?, y.shape().clone()))
    }

    fn cpu(&self) -> Result<(CpuStorage, Shape)> {
        match self.storage()? {
            (Storage::Cpu(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("{}: result not on the CPU", self.op.name),
        }
    }

    #[cfg(feature = "cuda")]
    fn cuda(&self) -> Result<(candle_core::CudaStorage, Shape)> {
        match self.storage()? {
            (Storage::Cuda(s), shape) => Ok((s, shape)),
            _ => candle_core::bail!("{}: result not on a CUDA device", self.op.name),
        }
    }

    /// Gradients of the first `n_args` inputs (the anchor, if any, gets none).
    fn grads(&self, args: &[&Tensor], grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        let args = &args[..self.n_args];
        let detached: Vec<Tensor> = args.iter().map(|a| a.detach()).collect();
        let mut out = match &self.op.backward {
            Backward::Explicit(f) => f(&detached, grad)?,
            Backward::Recompute => self.recompute(args, grad)?,
            Backward::Retained | Backward::Taped => self.differentiate_segment(args, grad)?,
        };
        for (g, a) in out.iter_mut().zip(args) {
            if !a.track_op() {
                *g = None;
            }
        }
        out.resize(3, None);
        Ok(out)
    }

    fn recompute(&self, args: &[&Tensor], grad: &Tensor) -> Result<Vec<Option<Tensor>>> {
        if self.op.taped_recompute {
            // The recomputation records on a tape (the ops take their graph-node path, not the
            // plain compositions a local graph needs), then the tape is walked; a tape that
            // broke falls back to the local graph below.
            if let Some((leaves, y, tape)) =
                self.op.record_forward(args, "recomputed without a tape")?
            {
                let mut grads = tape.backward(&y, grad)?;
                return self.collect(args, &leaves, |t| grads.remove(&t.id()));
            }
        }
        let leaves = leaves(args)?;
        let was = IN_RECOMPUTE.with(|c| c.replace(true));
        let run = || -> Result<GradStore> {
            let y = (self.op.forward)(&leaves, true)?;
            seeded_backward(&y, grad)
        };
        let grads = run();
        IN_RECOMPUTE.with(|c| c.set(was));
        let grads = grads?;
        self.collect(args, &leaves, |t| grads.get(t).cloned())
    }

    /// A segment's backward: its kept graph differentiated with `grad`, then dropped (its
    /// activations freed before the blocks below it run their backward).
    fn differentiate_segment(
        &self,
        args: &[&Tensor],
        grad: &Tensor,
    ) -> Result<Vec<Option<Tensor>>> {
        let local = self
            .local
            .lock()
            .map_err(|_| candle_core::Error::msg("recompute node poisoned"))?
            .take()
            .ok_or_else(|| {
                candle_core::Error::msg(format!(
                    "{}: a second backward through one forward (its graph was freed by the \
                     first)",
                    self.op.name
                ))
            })?;
        let mut local = local;
        let leaves = std::mem::take(&mut local.leaves);
        if let Some(tape) = local.tape.take() {
            let y = local.y.clone();
            drop(local);
            let mut grads = timed(true, y.device(), || tape.backward(&y, grad))?;
            return self.collect(args, &leaves, |t| grads.remove(&t.id()));
        }
        let grads = timed(true, local.y.device(), || seeded_backward(&local.y, grad))?;
        drop(local);
        self.collect(args, &leaves, |t| grads.get(t).cloned())
    }

    /// The weights' gradients to the sink; the tracked inputs' gradients, in input order.
    fn collect(
        &self,
        args: &[&Tensor],
        leaves: &[Tensor],
        mut grads: impl FnMut(&Tensor) -> Option<Tensor>,
    ) -> Result<Vec<Option<Tensor>>> {
        if let Some(sink) = &self.op.sink {
            for p in &self.op.params {
                if let Some(g) = grads(p) {
                    sink.push(p.clone(), g)?;
                }
            }
        }
        Ok(leaves
            .iter()
            .zip(args)
            .map(|(l, a)| if a.track_op() { grads(l) } else { None })
            .collect())
    }
}

impl CustomOp1 for Node {
    fn name(&self) -> &'static str {
        self.op.name
    }
    fn cpu_fwd(&self, _: &CpuStorage, _: &Layout) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda()
    }
    fn bwd(&self, a: &Tensor, _res: &Tensor, grad: &Tensor) -> Result<Option<Tensor>> {
        let mut g = self.grads(&[a], grad)?;
        Ok(g.swap_remove(0))
    }
}

impl CustomOp2 for Node {
    fn name(&self) -> &'static str {
        self.op.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten()))
    }
}

impl CustomOp3 for Node {
    fn name(&self) -> &'static str {
        self.op.name
    }
    fn cpu_fwd(
        &self,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
        _: &CpuStorage,
        _: &Layout,
    ) -> Result<(CpuStorage, Shape)> {
        self.cpu()
    }
    #[cfg(feature = "cuda")]
    fn cuda_fwd(
        &self,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
        _: &candle_core::CudaStorage,
        _: &Layout,
    ) -> Result<(candle_core::CudaStorage, Shape)> {
        self.cuda()
    }
    fn bwd(
        &self,
        a: &Tensor,
        b: &Tensor,
        c: &Tensor,
        _res: &Tensor,
        grad: &Tensor,
    ) -> Result<(Option<Tensor>, Option<Tensor>, Option<Tensor>)> {
        let mut g = self.grads(&[a, b, c], grad)?.into_iter();
        Ok((g.next().flatten(), g.next().flatten(), g.next().flatten()))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::{DType, Device};

    fn composed(args: &[Tensor], _: bool) -> Result<Tensor> {
        // (a · b).exp() + a, a composition with several intermediates.
        args[0].matmul(&args[1])?.exp()? + &args[0]
    }

    #[test]
    fn recompute_matches_the_composition_values_and_gradients() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::from_tensor(&Tensor::randn(0f64, 0.3, (4, 4), &dev)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f64, 0.3, (4, 4), &dev)?)?;
        let w = Tensor::randn(0f64, 1.0, (4, 4), &dev)?;
        let want = composed(&[a.as_tensor().clone(), b.as_tensor().clone()], true)?;
        let gw = (&want * &w)?.sum_all()?.backward()?;
        let got = Recompute::new("test", composed).apply(&[a.as_tensor(), b.as_tensor()])?;
        let gg = (&got * &w)?.sum_all()?.backward()?;
        let diff = |x: &Tensor, y: &Tensor| -> Result<f64> {
            (x - y)?.abs()?.max_all()?.to_scalar::<f64>()
        };
        assert!(diff(&want, &got)? < 1e-12);
        for v in [&a, &b] {
            let (x, y) = (gw.get(v.as_tensor()), gg.get(v.as_tensor()));
            assert!(diff(x.expect("grad"), y.expect("grad"))? < 1e-12);
        }
        Ok(())
    }

    #[test]
    fn params_gradients_reach_the_sink_even_without_tracked_inputs() -> Result<()> {
        let dev = Device::Cpu;
        let x = Tensor::randn(0f32, 1.0, (3, 2), &dev)?;
        let w = Var::from_tensor(&Tensor::randn(0f32, 1.0, (2, 2), &dev)?)?;
        let wd = w.as_tensor().detach();
        let wv = w.as_tensor().clone();
        let sink = GradSink::new();
        let y = Recompute::new("block", move |a, grad| {
            a[0].matmul(if grad { &wv } else { &wd })?.tanh()
        })
        .with_params(vec![w.as_tensor().clone()], sink.clone())
        .apply(&[&x])?;
        let mut store = y.sum_all()?.backward()?;
        assert!(store.get(w.as_tensor()).is_none());
        sink.drain_into(&mut store)?;
        assert!(sink.is_empty());
        let want = x.matmul(w.as_tensor())?.tanh()?.sum_all()?.backward()?;
        let d = (store.get(w.as_tensor()).expect("sink grad")
            - want.get(w.as_tensor()).expect("g"))?
        .abs()?
        .max_all()?
        .to_dtype(DType::F64)?
        .to_scalar::<f64>()?;
        assert!(d < 1e-6, "{d}");
        Ok(())
    }

    /// A segment: the composition's values and gradients (weights through the sink), its graph
    /// freed by its backward while the outer graph (the loss) is still alive, and a second
    /// backward through the same forward refused.
    #[test]
    fn segments_match_the_composition_and_free_their_graph_in_backward() -> Result<()> {
        let dev = Device::Cpu;
        let x = Var::from_tensor(&Tensor::randn(0f64, 0.5, (3, 4), &dev)?)?;
        let w = Var::from_tensor(&Tensor::randn(0f64, 0.5, (4, 4), &dev)?)?;
        let dout = Tensor::randn(0f64, 1.0, (3, 4), &dev)?;
        let block =
            |a: &Tensor, w: &Tensor| -> Result<Tensor> { (a.matmul(w)?.tanh()? + a)?.exp() };
        // Two blocks in a row, as decoder layers.
        let want = block(&block(x.as_tensor(), w.as_tensor())?, w.as_tensor())?;
        let gw = (&want * &dout)?.sum_all()?.backward()?;
        let sink = GradSink::new();
        let seg = |a: &Tensor| -> Result<Tensor> {
            let wv = w.as_tensor().clone();
            Recompute::segment("block", move |t, _| block(&t[0], &wv))
                .with_params(vec![w.as_tensor().clone()], sink.clone())
                .apply(&[a])
        };
        let before = live_segments();
        let got = seg(&seg(x.as_tensor())?)?;
        assert_eq!(live_segments(), before + 2);
        let loss = (&got * &dout)?.sum_all()?;
        let mut gg = loss.backward()?;
        // The loss (and so the outer graph) is alive: the segments' graphs went in backward.
        assert_eq!(live_segments(), before);
        sink.drain_into(&mut gg)?;
        let diff = |a: &Tensor, b: &Tensor| -> Result<f64> {
            (a - b)?.abs()?.max_all()?.to_scalar::<f64>()
        };
        assert!(diff(&want, &got)? < 1e-12);
        for v in [&x, &w] {
            let (a, b) = (gw.get(v.as_tensor()), gg.get(v.as_tensor()));
            assert!(diff(a.expect("want"), b.expect("got"))? < 1e-12);
        }
        let again = loss.backward().map(|_| ()).unwrap_err().to_string();
        assert!(again.contains("a second backward"), "{again}");
        // A forward never differentiated frees its graph with the outer one.
        let unused = seg(x.as_tensor())?;
        assert_eq!(live_segments(), before + 1);
        drop(unused);
        assert_eq!(live_segments(), before);
        Ok(())
    }

    /// A seeded backward gives the gradients of `(y · g).sum()`, and refuses a gradient of
    /// another shape.
    #[test]
    fn seeded_backward_is_the_weighted_sums_backward() -> Result<()> {
        let dev = Device::Cpu;
        let a = Var::from_tensor(&Tensor::randn(0f64, 0.3, (4, 4), &dev)?)?;
        let b = Var::from_tensor(&Tensor::randn(0f64, 0.3, (4, 4), &dev)?)?;
        let g = Tensor::randn(0f64, 1.0, (4, 4), &dev)?;
        let y = composed(&[a.as_tensor().clone(), b.as_tensor().clone()], true)?;
        let want = (&y * &g)?.sum_all()?.backward()?;
        let got = seeded_backward(&y, &g)?;
        for v in [&a, &b] {
            let d = (want.get(v.as_tensor()).expect("want")
                - got.get(v.as_tensor()).expect("got"))?
            .abs()?
            .max_all()?
            .to_scalar::<f64>()?;
            assert!(d < 1e-12, "{d}");
        }
        let bad = seeded_backward(&y, &g.narrow(0, 0, 2)?)
            .unwrap_err()
            .to_string();
        assert!(bad.contains("gradient [2, 4] for [4, 4]"), "{bad}");
        Ok(())
    }

    #[test]
    fn untracked_inputs_give_the_plain_result() -> Result<()> {
        let x = Tensor::new(&[1f32, 2.0], &Device::Cpu)?;
        let y = Recompute::new("plain", |a, _| a[0].exp()).apply(&[&x])?;
        assert!(!y.track_op());
        assert_eq!(y.to_vec1::<f32>()?, x.exp()?.to_vec1::<f32>()?);
        Ok(())
    }
}
