"""Block-wise training under a budget (ort_offload.dynamic.runtime, ort_offload.dynamic.trainer).

Every budgeted run is compared with the unbudgeted block-wise run on the same batches (losses and
every parameter bitwise: moving tensors never changes numbers), and with plain torch training.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

import ort_offload
from models import get_dynamic_model
from ort_offload.dynamic.blockwise import BlockStepCache
from ort_offload.cli import main
from ort_offload.dynamic.trainer import DYNAMIC_REPORT_KEYS, BlockwiseTrainer
from ort_offload.errors import BudgetTooSmallError
from ort_offload.report import REPORT_KEYS
from pilot.prediction import NoPredictor, OraclePredictor, WrongPredictor

STEPS = 3
_CACHES: dict[str, BlockStepCache] = {}


def _cache(name: str) -> BlockStepCache:
    return _CACHES.setdefault(name, BlockStepCache())


def _train(name, budget=None, predictor=None, *, steps=STEPS, keys=None, host=False, **options):
    """Train ``name`` tiny for ``steps`` (batch keys ``keys`` if given); returns (trainer, state)."""
    spec = get_dynamic_model(name, "tiny", seed=0)
    device = None if host else ort_offload.set_offload_device("cpu", budget=budget)
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, device=device, predictor=predictor, optimizer="adamw",
                               lr=1e-2, cache=_cache(name), **options)
    try:
        for step in range(steps):
            inputs, targets = spec.make_batch(seed=step, key=None if keys is None else keys[step])
            trainer.step(*inputs, *targets)
    finally:
        trainer.close()
    return trainer, trainer.flat_state()


def _torch_losses(name, steps=STEPS):
    spec = get_dynamic_model(name, "tiny", seed=0)
    optimizer = torch.optim.AdamW(spec.model.parameters(), lr=1e-2)
    losses = []
    for step in range(steps):
        (ids,), (y,) = spec.make_batch(seed=step)
        loss = spec.loss_fn(spec.model(ids), y)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _assert_same(a, b):
    trainer_a, state_a = a
    trainer_b, state_b = b
    assert trainer_a.losses == trainer_b.losses
    assert state_a.keys() == state_b.keys()
    for key in state_a:
        assert np.array_equal(state_a[key], state_b[key]), key


# fixed-bert and fixed-lstm are var-bert and var-lstm on one path: `make test-all` runs them.
@pytest.mark.parametrize("name", ["var-bert", pytest.param("fixed-bert", marks=pytest.mark.slow), "moe", "tree-lstm",
                                  "var-lstm", pytest.param("fixed-lstm", marks=pytest.mark.slow), "recycle-former"])
def test_budgets_down_to_the_minimum_give_identical_training(name):
    host = _train(name, host=True)
    unlimited = _train(name, None, OraclePredictor())
    _assert_same(unlimited, host)
    runtime = unlimited[0].runtime
    assert runtime.stats.faults == 0  # the oracle's prefetches cover every block
    minimum = runtime.min_budget_bytes
    assert 0 < minimum <= runtime.peak
    torch_losses = _torch_losses(name)
    assert max(abs(a - b) / abs(b) for a, b in zip(host[0].losses, torch_losses)) <= 1e-5
    for budget in (minimum, (minimum + runtime.peak) // 2):
        run = _train(name, budget, OraclePredictor())
        _assert_same(run, host)
        report = run[0].report()
        assert report["peak_device_bytes"] <= budget
        assert report["within_budget"] is True


@pytest.mark.parametrize("name", ["var-bert", "tree-lstm"])
def test_pre_eviction_writes_back_ahead_without_changing_numbers(name):
    host = _train(name, host=True)
    minimum = _train(name, None, OraclePredictor())[0].runtime.min_budget_bytes
    run = _train(name, minimum + minimum // 4, OraclePredictor(), pre_evict=True)
    _assert_same(run, host)
    runtime = run[0].runtime
    assert runtime.peak <= runtime.budget
    kinds = {event.kind for trace in runtime.step_traces for event in trace}
    assert "writeback_async" in kinds


def test_trace_replay_hides_prefetched_copies_under_compute():
    """On a GPU profile, the oracle's prefetches stall less than fetching everything on demand."""
    from graph_passes.cost.device_profiles import get_profile
    from graph_passes.cost.trace_replay import replay

    minimum = _train("var-bert", None, OraclePredictor())[0].runtime.min_budget_bytes
    budget = 2 * minimum
    prefetched = _train("var-bert", budget, OraclePredictor(), keys=[4] * STEPS)[0].runtime
    on_demand = _train("var-bert", budget, NoPredictor(), keys=[4] * STEPS, prefetch=False)[0].runtime
    profile = get_profile("V100-16GB-PCIe3")
    a = replay(prefetched.step_traces[-1], profile)
    b = replay(on_demand.step_traces[-1], profile)
    assert a.compute_s == pytest.approx(b.compute_s)  # the same blocks ran
    assert a.h2d_bytes > 0 and b.h2d_bytes > 0
    assert a.stall_s < b.stall_s
    assert b.step_s >= b.compute_s + b.h2d_bytes / profile.h2d_bandwidth * 0.99  # faults serialise copy and compute


