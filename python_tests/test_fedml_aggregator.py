"""fedkernels.integrations.fedml side by side with FedML's own ``FedMLAggOperator.agg`` (when the
fedml 0.9.6 wheel's files are installed) and against the formulas in float64 (always).

``import fedml`` runs FedML's ``__init__``, which imports many packages this suite does not
install; ``bench/harness/fedml_files.py`` (shared with ``bench/bench_fedml.py``) loads only the two
files the aggregation needs (``core/common/ml_engine_backend.py`` and
``ml/aggregator/agg_operator.py``) under their own module names, below empty parent packages,
and removes them again after the module's tests.
Every call gets its own deep copy of the inputs, since both FedML and the drop-in write into
client 0's dict (and, for the plain sums, into its tensors).
"""

from __future__ import annotations

import copy
import subprocess
import sys
import warnings
from collections import OrderedDict
from pathlib import Path

import numpy as np
import pytest
import torch
from conftest import DEVICES

import fedkernels.integrations.fedml as drop_in
from fedkernels.integrations.fedml import FedMLAggOperator, Installed, agg, install

from harness import fedml_files  # bench/harness/: the benchmark of FedML uses it too


@pytest.fixture(scope="module")
def fedml_agg():
    """FedML's ``agg_operator`` module, loaded from the wheel's files without ``fedml/__init__``,
    and registered in ``sys.modules`` (where the drop-in's lazy import finds it)."""
    root = fedml_files.fedml_root()
    if root is None:
        pytest.skip(fedml_files.MISSING)
    with fedml_files.loaded(root) as module:
        yield module


class Args:
    def __init__(self, optimizer, **kw):
        self.federated_optimizer = optimizer
        self.__dict__.update(kw)


def model(seed, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g).to(dtype)  # noqa: E731
    return OrderedDict([
        ("conv.weight", r(8, 3, 3, 3)),
        ("conv.bias", r(8)),
        ("bn.weight", r(8)),
        ("bn.running_mean", r(8)),
        ("bn.num_batches_tracked", torch.tensor(seed + 3, dtype=torch.int64)),
        ("fc.weight", r(10, 64)),
        ("fc.bias", r(10)),
    ])


COUNTS = {
    "int": lambda k: [50 + 17 * i for i in range(k)],
    "float": lambda k: [0.5 + 1.25 * i for i in range(k)],
    "numpy int": lambda k: list(np.arange(3, 3 + 2 * k, 2, dtype=np.int64)),
    "mixed": lambda k: [[7, 2.5, np.int32(4), np.float64(1.5)][i % 4] for i in range(k)],
}


def pairs(k, dtype, counts="int"):
    return [(n, model(i, dtype)) for i, n in enumerate(COUNTS[counts](k))]


def both(fedml_agg, args, raw):
    """FedML's and our results, each on its own deep copy, the copies handed in, and the
    tensors our copy's dicts held before the call."""
    theirs_in, ours_in = copy.deepcopy(raw), copy.deepcopy(raw)
    held = [[dict(d) if isinstance(d, dict) else list(d) for d in entry[1:]] for entry in ours_in]
    theirs = fedml_agg.FedMLAggOperator.agg(args, theirs_in)
    ours = FedMLAggOperator.agg(args, ours_in)
    return theirs, ours, theirs_in, ours_in, held


def reference(raw, key, mean, index=1):
    """The formula in float64."""
    counts = [float(e[0]) for e in raw]
    total = sum(counts)
    out = 0
    for n, e in zip(counts, raw):
        out = out + e[index][key].double() * (n / total if mean else 1.0)
    return out


def assert_close_to(ours, theirs, ref, k):
    """Float entries: ours within a rounding of the float64 formula (a few for sums of many
    terms), and within K roundings of FedML's, which rounds every step in the tensor's dtype."""
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    if not ours.is_floating_point():
        assert torch.equal(ours, theirs)
        return
    eps = torch.finfo(ours.dtype).eps
    scale = max(ref.abs().max().item(), 1.0)
    torch.testing.assert_close(ours.double(), ref, rtol=0, atol=4 * eps * scale)
    torch.testing.assert_close(ours.double(), theirs.double(), rtol=0,
                               atol=(2 * k + 4) * eps * scale)


DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16]


@pytest.mark.parametrize("counts", sorted(COUNTS))
@pytest.mark.parametrize("k", [1, 2, 10])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
@pytest.mark.parametrize("optimizer", ["FedAvg", "FedProx", "FedAvg_seq", "FedDyn"])
def test_same_as_fedml(fedml_agg, optimizer, dtype, k, counts):
    raw = pairs(k, dtype, counts)
    args = Args(optimizer, ml_engine="torch")
    theirs, ours, theirs_in, ours_in, held = both(fedml_agg, args, raw)
    mean = optimizer in ("FedAvg", "FedProx")
    # FedML's result object: client 0's dict, client 0's key order.
    assert ours is ours_in[0][1] and theirs is theirs_in[0][1]
    assert list(ours) == list(theirs) == list(raw[0][1])
    for key in raw[0][1]:
        assert_close_to(ours[key], theirs[key], reference(raw, key, mean), k)
    nbt = "bn.num_batches_tracked"
    assert ours[nbt].dtype == (torch.get_default_dtype() if mean else torch.int64)
    assert torch.equal(ours[nbt], theirs[nbt])  # the same arithmetic as FedML's, exactly
    for i in range(k):
        for key, before in raw[i][1].items():
            t = held[i][0][key]
            if mean or i > 0:  # the clients' tensors are left as they were
                assert torch.equal(t, before)
            if i > 0:
                assert ours_in[i][1][key] is t
    for key in raw[0][1]:
        if mean:  # new tensors in client 0's dict
            assert ours[key] is not held[0][0][key]
        else:  # FedML's += : client 0's own tensors hold the sums (unchanged for K = 1)
            assert ours[key] is held[0][0][key]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("optimizer", ["FedAvg", "FedAvg_seq", "Mime"])
def test_one_fused_call(fedml_agg, monkeypatch, optimizer, device):
    """All float entries of all clients (both dicts for Mime) go through one fused call; only
    the integer buffer takes FedML's arithmetic."""
    calls = []
    for name, fn in (("aggregate", drop_in.aggregate),
                     ("weighted_sum_", drop_in.summation.weighted_sum_)):
        def spy(*a, _fn=fn, _name=name, **kw):
            calls.append(_name)
            return _fn(*a, **kw)
        if name == "aggregate":
            monkeypatch.setattr(drop_in, "aggregate", spy)
        else:
            monkeypatch.setattr(drop_in.summation, "weighted_sum_", spy)
    to = lambda m: OrderedDict((key, t.to(device)) for key, t in m.items())  # noqa: E731
    if optimizer == "Mime":
        raw = [(n, to(model(i)), to(model(10 + i))) for i, n in enumerate([3, 4, 5])]
    else:
        raw = [(n, to(model(i))) for i, n in enumerate([3, 4, 5])]
    args = Args(optimizer, client_num_per_round=3)
    theirs, ours, *_ = both(fedml_agg, args, raw)
    assert calls == ["weighted_sum_" if optimizer == "FedAvg_seq" else "aggregate"]
    for side in ((0, 1) if optimizer == "Mime" else (None,)):
        o = ours if side is None else ours[side]
        t = theirs if side is None else theirs[side]
        for key in o:
            assert o[key].device == t[key].device and o[key].dtype == t[key].dtype
            torch.testing.assert_close(o[key], t[key], rtol=1e-5, atol=1e-5)


def test_same_dict_twice_follows_fedmls_in_place_adds(fedml_agg):
    """FedAvg_seq with one dict for two clients: FedML's x += x doubles it; the fused in-place
    op refuses the overlap before writing, and FedML's arithmetic runs instead."""
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        m = model(0)
        expected = {key: 2 * t for key, t in m.items()}
        result = fn(Args("FedAvg_seq"), [(1, m), (1, m)])
        assert all(torch.equal(result[key], expected[key]) for key in m)


