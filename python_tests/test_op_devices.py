"""Every op checks that its tensor arguments are on one device.

A call that mixes devices must raise an error that names an argument, never return a result.
The case that matters most is a ``meta`` tensor among CPU tensors: the dispatcher then runs the
op's fake (meta) implementation, not the native kernel, so the fakes check devices as the
native host code does (and a fake that did not would return uninitialised CPU memory as the
result, or, for the in-place ops, silently do nothing). Small host-side arguments that the
native op reads or uploads itself (weights, lam, log_prior, log_weights, grad_stats) may be on
the CPU whatever the parameters' device, but not on a third device.

Also: the regularizers on an empty parameter list give a defined result (a zero loss, as an
empty sum), and calls with every tensor on ``meta`` (the fake path alone) give the right shapes.
"""

from __future__ import annotations

import pytest
import torch

import fedkernels
from fedkernels.ops import mixing

OPS = torch.ops.fedkernels
META = torch.device("meta")


def _meta(x):
    return torch.empty_like(x, device="meta")


def _randn(*shape, dtype=torch.float32):
    return torch.randn(shape, dtype=dtype)


# ---------------------------------------------------------------- the cases
#
# Each case: (op overload, builder of its CPU arguments as a dict of keyword-like names in
# schema order, the tensor arguments to move to meta one at a time). A moved argument is a name,
# or (name, index) for one tensor of a list. With it: the words the error must contain.


def _weighted_sum_args():
    K, shapes = 3, [(4, 3), (5,)]
    updates = [_randn(*s) for _ in range(K) for s in shapes]
    return dict(updates=updates, weights=torch.tensor([0.2, 0.3, 0.5]),
                base=[_randn(*s) for s in shapes], scale=1.0, delta=True)


def _superfed_lists():
    shapes = [(4, 3), (5,), ()]
    return ([_randn(*s) for s in shapes], [_randn(*s) for s in shapes],
            [_randn(*s) for s in shapes])


def _mix_args():
    g, l, _ = _superfed_lists()
    return dict(global_params=g, local_params=l, lam=torch.tensor(0.3, dtype=torch.float64))


def _mix_backward_args():
    g, l, _ = _superfed_lists()
    return dict(grads=[_randn(*x.shape) for x in g], global_params=g, local_params=l,
                lam=torch.tensor([0.1, 0.5, 0.9], dtype=torch.float64),
                output_mask=[True, True, True])


def _stats_args():
    g, l, a = _superfed_lists()
    return dict(global_params=g, local_params=l, anchor=a)


def _stats_backward_args():
    g, l, a = _superfed_lists()
    return dict(grad_stats=torch.randn(3, 4, dtype=torch.float64), global_params=g,
                local_params=l, anchor=a, output_mask=[True, True, True])


def _mix_stats_args():
    g, l, a = _superfed_lists()
    return dict(global_params=g, local_params=l, lam=torch.tensor(0.3, dtype=torch.float64),
                anchor=a)


def _mix_stats_backward_args():
    g, l, a = _superfed_lists()
    return dict(grads=[_randn(*x.shape) for x in g],
                grad_stats=torch.randn(3, 4, dtype=torch.float64), global_params=g,
                local_params=l, lam=torch.tensor(0.3, dtype=torch.float64), anchor=a,
                output_mask=[True, True, True, True])


def _superfed_sgd_step_args():
    g, l, a = _superfed_lists()
    return dict(global_params=g, local_params=l, global_momentum=[_randn(*x.shape) for x in g],
                local_momentum=[_randn(*x.shape) for x in g], grads=[_randn(*x.shape) for x in g],
                grad_stats=torch.randn(3, 4, dtype=torch.float64),
                lam=torch.tensor(0.3, dtype=torch.float64), anchor=a, lr=0.1, momentum=0.9,
                dampening=0.0, weight_decay=0.01, nesterov=False, first_step=[False, False])


