"""The README's "Your own model" example runs as written at dp=2 (ZeRO-3, a meta model)
and its loss falls."""

from __future__ import annotations

import contextlib
import io
from pathlib import Path

from hybrid.instruments.local_processes import run_processes

README = Path(__file__).resolve().parents[2] / "README.md"


def readme_example() -> str:
    text = README.read_text()
    start = text.index("<!-- own-model example")
    body = text[text.index("\n", start) + 1 : text.index("<!-- end of own-model example")]
    return "\n".join(line.removeprefix("    ") for line in body.splitlines())


def run_example(code: str) -> str:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        exec(compile(code, "README.md", "exec"), {"__name__": "__main__"})
    return out.getvalue()


def test_the_readme_own_model_example_trains() -> None:
    code = readme_example()
    assert len([line for line in code.splitlines() if line.strip()]) <= 20, code
    printed = run_processes(run_example, 2, code)[0]
    loss = float(printed.rsplit("loss", 1)[1])
    assert loss < 2.0, printed  # ln 10 = 2.30 at the start
