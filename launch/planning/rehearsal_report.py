"""A rehearsal's measurements next to the planner's figures, each with measured / planned."""

from __future__ import annotations

from typing import Any

import torch

from hybrid.instruments.engine_memory import CATEGORIES
from hybrid.memory import Hardware, Plan
from launch.planning.rehearsal_request import Request, model_config, planned, planned_step_flops
from launch.planning.search import Model


def planned_categories(plan: Plan) -> dict[str, float]:
    """The planner's peak moment in the measured categories (hybrid.instruments.engine_memory): the
    model states split into parameters, gradients reduced so far and optimizer states;
    stage 3's gathered buckets are parameters, not buffers, and the weight gradients
    autograd holds (`Moment.autograd`) are autograd's, with the activations."""
    moment, memory = plan.peak, plan.memory
    assert moment is not None
    gathered = moment.parameters if plan.layout.zero_stage == 3 else 0.0
    params, optimizer = float(memory["parameters"] or 0), float(memory["optimizer"] or 0)
    return {
        "parameters": params + gathered,
        "gradients": moment.model_states - params - optimizer,
        "optimizer": optimizer,
        "activations": moment.activations + moment.autograd,
        "buffers": moment.buffers - gathered - moment.autograd,
        "total": moment.total,
    }


def _ratio(measured: float, planned: float) -> float | None:
    return measured / planned if planned else (1.0 if measured == 0 else None)


def compare(
    request: Request, plan: Plan, measured: dict[str, Any], device: torch.device
) -> dict[str, Any]:
    """The measurements next to the planner's figures, each with measured / planned."""
    config = request.config
    model_cfg, _ = model_config(config)
    window = config.train.seq_len or model_cfg.seq_len
    layout = plan.layout
    expected = planned_categories(plan)
    memory = {
        name: {
            "measured": measured["peak"][name],
            "planned": expected[name],
            "ratio": _ratio(measured["peak"][name], expected[name]),
        }
        for name in (*CATEGORIES, "total")
    }
    step_flops = planned_step_flops(request)  # then the rate measured
    rate, at_rate = None, {}
    if measured["step_s"] is not None:  # fake compute measures no time
        rate = step_flops / measured["step_s"]
        at_rate = planned(request, Hardware(peak_flops=rate, efficiency=1.0)).time or {}
    communication = {
        group: {
            "measured": measured["sent"].get(group, 0.0),
            "planned": plan.communication[f"{group}_bytes"] or 0.0,
            "ratio": _ratio(
                measured["sent"].get(group, 0.0), plan.communication[f"{group}_bytes"] or 0.0
            ),
        }
        for group in ("dp", "tp")
    }
    return {
        "config": request.name,
        "model": Model(request.name, model_cfg, window).describe(),
        "world": request.world,
        "rank": request.rank,
        **measured["topology"],
        "layout": layout.describe(),
        "precision": layout.precision,
        "device": str(device),
        "compute": measured["compute"],
        "peak_moment": plan.peak.name if plan.peak else None,
        "memory": memory,
        "built": measured["built"],
        "after_backward": measured["after_backward"],
        "allocator_peak": measured["allocator_peak"],
        "time": {
            "build_s": measured["build_s"],
            "first_step_s": measured["first_step_s"],
            "step_s": measured["step_s"],
            "timed_steps": measured["timed_steps"],
            "flops": step_flops,
            "counted_flops": measured["counted_flops"],
            "flops_ratio": _ratio(measured["counted_flops"], step_flops),
            "tflops": None if rate is None else rate / 1e12,
            "planned": {k: v for k, v in at_rate.items() if k != "mfu"},
        },
        "communication": communication,
        "collectives": measured["collectives"],
        "counter_bytes": measured["counter_bytes"],
    }
