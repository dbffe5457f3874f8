"""Each rank's peak memory during a run, measured from outside the engine, so a user sees
it against the planner's prediction (launch.planning.memory_check.planned_peak).

- CPU: the process's peak resident set (VmHWM in /proc/self/status) above its resident
  set when the run starts measuring, just before the model is built (imports, the
  tokenizer and the token data are in the baseline, as they are in no plan). The peak is
  reset to the current RSS there (`5` into /proc/self/clear_refs), so a larger earlier
  peak (tokenizing, a previous run in the same process) does not hide the run's. Where
  that reset is refused the baseline is the earlier peak instead: the figure can then
  only be low, never high. RSS also counts pages of torch's libraries first touched
  during the run: a few tens of MiB that dominate a tiny model's figure.
- CUDA: `torch.cuda.max_memory_allocated` above `memory_allocated`, after resetting the
  allocator's peak at the same point. `device_peak` is that allocator peak itself, the
  baseline included: the device memory a run shows in its bar and summary.
"""

from __future__ import annotations

import resource

import torch
import torch.distributed as dist

from hybrid.distributed.comm import Group
from launch.planning.memory_check import format_bytes

STATUS = "/proc/self/status"
CLEAR_REFS = "/proc/self/clear_refs"


def _status_bytes(field: str) -> int | None:
    """A `kB` field of /proc/self/status in bytes; None where there is no /proc."""
    try:
        with open(STATUS) as f:
            for line in f:
                if line.startswith(f"{field}:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _peak_rss() -> int:
    peak = _status_bytes("VmHWM")
    if peak is None:  # no /proc: getrusage's maximum resident set, in KiB on Linux
        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return peak


def _reset_peak_rss() -> int:
    """Reset the high-water mark to the current RSS and return the baseline to subtract."""
    try:
        with open(CLEAR_REFS, "w") as f:
            f.write("5")
    except OSError:
        return _peak_rss()  # not resettable: only growth beyond the old peak is counted
    current = _status_bytes("VmRSS")
    return current if current is not None else _peak_rss()


class PeakMemory:
    """Bytes this rank's run has reached at most, above its baseline. `world`: the ranks
    whose peaks `maxima` and `per_rank` compare (a run passes its topology's; default:
    the whole job)."""

    def __init__(self, device: torch.device, world: Group | None = None) -> None:
        self.device = device
        self.world = world if world is not None else Group.whole_job()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
            torch.cuda.reset_peak_memory_stats(device)
            self.baseline = torch.cuda.memory_allocated(device)
        else:
            self.baseline = _reset_peak_rss()

    def local(self) -> int:
        """This rank's peak so far, above the baseline."""
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device) - self.baseline
        return max(0, _peak_rss() - self.baseline)

    def device_peak(self) -> int | None:
        """The CUDA allocator's own peak since the run began measuring, baseline included:
        what the device had to hold at most (torch.cuda.max_memory_allocated, reset at
        the start); None on CPU, where there is no device memory apart from the RSS."""
        if self.device.type != "cuda":
            return None
        return torch.cuda.max_memory_allocated(self.device)

    def max_over_ranks(self) -> int:
        """The largest rank's peak so far: one MAX all-reduce of one number (all ranks
        must call)."""
        return self.maxima()[0]

    def maxima(self) -> tuple[int, int | None]:
        """The largest rank's `local()` and `device_peak()` so far, in one MAX all-reduce
        of two numbers (all ranks must call)."""
        device = self.device_peak()
        value = torch.tensor(
            [self.local(), -1 if device is None else device], dtype=torch.int64, device=self.device
        )
        self.world.all_reduce(value, op=dist.ReduceOp.MAX)
        local, device_max = (int(v) for v in value.tolist())
        return local, None if device is None else device_max

    def per_rank(self) -> list[int]:
        """Every rank's peak so far, by rank (all ranks must call)."""
        mine = torch.tensor([self.local()], dtype=torch.int64, device=self.device)
        return [int(v) for v in self.world.all_gather(mine).tolist()]


def memory_summary(peaks: list[int], planned: int | None) -> str:
    """'peak memory 41.2 MiB (ranks 41.2 MiB, 40.9 MiB), planned 12.3 MiB': the largest
    rank's, each rank's for up to 8 ranks (the range beyond), then the planner's."""
    text = f"peak memory {format_bytes(max(peaks))}"
    if 1 < len(peaks) <= 8:
        text += f" (ranks {', '.join(format_bytes(p) for p in peaks)})"
    elif len(peaks) > 8:
        text += f" (ranks {format_bytes(min(peaks))} to {format_bytes(max(peaks))})"
    return text if planned is None else f"{text}, planned {format_bytes(planned)}"
