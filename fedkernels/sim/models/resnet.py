"""Residual networks for small images: ResNet-18 for 32x32 inputs, and SuPerFed's ResNet9 and
MobileNet.

ResNet-18 is written here rather than taken from torchvision: PyPI's torchvision 0.28.0 wheel
links libtorch_cuda.so and does not import beside the CPU build of torch 2.13.0 ("operator
torchvision::nms does not exist"). Its modules carry torchvision's names (``conv1``, ``bn1``,
``layer1.0.downsample.1``, ``fc``), so a state_dict maps onto
``torchvision.models.resnet18(norm_layer=...)`` with a 3x3 stride-1 ``conv1`` and no
max-pool; a test checks that whenever torchvision imports.
"""

from __future__ import annotations

from torch import Tensor, nn

from ..model_catalog import out_size
from .layers import (
    NormFactory,
    image_view,
    init_kaiming_fan_out,
    init_xavier_normal,
    norm_factory,
    require_side,
)

RESNET_WIDTHS = (64, 128, 256, 512)


class BasicBlock(nn.Module):
    """Two bias-free 3x3 convs with norms and ReLUs; a 1x1 conv and norm project the input
    when the stride or the width changes (torchvision's ``BasicBlock``)."""

    def __init__(self, c_in: int, c_out: int, stride: int, make_norm: NormFactory) -> None:
        super().__init__()
        self.conv1 = nn.Conv2d(c_in, c_out, 3, stride, 1, bias=False)
        self.bn1 = make_norm(c_out)
        self.conv2 = nn.Conv2d(c_out, c_out, 3, 1, 1, bias=False)
        self.bn2 = make_norm(c_out)
        self.relu = nn.ReLU()
        self.downsample = None
        if stride != 1 or c_in != c_out:
            self.downsample = nn.Sequential(nn.Conv2d(c_in, c_out, 1, stride, bias=False),
                                            make_norm(c_out))

    def forward(self, x: Tensor) -> Tensor:
        out = self.bn2(self.conv2(self.relu(self.bn1(self.conv1(x)))))
        shortcut = x if self.downsample is None else self.downsample(x)
        return self.relu(out + shortcut)


class ResNet18(nn.Module):
    """ResNet-18 for 32x32 images (He et al. 2016, in the CIFAR form of kuangliu/pytorch-cifar
    that FedGO uses, and with GroupNorm of 2 groups in FedAU's and Semi-VRed's experiments):
    a 3x3 stride-1 stem without max-pool, four stages of two basic blocks (64, 128, 256, 512
    channels, strides 1, 2, 2, 2), global average pooling and a linear layer. ``norm``: batch
    (default) or group (``groups`` groups) or none. He-normal (fan-out) conv weights, as
    torchvision. 11,173,962 parameters on CIFAR-10 (3x32x32, 10 classes), BatchNorm and
    GroupNorm alike (the spec's "about 11.2M")."""

    def __init__(
        self, image_shape: tuple[int, ...] | None, num_classes: int, norm: str = "batch",
        groups: int = 2,
    ) -> None:
        super().__init__()
        c, _, _ = self.image_shape = image_view("resnet18", image_shape)
        make_norm = norm_factory("resnet18", norm, groups, RESNET_WIDTHS)
        self.conv1 = nn.Conv2d(c, 64, 3, 1, 1, bias=False)
        self.bn1 = make_norm(64)
        self.relu = nn.ReLU()
        c_in = 64
        for i, (width, stride) in enumerate(zip(RESNET_WIDTHS, (1, 2, 2, 2)), start=1):
            stage = nn.Sequential(BasicBlock(c_in, width, stride, make_norm),
                                  BasicBlock(width, width, 1, make_norm))
            self.add_module(f"layer{i}", stage)
            c_in = width
        self.avgpool = nn.AdaptiveAvgPool2d(1)
        self.fc = nn.Linear(512, num_classes)
        init_kaiming_fan_out(self)

    def forward(self, x: Tensor) -> Tensor:
        x = self.relu(self.bn1(self.conv1(x.reshape(x.shape[0], *self.image_shape))))
        x = self.layer4(self.layer3(self.layer2(self.layer1(x))))
        return self.fc(self.avgpool(x).flatten(1))


