"""SVHN (cropped digits) from its publisher's MATLAB files.

``train_32x32.mat`` (73,257 images), ``test_32x32.mat`` (26,032) and, optionally,
``extra_32x32.mat`` (531,131 easier images) each hold ``X``, uint8 of shape
``[32, 32, 3, n]`` (height, width, channel, image), and ``y``, ``[n, 1]`` with the digit's
label in 1..10, where 10 stands for the digit 0.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..config import ConfigError
from ..dataset import Dataset
from .assemble import from_parts
from .files import data_error, find_file, root_folder

# Our own reader: torchvision's refuses files whose md5 differs from the publisher's.
FOLDERS = [".", "svhn", "SVHN"]
IMAGE_SHAPE = (3, 32, 32)


def read_mat(path: Path) -> tuple[np.ndarray, np.ndarray]:
    """Images ``[n, 3, 32, 32]`` uint8 and labels ``[n]`` in 0..9 of one SVHN file."""
    try:
        from scipy.io import loadmat
    except ImportError:  # pragma: no cover - depends on the environment
        raise ConfigError("reading SVHN's .mat files needs SciPy: pip install scipy") from None
    try:
        content = loadmat(path, variable_names=["X", "y"])
    except (ValueError, TypeError, NotImplementedError, OSError, EOFError) as err:
        reason = " ".join(str(err).split()) or type(err).__name__
        raise data_error(path, f"is not a MATLAB file SciPy can read ({reason})") from None
    for key in ("X", "y"):
        if key not in content:
            raise data_error(path, f"has no variable {key!r} (an SVHN file holds X and y)")
    x, y = content["X"], content["y"]
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[:3] != (32, 32, 3):
        raise data_error(path, f"X is {x.dtype} {x.shape}, not uint8 32x32x3 images (32, 32, 3, n)")
    y = y.reshape(-1)
    if len(y) != x.shape[3]:
        raise data_error(path, f"y holds {len(y)} labels for {x.shape[3]} images")
    if y.dtype.kind not in "iuf" or not np.isin(y, np.arange(1, 11)).all():
        raise data_error(path, "y must hold labels in 1..10 (10 is the digit 0)")
    labels = y.astype(np.int64) % 10
    return np.ascontiguousarray(x.transpose(3, 2, 0, 1)), labels


def load_svhn(root: str | Path, extra: bool = False) -> Dataset:
    """The training images (and the extra ones when ``extra``), then the test images."""
    folder = root_folder(root)
    names = ["train"] + (["extra"] if extra else []) + ["test"]
    paths = {part: find_file(folder, FOLDERS, f"{part}_32x32.mat", gzipped=False)
             for part in names}
    parts = [(part, *read_mat(paths[part])) for part in names]
    return from_parts("svhn-extra" if extra else "svhn", parts, 10, source=paths["train"].parent,
                      classes=[str(d) for d in range(10)], image_shape=IMAGE_SHAPE)
