r"""Server optimizers: how the global model moves given the round's client models and weights.
Framework-neutral: the simulator's server and the Flower strategies both step with them.

Every optimizer works on the round's averaged update (the negative pseudo-gradient)

.. math:: \Delta_t = \sum_k w_k (x_k - x_t),

computed by :func:`fedkernels.aggregate` in delta mode. The update formulas are those of
Flower's strategies of the same names (``flwr.serverapp.strategy``; Reddi et al. 2021,
"Adaptive Federated Optimization"), with ``t`` the 1-based round and ``m_0 = v_0 = 0``:

- **sgd** (FedAvg with server learning rate): :math:`x_{t+1} = x_t + \eta\Delta_t`, one fused
  in-place ``aggregate(..., base=x, scale=eta, out=x)``.
- **fedavgm**: :math:`g_t = -\Delta_t`; :math:`m_1 = g_1`, :math:`m_t = \mu m_{t-1} + g_t`;
  :math:`x_{t+1} = x_t - \eta m_t`.
- **fedadagrad**: :math:`v_t = v_{t-1} + \Delta_t^2`;
  :math:`x_{t+1} = x_t + \eta\Delta_t / (\sqrt{v_t} + \tau)`.
- **fedadam**: :math:`m_t = \beta_1 m_{t-1} + (1-\beta_1)\Delta_t`,
  :math:`v_t = \beta_2 v_{t-1} + (1-\beta_2)\Delta_t^2`,
  :math:`\eta_t = \eta\sqrt{1-\beta_2^{t+1}}/(1-\beta_1^{t+1})` (Flower's bias correction,
  whose exponent is the 1-based round plus one),
  :math:`x_{t+1} = x_t + \eta_t m_t/(\sqrt{v_t}+\tau)`.
- **fedyogi**: :math:`m_t` as Adam,
  :math:`v_t = v_{t-1} - (1-\beta_2)\Delta_t^2\,\mathrm{sign}(v_{t-1} - \Delta_t^2)`,
  :math:`x_{t+1} = x_t + \eta m_t/(\sqrt{v_t}+\tau)` (no bias correction).
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from fedkernels.aggregate import aggregate

StateDict = dict[str, Tensor]

__all__ = ["FedAdagrad", "FedAdam", "FedAvgM", "FedYogi", "ServerOptimizer", "ServerSGD"]


class ServerOptimizer:
    """Base class: computes ``Delta_t`` and hands it to :meth:`update`."""

    def __init__(self, lr: float) -> None:
        self.lr = lr

    def apply(
        self, params: StateDict, client_params: list[StateDict], weights: Tensor, server_round: int
    ) -> None:
        """Moves ``params`` (in place) given the clients' parameters and weights."""
        averaged = aggregate(client_params, weights, base=params)
        names = list(params)
        x = [params[n] for n in names]
        delta = torch._foreach_sub([averaged[n] for n in names], x)
        self.update(names, x, delta, server_round)

    def update(
        self, names: list[str], x: list[Tensor], delta: list[Tensor], server_round: int
    ) -> None:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restores :meth:`state_dict`."""


class ServerSGD(ServerOptimizer):
    """``x <- x + eta * sum_k w_k (x_k - x)``, fused in one in-place aggregate call."""

    def apply(
        self, params: StateDict, client_params: list[StateDict], weights: Tensor, server_round: int
    ) -> None:
        aggregate(client_params, weights, base=params, scale=self.lr, out=params)


class _Moments(ServerOptimizer):
    """Optimizers with per-parameter moment tensors created on the first update."""

    moments: tuple[str, ...] = ()

    def __init__(self, lr: float) -> None:
        super().__init__(lr)
        self.state: dict[str, dict[str, Tensor]] = {m: {} for m in self.moments}

    def _moment(self, which: str, names: list[str], like: list[Tensor]) -> list[Tensor]:
        table = self.state[which]
        for n, t in zip(names, like):
            if n not in table:
                table[n] = torch.zeros_like(t)
        return [table[n] for n in names]

    def state_dict(self) -> dict[str, Any]:
        return {"state": {m: dict(t) for m, t in self.state.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.state = {m: {n: t.clone() for n, t in state["state"][m].items()} for m in self.moments}


class FedAvgM(_Moments):
    """Server momentum (Hsu et al. 2019): ``m_t = mu m_{t-1} + g_t`` with ``g_t = -Delta_t``
    and ``m_1 = g_1``; ``x <- x - eta m_t``."""

    moments = ("momentum",)

    def __init__(self, lr: float, momentum: float) -> None:
        super().__init__(lr)
        self.momentum = momentum

    def update(self, names, x, delta, server_round) -> None:
        first = not self.state["momentum"]
        m = self._moment("momentum", names, x)
        if first:
            torch._foreach_sub_(m, delta)  # m_1 = g_1 = -Delta_1 (m starts at 0)
        else:
            torch._foreach_mul_(m, self.momentum)
            torch._foreach_sub_(m, delta)
        torch._foreach_add_(x, m, alpha=-self.lr)


class FedAdagrad(_Moments):
    """``v_t = v_{t-1} + Delta_t^2``; ``x <- x + eta Delta_t / (sqrt(v_t) + tau)``."""

    moments = ("v",)

    def __init__(self, lr: float, tau: float) -> None:
        super().__init__(lr)
        self.tau = tau

    def update(self, names, x, delta, server_round) -> None:
        v = self._moment("v", names, x)
        torch._foreach_addcmul_(v, delta, delta)
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, self.tau)
        torch._foreach_addcdiv_(x, delta, denom, value=self.lr)


class FedAdam(_Moments):
    """Adam on ``Delta_t`` with Flower's bias-corrected step size (module docstring)."""

    moments = ("m", "v")

    def __init__(self, lr: float, beta1: float, beta2: float, tau: float) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.tau = beta1, beta2, tau

    def update(self, names, x, delta, server_round) -> None:
        m = self._moment("m", names, x)
        v = self._moment("v", names, x)
        torch._foreach_mul_(m, self.beta1)
        torch._foreach_add_(m, delta, alpha=1.0 - self.beta1)
        torch._foreach_mul_(v, self.beta2)
        torch._foreach_addcmul_(v, delta, delta, value=1.0 - self.beta2)
        step = (
            self.lr
            * (1.0 - self.beta2 ** (server_round + 1.0)) ** 0.5
            / (1.0 - self.beta1 ** (server_round + 1.0))
        )
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, self.tau)
        torch._foreach_addcdiv_(x, m, denom, value=step)


class FedYogi(_Moments):
    """Yogi on ``Delta_t``: additive second-moment update (module docstring)."""

    moments = ("m", "v")

    def __init__(self, lr: float, beta1: float, beta2: float, tau: float) -> None:
        super().__init__(lr)
        self.beta1, self.beta2, self.tau = beta1, beta2, tau

    def update(self, names, x, delta, server_round) -> None:
        m = self._moment("m", names, x)
        v = self._moment("v", names, x)
        torch._foreach_mul_(m, self.beta1)
        torch._foreach_add_(m, delta, alpha=1.0 - self.beta1)
        squared = torch._foreach_mul(delta, delta)
        direction = torch._foreach_sign(torch._foreach_sub(v, squared))
        torch._foreach_mul_(direction, squared)
        torch._foreach_add_(v, direction, alpha=-(1.0 - self.beta2))
        denom = torch._foreach_sqrt(v)
        torch._foreach_add_(denom, self.tau)
        torch._foreach_addcdiv_(x, m, denom, value=self.lr)
