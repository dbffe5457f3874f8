"""Workers for tests/any_model/test_wrap.py (run on every rank of a dp=2 job)."""

from __future__ import annotations

import gc
from pathlib import Path
from typing import Any, ClassVar

import tiny_models as tm
import torch
from torch.distributed._tools.mem_tracker import MemTracker, _MemRefType, _ModState
from torch.utils._python_dispatch import TorchDispatchMode
from tp_cases import in_process_group

from hybrid.distributed.topology import Topology
from hybrid.engine import EngineConfig
from hybrid.wrap import wrap

LR, DECAY, STEPS = 1e-3, 0.1, 5


def reference_losses(kind: str) -> tuple[list[float], dict[str, torch.Tensor]]:
    """A plain single-process loop: the whole batch, torch's AdamW."""
    model = tm.build(kind)
    optimizer, loss_of = tm.adamw(model, LR, DECAY), tm.loss_of(kind)
    losses = []
    for step in range(STEPS):
        loss = loss_of(model, *tm.batch(kind, step))
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, {name: p.detach().clone() for name, p in model.named_parameters()}


def wrapped_losses(
    kind: str, stage: int, topology: Topology, own_checkpointing: bool = False, **options: Any
) -> dict[str, Any]:
    """The same model and data through hybrid.wrap, this rank's rows of each batch;
    `own_checkpointing`: the model's own gradient checkpointing (transformers'), which
    runs each layer's hooks again inside backward."""
    model = tm.build(kind)
    if options.get("values") == "state dict":  # the same weights, given to a meta model
        options["values"] = model.state_dict()
        model = tm.build(kind, device="meta")
    if own_checkpointing:
        model.gradient_checkpointing_enable({"use_reentrant": True})
    engine = wrap(model, topology, EngineConfig(zero_stage=stage, weight_decay=DECAY), **options)
    rows = slice(topology.dp_rank * 2, topology.dp_rank * 2 + 2)
    loss_of, losses = tm.loss_of(kind), []
    for step in range(STEPS):
        x, y = tm.batch(kind, step)
        loss = loss_of(engine, x[rows], y[rows])
        engine.backward(loss)
        engine.step(LR)
        losses.append(float(topology.dp_group.all_reduce(loss.detach().clone())) / topology.dp)
    laid_out = sum(b.numel - b.padding for b in engine.buckets)
    exported = None
    if stage == 3 and kind != "vit" and not options and not own_checkpointing:
        exported = export_and_reload(engine, model, topology, x[rows])
    return {
        "exported": exported,
        "losses": losses,
        "final": engine.full_state_dict(),
        "laid_out": laid_out,
        "units": len(engine.buckets) - 1,
    }


def export_and_reload(engine: Any, model: Any, topology: Topology, x: torch.Tensor) -> float | None:
    """Rank 0 writes the trained model as a Hugging Face folder in files of at most 20 kB
    (sharded, with an index) while the others stream their shards to it; rank 0 then loads
    it with from_pretrained: the largest difference of its logits from the engine's."""
    import tempfile

    from transformers import AutoModelForCausalLM

    from hybrid.checkpoint.full_state import full_tensor_layout
    from models.hf_native.export import write_native_export

    with torch.no_grad():
        ours = engine(input_ids=x).logits
    if topology.rank != 0:
        for _ in engine.full_tensors():
            pass
        return None
    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(tmp) / "export"
        layout = full_tensor_layout(engine)
        write_native_export(folder, model.config, layout, engine.full_tensors(), 20_000)
        assert (folder / "model.safetensors.index.json").is_file()
        loaded = AutoModelForCausalLM.from_pretrained(str(folder)).eval()
        with torch.no_grad():
            theirs = loaded(input_ids=x).logits
    return (ours - theirs).abs().max().item()


