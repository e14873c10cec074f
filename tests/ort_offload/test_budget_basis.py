"""Dynamic shapes keep their budget: a fraction resolves against the largest signature the
trainer is told about (``max_shapes``) or the first batch, the report says which, and every
later signature plans under those bytes or raises before anything changes."""

from __future__ import annotations

import math

import numpy as np
import pytest

from helpers import batches, train_ort
from ort_offload.budget_basis import max_batch
from ort_offload.errors import BudgetTooSmallError, InputMismatchError

GPT_DECLARED = {"ids": (np.dtype(np.int64), ("batch", "seq")), "targets": (np.dtype(np.int64), ("batch", "seq"))}


@pytest.fixture(scope="module")
def unbudgeted():
    """gpt tiny's losses at lengths 16, 8, 12 and 8, 16 with everything resident (the reference)."""
    return {tuple(lengths): train_ort("gpt", data=batches("gpt", len(lengths), seq_lengths=lengths)).losses
            for lengths in ([16, 8, 12], [8, 16])}


def _assert_close(losses, reference):
    np.testing.assert_allclose(losses, reference, rtol=1e-5)  # split may reorder sums (design.md)


def test_a_fraction_of_the_largest_shapes_trains_every_length_up_to_them(unbudgeted):
    data = batches("gpt", 2, seq_lengths=[8, 16])
    run = train_ort("gpt", data=data, budget="0.12x", passes="auto", max_shapes={"seq": 16})
    report = run.trainer.report()
    basis = report["budget_resolved_against"]
    assert basis["source"] == "max_shapes" and basis["shapes"] == {"ids": [8, 16], "targets": [8, 16]}
    assert report["baseline_peak_bytes"] == basis["peak_bytes"]  # the peak the fraction is of
    assert report["budget_bytes"] == math.floor(0.12 * basis["peak_bytes"])
    assert report["within_budget"] and report["plans_made"] == 2
    _assert_close(run.losses, unbudgeted[(8, 16)])


@pytest.mark.slow
def test_without_max_shapes_a_longer_batch_raises_its_own_minimum_before_anything_changes():
    data = batches("gpt", 2, seq_lengths=[8, 16])
    run = train_ort("gpt", data=data[:1], budget="0.12x", passes="auto")
    before = run.trainer.flat_state()
    with pytest.raises(BudgetTooSmallError) as caught:
        run.trainer.step(*data[1][0], *data[1][1])
    report = run.trainer.report()
    assert caught.value.budget_bytes == report["budget_bytes"] < caught.value.needed_bytes
    assert f"({caught.value.needed_bytes} bytes)" in str(caught.value)
    after = run.trainer.flat_state()
    assert all(before[k].tobytes() == after[k].tobytes() for k in before) and run.trainer.steps_done == 1
    assert report["budget_resolved_against"]["source"] == "first batch"
    assert report["budget_resolved_against"]["shapes"]["ids"] == [8, 8]


def test_a_shorter_length_after_a_split_plan_for_the_longest_runs_within_the_budget(unbudgeted):
    # The longest first: a split plan keeps part of the state on the host, a shorter length's
    # swap plan another part; the runtime moves the state where each plan expects it.
    run = train_ort("gpt", data=batches("gpt", 3, seq_lengths=[16, 8, 12]), budget="0.15x", passes="auto")
    report = run.trainer.report()
    assert "split" in report["passes"] and report["within_budget"] and report["plans_made"] == 3
    assert report["baseline_peak_bytes"] == report["budget_resolved_against"]["peak_bytes"]
    assert report["budget_resolved_against"]["shapes"]["ids"] == [8, 16]
    _assert_close(run.losses, unbudgeted[(16, 8, 12)])


def test_max_shapes_name_inputs_or_dynamic_axes():
    example = {"ids": np.arange(16).reshape(2, 8), "targets": np.arange(16).reshape(2, 8)}
    by_axis = max_batch(example, GPT_DECLARED, {"seq": 32})
    by_input = max_batch(example, GPT_DECLARED, {"ids": (4, 32)})
    assert {n: a.shape for n, a in by_axis.items()} == {"ids": (2, 32), "targets": (2, 32)}
    assert {n: a.shape for n, a in by_input.items()} == {"ids": (4, 32), "targets": (4, 32)}
    assert set(np.unique(by_input["ids"])) <= set(range(16))  # the example's values: valid token ids
    for bad, message in (({"sequence": 32}, "neither a batch input nor a dynamic axis"), ({"ids": (32,)}, "rank"),
                         ({"seq": 0}, "at least 1"), ({"ids": "4x32"}, "whole sizes")):
        with pytest.raises(InputMismatchError, match=message):
            max_batch(example, GPT_DECLARED, bad)


def test_max_shapes_on_a_dynamic_model_is_refused_with_what_to_do():
    import ort_offload
    from models import get_dynamic_model

    spec = get_dynamic_model("var-lstm", "tiny")
    device = ort_offload.set_offload_device("cpu", budget="0.5x")
    with pytest.raises(InputMismatchError, match="max_shapes is for static models"):
        ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, max_shapes={"seq": 64})
