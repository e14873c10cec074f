"""Registry of the dynamic zoo: names -> (configs, builder, batch generator, network type).

Owns :class:`DynamicModelSpec`, :func:`get_dynamic_model`, :func:`list_dynamic_models` and
:func:`list_dynamic_configs`. Names: ``var-bert``, ``fixed-bert`` (:mod:`models.var_bert`),
``moe`` (:mod:`models.moe`), ``tree-lstm`` (:mod:`models.tree_lstm`), ``var-lstm``,
``fixed-lstm`` (:mod:`models.var_lstm`), ``recycle-former`` (:mod:`models.recycle_former`:
AlphaFold-style recycling, a shared-weight trunk re-run a per-sample number of times). Every
model follows the protocol of :mod:`models.dynamic_common` (``blocks()``, ``path(ids)``,
Python control flow in ``forward``) and a batch shares one path. These models are not in :mod:`models.registry`: the static
exporter traces one path, so they are trained block-wise instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from models import moe, recycle_former, tree_lstm, var_bert, var_lstm
from models.dynamic_common import Batch
from models.registry import UnknownModelError, build_config, classification_loss

__all__ = ["DynamicModelSpec", "get_dynamic_model", "list_dynamic_configs", "list_dynamic_models"]


@dataclass(frozen=True, kw_only=True)
class _DynamicEntry:
    """How the registry builds one dynamic model family."""

    configs: Mapping[str, Any]
    build: Callable[[Any], nn.Module]
    make_batch: Callable[..., Batch]  # (config, batch, generator, *, key) -> Batch
    network_type: str  # the pilot's network-type one-hot: "transformer" | "lstm" | "cnn"
    is_dynamic: Callable[[Any], bool]  # whether a config's path varies between samples
    default_batch: Mapping[str, int]  # per named config


_ENTRIES: dict[str, _DynamicEntry] = {
    "var-bert": _DynamicEntry(
        configs=var_bert.VAR_CONFIGS,
        build=var_bert.DepthBERT,
        make_batch=var_bert.make_batch,
        network_type="transformer",
        is_dynamic=lambda cfg: cfg.dynamic,
        default_batch={"tiny": 8, "small": 16, "deep": 8},
    ),
    "fixed-bert": _DynamicEntry(
        configs=var_bert.FIXED_CONFIGS,
        build=var_bert.DepthBERT,
        make_batch=var_bert.make_batch,
        network_type="transformer",
        is_dynamic=lambda cfg: cfg.dynamic,
        default_batch={"tiny": 8, "small": 16},
    ),
    "moe": _DynamicEntry(
        configs=moe.CONFIGS,
        build=moe.MoETransformer,
        make_batch=moe.make_batch,
        network_type="transformer",
        is_dynamic=lambda cfg: cfg.experts > 1,
        default_batch={"tiny": 8, "small": 16},
    ),
    "recycle-former": _DynamicEntry(
        configs=recycle_former.CONFIGS,
        build=recycle_former.RecycleFormer,
        make_batch=recycle_former.make_batch,
        network_type="transformer",
        is_dynamic=lambda cfg: cfg.dynamic,
        default_batch={"tiny": 8, "small": 16},
    ),
    "tree-lstm": _DynamicEntry(
        configs=tree_lstm.CONFIGS,
        build=tree_lstm.TreeLSTM,
        make_batch=tree_lstm.make_batch,
        network_type="lstm",
        is_dynamic=lambda cfg: cfg.max_leaves > cfg.min_leaves or cfg.max_leaves >= 3,
        default_batch={"tiny": 8, "small": 32},
    ),
    "var-lstm": _DynamicEntry(
        configs=var_lstm.VAR_CONFIGS,
        build=var_lstm.StepLSTM,
        make_batch=var_lstm.make_batch,
        network_type="lstm",
        is_dynamic=lambda cfg: cfg.dynamic,
        default_batch={"tiny": 8, "small": 32},
    ),
    "fixed-lstm": _DynamicEntry(
        configs=var_lstm.FIXED_CONFIGS,
        build=var_lstm.StepLSTM,
        make_batch=var_lstm.make_batch,
        network_type="lstm",
        is_dynamic=lambda cfg: cfg.dynamic,
        default_batch={"tiny": 8, "small": 32},
    ),
}


@dataclass(frozen=True)
class DynamicModelSpec:
    """A built dynamic (or fixed counterpart) model with its loss and batch generator.

    ``model(ids)`` returns class logits ``[B, classes]``; ``loss_fn(logits, y)`` the mean
    cross-entropy; ``model.blocks()`` and ``model.path(ids)`` describe the block invocations.
    ``dynamic`` is False for the static counterparts, whose path never changes.
    ``network_type`` is the pilot's network-type feature.
    """

    name: str
    config_name: str
    config: Any
    model: nn.Module
    loss_fn: Callable[..., torch.Tensor]
    input_names: tuple[str, ...]
    target_names: tuple[str, ...]
    network_type: str
    dynamic: bool
    default_batch: int

    def make_batch(self, batch: int | None = None, *, seed: int = 0, key: int | None = None) -> Batch:
        """Synthetic ``(inputs, targets)`` on the CPU, deterministic for ``(batch, seed, key)``;
        all rows share one path. ``key`` pins the path parameter (var-bert/fixed-bert: segment
        count; moe: expert; tree-lstm: leaf count; var-lstm/fixed-lstm: length; recycle-former:
        trunk iterations); by default
        it is drawn from ``seed``."""
        batch = self.default_batch if batch is None else batch
        if batch < 1:
            raise ValueError(f"batch must be >= 1, got {batch}")
        generator = torch.Generator().manual_seed(seed)
        return _entry(self.name).make_batch(self.config, batch, generator, key=key)


def list_dynamic_models() -> list[str]:
    """Registered dynamic model names, sorted."""
    return sorted(_ENTRIES)


def list_dynamic_configs(name: str) -> list[str]:
    """Named configs of dynamic model ``name``, sorted. Raises :class:`UnknownModelError`."""
    return sorted(_entry(name).configs)


def get_dynamic_model(name: str, config: str = "tiny", *, seed: int = 0, **overrides: Any) -> DynamicModelSpec:
    """Build dynamic model ``name`` from named ``config`` with fields replaced by ``overrides``.

    Parameters are initialised under ``torch.manual_seed(seed)`` in a forked RNG (the caller's
    global RNG is untouched) and are identical for equal arguments; training mode, CPU.
    Raises :class:`UnknownModelError` for an unknown name or config, ``ValueError`` for an
    unknown override field or an invalid resulting config.
    """
    entry = _entry(name)
    resolved, config_name, model = build_config(name, entry.configs, entry.build, config, seed=seed, overrides=overrides)
    return DynamicModelSpec(
        name=name,
        config_name=config_name,
        config=resolved,
        model=model,
        loss_fn=classification_loss,
        input_names=("ids",),
        target_names=("y",),
        network_type=entry.network_type,
        dynamic=entry.is_dynamic(resolved),
        default_batch=entry.default_batch[config],
    )


def _entry(name: str) -> _DynamicEntry:
    try:
        return _ENTRIES[name]
    except (KeyError, TypeError):
        raise UnknownModelError(
            f"unknown dynamic model {name!r}; valid dynamic models: {', '.join(list_dynamic_models())}"
        ) from None
