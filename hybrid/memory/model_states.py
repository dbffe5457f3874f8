"""The ZeRO paper's model-state and communication accounting (arXiv 1910.02054).

Per GPU, for Psi parameters (this TP rank's count), N data-parallel ranks, parameters and
gradients of `param_bytes` each and K bytes of optimizer state per parameter (mixed-
precision Adam: fp32 master, momentum, variance: K = 12), section 5.1 and Figure 1:
  stage 0: (2 + 2 + K) Psi      stage 1: 2 Psi + 2 Psi + K Psi / N
  stage 2: 2 Psi + (2 + K) Psi / N      stage 3: (2 + 2 + K) Psi / N
(with 2 standing for `param_bytes`). Data-parallel traffic per step (section 7): stages 0-2
move 2 Psi elements (a reduce-scatter and an all-gather, or an all-reduce), stage 3 3 Psi
(the parameters are gathered for forward and again for backward), each collective of S
bytes moving S (N - 1) / N per rank in a ring.
"""

from __future__ import annotations

ADAM_MIXED_K = 12


def model_state_bytes(
    stage: int, psi: int, dp: int, param_bytes: int = 2, k: int = ADAM_MIXED_K
) -> dict[str, float]:
    """Bytes per GPU of parameters, gradients and optimizer states at a ZeRO stage."""
    if stage not in (0, 1, 2, 3):
        raise ValueError(f"ZeRO stage {stage} must be 0, 1, 2 or 3")
    shard = psi / dp
    return {
        "parameters": param_bytes * (shard if stage == 3 else psi),
        "gradients": param_bytes * (shard if stage >= 2 else psi),
        "optimizer": k * (psi if stage == 0 else shard),
    }


def dp_traffic_bytes(stage: int, psi: int, dp: int, param_bytes: int = 2) -> float:
    """Bytes one rank sends per step over the data-parallel group with ring collectives."""
    passes = 3 if stage == 3 else 2
    return passes * param_bytes * psi * (dp - 1) / dp
