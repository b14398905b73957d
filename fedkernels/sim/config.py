"""Experiment configuration: plain dataclasses, one per section.

A YAML/JSON file and the CLI map onto them one to one: the file's top-level keys are the fields
of :class:`ExperimentConfig`, each section (``data``, ``partition``, ``participation``, ``model``,
``client``, ``server``) is a nested mapping, and a CLI flag ``--section.field VALUE`` sets one
field (``--rounds`` and the other top-level scalars have no section); jsonargparse derives the
flags from these classes (:mod:`fedkernels.cli.flags`). Every tree goes through
:func:`from_dict`, which converts values (strings too, as Python callers and sweeps give them)
to the field's type and rejects unknown keys; every dataclass checks its ranges in
``__post_init__``. All problems raise
:class:`ConfigError`, which the CLI reports as a usage error (exit code 2).
"""

from __future__ import annotations

import codecs
import dataclasses
import difflib
import math
import re
import reprlib
import types
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, Literal, Union, get_args, get_origin, get_type_hints

from .model_catalog import MODEL_CATALOG, MODEL_NAMES, model_name_help


class ConfigError(ValueError):
    """An invalid configuration value or combination of values."""


# A value quoted in an error is shown in at most a few hundred characters: a configuration
# file can hold a list or mapping whose YAML aliases expand it far beyond its size, and a
# message that spelled it out would take the memory and time the file did not.
_SHOWN = reprlib.Repr()  # (keyword arguments only from Python 3.12)
_SHOWN.maxlevel = 3
_SHOWN.maxtuple = _SHOWN.maxlist = _SHOWN.maxarray = _SHOWN.maxdict = 6
_SHOWN.maxset = _SHOWN.maxfrozenset = _SHOWN.maxdeque = 6
_SHOWN.maxstring, _SHOWN.maxlong, _SHOWN.maxother = 80, 40, 80


def show(value: Any) -> str:
    """``repr(value)``, bounded in length whatever the value (for error messages)."""
    return _SHOWN.repr(value)


def show_key(key: Any) -> str:
    """A mapping key for an error message: a string as it is, up to a bounded length."""
    if isinstance(key, str) and len(key) <= 80:
        return key
    return show(key)


def _require(condition: bool, message: str) -> None:
    if not condition:
        raise ConfigError(message)


def _require_finite(config: Any, section: str) -> None:
    """Rejects NaN and infinity in every float field (and list of floats) of ``config``: no
    field of these configurations has a meaning for them, and letting one through only shows
    up as NaN in ``results.json`` rounds later."""
    for f in dataclasses.fields(config):
        value = getattr(config, f.name)
        values = value if isinstance(value, (list, tuple)) else [value]
        for v in values:
            _require(
                not isinstance(v, float) or math.isfinite(v),
                f"{section}.{f.name} must be a finite number, got {show(value)}",
            )


# DataConfig's fields that only data.name=csv reads
CSV_FIELDS = ("path", "delimiter", "decimal", "encoding", "label_column", "client_column",
              "label_map", "positive_labels", "categorical_columns", "ignore_columns",
              "standardize")


def _default(f: dataclasses.Field) -> Any:
    return f.default_factory() if f.default is dataclasses.MISSING else f.default


def _refuse_inapplicable(config: Any, section: str) -> None:
    """Refuses a field set (away from its default) where nothing reads it: such a setting was
    silently ignored, and the run was not the one asked for."""
    for name, where in config.inapplicable().items():
        f = next(f for f in dataclasses.fields(config) if f.name == name)
        _require(getattr(config, name) == _default(f),
                 f"{section}.{name} is read only with {where}: leave it out, or choose that "
                 "setting")


def unread_settings(config: ExperimentConfig, tree: Mapping[str, Any]) -> list[str]:
    """The settings ``tree`` (a configuration file's or the flags' tree) gives that ``config``
    leaves unread, each as a sentence: ``partition.alpha`` of an iid partition. The data set's
    and the model's own options are refused outright; these depend on a switch of their section
    (partition.kind, server.optimizer, ...), which a sweep may vary with the setting left in."""
    out = []
    for section in SECTIONS:
        given = tree.get(section)
        if not isinstance(given, Mapping):
            continue
        for name, where in getattr(config, section).inapplicable().items():
            if name in given:
                out.append(f"{section}.{name} is read only with {where}, so it has no effect")
    return out


