"""Recycling transformer (``recycle-former``): a shared-weight trunk re-run a per-sample number of times.

Owns :class:`RecycleFormerConfig`, its named configs (:data:`CONFIGS`: ``tiny``, ``small``), the
model :class:`RecycleFormer`, :func:`gap_token`, :func:`sample_iterations` and the synthetic
batch generator :func:`make_batch`. Input ``ids[B, S]`` int64, target ``y[B]`` int64.

Modelled on AlphaFold's recycling (the "AlphaFold (evoformer)" family of DyNN-Offload's pilot
training set, Table II): the trunk, ``layers`` blocks with their own weights, runs once, then
is re-run on its own output, the same weights each time; the number of trunk iterations
depends on the sample. A block (:class:`RecycleBlock`) follows the evoformer's row attention and
transition, cut down to one sequence: pre-LN, self-attention whose output is gated by
``sigmoid(Linear(x))`` before its projection, then a ReLU transition MLP, each residual.

Path rule. The input reads as an alignment row with gaps: token 0 is the gap symbol
(:func:`gap_token`; the other tokens are ``1..vocab - 1``), and a row with ``g`` gaps, harder
to fold, gets ``min(1 + g, recycles)`` iterations (:func:`sample_iterations`).
The path is ``(0, 1, ..., layers - 1)`` repeated once per iteration: block indices repeat, as
in var-LSTM's unrolled steps. Unlike AlphaFold, every iteration is trained (no stop-gradient
on the earlier ones) and nothing but the trunk's own output is fed back (no recycling
embedder), so the trunk blocks are all the control flow chooses between.

Compared with var-BERT (:mod:`models.var_bert`): var-BERT's depth also follows the count of
one token, but its marker is the vocabulary's last id and each extra segment runs *new* post-LN
BERT layers; here the gap is id 0, the tiny vocabulary is smaller (48, so the embedding tables
differ), the blocks are gated pre-LN blocks, and each extra iteration re-runs the *same* ones.

Batch semantics: a batch shares one path. :func:`make_batch` draws one iteration count per
batch and gives every row that many gaps minus one (at per-row random positions);
:meth:`RecycleFormer.path` raises :class:`~models.dynamic_common.MixedPathError` on a batch
whose rows disagree.

Target: the class-band token task of :mod:`models.bert` on the non-gap tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from models.bert import class_band_tokens
from models.dynamic_common import Batch, shared_path
from models.gpt import check_transformer_config

__all__ = [
    "CONFIGS",
    "GatedSelfAttention",
    "RecycleBlock",
    "RecycleFormer",
    "RecycleFormerConfig",
    "gap_token",
    "make_batch",
    "sample_iterations",
]


@dataclass(frozen=True, kw_only=True)
class RecycleFormerConfig:
    """Shape of a :class:`RecycleFormer`. ``layers``: blocks of the trunk (one iteration);
    ``recycles``: the most trunk iterations a sample can get. ``seq`` is the default and
    maximum sequence length (the positional table)."""

    layers: int = 2
    recycles: int = 4
    d_model: int = 32
    heads: int = 2
    vocab: int = 48
    seq: int = 16
    mlp_ratio: int = 4
    dropout: float = 0.0
    classes: int = 4

    def __post_init__(self) -> None:
        check_transformer_config(self)
        if self.recycles < 1:
            raise ValueError(f"RecycleFormerConfig.recycles must be >= 1, got {self.recycles}")
        if self.seq < self.recycles - 1:
            raise ValueError(f"RecycleFormerConfig.seq ({self.seq}) must be >= recycles - 1 ({self.recycles - 1})")
        if not 1 <= self.classes <= self.vocab - 1:
            raise ValueError(
                f"RecycleFormerConfig.classes must be in [1, vocab - 1 = {self.vocab - 1}], got {self.classes}"
            )

    @property
    def dynamic(self) -> bool:
        """True when the number of iterations depends on the sample (``recycles > 1``)."""
        return self.recycles > 1


CONFIGS: dict[str, RecycleFormerConfig] = {
    "tiny": RecycleFormerConfig(layers=2, recycles=4, d_model=32, heads=2, vocab=48, seq=16, classes=4),
    "small": RecycleFormerConfig(layers=4, recycles=4, d_model=256, heads=4, vocab=512, seq=128, classes=8),
}


def gap_token(config: RecycleFormerConfig) -> int:
    """The gap token id (0; the data's other tokens are ``1..vocab - 1``)."""
    return 0


def sample_iterations(config: RecycleFormerConfig, ids: torch.Tensor) -> torch.Tensor:
    """Per-row trunk iterations ``[B]`` int64: ``min(1 + #gaps, recycles)``."""
    gaps = (ids == gap_token(config)).sum(dim=1)
    return torch.clamp(gaps + 1, max=config.recycles)


class GatedSelfAttention(nn.Module):
    """Multi-head self-attention (no mask) with AlphaFold's output gate: Linear qkv -> SDPA ->
    ``* sigmoid(Linear gate(x))`` -> Linear output projection."""

    def __init__(self, d_model: int, heads: int, *, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.gate = nn.Linear(d_model, d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.heads
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, Dh]
        y = F.scaled_dot_product_attention(q, k, v)
        y = y.transpose(1, 2).reshape(batch, seq, d_model) * torch.sigmoid(self.gate(x))
        return self.dropout(self.proj(y))


class RecycleBlock(nn.Module):
    """Pre-LN trunk block: ``x + attn(ln1(x))`` (gated attention) then ``x + transition(ln2(x))``
    (Linear -> ReLU -> Linear), ``x[B, S, D] -> x[B, S, D]``."""

    def __init__(self, config: RecycleFormerConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = GatedSelfAttention(config.d_model, config.heads, dropout=config.dropout)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.transition = nn.Sequential(
            nn.Linear(config.d_model, config.mlp_ratio * config.d_model),
            nn.ReLU(),
            nn.Linear(config.mlp_ratio * config.d_model, config.d_model),
            nn.Dropout(config.dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.transition(self.ln2(x))


class RecycleFormer(nn.Module):
    """Encoder whose trunk (:attr:`trunk`, ``layers`` :class:`RecycleBlock` s,
    ``x[B, S, D] -> x[B, S, D]``) runs ``iterations(sample)`` times on its own output.

    Embedding (token + position, LayerNorm) and the head (LayerNorm, mean pool, Linear) run once.
    """

    def __init__(self, config: RecycleFormerConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq, config.d_model)
        self.emb_ln = nn.LayerNorm(config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.trunk = nn.ModuleList(RecycleBlock(config) for _ in range(config.layers))
        self.out_ln = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.classes)

    def blocks(self) -> list[nn.Module]:
        """The trunk's blocks; path entries index this list."""
        return list(self.trunk)

    def iterations(self, ids: torch.Tensor) -> int:
        """Trunk iterations every row of ``ids[B, S]`` gets; MixedPathError if rows differ."""
        self._check_ids(ids)
        return shared_path([int(n) for n in sample_iterations(self.config, ids)], what="recycling iterations")

    def path(self, ids: torch.Tensor) -> tuple[int, ...]:
        """Block indices the forward runs on ``ids[B, S]``: ``(0, ..., layers - 1)`` per iteration."""
        return tuple(range(self.config.layers)) * self.iterations(ids)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> class logits ``[B, classes]``."""
        path = self.path(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.emb_ln(self.tok_emb(ids) + self.pos_emb(positions)))
        for index in path:
            x = self.trunk[index](x)
        return self.head(self.out_ln(x).mean(dim=1))

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[0] < 1 or not 1 <= ids.shape[1] <= self.config.seq:
            raise ValueError(f"ids must be [B >= 1, 1 <= S <= {self.config.seq}], got {tuple(ids.shape)}")


def make_batch(config: RecycleFormerConfig, batch: int, generator: torch.Generator, *, key: int | None = None) -> Batch:
    """``(ids,), (y,)`` of ``config.seq`` tokens; every row gets ``key`` trunk iterations
    (``key - 1`` gaps at random positions), ``key`` drawn uniformly from ``[1, recycles]`` when
    None. Non-gap tokens: the class-band tokens of :mod:`models.bert` over ``1..vocab - 1``."""
    if key is None:
        key = int(torch.randint(1, config.recycles + 1, (1,), generator=generator))
    if not 1 <= key <= config.recycles:
        raise ValueError(f"key (iterations) must be in [1, {config.recycles}], got {key}")
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    ids = 1 + class_band_tokens(y, config.seq, config.vocab - 1, config.classes, generator)
    positions = torch.rand(batch, config.seq, generator=generator).argsort(dim=1)[:, : key - 1]
    ids.scatter_(1, positions, gap_token(config))
    return (ids,), (y,)
