//! CUDA graphs for the decode step.
//!
//! A decode step on a GPU is some 250 small launches (8 per layer, the head, the sampler) and
//! at 128 rows of a 0.77B model the device finishes each before the host has issued the next:
//! the step measured 5.9 ms at 128 rows and 5.3 ms at 8, bound by the host's ≈ 20 µs per
//! launch. A CUDA graph records the step's launches once and replays them with one call.
//!
//! What a replay needs, and how the step provides it:
//! - **Fixed launch arguments.** The cached length changes every step, so the cache pass reads
//!   it from device memory ([`crate::fused::cached_attention_at`]), the attention bias spans
//!   the cache's capacity (columns past the length are not read), and the step's inputs and
//!   outputs are buffers made before the capture and written in place: the token ids, the
//!   next positions, the length, the logits. The replay ends by advancing positions and length
//!   itself. A sliding window's band (keys `w` or more positions back masked) is made from the
//!   length on the device too, against a buffer of the cache positions.
//! - **No host traffic inside.** The sampler (which uploads the rows' uniforms and brings back
//!   the sampled ids) runs between replays, as do the ids' copy into the graph's buffer.
//! - **Allocations inside the step** become the graph's own (cudarc allocates stream-ordered),
//!   freed inside it too, so the graph can be replayed.
//! - **One graph per batch size.** When finished rows leave the batch (a compaction), the
//!   graph's state goes back to the eager decode state, one eager step runs at the new size
//!   (its kernels and cuBLAS's loaded before any capture) and the next step is captured anew.
//!
//! A capture that fails (an op the driver refuses to record) switches graphs off for the
//! process with one line on stderr; the eager step runs, with the same results. `grpo-cli
//! check --device cuda` compares a generation with graphs against one without.
//! `GRPO_CUDA_GRAPHS=0` turns them off.
//!
//! On the CPU nothing is captured; [`replayed_on_the_host`] runs the same step structure there
//! (the buffers, the length read from a tensor, the in-place updates) with the step's ops run
//! again at each "replay", so the tests check it against the eager step.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};

use candle_core::{DType, Device, Result, Tensor};

use crate::generate::DecodeState;
use crate::model::Transformer;

static OFF: AtomicBool = AtomicBool::new(false);
static CAPTURES: AtomicUsize = AtomicUsize::new(0);
static REPLAYS: AtomicUsize = AtomicUsize::new(0);

thread_local! {
    static ON_THE_HOST: Cell<bool> = const { Cell::new(false) };
    static CORRUPT: Cell<bool> = const { Cell::new(false) };
}

/// The dtypes whose first captured step was checked against the eager step in this process.
static VERIFIED: std::sync::Mutex<Vec<DType>> = std::sync::Mutex::new(Vec::new());

/// Runs `f` with the host-replayed steps' logits spoiled (tests of the replay check).
pub fn with_corrupted_replays<T>(f: impl FnOnce() -> T) -> T {
    let prev = CORRUPT.with(|c| c.replace(true));
    let out = f();
    CORRUPT.with(|c| c.set(prev));
    out
}

/// Decode steps replayed in this process (on the CPU, under [`replayed_on_the_host`]).
pub fn replays() -> usize {
    REPLAYS.load(Ordering::Relaxed)
}

/// Decode steps captured in this process (each a graph replayed until its batch changes; on the
/// CPU, the steps [`replayed_on_the_host`] set up).
pub fn captures() -> usize {
    CAPTURES.load(Ordering::Relaxed)
}

/// Whether decode steps on `device` are captured: a CUDA device in a CUDA build, unless
/// `GRPO_CUDA_GRAPHS=0` or a capture failed in this process (or, on this thread, the CPU
/// under [`replayed_on_the_host`]).
pub fn enabled(device: &Device) -> bool {
    if device.is_cpu() {
        return ON_THE_HOST.with(Cell::get);
    }
    static WANTED: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    device.is_cuda()
        && cfg!(feature = "cuda")
        && !OFF.load(Ordering::Relaxed)
        && *WANTED.get_or_init(|| std::env::var("GRPO_CUDA_GRAPHS").as_deref() != Ok("0"))
}

