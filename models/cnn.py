"""ResNet-style CNN image classifier with BatchNorm.

Owns the CNN config, its named configs (``tiny``, ``small``, ``medium``), the residual block and model, and
the synthetic batch generator. Input ``x[B, in_channels, H, W]`` float32, target ``y[B]`` int64.
Only the batch axis is dynamic.

Layout: conv-bn-relu stem at ``channels``; ``layers`` basic residual blocks in
``self.layers`` — the first ``layers // 2`` keep ``channels`` at full resolution, the next one
halves the resolution (stride 2) and doubles the width with a 1x1 projection shortcut, the rest
keep that; global average pooling; Linear classifier. Ops used: Conv2d, BatchNorm2d, ReLU,
AdaptiveAvgPool2d, Linear and tensor addition.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["CNNConfig", "CNN", "BasicBlock", "CONFIGS", "make_batch"]

TEACHER_SEED = 1_000_033
"""Seed of the fixed per-class colours of the synthetic images (independent of the batch seed)."""


@dataclass(frozen=True, kw_only=True)
class CNNConfig:
    """Shape of a :class:`CNN`."""

    layers: int = 3  # residual basic blocks
    channels: int = 8  # stem width; doubled by the stride-2 block
    image_size: int = 16  # H == W
    in_channels: int = 3
    classes: int = 10

    def __post_init__(self) -> None:
        for name in ("layers", "channels", "in_channels", "classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"CNNConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.image_size < 2:
            raise ValueError(f"CNNConfig.image_size must be >= 2, got {self.image_size}")


CONFIGS: dict[str, CNNConfig] = {
    "tiny": CNNConfig(layers=3, channels=8, image_size=16, classes=10),
    "small": CNNConfig(layers=4, channels=32, image_size=32, classes=10),
    # GPU-sized: wide residual blocks on 64x64 images.
    "medium": CNNConfig(layers=8, channels=128, image_size=64, classes=100),
}


def conv_bn(c_in: int, c_out: int, *, kernel: int, stride: int) -> nn.Sequential:
    """Conv2d (no bias, 'same'-style padding) followed by BatchNorm2d."""
    return nn.Sequential(
        nn.Conv2d(c_in, c_out, kernel, stride=stride, padding=kernel // 2, bias=False),
        nn.BatchNorm2d(c_out),
    )


class BasicBlock(nn.Module):
    """``relu(bn(conv(relu(bn(conv(x))))) + shortcut(x))``; 1x1 conv-bn shortcut when the
    shape changes, identity otherwise."""

    def __init__(self, c_in: int, c_out: int, *, stride: int) -> None:
        super().__init__()
        self.conv1 = conv_bn(c_in, c_out, kernel=3, stride=stride)
        self.relu1 = nn.ReLU()
        self.conv2 = conv_bn(c_out, c_out, kernel=3, stride=1)
        self.shortcut = (
            conv_bn(c_in, c_out, kernel=1, stride=stride) if stride != 1 or c_in != c_out else nn.Identity()
        )
        self.relu2 = nn.ReLU()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = self.conv2(self.relu1(self.conv1(x)))
        return self.relu2(y + self.shortcut(x))


class CNN(nn.Module):
    """Stem, residual blocks in ``self.layers``, global average pool, Linear classifier."""

    def __init__(self, config: CNNConfig) -> None:
        super().__init__()
        self.config = config
        width = config.channels
        self.stem = nn.Sequential(conv_bn(config.in_channels, width, kernel=3, stride=1), nn.ReLU())
        blocks = []
        first_stage = config.layers // 2
        for index in range(config.layers):
            if index == first_stage:
                blocks.append(BasicBlock(width, 2 * width, stride=2))
                width *= 2
            else:
                blocks.append(BasicBlock(width, width, stride=1))
        self.layers = nn.ModuleList(blocks)
        self.pool = nn.AdaptiveAvgPool2d(1)
        self.head = nn.Linear(width, config.classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        """``x[B, C, H, W]`` float32 -> class logits ``[B, classes]``."""
        x = self.stem(x)
        for layer in self.layers:
            x = layer(x)
        return self.head(torch.flatten(self.pool(x), 1))


def make_batch(
    config: CNNConfig, batch: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """Random labels ``y``; ``x`` = Gaussian noise plus a fixed per-class colour and a
    per-class horizontal gradient direction, so the class is learnable."""
    size = config.image_size
    teacher_gen = torch.Generator().manual_seed(TEACHER_SEED)
    colours = torch.randn(config.classes, config.in_channels, generator=teacher_gen)
    slopes = torch.randn(config.classes, generator=teacher_gen)
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    ramp = torch.linspace(-1.0, 1.0, size).view(1, 1, 1, size)
    pattern = colours[y].view(batch, config.in_channels, 1, 1) + slopes[y].view(batch, 1, 1, 1) * ramp
    x = pattern + torch.randn(batch, config.in_channels, size, size, generator=generator)
    return (x,), (y,)
