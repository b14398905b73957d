r"""Byzantine-robust aggregation rules over K client models: coordinate-wise median, trimmed
mean, Krum / Multi-Krum and Bulyan, with the arithmetic of Flower's ``FedMedian``,
``FedTrimmedAvg``, ``Krum``, ``MultiKrum`` and ``Bulyan`` (the math and the exact rules:
``docs/algorithms/robust_and_private.md``).

``clients`` is what :func:`fedkernels.aggregate` accepts: a list of K state_dicts, a list of K
tensor lists (or tensors), or one ``[K, P]`` tensor; results have the structure of client 0
(or of ``out``). Floating-point entries (float32, float64, float16, bfloat16) are aggregated;
integer and bool entries (BatchNorm's ``num_batches_tracked``) are the element-wise maximum over
the clients the rule uses (Krum: the selected client's own). The clients are read as values: a
result never requires grad.

Per coordinate, with the K values sorted ascending (NaN sorts last):

- median: the middle value for odd K; for even K the mean of the two middle values, computed as
  NumPy does (their sum in the accumulate type, halved); NaN where any client is NaN;
- trimmed mean: the values of ranks ``[c, K - c)``, ``c = int(beta * K)``, summed in ascending
  order in the accumulate type and divided by their count (NumPy sums the same values in the
  order ``np.partition`` leaves them, so results agree up to that summation order).

The accumulate type is float32 for float32/float16/bfloat16 and float64 for float64 (NumPy's
mean also sums float16 in float32).
"""

from __future__ import annotations

import math

import numpy as np
import torch
from torch import Tensor

from .aggregate import aggregate
from .client_set import ClientSet
from .model_layout import Model, real_number, refuse_non_real_weights
from .ops import robust as robust_ops

__all__ = ["coordinate_median", "trimmed_mean", "pairwise_sq_distances", "krum_scores", "krum",
           "bulyan", "BULYAN_SELECTIONS"]

BULYAN_SELECTIONS = ("iterative", "multikrum")


def coordinate_median(clients, *, out: Model | None = None) -> Model:
    r"""Coordinate-wise median over the K clients, equal to ``np.median(stack, axis=0)`` (the
    arithmetic of Flower's ``FedMedian`` / ``aggregate_median``): odd K gives the middle value,
    even K :math:`(s_{K/2-1} + s_{K/2}) / 2` computed in the accumulate type; a coordinate where
    any client is NaN is NaN. ``out``: where to write the result (client 0's structure, dtypes
    and devices; must not alias a client)."""
    cs = ClientSet(clients, "fedkernels.coordinate_median")
    out_tensors = cs.out_tensors(out, op_sees=None)
    results = cs.run(robust_ops.coordinate_median, cs.flat(), cs.K, cs.float_out(out_tensors))
    return cs.finish(results, None, out_tensors, out)


def trimmed_mean(clients, beta: float, *, out: Model | None = None) -> Model:
    r"""β-trimmed mean per coordinate, Flower's ``FedTrimmedAvg`` arithmetic: with
    :math:`c = \lfloor \beta K \rfloor` the c smallest and c largest values of each coordinate
    are dropped and the other :math:`K - 2c` averaged (summed in ascending order in the
    accumulate type). ``0 <= beta < 0.5`` as in Flower; NaN sorts above every number, so a NaN
    among the c largest values of a coordinate is dropped with them."""
    api = "fedkernels.trimmed_mean"
    beta = real_number(api, "beta", beta)
    if not 0.0 <= beta < 0.5:
        raise ValueError(f"{api}: beta must be in [0, 0.5), got {beta}")
    cs = ClientSet(clients, api)
    out_tensors = cs.out_tensors(out, op_sees=None)
    lowercut = int(beta * cs.K)  # Flower's (and SciPy's trim_mean's) cut
    results = cs.run(robust_ops.trimmed_mean, cs.flat(), cs.K, lowercut, cs.float_out(out_tensors))
    return cs.finish(results, None, out_tensors, out)


def nearest_to_median_mean(clients, window: int, *, out: Model | None = None) -> Model:
    r"""Bulyan's coordinate step on its own: per coordinate, the mean of the ``window`` values
    (1 to K) nearest to the clients' coordinate-wise median (:func:`coordinate_median` rules),
    summed in the accumulate type. On an exact distance tie the lower value is taken; a
    coordinate where any client is NaN is NaN. :func:`bulyan` runs it over the clients its
    Krum step selected."""
    api = "fedkernels.nearest_to_median_mean"
    cs = ClientSet(clients, api)
    window = _check_count(api, "window", window, 1, cs.K)
    out_tensors = cs.out_tensors(out, op_sees=None)
    results = cs.run(robust_ops.median_window_mean, cs.flat(), cs.K, window,
                     cs.float_out(out_tensors))
    return cs.finish(results, None, out_tensors, out)