def _pseudo_labels_args():
    K, N, C = 3, 5, 4
    return dict(logits=_randn(K, N, C), scores=_randn(K, N),
                log_prior=torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64).log(),
                weighting="fedgo", combine="logits", temperature=1.0, tau=1.0,
                double_sigmoid=True)


def _distill_kl_args():
    return dict(student_logits=_randn(5, 4), target=torch.softmax(_randn(5, 4), 1),
                temperature=2.0, scale=1.0, with_grad=True)


def _energy_args():
    return dict(logits=_randn(6, 4), labels=torch.tensor([0, 1, 2, 3, 0, 1]))


def _sgld_step_args():
    return dict(x=_randn(4, 3), grad=_randn(4, 3), step_size=0.1, noise_std=0.01,
                grad_clip=None, clamp_min=None, clamp_max=None, noise=_randn(4, 3),
                generator=None)


def _compose_args():
    K, M = 3, 4
    return dict(x=_randn(M, 2), grads=_randn(K, M, 2), energies=_randn(K, M),
                log_weights=torch.zeros(K), weighting="exact", step_size=0.1, noise_std=0.01,
                grad_clip=None, clamp_min=None, clamp_max=None, noise=_randn(M, 2),
                generator=None)


def _robust_args(extra=None):
    K, shapes = 3, [(4, 3), (5,)]
    args = dict(clients=[_randn(*s) for _ in range(K) for s in shapes], num_clients=K)
    if extra:
        args.update(extra)
    return args


def _private_sum_args():
    K, shapes = 3, [(4, 3), (5,)]
    return dict(clients=[_randn(*s) for _ in range(K) for s in shapes],
                coefficients=torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64),
                base=[_randn(*s) for s in shapes], noise_std=0.1, generator=None)


def _private_sum_inplace_args():
    args = _private_sum_args()
    return {"base": args.pop("base"), **args}


def _quantize_args():
    return dict(x=[_randn(4, 3), _randn(5)], residual=[_randn(4, 3), _randn(5)], block_size=4,
                stochastic=True, seed=3, offset=0)


def _dequantize_args():
    q = fedkernels.quantize_int8([_randn(4, 3), _randn(5)] * 2, 4)
    return dict(values=q.values, scales=q.scales,
                weights=torch.tensor([0.5, 0.5], dtype=torch.float64), block_size=4,
                dtype=torch.float32)


def _quantize_fp8_args():
    args = _quantize_args()
    del args["block_size"]
    return args


def _dequantize_int4_args():
    q = fedkernels.quantize_int4([_randn(4, 3), _randn(5)] * 2, 4)
    return dict(values=q.values, scales=q.scales,
                weights=torch.tensor([0.5, 0.5], dtype=torch.float64), block_size=4,
                numels=[12, 5], dtype=torch.float32)


def _dequantize_fp8_args():
    q = fedkernels.quantize_fp8([_randn(4, 3), _randn(5)] * 2)
    return dict(values=q.values, scales=q.scales,
                weights=torch.tensor([0.5, 0.5], dtype=torch.float64), dtype=torch.float32)


def _secagg_mask_args():
    return dict(x=[_randn(4, 3), _randn(5)], clip=4.0, scale=1024.0, stochastic=True, seed=3,
                offset=0, mask_seeds=torch.tensor([[1, 2], [3, 4]]), mask_signs=[1, -1])


def _secagg_unmask_args():
    y = [torch.randint(-2**31, 2**31 - 1, s, dtype=torch.int32) for s in [(4, 3), (5,)] * 2]
    return dict(masked=y, num_clients=2, mask_seeds=torch.tensor([[1, 2]]), mask_signs=[1])


def _sparse_args():
    shapes = [(4, 3), (5,)]
    cs = [fedkernels.sparsify_topk([_randn(*s) for s in shapes], 2) for _ in range(2)]
    return dict(base=[_randn(*s) for s in shapes], indices=[i for c in cs for i in c.indices],
                values=[v for c in cs for v in c.values],
                weights=torch.tensor([0.5, 0.5], dtype=torch.float64))


