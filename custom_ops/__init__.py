"""The ``ai.ort_offload`` op set: schemas, ONNX-function reference bodies and runtime meanings.

Every op ort_offload writes into a graph lives in :data:`DOMAIN` and carries an ONNX-function
body with reference semantics, so stock ONNX Runtime runs a rewritten graph and gives the same
numbers. The runtime registers its own meaning for each op through :mod:`custom_ops.registry`.
Importing this package registers every op of the set in :data:`default_registry`.
"""

from custom_ops.registry import DOMAIN, OPSET_VERSION, OpDefinition, OpRegistry, default_registry
from custom_ops.swap import SWAP_IN, SWAP_OUT, attach_functions, make_swap_in, make_swap_out
from custom_ops.pilot import PILOT_MODEL_INFERENCE, make_pilot_graph

__all__ = [
    "DOMAIN",
    "OPSET_VERSION",
    "OpDefinition",
    "OpRegistry",
    "default_registry",
    "SWAP_IN",
    "SWAP_OUT",
    "attach_functions",
    "make_swap_in",
    "make_swap_out",
    "PILOT_MODEL_INFERENCE",
    "make_pilot_graph",
]
