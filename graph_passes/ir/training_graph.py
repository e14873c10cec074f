"""A training-step graph: an ONNX model plus the role of every value and the state it carries.

One step reads parameters, optimizer state and buffers as graph inputs and writes their updated
versions as graph outputs; ``state_pairs`` maps each such input to the output that replaces it
for the next step. Roles and pairs are stored in the model's ``metadata_props`` so a saved graph
is self-describing: ``TrainingGraph.load`` of a file written by ``ort_offload.export.training_step`` recovers
them; a foreign graph gets roles inferred from its structure.
"""

from __future__ import annotations

import dataclasses
import enum
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Mapping

import onnx

from graph_passes.ir.liveness import ancestor_nodes

ROLES_KEY = "ort_offload.roles"
STATE_PAIRS_KEY = "ort_offload.state_pairs"
MODEL_NAME_KEY = "ort_offload.model"
DATA_INPUTS_KEY = "ort_offload.data_inputs"
TIED_PARAMS_KEY = "ort_offload.tied_params"  # written by the exporter: {alias: name}
UNUSED_PARAMS_KEY = "ort_offload.unused_params"


class Role(str, enum.Enum):
    """What a value is in a training step."""

    INPUT = "input"  # a batch tensor: model input or target
    PARAM = "param"
    GRAD = "grad"
    OPTIMIZER_STATE = "optimizer_state"  # moments, momentum buffers, step count, learning rate
    BUFFER = "buffer"  # non-trainable module state updated by the step (BatchNorm running stats)
    ACTIVATION = "activation"
    LOSS = "loss"


# Initializer bytes from which a graph is saved with external data (protobuf's limit is 2 GiB).
EXTERNAL_DATA_BYTES = 1 << 30

# Roles whose values persist across steps (resident state of the trainer).
STATE_ROLES = frozenset({Role.PARAM, Role.OPTIMIZER_STATE, Role.BUFFER})


