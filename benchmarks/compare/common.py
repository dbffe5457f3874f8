"""What every system shares: the model shape, the data, the optimizer's hyper-parameters,
the training loop that times it, and the measurements taken the same way for all.

Measurements, all per rank (metrics.py has the instruments):
- step time: wall clock of forward + backward + optimizer step + reading the loss (which
  waits for the step), after `warmup` untimed steps;
- peak memory: the most the process held during the timed steps, above its own baseline
  read after imports and process-group start and before the model is built
  (metrics.PeakMeter: VmHWM reset just before the timed steps, minus the baseline VmRSS;
  on CUDA torch.cuda.max_memory_allocated over the same window). The same instrument for
  every system; no system's own accounting is used;
- model states: the storages of parameters, gradients and optimizer states (moments,
  master copies) alive at the end of the last warm-up step's backward, each storage once,
  found by walking Python's objects and sized by us (metrics.live_tensor_bytes); what a
  system preallocates for communication (DeepSpeed's reduce buckets) and any other live
  tensor are counted apart, never as model states;
- communication: every collective that reaches a process group, counted where all systems
  meet, at torch's dispatcher: the `c10d::` operators (dist.* calls, DDP's C++ reducer,
  FSDP2, DeepSpeed) and the functional collectives (`_c10d_functional::`, DTensor's path),
  during the last warm-up step; bytes follow hybrid.distributed.comm's convention (all-reduce
  and broadcast: the tensor; all-gather: the gathered output; reduce-scatter: the input).
"""

from __future__ import annotations

import contextlib
import gzip
import json
import os
import platform
import statistics
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from models.gpt import GPT, GPTConfig

from .initial_weights import seeded_weights
from .metrics import CommCounter, PeakMeter, settled_tensor_bytes

SEED = 1234
ROOT = Path(__file__).resolve().parents[2]
CORPUS = ROOT / "launch" / "assets" / "shakespeare.txt.gz"


@dataclass(frozen=True)
class BenchConfig:
    """The model, batch and optimizer every system runs. Tokens are the corpus's bytes, so
    the vocabulary is 256. The default model has 57M parameters (8 layers x d_model 768):
    in fp32 its model states are 0.9 GB per rank at stage 0 and 0.4 GB at stage 3, against
    about 70 MB of activations for its 2 x 128 tokens per rank and 0.2-0.3 GB of import
    baseline, so the parameters dominate every memory figure. `quick()` is the small model
    (3.3M parameters) for checking the harness in a few minutes: there the import
    baselines and fixed costs swamp the figures."""

    n_layer: int = 8
    n_head: int = 12
    d_model: int = 768
    seq_len: int = 128
    vocab_size: int = 256
    global_batch: int = 4  # sequences per optimizer step, split over DP ranks
    steps: int = 4  # timed steps
    warmup: int = 2  # untimed steps before them; the last one is instrumented
    lr: float = 3e-4  # at 1e-3 this model spikes in its first steps, and a spike amplifies
    # rounding differences past 1e-5: the loss check would compare chaos, not arithmetic
    grad_clip: float = 1.0
    weight_decay: float = 0.1
    betas: tuple[float, float] = (0.9, 0.95)
    eps: float = 1e-8
    bucket_mb: float = 25.0  # our bucket cap; DDP's default and DeepSpeed's bucket sizes
    fused_adamw: bool = True  # every system steps the same torch AdamW kernel (ours: fused)
    ours_draws_weights: bool = True  # as a user's job; False: the peers' file (peer_speed)
    device: str = "cpu"
    # bf16: ours' bf16 engine, autocast for the peers, FSDP2's policy, DeepSpeed's bf16.
    # The default on CUDA; on CPU only where the CPU has native bf16 matrix kernels.
    precision: str = "fp32"

    @classmethod
    def quick(cls, **overrides: Any) -> BenchConfig:
        """The small model: 4 layers x d_model 256, 3.3M parameters."""
        small = dict(n_layer=4, n_head=4, d_model=256, seq_len=256, global_batch=8, steps=5)
        return cls(**{**small, **overrides})

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            n_layer=self.n_layer,
            n_head=self.n_head,
            d_model=self.d_model,
            seq_len=self.seq_len,
            vocab_size=self.vocab_size,
            dropout=0.0,
        )

    def parameter_count(self) -> int:
        model = GPT(self.gpt_config(), device="meta")  # shapes only, nothing drawn
        return sum(p.numel() for p in model.parameters())

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    @property
    def bf16(self) -> bool:
        return self.precision == "bf16"

    def bucket_elements(self) -> int:
        """Our bucket cap in elements of the training dtype (DeepSpeed counts elements)."""
        return int(self.bucket_mb * 2**20 / (2 if self.bf16 else 4))


