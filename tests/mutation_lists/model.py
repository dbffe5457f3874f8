"""Mutations of the GPT model and its Hugging Face import and export (models/gpt)."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

MUTATIONS = [
    Mutation(
        "a lazy HF read takes the whole stored tensor, then slices it",
        "models/gpt/hf/lazy.py",
        "                            piece = sliced[lo + r : lo + r + n, c0:c1]",
        "                            piece = sliced[:][lo + r : lo + r + n, c0:c1]",
        ("tests/hf/test_hf_lazy.py::test_a_range_reads_only_its_rows",),
    ),
    Mutation(
        "a lazy HF read starts a TP rank's rows one row per rank early",
        "models/gpt/hf/lazy.py",
        "            rows = rows + tp_rank * local[0]",
        "            rows = rows + tp_rank * (local[0] - 1)",
        ("tests/hf/test_hf_lazy.py::test_reads_equal_the_eager_slices",),
    ),
    Mutation(
        "a lazy HF read takes the stored row one past the mapped one",
        "models/gpt/hf/lazy.py",
        "            lo = first & ((1 << _ROW_BITS) - 1)",
        "            lo = (first + 1) & ((1 << _ROW_BITS) - 1)",
        ("tests/hf/test_hf_lazy.py::test_reads_equal_the_eager_slices",),
    ),
    Mutation(
        "a lazy HF read of GPT-2's Conv1D weights is not transposed",
        "models/gpt/hf/lazy.py",
        "                    piece = sliced[c : c + n, lo : lo + b - a].t()",
        "                    piece = sliced[lo : lo + b - a, c : c + n]",
        ("tests/hf/test_hf_lazy.py::test_reads_equal_the_eager_slices",),
    ),
    Mutation(
        "the lazy HF import keeps a tensor with no place in the model",
        "models/gpt/hf/lazy.py",
        "    if left:\n        s = have[left[0]]",
        "    if False:\n        s = have[left[0]]",
        ("tests/hf/test_hf_lazy.py::test_bad_folders_are_one_line_naming_file_and_key",),
    ),
    Mutation(
        "a ZeRO-3 rank reads its imported piece from the start of its TP slice",
        "models/gpt/model.py",
        "            value = self._init_weights.read(name, spec, self.tp.rank, start, end)",
        "            value = self._init_weights.read(name, spec, self.tp.rank, 0, end - start)",
        ("tests/hf/test_hf_lazy.py::test_engine_shards_equal_the_eager_path_at_tp2_and_zero3",),
    ),
    Mutation(
        "HF export: a shard's size counts half of each tensor",
        "models/hf_native/sharded_folder.py",
        "        size += nbytes\n",
        "        size += nbytes // 2\n",
        ("tests/hf/test_hf_export.py::test_shards_and_index_equal_save_pretrained",),
    ),
    Mutation(
        "HF export: gate and up projections swapped",
        "models/gpt/hf/layouts.py",
        "        return t.unflatten(0, (-1, 2))[:, i]",
        "        return t.unflatten(0, (-1, 2))[:, 1 - i]",
        ("tests/hf/test_hf_export.py::test_shards_and_index_equal_save_pretrained",),
    ),
    Mutation(
        "HF export: k_proj taken from the v rows of our QKV",
        "models/gpt/hf/layouts.py",
        "        return _split_qkv(t, config)[i]",
        "        return _split_qkv(t, config)[(0, 2, 2)[i]]",
        ("tests/hf/test_convert.py::test_hf_to_ours_at_tp2_stage3_and_back_is_exact",),
    ),
    Mutation(
        "HF export: index total_size counts elements, not bytes",
        "models/hf_native/sharded_folder.py",
        '                "total_size": sum(entry_bytes(entry) for entry in layout),',
        '                "total_size": sum(torch.Size(s).numel() for _, s, _ in layout),',
        ("tests/hf/test_hf_export.py::test_a_tensor_above_the_limit_gets_its_own_file",),
    ),
    Mutation(
        "HF export: an index written for a single file",
        "models/hf_native/sharded_folder.py",
        "    if len(shards) > 1:\n        index = {",
        "    if len(shards) >= 1:\n        index = {",
        ("tests/hf/test_hf_export.py::test_one_file_and_no_index_when_everything_fits",),
    ),
    Mutation(
        "HF export: written straight into the final folder",
        "models/hf_native/sharded_folder.py",
        '    tmp = folder.parent / f".tmp-{folder.name}"',
        "    tmp = folder",
        ("tests/hf/test_hf_export.py::test_a_failed_export_leaves_the_previous_folder",),
    ),
    Mutation(
        "HF export: GB read as GiB",
        "models/hf_native/sharded_folder.py",
        '"GB": 10**9',
        '"GB": 2**30',
        ("tests/hf/test_hf_export.py::test_shard_sizes_parse_as_huggingface_hub_parses_them",),
    ),
    Mutation(
        "packed documents attend across examples (mask ignores segment ids)",
        "models/gpt/attention.py",
        "    same = segments[:, :, None] == segments[:, None, :]\n",
        "    same = segments[:, :, None] >= segments[:, None, :]\n",
        ("tests/data/test_packing.py::test_packed_loss_equals_each_example_alone",),
    ),
    Mutation(
        "packed positions do not restart per example",
        "models/gpt/model.py",
        "            mask, positions = document_mask(segments), segment_positions(segments)\n",
        "            mask, positions = document_mask(segments), None\n",
        ("tests/data/test_packing.py::test_packed_loss_equals_each_example_alone",),
    ),
    Mutation(
        "recompute RoPE's tables in every layer",
        "models/gpt/attention.py",
        "    return _cached_rotary_table(seq, head_dim, theta, like.device, like.dtype)\n",
        "    return _cached_rotary_table.__wrapped__(\n"
        "        seq, head_dim, theta, like.device, like.dtype\n"
        "    )\n",
        ("tests/model/test_rotary_cache.py::test_tables_are_computed_once_and_change_nothing",),
    ),
    Mutation(
        "cache RoPE's tables in inference mode too",
        "models/gpt/attention.py",
        '    if torch.is_inference_mode_enabled() or like.device.type == "meta":\n',
        '    if like.device.type == "meta":\n',
        ("tests/model/test_rotary_cache.py::test_inference_mode_tables_are_not_kept_for_training",),
    ),
    Mutation(
        "run torch's bf16 LayerNorm kernel on CPU instead of computing in fp32",
        "models/gpt/norms.py",
        "        if x.dtype == torch.float32 or x.is_cuda:",
        "        if True:",
        ("tests/model/test_norms.py::test_bf16_gradients_are_one_rounding_from_fp64",),
    ),
    Mutation(
        "save the LayerNorm input in fp32 for backward",
        "models/gpt/norms.py",
        "        ctx.save_for_backward(x, weight, bias)",
        "        ctx.save_for_backward(x.float(), weight, bias)",
        ("tests/model/test_norms.py::test_bf16_saves_no_more_than_torchs_layer_norm",),
    ),
    Mutation(
        "normalise all rows at once: fp32 temporaries of the whole input",
        "models/gpt/norms.py",
        "PIECES = 4",
        "PIECES = 1",
        ("tests/model/test_norms.py::test_bf16_peak_is_near_torchs_layer_norm",),
    ),
    Mutation(
        "keep only the last piece's weight and bias gradients",
        "models/gpt/norms.py",
        "                total += grad",
        "                total.copy_(grad)",
        ("tests/model/test_norms.py::test_bf16_gradients_are_one_rounding_from_fp64",),
    ),
]
