//! `grpo-cli plot RUN_DIR`: PNG curves of a run's `metrics.jsonl` (plotters, bitmap backend,
//! with an embedded DejaVu Sans font so no system font is needed).

use std::path::{Path, PathBuf};

use anyhow::{Context, Result, bail};
use plotters::prelude::*;
use plotters::style::FontStyle;

/// The panels of a GRPO run: (metric key, title).
pub const PANELS: [(&str, &str); 6] = [
    ("reward", "reward"),
    ("reward_std", "reward_std"),
    ("kl", "kl"),
    ("loss", "loss"),
    ("completions/mean_length", "completion length"),
    ("step_time", "step time (s)"),
];

/// The panels of a DPO run.
pub const DPO_PANELS: [(&str, &str); 6] = [
    ("loss", "loss"),
    ("rewards/margins", "rewards/margins"),
    ("rewards/accuracies", "rewards/accuracies"),
    ("rewards/chosen", "rewards/chosen"),
    ("rewards/rejected", "rewards/rejected"),
    ("step_time", "step time (s)"),
];

/// The panels of an SFT run.
pub const SFT_PANELS: [(&str, &str); 6] = [
    ("loss", "loss"),
    ("eval/loss", "eval/loss"),
    ("grad_norm", "grad_norm"),
    ("learning_rate", "learning_rate"),
    ("num_tokens", "tokens"),
    ("step_time", "step time (s)"),
];

static FONT: &[u8] = include_bytes!("../assets/DejaVuSans.ttf");

/// Reads `(step, value)` series of `key` from metrics.jsonl lines.
pub fn series(text: &str, key: &str) -> Vec<(f64, f64)> {
    text.lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| {
            let s = v.get("step")?.as_f64()?;
            let y = v.get(key)?.as_f64()?;
            y.is_finite().then_some((s, y))
        })
        .collect()
}

/// Writes `RUN_DIR/curves.png` (2 × 3 panels) and returns its path.
pub fn plot_run(run_dir: &Path) -> Result<PathBuf> {
    let metrics = run_dir.join("metrics.jsonl");
    let text = std::fs::read_to_string(&metrics).with_context(|| {
        format!(
            "{}: cannot read (is this a run directory?)",
            metrics.display()
        )
    })?;
    let panels = if !series(&text, "reward").is_empty() {
        PANELS
    } else if !series(&text, "rewards/margins").is_empty() {
        DPO_PANELS
    } else if !series(&text, "loss").is_empty() {
        SFT_PANELS
    } else {
        bail!(
            "{}: no step with a `reward` or `loss` metric to plot",
            metrics.display()
        );
    };
    // Registering twice is harmless; a bad font would be a build defect.
    let _ = plotters::style::register_font("sans-serif", FontStyle::Normal, FONT);
    let out = run_dir.join("curves.png");
    let draw = || -> std::result::Result<(), Box<dyn std::error::Error>> {
        let root = BitMapBackend::new(&out, (1500, 800)).into_drawing_area();
        root.fill(&WHITE)?;
        let areas = root.split_evenly((2, 3));
        for (area, (key, title)) in areas.iter().zip(panels) {
            let pts = series(&text, key);
            if pts.is_empty() {
                area.titled(&format!("{title}: not logged"), ("sans-serif", 18))?;
                continue;
            }
            let (x0, x1) = pts
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                    (a.min(p.0), b.max(p.0))
                });
            let (y0, y1) = pts
                .iter()
                .fold((f64::INFINITY, f64::NEG_INFINITY), |(a, b), p| {
                    (a.min(p.1), b.max(p.1))
                });
            let pad = ((y1 - y0) * 0.05).max(1e-9);
            let mut chart = ChartBuilder::on(area)
                .caption(title, ("sans-serif", 20))
                .margin(10)
                .x_label_area_size(30)
                .y_label_area_size(60)
                .build_cartesian_2d(x0..x1.max(x0 + 1.0), (y0 - pad)..(y1 + pad))?;
            chart
                .configure_mesh()
                .x_desc("step")
                .label_style(("sans-serif", 12))
                .draw()?;
            chart.draw_series(LineSeries::new(pts, &BLUE))?;
        }
        root.present()?;
        Ok(())
    };
    draw().map_err(|e| anyhow::anyhow!("{}: cannot draw: {e}", out.display()))?;
    Ok(out)
}
