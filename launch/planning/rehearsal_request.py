"""What a rehearsal is asked to run (one rank of a job) and the planner's plan of it."""

from __future__ import annotations

import dataclasses
from argparse import Namespace
from dataclasses import dataclass

from hybrid.memory import Hardware, Layout, Plan, parse_bytes
from launch.config import Config
from launch.data.tokenizers import tokenizer_size
from launch.planning.memory_check import run_model
from launch.planning.search import GPT2_TOKENS, Model, layout_options
from models.gpt import GPTConfig

# Kept free beside the planned peak: the process itself (torch's libraries, the CUDA
# context on a GPU), as launch.plan's default --reserve.
RESERVE = parse_bytes("1GiB")


class RehearsalError(ValueError):
    """A rehearsal that cannot run; the message names the numbers and the fix."""


@dataclass(frozen=True)
class Request:
    config: Config  # with --layers applied
    name: str  # the preset or file
    world: int
    rank: int
    steps: int = 2
    memory_limit: int | None = None  # None: this machine's free memory
    compute: str = "fake"  # "fake": shapes only (memory, FLOPs, bytes); "real": also time


def with_layers(config: Config, layers: int | None) -> Config:
    """The config with only `layers` transformer layers, at full width."""
    if layers is None:
        return config
    if not 1 <= layers <= config.model.n_layer:
        raise RehearsalError(
            f"--layers {layers} must be between 1 and the model's {config.model.n_layer}"
        )
    return dataclasses.replace(config, model=dataclasses.replace(config.model, n_layer=layers))


def model_config(config: Config) -> tuple[GPTConfig, int]:
    """The model this rank builds, its vocabulary sized from the tokenizer as a run sizes
    it (launch.planning.memory_check.run_model), and the number of real token ids, among which the
    synthetic tokens are drawn."""
    n_tokens = GPT2_TOKENS if config.data.tokenizer == "gpt2" else tokenizer_size(config.data)
    model = run_model(config, n_tokens)
    return model, min(n_tokens, model.vocab_size or n_tokens)


def planned(request: Request, hardware: Hardware | None = None, device_type: str = "cpu") -> Plan:
    """The planner's plan of this rank's layout on `device_type`; collectives as NCCL's
    (the fake group, like NCCL, allocates nothing of its own)."""
    config = request.config
    model, _ = model_config(config)
    layout = Layout(
        gpus=request.world, bucket_mb=config.parallel.bucket_mb, **layout_options(config)
    )
    args = Namespace(
        gpu_memory=None,
        reserve=RESERVE,
        hardware=hardware or Hardware(),
        backend="nccl",
        device_type=device_type,
    )
    return Model(request.name, model, config.train.seq_len or model.seq_len).plan(layout, args)


def planned_step_flops(request: Request) -> float:
    """FLOPs this rank executes in one step, as the planner counts them (recomputation's
    extra forward included): its compute time at 1 FLOP/s."""
    return (planned(request, Hardware(peak_flops=1.0, efficiency=1.0)).time or {})["compute_s"]
