"""Input-aware recompute planning (Mimose): a per-layer memory estimator, the greedy bucket
rule, and a plan cache shared by similar input sizes.

Mimose (§4.3-4.4, Algorithm 1) plans per mini-batch: a quadratic in the input size predicts each
layer's saved activations, and a greedy rule picks layers to recompute until their predicted
bytes cover the excess over the budget, all in under a millisecond, so a new input size costs
no profiling run. Here a *layer* is a forward segment (:func:`graph_passes.planning.recompute.planner.forward_segments`)
and the *input size* is the element count of the step's data inputs (Mimose §3.1's definition).

- :class:`QuadraticFit`, :class:`LayerMemoryEstimator`: least-squares ``a·x² + b·x + c`` per
  layer (and for the graph's least budget without recompute), fitted once from the first
  :data:`FIT_SIZES` distinct sizes and then frozen, as in the paper. The samples are exact
  (saved bytes from shape inference, the least budget from the memory replay), so for
  transformers, whose activations are at most quadratic in the sequence length, the fit is
  exact; the estimator records its relative error per layer on every later size.
- :func:`bucket_choice`: Algorithm 1's choice of the next layer: layers within
  :data:`BUCKET_TOLERANCE` of each other share a bucket, earliest layer first within a bucket;
  the bucket whose largest layer is the smallest one still covering the excess, else the bucket
  of the largest layer. :func:`plan_from_estimates` runs the rule on predicted bytes alone (the
  sub-millisecond plan); the runtime then checks the plan with one memory replay and, if the
  estimate fell short, keeps choosing by the same rule with measured excess.
- :class:`PlanCache`: plans keyed by a size bucket (sizes within :data:`CACHE_GRANULARITY` of
  each other share one; the paper leaves the threshold open). A plan serves any size its
  check passes; one that fails for a larger size is replaced.
"""

from __future__ import annotations

import dataclasses
import math
from typing import TYPE_CHECKING, Generic, Hashable, Mapping, Sequence, TypeVar

import numpy as np

if TYPE_CHECKING:  # numpy alone at run time: benchmarks/gpu_mimose.py uses this module without onnx
    from graph_passes.ir.shapes import TensorInfo

FIT_SIZES = 10  # distinct input sizes the estimator is fitted from (Mimose §6.3: 10 iterations)
BUCKET_TOLERANCE = 0.10  # layers within 10% of each other share a bucket (Algorithm 1, line 8)
CACHE_GRANULARITY = 0.10  # sizes within 10% share a cached plan

T = TypeVar("T")


def input_size(infos: Mapping[str, TensorInfo], data_inputs: Sequence[str]) -> int:
    """Elements in the step's data inputs (batch × sequence for token ids)."""
    return sum(math.prod(infos[n].shape) for n in data_inputs if n in infos)


class QuadraticFit:
    """``y ≈ a·x² + b·x + c`` by least squares over the samples given (with fewer than three
    distinct sizes the polynomial degree drops to what they determine)."""

    def __init__(self, xs: Sequence[float], ys: Sequence[float]) -> None:
        if len(xs) != len(ys) or not xs:
            raise ValueError("QuadraticFit needs as many sizes as values, at least one")
        x = np.asarray(xs, dtype=np.float64)
        self._scale = float(np.max(np.abs(x))) or 1.0  # conditioning: fit on x / max|x|
        degree = min(2, len(set(xs)) - 1)
        self.coefficients = np.polyfit(x / self._scale, np.asarray(ys, dtype=np.float64), degree)
        # Evaluated with Python floats (Horner): a plan evaluates one fit per layer, and
        # np.polyval's per-call overhead alone would be most of the sub-millisecond plan time.
        self._horner = tuple(float(c) for c in self.coefficients)

    def __call__(self, x: float) -> float:
        t = x / self._scale
        value = 0.0
        for c in self._horner:
            value = value * t + c
        return value


