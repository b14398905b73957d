"""One :class:`~fedkernels.sim.dataset.Dataset` from the parts a publisher ships (train, test, ...).

The parts are stacked in the order given, and ``official_test`` marks the rows of the parts the
publisher meant for testing, so that a configuration can keep that split while the default
per-client split still sees one pool.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from ..dataset import Dataset


def from_parts(
    name: str,
    parts: Sequence[tuple[str, np.ndarray, np.ndarray]],
    num_classes: int,
    *,
    source: Path | str,
    classes: Sequence[str] | None = None,
    image_shape: tuple[int, ...] | None = None,
    test_parts: Sequence[str] = ("test",),
    groups: np.ndarray | None = None,
    vocab_size: int | None = None,
    **info: Any,
) -> Dataset:
    """``parts``: ``(part name, rows [n, ...], labels [n])``; rows of uint8 are pixels, of
    float32 features, of int64 tokens; every row is flattened."""
    xs = [rows.reshape(len(rows), -1) for _, rows, _ in parts]
    x = np.concatenate(xs) if len(xs) > 1 else xs[0]
    y = np.concatenate([labels for _, _, labels in parts]).astype(np.int64)
    official = np.concatenate([np.full(len(labels), part in test_parts)
                               for part, _, labels in parts])
    details: dict[str, Any] = {"source": str(source),
                               "parts": {part: int(len(labels)) for part, _, labels in parts}}
    if official.any():
        details["official_test"] = [p for p, _, _ in parts if p in test_parts]
    if classes is not None:
        details["classes"] = list(classes)
    details.update(info)
    return Dataset(
        torch.from_numpy(np.ascontiguousarray(x)),
        torch.from_numpy(y),
        num_classes,
        groups,
        image_shape,
        name=name,
        info=details,
        vocab_size=vocab_size,
        official_test=official if official.any() else None,
    )
