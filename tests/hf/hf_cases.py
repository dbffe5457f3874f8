"""Tiny random Hugging Face models and the worker functions of the import/export tests."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from tp_cases import in_process_group
from transformers import GPT2Config, GPT2LMHeadModel, LlamaConfig, LlamaForCausalLM

from hybrid.distributed.topology import Topology
from hybrid.engine import Engine, EngineConfig
from hybrid.recompute import Recompute, RecomputePolicy
from hybrid.tensor_parallel import TensorParallel
from models.gpt import GPT
from models.gpt.hf.folder import read_hf_folder

VOCAB = 1001  # not a multiple of 128, nor of tp=2: the vocabulary-parallel layers pad it


def make_hf(family: str, seed: int = 0) -> torch.nn.Module:
    """A randomly initialised GPT2LMHeadModel (3 layers, 6 heads) or LlamaForCausalLM
    (3 layers, 6 query heads on 2 kv heads, untied output): see `random_hf`."""
    gpt2 = dict(vocab_size=VOCAB, n_positions=32, n_embd=48, n_layer=3, n_head=6)
    llama = dict(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=80, num_hidden_layers=3,
        num_attention_heads=6, num_key_value_heads=2, max_position_embeddings=64,
        tie_word_embeddings=False, rope_theta=5000.0,
    )  # fmt: skip
    return random_hf(family, seed, gpt2 if family == "gpt2" else llama)


def random_hf(family: str, seed: int, sizes: dict[str, Any]) -> torch.nn.Module:
    """A GPT2LMHeadModel or LlamaForCausalLM of config `sizes`; every parameter, biases and
    norm gains included, gets noise on top of transformers' init, so a mapping that mixes
    up two tensors of the same shape cannot pass."""
    torch.manual_seed(seed)
    if family == "gpt2":
        config = GPT2Config(**sizes, bos_token_id=None, eos_token_id=None)
        model: torch.nn.Module = GPT2LMHeadModel(config)
    else:
        model = LlamaForCausalLM(LlamaConfig(**sizes))
    with torch.no_grad():
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    return model.eval()


def tokens(batch: int = 3, length: int = 17) -> torch.Tensor:
    """(batch, length) ids; inputs are [:, :-1] (16, even: splits under SP), targets [:, 1:]."""
    return torch.randint(0, VOCAB, (batch, length), generator=torch.Generator().manual_seed(7))


def hf_reference(model: torch.nn.Module) -> dict[str, Any]:
    """Transformers' logits of the inputs, its loss (it shifts the labels itself) and the
    loss's gradient norm over every parameter (torch.nn.utils.clip_grad_norm_)."""
    ids = tokens()
    with torch.no_grad():
        logits = model(ids[:, :-1]).logits
    model.zero_grad()
    loss = model(ids, labels=ids).loss
    loss.backward()
    norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
    model.zero_grad()
    return {"logits": logits, "loss": loss.item(), "grad_norm": norm}


def ours(model: GPT) -> dict[str, Any]:
    ids = tokens()
    with torch.no_grad():
        return {"logits": model(ids[:, :-1]), "loss": model(ids[:, :-1], ids[:, 1:]).item()}


def tp2_imports(folders: dict[str, str]) -> dict[str, Any]:
    """At tp=2, for each family's folder: logits and loss of the imported model without
    and with sequence parallelism, and the gradient norm of one backward through an
    Engine (under SP with full recompute, so the recomputed backward runs); and the loss
    and gathered weights of the model built on the meta device and materialised by a
    ZeRO-3 Engine from the imported tensors (GPT.initial_value)."""

    def work() -> dict[str, Any]:
        topology = Topology.build(2)
        results: dict[str, Any] = {}
        for family, folder in folders.items():
            config, weights = read_hf_folder(Path(folder))
            for sp in (False, True):
                tp = TensorParallel.from_topology(topology, 0, sp)
                recompute = RecomputePolicy(Recompute.FULL if sp else Recompute.NONE)
                model = GPT(config, tp, recompute, init_weights=weights).eval()
                results[f"{family}/sp={sp}"] = ours(model)
                engine = Engine(model, topology, tp, EngineConfig(), list(model.blocks))
                ids = tokens()
                engine.backward(engine(ids[:, :-1], ids[:, 1:]))
                results[f"{family}/sp={sp}"]["grad_norm"] = engine.step(0.0).grad_norm
            tp = TensorParallel.from_topology(topology, 0)
            meta = GPT(config, tp, device="meta", init_weights=weights).eval()
            engine = Engine(meta, topology, tp, EngineConfig(zero_stage=3), list(meta.blocks))
            ids = tokens()
            with torch.no_grad():
                results[f"{family}/zero3-loss"] = engine(ids[:, :-1], ids[:, 1:]).item()
            full = engine.full_state_dict()
            results[f"{family}/zero3-weights-equal"] = full.keys() == weights.keys() and all(
                torch.equal(full[name], weights[name].float()) for name in weights
            )
        return results

    return in_process_group(work)


UNPICKLED: list[str] = []


def _record_unpickling() -> str:
    UNPICKLED.append("ran")
    return "ran"


class Payload:
    """An object whose unpickling calls a function: what weights_only=True must refuse."""

    def __reduce__(self) -> tuple[Any, tuple]:
        return (_record_unpickling, ())


def next_token_logits(tp: int, folder: str, ids: torch.Tensor) -> torch.Tensor:
    """The last position's logits of the checkpoint in `folder`, imported at tensor-parallel
    degree `tp` (every rank reads the full tensors and keeps its slice)."""

    def work() -> torch.Tensor:
        topology = Topology.build(tp)
        config, weights = read_hf_folder(Path(folder))
        model = GPT(config, TensorParallel.from_topology(topology, 0), init_weights=weights)
        del weights  # each rank now holds only its TP slice
        with torch.no_grad():
            return model.eval()(ids)[:, -1]

    return in_process_group(work)
