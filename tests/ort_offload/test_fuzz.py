"""Fuzzing the user-facing contract: generated bad argument vectors for every CLI command and
generated corrupt files (graphs, checkpoints, zoo baselines) must each end in exit code 2 (or
an OffloadError from the API) with one line on stderr, no traceback, and no file written or
changed.

Every generated case holds at least one value the checks refuse before any work, so a case
that trains or exports is itself a failure of the contract. The full runs (300 CLI vectors,
100 checkpoint mutations, a few subprocess runs) are marked ``slow`` (``make test-all``); a
short run of each is part of ``make test``.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import numpy as np
import onnx
import onnx.helper as oh
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ort_offload.budget import parse_budget
from ort_offload.cli import main
from ort_offload.errors import BudgetParseError, CheckpointError, OffloadError

REPO = Path(__file__).resolve().parents[2]
QUICK, FULL = 40, 300
_SETTINGS = dict(deadline=None, suppress_health_check=list(HealthCheck), derandomize=True, database=None)

# ---- the bad values ------------------------------------------------------------------------------

BAD_BUDGETS = st.sampled_from([
    "1e400", "inf", "-inf", "nan", "-1", "0", "0.0", "0x", "-0.5x", "infx", "nanx", "1e30", "abc", "64XB", "",
    " ", "1e400x", "9" * 400 + "x", "0.1", "x", "1.5.5GiB", "0b101", "1_000", "MiB", "\n", "64MiB\n0",
]) | st.text(max_size=12).filter(lambda t: _budget_refused(t))
BAD_COUNTS = st.sampled_from(["-1", "0", "-100", "1.5", "abc", "", "1e3", "99999999999999999999999", "0x10", " "]) \
    | st.integers(max_value=0).map(str) | st.integers(min_value=2**40, max_value=2**80).map(str)
BAD_LOW_COUNTS = BAD_COUNTS.filter(lambda t: not t.strip().isdigit() or int(t) < 1)  # no upper bound (--block-nodes)
BAD_SEEDS = st.sampled_from(["-1", str(2**31), str(2**64), "x", "1.0", ""]) | st.integers(max_value=-1).map(str)
BAD_LRS = st.sampled_from(["nan", "inf", "-inf", "-1e-3", "abc", "", "1e400", "-0.1", "NaN", "+inf"])
# Names no registry knows: printable ASCII with a letter or digit, no comma (a comma list with
# only empty names would mean "none" to some options), not an option.
BAD_NAMES = st.text(alphabet=st.characters(codec="ascii", min_codepoint=32, exclude_characters=","),
                    min_size=1, max_size=10).filter(
    lambda t: any(c.isalnum() for c in t) and not t.startswith("-") and t.strip().lower() not in _KNOWN_NAMES)
BAD_PATHS = st.sampled_from(["{DIR}", "{DIR}/", "{MISSING}", "{FILE}/r.json", "/dev/null", "", "{LONG}"])
BAD_OPTIONS = st.sampled_from(["--no-such-option", "--budget", "--steps", "-o", "--json", "--input"])
JUNK = st.lists(st.text(max_size=8), max_size=5).filter(
    lambda v: not v or (v[0] not in _COMMANDS and not any(t.startswith("-") for t in v)))

_COMMANDS = {"train", "export", "run", "transform", "inspect", "zoo", "pilot"}
_KNOWN_NAMES = {"mlp", "gpt", "cnn", "bert", "lstm", "var-bert", "fixed-bert", "moe", "tree-lstm", "var-lstm",
                "fixed-lstm", "recycle-former", "tiny", "small", "tiny12", "deep", "adamw", "sgd", "auto", "none",
                "swap", "recompute", "split", "cpu", "min"}


def _zoo_budgets_refused(text: str) -> bool:
    """Whether ``zoo --budgets text`` has a label that is neither ``min`` nor a fraction."""
    def refused(label):
        label = label.strip()
        if label == "min":
            return False
        try:
            return not parse_budget(label).is_fraction
        except BudgetParseError:
            return True

    return any(refused(label) for label in text.split(","))


def _budget_refused(text: str) -> bool:
    try:
        parse_budget(text)
    except BudgetParseError:
        return True
    return False


# ---- argument vectors: a valid base plus at least one bad value ---------------------------------


def _with(base, *extra):
    return st.tuples(*[st.just(x) if not isinstance(x, st.SearchStrategy) else x for x in extra]).map(
        lambda values: list(base) + list(values))


TRAIN = ["train", "--model", "mlp", "--steps", "1", "--quiet"]
RUN = ["run", "{GRAPH}", "--steps", "1", "--quiet"]
TRANSFORM = ["transform", "{GRAPH}", "-o", "{OUT}", "--budget", "0.5x"]
INSPECT = ["inspect", "{GRAPH}"]
EXPORT = ["export", "--model", "mlp", "-o", "{OUT}"]
ZOO = ["zoo", "--quick", "--quiet", "--baseline", "{BASELINE}"]
PILOT = ["pilot", "train", "--out", "{DIR}", "--quiet"]


def _common_run_options(base):
    return st.one_of(
        _with(base, "--budget", BAD_BUDGETS),
        _with(base, "--steps", BAD_COUNTS),
        _with(base, "--block-nodes", BAD_LOW_COUNTS),
        _with(base, "--seed", BAD_SEEDS),
        _with(base, st.sampled_from(["--json", "--plot"]), BAD_PATHS),
        _with(base, "--json", "{OUT}", "--plot", "{OUT}"),
        _with(base, "--passes", BAD_NAMES),
        _with(base, "--arena-policy", BAD_NAMES),
        _with(base, BAD_OPTIONS),
    )


ARGV = st.one_of(
    _common_run_options(TRAIN),
    _with(TRAIN, st.sampled_from(["--batch", "--seq"]), BAD_COUNTS),
    _with(TRAIN, "--lr", BAD_LRS),
    _with(TRAIN, st.sampled_from(["--model", "--config", "--optimizer", "--predictor"]), BAD_NAMES),
    _with(TRAIN, "--cache-dir", st.sampled_from(["{FILE}", "{FILE}/sub", ""])),
    _with(TRAIN, "--seq-range", st.sampled_from(["0:5", "5:1", "a:b", "5", ":", "-1:3"])),
    _with(["train", "--model", "gpt", "--steps", "1", "--quiet"], "--seq-range", st.just("1:99999999")),
    _with(["train", "--model", "var-bert", "--steps", "1", "--quiet"], "--misprediction-log", BAD_PATHS),
    _common_run_options(RUN),
    _with(RUN, "--json", "{GRAPH}"),
    _with(RUN, "--input", st.sampled_from(["x", "x=", "=4", "x=4x", "nope=3", "x=axb", "x=0", "w=2"])),
    _with(TRANSFORM[:-2], "--budget", BAD_BUDGETS),
    _with(TRANSFORM, st.sampled_from(["-o", "--report", "--plot"]), st.sampled_from(["{GRAPH}", "{DIR}", "{MISSING}"])),
    _with(TRANSFORM, "--passes", BAD_NAMES),
    _with(INSPECT, "--json", st.sampled_from(["{GRAPH}", "{DIR}", "{MISSING}", "/dev/null"])),
    _with(INSPECT, "--input", st.sampled_from(["x", "=4", "x=4x", "x=axb"])),
    _with(EXPORT[:-2], "-o", BAD_PATHS),
    _with(EXPORT, st.sampled_from(["--batch", "--seq"]), BAD_COUNTS),
    _with(EXPORT, "--lr", BAD_LRS),
    _with(EXPORT, "--seed", BAD_SEEDS),
    _with(EXPORT, "--model", BAD_NAMES),
    _with(EXPORT, "--cache-dir", st.sampled_from(["{FILE}", "{FILE}/sub"])),
    _with(ZOO, "--budgets", st.one_of(BAD_BUDGETS, st.just("0.5x,infx")).filter(_zoo_budgets_refused)),
    _with(ZOO, "--steps", BAD_COUNTS),
    _with(ZOO, st.sampled_from(["--json", "--markdown"]), st.sampled_from(["{DIR}", "{MISSING}", "{BASELINE}"])),
    _with(ZOO, "--models", BAD_NAMES.filter(lambda t: "," not in t)),
    _with(ZOO, "--passes", st.sampled_from(["none", "bogus"])),
    _with(["zoo", "--quick", "--quiet", "--baseline", "{JUNKFILE}"]),
    _with(PILOT, st.sampled_from(["--samples", "--steps", "--hidden", "--test-samples"]), BAD_COUNTS),
    _with(PILOT, "--holdout", BAD_NAMES.filter(lambda t: t.strip().lower() != "none")),
    _with(["pilot", "train", "--out", "{FILE}"]),
    JUNK,
)

CORRUPT_GRAPH = st.one_of(
    st.just(b""),
    st.binary(min_size=1, max_size=200),
    st.sampled_from([b"this is not onnx", b"\x08\x07", b"\n\x00", b"\xff" * 64]),
    st.floats(min_value=0.01, max_value=0.95).map(lambda f: ("truncate", f)),
)


# ---- one case: materialize, run, check the contract ----------------------------------------------


def _toy_graph() -> onnx.ModelProto:
    """A training step of two state values and one batch input (valid: it trains)."""
    nodes = [
        oh.make_node("Mul", ["x", "w"], ["xw"]),
        oh.make_node("ReduceSum", ["xw"], ["loss"], keepdims=0),
        oh.make_node("Mul", ["w", "w"], ["w.updated"]),
    ]
    graph = oh.make_graph(nodes, "toy", [oh.make_tensor_value_info("w", onnx.TensorProto.FLOAT, [4]),
                                         oh.make_tensor_value_info("x", onnx.TensorProto.FLOAT, [4])],
                          [oh.make_tensor_value_info("loss", onnx.TensorProto.FLOAT, []),
                           oh.make_tensor_value_info("w.updated", onnx.TensorProto.FLOAT, [4])])
    return oh.make_model(graph, opset_imports=[oh.make_opsetid("", 20)], ir_version=10)


TOY = _toy_graph().SerializeToString()


@dataclasses.dataclass
class Workdir:
    """A fresh directory per case: an input graph, an existing file and directory, and names."""

    root: Path

    def place(self, graph_bytes: bytes) -> dict[str, str]:
        (self.root / "d").mkdir()
        (self.root / "f.txt").write_text("an existing file")
        (self.root / "junk.json").write_text("{not json")
        (self.root / "g.onnx").write_bytes(graph_bytes)
        return {
            "{GRAPH}": str(self.root / "g.onnx"), "{DIR}": str(self.root / "d"), "{FILE}": str(self.root / "f.txt"),
            "{MISSING}": str(self.root / "nodir" / "out.json"), "{OUT}": str(self.root / "out.bin"),
            "{BASELINE}": str(self.root / "baseline.json"), "{JUNKFILE}": str(self.root / "junk.json"),
            "{LONG}": str(self.root / ("x" * 300)),
        }


def _materialize(argv: list[str], names: dict[str, str]) -> list[str]:
    out = []
    for token in argv:
        for key, value in names.items():
            token = token.replace(key, value)
        out.append(token)
    return out


def _snapshot(root: Path) -> dict[str, str]:
    return {str(p.relative_to(root)): (hashlib.sha256(p.read_bytes()).hexdigest() if p.is_file() else "dir")
            for p in sorted(root.rglob("*"))}


def _graph_bytes(corrupt) -> bytes:
    if isinstance(corrupt, tuple):
        return TOY[: max(1, int(len(TOY) * corrupt[1]))]
    return corrupt


def _still_a_graph(data: bytes) -> bool:
    try:
        onnx.checker.check_model(onnx.load_model_from_string(data))
    except Exception:
        return False
    return True


def check_cli_case(argv: list[str], graph_bytes: bytes, capsys) -> None:
    """Run ``argv`` in a fresh directory and assert the contract."""
    root = Path(tempfile.mkdtemp(prefix="fuzz-"))
    cwd = os.getcwd()
    try:
        names = Workdir(root).place(graph_bytes)
        args = _materialize(argv, names)
        before = _snapshot(root)
        os.chdir(root)
        capsys.readouterr()
        try:
            code = main(args)
        except SystemExit as e:  # argparse
            code = e.code
        err = capsys.readouterr().err.strip()
        assert code == 2, (args, code, err)
        assert len(err.splitlines()) == 1, (args, err)
        assert "Traceback" not in err and err.startswith("ort-offload"), (args, err)
        assert _snapshot(root) == before, args
    finally:
        os.chdir(cwd)
        shutil.rmtree(root, ignore_errors=True)


def _cli_fuzz(argv, capsys):
    check_cli_case(argv, TOY, capsys)


@settings(max_examples=QUICK, **_SETTINGS)
@given(argv=ARGV)
def test_bad_argument_vectors_quick(argv, capsys):
    _cli_fuzz(argv, capsys)


@pytest.mark.slow
@settings(max_examples=FULL, **_SETTINGS)
@given(argv=ARGV)
def test_bad_argument_vectors(argv, capsys):
    _cli_fuzz(argv, capsys)


@settings(max_examples=QUICK, **_SETTINGS)
@given(corrupt=CORRUPT_GRAPH, command=st.sampled_from([RUN, INSPECT, TRANSFORM]))
def test_corrupt_graph_files(corrupt, command, capsys):
    data = _graph_bytes(corrupt)
    if _still_a_graph(data):  # a cut at a field boundary can leave a smaller valid graph: not a bad input
        return
    check_cli_case(command, data, capsys)


# ---- the API: budgets and corrupt checkpoints ---------------------------------------------------


@settings(max_examples=200, **_SETTINGS)
@given(value=st.one_of(st.text(max_size=20), st.floats(allow_nan=True, allow_infinity=True),
                       st.integers(min_value=-2**70, max_value=2**70), st.booleans(), st.none(),
                       st.lists(st.integers(), max_size=2)))
def test_budgets_parse_or_raise_budget_parse_error(value):
    try:
        budget = parse_budget(value)
    except BudgetParseError as e:
        assert "\n" not in str(e)
        return
    assert budget is None or budget.is_fraction or 1 <= budget.nbytes <= 2**60


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """An mlp trainer after one step, and the bytes of its checkpoint."""
    from helpers import train_ort

    run = train_ort("mlp", steps=1, optimizer="adamw")
    path = run.trainer.save(tmp_path_factory.mktemp("ckpt") / "c.npz")
    return run.trainer, path.read_bytes()


def _mutate(data: bytes, how) -> bytes:
    kind, position, value = how
    at = int(position * len(data))
    if kind == "truncate":
        return data[:at]
    if kind == "flip":
        return data[:at] + bytes([data[min(at, len(data) - 1)] ^ (value or 1)]) + data[at + 1:]
    return data[:at] + bytes([value]) * 16 + data[at + 16:]  # overwrite a run


MUTATIONS = st.tuples(st.sampled_from(["truncate", "flip", "overwrite"]), st.floats(0, 0.999),
                      st.integers(0, 255))
BAD_META = st.fixed_dictionaries({}, optional={
    "format": st.one_of(st.text(max_size=8), st.integers()),
    "model": st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2)),
    "steps": st.one_of(st.text(max_size=4), st.floats(allow_nan=False), st.integers(-5, -1), st.booleans(), st.none()),
    "losses": st.one_of(st.integers(), st.text(max_size=4), st.lists(st.text(max_size=2), min_size=1, max_size=2)),
}) | st.one_of(st.lists(st.integers(), max_size=3), st.text(max_size=6), st.integers())


def _check_load(trainer, path: Path) -> None:
    """Loading ``path`` raises CheckpointError with the state unchanged, or restores it exactly."""
    before, steps = trainer.flat_state(), trainer.steps_done
    with contextlib.suppress(CheckpointError):
        trainer.load(path)
    after = trainer.flat_state()
    assert all(before[k].tobytes() == after[k].tobytes() for k in before)
    assert trainer.steps_done == steps


def _checkpoint_fuzz(saved, tmp_path_factory, how=None, meta=None):
    trainer, data = saved
    path = tmp_path_factory.mktemp("bad") / "c.npz"
    if how is not None:
        path.write_bytes(_mutate(data, how))
    else:
        state = {f"state/{k}": v for k, v in trainer.flat_state().items()}
        np.savez(path, __meta__=np.array(json.dumps(meta)), **state)
    _check_load(trainer, path)


@settings(max_examples=QUICK, **_SETTINGS)
@given(how=MUTATIONS)
def test_corrupt_checkpoint_bytes_quick(saved, tmp_path_factory, how):
    _checkpoint_fuzz(saved, tmp_path_factory, how=how)


@pytest.mark.slow
@settings(max_examples=100, **_SETTINGS)
@given(how=MUTATIONS)
def test_corrupt_checkpoint_bytes(saved, tmp_path_factory, how):
    _checkpoint_fuzz(saved, tmp_path_factory, how=how)


@settings(max_examples=QUICK, **_SETTINGS)
@given(meta=BAD_META)
def test_bad_checkpoint_metadata(saved, tmp_path_factory, meta):
    trainer, _ = saved
    with pytest.raises(CheckpointError):
        path = tmp_path_factory.mktemp("meta") / "c.npz"
        state = {f"state/{k}": v for k, v in trainer.flat_state().items()}
        np.savez(path, __meta__=np.array(json.dumps(meta)), **state)
        trainer.load(path)
    assert issubclass(CheckpointError, OffloadError)


# ---- the real process: no traceback, one line ---------------------------------------------------


SUBPROCESS_CASES = [
    ["train", "--model", "mlp", "--budget", "1e400"],
    ["train", "--model", "mlp", "--block-nodes", "-1"],
    ["train", "--model", "mlp", "--json", "{DIR}"],
    ["train", "--model", "mlp", "--lr", "nan"],
    ["run", "{GRAPH}", "--json", "{GRAPH}"],
    ["transform", "{GRAPH}", "-o", "{GRAPH}", "--budget", "0.5x"],
    ["export", "--model", "mlp", "-o", "{OUT}", "--cache-dir", "{FILE}"],
    ["zoo", "--budgets", "infx", "--baseline", "{BASELINE}"],
    ["inspect", "{GRAPH}", "--json", "{DIR}"],
    ["train", "--model", "mlp", "--steps", "x"],
]


@pytest.mark.slow
@pytest.mark.parametrize("argv", SUBPROCESS_CASES, ids=lambda a: " ".join(a[:4]))
def test_the_real_process_prints_one_line(argv, tmp_path):
    names = Workdir(tmp_path).place(TOY)
    before = _snapshot(tmp_path)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
    result = subprocess.run([sys.executable, "-m", "ort_offload", *_materialize(argv, names)], cwd=tmp_path,
                            capture_output=True, text=True, env=env, timeout=300)
    assert result.returncode == 2, result.stderr
    assert len(result.stderr.strip().splitlines()) == 1 and "Traceback" not in result.stderr, result.stderr
    assert _snapshot(tmp_path) == before


# ---- the API: devices, output paths and batches ---------------------------------------------------


@settings(max_examples=QUICK * 2, **_SETTINGS)
@given(budget=st.one_of(st.none(), BAD_BUDGETS, st.sampled_from(["0.5x", "64MiB", 4096])),
       block_nodes=st.one_of(st.none(), st.integers(-3, 3), st.floats(allow_nan=True), st.text(max_size=3)),
       threads=st.one_of(st.integers(-2, 4), st.none(), st.text(max_size=2)),
       policy=st.sampled_from(["best_fit", "double_buffer", "nope", ""]))
def test_set_offload_device_returns_a_device_or_raises_an_offload_error(budget, block_nodes, threads, policy):
    import ort_offload

    try:
        device = ort_offload.set_offload_device("cpu", budget=budget, max_block_nodes=block_nodes,
                                                intra_op_threads=threads, arena_policy=policy)
    except OffloadError as e:
        assert "\n" not in str(e)
        return
    assert device.max_block_nodes is None or device.max_block_nodes >= 1


@settings(max_examples=QUICK * 2, **_SETTINGS)
@given(names=st.lists(st.text(alphabet="ab./\\x00 -", max_size=6), min_size=1, max_size=3))
def test_output_path_checks_accept_or_raise_an_offload_error(names):
    from ort_offload.validation import check_output_paths

    root = Path(tempfile.mkdtemp(prefix="paths-"))
    try:
        (root / "a").mkdir()
        (root / "b").write_text("input")
        before = _snapshot(root)
        outputs = {f"--out{i}": str(root / n) if n else "" for i, n in enumerate(names)}
        with contextlib.suppress(OffloadError):
            check_output_paths(outputs, inputs=[root / "b"])
        assert _snapshot(root) == before
    finally:
        shutil.rmtree(root, ignore_errors=True)


@pytest.fixture(scope="module")
def gpt_trainer():
    from helpers import train_ort

    return train_ort("gpt", steps=1, optimizer="adamw").trainer


ARRAYS = st.tuples(
    st.sampled_from(["float32", "float64", "int64", "int32", "bool", "float16"]),
    st.lists(st.integers(0, 20), max_size=3),
    st.integers(-70000, 70000),
).map(lambda t: np.full(t[1], t[2]).astype(t[0]))


@settings(max_examples=QUICK * 2, **_SETTINGS)
@given(batch=st.lists(ARRAYS, min_size=0, max_size=3))
def test_bad_batches_raise_input_mismatch_and_keep_the_state(gpt_trainer, batch):
    """A step on arrays of any dtype, shape and value: it trains, or an OffloadError leaves the state as it was."""
    before, steps = gpt_trainer.flat_state(), gpt_trainer.steps_done
    try:
        gpt_trainer.step(*batch)
    except OffloadError as e:
        assert "\n" not in str(e)
        after = gpt_trainer.flat_state()
        assert all(before[k].tobytes() == after[k].tobytes() for k in before) and gpt_trainer.steps_done == steps
