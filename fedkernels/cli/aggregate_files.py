"""``fedkernels aggregate``: the weighted sum of K checkpoint files, streamed in chunks
(:func:`fedkernels.checkpoint_files.aggregate_files`).

    fedkernels aggregate a.safetensors b.safetensors c.safetensors --weights 30 50 20 \\
        --normalize --out avg.safetensors

Exit status 0 on success, 2 for bad arguments or unusable files (one line on stderr).
"""

from __future__ import annotations

import argparse
import math
import re
import sys
import time

from fedkernels.checkpoint_files import (
    DEFAULT_CHUNK_BYTES,
    DEFAULT_MAX_SHARD_BYTES,
    INT_POLICIES,
    aggregate_files,
)

PROG = "fedkernels aggregate"
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


class _UsageError(Exception):
    pass


class _Parser(argparse.ArgumentParser):
    """argparse whose errors become this command's one-line error (no usage block)."""

    def error(self, message: str) -> None:  # type: ignore[override]
        raise _UsageError(message)


def byte_size(text: str) -> int:
    """``5GB``, ``500MB``, ``4MiB`` or a plain number of bytes."""
    match = re.fullmatch(r"\s*(\d+(?:\.\d*)?)\s*([A-Za-z]*)\s*", text)
    unit = match.group(2).upper() if match else None
    if match is None or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"expected a size such as 5GB, 500MB or 4MiB, got {text!r}")
    value = float(match.group(1)) * _UNITS[unit]
    if not math.isfinite(value) or value < 1:
        raise argparse.ArgumentTypeError(f"expected a positive size, got {text!r}")
    return int(value)


def shard_size(text: str) -> int | None:
    return None if text.strip().lower() == "none" else byte_size(text)


def real(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"expected a finite number, got {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(
        prog=PROG, allow_abbrev=False,
        description="Weighted sum of K model checkpoints (safetensors files, sharded "
                    "checkpoints or torch .pt state_dicts), streamed in chunks: memory stays "
                    "a few chunks per client whatever the model's size. Plain: scale * sum_k "
                    "w_k x_k; with --base: base + scale * sum_k w_k (x_k - base).",
    )
    parser.add_argument("files", nargs="+", metavar="FILE",
                        help="client checkpoints: .safetensors, *.safetensors.index.json (or "
                             "its folder), .pt/.pth/.bin")
    parser.add_argument("--weights", nargs="+", type=real, required=True, metavar="W",
                        help="one weight per FILE (e.g. sample counts with --normalize)")
    parser.add_argument("--out", required=True, metavar="FILE",
                        help="the result: a .safetensors path (sharded as NAME-0000i-of-0000N "
                             "with NAME.safetensors.index.json above --max-shard-size)")
    parser.add_argument("--base", metavar="FILE",
                        help="the current global model: delta mode, base + scale * sum w (x - base)")
    parser.add_argument("--scale", type=real, default=1.0,
                        help="multiplies the weighted sum (the server learning rate with --base)")
    parser.add_argument("--normalize", action="store_true", help="divide the weights by their sum")
    parser.add_argument("--int-policy", choices=INT_POLICIES, default="max",
                        help="integer and bool tensors: elementwise max (default), client 0's "
                             "(first), base's (skip) or an error")
    parser.add_argument("--max-shard-size", type=shard_size, default=DEFAULT_MAX_SHARD_BYTES,
                        metavar="SIZE", help="largest output file, e.g. 5GB (default) or none")
    parser.add_argument("--chunk-size", type=byte_size, default=DEFAULT_CHUNK_BYTES,
                        metavar="SIZE", help="bytes of each client summed per step (default 1MiB)")
    parser.add_argument("--overwrite", action="store_true", help="replace existing output files")
    parser.add_argument("--no-fsync", action="store_true",
                        help="do not flush the output to the disk before renaming it")
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
        if len(args.weights) != len(args.files):
            raise _UsageError(f"{len(args.files)} files but {len(args.weights)} weights; give "
                              "one weight per file")
        start = time.perf_counter()
        written = aggregate_files(
            args.files, args.weights, out=args.out, base=args.base, scale=args.scale,
            normalize=args.normalize, int_policy=args.int_policy, chunk_bytes=args.chunk_size,
            max_shard_bytes=args.max_shard_size, overwrite=args.overwrite,
            fsync=not args.no_fsync)
    except (_UsageError, ValueError, TypeError) as err:
        message = str(err).removeprefix("fedkernels.aggregate_files: ")
        print(f"{PROG}: error: {' '.join(message.split())}", file=sys.stderr)
        return 2
    seconds = time.perf_counter() - start
    print(f"wrote {written[0]}" + (f" and {len(written) - 1} shards" if len(written) > 1 else "")
          + f" ({len(args.files)} clients, {seconds:.1f} s)")
    return 0
