"""Tests of ``fedkernels::superfed_sgd_step_`` and :class:`fedkernels.SuPerFedSGD`
(fedkernels/ops/mixing_sgd.py; docs/algorithms/superfed.md, section 8): the fused step against
the composition it replaces, ``fedkernels.superfed_mix`` + ``torch.optim.SGD(g + l)`` (parameters
and momentum buffers, over several steps), tensors the loss does not use, state_dict and lr
schedulers as with SGD, strided / empty / mixed-dtype tensors, thread-count determinism, opcheck,
and the errors (which write nothing)."""

from __future__ import annotations

import copy
import math

import pytest
import torch
from conftest import bitwise_equal, dtype_id, randn
from test_cpu_threads import on_one_and_two_threads

import fedkernels
from fedkernels import SuPerFedSGD
from fedkernels.ops.mixing_sgd import superfed_sgd_step_

ops = torch.ops.fedkernels

# 0-d, empty (two ways), a vector tail, 2-D and 3-D.
SHAPES = [(5, 7), (129,), (), (3, 4, 2), (0,), (3, 0)]

TOL = {
    torch.float64: dict(rtol=1e-12, atol=1e-12),
    torch.float32: dict(rtol=1e-5, atol=1e-5),
}

# (momentum, dampening, weight_decay, nesterov)
SGD_SETTINGS = {
    "plain": (0.0, 0.0, 0.0, False),
    "decay": (0.0, 0.0, 1e-2, False),
    "momentum": (0.9, 0.0, 0.0, False),
    "damped_decay": (0.9, 0.3, 1e-2, False),
    "nesterov_decay": (0.9, 0.0, 1e-2, True),
}

# (nu, mu, with anchor, prox_form, per_tensor, numerator_eps)
REG_SETTINGS = {
    "paper": (1.0, 0.05, True, "paper", False, 0.0),
    "code_per_tensor": (0.5, 0.1, True, "code", True, 1e-6),
    "nu0": (0.0, 0.1, True, "paper", False, 0.0),
    "mu0": (1.0, 0.0, True, "paper", False, 0.0),
    "no_anchor": (1.0, 0.1, False, "code", False, 1e-6),
    "none": (0.0, 0.0, False, "paper", False, 0.0),
}


def sgd_kwargs(name, lr=0.1):
    momentum, dampening, weight_decay, nesterov = SGD_SETTINGS[name]
    return dict(lr=lr, momentum=momentum, dampening=dampening, weight_decay=weight_decay,
                nesterov=nesterov)


def reg_kwargs(name):
    nu, mu, anchor, form, per_tensor, numerator_eps = REG_SETTINGS[name]
    return anchor, dict(nu=nu, mu=mu, prox_form=form, per_tensor=per_tensor,
                        numerator_eps=numerator_eps)


def make_model(shapes, dtypes, seed=0):
    """g, l, anchor (g moved a little) and the loss weights W; ``dtypes``: one dtype, or one per
    tensor."""
    if isinstance(dtypes, torch.dtype):
        dtypes = [dtypes] * len(shapes)
    gen = torch.Generator().manual_seed(seed)

    def one():
        return [randn(s, d, gen) for s, d in zip(shapes, dtypes)]

    g, l, w = one(), one(), one()
    anchor = [(x.double() + 0.1 * randn(x.shape, torch.float64, gen)).to(x.dtype) for x in g]
    return g, l, anchor, w


def lam_schedule(kind, n, steps, seed=0):
    """One lam a step: model mixing as a float or a 0-d tensor, layer mixing as a tensor or a
    list (the last step's layer-mixing lam has a 0 and a 1, the endpoints)."""
    gen = torch.Generator().manual_seed(seed + 11)
    out = []
    for s in range(steps):
        if kind == "float":
            out.append(0.15 + 0.2 * s)
        elif kind == "tensor0":
            out.append(torch.rand((), generator=gen, dtype=torch.float64))
        else:
            lam = torch.rand(n, generator=gen, dtype=torch.float64)
            if s == steps - 1 and n >= 2:
                lam[0], lam[1] = 0.0, 1.0
            out.append(lam if kind == "lm" else lam.tolist())
    return out


def smooth_loss(weights, use=None):
    """A smooth nonlinear loss of theta, bounded below: sum_t sum(sin(theta_t * W_t) +
    theta_t^2 / 4), over the tensors in ``use`` (all by default)."""

    def loss(theta):
        total = 0.0
        for t, (x, w) in enumerate(zip(theta, weights)):
            if use is None or t in use:
                total = total + (torch.sin(x * w) + 0.25 * x * x).sum()
        return total

    return loss


class Composition:
    """What SuPerFedSGD replaces: superfed_mix + torch.optim.SGD(g + l)."""

    def __init__(self, g, l, anchor, sgd, reg):
        self.g = [x.detach().clone().requires_grad_() for x in g]
        self.l = [x.detach().clone().requires_grad_() for x in l]
        self.anchor = None if anchor is None else [a.clone() for a in anchor]
        self.reg = reg
        self.opt = torch.optim.SGD(self.g + self.l, **sgd)

    @property
    def params(self):
        return self.g + self.l

    def step(self, lam, loss, with_reg=True):
        theta, reg = fedkernels.superfed_mix(self.g, self.l, lam, self.anchor, **self.reg)
        self.opt.zero_grad()
        (loss(theta) + reg if with_reg else loss(theta)).backward()
        self.opt.step()


