"""The suite's guards against a hang: the per-phase time limit (time_limit.py) and the runner
that kills a command's whole process tree (process_tree.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from process_tree import processes_naming, run_bounded

HERE = Path(__file__).resolve().parent


@pytest.mark.slow
def test_a_hung_test_fails_with_its_stack_and_the_next_one_runs(tmp_path):
    (tmp_path / "test_hang.py").write_text(textwrap.dedent("""
        import time

        def test_hangs():
            while True:
                time.sleep(0.1)

        def test_after():
            pass
    """))
    env = dict(os.environ, FEDKERNELS_TEST_TIME_LIMIT_S="2",
               PYTHONPATH=os.pathsep.join([str(HERE), os.environ.get("PYTHONPATH", "")]))
    started = time.monotonic()
    done = subprocess.run([sys.executable, "-m", "pytest", "-p", "time_limit",
                           "-p", "no:cacheprovider", "-q", "test_hang.py", "--rootdir", "."],
                          cwd=tmp_path, env=env, capture_output=True, text=True, timeout=120)
    assert done.returncode == 1, done.stdout + done.stderr
    assert "ran past the 2 s time limit" in done.stdout
    assert "1 failed, 1 passed" in done.stdout
    assert "test_hangs ran past 2 s; every thread's stack" in done.stdout
    assert 'line 6 in test_hangs' in done.stdout  # the stack names where it hung
    assert time.monotonic() - started < 60


@pytest.mark.slow
def test_run_bounded_kills_workers_in_their_own_sessions(tmp_path):
    # the launcher's worker starts a new session (as torchrun's and NVFlare's do) and keeps the
    # launcher's stdout: a pipe would never close, and killing the process group misses it
    marker = "fedkernels-time-limit-test-worker"
    script = textwrap.dedent(f"""
        import subprocess, sys, time
        subprocess.Popen([sys.executable, "-c", "import time; time.sleep(300)", "{marker}"],
                         start_new_session=True)
        print("started", flush=True)
        time.sleep(300)
    """)
    started = time.monotonic()
    status, output = run_bounded([sys.executable, "-c", script], tmp_path / "log", timeout=3)
    assert status is None
    assert "started" in output
    assert time.monotonic() - started < 30
    deadline = time.monotonic() + 10
    while processes_naming(marker) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert processes_naming(marker) == []


def test_run_bounded_returns_the_status_and_output(tmp_path):
    status, output = run_bounded([sys.executable, "-c", "print('hello'); raise SystemExit(3)"],
                                 tmp_path / "log", timeout=60)
    assert (status, output.strip()) == (3, "hello")
