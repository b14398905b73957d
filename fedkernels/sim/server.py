r"""The server: the global model and the optimizer that moves it
(:mod:`fedkernels.rules.server_optimizers`: plain SGD, FedAvgM, FedAdagrad, FedAdam, FedYogi
on the round's averaged update).

Only trainable parameters go through the optimizer. Floating-point buffers (BatchNorm running
mean and variance) become the weighted mean of the clients' buffers with the weights
normalised to sum 1 (an Adam step on a running variance would be meaningless), and integer
buffers (``num_batches_tracked``) the clients' maximum (``int_policy="max"``).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import torch
from torch import Tensor, nn

from fedkernels.aggregate import aggregate
from fedkernels.rules.server_optimizers import (
    FedAdagrad,
    FedAdam,
    FedAvgM,
    FedYogi,
    ServerOptimizer,
    ServerSGD,
)

from .config import ServerConfig

if TYPE_CHECKING:
    from .central_dp import CentralPrivacy

StateDict = dict[str, Tensor]


def build_server_optimizer(config: ServerConfig) -> ServerOptimizer:
    """The optimizer ``config.optimizer`` names, with its learning rate."""
    lr = config.learning_rate
    if config.optimizer == "sgd":
        return ServerSGD(lr)
    if config.optimizer == "fedavgm":
        return FedAvgM(lr, config.momentum)
    if config.optimizer == "fedadagrad":
        return FedAdagrad(lr, config.tau)
    if config.optimizer == "fedadam":
        return FedAdam(lr, config.beta1, config.beta2, config.tau)
    return FedYogi(lr, config.beta1, config.beta2, config.tau)


def to_device(tree: Any, device: torch.device | None) -> Any:
    """``tree`` (nested dicts, lists and tuples) with every tensor moved to ``device`` (left
    where it is for ``None``)."""
    if device is None:
        return tree
    if isinstance(tree, Tensor):
        return tree.to(device)
    if isinstance(tree, dict):
        return {k: to_device(v, device) for k, v in tree.items()}
    if isinstance(tree, (list, tuple)):
        return type(tree)(to_device(v, device) for v in tree)
    return tree


class Server:
    """Holds the global ``state`` (a state_dict of the model) and applies client rounds to it."""

    def __init__(
        self, model: nn.Module, optimizer: ServerOptimizer, private: CentralPrivacy | None = None
    ) -> None:
        self.state: StateDict = {k: v.detach().clone() for k, v in model.state_dict().items()}
        self.parameter_names = [n for n, _ in model.named_parameters()]
        trainable = set(self.parameter_names)
        self.buffer_names = [n for n in self.state if n not in trainable]
        self.optimizer = optimizer
        self.private = private  # central DP: clipped, noised, equally weighted mean

    def step(self, client_states: list[StateDict], weights: Tensor, round_index: int) -> None:
        """Applies one round: parameters through the optimizer, buffers averaged
        (module docstring). ``round_index`` is 0-based."""
        if not client_states:
            return
        params = {n: self.state[n] for n in self.parameter_names}
        client_params = [{n: s[n] for n in self.parameter_names} for s in client_states]
        if self.private is None:
            self.optimizer.apply(params, client_params, weights, round_index + 1)
        else:
            # the optimizer moves x towards the private mean as it would towards the average
            averaged = self.private.average(params, client_params, round_index)
            self.optimizer.apply(
                params, [averaged], torch.ones(1, dtype=torch.float64, device="cpu"),
                round_index + 1,
            )
        if self.buffer_names:
            buffers = {n: self.state[n] for n in self.buffer_names}
            aggregate(
                [{n: s[n] for n in self.buffer_names} for s in client_states],
                weights,
                normalize=True,
                out=buffers,
            )

    def state_dict(self) -> dict[str, Any]:
        state = {"global": self.state, "optimizer": self.optimizer.state_dict()}
        if self.private is not None:
            state["private"] = self.private.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`, from tensors on any device (a checkpoint written on a
        GPU resumes on the CPU, and the other way round): the optimizer's moments are moved to
        the global model's device."""
        for name, value in state["global"].items():
            self.state[name].copy_(value)
        device = next(iter(self.state.values())).device if self.state else None
        self.optimizer.load_state_dict(to_device(state["optimizer"], device))
        if self.private is not None:
            self.private.load_state_dict(state["private"])
