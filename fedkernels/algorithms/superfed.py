r"""SuPerFed (Hahn et al., KDD'22, "Connecting Low-Loss Subspace for Personalized Federated
Learning"): every client keeps a personal model :math:`l_k` beside its copy :math:`g` of the
global model and trains both at once through their weight-space mixture. Equations, defaults
and the differences from the official code: ``docs/algorithms/superfed.md``.

Client :math:`k` in round :math:`t` (1-based), with :math:`a` the round's global model:

- Phase I, :math:`t \le \lfloor L R \rfloor`: FedProx on :math:`g` alone
  (:math:`\lambda = 0`, the local model frozen).
- Phase II: for every minibatch draw :math:`\lambda \sim U(0,1)` (MM: one for the whole model;
  LM: one per module, shared by the module's tensors), form
  :math:`\theta = (1-\lambda) g + \lambda l_k`, and take one SGD step on both endpoints of

  .. math:: \mathrm{CE}(f(x;\theta), y) + \nu\cos^2(g, l_k) + R_{prox}(g, a)

  (one forward/backward through the mixed model via ``torch.func.functional_call``; the
  mixed weights and the regularizers' statistics come from one fused pass over both endpoints
  and the anchor, and the SGD update of both from one fused pass back:
  :class:`fedkernels.SuPerFedSGD`). The optimizer has the run's client settings (those of
  ``torch.optim.SGD``) and is re-created every round.

Only :math:`g` goes to the server, which averages it by training-set size (FedAvg's fused
aggregate); :math:`l_k` never leaves the client. Local models start from an initialisation of
their own (a per-client stream), not a copy of the global model (the official code's
choice). Every parameter of the model is mixed (the official models have no biases, so there
too every parameter has a local twin). Evaluation: each client's accuracy of
:math:`\theta(\lambda)` for :math:`\lambda \in \{0, 0.1, \dots, 1\}`, one :math:`\lambda` for all
layers (LM too). ``personalized_accuracy`` is the test accuracy at the :math:`\lambda` each
client picks on its validation split (``validation_fraction`` of its training samples, held
out of training; ``lambda_selection``); the paper's figure, each client's best test accuracy
on the grid (an oracle choice), is ``personalized_accuracy_oracle``.
"""

from __future__ import annotations

import contextlib
import copy
import dataclasses
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from fedkernels.ops.mixing import mix_endpoints, superfed_regularizer
from fedkernels.ops.mixing_sgd import SuPerFedSGD
from fedkernels.sim import seeding
from fedkernels.sim.client import ClientUpdate, batch_indices, batch_plan, local_lr
from fedkernels.sim.config import ConfigError
from fedkernels.sim.federation import ClientData, split_client
from fedkernels.sim.strategy import SetupInfo

from .fedavg import FedAvg
from .personalized import personalized_metrics, personalized_summary
from .registry import register

# Random streams of their own (beside those of fedkernels.sim.seeding).
LOCAL_INIT = 101  # (seed, LOCAL_INIT, client): the client's local model
MIXING = 102  # (seed, MIXING, round, client): the lambdas of the client's minibatches
VALIDATION = 103  # (seed, VALIDATION, client): the client's validation rows

EVAL_GRID = tuple(i / 10 for i in range(11))


