"""Model zoo (pure torch): small static networks with named configs and synthetic data.

Owns the public entry points re-exported from :mod:`models.registry`: :func:`get_model` builds a
:class:`ModelSpec` (module, loss, I/O names, dynamic axes, batch generator) by registry name —
``bert``, ``cnn``, ``gpt``, ``lstm``, ``mlp`` — and named config (``tiny``, ``small``).
Depends on torch only.
"""

from models.registry import ModelSpec, UnknownModelError, get_model, list_configs, list_models

__all__ = ["ModelSpec", "UnknownModelError", "get_model", "list_configs", "list_models"]
