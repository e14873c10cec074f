"""Keeping your own torch loop: the offloaded module under a user's AdamW + OneCycleLR +
clipping + accumulation loop, the in-graph trainer with torch.optim objects, schedulers,
clipping and accumulation, torch-format checkpoints in both directions, and eval outputs;
everything against the same loop in plain torch."""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch

import ort_offload
from helpers import batches, max_relative_diff
from models import get_model
from graph_passes.ir.training_graph import Role
from ort_offload.errors import CheckpointError, InputMismatchError, InvalidArgumentError

ACCUMULATE = 4
CLIP = 1.0


def _close(ours, theirs, rtol=1e-5):
    assert len(ours) == len(theirs)
    for a, b in zip(ours, theirs):
        assert abs(a - b) <= rtol * max(abs(b), 1e-12), (ours, theirs)


def _assert_params_close(model_a, model_b, rtol=1e-5):
    state_b = model_b.state_dict()
    for name, tensor in model_a.state_dict().items():
        diff = max_relative_diff(tensor.detach().numpy(), state_b[name].detach().numpy())
        assert diff <= rtol, f"{name}: relative difference {diff:.3g}"


def _torch_loop(model, forward, data, *, updates, accumulate=ACCUMULATE, cycle_momentum=True):
    """The user's loop: AdamW + OneCycleLR + clip_grad_norm_ + ``accumulate``-way accumulation;
    ``forward(inputs, targets)`` gives a micro-batch's loss. Returns the losses and grad norms."""
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=updates,
                                                    cycle_momentum=cycle_momentum)
    losses, norms = [], []
    for index, (inputs, targets) in enumerate(data):
        loss = forward(inputs, targets)
        (loss / accumulate).backward()
        losses.append(loss.item())
        if (index + 1) % accumulate == 0:
            norms.append(float(torch.nn.utils.clip_grad_norm_(model.parameters(), CLIP)))
            optimizer.step()
            scheduler.step()
            optimizer.zero_grad()
    return losses, norms


def _offloaded(name, data, budget, passes="auto"):
    spec = get_model(name)
    device = ort_offload.set_offload_device("cpu", budget=budget)
    module = ort_offload.offload(spec.model, device, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=spec.loss_fn, input_names=spec.input_names,
                                 target_names=spec.target_names, dynamic_axes=spec.dynamic_axes, name=name,
                                 passes=passes)
    return spec, module


def test_offloaded_module_in_a_users_loop_matches_torch():
    """(a): 20 updates of 4 micro-batches at 0.5x: losses, grad norms and parameters within 1e-5."""
    updates = 20
    data = batches("mlp", updates * ACCUMULATE)
    spec, module = _offloaded("mlp", data, "0.5x")
    reference = copy.deepcopy(spec.model)
    ours, our_norms = _torch_loop(module, lambda i, t: module(*i, *t), data, updates=updates)
    theirs, their_norms = _torch_loop(reference, lambda i, t: spec.loss_fn(reference(*i), *t), data, updates=updates)
    _close(ours, theirs)
    _close(our_norms, their_norms)
    _assert_params_close(module, reference)
    report = module.report()
    assert report["within_budget"] is True and report["peak_device_bytes"] <= report["budget_bytes"]
    assert report["budget_bytes"] < report["baseline_peak_bytes"]
    assert set(module.state_dict()) == set(reference.state_dict())


@pytest.mark.parametrize("name", ["mlp", "cnn"])
def test_offloaded_forward_backward_equal_the_unplanned_program_bitwise(name):
    data = batches(name, 3)
    _, planned = _offloaded(name, data, "0.5x")
    _, unplanned = _offloaded(name, data, None, passes="none")
    unplanned.load_state_dict(planned.state_dict())
    assert planned.report()["budget_bytes"] < unplanned.report()["baseline_peak_bytes"]
    for inputs, targets in data:
        results = []
        for module in (planned, unplanned):
            module.zero_grad()
            loss = module(*inputs, *targets)
            loss.backward()
            results.append((loss.item(), [p.grad.clone() for p in module.parameters()],
                            [b.clone() for b in module.buffers()]))
        assert results[0][0] == results[1][0]
        assert all(torch.equal(a, b) for a, b in zip(results[0][1], results[1][1]))
        assert all(torch.equal(a, b) for a, b in zip(results[0][2], results[1][2]))  # BatchNorm stats
    assert planned.report()["within_budget"] is True


