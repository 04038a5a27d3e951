//! `grpo-cli bench-model`: generation and forward + backward speed of the policy model, the
//! Rust side of `scripts/bench_torch_model.py` (same workload, same weights).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::Result;
use candle_core::{DType, Device, Tensor};
use clap::Args;
use grpo_rollout::{SamplingParams, TrainableModel};

/// `grpo-cli bench-model`.
#[derive(Debug, Args)]
pub struct BenchModelArgs {
    /// A Hugging Face model directory (or .gguf file).
    #[arg(long)]
    model: PathBuf,
    /// Sequences per batch.
    #[arg(long, default_value_t = 32)]
    batch: usize,
    /// New tokens per sequence in the generation benchmark.
    #[arg(long, default_value_t = 64)]
    new_tokens: usize,
    /// Prompt tokens per sequence in the generation benchmark (4 distinct prompts).
    #[arg(long, default_value_t = 16)]
    prompt_len: usize,
    /// Sequence length of the forward + backward benchmark.
    #[arg(long, default_value_t = 80)]
    seq_len: usize,
    /// Timed repetitions (the median is reported; one warm-up run precedes them).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Which phases to run: `all`, `generate` or `fwd-bwd` (to profile one alone).
    #[arg(long, default_value = "all", value_parser = ["all", "generate", "fwd-bwd"])]
    phase: String,
    /// Forward + backward with gradient checkpointing (`train.gradient_checkpointing`).
    #[arg(long)]
    gradient_checkpointing: bool,
    #[command(flatten)]
    place: grpo_cli::DeviceArgs,
}

fn median(mut v: Vec<f64>) -> Option<f64> {
    v.sort_by(f64::total_cmp);
    v.get(v.len() / 2).copied()
}

