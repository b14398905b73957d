"""``fedkernels run --smoke``: any configuration shrunk to a run of seconds.

A smoke run checks that a configuration's whole pipeline runs (data loader, partition,
participation, model, algorithm, metrics, outputs) without its cost: it keeps every choice of
the configuration (data set, model, algorithm, partition kind, participation kind) and lowers
every size:

- two rounds, evaluated and checkpointed after each;
- at most four clients (more where a pathological partition needs them to cover the classes),
  at least half of them sampled per round; explicit participation probabilities are dropped;
- two local steps of at most eight rows instead of the local epochs;
- tiny widths for the models that have any (``mlp``, ``cnn``); the papers' models keep theirs;
- the algorithm's costly parameters (epochs of its server or discriminator training, GAN steps,
  synthetic or generated set sizes, its own batch sizes and epochs) lowered;
- generated data sets (``mnist1d``, ``gaussian_mixture``) a few hundred samples;
- a data set read from the publisher's files (and ``heart``) is replaced by tiny random files
  in the publisher's exact format (:mod:`fedkernels.sim.datasets.tiny_files`), written into a
  folder of the run, so that the loader itself runs; ``data.download`` is switched off;
- a Dirichlet partition's concentration raised to at least 1, so that every tiny client gets rows
  of several classes (and, with ``data.official_split``, rows of both parts).

A user's CSV file is read as it is. The numbers of a smoke run mean nothing: it answers "does
this configuration run", fast.
"""

from __future__ import annotations

import dataclasses
import math
import string
from pathlib import Path
from typing import Any

import numpy as np

from .config import ConfigError, ExperimentConfig, from_dict
from .datasets import tiny_files

ROUNDS = 2
CLIENTS = 4
LOCAL_STEPS = 2
BATCH_SIZE = 8
GENERATED_SAMPLES = 400
MIN_FRACTION = 0.5
MIN_DIRICHLET_ALPHA = 1.0
DATA_FOLDER = "smoke-data"  # inside the run's folder

# algorithm parameters that scale a run's cost -> their smoke value (only ever lowered)
ALGORITHM_LIMITS: dict[str, Any] = {
    "server_epochs": 1, "disc_epochs": 1, "gan_steps": 2, "num_generated": 32,
    "generator_width": 8, "disc_width": 8, "disc_hidden": [8], "hidden": [16],
    "server_batch_size": 16, "disc_batch_size": 16, "batch_size": BATCH_SIZE,
    "spc": 1, "local_epochs": 1, "head_epochs": 1, "finetune_epochs": 1,
    "personal_epochs": 1, "inner_steps": 2, "classify_every": 1, "latent_dim": 2,
}
# classes of the tiny files and generated sets (a pathological partition must cover them)
EMNIST_CLASSES = {"byclass": 62, "bymerge": 47, "balanced": 47, "letters": 26, "digits": 10,
                  "mnist": 10}
TINY_IMAGENET_WNIDS = ("n01443537", "n01629819", "n01641577", "n01644900")
CINIC10_CLASSES = ("airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse",
                   "ship", "truck")
LEAF_USERS = 4


def smoke_config(config: ExperimentConfig, data_root: str | Path,
                 algorithm_config: type | None = None) -> ExperimentConfig:
    """``config`` shrunk to a few seconds' run (module docstring); tiny publisher's files, if
    its data set needs any, are written into ``data_root``. ``algorithm_config`` is the
    algorithm's parameter dataclass (its ``config_class``), whose costly fields are lowered
    even where the configuration leaves them at their defaults."""
    tree = config.to_dict()
    tree.update(rounds=min(config.rounds, ROUNDS), eval_every=1, checkpoint_every=1)
    num_classes = _shrink_data(tree["data"], Path(data_root).resolve())
    _shrink_partition(tree["partition"], num_classes)
    _shrink_participation(tree["participation"], tree["partition"]["num_clients"] !=
                          config.partition.num_clients)
    client = tree["client"]
    client.update(steps=LOCAL_STEPS, batch_size=min(client["batch_size"], BATCH_SIZE))
    model = tree["model"]
    if model["name"] == "mlp":
        model["hidden"] = [min(h, 8) for h in model["hidden"]][:1]
    elif model["name"] == "cnn":
        model["channels"] = [min(model["channels"][0], 4), min(model["channels"][1], 8)]
    if algorithm_config is not None:
        tree["algorithm_params"] = _shrink_algorithm(tree["algorithm_params"], algorithm_config)
    return from_dict(ExperimentConfig, tree)


def _shrink_algorithm(params: dict[str, Any], cls: type) -> dict[str, Any]:
    """``params`` with each costly field of ``cls`` lowered to its limit, one field at a time,
    keeping a lowered value only where the algorithm's configuration accepts it (FedEvg's
    ``hidden`` belongs to its MLP energy model only, say)."""
    if not dataclasses.is_dataclass(cls):
        return params
    defaults = {f.name: (f.default_factory() if f.default is dataclasses.MISSING else f.default)
                for f in dataclasses.fields(cls)}
    out = dict(params)
    for name, limit in ALGORITHM_LIMITS.items():
        if name not in defaults:
            continue
        current = out.get(name, defaults[name])
        if current is None or not _larger(current, limit):
            continue
        trial = {**out, name: limit}
        try:
            from_dict(cls, trial)
        except (ConfigError, TypeError, ValueError):
            continue
        out = trial
    return out


