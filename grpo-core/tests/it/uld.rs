//! GOLD's ULD loss against TRL 1.16's own `ULDLoss` (`scripts/check_uld.py`,
//! `tests/fixtures/uld-trl-1.16.jsonl`): two samples whose student and teacher tokenise the
//! answer differently, every setting the script runs — positional and byte-aligned, the
//! `observed` and `bayesian` merges, EOS kept, temperatures, the hybrid loss with adaptive and
//! fixed weights — give TRL's loss and student-logit gradient within 1e-12. Then the byte
//! alignment's groups on their own, and the refusals.
#![cfg(feature = "candle")]
#![allow(clippy::unwrap_used, missing_docs)]

use std::collections::HashMap;

use candle_core::{Device, Tensor, Var};
use grpo_core::uld::{
    Hybrid, MergeStrategy, UldConfig, UldSide, VocabMatch, align_by_byte_offsets, uld_loss,
};

const VS: usize = 6;
const VT: usize = 7;
const L: usize = 8;

type Side = (&'static [u32], &'static [(usize, usize)], usize);

/// The script's samples: (student answer, its offsets, prompt length), the teacher's.
const SAMPLES: [(Side, Side); 2] = [
    (
        (
            &[1, 2, 3, 0, 5],
            &[(0, 2), (2, 3), (3, 4), (4, 6), (6, 6)],
            2,
        ),
        (
            &[4, 1, 2, 3, 0, 6],
            &[(0, 1), (1, 3), (3, 4), (4, 5), (5, 6), (6, 6)],
            1,
        ),
    ),
    (
        (&[2, 4, 5], &[(0, 3), (3, 5), (5, 5)], 3),
        (&[3, 1, 6], &[(0, 3), (3, 5), (5, 5)], 2),
    ),
];

/// The script's logits `(2·L, V)`: `2 sin(seed + 0.9 i + 1.7 j)`.
fn logits(v: usize, seed: f64) -> Tensor {
    let x: Vec<f64> = (0..2 * L)
        .flat_map(|i| (0..v).map(move |j| 2.0 * (seed + 0.9 * i as f64 + 1.7 * j as f64).sin()))
        .collect();
    Tensor::from_vec(x, (2, L, v), &Device::Cpu).unwrap()
}

fn side(all: &Tensor, b: usize, (ids, offs, p): Side) -> UldSide {
    UldSide {
        logits: all.get(b).unwrap().narrow(0, p - 1, ids.len() + 1).unwrap(),
        ids: ids.to_vec(),
        offsets: offs.to_vec(),
    }
}

fn vocab(words: &[&str]) -> HashMap<String, u32> {
    words
        .iter()
        .enumerate()
        .map(|(i, w)| (w.to_string(), i as u32))
        .collect()
}

