"""The full (tp=1, dp=1) model streamed out of an Engine's buckets, one bucket gathered at
a time: what a final export, a Hugging Face folder or a test reads. A rank holds its
shards plus one gathered bucket and one full tensor, never the whole model."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

import torch
from torch import nn

from hybrid.tensor_parallel import TensorParallel, parameter_shards
from hybrid.tensor_parallel.shards import gather_full
from hybrid.zero.bucket import FlatBucket
from hybrid.zero.gather import ParameterGatherer


def gathered_full_tensors(
    module: nn.Module,
    buckets: Sequence[FlatBucket],
    gatherer: ParameterGatherer | None,
    tp: TensorParallel,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tp=1 tensor) for every parameter, bucket by bucket. Every rank must run the
    iterator to its end (it gathers over DP at stage 3 and over TP). A yielded tensor may be
    a view of a buffer that is freed once the iterator moves on: copy or write it before."""
    specs = parameter_shards(module)
    for index, bucket in enumerate(buckets):
        if gatherer is not None:
            gatherer.gather(index)
        try:
            for name, param in zip(bucket.names, bucket.params, strict=True):
                yield name, gather_full(param.detach(), specs.get(name), tp.group)
        finally:
            if gatherer is not None:
                gatherer.free(index)
