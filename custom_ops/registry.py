"""Registry of the ``ai.ort_offload`` ops: name → reference body and runtime handler.

Passes look up an op's ONNX-function body here when they insert it; the runtime looks up the
handler that gives the op its meaning (a copy, a release, a prediction). Ops register
themselves; the runtime never hard-codes their names.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import onnx

DOMAIN = "ai.ort_offload"
OPSET_VERSION = 1


@dataclasses.dataclass(frozen=True)
class OpDefinition:
    """One op of the domain: its reference body (an ONNX function) and its runtime handler."""

    name: str
    function: onnx.FunctionProto
    runtime_handler: Callable[..., Any] | None = None
    doc: str = ""


class OpRegistry:
    """Ops of :data:`DOMAIN`, keyed by op type, in registration order."""

    def __init__(self) -> None:
        self._ops: dict[str, OpDefinition] = {}

    def register(self, definition: OpDefinition) -> OpDefinition:
        if definition.name in self._ops:
            raise ValueError(f"op {DOMAIN}::{definition.name} is already registered")
        if definition.function.domain != DOMAIN or definition.function.name != definition.name:
            raise ValueError(f"function body of {definition.name} must be {DOMAIN}::{definition.name}")
        self._ops[definition.name] = definition
        return definition

    def get(self, name: str) -> OpDefinition:
        try:
            return self._ops[name]
        except KeyError:
            known = ", ".join(sorted(self._ops)) or "none"
            raise KeyError(f"no op {DOMAIN}::{name} is registered (registered: {known})") from None

    def __contains__(self, name: str) -> bool:
        return name in self._ops

    def names(self) -> list[str]:
        return list(self._ops)

    def functions(self) -> list[onnx.FunctionProto]:
        """Reference bodies of every registered op, to attach to a model that uses them."""
        return [op.function for op in self._ops.values()]


default_registry = OpRegistry()