def applicable_dict(config: ExperimentConfig) -> dict[str, Any]:
    """``config`` as a tree of the fields that apply to it: each section without the fields
    its other settings leave unread (a digits run lists no CSV or synthetic-data fields). Read
    back with :func:`from_dict`, it gives the same run: what was left out is read by nothing."""
    tree = config.to_dict()
    for section in SECTIONS:
        for name in getattr(config, section).inapplicable():
            tree[section].pop(name, None)
    return tree


# data.delimiter's spellings and the characters they name; data.decimal's marks (the CSV
# reader, fedkernels.sim.tabular, checks them again for load_csv called without a config).
CSV_DELIMITERS = {",": ",", ";": ";", "tab": "\t", "\t": "\t", "|": "|"}
CSV_DECIMAL_MARKS = (".", ",")


def known_encoding(name: str) -> bool:
    """Whether Python has a text codec of this name (data.encoding)."""
    try:
        codecs.lookup(name)
    except LookupError:
        return False
    return True


# data sets read from the publisher's files in data.root
FILE_DATASETS = ("mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "svhn", "cinic10",
                 "tiny_imagenet", "femnist", "shakespeare")
# DataConfig's fields that only some data sets read (CSV's are checked apart, CSV_FIELDS)
DATASET_OPTIONS = {
    "root": (*FILE_DATASETS, "heart"),
    "download": ("mnist", "fashion_mnist", "emnist", "cifar10", "cifar100", "svhn"),
    "split": ("emnist",),
    "coarse": ("cifar100",),
    "extra": ("svhn",),
    "official_split": (*FILE_DATASETS, "mnist1d"),
    "num_samples": ("gaussian_mixture", "mnist1d"),
}


# DataConfig's fields that only one generated data set reads
DATASET_GENERATORS = {
    "synthetic": ("alpha", "beta", "iid", "max_samples"),
    "gaussian_mixture": ("num_features", "num_classes", "separation"),
}


DEVICE_NAME = re.compile(r"cpu|auto|cuda(:\d+)?")


def check_device_name(value: Any) -> None:
    """Raises :class:`ConfigError` unless ``value`` is ``cpu``, ``cuda``, ``cuda:N`` or
    ``auto`` (whether the device exists is :func:`fedkernels.sim.devices.resolve_device`'s
    question)."""
    _require(isinstance(value, str) and DEVICE_NAME.fullmatch(value) is not None,
             f"device must be cpu, cuda, cuda:N or auto, got {show(value)}")


def _field(default: Any, help: str) -> Any:  # noqa: A002  (the argparse word)
    if isinstance(default, (list, dict)):
        return field(default_factory=lambda: type(default)(default), metadata={"help": help})
    return field(default=default, metadata={"help": help})


