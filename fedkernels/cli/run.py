"""``fedkernels run``: one federated experiment.

Its flags map one to one onto :class:`fedkernels.sim.config.ExperimentConfig` (jsonargparse
derives them, :mod:`.flags`): top-level fields are ``--rounds``, ``--seed``, ...; section fields
are ``--section.field`` (``--partition.alpha 0.3``); the chosen algorithm's parameters are
``--<algorithm>.<field>`` (``--fedprox.mu 0.01``). ``--config FILE`` reads the same tree from
YAML or JSON first; flags override it; ``--print_config`` prints the tree they resolve to.
The output folder receives ``config.json``, ``checkpoint.pt`` (after every ``checkpoint_every``
rounds), ``results.json`` and two PNG plots; ``--resume`` continues from the
checkpoint there, and a folder that already holds a run is replaced only with ``--overwrite``.

``--algorithm`` also takes ``package.module:Class`` and the names of installed plugins (entry
point group ``fedkernels.algorithms``, see :mod:`fedkernels.algorithms.registry`). Because the
chosen algorithm's flags must exist before the command line is parsed, :func:`main` first looks
for the algorithm alone (flag, then ``--config`` file, then the saved run on ``--resume``).

Every error (flag, value, file) is one line, ``fedkernels run: error: ...``, and exit status 2.
A run holds an exclusive lock on its folder (``run.lock`` there) while it runs, so that a second
run into the same folder is refused instead of overwriting the first one's files.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import json
import os
import shlex
import shutil
import signal
import sys
import textwrap
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from fedkernels.sim.atomic_files import remove_leftovers, write_text
from fedkernels.sim.config import (
    ConfigError,
    ExperimentConfig,
    applicable_dict,
    from_dict,
    unread_settings,
)

from .algorithm_options import ENTRY_POINT_GROUP, known_names
from .algorithm_options import saved as saved_options
from .config_file import load_config_file
from .flags import Parser, add_algorithm_flags, add_config_flags, parse_layers, saved_class
from .parsing import (
    algorithm_name,
    check_writable,
    data_warnings,
    missing_extra,
    one_line,
    require_extra,
    set_threads,
)

CONFIG_NAME = "config.json"
CHECKPOINT_NAME = "checkpoint.pt"
RESULTS_NAME = "results.json"
METRICS_NAME = "metrics.csv"
TENSORBOARD_DIR = "tensorboard"  # --log tensorboard's event files
LOGGERS = ("tensorboard",)
CURVES_NAME = "curves.png"
CLIENTS_NAME = "client_accuracy.png"
LOCK_NAME = "run.lock"
# what a run writes into its folder (``--overwrite`` removes these and nothing else)
OUTPUT_NAMES = (
    CONFIG_NAME,
    CHECKPOINT_NAME,
    CHECKPOINT_NAME + ".partial",
    RESULTS_NAME,
    METRICS_NAME,
    CURVES_NAME,
    CLIENTS_NAME,
    # each figure's PDF beside its PNG
    str(Path(CURVES_NAME).with_suffix(".pdf")),
    str(Path(CLIENTS_NAME).with_suffix(".pdf")),
)
# files that mean a folder holds a run worth keeping
RUN_MARKERS = (RESULTS_NAME, CHECKPOINT_NAME)
DEFAULT_ALGORITHM = "fedavg"


def _epilog(chosen: str, names: list[str]) -> str:
    listed = textwrap.fill(", ".join(names), width=76, initial_indent="  ",
                           subsequent_indent="  ")
    return (
        f"Only the chosen algorithm's options ({chosen}) are listed; another's are shown by\n"
        "  fedkernels run --algorithm NAME --help\n"
        f"Algorithms:\n{listed}\n"
        "or your own Strategy subclass: --algorithm package.module:Class, or the name of an\n"
        f"installed plugin (entry point group '{ENTRY_POINT_GROUP}')."
    )


class _Version(argparse.Action):
    """``--version``: the line of ``fedkernels --version`` (git is asked only when given)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: Any) -> None:
        super().__init__(option_strings, dest, nargs=0, default=argparse.SUPPRESS,
                         help="print the version and exit")

    def __call__(self, parser, namespace, values, option_string=None) -> None:
        from . import version_line

        print(version_line())
        parser.exit()