def test_plain_sums_write_into_client_0s_tensors(fedml_agg):
    raw = pairs(3, torch.float32)
    args = Args("FedAvg_seq")
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        data = copy.deepcopy(raw)
        tensors0 = dict(data[0][1])
        others = [copy.deepcopy(d[1]) for d in data[1:]]
        result = fn(args, data)
        for key, t in tensors0.items():
            assert result[key] is t  # the same tensor object, now the sum
            expected = raw[0][1][key] + raw[1][1][key] + raw[2][1][key]
            torch.testing.assert_close(t, expected, rtol=1e-6, atol=1e-6)
        for d, o in zip(data[1:], others):
            assert all(torch.equal(d[1][key], o[key]) for key in o)


@pytest.mark.parametrize("k", [1, 2, 10])
@pytest.mark.parametrize("dtype", DTYPES, ids=str)
def test_mime_same_as_fedml(fedml_agg, dtype, k):
    raw = []
    for i, n in enumerate(COUNTS["mixed"](k)):
        grads = model(100 + i, dtype)
        grads["only.in.grads"] = torch.full((3,), float(i))
        raw.append((n, model(i, dtype), grads))
    args = Args("Mime", client_num_per_round=k)
    theirs, ours, theirs_in, ours_in, held = both(fedml_agg, args, raw)
    assert isinstance(ours, tuple) and len(ours) == 2
    assert ours[0] is ours_in[0][1] and ours[1] is ours_in[0][2]
    for side in (0, 1):
        assert list(ours[side]) == list(theirs[side])
        for key in raw[0][1]:
            ref = reference(raw, key, True, index=side + 1)
            assert_close_to(ours[side][key], theirs[side][key], ref, k)
    # A key of the gradients that the model lacks is not aggregated (client 0's, as given).
    assert torch.equal(ours[1]["only.in.grads"], theirs[1]["only.in.grads"])
    assert ours[1]["only.in.grads"] is ours_in[0][2]["only.in.grads"]
    for i in range(k):  # the clients' tensors (client 0's included) are left as they were
        for index in (1, 2):
            for key, before in raw[i][index].items():
                assert torch.equal(held[i][index - 1][key], before)


def test_mime_client_count_assertion(fedml_agg):
    raw = [(n, model(i), model(10 + i)) for i, n in enumerate([3, 4, 5])]
    args = Args("Mime", client_num_per_round=4)
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        with pytest.raises(AssertionError):
            fn(args, copy.deepcopy(raw))


def test_delegated_to_fedml_give_fedmls_results(fedml_agg):
    # SCAFFOLD: FedML's peculiar result (the last client's delta, its control delta / total).
    raw = [(n, model(i), model(10 + i)) for i, n in enumerate([3, 4, 5])]
    args = Args("SCAFFOLD", client_num_in_total=7)
    theirs, ours, _, ours_in, _ = both(fedml_agg, args, raw)
    assert ours[0] is ours_in[0][1] and ours[1] is ours_in[0][2]
    for side in (0, 1):
        assert list(ours[side]) == list(theirs[side])
        for key in raw[0][1]:
            assert torch.equal(ours[side][key], theirs[side][key])
    torch.testing.assert_close(ours[1]["fc.weight"], raw[2][2]["fc.weight"] / 7)
    # FedOpt, FedNova and unknown names: FedML computes nothing and raises UnboundLocalError.
    for name in ("FedOpt", "FedNova", "NotAnOptimizer"):
        for fn in (fedml_agg.FedMLAggOperator.agg, agg):
            with pytest.raises(UnboundLocalError):
                fn(Args(name), pairs(2, torch.float32))
    # Another engine: FedML's function for it (tf: a list of arrays per client).
    raw = [(n, [np.full((2, 3), float(n)), np.arange(4.0) * n]) for n in (1, 2, 5)]
    theirs, ours, *_ = both(fedml_agg, Args("FedAvg", ml_engine="tf"), raw)
    assert all(np.array_equal(a, b) for a, b in zip(ours, theirs))


