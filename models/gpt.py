"""GPT-style decoder language model (pre-LN transformer, causal attention).

Owns the GPT config, its named configs (``tiny``, ``small``, ``medium``), the modules (attention, block,
model), the next-token loss and the synthetic batch generator. Input ``ids[B, S]`` int64,
target ``targets[B, S]`` int64 (the input shifted by one token). The sequence axis is dynamic
up to ``config.seq``: positions come from ``torch.arange(S)``.

Attention is written with a Linear qkv projection and ``F.scaled_dot_product_attention`` (no
``nn.MultiheadAttention``) so the model exports cleanly through ``torch.export``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "GPTConfig",
    "GPT",
    "GPTBlock",
    "SelfAttention",
    "CONFIGS",
    "lm_loss",
    "make_batch",
    "check_transformer_config",
    "structured_token_sequences",
]


def check_transformer_config(cfg: Any) -> None:
    """Validate the fields shared by the transformer configs (GPT and BERT)."""
    cls_name = type(cfg).__name__
    for name in ("layers", "d_model", "heads", "vocab", "seq", "mlp_ratio"):
        value = getattr(cfg, name)
        if value < 1:
            raise ValueError(f"{cls_name}.{name} must be >= 1, got {value}")
    if cfg.d_model % cfg.heads != 0:
        raise ValueError(f"{cls_name}.d_model ({cfg.d_model}) must be divisible by heads ({cfg.heads})")
    if not 0.0 <= cfg.dropout < 1.0:
        raise ValueError(f"{cls_name}.dropout must be in [0, 1), got {cfg.dropout}")


@dataclass(frozen=True, kw_only=True)
class GPTConfig:
    """Shape of a :class:`GPT`. ``seq`` is the default and maximum sequence length."""

    layers: int = 2
    d_model: int = 32
    heads: int = 2
    vocab: int = 64
    seq: int = 16
    mlp_ratio: int = 4
    dropout: float = 0.0

    def __post_init__(self) -> None:
        check_transformer_config(self)


CONFIGS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(layers=2, d_model=32, heads=2, vocab=64, seq=16),
    "small": GPTConfig(layers=4, d_model=256, heads=4, vocab=512, seq=128),
    # GPU-sized: steps compute-bound on an H100 (~92M parameters with embeddings).
    "medium": GPTConfig(layers=12, d_model=768, heads=12, vocab=8192, seq=512),
}


class SelfAttention(nn.Module):
    """Multi-head self-attention: Linear qkv -> SDPA -> Linear output projection."""

    def __init__(self, d_model: int, heads: int, *, causal: bool, dropout: float = 0.0) -> None:
        super().__init__()
        self.heads = heads
        self.causal = causal
        self.qkv = nn.Linear(d_model, 3 * d_model)
        self.proj = nn.Linear(d_model, d_model)
        self.dropout = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, d_model = x.shape
        head_dim = d_model // self.heads
        qkv = self.qkv(x).view(batch, seq, 3, self.heads, head_dim)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)  # each [B, H, S, Dh]
        y = F.scaled_dot_product_attention(q, k, v, is_causal=self.causal)
        y = y.transpose(1, 2).reshape(batch, seq, d_model)
        return self.dropout(self.proj(y))


def feed_forward(d_model: int, mlp_ratio: int, dropout: float) -> nn.Sequential:
    """Transformer MLP: Linear -> GELU -> Linear -> Dropout."""
    return nn.Sequential(
        nn.Linear(d_model, mlp_ratio * d_model),
        nn.GELU(),
        nn.Linear(mlp_ratio * d_model, d_model),
        nn.Dropout(dropout),
    )


class GPTBlock(nn.Module):
    """Pre-LN decoder block: ``x + attn(ln1(x))`` then ``x + mlp(ln2(x))``."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(config.d_model)
        self.attn = SelfAttention(config.d_model, config.heads, causal=True, dropout=config.dropout)
        self.ln2 = nn.LayerNorm(config.d_model)
        self.mlp = feed_forward(config.d_model, config.mlp_ratio, config.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    """Token + learned positional embedding, ``layers`` pre-LN blocks, final LN, LM head."""

    def __init__(self, config: GPTConfig) -> None:
        super().__init__()
        self.config = config
        self.tok_emb = nn.Embedding(config.vocab, config.d_model)
        self.pos_emb = nn.Embedding(config.seq, config.d_model)
        self.drop = nn.Dropout(config.dropout)
        self.layers = nn.ModuleList(GPTBlock(config) for _ in range(config.layers))
        self.ln_f = nn.LayerNorm(config.d_model)
        self.head = nn.Linear(config.d_model, config.vocab)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 -> logits ``[B, S, vocab]``."""
        positions = torch.arange(ids.shape[1], device=ids.device)
        x = self.drop(self.tok_emb(ids) + self.pos_emb(positions))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.ln_f(x))


def lm_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits[B, S, V]`` against next tokens ``targets[B, S]``."""
    return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))


def structured_token_sequences(
    batch: int, length: int, vocab: int, generator: torch.Generator
) -> torch.Tensor:
    """Arithmetic token sequences ``(start + i * stride) % vocab``, stride in 1..4 per row.

    Every token after the second is determined by the two before it, so a model can learn
    next-token prediction from context.
    """
    start = torch.randint(0, vocab, (batch, 1), generator=generator)
    stride = torch.randint(1, 5, (batch, 1), generator=generator)
    return (start + stride * torch.arange(length).unsqueeze(0)) % vocab


def make_batch(
    config: GPTConfig, batch: int, seq: int, generator: torch.Generator
) -> tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]:
    """``ids = tokens[:, :-1]``, ``targets = tokens[:, 1:]`` of arithmetic sequences."""
    tokens = structured_token_sequences(batch, seq + 1, config.vocab, generator)
    return (tokens[:, :-1].contiguous(),), (tokens[:, 1:].contiguous(),)
