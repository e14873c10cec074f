"""Swap ops of the ``ai.ort_offload`` domain (v1): ``SwapOut`` and ``SwapIn``.

This module owns the two ops a swap pass writes into a training graph, the helpers that build
their nodes with provenance metadata, and :func:`attach_functions`, which makes a rewritten model
self-contained for stock ONNX Runtime.

Op set design
-------------
``SwapOut(x) -> y``
    Runtime meaning: copy ``x`` device → host and release ``x``'s device buffer once the copy is
    done. ``y`` names the host copy; every later use of the value must go through a ``SwapIn`` of
    ``y``. Reference body: ``y = Identity(x)``.

``SwapIn(y, after) -> z``
    Runtime meaning: copy the host tensor ``y`` host → device into a new device buffer ``z``.
    ``after`` is the *ordering token*: any tensor (of any type or shape) produced by the node
    after which the copy may start. It is consumed only to tie the ``SwapIn`` into the schedule,
    so a topological order of the graph never starts the copy earlier than the planner wants
    (place the ``SwapIn`` early enough for the copy to hide under compute, late enough for the
    memory to be free). Reference body: ``z = Identity(y)``; ``after`` is ignored.

No separate token op is needed: the ``SwapOut`` → ``SwapIn`` order already follows from the data
edge ``y``, and the ``after`` input expresses the "start after node N" edge directly, so no extra
nodes or dummy tensors enter the graph.

Each body is an ONNX function (domain :data:`~custom_ops.registry.DOMAIN`, importing the default
ONNX domain at opset 20) without type constraints: ONNX functions are polymorphic, so one body
serves every element type and shape, and ``after`` may differ in type from ``y``. A graph
rewritten with these ops therefore runs in stock ONNX Runtime with bitwise-identical numbers.

Runtime meanings: both ops register here with ``runtime_handler=None``. The ort_offload runtime
gives them their meaning (the copies and the release) by registering its own handlers through
:mod:`custom_ops.registry`; this module does not import the runtime.
"""

from __future__ import annotations

from typing import Iterable, Iterator, Mapping

import onnx
import onnx.helper as oh
import onnx_ir as ir

from custom_ops.registry import DOMAIN, OPSET_VERSION, OpDefinition, OpRegistry, default_registry

SWAP_OUT = "SwapOut"
SWAP_IN = "SwapIn"

REFERENCE_ONNX_OPSET = 20
"""Version of the default ONNX domain the reference bodies import (they use only ``Identity``)."""

PASS_KEY = "ort_offload.pass"
REASON_KEY = "ort_offload.reason"
"""Node ``metadata_props`` keys carrying the provenance of an inserted node (which pass, why)."""

MIN_IR_VERSION_FOR_FUNCTIONS = 8
"""Model-local functions exist from IR version 8 on."""

_ONNX_DOMAINS = ("", "ai.onnx")


def _identity_body(name: str, inputs: list[str], doc: str) -> onnx.FunctionProto:
    function = oh.make_function(
        DOMAIN,
        name,
        inputs,
        ["output"],
        [oh.make_node("Identity", [inputs[0]], ["output"])],
        [oh.make_opsetid("", REFERENCE_ONNX_OPSET)],
    )
    function.doc_string = doc
    return function


_SWAP_OUT_DOC = (
    "Copy the input device -> host, then release its device buffer; the output names the host "
    "copy. Reference semantics: Identity."
)
_SWAP_IN_DOC = (
    "Copy a host tensor (a SwapOut output) host -> device. 'after' is an ordering token: a tensor "
    "produced by the node after which the copy may start; only its existence matters. Reference "
    "semantics: Identity of the first input."
)