class Fused:
    """SuPerFedSGD on copies of g and l (``copy=False``: on g and l themselves)."""

    def __init__(self, g, l, anchor, sgd, reg, copy=True):
        self.g = [x.detach().clone() for x in g] if copy else list(g)
        self.l = [x.detach().clone() for x in l] if copy else list(l)
        self.opt = SuPerFedSGD(self.g, self.l, anchor, **sgd, **reg)

    @property
    def params(self):
        return self.g + self.l

    def step(self, lam, loss, with_reg=True):
        theta, reg = self.opt.mix(lam)
        (loss(theta) + reg if with_reg else loss(theta)).backward()
        self.opt.step()


def buffer(opt, p):
    return opt.state[p].get("momentum_buffer") if p in opt.state else None


def assert_same_run(fused, ref, tol=None):
    """Same parameters and momentum buffers, position by position in g + l (tolerance: the
    dtype's, or ``tol``)."""
    for i, (p, q) in enumerate(zip(fused.params, ref.params)):
        each = tol or TOL[p.dtype]
        assert p.dtype == q.dtype and p.shape == q.shape
        torch.testing.assert_close(p, q.detach(), **each, msg=lambda m, i=i: f"param {i}: {m}")
        bp, bq = buffer(fused.opt, p), buffer(ref.opt, q)
        assert (bp is None) == (bq is None), f"param {i}: momentum buffer {bp is None} {bq is None}"
        if bq is not None:
            torch.testing.assert_close(bp, bq, **each, msg=lambda m, i=i: f"buffer {i}: {m}")


# ---------------------------------------------------------------- equivalence


@pytest.mark.parametrize("lam_kind", ["float", "lm"])
@pytest.mark.parametrize("reg_name", list(REG_SETTINGS))
@pytest.mark.parametrize("sgd_name", list(SGD_SETTINGS))
def test_matches_superfed_mix_and_torch_sgd(sgd_name, reg_name, lam_kind):
    g, l, anchor, w = make_model(SHAPES, torch.float64)
    with_anchor, reg = reg_kwargs(reg_name)
    anchor = anchor if with_anchor else None
    sgd = sgd_kwargs(sgd_name)
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    loss = smooth_loss(w)
    for lam in lam_schedule(lam_kind, len(g), steps=4):
        fused.step(lam, loss)
        ref.step(lam, loss)
    assert_same_run(fused, ref)
    # the run moved the parameters (so the comparison compares something)
    assert not torch.allclose(fused.g[0], g[0]) and not torch.allclose(fused.l[1], l[1])


@pytest.mark.parametrize("lam_kind", ["tensor0", "lm_list"])
@pytest.mark.parametrize("sgd_name", ["momentum", "damped_decay", "nesterov_decay"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64], ids=dtype_id)
def test_matches_the_composition_float32_and_lam_forms(dtype, sgd_name, lam_kind):
    g, l, anchor, w = make_model(SHAPES, dtype, seed=1)
    _, reg = reg_kwargs("code_per_tensor")
    sgd = sgd_kwargs(sgd_name)
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    loss = smooth_loss(w)
    for lam in lam_schedule(lam_kind, len(g), steps=4, seed=1):
        fused.step(lam, loss)
        ref.step(lam, loss)
    assert_same_run(fused, ref)


@pytest.mark.parametrize("lam_kind", ["float", "lm"])
@pytest.mark.parametrize("sgd_name", ["decay", "damped_decay", "nesterov_decay"])
def test_bfloat16_is_as_close_to_float64_as_the_composition(sgd_name, lam_kind):
    """bfloat16 rounds differently by design (once per element against once per _foreach op),
    so the fused run is compared loosely with the bfloat16 composition, and its error from the
    same run in float64 must be no larger than the composition's."""
    g, l, anchor, w = make_model(SHAPES, torch.bfloat16, seed=2)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs(sgd_name)
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    up = [[x.double() for x in xs] for xs in (g, l, anchor, w)]
    exact = Composition(up[0], up[1], up[2], sgd, reg)
    lams = lam_schedule(lam_kind, len(g), steps=3, seed=2)
    for lam in lams:
        fused.step(lam, smooth_loss(w))
        ref.step(lam, smooth_loss(w))
        exact.step(lam, smooth_loss(up[3]))

    def error(run):
        return math.sqrt(sum(float(((p.detach().double() - q.detach()) ** 2).sum())
                             for p, q in zip(run.params, exact.params)))

    for p, q in zip(fused.params, ref.params):
        assert p.dtype == torch.bfloat16
        torch.testing.assert_close(p, q.detach(), rtol=2e-2, atol=3e-2)
        bp, bq = buffer(fused.opt, p), buffer(ref.opt, q)
        assert (bp is None) == (bq is None)
        if bq is not None:
            torch.testing.assert_close(bp, bq, rtol=2e-2, atol=6e-2)
    assert error(fused) <= 1.25 * error(ref) + 1e-3, (error(fused), error(ref))


def test_mixed_dtypes_in_one_list():
    dtypes = [torch.float32, torch.float64, torch.float64, torch.float32, torch.float32]
    shapes = [(5, 7), (129,), (), (0,), (70,)]
    g, l, anchor, w = make_model(shapes, dtypes, seed=3)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("damped_decay")
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    for lam in lam_schedule("lm", len(g), steps=3, seed=3):
        fused.step(lam, smooth_loss(w))
        ref.step(lam, smooth_loss(w))
    assert [p.dtype for p in fused.g] == dtypes
    # the float32 tensors' rounding reaches the float64 ones through the shared cosine
    assert_same_run(fused, ref, TOL[torch.float32])


