"""What the ops that write into existing tensors (in place, ``out=``) promise autograd and the
caller: the written tensors' version counters advance, so a graph that saved one refuses to use
the overwritten values; a leaf that requires grad is never written with grad mode on; an input
that requires grad is refused rather than silently cut from the graph; an input that shares part
of the memory being written is refused instead of read half-overwritten."""

from __future__ import annotations

import pytest
import torch

import fedkernels as fk
from fedkernels.ops import robust as robust_ops
from fedkernels.ops import summation

_ops = torch.ops.fedkernels


def _writers():
    """(name, fn(target)) for every op that writes into `target`, a float32 tensor of 6."""
    clients = [torch.randn(6) for _ in range(3)]
    flat = [torch.randn(6) for _ in range(3)]
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    sparse = [fk.sparsify_topk(c, 2) for c in clients[:2]]
    return [
        ("aggregate base=out", lambda t: fk.aggregate(clients, [1.0, 2.0, 3.0], base=t, out=t)),
        ("aggregate out", lambda t: fk.aggregate(clients, [1.0, 2.0, 3.0], out=t)),
        ("weighted_sum_", lambda t: summation.weighted_sum_([t], flat, w, 1.0, False)),
        ("weighted_sum.out", lambda t: summation.weighted_sum_out(flat, w, [], 1.0, False, [t])),
        ("sgld_step_", lambda t: fk.sgld_step_(t, torch.ones(6), step_size=0.1, noise_std=0.0)),
        ("sgld_compose_step inplace", lambda t: fk.sgld_compose_step(
            t.view(2, 3), torch.ones(2, 2, 3), torch.zeros(2, 2), torch.zeros(2),
            step_size=0.1, noise_std=0.0, inplace=True)),
        ("coordinate_median out", lambda t: fk.coordinate_median(clients, out=t)),
        ("trimmed_mean out", lambda t: fk.trimmed_mean(clients, 0.2, out=t)),
        ("median_window_mean.out", lambda t: robust_ops.median_window_mean(flat, 3, 1, [t])),
        ("private_aggregate out", lambda t: fk.private_aggregate(
            clients, base=torch.zeros(6), clip_norm=1.0, noise_std=0.0, out=t)),
        ("private_sum_", lambda t: _ops.private_sum_([t], flat, w.float(), 0.0, None)),
        # quantized updates: the server's sum into out=, in each format
        ("aggregate_quantized int8 out", lambda t: fk.aggregate_quantized(
            [fk.quantize_int8(c, 2) for c in clients], w, out=[t])),
        ("aggregate_quantized int4 out", lambda t: fk.aggregate_quantized(
            [fk.quantize_int4(c, 2) for c in clients], w, out=[t])),
        ("aggregate_quantized fp8 out", lambda t: fk.aggregate_quantized(
            [fk.quantize_fp8(c) for c in clients], w, out=[t])),
        # sparse updates
        ("aggregate_sparse_", lambda t: fk.aggregate_sparse_([t], sparse, [0.5, 0.5])),
        ("aggregate_sparse out", lambda t: fk.aggregate_sparse(sparse, [0.5, 0.5], out=[t])),
    ]


WRITERS = [name for name, _ in _writers()]


def _writer(name):
    return dict(_writers())[name]


@pytest.mark.parametrize("name", WRITERS)
def test_a_write_advances_the_version_counter(name):
    t = torch.zeros(6)
    before = t._version
    _writer(name)(t)
    assert t._version > before


@pytest.mark.parametrize("name", WRITERS)
def test_backward_refuses_values_overwritten_after_they_were_saved(name):
    p = torch.nn.Parameter(torch.randn(6))
    loss = (p * p).sum()  # saves p
    with torch.no_grad():
        _writer(name)(p)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


@pytest.mark.parametrize("name", WRITERS)
def test_a_leaf_that_requires_grad_is_written_only_under_no_grad(name):
    p = torch.nn.Parameter(torch.zeros(6))
    with pytest.raises(RuntimeError, match="requires grad"):  # the leaf, or a view of it
        _writer(name)(p)
    assert torch.equal(p.detach(), torch.zeros(6))
    with torch.no_grad():
        _writer(name)(p)  # the usual way to write parameters, as with PyTorch's own ops


