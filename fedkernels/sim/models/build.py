"""``build_model``: the module ``--model.name`` names (the list, with sources and sizes, is
:mod:`fedkernels.sim.model_catalog`)."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import nn

from .. import seeding
from ..config import ConfigError, ModelConfig
from .basic import MLP, LogisticRegression, SmallCNN
from .convnets import FedAUCNN, SuPerFedTwoCNN, SuPerFedTwoNN, TwoCNN, TwoNN
from .energy import FedEvgResNet10
from .resnet import ResNet18, SuPerFedMobileNet, SuPerFedResNet9
from .sequence import CharLSTM
from .signal import MNIST1DCNN
from .vgg import VGG11, SuPerFedVGG9

Shape = tuple[int, ...] | None
Builder = Callable[[ModelConfig, int, int, Shape, int], nn.Module]


def _cnn(c: ModelConfig, d: int, k: int, shape: Shape, vocab: int) -> nn.Module:
    if shape is None:
        raise ConfigError("model.name=cnn needs image data (digits, or tensors with an image shape)")
    return SmallCNN(shape, k, c.channels, c.batch_norm)


def _fedau(variant: str) -> Builder:
    return lambda c, d, k, shape, vocab: FedAUCNN(variant, shape, k)


BUILDERS: dict[str, Builder] = {
    "logreg": lambda c, d, k, shape, vocab: LogisticRegression(d, k),
    "mlp": lambda c, d, k, shape, vocab: MLP(d, c.hidden, k, c.batch_norm),
    "cnn": _cnn,
    "twonn": lambda c, d, k, shape, vocab: TwoNN(d, k),
    "twocnn": lambda c, d, k, shape, vocab: TwoCNN(shape, k),
    "superfed_twonn": lambda c, d, k, shape, vocab: SuPerFedTwoNN(d, k),
    "superfed_twocnn": lambda c, d, k, shape, vocab: SuPerFedTwoCNN(shape, k),
    "superfed_vgg9": lambda c, d, k, shape, vocab: SuPerFedVGG9(shape, k),
    "superfed_resnet9": lambda c, d, k, shape, vocab: SuPerFedResNet9(shape, k, c.norm, c.groups),
    "superfed_mobilenet": lambda c, d, k, shape, vocab: SuPerFedMobileNet(shape, k, c.norm,
                                                                          c.groups),
    "superfed_char_lstm": lambda c, d, k, shape, vocab: CharLSTM(vocab, k, bias=False),
    "fedau_cnn_fashion_mnist": _fedau("fashion_mnist"),
    "fedau_cnn_svhn": _fedau("svhn"),
    "fedau_cnn_cifar10": _fedau("cifar10"),
    "fedau_cnn_cifar100": _fedau("cifar100"),
    "fedau_cnn_cinic10": _fedau("cinic10"),
    "vgg11": lambda c, d, k, shape, vocab: VGG11(shape, k, c.norm, c.groups),
    "resnet18": lambda c, d, k, shape, vocab: ResNet18(shape, k, c.norm, c.groups),
    "fedevg_resnet10": lambda c, d, k, shape, vocab: FedEvgResNet10(shape, k),
    "mnist1d_cnn": lambda c, d, k, shape, vocab: MNIST1DCNN(shape, d, k),
    "char_lstm": lambda c, d, k, shape, vocab: CharLSTM(vocab, k),
}


def build_model(
    config: ModelConfig,
    num_features: int,
    num_classes: int,
    image_shape: tuple[int, ...] | None,
    seed: int,
    *,
    vocab_size: int | None = None,
) -> nn.Module:
    """The model ``config`` names, initialised from the ``(seed, MODEL_INIT)`` stream on the
    CPU (whatever torch's default device), so a run starts from the same weights on any device.

    ``image_shape`` is how image and signal models view a row; ``vocab_size`` is the number
    of distinct token ids of token data (default: ``num_classes``, as for next-character
    prediction)."""
    builder = BUILDERS.get(config.name)
    if builder is None:
        raise ConfigError(f"model.name: unknown model {config.name!r}")
    vocab = num_classes if vocab_size is None else vocab_size
    with seeding.torch_stream(seed, seeding.MODEL_INIT), torch.device("cpu"):
        return builder(config, num_features, num_classes, image_shape, vocab)
