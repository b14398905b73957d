r"""Personalized baselines of SuPerFed's comparisons, on the shared round loop. Every strategy
keeps a personal model (or a personal part of one) per client, reports the accuracy of each
client's personal model on the client's own test split (:meth:`evaluate`), and lets the server
combine what is shared with the fused :func:`fedkernels.aggregate` (through the simulation's
server, so ``--server.optimizer`` still applies). Update rules, defaults and citations:
``docs/algorithms/personalized.md``.

Notation: :math:`w` is the client's copy of the global model (it starts each round at the
global :math:`w^t`), :math:`v` a personal model, :math:`\eta_t` the run's local learning rate
(``client.lr * client.lr_decay**t``), SGD the run's ``torch.optim.SGD`` settings (momentum,
weight decay), re-created every round. "Local training" is the run's plan of minibatches
(``client.epochs`` or ``client.steps`` of ``client.batch_size``), the same batches the shared
trainer would draw.

- ``local``: no federation; a sampled client trains its own model (local training), nothing is
  aggregated.
- ``fedavg-ft``: FedAvg; before every evaluation each client fine-tunes a copy of the global
  model on its training split (``finetune_epochs``).
- ``fedper``: the body is federated, the head stays on the client; both are trained together.
- ``fedrep``: the head is trained first with the body frozen (``head_epochs``), then the body
  with the head frozen (local training); only the body is aggregated.
- ``lg-fedavg``: the body (representation) stays on the client, the head is federated.
- ``apfl``: per minibatch :math:`w \leftarrow w - \eta\nabla f(w)`,
  :math:`v \leftarrow v - \eta\nabla_v f(\bar v)` with :math:`\bar v = \alpha v + (1-\alpha) w`
  (both gradients at the same iterate), optionally
  :math:`\alpha \leftarrow \Pi_{[0,1]}(\alpha - \eta_\alpha \langle v - w, \nabla f(\bar v)\rangle)`;
  the personalized model is :math:`\alpha_k v_k + (1-\alpha_k) w^t`.
- ``ditto``: :math:`w` by local training (FedAvg), then :math:`v` by SGD on
  :math:`f(v) + \tfrac{\lambda}{2}\|v - w^t\|^2`.
- ``pfedme``: per minibatch (one "local round"), :math:`K` steps
  :math:`\theta \leftarrow \theta - \eta_p(\nabla f(\theta) + \lambda(\theta - w))`, then
  :math:`w \leftarrow w - \eta\lambda(w - \theta)`; the server sets
  :math:`w^{t+1} = (1-\beta) w^t + \beta\,\mathrm{avg}(w_k)`; the personalized model is
  :math:`\theta_k`.

"Head" and "body" split the model's ``state_dict`` keys: the head is the modules or parameters
named by ``head`` (default: the last ``nn.Linear`` module), the body everything else. Personal
parts start as the run's initial global model. A shared upload carries the global model's own
values in its personal entries, so the aggregate leaves them exactly where they are.
"""

from __future__ import annotations

import copy
import dataclasses
from collections.abc import Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, ClassVar

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call

from fedkernels.ops.mixing import mix_endpoints, proximal_term
from fedkernels.sim import seeding
from fedkernels.sim.client import ClientUpdate, batch_indices, batch_plan, local_lr
from fedkernels.sim.config import ClientConfig, ConfigError
from fedkernels.sim.metrics import calibration_errors, distribution_summary
from fedkernels.sim.server import Server
from fedkernels.sim.strategy import RoundInfo, SetupInfo
from fedkernels.sim.vmap import eval_batchable, stacked_eval

from .fedavg import FedAvg
from .registry import register

# Random streams of their own (beside those of fedkernels.sim.seeding).
SECOND_PHASE = 131  # (seed, SECOND_PHASE, round, client): batches of a second local phase
FINETUNE = 132  # (seed, FINETUNE, client): fedavg-ft's fine-tuning batches

HEAD_HELP = (
    "module or parameter names forming the head, comma-separated (default: the last "
    "nn.Linear module); the body is every other entry of the model"
)


# ---------------------------------------------------------------------------------- helpers


