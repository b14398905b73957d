"""Running the installed ``fedkernels`` console script in a child process, as a user does.

The child gets the test interpreter's folder on its PATH (no activated virtualenv needed), one
torch thread, and a bounded wait; a child that does not finish fails the test with its output.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

SCRIPT = Path(sys.executable).parent / "fedkernels"
TIMEOUT_S = 300

# a small, fast experiment: 3 clients, logistic regression, no progress bar or plots
FAST = [
    "--model.name", "logreg", "--partition.num_clients", "3", "--threads", "1",
    "--no-progress", "--no-plots",
]


def child_env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    env["OMP_NUM_THREADS"] = "1"
    # torch.cuda warns at import time when the deprecated pynvml package is installed; that
    # line is the environment's, not the command's
    env["PYTHONWARNINGS"] = "ignore::FutureWarning:torch.cuda"
    for key, value in extra.items():
        if key == "PYTHONPATH" and env.get(key):
            value += os.pathsep + env[key]
        env[key] = value
    return env


def fedkernels(
    *args: str, cwd: Path | None = None, timeout: float = TIMEOUT_S, **env: str
) -> subprocess.CompletedProcess:
    """``fedkernels ARGS...`` run to completion (``env``: extra environment variables)."""
    if not SCRIPT.is_file():
        pytest.fail(f"the console script {SCRIPT} is missing: install the package (pip install -e .)")
    try:
        return subprocess.run(
            [str(SCRIPT), *args],
            cwd=cwd,
            env=child_env(**env),
            capture_output=True,
            text=True,
            timeout=timeout,
        )
    except subprocess.TimeoutExpired as err:
        pytest.fail(
            f"fedkernels {' '.join(args)} did not finish in {timeout} s; output so far:\n"
            f"{err.stdout}\n{err.stderr}"
        )


def assert_one_line_error(done: subprocess.CompletedProcess, *fragments: str,
                          command: str = "run") -> str:
    """Exit status 2 and exactly one line on stderr, ``fedkernels COMMAND: error: ...``,
    holding every fragment. Returns that line."""
    assert done.returncode == 2, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1, done.stderr
    assert lines[0].startswith(f"fedkernels {command}: error: "), done.stderr
    for fragment in fragments:
        assert fragment in lines[0], (fragment, lines[0])
    return lines[0]


def assert_success(done: subprocess.CompletedProcess) -> None:
    assert done.returncode == 0, f"exit {done.returncode}\n{done.stdout}\n{done.stderr}"


def interrupt_when(args: list[str], ready: Path, settle_s: float = 0.0,
                   sig: int = signal.SIGINT) -> tuple[int, str]:
    """Starts ``fedkernels ARGS...``, presses Ctrl-C (SIGINT; or sends ``sig``) once ``ready``
    exists (and ``settle_s`` more seconds have passed); returns the exit status and stderr."""
    child = subprocess.Popen(
        [str(SCRIPT), *args], env=child_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True,
        # a child of a background job would inherit SIGINT ignored
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    try:
        deadline = time.monotonic() + TIMEOUT_S
        while not ready.exists():
            if child.poll() is not None:
                pytest.fail(f"fedkernels exited early ({child.returncode}):\n{child.communicate()}")
            if time.monotonic() > deadline:
                pytest.fail(f"{ready} did not appear in time")
            time.sleep(0.1)
        time.sleep(settle_s)
        child.send_signal(sig)
        _, err = child.communicate(timeout=TIMEOUT_S)
    finally:
        if child.poll() is None:
            child.kill()
            child.communicate()
    return child.returncode, err
