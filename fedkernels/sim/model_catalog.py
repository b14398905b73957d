"""The models ``--model.name`` builds, described without torch: source, standard input, the
options each one reads, whether it trains on the vmap path, and its parameter count.

The counts are layer arithmetic, so the help of ``model.name`` can list them without building
a model; ``python_tests/test_models_papers.py`` checks every one against ``sum(p.numel())`` of
the module :func:`fedkernels.sim.models.build_model` builds. ``docs/guide/models.md`` describes
the models in words.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

Options = Mapping[str, Any]
Shape = tuple[int, ...]

def linear(n_in: int, n_out: int, bias: bool = True) -> int:
    return n_in * n_out + (n_out if bias else 0)


def conv(c_in: int, c_out: int, kernel_area: int, bias: bool = True, groups: int = 1) -> int:
    return c_in // groups * c_out * kernel_area + (c_out if bias else 0)


def norm(channels: int, kind: str) -> int:
    """Affine weight and bias of BatchNorm/GroupNorm (running statistics are buffers)."""
    return 2 * channels if kind in ("batch", "group") else 0


def out_size(n: int, kernel: int, stride: int = 1, padding: int = 0) -> int:
    """Output length of a convolution or pooling window along one side."""
    return (n + 2 * padding - kernel) // stride + 1


def lstm(n_in: int, hidden: int, layers: int, bias: bool) -> int:
    """nn.LSTM: four gates per layer, two bias vectors per layer (b_ih and b_hh)."""
    total = 0
    for layer in range(layers):
        width = n_in if layer == 0 else hidden
        total += 4 * hidden * (width + hidden) + (8 * hidden if bias else 0)
    return total


def head(n_in: int, widths: list[int], num_classes: int, bias: bool = True) -> int:
    """Fully connected layers ``n_in -> widths... -> num_classes``."""
    total, width = 0, n_in
    for w in [*widths, num_classes]:
        total += linear(width, w, bias)
        width = w
    return total


def basic_block(c_in: int, c_out: int, stride: int, kind: str) -> int:
    """ResNet basic block: two 3x3 convs (bias-free) with norms, 1x1 projection when needed."""
    total = conv(c_in, c_out, 9, False) + norm(c_out, kind) + conv(c_out, c_out, 9, False)
    total += norm(c_out, kind)
    if stride != 1 or c_in != c_out:
        total += conv(c_in, c_out, 1, False) + norm(c_out, kind)
    return total


def vgg_features(shape: Shape, layout: list[int | str], kind: str, bias: bool) -> tuple[int, int]:
    """Parameters of VGG's conv stack and the length of its flattened output."""
    c, h, w = shape
    total = 0
    for item in layout:
        if item == "M":
            h, w = h // 2, w // 2
        else:
            total += conv(c, int(item), 9, bias) + norm(int(item), kind)
            c = int(item)
    return total, c * h * w


VGG11_LAYOUT: list[int | str] = [64, "M", 128, "M", 256, 256, "M", 512, 512, "M", 512, 512, "M"]
SUPERFED_VGG9_LAYOUT: list[int | str] = [16, "M", 32, "M", 64, 128, "M", 256, 512, "M"]
# FedAU's heads after the two conv blocks, with the dropout before each linear layer
FEDAU_HEADS = {
    "fashion_mnist": ([128], 0.0),
    "svhn": ([128], 0.0),
    "cifar10": ([256, 64], 0.0),
    "cifar100": ([512, 256], 0.2),
    "cinic10": ([512, 256], 0.2),
}
MNIST1D_CHANNELS = 25


def _features(shape: Shape) -> int:
    return math.prod(shape)