@dataclasses.dataclass
class TrainingGraph:
    """An ONNX training step and what its values are.

    ``roles`` covers every graph input, graph output and node output. ``state_pairs`` maps a
    state input name to the output name holding its value after the step.
    """

    model: onnx.ModelProto
    roles: dict[str, Role]
    state_pairs: dict[str, str]
    name: str = "graph"

    @property
    def graph(self) -> onnx.GraphProto:
        return self.model.graph

    @property
    def input_names(self) -> list[str]:
        return [v.name for v in self.model.graph.input]

    @property
    def output_names(self) -> list[str]:
        return [v.name for v in self.model.graph.output]

    @property
    def data_inputs(self) -> list[str]:
        """Inputs fed per step (batch tensors), in graph order."""
        return [n for n in self.input_names if self.roles.get(n) == Role.INPUT]

    @property
    def state_inputs(self) -> list[str]:
        return [n for n in self.input_names if self.roles.get(n) in STATE_ROLES]

    @property
    def loss_name(self) -> str | None:
        for name in self.output_names:
            if self.roles.get(name) == Role.LOSS:
                return name
        return None

    @property
    def step_fetches(self) -> list[str] | None:
        """What one step hands back: the loss, then every other output that is not a state
        update (the gradients of a graph without an optimizer, e.g. an ORT training artifact);
        None (every output but the state updates) for a graph without a loss."""
        loss = self.loss_name
        if loss is None:
            return None
        updates = set(self.state_pairs.values())
        return [loss] + [n for n in self.output_names if n != loss and n not in updates]

    def forward_part(self) -> "TrainingGraph":
        """The step without its backward and update: the nodes the loss and the updated buffers
        depend on, with those as the only outputs (the same inputs, so the same state).

        What a training-mode forward computes when no gradient is wanted; buffers (BatchNorm
        running statistics) are updated as the whole step updates them. A graph whose loss
        is unknown has no such part (:class:`ValueError`)."""
        loss = self.loss_name
        if loss is None:
            raise ValueError(f"{self.name}: a graph without a loss output has no forward part")
        buffers = {k: v for k, v in self.state_pairs.items() if self.roles.get(k) == Role.BUFFER}
        outputs = [loss, *buffers.values()]
        nodes = list(self.model.graph.node)
        keep = sorted(ancestor_nodes(nodes, outputs))
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        graph = model.graph
        del graph.node[:]
        graph.node.extend(nodes[i] for i in keep)
        kept_outputs = [o for o in self.model.graph.output if o.name in set(outputs)]
        del graph.output[:]
        graph.output.extend(kept_outputs)
        values = {v.name for v in graph.input} | {o for i in keep for o in nodes[i].output}
        kept_info = [v for v in self.model.graph.value_info if v.name in values]
        del graph.value_info[:]
        graph.value_info.extend(kept_info)
        roles = {k: r for k, r in self.roles.items() if k in values}
        return TrainingGraph(model=model, roles=roles, state_pairs=buffers, name=self.name)

    def names_with_role(self, role: Role) -> list[str]:
        return [n for n, r in self.roles.items() if r == role]

    @property
    def tied_params(self) -> dict[str, str]:
        """Each alias of a tied parameter and the name of the one state input it shares."""
        return json.loads(self._prop(TIED_PARAMS_KEY) or "{}")

    @property
    def unused_params(self) -> list[str]:
        """Trainable parameters the loss does not depend on: kept as state, never updated."""
        return json.loads(self._prop(UNUSED_PARAMS_KEY) or "[]")

    def _prop(self, key: str) -> str | None:
        return next((p.value for p in self.model.metadata_props if p.key == key), None)

    # ---- persistence -------------------------------------------------------------------

    def with_metadata(self) -> onnx.ModelProto:
        """The model with roles and state pairs written into ``metadata_props``."""
        model = onnx.ModelProto()
        model.CopyFrom(self.model)
        props = {p.key: p.value for p in model.metadata_props}
        props[ROLES_KEY] = json.dumps({k: v.value for k, v in self.roles.items()}, sort_keys=True)
        props[STATE_PAIRS_KEY] = json.dumps(self.state_pairs, sort_keys=True)
        props[MODEL_NAME_KEY] = self.name
        del model.metadata_props[:]
        for key in sorted(props):
            model.metadata_props.add(key=key, value=props[key])
        return model

    def save(self, path: str | os.PathLike, *, external_data_bytes: int = EXTERNAL_DATA_BYTES) -> Path:
        """Write the graph atomically (temporary files, then renames).

        When its initializers hold ``external_data_bytes`` or more (protobuf cannot serialize
        2 GiB), they go to ``<name>.data`` beside the file, as ONNX external data.
        """
        path = Path(path)
        model = self.with_metadata()
        data_bytes = sum(len(t.raw_data) or 4 * len(t.float_data) for t in model.graph.initializer)
        if data_bytes < external_data_bytes:
            tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
            try:
                onnx.save_model(model, tmp)
                os.replace(tmp, path)
            finally:
                tmp.unlink(missing_ok=True)
            return path
        data_name = f"{path.name}.data"
        tmp_dir = Path(tempfile.mkdtemp(prefix=f".{path.name}.", dir=path.parent))
        try:
            onnx.save_model(model, tmp_dir / path.name, save_as_external_data=True, all_tensors_to_one_file=True,
                            location=data_name, size_threshold=1024)
            os.replace(tmp_dir / data_name, path.with_name(data_name))  # the data first: the model points at it
            os.replace(tmp_dir / path.name, path)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        return path

    @classmethod
    def from_model(cls, model: onnx.ModelProto, *, name: str | None = None) -> "TrainingGraph":
        """Wrap a model, reading roles from its metadata or inferring them from its structure."""
        props = {p.key: p.value for p in model.metadata_props}
        if ROLES_KEY in props:
            roles = {k: Role(v) for k, v in json.loads(props[ROLES_KEY]).items()}
            pairs = json.loads(props.get(STATE_PAIRS_KEY, "{}"))
        else:
            roles, pairs = infer_roles(model)
        graph_name = name or props.get(MODEL_NAME_KEY) or model.graph.name or "graph"
        return cls(model=model, roles=roles, state_pairs=pairs, name=graph_name)


def infer_roles(model: onnx.ModelProto) -> tuple[dict[str, Role], dict[str, str]]:
    """Roles for a graph without our metadata.

    An input whose name reappears as an output with a common "updated" suffix is state; a
    floating-point scalar output named like a loss (or the first scalar output) is the loss;
    everything else is a batch input or an activation.
    """
    graph = model.graph
    outputs = [o.name for o in graph.output]
    output_set = set(outputs)
    roles: dict[str, Role] = {}
    pairs: dict[str, str] = {}
    for value in graph.input:
        for suffix in (".updated", "_updated", ".new", "_new", "_out", ".out"):
            if value.name + suffix in output_set:
                pairs[value.name] = value.name + suffix
                break
        roles[value.name] = Role.PARAM if value.name in pairs else Role.INPUT
    for name, out in pairs.items():
        roles[out] = roles[name]
    for node in graph.node:
        for out in node.output:
            if out and out not in roles:
                roles[out] = Role.ACTIVATION
    loss = next((o for o in outputs if "loss" in o.lower()), None)
    if loss is None:
        loss = next((o.name for o in graph.output if _is_scalar(o)), None)
    if loss is not None:
        roles[loss] = Role.LOSS
    return roles, pairs


def _is_scalar(value: onnx.ValueInfoProto) -> bool:
    tensor_type = value.type.tensor_type
    return tensor_type.HasField("shape") and len(tensor_type.shape.dim) == 0


def role_counts(roles: Mapping[str, Role]) -> dict[str, int]:
    counts: dict[str, int] = {}
    for role in roles.values():
        counts[role.value] = counts.get(role.value, 0) + 1
    return dict(sorted(counts.items()))
