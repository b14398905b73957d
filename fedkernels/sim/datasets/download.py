"""``data.download``: torchvision fetches a data set's files into ``data.root``.

Only the fetching is torchvision's (it knows the publishers' addresses and checksums); the files
it leaves are read by this package's own readers, like files put there by hand. torchvision is
the optional extra ``fedkernels[vision]``.
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

from ..config import ConfigError

# data.name -> torchvision's class
TORCHVISION_CLASSES = {"mnist": "MNIST", "fashion_mnist": "FashionMNIST", "emnist": "EMNIST",
                       "cifar10": "CIFAR10", "cifar100": "CIFAR100", "svhn": "SVHN"}


def torchvision_datasets() -> Any:
    try:
        return importlib.import_module("torchvision.datasets")
    except Exception as err:  # ImportError, or a wheel built for another torch (RuntimeError)
        reason = " ".join(str(err).split()) or type(err).__name__
        raise ConfigError(
            f"data.download needs torchvision, which cannot be imported ({reason}): pip install "
            "'fedkernels[vision]' (torchvision 0.28.0 for torch 2.13), or put the files in "
            "data.root by hand (docs/guide/datasets.md)"
        ) from None


def download(name: str, root: str | Path, split: str = "byclass", extra: bool = False) -> None:
    """Fetches the training and test files of ``name`` into ``root`` (created if missing)."""
    if name not in TORCHVISION_CLASSES:
        raise ConfigError(f"data.download: torchvision cannot fetch {name}; put its files in "
                          "data.root by hand (docs/guide/datasets.md)")
    folder = Path(root).expanduser()
    folder.mkdir(parents=True, exist_ok=True)
    cls = getattr(torchvision_datasets(), TORCHVISION_CLASSES[name])
    if name == "svhn":
        calls = [{"split": s} for s in ("train", "test", *(("extra",) if extra else ()))]
    else:
        calls = [{"train": True}, {"train": False}]
        if name == "emnist":
            calls = [{**c, "split": split} for c in calls]
    for kwargs in calls:
        try:
            cls(str(folder), download=True, **kwargs)
        except Exception as err:  # network and checksum errors come as many types
            reason = " ".join(str(err).split()) or type(err).__name__
            raise ConfigError(f"data.download: torchvision could not fetch {name} into {folder} "
                              f"({reason})") from None