def _norms_args():
    args = _robust_args()
    args["base"] = [_randn(4, 3), _randn(5)]
    return args


# (op, builder, [(moved argument, words the error names)])
CASES = [
    (OPS.weighted_sum.default, _weighted_sum_args, [
        (("updates", 0), ["client 1, tensor 0", "cpu", "meta"]),
        (("updates", 3), ["client 1, tensor 1", "meta"]),
        ("weights", ["weights", "meta"]),
        (("base", 1), ["base tensor 1", "meta"]),
    ]),
    (OPS.weighted_sum_.default, lambda: {
        "base": _weighted_sum_args()["base"], **{k: v for k, v in _weighted_sum_args().items()
                                                 if k != "base"}}, [
        (("base", 0), ["base tensor 0", "meta"]),
        (("updates", 5), ["client 2, tensor 1", "meta"]),
        ("weights", ["weights", "meta"]),
    ]),
    (OPS.mix_endpoints.default, _mix_args, [
        (("global_params", 0), ["global_params tensor 1", "meta"]),
        (("global_params", 2), ["global_params tensor 2", "meta"]),
        (("local_params", 1), ["local_params tensor 1", "meta"]),
        ("lam", ["lam", "meta"]),
    ]),
    (OPS.mix_endpoints_backward.default, _mix_backward_args, [
        (("grads", 1), ["grads tensor 1", "meta"]),
        (("global_params", 1), ["global_params tensor 1", "meta"]),
        (("local_params", 0), ["local_params tensor 0", "meta"]),
        ("lam", ["lam", "meta"]),
    ]),
    (OPS.superfed_stats.default, _stats_args, [
        (("global_params", 2), ["global_params tensor 2", "meta"]),
        (("local_params", 0), ["local_params tensor 0", "meta"]),
        (("anchor", 1), ["anchor tensor 1", "meta"]),
    ]),
    (OPS.superfed_stats_backward.default, _stats_backward_args, [
        ("grad_stats", ["grad_stats", "meta"]),
        (("global_params", 1), ["global_params tensor 1", "meta"]),
        (("local_params", 2), ["local_params tensor 2", "meta"]),
        (("anchor", 0), ["anchor tensor 0", "meta"]),
    ]),
    (OPS.mix_endpoints_with_stats.default, _mix_stats_args, [
        (("global_params", 1), ["global_params tensor 1", "meta"]),
        (("local_params", 1), ["local_params tensor 1", "meta"]),
        ("lam", ["lam", "meta"]),
        (("anchor", 2), ["anchor tensor 2", "meta"]),
    ]),
    (OPS.mix_endpoints_with_stats_backward.default, _mix_stats_backward_args, [
        (("grads", 0), ["grads tensor 0", "meta"]),
        ("grad_stats", ["grad_stats", "meta"]),
        (("global_params", 2), ["global_params tensor 2", "meta"]),
        (("local_params", 0), ["local_params tensor 0", "meta"]),
        ("lam", ["lam", "meta"]),
        (("anchor", 1), ["anchor tensor 1", "meta"]),
    ]),
    (OPS.superfed_sgd_step_.default, _superfed_sgd_step_args, [
        (("global_params", 1), ["global_params tensor 1", "meta"]),
        (("local_params", 2), ["local_params tensor 2", "meta"]),
        (("global_momentum", 0), ["global_momentum tensor 0", "meta"]),
        (("local_momentum", 1), ["local_momentum tensor 1", "meta"]),
        (("grads", 0), ["grads tensor 0", "meta"]),
        ("grad_stats", ["grad_stats", "meta"]),
        ("lam", ["lam", "meta"]),
        (("anchor", 2), ["anchor tensor 2", "meta"]),
    ]),
    (OPS.ensemble_pseudo_labels.default, _pseudo_labels_args, [
        ("logits", ["scores", "meta"]),
        ("scores", ["scores", "meta"]),
        ("log_prior", ["log_prior", "meta"]),
    ]),
    (OPS.distill_kl.default, _distill_kl_args, [
        ("student_logits", ["pseudo_labels", "meta"]),
        ("target", ["pseudo_labels", "meta"]),
    ]),
    (OPS.energy_from_logits.default, _energy_args, [
        ("logits", ["labels", "meta"]),
        ("labels", ["labels", "meta"]),
    ]),
    (OPS.sgld_step.default, _sgld_step_args, [
        ("x", ["grad", "meta"]),
        ("grad", ["grad", "meta"]),
        ("noise", ["noise", "meta"]),
    ]),
    (OPS.sgld_step_.default, _sgld_step_args, [
        ("x", ["grad", "meta"]),
        ("grad", ["grad", "meta"]),
        ("noise", ["noise", "meta"]),
    ]),
    (OPS.sgld_compose_step.default, _compose_args, [
        ("x", ["grads", "meta"]),
        ("grads", ["grads", "meta"]),
        ("energies", ["energies", "meta"]),
        ("log_weights", ["log_weights", "meta"]),
        ("noise", ["noise", "meta"]),
    ]),
    (OPS.coordinate_median.default, _robust_args, [
        (("clients", 0), ["client 1, tensor 0", "meta"]),
        (("clients", 5), ["client 2, tensor 1", "meta"]),
    ]),
    (OPS.trimmed_mean.default, lambda: _robust_args({"cut": 1}), [
        (("clients", 3), ["client 1, tensor 1", "meta"]),
    ]),
    (OPS.median_window_mean.default, lambda: _robust_args({"window": 2}), [
        (("clients", 2), ["client 1, tensor 0", "meta"]),
    ]),
    (OPS.pairwise_sq_distances.default, _robust_args, [
        (("clients", 1), ["client 0, tensor 1", "meta"]),
        (("clients", 4), ["client 2, tensor 0", "meta"]),
    ]),
    (OPS.update_norms.default, _norms_args, [
        (("clients", 2), ["client 1, tensor 0", "meta"]),
        (("base", 1), ["base tensor 1", "meta"]),
    ]),
    (OPS.private_sum.default, _private_sum_args, [
        (("clients", 3), ["client 1, tensor 1", "meta"]),
        ("coefficients", ["coefficients", "meta"]),
        (("base", 0), ["base tensor 0", "meta"]),
    ]),
    (OPS.private_sum_.default, _private_sum_inplace_args, [
        (("base", 1), ["base tensor 1", "meta"]),
        (("clients", 0), ["client 1, tensor 0", "meta"]),
        ("coefficients", ["coefficients", "meta"]),
    ]),
    (OPS.quantize_int8.default, _quantize_args, [
        (("x", 1), ["x tensor 1", "meta"]),
        (("residual", 0), ["residual tensor 0", "meta"]),
    ]),
    (OPS.dequantize_weighted_sum.default, _dequantize_args, [
        (("values", 3), ["values tensor 3", "meta"]),
        (("scales", 2), ["scales tensor 2", "meta"]),
        ("weights", ["weights", "meta"]),
    ]),
    # quantized updates: 4-bit and fp8
    (OPS.quantize_int4.default, _quantize_args, [
        (("x", 1), ["x tensor 1", "meta"]),
        (("residual", 0), ["residual tensor 0", "meta"]),
    ]),
    (OPS.quantize_fp8.default, _quantize_fp8_args, [
        (("x", 1), ["x tensor 1", "meta"]),
        (("residual", 0), ["residual tensor 0", "meta"]),
    ]),
    (OPS.dequantize_int4_weighted_sum.default, _dequantize_int4_args, [
        (("values", 3), ["values tensor 3", "meta"]),
        (("scales", 2), ["scales tensor 2", "meta"]),
        ("weights", ["weights", "meta"]),
    ]),
    (OPS.dequantize_fp8_weighted_sum.default, _dequantize_fp8_args, [
        (("values", 3), ["values tensor 3", "meta"]),
        (("scales", 2), ["scales tensor 2", "meta"]),
        ("weights", ["weights", "meta"]),
    ]),
    (OPS.secagg_mask.default, _secagg_mask_args, [
        (("x", 1), ["x tensor 1", "meta"]),
    ]),
    (OPS.secagg_unmask_sum.default, _secagg_unmask_args, [
        (("masked", 3), ["masked tensor 3", "meta"]),
    ]),
    # sparse updates
    (OPS.sparse_weighted_sum.default, _sparse_args, [
        (("base", 1), ["base tensor 1", "meta"]),
        (("indices", 2), ["indices tensor 2", "meta"]),
        (("values", 3), ["values tensor 3", "meta"]),
        ("weights", ["weights", "meta"]),
    ]),
    (OPS.sparse_weighted_sum_.default, _sparse_args, [
        (("base", 1), ["base tensor 1", "meta"]),
        (("indices", 1), ["indices tensor 1", "meta"]),
        (("values", 2), ["values tensor 2", "meta"]),
    ]),
    (OPS.sgld_compose_step_.default, _compose_args, [
        ("x", ["grads", "meta"]),
        ("grads", ["grads", "meta"]),
        ("energies", ["energies", "meta"]),
        ("log_weights", ["log_weights", "meta"]),
        ("noise", ["noise", "meta"]),
    ]),
]


