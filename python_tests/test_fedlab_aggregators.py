"""fedkernels.integrations.fedlab against FedLab's own ``Aggregators`` (when fedlab is installed)
and against the FedAvg / FedAsync formulas in float64 (always)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fedkernels.integrations.fedlab import Aggregators, WeightError, fedasync_aggregate, fedavg_aggregate


def _fedlab():
    return pytest.importorskip(
        "fedlab.utils.aggregator",
        reason="fedlab is not installed (pip install --no-deps fedlab, see docs/guide/integrations.md)",
    ).Aggregators


def vectors(k, p, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(p, generator=g).to(dtype) for _ in range(k)]


WEIGHTS = {
    "none": None,
    "int list": lambda k: list(range(1, k + 1)),
    "float list": lambda k: [0.5 + i for i in range(k)],
    "numpy float64": lambda k: np.linspace(1.0, 2.0, k),
    "tensor float32": lambda k: torch.linspace(0.1, 1.0, k),
    "tensor float64": lambda k: torch.linspace(0.1, 1.0, k, dtype=torch.float64),
    "one zero": lambda k: [0.0] + [1.0] * (k - 1),
}


def make_weights(name, k):
    w = WEIGHTS[name]
    return None if w is None else w(k)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
@pytest.mark.parametrize("k", [1, 3, 10])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16, torch.bfloat16])
def test_fedavg_same_as_fedlab(name, k, dtype):
    FedLab = _fedlab()
    xs = vectors(k, 1000, dtype)
    if name == "one zero" and k == 1:  # 0 / 0: FedLab's assert, our WeightError (one of them)
        with pytest.raises(AssertionError):
            FedLab.fedavg_aggregate(xs, make_weights(name, k))
        with pytest.raises(AssertionError):
            Aggregators.fedavg_aggregate(xs, make_weights(name, k))
        return
    theirs = FedLab.fedavg_aggregate(xs, make_weights(name, k))
    ours = Aggregators.fedavg_aggregate(xs, make_weights(name, k))
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    half = dtype in (torch.float16, torch.bfloat16)
    tol = 1e-2 if half and theirs.dtype == dtype else 1e-5 if dtype != torch.float64 else 1e-12
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


@pytest.mark.parametrize("name", sorted(WEIGHTS))
def test_fedavg_formula(name):
    k, p = 7, 5000
    xs = vectors(k, p, torch.float32, seed=1)
    w = make_weights(name, k)
    w64 = np.ones(k) if w is None else np.asarray(w.tolist() if torch.is_tensor(w) else w, np.float64)
    expected = sum((w64[i] / w64.sum()) * xs[i].double() for i in range(k))
    ours = fedavg_aggregate(xs, w)
    torch.testing.assert_close(ours.double(), expected, rtol=1e-5, atol=1e-6)


def test_fedavg_k_by_p_tensor_and_multi_dim_vectors():
    xs = vectors(5, 300)
    w = [3, 1, 4, 1, 5]
    torch.testing.assert_close(fedavg_aggregate(torch.stack(xs), w), fedavg_aggregate(xs, w))
    shaped = [x.reshape(10, 30) for x in xs]
    out = fedavg_aggregate(shaped, w)
    assert out.shape == (10, 30)
    torch.testing.assert_close(out.reshape(-1), fedavg_aggregate(xs, w))


def test_fedavg_does_not_touch_inputs():
    xs = vectors(4, 100)
    copies = [x.clone() for x in xs]
    fedavg_aggregate(xs, [1, 2, 3, 4])
    for x, c in zip(xs, copies):
        assert torch.equal(x, c)


@pytest.mark.parametrize("weights", [[1.0, -1.0, 2.0], [0.0, 0.0, 0.0]])
def test_bad_weights_raise_fedlabs_assertion_and_a_value_error(weights):
    xs = vectors(3, 10)
    with pytest.raises(WeightError, match="non-negative"):
        fedavg_aggregate(xs, weights)
    for exc in (AssertionError, ValueError):
        with pytest.raises(exc):
            fedavg_aggregate(xs, weights)
    try:
        FedLab = _fedlab()
    except pytest.skip.Exception:
        return
    with pytest.raises(AssertionError):
        FedLab.fedavg_aggregate(xs, weights)


def test_clear_errors():
    xs = vectors(3, 10)
    with pytest.raises(ValueError, match="empty"):
        fedavg_aggregate([])
    with pytest.raises(ValueError, match="client 2 has shape"):
        fedavg_aggregate(xs[:2] + [torch.zeros(11)])
    with pytest.raises(ValueError, match="3 clients but weights of shape"):
        fedavg_aggregate(xs, [1.0, 2.0])
    with pytest.raises(TypeError, match="client 1 is a ndarray"):
        fedavg_aggregate([xs[0], np.zeros(10)])
    with pytest.raises(ValueError, match="2-D"):
        fedavg_aggregate(torch.zeros(2, 3, 4))
    with pytest.raises(ValueError, match="new_param has shape"):
        fedasync_aggregate(xs[0], torch.zeros(5), 0.5)


def test_integer_and_mixed_vectors_follow_fedlabs_formula():
    ints = [torch.arange(6), torch.arange(6) * 3]
    mixed = [torch.ones(6), torch.ones(6, dtype=torch.float64) * 3]
    for xs in (ints, mixed):
        expected = torch.sum(torch.stack(xs, dim=-1) * (torch.tensor([1.0, 3.0]) / 4), dim=-1)
        torch.testing.assert_close(fedavg_aggregate(xs, [1.0, 3.0]), expected)


@pytest.mark.parametrize("alpha", [0.0, 0.3, 1.0, torch.tensor(0.6), np.float64(0.25)])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.bfloat16])
def test_fedasync_same_as_fedlab(alpha, dtype):
    FedLab = _fedlab()
    server, new = vectors(2, 2000, dtype, seed=4)
    theirs = FedLab.fedasync_aggregate(server, new, alpha)
    ours = Aggregators.fedasync_aggregate(server, new, alpha)
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape
    tol = 1e-2 if dtype == torch.bfloat16 else 1e-6
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)


def test_fedasync_formula_and_fallbacks():
    server, new = vectors(2, 3000, torch.float32, seed=5)
    out = fedasync_aggregate(server, new, 0.2)
    torch.testing.assert_close(out.double(), 0.8 * server.double() + 0.2 * new.double(),
                               rtol=1e-6, atol=1e-6)
    per_coordinate = torch.rand(3000)
    torch.testing.assert_close(fedasync_aggregate(server, new, per_coordinate),
                               (1 - per_coordinate) * server + per_coordinate * new)
    mixed = fedasync_aggregate(server, new.double(), 0.5)
    assert mixed.dtype == torch.float64


def test_weights_that_require_grad_keep_fedlabs_gradient():
    # Read as a float (or detached), a weight that requires grad lost the gradient that
    # FedLab's result carries; a complex alpha raised TypeError from float().
    server, new = vectors(2, 5, torch.float64, seed=6)
    alpha = torch.tensor(0.3, dtype=torch.float64, requires_grad=True)
    out = fedasync_aggregate(server, new, alpha)
    (grad,) = torch.autograd.grad(out.sum(), alpha)
    torch.testing.assert_close(grad, (new - server).sum())
    weights = torch.tensor([1.0, 3.0], dtype=torch.float64, requires_grad=True)
    out = fedavg_aggregate([server, new], weights)
    (grad,) = torch.autograd.grad(out.sum(), weights)
    mean = (server + 3 * new) / 4  # d/dw_k of sum_k w_k x_k / sum w = (x_k - mean) / sum w
    torch.testing.assert_close(grad, torch.stack([(server - mean).sum(), (new - mean).sum()]) / 4)
    with torch.no_grad():  # nothing to carry: the fused pass
        torch.testing.assert_close(fedasync_aggregate(server, new, alpha),
                                   0.7 * server + 0.3 * new)
    out = fedasync_aggregate(server.float(), new.float(), 0.5j)
    torch.testing.assert_close(out, (1 - 0.5j) * server.float() + 0.5j * new.float())


def test_drop_in_class_has_fedlabs_static_methods():
    assert Aggregators.fedavg_aggregate is fedavg_aggregate
    assert Aggregators().fedasync_aggregate is fedasync_aggregate


@pytest.mark.slow
def test_frameworks_are_optional():
    """`import fedkernels` and the FedLab drop-ins work with neither NVFlare nor FedLab
    importable; the NVFlare module says how to install what it needs."""
    import subprocess
    import sys
    import textwrap

    code = textwrap.dedent("""
        import sys
        class Block:
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] in ("nvflare", "fedlab"):
                    raise ImportError(f"blocked {name}")
        sys.meta_path.insert(0, Block())
        import torch, fedkernels
        from fedkernels.integrations.fedlab import Aggregators
        print(Aggregators.fedavg_aggregate([torch.ones(3), torch.zeros(3)]).tolist())
        try:
            import fedkernels.integrations.nvflare
        except ImportError as err:
            print(err)
        assert not any(m.split(".")[0] in ("nvflare", "fedlab") for m in sys.modules)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "[0.5, 0.5, 0.5]" in out.stdout
    assert "pip install 'fedkernels[nvflare]'" in out.stdout


