"""Helpers of the simulator's device tests: small runs of every family of algorithms, a probe
that checks where the tensors a strategy receives and returns are, and a counter of the
fedkernels ops a run dispatches, by device."""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import Tensor
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

from fedkernels.algorithms import build_strategy
from fedkernels.sim import Dataset, ExperimentConfig, Simulation, from_dict
from fedkernels.sim.strategy import RoundInfo, Strategy

HOST = torch.device("cpu")


@dataclass(frozen=True)
class Case:
    """One small run: the algorithm, its parameters, changes to the base configuration and
    the fedkernels ops (name prefixes) it must dispatch."""

    algorithm: str
    params: dict[str, Any] = field(default_factory=dict)
    overrides: dict[str, Any] = field(default_factory=dict)
    ops: tuple[str, ...] = ("weighted_sum",)
    images: bool = False  # train a CNN on image rows (a dataset of 1x8x8 images)


SERVER_DATA = {"data": {"server_fraction": 0.3}}

# One run per family of algorithms (and per simulator feature that places tensors: vmap, the
# server's optimizer moments, central DP, attacks, augmentation).
CASES = {
    "fedavg": Case("fedavg"),
    "fedavg-vmap": Case("fedavg", overrides={"vmap": True}),
    "fedadam": Case("fedavg", overrides={"server": {"optimizer": "fedadam"}}),
    "fedprox": Case("fedprox"),
    "superfed-mm": Case("superfed-mm", {"start_fraction": 0.0},
                        ops=("weighted_sum", "mix_endpoints_with_stats", "superfed_sgd_step_",
                             "mix_endpoints")),
    "superfed-lm": Case("superfed-lm", {"start_fraction": 0.5},
                        ops=("weighted_sum", "superfed_stats", "mix_endpoints_with_stats")),
    "aaggff-s": Case("aaggff-s"),
    "aaggff-d": Case("aaggff-d", overrides={"participation": {"kind": "uniform",
                                                              "fraction": 0.5}}),
    "fedau": Case("fedau", overrides={"participation": {"kind": "bernoulli", "fraction": 0.5}}),
    "mifa": Case("mifa"),
    "qfedavg": Case("qfedavg"),
    "fedmgda": Case("fedmgda"),
    "trimmed-mean": Case("trimmed-mean", ops=("trimmed_mean", "weighted_sum")),
    "krum": Case("krum", ops=("pairwise_sq_distances",)),
    "dp": Case("fedavg", overrides={"dp": {"clip": 1.0, "noise_multiplier": 0.5}},
               ops=("update_norms", "private_sum")),
    "attack": Case("fedavg", overrides={"attack": {"kind": "gaussian"}}),
    "apfl": Case("apfl", {"learn_alpha": True}, ops=("weighted_sum", "mix_endpoints")),
    "ditto": Case("ditto", ops=("weighted_sum", "superfed_stats")),
    "pfedme": Case("pfedme", {"inner_steps": 1}, ops=("weighted_sum", "superfed_stats")),
    "fedrep": Case("fedrep", {"head_epochs": 1}),
    "fedevg": Case("fedevg", {"spc": 2, "hidden": [8], "clamp": False},
                   ops=("energy_from_logits", "sgld_step", "sgld_compose_step")),
    "fedcvae": Case("fedcvae", {"spc": 2, "hidden": [8]}),
    "fedgo": Case("fedgo", {"disc_epochs": 1, "server_epochs": 1, "disc_hidden": [8]},
                  SERVER_DATA, ops=("weighted_sum", "ensemble_pseudo_labels", "distill_kl")),
    "fedet-wgan": Case("fedet", {"generator": "wgan_gp", "gan_steps": 1, "disc_epochs": 1,
                                 "distill_set": "generated", "num_generated": 20,
                                 "consensus": "hard", "diversity_lambda": 0.05}, SERVER_DATA,
                       ops=("weighted_sum", "ensemble_pseudo_labels")),
    "cnn-augment-vmap": Case("fedavg", overrides={"vmap": True, "model": {"name": "cnn"},
                                                  "client": {"augment": "crop_flip"}},
                             images=True),
}


def config(case: Case, device: str = "cpu", rounds: int = 2) -> ExperimentConfig:
    """The case's configuration: four clients of a small Gaussian mixture, an MLP, two local
    steps of 16 rows per round."""
    tree: dict[str, Any] = {
        "rounds": rounds, "device": device, "seed": 3,
        "algorithm": case.algorithm, "algorithm_params": case.params,
        "data": {"name": "gaussian_mixture", "num_samples": 320, "num_features": 12,
                 "num_classes": 3},
        "partition": {"num_clients": 4},
        "model": {"name": "mlp", "hidden": [8]},
        "client": {"steps": 2, "batch_size": 16},
    }
    for key, value in case.overrides.items():
        if key == "model" and value.get("name", "mlp") != "mlp":
            tree[key] = value  # another model reads none of the MLP's options
        elif isinstance(value, dict):
            tree.setdefault(key, {}).update(value)
        else:
            tree[key] = value
    return from_dict(ExperimentConfig, tree)


