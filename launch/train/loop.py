"""A training run, from random weights (launch.pretrain) or from a Hugging Face checkpoint
(launch.finetune): build the model and the Engine, resume, train, evaluate, checkpoint,
and write the result at the end.
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import yaml
from transformers import PreTrainedTokenizerBase

from hybrid.checkpoint.saver import CheckpointWriter
from hybrid.distributed.env import DistributedEnv
from hybrid.distributed.topology import Topology
from hybrid.engine import Engine
from hybrid.tensor_parallel import TensorParallel
from launch.config import Config, ConfigError, to_dict
from launch.data import DistributedBatches, TokenWindows, load_tokenizer, prepare_data
from launch.data.examples import is_prompt_completion, read_examples
from launch.data.mixture import load_mixture, validation_sets
from launch.data.prepare.wait import DataPhase
from launch.data.sampler import Samples
from launch.data.token_file import resolve_files
from launch.observe.mfu import Utilization
from launch.observe.peak_memory import PeakMemory
from launch.observe.tracking import Tracker, rotate_old_metrics, truncate_metrics
from launch.planning.memory_check import planned_peak_bytes
from launch.train.checkpointing import restore
from launch.train.checkpointing import save as save_checkpoint
from launch.train.outputs import generate_sample, summary_line, write_final_weights
from launch.train.preemption import NonFiniteLoss, Preemption
from launch.train.schedule import lr_at
from launch.train.setup import build_model, engine_config, run_banner, run_utilization
from launch.train.step import eval_steps, evaluate, train_step


@dataclass
class RunData:
    """What a run trains and validates on: packed token windows, prompt/completion
    examples (launch.data.examples) when the files are jsonl of that shape, or a mixture
    of corpora (launch.data.mixture.MixtureWindows, train and val: one val set a source)."""

    tokenizer: PreTrainedTokenizerBase
    train: Samples
    val: Samples
    description: str


@dataclass
class Run:
    """What the step loop works with, built once by `train`: the engine and its layout,
    the data, and everything that watches, stops or saves the run."""

    config: Config
    env: DistributedEnv
    topology: Topology
    tp: TensorParallel
    engine: Engine
    batches: DistributedBatches
    val_set: list[tuple[str, float, list[Any]]]
    tracker: Tracker | None
    preemption: Preemption
    memory: PeakMemory
    planned: int | None  # the planner's peak for this layout, shown beside the measured one
    writer: CheckpointWriter
    utilization: Utilization
    history: list[dict[str, Any]] = field(default_factory=list)


def load_data(config: Config, env: DistributedEnv, window: int) -> RunData:
    """One rank per node prepares the cache (tokenizing it when missing); the others wait
    for it without a collective, so preparation may take longer than the process group's
    timeout (launch.data.prepare.wait); then every rank reads it."""
    phase = DataPhase(env)
    if not phase.first:
        phase.wait_for_node()
    try:
        paths = resolve_files(config.data.files)
        if config.data.mixture:  # several corpora by weight, each its own cache
            tokenizer, train, val, description = load_mixture(
                config.data,
                window,
                lambda source: prepare_data(
                    source, phase.verify, progress=None if phase.first else False
                ),
            )
        elif is_prompt_completion(paths):
            tokenizer = load_tokenizer(config.data, paths)
            examples = read_examples(paths, tokenizer, window, config.data.cache_dir)
            train, val = examples.split(config.data.val_fraction, packed=config.data.pack)
            description = f"{len(train):,} train / {len(val):,} val prompt/completion examples"
            if config.data.pack:
                description = (
                    f"{len(examples):,} prompt/completion examples packed into {len(train):,} "
                    f"train / {len(val):,} val sequences of {window} tokens"
                )
            if examples.dropped:
                description += f" ({examples.dropped} dropped: prompt fills train.seq_len)"
        else:
            data = prepare_data(config.data, phase.verify, progress=None if phase.first else False)
            tokenizer = data.tokenizer
            train = TokenWindows(data.train_tokens, window)
            val = TokenWindows(data.val_tokens, window)
            description = f"{len(data.train_tokens):,} train tokens"
    except ValueError as error:  # the same files on every rank: every rank raises alike
        if phase.first:
            phase.node_done(error=str(error))
        raise ConfigError(str(error)) from None
    except BaseException as error:  # anything else: the waiting ranks must not hang
        if phase.first:
            phase.node_done(error=f"local rank 0 failed preparing the data: {error!r}")
        raise
    if phase.first:
        phase.node_done()
    phase.wait_for_all()
    return RunData(tokenizer, train, val, description)


def train(
    config: Config, env: DistributedEnv, dp: int, resume: Path | None = None
) -> list[dict[str, Any]]:
    """Run the job from the start or from checkpoint `resume`, to `train.steps` (or
    `train.stop_at`); returns the per-step metrics of this run (the same on every rank)."""
    t, p = config.train, config.parallel
    run_dir = Path(config.run_dir)
    topology = Topology.build(p.tp, env.device.type)
    assert topology.dp == dp
    window = t.seq_len or config.model.seq_len
    data = load_data(config, env, window)
    # Replicated-region dropout draws from the default generator, seeded alike everywhere;
    # TP regions from the TP stream (hybrid.tensor_parallel.random).
    torch.manual_seed(t.seed + 1)
    tp = TensorParallel.from_topology(topology, t.seed, p.sequence_parallel, env.device)
    # Built on the meta device at every stage: the Engine materialises each parameter
    # straight into its bucket (stages 0-2) or shard (stage 3), so the model never exists
    # twice on a rank (a model built on the device, then copied, peaked at 2x parameters).
    device = "meta"
    memory = PeakMemory(env.device, topology.world)  # baseline: what the run holds before it
    model = build_model(config, len(data.tokenizer), tp, device, resume is not None, env.device)
    # (model_source=hf: the planner counts the model itself, not its config)
    planned = planned_peak_bytes(config, model.config, env.world_size, env.device.type)
    utilization = run_utilization(config, model, window, env)
    engine = Engine(
        model, topology, tp, engine_config(config, dp), units=list(model.blocks), device=env.device
    )
    model.forget_initial_weights()  # the Engine holds this rank's shards now
    start_step, consumed_samples = 0, 0
    if resume is not None:
        state = restore(resume, engine, config, topology, tp)
        start_step, consumed_samples = state["step"], state["consumed_samples"]
    batches = DistributedBatches(
        data.train,
        t.seed,
        t.global_batch_size,
        t.micro_batch_size,
        topology.dp_rank,
        topology.dp,
        start_sample=consumed_samples,
    )
    val_set = validation_sets(
        data.val,
        t.eval_batches * t.global_batch_size,
        t.micro_batch_size,
        topology.dp_rank,
        topology.dp,
    )
    tracker = None
    if env.is_main:
        run_dir.mkdir(parents=True, exist_ok=True)
        if start_step:
            truncate_metrics(run_dir, start_step)
            print(f"resuming from {resume} at step {start_step}", flush=True)
        else:
            rotate_old_metrics(run_dir)
        resolved = to_dict(config) | {"model": dataclasses.asdict(model.config)}
        (run_dir / "config.yaml").write_text(yaml.safe_dump(resolved, sort_keys=False))
        print(run_banner(config, model, topology, data.description, env), flush=True)
        tracker = Tracker(run_dir, config.tracking.wandb, resolved, t.steps, start_step)

    history: list[dict[str, Any]] = []
    started = time.perf_counter()
    stop = t.stop_at or t.steps
    if start_step >= stop:
        raise ConfigError(
            f"the checkpoint {resume} is at step {start_step}, which already reaches "
            f"train.steps (or stop_at) = {stop}; raise train.steps or set checkpoint.resume=none"
        )
    preemption = Preemption()
    writer = CheckpointWriter(config.checkpoint.async_save)
    run = Run(
        config, env, topology, tp, engine, batches, val_set, tracker, preemption, memory,
        planned, writer, utilization, history,
    )  # fmt: skip
    try:
        finished = _loop(run, range(start_step, stop))
        writer.close()  # the last checkpoint committed before anything else happens
    finally:
        preemption.uninstall()
    total_time = time.perf_counter() - started
    if not finished or stop < t.steps:
        if tracker is not None:
            tracker.finish()
            why = "SIGTERM" if not finished else "train.stop_at"
            print(
                f"stopped after step {history[-1]['step']} ({why}) with a checkpoint; "
                "run again to resume",
                flush=True,
            )
        return history

    sample = generate_sample(model, data.tokenizer, config, env.device)  # every rank: TP talks
    write_final_weights(engine, config, data.tokenizer, run_dir, env.is_main)
    peaks = memory.per_rank()  # every rank: the whole run's, final weights included
    device_peak = memory.maxima()[1]  # every rank: the allocator's, largest rank's (CUDA)
    if tracker is not None:
        tracker.finish()
        if sample is not None:
            print(
                f"--- sample ({config.sample.tokens} tokens) ---\n{sample}\n--- end of sample ---"
            )
        print(summary_line(history, total_time, run_dir, peaks, planned, device_peak), flush=True)
    return history


def _loop(run: Run, steps: range) -> bool:
    """Train `steps`, appending each step's metrics to `run.history`; checkpoint every
    `checkpoint.every` steps and after the last. False when SIGTERM stopped it early
    (after a checkpoint of the step it finished). Each step's metrics carry the largest
    rank's peak memory so far beside the planner's peak for this layout, on CUDA the
    allocator's peak, and MFU where the device's peak is known."""
    config, env, engine, batches = run.config, run.env, run.engine, run.batches
    t = config.train
    evaluate_after = set(eval_steps(t.steps, t.eval_every))
    tokens_per_step = t.global_batch_size * (t.seq_len or config.model.seq_len)
    for step in steps:
        tick = time.perf_counter()
        lr = lr_at(step, t)
        loss, grad_norm, skipped = train_step(engine, batches.next_step(), lr, env.device)
        elapsed = time.perf_counter() - tick
        metrics = {
            "step": step + 1,
            "loss": loss,
            "lr": lr,
            "grad_norm": grad_norm,
            "tokens_per_s": tokens_per_step / elapsed,
            "step_time_s": elapsed,
        }
        mfu = run.utilization.of(metrics["tokens_per_s"])
        if mfu is not None:
            metrics["mfu"] = mfu  # a fraction of one device's peak
        # fp16 overflows are routine (the loss scale halves); elsewhere a NaN or inf is not.
        if t.precision != "fp16" and (skipped or not math.isfinite(loss)):
            if t.on_nonfinite == "stop":
                raise NonFiniteLoss(step + 1)
            if env.is_main:
                print(
                    f"warning: step {step + 1}: NaN or inf loss or gradient; the update "
                    "was skipped on every rank (train.on_nonfinite=skip)",
                    flush=True,
                )
        if skipped:
            metrics["skipped"] = True  # no update (fp16: and a lower loss scale)
        if step + 1 in evaluate_after:
            metrics |= val_losses(engine, run.val_set, run.topology, env.device)
        # After evaluation, so the line's peak covers it. The loss is reduced over DP only
        # (a SUM), so the largest rank's peak takes its own MAX over the world.
        peak, device_peak = run.memory.maxima()
        metrics["peak_mem_bytes"] = peak
        metrics["planned_peak_bytes"] = run.planned
        if device_peak is not None:
            metrics["device_mem_bytes"] = device_peak
        run.history.append(metrics)
        if run.tracker is not None:
            run.tracker.log(metrics)
        run.preemption.step_took(time.perf_counter() - tick)  # with evaluation: the grace
        every = config.checkpoint.every
        preempted = run.preemption.requested(run.topology, env.device)
        if (every and (step + 1) % every == 0) or step + 1 == steps.stop or preempted:
            save_checkpoint(
                engine, config, step + 1, batches.consumed_samples, run.topology, run.tp, run.writer
            )
        if preempted:
            return False
    return True


def val_losses(
    engine: Engine,
    val_sets: list[tuple[str, float, list[Any]]],
    topology: Topology,
    device: torch.device,
) -> dict[str, float]:
    """Each validation set's loss under its metrics key. A mixture's `val_loss` is the
    sources' losses weighed by their shares: the loss on the mixed distribution, with no
    second pass over the data."""
    losses = {
        key: evaluate(engine, batches, topology.dp_group, device) for key, _, batches in val_sets
    }
    if "val_loss" not in losses:
        total = sum(weight for _, weight, _ in val_sets)
        overall = sum(weight * losses[key] for key, weight, _ in val_sets) / total
        losses = {"val_loss": overall} | losses
    return losses
