"""Reference values of IW-OPD's loss (grpo-core/tests/it/distill.rs, `iw_opd_matches_trls_loss`):
TRL 1.16's own `IWOPDTrainer._compute_iw_opd_loss` on float64 inputs (a stand-in `self` with
the attributes it reads), with the student's logit gradient by autograd. Run with torch and
trl==1.16.0 installed:

    TRL_EXPERIMENTAL_SILENCE=1 python scripts/check_iw_opd.py
"""
from collections import defaultdict
from types import SimpleNamespace

import torch
from trl.experimental.iw_opd.iw_opd_trainer import IWOPDTrainer

torch.manual_seed(0)
logits = torch.tensor(
    [[[1.0, -0.5, 0.3, 0.2], [0.1, 0.4, -1.0, 0.9], [0.5, 0.5, -0.2, 0.0]],
     [[-0.3, 0.8, 0.1, -0.6], [1.2, -0.4, 0.2, 0.3], [0.0, 0.0, 0.7, -0.9]]],
    dtype=torch.float64,
)
tokens = torch.tensor([[2, 3, 0], [1, 0, 3]])
labels = torch.tensor([[2, 3, 0], [1, 0, -100]])
teacher = torch.tensor([[-1.1, -0.7, -2.0], [-0.4, -1.9, 0.0]], dtype=torch.float64)
rollout = torch.tensor([[-1.3, -0.9, -1.2], [-0.8, -1.0, 0.0]], dtype=torch.float64)
for gamma, temp, use_rollout in [(0.5, 1.0, True), (1.0, 0.7, False)]:
    me = SimpleNamespace(temperature=temp, iw_opd_gamma=gamma, iw_opd_epsilon=1e-8,
                         model=SimpleNamespace(training=True), _metrics={"train": defaultdict(list)})
    z = logits.clone().requires_grad_(True)
    loss = IWOPDTrainer._compute_iw_opd_loss(me, z, tokens, labels, teacher,
                                             rollout if use_rollout else None, num_items_in_batch=5)
    loss.backward()
    m = {k: v[0] for k, v in me._metrics["train"].items()}
    print(gamma, temp, use_rollout, repr(loss.item()), z.grad.tolist(), m)