@dataclass
class DataConfig:
    """Where the samples come from (:mod:`fedkernels.sim.data`)."""

    name: Literal[
        "digits", "synthetic", "gaussian_mixture", "csv", "mnist", "fashion_mnist", "emnist",
        "cifar10", "cifar100", "svhn", "cinic10", "tiny_imagenet", "femnist", "shakespeare",
        "mnist1d", "heart",
    ] = _field(
        "digits",
        "data set: built-in, a CSV file, or a publisher's (docs/guide/datasets.md)",
    )
    test_fraction: float = _field(
        0.2, "fraction of each client's samples held out for its test split"
    )
    root: str | None = _field(None, "folder of the publisher's files")
    download: bool = _field(False, "fetch missing files with torchvision (not for all sets)")
    split: Literal["byclass", "bymerge", "balanced", "letters", "digits", "mnist"] = _field(
        "byclass", "emnist: the split"
    )
    coarse: bool = _field(False, "cifar100: the 20 superclasses")
    extra: bool = _field(False, "svhn: add extra_32x32.mat to training")
    official_split: bool = _field(
        False, "clients' test rows are their rows of the publisher's test set"
    )
    stratify: bool | None = _field(None, "stratify test splits by label (default: heart)")
    alpha: float = _field(1.0, "synthetic: spread of the per-client models (u_k ~ N(0, alpha))")
    beta: float = _field(1.0, "synthetic: spread of the per-client input means (B_k ~ N(0, beta))")
    iid: bool = _field(
        False, "synthetic: one shared model and input distribution (the IID variant)"
    )
    max_samples: int = _field(2000, "synthetic: cap on the log-normal number of samples per user")
    num_samples: int | None = _field(
        None, "gaussian_mixture, mnist1d: number of samples (default: 3000, 5000)"
    )
    num_features: int = _field(10, "gaussian_mixture: dimension")
    num_classes: int = _field(5, "gaussian_mixture: number of classes (one Gaussian each)")
    separation: float = _field(2.0, "gaussian_mixture: scale of the class means (unit noise)")
    path: str | None = _field(None, "csv: path of the file (header row required)")
    delimiter: str | None = _field(
        None,
        "csv: the character between fields: ',', ';', 'tab' or '|' (default: tab for a .tsv "
        "file, else ',')",
    )
    decimal: str = _field(
        ".",
        "csv: the decimal mark of numbers: '.', or ',' to read numbers as spreadsheets in "
        "decimal-comma locales write them (3,5 and 1.234,5)",
    )
    encoding: str = _field(
        "utf-8", "csv: the file's text encoding (cp1252 for a Windows Excel export, latin-1)"
    )
    label_column: str = _field("label", "csv: name of the label column")
    client_column: str | None = _field(
        None,
        "csv: name of the column that says which client a row belongs to; only "
        "partition.kind=natural needs it, and there it defaults to 'client' (other partitions "
        "ignore it, but a named column is kept out of the features)",
    )
    label_map: str | None = _field(
        None, "csv: label value -> class, e.g. 'benign=0,malignant=1' (default: sorted values)"
    )
    positive_labels: list[Any] | None = _field(
        None, "csv: these label values are class 1, every other value class 0, e.g. 1,2,3,4"
    )
    categorical_columns: list[str] | None = _field(
        None, "csv: read these columns as categories even where their values are numbers"
    )
    ignore_columns: list[str] | None = _field(
        None, "csv: columns left out of the features (identifiers, free text)"
    )
    standardize: bool = _field(
        True, "csv: scale numeric features by the training rows' mean and standard deviation"
    )
    server_fraction: float = _field(
        0.0,
        "fraction of each class held out as the server's unlabeled data (ensemble "
        "distillation; 0: none)",
    )
    label_noise: Literal["none", "symmetric", "pair"] = _field(
        "none",
        "noise on the clients' training labels (test labels stay clean): symmetric (a flipped "
        "label becomes any other class, uniformly) or pair (class c becomes c+1 mod C)",
    )
    noise_rate: float = _field(
        0.0, "label_noise: probability that a training label is flipped (SuPerFed: 0.1-0.6)"
    )

    def __post_init__(self) -> None:
        _require_finite(self, "data")
        _require(0.0 < self.test_fraction < 1.0, "data.test_fraction must be in (0, 1)")
        _require(0.0 <= self.server_fraction < 1.0, "data.server_fraction must be in [0, 1)")
        _require(self.alpha >= 0 and self.beta >= 0, "data.alpha and data.beta must be >= 0")
        _require(self.max_samples >= 50, "data.max_samples must be >= 50 (the generator's minimum)")
        _require(self.num_samples is None or self.num_samples >= 2,
                 "data.num_samples must be >= 2")
        _require(self.name not in FILE_DATASETS or bool(self.root),
                 f"data.name={self.name} needs data.root, the folder holding its files")
        default_fraction = _default(DATA_FIELDS["test_fraction"])
        _require(not self.official_split or self.test_fraction == default_fraction,
                 "data.test_fraction is not read with data.official_split (the publisher's "
                 "split decides the test rows): leave one of them out")
        for option, names in DATASET_OPTIONS.items():
            value, default = getattr(self, option), _default(DATA_FIELDS[option])
            _require(value == default or self.name in names,
                     f"data.{option} is a setting of {', '.join(names)}, but data.name is "
                     f"{show(self.name)}: leave it out, or choose one of those data sets")
        _require(self.num_features >= 1, "data.num_features must be >= 1")
        _require(self.num_classes >= 2, "data.num_classes must be >= 2")
        _require(self.separation >= 0, "data.separation must be >= 0")
        _require(self.name != "csv" or bool(self.path), "data.name=csv needs data.path")
        _require(self.name != "heart" or bool(self.root),
                 "data.name=heart needs data.root, the folder holding the UCI files "
                 "(processed.cleveland.data, ...) or heart_disease_uci.csv")
        if self.name != "csv":
            # a CSV setting is read by nothing else: without data.name=csv the run would
            # quietly train on the built-in data set instead of the file named
            given = [f.name for f in dataclasses.fields(self)
                     if f.name in CSV_FIELDS and getattr(self, f.name) != _default(f)]
            _require(not given, f"data.{given[0] if given else ''} is a setting of CSV data, but "
                     f"data.name is {show(self.name)}: add --data.name csv (data.name: csv in a "
                     "configuration file) to read the file, or leave the setting out")
        _require(self.delimiter is None or self.delimiter in CSV_DELIMITERS,
                 f"data.delimiter must be one of ',', ';', 'tab' or '|', got {show(self.delimiter)}")
        _require(self.decimal in CSV_DECIMAL_MARKS, f"data.decimal must be '.' or ',', got "
                 f"{show(self.decimal)}")
        _require(known_encoding(self.encoding), f"data.encoding: unknown text encoding "
                 f"{show(self.encoding)} (e.g. utf-8, cp1252, latin-1)")
        _require(0.0 <= self.noise_rate < 1.0, "data.noise_rate must be in [0, 1)")
        _require(
            self.label_noise != "none" or self.noise_rate == 0.0,
            "data.noise_rate needs data.label_noise (symmetric or pair)",
        )
        _refuse_inapplicable(self, "data")

    def inapplicable(self) -> dict[str, str]:
        """The fields this data set does not read, each with where it applies."""
        out: dict[str, str] = {}
        if self.name != "csv":
            out.update(dict.fromkeys(CSV_FIELDS, "data.name=csv"))
        for option, names in DATASET_OPTIONS.items():
            if self.name not in names:
                out[option] = f"data.name in ({', '.join(names)})"
        for group, names in DATASET_GENERATORS.items():
            if self.name != group:
                out.update(dict.fromkeys(names, f"data.name={group}"))
        if self.label_noise == "none":
            out["noise_rate"] = "data.label_noise symmetric or pair"
        if self.official_split:
            out["test_fraction"] = "data.official_split false"
        return out


