r"""Ensemble-distillation ops (math: ``docs/algorithms/distillation.md``, sections 2-4 and 8).

Two native ops, each with a fake (``torch.compile``) and an autograd formula:

- ``fedkernels::ensemble_pseudo_labels``: the pseudo-labels of K teachers on N samples from
  their logits ``L[K, N, C]`` in one pass per sample: per-sample client weights
  :math:`w_{k,i}` (:math:`\sum_k w_{k,i} = 1`), then

  * ``combine="logits"`` (the paper's default): :math:`y_i = \mathrm{softmax}(\sum_k w_{k,i} L_{k,i}/T)`;
  * ``combine="probs"``: :math:`y_i = \sum_k w_{k,i}\,\mathrm{softmax}(L_{k,i}/T)`.

  The weightings, with :math:`n_k` the optional ``sample_sizes`` and :math:`z` the
  discriminators' logits ``scores[K, N]``:

  * ``uniform`` (FedDF): :math:`w \propto n_k` (1/K without sample sizes);
  * ``entropy`` (FedHKT/FedDS): :math:`\mathrm{softmax}_k(-H(\mathrm{softmax}(L_{k,i}))/\tau + \log n_k)`;
  * ``fedgo``: :math:`\mathrm{softmax}_k(g(z_{k,i}) + \log n_k)`, the odds form of
    :math:`n_k\Phi_k / \sum_j n_j\Phi_j` (Theorem 3.6) with :math:`g = \mathrm{sig}` for the
    paper's double-sigmoid discriminator head (``odds="double_sigmoid"``, the default) or
    :math:`g(z) = z` for the plain head (``odds="exact"``);
  * ``variance`` (Fed-ET): :math:`n_k v_{k,i} / \sum_j n_j v_{j,i}` with :math:`v` the variance of
    the C logits (uniform where every variance is 0);
  * ``domain`` (DaFKD): :math:`n_k\,\mathrm{sig}(z_{k,i}) / \sum_j n_j\,\mathrm{sig}(z_{j,i})`.

  The strategies pass ``sample_sizes`` only to ``fedgo``, as the papers do. Its backward (only
  needed when a generator is trained through the ensemble) is written with torch ops from the
  saved outputs.
- ``fedkernels::distill_kl``: :math:`\ell = s\sum_i\sum_c y_{ic}(\log y_{ic} - \log q_{ic})`,
  :math:`q = \mathrm{softmax}(S/T)`, and in the same pass its gradient
  :math:`\partial\ell/\partial S = (s/T)(q\sum_c y_c - y)` (:math:`(s/T)(q - y)` for a
  normalised target), which the backward only scales by the incoming
  gradient. ``reduction`` picks :math:`s`: ``"batchmean"`` :math:`T^2/N` (default),
  ``"feddf"`` :math:`1/N`, ``"dafkd"`` :math:`T^2/(NC)`, ``"sum"`` :math:`T^2`.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .autograd_bypass import EagerAutograd, grad_can_flow
from .devices import check_device
from .row_softmax import log_softmax_last, softmax_last

_ops = torch.ops.fedkernels

WEIGHTINGS = ("uniform", "fedgo", "entropy", "variance", "domain")
COMBINES = ("logits", "probs")
ODDS = ("double_sigmoid", "exact")
REDUCTIONS = ("batchmean", "feddf", "dafkd", "sum")

__all__ = [
    "WEIGHTINGS",
    "COMBINES",
    "ODDS",
    "REDUCTIONS",
    "ensemble_pseudo_labels",
    "distill_kl",
    "kl_scale",
]


# ---------------------------------------------------------------- public API


def ensemble_pseudo_labels(
    logits: Tensor,
    scores: Tensor | None = None,
    *,
    weighting: str = "uniform",
    sample_sizes: Sequence[float] | Tensor | None = None,
    combine: str = "logits",
    temperature: float = 1.0,
    tau: float = 1.0,
    odds: str = "double_sigmoid",
    return_weights: bool = False,
) -> Tensor | tuple[Tensor, Tensor]:
    r"""Pseudo-labels ``[N, C]`` of K teachers' ``logits[K, N, C]`` (module docstring), in
    ``logits``' dtype (fp32 accumulation for fp16/bf16). ``scores[K, N]``: the discriminators'
    logits, required by ``fedgo`` and ``domain`` and refused by the others. With
    ``return_weights`` also the weights ``[K, N]``."""
    if odds not in ODDS:
        raise ValueError(f"fedkernels.ensemble_pseudo_labels: odds must be one of {ODDS}, not {odds!r}")
    log_prior = None
    if sample_sizes is not None:
        # log n_k in float64 on the CPU; the op checks it is finite (n_k > 0) and moves it.
        log_prior = torch.as_tensor(sample_sizes, dtype=torch.float64,
                                    device=None if isinstance(sample_sizes, Tensor) else "cpu").log()
    inputs = (logits, scores, log_prior, weighting, combine, float(temperature), float(tau),
              odds == "double_sigmoid")
    y, w = _PSEUDO_AUTOGRAD(*inputs)
    return (y, w) if return_weights else y


def _kl_count(reduction: str, num_samples, num_classes):
    """The count the factor of ``reduction`` divides by (ints, or symbols when traced)."""
    n = torch.sym_max(num_samples, 1)
    if reduction in ("batchmean", "feddf"):
        return n
    if reduction == "dafkd":
        return n * torch.sym_max(num_classes, 1)
    if reduction == "sum":
        return 1
    raise ValueError(f"fedkernels.distill_kl: reduction must be one of {REDUCTIONS}, not {reduction!r}")


def kl_scale(reduction: str, num_samples: int, num_classes: int, temperature: float) -> float:
    """The factor :math:`s` of :func:`distill_kl` for ``reduction`` (module docstring)."""
    count = _kl_count(reduction, num_samples, num_classes)
    return (1.0 if reduction == "feddf" else temperature * temperature) / count


def distill_kl(
    student_logits: Tensor,
    pseudo_labels: Tensor,
    temperature: float = 1.0,
    *,
    reduction: str = "batchmean",
) -> Tensor:
    r"""Forward KL(pseudo_labels ‖ softmax(student_logits / T)) scaled by ``reduction``
    (module docstring), with the gradient formed in the same pass when it is needed. Returns a
    0-d float32 tensor (float64 for float64 inputs)."""
    n, c = (student_logits.shape[0], student_logits.shape[1]) if student_logits.dim() == 2 else (1, 1)
    # Traced with a dynamic batch (torch.export, torch.compile), n and c are symbols: a float
    # factor computed from them would fix the graph to one size. The op then takes the part of
    # the factor without them, and the loss is divided by the count as a tensor.
    symbolic = isinstance(n, torch.SymInt) or isinstance(c, torch.SymInt)
    scale = kl_scale(reduction, 1 if symbolic else n, 1 if symbolic else c, float(temperature))
    with_grad = grad_can_flow(student_logits, pseudo_labels)
    loss = _KL_AUTOGRAD(student_logits, pseudo_labels, float(temperature), scale, with_grad)[0]
    if symbolic:
        loss = loss / _kl_count(reduction, n, c)
    return loss


# ---------------------------------------------------------------- fake implementations


@torch.library.register_fake("fedkernels::ensemble_pseudo_labels")
def _ensemble_pseudo_labels_fake(
    logits, scores, log_prior, weighting, combine, temperature, tau, double_sigmoid
):
    torch._check(
        logits.dim() == 3,
        lambda: f"fedkernels.ensemble_pseudo_labels: logits must be [K, N, C], got {logits.dim()}-D",
    )
    k, n, c = logits.shape
    if scores is not None:
        torch._check(
            scores.dim() == 2 and scores.shape[0] == k and scores.shape[1] == n,
            lambda: f"fedkernels.ensemble_pseudo_labels: scores must be [K, N], got {tuple(scores.shape)}",
        )
        check_device("ensemble_pseudo_labels", scores, logits.device, "scores")
    if log_prior is not None:
        check_device(
            "ensemble_pseudo_labels", log_prior, logits.device, "log_prior", allow_cpu=True
        )
    return logits.new_empty((n, c)), logits.new_empty((k, n))


@torch.library.register_fake("fedkernels::distill_kl")
def _distill_kl_fake(student_logits, target, temperature, scale, with_grad):
    torch._check(
        student_logits.dim() == 2,
        lambda: f"fedkernels.distill_kl: student_logits must be [N, C], got {student_logits.dim()}-D",
    )
    torch._check(
        target.shape == student_logits.shape,
        lambda: "fedkernels.distill_kl: pseudo_labels and student_logits differ in shape",
    )
    check_device("distill_kl", target, student_logits.device, "pseudo_labels")
    acc = torch.float64 if student_logits.dtype == torch.float64 else torch.float32
    loss = student_logits.new_empty((), dtype=acc)
    grad = student_logits.new_empty(student_logits.shape if with_grad else (0,))
    return loss, grad


# ---------------------------------------------------------------- autograd


def _pseudo_setup(ctx, inputs, output):
    logits, scores, log_prior, weighting, combine, temperature, tau, double_sigmoid = inputs
    y, w = output
    ctx.weighting, ctx.combine = weighting, combine
    ctx.temperature, ctx.tau, ctx.double_sigmoid = temperature, tau, double_sigmoid
    ctx.has_scores, ctx.has_prior = scores is not None, log_prior is not None
    ctx.save_for_backward(logits, scores, log_prior, y, w)


def _pseudo_backward(ctx, grad_y, grad_w):
    """Three stages (docs/algorithms/distillation.md, "8. Ops"): the combine, the normalisation
    of the weights over clients, the scores (entropy, odds, variance); in the accumulate dtype."""
    logits, scores, log_prior, y, w = ctx.saved_tensors
    acc = torch.float64 if logits.dtype == torch.float64 else torch.float32
    L, y, w = logits.to(acc), y.to(acc), w.to(acc)
    K = L.shape[0]
    T = ctx.temperature
    gy = torch.zeros_like(y) if grad_y is None else grad_y.to(acc)
    # The logits' [K, N, C] terms only when the logits need a gradient; the weights' gradient gw
    # only for the scores', the prior's, and the logits' where the weights depend on the logits
    # (entropy, variance). A distillation step wants the logits' alone, and with FedGO's,
    # DaFKD's or uniform weights skips every stage after the combine.
    need_L, need_s, need_p = ctx.needs_input_grad[:3]
    need_w = need_s or need_p or (need_L and ctx.weighting in ("entropy", "variance"))
    grad_L = None
    gw = grad_w.to(acc) if grad_w is not None else None
    # Combine.
    if ctx.combine == "logits":
        gm = y * (gy - (y * gy).sum(-1, keepdim=True)) / T  # [N, C]
        if need_L:
            grad_L = w[:, :, None] * gm[None]
        if need_w:
            g_comb = (L * gm[None]).sum(-1)
            gw = g_comb if gw is None else gw + g_comb
    else:
        p = softmax_last(L / T)
        if need_L:
            wg = w[:, :, None] * gy[None]
            grad_L = p * (wg - (p * wg).sum(-1, keepdim=True)) / T
        if need_w:
            g_comb = (p * gy[None]).sum(-1)
            gw = g_comb if gw is None else gw + g_comb
    if not need_w:
        return (grad_L.to(logits.dtype) if need_L else None, None, None,
                None, None, None, None, None)
    # Normalisation over clients: d/d(score) of softmax or linear weights.
    centred = gw - (w * gw).sum(0, keepdim=True)  # [K, N]
    grad_scores = grad_prior = None
    weighting = ctx.weighting
    if weighting in ("uniform", "entropy", "fedgo"):
        g_a = w * centred
        if weighting == "entropy" and need_L:
            # a = -H/tau; dH/dL = -P (log P + H).
            logp = log_softmax_last(L)
            p1 = logp.exp()
            h = -(p1 * logp).sum(-1, keepdim=True)
            grad_L = grad_L + (g_a / ctx.tau)[:, :, None] * p1 * (logp + h)
        elif weighting == "fedgo" and need_s:
            z = scores.to(acc)
            if ctx.double_sigmoid:
                sz = torch.sigmoid(z)
                grad_scores = g_a * sz * (1 - sz)
            else:
                grad_scores = g_a
        if ctx.has_prior and need_p:
            grad_prior = g_a.sum(1)
    else:
        n = log_prior.to(acc).to(L.device).exp() if ctx.has_prior else torch.ones(
            K, dtype=acc, device=L.device)
        if weighting == "variance":
            base = L.var(dim=-1, unbiased=False)
        else:
            base = torch.sigmoid(scores.to(acc))
        mass = n[:, None] * base
        total = mass.sum(0, keepdim=True)
        g_s = torch.where(total > 0, centred / total.clamp_min(torch.finfo(acc).tiny), 0.0)
        if weighting == "variance":
            if need_L:
                C = L.shape[-1]
                grad_L = grad_L + (g_s * n[:, None])[:, :, None] * 2.0 / C * (
                    L - L.mean(-1, keepdim=True))
        elif need_s:
            grad_scores = g_s * n[:, None] * base * (1 - base)
        if ctx.has_prior and need_p:
            grad_prior = (g_s * mass).sum(1)
    grad_logits = grad_L.to(logits.dtype) if need_L else None
    if grad_scores is not None:
        grad_scores = grad_scores.to(scores.dtype)
    elif ctx.has_scores and need_s:
        grad_scores = torch.zeros_like(scores)
    if grad_prior is not None:
        grad_prior = grad_prior.to(log_prior.dtype).to(log_prior.device)
    return grad_logits, grad_scores, grad_prior, None, None, None, None, None


torch.library.register_autograd(
    "fedkernels::ensemble_pseudo_labels", _pseudo_backward, setup_context=_pseudo_setup
)
_PSEUDO_AUTOGRAD = EagerAutograd(_ops.ensemble_pseudo_labels.default, _pseudo_setup,
                                 _pseudo_backward)


def _is_one(grad_loss: Tensor) -> bool:
    """Whether the incoming gradient is a plain CPU 1.0, as ``loss.backward()`` passes: then
    the kernel's gradient needs no scaling pass (a read and a write of N x C values, and a fresh
    output's page faults). Autograd copies a gradient it cannot take over (``_kl_setup``), so
    handing on the saved tensor is safe. Reading the value would synchronise a GPU and cannot be
    traced, so anything but an eager CPU tensor takes the multiplication."""
    return (type(grad_loss) is torch.Tensor and grad_loss.device.type == "cpu"
            and grad_loss.numel() == 1 and not torch.compiler.is_compiling()
            and grad_loss.item() == 1.0)


def _kl_setup(ctx, inputs, output):
    student, target, temperature, scale, with_grad = inputs
    _, grad = output
    ctx.temperature, ctx.scale, ctx.with_grad = temperature, scale, with_grad
    ctx.save_for_backward(student, target, grad)
    # Nothing flows into the gradient output: materialised, its zero gradient would be an N x C
    # fill per loss.backward(), a large part of a training step.
    ctx.set_materialize_grads(False)
    # Marked, the gradient output is saved as itself: autograd then copies the gradient handed
    # on from it (_is_one) while a retained graph still holds it, and takes it over only once
    # the graph is freed. Unmarked, it would be saved as a separate alias that autograd does
    # not count: with retain_graph, x.grad would become the saved gradient, and an in-place
    # change of x.grad (clipping, zeroing) would make the next backward through the graph fail.
    ctx.mark_non_differentiable(grad)


def _kl_backward(ctx, grad_loss, _grad_of_grad):
    student, target, grad = ctx.saved_tensors
    need_s, need_t = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
    grad_s = grad_t = None
    if grad_loss is None:
        grad_loss = torch.zeros((), dtype=torch.float32, device=student.device)
    if need_s:
        # The kernel's gradient is a constant to autograd: with create_graph (grad mode on in
        # backward) the formula below, which PyTorch can differentiate again, is used instead.
        if ctx.with_grad and not torch.is_grad_enabled():
            if _is_one(grad_loss):  # loss.backward(): the kernel's gradient as it is
                grad_s = grad
            else:
                grad_s = (grad.to(grad_loss.dtype) * grad_loss).to(student.dtype)
        else:  # or the forward ran without a gradient (e.g. under no_grad, then re-entered)
            q = softmax_last(student.to(grad_loss.dtype) / ctx.temperature)
            y = target.to(q.dtype)
            grad_s = (ctx.scale / ctx.temperature * (q * y.sum(-1, keepdim=True) - y) * grad_loss
                      ).to(student.dtype)
    if need_t:
        acc = grad_loss.dtype
        y = target.to(acc)
        log_q = log_softmax_last(student.to(acc) / ctx.temperature)
        grad_t = (ctx.scale * (torch.log(y) + 1 - log_q) * grad_loss).to(target.dtype)
    return grad_s, grad_t, None, None, None


torch.library.register_autograd("fedkernels::distill_kl", _kl_backward, setup_context=_kl_setup)


_KL_AUTOGRAD = EagerAutograd(_ops.distill_kl.default, _kl_setup, _kl_backward)


def _vmap_each(op):
    """A ``torch.vmap`` rule that calls ``op`` once per batch entry: what PyTorch's fallback
    does, without its warning that asks the op's authors for a rule. (A loss per entry has no
    cheaper batched form; the pseudo-labels' blocks are per entry too.)"""
    def rule(info, in_dims, *args):
        def entry(b):
            return op(*(a if d is None else a.select(d, b) for a, d in zip(args, in_dims)))

        outputs = [torch.stack(o) for o in zip(*(entry(b) for b in range(info.batch_size)))]
        return tuple(outputs), (0,) * len(outputs)
    return rule


torch.library.register_vmap("fedkernels::distill_kl", _vmap_each(_ops.distill_kl))
torch.library.register_vmap("fedkernels::ensemble_pseudo_labels",
                            _vmap_each(_ops.ensemble_pseudo_labels))
