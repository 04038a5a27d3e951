"""Reference values of grpo-core's verl estimators (tests/it/estimators.rs): a line-by-line
transcription of verl's `core_algos` (compute_*_outcome_advantage, kl_penalty) and
`ray_trainer.apply_kl_penalty` on padded (batch, response_length) rows, in plain Python (no torch),
printed as Rust literals. Run: python3 verl_reference.py"""
import math
import random


def masked_mean(x, m):
    return sum(a * b for a, b in zip(x, m)) / (sum(m) + 1e-8)


def masked_var(x, m):
    mu = masked_mean(x, m)
    var = masked_mean([(a - mu) ** 2 for a in x], m)
    n = sum(m)
    return var * n / (n - 1)


def masked_whiten(rows, mask):
    flat = [x for r in rows for x in r]
    fm = [x for r in mask for x in r]
    mu, var = masked_mean(flat, fm), masked_var(flat, fm)
    return [[(x - mu) / math.sqrt(var + 1e-8) for x in r] for r in rows]


def std(xs):  # torch.std: unbiased
    mu = sum(xs) / len(xs)
    return math.sqrt(sum((x - mu) ** 2 for x in xs) / (len(xs) - 1))


def kl_penalty(lp, ref, kind):
    if kind == "kl":
        return lp - ref
    if kind == "abs":
        return abs(lp - ref)
    if kind == "mse":
        return 0.5 * (lp - ref) ** 2
    kl = max(-20.0, min(20.0, ref - lp))
    return max(-10.0, min(10.0, math.exp(kl) - kl - 1))


def apply_kl_penalty(scores_tok, mask, old, ref, beta, kind):
    kld = [[kl_penalty(o, r, kind) * m for o, r, m in zip(orow, rrow, mrow)] for orow, rrow, mrow in zip(old, ref, mask)]
    rewards = [[s - beta * k for s, k in zip(srow, krow)] for srow, krow in zip(scores_tok, kld)]
    current = sum(masked_mean(k, m) for k, m in zip(kld, mask)) / len(kld)
    return rewards, current


def groups(index):
    out = {}
    for i, g in enumerate(index):
        out.setdefault(g, []).append(i)
    return out


def broadcast(per_seq, mask):
    return [[a * m for m in mrow] for a, mrow in zip(per_seq, mask)]


def grpo_passk(tlr, mask, index, norm):
    scores = [sum(r) for r in tlr]
    adv = [0.0] * len(scores)
    for g, ids in groups(index).items():
        rs = [scores[i] for i in ids]
        order = sorted(range(len(rs)), key=lambda j: -rs[j])
        r_max, r_second = rs[order[0]], rs[order[1]]
        a = r_max - r_second
        if norm:
            a = a / (std(rs) + 1e-6)
        adv[ids[order[0]]] = a
    return broadcast(adv, mask)


def rfpp_baseline(tlr, mask, index):
    T = len(tlr[0])
    scores = [sum(r) for r in tlr]
    mean = {}
    for g, ids in groups(index).items():
        mean[g] = 0.0 if len(ids) == 1 else sum(scores[i] for i in ids) / len(ids)
    scores = [s - mean[index[i]] for i, s in enumerate(scores)]
    rows = [[s * m for m in mrow] for s, mrow in zip(scores, mask)]
    w = masked_whiten(rows, mask)
    return [[x * m for x, m in zip(wr, mr)] for wr, mr in zip(w, mask)]


def opo(tlr, mask, index):
    lens = [sum(m) for m in mask]
    scores = [sum(r) for r in tlr]
    bsl = {}
    for g, ids in groups(index).items():
        if len(ids) == 1:
            bsl[g] = 0.0
        else:
            bsl[g] = sum(lens[i] * scores[i] for i in ids) / sum(lens[i] for i in ids)
    return broadcast([s - bsl[index[i]] for i, s in enumerate(scores)], mask)


