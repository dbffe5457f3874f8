"""From the jobs' per-rank JSON to the table, the acceptance checks and the chart."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .common import JobSpec

MB = 2**20
LOSS_TOLERANCE = 1e-5  # relative, fp32, at every step
# bf16 (GPU): the systems round in different places (bf16 weights for ours and DeepSpeed,
# autocast over fp32 weights for torch's), so only a loose agreement is expected.
LOSS_TOLERANCE_BF16 = 2e-2


@dataclass
class Row:
    """One configuration over all rounds."""

    spec: JobSpec
    rounds: list[list[dict[str, Any]]] = field(default_factory=list)  # per round: ranks
    failure: str | None = None

    @property
    def ok(self) -> bool:
        return bool(self.rounds) and self.failure is None

    def _per_round(self, value: Any) -> float:
        return statistics.median(max(value(r) for r in ranks) for ranks in self.rounds)

    @property
    def step_time(self) -> float:
        """Median over rounds of the slowest rank's median step time."""
        return self._per_round(lambda r: r["median_time"])

    @property
    def tokens_per_s(self) -> float:
        return self.spec.bench.tokens_per_step / self.step_time

    @property
    def peak_rss(self) -> float:
        return self._per_round(lambda r: r["peak_rss"])

    @property
    def state_bytes(self) -> float:
        return self._per_round(lambda r: r["memory"]["total"])

    @property
    def comm_bytes(self) -> float:
        return self._per_round(lambda r: r["comm"]["total_bytes"])

    @property
    def losses(self) -> list[float]:
        """The global batch's loss per step: the mean of the DP ranks' local means (equal
        local batch sizes), read on TP rank 0 (TP ranks hold the same loss)."""
        ranks = [r for r in self.rounds[0] if r["tp_rank"] == 0]
        steps = len(ranks[0]["losses"])
        return [statistics.fmean(r["losses"][i] for r in ranks) for i in range(steps)]


def max_relative_difference(losses: list[float], reference: list[float]) -> float:
    return max(abs(a - b) / abs(b) for a, b in zip(losses, reference, strict=True))


def best_peer(rows: list[Row], row: Row) -> Row | None:
    peers = [
        r
        for r in rows
        if r.ok and r.spec.system not in ("ours", "floor") and r.spec.group == row.spec.group
    ]
    return min(peers, key=lambda r: r.step_time) if peers else None


def floor_of(rows: list[Row], spec: JobSpec) -> Row | None:
    """The no-communication floor of `spec`'s DP layout (any stage: it has none)."""
    for r in rows:
        s = r.spec
        if (
            r.ok
            and s.system == "floor"
            and (s.dp, s.tp, s.recompute)
            == (
                spec.dp,
                spec.tp,
                spec.recompute,
            )
        ):
            return r
    return None


def synchronised(rows: list[Row]) -> list[Row]:
    """The rows that train one model together (not the floor's independent replicas)."""
    return [r for r in rows if r.ok and r.spec.system != "floor"]


def reference_losses(rows: list[Row]) -> list[float] | None:
    """The plain loop without recomputation, else any configuration that ran."""
    plain = [r for r in rows if r.ok and r.spec.system == "plain" and not r.spec.recompute]
    ran = plain or synchronised(rows)
    return ran[0].losses if ran else None


