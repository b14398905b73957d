"""Helpers of the algorithm tests: hand-made rounds fed straight to a strategy."""

from __future__ import annotations

import numpy as np
import torch
from torch import nn

from fedkernels.sim.config import ClientConfig, ServerConfig
from fedkernels.sim.participation import ParticipationHistory
from fedkernels.sim.server import Server, build_server_optimizer
from fedkernels.sim.strategy import RoundInfo, SetupInfo

SHAPES = {"w": (3, 2), "b": (2,)}


def setup_info(num_clients, sizes=None, probabilities=None, lr=0.1, model=None):
    sizes = np.ones(num_clients) * 10 if sizes is None else np.asarray(sizes, dtype=np.float64)
    return SetupInfo(
        num_clients=num_clients,
        train_sizes=torch.tensor(sizes, dtype=torch.float64),
        num_classes=2,
        participation_probabilities=probabilities,
        parameter_names=list(SHAPES) if model is None else [n for n, _ in model.named_parameters()],
        model=model,
        client_config=ClientConfig(lr=lr),
        rounds=10,
        seed=0,
    )


def random_states(num_clients, seed=0, scale=1.0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    glob = {n: torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()}
    clients = [
        {n: glob[n] + scale * torch.randn(s, generator=g, dtype=dtype) for n, s in SHAPES.items()}
        for _ in range(num_clients)
    ]
    return glob, clients


def flat(state):
    return np.concatenate([state[n].numpy().ravel() for n in SHAPES])


def round_info(
    losses,
    sizes,
    global_state=None,
    client_states=None,
    participants=None,
    num_clients=None,
    round_index=0,
    history=None,
    train_losses=None,
):
    k = len(losses)
    if global_state is None:
        global_state, client_states = random_states(k)
    participants = torch.arange(k) if participants is None else torch.as_tensor(participants)
    num_clients = k if num_clients is None else num_clients
    if history is None:
        history = ParticipationHistory(num_clients)
        mask = torch.zeros(num_clients, dtype=torch.bool)
        mask[participants] = True
        for _ in range(round_index + 1):
            history.record(mask)
    losses = torch.as_tensor(np.asarray(losses, dtype=np.float64))
    return RoundInfo(
        round=round_index,
        num_clients=num_clients,
        participants=participants,
        num_samples=torch.as_tensor(np.asarray(sizes, dtype=np.float64)),
        global_state=global_state,
        client_states=client_states,
        train_losses=losses if train_losses is None else torch.as_tensor(train_losses),
        global_losses=losses,
        history=history,
    )


class VectorModel(nn.Module):
    """A model that is one parameter vector (quadratic-objective tests)."""

    def __init__(self, dim, dtype=torch.float64):
        super().__init__()
        self.x = nn.Parameter(torch.zeros(dim, dtype=dtype))

    def forward(self, inputs):  # pragma: no cover - not used
        return inputs


def sgd_server(model, lr=1.0):
    return Server(model, build_server_optimizer(ServerConfig(optimizer="sgd", lr=lr)))
