"""Model-state bytes per GPU under ZeRO, from the paper's formulas and, exactly, from the
engine's bucket layout (hybrid.engine, hybrid.zero.bucket).

The paper (Rajbhandari et al. 2020, arXiv 1910.02054, section 5.1 and Figure 1), for Psi
parameters (this TP rank's count), N data-parallel ranks, parameters and gradients of
`param_bytes` each and K bytes of optimizer state per parameter (mixed-precision Adam:
fp32 master, momentum, variance: K = 12):
  stage 0: (2 + 2 + K) Psi      stage 1: 2 Psi + 2 Psi + K Psi / N
  stage 2: 2 Psi + (2 + K) Psi / N      stage 3: (2 + 2 + K) Psi / N
(with 2 standing for `param_bytes`, the gradients' 2 for `grad_bytes`: 4 when bf16 or
fp16 gradients are accumulated and reduced in fp32, the engine's default `grad_reduce_dtype`,
as Megatron and DeepSpeed do; stage 0 is then (2 + 4 + K) Psi).

The engine adds what the paper rounds away: every bucket is padded to a multiple of N so
the shards are equal (reduce-scatter and all-gather need that), and it holds transient
communication buffers during backward. `zero_state_bytes` replays both from the sizes of
the model's own parameters (bucket 0) and of its units (transformer layers).

One departure: the paper's stage 1 keeps the full gradients (2 Psi). The engine needs them
only while it accumulates over micro-batches; its reducing backward frees each bucket's
full buffer once reduced, as stage 2 does, so after backward stage 1 holds the gradient
shard (2 Psi / N) and the full gradients count as a transient buffer.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid.zero.bucket import group_units, max_bucket_numel

ADAM_MIXED_K = 12
# Element bytes of parameters and gradients, and optimizer bytes per parameter, by
# precision. In fp32 the master weights are the parameters themselves (hybrid.zero.state),
# so only Adam's two moments remain: K = 8.
PRECISION_BYTES = {"bf16": (2, ADAM_MIXED_K), "fp16": (2, ADAM_MIXED_K), "fp32": (4, 8)}
GRAD_REDUCE_DTYPES = ("fp32", "bf16")


def model_state_bytes(
    stage: int,
    psi: int,
    dp: int,
    param_bytes: int = 2,
    k: int = ADAM_MIXED_K,
    grad_bytes: int | None = None,
) -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer states at a ZeRO stage;
    gradients of `grad_bytes` per element (default: `param_bytes`, the paper's)."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    grad_bytes = param_bytes if grad_bytes is None else grad_bytes
    shard = psi / dp
    return {
        "parameters": param_bytes * (shard if stage == 3 else psi),
        "gradients": grad_bytes * (shard if stage >= 2 else psi),
        "optimizer": k * (psi if stage == 0 else shard),
    }


def engine_state_bytes(
    stage: int,
    psi: int,
    dp: int,
    param_bytes: int = 2,
    k: int = ADAM_MIXED_K,
    grad_bytes: int | None = None,
) -> dict[str, float]:
    """The engine's model states after backward: the paper's, but the gradient shard at
    stage 1 (see the module's docstring)."""
    states = model_state_bytes(stage, psi, dp, param_bytes, k, grad_bytes)
    if stage == 1:
        states["gradients"] = model_state_bytes(2, psi, dp, param_bytes, k, grad_bytes)["gradients"]
    return states


def precision_bytes(precision: str) -> tuple[int, int]:
    """(bytes per parameter element, optimizer bytes per parameter K)."""
    if precision not in PRECISION_BYTES:
        raise ValueError(f"precision={precision!r} must be one of {list(PRECISION_BYTES)}")
    return PRECISION_BYTES[precision]


def grad_element_bytes(precision: str, grad_reduce_dtype: str = "fp32") -> int:
    """Bytes per gradient element in the engine's buffers, reductions and shards: 4 when
    reduced in fp32 (hybrid.engine.EngineConfig.grad_reduce_dtype), else the parameters'."""
    if grad_reduce_dtype not in GRAD_REDUCE_DTYPES:
        raise ValueError(
            f"grad_reduce_dtype={grad_reduce_dtype!r} must be one of {list(GRAD_REDUCE_DTYPES)}"
        )
    element, _ = precision_bytes(precision)
    return 4 if grad_reduce_dtype == "fp32" else element


def bucket_numels(
    root: int, units: Sequence[int], stage: int, dp: int, precision: str, bucket_mb: float
) -> list[int]:
    """Padded element count of each bucket the engine builds: bucket 0 the model's own
    parameters, then the units grouped by the engine's rule (hybrid.zero.bucket: the cap
    in parameter elements), each rounded up to a multiple of dp at stages 1-3 (stage 0
    shards nothing: no padding)."""
    element, _ = precision_bytes(precision)
    groups = group_units(units, max_bucket_numel(stage, bucket_mb, element))
    sizes = [root] + [sum(units[i] for i in group) for group in groups]
    ranks = dp if stage >= 1 else 1
    return [-(-n // ranks) * ranks for n in sizes]


def zero_state_bytes(
    root: int,
    units: Sequence[int],
    stage: int,
    dp: int,
    precision: str = "bf16",
    bucket_mb: float = 25.0,
    micro_batches: int = 1,
    grad_reduce_dtype: str = "fp32",
) -> dict[str, int]:
    """What `Engine.model_state_bytes()` reports on every rank, to the byte: parameters,
    gradients (when backward ends), optimizer states, and the peak of transient
    communication buffers; plus the padding elements, for the record."""
    element, k = precision_bytes(precision)
    grad = grad_element_bytes(precision, grad_reduce_dtype)
    numels = bucket_numels(root, units, stage, dp, precision, bucket_mb)
    padded = sum(numels)
    states = engine_state_bytes(stage, padded, dp, element, k, grad)
    result = {name: int(value) for name, value in states.items()}
    result["buffers"] = buffer_bytes(numels, stage, dp, grad, micro_batches, element)
    result["padding"] = padded - root - sum(units)
    return result


def buffer_bytes(
    numels: Sequence[int],
    stage: int,
    dp: int,
    element: int,
    micro_batches: int = 1,
    param_element: int | None = None,
) -> int:
    """Peak bytes of the engine's transient communication buffers in one step: gradient
    buffers and shards of `element` bytes each, stage 3's gathered parameters of
    `param_element` (default: `element`).

    The engine issues each bucket's reduction from gradient hooks as soon as the bucket
    is complete, in every backward at stages 2-3 and in the last one at stage 1:
    - stage 0: the all-reduce works in the persistent gradient buffer: nothing extra;
    - stages 1-3: bucket k's buffer opens once bucket k + 1's reduction has ended (its
      full buffer freed), so a unit bucket's full buffer is filled or reduced at a time,
      beside the root bucket's (open from backward's first gradient to its last).
      Stage 3 adds the gathered parameters. Replayed event by event (`_backward_peak`);
    - stage 1 over several micro-batches: every bucket's full buffer, accumulating, when
      the last backward issues its first two reductions (`_accumulated_peak`).
    """
    shards = [n // dp for n in numels]
    if stage == 0:
        return 0
    if stage == 1 and micro_batches > 1:
        return element * _accumulated_peak(numels, shards)
    gathered = (element if param_element is None else param_element) if stage == 3 else 0
    return _backward_peak(numels, shards, element, gathered)


def _accumulated_peak(numels: Sequence[int], shards: Sequence[int]) -> int:
    """Stage 1's last backward starts with every bucket's full gradient held; buckets
    complete from the last unit to bucket 0, and the second reduction issued is the moment
    before the first is waited for and its full buffer freed."""
    order = [*range(len(numels) - 1, 0, -1), 0]
    return sum(numels) + sum(shards[k] for k in order[:2])


def _backward_peak(numels: Sequence[int], shards: Sequence[int], grad: int, gathered: int) -> int:
    """Replays the moments the engine measures (hybrid.engine._note_buffers) in backward.

    Bucket 0 (embeddings, final norm) opens its gradient buffer first (the final norm's
    or output layer's gradient comes first) and completes last (the token embedding's
    comes last). For each unit bucket k from the last: its first gradient waits for the
    reduction in flight (bucket k + 1's, freed) and opens its buffer; when complete it is
    reduce-scattered (a shard-sized output). At stage 3
    backward starts with bucket 0 gathered and the last unit prefetched; the hook of unit
    k gathers k and prefetches k - 1, and k is freed once issued. (Forward holds at most
    bucket 0 and two units: never more than backward does.) Bytes: `grad` per gradient
    element, `gathered` per gathered parameter element (0: nothing gathered, stages 1-2).
    """
    n = len(numels) - 1
    root_gathered = gathered * numels[0]
    peak = grad * numels[0] + root_gathered + (gathered * numels[n] if n else 0)
    previous = 0  # the reduction still in flight: a full buffer and its shard output
    for k in range(n, 0, -1):
        following = gathered * numels[k - 1] if k > 1 else 0
        open_now = grad * (numels[0] + numels[k])  # bucket k + 1's reduction ended first
        gathered_k = gathered * numels[k]
        peak = max(peak, open_now + root_gathered + gathered_k + following)
        peak = max(peak, open_now + grad * shards[k] + root_gathered + following)
        previous = grad * (numels[k] + shards[k])
    return max(peak, grad * (numels[0] + shards[0]) + previous)