/// Turns graphs off (or back on) for the process: `grpo-cli check` compares both ways.
pub fn set_enabled(on: bool) {
    OFF.store(!on, Ordering::Relaxed);
}

/// Runs `f` with the CPU's decode steps run as captured ones would be (the step's buffers and
/// in-place updates, its ops run again at each replay), on this thread: the tests of the
/// captured step's logic.
pub fn replayed_on_the_host<T>(f: impl FnOnce() -> T) -> T {
    let prev = ON_THE_HOST.with(|c| c.replace(true));
    let out = f();
    ON_THE_HOST.with(|c| c.set(prev));
    out
}

/// The buffers a captured step reads and writes in place.
struct Buffers {
    /// `(n,)` u32: the rows' input tokens.
    ids: Tensor,
    /// `(n, 1)` u32: their positions, advanced by the step.
    pos: Tensor,
    /// `(1,)` u32: the cached length, advanced by the step.
    past: Tensor,
    /// `(n, capacity)`: each row's key bias (its prompt's padding masked, 0 after); f32, or
    /// f16 clamped to f16's mask value for an f16 model.
    bias: Tensor,
    /// `(n, vocab)`: the logits the step leaves.
    logits: Tensor,
    /// `(1, capacity)` f32: the cache positions, for a sliding window's band (made on the
    /// device from `past` at each replay); `None` without a window.
    keys: Option<Tensor>,
}

impl Buffers {
    /// The step's ops: what the graph records.
    fn run(&self, model: &Transformer, state: &mut DecodeState) -> Result<()> {
        let (n, cap) = self.bias.dims2()?;
        let len = state.cache.len();
        state.cache.past_at = Some(self.past.clone());
        state.cache.key_index = self.keys.clone();
        let run = (|| -> Result<()> {
            let bias = self.bias.reshape((n, 1, 1, cap))?;
            let ids = self.ids.reshape((n, 1))?;
            let hidden = model.forward_hidden(&ids, &self.pos, &bias, Some(&mut state.cache))?;
            self.logits
                .slice_set(&model.logits(&hidden.squeeze(1)?)?, 0, 0)?;
            self.pos.slice_set(&(&self.pos + 1.0)?, 0, 0)?;
            self.past.slice_set(&(&self.past + 1.0)?, 0, 0)
        })();
        // The host's count is the caller's to advance (a capture runs nothing).
        state.cache.past_at = None;
        state.cache.key_index = None;
        state.cache.set_len(len);
        run
    }
}

enum Replay {
    #[cfg(feature = "cuda")]
    Cuda(candle_core::cuda_backend::cudarc::driver::CudaGraph),
    /// The step's ops run again (the CPU under [`replayed_on_the_host`]).
    Host,
}

/// A decode step captured for a batch of rows, with the buffers it reads and writes.
pub(crate) struct GraphStep {
    bufs: Buffers,
    replay: Replay,
}

impl GraphStep {
    /// Captures `state`'s next decode step on `model` (`state` as the eager step leaves it).
    /// `None` where the step cannot be captured: no room left in the cache or the RoPE tables,
    /// a model whose cache pass is not the one kernel, or a capture the driver refused (then
    /// graphs are off for the process, said once on stderr).
    pub(crate) fn capture(model: &Transformer, state: &mut DecodeState) -> Result<Option<Self>> {
        let dev = model.device();
        if !enabled(dev) || !model.graphable() {
            return Ok(None);
        }
        let n = state.next_pos.dim(0)?;
        let len = state.cache.len();
        let capacity = state.cache.capacity();
        if len == 0 || len >= capacity || len >= model.max_positions() {
            return Ok(None);
        }
        // The buffers, made (and filled) before the capture. An f16 model's bias is clamped to
        // f16's mask value and kept in f16 here (the forward's own clamp would upload a scalar
        // inside the capture).
        let free = Tensor::zeros((n, capacity - len), DType::F32, dev)?;
        let bias = Tensor::cat(&[&state.key_bias.to_dtype(DType::F32)?, &free], 1)?;
        let bias = match model.dtype() {
            DType::F16 => bias
                .maximum(crate::model::attention_mask_value(DType::F16))?
                .to_dtype(DType::F16)?,
            _ => bias,
        };
        let bufs = Buffers {
            ids: Tensor::zeros(n, DType::U32, dev)?,
            pos: state.next_pos.copy()?,
            past: Tensor::new(&[len as u32], dev)?,
            bias,
            logits: state.logits.zeros_like()?,
            keys: match model.cfg.sliding_window {
                Some(_) => Some(
                    Tensor::arange(0u32, capacity as u32, dev)?
                        .to_dtype(DType::F32)?
                        .reshape((1, capacity))?,
                ),
                None => None,
            },
        };
        if dev.is_cpu() {
            CAPTURES.fetch_add(1, Ordering::Relaxed);
            return Ok(Some(Self {
                bufs,
                replay: Replay::Host,
            }));
        }
        Self::record(bufs, model, state)
    }

