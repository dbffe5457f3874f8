"""Packed fine-tuning (data.pack): prompt/completion examples tokenized once into a
memory-mapped cache, several to a sequence, each attending only to itself.

The reference is the plain computation: every example alone through the same model, its
completion-token losses summed and divided by their count. A packed batch (block-diagonal
causal mask, positions restarting per example) gives the same loss within 1e-5 in fp32,
and the same logits per example, for learned positions (GPT-2) and rotary positions with
grouped-query attention (Llama); also at tp=2 with and without sequence parallelism.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from hybrid.instruments.local_processes import run_processes
from launch.data.examples import Examples, PackedExamples, read_examples
from launch.data.tokenizers import gpt2_tokenizer
from launch.train.step import evaluate, model_options, split_batch
from models.gpt import GPT, IGNORE_INDEX, GPTConfig
from models.gpt.attention import document_mask, rotary_cos_sin, segment_positions

WINDOW = 48
WORDS = ["the", "cat", "sat", "on", "a", "mat", "two", "dogs", "ran", "past", "red", "old"]
GPT2 = GPTConfig(n_layer=2, n_head=4, d_model=32, seq_len=WINDOW, vocab_size=128)
LLAMA = GPTConfig(
    n_layer=2, n_head=4, d_model=32, seq_len=WINDOW, vocab_size=128, norm="rmsnorm",
    mlp="swiglu", d_ff=48, positions="rope", n_kv_head=2,
    tie_embeddings=False, bias=False,
)  # fmt: skip


def write_records(path: Path, n: int = 40, seed: int = 0) -> Path:
    """Short records of varied lengths, a few too long for the window (they are cut)."""
    rng = random.Random(seed)
    with path.open("w") as f:
        for i in range(n):
            prompt = " ".join(rng.choices(WORDS, k=rng.randint(1, 8))) + ":"
            words = 60 if i % 13 == 5 else rng.randint(1, 10)
            completion = " " + " ".join(rng.choices(WORDS, k=words))
            f.write(json.dumps({"prompt": prompt, "completion": completion}) + "\n")
    return path


def word_tokenizer() -> PreTrainedTokenizerFast:
    """One token per word (a vocabulary of 15), so the models' vocabulary is small and the
    tests fast; the GPT-2 tokenizer is tested on the cache below."""
    vocab = {word: i for i, word in enumerate(["<eos>", "<unk>", ":", *WORDS])}
    words = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=words, eos_token="<eos>", unk_token="<unk>")


@pytest.fixture(scope="module")
def examples(tmp_path_factory: pytest.TempPathFactory) -> Examples:
    folder = tmp_path_factory.mktemp("packing")
    return read_examples([write_records(folder / "sft.jsonl")], word_tokenizer(), WINDOW, folder)


def alone(model: GPT, examples: Examples) -> tuple[float, list[torch.Tensor]]:
    """The reference: each example alone (no padding, no neighbours): the loss summed over
    every completion token of the set over their count, and each example's logits."""
    total, count, logits = 0.0, 0, []
    with torch.no_grad():
        for i in range(len(examples)):
            x, y = (torch.from_numpy(a) for a in examples.pair(i))
            logits.append(model(x[None])[0])
            total += F.cross_entropy(logits[-1], y, ignore_index=IGNORE_INDEX, reduction="sum")
            count += int((y != IGNORE_INDEX).sum())
    return float(total) / count, logits


def packed_loss(model: GPT, packed: PackedExamples) -> tuple[float, torch.Tensor]:
    inputs, targets, segments = packed.batch(np.arange(len(packed)))
    with torch.no_grad():
        return model(inputs, targets, segments=segments).item(), model(inputs, segments=segments)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_packed_loss_equals_each_example_alone(config: GPTConfig, examples: Examples) -> None:
    model = GPT(config, seed=3).eval()
    train, _ = examples.split(0.1, packed=True)
    part, _ = examples.split(0.1)
    assert len(train) * 2 < len(part)  # really packed: under half as many rows
    reference, reference_logits = alone(model, part)
    loss, logits = packed_loss(model, train)
    assert loss == pytest.approx(reference, rel=1e-5, abs=1e-6)
    # and per example: its logits in the packed row are those it has alone
    inputs, _, segments = train.batch(np.arange(len(train)))
    for row in range(len(train)):
        first, last = int(train.starts[row]), int(train.starts[row + 1])
        for segment in range(last - first):
            where = segments[row] == segment
            assert torch.equal(inputs[row][where], torch.from_numpy(part.pair(first + segment)[0]))
            torch.testing.assert_close(logits[row][where], reference_logits[first + segment])
    # the padded (unpacked) batch agrees too: what fine-tuning did before packing
    unpacked = model(*part.batch(np.arange(len(part)))).item()
    assert unpacked == pytest.approx(reference, rel=1e-5)


