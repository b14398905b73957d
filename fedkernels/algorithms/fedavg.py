"""FedAvg (McMahan et al. 2017): the server combines the clients' models weighted by their
number of training samples."""

from __future__ import annotations

from torch import Tensor

from fedkernels.sim.strategy import RoundInfo, Strategy

from .registry import register


@register
class FedAvg(Strategy):
    r"""Weights :math:`w_k = n_k / \sum_{j \in S_t} n_j` over the round's participants, so that
    with the plain server step :math:`x_{t+1} = x_t + \eta \sum_k w_k (x_k - x_t)` (and
    :math:`\eta = 1` the weighted model average). The server optimizer (``server.optimizer``)
    turns it into FedAvgM, FedAdam, FedYogi or FedAdagrad."""

    name = "fedavg"

    def client_weights(self, info: RoundInfo) -> Tensor:
        return info.num_samples / info.num_samples.sum()