    #[cfg(not(feature = "cuda"))]
    fn record(_: Buffers, _: &Transformer, _: &mut DecodeState) -> Result<Option<Self>> {
        Ok(None)
    }

    #[cfg(feature = "cuda")]
    fn record(bufs: Buffers, model: &Transformer, state: &mut DecodeState) -> Result<Option<Self>> {
        use candle_core::cuda_backend::cudarc::driver::sys;

        let Device::Cuda(cd) = model.device() else {
            return Ok(None);
        };
        // candle uploads a strided op's dims and strides from a host vector that is freed when
        // the op returns: captured, that copy would read freed host memory at every replay.
        // candle's parameter cache keeps each such upload in a device buffer of its own that
        // outlives the graph, and refuses an upload it has not cached while a capture runs. A
        // warm-up run of the step, eager and under the cache, makes the uploads the capture
        // then finds; it writes the cache's keys and values at the position the first replay
        // writes again, and the buffers it advances are put back.
        let stream = cd.cuda_stream();
        let _params = cd.enable_cuda_graph_htod_cache();
        let (pos, past) = (bufs.pos.copy()?, bufs.past.copy()?);
        if let Err(e) = bufs.run(model, state) {
            return Ok(give_up(&format!("the warm-up step failed: {e}"), &stream));
        }
        bufs.pos.slice_set(&pos, 0, 0)?;
        bufs.past.slice_set(&past, 0, 0)?;
        model.device().synchronize()?;
        let mode = sys::CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL;
        if let Err(e) = stream.begin_capture(mode) {
            return Ok(give_up(&e.to_string(), &stream));
        }
        let ran = bufs.run(model, state);
        let ended = stream.end_capture(sys::CUgraphInstantiate_flags(0));
        let graph = match (ran, ended) {
            (Ok(()), Ok(Some(g))) => g,
            (Err(e), _) => return Ok(give_up(&e.to_string(), &stream)),
            (_, Err(e)) => return Ok(give_up(&e.to_string(), &stream)),
            (_, Ok(None)) => return Ok(give_up("nothing was recorded", &stream)),
        };
        let nodes = audit(&graph);
        if let Ok(mut last) = LAST_NODES.lock() {
            *last = nodes.summary();
        }
        if let Some(why) = nodes.unsafe_replay() {
            return Ok(give_up(&why, &stream));
        }
        if let Err(e) = graph.upload() {
            return Ok(give_up(&e.to_string(), &stream));
        }
        CAPTURES.fetch_add(1, Ordering::Relaxed);
        Ok(Some(Self {
            bufs,
            replay: Replay::Cuda(graph),
        }))
    }

    /// Whether the next step of `state` can be replayed: the same rows, room in the cache, a
    /// position within the RoPE tables (past them the eager step computes its cos and sin,
    /// where a CUDA replay, which runs no host code, would read past the tables). A sliding
    /// window's band the replay makes itself, from the cached length on the device.
    pub(crate) fn fits(&self, model: &Transformer, state: &DecodeState) -> bool {
        let (n, capacity) = self.bufs.bias.dims2().unwrap_or((0, 0));
        state.cache.len() < capacity
            && state.cache.len() < model.max_positions()
            && state.cache.capacity() == capacity
            && state.next_pos.dim(0).is_ok_and(|rows| rows == n)
    }

