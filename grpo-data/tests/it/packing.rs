//! `grpo_data::packing` against TRL's own packing code, and its invariants on random input.

use grpo_data::packing::{Piece, Strategy, pack};
use proptest::prelude::*;

#[path = "../data/packing_reference.rs"]
mod reference;

#[test]
fn bfd_and_bfd_split_equal_trl_row_for_row() {
    for (k, &(lengths, seq_length, split, want)) in reference::CASES.iter().enumerate() {
        let strategy = if split {
            Strategy::BfdSplit
        } else {
            Strategy::Bfd
        };
        let got: Vec<Vec<(usize, usize, usize)>> = pack(lengths, seq_length, strategy)
            .iter()
            .map(|r| r.iter().map(|p| (p.seq, p.start, p.len)).collect())
            .collect();
        let want: Vec<Vec<(usize, usize, usize)>> = want.iter().map(|r| r.to_vec()).collect();
        assert_eq!(
            got, want,
            "case {k}: lengths {lengths:?}, rows of {seq_length}, {strategy:?}"
        );
    }
}

/// Tokens of each sequence covered by the rows, in order, with no overlap.
fn covered(rows: &[Vec<Piece>], n: usize) -> Vec<Vec<(usize, usize)>> {
    let mut by_seq = vec![Vec::new(); n];
    for r in rows {
        for p in r {
            by_seq[p.seq].push((p.start, p.len));
        }
    }
    for s in &mut by_seq {
        s.sort();
    }
    by_seq
}

proptest! {
    #[test]
    fn rows_fit_and_keep_what_the_strategy_promises(
        lengths in proptest::collection::vec(0usize..40, 0..50),
        seq_length in 1usize..32,
    ) {
        for strategy in [Strategy::Bfd, Strategy::BfdSplit, Strategy::Wrapped] {
            let rows = pack(&lengths, seq_length, strategy);
            for r in &rows {
                let fill: usize = r.iter().map(|p| p.len).sum();
                prop_assert!(fill >= 1 && fill <= seq_length, "{strategy:?}: a row of {fill}");
                prop_assert!(r.iter().all(|p| p.len > 0));
            }
            let cov = covered(&rows, lengths.len());
            for (i, (&n, pieces)) in lengths.iter().zip(&cov).enumerate() {
                // Each sequence's pieces tile its kept tokens from the start, without overlap.
                let mut at = 0;
                for &(start, len) in pieces {
                    prop_assert_eq!(start, at, "sequence {} in {:?}", i, strategy);
                    at += len;
                }
                let kept = if strategy == Strategy::Bfd { n.min(seq_length) } else { n };
                prop_assert_eq!(at, kept, "sequence {} in {:?}", i, strategy);
                if strategy == Strategy::Bfd {
                    prop_assert!(pieces.len() <= 1);
                }
            }
            let total: usize = cov.iter().flatten().map(|&(_, l)| l).sum();
            if strategy == Strategy::Wrapped {
                // Full rows but the last.
                prop_assert_eq!(rows.len(), total.div_ceil(seq_length));
            } else {
                // A row is opened only for a piece that fits in no row before it: each earlier
                // row's fill plus that first piece exceeds a row.
                for (j, r) in rows.iter().enumerate() {
                    for earlier in &rows[..j] {
                        let fill: usize = earlier.iter().map(|p| p.len).sum();
                        prop_assert!(fill + r[0].len > seq_length, "{:?}", strategy);
                    }
                }
            }
        }
    }
}
