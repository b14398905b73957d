r"""Local training of one client, and the minibatch plan both training paths share.

Client k in round t starts from the global model :math:`x_t` and runs SGD (PyTorch's
``torch.optim.SGD``: momentum :math:`\mu`, weight decay :math:`\lambda`, no dampening) with the
learning rate :math:`\gamma_t = \gamma\,\rho^t` (``lr * lr_decay**t``) on

.. math:: \ell_k(x) = \mathrm{CE}(x; \text{minibatch}) + P(x, x_t),

where :math:`P` is the strategy's local penalty (FedProx: :math:`\tfrac{\mu}{2}\|x - x_t\|^2`).
With ``client.augment`` each minibatch of images is augmented first (:mod:`.augment`), with
draws from the client's own torch stream.
"""

from __future__ import annotations

import copy
import itertools
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from . import seeding
from .augment import build_augmentation
from .config import ClientConfig
from .federation import ClientData
from .strategy import Strategy


@dataclass
class ClientUpdate:
    """The result of one client's local training."""

    state: dict[str, Tensor]  # the trained model's full state_dict
    train_loss: float  # mean minibatch cross-entropy over the local steps


def local_lr(config: ClientConfig, round_index: int) -> float:
    """``gamma_t = lr * lr_decay**t``."""
    return config.lr * config.lr_decay**round_index


