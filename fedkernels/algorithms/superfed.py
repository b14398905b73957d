r"""SuPerFed (Hahn et al., KDD'22, "Connecting Low-Loss Subspace for Personalized Federated
Learning"): every client keeps a personal model :math:`l_k` beside its copy :math:`g` of the
global model and trains both at once through their weight-space mixture. Equations, defaults
and the differences from the official code: ``docs/algorithms/superfed.md``.

Client :math:`k` in round :math:`t` (1-based), with :math:`a` the round's global model:

- Phase I, :math:`t \le \lfloor L R \rfloor`: FedProx on :math:`g` alone
  (:math:`\lambda = 0`, the local model frozen).
- Phase II: for every minibatch draw :math:`\lambda \sim U(0,1)` (MM: one for the whole model;
  LM: one per module, shared by the module's tensors), form
  :math:`\theta = (1-\lambda) g + \lambda l_k` with :func:`fedkernels.superfed_mix`, and take one
  SGD step on both endpoints of

  .. math:: \mathrm{CE}(f(x;\theta), y) + \nu\cos^2(g, l_k) + R_{prox}(g, a)

  (one forward/backward through the mixed model via ``torch.func.functional_call``; the
  mixed weights and the regularizers' statistics come from one fused pass over both endpoints
  and the anchor, and their gradients from one fused pass back). The optimizer is
  ``torch.optim.SGD`` with the run's client settings, re-created every round.

Only :math:`g` goes to the server, which averages it by training-set size (FedAvg's fused
aggregate); :math:`l_k` never leaves the client. Local models start from an initialisation of
their own (a per-client stream), not a copy of the global model (the official code's
choice). Every parameter of the model is mixed (the official models have no biases, so there
too every parameter has a local twin). Evaluation: each client's test accuracy of
:math:`\theta(\lambda)` for :math:`\lambda \in \{0, 0.1, \dots, 1\}`, one :math:`\lambda` for all
layers (LM too); the paper's figure is the mean over all clients of each client's best
accuracy on that grid (chosen on the test split itself, an oracle), reported here with a
selection on the client's training split beside it.
"""

from __future__ import annotations

import copy
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any, ClassVar, Literal

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor
from torch.func import functional_call

from fedkernels.ops.mixing import mix_endpoints, superfed_mix, superfed_regularizer
from fedkernels.sim import seeding
from fedkernels.sim.client import ClientUpdate, batch_plan, local_lr
from fedkernels.sim.config import ConfigError
from fedkernels.sim.strategy import SetupInfo

from .fedavg import FedAvg
from .registry import register

# Random streams of their own (beside those of fedkernels.sim.seeding).
LOCAL_INIT = 101  # (seed, LOCAL_INIT, client): the client's local model
MIXING = 102  # (seed, MIXING, round, client): the lambdas of the client's minibatches

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

    def __post_init__(self) -> None:
        if self.nu < 0 or self.mu < 0:
            raise ConfigError("superfed: nu and mu must be >= 0")
        if not 0 <= self.start_fraction <= 1:
            raise ConfigError("superfed: start_fraction must be in [0, 1]")
        if self.numerator_eps < 0:
            raise ConfigError("superfed: numerator_eps must be >= 0")


@dataclass
class SuPerFedLMConfig(SuPerFedConfig):
    nu: float = field(default=2.0, metadata={"help": "orthogonality strength nu (cos^2 term)"})


