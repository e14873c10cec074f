"""The pilot network: three parallel MLPs, one per network type (DyNN-Offload §IV-C).

Owns :class:`PilotNet` (torch, for training), :data:`DEFAULT_HIDDEN` and :func:`export_onnx`
(the trained net as a graph of one ``ai.ort_offload::pilot_model_inference`` node,
:mod:`custom_ops.pilot`).

Shape. Input: the feature vector of :func:`pilot.features.feature_vector`, standardized with the
training set's mean and standard deviation (stored in the net and in the ONNX graph). Each MLP:
input layer ``F → H``, hidden ``H → H``, output ``H → O`` with LeakyReLU between (the paper's
input layer, two hidden layers, output layer), ``O`` = :func:`pilot.mapping.output_size`. The
network-type one-hot selects the MLP whose output counts. Width ``H = 48``: three MLPs then hold
~47k parameters (F = 170 inputs; ~190 KB as float32), small enough to commit and to run well
under 30 µs; the paper's own numbers (3,260 parameters vs. 512 neurons per layer) contradict
each other, so the width was chosen by the accuracy/latency measured here
(``benchmarks/pilot_bench.py``). Width is not what limits accuracy: 96 wide gave the same
per-family exact-path accuracy as 48 in our runs (the limits are in the inputs, see
:mod:`pilot.train`).
"""

from __future__ import annotations

import numpy as np
import onnx
import torch
from torch import nn

from custom_ops.pilot import LEAKY_RELU_SLOPE, PILOT_NETWORK_TYPES, make_pilot_graph
from pilot.features import NETWORK_TYPES

__all__ = ["DEFAULT_HIDDEN", "PilotNet", "export_onnx"]

DEFAULT_HIDDEN = 48
assert NETWORK_TYPES == PILOT_NETWORK_TYPES, "the op's MLP order must be the one-hot's order"


class PilotNet(nn.Module):
    """``(features[N, F], one_hot[N, 3]) -> raw[N, O]``: the selected MLP's output."""

    def __init__(self, features: int, outputs: int, hidden: int = DEFAULT_HIDDEN) -> None:
        super().__init__()
        self.register_buffer("mean", torch.zeros(features))
        self.register_buffer("std", torch.ones(features))
        self.mlps = nn.ModuleList(
            nn.Sequential(
                nn.Linear(features, hidden), nn.LeakyReLU(LEAKY_RELU_SLOPE),
                nn.Linear(hidden, hidden), nn.LeakyReLU(LEAKY_RELU_SLOPE),
                nn.Linear(hidden, outputs),
            )
            for _ in NETWORK_TYPES
        )

    def set_standardization(self, features: np.ndarray) -> None:
        """Mean and standard deviation (floor 1e-6 → 1) of the training features."""
        mean = features.mean(axis=0)
        std = features.std(axis=0)
        std[std < 1e-6] = 1.0
        self.mean.copy_(torch.as_tensor(mean, dtype=torch.float32))
        self.std.copy_(torch.as_tensor(std, dtype=torch.float32))

    def forward(self, features: torch.Tensor, one_hot: torch.Tensor) -> torch.Tensor:
        x = (features - self.mean) / self.std
        return sum(one_hot[:, t : t + 1] * mlp(x) for t, mlp in enumerate(self.mlps))

    def parameter_count(self) -> int:
        return sum(p.numel() for p in self.parameters())


def export_onnx(net: PilotNet, *, metadata: dict[str, str] | None = None) -> onnx.ModelProto:
    """The trained ``net`` as a ``pilot_model_inference`` graph (weights as initializers)."""
    weights = {"mean": net.mean.numpy(), "std": net.std.numpy()}
    for t, mlp in zip(NETWORK_TYPES, net.mlps):
        linears = [m for m in mlp if isinstance(m, nn.Linear)]
        for layer, linear in enumerate(linears):
            weights[f"w{layer}_{t}"] = linear.weight.detach().numpy().T.copy()
            weights[f"b{layer}_{t}"] = linear.bias.detach().numpy().copy()
    features = net.mean.shape[0]
    outputs = net.mlps[0][-1].out_features
    return make_pilot_graph(weights, feature_size=features, output_size=outputs, metadata=metadata)