def test_the_state_dict_idiom_protects_a_saved_graph():
    model = torch.nn.Linear(3, 1, bias=False)
    loss = (model.weight * model.weight).sum()
    sd = model.state_dict()  # detached tensors sharing the parameters' memory and versions
    fk.aggregate([{"weight": torch.zeros(1, 3)}, {"weight": torch.ones(1, 3)}], [0.5, 0.5],
                 base=sd, out=sd)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        loss.backward()


def test_aggregate_names_the_out_leaf_or_the_base_that_requires_grad():
    # The op refuses them before writing; aggregate names the tensor only after that refusal.
    clients = [{"a": torch.randn(2), "w": torch.randn(3)} for _ in range(2)]
    leaf = {"a": torch.zeros(2), "w": torch.nn.Parameter(torch.zeros(3))}
    with pytest.raises(RuntimeError, match=r"out tensor 'w' is a leaf that requires grad"):
        fk.aggregate(clients, [1.0, 1.0], out=leaf)
    assert torch.equal(leaf["a"], torch.zeros(2))
    base = {"a": torch.zeros(2), "w": torch.zeros(3, requires_grad=True) * 1.0}
    out = {"a": torch.zeros(2), "w": torch.zeros(3)}
    with pytest.raises(RuntimeError, match=r"base tensor 'w' requires grad"):
        fk.aggregate(clients, [1.0, 1.0], base=base, out=out)
    assert torch.equal(out["a"], torch.zeros(2))


def test_out_refuses_inputs_that_require_grad_and_names_them():
    clients = [{"w": torch.randn(3)}, {"w": torch.randn(3, requires_grad=True)}]
    out = {"w": torch.zeros(3)}
    with pytest.raises(RuntimeError, match=r"client 1, tensor 'w' requires grad.*without out="):
        fk.aggregate(clients, [1.0, 1.0], out=out)
    assert torch.equal(out["w"], torch.zeros(3))
    with torch.no_grad():
        fk.aggregate(clients, [1.0, 1.0], out=out)
    assert torch.allclose(out["w"], clients[0]["w"] + clients[1]["w"].detach())
    # Without out= the result is differentiable.
    r = fk.aggregate(clients, [1.0, 1.0])
    r["w"].sum().backward()
    assert torch.equal(clients[1]["w"].grad, torch.ones(3))


def test_native_out_ops_refuse_inputs_that_require_grad():
    x = torch.randn(4, requires_grad=True)
    with pytest.raises(RuntimeError, match=r"weighted_sum\.out: updates\[0\] requires grad"):
        summation.weighted_sum_out([x], torch.ones(1), [], 1.0, False, [torch.zeros(4)])
    with pytest.raises(RuntimeError, match=r"sgld_step_: grad requires grad"):
        fk.sgld_step_(torch.zeros(4), x, step_size=0.1, noise_std=0.0)


def test_accumulator_reads_updates_as_values():
    p = torch.randn(3, requires_grad=True)
    acc = fk.Accumulator()
    acc.add([p], 2.0)
    r = acc.result()[0]
    assert not r.requires_grad
    assert torch.equal(r, 2.0 * p.detach())


def test_inference_mode_writes_without_version_counters():
    with torch.inference_mode():
        t = torch.zeros(6)
        fk.aggregate([torch.ones(6)] * 2, [1.0, 1.0], base=t, out=t)
    assert torch.equal(t, torch.full((6,), 2.0))


# ---------------------------------------------------------------- overlap


