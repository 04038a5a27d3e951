#!/usr/bin/env python3
"""Reference values for grpo-core's DPO loss types (TRL 1.16), in plain Python (float64).

Writes grpo-core/tests/data/dpo_variants.rs (and KTO's cases: TRL 1.16's KTOTrainer loss on
unpaired labelled rows with a given KL estimate): for every `loss_type` of TRL 1.16's DPOTrainer
(and a weighted combination, and each f-divergence), the loss of a batch of pairs and its
gradient with respect to the policy's summed chosen and rejected log-probs (central
differences, h = 1e-6), also with WPO's per-pair weights (`use_weighting`) as constants. The
formulas follow DPOTrainer._compute_loss, written out here.

    python3 scripts/gen_dpo_reference.py   # no dependencies; from the repository root
"""
import math
import pathlib

OUT = pathlib.Path(__file__).resolve().parent.parent / "grpo-core/tests/data/dpo_variants.rs"

PC = [-12.5, -3.0, -40.25, -7.1, -20.3]
PR = [-11.0, -9.5, -38.0, -7.4, -25.2]
RC = [-12.0, -4.0, -41.0, -6.5, -21.0]
RR = [-12.0, -8.0, -37.5, -7.25, -24.0]
NC = [5.0, 2.0, 17.0, 4.0, 9.0]
NR = [6.0, 4.0, 15.0, 4.0, 12.0]
# WPO pair weights (TRL's use_weighting): constants that multiply each pair's loss.
W = [0.8, 0.35, 1.2, 0.05, 0.6]


def logsig(x):
    return -math.log1p(math.exp(-x)) if x >= 0 else x - math.log1p(math.exp(x))


def sig(x):
    return math.exp(logsig(x))


def score(u, f, alpha):
    if f == "reverse_kl":
        return u
    if f == "forward_kl":
        return 1 - math.exp(-u)
    if f == "js_divergence":
        return math.log(2) + logsig(u)
    if abs(alpha - 1.0) < 1e-6:
        return u
    t = min((alpha - 1.0) * u, 80.0)
    return (math.exp(t) - 1.0) / (alpha - 1.0)


def loss(pc, pr, types, weights, beta, eps, f, alpha, tau, wpo=False):
    n = len(pc)
    cl = [pc[i] - RC[i] for i in range(n)]
    rl = [pr[i] - RR[i] for i in range(n)]
    cs = [score(u, f, alpha) for u in cl]
    rs = [score(u, f, alpha) for u in rl]
    d = [cs[i] - rs[i] for i in range(n)]
    total = 0.0
    for lt, w in zip(types, weights):
        if lt == "sigmoid":
            per = [-logsig(beta * x) for x in d]
        elif lt == "hinge":
            per = [max(0.0, 1 - beta * x) for x in d]
        elif lt == "ipo":
            per = [(cs[i] / max(NC[i], 1) - rs[i] / max(NR[i], 1) - 1 / (2 * beta)) ** 2 for i in range(n)]
        elif lt == "exo_pair":
            per = []
            for x in d:
                z = beta * x
                per.append(sig(z) * (logsig(z) - math.log1p(-eps)) + sig(-z) * (logsig(-z) - math.log(eps)))
        elif lt == "nca_pair":
            per = [-logsig(beta * cl[i]) - 0.5 * logsig(-beta * cl[i]) - 0.5 * logsig(-beta * rl[i]) for i in range(n)]
        elif lt == "robust":
            per = [(-(1 - eps) * logsig(beta * x) + eps * logsig(-beta * x)) / (1 - 2 * eps) for x in d]
        elif lt == "bco_pair":
            per = [-logsig(beta * cl[i]) - logsig(-beta * rl[i]) for i in range(n)]
        elif lt == "sppo_hard":
            per = [(cl[i] - 0.5 / beta) ** 2 + (rl[i] + 0.5 / beta) ** 2 for i in range(n)]
        elif lt in ("aot", "aot_unpaired"):
            if lt == "aot":
                a = sorted(pc[i] - pr[i] for i in range(n))
                b = sorted(RC[i] - RR[i] for i in range(n))
            else:
                a, b = sorted(cl), sorted(rl)
            dd = [a[i] - b[i] for i in range(n)]
            per = [-logsig(beta * x) * (1 - eps) - logsig(-beta * x) * eps for x in dd]
        elif lt == "apo_zero":
            per = [1 - sig(beta * cl[i]) + sig(beta * rl[i]) for i in range(n)]
        elif lt == "apo_down":
            per = [sig(beta * cl[i]) + 1 - sig(beta * (cl[i] - rl[i])) for i in range(n)]
        elif lt == "discopop":
            per = []
            for x in d:
                z = beta * x
                m = sig(z / tau)
                per.append(-logsig(z) * (1 - m) + math.exp(-z) * m)
        elif lt == "sft":
            per = [-sum(pc) / sum(max(v, 1) for v in NC)] * n
        elif lt == "sigmoid_norm":
            per = [-logsig(beta * (cs[i] / max(NC[i], 1) - rs[i] / max(NR[i], 1))) for i in range(n)]
        else:
            raise ValueError(lt)
        if wpo:
            per = [per[i] * W[i] for i in range(n)]
        total += w * sum(per) / n
    return total


