"""Property-based tests (hypothesis): random K, shapes, dtypes, weights and modes; the op
matches the reference, is linear in the weights and in the updates, and does not depend on
the order of the clients beyond float rounding."""

from __future__ import annotations

import math

import pytest
import torch

hypothesis = pytest.importorskip("hypothesis")
from conftest import FLOAT_DTYPES, assert_close, bitwise_equal, property_examples, tolerances  # noqa: E402
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

import fedkernels  # noqa: E402
from fedkernels.ops.reference import aggregate_reference  # noqa: E402

SETTINGS = settings(max_examples=property_examples(60), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 6), min_size=0, max_size=3).map(tuple) | st.sampled_from(
    [(1,), (31,), (33,), (65,), (257,), (7, 9)])
weights_st = st.floats(-3.0, 3.0, allow_nan=False, allow_infinity=False)


@st.composite
def problems(draw, dtypes=FLOAT_DTYPES):
    num_clients = draw(st.integers(1, 9))
    tensor_shapes = draw(st.lists(shapes, min_size=1, max_size=4))
    dtype = draw(st.sampled_from(dtypes))
    seed = draw(st.integers(0, 2**16))
    g = torch.Generator().manual_seed(seed)
    clients = [[torch.randn(s, generator=g, dtype=torch.float64).to(dtype) for s in tensor_shapes]
               for _ in range(num_clients)]
    weights = draw(st.lists(weights_st, min_size=num_clients, max_size=num_clients))
    base = None
    if draw(st.booleans()):
        base_dtype = dtype
        if dtype in (torch.float16, torch.bfloat16) and draw(st.booleans()):
            base_dtype = torch.float32
        base = [torch.randn(s, generator=g, dtype=torch.float64).to(base_dtype)
                for s in tensor_shapes]
    scale = draw(st.sampled_from([1.0, 0.5, 2.0, -1.25]))
    structure = draw(st.sampled_from(["list", "dict"]))
    if structure == "dict":
        names = [f"layer{i}.w" for i in range(len(tensor_shapes))]
        clients = [dict(zip(names, c)) for c in clients]
        base = None if base is None else dict(zip(names, base))
    return clients, weights, base, scale, dtype


def _magnitude(weights):
    return max(1.0, sum(abs(w) for w in weights))


@SETTINGS
@given(problems())
def test_matches_reference(problem):
    clients, weights, base, scale, dtype = problem
    result = fedkernels.aggregate(clients, weights, base=base, scale=scale)
    expected = aggregate_reference(clients, weights, base=base, scale=scale)
    # Errors grow with the size of the terms summed (|scale| * sum |w_k| * |x|).
    grow = (abs(scale) * _magnitude(weights)) ** 2
    assert_close(result, expected, None, num_clients=int(math.ceil(grow)))


@SETTINGS
@given(problems(), st.booleans())
def test_deterministic(problem, normalize):
    clients, weights, base, scale, _ = problem
    if normalize and abs(sum(weights)) < 1e-3:
        weights = [w + 1.0 for w in weights]
    first = fedkernels.aggregate(clients, weights, base=base, scale=scale, normalize=normalize)
    again = fedkernels.aggregate(clients, weights, base=base, scale=scale, normalize=normalize)
    assert bitwise_equal(first, again)


@SETTINGS
@given(problems(dtypes=[torch.float64]), weights_st, weights_st)
def test_linear_in_weights(problem, a, b):
    """agg(x, a*w + b*v) = a*agg(x, w) + b*agg(x, v) (float64, plain mode)."""
    clients, weights, _, scale, _ = problem
    other = [(i % 3) - 1.0 for i in range(len(weights))]
    mixed = [a * w + b * v for w, v in zip(weights, other)]
    left = fedkernels.aggregate(clients, mixed, scale=scale)
    right_w = fedkernels.aggregate(clients, weights, scale=scale)
    right_v = fedkernels.aggregate(clients, other, scale=scale)
    items = (lambda m: list(m.values())) if isinstance(left, dict) else list
    for l_, rw, rv in zip(items(left), items(right_w), items(right_v)):
        torch.testing.assert_close(l_, a * rw + b * rv, rtol=1e-10, atol=1e-10)


