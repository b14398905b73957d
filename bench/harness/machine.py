"""The machine a run measured: the device name that results files are named after (a CPU's
names its model and fedkernels' CPU build), the CPU's identity, and the environment recorded
with every run (device, torch, date, threads, CPU build, clock).
"""

from __future__ import annotations

import datetime
import os
import platform
import re

import torch

from .timing import cpu_clock_name


def device_name(device: torch.device) -> str:
    """The name that results files are named after: the GPU's name, or ``cpu-<model>-<build>``
    (the CPU model and the fedkernels CPU build that runs), lower case with dashes."""
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
    else:
        name = platform.processor() or "cpu"
        try:
            with open("/proc/cpuinfo") as f:
                for line in f:
                    if line.startswith("model name"):
                        name = line.split(":", 1)[1].strip()
                        break
        except OSError:
            pass
        # The build in the name: one model name covers CPUs with and without AVX-512, and
        # their results must not overwrite each other.
        from fedkernels.ops import native

        name = f"cpu-{name}-{native.cpu_capability}"
    return re.sub(r"[^a-z0-9]+", "-", name.lower()).strip("-")


def cpu_identity() -> dict[str, str]:
    """The CPU's family, model and stepping (/proc/cpuinfo) and its last-level cache size
    (sysfs), where the system tells them. Virtual machines report generic model names
    ("AMD EPYC", "Intel(R) Xeon(R) Processor") that cover several generations of CPU, so the
    results file a device name picks can hold another CPU's run."""
    found: dict[str, str] = {}
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                key, _, value = line.partition(":")
                key = key.strip()
                if key in ("cpu family", "model", "stepping") and key not in found:
                    found[key] = value.strip()
                if not line.strip() and found:  # the first processor's block only
                    break
    except OSError:
        pass
    cache = "/sys/devices/system/cpu/cpu0/cache"
    try:
        levels = []
        for index in (n for n in os.listdir(cache) if n.startswith("index")):
            with open(os.path.join(cache, index, "level")) as f:
                level = int(f.read())
            with open(os.path.join(cache, index, "size")) as f:
                levels.append((level, f.read().strip()))
        if levels:
            found["last-level cache"] = max(levels)[1]
    except (OSError, ValueError):
        pass
    return {key.replace("cpu ", ""): value for key, value in found.items()}


def environment(device: torch.device) -> dict:
    """What a results file records of the run: the device name, torch, the UTC date, torch's
    threads and fedkernels' CPU build; on a CPU its identity and a clock other than wall time;
    on a GPU the CUDA version."""
    from fedkernels.ops import native

    env = {
        "device": device_name(device),
        "torch": torch.__version__,
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "threads": torch.get_num_threads(),
        "fedkernels_cpu_build": native.cpu_capability,
    }
    if device.type == "cpu":
        identity = cpu_identity()
        if identity:
            env["cpu"] = identity
    if device.type == "cpu" and cpu_clock_name() != "wall":
        env["cpu_clock"] = cpu_clock_name()
    if device.type == "cuda":
        env["cuda"] = torch.version.cuda
    return env
