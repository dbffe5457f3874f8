"""Mutations of the entry points: config, data, training loop, tracking, conversion (launch/)."""

from __future__ import annotations

from mutation_lists.mutation import Mutation

MUTATIONS = [
    Mutation(
        "make resume find no checkpoint",
        "launch/train/checkpointing.py",
        "        return _newest_loadable(checkpoint_root(config))",
        "        return None",
        ("tests/checkpoint/test_checkpoint.py::test_stopped_and_resumed_run_has_the_same_losses",),
    ),
    Mutation(
        "save the fp16 loss scale's good steps not at all",
        "launch/train/checkpointing.py",
        '        "good_steps": engine.good_steps,\n',
        "",
        ("tests/precision/test_fp16_loss_scale.py",),
    ),
    Mutation(
        "checkpoint.verify=size hashes the files anyway",
        "launch/train/checkpointing.py",
        '    if candidate is None or verify != "full":',
        '    if candidate is None or verify == "none":',
        (
            "tests/checkpoint/test_resume_verify.py::test_size_reads_no_shard_and_none_reads_nothing_and_loads_the_altered_file",
        ),
    ),
    Mutation(
        "checkpoint.verify=none loads without a warning",
        "launch/train/checkpointing.py",
        '    if candidate is not None and verify == "none":',
        "    if False:",
        (
            "tests/checkpoint/test_resume_verify.py::test_size_reads_no_shard_and_none_reads_nothing_and_loads_the_altered_file",
        ),
    ),
    Mutation(
        "the command line resumes without hashing after start-up",
        "launch/train/entry.py",
        "        resume = verify_resume(config, candidate, env.world)",
        "        resume = candidate",
        (
            "tests/checkpoint/test_resume_verify.py::test_the_command_line_hashes_after_start_up_and_names_the_file",
        ),
    ),
    Mutation(
        "checkpoint.async read under its field's name",
        "launch/config/tree.py",
        '    return f.metadata.get("key", f.name)',
        "    return f.name",
        ("tests/checkpoint/test_resume_verify.py::test_verify_and_async_keys",),
    ),
    Mutation(
        "convert --to-hf reads the Adam moments along with the weights",
        "launch/convert.py",
        '    for key, tensor in reader.stream(f"model.{name}" for name in names):',
        '    keys = (k for n in names for k in (f"model.{n}", f"exp_avg.{n}"))\n'
        '    for key, tensor in ((k, t) for k, t in reader.stream(keys) if k[:6] == "model."):',
        ("tests/hf/test_convert.py::test_hf_to_ours_at_tp2_stage3_and_back_is_exact",),
    ),
    Mutation(
        "convert --from-hf writes zero weights and the weights as exp_avg",
        "launch/convert.py",
        '        if kind != "model":\n            return torch.zeros(rows)',
        '        if kind != "exp_avg":\n            return torch.zeros(rows)',
        ("tests/hf/test_convert.py::test_hf_to_ours_at_tp2_stage3_and_back_is_exact",),
    ),
    Mutation(
        "convert --from-hf writes Adam moments without --optimizer-states",
        "launch/convert.py",
        '    kinds = ("model", *MOMENTS) if optimizer_states else ("model",)',
        '    kinds = ("model", *MOMENTS)',
        ("tests/hf/test_convert.py::test_a_checkpoint_without_moments_resumes_at_tp2_dp2_stage3",),
    ),
    Mutation(
        "the fine-tuned export leaves the tokenizer out",
        "launch/train/outputs.py",
        "            extra_files=lambda folder: tokenizer.save_pretrained(str(folder)),\n",
        "",
        (
            "tests/hf/test_finetune.py::test_prompt_completion_loss_is_layout_free_and_matches_transformers",
        ),
    ),
    Mutation(
        "text paragraphs split at every newline instead of blank lines",
        "launch/data/prepare/read.py",
        'text.readline()).split("\\n\\n")  # finish the line first\n',
        'text.readline()).split("\\n")  # finish the line first\n',
        (
            "tests/data/test_prepare_data.py::test_tokens_and_document_index_equal_the_plain_computation",
        ),
    ),
    Mutation(
        "a rerun after a crash re-tokenizes the inputs already finished",
        "launch/data/prepare/corpus.py",
        "        return part if whole else None\n",
        "        return None\n",
        ("tests/data/test_prepare_data.py::test_a_crash_keeps_the_inputs_already_finished",),
    ),
    Mutation(
        "waiting ranks sit in a barrier under the collective timeout again",
        "launch/train/loop.py",
        "        phase.wait_for_node()\n",
        "        torch.distributed.barrier()\n",
        ("tests/data/test_prepare_data.py::test_waiting_ranks_outlast_the_collective_timeout",),
    ),
    Mutation(
        "the sampler's permutation ignores the epoch: every epoch repeats the first's order",
        "launch/data/sampler.py",
        "            self._order = FeistelPermutation(self.n, (self.seed, self.stream, epoch))\n",
        "            self._order = FeistelPermutation(self.n, (self.seed, self.stream, 0))\n",
        (
            "tests/data/test_sampler_permutation.py::test_deterministic_from_the_seed_and_fresh_each_epoch",
        ),
    ),
    Mutation(
        "cycle-walking stops after one pass: ids >= n escape, an epoch is no bijection",
        "launch/data/sampler.py",
        "            outside = outside[out[outside] >= self.n]\n",
        "            outside = outside[:0]\n",
        ("tests/data/test_sampler_permutation.py::test_every_epoch_visits_each_window_once",),
    ),
    Mutation(
        "the sampler materialises a permutation per epoch (memory grows with the corpus)",
        "launch/data/sampler.py",
        "        out = self._rounds(np.asarray(positions, dtype=np.uint64))\n",
        "        out = np.random.default_rng(self.keys).permutation(self.n).astype(np.uint64)\n"
        "        out = out[np.asarray(positions, dtype=np.int64)]\n",
        (
            "tests/data/test_sampler_permutation.py::test_window_ids_at_a_trillion_tokens_in_constant_memory",
        ),
    ),
    Mutation(
        "a mixture's block order is dealt once and reused: resume and dp change the windows",
        "launch/data/mixture.py",
        "        if self._dealt[0] != block:\n",
        "        if self._dealt[0] == -1:\n",
        (
            "tests/data/test_mixture.py::test_resume_mid_run_and_at_another_dp_gives_the_same_windows",
        ),
    ),
    Mutation(
        "a source restarts its sample index every block: it repeats windows, no epochs",
        "launch/data/mixture.py",
        "            k[chosen] = b * self.counts[source[chosen]] + rank[position[chosen]]\n",
        "            k[chosen] = rank[position[chosen]]\n",
        (
            "tests/data/test_mixture.py::test_proportions_over_ten_thousand_windows_match_the_weights",
        ),
    ),
    Mutation(
        "every source is validated on the first source's windows",
        "launch/data/mixture.py",
        "            eval_batches(part, n_samples, micro_batch_size, dp_rank, dp_size),\n",
        "            eval_batches(val.parts[0], n_samples, micro_batch_size, dp_rank, dp_size),\n",
        ("tests/data/test_mixture.py::test_a_mixture_run_writes_val_loss_per_source",),
    ),
    Mutation(
        "cached examples take the loss on the last prompt token too (off by one)",
        "launch/data/example_rows.py",
        "        targets[: max(int(self.prompt[i]) - 1, 0)] = IGNORE_INDEX\n",
        "        targets[: max(int(self.prompt[i]) - 2, 0)] = IGNORE_INDEX\n",
        ("tests/data/test_packing.py::test_cache_is_memory_mapped_compact_and_reused",),
    ),
    Mutation(
        "TokenShards drops the last token of each shard in a slice across shards",
        "launch/data/shards.py",
        " - begin : min(hi, end) - begin])\n",
        " - begin : min(hi, end - 1) - begin])\n",
        ("tests/data/test_shards.py::test_round_trip_across_shard_boundaries",),
    ),
    Mutation(
        "the shard scan accepts a token id equal to vocab_size",
        "launch/data/shards.py",
        "if chunk.size and int(chunk.max()) >= self.vocab_size:\n",
        "if chunk.size and int(chunk.max()) > self.vocab_size:\n",
        ("tests/data/test_shards.py::test_bad_shard_folders_say_what_is_wrong",),
    ),
    Mutation(
        "slicing TokenShards copies the tokens instead of returning a lazy view",
        "launch/data/shards.py",
        "            return view\n",
        "            return np.asarray(view)\n",
        ("tests/data/test_shards.py::test_memory_does_not_grow_with_the_corpus",),
    ),
    Mutation(
        "every rank of a node prepares the cache (local rank 0 no longer the only one)",
        "launch/data/prepare/wait.py",
        "        self.first = env.local_rank == 0\n",
        "        self.first = True\n",
        (
            "tests/reliability/test_two_nodes.py::test_two_nodes_prepare_their_own_cache_once_and_match_one_node",
        ),
    ),
    Mutation(
        "a checked cache is never reused: the node's waiting ranks tokenize it again",
        "launch/data/token_file.py",
        "    if problem is None:\n        return token_file\n",
        "    if problem is None and False:\n        return token_file\n",
        (
            "tests/reliability/test_two_nodes.py::test_two_nodes_prepare_their_own_cache_once_and_match_one_node",
        ),
    ),
    Mutation(
        "a pre-tokenized datasets folder's ids are not checked against the vocabulary",
        "launch/data/hf_folders.py",
        "    if flat.size and (flat.min() < 0 or flat.max() >= vocab):\n",
        "    if False:\n",
        (
            "tests/hf/test_hf_folders.py::test_an_id_outside_the_vocabulary_is_one_line_naming_the_row",
        ),
    ),
    Mutation(
        "the cache key of a datasets folder ignores its files' sizes, mtimes and hashes",
        "launch/data/prepare/read.py",
        '        parts = [f"{f.relative_to(path)}={input_fingerprint(f)}" for f in files]\n',
        "        parts = [str(f.relative_to(path)) for f in files]\n",
        ("tests/hf/test_hf_folders.py::test_editing_a_file_in_the_folder_changes_the_cache_key",),
    ),
    Mutation(
        "a datasets folder's text rows lose their end-of-text separator",
        "launch/data/prepare/corpus.py",
        "        eos = tokenizer.eos_token_id\n",
        "        eos = None\n",
        ("tests/hf/test_hf_folders.py::test_text_rows_are_tokenized_like_records",),
    ),
    Mutation(
        "prepare a bpe mixture's sources each with its own vocabulary",
        "launch/prepare_data.py",
        "    data = shared_tokenizer(data)  # bpe: one vocabulary trained on every source, as "
        "training\n",
        "",
        (
            "tests/data/test_prepare_data.py::test_command_line_prepares_a_bpe_mixture_that_training_finds_cached",
        ),
    ),
    Mutation(
        "token shards' ids checked only in the data phase, never before the process group",
        "launch/train/entry.py",
        "    if len(shards) * shards.dtype.itemsize <= SCAN_AT_START_BYTES:\n",
        "    if False:\n",
        (
            "tests/data/test_shards.py::"
            "test_pretraining_reads_a_shard_folder_in_place_and_names_a_missing_shard",
        ),
    ),
    Mutation(
        "MFU forgets that the step's tokens/s is shared by every device (world size)",
        "launch/observe/mfu.py",
        "    return model_flops_per_token * tokens_per_s / world_size / peak\n",
        "    return model_flops_per_token * tokens_per_s / peak\n",
        ("tests/entry_points/test_mfu.py::test_mfu_shares_the_step_over_the_world",),
    ),
    Mutation(
        "MFU counts full recomputation's FLOPs instead of the model's (the planner's)",
        "launch/observe/mfu.py",
        "        per_token = flops_per_token(with_seq_len(model, seq_len))\n",
        "        per_token = flops_per_token(with_seq_len(model, seq_len), True)\n",
        (
            "tests/entry_points/test_mfu.py::test_logged_mfu_is_the_planners_flops_at_the_logged_speed",
        ),
    ),
    Mutation(
        "the bar shows the RSS/above-baseline figure instead of the CUDA allocator's peak",
        "launch/observe/tracking.py",
        '        memory = metrics.get("device_mem_bytes", metrics.get("peak_mem_bytes"))\n',
        '        memory = metrics.get("peak_mem_bytes")\n',
        ("tests/entry_points/test_mfu.py::test_bar_shows_mfu_and_memory_in_gib",),
    ),
    Mutation(
        "drop parallel.overlap_param_gather on the way to the engine",
        "launch/train/setup.py",
        "        overlap_param_gather=config.parallel.overlap_param_gather,\n",
        "",
        (
            "tests/planning/test_plan_cli.py::test_overlap_off_waits_for_the_parameter_gathers_in_the_step",
        ),
    ),
]
