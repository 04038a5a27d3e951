"""Reference values of SDPO's top-k divergence (grpo-core/tests/it/distill.rs,
`topk_divergence_matches_trls_sdpo_loss`): TRL 1.16's own
`trl.experimental.sdpo.loss_utils.compute_topk_self_distillation_loss` on float64 logits, with
the student's gradient by autograd. Run with torch and trl==1.16.0 installed:

    TRL_EXPERIMENTAL_SILENCE=1 python scripts/check_sdpo_divergence.py
"""
import torch
from trl.experimental.sdpo.loss_utils import compute_topk_self_distillation_loss

zs = torch.tensor([[1.0, -0.5, 2.0, 0.25, 0.9], [0.0, 0.3, -1.2, 0.7, 0.1]], dtype=torch.float64)
zt = torch.tensor([[0.5, 0.5, 1.0, -1.0, 0.2], [2.0, -0.3, 0.1, 0.0, -0.4]], dtype=torch.float64)
for k, alpha, tail, temp in [(2, 1.0, False, 1.0), (3, 0.0, True, 1.0), (3, 0.5, False, 0.7), (2, 0.3, True, 1.3)]:
    s = (zs / temp).clone().requires_grad_(True)
    # TRL's SDPO divides both models' logits by the temperature before the loss.
    loss = compute_topk_self_distillation_loss(
        s, zt / temp, distillation_topk=k, distillation_alpha=alpha, distillation_add_tail=tail
    )
    loss.sum().backward()
    grad = (s.grad / temp).tolist()  # d/dzs = d/ds · ds/dzs
    print(f"({k}, {alpha}, {str(tail).lower()}, {temp}, {loss.tolist()!r}, {grad!r}),")