def rfpp(tlr, mask, gamma):
    B, T = len(tlr), len(tlr[0])
    returns = [[0.0] * T for _ in range(B)]
    running = [0.0] * B
    for t in reversed(range(T)):
        for i in range(B):
            running[i] = tlr[i][t] + gamma * running[i]
            returns[i][t] = running[i]
            running[i] = running[i] * mask[i][t]
    w = masked_whiten(returns, mask)
    return [[x * m for x, m in zip(wr, mr)] for wr, mr in zip(w, mask)]


def remax(tlr, mask, baselines):
    B, T = len(tlr), len(tlr[0])
    out = []
    for i in range(B):
        masked = [tlr[i][t] * mask[i][t] for t in range(T)]
        returns = [sum(masked[t:]) for t in range(T)]
        out.append([returns[t] - baselines[i] * mask[i][t] for t in range(T)])
    return out


def gpg(tlr, mask, index):
    scores = [sum(r) for r in tlr]
    bsz = len(scores)
    m = sum(1 for s in scores if s != 0)
    alpha = bsz / max(m, 1)
    mean = {}
    for g, ids in groups(index).items():
        mean[g] = 0.0 if len(ids) == 1 else sum(scores[i] for i in ids) / len(ids)
    return broadcast([alpha * (s - mean[index[i]]) for i, s in enumerate(scores)], mask)


def otb(tlr, mask, index, old, spsq, handle_zero_tail):
    """compute_optimal_token_baseline_advantage on padded rows (no IS weights)."""
    B, T = len(tlr), len(tlr[0])
    returns = []
    for r, m in zip(tlr, mask):
        acc, out = 0.0, [0.0] * T
        for t in reversed(range(T)):
            acc += r[t] * m[t]
            out[t] = acc
        returns.append(out)
    w_cum = []
    for o, sp, m in zip(old, spsq, mask):
        acc, out = 0.0, []
        for t in range(T):
            acc += (1 - 2 * math.exp(o[t]) + sp[t]) * m[t]
            out.append(acc)
        w_cum.append(out)
    baselines = [[0.0] * T for _ in range(B)]
    for _, idx in groups(index).items():
        if len(idx) == 1:
            continue
        num = [sum(returns[i][t] * w_cum[i][t] * mask[i][t] for i in idx) for t in range(T)]
        den = [sum(w_cum[i][t] * mask[i][t] for i in idx) + 1e-8 for t in range(T)]
        for i in idx:
            baselines[i] = [n / d for n, d in zip(num, den)]
        if handle_zero_tail:
            lens = [sum(mask[i]) for i in idx]
            srt = sorted(lens)
            mx, second = srt[-1], srt[-2]
            at = [i for i, n in zip(idx, lens) if n == mx]
            if len(at) == 1 and mx > second:
                for t in range(second, T):
                    baselines[at[0]][t] = 0.0
    return [[(g - b) * m for g, b, m in zip(gr, br, mr)] for gr, br, mr in zip(returns, baselines, mask)]


def fmt_rows(rows, mask):
    # Only the loss tokens: grpo-core's rows hold those alone.
    out = []
    for r, m in zip(rows, mask):
        out.append("vec![" + ", ".join(repr(float(x)) for x, k in zip(r, m) if k) + "]")
    return "vec![" + ", ".join(out) + "]"


