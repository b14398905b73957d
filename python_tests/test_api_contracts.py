"""The contract of every public function and method that writes into tensors it is given
(``out=``, in place, or its own running state): hypothesis draws valid calls and invalid ones
(an ``out`` entry that aliases or partly overlaps any input, also a client the rule does not
select; a leaf that requires grad, a wrong dtype, shape or device at any position; inputs on
the meta device; NaN weights) and checks that

- a valid call gives the documented result (the formula, computed here in float64 or by
  ``fedkernels.reference``), and a refusal of a valid call is a failure;
- an invalid call raises a ``ValueError`` or ``TypeError`` whose message names the function
  (a ``RuntimeError`` only for a tensor that requires grad, as PyTorch's in-place ops raise);
- on every refusal each ``out`` tensor, and every input, is bitwise what it was.

The fast tier runs a few dozen examples per family; the ``slow`` variants many more.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fedkernels as fk  # noqa: E402
from fedkernels import robust  # noqa: E402
from fedkernels.integrations.adapters import aggregate_into_module  # noqa: E402
from fedkernels.integrations.distributed import WeightedPartial  # noqa: E402
from fedkernels.ops import reference as R  # noqa: E402
from fedkernels.ops.mixing_sgd import superfed_sgd_step_  # noqa: E402

FLOATS = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 2e-2}
OTHER_FLOAT = {torch.float32: torch.float64, torch.float64: torch.float32,
               torch.float16: torch.bfloat16, torch.bfloat16: torch.float16}


def _tiers(fast: int, full: int):
    """(fast-tier settings, slow-tier settings) for one property."""
    common = dict(deadline=None, derandomize=True, database=None,
                  suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
    return settings(max_examples=fast, **common), settings(max_examples=full, **common)


# ---------------------------------------------------------------- models


@dataclass
class Models:
    """K client models of one structure, their float entries' index, and how to make more."""
    kind: str  # "tensor", "flat" ([K, P]), "list", "dict" (with an int64 entry "n")
    clients: Any
    dtype: torch.dtype
    shapes: list[tuple[int, ...]]

    @property
    def K(self) -> int:
        return len(self.clients)

    def entries(self, model) -> list[torch.Tensor]:
        if isinstance(model, torch.Tensor):
            return [model]
        return list(model.values()) if isinstance(model, dict) else list(model)

    def client_entries(self, k: int) -> list[torch.Tensor]:
        return self.entries(self.clients[k])

    def float_positions(self) -> list[int]:
        return [i for i, t in enumerate(self.client_entries(0)) if t.is_floating_point()]

    def build(self, tensors: list[torch.Tensor]):
        if self.kind in ("tensor", "flat"):
            return tensors[0]
        if self.kind == "list":
            return list(tensors)
        return dict(zip(self.names(), tensors))

    def names(self) -> list:
        return list(self.clients[0]) if self.kind == "dict" else list(range(len(self.shapes)))

    def zeros_like_client(self):
        return self.build([torch.zeros_like(t) for t in self.client_entries(0)])


