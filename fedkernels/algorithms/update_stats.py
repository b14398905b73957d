r"""Statistics of a round's client updates :math:`u_k = x_k - x_t`, computed with batched ops.

- :func:`update_sq_norms`: :math:`\|u_k\|^2` for every client (q-FedAvg's Lipschitz
  estimate, FedMGDA+'s normalisation), from one ``torch._foreach_sub`` and one
  ``torch._foreach_norm`` over all K·T tensors (T = tensors per model), not a loop over them.
- :func:`update_gram`: :math:`G_{jk} = \langle u_j, u_k\rangle` (FedMGDA+), one ``[K, P]``
  matrix of flattened updates and one matmul.
- :func:`flat_updates`: that ``[K, P]`` matrix.

Only the named entries (the trainable parameters) take part. Sums are in float64, on the
models' device; the per-client results (``[K]`` norms, the ``[K, K]`` Gram matrix) come back on
the CPU, where the weight rules read them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def _client_and_global(
    client_states: Sequence[Mapping[str, Tensor]],
    global_state: Mapping[str, Tensor],
    names: Sequence[str],
) -> tuple[list[Tensor], list[Tensor]]:
    clients = [s[n] for s in client_states for n in names]
    base = [global_state[n] for n in names] * len(client_states)
    return clients, base


def update_sq_norms(
    client_states: Sequence[Mapping[str, Tensor]],
    global_state: Mapping[str, Tensor],
    names: Sequence[str],
) -> Tensor:
    r""":math:`\|x_k - x_t\|^2` summed over the entries ``names``, float64 ``[K]`` on the CPU."""
    clients, base = _client_and_global(client_states, global_state, names)
    deltas = torch._foreach_sub(clients, base)
    norms = torch.stack(torch._foreach_norm(deltas)).double()
    return norms.square().view(len(client_states), len(names)).sum(dim=1).cpu()


def flat_updates(
    client_states: Sequence[Mapping[str, Tensor]],
    global_state: Mapping[str, Tensor],
    names: Sequence[str],
    dtype: torch.dtype = torch.float64,
) -> Tensor:
    """``[K, P]``: row k is ``x_k - x_t`` flattened over ``names`` (in that order)."""
    base = torch.cat([global_state[n].reshape(-1) for n in names]).to(dtype)
    rows = torch.stack(
        [torch.cat([s[n].reshape(-1) for n in names]) for s in client_states]
    ).to(dtype)
    return rows.sub_(base)


def update_gram(
    client_states: Sequence[Mapping[str, Tensor]],
    global_state: Mapping[str, Tensor],
    names: Sequence[str],
) -> Tensor:
    r""":math:`G = U U^\top` with :math:`U` the ``[K, P]`` float64 update matrix (on the CPU)."""
    u = flat_updates(client_states, global_state, names)
    return (u @ u.T).cpu()
