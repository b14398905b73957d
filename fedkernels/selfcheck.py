"""A self-check to run after installing: ``fedkernels check`` or ``fedkernels.check()``.

It reports what was installed and loaded (versions, the CPU kernel build and why it was
chosen, whether the CUDA kernels are built and a GPU is visible), runs every op of the
``fedkernels`` torch library on every available device and floating dtype against the
pure-PyTorch reference (:mod:`fedkernels.ops.reference`) on small random inputs, and measures
a short bandwidth probe: the read bandwidth of one large ``sum`` against ``weighted_sum`` of
K = 10 clients of about 64 MB each read from the same memory.

The ops are listed from the loaded library, so an op without a check here is itself a
failure: a new op cannot ship without one.
"""

from __future__ import annotations

import json
import math
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path
from typing import Any, TextIO

import torch
from torch import Tensor

from .aggregate import aggregate
from .ops import native
from .ops import reference as R

DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)

# Native vs reference differ by rounding only (same accumulate dtype, same client order):
# elementwise outputs by one rounding of the output, reductions by the summation order.
ELEMENTWISE_TOL = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.float16: (2e-3, 2e-3),
    torch.bfloat16: (1.6e-2, 1.6e-2),
}
REDUCTION_TOL = {
    torch.float64: (1e-9, 1e-9),
    torch.float32: (1e-4, 1e-3),
    torch.float16: (2e-3, 2e-2),
    torch.bfloat16: (2e-3, 2e-2),
}
EXACT = (0.0, 0.0)

# the bandwidth probe: K clients of CLIENT_BYTES each, read by both the probe and the op
PROBE_CLIENTS = 10
PROBE_CLIENT_BYTES = 64 * 2**20
PROBE_SECONDS = 5.0


# ---------------------------------------------------------------- comparisons


@dataclass
class Comparison:
    """One output of a native op (``actual``) against its reference (``expected``)."""

    label: str
    actual: Any
    expected: Any
    tol: tuple[float, float]


def _compare(c: Comparison) -> tuple[bool, float, str]:
    """(passed, max abs error, why it failed)."""
    a, e = c.actual, c.expected
    if isinstance(e, (list, tuple)):
        if not isinstance(a, (list, tuple)) or len(a) != len(e):
            return False, math.inf, f"{c.label}: expected {len(e)} tensors, got {_describe(a)}"
        worst = 0.0
        for i, (x, y) in enumerate(zip(a, e)):
            ok, err, why = _compare(Comparison(f"{c.label}[{i}]", x, y, c.tol))
            if not ok:
                return False, err, why
            worst = max(worst, err)
        return True, worst, ""
    if not isinstance(a, Tensor):
        return False, math.inf, f"{c.label}: expected a tensor, got {_describe(a)}"
    if a.dtype != e.dtype or a.shape != e.shape:
        return False, math.inf, (f"{c.label}: got {a.dtype} {tuple(a.shape)}, "
                                 f"expected {e.dtype} {tuple(e.shape)}")
    if a.numel() == 0:
        return True, 0.0, ""
    x, y = a.detach().cpu().double(), e.detach().cpu().double()
    if not e.is_floating_point():
        ok = torch.equal(x, y)
        return ok, 0.0 if ok else math.inf, "" if ok else f"{c.label}: integer values differ"
    nan_x, nan_y = torch.isnan(x), torch.isnan(y)
    if not torch.equal(nan_x, nan_y):
        # said as such: the NaNs leave the difference of the other values, often 0 (an out=
        # that was never written keeps its NaN fill), and "max abs error 0" would not say it
        extra, missing = int((nan_x & ~nan_y).sum()), int((nan_y & ~nan_x).sum())
        parts = ([f"{extra} NaN where the reference has a number"] if extra else []) + \
            ([f"a number where the reference has {missing} NaN"] if missing else [])
        return False, math.inf, f"{c.label}: {' and '.join(parts)} (of {x.numel()} values)"
    diff = (x - y).abs().nan_to_num(0.0)
    err = float(diff.max())
    rtol, atol = c.tol
    bad = diff > atol + rtol * y.abs().nan_to_num(0.0)
    if bool(bad.any()):
        return False, err, f"{c.label}: max abs error {err:.3g} (rtol {rtol:g}, atol {atol:g})"
    return True, err, ""


def _describe(x: Any) -> str:
    if isinstance(x, Tensor):
        return f"a {x.dtype} tensor {tuple(x.shape)}"
    if isinstance(x, (list, tuple)):
        return f"a {type(x).__name__} of {len(x)}"
    return type(x).__name__


def _bitwise_equal(a: Any, b: Any) -> bool:
    if isinstance(a, (list, tuple)):
        return isinstance(b, (list, tuple)) and len(a) == len(b) and all(
            _bitwise_equal(x, y) for x, y in zip(a, b))
    if not isinstance(a, Tensor) or not isinstance(b, Tensor):
        return a is b or a == b
    if a.dtype != b.dtype or a.shape != b.shape:
        return False

    def as_bytes(t: Tensor) -> Tensor:
        return t.detach().cpu().contiguous().reshape(-1).view(torch.uint8)

    return torch.equal(as_bytes(a), as_bytes(b))


# ---------------------------------------------------------------- inputs

# odd on purpose: 2-D, longer than a vector, 0-d, empty, 3-D
SHAPES = [(5, 7), (129,), (), (0,), (2, 3, 4)]
NUM_CLIENTS = 3


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _randn(shape, dtype, device, gen, scale: float = 1.0) -> Tensor:
    return (scale * torch.randn(shape, generator=gen, dtype=torch.float64)).to(dtype).to(device)


def _tensors(dtype, device, seed, shapes=SHAPES) -> list[Tensor]:
    g = _gen(seed)
    return [_randn(s, dtype, device, g) for s in shapes]


def _flat(clients: list[list[Tensor]]) -> list[Tensor]:
    return [t for client in clients for t in client]


def _weights() -> Tensor:
    return torch.tensor([0.5, -0.25, 1.5], dtype=torch.float64)


def _lams(num_tensors: int) -> dict[str, Tensor]:
    """Model mixing (one lam) and layer mixing (one per tensor)."""
    return {"mm": torch.tensor(0.3, dtype=torch.float64),
            "lm": torch.linspace(0.1, 0.9, num_tensors, dtype=torch.float64)}


def _tol(dtype, table=None) -> tuple[float, float]:
    return (table or ELEMENTWISE_TOL)[dtype]


def _ws_tol(dtype) -> tuple[float, float]:
    rtol, atol = ELEMENTWISE_TOL[dtype]
    return rtol, atol * math.sqrt(NUM_CLIENTS)


def _grads_of(outputs: list[Tensor], inputs: list[Tensor], grad_outputs: list[Tensor]):
    pairs = [(o, g) for o, g in zip(outputs, grad_outputs) if o.requires_grad]
    grads = torch.autograd.grad([o for o, _ in pairs], inputs, [g for _, g in pairs],
                                allow_unused=True)
    return [torch.zeros_like(x) if g is None else g for x, g in zip(inputs, grads)]


