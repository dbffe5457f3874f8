"""Mutations of ZeRO for any model (hybrid/wrap, and what it relies on in hybrid/zero)
and of the Hugging Face fine-tune as it is (models/hf_native, launch)."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

WRAP = "tests/any_model/test_wrap.py"

MUTATIONS = [
    Mutation(
        "tied weights counted twice (an embedding and its output layer laid out apart)",
        "hybrid/zero/bucket.py",
        "    groups = [[(names[id(p)], p) for p in model.parameters() if id(p) not in in_units]]",
        "    groups = [[(n, p) for n, p in model.named_parameters(remove_duplicate=False)"
        " if id(p) not in in_units]]",
        (f"{WRAP}::test_wrap_trains_a_hugging_face_model_as_a_plain_adamw_loop[qwen2]",),
    ),
    Mutation(
        "units not detected (one bucket for the whole model)",
        "hybrid/wrap/units.py",
        "    return list(largest)\n",
        "    return []\n",
        (
            f"{WRAP}::test_wrap_trains_a_hugging_face_model_as_a_plain_adamw_loop[mistral]",
            f"{WRAP}::test_stage_3_holds_at_most_two_units_of_gathered_parameters",
        ),
    ),
    Mutation(
        "a meta parameter drawn whole on every rank, then sliced",
        "hybrid/wrap/meta_init.py",
        "        out = torch.zeros(end - start, dtype=self.dtypes[name])\n",
        "        out = torch.zeros(self.shapes[name].numel(), dtype=self.dtypes[name])\n"
        "        start, end = 0, out.numel()\n",
        (f"{WRAP}::test_a_meta_model_at_stage_3_is_initialised_shard_by_shard",),
    ),
    Mutation(
        "a unit's output in a tuple gets no gather before its backward (ZeRO-3)",
        "hybrid/zero/gather.py",
        "            for tensor in tree_leaves(output):\n",
        "            for tensor in [output]:\n",
        (f"{WRAP}::test_wrap_trains_a_hugging_face_model_as_a_plain_adamw_loop[vit]",),
    ),
    Mutation(
        "ZeRO-3 prefetches nothing in backward",
        "hybrid/zero/gather.py",
        "            self.gather(index)\n            self.prefetch(following)\n",
        "            self.gather(index)\n            if not in_backward():\n"
        "                self.prefetch(following)\n",
        (
            "tests/planning/test_plan_instrument.py::test_planner_peak_within_10_percent_of_the_instrument",
        ),
    ),
    Mutation(
        "resume does not restore the model's shards (an HF model keeps its fresh init)",
        "hybrid/checkpoint/engine_state.py",
        "        {key: value for key, value in state.items() if key in saved},\n",
        "        {k: v for k, v in state.items() if k in saved and not k.startswith('model.')},\n",
        (
            "tests/any_model/test_hf_native_finetune.py::"
            "test_a_qwen2_folder_fine_tunes_as_it_is_resumes_exactly_and_exports",
        ),
    ),
]
