"""A time limit on every phase of a test (setup, call, teardown), as a pytest plugin.

A phase that runs past FEDKERNELS_TEST_TIME_LIMIT_S seconds (600 unless set; 0 turns the limit
off) fails with every thread's stack printed, instead of hanging the suite: a child process
that never exits must cost one test, not the whole CI run. SIGALRM, so the main thread of a
POSIX process only; elsewhere the tests run without a limit.
"""

from __future__ import annotations

import contextlib
import faulthandler
import os
import signal
import sys
import threading

import pytest

TIME_LIMIT_S = int(os.environ.get("FEDKERNELS_TEST_TIME_LIMIT_S", "600"))


@contextlib.contextmanager
def _time_limit(item):
    if (TIME_LIMIT_S <= 0 or not hasattr(signal, "SIGALRM")
            or threading.current_thread() is not threading.main_thread()):
        yield
        return

    def expired(signum, frame):
        # the stacks of the threads a test started show where it hung; pytest reports them with
        # the failure as the phase's captured stderr
        print(f"\n{item.nodeid} ran past {TIME_LIMIT_S} s; every thread's stack:",
              file=sys.stderr, flush=True)
        try:
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        except (AttributeError, ValueError, OSError):  # --capture=sys: no file descriptor
            faulthandler.dump_traceback(file=sys.__stderr__, all_threads=True)
        pytest.fail(f"ran past the {TIME_LIMIT_S} s time limit (FEDKERNELS_TEST_TIME_LIMIT_S)",
                    pytrace=True)

    previous = signal.signal(signal.SIGALRM, expired)
    signal.alarm(TIME_LIMIT_S)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, previous)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_setup(item):
    with _time_limit(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_call(item):
    with _time_limit(item):
        return (yield)


@pytest.hookimpl(wrapper=True)
def pytest_runtest_teardown(item, nextitem):
    with _time_limit(item):
        return (yield)