class SuPerFedResNet9(nn.Module):
    """SuPerFed's ResNet9 (official code; the CIFAR-100 model of the thesis' Table 2.4): a
    bias-free 3x3 stride-2 stem with norm and ReLU, a 3x3 stride-2 max-pool, one basic block
    per stage (64, 128, 256, 512 channels; strides 1, 1, 2, 2), global average pooling, then
    FC 256, ReLU, FC to the classes without biases; Xavier-normal weights. ``norm``: batch
    (default; the code's BatchNorm keeps no running statistics, ours does), group or none.
    5,054,784 parameters on CIFAR-100 (3x28x28, 100 classes); the paper's "about 5.05M"."""

    def __init__(
        self, image_shape: tuple[int, ...] | None, num_classes: int, norm: str = "batch",
        groups: int = 2,
    ) -> None:
        super().__init__()
        c, _, _ = self.image_shape = image_view("superfed_resnet9", image_shape)
        make_norm = norm_factory("superfed_resnet9", norm, groups, RESNET_WIDTHS)
        self.stem = nn.Sequential(nn.Conv2d(c, 64, 3, 2, 1, bias=False), make_norm(64), nn.ReLU(),
                                  nn.MaxPool2d(3, 2, 1))
        blocks, c_in = [], 64
        for width, stride in zip(RESNET_WIDTHS, (1, 1, 2, 2)):
            blocks.append(BasicBlock(c_in, width, stride, make_norm))
            c_in = width
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                        nn.Linear(512, 256, bias=False), nn.ReLU(),
                                        nn.Linear(256, num_classes, bias=False))
        init_xavier_normal(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.blocks(self.stem(x.reshape(x.shape[0], *self.image_shape))))


class SuPerFedMobileNet(nn.Module):
    """SuPerFed's MobileNet (official code; the TinyImageNet model of the thesis' Table 2.4): a
    bias-free 3x3 stride-2 stem with 32 channels, four depthwise-separable blocks (3x3
    depthwise conv without padding, norm, ReLU, 1x1 conv, norm, ReLU) to 64, 128, 256 and 512
    channels with strides 1, 2, 2, 1, global average pooling, then FC 256, ReLU, FC to the
    classes without biases; Xavier-normal weights. ``norm`` as in :class:`SuPerFedResNet9`.
    364,480 parameters on TinyImageNet (3x64x64, 200 classes); the paper's "about 0.36M".
    The unpadded depthwise convs need images of at least 33x33."""

    STAGES = ((32, 64, 1), (64, 128, 2), (128, 256, 2), (256, 512, 1))

    def __init__(
        self, image_shape: tuple[int, ...] | None, num_classes: int, norm: str = "batch",
        groups: int = 2,
    ) -> None:
        super().__init__()
        c, h, w = self.image_shape = image_view("superfed_mobilenet", image_shape)
        make_norm = norm_factory("superfed_mobilenet", norm, groups, (32, 64, 128, 256, 512))
        self.stem = nn.Sequential(nn.Conv2d(c, 32, 3, 2, 1, bias=False), make_norm(32), nn.ReLU())
        h, w = out_size(h, 3, 2, 1), out_size(w, 3, 2, 1)
        blocks: list[nn.Module] = []
        for c_in, c_out, stride in self.STAGES:
            blocks.append(nn.Sequential(
                nn.Conv2d(c_in, c_in, 3, stride, 0, groups=c_in, bias=False), make_norm(c_in),
                nn.ReLU(), nn.Conv2d(c_in, c_out, 1, bias=False), make_norm(c_out), nn.ReLU()))
            h, w = out_size(h, 3, stride), out_size(w, 3, stride)
        require_side("superfed_mobilenet", self.image_shape, h, w)
        self.blocks = nn.Sequential(*blocks)
        self.classifier = nn.Sequential(nn.AdaptiveAvgPool2d(1), nn.Flatten(),
                                        nn.Linear(512, 256, bias=False), nn.ReLU(),
                                        nn.Linear(256, num_classes, bias=False))
        init_xavier_normal(self)

    def forward(self, x: Tensor) -> Tensor:
        return self.classifier(self.blocks(self.stem(x.reshape(x.shape[0], *self.image_shape))))
