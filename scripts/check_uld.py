"""Reference values of GOLD's ULD loss (grpo-core/tests/it/uld.rs): TRL 1.16's own
`experimental.gold.ULDLoss` on a batch of two samples whose student and teacher tokenise the
answer differently (byte offsets given), float64 logits from a fixed formula, for each setting
below — positional and extended (byte-aligned) ULD, the `observed` and `bayesian` merges, EOS
skipped or kept, the temperatures, the hybrid loss (a vocabulary match from two small vocabularies;
adaptive and fixed weights, β 0.5 and 1) — printing the loss and the student logits' gradient
by autograd. A stand-in config carries the fields ULDLoss reads. Run with torch and
trl==1.16.0 installed:

    TRL_EXPERIMENTAL_SILENCE=1 python scripts/check_uld.py
"""
import json
import math
from types import SimpleNamespace

import torch
from trl.experimental.gold.gold_trainer import ULDLoss

VS, VT, L = 6, 7, 8
# Per sample: (student answer ids, byte offsets, prompt length), (teacher's), for an answer
# that ends with EOS (student id 5, teacher id 6).
SAMPLES = [
    (([1, 2, 3, 0, 5], [(0, 2), (2, 3), (3, 4), (4, 6), (6, 6)], 2),
     ([4, 1, 2, 3, 0, 6], [(0, 1), (1, 3), (3, 4), (4, 5), (5, 6), (6, 6)], 1)),
    (([2, 4, 5], [(0, 3), (3, 5), (5, 5)], 3),
     ([3, 1, 6], [(0, 3), (3, 5), (5, 5)], 2)),
]


def logits(n, v, seed):
    return torch.tensor([[math.sin(seed + 0.9 * i + 1.7 * j) * 2.0 for j in range(v)] for i in range(n)],
                        dtype=torch.float64)


def batch(side, v, seed):
    ids = torch.zeros(2, L, dtype=torch.long)
    labels = torch.full((2, L), -100, dtype=torch.long)
    offs = torch.zeros(2, L, 2, dtype=torch.long)
    for b, sample in enumerate(SAMPLES):
        a_ids, a_offs, p = sample[side]
        for k, (t, o) in enumerate(zip(a_ids, a_offs)):
            ids[b, p + k] = t
            labels[b, p + k] = t
            offs[b, p + k] = torch.tensor(o)
    return logits(2 * L, v, seed).view(2, L, v), ids, labels, offs


STUDENT_VOCAB = {"a": 0, "b": 1, "c": 2, "d": 3, "e": 4, "<s_eos>": 5}
TEACHER_VOCAB = {"c": 0, "x": 1, "a": 2, "y": 3, "e": 4, "z": 5, "<t_eos>": 6}

CASES = [
    dict(use_extended_uld=False, uld_token_merge_strategy="observed"),
    dict(use_extended_uld=True, uld_token_merge_strategy="observed"),
    dict(use_extended_uld=True, uld_token_merge_strategy="bayesian"),
    dict(use_extended_uld=True, uld_token_merge_strategy="observed", uld_skip_student_eos=False,
         uld_skip_teacher_eos=False, uld_student_temperature=0.7, uld_teacher_temperature=1.3,
         uld_distillation_weight=0.5),
    dict(use_extended_uld=True, uld_token_merge_strategy="observed", uld_use_hybrid_loss=True, beta=0.5),
    dict(use_extended_uld=True, uld_token_merge_strategy="bayesian", uld_use_hybrid_loss=True, beta=1.0,
         uld_hybrid_matched_weight=0.3, uld_hybrid_unmatched_weight=0.9),
]
for case in CASES:
    cfg = dict(uld_crossentropy_weight=0.0, uld_distillation_weight=1.0, uld_student_temperature=1.0,
               uld_teacher_temperature=1.0, uld_skip_student_eos=True, uld_skip_teacher_eos=True,
               use_extended_uld=True, uld_token_merge_strategy="observed", uld_use_hybrid_loss=False,
               uld_hybrid_matched_weight=None, uld_hybrid_unmatched_weight=None, beta=1.0)
    cfg.update(case)
    st = SimpleNamespace(get_vocab=lambda: STUDENT_VOCAB)
    tt = SimpleNamespace(get_vocab=lambda: TEACHER_VOCAB)
    fn = ULDLoss(SimpleNamespace(**cfg), student_tokenizer=st, teacher_tokenizer=tt)
    sl, sids, slab, soff = batch(0, VS, 0.3)
    tl, tids, tlab, toff = batch(1, VT, 1.1)
    sl.requires_grad_(True)
    loss = fn(sl, tl, slab, tlab, sids, tids, soff, toff)
    loss.backward()
    print(json.dumps({"case": case, "loss": loss.item(), "grad": sl.grad.tolist()}))
