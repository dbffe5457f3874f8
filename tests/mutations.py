"""The mutation check: does the suite fail when the code is wrong?

    python tests/mutations.py                 # every mutation (about 10 min on 2 cores)
    python tests/mutations.py --list          # names, files and the tests that should fail
    python tests/mutations.py --only NAME ... # some of them

The tree (git's tracked and untracked, not ignored, files) is copied to a temporary
folder; the tests that should catch the mutations first run there unmutated (they must
pass, else a "caught" would mean nothing), then each mutation, a small textual patch named
by what it breaks, is applied alone and its tests run with `pytest -x`. A mutation is
caught when pytest reports a failing test (exit 1); an error of the harness (the patch no
longer applies, nothing collected) is reported as such, never as caught. The copy comes
first on PYTHONPATH, so the mutated code is what the tests and their subprocesses import,
not the editable install. Exits 1 unless every mutation was caught.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class Mutation:
    name: str  # what it breaks
    path: str  # relative to the repository root
    old: str  # must occur exactly once in the file
    new: str
    tests: tuple[str, ...]  # pytest node ids, any of which should fail


MUTATIONS = [
    Mutation(
        "stage 0 keeps its full gradient buffers through the next forward",
        "hybrid/engine.py",
        "        for state in self.states:\n            state.grad_flat = None\n",
        "        for state in self.states:\n            pass\n",
        (
            "tests/test_memory_vs_plain.py::test_no_gradient_is_alive_during_forward",
            "tests/test_memory_vs_plain.py::test_peak_step_memory_is_the_plain_loops_within_one_bucket",
        ),
    ),
    Mutation(
        "keep autograd's gradient after copying it into the bucket",
        "hybrid/engine.py",
        "        param.grad = None\n        state.ready += 1\n",
        "        state.ready += 1\n",
        (
            "tests/test_memory_vs_plain.py::test_peak_step_memory_is_the_plain_loops_within_one_bucket",
        ),
    ),
    Mutation(
        "skip the DP all-reduce of the gradient norm",
        "hybrid/engine.py",
        "            self.dp.all_reduce(squares)\n",
        "            pass\n",
        ("tests/test_clipping.py::test_norm_and_clipped_weights_match_torch_at_every_layout",),
    ),
    Mutation(
        "count replicated parameters tp times in the norm",
        "hybrid/engine.py",
        "        return float((split_part[0] + squares[1]).sqrt())",
        "        return float((split_part[0] + squares[1] * self.tp.size).sqrt())",
        ("tests/test_hf.py::test_import_at_tp2_matches_transformers",),
    ),
    Mutation(
        "drop the 1/dp scaling of the loss",
        "hybrid/engine.py",
        "scale = self.loss_scale / (self.config.micro_batches * self.dp.size)",
        "scale = self.loss_scale / self.config.micro_batches",
        ("tests/test_data_parallel.py",),
    ),
    Mutation(
        "make resume find no checkpoint",
        "launch/train/checkpointing.py",
        "        return _newest_loadable(checkpoint_root(config))",
        "        return None",
        ("tests/test_checkpoint.py::test_stopped_and_resumed_run_has_the_same_losses",),
    ),
    Mutation(
        "restore the wrong rank's RNG state",
        "hybrid/checkpoint/folders.py",
        '    file = path / "rng" / f"rank{rank}.pt"',
        '    file = path / "rng" / f"rank{rank ^ 1}.pt"',
        ("tests/test_checkpoint.py::test_stopped_and_resumed_run_has_the_same_losses",),
    ),
    Mutation(
        "leave padded vocabulary unmasked",
        "hybrid/tensor_parallel/cross_entropy.py",
        "        if vocab_start + local_vocab > n_real:",
        "        if False:",
        ("tests/test_hf.py::test_import_at_tp2_matches_transformers",),
    ),
    Mutation(
        "reduce sequence-parallel LayerNorm gradients twice",
        "hybrid/engine.py",
        "                    self.tp.group.all_reduce(flat[segment.start : segment.end])\n",
        "                    self.tp.group.all_reduce(flat[segment.start : segment.end])\n"
        "                    self.tp.group.all_reduce(flat[segment.start : segment.end])\n",
        ("tests/test_hybrid_2d.py",),
    ),
    Mutation(
        "skip the stage-3 backward regather",
        "hybrid/zero/gather.py",
        "output.register_hook(lambda grad: (before(index, backward_next), grad)[1])",
        "None",
        ("tests/test_zero.py::test_stage_matches_adamw",),
    ),
    Mutation(
        "apply the update on a skipped NaN step",
        "hybrid/engine.py",
        "            self.optimizer.zero_grad(set_to_none=True)\n"
        "            return StepStats(norm, True, self.loss_scale)\n",
        "            pass\n",
        ("tests/test_nonfinite_skip.py",),
    ),
    Mutation(
        "write a checkpoint shard without its checksum",
        "hybrid/checkpoint/folders.py",
        'files = sorted(tmp.glob(f"__{rank}_*.distcp")) + sorted(tmp.glob(f"rng/rank{rank}.pt"))',
        'files = sorted(tmp.glob(f"rng/rank{rank}.pt"))',
        ("tests/test_checkpoint.py::test_an_altered_shard_is_named_by_its_checksum",),
    ),
    # Issue 15: the checks this issue added.
    Mutation(
        "clip the gradients never",
        "hybrid/engine.py",
        "            torch._foreach_mul_(grads, self.config.grad_clip / (norm + 1e-6))",
        "            pass",
        ("tests/test_clipping.py::test_norm_and_clipped_weights_match_torch_at_every_layout",),
    ),
    Mutation(
        "bf16 weights with no fp32 master (the update rounded to bf16)",
        "hybrid/engine.py",
        "        self.optimizer.step()\n",
        "        self.optimizer.step()\n"
        "        for state in self.states:\n"
        "            state.master.copy_(state.master.to(self.dtype))\n",
        ("tests/test_bf16_masters.py::test_fp32_masters_follow_the_reference_at_every_layout",),
    ),
    Mutation(
        "save the fp16 loss scale's good steps not at all",
        "launch/train/checkpointing.py",
        '        "good_steps": engine.good_steps,\n',
        "",
        ("tests/test_fp16_loss_scale.py",),
    ),
    Mutation(
        "keep every checkpoint (no pruning)",
        "hybrid/checkpoint/folders.py",
        "        for old in complete[: max(0, len(complete) - keep)]:",
        "        for old in complete[:0]:",
        ("tests/test_checkpoint_keep.py",),
    ),
    # Issue 14: ZeRO-3 memory, seeded initialisation, streamed full state.
    Mutation(
        "ZeRO-3 frees a bucket without releasing its storage",
        "hybrid/zero/gather.py",
        "        self._flat[index].untyped_storage().resize_(0)\n        self._held",
        "        self._held",
        ("tests/test_stage3_memory.py",),
    ),
    Mutation(
        "a rank draws every parameter in full at initialisation",
        "hybrid/zero/state.py",
        '    make = getattr(model, "initial_values", None)',
        "    make = None",
        ("tests/test_meta_construction.py",),
    ),
    Mutation(
        "the full-state writer keeps every gathered bucket",
        "hybrid/checkpoint/full_state.py",
        "                gatherer.free(index)",
        "                pass",
        ("tests/test_full_state.py",),
    ),
    Mutation(
        "the planner forgets stage 3's gathered buckets",
        "hybrid/memory/peak.py",
        "        chosen = {k for k in buckets if 0 <= k < len(self.numels)}",
        "        chosen = set()",
        ("tests/test_plan_instrument.py",),
    ),
    Mutation(
        "the memory check never knows the device's size",
        "launch/planning/memory_check.py",
        "    known = memory_limit(config, device)",
        "    known = None",
        ("tests/test_memory_check.py",),
    ),
    Mutation(
        "file the fp32 master under activations, not optimizer states",
        "hybrid/instruments/engine_memory.py",
        '            yield "optimizer", state.master\n',
        "            pass\n",
        ("tests/test_rehearse.py::test_peak_and_categories_within_10_percent_of_the_planner",),
    ),
    Mutation(
        "a rehearsal plays rank 0 whatever --rank says",
        "launch/planning/rehearsal.py",
        "    with fake_world(request.world, request.rank):",
        "    with fake_world(request.world, 0):",
        ("tests/test_rehearse.py::test_model_states_equal_a_real_job",),
    ),
    Mutation(
        "count an all-gather by its input, not its output",
        "hybrid/instruments/dispatch_counters.py",
        '    "_allgather_base_": ("all_gather", 0),  # the output',
        '    "_allgather_base_": ("all_gather", 1),',
        (
            "tests/test_rehearse.py::test_collectives_counted_at_the_dispatcher_equal_ours_and_the_plan",
        ),
    ),
    Mutation(
        "no refusal of a layout above the memory",
        "launch/planning/rehearsal.py",
        "    if need > limit:",
        "    if False:",
        ("tests/test_rehearse.py::test_refusals_come_before_anything_is_allocated",),
    ),
    Mutation(
        "the planner forgets the sum of the tied embedding's gradients",
        "hybrid/memory/peak.py",
        "        tables = self.table + 2 * held\n",
        "        tables = self.table + held\n",
        ("tests/test_rehearse.py::test_tied_embedding_gradients_at_the_embedding_moment",),
    ),
    Mutation(
        "a lazy HF read takes the whole stored tensor, then slices it",
        "models/gpt/hf/lazy.py",
        "                            piece = sliced[lo + r : lo + r + n, c0:c1]",
        "                            piece = sliced[:][lo + r : lo + r + n, c0:c1]",
        ("tests/test_hf_lazy.py::test_a_range_reads_only_its_rows",),
    ),
    Mutation(
        "a lazy HF read starts a TP rank's rows one row per rank early",
        "models/gpt/hf/lazy.py",
        "            rows = rows + tp_rank * local[0]",
        "            rows = rows + tp_rank * (local[0] - 1)",
        ("tests/test_hf_lazy.py::test_reads_equal_the_eager_slices",),
    ),
    Mutation(
        "a lazy HF read takes the stored row one past the mapped one",
        "models/gpt/hf/lazy.py",
        "            lo = first & ((1 << _ROW_BITS) - 1)",
        "            lo = (first + 1) & ((1 << _ROW_BITS) - 1)",
        ("tests/test_hf_lazy.py::test_reads_equal_the_eager_slices",),
    ),
    Mutation(
        "a lazy HF read of GPT-2's Conv1D weights is not transposed",
        "models/gpt/hf/lazy.py",
        "                    piece = sliced[c : c + n, lo : lo + b - a].t()",
        "                    piece = sliced[lo : lo + b - a, c : c + n]",
        ("tests/test_hf_lazy.py::test_reads_equal_the_eager_slices",),
    ),
    Mutation(
        "the lazy HF import keeps a tensor with no place in the model",
        "models/gpt/hf/lazy.py",
        "    if left:\n        s = have[left[0]]",
        "    if False:\n        s = have[left[0]]",
        ("tests/test_hf_lazy.py::test_bad_folders_are_one_line_naming_file_and_key",),
    ),
    Mutation(
        "a ZeRO-3 rank reads its imported piece from the start of its TP slice",
        "models/gpt/model.py",
        "            value = self._init_weights.read(name, spec, self.tp.rank, start, end)",
        "            value = self._init_weights.read(name, spec, self.tp.rank, 0, end - start)",
        ("tests/test_hf_lazy.py::test_engine_shards_equal_the_eager_path_at_tp2_and_zero3",),
    ),
    Mutation(
        "every rank hashes every checkpoint file at resume",
        "hybrid/checkpoint/folders.py",
        "    for position in hashing_share([_size(file) for file, _, _ in files], rank, world):",
        "    for position in hashing_share([_size(file) for file, _, _ in files], 0, 1):",
        (
            "tests/test_resume_verify.py::test_full_verification_reads_every_byte_once_across_the_ranks",
        ),
    ),
    Mutation(
        "skip the all-reduce of the first bad checkpoint file",
        "hybrid/checkpoint/folders.py",
        "        first_bad = _min_over_ranks(first_bad, among)",
        "        pass",
        ("tests/test_resume_verify.py::test_an_altered_file_is_named_alike_on_every_rank",),
    ),
    Mutation(
        "checkpoint.verify=size hashes the files anyway",
        "launch/train/checkpointing.py",
        '    if candidate is None or verify != "full":',
        '    if candidate is None or verify == "none":',
        (
            "tests/test_resume_verify.py::test_size_reads_no_shard_and_none_reads_nothing_and_loads_the_altered_file",
        ),
    ),
    Mutation(
        "checkpoint.verify=none loads without a warning",
        "launch/train/checkpointing.py",
        '    if candidate is not None and verify == "none":',
        "    if False:",
        (
            "tests/test_resume_verify.py::test_size_reads_no_shard_and_none_reads_nothing_and_loads_the_altered_file",
        ),
    ),
    Mutation(
        "the command line resumes without hashing after start-up",
        "launch/train/entry.py",
        "        resume = verify_resume(config, candidate, env.world)",
        "        resume = candidate",
        (
            "tests/test_resume_verify.py::test_the_command_line_hashes_after_start_up_and_names_the_file",
        ),
    ),
    Mutation(
        "checkpoint.async read under its field's name",
        "launch/config/tree.py",
        '    return f.metadata.get("key", f.name)',
        "    return f.name",
        ("tests/test_resume_verify.py::test_verify_and_async_keys",),
    ),
    Mutation(
        "HF export: a shard's size counts half of each tensor",
        "models/gpt/hf/export.py",
        "        size += nbytes\n",
        "        size += nbytes // 2\n",
        ("tests/test_hf_export.py::test_shards_and_index_equal_save_pretrained",),
    ),
    Mutation(
        "HF export: gate and up projections swapped",
        "models/gpt/hf/layouts.py",
        "        return t.unflatten(0, (-1, 2))[:, i]",
        "        return t.unflatten(0, (-1, 2))[:, 1 - i]",
        ("tests/test_hf_export.py::test_shards_and_index_equal_save_pretrained",),
    ),
    Mutation(
        "HF export: k_proj taken from the v rows of our QKV",
        "models/gpt/hf/layouts.py",
        "        return _split_qkv(t, config)[i]",
        "        return _split_qkv(t, config)[(0, 2, 2)[i]]",
        ("tests/test_convert.py::test_hf_to_ours_at_tp2_stage3_and_back_is_exact",),
    ),
    Mutation(
        "HF export: index total_size counts elements, not bytes",
        "models/gpt/hf/export.py",
        '                "total_size": sum(_nbytes(entry) for entry in out_layout),',
        '                "total_size": sum(torch.Size(s).numel() for _, s, _ in out_layout),',
        ("tests/test_hf_export.py::test_a_tensor_above_the_limit_gets_its_own_file",),
    ),
    Mutation(
        "HF export: an index written for a single file",
        "models/gpt/hf/export.py",
        "    if len(shards) > 1:\n        index = {",
        "    if len(shards) >= 1:\n        index = {",
        ("tests/test_hf_export.py::test_one_file_and_no_index_when_everything_fits",),
    ),
    Mutation(
        "HF export: written straight into the final folder",
        "models/gpt/hf/export.py",
        '    tmp = folder.parent / f".tmp-{folder.name}"',
        "    tmp = folder",
        ("tests/test_hf_export.py::test_a_failed_export_leaves_the_previous_folder",),
    ),
    Mutation(
        "HF export: GB read as GiB",
        "models/gpt/hf/export.py",
        '"GB": 10**9',
        '"GB": 2**30',
        ("tests/test_hf_export.py::test_shard_sizes_parse_as_huggingface_hub_parses_them",),
    ),
    Mutation(
        "convert --to-hf reads the Adam moments along with the weights",
        "launch/convert.py",
        '    for key, tensor in reader.stream(f"model.{name}" for name in names):',
        '    keys = (k for n in names for k in (f"model.{n}", f"exp_avg.{n}"))\n'
        '    for key, tensor in ((k, t) for k, t in reader.stream(keys) if k[:6] == "model."):',
        ("tests/test_convert.py::test_hf_to_ours_at_tp2_stage3_and_back_is_exact",),
    ),
    Mutation(
        "convert --from-hf writes zero weights and the weights as exp_avg",
        "launch/convert.py",
        '        if kind != "model":\n            return torch.zeros(rows)',
        '        if kind != "exp_avg":\n            return torch.zeros(rows)',
        ("tests/test_convert.py::test_hf_to_ours_at_tp2_stage3_and_back_is_exact",),
    ),
    Mutation(
        "convert --from-hf writes Adam moments without --optimizer-states",
        "launch/convert.py",
        '    kinds = ("model", *MOMENTS) if optimizer_states else ("model",)',
        '    kinds = ("model", *MOMENTS)',
        ("tests/test_convert.py::test_a_checkpoint_without_moments_resumes_at_tp2_dp2_stage3",),
    ),
    Mutation(
        "the fine-tuned export leaves the tokenizer out",
        "launch/train/outputs.py",
        "            extra_files=lambda folder: tokenizer.save_pretrained(str(folder)),\n",
        "",
        (
            "tests/test_finetune.py::test_prompt_completion_loss_is_layout_free_and_matches_transformers",
        ),
    ),
    Mutation(
        "an asynchronous save writes the live tensors, not a staged copy",
        "hybrid/checkpoint/saver.py",
        "        return self._staged\n",
        "        return flats\n",
        (
            "tests/test_checkpoint_async.py::"
            "test_a_save_holds_the_state_of_its_step_while_training_goes_on[True]",
        ),
    ),
    Mutation(
        "a shard's checksum taken while writing misses its small writes",
        "hybrid/checkpoint/hashing.py",
        "            self.small += view\n",
        "            pass\n",
        ("tests/test_checkpoint_async.py::test_digests_taken_while_writing_equal_the_files",),
    ),
    Mutation(
        "a save runs a collective per key (as ShardedTensor did)",
        "hybrid/checkpoint/engine_state.py",
        '        key: ChunkedTensor(shapes[key.split(".", 1)[1]], pieces)\n',
        '        key: ChunkedTensor(shapes[key.split(".", 1)[1]], (\n'
        "            dist.all_gather_object([None] * dist.get_world_size(), key) or pieces\n"
        "        ))\n",
        ("tests/test_checkpoint_async.py::test_a_save_costs_a_few_collectives_not_one_per_key",),
    ),
    Mutation(
        "a checkpoint without Adam's moments keeps the engine's old ones",
        "hybrid/checkpoint/engine_state.py",
        '            flats["exp_avg"].zero_()\n',
        "",
        (
            "tests/test_checkpoint_async.py::test_a_checkpoint_without_moments_loads_with_fresh_ones",
        ),
    ),
    Mutation(
        "the checkpoint writer keeps each piece after writing it",
        "hybrid/checkpoint/offline_write.py",
        "        self.release()\n        key, start = write_item.index.fqn",
        "        key, start = write_item.index.fqn",
        ("tests/test_convert.py::test_the_checkpoint_writer_holds_one_piece_at_a_time",),
    ),
    Mutation(
        "the checkpoint writer's chunks twice the size asked for",
        "hybrid/checkpoint/offline_write.py",
        "    step = max(1, chunk_bytes // max(row, 1))",
        "    step = max(1, 2 * chunk_bytes // max(row, 1))",
        ("tests/test_convert.py::test_the_checkpoint_writer_holds_one_piece_at_a_time",),
    ),
    Mutation(
        "a raw checkpoint piece read from its first row, not the first row asked for",
        "hybrid/checkpoint/raw.py",
        "            stream.seek(info.offset + first * row)\n",
        "            stream.seek(info.offset)\n",
        ("tests/test_checkpoint_raw.py::test_a_resharded_load_reads_rows_and_columns_of_a_piece",),
    ),
    Mutation(
        "a raw checkpoint piece cut to the columns asked for from its first column",
        "hybrid/checkpoint/raw.py",
        "                whole = whole.narrow(dim, start, length)\n",
        "                whole = whole.narrow(dim, 0, length)\n",
        ("tests/test_checkpoint_raw.py::test_a_resharded_load_reads_rows_and_columns_of_a_piece",),
    ),
    Mutation(
        "the raw writer holds each piece until it has asked for the next",
        "hybrid/checkpoint/raw.py",
        "                del data, view  # a produced piece is freed once written\n",
        "",
        ("tests/test_convert.py::test_the_checkpoint_writer_holds_one_piece_at_a_time",),
    ),
    Mutation(
        "the raw writer stores each piece as a torch.save zip, as DCP's writer does",
        "hybrid/checkpoint/raw.py",
        "                    view, marks = tensor_bytes(data), [RAW]\n",
        "                    buf = io.BytesIO()\n"
        "                    torch.save(data, buf)\n"
        "                    view, marks = buf.getbuffer(), [RAW]\n",
        ("tests/test_checkpoint_raw.py::test_each_piece_is_its_bytes_and_nothing_else",),
    ),
    Mutation(
        "pruned checkpoints are renamed aside but never deleted",
        "hybrid/checkpoint/folders.py",
        "        shutil.rmtree(trash, ignore_errors=True)\n",
        "        pass\n",
        (
            "tests/test_checkpoint_keep.py::"
            "test_only_the_newest_keep_checkpoints_remain_and_resume_uses_the_newest",
        ),
    ),
    Mutation(
        "text paragraphs split at every newline instead of blank lines",
        "launch/data/prepare/read.py",
        'text.readline()).split("\\n\\n")  # finish the line first\n',
        'text.readline()).split("\\n")  # finish the line first\n',
        ("tests/test_prepare_data.py::test_tokens_and_document_index_equal_the_plain_computation",),
    ),
    Mutation(
        "a rerun after a crash re-tokenizes the inputs already finished",
        "launch/data/prepare/corpus.py",
        "        return part if whole else None\n",
        "        return None\n",
        ("tests/test_prepare_data.py::test_a_crash_keeps_the_inputs_already_finished",),
    ),
    Mutation(
        "waiting ranks sit in a barrier under the collective timeout again",
        "launch/train/loop.py",
        "        phase.wait_for_node()\n",
        "        torch.distributed.barrier()\n",
        ("tests/test_prepare_data.py::test_waiting_ranks_outlast_the_collective_timeout",),
    ),
    Mutation(
        "the sampler's permutation ignores the epoch: every epoch repeats the first's order",
        "launch/data/sampler.py",
        "            self._order = FeistelPermutation(self.n, (self.seed, self.stream, epoch))\n",
        "            self._order = FeistelPermutation(self.n, (self.seed, self.stream, 0))\n",
        (
            "tests/test_sampler_permutation.py::test_deterministic_from_the_seed_and_fresh_each_epoch",
        ),
    ),
    Mutation(
        "cycle-walking stops after one pass: ids >= n escape, an epoch is no bijection",
        "launch/data/sampler.py",
        "            outside = outside[out[outside] >= self.n]\n",
        "            outside = outside[:0]\n",
        ("tests/test_sampler_permutation.py::test_every_epoch_visits_each_window_once",),
    ),
    Mutation(
        "the sampler materialises a permutation per epoch (memory grows with the corpus)",
        "launch/data/sampler.py",
        "        out = self._rounds(np.asarray(positions, dtype=np.uint64))\n",
        "        out = np.random.default_rng(self.keys).permutation(self.n).astype(np.uint64)\n"
        "        out = out[np.asarray(positions, dtype=np.int64)]\n",
        (
            "tests/test_sampler_permutation.py::test_window_ids_at_a_trillion_tokens_in_constant_memory",
        ),
    ),
    Mutation(
        "a mixture's block order is dealt once and reused: resume and dp change the windows",
        "launch/data/mixture.py",
        "        if self._dealt[0] != block:\n",
        "        if self._dealt[0] == -1:\n",
        ("tests/test_mixture.py::test_resume_mid_run_and_at_another_dp_gives_the_same_windows",),
    ),
    Mutation(
        "a source restarts its sample index every block: it repeats windows, no epochs",
        "launch/data/mixture.py",
        "            k[chosen] = b * self.counts[source[chosen]] + rank[position[chosen]]\n",
        "            k[chosen] = rank[position[chosen]]\n",
        ("tests/test_mixture.py::test_proportions_over_ten_thousand_windows_match_the_weights",),
    ),
    Mutation(
        "every source is validated on the first source's windows",
        "launch/data/mixture.py",
        "            eval_batches(part, n_samples, micro_batch_size, dp_rank, dp_size),\n",
        "            eval_batches(val.parts[0], n_samples, micro_batch_size, dp_rank, dp_size),\n",
        ("tests/test_mixture.py::test_a_mixture_run_writes_val_loss_per_source",),
    ),
    Mutation(
        "packed documents attend across examples (mask ignores segment ids)",
        "models/gpt/attention.py",
        "    same = segments[:, :, None] == segments[:, None, :]\n",
        "    same = segments[:, :, None] >= segments[:, None, :]\n",
        ("tests/test_packing.py::test_packed_loss_equals_each_example_alone",),
    ),
    Mutation(
        "packed positions do not restart per example",
        "models/gpt/model.py",
        "            mask, positions = document_mask(segments), segment_positions(segments)\n",
        "            mask, positions = document_mask(segments), None\n",
        ("tests/test_packing.py::test_packed_loss_equals_each_example_alone",),
    ),
    Mutation(
        "cached examples take the loss on the last prompt token too (off by one)",
        "launch/data/examples.py",
        "        targets[: max(int(self.prompt[i]) - 1, 0)] = IGNORE_INDEX\n",
        "        targets[: max(int(self.prompt[i]) - 2, 0)] = IGNORE_INDEX\n",
        ("tests/test_packing.py::test_cache_is_memory_mapped_compact_and_reused",),
    ),
    Mutation(
        "TokenShards drops the last token of each shard in a slice across shards",
        "launch/data/shards.py",
        " - begin : min(hi, end) - begin])\n",
        " - begin : min(hi, end - 1) - begin])\n",
        ("tests/test_shards.py::test_round_trip_across_shard_boundaries",),
    ),
    Mutation(
        "the shard scan accepts a token id equal to vocab_size",
        "launch/data/shards.py",
        "if chunk.size and int(chunk.max()) >= self.vocab_size:\n",
        "if chunk.size and int(chunk.max()) > self.vocab_size:\n",
        ("tests/test_shards.py::test_bad_shard_folders_say_what_is_wrong",),
    ),
    Mutation(
        "slicing TokenShards copies the tokens instead of returning a lazy view",
        "launch/data/shards.py",
        "            return view\n",
        "            return np.asarray(view)\n",
        ("tests/test_shards.py::test_memory_does_not_grow_with_the_corpus",),
    ),
    Mutation(
        "every rank of a node prepares the cache (local rank 0 no longer the only one)",
        "launch/data/prepare/wait.py",
        "        self.first = env.local_rank == 0\n",
        "        self.first = True\n",
        (
            "tests/test_two_nodes.py::test_two_nodes_prepare_their_own_cache_once_and_match_one_node",
        ),
    ),
    Mutation(
        "a checked cache is never reused: the node's waiting ranks tokenize it again",
        "launch/data/token_file.py",
        "    if problem is None:\n        return token_file\n",
        "    if problem is None and False:\n        return token_file\n",
        (
            "tests/test_two_nodes.py::test_two_nodes_prepare_their_own_cache_once_and_match_one_node",
        ),
    ),
    Mutation(
        "a pre-tokenized datasets folder's ids are not checked against the vocabulary",
        "launch/data/hf_folders.py",
        "    if flat.size and (flat.min() < 0 or flat.max() >= vocab):\n",
        "    if False:\n",
        ("tests/test_hf_folders.py::test_an_id_outside_the_vocabulary_is_one_line_naming_the_row",),
    ),
    Mutation(
        "the cache key of a datasets folder ignores its files' sizes, mtimes and hashes",
        "launch/data/prepare/read.py",
        '        parts = [f"{f.relative_to(path)}={input_fingerprint(f)}" for f in files]\n',
        "        parts = [str(f.relative_to(path)) for f in files]\n",
        ("tests/test_hf_folders.py::test_editing_a_file_in_the_folder_changes_the_cache_key",),
    ),
    Mutation(
        "a datasets folder's text rows lose their end-of-text separator",
        "launch/data/prepare/corpus.py",
        "        eos = tokenizer.eos_token_id\n",
        "        eos = None\n",
        ("tests/test_hf_folders.py::test_text_rows_are_tokenized_like_records",),
    ),
    Mutation(
        "prepare a bpe mixture's sources each with its own vocabulary",
        "launch/prepare_data.py",
        "    data = shared_tokenizer(data)  # bpe: one vocabulary trained on every source, as "
        "training\n",
        "",
        (
            "tests/test_prepare_data.py::test_command_line_prepares_a_bpe_mixture_that_training_finds_cached",
        ),
    ),
    Mutation(
        "token shards' ids checked only in the data phase, never before the process group",
        "launch/train/entry.py",
        "    if len(shards) * shards.dtype.itemsize <= SCAN_AT_START_BYTES:\n",
        "    if False:\n",
        (
            "tests/test_shards.py::"
            "test_pretraining_reads_a_shard_folder_in_place_and_names_a_missing_shard",
        ),
    ),
    Mutation(
        "clone the softmax in the cross-entropy's backward",
        "hybrid/tensor_parallel/cross_entropy.py",
        "        grad = softmax  # in place: the softmax is needed by nothing else\n",
        "        grad = softmax.clone()\n",
        ("tests/test_cross_entropy_memory.py",),
    ),
    Mutation(
        "recompute RoPE's tables in every layer",
        "models/gpt/attention.py",
        "    return _cached_rotary_table(seq, head_dim, theta, like.device, like.dtype)\n",
        "    return _cached_rotary_table.__wrapped__(\n"
        "        seq, head_dim, theta, like.device, like.dtype\n"
        "    )\n",
        ("tests/test_rotary_cache.py::test_tables_are_computed_once_and_change_nothing",),
    ),
    Mutation(
        "cache RoPE's tables in inference mode too",
        "models/gpt/attention.py",
        '    if torch.is_inference_mode_enabled() or like.device.type == "meta":\n',
        '    if like.device.type == "meta":\n',
        ("tests/test_rotary_cache.py::test_inference_mode_tables_are_not_kept_for_training",),
    ),
    Mutation(
        "micro-batch accumulation rounded to bf16 again (the sum cast to the gradient's dtype)",
        "hybrid/engine.py",
        "            view.add_(param.grad)"
        "  # in fp32 buffers: the 16-bit gradient summed in fp32\n",
        "            view.copy_(view.to(param.grad.dtype) + param.grad)\n",
        (
            "tests/test_grad_reduce.py::test_fp32_shard_equals_the_fp32_sum_of_bf16_micro_batch_gradients",
        ),
    ),
    Mutation(
        "fp16 loss scale divided only when the shard is cast (not for fp32 shards)",
        "hybrid/engine.py",
        "            if grad.dtype != torch.float32:\n"
        "                grad = grad.float()\n"
        "            if self.loss_scale != 1.0:"
        "  # fp16: unscaled in fp32, the shard's own if fp32\n"
        "                grad /= self.loss_scale\n",
        "            if grad.dtype != torch.float32:\n"
        "                grad = grad.float()\n"
        "                if self.loss_scale != 1.0:\n"
        "                    grad /= self.loss_scale\n",
        ("tests/test_grad_reduce.py::test_fp16_loss_scale_is_divided_out_of_fp32_shards",),
    ),
    Mutation(
        "planner counts gradients at the parameter element size whatever grad_reduce_dtype",
        "hybrid/memory/model_states.py",
        '    return 4 if grad_reduce_dtype == "fp32" else element\n',
        "    return element\n",
        ("tests/test_grad_reduce.py::test_planner_follows_the_setting",),
    ),
    Mutation(
        "MFU forgets that the step's tokens/s is shared by every device (world size)",
        "launch/observe/mfu.py",
        "    return model_flops_per_token * tokens_per_s / world_size / peak\n",
        "    return model_flops_per_token * tokens_per_s / peak\n",
        ("tests/test_mfu.py::test_mfu_shares_the_step_over_the_world",),
    ),
    Mutation(
        "MFU counts full recomputation's FLOPs instead of the model's (the planner's)",
        "launch/observe/mfu.py",
        "        per_token = flops_per_token(with_seq_len(model, seq_len))\n",
        "        per_token = flops_per_token(with_seq_len(model, seq_len), True)\n",
        ("tests/test_mfu.py::test_logged_mfu_is_the_planners_flops_at_the_logged_speed",),
    ),
    Mutation(
        "the bar shows the RSS/above-baseline figure instead of the CUDA allocator's peak",
        "launch/observe/tracking.py",
        '        memory = metrics.get("device_mem_bytes", metrics.get("peak_mem_bytes"))\n',
        '        memory = metrics.get("peak_mem_bytes")\n',
        ("tests/test_mfu.py::test_bar_shows_mfu_and_memory_in_gib",),
    ),
    Mutation(
        "the planner's cross-entropy terms of the cloning loss (e + 12 bytes per logit)",
        "hybrid/memory/peak.py",
        "        self.loss_forward = (e + FP32) * tokens * vocab\n",
        "        self.loss_forward = (e + 3 * FP32) * tokens * vocab\n",
        ("tests/test_rehearse.py::test_peak_and_categories_within_10_percent_of_the_planner",),
    ),
    Mutation(
        "the planner keeps the explicit attention core with dropout on CUDA too",
        "hybrid/memory/activations.py",
        '    if recompute == "none" and shape.dropout and not shape.dropout_in_kernel:\n',
        '    if recompute == "none" and shape.dropout:\n',
        ("tests/test_plan.py::test_dropout_on_cuda_keeps_no_attention_core",),
    ),
    Mutation(
        "launch.plan plans the CPU attention path for NCCL runs",
        "launch/plan.py",
        '    return "cuda" if getattr(args, "backend", "nccl") == "nccl" else "cpu"\n',
        '    return "cpu"\n',
        ("tests/test_plan.py::test_dropout_on_cuda_keeps_no_attention_core",),
    ),
    Mutation(
        "stages 1-2 wait for every parameter gather in the step (no overlap)",
        "hybrid/zero/publish.py",
        "        self._queued = list(range(len(self.flats)))\n        self._issue()\n",
        "        self._queued = list(range(len(self.flats)))\n        self._issue()\n"
        "        self.wait_all()\n",
        ("tests/test_param_gather_overlap.py",),
    ),
    Mutation(
        "no forward pre-hook waits for a unit's bucket (forward reads parameters in flight)",
        "hybrid/zero/publish.py",
        "            unit.register_forward_pre_hook(lambda module, args, k=bucket: before(k))\n",
        "",
        ("tests/test_param_gather_overlap.py",),
    ),
    Mutation(
        "plan the step's all-gather hidden though the step waits for it",
        "hybrid/memory/planner.py",
        "if layout.overlap_param_gather else gather",
        "",
        ("tests/test_plan.py::test_overlap_off_waits_for_the_parameter_gathers_in_the_step",),
    ),
    Mutation(
        "drop parallel.overlap_param_gather on the way to the engine",
        "launch/train/loop.py",
        "        overlap_param_gather=config.parallel.overlap_param_gather,\n",
        "",
        ("tests/test_plan.py::test_overlap_off_waits_for_the_parameter_gathers_in_the_step",),
    ),
    Mutation(
        "run torch's bf16 LayerNorm kernel on CPU instead of computing in fp32",
        "models/gpt/norms.py",
        "        if x.dtype == torch.float32 or x.is_cuda:",
        "        if True:",
        ("tests/test_norms.py::test_bf16_gradients_are_one_rounding_from_fp64",),
    ),
    Mutation(
        "save the LayerNorm input in fp32 for backward",
        "models/gpt/norms.py",
        "        ctx.save_for_backward(x, weight, bias)",
        "        ctx.save_for_backward(x.float(), weight, bias)",
        ("tests/test_norms.py::test_bf16_saves_no_more_than_torchs_layer_norm",),
    ),
    Mutation(
        "normalise all rows at once: fp32 temporaries of the whole input",
        "models/gpt/norms.py",
        "PIECES = 8",
        "PIECES = 1",
        ("tests/test_norms.py::test_bf16_peak_is_near_torchs_layer_norm",),
    ),
    Mutation(
        "keep only the last piece's weight and bias gradients",
        "models/gpt/norms.py",
        "                total += grad",
        "                total.copy_(grad)",
        ("tests/test_norms.py::test_bf16_gradients_are_one_rounding_from_fp64",),
    ),
    Mutation(
        "pairwise reduce-scatter sends its own half",
        "hybrid/distributed/pairwise.py",
        "dist.isend(pieces[peer], group=group",
        "dist.isend(pieces[rank], group=group",
        ("tests/test_pairwise.py::test_reduce_scatter_matches_gloo_and_the_fp64_sum",),
    ),
    Mutation(
        "pairwise reduce-scatter leaves out its own half",
        "hybrid/distributed/pairwise.py",
        "            out.add_(addend)\n",
        "            pass\n",
        ("tests/test_pairwise.py::test_reduce_scatter_matches_gloo_and_the_fp64_sum",),
    ),
    Mutation(
        "pairwise all-gather leaves an out-of-place shard out",
        "hybrid/distributed/pairwise.py",
        "        mine.copy_(shard)\n",
        "        pass\n",
        ("tests/test_pairwise.py::test_all_gather_is_the_concatenation",),
    ),
    Mutation(
        "pairwise all-gather files a peer's piece in the wrong place",
        "hybrid/distributed/pairwise.py",
        "dist.irecv(pieces[peer], group=group",
        "dist.irecv(pieces[(peer + 1) % size], group=group",
        ("tests/test_pairwise.py::test_all_gather_is_the_concatenation",),
    ),
    Mutation(
        "the dispatcher trace ignores point-to-point sends",
        "hybrid/instruments/dispatch_counters.py",
        '    "send": ("send", 0),\n',
        "",
        ("tests/test_pairwise.py::test_dispatcher_sees_sends_of_a_rings_bytes",),
    ),
    Mutation(
        "gloo groups never exchange pairwise",
        "hybrid/distributed/comm.py",
        'dist.get_backend(process_group) == "gloo"',
        'dist.get_backend(process_group) == "nccl"',
        ("tests/test_pairwise.py::test_dispatcher_sees_sends_of_a_rings_bytes",),
    ),
    Mutation(
        "an exchange dropped in flight is freed unfinished",
        "hybrid/distributed/pairwise.py",
        "    def __del__(self) -> None:",
        "    def _unused(self) -> None:",
        ("tests/test_pairwise.py::test_exchanges_dropped_in_flight_do_not_stall_the_group[2]",),
    ),
    Mutation(
        "plan gloo's reduce-scatter copy in a group of two, which exchanges pairwise",
        "hybrid/memory/peak.py",
        'self.layout.backend == "gloo" and not reduces_pairwise(self.layout.dp)',
        'self.layout.backend == "gloo"',
        (
            "tests/test_plan_instrument.py::test_gloo_adds_its_copies_only_where_its_own_collectives_run",
        ),
    ),
]


def copy_tree(dest: Path) -> None:
    """The files git would commit (tracked, and untracked but not ignored)."""
    listed = subprocess.run(
        ["git", "ls-files", "--cached", "--others", "--exclude-standard", "-z"],
        cwd=ROOT, capture_output=True, check=True,
    ).stdout.decode().split("\0")  # fmt: skip
    for name in filter(None, listed):
        source = ROOT / name
        if source.is_file():
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(source, dest / name)


def run_pytest(tree: Path, tests: tuple[str, ...], timeout: float) -> tuple[int, float, str]:
    """pytest's exit code in `tree`, the seconds it took and its first failure line."""
    env = os.environ | {"PYTHONPATH": str(tree)}
    command = [sys.executable, "-m", "pytest", "-x", "-q", "-p", "no:cacheprovider", *tests]
    start = time.perf_counter()
    try:
        done = subprocess.run(
            command, cwd=tree, env=env, capture_output=True, text=True, timeout=timeout
        )
    except subprocess.TimeoutExpired:
        return -1, time.perf_counter() - start, f"harness timeout after {timeout:.0f} s"
    lines = done.stdout.splitlines()
    failure = next((line for line in lines if line.startswith(("FAILED", "ERROR"))), "")
    return done.returncode, time.perf_counter() - start, failure or (lines[-1] if lines else "")


