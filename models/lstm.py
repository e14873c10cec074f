"""LSTM sequence classifier: embedding -> ``nn.LSTM`` -> Linear head on the last time step.

Owns the LSTM config, its named configs (``tiny``, ``small``) and the model; the synthetic
batches reuse the class-band token task of :mod:`models.bert`. Input ``ids[B, S]`` int64,
target ``y[B]`` int64. Only the batch axis is dynamic: the LSTM exports unrolled over a fixed
sequence length (``config.seq``), though the eager module accepts any length.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.bert import class_band_tokens

__all__ = ["LSTMConfig", "LSTMClassifier", "CONFIGS", "make_batch"]


@dataclass(frozen=True, kw_only=True)
class LSTMConfig:
    """Shape of an :class:`LSTMClassifier`. ``seq`` is the default (export) sequence length."""

    layers: int = 1
    embed: int = 32
    hidden: int = 32
    vocab: int = 64
    seq: int = 8
    classes: int = 4
    dropout: float = 0.0  # between stacked LSTM layers (only used when layers > 1)

    def __post_init__(self) -> None:
        for name in ("layers", "embed", "hidden", "vocab", "seq", "classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"LSTMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.classes > self.vocab:
            raise ValueError(f"LSTMConfig.classes must be <= vocab={self.vocab}, got {self.classes}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"LSTMConfig.dropout must be in [0, 1), got {self.dropout}")


CONFIGS: dict[str, LSTMConfig] = {
    "tiny": LSTMConfig(layers=1, embed=32, hidden=32, vocab=64, seq=8, classes=4),
    "small": LSTMConfig(layers=2, embed=128, hidden=256, vocab=512, seq=64, classes=8),
}


class LSTMClassifier(nn.Module):
    """Embedding, ``nn.LSTM(batch_first=True)``, Linear head on the top layer's last output."""

    def __init__(self, config: LSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.embed)
        self.lstm = nn.LSTM(
            config.embed,
            config.hidden,
            num_layers=config.layers,
            batch_first=True,
            dropout=config.dropout if config.layers > 1 else 0.0,
        )
        self.head = nn.Linear(config.hidden, config.classes)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> class logits ``[B, classes]``."""
        out, _ = self.lstm(self.embedding(ids))
        return self.head(out[:, -1])


def make_batch(
    config: LSTMConfig, batch: int, seq: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Random labels ``y``; ``ids`` mix uniform noise with tokens of the label's vocab band."""
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    ids = class_band_tokens(y, seq, config.vocab, config.classes, generator)
    return (ids,), (y,)
