"""Local Hugging Face `datasets` folders as a source of documents, read streaming.

Two layouts are recognised:

- a folder of parquet files (found recursively, read in sorted path order), as
  `Dataset.to_parquet` or a dataset repository's `data/train-*.parquet` leave them;
- a folder written by `Dataset.save_to_disk` (state.json and data-*.arrow), or by
  `DatasetDict.save_to_disk` (dataset_dict.json; its `train` split is read).

Both are read with `datasets.load_dataset(..., streaming=True)`: record batches come
straight from the files, with no arrow copy of the corpus in a cache and nothing fetched
from the network. A folder whose rows have the text column (data.text_field) yields text
documents, one per row; a folder without it but with an `input_ids` column yields
pre-tokenized documents, one 1-D int64 array per row.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal

import numpy as np

if TYPE_CHECKING:
    from launch.config import DataConfig

TOKENS_COLUMN = "input_ids"
_BATCH_ROWS = 1024  # rows per record batch read: bounds memory whatever the corpus size


@dataclass(frozen=True)
class HFFolder:
    """A local datasets folder, checked: its files, the column read and the row count."""

    path: Path
    kind: Literal["parquet", "arrow"]
    files: tuple[Path, ...]
    column: str
    n_rows: int

    @property
    def pretokenized(self) -> bool:
        return self.column == TOKENS_COLUMN

    def documents(self) -> Iterator[str | np.ndarray]:
        """Each row's text (str), or its token ids (1-D int64 array) when pretokenized;
        rows whose value is null are skipped."""
        return (document for _, document in self.rows())

    def rows(self) -> Iterator[tuple[int, str | np.ndarray]]:
        """(row number, document) of every non-null row, numbered over the folder's files
        in order from 0, so an error can name the row."""
        import datasets  # here: about 1 s of start-up that a cached corpus never needs

        datasets.disable_progress_bars()
        # datasets reads a parquet row group whole unless told a batch size (a row group can
        # be 100 MB of text), and every column unless told which.
        options = {"batch_size": _BATCH_ROWS, "columns": [self.column]}
        stream = datasets.load_dataset(
            self.kind, data_files=[str(f) for f in self.files], split="train", streaming=True,
            **(options if self.kind == "parquet" else {}),
        )  # fmt: skip
        row = 0
        for table in stream.select_columns([self.column]).with_format("arrow").iter(_BATCH_ROWS):
            column = table.column(self.column)
            if not self.pretokenized:
                texts = column.to_pylist()
                yield from ((row + i, text) for i, text in enumerate(texts) if text is not None)
                row += len(texts)
                continue
            for chunk in column.chunks:  # offsets and values: no Python list per token
                offsets = chunk.offsets.to_numpy()
                values = chunk.values.to_numpy(zero_copy_only=False).astype(np.int64)
                valid = chunk.is_valid().to_numpy(zero_copy_only=False)
                for i in np.flatnonzero(valid):
                    yield row + int(i), values[offsets[i] : offsets[i + 1]]
                row += len(chunk)


def id_batches(
    rows: Iterator[tuple[int, Any]], folder: Path, vocab: int, dtype: np.dtype, tokens: int
) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """(ids as `dtype`, row lengths) of batches of about `tokens` ids of `input_ids` rows
    (HFFolder.rows()), every id checked to lie in [0, vocab): one-line ValueError naming
    the folder, the row and the id."""
    batch: list[np.ndarray] = []
    numbers: list[int] = []
    n = 0
    for number, ids in rows:
        batch.append(ids)
        numbers.append(number)
        n += len(ids)
        if n >= tokens:
            yield _checked(batch, numbers, folder, vocab, dtype)
            batch, numbers, n = [], [], 0
    if batch:
        yield _checked(batch, numbers, folder, vocab, dtype)


def _checked(
    batch: list[np.ndarray], numbers: list[int], folder: Path, vocab: int, dtype: np.dtype
) -> tuple[np.ndarray, np.ndarray]:
    flat = np.concatenate(batch)
    lengths = np.fromiter(map(len, batch), np.int64, len(batch))
    if flat.size and (flat.min() < 0 or flat.max() >= vocab):
        at = int(np.argmax((flat < 0) | (flat >= vocab)))
        ends = np.cumsum(lengths)
        row = int(np.searchsorted(ends, at, side="right"))
        raise ValueError(
            f"{folder}: row {numbers[row]}: token id {int(flat[at])} at offset "
            f"{at - int(ends[row] - lengths[row])} is outside the vocabulary [0, {vocab}) of "
            "data.tokenizer; set data.tokenizer to the tokenizer the input_ids come from"
        )
    return flat.astype(dtype), lengths


def is_hf_folder(folder: Path) -> bool:
    """True when `folder` looks like a datasets folder: save_to_disk's marker files, or
    parquet files somewhere inside."""
    folder = Path(folder)
    if not folder.is_dir():
        return False
    markers = ("state.json", "dataset_dict.json")
    return any((folder / m).is_file() for m in markers) or any(folder.rglob("*.parquet"))


def open_hf_folder(folder: str | Path, text_field: str = "text") -> HFFolder:
    """Check a datasets folder and say what it holds; one-line ValueError naming the folder
    when it holds no data files, neither column, or no rows."""
    folder = Path(folder).expanduser()
    if not folder.is_dir():
        raise ValueError(f"data.files: {folder} is not a folder")
    kind, files = _data_files(folder)
    columns, n_rows = _schema_and_rows(kind, files)
    if text_field in columns:
        column = text_field
    elif TOKENS_COLUMN in columns:
        column = TOKENS_COLUMN
    else:
        raise ValueError(
            f"{folder} has neither a '{text_field}' nor an '{TOKENS_COLUMN}' column "
            f"(columns: {', '.join(columns)}); set data.text_field"
        )
    if n_rows == 0:
        raise ValueError(f"{folder} holds no documents (0 rows); it is an empty source")
    return HFFolder(folder, kind, files, column, n_rows)


def data_files(folder: str | Path) -> tuple[Literal["parquet", "arrow"], tuple[Path, ...]]:
    """The folder's kind and its data files, in reading order, from the names alone (what
    the cache key fingerprints); one-line ValueError when it holds none."""
    return _data_files(Path(folder).expanduser())


def check_hf_folders(data: DataConfig) -> None:
    """Every datasets folder in data.files and in each mixture source, checked from its
    metadata (open_hf_folder) before any process group: one-line ValueError naming it. A
    pre-tokenized folder cannot train a `bpe` tokenizer: its ids come from another one."""
    sources = [("data.files", data.files)]
    sources += [(f"data.mixture[{i}]", s.files) for i, s in enumerate(data.mixture)]
    for where, files in sources:
        for name in files:
            if not is_hf_folder(Path(name).expanduser()):
                continue
            try:
                folder = open_hf_folder(name, data.text_field)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
            if folder.pretokenized and data.tokenizer == "bpe":
                raise ValueError(
                    f"{where}: {folder.path} holds pre-tokenized {TOKENS_COLUMN}; data.tokenizer="
                    "bpe cannot be trained on it: set data.tokenizer to the tokenizer of its ids"
                )


def _data_files(folder: Path) -> tuple[Literal["parquet", "arrow"], tuple[Path, ...]]:
    split = folder
    if (folder / "dataset_dict.json").is_file():
        splits = json.loads((folder / "dataset_dict.json").read_text()).get("splits", [])
        if "train" not in splits:
            raise ValueError(f"{folder}: a DatasetDict without a 'train' split (splits: {splits})")
        split = folder / "train"
    if (split / "state.json").is_file():
        state = json.loads((split / "state.json").read_text())
        files = tuple(split / f["filename"] for f in state.get("_data_files", []))
        if not files:
            raise ValueError(f"{split}/state.json lists no data files; it is an empty source")
        missing = [f.name for f in files if not f.is_file()]
        if missing:
            raise ValueError(f"{split}/state.json names {missing[0]}, which is missing")
        return "arrow", files
    files = tuple(sorted(folder.rglob("*.parquet")))
    if not files:
        raise ValueError(
            f"{folder} holds no parquet files and no save_to_disk dataset (state.json); "
            "it is an empty source"
        )
    return "parquet", files


def _schema_and_rows(kind: str, files: tuple[Path, ...]) -> tuple[list[str], int]:
    """Column names and total rows, from the files' metadata (parquet footers, arrow batch
    headers over a memory map): nothing is decoded."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    columns: list[str] = []
    n_rows = 0
    for path in files:
        try:
            if kind == "parquet":
                meta = pq.read_metadata(path)
                names, rows = meta.schema.to_arrow_schema().names, meta.num_rows
            else:
                with pa.memory_map(str(path)) as source:
                    reader = pa.ipc.open_stream(source)
                    names, rows = reader.schema.names, sum(b.num_rows for b in reader)
        except (OSError, pa.ArrowInvalid) as error:
            raise ValueError(f"{path}: not a readable {kind} file ({error})") from None
        columns = columns or names
        n_rows += rows
    return columns, n_rows
