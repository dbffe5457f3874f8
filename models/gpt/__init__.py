"""GPT-2 architecture on `hybrid` layers."""

from .accounting import count_parameters, flops_per_token
from .config import GPTConfig, pad_vocab_size
from .model import GPT

__all__ = ["GPT", "GPTConfig", "count_parameters", "flops_per_token", "pad_vocab_size"]