def test_explicit_attention_path_masks_documents(examples: Examples) -> None:
    """The explicit softmax path (taken in training with dropout) with the document mask:
    dropout so small that nothing is dropped, so the loss is the reference's."""
    config = GPTConfig(**{**LLAMA.__dict__, "dropout": 1e-12})
    model = GPT(config, seed=3).train()
    train, _ = examples.split(0.1, packed=True)
    part, _ = examples.split(0.1)
    reference, _ = alone(model, part)
    assert packed_loss(model, train)[0] == pytest.approx(reference, rel=1e-5)


def test_positions_restart_and_mask_is_block_diagonal() -> None:
    segments = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2, 2, 3]])
    positions = segment_positions(segments)
    assert positions.tolist() == [[0, 1, 2, 0, 1, 0, 1, 2, 3, 0]]
    mask = document_mask(segments)[0, 0]
    same = segments[0][:, None] == segments[0][None, :]
    causal = torch.ones(10, 10, dtype=torch.bool).tril()
    assert torch.equal(mask, same & causal)
    # rotary angles at restarted positions are those of each document alone
    cos, sin = rotary_cos_sin(10, 8, 10000.0, torch.device("cpu"), positions)
    alone_cos, alone_sin = rotary_cos_sin(4, 8, 10000.0, torch.device("cpu"))
    torch.testing.assert_close(cos[0, 0, 5:9], alone_cos)
    torch.testing.assert_close(sin[0, 0, 3:5], alone_sin[:2])


def test_cache_is_memory_mapped_compact_and_reused(tmp_path: Path) -> None:
    records = write_records(tmp_path / "sft.jsonl")
    tokenizer = gpt2_tokenizer()
    first = read_examples([records], tokenizer, WINDOW, tmp_path)
    built = np.array(first.tokens)
    assert isinstance(first.tokens, np.memmap) and first.tokens.dtype == np.uint16
    assert isinstance(first.offsets, np.memmap) and isinstance(first.prompt, np.memmap)
    (folder,) = (tmp_path / "examples").iterdir()
    assert first.folder == folder
    # the cut examples: window + 1 tokens at most, ending where the window ends
    lengths = np.diff(first.offsets)
    assert lengths.max() == WINDOW + 1 and len(first) == 40 and first.dropped == 0
    # a second start reads the cache: the tokenizer is never called
    tokens_file = folder / "tokens.bin"
    before = tokens_file.stat().st_mtime_ns

    class Refuses(type(tokenizer)):  # type: ignore[misc]
        def __call__(self, *args: object, **kwargs: object) -> None:
            raise AssertionError("tokenized again")

    refusing = Refuses(tokenizer_object=tokenizer.backend_tokenizer, eos_token="<|endoftext|>")
    second = read_examples([records], refusing, WINDOW, tmp_path)
    assert tokens_file.stat().st_mtime_ns == before
    assert np.array_equal(second.tokens, first.tokens)
    x, y = first.batch(np.arange(3))
    assert torch.equal(x, second.batch(np.arange(3))[0]) and x.shape == (3, WINDOW)
    # the same batches as tokenizing the records directly (the plain computation)
    record = json.loads(records.read_text().splitlines()[1])
    prompt = tokenizer(record["prompt"])["input_ids"]
    sequence = prompt + tokenizer(record["completion"])["input_ids"] + [tokenizer.eos_token_id]
    assert x[1, : len(sequence) - 1].tolist() == sequence[:-1]
    expected = [IGNORE_INDEX] * (len(prompt) - 1) + sequence[len(prompt) :]
    assert y[1, : len(sequence) - 1].tolist() == expected
    assert (y[1, len(sequence) - 1 :] == IGNORE_INDEX).all()
    # a truncated file is noticed and rebuilt
    tokens_file.write_bytes(tokens_file.read_bytes()[:-2])
    with pytest.warns(UserWarning, match="example cache .* is corrupt: tokens.bin"):
        rebuilt = read_examples([records], tokenizer, WINDOW, tmp_path)
    assert np.array_equal(rebuilt.tokens, built)
    # an edited file gets a new cache
    records.write_text(records.read_text().replace("cat", "dog"))
    read_examples([records], tokenizer, WINDOW, tmp_path)
    assert len(list((tmp_path / "examples").iterdir())) == 2


def test_packing_is_in_order_and_fills_rows(examples: Examples) -> None:
    train, val = examples.split(0.1, packed=True)
    starts = np.asarray(train.starts)
    assert starts[0] == 0 and starts[-1] == len(examples) - 4 and np.all(np.diff(starts) > 0)
    lengths = np.diff(examples.offsets) - 1
    for row in range(len(train)):
        used = lengths[starts[row] : starts[row + 1]].sum()
        assert used <= WINDOW
        if row + 1 < len(train):  # next fit: the next example would not have fitted
            assert used + lengths[starts[row + 1]] > WINDOW
    _, targets, segments = train.batch(np.array([0]))
    n = int(lengths[starts[0] : starts[1]].sum())
    assert (targets[0, n:] == IGNORE_INDEX).all() and (segments[0, n:] == segments[0, n]).all()
    assert val.examples.offsets[0] == examples.offsets[len(examples) - 4]


