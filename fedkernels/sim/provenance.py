"""Which code made a result: the fedkernels version and, for a git checkout, its commit.

Both are read without importing torch, so that ``fedkernels --version`` answers at once.
"""

from __future__ import annotations

import functools
import subprocess
import sys
from importlib import metadata
from pathlib import Path
from typing import Any

# the checkout holding this package (fedkernels/sim/provenance.py -> the repository root)
SOURCE_ROOT = Path(__file__).resolve().parents[2]


def package_version() -> str:
    """The installed distribution's version, else the package's ``__version__``."""
    try:
        return metadata.version("fedkernels")
    except metadata.PackageNotFoundError:  # imported from a source folder, not installed
        return getattr(sys.modules.get("fedkernels"), "__version__", "unknown")


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", "-C", str(SOURCE_ROOT), *args], capture_output=True,
                              text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):  # no git, or it hangs on a network mount
        return None
    return done.stdout.strip() if done.returncode == 0 else None


@functools.lru_cache(maxsize=1)
def git_state() -> dict[str, Any]:
    """``git_commit`` (the checkout's HEAD) and ``git_dirty`` (tracked files changed since),
    both ``None`` when the package is not imported from a git checkout (a wheel install)."""
    if not (SOURCE_ROOT / ".git").exists():  # a worktree's .git is a file: exists() holds
        return {"git_commit": None, "git_dirty": None}
    commit = _git("rev-parse", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no") if commit else None
    return {"git_commit": commit, "git_dirty": None if status is None else bool(status)}


def provenance() -> dict[str, Any]:
    """``fedkernels`` (version), ``git_commit`` and ``git_dirty``."""
    return {"fedkernels": package_version(), **git_state()}