def test_fraction_budget_is_taken_of_the_resident_baseline():
    trainer, _ = _train("moe", "0.5x", OraclePredictor())
    report = trainer.report()
    assert report["budget_bytes"] == report["baseline_peak_bytes"] // 2
    assert report["peak_device_bytes"] <= report["budget_bytes"]
    # Without offload (everything resident) the same model needs the whole baseline.
    assert report["baseline_peak_bytes"] > trainer.runtime.min_budget_bytes


def test_wrong_predictions_only_cost_faults():
    host = _train("var-bert", host=True)
    oracle = _train("var-bert", None, OraclePredictor())
    wrong = _train("var-bert", None, WrongPredictor(), misprediction_cache=False)
    _assert_same(wrong, host)
    report = wrong[0].report()
    assert report["mispredictions"] == STEPS
    assert report["exact_path_accuracy"] == 0.0
    assert report["faults"] > oracle[0].report()["faults"] == 0


def test_on_demand_only_fetches_everything_by_fault():
    on_demand, _ = _train("var-lstm", None, NoPredictor(), prefetch=False)
    stats = on_demand.runtime.stats
    assert stats.prefetches == 0 and stats.prefetch_hits == 0
    spec = get_dynamic_model("var-lstm", "tiny", seed=0)
    params = sum(1 for b in spec.model.blocks() for _ in b.parameters())
    assert stats.faults >= STEPS * params  # every parameter faults in at least once per step
    _assert_same((on_demand, on_demand.flat_state()), _train("var-lstm", host=True))


def test_misprediction_cache_and_log(tmp_path):
    log = tmp_path / "mispredictions.jsonl"
    keys = [3] * 4  # four batches with the same path: the pilot says the same thing each time
    trainer, _ = _train("var-bert", None, WrongPredictor(), steps=4, keys=keys, misprediction_log=log)
    report = trainer.report()
    assert report["mispredictions"] == 1
    assert report["misprediction_cache_hits"] == 3
    records = [json.loads(line) for line in log.read_text().splitlines()]
    assert len(records) == 1
    spec = get_dynamic_model("var-bert", "tiny", seed=0)
    ids = torch.tensor(records[0]["inputs"][0])
    assert tuple(records[0]["true_path"]) == spec.model.path(ids)
    assert records[0]["predicted_path"] != records[0]["true_path"]
    uncached, _ = _train("var-bert", None, WrongPredictor(), steps=4, keys=keys, misprediction_cache=False)
    assert uncached.report()["mispredictions"] == 4


