"""torch → one ONNX graph of a whole training step (forward, backward, optimizer update).

The path (docs/decisions.md, torch and ONNX Runtime facts): ``torch.export.export`` of a module whose forward
returns the loss, ``_export_forward_backward`` for the joint forward/backward graph, and a
re-export of that joint graph with ``torch.onnx.export(dynamo=True)`` so the backward is made of
standard ONNX ops. The optimizer update is then appended as ONNX ops
(:mod:`ort_offload.export.optimizers`), values are renamed after what they are (parameter FQNs,
``<param>.exp_avg``, ``<name>.updated``, ``loss``) and every value's role is recorded.

Exports are cached on disk, keyed by the fingerprint of the program ``torch.export`` captures
(graph code with every literal and shape, signature, constants), the trainable parameters, the
optimizer and the exporter's versions and code: a cache hit runs ``torch.export`` (the cheap
part) and skips the joint graph and the ONNX export. Each entry is verified against the content
hash written with it (:mod:`ort_offload.export.cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import inspect
import json
import logging
import os
import re
import time
import warnings
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

import numpy as np
import onnx
import onnx_ir as ir
import torch

from graph_passes.ir.training_graph import MODEL_NAME_KEY, TIED_PARAMS_KEY, UNUSED_PARAMS_KEY, Role, TrainingGraph
from ort_offload.export import optimizers
from ort_offload.errors import ExportError, InputMismatchError
from ort_offload.export.cache import read_entry, write_entry
from ort_offload.export.progress import export_status

logger = logging.getLogger(__name__)
# torch's ONNX exporter warns once per process that torchvision (which we do not use) is missing.
logging.getLogger("torch.onnx._internal.exporter._registration").setLevel(logging.ERROR)

OPSET_VERSION = 20
EXPORTER_VERSION = "6"  # bump when the exported graph's layout changes: invalidates caches
LOSS_OUTPUT = "loss"
CACHE_ENV = "ORT_OFFLOAD_CACHE_DIR"


def default_cache_dir() -> Path:
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "ort_offload" / "exports"


@dataclasses.dataclass(frozen=True)
class ExportResult:
    """An exported training step and how it was obtained."""

    graph: TrainingGraph
    cache_key: str
    cache_hit: bool
    export_time_s: float
    path: Path | None


class _LossModule(torch.nn.Module):
    """forward(*inputs, *targets) -> scalar loss, from a model plus an optional loss function."""

    def __init__(self, model: torch.nn.Module, loss_fn: Callable | None, num_inputs: int) -> None:
        super().__init__()
        self.model = model
        self.loss_fn = loss_fn
        self.num_inputs = num_inputs

    def forward(self, *batch):
        inputs, targets = batch[: self.num_inputs], batch[self.num_inputs :]
        out = self.model(*inputs)
        return out if self.loss_fn is None else self.loss_fn(out, *targets)


class _TensorOutputs(torch.nn.Module):
    """forward(*inputs) -> the model's outputs, a dict or dataclass output (``ModelOutput``)
    reduced to its tensor fields in order (a KV cache object is no graph output). Parameter
    names get the same "model." prefix as in :class:`_LossModule`."""

    def __init__(self, model: torch.nn.Module) -> None:
        super().__init__()
        self.model = model

    def forward(self, *inputs):
        out = self.model(*inputs)
        if isinstance(out, Mapping):
            return tuple(v for v in out.values() if isinstance(v, torch.Tensor))
        return out


class _Positional(torch.nn.Module):
    """Calls an exported graph module with positional arguments only."""

    def __init__(self, graph_module: torch.nn.Module) -> None:
        super().__init__()
        self.graph_module = graph_module

    def forward(self, *args):
        return self.graph_module(*args)


@contextlib.contextmanager
def _export_context():
    """Math attention (flash/efficient backwards have no ONNX translation), quiet warnings."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def _translation_table() -> dict:
    from ort_offload.export.aten_translations import CUSTOM_TRANSLATION_TABLE

    return dict(CUSTOM_TRANSLATION_TABLE)


def _source_of(obj: Any) -> str:
    try:
        return inspect.getsource(obj)
    except (OSError, TypeError):
        return getattr(obj, "__qualname__", repr(type(obj)))


def _plain_value(value: Any, depth: int = 0) -> Any:
    """A JSON-able rendering of an attribute's value: numbers, strings, containers, dataclasses
    and config objects (``to_dict()``) by content, tensors by digest, functions by source."""
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    if depth > 4:
        return type(value).__qualname__
    if isinstance(value, torch.Tensor):
        return _tensor_digest(value)
    if isinstance(value, (list, tuple, set, frozenset)):
        items = [_plain_value(v, depth + 1) for v in value]
        return sorted(items, key=repr) if isinstance(value, (set, frozenset)) else items
    if isinstance(value, Mapping):
        return {str(k): _plain_value(v, depth + 1) for k, v in value.items()}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {f.name: _plain_value(getattr(value, f.name), depth + 1) for f in dataclasses.fields(value)}
    if callable(getattr(value, "to_dict", None)):
        try:
            return _plain_value(value.to_dict(), depth + 1)
        except Exception:  # noqa: BLE001 - a config that cannot render itself keys by its type
            return f"{type(value).__module__}.{type(value).__qualname__}"
    if callable(value):
        return hashlib.sha256(_source_of(value).encode()).hexdigest()
    return f"{type(value).__module__}.{type(value).__qualname__}"