def _count_logreg(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    return linear(_features(shape), classes)


def _count_mlp(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    bn = sum(norm(h, "batch") for h in o["hidden"]) if o.get("batch_norm") else 0
    return head(_features(shape), list(o["hidden"]), classes) + bn


def _count_cnn(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    c, h, w = shape
    c1, c2 = o["channels"]
    kind = "batch" if o.get("batch_norm") else "none"
    total = conv(c, c1, 9) + norm(c1, kind) + conv(c1, c2, 9) + norm(c2, kind)
    return total + linear(c2 * (h // 4) * (w // 4), classes)


def _count_twonn(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    return head(_features(shape), [200, 200], classes)


def _count_twocnn(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    c, h, w = shape  # 5x5 convs with 'same' padding, 2x2 pools
    return conv(c, 32, 25) + conv(32, 64, 25) + head(64 * (h // 4) * (w // 4), [512], classes)


def _count_superfed_twonn(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    return head(_features(shape), [200, 200, 200], classes, bias=False)


def _count_superfed_twocnn(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    c, h, w = shape
    for _ in range(2):  # 5x5 conv with padding 1, then a 2x2 pool with padding 1
        h, w = out_size(out_size(h, 5, 1, 1), 2, 2, 1), out_size(out_size(w, 5, 1, 1), 2, 2, 1)
    convs = conv(c, 32, 25, False) + conv(32, 64, 25, False)
    return convs + head(64 * h * w, [200, 200], classes, bias=False)


def _count_superfed_vgg9(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    total, flat = vgg_features(shape, SUPERFED_VGG9_LAYOUT, "none", False)
    return total + head(flat, [256], classes, bias=False)


def _count_superfed_resnet9(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    total = conv(shape[0], 64, 9, False) + norm(64, o["norm"])
    for c_in, c_out, stride in ((64, 64, 1), (64, 128, 1), (128, 256, 2), (256, 512, 2)):
        total += basic_block(c_in, c_out, stride, o["norm"])
    return total + head(512, [256], classes, bias=False)


def _count_superfed_mobilenet(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    kind = o["norm"]
    total = conv(shape[0], 32, 9, False) + norm(32, kind)
    for c_in, c_out in ((32, 64), (64, 128), (128, 256), (256, 512)):
        total += conv(c_in, c_in, 9, False, groups=c_in) + norm(c_in, kind)
        total += conv(c_in, c_out, 1, False) + norm(c_out, kind)
    return total + head(512, [256], classes, bias=False)


def _count_fedau_cnn(variant: str) -> Callable[[Shape, int, int | None, Options], int]:
    def count(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
        c, h, w = shape
        widths, _ = FEDAU_HEADS[variant]
        return conv(c, 32, 9) + conv(32, 32, 9) + head(32 * (h // 4) * (w // 4), widths, classes)

    return count


def _count_vgg11(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    total, flat = vgg_features(shape, VGG11_LAYOUT, o["norm"], True)
    return total + head(flat, [512, 512], classes)


def _count_resnet18(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    kind = o["norm"]
    total, c_in = conv(shape[0], 64, 9, False) + norm(64, kind), 64
    for c_out, stride in ((64, 1), (128, 2), (256, 2), (512, 2)):
        total += basic_block(c_in, c_out, stride, kind) + basic_block(c_out, c_out, 1, kind)
        c_in = c_out
    return total + linear(512, classes)


def _count_fedevg_resnet10(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    c, h, w = shape
    total = conv(c, 64, 9, False) + norm(64, "group")
    for c_in, c_out, stride in ((64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2)):
        total += basic_block(c_in, c_out, stride, "group")
        h, w = out_size(h, 3, stride, 1), out_size(w, 3, stride, 1)
    return total + norm(512, "group") + linear(512 * h * w, classes)


def _count_mnist1d_cnn(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    channels, length = (1, shape[0]) if len(shape) == 1 else shape
    k = MNIST1D_CHANNELS
    length = out_size(out_size(out_size(length, 5, 2, 1), 3, 2, 1), 3, 2, 1)
    return conv(channels, k, 5) + conv(k, k, 3) + conv(k, k, 3) + linear(k * length, classes)


def _count_char_lstm(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    return (vocab or classes) * 8 + lstm(8, 256, 2, True) + linear(256, classes)


def _count_superfed_char_lstm(shape: Shape, classes: int, vocab: int | None, o: Options) -> int:
    return (vocab or classes) * 8 + lstm(8, 256, 2, False) + linear(256, classes, False)


@dataclass(frozen=True)
class ModelEntry:
    """One ``--model.name``: what it is, its standard input and its size there."""

    name: str
    summary: str  # the architecture in a few words
    source: str  # paper (and table) or code it follows
    data: str  # the data it is meant for
    shape: Shape  # standard input: (d,) features, (C, H, W) images, (C, L) signals, (T,) tokens
    classes: int
    count: Callable[[Shape, int, int | None, Options], int]
    options: tuple[str, ...] = ()  # ModelConfig fields it reads beside name
    standard: Mapping[str, Any] = field(default_factory=dict)  # those options in the count
    vocab: int | None = None  # token models: the vocabulary of the standard input
    vmap: str = "yes"  # whether (and how) it trains on the vmap path

    def parameters(
        self,
        shape: Shape | None = None,
        classes: int | None = None,
        vocab: int | None = None,
        options: Options | None = None,
    ) -> int:
        """Trainable parameters on ``shape``/``classes`` (default: the standard input)."""
        opts = {"norm": "batch", **self.standard, **(options or {})}
        return self.count(
            self.shape if shape is None else tuple(shape),
            self.classes if classes is None else classes,
            self.vocab if vocab is None else vocab,
            opts,
        )

    @property
    def input_words(self) -> str:
        dims = "x".join(map(str, self.shape))
        if self.vocab is not None:
            return f"{dims} tokens of {self.vocab}, {self.classes} classes"
        if len(self.shape) == 1:
            return f"{dims} features, {self.classes} classes"
        return f"{dims}, {self.classes} classes"


_NORM_VMAP = "with norm=group or none (BatchNorm: no)"
_ENTRIES = [
    ModelEntry("logreg", "multinomial logistic regression", "-", "any feature rows", (64,), 10,
               _count_logreg),
    ModelEntry("mlp", "ReLU MLP (model.hidden, model.batch_norm)", "-", "any feature rows",
               (64,), 10, _count_mlp, ("hidden", "batch_norm"), {"hidden": [64]},
               vmap="yes (model.batch_norm: no)"),
    ModelEntry("cnn", "two conv3x3+maxpool blocks, linear (model.channels)", "-",
               "small images (digits 8x8)", (1, 8, 8), 10, _count_cnn,
               ("channels", "batch_norm"), {"channels": [16, 32]},
               vmap="yes (model.batch_norm: no)"),
    ModelEntry("twonn", "2x200 ReLU MLP", "McMahan et al. 2017 (FedAvg), 2NN",
               "MNIST", (784,), 10, _count_twonn),
    ModelEntry("twocnn", "conv5x5 32, conv5x5 64 (2x2 max-pools), FC 512",
               "McMahan et al. 2017 (FedAvg), CNN", "MNIST, FEMNIST", (1, 28, 28), 10,
               _count_twocnn),
    ModelEntry("superfed_twonn", "3x200 ReLU MLP, bias-free, Xavier init",
               "SuPerFed (Hahn et al. 2022) code, TwoNN; Table 2.3", "MNIST", (784,), 10,
               _count_superfed_twonn),
    ModelEntry("superfed_twocnn", "conv5x5 32, conv5x5 64 (padded pools), FC 200-200, bias-free",
               "SuPerFed code, TwoCNN; Table 2.3", "CIFAR-10 at 28x28", (3, 28, 28), 10,
               _count_superfed_twocnn),
    ModelEntry("superfed_vgg9", "6 conv3x3 (16..512), 4 max-pools, FC 256, bias-free",
               "SuPerFed code, VGG9; Table 2.5", "FEMNIST", (1, 28, 28), 62, _count_superfed_vgg9),
    ModelEntry("superfed_resnet9", "ResNet-9 (stride-2 stem, max-pool, 4 blocks), FC 256",
               "SuPerFed code, ResNet9; Table 2.4", "CIFAR-100 at 28x28", (3, 28, 28), 100,
               _count_superfed_resnet9, ("norm", "groups"), vmap=_NORM_VMAP),
    ModelEntry("superfed_mobilenet", "MobileNet (4 depthwise-separable blocks), FC 256",
               "SuPerFed code, MobileNet; Table 2.4", "TinyImageNet", (3, 64, 64), 200,
               _count_superfed_mobilenet, ("norm", "groups"), vmap=_NORM_VMAP),
    ModelEntry("superfed_char_lstm", "embedding 8, 2-layer LSTM 256, bias-free",
               "SuPerFed code, NextCharLM; Table 2.5", "Shakespeare (its 100 printable characters)",
               (80,), 100, _count_superfed_char_lstm, vocab=100,
               vmap="yes (PyTorch runs the LSTM client by client)"),
    ModelEntry("fedau_cnn_fashion_mnist", "conv3x3 32 twice (max-pools), FC 128",
               "FedAU (Wang and Ji 2024) code (not in Table 1)", "Fashion-MNIST", (1, 28, 28), 10,
               _count_fedau_cnn("fashion_mnist")),
    ModelEntry("fedau_cnn_svhn", "conv3x3 32 twice (max-pools), FC 128",
               "FedAU code; Table 1", "SVHN", (3, 32, 32), 10, _count_fedau_cnn("svhn")),
    ModelEntry("fedau_cnn_cifar10", "conv3x3 32 twice (max-pools), FC 256-64",
               "FedAU code; Table 1", "CIFAR-10", (3, 32, 32), 10,
               _count_fedau_cnn("cifar10")),
    ModelEntry("fedau_cnn_cifar100", "conv3x3 32 twice (max-pools), FC 512-256, dropout 0.2",
               "FedAU code; Table 1", "CIFAR-100", (3, 32, 32), 100,
               _count_fedau_cnn("cifar100")),
    ModelEntry("fedau_cnn_cinic10", "conv3x3 32 twice (max-pools), FC 512-256, dropout 0.2",
               "FedAU code; Table 1", "CINIC-10", (3, 32, 32), 10,
               _count_fedau_cnn("cinic10")),
    ModelEntry("vgg11", "VGG-11 for 32x32 (conv3x3 64..512, 5 max-pools), FC 512-512, dropout",
               "FedGO's VGG11-BN (pytorch-vgg-cifar10)", "CIFAR-10/100", (3, 32, 32), 10,
               _count_vgg11, ("norm", "groups"), vmap=_NORM_VMAP),
    ModelEntry("resnet18", "ResNet-18 for 32x32 (3x3 stem, stride 1, no max-pool)",
               "FedGO (BatchNorm), FedAU/Semi-VRed (GroupNorm, 2 groups)", "CIFAR-10/100, CINIC-10",
               (3, 32, 32), 10, _count_resnet18, ("norm", "groups"), vmap=_NORM_VMAP),
    ModelEntry("fedevg_resnet10", "ResNet-10, GroupNorm, SiLU, spectral norm on the last layer",
               "FedEvg (Hahn, thesis ch. IV) energy network", "MNIST/CIFAR-10 at 32x32",
               (1, 32, 32), 10, _count_fedevg_resnet10,
               vmap="no (spectral norm's power iteration updates buffers)"),
    ModelEntry("mnist1d_cnn", "3 conv1d (25 channels, stride 2), linear",
               "MNIST-1D (Greydanus and Kobak 2020), ConvBase", "MNIST-1D", (1, 40), 10,
               _count_mnist1d_cnn),
    ModelEntry("char_lstm", "embedding 8, 2-layer LSTM 256, next-character head",
               "LEAF Shakespeare model (Caldas et al. 2018)", "Shakespeare (80 characters)",
               (80,), 80, _count_char_lstm, vocab=80,
               vmap="yes (PyTorch runs the LSTM client by client)"),
]

MODEL_CATALOG: dict[str, ModelEntry] = {e.name: e for e in _ENTRIES}
MODEL_NAMES: tuple[str, ...] = tuple(MODEL_CATALOG)


def model_name_help() -> str:
    """The help of ``model.name``: each model with its parameters on its standard input
    (:attr:`ModelEntry.input_words`)."""
    listed = ", ".join(f"{e.name} {e.parameters():,}" for e in MODEL_CATALOG.values())
    return f"the model (docs/guide/models.md), parameters on its standard input: {listed}"
