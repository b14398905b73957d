"""Plain conv-pool networks of the papers: FedAvg's CNN, SuPerFed's TwoCNN and FedAU's CNNs,
plus the fully connected TwoNNs.

All of them are conv (ReLU, 2x2 max-pool) blocks followed by a fully connected ReLU head
(:class:`ConvPoolNet`); the subclasses fix the sizes, biases, dropout and initialisation of
one paper. Rows are viewed as the data's ``(channels, height, width)`` image.
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from ..model_catalog import FEDAU_HEADS, out_size
from .basic import MLP
from .layers import image_view, init_xavier_normal, require_side


class ConvPoolNet(nn.Module):
    """``channels`` conv layers (``kernel`` x ``kernel``, padding ``conv_padding``), each with a
    ReLU and a 2x2 max-pool (padding ``pool_padding``), then linear layers through ``hidden``
    to the classes with ReLUs between them; ``dropout`` > 0 puts a dropout before every linear
    layer."""

    def __init__(
        self,
        name: str,
        image_shape: tuple[int, ...] | None,
        num_classes: int,
        *,
        channels: list[int],
        kernel: int,
        conv_padding: int,
        hidden: list[int],
        pool_padding: int = 0,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        c, h, w = self.image_shape = image_view(name, image_shape)
        blocks: list[nn.Module] = []
        for out in channels:
            blocks += [nn.Conv2d(c, out, kernel, padding=conv_padding, bias=bias), nn.ReLU(),
                       nn.MaxPool2d(2, padding=pool_padding)]
            c = out
            h = out_size(out_size(h, kernel, 1, conv_padding), 2, 2, pool_padding)
            w = out_size(out_size(w, kernel, 1, conv_padding), 2, 2, pool_padding)
        require_side(name, self.image_shape, h, w)
        self.features = nn.Sequential(*blocks)
        layers: list[nn.Module] = []
        width = c * h * w
        for i, out in enumerate([*hidden, num_classes]):
            if dropout:
                layers.append(nn.Dropout(dropout))
            layers.append(nn.Linear(width, out, bias=bias))
            if i < len(hidden):
                layers.append(nn.ReLU())
            width = out
        self.classifier = nn.Sequential(*layers)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        return self.classifier(self.features(x).flatten(1))


class TwoNN(MLP):
    """FedAvg's 2NN (McMahan et al. 2017, §3): two hidden layers of 200 ReLU units.
    199,210 parameters on MNIST (784 features, 10 classes), as the paper states."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__(num_features, [200, 200], num_classes)


class TwoCNN(ConvPoolNet):
    """FedAvg's CNN (McMahan et al. 2017, §3): 5x5 conv with 32 channels, 2x2 max-pool, 5x5
    conv with 64 channels, 2x2 max-pool, a 512-unit ReLU layer and the softmax layer. The
    convolutions keep the image size (padding 2, TensorFlow's 'same'), which gives the
    paper's 1,663,370 parameters on MNIST (1x28x28, 10 classes) exactly."""

    def __init__(self, image_shape: tuple[int, ...] | None, num_classes: int) -> None:
        super().__init__("twocnn", image_shape, num_classes, channels=[32, 64], kernel=5,
                         conv_padding=2, hidden=[512])


class SuPerFedTwoNN(MLP):
    """SuPerFed's TwoNN (official code; the MNIST model of the thesis' Table 2.3): three hidden
    layers of 200 ReLU units, no biases, Xavier-normal weights. 238,800 parameters on MNIST
    (784 features, 10 classes); the spec's count."""

    def __init__(self, num_features: int, num_classes: int) -> None:
        super().__init__(num_features, [200, 200, 200], num_classes, bias=False)
        init_xavier_normal(self)


class SuPerFedTwoCNN(ConvPoolNet):
    """SuPerFed's TwoCNN (official code; the CIFAR-10 model of the thesis' Table 2.3): 5x5 convs
    with 32 and 64 channels and padding 1, each with a ReLU and a 2x2 max-pool with padding 1,
    then 200-200 ReLU layers; no biases, Xavier-normal weights. 722,800 parameters on CIFAR-10
    resized to 3x28x28 (the paper's "about 723k"); 721,200 on 1x28x28."""

    def __init__(self, image_shape: tuple[int, ...] | None, num_classes: int) -> None:
        super().__init__("superfed_twocnn", image_shape, num_classes, channels=[32, 64],
                         kernel=5, conv_padding=1, pool_padding=1, hidden=[200, 200],
                         bias=False)
        init_xavier_normal(self)


class FedAUCNN(ConvPoolNet):
    """FedAU's CNNs (Wang and Ji 2024, official code's ``model/cnn_*.py``; the models behind
    the paper's Table 1): two 3x3 convs with 32 channels (padding 1), each with a ReLU and a
    2x2 max-pool, then a head per data set: ``fashion_mnist`` FC 128 (211,690 parameters on
    1x28x28), ``svhn`` FC 128 (273,706 on 3x32x32), ``cifar10`` FC 256-64 (551,786),
    ``cifar100`` FC 512-256 with dropout 0.2 before every linear layer (1,216,260 with 100
    classes), ``cinic10`` as cifar100 (1,193,130 with 10 classes). He-normal weights and zero
    biases, except the last layer, which keeps PyTorch's default, as in the code."""

    def __init__(self, variant: str, image_shape: tuple[int, ...] | None, num_classes: int) -> None:
        hidden, dropout = FEDAU_HEADS[variant]
        super().__init__(f"fedau_cnn_{variant}", image_shape, num_classes, channels=[32, 32],
                         kernel=3, conv_padding=1, hidden=hidden, dropout=dropout)
        last = self.classifier[-1]
        with torch.no_grad():
            for m in self.modules():
                if isinstance(m, (nn.Conv2d, nn.Linear)) and m is not last:
                    nn.init.kaiming_normal_(m.weight, nonlinearity="relu")
                    nn.init.zeros_(m.bias)