def _attributes(model: torch.nn.Module) -> dict:
    """Every submodule's own attributes (not parameters, buffers or submodules): plain values
    and config objects change what forward computes without changing the structure."""
    return {
        name or "root": {k: _plain_value(v) for k, v in sorted(vars(module).items())
                         if not k.startswith("_") and k != "forward"}  # forward: the block-wise wrapper
        for name, module in model.named_modules()
    }


def _structure_fingerprint(model: torch.nn.Module, loss_fn: Callable | None) -> dict:
    """Structure, code and attributes of a module without tracing it (block-wise steps key on
    this; the whole-step export keys on the program torch.export captures)."""
    classes = sorted({type(m) for m in model.modules()}, key=lambda c: c.__module__ + c.__qualname__)
    return {
        "repr": repr(model),
        "attributes": _attributes(model),
        "code": [hashlib.sha256(_source_of(c).encode()).hexdigest() for c in classes],
        "params": [(n, list(p.shape), str(p.dtype), p.requires_grad) for n, p in model.named_parameters()],
        "buffers": [(n, list(b.shape), str(b.dtype)) for n, b in model.named_buffers()],
        "training": model.training,
        "loss_fn": None if loss_fn is None else hashlib.sha256(_source_of(loss_fn).encode()).hexdigest(),
    }


def _tensor_digest(value: Any) -> str:
    if not isinstance(value, torch.Tensor):
        return repr(value)
    flat = value.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return f"{value.dtype}{list(value.shape)}:{hashlib.sha256(data).hexdigest()}"


def program_fingerprint(program: torch.export.ExportedProgram) -> str:
    """Digest of what a captured program computes: the code of its graph and subgraphs (every op,
    literal, shape and dtype), its signature, shape constraints and lifted constants' values.

    torch.export bakes plain attributes, config flags and the code of every function the
    forward runs into this graph, so two modules with the same fingerprint export the same step.
    """
    code = program.graph_module.print_readable(
        print_output=False, include_stride=True, include_device=True, colored=False
    )
    payload = {
        "code": code,
        "signature": str(program.graph_signature),
        "ranges": sorted(f"{k}: {v}" for k, v in program.range_constraints.items()),
        "constants": {name: _tensor_digest(v) for name, v in sorted(program.constants.items())},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True).encode()).hexdigest()


def _exporter_sources() -> str:
    """Digest of our own exporter code: editing it invalidates every cached export."""
    from ort_offload.export import aten_translations

    digest = hashlib.sha256()
    for module in (aten_translations, optimizers, inspect.getmodule(_exporter_sources)):
        digest.update(_source_of(module).encode())
    return digest.hexdigest()


def _versions() -> dict[str, str]:
    import onnx_ir
    import onnxscript

    return {
        "exporter": EXPORTER_VERSION, "exporter_code": _exporter_sources(), "torch": torch.__version__,
        "onnx": onnx.__version__, "onnxscript": onnxscript.__version__, "onnx_ir": onnx_ir.__version__,
    }


