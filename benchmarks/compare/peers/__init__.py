"""The systems compared: ours, the plain-PyTorch references, torch's own parallelism and
DeepSpeed, each a trainer with the same interface (benchmarks/compare/worker.py)."""