@dataclass
class SuPerFedConfig:
    nu: float = field(default=1.0, metadata={"help": "orthogonality strength nu (cos^2 term)"})
    mu: float = field(default=0.01, metadata={"help": "proximal strength mu"})
    start_fraction: float = field(
        default=0.4,
        metadata={"help": "L: mixing starts after round floor(L*R) (FedProx warm-up before)"},
    )
    prox_form: Literal["paper", "code"] = field(
        default="paper",
        metadata={"help": "paper: mu/2*||g-a||^2; code: mu*sum_p ||g_p-a_p|| (official code)"},
    )
    numerator_eps: float = field(
        default=0.0,
        metadata={"help": "per-element eps in the cosine's numerator (official code: 1e-6)"},
    )
    local_init: Literal["independent", "copy_global"] = field(
        default="independent",
        metadata={"help": "local model: own initialisation per client, or a copy of the global"},
    )
    lambda_selection: Literal["validation", "train", "test"] = field(
        default="validation",
        metadata={
            "help": "split on which each client picks its lambda for personalized_accuracy: "
            "validation (held out of its training samples), train, or test (the paper's "
            "oracle choice)"
        },
    )
    validation_fraction: float = field(
        default=0.2,
        metadata={
            "help": "lambda_selection=validation: fraction of each client's training samples "
            "held out of training for choosing lambda (at least one when it has two)"
        },
    )

    def __post_init__(self) -> None:
        if self.nu < 0 or self.mu < 0:
            raise ConfigError("superfed: nu and mu must be >= 0")
        if not 0 <= self.start_fraction <= 1:
            raise ConfigError("superfed: start_fraction must be in [0, 1]")
        if self.numerator_eps < 0:
            raise ConfigError("superfed: numerator_eps must be >= 0")
        if not 0 < self.validation_fraction < 1:
            raise ConfigError(
                f"superfed: validation_fraction must be in (0, 1), got {self.validation_fraction}"
            )


@dataclass
class SuPerFedLMConfig(SuPerFedConfig):
    nu: float = field(default=2.0, metadata={"help": "orthogonality strength nu (cos^2 term)"})


