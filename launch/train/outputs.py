"""What a finished run leaves: its trained weights (model.safetensors, or a fine-tuned
Hugging Face folder), a generated sample, and the summary line printed last."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import torch
from transformers import PreTrainedTokenizerBase

from hybrid.checkpoint.full_state import full_tensor_layout, write_safetensors
from hybrid.engine import Engine
from launch.config import Config
from launch.observe.mfu import format_mfu
from launch.observe.peak_memory import memory_summary
from launch.observe.tracking import format_count
from launch.planning.memory_check import format_bytes
from models.gpt import GPT
from models.gpt.hf.export import write_hf_export
from models.hf_native.causal_lm import HFCausalLM


def write_final_weights(
    engine: Engine,
    config: Config,
    tokenizer: PreTrainedTokenizerBase,
    run_dir: Path,
    is_main: bool,
) -> None:
    """The trained weights at tp=1 on the main rank. Every rank walks the stream of full
    tensors (one bucket gathered at a time, hybrid.checkpoint.full_state) and the main rank writes
    each as it comes, so no rank ever holds the whole model: a pretraining run's
    model.safetensors, or a fine-tuning run's Hugging Face folder (sharded safetensors,
    converted tensor by tensor: models.gpt.hf.export)."""
    if config.init_from is not None and is_main:  # fine-tuned: a folder from_pretrained loads
        if config.model_source == "hf":  # the transformers model, as it came
            from models.hf_native.export import write_native_export as write

            described = engine.module.hf_config
        else:
            write, described = write_hf_export, engine.module.config
        write(
            run_dir / "hf",
            described,
            full_tensor_layout(engine),
            engine.full_tensors(),
            extra_files=lambda folder: tokenizer.save_pretrained(str(folder)),
        )
        print(f"exported the fine-tuned model to {run_dir / 'hf'}", flush=True)
        return
    if not is_main:
        for _ in engine.full_tensors():  # the collectives the main rank's writer needs
            pass
        return
    write_safetensors(
        run_dir / "model.safetensors", full_tensor_layout(engine), engine.full_tensors()
    )
    tokenizer.save_pretrained(str(run_dir / "tokenizer"))


def generate_sample(
    model: GPT | HFCausalLM,
    tokenizer: PreTrainedTokenizerBase,
    config: Config,
    device: torch.device,
) -> str | None:
    s = config.sample
    if s.tokens == 0:
        return None
    prompt = tokenizer.encode(s.prompt, add_special_tokens=False) or [tokenizer.eos_token_id or 0]
    generator = torch.Generator(device).manual_seed(config.train.seed)
    model.eval()
    out = model.generate(
        torch.tensor([prompt], device=device),
        s.tokens,
        s.temperature,
        s.top_k,
        generator=generator,
    )
    return tokenizer.decode(out[0].tolist())


def summary_line(
    history: list[dict[str, Any]],
    total_time: float,
    run_dir: Path,
    peaks: list[int] | None = None,
    planned: int | None = None,
    device_peak: int | None = None,
) -> str:
    """The run's last line: steps, time, losses, median tokens/s and MFU, peak memory
    beside the plan, and on CUDA the allocator's peak (the largest rank's)."""
    vals = [m["val_loss"] for m in history if "val_loss" in m]
    speed = statistics.median(m["tokens_per_s"] for m in history)
    parts = [f"done: {len(history)} steps in {total_time:.0f}s", f"loss {history[-1]['loss']:.4f}"]
    if vals:
        parts.append(f"val_loss {vals[0]:.4f} -> {vals[-1]:.4f} ({vals[-1] / vals[0] - 1:+.0%})")
    parts.append(f"{format_count(speed)} tokens/s (median)")
    mfus = [m["mfu"] for m in history if "mfu" in m]
    if mfus:
        parts.append(f"MFU {format_mfu(statistics.median(mfus))} (median)")
    if peaks:
        parts.append(memory_summary(peaks, planned))
    if device_peak is not None:
        parts.append(f"device memory {format_bytes(device_peak)} (allocator peak)")
    parts.append(f"run_dir {run_dir}")
    return " | ".join(parts)