def _values(shape, dtype, seed: int, scale: float = 1.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return (scale * torch.randn(shape, generator=g, dtype=torch.float64)).to(dtype)


@st.composite
def models(draw, *, min_k=1, max_k=6, kinds=("tensor", "flat", "list", "dict"), dtypes=FLOATS,
           ints=True, k=None):
    kind = draw(st.sampled_from(kinds))
    K = k if k is not None else draw(st.integers(min_k, max_k))
    dtype = draw(st.sampled_from(dtypes))
    if kind in ("tensor", "flat"):
        shapes = [(draw(st.integers(2, 6)),)]
    else:
        shapes = draw(st.lists(st.sampled_from([(2,), (3,), (2, 2), (4,), (1,)]),
                               min_size=1, max_size=3))
    seed = draw(st.integers(0, 2**16))
    rows = [[_values(s, dtype, seed * 97 + 7 * k + i) for i, s in enumerate(shapes)]
            for k in range(K)]
    if kind == "tensor":
        clients = [r[0] for r in rows]
    elif kind == "flat":
        clients = torch.stack([r[0] for r in rows])
    elif kind == "list":
        clients = rows
    else:
        clients = []
        for k, r in enumerate(rows):
            model = {f"w{i}": t for i, t in enumerate(r)}
            if ints:
                model["n"] = torch.tensor(3 * k % 5, dtype=torch.int64)
            clients.append(model)
    return Models(kind, clients, dtype, shapes)


# ---------------------------------------------------------------- mutations of out

VALID = "valid"


@dataclass
class Call:
    api: str  # the function's name as its errors must give it
    run: Callable[[], Any]
    written: list[torch.Tensor]  # what it may write (checked unchanged on a refusal)
    read: list[torch.Tensor]  # what it must never write
    expected: Callable[[], list[torch.Tensor]] | None  # the documented values of `written`
    tol: float
    invalid: bool
    grad: bool = False  # the fault is a tensor that requires grad
    no_grad: bool = False
    check: Callable[[Any], None] | None = None  # more checks of a valid call's return value
    note: str = ""
    extra: dict = field(default_factory=dict)


def _out_mutations(draw, m: Models, out, *, grad_ok: bool = True, select_from=None):
    """A mutation of ``out`` (and the clients, for a partial overlap): returns
    ``(out, mutation, grad)``. ``select_from``: clients that aliasing may pick (default all)."""
    entries = m.entries(out)
    floats = m.float_positions()
    choices = [VALID, "alias", "overlap", "dtype", "shape", "meta"]
    if grad_ok:
        choices += ["grad", "grad_no_grad"]
    mutation = draw(st.sampled_from(choices))
    if mutation == VALID:
        return out, VALID, False
    if mutation in ("alias", "overlap"):
        j = draw(st.sampled_from(select_from if select_from is not None else range(m.K)))
        if m.kind == "flat":
            P = m.clients.shape[1]
            flat = m.clients.view(-1)
            if mutation == "alias" or j == m.K - 1:
                return m.clients[j], mutation, False
            start = j * P + draw(st.integers(1, P - 1))  # straddles clients j and j + 1
            return flat[start:start + P], mutation, False
        i = draw(st.sampled_from(range(len(entries))))
        target = m.client_entries(j)[i]
        if mutation == "alias" or target.numel() < 2:
            entries[i] = target
        else:
            # client j's entry becomes a view of a buffer that out's entry overlaps by half
            n = target.numel()
            buffer = torch.zeros(2 * n, dtype=target.dtype)
            buffer[:n] = target.reshape(-1)
            view = buffer[:n].view(target.shape)
            _replace_client_entry(m, j, i, view)
            shift = draw(st.integers(1, n - 1))
            entries[i] = buffer[shift:shift + n].view(target.shape)
        return m.build(entries), mutation, False
    i = draw(st.sampled_from(floats if mutation.startswith("grad") else range(len(entries))))
    t = entries[i]
    if mutation.startswith("grad"):
        entries[i] = torch.zeros_like(t).requires_grad_(True)
    elif mutation == "dtype":
        entries[i] = torch.zeros_like(t, dtype=OTHER_FLOAT[t.dtype] if t.is_floating_point()
                                      else torch.int32)
    elif mutation == "shape":
        entries[i] = torch.zeros(t.numel() + 1, dtype=t.dtype) if t.dim() else \
            torch.zeros(2, dtype=t.dtype)
    else:
        entries[i] = torch.empty_like(t, device="meta")
    return m.build(entries), mutation, mutation == "grad"


def _replace_client_entry(m: Models, k: int, i: int, tensor: torch.Tensor) -> None:
    c = m.clients[k]
    if isinstance(c, torch.Tensor):
        m.clients[k] = tensor
    elif isinstance(c, dict):
        c[list(c)[i]] = tensor
    else:
        c[i] = tensor


# ---------------------------------------------------------------- the check


def _bits(t: torch.Tensor) -> torch.Tensor | None:
    if t.device.type == "meta":
        return None
    return t.detach().clone().reshape(-1).view(torch.uint8)


def _same_bits(before, tensors) -> bool:
    return all(b is None or torch.equal(b, _bits(t)) for b, t in zip(before, tensors))


def _close(got: torch.Tensor, want: torch.Tensor, tol: float) -> None:
    assert got.shape == want.shape, (got.shape, want.shape)
    if got.device.type == "meta":
        return
    if not got.is_floating_point():
        assert torch.equal(got, want.to(got.dtype)), (got, want)
        return
    g, w = got.detach().double(), want.detach().double()
    scale = 1.0 + float(w.abs().max()) if w.numel() else 1.0
    torch.testing.assert_close(g, w, rtol=tol, atol=tol * scale, equal_nan=True)


def check_contract(call: Call) -> None:
    before_written = [_bits(t) for t in call.written]
    read = [t for t in call.read if not any(t is w for w in call.written)]
    before_read = [_bits(t) for t in read]
    context = torch.no_grad() if call.no_grad else contextlib.nullcontext()
    try:
        with context:
            got = call.run()
    except (ValueError, TypeError, RuntimeError) as err:
        message = str(err)
        if not call.invalid:
            pytest.fail(f"{call.api} refused a valid call ({call.note}): "
                        f"{type(err).__name__}: {message}")
        if isinstance(err, RuntimeError) and not isinstance(err, (ValueError, TypeError)):
            assert call.grad, f"{call.api}: RuntimeError for a fault that is not a gradient " \
                              f"({call.note}): {message}"
        assert call.api in message, f"the error does not name {call.api} ({call.note}): " \
                                    f"{type(err).__name__}: {message}"
        assert _same_bits(before_written, call.written), \
            f"{call.api} wrote before refusing ({call.note}): {message}"
        assert _same_bits(before_read, read), f"{call.api} wrote an input ({call.note})"
        return
    assert not call.invalid, f"{call.api} accepted an invalid call ({call.note})"
    assert _same_bits(before_read, read), f"{call.api} wrote an input ({call.note})"
    if call.expected is not None:
        for w, e in zip(call.written, call.expected()):
            _close(w, e, call.tol)
    if call.check is not None:
        call.check(got)


def _note(**parts) -> str:
    return ", ".join(f"{k}={v}" for k, v in parts.items())


# ---------------------------------------------------------------- aggregate


def _aggregate_expected(m: Models, weights, base, scale, normalize):
    w = torch.tensor(weights, dtype=torch.float64)
    if normalize:
        w = w / w.sum()
    out = []
    for i, first in enumerate(m.client_entries(0)):
        values = [m.client_entries(k)[i] for k in range(m.K)]
        if not first.is_floating_point():
            r = values[0]
            for v in values[1:]:
                r = torch.maximum(r, v)
            out.append(r)
            continue
        b = None if base is None else m.entries(base)[i].double()
        s = sum(float(w[k]) * (v.double() - (0 if b is None else b)) for k, v in enumerate(values))
        out.append(scale * s if b is None else b + scale * s)
    return out


@st.composite
def aggregate_calls(draw):
    m = draw(models())
    weights = draw(st.lists(st.sampled_from([0.5, 1.0, 2.0, 3.0]), min_size=m.K, max_size=m.K))
    normalize = draw(st.booleans())
    scale = draw(st.sampled_from([1.0, 0.5]))
    delta = draw(st.booleans())
    base = None
    if delta:
        base = m.build([_values(t.shape, t.dtype, 99 + i) if t.is_floating_point() else t.clone()
                        for i, t in enumerate(m.client_entries(0))])
    in_place = delta and draw(st.booleans())
    out = base if in_place else m.zeros_like_client()
    # in place, an out entry that requires grad would be a base entry that does: another case
    out, mutation, grad = _out_mutations(draw, m, out, grad_ok=not in_place)
    invalid = mutation not in (VALID, "grad_no_grad")
    if draw(st.sampled_from([False] * 5 + [True])):
        weights = list(weights)
        weights[draw(st.integers(0, m.K - 1))] = math.nan
        invalid, mutation = True, mutation + "+nan weight"
    expected = _aggregate_expected(m, [1.0 if math.isnan(x) else x for x in weights], base,
                                   scale, normalize) if not invalid else None
    written = m.entries(out)
    read = [t for k in range(m.K) for t in m.client_entries(k)]
    read += [] if base is None or in_place else m.entries(base)
    return Call("fedkernels.aggregate",
                lambda: fk.aggregate(m.clients, weights, base=base, scale=scale,
                                     normalize=normalize, out=out),
                written, read, (lambda: expected), TOL[m.dtype], invalid, grad,
                no_grad=mutation == "grad_no_grad",
                note=_note(kind=m.kind, K=m.K, dtype=m.dtype, mutation=mutation,
                           in_place=in_place))


FAST, FULL = _tiers(60, 600)


@FAST
@given(aggregate_calls())
def test_aggregate(call):
    check_contract(call)


@pytest.mark.slow
@FULL
@given(aggregate_calls())
def test_aggregate_long(call):
    check_contract(call)


# ---------------------------------------------------------------- Accumulator


@st.composite
def accumulator_runs(draw):
    m = draw(models(kinds=("tensor", "list", "dict")))
    acc = fk.Accumulator()
    good = draw(st.integers(1, m.K))
    for k in range(good - 1):
        acc.add(m.clients[k], 1.0 + k)
    update, weight = m.clients[good - 1], 1.0 + good - 1
    fault = draw(st.sampled_from([VALID, "dtype", "shape", "meta", "nan weight", "keys"]))
    if fault != VALID and acc.count == 0:
        acc.add(m.clients[0], 1.0)  # the structure comes from the first update
        good = 0
    if fault in ("dtype", "shape", "meta"):
        entries = [t.clone() for t in m.entries(update)]
        i = draw(st.integers(0, len(entries) - 1))
        t = entries[i]
        entries[i] = (torch.zeros_like(t, dtype=OTHER_FLOAT[t.dtype] if t.is_floating_point()
                                       else torch.int32) if fault == "dtype" else
                      torch.zeros(t.numel() + 1, dtype=t.dtype) if fault == "shape" else
                      torch.empty_like(t, device="meta"))
        update = m.build(entries)
    elif fault == "nan weight":
        weight = math.nan
    elif fault == "keys":
        if m.kind == "dict":
            update = dict(update, extra=torch.zeros(1))
        elif m.kind == "list":
            update = list(update) + [torch.zeros(1)]
        else:
            update = [update, update]
    before = acc.result() if acc.count else None

    def run():
        acc.add(update, weight)

    call = Call("fedkernels.Accumulator", run, [], [t for k in range(m.K)
                                                    for t in m.client_entries(k)],
                None, TOL[m.dtype], fault != VALID,
                note=_note(kind=m.kind, dtype=m.dtype, fault=fault))
    return call, acc, before, m, good, fault


@FAST
@given(accumulator_runs())
def test_accumulator_add(run):
    _check_accumulator(run)


@pytest.mark.slow
@FULL
@given(accumulator_runs())
def test_accumulator_add_long(run):
    _check_accumulator(run)


def _check_accumulator(run):
    call, acc, before, m, good, fault = run
    count = acc.count
    check_contract(call)
    if fault == VALID:
        assert acc.count == count + 1
        weights = [1.0 + k for k in range(good)]
        want = _aggregate_expected(Models(m.kind, m.clients[:good], m.dtype, m.shapes),
                                   weights, None, 1.0, False)
        for g, w in zip(m.entries(acc.result()), want):
            _close(g, w, TOL[m.dtype] * 4)
        return
    # refused: the running state is as before, bitwise
    assert acc.count == count
    for a, b in zip(m.entries(acc.result()), m.entries(before)):
        assert torch.equal(a, b) or (a.is_floating_point() and torch.equal(a.isnan(), b.isnan()))


# ---------------------------------------------------------------- robust rules


def _krum_selection(m: Models, f: int, count: int, among=None) -> list[int]:
    """The ``count`` lowest Krum scores (ties: lower index), from float64 distances."""
    flat = [m.client_entries(k)[i] for k in range(m.K) for i in m.float_positions()]
    d = R.pairwise_sq_distances_reference(flat, m.K).numpy() if flat else \
        np.zeros((m.K, m.K))
    among = list(range(m.K)) if among is None else among
    sub = d[np.ix_(among, among)]
    n = max(1, len(among) - f - 2)
    scores = np.array([np.sum(np.sort(row)[1:n + 1]) for row in sub])
    scores[np.isnan(scores)] = np.inf
    return [among[i] for i in np.argsort(scores, kind="stable")[:count]]


def _bulyan_selection(m: Models, f: int, theta: int, selection: str) -> list[int]:
    if selection == "multikrum":
        return _krum_selection(m, f, theta)
    remaining, chosen = list(range(m.K)), []
    for _ in range(theta):
        best = _krum_selection(m, f, 1, remaining)[0]
        chosen.append(best)
        remaining.remove(best)
    return chosen


def _per_rule(m: Models, who: list[int], float_rule) -> list[torch.Tensor]:
    """The result's entries: ``float_rule`` over clients ``who`` for the float entries
    (client-major tensors, one call), the maximum over ``who`` for the integer ones."""
    floats = m.float_positions()
    flat = [m.client_entries(k)[i] for k in who for i in floats]
    results = iter(float_rule(flat, len(who)) if floats else [])
    out = []
    for i in range(len(m.client_entries(0))):
        if i in floats:
            out.append(next(results))
        else:
            r = m.client_entries(who[0])[i]
            for k in who[1:]:
                r = torch.maximum(r, m.client_entries(k)[i])
            out.append(r)
    return out


ROBUST_RULES = ["median", "trimmed", "window", "krum", "multikrum", "bulyan", "bulyan-multikrum"]


@st.composite
def robust_calls(draw, rule):
    f = draw(st.integers(0, 1))
    min_k = 4 * f + 3 if rule.startswith("bulyan") else 2
    m = draw(models(min_k=min_k, max_k=max(min_k, 7)))
    if draw(st.booleans()) and m.K > 2:  # an outlier: one client far from the rest
        j = draw(st.integers(0, m.K - 1))
        entries = [t * 50 + 20 if t.is_floating_point() else t for t in m.client_entries(j)]
        if m.kind == "flat":
            m.clients[j] = entries[0]
        else:
            m.clients[j] = m.build(entries)
    selected = list(range(m.K))
    if rule == "median":
        api, fn = "fedkernels.coordinate_median", lambda out: robust.coordinate_median(
            m.clients, out=out)
        rule_of = lambda flat, K: R.coordinate_median_reference(flat, K)  # noqa: E731
    elif rule == "trimmed":
        beta = draw(st.sampled_from([0.0, 0.1, 0.25, 0.4]))
        cut = int(beta * m.K)
        api, fn = "fedkernels.trimmed_mean", lambda out: robust.trimmed_mean(m.clients, beta,
                                                                               out=out)
        rule_of = lambda flat, K: R.trimmed_mean_reference(flat, K, cut)  # noqa: E731
    elif rule == "window":
        window = draw(st.integers(1, m.K))
        api, fn = "fedkernels.nearest_to_median_mean", lambda out: robust.nearest_to_median_mean(
            m.clients, window, out=out)
        rule_of = lambda flat, K: R.median_window_mean_reference(flat, K, window)  # noqa: E731
    elif rule in ("krum", "multikrum"):
        keep = 1 if rule == "krum" else draw(st.integers(2, m.K))
        weights = None if keep == 1 or draw(st.booleans()) else \
            draw(st.lists(st.sampled_from([1.0, 2.0, 5.0]), min_size=m.K, max_size=m.K))
        selected = _krum_selection(m, f, keep)
        api, fn = "fedkernels.krum", lambda out: robust.krum(m.clients, f, keep,
                                                              weights=weights, out=out)
        w = [1.0] * m.K if weights is None else weights
        total = sum(w[k] for k in selected)

        def rule_of(flat, K):
            T = len(flat) // K
            return [sum(w[selected[s]] / total * flat[s * T + t].double() for s in range(K))
                    for t in range(T)]
    else:
        selection = "multikrum" if rule == "bulyan-multikrum" else "iterative"
        theta, beta = m.K - 2 * f, m.K - 4 * f
        selected = _bulyan_selection(m, f, theta, selection)
        api, fn = "fedkernels.bulyan", lambda out: robust.bulyan(m.clients, f,
                                                                  selection=selection, out=out)
        rule_of = lambda flat, K: R.median_window_mean_reference(flat, K, beta)  # noqa: E731
    # aliasing: any client, and an unselected one in half the examples where there is one
    unselected = [k for k in range(m.K) if k not in selected]
    pick = unselected if unselected and draw(st.booleans()) else None
    out, mutation, grad = _out_mutations(draw, m, m.zeros_like_client(), select_from=pick)
    meta_clients = mutation == VALID and draw(st.sampled_from([False] * 3 + [True]))
    if meta_clients:  # every client on meta, no out: a meta result, or a refusal by name
        meta = [torch.empty_like(c, device="meta") for c in m.client_entries(0)]
        m_meta = Models(m.kind, [m.build([torch.empty_like(t, device="meta")
                                          for t in meta]) for _ in range(m.K)]
                        if m.kind != "flat" else torch.empty_like(m.clients, device="meta"),
                        m.dtype, m.shapes)
        needs_values = rule.startswith(("krum", "multikrum", "bulyan"))
        meta_api = api

        def run_meta():
            if rule == "median":
                return robust.coordinate_median(m_meta.clients)
            if rule == "trimmed":
                return robust.trimmed_mean(m_meta.clients, 0.1)
            if rule == "window":
                return robust.nearest_to_median_mean(m_meta.clients, 1)
            if rule.startswith("bulyan"):
                return robust.bulyan(m_meta.clients, f)
            return robust.krum(m_meta.clients, f)

        def check_meta(result):
            result = result[0] if isinstance(result, tuple) else result
            assert all(t.device.type == "meta" for t in m_meta.entries(result))

        return Call(meta_api, run_meta, [], [], None, 0.0, needs_values, check=check_meta,
                    note=_note(rule=rule, kind=m.kind, meta_clients=True))
    invalid = mutation not in (VALID, "grad_no_grad")
    written = m.entries(out)
    read = [t for k in range(m.K) for t in m.client_entries(k)]

    def expected():
        if rule == "krum":
            return [t.clone() for t in m.client_entries(selected[0])]
        return _per_rule(m, selected, rule_of)

    def check(result):
        if rule in ("krum", "multikrum"):
            assert result[1] == selected, (result[1], selected)

    return Call(api, lambda: fn(out), written, read, expected,
                TOL[m.dtype] * (4 if rule == "multikrum" else 1), invalid, grad,
                no_grad=mutation == "grad_no_grad", check=check,
                note=_note(rule=rule, kind=m.kind, K=m.K, f=f, dtype=m.dtype,
                           mutation=mutation, selected=selected))


FAST_ROBUST, FULL_ROBUST = _tiers(40, 400)


@pytest.mark.parametrize("rule", ROBUST_RULES)
def test_robust_rules(rule):
    FAST_ROBUST(given(robust_calls(rule))(check_contract))()


@pytest.mark.slow
@pytest.mark.parametrize("rule", ROBUST_RULES)
def test_robust_rules_long(rule):
    FULL_ROBUST(given(robust_calls(rule))(check_contract))()


# ---------------------------------------------------------------- private_aggregate


@st.composite
def private_calls(draw):
    m = draw(models(max_k=5))
    base = m.build([_values(t.shape, t.dtype, 5 + i) if t.is_floating_point()
                    else torch.zeros_like(t) for i, t in enumerate(m.client_entries(0))])
    clip = draw(st.sampled_from([0.5, 2.0, 100.0]))
    weights = None if draw(st.booleans()) else \
        draw(st.lists(st.sampled_from([1.0, 2.0, 3.0]), min_size=m.K, max_size=m.K))
    in_place = draw(st.booleans())
    out = base if in_place else m.zeros_like_client()
    out, mutation, grad = _out_mutations(draw, m, out, grad_ok=not in_place)
    invalid = mutation not in (VALID, "grad_no_grad")
    if weights is not None and draw(st.sampled_from([False] * 4 + [True])):
        weights = list(weights)
        weights[0] = math.nan
        invalid, mutation = True, mutation + "+nan weight"
    floats = m.float_positions()
    b = [t.detach().clone().double() for t in m.entries(base)]  # before an in-place write

    def expected():
        w = [1.0] * m.K if weights is None else weights
        w = [x / sum(w) for x in w]
        norms = [math.sqrt(sum(float(((m.client_entries(k)[i].double() - b[i]) ** 2).sum())
                               for i in floats)) for k in range(m.K)]
        coef = [wk * (1.0 if n == 0 else min(1.0, clip / n)) for wk, n in zip(w, norms)]
        return [b[i] + sum(c * (m.client_entries(k)[i].double() - b[i])
                           for k, c in enumerate(coef)) if i in floats else m.entries(base)[i]
                for i in range(len(b))]

    read = [t for k in range(m.K) for t in m.client_entries(k)]
    read += [] if in_place else m.entries(base)
    return Call("fedkernels.private_aggregate",
                lambda: fk.private_aggregate(m.clients, weights, base=base, clip_norm=clip,
                                             noise_std=0.0, out=out),
                m.entries(out), read, expected, TOL[m.dtype] * 4, invalid, grad,
                no_grad=mutation == "grad_no_grad",
                note=_note(kind=m.kind, K=m.K, dtype=m.dtype, mutation=mutation,
                           in_place=in_place))


@FAST
@given(private_calls())
def test_private_aggregate(call):
    check_contract(call)


@pytest.mark.slow
@FULL
@given(private_calls())
def test_private_aggregate_long(call):
    check_contract(call)


# ---------------------------------------------------------------- SGLD and SuPerFed (in place)


@st.composite
def in_place_op_calls(draw):
    op = draw(st.sampled_from(["sgld_step_", "sgld_compose_step", "superfed_sgd_step_"]))
    dtype = draw(st.sampled_from([torch.float32, torch.float64]))
    seed = draw(st.integers(0, 2**16))
    fault = draw(st.sampled_from([VALID, "grad", "grad_no_grad", "overlap", "dtype", "shape",
                                  "meta"]))
    n = draw(st.integers(2, 6))
    shape = (n,)

    def fresh(i, s=shape):
        return _values(s, dtype, seed + i)

    if op == "sgld_step_":
        x, grad, noise = fresh(0), fresh(1), fresh(2)
        if fault == "overlap":  # grad reads half of what x's write covers
            buffer = torch.cat([x, grad])
            x, grad = buffer[:n], buffer[1:n + 1]
        elif fault in ("grad", "grad_no_grad"):
            x = x.clone().requires_grad_(True)
        elif fault == "dtype":
            grad = grad.to(torch.float64 if dtype == torch.float32 else torch.float32)
        elif fault == "shape":
            grad = fresh(1, (n + 1,))
        elif fault == "meta":
            grad = torch.empty_like(grad, device="meta")
        x0, g0, n0 = x.detach().clone(), grad.detach().clone(), noise.clone()
        return Call("fedkernels.sgld_step_",
                    lambda: fk.sgld_step_(x, grad, step_size=0.1, noise_std=0.01, noise=noise),
                    [x], [grad, noise],
                    lambda: [R.sgld_step_reference(x0, g0, 0.1, 0.01, noise=n0)],
                    TOL[dtype], fault not in (VALID, "grad_no_grad"), fault == "grad",
                    no_grad=fault == "grad_no_grad", note=_note(op=op, fault=fault))
    if op == "sgld_compose_step":
        K, M = draw(st.integers(1, 3)), 2
        x = fresh(0, (M, n))
        grads, energies = fresh(1, (K, M, n)), fresh(2, (K, M))
        log_w, noise = fresh(3, (K,)), fresh(4, (M, n))
        if fault == "overlap":
            buffer = torch.cat([x.reshape(-1), grads.reshape(-1)])
            x = buffer[:M * n].view(M, n)
            grads = buffer[1:1 + K * M * n].view(K, M, n)
        elif fault in ("grad", "grad_no_grad"):
            x = x.clone().requires_grad_(True)
        elif fault == "dtype":  # (energies and log weights may be of any float dtype)
            grads = grads.to(torch.float64 if dtype == torch.float32 else torch.float32)
        elif fault == "shape":
            energies = fresh(2, (K, M + 1))
        elif fault == "meta":
            grads = torch.empty_like(grads, device="meta")
        snap = [t.detach().clone() for t in (x, grads, energies, log_w, noise)]
        return Call("fedkernels.sgld_compose_step",
                    lambda: fk.sgld_compose_step(x, grads, energies, log_w, step_size=0.1,
                                                 noise_std=0.01, noise=noise, inplace=True),
                    [x], [grads, energies, log_w, noise],
                    lambda: [R.sgld_compose_step_reference(*snap[:4], 0.1, 0.01,
                                                           noise=snap[4])[0]],
                    TOL[dtype] * 4, fault not in (VALID, "grad_no_grad"), fault == "grad",
                    no_grad=fault == "grad_no_grad", note=_note(op=op, fault=fault))
    T = draw(st.integers(1, 3))
    g = [fresh(10 + t) for t in range(T)]
    l_ = [fresh(20 + t) for t in range(T)]
    grads = [fresh(30 + t) for t in range(T)]
    stats = torch.zeros(T, 4, dtype=torch.float64)
    lam = 0.3
    p = draw(st.integers(0, T - 1))
    if fault == "overlap":  # grads[p] reads part of l[p], which the step writes
        buffer = torch.cat([l_[p], grads[p]])
        l_[p], grads[p] = buffer[:n], buffer[1:n + 1]
    elif fault in ("grad", "grad_no_grad"):
        g[p] = g[p].clone().requires_grad_(True)
    elif fault == "dtype":
        grads[p] = grads[p].to(torch.float64 if dtype == torch.float32 else torch.float32)
    elif fault == "shape":
        grads[p] = fresh(30 + p, (n + 1,))
    elif fault == "meta":
        grads[p] = torch.empty_like(grads[p], device="meta")
    snap_g, snap_l, snap_grads = ([t.detach().clone() for t in ts] for ts in (g, l_, grads))

    def expected():
        new_g, new_l, _, _ = R.superfed_sgd_step_reference(snap_g, snap_l, [], [], snap_grads,
                                                           stats, lam, lr=0.1)
        return new_g + new_l

    return Call("fedkernels.superfed_sgd_step_",
                lambda: superfed_sgd_step_(g, l_, [], [], grads, stats, lam, lr=0.1),
                g + l_, grads, expected, TOL[dtype] * 4,
                fault not in (VALID, "grad_no_grad"), fault == "grad",
                no_grad=fault == "grad_no_grad", note=_note(op=op, fault=fault, p=p))


@FAST
@given(in_place_op_calls())
def test_sgld_and_superfed_in_place(call):
    check_contract(call)


@pytest.mark.slow
@FULL
@given(in_place_op_calls())
def test_sgld_and_superfed_in_place_long(call):
    check_contract(call)


# ---------------------------------------------------------------- integrations


@st.composite
def integration_calls(draw):
    which = draw(st.sampled_from(["WeightedPartial.result", "aggregate_into_module",
                                  "SuPerFedSGD.step"]))
    if which == "WeightedPartial.result":
        m = draw(models(kinds=("list", "dict"), dtypes=[torch.float32, torch.float64]))
        weights = [1.0 + k for k in range(m.K)]
        delta = draw(st.booleans())
        base = None
        if delta:
            base = m.build([_values(t.shape, t.dtype, 50 + i) if t.is_floating_point()
                            else t.clone() for i, t in enumerate(m.client_entries(0))])
        partial = WeightedPartial.from_clients(m.clients, weights, base=base)
        in_place = delta and draw(st.booleans())
        out = base if in_place else m.zeros_like_client()
        out, mutation, grad = _out_mutations(draw, m, out, grad_ok=not in_place)
        if mutation in ("alias", "overlap"):
            mutation = VALID  # the partial holds sums, not the clients: nothing to alias
            out = base if in_place else m.zeros_like_client()
        invalid = mutation not in (VALID, "grad_no_grad")
        expected = _aggregate_expected(m, weights, base, 1.0, True)
        return Call("fedkernels.integrations.distributed",
                    lambda: partial.result(normalize=True, out=out), m.entries(out),
                    [t for k in range(m.K) for t in m.client_entries(k)],
                    lambda: expected, TOL[m.dtype] * 4, invalid, grad,
                    no_grad=mutation == "grad_no_grad",
                    note=_note(which=which, kind=m.kind, mutation=mutation, delta=delta))
    if which == "aggregate_into_module":
        K = draw(st.integers(1, 4))
        torch.manual_seed(draw(st.integers(0, 2**16)))
        target = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
        clients = [torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.BatchNorm1d(2))
                   for _ in range(K)]
        fault = draw(st.sampled_from([VALID, "target is a client", "nan weight"]))
        if fault == "target is a client":
            clients[draw(st.integers(0, K - 1))] = target
        weights = [1.0 + k for k in range(K)]
        if fault == "nan weight":
            weights[0] = math.nan
        states = [c.state_dict() for c in clients]
        written = list(target.state_dict().values())
        expected = _aggregate_expected(Models("dict", states, torch.float32, []), weights,
                                       None, 1.0, True)
        return Call("fedkernels.aggregate",
                    lambda: aggregate_into_module(target, clients, weights), written,
                    [t for s in states for t in s.values()], lambda: expected, 1e-5,
                    fault != VALID, note=_note(which=which, fault=fault))
    # SuPerFedSGD.step: a parameter that requires grad is its normal input (step runs under
    # no_grad, as optimizers do); a refusal here would be a failure
    n = draw(st.integers(1, 4))
    g = [torch.nn.Parameter(_values((n,), torch.float32, 1))]
    l_ = [torch.nn.Parameter(_values((n,), torch.float32, 2))]
    opt = fk.SuPerFedSGD(g, l_, lr=0.1, nu=0.0, mu=0.0)
    theta, reg = opt.mix(0.25)
    (theta[0] * torch.arange(1.0, n + 1)).sum().backward()
    g0, l0 = g[0].detach().clone(), l_[0].detach().clone()
    d = torch.arange(1.0, n + 1)
    return Call("fedkernels.SuPerFedSGD", opt.step, g + l_, [],
                lambda: [g0 - 0.1 * 0.75 * d, l0 - 0.1 * 0.25 * d], 1e-6, False,
                note=_note(which=which))