def test_low_level_op_matches_the_backward_op_and_torch_sgd():
    """The native op alone, with given buffers and grad_stats, against
    mix_endpoints_with_stats_backward's gradients given to torch.optim.SGD (first_step: torch's
    first step, which sets a buffer to the gradient and never reads the old one)."""
    shapes = [(5, 7), (129,), (), (0,)]
    gen = torch.Generator().manual_seed(4)
    for first_step in (False, True):
        for nesterov, dampening, with_anchor, lam in (
            (False, 0.3, True, torch.tensor([0.2, 0.7, 0.5, 0.1], dtype=torch.float64)),
            (True, 0.0, False, 0.35),
        ):
            g, l, a, grads = ([randn(s, torch.float64, gen) for s in shapes] for _ in range(4))
            bg, bl = ([randn(s, torch.float64, gen) for s in shapes] for _ in range(2))
            anchor = a if with_anchor else []
            h = torch.randn(len(shapes), 4, generator=gen, dtype=torch.float64)
            sgd = dict(lr=0.05, momentum=0.8, dampening=dampening, weight_decay=0.02,
                       nesterov=nesterov)
            grad_g, grad_l, _, _ = ops.mix_endpoints_with_stats_backward(
                grads, h, g, l, torch.as_tensor(lam, dtype=torch.float64), anchor,
                [True, True, False, False])
            ref = [x.clone().requires_grad_() for x in g + l]
            opt = torch.optim.SGD(ref, **sgd)
            for p, d, b in zip(ref, grad_g + grad_l, bg + bl):
                p.grad = d.clone()
                if not first_step:
                    opt.state[p]["momentum_buffer"] = b.clone()
            opt.step()
            superfed_sgd_step_(g, l, bg, bl, grads, h, lam, anchor, **sgd, first_step=first_step)
            for i, (p, q) in enumerate(zip(g + l, ref)):
                torch.testing.assert_close(p, q.detach(), **TOL[torch.float64])
                torch.testing.assert_close((bg + bl)[i], opt.state[q]["momentum_buffer"],
                                           **TOL[torch.float64])


# ---------------------------------------------------------------- tensors the loss does not use


@pytest.mark.parametrize("reg_name", ["paper", "none"])
@pytest.mark.parametrize("sgd_name", ["decay", "damped_decay", "nesterov_decay"])
def test_unused_tensor_is_updated_as_in_the_composition(sgd_name, reg_name):
    """Loss without the regularizer (or nu = 0, no anchor: a constant regularizer) and theta_1
    unused: superfed_mix's backward still gives g_1 and l_1 a (zero) gradient, so SGD applies
    weight decay and momentum to them; the fused step does the same."""
    g, l, anchor, w = make_model([(5, 7), (129,), (3, 4)], torch.float64, seed=5)
    with_anchor, reg = reg_kwargs(reg_name)
    anchor = anchor if with_anchor else None
    sgd = sgd_kwargs(sgd_name)
    with_reg = reg_name == "none"  # reg is then a constant 0 that no tensor depends on
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    for lam in lam_schedule("lm", len(g), steps=4, seed=5):
        fused.step(lam, smooth_loss(w, use={0, 2}), with_reg=with_reg)
        ref.step(lam, smooth_loss(w, use={0, 2}), with_reg=with_reg)
    assert (buffer(fused.opt, fused.g[1]) is not None) == (sgd["momentum"] != 0)
    assert not torch.equal(fused.g[1], g[1])  # weight decay moved it
    assert_same_run(fused, ref)


@pytest.mark.parametrize("reg_name", ["paper", "nu0", "code_per_tensor"])
def test_with_the_regularizer_every_tensor_is_updated(reg_name):
    """The regularizer reaches every tensor: with it in the loss, a tensor whose theta is unused
    is still updated (and gets a momentum buffer), as in the composition."""
    g, l, anchor, w = make_model([(5, 7), (129,), (3, 4)], torch.float64, seed=6)
    _, reg = reg_kwargs(reg_name)
    sgd = sgd_kwargs("damped_decay")
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    for lam in lam_schedule("float", len(g), steps=3, seed=6):
        fused.step(lam, smooth_loss(w, use={0, 2}))
        ref.step(lam, smooth_loss(w, use={0, 2}))
    assert all(buffer(fused.opt, p) is not None for p in fused.params)
    assert not torch.equal(fused.g[1], g[1]) and not torch.equal(fused.l[1], l[1])
    assert_same_run(fused, ref)


def test_regularizer_only_loss_updates_every_tensor():
    g, l, anchor, w = make_model([(5, 7), (129,)], torch.float64, seed=7)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("momentum")
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    for lam in (0.3, 0.6):
        fused.step(lam, lambda theta: 0.0)
        ref.step(lam, lambda theta: 0.0)
    assert_same_run(fused, ref)


def test_skips_match_the_superfed_mix_composition():
    g, l, anchor, w = make_model([(5, 7), (129,), (3, 4)], torch.float64, seed=5)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("damped_decay")
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    for lam in (0.3, 0.6):
        fused.step(lam, smooth_loss(w, use={0, 2}), with_reg=False)
        ref.step(lam, smooth_loss(w, use={0, 2}), with_reg=False)
    assert_same_run(fused, ref)


# ---------------------------------------------------------------- state_dict, lr scheduler


