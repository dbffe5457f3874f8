"""Cross-entropy over vocabulary-split logits, without ever gathering the full logits.

Each TP rank holds logits for its vocabulary slice [start, start + V/tp). The softmax
denominator needs the global max (one MAX all-reduce, for stability) and the global sum
of exponentials; the target's logit lives on exactly one rank. The last two travel in one
SUM all-reduce. Columns at or beyond `n_real` (vocabulary padding) are set to -inf, so the
loss equals that of the unpadded model and padding gets zero gradient.

Backward is local: d loss / d logits = softmax - onehot(target), on each rank's slice.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from ..comm import Group


class _VocabParallelCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        logits: torch.Tensor,
        targets: torch.Tensor,
        group: Group,
        vocab_start: int,
        n_real: int,
    ) -> torch.Tensor:
        logits = logits.float()  # the loss is always computed in fp32
        local_vocab = logits.shape[-1]
        columns = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
        if vocab_start + local_vocab > n_real:
            logits = logits.masked_fill(columns >= n_real, float("-inf"))
        global_max = logits.max(dim=-1).values
        group.all_reduce(global_max, op=dist.ReduceOp.MAX)
        exp = (logits - global_max.unsqueeze(-1)).exp()
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = torch.gather(logits, -1, index).squeeze(-1) - global_max
        sums = torch.stack([exp.sum(dim=-1), target_logit.masked_fill(~mine, 0.0)])
        group.all_reduce(sums)  # (sum of exp, target logit - max) over the whole vocabulary
        loss = sums[0].log() - sums[1]
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine)
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        softmax, index, mine = ctx.saved_tensors
        grad = softmax.clone()
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_start: int, n_real: int
) -> torch.Tensor:
    """Per-token loss (fp32) from this rank's logits slice (..., V/tp) and global targets."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, n_real)
