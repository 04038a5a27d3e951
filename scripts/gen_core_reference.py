#!/usr/bin/env python3
"""Reference values for grpo-core, computed with PyTorch (float64).

Writes grpo-core/tests/data/reference.rs: the loss, its gradient with respect to
per_token_logps and the metrics for every loss type x importance level x beta (3 cases each),
group / batch / none / leave-one-out advantages, and log-softmax-gather / entropy values and
gradients. The formulas follow TRL 1.16's GRPOTrainer._compute_loss and
_generate_and_score_completions, written out here from their definitions.

    python3 scripts/gen_core_reference.py   # needs torch; run from the repository root
"""
import math
import pathlib

import torch

torch.manual_seed(0)
OUT = pathlib.Path(__file__).resolve().parent.parent / "grpo-core/tests/data/reference.rs"


def policy_loss(logp, old, ref, adv, mask, cfg):
    """The GRPO-family loss, its metrics. logp requires grad."""
    old = logp.detach() if old is None else old
    log_ratio = logp - old
    if cfg["level"] == "token":
        log_w = log_ratio
    else:
        log_w = ((log_ratio * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).unsqueeze(-1)
    coef_1 = torch.exp(log_w)
    kl = None
    if cfg["beta"] != 0.0:
        kl = torch.exp(ref - logp) - (ref - logp) - 1
        if cfg["kl_corr"]:
            kl = kl * coef_1
    a = adv.unsqueeze(1)
    if cfg["loss_type"] == "cispo":
        w = torch.clamp(coef_1, max=cfg["eps_high"]).detach()
        ptl = -w * a * logp
    else:
        coef_2 = torch.clamp(coef_1, 1 - cfg["eps_low"], 1 + cfg["eps_high"])
        if cfg["delta"] is not None:
            coef_1 = torch.clamp(coef_1, max=cfg["delta"])
        ptl = -torch.min(coef_1 * a, coef_2 * a)
    if kl is not None:
        ptl = ptl + cfg["beta"] * kl
    lt = cfg["loss_type"]
    if lt == "grpo":
        loss = ((ptl * mask).sum(-1) / mask.sum(-1).clamp(min=1.0)).mean()
    elif lt == "bnpo":
        loss = (ptl * mask).sum() / mask.sum().clamp(min=1.0)
    elif lt == "dr_grpo":
        loss = (ptl * mask).sum() / (ptl.size(0) * cfg["max_len"])
    else:
        n = cfg["num_items"] if cfg["num_items"] is not None else mask.sum().item()
        loss = (ptl * mask).sum() / max(n, 1.0)

    def gmean(x):
        if x.shape[1] == 1:
            return (x.sum() / max(x.shape[0], 1)).item()
        return ((x * mask).sum() / mask.sum().clamp(min=1.0)).item()

    metrics = {"kl": gmean(kl) if kl is not None else 0.0}
    if lt == "cispo":
        high = ((coef_1 > cfg["eps_high"]) & (a > 0)).double()
        low = torch.zeros_like(high)
    else:
        low = ((coef_1 < 1 - cfg["eps_low"]) & (a < 0)).double()
        high = ((coef_1 > 1 + cfg["eps_high"]) & (a > 0)).double()
    metrics["low"] = gmean(low)
    metrics["high"] = gmean(high)
    metrics["region"] = gmean(((low + high) > 0).double())
    return loss, metrics


def rs_f64(xs):
    return "&[" + ", ".join(repr(float(x)) for x in xs) + "]"


def rs_opt(x):
    return "None" if x is None else f"Some({float(x)!r})"


def loss_cases():
    out = []
    for lt in ["grpo", "bnpo", "dr_grpo", "dapo", "cispo"]:
        for level in ["token", "sequence"]:
            for beta in [0.0, 0.04]:
                for case in range(3):
                    b, t = [(3, 4), (4, 5), (2, 6)][case]
                    logp = -torch.rand(b, t, dtype=torch.float64) * 3.0 - 0.05
                    noise = [0.0, 0.3, 0.6][case]
                    old = None if case == 0 else logp + noise * torch.randn(b, t, dtype=torch.float64)
                    ref = logp + 0.2 * torch.randn(b, t, dtype=torch.float64)
                    adv = torch.randn(b, dtype=torch.float64)
                    mask = (torch.rand(b, t) > 0.25).double()
                    mask[:, 0] = 1.0
                    if case == 1:
                        mask[-1, :] = 0.0  # a fully masked row
                    if case == 2:
                        adv[0] = 0.0
                    eps_low, eps_high = [(0.2, 0.2), (0.2, 0.28), (0.1, 0.3)][case]
                    if lt == "cispo" and case > 0:
                        eps_high = [None, 1.1, 1.3][case]
                    cfg = dict(
                        loss_type=lt,
                        level=level,
                        beta=beta,
                        eps_low=eps_low,
                        eps_high=eps_high,
                        delta=1.5 if case == 2 else None,
                        kl_corr=case != 2,
                        max_len=t + 2,
                        num_items=23.0 if case == 2 else None,
                    )
                    x = logp.clone().requires_grad_(True)
                    loss, m = policy_loss(x, old, ref if beta else None, adv, mask, cfg)
                    loss.backward()
                    out.append(
                        f"""    LossCase {{
        name: "{lt}/{level}/beta={beta}/case{case}",
        loss_type: "{lt}", level: "{level}", beta: {beta!r}, epsilon_low: {eps_low!r},
        epsilon_high: {eps_high!r}, delta: {rs_opt(cfg['delta'])},
        kl_importance_correction: {str(cfg['kl_corr']).lower()}, max_completion_length: {t + 2},
        num_items_in_batch: {rs_opt(cfg['num_items'])}, b: {b}, t: {t},
        logp: {rs_f64(logp.flatten())},
        old: {'None' if old is None else 'Some(' + rs_f64(old.flatten()) + ')'},
        reference: {'None' if not beta else 'Some(' + rs_f64(ref.flatten()) + ')'},
        advantages: {rs_f64(adv)},
        mask: {rs_f64(mask.flatten())},
        loss: {loss.item()!r},
        grad: {rs_f64(x.grad.flatten())},
        kl: {m['kl']!r}, clip_low: {m['low']!r}, clip_high: {m['high']!r}, clip_region: {m['region']!r},
    }},"""
                    )
    return out


def nanstd(x, dim=None):
    mean = torch.nanmean(x, dim=dim, keepdim=True)
    var = torch.nanmean((x - mean) ** 2, dim=dim, keepdim=True)
    count = torch.sum(~torch.isnan(x), dim=dim, keepdim=True)
    corr = torch.where(count > 1, count / (count - 1), torch.full_like(count, float("nan"), dtype=x.dtype))
    out = torch.sqrt(var * corr)
    return out if dim is None else out.squeeze(dim)


def advantages(rewards, g, scale):
    grouped = rewards.view(-1, g)
    mean = torch.nanmean(grouped, dim=1).repeat_interleave(g)
    if scale in ("group", "none"):
        std = nanstd(grouped, dim=1).repeat_interleave(g) if g > 1 else torch.zeros_like(rewards)
    else:
        std = nanstd(rewards).expand_as(rewards) if rewards.numel() > 1 else torch.zeros_like(rewards)
    a = rewards - mean
    if scale != "none":
        a = a / (std + 1e-4)
    return torch.nan_to_num(a, nan=0.0)


def rloo(rewards, g):
    out = []
    for grp in rewards.view(-1, g):
        ok = ~torch.isnan(grp)
        n, s = int(ok.sum()), torch.nansum(grp).item()
        for r in grp.tolist():
            out.append(0.0 if math.isnan(r) or n < 2 else r - (s - r) / (n - 1))
    return out


def adv_cases():
    out = []
    specs = [(4, 3), (8, 4), (2, 8), (6, 1)]
    for i, (groups, g) in enumerate(specs):
        r = torch.randn(groups * g, dtype=torch.float32).double() * (i + 1) + i
        r = r.float().double()  # representable in f32, as the Rust input is
        if i == 1:
            r[1] = float("nan")
            r[4:8] = 0.5  # a constant group
        if i == 2:
            r[9:16] = float("nan")  # a group with a single scorable reward
        line = [f"    AdvCase {{ group_size: {g}, rewards: {rs_f64(r)},"]
        for scale in ["group", "batch", "none"]:
            line.append(f"        {scale}: {rs_f64(advantages(r, g, scale))},")
        line.append(f"        rloo: {rs_f64(rloo(r, g))} }},")
        out.append("\n".join(line).replace("nan", "f64::NAN"))
    return out


def logprob_cases():
    out = []
    for shape in [(2, 3, 7), (1, 5, 33), (3, 2, 4)]:
        logits = (torch.randn(*shape, dtype=torch.float64) * 2.5).requires_grad_(True)
        targets = torch.randint(0, shape[-1], shape[:-1])
        w = torch.randn(*shape[:-1], dtype=torch.float64)
        lp = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        (lp * w).sum().backward()
        g_lp = logits.grad.clone()
        logits.grad = None
        p = torch.softmax(logits, -1)
        ent = -(p * torch.log_softmax(logits, -1)).sum(-1)
        (ent * w).sum().backward()
        out.append(
            f"""    LogprobCase {{ shape: {list(shape)}, logits: {rs_f64(logits.detach().flatten())},
        targets: &{targets.flatten().tolist()}, weights: {rs_f64(w.flatten())},
        logps: {rs_f64(lp.detach().flatten())}, logp_grad: {rs_f64(g_lp.flatten())},
        entropy: {rs_f64(ent.detach().flatten())}, entropy_grad: {rs_f64(logits.grad.flatten())} }},"""
        )
    return out


def main():
    src = pathlib.Path(__file__).read_text()
    header = "\n".join("// " + line if line else "//" for line in src.splitlines())
    body = [
        "// @generated by scripts/gen_core_reference.py with torch " + torch.__version__ + "; do not edit.",
        "// The snippet that produced these values:",
        "//",
        header,
        "",
        "pub const LOSS_CASES: &[LossCase] = &[",
        *loss_cases(),
        "];",
        "",
        "pub const ADV_CASES: &[AdvCase] = &[",
        *adv_cases(),
        "];",
        "",
        "pub const LOGPROB_CASES: &[LogprobCase] = &[",
        *logprob_cases(),
        "];",
        "",
    ]
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text("\n".join(body))
    print(f"wrote {OUT}")


if __name__ == "__main__":
    main()