class _SuPerFed(FedAvg):
    """Shared by the MM and LM variants (module docstring); the server is FedAvg's."""

    layerwise: ClassVar[bool] = False
    evaluates_on_clients = True  # the local models live on the clients
    runs_apart = True  # their state through client_state_dict

    def rounds_dependence(self, old_rounds: int, played: int) -> str | None:
        old_start = int(self.config.start_fraction * old_rounds)
        # round t (0-based) mixes when t + 1 > start: the played rounds differ when a start
        # lies below the last of them
        if old_start == self.start_round or min(old_start, self.start_round) >= played:
            return None
        return (f"mixing starts after round floor(start_fraction * rounds) ({old_start} for "
                f"{old_rounds} rounds, {self.start_round} for {self.info.rounds})")

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        if info.model is None or info.client_config is None:
            raise ConfigError(f"{self.name} needs the simulation's model and client settings")
        self.model = copy.deepcopy(info.model)
        self.client = info.client_config
        self.seed = info.seed
        self.device = info.device
        self.start_round = int(self.config.start_fraction * info.rounds)  # floor(L * R)
        self.names = [n for n, _ in self.model.named_parameters()]
        # LM: the module owning each parameter (its lambda), as an index per tensor.
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in self.names]
        modules = list(dict.fromkeys(owners))
        self.module_of_tensor = torch.tensor([modules.index(o) for o in owners], device="cpu")
        self.num_modules = len(modules)
        self.local: dict[int, list[Tensor]] = {}
        self._splits: dict[int, tuple[ClientData, ClientData | None]] = {}

    # ------------------------------------------------------------------ local models

    def local_model(self, client_id: int, global_state: Mapping[str, Tensor]) -> list[Tensor]:
        """Client ``client_id``'s local endpoint, created on first use."""
        if client_id not in self.local:
            if self.config.local_init == "copy_global":
                init = [global_state[n].detach().clone() for n in self.names]
            else:
                # initialised on the CPU, from the client's stream: the same on every device
                fresh = copy.deepcopy(self.model).to("cpu")
                with seeding.torch_stream(self.seed, LOCAL_INIT, client_id):
                    for module in fresh.modules():
                        if module is not fresh and hasattr(module, "reset_parameters"):
                            module.reset_parameters()
                params = dict(fresh.named_parameters())
                init = [params[n].detach().to(self.device) for n in self.names]
            self.local[client_id] = init
        return self.local[client_id]

    def split(self, data: ClientData, client_id: int) -> tuple[ClientData, ClientData | None]:
        """``(fit, validation)``: with ``lambda_selection=validation`` the client's training
        samples cut into the part it trains on and the part it picks lambda on (a seeded
        shuffle of its own; none held out from a client with one training sample), else the
        whole training split and None."""
        if self.config.lambda_selection != "validation":
            return data, None
        if client_id not in self._splits:
            if data.num_train < 2:
                self._splits[client_id] = (data, None)
            else:
                rng = seeding.numpy_rng(self.seed, VALIDATION, client_id)
                fit, val = split_client(
                    np.arange(data.num_train), self.config.validation_fraction, rng
                )
                self._splits[client_id] = (_rows(data, fit), _rows(data, val))
        return self._splits[client_id]

    def sample_lambda(self, rng: np.random.Generator) -> Tensor:
        """MM: one lambda ~ U(0,1); LM: one per module, spread over the module's tensors (on
        the CPU, where the mixing ops take lambda)."""
        if not self.layerwise:
            return torch.tensor(rng.uniform(0.0, 1.0), dtype=torch.float32, device="cpu")
        per_module = torch.from_numpy(rng.uniform(0.0, 1.0, self.num_modules)).float()
        return per_module[self.module_of_tensor]

    # ------------------------------------------------------------------ training

    def train_client(
        self, global_state: Mapping[str, Tensor], data: Any, round_index: int, client_id: int
    ) -> ClientUpdate:
        cfg, client = self.config, self.client
        model = self.model
        data, _ = self.split(data, client_id)  # the validation rows are never trained on
        model.load_state_dict(global_state)
        model.train()
        mixing = round_index + 1 > self.start_round  # the paper counts rounds from 1
        anchor = [global_state[n].detach() for n in self.names]
        sgd = dict(lr=local_lr(client, round_index), momentum=client.momentum,
                   weight_decay=client.weight_decay)
        if mixing:  # SGD on both endpoints, fused with the mixing backward
            g = [a.clone() for a in anchor]
            l_params = [x.clone() for x in self.local_model(client_id, global_state)]
            optimizer = SuPerFedSGD(
                g, l_params, anchor, nu=cfg.nu, mu=cfg.mu, prox_form=cfg.prox_form,
                numerator_eps=cfg.numerator_eps, **sgd,
            )
        else:  # Phase I: FedProx on the global endpoint
            g = [a.clone().requires_grad_() for a in anchor]
            optimizer = torch.optim.SGD(g, **sgd)
        plan = batch_plan(
            data.num_train,
            client,
            seeding.numpy_rng(self.seed, seeding.BATCHES, round_index, client_id),
        )
        lam_rng = seeding.numpy_rng(self.seed, MIXING, round_index, client_id)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            for index in batch_indices(plan, self.device):
                if mixing:  # theta and the regularizers from one fused pass (and one back)
                    theta, reg = optimizer.mix(self.sample_lambda(lam_rng))
                else:
                    theta = g
                    reg = superfed_regularizer(
                        g, None, anchor, nu=0.0, mu=cfg.mu, prox_form=cfg.prox_form
                    )
                logits = functional_call(
                    model, dict(zip(self.names, theta)), (data.train_x[index],)
                )
                loss = F.cross_entropy(logits, data.train_y[index])
                optimizer.zero_grad(set_to_none=True)
                (loss + reg).backward()
                optimizer.step()
                loss_sum += loss.detach()
        if mixing:
            self.local[client_id] = [x.detach() for x in l_params]
        state = {k: v.detach().clone() for k, v in model.state_dict().items()}  # buffers
        state.update({n: x.detach() for n, x in zip(self.names, g)})
        return ClientUpdate(state, float(loss_sum) / max(len(plan), 1))

    # ------------------------------------------------------------------ evaluation

    @contextlib.contextmanager
    def _evaluating(self, global_state: Mapping[str, Tensor]) -> Iterator[None]:
        """The working model holds ``global_state``'s buffers, in eval mode, within the block."""
        self.model.load_state_dict(global_state)
        self.model.eval()
        try:
            yield
        finally:
            self.model.train()

    def _split_rows(self, client: Any, client_id: int, split: str
                    ) -> tuple[Tensor, Tensor] | None:
        """``(x, y)`` of the client's ``split``: ``test``, ``train`` (the samples it trains
        on) or ``validation``; None where that split is empty."""
        fit, val = self.split(client, client_id)
        if split == "test":
            rows = (client.test_x, client.test_y)
        elif split == "train":
            rows = (fit.train_x, fit.train_y)
        else:
            rows = None if val is None else (val.train_x, val.train_y)
        return None if rows is None or len(rows[0]) == 0 else rows

    @torch.no_grad()
    def _split_logits(self, global_state: Mapping[str, Tensor], client: Any, client_id: int,
                      split: str) -> Tensor | None:
        """``[11, n, C]`` logits of the client's theta(lambda) on its ``split`` for the lambda
        grid (inside :meth:`_evaluating`); None where the split is empty."""
        rows = self._split_rows(client, client_id, split)
        if rows is None:
            return None
        g = [global_state[n] for n in self.names]
        local = self.local_model(client_id, global_state)
        return torch.stack([
            functional_call(self.model, dict(zip(self.names, mix_endpoints(g, local, lam))),
                            (rows[0],))
            for lam in EVAL_GRID
        ])

    def _split_accuracy(self, global_state: Mapping[str, Tensor], client: Any, client_id: int,
                        split: str) -> Tensor:
        """``[11]``: the client's accuracy on its ``split`` for the lambda grid (0 where the
        split is empty)."""
        z = self._split_logits(global_state, client, client_id, split)
        if z is None:
            return torch.zeros(len(EVAL_GRID), dtype=torch.float64, device="cpu")
        y = self._split_rows(client, client_id, split)[1]
        return (z.argmax(2) == y).double().mean(1).cpu()

    @torch.no_grad()
    def grid_logits(
        self, global_state: Mapping[str, Tensor], clients: list[Any], split: str = "test"
    ) -> list[Tensor | None]:
        """Per client, ``[11, n, C]`` logits of its theta(lambda) for the lambda grid 0, 0.1,
        ..., 1 (one lambda for all layers) on its ``split`` (``test``, ``train``: the samples
        it trains on, or ``validation``); None where that split is empty."""
        with self._evaluating(global_state):
            return [self._split_logits(global_state, c, k, split) for k, c in enumerate(clients)]

    def grid_accuracy(
        self, global_state: Mapping[str, Tensor], clients: list[Any], split: str = "test"
    ) -> Tensor:
        """``[clients, 11]``: accuracy of each client's theta(lambda) on its ``split`` for the
        lambda grid (:meth:`grid_logits`; 0 where the split is empty)."""
        with self._evaluating(global_state):
            rows = [self._split_accuracy(global_state, c, k, split) for k, c in enumerate(clients)]
        if not rows:
            return torch.zeros(0, len(EVAL_GRID), dtype=torch.float64, device="cpu")
        return torch.stack(rows)

    def _selection_splits(self) -> tuple[str, ...]:
        return ("train", "validation") if self.config.lambda_selection == "validation" \
            else ("train",)

    def evaluate(self, global_state: Mapping[str, Tensor], clients: list[Any]) -> dict[str, Any]:
        """``personalized_*`` at each client's lambda chosen on ``lambda_selection``'s split
        (accuracy statistics, ECE, MCE; ties go to the smaller lambda, a client with an empty
        split takes lambda = 0), ``personalized_accuracy_oracle`` (the paper's per-client best
        test accuracy), the train-selected (and validation-selected) accuracy, the best lambda
        common to all clients and both endpoints: :meth:`combine_client_evaluations` of every
        client's :meth:`evaluate_client`."""
        parts = [self.evaluate_client(global_state, c, k) for k, c in enumerate(clients)]
        return self.combine_client_evaluations(global_state, clients, parts)

    @torch.no_grad()
    def evaluate_client(
        self, global_state: Mapping[str, Tensor], client: Any, client_id: int
    ) -> dict[str, Tensor]:
        """What :meth:`evaluate` needs of one client, who alone holds its local model: its
        test logits on the lambda grid (``test_logits``, ``[11, n, C]``, absent for an empty
        test split) and its grid accuracies on the splits that choose lambda
        (``train_accuracy``, ``validation_accuracy``, ``[11]``)."""
        part: dict[str, Tensor] = {}
        with self._evaluating(global_state):
            logits = self._split_logits(global_state, client, client_id, "test")
            if logits is not None:
                part["test_logits"] = logits
            for split in self._selection_splits():
                part[f"{split}_accuracy"] = self._split_accuracy(global_state, client,
                                                                 client_id, split)
        return part

    def combine_client_evaluations(
        self, global_state: Mapping[str, Tensor], clients: list[Any],
        parts: list[dict[str, Tensor] | None],
    ) -> dict[str, Any]:
        """:meth:`evaluate`'s metrics from the clients' parts (:meth:`evaluate_client`); the
        statistics cover the clients that replied, and ``personalized_missing_clients`` lists
        the others."""
        present = [k for k, part in enumerate(parts) if part is not None]
        grid_size = len(EVAL_GRID)
        test = torch.zeros(len(present), grid_size, dtype=torch.float64, device="cpu")
        logits: list[Tensor | None] = [None] * len(clients)
        for row, k in enumerate(present):
            z = parts[k].get("test_logits")
            if z is not None:
                z = z.to(clients[k].test_y.device)
                logits[k] = z
                test[row] = (z.argmax(2) == clients[k].test_y).double().mean(1).cpu()
        grids = {"test": test}
        for split in self._selection_splits():
            grids[split] = torch.stack([
                parts[k][f"{split}_accuracy"].double().cpu().reshape(grid_size) for k in present
            ]) if present else test.clone()
        chosen = grids[self.config.lambda_selection].argmax(dim=1)  # first maximum
        at_chosen: list[Tensor | None] = [None] * len(clients)
        for row, k in enumerate(present):
            if logits[k] is not None:
                at_chosen[k] = logits[k][int(chosen[row])]
        out = personalized_summary(personalized_metrics(at_chosen, clients))
        if not present:
            return {**out, "personalized_missing_clients": list(range(len(clients)))}
        grid = torch.tensor(EVAL_GRID, dtype=torch.float64, device="cpu")
        out["personalized_lambda_mean"] = float(grid[chosen].mean())
        out["personalized_accuracy_oracle"] = float(test.max(dim=1).values.mean())
        for split in ("train", "validation"):
            if split in grids:
                picked = test.gather(1, grids[split].argmax(dim=1, keepdim=True)).squeeze(1)
                out[f"personalized_accuracy_{split}_selected"] = float(picked.mean())
        out["mixed_accuracy_best_common_lambda"] = float(test.mean(dim=0).max())
        out["global_endpoint_accuracy"] = float(test[:, 0].mean())
        out["local_endpoint_accuracy"] = float(test[:, -1].mean())
        if len(present) < len(clients):
            out["personalized_missing_clients"] = sorted(set(range(len(clients))) - set(present))
        return out

    # ------------------------------------------------------------------ clients apart

    def client_state_dict(self, client_id: int) -> dict[str, Tensor]:
        """The client's local endpoint ``l_k`` (none before its first use)."""
        local = self.local.get(client_id)
        return {} if local is None else {f"local.{i}": x for i, x in enumerate(local)}

    def load_client_state_dict(self, client_id: int, state: Mapping[str, Tensor]) -> None:
        if not state:
            self.local.pop(client_id, None)
            return
        expected = [f"local.{i}" for i in range(len(self.names))]
        if sorted(state) != sorted(expected):
            raise ValueError(f"{self.name}: client {client_id}'s kept state has "
                             f"{len(state)} tensors, its local model {len(expected)}")
        self.local[client_id] = [state[key].to(self.device, copy=True) for key in expected]

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"local": {str(k): list(v) for k, v in self.local.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local = {int(k): [x.to(self.device, copy=True) for x in v]
                      for k, v in state["local"].items()}


def _rows(data: ClientData, rows: np.ndarray) -> ClientData:
    """``data`` with its training split cut down to the positions ``rows``."""
    index = torch.from_numpy(rows).to(data.train_x.device)
    return dataclasses.replace(
        data,
        train_x=data.train_x[index],
        train_y=data.train_y[index],
        train_index=data.train_index[rows],
    )


@register
class SuPerFedMM(_SuPerFed):
    """SuPerFed with model mixing: one lambda per minibatch for the whole model."""

    name = "superfed-mm"
    config_class = SuPerFedConfig
    layerwise = False


@register
class SuPerFedLM(_SuPerFed):
    """SuPerFed with layer mixing: one lambda per module per minibatch."""

    name = "superfed-lm"
    config_class = SuPerFedLMConfig
    layerwise = True