def build_parser(algorithm: str = DEFAULT_ALGORITHM, help_only: bool = False) -> Parser:
    """The parser of ``fedkernels run`` with ``algorithm``'s options (a name or import path;
    ``parser.algorithm`` is its registered name). ``help_only``: a built-in algorithm's options
    come from their saved copy (:mod:`.algorithm_options`), so that the help needs neither the
    algorithms nor torch."""
    options = saved_options()
    if help_only and algorithm in options:
        config_class = saved_class(algorithm, options[algorithm])
        names = known_names()
    else:
        from fedkernels.algorithms.registry import available, strategy_class

        chosen_class = strategy_class(algorithm)
        algorithm, config_class = chosen_class.name, chosen_class.config_class
        names = known_names() if help_only else available()
    # a misspelled flag may be close to another algorithm's option
    others = [f"--{name}.{field[0]}" for name, fields in options.items() if name != algorithm
              for field in fields or []]
    parser = Parser(
        prog="fedkernels run",
        usage="%(prog)s [--config FILE] [--out DIR] [--resume | --overwrite] [--print_config] "
        "[--FIELD VALUE ...] [--SECTION.FIELD VALUE ...] [--ALGORITHM.FIELD VALUE ...]",
        description="Run a federated experiment; writes results.json, metrics.csv, plots and "
        "a resumable checkpoint into --out.",
        epilog=_epilog(algorithm, names),
        suggest=others,
    )
    parser.algorithm = algorithm
    parser.add_argument(
        "--config", metavar="FILE", help="YAML or JSON file with the configuration tree"
    )
    parser.add_argument(
        "--out", metavar="DIR",
        help="output folder (default: runs/ALGORITHM-DATA-seedSEED, -2, -3 if taken)",
    )
    parser.add_argument(
        "--resume", action="store_true", help="continue the run whose checkpoint is in --out"
    )
    parser.add_argument(
        "--overwrite",
        action="store_true",
        help="replace the run already in --out",
    )
    parser.add_argument(
        "--print_config", action="store_true",
        help="print the configuration as YAML (for --config) and exit",
    )
    parser.add_argument(
        "--threads", type=int, metavar="N", help="torch CPU threads (torch.set_num_threads)"
    )
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.add_argument("--no-plots", action="store_true", help="skip the plots")
    # choices are checked after the parse: jsonargparse checks the appended list against them
    parser.add_argument("--log", action="append", metavar="NAME",
                        help=f"log the rounds to tensorboard too (--out/{TENSORBOARD_DIR})")
    parser.add_argument("--smoke", action="store_true",
                        help="shrink the run to seconds (fedkernels.sim.smoke)")
    parser.add_argument("--version", action=_Version)
    add_config_flags(parser)
    action = parser.flag_action("--algorithm")
    action.metavar = "NAME"
    action.help = ("the algorithm: a name listed below, package.module:Class, or an installed "
                   f"plugin (default: {DEFAULT_ALGORITHM})")
    add_algorithm_flags(parser, algorithm, config_class)
    return parser


def refuse_other_algorithms_flags(argv: list[str], algorithm: str, running: str) -> None:
    """Refuses a flag of another algorithm than ``algorithm`` (as given: ``running``), which
    the run would not read, naming both."""
    for name, fields in saved_options().items():
        flags = {f"--{name}.{field[0]}" for field in fields or []}
        for token in argv:
            flag = token.split("=", 1)[0]
            if name != algorithm and flag in flags:
                raise ConfigError(f"{flag} is a parameter of {name}, but the algorithm is "
                                  f"{running}")


def resolve_config(tree: dict[str, Any], asked: dict[str, Any] | None = None,
                   unread: list[str] | None = None) -> ExperimentConfig:
    """The configuration ``tree`` (what the layers set, :func:`~.flags.parse_layers`) as one
    checked config. ``unread`` receives a sentence for each setting of ``asked`` (the file's
    and the flags') that the configuration leaves unread
    (:func:`~fedkernels.sim.config.unread_settings`)."""
    algorithm = tree.get("algorithm", DEFAULT_ALGORITHM)
    if not isinstance(algorithm, str):
        raise ConfigError(f"algorithm: expected a name, got {algorithm!r}")
    tree["algorithm"] = algorithm_name(algorithm)
    config = from_dict(ExperimentConfig, tree)
    if unread is not None and asked:
        unread += unread_settings(config, asked)
    if config.data.path is not None:
        # absolute, so that --resume from another working folder reads the same file; '~' as
        # the shell would expand it (a configuration file's path reaches us unexpanded)
        path = os.path.abspath(os.path.expanduser(config.data.path))
        data = dataclasses.replace(config.data, path=path)
        config = dataclasses.replace(config, data=data)
    return config