def _leaves(tensors: Iterable[Tensor]) -> list[Tensor]:
    return [t.detach().clone().requires_grad_(True) for t in tensors]


# ---------------------------------------------------------------- one check per op
# Each takes the op under test (the native overload, or a replacement), a device and a dtype,
# and returns its outputs next to the reference's.

OpCheck = Callable[[Callable, torch.device, torch.dtype], list[Comparison]]


def _weighted_sum_cases(dtype, device):
    clients = [_tensors(dtype, device, seed) for seed in range(NUM_CLIENTS)]
    base = _tensors(dtype, device, 10)
    return clients, base, _weights()


def check_weighted_sum(op, device, dtype):
    clients, base, w = _weighted_sum_cases(dtype, device)
    out = []
    for label, b, scale, delta in [("plain", [], 1.0, False), ("delta", base, 0.7, True),
                                   ("accumulate", base, 2.0, False)]:
        got = op(_flat(clients), w, b, scale, delta)
        want = R.weighted_sum_reference(clients, w, b or None, scale, delta)
        out.append(Comparison(label, got, want, _ws_tol(dtype)))
    return out


def check_weighted_sum_out(op, device, dtype):
    clients, base, w = _weighted_sum_cases(dtype, device)
    result = [torch.full_like(t, float("nan")) for t in base]
    op(_flat(clients), w, base, 0.7, True, out=result)
    want = R.weighted_sum_reference(clients, w, base, 0.7, True)
    return [Comparison("delta, out=", result, want, _ws_tol(dtype))]


def check_weighted_sum_inplace(op, device, dtype):
    clients, base, w = _weighted_sum_cases(dtype, device)
    out = []
    for label, delta in [("delta", True), ("accumulate", False)]:
        b = [t.clone() for t in base]
        op(b, _flat(clients), w, 0.7, delta)
        want = R.weighted_sum_reference(clients, w, base, 0.7, delta)
        out.append(Comparison(label, b, want, _ws_tol(dtype)))
    return out


def check_mix_endpoints(op, device, dtype):
    g, l = _tensors(dtype, device, 0), _tensors(dtype, device, 1)
    return [Comparison(kind, op(g, l, lam), R.mix_endpoints_reference(g, l, lam), _tol(dtype))
            for kind, lam in _lams(len(g)).items()]


def check_mix_endpoints_backward(op, device, dtype):
    g, l, up = (_tensors(dtype, device, s) for s in (0, 1, 2))
    out = []
    for kind, lam in _lams(len(g)).items():
        got_g, got_l, got_lam = op(up, g, l, lam, [True, True, True])
        gg, ll, lm = _leaves(g), _leaves(l), lam.clone().requires_grad_(True)
        want = _grads_of(R.mix_endpoints_reference(gg, ll, lm), [*gg, *ll, lm], up)
        n = len(g)
        out += [Comparison(f"{kind} grad global", got_g, want[:n], _tol(dtype)),
                Comparison(f"{kind} grad local", got_l, want[n:2 * n], _tol(dtype)),
                Comparison(f"{kind} grad lam", got_lam, want[2 * n].to(got_lam.dtype)
                           if isinstance(got_lam, Tensor) else want[2 * n],
                           _tol(dtype, REDUCTION_TOL))]
    return out


def check_superfed_stats(op, device, dtype):
    g, l, a = (_tensors(dtype, device, s) for s in (0, 1, 2))
    tol = _tol(dtype, REDUCTION_TOL)
    return [Comparison("g, l, anchor", op(g, l, a), R.superfed_stats_reference(g, l, a), tol),
            Comparison("g only", op(g, [], []), R.superfed_stats_reference(g), tol)]


def _stats_upstream(num_tensors: int, device) -> Tensor:
    return _randn((num_tensors, 4), torch.float64, device, _gen(3))


def check_superfed_stats_backward(op, device, dtype):
    g, l, a = (_tensors(dtype, device, s) for s in (0, 1, 2))
    h = _stats_upstream(len(g), device)
    got = op(h, g, l, a, [True, True, True])
    gg, ll, aa = _leaves(g), _leaves(l), _leaves(a)
    want = _grads_of([R.superfed_stats_reference(gg, ll, aa)], [*gg, *ll, *aa], [h])
    n = len(g)
    return [Comparison(name, got[i], want[i * n:(i + 1) * n], _tol(dtype))
            for i, name in enumerate(["grad global", "grad local", "grad anchor"])]


def check_mix_endpoints_with_stats(op, device, dtype):
    g, l, a = (_tensors(dtype, device, s) for s in (0, 1, 2))
    out = []
    for kind, lam in _lams(len(g)).items():
        theta, stats = op(g, l, lam, a)
        out += [Comparison(f"{kind} theta", theta, R.mix_endpoints_reference(g, l, lam),
                           _tol(dtype)),
                Comparison(f"{kind} stats", stats, R.superfed_stats_reference(g, l, a),
                           _tol(dtype, REDUCTION_TOL))]
    return out


def check_mix_endpoints_with_stats_backward(op, device, dtype):
    g, l, a, up = (_tensors(dtype, device, s) for s in (0, 1, 2, 4))
    h = _stats_upstream(len(g), device)
    n = len(g)
    out = []
    for kind, lam in _lams(n).items():
        got_g, got_l, got_lam, got_a = op(up, h, g, l, lam, a, [True, True, True, True])
        gg, ll, aa, lm = _leaves(g), _leaves(l), _leaves(a), lam.clone().requires_grad_(True)
        outputs = [*R.mix_endpoints_reference(gg, ll, lm), R.superfed_stats_reference(gg, ll, aa)]
        want = _grads_of(outputs, [*gg, *ll, lm, *aa], [*up, h])
        want_lam = want[2 * n]
        out += [Comparison(f"{kind} grad global", got_g, want[:n], _tol(dtype)),
                Comparison(f"{kind} grad local", got_l, want[n:2 * n], _tol(dtype)),
                Comparison(f"{kind} grad lam", got_lam, want_lam.to(got_lam.dtype)
                           if isinstance(got_lam, Tensor) else want_lam,
                           _tol(dtype, REDUCTION_TOL)),
                Comparison(f"{kind} grad anchor", got_a, want[2 * n + 1:], _tol(dtype))]
    return out


def check_superfed_sgd_step(op, device, dtype):
    g, l, a, up, bg, bl = (_tensors(dtype, device, s) for s in (0, 1, 2, 4, 5, 6))
    h = _stats_upstream(len(g), device)
    out = []
    settings = (((False, False), False, 0.1), ((True, False), False, 0.1),
                ((False, True), True, 0.0))
    for kind, lam in _lams(len(g)).items():
        for first, nesterov, dampening in settings:
            sgd = dict(lr=0.1, momentum=0.9, dampening=dampening, weight_decay=0.01,
                       nesterov=nesterov)
            got = [[x.clone() for x in xs] for xs in (g, l, bg, bl)]
            op(*got, up, h, lam, a, *sgd.values(), list(first))
            want = R.superfed_sgd_step_reference(g, l, bg, bl, up, h, lam, a, **sgd,
                                                 first_step=first)
            name = f"{kind} first={first}{' nesterov' if nesterov else ''}"
            out += [Comparison(f"{name} {part}", x, y, _tol(dtype))
                    for part, x, y in zip(("global", "local", "global buffer", "local buffer"),
                                          got, want)]
    return out


