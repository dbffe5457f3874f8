"""Model FLOPs utilisation (MFU) of a training run: the model's own FLOPs per second on one
device against that device's peak, as Megatron-LM and PaLM (arXiv 2204.02311, appendix B)
report it. The FLOPs are the planner's (models.gpt.flops_per_token: recomputation is not
counted, so MFU does not rise when a run recomputes); the peak is `train.peak_tflops` or,
on CUDA, a known GPU's dense bf16 tensor peak. With neither (CPU, an unknown GPU) there is
no MFU: a guessed peak would make a figure that looks exact and is not.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from models.gpt import GPTConfig, flops_per_token
from models.gpt.accounting import with_seq_len

# Dense (no 2:4 sparsity) BF16 tensor-core TFLOP/s per GPU, at boost clock. The datasheets
# print the sparse figure with an asterisk; these are half of it. First match wins, so a
# variant comes before its family's name. Sources: NVIDIA datasheets (A100, H100 (SXM,
# PCIe, NVL), H200, GH200, L4, L40, L40S, A10, A40, RTX A6000, B200) and architecture
# whitepapers (Ampere GA102 for the RTX 3090, Ada for the RTX 4090: "FP16/BF16 tensor with
# FP32 accumulate", the rate a training run's GEMMs take); AMD's MI300X datasheet. The
# A10G is AWS's part with no NVIDIA datasheet: 70, as AWS's G5 figures give it (Baseten,
# "NVIDIA A10 vs A10G for ML model inference"), not the A10's 125. Volta and Turing have
# no bf16: their FP16 tensor peak stands in (V100 SXM2 125, PCIe 112; T4 65), the rate an
# fp16 run gets.
PEAK_TFLOPS: tuple[tuple[str, float], ...] = (
    (r"\bH100 PCIe\b", 756.0),
    (r"\bH100 NVL\b", 835.0),
    (r"\bH200 NVL\b", 835.0),
    (r"\bGH200\b", 989.0),
    (r"\bH100\b", 989.0),  # SXM5: "NVIDIA H100 80GB HBM3"
    (r"\bH800\b", 989.0),
    (r"\bH200\b", 989.0),
    (r"\bB200\b", 2250.0),
    (r"\bA100\b", 312.0),  # SXM4 and PCIe, 40 and 80 GB alike
    (r"\bA800\b", 312.0),
    (r"\bA10G\b", 70.0),
    (r"\bA10\b", 125.0),
    (r"\bA40\b", 149.7),
    (r"\bRTX A6000\b", 154.8),
    (r"\bL40S\b", 362.0),
    (r"\bL40\b", 181.0),
    (r"\bL4\b", 121.0),
    (r"\bRTX 4090\b", 165.2),
    (r"\bRTX 3090\b", 71.0),
    (r"\bV100[- ]PCIe\b", 112.0),  # "Tesla V100-PCIE-16GB"
    (r"\bV100\b", 125.0),
    (r"\bT4\b", 65.0),
    (r"\bMI300X\b", 1307.4),
)


def table_peak_tflops(device_name: str) -> float | None:
    """The dense bf16 peak of a GPU named as torch.cuda.get_device_name() names it, e.g.
    'NVIDIA A100-SXM4-80GB' -> 312.0; None for a name the table does not know."""
    for pattern, tflops in PEAK_TFLOPS:
        if re.search(pattern, device_name, re.IGNORECASE):
            return tflops
    return None


def peak_flops(peak_tflops: float | None, device: torch.device) -> float | None:
    """One device's peak FLOP/s: `train.peak_tflops` when given, else the table's for the
    CUDA device, else None (CPU, or a GPU the table lacks)."""
    if peak_tflops is not None:
        if peak_tflops <= 0:
            raise ValueError(f"train.peak_tflops={peak_tflops} must be positive")
        return peak_tflops * 1e12
    if device.type != "cuda":
        return None
    tflops = table_peak_tflops(torch.cuda.get_device_name(device))
    return None if tflops is None else tflops * 1e12


def mfu(model_flops_per_token: float, tokens_per_s: float, world_size: int, peak: float) -> float:
    """The fraction of one device's `peak` FLOP/s that the model's FLOPs fill, with the
    step's `tokens_per_s` over all ranks shared evenly by `world_size` devices (TP and DP
    alike: every rank does 1/world of the step's FLOPs)."""
    return model_flops_per_token * tokens_per_s / world_size / peak


def format_mfu(fraction: float) -> str:
    """'41.2%', '3.05%', '0.026%': three significant digits, so a CPU run's small figure
    does not print as 0.0%."""
    return f"{100 * fraction:.3g}%"


@dataclass(frozen=True)
class Utilization:
    """What a run needs to turn each step's tokens/s into MFU; `peak` None: no MFU."""

    model_flops_per_token: float
    world_size: int
    peak: float | None

    @classmethod
    def for_run(
        cls,
        model: GPTConfig,
        seq_len: int,
        world_size: int,
        peak_tflops: float | None,
        device: torch.device,
    ) -> Utilization:
        """The planner's model FLOPs per token for training windows of `seq_len` tokens
        (launch.plan's Model.plan computes the same), and the device's peak."""
        per_token = flops_per_token(with_seq_len(model, seq_len))
        return cls(per_token, world_size, peak_flops(peak_tflops, device))

    def of(self, tokens_per_s: float) -> float | None:
        if self.peak is None:
            return None
        return mfu(self.model_flops_per_token, tokens_per_s, self.world_size, self.peak)