def head_keys(model: nn.Module, head: Sequence[str] | None, algorithm: str) -> list[str]:
    """The ``state_dict`` keys of the head of ``model``: every key equal to a name in ``head``
    or under it (``layers.2`` takes ``layers.2.weight`` and ``layers.2.bias``), or those of the
    last ``nn.Linear`` module when ``head`` is ``None``. Raises :class:`ConfigError` when a name
    matches no parameter, or when the head or the body would hold no parameter."""
    keys = list(model.state_dict())
    params = {n for n, _ in model.named_parameters()}
    if head is None:
        linear = [name for name, m in model.named_modules() if isinstance(m, nn.Linear)]
        if not linear:
            raise ConfigError(
                f"{algorithm}: the model has no nn.Linear layer to use as the head; "
                f"name the head's modules with --{algorithm}.head"
            )
        head = [linear[-1]]
    chosen: list[str] = []
    for name in head:
        under = [k for k in keys if name == "" or k == name or k.startswith(name + ".")]
        if not any(k in params for k in under):
            raise ConfigError(
                f"{algorithm}.head: {name!r} names no parameter of the model "
                f"(parameters: {', '.join(n for n, _ in model.named_parameters())})"
            )
        chosen += [k for k in under if k not in chosen]
    if all(k in chosen for k in params):
        raise ConfigError(
            f"{algorithm}.head: the head ({', '.join(head) or 'the whole model'}) holds every "
            "parameter, which leaves no body; use a model with more than one layer or name "
            f"a smaller head with --{algorithm}.head"
        )
    return [k for k in keys if k in chosen]


def phase_plan(
    client: ClientConfig, epochs: int | None, num_samples: int, rng: np.random.Generator
) -> list[np.ndarray]:
    """Minibatches of a training phase: the run's local training (``epochs=None``) or
    ``epochs`` passes over the samples in batches of ``client.batch_size``."""
    if epochs == 0:
        return []
    if epochs is not None:
        client = dataclasses.replace(client, epochs=epochs, steps=None)
    return batch_plan(num_samples, client, rng)


@contextmanager
def trainable_only(model: nn.Module, names: set[str]) -> Iterator[list[nn.Parameter]]:
    """Within the block only the parameters ``names`` require gradients (the others are frozen
    and get no gradient); yields them in ``named_parameters`` order."""
    params = list(model.named_parameters())
    flags = [p.requires_grad for _, p in params]
    try:
        for n, p in params:
            p.requires_grad_(n in names)
        yield [p for n, p in params if n in names]
    finally:
        for (_, p), flag in zip(params, flags):
            p.requires_grad_(flag)


def sgd_phase(
    model: nn.Module,
    params: list[nn.Parameter],
    data: Any,
    plan: list[np.ndarray],
    lr: float,
    client: ClientConfig,
) -> tuple[float, int]:
    """Minimizes the minibatch cross-entropy of ``model`` over ``params`` with the run's SGD
    (momentum, weight decay) at learning rate ``lr``; returns the sum of the minibatch losses
    and the number of steps."""
    if not plan:
        return 0.0, 0
    optimizer = torch.optim.SGD(
        params, lr=lr, momentum=client.momentum, weight_decay=client.weight_decay
    )
    device = data.train_x.device
    loss_sum = torch.zeros((), dtype=torch.float64, device=device)
    for index in batch_indices(plan, device):
        loss = F.cross_entropy(model(data.train_x[index]), data.train_y[index])
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        loss_sum += loss.detach()
    return float(loss_sum), len(plan)


def _clone(state: Mapping[str, Tensor], keys: Sequence[str] | None = None) -> dict[str, Tensor]:
    return {k: state[k].detach().clone() for k in (state if keys is None else keys)}


def _check_count(algorithm: str, name: str, value: int | None, minimum: int) -> None:
    if value is not None and value < minimum:
        raise ConfigError(f"{algorithm}.{name} must be >= {minimum} (got {value})")


