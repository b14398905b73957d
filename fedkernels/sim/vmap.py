r"""Training all of a round's clients at once with ``torch.func``.

The K participants' parameters are stacked into ``[K, ...]`` tensors and every local step runs
the clients' losses with ``vmap`` and one autograd pass over their sum (``vmap(grad(loss))``
for models with an op that has no batching rule): one batched forward and backward instead of
K small ones, which is where the time of CPU simulations with small models goes.

Clients whose minibatch plans differ (different data sizes) are padded: step s of client k
uses the rows of its own plan (the same :func:`~fedkernels.sim.client.batch_plan` the
sequential path uses), padded to the largest batch with a 0/1 row mask, so its loss is
:math:`\sum_i m_i \ell_i / \sum_i m_i`, the mean over its real rows; a client whose plan has
ended is frozen by an ``active`` mask. The SGD step is PyTorch's (momentum :math:`\mu`,
weight decay :math:`\lambda`, no dampening) written on the stacked tensors:

.. math:: g \leftarrow \nabla + \lambda x,\quad b \leftarrow g \text{ (first step) or }
          \mu b + g,\quad x \leftarrow x - \gamma_t b.

So the result equals the sequential path up to float rounding. Models whose layers mix the
rows of a batch (BatchNorm) would see the padding and cannot use this path.
"""

from __future__ import annotations

import copy

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.func import functional_call, grad_and_value, vmap
from torch.nn.utils.parametrizations import _SpectralNorm

from . import seeding
from .augment import build_augmentation
from .client import ClientUpdate, batch_plan, local_lr, model_device
from .config import ClientConfig, ConfigError
from .federation import ClientData
from .strategy import Strategy


def check_batchable(model: nn.Module) -> None:
    """Raises :class:`ConfigError` if ``model`` cannot be trained on the batched path."""
    for name, module in model.named_modules():
        if isinstance(module, nn.modules.batchnorm._BatchNorm):
            raise ConfigError(
                f"vmap client training cannot handle BatchNorm (layer {name!r}): padded rows would "
                "enter the batch statistics; use model.batch_norm=false (model.norm=group or none "
                "for the paper models) or vmap=false"
            )
        if isinstance(module, _SpectralNorm):
            # its power iteration writes the shared u, v buffers in place at every forward
            raise ConfigError(
                f"vmap client training cannot handle spectral norm (layer {name!r}); use vmap=false"
            )


def eval_batchable(model: nn.Module) -> bool:
    """Whether :func:`stacked_eval` may run ``model``: its eval-mode forward must treat every
    row on its own (BatchNorm does, with its running statistics) and keep no state outside
    the ``state_dict`` (spectral norm's power iteration vectors are not worth the risk)."""
    return not any(isinstance(m, _SpectralNorm) for m in model.modules())


def stacked_eval(
    model: nn.Module, states: list[dict[str, Tensor]], inputs: list[Tensor]
) -> list[Tensor] | None:
    """``model`` (in eval mode, no gradients) run with ``states[k]`` on ``inputs[k]`` for every
    k, as one ``vmap(functional_call)`` over the states stacked along a new first dimension and
    the inputs zero padded to the longest; returns each input's output rows, or ``None`` when
    the states do not match the model's ``state_dict`` entry for entry (keys, shapes, dtypes,
    devices), so the caller's ``load_state_dict`` path can report or cast as it would.

    An entry that is the same tensor in every state (a shared body, the buffers) is passed
    once, unstacked."""
    reference = model.state_dict()
    first = states[0]
    if set(first) != set(reference):
        return None
    for n, ref in reference.items():
        for s in states:
            t = s[n]
            if t.shape != ref.shape or t.dtype != ref.dtype or t.device != ref.device:
                return None
    shared = {n: t for n, t in first.items() if all(s[n] is t for s in states)}
    stacked = {n: torch.stack([s[n] for s in states]) for n in first if n not in shared}
    x = _stack_rows(inputs)

    def forward(p: dict[str, Tensor], rows: Tensor) -> Tensor:
        return functional_call(model, (p, shared), (rows,))

    out = vmap(forward)(stacked, x)
    return [out[k, : t.shape[0]] for k, t in enumerate(inputs)]