def check_file_algorithm(config_file: str, from_file: dict[str, Any], flag: str | None,
                         algorithm: str) -> None:
    """Two ways a configuration file's algorithm settings go astray, each named: parameters
    written as a section of their own, as the flags spell them (``fedprox: {mu: 0.01}``), and
    parameters of the file's algorithm that --algorithm (``flag``) replaced."""
    fields = {f.name for f in dataclasses.fields(ExperimentConfig)}
    for key in from_file:
        if key not in fields and key in known_names():
            raise ConfigError(f"{config_file}: unknown key {key}; an algorithm's parameters go "
                              f"under algorithm_params (algorithm: {key}, algorithm_params: "
                              "{FIELD: VALUE})")
    in_file, params = from_file.get("algorithm"), from_file.get("algorithm_params")
    if flag is not None and isinstance(in_file, str) and isinstance(params, dict) \
            and params and in_file.lower() not in (flag.lower(), algorithm.lower()):
        raise ConfigError(
            f"--algorithm {flag} replaces the algorithm of {config_file} ({in_file}), "
            f"whose algorithm_params ({', '.join(map(str, params))}) belong to it; remove them "
            f"from the file, or give {algorithm}'s own as --{algorithm}.FIELD")


@contextlib.contextmanager
def _locked(out: Path) -> Iterator[None]:
    """Holds an exclusive lock on the run folder ``out`` (the file ``run.lock``, removed when
    the run ends); refuses a folder another run holds."""
    path = out / LOCK_NAME
    busy = ConfigError(f"--out {out}: another run is using this folder (it holds {path}); wait "
                       "for it to end or choose another --out")
    try:
        handle = path.open("a")
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot write into it ({err.strerror or err})") from None
    with handle:
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy from None
        try:
            current = path.stat().st_ino
        except FileNotFoundError:
            current = None
        if current != os.fstat(handle.fileno()).st_ino:
            raise busy  # the run that just ended removed the file we locked
        try:
            yield
        finally:
            path.unlink(missing_ok=True)  # while locked: a later taker of this file sees it gone


def run_experiment(
    config: ExperimentConfig,
    out: Path,
    *,
    resume: bool = False,
    overwrite: bool = False,
    progress: bool = True,
    plots: bool = True,
    log: tuple[str, ...] | list[str] = (),
) -> dict[str, Any]:
    """Runs ``config`` with its algorithm, writing the outputs into ``out``; returns the
    ``results.json`` content. ``overwrite`` removes a previous run's files from ``out`` once
    the experiment has been set up (and so checked); ``log`` names further loggers of each
    round's metrics (``tensorboard``)."""
    from fedkernels.algorithms.registry import build_strategy
    from fedkernels.sim.run import Simulation

    strategy = build_strategy(config.algorithm, config.algorithm_params)
    simulation = Simulation(config, strategy, checkpoint=out / CHECKPOINT_NAME)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot create the folder: {err.strerror or err}") from None
    with _locked(out):
        return _run_locked(simulation, config, out, resume=resume, overwrite=overwrite,
                           progress=progress, plots=plots, log=tuple(log))