def check_ensemble_pseudo_labels(op, device, dtype):
    K, N, C = 4, 9, 11
    g = _gen(0)
    logits = _randn((K, N, C), dtype, device, g, scale=3.0)
    scores = _randn((K, N), torch.float64, device, g, scale=2.0)
    sizes = torch.arange(1, K + 1, dtype=torch.float64) * 10
    out = []
    cases = [("uniform", "logits", False), ("entropy", "probs", False), ("fedgo", "logits", True),
             ("variance", "probs", True), ("domain", "logits", False)]
    for weighting, combine, with_sizes in cases:
        s = scores if weighting in ("fedgo", "domain") else None
        prior = sizes.log() if with_sizes else None
        y, w = op(logits, s, prior, weighting, combine, 2.0, 0.5, True)
        y_ref, w_ref = R.ensemble_pseudo_labels_reference(
            logits, s, weighting=weighting, combine=combine, temperature=2.0, tau=0.5,
            sample_sizes=sizes if with_sizes else None, return_weights=True)
        out += [Comparison(f"{weighting}/{combine} labels", y, y_ref, _tol(dtype)),
                Comparison(f"{weighting}/{combine} weights", w, w_ref, _tol(dtype))]
    return out


def check_distill_kl(op, device, dtype):
    g = _gen(0)
    n, c, temperature, scale = 13, 10, 2.0, 0.25
    s = _randn((n, c), dtype, device, g, scale=3.0)
    y = torch.softmax(_randn((n, c), torch.float64, "cpu", g, scale=2.0), -1).to(dtype).to(device)
    loss, grad = op(s, y, temperature, scale, True)
    s64 = s.double().requires_grad_(True)
    ref = R.distill_kl_reference(s64, y.double(), temperature, scale)
    (ref_grad,) = torch.autograd.grad(ref, s64)
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    loss_only, no_grad = op(s, y, temperature, scale, False)
    return [
        Comparison("loss", loss, R.distill_kl_reference(s, y, temperature, scale).to(acc),
                   _tol(dtype, REDUCTION_TOL)),
        Comparison("grad", grad, ref_grad.to(dtype), _tol(dtype)),
        Comparison("loss without grad", loss_only, loss, EXACT),
        Comparison("no grad asked", no_grad, s.new_empty((0,)), EXACT),
    ]


def check_energy_from_logits(op, device, dtype):
    g = _gen(0)
    logits = _randn((17, 11), dtype, device, g, scale=4.0)
    labels = torch.randint(0, 11, (17,), generator=g).to(device)
    return [Comparison("conditional", op(logits, labels),
                       R.energy_from_logits_reference(logits, labels), _tol(dtype)),
            Comparison("marginal", op(logits, None),
                       R.energy_from_logits_reference(logits, None), _tol(dtype))]


def _step_inputs(dtype, device):
    g = _gen(0)
    shape = (3, 5, 7)
    x = torch.rand(shape, generator=g, dtype=torch.float64).to(dtype).to(device)
    return x, _randn(shape, dtype, device, g, 3.0), _randn(shape, dtype, device, g)


def _drawn_noise_is_reproducible(draw: Callable[[torch.Generator], Tensor], x: Tensor):
    """Drawn noise: the same seed gives bitwise the same step."""
    first = draw(torch.Generator(device=x.device).manual_seed(7))
    again = draw(torch.Generator(device=x.device).manual_seed(7))
    return Comparison("drawn noise, same seed twice", again, first, EXACT)


def check_sgld_step(op, device, dtype):
    x, grad, noise = _step_inputs(dtype, device)
    out = []
    for label, clip, lo, hi in [("plain", None, None, None), ("clip, clamp", 3.0, 0.0, 1.0)]:
        got = op(x, grad, 0.7, 0.05, clip, lo, hi, noise, None)
        want = R.sgld_step_reference(x, grad, 0.7, 0.05, noise=noise, grad_clip=clip,
                                     clamp=None if lo is None else (lo, hi))
        out.append(Comparison(label, got, want, _tol(dtype)))
    out.append(_drawn_noise_is_reproducible(
        lambda gen: op(x, grad, 0.7, 0.05, None, None, None, None, gen), x))
    return out


def check_sgld_step_inplace(op, device, dtype):
    x, grad, noise = _step_inputs(dtype, device)
    y = x.clone()
    op(y, grad, 0.7, 0.05, 3.0, 0.0, 1.0, noise, None)
    want = R.sgld_step_reference(x, grad, 0.7, 0.05, noise=noise, grad_clip=3.0, clamp=(0.0, 1.0))
    return [Comparison("clip, clamp, in place", y, want, _tol(dtype))]


def _compose_inputs(dtype, device):
    g = _gen(0)
    K, M, feat = 4, 6, (2, 5)
    x = torch.rand((M, *feat), generator=g, dtype=torch.float64).to(dtype).to(device)
    grads = _randn((K, M, *feat), dtype, device, g, 4.0)
    energies = _randn((K, M), torch.float32, device, g, 3.0)
    log_w = torch.log(torch.rand(K, generator=g) + 0.1).to(device)
    return x, grads, energies, log_w, _randn((M, *feat), dtype, device, g)


def _compose_tol(dtype):
    rtol, atol = ELEMENTWISE_TOL[dtype]
    return rtol, 2 * atol  # K = 4 clients summed


def check_sgld_compose_step(op, device, dtype):
    x, grads, energies, log_w, noise = _compose_inputs(dtype, device)
    out = []
    for mode in ("exact", "signed"):
        got, pi = op(x, grads, energies, log_w, mode, 0.3, 0.1, 3.0, None, None, noise, None)
        want, want_pi = R.sgld_compose_step_reference(
            x, grads, energies, log_w, 0.3, 0.1, noise=noise, mode=mode, grad_clip=3.0)
        out += [Comparison(f"{mode} step", got, want, _compose_tol(dtype)),
                Comparison(f"{mode} weights", pi, want_pi, _tol(torch.float64 if dtype ==
                                                                 torch.float64 else torch.float32))]
    out.append(_drawn_noise_is_reproducible(
        lambda gen: op(x, grads, energies, log_w, "signed", 0.3, 0.1, None, None, None, None,
                       gen)[0], x))
    return out


def check_sgld_compose_step_inplace(op, device, dtype):
    x, grads, energies, log_w, noise = _compose_inputs(dtype, device)
    y = x.clone()
    pi = op(y, grads, energies, log_w, "signed", 10.0, 0.01, 3.0, 0.0, 1.0, noise, None)
    want, want_pi = R.sgld_compose_step_reference(
        x, grads, energies, log_w, 10.0, 0.01, noise=noise, mode="signed", grad_clip=3.0,
        clamp=(0.0, 1.0))
    pi_tol = _tol(torch.float64 if dtype == torch.float64 else torch.float32)
    return [Comparison("signed, clamp, in place", y, want, _compose_tol(dtype)),
            Comparison("weights", pi, want_pi, pi_tol)]