def _ids():
    for op, _, moves in CASES:
        for moved, _ in moves:
            name = moved if isinstance(moved, str) else f"{moved[0]}[{moved[1]}]"
            yield f"{op.name().split('::')[1]}-{name}"


def _params():
    for op, build, moves in CASES:
        for moved, words in moves:
            yield op, build, moved, words


def _move(args: dict, moved) -> dict:
    args = dict(args)
    if isinstance(moved, str):
        args[moved] = _meta(args[moved])
    else:
        name, i = moved
        args[name] = list(args[name])
        args[name][i] = _meta(args[name][i])
    return args


def _call(op, args: dict):
    return op(*args.values())


def _map_tensors(fn, args: dict) -> dict:
    """args with fn applied to every tensor (also inside lists)."""
    def one(v):
        if isinstance(v, torch.Tensor):
            return fn(v)
        if isinstance(v, list):
            return [one(x) for x in v]
        return v
    return {k: one(v) for k, v in args.items()}


def test_every_op_is_covered():
    """Each op overload of the library has a case here (a new op must add one)."""
    covered = {op.name() + ("." + op._overloadname if op._overloadname != "default" else "")
               for op, _, _ in CASES}
    # The .out overloads are covered by their own tests below.
    covered |= {f"fedkernels::{name}.out" for name in (
        "weighted_sum", "coordinate_median", "trimmed_mean", "median_window_mean",
        "private_sum", "dequantize_weighted_sum", "dequantize_int4_weighted_sum",
        "dequantize_fp8_weighted_sum", "sparse_weighted_sum")}
    # The output pool's controls take no tensors: nothing to place on a device
    # (test_output_pool.py tests them).
    covered |= {f"fedkernels::output_pool_{name}" for name in ("set_limit", "release", "stats")}
    schemas = {s.name + ("." + s.overload_name if s.overload_name else "")
               for s in torch._C._jit_get_all_schemas() if s.name.startswith("fedkernels::")}
    assert schemas == covered