SWAP_OUT_DEFINITION = OpDefinition(
    SWAP_OUT, _identity_body(SWAP_OUT, ["input"], _SWAP_OUT_DOC), runtime_handler=None, doc=_SWAP_OUT_DOC
)
SWAP_IN_DEFINITION = OpDefinition(
    SWAP_IN, _identity_body(SWAP_IN, ["host", "after"], _SWAP_IN_DOC), runtime_handler=None, doc=_SWAP_IN_DOC
)


def register_swap_ops(registry: OpRegistry) -> None:
    """Register ``SwapOut`` and ``SwapIn`` in ``registry`` (skipping those already there)."""
    for definition in (SWAP_OUT_DEFINITION, SWAP_IN_DEFINITION):
        if definition.name not in registry:
            registry.register(definition)


register_swap_ops(default_registry)


def _provenance(node: onnx.NodeProto, provenance: str, reason: str) -> onnx.NodeProto:
    if not provenance:
        raise ValueError("provenance (the name of the pass inserting the node) must not be empty")
    for key, value in ((PASS_KEY, provenance), (REASON_KEY, reason)):
        entry = node.metadata_props.add()
        entry.key, entry.value = key, value
    return node


def swap_node_name(op_type: str, out_name: str) -> str:
    """The default name of a swap node: unique as long as value names are."""
    return f"{DOMAIN}.{op_type}.{out_name}"


def make_swap_out(
    value_name: str,
    *,
    out_name: str,
    provenance: str,
    reason: str | None = None,
    node_name: str | None = None,
) -> onnx.NodeProto:
    """A ``SwapOut`` node moving ``value_name`` to the host as ``out_name``.

    ``provenance`` is the inserting pass (stored under :data:`PASS_KEY`); ``reason`` says why
    (stored under :data:`REASON_KEY`; a generic description when omitted). The node name defaults
    to one derived from ``out_name``, unique as long as value names are.
    """
    node = oh.make_node(
        SWAP_OUT, [value_name], [out_name], name=node_name or swap_node_name(SWAP_OUT, out_name), domain=DOMAIN
    )
    return _provenance(node, provenance, reason or f"device->host copy and release of {value_name}")


def make_swap_in(
    host_name: str,
    *,
    after: str,
    out_name: str,
    provenance: str,
    reason: str | None = None,
    node_name: str | None = None,
) -> onnx.NodeProto:
    """A ``SwapIn`` node bringing host tensor ``host_name`` back to the device as ``out_name``.

    ``after`` is the ordering token: the name of a tensor produced by the node after which the
    copy may start. ``provenance``/``reason`` as in :func:`make_swap_out`.
    """
    if not after:
        raise ValueError("SwapIn needs an ordering token: 'after' names a tensor the copy waits for")
    node = oh.make_node(
        SWAP_IN, [host_name, after], [out_name],
        name=node_name or swap_node_name(SWAP_IN, out_name), domain=DOMAIN,
    )
    return _provenance(node, provenance, reason or f"host->device copy of {host_name} after {after}")


def _graph_nodes(graph: onnx.GraphProto) -> Iterator[onnx.NodeProto]:
    for node in graph.node:
        yield node
        for attribute in node.attribute:
            if attribute.type == onnx.AttributeProto.GRAPH:
                yield from _graph_nodes(attribute.g)
            elif attribute.type == onnx.AttributeProto.GRAPHS:
                for subgraph in attribute.graphs:
                    yield from _graph_nodes(subgraph)


def _used_op_types(model: onnx.ModelProto) -> set[str]:
    nodes = list(_graph_nodes(model.graph))
    for function in model.functions:
        nodes.extend(function.node)
    return {node.op_type for node in nodes if node.domain == DOMAIN}


def _adapted_body(function: onnx.FunctionProto, onnx_version: int | None) -> onnx.FunctionProto:
    """A copy of ``function`` importing the model's version of the default ONNX domain.

    The checker requires a function's opset imports to match the model's; the swap bodies use
    only ``Identity``, which every opset version has with the same meaning.
    """
    body = onnx.FunctionProto()
    body.CopyFrom(function)
    if onnx_version is not None:
        for opset in body.opset_import:
            if opset.domain in _ONNX_DOMAINS:
                opset.version = onnx_version
    return body


