"""The labelled data set every loader returns: rows, labels, and what a run needs to know
about them (input kind, natural clients, image shape, the publisher's test split)."""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from torch import Tensor

from .config import ConfigError
from .tabular import TableEncoder

# x's dtype -> the kind of its rows (any other float dtype is "features")
INPUT_KINDS = {torch.uint8: "pixels", torch.int64: "tokens"}


@dataclass
class Dataset:
    """Samples ``x[i]`` (one row each) with labels ``y[i]`` in ``[0, num_classes)``.

    A row is one of three kinds (:attr:`input_kind`), told by ``x``'s dtype:

    * ``features`` (float): the model's input as it is;
    * ``pixels`` (uint8): an image's bytes, which the model sees scaled to [0, 1] as float32
      (:meth:`rows`); a quarter of the memory of float rows while the pool is whole;
    * ``tokens`` (int64): indices in ``[0, vocab_size)`` of a sequence (characters of text).

    ``groups[i]`` is sample i's natural client (an integer; clients are the sorted distinct
    values), or ``None``. ``image_shape`` (e.g. ``(1, 8, 8)``; ``(1, 40)`` for a 1-D signal)
    says how a CNN views a row. ``official_test[i]`` is True where the publisher put sample i
    in its test set (None: the data set has no such split). ``info`` says what the loader did
    (label mapping, encoded, imputed and standardised columns, files read); a run records it in
    ``results.json``. ``encoder`` (tabular data) rebuilds ``x`` with statistics of the training
    rows only (:meth:`fit_features`).
    """

    x: Tensor
    y: Tensor
    num_classes: int
    groups: np.ndarray | None = None
    image_shape: tuple[int, ...] | None = None
    name: str = "tensors"
    info: dict[str, Any] = field(default_factory=dict)
    encoder: TableEncoder | None = field(default=None, repr=False)
    vocab_size: int | None = None
    official_test: np.ndarray | None = None

    def __post_init__(self) -> None:
        kind = INPUT_KINDS.get(self.x.dtype, "features" if self.x.is_floating_point() else None)
        if self.x.dim() != 2 or kind is None:
            raise ConfigError(
                f"dataset x must be a 2-D float, uint8 (pixels) or int64 (tokens) tensor, got "
                f"{tuple(self.x.shape)} {self.x.dtype}"
            )
        if self.y.shape != (self.x.shape[0],) or self.y.dtype != torch.int64:
            raise ConfigError(f"dataset y must be int64 of shape ({self.x.shape[0]},)")
        if self.x.shape[0] == 0:
            raise ConfigError("dataset is empty")
        if int(self.y.min()) < 0 or int(self.y.max()) >= self.num_classes:
            raise ConfigError(f"dataset labels must lie in [0, {self.num_classes})")
        if kind == "tokens":
            if self.vocab_size is None or self.vocab_size < 1:
                raise ConfigError("dataset x of int64 tokens needs vocab_size >= 1")
            if int(self.x.min()) < 0 or int(self.x.max()) >= self.vocab_size:
                raise ConfigError(f"dataset tokens must lie in [0, {self.vocab_size})")
        elif self.vocab_size is not None:
            raise ConfigError(f"dataset vocab_size is for int64 tokens, but x is {self.x.dtype}")
        if kind == "features" and not torch.isfinite(self.x).all():
            raise ConfigError("dataset x has non-finite values")
        if self.groups is not None and len(self.groups) != self.x.shape[0]:
            raise ConfigError("dataset groups must have one entry per sample")
        if self.official_test is not None and (
            self.official_test.shape != (self.x.shape[0],) or self.official_test.dtype != np.bool_
        ):
            raise ConfigError("dataset official_test must be a boolean mask, one entry per sample")
        if self.image_shape is not None and math.prod(self.image_shape) != self.x.shape[1]:
            raise ConfigError(
                f"image_shape {self.image_shape} does not match {self.x.shape[1]} features"
            )

    @property
    def input_kind(self) -> str:
        """``features``, ``pixels`` or ``tokens`` (the class docstring)."""
        return INPUT_KINDS.get(self.x.dtype, "features")

    def rows(self, index: Tensor) -> Tensor:
        """The model inputs of the samples ``index``: pixels as float32 in [0, 1], features
        and tokens as stored."""
        x = self.x[index]
        return x.to(torch.float32).div_(255.0) if self.input_kind == "pixels" else x

    @property
    def num_samples(self) -> int:
        return self.x.shape[0]

    def fit_features(self, train_rows: np.ndarray) -> Dataset:
        """This data set with its features re-encoded from statistics of ``train_rows`` only
        (the union of the clients' training splits), so that no test row leaks into them.
        Data sets without an encoder come back unchanged."""
        if self.encoder is None:
            return self
        x, features = self.encoder.encode(train_rows)
        return dataclasses.replace(self, x=torch.from_numpy(x),
                                   info={**self.info, "features": features})

    @property
    def num_features(self) -> int:
        return self.x.shape[1]

    @classmethod
    def from_tensors(
        cls,
        x: Tensor,
        y: Tensor,
        groups: Tensor | np.ndarray | None = None,
        *,
        num_classes: int | None = None,
        image_shape: tuple[int, ...] | None = None,
    ) -> Dataset:
        """User data: ``x`` of shape ``[n, ...]`` (flattened to ``[n, d]``; a 3-D sample shape
        becomes ``image_shape``), integer labels ``y``, optional natural client ids ``groups``.
        The pool is kept on the CPU, where it is partitioned; a simulation moves each client's
        rows to its device once."""
        x = torch.as_tensor(x, device="cpu")
        if x.dim() >= 3 and image_shape is None:
            image_shape = tuple(x.shape[1:]) if x.dim() == 4 else (1, *x.shape[1:])
        x = x.reshape(x.shape[0], -1).to(torch.float32)
        y = torch.as_tensor(y, device="cpu").to(torch.int64)
        if groups is not None:
            groups = np.asarray(torch.as_tensor(groups, device="cpu").numpy(), dtype=np.int64)
        k = int(y.max()) + 1 if num_classes is None else num_classes
        return cls(x, y, k, groups, image_shape)
