"""The benchmarks' command lines: argument types that refuse a bad value before any work, the
flags that every results-writing script shares (``--save``, ``--out``, ``--clock``,
``--check``, ``--tolerance``), and ``--device`` resolved to a device this machine can run.

A bad argument is argparse's one-line error or :func:`fail`'s, exit status 2, never a
traceback minutes into a run.
"""

from __future__ import annotations

import argparse
import math
import os
import sys
from collections.abc import Callable

import torch

from .timing import CPU_CLOCKS


def fail(message: str) -> None:
    """One line on stderr naming the script, exit status 2 (no traceback)."""
    print(f"{os.path.basename(sys.argv[0]) or 'bench'}: error: {message}", file=sys.stderr)
    sys.exit(2)


def resolve_device(text: str) -> torch.device:
    """``--device`` as a torch device this machine can run the fused ops on, or a one-line
    error: an unknown device, CUDA without a visible GPU, or without fedkernels' CUDA kernels."""
    try:
        device = torch.device(text)
    except (RuntimeError, ValueError):
        fail(f"--device {text!r} is not a device name (use cpu or cuda)")
    if device.type not in ("cpu", "cuda"):
        fail(f"--device {text!r}: the benchmarks run on cpu or cuda")
    if device.type == "cuda":
        if not torch.cuda.is_available():
            build = f"CUDA {torch.version.cuda}" if torch.version.cuda else "a CPU-only build"
            fail(f"--device {text} but no CUDA GPU is visible to torch (torch {torch.__version__}, "
                 f"{build}); run on a GPU machine or use --device cpu")
        if device.index is not None and device.index >= torch.cuda.device_count():
            fail(f"--device {text}: only {torch.cuda.device_count()} GPU(s) visible")
        from fedkernels.ops import native

        if not native.cuda_available:
            fail(f"--device {text} but fedkernels' CUDA kernels are not built; rebuild with "
                 "FEDKERNELS_CUDA=1 pip install --no-build-isolation -e .")
    return device


def at_least(minimum: int) -> Callable[[str], int]:
    """An argparse type: an integer of at least ``minimum``. A count of 0 (repeats, clients,
    probe bytes) would otherwise surface after minutes of work as a ZeroDivisionError or an
    empty median; as a type it is argparse's one-line error, exit status 2, before any."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"must be at least {minimum}, got {value}")
        return value

    parse.__name__ = f"integer >= {minimum}"
    return parse


def _finite_number(text: str, ok, bound: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not (math.isfinite(value) and ok(value)):
        raise argparse.ArgumentTypeError(f"must be a finite number {bound}, got {text}")
    return value


def non_negative_fraction(text: str) -> float:
    """An argparse type: a finite float >= 0 (``--tolerance``)."""
    return _finite_number(text, lambda v: v >= 0, ">= 0")


def positive_number(text: str) -> float:
    """An argparse type: a finite float > 0 (a time limit, a memory bound)."""
    return _finite_number(text, lambda v: v > 0, "> 0")


def add_output_arguments(parser: argparse.ArgumentParser) -> None:
    """``--save`` and ``--out`` (where they write: harness.results)."""
    parser.add_argument("--save", action="store_true",
                        help="also merge the results into the committed "
                             "bench/results/<device>.json")
    parser.add_argument("--out", metavar="FILE",
                        help="write the results JSON to FILE instead of a new file under "
                             "bench/results/runs/")


def check_output_arguments(args: argparse.Namespace) -> None:
    if args.out and os.path.isdir(args.out):
        fail(f"--out {args.out!r} is a directory; give a file name")
    if getattr(args, "check", False) and args.save:
        fail("--check compares a fresh run with the committed results, which --save would "
             "replace first; run them separately")


def add_clock_argument(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clock", choices=sorted(CPU_CLOCKS), default="wall",
                        help="clock of CPU timings: wall (default) or process (this process's "
                             "CPU time: leaves out other work on a shared machine; use with one "
                             "torch thread)")


def add_check_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--check", action="store_true",
                        help="run afresh and compare the ratios (speed-ups over the baselines, "
                             "fractions of the bandwidth probe) with the committed "
                             "bench/results/<device>.json; exit status 1 when one regressed")
    parser.add_argument("--tolerance", type=non_negative_fraction, default=0.2,
                        help="--check flags a ratio that got worse by more than this fraction "
                             "(default 0.2: 20%%)")
