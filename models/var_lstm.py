"""Step-unrolled LSTM classifier: variable length (``var-lstm``) and fixed length (``fixed-lstm``).

Owns :class:`StepLSTMConfig`, the named configs of both registry names (:data:`VAR_CONFIGS`,
:data:`FIXED_CONFIGS`: ``tiny``, ``small``), the block :class:`LSTMStep`, the model
:class:`StepLSTM` and the synthetic batch generator :func:`make_batch`. Input ``ids[B, S]``
int64, target ``y[B]`` int64.

The forward unrolls the recurrence in Python: for each time step ``t`` and layer ``l`` it calls
block ``l`` (an :class:`LSTMStep`, ``(x, h, c) -> (h, c)``). The path is
``(0, 1, ..., layers - 1)`` repeated ``S`` times: its length is the sample's sequence length.
``var-lstm`` takes any ``S`` in ``[min_seq, seq]``; ``fixed-lstm`` (``min_seq == seq``) only
``S == seq``, so its path never changes.

Batch semantics: a batch shares one length (length bucketing, no padding); :func:`make_batch`
draws one length per batch. Target: the class-band token task of :mod:`models.bert`, read from
the top layer's last hidden state.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.bert import class_band_tokens
from models.dynamic_common import Batch

__all__ = ["StepLSTMConfig", "StepLSTM", "LSTMStep", "VAR_CONFIGS", "FIXED_CONFIGS", "make_batch"]


@dataclass(frozen=True, kw_only=True)
class StepLSTMConfig:
    """Shape of a :class:`StepLSTM`; sequences have ``min_seq..seq`` tokens (``seq`` is the
    default and longest length)."""

    layers: int = 1
    embed: int = 32
    hidden: int = 32
    vocab: int = 64
    min_seq: int = 4
    seq: int = 12
    classes: int = 4

    def __post_init__(self) -> None:
        for name in ("layers", "embed", "hidden", "vocab", "min_seq", "classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"StepLSTMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.seq < self.min_seq:
            raise ValueError(f"StepLSTMConfig.seq ({self.seq}) must be >= min_seq ({self.min_seq})")
        if self.classes > self.vocab:
            raise ValueError(f"StepLSTMConfig.classes must be <= vocab={self.vocab}, got {self.classes}")

    @property
    def dynamic(self) -> bool:
        """True when the length (and so the path) varies between batches."""
        return self.min_seq < self.seq


VAR_CONFIGS: dict[str, StepLSTMConfig] = {
    "tiny": StepLSTMConfig(layers=1, embed=32, hidden=32, vocab=64, min_seq=4, seq=12, classes=4),
    "small": StepLSTMConfig(layers=2, embed=128, hidden=256, vocab=512, min_seq=16, seq=128, classes=8),
}

FIXED_CONFIGS: dict[str, StepLSTMConfig] = {
    "tiny": StepLSTMConfig(layers=1, embed=32, hidden=32, vocab=64, min_seq=8, seq=8, classes=4),
    "small": StepLSTMConfig(layers=2, embed=128, hidden=256, vocab=512, min_seq=64, seq=64, classes=8),
}


class LSTMStep(nn.Module):
    """One LSTM layer for one time step: ``(x[B, I], h[B, H], c[B, H]) -> (h, c)``."""

    def __init__(self, inputs: int, hidden: int) -> None:
        super().__init__()
        self.cell = nn.LSTMCell(inputs, hidden)

    def forward(self, x: torch.Tensor, h: torch.Tensor, c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cell(x, (h, c))


class StepLSTM(nn.Module):
    """Embedding, ``layers`` :class:`LSTMStep` blocks unrolled over the sequence, Linear head."""

    def __init__(self, config: StepLSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.embed)
        self.steps = nn.ModuleList(
            LSTMStep(config.embed if layer == 0 else config.hidden, config.hidden) for layer in range(config.layers)
        )
        self.head = nn.Linear(config.hidden, config.classes)

    def blocks(self) -> list[nn.Module]:
        """One :class:`LSTMStep` per layer; path entries index this list."""
        return list(self.steps)

    def path(self, ids: torch.Tensor) -> tuple[int, ...]:
        """``(0, ..., layers - 1)`` once per time step of ``ids[B, S]``."""
        if ids.dim() != 2 or ids.shape[0] < 1 or not self.config.min_seq <= ids.shape[1] <= self.config.seq:
            raise ValueError(
                f"ids must be [B >= 1, {self.config.min_seq} <= S <= {self.config.seq}], got {tuple(ids.shape)}"
            )
        return tuple(range(self.config.layers)) * ids.shape[1]

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> class logits ``[B, classes]``."""
        path = self.path(ids)
        embedded = self.embedding(ids)
        batch, hidden = ids.shape[0], self.config.hidden
        h = [embedded.new_zeros(batch, hidden) for _ in self.steps]
        c = [embedded.new_zeros(batch, hidden) for _ in self.steps]
        for position, layer in enumerate(path):
            x = embedded[:, position // self.config.layers] if layer == 0 else h[layer - 1]
            h[layer], c[layer] = self.steps[layer](x, h[layer], c[layer])
        return self.head(h[-1])


def make_batch(config: StepLSTMConfig, batch: int, generator: torch.Generator, *, key: int | None = None) -> Batch:
    """``(ids,), (y,)`` of length ``key`` (uniform in ``[min_seq, seq]`` when None)."""
    if key is None:
        key = int(torch.randint(config.min_seq, config.seq + 1, (1,), generator=generator))
    if not config.min_seq <= key <= config.seq:
        raise ValueError(f"key (length) must be in [{config.min_seq}, {config.seq}], got {key}")
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    return (class_band_tokens(y, key, config.vocab, config.classes, generator),), (y,)
