r"""Byzantine clients: a seeded set of clients whose replies (or training labels) are corrupted.

``round(fraction * N)`` clients are chosen once per experiment from the stream
``(seed, ATTACK)`` and stay Byzantine for the whole run. With :math:`x_t` the round's global
model and :math:`x_k` what client k trained honestly, a Byzantine client replies

- **signflip**: :math:`x_t - s\,(x_k - x_t)` (its update reversed and magnified);
- **scale**: :math:`x_t + s\,(x_k - x_t)` (its update magnified, a model-replacement boost);
- **gaussian**: :math:`x_t + \xi`, :math:`\xi \sim \mathcal{N}(0, \sigma^2 I)` (noise instead of an
  update), drawn from the stream ``(seed, ATTACK, round, client)``;
- **labelflip**: the honest reply of a client whose training labels are :math:`C - 1 - y`
  (its test labels stay true, so the global model is still judged on correct labels).

The replies are changed after local training and before the strategy aggregates them, so every
algorithm sees the same attack. Only the trainable parameters are changed; buffers (BatchNorm
statistics) are left as trained.
"""

from __future__ import annotations

import dataclasses
import zlib

import torch
from torch import Tensor

from . import seeding
from .client import ClientUpdate
from .config import AttackConfig
from .federation import Federation


def choose_byzantine(num_clients: int, fraction: float, seed: int) -> list[int]:
    """The sorted ids of the ``round(fraction * num_clients)`` Byzantine clients."""
    count = int(round(fraction * num_clients))
    rng = seeding.numpy_rng(seed, seeding.ATTACK)
    return sorted(int(k) for k in rng.choice(num_clients, size=count, replace=False))


class ByzantineClients:
    """The attack of one experiment: who is Byzantine and what their replies become."""

    def __init__(self, config: AttackConfig, num_clients: int, seed: int) -> None:
        self.config = config
        self.seed = seed
        self.clients = choose_byzantine(num_clients, config.fraction, seed)
        self._members = set(self.clients)

    def poison_labels(self, federation: Federation) -> None:
        """labelflip: replaces each Byzantine client's training labels ``y`` by ``C - 1 - y``."""
        if self.config.kind != "labelflip":
            return
        last = federation.num_classes - 1
        for k in self.clients:
            data = federation.clients[k]
            federation.clients[k] = dataclasses.replace(data, train_y=last - data.train_y)

    def corrupt(
        self,
        updates: list[ClientUpdate],
        client_ids: list[int],
        global_state: dict[str, Tensor],
        parameter_names: list[str],
        round_index: int,
    ) -> list[ClientUpdate]:
        """The replies the server receives: the Byzantine participants' replies replaced
        (module docstring), the others unchanged."""
        kind = self.config.kind
        if kind in ("none", "labelflip"):
            return updates
        replies = []
        for update, k in zip(updates, client_ids):
            if k not in self._members:
                replies.append(update)
                continue
            state = dict(update.state)
            for name in parameter_names:
                state[name] = self._reply(state[name], global_state[name], round_index, k, name)
            replies.append(ClientUpdate(state, update.train_loss))
        return replies

    def _reply(self, trained: Tensor, base: Tensor, round_index: int, client: int,
               name: str) -> Tensor:
        s = self.config.scale
        if self.config.kind == "signflip":
            return base - s * (trained - base)
        if self.config.kind == "scale":
            return base + s * (trained - base)
        # drawn on the CPU: the same noise whatever the run's device
        generator = seeding.generator(self.seed, seeding.ATTACK, round_index, client,
                                      _name_key(name))
        noise = torch.randn(base.shape, generator=generator, dtype=base.dtype, device="cpu")
        return base + self.config.std * noise.to(base.device)

    def count_in(self, client_ids: list[int]) -> int:
        """How many of ``client_ids`` are Byzantine."""
        return sum(k in self._members for k in client_ids)


def _name_key(name: str) -> int:
    """A stable integer key of a parameter name (Python's ``hash`` of a str varies by process)."""
    return zlib.crc32(name.encode())


def build_attack(config: AttackConfig, num_clients: int, seed: int) -> ByzantineClients | None:
    """The experiment's Byzantine clients, or ``None`` for ``attack.kind=none``."""
    if config.kind == "none":
        return None
    return ByzantineClients(config, num_clients, seed)

