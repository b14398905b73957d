"""Named, independent random streams derived from one experiment seed.

Every random choice of a simulation draws from a stream keyed by ``(seed, stream, *keys)``,
e.g. the minibatch order of client 7 in round 12 comes from ``(seed, BATCHES, 12, 7)``. A
stream's numbers therefore do not depend on what other streams consumed, on the order in which
clients are trained, or on whether the run was interrupted and resumed: the only stateful
generator (participation sampling) is saved in the checkpoint.
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


@contextlib.contextmanager
def torch_stream(seed: int, stream: int, *keys: int) -> Iterator[None]:
    """Runs the block with torch's CPU generator seeded for one stream, then restores the
    caller's generator state (so a simulation leaves the user's torch RNG untouched)."""
    with torch.random.fork_rng(devices=[]):
        # Only the CPU generator: torch.manual_seed would also queue seeds for every
        # accelerator backend, a cost paid on every call.
        torch.default_generator.manual_seed(torch_seed(seed, stream, *keys))
        yield
