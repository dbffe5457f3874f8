"""The clip inside the fused AdamW kernel (hybrid.zero.optimizer.step_adamw): a clipped
step equals torch's multiply-then-step, and the step after it, unclipped, divides by
nothing (the divisor is the step's own, never left on the optimizer)."""

from __future__ import annotations

import torch

from hybrid.zero.optimizer import step_adamw


def adamw(params: list[torch.nn.Parameter]) -> torch.optim.AdamW:
    # eps as large as the gradients: Adam's update then depends on their scale, which it
    # otherwise divides out (so a clip, or a divisor left behind, would hardly show).
    return torch.optim.AdamW(params, lr=0.0, betas=(0.9, 0.95), eps=1.0, fused=True)


def test_a_clipped_then_an_unclipped_step_match_torchs_multiply() -> None:
    torch.manual_seed(0)
    ours = [torch.nn.Parameter(torch.randn(300)) for _ in range(3)]
    reference = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    unclipped = [torch.nn.Parameter(p.detach().clone()) for p in ours]
    ours_opt, reference_opt, unclipped_opt = adamw(ours), adamw(reference), adamw(unclipped)
    for divisor in (4.0, None):  # clipped by 4, then not clipped
        grads = [torch.randn(300) for _ in ours]
        for p, q, u, g in zip(ours, reference, unclipped, grads, strict=True):
            p.grad, q.grad, u.grad = g.clone(), g.clone(), g.clone()
        step_adamw(unclipped_opt, 1e-2, None, torch.device("cpu"))
        if divisor is not None:
            torch._foreach_mul_([q.grad for q in reference], 1.0 / divisor)
        for group in reference_opt.param_groups:
            group["lr"] = 1e-2
        reference_opt.step()
        step_adamw(ours_opt, 1e-2, divisor, torch.device("cpu"))
        for p, q, u in zip(ours, reference, unclipped, strict=True):
            torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
            # The premise: the clip moves the weights by far more than the tolerance.
            assert (q - u).abs().max() > 1e-4
