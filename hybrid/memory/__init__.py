"""The planner: what fits where. Bytes per GPU and bytes sent per step for a model (given
as generic numbers: parameters per TP rank, a transformer's shape) on a parallel layout.

- model_states: ZeRO's model-state formulas (arXiv 1910.02054) and, exactly, the engine's
  padded buckets and transient communication buffers;
- activations: Korthikanti et al. 2022 (arXiv 2205.05198) per layer, with TP, sequence
  parallelism and recomputation, plus embedding, output and loss;
- peak: the moments of a training step, each with what is alive then, and the largest;
- communication: DP (ZeRO section 7) and TP (Megatron-LM) volumes per step;
- planner: Layout, Hardware, RankParameters, plan() -> Plan (with a step-time estimate);
- units: sizes with units (32GiB, 80GB, 25GB/s, 175B).
The GPT-specific numbers (parameter counts per rank from a GPTConfig) are in
models/gpt/accounting.py; the command line is launch/plan.py.
"""

from hybrid.memory.activations import (
    RECOMPUTE_MODES,
    TransformerShape,
    activation_bytes,
    layer_bytes,
    paper_layer_bytes,
    stored_activation_bytes,
)
from hybrid.memory.communication import dp_traffic_bytes, tp_traffic_bytes
from hybrid.memory.model_states import (
    ADAM_MIXED_K,
    bucket_numels,
    buffer_bytes,
    engine_state_bytes,
    grad_element_bytes,
    model_state_bytes,
    precision_bytes,
    zero_state_bytes,
)
from hybrid.memory.peak import BACKENDS, Moment, StepLayout, step_moments, step_peak
from hybrid.memory.planner import (
    Hardware,
    Layout,
    Plan,
    RankParameters,
    plan,
    step_layout,
    step_time,
)
from hybrid.memory.units import (
    format_count,
    parse_bandwidth,
    parse_bytes,
    parse_count,
    unit_bytes,
)

__all__ = [
    "ADAM_MIXED_K",
    "BACKENDS",
    "RECOMPUTE_MODES",
    "Hardware",
    "Layout",
    "Moment",
    "Plan",
    "RankParameters",
    "StepLayout",
    "TransformerShape",
    "activation_bytes",
    "bucket_numels",
    "buffer_bytes",
    "dp_traffic_bytes",
    "engine_state_bytes",
    "format_count",
    "grad_element_bytes",
    "layer_bytes",
    "model_state_bytes",
    "paper_layer_bytes",
    "parse_bandwidth",
    "parse_bytes",
    "parse_count",
    "plan",
    "precision_bytes",
    "step_layout",
    "step_moments",
    "step_peak",
    "step_time",
    "stored_activation_bytes",
    "tp_traffic_bytes",
    "unit_bytes",
    "zero_state_bytes",
]
