"""Will the run's layout fit? The planner's peak per rank (launch.plan, hybrid.memory) for
the layout a run is configured with, against the device's memory, before start-up.

The device's memory is `train.memory_limit` when it is set, else the GPU's size on CUDA;
on CPU without a limit nothing is checked. A layout whose planned peak is larger stops the
launch with one line: both numbers and the nearest layout of the same world size that fits
(from the planner's `--search`: the fewest changed options, then the fastest), or that
none does. `train.memory_check=warn` prints the same line as a warning and runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import os
import sys
import warnings
from typing import Any

import torch

from hybrid.memory import Hardware, Layout, Plan, parse_bytes
from launch.config import Config, ConfigError, validate, validate_layout
from launch.planning.search import Model, layout_options, search
from models.gpt import GPTConfig, pad_vocab_size
from models.hf_native.causal_lm import HFCausalLM

# On CUDA the device also holds what the planner's terms do not see (CUDA context, NCCL
# buffers, fragmentation): launch.plan's default --reserve, added for the check only.
CUDA_RESERVE = parse_bytes("1GiB")

# The options a search may change, with the config key each one is; the rest of the
# layout (global batch, precision, recompute_every) changes the training itself.
FREE_OPTIONS = {
    "tp": "parallel.tp",
    "zero_stage": "parallel.zero_stage",
    "sequence_parallel": "parallel.sequence_parallel",
    "recompute": "parallel.recompute",
    "micro_batch": "train.micro_batch_size",
}


def run_model(config: Config, n_tokens: int) -> GPTConfig:
    """The model the run builds: the vocabulary sized from the tokenizer as build_model
    sizes it (padded to a multiple of 128) unless the config fixes it."""
    m = config.model
    if m.vocab_size is not None:
        return m
    return dataclasses.replace(m, vocab_size=pad_vocab_size(n_tokens))


def _plan_args(
    config: Config, gpus: int, device_type: str, limit: int | None, reserve: int
) -> argparse.Namespace:
    """What launch.plan's Model.plan and search read from their command line: the free
    options unset (None), the others fixed to the run's."""
    fixed = {k: v for k, v in layout_options(config).items() if k not in FREE_OPTIONS}
    return argparse.Namespace(
        gpus=gpus,
        gpu_memory=limit,
        reserve=reserve,
        backend="nccl" if device_type == "cuda" else "gloo",  # as hybrid.distributed.env picks
        hardware=Hardware(),  # only ranks fitting layouts by estimated step time
        bucket_mb=config.parallel.bucket_mb,  # the engine's (launch.train.setup)
        **dict.fromkeys(FREE_OPTIONS),
        **fixed,
    )


def planned_peak(
    config: Config,
    model: GPTConfig,
    gpus: int,
    device_type: str = "cpu",
    limit: int | None = None,
    reserve: int = 0,
) -> Plan:
    """The planner's plan of the run's layout on `gpus` ranks of `device_type`:
    memory["peak"] is the peak of a step per rank, memory["total"] that plus `reserve`
    (what must fit in `limit`)."""
    args = _plan_args(config, gpus, device_type, limit, reserve)
    layout = Layout(gpus=gpus, bucket_mb=args.bucket_mb, **layout_options(config))
    return _planner_model(config, model).plan(layout, args)


def planned_peak_bytes(config: Config, model: GPTConfig, gpus: int, device_type: str) -> int | None:
    """The planned peak of a step per rank, which a run logs beside its measured peak (no
    reserve: neither RSS growth nor the CUDA allocator sees the CUDA context); None, with a
    warning, when the planner fails on this model: a prediction must never stop a run."""
    try:
        return int(planned_peak(config, model, gpus, device_type).memory["peak"] or 0)
    except Exception as error:
        warnings.warn(f"the planner failed on this layout ({error!r})", stacklevel=2)
        return None


def _planner_model(config: Config, model: GPTConfig) -> Model:
    window = config.train.seq_len or model.seq_len
    if config.model_source == "hf":  # counted from the model itself, built on meta
        return Model(str(config.init_from), None, window, native=native_model(config))
    return Model("run", model, window)


@functools.cache
def _native(folder: str) -> HFCausalLM:
    return HFCausalLM(folder, read_weights=False)


def native_model(config: Config) -> HFCausalLM:
    """The Hugging Face model of `init_from` on meta (weights not read), built once."""
    return _native(str(config.init_from))


