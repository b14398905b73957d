"""Bandwidth probes: the read (a large ``sum``) and copy (a large ``copy_``) bandwidth of the
device, measured in the same run as the cases on buffers larger than any cache, so that a
case's effective bandwidth reads as a fraction of what this machine does.
"""

from __future__ import annotations

import torch

from .machine import environment
from .timing import median_time

# The smallest --probe-bytes: one float32 (a 0-byte probe divides by a zero time).
MIN_PROBE_BYTES = 4


def bandwidth_probes(device: torch.device, nbytes: int = 1 << 30) -> dict[str, float]:
    """Read (``sum``) and copy (``copy_``, counted as read + write) bandwidth in GB/s on
    buffers larger than any cache."""
    src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)
    dst = torch.empty_like(src)
    read = median_time(lambda: src.sum(), device, repeats=9)
    copy = median_time(lambda: dst.copy_(src), device, repeats=9)
    return {"read_GBps": nbytes / read / 1e9, "copy_GBps": 2 * nbytes / copy / 1e9,
            "probe_bytes": nbytes}


class ReadProbe:
    """The read probe again right before each case: ``sum`` over a buffer larger than any
    cache, the median of a few calls. The host of a shared machine speeds up and slows down
    within a run, so a case's fraction of the probe is taken against the probe measured next
    to it. Not between the case's own calls: a probe there flushes the caches, and small cases
    would then be timed cold while the benches time every op warm."""

    def __init__(self, device: torch.device, nbytes: int) -> None:
        self.device = device
        self.nbytes = nbytes
        self.src = torch.ones(nbytes // 4, dtype=torch.float32, device=device)

    def read_gbps(self, repeats: int = 5) -> float:
        return self.nbytes / median_time(lambda: self.src.sum(), self.device, repeats) / 1e9


def print_probes(device: torch.device, probes: dict[str, float]) -> None:
    """The machine and its bandwidth probes, first thing in every run's output."""
    env = environment(device)
    print(f"# {env['device']}  torch {env['torch']}  threads {env['threads']}  "
          f"cpu build {env['fedkernels_cpu_build']}")
    print(f"# probes: read {probes['read_GBps']:.1f} GB/s (sum of "
          f"{probes['probe_bytes'] / 2**20:.0f} MiB), copy {probes['copy_GBps']:.1f} GB/s",
          flush=True)