# Robust rules and DP: the order statistics sum the same sorted values in the same order as
# the reference (bitwise equal); distances and norms are float64 sums in another order.
ROBUST_CLIENTS = 6
F64_SUM_TOL = (1e-12, 1e-12)


def _robust_clients(dtype, device):
    return [_tensors(dtype, device, seed) for seed in range(ROBUST_CLIENTS)]


def _order_stat_check(name, param):
    reference = {"coordinate_median": R.coordinate_median_reference,
                 "trimmed_mean": R.trimmed_mean_reference,
                 "median_window_mean": R.median_window_mean_reference}[name]
    extra = () if param is None else (param,)

    def check(op, device, dtype):
        clients = _flat(_robust_clients(dtype, device))
        want = reference(clients, ROBUST_CLIENTS, *extra)
        got = op(clients, ROBUST_CLIENTS, *extra)
        return [Comparison(name, got, want, EXACT)]

    def check_out(op, device, dtype):
        clients = _flat(_robust_clients(dtype, device))
        want = reference(clients, ROBUST_CLIENTS, *extra)
        result = [torch.full_like(t, float("nan")) for t in want]
        op(clients, ROBUST_CLIENTS, *extra, out=result)
        return [Comparison(f"{name}, out=", result, want, EXACT)]

    return check, check_out


def check_pairwise_sq_distances(op, device, dtype):
    clients = _flat(_robust_clients(dtype, device))
    return [Comparison("distances", op(clients, ROBUST_CLIENTS),
                       R.pairwise_sq_distances_reference(clients, ROBUST_CLIENTS), F64_SUM_TOL)]


def check_update_norms(op, device, dtype):
    clients = _flat(_robust_clients(dtype, device))
    base = _tensors(dtype, device, 10)
    return [Comparison("norms", op(clients, ROBUST_CLIENTS, base),
                       R.update_norms_reference(clients, ROBUST_CLIENTS, base), F64_SUM_TOL)]


def _private_inputs(dtype, device):
    clients = _flat(_robust_clients(dtype, device))
    coef = torch.linspace(0.05, 0.3, ROBUST_CLIENTS, dtype=torch.float64)
    return clients, coef, _tensors(dtype, device, 10)


def _private_tol(dtype):
    rtol, atol = ELEMENTWISE_TOL[dtype]
    return rtol, atol * math.sqrt(ROBUST_CLIENTS)


def check_private_sum(op, device, dtype):
    clients, coef, base = _private_inputs(dtype, device)
    want = R.private_sum_reference(clients, coef, base, 0.0)
    out = [Comparison("no noise", op(clients, coef, base, 0.0, None), want, _private_tol(dtype))]
    out.append(_drawn_noise_is_reproducible(
        lambda gen: op(clients, coef, base, 0.1, gen), base[0]))
    return out


def check_private_sum_out(op, device, dtype):
    clients, coef, base = _private_inputs(dtype, device)
    result = [torch.full_like(t, float("nan")) for t in base]
    op(clients, coef, base, 0.0, None, out=result)
    want = R.private_sum_reference(clients, coef, base, 0.0)
    return [Comparison("no noise, out=", result, want, _private_tol(dtype))]


def check_private_sum_inplace(op, device, dtype):
    clients, coef, base = _private_inputs(dtype, device)
    b = [t.clone() for t in base]
    op(b, clients, coef, 0.0, None)
    want = R.private_sum_reference(clients, coef, base, 0.0)
    return [Comparison("no noise, in place", b, want, _private_tol(dtype))]


def check_quantize_int8(op, device, dtype):
    x = _tensors(dtype, device, 20)
    res = _tensors(dtype, device, 21)
    out = []
    for stochastic in (False, True):
        got = op(x, res, 8, stochastic, 12345, 1)
        want = R.quantize_int8_reference(x, 8, stochastic, 12345, 1, res)
        label = "stochastic" if stochastic else "nearest"
        # the same arithmetic on both sides: int8 values and scales bit for bit
        out += [Comparison(f"{label} values", got[0], want[0], EXACT),
                Comparison(f"{label} scales", got[1], want[1], EXACT),
                Comparison(f"{label} residual", got[2], want[2], _tol(dtype))]
    return out


def _quantized_clients(device):
    """NUM_CLIENTS clients quantized by the reference (block 8): their values and scales, and
    client 0's values (the results' shapes)."""
    clients = [R.quantize_int8_reference(_tensors(torch.float32, device, 30 + k), 8)
               for k in range(NUM_CLIENTS)]
    return ([v for c in clients for v in c[0]], [s for c in clients for s in c[1]],
            clients[0][0])


def check_dequantize_weighted_sum(op, device, dtype):
    values, scales, _ = _quantized_clients(device)
    w = _weights()
    want = R.dequantize_weighted_sum_reference(values, scales, w, 8, dtype)
    return [Comparison("weighted sum", op(values, scales, w, 8, dtype), want,
                       _tol(dtype, REDUCTION_TOL))]


def check_dequantize_weighted_sum_out(op, device, dtype):
    values, scales, first = _quantized_clients(device)
    w = _weights()
    result = [torch.full(v.shape, float("nan"), dtype=dtype, device=device) for v in first]
    op(values, scales, w, 8, dtype, out=result)
    want = R.dequantize_weighted_sum_reference(values, scales, w, 8, dtype)
    return [Comparison("weighted sum, out=", result, want, _tol(dtype, REDUCTION_TOL))]


def check_quantize_int4(op, device, dtype):
    x = _tensors(dtype, device, 22)
    res = _tensors(dtype, device, 23)
    out = []
    for stochastic in (False, True):
        got = op(x, res, 8, stochastic, 12345, 1)
        want = R.quantize_int4_reference(x, 8, stochastic, 12345, 1, res)
        label = "stochastic" if stochastic else "nearest"
        out += [Comparison(f"{label} packed values", got[0], want[0], EXACT),
                Comparison(f"{label} scales", got[1], want[1], EXACT),
                Comparison(f"{label} residual", got[2], want[2], _tol(dtype))]
    return out


def check_quantize_fp8(op, device, dtype):
    x = _tensors(dtype, device, 24)
    res = _tensors(dtype, device, 25)
    out = []
    for stochastic in (False, True):
        got = op(x, res, stochastic, 12345, 1)
        want = R.quantize_fp8_reference(x, stochastic, 12345, 1, res)
        label = "stochastic" if stochastic else "nearest"
        # e4m3fn compared through its bytes: exact, -0 and all
        out += [Comparison(f"{label} values", [v.view(torch.uint8) for v in got[0]],
                           [v.view(torch.uint8) for v in want[0]], EXACT),
                Comparison(f"{label} scales", got[1], want[1], EXACT),
                Comparison(f"{label} residual", got[2], want[2], _tol(dtype))]
    return out


