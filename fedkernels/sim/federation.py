"""The clients of a simulation: each one's train and test split of its share of the data, with
optional noise on the training labels (:func:`noisy_labels`)."""

from __future__ import annotations

import dataclasses
import warnings
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from . import seeding
from .config import ConfigError, PartitionConfig
from .dataset import Dataset
from .partition import partition
from .tabular import DataWarning

LABEL_NOISE = 21  # (seed, LABEL_NOISE, client): a stream of its own beside those of seeding


@dataclass
class ClientData:
    """One client's samples. ``train_index``/``test_index`` are rows of the pooled data set."""

    train_x: Tensor
    train_y: Tensor
    test_x: Tensor
    test_y: Tensor
    train_index: np.ndarray
    test_index: np.ndarray

    @property
    def num_train(self) -> int:
        return len(self.train_index)

    @property
    def num_test(self) -> int:
        return len(self.test_index)

    def to(self, device: torch.device) -> ClientData:
        """This client's samples on ``device`` (the row indices stay NumPy arrays)."""
        return dataclasses.replace(
            self, train_x=self.train_x.to(device), train_y=self.train_y.to(device),
            test_x=self.test_x.to(device), test_y=self.test_y.to(device),
        )


@dataclass
class Federation:
    """All clients, plus what a model needs to know about the data."""

    clients: list[ClientData]
    num_classes: int
    num_features: int
    image_shape: tuple[int, ...] | None = None
    server_x: Tensor | None = None  # the server's unlabeled data (data.server_fraction)
    data_info: dict[str, Any] = field(default_factory=dict)  # what the loader did (Dataset.info)
    vocab_size: int | None = None  # rows of int64 tokens: their number of distinct values

    @property
    def num_clients(self) -> int:
        return len(self.clients)

    def train_sizes(self) -> Tensor:
        """``n_k``, the number of training samples of each client (float64, ``[N]``, on the
        CPU: a host-side value)."""
        return torch.tensor([c.num_train for c in self.clients], dtype=torch.float64,
                            device="cpu")

    def label_distributions(self) -> np.ndarray:
        """``kappa[n, c]``: the fraction of client n's training labels equal to c."""
        counts = np.stack(
            [np.bincount(c.train_y.cpu().numpy(), minlength=self.num_classes)
             for c in self.clients]
        ).astype(np.float64)
        return counts / counts.sum(axis=1, keepdims=True)

    def to(self, device: torch.device) -> Federation:
        """The same federation with every client's samples and the server's rows on ``device``:
        one copy each, made once for the whole run."""
        return dataclasses.replace(
            self, clients=[c.to(device) for c in self.clients],
            server_x=None if self.server_x is None else self.server_x.to(device),
        )