@pytest.mark.parametrize("op, build, moved, words", list(_params()), ids=list(_ids()))
def test_one_argument_on_meta_raises(op, build, moved, words):
    args = build()
    before = _map_tensors(torch.clone, args)
    with pytest.raises((ValueError, RuntimeError)) as info:
        _call(op, _move(args, moved))
    message = str(info.value)
    for word in words:
        assert word in message, (word, message)
    assert "fedkernels." in message, message
    # Nothing was written (the in-place ops' x and base stay as they were).
    for k, v in args.items():
        tensors = v if isinstance(v, list) else [v]
        for t, b in zip(tensors, before[k] if isinstance(v, list) else [before[k]]):
            if isinstance(t, torch.Tensor):
                assert torch.equal(t, b), k


def test_weighted_sum_out_on_meta_raises():
    args = _weighted_sum_args()
    out = [torch.empty_like(x) for x in args["base"]]
    out_meta = [out[0], _meta(out[1])]
    with pytest.raises(ValueError, match="out tensor 1 is on meta, expected cpu"):
        OPS.weighted_sum.out(*args.values(), out=out_meta)
    with pytest.raises(ValueError, match="client 2, tensor 0 is on meta"):
        updates = list(args["updates"])
        updates[4] = _meta(updates[4])
        OPS.weighted_sum.out(updates, *list(args.values())[1:], out=out)


