"""Mutations of sharded checkpoints (hybrid/checkpoint)."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

MUTATIONS = [
    Mutation(
        "restore the wrong rank's RNG state",
        "hybrid/checkpoint/folders.py",
        '    file = path / "rng" / f"rank{rank}.pt"',
        '    file = path / "rng" / f"rank{rank ^ 1}.pt"',
        ("tests/checkpoint/test_checkpoint.py::test_stopped_and_resumed_run_has_the_same_losses",),
    ),
    Mutation(
        "write a checkpoint shard without its checksum",
        "hybrid/checkpoint/folders.py",
        'files = sorted(tmp.glob(f"__{rank}_*.distcp")) + sorted(tmp.glob(f"rng/rank{rank}.pt"))',
        'files = sorted(tmp.glob(f"rng/rank{rank}.pt"))',
        ("tests/checkpoint/test_checkpoint.py::test_an_altered_shard_is_named_by_its_checksum",),
    ),
    Mutation(
        "keep every checkpoint (no pruning)",
        "hybrid/checkpoint/folders.py",
        "        for old in complete[: max(0, len(complete) - keep)]:",
        "        for old in complete[:0]:",
        ("tests/checkpoint/test_checkpoint_keep.py",),
    ),
    Mutation(
        "the full-state writer keeps every gathered bucket",
        "hybrid/zero/full_model.py",
        "                gatherer.free(index)",
        "                pass",
        ("tests/checkpoint/test_full_state.py",),
    ),
    Mutation(
        "every rank hashes every checkpoint file at resume",
        "hybrid/checkpoint/checksums.py",
        "    for position in hashing_share([_size(file) for file, _, _ in files], rank, world):",
        "    for position in hashing_share([_size(file) for file, _, _ in files], 0, 1):",
        (
            "tests/checkpoint/test_resume_verify.py::test_full_verification_reads_every_byte_once_across_the_ranks",
        ),
    ),
    Mutation(
        "skip the all-reduce of the first bad checkpoint file",
        "hybrid/checkpoint/checksums.py",
        "        first_bad = _min_over_ranks(first_bad, among)",
        "        pass",
        (
            "tests/checkpoint/test_resume_verify.py::test_an_altered_file_is_named_alike_on_every_rank",
        ),
    ),
    Mutation(
        "an asynchronous save writes the live tensors, not a staged copy",
        "hybrid/checkpoint/saver.py",
        "        return self._staged\n",
        "        return flats\n",
        (
            "tests/checkpoint/test_checkpoint_async.py::"
            "test_a_save_holds_the_state_of_its_step_while_training_goes_on[True]",
        ),
    ),
    Mutation(
        "a shard's checksum taken while writing misses its small writes",
        "hybrid/checkpoint/hashing.py",
        "            self.small += view\n",
        "            pass\n",
        (
            "tests/checkpoint/test_checkpoint_async.py::test_digests_taken_while_writing_equal_the_files",
        ),
    ),
    Mutation(
        "a save runs a collective per key (as ShardedTensor did)",
        "hybrid/checkpoint/engine_state.py",
        '        key: ChunkedTensor(shapes[key.split(".", 1)[1]], pieces)\n',
        '        key: ChunkedTensor(shapes[key.split(".", 1)[1]], (\n'
        "            dist.all_gather_object([None] * dist.get_world_size(), key) or pieces\n"
        "        ))\n",
        (
            "tests/checkpoint/test_checkpoint_async.py::test_a_save_costs_a_few_collectives_not_one_per_key",
        ),
    ),
    Mutation(
        "a checkpoint without Adam's moments keeps the engine's old ones",
        "hybrid/checkpoint/engine_state.py",
        '            flats["exp_avg"].zero_()\n',
        "",
        (
            "tests/checkpoint/test_checkpoint_async.py::test_a_checkpoint_without_moments_loads_with_fresh_ones",
        ),
    ),
    Mutation(
        "the checkpoint writer keeps each piece after writing it",
        "hybrid/checkpoint/offline_write.py",
        "        self.release()\n        key, start = write_item.index.fqn",
        "        key, start = write_item.index.fqn",
        ("tests/hf/test_convert.py::test_the_checkpoint_writer_holds_one_piece_at_a_time",),
    ),
    Mutation(
        "the checkpoint writer's chunks twice the size asked for",
        "hybrid/checkpoint/offline_write.py",
        "    step = max(1, chunk_bytes // max(row, 1))",
        "    step = max(1, 2 * chunk_bytes // max(row, 1))",
        ("tests/hf/test_convert.py::test_the_checkpoint_writer_holds_one_piece_at_a_time",),
    ),
    Mutation(
        "a raw checkpoint piece read from its first row, not the first row asked for",
        "hybrid/checkpoint/raw.py",
        "            stream.seek(info.offset + first * row)\n",
        "            stream.seek(info.offset)\n",
        (
            "tests/checkpoint/test_checkpoint_raw.py::test_a_resharded_load_reads_rows_and_columns_of_a_piece",
        ),
    ),
    Mutation(
        "a raw checkpoint piece cut to the columns asked for from its first column",
        "hybrid/checkpoint/raw.py",
        "                whole = whole.narrow(dim, start, length)\n",
        "                whole = whole.narrow(dim, 0, length)\n",
        (
            "tests/checkpoint/test_checkpoint_raw.py::test_a_resharded_load_reads_rows_and_columns_of_a_piece",
        ),
    ),
    Mutation(
        "the raw writer holds each piece until it has asked for the next",
        "hybrid/checkpoint/raw.py",
        "                del data, view  # a produced piece is freed once written\n",
        "",
        ("tests/hf/test_convert.py::test_the_checkpoint_writer_holds_one_piece_at_a_time",),
    ),
    Mutation(
        "the raw writer stores each piece as a torch.save zip, as DCP's writer does",
        "hybrid/checkpoint/raw.py",
        "                    view, marks = tensor_bytes(data), [RAW]\n",
        "                    buf = io.BytesIO()\n"
        "                    torch.save(data, buf)\n"
        "                    view, marks = buf.getbuffer(), [RAW]\n",
        ("tests/checkpoint/test_checkpoint_raw.py::test_each_piece_is_its_bytes_and_nothing_else",),
    ),
    Mutation(
        "pruned checkpoints are renamed aside but never deleted",
        "hybrid/checkpoint/folders.py",
        "        shutil.rmtree(trash, ignore_errors=True)\n",
        "        pass\n",
        (
            "tests/checkpoint/test_checkpoint_keep.py::"
            "test_only_the_newest_keep_checkpoints_remain_and_resume_uses_the_newest",
        ),
    ),
]