@pytest.mark.parametrize("direction", ["fused_to_sgd", "sgd_to_fused"])
def test_state_dict_moves_between_superfed_sgd_and_torch_sgd(direction):
    g, l, anchor, w = make_model(SHAPES, torch.float64, seed=8)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("nesterov_decay")
    loss = smooth_loss(w)
    lams = lam_schedule("lm", len(g), steps=5, seed=8)
    first = (Fused if direction == "fused_to_sgd" else Composition)(g, l, anchor, sgd, reg)
    for lam in lams[:2]:
        first.step(lam, loss)
    state = first.opt.state_dict()
    n = 2 * len(g)
    assert state["param_groups"][0]["params"] == list(range(n))
    assert sorted(state["state"]) == list(range(n))
    # the receiving optimizers start with another lr: load_state_dict restores the saved one
    other = dict(sgd, lr=0.5)
    now = [p.detach() for p in first.params]
    fused = Fused(now[: len(g)], now[len(g):], anchor, other, reg)
    ref = Composition(now[: len(g)], now[len(g):], anchor, other, reg)
    # load_state_dict keeps the given buffers (no copy): each optimizer gets its own
    fused.opt.load_state_dict(copy.deepcopy(state))
    ref.opt.load_state_dict(copy.deepcopy(state))
    assert fused.opt.param_groups[0]["lr"] == ref.opt.param_groups[0]["lr"] == 0.1
    for lam in lams[2:]:
        fused.step(lam, loss)
        ref.step(lam, loss)
        first.step(lam, loss)
    assert_same_run(fused, ref)
    if direction == "fused_to_sgd":
        assert_same_run(first, ref)
    else:
        assert_same_run(fused, first)


def test_state_dict_with_one_buffer_of_a_pair():
    """A torch SGD state where g_0 has a momentum buffer and l_0 none (l_0 had grad None in the
    step that made it): the loaded SuPerFedSGD continues g_0's buffer and starts l_0's, as SGD."""
    g, l, anchor, w = make_model([(5, 7), (129,)], torch.float64, seed=9)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("damped_decay")
    ref = Composition(g, l, anchor, sgd, reg)
    ref.g[0].grad = torch.ones_like(ref.g[0])
    ref.opt.step()
    ref.g[0].grad = None
    assert buffer(ref.opt, ref.g[0]) is not None and buffer(ref.opt, ref.l[0]) is None
    now = [p.detach() for p in ref.params]
    fused = Fused(now[:2], now[2:], anchor, sgd, reg)
    fused.opt.load_state_dict(copy.deepcopy(ref.opt.state_dict()))
    for lam in (0.3, 0.6):
        fused.step(lam, smooth_loss(w))
        ref.step(lam, smooth_loss(w))
    assert_same_run(fused, ref)


def test_lr_scheduler_changes_the_step_as_with_sgd():
    g, l, anchor, w = make_model(SHAPES, torch.float64, seed=10)
    _, reg = reg_kwargs("code_per_tensor")
    sgd = sgd_kwargs("damped_decay", lr=0.2)
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    schedulers = [torch.optim.lr_scheduler.StepLR(r.opt, step_size=1, gamma=0.3)
                  for r in (fused, ref)]
    for lam in lam_schedule("float", len(g), steps=4, seed=10):
        fused.step(lam, smooth_loss(w))
        ref.step(lam, smooth_loss(w))
        for s in schedulers:
            s.step()
    assert fused.opt.param_groups[0]["lr"] == pytest.approx(0.2 * 0.3**4)
    assert_same_run(fused, ref)
    # without the scheduler the result differs: the lr reached the update
    plain = Fused(g, l, anchor, sgd, reg)
    for lam in lam_schedule("float", len(g), steps=4, seed=10):
        plain.step(lam, smooth_loss(w))
    assert not torch.allclose(plain.g[0], fused.g[0])


# ---------------------------------------------------------------- layouts, sizes, threads


def test_strided_parameters_are_updated_in_place():
    """A transposed view, a slice with gaps and a channels_last tensor, in g, l and the anchor:
    updated in place (through the views, the gaps untouched), with the bits of the same run on
    contiguous copies, and as in the composition."""
    gen = torch.Generator().manual_seed(11)

    def r(*shape):
        return randn(shape, torch.float64, gen)

    base_g, base_l = r(7, 5), r(6, 8)
    cl = torch.channels_last
    g = [base_g.t(), r(6, 8)[:, ::2], r(4, 3, 3, 3).to(memory_format=cl), r(9)]
    l = [r(5, 7), base_l[:, 1::2], r(4, 3, 3, 3).to(memory_format=cl), r(3, 9)[1]]
    anchor = [r(7, 5).t(), r(6, 4), r(4, 3, 3, 3).to(memory_format=cl), r(9, 2)[:, 0]]
    w = [r(*x.shape) for x in g]
    assert not any(x.is_contiguous() for x in (g[0], g[1], g[2], l[1], l[2], anchor[0]))
    gaps = base_l[:, ::2].clone()
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("nesterov_decay")
    fused = Fused(g, l, anchor, sgd, reg, copy=False)  # the views themselves
    dense = Fused([x.contiguous() for x in g], [x.contiguous() for x in l],
                  [x.contiguous() for x in anchor], sgd, reg)
    ref = Composition(g, l, anchor, sgd, reg)
    for lam in lam_schedule("lm", len(g), steps=3, seed=11):
        for run in (fused, dense, ref):
            run.step(lam, smooth_loss(w))
    assert bitwise_equal(base_g.t(), dense.g[0]) and bitwise_equal(base_l[:, 1::2], dense.l[1])
    assert bitwise_equal(base_l[:, ::2], gaps)
    assert g[2].is_contiguous(memory_format=cl) and l[2].is_contiguous(memory_format=cl)
    for p, q in zip(fused.params, dense.params):
        assert bitwise_equal(p, q)
        assert bitwise_equal(buffer(fused.opt, p), buffer(dense.opt, q))
    assert_same_run(fused, ref)