def grad(args, which):
    h = 1e-6
    out = []
    base = PC if which == 0 else PR
    for k in range(len(base)):
        p, m = list(base), list(base)
        p[k] += h
        m[k] -= h
        if which == 0:
            out.append((loss(p, PR, *args) - loss(m, PR, *args)) / (2 * h))
        else:
            out.append((loss(PC, p, *args) - loss(PC, m, *args)) / (2 * h))
    return out


TYPES = ["sigmoid", "hinge", "ipo", "exo_pair", "nca_pair", "robust", "bco_pair", "sppo_hard",
         "aot", "aot_unpaired", "apo_zero", "apo_down", "discopop", "sft", "sigmoid_norm"]
CASES = []
for t in TYPES:
    eps = 0.1 if t in ("exo_pair", "robust", "aot", "aot_unpaired") else 0.0
    CASES.append((t, [t], [1.0], 0.1, eps, "reverse_kl", 0.5, 0.05))
CASES.append(("mpo_combination", ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.5, 0.0, "reverse_kl", 0.5, 0.05))
for f, alpha in [("forward_kl", 0.5), ("js_divergence", 0.5), ("alpha_divergence", 0.3), ("alpha_divergence", 1.0)]:
    CASES.append((f"sigmoid_{f}_{alpha}", ["sigmoid", "ipo"], [1.0, 0.5], 0.2, 0.0, f, alpha, 0.05))
CASES.append(("discopop_beta_1", ["discopop"], [1.0], 1.0, 0.0, "reverse_kl", 0.5, 0.2))
# WPO: the pair weights on each loss type of a combination, the sft term included.
WPO_CASES = [
    ("wpo_sigmoid", ["sigmoid"], [1.0], 0.1, 0.0, "reverse_kl", 0.5, 0.05, True),
    ("wpo_mpo_combination", ["sigmoid", "bco_pair", "sft"], [0.8, 0.2, 1.0], 0.5, 0.0, "reverse_kl", 0.5, 0.05, True),
    ("wpo_ipo_robust_js", ["ipo", "robust"], [1.0, 0.5], 0.2, 0.1, "js_divergence", 0.5, 0.05, True),
]
CASES = [c + (False,) for c in CASES] + WPO_CASES


# KTO (TRL 1.16's KTOTrainer._compute_loss): unpaired rows, labels, the batch's KL estimate.
LABELS = [True, False, True, True, False]


def kto(pc, kl, beta, wd, wu, lt):
    per = []
    for i, lab in enumerate(LABELS):
        r = pc[i] - RC[i]
        z = kl if lt == "kto" else 0.0
        if lab:
            per.append(wd * (1 - sig(beta * (r - z))))
        elif lt == "kto":
            per.append(wu * (1 - sig(beta * (z - r))))
        else:
            per.append(wu * sig(beta * r))
    return sum(per) / len(per)


def kto_grad(args):
    h = 1e-6
    out = []
    for k in range(len(PC)):
        p, m = list(PC), list(PC)
        p[k] += h
        m[k] -= h
        out.append((kto(p, *args) - kto(m, *args)) / (2 * h))
    return out


KTO = [
    ("kto", 0.0, 0.1, 1.0, 1.0, "kto"),
    ("kto_kl", 0.37, 0.5, 1.0, 1.33, "kto"),
    ("apo_zero_unpaired", 0.37, 0.2, 0.8, 1.0, "apo_zero_unpaired"),
]


def arr(xs):
    return "&[" + ", ".join(repr(float(x)) for x in xs) + "]"


lines = ["// @generated by scripts/gen_dpo_reference.py — do not edit.",
         f"pub const PC: &[f64] = {arr(PC)};", f"pub const PR: &[f64] = {arr(PR)};",
         f"pub const RC: &[f64] = {arr(RC)};", f"pub const RR: &[f64] = {arr(RR)};",
         f"pub const NC: &[f64] = {arr(NC)};", f"pub const NR: &[f64] = {arr(NR)};",
         f"pub const W: &[f64] = {arr(W)};",
         "pub const DPO_CASES: &[DpoCase] = &["]
for name, types, weights, beta, eps, f, alpha, tau, wpo in CASES:
    args = (types, weights, beta, eps, f, alpha, tau, wpo)
    l = loss(PC, PR, *args)
    gc, gr = grad(args, 0), grad(args, 1)
    tl = ", ".join(f'"{t}"' for t in types)
    lines.append(
        f'    DpoCase {{ name: "{name}", loss_type: &[{tl}], weights: {arr(weights)}, beta: {beta!r}, '
        f'label_smoothing: {eps!r}, f_divergence: "{f}", alpha: {alpha!r}, tau: {tau!r}, '
        f'pair_weighted: {"true" if wpo else "false"}, '
        f'loss: {l!r}, grad_chosen: {arr(gc)}, grad_rejected: {arr(gr)} }},')
lines.append("];")
lines.append("pub const KTO_LABELS: &[bool] = &[" + ", ".join("true" if b else "false" for b in LABELS) + "];")
lines.append("pub const KTO_CASES: &[KtoCase] = &[")
for name, kl, beta, wd, wu, lt in KTO:
    args = (kl, beta, wd, wu, lt)
    lines.append(
        f'    KtoCase {{ name: "{name}", kl: {kl!r}, beta: {beta!r}, desirable_weight: {wd!r}, '
        f'undesirable_weight: {wu!r}, loss_type: "{lt}", loss: {kto(PC, *args)!r}, grad: {arr(kto_grad(args))} }},')
lines.append("];")
OUT.write_text("\n".join(lines) + "\n")
print(f"wrote {OUT} ({len(CASES)} cases)")
