"""Cross-entropy over vocabulary-split logits, without ever gathering the full logits.

Each TP rank holds logits for its vocabulary slice [start, start + V/tp). The softmax
denominator needs the global max (one MAX all-reduce, for stability) and the global sum
of exponentials; the target's logit lives on exactly one rank. The last two travel in one
SUM all-reduce. Columns at or beyond `n_real` (vocabulary padding) are set to -inf, so the
loss equals that of the unpadded model and padding gets zero gradient.

Backward is local: d loss / d logits = softmax - onehot(target), on each rank's slice.

Memory, with n tokens and a slice of V/tp: forward makes one n x V/tp fp32 buffer, the
exponentials (in the fp32 copy of bf16 logits; beside fp32 logits, which are never
written), which become the softmax in place and are saved for backward. Backward turns
that saved softmax into the gradient in place, as Megatron does, instead of cloning it:
one n x V/tp fp32 buffer less at the loss's peak. So backward may run once, the usual
case; a second backward through the same loss (retain_graph=True) is refused, not wrong.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from hybrid.distributed.comm import Group


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
        given = logits
        logits = logits.float()  # the loss is always computed in fp32
        local_vocab = logits.shape[-1]
        columns = torch.arange(vocab_start, vocab_start + local_vocab, device=logits.device)
        if vocab_start + local_vocab > n_real:
            padding = columns >= n_real
            if logits is given:  # fp32 logits: this copy is the one buffer of the loss
                logits = logits.masked_fill(padding, float("-inf"))
            else:
                logits.masked_fill_(padding, float("-inf"))
        owned = logits is not given
        global_max = logits.max(dim=-1).values
        group.all_reduce(global_max, op=dist.ReduceOp.MAX)
        local_target = targets - vocab_start
        mine = (local_target >= 0) & (local_target < local_vocab)
        index = local_target.masked_fill(~mine, 0).unsqueeze(-1)
        target_logit = torch.gather(logits, -1, index).squeeze(-1) - global_max
        # exp(logits - max) in our own fp32 copy when there is one (bf16 logits, padding
        # masked), else in a new one; the caller's fp32 logits are never written.
        shift = global_max.unsqueeze(-1)
        exp = (logits.sub_(shift) if owned else logits - shift).exp_()
        del logits, given
        sums = torch.stack([exp.sum(dim=-1), target_logit.masked_fill(~mine, 0.0)])
        group.all_reduce(sums)  # (sum of exp, target logit - max) over the whole vocabulary
        loss = sums[0].log() - sums[1]
        softmax = exp.div_(sums[0].unsqueeze(-1))
        ctx.save_for_backward(softmax, index, mine)
        ctx.used = False
        return loss

    @staticmethod
    def backward(ctx: Any, grad_loss: torch.Tensor) -> tuple[Any, ...]:
        if ctx.used:
            raise RuntimeError(
                "vocab_parallel_cross_entropy: a second backward through the same loss; its "
                "softmax became the first backward's gradient in place (run forward again)"
            )
        ctx.used = True
        softmax, index, mine = ctx.saved_tensors
        grad = softmax  # in place: the softmax is needed by nothing else
        grad.scatter_add_(-1, index, -mine.to(grad.dtype).unsqueeze(-1))
        grad.mul_(grad_loss.unsqueeze(-1))
        return grad, None, None, None, None


def vocab_parallel_cross_entropy(
    logits: torch.Tensor, targets: torch.Tensor, group: Group, vocab_start: int, n_real: int
) -> torch.Tensor:
    """Per-token loss (fp32) from this rank's logits slice (..., V/tp) and global targets."""
    return _VocabParallelCrossEntropy.apply(logits, targets, group, vocab_start, n_real)