def _writers_2d():
    """(name, fn(target)) for ops that write a [2, 3] float32 target."""
    clients = [torch.randn(2, 3) for _ in range(3)]
    w = torch.tensor([0.2, 0.3, 0.5], dtype=torch.float64)
    return [
        ("aggregate out", lambda t: fk.aggregate(clients, [1.0, 2.0, 3.0], out=t)),
        ("weighted_sum_", lambda t: summation.weighted_sum_([t], clients, w, 1.0, False)),
        ("sgld_step_", lambda t: fk.sgld_step_(t, torch.ones(2, 3), step_size=0.1,
                                               noise_std=0.0)),
        ("trimmed_mean out", lambda t: fk.trimmed_mean(clients, 0.2, out=t)),
        ("private_sum_", lambda t: _ops.private_sum_([t], clients, w.float(), 0.0, None)),
    ]


@pytest.mark.parametrize("name", [name for name, _ in _writers_2d()])
def test_a_target_whose_rows_overlap_is_refused(name):
    # Rows of 3 elements 1 apart share 2 elements: torch's own check answers "too hard" for
    # such a view (only a zero stride is a sure overlap), and the ops wrote it with no error.
    buf = torch.zeros(8)
    target = buf.as_strided((2, 3), (1, 1))
    with pytest.raises(ValueError, match="share memory"):
        dict(_writers_2d())[name](target)
    assert torch.equal(buf, torch.zeros(8))


@pytest.mark.parametrize("name", [name for name, _ in _writers_2d()])
def test_a_strided_target_that_overlaps_nothing_is_written(name):
    # Every other column of a [2, 6] buffer: not dense, but no two elements share memory.
    torch.manual_seed(0)
    dense = torch.zeros(2, 3)
    dict(_writers_2d())[name](dense)
    torch.manual_seed(0)
    buf = torch.full((2, 6), 7.0)
    buf[:, ::2] = 0.0  # the in-place ops add to their target
    dict(_writers_2d())[name](buf[:, ::2])
    assert torch.equal(buf[:, ::2], dense)
    assert torch.equal(buf[:, 1::2], torch.full((2, 3), 7.0))


def test_sgld_step_refuses_a_grad_sharing_part_of_x():
    buf = torch.randn(40)
    x, grad = buf[8:40], buf[0:32]
    before = buf.clone()
    with pytest.raises(ValueError, match="grad shares part of x's memory"):
        fk.sgld_step_(x, grad, step_size=0.5, noise_std=0.0)
    assert torch.equal(buf, before)


def test_sgld_step_refuses_noise_sharing_part_of_x():
    buf = torch.randn(40)
    with pytest.raises(ValueError, match="noise shares part of x's memory"):
        fk.sgld_step_(buf[8:40], torch.zeros(32), step_size=0.0, noise_std=1.0, noise=buf[0:32])


def test_sgld_compose_step_refuses_grads_sharing_part_of_x():
    buf = torch.randn(2 * 16 + 8)
    grads, x = buf[:32].view(2, 16), buf[8:24]
    with pytest.raises(ValueError, match="grads shares part of x's memory"):
        fk.sgld_compose_step(x, grads, torch.zeros(2, 16), torch.zeros(2), step_size=0.5,
                             noise_std=0.0, inplace=True)


def test_sgld_step_with_grad_the_same_memory_as_x_is_exact():
    x = torch.randn(100)
    expected = x - 0.5 * x
    fk.sgld_step_(x, x, step_size=0.5, noise_std=0.0)
    assert torch.equal(x, expected)


def test_sgld_out_of_place_accepts_overlapping_inputs():
    buf = torch.randn(40)
    x, grad = buf[8:40], buf[0:32]
    expected = x - 0.5 * grad
    assert torch.equal(fk.sgld_step(x, grad, step_size=0.5, noise_std=0.0), expected)


def _two_views(buffer: bytearray, dtype=torch.float32):
    """Two tensors over one buffer, each with a storage of its own (as two torch.frombuffer or
    from_numpy calls give): the same memory without a shared storage."""
    return torch.frombuffer(buffer, dtype=dtype), torch.frombuffer(buffer, dtype=dtype)


def test_sgld_step_refuses_a_grad_over_the_same_buffer_through_another_storage():
    a, b = _two_views(bytearray(40 * 4))
    a.copy_(torch.randn(40))
    before = a.clone()
    with pytest.raises(ValueError, match="grad shares part of x's memory"):
        fk.sgld_step_(a[8:40], b[0:32], step_size=0.5, noise_std=0.0)
    assert torch.equal(a, before)