def personalized_metrics(logits: list[Tensor | None], clients: list[Any]) -> dict[str, Any]:
    """Per-client ``accuracy``, ``ece``, ``mce`` (``[N]`` float64 on the CPU, NaN for a client
    without test samples) of the personalized models' test ``logits`` (one entry per client,
    on the clients' device), and the pooled ``ece_pooled``/``mce_pooled`` over every client's
    samples."""
    n = len(clients)
    accuracy, ece, mce = (torch.full((n,), float("nan"), dtype=torch.float64, device="cpu")
                          for _ in range(3))
    kept = [(k, z) for k, z in enumerate(logits) if z is not None]
    out: dict[str, Any] = {"accuracy": accuracy, "ece": ece, "mce": mce}
    if not kept:
        return out
    ids = [k for k, _ in kept]
    z = torch.cat([z for _, z in kept])
    y = torch.cat([clients[k].test_y for k in ids])
    device = z.device
    sizes = torch.tensor([len(clients[k].test_y) for k in ids], device=device)
    owner = torch.repeat_interleave(torch.arange(len(ids), device=device), sizes)
    correct = (z.argmax(1) == y).double()
    index = torch.tensor(ids, device="cpu")
    hits = torch.zeros(len(ids), dtype=torch.float64, device=device).index_add_(0, owner, correct)
    accuracy[index] = (hits / sizes).cpu()
    client_ece, client_mce = calibration_errors(z, y, owner, len(ids))
    ece[index], mce[index] = client_ece.cpu(), client_mce.cpu()
    pooled_ece, pooled_mce = calibration_errors(z, y)
    out["ece_pooled"], out["mce_pooled"] = float(pooled_ece[0]), float(pooled_mce[0])
    return out


def personalized_summary(metrics: dict[str, Any]) -> dict[str, Any]:
    """The ``personalized_*`` keys a strategy's evaluation reports from
    :func:`personalized_metrics` (``PersonalizedStrategy.evaluate``)."""
    accuracy = metrics["accuracy"]
    finite = accuracy[~accuracy.isnan()]
    out: dict[str, Any] = {}
    if finite.numel():
        for key, value in distribution_summary(finite).items():
            out["personalized_accuracy" if key == "mean" else f"personalized_accuracy_{key}"] = (
                value
            )
        for key in ("ece", "mce"):
            values = metrics[key][~metrics[key].isnan()]
            out[f"personalized_{key}"] = float(values.mean())
            out[f"personalized_{key}_pooled"] = metrics[f"{key}_pooled"]
    out["personalized_client_accuracy"] = accuracy.tolist()
    return out


# ---------------------------------------------------------------------------------- base