def _larger(value: Any, limit: Any) -> bool:
    if isinstance(limit, list):
        return isinstance(value, (list, tuple)) and (len(value) > len(limit)
                                                     or sum(value) > sum(limit))
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value > limit


def _shrink_partition(partition: dict[str, Any], num_classes: int | None) -> None:
    if partition["kind"] == "natural":
        return  # the data's own clients (the tiny files have few)
    clients = min(partition["num_clients"], CLIENTS)
    if partition["kind"] == "pathological" and num_classes is not None:
        clients = max(clients, math.ceil(num_classes / partition["classes_per_client"]))
        clients = min(clients, partition["num_clients"])
    partition["num_clients"] = clients
    if partition["kind"] == "dirichlet":
        partition["alpha"] = max(partition["alpha"], MIN_DIRICHLET_ALPHA)


def _shrink_participation(participation: dict[str, Any], clients_changed: bool) -> None:
    if participation["kind"] != "full":
        participation["fraction"] = max(participation["fraction"], MIN_FRACTION)
    if participation["kind"] == "cyclic":
        participation["cycle_length"] = 2
    if clients_changed:
        participation["probabilities"] = None


def _shrink_data(data: dict[str, Any], root: Path) -> int | None:
    """Shrinks the ``data`` section in place, writing tiny files into ``root`` where the data
    set is read from files; returns the number of classes when it is known."""
    name = data["name"]
    if name in ("mnist1d", "gaussian_mixture"):
        default = 5000 if name == "mnist1d" else 3000
        data["num_samples"] = min(data["num_samples"] or default, GENERATED_SAMPLES)
        return 10 if name == "mnist1d" else data["num_classes"]
    if name == "synthetic":
        data["max_samples"] = 50
        return 10
    if name == "digits":
        return 10
    if name == "csv":
        return None
    data.update(root=str(root), download=False)
    return write_tiny_dataset(data, root)


def write_tiny_dataset(data: dict[str, Any], root: Path, seed: int = 0) -> int | None:
    """Tiny files of ``data["name"]`` in the publisher's format, in ``root``; returns the
    number of classes they hold (None for the natural clients of LEAF and heart)."""
    name = data["name"]
    rng = np.random.default_rng(seed)
    if name in ("mnist", "fashion_mnist"):
        tiny_files.write_mnist(root, num_train=120, num_test=60, seed=seed)
        return 10
    if name == "emnist":
        split = data["split"]
        classes = EMNIST_CLASSES[split]
        tiny_files.write_mnist(root, prefix=f"emnist-{split}-", test_stem="test",
                               num_train=4 * classes, num_test=2 * classes, num_classes=classes,
                               first_label=1 if split == "letters" else 0, seed=seed)
        return classes
    if name == "cifar10":
        tiny_files.write_cifar10(root, per_batch=20, num_test=40, seed=seed)
        return 10
    if name == "cifar100":
        tiny_files.write_cifar100(root, num_train=300, num_test=100, seed=seed)
        return 20 if data["coarse"] else 100
    if name == "svhn":
        parts = {"train": 100, "test": 40, **({"extra": 20} if data["extra"] else {})}
        tiny_files.write_svhn(root, parts, seed=seed)
        return 10
    if name == "cinic10":
        tiny_files.write_cinic10(root, classes=CINIC10_CLASSES, per_class=4, seed=seed)
        return len(CINIC10_CLASSES)
    if name == "tiny_imagenet":
        tiny_files.write_tiny_imagenet(root, wnids=TINY_IMAGENET_WNIDS, per_class=8, num_val=8,
                                       seed=seed)
        return len(TINY_IMAGENET_WNIDS)
    if name == "femnist":
        files = {}
        for u in range(LEAF_USERS):
            user = f"f{u:04d}"
            files[f"train/part_{u}.json"] = {user: tiny_files.femnist_user(12, rng, u)}
            files[f"test/part_{u}.json"] = {user: tiny_files.femnist_user(4, rng, u + 7)}
        tiny_files.write_leaf(root / "femnist" / "data", files)
        return None
    if name == "shakespeare":
        text = (string.ascii_letters + " .,;:!?'\n") * 4
        files = {}
        for u in range(LEAF_USERS):
            user = f"ROLE_{u}"
            start = 7 * u
            files[f"train/part_{u}.json"] = {user: tiny_files.shakespeare_user(text[start:], 12)}
            files[f"test/part_{u}.json"] = {
                user: tiny_files.shakespeare_user(text[start + 20:], 4)}
        tiny_files.write_leaf(root / "shakespeare" / "data", files)
        return None
    if name == "heart":
        tiny_files.write_heart(root, seed=seed)
        return None
    raise ConfigError(f"--smoke has no tiny files for data.name={name}")  # a new data set