def _run_locked(simulation, config: ExperimentConfig, out: Path, *, resume: bool,
                overwrite: bool, progress: bool, plots: bool,
                log: tuple[str, ...]) -> dict[str, Any]:
    """:func:`run_experiment` once the folder is locked."""
    from fedkernels.algorithms.registry import is_import_path
    from fedkernels.sim.plots import plot_client_accuracy, plot_curves
    from fedkernels.sim.progress import round_progress
    from fedkernels.sim.round_logs import TensorBoardLog, write_metrics_csv

    if not resume and not overwrite:
        # Again under the lock: a run that ended since the first check left its results here.
        _refuse_finished_run(out)
    # Temporaries of writers killed mid-write (SIGKILL, a power cut): under the lock no other
    # run writes here, so they are leftovers whatever happens next.
    for name in (CONFIG_NAME, CHECKPOINT_NAME, RESULTS_NAME):
        remove_leftovers(out / name)
    if resume:
        simulation.load_checkpoint()
    if overwrite:
        for name in OUTPUT_NAMES:
            (out / name).unlink(missing_ok=True)
        # the replaced run's events would show as one curve with the new run's
        shutil.rmtree(out / TENSORBOARD_DIR, ignore_errors=True)
    saved = applicable_dict(simulation.config)  # the fields that apply, no others
    if is_import_path(config.algorithm):
        saved["algorithm"] = config.algorithm  # so that --resume can import it again
    write_text(out / CONFIG_NAME, json.dumps(saved, indent=2) + "\n")
    loggers = [TensorBoardLog(out / TENSORBOARD_DIR)] if "tensorboard" in log else []
    try:
        with round_progress(simulation, enabled=progress) as report:
            def on_round(record: dict[str, Any]) -> None:
                report(record)
                for logger in loggers:
                    logger(record)

            result = simulation.run(on_round=on_round)
    finally:
        for logger in loggers:
            logger.close()
    result.write_json(out / RESULTS_NAME)
    write_metrics_csv(result.rounds, out / METRICS_NAME)
    if plots:
        plot_curves(result, out / CURVES_NAME)
        plot_client_accuracy(result, out / CLIENTS_NAME)
    return result.to_dict()


def resolved_tree(config: ExperimentConfig) -> dict[str, Any]:
    """``config`` as config.json will hold it: the fields that apply, the algorithm under its
    registered name (an import path as given) with all its parameters, checked."""
    from fedkernels.algorithms.registry import build_strategy, is_import_path

    strategy = build_strategy(config.algorithm, config.algorithm_params)
    params = getattr(strategy, "config", None)
    config = dataclasses.replace(
        config, algorithm=config.algorithm if is_import_path(config.algorithm) else strategy.name,
        algorithm_params=dataclasses.asdict(params) if params is not None else {})
    return applicable_dict(config)


def _config_text(config: ExperimentConfig) -> str:
    """``--print_config``: :func:`resolved_tree` in YAML, or JSON without PyYAML; either reads
    back with --config."""
    tree = resolved_tree(config)
    try:
        import yaml
    except ImportError:
        return json.dumps(tree, indent=2) + "\n"
    return yaml.safe_dump(tree, sort_keys=False, default_flow_style=None, width=100)


def _default_out(config: ExperimentConfig) -> Path:
    """``runs/<algorithm>-<data>-seed<seed>``: where a run without --out goes, unless taken."""
    from fedkernels.algorithms.registry import strategy_class

    name = strategy_class(config.algorithm).name
    return Path("runs") / f"{name}-{config.data.name}-seed{config.seed}"


def _claim_default_out(base: Path) -> Path:
    """The first of ``base``, ``base-2``, ``base-3``, ... that does not exist, created now:
    a second run of the same configuration gets its own folder instead of being refused (and
    two started at once cannot both take one, mkdir being atomic)."""
    for count in range(1, 100_000):
        out = base if count == 1 else base.with_name(f"{base.name}-{count}")
        try:
            out.mkdir(parents=True)
        except FileExistsError:
            continue
        except OSError as err:
            raise ConfigError(f"--out {out}: cannot create the folder: "
                              f"{err.strerror or err}") from None
        return out
    raise ConfigError(f"{base}: every numbered folder up to -99999 is taken; give --out")



class _Prescan(argparse.ArgumentParser):
    def error(self, message: str):  # type: ignore[override]
        raise ConfigError(message)


def _prescan(argv: list[str]) -> argparse.Namespace:
    """``--algorithm``, ``--config``, ``--out`` and ``--resume``, read before the parse whose
    flags depend on the algorithm; a malformed command line is left for that parse to report
    (jsonargparse parses no command line partly, so this is plain argparse)."""
    pre = _Prescan(add_help=False, allow_abbrev=False)
    for flag in ("--algorithm", "--config", "--out"):
        pre.add_argument(flag)
    pre.add_argument("--resume", action="store_true")
    try:
        return pre.parse_known_args(argv)[0]
    except ConfigError:
        return argparse.Namespace(algorithm=None, config=None, out=None, resume=False)


