"""Models for the simulations: the simulator's small ones and the source papers' (each class's
docstring names its paper and its parameter count; ``docs/guide/models.md`` lists them).

A model maps a ``[B, d]`` batch of rows to ``[B, C]`` logits: float features, viewed as the
data's image or signal shape by conv models, or int64 token ids for :class:`CharLSTM`. Any
``nn.Module`` of that form works as well (pass it to :class:`~fedkernels.sim.run.Simulation`).
"""

from .basic import MLP, LogisticRegression, RowBatchNorm, SmallCNN
from .build import BUILDERS, build_model
from .convnets import ConvPoolNet, FedAUCNN, SuPerFedTwoCNN, SuPerFedTwoNN, TwoCNN, TwoNN
from .energy import EnergyBlock, FedEvgResNet10
from .resnet import BasicBlock, ResNet18, SuPerFedMobileNet, SuPerFedResNet9
from .sequence import CharLSTM
from .signal import MNIST1DCNN
from .vgg import VGG, VGG11, SuPerFedVGG9

__all__ = [
    "BUILDERS",
    "MLP",
    "MNIST1DCNN",
    "VGG",
    "VGG11",
    "BasicBlock",
    "CharLSTM",
    "ConvPoolNet",
    "EnergyBlock",
    "FedAUCNN",
    "FedEvgResNet10",
    "LogisticRegression",
    "ResNet18",
    "RowBatchNorm",
    "SmallCNN",
    "SuPerFedMobileNet",
    "SuPerFedResNet9",
    "SuPerFedTwoCNN",
    "SuPerFedTwoNN",
    "SuPerFedVGG9",
    "TwoCNN",
    "TwoNN",
    "build_model",
]
