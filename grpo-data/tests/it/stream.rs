//! Shuffle, epochs, batches, resume, splits, max_samples, synthetic data.

use crate::common;

use std::collections::HashSet;

use common::*;
use grpo_data::synth::ArithmeticConfig;
use grpo_data::{DataConfig, Dataset, Position, SampleStream, StreamConfig};
use proptest::prelude::*;

fn parquet_dataset(dir: &tempfile::TempDir, rows: usize, chunk_rows: usize) -> Dataset {
    // Several shards and row groups of uneven size.
    let mut start = 0;
    let mut k = 0;
    while start < rows {
        let n = (rows - start).min(37);
        write(
            &dir.path().join(format!("s-{k:03}.parquet")),
            vec![typed_batch(start as u64, n, false)],
        );
        start += n;
        k += 1;
    }
    Dataset::open(&[dir.path().to_string_lossy()], &opts(chunk_rows)).expect("open")
}

fn indices(stream: &mut SampleStream, n: usize) -> Vec<u64> {
    (0..n)
        .map(|_| stream.next_sample().expect("read").expect("sample").index)
        .collect()
}

fn cfg(seed: u64, window: usize) -> StreamConfig {
    StreamConfig {
        seed,
        batch_size: 5,
        epochs: Some(3),
        shuffle_window: window,
        shuffle: true,
    }
}

#[test]
fn shuffle_is_reproducible_and_covers_each_sample_once_per_epoch() {
    let dir = tmp();
    let d = parquet_dataset(&dir, 200, 8);
    let all: Vec<u64> = {
        let mut s = SampleStream::new(d.clone(), cfg(3, 50)).expect("stream");
        std::iter::from_fn(|| s.next_sample().expect("read").map(|x| x.index)).collect()
    };
    assert_eq!(all.len(), 600);
    for epoch in all.chunks(200) {
        let set: HashSet<u64> = epoch.iter().copied().collect();
        assert_eq!(set.len(), 200);
        assert_eq!(set, (0..200).collect());
        assert_ne!(
            epoch,
            (0..200).collect::<Vec<_>>().as_slice(),
            "not shuffled"
        );
    }
    assert_ne!(all[..200], all[200..400], "epochs differ");
    let again: Vec<u64> = {
        let mut s = SampleStream::new(d.clone(), cfg(3, 50)).expect("stream");
        std::iter::from_fn(|| s.next_sample().expect("read").map(|x| x.index)).collect()
    };
    assert_eq!(all, again, "same seed, same order");
    let mut other = SampleStream::new(d, cfg(4, 50)).expect("stream");
    assert_ne!(
        indices(&mut other, 200),
        all[..200],
        "another seed, another order"
    );
}

#[test]
fn order_is_pinned_across_machines() {
    // The order is a pure function of the seed via ChaCha8 (grpo_data::rng); pin it so a change
    // in the algorithm (which would break resuming old checkpoints) is noticed. The value comes
    // from the specifications alone: scripts/gen_rng_reference.py.
    let d = ArithmeticConfig {
        n: 10,
        ..Default::default()
    }
    .dataset()
    .expect("synth");
    let mut s = SampleStream::new(
        d,
        StreamConfig {
            seed: 1,
            ..Default::default()
        },
    )
    .expect("s");
    let got = indices(&mut s, 10);
    let mut sorted = got.clone();
    sorted.sort();
    assert_eq!(sorted, (0..10).collect::<Vec<_>>());
    assert_eq!(got, PINNED_ORDER.to_vec(), "shuffle order changed: {got:?}");
}

const PINNED_ORDER: [u64; 10] = [1, 9, 0, 7, 5, 3, 6, 4, 8, 2];

#[test]
fn no_shuffle_reads_in_file_order() {
    let dir = tmp();
    let d = parquet_dataset(&dir, 90, 7);
    let mut s = SampleStream::new(
        d,
        StreamConfig {
            shuffle: false,
            epochs: Some(2),
            ..Default::default()
        },
    )
    .expect("stream");
    let got = indices(&mut s, 180);
    let want: Vec<u64> = (0..90).chain(0..90).collect();
    assert_eq!(got, want);
    assert!(s.next_sample().expect("end").is_none());
}

