"""The GPT architecture on tensor-parallel layers: GPT-2 by default, Llama-family options.

Pre-norm blocks (LayerNorm or RMSNorm), multi-head or grouped-query causal attention with
learned or rotary positions, a GELU or SwiGLU MLP, tied or separate output embeddings,
dropout. With tp ranks (Megatron-LM, Shoeybi et al. 2019):
- attention heads are split across ranks: QKV is column-parallel with its output features
  ordered (kv_head, [q_1 .. q_g, k, v], head_dim), (head, q|k|v, head_dim) for multi-head
  attention, so each rank's slice holds whole heads (attention.py); the output projection
  is row-parallel;
- the MLP is column-parallel, then row-parallel (mlp.py);
- the token embedding is vocabulary-parallel and, tied, doubles as the output layer (or
  `lm_head` is a separate vocabulary-parallel weight), and the loss is computed on the
  vocabulary slices (no full logits anywhere).
Activations inside the model are (sequence, batch, features); under sequence parallelism
the residual stream holds this rank's sequence chunk.
"""

from __future__ import annotations

import math
from collections.abc import Mapping

import torch
import torch.nn.functional as F
from torch import nn

from hybrid.dropout import dropout
from hybrid.recompute import RecomputePolicy, maybe_recompute
from hybrid.tensor_parallel import (
    TensorParallel,
    VocabParallelEmbedding,
    VocabParallelOutput,
    gather_from_region,
    init_from_seed,
    parameter_shards,
    vocab_parallel_cross_entropy,
)
from hybrid.tensor_parallel.layers import parallel_linear_input
from hybrid.tensor_parallel.shards import Init, full_shape, seeded_elements
from models.gpt.attention import CausalSelfAttention, document_mask, segment_positions
from models.gpt.config import GPTConfig
from models.gpt.mlp import make_mlp
from models.gpt.norms import make_norm
from models.gpt.weight_source import WeightSource, as_weight_source

INIT_STD = 0.02  # GPT-2's initializer_range
IGNORE_INDEX = -100  # a target that takes no loss (torch's and Hugging Face's convention)


class Block(nn.Module):
    def __init__(
        self, config: GPTConfig, tp: TensorParallel, recompute: RecomputePolicy, index: int
    ) -> None:
        super().__init__()
        self.tp = tp
        self.recompute_layer = recompute.full_layer(index)
        self.ln_1 = make_norm(config)
        self.attn = CausalSelfAttention(config, tp, recompute.attention_core)
        self.ln_2 = make_norm(config)
        self.mlp = make_mlp(config, tp)
        self.dropout = config.dropout

    def forward(
        self,
        x: torch.Tensor,
        mask: torch.Tensor | None = None,
        positions: torch.Tensor | None = None,
    ) -> torch.Tensor:
        return maybe_recompute(
            self.recompute_layer, self._layer, x, mask, positions, rng=self.tp.rng
        )

    def _layer(
        self, x: torch.Tensor, mask: torch.Tensor | None, positions: torch.Tensor | None
    ) -> torch.Tensor:
        x = x + self._residual_dropout(self.attn(self.ln_1(x), mask, positions))
        return x + self._residual_dropout(self.mlp(self.ln_2(x)))

    def _residual_dropout(self, x: torch.Tensor) -> torch.Tensor:
        with self.tp.residual_rng():
            return dropout(x, self.dropout, self.training)


