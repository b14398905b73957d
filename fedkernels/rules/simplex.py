r"""Small dense problems on the probability simplex that several strategies solve each round.

- :func:`project_simplex`: the Euclidean projection onto
  :math:`\Delta = \{p : p_i \ge 0, \sum_i p_i = 1\}` (AFL's dual step), by sorting
  (Wang & Carreira-Perpiñán 2013).
- :func:`simplex_qp`: the exact minimiser of a strictly convex quadratic
  :math:`\tfrac12 p^\top Q p + c^\top p` over :math:`\Delta` intersected with a box
  :math:`lo \le p \le hi` (AAggFF-S's online Newton step, FedMGDA+'s min-norm problem), by a
  primal active-set method (Nocedal & Wright, *Numerical Optimization*, Alg. 16.3).

Both work in float64 NumPy: the problems are K x K with K the number of clients in a round.
"""

from __future__ import annotations

import numpy as np


def project_simplex(v: np.ndarray) -> np.ndarray:
    r""":math:`\Pi_\Delta(v)_i = \max(v_i - \tau, 0)` with :math:`\tau` such that the result
    sums to 1: sort :math:`u` descending, :math:`\rho = \max\{k : u_k - (\sum_{j \le k} u_j - 1)/k
    > 0\}`, :math:`\tau = (\sum_{j \le \rho} u_j - 1)/\rho`."""
    v = np.asarray(v, dtype=np.float64)
    if not np.all(np.isfinite(v)):
        raise ValueError("project_simplex: the vector holds NaN or infinite entries")
    u = np.sort(v)[::-1]
    cumulative = np.cumsum(u) - 1.0
    k = np.arange(1, len(v) + 1)
    above = k[u - cumulative / k > 0]
    if len(above) == 0:
        # u_1 so large that u_1 - 1 rounds to u_1 (k = 1 always qualifies in exact
        # arithmetic): the projection does not change when every entry moves by the same
        # amount, so project v - max(v) instead
        return project_simplex(v - u[0])
    rho = above[-1]
    tau = cumulative[rho - 1] / rho
    return np.maximum(v - tau, 0.0)


def simplex_qp(
    q: np.ndarray,
    c: np.ndarray,
    lower: np.ndarray | float = 0.0,
    upper: np.ndarray | float = np.inf,
    start: np.ndarray | None = None,
    tol: float = 1e-12,
) -> np.ndarray:
    r"""``argmin ½ pᵀ Q p + cᵀ p`` subject to ``Σ p = 1`` and ``lower <= p <= upper``.

    ``Q`` must be symmetric positive definite (positive semi-definite works when the minimiser
    is unique on the feasible set). Primal active set: the working set ``W`` holds bounds
    treated as equalities. Each iteration solves the equality-constrained step on the free
    variables ``F``,

    .. math:: \begin{bmatrix} Q_{FF} & 1 \\ 1^\top & 0 \end{bmatrix}
              \begin{bmatrix} s_F \\ \nu \end{bmatrix} =
              \begin{bmatrix} -g_F \\ 0 \end{bmatrix}, \quad g = Qp + c,

    takes the longest feasible part of it (adding the blocking bound to ``W``), and when the
    step is zero checks the bounds' multipliers :math:`\mu_i = \pm(g_i + \nu)`, releasing the
    most negative one. It stops when all are non-negative: the KKT point, exact up to rounding.
    ``start`` must be feasible (default: the uniform point, clipped into the box and
    re-balanced).
    """
    q = np.asarray(q, dtype=np.float64)
    c = np.asarray(c, dtype=np.float64)
    k = len(c)
    lo = np.broadcast_to(np.asarray(lower, dtype=np.float64), (k,)).copy()
    hi = np.broadcast_to(np.asarray(upper, dtype=np.float64), (k,)).copy()
    if lo.sum() > 1.0 + 1e-12 or np.minimum(hi, 1e300).sum() < 1.0 - 1e-12 or np.any(lo > hi):
        raise ValueError("simplex_qp: the box does not intersect the simplex")
    p = _feasible_start(lo, hi) if start is None else np.asarray(start, dtype=np.float64).copy()
    at_lower = np.zeros(k, dtype=bool)
    at_upper = np.zeros(k, dtype=bool)
    scale = max(1.0, float(np.abs(q).max(initial=0.0)), float(np.abs(c).max(initial=0.0)))
    # After a full (unblocked) step the point minimises the quadratic on its face, so the next
    # step on the same face is zero in exact arithmetic. With a singular Q_FF (two clients with
    # the same update direction) the least-squares solve returns rounding noise there instead,
    # which would be stepped along forever; such a step counts as zero.
    on_face_minimum = False
    for _ in range(50 * k + 100):
        free = ~(at_lower | at_upper)
        g = q @ p + c
        f = np.flatnonzero(free)
        system = np.zeros((len(f) + 1, len(f) + 1))
        system[: len(f), : len(f)] = q[np.ix_(f, f)]
        system[: len(f), -1] = 1.0
        system[-1, : len(f)] = 1.0
        rhs = np.concatenate([-g[f], [0.0]])
        solution = np.linalg.lstsq(system, rhs, rcond=None)[0]
        step, nu = np.zeros(k), solution[-1]
        step[f] = solution[:-1]
        if on_face_minimum or np.abs(step).max(initial=0.0) <= tol * max(1.0, np.abs(p).max()):
            multipliers = np.full(k, np.inf)
            multipliers[at_lower] = (g + nu)[at_lower]
            multipliers[at_upper] = -(g + nu)[at_upper]
            worst = int(np.argmin(multipliers))
            if multipliers[worst] >= -tol * scale:
                return _clean(p, lo, hi)
            at_lower[worst] = at_upper[worst] = False
            on_face_minimum = False
            continue
        length, blocking, to_upper = 1.0, -1, False
        for i in f:
            if step[i] < 0 and lo[i] > -np.inf:
                room = (lo[i] - p[i]) / step[i]
                if room < length:
                    length, blocking, to_upper = max(room, 0.0), i, False
            elif step[i] > 0 and hi[i] < np.inf:
                room = (hi[i] - p[i]) / step[i]
                if room < length:
                    length, blocking, to_upper = max(room, 0.0), i, True
        p = p + length * step
        on_face_minimum = blocking < 0
        if blocking >= 0:
            if to_upper:
                p[blocking], at_upper[blocking] = hi[blocking], True
            else:
                p[blocking], at_lower[blocking] = lo[blocking], True
    raise RuntimeError("simplex_qp: the active-set method did not converge")


def _feasible_start(lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """A point of the box with sum 1: the uniform point clipped into the box, then moved
    towards the bound with room until the sum is 1."""
    k = len(lo)
    p = np.clip(np.full(k, 1.0 / k), lo, hi)
    for _ in range(k + 1):
        gap = 1.0 - p.sum()
        if abs(gap) <= 1e-15:
            break
        room = (np.minimum(hi, 1.0) - p) if gap > 0 else (p - lo)
        movable = room > 0
        share = gap / movable.sum()
        p[movable] = np.clip(p[movable] + share, lo[movable], hi[movable])
    return p


def _clean(p: np.ndarray, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    p = np.clip(p, lo, hi)
    return p / p.sum()
