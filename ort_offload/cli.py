"""The ``ort-offload`` command line: ``train``, ``export``, ``run``, ``transform``, ``inspect``, ``zoo``, ``pilot train``.

``train`` trains a zoo model under a budget and prints the report; ``export`` writes a zoo
model's training step as ONNX; ``run`` executes any training-step ONNX file under a budget;
``transform`` writes the plan for a budget into a graph; ``inspect`` summarises a graph;
``zoo`` runs the model-zoo regression (exit code 1 when a model regresses); ``pilot train``
trains the DyNN-Offload pilot on the dynamic zoo (:mod:`pilot.train`). ``run``,
``transform`` and ``inspect`` also take the ``training_model.onnx`` of ORT's ``generate_artifacts``
(:mod:`ort_offload.export.ort_artifacts`; its kernels need ``.venv-compat``).
Every user error prints one line and exits with code 2; nothing is left half-written.
"""

from __future__ import annotations

import argparse
import logging
import random
import sys
from pathlib import Path
from typing import Sequence

EXIT_USAGE = 2
# The loggers -v and -vv turn up: our packages, and ONNX Runtime's own log (graph_passes.ort_logging).
OUR_LOGGERS = ("ort_offload", "graph_passes", "pilot", "models", "custom_ops", "onnxruntime")
EXIT_REGRESSION = 1
# Upper bounds of counts: the CLI makes every step's batch up front, and a bigger batch,
# sequence or pilot width is a typo rather than a run this machine could finish.
MAX_STEPS = 1_000_000
MAX_SIZE = 2**20
MAX_SAMPLES = 10_000_000
# (option, attribute, largest value, hint) of every count option; the smallest is 1 for all.
COUNT_OPTIONS = (
    ("--steps", "steps", MAX_STEPS, ""),
    ("--batch", "batch", MAX_SIZE, ""),
    ("--seq", "seq", MAX_SIZE, ""),
    ("--block-nodes", "block_nodes", None, "; omit it for the largest blocks that fit the budget"),
    ("--samples", "samples", MAX_SAMPLES, ""),
    ("--test-samples", "test_samples", MAX_SAMPLES, ""),
    ("--hidden", "hidden", MAX_SIZE, ""),
)


class _Parser(argparse.ArgumentParser):
    """argparse under the CLI's error contract: one line on stderr and exit code 2."""

    def error(self, message: str):
        self.exit(EXIT_USAGE, f"{self.prog}: error: {' '.join(message.split())} (see --help)\n")