    /// One decode step of the rows' tokens `ids` `(n,)`: the graph replayed, the cache's count
    /// advanced, and `state.logits` the graph's logits (valid until the next replay).
    pub(crate) fn step(
        &self,
        model: &Transformer,
        state: &mut DecodeState,
        ids: &Tensor,
    ) -> Result<()> {
        self.bufs.ids.slice_set(&ids.to_dtype(DType::U32)?, 0, 0)?;
        match &self.replay {
            #[cfg(feature = "cuda")]
            Replay::Cuda(g) => g
                .launch()
                .map_err(|e| candle_core::Error::msg(format!("CUDA graph launch: {e}")))?,
            Replay::Host => {
                self.bufs.run(model, state)?;
                if CORRUPT.with(Cell::get) {
                    let bad = (&self.bufs.logits + 1.0)?;
                    self.bufs.logits.slice_set(&bad, 0, 0)?;
                }
            }
        }
        state.cache.set_len(state.cache.len() + 1);
        state.logits = self.bufs.logits.clone();
        REPLAYS.fetch_add(1, Ordering::Relaxed);
        Ok(())
    }

    /// Gives the step's state back to `state` as the eager step keeps it (before a compaction
    /// or an eager step): the rows' next positions, their key bias over the cached positions,
    /// the last logits as a tensor of their own.
    pub(crate) fn release(self, state: &mut DecodeState) -> Result<()> {
        state.key_bias = self.key_bias(state)?;
        state.next_pos = self.bufs.pos.copy()?;
        state.logits = self.bufs.logits.copy()?;
        Ok(())
    }

    /// The rows' key bias over the cached positions `(n, len)` f32, as the eager step keeps it
    /// (`state.key_bias` is stale while the graph runs the steps).
    pub(crate) fn key_bias(&self, state: &DecodeState) -> Result<Tensor> {
        self.bufs
            .bias
            .narrow(1, 0, state.cache.len())?
            .to_dtype(DType::F32)?
            .contiguous()
    }
}

/// The decode loop's side of the graphs: each step replays the captured step where it fits and
/// runs eagerly otherwise, capturing once one eager step has run at the batch's size. The first
/// replay in a dtype is checked against the eager step on the same state (its cache writes are
/// the replay's own: the same keys and values at the same positions); a replay that differs
/// turns graphs off, and the eager step's result stands.
#[derive(Default)]
pub(crate) struct Decoder {
    graph: Option<GraphStep>,
    eager_at_size: usize,
    off: bool,
}

impl Decoder {
    /// One decode step of the rows' tokens `ids`. A capture that is not possible (graphs off,
    /// a model without the one-kernel cache pass, a full cache) is not tried again in this
    /// decode loop.
    pub(crate) fn step(
        &mut self,
        model: &Transformer,
        state: &mut DecodeState,
        ids: &Tensor,
    ) -> Result<()> {
        if self.graph.is_none() && !self.off && self.eager_at_size > 0 {
            match GraphStep::capture(model, state)? {
                Some(g) => return self.first_replay(g, model, state, ids),
                None => self.off = true,
            }
        }
        match &self.graph {
            Some(g) if g.fits(model, state) => g.step(model, state, ids),
            _ => {
                self.release(state)?;
                self.eager_at_size += 1;
                state.decode_step(model, ids)
            }
        }
    }

    /// The first step of a graph just captured (it fits the state it was captured from): on a
    /// GPU, the first in its dtype in the process, and every one on the CPU (whose host replays
    /// are tests'), replayed and then checked against the eager step from the same state (its
    /// count put back); a replay that differs goes, and the eager step's state stands.
    fn first_replay(
        &mut self,
        g: GraphStep,
        model: &Transformer,
        state: &mut DecodeState,
        ids: &Tensor,
    ) -> Result<()> {
        let dt = model.dtype();
        let gpu = model.device().is_cuda();
        let checked = gpu && VERIFIED.lock().map(|v| v.contains(&dt)).unwrap_or(true);
        g.step(model, state, ids)?;
        if checked {
            self.graph = Some(g);
            return Ok(());
        }
        let replayed = state.logits.copy()?;
        state.cache.set_len(state.cache.len() - 1);
        state.decode_step(model, ids)?;
        let diff = grpo_core::selfcheck::rel_diff(&state.logits, &replayed)?;
        let limit = 2.5 * grpo_core::selfcheck::tolerance(dt);
        if diff <= limit {
            if gpu && let Ok(mut v) = VERIFIED.lock() {
                v.push(dt);
            }
            self.graph = Some(g);
            return Ok(());
        }
        self.off = true;
        switch_off(
            gpu,
            &format!(
                "a replayed step's logits differ from the eager step's by {diff:.2e} (limit \
                 {limit:.0e})"
            ),
        );
        Ok(())
    }

