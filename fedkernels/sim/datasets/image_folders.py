"""CINIC-10 and Tiny-ImageNet from their publishers' folders of image files.

CINIC-10: ``train/``, ``valid/`` and ``test/`` (90,000 images each), each with one folder of
32x32 PNG images per class (``airplane`` ... ``truck``). Tiny-ImageNet: ``tiny-imagenet-200/``
with ``wnids.txt`` (the 200 WordNet ids), ``train/<wnid>/images/*.JPEG`` (500 64x64 images a
class) and ``val/images/*.JPEG`` labelled by ``val/val_annotations.txt`` (file, wnid, box); the
test images come without labels and are not read. Greyscale images become RGB.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..config import ConfigError
from ..dataset import Dataset
from .assemble import from_parts
from .files import MissingFiles, data_error, find_folder, root_folder

# Our own reader: torchvision has no class for either data set, and its ImageFolder yields
# one PIL image at a time where the simulator wants one array.
CINIC_PARTS = ("train", "valid", "test")
CINIC_SIDE = 32
TINY_FOLDER = "tiny-imagenet-200"
TINY_SIDE = 64


def _pillow(what: str) -> Any:
    try:
        from PIL import Image, UnidentifiedImageError
    except ImportError:
        raise ConfigError(f"reading {what}'s images needs Pillow: pip install pillow") from None
    return Image, UnidentifiedImageError


def image_files(folder: Path, suffix: str) -> list[Path]:
    """The files of ``folder`` whose name ends in ``suffix`` (any letter case), sorted; an
    empty or missing folder is an error naming it."""
    if not folder.is_dir():
        raise MissingFiles(f"{folder} is not a folder")
    files = sorted(p for p in folder.iterdir() if p.name.lower().endswith(suffix) and p.is_file())
    if not files:
        raise data_error(folder, f"holds no {suffix} images")
    return files


def read_images(files: Sequence[Path], side: int, what: str) -> np.ndarray:
    """``[n, 3, side, side]`` uint8 from image files that must all be ``side`` x ``side``."""
    image, unreadable = _pillow(what)
    out = np.empty((len(files), 3, side, side), dtype=np.uint8)
    for i, path in enumerate(files):
        try:
            with image.open(path) as picture:
                pixels = np.asarray(picture.convert("RGB"))
        except (unreadable, OSError, ValueError) as err:
            reason = " ".join(str(err).split()) or type(err).__name__
            raise data_error(path, f"is not an image Pillow can read ({reason})") from None
        if pixels.shape != (side, side, 3):
            raise data_error(path, f"is {pixels.shape[1]}x{pixels.shape[0]} pixels, not "
                                   f"{side}x{side} as every {what} image")
        out[i] = pixels.transpose(2, 0, 1)
    return out


def load_cinic10(root: str | Path) -> Dataset:
    """The train, valid and test images in that order; test is the publisher's test split.
    Classes are the sorted names of train/'s folders; valid/ and test/ must have the same."""
    folder = find_folder(root_folder(root), ["cinic-10", "CINIC-10", "cinic10", "."], "train")
    train = folder / "train"
    classes = sorted(p.name for p in train.iterdir() if p.is_dir())
    if not classes:
        raise data_error(train, "holds no class folders")
    parts = []
    for part in CINIC_PARTS:
        files, labels = [], []
        for label, name in enumerate(classes):
            found = image_files(folder / part / name, ".png")
            files += found
            labels += [label] * len(found)
        others = sorted({p.name for p in (folder / part).iterdir() if p.is_dir()} - set(classes))
        if others:
            raise data_error(folder / part, f"has class folders that train/ lacks: "
                                            f"{', '.join(others)}")
        parts.append((part, read_images(files, CINIC_SIDE, "CINIC-10"),
                      np.asarray(labels, dtype=np.int64)))
    return from_parts("cinic10", parts, len(classes), source=folder, classes=classes,
                      image_shape=(3, CINIC_SIDE, CINIC_SIDE))


def load_tiny_imagenet(root: str | Path) -> Dataset:
    """The 100,000 training images, then the 10,000 validation images (the publisher's test
    labels are withheld, so its validation set is the test split here). Class ``c`` is the
    ``c``-th of the sorted WordNet ids of ``wnids.txt``."""
    folder = find_folder(root_folder(root), [TINY_FOLDER, "."], "wnids.txt")
    wnids_path = folder / "wnids.txt"
    try:
        wnids = sorted({line.strip() for line in wnids_path.read_text().splitlines()
                        if line.strip()})
    except (OSError, UnicodeDecodeError) as err:
        raise data_error(wnids_path, f"cannot be read ({err})") from None
    if not wnids:
        raise data_error(wnids_path, "lists no WordNet ids")
    index = {w: i for i, w in enumerate(wnids)}
    files, labels = [], []
    for wnid in wnids:
        found = image_files(folder / "train" / wnid / "images", ".jpeg")
        files += found
        labels += [index[wnid]] * len(found)
    train = ("train", read_images(files, TINY_SIDE, "Tiny-ImageNet"),
             np.asarray(labels, dtype=np.int64))
    val_files, val_labels = _validation(folder / "val", index)
    val = ("val", read_images(val_files, TINY_SIDE, "Tiny-ImageNet"),
           np.asarray(val_labels, dtype=np.int64))
    return from_parts("tiny_imagenet", [train, val], len(wnids), source=folder, classes=wnids,
                      image_shape=(3, TINY_SIDE, TINY_SIDE), test_parts=("val",))


def _validation(val: Path, index: dict[str, int]) -> tuple[list[Path], list[int]]:
    """The files and labels that ``val/val_annotations.txt`` lists (tab-separated: file name,
    WordNet id, bounding box)."""
    annotations = val / "val_annotations.txt"
    if not annotations.is_file():
        raise MissingFiles(f"no {annotations}")
    files, labels = [], []
    try:
        lines = annotations.read_text().splitlines()
    except (OSError, UnicodeDecodeError) as err:
        raise data_error(annotations, f"cannot be read ({err})") from None
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        fields = line.split("\t")
        if len(fields) < 2:
            raise data_error(annotations, f"line {number} is not 'file<TAB>wnid<TAB>box'")
        name, wnid = fields[0].strip(), fields[1].strip()
        if wnid not in index:
            raise data_error(annotations, f"line {number}: {wnid!r} is not in wnids.txt")
        path = val / "images" / name
        if not path.is_file():
            raise data_error(annotations, f"line {number}: {path} does not exist")
        files.append(path)
        labels.append(index[wnid])
    if not files:
        raise data_error(annotations, "lists no images")
    return files, labels
