"""Fixtures for the ORT-training-artifact tests: they run only in the training build's venv.

``make compat-test`` runs them in ``.venv-compat`` (onnxruntime-training-cpu 1.19.2). Where
``onnxruntime.training`` is missing (the main ``.venv``), pytest does not collect them, so
``make test`` is unaffected. Each artifact set is generated once per test session: a forward
model exported with torch's TorchScript exporter, then ORT's ``generate_artifacts``.
"""

from __future__ import annotations

import importlib.util
import io
import math

import pytest

try:
    _HAS_TRAINING = importlib.util.find_spec("onnxruntime.training") is not None
except ModuleNotFoundError:  # no onnxruntime at all
    _HAS_TRAINING = False

collect_ignore_glob = [] if _HAS_TRAINING else ["test_*.py"]

BATCH = 4
SEQ = 8
VOCAB = 50
FEATURES = 16
CLASSES = 4


def _torch_models():
    import torch

    class MLP(torch.nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.fc1 = torch.nn.Linear(FEATURES, 64)
            self.fc2 = torch.nn.Linear(64, 32)
            self.fc3 = torch.nn.Linear(32, CLASSES)

        def forward(self, x):
            return self.fc3(torch.relu(self.fc2(torch.relu(self.fc1(x)))))

    class Block(torch.nn.Module):
        """Pre-norm decoder layer: causal self-attention and a GELU MLP."""

        def __init__(self, d: int, heads: int) -> None:
            super().__init__()
            self.heads = heads
            self.scale = 1.0 / math.sqrt(d // heads)
            self.ln1 = torch.nn.LayerNorm(d)
            self.qkv = torch.nn.Linear(d, 3 * d)
            self.proj = torch.nn.Linear(d, d)
            self.ln2 = torch.nn.LayerNorm(d)
            self.fc = torch.nn.Linear(d, 4 * d)
            self.out = torch.nn.Linear(4 * d, d)

        def forward(self, x, mask):
            b, t, d = x.shape
            h = self.heads
            q, k, v = (z.reshape(b, t, h, d // h).transpose(1, 2) for z in self.qkv(self.ln1(x)).chunk(3, dim=-1))
            att = torch.softmax(q @ k.transpose(-1, -2) * self.scale + mask, dim=-1)
            x = x + self.proj((att @ v).transpose(1, 2).reshape(b, t, d))
            return x + self.out(torch.nn.functional.gelu(self.fc(self.ln2(x))))

    class TinyGPT(torch.nn.Module):
        def __init__(self, d: int = 32, heads: int = 2, layers: int = 2) -> None:
            super().__init__()
            self.tok = torch.nn.Embedding(VOCAB, d)
            self.pos = torch.nn.Parameter(torch.randn(SEQ, d) * 0.02)
            self.blocks = torch.nn.ModuleList([Block(d, heads) for _ in range(layers)])
            self.lnf = torch.nn.LayerNorm(d)
            self.head = torch.nn.Linear(d, VOCAB)
            self.register_buffer("mask", torch.triu(torch.full((SEQ, SEQ), -1e9), 1))

        def forward(self, ids):
            x = self.tok(ids) + self.pos
            for block in self.blocks:
                x = block(x, self.mask)
            return self.head(self.lnf(x)).reshape(-1, VOCAB)  # (tokens, classes) for the loss

    return MLP, TinyGPT


def _export(module, example, input_name: str, dynamic_axes):
    """Forward ONNX of ``module`` with every parameter its own initializer."""
    import onnx
    import torch

    torch.manual_seed(0)
    with torch.no_grad():  # distinct values: the exporter merges identical initializers (LayerNorm ones)
        for p in module.parameters():
            p.add_(0.05 * torch.randn_like(p))
    buffer = io.BytesIO()
    torch.onnx.export(
        module, (example,), buffer, input_names=[input_name], output_names=["logits"], dynamic_axes=dynamic_axes,
        opset_version=17, do_constant_folding=False, dynamo=False,
    )
    return onnx.load_from_string(buffer.getvalue()), [n for n, _ in module.named_parameters()]


@pytest.fixture(scope="session")
def artifacts(tmp_path_factory):
    """name -> (training_model.onnx path, batch shapes for symbolic inputs, number of classes:
    labels and token ids are below it) for the MLP and the tiny transformer."""
    import onnxruntime
    import torch

    from ort_offload.export.ort_artifacts import generate_training_artifacts

    onnxruntime.set_default_logger_severity(3)
    MLP, TinyGPT = _torch_models()
    root = tmp_path_factory.mktemp("ort_artifacts")
    made = {}
    torch.manual_seed(0)
    model, params = _export(MLP(), torch.randn(BATCH, FEATURES), "x", {"x": {0: "batch"}, "logits": {0: "batch"}})
    made["mlp"] = (generate_training_artifacts(model, requires_grad=params, directory=root / "mlp"),
                   {"x": (BATCH, FEATURES), "labels": (BATCH,)}, CLASSES)
    torch.manual_seed(0)
    model, params = _export(TinyGPT(), torch.randint(0, VOCAB, (BATCH, SEQ)), "ids", None)
    made["gpt"] = (generate_training_artifacts(model, requires_grad=params, directory=root / "gpt"), {}, VOCAB)
    return made
