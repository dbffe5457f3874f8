"""Bytes one GPU sends per optimizer step over its data-parallel and tensor-parallel
groups, with ring collectives: an all-reduce of S bytes over n ranks sends 2 S (n-1)/n,
a reduce-scatter or all-gather of S (the full tensor) sends S (n-1)/n (the ZeRO paper's
convention, section 7; hybrid.distributed.comm counts S per call by the same rule).

Data parallelism (ZeRO section 7) moves 2 Psi per step at stages 0-2 (an all-reduce, or a
reduce-scatter and an all-gather) and 3 Psi at stage 3 (parameters gathered for forward
and again for backward). With m micro-batches per step the engine reduces once per step
at stages 0-1 (gradients accumulate in the full buffer) but once per micro-batch at
stages 2-3 (only shards are kept), and stage 3 gathers twice per micro-batch:
  stage 0-1: 2 Psi    stage 2: (m + 1) Psi    stage 3: 3 m Psi,
in units of one element of what moves: gradients (all-reduce, reduce-scatter) of
`grad_bytes` (4 when reduced in fp32, the engine's default for bf16 and fp16), parameters
(all-gather) of `param_bytes`.

Tensor parallelism (Megatron-LM, arXiv 1909.08053, section 3; Korthikanti et al. 2022,
section 4.2.2), per micro-batch, with A = e sbh bytes of one activation:
- without sequence parallelism, all-reduces of A: per layer 2 forward (g) and 2 backward
  (f), 2 more when the layer is recomputed; 1 for the embedding (forward), 1 for the
  output layer (backward);
- with sequence parallelism, all-gathers (AG) and reduce-scatters (RS) of A: per layer
  forward 2 AG + 2 RS; backward 2 AG (each RS's conjugate), 2 AG (the column-parallel
  inputs are gathered again instead of stored) + 2 RS; recomputation repeats the
  forward; embedding RS forward + AG backward; output layer AG forward, AG + RS backward;
- recomputation stops once every tensor backward needs is back (torch's non-reentrant
  checkpoint stops early): without dropout nothing after the layer's last reduction is
  saved, so that one collective is not repeated;
- the vocabulary-parallel loss: two fp32 all-reduces of 1 and 2 values per token;
- per step: under sequence parallelism the gradients of the replicated parameters (norms,
  row-parallel biases, position table) are all-reduced over TP with each reduction (once
  per step at stages 0-1, per micro-batch at 2-3); the global gradient norm: two float64
  (the split parameters' sum of squares and a non-finite flag). In fp16 the overflow
  check adds one float32 per step on each group: not counted.
"""

from __future__ import annotations

import math

from hybrid.memory.activations import TransformerShape, check_recompute


def dp_traffic_bytes(
    stage: int,
    psi: int,
    dp: int,
    param_bytes: int = 2,
    micro_batches: int = 1,
    grad_bytes: int | None = None,
) -> float:
    """Bytes one rank sends per step over the data-parallel group with ring collectives;
    gradients of `grad_bytes` per element (default: `param_bytes`)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    # (gradient passes, parameter passes): an all-reduce counts as two passes.
    m = micro_batches
    reduced, gathered = {0: (2, 0), 1: (1, 1), 2: (m, 1), 3: (m, 2 * m)}[stage]
    return (reduced * grad_bytes + gathered * param_bytes) * psi * (dp - 1) / dp


def tp_traffic_bytes(
    shape: TransformerShape,
    micro_batch: int,
    micro_batches: int,
    tp: int,
    sequence_parallel: bool,
    recompute: str,
    element: int,
    stage: int,
    replicated_params: int,
    recompute_every: int = 1,
    grad_element: int | None = None,
) -> float:
    """Bytes one rank sends per step over the tensor-parallel group (see the docstring);
    `replicated_params` counts this rank's parameters that are not split across TP, whose
    gradients are of `grad_element` bytes (default: `element`, the activations')."""
    check_recompute(recompute)
    if tp == 1:
        return 0.0
    ring = (tp - 1) / tp
    s, b, layers = shape.seq_len, micro_batch, shape.layers
    activation = element * s * b * shape.hidden
    recomputed = math.ceil(layers / recompute_every) if recompute == "full" else 0
    loss = 2 * ring * (4 + 8) * s * b
    repeated = 2 if shape.dropout else 1  # reductions a recomputed forward repeats
    if sequence_parallel:
        transfers = 2 + 10 * layers + (2 + repeated) * recomputed + 3
        per_micro_batch = ring * activation * transfers + loss
    else:
        all_reduces = 1 + 4 * layers + repeated * recomputed + 1
        per_micro_batch = 2 * ring * activation * all_reduces + loss
    reductions = micro_batches if stage >= 2 else 1
    grad_element = element if grad_element is None else grad_element
    gradients = 2 * ring * grad_element * replicated_params * reductions
    gradients = gradients if sequence_parallel else 0
    norm = 2 * ring * 16
    return micro_batches * per_micro_batch + gradients + norm
