"""The native op ``torch.ops.fedkernels.weighted_sum`` (functional, ``.out`` and in-place
``weighted_sum_``): every mode against the reference, mixed dtypes in one call, the three CPU
builds, opcheck, gradcheck and torch.compile."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch
from conftest import (
    DEVICES,
    FLOAT_DTYPES,
    HALF_DTYPES,
    ODD_SHAPES,
    assert_close,
    bitwise_equal,
    cpu_builds,
    dtype_id,
    make_clients_list,
    make_weights,
    to_device,
)

import fedkernels  # noqa: F401  (registers the ops)
from fedkernels import ops
from fedkernels.ops.reference import weighted_sum_reference

SHAPES = ODD_SHAPES + [(1000,)]


def flat(clients):
    """Client-major flat list: updates[k * T + t]."""
    return [t for c in clients for t in c]


def weights_tensor(num_clients, device="cpu", seed=0):
    return torch.tensor(make_weights(num_clients, seed), dtype=torch.float64, device=device)


# ---------------------------------------------------------------- modes vs reference

# mode -> (base given, delta)
OP_MODES = {"plain": (False, False), "delta": (True, True), "accumulate": (True, False)}


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", list(OP_MODES))
def test_functional(mode, dtype, device):
    has_base, delta = OP_MODES[mode]
    clients = make_clients_list(4, SHAPES, dtype, seed=1)
    base = make_clients_list(1, SHAPES, dtype, seed=2)[0] if has_base else []
    w = weights_tensor(4)
    expected = weighted_sum_reference(clients, w, base or None, 0.75, delta)
    result = ops.weighted_sum(flat(to_device(clients, device)), w.to(device),
                              to_device(base, device), 0.75, delta)
    assert isinstance(result, list) and len(result) == len(SHAPES)
    assert_close(result, expected, dtype, num_clients=4)
    if device == "cuda":
        on_cpu = ops.weighted_sum(flat(clients), w, base, 0.75, delta)
        assert_close(result, on_cpu, dtype, num_clients=4)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("mode", list(OP_MODES))
def test_out_variant(mode, dtype, device):
    has_base, delta = OP_MODES[mode]
    clients = make_clients_list(3, SHAPES, dtype, seed=3, device=device)
    base = make_clients_list(1, SHAPES, dtype, seed=4, device=device)[0] if has_base else []
    w = weights_tensor(3, seed=3)
    out = [torch.full(s, 9.0, dtype=dtype, device=device) for s in SHAPES]
    ptrs = [o.data_ptr() for o in out]
    assert ops.weighted_sum_out(flat(clients), w, base, 1.25, delta, out) is None
    assert [o.data_ptr() for o in out] == ptrs
    expected = weighted_sum_reference(to_device(clients, "cpu"), w,
                                      to_device(base, "cpu") or None, 1.25, delta)
    assert_close(out, expected, dtype, num_clients=3)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
@pytest.mark.parametrize("delta", [True, False], ids=["delta", "accumulate"])
def test_in_place(delta, dtype, device):
    clients = make_clients_list(5, SHAPES, dtype, seed=5, device=device)
    base = make_clients_list(1, SHAPES, dtype, seed=6, device=device)[0]
    w = weights_tensor(5, seed=5)
    expected = weighted_sum_reference(to_device(clients, "cpu"), w, to_device(base, "cpu"),
                                      0.4, delta)
    ptrs = [b.data_ptr() for b in base]
    assert ops.weighted_sum_(base, flat(clients), w, 0.4, delta) is None
    assert [b.data_ptr() for b in base] == ptrs
    assert_close(base, expected, dtype, num_clients=5)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_streaming_accumulate_with_weighted_sum_(dtype, device):
    """acc += w_k x_k one client at a time (delta=False) equals the one-shot plain sum; half
    updates accumulate into fp32 accumulators."""
    clients = make_clients_list(6, SHAPES, dtype, seed=7, device=device)
    w = make_weights(6, seed=7)
    acc_dtype = torch.float64 if dtype == torch.float64 else torch.float32
    acc = [torch.zeros(s, dtype=acc_dtype, device=device) for s in SHAPES]
    for k in range(6):
        ops.weighted_sum_(acc, clients[k], torch.tensor([w[k]], dtype=torch.float64), 1.0,
                          False)
    expected = weighted_sum_reference(
        [[t.to(acc_dtype) for t in c] for c in to_device(clients, "cpu")], w)
    assert_close(acc, expected, acc_dtype, num_clients=6)


@pytest.mark.parametrize("device", DEVICES)
def test_mixed_dtypes_in_one_call(device):
    """One call whose tensor list mixes every dtype (one kernel group per dtype pair), with
    half tensors going into fp32 base/out tensors."""
    dtypes = [torch.float32, torch.float16, torch.float64, torch.bfloat16, torch.float16,
              torch.float32, torch.bfloat16]
    shapes = [(33,), (5, 3), (), (0,), (70_001,), (2, 2), (65_541,)]
    g = torch.Generator().manual_seed(8)
    clients = [[torch.randn(s, generator=g).to(d) for s, d in zip(shapes, dtypes)]
               for _ in range(3)]
    base_dtypes = [torch.float32 if d in HALF_DTYPES and i % 2 else d
                   for i, d in enumerate(dtypes)]
    base = [torch.randn(s, generator=g).to(d) for s, d in zip(shapes, base_dtypes)]
    w = weights_tensor(3, seed=8)
    for b, delta in (([], False), (base, True), (base, False)):
        expected = weighted_sum_reference(clients, w, b or None, 0.5, delta)
        result = ops.weighted_sum(flat(to_device(clients, device)), w,
                                  to_device(b, device), 0.5, delta)
        assert [r.dtype for r in result] == ([r.dtype for r in b] if b else dtypes)
        for r, e, d in zip(result, expected, dtypes):
            assert_close(r, e, d, num_clients=3)


def test_delta_without_base_is_plain():
    """delta=True with an empty base means plain mode (it used to read through a null base)."""
    clients = make_clients_list(3, [(100,), (7,)], torch.float32, seed=9)
    w = weights_tensor(3)
    plain = ops.weighted_sum(flat(clients), w, [], 2.0, False)
    assert bitwise_equal(ops.weighted_sum(flat(clients), w, [], 2.0, True), plain)
    out = [torch.empty_like(t) for t in clients[0]]
    ops.weighted_sum_out(flat(clients), w, [], 2.0, True, out)
    assert bitwise_equal(out, plain)


@pytest.mark.parametrize("wdtype", [torch.float32, torch.float64, torch.int64, torch.int32])
def test_weight_dtypes(wdtype):
    clients = make_clients_list(3, [(40,)], torch.float64, seed=10)
    w = torch.tensor([3, -2, 5]).to(wdtype)
    result = ops.weighted_sum(flat(clients), w, [], 1.0, False)
    assert_close(result, weighted_sum_reference(clients, [3.0, -2.0, 5.0]), torch.float64)


def test_non_contiguous_weights():
    clients = make_clients_list(3, [(40,)], torch.float32, seed=11)
    w = torch.tensor([0.5, 99.0, 0.25, 99.0, 2.0])[::2]
    assert not w.is_contiguous()
    assert bitwise_equal(ops.weighted_sum(flat(clients), w, [], 1.0, False),
                         ops.weighted_sum(flat(clients), w.contiguous(), [], 1.0, False))


def test_no_tensors():
    assert ops.weighted_sum([], torch.ones(3), [], 1.0, False) == []
    ops.weighted_sum_out([], torch.ones(3), [], 1.0, False, [])
    ops.weighted_sum_([], [], torch.ones(3), 1.0, True)


def test_cancellation_is_exact_for_representable_values():
    """Fixed client order: x + (-x) + y gives exactly y."""
    x = torch.tensor([1e30, -3.5, 7.25])
    y = torch.tensor([0.5, 0.125, -2.0])
    result = ops.weighted_sum([x, -x, y], torch.ones(3), [], 1.0, False)
    assert torch.equal(result[0], y)


@pytest.mark.parametrize("device", DEVICES)
def test_nan_propagates(device):
    x = torch.zeros(10, device=device)
    y = torch.zeros(10, device=device)
    y[3] = float("nan")
    result = ops.weighted_sum([x, y], torch.ones(2), [], 1.0, False)[0].cpu()
    assert torch.isnan(result[3]) and torch.isfinite(result[torch.arange(10) != 3]).all()


# ---------------------------------------------------------------- the three CPU builds


_BUILD_CHECK = textwrap.dedent(
    """
    import sys, torch, fedkernels
    from fedkernels import ops
    from fedkernels.ops import native as _native
    from fedkernels.ops.reference import weighted_sum_reference
    assert _native.cpu_capability == sys.argv[1], (_native.cpu_capability, sys.argv[1])
    g = torch.Generator().manual_seed(0)
    shapes = [(), (0,), (1,), (31,), (33,), (5, 7), (2053,)]
    tol = {torch.float32: 1e-5, torch.float64: 1e-12, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}
    checked = 0
    for dtype in tol:
        for num_clients in (1, 3, 6):
            clients = [[torch.randn(s, generator=g).to(dtype) for s in shapes]
                       for _ in range(num_clients)]
            w = torch.rand(num_clients, generator=g, dtype=torch.float64) - 0.3
            bases = [[torch.randn(s, generator=g).to(dtype) for s in shapes]]
            if dtype in (torch.float16, torch.bfloat16):
                bases.append([torch.randn(s, generator=g) for s in shapes])
            cases = [([], False)] + [(b, d) for b in bases for d in (True, False)]
            for base, delta in cases:
                want = weighted_sum_reference(clients, w, base or None, 0.7, delta)
                got = ops.weighted_sum([t for c in clients for t in c], w, base, 0.7, delta)
                for a, e in zip(got, want):
                    torch.testing.assert_close(a, e, rtol=tol[dtype], atol=tol[dtype])
                inplace = [b.clone() for b in base]
                if inplace:
                    ops.weighted_sum_(inplace, [t for c in clients for t in c], w, 0.7, delta)
                    for a, e in zip(inplace, want):
                        torch.testing.assert_close(a, e, rtol=tol[dtype], atol=tol[dtype])
                checked += 1
    # Across the parallel chunk boundary (65536 elements), once per dtype.
    for dtype in tol:
        x = [torch.randn(65536 + 2053, generator=g).to(dtype) for _ in range(3)]
        w = torch.tensor([0.5, -1.5, 2.0], dtype=torch.float64)
        got = ops.weighted_sum(x, w, [x[0]], 1.0, True)[0]
        want = weighted_sum_reference([[t] for t in x], w, [x[0]], 1.0, True)[0]
        torch.testing.assert_close(got, want, rtol=tol[dtype], atol=tol[dtype])
        checked += 1
    print("OK", _native.cpu_capability, checked)
    """
)




@pytest.mark.slow
@pytest.mark.parametrize("capability", ["default", "avx2", "avx512"])
def test_cpu_build_matches_reference(capability):
    if capability not in cpu_builds():
        pytest.skip(f"this CPU does not support the {capability} build, or "
                    "FEDKERNELS_CPU_CAPABILITY forces another")
    env = dict(os.environ, FEDKERNELS_CPU_CAPABILITY=capability, OMP_NUM_THREADS="2")
    proc = subprocess.run([sys.executable, "-c", _BUILD_CHECK, capability], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split()[:2] == ["OK", capability], proc.stdout
    assert int(proc.stdout.split()[2]) == 4 * 3 * 5 - 2 * 3 * 2 + 4  # every case ran


def test_default_build_is_the_best_supported():
    from fedkernels.ops import native as _native

    if os.environ.get("FEDKERNELS_CPU_CAPABILITY"):
        pytest.skip("a build is forced by FEDKERNELS_CPU_CAPABILITY")
    assert _native.cpu_capability == _native._supported_capabilities()[0]


@pytest.mark.slow
def test_unsupported_capability_is_a_clear_import_error():
    env = dict(os.environ, FEDKERNELS_CPU_CAPABILITY="sse9")
    proc = subprocess.run([sys.executable, "-c", "import fedkernels"], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode != 0
    assert "FEDKERNELS_CPU_CAPABILITY must be one of" in proc.stderr


# ---------------------------------------------------------------- opcheck


def _opcheck_samples(device="cpu"):
    g = torch.Generator().manual_seed(12)

    def r(shape, dtype=torch.float32):
        return torch.randn(shape, generator=g).to(dtype).to(device)

    shapes = [(5,), (2, 3), (), (0,)]
    samples = []
    # plain, float32, mixed shapes
    samples.append(([r(s) for _ in range(3) for s in shapes], torch.rand(3, generator=g), [],
                    0.5, False))
    # delta, float64 with requires_grad (exercises the autograd registration)
    x = [r(s, torch.float64).requires_grad_() for _ in range(2) for s in shapes[:3]]
    samples.append((x, torch.rand(2, generator=g, dtype=torch.float64).requires_grad_(),
                    [r(s, torch.float64).requires_grad_() for s in shapes[:3]], 1.5, True))
    # bf16 updates into an fp32 base, accumulate
    samples.append(([r((17,), torch.bfloat16) for _ in range(4)], torch.rand(4, generator=g),
                    [r((17,))], 1.0, False))
    # non-contiguous inputs
    samples.append(([r((6, 4)).t() for _ in range(2)], torch.rand(2, generator=g),
                    [r((6, 8))[:, ::2].t()], 0.3, True))
    return samples


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", range(4))
def test_opcheck_functional(index, device):
    args = _opcheck_samples(device)[index]
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.default, args)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", [0, 2, 3])
def test_opcheck_out(index, device):
    updates, w, base, scale, delta = _opcheck_samples(device)[index]
    n = len(updates) // w.numel()
    out = [torch.empty_like(base[t] if base else updates[t]) for t in range(n)]
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum.out,
                          (updates, w, base, scale, delta), {"out": out})


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("index", [2, 3])
def test_opcheck_in_place(index, device):
    updates, w, base, scale, delta = _opcheck_samples(device)[index]
    base = [b.detach().clone() for b in base]
    torch.library.opcheck(torch.ops.fedkernels.weighted_sum_.default,
                          (base, updates, w, scale, delta))


# ---------------------------------------------------------------- gradcheck


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("mode", list(OP_MODES))
def test_gradcheck(mode, device):
    has_base, delta = OP_MODES[mode]
    g = torch.Generator().manual_seed(13)
    shapes = [(3,), (2, 2), ()]
    num_clients, n = 3, len(shapes)

    def r(shape):
        return torch.randn(shape, generator=g, dtype=torch.float64).to(device).requires_grad_()

    updates = [r(s) for _ in range(num_clients) for s in shapes]
    w = torch.rand(num_clients, generator=g, dtype=torch.float64).to(device).requires_grad_()
    base = [r(s) for s in shapes] if has_base else []

    def fn(*args):
        xs = list(args[: num_clients * n])
        weights = args[num_clients * n]
        b = list(args[num_clients * n + 1:])
        return tuple(ops.weighted_sum(xs, weights, b, 0.7, delta))

    assert torch.autograd.gradcheck(fn, (*updates, w, *base))


def test_backward_matches_reference_autograd():
    """The registered backward against autograd through the reference (float32, with base)."""
    g = torch.Generator().manual_seed(14)
    clients = [[torch.randn(s, generator=g).requires_grad_() for s in [(4,), (3, 2)]]
               for _ in range(3)]
    base = [torch.randn(s, generator=g).requires_grad_() for s in [(4,), (3, 2)]]
    w = torch.rand(3, generator=g).requires_grad_()
    upstream = [torch.randn(4, generator=g), torch.randn(3, 2, generator=g)]

    def grads(fn):
        out = fn()
        inputs = [t for c in clients for t in c] + [w] + base
        return torch.autograd.grad(out, inputs, upstream)

    native = grads(lambda: ops.weighted_sum(flat(clients), w, base, 0.9, True))

    def reference():
        return [b + 0.9 * sum(w[k] * (clients[k][t] - b) for k in range(3))
                for t, b in enumerate(base)]

    for a, e in zip(native, grads(reference)):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("wanted", ["updates", "weights", "base", "one update"])
def test_backward_forms_only_the_gradients_asked_for(wanted):
    """With only some inputs requiring grad, those get the reference's gradients and the rest
    none (the weights' gradient, a float64 read of every update, is not formed unless asked)."""
    g = torch.Generator().manual_seed(15)
    shapes = [(4,), (3, 2)]
    clients = [[torch.randn(s, generator=g) for s in shapes] for _ in range(3)]
    base = [torch.randn(s, generator=g) for s in shapes]
    w = torch.rand(3, generator=g)
    upstream = [torch.randn(s, generator=g) for s in shapes]
    inputs = {"updates": [t for c in clients for t in c], "weights": [w], "base": base,
              "one update": [clients[1][0]]}[wanted]
    for t in inputs:
        t.requires_grad_()

    def grads(outputs):
        loss = sum((o * u).sum() for o, u in zip(outputs, upstream) if o.requires_grad)
        return torch.autograd.grad(loss, inputs)

    native = grads(ops.weighted_sum(flat(clients), w, base, 0.9, True))
    reference = grads([b + 0.9 * sum(w[k] * (clients[k][t] - b) for k in range(3))
                       for t, b in enumerate(base)])
    for a, e in zip(native, reference):
        torch.testing.assert_close(a, e, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------- torch.compile


def _backend(device):
    # aot_eager runs dynamo, the fake kernels and functionalization, as inductor does, without
    # inductor's C++ compile of the CPU graph (~20 s cold on 2 cores); CUDA runs inductor.
    return "inductor" if device == "cuda" else "aot_eager"


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph(device):
    torch._dynamo.reset()

    def step(updates, weights, base):
        out = ops.weighted_sum(updates, weights, base, 0.5, True)
        return [o * 2 for o in out]

    compiled = torch.compile(step, fullgraph=True, backend=_backend(device))
    clients = make_clients_list(3, [(7,), (2, 5)], torch.float32, seed=15, device=device)
    base = make_clients_list(1, [(7,), (2, 5)], torch.float32, seed=16, device=device)[0]
    w = weights_tensor(3, device=device)
    got = compiled(flat(clients), w, base)
    want = step(flat(clients), w, base)
    assert bitwise_equal(got, want)


def test_compile_fullgraph_inductor_cpu():
    """The default backend too: inductor keeps the op as an extern kernel around its own
    generated code (the one compile of C++ in the suite)."""
    torch._dynamo.reset()

    def step(updates, weights):
        return [torch.relu(o) + 1 for o in ops.weighted_sum(updates, weights, [], 2.0, False)]

    compiled = torch.compile(step, fullgraph=True)
    clients = make_clients_list(3, [(33,), (4, 4)], torch.float32, seed=21)
    w = weights_tensor(3)
    assert bitwise_equal(compiled(flat(clients), w), step(flat(clients), w))


@pytest.mark.parametrize("device", DEVICES)
def test_compile_fullgraph_in_place(device):
    torch._dynamo.reset()

    def step(acc, updates, weights):
        ops.weighted_sum_(acc, updates, weights, 1.0, False)
        return acc

    compiled = torch.compile(step, fullgraph=True, backend=_backend(device))
    clients = make_clients_list(2, [(9,), ()], torch.float32, seed=17, device=device)
    acc_a = [torch.ones(9, device=device), torch.ones((), device=device)]
    acc_b = [a.clone() for a in acc_a]
    compiled(acc_a, flat(clients), weights_tensor(2, device=device))
    step(acc_b, flat(clients), weights_tensor(2, device=device))
    assert bitwise_equal(acc_a, acc_b)
    assert not torch.equal(acc_a[0], torch.ones(9, device=device))


def test_jit_trace_refuses_ops_that_write_into_a_list():
    """torch.jit.trace dropped the out= and in-place list ops as dead code: the traced module
    returned its out/base tensors unwritten, without an error. Every Python path to such an op
    now refuses the trace, naming the op; allocating calls still trace, and torch.export and
    torch.compile (above) record all of them."""
    import warnings

    from fedkernels.ops import private, robust

    w2 = weights_tensor(2)
    calls = {
        "weighted_sum.out": lambda a, b, o: ops.weighted_sum_out([a, b], w2, [], 1.0, False, [o]),
        "weighted_sum_": lambda a, b, o: ops.weighted_sum_([o], [a, b], w2, 1.0, False),
        "coordinate_median.out": lambda a, b, o: robust.coordinate_median([a, b, a], 3, [o]),
        "trimmed_mean.out": lambda a, b, o: robust.trimmed_mean([a, b, a], 3, 0, [o]),
        "median_window_mean.out": lambda a, b, o: robust.median_window_mean([a, b, a], 3, 1,
                                                                            [o]),
        "private_sum.out": lambda a, b, o: private.private_sum([a, b], w2, [o], 0.0, None, [o]),
        "private_sum_": lambda a, b, o: private.private_sum_([o], [a, b], w2, 0.0, None),
        "superfed_sgd_step_": lambda a, b, o: ops.superfed_sgd_step_(
            [o], [a], [], [], [b], torch.zeros(1, 4, dtype=torch.float64), 0.5, lr=0.1),
        "aggregate out=": lambda a, b, o: fedkernels.aggregate([[a], [b]], [0.5, 0.5], out=[o]),
        "Accumulator": lambda a, b, o: _accumulated(a, b),
    }
    args = (torch.randn(6), torch.randn(6), torch.zeros(6))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # torch.jit.trace is deprecated
        for name, call in calls.items():
            # the public APIs name themselves, the ops their own name
            op = "Accumulator" if name == "Accumulator" else \
                "aggregate" if name == "aggregate out=" else name
            with pytest.raises(RuntimeError, match=f"fedkernels.{op}: torch.jit.trace does not "
                                                   "record ops that write into a list"):
                torch.jit.trace(_Returns(call), args)
        traced = torch.jit.trace(_Returns(lambda a, b, o: fedkernels.aggregate(
            [[a], [b]], [0.5, 0.5])[0]), args)
        assert torch.equal(traced(*args), (args[0] + args[1]) * 0.5)


def _accumulated(a, b):
    acc = fedkernels.Accumulator()
    acc.add([a], 0.5)
    acc.add([b], 0.5)
    return acc.result()[0]


class _Returns(torch.nn.Module):
    def __init__(self, call):
        super().__init__()
        self.call = call

    def forward(self, a, b, o):
        result = self.call(a, b, o)
        return o if result is None or isinstance(result, list) else result


# ---------------------------------------------------------------- CUDA only


@pytest.mark.cuda
def test_cuda_large_k_and_many_tensors(cuda_device):
    """K = 1024 clients and thousands of tensors in one call (the device pointer table)."""
    shapes = [((i * 13) % 41,) for i in range(2000)]
    clients = make_clients_list(4, shapes, torch.float32, seed=18)
    w = weights_tensor(4)
    on_cpu = ops.weighted_sum(flat(clients), w, [], 1.0, False)
    got = ops.weighted_sum(flat(to_device(clients, cuda_device)), w.to(cuda_device), [], 1.0,
                           False)
    assert_close(got, on_cpu, torch.float32, num_clients=4)

    big_k = make_clients_list(1024, [(3,), (129,)], torch.bfloat16, seed=19)
    w = weights_tensor(1024)
    base = [torch.randn(3), torch.randn(129)]
    expected = weighted_sum_reference(big_k, w, base, 0.5, True)
    got = ops.weighted_sum(flat(to_device(big_k, cuda_device)), w.to(cuda_device),
                           to_device(base, cuda_device), 0.5, True)
    assert_close(got, expected, torch.float32, num_clients=1024)


@pytest.mark.cuda
@pytest.mark.parametrize("dtype", FLOAT_DTYPES, ids=dtype_id)
def test_cuda_deterministic_and_weights_on_either_device(dtype, cuda_device):
    clients = make_clients_list(9, [(1_000_003,), (5,)], dtype, seed=20, device=cuda_device)
    w = weights_tensor(9)
    first = ops.weighted_sum(flat(clients), w, [], 1.0, False)
    again = ops.weighted_sum(flat(clients), w.to(cuda_device), [], 1.0, False)
    assert bitwise_equal(first, again)
    assert bitwise_equal(ops.weighted_sum(flat(clients), w, [], 1.0, False), first)
    assert first[0].device.type == "cuda"


def test_aggregate_compiles_fullgraph():
    """The structure-aware API traces too: a state_dict with an integer buffer, normalize."""
    gen = torch.Generator().manual_seed(0)
    clients = [{"w": torch.randn(3, 4, generator=gen), "n": torch.tensor(k)} for k in range(3)]
    weights = torch.tensor([1.0, 2.0, 3.0])

    def step(clients, weights):
        return fedkernels.aggregate(clients, weights, normalize=True)

    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")
    got, want = compiled(clients, weights), step(clients, weights)
    assert torch.equal(got["w"], want["w"]) and torch.equal(got["n"], want["n"])


def test_aggregate_is_differentiable_in_weights():
    """Learned client weights: d/dw_k of sum(result) is sum(x_k)."""
    xs = [torch.full((4,), float(k), dtype=torch.float64) for k in range(3)]
    w = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64, requires_grad=True)
    fedkernels.aggregate(xs, w).sum().backward()
    assert torch.equal(w.grad, torch.tensor([0.0, 4.0, 8.0], dtype=torch.float64))