pub fn bench_model(a: BenchModelArgs) -> Result<()> {
    anyhow::ensure!(a.new_tokens >= 2, "--new-tokens must be at least 2");
    anyhow::ensure!(a.prompt_len >= 1, "--prompt-len must be at least 1");
    let (device, dtype) = a.place.resolve()?;
    let m =
        grpo_rollout::load(&a.model, dtype, &device).and_then(grpo_rollout::LoadedModel::causal)?;
    let vocab = m.model.cfg.vocab_size as u32;
    // Generation: 4 prompts x (batch / 4) samples (the TRL bench shape), EOS suppressed.
    let prompt_ids: Vec<Vec<u32>> = (0..4u32)
        .map(|i| {
            (0..a.prompt_len as u32)
                .map(|j| (i * 31 + j * 7 + 5) % vocab)
                .collect()
        })
        .collect();
    let groups = a.batch / 4;
    let params = |n: usize| SamplingParams {
        max_new_tokens: n,
        min_new_tokens: n,
        temperature: 1.0,
        seed: 1,
        ..Default::default()
    };
    let detached = m.model.detached();
    // Runs per phase: one warm-up, then `reps` timed. The whole generation, then the prefill
    // alone (one new token): the difference is the decode steps.
    let gen_runs = if a.phase == "fwd-bwd" { 0 } else { a.reps + 1 };
    let fb_runs = if a.phase == "generate" { 0 } else { a.reps + 1 };
    let time_generation = |n: usize| -> Result<Vec<f64>> {
        let mut times = Vec::new();
        for r in 0..gen_runs {
            let t = Instant::now();
            let out = grpo_rollout::generate(
                &detached,
                &m.tokenizer,
                &prompt_ids,
                groups.max(1),
                &params(n),
            )?;
            let dt = t.elapsed().as_secs_f64();
            anyhow::ensure!(
                out.iter().all(|c| c.token_ids.len() == n),
                "generation stopped early"
            );
            if r > 0 {
                times.push(dt);
            }
        }
        Ok(times)
    };
    let gen_s = time_generation(a.new_tokens)?;
    let prefill_s = time_generation(1)?;
    // Where a decode step goes: layers, head, sampling, each waited for.
    let breakdown = if gen_runs > 0 {
        let prompts: Vec<&[u32]> = prompt_ids.iter().map(|p| p.as_slice()).collect();
        let counts = vec![groups.max(1); prompts.len()];
        let steps = (a.new_tokens - 1).min(32);
        Some(grpo_rollout::generate::decode_breakdown(
            &detached,
            &prompts,
            &counts,
            steps,
            &params(steps),
        )?)
    } else {
        None
    };
    // Forward + backward of a log-prob loss on batch x seq_len tokens (last half scored).
    let mut tm = TrainableModel::full(&m.model)?;
    if a.gradient_checkpointing {
        tm.model.enable_gradient_checkpointing();
    } else if grpo_rollout::model::layer_segments_wanted(&device) {
        tm.model.enable_layer_segments();
    }
    let ids: Vec<u32> = (0..a.batch * a.seq_len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 7) % vocab)
        .collect();
    let ids = Tensor::from_vec(ids, (a.batch, a.seq_len), &device)?;
    let mask = Tensor::ones((a.batch, a.seq_len), DType::U32, &device)?;
    let (mut fb_s, mut fwd_s) = (Vec::new(), Vec::new());
    // On a GPU the host only queues kernels: the time until a pass returns, before waiting for
    // the device, is the host's share. Close to the pass's whole time means the GPU waited
    // for the host (launch-bound), far below it means the GPU was the bound.
    let (mut fwd_issue, mut bwd_issue, mut bwd_s) = (Vec::new(), Vec::new(), Vec::new());
    let (mut fwd_tensors, mut bwd_tensors) = (0, 0);
    device.synchronize()?;
    // Resets the pool's peaks: the next read gives the forward + backward passes' own.
    grpo_core::memlog::pool_peaks_mib(&device);
    for r in 0..fb_runs {
        let t = Instant::now();
        let t0 = tensors_created(&device)?;
        let (lp, _) = tm
            .model
            .completion_logprobs(&ids, &mask, a.seq_len / 2, 1.0, false)?;
        let fwd_queued = t.elapsed().as_secs_f64();
        // Kernels run asynchronously on a GPU: wait for them before reading the clock.
        device.synchronize()?;
        let fwd = t.elapsed().as_secs_f64();
        let tb = Instant::now();
        let t1 = tensors_created(&device)?;
        let grads = tm.model.backward(&lp.mean_all()?.neg()?)?;
        let bwd_queued = tb.elapsed().as_secs_f64();
        let t2 = tensors_created(&device)?;
        (fwd_tensors, bwd_tensors) = (t1 - t0 - 1, t2 - t1 - 1);
        device.synchronize()?;
        let bwd = tb.elapsed().as_secs_f64();
        let dt = t.elapsed().as_secs_f64();
        anyhow::ensure!(grads.get(tm.vars[0].1.as_tensor()).is_some(), "no gradient");
        if r > 0 {
            fb_s.push(dt);
            fwd_s.push(fwd);
            fwd_issue.push(fwd_queued);
            bwd_issue.push(bwd_queued);
            bwd_s.push(bwd);
        }
    }
    device.synchronize()?;
    let pool_peaks = grpo_core::memlog::pool_peaks_mib(&device);
    // One more pass with each decoder layer's forward and backward timed on its own (layer
    // segments, switched on for this pass; each waited for): the layers' share of the learner
    // against the rest.
    let plain = tm.model.layer_blocks.is_none();
    let (layer_fwd, layer_bwd) =
        if fb_runs > 0 && (plain || tm.model.layer_blocks.as_ref().is_some_and(|b| !b.recompute)) {
            if plain {
                tm.model.enable_layer_segments();
            }
            grpo_core::recompute::set_segment_timing(true);
            let pass = (|| -> Result<()> {
                let (lp, _) =
                    tm.model
                        .completion_logprobs(&ids, &mask, a.seq_len / 2, 1.0, false)?;
                tm.model.backward(&lp.mean_all()?.neg()?)?;
                device.synchronize()?;
                Ok(())
            })();
            grpo_core::recompute::set_segment_timing(false);
            if plain {
                tm.model.layer_blocks = None;
            }
            pass?;
            let (f, b) = grpo_core::recompute::take_segment_times();
            (Some(f.iter().sum::<f64>()), Some(b.iter().sum::<f64>()))
        } else {
            (None, None)
        };
    let g = median(gen_s.clone());
    let p = median(prefill_s.clone());
    // The matmul work of forward + backward: every row through the layers, the full L x L
    // score matrix (causal positions are masked, not skipped), the head on the scored half;
    // backward twice the forward.
    let (b, l) = (a.batch, a.seq_len);
    let fb_gflop = 3.0 * m.model.cfg.matmul_flops(b * l, b * l * l, b * (l / 2)) / 1e9;
    let fb = median(fb_s.clone());
    let mm = if fb_runs > 0 {
        Some(matmul_peak_gflops(&device, dtype)?)
    } else {
        None
    };
    let batch = (groups.max(1) * 4) as f64;
    println!(
        "{}",
        serde_json::json!({
            "impl": "grpo-rs",
            "device": a.place.device,
            "dtype": a.place.dtype,
            "params": m.model.cfg.num_parameters(),
            "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "generate_s_median": g,
            "generate_s_all": gen_s,
            "generate_tokens_per_s": g.map(|g| batch * a.new_tokens as f64 / g),
            "prefill_s_median": p,
            "prefill_tokens_per_s": p.map(|p| batch * a.prompt_len as f64 / p),
            "decode_ms_per_step": g.zip(p).map(|(g, p)| (g - p) / (a.new_tokens - 1) as f64 * 1e3),
            "decode_layers_ms": breakdown.map(|b| b.layers_ms),
            "decode_head_ms": breakdown.map(|b| b.head_ms),
            "decode_sample_ms": breakdown.map(|b| b.sample_ms),
            // Decode steps captured as CUDA graphs (0: every step ran eagerly).
            "decode_graphs": grpo_rollout::graph::captures(),
            // The KV cache's bytes per token of one row (all layers).
            "kv_cache_bytes_per_token": m
                .model
                .cfg
                .kv_cache_values_per_token(grpo_rollout::mla::latent_cache(&device))
                * m.model.dtype().size_in_bytes(),
            "fwd_bwd_s_median": fb,
            "fwd_s_median": median(fwd_s),
            "bwd_s_median": median(bwd_s),
            "fwd_issue_s_median": median(fwd_issue),
            "bwd_issue_s_median": median(bwd_issue),
            "layers_fwd_s": layer_fwd,
            "layers_bwd_s": layer_bwd,
            "fwd_bwd_s_all": fb_s,
            "fwd_bwd_gflop": fb_gflop,
            "fwd_bwd_gflop_per_s": fb.map(|t| fb_gflop / t),
            "fwd_bwd_tflop_per_s": fb.map(|t| fb_gflop / t / 1e3),
            "matmul_gflop_per_s": mm,
            "fwd_bwd_matmul_fraction": fb.zip(mm).map(|(t, mm)| fb_gflop / t / mm),
            "peak_rss_mib": grpo_cli::trainer::peak_rss_mib(),
            // On a GPU: the allocation pool's peaks over the forward + backward passes, MiB
            // (live tensors; reserved, which is what the device shows in use).
            "fwd_bwd_pool_in_use_peak_mib": pool_peaks.map(|p| p.0),
            "fwd_bwd_pool_reserved_peak_mib": pool_peaks.map(|p| p.1),
            // Taped layer blocks that fell back to segments (an op inside did not record).
            "tape_fallbacks": grpo_core::recompute::tape_fallbacks(),
            // Tensors (op results and views) one forward / one backward creates: the host's
            // work per pass, on any device (each op result is an allocation and a launch on a GPU).
            "fwd_tensors": fwd_tensors,
            "bwd_tensors": bwd_tensors,
        })
    );
    Ok(())
}