def _quantized_clients_as(fmt, device):
    """NUM_CLIENTS clients quantized by the reference in 4-bit (block 8) or fp8: values,
    scales, and the tensors' element counts."""
    xs = [_tensors(torch.float32, device, 40 + k) for k in range(NUM_CLIENTS)]
    clients = [R.quantize_int4_reference(x, 8) if fmt == "int4" else R.quantize_fp8_reference(x)
               for x in xs]
    return ([v for c in clients for v in c[0]], [s for c in clients for s in c[1]],
            [t.numel() for t in xs[0]])


def check_dequantize_int4_weighted_sum(op, device, dtype):
    values, scales, numels = _quantized_clients_as("int4", device)
    w = _weights()
    want = R.dequantize_weighted_sum_reference(values, scales, w, 8, dtype, numels)
    return [Comparison("weighted sum", op(values, scales, w, 8, numels, dtype), want,
                       _tol(dtype, REDUCTION_TOL))]


def check_dequantize_int4_weighted_sum_out(op, device, dtype):
    values, scales, numels = _quantized_clients_as("int4", device)
    w = _weights()
    result = [torch.full((n,), float("nan"), dtype=dtype, device=device) for n in numels]
    op(values, scales, w, 8, numels, dtype, out=result)
    want = R.dequantize_weighted_sum_reference(values, scales, w, 8, dtype, numels)
    return [Comparison("weighted sum, out=", result, want, _tol(dtype, REDUCTION_TOL))]


def check_dequantize_fp8_weighted_sum(op, device, dtype):
    values, scales, _ = _quantized_clients_as("fp8", device)
    w = _weights()
    want = R.dequantize_weighted_sum_reference(values, scales, w, 0, dtype)
    return [Comparison("weighted sum", op(values, scales, w, dtype), want,
                       _tol(dtype, REDUCTION_TOL))]


def check_dequantize_fp8_weighted_sum_out(op, device, dtype):
    values, scales, _ = _quantized_clients_as("fp8", device)
    w = _weights()
    T = len(values) // NUM_CLIENTS
    result = [torch.full(v.shape, float("nan"), dtype=dtype, device=device) for v in values[:T]]
    op(values, scales, w, dtype, out=result)
    want = R.dequantize_weighted_sum_reference(values, scales, w, 0, dtype)
    return [Comparison("weighted sum, out=", result, want, _tol(dtype, REDUCTION_TOL))]


def _secagg_seeds():
    return torch.tensor([[11, -5], [2**62 + 3, 7], [-9, 2**40]], dtype=torch.int64), [1, -1, 1]


def check_secagg_mask(op, device, dtype):
    x = _tensors(dtype, device, 40)
    x[0][0, 0] = 9.0  # beyond the clip
    seeds, signs = _secagg_seeds()
    out = []
    for stochastic in (False, True):
        got = op(x, 4.0, 2.0**16, stochastic, 77, 5, seeds, signs)
        want = R.secagg_mask_reference(x, 4.0, 2.0**16, stochastic, 77, 5, seeds, signs)
        label = "stochastic" if stochastic else "nearest"
        out.append(Comparison(f"{label} masked codes", got, want, EXACT))
    return out


def check_secagg_unmask_sum(op, device, dtype):
    g = _gen(41)
    masked = [torch.randint(-2**31, 2**31 - 1, s, generator=g, dtype=torch.int32).to(device)
              for _ in range(NUM_CLIENTS) for s in SHAPES]
    seeds, signs = _secagg_seeds()
    got = op(masked, NUM_CLIENTS, seeds, signs)
    T = len(SHAPES)
    want = R.secagg_unmask_sum_reference(
        [masked[k * T:(k + 1) * T] for k in range(NUM_CLIENTS)], seeds, signs)
    return [Comparison("ring sum minus masks", got, want, EXACT)]


def _sparse_clients(dtype, device):
    """NUM_CLIENTS clients' top-8 lists per tensor, chosen by the reference (int32 indices),
    client-major, and a base."""
    idx, vals = [], []
    for k in range(NUM_CLIENTS):
        x = _tensors(dtype, device, 40 + k)
        i, v, _ = R.sparsify_topk_reference(x, [min(8, t.numel()) for t in x])
        idx += [t.to(torch.int32) for t in i]
        vals += v
    return idx, vals, _tensors(dtype, device, 39)


def check_sparse_weighted_sum(op, device, dtype):
    idx, vals, base = _sparse_clients(dtype, device)
    want = R.sparse_weighted_sum_reference(base, idx, vals, _weights())
    return [Comparison("scatter-add", op(base, idx, vals, _weights()), want, EXACT)]


def check_sparse_weighted_sum_out(op, device, dtype):
    idx, vals, base = _sparse_clients(dtype, device)
    result = [torch.full_like(t, float("nan")) for t in base]
    op(base, idx, vals, _weights(), out=result)
    want = R.sparse_weighted_sum_reference(base, idx, vals, _weights())
    return [Comparison("scatter-add, out=", result, want, EXACT)]


def check_sparse_weighted_sum_inplace(op, device, dtype):
    idx, vals, base = _sparse_clients(dtype, device)
    b = [t.clone() for t in base]
    op(b, idx, vals, _weights())
    want = R.sparse_weighted_sum_reference(base, idx, vals, _weights())
    return [Comparison("scatter-add, in place", b, want, EXACT)]


_median = _order_stat_check("coordinate_median", None)
_trimmed = _order_stat_check("trimmed_mean", 1)
_window = _order_stat_check("median_window_mean", 3)


CHECKS: dict[str, OpCheck] = {
    "weighted_sum": check_weighted_sum,
    "weighted_sum.out": check_weighted_sum_out,
    "weighted_sum_": check_weighted_sum_inplace,
    "mix_endpoints": check_mix_endpoints,
    "mix_endpoints_backward": check_mix_endpoints_backward,
    "superfed_stats": check_superfed_stats,
    "superfed_stats_backward": check_superfed_stats_backward,
    "mix_endpoints_with_stats": check_mix_endpoints_with_stats,
    "mix_endpoints_with_stats_backward": check_mix_endpoints_with_stats_backward,
    "superfed_sgd_step_": check_superfed_sgd_step,
    "ensemble_pseudo_labels": check_ensemble_pseudo_labels,
    "distill_kl": check_distill_kl,
    "energy_from_logits": check_energy_from_logits,
    "sgld_step": check_sgld_step,
    "sgld_step_": check_sgld_step_inplace,
    "sgld_compose_step": check_sgld_compose_step,
    "sgld_compose_step_": check_sgld_compose_step_inplace,
    "coordinate_median": _median[0],
    "coordinate_median.out": _median[1],
    "trimmed_mean": _trimmed[0],
    "trimmed_mean.out": _trimmed[1],
    "median_window_mean": _window[0],
    "median_window_mean.out": _window[1],
    "pairwise_sq_distances": check_pairwise_sq_distances,
    "update_norms": check_update_norms,
    "private_sum": check_private_sum,
    "private_sum.out": check_private_sum_out,
    "private_sum_": check_private_sum_inplace,
    "quantize_int8": check_quantize_int8,
    "dequantize_weighted_sum": check_dequantize_weighted_sum,
    "dequantize_weighted_sum.out": check_dequantize_weighted_sum_out,
    "quantize_int4": check_quantize_int4,
    "quantize_fp8": check_quantize_fp8,
    "dequantize_int4_weighted_sum": check_dequantize_int4_weighted_sum,
    "dequantize_int4_weighted_sum.out": check_dequantize_int4_weighted_sum_out,
    "dequantize_fp8_weighted_sum": check_dequantize_fp8_weighted_sum,
    "dequantize_fp8_weighted_sum.out": check_dequantize_fp8_weighted_sum_out,
    # Secure aggregation
    "secagg_mask": check_secagg_mask,
    "secagg_unmask_sum": check_secagg_unmask_sum,
    # sparse updates: the same arithmetic in the same order, bit for bit
    "sparse_weighted_sum": check_sparse_weighted_sum,
    "sparse_weighted_sum.out": check_sparse_weighted_sum_out,
    "sparse_weighted_sum_": check_sparse_weighted_sum_inplace,
}

