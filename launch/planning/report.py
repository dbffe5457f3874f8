"""The text `python -m launch.plan` prints: one plan's breakdown, or the search's ranking."""

from __future__ import annotations

import argparse

from hybrid.memory import Plan, grad_element_bytes, precision_bytes, unit_bytes


def report(p: Plan, title: str, args: argparse.Namespace) -> str:
    """The readable breakdown of one plan under `title` (the model's description)."""
    unit, size = args.units, unit_bytes(args.units)
    layout, memory = p.layout, p.memory

    def row(label: str, value: float | None, note: str = "") -> str:
        shown = "-" if value is None else f"{value / size:10.2f}"
        return f"  {label:<28}{shown:>10}  {note}".rstrip()

    element, _ = precision_bytes(layout.precision)
    grad = grad_element_bytes(layout.precision, layout.grad_reduce_dtype)
    pad = f", padding {p.padding} elements" if p.padding else ""
    lines = [
        title,
        f"layout: {layout.describe()}, {layout.sequences} sequences per step, {layout.precision}",
        "",
        f"{'memory per GPU':<30}{unit:>10}",
        row("parameters", memory["parameters"], f"{p.psi:,} per TP rank x {element} B{pad}"),
        row(
            "gradients",
            memory["gradients"],
            f"{grad} B, accumulated and reduced in {'fp32' if grad == 4 else layout.precision}",
        ),
        row("optimizer states", memory["optimizer"], f"fp32 Adam (ZeRO stage {layout.zero_stage})"),
        row("= model states", memory["model_states"]),
    ]
    if p.activation_parts is not None:
        a = p.activation_parts
        lines += [
            row("activations", memory["activations"], f"micro-batch {layout.micro_batch}"),
            row("  transformer layers", a["layers"], f"recompute {layout.recompute}"),
            row("  recompute working set", a["recompute_working_set"]),
            row("  embedding and output", a["embedding"] + a["output"]),
            row("  loss and logits buffers", a["loss"] + a["loss_buffers"]),
        ]
    lines.append(row("communication buffers", memory["buffers"], "their own peak, in backward"))
    if p.peak is not None:  # the step's largest moment: these parts alive together
        m = p.peak
        lines += [
            row("peak of a step", memory["peak"], f"at {m.name}:"),
            row("  model states", m.model_states, "held then"),
            row("  activations", m.activations, "alive then"),
            row("  buffers", m.buffers, "gathered, in flight, step temporaries"),
        ]
    else:
        lines.append(row("peak of a step", memory["peak"], "model states only"))
    lines += [
        row("reserved", memory["reserved"], "CUDA context, NCCL, fragmentation"),
        row("= total", memory["total"], "peak + reserved"),
    ]
    if p.gpu_memory is not None:
        free = p.gpu_memory - (memory["total"] or 0.0)
        verdict = "fits" if p.fits else "does NOT fit"
        lines.append(
            f"  {verdict} in {p.gpu_memory / size:.2f} {unit}: "
            f"{abs(free) / size:.2f} {unit} {'free' if free >= 0 else 'short'}"
        )
    c = p.communication
    lines += ["", f"{'sent per GPU per step':<30}{unit:>10}  (ring collectives)"]
    lines.append(row(f"data parallel ({layout.dp} ranks)", c["dp_bytes"]))
    if c["tp_bytes"] is not None:
        lines.append(row(f"tensor parallel ({layout.tp} ranks)", c["tp_bytes"]))
    if p.time:
        t, h = p.time, args.hardware
        lines += [
            "",
            f"step time at {h.peak_flops / 1e12:.0f} TFLOP/s x {h.efficiency:.0%}, "
            f"links {h.intra_node_bandwidth / 1e9:.0f} GB/s in a node of {h.gpus_per_node}, "
            f"{h.inter_node_bandwidth / 1e9:.1f} GB/s between",
            f"  compute {t['compute_s']:.3f} s + TP {t['tp_s']:.3f} s + DP exposed "
            f"{t['dp_exposed_s']:.3f} s (of {t['dp_s']:.3f} s) = {t['step_s']:.3f} s per step, "
            f"{t['tokens_per_s']:,.0f} tokens/s, MFU {t.get('mfu', 0):.0%}",
        ]
    lines += [f"note: {n}" for n in p.notes]
    return "\n".join(lines)


def search_table(plans: list[Plan], args: argparse.Namespace) -> str:
    """The layouts that fit, ranked (plans come sorted by `rank_key`)."""
    unit, size = args.units, unit_bytes(args.units)
    fitting = [p for p in plans if p.fits]
    if not plans:
        return (
            f"no valid layout of {args.gpus} GPUs: no tp divides both the GPUs and the heads "
            "with a DP degree that divides the global batch; set --global-batch"
        )
    if not fitting:  # sorted by memory among those that do not fit: the smallest first
        best = plans[0]
        return (
            f"no layout of {args.gpus} GPUs fits; the smallest needs "
            f"{best.memory['total'] / size:.2f} {unit}: {best.layout.describe()}"
        )
    shown = fitting[: args.top] if args.top else fitting
    lines = [
        f"{len(fitting)} of {len(plans)} layouts of {args.gpus} GPUs fit in "
        f"{args.gpu_memory / size:.2f} {unit}, by estimated step time:",
        f"{'#':>3} {'tp':>3} {'dp':>4} {'ZeRO':>4} {'SP':>3} {'recompute':>9} {'micro':>5} "
        f"{'memory ' + unit:>11} {'step s':>8} {'tokens/s':>10} {'MFU':>5}",
    ]
    for i, p in enumerate(shown, 1):
        lay, t = p.layout, p.time or {}
        step = f"{t['step_s']:8.3f}" if t else f"{'-':>8}"
        tokens = f"{t['tokens_per_s']:10,.0f}" if t else f"{'-':>10}"
        mfu = f"{t['mfu']:5.0%}" if "mfu" in t else f"{'-':>5}"
        lines.append(
            f"{i:>3} {lay.tp:>3} {lay.dp:>4} {lay.zero_stage:>4} "
            f"{'yes' if lay.sequence_parallel else 'no':>3} {lay.recompute:>9} "
            f"{lay.micro_batch:>5} {p.memory['total'] / size:11.2f} {step} {tokens} {mfu}"
        )
    if len(shown) < len(fitting):
        lines.append(f"... and {len(fitting) - len(shown)} more (--top)")
    return "\n".join(lines)