def _distances(cs: ClientSet) -> Tensor:
    if not cs.has_floats:  # no coordinates: every client is at distance 0
        return torch.zeros(cs.K, cs.K, dtype=torch.float64)
    return cs.run(robust_ops.pairwise_sq_distances, cs.flat(), cs.K)


def pairwise_sq_distances(clients) -> Tensor:
    r"""``[K, K]`` float64 matrix of :math:`\lVert x_i - x_j\rVert_2^2` over all floating-point
    tensors of the clients, accumulated in float64 from the exact differences (Flower computes
    the same quantity in the models' dtype, float32 for float32 models, so its values differ in
    the low bits). Symmetric with a zero diagonal; NaN/Inf in a client make the other entries
    of its row and column NaN/Inf."""
    return _distances(ClientSet(clients, "fedkernels.pairwise_sq_distances"))


def _check_count(api: str, name: str, value, low: int, high: int | None = None) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
        raise TypeError(f"{api}: {name} must be an int, got {type(value).__name__}")
    value = int(value)
    if value < low or (high is not None and value > high):
        bound = f">= {low}" if high is None else f"in [{low}, {high}]"
        raise ValueError(f"{api}: {name} must be {bound}, got {value}")
    return value


def krum_scores(distances: Tensor, num_malicious: int) -> Tensor:
    r"""Krum score of each client from the ``[K, K]`` squared distances: the sum of the
    :math:`n = \max(1, K - f - 2)` smallest entries of its row after the smallest (its own zero
    distance), as Flower's ``aggregate_krum`` and ``select_multikrum`` compute it (summed with
    ``np.sum``, in ascending order). Returns ``[K]`` float64 on the CPU; a NaN score (a client
    with NaN values) becomes +inf, so such a client ranks last (NumPy's ``argmin`` would pick it)."""
    api = "fedkernels.krum_scores"
    if not isinstance(distances, Tensor) or distances.dim() != 2 or \
            distances.shape[0] != distances.shape[1]:
        raise ValueError(f"{api}: distances must be a square [K, K] tensor")
    K = distances.shape[0]
    f = _check_count(api, "num_malicious", num_malicious, 0)
    if distances.device.type == "meta":
        raise ValueError(f"{api}: distances is on the meta device, which holds no values")
    num_closest = max(1, K - f - 2)
    d = distances.detach().to("cpu", torch.float64).numpy()
    scores = np.array([np.sum(np.sort(row)[1:num_closest + 1]) for row in d], dtype=np.float64)
    scores[np.isnan(scores)] = np.inf
    return torch.from_numpy(scores)


def _lowest(scores: Tensor, m: int) -> list[int]:
    """Indices of the m lowest scores, ascending; ties go to the lower index."""
    return np.argsort(scores.numpy(), kind="stable")[:m].tolist()


def krum(clients, num_malicious: int, num_to_keep: int = 1, *, weights=None,
         out: Model | None = None) -> tuple[Model, list[int]]:
    r"""Krum (``num_to_keep=1``) and Multi-Krum (``num_to_keep > 1``).

    Each client's score is the sum of its squared distances to its :math:`\max(1, K - f - 2)`
    nearest other clients (:func:`krum_scores` on :func:`pairwise_sq_distances`); the
    ``num_to_keep`` clients with the lowest scores are selected (ties: lower index first).
    Krum returns a copy of the selected client; Multi-Krum the weighted average
    :math:`\sum_{k \in S} w_k x_k / \sum_{k \in S} w_k` of the selected clients (``weights``:
    K numbers such as example counts, as Flower weights by ``num_examples``; None: equal).

    Flower equivalents: legacy ``aggregate_krum(results, f, to_keep)`` with ``to_keep=0`` is
    ``num_to_keep=1`` and ``to_keep=m > 0`` is ``num_to_keep=m``; the Message API's ``Krum`` /
    ``MultiKrum(num_nodes_to_select=m)`` is ``num_to_keep=m``. The selection equals Flower's
    except where two scores tie to within Flower's float32 distance rounding.

    Returns ``(result, selected)``: ``selected`` is the list of chosen client indices, lowest
    score first.
    """
    api = "fedkernels.krum"
    cs = ClientSet(clients, api)
    f = _check_count(api, "num_malicious", num_malicious, 0)
    m = _check_count(api, "num_to_keep", num_to_keep, 1, cs.K)
    cs.refuse_meta("Krum's selection depends on them")
    out_tensors = cs.out_tensors(out, floats_written_here=True)
    if weights is not None:
        w = _checked_weights(api, weights, cs.K)
    selected = _lowest(krum_scores(_distances(cs), f), m)
    if m == 1:
        results = [t.clone() for t in cs.floats[selected[0]]]
        if out_tensors is not None:
            for o, r in zip(cs.float_out(out_tensors), results):
                o.copy_(r)
    else:
        sel_weights = [1.0] * m if weights is None else [w[k] for k in selected]
        if sum(sel_weights) == 0:
            raise ValueError(f"{api}: the weights of the selected clients {selected} sum to 0")
        results = (aggregate([cs.floats[k] for k in selected], sel_weights, normalize=True)
                   if cs.has_floats else [])
    return cs.finish(results, selected, out_tensors, out), selected