def images() -> Dataset:
    """320 one-channel 8x8 images of three classes (a bright square in a class's corner)."""
    g = torch.Generator(device="cpu").manual_seed(0)
    y = torch.arange(320, device="cpu") % 3
    x = 0.1 * torch.rand(320, 1, 8, 8, generator=g, device="cpu")
    for c in range(3):
        x[y == c, :, 2 * c: 2 * c + 3, 2 * c: 2 * c + 3] += 0.8
    return Dataset.from_tensors(x, y)


def simulation(case: Case, device: str = "cpu", rounds: int = 2, **kwargs) -> Simulation:
    dataset = images() if case.images else None
    return Simulation(config(case, device, rounds), build_strategy(case.algorithm, case.params),
                      dataset=dataset, **kwargs)


# ---------------------------------------------------------------- where tensors are


def misplaced(tree: Any, device: torch.device, what: str) -> list[str]:
    """``what.path on D`` for every tensor of ``tree`` (dicts, lists, dataclass-free) that is
    not on ``device``."""
    out = []
    if isinstance(tree, Tensor):
        if tree.device != device:
            out.append(f"{what} on {tree.device}")
    elif isinstance(tree, Mapping):
        for k, v in tree.items():
            out += misplaced(v, device, f"{what}.{k}")
    elif isinstance(tree, (list, tuple)):
        for i, v in enumerate(tree):
            out += misplaced(v, device, f"{what}[{i}]")
    return out


def _client_data(data: Any) -> dict[str, Tensor]:
    return {n: getattr(data, n) for n in ("train_x", "train_y", "test_x", "test_y")}


class PlacementProbe:
    """Wraps a strategy's methods and records every tensor it receives or returns that is not
    where the simulator's placement rule puts it: models and samples on ``device``, the
    per-client scalars of a round and the client weights on the CPU."""

    def __init__(self, strategy: Strategy, device: torch.device) -> None:
        self.device = device
        self.problems: list[str] = []
        self.calls: Counter[str] = Counter()
        self._wrap(strategy, "train_client", self._train_client)
        self._wrap(strategy, "aggregate", self._aggregate)
        self._wrap(strategy, "client_weights", self._client_weights)
        self._wrap(strategy, "evaluate", self._evaluate)

    def _wrap(self, strategy: Strategy, name: str, check) -> None:
        original = getattr(strategy, name)

        def wrapped(*args):
            self.calls[name] += 1
            return check(original, *args)

        setattr(strategy, name, wrapped)

    def _note(self, tree: Any, device: torch.device, what: str) -> None:
        self.problems += misplaced(tree, device, what)

    def _train_client(self, original, global_state, data, round_index, client_id):
        self._note(global_state, self.device, "train_client(global_state)")
        self._note(_client_data(data), self.device, "train_client(data)")
        update = original(global_state, data, round_index, client_id)
        if update is not None:
            self._note(update.state, self.device, "train_client -> state")
        return update

    def _aggregate(self, original, info: RoundInfo, server):
        self._note(dict(info.global_state), self.device, "RoundInfo.global_state")
        self._note(info.client_states, self.device, "RoundInfo.client_states")
        host = {"participants": info.participants, "num_samples": info.num_samples,
                "train_losses": info.train_losses, "global_losses": info.global_losses,
                "history": info.history.matrix}
        self._note({k: v for k, v in host.items() if v is not None}, HOST, "RoundInfo")
        extra = original(info, server)
        self._note(server.state, self.device, "server.state")
        self._note(server.optimizer.state_dict(), self.device, "server optimizer state")
        return extra

    def _client_weights(self, original, info: RoundInfo):
        weights = original(info)
        self._note(weights, HOST, "client_weights ->")
        return weights

    def _evaluate(self, original, global_state, clients):
        self._note(dict(global_state), self.device, "evaluate(global_state)")
        self._note([_client_data(c) for c in clients], self.device, "evaluate(clients)")
        return original(global_state, clients)


# ---------------------------------------------------------------- which kernels ran


class FedkernelsOpCounter(TorchDispatchMode):
    """Counts the fedkernels ops dispatched within the block, by (name, device type): the
    device is the accelerator among the op's tensor arguments when there is one (the kernel the
    dispatcher picks), else the CPU. Names are the schema's, without the namespace
    (``weighted_sum_``)."""

    def __init__(self) -> None:
        super().__init__()
        self.calls: Counter[tuple[str, str]] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        namespace, _, name = func._schema.name.partition("::")
        if namespace == "fedkernels":
            kinds = {t.device.type for t in tree_leaves((args, kwargs)) if isinstance(t, Tensor)}
            accelerators = sorted(kinds - {"cpu"})
            self.calls[(name, accelerators[0] if accelerators else "cpu")] += 1
        return func(*args, **kwargs)

    def devices(self) -> set[str]:
        return {device for _, device in self.calls}

    def names(self) -> set[str]:
        return {name for name, _ in self.calls}


def final_state(sim: Simulation) -> dict[str, Tensor]:
    """The global model after the run, on the CPU."""
    return {k: v.detach().to("cpu", copy=True) for k, v in sim.server.state.items()}
