"""hybrid: the parallel library (tensor parallelism, ZeRO, recomputation). Knows nothing of GPT."""
