"""FedProx (Li et al. 2020): FedAvg's server with a proximal term in each client's loss."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fedkernels.sim.config import ConfigError

from .fedavg import FedAvg
from .registry import register


@dataclass
class FedProxConfig:
    mu: float = field(default=0.01, metadata={"help": "proximal strength mu (0 gives FedAvg)"})

    def __post_init__(self) -> None:
        if self.mu < 0:
            raise ConfigError("fedprox.mu must be >= 0")


@register
class FedProx(FedAvg):
    r"""Client k minimises :math:`f_k(x) + \tfrac{\mu}{2}\|x - x_t\|^2` over the trainable
    parameters, :math:`x_t` being the round's global model; the server is FedAvg's."""

    name = "fedprox"
    config_class = FedProxConfig

    def local_penalty(
        self, params: Mapping[str, Tensor], global_params: Mapping[str, Tensor]
    ) -> Tensor:
        squared = [((params[n] - global_params[n]) ** 2).sum() for n in global_params]
        return 0.5 * self.config.mu * torch.stack(squared).sum()
