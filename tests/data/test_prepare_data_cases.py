"""Cases of tests/data/test_prepare_data.py that run in several processes
(hybrid.instruments.local_processes): the data phase of a job whose preparation outlasts the
collective timeout."""

from __future__ import annotations

import time
from typing import Any

import torch
import torch.distributed as dist

from hybrid.distributed.env import init_distributed, shutdown
from launch.config import Config, ConfigError, DataConfig
from launch.train import loop as training

TIMEOUT_S = 2.0  # the process group's; local rank 0 prepares for longer


def slow_preparation(corpus: str, cache_dir: str, delay_s: float, fail: bool) -> dict[str, Any]:
    """load_data with local rank 0 preparing for `delay_s` (then failing, with `fail`),
    under a process group whose collectives time out after TIMEOUT_S; then one
    all-reduce, which only works if every rank is still in the job."""
    env = init_distributed(TIMEOUT_S)
    real = training.prepare_data

    def slow(*args: Any, **kwargs: Any) -> Any:
        time.sleep(delay_s)
        if fail:
            raise ValueError(f"{corpus}: deliberately unreadable")
        return real(*args, **kwargs)

    if env.local_rank == 0:
        training.prepare_data = slow
    config = Config(data=DataConfig(files=[corpus], cache_dir=cache_dir, tokenizer="gpt2"))
    started = time.perf_counter()
    try:
        data = training.load_data(config, env, 16)
    except (
        ConfigError
    ) as error:  # as launch.train.entry: every rank alike, then the shutdown barrier
        shutdown(env)
        return {"error": str(error)}
    waited = time.perf_counter() - started
    total = torch.tensor([float(len(data.train))])
    dist.all_reduce(total)
    shutdown(env)
    return {"n_train": len(data.train), "total": float(total), "waited_s": waited}