def _chosen_algorithm(pre: argparse.Namespace, file_tree: dict[str, Any] | None,
                      saved: dict[str, Any] | None, help_only: bool = False) -> str:
    """The algorithm the command line asks for: ``--algorithm``, else the ``--config`` file's,
    else the resumed run's. ``help_only``: matched against the saved names, without importing
    the algorithms."""
    names = known_names() if help_only else None
    for source in (pre.algorithm, (file_tree or {}).get("algorithm"),
                   (saved or {}).get("algorithm")):
        if isinstance(source, str):
            return algorithm_name(source, names)
    return DEFAULT_ALGORITHM


def _saved_config(out: Path) -> dict[str, Any]:
    """The configuration tree of the run in ``out`` (for ``--resume``), checked."""
    path = out / CONFIG_NAME
    if not path.is_file():
        raise ConfigError(f"cannot resume: no {CONFIG_NAME} in {out}")
    try:
        tree = json.loads(path.read_text())
    except (OSError, ValueError) as err:  # ValueError: bad JSON or bad UTF-8
        raise ConfigError(f"cannot resume: {path} is empty or damaged ({one_line(err)})") from None
    if not isinstance(tree, dict):
        raise ConfigError(f"cannot resume: {path} does not hold a configuration mapping")
    try:
        from_dict(ExperimentConfig, tree)
    except ConfigError as err:
        raise ConfigError(f"cannot resume: {path}: {err}") from None
    return tree


def _check_saved_data_file(config: ExperimentConfig, saved: dict[str, Any]) -> None:
    """On ``--resume``, a CSV file that is no longer where the run read it is named with the
    way out: its new place, given with --data.path, is accepted when the file is the same."""
    path = config.data.path
    if config.data.name != "csv" or path is None or os.path.exists(path):
        return
    if path == (saved.get("data") or {}).get("path"):
        raise ConfigError(
            f"cannot resume: the run's data file {path} is gone; if it was moved, give its new "
            "place with --data.path (the file must be the same: its size and SHA-256 are "
            "checked against the checkpoint's)")


def _check_out(out: Path, *, resume: bool, overwrite: bool) -> None:
    """Refuses an output folder that cannot be one, or that holds a run to keep."""
    if resume and overwrite:
        raise ConfigError("--resume continues the run in --out and --overwrite replaces it: "
                          "give one of them")
    for path in (out, *out.parents):
        if path.exists() and not path.is_dir():
            what = "" if path == out else f": {path}"
            raise ConfigError(f"--out {out}{what} exists and is not a folder")
    if resume or overwrite or not out.is_dir():
        return
    _refuse_finished_run(out)


def _refuse_finished_run(out: Path) -> None:
    """Refuses a folder that holds a run (results or a checkpoint) to keep, or a config.json
    that no run wrote (the run would write its own over it)."""
    found = [name for name in RUN_MARKERS if (out / name).exists()]
    if found:
        raise ConfigError(
            f"--out {out} already holds a run ({', '.join(found)}): add --resume to continue "
            "it or --overwrite to replace it"
        )
    if (out / CONFIG_NAME).exists() and not _written_by_a_run(out / CONFIG_NAME):
        raise ConfigError(
            f"--out {out} holds a {CONFIG_NAME} that is not a run's (a run writes its complete "
            "configuration there, over the file): choose another --out, rename the file, or "
            "add --overwrite to replace it"
        )


def _written_by_a_run(path: Path) -> bool:
    """Whether ``path`` is a config.json as a run writes it: every field of the configuration
    and no other key (a hand-written configuration, as ``--config config.json --out .`` would
    use, names a few)."""
    try:
        tree = json.loads(path.read_text())
    except (OSError, ValueError):
        return False
    fields = {f.name for f in dataclasses.fields(ExperimentConfig)}
    # runs from before the attack and dp sections existed wrote all the others
    return isinstance(tree, dict) and fields - {"attack", "dp"} <= set(tree) <= fields


