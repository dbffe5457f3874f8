"""The GPT architecture on `hybrid` layers: GPT-2 by default, Llama-family options.

Hugging Face import/export is in `models.gpt.hf.folder` (imported on demand: it loads transformers).
"""

from models.gpt.accounting import count_parameters, flops_per_token
from models.gpt.config import GPTConfig, pad_vocab_size
from models.gpt.model import GPT, IGNORE_INDEX

__all__ = [
    "GPT",
    "IGNORE_INDEX",
    "GPTConfig",
    "count_parameters",
    "flops_per_token",
    "pad_vocab_size",
]