@pytest.mark.parametrize("op, build", [
    (OPS.coordinate_median.out, _robust_args),
    (OPS.trimmed_mean.out, lambda: _robust_args({"cut": 1})),
    (OPS.median_window_mean.out, lambda: _robust_args({"window": 2})),
    (OPS.private_sum.out, _private_sum_args),
], ids=["coordinate_median", "trimmed_mean", "median_window_mean", "private_sum"])
def test_robust_and_private_out_on_meta_raises(op, build):
    args = build()
    out = [torch.empty(4, 3), torch.empty(5)]
    with pytest.raises(ValueError, match="out tensor 1 is on meta, expected cpu"):
        op(*args.values(), out=[out[0], _meta(out[1])])
    clients = list(args["clients"])
    clients[4] = _meta(clients[4])
    with pytest.raises(ValueError, match="client 2, tensor 0 is on meta"):
        op(*{**args, "clients": clients}.values(), out=out)


def test_dequantize_weighted_sum_out_on_meta_raises():
    args = _dequantize_args()
    out = [torch.empty(4, 3), torch.empty(5)]
    with pytest.raises(ValueError, match="out tensor 1 is on meta, expected cpu"):
        OPS.dequantize_weighted_sum.out(*args.values(), out=[out[0], _meta(out[1])])
    values = list(args["values"])
    values[2] = _meta(values[2])
    with pytest.raises(ValueError, match="values tensor 2 is on meta"):
        OPS.dequantize_weighted_sum.out(*{**args, "values": values}.values(), out=out)


@pytest.mark.parametrize("op, build", [
    (OPS.dequantize_int4_weighted_sum.out, _dequantize_int4_args),
    (OPS.dequantize_fp8_weighted_sum.out, _dequantize_fp8_args),
], ids=["int4", "fp8"])
def test_dequantize_int4_and_fp8_out_on_meta_raises(op, build):
    args = build()
    out = [torch.empty(4, 3), torch.empty(5)]
    with pytest.raises(ValueError, match="out tensor 1 is on meta, expected cpu"):
        op(*args.values(), out=[out[0], _meta(out[1])])
    values = list(args["values"])
    values[2] = _meta(values[2])
    with pytest.raises(ValueError, match="values tensor 2 is on meta"):
        op(*{**args, "values": values}.values(), out=out)


def test_sparse_weighted_sum_out_on_meta_raises():
    args = _sparse_args()
    out = [torch.empty(4, 3), torch.empty(5)]
    with pytest.raises(ValueError, match="out tensor 1 is on meta, expected cpu"):
        OPS.sparse_weighted_sum.out(*args.values(), out=[out[0], _meta(out[1])])
    values = list(args["values"])
    values[2] = _meta(values[2])
    with pytest.raises(ValueError, match="values tensor 2 is on meta"):
        OPS.sparse_weighted_sum.out(*{**args, "values": values}.values(), out=out)


@pytest.mark.parametrize("op, build", [(op, build) for op, build, _ in CASES],
                         ids=[op.name().split("::")[1] for op, _, _ in CASES])
def test_all_meta_gives_shapes(op, build):
    """Every tensor on meta: the fake path alone, with the shapes of the CPU result."""
    args = build()
    expected = _call(op, _map_tensors(torch.clone, args))
    got = _call(op, _map_tensors(_meta, args))
    _assert_same_structure(got, expected)