    /// Hands a running graph's state back to `state` (before the batch changes: a compaction,
    /// or the rows set aside whole).
    pub(crate) fn release(&mut self, state: &mut DecodeState) -> Result<()> {
        match self.graph.take() {
            Some(g) => g.release(state),
            None => Ok(()),
        }
    }

    /// Before a compaction: the state handed back, and the next size runs one eager step
    /// before its capture.
    pub(crate) fn resize(&mut self, state: &mut DecodeState) -> Result<()> {
        self.eager_at_size = 0;
        self.release(state)
    }

    /// The rows' key bias over the cached positions, `(n, len)` f32, whether or not a graph
    /// runs the steps.
    pub(crate) fn key_bias(&self, state: &DecodeState) -> Result<Tensor> {
        match &self.graph {
            Some(g) => g.key_bias(state),
            None => Ok(state.key_bias.clone()),
        }
    }
}

/// Graphs off for the process (for the GPUs: the CPU's host replays are tests'), with one line
/// on stderr.
fn switch_off(gpu: bool, why: &str) {
    if gpu {
        OFF.store(true, Ordering::Relaxed);
    }
    eprintln!(
        "grpo: decode steps are not replayed as CUDA graphs: {why}; decoding without them \
         (GRPO_CUDA_GRAPHS=0 does so on purpose)"
    );
}

/// The nodes of the last captured step by kind (kernels, copies, allocations, frees...), for
/// `grpo-cli check`'s graph row; empty before the first capture.
pub fn last_capture_nodes() -> String {
    LAST_NODES.lock().map(|s| s.clone()).unwrap_or_default()
}

static LAST_NODES: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

/// A captured graph's nodes by kind.
#[derive(Debug, Default, Clone, PartialEq)]
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
struct Nodes {
    kernels: usize,
    /// Copies whose source is host memory (a replay would read it again).
    host_copies: usize,
    device_copies: usize,
    memsets: usize,
    allocs: usize,
    frees: usize,
    other: usize,
    /// Why the nodes could not be read, if they could not.
    unreadable: Option<String>,
}

#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
impl Nodes {
    fn summary(&self) -> String {
        if let Some(e) = &self.unreadable {
            return format!("nodes unreadable: {e}");
        }
        format!(
            "{} kernels, {} device copies, {} host copies, {} memsets, {} allocations, {} \
             frees, {} other",
            self.kernels,
            self.device_copies,
            self.host_copies,
            self.memsets,
            self.allocs,
            self.frees,
            self.other
        )
    }

    /// Why replaying these nodes would be wrong: a copy from host memory (freed since the
    /// capture), or a free of memory the graph did not allocate (freed again at each replay).
    fn unsafe_replay(&self) -> Option<String> {
        if self.host_copies > 0 {
            return Some(format!(
                "the step copies from host memory ({})",
                self.summary()
            ));
        }
        if self.frees > self.allocs {
            return Some(format!(
                "the step frees memory it did not allocate ({})",
                self.summary()
            ));
        }
        None
    }
}