def _checked_weights(api: str, weights, K: int) -> list[float]:
    refuse_non_real_weights(api, weights)
    try:
        w = np.asarray(weights.detach().cpu() if isinstance(weights, Tensor) else weights,
                       dtype=np.float64)
    except (TypeError, ValueError) as err:
        raise TypeError(f"{api}: weights must be K numbers: {err}") from None
    if w.shape != (K,):
        raise ValueError(f"{api}: got {K} clients but weights of shape {w.shape}")
    bad = [k for k in range(K) if not (math.isfinite(w[k]) and w[k] >= 0)]
    if bad:
        raise ValueError(f"{api}: weight of client {bad[0]} is {w[bad[0]]}; weights must be "
                         f"finite and >= 0 (bad: clients {bad[:10]})")
    return w.tolist()


def _bulyan_select(d: Tensor, f: int, theta: int, selection: str) -> list[int]:
    if selection == "multikrum":
        return _lowest(krum_scores(d, f), theta)
    remaining, chosen = list(range(d.shape[0])), []
    for _ in range(theta):
        sub = d[remaining][:, remaining]
        best = remaining[_lowest(krum_scores(sub, f), 1)[0]]
        chosen.append(best)
        remaining.remove(best)
    return chosen


def bulyan(clients, num_malicious: int, *, selection: str = "iterative",
           out: Model | None = None) -> Model:
    r"""Bulyan (El Mhamdi et al., 2018) with Flower's arithmetic.

    With :math:`\theta = K - 2f` and :math:`\beta = \theta - 2f` (needs :math:`K \ge 4f + 3`):
    select :math:`\theta` clients by Krum, then per coordinate average the :math:`\beta` values
    of the selected clients closest to their coordinate-wise median (:func:`coordinate_median`
    rules; on an exact distance tie the lower value is taken; a coordinate where a selected
    client is NaN is NaN).

    ``selection``: ``"iterative"`` is Flower's legacy ``aggregate_bulyan`` with
    ``aggregate_krum`` (Krum applied :math:`\theta` times, each time to the clients not yet
    selected, so the Krum neighbourhood :math:`\max(1, n - f - 2)` shrinks with them);
    ``"multikrum"`` is the Message API's ``Bulyan`` (the :math:`\theta` lowest Krum scores of
    one scoring of all K clients). Neither Flower rule uses client weights, and neither does
    this. Flower picks the :math:`\beta` closest values with ``np.argpartition`` (no defined
    tie order) and averages them with ``np.mean`` in the models' dtype, so results agree with
    Flower's up to that summation order and exact ties."""
    api = "fedkernels.bulyan"
    if selection not in BULYAN_SELECTIONS:
        raise ValueError(f"{api}: selection must be one of {BULYAN_SELECTIONS}, "
                         f"not {selection!r}")
    cs = ClientSet(clients, api)
    f = _check_count(api, "num_malicious", num_malicious, 0)
    if cs.K < 4 * f + 3:
        raise ValueError(f"{api}: Bulyan needs K >= 4 * num_malicious + 3 = {4 * f + 3} "
                         f"clients, got K = {cs.K}")
    cs.refuse_meta("Bulyan's selection depends on them")
    theta = cs.K - 2 * f
    beta = theta - 2 * f
    chosen = _bulyan_select(_distances(cs), f, theta, selection)
    out_tensors = cs.out_tensors(out, op_sees=chosen)  # and the others, which it does not see
    results = cs.run(robust_ops.median_window_mean, cs.flat(chosen), theta, beta,
                     cs.float_out(out_tensors))
    return cs.finish(results, chosen, out_tensors, out)