def main():
    rnd = random.Random(7)
    G, P, T = 4, 3, 6
    B = G * P
    index = [i // G for i in range(B)]
    lens = [rnd.randint(1, T) for _ in range(B)]
    mask = [[1 if t < n else 0 for t in range(T)] for n in lens]
    scores = [rnd.choice([0.0, 0.0, 1.0, 0.5, -0.25]) + round(rnd.uniform(-0.1, 0.1), 3) for _ in range(B)]
    scores[4:8] = [0.0, 0.0, 0.0, 0.0]  # a group of equal (zero) scores
    scores = [round(s, 3) for s in scores]
    old = [[round(rnd.uniform(-3, -0.05), 3) for _ in range(T)] for _ in range(B)]
    ref = [[round(o + rnd.uniform(-0.6, 0.6), 3) for o in row] for row in old]
    # The reward manager's token-level scores: the score on the last response token.
    tls = [[scores[i] if t == lens[i] - 1 else 0.0 for t in range(T)] for i in range(B)]

    print("// generated by verl_reference.py")
    print(f"const LENS: [usize; {B}] = {lens};")
    print(f"const SCORES: [f32; {B}] = [{', '.join(repr(float(s)) for s in scores)}];")
    print(f"fn old() -> Vec<Vec<f64>> {{ {fmt_rows(old, mask)} }}")
    print(f"fn refs() -> Vec<Vec<f64>> {{ {fmt_rows(ref, mask)} }}")
    for kind in ["kl", "abs", "mse", "low_var_kl"]:
        tlr, cur = apply_kl_penalty(tls, mask, old, ref, 0.05, kind)
        print(f"// kl_penalty {kind}, beta 0.05")
        print(f"fn tlr_{kind}() -> Vec<Vec<f64>> {{ {fmt_rows(tlr, mask)} }}")
        print(f"const CURRENT_KL_{kind.upper()}: f64 = {cur!r};")
    tlr, _ = apply_kl_penalty(tls, mask, old, ref, 0.05, "kl")
    for name, rows in [
        ("passk_norm", grpo_passk(tls, mask, index, True)),
        ("passk_plain", grpo_passk(tls, mask, index, False)),
        ("rfpp_baseline", rfpp_baseline(tls, mask, index)),
        ("rfpp_baseline_kl", rfpp_baseline(tlr, mask, index)),
        ("opo", opo(tls, mask, index)),
        ("opo_kl", opo(tlr, mask, index)),
        ("rfpp", rfpp(tls, mask, 1.0)),
        ("rfpp_kl_gamma", rfpp(tlr, mask, 0.9)),
        ("gpg", gpg(tls, mask, index)),
        ("gpg_kl", gpg(tlr, mask, index)),
    ]:
        print(f"fn want_{name}() -> Vec<Vec<f64>> {{ {fmt_rows(rows, mask)} }}")
    # ReMax: each prompt's greedy completion's reward, repeated over its group.
    greedy = [round(rnd.uniform(-0.5, 1.0), 3) for _ in range(P)]
    baselines = [greedy[index[i]] for i in range(B)]
    print(f"const GREEDY: [f64; {P}] = [{', '.join(repr(g) for g in greedy)}];")
    print(f"fn want_remax() -> Vec<Vec<f64>> {{ {fmt_rows(remax(tls, mask, baselines), mask)} }}")
    print(f"fn want_remax_kl() -> Vec<Vec<f64>> {{ {fmt_rows(remax(tlr, mask, baselines), mask)} }}")
    # The adaptive controller over three steps (ray_trainer's update after each).
    value, out = 0.05, []
    for kl, n in [(0.3, 12), (0.02, 12), (0.1, 24)]:
        err = max(-0.2, min(0.2, kl / 0.1 - 1))
        value *= 1 + err * n / 100
        out.append(value)
    print(f"const ADAPTIVE: [f64; 3] = [{', '.join(repr(v) for v in out)}];")
    # The optimal token baseline: Σπ² of each token's distribution, at least π².
    spsq = [[math.exp(o) ** 2 + rnd.uniform(0, 0.5) * (1 - math.exp(o) ** 2) for o in row] for row in old]
    print(f"fn sum_pi_sq() -> Vec<Vec<f64>> {{ {fmt_rows(spsq, mask)} }}")
    print(f"fn want_otb() -> Vec<Vec<f64>> {{ {fmt_rows(otb(tls, mask, index, old, spsq, False), mask)} }}")
    print(f"fn want_otb_tail() -> Vec<Vec<f64>> {{ {fmt_rows(otb(tls, mask, index, old, spsq, True), mask)} }}")
    print(f"fn want_otb_kl() -> Vec<Vec<f64>> {{ {fmt_rows(otb(tlr, mask, index, old, spsq, False), mask)} }}")


main()
