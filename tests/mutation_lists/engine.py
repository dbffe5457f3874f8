"""Mutations of the engine, ZeRO, tensor parallelism and the collectives
(hybrid/engine.py, hybrid/zero, hybrid/tensor_parallel, hybrid/distributed)."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

MUTATIONS = [
    Mutation(
        "stage 0 keeps its full gradient buffers through the next forward",
        "hybrid/engine.py",
        "        for state in self.states:\n            state.grad_flat = None\n",
        "        for state in self.states:\n            pass\n",
        (
            "tests/peers/test_memory_vs_plain.py::test_no_gradient_is_alive_during_forward",
            "tests/peers/test_memory_vs_plain.py::test_peak_step_memory_is_the_plain_loops",
        ),
    ),
    Mutation(
        "one process opens bucket buffers instead of stepping on autograd's gradients",
        "hybrid/engine_config.py",
        "        config.zero_stage == 0\n        and dp_size == 1\n",
        "        config.zero_stage == 0\n        and dp_size == 0\n",
        ("tests/peers/test_memory_vs_plain.py::test_peak_step_memory_is_the_plain_loops",),
    ),
    Mutation(
        "one process keeps autograd's gradients through the next forward",
        "hybrid/zero/gradients.py",
        "            view.grad = grad.reshape(-1)  # a view: autograd's are contiguous\n"
        "            param.grad = None\n",
        "            view.grad = grad.reshape(-1)  # a view: autograd's are contiguous\n",
        ("tests/peers/test_memory_vs_plain.py::test_no_gradient_is_alive_during_forward",),
    ),
    Mutation(
        "keep autograd's gradient after copying it into the bucket",
        "hybrid/engine.py",
        "        grad, param.grad = param.grad, None\n",
        "        grad = param.grad\n",
        ("tests/peers/test_memory_vs_plain.py::test_peak_step_memory_is_the_plain_loops",),
    ),
    Mutation(
        "take the clip norm of a whole bucket segment in one fp32 sum",
        "hybrid/zero/gradients.py",
        "NORM_PIECE = 1 << 16\n",
        "NORM_PIECE = 1 << 30\n",
        (
            "tests/precision/test_grad_norm_accuracy.py::"
            "test_sum_of_squares_over_a_bucket_segment_is_float64_accurate",
        ),
    ),
    Mutation(
        "the engine keeps its build's freed heap pages resident (no malloc_trim)",
        "hybrid/engine.py",
        "        trim_freed_memory(device)  # the build's freed host memory back to the OS\n",
        "",
        ("tests/zero/test_host_memory.py::test_the_engine_returns_its_build_s_freed_memory",),
    ),
    Mutation(
        "trim_freed_memory reports success without returning the heap's free pages",
        "hybrid/distributed/host_memory.py",
        "    return malloc_trim is not None and bool(malloc_trim(0))\n",
        "    return True\n",
        ("tests/zero/test_host_memory.py::test_freed_heap_pages_go_back_to_the_os",),
    ),
    Mutation(
        "skip the DP all-reduce of the gradient norm",
        "hybrid/zero/gradients.py",
        "        dp.all_reduce(squares)\n",
        "        pass\n",
        (
            "tests/precision/test_clipping.py::test_norm_and_clipped_weights_match_torch_at_every_layout",
        ),
    ),
    Mutation(
        "count replicated parameters tp times in the norm",
        "hybrid/zero/gradients.py",
        "    return float((split_part[0] + squares[1]).sqrt())",
        "    return float((split_part[0] + squares[1] * tp_group.size).sqrt())",
        ("tests/hf/test_hf.py::test_import_at_tp2_matches_transformers",),
    ),
    Mutation(
        "drop the 1/dp scaling of the loss",
        "hybrid/engine.py",
        "scale = self.loss_scale / (self.config.micro_batches * self.dp.size)",
        "scale = self.loss_scale / self.config.micro_batches",
        ("tests/zero/test_data_parallel.py",),
    ),
    Mutation(
        "leave padded vocabulary unmasked",
        "hybrid/tensor_parallel/cross_entropy.py",
        "        if vocab_start + local_vocab > n_real:",
        "        if False:",
        ("tests/hf/test_hf.py::test_import_at_tp2_matches_transformers",),
    ),
    Mutation(
        "reduce sequence-parallel LayerNorm gradients twice",
        "hybrid/engine.py",
        "                    self.tp.group.all_reduce(flat[segment.start : segment.end])\n",
        "                    self.tp.group.all_reduce(flat[segment.start : segment.end])\n"
        "                    self.tp.group.all_reduce(flat[segment.start : segment.end])\n",
        ("tests/tensor_parallel/test_hybrid_2d.py",),
    ),
    Mutation(
        "skip the stage-3 backward regather",
        "hybrid/zero/gather.py",
        "tensor.register_hook(lambda grad: (before(index, backward_next), grad)[1])",
        "None",
        ("tests/zero/test_zero.py::test_stage_matches_adamw",),
    ),
    Mutation(
        "apply the update on a skipped NaN step",
        "hybrid/engine.py",
        "            self._release_gradients()\n"
        "            return StepStats(norm, True, self.loss_scale)\n",
        "            pass\n",
        ("tests/precision/test_nonfinite_skip.py",),
    ),
    # Issue 15: the checks this issue added.
    Mutation(
        "clip the gradients never",
        "hybrid/engine.py",
        "        divisor = (norm + 1e-6) / clip if 0 < clip < norm else None",
        "        divisor = None",
        (
            "tests/precision/test_clipping.py::test_norm_and_clipped_weights_match_torch_at_every_layout",
        ),
    ),
    Mutation(
        "bf16 weights with no fp32 master (the update rounded to bf16)",
        "hybrid/engine.py",
        "        self.optimizer.step()\n",
        "        self.optimizer.step()\n"
        "        for state in self.states:\n"
        "            state.master.copy_(state.master.to(self.dtype))\n",
        (
            "tests/precision/test_bf16_masters.py::test_fp32_masters_follow_the_reference_at_every_layout",
        ),
    ),
    # Issue 14: ZeRO-3 memory, seeded initialisation, streamed full state.
    Mutation(
        "ZeRO-3 frees a bucket without releasing its storage",
        "hybrid/zero/gather.py",
        "        self._flat[index].untyped_storage().resize_(0)\n        self._held",
        "        self._held",
        ("tests/zero/test_stage3_memory.py",),
    ),
    Mutation(
        "a rank draws every parameter in full at initialisation",
        "hybrid/zero/state.py",
        '    make = getattr(source, "initial_values", None)',
        "    make = None",
        ("tests/model/test_meta_construction.py",),
    ),
    Mutation(
        "clone the softmax in the cross-entropy's backward",
        "hybrid/tensor_parallel/cross_entropy.py",
        "        grad = softmax  # in place: the softmax is needed by nothing else\n",
        "        grad = softmax.clone()\n",
        ("tests/tensor_parallel/test_cross_entropy_memory.py",),
    ),
    Mutation(
        "micro-batch accumulation rounded to bf16 again (the sum cast to the gradient's dtype)",
        "hybrid/engine.py",
        "lambda view, add: view.add_(grad) if add",
        "lambda view, add: view.copy_(view.to(grad.dtype) + grad) if add",
        (
            "tests/zero/test_grad_reduce.py::test_fp32_shard_equals_the_fp32_sum_of_bf16_micro_batch_gradients",
        ),
    ),
    Mutation(
        "fp16 loss scale divided only when the shard is cast (not for fp32 shards)",
        "hybrid/zero/gradients.py",
        "        if grad.dtype != torch.float32:\n"
        "            grad = grad.float()\n"
        "        if loss_scale != 1.0:"
        "  # fp16: unscaled in fp32, the shard's own if fp32\n"
        "            grad /= loss_scale\n",
        "        if grad.dtype != torch.float32:\n"
        "            grad = grad.float()\n"
        "            if loss_scale != 1.0:\n"
        "                grad /= loss_scale\n",
        ("tests/zero/test_grad_reduce.py::test_fp16_loss_scale_is_divided_out_of_fp32_shards",),
    ),
    Mutation(
        "stages 1-2 wait for every parameter gather in the step (no overlap)",
        "hybrid/zero/publish.py",
        "        self._queued = list(range(len(self.flats)))\n        self._issue()\n",
        "        self._queued = list(range(len(self.flats)))\n        self._issue()\n"
        "        self.wait_all()\n",
        ("tests/zero/test_param_gather_overlap.py",),
    ),
    Mutation(
        "no forward pre-hook waits for a unit's bucket (forward reads parameters in flight)",
        "hybrid/zero/publish.py",
        "            unit.register_forward_pre_hook(lambda module, args, k=bucket: before(k))\n",
        "",
        ("tests/zero/test_param_gather_overlap.py",),
    ),
    Mutation(
        "pairwise reduce-scatter sends its own half",
        "hybrid/distributed/pairwise.py",
        "dist.isend(pieces[peer], group=group",
        "dist.isend(pieces[rank], group=group",
        ("tests/zero/test_pairwise.py::test_reduce_scatter_matches_gloo_and_the_fp64_sum",),
    ),
    Mutation(
        "pairwise reduce-scatter leaves out its own half",
        "hybrid/distributed/pairwise.py",
        "            out.add_(addend)\n",
        "            pass\n",
        ("tests/zero/test_pairwise.py::test_reduce_scatter_matches_gloo_and_the_fp64_sum",),
    ),
    Mutation(
        "pairwise all-gather leaves an out-of-place shard out",
        "hybrid/distributed/pairwise.py",
        "        mine.copy_(shard)\n",
        "        pass\n",
        ("tests/zero/test_pairwise.py::test_all_gather_is_the_concatenation",),
    ),
    Mutation(
        "pairwise all-gather files a peer's piece in the wrong place",
        "hybrid/distributed/pairwise.py",
        "dist.irecv(pieces[peer], group=group",
        "dist.irecv(pieces[(peer + 1) % size], group=group",
        ("tests/zero/test_pairwise.py::test_all_gather_is_the_concatenation",),
    ),
    Mutation(
        "gloo groups never exchange pairwise",
        "hybrid/distributed/comm.py",
        'dist.get_backend(process_group) == "gloo"',
        'dist.get_backend(process_group) == "nccl"',
        ("tests/zero/test_pairwise.py::test_dispatcher_sees_sends_of_a_rings_bytes",),
    ),
    Mutation(
        "an exchange dropped in flight is freed unfinished",
        "hybrid/distributed/pairwise.py",
        "    def __del__(self) -> None:",
        "    def _unused(self) -> None:",
        (
            "tests/zero/test_pairwise.py::test_exchanges_dropped_in_flight_do_not_stall_the_group[2]",
        ),
    ),
    Mutation(
        "a written weight gradient overwrites the micro-batches before it",
        "hybrid/tensor_parallel/weight_grads.py",
        "            out.addmm_(grad.t(), x)\n",
        "            torch.mm(grad.t(), x, out=out)\n",
        (
            "tests/zero/test_weight_grads.py::test_written_gradients_are_autograds[1-2-Recompute.NONE]",
        ),
    ),
    Mutation(
        "the engine leaves the Linear weights' gradients to autograd (no sinks)",
        "hybrid/engine.py",
        "            attach_weight_gradient_sinks(self.module, ",
        "            (lambda *_: None)(self.module, ",
        (
            "tests/zero/test_weight_grads.py::test_written_gradients_are_autograds[1-2-Recompute.NONE]",
        ),
    ),
    Mutation(
        "the sink looked up on a copy of the weight (as a recomputed saved tensor is)",
        "hybrid/tensor_parallel/linear.py",
        "ctx.has_bias, ctx.parameter = bias is not None, weight\n",
        "ctx.has_bias, ctx.parameter = bias is not None, weight.detach()\n",
        (
            "tests/zero/test_weight_grads.py::test_written_gradients_are_autograds[2-2-Recompute.FULL]",
        ),
    ),
    Mutation(
        "under sequence parallelism the sink looked up on a copy of the weight",
        "hybrid/tensor_parallel/layers.py",
        "ctx.group, ctx.has_bias, ctx.parameter = group, bias is not None, weight\n",
        "ctx.group, ctx.has_bias, ctx.parameter = group, bias is not None, weight.detach()\n",
        (
            "tests/zero/test_weight_grads.py::test_written_gradients_under_sequence_parallel_recomputation",
        ),
    ),
    Mutation(
        "a second gradient of a sunk weight is taken (its bucket may be reduced already)",
        "hybrid/zero/state.py",
        "        if self.arrived[index]:\n",
        "        if False:\n",
        ("tests/zero/test_weight_grads.py::test_a_weight_used_outside_its_layer_is_refused",),
    ),
    Mutation(
        "a weight two layers share gets a sink (two writes, no sum)",
        "hybrid/tensor_parallel/layers.py",
        "uses[id(weight)] == 1",
        "uses[id(weight)] >= 1",
        ("tests/zero/test_weight_grads.py::test_a_weight_two_layers_share_is_summed_by_autograd",),
    ),
    Mutation(
        "a gradient hook on a Linear's weight is skipped (the sink takes the gradient)",
        "hybrid/tensor_parallel/weight_grads.py",
        "    return None if weight._backward_hooks else getattr(weight, _SINK, None)\n",
        "    return getattr(weight, _SINK, None)\n",
        ("tests/zero/test_weight_grads.py::test_a_gradient_hook_on_a_weight_sees_and_changes_it",),
    ),
    # Issue 30: the clip inside the fused AdamW kernel.
    Mutation(
        "the clip's divisor left on the optimizer (the next, unclipped step divides too)",
        "hybrid/zero/optimizer.py",
        '        optimizer.__dict__.pop("grad_scale", None)',
        "        pass",
        ("tests/precision/test_clip_in_adamw.py",),
    ),
    Mutation(
        "the clip's divisor never given to the kernel",
        "hybrid/zero/optimizer.py",
        "        optimizer.grad_scale = torch.tensor(divisor,",
        "        optimizer.unused_scale = torch.tensor(divisor,",
        ("tests/precision/test_clip_in_adamw.py",),
    ),
    # Issue 30: the Linear's two-node backward (x freed before grad_x; gelu's in place).
    Mutation(
        "the Linear's backward is autograd's one node (x alive beside grad_x)",
        "hybrid/tensor_parallel/linear.py",
        "    if not recorded:\n",
        "    if True:\n",
        (
            "tests/tensor_parallel/test_linear_backward.py::test_the_mlp_backward_holds_one_hidden_buffer_fewer",
        ),
    ),
    Mutation(
        "gelu's gradient written to a new tensor, not over grad_h",
        "hybrid/tensor_parallel/linear.py",
        "approximate=ctx.approximate, grad_input=grad_input\n",
        "approximate=ctx.approximate, grad_input=torch.empty_like(grad_input)\n",
        (
            "tests/tensor_parallel/test_linear_backward.py::test_the_mlp_backward_holds_one_hidden_buffer_fewer",
        ),
    ),
    Mutation(
        "h's absent gradient made as zeros (a hidden-sized buffer)",
        "hybrid/tensor_parallel/linear.py",
        "        ctx.set_materialize_grads(False)",
        "        ctx.set_materialize_grads(True)",
        (
            "tests/tensor_parallel/test_linear_backward.py::test_the_mlp_backward_holds_one_hidden_buffer_fewer",
        ),
    ),
]
