"""Run files written whole or not at all: each is written under a temporary name beside it and
then renamed over it, so that a crash or a Ctrl-C in the middle of a write leaves the previous
file (or none), never a truncated one."""

from __future__ import annotations

import contextlib
import glob
import os
import uuid
from collections.abc import Iterator
from pathlib import Path

PARTIAL_SUFFIX = ".partial"


@contextlib.contextmanager
def replacing(path: str | os.PathLike) -> Iterator[Path]:
    """Yields a new temporary path beside ``path``, for the caller to write. When the block ends
    normally the file there replaces ``path``; when it raises (or is interrupted) the file is
    removed. The name holds the process id and a random part, so two writers never share one."""
    path = Path(path)
    partial = path.with_name(f"{path.name}.{os.getpid()}-{uuid.uuid4().hex[:8]}{PARTIAL_SUFFIX}")
    try:
        yield partial
        os.replace(partial, path)
    except BaseException:
        partial.unlink(missing_ok=True)
        raise


def write_text(path: str | os.PathLike, text: str) -> None:
    """``Path(path).write_text(text)``, all or nothing."""
    with replacing(path) as partial:
        partial.write_text(text)


def remove_leftovers(path: str | os.PathLike) -> None:
    """Removes the temporaries that writers stopped mid-write (a killed process) left beside
    ``path``."""
    path = Path(path)
    for partial in path.parent.glob(f"{glob.escape(path.name)}.*{PARTIAL_SUFFIX}"):
        partial.unlink(missing_ok=True)