class GPT(nn.Module):
    """The decoder at any tensor-parallel degree.

    `n_real_tokens` (default: `config.vocab_size`) is how many vocabulary entries are real
    tokens; the loss masks the rest (Megatron-style padding to a multiple of 128, and to a
    multiple of tp), so the loss equals that of the unpadded model.

    Weights come from the seed (`reset_parameters`) or, with `init_weights`, from full
    (tp=1) tensors under our parameter names, e.g. a Hugging Face checkpoint converted by
    `models.gpt.hf.folder`: each rank keeps only its TP slice (`load_full_state`).
    """

    def __init__(
        self,
        config: GPTConfig,
        tp: TensorParallel | None = None,
        recompute: RecomputePolicy | None = None,
        seed: int = 0,
        n_real_tokens: int | None = None,
        device: torch.device | str | None = None,
        init_weights: Mapping[str, torch.Tensor] | WeightSource | None = None,
    ) -> None:
        """On `device="meta"` only shapes exist: nothing is allocated or initialised, and
        the Engine materialises each rank's shard from `initial_value` (ZeRO-3 at scale),
        which reads this rank's piece of `init_weights` when given (a mapping of full
        tensors, or a WeightSource such as models.gpt.hf.lazy.open_hf_weights' lazy
        files), else draws from the seed."""
        super().__init__()
        if config.vocab_size is None:
            raise ValueError("GPTConfig.vocab_size must be set before building the model")
        tp = tp or TensorParallel.single(seed)
        recompute = recompute or RecomputePolicy()
        config.check()
        check_tp_shapes(config, tp.size, tp.sequence_parallel)
        self.config, self.tp = config, tp
        self.n_real_tokens = n_real_tokens or config.vocab_size
        self.seed = seed
        self._init_weights: WeightSource | None = None
        with torch.device(device or "cpu"):
            self.wte = VocabParallelEmbedding(config.vocab_size, config.d_model, tp)
            if config.positions == "learned":
                # Uninitialised here (reset_parameters draws it): nn.Embedding's own
                # normal_ is wasted work, and on meta it imports torch._dynamo (~2 s).
                empty = torch.empty(config.seq_len, config.d_model)
                self.wpe = nn.Embedding(config.seq_len, config.d_model, _weight=empty)
            self.blocks = nn.ModuleList(
                Block(config, tp, recompute, i) for i in range(config.n_layer)
            )
            self.ln_f = make_norm(config)
            if not config.tie_embeddings:
                self.lm_head = VocabParallelOutput(config.vocab_size, config.d_model, tp)
        if init_weights is not None:
            self.load_full_state(init_weights)
        elif torch.device(device or "cpu").type != "meta":
            self.reset_parameters(seed)

    def reset_parameters(self, seed: int) -> None:
        """GPT-2 initialisation (Radford et al. 2019, section 2.3), drawn per parameter from
        (seed, name) so every tp slices the same full weights (hybrid.tensor_parallel.shards);
        a rank draws only the random values of its own slice (counter-based: seeded.py).

        Weights N(0, 0.02), biases 0, norm gains 1; the residual projections that write
        into the residual stream (attention and MLP output) are scaled by 1/sqrt(2 n_layer),
        since each layer adds two of them to the stream. The same rule serves every option
        (GQA's QKV, SwiGLU's gate|up, the untied output layer are plain N(0, 0.02)).
        """
        self.seed, self._init_weights = seed, None
        init_from_seed(self, seed, self._init_rule, self.tp.rank)

    @torch.no_grad()
    def load_full_state(self, state: Mapping[str, torch.Tensor] | WeightSource) -> None:
        """Set every parameter to this TP rank's slice of the full (tp=1) tensor of the same
        name in `state` (a mapping, or a WeightSource that reads lazily); names and full
        shapes must match exactly.

        Parameters on the meta device cannot take data: for them the source is kept, and
        `initial_values` reads from it only the piece the Engine materialises (a mapping's
        tensors stay referenced until `forget_initial_weights`, `reset_parameters` or the
        model is dropped; a lazy source holds no weights).
        """
        source = as_weight_source(state)
        expected = dict(self.named_parameters())
        names = set(source.names())
        missing, unexpected = expected.keys() - names, names - expected.keys()
        if missing or unexpected:
            raise ValueError(
                f"imported weights do not match the model: missing {sorted(missing)}, "
                f"unexpected {sorted(unexpected)}"
            )
        specs = parameter_shards(self)
        for name, param in expected.items():
            want, got = full_shape(param, specs.get(name)), tuple(source.shape(name))
            if got != want:
                raise ValueError(
                    f"imported weight {name} has shape {got}; the model (tp=1) expects {want}"
                )
        if any(p.device.type == "meta" for p in expected.values()):
            self._init_weights = source
        for name, param in expected.items():
            if param.device.type != "meta":
                value = source.read(name, specs.get(name), self.tp.rank, 0, param.numel())
                param.copy_(value.reshape(param.shape))

    def forget_initial_weights(self) -> None:
        """Drop the imported weights kept for `initial_values` once the Engine has
        materialised every shard (tensors in memory would otherwise stay referenced)."""
        self._init_weights = None

    def initial_value(self, name: str) -> torch.Tensor:
        """This TP rank's slice of parameter `name`'s initial value (the imported tensor,
        or the seeded draw of `reset_parameters`); one parameter at a time, for
        materialising a model built on the meta device."""
        param = self.get_parameter(name)
        return self.initial_values(name, 0, param.numel()).view(param.shape)

    def initial_values(self, name: str, start: int, end: int) -> torch.Tensor:
        """Elements [start, end) of the flattened `initial_value(name)`, as a 1-D tensor.
        Seeded, only those elements are drawn (hybrid.tensor_parallel.seeded), so a ZeRO-3
        rank draws only its DP shard of its TP slice."""
        param = self.get_parameter(name)
        spec = parameter_shards(self).get(name)
        if self._init_weights is not None:
            value = self._init_weights.read(name, spec, self.tp.rank, start, end)
            return value.to(param.dtype)
        full = full_shape(param, spec)
        rank = self.tp.rank
        return seeded_elements(name, full, spec, self.seed, self._init_rule, rank, start, end)

    def _init_rule(self, name: str, shape: tuple[int, ...]) -> Init:
        """GPT-2's distribution of parameter `name` (see `reset_parameters`)."""
        if name.endswith("bias") or (".ln_" in name or name.startswith("ln_")):
            return Init(fill=1.0 if name.endswith("weight") else 0.0)
        residual_std = INIT_STD / math.sqrt(2 * self.config.n_layer)
        return Init(fill=0.0, std=residual_std if name.endswith("proj.weight") else INIT_STD)

    def forward(
        self,
        idx: torch.Tensor,
        targets: torch.Tensor | None = None,
        loss_tokens: float | torch.Tensor | None = None,
        segments: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """Without `targets`: the full logits (b, s, vocab_size), gathered across TP.

        With `targets` (b, s): the cross-entropy summed over the targets that are not
        IGNORE_INDEX (prompt and padding tokens in supervised fine-tuning), divided by
        `loss_tokens`, by default their count (the mean). A trainer that accumulates
        micro-batches passes the count it needs for the mean over the whole global batch:
        averaging per micro-batch would weigh a token by how full its micro-batch is, and
        the loss would change with the parallel layout.

        `segments` (b, s): the document id of each token of packed sequences (several
        fine-tuning examples to a row). Each document then attends only to itself and its
        positions start at 0, so its logits are those it would have alone.
        """
        seq = idx.shape[1]
        if seq > self.config.seq_len:
            raise ValueError(
                f"sequence of {seq} tokens exceeds model.seq_len={self.config.seq_len}"
            )
        mask = positions = None
        if segments is not None:
            mask, positions = document_mask(segments), segment_positions(segments)
        x = self._embed(idx.t(), positions)
        for block in self.blocks:
            x = block(x, mask, positions)
        logits = self._output(self.ln_f(x))  # (s, b, V/tp)
        if targets is None:
            full = gather_from_region(logits, self.tp.group)[..., : self.config.vocab_size]
            return full.transpose(0, 1)
        targets = targets.t()
        ignored = targets == IGNORE_INDEX
        per_token = vocab_parallel_cross_entropy(
            logits, targets, self.tp.group, self.wte.vocab_start, self.n_real_tokens
        ).masked_fill(ignored, 0.0)  # and zero gradient: masked_fill's backward masks it
        if loss_tokens is None:
            loss_tokens = (~ignored).sum().clamp(min=1)
        return per_token.sum() / loss_tokens

    def _embed(self, ids: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
        """Token (+ learned position) embeddings with dropout; under sequence parallelism
        this rank's chunk of the sequence (the token embedding's reduction is a
        reduce-scatter). Rotary positions are applied inside attention instead."""
        x = self.wte(ids)  # (s, b, h) or (s/tp, b, h)
        if self.config.positions == "learned":
            chunk = x.shape[0]
            start = self.tp.rank * chunk if self.tp.sequence_parallel else 0
            if positions is None:
                x = x + self.wpe(torch.arange(start, start + chunk, device=ids.device)).unsqueeze(1)
            else:  # packed documents: (b, s) positions, this rank's chunk of them
                x = x + self.wpe(positions[:, start : start + chunk].t())
        with self.tp.residual_rng():
            return dropout(x, self.config.dropout, self.training)

    def _output(self, x: torch.Tensor) -> torch.Tensor:
        """This rank's vocabulary slice of the logits. Tied: the embedding's slice serves
        as a column-split output weight (Press & Wolf 2017)."""
        if self.config.tie_embeddings:
            return parallel_linear_input(x, self.wte.weight, None, self.tp)
        return self.lm_head(x)

    @torch.no_grad()
    def generate(
        self,
        idx: torch.Tensor,
        new_tokens: int,
        temperature: float = 0.8,
        top_k: int | None = 40,
        generator: torch.Generator | None = None,
    ) -> torch.Tensor:
        """Sample `new_tokens` tokens after the prompt `idx` (b, s); vocabulary padding is
        never sampled. Under TP every rank of the group must call it (same generator seed)."""
        for _ in range(new_tokens):
            context = idx[:, -self.config.seq_len :]
            if self.tp.sequence_parallel:  # the sequence must split evenly across TP ranks
                keep = context.shape[1] - context.shape[1] % self.tp.size
                context = context[:, -keep:] if keep else context[:, :1].expand(-1, self.tp.size)
            logits = self(context)[:, -1, : self.n_real_tokens].float()
            logits = logits / max(temperature, 1e-5)
            if top_k is not None:
                kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                logits = logits.masked_fill(logits < kth, float("-inf"))
            probs = F.softmax(logits, dim=-1)
            idx = torch.cat([idx, torch.multinomial(probs, 1, generator=generator)], dim=1)
        return idx


def check_tp_shapes(config: GPTConfig, tp: int, sequence_parallel: bool) -> None:
    """Shapes a tensor-parallel GPT needs; each message names the numbers."""
    if config.d_model % config.n_head:
        raise ValueError(f"d_model={config.d_model} is not divisible by n_head={config.n_head}")
    if config.n_head % config.kv_heads:
        raise ValueError(
            f"n_head={config.n_head} is not divisible by n_kv_head={config.kv_heads}: in "
            "grouped-query attention each key/value head serves n_head/n_kv_head query heads"
        )
    if config.n_head % tp:
        raise ValueError(
            f"n_head={config.n_head} is not divisible by tp={tp}: attention heads are split "
            "across tensor-parallel ranks"
        )
    if config.kv_heads % tp:
        raise ValueError(
            f"n_kv_head={config.kv_heads} is not divisible by tp={tp}: key/value heads are "
            "split across tensor-parallel ranks with their query heads"
        )
    if config.ffn_dim % tp:
        raise ValueError(
            f"MLP width {config.ffn_dim} (d_ff) is not divisible by tp={tp}: the MLP is "
            "split across tensor-parallel ranks"
        )
    if config.positions == "rope" and config.head_dim % 2:
        raise ValueError(
            f"head_dim={config.head_dim} (d_model / n_head) must be even for rotary positions"
        )
    if sequence_parallel and config.seq_len % tp:
        raise ValueError(
            f"seq_len={config.seq_len} is not divisible by tp={tp}: sequence parallelism "
            "splits every sequence into tp equal chunks"
        )