@FAST
@given(integration_calls())
def test_integrations_in_place(call):
    check_contract(call)


@pytest.mark.slow
@FULL
@given(integration_calls())
def test_integrations_in_place_long(call):
    check_contract(call)


# ---------------------------------------------------------------- the checker itself


def test_the_checker_fails_a_refusal_of_a_valid_call():
    call = Call("fedkernels.x", lambda: (_ for _ in ()).throw(ValueError("fedkernels.x: no")),
                [], [], None, 0.0, invalid=False)
    with pytest.raises(pytest.fail.Exception, match="refused a valid call"):
        check_contract(call)


def test_the_checker_fails_a_write_before_a_refusal():
    t = torch.zeros(3)

    def run():
        t.add_(1)
        raise ValueError("fedkernels.x: too late")

    with pytest.raises(AssertionError, match="wrote before refusing"):
        check_contract(Call("fedkernels.x", run, [t], [], None, 0.0, invalid=True))


def test_the_checker_fails_an_unnamed_error_and_an_accepted_invalid_call():
    with pytest.raises(AssertionError, match="does not name"):
        check_contract(Call("fedkernels.x", lambda: (_ for _ in ()).throw(ValueError("no")),
                            [], [], None, 0.0, invalid=True))
    with pytest.raises(AssertionError, match="accepted an invalid call"):
        check_contract(Call("fedkernels.x", lambda: None, [], [], None, 0.0, invalid=True))