@pytest.mark.parametrize("optimizer", ["FedAvg", "FedAvg_seq"])
def test_mixed_entries_follow_fedmls_arithmetic(fedml_agg, optimizer):
    """Entries the fused op does not take as they are give FedML's result bit for bit: a
    client's float64 copy of a float32 entry, a tensor that broadcasts to client 0's shape,
    an int32 and a bool buffer, a Python float."""
    raw = pairs(3, torch.float32)
    raw[1][1]["fc.bias"] = raw[1][1]["fc.bias"].double()
    raw[2][1]["bn.weight"] = torch.tensor([0.25])
    for i, (_, m) in enumerate(raw):
        m["counter"] = torch.tensor([i, 2 * i], dtype=torch.int32)
        m["flag"] = torch.tensor([True, False])
        m["scalar"] = 1.5 * (i + 1)
    if optimizer == "FedAvg_seq":
        for _, m in raw:
            m.pop("flag")  # bool += bool is a logical or in torch, then the same on both
    theirs, ours, *_ = both(fedml_agg, Args(optimizer), raw)
    assert list(ours) == list(theirs)
    for key in ours:
        if key in ("fc.bias", "bn.weight", "counter", "flag", "scalar"):
            o, t = ours[key], theirs[key]
            assert (o == t) if key == "scalar" else (o.dtype == t.dtype and torch.equal(o, t))


def test_missing_key(fedml_agg):
    raw = pairs(3, torch.float32)
    del raw[2][1]["bn.weight"]
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        data = copy.deepcopy(raw)
        with pytest.raises(KeyError, match="bn.weight"):
            fn(Args("FedAvg"), data)
    # Ours raises before writing: client 0's dict still holds its own tensors.
    data = copy.deepcopy(raw)
    held = dict(data[0][1])
    with pytest.raises(KeyError):
        agg(Args("FedAvg"), data)
    assert all(data[0][1][key] is t for key, t in held.items())
    # Keys a later client has beyond client 0's are ignored, as FedML ignores them.
    raw = pairs(2, torch.float32)
    raw[1][1]["extra"] = torch.ones(3)
    theirs, ours, *_ = both(fedml_agg, Args("FedAvg"), raw)
    assert list(ours) == list(theirs) and "extra" not in ours


def test_zero_total(fedml_agg):
    raw = [(0, model(0)), (0, model(1))]
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        with pytest.raises(ZeroDivisionError):
            fn(Args("FedAvg"), copy.deepcopy(raw))
    # NumPy counts divide to NaN (with NumPy's warning) and give NaN entries on both sides.
    raw = [(np.int64(0), model(0)), (np.int64(0), model(1))]
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)
        theirs, ours, *_ = both(fedml_agg, Args("FedAvg"), raw)
    for key in ours:
        torch.testing.assert_close(ours[key], theirs[key], equal_nan=True, rtol=0, atol=0)
    # The plain sums ignore the counts.
    theirs, ours, *_ = both(fedml_agg, Args("FedAvg_seq"), [(0, model(0)), (0, model(1))])
    assert all(torch.equal(ours[key], theirs[key]) for key in ours)
    # An empty model divides nothing: client 0's empty dict back.
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        empty = OrderedDict()
        assert fn(Args("FedAvg"), [(0, empty), (0, OrderedDict())]) is empty


@pytest.mark.parametrize("optimizer", ["FedAvg", "FedAvg_seq", "Mime"])
def test_shape_mismatch(fedml_agg, optimizer):
    if optimizer == "Mime":
        raw = [(n, model(i), model(10 + i)) for i, n in enumerate([3, 4])]
        raw[1][2]["fc.weight"] = torch.randn(10, 65)
    else:
        raw = pairs(2, torch.float32)
        raw[1][1]["fc.weight"] = torch.randn(10, 65)
    args = Args(optimizer, client_num_per_round=2)
    with pytest.raises(RuntimeError):
        fedml_agg.FedMLAggOperator.agg(args, copy.deepcopy(raw))
    data = copy.deepcopy(raw)
    held = dict(data[0][1])
    with pytest.raises(RuntimeError, match=r"client 1's tensor 'fc.weight' has shape \(10, 65\)"):
        agg(args, data)
    assert all(data[0][1][key] is t for key, t in held.items())
    assert all(torch.equal(t, raw[0][1][key]) for key, t in held.items())


