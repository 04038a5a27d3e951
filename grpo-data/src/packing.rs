//! Packing token sequences into fixed-length rows, as TRL's `pack_dataset` does: best-fit
//! decreasing bins that keep every sequence whole (`bfd`, the overflow of a long sequence cut
//! off; `bfd_split`, cut into `seq_length` pieces that are packed like any other sequence), or
//! the sequences laid end to end and cut every `seq_length` tokens (`wrapped`).
//!
//! Only lengths go in; what comes out says which piece of which sequence goes where, so the
//! caller packs any columns it has (token ids, loss masks) the same way. A `bfd` row's
//! sequences stay apart in training: each restarts its positions at 0 and attends only to
//! itself (TRL's padding-free, position-id-aware attention).
//!
//! ```
//! use grpo_data::packing::{pack, Piece, Strategy};
//!
//! // TRL's docstring example: sequences of 5, 2, 3 and 1 tokens into rows of 4.
//! let rows = pack(&[5, 2, 3, 1], 4, Strategy::Bfd);
//! let seqs: Vec<Vec<usize>> = rows.iter().map(|r| r.iter().map(|p| p.seq).collect()).collect();
//! assert_eq!(seqs, vec![vec![0], vec![2, 3], vec![1]]);
//! assert_eq!(rows[0][0], Piece { seq: 0, start: 0, len: 4 }); // the 5th token is cut off
//! ```

use std::collections::{BTreeMap, VecDeque};

/// How sequences become rows.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Strategy {
    /// Best fit decreasing; a sequence longer than a row keeps its first `seq_length` tokens.
    Bfd,
    /// Best fit decreasing; a longer sequence is cut into `seq_length` pieces (the last one
    /// shorter), each packed as a sequence of its own: no token is lost.
    BfdSplit,
    /// End to end, cut every `seq_length` tokens: rows are full but a sequence may start in
    /// one row and end in the next.
    Wrapped,
}

/// A run of tokens `start..start + len` of sequence `seq` (its index in the input).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Piece {
    /// The sequence's index in the lengths given to [`pack`].
    pub seq: usize,
    /// The first token taken.
    pub start: usize,
    /// How many tokens.
    pub len: usize,
}

/// Packs sequences of `lengths` tokens into rows of at most `seq_length` tokens. Each row is
/// its pieces in order; empty sequences are left out. The result is TRL's `pack_dataset`
/// (trl 1.16) on one batch of rows, row for row and piece for piece: the pieces taken in
/// decreasing length (ties in input order), each put in the fullest row it fits in (of equally
/// full rows, the one that reached that fill first), or in a new row.
///
/// # Panics
/// If `seq_length` is 0.
pub fn pack(lengths: &[usize], seq_length: usize, strategy: Strategy) -> Vec<Vec<Piece>> {
    assert!(seq_length > 0, "packing needs a row length above 0");
    let mut pieces: Vec<Piece> = Vec::new();
    for (seq, &n) in lengths.iter().enumerate() {
        match strategy {
            Strategy::Bfd if n > 0 => pieces.push(Piece {
                seq,
                start: 0,
                len: n.min(seq_length),
            }),
            Strategy::BfdSplit | Strategy::Wrapped => {
                pieces.extend((0..n).step_by(seq_length).map(|start| Piece {
                    seq,
                    start,
                    len: seq_length.min(n - start),
                }));
            }
            Strategy::Bfd => {}
        }
    }
    if strategy == Strategy::Wrapped {
        return wrapped(&pieces, seq_length);
    }
    // Decreasing length; a stable sort keeps equal lengths in input order.
    let mut order: Vec<usize> = (0..pieces.len()).collect();
    order.sort_by(|&a, &b| pieces[b].len.cmp(&pieces[a].len));
    let mut rows: Vec<Vec<Piece>> = Vec::new();
    // Room left → rows with that much room, in the order they came to have it.
    let mut by_room: BTreeMap<usize, VecDeque<usize>> = BTreeMap::new();
    let mut fill: Vec<usize> = Vec::new();
    for i in order {
        let p = pieces[i];
        let fit = by_room
            .range(p.len..seq_length)
            .next()
            .map(|(&room, _)| room);
        let row = match fit {
            Some(room) => {
                let queue = by_room.get_mut(&room).expect("a room found in the map");
                let row = queue.pop_front().expect("no empty queue is kept");
                if queue.is_empty() {
                    by_room.remove(&room);
                }
                row
            }
            None => {
                rows.push(Vec::new());
                fill.push(0);
                rows.len() - 1
            }
        };
        rows[row].push(p);
        fill[row] += p.len;
        let room = seq_length - fill[row];
        if room > 0 {
            by_room.entry(room).or_default().push_back(row);
        }
    }
    rows
}

/// The pieces (one per `seq_length` run of each sequence) laid end to end and cut every
/// `seq_length` tokens.
fn wrapped(pieces: &[Piece], seq_length: usize) -> Vec<Vec<Piece>> {
    let mut rows: Vec<Vec<Piece>> = Vec::new();
    let mut room = 0;
    for p in pieces {
        let mut p = *p;
        while p.len > 0 {
            if room == 0 {
                rows.push(Vec::new());
                room = seq_length;
            }
            let take = p.len.min(room);
            rows.last_mut()
                .expect("a row was just pushed")
                .push(Piece { len: take, ..p });
            room -= take;
            p.start += take;
            p.len -= take;
        }
    }
    // Adjacent pieces of one sequence in a row are one run.
    for row in &mut rows {
        let mut merged: Vec<Piece> = Vec::with_capacity(row.len());
        for p in row.drain(..) {
            match merged.last_mut() {
                Some(last) if last.seq == p.seq && last.start + last.len == p.start => {
                    last.len += p.len;
                }
                _ => merged.push(p),
            }
        }
        *row = merged;
    }
    rows
}

#[cfg(test)]
mod tests {
    use super::*;

    fn seqs(rows: &[Vec<Piece>]) -> Vec<Vec<(usize, usize, usize)>> {
        rows.iter()
            .map(|r| r.iter().map(|p| (p.seq, p.start, p.len)).collect())
            .collect()
    }

    #[test]
    fn trl_docstring_examples() {
        // trl.pack_dataset's docstring: [[1,2,3,4,5],[6,7],[8,9,10],[11]] into rows of 4.
        let l = [5, 2, 3, 1];
        assert_eq!(
            seqs(&pack(&l, 4, Strategy::Bfd)),
            vec![vec![(0, 0, 4)], vec![(2, 0, 3), (3, 0, 1)], vec![(1, 0, 2)]]
        );
        assert_eq!(
            seqs(&pack(&l, 4, Strategy::BfdSplit)),
            vec![
                vec![(0, 0, 4)],
                vec![(2, 0, 3), (0, 4, 1)],
                vec![(1, 0, 2), (3, 0, 1)]
            ]
        );
        assert_eq!(
            seqs(&pack(&l, 4, Strategy::Wrapped)),
            vec![
                vec![(0, 0, 4)],
                vec![(0, 4, 1), (1, 0, 2), (2, 0, 1)],
                vec![(2, 1, 2), (3, 0, 1)]
            ]
        );
    }

    #[test]
    fn empty_sequences_and_no_input() {
        assert!(pack(&[], 8, Strategy::Bfd).is_empty());
        assert!(pack(&[0, 0], 8, Strategy::BfdSplit).is_empty());
        assert_eq!(
            seqs(&pack(&[0, 3, 0], 8, Strategy::Bfd)),
            vec![vec![(1, 0, 3)]]
        );
    }
}