def test_offloaded_backward_scales_and_sums_like_torch():
    """The incoming gradient is honoured: scaled losses, a non-scalar result with backward(g),
    sums over several backward calls; a second backward through one loss is a clear error."""
    data = batches("mlp", 3)
    spec, module = _offloaded("mlp", data, None)
    reference = copy.deepcopy(spec.model)
    for (inputs, targets), scale in zip(data, (0.5, 0.25)):
        (module(*inputs, *targets) * scale).backward()
        (spec.loss_fn(reference(*inputs), *targets) * scale).backward()
    (inputs, targets), weights = data[2], torch.tensor([0.5, 2.0])
    torch.stack([module(*inputs, *targets), 3 * module(*inputs, *targets)]).backward(weights)
    theirs = spec.loss_fn(reference(*inputs), *targets)
    torch.stack([theirs, 3 * theirs]).backward(weights)
    for ours, theirs in zip(module.parameters(), reference.parameters()):
        assert max_relative_diff(ours.grad.numpy(), theirs.grad.numpy()) <= 1e-5
    loss = module(*inputs, *targets)
    loss.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="second time"):
        loss.backward()


def test_training_forward_without_gradients_runs_the_forward_part_only():
    """Under torch.no_grad() or with frozen parameters a training-mode call costs a forward:
    the loss and BatchNorm statistics as torch's, no backward program run, within the budget."""
    data = batches("cnn", 2)
    spec, module = _offloaded("cnn", data, "0.5x")
    reference = copy.deepcopy(spec.model)
    (inputs, targets) = data[0]
    with torch.no_grad():
        ours = module(*inputs, *targets)
        theirs = spec.loss_fn(reference(*inputs), *targets)
    assert not ours.requires_grad and abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item())
    for a, b in zip(module.buffers(), reference.buffers()):  # running statistics moved as torch's
        assert max_relative_diff(a.double().numpy(), b.double().numpy()) <= 1e-5
    module.requires_grad_(False)
    reference.requires_grad_(False)
    ours = module(*data[1][0], *data[1][1])
    theirs = spec.loss_fn(reference(*data[1][0]), *data[1][1])
    assert not ours.requires_grad and abs(ours.item() - theirs.item()) <= 1e-5 * abs(theirs.item())
    assert module.trainer.steps_done == 0 and module.trainer.runner.step_times_s == []  # no backward ran
    forward_part = module._forward_part.graph
    assert Role.GRAD not in forward_part.roles.values()
    assert len(forward_part.model.graph.node) < len(module.trainer.graph.model.graph.node)
    stats = module.trainer.runtime.stats
    assert 0 < stats.peak_device_bytes <= module.report()["budget_bytes"]
    module.requires_grad_(True)
    with pytest.raises(InputMismatchError, match="detach"):
        module(inputs[0].clone().requires_grad_(True), *targets)


def test_in_graph_trainer_with_torch_optimizer_scheduler_clipping_and_accumulation_matches_torch():
    """(b): a torch.optim.AdamW object, OneCycleLR, clipping and 4-way accumulation in the graph."""
    updates = 20
    data = batches("mlp", updates * ACCUMULATE)
    spec = get_model("mlp")
    reference = copy.deepcopy(spec.model)
    optimizer = torch.optim.AdamW(spec.model.parameters(), lr=1e-2, weight_decay=0.01)
    scheduler = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=updates,
                                                    cycle_momentum=False)
    device = ort_offload.set_offload_device("cpu", budget="0.5x")
    trainer = ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0], example_targets=data[0][1],
        optimizer=optimizer, lr_scheduler=scheduler, grad_clip_norm=CLIP, accumulation_steps=ACCUMULATE, name="mlp")
    ours = [trainer.step(*inputs, *targets) for inputs, targets in data]
    theirs, their_norms = _torch_loop(reference, lambda i, t: spec.loss_fn(reference(*i), *t), data,
                                      updates=updates, cycle_momentum=False)
    _close(ours, theirs)
    report = trainer.report()
    _close(report["grad_norms"], their_norms)
    assert report["steps"] == updates and trainer.steps_done == updates
    assert report["within_budget"] is True and report["budget_bytes"] < report["baseline_peak_bytes"]
    _assert_params_close(trainer.copy_to(copy.deepcopy(spec.model)), reference)
    torch_optimizer = torch.optim.AdamW(reference.parameters())
    torch_optimizer.load_state_dict(trainer.state_dict()["optimizer"])  # torch takes the layout


