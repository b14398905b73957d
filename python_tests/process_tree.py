"""Child processes that cannot outlive their test.

Launchers such as ``torchrun`` and NVIDIA FLARE's simulator start their workers in new sessions
(``start_new_session`` / ``setsid``), so killing the launcher's process group misses them, and a
worker that still holds the launcher's stdout pipe makes ``communicate()`` wait forever. Here the
output goes to a file, and on timeout every descendant found through /proc is killed.
"""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def parents() -> dict[int, int]:
    """{pid: parent pid} of every process visible in /proc."""
    table = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                # the field after the parenthesised name: state, then the parent's pid
                stat = (entry / "stat").read_text()
                table[int(entry.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, ValueError, IndexError):
                continue
    return table


def with_descendants(pids: list[int]) -> list[int]:
    """``pids`` and all their descendants, parents before children."""
    table = parents()
    result, frontier = list(pids), set(pids)
    while frontier:
        children = [p for p, parent in table.items() if parent in frontier and p not in result]
        result += children
        frontier = set(children)
    return result


def processes_naming(text: str) -> list[int]:
    """The pids whose command line contains ``text``."""
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if text in (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode():
                    found.append(int(entry.name))
            except OSError:
                continue
    return found


def kill_tree(pids: list[int]) -> None:
    """SIGKILL to ``pids`` and their descendants, children first (none is re-parented away
    before it is found)."""
    for pid in reversed(with_descendants(pids)):
        try:
            os.kill(pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass


def run_bounded(args: list[str], log: Path, timeout: float, **popen) -> tuple[int | None, str]:
    """Runs ``args`` with stdout and stderr into the file ``log``; returns (exit status, output).
    The status is None when the command outlived ``timeout`` seconds: then it and every process
    it started were killed. Anything that interrupts the wait (a test's time limit) also kills
    them."""
    with open(log, "wb") as sink:
        process = subprocess.Popen(args, stdout=sink, stderr=subprocess.STDOUT,
                                   stdin=subprocess.DEVNULL, start_new_session=True, **popen)
    status: int | None = None
    try:
        status = process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        pass
    finally:
        if status is None:
            kill_tree([process.pid])
            process.wait()
    return status, log.read_text(errors="replace")
