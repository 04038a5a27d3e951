#!/usr/bin/env python3
"""Reference values for grpo-core's TRL 1.16 loss variants, in plain Python (float64).

Writes grpo-core/tests/data/loss_variants.rs: for sapo, luspo and vespo, the off-policy
sequence mask (`off_policy_mask_threshold`), the high-entropy token mask
(`top_entropy_quantile`) and the entropy bonus (`entropy_coef`), the total loss of one
micro-batch, its gradient with respect to the per-token log-probs and to the entropies, and
the vespo weight metric. The formulas follow TRL 1.16's GRPOTrainer._compute_loss,
get_gamma_weights, get_off_policy_mask and get_high_entropy_mask, written out here from their
definitions. What TRL computes without a gradient (vespo's weights, the masks, cispo-style
constants) is computed from the unperturbed inputs, and the gradients are central finite
differences (h = 1e-6) of the rest.

    python3 scripts/gen_loss_variants_reference.py   # no dependencies; from the repository root
"""
import math
import pathlib
import random

OUT = pathlib.Path(__file__).resolve().parent.parent / "grpo-core/tests/data/loss_variants.rs"
random.seed(7)


def quantile(values, q):
    """torch.quantile's default (linear) interpolation."""
    v = sorted(values)
    pos = q * (len(v) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(v) - 1)
    return v[lo] + (pos - lo) * (v[hi] - v[lo])


def sigmoid(x):
    return 1.0 / (1.0 + math.exp(-x))


def loss_of(case, logp, ent, logp_c, ent_c):
    """The micro-batch's total loss; *_c are the unperturbed inputs (no-gradient parts)."""
    B, T = case["b"], case["t"]
    mask, adv, old = case["mask"], case["adv"], case["old"]
    lt = case["loss_type"]
    isw = case["isw"]
    idx = lambda i, j: i * T + j  # noqa: E731
    # Masks (no gradient).
    opsm = [1.0] * B
    if case["opsm"] is not None:
        samp = case["sampling"] if case["sampling"] is not None else old
        for i in range(B):
            s = sum((samp[idx(i, j)] - logp_c[idx(i, j)]) * mask[idx(i, j)] for j in range(T))
            n = max(1.0, sum(mask[idx(i, j)] for j in range(T)))
            opsm[i] = 1.0 if (adv[i] >= 0 or s / n <= case["opsm"]) else 0.0
    emask = [1.0] * (B * T)
    if case["top_q"] < 1.0:
        real = [ent_c[k] for k in range(B * T) if mask[k] != 0]
        thr = quantile(real, 1.0 - case["top_q"])
        emask = [1.0 if (mask[k] != 0 and ent_c[k] * mask[k] >= thr) else 0.0 for k in range(B * T)]
    # Ratios.
    log_ratio = [logp[k] - old[k] for k in range(B * T)]
    if case["level"] == "token":
        log_w = [[log_ratio[idx(i, j)] for j in range(T)] for i in range(B)]
    else:
        seq = []
        for i in range(B):
            n = max(1.0, sum(mask[idx(i, j)] for j in range(T)))
            seq.append(sum(log_ratio[idx(i, j)] * mask[idx(i, j)] for j in range(T)) / n)
        log_w = [[seq[i]] * T for i in range(B)]
    coef1 = [[math.exp(log_w[i][j]) for j in range(T)] for i in range(B)]
    phi = [0.0] * B
    if lt == "vespo":
        lower = math.log(1e-8)
        for i in range(B):
            s = sum(max(-20.0, min(20.0, logp_c[idx(i, j)] - old[idx(i, j)])) * mask[idx(i, j)]
                    for j in range(T))
            if isw is not None:
                s += sum(max(lower, min(20.0, math.log(isw[idx(i, j)]))) for j in range(T))
            lw = max(lower, min(20.0, s))
            w = math.exp(lw)
            k = case["vespo"][0] if adv[i] >= 0 else case["vespo"][2]
            lam = max(1e-4, case["vespo"][1] if adv[i] >= 0 else case["vespo"][3])
            p = math.exp(lam + k * lw - lam * w)
            phi[i] = p if math.isfinite(p) else 0.0
    ptl = [[0.0] * T for _ in range(B)]
    for i in range(B):
        for j in range(T):
            a = adv[i]
            c1 = coef1[i][j]
            if lt == "sapo":
                tau = case["sapo"][0] if a > 0 else case["sapo"][1]
                v = -(sigmoid(tau * (c1 - 1.0)) * 4.0 / tau) * a
            elif lt == "vespo":
                v = -phi[i] * a * logp[idx(i, j)]
            else:  # the clipped objective (luspo and the others)
                c2 = min(max(c1, 1 - case["eps_low"]), 1 + case["eps_high"])
                v = -min(c1 * a, c2 * a)
            v *= opsm[i]
            v *= emask[idx(i, j)]
            if isw is not None and lt != "vespo":
                v *= isw[idx(i, j)]
            ptl[i][j] = v
    masked = [[ptl[i][j] * mask[idx(i, j)] for j in range(T)] for i in range(B)]
    if lt in ("grpo", "sapo"):
        loss = sum(sum(masked[i]) / max(1.0, sum(mask[idx(i, j)] for j in range(T))) for i in range(B)) / B
    elif lt == "bnpo":
        loss = sum(map(sum, masked)) / max(1.0, sum(mask))
    elif lt == "dr_grpo":
        loss = sum(map(sum, masked)) / (B * case["max_len"])
    elif lt in ("dapo", "cispo", "vespo"):
        loss = sum(map(sum, masked)) / max(1.0, case["num_items"])
    elif lt == "luspo":
        loss = sum(map(sum, masked)) / B
    if case["entropy_coef"] != 0.0:
        acts = [mask[k] * emask[k] for k in range(B * T)]
        h = sum(ent[k] * acts[k] for k in range(B * T)) / max(1.0, sum(acts))
        loss -= case["entropy_coef"] * h
    return loss, sum(phi) / B


