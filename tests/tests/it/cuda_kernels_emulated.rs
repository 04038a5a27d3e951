//! The fused ops' CUDA kernels (`grpo-rollout/src/kernels.cu`, `grpo-core/src/head.cu`, the
//! 8-bit optimizer state's `grpo-core/src/quant.cu`, after
//! `grpo-core/src/cuda_prelude.cu`), their own source, run on the
//! host under an emulation of the CUDA built-ins (`tests/cuda_emulation`: a thread per CUDA
//! thread, barriers for `__syncthreads` and warp shuffles), launched as `grpo-rollout/src/cuda.rs`
//! launches them, against the candle compositions on the CPU: values and gradients, in f32, bf16
//! and f16, on shapes with partial warps, several rows per block, a strided KV-cache view,
//! masked keys and grouped-query heads — each run twice, the threads resumed in opposite
//! orders, the two outputs required to be the same bits (a race would differ), under
//! AddressSanitizer where the compiler has it (a read or write past a buffer stops it). What this cannot see (the PTX compiler, the driver, real
//! concurrency) `grpo-cli check --device cuda` checks on a GPU.
//!
//! Needs a C++20 compiler (`$CXX`, else `c++`); without one the tests say so and pass.
#![allow(clippy::unwrap_used, missing_docs)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

use candle_core::{DType, Device, Tensor, Var};
use grpo_rollout::fused;

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The harness binary, compiled once per test process (None: no C++ compiler here), and
/// whether it runs under AddressSanitizer.
fn harness_build() -> Option<&'static (PathBuf, bool)> {
    static BIN: OnceLock<Option<(PathBuf, bool)>> = OnceLock::new();
    BIN.get_or_init(|| {
        let cxx = std::env::var("CXX").unwrap_or_else(|_| "c++".into());
        // Compiled beside the test binaries, under a name of this process's, then renamed.
        let dir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("cuda-emulation");
        std::fs::create_dir_all(&dir).unwrap();
        let bin = dir.join("harness");
        let fresh = dir.join(format!("harness-{}", std::process::id()));
        let r = root();
        let compile = |extra: &[&str]| {
            Command::new(&cxx)
                .args(extra)
                .args(["-std=c++20", "-O1", "-fno-strict-aliasing", "-o"])
                .arg(&fresh)
                .arg(r.join("tests/cuda_emulation/harness.cpp"))
                .arg(format!("-I{}", r.join("grpo-rollout/src").display()))
                .arg(format!("-I{}", r.join("grpo-core/src").display()))
                .arg(format!("-I{}", r.join("tests/cuda_emulation").display()))
                .output()
        };
        // With AddressSanitizer where the compiler has it: a kernel that reads or writes past
        // a buffer (an illegal address, or garbage, on a GPU) stops the harness.
        let asan = ["-fsanitize=address", "-fno-omit-frame-pointer", "-g"];
        let (out, sanitized) = match compile(&asan) {
            Ok(o) if o.status.success() => (Ok(o), true),
            Ok(_) => {
                eprintln!("note: the harness runs without AddressSanitizer (`{cxx}` lacks it)");
                (compile(&[]), false)
            }
            Err(e) => (Err(e), false),
        };
        match out {
            Ok(o) if o.status.success() => {
                std::fs::rename(&fresh, &bin).unwrap();
                Some((bin, sanitized))
            }
            Ok(o) => panic!(
                "the kernels do not compile under the emulation:\n{}",
                String::from_utf8_lossy(&o.stderr)
            ),
            Err(e) => {
                eprintln!("skipped: no C++ compiler `{cxx}` ({e})");
                None
            }
        }
    })
    .as_ref()
}

/// The harness binary (None: no C++ compiler here).
fn harness() -> Option<&'static Path> {
    harness_build().map(|(bin, _)| bin.as_path())
}

/// Runs `op` in `dtype` on `inputs` (written as f32) with `args`; the output as f32.
fn run(op: &str, dtype: &str, args: &[String], inputs: &[&Tensor]) -> Option<Vec<f32>> {
    let bin = harness()?;
    let dir = tempfile::tempdir().unwrap();
    for (i, t) in inputs.iter().enumerate() {
        let v: Vec<f32> = t.flatten_all().unwrap().to_vec1().unwrap();
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        std::fs::write(dir.path().join(format!("in{i}.f32")), bytes).unwrap();
    }
    // Twice: the scheduler resuming threads by index, then last first. A kernel whose bits
    // differ reads what another thread writes with no barrier between (a race on a GPU).
    let [forward, reverse] =
        ["forward", "reverse"].map(|order| run_in(bin, op, dtype, dir.path(), args, order));
    assert!(
        forward == reverse,
        "harness {op} {dtype} {args:?}: the output depends on the order threads run in (a race)"
    );
    Some(forward)
}