class BatchedTrainer:
    """Trains a list of clients with one vmapped step per local step (module docstring)."""

    def __init__(
        self,
        model: nn.Module,
        config: ClientConfig,
        strategy: Strategy,
        seed: int,
        *,
        image_shape: tuple[int, ...] | None = None,
    ) -> None:
        check_batchable(model)
        self.model = copy.deepcopy(model)
        self.device = model_device(self.model)
        if getattr(model, "stacked_conv_as_matmul", False) and self.device.type == "cpu":
            convs_as_matmuls(self.model)
        self.config = config
        self.strategy = strategy
        self.seed = seed
        self.parameter_names = [n for n, _ in self.model.named_parameters()]
        # Gradients by one autograd pass over the vmapped losses, until an op without a
        # batching rule makes torch.func.grad necessary (see train).
        self.autograd_batches = True
        self.augment = build_augmentation(
            config.augment, image_shape or getattr(model, "image_shape", None)
        )

    def train(
        self,
        global_state: dict[str, Tensor],
        clients: list[ClientData],
        round_index: int,
        client_ids: list[int],
    ) -> list[ClientUpdate]:
        """Local training of ``clients`` (ids ``client_ids``) in round ``round_index``, with the
        minibatch plans of the sequential path; augmentation and dropout draw from
        ``(seed, LOCAL_TRAINING, round)``, so they differ from the sequential path's."""
        config, k_count = self.config, len(clients)
        plans = [
            batch_plan(
                c.num_train, config, seeding.numpy_rng(self.seed, seeding.BATCHES, round_index, cid)
            )
            for c, cid in zip(clients, client_ids)
        ]
        index, mask, active = (t.to(self.device) for t in _pad_plans(plans))
        x_all = _stack_rows([c.train_x for c in clients])
        y_all = _stack_rows([c.train_y for c in clients])

        names = self.parameter_names
        params = {n: global_state[n].unsqueeze(0).repeat_interleave(k_count, 0) for n in names}
        buffers = {n: t for n, t in global_state.items() if n not in params}
        global_params = {n: global_state[n] for n in names}
        strategy, model = self.strategy, self.model

        def losses(p: dict[str, Tensor], x: Tensor, y: Tensor, m: Tensor) -> tuple[Tensor, Tensor]:
            logits = functional_call(model, (p, buffers), (x,))
            # cross_entropy(reduction="none") as its parts: under vmap the fused op runs a
            # decomposition whose first call imports sympy (about 0.4 s); the values are equal.
            nll = -F.log_softmax(logits, dim=-1).gather(-1, y.unsqueeze(-1)).squeeze(-1)
            data = (nll * m).sum() / m.sum().clamp_min(1.0)
            objective = strategy.transform_local_loss(data)
            penalty = strategy.local_penalty(p, global_params)
            return (objective if penalty is None else objective + penalty), data

        batched_losses = vmap(losses, randomness="different")
        per_client_grads = vmap(grad_and_value(losses, has_aux=True), randomness="different")

        def autograd_step(p: dict[str, Tensor], x: Tensor, y: Tensor, m: Tensor):
            # The clients' losses are independent, so the gradient of their sum with respect to
            # the stacked parameters is every client's own gradient: one plain autograd pass
            # instead of torch.func.grad, whose first call imports torch._dynamo (about 1 s).
            leaves = [p[n].detach().requires_grad_() for n in names]
            with torch.enable_grad():
                objective, data = batched_losses(dict(zip(names, leaves)), x, y, m)
                found = torch.autograd.grad(objective.sum(), leaves, allow_unused=True)
            return {n: torch.zeros_like(leaf) if g is None else g
                    for n, leaf, g in zip(names, leaves, found)}, data.detach()

        def step(p: dict[str, Tensor], x: Tensor, y: Tensor, m: Tensor):
            if self.autograd_batches:
                rng = _rng_state(self.device)
                try:
                    return autograd_step(p, x, y, m)
                except RuntimeError as err:
                    # An op without a batching rule (the LSTM's): vmap cannot loop over the
                    # clients for it while autograd records, torch.func.grad can.
                    if "Batching rule not implemented" not in str(err):
                        raise
                    _set_rng_state(self.device, rng)
                    self.autograd_batches = False
            grads, (_, data) = per_client_grads(p, x, y, m)
            return grads, data

        lr = local_lr(config, round_index)
        rows = torch.arange(k_count, device=self.device).unsqueeze(1)
        momentum: dict[str, Tensor] = {}
        loss_sum = torch.zeros(k_count, dtype=torch.float64, device=self.device)
        model.train()
        with seeding.torch_stream(self.seed, seeding.LOCAL_TRAINING, round_index,
                                  device=self.device):
            for s in range(index.shape[0]):
                x = x_all[rows, index[s]]
                if self.augment is not None:  # padding rows too: the mask drops them anyway
                    x = self.augment(x.flatten(0, 1)).view_as(x)
                grads, data_loss = step(params, x, y_all[rows, index[s]], mask[s])
                on = active[s]
                for n in names:
                    p, g = params[n], grads[n]
                    if config.weight_decay:
                        g = g + config.weight_decay * p
                    if config.momentum:
                        if s > 0:
                            g = _where(on, config.momentum * momentum[n] + g, momentum[n])
                        momentum[n] = g
                    params[n] = _where(on, p - lr * g, p)
                loss_sum += torch.where(on, data_loss.double(), 0.0)

        mean_losses = (loss_sum / active.sum(dim=0).double()).tolist()  # one copy to the host
        order = list(global_state)
        return [
            ClientUpdate(
                {n: (params[n][k] if n in params else buffers[n]).clone() for n in order},
                mean_losses[k],
            )
            for k in range(k_count)
        ]


