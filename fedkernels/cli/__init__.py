"""The ``fedkernels`` command line: ``fedkernels run`` (one experiment, :mod:`.run`),
``fedkernels compare`` (several algorithms over several seeds, :mod:`.compare`), ``fedkernels
check`` (:mod:`.check`) and ``fedkernels aggregate`` (checkpoint files, :mod:`.aggregate_files`)."""

from __future__ import annotations

import importlib
import os
import signal
import sys
import threading

from .parsing import missing_extra, one_line

# command -> (one line of help, the module whose main takes the arguments after the command's
# name); a command's module is imported only when it is chosen, so that --help and --version
# answer without importing torch
COMMANDS: dict[str, tuple[str, str]] = {
    "run": ("run one federated experiment", "run"),
    "compare": ("table and plot finished runs, or sweep a configuration over seeds", "compare"),
    "check": ("check this installation: builds, every op against its reference, bandwidth",
              "check"),
    "aggregate": ("weighted sum of K checkpoint files (safetensors, sharded, .pt), streamed",
                  "aggregate_files"),
}
HELP_FLAGS = ("-h", "--help")


def version_line() -> str:
    """``fedkernels 0.1.0 (git 1a2b3c4d5e6f, modified)``: the version and, from a git checkout,
    the commit (``modified`` when tracked files differ from it)."""
    from fedkernels.sim.provenance import git_state, package_version

    git = git_state()
    where = ""
    if git["git_commit"]:
        where = f" (git {git['git_commit'][:12]}{', modified' if git['git_dirty'] else ''})"
    return f"fedkernels {package_version()}{where}"


def _usage() -> str:
    width = max(map(len, COMMANDS))
    lines = [f"  {name:<{width}}  {text}" for name, (text, _) in COMMANDS.items()]
    return (
        "usage: fedkernels COMMAND [OPTIONS]\n\ncommands:\n" + "\n".join(lines)
        + "\n\nfedkernels COMMAND --help shows the options of one command; fedkernels --version "
        "the version."
    )


def _run_command(command: str, rest: list[str]) -> int:
    """Runs a command; what its own checks did not foresee from the system (a folder it may
    not enter, a size that does not fit in memory) is still a one-line error, exit status 2."""
    if not any(flag in rest for flag in (*HELP_FLAGS, "--version")):
        import fedkernels

        fedkernels._ensure_loaded()  # a command that computes: the package as an import gives it
    try:
        module = importlib.import_module(f".{COMMANDS[command][1]}", __name__)
    except ModuleNotFoundError as err:  # jsonargparse, of the sim extra
        problem = missing_extra(err)
        if problem is None:
            raise
        print(f"fedkernels {command}: error: {problem}", file=sys.stderr)
        return 2
    try:
        return module.main(rest)
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
    if command in HELP_FLAGS:
        print(_usage())
        return 0
    if command == "--version":
        print(version_line())
        return 0
    problem = f"unknown command {command!r}" if command else "no command given"
    print(
        f"fedkernels: error: {problem} (commands: {', '.join(COMMANDS)}; see fedkernels --help)",
        file=sys.stderr,
    )
    return 2