def test_budget_too_small_changes_nothing():
    spec = get_dynamic_model("var-bert", "tiny", seed=0)
    before = {k: v.clone() for k, v in spec.model.state_dict().items()}
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, device=ort_offload.set_offload_device("cpu", budget="64KiB"),
                               cache=_cache("var-bert"))
    inputs, targets = spec.make_batch(seed=0)
    with pytest.raises(BudgetTooSmallError) as caught:
        trainer.step(*inputs, *targets)
    trainer.close()
    assert "raise the budget" in str(caught.value)
    for key, value in spec.model.state_dict().items():
        assert torch.equal(value, before[key]), key
    assert all(p.grad is None for p in spec.model.parameters())
    assert not trainer.optimizer.state  # the optimizer never ran
    # The stated minimum does train.
    retry = BlockwiseTrainer(spec.model, spec.loss_fn, cache=_cache("var-bert"),
                             device=ort_offload.set_offload_device("cpu", budget=caught.value.needed_bytes))
    retry.step(*inputs, *targets)
    retry.close()
    assert retry.report()["peak_device_bytes"] <= caught.value.needed_bytes


def test_prefetches_land_in_alternating_halves(monkeypatch):
    """Execution block i's prefetched parameters go to half i % 2 (the migration half while
    block i - 1 computes in the other)."""
    from ort_offload.dynamic.runtime import BlockRuntime

    placed: list[tuple[int, int, tuple[int, int]]] = []  # (execution block, offset, region)
    original = BlockRuntime._prefetch_group

    def recording(self, i):
        original(self, i)
        region = self._region(i)
        for name, _ in self._group_tensors(i):
            if name in self.mem.prefetched and name in self.arena:
                placed.append((i, self.arena.allocator.placement(name).offset, region))

    monkeypatch.setattr(BlockRuntime, "_prefetch_group", recording)
    unlimited, _ = _train("fixed-bert", None, OraclePredictor(), steps=1)
    budget = 4 * unlimited.runtime.min_budget_bytes  # room for both halves to hold a layer's parameters
    placed.clear()
    trainer, _ = _train("fixed-bert", budget, OraclePredictor(), steps=1)
    assert trainer.runtime.mem.policy.name == "double_buffer"
    forward = [(i, offset, region) for i, offset, region in placed]
    assert {i % 2 for i, _, _ in forward} == {0, 1}
    inside = [region[0] <= offset < region[1] for _, offset, region in forward]
    assert sum(inside) >= 0.9 * len(inside)  # a full half falls back to anywhere; here it rarely is


def test_create_ort_trainer_takes_dynamic_models():
    spec = get_dynamic_model("tree-lstm", "tiny", seed=0)
    device = ort_offload.set_offload_device("cpu", budget="0.5x")
    trainer = ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn)
    assert isinstance(trainer, BlockwiseTrainer)
    inputs, targets = spec.make_batch(seed=0)
    trainer.step(*inputs, *targets)
    trainer.close()
    report = trainer.report()
    assert tuple(report) == REPORT_KEYS + DYNAMIC_REPORT_KEYS
    assert report["within_budget"] is True


def test_cli_trains_a_dynamic_model(tmp_path, capsys):
    out = tmp_path / "report.json"
    code = main(["train", "--model", "moe", "--budget", "0.6x", "--steps", "2", "--quiet", "--json", str(out),
                 "--predictor", "wrong"])
    assert code == 0
    report = json.loads(out.read_text())
    assert report["steps"] == 2 and report["within_budget"] is True
    assert report["faults"] > 0
    assert main(["train", "--model", "moe", "--plot", str(tmp_path / "p.png"), "--quiet"]) == 2
    assert "does not apply to dynamic models" in capsys.readouterr().err
    assert not (tmp_path / "p.png").exists()