DATA_FIELDS = {f.name: f for f in dataclasses.fields(DataConfig)}


@dataclass
class PartitionConfig:
    """How the pooled samples are split among clients (:mod:`fedkernels.sim.partition`)."""

    kind: Literal["iid", "dirichlet", "pathological", "natural"] = _field(
        "iid",
        "iid; dirichlet label skew; pathological (classes_per_client labels each); "
        "natural (the data's own client column/users)",
    )
    num_clients: int = _field(10, "number of clients N (synthetic: number of generated users)")
    alpha: float = _field(0.5, "dirichlet: concentration; smaller is more skewed")
    classes_per_client: int = _field(2, "pathological: distinct labels per client")
    min_samples: int = _field(2, "minimum samples per client (train + test)")

    def __post_init__(self) -> None:
        _require_finite(self, "partition")
        _require(self.num_clients >= 1, "partition.num_clients must be >= 1")
        _require(self.alpha > 0, "partition.alpha must be > 0")
        _require(self.classes_per_client >= 1, "partition.classes_per_client must be >= 1")
        _require(self.min_samples >= 2, "partition.min_samples must be >= 2 (one train, one test)")

    def inapplicable(self) -> dict[str, str]:
        out = {}
        if self.kind != "dirichlet":
            out["alpha"] = "partition.kind=dirichlet"
        if self.kind != "pathological":
            out["classes_per_client"] = "partition.kind=pathological"
        return out


@dataclass
class ParticipationConfig:
    """Which clients take part in each round (:mod:`fedkernels.sim.participation`)."""

    kind: Literal["full", "uniform", "bernoulli", "markov", "cyclic"] = _field(
        "full",
        "full; uniform sample of a fraction; independent Bernoulli(p_n); Markov on/off; "
        "cyclic on/off",
    )
    fraction: float = _field(
        0.1, "uniform: fraction C of clients per round; bernoulli/markov/cyclic: mean p_n"
    )
    probability_model: Literal["constant", "label_correlated"] = _field(
        "constant",
        "p_n = fraction for all, or FedAU's data-correlated p_n = "
        "clip(C * fraction * <kappa_n, q>, min_probability, 1)",
    )
    probabilities: list[float] | None = _field(
        None, "explicit p_n, one per client (overrides the model)"
    )
    min_probability: float = _field(0.02, "label_correlated: lower clip p_min")
    label_concentration: float = _field(0.1, "label_correlated: q ~ Dirichlet(concentration)")
    markov_delta: float = _field(0.05, "markov: largest probability of switching to active")
    cycle_length: int = _field(100, "cyclic: rounds per on/off cycle")

    def __post_init__(self) -> None:
        _require_finite(self, "participation")
        _require(0.0 < self.fraction <= 1.0, "participation.fraction must be in (0, 1]")
        _require(
            0.0 <= self.min_probability <= 1.0, "participation.min_probability must be in [0, 1]"
        )
        _require(self.label_concentration > 0, "participation.label_concentration must be > 0")
        _require(0.0 < self.markov_delta <= 1.0, "participation.markov_delta must be in (0, 1]")
        _require(self.cycle_length >= 2, "participation.cycle_length must be >= 2")
        if self.probabilities is not None:
            _require(
                all(0.0 <= p <= 1.0 for p in self.probabilities),
                "participation.probabilities must all be in [0, 1]",
            )

    def inapplicable(self) -> dict[str, str]:
        out = {}
        probabilistic = self.kind in ("bernoulli", "markov", "cyclic")
        if not probabilistic:
            out.update(dict.fromkeys(("probability_model", "probabilities"),
                                     "participation.kind bernoulli, markov or cyclic"))
        if self.kind == "full" or (probabilistic and self.probabilities is not None):
            out["fraction"] = ("participation.kind uniform, or bernoulli, markov or cyclic "
                               "without participation.probabilities")
        if not probabilistic or self.probability_model != "label_correlated" \
                or self.probabilities is not None:
            out.update(dict.fromkeys(("min_probability", "label_concentration"),
                                     "participation.probability_model=label_correlated"))
        if self.kind != "markov":
            out["markov_delta"] = "participation.kind=markov"
        if self.kind != "cyclic":
            out["cycle_length"] = "participation.kind=cyclic"
        return out