def test_tiny_network_through_functional_call():
    """A conv net's parameters, the conv weight channels_last and the linear weight transposed
    in memory, trained through torch.func.functional_call: as the composition."""
    torch.manual_seed(12)
    net = torch.nn.Sequential(torch.nn.Conv2d(3, 4, 3), torch.nn.Tanh(), torch.nn.Flatten(),
                              torch.nn.Linear(4 * 4 * 4, 5))
    names = [n for n, _ in net.named_parameters()]

    def layout(x):
        if x.dim() == 4:
            return x.contiguous(memory_format=torch.channels_last)
        return x.t().contiguous().t() if x.dim() == 2 else x

    g = [layout(p.detach().clone()) for p in net.parameters()]
    l = [layout(p.detach() + 0.1 * torch.randn_like(p)) for p in net.parameters()]
    anchor = [p.detach() + 0.05 * torch.randn_like(p) for p in net.parameters()]
    x, y = torch.randn(8, 3, 6, 6), torch.randint(0, 5, (8,))

    def loss(theta):
        out = torch.func.functional_call(net, dict(zip(names, theta)), (x,))
        return torch.nn.functional.cross_entropy(out, y)

    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("nesterov_decay")
    fused, ref = Fused(g, l, anchor, sgd, reg, copy=False), Composition(g, l, anchor, sgd, reg)
    for lam in lam_schedule("lm", len(g), steps=3, seed=12):
        fused.step(lam, loss)
        ref.step(lam, loss)
    assert g[0].is_contiguous(memory_format=torch.channels_last) and not g[2].is_contiguous()
    assert_same_run(fused, ref)


def test_empty_tensors_and_an_all_empty_model():
    shapes = [(0,), (3, 0), (2,), (0, 4)]
    g, l, anchor, w = make_model(shapes, torch.float32, seed=13)
    _, reg = reg_kwargs("code_per_tensor")
    sgd = sgd_kwargs("damped_decay")
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    for lam in lam_schedule("lm", len(g), steps=2, seed=13):
        fused.step(lam, smooth_loss(w))
        ref.step(lam, smooth_loss(w))
    assert_same_run(fused, ref)
    assert [tuple(p.shape) for p in fused.g] == shapes
    # only empty tensors: nothing to do, no error, buffers as SGD's
    g, l, anchor, w = make_model(shapes[:2], torch.float32, seed=13)
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    fused.step(0.4, smooth_loss(w))
    ref.step(0.4, smooth_loss(w))
    assert_same_run(fused, ref)


def test_one_and_two_threads_give_the_same_bits():
    """Tensors of several 64 Ki-element chunks, and a pass large enough to run in parallel."""
    shapes = [(200_003,), (300, 700), (5,)]

    def run():
        g, l, anchor, w = make_model(shapes, torch.float32, seed=14)
        _, reg = reg_kwargs("code_per_tensor")
        fused = Fused(g, l, anchor, sgd_kwargs("damped_decay"), reg)
        regs = []
        for lam in lam_schedule("lm", len(g), steps=3, seed=14):
            theta, r = fused.opt.mix(lam)
            (smooth_loss(w)(theta) + r).backward()
            fused.opt.step()
            regs.append(r.detach())
        return fused.params + [buffer(fused.opt, p) for p in fused.params] + regs, fused

    (one, _), (two, fused) = on_one_and_two_threads(run)
    assert bitwise_equal(one, two)
    g, l, anchor, w = make_model(shapes, torch.float32, seed=14)
    _, reg = reg_kwargs("code_per_tensor")
    ref = Composition(g, l, anchor, sgd_kwargs("damped_decay"), reg)
    for lam in lam_schedule("lm", len(g), steps=3, seed=14):
        ref.step(lam, smooth_loss(w))
    assert_same_run(fused, ref)


# ---------------------------------------------------------------- opcheck


def _opcheck_cases():
    shapes = [(3, 4), (5,), (), (0,)]
    gen = torch.Generator().manual_seed(15)

    def lst():
        return [randn(s, torch.float32, gen) for s in shapes]

    h = torch.randn(4, 4, generator=gen, dtype=torch.float64)
    lam_mm, lam_lm = torch.tensor(0.3, dtype=torch.float64), torch.tensor([0.1, 0.5, 0.9, 0.2])
    return [
        (lst(), lst(), [], [], lst(), h, lam_mm, lst(), 0.1, 0.0, 0.0, 0.0, False, [False] * 2),
        (lst(), lst(), lst(), lst(), lst(), h, lam_lm, [], 0.1, 0.9, 0.0, 0.01, True, [False] * 2),
        (lst(), lst(), lst(), lst(), lst(), h, lam_lm, lst(), 0.1, 0.9, 0.3, 0.01, False,
         [True, False]),
    ]


@pytest.mark.parametrize("case", range(3))
def test_opcheck(case):
    torch.library.opcheck(ops.superfed_sgd_step_.default, _opcheck_cases()[case])


# ---------------------------------------------------------------- errors


def _valid_call():
    shapes = [(3, 4), (3, 4), (5,), ()]
    gen = torch.Generator().manual_seed(16)

    def lst():
        return [randn(s, torch.float32, gen) for s in shapes]

    return dict(global_params=lst(), local_params=lst(), global_momentum=lst(),
                local_momentum=lst(), grads=lst(),
                grad_stats=torch.randn(4, 4, generator=gen, dtype=torch.float64),
                lam=torch.tensor([0.2, 0.4, 0.6, 0.8], dtype=torch.float64), anchor=lst(),
                lr=0.1, momentum=0.9, dampening=0.0, weight_decay=0.01, nesterov=False,
                first_step=[False, False])


