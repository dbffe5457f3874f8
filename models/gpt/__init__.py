"""The GPT architecture on `hybrid` layers: GPT-2 by default, Llama-family options.

Hugging Face import/export is in `models.gpt.hf` (imported on demand: it loads transformers).
"""

from .accounting import count_parameters, flops_per_token
from .config import GPTConfig, pad_vocab_size
from .model import GPT, IGNORE_INDEX

__all__ = [
    "GPT",
    "IGNORE_INDEX",
    "GPTConfig",
    "count_parameters",
    "flops_per_token",
    "pad_vocab_size",
]