# The public API on top of the ops, checked the same way (a state_dict with an integer buffer).
API_NAME = "aggregate (API)"


def check_aggregate_api(device, dtype):
    g = _gen(0)
    sds = [{"w": _randn((6, 5), dtype, device, g), "b": _randn((5,), dtype, device, g),
            "count": torch.tensor(k + 1, device=device)} for k in range(NUM_CLIENTS)]
    sizes = [10.0, 30.0, 60.0]
    got = aggregate(sds, sizes, normalize=True)
    want = R.aggregate_reference(sds, sizes, normalize=True)
    return [Comparison(key, got[key], want[key], _ws_tol(dtype)) for key in want]


# ---------------------------------------------------------------- the ops of the library


# The output pool's controls compute nothing to check (python_tests/test_output_pool.py).
_NOT_ARITHMETIC = ("output_pool_set_limit", "output_pool_release", "output_pool_stats")


def library_ops() -> list[str]:
    """Every arithmetic overload of the ``fedkernels`` torch library, as ``name`` or
    ``name.overload``."""
    names = set()
    for schema in torch._C._jit_get_all_schemas():
        if schema.name.startswith("fedkernels::"):
            name = schema.name.split("::", 1)[1]
            if name in _NOT_ARITHMETIC:
                continue
            names.add(f"{name}.{schema.overload_name}" if schema.overload_name else name)
    return sorted(names)


def native_op(name: str) -> Callable:
    """The op overload ``torch.ops.fedkernels.<name>`` (``name`` may carry ``.overload``)."""
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.fedkernels, base), overload or "default")


def _has_kernel(name: str, device_type: str) -> bool:
    key = "CUDA" if device_type == "cuda" else "CPU"
    return torch._C._dispatch_has_kernel_for_dispatch_key(f"fedkernels::{name}", key)


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _run_check(run: Callable[[], list[Comparison]]) -> dict[str, Any]:
    """Runs one op check twice: outputs against the reference, then bitwise determinism."""
    try:
        first = run()
        worst = 0.0
        for c in first:
            ok, err, why = _compare(c)
            if not ok:
                return {"status": "fail", "max_abs_error": err, "detail": why}
            worst = max(worst, err)
        second = run()
        for a, b in zip(first, second):
            if not _bitwise_equal(a.actual, b.actual):
                return {"status": "fail", "max_abs_error": worst,
                        "detail": f"{a.label}: not bitwise the same on a second run"}
        return {"status": "pass", "max_abs_error": worst, "detail": ""}
    except Exception as err:  # a crash of the op is a failed check, reported by name
        message = str(err).split("\nException raised from")[0].strip().splitlines()
        return {"status": "fail", "max_abs_error": None,
                "detail": f"{type(err).__name__}: {message[0] if message else ''}"}


def run_op_checks(
    devices: list[str],
    dtypes: Iterable[torch.dtype] = DTYPES,
    ops: Mapping[str, Callable] | None = None,
    library: list[str] | None = None,
) -> list[dict[str, Any]]:
    """One record per (op, device, dtype): status pass/fail, the largest error, why it failed."""
    ops = dict(ops or {})
    library = library_ops() if library is None else library
    names = sorted(set(library) | set(CHECKS))
    records = []
    for name in names:
        for device in devices:
            for dtype in dtypes:
                record = {"op": name, "device": device, "dtype": _dtype_name(dtype)}
                if name not in CHECKS:
                    record.update(status="fail", max_abs_error=None,
                                  detail="no self-check exists for this op")
                elif name not in library:
                    record.update(status="fail", max_abs_error=None,
                                  detail="op is not in the loaded fedkernels library")
                elif name not in ops and not _has_kernel(name, device):
                    record.update(status="fail", max_abs_error=None,
                                  detail=f"no {device} kernel registered")
                else:
                    op = ops.get(name) or native_op(name)
                    check = CHECKS[name]
                    dev = torch.device(device)
                    record.update(_run_check(lambda: check(op, dev, dtype)))  # noqa: B023
                records.append(record)
    for device in devices:
        for dtype in dtypes:
            record = {"op": API_NAME, "device": device, "dtype": _dtype_name(dtype)}
            dev = torch.device(device)
            record.update(_run_check(lambda: check_aggregate_api(dev, dtype)))  # noqa: B023
            records.append(record)
    return records


# ---------------------------------------------------------------- environment


def _fedkernels_version() -> str:
    try:
        return metadata.version("fedkernels")
    except metadata.PackageNotFoundError:  # built in place, not installed
        root = sys.modules.get(__package__ or "fedkernels")
        return getattr(root, "__version__", "unknown")


def _torch_compiler() -> str:
    """The C++ compiler torch was built with, from ``torch.__config__.show()``."""
    try:
        lines = torch.__config__.show().splitlines()
    except Exception:
        return "unknown"
    for line in lines:
        text = line.strip().lstrip("- ").strip()
        if text.split(" ")[0] in ("GCC", "clang", "Clang", "MSVC", "AppleClang"):
            return text
    return "unknown"


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _nvcc() -> dict[str, Any]:
    path = shutil.which("nvcc")
    home = os.environ.get("CUDA_HOME") or os.environ.get("CUDA_PATH")
    if path is None and home and os.path.exists(os.path.join(home, "bin", "nvcc")):
        path = os.path.join(home, "bin", "nvcc")
    if path is None and os.path.exists("/usr/local/cuda/bin/nvcc"):
        path = "/usr/local/cuda/bin/nvcc"
    version = None
    if path is not None:
        try:
            text = subprocess.run([path, "--version"], capture_output=True, text=True,
                                  timeout=10).stdout
            release = [ln for ln in text.splitlines() if "release" in ln]
            version = release[-1].split("release", 1)[1].strip() if release else None
        except (OSError, subprocess.SubprocessError):
            version = None
    return {"path": path, "version": version}


