"""Pretrain a GPT:

    torchrun --standalone --nproc_per_node N -m launch.pretrain \
        --config configs/tiny.yaml [key=value ...]

A plain `python -m launch.pretrain ...` runs the same job in one process.
"""

from __future__ import annotations

import sys

from launch.config import load_config
from launch.train.entry import check_before_start, run
from launch.train.loop import train

__all__ = ["check_before_start", "main", "train"]


def main(argv: list[str] | None = None) -> int:
    return run(
        argv, "python -m launch.pretrain", "Pretrain a GPT (run it under torchrun).", load_config
    )


if __name__ == "__main__":
    sys.exit(main())
