"""MLP classifier: a Linear/ReLU stack trained with cross-entropy.

Owns the MLP config, its named configs (``tiny``, ``small``), the module and the synthetic
batch generator. Inputs ``x[B, in_features]`` float32, target ``y[B]`` int64. The targets are
the argmax of a fixed random linear "teacher" applied to ``x``, so the task is learnable.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["MLPConfig", "MLP", "CONFIGS", "make_batch"]

TEACHER_SEED = 1_000_003
"""Seed of the fixed teacher that labels the synthetic data (independent of the batch seed)."""


@dataclass(frozen=True, kw_only=True)
class MLPConfig:
    """Shape of an :class:`MLP`."""

    in_features: int = 32
    hidden: int = 128
    layers: int = 2  # hidden Linear/ReLU layers
    classes: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        for name in ("in_features", "hidden", "layers", "classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"MLPConfig.{name} must be >= 1, got {getattr(self, name)}")
        if not 0.0 <= self.dropout < 1.0:
            raise ValueError(f"MLPConfig.dropout must be in [0, 1), got {self.dropout}")


CONFIGS: dict[str, MLPConfig] = {
    "tiny": MLPConfig(in_features=32, hidden=128, layers=2, classes=4),
    "small": MLPConfig(in_features=256, hidden=1024, layers=4, classes=10),
}


class MLP(nn.Module):
    """``layers`` blocks of Linear -> ReLU (-> Dropout), then a Linear head producing logits."""

    def __init__(self, config: MLPConfig) -> None:
        super().__init__()
        self.config = config
        widths = [config.in_features] + [config.hidden] * config.layers
        self.layers = nn.ModuleList(
            nn.Sequential(nn.Linear(w_in, w_out), nn.ReLU(), nn.Dropout(config.dropout))
            for w_in, w_out in zip(widths[:-1], widths[1:])
        )
        self.head = nn.Linear(widths[-1], config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def make_batch(
    config: MLPConfig, batch: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``x ~ N(0, 1)``; ``y = argmax(x @ W_teacher)`` with a teacher fixed per config shape."""
    teacher_gen = torch.Generator().manual_seed(TEACHER_SEED)
    teacher = torch.randn(config.in_features, config.classes, generator=teacher_gen)
    x = torch.randn(batch, config.in_features, generator=generator)
    y = (x @ teacher).argmax(dim=1)
    return (x,), (y,)