def test_pilot_guided_training():
    """The committed pilot drives the prefetches of a real training run: var-LSTM's paths (its
    length) are predicted exactly, so nothing faults, and the numbers are the unbudgeted run's."""
    from ort_offload.dynamic.pilot_support import make_pilot

    spec = get_dynamic_model("var-lstm", "tiny", seed=0)
    pilot = make_pilot(spec)
    trainer = BlockwiseTrainer(spec.model, spec.loss_fn, device=ort_offload.set_offload_device("cpu"),
                               predictor=pilot, optimizer="adamw", lr=1e-2, cache=_cache("var-lstm"))
    for step in range(STEPS):
        inputs, targets = spec.make_batch(seed=step)
        trainer.step(*inputs, *targets)
    trainer.close()
    report = trainer.report()
    assert report["exact_path_accuracy"] == 1.0 and report["mispredictions"] == 0
    assert report["faults"] == 0
    assert report["pilot_inference_us_median"] > 0 and report["pilot_mapping_us_median"] > 0
    _assert_same((trainer, trainer.flat_state()), _train("var-lstm", host=True))


def test_pilot_features_do_not_drift_with_training():
    """The pilot embeds samples with the embedding the model had when it was attached, so
    training the embedding does not change its predictions."""
    from ort_offload.dynamic.pilot_support import make_pilot

    spec = get_dynamic_model("moe", "tiny", seed=0)
    pilot = make_pilot(spec)
    batches = [spec.make_batch(1, seed=50_000 + i)[0] for i in range(8)]
    before = [pilot.predict(spec.model, inputs) for inputs in batches]
    with torch.no_grad():
        spec.model.tok_emb.weight.add_(0.05 * torch.randn_like(spec.model.tok_emb.weight))
    after = [pilot.predict(spec.model, inputs) for inputs in batches]
    assert [p.path for p in before] == [p.path for p in after]
    assert [p.key for p in before] == [p.key for p in after]


def test_misprediction_cache_corrects_only_systematic_confusions():
    from ort_offload.dynamic.misprediction_cache import MispredictionCache
    from pilot.prediction import PathPrediction, even_groups

    def said(path):
        return PathPrediction(path=path, execution_blocks=even_groups(path, 2), key=("raw", path))

    cache = MispredictionCache()
    right, wrong_truth = (0, 1, 2), (0, 1)
    cache.record(said(right), right)
    assert len(cache) == 0 and cache.lookup(said(right)) is None  # never wrong: not remembered
    cache.record(said(right), wrong_truth)
    corrected = cache.lookup(said(right))
    assert corrected is not None and corrected.path == wrong_truth
    assert corrected.execution_blocks == even_groups(wrong_truth, 2)
    cache.record(said(right), right)
    cache.record(said(right), right)
    assert cache.lookup(said(right)) is None  # right twice, wrong once since: keep the prediction


def test_misprediction_cache_tells_apart_outputs_that_map_to_the_same_path():
    """The same predicted path said two ways (pilot outputs a block unit apart): a confusion seen
    under one key corrects that key only."""
    from ort_offload.dynamic.misprediction_cache import MispredictionCache
    from pilot.mapping import block_unit_key
    from pilot.prediction import PathPrediction, even_groups

    path, truth = (0, 1, 2, 3), (0,)
    near, between = np.zeros(8, np.float32), np.full(8, 0.4, np.float32)
    between[0] = 1.6  # rounds a block unit away from ``near``
    assert block_unit_key(near) != block_unit_key(between) and block_unit_key(near) == block_unit_key(near + 0.3)

    def said(raw):
        return PathPrediction(path=path, execution_blocks=even_groups(path, 2), key=("arch", block_unit_key(raw)))

    cache = MispredictionCache()
    for _ in range(3):
        cache.record(said(between), truth)
        cache.record(said(near), path)
    assert cache.lookup(said(between)).path == truth
    assert cache.lookup(said(near)) is None and cache.lookup(said(near + 0.3)) is None


def test_cli_falls_back_from_the_pilot_only_when_not_asked_for_it(capsys):
    """tree-lstm small has too many candidate paths for the pilot: by default the CLI says so and
    prefetches from the true path; asking for the pilot explicitly is a one-line error."""
    args = ["train", "--model", "tree-lstm", "--config", "small", "--steps", "1", "--quiet"]
    assert main(args + ["--predictor", "pilot"]) == 2
    err = capsys.readouterr().err
    assert "the pilot cannot serve this model" in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert main(args) == 0
    assert "prefetching from the true path" in capsys.readouterr().err