def test_out_aliasing_a_client_through_another_storage_is_refused():
    a, b = _two_views(bytearray(12 * 4))
    clients = [a[0:6], torch.randn(6)]
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match="out tensor 0 overlaps client 0, tensor 0"):
        summation.weighted_sum_out(clients, w, [], 1.0, False, [b[3:9]])
    with pytest.raises(ValueError, match="out tensor 0 overlaps client 0, tensor 0"):
        robust_ops.coordinate_median(clients, 2, [b[3:9]])


def test_superfed_step_refuses_endpoints_that_are_one_strided_view():
    # Two views of the same every-other column: not dense, so torch's overlap test cannot tell,
    # and the step would update the elements twice.
    buf = torch.randn(3, 8)
    g, l = [buf[:, ::2]], [buf[:, ::2]]
    before = buf.clone()
    with pytest.raises(ValueError, match="global_params tensor 0 overlaps local_params tensor 0"):
        _ops.superfed_sgd_step_(g, l, [], [], [torch.randn(3, 4)],
                                torch.zeros(1, 4, dtype=torch.float64),
                                torch.tensor([0.5], dtype=torch.float64), [], 0.1, 0.0, 0.0, 0.0,
                                False, [False, False])
    assert torch.equal(buf, before)


def test_an_overlap_error_names_the_first_output_and_input_in_list_order():
    # Client 1's tensors lie in memory in the reverse of their order, and out is client 1: the
    # message names tensor 0 (the first in the list), not the lowest address.
    buf = torch.randn(10)
    updates = [torch.randn(5), torch.randn(5), buf[5:10], buf[0:5]]  # client-major, T = 2
    w = torch.tensor([0.5, 0.5], dtype=torch.float64)
    with pytest.raises(ValueError, match="out tensor 0 overlaps client 1, tensor 0;"):
        summation.weighted_sum_out(updates, w, [], 1.0, False, [updates[2], updates[3]])
    with pytest.raises(ValueError, match="out tensor 0 overlaps client 1, tensor 0;"):
        robust_ops.coordinate_median(updates, 2, [updates[2], updates[3]])


def test_krum_refuses_an_out_that_is_a_client():
    clients = [torch.randn(5) for _ in range(6)]
    kept = [c.clone() for c in clients]
    for m in (1, 3):
        with pytest.raises(ValueError, match="fedkernels.krum: out tensor 0 overlaps client 4"):
            fk.krum(clients, 1, m, out=clients[4])
        with pytest.raises(ValueError, match="overlaps client 2"):
            fk.krum([{"a": c} for c in clients], 1, m, out={"a": clients[2][:]})
    assert all(torch.equal(c, k) for c, k in zip(clients, kept))


# ---------------------------------------------------------------- accumulate range


def test_weights_beyond_float32_are_refused_by_the_op_itself():
    x = [torch.ones(4), torch.ones(4)]
    w = torch.tensor([1e39, 1.0], dtype=torch.float64)
    with pytest.raises(ValueError, match="weight of client 0 is 1e\\+39, beyond the float32"):
        summation.weighted_sum(x, w, [], 1.0, False)
    # float64 tensors accumulate in float64, where the weight is fine.
    r = summation.weighted_sum([t.double() for t in x], w, [], 1.0, False)
    assert torch.equal(r[0], torch.full((4,), 1e39 + 1.0, dtype=torch.float64))


@pytest.mark.parametrize("scale", [float("inf"), float("nan"), 1e39])
def test_a_scale_beyond_float32_is_refused_by_the_op(scale):
    with pytest.raises(ValueError, match="scale is"):
        summation.weighted_sum([torch.ones(4)], torch.ones(1), [], scale, False)


def test_compiled_aggregate_keeps_the_weight_range_check():
    f = torch.compile(lambda a, b, w: fk.aggregate([a, b], w), fullgraph=True, backend="eager")
    w = torch.tensor([1e39, 1.0], dtype=torch.float64)
    with pytest.raises(Exception, match="beyond the float32 range"):
        f(torch.ones(4), torch.ones(4), w)


