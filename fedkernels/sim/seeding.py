"""Named, independent random streams derived from one experiment seed.

Every random choice of a simulation draws from a stream keyed by ``(seed, stream, *keys)``,
e.g. the minibatch order of client 7 in round 12 comes from ``(seed, BATCHES, 12, 7)``. A
stream's numbers therefore do not depend on what other streams consumed, on the order in which
clients are trained, or on whether the run was interrupted and resumed: the only stateful
generator (participation sampling) is saved in the checkpoint.

Streams and devices. Draws that define the experiment rather than the arithmetic are made on
the CPU whatever the run's device, and copied where needed: data, partitions, minibatch orders
(NumPy), initial weights (modules are built on the CPU), augmentation offsets, SuPerFed's
lambdas, attack noise. They are the same numbers on every device. Draws that torch makes on the
device itself (dropout, ``torch.func.vmap``'s randomness, the noise of the SGLD and private
ops) come from the device's generator: :func:`torch_stream` seeds the CUDA default generator
too when given a CUDA device, and :func:`generator` makes a seeded ``torch.Generator`` on a
device. Those draws repeat bitwise on the same device and differ between CPU and GPU.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import numpy as np
import torch

DATA = 0
PARTITION = 1
SPLIT = 2
PARTICIPATION = 3
MODEL_INIT = 4
BATCHES = 5
LOCAL_TRAINING = 6
SERVER_SPLIT = 7
ATTACK = 8
DP_NOISE = 9


def numpy_rng(seed: int, stream: int, *keys: int) -> np.random.Generator:
    """A numpy generator for one stream (``np.random.SeedSequence`` spawning by key)."""
    return np.random.default_rng(np.random.SeedSequence([seed, stream, *keys]))


def torch_seed(seed: int, stream: int, *keys: int) -> int:
    """A 63-bit torch seed for one stream."""
    state = np.random.SeedSequence([seed, stream, *keys]).generate_state(2, dtype=np.uint32)
    return (int(state[0]) << 31) ^ int(state[1])


def generator(seed: int, stream: int, *keys: int,
              device: torch.device | str = "cpu") -> torch.Generator:
    """A ``torch.Generator`` on ``device`` seeded for one stream (the ops that draw on a GPU
    take a generator of the GPU)."""
    return torch.Generator(device=device).manual_seed(torch_seed(seed, stream, *keys))


@contextlib.contextmanager
def torch_stream(seed: int, stream: int, *keys: int,
                 device: torch.device | None = None) -> Iterator[None]:
    """Runs the block with torch's CPU generator seeded for one stream, and with a CUDA
    ``device`` that device's default generator too (same seed), then restores the caller's
    generator states (so a simulation leaves the user's torch RNG untouched)."""
    if device is None or device.type != "cuda":
        # the CPU generator alone, saved and restored by hand: fork_rng's checks cost more
        # than the seeding itself, once per client and round
        cpu = torch.default_generator
        saved = cpu.get_state()
        cpu.manual_seed(torch_seed(seed, stream, *keys))
        try:
            yield
        finally:
            cpu.set_state(saved)
        return
    cuda = [device]
    with torch.random.fork_rng(devices=cuda, device_type="cuda"):
        # Only these generators: torch.manual_seed would also queue seeds for every
        # accelerator backend, a cost paid on every call.
        value = torch_seed(seed, stream, *keys)
        torch.default_generator.manual_seed(value)
        for d in cuda:
            with torch.cuda.device(d):
                torch.cuda.manual_seed(value)
        yield