def apply(tree: Path, mutation: Mutation) -> str:
    """Patch the copy; returns the original text to put back."""
    file = tree / mutation.path
    text = file.read_text()
    if text.count(mutation.old) != 1:
        raise ValueError(f"{mutation.name}: the patch no longer applies to {mutation.path}")
    file.write_text(text.replace(mutation.old, mutation.new))
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="+", metavar="NAME", help="names (or parts of them)")
    parser.add_argument("--list", action="store_true", help="list the mutations and exit")
    parser.add_argument("--timeout", type=float, default=900.0, help="per pytest run (s)")
    args = parser.parse_args(argv)
    chosen = [m for m in MUTATIONS if not args.only or any(part in m.name for part in args.only)]
    if args.list or not chosen:
        for m in chosen or MUTATIONS:
            print(f"{m.name}\n    {m.path}\n    {' '.join(m.tests)}")
        return 0 if chosen else 2
    with tempfile.TemporaryDirectory(prefix="mutations-") as folder:
        tree = Path(folder)
        copy_tree(tree)
        tests = tuple(dict.fromkeys(t for m in chosen for t in m.tests))
        code, seconds, line = run_pytest(tree, tests, args.timeout)
        print(f"unmutated: exit {code} in {seconds:.0f} s", flush=True)
        if code != 0:
            print(f"the tests fail without a mutation ({line}): fix that first")
            return 1
        rows = []
        for m in chosen:
            try:
                original = apply(tree, m)
            except ValueError as error:
                rows.append((m, "harness error", 0.0, str(error)))
                continue
            try:
                code, seconds, line = run_pytest(tree, m.tests, args.timeout)
            finally:
                (tree / m.path).write_text(original)
            verdict = {0: "NOT CAUGHT", 1: "caught"}.get(code, f"harness error (exit {code})")
            rows.append((m, verdict, seconds, line))
            print(f"{verdict}: {m.name} ({seconds:.0f} s) {line}", flush=True)
    print("\n| mutation | file | test that caught it | result | seconds |")
    print("|---|---|---|---|---:|")
    for m, verdict, seconds, line in rows:
        caught_by = line.removeprefix("FAILED ").split(" - ")[0] if verdict == "caught" else ""
        tests = caught_by or " ".join(m.tests)
        print(f"| {m.name} | `{m.path}` | `{tests}` | {verdict} | {seconds:.0f} |")
    return 0 if all(verdict == "caught" for _, verdict, _, _ in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())