def cache_key(
    program: torch.export.ExportedProgram,
    model: torch.nn.Module,
    optimizer: optimizers.OptimizerConfig | None,
    kind: str,
    names: Sequence[str] = (),
) -> str:
    """Key of an export: the captured program's fingerprint, which parameters train, the
    optimizer (its learning rate is a graph input), the graph's batch input ``names`` (the
    program does not hold them) and the versions of everything that turns the program into ONNX."""
    payload = {
        "kind": kind,
        "names": list(names),
        "versions": _versions(),
        "program": program_fingerprint(program),
        "trainable": [n for n, p in model.named_parameters(remove_duplicate=False) if p.requires_grad],
        "optimizer": None
        if optimizer is None
        else {"type": type(optimizer).__name__, **{k: v for k, v in dataclasses.asdict(optimizer).items() if k != "lr"}},
    }
    return hashlib.sha256(json.dumps(payload, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _dynamic_shapes(batch: Sequence[torch.Tensor], dynamic_axes: Sequence[Mapping[int, str]]):
    shapes = []
    for tensor, axes in zip(batch, dynamic_axes):
        shapes.append({i: torch.export.Dim.AUTO for i in axes if i < tensor.dim()} or None)
    return tuple(shapes)


def export_training_step(
    model: torch.nn.Module,
    *,
    example_inputs: Sequence[torch.Tensor],
    example_targets: Sequence[torch.Tensor] = (),
    loss_fn: Callable | None = None,
    optimizer: optimizers.OptimizerConfig | str = "adamw",
    input_names: Sequence[str] | None = None,
    target_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    name: str = "model",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> ExportResult:
    """Export one training step of ``model`` as a :class:`TrainingGraph`.

    ``example_inputs`` are the model's inputs, ``example_targets`` the extra arguments of
    ``loss_fn(outputs, *targets)``; without ``loss_fn`` the model's forward returns the loss.
    ``dynamic_axes`` maps an input or target name to ``{axis: "batch" | "seq"}``.
    """
    optimizer = optimizers.make_optimizer(optimizer) if isinstance(optimizer, str) else optimizer
    return _export(
        model,
        kind="train",
        example_inputs=example_inputs,
        example_targets=example_targets,
        loss_fn=loss_fn,
        optimizer=optimizer,
        input_names=input_names,
        target_names=target_names,
        dynamic_axes=dynamic_axes,
        name=name,
        cache_dir=cache_dir,
        use_cache=use_cache,
    )


def export_forward(
    model: torch.nn.Module,
    *,
    example_inputs: Sequence[torch.Tensor],
    input_names: Sequence[str] | None = None,
    dynamic_axes: Mapping[str, Mapping[int, str]] | None = None,
    name: str = "model",
    cache_dir: str | os.PathLike | None = None,
    use_cache: bool = True,
) -> ExportResult:
    """Export the model's forward in eval mode (parameters and buffers as inputs) for ``eval()``."""
    return _export(
        model,
        kind="eval",
        example_inputs=example_inputs,
        example_targets=(),
        loss_fn=None,
        optimizer=None,
        input_names=input_names,
        target_names=(),
        dynamic_axes=dynamic_axes,
        name=name,
        cache_dir=cache_dir,
        use_cache=use_cache,
    )


def _export(
    model, *, kind, example_inputs, example_targets, loss_fn, optimizer, input_names, target_names,
    dynamic_axes, name, cache_dir, use_cache,
) -> ExportResult:
    example_inputs = tuple(example_inputs)
    example_targets = tuple(example_targets)
    batch = example_inputs + example_targets
    for i, t in enumerate(batch):
        if not isinstance(t, torch.Tensor):
            raise InputMismatchError(f"example input {i} is a {type(t).__name__}, not a torch.Tensor")
        if t.numel() == 0:
            raise InputMismatchError(f"example input {i} has no elements (shape {list(t.shape)}): "
                                     "a step needs at least one sample")
    input_names = list(input_names or [f"input{i}" for i in range(len(example_inputs))])
    target_names = list(target_names or [f"target{i}" for i in range(len(example_targets))])
    if len(input_names) != len(example_inputs) or len(target_names) != len(example_targets):
        raise InputMismatchError("input_names/target_names must name every example input/target")
    batch_names = input_names + target_names
    dynamic_axes = dynamic_axes or {}
    axes = [dict(dynamic_axes.get(n, {})) for n in batch_names]

    was_training = model.training
    model.train(kind == "train")
    try:
        with export_status(f"exporting {name} ({kind})") as phase:
            return _export_or_load(model, kind, loss_fn, example_inputs, batch, batch_names, input_names, axes,
                                   optimizer, name, cache_dir, use_cache, phase)
    finally:
        model.train(was_training)


def _export_or_load(model, kind, loss_fn, example_inputs, batch, batch_names, input_names, axes, optimizer, name,
                    cache_dir, use_cache, phase) -> ExportResult:
    """The cached export of the captured program where there is one, else a fresh export (cached)."""
    start = time.perf_counter()
    phase("capturing the model with torch.export")
    program = _capture(model, kind, loss_fn, example_inputs, batch, axes)
    key = cache_key(program, model, optimizer, kind, batch_names)
    directory = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    path = directory / f"{name}-{kind}-{key}.onnx"
    cached = read_entry(path) if use_cache else None  # verified against its content hash
    if cached is None and use_cache:
        cached, path = _entry_under_another_name(path, kind, key, name) or (None, path)
    if cached is not None:
        try:
            graph = TrainingGraph.from_model(cached, name=name)
            elapsed = time.perf_counter() - start
            logger.info("export cache hit for %s (%s) in %.3f s", name, kind, elapsed)
            return ExportResult(graph, key, True, elapsed, path)
        except Exception as e:  # a corrupt cache entry is re-exported, not fatal
            logger.warning("ignoring unreadable export cache entry %s: %s", path, e)
    if kind == "train":
        wrapper = _LossModule(model, loss_fn, len(example_inputs))
        graph = _export_train(program, wrapper, batch, batch_names, axes, optimizer, name, phase)
    else:
        graph = _export_eval(program, _TensorOutputs(model), example_inputs, input_names, axes, name, phase)
    elapsed = time.perf_counter() - start
    logger.info("exported %s (%s): %d nodes in %.1f s", name, kind, len(graph.graph.node), elapsed)
    if use_cache:
        phase("writing the export cache")
    saved = write_entry(path, graph.save) if use_cache else None
    return ExportResult(graph, key, False, elapsed, saved)


def _entry_under_another_name(path: Path, kind: str, key: str, name: str) -> tuple[onnx.ModelProto, Path] | None:
    """A verified entry beside ``path`` of the same key (the same captured program, optimizer
    and versions) exported under another name, renamed ``name``, and its path; None when there
    is none."""
    for other in sorted(path.parent.glob(f"*-{kind}-{key}.onnx")):
        model = None if other == path else read_entry(other)
        if model is not None:
            model.graph.name = name
            for prop in model.metadata_props:
                if prop.key == MODEL_NAME_KEY:
                    prop.value = name
            return model, other
    return None


def _torch_export(module: torch.nn.Module, args: tuple, dynamic_shapes) -> torch.export.ExportedProgram:
    try:
        with _export_context():
            return torch.export.export(module, args, dynamic_shapes=dynamic_shapes)
    except Exception as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(
            f"torch.export could not capture the model ({type(e).__name__}: {first}); "
            "remove data-dependent control flow or .item() calls from forward"
        ) from e


def _onnx_export(graph_module, args: tuple, dynamic_shapes, *, origin: torch.fx.GraphModule | None = None) -> ir.Model:
    """ONNX of ``graph_module``; ``origin`` (the captured forward, whose nodes know their module)
    names where an op without a translation came from."""
    try:
        with _export_context():
            program = torch.onnx.export(
                _Positional(graph_module),
                args,
                dynamo=True,
                dynamic_shapes=(dynamic_shapes,),
                opset_version=OPSET_VERSION,
                custom_translation_table=_translation_table(),
                verbose=False,
                optimize=True,
            )
    except Exception as e:
        op = _untranslatable_op(e)
        if op is not None:
            raise ExportError(
                f"{op} (from {_origin_of([g for g in (origin, graph_module) if g is not None], op)}) "
                "has no ONNX translation: add one to "
                "ort_offload/export/aten_translations.py or avoid the op in the model"
            ) from e
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise ExportError(f"ONNX export of the training step failed ({type(e).__name__}: {first})") from e
    return program.model


_NO_TRANSLATION = re.compile(r"No ONNX function found for <OpOverload\(op='([\w.]+)', overload='(\w+)'\)>")


def _untranslatable_op(error: BaseException) -> str | None:
    """``aten.op.overload`` when torch's ONNX exporter failed for want of a translation of it."""
    seen = set()
    while error is not None and id(error) not in seen:
        seen.add(id(error))
        match = _NO_TRANSLATION.search(str(error))
        if match:
            return f"{match.group(1)}.{match.group(2)}"
        error = error.__cause__ or error.__context__
    return None


def _origin_of(graph_modules: Sequence[torch.fx.GraphModule], op: str) -> str:
    """The innermost module (path and class) whose forward produced the first node calling ``op``
    (or an op of the same name that the ONNX exporter's decompositions turned into it)."""
    base = op.split(".")[1] if op.count(".") >= 2 else op
    found = None
    for graph_module in graph_modules:
        for node in graph_module.graph.nodes:
            if node.op == "call_function" and (str(node.target) == op or base in str(node.target)):
                stack = node.meta.get("nn_module_stack") or {}
                if stack:
                    path, cls = list(stack.values())[-1]
                    cls_name = cls if isinstance(cls, str) else getattr(cls, "__qualname__", str(cls))
                    return f"module {_strip(str(path)) or 'root'} ({cls_name.rsplit('.', 1)[-1]})"
                found = found or f"node {node.name}"
    return found or "the joint graph"


def _capture(model, kind, loss_fn, example_inputs, batch, axes) -> torch.export.ExportedProgram:
    """torch.export of the training loss (``kind`` "train") or of the model's forward."""
    if kind == "train":
        wrapper = _LossModule(model, loss_fn, len(example_inputs))
        return _torch_export(wrapper, batch, (_dynamic_shapes(batch, axes),))  # forward(*batch): one varargs entry
    return _torch_export(_TensorOutputs(model), example_inputs, (_dynamic_shapes(example_inputs, axes),))


@dataclasses.dataclass(frozen=True)
class ParameterUse:
    """How a captured program reads the module's parameters.

    ``names`` is the graph input name of each parameter target: a tied parameter (one tensor
    under several names) is one input, named by its first name, whichever alias torch.export
    routed its uses through. ``dropped`` are the other aliases (inputs removed after export),
    ``tied`` maps each alias to the name it shares, and ``unused`` are trainable parameters the
    outputs do not depend on: kept as state, never updated (DDP's ``find_unused_parameters``).
    """

    names: dict[str, str]
    dropped: frozenset[str]
    tied: dict[str, str]
    unused: tuple[str, ...]
    unreached: frozenset[str]  # parameter targets whose placeholder no output depends on


def _reaching_outputs(graph: torch.fx.Graph) -> set[str]:
    """Names of the nodes that some output of ``graph`` depends on."""
    seen: set[str] = set()
    stack = [graph.output_node()]
    while stack:
        for node in stack.pop().all_input_nodes:
            if node.name not in seen:
                seen.add(node.name)
                stack.append(node)
    return seen


def _parameter_use(program: torch.export.ExportedProgram, module: torch.nn.Module) -> ParameterUse:
    from torch.export.graph_signature import InputKind

    specs = [s for s in program.graph_signature.input_specs if s.kind == InputKind.PARAMETER]
    placeholder = {s.target: s.arg.name for s in specs}
    reached = _reaching_outputs(program.graph)
    groups: dict[int, list[str]] = {}
    tensors = dict(module.named_parameters(remove_duplicate=False))
    for target, tensor in tensors.items():
        groups.setdefault(id(tensor), []).append(target)
    names, dropped, tied, unused = {}, set(), {}, []
    for spec in specs:
        group = [t for t in groups.get(id(tensors.get(spec.target)), [spec.target]) if t in placeholder]
        used = [t for t in group if placeholder[t] in reached]
        if len(used) > 1:
            raise ExportError(
                f"tied parameter {_strip(group[0])} is read under several names ({', '.join(map(_strip, used))}); "
                "tie it by assigning one Parameter object, not copies that share storage"
            )
        keeper = used[0] if used else group[0]
        first = _strip(group[0])
        names[spec.target] = first if spec.target == keeper else f"{_strip(spec.target)}.tied_alias"
        if spec.target != keeper:
            dropped.add(spec.target)
        if spec.target != group[0]:
            tied[_strip(spec.target)] = first
        if not used and spec.target == keeper and tensors[spec.target].requires_grad:
            unused.append(first)
    unreached = frozenset(t for t in placeholder if placeholder[t] not in reached)
    return ParameterUse(names, frozenset(dropped), tied, tuple(unused), unreached)


def _stop_gradients(program: torch.export.ExportedProgram, targets) -> None:
    """Mark parameter inputs as not requiring a gradient for the joint graph (torch refuses a
    trainable parameter that receives none)."""
    placeholder = {s.target: s.arg.name for s in program.graph_signature.input_specs}
    names = {placeholder[t] for t in targets}
    for node in program.graph.nodes:
        if node.op == "placeholder" and node.name in names:
            value = node.meta["val"]
            with value.fake_mode:
                node.meta["val"] = value.detach()


def _drop_inputs(graph: ir.Graph, names) -> None:
    """Remove graph inputs that no node reads (the unused aliases of tied parameters)."""
    for value in [v for v in graph.inputs if v.name in names]:
        if value.uses():
            raise ExportError(f"input {value.name!r} is still read after export; report this model")
        graph.inputs.remove(value)


def _settle_inputs(graph: ir.Graph, arguments: GraphArguments, out_names, use: ParameterUse, *, what: str) -> dict:
    """Name the exported graph's inputs and outputs, drop tied aliases, inline constants; the
    roles of the inputs that remain."""
    _rename_signature(graph, arguments.names, out_names, what=what)
    dropped = {use.names[t] for t in use.dropped}
    _drop_inputs(graph, dropped)
    _inline_constants(graph, arguments.constants)
    return {n: r for n, r in zip(arguments.names, arguments.roles) if n not in dropped and r is not None}


def _export_train(ep, wrapper, batch, batch_names, axes, optimizer, name, phase=lambda _: None):
    """The joint forward/backward of the captured loss ``ep`` of ``wrapper``, in ONNX, with the
    optimizer appended; ``phase`` hears of each phase as it starts."""
    from torch.export.experimental import _export_forward_backward

    use = _parameter_use(ep, wrapper)
    _stop_gradients(ep, use.unreached)
    if use.unused:
        logger.warning("%s: parameters the loss does not depend on are kept and never updated: %s",
                       name, ", ".join(use.unused))
    phase("building the joint forward/backward graph")
    try:
        with _export_context():
            joint = _export_forward_backward(ep)
    except Exception as e:
        raise ExportError(f"torch could not build the backward graph ({type(e).__name__}: {e})") from e

    from torch.export.graph_signature import OutputKind

    arguments = _graph_arguments(
        joint, joint.graph_signature.input_specs, wrapper, batch, batch_names, axes, use.names,
        what=f"the joint graph of {name}",
    )

    out_names, out_roles, grad_of = [], [], {}
    for spec in joint.graph_signature.output_specs:
        if spec.kind == OutputKind.LOSS_OUTPUT:
            out_names.append(LOSS_OUTPUT)
            out_roles.append(Role.LOSS)
        elif spec.kind == OutputKind.BUFFER_MUTATION:
            out_names.append(optimizers.updated_name(_strip(spec.target)))
            out_roles.append(Role.BUFFER)
        elif spec.kind == OutputKind.GRADIENT_TO_PARAMETER:
            out_names.append(f"{use.names[spec.target]}.grad")
            out_roles.append(Role.GRAD)
            grad_of[out_names[-1]] = use.names[spec.target]
        else:
            raise ExportError(f"unsupported output kind {spec.kind} in the joint graph of {name}")

    phase("translating the joint graph to ONNX")
    ir_model = _onnx_export(joint.graph_module, tuple(arguments.values), tuple(arguments.dynamic), origin=ep.graph_module)
    graph = ir_model.graph
    roles = _settle_inputs(graph, arguments, out_names, use, what=f"the training step of {name}")
    roles.update(zip(out_names, out_roles))
    pairs = {_base(n): n for n, r in zip(out_names, out_roles) if r == Role.BUFFER}
    _match_state_shapes(graph, pairs)
    if optimizer is not None:
        phase(f"appending the {type(optimizer).__name__} update")
        append_optimizer(graph, optimizer, grad_of, roles, pairs)
    return _finish(ir_model, roles, pairs, name, dict(zip(batch_names, axes)), use)


def _export_eval(ep, model, example_inputs, input_names, axes, name, phase=lambda _: None):
    use = _parameter_use(ep, model)
    arguments = _graph_arguments(
        ep, ep.graph_signature.input_specs, model, example_inputs, input_names, axes, use.names,
        what=f"the forward graph of {name}",
    )
    phase("translating the forward graph to ONNX")
    ir_model = _onnx_export(ep.graph_module, tuple(arguments.values), tuple(arguments.dynamic))
    graph = ir_model.graph
    out_names = ["output"] if len(graph.outputs) == 1 else [f"output{i}" for i in range(len(graph.outputs))]
    roles = _settle_inputs(graph, arguments, out_names, use, what=f"the forward graph of {name}")
    roles.update({n: Role.ACTIVATION for n in out_names})
    return _finish(ir_model, roles, {}, name, dict(zip(input_names, axes)), use)


@dataclasses.dataclass(frozen=True)
class GraphArguments:
    """Positional arguments of an exported graph module, with the ONNX input name, role and
    dynamic shape of each; ``constants`` are the lifted constant tensors among them (by input
    name), which become Constant nodes after export."""

    values: list
    names: list[str]
    roles: list[Role | None]
    dynamic: list
    constants: dict[str, torch.Tensor]


def _graph_arguments(program, input_specs, module, user_values, user_names, axes, param_names, *, what: str):
    """The arguments of ``program``'s graph (``input_specs`` order): parameters named by
    ``param_names`` (target -> name), buffers by FQN, user inputs by the names the caller gave,
    constant tensors by their target."""
    from torch.export.graph_signature import InputKind

    params = dict(module.named_parameters(remove_duplicate=False))
    buffers = dict(module.named_buffers(remove_duplicate=False))
    args, names, roles, dynamic, constants = [], [], [], [], {}
    user_index = 0
    for spec in input_specs:
        if spec.kind in (InputKind.PARAMETER, InputKind.BUFFER):
            is_param = spec.kind == InputKind.PARAMETER
            args.append((params if is_param else buffers)[spec.target].detach())
            names.append(param_names[spec.target] if is_param else _strip(spec.target))
            roles.append(Role.PARAM if is_param else Role.BUFFER)
            dynamic.append(None)
        elif spec.kind == InputKind.USER_INPUT:
            args.append(user_values[user_index])
            names.append(user_names[user_index])
            roles.append(Role.INPUT)
            dynamic.append({i: torch.export.Dim.AUTO for i in axes[user_index]} or None)
            user_index += 1
        elif spec.kind == InputKind.CONSTANT_TENSOR and isinstance(program.constants.get(spec.target), torch.Tensor):
            args.append(program.constants[spec.target].detach())
            names.append(f"constant.{_strip(spec.target)}")
            roles.append(None)
            dynamic.append(None)
            constants[names[-1]] = args[-1]
        else:
            raise ExportError(f"unsupported input kind {spec.kind} in {what}")
    return GraphArguments(args, names, roles, dynamic, constants)


def _inline_constants(graph: ir.Graph, constants: Mapping[str, torch.Tensor]) -> None:
    """Replace the graph inputs of lifted constant tensors by Constant nodes holding their values."""
    for value in [v for v in graph.inputs if v.name in constants]:
        tensor = constants[value.name]
        try:
            array = tensor.cpu().numpy()
        except TypeError as e:
            raise ExportError(f"constant tensor {value.name!r} has dtype {tensor.dtype}, which has no ONNX constant here") from e
        node = ir.node("Constant", [], {"value": ir.tensor(array)}, name=f"export/{value.name}")
        if len(graph):
            graph.insert_before(graph[0], node)
        else:
            graph.append(node)
        node.outputs[0].name = f"{value.name}.value"
        node.outputs[0].dtype, node.outputs[0].shape = value.dtype, value.shape
        value.replace_all_uses_with(node.outputs[0])
        graph.inputs.remove(value)


def _strip(target: str) -> str:
    """FQN of a parameter of the wrapped model ("model.layers.0.w" -> "layers.0.w")."""
    return target[len("model.") :] if target.startswith("model.") else target


def _base(updated: str) -> str:
    return updated[: -len(optimizers.UPDATED_SUFFIX)]


def _rename_signature(graph: ir.Graph, input_names: Sequence[str], output_names: Sequence[str], *, what: str) -> None:
    """Name the exported graph's inputs and outputs; ``what`` names the graph in the error raised
    when the ONNX export changed how many there are."""
    if len(graph.inputs) != len(input_names) or len(graph.outputs) != len(output_names):
        raise ExportError(
            f"ONNX export of {what} changed its signature ({len(graph.inputs)} inputs/{len(graph.outputs)} outputs, "
            f"expected {len(input_names)}/{len(output_names)})"
        )
    taken = {v.name for node in graph for v in node.outputs} | {v.name for v in graph.initializers.values()}
    for value, new in zip(graph.inputs, input_names):
        if new in taken:
            raise ExportError(f"value name {new!r} is already used inside the exported graph")
        value.name = new
    outputs = list(graph.outputs)
    for i, (value, new) in enumerate(zip(outputs, output_names)):
        if value.is_graph_input() or value.name in output_names[:i] or any(
            value is other for other in outputs[:i]
        ):
            # An output that is an input or repeats another output gets its own Identity.
            node = ir.node("Identity", [value], name=f"export/identity/{new}")
            graph.append(node)
            node.outputs[0].name = new
            node.outputs[0].dtype, node.outputs[0].shape = value.dtype, value.shape
            graph.outputs[i] = node.outputs[0]
        else:
            value.name = new


def _match_state_shapes(graph: ir.Graph, pairs: Mapping[str, str]) -> None:
    """Give each updated buffer its input's shape (torch's translation of `num_batches_tracked
    + 1` yields shape [1] for a 0-d buffer), so state keeps one shape across steps."""
    inputs = {v.name: v for v in graph.inputs}
    for position, value in enumerate(list(graph.outputs)):
        source = next((s for s, out in pairs.items() if out == value.name), None)
        if source is None:
            continue
        target = inputs[source]
        if value.shape is not None and target.shape is not None and list(value.shape) == list(target.shape):
            continue
        if target.shape is None or not target.shape.is_static():
            raise ExportError(f"buffer {source!r} needs a static shape to be carried across steps")
        dims = ir.tensor(np.array(list(target.shape), dtype=np.int64))
        shape_node = ir.node("Constant", [], {"value": dims}, name=f"export/shape/{source}")
        value.name = f"{value.name}.raw"
        reshape = ir.node("Reshape", [value, shape_node.outputs[0]], name=f"export/reshape/{source}")
        graph.append(shape_node)
        graph.append(reshape)
        reshape.outputs[0].name = pairs[source]
        reshape.outputs[0].dtype, reshape.outputs[0].shape = target.dtype, target.shape
        graph.outputs[position] = reshape.outputs[0]


def append_optimizer(graph: ir.Graph, config, grad_of: dict, roles: dict, pairs: dict) -> None:
    """Append ``config``'s update of every parameter in ``grad_of`` (its gradient) to ``graph``, with
    the new state as outputs paired with the old (``pairs``) and their roles."""
    values = {v.name: v for v in graph.inputs}
    grads = {v.name: v for v in graph.outputs if v.name in grad_of}
    scalar_f = ir.TensorType(ir.DataType.FLOAT)
    lr = ir.Value(name=optimizers.LR_INPUT, type=scalar_f, shape=ir.Shape([]))
    step = ir.Value(name=optimizers.STEP_INPUT, type=scalar_f, shape=ir.Shape([]))
    graph.inputs.extend([lr, step])
    roles[lr.name] = roles[step.name] = Role.OPTIMIZER_STATE
    new_outputs = [v for v in graph.outputs if v.name not in grad_of]
    for grad_name, param_name in grad_of.items():
        param = values[param_name]
        states = {}
        for state in config.state_names:
            sname = optimizers.state_input_name(param_name, state)
            value = ir.Value(name=sname, type=param.type, shape=param.shape)
            graph.inputs.append(value)
            states[state] = value
            roles[sname] = Role.OPTIMIZER_STATE
        updates = optimizers.append_update(
            graph, config, param=param, grad=grads[grad_name], states=states, lr=lr, step=step
        )
        for source, updated in updates.items():
            updated.dtype, updated.shape = param.dtype, param.shape
            new_outputs.append(updated)
            roles[updated.name] = roles[source]
            pairs[source] = updated.name
    graph.outputs.clear()
    graph.outputs.extend(new_outputs)


def _finish(
    ir_model: ir.Model, roles: dict, pairs: dict, name: str, axes: Mapping[str, Mapping[int, str]], use: ParameterUse
) -> TrainingGraph:
    model = ir.to_proto(ir_model)
    model.graph.name = name
    model.metadata_props.add(key=TIED_PARAMS_KEY, value=json.dumps(use.tied, sort_keys=True))
    model.metadata_props.add(key=UNUSED_PARAMS_KEY, value=json.dumps(list(use.unused)))
    _name_dynamic_dims(model, axes)
    _seed_random_ops(model)
    return checked_training_graph(model, roles, pairs, name, what=f"exported graph of {name}")


def checked_training_graph(model: onnx.ModelProto, roles: dict, pairs: dict, name: str, *, what: str) -> TrainingGraph:
    """``model`` as a training graph: every value without a role is an activation, and the model
    passes ONNX's checker (else an ExportError naming ``what``)."""
    for node in model.graph.node:
        for out in node.output:
            if out and out not in roles:
                roles[out] = Role.ACTIVATION
    try:
        onnx.checker.check_model(model)
    except onnx.checker.ValidationError as e:
        raise ExportError(f"{what} is not valid ONNX: {str(e).splitlines()[0]}") from e
    return TrainingGraph(model=model, roles=roles, state_pairs=pairs, name=name)


SEEDED_RANDOM_OPS = ("Dropout", "RandomUniform", "RandomUniformLike", "RandomNormal", "RandomNormalLike",
                     "Bernoulli", "Multinomial")


def _seed_random_ops(model: onnx.ModelProto) -> None:
    """Give every random node without a seed one derived from its name. ONNX Runtime seeds a
    node's generator once per session, so each run then draws the next masks of a fixed
    sequence: the same in one whole-graph session as in block sessions, which makes training
    with Dropout reproducible and lets planned runs equal unplanned ones bitwise."""
    for node in model.graph.node:
        if node.op_type in SEEDED_RANDOM_OPS and not any(a.name == "seed" for a in node.attribute):
            digest = hashlib.sha256(node.name.encode("utf-8")).digest()
            seed = int.from_bytes(digest[:4], "little") & 0x7FFFFFFF
            attr = onnx.helper.make_attribute("seed", float(seed) if node.op_type != "Dropout" else seed)
            node.attribute.append(attr)


def _name_dynamic_dims(model: onnx.ModelProto, axes: Mapping[str, Mapping[int, str]]) -> None:
    """Rename torch's symbols (s0, s17, ...) of the batch and sequence axes to the user's tags
    ("batch", "seq") everywhere in the graph. Axes with the same tag share one name: the user
    said they are the same size (torch may have kept separate symbols for them)."""
    inputs = {v.name: v for v in model.graph.input}
    renames: dict[str, str] = {}
    for input_name, tags in axes.items():
        dims = inputs[input_name].type.tensor_type.shape.dim if input_name in inputs else []
        for axis, tag in tags.items():
            if axis < len(dims) and dims[axis].dim_param and dims[axis].dim_param not in renames:
                renames[dims[axis].dim_param] = tag
    if not renames:
        return
    for value in list(model.graph.input) + list(model.graph.output) + list(model.graph.value_info):
        for dim in value.type.tensor_type.shape.dim:
            if dim.dim_param in renames:
                dim.dim_param = renames[dim.dim_param]


def initial_state(
    graph: TrainingGraph, model: torch.nn.Module, *, lr: float, step: int = 1
) -> dict[str, np.ndarray]:
    """Values of every state input for the first step: parameters, buffers (non-persistent ones
    too: they are not in ``state_dict()``), zero optimizer state."""
    named = {**dict(model.named_buffers()), **model.state_dict(keep_vars=False)}
    tensors = {n: t.detach().cpu().numpy() for n, t in named.items()}
    by_input = {v.name: v for v in graph.graph.input}
    state = {}
    for input_name in graph.state_inputs:
        if input_name == optimizers.LR_INPUT:
            state[input_name] = np.array(lr, dtype=np.float32)
        elif input_name == optimizers.STEP_INPUT:
            state[input_name] = np.array(step, dtype=np.float32)
        elif input_name == optimizers.APPLY_INPUT:
            state[input_name] = np.array(0.0, dtype=np.float32)
        elif input_name in tensors:
            state[input_name] = np.array(tensors[input_name], copy=True, order="C")
        else:
            param_name = input_name.rsplit(".", 1)[0]
            if param_name not in tensors:
                raise ExportError(f"no initial value for state input {input_name!r}")
            state[input_name] = np.zeros_like(tensors[param_name])
        elem = by_input[input_name].type.tensor_type.elem_type
        expected = onnx.helper.tensor_dtype_to_np_dtype(elem)
        if state[input_name].dtype != expected:
            state[input_name] = state[input_name].astype(expected)
    return state