def batch_plan(
    num_samples: int, config: ClientConfig, rng: np.random.Generator
) -> list[np.ndarray]:
    """The minibatches (row indices) of one client's local training in one round.

    Epoch mode: ``epochs`` passes, each over a fresh permutation cut into batches of
    ``batch_size`` (the last one smaller). Step mode (``steps`` set): ``steps`` batches of
    ``min(batch_size, n)`` rows taken in order from consecutive permutations (a batch that
    spans two permutations may hold a row twice). A trailing batch of a single sample is merged into
    the batch before it (BatchNorm cannot train on one sample).
    """
    b = config.batch_size
    if config.steps is None:
        batches = []
        for _ in range(config.epochs):
            order = rng.permutation(num_samples)
            batches += _cut(order, b)
        return batches
    needed = config.steps * min(b, num_samples)
    order = np.concatenate(
        [rng.permutation(num_samples) for _ in range(-(-needed // num_samples))]
    )[:needed]
    return np.split(order, config.steps)


def plan_indices(
    num_samples: int, config: ClientConfig, rng: np.random.Generator, device: torch.device
) -> list[Tensor]:
    """``batch_indices(batch_plan(num_samples, config, rng), device)``, the same draws and
    rows, built from the whole order at once instead of from cut and rejoined pieces."""
    b = config.batch_size
    if config.steps is not None:
        return batch_indices(batch_plan(num_samples, config, rng), device)
    sizes = _cut_sizes(num_samples, b) * config.epochs
    if not sizes:
        return []
    orders = [rng.permutation(num_samples) for _ in range(config.epochs)]
    flat = torch.from_numpy(orders[0] if len(orders) == 1 else np.concatenate(orders))
    return list(flat.to(device).split(sizes))


def batch_indices(plan: list[np.ndarray], device: torch.device) -> list[Tensor]:
    """The plan's minibatches as int64 index tensors on ``device``, copied there in one piece
    (one host-to-device copy per client and round instead of one per minibatch)."""
    if not plan:
        return []
    flat = torch.from_numpy(np.concatenate(plan)).to(device)
    return list(flat.split([len(rows) for rows in plan]))


def _cut_sizes(n: int, size: int) -> list[int]:
    """Batch sizes of one pass over ``n`` rows: ``size`` each, the last smaller, and a trailing
    batch of one row merged into the one before it."""
    sizes = [size] * (n // size) + ([n % size] if n % size else [])
    if len(sizes) > 1 and sizes[-1] == 1:
        sizes[-2:] = [sizes[-2] + 1]
    return sizes


def _cut(order: np.ndarray, size: int) -> list[np.ndarray]:
    sizes = _cut_sizes(len(order), size)
    return np.split(order, np.cumsum(sizes)[:-1]) if sizes else []


def model_device(model: torch.nn.Module) -> torch.device:
    """The device of ``model``'s first parameter or buffer (the CPU for a module without
    either)."""
    first = next(itertools.chain(model.parameters(), model.buffers()), None)
    return torch.device("cpu") if first is None else first.device


class LocalSGD:
    """``torch.optim.SGD``'s update (momentum, weight decay; no dampening, no Nesterov) with the
    arithmetic of its default path: per tensor on the CPU, foreach kernels on other devices, so
    the same bits. Ours because building a first ``torch.optim`` optimizer imports
    ``torch._dynamo``: about a second of every sequential run's start on a 2-core machine."""

    def __init__(self, params: list[Tensor], momentum: float, weight_decay: float) -> None:
        self.params = params
        self.momentum = momentum
        self.weight_decay = weight_decay
        self.foreach = bool(params) and params[0].device.type != "cpu"
        self.reset()

    def reset(self) -> None:
        """Forgets the momentum buffers (a new client starts without them)."""
        self.buffers: list[Tensor | None] = [None] * len(self.params)

    @torch.no_grad()
    def step(self, lr: float) -> None:
        with_grad = [i for i, p in enumerate(self.params) if p.grad is not None]
        params = [self.params[i] for i in with_grad]
        grads = [self.params[i].grad for i in with_grad]
        if self.foreach:
            self._step_foreach(with_grad, params, grads, lr)
            return
        for i, param, grad in zip(with_grad, params, grads):
            if self.weight_decay != 0:
                grad = grad.add(param, alpha=self.weight_decay)
            if self.momentum != 0:
                buf = self.buffers[i]
                if buf is None:
                    buf = self.buffers[i] = grad.detach().clone()
                else:
                    buf.mul_(self.momentum).add_(grad, alpha=1)
                grad = buf
            param.add_(grad, alpha=-lr)

    def _step_foreach(self, with_grad: list[int], params: list[Tensor], grads: list[Tensor],
                      lr: float) -> None:
        if self.weight_decay != 0:
            grads = torch._foreach_add(grads, params, alpha=self.weight_decay)
        if self.momentum != 0:
            if all(self.buffers[i] is not None for i in with_grad):
                bufs = [self.buffers[i] for i in with_grad]
                torch._foreach_mul_(bufs, self.momentum)
                torch._foreach_add_(bufs, grads, alpha=1)
            else:
                for i, grad in zip(with_grad, grads):
                    if self.buffers[i] is None:
                        self.buffers[i] = grad.detach().clone()
                    else:
                        self.buffers[i].mul_(self.momentum).add_(grad, alpha=1)
            grads = [self.buffers[i] for i in with_grad]
        torch._foreach_add_(params, grads, alpha=-lr)


class LocalTrainer:
    """Trains clients one after another on a reusable working copy of the model.
    ``image_shape`` (default: the model's ``image_shape`` attribute) is how ``client.augment``
    views the rows."""

    def __init__(
        self,
        model: nn.Module,
        config: ClientConfig,
        strategy: Strategy,
        seed: int,
        *,
        image_shape: tuple[int, ...] | None = None,
    ) -> None:
        self.model = copy.deepcopy(model)
        self.config = config
        self.strategy = strategy
        self.seed = seed
        self.parameter_names = [n for n, _ in self.model.named_parameters()]
        self.device = model_device(self.model)
        # Built once and refilled per client: in a profiled round, load_state_dict, a fresh
        # optimizer and a per-batch parameter dict cost a third of a small model's training.
        self.params = dict(self.model.named_parameters())
        self.state_keys = list(self.model.state_dict(keep_vars=True))
        self.state_targets = list(self.model.state_dict(keep_vars=True).values())
        self.optimizer = LocalSGD(list(self.model.parameters()), config.momentum,
                                  config.weight_decay)
        self.uses_penalty = type(strategy).local_penalty is not Strategy.local_penalty
        self.transforms_loss = (type(strategy).transform_local_loss
                                is not Strategy.transform_local_loss)
        self.modules = list(self.model.modules())
        self.param_list = list(self.params.values())
        self.augment = build_augmentation(
            config.augment, image_shape or getattr(model, "image_shape", None)
        )

    def train(
        self, global_state: dict[str, Tensor], data: ClientData, round_index: int, client_id: int
    ) -> ClientUpdate:
        """Local training of client ``client_id`` in round ``round_index`` (module docstring);
        minibatch order from ``(seed, BATCHES, round, client)``, torch randomness (augmentation,
        dropout) from ``(seed, LOCAL_TRAINING, round, client)``. Trains on the model's device,
        where ``data`` must be."""
        model, config, optimizer = self.model, self.config, self.optimizer
        self._load(global_state)
        if not all(m.training for m in self.modules):
            model.train()
        global_params = ({n: global_state[n] for n in self.parameter_names}
                         if self.uses_penalty else None)
        optimizer.reset()  # no momentum carried from the previous client
        lr = local_lr(config, round_index)
        batches = plan_indices(
            data.num_train,
            config,
            seeding.numpy_rng(self.seed, seeding.BATCHES, round_index, client_id),
            self.device,
        )
        # float64 sums of the float32 losses in batch order: a Python float on the CPU (the
        # same IEEE additions as a float64 tensor, without a tensor op per batch)
        on_cpu = self.device.type == "cpu"
        loss_sum = 0.0 if on_cpu else torch.zeros((), dtype=torch.float64, device=self.device)
        params = self.param_list
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index, client_id,
                                  device=self.device):
            for index in batches:
                x = data.train_x[index]
                if self.augment is not None:
                    x = self.augment(x)
                loss = F.cross_entropy(model(x), data.train_y[index])
                penalty = (self.strategy.local_penalty(self.params, global_params)
                           if self.uses_penalty else None)
                for p in params:  # optimizer.zero_grad(set_to_none=True) without its wrappers
                    p.grad = None
                objective = (self.strategy.transform_local_loss(loss) if self.transforms_loss
                             else loss)
                (objective if penalty is None else objective + penalty).backward()
                optimizer.step(lr)
                if on_cpu:
                    loss_sum += loss.item()
                else:
                    loss_sum += loss.detach()
        state = dict(zip(self.state_keys, [v.detach().clone() for v in self.state_targets]))
        return ClientUpdate(state, float(loss_sum) / len(batches))

    def _load(self, global_state: dict[str, Tensor]) -> None:
        """``load_state_dict`` for the layout this trainer was built with: one foreach copy
        into the model's parameters and buffers, the same values."""
        if global_state.keys() != set(self.state_keys):
            self.model.load_state_dict(global_state)  # its own error names what differs
            return
        with torch.no_grad():
            torch._foreach_copy_(self.state_targets, [global_state[k] for k in self.state_keys])