@dataclass
class ModelConfig:
    """The model every client trains (:mod:`fedkernels.sim.models`; the models, with their
    sources and sizes, are :mod:`fedkernels.sim.model_catalog`)."""

    name: Literal[MODEL_NAMES] = _field("mlp", model_name_help())
    hidden: list[int] = _field([64], "mlp: hidden layer widths")
    channels: list[int] = _field([16, 32], "cnn: channels of the two conv blocks")
    batch_norm: bool = _field(False, "mlp/cnn: BatchNorm after each hidden layer")
    norm: Literal["batch", "group", "none"] = _field(
        "batch", "norm after each conv: resnet18, vgg11, superfed_resnet9, _mobilenet"
    )
    groups: int = _field(2, "norm=group: groups of each GroupNorm")

    def __post_init__(self) -> None:
        _require(all(h >= 1 for h in self.hidden), "model.hidden widths must be >= 1")
        _require(
            len(self.channels) == 2 and all(c >= 1 for c in self.channels),
            "model.channels must be two positive numbers",
        )
        _require(self.groups >= 1, "model.groups must be >= 1")
        entry = MODEL_CATALOG[self.name]
        for f in dataclasses.fields(self):
            if f.name == "name" or f.name in entry.options or getattr(self, f.name) == _default(f):
                continue
            reads = ", ".join(f"model.{o}" for o in entry.options) or "no other model option"
            raise ConfigError(f"model.{f.name} is not a setting of model.name={self.name} (it "
                              f"reads {reads}): leave it out, or choose a model that reads it")
        _require(self.groups == _default(MODEL_FIELDS["groups"]) or self.norm == "group",
                 "model.groups is read only with model.norm=group")

    def inapplicable(self) -> dict[str, str]:
        reads = MODEL_CATALOG[self.name].options
        out = {f.name: f"a model that reads it (model.name={self.name} does not)"
               for f in dataclasses.fields(self) if f.name != "name" and f.name not in reads}
        if "groups" in reads and self.norm != "group":
            out["groups"] = "model.norm=group"
        return out


MODEL_FIELDS = {f.name: f for f in dataclasses.fields(ModelConfig)}
AUGMENTATIONS = ("none", "crop_flip", "crop", "flip")


@dataclass
class ClientConfig:
    """Local training (:mod:`fedkernels.sim.client`)."""

    epochs: int = _field(1, "local epochs (ignored when steps is set)")
    steps: int | None = _field(None, "local SGD steps per round (instead of epochs)")
    batch_size: int = _field(16, "minibatch size")
    lr: float = _field(0.1, "local learning rate (round 0)")
    lr_decay: float = _field(1.0, "per-round factor: lr_t = lr * lr_decay**t")
    momentum: float = _field(0.0, "SGD momentum")
    weight_decay: float = _field(0.0, "SGD weight decay (L2)")
    augment: Literal[AUGMENTATIONS] = _field(
        "none", "training images, on device: random crop (4-pixel pad) and/or flip"
    )

    def __post_init__(self) -> None:
        _require_finite(self, "client")
        _require(self.epochs >= 1, "client.epochs must be >= 1")
        _require(self.steps is None or self.steps >= 1, "client.steps must be >= 1")
        _require(self.batch_size >= 1, "client.batch_size must be >= 1")
        _require(self.lr > 0, "client.lr must be > 0")
        _require(0 < self.lr_decay <= 1, "client.lr_decay must be in (0, 1]")
        _require(0 <= self.momentum < 1, "client.momentum must be in [0, 1)")
        _require(self.weight_decay >= 0, "client.weight_decay must be >= 0")

    def inapplicable(self) -> dict[str, str]:
        # steps replaces epochs (steps: null says that epochs count)
        return {"epochs": "client.steps unset"} if self.steps is not None else {}