class _SuPerFed(FedAvg):
    """Shared by the MM and LM variants (module docstring); the server is FedAvg's."""

    layerwise: ClassVar[bool] = False

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        if info.model is None or info.client_config is None:
            raise ConfigError(f"{self.name} needs the simulation's model and client settings")
        self.model = copy.deepcopy(info.model)
        self.client = info.client_config
        self.seed = info.seed
        self.start_round = int(self.config.start_fraction * info.rounds)  # floor(L * R)
        self.names = [n for n, _ in self.model.named_parameters()]
        # LM: the module owning each parameter (its lambda), as an index per tensor.
        owners = [n.rsplit(".", 1)[0] if "." in n else "" for n in self.names]
        modules = list(dict.fromkeys(owners))
        self.module_of_tensor = torch.tensor([modules.index(o) for o in owners])
        self.num_modules = len(modules)
        self.local: dict[int, list[Tensor]] = {}

    # ------------------------------------------------------------------ local models

    def local_model(self, client_id: int, global_state: Mapping[str, Tensor]) -> list[Tensor]:
        """Client ``client_id``'s local endpoint, created on first use."""
        if client_id not in self.local:
            if self.config.local_init == "copy_global":
                init = [global_state[n].detach().clone() for n in self.names]
            else:
                fresh = copy.deepcopy(self.model)
                with seeding.torch_stream(self.seed, LOCAL_INIT, client_id):
                    for module in fresh.modules():
                        if module is not fresh and hasattr(module, "reset_parameters"):
                            module.reset_parameters()
                params = dict(fresh.named_parameters())
                init = [params[n].detach().clone() for n in self.names]
            self.local[client_id] = init
        return self.local[client_id]

    def sample_lambda(self, rng: np.random.Generator) -> Tensor:
        """MM: one lambda ~ U(0,1); LM: one per module, spread over the module's tensors."""
        if not self.layerwise:
            return torch.tensor(rng.uniform(0.0, 1.0), dtype=torch.float32)
        per_module = torch.from_numpy(rng.uniform(0.0, 1.0, self.num_modules)).float()
        return per_module[self.module_of_tensor]

    # ------------------------------------------------------------------ training

    def train_client(
        self, global_state: Mapping[str, Tensor], data: Any, round_index: int, client_id: int
    ) -> ClientUpdate:
        cfg, client = self.config, self.client
        model = self.model
        model.load_state_dict(global_state)
        model.train()
        mixing = round_index + 1 > self.start_round  # the paper counts rounds from 1
        anchor = [global_state[n].detach() for n in self.names]
        g = [a.clone().requires_grad_() for a in anchor]
        local = self.local_model(client_id, global_state)
        l_params = [x.clone().requires_grad_(mixing) for x in local]
        optimizer = torch.optim.SGD(
            g + (l_params if mixing else []),
            lr=local_lr(client, round_index),
            momentum=client.momentum,
            weight_decay=client.weight_decay,
        )
        plan = batch_plan(
            data.num_train,
            client,
            seeding.numpy_rng(self.seed, seeding.BATCHES, round_index, client_id),
        )
        lam_rng = seeding.numpy_rng(self.seed, MIXING, round_index, client_id)
        loss_sum = torch.zeros((), dtype=torch.float64)
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id):
            for rows in plan:
                index = torch.from_numpy(rows)
                if mixing:  # theta and the regularizers from one fused pass (and one back)
                    theta, reg = superfed_mix(
                        g,
                        l_params,
                        self.sample_lambda(lam_rng),
                        anchor,
                        nu=cfg.nu,
                        mu=cfg.mu,
                        prox_form=cfg.prox_form,
                        numerator_eps=cfg.numerator_eps,
                    )
                else:  # Phase I: FedProx on the global endpoint
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

    @torch.no_grad()
    def grid_accuracy(
        self, global_state: Mapping[str, Tensor], clients: list[Any], split: str = "test"
    ) -> Tensor:
        """``[clients, 11]``: accuracy of each client's theta(lambda) on its ``split`` for the
        lambda grid 0, 0.1, ..., 1 (one lambda for all layers)."""
        model = self.model
        model.load_state_dict(global_state)
        model.eval()
        g = [global_state[n] for n in self.names]
        out = torch.zeros(len(clients), len(EVAL_GRID), dtype=torch.float64)
        for k, c in enumerate(clients):
            x, y = (c.test_x, c.test_y) if split == "test" else (c.train_x, c.train_y)
            if len(y) == 0:
                continue
            local = self.local_model(k, global_state)
            for j, lam in enumerate(EVAL_GRID):
                theta = mix_endpoints(g, local, lam)
                logits = functional_call(model, dict(zip(self.names, theta)), (x,))
                out[k, j] = (logits.argmax(1) == y).double().mean()
        model.train()
        return out

    def evaluate(self, global_state: Mapping[str, Tensor], clients: list[Any]) -> dict[str, float]:
        test = self.grid_accuracy(global_state, clients, "test")
        train = self.grid_accuracy(global_state, clients, "train")
        best = test.max(dim=1).values  # the paper's per-client oracle choice
        chosen = train.argmax(dim=1)  # a choice that does not look at the test split
        by_train = test.gather(1, chosen[:, None]).squeeze(1)
        return {
            "personalized_accuracy": float(best.mean()),
            "personalized_accuracy_std": float(best.std(correction=0)),
            "personalized_accuracy_train_selected": float(by_train.mean()),
            "personalized_lambda_train_selected_mean": float(
                torch.tensor(EVAL_GRID, dtype=torch.float64)[chosen].mean()
            ),
            "mixed_accuracy_best_common_lambda": float(test.mean(dim=0).max()),
            "global_endpoint_accuracy": float(test[:, 0].mean()),
            "local_endpoint_accuracy": float(test[:, -1].mean()),
        }

    # ------------------------------------------------------------------ checkpoint

    def state_dict(self) -> dict[str, Any]:
        return {"local": {str(k): list(v) for k, v in self.local.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.local = {int(k): [x.clone() for x in v] for k, v in state["local"].items()}


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