def cpu_build_info() -> dict[str, Any]:
    """Which CPU kernel library was loaded, what else was built, and why that one."""
    torch_cap = torch.backends.cpu.get_cpu_capability()
    forced = os.environ.get("FEDKERNELS_CPU_CAPABILITY", "")
    aten = os.environ.get("ATEN_CPU_CAPABILITY", "")
    built = [cap for cap in native._ORDER if native._library(f"_cpu_{cap}") is not None]
    if forced:
        reason = f"forced by FEDKERNELS_CPU_CAPABILITY={forced}"
    else:
        reason = f"the best build for torch's CPU capability {torch_cap}"
        if aten and aten.lower() == torch_cap.lower():
            reason += f" (set by ATEN_CPU_CAPABILITY={aten})"
        elif aten:
            # torch ignores a value it does not know or this CPU cannot run (with a warning
            # that scrolls away): not "set by" it
            reason += f" (torch did not apply ATEN_CPU_CAPABILITY={aten})"
    return {"loaded": native.cpu_capability, "built": built, "torch_capability": torch_cap,
            "FEDKERNELS_CPU_CAPABILITY": forced or None, "ATEN_CPU_CAPABILITY": aten or None,
            "reason": reason}


def cuda_info() -> dict[str, Any]:
    built = native._library("_cuda") is not None
    gpus = []
    if torch.cuda.is_available():
        for i in range(torch.cuda.device_count()):
            p = torch.cuda.get_device_properties(i)
            gpus.append({"name": p.name, "capability": f"{p.major}.{p.minor}",
                         "memory_GB": round(p.total_memory / 1e9, 1)})
    if native.cuda_available:
        kernels = "built and loaded"
    elif built:
        kernels = "built but not loaded (torch is not a CUDA build)"
    else:
        kernels = "not built (build with FEDKERNELS_CUDA=1 on a machine with nvcc)"
    return {"torch_cuda": torch.version.cuda, "kernels_built": built,
            "kernels_loaded": native.cuda_available, "kernels": kernels,
            "gpu_visible": torch.cuda.is_available(), "gpus": gpus, "nvcc": _nvcc(),
            "TORCH_CUDA_ARCH_LIST": os.environ.get("TORCH_CUDA_ARCH_LIST")}


def environment() -> dict[str, Any]:
    return {
        "fedkernels": _fedkernels_version(),
        "fedkernels_path": str(Path(native.__file__).resolve().parent.parent),
        "python": platform.python_version(),
        "python_executable": sys.executable,
        "platform": platform.platform(),
        "torch": torch.__version__,
        "torch_compiler": _torch_compiler(),
        "torch_threads": torch.get_num_threads(),
        "cpu": _cpu_model(),
        "cpu_build": cpu_build_info(),
        "cuda": cuda_info(),
    }


# ---------------------------------------------------------------- bandwidth probe


def bandwidth_probe(device: str, budget_s: float = PROBE_SECONDS,
                    client_bytes: int = PROBE_CLIENT_BYTES,
                    num_clients: int = PROBE_CLIENTS) -> dict[str, Any]:
    """Read bandwidth of ``sum`` over K x ``client_bytes`` of fp32 against ``weighted_sum`` of
    the same K clients (slices of that buffer): GB/s over the op's minimum traffic (read K
    clients, write one), and its percentage of the probe. Stops timing at ``budget_s``."""
    dev = torch.device(device)
    n = client_bytes // 4
    start = time.perf_counter()
    try:
        buf = torch.empty(num_clients * n, dtype=torch.float32, device=dev)
        for k in range(num_clients):
            buf[k * n:(k + 1) * n].fill_(0.01 * (k + 1))  # touches every page
        clients = [buf[k * n:(k + 1) * n] for k in range(num_clients)]
        out = [torch.empty(n, dtype=torch.float32, device=dev)]
    except (RuntimeError, MemoryError) as err:
        return {"device": device, "status": "skipped",
                "detail": f"could not allocate {num_clients * client_bytes / 2**20:.0f} MiB: "
                          f"{str(err).splitlines()[0]}"}
    w = torch.full((num_clients,), 1.0 / num_clients, dtype=torch.float64)
    op = torch.ops.fedkernels.weighted_sum.out

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)

    # one GPU call is too short to time on its own: time several per sample
    calls = 10 if dev.type == "cuda" else 1

    def timed(fn) -> float:
        sync()
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        sync()
        return (time.perf_counter() - t0) / calls

    fns = {"probe": lambda: buf.sum(),
           "weighted_sum": lambda: op(clients, w, [], 1.0, False, out=out)}
    times: dict[str, list[float]] = {k: [] for k in fns}
    for fn in fns.values():  # warm-up
        fn()
    deadline = start + budget_s
    while True:  # interleaved, so both see the same machine; at least 3 each
        for k, fn in fns.items():
            times[k].append(timed(fn))
        count = len(times["probe"])
        if count >= 15 or (count >= 3 and time.perf_counter() + calls * sum(
                t[-1] for t in times.values()) > deadline):
            break
    read_bytes = num_clients * n * 4
    probe = read_bytes / statistics.median(times["probe"]) / 1e9
    fused = (num_clients + 1) * n * 4 / statistics.median(times["weighted_sum"]) / 1e9
    return {"device": device, "status": "measured", "clients": num_clients,
            "client_MiB": client_bytes / 2**20, "repeats": len(times["probe"]),
            "threads": torch.get_num_threads() if dev.type == "cpu" else None,
            "read_probe_GBps": probe, "weighted_sum_GBps": fused,
            "pct_of_probe": 100.0 * fused / probe,
            "seconds": time.perf_counter() - start}


# ---------------------------------------------------------------- report


def _status_cell(records: list[dict]) -> str:
    return "ok" if all(r["status"] == "pass" for r in records) else "FAIL"


