r"""FedAU's online estimate of each client's mean participation interval (Wang & Ji, ICLR
2024), from which its aggregation weight :math:`w_n = \omega_n / N` follows: shared by the
simulator's ``fedau`` strategy and the Flower ``FedAU`` strategy. Equations and defaults:
``docs/algorithms/participation.md``."""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

__all__ = ["IntervalWeightEstimator"]


class IntervalWeightEstimator:
    r"""FedAU's online weights (Wang & Ji 2024, Alg. 2, in the "list" form of IBM/fedau).

    Per client: ``c`` rounds since the last completed interval, ``M`` completed intervals,
    ``omega`` their running mean (1 while ``M == 0``). Each round, in order, a participant
    first *uses* ``omega`` (the interval it closes now counts only from the next round), then
    closes the interval ``c + 1``; a non-participant increments ``c`` and, when ``c`` reaches
    the cutoff K, closes a dummy interval of length K. Under Bernoulli(p) participation
    :math:`\omega_n \to (1 - (1-p_n)^K)/p_n` (:math:`1/p_n` without cutoff).
    """

    def __init__(self, num_clients: int, cutoff: int | None) -> None:
        self.cutoff = cutoff
        self.count = torch.zeros(num_clients, dtype=torch.int64, device="cpu")
        self.intervals = torch.zeros(num_clients, dtype=torch.int64, device="cpu")
        self.omega = torch.ones(num_clients, dtype=torch.float64, device="cpu")

    def _close(self, done: Tensor, length: Tensor) -> None:
        m = self.intervals.double()
        mean = torch.where(
            self.intervals == 0, length.double(), (m * self.omega + length) / (m + 1.0)
        )
        self.omega = torch.where(done, mean, self.omega)
        self.intervals = self.intervals + done.long()

    def add_clients(self, count: int) -> None:
        """Appends ``count`` clients with no interval observed yet (``omega`` 1)."""
        self.count = torch.cat([self.count, torch.zeros(count, dtype=torch.int64, device="cpu")])
        self.intervals = torch.cat([self.intervals, torch.zeros(count, dtype=torch.int64, device="cpu")])
        self.omega = torch.cat([self.omega, torch.ones(count, dtype=torch.float64, device="cpu")])

    def observe(self, mask: Tensor) -> None:
        """Advances by one round with participation ``mask`` (bool ``[N]``)."""
        self._close(mask, self.count + 1)
        self.count = torch.where(mask, torch.zeros_like(self.count), self.count + 1)
        if self.cutoff is not None:
            dummy = ~mask & (self.count >= self.cutoff)
            self._close(dummy, torch.full_like(self.count, self.cutoff))
            self.count = torch.where(dummy, torch.zeros_like(self.count), self.count)

    def state_dict(self) -> dict[str, Any]:
        return {"count": self.count, "intervals": self.intervals, "omega": self.omega}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.count = state["count"].clone()
        self.intervals = state["intervals"].clone()
        self.omega = state["omega"].clone()
