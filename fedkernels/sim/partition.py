"""Splitting a pooled data set among clients.

Every partitioner returns one array of sample indices per client. The arrays are disjoint and
together cover every sample: each one is built by cutting a permutation (or a per-class list)
into consecutive pieces, never by sampling with replacement. (Sampling with replacement, or
drawing each client's samples from the whole pool, is the bug of some public FL code that gives
clients overlapping samples.)
"""

from __future__ import annotations

import numpy as np

from .config import ConfigError, PartitionConfig

MAX_DIRICHLET_TRIES = 1000


def iid(num_samples: int, num_clients: int, rng: np.random.Generator) -> list[np.ndarray]:
    """A random permutation cut into ``num_clients`` pieces whose sizes differ by at most 1."""
    return [np.sort(part) for part in np.array_split(rng.permutation(num_samples), num_clients)]


def dirichlet(
    labels: np.ndarray,
    num_clients: int,
    alpha: float,
    rng: np.random.Generator,
    min_samples: int = 1,
) -> list[np.ndarray]:
    """Label skew: for each class c, draw ``q_c ~ Dirichlet(alpha * 1_N)`` and cut the class's
    shuffled samples into N consecutive pieces of sizes proportional to ``q_c``.

    Small alpha gives each client few classes; large alpha approaches IID. The draw is
    repeated (up to 1000 times) until every client has at least ``min_samples`` samples.
    """
    classes = [np.flatnonzero(labels == c) for c in np.unique(labels)]
    for _ in range(MAX_DIRICHLET_TRIES):
        parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
        for members in classes:
            members = rng.permutation(members)
            share = rng.dirichlet(np.full(num_clients, alpha))
            cuts = np.round(np.cumsum(share)[:-1] * len(members)).astype(np.int64)
            for client, piece in enumerate(np.split(members, cuts)):
                parts[client].append(piece)
        result = [np.sort(np.concatenate(p)) for p in parts]
        if min(len(r) for r in result) >= min_samples:
            return result
    raise ConfigError(
        f"dirichlet partition: no draw in {MAX_DIRICHLET_TRIES} gave every one of {num_clients} "
        f"clients {min_samples} samples; raise partition.alpha, or lower partition.num_clients "
        "or partition.min_samples"
    )


def pathological(
    labels: np.ndarray, num_clients: int, classes_per_client: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Each client holds exactly ``classes_per_client`` labels.

    The classes are shuffled into a ring; client k takes the ``classes_per_client``
    consecutive classes starting at ``k * classes_per_client`` (mod C), so every class has an
    owner when ``N * classes_per_client >= C``. Each class's shuffled samples are then cut into
    equal pieces among its owners.
    """
    distinct = np.unique(labels)
    num_classes = len(distinct)
    if classes_per_client > num_classes:
        raise ConfigError(
            f"pathological partition: classes_per_client={classes_per_client} but the data has "
            f"only {num_classes} classes"
        )
    if num_clients * classes_per_client < num_classes:
        raise ConfigError(
            f"pathological partition: {num_clients} clients x {classes_per_client} classes "
            f"cannot cover {num_classes} classes"
        )
    ring = rng.permutation(distinct)
    owners: dict[int, list[int]] = {int(c): [] for c in distinct}
    for client in range(num_clients):
        for j in range(classes_per_client):
            owners[int(ring[(client * classes_per_client + j) % num_classes])].append(client)
    parts: list[list[np.ndarray]] = [[] for _ in range(num_clients)]
    for c, holders in owners.items():
        members = rng.permutation(np.flatnonzero(labels == c))
        if len(members) < len(holders):
            raise ConfigError(
                f"pathological partition: class {c} has {len(members)} samples for "
                f"{len(holders)} clients"
            )
        for client, piece in zip(holders, np.array_split(members, len(holders))):
            parts[client].append(piece)
    return [np.sort(np.concatenate(p)) for p in parts]


def natural(groups: np.ndarray) -> list[np.ndarray]:
    """One client per distinct group value (in sorted order)."""
    return [np.flatnonzero(groups == g) for g in np.unique(groups)]


def partition(
    config: PartitionConfig,
    labels: np.ndarray,
    groups: np.ndarray | None,
    rng: np.random.Generator,
) -> list[np.ndarray]:
    """The partition ``config`` asks for, checked for the minimum size per client."""
    n = len(labels)
    if config.kind == "natural":
        if groups is None:
            raise ConfigError(
                "partition.kind=natural needs a data set with its own clients "
                "(synthetic, femnist, shakespeare, or csv with data.client_column)"
            )
        parts = natural(groups)
    elif n < config.num_clients * config.min_samples:
        raise ConfigError(
            f"{n} samples cannot give {config.num_clients} clients {config.min_samples} each"
        )
    elif config.kind == "iid":
        parts = iid(n, config.num_clients, rng)
    elif config.kind == "dirichlet":
        parts = dirichlet(labels, config.num_clients, config.alpha, rng, config.min_samples)
    else:
        parts = pathological(labels, config.num_clients, config.classes_per_client, rng)
    small = [k for k, p in enumerate(parts) if len(p) < config.min_samples]
    if small:
        raise ConfigError(
            f"{len(small)} clients have fewer than partition.min_samples={config.min_samples} "
            f"samples (client {small[0]} has {len(parts[small[0]])})"
        )
    return parts
