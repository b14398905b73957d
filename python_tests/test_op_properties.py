"""Property test over every op family: on random shapes (0-d and empty included), dtypes,
devices (cpu, or one argument on meta) and values (NaN/Inf injected), each call on valid
arguments equals the pure-PyTorch reference (NaN where the reference has NaN), and each call
on invalid ones (a mix of meta and cpu tensors, a parameter out of its range) raises a clear
``ValueError``/``TypeError`` naming the op. Which it is, each test decides from the arguments
before the call: a refusal of a valid call fails, as an accepted invalid one does. Never a
crash, never another exception, never a result that differs from the reference.
"""

from __future__ import annotations

import math

import pytest
import torch
from conftest import property_examples
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import fedkernels
from fedkernels import ops
from fedkernels.ops import reference as R

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]
TOL = {torch.float32: 2e-5, torch.float64: 1e-10, torch.float16: 4e-3, torch.bfloat16: 3e-2}
SETTINGS = settings(max_examples=property_examples(30), deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])

shapes = st.lists(st.integers(0, 4), min_size=0, max_size=3).map(tuple)


@st.composite
def tensors(draw, shape, dtype, poison=True):
    """A tensor of ``shape`` whose entries may include NaN or +-Inf."""
    seed = draw(st.integers(0, 2**16))
    t = torch.randn(shape, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    if poison and t.numel() and draw(st.booleans()):
        t.view(-1)[draw(st.integers(0, t.numel() - 1))] = draw(
            st.sampled_from([math.nan, math.inf, -math.inf]))
    return t.to(dtype)


def _outcome(call, reference, dtype, mixed_devices: bool, invalid: str | None = None):
    """A call on invalid arguments (``mixed_devices``: meta and cpu tensors; ``invalid``: why
    else) raises a clear error; any other call returns the reference's result (only the
    shapes when every tensor was on meta), and a refusal of it fails the property."""
    invalid = invalid or ("mixes meta and cpu tensors" if mixed_devices else None)
    try:
        got = call()
    except (ValueError, TypeError) as err:
        assert "fedkernels" in str(err), f"unclear error: {err!r}"
        assert invalid is not None, f"a valid call was refused: {err}"
        return
    assert invalid is None, f"an invalid call ({invalid}) returned instead of raising"
    want = reference()
    got = got if isinstance(got, (list, tuple)) else [got]
    want = want if isinstance(want, (list, tuple)) else [want]
    assert len(got) == len(want)
    for g, w in zip(got, want):
        w = torch.as_tensor(w)  # a reference sum over no tensors is a Python 0.0
        assert g.shape == w.shape, (g.shape, w.shape)
        if g.device.type == "meta":
            continue
        torch.testing.assert_close(g.double(), w.double(), rtol=TOL[dtype], atol=TOL[dtype],
                                   equal_nan=True)


def _maybe_meta(draw, tensors_by_name: dict):
    """Moves at most one named tensor (or one entry of a list) to meta; returns the arguments
    and whether the call now mixes meta and cpu tensors."""
    name = draw(st.sampled_from([None, *tensors_by_name]))
    if name is None:
        return tensors_by_name, False
    value = tensors_by_name[name]
    if isinstance(value, list):
        if not value:
            return tensors_by_name, False
        i = draw(st.integers(0, len(value) - 1))
        value = list(value)
        value[i] = torch.empty_like(value[i], device="meta")
    else:
        value = torch.empty_like(value, device="meta")
    count = sum(len(v) if isinstance(v, list) else 1 for v in tensors_by_name.values())
    return {**tensors_by_name, name: value}, count > 1


@SETTINGS
@given(st.data())
def test_weighted_sum(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    k = data.draw(st.integers(1, 4))
    layer_shapes = data.draw(st.lists(shapes, min_size=1, max_size=3))
    clients = [[data.draw(tensors(s, dtype)) for s in layer_shapes] for _ in range(k)]
    weights = torch.tensor(data.draw(st.lists(st.floats(-3, 3), min_size=k, max_size=k)),
                           dtype=torch.float64)
    delta = data.draw(st.booleans())
    base = [data.draw(tensors(s, dtype)) for s in layer_shapes] if delta else []
    args, moved = _maybe_meta(data.draw, {"flat": [t for c in clients for t in c], "base": base})
    _outcome(lambda: ops.weighted_sum(args["flat"], weights, args["base"], 1.0, delta),
             lambda: R.weighted_sum_reference(clients, weights, base or None, 1.0, delta),
             dtype, moved)


@SETTINGS
@given(st.data())
def test_robust_rules_and_distances(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    k = data.draw(st.integers(1, 6))
    layer_shapes = data.draw(st.lists(shapes, min_size=1, max_size=3))
    flat = [data.draw(tensors(s, dtype)) for _ in range(k) for s in layer_shapes]
    rule = data.draw(st.sampled_from(["median", "trimmed", "window", "distances"]))
    param = data.draw(st.integers(0, k))
    args, moved = _maybe_meta(data.draw, {"flat": flat})
    calls = {
        "median": (lambda: ops.coordinate_median(args["flat"], k),
                   lambda: R.coordinate_median_reference(flat, k)),
        "trimmed": (lambda: ops.trimmed_mean(args["flat"], k, param),
                    lambda: R.trimmed_mean_reference(flat, k, param)),
        "window": (lambda: ops.median_window_mean(args["flat"], k, param),
                   lambda: R.median_window_mean_reference(flat, k, param)),
        "distances": (lambda: ops.pairwise_sq_distances(args["flat"], k),
                      lambda: R.pairwise_sq_distances_reference(flat, k)),
    }
    invalid = {"trimmed": None if 0 <= param < k - param else "cut not in [0, K/2)",
               "window": None if 1 <= param <= k else "window not in [1, K]"}.get(rule)
    _outcome(*calls[rule], torch.float64 if rule == "distances" else dtype, moved, invalid)


@SETTINGS
@given(st.data())
def test_norms_and_private_sum(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    k = data.draw(st.integers(1, 4))
    layer_shapes = data.draw(st.lists(shapes, min_size=1, max_size=3))
    flat = [data.draw(tensors(s, dtype)) for _ in range(k) for s in layer_shapes]
    base = [data.draw(tensors(s, dtype)) for s in layer_shapes]
    coef = torch.tensor(data.draw(st.lists(st.floats(0, 1), min_size=k, max_size=k)),
                        dtype=torch.float64)
    args, moved = _maybe_meta(data.draw, {"flat": flat, "base": base})
    if data.draw(st.booleans()):
        _outcome(lambda: ops.update_norms(args["flat"], k, args["base"]),
                 lambda: R.update_norms_reference(flat, k, base), torch.float64, moved)
    else:
        _outcome(lambda: ops.private_sum(args["flat"], coef, args["base"], 0.0),
                 lambda: R.private_sum_reference(flat, coef, base, 0.0), dtype, moved)


@SETTINGS
@given(st.data())
def test_mix_endpoints(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    layer_shapes = data.draw(st.lists(shapes, min_size=1, max_size=3))
    g = [data.draw(tensors(s, dtype)) for s in layer_shapes]
    l = [data.draw(tensors(s, dtype)) for s in layer_shapes]
    lam = data.draw(st.floats(0, 1))
    args, moved = _maybe_meta(data.draw, {"g": g, "l": l})
    _outcome(lambda: fedkernels.mix_endpoints(args["g"], args["l"], lam),
             lambda: R.mix_endpoints_reference(g, l, lam), dtype, moved)


@SETTINGS
@given(st.data())
def test_regularizers(data):
    dtype = data.draw(st.sampled_from(DTYPES))
    layer_shapes = data.draw(st.lists(shapes, min_size=0, max_size=3))
    g = [data.draw(tensors(s, dtype)) for s in layer_shapes]
    l = [data.draw(tensors(s, dtype)) for s in layer_shapes]
    a = [data.draw(tensors(s, dtype)) for s in layer_shapes]
    if data.draw(st.booleans()):
        args, moved = _maybe_meta(data.draw, {"g": g, "l": l})
        _outcome(lambda: fedkernels.cosine_orthogonality(args["g"], args["l"]),
                 lambda: R.cosine_orthogonality_reference(g, l), dtype, moved)
    else:
        args, moved = _maybe_meta(data.draw, {"g": g, "a": a})
        _outcome(lambda: fedkernels.proximal_term(args["g"], args["a"], mu=0.5),
                 lambda: R.proximal_term_reference(g, a, mu=0.5), dtype, moved)


@SETTINGS
@given(st.data())
def test_ensemble_pseudo_labels_and_distill_kl(data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    k, n, c = data.draw(st.integers(1, 3)), data.draw(st.integers(0, 4)), data.draw(st.integers(1, 4))
    logits = data.draw(tensors((k, n, c), dtype, poison=False))
    args, moved = _maybe_meta(data.draw, {"logits": logits})
    _outcome(lambda: fedkernels.ensemble_pseudo_labels(args["logits"], weighting="uniform"),
             lambda: R.ensemble_pseudo_labels_reference(logits, weighting="uniform"), dtype, moved)
    student = data.draw(tensors((n, c), dtype, poison=False))
    target = torch.softmax(data.draw(tensors((n, c), dtype, poison=False)), -1)
    args, moved = _maybe_meta(data.draw, {"student": student, "target": target})
    _outcome(lambda: fedkernels.distill_kl(args["student"], args["target"], 2.0, reduction="sum"),
             lambda: R.distill_kl_reference(student, target, 2.0, scale=4.0), dtype, moved)


@SETTINGS
@given(st.data())
def test_distill_kl_across_its_cpu_paths(data):
    # Rows of fewer than 32 classes go a vector's width at a time (lanes, groups padded with
    # zero rows), longer ones by row groups, huge maxima through the full exp: loss and
    # gradient against float64 for any N (groups of 16 rows or not) and C on either side.
    n, c = data.draw(st.integers(1, 70)), data.draw(st.integers(1, 40))
    temperature = data.draw(st.sampled_from([0.5, 1.0, 3.0]))
    g = torch.Generator().manual_seed(data.draw(st.integers(0, 2**31 - 1)))
    s = 4 * torch.randn(n, c, generator=g, dtype=torch.float64)
    y = torch.softmax(2 * torch.randn(n, c, generator=g, dtype=torch.float64), -1)
    y = torch.where(torch.rand(n, c, generator=g, dtype=torch.float64) < 0.2, 0.0, y)
    for i in data.draw(st.lists(st.integers(0, n - 1), max_size=3)):
        s[i, data.draw(st.integers(0, c - 1))] = data.draw(st.sampled_from([1e8, -1e8, -50.0]))
    s, y = s.float(), y.float()
    x = s.clone().requires_grad_(True)
    loss = fedkernels.distill_kl(x, y, temperature, reduction="sum")
    loss.backward()
    xr = s.double().requires_grad_(True)
    log_q = torch.log_softmax(xr / temperature, -1)
    yd = y.double()
    want = (temperature ** 2) * torch.where(yd > 0, yd * (yd.clamp_min(1e-300).log() - log_q), 0.0).sum()
    want.backward()
    torch.testing.assert_close(loss.double(), want.detach(), rtol=3e-5, atol=1e-5)
    torch.testing.assert_close(x.grad.double(), xr.grad, rtol=1e-4, atol=2e-6)


@SETTINGS
@given(st.data())
def test_energy_and_sgld(data):
    dtype = data.draw(st.sampled_from([torch.float32, torch.float64]))
    m, c = data.draw(st.integers(0, 4)), data.draw(st.integers(1, 4))
    logits = data.draw(tensors((m, c), dtype))
    args, moved = _maybe_meta(data.draw, {"logits": logits})
    _outcome(lambda: fedkernels.energy_from_logits(args["logits"]),
             lambda: R.energy_from_logits_reference(logits), dtype, moved)

    shape = data.draw(shapes)
    x, grad, noise = (data.draw(tensors(shape, dtype)) for _ in range(3))
    args, moved = _maybe_meta(data.draw, {"x": x, "grad": grad, "noise": noise})
    _outcome(lambda: fedkernels.sgld_step(args["x"], args["grad"], step_size=0.1, noise_std=0.01,
                                          noise=args["noise"]),
             lambda: R.sgld_step_reference(x, grad, 0.1, 0.01, noise=noise), dtype, moved)

    k = data.draw(st.integers(1, 3))
    xs = data.draw(tensors((m, 3), dtype))
    grads = data.draw(tensors((k, m, 3), dtype))
    energies = data.draw(tensors((k, m), dtype, poison=False))
    log_w = torch.log(torch.rand(k, dtype=torch.float64) + 0.1)
    noise = data.draw(tensors((m, 3), dtype, poison=False))
    args, moved = _maybe_meta(data.draw, {"x": xs, "grads": grads, "energies": energies,
                                          "noise": noise})
    _outcome(lambda: fedkernels.sgld_compose_step(args["x"], args["grads"], args["energies"], log_w,
                                                  step_size=0.1, noise_std=0.01, noise=args["noise"]),
             lambda: R.sgld_compose_step_reference(xs, grads, energies, log_w, 0.1, 0.01,
                                                   noise=noise)[0],
             dtype, moved)


def test_an_unexpected_exception_type_fails_the_property():
    """The property helper itself: a crash of another kind is not an accepted outcome."""
    def crash():
        raise RuntimeError("boom")

    with pytest.raises(RuntimeError):
        _outcome(crash, lambda: torch.zeros(1), torch.float32, False)


def test_a_refusal_of_a_valid_call_fails_the_property():
    """The property helper itself: an op changed to refuse every input does not pass."""
    def refuse():
        raise ValueError("fedkernels.weighted_sum: no")

    with pytest.raises(AssertionError, match="a valid call was refused"):
        _outcome(refuse, lambda: torch.zeros(1), torch.float32, False)
    _outcome(refuse, lambda: torch.zeros(1), torch.float32, False, invalid="cut out of range")
    with pytest.raises(AssertionError, match="returned instead of raising"):
        _outcome(lambda: torch.zeros(1), lambda: torch.zeros(1), torch.float32, True)


@pytest.mark.parametrize("row", [[math.inf], [math.inf, 1.0], [-math.inf], [-math.inf, -math.inf],
                                 [math.nan, math.inf], [-math.inf, math.inf]])
def test_energy_of_infinite_logits_is_minus_their_logsumexp(row):
    """Found by the property above: an infinite max used to give NaN (inf - inf) instead of
    -logsumexp."""
    logits = torch.tensor([row])
    torch.testing.assert_close(fedkernels.energy_from_logits(logits), -torch.logsumexp(logits, -1),
                               equal_nan=True)