DEFAULT_SERVER_LR = {"sgd": 1.0, "fedavgm": 1.0, "fedadam": 0.1, "fedyogi": 0.01, "fedadagrad": 0.1}


@dataclass
class ServerConfig:
    """The server step on the pseudo-gradient (:mod:`fedkernels.sim.server`)."""

    optimizer: Literal["sgd", "fedavgm", "fedadam", "fedyogi", "fedadagrad"] = _field(
        "sgd", "server optimizer on the aggregated update (sgd with lr 1 is plain FedAvg)"
    )
    lr: float | None = _field(
        None,
        "server learning rate eta (default: 1 for sgd/fedavgm, 0.1 fedadam/fedadagrad, "
        "0.01 fedyogi)",
    )
    momentum: float = _field(0.9, "fedavgm: server momentum")
    beta1: float = _field(0.9, "fedadam/fedyogi: first-moment decay")
    beta2: float = _field(0.99, "fedadam/fedyogi: second-moment decay")
    tau: float = _field(1e-3, "fedadam/fedyogi/fedadagrad: adaptivity epsilon")

    def __post_init__(self) -> None:
        _require_finite(self, "server")
        _require(self.lr is None or self.lr > 0, "server.lr must be > 0")
        _require(0 <= self.momentum < 1, "server.momentum must be in [0, 1)")
        _require(
            0 <= self.beta1 < 1 and 0 <= self.beta2 < 1, "server.beta1/beta2 must be in [0, 1)"
        )
        _require(self.tau > 0, "server.tau must be > 0")

    def inapplicable(self) -> dict[str, str]:
        readers = {"momentum": ("fedavgm",), "beta1": ("fedadam", "fedyogi"),
                   "beta2": ("fedadam", "fedyogi"), "tau": ("fedadam", "fedyogi", "fedadagrad")}
        return {name: f"server.optimizer {' or '.join(names)}"
                for name, names in readers.items() if self.optimizer not in names}

    @property
    def learning_rate(self) -> float:
        """``lr``, or the optimizer's default when it is not set."""
        return DEFAULT_SERVER_LR[self.optimizer] if self.lr is None else self.lr


@dataclass
class AttackConfig:
    """Byzantine clients (:mod:`fedkernels.sim.attacks`)."""

    kind: Literal["none", "signflip", "gaussian", "labelflip", "scale"] = _field(
        "none",
        "what the Byzantine clients do: signflip (reply x - scale*(x_k - x)), gaussian (reply "
        "x + N(0, std^2)), labelflip (train on label C-1-y), scale (reply x + scale*(x_k - x))",
    )
    fraction: float = _field(
        0.2, "fraction of the clients that are Byzantine (a seeded choice of round(fraction*N))"
    )
    scale: float = _field(10.0, "signflip/scale: factor on the honest update x_k - x")
    std: float = _field(1.0, "gaussian: standard deviation of the reply's noise")

    def __post_init__(self) -> None:
        _require_finite(self, "attack")
        _require(0.0 <= self.fraction <= 1.0, "attack.fraction must be in [0, 1]")
        _require(self.scale > 0, "attack.scale must be > 0")
        _require(self.std > 0, "attack.std must be > 0")

    def inapplicable(self) -> dict[str, str]:
        out = {}
        if self.kind == "none":
            out["fraction"] = "an attack.kind"
        if self.kind not in ("signflip", "scale"):
            out["scale"] = "attack.kind signflip or scale"
        if self.kind != "gaussian":
            out["std"] = "attack.kind=gaussian"
        return out