def every_stage(kind: str) -> dict[str, Any]:
    """Stages 0-3 (and stage 3 with recomputation) against the reference, in one job."""

    def work() -> dict[str, Any]:
        topology = Topology.build(1)
        out = {s: wrapped_losses(kind, s, topology) for s in range(4)}
        out["3+recompute"] = wrapped_losses(kind, 3, topology, recompute=True)
        out["3+own checkpointing"] = wrapped_losses(kind, 3, topology, own_checkpointing=True)
        out["3+meta from a state dict"] = wrapped_losses(kind, 3, topology, values="state dict")
        out["reference"], out["reference_final"] = reference_losses(kind)
        out["unique_elements"] = sum(p.numel() for p in tm.build(kind).parameters())
        return out

    return in_process_group(work)


class RandomDraws(TorchDispatchMode):
    """Counts, at torch's dispatcher, the elements every random draw (normal_, uniform_)
    makes on a real device: the largest one and their total."""

    RANDOM: ClassVar = {torch.ops.aten.normal_.default, torch.ops.aten.uniform_.default}

    def __init__(self) -> None:
        super().__init__()
        self.largest, self.total = 0, 0

    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: Any = None):
        out = func(*args, **(kwargs or {}))
        if func in self.RANDOM and out.device.type != "meta":
            self.largest = max(self.largest, out.numel())
            self.total += out.numel()
        return out


def meta_stage3(kind: str) -> dict[str, Any]:
    """A model built on meta, wrapped at stage 3: what initialising it wrote on this rank,
    and one training step's loss (the values must be usable)."""

    def work() -> dict[str, Any]:
        topology = Topology.build(1)
        model = tm.build(kind, device="meta", layers=6)
        elements = sum(p.numel() for p in model.parameters())
        tied = model.get_output_embeddings() is not None and (
            model.get_output_embeddings().weight is model.get_input_embeddings().weight
        )
        tied_elements = model.get_input_embeddings().weight.numel() if tied else 0
        counter = RandomDraws()
        with counter:
            engine = wrap(model, topology, EngineConfig(zero_stage=3))
        x, y = tm.batch(kind, 0)
        rows = slice(topology.dp_rank * 2, topology.dp_rank * 2 + 2)
        loss = tm.loss_of(kind)(engine, x[rows], y[rows])
        engine.backward(loss)
        engine.step(LR)
        full = engine.full_state_dict()
        pieces = [end - start for b in engine.buckets for _, start, end, _ in b.pieces()]
        return {
            "largest_draw": counter.largest,
            "drawn": counter.total,
            "elements": elements,
            "tied": tied_elements,
            "largest_piece": max(pieces),
            "shard_total": sum(b.shard_numel for b in engine.buckets),
            "loss": loss.item(),
            "std": {n: t.std().item() for n, t in full.items() if t.dim() >= 2},
        }

    return in_process_group(work)


def stage3_memory(kind: str) -> dict[str, Any]:
    """Gathered parameters (MemTracker's Parameter category) at the forward and backward
    peaks of a second ZeRO-3 step, with the bucket sizes for the bound."""

    def work() -> dict[str, Any]:
        topology = Topology.build(1)
        model = tm.build(kind, layers=6)
        engine = wrap(model, topology, EngineConfig(zero_stage=3))
        x, y = tm.batch(kind, 0)
        rows = slice(topology.dp_rank * 2, topology.dp_rank * 2 + 2)
        loss_of = tm.loss_of(kind)
        engine.backward(loss_of(engine, x[rows], y[rows]))
        engine.step(LR)
        gc.collect()
        live = [t for t in gc.get_objects() if isinstance(t, torch.Tensor)]
        tracker = MemTracker()
        tracker.track_external(model, engine.optimizer, *live)
        with tracker:
            engine.backward(loss_of(engine, x[rows], y[rows]))
        snapshots = tracker.memory_tracking[model].snapshots
        cpu = torch.device("cpu")

        def params(state: _ModState) -> int:
            return snapshots[state][-1][cpu][_MemRefType("Parameter")]

        engine.step(LR)
        return {
            "forward": params(_ModState.PEAK_FW),
            "backward": params(_ModState.PEAK_BW),
            "root": engine.buckets[0].numel * 4,
            "unit": max(b.numel for b in engine.buckets[1:]) * 4,
            "units": len(engine.buckets) - 1,
        }

    return in_process_group(work)