def _check_extras(config: ExperimentConfig, *, progress: bool, plots: bool,
                  log: list[str] | tuple[str, ...] = ()) -> None:
    """The optional packages this run will import, checked before anything is written."""
    if "tensorboard" in log:
        from fedkernels.sim.round_logs import require_tensorboard

        require_tensorboard()
    if progress:
        require_extra("tqdm", "the progress bar", "--no-progress")
    if plots:
        require_extra("matplotlib", "plotting", "--no-plots")
    if config.data.name == "digits":
        require_extra("sklearn", "the digits data set")
    if config.data.name in ("csv", "heart"):  # tables are read with pandas and scikit-learn
        for module in ("pandas", "sklearn"):
            require_extra(module, f"data.name={config.data.name}")


def _continue_command(out: Path, args: argparse.Namespace) -> str:
    command = ["fedkernels", "run", "--resume", "--out", str(out)]
    if args.threads is not None:
        command += ["--threads", str(args.threads)]
    command += ["--no-progress"] * args.no_progress + ["--no-plots"] * args.no_plots
    for name in args.log:
        command += ["--log", name]
    return shlex.join(command)


class Terminated(KeyboardInterrupt):
    """SIGTERM (a job scheduler, ``timeout``, ``kill``), stopping a run as Ctrl-C does."""


@contextlib.contextmanager
def _sigterm_stops_like_ctrl_c() -> Iterator[None]:
    """While the block runs, SIGTERM raises :class:`Terminated`: the run then ends as after
    Ctrl-C (the file being written is dropped, the folder unlocked, the command that continues
    the run printed) instead of dying mid-write and leaving a temporary file behind."""
    if threading.current_thread() is not threading.main_thread():
        yield  # signal handlers can only be set from the main thread
        return

    def stop(signum, frame) -> None:
        raise Terminated

    previous = signal.signal(signal.SIGTERM, stop)
    try:
        yield
    finally:
        # None: a handler set outside Python, which cannot be put back; the default it is
        signal.signal(signal.SIGTERM, signal.SIG_DFL if previous is None else previous)


def _error(message: object) -> int:
    print(f"fedkernels run: error: {one_line(message)}", file=sys.stderr)
    return 2


def main(argv: list[str] | None = None) -> int:
    """``fedkernels run ...`` (``argv`` holds what follows the word ``run``)."""
    argv = sys.argv[2:] if argv is None else list(argv)
    with _sigterm_stops_like_ctrl_c():
        return _main(argv)


