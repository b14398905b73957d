"""MNIST-1D (Greydanus and Kobak, 2020), generated offline by the ``mnist1d`` package.

Each sample is a 40-step 1-D signal made from one of ten digit-like templates by random
padding, translation, shear, scaling and noise, standardised over the whole set. The package's
generator (``make_dataset``) is called with its published arguments (``get_dataset_args``:
seed 42, 80/20 train/test) and our ``num_samples``; its ``get_dataset`` is not used, since it
downloads a pickle by default. Published test accuracies with 5000 samples: logistic regression
32 %, MLP 68 %, CNN 94 %.
"""

from __future__ import annotations

import random

import numpy as np

from ..config import ConfigError
from ..dataset import Dataset
from .assemble import from_parts

DEFAULT_SAMPLES = 5000  # the published set: 4000 train, 1000 test
SIGNAL_LENGTH = 40


def generate_mnist1d(num_samples: int = DEFAULT_SAMPLES) -> Dataset:
    """``num_samples`` signals (rounded down to a multiple of 10: the generator makes the
    same number of each digit) as float32 rows ``[n, 40]``; train rows, then test rows."""
    try:
        from mnist1d.data import get_dataset_args, make_dataset
    except ImportError:
        raise ConfigError("data.name=mnist1d needs the mnist1d package: pip install mnist1d"
                          ) from None
    if num_samples < 10:
        raise ConfigError(f"data.num_samples={num_samples}: mnist1d needs at least 10 (one "
                          "of each digit)")
    args = get_dataset_args()
    args.num_samples = num_samples
    # the generator seeds NumPy's and Python's global random state: keep the caller's
    numpy_state, python_state = np.random.get_state(), random.getstate()
    try:
        data = make_dataset(args)
    finally:
        np.random.set_state(numpy_state)
        random.setstate(python_state)
    parts = [("train", np.asarray(data["x"], dtype=np.float32), np.asarray(data["y"])),
             ("test", np.asarray(data["x_test"], dtype=np.float32), np.asarray(data["y_test"]))]
    if parts[0][1].shape[1] != SIGNAL_LENGTH:  # pragma: no cover - a changed package default
        raise ConfigError(f"mnist1d generated signals of {parts[0][1].shape[1]} steps, not "
                          f"{SIGNAL_LENGTH}")
    return from_parts("mnist1d", parts, 10, source="mnist1d.data.make_dataset",
                      classes=[str(d) for d in range(10)], image_shape=(1, SIGNAL_LENGTH),
                      generator={"num_samples": num_samples, "seed": args.seed,
                                 "train_split": args.train_split})
