"""Binary Tree-LSTM (``tree-lstm``) over bracketed token sequences.

Owns :class:`TreeLSTMConfig`, its named configs (``tiny``, ``small``), the bracket parser
(:func:`parse_tree`), the cells (:class:`LeafCell`, :class:`ComposeCell`), the model
:class:`TreeLSTM` and the synthetic batch generator :func:`make_batch`. Input ``ids[B, S]``
int64, target ``y[B]`` int64.

Trees from the sample. Token ``vocab - 2`` opens a bracket and ``vocab - 1`` closes one
(:func:`bracket_tokens`); every other token is a word. The grammar is
``T := word | OPEN T T CLOSE``, so ``( ( a b ) c )`` is the binary tree ``((a, b), c)``. The
forward evaluates the tree bottom-up in post-order (the order of the tokens): a word runs the
leaf cell on its embedding, a closing bracket runs the compose cell on the two subtrees it
closes (binary Tree-LSTM, separate forget gates per child). The head classifies the root.

Blocks and path. ``blocks() == [leaf_cell, compose_cell]``; the path is the sequence of cell
invocations, ``0`` per word and ``1`` per closing bracket, in token order: ``( ( a b ) c )``
gives ``(0, 0, 1, 0, 1)``. It depends on the sample only through its bracket structure.

Batch semantics: a batch shares one tree shape (same brackets at the same positions, different
words); :func:`make_batch` draws one random binary tree per batch, and
:meth:`TreeLSTM.path` raises :class:`~models.dynamic_common.MixedPathError` when rows differ.
Each cell invocation thus runs on ``[B, ...]`` tensors.

Target: the class-band token task of :mod:`models.bert` on the words (leaves).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from models.bert import class_band_tokens
from models.dynamic_common import Batch, shared_path

__all__ = [
    "TreeLSTMConfig",
    "TreeLSTM",
    "LeafCell",
    "ComposeCell",
    "CONFIGS",
    "LEAF",
    "COMPOSE",
    "bracket_tokens",
    "parse_tree",
    "random_tree_template",
    "make_batch",
]

LEAF = 0
"""Index of the leaf cell in ``TreeLSTM.blocks()`` (one invocation per word)."""
COMPOSE = 1
"""Index of the compose cell in ``TreeLSTM.blocks()`` (one invocation per closing bracket)."""

_WORD = -1  # a word slot in a tree template


@dataclass(frozen=True, kw_only=True)
class TreeLSTMConfig:
    """Shape of a :class:`TreeLSTM`; generated trees have ``min_leaves..max_leaves`` words."""

    embed: int = 32
    hidden: int = 32
    vocab: int = 64
    min_leaves: int = 2
    max_leaves: int = 8
    classes: int = 4

    def __post_init__(self) -> None:
        for name in ("embed", "hidden", "vocab", "min_leaves", "classes"):
            if getattr(self, name) < 1:
                raise ValueError(f"TreeLSTMConfig.{name} must be >= 1, got {getattr(self, name)}")
        if self.max_leaves < self.min_leaves:
            raise ValueError(
                f"TreeLSTMConfig.max_leaves ({self.max_leaves}) must be >= min_leaves ({self.min_leaves})"
            )
        if not self.classes <= self.vocab - 2:
            raise ValueError(f"TreeLSTMConfig.classes must be <= vocab - 2 = {self.vocab - 2}, got {self.classes}")

    @property
    def seq(self) -> int:
        """Tokens of the largest generated tree (``max_leaves`` words, ``max_leaves - 1`` bracket pairs)."""
        return 3 * self.max_leaves - 2


CONFIGS: dict[str, TreeLSTMConfig] = {
    "tiny": TreeLSTMConfig(embed=32, hidden=32, vocab=64, min_leaves=2, max_leaves=8, classes=4),
    "small": TreeLSTMConfig(embed=128, hidden=256, vocab=512, min_leaves=4, max_leaves=32, classes=8),
}


def bracket_tokens(config: TreeLSTMConfig) -> tuple[int, int]:
    """``(open, close)`` token ids: the last two of the vocabulary."""
    return config.vocab - 2, config.vocab - 1


def parse_tree(tokens: list[int], *, open_token: int, close_token: int) -> tuple[int, ...]:
    """Post-order cell sequence of a bracketed token list (:data:`LEAF` per word,
    :data:`COMPOSE` per closing bracket). Raises ``ValueError`` unless ``tokens`` is exactly one
    tree of the grammar ``T := word | OPEN T T CLOSE``."""
    path: list[int] = []
    stack = 0  # subtrees built and not yet composed
    opens: list[int] = []  # stack height at each unclosed OPEN
    for position, token in enumerate(tokens):
        if token == open_token:
            opens.append(stack)
        elif token == close_token:
            if not opens or stack != opens.pop() + 2:
                raise ValueError(f"malformed tree: CLOSE at {position} does not close exactly two subtrees")
            stack -= 1
            path.append(COMPOSE)
        else:
            stack += 1
            path.append(LEAF)
        if stack > (opens[-1] + 2 if opens else 1):
            raise ValueError(f"malformed tree: token {position} starts a subtree outside any bracket")
    if opens or stack != 1:
        raise ValueError("malformed tree: unclosed bracket or empty input")
    return tuple(path)


class LeafCell(nn.Module):
    """Tree-LSTM leaf: ``x[B, E] -> (h, c)[B, H]`` with ``c = i * u``, ``h = o * tanh(c)``."""

    def __init__(self, config: TreeLSTMConfig) -> None:
        super().__init__()
        self.gates = nn.Linear(config.embed, 3 * config.hidden)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        i, o, u = self.gates(x).chunk(3, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u)
        return torch.sigmoid(o) * torch.tanh(c), c


class ComposeCell(nn.Module):
    """Binary Tree-LSTM node: ``(h_l, c_l, h_r, c_r)[B, H] -> (h, c)[B, H]`` with a forget gate
    per child: ``c = i * u + f_l * c_l + f_r * c_r``, ``h = o * tanh(c)``."""

    def __init__(self, config: TreeLSTMConfig) -> None:
        super().__init__()
        self.gates = nn.Linear(2 * config.hidden, 5 * config.hidden)

    def forward(
        self, h_left: torch.Tensor, c_left: torch.Tensor, h_right: torch.Tensor, c_right: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        i, f_left, f_right, o, u = self.gates(torch.cat([h_left, h_right], dim=-1)).chunk(5, dim=-1)
        c = torch.sigmoid(i) * torch.tanh(u) + torch.sigmoid(f_left) * c_left + torch.sigmoid(f_right) * c_right
        return torch.sigmoid(o) * torch.tanh(c), c


class TreeLSTM(nn.Module):
    """Word embedding, leaf and compose cells over the sample's tree, Linear head on the root."""

    def __init__(self, config: TreeLSTMConfig) -> None:
        super().__init__()
        self.config = config
        self.embedding = nn.Embedding(config.vocab, config.embed)
        self.cells = nn.ModuleList([LeafCell(config), ComposeCell(config)])
        self.head = nn.Linear(config.hidden, config.classes)

    def blocks(self) -> list[nn.Module]:
        """``[leaf_cell, compose_cell]`` (indices :data:`LEAF`, :data:`COMPOSE`)."""
        return list(self.cells)

    def path(self, ids: torch.Tensor) -> tuple[int, ...]:
        """Cell invocations of the forward on ``ids[B, S]`` (see the module docstring)."""
        if ids.dim() != 2 or ids.shape[0] < 1:
            raise ValueError(f"ids must be [B >= 1, S], got {tuple(ids.shape)}")
        open_token, close_token = bracket_tokens(self.config)
        structure = torch.where((ids == open_token) | (ids == close_token), ids, -1)
        rows = [tuple(row) for row in structure.tolist()]
        template = shared_path(rows, what="bracket structure")
        return parse_tree(list(template), open_token=open_token, close_token=close_token)

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """``ids[B, S]`` int64 (one tree per row, shared shape) -> class logits ``[B, classes]``."""
        path = self.path(ids)
        open_token, _ = bracket_tokens(self.config)
        words = [p for p, token in enumerate(ids[0].tolist()) if token < open_token]
        embedded = self.embedding(ids)
        leaf, compose = self.cells
        stack: list[tuple[torch.Tensor, torch.Tensor]] = []
        next_word = iter(words)
        for cell in path:
            if cell == LEAF:
                stack.append(leaf(embedded[:, next(next_word)]))
            else:
                h_right, c_right = stack.pop()
                h_left, c_left = stack.pop()
                stack.append(compose(h_left, c_left, h_right, c_right))
        (h_root, _), = stack
        return self.head(h_root)


