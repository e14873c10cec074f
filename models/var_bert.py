"""Variable-depth BERT (``var-bert``) and its fixed-depth counterpart (``fixed-bert``).

Owns :class:`DepthBERTConfig`, the named configs of both registry names (:data:`VAR_CONFIGS`:
``tiny``, ``small``, ``deep``; :data:`FIXED_CONFIGS`: ``tiny``, ``small``), the model
:class:`DepthBERT` and the synthetic batch generator :func:`make_batch`. Input ``ids[B, S]``
int64, target ``y[B]`` int64.

Path rule. A document is made of segments separated by the marker token ``vocab - 1``
(:func:`marker_token`). A sample with ``m`` markers has ``1 + m`` segments (capped at
``config.segments``) and runs the first ``segments_of_sample * layers_per_segment`` encoder
layers, ``layers_per_segment = layers // segments``: more segments, deeper encoder (the
"variable number of document segments" reading of var-BERT). The path is the tuple of layer
indices ``(0, 1, ..., depth - 1)``, computed from the marker count without running any layer.
``fixed-bert`` is the same model with ``segments == 1``: markers are ignored and every sample
runs all ``layers``.

Batch semantics: a batch shares one path. :func:`make_batch` draws one segment count per batch
and gives every row that many markers (at per-row random positions); :meth:`DepthBERT.path`
raises :class:`~models.dynamic_common.MixedPathError` on a batch whose rows disagree.

Target: the class-band token task of :mod:`models.bert` on the non-marker tokens, so the class
is learnable whatever the depth.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.bert import BERTBlock, class_band_tokens
from models.dynamic_common import Batch, shared_path
from models.gpt import check_transformer_config

__all__ = [
    "DepthBERTConfig",
    "DepthBERT",
    "VAR_CONFIGS",
    "FIXED_CONFIGS",
    "make_batch",
    "marker_token",
    "sample_depth",
]


@dataclass(frozen=True, kw_only=True)
class DepthBERTConfig:
    """Shape of a :class:`DepthBERT`. ``layers`` is the deepest path; ``segments`` the most
    segments a sample counts (``layers`` must be a multiple of it). ``seq`` is the default and
    maximum sequence length (the positional table)."""

    layers: int = 4
    segments: int = 4
    d_model: int = 32
    heads: int = 2
    vocab: int = 64
    seq: int = 16
    mlp_ratio: int = 4
    dropout: float = 0.0
    classes: int = 4

    def __post_init__(self) -> None:
        check_transformer_config(self)
        if self.segments < 1 or self.layers % self.segments != 0:
            raise ValueError(
                f"DepthBERTConfig.segments must be >= 1 and divide layers ({self.layers}), got {self.segments}"
            )
        if self.seq < self.segments:
            raise ValueError(f"DepthBERTConfig.seq ({self.seq}) must be >= segments ({self.segments})")
        if not 1 <= self.classes <= self.vocab - 1:
            raise ValueError(
                f"DepthBERTConfig.classes must be in [1, vocab - 1 = {self.vocab - 1}], got {self.classes}"
            )

    @property
    def layers_per_segment(self) -> int:
        """Encoder layers each segment adds to the path."""
        return self.layers // self.segments

    @property
    def dynamic(self) -> bool:
        """True when the depth depends on the sample (``segments > 1``)."""
        return self.segments > 1


VAR_CONFIGS: dict[str, DepthBERTConfig] = {
    "tiny": DepthBERTConfig(layers=4, segments=4, d_model=32, heads=2, vocab=64, seq=16, classes=4),
    "small": DepthBERTConfig(layers=12, segments=4, d_model=256, heads=4, vocab=512, seq=128, classes=8),
    # Capacity runs: many narrow layers (8 per segment, up to 64 deep), ~12.7M parameters.
    "deep": DepthBERTConfig(layers=64, segments=8, d_model=128, heads=4, vocab=256, seq=64, classes=8),
}

FIXED_CONFIGS: dict[str, DepthBERTConfig] = {
    "tiny": DepthBERTConfig(layers=4, segments=1, d_model=32, heads=2, vocab=64, seq=16, classes=4),
    "small": DepthBERTConfig(layers=12, segments=1, d_model=256, heads=4, vocab=512, seq=128, classes=8),
}


def marker_token(config: DepthBERTConfig) -> int:
    """The segment-marker token id (the last one of the vocabulary)."""
    return config.vocab - 1


def sample_depth(config: DepthBERTConfig, ids: torch.Tensor) -> torch.Tensor:
    """Per-row depth ``[B]`` int64: ``min(1 + #markers, segments) * layers_per_segment``."""
    markers = (ids == marker_token(config)).sum(dim=1)
    return torch.clamp(markers + 1, max=config.segments) * config.layers_per_segment


class DepthBERT(nn.Module):
    """BERT encoder that runs the first ``depth(sample)`` of its ``layers`` post-LN blocks.

    Embedding (token + position, LayerNorm) and the mean-pool classification head always run;
    the blocks are :attr:`layers` (one :class:`~models.bert.BERTBlock` each, ``x[B, S, D] ->
    x[B, S, D]``).
    """

    def __init__(self, config: DepthBERTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq, config.d_model)
        self.emb_ln = nn.LayerNorm(config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(BERTBlock(config) for _ in range(config.layers))
        self.head = nn.Linear(config.d_model, config.classes)

    def blocks(self) -> list[nn.Module]:
        """The encoder layers; path entries index this list."""
        return list(self.layers)

    def path(self, ids: torch.Tensor) -> tuple[int, ...]:
        """Layer indices the forward runs on batch ``ids[B, S]``: ``(0, ..., depth - 1)``."""
        self._check_ids(ids)
        depth = shared_path([(int(d),) for d in sample_depth(self.config, ids)], what="depth")[0]
        return tuple(range(depth))

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> class logits ``[B, classes]``."""
        path = self.path(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.emb_ln(self.tok_emb(ids) + self.pos_emb(positions)))
        for index in path:
            x = self.layers[index](x)
        return self.head(x.mean(dim=1))

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[0] < 1 or not 1 <= ids.shape[1] <= self.config.seq:
            raise ValueError(f"ids must be [B >= 1, 1 <= S <= {self.config.seq}], got {tuple(ids.shape)}")


def make_batch(config: DepthBERTConfig, batch: int, generator: torch.Generator, *, key: int | None = None) -> Batch:
    """``(ids,), (y,)`` of ``config.seq`` tokens; every row has ``key`` segments (``key - 1``
    markers at random positions), ``key`` drawn uniformly from ``[1, segments]`` when None."""
    if key is None:
        key = int(torch.randint(1, config.segments + 1, (1,), generator=generator))
    if not 1 <= key <= config.segments:
        raise ValueError(f"key (segments) must be in [1, {config.segments}], got {key}")
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    ids = class_band_tokens(y, config.seq, config.vocab - 1, config.classes, generator)
    positions = torch.rand(batch, config.seq, generator=generator).argsort(dim=1)[:, : key - 1]
    ids.scatter_(1, positions, marker_token(config))
    return (ids,), (y,)
