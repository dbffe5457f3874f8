"""The GPU section of benchmarks/compare_systems.py alone (benchmarks/compare/gpu.py):
single-GPU throughput and MFU of gpt2-1.5b in bf16, ours against plain PyTorch.

    python benchmarks/gpu/gpu_section.py [--gpu-micro-batches 1 2 4 8] [--gpu-steps 5] [--out F]
    python benchmarks/gpu/gpu_section.py --gpu-device cpu --gpu-model tiny   # no GPU: try it
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from benchmarks.compare import gpu


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    gpu.add_arguments(parser)
    parser.add_argument("--out", type=Path, help="also write the markdown lines here")
    args = parser.parse_args()
    text = "\n".join(gpu.section(args)) + "\n"
    print(text)
    if args.out is not None:
        args.out.write_text(text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