@SETTINGS
@given(problems(dtypes=[torch.float64]), weights_st)
def test_linear_in_updates(problem, c):
    """agg(c*x + y) = c*agg(x) + agg(y), and in delta mode the result moves with the base:
    agg(x + d, base=b + d) = agg(x, base=b) + d."""
    clients, weights, base, scale, _ = problem
    items = (lambda m: list(m.values())) if isinstance(clients[0], dict) else list
    rebuild = (lambda like, ts: dict(zip(like, ts))) if isinstance(clients[0], dict) else (
        lambda like, ts: ts)
    shifted = [rebuild(cl, [c * t + 1.0 for t in items(cl)]) for cl in clients]
    got = items(fedkernels.aggregate(shifted, weights, scale=scale))
    plain = items(fedkernels.aggregate(clients, weights, scale=scale))
    ones = scale * sum(weights)
    for g_, p_ in zip(got, plain):
        torch.testing.assert_close(g_, c * p_ + ones, rtol=1e-9, atol=1e-9)
    if base is not None:
        d = 0.75
        moved = [rebuild(cl, [t + d for t in items(cl)]) for cl in clients]
        moved_base = rebuild(base, [t + d for t in items(base)])
        got = items(fedkernels.aggregate(moved, weights, base=moved_base, scale=scale))
        want = items(fedkernels.aggregate(clients, weights, base=base, scale=scale))
        for g_, w_ in zip(got, want):
            torch.testing.assert_close(g_, w_ + d, rtol=1e-9, atol=1e-9)


@SETTINGS
@given(problems(), st.randoms(use_true_random=False))
def test_permutation_of_clients(problem, rng):
    """Reordering the clients (with their weights) changes the result by rounding only."""
    clients, weights, base, scale, dtype = problem
    order = list(range(len(clients)))
    rng.shuffle(order)
    result = fedkernels.aggregate(clients, weights, base=base, scale=scale)
    permuted = fedkernels.aggregate([clients[i] for i in order], [weights[i] for i in order],
                                    base=base, scale=scale)
    grow = (abs(scale) * _magnitude(weights)) ** 2
    tol = tolerances(dtype, int(math.ceil(grow)))
    out_dtype = dtype if base is None else next(iter(
        base.values() if isinstance(base, dict) else base)).dtype
    if out_dtype in (torch.float16, torch.bfloat16):
        # Two fp32 sums that differ in the last bit may round to neighbouring half values.
        tol = {k: 2 * v for k, v in tol.items()}
    items = (lambda m: list(m.values())) if isinstance(result, dict) else list
    for a, b in zip(items(result), items(permuted)):
        torch.testing.assert_close(a.double(), b.double(), **tol)


@SETTINGS
@given(problems(), st.booleans())
def test_accumulator_equals_aggregate(problem, normalize):
    clients, weights, base, scale, dtype = problem
    if normalize and abs(sum(weights)) < 0.5:
        weights = [abs(w) + 0.1 for w in weights]
    acc = fedkernels.Accumulator(base=base, scale=scale)
    for client, w in zip(clients, weights):
        acc.add(client, w)
    streamed = acc.result(normalize=normalize)
    at_once = fedkernels.aggregate(clients, weights, base=base, scale=scale, normalize=normalize)
    grow = (abs(scale) * _magnitude(weights) / (abs(sum(weights)) if normalize else 1.0)) ** 2
    # The streaming form computes b + s (sum w x - (sum w) b): more cancellation than
    # b + s sum w (x - b) when base is given, so allow a few more roundings.
    tol = tolerances(dtype, int(math.ceil(grow)) * (16 if base is not None else 1))
    out_dtype = dtype if base is None else next(iter(
        base.values() if isinstance(base, dict) else base)).dtype
    if out_dtype in (torch.float16, torch.bfloat16):
        tol = {k: 2 * v for k, v in tol.items()}
    items = (lambda m: list(m.values())) if isinstance(at_once, dict) else list
    for a, b in zip(items(streamed), items(at_once)):
        assert a.dtype == b.dtype and a.shape == b.shape
        torch.testing.assert_close(a.double(), b.double(), **tol)