def memory_limit(config: Config, device: torch.device) -> tuple[int, str] | None:
    """The device's memory and how to name it, or None when it is not known (CPU)."""
    if config.train.memory_limit is not None:
        text = config.train.memory_limit
        return parse_bytes(text, "train.memory_limit"), f"train.memory_limit={text}"
    if device.type == "cuda":
        size = torch.cuda.get_device_properties(device).total_memory
        return size, f"the {format_bytes(size)} of {device}"
    return None


def local_device() -> torch.device:
    """The device this rank will train on (as hybrid.distributed.env picks it), without
    starting anything."""
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
    return torch.device("cpu")


def check_memory(config: Config, world_size: int, n_tokens: int) -> None:
    """Stop (ConfigError) or, with train.memory_check=warn, warn on rank 0 when the
    planner's peak for the run's layout exceeds the device's memory."""
    device = local_device()
    known = memory_limit(config, device)
    if known is None:
        return
    limit, named = known
    reserve = CUDA_RESERVE if device.type == "cuda" else 0
    model = run_model(config, n_tokens)
    peak = planned_peak(config, model, world_size, device.type, limit, reserve).memory["total"]
    peak = peak or 0.0
    if peak <= limit:
        return
    reserved = f" (with {format_bytes(reserve)} reserved for CUDA)" if reserve else ""
    message = (
        f"the planned peak memory per rank, {format_bytes(peak)}{reserved}, exceeds "
        f"{named} ({format_bytes(limit)}) for {_describe(layout_options(config))} on "
        f"{world_size} rank{'s' if world_size > 1 else ''}; "
        f"{nearest_fit_text(config, model, world_size, device.type, limit, reserve)}"
    )
    if config.train.memory_check == "stop":
        raise ConfigError(f"{message}; or set train.memory_check=warn to run anyway")
    if os.environ.get("RANK", "0") == "0":
        print(f"warning: {message} (train.memory_check=warn: running anyway)", file=sys.stderr)


def nearest_fit_text(
    config: Config, model: GPTConfig, gpus: int, device_type: str, limit: int, reserve: int
) -> str:
    """The nearest fitting layout as overrides to paste, or the smallest peak of all."""
    args = _plan_args(config, gpus, device_type, limit, reserve)
    current = layout_options(config)
    plans = search(args, _planner_model(config, model), current)
    plans = [p for p in plans if _accepted(config, p, gpus)]
    fitting = [p for p in plans if p.fits]
    if not fitting:
        if not plans:
            return "the planner found no valid layout of this world size"
        least = min(plans, key=lambda p: p.memory["total"] or 0.0)
        return (
            f"no layout of {gpus} ranks fits: the smallest planned peak is "
            f"{format_bytes(least.memory['total'] or 0.0)} "
            f"({_overrides(least, current) or 'this layout'}); use more ranks or a smaller model"
        )
    # search() orders fitting layouts by estimated step time; min keeps that order on ties.
    best = min(fitting, key=lambda p: len(_changes(p, current)))
    return (
        f"the nearest layout that fits: {_overrides(best, current)} "
        f"(planned {format_bytes(best.memory['total'] or 0.0)})"
    )


def _changes(p: Plan, current: dict[str, Any]) -> dict[str, Any]:
    return {
        key: getattr(p.layout, key)
        for key in FREE_OPTIONS
        if getattr(p.layout, key) != current[key]
    }


def _overrides(p: Plan, current: dict[str, Any]) -> str:
    return " ".join(f"{FREE_OPTIONS[k]}={_yaml(v)}" for k, v in _changes(p, current).items())


def _accepted(config: Config, p: Plan, gpus: int) -> bool:
    """Whether the run's own checks take this layout (they know rules the planner does
    not, e.g. sequence length against tp), so a suggestion is one that starts."""
    layout = p.layout
    candidate = dataclasses.replace(
        config,
        parallel=dataclasses.replace(
            config.parallel,
            tp=layout.tp,
            zero_stage=layout.zero_stage,
            sequence_parallel=layout.sequence_parallel,
            recompute=layout.recompute,
        ),
        train=dataclasses.replace(config.train, micro_batch_size=layout.micro_batch),
    )
    try:
        validate(candidate)
        validate_layout(candidate, gpus)
    except ConfigError:
        return False
    return True


def _describe(options: dict[str, Any]) -> str:
    return ", ".join(f"{FREE_OPTIONS[k]}={_yaml(options[k])}" for k in FREE_OPTIONS)


def _yaml(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def format_bytes(n: float) -> str:
    """1.50 GiB, 52.3 MiB, 912 KiB: binary units, as train.memory_limit is usually written."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f} {unit}" if unit in ("TiB", "GiB") else f"{n / size:.1f} {unit}"
    return f"{n:.0f} B"
