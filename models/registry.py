"""Model registry: names -> (config class, named configs, builder, loss, synthetic batches).

Owns :class:`ModelSpec` (everything a trainer, exporter or benchmark needs to run a model),
:func:`get_model`, :func:`list_models`, :func:`list_configs` and :class:`UnknownModelError`.
Each model module (``models.mlp``, ``models.gpt``, ...) owns its own config dataclass,
``CONFIGS`` table, module class and batch generator; this module only wires them together.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from models import bert, cnn, gpt, lstm, mlp

__all__ = [
    "ModelSpec",
    "UnknownModelError",
    "classification_loss",
    "get_model",
    "list_configs",
    "list_models",
]

Batch = tuple[tuple[torch.Tensor, ...], tuple[torch.Tensor, ...]]

CUSTOM_CONFIG_NAME = "custom"
"""``ModelSpec.config_name`` of a model whose overrides changed its named config."""


class UnknownModelError(ValueError):
    """A model name or config name that the registry does not know."""


def classification_loss(logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``logits[B, C]`` against class indices ``y[B]``."""
    return F.cross_entropy(logits, y)


@dataclass(frozen=True, kw_only=True)
class _ModelEntry:
    """How the registry builds one model family."""

    configs: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    loss_fn: Callable[..., torch.Tensor]
    input_names: tuple[str, ...]
    target_names: tuple[str, ...]
    dynamic_axes: Mapping[str, Mapping[int, str]]
    default_batch: Mapping[str, int]  # per named config
    has_seq: bool
    seq_is_capped: bool  # True when seq may not exceed config.seq (positional table size)
    make_batch: Callable[[Any, int, int | None, torch.Generator], Batch]


_BATCH_SEQ = {0: "batch", 1: "seq"}
_BATCH = {0: "batch"}

_ENTRIES: dict[str, _ModelEntry] = {
    "mlp": _ModelEntry(
        configs=mlp.CONFIGS,
        build=mlp.MLP,
        loss_fn=classification_loss,
        input_names=("x",),
        target_names=("y",),
        dynamic_axes={"x": _BATCH, "y": _BATCH},
        default_batch={"tiny": 8, "small": 64},
        has_seq=False,
        seq_is_capped=False,
        make_batch=lambda cfg, b, s, g: mlp.make_batch(cfg, b, g),
    ),
    "gpt": _ModelEntry(
        configs=gpt.CONFIGS,
        build=gpt.GPT,
        loss_fn=gpt.lm_loss,
        input_names=("ids",),
        target_names=("targets",),
        dynamic_axes={"ids": _BATCH_SEQ, "targets": _BATCH_SEQ},
        default_batch={"tiny": 8, "small": 8, "medium": 8},
        has_seq=True,
        seq_is_capped=True,
        make_batch=gpt.make_batch,
    ),
    "cnn": _ModelEntry(
        configs=cnn.CONFIGS,
        build=cnn.CNN,
        loss_fn=classification_loss,
        input_names=("x",),
        target_names=("y",),
        dynamic_axes={"x": _BATCH, "y": _BATCH},
        default_batch={"tiny": 8, "small": 32, "medium": 64},
        has_seq=False,
        seq_is_capped=False,
        make_batch=lambda cfg, b, s, g: cnn.make_batch(cfg, b, g),
    ),
    "bert": _ModelEntry(
        configs=bert.CONFIGS,
        build=bert.BERT,
        loss_fn=classification_loss,
        input_names=("ids",),
        target_names=("y",),
        dynamic_axes={"ids": _BATCH_SEQ, "y": _BATCH},
        default_batch={"tiny": 8, "tiny12": 8, "small": 16},
        has_seq=True,
        seq_is_capped=True,
        make_batch=bert.make_batch,
    ),
    "lstm": _ModelEntry(
        configs=lstm.CONFIGS,
        build=lstm.LSTMClassifier,
        loss_fn=classification_loss,
        input_names=("ids",),
        target_names=("y",),
        dynamic_axes={"ids": _BATCH, "y": _BATCH},
        default_batch={"tiny": 8, "small": 32},
        has_seq=True,
        seq_is_capped=False,
        make_batch=lstm.make_batch,
    ),
}


