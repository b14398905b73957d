"""FedEvg's energy network: the ResNet-10 of its official code, whose logits f(x) give the
class-conditional energy E(x, y) = -f(x)[y] (``docs/algorithms/fedevg.md``)."""

from __future__ import annotations

from torch import Tensor, nn

from ..model_catalog import out_size
from .layers import image_view, init_xavier_normal, require_side

RESNET10_STAGES = ((64, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 2))


class EnergyBlock(nn.Module):
    """Bias-free 3x3 conv, GroupNorm with two channels per group, SiLU, 3x3 conv, GroupNorm;
    plus the input (through a 1x1 conv and GroupNorm when the stride or width changes). No
    activation after the sum, as in the official code."""

    def __init__(self, c_in: int, c_out: int, stride: int) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False), nn.GroupNorm(c_out // 2, c_out),
            nn.SiLU(), nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False),
            nn.GroupNorm(c_out // 2, c_out))
        self.shortcut: nn.Module = nn.Identity()
        if stride != 1 or c_in != c_out:
            self.shortcut = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                          nn.GroupNorm(c_out // 2, c_out))

    def forward(self, x: Tensor) -> Tensor:
        return self.features(x) + self.shortcut(x)


class FedEvgResNet10(nn.Module):
    """FedEvg's energy network (Hahn's thesis, ch. IV, §1.9 of our spec; the official code's
    ``ResNet10`` with ``--hidden_size 64 --penult_spectral_norm``): a bias-free 3x3 stem with
    64 channels, GroupNorm(16) and SiLU; four stages of one :class:`EnergyBlock` (64, 128,
    256, 512 channels; strides 1, 2, 2, 2); GroupNorm(64), SiLU; the flattened map goes to a
    linear layer with bias, under spectral norm (``spectral_norm=False`` leaves it plain).
    Xavier-normal weights and zero biases (the code re-initialises so every round).
    4,979,914 parameters on MNIST at 1x32x32 and 4,981,066 on CIFAR-10 (3x32x32), 10
    classes (the spec's measured 4.98M). The spectral norm's power iteration updates buffers
    in training mode, so this model does not train on the vmap path."""

    def __init__(
        self, image_shape: tuple[int, ...] | None, num_classes: int, spectral_norm: bool = True
    ) -> None:
        super().__init__()
        c, h, w = self.image_shape = image_view("fedevg_resnet10", image_shape)
        layers: list[nn.Module] = [nn.Conv2d(c, 64, 3, 1, 1, bias=False), nn.GroupNorm(16, 64),
                                   nn.SiLU()]
        for c_in, c_out, stride in RESNET10_STAGES:
            layers.append(EnergyBlock(c_in, c_out, stride))
            h, w = out_size(h, 3, stride, 1), out_size(w, 3, stride, 1)
        require_side("fedevg_resnet10", self.image_shape, h, w)
        layers += [nn.GroupNorm(64, 512), nn.SiLU(), nn.Flatten()]
        self.features = nn.Sequential(*layers)
        self.classifier = nn.Linear(512 * h * w, num_classes)
        init_xavier_normal(self)
        if spectral_norm:
            self.classifier = nn.utils.parametrizations.spectral_norm(self.classifier)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.features(x.reshape(x.shape[0], *self.image_shape)))
