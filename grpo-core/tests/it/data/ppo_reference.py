"""Reference values of grpo-core's PPO targets (tests/it/ppo.rs): a line-by-line transcription of
TRL's experimental PPOTrainer.train (rewards, whitening, GAE) on padded rows, in plain Python
(no torch), printed as Rust literals. Run: python3 ppo_reference.py"""
import math

INVALID_LOGPROB = 1.0


def masked_mean(x, m):
    return sum(a for a, b in zip(x, m) if b) / sum(m)


def masked_var(x, m):
    mu = masked_mean(x, m)
    var = masked_mean([(a - mu) ** 2 for a in x], m)
    n = sum(m)
    return var * n / (n - 1)


def masked_whiten(x, m, shift_mean=True):
    mu, var = masked_mean(x, m), masked_var(x, m)
    out = [(a - mu) / math.sqrt(var + 1e-8) for a in x]
    if not shift_mean:
        out = [a + mu for a in out]
    return out


def trl_targets(logprobs, ref_logprobs, values, scores, lengths, kl_coef, k3, whiten_rewards, gamma, lam):
    n, T = len(lengths), max(lengths)
    seq_len = [l - 1 for l in lengths]  # first pad index - 1
    lp = [[logprobs[i][j] if j <= seq_len[i] else INVALID_LOGPROB for j in range(T)] for i in range(n)]
    rlp = [[ref_logprobs[i][j] if j <= seq_len[i] else INVALID_LOGPROB for j in range(T)] for i in range(n)]
    p1 = [[j > seq_len[i] + 1 for j in range(T)] for i in range(n)]
    vals = [[0.0 if p1[i][j] else values[i][j] for j in range(T)] for i in range(n)]
    kl = []
    for i in range(n):
        row = []
        for j in range(T):
            logr = rlp[i][j] - lp[i][j]
            row.append(-logr if not k3 else (math.exp(logr) - 1) - logr)
        kl.append(row)
    rewards = [[-kl_coef * kl[i][j] for j in range(T)] for i in range(n)]
    for i in range(n):
        end = seq_len[i] + 1 if seq_len[i] + 1 < T else seq_len[i]
        rewards[i][end] += scores[i]
    if whiten_rewards:
        flat = [x for r in rewards for x in r]
        mask = [not x for r in p1 for x in r]
        w = masked_whiten(flat, mask, shift_mean=False)
        rewards = [[0.0 if p1[i][j] else w[i * T + j] for j in range(T)] for i in range(n)]
    adv = [[0.0] * T for _ in range(n)]
    for i in range(n):
        last = 0.0
        for t in reversed(range(T)):
            nxt = vals[i][t + 1] if t < T - 1 else 0.0
            delta = rewards[i][t] + gamma * nxt - vals[i][t]
            last = delta + gamma * lam * last
            adv[i][t] = last
    returns = [[adv[i][j] + vals[i][j] for j in range(T)] for i in range(n)]
    pad = [[j > seq_len[i] for j in range(T)] for i in range(n)]
    w = masked_whiten([x for r in adv for x in r], [not x for r in pad for x in r])
    adv = [[0.0 if pad[i][j] else w[i * T + j] for j in range(T)] for i in range(n)]
    return adv, returns


lengths = [3, 1, 4, 2]
logprobs = [[-1.2, -0.3, -2.1], [-0.7], [-0.1, -1.5, -0.9, -3.0], [-0.4, -2.2]]
ref_logprobs = [[-1.0, -0.5, -1.7], [-1.1], [-0.2, -1.2, -1.3, -2.5], [-0.6, -2.0]]
values = [[0.3, -0.2, 0.5, 0.1], [0.05, 0.4], [0.2, 0.1, -0.3, 0.6, 0.9], [-0.1, 0.25, 0.7]]
scores = [1.5, -0.5, 0.8, 0.0]
for name, args in [
    ("K3_WHITENED", dict(kl_coef=0.05, k3=True, whiten_rewards=True, gamma=0.9, lam=0.8)),
    ("K1_PLAIN", dict(kl_coef=0.2, k3=False, whiten_rewards=False, gamma=1.0, lam=0.95)),
]:
    adv, ret = trl_targets(logprobs, ref_logprobs, values, scores, lengths, **args)
    fmt = lambda m: "[" + ", ".join("%.9f" % x for r in m for x in r) + "]"
    print(f"const {name}_ADV: [f32; 16] = {fmt(adv)};")
    print(f"const {name}_RET: [f32; 16] = {fmt(ret)};")