@pytest.mark.parametrize("alpha", [float("nan"), float("inf"), -float("inf"), 1e39,
                                   torch.tensor(float("nan"))],
                         ids=["nan", "inf", "-inf", "1e39", "nan tensor"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64, torch.float16])
def test_fedasync_alpha_the_op_refuses_gives_fedlabs_result(alpha, dtype):
    # The fused op refuses non-finite weights and, for narrow dtypes, weights beyond the
    # float32 range; FedLab returns its NaN/Inf there, so we give its formula's result.
    server, new = vectors(2, 50, dtype, seed=7)
    expected = torch.mul(1 - alpha, server) + torch.mul(alpha, new)
    out = fedasync_aggregate(server, new, alpha)
    assert out.dtype == expected.dtype
    torch.testing.assert_close(out, expected, equal_nan=True)
    try:
        FedLab = _fedlab()
    except pytest.skip.Exception:
        return
    torch.testing.assert_close(out, FedLab.fedasync_aggregate(server, new, alpha), equal_nan=True)


def test_sparse_vectors_follow_fedlabs_formula():
    # The fused op reads dense memory only; FedLab's stack and multiply take sparse tensors.
    xs = [x.to_sparse() for x in vectors(3, 20, seed=8)]
    w = torch.tensor([1.0, 2.0, 3.0]) / 6
    out = fedavg_aggregate(xs, [1.0, 2.0, 3.0])
    assert out.layout == torch.sparse_coo
    torch.testing.assert_close(out.to_dense(), torch.sum(torch.stack(xs, dim=-1) * w, dim=-1).to_dense())
    out = fedasync_aggregate(xs[0], xs[1], 0.3)
    assert out.layout == torch.sparse_coo
    torch.testing.assert_close(out.to_dense(), (0.7 * xs[0] + 0.3 * xs[1]).to_dense())
    try:
        FedLab = _fedlab()
    except pytest.skip.Exception:
        return
    torch.testing.assert_close(fedavg_aggregate(xs, [1.0, 2.0, 3.0]).to_dense(),
                               FedLab.fedavg_aggregate(xs, [1.0, 2.0, 3.0]).to_dense())


def test_all_negative_weights_normalize_as_in_fedlab():
    # Divided by their (negative) sum they are positive: FedLab's assert passes, and ours.
    xs = vectors(3, 40, seed=9)
    torch.testing.assert_close(fedavg_aggregate(xs, [-1.0, -2.0, -3.0]),
                               fedavg_aggregate(xs, [1.0, 2.0, 3.0]))
    try:
        FedLab = _fedlab()
    except pytest.skip.Exception:
        return
    torch.testing.assert_close(fedavg_aggregate(xs, [-1.0, -2.0, -3.0]),
                               FedLab.fedavg_aggregate(xs, [-1.0, -2.0, -3.0]))
