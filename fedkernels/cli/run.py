"""The ``fedkernels`` command line.

``fedkernels run`` runs one federated experiment. Its flags map one to one onto
:class:`fedkernels.sim.config.ExperimentConfig`: top-level fields are ``--rounds``,
``--seed``, ...; section fields are ``--section.field`` (``--partition.alpha 0.3``); the chosen
algorithm's parameters are ``--<algorithm>.<field>`` (``--fedprox.mu 0.01``). ``--config FILE``
reads the same tree from YAML or JSON first; flags override it. The output folder receives
``config.json``, ``checkpoint.pt`` (after every ``checkpoint_every`` rounds), ``results.json``
and two PNG plots; ``--resume`` continues from the checkpoint there.

Invalid flags or configurations print a one-line error and exit with status 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from pathlib import Path
from typing import Any, Literal, get_args, get_origin

from fedkernels.algorithms import available, build_strategy, strategy_class
from fedkernels.sim.config import SECTIONS, ConfigError, ExperimentConfig, field_types, from_dict, set_dotted

from .config_file import load_config_file

CONFIG_NAME = "config.json"
CHECKPOINT_NAME = "checkpoint.pt"
RESULTS_NAME = "results.json"
CURVES_NAME = "curves.png"
CLIENTS_NAME = "client_accuracy.png"


def _add_field(
    group: argparse._ArgumentGroup,
    flag: str,
    f: dataclasses.Field,
    tp: Any,
    metavar: str | None = None,
) -> None:
    """One ``--flag VALUE`` for a config field; values stay strings until :func:`from_dict`."""
    help_text = f.metadata.get("help", "")
    default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
    options: dict[str, Any] = {"dest": flag, "default": argparse.SUPPRESS}
    inner = [a for a in get_args(tp) if a is not type(None)] or [tp]
    if metavar is not None:
        options["metavar"] = metavar
    elif get_origin(tp) is Literal:
        options["metavar"] = "{" + ",".join(map(str, get_args(tp))) + "}"
    elif tp is bool:
        options.update(nargs="?", const="true", metavar="BOOL")
    elif get_origin(tp) is list or get_origin(inner[0]) is list:
        options["metavar"] = "A,B,..."
    else:
        options["metavar"] = getattr(inner[0], "__name__", "VALUE").upper()
    group.add_argument(f"--{flag}", help=f"{help_text} (default: {default})", **options)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedkernels", description="fedkernels: fused federated-learning ops and simulations"
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    run = commands.add_parser(
        "run",
        help="run a federated experiment",
        usage="%(prog)s [--config FILE] [--out DIR] [--resume] [--FIELD VALUE ...] "
        "[--SECTION.FIELD VALUE ...]",
        description="Run a federated experiment; writes results.json, plots and a resumable "
        "checkpoint into --out.",
    )
    run.add_argument(
        "--config", metavar="FILE", help="YAML or JSON file with the configuration tree"
    )
    run.add_argument(
        "--out", metavar="DIR", help="output folder (default: runs/<algorithm>-<data>-seed<seed>)"
    )
    run.add_argument("--resume", action="store_true", help="continue from the checkpoint in --out")
    run.add_argument(
        "--threads", type=int, metavar="N", help="torch CPU threads (torch.set_num_threads)"
    )
    run.add_argument("--no-progress", action="store_true", help="no progress bar")
    run.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    commands.add_parser(
        "compare", help="run several algorithms over several seeds (see fedkernels compare -h)"
    )

    top = run.add_argument_group("experiment")
    types = field_types(ExperimentConfig)
    for f in dataclasses.fields(ExperimentConfig):
        if f.name in SECTIONS or f.name == "algorithm_params":
            continue
        choices = "{" + ",".join(available()) + "}" if f.name == "algorithm" else None
        _add_field(top, f.name, f, types[f.name], choices)
    for section in SECTIONS:
        cls = types[section]
        group = run.add_argument_group(section)
        section_types = field_types(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, f"{section}.{f.name}", f, section_types[f.name])
    for name in available():
        cls = strategy_class(name).config_class
        if cls is None:
            continue
        group = run.add_argument_group(f"algorithm {name}")
        algorithm_types = field_types(cls)
        for f in dataclasses.fields(cls):
            _add_field(group, f"{name}.{f.name}", f, algorithm_types[f.name])
    return parser


# argparse destinations that are options of the command, not configuration fields
_RUN_OPTIONS = {"command", "config", "out", "resume", "threads", "no_progress", "no_plots"}


def resolve_config(
    args: argparse.Namespace, base: dict[str, Any] | None = None
) -> ExperimentConfig:
    """``base`` (a saved config), then ``--config``, then the flags, as one checked config."""
    tree: dict[str, Any] = json.loads(json.dumps(base)) if base else {}
    if args.config:
        for key, value in load_config_file(args.config).items():
            tree[key] = value
    given = {k: v for k, v in vars(args).items() if k not in _RUN_OPTIONS}
    for flag, value in given.items():
        head = flag.split(".", 1)[0]
        if "." in flag and head not in SECTIONS:
            continue  # algorithm parameters, below
        set_dotted(tree, flag, value)
    algorithm = tree.get("algorithm", "fedavg")
    for flag, value in given.items():
        head, _, param = flag.partition(".")
        if param and head not in SECTIONS:
            if head != algorithm:
                raise ConfigError(
                    f"--{flag} is a parameter of {head}, but the algorithm is {algorithm}"
                )
            tree.setdefault("algorithm_params", {})[param] = value
    return from_dict(ExperimentConfig, tree)


def run_experiment(
    config: ExperimentConfig,
    out: Path,
    *,
    resume: bool = False,
    progress: bool = True,
    plots: bool = True,
) -> dict[str, Any]:
    """Runs ``config`` with its registered algorithm, writing the outputs into ``out``;
    returns the ``results.json`` content."""
    from fedkernels.sim.plots import plot_client_accuracy, plot_curves
    from fedkernels.sim.run import Simulation

    strategy = build_strategy(config.algorithm, config.algorithm_params)
    simulation = Simulation(config, strategy, checkpoint=out / CHECKPOINT_NAME)
    if resume:
        simulation.load_checkpoint()
    out.mkdir(parents=True, exist_ok=True)
    (out / CONFIG_NAME).write_text(json.dumps(simulation.config.to_dict(), indent=2) + "\n")
    bar = None
    if progress:
        from tqdm import tqdm

        bar = tqdm(
            total=config.rounds, initial=simulation.next_round, unit="round", file=sys.stderr
        )

    def report(record: dict[str, Any]) -> None:
        if bar is not None:
            if "test_accuracy" in record:
                bar.set_postfix(acc=f"{record['test_accuracy']:.3f}")
            bar.update(1)

    try:
        result = simulation.run(on_round=report)
    finally:
        if bar is not None:
            bar.close()
    result.write_json(out / RESULTS_NAME)
    if plots:
        plot_curves(result, out / CURVES_NAME)
        plot_client_accuracy(result, out / CLIENTS_NAME)
    return result.to_dict()


def _default_out(config: ExperimentConfig) -> Path:
    return Path("runs") / f"{config.algorithm}-{config.data.name}-seed{config.seed}"


def main(argv: list[str] | None = None) -> int:
    """``fedkernels run ...`` (``argv`` includes the word ``run``)."""
    argv = sys.argv[1:] if argv is None else argv
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.threads is not None:
            if args.threads < 1:
                raise ConfigError("--threads must be >= 1")
            import torch

            torch.set_num_threads(args.threads)
        saved = None
        if args.resume:
            if not args.out:
                raise ConfigError("--resume needs --out, the folder of the run to continue")
            saved_path = Path(args.out) / CONFIG_NAME
            if not saved_path.is_file():
                raise ConfigError(f"cannot resume: no {CONFIG_NAME} in {args.out}")
            saved = json.loads(saved_path.read_text())
        config = resolve_config(args, saved)
        out = Path(args.out) if args.out else _default_out(config)
        results = run_experiment(
            config, out, resume=args.resume, progress=not args.no_progress, plots=not args.no_plots
        )
    except ConfigError as err:
        print(f"fedkernels run: error: {err}\n(see fedkernels run --help)", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("\ninterrupted; continue with --resume --out <folder>", file=sys.stderr)
        return 130
    summary = results["summary"]
    print(
        f"test accuracy {summary['test_accuracy']:.4f}, client accuracy mean "
        f"{summary['client_accuracy_mean']:.4f} worst-10% {summary['client_accuracy_worst10']:.4f} "
        f"-> {out / RESULTS_NAME}"
    )
    return 0