@dataclass
class PrivacyConfig:
    """Server-side central differential privacy (:mod:`fedkernels.sim.central_dp`)."""

    clip: float | None = _field(
        None,
        "L2 bound C on each client's update x_k - x; setting it turns central DP on "
        "(default: off; with dp.adaptive the initial C, 0.1)",
    )
    noise_multiplier: float = _field(
        0.0, "sigma: Gaussian noise of std sigma*C/K on the mean of the K clipped updates"
    )
    adaptive: bool = _field(
        False, "adapt C each round towards the target quantile of the update norms"
    )
    target_quantile: float = _field(0.5, "adaptive: fraction of updates meant to stay unclipped")
    clip_lr: float = _field(0.2, "adaptive: learning rate of the geometric clip update")
    clipped_count_stddev: float | None = _field(
        None, "adaptive: noise std of the count of clipped updates (default: K/20)"
    )
    delta: float | None = _field(None, "delta of the reported (epsilon, delta) (default: 1/N)")
    accountant: Literal["rdp", "pld"] = _field(
        "rdp", "privacy accountant of dp-accounting (extra fedkernels[dp]) for epsilon"
    )

    def __post_init__(self) -> None:
        _require_finite(self, "dp")
        _require(self.clip is None or self.clip > 0, "dp.clip must be > 0")
        _require(self.noise_multiplier >= 0, "dp.noise_multiplier must be >= 0")
        _require(
            self.clip is not None or self.adaptive or self.noise_multiplier == 0,
            "dp.noise_multiplier needs dp.clip (or dp.adaptive): the noise is scaled by the "
            "clipping bound",
        )
        _require(0.0 <= self.target_quantile <= 1.0, "dp.target_quantile must be in [0, 1]")
        _require(self.clip_lr > 0, "dp.clip_lr must be > 0")
        _require(
            self.clipped_count_stddev is None or self.clipped_count_stddev >= 0,
            "dp.clipped_count_stddev must be >= 0",
        )
        _require(self.delta is None or 0 < self.delta < 1, "dp.delta must be in (0, 1)")

    def inapplicable(self) -> dict[str, str]:
        out = {}
        if not self.enabled:
            out.update(dict.fromkeys(("noise_multiplier", "delta", "accountant"),
                                     "central DP on (dp.clip or dp.adaptive)"))
        if not self.adaptive:
            out.update(dict.fromkeys(("target_quantile", "clip_lr", "clipped_count_stddev"),
                                     "dp.adaptive"))
        return out

    @property
    def enabled(self) -> bool:
        """Whether updates are clipped (and noised) at all."""
        return self.clip is not None or self.adaptive


@dataclass
class ExperimentConfig:
    """One federated experiment: everything ``fedkernels run`` needs."""

    algorithm: str = _field("fedavg", "algorithm (strategy) from fedkernels.algorithms")
    algorithm_params: dict[str, Any] = _field({}, "the algorithm's own parameters")
    rounds: int = _field(50, "communication rounds")
    seed: int = _field(0, "seed of every random stream (data, partition, sampling, training)")
    eval_every: int = _field(1, "evaluate every this many rounds (and after the last)")
    checkpoint_every: int = _field(1, "write the resume checkpoint every this many rounds")
    vmap: bool = _field(False, "train a round's clients at once with torch.func.vmap")
    device: str = _field(
        "cpu",
        "where the whole run computes: cpu, cuda, cuda:N, or auto (a GPU if one is visible)",
    )
    data: DataConfig = field(default_factory=DataConfig)
    partition: PartitionConfig = field(default_factory=PartitionConfig)
    participation: ParticipationConfig = field(default_factory=ParticipationConfig)
    model: ModelConfig = field(default_factory=ModelConfig)
    client: ClientConfig = field(default_factory=ClientConfig)
    server: ServerConfig = field(default_factory=ServerConfig)
    attack: AttackConfig = field(default_factory=AttackConfig)
    dp: PrivacyConfig = field(default_factory=PrivacyConfig)

    def __post_init__(self) -> None:
        _require(self.rounds >= 1, "rounds must be >= 1")
        _require(self.eval_every >= 1, "eval_every must be >= 1")
        _require(self.checkpoint_every >= 1, "checkpoint_every must be >= 1")
        _require(self.seed >= 0, "seed must be >= 0")
        check_device_name(self.device)
        if (
            self.data.name == "csv"
            and self.partition.kind == "natural"
            and self.data.client_column is None
        ):
            # the natural partition needs a client column; 'client' is the conventional name
            self.data = dataclasses.replace(self.data, client_column="client")
        probs = self.participation.probabilities
        _require(
            probs is None
            or len(probs) == self.partition.num_clients
            or self.partition.kind == "natural",
            "participation.probabilities needs one value per client (partition.num_clients)",
        )
        _require(not (self.model.batch_norm and self.client.batch_size < 2),
                 "model.batch_norm needs client.batch_size >= 2 (BatchNorm normalises over the "
                 "rows of a batch)")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


SECTIONS = ("data", "partition", "participation", "model", "client", "server", "attack", "dp")

_TRUE = {"true", "yes", "on", "1"}
_FALSE = {"false", "no", "off", "0"}
_NONE = {"none", "null", "~", ""}


