//! Seeded random numbers for shuffles, splits and synthetic data: ChaCha8 from rand_chacha.
//! The same seed gives the same numbers on any machine and any Rust version.
//!
//! **Why ChaCha8** (and not ChaCha12 or ChaCha20): these streams need good statistics and
//! reproducibility, not secrecy. ChaCha8 is the fastest of the three and already far beyond
//! statistical tests (no known distinguisher below 7 rounds), and ChaCha's output is fixed by
//! its specification (it reproduces the published keystream test vectors, see the tests), so
//! it never changes between platforms or crate versions. rand's `StdRng` (ChaCha12 today) makes
//! no such promise about its algorithm, so it is not used here.
//!
//! What is fixed on top of ChaCha8: a `u64` seed becomes the 256-bit key through rand_core's
//! `seed_from_u64` (PCG32 expansion; its documentation counts changing it as value-breaking),
//! `u64`s are the keystream's little-endian words, [`SeededRng::below`] is Lemire's
//! multiply-shift with rejection, and [`SeededRng::shuffle`] is Fisher–Yates over it — all
//! ours, so an upgrade of rand cannot reorder a dataset.

use rand_chacha::ChaCha8Rng;
use rand_chacha::rand_core::{RngCore, SeedableRng};

/// Where [`mix`] reads in a ChaCha8 stream: word 2^67, the second half of the stream's 2^68
/// 32-bit words, which a [`SeededRng`] (reading from word 0) would need 2^66 draws to reach.
const MIX_WORD_POS: u128 = 1 << 67;

/// A seeded generator: ChaCha8 keyed by a `u64` seed (stream 0, from its start).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SeededRng {
    inner: ChaCha8Rng,
}

impl SeededRng {
    /// A generator seeded with `seed` (`ChaCha8Rng::seed_from_u64(seed)`).
    pub fn new(seed: u64) -> Self {
        SeededRng {
            inner: ChaCha8Rng::seed_from_u64(seed),
        }
    }

    /// The next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    /// A uniform integer in `[0, n)` (Lemire's multiply-shift with rejection: no modulo bias).
    /// `n` must be at least 1.
    pub fn below(&mut self, n: u64) -> u64 {
        debug_assert!(n > 0);
        let n = n.max(1);
        let threshold = n.wrapping_neg() % n;
        loop {
            let m = u128::from(self.next_u64()) * u128::from(n);
            if (m as u64) >= threshold {
                return (m >> 64) as u64;
            }
        }
    }

    /// A uniform integer in `[lo, hi]`.
    pub fn range(&mut self, lo: u64, hi: u64) -> u64 {
        lo + self.below(hi - lo + 1)
    }

    /// Shuffle `items` in place (Fisher–Yates).
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.below(i as u64 + 1) as usize;
            items.swap(i, j);
        }
    }
}

/// rand's interface, for rand's distributions and adaptors.
impl RngCore for SeededRng {
    fn next_u32(&mut self) -> u32 {
        self.inner.next_u32()
    }

    fn next_u64(&mut self) -> u64 {
        self.inner.next_u64()
    }

    fn fill_bytes(&mut self, dst: &mut [u8]) {
        self.inner.fill_bytes(dst)
    }
}