def test_malformed_lists(fedml_agg):
    for fn in (fedml_agg.FedMLAggOperator.agg, agg):
        with pytest.raises(IndexError):
            fn(Args("FedAvg"), [])
        with pytest.raises(ValueError):  # pairs where Mime expects triples
            fn(Args("Mime", client_num_per_round=2), pairs(2, torch.float32))
        with pytest.raises(ValueError):  # triples where FedAvg expects pairs
            fn(Args("FedAvg"), [(1, model(0), model(1))])


def test_install_and_undo(fedml_agg):
    cls = fedml_agg.FedMLAggOperator
    original = cls.__dict__["agg"]
    handle = install()
    try:
        assert isinstance(handle, Installed) and handle.active
        assert cls.agg is agg  # what ServerAggregator and the trainers look up on the class
        raw = pairs(3, torch.float32)
        data = copy.deepcopy(raw)
        assert cls.agg(Args("FedAvg"), data) is data[0][1]
        # Cases it hands to FedML still reach FedML's original code (no recursion).
        result = cls.agg(Args("SCAFFOLD", client_num_in_total=3),
                         [(n, model(i), model(10 + i)) for i, n in enumerate([1, 2])])
        assert isinstance(result, tuple)
    finally:
        handle()
    assert cls.__dict__["agg"] is original and not handle.active
    handle.undo()  # undoing twice is a no-op
    assert cls.__dict__["agg"] is original
    with install(cls) as h:
        assert cls.agg is agg and h.active
    assert cls.__dict__["agg"] is original


def test_install_refuses_a_class_without_agg():
    class NotFedML:
        pass

    with pytest.raises(TypeError, match="no agg"):
        install(NotFedML)


def test_clear_import_error_without_fedml(monkeypatch):
    monkeypatch.setitem(sys.modules, "fedml.ml.aggregator.agg_operator", None)
    with pytest.raises(ImportError, match="pip install fedml"):
        agg(Args("FedOpt"), pairs(2, torch.float32))
    with pytest.raises(ImportError, match="install"):
        install()
    # The fused cases need no FedML.
    raw = pairs(3, torch.float64, "float")
    out = agg(Args("FedAvg"), copy.deepcopy(raw))
    for key in raw[0][1]:
        torch.testing.assert_close(out[key].double(), reference(raw, key, True))
    out = agg(Args("Mime", client_num_per_round=2),
              [(1, model(0), model(1)), (3, model(2), model(3))])
    assert isinstance(out, tuple)


@pytest.mark.slow
def test_module_import_does_not_import_fedml():
    code = ("import sys, fedkernels.integrations.fedml; "
            "assert 'fedml' not in sys.modules, sorted(m for m in sys.modules if 'fedml' in m)")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=300)



def test_docs_example_runs_without_fedml(monkeypatch):
    """The first example of docs/guide/integrations.md's FedML section, which needs no FedML."""
    monkeypatch.setitem(sys.modules, "fedml.ml.aggregator.agg_operator", None)
    text = (Path(__file__).resolve().parents[1] / "docs" / "guide" / "integrations.md").read_text()
    section = text[text.index("## FedML"):]
    code = section[section.index("```python\n") + 10:]
    code = code[:code.index("```")]
    scope: dict = {}
    exec(compile(code, "docs/guide/integrations.md (FedML)", "exec"), scope)
    state = scope["global_state"]
    assert list(state) == ["weight", "bias", "num_batches_tracked"]
    assert state["num_batches_tracked"].dtype == torch.get_default_dtype()


def test_plain_sum_with_a_client_that_requires_grad(fedml_agg):
    """FedAvg_seq adds a client tensor that requires grad into client 0's: FedML's += records
    it in autograd, and so does the drop-in (it takes FedML's arithmetic for that entry)."""
    raw = pairs(2, torch.float32)
    raw[1][1]["fc.bias"].requires_grad_(True)
    theirs, ours, *_ = both(fedml_agg, Args("FedAvg_seq"), raw)
    assert ours["fc.bias"].requires_grad and theirs["fc.bias"].requires_grad
    assert torch.equal(ours["fc.bias"].detach(), theirs["fc.bias"].detach())
    assert all(torch.equal(ours[key], theirs[key]) for key in ours if key != "fc.bias")