def format_report(report: dict[str, Any]) -> str:
    env = report["environment"]
    cpu, cuda = env["cpu_build"], env["cuda"]
    nvcc = cuda["nvcc"]
    gpus = ", ".join(f"{g['name']} (sm {g['capability']}, {g['memory_GB']} GB)"
                     for g in cuda["gpus"]) or "none visible"
    lines = [
        "fedkernels self-check",
        "",
        f"  fedkernels      {env['fedkernels']} ({env['fedkernels_path']})",
        f"  python          {env['python']} ({env['python_executable']})",
        f"  torch           {env['torch']}, CUDA {cuda['torch_cuda'] or 'none (CPU build)'}, "
        f"built with {env['torch_compiler']}",
        f"  platform        {env['platform']}",
        f"  cpu             {env['cpu']}, {env['torch_threads']} torch threads",
        f"  cpu kernels     {cpu['loaded']} loaded: {cpu['reason']}; built: "
        f"{', '.join(cpu['built']) or 'none'}",
        f"  cuda kernels    {cuda['kernels']}",
        f"  gpu             {gpus}",
        f"  nvcc            {nvcc['path'] or 'not found'}"
        + (f" (release {nvcc['version']})" if nvcc["version"] else ""),
        "",
    ]
    records = report["ops"]
    columns: list[tuple[str, str]] = []
    for r in records:
        if (r["device"], r["dtype"]) not in columns:
            columns.append((r["device"], r["dtype"]))
    names: list[str] = []
    for r in records:
        if r["op"] not in names:
            names.append(r["op"])
    width = max(len(n) for n in names) + 2
    short = {"float32": "f32", "float64": "f64", "float16": "f16", "bfloat16": "bf16"}
    heads = [f"{d}:{short.get(t, t)}" for d, t in columns]
    cell = max(len(h) for h in heads) + 2
    lines.append(f"  {'op (vs reference)':<{width}}" + "".join(f"{h:>{cell}}" for h in heads))
    by_key = {(r["op"], r["device"], r["dtype"]): r for r in records}
    for name in names:
        cells = [_status_cell([by_key[(name, d, t)]]) for d, t in columns]
        lines.append(f"  {name:<{width}}" + "".join(f"{c:>{cell}}" for c in cells))
    failures = [r for r in records if r["status"] != "pass"]
    if failures:
        lines += ["", "  failures:"]
        for r in failures:
            lines.append(f"    {r['op']} on {r['device']} {r['dtype']}: {r['detail']}")
    lines.append("")
    for b in report["bandwidth"]:
        if b["status"] == "measured":
            lines.append(
                f"  bandwidth {b['device']:<5} read probe (sum over {b['clients']} x "
                f"{b['client_MiB']:.0f} MiB) {b['read_probe_GBps']:.1f} GB/s; weighted_sum K="
                f"{b['clients']} {b['weighted_sum_GBps']:.1f} GB/s = {b['pct_of_probe']:.0f}% of "
                f"the probe ({b['repeats']} repeats)")
        else:
            lines.append(f"  bandwidth {b['device']:<5} {b['status']}: {b.get('detail', '')}")
    if not report["bandwidth"]:
        lines.append("  bandwidth       skipped (--quick)")
    checked = len(records)
    failed = len(failures)
    lines += ["", f"result: {'PASS' if report['ok'] else 'FAIL'} "
                  f"({checked - failed} of {checked} op checks passed)"]
    return "\n".join(lines)


def _validate_json_path(json_path: str | os.PathLike | None) -> Path | None:
    if json_path is None:
        return None
    if not isinstance(json_path, (str, os.PathLike)):
        raise TypeError(f"json_path must be a path, not {type(json_path).__name__}")
    path = Path(json_path)
    if path.is_dir():
        raise ValueError(f"cannot write the JSON report to {str(path)!r}: it is a directory")
    if not path.parent.is_dir():
        what = "is a file, not a folder" if path.parent.exists() else "does not exist"
        raise ValueError(f"cannot write the JSON report to {str(path)!r}: "
                         f"{str(path.parent)!r} {what}")
    # try it now rather than after the checks; permission bits say yes to root even in /sys
    try:
        if path.exists():
            with path.open("a"):
                pass
        else:
            with tempfile.TemporaryFile(dir=path.parent):
                pass
    except OSError as err:
        raise ValueError(f"cannot write the JSON report to {str(path)!r}: "
                         f"{err.strerror or err}") from None
    return path


def _json_safe(value: Any) -> Any:
    """``value`` with every non-finite float as null: json.dumps writes Infinity and NaN,
    which are not JSON (strict parsers, jq and JavaScript's JSON.parse, refuse the file); a
    failed check's error is infinite where the shapes or the NaNs differ."""
    if isinstance(value, float) and not math.isfinite(value):
        return None
    if isinstance(value, dict):
        return {k: _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    return value


def available_devices() -> list[str]:
    return ["cpu", "cuda"] if torch.cuda.is_available() else ["cpu"]


def check(
    *,
    quick: bool = False,
    json_path: str | os.PathLike | None = None,
    devices: Iterable[str] | None = None,
    ops: Mapping[str, Callable] | None = None,
    verbose: bool = True,
    file: TextIO | None = None,
) -> dict[str, Any]:
    """Checks this installation and prints a report; returns it as a dict (``report["ok"]``).

    Every op of the ``fedkernels`` torch library runs on every device in ``devices`` (names,
    or one name; default: the CPU, and CUDA when a GPU is visible) in float32, float64,
    float16 and bfloat16 against :mod:`fedkernels.ops.reference`; an op with no check here
    fails. Unless ``quick``, a bandwidth probe (at most ~5 s per device) compares
    ``weighted_sum`` of K = 10 clients of 64 MB with a ``sum`` over the same memory.
    ``json_path`` also writes the report as JSON (a non-finite number, such as the infinite
    error of a wrong shape, as null).
    ``ops`` maps op names (``"weighted_sum"``, ``"weighted_sum.out"``, ...) to callables
    that replace the native op in the check (to see what a broken op looks like).
    ``verbose=False`` prints nothing; ``file`` is where the report goes (default stdout).
    """
    path = _validate_json_path(json_path)
    if not isinstance(quick, bool):
        raise TypeError(f"quick must be True or False, not {quick!r}")
    known = set(CHECKS)
    ops = dict(ops or {})
    for name, fn in ops.items():
        if name not in known:
            raise ValueError(f"ops: unknown op {name!r}; the checked ops are {sorted(known)}")
        if not callable(fn):
            raise TypeError(f"ops[{name!r}] must be callable, not {type(fn).__name__}")
    available = available_devices()
    if isinstance(devices, str):  # "cpu", not the characters c, p, u
        devices = [devices]
    # each device once: a repeated one ran every check again and counted it twice
    devices = available if devices is None else list(dict.fromkeys(devices))
    for d in devices:
        if d not in ("cpu", "cuda"):
            raise ValueError(f"devices: {d!r} is not 'cpu' or 'cuda'")
        if d not in available:
            raise ValueError(f"devices: {d!r} requested but no CUDA GPU is visible to torch")
    if not devices:
        raise ValueError("devices: give at least one device")

    env = environment()
    records = run_op_checks(devices, DTYPES, ops)
    problems = []
    if env["cuda"]["gpu_visible"] and not env["cuda"]["kernels_loaded"]:
        problems.append("a GPU is visible but the CUDA kernels are not loaded: "
                        + env["cuda"]["kernels"])
    bandwidth = [] if quick else [bandwidth_probe(d) for d in devices]
    ok = all(r["status"] == "pass" for r in records) and not problems
    report = {"ok": ok, "environment": env, "ops": records, "bandwidth": bandwidth,
              "problems": problems, "quick": quick,
              "tolerances": {_dtype_name(d): {"elementwise": ELEMENTWISE_TOL[d],
                                              "reduction": REDUCTION_TOL[d]} for d in DTYPES}}
    if verbose:
        text = format_report(report)
        if problems:
            text += "\n" + "\n".join(f"problem: {p}" for p in problems)
        print(text, file=file or sys.stdout, flush=True)
    if path is not None:
        try:
            path.write_text(json.dumps(_json_safe(report), indent=1, default=str,
                                       allow_nan=False) + "\n")
        except OSError as err:
            raise ValueError(f"cannot write the JSON report to {str(path)!r}: "
                             f"{err.strerror or err}") from None
    return report
