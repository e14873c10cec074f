"""Mixture-of-experts transformer encoder (``moe``): top-1 expert per sample, rule-routed.

Owns :class:`MoEConfig`, its named configs (``tiny``, ``small``), the blocks
(:class:`AttentionBlock`, :class:`ExpertBlock`), the model :class:`MoETransformer` and the
synthetic batch generator :func:`make_batch`. Input ``ids[B, S]`` int64, target ``y[B]`` int64.

Routing. The last ``experts`` token ids of the vocabulary are domain tokens, one per expert
(:func:`domain_tokens`). A sample's expert is the one whose domain token occurs most often in it
(ties to the lower index; no domain token: expert 0). Routing is a deterministic function of the
tokens, as in hash-routed MoE layers, not a learned gate: a gate's choice would drift with its
parameters during training, whereas this rule gives every sample a fixed path that a predictor
can learn from token counts. Each of the ``layers`` layers is a shared attention block followed
by that layer's expert for the sample (pre-LN, ``x + mlp_e(ln(x))``).

Blocks and path. ``blocks()`` lists, per layer ``l``, the attention block then the layer's
``experts`` expert blocks: attention of layer ``l`` is index ``l * (experts + 1)``, expert ``e``
of layer ``l`` is ``l * (experts + 1) + 1 + e``. The path is ``(attn_0, expert_0_e, attn_1,
expert_1_e, ...)`` for the sample's expert ``e``.

Batch semantics: a batch shares one expert. :func:`make_batch` draws one expert per batch and
puts its domain token at a few random positions of every row, plus one distractor domain token
of another expert (so the rule is "most frequent", not "present"); :meth:`MoETransformer.path`
raises :class:`~models.dynamic_common.MixedPathError` when rows route differently.

Target: the class-band token task of :mod:`models.bert` on the non-domain tokens.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.bert import class_band_tokens
from models.dynamic_common import Batch, shared_path
from models.gpt import SelfAttention, check_transformer_config, feed_forward

__all__ = [
    "MoEConfig",
    "MoETransformer",
    "AttentionBlock",
    "ExpertBlock",
    "CONFIGS",
    "DOMAIN_REPEATS",
    "make_batch",
    "domain_tokens",
    "route",
]

DOMAIN_REPEATS = 3
"""How many copies of its expert's domain token each generated row carries."""


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """Shape of a :class:`MoETransformer`. ``seq`` is the default and maximum sequence length."""

    layers: int = 2
    experts: int = 4
    d_model: int = 32
    heads: int = 2
    vocab: int = 64
    seq: int = 16
    mlp_ratio: int = 4
    dropout: float = 0.0
    classes: int = 4

    def __post_init__(self) -> None:
        check_transformer_config(self)
        if self.experts < 1:
            raise ValueError(f"MoEConfig.experts must be >= 1, got {self.experts}")
        if self.seq < DOMAIN_REPEATS + 1:
            raise ValueError(f"MoEConfig.seq must be >= {DOMAIN_REPEATS + 1}, got {self.seq}")
        words = self.vocab - self.experts
        if not 1 <= self.classes <= words:
            raise ValueError(
                f"MoEConfig.classes must be in [1, vocab - experts = {words}], got {self.classes}"
            )


CONFIGS: dict[str, MoEConfig] = {
    "tiny": MoEConfig(layers=2, experts=4, d_model=32, heads=2, vocab=64, seq=16, classes=4),
    "small": MoEConfig(layers=4, experts=8, d_model=256, heads=4, vocab=512, seq=128, classes=8),
}


def domain_tokens(config: MoEConfig) -> range:
    """Token ids of the experts' domain tokens: expert ``e`` is ``vocab - experts + e``."""
    return range(config.vocab - config.experts, config.vocab)


