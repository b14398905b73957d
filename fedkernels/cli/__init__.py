"""The ``fedkernels`` command line: ``fedkernels run`` (one experiment, :mod:`.run`) and
``fedkernels compare`` (several algorithms over several seeds, :mod:`.compare`)."""

from __future__ import annotations

import sys

from . import check, compare, run


def main(argv: list[str] | None = None) -> int:
    """Entry point of the ``fedkernels`` script."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["check"]:
        return check.main(argv[1:])
    if argv[:1] == ["compare"]:
        return compare.main(argv[1:])
    return run.main(argv)