/// One harness run with the scheduler's thread order (`GPU_EMU_ORDER`); its output as f32.
fn run_in(bin: &Path, op: &str, dtype: &str, dir: &Path, args: &[String], order: &str) -> Vec<f32> {
    // Its stderr (AddressSanitizer's note on fibers at every start) only when it fails.
    let out = Command::new(bin)
        .arg(op)
        .arg(dtype)
        .arg(dir)
        .args(args)
        .env("GPU_EMU_ORDER", order)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "harness {op} {dtype} failed ({order} order):\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let bytes = std::fs::read(dir.join("out.f32")).unwrap();
    bytes
        .chunks(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

#[test]
fn the_emulation_shows_races_unwritten_shared_memory_exited_lanes_and_overflows() {
    let Some(bin) = harness() else { return };
    let dir = tempfile::tempdir().unwrap();
    // Each thread reads its neighbour's slot with no barrier after the writes; block 1 reads
    // what block 0 writes.
    for probe in ["probe_race", "probe_blocks"] {
        let [forward, reverse] =
            ["forward", "reverse"].map(|o| run_in(bin, probe, "f32", dir.path(), &[], o));
        assert_ne!(
            forward.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            reverse.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            "{probe}: the two orders must tell a race"
        );
    }
    // Slot 0 of the dynamic shared memory is read by every thread and written by none.
    let stale = run_in(bin, "probe_unwritten", "f32", dir.path(), &[], "forward");
    assert!(stale.iter().all(|x| x.is_nan()), "{stale:?}");
    // A warp-wide shuffle after half the warp returned: the emulation stops with an error.
    let out = Command::new(bin)
        .args(["probe_exited", "f32"])
        .arg(dir.path())
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(3), "{out:?}");
    assert!(
        String::from_utf8_lossy(&out.stderr).contains("16 of 32 lanes present"),
        "{out:?}"
    );
    // The last thread reads one element past its buffer: AddressSanitizer stops the harness.
    if harness_build().is_some_and(|(_, sanitized)| *sanitized) {
        let out = Command::new(bin)
            .args(["probe_overflow", "f32"])
            .arg(dir.path())
            .output()
            .unwrap();
        assert!(!out.status.success(), "{out:?}");
        assert!(
            String::from_utf8_lossy(&out.stderr).contains("heap-buffer-overflow"),
            "{out:?}"
        );
    }
}

const DTYPES: [(&str, DType, f32); 3] = [
    ("f32", DType::F32, 2e-5),
    ("bf16", DType::BF16, 2e-2),
    ("f16", DType::F16, 3e-3),
];

/// Random normal f32 tensor (seeded), rounded through `dt` so both sides see the same values.
fn randn(shape: &[usize], dt: DType, seed: u64) -> Tensor {
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(seed);
    let n: usize = shape.iter().product();
    let v: Vec<f32> = (0..n)
        .map(|_| {
            // Box–Muller.
            let (u1, u2): (f64, f64) = (rng.random::<f64>().max(1e-12), rng.random::<f64>());
            ((-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos()) as f32
        })
        .collect();
    Tensor::from_vec(v, shape, &Device::Cpu)
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap()
}

fn flat(t: &Tensor) -> Vec<f32> {
    t.flatten_all().unwrap().to_vec1().unwrap()
}

/// Every element within `tol · (1 + |want|)`.
fn close(what: &str, got: &[f32], want: &[f32], tol: f32) {
    assert_eq!(got.len(), want.len(), "{what}: length");
    let mut worst = (0.0f32, 0usize);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        let e = (g - w).abs() / (1.0 + w.abs());
        if e.is_nan() || e > worst.0 {
            worst = (if e.is_nan() { f32::INFINITY } else { e }, i);
        }
    }
    assert!(
        worst.0 <= tol,
        "{what}: element {} is {} where the composition gives {} (tolerance {tol})",
        worst.1,
        got[worst.1],
        want[worst.1]
    );
}

fn s(v: impl ToString) -> String {
    v.to_string()
}

#[test]
fn rms_norm_forward_and_backward_match_the_composition() {
    // h = 300: a partial last warp; 7 rows over 3 blocks in the backward (several rows per
    // block, a block with fewer rows). h = 2,100: rows above what the backward holds in
    // registers (its loop over the row).
    let (rows, eps) = (7, 1e-6);
    for (h, (name, dt, tol)) in [300usize, 2100]
        .into_iter()
        .flat_map(|h| DTYPES.into_iter().map(move |d| (h, d)))
    {
        let x = randn(&[rows, h], dt, 1);
        let w = randn(&[h], dt, 2);
        let g = randn(&[rows, h], dt, 3);
        let args = [s(rows), s(h), s(eps)];
        let Some(y) = run("rms_fwd", name, &args, &[&x, &w]) else {
            return;
        };
        let want = fused::rms_norm_composed(&x, &w, eps).unwrap();
        close(&format!("rms_norm {name}"), &y, &flat(&want), tol);

        let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let loss = (fused::rms_norm_composed(&xv, &wv, eps).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let (dx, dw) = (grads.get(&xv).unwrap(), grads.get(&wv).unwrap());
        for blocks in [1, 3, rows] {
            let args = [s(rows), s(h), s(eps), s(blocks)];
            let out = run("rms_bwd", name, &args, &[&x, &w, &g]).unwrap();
            let (gx, gw) = out.split_at(rows * h);
            close(&format!("rms_norm dx {name}"), gx, &flat(dx), tol * 2.0);
            // dw sums `rows` products: its rounding grows with them.
            close(
                &format!("rms_norm dw {name} ({blocks} blocks)"),
                gw,
                &flat(dw),
                tol * 4.0,
            );
        }
    }
}

fn rope_tables(b: usize, l: usize, d: usize, dt: DType) -> (Tensor, Tensor) {
    let theta = (randn(&[b, l, d / 2], DType::F32, 9) * 3.0).unwrap();
    let c = theta
        .cos()
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let s = theta
        .sin()
        .unwrap()
        .to_dtype(dt)
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    (c, s)
}

#[test]
fn rope_forward_and_inverse_match_the_composition() {
    let (b, l, h, d) = (2, 5, 3, 12);
    for (name, dt, tol) in DTYPES {
        let x = randn(&[b, l, h, d], dt, 4);
        let (c, sn) = rope_tables(b, l, d, dt);
        let args = [s(b), s(l), s(h), s(d), s(0)];
        let Some(y) = run("rope", name, &args, &[&x, &c, &sn]) else {
            return;
        };
        let want = fused::rope_composed(&x, &c, &sn).unwrap();
        close(&format!("rope {name}"), &y, &flat(&want), tol);

        // The inverse is the backward: (B, H, L, D) → (B, L, H, D), rotated by −θ.
        let xv = Var::from_tensor(&x).unwrap();
        let g = randn(&[b, h, l, d], dt, 5);
        let loss = (fused::rope_composed(&xv, &c, &sn).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap();
        let dx = loss.backward().unwrap().get(&xv).unwrap().clone();
        let args = [s(b), s(l), s(h), s(d), s(1)];
        let got = run("rope", name, &args, &[&g, &c, &sn]).unwrap();
        close(&format!("rope backward {name}"), &got, &flat(&dx), tol);

        // cos = 1, sin = 0: the storage type's loads and stores round-trip exactly.
        let ones = Tensor::ones((b, l, d / 2), DType::F32, &Device::Cpu).unwrap();
        let zeros = ones.zeros_like().unwrap();
        let args = [s(b), s(l), s(h), s(d), s(0)];
        let got = run("rope", name, &args, &[&x, &ones, &zeros]).unwrap();
        let moved = x.transpose(1, 2).unwrap().contiguous().unwrap();
        assert_eq!(
            got,
            flat(&moved),
            "rope {name}: identity rotation must be exact"
        );
    }
}

#[test]
fn silu_mul_forward_and_backward_match_the_composition() {
    let n = 1000; // not a multiple of the block
    for (name, dt, tol) in DTYPES {
        let a = (randn(&[n], dt, 6) * 3.0).unwrap();
        let a = a.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
        let u = randn(&[n], dt, 7);
        let g = randn(&[n], dt, 8);
        let Some(y) = run("silu_fwd", name, &[], &[&a, &u]) else {
            return;
        };
        close(
            &format!("silu_mul {name}"),
            &y,
            &flat(&fused::silu_mul_composed(&a, &u).unwrap()),
            tol,
        );
        let (av, uv) = (Var::from_tensor(&a).unwrap(), Var::from_tensor(&u).unwrap());
        let loss = (fused::silu_mul_composed(&av, &uv).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let out = run("silu_bwd", name, &[], &[&a, &u, &g]).unwrap();
        let (da, du) = out.split_at(n);
        close(
            &format!("silu_mul da {name}"),
            da,
            &flat(grads.get(&av).unwrap()),
            tol,
        );
        close(
            &format!("silu_mul du {name}"),
            du,
            &flat(grads.get(&uv).unwrap()),
            tol,
        );
    }
}

/// A causal + padding bias `(B, 1, L, S)`: 0 where a query may attend, −1e9 elsewhere, the
/// queries being the last `L` of `S` positions and row `b` left-padded by `b` positions.
fn bias(b: usize, l: usize, s: usize) -> Tensor {
    padded_bias(b, l, s, false)
}

/// [`bias`]; with `own`, a query at a padding position sees itself (as the model's masks keep
/// every row finite), so that no row is masked whole.
fn padded_bias(b: usize, l: usize, s: usize, own: bool) -> Tensor {
    let mut v = Vec::with_capacity(b * l * s);
    for bi in 0..b {
        for i in 0..l {
            let pos = s - l + i;
            for j in 0..s {
                let seen = j <= pos && (j >= bi || (own && j == pos));
                v.push(if seen { 0.0f32 } else { -1e9 });
            }
        }
    }
    Tensor::from_vec(v, (b, 1, l, s), &Device::Cpu).unwrap()
}

#[test]
fn attention_softmax_forward_and_backward_match_the_composition() {
    let (b, h, l, sl) = (2, 3, 4, 70);
    let scale = 0.125;
    for (name, dt, tol) in DTYPES {
        let x = (randn(&[b, h, l, sl], dt, 10) * 4.0).unwrap();
        let x = x.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
        let m = bias(b, l, sl);
        let args = [s(b), s(h), s(l), s(sl), s(scale)];
        let Some(p) = run("softmax_fwd", name, &args, &[&x, &m]) else {
            return;
        };
        let want = fused::attention_softmax_composed(&x, &m, scale).unwrap();
        close(&format!("attention_softmax {name}"), &p, &flat(&want), tol);

        let g = randn(&[b, h, l, sl], dt, 11);
        let xv = Var::from_tensor(&x).unwrap();
        let loss = (fused::attention_softmax_composed(&xv, &m, scale).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap();
        let dx = loss.backward().unwrap().get(&xv).unwrap().clone();
        let pt = want.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
        let args = [s(b * h * l), s(sl), s(scale)];
        let got = run("softmax_bwd", name, &args, &[&pt, &g]).unwrap();
        close(
            &format!("attention_softmax backward {name}"),
            &got,
            &flat(&dx),
            tol,
        );
    }
}

#[test]
fn attention_over_a_strided_cache_matches_the_composition() {
    // Grouped query heads (6 over 2), a cache of capacity 50 holding 37 positions (a strided
    // view), one query row (a decode step) and three (a short prefill), head dim 40 (a partial
    // warp), left padding and causal masking through the bias.
    // Then a decode step of the 0.77B model's shape: head dim 128, 6 query heads per kv head,
    // 300 cached positions of 320 (two tiles of keys).
    // And 18 query heads on one kv head (blocks of 8, 8 and 2 heads) with head dim 160.
    for (b, nh, nkv, d, cap, l, sl) in [
        (2, 6, 2, 40, 50, 1, 37),
        (2, 6, 2, 40, 50, 3, 37),
        (2, 6, 2, 40, 50, 1, 5),
        (2, 6, 1, 128, 320, 1, 300),
        (2, 18, 1, 160, 40, 2, 30),
        // Head dim 36: rows of 16-bit keys that 16-byte loads cannot take (read one by one).
        (2, 6, 2, 36, 50, 1, 37),
    ] {
        for (name, dt, tol) in DTYPES {
            let q = randn(&[b, nh, l, d], dt, 12);
            let kc = randn(&[b, nkv, cap, d], dt, 13);
            let vc = randn(&[b, nkv, cap, d], dt, 14);
            let m = bias(b, l, sl);
            let scale = 1.0 / (d as f64).sqrt();
            let args = [b, nh, nkv, l, sl, d, cap].map(s);
            let mut args = args.to_vec();
            args.push(s(scale));
            let Some(got) = run("attention", name, &args, &[&q, &kc, &vc, &m]) else {
                return;
            };
            let k = kc.narrow(2, 0, sl).unwrap();
            let v = vc.narrow(2, 0, sl).unwrap();
            let want = fused::attention_composed(&q, &k, &v, &m, scale).unwrap();
            close(
                &format!("attention {name} (L {l}, S {sl})"),
                &got,
                &flat(&want),
                tol,
            );
            // Masked keys carry no weight: row 1 is left-padded by one position, so its key 0
            // is masked, and a key 0 of 50s there changes nothing; a key 1 of 50s (visible)
            // changes row 1's outputs.
            let big = Tensor::full(50f32, (1, nkv, 1, d), &Device::Cpu).unwrap();
            let masked = kc.slice_assign(&[1..2, 0..nkv, 0..1, 0..d], &big).unwrap();
            let again = run("attention", name, &args, &[&q, &masked, &vc, &m]).unwrap();
            assert_eq!(again, got, "attention {name}: a masked key mattered");
            let visible = kc.slice_assign(&[1..2, 0..nkv, 1..2, 0..d], &big).unwrap();
            let again = run("attention", name, &args, &[&q, &visible, &vc, &m]).unwrap();
            let half = l * nh * d;
            assert_eq!(
                &again[..half],
                &got[..half],
                "attention {name}: row 0 moved"
            );
            assert_ne!(
                &again[half..],
                &got[half..],
                "attention {name}: a visible key did not"
            );
        }
    }
}

#[test]
fn flash_attention_forward_and_backward_match_the_composition() {
    // Training lengths on the tensor cores (mma.m16n8k16 emulated with the PTX ISA's fragment
    // layout): grouped query heads, keys and values as a strided cache view (capacity past S),
    // partial query and key tiles (70 = 64 + 6; 33), causal + left-padding masks where padded
    // query rows see only masked keys, head dims 64 and 128, 16-byte, 32-bit and 16-bit row
    // loads.
    // Reference: the f32 composition on the same (rounded) inputs and its autograd gradients.
    // Then a prefill after 83 cached positions (17 queries over 100 keys) with the 0.77B
    // model's head grouping (6 query heads per kv head) and head dim.
    // With `causal`, key tiles above the diagonal are skipped (130 rows: three blocks of 64;
    // a prefill after cached positions): rows with a visible key must not change, and a row
    // with none (a padded position) is left out of the comparison, its gradient zero as in the
    // model. Head dim 128 with 16-byte rows: dk/dv's prefetching loop, causal steps included.
    for (b, nh, nkv, l, sl, d, cap, align, causal) in [
        (2, 4, 2, 70, 70, 64, 75, 8, false),
        (2, 4, 2, 70, 70, 64, 75, 1, false),
        (3, 6, 2, 33, 33, 128, 33, 2, false),
        (2, 6, 1, 17, 100, 128, 128, 8, false),
        (2, 4, 2, 130, 130, 64, 130, 8, true),
        (2, 6, 1, 80, 150, 64, 150, 2, true),
        (1, 4, 2, 130, 130, 128, 130, 8, true),
    ] {
        for (name, dt, tol) in DTYPES.into_iter().filter(|c| c.1 != DType::F32) {
            let seed = (l + sl + d + align) as u64;
            let q = randn(&[b, nh, l, d], dt, seed);
            let kc = randn(&[b, nkv, cap, d], dt, seed + 1);
            let vc = randn(&[b, nkv, cap, d], dt, seed + 2);
            // The model's mask value: −1e9 would be −inf in f16.
            let masked = grpo_rollout::model::attention_mask_value(dt);
            let m = bias(b, l, sl).affine(masked / -1e9, 0.0).unwrap();
            // Rows whose every key is masked.
            let dead: Vec<bool> = m
                .flatten_to(2)
                .unwrap()
                .to_vec2::<f32>()
                .unwrap()
                .iter()
                .map(|r| r.iter().all(|&x| x < -1.0))
                .collect();
            let live = Tensor::from_vec(
                dead.iter().map(|&d| if d { 0f32 } else { 1.0 }).collect(),
                (b * l, 1),
                &Device::Cpu,
            )
            .unwrap();
            let mut dout = randn(&[b * l, nh * d], dt, seed + 3);
            if causal {
                dout = dout.broadcast_mul(&live).unwrap();
            }
            let scale = 1.0 / (d as f64).sqrt();
            let mut args = [b, nh, nkv, l, sl, d, cap].map(s).to_vec();
            args.push(s(scale));
            args.push(s(align));
            args.push(s(u8::from(causal)));
            let Some(fwd) = run("flash_fwd", name, &args, &[&q, &kc, &vc, &m]) else {
                return;
            };
            let what = format!(
                "flash attention {name} (L {l}, S {sl}, D {d}, align {align}, causal {causal})"
            );
            let (qv, kv, vv) = (
                Var::from_tensor(&q).unwrap(),
                Var::from_tensor(&kc.narrow(2, 0, sl).unwrap()).unwrap(),
                Var::from_tensor(&vc.narrow(2, 0, sl).unwrap()).unwrap(),
            );
            let want = fused::attention_composed(&qv, &kv, &vv, &m, scale).unwrap();
            let n = b * l * nh * d;
            let rows_of = |v: &[f32]| -> Vec<f32> {
                v.chunks(nh * d)
                    .zip(&dead)
                    .filter(|(_, dead)| !causal || !**dead)
                    .flat_map(|(r, _)| r.to_vec())
                    .collect()
            };
            close(&what, &rows_of(&fwd[..n]), &rows_of(&flat(&want)), tol);
            // The stats: each row's maximum and 1 / Σ exp, finite for every row.
            let stats = &fwd[n..];
            assert_eq!(stats.len(), b * nh * l * 2, "{what}: stats");
            assert!(
                stats
                    .chunks(2)
                    .all(|r| r[0].is_finite() && r[1] > 0.0 && r[1] <= 1.0),
                "{what}: stats out of range"
            );

            let grads = (want * &dout)
                .unwrap()
                .sum_all()
                .unwrap()
                .backward()
                .unwrap();
            let got = run("flash_bwd", name, &args, &[&q, &kc, &vc, &m, &dout]).unwrap();
            let (nq, nk) = (n, b * nkv * sl * d);
            assert_eq!(got.len(), nq + 2 * nk, "{what}: gradient sizes");
            close(
                &format!("{what}: dq"),
                &got[..nq],
                &flat(grads.get(&qv).unwrap()),
                tol,
            );
            close(
                &format!("{what}: dk"),
                &got[nq..nq + nk],
                &flat(grads.get(&kv).unwrap()),
                tol,
            );
            close(
                &format!("{what}: dv"),
                &got[nq + nk..],
                &flat(grads.get(&vv).unwrap()),
                tol,
            );
        }
    }
}

/// Runs the emulated `cached_attention` kernel and checks it against the CPU's
/// [`fused::cached_attention`] (rope, two kv_writes and attention on views of the packed
/// projections) and, to the bit, against the emulated kernels of those ops one after another.
fn check_cached_attention(dims: [usize; 7], dt: DType, name: &str, tol: f32, seed: u64) -> bool {
    let [b, nh, nkv, l, past, d, cap] = dims;
    let sl = past + l;
    let qkv = randn(&[b, l, nh + 2 * nkv, d], dt, seed);
    let kc = randn(&[b, nkv, cap, d], dt, seed + 1);
    let vc = randn(&[b, nkv, cap, d], dt, seed + 2);
    let (c, sn) = rope_tables(b, l, d, dt);
    let m = padded_bias(b, l, sl, true);
    let scale = 1.0 / (d as f64).sqrt();
    let mut args = [b, nh, nkv, l, past, d, cap].map(s).to_vec();
    args.push(s(scale));
    let Some(got) = run(
        "cached_attention",
        name,
        &args,
        &[&qkv, &kc, &vc, &c, &sn, &m],
    ) else {
        return false;
    };
    let what = format!("cached_attention {name} b {b} heads {nh}/{nkv} L {l} past {past} D {d}");
    let n = b * l * nh * d;
    let (ctx, caches) = got.split_at(n);
    let (gk, gv) = caches.split_at(b * nkv * cap * d);
    let (wk, wv) = (kc.copy().unwrap(), vc.copy().unwrap());
    let want = fused::cached_attention(&qkv, None, &wk, &wv, &c, &sn, &m, past, nh, scale).unwrap();
    close(&format!("{what}: context"), ctx, &flat(&want), tol * 2.0);
    close(&format!("{what}: keys"), gk, &flat(&wk), tol);
    assert_eq!(gv, &flat(&wv)[..], "{what}: values must move unchanged");

    // The ops it replaces, as their own kernels: the same bits.
    let part = |at: usize, h: usize| qkv.narrow(2, at, h).unwrap().contiguous().unwrap();
    let q = run(
        "rope",
        name,
        &[b, l, nh, d, 0].map(s),
        &[&part(0, nh), &c, &sn],
    )
    .unwrap();
    let q = Tensor::from_vec(q, (b, nh, l, d), &Device::Cpu).unwrap();
    let write = |cache: &Tensor, x: &Tensor, rotate: usize| {
        let args = [b, l, nkv, d, cap, past, rotate].map(s);
        let v = run("kv_write", name, &args, &[cache, x, &c, &sn]).unwrap();
        Tensor::from_vec(v, (b, nkv, cap, d), &Device::Cpu).unwrap()
    };
    let k2 = write(&kc, &part(nh, nkv), 1);
    let v2 = write(&vc, &part(nh + nkv, nkv), 0);
    let mut args = [b, nh, nkv, l, sl, d, cap].map(s).to_vec();
    args.push(s(scale));
    let ctx2 = run("attention", name, &args, &[&q, &k2, &v2, &m]).unwrap();
    assert_eq!(
        ctx,
        &ctx2[..],
        "{what}: context differs from rope + kv_write + attention"
    );
    assert_eq!(gk, &flat(&k2)[..], "{what}: keys differ from kv_write's");

    // As a decode step captured in a CUDA graph launches it: the cached length read from
    // device memory (the argument says 0), the bias `cap` wide with rows `cap` apart.
    // The columns past `past + L` hold NaN: reading one would show.
    let wide = {
        let nan = Tensor::full(f32::NAN, (b, 1, l, cap - sl), &Device::Cpu).unwrap();
        Tensor::cat(&[&m, &nan], 3).unwrap()
    };
    let mut args = [b, nh, nkv, l, past, d, cap].map(s).to_vec();
    args.push(s(scale));
    args.push(s(1));
    let graphed = run(
        "cached_attention",
        name,
        &args,
        &[&qkv, &kc, &vc, &c, &sn, &wide],
    )
    .unwrap();
    let (gctx, gcaches) = graphed.split_at(n);
    close(&format!("{what}: graphed context"), gctx, ctx, tol);
    assert_eq!(gcaches, caches, "{what}: graphed cache writes differ");

    // With the packed projection's bias given to the kernel (added as q, k, v are read): the
    // same bits as the pass over q/k/v with the bias added first, in the storage type.
    let pb = randn(&[(nh + 2 * nkv) * d], dt, seed + 3);
    let added = qkv
        .to_dtype(dt)
        .unwrap()
        .broadcast_add(&pb.to_dtype(dt).unwrap().reshape((nh + 2 * nkv, d)).unwrap())
        .unwrap()
        .to_dtype(DType::F32)
        .unwrap();
    let mut args = [b, nh, nkv, l, past, d, cap].map(s).to_vec();
    args.push(s(scale));
    let inputs = [&added, &kc, &vc, &c, &sn, &m];
    let want = run("cached_attention", name, &args, &inputs).unwrap();
    let inputs = [&qkv, &kc, &vc, &c, &sn, &m, &pb];
    let got = run("cached_attention", name, &args, &inputs).unwrap();
    assert_eq!(got, want, "{what}: the bias added in the kernel differs");
    true
}

#[test]
fn cached_attention_equals_rope_kv_writes_and_attention() {
    // A decode step over a partly filled cache with grouped heads and a head dim that leaves a
    // partial warp; a short prefill after cached positions; a first prefill (nothing cached,
    // one kv head per query head); a decode step of the 0.77B model's shape; 18 query heads on
    // one kv head (blocks of 8, 8 and 2 heads, only the first writing the cache); head dim
    // 160; head dim 36 (16-bit cached keys read one by one, f32 ones in 16-byte loads).
    for dims in [
        [2, 6, 2, 1, 36, 40, 50],
        [2, 6, 2, 3, 34, 40, 50],
        [2, 4, 4, 5, 0, 16, 8],
        [2, 12, 2, 1, 299, 128, 320],
        [2, 18, 1, 2, 20, 32, 24],
        [1, 4, 2, 1, 20, 160, 24],
        [2, 6, 2, 1, 20, 36, 24],
    ] {
        for (name, dt, tol) in DTYPES {
            if !check_cached_attention(dims, dt, name, tol, 40) {
                return;
            }
        }
    }
}

#[test]
fn silu_mul_of_packed_rows_matches_the_composition() {
    // Forward, and the backward over packed rows against the separate halves' (which the test
    // above checks against candle's autograd).
    let (rows, cols) = (7, 300); // rows that span blocks, a block that spans rows
    for (name, dt, tol) in DTYPES {
        let gu = randn(&[rows, 2 * cols], dt, 30);
        let Some(got) = run("silu_packed", name, &[s(rows), s(cols)], &[&gu]) else {
            return;
        };
        let (g, u) = (
            gu.narrow(1, 0, cols).unwrap(),
            gu.narrow(1, cols, cols).unwrap(),
        );
        let want = fused::silu_mul_composed(&g, &u).unwrap();
        close(&format!("silu_mul packed {name}"), &got, &flat(&want), tol);
        let (g, u) = (g.contiguous().unwrap(), u.contiguous().unwrap());
        let apart = run("silu_fwd", name, &[], &[&g, &u]).unwrap();
        assert_eq!(
            got, apart,
            "silu_mul packed {name}: differs from the separate halves"
        );
        // The backward over the packed rows: [dgate | dup] in their layout, the same bits as
        // the backward of the separate halves.
        let grad = randn(&[rows, cols], dt, 31);
        let packed = run("silu_packed_bwd", name, &[s(rows), s(cols)], &[&gu, &grad]).unwrap();
        let flat_apart = run("silu_bwd", name, &[], &[&g, &u, &grad]).unwrap();
        let (da, du) = flat_apart.split_at(rows * cols);
        for r in 0..rows {
            let row = &packed[r * 2 * cols..(r + 1) * 2 * cols];
            assert_eq!(
                &row[..cols],
                &da[r * cols..(r + 1) * cols],
                "{name}: dgate row {r}"
            );
            assert_eq!(
                &row[cols..],
                &du[r * cols..(r + 1) * cols],
                "{name}: dup row {r}"
            );
        }
    }
}

#[test]
fn add_rms_norm_matches_the_composition() {
    // h = 300: the row in registers; 2,100: above what a block's registers hold (the loop).
    let (rows, eps) = (5, 1e-5);
    for (h, (name, dt, tol)) in [300usize, 2100]
        .into_iter()
        .flat_map(|h| DTYPES.into_iter().map(move |d| (h, d)))
    {
        let x = randn(&[rows, h], dt, 15);
        let r = randn(&[rows, h], dt, 16);
        let w = randn(&[h], dt, 17);
        let Some(out) = run("add_rms", name, &[s(rows), s(h), s(eps)], &[&x, &r, &w]) else {
            return;
        };
        let (sum, y) = fused::add_rms_norm_composed(&x, &r, &w, eps).unwrap();
        let (gs, gy) = out.split_at(rows * h);
        close(&format!("add_rms_norm sum {name}"), gs, &flat(&sum), tol);
        close(
            &format!("add_rms_norm normed {name}"),
            gy,
            &flat(&y),
            tol * 2.0,
        );
        // The normed half is, to the bit, the RMSNorm kernel's of the stored sum.
        let sum = Tensor::from_vec(gs.to_vec(), (rows, h), &Device::Cpu).unwrap();
        let normed = run("rms_fwd", name, &[s(rows), s(h), s(eps)], &[&sum, &w]).unwrap();
        assert!(
            normed
                .iter()
                .zip(gy)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "add_rms_norm {name}, h {h}: not the RMSNorm kernel's bits"
        );
    }
}

#[test]
fn kv_writes_match_the_composition() {
    // Two new positions after 3 cached ones in a cache of capacity 7; what was there before
    // and after the written positions stays.
    let (b, l, g, d, cap, past) = (2, 2, 3, 10, 7, 3);
    for (name, dt, _) in DTYPES {
        let cache = randn(&[b, g, cap, d], dt, 18);
        let x = randn(&[b, l, g, d], dt, 19);
        let (c, sn) = rope_tables(b, l, d, dt);
        for rotate in [true, false] {
            let args = [b, l, g, d, cap, past, rotate as usize].map(s);
            let Some(got) = run("kv_write", name, &args, &[&cache, &x, &c, &sn]) else {
                return;
            };
            let want = cache.copy().unwrap();
            let rot = rotate.then_some((&c, &sn));
            fused::kv_write_composed(&want, &x, rot, past).unwrap();
            // Rotation computes in f32 and rounds once; the composition rounds each product.
            let tol = if rotate && dt != DType::F32 {
                2e-2
            } else {
                2e-6
            };
            close(
                &format!("kv_write {name} rotate {rotate}"),
                &got,
                &flat(&want),
                tol,
            );
            if !rotate {
                assert_eq!(
                    got,
                    flat(&want),
                    "kv_write {name}: values must move unchanged"
                );
            }
        }
    }
}

/// `log_softmax(x)[t]` and the entropy of `(n, v)` logits as candle compositions in f32, with
/// their gradients for row weights `g`: the reference of the head's kernels.
fn head_reference(x: &Tensor, t: &[u32], g: &Tensor) -> (Tensor, Tensor, Tensor, Tensor) {
    let xv = Var::from_tensor(x).unwrap();
    let lse = |x: &Tensor| {
        let m = x.max_keepdim(1).unwrap().detach();
        let e = x.broadcast_sub(&m).unwrap().exp().unwrap();
        e.sum_keepdim(1)
            .unwrap()
            .log()
            .unwrap()
            .broadcast_add(&m)
            .unwrap()
    };
    let ids = Tensor::new(t, &Device::Cpu).unwrap().unsqueeze(1).unwrap();
    let lp = (xv.gather(&ids, 1).unwrap() - lse(&xv))
        .unwrap()
        .squeeze(1)
        .unwrap();
    let dlp = (&lp * g).unwrap().sum_all().unwrap().backward().unwrap();
    let dlp = dlp.get(&xv).unwrap().clone();
    let logp = xv.broadcast_sub(&lse(&xv)).unwrap();
    let h = (logp.exp().unwrap() * &logp)
        .unwrap()
        .sum(1)
        .unwrap()
        .neg()
        .unwrap();
    let dh = (&h * g).unwrap().sum_all().unwrap().backward().unwrap();
    let dh = dh.get(&xv).unwrap().clone();
    (lp, dlp, h, dh)
}

#[test]
fn log_softmax_gather_and_entropy_match_the_composition() {
    // A vocabulary of 1000 (not a multiple of the block), wide logits.
    let (n, v) = (6, 1000);
    for (name, dt, tol) in DTYPES {
        let x = (randn(&[n, v], dt, 20) * 4.0).unwrap();
        let x = x.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
        let t: Vec<u32> = (0..n as u32).map(|i| (i * 163 + 7) % v as u32).collect();
        let tf = Tensor::new(
            t.iter().map(|&i| i as f32).collect::<Vec<_>>(),
            &Device::Cpu,
        )
        .unwrap();
        let g = randn(&[n], DType::F32, 21);
        let (lp, dlp, h, dh) = head_reference(&x, &t, &g);
        let args = [s(n), s(v)];
        let Some(got) = run("lsg_fwd", name, &args, &[&x, &tf, &g]) else {
            return;
        };
        // Row results are f32 whatever the logits' dtype.
        close(
            &format!("log_softmax_gather {name}"),
            &got,
            &flat(&lp),
            2e-5,
        );
        let got = run("ent_fwd", name, &args, &[&x, &tf, &g]).unwrap();
        close(&format!("entropy {name}"), &got, &flat(&h), 2e-5);
        let got = run("lsg_bwd", name, &args, &[&x, &tf, &g]).unwrap();
        close(
            &format!("log_softmax_gather backward {name}"),
            &got,
            &flat(&dlp),
            tol,
        );
        let got = run("ent_bwd", name, &args, &[&x, &tf, &g]).unwrap();
        close(&format!("entropy backward {name}"), &got, &flat(&dh), tol);
    }
}

/// The 8-bit optimizer states' quantizer and lookup (`grpo-core/src/quant.cu`) against
/// `grpo_core::quant::quantize` and `dequantize` on the CPU: the same bytes and values, on
/// blocks with values over seven
/// decades of both signs, tiny ones (kept nonzero), exact midpoints between code entries, a
/// block of zeros, both maps.
#[test]
fn the_8bit_state_quantizer_gives_the_cpu_bytes() {
    use grpo_core::quant::{BLOCK, dynamic_map, quantize};
    let blocks = 6;
    for signed in [true, false] {
        let code = dynamic_map(signed);
        let mut vals = Vec::with_capacity(blocks * BLOCK);
        for i in 0..blocks * BLOCK {
            let b = i / BLOCK;
            let u = ((i * 7919 + 13) % 2001) as f32 / 1000.0 - 1.0;
            let v = match b {
                0 => u,
                1 => u * 10f32.powi((i % 8) as i32 - 7),
                2 => 0.0,
                // Midpoints of neighbouring entries (the block maximum is the code's 1.0).
                3 => match i % BLOCK {
                    0 => 1.0,
                    k => (code[k % 255] + code[k % 255 + 1]) / 2.0,
                },
                4 => u * 1e-30,
                _ => -u.abs() * 3e3,
            };
            vals.push(if signed { v } else { v.abs() });
        }
        let x = Tensor::from_vec(vals.clone(), blocks * BLOCK, &Device::Cpu).unwrap();
        let code_t = Tensor::new(code.as_slice(), &Device::Cpu).unwrap();
        let q = quantize(&x, &code_t).unwrap();
        let want: Vec<f32> = q.codes.to_dtype(DType::F32).unwrap().to_vec1().unwrap();
        let absmax = q.absmax.clone();
        let Some(got) = run(
            "quantize_code",
            "f32",
            &[s(blocks)],
            &[&x, &absmax, &code_t],
        ) else {
            return;
        };
        assert_eq!(got, want, "signed map: {signed}");
        // The lookup back: the CPU's values to the bit.
        let back: Vec<f32> = grpo_core::quant::dequantize(&q, &code_t, x.shape())
            .unwrap()
            .to_vec1()
            .unwrap();
        let bytes = q.codes.to_dtype(DType::F32).unwrap();
        let got = run(
            "dequantize_code",
            "f32",
            &[s(blocks)],
            &[&bytes, &absmax, &code_t],
        )
        .unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert_eq!(bits(&got), bits(&back), "lookup, signed map: {signed}");
    }
}

#[test]
fn sampling_matches_the_device_sampler() {
    use grpo_rollout::SamplingParams;
    use grpo_rollout::sample::DeviceSampler;
    // 5 rows over a vocabulary of 300 in rows of 320 (the logits' own width may exceed it), and
    // of 2,600 (more than a block's threads: every thread's passes loop, its segment of the
    // draw is several tokens long); sharp and flat rows; every filter alone and together,
    // penalties, suppression, greedy.
    let n = 5usize;
    let base = SamplingParams::default();
    let cases: Vec<(&str, SamplingParams)> = vec![
        ("plain", base.clone()),
        (
            "temperature 0.7",
            SamplingParams {
                temperature: 0.7,
                ..base.clone()
            },
        ),
        (
            "top_k 7",
            SamplingParams {
                top_k: 7,
                ..base.clone()
            },
        ),
        (
            "top_p 0.8",
            SamplingParams {
                top_p: 0.8,
                ..base.clone()
            },
        ),
        (
            "min_p 0.05",
            SamplingParams {
                min_p: 0.05,
                ..base.clone()
            },
        ),
        (
            "top_k 20 + top_p 0.9 + min_p 0.02",
            SamplingParams {
                top_k: 20,
                top_p: 0.9,
                min_p: 0.02,
                ..base.clone()
            },
        ),
        (
            "repetition penalty 1.3 + logit bias",
            SamplingParams {
                repetition_penalty: 1.3,
                logit_bias: vec![(3, 5.0), (17, -100.0)],
                ..base.clone()
            },
        ),
        (
            "min_new_tokens (stop ids suppressed)",
            SamplingParams {
                min_new_tokens: 4,
                ..base.clone()
            },
        ),
        (
            "greedy",
            SamplingParams {
                temperature: 0.0,
                ..base.clone()
            },
        ),
    ];
    let stop_ids = [2u32, 11];
    let prompts: Vec<Vec<u32>> = (0..n as u32).map(|r| vec![r, 5 + r, 40, 41]).collect();
    let prompt_refs: Vec<&[u32]> = prompts.iter().map(|p| p.as_slice()).collect();
    for (v, ld) in [(300usize, 320usize), (2600, 2608)] {
        for (name, dt, _) in DTYPES {
            // Row r's logits scaled by r + 0.5: from flat to sharp.
            let scale: Vec<f32> = (0..n).flat_map(|r| vec![r as f32 + 0.5; ld]).collect();
            let scale = Tensor::from_vec(scale, (n, ld), &Device::Cpu).unwrap();
            let x = (randn(&[n, ld], dt, 30) * scale).unwrap();
            let x = x.to_dtype(dt).unwrap().to_dtype(DType::F32).unwrap();
            let u: Vec<f32> = (0..n).map(|r| (r as f32 * 0.37 + 0.11).fract()).collect();
            let suppress = [true, false, true, false, true];
            for (case, params) in &cases {
                let mut sampler =
                    DeviceSampler::new(params, v, &stop_ids, &prompt_refs, &Device::Cpu).unwrap();
                let (_, want) = sampler.step(&x, &u, &suppress, None).unwrap();
                // The kernel's inputs, as the sampler holds them.
                let mut bias = vec![0f32; v];
                for &(id, b) in &params.logit_bias {
                    bias[id as usize] += b;
                }
                let mut seen = vec![0f32; n * v];
                for (r, p) in prompts.iter().enumerate() {
                    for &t in p {
                        seen[r * v + t as usize] = 1.0;
                    }
                }
                let mut stop = vec![0f32; v];
                for &t in &stop_ids {
                    stop[t as usize] = 1.0;
                }
                let su: Vec<f32> = (0..n)
                    .flat_map(|r| [f32::from(u8::from(suppress[r])), u[r]])
                    .collect();
                let t = if params.temperature > 0.0 {
                    params.temperature
                } else {
                    1.0
                };
                let args = [
                    s(n),
                    s(v),
                    s(ld),
                    s(t),
                    s(params.repetition_penalty),
                    s(params.top_p),
                    s(params.min_p),
                    s(u8::from(params.temperature == 0.0)),
                    s(params.top_k),
                    s(u8::from(!params.logit_bias.is_empty())),
                    s(u8::from(params.repetition_penalty != 1.0)),
                    s(u8::from(params.min_new_tokens > 0)),
                ];
                let t = |v: Vec<f32>, shape: &[usize]| {
                    Tensor::from_vec(v, shape, &Device::Cpu).unwrap()
                };
                let inputs = [
                    &x,
                    &t(bias, &[v]),
                    &t(seen, &[n, v]),
                    &t(stop, &[v]),
                    &t(su, &[n, 2]),
                ];
                let Some(got) = run("sample", name, &args, &inputs) else {
                    return;
                };
                for (r, (tok, lp, _)) in want.iter().enumerate() {
                    assert_eq!(
                        got[2 * r] as u32,
                        *tok,
                        "{case}, {name}, vocabulary {v}, row {r}: the kernel drew {} where the sampler drew {tok}",
                        got[2 * r]
                    );
                    assert!(
                        (got[2 * r + 1] - lp).abs() <= 2e-5 * (1.0 + lp.abs()),
                        "{case}, {name}, row {r}: recorded log-prob {} against {lp}",
                        got[2 * r + 1]
                    );
                }
            }
        }
    }
}

#[test]
fn random_shapes_match_the_composition() {
    // Shapes drawn at random (seeded): hidden sizes and head dims that are no multiple of
    // anything up to the kernels' limits, any head grouping, up to 16 query rows over caches of
    // any fill; f32 and bf16.
    use rand::{Rng, SeedableRng};
    let mut rng = rand_chacha::ChaCha8Rng::seed_from_u64(7);
    for case in 0..8 {
        let (name, dt, tol) = DTYPES[case % 2];
        // RMSNorm forward and backward.
        let (rows, h) = (rng.random_range(1..40usize), rng.random_range(1..700usize));
        let x = randn(&[rows, h], dt, 100 + case as u64);
        let w = randn(&[h], dt, 200 + case as u64);
        let g = randn(&[rows, h], dt, 300 + case as u64);
        let Some(y) = run("rms_fwd", name, &[s(rows), s(h), s(1e-6)], &[&x, &w]) else {
            return;
        };
        let want = fused::rms_norm_composed(&x, &w, 1e-6).unwrap();
        close(
            &format!("case {case}: rms_norm ({rows}, {h}) {name}"),
            &y,
            &flat(&want),
            tol,
        );
        let (xv, wv) = (Var::from_tensor(&x).unwrap(), Var::from_tensor(&w).unwrap());
        let loss = (fused::rms_norm_composed(&xv, &wv, 1e-6).unwrap() * &g)
            .unwrap()
            .sum_all()
            .unwrap();
        let grads = loss.backward().unwrap();
        let blocks = rng.random_range(1..=rows);
        let args = [s(rows), s(h), s(1e-6), s(blocks)];
        let out = run("rms_bwd", name, &args, &[&x, &w, &g]).unwrap();
        let (gx, gw) = out.split_at(rows * h);
        let what = format!("case {case}: rms_norm backward ({rows}, {h}), {blocks} blocks {name}");
        close(&what, gx, &flat(grads.get(&xv).unwrap()), tol * 2.0);
        close(&what, gw, &flat(grads.get(&wv).unwrap()), tol * 8.0);

        // Attention of a few query rows over a partly filled cache.
        let nkv = rng.random_range(1..4usize);
        let nh = nkv * rng.random_range(1..5usize);
        let d = [16usize, 32, 40, 64, 96, 128, 256][rng.random_range(0..7usize)];
        let b = rng.random_range(1..4usize);
        let l = rng.random_range(1..17usize);
        let sl = l + rng.random_range(0..150usize);
        let cap = sl + rng.random_range(0..20usize);
        let q = randn(&[b, nh, l, d], dt, 400 + case as u64);
        let kc = randn(&[b, nkv, cap, d], dt, 500 + case as u64);
        let vc = randn(&[b, nkv, cap, d], dt, 600 + case as u64);
        let m = bias(b, l, sl);
        let scale = 1.0 / (d as f64).sqrt();
        let mut args = [b, nh, nkv, l, sl, d, cap].map(s).to_vec();
        args.push(s(scale));
        let got = run("attention", name, &args, &[&q, &kc, &vc, &m]).unwrap();
        let k = kc.narrow(2, 0, sl).unwrap();
        let v = vc.narrow(2, 0, sl).unwrap();
        let want = fused::attention_composed(&q, &k, &v, &m, scale).unwrap();
        let what = format!(
            "case {case}: attention b {b} heads {nh}/{nkv} L {l} S {sl}/{cap} D {d} {name}"
        );
        close(&what, &got, &flat(&want), tol);
        // The same shape as a pass over a cache after the packed product.
        check_cached_attention(
            [b, nh, nkv, l, sl - l, d, cap],
            dt,
            name,
            tol,
            700 + case as u64,
        );
    }
}
