//! Read a dataset once through the shuffled stream and report rows/s and peak memory.
//!
//! ```text
//! cargo run --release -p grpo-data --example read_bench -- FILE [--no-shuffle] [--synth N]
//! ```
//! With `--synth N`, FILE is first written with N `arithmetic` problems (by its extension).

use std::time::Instant;

use grpo_data::synth::ArithmeticConfig;
use grpo_data::{Dataset, OpenOptions, Prompt, SampleStream, StreamConfig};

fn peak_rss_kib() -> Option<u64> {
    let status = std::fs::read_to_string("/proc/self/status").ok()?;
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    line.split_whitespace().nth(1)?.parse().ok()
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let Some(file) = args.first() else {
        return Err("usage: read_bench FILE [--no-shuffle] [--synth N]".into());
    };
    let shuffle = !args.iter().any(|a| a == "--no-shuffle");
    if let Some(i) = args.iter().position(|a| a == "--synth") {
        let n: u64 = args.get(i + 1).ok_or("--synth N")?.parse()?;
        let t = Instant::now();
        let cfg = ArithmeticConfig {
            n,
            seed: 1,
            ..Default::default()
        };
        cfg.write(std::path::Path::new(file))?;
        println!(
            "wrote {n} rows to {file} in {:.2}s",
            t.elapsed().as_secs_f64()
        );
    }
    let t = Instant::now();
    let data = Dataset::open(&[file], &OpenOptions::default())?;
    let opened = t.elapsed().as_secs_f64();
    let cfg = StreamConfig {
        shuffle,
        batch_size: 64,
        ..Default::default()
    };
    let mut stream = SampleStream::new(data.clone(), cfg)?;
    let t = Instant::now();
    let (mut rows, mut bytes) = (0u64, 0usize);
    while let Some(batch) = stream.next_batch()? {
        for s in &batch {
            rows += 1;
            bytes += match &s.prompt {
                Prompt::Text(t) => t.len(),
                Prompt::Conversation(m) => m.iter().map(|m| m.content.len()).sum(),
            };
        }
    }
    let secs = t.elapsed().as_secs_f64();
    assert_eq!(rows, data.len());
    println!(
        "{file}: {rows} rows, shuffle={shuffle}, {secs:.3}s = {:.0} rows/s ({:.1} MB prompts); open {opened:.3}s; peak RSS (VmHWM) {:.1} MiB",
        rows as f64 / secs,
        bytes as f64 / 1e6,
        peak_rss_kib().unwrap_or(0) as f64 / 1024.0
    );
    Ok(())
}