/// The kinds of `graph`'s nodes, read from the driver.
#[cfg(feature = "cuda")]
#[allow(unsafe_code)]
fn audit(graph: &candle_core::cuda_backend::cudarc::driver::CudaGraph) -> Nodes {
    use candle_core::cuda_backend::cudarc::driver::sys;
    use sys::CUgraphNodeType as T;
    let mut out = Nodes::default();
    let ok = |r: sys::CUresult| r == sys::CUresult::CUDA_SUCCESS;
    let g = graph.cu_graph();
    let mut n = 0usize;
    // SAFETY: `g` is the live graph `graph` owns; a null node array asks for the count only,
    // and the second call fills exactly `n` handles.
    if !ok(unsafe { sys::cuGraphGetNodes(g, std::ptr::null_mut(), &mut n) }) {
        out.unreadable = Some("cuGraphGetNodes failed".into());
        return out;
    }
    let mut nodes: Vec<sys::CUgraphNode> = vec![std::ptr::null_mut(); n];
    if !ok(unsafe { sys::cuGraphGetNodes(g, nodes.as_mut_ptr(), &mut n) }) {
        out.unreadable = Some("cuGraphGetNodes failed".into());
        return out;
    }
    for &node in &nodes[..n] {
        let mut kind = T::CU_GRAPH_NODE_TYPE_EMPTY;
        // SAFETY: `node` is one of `g`'s nodes, read into a local.
        if !ok(unsafe { sys::cuGraphNodeGetType(node, &mut kind) }) {
            out.unreadable = Some("cuGraphNodeGetType failed".into());
            return out;
        }
        match kind {
            T::CU_GRAPH_NODE_TYPE_KERNEL => out.kernels += 1,
            T::CU_GRAPH_NODE_TYPE_MEMCPY => {
                // SAFETY: a memcpy node's parameters, read into a zeroed plain-data struct.
                let mut p: sys::CUDA_MEMCPY3D = unsafe { std::mem::zeroed() };
                let read = ok(unsafe { sys::cuGraphMemcpyNodeGetParams(node, &mut p) });
                if !read || p.srcMemoryType == sys::CUmemorytype::CU_MEMORYTYPE_HOST {
                    out.host_copies += 1;
                } else {
                    out.device_copies += 1;
                }
            }
            T::CU_GRAPH_NODE_TYPE_MEMSET => out.memsets += 1,
            T::CU_GRAPH_NODE_TYPE_MEM_ALLOC => out.allocs += 1,
            T::CU_GRAPH_NODE_TYPE_MEM_FREE => out.frees += 1,
            _ => out.other += 1,
        }
    }
    out
}

/// A failed capture's aftermath: the stream out of capture mode, the error the driver recorded
/// cleared (so that later calls do not report it), graphs off for the process, one line on
/// stderr.
#[cfg(feature = "cuda")]
fn give_up<T>(
    why: &str,
    stream: &std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
) -> Option<T> {
    use candle_core::cuda_backend::cudarc::driver::sys;
    if stream
        .capture_status()
        .is_ok_and(|s| s != sys::CUstreamCaptureStatus::CU_STREAM_CAPTURE_STATUS_NONE)
    {
        let _ = stream.end_capture(sys::CUgraphInstantiate_flags(0));
    }
    let _ = stream.context().check_err();
    switch_off(
        true,
        &format!(
            "a decode step could not be captured ({})",
            why.lines().next().unwrap_or("")
        ),
    );
    None
}

#[cfg(test)]
mod tests {
    use super::Nodes;

    #[test]
    fn a_graph_that_copies_from_the_host_or_frees_outside_memory_is_not_replayed() {
        let sound = Nodes {
            kernels: 240,
            device_copies: 3,
            allocs: 40,
            frees: 40,
            ..Nodes::default()
        };
        assert_eq!(sound.unsafe_replay(), None);
        assert!(
            sound
                .summary()
                .starts_with("240 kernels, 3 device copies, 0 host copies")
        );
        let host = Nodes {
            host_copies: 1,
            ..sound.clone()
        };
        assert!(
            host.unsafe_replay()
                .unwrap()
                .contains("copies from host memory")
        );
        let frees = Nodes {
            frees: 41,
            ..sound.clone()
        };
        assert!(
            frees
                .unsafe_replay()
                .unwrap()
                .contains("frees memory it did not allocate")
        );
        let unreadable = Nodes {
            unreadable: Some("cuGraphGetNodes failed".into()),
            ..Nodes::default()
        };
        assert_eq!(
            unreadable.summary(),
            "nodes unreadable: cuGraphGetNodes failed"
        );
    }
}