# ---------------------------------------------------------------- messages


def test_a_bare_tensor_model_is_tensor_0_in_messages():
    with pytest.raises(ValueError, match=r"client 0 \(tensors 0\)"):
        fk.aggregate([torch.tensor([float("nan")]), torch.ones(1)], [1.0, 1.0], check_finite=True)


def test_weights_beyond_float64_are_refused_naming_the_client():
    xs = [torch.ones(2), torch.ones(2)]
    with pytest.raises(ValueError, match="weight of client 1 is an integer beyond the float64"):
        fk.aggregate(xs, [1, 10**400])


@pytest.mark.parametrize("weight, kind, match", [
    (float("nan"), ValueError, "the weight of update 1 is nan"),
    (torch.tensor([1.0, 2.0]), ValueError, "must be one number, got a tensor of shape"),
    ([1.0], TypeError, "must be a real number, got list"),
    (True, TypeError, "must be a real number, got bool"),
    (10**400, ValueError, "beyond the float64 range"),
])
def test_accumulator_weight_errors_name_the_accumulator_and_the_update(weight, kind, match):
    acc = fk.Accumulator()
    acc.add([torch.ones(2)], 1.0)
    with pytest.raises(kind, match=match) as err:
        acc.add([torch.ones(2)], weight)
    assert str(err.value).startswith("fedkernels.Accumulator:")
    assert acc.count == 1


def test_robust_rules_name_themselves_in_layout_errors():
    with pytest.raises(TypeError, match="^fedkernels.coordinate_median: client 0 has unsupported"):
        fk.coordinate_median([torch.randn(2, dtype=torch.cfloat)] * 2)


# ---------------------------------------------------------------- tied weights


class _Tied(torch.nn.Module):
    """An embedding shared with the output layer: the state_dict holds it under two keys."""

    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(7, 4)
        self.norm = torch.nn.BatchNorm1d(4)
        self.head = torch.nn.Linear(4, 7, bias=False)
        self.head.weight = self.emb.weight


def _tied_clients(tie: str):
    torch.manual_seed(0)
    clients = []
    for _ in range(3):
        sd = {n: t.clone() for n, t in _Tied().state_dict().items()}
        if tie == "shared":
            sd["head.weight"] = sd["emb.weight"]
        elif tie == "copied":  # as after serialisation: equal values, separate memory
            sd["head.weight"] = sd["emb.weight"].clone()
        clients.append(sd)
    return clients


@pytest.mark.parametrize("tie", ["shared", "copied"])
def test_in_place_aggregation_of_a_model_with_tied_weights(tie):
    model = _Tied()
    sd = model.state_dict()
    clients = _tied_clients(tie)
    expected = fk.aggregate(clients, [1.0, 2.0, 3.0], base=sd)
    fk.aggregate(clients, [1.0, 2.0, 3.0], base=sd, out=sd)
    assert model.head.weight is model.emb.weight
    for name, t in sd.items():
        assert torch.equal(t, expected[name]), name
    out = {n: torch.empty_like(t) for n, t in expected.items()}
    out["head.weight"] = out["emb.weight"]
    fk.aggregate(clients, [1.0, 2.0, 3.0], out=out)
    assert torch.equal(out["head.weight"], fk.aggregate(clients, [1.0, 2.0, 3.0])["emb.weight"])


def test_tied_outputs_refuse_clients_that_disagree_under_the_tied_keys():
    model = _Tied()
    sd = model.state_dict()
    before = {n: t.clone() for n, t in sd.items()}
    clients = _tied_clients("copied")
    clients[2]["head.weight"] = clients[2]["head.weight"] + 1.0
    with pytest.raises(ValueError, match="'emb.weight' and 'head.weight' are one tensor.*client 2"):
        fk.aggregate(clients, [1.0, 2.0, 3.0], base=sd, out=sd)
    assert all(torch.equal(sd[n], before[n]) for n in sd)
