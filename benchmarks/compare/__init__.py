"""Side-by-side benchmark of our engine against DeepSpeed, PyTorch (DDP, FSDP2, DTensor TP,
FSDP2 + TP) and a plain single-process loop, on the same GPT, weights, data and batch.

`benchmarks/compare_systems.py` is the one command; each (system, configuration) runs as
its own torchrun job of `benchmarks.compare.worker`, which writes one JSON file per rank.
"""