@pytest.mark.parametrize("make", [
    lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, nesterov=True, weight_decay=1e-3),
    lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=1e-2),
])
def test_torch_optimizer_objects_match_torch(make):
    data = batches("mlp", 4)
    spec = get_model("mlp")
    reference = copy.deepcopy(spec.model)
    device = ort_offload.set_offload_device("cpu")
    trainer = ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0],
                                             example_targets=data[0][1], optimizer=make(spec.model.parameters()))
    ours = [trainer.step(*i, *t) for i, t in data]
    optimizer = make(reference.parameters())
    theirs = []
    for inputs, targets in data:
        loss = spec.loss_fn(reference(*inputs), *targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        theirs.append(loss.item())
    _close(ours, theirs)
    _assert_params_close(trainer.copy_to(copy.deepcopy(spec.model)), reference)


@pytest.mark.parametrize("make, words", [
    (lambda p: torch.optim.RMSprop(p), "RMSprop"),
    (lambda p: torch.optim.AdamW(p, amsgrad=True), "amsgrad"),
    (lambda p: torch.optim.SGD(p, lr=0.1, momentum=0.9, dampening=0.1), "dampening"),
])
def test_unsupported_optimizers_are_one_clear_error(make, words):
    spec = get_model("mlp")
    ((x,), (y,)), = batches("mlp", 1)
    device = ort_offload.set_offload_device("cpu")
    with pytest.raises(InvalidArgumentError, match=words) as info:
        ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=(x,),
                                       example_targets=(y,), optimizer=make(spec.model.parameters()))
    assert "ort_offload.offload" in str(info.value) and "\n" not in str(info.value)
    optimizer = torch.optim.AdamW(spec.model.parameters())
    cycling = torch.optim.lr_scheduler.OneCycleLR(optimizer, max_lr=1e-2, total_steps=5)
    with pytest.raises(InvalidArgumentError, match="cycle_momentum=False"):
        ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=(x,),
                                       example_targets=(y,), optimizer=optimizer, lr_scheduler=cycling)
    with pytest.raises(InvalidArgumentError, match="accumulation_steps"):
        ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=(x,),
                                       example_targets=(y,), accumulation_steps=0)


def _trainer(spec, data, optimizer=None):
    device = ort_offload.set_offload_device("cpu", budget="0.5x")
    optimizer = optimizer or torch.optim.AdamW(spec.model.parameters(), lr=1e-2, weight_decay=0.01)
    return ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0],
                                          example_targets=data[0][1], optimizer=optimizer, name="mlp")