@dataclasses.dataclass
class LayerMemoryEstimator:
    """Per-layer saved bytes and the no-recompute least budget as quadratics in the input size.

    ``observe`` records exact samples until :attr:`fit_sizes` distinct sizes are in, then fits
    and freezes; after that it records, for each new size, each layer's relative error
    ``|predicted − actual| / actual``."""

    layers: int
    fit_sizes: int = FIT_SIZES
    samples: dict[int, tuple[tuple[int, ...], int]] = dataclasses.field(default_factory=dict)  # size -> (layer bytes, need)
    errors: list[list[float]] = dataclasses.field(default_factory=list)  # per layer, one per size after the fit
    _layer_fits: list[QuadraticFit] | None = None
    _need_fit: QuadraticFit | None = None

    @property
    def ready(self) -> bool:
        return self._layer_fits is not None

    def observe(self, size: int, layer_bytes: Sequence[int], need_bytes: int | None = None) -> None:
        """One exact sample: the layers' saved bytes at ``size`` and, while fitting, the least
        budget without recompute (``None`` when it was not measured at this size)."""
        if len(layer_bytes) != self.layers:
            raise ValueError(f"expected {self.layers} layer sizes, got {len(layer_bytes)}")
        if self.ready:
            if size not in self.samples:
                predicted = self.predict_layers(size)
                if not self.errors:
                    self.errors = [[] for _ in range(self.layers)]
                for k, (p, actual) in enumerate(zip(predicted, layer_bytes)):
                    self.errors[k].append(abs(p - actual) / actual if actual else float(p != 0))
                self.samples[size] = (tuple(layer_bytes), -1)
            return
        if need_bytes is None or size in self.samples:
            return
        self.samples[size] = (tuple(int(b) for b in layer_bytes), int(need_bytes))
        if len(self.samples) >= self.fit_sizes:
            self._fit()

    def _fit(self) -> None:
        sizes = sorted(self.samples)
        self._layer_fits = [QuadraticFit(sizes, [self.samples[s][0][k] for s in sizes]) for k in range(self.layers)]
        self._need_fit = QuadraticFit(sizes, [self.samples[s][1] for s in sizes])

    def predict_layers(self, size: int) -> list[float]:
        if self._layer_fits is None:
            raise RuntimeError("the estimator is not fitted yet")
        return [max(0.0, fit(size)) for fit in self._layer_fits]

    def predict_need(self, size: int) -> float:
        if self._need_fit is None:
            raise RuntimeError("the estimator is not fitted yet")
        return self._need_fit(size)

    def error_summary(self) -> list[dict[str, float]]:
        """Per layer: sizes predicted, median and largest relative error."""
        out = []
        for k, errs in enumerate(self.errors):
            out.append({"layer": k, "sizes": len(errs), "median": float(np.median(errs)) if errs else math.nan,
                        "max": max(errs) if errs else math.nan})
        return out


def bucket_choice(estimates: Mapping[int, float], excess: float, *, tolerance: float = BUCKET_TOLERANCE) -> int:
    """The next layer to recompute among ``estimates`` (layer index → bytes; index order is
    forward order), for ``excess`` bytes still over the budget (Algorithm 1, lines 2-21)."""
    if not estimates:
        raise ValueError("no layer left to choose")
    return _choose(sorted(estimates, key=lambda k: (-estimates[k], k)), estimates, excess, tolerance)


def _choose(by_size: Sequence[int], estimates: Mapping[int, float], excess: float, tolerance: float) -> int:
    """:func:`bucket_choice` over ``by_size``, the layers largest first (ties: earliest)."""
    buckets: list[list[int]] = []
    position = 0
    while position < len(by_size):
        head = by_size[position]
        bucket = [head]
        position += 1
        while position < len(by_size) and estimates[by_size[position]] > estimates[head] * (1 - tolerance):
            bucket.append(by_size[position])
            position += 1
        buckets.append(bucket)
    # A bucket's largest layer is its head (the list is largest first); the earliest layer of
    # a bucket is its smallest index.
    covering = [b for b in buckets if estimates[b[0]] >= excess]
    if covering:  # the bucket nearest the excess: the smallest largest-layer that still covers it
        return min(min(covering, key=lambda b: estimates[b[0]]))
    return min(buckets[0])  # nothing covers it: the largest layers' bucket


def plan_from_estimates(estimates: Sequence[float], excess: float, *, tolerance: float = BUCKET_TOLERANCE) -> tuple[int, ...]:
    """Layers (sorted) whose estimated bytes cover ``excess`` by the bucket rule, or all of them."""
    remaining = {k: float(e) for k, e in enumerate(estimates) if e > 0}
    if excess <= 0:
        return ()
    if sum(remaining.values()) <= excess:  # the rule would take every layer, one by one
        return tuple(sorted(remaining))
    by_size = sorted(remaining, key=lambda k: (-remaining[k], k))  # sorted once; picks leave the order
    chosen = []
    while excess > 0 and by_size:
        pick = _choose(by_size, remaining, excess, tolerance)
        chosen.append(pick)
        by_size.remove(pick)
        excess -= remaining[pick]
    return tuple(sorted(chosen))


class PlanCache(Generic[T]):
    """Plans by input-size bucket: sizes within ``granularity`` of each other share a key
    (geometric buckets: ``floor(log(size) / log(1 + granularity))``). ``granularity=None`` puts
    every size in one bucket: a static plan."""

    def __init__(self, granularity: float | None = CACHE_GRANULARITY) -> None:
        if granularity is not None and not granularity > 0:
            raise ValueError(f"plan cache granularity must be > 0 or None, got {granularity!r}")
        self.granularity = granularity
        self._plans: dict[Hashable, T] = {}

    def key(self, size: int) -> Hashable:
        if self.granularity is None:
            return "static"
        return math.floor(math.log(max(size, 1)) / math.log1p(self.granularity))

    def get(self, size: int) -> T | None:
        return self._plans.get(self.key(size))

    def put(self, size: int, plan: T) -> None:
        self._plans[self.key(size)] = plan

    def discard(self, size: int) -> None:
        self._plans.pop(self.key(size), None)

    def __len__(self) -> int:
        return len(self._plans)


__all__ = [
    "BUCKET_TOLERANCE", "CACHE_GRANULARITY", "FIT_SIZES", "LayerMemoryEstimator", "PlanCache", "QuadraticFit",
    "bucket_choice", "input_size", "plan_from_estimates",
]
