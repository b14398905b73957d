"""Compiles and runs a small C++ driver against the plain-C++ headers of csrc/ with the system
compiler (a second or two), for tests of host-compilable kernel code; skips where the sources
(an installed package) or a compiler are missing."""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from pathlib import Path

import pytest

CSRC = Path(__file__).resolve().parent.parent / "csrc"


def run_driver(source: str, header: str, tmp_path: Path) -> str:
    """Builds ``source`` (which includes ``header``, a path under csrc/) with -Werror and runs
    it; asserts that both succeed and returns the program's standard output."""
    if not (CSRC / header).exists():
        pytest.skip("the C++ sources are not next to the tests (an installed package)")
    compiler = next((p for p in map(shutil.which, ("c++", "g++", "clang++")) if p), None)
    if compiler is None:
        pytest.skip("no C++ compiler on the PATH")
    path = tmp_path / "driver.cpp"
    path.write_text(source)
    binary = tmp_path / "driver"
    # FK_DRIVER_CXXFLAGS adds flags: .ci/sanitize.sh builds the drivers under its sanitizers
    extra = shlex.split(os.environ.get("FK_DRIVER_CXXFLAGS", ""))
    build = subprocess.run(
        [compiler, "-std=c++20", "-O1", "-Wall", "-Werror", *extra, f"-I{CSRC}", str(path), "-o",
         str(binary)],
        capture_output=True, text=True, timeout=120,
    )
    assert build.returncode == 0, build.stderr
    run = subprocess.run([str(binary)], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    return run.stdout