def _replace(name, index, value):
    def edit(c):
        c[name] = list(c[name])
        c[name][index] = value(c) if callable(value) else value
    return edit


def _set(**changes):
    def edit(c):
        for k, v in changes.items():
            c[k] = v(c) if callable(v) else v
    return edit


NAN, INF = float("nan"), float("inf")

OP_ERRORS = {
    "local_length": (_set(local_params=lambda c: c["local_params"][:3]), ValueError,
                     "local_params has 3 tensors, global_params has 4"),
    "grads_length": (_set(grads=lambda c: c["grads"][1:]), ValueError, "grads has 3 tensors"),
    "anchor_length": (_set(anchor=lambda c: c["anchor"][:1]), ValueError, "anchor has 1 tensors"),
    "local_shape": (_replace("local_params", 2, torch.zeros(6)), ValueError,
                    "local_params tensor 2 has shape"),
    "grads_shape": (_replace("grads", 0, torch.zeros(4, 3)), ValueError, "grads tensor 0 has shape"),
    "local_dtype": (_replace("local_params", 1, torch.zeros(3, 4, dtype=torch.float64)), TypeError,
                    "local_params tensor 1 has dtype"),
    "buffer_dtype": (_replace("local_momentum", 3, torch.zeros((), dtype=torch.float64)),
                     TypeError, "local_momentum tensor 3 has dtype"),
    "buffer_shape": (_replace("global_momentum", 0, torch.zeros(12)), ValueError,
                     "global_momentum tensor 0 has shape"),
    "int_params": (_set(global_params=lambda c: [x.long() for x in c["global_params"]],
                        local_params=lambda c: [x.long() for x in c["local_params"]]),
                   TypeError, "global_params tensor 0"),
    "negative_lr": (_set(lr=-0.1), ValueError, "lr must be finite and >= 0, got -0.1"),
    "nan_lr": (_set(lr=NAN), ValueError, "lr must be finite and >= 0, got nan"),
    "inf_lr": (_set(lr=INF), ValueError, "lr must be finite and >= 0"),
    "negative_momentum": (_set(momentum=-0.9), ValueError, "momentum must be finite and >= 0"),
    "nan_dampening": (_set(dampening=NAN), ValueError, "dampening must be finite and >= 0"),
    "negative_weight_decay": (_set(weight_decay=-1e-3), ValueError,
                              "weight_decay must be finite and >= 0"),
    "nesterov_without_momentum": (
        _set(momentum=0.0, nesterov=True, global_momentum=[], local_momentum=[]), ValueError,
        "nesterov needs momentum > 0 and dampening 0"),
    "nesterov_with_dampening": (_set(nesterov=True, dampening=0.1), ValueError,
                                "nesterov needs momentum > 0 and dampening 0"),
    "buffers_without_momentum": (_set(momentum=0.0), ValueError,
                                 "momentum buffers given with momentum 0"),
    "one_buffer_list_without_momentum": (_set(momentum=0.0, global_momentum=[]), ValueError,
                                         "momentum buffers given with momentum 0"),
    "buffers_missing": (_set(global_momentum=[], local_momentum=[]), ValueError,
                        "global_momentum has 0 tensors"),
    "local_buffers_missing": (_set(local_momentum=[]), ValueError,
                              "local_momentum has 0 tensors"),
    "global_is_local": (_replace("local_params", 2, lambda c: c["global_params"][2]), ValueError,
                        "global_params tensor 2 overlaps local_params tensor 2"),
    "param_twice": (_replace("global_params", 1, lambda c: c["global_params"][0]), ValueError,
                    "global_params tensor 0 overlaps global_params tensor 1"),
    "local_twice": (_replace("local_params", 0, lambda c: c["local_params"][1]), ValueError,
                    "local_params tensor 0 overlaps local_params tensor 1"),
    "partial_overlap": (
        _replace("local_params", 2, lambda c: c["global_params"][0].reshape(-1)[2:7]), ValueError,
        "global_params tensor 0 overlaps local_params tensor 2"),
    "buffer_is_param": (_replace("global_momentum", 3, lambda c: c["local_params"][3]), ValueError,
                        "local_params tensor 3 overlaps global_momentum tensor 3"),
    "buffers_shared": (_replace("local_momentum", 2, lambda c: c["global_momentum"][2]),
                       ValueError, "global_momentum tensor 2 overlaps local_momentum tensor 2"),
    "grads_is_param": (_replace("grads", 1, lambda c: c["global_params"][1]), ValueError,
                       "global_params tensor 1 overlaps grads tensor 1"),
    "anchor_is_local": (_replace("anchor", 0, lambda c: c["local_params"][0]), ValueError,
                        "local_params tensor 0 overlaps anchor tensor 0"),
    "expanded_param": (_replace("global_params", 2, torch.zeros(1).expand(5)), ValueError,
                       "global_params tensor 2 has elements that share memory"),
    "expanded_2d_local": (_replace("local_params", 0, torch.zeros(4).expand(3, 4)), ValueError,
                          "local_params tensor 0 has elements that share memory"),
    "expanded_buffer": (_replace("local_momentum", 1, torch.zeros(4).expand(3, 4)), ValueError,
                        "local_momentum tensor 1 has elements that share memory"),
    # rows 1 element apart, not a zero stride: torch's own check finds it too hard to tell
    "overlapping_rows": (_replace("local_params", 0, torch.zeros(6).as_strided((3, 4), (1, 1))),
                         ValueError, "local_params tensor 0 has elements that share memory"),
    "grad_stats_shape": (_set(grad_stats=torch.zeros(4, 3, dtype=torch.float64)), ValueError,
                         r"grad_stats has shape \[4, 3\], expected \[4, 4\]"),
    "grad_stats_rows": (_set(grad_stats=torch.zeros(3, 4, dtype=torch.float64)), ValueError,
                        "grad_stats has shape"),
    "grad_stats_int": (_set(grad_stats=torch.zeros(4, 4, dtype=torch.long)), TypeError,
                       "grad_stats must be floating point"),
    "lam_count": (_set(lam=torch.tensor([0.1, 0.2, 0.3], dtype=torch.float64)), ValueError,
                  "lam has 3 values"),
    "lam_nan": (_set(lam=torch.tensor([0.1, NAN, 0.3, 0.4], dtype=torch.float64)), ValueError,
                "lam of tensor 1 is nan"),
    "lam_int": (_set(lam=torch.tensor(1)), TypeError, "lam must be a floating-point"),
}


