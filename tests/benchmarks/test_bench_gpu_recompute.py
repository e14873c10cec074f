"""The GPU recompute-cost check (benchmarks/gpu_recompute.py) runs end to end on the CPU and
writes consistent JSON; on the CUDA machine it runs the same code. Both GPU scripts
(this one and benchmarks/gpu_mimose.py) refuse bad arguments with one line."""

from __future__ import annotations

import json

import pytest

from benchmarks import gpu_mimose, gpu_recompute


def test_a_cpu_run_times_both_steps_per_length(tmp_path, capsys):
    out = tmp_path / "gpu_recompute.json"
    assert gpu_recompute.main(["--device", "cpu", "--config", "tiny", "--lengths", "16,24",
                               "--repeats", "1", "--warmup", "1", "--out", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["model"] == "bert-tiny" and [r["length"] for r in result["rows"]] == [16, 24]
    for row in result["rows"]:
        plain, recompute = row["plain"], row["recompute_all"]
        assert plain["step_s"] > 0 and recompute["step_s"] > 0
        assert row["recompute_over_plain"] == pytest.approx(recompute["step_s"] / plain["step_s"])
        assert recompute["first_loss"] == pytest.approx(plain["first_loss"], rel=1e-6)
    total = sum(r["recompute_all"]["step_s"] for r in result["rows"]) / sum(r["plain"]["step_s"] for r in result["rows"])
    assert result["ceiling_over_lengths"] == pytest.approx(total)
    assert "recompute-all over plain" in capsys.readouterr().out


@pytest.mark.parametrize("script, argv", [
    *((gpu_recompute, a) for a in (["--lengths", "a,b"], ["--repeats", "0"], ["--lengths", ""], ["--batch", "0"])),
    *((gpu_mimose, a) for a in (["--steps", "1"], ["--batch", "0"], ["--fit-sizes", "0"], ["--budget-margin", "-1"])),
])
def test_bad_arguments_exit_with_one_line(tmp_path, script, argv):
    out = tmp_path / "x.json"
    with pytest.raises(SystemExit) as exited:
        script.main(["--device", "cpu", "--out", str(out), *argv])
    assert isinstance(exited.value.code, str) and "\n" not in exited.value.code
    assert not out.exists()


def test_recomputed_layers_run_their_forward_again_in_the_backward():
    import torch

    from models import get_model

    spec = get_model("bert", "tiny")
    (ids,), (y,) = spec.make_batch(seq=16, seed=0)
    calls = []
    layers = list(spec.model.layers)
    for layer in layers:  # counted in forward itself: module hooks do not fire in the recomputation
        def counted(x, forward=layer.forward):
            calls.append(1)
            return forward(x)
        layer.forward = counted
    gpu_recompute._recompute_layers(torch, spec.model)
    assert [m.layer for m in spec.model.layers] == layers
    gpu_recompute._step_fn(torch, spec.model, spec.loss_fn, ids, y)()
    assert len(calls) == 2 * len(layers)  # once in the forward, once more in the backward