# Systems and their families. `ours` covers every layout of our engine; `floor` is no
# system but a bound: the plain loop on every DP rank with no communication at all.
PEERS = ("plain", "ddp", "fsdp2", "dtensor_tp", "fsdp2_tp", "deepspeed")
SYSTEMS = ("ours", *PEERS, "floor")


@dataclass(frozen=True)
class JobSpec:
    """One (system, configuration): a torchrun job of `world` = dp x tp processes."""

    system: str
    dp: int = 1
    tp: int = 1
    stage: int = 0  # ZeRO stage (ours, DeepSpeed); FSDP2 is stage 3, DDP stage 0
    recompute: bool = False  # full recomputation of every transformer block
    bench: BenchConfig = field(default_factory=BenchConfig)

    @property
    def world(self) -> int:
        return self.dp * self.tp

    @property
    def layout(self) -> str:
        if self.world == 1:
            return "1 process"
        parts = [f"tp={self.tp}"] if self.tp > 1 else []
        parts += [f"dp={self.dp}"] if self.dp > 1 else []
        return " x ".join(parts)

    @property
    def label(self) -> str:
        name = {
            "ours": f"ours stage {self.stage}",
            "deepspeed": f"DeepSpeed stage {self.stage}",
            "plain": "plain PyTorch",
            "floor": "floor: plain PyTorch per rank, no communication",
            "ddp": "DDP",
            "fsdp2": "FSDP2",
            "dtensor_tp": "DTensor TP + loss_parallel",
            "fsdp2_tp": "FSDP2 + DTensor TP",
        }[self.system]
        return f"{name}, {self.layout}" + (", recompute" if self.recompute else "")

    @property
    def group(self) -> str:
        """Configurations that compete: same layout, same ZeRO stage, same recompute."""
        return f"{self.layout} | stage {self.stage} | {'full' if self.recompute else 'none'}"

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> JobSpec:
        raw = json.loads(text)
        bench = raw.pop("bench")
        bench["betas"] = tuple(bench["betas"])
        return cls(bench=BenchConfig(**bench), **raw)


# ---- model, data, optimizer -----------------------------------------------------------------


def initial_state(bench: BenchConfig) -> dict[str, torch.Tensor]:
    """Our GPT's weights at tp=1 from SEED: the weights every system starts from (ours
    draws the same full tensors and slices them, hybrid.tensor_parallel.shards)."""
    return seeded_weights(bench.gpt_config(), SEED)


def global_batches(bench: BenchConfig) -> list[torch.Tensor]:
    """(global_batch, seq_len + 1) windows of the bundled corpus's bytes per step, drawn
    from SEED: the same global batches for every system."""
    with gzip.open(CORPUS, "rb") as f:
        corpus = torch.from_numpy(np.frombuffer(f.read(), dtype=np.uint8).copy())
    window = bench.seq_len + 1
    generator = torch.Generator().manual_seed(SEED)
    batches = []
    for _ in range(bench.warmup + bench.steps):
        starts = torch.randint(
            0, corpus.numel() - window, (bench.global_batch,), generator=generator
        )
        batches.append(torch.stack([corpus[s : s + window] for s in starts.tolist()]).long())
    return batches