def route(config: MoEConfig, ids: torch.Tensor) -> torch.Tensor:
    """Per-row expert ``[B]`` int64: the most frequent domain token (ties: lowest expert)."""
    first = config.vocab - config.experts
    offsets = ids - first
    is_domain = offsets >= 0
    counts = torch.zeros(ids.shape[0], config.experts, dtype=torch.int64, device=ids.device)
    counts.scatter_add_(1, offsets.clamp(min=0), is_domain.to(torch.int64))
    return counts.argmax(dim=1)  # argmax returns the first maximal index


class AttentionBlock(nn.Module):
    """Pre-LN self-attention sublayer: ``x + attn(ln(x))``, ``x[B, S, D] -> x[B, S, D]``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config.d_model, config.heads, causal=False, dropout=config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.attn(self.ln(x))


class ExpertBlock(nn.Module):
    """Pre-LN expert feed-forward sublayer: ``x + mlp(ln(x))``, ``x[B, S, D] -> x[B, S, D]``."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.ln = nn.LayerNorm(config.d_model)
        self.mlp = feed_forward(config.d_model, config.mlp_ratio, config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + self.mlp(self.ln(x))


class MoETransformer(nn.Module):
    """Embedding, ``layers`` x (attention, routed expert), final LN, mean-pool head."""

    def __init__(self, config: MoEConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.attention = nn.ModuleList(AttentionBlock(config) for _ in range(config.layers))
        self.experts = nn.ModuleList(
            nn.ModuleList(ExpertBlock(config) for _ in range(config.experts)) for _ in range(config.layers)
        )
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.classes)

    def blocks(self) -> list[nn.Module]:
        """Per layer: its attention block, then its experts (see the module docstring)."""
        out: list[nn.Module] = []
        for attention, experts in zip(self.attention, self.experts):
            out.append(attention)
            out.extend(experts)
        return out

    def expert_of(self, ids: torch.Tensor) -> int:
        """The expert every row of ``ids[B, S]`` routes to; MixedPathError if rows differ."""
        self._check_ids(ids)
        return shared_path([int(e) for e in route(self.config, ids)], what="expert")

    def path(self, ids: torch.Tensor) -> tuple[int, ...]:
        """Block indices of the forward on ``ids[B, S]``: attention, expert, per layer."""
        expert = self.expert_of(ids)
        stride = self.config.experts + 1
        return tuple(
            index for layer in range(self.config.layers) for index in (layer * stride, layer * stride + 1 + expert)
        )

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> class logits ``[B, classes]``."""
        expert = self.expert_of(ids)
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(positions))
        for attention, experts in zip(self.attention, self.experts):
            x = experts[expert](attention(x))
        return self.head(self.ln_f(x).mean(dim=1))

    def _check_ids(self, ids: torch.Tensor) -> None:
        if ids.dim() != 2 or ids.shape[0] < 1 or not 1 <= ids.shape[1] <= self.config.seq:
            raise ValueError(f"ids must be [B >= 1, 1 <= S <= {self.config.seq}], got {tuple(ids.shape)}")


def make_batch(config: MoEConfig, batch: int, generator: torch.Generator, *, key: int | None = None) -> Batch:
    """``(ids,), (y,)`` of ``config.seq`` tokens routed to expert ``key`` (drawn uniformly
    when None): :data:`DOMAIN_REPEATS` copies of its domain token and, with more than one
    expert, one copy of another expert's, at random positions of each row."""
    if key is None:
        key = int(torch.randint(0, config.experts, (1,), generator=generator))
    if not 0 <= key < config.experts:
        raise ValueError(f"key (expert) must be in [0, {config.experts}), got {key}")
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    ids = class_band_tokens(y, config.seq, config.vocab - config.experts, config.classes, generator)
    slots = torch.rand(batch, config.seq, generator=generator).argsort(dim=1)
    first = config.vocab - config.experts
    ids.scatter_(1, slots[:, :DOMAIN_REPEATS], first + key)
    if config.experts > 1:
        shift = torch.randint(1, config.experts, (batch, 1), generator=generator)
        distractor = first + (key + shift) % config.experts
        ids.scatter_(1, slots[:, DOMAIN_REPEATS : DOMAIN_REPEATS + 1], distractor)
    return (ids,), (y,)