def test_trainer_passes_segments_through(examples: Examples) -> None:
    """evaluate() on packed batches gives the unpacked batches' loss; model_options adds
    nothing to other batches, whose forward is unchanged."""
    model = GPT(GPT2, seed=3)
    packed, _ = examples.split(0.1, packed=True)
    plain, _ = examples.split(0.1)

    class Group:  # one DP rank: the all-reduce is the identity
        size = 1

        def all_reduce(self, tensor: torch.Tensor) -> torch.Tensor:
            return tensor

    class Engine:
        module = model

        def __call__(self, *args: object, **kwargs: object) -> torch.Tensor:
            return model(*args, **kwargs)

    device = torch.device("cpu")
    rows = range(len(packed))
    batches = [packed.batch(np.array(rows[i : i + 2])) for i in range(0, len(rows), 2)]
    plain_batches = [plain.batch(np.arange(i, i + 4)) for i in range(0, len(plain), 4)]
    loss = evaluate(Engine(), batches, Group(), device)  # type: ignore[arg-type]
    assert loss == pytest.approx(evaluate(Engine(), plain_batches, Group(), device), rel=1e-5)
    assert model_options(plain_batches[0], device) == {}
    assert split_batch(batches[0], device)[0].shape == (2, WINDOW)


def _tp_losses(config: GPTConfig, batch: tuple[torch.Tensor, ...]) -> dict[str, float]:
    """In each rank of a process group of 2: the packed loss at tp=2, with and without
    sequence parallelism (attention sees the whole sequence either way)."""
    from hybrid.distributed.env import init_distributed, shutdown
    from hybrid.distributed.topology import Topology
    from hybrid.tensor_parallel import TensorParallel

    env = init_distributed()
    try:
        topology, out = Topology.build(2), {}
        for sp in (False, True):
            model = GPT(config, TensorParallel.from_topology(topology, 3, sp), seed=3).eval()
            inputs, targets, segments = batch
            with torch.no_grad():
                out[f"sp={sp}"] = model(inputs, targets, segments=segments).item()
        return out
    finally:
        shutdown(env)


@pytest.mark.parametrize("config", [GPT2, LLAMA], ids=["gpt2", "llama"])
def test_packed_loss_at_tp2(config: GPTConfig, examples: Examples) -> None:
    train, _ = examples.split(0.1, packed=True)
    batch = train.batch(np.arange(4))
    with torch.no_grad():
        reference = GPT(config, seed=3).eval()(batch[0], batch[1], segments=batch[2]).item()
    results = run_processes(_tp_losses, 2, config, batch)
    for rank in results:
        for name, loss in rank.items():
            assert loss == pytest.approx(reference, rel=1e-5), name


def _steps(layouts: list[tuple[int, int, bool]], steps: list) -> list:
    """Two optimizer steps through launch.train.step.train_step and the Engine at each
    (tp, zero stage, sequence parallel) layout: each step's loss and gradient norm. With
    one process the whole global batch is one micro-batch; else this DP rank's share of
    the micro-batches."""
    from hybrid.distributed.topology import Topology
    from hybrid.engine import Engine, EngineConfig
    from hybrid.tensor_parallel import TensorParallel
    from launch.train.step import train_step

    out = []
    for tp, stage, sp in layouts:
        topology = Topology.build(tp)
        parallel = TensorParallel.from_topology(topology, 3, sp)
        model = GPT(LLAMA, parallel, seed=3)
        per_rank = len(steps[0]) // topology.dp
        config = EngineConfig(zero_stage=stage, micro_batches=per_rank)
        engine = Engine(model, topology, parallel, config, units=list(model.blocks))
        results = []
        for micro in steps:
            mine = micro[topology.dp_rank * per_rank : (topology.dp_rank + 1) * per_rank]
            loss, norm, _ = train_step(engine, mine, 1e-2, torch.device("cpu"))
            results.append((loss, norm))
        out.append(results)
    return out


def _steps_in_group(layouts: list[tuple[int, int, bool]], steps: list) -> list:
    from hybrid.distributed.env import init_distributed, shutdown

    env = init_distributed()
    try:
        return _steps(layouts, steps)
    finally:
        shutdown(env)


def test_packed_train_steps_match_unpacked(examples: Examples) -> None:
    """The loss and gradient norm of two steps on packed rows, at (dp=2, ZeRO-3) and at
    (tp=2 + sequence parallel, ZeRO-1), equal those of one process stepping on the same
    examples padded one to a row (the mean over every completion token of the batch)."""
    packed, _ = examples.split(0.1, packed=True)
    plain, _ = examples.split(0.1)
    rows = [[0, 1, 2, 3], [4, 5, 6, 7]]
    packed_steps = [[packed.batch(np.array([r])) for r in step] for step in rows]
    members = [np.arange(packed.starts[step[0]], packed.starts[step[-1] + 1]) for step in rows]
    (reference,) = _steps([(1, 0, False)], [[plain.batch(ids)] for ids in members])
    results = run_processes(_steps_in_group, 2, [(1, 3, False), (2, 1, True)], packed_steps)[0]
    for layout in results:
        assert np.allclose(layout, reference, rtol=1e-5, atol=0), (layout, reference)