def attach_functions(model: onnx.ModelProto, *, registry: OpRegistry = default_registry) -> None:
    """Make ``model`` runnable in stock ONNX Runtime: add the op-set import and reference bodies.

    For every op of ``registry`` the model uses (main graph, subgraphs, or local functions), adds
    its ONNX-function body unless the model already has it, and imports
    :data:`~custom_ops.registry.DOMAIN` at :data:`~custom_ops.registry.OPSET_VERSION`.
    Idempotent. Raises ``ValueError`` for an op the registry does not know, a model importing
    another version of the domain, a different body already attached, or an IR version without
    local functions.
    """
    imported = {opset.domain: opset.version for opset in model.opset_import}
    existing = {(f.domain, f.name, f.overload): f for f in model.functions}
    used = _used_op_types(model)
    bodies = _bodies_to_attach(used, model.ir_version, imported, existing, registry)
    if used and DOMAIN not in imported:
        model.opset_import.append(oh.make_opsetid(DOMAIN, OPSET_VERSION))
    model.functions.extend(bodies)


def attach_functions_ir(model: ir.Model, *, registry: OpRegistry = default_registry) -> None:
    """:func:`attach_functions` for an ``onnx_ir`` model (the passes' form): the same checks,
    the same import and bodies."""
    graph_nodes = ir.traversal.RecursiveGraphIterator(model.graph)
    used = {n.op_type for n in _chain(graph_nodes, *model.functions.values()) if n.domain == DOMAIN}
    existing = {key: ir.serde.serialize_function(f) for key, f in model.functions.items()
                if key[0] == DOMAIN and key[1] in used}
    bodies = _bodies_to_attach(used, model.ir_version, model.opset_imports, existing, registry)
    if used and DOMAIN not in model.opset_imports:
        model.opset_imports[DOMAIN] = OPSET_VERSION
    for body in bodies:
        function = ir.serde.deserialize_function(body)
        model.functions[function.identifier()] = function


def _chain(*groups: Iterable) -> Iterator:
    for group in groups:
        yield from group


def _bodies_to_attach(used: set[str], ir_version: int, imported: Mapping[str, int],
                      existing: Mapping[tuple[str, str, str], onnx.FunctionProto],
                      registry: OpRegistry) -> list[onnx.FunctionProto]:
    """The bodies :func:`attach_functions` adds (in registration order), after its checks."""
    if not used:
        return []
    unknown = sorted(name for name in used if name not in registry)
    if unknown:
        raise ValueError(
            f"model uses {DOMAIN} ops with no registered definition: {', '.join(unknown)}; "
            "import the module that registers them"
        )
    if ir_version < MIN_IR_VERSION_FOR_FUNCTIONS:
        raise ValueError(
            f"model IR version {ir_version} has no local functions; "
            f"set ir_version ≥ {MIN_IR_VERSION_FOR_FUNCTIONS} before attaching {DOMAIN} bodies"
        )
    if DOMAIN in imported and imported[DOMAIN] != OPSET_VERSION:
        raise ValueError(
            f"model imports {DOMAIN} version {imported[DOMAIN]}, this op set is version {OPSET_VERSION}"
        )
    onnx_version = next((v for d, v in imported.items() if d in _ONNX_DOMAINS), None)
    bodies = []
    for name in registry.names():  # registration order: deterministic
        if name not in used:
            continue
        body = _adapted_body(registry.get(name).function, onnx_version)
        present = existing.get((body.domain, body.name, body.overload))
        if present is None:
            bodies.append(body)
        elif present.SerializeToString(deterministic=True) != body.SerializeToString(deterministic=True):
            raise ValueError(
                f"model already has a different body for {DOMAIN}::{name}; remove it before attaching"
            )
    return bodies