@pytest.mark.parametrize("case", list(OP_ERRORS))
def test_op_errors_name_the_argument_and_write_nothing(case):
    edit, error, match = OP_ERRORS[case]
    call = _valid_call()
    edit(call)
    tensors = [x for v in call.values() if isinstance(v, list) for x in v
               if isinstance(x, torch.Tensor)]
    tensors += [call["grad_stats"], call["lam"]]
    before = [x.clone() for x in tensors]
    args = list(call.values())
    with pytest.raises(error, match=match):
        ops.superfed_sgd_step_(*args)
    for x, b in zip(tensors, before):
        assert bitwise_equal(x, b)


def test_the_valid_call_of_the_error_cases_runs():
    call = _valid_call()
    before = [x.clone() for x in call["global_params"]]
    ops.superfed_sgd_step_(*call.values())
    assert all(not torch.equal(x, b) for x, b in zip(call["global_params"], before))


@pytest.mark.parametrize("name", ["global_params", "local_momentum"])
def test_grad_mode_refuses_a_written_leaf_that_requires_grad(name):
    """As PyTorch's in-place ops: with grad mode on, a written leaf that requires grad is
    refused (nothing written); under torch.no_grad() the same call runs and advances the
    written tensors' version counters."""
    call = _valid_call()
    call[name][1].requires_grad_()
    before = [x.detach().clone() for x in call["global_params"]]
    with pytest.raises(RuntimeError, match=rf"{name}\[1\] is a leaf tensor that requires grad"):
        superfed_sgd_step_(**call)
    assert all(bitwise_equal(x.detach(), b) for x, b in zip(call["global_params"], before))
    versions = [x._version for x in call["global_params"] + call["local_momentum"]]
    with torch.no_grad():
        superfed_sgd_step_(**call)
    assert all(x._version > v
               for x, v in zip(call["global_params"] + call["local_momentum"], versions))


def test_grad_mode_refuses_a_read_input_that_requires_grad():
    call = _valid_call()
    call["grads"][0].requires_grad_()
    with pytest.raises(RuntimeError, match=r"grads\[0\] requires grad"):
        superfed_sgd_step_(**call)


def _opt():
    g, l, anchor, w = make_model([(3, 4), (5,)], torch.float32, seed=17)
    return SuPerFedSGD(g, l, anchor, lr=0.1, momentum=0.9, nu=1.0, mu=0.1), w


@pytest.mark.parametrize(
    "make, match",
    [
        (lambda g, l: SuPerFedSGD(g, l[:1], lr=0.1, nu=1.0, mu=0.0),
         "local_params has 1 tensors, global_params has 2"),
        (lambda g, l: SuPerFedSGD([], [], lr=0.1, nu=1.0, mu=0.0), "global_params is empty"),
        (lambda g, l: SuPerFedSGD(g, l, lr=-0.1, nu=1.0, mu=0.0), "lr must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=NAN, nu=1.0, mu=0.0), "lr must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, momentum=-0.5, nu=1.0, mu=0.0),
         "momentum must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, momentum=0.9, dampening=INF, nu=1.0, mu=0.0),
         "dampening must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, weight_decay=-1e-4, nu=1.0, mu=0.0),
         "weight_decay must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, nesterov=True, nu=1.0, mu=0.0),
         "nesterov needs momentum > 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, momentum=0.9, dampening=0.1, nesterov=True,
                                  nu=1.0, mu=0.0), "nesterov needs momentum > 0 and dampening 0"),
        (lambda g, l: SuPerFedSGD(g, l, g, lr=0.1, nu=1.0, mu=0.1, prox_form="squared"),
         "prox_form must be 'paper' or 'code'"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, nu=-1.0, mu=0.0), "nu must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, g, lr=0.1, nu=1.0, mu=NAN), "mu must be finite and >= 0"),
        (lambda g, l: SuPerFedSGD(g, l, lr=0.1, nu=1.0, mu=0.0, numerator_eps=-1e-6),
         "numerator_eps must be finite and >= 0"),
    ],
)
def test_optimizer_arguments_are_checked(make, match):
    g, l = make_model([(3, 4), (5,)], torch.float32, seed=18)[:2]
    with pytest.raises(ValueError, match=match):
        make(g, l)


