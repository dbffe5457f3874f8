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
from pathlib import Path

from mutation_lists import MUTATIONS, Mutation  # tests/ is on sys.path: this file's folder

ROOT = Path(__file__).resolve().parent.parent


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
