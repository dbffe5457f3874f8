"""The peak of a training step: what one rank holds at each moment of a step, and the
largest of those moments, which is what an allocator's high-water mark measures
(`torch.cuda.max_memory_allocated`; on CPU `torch.distributed._tools.mem_tracker`).

Each moment adds model states (ZeRO, arXiv 1910.02054 section 5), activations (arXiv
2205.05198 section 4, hybrid.memory.activations) and buffers (gathered buckets, gradient
buckets filled or reduced, gloo's copies). `peak.md` beside this file lists every moment,
what is alive at each and why, which one is the peak per stage, and what is not counted.
"""

from __future__ import annotations

from collections.abc import Sequence

from hybrid.distributed.pairwise import reduces_pairwise
from hybrid.memory.activations import TransformerShape, layer_bytes
from hybrid.memory.model_states import (
    bucket_numels,
    grad_element_bytes,
    precision_bytes,
    zero_state_bytes,
)
from hybrid.memory.moment import BACKENDS as BACKENDS
from hybrid.memory.moment import Moment as Moment
from hybrid.memory.moment import StepLayout as StepLayout
from hybrid.zero.bucket import group_units, max_bucket_numel

FP32 = 4


def step_peak(
    layout: StepLayout,
    root: int,
    units: Sequence[int],
    shape: TransformerShape | None,
    seen: bool = False,
) -> Moment:
    """The largest moment of a step (the first of equals); with `seen`, the largest as a
    dispatch-level tracker sees them (`Moment.seen`: what MemTracker measures on gloo)."""
    moments = step_moments(layout, root, units, shape)
    return max(moments, key=lambda m: m.seen if seen else m.total)


def step_moments(
    layout: StepLayout, root: int, units: Sequence[int], shape: TransformerShape | None
) -> list[Moment]:
    """Every moment of a step, in order (see the module docstring). `root` and `units`
    are the parameter elements of bucket 0 and of each unit (layer) on this TP rank;
    without a shape there are no activations, only model states and buffers."""
    return _Step(layout, root, tuple(units), shape).moments()


