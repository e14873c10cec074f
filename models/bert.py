"""BERT-style encoder for sequence classification (post-LN transformer, full attention).

Owns the BERT config, its named configs (``tiny``, ``small``), the encoder block and model, and
the synthetic batch generator. Input ``ids[B, S]`` int64, target ``y[B]`` int64. The sequence
axis is dynamic up to ``config.seq``. The classifier reads the mean of the final hidden states.

The synthetic task: each sequence mixes uniform noise tokens with tokens from its class's band
of the vocabulary (see :func:`class_band_tokens`), so the class is learnable from the tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.gpt import SelfAttention, check_transformer_config, feed_forward

__all__ = ["BERTConfig", "BERT", "BERTBlock", "CONFIGS", "make_batch", "class_band_tokens"]

SIGNAL_FRACTION = 0.5
"""Probability that a synthetic token is drawn from its class's band instead of uniformly."""


@dataclass(frozen=True, kw_only=True)
class BERTConfig:
    """Shape of a :class:`BERT`. ``seq`` is the default sequence length; ``max_seq`` (default:
    ``seq``) the longest one, the size of the positional table."""

    layers: int = 2
    d_model: int = 32
    heads: int = 2
    vocab: int = 64
    seq: int = 16
    max_seq: int | None = None
    mlp_ratio: int = 4
    dropout: float = 0.0
    classes: int = 4

    def __post_init__(self) -> None:
        check_transformer_config(self)
        if self.max_seq is not None and self.max_seq < self.seq:
            raise ValueError(f"BERTConfig.max_seq ({self.max_seq}) must be >= seq ({self.seq})")
        if not 1 <= self.classes <= self.vocab:
            raise ValueError(f"BERTConfig.classes must be in [1, vocab={self.vocab}], got {self.classes}")

    @property
    def positions(self) -> int:
        """The longest sequence the model takes."""
        return self.max_seq or self.seq


# Sequences up to 256 for variable-length training (Mimose's setting); ``tiny12`` has twelve
# layers, as many as BERT-base, at tiny width: the size planning-time targets are stated for.
CONFIGS: dict[str, BERTConfig] = {
    "tiny": BERTConfig(layers=2, d_model=32, heads=2, vocab=64, seq=16, max_seq=256, classes=4),
    "tiny12": BERTConfig(layers=12, d_model=32, heads=2, vocab=64, seq=16, max_seq=256, classes=4),
    "small": BERTConfig(layers=4, d_model=256, heads=4, vocab=512, seq=128, max_seq=256, classes=8),
}


class BERTBlock(nn.Module):
    """Post-LN encoder block: ``ln1(x + attn(x))`` then ``ln2(x + mlp(x))``."""

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.attn = SelfAttention(config.d_model, config.heads, causal=False, dropout=config.dropout)
        self.ln1 = nn.LayerNorm(config.d_model)
        self.mlp = feed_forward(config.d_model, config.mlp_ratio, config.dropout)
        self.ln2 = nn.LayerNorm(config.d_model)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = self.ln1(x + self.attn(x))
        return self.ln2(x + self.mlp(x))


class BERT(nn.Module):
    """Token + positional embedding with LayerNorm, ``layers`` post-LN blocks, mean-pool head."""

    def __init__(self, config: BERTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.positions, config.d_model)
        self.emb_ln = nn.LayerNorm(config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(BERTBlock(config) for _ in range(config.layers))
        self.head = nn.Linear(config.d_model, config.classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> class logits ``[B, classes]``."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.emb_ln(self.tok_emb(ids) + self.pos_emb(positions)))
        for layer in self.layers:
            x = layer(x)
        return self.head(x.mean(dim=1))


def class_band_tokens(
    labels: torch.Tensor, seq: int, vocab: int, classes: int, generator: torch.Generator
) -> torch.Tensor:
    """Tokens ``[B, seq]``: each is, with probability :data:`SIGNAL_FRACTION`, drawn from the
    band ``[y * vocab // classes, (y + 1) * vocab // classes)`` of its row's label ``y``, and
    uniformly from the vocabulary otherwise."""
    batch = labels.shape[0]
    band = vocab // classes
    noise = torch.randint(0, vocab, (batch, seq), generator=generator)
    signal = labels.unsqueeze(1) * band + torch.randint(0, band, (batch, seq), generator=generator)
    use_signal = torch.rand(batch, seq, generator=generator) < SIGNAL_FRACTION
    return torch.where(use_signal, signal, noise)


def make_batch(
    config: BERTConfig, batch: int, seq: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Random labels ``y``; ``ids`` from :func:`class_band_tokens`."""
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    ids = class_band_tokens(y, seq, config.vocab, config.classes, generator)
    return (ids,), (y,)