def random_tree_template(leaves: int, generator: torch.Generator) -> list[int]:
    """Bracketed template of a random binary tree with ``leaves`` words: OPEN/CLOSE are
    ``-2``/``-3``, a word slot is ``-1``. Split points are uniform at every node."""

    def build(n: int) -> list[int]:
        if n == 1:
            return [_WORD]
        left = int(torch.randint(1, n, (1,), generator=generator))
        return [-2, *build(left), *build(n - left), -3]

    return build(leaves)


def make_batch(config: TreeLSTMConfig, batch: int, generator: torch.Generator, *, key: int | None = None) -> Batch:
    """``(ids,), (y,)``: one random tree of ``key`` leaves (uniform in ``[min_leaves,
    max_leaves]`` when None) shared by the batch, words from the label's class band."""
    if key is None:
        key = int(torch.randint(config.min_leaves, config.max_leaves + 1, (1,), generator=generator))
    if not config.min_leaves <= key <= config.max_leaves:
        raise ValueError(f"key (leaves) must be in [{config.min_leaves}, {config.max_leaves}], got {key}")
    template = torch.tensor(random_tree_template(key, generator))
    y = torch.randint(0, config.classes, (batch,), generator=generator)
    words = class_band_tokens(y, key, config.vocab - 2, config.classes, generator)
    open_token, close_token = bracket_tokens(config)
    ids = torch.empty(batch, len(template), dtype=torch.int64)
    ids[:, template == -2] = open_token
    ids[:, template == -3] = close_token
    ids[:, template == _WORD] = words
    return (ids,), (y,)
