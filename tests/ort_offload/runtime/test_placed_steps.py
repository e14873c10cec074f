"""Steps placed ahead run the same numbers as steps placed as they go, bind nothing once their
placements recur, keep a budget's placements and peak, and fail as a step-by-step run fails."""

import pytest

from helpers import batches, train_ort
from ort_offload.errors import ExecutionError, OffloadError
from ort_offload.runtime import placed_steps
from ort_offload.runtime.block_session import BlockSession

STEPS = 7


def _step_by_step(monkeypatch):
    monkeypatch.setattr(placed_steps, "BEST_FIT_STEPS", 10**9)


def _tables(run):
    return run.trainer.runner.last_prepared.run_cache.get("placed")


def _assert_same_numbers(run, reference):
    assert run.losses == reference.losses
    assert all(run.state[k].tobytes() == v.tobytes() for k, v in reference.state.items())


@pytest.mark.parametrize("block_nodes", [None, 64])
def test_an_unbudgeted_run_alternates_two_placed_steps_with_the_same_numbers(monkeypatch, block_nodes):
    placed = train_ort("gpt", steps=STEPS, optimizer="adamw", block_nodes=block_nodes)
    tables = _tables(placed)
    assert len(tables.by_token) == 2 and tables.misses == 0 and not tables.off  # a leaving and a returning step
    with monkeypatch.context() as m:
        _step_by_step(m)
        reference = train_ort("gpt", steps=STEPS, optimizer="adamw", block_nodes=block_nodes)
    assert _tables(reference).by_token == {}
    _assert_same_numbers(placed, reference)
    # The first two steps are best fit's, as the memory replay's; the peak is what ran.
    prepared = placed.trainer.runner.last_prepared
    peaks = [t.placed.peak_bytes for t in tables.by_token.values()]
    assert placed.trainer.report()["peak_device_bytes"] == max([prepared.trace.peak_device_bytes] + peaks)


def test_a_recurring_placed_step_binds_nothing(monkeypatch):
    spec_batches = batches("gpt", 1)
    (inputs, targets), = spec_batches
    # Runs 1-2 best fit, 3-4 the two placed steps (the arena may grow for the second, so
    # the first one's pointers move once: run 5 binds them again).
    run = train_ort("gpt", steps=5, optimizer="adamw", data=spec_batches * 5)
    binds = []
    original = BlockSession._bind
    monkeypatch.setattr(BlockSession, "_bind", lambda self, *a: binds.append(self) or original(self, *a))
    for _ in range(4):
        run.trainer.step(*inputs, *targets)
    assert binds == []
    _step_by_step(monkeypatch)
    for _ in range(2):  # step by step, best fit moves the updates: blocks bind again
        run.trainer.step(*inputs, *targets)
    assert binds


def test_a_budget_keeps_its_placements_and_peak(monkeypatch):
    placed = train_ort("gpt", steps=STEPS, optimizer="adamw", budget="1.0x")
    assert _tables(placed).by_token  # steps ran from tables
    with monkeypatch.context() as m:
        _step_by_step(m)
        reference = train_ort("gpt", steps=STEPS, optimizer="adamw", budget="1.0x")
    _assert_same_numbers(placed, reference)
    report, expected = placed.trainer.report(), reference.trainer.report()
    assert report["peak_device_bytes"] == expected["peak_device_bytes"] <= report["budget_bytes"]
    assert placed.trainer.runtime.arena.allocator.layout() == reference.trainer.runtime.arena.allocator.layout()


@pytest.mark.parametrize("placed", [True, False])
def test_a_failing_placed_step_fails_as_a_step_by_step_one(monkeypatch, placed):
    if not placed:
        _step_by_step(monkeypatch)
    data = batches("gpt", 1)
    (inputs, targets), = data
    run = train_ort("gpt", steps=4, optimizer="adamw", data=data * 4)
    runner = run.trainer.runner
    program = runner.last_prepared.program
    assert bool(_tables(run).by_token) == placed
    first, last = program.blocks[0].index, program.blocks[-1].index
    sessions = {b: runner.session(runner.last_prepared, b) for b in (first, last)}

    def fail_in(block):
        monkeypatch.setattr(sessions[block], "run_at", lambda *a, **k: (_ for _ in ()).throw(RuntimeError("boom")))

    fail_in(first)  # nothing consumed yet: the step fails, the state is intact
    with pytest.raises(ExecutionError, match=f"block {first} "):
        run.trainer.step(*inputs, *targets)
    monkeypatch.undo()
    if not placed:
        _step_by_step(monkeypatch)
    for _ in range(3):  # the failure checks the state again: best fit twice, then placed again
        run.trainer.step(*inputs, *targets)
    assert bool(_tables(run).by_token) == placed
    fail_in(last)  # the first block has freed the parameters it updated
    with pytest.raises(OffloadError, match="consumed state"):
        run.trainer.step(*inputs, *targets)