def convert(value: Any, tp: Any, where: str) -> Any:
    """Converts ``value`` (a YAML/JSON value or a string, as Python callers and sweeps give
    them) to the type ``tp``; ``where`` names the key in the error."""
    origin = get_origin(tp)
    if tp is Any:
        return value
    if origin is Literal:
        choices = get_args(tp)
        if value not in choices:
            close = difflib.get_close_matches(str(value), list(map(str, choices)), n=1)
            hint = f"; did you mean {close[0]}?" if close else ""
            raise ConfigError(f"{where}: {show(value)} is not one of: "
                              f"{', '.join(map(str, choices))}{hint}")
        return value
    if origin in (Union, types.UnionType):
        args = [a for a in get_args(tp) if a is not type(None)]
        if value is None or (isinstance(value, str) and value.lower() in _NONE):
            _require(len(args) < len(get_args(tp)), f"{where}: a value is required")
            return None
        return convert(value, args[0], where)
    if tp is bool:
        if isinstance(value, bool):
            return value
        if type(value) is int and value in (0, 1):  # YAML/JSON 1 and 0, as the flag's "1"/"0"
            return bool(value)
        if isinstance(value, str) and value.lower() in _TRUE | _FALSE:
            return value.lower() in _TRUE
        raise ConfigError(f"{where}: expected true or false, got {show(value)}")
    if tp is int:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected an integer, got {show(value)}")
        if isinstance(value, int):
            number = value
        elif isinstance(value, float) and value.is_integer():
            number = int(value)
        else:
            if isinstance(value, (Mapping, list, tuple, set)):  # str() would spell it all out
                raise ConfigError(f"{where}: expected an integer, got {show(value)}")
            try:
                number = int(str(value))
            except ValueError:
                raise ConfigError(f"{where}: expected an integer, got {show(value)}") from None
        # every count, size and seed is a 64-bit integer in NumPy and torch
        _require(-(2**63) <= number < 2**63,
                 f"{where}: {show(value)} is beyond the 64-bit integer range")
        return number
    if tp is float:
        if isinstance(value, bool):
            raise ConfigError(f"{where}: expected a number, got {show(value)}")
        try:
            number = float(value)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: expected a number, got {show(value)}") from None
        # no configuration value means anything as NaN or infinity (algorithms' included)
        _require(math.isfinite(number), f"{where}: expected a finite number, got {show(value)}")
        return number
    if tp is str:
        _require(isinstance(value, str), f"{where}: expected a string, got {show(value)}")
        return value
    if origin is list:
        (item,) = get_args(tp)
        if isinstance(value, str):
            # spaces inside a value belong to it ("heart disease"), only those around it go
            value = [v.strip() for v in value.split(",") if v.strip()]
        elif isinstance(value, (int, float)) and not isinstance(value, bool):
            value = [value]  # YAML's 'hidden: 64', as the flag's '--model.hidden 64'
        _require(isinstance(value, (list, tuple)), f"{where}: expected a list, got {show(value)}")
        return [convert(v, item, f"{where}[{i}]") for i, v in enumerate(value)]
    if origin is dict:
        _require(isinstance(value, Mapping), f"{where}: expected a mapping, got {show(value)}")
        return dict(value)
    if dataclasses.is_dataclass(tp):
        return from_dict(tp, value, where)
    raise TypeError(f"{where}: unsupported field type {tp!r}")  # a bug in a config class


T = typing.TypeVar("T")


def from_dict(cls: type[T], data: Any, where: str = "") -> T:
    """Builds the dataclass ``cls`` from a mapping, converting and checking every value.

    Unknown keys and wrong types raise :class:`ConfigError` naming the key, e.g.
    ``partition.alpha: expected a number, got 'x'``.
    """
    section = where or cls.__name__
    _require(isinstance(data, Mapping), f"{section}: expected a mapping, got {show(data)}")
    hints = get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    prefix = f"{where}." if where else ""
    unknown = [k for k in data if k not in names]
    if unknown:
        raise ConfigError(f"unknown key {prefix}{show_key(unknown[0])} (valid: {', '.join(names)})")
    kwargs = {k: convert(v, hints[k], f"{prefix}{k}") for k, v in data.items()}
    return cls(**kwargs)


def field_types(cls: type) -> dict[str, Any]:
    """The resolved type of each field of a config dataclass (for the CLI's flags)."""
    return get_type_hints(cls)


def set_dotted(tree: dict[str, Any], dotted: str, value: Any) -> None:
    """``set_dotted(d, "partition.alpha", "0.3")`` sets ``d["partition"]["alpha"]``."""
    *parents, leaf = dotted.split(".")
    node = tree
    for key in parents:
        node = node.setdefault(key, {})
        _require(isinstance(node, dict), f"{dotted}: {key} is not a section")
    node[leaf] = value
