"""``fedkernels check``: the installation self-check (:mod:`fedkernels.selfcheck`).

Prints versions, the loaded CPU kernel build and why, the CUDA status, one pass/fail row per op
and device and dtype against the pure-PyTorch reference, and a short bandwidth probe. Exit
status 0 when every check passes, 1 when one fails, 2 for bad arguments.
"""

from __future__ import annotations

import argparse
import sys

from fedkernels.selfcheck import available_devices, check


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="fedkernels check",
        description="Check this fedkernels installation: versions, builds, every op against "
                    "its reference on every device and dtype, and a bandwidth probe.",
    )
    parser.add_argument("--json", metavar="FILE", help="also write the report as JSON to FILE")
    parser.add_argument("--quick", action="store_true", help="skip the bandwidth probe")
    parser.add_argument("--device", action="append", choices=["cpu", "cuda"],
                        help="check only this device (repeatable; default: every available one)")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    devices = args.device
    if devices and "cuda" in devices and "cuda" not in available_devices():
        print("fedkernels check: error: --device cuda but no CUDA GPU is visible to torch",
              file=sys.stderr)
        return 2
    try:
        report = check(quick=args.quick, json_path=args.json, devices=devices)
    except (ValueError, TypeError) as err:
        print(f"fedkernels check: error: {err}", file=sys.stderr)
        return 2
    if args.json:
        print(f"wrote {args.json}")
    return 0 if report["ok"] else 1