def table(rows: list[Row]) -> list[str]:
    reference = reference_losses(rows)
    lines = [
        "| configuration | step time (ms) | tokens/s | peak RSS / rank (MB) "
        "| model states / rank (MB) | comm / step / rank (MB) | final loss "
        "| max loss rel. diff | ours / best peer |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for row in rows:
        if not row.ok:
            lines.append(f"| {row.spec.label} | {row.failure or 'did not run'} ||||||||")
            continue
        ratio = ""
        if row.spec.system == "ours":
            peer = best_peer(rows, row)
            if peer:
                ratio = f"{row.step_time / peer.step_time:.3f} ({peer.spec.label.split(',')[0]})"
        diff = max_relative_difference(row.losses, reference) if reference else float("nan")
        loss, shown = f"{row.losses[-1]:.6f}", f"{diff:.1e}"
        if row.spec.system == "floor":  # replicas that never synchronise: another model
            loss, shown, ratio = "(unsynchronised)", "n/a", ""
        lines.append(
            f"| {row.spec.label} | {row.step_time * 1e3:.1f} | {row.tokens_per_s:,.0f} "
            f"| {row.peak_rss / MB:.0f} | {row.state_bytes / MB:.2f} "
            f"| {row.comm_bytes / MB:.2f} | {loss} | {shown} | {ratio} |"
        )
    return lines


def _find(rows: list[Row], system: str, spec: JobSpec) -> Row | None:
    for r in rows:
        s = r.spec
        if r.ok and s.system == system and s.group == spec.group:
            return r
    return None


def acceptance(rows: list[Row]) -> list[str]:
    """The issue's targets, each with its measured value and PASS / FAIL."""
    lines = ["| check | measured | target | result |", "|---|---|---|---|"]

    def check(name: str, value: float, target: float, fmt: str = "{:.4f}") -> None:
        verdict = "PASS" if value <= target else "FAIL"
        lines.append(f"| {name} | {fmt.format(value)} | <= {fmt.format(target)} | {verdict} |")

    reference = reference_losses(rows)
    if reference:
        worst = max(
            (max_relative_difference(r.losses, reference), r.spec.label) for r in synchronised(rows)
        )
        bf16 = any(r.spec.bench.bf16 for r in rows)
        tolerance = LOSS_TOLERANCE_BF16 if bf16 else LOSS_TOLERANCE
        check(f"losses agree at every step (worst: {worst[1]})", worst[0], tolerance, "{:.1e}")
    for ours in (r for r in rows if r.ok and r.spec.system == "ours"):
        spec = ours.spec
        suffix = ", recompute" if spec.recompute else ""
        if spec.world == 1:
            peer = _find(rows, "plain", spec)
            if peer:
                check(
                    f"ours 1 process / plain loop, time{suffix}",
                    ours.step_time / peer.step_time,
                    1.05,
                )
        elif spec.tp == 1:
            peer = _find(rows, "deepspeed", spec)
            if peer:
                name = f"ours / DeepSpeed stage {spec.stage}"
                check(f"{name}, time{suffix}", ours.step_time / peer.step_time, 0.9)
                floor = floor_of(rows, spec)
                if floor:  # the least any DP system could take here: not a target, a bound
                    lines.append(
                        f"| (bound) no-communication floor / DeepSpeed stage {spec.stage}"
                        f"{suffix} | {floor.step_time / peer.step_time:.4f} | | |"
                    )
                check(f"{name}, model states{suffix}", ours.state_bytes / peer.state_bytes, 1.0)
                check(f"{name}, peak RSS{suffix}", ours.peak_rss / peer.peak_rss, 1.0)
            fsdp = _find(rows, "fsdp2", spec) if spec.stage == 3 else None
            if fsdp:
                check(f"ours stage 3 / FSDP2, time{suffix}", ours.step_time / fsdp.step_time, 1.0)
        elif spec.dp == 1:
            peer = _find(rows, "dtensor_tp", spec)
            if peer:
                check(f"ours tp=2 / DTensor TP, time{suffix}", ours.step_time / peer.step_time, 1.0)
        else:
            peer = _find(rows, "fsdp2_tp", spec)
            if peer:
                check(f"ours 2D / FSDP2 + TP, time{suffix}", ours.step_time / peer.step_time, 1.0)
    return lines


def chart(rows: list[Row], path: Path, title: str) -> None:
    """Step time and model-state bytes per configuration, ours in one colour."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    ran = [r for r in rows if r.ok]
    if not ran:
        return
    labels = [r.spec.label for r in ran]
    colours = ["tab:blue" if r.spec.system == "ours" else "tab:gray" for r in ran]
    fig, axes = plt.subplots(1, 2, figsize=(14, 0.32 * len(ran) + 1.5), sharey=True)
    y = list(range(len(ran)))
    axes[0].barh(y, [r.step_time * 1e3 for r in ran], color=colours)
    axes[0].set_xlabel("median step time (ms)")
    axes[1].barh(y, [r.state_bytes / MB for r in ran], color=colours)
    axes[1].set_xlabel("model states per rank (MB)")
    axes[0].set_yticks(y, labels, fontsize=8)
    axes[0].invert_yaxis()
    for ax in axes:
        ax.grid(axis="x", alpha=0.3)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