def _add_common_run_options(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--budget", default=None, help="device budget: bytes, 64MiB, 1.5GiB or 0.5x of the unplanned peak (default: unlimited)")
    parser.add_argument("--steps", type=int, default=5, help="training steps to run (default 5)")
    parser.add_argument("--passes", default="auto",
                        help="auto (what the budget needs: swap, then split), none, or a comma list of passes (recompute, swap, split)")
    parser.add_argument("--json", dest="json_path", default=None, help="write the report as JSON")
    parser.add_argument("--plot", dest="plot_path", default=None, help="write a PNG of device bytes over one step")
    parser.add_argument("--device", default="cpu", help="device to run on: cpu, cuda or cuda:N (needs onnxruntime-gpu)")
    parser.add_argument("--block-nodes", type=int, default=None,
                        help="max nodes per execution block, at least 1 (default: the largest blocks that fit the budget)")
    parser.add_argument("--arena-policy", default="best_fit", choices=_arena_policies(),
                        help="where the arena places tensors (double_buffer: work and migration halves)")
    parser.add_argument("--recompute-policy", default="input_aware", choices=_recompute_policies(),
                        help="recompute plans per input size (input_aware, Mimose) or one for every size (static)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--stop-on-nonfinite", action="store_true",
                        help="stop (exit code 2) at the first step whose loss or update is NaN or infinite, "
                             "before it changes the state (default: count such steps and warn)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar or table")


def build_parser() -> argparse.ArgumentParser:
    from ort_offload.version import package_version

    parser = _Parser(prog="ort-offload", description="Train models larger than device memory on ONNX Runtime.")
    parser.add_argument("-v", "--verbose", action="count", default=0,
                        help="log more: -v our info, -vv our debug, -vvv every library's debug too "
                             "(torch's follow TORCH_LOGS)")
    parser.add_argument("--version", action="version", version=f"%(prog)s {package_version()}")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_train_command(sub)
    _add_export_command(sub)
    _add_transform_command(sub)
    _add_inspect_command(sub)
    _add_run_command(sub)
    _add_pilot_command(sub)
    _add_zoo_command(sub)
    return parser


def _add_train_command(sub) -> None:
    """The ``train`` command and its options."""
    train = sub.add_parser("train", help="train a zoo model under a budget and print the report")
    train.add_argument("--model", required=True,
                       help="zoo model: mlp, gpt, cnn, bert, lstm; dynamic (trained block-wise): var-bert, fixed-bert, "
                            "moe, tree-lstm, var-lstm, fixed-lstm, recycle-former")
    train.add_argument("--config", default="tiny", help="model config (tiny, small)")
    train.add_argument("--batch", type=int, default=None)
    train.add_argument("--seq", type=int, default=None)
    train.add_argument("--seq-range", default=None, metavar="MIN:MAX",
                       help="variable-length training: each step's sequence length drawn from MIN..MAX (the "
                            "first step gets MAX); one exported graph serves every length, each new one is planned")
    train.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    train.add_argument("--lr", type=float, default=None)
    train.add_argument("--verify", action="store_true", help="also train in plain torch and report the largest differences")
    train.add_argument("--cache-dir", default=None, help="export cache directory")
    train.add_argument("--shard-optimizer-state", action="store_true",
                       help="under torchrun: each rank keeps the optimizer state of its 1/N of the parameters (ZeRO 1-2)")
    train.add_argument("--predictor", default=None, choices=["pilot", "oracle", "none", "wrong"],
                       help="dynamic models: who predicts each batch's path for prefetching (pilot: the trained pilot "
                            "model, the default where it can enumerate the model's paths, else oracle; oracle: the "
                            "true path; none: every fetch on demand; wrong: always mispredicted, for testing)")
    train.add_argument("--misprediction-log", default=None, help="dynamic models: append mispredicted batches (JSON lines)")
    _add_common_run_options(train)


def _add_export_command(sub) -> None:
    """The ``export`` command and its options."""
    export = sub.add_parser("export", help="write a zoo model's training step as ONNX")
    export.add_argument("--model", required=True)
    export.add_argument("--config", default="tiny")
    export.add_argument("--batch", type=int, default=None)
    export.add_argument("--seq", type=int, default=None)
    export.add_argument("--optimizer", default="adamw", choices=["adamw", "sgd"])
    export.add_argument("--lr", type=float, default=None)
    export.add_argument("--seed", type=int, default=0)
    export.add_argument("-o", "--output", required=True, help="output .onnx path")
    export.add_argument("--cache-dir", default=None)


def _add_transform_command(sub) -> None:
    """The ``transform`` command and its options."""
    transform = sub.add_parser("transform", help="plan a training-step ONNX graph for a budget and write the plan into it")
    transform.add_argument("graph", help="training-step .onnx file, or the training_model.onnx of ORT's generate_artifacts")
    transform.add_argument("-o", "--output", required=True, help="rewritten .onnx path")
    transform.add_argument("--budget", required=True, help="device budget: bytes, 64MiB or 0.5x of the unplanned peak")
    transform.add_argument("--passes", default="auto", help="auto, none, or a comma list (recompute, swap)")
    transform.add_argument("--input", action="append", default=[], metavar="NAME=SHAPE",
                           help="concrete shape of an input with symbolic dims (repeatable)")
    transform.add_argument("--report", dest="json_path", default=None, help="write what changed and why as JSON")
    transform.add_argument("--plot", dest="plot_path", default=None, help="PNG of device bytes, before and after")
    transform.add_argument("--device", default="cpu")
    transform.add_argument("--device-profile", default=None, choices=_profile_names(),
                           help="plan for this device profile's speeds (default: the device itself)")
    transform.add_argument("--plan-time", type=float, default=None,
                           help="seconds of planning in all: what the grid leaves goes to a genetic swap search (GPU profiles; 0: grid only)")
    transform.add_argument("--plan-evaluations", type=int, default=None,
                           help="cap on the genetic search's plan evaluations: with it, the plan depends only on "
                                "the seed, not on this machine's speed")
    transform.add_argument("--plan-workers", type=int, default=None, metavar="N",
                           help="processes the genetic search times plans in (default: the usable cores, at most 4)")


def _add_inspect_command(sub) -> None:
    """The ``inspect`` command and its options."""
    inspect = sub.add_parser("inspect", help="summarise a training-step ONNX graph")
    inspect.add_argument("graph", help="training-step .onnx file")
    inspect.add_argument("--input", action="append", default=[], metavar="NAME=SHAPE")
    inspect.add_argument("--json", dest="json_path", default=None)


def _add_run_command(sub) -> None:
    """The ``run`` command and its options."""
    run = sub.add_parser("run", help="execute a training-step ONNX graph under a budget")
    run.add_argument("graph", help="training-step .onnx file (or an ORT artifact training_model.onnx: parameters from its checkpoint)")
    run.add_argument("--input", action="append", default=[], metavar="NAME=SHAPE",
                     help="concrete shape of an input with symbolic dims, e.g. ids=8x128 (repeatable)")
    _add_common_run_options(run)


def _add_pilot_command(sub) -> None:
    """The ``pilot`` command and its options."""
    pilot = sub.add_parser("pilot", help="the DyNN-Offload pilot model: offline training")
    pilot_sub = pilot.add_subparsers(dest="pilot_command", required=True)
    pilot_train = pilot_sub.add_parser("train", help="train the pilot on the dynamic zoo and write pilot.onnx + pilot-report.json")
    pilot_train.add_argument("--out", default=".", help="existing directory for pilot.onnx and pilot-report.json (default .)")
    pilot_train.add_argument("--samples", type=int, default=None, help="training samples per family (default 4000)")
    pilot_train.add_argument("--test-samples", type=int, default=None, help="test samples per family (default 200)")
    pilot_train.add_argument("--steps", type=int, default=None, help="optimizer steps (default 12000)")
    pilot_train.add_argument("--hidden", type=int, default=None, help="width of each MLP layer (default 48)")
    pilot_train.add_argument("--holdout", default=None,
                             help="comma list of families kept out of training, or 'none' (default var-lstm,var-bert)")
    pilot_train.add_argument("--families", default=None, help="comma list of families to use (default: all seven)")
    pilot_train.add_argument("--seed", type=int, default=0)
    pilot_train.add_argument("--quiet", action="store_true", help="no table")


def _add_zoo_command(sub) -> None:
    """The ``zoo`` command and its options."""
    zoo = sub.add_parser("zoo", help="model-zoo regression: onnx light models and our zoo at several budgets")
    zoo.add_argument("--quick", action="store_true",
                     help="fast subset for CI: two light models and our tiny zoo at 0.5x")
    zoo.add_argument("--models", default=None, help="comma list of zoo models to run (default: all)")
    zoo.add_argument("--budgets", default=None, help="comma list of budgets (default 1.0x,0.5x,0.25x,min)")
    zoo.add_argument("--steps", type=int, default=2, help="training steps per run (default 2)")
    zoo.add_argument("--passes", default="auto", help="passes to plan with (default auto: swap where needed)")
    zoo.add_argument("--json", dest="json_path", default=None, help="write the results as JSON")
    zoo.add_argument("--markdown", dest="markdown_path", default=None, help="write the table as markdown")
    zoo.add_argument("--baseline", default=None,
                     help="baseline results: deltas are shown against it and a complete passing run replaces it "
                          "(default: none, nothing compared or written)")
    zoo.add_argument("--quiet", action="store_true", help="no progress bar")


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    _configure_logging(args.verbose)
    _route_onnxruntime_log()
    from models import UnknownModelError as ZooUnknownModel
    from ort_offload.errors import OffloadError

    try:
        _validate(args)
        if args.command == "train":
            return _train(args)
        if args.command == "export":
            return _export(args)
        if args.command == "transform":
            return _transform(args)
        if args.command == "inspect":
            return _inspect(args)
        if args.command == "zoo":
            return _zoo(args)
        if args.command == "pilot":
            return _pilot_train(args)
        return _run(args)
    except (OffloadError, ZooUnknownModel) as e:
        print(f"ort-offload: error: {_one_line(str(e))}", file=sys.stderr)
        return EXIT_USAGE
    except OSError as e:  # the file system refused a read or write the checks could not foresee
        where = f" ({e.filename})" if e.filename else ""
        print(f"ort-offload: error: {_one_line(e.strerror or str(e))}{_one_line(where)}: check the path, its "
              "permissions and the free space", file=sys.stderr)
        return EXIT_USAGE
    except KeyboardInterrupt:
        print("ort-offload: interrupted", file=sys.stderr)
        return 130


def _configure_logging(verbose: int) -> None:
    """Warnings of every logger; ``-v`` adds our info, ``-vv`` our debug, ``-vvv`` every
    library's debug (onnxscript and onnx_ir log thousands of lines; torch sets its own levels)."""
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    if verbose <= 0:
        return
    level = logging.INFO if verbose == 1 else logging.DEBUG
    for name in OUR_LOGGERS:
        logging.getLogger(name).setLevel(level)
    if verbose >= 3:
        logging.getLogger().setLevel(logging.DEBUG)


def _route_onnxruntime_log() -> None:
    """ONNX Runtime's default logger at the severity our verbosity asks for (graph_passes.ort_logging)."""
    import onnxruntime as ort

    from graph_passes.ort_logging import ort_log_severity

    ort.set_default_logger_severity(ort_log_severity())


def _one_line(text: str) -> str:
    return " ".join(text.split())


# ---- checks before any work ---------------------------------------------------------------------


def _validate(args) -> None:
    """Check every user-given value of ``args`` before any work: counts, seed, learning rate,
    budgets, output paths and directories. A refused command has written and changed nothing."""
    from ort_offload.budget import parse_budget
    from ort_offload.validation import check_count, check_directory, check_learning_rate, check_seed

    for flag, attr, maximum, hint in COUNT_OPTIONS:
        if getattr(args, attr, None) is not None:
            check_count(getattr(args, attr), name=flag, minimum=1, maximum=maximum, hint=hint)
    if getattr(args, "seed", None) is not None:
        check_seed(args.seed)
    if getattr(args, "lr", None) is not None:
        check_learning_rate(args.lr, name="--lr")
    if getattr(args, "budget", None) is not None:
        parse_budget(args.budget)
    if getattr(args, "cache_dir", None) is not None:
        check_directory(args.cache_dir, name="--cache-dir")
    if args.command == "zoo":
        _zoo_budgets(args)
    _validate_paths(args)


def _validate_paths(args) -> None:
    """Outputs: writable files, none a directory, an input of the command or another output."""
    from ort_offload.validation import check_output_paths

    graph = getattr(args, "graph", None)
    inputs = [graph, f"{graph}.data"] if graph is not None else []
    outputs = {
        "-o": getattr(args, "output", None),
        "--json" if args.command != "transform" else "--report": getattr(args, "json_path", None),
        "--plot": getattr(args, "plot_path", None),
        "--markdown": getattr(args, "markdown_path", None),
        "--misprediction-log": getattr(args, "misprediction_log", None),
    }
    if args.command == "zoo":
        outputs["--baseline"] = args.baseline
    check_output_paths(outputs, inputs=inputs)


# ---- commands ---------------------------------------------------------------------------------


def _zoo_spec(args):
    from models import get_model

    try:
        return get_model(args.model, args.config, seed=args.seed)
    except ValueError as e:
        from ort_offload.errors import UnknownModelError

        raise UnknownModelError(str(e)) from e


def _seq_lengths(args) -> list[int] | None:
    """Per-step sequence lengths for ``--seq-range MIN:MAX`` (seeded; the first is MAX), else None."""
    if getattr(args, "seq_range", None) is None:
        return None
    from ort_offload.errors import InputMismatchError

    if args.seq is not None:
        raise InputMismatchError("--seq and --seq-range exclude each other: give one of them")
    low, sep, high = args.seq_range.partition(":")
    try:
        low, high = int(low), int(high)
    except ValueError:
        low = high = 0
    if not sep or not 1 <= low <= high:
        raise InputMismatchError(f"--seq-range {args.seq_range!r}: expected MIN:MAX with 1 <= MIN <= MAX, e.g. 16:256")
    rng = random.Random(args.seed)
    return [high] + [rng.randint(low, high) for _ in range(args.steps - 1)]


def _batch(spec, args, step: int, seq: int | None = None):
    try:
        return spec.make_batch(args.batch, seq if seq is not None else args.seq, seed=args.seed * 100003 + step)
    except ValueError as e:
        from ort_offload.errors import InputMismatchError

        raise InputMismatchError(str(e)) from e


def _profile_names() -> list[str]:
    from graph_passes.cost.device_profiles import profile_names

    return profile_names()


def _arena_policies() -> list[str]:
    from ort_offload.runtime.arena import ARENA_POLICIES

    return list(ARENA_POLICIES)


def _recompute_policies() -> list[str]:
    from ort_offload.runtime.offload_device import RECOMPUTE_POLICIES

    return list(RECOMPUTE_POLICIES)


def _device(args):
    import ort_offload

    return ort_offload.set_offload_device(
        args.device, budget=args.budget, max_block_nodes=args.block_nodes,
        arena_policy=getattr(args, "arena_policy", "best_fit"), planning_profile=getattr(args, "device_profile", None),
        recompute_policy=getattr(args, "recompute_policy", "input_aware"),
        plan_time=getattr(args, "plan_time", None), plan_evaluations=getattr(args, "plan_evaluations", None),
        plan_workers=getattr(args, "plan_workers", None),
    )


def _train(args) -> int:
    import ort_offload
    from ort_offload.distributed import init_from_environment

    ranks = init_from_environment()  # under torchrun: one data-parallel rank of the global --batch
    device = _device(args)
    if _is_dynamic_name(args.model):
        return _train_dynamic(args, device)
    spec = _zoo_spec(args)
    lengths = _seq_lengths(args) or [None] * args.steps
    inputs, targets = _batch(spec, args, 0, lengths[0])
    options = {"lr": args.lr} if args.lr is not None else {}
    if args.seq_range and any("seq" in axes.values() for axes in spec.dynamic_axes.values()):
        options["max_shapes"] = {"seq": max(lengths)}  # a fraction budget is of the longest batch's peak
    trainer = ort_offload.create_ort_trainer(
        device, spec.model, loss_fn=spec.loss_fn, example_inputs=inputs, example_targets=targets,
        input_names=spec.input_names, target_names=spec.target_names, dynamic_axes=spec.dynamic_axes,
        optimizer=args.optimizer, passes=args.passes, name=spec.name, cache_dir=args.cache_dir,
        stop_on_nonfinite=args.stop_on_nonfinite, shard_optimizer_state=args.shard_optimizer_state, **options,
    )
    batches = [_batch(spec, args, step, lengths[step]) for step in range(args.steps)]
    _run_steps(trainer, [tuple(i) + tuple(t) for i, t in batches], quiet=args.quiet)
    extra = {}
    if args.verify:
        extra["verify"] = _verify(spec, args, trainer, batches)
    code = _finish(trainer, args, extra)
    if ranks:
        import torch.distributed

        torch.distributed.destroy_process_group()
    return code


def _is_dynamic_name(name: str) -> bool:
    from models import list_dynamic_models

    return name in list_dynamic_models()


def _train_dynamic(args, device) -> int:
    """Train a dynamic zoo model block-wise under the device's budget."""
    from models import get_dynamic_model
    from ort_offload.dynamic.trainer import BlockwiseTrainer
    from ort_offload.errors import InputMismatchError, OffloadError, UnknownModelError
    from pilot.prediction import NoPredictor, OraclePredictor, WrongPredictor

    for flag, value in (("--plot", args.plot_path), ("--seq", args.seq), ("--seq-range", args.seq_range),
                        ("--block-nodes", args.block_nodes)):
        if value is not None:
            raise OffloadError(f"{flag} does not apply to dynamic models (trained block-wise); drop it")
    if args.passes not in ("auto", "none"):
        raise OffloadError("--passes does not apply to dynamic models: block-wise training offloads by prefetch; drop it")
    try:
        spec = get_dynamic_model(args.model, args.config, seed=args.seed)
    except ValueError as e:
        raise UnknownModelError(str(e)) from e
    if args.predictor in (None, "pilot"):
        from ort_offload.dynamic.pilot_support import make_pilot
        from pilot.paths import PathSpaceTooLargeError

        try:
            predictor = make_pilot(spec)
        except PathSpaceTooLargeError as e:
            if args.predictor == "pilot":
                raise OffloadError(f"the pilot cannot serve this model: {e}; use --predictor oracle or none") from e
            print(f"ort-offload: note: the pilot cannot serve this model ({e}); prefetching from the true path "
                  "(--predictor oracle) instead", file=sys.stderr)
            predictor = OraclePredictor()
    else:
        predictor = {"oracle": OraclePredictor, "none": NoPredictor, "wrong": WrongPredictor}[args.predictor]()
    trainer = BlockwiseTrainer(
        spec.model, spec.loss_fn, device=device, predictor=predictor, optimizer=args.optimizer,
        lr=args.lr if args.lr is not None else 1e-3, name=f"{spec.name}-{spec.config_name}",
        cache_dir=args.cache_dir, misprediction_log=args.misprediction_log, stop_on_nonfinite=args.stop_on_nonfinite,
    )
    try:
        batches = []
        for step in range(args.steps):
            try:
                inputs, targets = spec.make_batch(args.batch, seed=args.seed * 100003 + step)
            except ValueError as e:
                raise InputMismatchError(str(e)) from e
            batches.append((inputs, targets))
        _run_steps(trainer, [tuple(i) + tuple(t) for i, t in batches], quiet=args.quiet)
        extra = {}
        if args.verify:
            extra["verify"] = _verify_dynamic(args, trainer, batches)
        return _finish(trainer, args, extra)
    finally:
        trainer.close()


def _verify_dynamic(args, trainer, batches) -> dict:
    """Train a fresh copy of the dynamic model in plain torch on the same batches and compare."""
    import torch

    from models import get_dynamic_model

    reference = get_dynamic_model(args.model, args.config, seed=args.seed)
    lr = args.lr if args.lr is not None else 1e-3
    optimizer = {"adamw": torch.optim.AdamW, "sgd": torch.optim.SGD}[args.optimizer](reference.model.parameters(), lr=lr)
    losses = _train_in_torch(reference, optimizer, batches)
    return _compare_with_torch(trainer.losses, losses, trainer.flat_state(), reference.model)


def _train_in_torch(reference, optimizer, batches) -> list[float]:
    """Plain torch training of ``reference`` (a zoo spec) on ``batches``; the losses."""
    losses = []
    for inputs, targets in batches:
        loss = reference.loss_fn(reference.model(*inputs), *targets)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        losses.append(loss.item())
    return losses


def _compare_with_torch(our_losses, torch_losses, state, reference_model) -> dict:
    """Largest relative differences of losses and parameters against a plain torch run."""
    import numpy as np

    param_diff, worst = 0.0, None
    for name, tensor in reference_model.state_dict().items():
        if name in state and tensor.is_floating_point():
            ref = tensor.detach().numpy()
            scale = max(float(np.abs(ref).max()), 1e-12)
            diff = float(np.abs(state[name] - ref).max()) / scale
            if diff > param_diff:
                param_diff, worst = diff, name
    loss_diff = max(abs(a - b) / max(abs(b), 1e-12) for a, b in zip(our_losses, torch_losses))
    # Adam turns float noise in an exactly-zero gradient (e.g. an attention key bias) into
    # ±lr steps in both frameworks; the worst tensor's name makes such cases recognisable.
    return {"torch_losses": torch_losses, "max_loss_rel_diff": loss_diff, "max_param_rel_diff": param_diff,
            "max_param_rel_diff_tensor": worst}


def _verify(spec, args, trainer, batches) -> dict:
    """Train a fresh copy of the same model in plain torch on the same batches and compare."""
    from models import get_model

    reference = get_model(args.model, args.config, seed=args.seed)
    optimizer = trainer.optimizer_config.torch_optimizer(reference.model.parameters())
    reference.model.train()
    losses = _train_in_torch(reference, optimizer, batches)
    return _compare_with_torch(trainer.losses, losses, trainer.flat_state(), reference.model)


def _run_steps(trainer, batches, *, quiet: bool) -> None:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from ort_offload.export.progress import spinners_off

    if quiet or len(batches) < 2:
        for batch in batches:
            trainer.step(*batch)
        return
    columns = (TextColumn("[bold]training"), BarColumn(), MofNCompleteColumn(), TextColumn("loss {task.fields[loss]}"), TimeElapsedColumn())
    with spinners_off(), Progress(*columns, transient=True) as progress:
        task = progress.add_task("train", total=len(batches), loss="-")
        for batch in batches:
            loss = trainer.step(*batch)
            progress.update(task, advance=1, loss=f"{loss:.4f}")


def _finish(trainer, args, extra: dict) -> int:
    from rich.console import Console

    from ort_offload.distributed import is_writer
    from ort_offload.report import plot_timeline, render_table, write_json

    report = trainer.report()
    writer = is_writer()  # of several data-parallel ranks, rank 0 writes the files
    if report.get("nonfinite_steps"):
        print(f"ort-offload: warning: {report['nonfinite_steps']} of {report['steps']} "
              f"steps gave NaN or infinite values (first: step {trainer.nonfinite_steps[0]}; null in the JSON report): "
              "lower --lr or check the inputs; --stop-on-nonfinite stops at the first", file=sys.stderr)
    if getattr(args, "plot_path", None) and writer:
        plot_timeline(args.plot_path, baseline=trainer.runner.baseline_trace, planned=trainer.runner.last_trace,
                      budget_bytes=report["budget_bytes"], title=f"{report['model']}: device bytes over one step")
    if args.json_path and writer:
        write_json({**report, **extra}, args.json_path)
    if not args.quiet:
        flat = {}
        for key, value in extra.items():
            if isinstance(value, dict):
                flat.update({f"{key}.{k}": v for k, v in value.items() if not isinstance(v, list)})
        Console().print(render_table(report, flat))
    return 0


def _export(args) -> int:
    from ort_offload.export.training_step import export_training_step
    from ort_offload.files import sweep_stale_temps
    from ort_offload.export.optimizers import make_optimizer

    spec = _zoo_spec(args)
    inputs, targets = _batch(spec, args, 0)
    result = export_training_step(
        spec.model, example_inputs=inputs, example_targets=targets, loss_fn=spec.loss_fn,
        optimizer=make_optimizer(args.optimizer, lr=args.lr), input_names=spec.input_names,
        target_names=spec.target_names, dynamic_axes=spec.dynamic_axes, name=spec.name, cache_dir=args.cache_dir,
    )
    sweep_stale_temps(args.output)
    result.graph.save(args.output)
    print(f"wrote {args.output}: {len(result.graph.graph.node)} nodes, inputs {', '.join(result.graph.data_inputs)}"
          f" ({'cache hit' if result.cache_hit else f'exported in {result.export_time_s:.1f} s'})")
    return 0


def _load_graph(path, *, training_step: bool = True):
    return _load_graph_and_state(path, training_step=training_step)[0]


def _load_graph_and_state(path, *, training_step: bool = True):
    """The graph in ``path`` and its parameter values where the file comes with them (the
    checkpoint beside an ORT training artifact), else None. ``training_step``: refuse a graph
    that trains nothing (no state, no gradients: an inference or eval graph)."""
    from graph_passes.ir.training_graph import TrainingGraph
    from graph_passes.ir.validate import check_supported_ops, check_training_step, load_model
    from ort_offload.export.ort_artifacts import is_artifact_graph, load_training_artifact

    model = load_model(path)
    if is_artifact_graph(model):  # ORT's generate_artifacts: com.microsoft gradient ops
        return load_training_artifact(path, model=model)
    check_supported_ops(model)
    graph = TrainingGraph.from_model(model, name=Path(path).stem)
    if training_step:
        check_training_step(graph)
    return graph, None


def _transform(args) -> int:
    from ort_offload.files import sweep_stale_temps
    from ort_offload.export.graph_inputs import parse_input_shapes
    from ort_offload.report import plot_timeline, write_json
    from ort_offload.trainer import resolve_passes
    from ort_offload.transform import transform

    device = _device(argparse.Namespace(device=args.device, budget=args.budget, block_nodes=None,
                                        device_profile=args.device_profile, plan_time=args.plan_time,
                                        plan_evaluations=args.plan_evaluations,
                                        plan_workers=args.plan_workers))
    graph = _load_graph(args.graph)
    result = transform(graph, device, parse_input_shapes(args.input), tuple(resolve_passes(args.passes)))
    sweep_stale_temps(args.output)
    result.graph.save(args.output)
    if args.json_path:
        write_json(result.report, args.json_path)
    if args.plot_path:
        plot_timeline(args.plot_path, baseline=None, planned=result.plan.choice.trace,
                      budget_bytes=result.report["budget_bytes"], title=f"{graph.name}: planned device bytes")
    report = result.report
    print(f"wrote {args.output}: {report['nodes_before']} -> {report['nodes_after']} nodes, "
          f"peak {report['baseline_peak_bytes']} -> {report['planned_peak_bytes']} bytes "
          f"(budget {report['budget_bytes']}), passes {', '.join(report['passes']) or 'none'}, "
          f"{len(report['swaps'])} swaps")
    return 0


def _inspect(args) -> int:
    from ort_offload.export.graph_inputs import parse_input_shapes
    from ort_offload.report import to_json, write_json
    from ort_offload.transform import inspect_graph

    graph = _load_graph(args.graph, training_step=False)
    shapes = parse_input_shapes(args.input) if args.input else None
    summary = inspect_graph(graph, _device(argparse.Namespace(device="cpu", budget=None, block_nodes=None)), shapes)
    if args.json_path:
        write_json(summary, args.json_path)
    print(to_json(summary), end="")
    return 0


def _pilot_train(args) -> int:
    from ort_offload.errors import OffloadError

    from pilot import train as pilot_train

    out = Path(args.out)
    if not out.is_dir():
        raise OffloadError(f"--out {args.out}: not an existing directory")
    for name in ("samples", "test_samples", "steps", "hidden"):
        value = getattr(args, name)
        if value is not None and value < 1:
            raise OffloadError(f"--{name.replace('_', '-')} must be at least 1, got {value}")

    def families(text, default):
        if text is None:
            return default
        if text.strip().lower() == "none":
            return ()
        return tuple(f.strip() for f in text.split(",") if f.strip())

    holdout = families(args.holdout, pilot_train.DEFAULT_HOLDOUT)
    chosen = families(args.families, tuple(pilot_train.TRAIN_VARIANTS))
    known = set(pilot_train.TRAIN_VARIANTS)
    unknown = sorted((set(holdout) | set(chosen)) - known)
    if unknown:
        raise OffloadError(f"unknown families {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if not set(chosen) - set(holdout):
        raise OffloadError("every family is held out: nothing to train on")
    from ort_offload.dynamic.pilot_support import pilot_architecture

    options = {k: v for k, v in (("samples", args.samples), ("test_samples", args.test_samples),
                                 ("steps", args.steps), ("hidden", args.hidden)) if v is not None}
    result = pilot_train.train_pilot(pilot_architecture, holdout=holdout, families=chosen, seed=args.seed, **options)
    model_path, report_path = pilot_train.write_outputs(result, out)
    if not args.quiet:
        print(pilot_train.format_report(result.report))
    print(f"wrote {model_path} and {report_path}")
    return 0


def _zoo(args) -> int:
    from ort_offload import zoo
    from ort_offload.errors import OffloadError
    from ort_offload.report import atomic_write_text
    from ort_offload.trainer import resolve_passes

    budgets = _zoo_budgets(args)
    passes = resolve_passes(args.passes)
    if not passes:
        raise OffloadError("--passes none cannot meet a budget below the unplanned peak: use auto, swap or recompute")
    only = [m.strip() for m in args.models.split(",")] if args.models else None
    cases = zoo.zoo_cases(quick=args.quick, only=only)
    baseline_path = Path(args.baseline) if args.baseline else None
    baseline = zoo.load_baseline(baseline_path) if baseline_path else {}
    results = zoo.run_zoo(cases, budgets=budgets, steps=args.steps, passes=passes, progress=not args.quiet)
    table = zoo.render_markdown(results, budgets, baseline)
    print(table)
    if args.markdown_path:
        atomic_write_text(args.markdown_path, table + "\n")
    if args.json_path:
        zoo.write_results(args.json_path, results, budgets=budgets, steps=args.steps, passes=passes)
    found = zoo.regressions(results, baseline)
    if found:
        print(f"\n{len(found)} regression(s):", *(f"  {line}" for line in found), sep="\n", file=sys.stderr)
        return EXIT_REGRESSION
    if baseline_path and only is None and args.budgets is None:  # only a complete run becomes the baseline
        zoo.write_results(baseline_path, results, budgets=budgets, steps=args.steps, passes=passes)
        print(f"\nall {len(results)} models pass; baseline updated: {baseline_path}")
    else:
        print(f"\nall {len(results)} models pass")
    return 0


def _zoo_budgets(args) -> tuple[str, ...]:
    """The zoo's budget labels: fractions of the unplanned peak (``0.5x``) or ``min``."""
    from ort_offload import zoo
    from ort_offload.budget import parse_budget
    from ort_offload.errors import BudgetParseError, OffloadError

    if args.budgets is None:
        return zoo.QUICK_BUDGETS if args.quick else zoo.ZOO_BUDGETS
    budgets = tuple(b.strip() for b in args.budgets.split(","))
    for label in budgets:
        if label == "min":
            continue
        try:
            fraction = parse_budget(label).is_fraction
        except BudgetParseError:
            fraction = False
        if not fraction:
            raise OffloadError(f"--budgets {label!r}: use fractions of the unplanned peak such as 0.5x, or min")
    return budgets


def _run(args) -> int:
    from ort_offload.export.graph_inputs import parse_input_shapes, random_batch, random_state
    from ort_offload.trainer import OrtTrainer, resolve_passes

    device = _device(args)
    passes = resolve_passes(args.passes)
    graph, values = _load_graph_and_state(args.graph)
    shapes = parse_input_shapes(args.input)
    state = random_state(graph, seed=args.seed) if values is None else values
    batches = [random_batch(graph, shapes, seed=args.seed * 100003 + step) for step in range(args.steps)]
    trainer = OrtTrainer(
        device, graph, initial_state=state, example_batch=batches[0],
        input_names=graph.data_inputs, target_names=[], passes=passes, stop_on_nonfinite=args.stop_on_nonfinite,
    )
    _run_steps(trainer, [tuple(b[n] for n in graph.data_inputs) for b in batches], quiet=args.quiet)
    return _finish(trainer, args, {})


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
