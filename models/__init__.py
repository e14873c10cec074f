"""Model zoo (pure torch): small static networks with named configs and synthetic data.

Owns the public entry points re-exported from :mod:`models.registry`: :func:`get_model` builds a
:class:`ModelSpec` (module, loss, I/O names, dynamic axes, batch generator) by registry name —
``bert``, ``cnn``, ``gpt``, ``lstm``, ``mlp`` — and named config (``tiny``, ``small``).

Also re-exports the dynamic zoo of :mod:`models.dynamic`: :func:`get_dynamic_model` builds a
:class:`DynamicModelSpec` — ``var-bert``, ``fixed-bert``, ``moe``, ``tree-lstm``, ``var-lstm``,
``fixed-lstm``, ``recycle-former`` — whose model exposes ``blocks()`` and ``path(ids)``. Depends on torch only.
"""

from models.dynamic import DynamicModelSpec, get_dynamic_model, list_dynamic_configs, list_dynamic_models
from models.dynamic_common import MixedPathError
from models.registry import ModelSpec, UnknownModelError, get_model, list_configs, list_models

__all__ = [
    "DynamicModelSpec",
    "MixedPathError",
    "ModelSpec",
    "UnknownModelError",
    "get_dynamic_model",
    "get_model",
    "list_configs",
    "list_dynamic_configs",
    "list_dynamic_models",
    "list_models",
]
