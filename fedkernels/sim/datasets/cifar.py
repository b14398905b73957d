"""CIFAR-10 and CIFAR-100 from their publisher's python pickles.

CIFAR-10: ``cifar-10-batches-py/`` holds ``data_batch_1`` .. ``data_batch_5`` (the 50,000
training images), ``test_batch`` (10,000) and ``batches.meta`` (``b'label_names'``).
CIFAR-100: ``cifar-100-python/`` holds ``train``, ``test`` and ``meta``
(``b'fine_label_names'``, ``b'coarse_label_names'``). Each batch is a pickled dict with
``bytes`` keys: ``b'data'``, a uint8 array ``[n, 3072]`` (the red, green then blue planes of a
32x32 image), and ``b'labels'`` (CIFAR-10) or ``b'fine_labels'`` and ``b'coarse_labels'``.
"""

from __future__ import annotations

import codecs
import importlib
import pickle
from pathlib import Path
from typing import Any

import numpy as np

from ..dataset import Dataset
from .assemble import from_parts
from .files import data_error, find_folder, root_folder

# Our own reader: torchvision's refuses files whose md5 differs from the publisher's, and so
# any small or repacked copy.
CIFAR10_FOLDER = "cifar-10-batches-py"
CIFAR100_FOLDER = "cifar-100-python"
IMAGE_SHAPE = (3, 32, 32)


def _numpy_multiarray() -> Any:
    try:  # NumPy 2 moved the core module; pickles name either place
        return importlib.import_module("numpy._core.multiarray")
    except ImportError:  # pragma: no cover - NumPy 1
        return importlib.import_module("numpy.core.multiarray")


class ArrayUnpickler(pickle.Unpickler):
    """Unpickles dicts, lists, bytes and NumPy arrays, and refuses any other class: a pickle
    can name any callable, and a data file has no business running code."""

    def find_class(self, module: str, name: str) -> Any:
        multiarray = _numpy_multiarray()
        allowed = {
            ("numpy.core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy._core.multiarray", "_reconstruct"): multiarray._reconstruct,
            ("numpy.core.multiarray", "scalar"): multiarray.scalar,
            ("numpy._core.multiarray", "scalar"): multiarray.scalar,
            ("numpy", "ndarray"): np.ndarray,
            ("numpy", "dtype"): np.dtype,
            ("_codecs", "encode"): codecs.encode,  # bytes in a protocol-2 pickle of Python 3
        }
        found = allowed.get((module, name))
        if found is None:
            raise pickle.UnpicklingError(f"it names {module}.{name}, which a CIFAR batch never "
                                         "holds")
        return found


def read_batch(path: Path) -> dict[bytes, Any]:
    """The dict pickled in ``path`` (keys as bytes, as Python 2 wrote them)."""
    if not path.is_file():
        raise data_error(path, "is missing")
    try:
        with path.open("rb") as stream:
            batch = ArrayUnpickler(stream, encoding="bytes").load()
    except (pickle.UnpicklingError, EOFError, ValueError, TypeError, AttributeError,
            IndexError, KeyError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise data_error(path, f"is not a CIFAR batch pickle ({reason})") from None
    except OSError as err:
        raise data_error(path, f"cannot be read ({err.strerror or err})") from None
    if not isinstance(batch, dict):
        raise data_error(path, f"holds a {type(batch).__name__}, not the dict of a CIFAR batch")
    return batch


def batch_images(path: Path, batch: dict[bytes, Any], label_key: bytes, num_classes: int
                 ) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, 3, 32, 32]`` uint8 and labels ``[n]`` of one batch."""
    for key in (b"data", label_key):
        if key not in batch:
            keys = ", ".join(repr(k) for k in batch)
            raise data_error(path, f"has no key {key!r} (keys: {keys})")
    data = batch[b"data"]
    if not isinstance(data, np.ndarray) or data.dtype != np.uint8 or data.ndim != 2 \
            or data.shape[1] != 3 * 32 * 32:
        what = (f"{data.dtype} {data.shape}" if isinstance(data, np.ndarray)
                else type(data).__name__)
        raise data_error(path, f"b'data' is {what}, not uint8 rows of 3072 pixels")
    labels = np.asarray(batch[label_key])
    if labels.shape != (len(data),) or labels.dtype.kind not in "iu":
        raise data_error(path, f"{label_key!r} must hold one integer per image ({len(data)}), "
                               f"holds {labels.dtype} {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() >= num_classes):
        raise data_error(path, f"{label_key!r} has labels outside 0..{num_classes - 1}")
    return data.reshape(len(data), *IMAGE_SHAPE), labels.astype(np.int64)


def class_names(path: Path, key: bytes, count: int) -> list[str]:
    meta = read_batch(path)
    names = meta.get(key)
    if not isinstance(names, list) or len(names) != count:
        raise data_error(path, f"{key!r} must list the {count} class names")
    return [n.decode("utf-8", "replace") if isinstance(n, bytes) else str(n) for n in names]


def load_cifar10(root: str | Path) -> Dataset:
    """The 50,000 training images (data_batch_1..5) and then the 10,000 test images."""
    folder = find_folder(root_folder(root), [CIFAR10_FOLDER, "."], "batches.meta")
    classes = class_names(folder / "batches.meta", b"label_names", 10)
    train = [batch_images(p, read_batch(p), b"labels", 10)
             for p in (folder / f"data_batch_{i}" for i in range(1, 6))]
    test = batch_images(folder / "test_batch", read_batch(folder / "test_batch"), b"labels", 10)
    parts = [("train", np.concatenate([x for x, _ in train]),
              np.concatenate([y for _, y in train])), ("test", *test)]
    return from_parts("cifar10", parts, 10, source=folder, classes=classes,
                      image_shape=IMAGE_SHAPE)


def load_cifar100(root: str | Path, coarse: bool = False) -> Dataset:
    """The 50,000 training images and then the 10,000 test images, with the 100 fine labels
    (or the 20 coarse superclasses when ``coarse``)."""
    folder = find_folder(root_folder(root), [CIFAR100_FOLDER, "."], "meta")
    prefix, count = (b"coarse", 20) if coarse else (b"fine", 100)
    classes = class_names(folder / "meta", prefix + b"_label_names", count)
    parts = [(part, *batch_images(folder / part, read_batch(folder / part),
                                  prefix + b"_labels", count))
             for part in ("train", "test")]
    return from_parts("cifar100-coarse" if coarse else "cifar100", parts, count, source=folder,
                      classes=classes, image_shape=IMAGE_SHAPE, labels="coarse" if coarse else "fine")