def local_batch(batch: torch.Tensor, dp_rank: int, dp: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This DP rank's contiguous rows of the global batch, as (inputs, targets)."""
    if batch.shape[0] % dp:
        raise ValueError(f"global batch {batch.shape[0]} is not divisible by dp={dp}")
    rows = batch.shape[0] // dp
    mine = batch[dp_rank * rows : (dp_rank + 1) * rows]
    return mine[:, :-1].contiguous(), mine[:, 1:].contiguous()


def adamw_groups(
    named: list[tuple[str, torch.nn.Parameter]], weight_decay: float
) -> list[dict[str, Any]]:
    """Our engine's rule: decay matrices and embeddings (dim >= 2), not biases or norms.
    Parameters of different kinds (plain tensors, DTensors per mesh) go into separate
    groups: torch's fused and foreach AdamW refuse to mix them in one call."""
    groups: dict[tuple[bool, str], list[torch.nn.Parameter]] = {}
    for _, p in named:
        mesh = getattr(p, "device_mesh", None)
        groups.setdefault((p.dim() >= 2, "" if mesh is None else repr(mesh)), []).append(p)
    return [
        {"params": params, "weight_decay": weight_decay if decay else 0.0}
        for (decay, _), params in groups.items()
    ]


def make_adamw(groups: list[dict[str, Any]], bench: BenchConfig) -> torch.optim.AdamW:
    """The peers' optimizer: torch AdamW with our hyper-parameters (DeepSpeed gets it as
    its client optimizer, so nothing of DeepSpeed's is compiled)."""
    return torch.optim.AdamW(
        groups, lr=bench.lr, betas=bench.betas, eps=bench.eps, fused=bench.fused_adamw or None
    )


def load_lazy_imports(device: torch.device) -> None:
    """Import, before any system's baseline, what torch imports on first use whichever
    system triggers it: torch's first optimizer constructor imports torch._dynamo (with
    sympy, DTensor and FSDP: about 70 MB resident here), and its first fused step loads
    that kernel. Without this the baseline of a system whose adapter happened to import
    DTensor early (the torch peers) already held part of it while ours paid it after its
    baseline, inside its measured peak."""
    import torch.distributed.fsdp
    import torch.distributed.tensor

    param = torch.nn.Parameter(torch.zeros(8, device=device))
    optimizer = torch.optim.AdamW([param], fused=True)
    param.grad = torch.zeros_like(param)
    optimizer.step()


# ---- the loop -------------------------------------------------------------------------------


class Trainer(Protocol):
    """A system ready to train: what the shared loop needs from it."""

    def forward(self, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
        """Forward of this rank's batch: the local mean loss, attached to the graph."""
        ...

    def backward(self, loss: torch.Tensor) -> None: ...

    def optimizer_step(self) -> None: ...

    def tensor_roles(self) -> dict[str, list[torch.Tensor]]:
        """Where this rank's tensors live, by role (metrics.ROLES): `parameters` (the
        tensors that hold its parameters or their local shards), and, where the system
        keeps them outside `.grad` and torch's optimizer state, `gradients` and
        `optimizer`; `buffers`: what it preallocates for communication. Only where the
        tensors are: their bytes are measured (metrics.live_tensor_bytes)."""
        ...

    def reported(self) -> dict[str, Any]:
        """What the system reports about itself (our engine's own byte counts)."""
        ...


def forward_backward(trainer: Trainer, x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """One forward and backward; the local mean loss, detached (a DTensor's local part)."""
    loss = trainer.forward(x, y)
    trainer.backward(loss)
    local = getattr(trainer, "local_loss", None)
    return (local(loss) if local else loss).detach()


def train(
    trainer: Trainer,
    batches: list[tuple[torch.Tensor, torch.Tensor]],
    warmup: int,
    meter: PeakMeter,
) -> dict:
    """Run every batch; time the steps after `warmup`, and take the peak memory over
    exactly those steps (`meter` is reset just before the first, read after the last);
    instrument the last warm-up step (communication, and model states at the end of its
    backward): its timing is not used, so the counting costs nothing."""
    if warmup < 2:
        raise ValueError("warmup must be at least 2: optimizer states exist from step 2 on")
    if len(batches) <= warmup:
        raise ValueError(f"{len(batches)} batches leave no timed step after {warmup} warm-up")
    losses, times, cpu_times = [], [], []
    comm: dict[str, Any] = {}
    memory: dict[str, Any] = {}
    exclude = [t for pair in batches for t in pair]
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            meter.start()
        instrument = i == warmup - 1
        counter = CommCounter() if instrument else contextlib.nullcontext()
        tick, cpu_tick = time.perf_counter(), time.process_time()
        with counter:
            loss = forward_backward(trainer, x, y)
            if instrument:
                memory = settled_tensor_bytes(trainer.tensor_roles(), exclude)
            trainer.optimizer_step()
            losses.append(float(loss))
        elapsed = time.perf_counter() - tick
        cpu = time.process_time() - cpu_tick  # every thread of the process (gloo's too)
        if isinstance(counter, CommCounter):
            comm = counter.summary()
        if i >= warmup:
            times.append(elapsed)
            cpu_times.append(cpu)
    peak = meter.stop()
    return {
        "losses": losses,
        "times": times,
        "median_time": statistics.median(times),
        "cpu_times": cpu_times,
        "median_cpu_time": statistics.median(cpu_times),
        "comm": comm,
        "memory": memory,
        "peak": peak,
    }


def machine() -> dict[str, str]:
    cpu = platform.processor() or "unknown"
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    info = {
        "cpu": cpu,
        "cores": str(os.cpu_count()),
        "memory_gb": f"{os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30:.0f}",
        "python": platform.python_version(),
        "torch": torch.__version__,
        "platform": platform.platform(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
    return info
