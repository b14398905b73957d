"""MNIST, Fashion-MNIST and EMNIST from their publishers' IDX files.

An IDX file is a magic number (two zero bytes, a type code, 0x08 for unsigned bytes, and the
number of dimensions), each dimension as a big-endian 32-bit count, then the values in C order.
Labels are ``0x00000801`` (one dimension: the count), images ``0x00000803`` (count, rows,
columns). The files may be gzipped (``.gz``, as published) or not (as torchvision leaves them),
and lie in ``data.root`` itself or in torchvision's ``<root>/MNIST/raw``-style folder.
"""

from __future__ import annotations

import math
import string
import struct
from pathlib import Path

import numpy as np

from ..dataset import Dataset
from .assemble import from_parts
from .files import data_error, find_file, read_bytes, root_folder

# Our own reader: torchvision reads only unpacked files under <root>/MNIST/raw, and its wheel
# does not import beside every torch build.
LABELS_MAGIC = 0x00000801
IMAGES_MAGIC = 0x00000803
UNSIGNED_BYTE = 0x08

DIGITS = list(string.digits)
FASHION_CLASSES = ["T-shirt/top", "Trouser", "Pullover", "Dress", "Coat", "Sandal", "Shirt",
                   "Sneaker", "Bag", "Ankle boot"]
# EMNIST's merged splits keep the lowercase letters whose shape differs from the capital's
MERGED_LOWERCASE = list("abdefghnqrt")
EMNIST_CLASSES = {
    "byclass": DIGITS + list(string.ascii_uppercase) + list(string.ascii_lowercase),
    "bymerge": DIGITS + list(string.ascii_uppercase) + MERGED_LOWERCASE,
    "balanced": DIGITS + list(string.ascii_uppercase) + MERGED_LOWERCASE,
    "letters": list(string.ascii_lowercase),
    "digits": DIGITS,
    "mnist": DIGITS,
}
# torchvision's folder of each data set (its download writes the files there)
TORCHVISION_FOLDERS = {"mnist": "MNIST/raw", "fashion_mnist": "FashionMNIST/raw",
                       "emnist": "EMNIST/raw"}


def read_idx(path: Path, magic: int) -> np.ndarray:
    """The uint8 array in the IDX file ``path``, whose magic number must be ``magic``."""
    raw = read_bytes(path)
    if len(raw) < 4:
        raise data_error(path, f"holds {len(raw)} bytes, too few for an IDX header")
    (found,) = struct.unpack(">I", raw[:4])
    if found != magic:
        kind = "labels" if magic == LABELS_MAGIC else "images"
        raise data_error(path, f"magic number 0x{found:08x} is not 0x{magic:08x} (IDX {kind}"
                               " of unsigned bytes)")
    ndim = magic & 0xFF
    header = 4 + 4 * ndim
    if len(raw) < header:
        raise data_error(path, f"is truncated inside its header ({len(raw)} of {header} bytes)")
    dims = struct.unpack(f">{ndim}I", raw[4:header])
    expected = math.prod(dims)
    if len(raw) - header != expected:
        shape = "x".join(map(str, dims))
        state = "truncated: it" if len(raw) - header < expected else "longer than its header says: it"
        raise data_error(path, f"is {state} holds {len(raw) - header} bytes of values, its "
                               f"header ({shape}) promises {expected}")
    return np.frombuffer(raw, dtype=np.uint8, offset=header).reshape(dims)


def read_pair(root: Path, folders: list[str], images_name: str, labels_name: str
              ) -> tuple[np.ndarray, np.ndarray, Path]:
    """Images ``[n, rows, cols]`` and labels ``[n]`` of one part; the images' path."""
    images_path = find_file(root, folders, images_name)
    labels_path = find_file(root, folders, labels_name)
    images = read_idx(images_path, IMAGES_MAGIC)
    labels = read_idx(labels_path, LABELS_MAGIC)
    if len(images) != len(labels):
        raise data_error(labels_path, f"holds {len(labels)} labels for the {len(images)} images "
                                      f"of {images_path.name}")
    return images, labels, labels_path


def check_labels(labels: np.ndarray, num_classes: int, path: Path, first: int = 0) -> None:
    if len(labels) and (labels.min() < first or labels.max() >= num_classes + first):
        bad = labels[(labels < first) | (labels >= num_classes + first)][0]
        raise data_error(path, f"label {bad} is outside {first}..{num_classes + first - 1}")


def load_mnist_family(name: str, root: str | Path, split: str = "byclass") -> Dataset:
    """``mnist``, ``fashion_mnist`` or ``emnist`` (with its ``split``): the publisher's train
    images and then its test images, as uint8 pixels ``[n, 784]`` of 1x28x28 images.

    EMNIST's files store each image transposed; it is turned upright here, as MNIST's are.
    EMNIST letters' labels 1..26 become classes 0..25 (a..z).
    """
    folder = root_folder(root)
    folders = [".", TORCHVISION_FOLDERS[name]]
    if name == "emnist":
        folders.append("gzip")  # the folder of the publisher's zip file
        prefix = f"emnist-{split}-"
        classes = EMNIST_CLASSES[split]
    else:
        prefix = ""
        classes = FASHION_CLASSES if name == "fashion_mnist" else DIGITS
    parts = []
    source = folder
    for part, stem in (("train", "train"), ("test", "t10k" if not prefix else "test")):
        images, labels, labels_path = read_pair(
            folder, folders, f"{prefix}{stem}-images-idx3-ubyte", f"{prefix}{stem}-labels-idx1-ubyte"
        )
        first = 1 if name == "emnist" and split == "letters" else 0
        check_labels(labels, len(classes), labels_path, first)
        if name == "emnist":
            images = images.transpose(0, 2, 1)
        if parts and images.shape[1:] != parts[0][1].shape[1:]:
            raise data_error(labels_path.parent, f"the {part} images are {images.shape[1:]} "
                                                 f"pixels, the train images {parts[0][1].shape[1:]}")
        parts.append((part, images, labels.astype(np.int64) - first))
        source = labels_path.parent
    info = {"split": split, "transposed_upright": True} if name == "emnist" else {}
    return from_parts(name if name != "emnist" else f"emnist-{split}", parts, len(classes),
                      source=source, classes=classes, image_shape=(1, *parts[0][1].shape[1:]),
                      **info)