def _main(argv: list[str]) -> int:
    args: Any = None
    out: Path | None = None
    try:
        # the help and the version need neither the algorithms nor torch: they answer at once
        help_only = any(flag in argv for flag in ("-h", "--help", "--version"))
        pre = _prescan(argv)
        file_tree = saved = None
        if pre.config:
            try:
                file_tree = load_config_file(pre.config)
            except ConfigError:
                if not help_only:  # the help does not depend on the file
                    raise
        if pre.resume and not help_only:
            if not pre.out:
                raise ConfigError("--resume needs --out, the folder of the run to continue")
            saved = _saved_config(Path(pre.out))
        algorithm = _chosen_algorithm(pre, file_tree, saved, help_only)
        parser = build_parser(algorithm, help_only=help_only)
        refuse_other_algorithms_flags(argv, parser.algorithm, algorithm)
        if file_tree is not None and not help_only:
            check_file_algorithm(pre.config, file_tree, pre.algorithm, parser.algorithm)
        try:
            args, tree, asked = parse_layers(
                parser, argv, file_tree=None if help_only else file_tree, saved_tree=saved,
                algorithm=parser.algorithm)
        except SystemExit as done:  # --help, --version
            return done.code if isinstance(done.code, int) else 0
        args.log = args.log or []
        for name in args.log:
            if name not in LOGGERS:
                raise ConfigError(f"--log {name}: not a logger (choose from {', '.join(LOGGERS)})")
        if args.threads is not None:
            set_threads(args.threads)
        unread: list[str] = []
        config = resolve_config(tree, asked, unread)
        for sentence in unread:
            print(f"fedkernels run: warning: {sentence}", file=sys.stderr)
        if saved is not None:
            _check_saved_data_file(config, saved)
        if args.print_config:
            print(_config_text(config), end="")
            return 0
        out = Path(args.out) if args.out else _default_out(config)
        if args.smoke and not args.out:
            out = out.with_name(out.name + "-smoke")  # never a full run's folder
        _check_out(out, resume=args.resume, overwrite=args.overwrite or not args.out)
        check_writable(out)
        _check_extras(config, progress=not args.no_progress, plots=not args.no_plots,
                      log=args.log)
        if not args.out and not args.overwrite:  # --overwrite alone replaces the default one
            out = _claim_default_out(out)
        if args.smoke:  # imported here: the data sets' writers cost every other run's start
            from fedkernels.algorithms.registry import strategy_class
            from fedkernels.sim.smoke import DATA_FOLDER, smoke_config

            config = smoke_config(config, out / DATA_FOLDER,
                                  strategy_class(config.algorithm).config_class)
        with data_warnings("fedkernels run"):
            results = run_experiment(
                config,
                out,
                resume=args.resume,
                overwrite=args.overwrite,
                progress=not args.no_progress,
                plots=not args.no_plots,
                log=args.log,
            )
    except ConfigError as err:
        return _error(err)
    except ModuleNotFoundError as err:
        message = missing_extra(err)
        if message is None:
            raise
        return _error(message)
    except KeyboardInterrupt as stop:
        what = "terminated" if isinstance(stop, Terminated) else "interrupted"
        if args is not None and out is not None and (out / CHECKPOINT_NAME).is_file():
            print(f"\n{what}; continue with: {_continue_command(out, args)}", file=sys.stderr)
        else:
            print(f"\n{what} before the first checkpoint; nothing to resume", file=sys.stderr)
        # the shell's status for a command killed by the signal
        return 128 + (signal.SIGTERM if isinstance(stop, Terminated) else signal.SIGINT)
    summary = results["summary"]
    print(
        f"test accuracy {summary['test_accuracy']:.4f}, client accuracy mean "
        f"{summary['client_accuracy_mean']:.4f} worst-10% {summary['client_accuracy_worst10']:.4f} "
        f"-> {out / RESULTS_NAME}"
    )
    if "personalized_accuracy" in summary:
        # what a personalized method is judged by; the test accuracy line is its global model's
        # (which e.g. 'local' never trains)
        worst = summary.get("personalized_accuracy_worst10")
        print(f"personalized accuracy (each client's own model) mean "
              f"{summary['personalized_accuracy']:.4f}"
              + ("" if worst is None else f" worst-10% {worst:.4f}"))
    if summary.get("client_auroc_mean") is not None:
        # over the clients whose test split holds two classes: the count says how many
        print(f"client AUROC mean {summary['client_auroc_mean']:.4f} worst "
              f"{summary['client_auroc_min']:.4f} over {summary['client_auroc_clients']} of "
              f"{len(results['clients'])} clients")
    if not any(r["participants"] for r in results["rounds"]):
        print("fedkernels run: warning: no round had a client to train, so the global model is "
              "the initial one (participants in results.json's rounds); raise "
              "participation.fraction or rounds", file=sys.stderr)
    if summary.get("diverged"):
        print("fedkernels run: warning: the training diverged: the global model holds NaN or "
              "infinite values or gives an infinite test loss, so its accuracies are not those "
              "of a trained model (summary.diverged in results.json); lower client.lr or the "
              "algorithm's step sizes", file=sys.stderr)
    elif summary.get("non_finite"):
        print("fedkernels run: warning: NaN or infinite results: "
              f"{', '.join(summary['non_finite'])} (summary.non_finite in results.json)",
              file=sys.stderr)
    if summary.get("vmap_rounds") == 0 and any(r["participants"] for r in results["rounds"]):
        print(f"fedkernels run: note: --vmap was not used: {results['config']['algorithm']} "
              "trains its clients itself (summary.vmap_rounds = 0)", file=sys.stderr)
    for caveat in summary.get("caveats", []):
        print(f"fedkernels run: warning: {caveat} (summary.caveats in results.json)",
              file=sys.stderr)
    skipped = [r for r in results["rounds"] if "skipped" in r]
    if skipped:
        print(f"fedkernels run: warning: {len(skipped)} of {len(results['rounds'])} rounds were "
              f"skipped, the global model unchanged ({skipped[0]['skipped']}, round "
              f"{skipped[0]['round']}; 'skipped' in results.json's rounds)", file=sys.stderr)
    return 0