def split_client(
    indices: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """A seeded shuffle of one client's rows, cut into train and
    ``max(1, round(test_fraction * n))`` test rows (at least one of each)."""
    shuffled = rng.permutation(indices)
    num_test = min(max(1, round(test_fraction * len(indices))), len(indices) - 1)
    return np.sort(shuffled[num_test:]), np.sort(shuffled[:num_test])


def official_split(
    indices: np.ndarray, official_test: np.ndarray, client: int
) -> tuple[np.ndarray, np.ndarray]:
    """One client's rows cut by the publisher's split: its rows of the publisher's test set
    are its test rows, the others its training rows (each part must be non-empty)."""
    test = official_test[indices]
    if test.all() or not test.any():
        raise ConfigError(
            f"data.official_split: client {client} has {int((~test).sum())} training and "
            f"{int(test.sum())} test rows of the publisher's split, and needs both (fewer "
            "clients, or leave data.official_split out for a random split of each client)"
        )
    return np.sort(indices[~test]), np.sort(indices[test])


def stratified_split_client(
    indices: np.ndarray, labels: np.ndarray, test_fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """One client's rows cut into train and test class by class: of each class's ``n_c``
    rows, a seeded shuffle puts ``round(test_fraction * n_c)`` in the test split, clipped to
    ``[1, n_c - 1]``, so that the test split holds every class the client has two rows of
    (and its AUROC is defined when it has two of each of two classes). A class with one row
    trains. When that leaves the test split empty (every class a single row), the split is
    :func:`split_client`'s. (scikit-learn's stratified splits round a small class down to no
    test row, and refuse a class of one row.)"""
    test = []
    for c in np.unique(labels[indices]):
        members = rng.permutation(indices[labels[indices] == c])
        if len(members) >= 2:
            test.append(members[: min(max(1, round(test_fraction * len(members))),
                                      len(members) - 1)])
    if not test:
        return split_client(indices, test_fraction, rng)
    test_rows = np.sort(np.concatenate(test))
    return np.setdiff1d(indices, test_rows), test_rows


def server_split(
    labels: np.ndarray, fraction: float, rng: np.random.Generator
) -> tuple[np.ndarray, np.ndarray]:
    """``(client_rows, server_rows)``: ``round(fraction * n_c)`` random samples of each class c
    go to the server (its unlabeled data for ensemble distillation), the rest to the clients."""
    server = []
    for c in np.unique(labels):
        members = rng.permutation(np.flatnonzero(labels == c))
        server.append(members[: int(round(fraction * len(members)))])
    server_rows = np.sort(np.concatenate(server)) if server else np.zeros(0, dtype=np.int64)
    client_rows = np.setdiff1d(np.arange(len(labels)), server_rows)
    return client_rows, server_rows


def noisy_labels(
    labels: Tensor, kind: str, rate: float, num_classes: int, rng: np.random.Generator
) -> Tensor:
    """``labels`` with each entry flipped independently with probability ``rate``:
    ``symmetric`` to one of the other ``num_classes - 1`` classes chosen uniformly, ``pair``
    from class c to ``(c + 1) mod num_classes`` (the noise models of SuPerFed's label-noise
    experiments); ``none`` returns them unchanged."""
    if kind == "none" or rate == 0 or len(labels) == 0:
        return labels
    if kind not in ("symmetric", "pair"):
        raise ValueError(f"label noise must be none, symmetric or pair, got {kind!r}")
    y = labels.numpy()
    flip = rng.random(len(y)) < rate
    if kind == "pair":
        shift = np.ones(len(y), dtype=np.int64)
    else:  # an offset in 1..C-1 never lands on the true class
        shift = rng.integers(1, num_classes, len(y))
    return torch.from_numpy(np.where(flip, (y + shift) % num_classes, y))


def build_federation(
    dataset: Dataset,
    config: PartitionConfig,
    test_fraction: float,
    seed: int,
    server_fraction: float = 0.0,
    *,
    label_noise: str = "none",
    noise_rate: float = 0.0,
    use_official_split: bool = False,
    stratify: bool = False,
) -> Federation:
    """Partitions ``dataset`` and splits each client's share into train and test, with the
    split of client k seeded by ``(seed, SPLIT, k)``. With ``server_fraction`` > 0 that
    fraction of every class is first held out, unlabeled, for the server (``server_x``).
    ``label_noise``/``noise_rate`` flip client k's training labels (:func:`noisy_labels`,
    stream ``(seed, LABEL_NOISE, k)``); test labels stay clean, and ``data_info`` records the
    fraction actually flipped. ``use_official_split`` splits each client by the publisher's
    train/test split (:func:`official_split`) instead of ``test_fraction``; ``stratify`` splits
    each client class by class (:func:`stratified_split_client`). ``data_info`` lists the
    clients whose test split holds a single class (no AUROC); when other clients have an AUROC,
    that is warned about once."""
    if use_official_split and dataset.official_test is None:
        raise ConfigError(f"data.official_split needs a data set with the publisher's test "
                          f"split (mnist ... mnist1d); {dataset.name} has none")
    labels = dataset.y.numpy()
    rows = np.arange(len(labels))
    server_rows = None
    if server_fraction > 0:
        rows, server_rows = server_split(
            labels, server_fraction, seeding.numpy_rng(seed, seeding.SERVER_SPLIT)
        )
    parts = partition(
        config,
        labels[rows],
        None if dataset.groups is None else dataset.groups[rows],
        seeding.numpy_rng(seed, seeding.PARTITION),
    )
    parts = [rows[p] for p in parts]
    if use_official_split:
        splits = [official_split(rows, dataset.official_test, k) for k, rows in enumerate(parts)]
    else:
        splits = [
            stratified_split_client(rows, labels, test_fraction,
                                    seeding.numpy_rng(seed, seeding.SPLIT, k))
            if stratify else
            split_client(rows, test_fraction, seeding.numpy_rng(seed, seeding.SPLIT, k))
            for k, rows in enumerate(parts)
        ]
    # Tabular features (imputation, scaling, category levels) are fitted on the union of the
    # clients' training rows only: no test row leaks into them.
    dataset = dataset.fit_features(np.concatenate([train for train, _ in splits]))
    # pixels become float rows here, client by client: the pool stays uint8
    server_x = None if server_rows is None else dataset.rows(torch.from_numpy(server_rows))
    clients = []
    flipped = 0
    for k, (train, test) in enumerate(splits):
        train_t, test_t = torch.from_numpy(train), torch.from_numpy(test)
        train_y = noisy_labels(
            dataset.y[train_t], label_noise, noise_rate, dataset.num_classes,
            seeding.numpy_rng(seed, LABEL_NOISE, k),
        )
        flipped += int((train_y != dataset.y[train_t]).sum())
        clients.append(
            ClientData(
                dataset.rows(train_t),
                train_y,
                dataset.rows(test_t),
                dataset.y[test_t],
                train,
                test,
            )
        )
    info = dataset.info
    if config.kind != "natural" and "clients" in info:
        # The client column was read (so it is not a feature) but this partition ignores it:
        # its value -> client mapping would describe clients that do not exist.
        info = {**info, "clients": {"column": info["clients"]["column"],
                                    "used": False, "partition": config.kind}}
    if stratify:
        info = {**info, "test_split": "stratified by label"}
    single = [k for k, (_, test) in enumerate(splits) if len(np.unique(labels[test])) < 2]
    if single:
        info = {**info, "single_class_test_clients": single}
        if len(single) < len(splits):  # with none left, no statistic is taken to mislead
            _warn_single_class_tests(single, len(splits), stratify)
    if label_noise != "none":
        total = sum(len(train) for train, _ in splits)
        info = {**info, "label_noise": {"kind": label_noise, "rate": noise_rate,
                                        "flipped_fraction": flipped / max(total, 1)}}
    return Federation(
        clients,
        dataset.num_classes,
        dataset.num_features,
        dataset.image_shape,
        server_x,
        info,
        dataset.vocab_size,
    )


def _warn_single_class_tests(clients: list[int], num_clients: int, stratified: bool) -> None:
    """Says once which clients' test splits hold a single class: they have no AUROC, so the
    statistics over clients' AUROCs cover the others only."""
    shown = ", ".join(map(str, clients[:10])) + (f" and {len(clients) - 10} more"
                                                 if len(clients) > 10 else "")
    hint = "" if stratified else "; data.stratify true gives each client's test split every " \
        "class it has two rows of"
    which = (f"the test splits of clients {shown} hold a single class each" if len(clients) > 1
             else f"the test split of client {shown} holds a single class")
    warnings.warn(DataWarning(
        f"{which}, so no AUROC: client_auroc_* cover {num_clients - len(clients)} of "
        f"{num_clients} clients (summary.client_auroc_clients){hint}"), stacklevel=3)
