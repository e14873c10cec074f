"""The ``ai.ort_offload`` op set: schemas, ONNX-function reference bodies and runtime meanings.

Every op ort_offload writes into a graph lives in :data:`DOMAIN` and carries an ONNX-function
body with reference semantics, so stock ONNX Runtime runs a rewritten graph and gives the same
numbers. The runtime registers its own meaning for each op through :mod:`custom_ops.registry`.
"""

from custom_ops.registry import DOMAIN, OPSET_VERSION, OpDefinition, OpRegistry, default_registry

__all__ = ["DOMAIN", "OPSET_VERSION", "OpDefinition", "OpRegistry", "default_registry"]
