"""Megatron-style tensor parallelism: conjugate collectives, split layers, vocab-parallel
loss, sequence parallelism and the TP-aware random stream."""

from .context import TensorParallel
from .cross_entropy import vocab_parallel_cross_entropy
from .grads import sync_sequence_parallel_grads
from .layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
)
from .mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from .random import TPRandom
from .shards import ShardSpec, init_from_seed, named_full_tensors, parameter_shards

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "TPRandom",
    "TensorParallel",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "copy_to_region",
    "gather_from_region",
    "gather_from_sequence",
    "init_from_seed",
    "named_full_tensors",
    "parameter_shards",
    "reduce_from_region",
    "reduce_scatter_to_sequence",
    "scatter_to_sequence",
    "sync_sequence_parallel_grads",
    "vocab_parallel_cross_entropy",
]
