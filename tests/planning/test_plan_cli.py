"""launch.plan from the command line: the presets' sizes against their papers, Turing-NLG
17B's layout found by the search, plots, one-line errors, units, and the step time's
recomputation, ZeRO-3 traffic and parameter-gather overlap."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
from plan_cases import run_plan

from hybrid.memory import parse_bytes, parse_count
from launch.config import load_config, preset_path
from launch.plan import main
from launch.planning.search import GPT2_TOKENS
from launch.train.setup import engine_config
from models.gpt import count_parameters, pad_vocab_size

PAPER_SIZES = {  # parameters as the papers give them (GPT-2 as since corrected)
    "gpt2-124m": 124e6,
    "gpt2-355m": 355e6,
    "gpt2-774m": 774e6,
    "gpt2-1.5b": 1.558e9,
    "megatron-1.2b": 1.2e9,
    "megatron-2.5b": 2.5e9,
    "megatron-4.2b": 4.2e9,
    "megatron-8.3b": 8.3e9,
    "turing-nlg-17b": 17.2e9,
    "gpt3-175b": 175e9,
    "korthikanti-22b": 22e9,
    "korthikanti-175b": 175e9,
    "korthikanti-530b": 530e9,
    "korthikanti-1t": 1e12,
}


@pytest.mark.parametrize("name", sorted(PAPER_SIZES))
def test_presets_have_their_papers_sizes(name: str) -> None:
    config = load_config(preset_path(name)).model
    if config.vocab_size is None:
        config = dataclasses.replace(config, vocab_size=pad_vocab_size(GPT2_TOKENS))
    assert count_parameters(config) == pytest.approx(PAPER_SIZES[name], rel=0.015)


# ---- the command line -----------------------------------------------------------------------

TURING = ["--config", "configs/turing-nlg-17b.yaml", "--gpus", "256", "--gpu-memory", "32GiB"]


def test_turing_nlg_17b_at_tp4_fits_and_search_finds_it(capsys: pytest.CaptureFixture) -> None:
    assert main([*TURING, "--tp", "4"]) == 0
    text = capsys.readouterr().out
    for line in ("parameters", "optimizer states", "activations", "communication buffers"):
        assert line in text
    assert "fits in 32.00 GiB" in text and "dp 64 x tp 4" in text and "per step" in text
    report = run_plan([*TURING, "--tp", "4"])
    assert report["fits"] and report["layout"]["dp"] == 64
    assert report["memory"]["total"] < 32 * 2**30 and report["time"]["step_s"] > 0

    found = run_plan([*TURING, "--search"])
    assert found and all(p["fits"] for p in found)
    steps = [p["time"]["step_s"] for p in found]
    assert steps == sorted(steps)
    assert {p["layout"]["tp"] for p in found} <= {1, 2, 4}  # 28 heads: tp 7, 14, 28 no (256)
    assert any(p["layout"]["tp"] == 4 for p in found)
    assert main([*TURING, "--search", "--top", "3"]) == 0
    table = capsys.readouterr().out
    assert "layouts of 256 GPUs fit in 32.00 GiB" in table and "(--top)" in table


def test_plot(tmp_path: Path) -> None:
    out = tmp_path / "zero.png"
    assert main(["--params", "7.5e9", "--gpus", "1024", "--plot", str(out), "--json"]) == 0
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--gpus", "250", "--tp", "4"], "--gpus 250 is not divisible by tp=4"),
        (["--gpus", "256", "--tp", "8"], "n_head=28 is not divisible by tp=8"),
        (["--gpus", "256", "--gpu-memory", "32"], "has no unit; write 32GiB"),
        (["--gpus", "256", "--global-batch", "100"], "global batch 100 is not a multiple"),
        (["--gpus", "256", "--tp", "1", "--sequence-parallel"], "sequence parallelism needs"),
        (["--gpus", "256", "--search"], "--search needs --gpu-memory"),
    ],
)
def test_bad_input_is_one_line_error(
    args: list[str], message: str, capsys: pytest.CaptureFixture
) -> None:
    assert main(["--config", "turing-nlg-17b", *args]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error: ") and message in err and err.count("\n") == 1, err


def test_unknown_preset_names_the_presets(capsys: pytest.CaptureFixture) -> None:
    assert main(["--config", "turing-17b", "--gpus", "8"]) == 2
    err = capsys.readouterr().err
    assert "unknown preset or config file 'turing-17b'" in err and "turing-nlg-17b" in err


def test_sizes_parse_with_units() -> None:
    assert parse_bytes("32GiB") == 32 * 2**30
    assert parse_bytes("80 GB") == 80 * 10**9
    assert parse_bytes("1.5TiB") == 3 * 2**39
    assert parse_count("7.5e9") == 7_500_000_000 and parse_count("175B") == 175 * 10**9
    for bad in ("32", "32 parsecs", "lots"):
        with pytest.raises(ValueError, match="GiB"):
            parse_bytes(bad)


def test_step_time_counts_recomputation_and_zero_3_traffic() -> None:
    """Full recomputation adds a forward of the layers (almost 4/3 of the compute: the
    logits are not recomputed); with one micro-batch per step ZeRO-3 sends 3 Psi over DP
    where stage 1 sends 2 Psi (ZeRO section 7), counted in 2-byte elements: with fp32
    gradients (the default) the reduce-scatter's Psi weighs 4 bytes, so (4 + 2 x 2) Psi
    against (4 + 2) Psi."""
    report = {}
    for stage, mode in ((1, "none"), (1, "full"), (3, "none")):
        args = ["--config", "gpt2-1.5b", "--gpus", "64", "--tp", "1", "--micro-batch", "8"]
        report[stage, mode] = run_plan([*args, "--zero-stage", str(stage), "--recompute", mode])
        for dtype in ("bf16", "fp32"):
            given = [*args, "--zero-stage", str(stage), "--grad-reduce-dtype", dtype]
            report[stage, mode, dtype] = run_plan([*given, "--recompute", mode])
    ratio = report[1, "full"]["time"]["compute_s"] / report[1, "none"]["time"]["compute_s"]
    assert 1.25 < ratio < 4 / 3
    assert report[1, "none"]["layout"]["micro_batches"] == 1
    for dtype, expected in (("bf16", 3 / 2), ("fp32", 4 / 3)):
        stage1, stage3 = (report[s, "none", dtype]["communication"]["dp_bytes"] for s in (1, 3))
        assert stage3 / stage1 == pytest.approx(expected, rel=1e-12)
    assert report[3, "none"]["communication"] == report[3, "none", "fp32"]["communication"]


def test_overlap_off_waits_for_the_parameter_gathers_in_the_step() -> None:
    """parallel.overlap_param_gather=false reaches the engine, and the planner follows it:
    the step's all-gather is all exposed instead of hidden behind the next forward. Stage 0
    publishes nothing, so the setting changes nothing there. (Memory does not depend on
    it: the all-gathers write into the flat buffers in place, on gloo too.)"""
    tiny = preset_path("tiny")
    off = load_config(tiny, ["parallel.overlap_param_gather=false"])
    assert engine_config(load_config(tiny), 2).overlap_param_gather
    assert not engine_config(off, 2).overlap_param_gather
    args = ["--config", "gpt2-1.5b", "--gpus", "64", "--tp", "1", "--micro-batch", "8"]
    for stage in (0, 1, 2):
        times = {
            overlap: run_plan(
                [*args, "--zero-stage", str(stage), f"parallel.overlap_param_gather={overlap}"]
            )["time"]
            for overlap in ("true", "false")
        }
        hidden = times["false"]["dp_exposed_s"] - times["true"]["dp_exposed_s"]
        assert times["false"]["compute_s"] == times["true"]["compute_s"]
        assert hidden > 0 if stage else hidden == 0
        step = times["false"]["step_s"] - times["true"]["step_s"]
        assert step == pytest.approx(hidden, rel=1e-9, abs=1e-12)
