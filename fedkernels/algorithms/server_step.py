r"""Applying a server direction that is not a weighted sum of the round's client models.

Most strategies hand weights to :meth:`Server.step`. MIFA and FedVARP instead move the global
model along a vector built from their memory of past updates; :func:`apply_direction` feeds
that vector :math:`v_t` (in the sign convention of :math:`\Delta_t = \sum_k w_k (x_k - x_t)`)
to the server's optimizer, so that plain SGD gives :math:`x_{t+1} = x_t + \eta v_t` and the
adaptive optimizers (FedAdam, ...) treat :math:`v_t` as they treat :math:`\Delta_t`. Float
buffers become the plain mean of the participants' buffers, as in :meth:`Server.step`.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor

from fedkernels.aggregate import aggregate
from fedkernels.rules.server_optimizers import ServerSGD
from fedkernels.sim.server import Server


def apply_direction(
    server: Server,
    direction: Sequence[Tensor],
    round_index: int,
    client_states: Sequence[Mapping[str, Tensor]],
) -> None:
    """Moves ``server``'s trainable parameters (in ``server.parameter_names`` order) along
    ``direction``; ``round_index`` is 0-based."""
    names = server.parameter_names
    params = [server.state[n] for n in names]
    optimizer = server.optimizer
    if isinstance(optimizer, ServerSGD):
        torch._foreach_add_(params, list(direction), alpha=optimizer.lr)
    else:
        optimizer.update(names, params, [d.clone() for d in direction], round_index + 1)
    if server.buffer_names and client_states:
        buffers = {n: server.state[n] for n in server.buffer_names}
        aggregate(
            [{n: s[n] for n in server.buffer_names} for s in client_states],
            torch.ones(len(client_states), dtype=torch.float64, device="cpu"),
            normalize=True,
            out=buffers,
        )