def fd(case, which):
    h = 1e-6
    base_l, base_e = case["logp"], case["ent"]
    out = []
    src = base_l if which == "logp" else base_e
    for k in range(len(src)):
        plus, minus = list(src), list(src)
        plus[k] += h
        minus[k] -= h
        if which == "logp":
            fp = loss_of(case, plus, base_e, base_l, base_e)[0]
            fm = loss_of(case, minus, base_e, base_l, base_e)[0]
        else:
            fp = loss_of(case, base_l, plus, base_l, base_e)[0]
            fm = loss_of(case, base_l, minus, base_l, base_e)[0]
        out.append((fp - fm) / (2 * h))
    return out


def make(name, loss_type, level="token", opsm=None, top_q=1.0, entropy_coef=0.0, isw=False,
         sampling=False, sapo=(1.0, 1.05), vespo=(2.0, 3.0, 3.0, 2.0), b=4, t=5):
    mask = []
    for i in range(b):
        n = t - (i % 3)  # rows of t, t-1, t-2 real tokens
        mask += [1.0] * n + [0.0] * (t - n)
    logp = [-random.uniform(0.05, 3.0) for _ in range(b * t)]
    old = [x + random.uniform(-0.35, 0.35) for x in logp]
    adv = [random.uniform(-1.5, 1.5) for _ in range(b)]
    adv[0], adv[1] = abs(adv[0]) + 0.1, -abs(adv[1]) - 0.1
    ent = [random.uniform(0.1, 4.0) for _ in range(b * t)]
    case = {
        "name": name, "loss_type": loss_type, "level": level, "b": b, "t": t,
        "mask": mask, "logp": logp, "old": old, "adv": adv, "ent": ent,
        "isw": [random.uniform(0.5, 1.8) for _ in range(b * t)] if isw else None,
        "sampling": [x + random.uniform(-0.4, 1.2) for x in logp] if sampling else None,
        "opsm": opsm, "top_q": top_q, "entropy_coef": entropy_coef,
        "sapo": sapo, "vespo": vespo, "eps_low": 0.2, "eps_high": 0.28,
        "max_len": 7, "num_items": sum(mask) + 3.0,
    }
    case["loss"], case["phi_mean"] = loss_of(case, logp, ent, logp, ent)
    case["grad_logp"] = fd(case, "logp")
    case["grad_ent"] = fd(case, "ent")
    return case


CASES = [
    make("sapo_token", "sapo"),
    make("sapo_sequence_temperatures", "sapo", level="sequence", sapo=(0.7, 1.6)),
    make("luspo_token", "luspo"),
    make("luspo_sequence", "luspo", level="sequence"),
    make("vespo", "vespo"),
    make("vespo_with_is_weights", "vespo", isw=True, vespo=(1.5, 2.5, 2.0, 1.0)),
    make("dapo_off_policy_mask_old", "dapo", opsm=-0.25),
    make("dapo_off_policy_mask_sampling", "dapo", opsm=0.3, sampling=True, isw=True),
    make("grpo_top_entropy", "grpo", top_q=0.4),
    make("bnpo_top_entropy_bonus", "bnpo", top_q=0.5, entropy_coef=0.03),
    make("dr_grpo_entropy_bonus", "dr_grpo", entropy_coef=-0.02),
    make("sapo_all_options", "sapo", opsm=0.1, top_q=0.7, entropy_coef=0.01, isw=True,
         sampling=True),
]


def arr(xs):
    return "&[" + ", ".join(repr(float(x)) for x in xs) + "]"


def opt(xs):
    return "None" if xs is None else f"Some({arr(xs)})"


def optf(x):
    return "None" if x is None else f"Some({float(x)!r})"


lines = [
    "// @generated by scripts/gen_loss_variants_reference.py — do not edit.",
    "pub const VARIANTS: &[VariantCase] = &[",
]
for c in CASES:
    lines.append(f"""    VariantCase {{
        name: {c['name']!r},
        loss_type: {c['loss_type']!r},
        level: {c['level']!r},
        b: {c['b']},
        t: {c['t']},
        epsilon_low: {c['eps_low']!r},
        epsilon_high: {c['eps_high']!r},
        max_completion_length: {c['max_len']},
        num_items_in_batch: {float(c['num_items'])!r},
        sapo: [{c['sapo'][0]!r}, {c['sapo'][1]!r}],
        vespo: [{', '.join(repr(float(v)) for v in c['vespo'])}],
        off_policy_mask_threshold: {optf(c['opsm'])},
        top_entropy_quantile: {float(c['top_q'])!r},
        entropy_coef: {float(c['entropy_coef'])!r},
        logp: {arr(c['logp'])},
        old: {arr(c['old'])},
        sampling: {opt(c['sampling'])},
        importance_weights: {opt(c['isw'])},
        advantages: {arr(c['adv'])},
        mask: {arr(c['mask'])},
        entropies: {arr(c['ent'])},
        loss: {c['loss']!r},
        grad_logp: {arr(c['grad_logp'])},
        grad_entropies: {arr(c['grad_ent'])},
        phi_seq_mean: {c['phi_mean']!r},
    }},""".replace("'", '"'))
lines.append("];")
OUT.write_text("\n".join(lines) + "\n")
print(f"wrote {OUT} ({len(CASES)} cases)")
