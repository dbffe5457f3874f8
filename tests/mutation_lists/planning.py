"""Mutations of the planner, the instruments and the rehearsal
(hybrid/memory, hybrid/instruments, launch/planning, launch/plan.py)."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

MUTATIONS = [
    Mutation(
        "the planner forgets stage 3's gathered buckets",
        "hybrid/memory/peak.py",
        "        chosen = {k for k in buckets if 0 <= k < len(self.numels)}",
        "        chosen = set()",
        ("tests/planning/test_plan_instrument.py",),
    ),
    Mutation(
        "the memory check never knows the device's size",
        "launch/planning/memory_check.py",
        "    known = memory_limit(config, device)",
        "    known = None",
        ("tests/planning/test_memory_check.py",),
    ),
    Mutation(
        "file the fp32 master under activations, not optimizer states",
        "hybrid/instruments/engine_memory.py",
        '            yield "optimizer", state.master\n',
        "            pass\n",
        (
            "tests/planning/test_rehearse.py::test_peak_and_categories_within_10_percent_of_the_planner",
        ),
    ),
    Mutation(
        "a rehearsal plays rank 0 whatever --rank says",
        "launch/planning/rehearsal.py",
        "    with fake_world(request.world, request.rank):",
        "    with fake_world(request.world, 0):",
        ("tests/planning/test_rehearse.py::test_model_states_equal_a_real_job",),
    ),
    Mutation(
        "count an all-gather by its input, not its output",
        "hybrid/instruments/dispatch_counters.py",
        '    "_allgather_base_": ("all_gather", 0),  # the output',
        '    "_allgather_base_": ("all_gather", 1),',
        (
            "tests/planning/test_rehearse.py::test_collectives_counted_at_the_dispatcher_equal_ours_and_the_plan",
        ),
    ),
    Mutation(
        "no refusal of a layout above the memory",
        "launch/planning/rehearsal.py",
        "    if need > limit:",
        "    if False:",
        ("tests/planning/test_rehearse.py::test_refusals_come_before_anything_is_allocated",),
    ),
    Mutation(
        "the planner forgets the sum of the tied embedding's gradients",
        "hybrid/memory/peak.py",
        "        tables = self.table + 2 * held\n",
        "        tables = self.table + held\n",
        ("tests/planning/test_rehearse.py::test_tied_embedding_gradients_at_the_embedding_moment",),
    ),
    Mutation(
        "planner counts gradients at the parameter element size whatever grad_reduce_dtype",
        "hybrid/memory/model_states.py",
        '    return 4 if grad_reduce_dtype == "fp32" else element\n',
        "    return element\n",
        ("tests/zero/test_grad_reduce.py::test_planner_follows_the_setting",),
    ),
    Mutation(
        "the planner's cross-entropy terms of the cloning loss (e + 12 bytes per logit)",
        "hybrid/memory/peak.py",
        "        self.loss_forward = (e + FP32) * tokens * vocab\n",
        "        self.loss_forward = (e + 3 * FP32) * tokens * vocab\n",
        (
            "tests/planning/test_rehearse.py::test_peak_and_categories_within_10_percent_of_the_planner",
        ),
    ),
    Mutation(
        "the planner keeps the explicit attention core with dropout on CUDA too",
        "hybrid/memory/activations.py",
        '    if recompute == "none" and shape.dropout and not shape.dropout_in_kernel:\n',
        '    if recompute == "none" and shape.dropout:\n',
        ("tests/planning/test_plan.py::test_dropout_on_cuda_keeps_no_attention_core",),
    ),
    Mutation(
        "launch.plan plans the CPU attention path for NCCL runs",
        "launch/planning/search.py",
        '    return "cuda" if getattr(args, "backend", "nccl") == "nccl" else "cpu"\n',
        '    return "cpu"\n',
        ("tests/planning/test_plan.py::test_dropout_on_cuda_keeps_no_attention_core",),
    ),
    Mutation(
        "plan the step's all-gather hidden though the step waits for it",
        "hybrid/memory/planner.py",
        "if layout.overlap_param_gather else gather",
        "",
        (
            "tests/planning/test_plan_cli.py::test_overlap_off_waits_for_the_parameter_gathers_in_the_step",
        ),
    ),
    Mutation(
        "the dispatcher trace ignores point-to-point sends",
        "hybrid/instruments/dispatch_counters.py",
        '    "send": ("send", 0),\n',
        "",
        ("tests/zero/test_pairwise.py::test_dispatcher_sees_sends_of_a_rings_bytes",),
    ),
    Mutation(
        "plan gloo's reduce-scatter copy in a group of two, which exchanges pairwise",
        "hybrid/memory/peak.py",
        'self.layout.backend == "gloo" and not reduces_pairwise(self.layout.dp)',
        'self.layout.backend == "gloo"',
        (
            "tests/planning/test_plan_instrument.py::test_gloo_adds_its_copies_only_where_its_own_collectives_run",
        ),
    ),
    Mutation(
        "gathers issued after the step are not counted in the rehearsal's window",
        "launch/planning/rehearsal.py",
        "        engine.wait_for_parameters()\n        if cuda:",
        "        if cuda:",
        (
            "tests/planning/test_rehearse_fake.py::test_bytes_of_a_step_cycle_equal_the_planner_at_every_stage",
        ),
    ),
]