def test_optimizer_misuse_raises_and_writes_nothing():
    opt, w = _opt()
    params = opt.param_groups[0]["params"]
    before = [p.clone() for p in params]

    def unchanged():
        return all(bitwise_equal(p, b) for p, b in zip(params, before)) and not opt.state

    with pytest.raises(RuntimeError, match=r"call mix\(\) and backward\(\) first"):
        opt.step()
    assert unchanged()
    opt.mix(0.3)
    with pytest.raises(RuntimeError, match="no gradient reached the mixed parameters"):
        opt.step()
    assert unchanged()
    theta, reg = opt.mix(0.3)
    (smooth_loss(w)(theta) + reg).backward()
    with pytest.raises(ValueError, match="takes no closure"):
        opt.step(lambda: 0.0)
    assert unchanged()
    with pytest.raises(ValueError, match="one parameter group"):
        opt.add_param_group({"params": [torch.zeros(3)]})
    assert len(opt.param_groups) == 1
    with pytest.raises(ValueError, match="lam has 3 values"):
        opt.mix([0.1, 0.2, 0.3])
    # the refused mix() left the pending step (mixed, backward done) as it was
    opt.step()
    assert not unchanged()
    with pytest.raises(RuntimeError, match=r"call mix\(\) and backward\(\) first"):
        opt.step()  # one step per mix()


def test_anchor_sharing_memory_with_g_is_refused_at_step():
    """The anchor is the round's frozen global model: the same tensors as g would move with g
    (the proximal term would always be 0); the step refuses it and writes nothing."""
    g, l = make_model([(3, 4), (5,)], torch.float32, seed=19)[:2]
    before = [p.clone() for p in g + l]
    opt = SuPerFedSGD(g, l, g, lr=0.1, nu=1.0, mu=0.1)
    theta, reg = opt.mix(0.5)
    (sum(t.sum() for t in theta) + reg).backward()
    with pytest.raises(ValueError, match="global_params tensor 0 overlaps anchor tensor 0"):
        opt.step()
    assert all(bitwise_equal(p, b) for p, b in zip(g + l, before))


# ---------------------------------------------------------------- CUDA


@pytest.mark.cuda
def test_cuda_matches_cpu():
    g, l, anchor, w = make_model(SHAPES + [(70001,)], torch.float32, seed=20)
    _, reg = reg_kwargs("code_per_tensor")
    sgd = sgd_kwargs("nesterov_decay")
    cpu = Fused(g, l, anchor, sgd, reg)

    def cuda(xs):
        return [x.cuda() for x in xs]

    gpu = Fused(cuda(g), cuda(l), cuda(anchor), sgd, reg)
    for lam in lam_schedule("lm", len(g), steps=3, seed=20):
        cpu.step(lam, smooth_loss(w))
        gpu.step(lam.cuda(), smooth_loss(cuda(w)))
    for p, q in zip(gpu.params, cpu.params):
        assert p.is_cuda
        torch.testing.assert_close(p.cpu(), q, **TOL[torch.float32])
        torch.testing.assert_close(buffer(gpu.opt, p).cpu(), buffer(cpu.opt, q),
                                   **TOL[torch.float32])


def test_a_failing_step_leaves_the_optimizer_as_it_was():
    """A step the op refuses (here a negative lr set in the group, as a bad scheduler could)
    writes nothing and keeps no half-made momentum buffer; the same step then runs once the lr
    is fixed, and matches the composition."""
    g, l, anchor, w = make_model([(5, 7), (129,)], torch.float64, seed=21)
    _, reg = reg_kwargs("paper")
    sgd = sgd_kwargs("damped_decay")
    fused, ref = Fused(g, l, anchor, sgd, reg), Composition(g, l, anchor, sgd, reg)
    theta, penalty = fused.opt.mix(0.4)
    (smooth_loss(w)(theta) + penalty).backward()
    fused.opt.param_groups[0]["lr"] = -1.0
    with pytest.raises(ValueError, match="lr must be finite and >= 0"):
        fused.opt.step()
    assert all(bitwise_equal(p, q) for p, q in zip(fused.params, g + l))
    assert all(buffer(fused.opt, p) is None for p in fused.params)
    fused.opt.param_groups[0]["lr"] = sgd["lr"]
    fused.opt.step()
    ref.step(0.4, smooth_loss(w))
    assert_same_run(fused, ref)


def test_torch_compile_fullgraph_matches_eager():
    """The in-place op traced whole by torch.compile (its fake and mutation annotations): the
    compiled step writes the same parameters and buffers as the eager one."""
    gen = torch.Generator().manual_seed(22)
    shapes = [(5, 7), (129,), ()]

    def lists():
        return [randn(s, torch.float32, gen) for s in shapes]

    g, l, bg, bl, grads, anchor = (lists() for _ in range(6))
    h = torch.randn(len(shapes), 4, generator=gen, dtype=torch.float64)
    lam = torch.tensor([0.2, 0.5, 0.9], dtype=torch.float64)

    def step(g, l, bg, bl):
        superfed_sgd_step_(g, l, bg, bl, grads, h, lam, anchor, lr=0.1, momentum=0.9,
                           dampening=0.1, weight_decay=0.01)

    eager = [[x.clone() for x in xs] for xs in (g, l, bg, bl)]
    traced = [[x.clone() for x in xs] for xs in (g, l, bg, bl)]
    with torch.no_grad():
        step(*eager)
        torch.compile(step, fullgraph=True, backend="aot_eager")(*traced)
    for xs, ys, before in zip(eager, traced, (g, l, bg, bl)):
        for x, y, b in zip(xs, ys, before):
            assert bitwise_equal(x, y) and not torch.equal(x, b)