/// An independent seed from `seed` and two stream numbers (e.g. epoch and window, or a purpose
/// and a step): the `b`-th 64-bit word, counted from word 2^67, of ChaCha8 stream `a` under the
/// key of `seed` (`seed_from_u64(seed)`, `set_stream(a)`, `set_word_pos(2^67 + 2b)`). A pure
/// function: no state, the same value on any machine, and distinct `(a, b)` read distinct
/// keystream words, never the ones a [`SeededRng::new`]`(seed)` hands out.
pub fn mix(seed: u64, a: u64, b: u64) -> u64 {
    let mut r = ChaCha8Rng::seed_from_u64(seed);
    r.set_stream(a);
    r.set_word_pos(MIX_WORD_POS + 2 * u128::from(b));
    r.next_u64()
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashSet;

    #[test]
    fn the_generator_is_chacha8_as_published() {
        // draft-strombergson-chacha-test-vectors, TC1 (all-zero 256-bit key and 64-bit IV):
        // the first keystream block at 8 rounds, then (first half) at 12 rounds.
        let chacha8 = [
            0x3e00ef2f895f40d6u64,
            0x7f5bb8e81f09a5a1,
            0x2c840ec3ce9a7f3b,
            0x181be188ef711a1e,
            0x984ce172b9216f41,
            0x9f445367456d5619,
            0x314a42a3da86b001,
            0x387bfdb80e0cfe42,
        ];
        let mut block = [0u8; 64];
        ChaCha8Rng::from_seed([0; 32]).fill_bytes(&mut block);
        let want: Vec<u8> = chacha8.iter().flat_map(|w| w.to_be_bytes()).collect();
        assert_eq!(block.to_vec(), want);
        let chacha12 = [
            0x9bf49a6a0755f953u64,
            0x811fce125f2683d5,
            0x0429c3bb49e07414,
            0x7e0089a52eae155f,
        ];
        let mut block = [0u8; 32];
        rand_chacha::ChaCha12Rng::from_seed([0; 32]).fill_bytes(&mut block);
        let want12: Vec<u8> = chacha12.iter().flat_map(|w| w.to_be_bytes()).collect();
        assert_eq!(block.to_vec(), want12);
        // Our u64s are that keystream's little-endian words: the same key gives the same bytes.
        let mut ours = SeededRng {
            inner: ChaCha8Rng::from_seed([0; 32]),
        };
        assert_eq!(
            ours.next_u64(),
            u64::from_le_bytes(want[..8].try_into().unwrap())
        );
        assert_eq!(
            ours.next_u64(),
            u64::from_le_bytes(want[8..16].try_into().unwrap())
        );
    }

    #[test]
    fn seeds_and_mix_are_pinned() {
        // A change here reorders every dataset and breaks resuming old runs: it must be
        // deliberate. The values come from the specifications alone (ChaCha8, rand_core's
        // PCG32 seed expansion, the word positions above): scripts/gen_rng_reference.py.
        let mut r = SeededRng::new(1234567);
        let got = [r.next_u64(), r.next_u64(), r.next_u64()];
        assert_eq!(got, PINNED_NEW, "{got:?}");
        let got = [
            mix(1, 0, 0),
            mix(1, 2, 3),
            mix(0x5eed, 0x6e6e_7261_7465, 42),
        ];
        assert_eq!(got, PINNED_MIX, "{got:?}");
    }

    const PINNED_NEW: [u64; 3] = [
        4949556339754410917,
        15024033290008477395,
        1841961641832425365,
    ];
    const PINNED_MIX: [u64; 3] = [
        7675428365644827547,
        10085996459000115897,
        8711903276476097136,
    ];

    #[test]
    fn same_seed_same_numbers_distinct_streams_distinct_numbers() {
        let draw = |seed| {
            let mut r = SeededRng::new(seed);
            (0..64).map(|_| r.next_u64()).collect::<Vec<_>>()
        };
        assert_eq!(draw(7), draw(7));
        assert_ne!(draw(7), draw(8));
        for (a, b) in [(0, 0), (3, 9), (u64::MAX, u64::MAX)] {
            assert_eq!(mix(7, a, b), mix(7, a, b));
        }
        // Distinct (seed, a, b), distinct values; none is one of SeededRng::new(seed)'s.
        let mut seen = HashSet::new();
        for seed in 0..4 {
            let firsts: HashSet<u64> = draw(seed).into_iter().collect();
            for a in 0..32 {
                for b in 0..32 {
                    let m = mix(seed, a, b);
                    assert!(seen.insert(m), "mix({seed}, {a}, {b}) repeats");
                    assert!(
                        !firsts.contains(&m),
                        "mix({seed}, {a}, {b}) is a draw of new"
                    );
                }
            }
        }
        // b's words are consecutive 64-bit words of stream a.
        let mut r = ChaCha8Rng::seed_from_u64(5);
        r.set_stream(9);
        r.set_word_pos(MIX_WORD_POS);
        assert_eq!([r.next_u64(), r.next_u64()], [mix(5, 9, 0), mix(5, 9, 1)]);
    }

    #[test]
    fn below_is_in_range_and_shuffles_are_uniform() {
        let mut r = SeededRng::new(7);
        for n in 1..50 {
            assert!(r.below(n) < n);
        }
        assert_eq!(r.range(5, 5), 5);
        let mut v: Vec<u32> = (0..100).collect();
        r.shuffle(&mut v);
        let mut s = v.clone();
        s.sort();
        assert_eq!(s, (0..100).collect::<Vec<_>>());
        assert_ne!(v, s);
        // All 24 orders of 4 items, equally often: chi-square with 23 degrees of freedom
        // below its 99.9 % quantile (49.73).
        let trials = 48_000;
        let mut counts = std::collections::HashMap::new();
        for _ in 0..trials {
            let mut x = [0u8, 1, 2, 3];
            r.shuffle(&mut x);
            *counts.entry(x).or_insert(0u32) += 1;
        }
        assert_eq!(counts.len(), 24);
        let expected = trials as f64 / 24.0;
        let chi2: f64 = counts
            .values()
            .map(|&c| (f64::from(c) - expected).powi(2) / expected)
            .sum();
        assert!(chi2 < 49.73, "chi-square {chi2}: {counts:?}");
        // And a biased shuffle (each item swapped with any position, a classic mistake) is
        // caught by the same statistic, so the check has teeth.
        let mut biased = std::collections::HashMap::new();
        for _ in 0..trials {
            let mut x = [0u8, 1, 2, 3];
            for i in 0..4 {
                let j = r.below(4) as usize;
                x.swap(i, j);
            }
            *biased.entry(x).or_insert(0u32) += 1;
        }
        let chi2: f64 = biased
            .values()
            .map(|&c| (f64::from(c) - expected).powi(2) / expected)
            .sum();
        assert!(chi2 > 49.73, "biased chi-square {chi2}");
    }
}
