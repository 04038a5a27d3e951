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
    let (device, dtype) = a.place.resolve()?;
    let m = grpo_rollout::load(&a.model, dtype, &device)?;
    let vocab = m.model.cfg.vocab_size as u32;
    // Generation: 4 prompts x 8 samples (the TRL bench shape), EOS suppressed.
    let prompt_ids: Vec<Vec<u32>> = (0..4u32)
        .map(|i| (0..16u32).map(|j| (i * 31 + j * 7 + 5) % vocab).collect())
        .collect();
    let groups = a.batch / 4;
    let params = SamplingParams {
        max_new_tokens: a.new_tokens,
        min_new_tokens: a.new_tokens,
        temperature: 1.0,
        seed: 1,
        ..Default::default()
    };
    let detached = m.model.detached();
    let mut gen_s = Vec::new();
    // Runs per phase: one warm-up, then `reps` timed.
    let gen_runs = if a.phase == "fwd-bwd" { 0 } else { a.reps + 1 };
    let fb_runs = if a.phase == "generate" { 0 } else { a.reps + 1 };
    for r in 0..gen_runs {
        let t = Instant::now();
        let out =
            grpo_rollout::generate(&detached, &m.tokenizer, &prompt_ids, groups.max(1), &params)?;
        let dt = t.elapsed().as_secs_f64();
        anyhow::ensure!(
            out.iter().all(|c| c.token_ids.len() == a.new_tokens),
            "generation stopped early"
        );
        if r > 0 {
            gen_s.push(dt);
        }
    }
    // Forward + backward of a log-prob loss on batch x seq_len tokens (last half scored).
    let mut tm = TrainableModel::full(&m.model)?;
    if a.gradient_checkpointing {
        tm.model.enable_gradient_checkpointing();
    }
    let ids: Vec<u32> = (0..a.batch * a.seq_len)
        .map(|i| ((i as u32).wrapping_mul(2_654_435_761) >> 7) % vocab)
        .collect();
    let ids = Tensor::from_vec(ids, (a.batch, a.seq_len), &device)?;
    let mask = Tensor::ones((a.batch, a.seq_len), DType::U32, &device)?;
    let mut fb_s = Vec::new();
    for r in 0..fb_runs {
        let t = Instant::now();
        let (lp, _) = tm
            .model
            .completion_logprobs(&ids, &mask, a.seq_len / 2, 1.0, false)?;
        let grads = tm.model.backward(&lp.mean_all()?.neg()?)?;
        let dt = t.elapsed().as_secs_f64();
        anyhow::ensure!(grads.get(tm.vars[0].1.as_tensor()).is_some(), "no gradient");
        if r > 0 {
            fb_s.push(dt);
        }
    }
    let g = median(gen_s.clone());
    // The matmul work of forward + backward: every row through the layers, the full L x L
    // score matrix (causal positions are masked, not skipped), the head on the scored half;
    // backward twice the forward.
    let (b, l) = (a.batch, a.seq_len);
    let fb_gflop = 3.0 * m.model.cfg.matmul_flops(b * l, b * l * l, b * (l / 2)) / 1e9;
    let fb = median(fb_s.clone());
    let mm = if fb_runs > 0 {
        Some(matmul_gflops())
    } else {
        None
    };
    println!(
        "{}",
        serde_json::json!({
            "impl": "grpo-rs",
            "params": m.model.cfg.num_parameters(),
            "threads": std::thread::available_parallelism().map(|n| n.get()).unwrap_or(1),
            "generate_s_median": g,
            "generate_s_all": gen_s,
            "generate_tokens_per_s": g.map(|g| (a.batch * a.new_tokens) as f64 / g),
            "fwd_bwd_s_median": fb,
            "fwd_bwd_s_all": fb_s,
            "fwd_bwd_gflop": fb_gflop,
            "fwd_bwd_gflop_per_s": fb.map(|t| fb_gflop / t),
            "matmul_gflop_per_s": mm,
            "fwd_bwd_matmul_fraction": fb.zip(mm).map(|(t, mm)| fb_gflop / t / mm),
            "peak_rss_mib": grpo_cli::trainer::peak_rss_mib(),
        })
    );
    Ok(())
}

/// candle's f32 matmul rate on this machine, GFLOP/s: the best of 20 timed 1024³ products
/// (as scripts/bench-vs-trl.sh measures torch's).
pub fn matmul_gflops() -> f64 {
    let n = 1024;
    let run = || -> Result<f64> {
        let x = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
        let y = Tensor::randn(0f32, 1.0, (n, n), &Device::Cpu)?;
        x.matmul(&y)?;
        let mut t = Vec::new();
        for _ in 0..20 {
            let s = Instant::now();
            x.matmul(&y)?;
            t.push(s.elapsed().as_secs_f64());
        }
        let best = t.into_iter().fold(f64::INFINITY, f64::min);
        Ok(2.0 * (n * n * n) as f64 / best / 1e9)
    };
    run().unwrap_or(f64::NAN)
}