def _assert_same_structure(got, expected):
    if isinstance(expected, (list, tuple)):
        assert isinstance(got, (list, tuple)) and len(got) == len(expected)
        for g, e in zip(got, expected):
            _assert_same_structure(g, e)
    elif isinstance(expected, torch.Tensor):
        assert got.device == META, got.device
        assert got.shape == expected.shape and got.dtype == expected.dtype, (got, expected)
    else:
        assert got is None and expected is None


@pytest.mark.parametrize("op, build, lam_name", [
    (OPS.mix_endpoints.default, _mix_args, "lam"),
    (OPS.mix_endpoints_with_stats.default, _mix_stats_args, "lam"),
    (OPS.weighted_sum.default, _weighted_sum_args, "weights"),
    (OPS.sgld_compose_step.default, _compose_args, "log_weights"),
    (OPS.ensemble_pseudo_labels.default, _pseudo_labels_args, "log_prior"),
    (OPS.private_sum.default, _private_sum_args, "coefficients"),
    (OPS.dequantize_weighted_sum.default, _dequantize_args, "weights"),
    (OPS.dequantize_int4_weighted_sum.default, _dequantize_int4_args, "weights"),
    (OPS.dequantize_fp8_weighted_sum.default, _dequantize_fp8_args, "weights"),
    (OPS.secagg_mask.default, _secagg_mask_args, "mask_seeds"),
    (OPS.secagg_unmask_sum.default, _secagg_unmask_args, "mask_seeds"),
    (OPS.sparse_weighted_sum.default, _sparse_args, "weights"),
])
def test_meta_parameters_with_host_side_argument_on_cpu(op, build, lam_name):
    """The small host-side argument may stay on the CPU when the rest is on meta (as on CUDA)."""
    args = build()
    meta_args = _map_tensors(_meta, {k: v for k, v in args.items() if k != lam_name})
    meta_args[lam_name] = args[lam_name]
    _call(op, {k: meta_args[k] for k in args})


# ---------------------------------------------------------------- empty parameter lists


def test_regularizers_of_an_empty_model_are_zero():
    for value in (
        fedkernels.cosine_orthogonality([], []),
        fedkernels.proximal_term([], [], mu=0.5),
        fedkernels.proximal_term([], [], mu=0.5, form="code"),
        fedkernels.superfed_regularizer([], [], [], nu=1.0, mu=0.5),
        fedkernels.superfed_regularizer([], None, [], nu=1.0, mu=0.5),
    ):
        assert value.shape == () and value.dtype == torch.float32 and float(value) == 0.0
    per_tensor = fedkernels.cosine_orthogonality([], [], per_tensor=True)
    assert per_tensor.shape == (0,) and per_tensor.dtype == torch.float32
    stats = mixing.superfed_stats([], [], [])
    assert stats.shape == (0, 4) and stats.dtype == torch.float64
    stats = mixing.superfed_stats([])
    assert stats.shape == (0, 4)


def test_empty_model_with_lam_and_mixing():
    lam = torch.tensor(0.25, dtype=torch.float64)
    assert fedkernels.mix_endpoints([], [], lam) == []
    theta, omega = fedkernels.superfed_mix([], [], lam, [], nu=1.0, mu=0.5)
    assert theta == [] and omega.shape == () and float(omega) == 0.0
    theta, stats = mixing.mix_endpoints_with_stats([], [], lam)
    assert theta == [] and stats.shape == (0, 4)
    # The empty model follows lam's device (meta here: the fake path).
    theta, stats = OPS.mix_endpoints_with_stats([], [], _meta(lam), [])
    assert theta == [] and stats.device == META and stats.shape == (0, 4)


def test_empty_lists_that_do_not_match_are_errors():
    g, l, a = _superfed_lists()
    with pytest.raises(ValueError, match="local_params has 3 tensors, global_params has 0"):
        mixing.superfed_stats([], l)
    with pytest.raises(ValueError, match="anchor has 3 tensors, global_params has 0"):
        fedkernels.proximal_term([], a)
