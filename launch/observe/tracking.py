"""What a run reports: metrics.jsonl, Weights & Biases, a progress bar and a loss-curve PNG.

Only rank 0 tracks. W&B is a convenience, never a dependency of training: any failure of
it (no network, a bad key, a crash of its service) becomes one warning and tracking goes on
without it. The API key is never written anywhere by us: wandb reads it from its own
settings or WANDB_API_KEY.
"""

from __future__ import annotations

import json
import math
import time
import warnings
from pathlib import Path
from typing import Any

from tqdm import tqdm

from launch.config import WandbConfig
from launch.observe.mfu import format_mfu

METRICS_FILE = "metrics.jsonl"
LOSS_PLOT = "loss.png"


class Tracker:
    def __init__(
        self,
        run_dir: Path,
        wandb_config: WandbConfig,
        config: dict[str, Any],
        total_steps: int,
        start_step: int = 0,
    ) -> None:
        self.run_dir = run_dir
        self.metrics_path = run_dir / METRICS_FILE
        self.progress = tqdm(
            total=total_steps, initial=start_step, desc="train", unit="step", dynamic_ncols=True
        )
        self.wandb_run = _start_wandb(wandb_config, run_dir, config)

    def log(self, metrics: dict[str, Any]) -> None:
        """Append one step's metrics to metrics.jsonl, W&B and the progress bar."""
        with open(self.metrics_path, "a") as f:
            f.write(json.dumps(metrics) + "\n")
        if self.wandb_run is not None:
            try:
                self.wandb_run.log(
                    {k: v for k, v in metrics.items() if k != "step"}, step=metrics["step"]
                )
            except Exception as error:  # W&B must never stop training
                self._drop_wandb(error)
        shown = {
            "loss": f"{metrics['loss']:.4f}",
            "lr": f"{metrics['lr']:.2e}",
            "tok/s": f"{metrics['tokens_per_s']:,.0f}",
        }
        if "mfu" in metrics:
            shown["mfu"] = format_mfu(metrics["mfu"])
        # The device's memory: the CUDA allocator's peak, else (CPU) the peak RSS growth.
        memory = metrics.get("device_mem_bytes", metrics.get("peak_mem_bytes"))
        if memory is not None:
            shown["mem"] = f"{memory / 2**30:.2f}GiB"
        if "val_loss" in metrics:
            shown["val"] = f"{metrics['val_loss']:.4f}"
        self.progress.set_postfix(shown, refresh=False)
        self.progress.update(1)

    def write(self, text: str) -> None:
        """Print a line without breaking the progress bar."""
        self.progress.write(text)

    def finish(self) -> None:
        self.progress.close()
        plot_losses(self.metrics_path, self.run_dir / LOSS_PLOT)
        if self.wandb_run is not None:
            try:
                self.wandb_run.finish()
            except Exception as error:
                self._drop_wandb(error)

    def _drop_wandb(self, error: Exception) -> None:
        warnings.warn(f"W&B failed ({error!r}); training goes on without it", stacklevel=2)
        self.wandb_run = None


def _start_wandb(config: WandbConfig, run_dir: Path, run_config: dict[str, Any]) -> Any:
    if config.mode == "disabled":
        return None
    try:
        import wandb

        return wandb.init(
            project=config.project,
            entity=config.entity,
            name=config.name or run_dir.name,
            mode=config.mode,
            dir=str(run_dir),
            config=run_config,
            settings=wandb.Settings(init_timeout=config.init_timeout_s, silent=True),
        )
    except Exception as error:  # no network, bad key, service crash: warn and go on
        warnings.warn(f"W&B could not start ({error!r}); training goes on without it", stacklevel=2)
        return None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    with open(path) as f:
        return [json.loads(line) for line in f if line.strip()]


def rotate_old_metrics(run_dir: Path) -> None:
    """A fresh run into a folder that has metrics keeps the old file under a dated name
    (with a counter if an older file has that name: a rename would replace it)."""
    path = run_dir / METRICS_FILE
    if path.exists():
        stamp = time.strftime("%Y%m%d-%H%M%S", time.localtime(path.stat().st_mtime))
        target, n = run_dir / f"metrics-{stamp}.jsonl", 0
        while target.exists():
            n += 1
            target = run_dir / f"metrics-{stamp}-{n}.jsonl"
        path.rename(target)


def truncate_metrics(run_dir: Path, last_step: int) -> None:
    """On resume: keep the metrics of steps up to the checkpoint's; later ones are redone."""
    path = run_dir / METRICS_FILE
    if path.exists():
        lines = path.read_text().splitlines()
        kept = [line for line in lines if line and json.loads(line)["step"] <= last_step]
        path.write_text("".join(line + "\n" for line in kept))


def plot_losses(metrics_path: Path, out_path: Path) -> None:
    """Train and validation loss against step, for those who do not open W&B."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt

        rows = read_metrics(metrics_path)
        fig, ax = plt.subplots(figsize=(7, 4))
        ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], label="train", lw=1)
        val = [(r["step"], r["val_loss"]) for r in rows if "val_loss" in r]
        if val:
            ax.plot(*zip(*val, strict=True), "o-", label="validation")
        ax.set_xlabel("step")
        ax.set_ylabel("loss (nats/token)")
        ax.grid(alpha=0.3)
        ax.legend()
        fig.tight_layout()
        fig.savefig(out_path, dpi=100)
        plt.close(fig)
    except Exception as error:  # a plot is a nicety: never fail a finished run over it
        warnings.warn(f"could not draw {out_path}: {error!r}", stacklevel=2)


def format_count(value: float) -> str:
    if value <= 0 or not math.isfinite(value):
        return str(value)
    for unit, size in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if value >= size:
            return f"{value / size:.1f}{unit}"
    return f"{value:.0f}"
