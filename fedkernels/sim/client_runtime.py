"""The clients' half of a round for clients that run apart from the server (in a Flower
ClientApp, :mod:`fedkernels.apps`), beside :class:`~fedkernels.sim.run.Simulation` as the
server's half (``role="server"``).

A :class:`ClientRuntime` builds what the simulation of the same configuration builds (the data
and its partition, the model, the strategy), so client k here trains exactly as client k does
inside ``fedkernels run``: the same samples, the same minibatch order and random streams, the
same local training code (:meth:`Strategy.train_client` or the shared
:class:`~fedkernels.sim.client.LocalTrainer`). What the client keeps between its rounds comes
in and goes out with each call (``client_state``): a process may serve one client's rounds
or many clients', and may be a new process in every round, so every call sets up a strategy
of its own and nothing else carries over.
"""

from __future__ import annotations

import copy
from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from .client import ClientUpdate, LocalTrainer
from .config import ConfigError, ExperimentConfig
from .dataset import Dataset
from .devices import reproducible_numerics, resolve_device
from .federation import ClientData
from .participation import build_sampler
from .run import global_losses, prepare_data
from .server import to_device
from .strategy import SetupInfo, Strategy


@dataclass
class ClientReply:
    """What one client sends back after a round's training."""

    update: ClientUpdate  # the trained state and the mean minibatch loss
    num_samples: int  # n_k, the client's training samples
    global_loss: float | None  # f_k(x_t) before training, where the strategy wants it
    extras: dict[str, Tensor]  # Strategy.reply_extras
    client_state: dict[str, Tensor]  # what the client keeps until its next round


class ClientRuntime:
    """The clients of ``config`` as one process sees them (module docstring); ``device``
    (default ``config.device``) is where this process trains."""

    def __init__(
        self,
        config: ExperimentConfig,
        new_strategy: Callable[[], Strategy],
        *,
        device: str | None = None,
        dataset: Dataset | None = None,
        model: nn.Module | None = None,
    ) -> None:
        if config.vmap:
            raise ConfigError(
                "vmap trains all of a round's clients at once in one process; clients that run "
                "apart train one by one (leave vmap false)"
            )
        self.config = config
        self.device = resolve_device(device or config.device)
        data = prepare_data(config, self.device, dataset)
        self.federation = fed = data.federation
        self.model = data.initial_model(config, model)
        self.sampler = build_sampler(config.participation, fed, config.seed)
        self.new_strategy = new_strategy
        self.eval_model = copy.deepcopy(self.model)

    def _setup(self) -> tuple[Strategy, LocalTrainer]:
        """A strategy set up as the clients' half, and the shared trainer on it: new for every
        call, so that nothing a client does stays in this process (what it keeps goes through
        ``client_state``, as it must where every message is a process of its own)."""
        fed, config, model = self.federation, self.config, self.model
        strategy = self.new_strategy()
        trainer = LocalTrainer(model, config.client, strategy, config.seed,
                               image_shape=fed.image_shape)
        strategy.setup(SetupInfo(
            fed.num_clients,
            fed.train_sizes(),
            fed.num_classes,
            self.sampler.probabilities,
            [n for n, _ in model.named_parameters()],
            model=model,
            client_config=config.client,
            rounds=config.rounds,
            seed=config.seed,
            server_data=None,  # the server's rows stay with the server
            participants_per_round=self.sampler.fixed_count,
            device=self.device,
            role="client",
            num_features=fed.num_features,
        ))
        return strategy, trainer

    def client(self, client_id: int) -> ClientData:
        """Client ``client_id``'s samples (on this process's device)."""
        if not 0 <= client_id < self.federation.num_clients:
            raise ConfigError(f"client {client_id} does not exist: the run has "
                              f"{self.federation.num_clients} clients (0 to "
                              f"{self.federation.num_clients - 1})")
        return self.federation.clients[client_id]

    def train(
        self,
        client_id: int,
        round_index: int,
        global_state: Mapping[str, Tensor],
        *,
        payload: Mapping[str, Tensor] | None = None,
        client_state: Mapping[str, Tensor] | None = None,
        global_loss: bool = False,
    ) -> ClientReply:
        """Client ``client_id``'s training in round ``round_index`` (0-based) from the global
        model ``global_state``, after taking in the server's ``payload`` and the state it kept
        from its earlier rounds; ``global_loss`` adds ``f_k(x_t)``."""
        data = self.client(client_id)
        state = to_device(dict(global_state), self.device)
        with reproducible_numerics(self.device):
            strategy, trainer = self._setup()
            strategy.load_client_state_dict(client_id, to_device(dict(client_state or {}),
                                                                 self.device))
            if payload:
                strategy.receive_payload(client_id, to_device(dict(payload), self.device))
            loss = None
            if global_loss:
                loss = float(global_losses(self.eval_model, state, [data])[0])
            update = strategy.train_client(state, data, round_index, client_id)
            if update is None:
                update = trainer.train(state, data, round_index, client_id)
            extras = strategy.reply_extras(client_id)
            kept = strategy.client_state_dict(client_id)
        return ClientReply(update, data.num_train, loss, extras, kept)

    def evaluate(
        self,
        client_id: int,
        global_state: Mapping[str, Tensor],
        *,
        client_state: Mapping[str, Tensor] | None = None,
    ) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        """Client ``client_id``'s part of the strategy's evaluation of ``global_state``
        (:meth:`Strategy.evaluate_client`) and the state it keeps afterwards."""
        data = self.client(client_id)
        state = to_device(dict(global_state), self.device)
        with reproducible_numerics(self.device), torch.no_grad():
            strategy, _ = self._setup()
            strategy.load_client_state_dict(client_id, to_device(dict(client_state or {}),
                                                                 self.device))
            part = strategy.evaluate_client(state, data, client_id)
            kept = strategy.client_state_dict(client_id)
        return part, kept


__all__ = ["ClientReply", "ClientRuntime"]