#[test]
fn resume_from_stored_position_continues_identically() {
    let dir = tmp();
    let d = parquet_dataset(&dir, 150, 8);
    let c = cfg(9, 40);
    let mut full = SampleStream::new(d.clone(), c.clone()).expect("stream");
    let reference: Vec<u64> =
        std::iter::from_fn(|| full.next_sample().expect("read").map(|x| x.index)).collect();
    for cut in [0usize, 1, 39, 40, 41, 149, 150, 151, 299, 300, 449] {
        let mut s = SampleStream::new(d.clone(), c.clone()).expect("stream");
        let head = indices(&mut s, cut);
        let json = serde_json::to_string(&s.position()).expect("ser");
        let pos: Position = serde_json::from_str(&json).expect("de");
        let mut r = SampleStream::resume(d.clone(), c.clone(), pos).expect("resume");
        let tail: Vec<u64> =
            std::iter::from_fn(|| r.next_sample().expect("read").map(|x| x.index)).collect();
        assert_eq!([head, tail].concat(), reference, "cut at {cut}");
    }
}

#[test]
fn resume_refuses_another_seed_or_dataset() {
    let dir = tmp();
    let d = parquet_dataset(&dir, 50, 8);
    let mut s = SampleStream::new(d.clone(), cfg(1, 10)).expect("stream");
    indices(&mut s, 7);
    let pos = s.position();
    let e = SampleStream::resume(d.clone(), cfg(2, 10), pos).expect_err("seed");
    assert!(
        e.to_string().contains("seed is 1 but this run's is 2"),
        "{e}"
    );
    let smaller = d.take(Some(20)).expect("take");
    assert!(SampleStream::resume(smaller, cfg(1, 10), pos).is_err());
}

#[test]
fn batches_run_across_epochs_and_last_one_is_short() {
    let d = ArithmeticConfig {
        n: 7,
        ..Default::default()
    }
    .dataset()
    .expect("synth");
    let mut s = SampleStream::new(
        d,
        StreamConfig {
            batch_size: 3,
            epochs: Some(2),
            ..Default::default()
        },
    )
    .expect("stream");
    let mut sizes = Vec::new();
    while let Some(b) = s.next_batch().expect("batch") {
        sizes.push(b.len());
    }
    assert_eq!(sizes, vec![3, 3, 3, 3, 2]);
}

#[test]
fn max_samples_and_eval_split() {
    let dir = tmp();
    parquet_dataset(&dir, 100, 8);
    let cfg = DataConfig {
        path: vec![dir.path().to_string_lossy().into_owned()],
        max_samples: Some(60),
        eval_fraction: Some(0.25),
        chunk_rows: 8,
        ..Default::default()
    };
    let splits = cfg.open(5).expect("open");
    let eval = splits.eval.expect("eval");
    assert_eq!((splits.train.len(), eval.len()), (45, 15));
    let read = |d: &Dataset| -> HashSet<u64> { read_all(d).iter().map(|s| s.index).collect() };
    let (tr, ev) = (read(&splits.train), read(&eval));
    assert_eq!(tr.len(), 45);
    assert!(tr.is_disjoint(&ev));
    assert_eq!(
        tr.union(&ev).copied().collect::<HashSet<_>>(),
        (0..60).collect()
    );
    // Same seed, same split; shuffled stream over the train split covers it once.
    assert_eq!(read(&cfg.open(5).expect("open").train), tr);
    assert_ne!(read(&cfg.open(6).expect("open").train), tr);
    let mut s = SampleStream::new(splits.train, StreamConfig::default()).expect("stream");
    let got: HashSet<u64> = indices(&mut s, 45).into_iter().collect();
    assert_eq!(got, tr);
    assert!(s.next_sample().expect("end").is_none());
}

/// `without_rows` leaves the named rows out of a whole dataset and of a split (an index it does
/// not hold changes nothing); a shuffled stream covers what is left once per epoch.
#[test]
fn without_rows_leaves_rows_out() {
    let dir = tmp();
    let d = parquet_dataset(&dir, 40, 8);
    let gone: HashSet<u64> = [0, 7, 8, 39, 1000].into_iter().collect();
    let kept = d.without_rows(&gone);
    assert_eq!(kept.len(), 36);
    let read = |d: &Dataset| -> HashSet<u64> { read_all(d).iter().map(|s| s.index).collect() };
    let want: HashSet<u64> = (0..40).filter(|i| !gone.contains(i)).collect();
    assert_eq!(read(&kept), want);
    let mut s = SampleStream::new(kept.clone(), StreamConfig::default()).expect("stream");
    let got: HashSet<u64> = indices(&mut s, 36).into_iter().collect();
    assert_eq!(got, want);
    // On a split: only its own rows count.
    let (train, eval) = d.split_eval(0.25, 3).expect("split");
    let ev = read(&eval);
    let some_eval = *ev.iter().next().expect("eval rows");
    let t2 = train.without_rows(&[some_eval, 5].into_iter().collect());
    let expect = if ev.contains(&5) { 30 } else { 29 };
    assert_eq!(t2.len(), expect);
    assert!(!read(&t2).contains(&5) && read(&t2).is_disjoint(&ev));
}