#[test]
fn uld_matches_trls_loss_and_gradient() {
    let text = include_str!("../fixtures/uld-trl-1.16.jsonl");
    let matchv = VocabMatch::new(
        &vocab(&["a", "b", "c", "d", "e", "<s_eos>"]),
        &vocab(&["c", "x", "a", "y", "e", "z", "<t_eos>"]),
    );
    assert_eq!(
        (matchv.teacher.clone(), matchv.student.clone()),
        (vec![0, 2, 4], vec![2, 0, 4])
    );
    let mut n = 0;
    for line in text.lines() {
        let v: serde_json::Value = serde_json::from_str(line).unwrap();
        let c = &v["case"];
        let flag = |k: &str, d: bool| c.get(k).and_then(serde_json::Value::as_bool).unwrap_or(d);
        let num = |k: &str, d: f64| c.get(k).and_then(serde_json::Value::as_f64).unwrap_or(d);
        let cfg = UldConfig {
            student_temperature: num("uld_student_temperature", 1.0),
            teacher_temperature: num("uld_teacher_temperature", 1.0),
            skip_student_eos: flag("uld_skip_student_eos", true),
            skip_teacher_eos: flag("uld_skip_teacher_eos", true),
            extended: flag("use_extended_uld", true),
            strategy: match c["uld_token_merge_strategy"].as_str().unwrap() {
                "bayesian" => MergeStrategy::Bayesian,
                _ => MergeStrategy::Observed,
            },
            distillation_weight: num("uld_distillation_weight", 1.0),
            hybrid: flag("uld_use_hybrid_loss", false).then(|| Hybrid {
                vocab: matchv.clone(),
                beta: num("beta", 1.0),
                weights: c.get("uld_hybrid_matched_weight").map(|w| {
                    (
                        w.as_f64().unwrap(),
                        c["uld_hybrid_unmatched_weight"].as_f64().unwrap(),
                    )
                }),
            }),
        };
        let s = Var::from_tensor(&logits(VS, 0.3)).unwrap();
        let t = logits(VT, 1.1);
        let samples: Vec<(UldSide, UldSide)> = SAMPLES
            .iter()
            .enumerate()
            .map(|(b, &(ss, ts))| (side(s.as_tensor(), b, ss), side(&t, b, ts)))
            .collect();
        let out = uld_loss(&samples, &cfg).unwrap();
        let got = out.loss.to_scalar::<f64>().unwrap();
        let want = v["loss"].as_f64().unwrap();
        assert!(
            (got - want).abs() < 1e-12,
            "{c}: loss {got} vs TRL's {want}"
        );
        let g = out.loss.backward().unwrap();
        let g = g.get(s.as_tensor()).unwrap().to_vec3::<f64>().unwrap();
        let wg: Vec<Vec<Vec<f64>>> = serde_json::from_value(v["grad"].clone()).unwrap();
        for b in 0..2 {
            for i in 0..L {
                for j in 0..VS {
                    let (x, y) = (g[b][i][j], wg[b][i][j]);
                    assert!(
                        (x - y).abs() < 1e-12,
                        "{c}: grad [{b}][{i}][{j}] {x} vs TRL's {y}"
                    );
                }
            }
        }
        assert_eq!(out.matched.is_some(), cfg.hybrid.is_some());
        n += 1;
    }
    assert_eq!(n, 6);
}

/// Groups close where both sides end on one byte; a tail with no common end is one group.
#[test]
fn byte_alignment_groups_tokens_that_cover_the_same_bytes() {
    let s = [(0, 2), (2, 3), (3, 4), (4, 6)];
    let t = [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6)];
    let (sg, tg) = align_by_byte_offsets(&s, &t);
    assert_eq!(sg, vec![vec![0, 1], vec![2], vec![3]]);
    assert_eq!(tg, vec![vec![0, 1], vec![2], vec![3, 4]]);
    let (sg, tg) = align_by_byte_offsets(&[(0, 2), (2, 5)], &[(0, 3), (3, 4)]);
    assert_eq!((sg, tg), (vec![vec![0, 1]], vec![vec![0, 1]]));
    let same = [(0, 1), (1, 2)];
    let (sg, tg) = align_by_byte_offsets(&same, &same);
    assert_eq!(
        (sg.len(), sg, tg),
        (2, vec![vec![0], vec![1]], vec![vec![0], vec![1]])
    );
}

#[test]
fn a_side_that_does_not_fit_is_refused() {
    let z = Tensor::zeros((3, VS), candle_core::DType::F64, &Device::Cpu).unwrap();
    let bad = UldSide {
        logits: z.clone(),
        ids: vec![1, 2, 3],
        offsets: vec![(0, 1), (1, 2), (2, 2)],
    };
    let ok = UldSide {
        logits: z,
        ids: vec![1, 2],
        offsets: vec![(0, 1), (1, 1)],
    };
    let e = uld_loss(&[(bad, ok)], &UldConfig::default())
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("sample 0's student side has 3 logits rows, 3 tokens"),
        "{e}"
    );
    assert!(uld_loss(&[], &UldConfig::default()).is_err());
}
