"""A Hugging Face folder's safetensors read lazily, for a model trained as it is: the
Engine asks for elements [start, end) of one flattened tensor (a rank's ZeRO shard of it)
and only the rows holding them are read (safetensors' `get_slice`), so a rank reads about
1/dp of the checkpoint: 70B in bf16 on 8 ranks, 17.5 GB a rank, not 140 GB."""

from __future__ import annotations

import math
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from models.gpt.hf.weight_files import weight_files


class SafetensorsValues:
    """`initial_values(name, start, end)` of the tensors named in `expected` (name ->
    shape), read from the folder's safetensors files; every name and shape is checked
    against the headers when it is opened (ValueError naming the first mismatch)."""

    def __init__(self, folder: str | Path, expected: dict[str, tuple[int, ...]]) -> None:
        folder = Path(folder)
        _, files, _ = weight_files(folder)
        if any(f.suffix != ".safetensors" for f in files):
            raise ValueError(
                f"{folder} holds pytorch_model.bin; a model trained as it is reads "
                "safetensors only: convert it (python -m launch.convert --help) or save it "
                "with save_pretrained(safe_serialization=True)"
            )
        self.where: dict[str, tuple[Path, tuple[int, ...]]] = {}
        for file in files:
            try:
                with safe_open(str(file), "pt") as f:
                    for key in f.keys():  # noqa: SIM118 - safe_open is not a mapping
                        self.where[key] = (file, tuple(f.get_slice(key).get_shape()))
            except (SafetensorError, OSError) as error:
                raise ValueError(f"{file}: not a readable safetensors file ({error})") from None
        for name, shape in expected.items():
            if name not in self.where:
                raise ValueError(f"{folder} has no tensor {name}, which the model has")
            if self.where[name][1] != tuple(shape):
                raise ValueError(
                    f"{folder}: {name} is {list(self.where[name][1])} there, "
                    f"{list(shape)} in the model its config.json builds"
                )

    def initial_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of tensor `name` flattened: the rows that cover them read."""
        file, shape = self.where[name]
        row = math.prod(shape[1:]) if shape else 1
        first, last = start // row, -(-end // row)
        with safe_open(str(file), "pt") as f:
            rows = f.get_tensor(name) if not shape else f.get_slice(name)[first:last]
        return rows.reshape(-1)[start - first * row : end - first * row].clone()

    def initial_value(self, name: str) -> torch.Tensor:
        shape = self.where[name][1]
        return self.initial_values(name, 0, math.prod(shape)).view(shape)