#[test]
fn eval_from_separate_files() {
    let dir = tmp();
    let train = write(
        &dir.path().join("train.jsonl"),
        vec![typed_batch(0, 10, false)],
    );
    let test = write(&dir.path().join("test.csv"), vec![typed_batch(0, 4, false)]);
    let cfg = DataConfig {
        path: vec![train.to_string_lossy().into_owned()],
        eval_path: vec![test.to_string_lossy().into_owned()],
        ..Default::default()
    };
    let s = cfg.open(0).expect("open");
    assert_eq!((s.train.len(), s.eval.expect("eval").len()), (10, 4));
}

#[test]
fn arithmetic_is_seeded_and_correct() {
    let c = ArithmeticConfig {
        n: 300,
        seed: 11,
        digits: 3,
        steps: 4,
    };
    let d = c.dataset().expect("synth");
    let rows = read_all(&d);
    assert_eq!(rows, read_all(&c.dataset().expect("again")));
    let mut words = 0;
    for s in &rows {
        let p = s.prompt.text();
        let answer: i64 = s
            .get_text("answer")
            .expect("answer")
            .parse()
            .expect("integer");
        if let Some(expr) = p.strip_prefix("What is ").and_then(|x| x.strip_suffix('?')) {
            let t: Vec<&str> = expr.split(' ').collect();
            let (a, b): (i64, i64) = (t[0].parse().expect("a"), t[2].parse().expect("b"));
            assert!(a < 1000 && b < 1000);
            let want = match t[1] {
                "+" => a + b,
                "-" => a - b,
                "*" => a * b,
                op => panic!("op {op}"),
            };
            assert_eq!(answer, want, "{p}");
        } else {
            words += 1;
            assert!(p.ends_with("have now?"), "{p}");
            assert!(answer >= 0);
        }
    }
    assert!(words > 30, "word problems present: {words}");
    let other = ArithmeticConfig { seed: 12, ..c }.dataset().expect("synth");
    assert_ne!(read_all(&other), rows);
    // Prefix-stable: the first 50 of 300 are the 50 of a 50-row set.
    let small = ArithmeticConfig { n: 50, ..c }.dataset().expect("synth");
    assert_eq!(read_all(&small), rows[..50].to_vec());
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(48))]
    #[test]
    fn no_sample_lost_or_repeated_within_an_epoch(
        rows in 1u64..300,
        batch in 1usize..40,
        epochs in 1u64..4,
        window in 1usize..120,
        seed in any::<u64>(),
        chunk in 1usize..50,
    ) {
        let batches = ArithmeticConfig { n: rows, seed, ..Default::default() }
            .batches(chunk).expect("synth").collect::<Result<Vec<_>, _>>().expect("batches");
        let d = Dataset::from_batches("p", batches, "prompt", chunk).expect("dataset");
        let cfg = StreamConfig { seed, batch_size: batch, epochs: Some(epochs), shuffle_window: window, shuffle: true };
        let mut s = SampleStream::new(d, cfg).expect("stream");
        let mut all = Vec::new();
        let mut n_batches = 0;
        while let Some(b) = s.next_batch().expect("batch") {
            prop_assert!(!b.is_empty() && b.len() <= batch);
            all.extend(b.into_iter().map(|x| x.index));
            n_batches += 1;
        }
        prop_assert_eq!(all.len() as u64, rows * epochs);
        prop_assert_eq!(n_batches as u64, (rows * epochs).div_ceil(batch as u64));
        for epoch in all.chunks(rows as usize) {
            let set: HashSet<u64> = epoch.iter().copied().collect();
            prop_assert_eq!(set, (0..rows).collect::<HashSet<_>>());
        }
    }
}