@dataclass(frozen=True)
class ModelSpec:
    """A built model with its loss, I/O names, dynamic axes and a synthetic batch generator.

    ``model(*inputs)`` returns the outputs (logits); ``loss_fn(outputs, *targets)`` returns the
    scalar mean loss. ``dynamic_axes`` maps every input and target name to ``{axis: "batch" |
    "seq"}``; ``"seq"`` appears only where the exported model supports variable length.
    """

    name: str
    config_name: str
    config: Any
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    input_names: tuple[str, ...]
    target_names: tuple[str, ...]
    dynamic_axes: dict[str, dict[int, str]]
    default_batch: int
    default_seq: int | None

    def make_batch(self, batch: int | None = None, seq: int | None = None, *, seed: int = 0) -> Batch:
        """Synthetic ``(inputs, targets)`` on the CPU, deterministic for ``seed``.

        ``batch`` defaults to :attr:`default_batch`, ``seq`` to :attr:`default_seq`. Models
        without a sequence axis reject an explicit ``seq``; GPT and BERT reject ``seq`` above
        the size of their positional table (``config.seq``; BERT's ``config.positions``).
        """
        entry = _entry(self.name)
        batch = self.default_batch if batch is None else batch
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        if not entry.has_seq:
            if seq is not None:
                raise ValueError(f"model {self.name!r} has no sequence axis; pass seq=None, got seq={seq}")
        else:
            seq = self.default_seq if seq is None else seq
            if seq < 1:
                raise ValueError(f"seq must be >= 1, got {seq}")
            longest = getattr(self.config, "positions", self.config.seq)
            if entry.seq_is_capped and seq > longest:
                field = "max_seq" if hasattr(self.config, "positions") else "seq"
                raise ValueError(
                    f"seq={seq} exceeds the maximum sequence length {longest} of model "
                    f"{self.name!r}; build it with {field}={seq} (get_model(..., {field}={seq}))"
                )
        generator = torch.Generator().manual_seed(seed)
        return entry.make_batch(self.config, batch, seq, generator)


def list_models() -> list[str]:
    """Registered model names, sorted."""
    return sorted(_ENTRIES)


def list_configs(name: str) -> list[str]:
    """Named configs of model ``name``, sorted. Raises :class:`UnknownModelError`."""
    return sorted(_entry(name).configs)


def get_model(name: str, config: str = "tiny", *, seed: int = 0, **overrides: Any) -> ModelSpec:
    """Build model ``name`` from named ``config`` with fields replaced by ``overrides``.

    Parameters are initialised under ``torch.manual_seed(seed)`` (inside a forked RNG, so the
    caller's global RNG state is untouched) and are identical for equal arguments. The model is
    returned in training mode on the CPU.

    Raises :class:`UnknownModelError` for an unknown ``name`` or ``config``, and ``ValueError``
    for an unknown override field or an invalid resulting config.
    """
    entry = _entry(name)
    resolved, config_name, model = build_config(name, entry.configs, entry.build, config, seed=seed, overrides=overrides)
    return ModelSpec(
        name=name,
        config_name=config_name,
        config=resolved,
        model=model,
        loss_fn=entry.loss_fn,
        input_names=entry.input_names,
        target_names=entry.target_names,
        dynamic_axes={key: dict(axes) for key, axes in entry.dynamic_axes.items()},
        default_batch=entry.default_batch[config],
        default_seq=resolved.seq if entry.has_seq else None,
    )


def build_config(name: str, configs: Mapping[str, Any], build: Callable[[Any], nn.Module], config: str, *,
                 seed: int, overrides: Mapping[str, Any]) -> tuple[Any, str, nn.Module]:
    """Named ``config`` of model ``name`` with ``overrides`` applied, its config name (or
    :data:`CUSTOM_CONFIG_NAME`), and the module built from it with parameters drawn under
    ``torch.manual_seed(seed)`` in a forked RNG (the caller's global RNG state is untouched)."""
    if config not in configs:
        raise UnknownModelError(
            f"unknown config {config!r} for model {name!r}; valid configs: {', '.join(sorted(configs))}"
        )
    base = configs[config]
    valid_fields = [field.name for field in dataclasses.fields(base)]
    unknown = sorted(set(overrides) - set(valid_fields))
    if unknown:
        raise ValueError(
            f"unknown config field(s) {', '.join(unknown)} for model {name!r}; "
            f"valid fields: {', '.join(valid_fields)}"
        )
    resolved = dataclasses.replace(base, **overrides) if overrides else base
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = build(resolved)
    return resolved, config if resolved == base else CUSTOM_CONFIG_NAME, model


def _entry(name: str) -> _ModelEntry:
    try:
        return _ENTRIES[name]
    except (KeyError, TypeError):
        raise UnknownModelError(f"unknown model {name!r}; valid models: {', '.join(list_models())}") from None