class _Step:
    def __init__(
        self,
        layout: StepLayout,
        root: int,
        units: tuple[int, ...],
        shape: TransformerShape | None,
    ) -> None:
        self.layout, self.shape = layout, shape
        # e: a parameter's (and activation's) element; g: a gradient's in the engine's
        # buffers, reductions and shards (4 when reduced in fp32). Autograd's own gradients
        # (the output layer's weight gradient) are e.
        self.e, _ = precision_bytes(layout.precision)
        self.g = grad_element_bytes(layout.precision, layout.grad_reduce_dtype)
        stage, dp, e = layout.stage, layout.dp, self.e
        self.numels = bucket_numels(root, units, stage, dp, layout.precision, layout.bucket_mb)
        self.shards = [n // dp for n in self.numels] if stage >= 1 else list(self.numels)
        cap = max_bucket_numel(stage, layout.bucket_mb, e)
        self.bucket = [1 + k for k, group in enumerate(group_units(units, cap)) for _ in group]
        states = zero_state_bytes(
            root,
            units,
            stage,
            dp,
            layout.precision,
            layout.bucket_mb,
            grad_reduce_dtype=layout.grad_reduce_dtype,
        )
        # Held for the whole run: parameters, master and moments. Gradients are not: the
        # step releases them, stage 0's full buffers too (hybrid.engine._release_gradients).
        self.persistent = float(states["parameters"] + states["optimizer"])
        # Gradients the earlier micro-batches left: stages 0-1 accumulate full buffers
        # (they reduce in the last backward only), stages 2-3 reduced shards.
        self.carried = 0.0
        if layout.micro_batches > 1:
            self.carried = self.g * sum(self.numels if stage <= 1 else self.shards)
        self._activations(len(units))

    def _activations(self, layers: int) -> None:
        """Per-layer and per-moment activation bytes (hybrid.memory.activations)."""
        shape, layout, e = self.shape, self.layout, self.e
        self.kept, self.working = [0.0] * layers, [0.0] * layers
        self.embedding = self.output = self.loss_forward = self.loss_backward = 0.0
        self.logit_grad = self.residual = self.gathered_input = self.flow = 0.0
        self.table = self.proj_input = 0.0
        self.tied = True
        if shape is None:
            return
        args = (shape, layout.micro_batch, layout.tp, layout.sequence_parallel)
        full = layer_bytes(*args, "none", e)

        def mode(index: int) -> str:
            if layout.recompute != "full":
                return layout.recompute
            return "full" if index % layout.recompute_every == 0 else "none"

        # Kept for backward; and held while the layer's backward runs: everything when its
        # forward is re-run first (Korthikanti section 5), the attention core again under
        # selective recomputation.
        self.kept = [layer_bytes(*args, mode(i), e) for i in range(layers)]
        self.working = [full if mode(i) != "none" else k for i, k in enumerate(self.kept)]
        t, h = layout.tp, shape.hidden
        tokens = shape.seq_len * layout.micro_batch
        vocab = -(-shape.vocab // t)  # this rank's vocabulary slice
        chunk = t if layout.sequence_parallel else 1
        self.embedding = tokens * h / chunk if shape.dropout else 0.0  # its 1-byte mask
        self.output = 2 * e * tokens * h / chunk  # the final norm's input and output
        # hybrid.tensor_parallel.cross_entropy: forward holds the logits and one fp32
        # buffer (becoming the softmax); backward turns that into the gradient in place,
        # which autograd casts to the logits' dtype when they are not fp32.
        self.loss_forward = (e + FP32) * tokens * vocab
        self.loss_backward = (FP32 + (e if e != FP32 else 0)) * tokens * vocab
        self.logit_grad = e * tokens * vocab
        self.residual = e * tokens * h / chunk
        # Under sequence parallelism a linear layer's backward gathers the whole sequence
        # (hybrid.tensor_parallel.layers; Korthikanti section 4.2.2): one full activation.
        self.gathered_input = e * tokens * h if layout.sequence_parallel else 0.0
        f = shape.ffn / t
        self.proj_input = e * tokens * f  # saved by the MLP's output projection
        self.flow = self.residual + self.gathered_input + e * (tokens * f + h * f)
        self.table = e * vocab * h  # the output layer's weight gradient
        self.tied = shape.tied_embeddings

    # ---- helpers ---------------------------------------------------------------------

    def _moment(
        self,
        name: str,
        states: float,
        activations: float,
        buffers: float,
        gathered: tuple[int, ...] = (),
        unseen: float = 0.0,
        autograd: float = 0.0,
    ) -> Moment:
        """A moment; at stage 3 the buckets in `gathered` are held too (buffers)."""
        held = self._gathered(gathered)
        parameters = held if self.layout.stage == 3 else float(self.e * sum(self.numels))
        return Moment(name, states, activations, buffers + held, parameters, unseen, autograd)

    def _gathered(self, buckets: tuple[int, ...]) -> float:
        """Stage 3: bytes of the gathered buckets among `buckets` (others skipped)."""
        if self.layout.stage != 3:
            return 0.0
        chosen = {k for k in buckets if 0 <= k < len(self.numels)}
        return float(self.e * sum(self.numels[k] for k in chosen))

    def _open(self, bucket: int) -> float:
        """Stages 1-3: full gradient buffers open while bucket `bucket` fills (the root
        bucket's, opened first, and its own); stage 1 after several micro-batches: every
        bucket not yet reduced."""
        if self.layout.stage == 0:
            return 0.0
        if self.layout.stage == 1 and self.carried:
            return float(self.g * (self.numels[0] + sum(self.numels[1 : bucket + 1])))
        return float(self.g * (self.numels[0] + (self.numels[bucket] if bucket else 0)))

    def _kept_open(self, layer: int) -> float:
        """Stage 0 in one micro-batch: the full gradient buffers backward has opened by
        `layer` (the root bucket's first, then each unit bucket's at its first gradient),
        all kept to the step: the step's gradients, a model state. (After earlier
        micro-batches every buffer is there: `carried`.)"""
        if self.layout.stage != 0 or self.carried:
            return 0.0
        opened = {0, *self.bucket[layer:]}
        return float(self.g * sum(self.numels[k] for k in opened))

    def _opens(self, layer: int) -> bool:
        """Whether `layer`'s backward opens its bucket's gradient buffer (the first
        layer of the bucket that backward reaches; none is opened after stages 0-1's
        earlier micro-batches: the buffers are there)."""
        if self.layout.stage <= 1 and self.carried:
            return False
        return layer + 1 == len(self.bucket) or self.bucket[layer + 1] != self.bucket[layer]

    def _in_flight(self, bucket: int) -> float:
        """A reduce-scatter issued and not yet waited for: its input (the full buffer),
        its shard output and, on gloo, the backend's copy of the input."""
        return self.g * (self.numels[bucket] + self.shards[bucket]) + self._copy(bucket)

    def _copy(self, bucket: int) -> float:
        """gloo's copy of a reduce-scatter's input, made inside the call and released
        when its work is waited for and dropped (torch 2.13's ProcessGroupGloo); none in a
        group of two, which exchanges pairwise (hybrid.distributed.comm)."""
        gloo_own = self.layout.backend == "gloo" and not reduces_pairwise(self.layout.dp)
        return float(self.g * self.numels[bucket]) if gloo_own else 0.0

    def _gather_copy(self, bucket: int) -> float:
        """gloo's staging of an all-gather's output (its own buffer of the output's size,
        from the call until the wait): stage 3's prefetch of bucket `bucket` in forward.
        Backward's gathers exchange pairwise, straight into the buffer (hybrid.zero.gather)."""
        if self.layout.backend != "gloo" or self.layout.stage != 3:
            return 0.0
        return float(self.e * self.numels[bucket]) if 0 <= bucket < len(self.numels) else 0.0

    # ---- moments ---------------------------------------------------------------------

    def moments(self) -> list[Moment]:
        return [*self._forward(), *self._backward(), self._optimizer_step()]

    def _forward(self) -> list[Moment]:
        """Stage 3 holds the root bucket through forward, each unit with the next one
        prefetched (hybrid.zero.gather.ParameterGatherer.hook). Stages 1-2's all-gathers,
        in flight into the first forward (hybrid.zero.publish), write into the flat
        buffers in place: nothing more is held."""
        states = self.persistent + self.carried
        moments, below = [], self.embedding
        for layer, k in enumerate(self.bucket):
            activations = below + self.working[layer]
            name = f"forward, layer {layer}"
            staged = self._gather_copy(k + 1)  # the prefetch in flight
            moment = self._moment(name, states, activations, staged, (0, k, k + 1), staged)
            moments.append(moment)
            below += self.kept[layer]
        activations = below + self.output + self.loss_forward
        moments.append(self._moment("forward, loss", states, activations, 0.0, (0,)))
        return moments

    def _backward(self) -> list[Moment]:
        stage, last = self.layout.stage, len(self.numels) - 1
        everything = self.embedding + sum(self.kept) + self.output
        states = self.persistent + self.carried
        # Untied output weights: the engine's hook copies their gradient at once (into the
        # root bucket's buffer at stages 1-3); tied ones autograd holds to the end.
        output = self.table + (0.0 if self.tied or stage == 0 else self._open(0))
        at_loss = everything + self.loss_backward
        moments = [
            self._moment(
                "backward, loss",
                states,
                at_loss,
                self._gather_copy(last),
                (0, last),
                self._gather_copy(last),
            ),
            self._moment(
                "backward, output layer",
                states + (self._kept_open(len(self.bucket)) if not self.tied else 0.0),
                everything + self.logit_grad + self.residual + 2 * self.gathered_input,
                output,
                (0, last),
                autograd=self.table,
            ),
        ]
        held = self.table if self.tied else 0.0
        # Stage 1's carried full buffers are counted as open buffers below.
        states = self.persistent + (self.carried if stage != 1 else 0.0)
        new_shards = self.carried == 0.0 or stage == 1  # else folded into carried ones
        pending = copy = 0.0  # the reduction in flight, and gloo's copy in it
        below = everything - self.output
        for layer in range(len(self.bucket) - 1, -1, -1):
            k = self.bucket[layer]
            below -= self.kept[layer]
            previous = k - 1 if k > 1 else -1  # prefetched at stage 3 (bucket 0 is held)
            activations = below + self.working[layer] + self.flow
            if stage >= 1 and self._opens(layer) and pending:
                # The reduction in flight ends before bucket k's buffer opens (the engine's
                # `_on_grad`): one full gradient buffer of the units at a time.
                states += self.g * self.shards[k + 1] if new_shards else 0.0
                pending = copy = 0.0
            buffers = held + self._open(k) + pending
            grads = self._kept_open(layer)  # stage 0's, kept to the step
            if self._opens(layer):
                # Bucket k's buffer opens with its first gradient, the projection's weight
                # gradient, after the projection's backward released its saved input:
                # the larger of the moments before and after.
                opening = self.g * self.numels[k]
                if opening > self.proj_input:
                    activations -= self.proj_input
                elif stage == 0:
                    grads -= opening
                else:
                    buffers -= opening
            name = f"backward, layer {layer}"
            gathered = (0, k, previous)
            moment = self._moment(name, states + grads, activations, buffers, gathered, copy, held)
            moments.append(moment)
            if stage >= 1 and (layer == 0 or self.bucket[layer - 1] != k):
                # Bucket k complete: issued (stage 3 frees its gathered buffer), then the
                # reduction before it is waited for and folded into its shard.
                issued = self._in_flight(k)
                buffers = held + self._open(k) - self.g * self.numels[k] + issued + pending
                name = f"backward, bucket {k} reduced"
                activations = below + self.residual
                unseen = self._copy(k)  # the one waited for is seen as it is waited for
                moment = self._moment(
                    name, states, activations, buffers, (0, previous), unseen, held
                )
                moments.append(moment)
                if pending and new_shards:
                    states += self.g * self.shards[k + 1]
                pending, copy = issued, self._copy(k)
        # The embedding's weight gradient; when tied, next to the output layer's and their
        # sum (autograd adds the two out of place: three tables at once, measured by the
        # rehearsal of a 17B rank, launch.rehearse); then bucket 0 issued while bucket 1's
        # reduction is waited for.
        tables = self.table + 2 * held
        buffers = self._open(0) + pending + tables
        name = "backward, embedding"
        grads = self._kept_open(0)  # every buffer opened
        moments.append(
            self._moment(name, states + grads, self.embedding, buffers, (0,), copy, autograd=tables)
        )
        if stage >= 1:
            buffers = self._in_flight(0) + pending
            name, unseen = "backward, root bucket reduced", self._copy(0)
            moments.append(self._moment(name, states, 0.0, buffers, (), unseen))
        return moments

    def _optimizer_step(self) -> Moment:
        """hybrid.engine.step: bucket by bucket, a 16-bit gradient shard (stage 0: the
        full buffer) is cast to fp32 and kept until the step returns, and the 16-bit shard
        is released; fp32 shards (fp32 precision or reduction) are the gradients, unscaled
        in place in fp16."""
        g, stage = self.g, self.layout.stage
        shards = self.shards if stage >= 1 else self.numels
        if g == FP32:
            states, buffers = self.persistent + g * sum(shards), 0.0
        else:  # stage 0 keeps its 16-bit buffers (the shards' source) through the step
            states = self.persistent + (g * sum(shards) if stage == 0 else 0.0)
            buffers = FP32 * sum(shards) + (g * shards[-1] if stage >= 1 else 0.0)
        if self.layout.precision == "fp16":  # the overflow check's boolean masks
            buffers += 2 * max(shards)
        return self._moment("optimizer step", states, 0.0, float(buffers))
