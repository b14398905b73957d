"""The ``fedkernels`` command line: ``fedkernels run`` (one experiment, :mod:`.run`),
``fedkernels compare`` (several algorithms over several seeds, :mod:`.compare`), ``fedkernels
check`` (:mod:`.check`) and ``fedkernels aggregate`` (checkpoint files, :mod:`.aggregate_files`)."""

from __future__ import annotations

import os
import signal
import sys
import threading
from collections.abc import Callable

from . import aggregate_files, check, compare, run
from .parsing import one_line

# command -> (one line of help, its main taking the arguments after the command's name)
COMMANDS: dict[str, tuple[str, Callable[[list[str]], int]]] = {
    "run": ("run one federated experiment", run.main),
    "compare": ("run several algorithms over several seeds: one table, one plot", compare.main),
    "check": ("check this installation: builds, every op against its reference, bandwidth", check.main),
    "aggregate": ("weighted sum of K checkpoint files (safetensors, sharded, .pt), streamed",
                  aggregate_files.main),
}


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (text, _) in COMMANDS.items()]
    return (
        "usage: fedkernels COMMAND [OPTIONS]\n\ncommands:\n" + "\n".join(lines)
        + "\n\nfedkernels COMMAND --help shows the options of one command."
    )


def _run_command(command: str, rest: list[str]) -> int:
    """Runs a command; what its own checks did not foresee from the system (a folder it may
    not enter, a size that does not fit in memory) is still a one-line error, exit status 2."""
    try:
        return COMMANDS[command][1](rest)
    except MemoryError as err:  # NumPy's allocation errors too
        problem = f"not enough memory ({one_line(err)}); is a size in the configuration too large?"
    except OSError as err:
        problem = (f"{err.filename}: {err.strerror}" if err.filename and err.strerror
                   else one_line(err))
    except RuntimeError as err:  # torch's allocator
        if "can't allocate memory" not in str(err):
            raise
        problem = (f"not enough memory ({one_line(str(err).split(' (')[0])}); is a size in the "
                   "configuration too large?")
    print(f"fedkernels {command}: error: {problem}", file=sys.stderr)
    return 2


def _exit_at_the_next_ctrl_c(code: int) -> None:
    """After the command has returned, a further Ctrl-C (a second quick one, say) lands in the
    interpreter's exit handlers (torch's, weakref finalizers) and printed their traceback: the
    process now just ends there, with the command's status."""
    if threading.current_thread() is not threading.main_thread():
        return

    def leave(signum, frame) -> None:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except (OSError, ValueError):
                pass
        os._exit(code)

    signal.signal(signal.SIGINT, leave)


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedkernels`` script (``argv``: None to read ``sys.argv``, as the
    script does; a list when called from Python, which leaves signal handling alone)."""
    if argv is not None:
        return _dispatch(list(argv))
    try:
        code = _dispatch(sys.argv[1:])
    except KeyboardInterrupt:  # a second Ctrl-C while the first one's report was printed
        print("\ninterrupted", file=sys.stderr)
        code = 128 + signal.SIGINT
    _exit_at_the_next_ctrl_c(code)
    return code


def _dispatch(argv: list[str]) -> int:
    command, rest = (argv[0], argv[1:]) if argv else ("", [])
    if command in COMMANDS:
        return _run_command(command, rest)
    if command in ("-h", "--help"):
        print(_usage())
        return 0
    problem = f"unknown command {command!r}" if command else "no command given"
    print(
        f"fedkernels: error: {problem} (commands: {', '.join(COMMANDS)}; see fedkernels --help)",
        file=sys.stderr,
    )
    return 2
