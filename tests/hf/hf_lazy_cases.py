"""Tiny Hugging Face folders and the 2-process worker of the lazy-import tests."""

from __future__ import annotations

from typing import Any

import torch
from hf_cases import random_hf
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT
from models.gpt.hf.folder import hf_to_ours, read_hf_config, read_hf_weights
from models.gpt.hf.lazy import open_hf_weights

VOCAB = 1001  # divides by neither tp=2 nor tp=4: the vocabulary split pads


def make_hf(family: str) -> torch.nn.Module:
    """A random GPT-2 (4 heads, tied) or Llama (8 query heads on 4 kv heads, untied) that
    splits at tp=1, 2 and 4, with noise on every parameter (no symmetry passes a test)."""
    gpt2 = dict(vocab_size=VOCAB, n_positions=16, n_embd=32, n_layer=2, n_head=4)
    llama = dict(
        vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
        num_attention_heads=8, num_key_value_heads=4, max_position_embeddings=32,
        tie_word_embeddings=False,
    )  # fmt: skip
    return random_hf(family, 0 if family == "gpt2" else 1, gpt2 if family == "gpt2" else llama)


def engine_shards(folder: str) -> dict[str, Any]:
    """At tp=2 (dp=1) and at dp=2 ZeRO-3 (tp=1): each rank's parameter shards after an
    Engine materialised the model from the lazy source and from the eager tensors (the
    old path: hf_to_ours of the whole files), and the lazy engine's gathered weights."""

    def work() -> dict[str, Any]:
        config = read_hf_config(folder)
        eager = hf_to_ours(read_hf_weights(folder), config)
        results: dict[str, Any] = {"eager-full": eager}
        for layout, tp, stage in (("tp2", 2, 0), ("dp2-zero3", 1, 3)):
            topology = Topology.build(tp)
            tensor_parallel = TensorParallel.from_topology(topology, 0)
            for kind in ("lazy", "eager"):
                weights = open_hf_weights(folder, config) if kind == "lazy" else eager
                model = GPT(config, tensor_parallel, device="meta", init_weights=weights)
                engine = Engine(
                    model, topology, tensor_parallel, EngineConfig(zero_stage=stage),
                    list(model.blocks),
                )  # fmt: skip
                model.forget_initial_weights()
                results[f"{layout}/{kind}"] = [s.param_shard.clone() for s in engine.states]
                if kind == "lazy":
                    results[f"{layout}/full"] = engine.full_state_dict()
        return results

    return in_process_group(work)