/// How many tensors this process has created so far (candle numbers them in order).
fn tensors_created(device: &Device) -> Result<usize> {
    let id = format!("{:?}", Tensor::zeros((), DType::U8, device)?.id());
    id.trim_start_matches("TensorId(")
        .trim_end_matches(')')
        .parse()
        .map_err(|_| anyhow::anyhow!("unexpected tensor id {id}"))
}

/// The matrix-product rate candle reaches on `device` in `dtype`, GFLOP/s: the best of 20
/// timed square products (1024 on the CPU, as scripts/bench-vs-trl.sh measures torch's; 8192
/// on a GPU, large enough to fill it), each waited for.
pub fn matmul_peak_gflops(device: &Device, dtype: DType) -> Result<f64> {
    let n = if device.is_cpu() { 1024 } else { 8192 };
    let x = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    let y = Tensor::randn(0f32, 1.0, (n, n), device)?.to_dtype(dtype)?;
    x.matmul(&y)?;
    device.synchronize()?;
    let mut best = f64::INFINITY;
    for _ in 0..20 {
        let s = Instant::now();
        let z = x.matmul(&y)?;
        device.synchronize()?;
        best = best.min(s.elapsed().as_secs_f64());
        drop(z);
    }
    Ok(2.0 * (n * n * n) as f64 / best / 1e9)
}