class PersonalizedStrategy(FedAvg):
    """Shared by the baselines: per-client personal state (checkpointed), the personalized
    evaluation, and a working copy of the model. FedAvg's server (sample-size weights)."""

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        if info.model is None or info.client_config is None:
            raise ConfigError(f"{self.name} needs the simulation's model and client settings")
        self.model = copy.deepcopy(info.model)
        self.client = info.client_config
        self.seed = info.seed
        self.device = info.device
        self.initial = _clone(info.model.state_dict())
        self.param_names = [n for n, _ in self.model.named_parameters()]
        self.personal: dict[int, dict[str, Tensor]] = {}

    # -------------------------------------------------------------- what a subclass defines

    def personal_state(
        self, client_id: int, global_state: Mapping[str, Tensor], data: Any
    ) -> dict[str, Tensor]:
        """The full ``state_dict`` of client ``client_id``'s personalized model."""
        raise NotImplementedError

    # -------------------------------------------------------------- shared pieces

    def batches(self, data: Any, round_index: int, client_id: int) -> list[np.ndarray]:
        """The run's local training plan: the batches the shared trainer would draw."""
        rng = seeding.numpy_rng(self.seed, seeding.BATCHES, round_index, client_id)
        return batch_plan(data.num_train, self.client, rng)

    def second_batches(
        self, data: Any, epochs: int | None, round_index: int, client_id: int
    ) -> list[np.ndarray]:
        """Batches of a second local phase (its own stream)."""
        rng = seeding.numpy_rng(self.seed, SECOND_PHASE, round_index, client_id)
        return phase_plan(self.client, epochs, data.num_train, rng)

    # Evaluation runs up to ``eval_chunk`` clients' personalized models in one vmapped forward
    # (fedkernels.sim.vmap.stacked_eval) instead of a load_state_dict and a forward per client;
    # ``eval_chunk_rows`` bounds the padded test rows of a chunk (memory). A subclass whose
    # personal_state must run in client order, or whose model vmap cannot run, sets
    # ``batched_eval = False``.
    batched_eval: ClassVar[bool] = True
    eval_chunk: ClassVar[int] = 64
    eval_chunk_rows: ClassVar[int] = 1 << 16

    @torch.no_grad()
    def personalized_logits(
        self, global_state: Mapping[str, Tensor], clients: list[Any]
    ) -> list[Tensor | None]:
        """Each client's personalized model's logits on its own test split (None for a client
        without test samples). Clients are batched in chunks of similar test sizes (so
        :meth:`personal_state` is called in that order); a model or states the batched path
        cannot take fall back to one client at a time, with the same results up to float
        rounding."""
        model = self.eval_model()
        model.eval()
        out: list[Tensor | None] = [None] * len(clients)
        ids = [k for k, c in enumerate(clients) if len(c.test_y)]
        if not (self.batched_eval and getattr(self, "_eval_batchable", True)
                and eval_batchable(model)):
            for k in ids:
                out[k] = self._sequential_logits(model, self.personal_state(k, global_state, clients[k]),
                                                 clients[k].test_x)
            return out
        ids.sort(key=lambda k: len(clients[k].test_y))
        start = 0
        while start < len(ids):
            end = start + 1  # sizes ascend: the chunk's padded rows are (end - start) * the last
            while (end < len(ids) and end - start < self.eval_chunk
                   and (end + 1 - start) * len(clients[ids[end]].test_y) <= self.eval_chunk_rows):
                end += 1
            chunk = ids[start:end]
            states = [self.personal_state(k, global_state, clients[k]) for k in chunk]
            inputs = [clients[k].test_x for k in chunk]
            try:
                logits = stacked_eval(model, states, inputs)
            except RuntimeError:  # an op vmap has no rule for: this model stays sequential
                self._eval_batchable = False
                logits = None
            if logits is None:
                logits = [self._sequential_logits(model, s, x) for s, x in zip(states, inputs)]
            for k, z in zip(chunk, logits):
                out[k] = z
            start = end
        return out

    @staticmethod
    def _sequential_logits(model: nn.Module, state: Mapping[str, Tensor], x: Tensor) -> Tensor:
        model.load_state_dict(state)
        model.eval()
        return model(x)

    def eval_model(self) -> nn.Module:
        if not hasattr(self, "_eval_model"):
            self._eval_model = copy.deepcopy(self.model)
        return self._eval_model

    def evaluate(self, global_state: Mapping[str, Tensor], clients: list[Any]) -> dict[str, Any]:
        """``personalized_accuracy`` (mean over clients) and its ``_std``, ``_worst10``,
        ``_best10``, ``_min``, ``_max``, ``_gini``; ``personalized_client_accuracy`` lists
        every client's value; ``personalized_ece``/``_mce`` (mean over clients) and
        ``_ece_pooled``/``_mce_pooled`` (every client's test samples, each through its own
        model)."""
        return personalized_summary(
            personalized_metrics(self.personalized_logits(global_state, clients), clients)
        )

    def state_dict(self) -> dict[str, Any]:
        return {"personal": {str(k): dict(v) for k, v in self.personal.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.personal = {
            int(k): {n: t.to(self.device, copy=True) for n, t in v.items()}
            for k, v in state["personal"].items()
        }


# ---------------------------------------------------------------------------------- local


@register
class LocalOnly(PersonalizedStrategy):
    """No federation: a client trains its own model (starting from the run's initial model)
    in every round it is sampled, with the run's local training; nothing is aggregated and the
    global model stays the initial one."""

    name = "local"
    supports_central_dp = False  # nothing is aggregated

    def personal_state(self, client_id, global_state, data):
        return self.personal.get(client_id, self.initial)

    def train_client(self, global_state, data, round_index, client_id):
        model = self.model
        model.load_state_dict(self.personal_state(client_id, global_state, data))
        model.train()
        plan = self.batches(data, round_index, client_id)
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            with trainable_only(model, set(self.param_names)) as params:
                loss, steps = sgd_phase(
                    model, params, data, plan, local_lr(self.client, round_index), self.client
                )
        self.personal[client_id] = _clone(model.state_dict())
        return ClientUpdate(_clone(global_state), loss / max(steps, 1))

    def aggregate(self, info: RoundInfo, server: Server) -> dict[str, float]:
        return {}  # nothing is shared


# ---------------------------------------------------------------------------------- fedavg-ft


@dataclass
class FedAvgFineTuneConfig:
    finetune_epochs: int | None = field(
        default=None,
        metadata={
            "help": "epochs of fine-tuning before evaluation (default: the run's local "
            "training, client.epochs or client.steps; 0 evaluates the global model)"
        },
    )
    finetune_lr: float | None = field(
        default=None, metadata={"help": "fine-tuning learning rate (default: client.lr)"}
    )

    def __post_init__(self) -> None:
        _check_count("fedavg-ft", "finetune_epochs", self.finetune_epochs, 0)
        if self.finetune_lr is not None and self.finetune_lr <= 0:
            raise ConfigError(f"fedavg-ft.finetune_lr must be > 0 (got {self.finetune_lr})")


@register
class FedAvgFineTune(PersonalizedStrategy):
    """FedAvg (the shared trainer, the vmap path too); at every evaluation each client
    fine-tunes a copy of the global model on its training split with the run's SGD, and is
    evaluated with it. The fine-tuned copies are thrown away."""

    name = "fedavg-ft"
    config_class = FedAvgFineTuneConfig

    def train_client(self, global_state, data, round_index, client_id):
        return None  # the shared trainer: plain FedAvg

    def personal_state(self, client_id, global_state, data):
        cfg = self.config
        model = self.model
        model.load_state_dict(global_state)
        model.train()
        rng = seeding.numpy_rng(self.seed, FINETUNE, client_id)
        plan = phase_plan(self.client, cfg.finetune_epochs, data.num_train, rng)
        lr = self.client.lr if cfg.finetune_lr is None else cfg.finetune_lr
        with torch.enable_grad(), seeding.torch_stream(self.seed, FINETUNE, client_id,
                                                       device=self.device):
            with trainable_only(model, set(self.param_names)) as params:
                sgd_phase(model, params, data, plan, lr, self.client)
        return _clone(model.state_dict())


# ---------------------------------------------------------------------------------- head/body


@dataclass
class HeadConfig:
    head: list[str] | None = field(default=None, metadata={"help": HEAD_HELP})


class PartialSharing(PersonalizedStrategy):
    """A model split into a head and a body, one of them personal (``personal_part``)."""

    personal_part: ClassVar[str] = "head"

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        head = head_keys(self.model, self.config.head, self.name)
        keys = list(self.initial)
        self.head_keys = head
        self.body_keys = [k for k in keys if k not in head]
        self.personal_keys = head if self.personal_part == "head" else self.body_keys
        self.shared_keys = [k for k in keys if k not in self.personal_keys]

    def personal_state(self, client_id, global_state, data):
        state = dict(global_state)
        state.update(self.personal.get(client_id, {k: self.initial[k] for k in self.personal_keys}))
        return state

    def train_phases(self, data: Any, round_index: int, client_id: int) -> tuple[float, int]:
        """Trains ``self.model`` (holding the client's model); returns the loss sum and steps of
        the phase that trains the shared part."""
        model = self.model
        with trainable_only(model, set(self.param_names)) as params:
            return sgd_phase(
                model,
                params,
                data,
                self.batches(data, round_index, client_id),
                local_lr(self.client, round_index),
                self.client,
            )

    def train_client(self, global_state, data, round_index, client_id):
        model = self.model
        model.load_state_dict(self.personal_state(client_id, global_state, data))
        model.train()
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            loss, steps = self.train_phases(data, round_index, client_id)
        trained = model.state_dict()
        self.personal[client_id] = _clone(trained, self.personal_keys)
        upload = _clone(trained)
        upload.update(_clone(global_state, self.personal_keys))  # not shared: unchanged
        return ClientUpdate(upload, loss / max(steps, 1))


@register
class FedPer(PartialSharing):
    """FedPer: the base layers (body) are federated, the personalization layers (head) stay on
    the client; local training updates both together."""

    name = "fedper"
    config_class = HeadConfig
    personal_part = "head"


@register
class LGFedAvg(PartialSharing):
    """LG-FedAvg: local representation layers (body) stay on the client, the global head is
    federated; local training updates both together."""

    name = "lg-fedavg"
    config_class = HeadConfig
    personal_part = "body"


@dataclass
class FedRepConfig(HeadConfig):
    head_epochs: int = field(
        default=10,
        metadata={"help": "epochs of head training (body frozen) before the body's (FedRep paper: 10)"},
    )

    def __post_init__(self) -> None:
        _check_count("fedrep", "head_epochs", self.head_epochs, 0)


@register
class FedRep(PartialSharing):
    """FedRep: ``head_epochs`` epochs on the head with the body frozen, then the run's local
    training on the body with the head frozen; only the body is aggregated."""

    name = "fedrep"
    config_class = FedRepConfig
    personal_part = "head"

    def train_phases(self, data, round_index, client_id):
        model, lr = self.model, local_lr(self.client, round_index)
        head = {n for n in self.param_names if n in self.head_keys}
        body = set(self.param_names) - head
        with trainable_only(model, head) as params:
            plan = self.second_batches(data, self.config.head_epochs, round_index, client_id)
            sgd_phase(model, params, data, plan, lr, self.client)
        with trainable_only(model, body) as params:
            return sgd_phase(
                model, params, data, self.batches(data, round_index, client_id), lr, self.client
            )


# ---------------------------------------------------------------------------------- apfl


@dataclass
class APFLConfig:
    alpha: float = field(
        default=0.25,
        metadata={
            "help": "mixing weight alpha of the personal model (initial value when learned; "
            "0.25: the fixed alpha of SuPerFed's comparison)"
        },
    )
    learn_alpha: bool = field(
        default=False,
        metadata={"help": "learn each client's alpha by projected gradient descent (adaptive APFL)"},
    )
    alpha_lr: float | None = field(
        default=None,
        metadata={"help": "learning rate of alpha (default: the round's local learning rate)"},
    )
    alpha_l2: float = field(
        default=0.0,
        metadata={"help": "L2 term c*alpha added to alpha's gradient (APFL's official code: 0.02)"},
    )

    def __post_init__(self) -> None:
        if not 0.0 <= self.alpha <= 1.0:
            raise ConfigError(f"apfl.alpha must be in [0, 1] (got {self.alpha})")
        if self.alpha_lr is not None and self.alpha_lr <= 0:
            raise ConfigError(f"apfl.alpha_lr must be > 0 (got {self.alpha_lr})")
        if self.alpha_l2 < 0:
            raise ConfigError(f"apfl.alpha_l2 must be >= 0 (got {self.alpha_l2})")


@register
class APFL(PersonalizedStrategy):
    r"""APFL: each client keeps :math:`v_k` and :math:`\alpha_k`; per minibatch both
    :math:`w` and :math:`v` take a step from the same iterate (module docstring), the mixture
    :math:`\bar v = \alpha v + (1-\alpha) w` formed by the fused ``mix_endpoints`` op (whose
    backward gives :math:`\alpha\nabla f(\bar v)` to :math:`v` and
    :math:`\langle \nabla f(\bar v), v - w\rangle` to :math:`\alpha`). :math:`w` is uploaded."""

    name = "apfl"
    config_class = APFLConfig

    def setup(self, info: SetupInfo) -> None:
        super().setup(info)
        self.alpha: dict[int, float] = {}

    def personal_params(self, client_id: int) -> list[Tensor]:
        state = self.personal.get(client_id, self.initial)
        return [state[n] for n in self.param_names]

    def alpha_of(self, client_id: int) -> float:
        return self.alpha.get(client_id, self.config.alpha)

    def personal_state(self, client_id, global_state, data):
        w = [global_state[n] for n in self.param_names]
        mixed = mix_endpoints(w, self.personal_params(client_id), self.alpha_of(client_id))
        state = dict(global_state)
        state.update(zip(self.param_names, mixed))
        return state

    def train_client(self, global_state, data, round_index, client_id):
        cfg, client, model, names = self.config, self.client, self.model, self.param_names
        model.load_state_dict(global_state)
        model.train()
        lr = local_lr(client, round_index)
        alpha_lr = lr if cfg.alpha_lr is None else cfg.alpha_lr
        w = [global_state[n].detach().clone().requires_grad_() for n in names]
        v = [t.clone().requires_grad_() for t in self.personal_params(client_id)]
        # host-side, as the mixing op takes lambda (its gradient comes back there too)
        alpha = torch.tensor(self.alpha_of(client_id), dtype=torch.float64, device="cpu")
        alpha.requires_grad_(cfg.learn_alpha)
        settings = dict(lr=lr, momentum=client.momentum, weight_decay=client.weight_decay)
        opt_w = torch.optim.SGD(w, **settings)
        opt_v = torch.optim.SGD(v, **settings)
        plan = self.batches(data, round_index, client_id)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            for index in batch_indices(plan, self.device):
                x, y = data.train_x[index], data.train_y[index]
                loss_w = F.cross_entropy(functional_call(model, dict(zip(names, w)), (x,)), y)
                v_bar = mix_endpoints([t.detach() for t in w], v, alpha)
                # the mixture runs on copies of the buffers: the running statistics that go
                # to the server are those of w's own forward passes (BatchNorm)
                buffers = {n: b.clone() for n, b in model.named_buffers()}
                loss_v = F.cross_entropy(
                    functional_call(model, (dict(zip(names, v_bar)), buffers), (x,)), y
                )
                opt_w.zero_grad(set_to_none=True)
                opt_v.zero_grad(set_to_none=True)
                alpha.grad = None
                (loss_w + loss_v).backward()
                opt_w.step()
                opt_v.step()
                if cfg.learn_alpha:
                    with torch.no_grad():
                        step = alpha.grad + cfg.alpha_l2 * alpha
                        alpha = (alpha - alpha_lr * step).clamp(0.0, 1.0).requires_grad_()
                loss_sum += loss_w.detach()
        self.personal[client_id] = {n: t.detach() for n, t in zip(names, v)}
        if cfg.learn_alpha:
            self.alpha[client_id] = float(alpha.detach())
        upload = _clone(model.state_dict())  # buffers
        upload.update({n: t.detach() for n, t in zip(names, w)})
        return ClientUpdate(upload, float(loss_sum) / max(len(plan), 1))

    def state_dict(self) -> dict[str, Any]:
        state = super().state_dict()
        state["alpha"] = {str(k): v for k, v in self.alpha.items()}
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.alpha = {int(k): float(v) for k, v in state["alpha"].items()}


# ---------------------------------------------------------------------------------- ditto


@dataclass
class DittoConfig:
    lam: float = field(
        default=1.0,
        metadata={
            "help": "lambda of the proximal term lambda/2*||v - w_t||^2 (the Ditto paper tunes "
            "it per data set; 1: SuPerFed's setting)"
        },
    )
    personal_epochs: int | None = field(
        default=None,
        metadata={
            "help": "epochs of the personal model's update per round (default: the run's "
            "local training, the same work as the global update)"
        },
    )

    def __post_init__(self) -> None:
        if self.lam < 0:
            raise ConfigError(f"ditto.lam must be >= 0 (got {self.lam})")
        _check_count("ditto", "personal_epochs", self.personal_epochs, 1)


@register
class Ditto(PersonalizedStrategy):
    r"""Ditto: the global copy :math:`w` gets the run's local training (exactly FedAvg's
    client update) and is uploaded; the personal model :math:`v_k` then takes SGD steps on
    :math:`f(v) + \tfrac{\lambda}{2}\|v - w^t\|^2` (the fused ``proximal_term`` op), anchored at
    the round's global model :math:`w^t`."""

    name = "ditto"
    config_class = DittoConfig

    def personal_state(self, client_id, global_state, data):
        state = dict(global_state)
        personal = self.personal.get(client_id, self.initial)
        state.update({n: personal[n] for n in self.param_names})
        return state

    def train_client(self, global_state, data, round_index, client_id):
        client, model, names = self.client, self.model, self.param_names
        lr = local_lr(client, round_index)
        model.load_state_dict(global_state)
        model.train()
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            with trainable_only(model, set(names)) as params:
                loss, steps = sgd_phase(
                    model, params, data, self.batches(data, round_index, client_id), lr, client
                )
        upload = _clone(model.state_dict())
        # the personal model, on its own batches
        anchor = [global_state[n].detach() for n in names]
        personal = self.personal.get(client_id, self.initial)
        v = [personal[n].detach().clone().requires_grad_() for n in names]
        optimizer = torch.optim.SGD(
            v, lr=lr, momentum=client.momentum, weight_decay=client.weight_decay
        )
        plan = self.second_batches(data, self.config.personal_epochs, round_index, client_id)
        with seeding.torch_stream(self.seed, SECOND_PHASE, round_index, client_id,
                                  device=self.device):
            for index in batch_indices(plan, self.device):
                logits = functional_call(model, dict(zip(names, v)), (data.train_x[index],))
                objective = F.cross_entropy(logits, data.train_y[index])
                if self.config.lam:
                    objective = objective + proximal_term(v, anchor, self.config.lam, "paper")
                optimizer.zero_grad(set_to_none=True)
                objective.backward()
                optimizer.step()
        self.personal[client_id] = {n: t.detach() for n, t in zip(names, v)}
        return ClientUpdate(upload, loss / max(steps, 1))


# ---------------------------------------------------------------------------------- pfedme


@dataclass
class PFedMeConfig:
    lam: float = field(
        default=15.0, metadata={"help": "lambda of the Moreau envelope (pFedMe paper, MNIST: 15)"}
    )
    inner_steps: int = field(
        default=5,
        metadata={"help": "K: gradient steps on the personalized model per minibatch (pFedMe paper: 5)"},
    )
    personal_lr: float = field(
        default=0.09,
        metadata={"help": "learning rate of the K inner steps (pFedMe paper, MNIST DNN: 0.09)"},
    )
    beta: float = field(
        default=1.0,
        metadata={"help": "server mixing: w <- (1-beta) w + beta avg(w_k) (pFedMe paper: 1)"},
    )

    def __post_init__(self) -> None:
        if self.lam <= 0:
            raise ConfigError(f"pfedme.lam must be > 0 (got {self.lam})")
        _check_count("pfedme", "inner_steps", self.inner_steps, 1)
        if self.personal_lr <= 0:
            raise ConfigError(f"pfedme.personal_lr must be > 0 (got {self.personal_lr})")
        if self.beta <= 0:
            raise ConfigError(f"pfedme.beta must be > 0 (got {self.beta})")


@register
class PFedMe(PersonalizedStrategy):
    r"""pFedMe: per minibatch of the run's local training, :math:`K` plain gradient steps of
    rate ``personal_lr`` on :math:`f(\theta) + \tfrac{\lambda}{2}\|\theta - w\|^2` (the fused
    ``proximal_term`` op; :math:`\theta` carries over from one minibatch to the next, starting
    at :math:`w^t`), then :math:`w \leftarrow w - \eta_t\lambda(w - \theta)` (no momentum or
    weight decay: the paper's update). :math:`w` is uploaded; the server's weights are
    :math:`\beta\,n_k/\sum_j n_j`, so the plain server step is
    :math:`(1-\beta) w^t + \beta\sum_k p_k w_k`. The personalized model is the client's last
    :math:`\theta` (the global model before its first round)."""

    name = "pfedme"
    config_class = PFedMeConfig

    def personal_state(self, client_id, global_state, data):
        state = dict(global_state)
        state.update(self.personal.get(client_id, {}))
        return state

    def client_weights(self, info: RoundInfo) -> Tensor:
        return self.config.beta * info.num_samples / info.num_samples.sum()

    def train_client(self, global_state, data, round_index, client_id):
        cfg, model, names = self.config, self.model, self.param_names
        model.load_state_dict(global_state)
        model.train()
        eta = local_lr(self.client, round_index)
        w = [global_state[n].detach().clone() for n in names]
        theta = [t.clone().requires_grad_() for t in w]
        plan = self.batches(data, round_index, client_id)
        loss_sum = torch.zeros((), dtype=torch.float64, device=self.device)
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            for index in batch_indices(plan, self.device):
                x, y = data.train_x[index], data.train_y[index]
                for _ in range(cfg.inner_steps):
                    loss = F.cross_entropy(functional_call(model, dict(zip(names, theta)), (x,)), y)
                    objective = loss + proximal_term(theta, w, cfg.lam, "paper")
                    grads = torch.autograd.grad(objective, theta)
                    with torch.no_grad():
                        torch._foreach_add_(theta, grads, alpha=-cfg.personal_lr)
                with torch.no_grad():  # w - eta*lam*(w - theta)
                    torch._foreach_lerp_(w, [t.detach() for t in theta], eta * cfg.lam)
                loss_sum += loss.detach()
        self.personal[client_id] = {n: t.detach().clone() for n, t in zip(names, theta)}
        upload = _clone(model.state_dict())
        upload.update(zip(names, w))
        return ClientUpdate(upload, float(loss_sum) / max(len(plan), 1))
