"""Reference values of the sparse distillation supports (grpo-core/tests/it/distill.rs,
`sparse_divergence_matches_trls_losses` and `served_divergence_matches_trls_losses`): TRL 1.16's
own IWOPDTrainer functions — `generalized_jsd_loss` with `top_k` (the local `loss_top_k` path),
`_compute_local_sparse_top_1_divergence_loss` (β > 0, `loss_top_k = 1`),
`_compute_server_forward_kl_loss` and `_compute_server_sparse_top_1_divergence_loss` (a teacher
on a server) — on float64 inputs, one row at a time (each row's loss is its divergence), with
the student's logit gradient by autograd. A stand-in `self` carries the attributes they read.
Run with torch and trl==1.16.0 installed:

    TRL_EXPERIMENTAL_SILENCE=1 python scripts/check_sparse_distill.py
"""
from types import SimpleNamespace

import torch
from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer

zs = torch.tensor([[1.0, -0.5, 2.0, 0.25, 0.9], [0.0, 0.3, -1.2, 0.7, 0.1]], dtype=torch.float64)
zt = torch.tensor([[0.5, 0.45, 1.0, -1.0, 0.2], [2.0, -0.3, 0.1, 0.0, -0.4]], dtype=torch.float64)
tokens = [2, 3]  # row 0's is the teacher's top token, row 1's is not


def bind(**kw):
    me = SimpleNamespace(**kw)
    for name in ["_get_reverse_kl_top_1_tokens", "_compute_sparse_top_1_divergence_loss"]:
        setattr(me, name, getattr(IWOPDTrainer, name).__get__(me))
    me._reduce_divergence_loss = IWOPDTrainer._reduce_divergence_loss
    return me


def row(i, f):
    z = zs[i].clone().view(1, 1, -1).requires_grad_(True)
    loss = f(z, zt[i].view(1, 1, -1), torch.tensor([[tokens[i]]]))
    loss.backward()
    return loss.item(), z.grad.view(-1).tolist()


def show(name, f):
    out = [row(i, f) for i in range(2)]
    print(name, [o[0] for o in out], [o[1] for o in out])


labels = lambda t: t.clone()
for k, beta, tail, temp in [(2, 0.0, True, 1.0), (2, 1.0, False, 1.0), (2, 0.5, True, 1.0), (3, 0.3, False, 0.7)]:
    show(f"local k={k} beta={beta} tail={tail} T={temp}",
         lambda z, t, x: IWOPDTrainer.generalized_jsd_loss(z, t, labels=labels(x), beta=beta, temperature=temp,
                                                           top_k=k, add_tail=tail, num_items_in_batch=1))
for beta, mode, tail, temp in [(1.0, "sampled", True, 1.0), (0.5, "sampled", True, 1.0), (0.5, "argmax", False, 0.7)]:
    me = bind(beta=beta, temperature=temp, loss_add_tail=tail, reverse_kl_top_1_mode=mode)
    show(f"top1 beta={beta} {mode} tail={tail} T={temp}",
         lambda z, t, x: IWOPDTrainer._compute_local_sparse_top_1_divergence_loss(me, z, t, x, labels(x), num_items_in_batch=1))


def served(i, t, x, k):
    lt = torch.log_softmax(t, dim=-1)
    top, ids = lt.topk(k, dim=-1)
    if i == 1 and k > 1:
        top[..., 1:] = float("-inf")  # the server gave row 1 its top token only
    return {"topk_logprobs": top, "topk_token_ids": ids, "actual_logprobs": lt.gather(-1, x.unsqueeze(-1)).squeeze(-1)}


for k, tail in [(3, True), (2, False)]:
    me = bind(beta=0.0, temperature=1.0, loss_add_tail=tail, reverse_kl_top_1_mode="sampled")
    out = []
    for i in range(2):
        z = zs[i].clone().view(1, 1, -1).requires_grad_(True)
        x = torch.tensor([[tokens[i]]])
        loss = IWOPDTrainer._compute_server_forward_kl_loss(me, served(i, zt[i].view(1, 1, -1), x, k), torch.log_softmax(z, -1), labels(x))
        loss.backward()
        out.append((loss.item(), z.grad.view(-1).tolist()))
    print(f"server forward k={k} tail={tail}", [o[0] for o in out], [o[1] for o in out])
for beta, tail in [(0.5, True), (1.0, False)]:
    me = bind(beta=beta, temperature=1.0, loss_add_tail=tail, reverse_kl_top_1_mode="sampled")
    out = []
    for i in range(2):
        z = zs[i].clone().view(1, 1, -1).requires_grad_(True)
        x = torch.tensor([[tokens[i]]])
        loss = IWOPDTrainer._compute_server_sparse_top_1_divergence_loss(me, served(i, zt[i].view(1, 1, -1), x, 1), torch.log_softmax(z, -1), x, labels(x))
        loss.backward()
        out.append((loss.item(), z.grad.view(-1).tolist()))
    print(f"server top1 beta={beta} tail={tail}", [o[0] for o in out], [o[1] for o in out])
