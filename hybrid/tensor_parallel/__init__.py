"""Megatron-style tensor parallelism: conjugate collectives, split layers, vocab-parallel
loss, sequence parallelism and the TP-aware random stream."""

from hybrid.tensor_parallel.context import TensorParallel
from hybrid.tensor_parallel.cross_entropy import vocab_parallel_cross_entropy
from hybrid.tensor_parallel.grads import sync_sequence_parallel_grads
from hybrid.tensor_parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    VocabParallelEmbedding,
    VocabParallelOutput,
    attach_weight_gradient_sinks,
)
from hybrid.tensor_parallel.mappings import (
    copy_to_region,
    gather_from_region,
    gather_from_sequence,
    reduce_from_region,
    reduce_scatter_to_sequence,
    scatter_to_sequence,
)
from hybrid.tensor_parallel.random import TPRandom
from hybrid.tensor_parallel.shards import (
    ShardSpec,
    init_from_seed,
    named_full_tensors,
    parameter_shards,
)

__all__ = [
    "ColumnParallelLinear",
    "RowParallelLinear",
    "ShardSpec",
    "TPRandom",
    "TensorParallel",
    "VocabParallelEmbedding",
    "VocabParallelOutput",
    "attach_weight_gradient_sinks",
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
