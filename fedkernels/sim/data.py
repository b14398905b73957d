"""Pooled labelled data sets, before they are split among clients.

Loaders: scikit-learn's bundled digits (real 8x8 images, no download), the FedProx
synthetic(alpha, beta) generator, a Gaussian mixture, user tensors, and a CSV file with a client
column. A data set that comes with its own clients (synthetic users, the CSV's client column)
carries them in ``groups`` for the ``natural`` partition. The publishers' data sets (MNIST,
CIFAR, SVHN, CINIC-10, Tiny-ImageNet, LEAF, MNIST-1D) are read by :mod:`fedkernels.sim.datasets`.

A CSV file's features depend on statistics (medians, means, category levels) that must come
from the training rows alone; which rows those are is only known once the data is split among
clients, so such a data set keeps its encoder and :meth:`Dataset.fit_features` refits it.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from . import seeding
from .config import FILE_DATASETS, ConfigError, DataConfig
from .dataset import Dataset
from .datasets import load_publisher_dataset
from .datasets.heart import load_heart
from .tabular import TableEncoder, client_codes, feature_columns, map_labels, read_table, require_columns

GAUSSIAN_MIXTURE_SAMPLES = 3000  # data.num_samples's default for gaussian_mixture
# read by fedkernels.sim.datasets (files in data.root, or the mnist1d generator)
PUBLISHER_DATASETS = (*FILE_DATASETS, "mnist1d")


def load_digits() -> Dataset:
    """scikit-learn's digits: 1797 real 8x8 grey images of the digits 0-9, pixels scaled to
    [0, 1]. Shipped inside scikit-learn, so it needs no download."""
    try:
        from sklearn.datasets import load_digits as sk_load_digits
    except ImportError as err:  # pragma: no cover - depends on the environment
        raise ConfigError(
            "the digits data set needs scikit-learn: pip install 'fedkernels[sim]'"
        ) from err
    x, y = sk_load_digits(return_X_y=True)
    return Dataset(
        torch.from_numpy(x / 16.0).to(torch.float32),
        torch.from_numpy(y).to(torch.int64),
        10,
        image_shape=(1, 8, 8),
        name="digits",
    )


def synthetic(
    alpha: float,
    beta: float,
    num_users: int,
    rng: np.random.Generator,
    *,
    iid: bool = False,
    max_samples: int = 2000,
    dimension: int = 60,
    num_classes: int = 10,
) -> Dataset:
    """The FedProx synthetic(alpha, beta) data (Li et al. 2020, ``generate_synthetic.py``).

    For user k: ``n_k = min(int(LogNormal(4, 2)) + 50, max_samples)``;
    ``u_k ~ N(0, alpha)``, ``B_k ~ N(0, beta)`` (alpha and beta are standard deviations, as in
    the original code); ``W_k ~ N(u_k, 1)^{d x C}``, ``b_k ~ N(u_k, 1)^C``;
    ``v_k ~ N(B_k, 1)^d``; ``x ~ N(v_k, Sigma)`` with ``Sigma = diag(j^-1.2)``, j = 1..d;
    ``y = argmax(W_k^T x + b_k)``. The IID variant shares one ``W, b`` and sets
    ``v_k = B_k * 1``. ``groups`` holds the user of each sample (the natural partition).
    """
    sizes = np.minimum(rng.lognormal(4, 2, num_users).astype(np.int64) + 50, max_samples)
    mean_w = rng.normal(0.0, alpha, num_users)
    shift = rng.normal(0.0, beta, num_users)
    std_x = np.power(np.arange(1, dimension + 1, dtype=np.float64), -1.2) ** 0.5
    shared_w = rng.normal(0.0, 1.0, (dimension, num_classes))
    shared_b = rng.normal(0.0, 1.0, num_classes)
    xs, ys = [], []
    for k in range(num_users):
        if iid:
            mean_x = np.full(dimension, shift[k])
            w, b = shared_w, shared_b
        else:
            mean_x = rng.normal(shift[k], 1.0, dimension)
            w = rng.normal(mean_w[k], 1.0, (dimension, num_classes))
            b = rng.normal(mean_w[k], 1.0, num_classes)
        x = mean_x + std_x * rng.standard_normal((sizes[k], dimension))
        xs.append(x)
        ys.append(np.argmax(x @ w + b, axis=1))
    groups = np.repeat(np.arange(num_users), sizes)
    return Dataset(
        torch.from_numpy(np.concatenate(xs)).to(torch.float32),
        torch.from_numpy(np.concatenate(ys)).to(torch.int64),
        num_classes,
        groups,
        name=f"synthetic({alpha},{beta})" + ("-iid" if iid else ""),
    )


def gaussian_mixture(
    num_samples: int,
    num_features: int,
    num_classes: int,
    separation: float,
    rng: np.random.Generator,
) -> Dataset:
    """A toy mixture: class means ``mu_c ~ separation * N(0, I)``, labels uniform,
    ``x = mu_y + N(0, I)``."""
    means = separation * rng.standard_normal((num_classes, num_features))
    y = rng.integers(0, num_classes, num_samples)
    x = means[y] + rng.standard_normal((num_samples, num_features))
    return Dataset(
        torch.from_numpy(x).to(torch.float32),
        torch.from_numpy(y).to(torch.int64),
        num_classes,
        name="gaussian_mixture",
    )


def load_csv(
    path: str | Path,
    label_column: str = "label",
    client_column: str | None = "client",
    *,
    label_map: str | None = None,
    positive_labels: Sequence[Any] | None = None,
    categorical_columns: Sequence[str] | None = None,
    ignore_columns: Sequence[str] | None = None,
    standardize: bool = True,
    delimiter: str | None = None,
    decimal: str = ".",
    encoding: str = "utf-8",
) -> Dataset:
    """A CSV file with a header row: one label column, optionally one client column (the
    natural partition), and feature columns (all the others but ``ignore_columns``).

    Labels are read as text: ``label_map`` (``"no=0,yes=1"``) maps them to classes,
    ``positive_labels`` makes those values class 1 and the rest class 0, and by default the
    distinct values in sorted order become ``0..C-1``. Feature columns of numbers are imputed
    (median, plus a 0/1 gap indicator) and standardised; text columns (and
    ``categorical_columns``) are one-hot encoded with a ``missing`` level. Missing markers:
    ``''``, ``?``, ``NA``, ``N/A``, ``nan``, ``null``. The encoding here is fitted on every
    row; a simulation refits it on the clients' training rows (:meth:`Dataset.fit_features`).
    Every problem raises :class:`ConfigError` naming the row and column. ``delimiter``: ``","``,
    ``";"``, ``"tab"`` or ``"|"`` (None: a tab for a ``.tsv`` file, else a comma); ``decimal``
    ``","`` reads ``3,5`` and ``1.234,5`` as 3.5 and 1234.5; ``encoding``: the file's text
    encoding (UTF-8 by default). Rules in ``docs/data.md``.
    """
    table = read_table(path, delimiter, decimal, encoding)
    require_columns(table, {"data.label_column": label_column,
                            "data.client_column": client_column})
    if client_column is not None and client_column == label_column:
        raise ConfigError(f"data.label_column and data.client_column are both {label_column!r}")
    special = {label_column: "data.label_column", client_column: "data.client_column"}
    for option, names in (("data.categorical_columns", categorical_columns),
                          ("data.ignore_columns", ignore_columns)):
        for name in names or ():
            if name not in table.header:
                raise ConfigError(f"{table.path}: {option} names {name!r}, which is not a column "
                                  f"(columns: {', '.join(table.header)})")
            if name in special:
                raise ConfigError(f"{option} names {name!r}, which is the {special[name]}")
    both = set(categorical_columns or ()) & set(ignore_columns or ())
    if both:
        raise ConfigError(f"column {sorted(both)[0]!r} is in both data.categorical_columns and "
                          "data.ignore_columns")
    ignored = set(ignore_columns or ())
    names = [c for c in table.header
             if c not in (label_column, client_column) and c not in ignored]
    if not names:
        raise ConfigError(f"{table.path}: no feature columns (columns: {', '.join(table.header)})")
    y, num_classes, labels = map_labels(table, label_column, label_map, positive_labels)
    groups, clients = (None, None) if client_column is None else client_codes(table, client_column)
    columns, dropped = feature_columns(table, names, list(categorical_columns or ()))
    if not columns:
        raise ConfigError(f"{table.path}: every feature column is empty (no value in any row "
                          f"of {', '.join(repr(c) for c in dropped)})")
    encoder = TableEncoder(columns, standardize, dropped)
    x, features = encoder.encode()
    info: dict[str, Any] = {"file": str(table.path), "rows": table.num_rows, "labels": labels}
    if table.empty_unnamed_columns:
        info["empty_unnamed_columns"] = table.empty_unnamed_columns
    if ignored:
        info["ignored_columns"] = [c for c in table.header if c in ignored]
    if clients is not None:
        info["clients"] = {"column": client_column, "mapping": clients}
    info["features"] = features
    return Dataset(torch.from_numpy(x), torch.from_numpy(y), num_classes, groups,
                   name=table.path.name, info=info, encoder=encoder)


# data sets whose clients' test splits are stratified by label unless data.stratify says not
STRATIFIED_BY_DEFAULT = ("heart",)


def stratified_split(config: DataConfig) -> bool:
    """Whether each client's train/test split is stratified by label (data.stratify, by
    default on for :data:`STRATIFIED_BY_DEFAULT`)."""
    return config.name in STRATIFIED_BY_DEFAULT if config.stratify is None else config.stratify


def load_dataset(config: DataConfig, num_clients: int, seed: int) -> Dataset:
    """The data set ``config`` names; ``num_clients`` is the number of synthetic users."""
    if config.name in PUBLISHER_DATASETS:
        return load_publisher_dataset(config)
    rng = seeding.numpy_rng(seed, seeding.DATA)
    if config.name == "digits":
        return load_digits()
    if config.name == "heart":
        return load_heart(config.root)
    if config.name == "synthetic":
        return synthetic(
            config.alpha,
            config.beta,
            num_clients,
            rng,
            iid=config.iid,
            max_samples=config.max_samples,
        )
    if config.name == "gaussian_mixture":
        return gaussian_mixture(
            config.num_samples or GAUSSIAN_MIXTURE_SAMPLES, config.num_features, config.num_classes,
            config.separation, rng,
        )
    return load_csv(
        config.path,
        config.label_column,
        config.client_column,
        label_map=config.label_map,
        positive_labels=config.positive_labels,
        categorical_columns=config.categorical_columns,
        ignore_columns=config.ignore_columns,
        standardize=config.standardize,
        delimiter=config.delimiter,
        decimal=config.decimal,
        encoding=config.encoding,
    )
