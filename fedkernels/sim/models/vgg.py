"""VGG-style networks: VGG-11 for 32x32 images and SuPerFed's VGG9."""

from __future__ import annotations

from torch import Tensor, nn

from ..model_catalog import SUPERFED_VGG9_LAYOUT, VGG11_LAYOUT
from .layers import image_view, init_kaiming_fan_out, init_xavier_normal, norm_factory, require_side


class VGG(nn.Module):
    """3x3 convs (padding 1) with the widths of ``layout``, each followed by the norm and a
    ReLU, and 2x2 max-pools where ``layout`` says ``"M"``; then linear layers through
    ``hidden`` (ReLUs between, a dropout before each hidden one when ``dropout`` > 0)."""

    def __init__(
        self,
        name: str,
        image_shape: tuple[int, ...] | None,
        num_classes: int,
        layout: list[int | str],
        hidden: list[int],
        *,
        norm: str = "none",
        groups: int = 2,
        bias: bool = True,
        dropout: float = 0.0,
    ) -> None:
        super().__init__()
        c, h, w = self.image_shape = image_view(name, image_shape)
        make_norm = norm_factory(name, norm, groups, [v for v in layout if v != "M"])
        layers: list[nn.Module] = []
        for item in layout:
            if item == "M":
                layers.append(nn.MaxPool2d(2))
                h, w = h // 2, w // 2
            else:
                layers += [nn.Conv2d(c, int(item), 3, padding=1, bias=bias), make_norm(int(item)),
                           nn.ReLU()]
                c = int(item)
        require_side(name, self.image_shape, h, w)
        self.features = nn.Sequential(*layers)
        head: list[nn.Module] = []
        width = c * h * w
        for out in hidden:
            if dropout:
                head.append(nn.Dropout(dropout))
            head += [nn.Linear(width, out, bias=bias), nn.ReLU()]
            width = out
        head.append(nn.Linear(width, num_classes, bias=bias))
        self.classifier = nn.Sequential(*head)

    def forward(self, x: Tensor) -> Tensor:
        x = x.reshape(x.shape[0], *self.image_shape)
        return self.classifier(self.features(x).flatten(1))


class VGG11(VGG):
    """VGG-11 for 32x32 images as FedGO uses it (its appendix F.4 "VGG11-BN", from the
    pytorch-vgg-cifar10 code it cites): convs 64, M, 128, M, 256, 256, M, 512, 512, M, 512,
    512, M with biases, each followed by the norm (``norm``: batch by default; group or none)
    and a ReLU, then dropout 0.5, FC 512, ReLU, dropout 0.5, FC 512, ReLU, FC to the classes.
    He-normal (fan-out) conv weights. 9,756,426 parameters on CIFAR-10 (3x32x32, 10 classes)
    with BatchNorm or GroupNorm, 9,750,922 without a norm."""

    def __init__(
        self, image_shape: tuple[int, ...] | None, num_classes: int, norm: str = "batch",
        groups: int = 2,
    ) -> None:
        super().__init__("vgg11", image_shape, num_classes, VGG11_LAYOUT, [512, 512], norm=norm,
                         groups=groups, dropout=0.5)
        init_kaiming_fan_out(self)


class SuPerFedVGG9(VGG):
    """SuPerFed's VGG9 (official code; the FEMNIST model of the thesis' Table 2.5): bias-free
    3x3 convs 16, M, 32, M, 64, 128, M, 256, 512, M with ReLUs and no norm, then FC 256, ReLU,
    FC to the classes, no biases, Xavier-normal weights. 1,718,416 parameters on FEMNIST
    (1x28x28, 62 classes); the paper's "about 1.72M"."""

    def __init__(self, image_shape: tuple[int, ...] | None, num_classes: int) -> None:
        super().__init__("superfed_vgg9", image_shape, num_classes, SUPERFED_VGG9_LAYOUT, [256],
                         bias=False)
        init_xavier_normal(self)
