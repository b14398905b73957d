"""The publishers' data sets, read from their own file formats in ``data.root``.

One module per format family: :mod:`.idx` (MNIST, Fashion-MNIST, EMNIST), :mod:`.cifar`
(CIFAR-10/100 pickles), :mod:`.svhn` (MATLAB files), :mod:`.image_folders` (CINIC-10,
Tiny-ImageNet), :mod:`.leaf` (FEMNIST, Shakespeare) and :mod:`.mnist_1d` (generated). Images
are kept as uint8 pixels (:class:`~fedkernels.sim.dataset.Dataset` scales them to [0, 1] as it
hands rows to clients). Each loader checks the files' structure (magic numbers, keys, shapes,
label ranges), not their checksums, and reports a problem as one line naming the file.
"""

from __future__ import annotations

from pathlib import Path

from ..config import DataConfig
from ..dataset import Dataset
from .cifar import load_cifar10, load_cifar100
from .download import TORCHVISION_CLASSES, download
from .files import MissingFiles
from .idx import load_mnist_family
from .image_folders import load_cinic10, load_tiny_imagenet
from .leaf import load_leaf
from .mnist_1d import DEFAULT_SAMPLES, generate_mnist1d
from .svhn import load_svhn


def _read(config: DataConfig) -> Dataset:
    name, root = config.name, config.root
    if name in ("mnist", "fashion_mnist", "emnist"):
        return load_mnist_family(name, root, config.split)
    if name == "cifar10":
        return load_cifar10(root)
    if name == "cifar100":
        return load_cifar100(root, config.coarse)
    if name == "svhn":
        return load_svhn(root, config.extra)
    if name == "cinic10":
        return load_cinic10(root)
    if name == "tiny_imagenet":
        return load_tiny_imagenet(root)
    if name in ("femnist", "shakespeare"):
        return load_leaf(name, root)
    if name == "mnist1d":
        return generate_mnist1d(config.num_samples or DEFAULT_SAMPLES)
    raise ValueError(f"load_publisher_dataset: {name!r} is not a publisher's data set")


def load_publisher_dataset(config: DataConfig) -> Dataset:
    """The data set ``config.name`` from the files in ``config.root``; with
    ``config.download``, files that are missing are fetched with torchvision first."""
    try:
        return _read(config)
    except MissingFiles as err:
        if not config.download:
            hint = (" (or add --data.download to fetch them with torchvision)"
                    if config.name in TORCHVISION_CLASSES else "")
            raise MissingFiles(f"{config.name}: {err}; where to get the files: "
                               f"docs/guide/datasets.md{hint}") from None
    download(config.name, Path(config.root), config.split, config.extra)
    return _read(config)