def conv1d_as_matmul(x: Tensor, weight: Tensor, bias: Tensor | None, stride: int,
                     padding: int) -> Tensor:
    """``F.conv1d(x, weight, bias, stride, padding)`` for ``x`` of ``[B, C_in, L]`` as one
    matrix product over the input's taps (equal up to float rounding). Under ``vmap`` over
    clients it becomes a batched matrix product, where ``F.conv1d`` becomes a grouped
    convolution."""
    if x.dim() != 3 or weight.dim() != 3 or weight.shape[1] != x.shape[1]:
        raise ValueError(f"conv1d_as_matmul: x [B, C_in, L] and weight [C_out, C_in, width] "
                         f"expected, got {tuple(x.shape)} and {tuple(weight.shape)}")
    if stride < 1 or padding < 0 or x.shape[-1] + 2 * padding < weight.shape[-1]:
        raise ValueError(f"conv1d_as_matmul: stride {stride}, padding {padding} and width "
                         f"{weight.shape[-1]} give no output position on length {x.shape[-1]}")
    batch, channels, _ = x.shape
    out_channels, _, width = weight.shape
    padded = F.pad(x, (padding, padding)).transpose(0, 1)  # [C_in, B, L + 2 padding]
    length = (padded.shape[-1] - width) // stride + 1
    span = stride * (length - 1) + 1
    # [C_in, width, B, L_out]: tap j of output position l reads input position stride·l + j
    taps = torch.stack([padded[..., j: j + span: stride] for j in range(width)], dim=1)
    out = torch.matmul(weight.reshape(out_channels, channels * width),
                       taps.reshape(channels * width, batch * length))
    out = out.view(out_channels, batch, length)
    if bias is not None:
        out = out + bias[:, None, None]
    return out.permute(1, 0, 2)


class _MatmulConv1d(nn.Conv1d):
    """``nn.Conv1d`` whose batched 3-D forward is :func:`conv1d_as_matmul`."""

    def _conv_forward(self, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        out_length = (input.shape[-1] + 2 * self.padding[0] - self.kernel_size[0]) \
            // self.stride[0] + 1
        if input.dim() != 3 or out_length < 1:
            return super()._conv_forward(input, weight, bias)
        return conv1d_as_matmul(input, weight, bias, self.stride[0], self.padding[0])


def convs_as_matmuls(model: nn.Module) -> None:
    """Runs the plain ``nn.Conv1d`` layers of ``model`` (no groups, dilation or padding
    other than zeros) as :func:`conv1d_as_matmul`, in place; parameters and names stay."""
    for module in model.modules():
        if (type(module) is nn.Conv1d and module.groups == 1 and module.dilation == (1,)
                and module.padding_mode == "zeros" and not isinstance(module.padding, str)):
            module.__class__ = _MatmulConv1d


def _rng_state(device: torch.device) -> tuple:
    cuda = torch.cuda.get_rng_state(device) if device.type == "cuda" else None
    return torch.default_generator.get_state(), cuda


def _set_rng_state(device: torch.device, state: tuple) -> None:
    torch.default_generator.set_state(state[0])
    if state[1] is not None:
        torch.cuda.set_rng_state(state[1], device)


def _where(on: Tensor, new: Tensor, old: Tensor) -> Tensor:
    return torch.where(on.view(-1, *([1] * (new.dim() - 1))), new, old)


def _stack_rows(tensors: list[Tensor]) -> Tensor:
    """``[K, n_max, ...]``, each client's rows first, zero padded."""
    out = tensors[0].new_zeros(
        (len(tensors), max(t.shape[0] for t in tensors), *tensors[0].shape[1:])
    )
    for k, t in enumerate(tensors):
        out[k, : t.shape[0]] = t
    return out


def _pad_plans(plans: list[list[np.ndarray]]) -> tuple[Tensor, Tensor, Tensor]:
    """``index [S, K, B]`` (padding points at row 0), ``mask [S, K, B]`` and ``active [S, K]``,
    on the CPU."""
    steps = max(len(p) for p in plans)
    width = max(len(b) for p in plans for b in p)
    index = np.zeros((steps, len(plans), width), dtype=np.int64)
    mask = np.zeros((steps, len(plans), width), dtype=np.float32)
    for k, plan in enumerate(plans):
        for s, rows in enumerate(plan):
            index[s, k, : len(rows)] = rows
            mask[s, k, : len(rows)] = 1.0
    return torch.from_numpy(index), torch.from_numpy(mask), torch.from_numpy(mask.any(axis=2))
