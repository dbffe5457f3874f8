"""The plan for one model on one layout: bytes per GPU, bytes sent per step, step time.

    params = RankParameters(root=..., units=(...,) * layers, replicated=..., total=...)
    result = plan(Layout(gpus=256, tp=4, zero_stage=2, recompute="full"), params, shape,
                  gpu_memory=32 * 2**30)

Memory per GPU is broken down into the model states (hybrid.memory.model_states: ZeRO
with the engine's padding), the activations one micro-batch keeps for backward
(hybrid.memory.activations: Korthikanti et al.) and the engine's peak of transient
communication buffers. The `peak` is not their sum: it is the largest moment of a
training step (hybrid.memory.peak), model states plus activations plus transient
buffers as they are alive together (activations peak around the loss, gradient buffers
at the end of backward, stage 3's gathered buckets in the last layers' backward).
`total` adds a reserve no moment holds (CUDA context, NCCL, fragmentation): what must fit.
An allocator's high-water mark (`torch.cuda.max_memory_allocated`, MemTracker) is `peak`.

The step time is compute plus the communication that is not hidden:
- compute: the FLOPs of a step (6 x parameters x tokens plus attention, Narayanan et al.
  2021, eq. 3, with recomputation's extra forward), at `efficiency` x the peak FLOP/s;
- TP collectives sit on the critical path of every layer: all exposed;
- DP collectives are issued from gradient hooks (and stage 3's gathers are prefetched), so
  they hide behind backward (forward for stage 3's first gather) of the micro-batch they
  belong to, up to its compute time; the all-gather after the optimizer step (stages 1-2)
  hides behind the next step's first forward (hybrid.zero.publish), up to its time, or
  is all exposed with `overlap_param_gather=False` (waited for in the step).
A group runs at the intra-node bandwidth when it fits in one node (TP innermost: tp ranks,
or tp x dp for DP), at the inter-node bandwidth otherwise.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any

from hybrid.distributed.topology import check_layout
from hybrid.memory.activations import TransformerShape, activation_bytes, check_recompute
from hybrid.memory.communication import dp_traffic_bytes, tp_traffic_bytes
from hybrid.memory.model_states import (
    grad_element_bytes,
    model_state_bytes,
    precision_bytes,
    zero_state_bytes,
)
from hybrid.memory.peak import Moment, StepLayout, step_peak


@dataclass(frozen=True)
class RankParameters:
    """Parameter elements on one TP rank: the model's own (embeddings, final norm: the
    engine's bucket 0) and each unit's (transformer layer); how many of them are
    replicated across TP rather than split; the whole model's count, each parameter once.
    `exact=False` for a bare parameter count: no layout, so no padding and no buffers."""

    root: int
    units: tuple[int, ...]
    replicated: int
    total: int
    exact: bool = True

    @property
    def psi(self) -> int:
        return self.root + sum(self.units)

    @classmethod
    def bare(cls, total: int, tp: int = 1) -> RankParameters:
        """Psi = total / tp per rank, as the ZeRO paper's analysis counts it."""
        return cls(-(-total // tp), (), 0, total, exact=False)


@dataclass(frozen=True)
class Layout:
    """How a job runs: gpus = dp x tp; ZeRO stage; sequence parallelism; recomputation;
    `micro_batch` sequences per forward; `global_batch` sequences per optimizer step over
    all DP ranks (None: one micro-batch per rank); `grad_reduce_dtype` the gradients'
    dtype from accumulation to the optimizer, `overlap_param_gather` whether stages 1-2
    wait for the step's all-gathers in the next forward (hybrid.engine.EngineConfig)."""

    gpus: int
    tp: int = 1
    zero_stage: int = 0
    sequence_parallel: bool = False
    recompute: str = "none"
    recompute_every: int = 1
    micro_batch: int = 1
    global_batch: int | None = None
    precision: str = "bf16"
    bucket_mb: float = 25.0
    grad_reduce_dtype: str = "fp32"
    overlap_param_gather: bool = True

    def __post_init__(self) -> None:
        check_layout(self.gpus, self.tp)
        if self.zero_stage not in (0, 1, 2, 3):
            raise ValueError(f"ZeRO stage {self.zero_stage} must be 0, 1, 2 or 3")
        check_recompute(self.recompute)
        grad_element_bytes(self.precision, self.grad_reduce_dtype)
        if self.sequence_parallel and self.tp == 1:
            raise ValueError("sequence parallelism needs tp > 1 (it splits the sequence over TP)")
        if self.micro_batch < 1 or self.recompute_every < 1:
            raise ValueError("micro_batch and recompute_every must be at least 1")
        per_step = self.micro_batch * self.dp
        if self.global_batch is not None and (
            self.global_batch < per_step or self.global_batch % per_step
        ):
            raise ValueError(
                f"global batch {self.global_batch} is not a multiple of micro-batch x dp = "
                f"{self.micro_batch} x {self.dp}; use a multiple of {per_step}"
            )

    @property
    def dp(self) -> int:
        return self.gpus // self.tp

    @property
    def micro_batches(self) -> int:
        """Gradient-accumulation steps per optimizer step."""
        if self.global_batch is None:
            return 1
        return self.global_batch // (self.micro_batch * self.dp)

    @property
    def sequences(self) -> int:
        return self.global_batch or self.micro_batch * self.dp

    def describe(self) -> str:
        parts = [f"{self.gpus} GPUs = dp {self.dp} x tp {self.tp}", f"ZeRO {self.zero_stage}"]
        if self.sequence_parallel:
            parts.append("SP")
        every = f" every {self.recompute_every}" if self.recompute_every > 1 else ""
        parts.append(f"recompute {self.recompute}{every}")
        parts.append(f"micro-batch {self.micro_batch} ({self.micro_batches} per step)")
        return ", ".join(parts)


@dataclass(frozen=True)
class Hardware:
    """Per GPU. The defaults are an A100 node: 312 TFLOP/s dense bf16; NVLink 300 GB/s per
    direction; one 200 Gb/s InfiniBand NIC per GPU (25 GB/s); 8 GPUs per node; 50% of peak
    achieved by the GEMMs (Narayanan et al. 2021 report 44-52% for 18B-1T models)."""

    peak_flops: float = 312e12
    efficiency: float = 0.5
    intra_node_bandwidth: float = 300e9
    inter_node_bandwidth: float = 25e9
    gpus_per_node: int = 8


@dataclass
class Plan:
    layout: Layout
    psi: int  # parameters on one TP rank
    total_parameters: int
    memory: dict[str, float | None]
    activation_parts: dict[str, float] | None
    padding: int | None
    communication: dict[str, float | None]
    time: dict[str, float] | None
    gpu_memory: int | None
    fits: bool | None
    notes: list[str] = field(default_factory=list)
    peak: Moment | None = None  # the step's largest moment (None for a bare count)

    def to_dict(self) -> dict[str, Any]:
        out = dataclasses.asdict(self)
        out["layout"] = dataclasses.asdict(self.layout) | {
            "dp": self.layout.dp,
            "micro_batches": self.layout.micro_batches,
        }
        return out


def plan(
    layout: Layout,
    params: RankParameters,
    shape: TransformerShape | None = None,
    *,
    gpu_memory: int | None = None,
    reserve: int = 0,
    hardware: Hardware | None = None,
    flops_per_token: float | None = None,
    model_flops_per_token: float | None = None,
    backend: str = "nccl",
) -> Plan:
    """Memory, communication and (with `shape` and FLOPs per token) step time of `layout`.
    `flops_per_token` is what the GPUs execute (recomputation included), the model's
    own (`model_flops_per_token`) is for MFU. `memory["peak"]` is the step's peak per
    rank, `memory["total"]` that plus `reserve`; `backend="gloo"` for CPU runs (gloo's
    own collectives copy their buffers, hybrid.memory.peak)."""
    hardware = hardware or Hardware()
    stage, dp, tp = layout.zero_stage, layout.dp, layout.tp
    element, k = precision_bytes(layout.precision)
    grad = grad_element_bytes(layout.precision, layout.grad_reduce_dtype)
    notes: list[str] = []
    if params.exact:
        states: dict[str, float] = dict(
            zero_state_bytes(
                params.root,
                params.units,
                stage,
                dp,
                layout.precision,
                layout.bucket_mb,
                layout.micro_batches,
                layout.grad_reduce_dtype,
            )
        )
        padding: int | None = int(states.pop("padding"))
        buffers: float | None = states.pop("buffers")
        psi_padded = params.psi + padding  # what the DP collectives move
    else:
        states = model_state_bytes(stage, params.psi, dp, element, k, grad)
        padding, buffers, psi_padded = None, None, params.psi
        notes.append("a bare parameter count: model states only (no layout, no activations)")
    memory: dict[str, float | None] = dict(states)
    memory["model_states"] = sum(states.values())

    parts = None
    tp_bytes = None
    if shape is not None:
        parts = activation_bytes(
            shape,
            layout.micro_batch,
            tp,
            layout.sequence_parallel,
            layout.recompute,
            element,
            layout.recompute_every,
        )
        memory["activations"] = parts["total"]
        tp_bytes = tp_traffic_bytes(
            shape,
            layout.micro_batch,
            layout.micro_batches,
            tp,
            layout.sequence_parallel,
            layout.recompute,
            element,
            stage,
            params.replicated,
            layout.recompute_every,
            grad,
        )
    else:
        memory["activations"] = None
    memory["buffers"] = buffers
    peak = None
    if params.exact:
        peak = step_peak(step_layout(layout, backend), params.root, params.units, shape)
        memory["peak"] = peak.total
    else:  # no layout of buckets: the paper's model states are all there is
        memory["peak"] = memory["model_states"]
    memory["reserved"] = float(reserve)
    memory["total"] = memory["peak"] + reserve
    dp_bytes = dp_traffic_bytes(stage, psi_padded, dp, element, layout.micro_batches, grad)
    communication: dict[str, float | None] = {"dp_bytes": dp_bytes, "tp_bytes": tp_bytes}

    time = None
    if shape is not None and flops_per_token is not None and tp_bytes is not None:
        time = step_time(
            layout, shape, hardware, flops_per_token, model_flops_per_token, psi_padded, tp_bytes
        )
    fits = None if gpu_memory is None else memory["total"] <= gpu_memory
    return Plan(
        layout=layout,
        psi=params.psi,
        total_parameters=params.total,
        memory=memory,
        activation_parts=parts,
        padding=padding,
        communication=communication,
        time=time,
        gpu_memory=gpu_memory,
        fits=fits,
        notes=notes,
        peak=peak,
    )


def step_layout(layout: Layout, backend: str = "nccl") -> StepLayout:
    """What hybrid.memory.peak needs of a layout."""
    return StepLayout(
        stage=layout.zero_stage,
        dp=layout.dp,
        tp=layout.tp,
        sequence_parallel=layout.sequence_parallel,
        recompute=layout.recompute,
        recompute_every=layout.recompute_every,
        micro_batch=layout.micro_batch,
        micro_batches=layout.micro_batches,
        precision=layout.precision,
        bucket_mb=layout.bucket_mb,
        backend=backend,
        grad_reduce_dtype=layout.grad_reduce_dtype,
    )


def step_time(
    layout: Layout,
    shape: TransformerShape,
    hardware: Hardware,
    flops_per_token: float,
    model_flops_per_token: float | None,
    psi_padded: int,
    tp_bytes: float,
) -> dict[str, float]:
    """Seconds per optimizer step, by part (see the module docstring)."""
    element, _ = precision_bytes(layout.precision)
    grad = grad_element_bytes(layout.precision, layout.grad_reduce_dtype)
    tokens = layout.sequences * shape.seq_len
    compute = flops_per_token * tokens / (layout.gpus * hardware.peak_flops * hardware.efficiency)
    m = layout.micro_batches
    forward = compute / m / 3  # backward (with any recomputation) is the rest
    backward = compute / m - forward

    def link(ranks_in_group: int) -> float:
        inside = ranks_in_group <= hardware.gpus_per_node
        return hardware.intra_node_bandwidth if inside else hardware.inter_node_bandwidth

    tp_time = tp_bytes / link(layout.tp)
    dp, bandwidth = layout.dp, link(layout.tp * layout.dp)
    ring = psi_padded * (dp - 1) / dp / bandwidth
    reduce, gather = grad * ring, element * ring  # one reduce-scatter; one all-gather
    stage = layout.zero_stage
    publish = max(0.0, gather - forward) if layout.overlap_param_gather else gather
    if dp == 1:
        exposed = 0.0
    elif stage == 0:
        exposed = max(0.0, 2 * reduce - backward)
    elif stage == 1:
        exposed = max(0.0, reduce - backward) + publish
    elif stage == 2:
        exposed = m * max(0.0, reduce - backward) + publish
    else:
        exposed = m * (max(0.0, gather - forward) + max(0.0, gather + reduce - backward))
    dp_time = dp_traffic_bytes(stage, psi_padded, dp, element, m, grad) / bandwidth
    seconds = compute + tp_time + exposed
    result = {
        "compute_s": compute,
        "tp_s": tp_time,
        "dp_s": dp_time,
        "dp_exposed_s": exposed,
        "step_s": seconds,
        "tokens_per_s": tokens / seconds,
    }
    if model_flops_per_token is not None:
        result["mfu"] = (
            model_flops_per_token * tokens / (seconds * layout.gpus * hardware.peak_flops)
        )
    return result