def test_trainer_checkpoint_resumes_in_plain_torch_and_back(tmp_path):
    """(c): a .pt saved by the trainer continues in plain torch with the same next loss, and
    one saved by plain torch continues in the trainer."""
    data = batches("mlp", 6)
    spec = get_model("mlp")
    trainer = _trainer(spec, data)
    for inputs, targets in data[:3]:
        trainer.step(*inputs, *targets)
    path = trainer.save(tmp_path / "from_ort.pt")
    saved = torch.load(path, weights_only=True)
    assert sorted(saved) == ["model", "optimizer", "step"] and saved["step"] == 3
    model = get_model("mlp").model
    model.load_state_dict(saved["model"])
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2, weight_decay=0.01)
    optimizer.load_state_dict(saved["optimizer"])
    for inputs, targets in data[3:]:
        ours = trainer.step(*inputs, *targets)
        loss = spec.loss_fn(model(*inputs), *targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        _close([ours], [loss.item()])
    _assert_params_close(trainer.copy_to(get_model("mlp").model), model)

    # Back: plain torch's state continues in a fresh trainer.
    torch.save({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": 6}, tmp_path / "from_torch.pt")
    resumed = _trainer(get_model("mlp"), data)
    resumed.load(tmp_path / "from_torch.pt")
    assert resumed.steps_done == 6
    (inputs, targets) = batches("mlp", 7)[6]
    ours = resumed.step(*inputs, *targets)
    loss = spec.loss_fn(model(*inputs), *targets)
    optimizer.zero_grad()
    loss.backward()
    optimizer.step()
    _close([ours], [loss.item()])
    _assert_params_close(resumed.copy_to(get_model("mlp").model), model)


def test_bad_torch_checkpoints_leave_the_trainer_unchanged(tmp_path):
    """load_state_dict (torch's layout) checks everything first: one CheckpointError, state as before."""
    data = batches("mlp", 2)
    spec = get_model("mlp")
    trainer = _trainer(spec, data)
    for inputs, targets in data:
        trainer.step(*inputs, *targets)
    good = trainer.state_dict()
    assert sorted(good) == ["model", "optimizer", "step"] and good["step"] == 2
    assert all(isinstance(t, torch.Tensor) for t in good["model"].values())
    before = trainer.flat_state()
    name = next(iter(good["model"]))
    moments = good["optimizer"]["state"][0]
    bad_states = [
        {**good, "step": 5},  # disagrees with the optimizer's step
        {**good, "model": {**good["model"], name: torch.zeros(3, 3)}},
        {**good, "model": {**good["model"], name: good["model"][name].double()}},
        {**good, "model": {k: v for k, v in good["model"].items() if k != name}},
        {**good, "model": {**good["model"], "extra.weight": torch.zeros(1)}},
        {**good, "model": {**good["model"], name: torch.full_like(good["model"][name], float("nan"))}},
        {**good, "optimizer": {**good["optimizer"], "state": {**good["optimizer"]["state"],
                                                             0: {**moments, "exp_avg": torch.zeros(2)}}}},
        {**good, "optimizer": {"state": {}}},
        {"model": good["model"], "step": 2},
        [1, 2],
    ]
    for state in bad_states:
        with pytest.raises(CheckpointError) as info:
            trainer.load_state_dict(state)
        assert "\n" not in str(info.value)
    (tmp_path / "junk.pt").write_bytes(b"not a checkpoint")
    with pytest.raises(CheckpointError):
        trainer.load(tmp_path / "junk.pt")
    after = trainer.flat_state()
    assert [k for k in before if before[k].tobytes() != after[k].tobytes()] == []
    trainer.load_state_dict(good)  # the good one loads, bitwise
    assert all(np.array_equal(before[k], v) for k, v in trainer.flat_state().items())


def test_old_npz_checkpoints_still_load(tmp_path):
    """A checkpoint in the flat .npz format (what save() wrote before torch's layout, whatever
    the suffix) still resumes; an ONNX-graph trainer without a torch model says to use flat_state."""
    data = batches("mlp", 4)
    spec = get_model("mlp")
    trainer = _trainer(spec, data)
    for inputs, targets in data[:2]:
        trainer.step(*inputs, *targets)
    from ort_offload.checkpoint import Checkpoint, write_checkpoint
    old = write_checkpoint(tmp_path / "old.pt", Checkpoint(model="mlp", steps=2, losses=list(trainer.losses),
                                                          state=trainer.flat_state()))
    expected = [trainer.step(*i, *t) for i, t in data[2:]]
    resumed = _trainer(get_model("mlp"), data)
    resumed.load(old)
    assert resumed.steps_done == 2
    _close([resumed.step(*i, *t) for i, t in data[2:]], expected, rtol=0)
    resumed.model = None
    with pytest.raises(ort_offload.errors.OffloadError, match="flat_state"):
        resumed.state_dict()


def test_eval_outputs_are_torch_tensors_equal_to_torch():
    """(d): the trainer's eval() and the offloaded module in eval mode."""
    data = batches("cnn", 2)
    spec, module = _offloaded("cnn", data, "0.5x")
    reference = copy.deepcopy(spec.model)
    (inputs, targets) = data[1]
    module(*data[0][0], *data[0][1]).backward()  # a training call first: BatchNorm stats move
    spec.loss_fn(reference(*data[0][0]), *data[0][1]).backward()
    module.eval()
    reference.eval()
    with torch.no_grad():
        expected = reference(*inputs)
        ours = module(*inputs)
        trainer_out = module.trainer.eval(*inputs)
        our_loss = module(*inputs, *targets)
    for out in (ours, trainer_out):
        assert isinstance(out, torch.Tensor)
        assert max_relative_diff(out.numpy(), expected.numpy()) <= 1e-5
    assert abs(our_loss.item() - spec.loss_fn(expected, *targets).item()) <= 1e-5


def test_export_cache_keys_on_the_input_names(tmp_path):
    """A cached export made with other input names is not reused (it would miss its inputs)."""
    spec = get_model("mlp")
    ((x,), (y,)), = batches("mlp", 1)
    device = ort_offload.set_offload_device("cpu")
    for names in (["features"], None):
        trainer = ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=(x,),
                                                 example_targets=(y,), input_names=names, cache_dir=tmp_path)
        assert trainer.input_names == (names or ["input0"])
        assert np.isfinite(trainer.step(x, y))


def test_tied_parameters_in_the_offloaded_module_and_torch_checkpoints(tmp_path):
    """One tensor under two names: one gradient (both uses), both keys in the torch-format state."""
    from test_real_models import TiedLM, lm_loss, token_data

    torch.manual_seed(0)
    data = token_data(steps=3)
    model = TiedLM()
    reference = copy.deepcopy(model)
    device = ort_offload.set_offload_device("cpu")
    module = ort_offload.offload(model, device, example_inputs=data[0][0], example_targets=data[0][1],
                                 loss_fn=lm_loss, cache_dir=tmp_path)
    for inputs, targets in data:
        module.zero_grad()
        reference.zero_grad()
        module(*inputs, *targets).backward()
        lm_loss(reference(*inputs), *targets).backward()
        for ours, theirs in zip(module.parameters(), reference.parameters()):
            assert max_relative_diff(ours.grad.numpy(), theirs.grad.numpy()) <= 1e-5
    trainer = ort_offload.create_ort_trainer(device, TiedLM(), loss_fn=lm_loss, example_inputs=data[0][0],
                                             example_targets=data[0][1], cache_dir=tmp_path)
    trainer.step(*data[0][0], *data[0][1])
    state = trainer.state_dict()
    assert torch.equal(state["model"]["head.weight"], state["model"]["emb.weight"])
    fresh = TiedLM()
    fresh.load_state_dict(state["model"])
    torch.optim.AdamW(fresh.parameters()).load_state_dict(state["optimizer"])
    trainer.load_state_dict(state)


def test_reduce_lr_on_plateau_steps_on_the_update_loss():
    data = batches("mlp", 4)
    spec = get_model("mlp")
    reference = copy.deepcopy(spec.model)

    def plateau(optimizer):  # never "improves" (threshold 1.0): halves the lr after every update
        return torch.optim.lr_scheduler.ReduceLROnPlateau(optimizer, factor=0.5, patience=0, threshold=1.0)

    optimizer = torch.optim.SGD(spec.model.parameters(), lr=0.1)
    scheduler = plateau(optimizer)
    device = ort_offload.set_offload_device("cpu")
    trainer = ort_offload.create_ort_trainer(device, spec.model, loss_fn=spec.loss_fn, example_inputs=data[0][0],
                                             example_targets=data[0][1], optimizer=optimizer, lr_scheduler=scheduler)
    ours = [trainer.step(*i, *t) for i, t in data]
    torch_optimizer = torch.optim.SGD(reference.parameters(), lr=0.1)
    torch_scheduler = plateau(torch_optimizer)
    theirs = []
    for inputs, targets in data:
        loss = spec.loss_fn(reference(*inputs), *targets)
        torch_optimizer.zero_grad()
        loss.backward()
        torch_optimizer.step()
        torch_scheduler.step(loss.item())
        theirs.append(loss.item())
    _close(ours, theirs)
    assert optimizer.param_groups[0]["lr"] == torch_optimizer.param_groups[0]["lr"] == 0.1 / 16
    _assert_params_close(trainer.copy_to(copy.deepcopy(spec.model)), reference)
