"""Pure-PyTorch references of every fedkernels op.

They are written for clarity, not speed: the tests compare the native ops against them and
the benchmarks time them as the baseline a user could write. The native ops never fall back
to them.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import torch
from torch import Tensor


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def weighted_sum_reference(
    updates: Sequence[Sequence[Tensor]],
    weights: Sequence[float] | Tensor,
    base: Sequence[Tensor] | None = None,
    scale: float = 1.0,
    delta: bool = False,
) -> list[Tensor]:
    """Tensor-list form of ``fedkernels::weighted_sum``: ``updates[k][t]`` is tensor t of client k.

    plain: ``scale * sum_k w_k x_k``; delta: ``b + scale * sum_k w_k (x_k - b)``;
    accumulate (base without delta): ``b + scale * sum_k w_k x_k``. Accumulates in client order
    in fp32 (fp64 for fp64 inputs) and stores in base's dtype (or the updates').
    """
    w = torch.as_tensor(weights, dtype=torch.float64).tolist()
    result = []
    for t in range(len(updates[0])):
        acc_dtype = _acc_dtype(updates[0][t].dtype)
        b = None if base is None else base[t].to(acc_dtype)
        acc = torch.zeros(updates[0][t].shape, dtype=acc_dtype, device=updates[0][t].device)
        for k, client in enumerate(updates):
            x = client[t].to(acc_dtype)
            acc = acc + w[k] * (x - b if delta else x)
        res = scale * acc if b is None else b + scale * acc
        out_dtype = updates[0][t].dtype if base is None else base[t].dtype
        result.append(res.to(out_dtype))
    return result


def _int_reference(values: list[Tensor], base: Tensor | None, policy: str) -> Tensor:
    if policy == "first":
        return values[0].clone()
    if policy == "skip":
        return (base if base is not None else values[0]).clone()
    if policy == "max":
        out = values[0].clone()
        for v in values[1:]:
            out = torch.maximum(out, v)
        return out
    raise TypeError(f"integer tensor with int_policy={policy!r}")


def aggregate_reference(
    updates,
    weights,
    *,
    base=None,
    scale: float = 1.0,
    normalize: bool = False,
    int_policy: str = "max",
):
    """What :func:`fedkernels.aggregate` computes, written with plain loops.

    ``updates`` is a list of state_dicts, a list of tensor lists, a list of tensors, or a
    ``[K, P]`` tensor.
    """
    w = torch.as_tensor(weights, dtype=torch.float64).cpu()
    if normalize:
        w = w / w.sum()
    delta = base is not None
    if isinstance(updates, Tensor):
        rows = [[updates[k]] for k in range(updates.shape[0])]
        b = None if base is None else [base]
        return weighted_sum_reference(rows, w, b, scale, delta)[0]
    if isinstance(updates[0], Tensor):  # one tensor per client: the result is one tensor
        out = aggregate_reference(
            [[u] for u in updates], w, base=None if base is None else [base], scale=scale,
            normalize=False, int_policy=int_policy,
        )
        return out[0]
    if isinstance(updates[0], Mapping):
        result = {}
        for name, first in updates[0].items():
            values = [client[name] for client in updates]
            b = None if base is None else base[name]
            if first.is_floating_point():
                result[name] = weighted_sum_reference(
                    [[v] for v in values], w, None if b is None else [b], scale, delta
                )[0]
            else:
                result[name] = _int_reference(values, b, int_policy)
        return result
    names = list(range(len(updates[0])))
    as_dicts = [dict(zip(names, client)) for client in updates]
    b = None if base is None else dict(zip(names, base))
    out = aggregate_reference(
        as_dicts, w, base=b, scale=scale, normalize=False, int_policy=int_policy
    )
    return [out[n] for n in names]


# ---------------------------------------------------------------- SuPerFed
# Math: docs/algorithms/superfed.md, sections 2-4 and 8; the ops are in fedkernels/ops/mixing.py.


def mix_endpoints_reference(
    global_params: Sequence[Tensor], local_params: Sequence[Tensor], lam
) -> list[Tensor]:
    """``theta_t = lerp(g_t, l_t, lam_t)`` with one lam for all tensors or one per tensor,
    in fp32 for half types (differentiable in all three arguments)."""
    lam = torch.as_tensor(lam, dtype=torch.float64)
    lams = lam.reshape(-1).expand(len(global_params))
    out = []
    for t, (g, l) in enumerate(zip(global_params, local_params)):
        acc = _acc_dtype(g.dtype)
        w = lams[t].to(acc)
        out.append(torch.lerp(g.to(acc), l.to(acc), w.to(g.device)).to(g.dtype))
    return out


def superfed_stats_reference(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor] = (),
    anchor: Sequence[Tensor] = (),
) -> Tensor:
    """Float64 ``[T, 4]`` rows ``[<g,l>, ||g||^2, ||l||^2, ||g-a||^2]`` (0 for a missing list)."""
    rows = []
    for t, g in enumerate(global_params):
        g64 = g.double()
        zero = g64.new_zeros(())
        l64 = local_params[t].double() if len(local_params) else None
        a64 = anchor[t].double() if len(anchor) else None
        rows.append(torch.stack([
            (g64 * l64).sum() if l64 is not None else zero,
            (g64 * g64).sum(),
            (l64 * l64).sum() if l64 is not None else zero,
            ((g64 - a64) ** 2).sum() if a64 is not None else zero,
        ]))
    if not rows:
        return torch.zeros((0, 4), dtype=torch.float64)
    return torch.stack(rows)


def superfed_sgd_step_reference(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    global_momentum: Sequence[Tensor],
    local_momentum: Sequence[Tensor],
    grads: Sequence[Tensor],
    grad_stats: Tensor,
    lam,
    anchor: Sequence[Tensor] = (),
    *,
    lr: float,
    momentum: float = 0.0,
    dampening: float = 0.0,
    weight_decay: float = 0.0,
    nesterov: bool = False,
    first_step: bool | tuple[bool, bool] = False,
) -> tuple[list[Tensor], list[Tensor], list[Tensor], list[Tensor]]:
    """New ``(g, l, global_momentum, local_momentum)`` of ``fedkernels::superfed_sgd_step_``
    (out of place; the buffer lists are empty with momentum 0): the mixing-with-statistics
    gradients given to torch.optim.SGD's update, in fp32 for half types."""
    n = len(global_params)
    lams = torch.as_tensor(lam, dtype=torch.float64).reshape(-1).expand(n)
    firsts = (first_step, first_step) if isinstance(first_step, bool) else tuple(first_step)
    h = grad_stats.double().cpu()

    def sgd(p, d, buf, first):
        if weight_decay:
            d = d + weight_decay * p
        if momentum:
            buf = d.clone() if first else buf * momentum + (1 - dampening) * d
            d = d + momentum * buf if nesterov else buf
        return p - lr * d, buf

    out: tuple[list[Tensor], ...] = ([], [], [], [])
    for t in range(n):
        dtype = global_params[t].dtype
        acc = _acc_dtype(dtype)
        g, l, G = (x[t].to(acc) for x in (global_params, local_params, grads))
        w = float(lams[t])
        h0, h1, h2, h3 = (float(v) for v in h[t])
        grad_g = (1 - w) * G + h0 * l + 2 * h1 * g
        if len(anchor):
            grad_g = grad_g + 2 * h3 * (g - anchor[t].to(acc))
        grad_l = w * G + h0 * g + 2 * h2 * l
        bufs = ([x[t].to(acc) for x in (global_momentum, local_momentum)] if momentum
                else [None, None])
        for p, d, buf, first, k in ((g, grad_g, bufs[0], firsts[0], 0),
                                    (l, grad_l, bufs[1], firsts[1], 1)):
            new_p, new_buf = sgd(p, d, buf, first)
            out[k].append(new_p.to(dtype))
            if momentum:
                out[k + 2].append(new_buf.to(dtype))
    return out


def cosine_orthogonality_reference(
    global_params: Sequence[Tensor],
    local_params: Sequence[Tensor],
    per_tensor: bool = False,
    numerator_eps: float = 0.0,
    eps: float = 1e-12,
) -> Tensor:
    """``(<g,l> + numerator_eps * N)^2 / (||g||^2 ||l||^2 + eps)`` over the flattened model (or
    per tensor), written as the official code does with per-tensor Python loops, in float64."""
    if per_tensor:
        return torch.stack([
            cosine_orthogonality_reference([g], [l], False, numerator_eps, eps)
            for g, l in zip(global_params, local_params)
        ])
    pairs = zip(global_params, local_params)
    s = sum((g.double() * l.double() + numerator_eps).sum() for g, l in pairs)
    a = sum(g.double().pow(2).sum() for g in global_params)
    b = sum(l.double().pow(2).sum() for l in local_params)
    return torch.as_tensor(s) ** 2 / (a * b + eps)


def proximal_term_reference(
    global_params: Sequence[Tensor],
    anchor: Sequence[Tensor],
    mu: float = 1.0,
    form: str = "paper",
) -> Tensor:
    """paper: ``mu/2 * sum_p ||g_p - a_p||^2``; code: ``mu * sum_p ||g_p - a_p||`` (torch.norm,
    whose gradient is 0 at 0), in float64."""
    diffs = [g.double() - a.double() for g, a in zip(global_params, anchor)]
    if form == "paper":
        return 0.5 * mu * sum((d**2).sum() for d in diffs)
    return mu * sum(torch.linalg.vector_norm(d) for d in diffs)


# ---------------------------------------------------------------- Ensemble distillation
# Math: docs/algorithms/distillation.md, sections 2-4. The composition a user would write with
# torch ops.


def ensemble_weights_reference(
    logits: Tensor,
    scores: Tensor | None = None,
    weighting: str = "uniform",
    sample_sizes: Sequence[float] | Tensor | None = None,
    tau: float = 1.0,
    odds: str = "double_sigmoid",
) -> Tensor:
    """Per-sample client weights ``w[K, N]`` (each column sums to 1) in the accumulate dtype:
    uniform, entropy ``softmax(-H/tau)``, fedgo ``softmax(g(z) + log n)``, variance
    ``n v / sum n v`` (uniform where every v is 0), domain ``n sig(z) / sum n sig(z)``."""
    acc = _acc_dtype(logits.dtype)
    L = logits.to(acc)
    K, N, _ = L.shape
    log_n = (
        torch.zeros(K, dtype=acc, device=L.device)
        if sample_sizes is None
        else torch.as_tensor(sample_sizes, dtype=torch.float64).log().to(acc).to(L.device)
    )
    if weighting in ("uniform", "entropy", "fedgo"):
        if weighting == "uniform":
            a = torch.zeros(K, N, dtype=acc, device=L.device)
        elif weighting == "entropy":
            p = torch.softmax(L, dim=-1)
            plogp = torch.where(p == 0, 0.0, p * torch.log_softmax(L, dim=-1))  # 0 log 0 = 0
            a = plogp.sum(-1) / tau  # -H / tau
        else:
            z = scores.to(acc)
            a = torch.sigmoid(z) if odds == "double_sigmoid" else z
        return torch.softmax(a + log_n[:, None], dim=0)
    if weighting == "variance":
        s = L.var(dim=-1, unbiased=False)
    elif weighting == "domain":
        s = torch.sigmoid(scores.to(acc))
    else:
        raise ValueError(f"unknown weighting {weighting!r}")
    s = s * log_n.exp()[:, None]
    total = s.sum(0, keepdim=True)
    return torch.where(total > 0, s / total.clamp_min(torch.finfo(acc).tiny), 1.0 / K)


def ensemble_pseudo_labels_reference(
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
):
    """``y[N, C]``: ``softmax(sum_k w_k L_k / T)`` (logits) or ``sum_k w_k softmax(L_k / T)``
    (probs), with ``w`` from :func:`ensemble_weights_reference`; in ``logits``' dtype."""
    acc = _acc_dtype(logits.dtype)
    L = logits.to(acc)
    w = ensemble_weights_reference(logits, scores, weighting, sample_sizes, tau, odds)
    if combine == "logits":
        y = torch.softmax((w[:, :, None] * L).sum(0) / temperature, dim=-1)
    else:
        y = (w[:, :, None] * torch.softmax(L / temperature, dim=-1)).sum(0)
    y = y.to(logits.dtype)
    return (y, w.to(logits.dtype)) if return_weights else y


def distill_kl_reference(
    student_logits: Tensor,
    pseudo_labels: Tensor,
    temperature: float = 1.0,
    scale: float | None = None,
) -> Tensor:
    """``scale * sum_i sum_c y (log y - log_softmax(S/T))`` with ``0 log 0 = 0``; default scale
    ``T^2 / N`` (forward KL, batchmean). Float32 (float64 for float64 inputs)."""
    acc = _acc_dtype(student_logits.dtype)
    n = student_logits.shape[0]
    if scale is None:
        scale = temperature**2 / max(n, 1)
    log_q = torch.log_softmax(student_logits.to(acc) / temperature, dim=-1)
    y = pseudo_labels.to(acc)
    return scale * (torch.xlogy(y, y) - y * log_q).sum()


# ---------------------------------------------------------------- FedEvg / SGLD
# Math: docs/algorithms/fedevg.md, sections 2, 4 and 5.


def energy_from_logits_reference(logits: Tensor, labels: Tensor | None = None) -> Tensor:
    """``-logits[i, labels_i]`` or ``-logsumexp_c logits[i, c]``."""
    acc = _acc_dtype(logits.dtype)
    f = logits.to(acc)
    e = -f.gather(1, labels[:, None])[:, 0] if labels is not None else -torch.logsumexp(f, dim=1)
    return e.to(logits.dtype)


def _clamp_bounds(clamp):
    return (None, None) if clamp is None else (clamp[0], clamp[1])


def sgld_step_reference(
    x: Tensor,
    grad: Tensor,
    step_size: float,
    noise_std: float,
    noise: Tensor | None = None,
    grad_clip: float | None = None,
    clamp: tuple[float, float] | None = None,
) -> Tensor:
    """``clamp(x - step * clip(grad, -tau, tau) + std * noise, lo, hi)``, in fp32 for
    fp16/bf16 (fp64 for fp64); ``noise=None`` means no noise."""
    acc = _acc_dtype(x.dtype)
    g = grad.to(acc)
    if grad_clip is not None:
        g = g.clamp(-grad_clip, grad_clip)
    v = x.to(acc) - step_size * g
    if noise is not None:
        v = v + noise_std * noise.to(acc)
    lo, hi = _clamp_bounds(clamp)
    if lo is not None or hi is not None:
        v = v.clamp(lo, hi)
    return v.to(x.dtype)


def sgld_compose_weights_reference(
    energies: Tensor, log_weights: Tensor, mode: str = "exact", dtype: torch.dtype | None = None
) -> Tensor:
    """``pi[K, M] = softmax_k(log w_k + phi(-E_kj))``, phi = identity (exact: the weights of the
    mixture's energy gradient) or sign (signed, FedEvg's choice), computed in ``dtype``
    (default: fp64 for fp64 energies, else fp32)."""
    acc = dtype or (torch.float64 if energies.dtype == torch.float64 else torch.float32)
    e = energies.to(acc)
    phi = -e if mode == "exact" else torch.sign(-e)
    return torch.softmax(log_weights.to(acc)[:, None] + phi, dim=0)


def sgld_compose_step_reference(
    x: Tensor,
    grads: Tensor,
    energies: Tensor,
    log_weights: Tensor,
    step_size: float,
    noise_std: float,
    noise: Tensor | None = None,
    mode: str = "exact",
    grad_clip: float | None = None,
    clamp: tuple[float, float] | None = None,
) -> tuple[Tensor, Tensor]:
    """FedEvg's composed server step in PyTorch: ``(x', pi)`` with
    ``a_j = sum_k pi_kj clip(G_kj)`` and ``x' = clamp(x - step a + std noise)``."""
    acc = _acc_dtype(x.dtype)
    pi = sgld_compose_weights_reference(energies, log_weights, mode, acc)
    g = grads.to(acc)
    if grad_clip is not None:
        g = g.clamp(-grad_clip, grad_clip)
    shape = (grads.shape[0], grads.shape[1]) + (1,) * (x.dim() - 1)
    a = (pi.reshape(shape) * g).sum(0)
    return _step_from_direction(x, a, step_size, noise_std, noise, clamp), pi


def _step_from_direction(x, a, step_size, noise_std, noise, clamp):
    """``clamp(x - step a + std noise)`` in a's (accumulate) dtype, cast to x's."""
    acc = a.dtype
    v = x.to(acc) - step_size * a
    if noise is not None:
        v = v + noise_std * noise.to(acc)
    lo, hi = _clamp_bounds(clamp)
    if lo is not None or hi is not None:
        v = v.clamp(lo, hi)
    return v.to(x.dtype)


# ---------------------------------------------------------------- robust aggregation and DP
# Client lists are client-major: clients[k * T + t] is tensor t of client k.


def _by_tensor(clients: Sequence[Tensor], num_clients: int) -> list[list[Tensor]]:
    T = len(clients) // num_clients
    return [[clients[k * T + t] for k in range(num_clients)] for t in range(T)]


def _sorted_values(tensors: list[Tensor]) -> Tensor:
    """The K values of each coordinate sorted ascending along dim 0 (NaN last), in the
    accumulate type (exact for float16/bfloat16)."""
    stack = torch.stack([t.reshape(-1) for t in tensors]).to(_acc_dtype(tensors[0].dtype))
    return torch.sort(stack, dim=0).values


def _ascending_sum(rows: Tensor) -> Tensor:
    acc = rows[0].clone()
    for r in rows[1:]:
        acc += r
    return acc


def _true_mean(total: Tensor, count: int) -> Tensor:
    """``total / count`` rounded once, as the kernels divide: PyTorch's CUDA division by a
    Python number multiplies by its rounded reciprocal instead (one bit off at times)."""
    return total / torch.full_like(total, count)


def _median_values(s: Tensor) -> Tensor:
    n = s.shape[0]
    return s[n // 2].clone() if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


def coordinate_median_reference(clients: Sequence[Tensor], num_clients: int) -> list[Tensor]:
    """``np.median`` over the clients, per tensor; NaN where any client is NaN."""
    out = []
    for tensors in _by_tensor(clients, num_clients):
        s = _sorted_values(tensors)
        med = _median_values(s)
        med[torch.isnan(s).any(dim=0)] = float("nan")
        out.append(med.to(tensors[0].dtype).reshape(tensors[0].shape))
    return out


def trimmed_mean_reference(clients: Sequence[Tensor], num_clients: int, cut: int) -> list[Tensor]:
    """Mean of ranks [cut, K - cut) per coordinate (NaN sorts last), summed in ascending order."""
    out = []
    for tensors in _by_tensor(clients, num_clients):
        kept = _sorted_values(tensors)[cut:num_clients - cut]
        out.append(_true_mean(_ascending_sum(kept), kept.shape[0]).to(tensors[0].dtype)
                   .reshape(tensors[0].shape))
    return out


def median_window_mean_reference(clients: Sequence[Tensor], num_clients: int,
                                 window: int) -> list[Tensor]:
    """Mean of the ``window`` values closest to each coordinate's median: a contiguous range of
    the sorted values grown from the lower middle one towards the closer side (lower on a tie)."""
    out = []
    n = num_clients
    for tensors in _by_tensor(clients, num_clients):
        s = _sorted_values(tensors)
        med = _median_values(s)
        cols = torch.arange(s.shape[1], device=s.device)
        lo = torch.full((s.shape[1],), (n - 1) // 2, dtype=torch.long, device=s.device)
        hi = lo.clone()
        inf = torch.full_like(med, float("inf"))
        for _ in range(window - 1):
            can_lo, can_hi = lo > 0, hi < n - 1
            d_lo = torch.where(can_lo, (med - s[(lo - 1).clamp(min=0), cols]).abs(), inf)
            d_hi = torch.where(can_hi, (s[(hi + 1).clamp(max=n - 1), cols] - med).abs(), inf)
            take_lo = can_lo & ((d_lo <= d_hi) | ~can_hi)
            lo = torch.where(take_lo, lo - 1, lo)
            hi = torch.where(take_lo, hi, hi + 1)
        total = torch.zeros_like(med)
        for r in range(n):
            total = torch.where((lo <= r) & (r <= hi), total + s[r], total)
        result = _true_mean(total, window)
        result[torch.isnan(s).any(dim=0)] = float("nan")
        out.append(result.to(tensors[0].dtype).reshape(tensors[0].shape))
    return out


def pairwise_sq_distances_reference(clients: Sequence[Tensor], num_clients: int) -> Tensor:
    """[K, K] float64 squared distances over all tensors, from float64 differences; the
    diagonal is 0 (a client's distance to itself is not computed, even with NaN/Inf)."""
    K = num_clients
    device = clients[0].device if clients else torch.device("cpu")
    d = torch.zeros(K, K, dtype=torch.float64, device=device)
    for tensors in _by_tensor(clients, num_clients):
        x = torch.stack([t.reshape(-1) for t in tensors]).to(torch.float64)
        for i in range(K):
            d[i] += ((x - x[i]) ** 2).sum(dim=1)
    return d.fill_diagonal_(0.0)


def update_norms_reference(clients: Sequence[Tensor], num_clients: int,
                           base: Sequence[Tensor]) -> Tensor:
    """[K] float64 norms of x_k - base over all tensors."""
    device = clients[0].device if clients else torch.device("cpu")
    sq = torch.zeros(num_clients, dtype=torch.float64, device=device)
    for tensors, b in zip(_by_tensor(clients, num_clients), base):
        for k, x in enumerate(tensors):
            sq[k] += ((x.to(torch.float64) - b.to(torch.float64)) ** 2).sum()
    return sq.sqrt()


def private_sum_reference(clients: Sequence[Tensor], coefficients: Tensor,
                          base: Sequence[Tensor], noise_std: float,
                          noise: Sequence[Tensor] | None = None) -> list[Tensor]:
    """``base + sum_k c_k (x_k - base) + noise_std * noise`` per tensor, clients in order, in
    the accumulate type; ``noise``: one standard-normal tensor per base tensor (None: none)."""
    K = coefficients.numel()
    coef = coefficients.tolist()
    out = []
    for t, (tensors, b) in enumerate(zip(_by_tensor(clients, K), base)):
        acc_type = _acc_dtype(b.dtype)
        bb = b.to(acc_type)
        acc = torch.zeros_like(bb)
        for c, x in zip(coef, tensors):
            acc += torch.tensor(c, dtype=acc_type) * (x.to(acc_type) - bb)
        r = bb + acc
        if noise is not None and noise_std != 0:
            r = r + torch.tensor(noise_std, dtype=acc_type) * noise[t].to(acc_type)
        out.append(r.to(b.dtype))
    return out


# ---------------------------------------------------------------- quantized updates

_M32 = 0xFFFFFFFF


def philox_words_reference(seed: int, offset: int, groups: Tensor) -> list[Tensor]:
    """The four output words of ``at::philox_engine(seed, subsequence=g, offset)`` for each
    group g (int64 tensor), as int64 tensors: Philox-4x32-10, products split in 16-bit halves
    so that no int64 overflows."""
    seed &= 2**64 - 1
    offset &= 2**64 - 1

    def mulhilo(m, x):
        low, high = m * (x & 0xFFFF), m * (x >> 16)
        return (high + (low >> 16)) >> 16, (((high & 0xFFFF) << 16) + low) & _M32

    x0 = torch.full_like(groups, offset & _M32)
    x1 = torch.full_like(groups, offset >> 32)
    x2, x3 = groups & _M32, groups >> 32
    k0, k1 = seed & _M32, seed >> 32
    for r in range(10):
        if r:
            k0, k1 = (k0 + 0x9E3779B9) & _M32, (k1 + 0xBB67AE85) & _M32
        hi0, lo0 = mulhilo(0xD2511F53, x0)
        hi1, lo1 = mulhilo(0xCD9E8D57, x2)
        x0, x1, x2, x3 = hi1 ^ x1 ^ k0, lo1, hi0 ^ x3 ^ k1, lo0
    return [x0, x1, x2, x3]


def _uniforms_reference(seed: int, offset: int, first: int, n: int, device) -> Tensor:
    """The float32 uniforms (word >> 8) 2^-24 of elements first..first + n of a list: word
    e % 4 of the Philox block (seed, subsequence e / 4, offset)."""
    e = torch.arange(first, first + n, dtype=torch.int64)
    words = torch.stack(philox_words_reference(seed, offset, e // 4), 1)
    word = words.gather(1, (e % 4).unsqueeze(1)).squeeze(1)
    return ((word >> 8).to(torch.float32) * 2.0**-24).to(device)


def _quantize_blocks_reference(x, block_size, levels, stochastic, seed, offset, residual):
    """Per tensor: (flat levels q as int8, scales, new residual) of the per-block quantizers."""
    levels_out, scales, new_res = [], [], []
    first = 0
    for t, xt in enumerate(x):
        acc = _acc_dtype(xt.dtype)
        v = xt.reshape(-1).to(acc)
        if residual is not None:
            v = v + residual[t].reshape(-1).to(acc)
        n = v.numel()
        nb = (n + block_size - 1) // block_size
        pad = torch.zeros(nb * block_size, dtype=acc, device=v.device)
        pad[:n] = v
        blocks = pad.reshape(nb, block_size)
        amax = blocks.abs().amax(dim=1) if nb else torch.zeros(0, dtype=acc, device=v.device)
        finite = torch.isfinite(blocks).all(dim=1)
        s = torch.where(finite, amax / levels, torch.full_like(amax, float("nan"))).to(torch.float32)
        se = s.repeat_interleave(block_size)[:n].to(acc)
        ok = se > 0
        w = v / torch.where(ok, se, torch.ones_like(se))
        if stochastic:
            r = torch.floor(w + _uniforms_reference(seed, offset, first, n, v.device).to(acc))
        else:
            r = torch.round(w)
        q = torch.where(ok, r.clamp(-levels, levels), torch.zeros_like(r)).to(torch.int8)
        levels_out.append(q)
        scales.append(s)
        if residual is not None:
            new_res.append((v - q.to(acc) * se).to(xt.dtype).reshape(xt.shape))
        first += n
    return levels_out, scales, (new_res if residual is not None else None)


def quantize_int8_reference(
    x: Sequence[Tensor],
    block_size: int,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    residual: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
    """(values, scales, new residual) of ``fedkernels::quantize_int8``: per tensor, blocks of
    ``block_size`` elements in C order, v = x (+ residual) in the accumulate type,
    s = float32(max|v| / 127) (NaN for a block with a NaN or inf), q = round(v / s) (ties to
    even) or floor(v / s + u) with u = (word >> 8) 2^-24, clamped to [-127, 127], 0 where s is
    0 or NaN; residual' = v - q s."""
    q, scales, new_res = _quantize_blocks_reference(x, block_size, 127, stochastic, seed, offset,
                                                    residual)
    return [qt.reshape(xt.shape) for qt, xt in zip(q, x)], scales, new_res


def pack_int4_reference(q: Tensor) -> Tensor:
    """Levels in [-8, 7] (flat) packed two a byte: element 2j in the low nibble of byte j,
    2j + 1 in the high one (a 0 nibble after an odd count)."""
    n = q.numel()
    nib = torch.zeros(n + n % 2, dtype=torch.int16, device=q.device)
    nib[:n] = q.to(torch.int16) & 0xF
    return (nib[0::2] | (nib[1::2] << 4)).to(torch.uint8)


def unpack_int4_reference(packed: Tensor, n: int) -> Tensor:
    """The n signed levels (int8) of a packed tensor."""
    b = packed.to(torch.int16)
    nib = torch.stack([b & 0xF, (b >> 4) & 0xF], 1).reshape(-1)[:n]
    return ((nib ^ 8) - 8).to(torch.int8)


def quantize_int4_reference(
    x: Sequence[Tensor],
    block_size: int,
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    residual: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
    """(packed values, scales, new residual) of ``fedkernels::quantize_int4``: as
    :func:`quantize_int8_reference` with s = float32(max|v| / 7) and levels in [-7, 7], packed by
    :func:`pack_int4_reference`."""
    q, scales, new_res = _quantize_blocks_reference(x, block_size, 7, stochastic, seed, offset,
                                                    residual)
    return [pack_int4_reference(qt) for qt in q], scales, new_res


FP8_MAX = 448.0


def fp8_round_reference(w: Tensor, u: Tensor | None = None) -> Tensor:
    """The e4m3fn grid value of w (same dtype): |w| saturated to 448, then to nearest (ties to
    even), or with uniforms u up iff u < the fractional distance to the next grid value."""
    a = w.abs().clamp(max=FP8_MAX)
    _, e = torch.frexp(a)  # a in [2^(e-1), 2^e)
    step = torch.where(a < 2.0**-6, torch.full_like(a, 2.0**-9),
                       torch.ldexp(torch.ones_like(a), (e - 4).to(a.dtype)))
    m = a / step
    if u is None:
        r = torch.round(m)
    else:
        fl = torch.floor(m)
        r = fl + (u.to(a.dtype) < m - fl).to(a.dtype)
    q = r * step
    return torch.where(torch.signbit(w), -q, q)  # -0 stays -0, as in a cast to e4m3fn


def quantize_fp8_reference(
    x: Sequence[Tensor],
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
    residual: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
    """(values, scales, new residual) of ``fedkernels::quantize_fp8``: per tensor,
    v = x (+ residual) in the accumulate type, s = float32(max|v| / 448) (0 for an empty
    tensor, NaN with a NaN or inf), q = :func:`fp8_round_reference` (v / s) as e4m3fn, 0 where
    s is 0 or NaN; residual' = v - q s."""
    values, scales, new_res = [], [], []
    first = 0
    for t, xt in enumerate(x):
        acc = _acc_dtype(xt.dtype)
        v = xt.reshape(-1).to(acc)
        if residual is not None:
            v = v + residual[t].reshape(-1).to(acc)
        n = v.numel()
        amax = v.abs().max() if n else torch.zeros((), dtype=acc, device=v.device)
        finite = bool(torch.isfinite(v).all())
        s = (amax / FP8_MAX if finite else torch.full_like(amax, float("nan"))).to(torch.float32)
        sa = s.to(acc)
        ok = bool(sa > 0)
        w = v / (sa if ok else torch.ones_like(sa))
        u = _uniforms_reference(seed, offset, first, n, v.device) if stochastic else None
        q = fp8_round_reference(w, u) if ok else torch.zeros_like(v)
        values.append(q.to(torch.float8_e4m3fn).reshape(xt.shape))
        scales.append(s.reshape(1))
        if residual is not None:
            new_res.append((v - q * sa).to(xt.dtype).reshape(xt.shape))
        first += n
    return values, scales, (new_res if residual is not None else None)


def dequantize_weighted_sum_reference(
    values: Sequence[Tensor],
    scales: Sequence[Tensor],
    weights: Sequence[float] | Tensor,
    block_size: int,
    dtype: torch.dtype = torch.float32,
    numels: Sequence[int] | None = None,
) -> list[Tensor]:
    """``sum_k (w_k s_kb) q_k`` per tensor over clients given client-major
    (``values[k * T + t]``), float32 in client order, stored as ``dtype``. The format follows
    the values' dtype: int8; uint8 packed 4-bit (``numels``: the element counts; results 1-D);
    float8_e4m3fn with one scale per tensor (``block_size`` unused)."""
    w = torch.as_tensor(weights, dtype=torch.float64).to(torch.float32)
    K = w.numel()
    T = len(values) // K
    out = []
    for t in range(T):
        packed = values[t].dtype == torch.uint8
        n = numels[t] if packed else values[t].numel()
        acc = torch.zeros(n, dtype=torch.float32, device=values[t].device)
        for k in range(K):
            c = w[k].to(scales[k * T + t].device) * scales[k * T + t]
            q = values[k * T + t]
            q = unpack_int4_reference(q, n) if packed else q.reshape(-1)
            ce = c.expand(n) if q.dtype == torch.float8_e4m3fn else \
                c.repeat_interleave(block_size)[:n]
            acc = acc + ce * q.float()
        out.append(acc.to(dtype).reshape((n,) if packed else values[t].shape))
    return out


# ---------------------------------------------------------------- secure aggregation


def _ring32(v: Tensor) -> Tensor:
    """int64 values mod 2^32, as the int32 of the same bits."""
    return ((v & _M32) ^ 0x80000000).sub(0x80000000).to(torch.int32)


def _mask_words(seeds: Tensor, signs: Sequence[int], first: int, n: int) -> Tensor:
    """sum_m s_m G_m(e) mod 2^32 for e in [first, first + n), int64 in [0, 2^32)."""
    e = torch.arange(first, first + n, dtype=torch.int64)
    total = torch.zeros(n, dtype=torch.int64)
    for (key, off), s in zip(seeds.tolist(), signs):
        words = torch.stack(philox_words_reference(key, off, e // 4), 1)
        word = words.gather(1, (e % 4).unsqueeze(1)).squeeze(1)
        total = (total + (word if s > 0 else -word)) & _M32
    return total


def secagg_mask_reference(
    x: Sequence[Tensor], clip: float, scale: float, stochastic: bool, seed: int, offset: int,
    seeds: Tensor, signs: Sequence[int],
) -> list[Tensor]:
    """``fedkernels::secagg_mask``: code(x) = round(clamp(x, -clip, clip) * scale) in float64
    (NaN as 0; to nearest, ties to even, or floor(w + word 2^-32) with word e of the stream
    (seed, offset)), plus the signed mask words, mod 2^32, as int32."""
    out, first = [], 0
    for xt in x:
        n = xt.numel()
        v = xt.reshape(-1).to(torch.float64).cpu()
        v = torch.where(torch.isnan(v), torch.zeros_like(v), v).clamp(-clip, clip)
        w = v * scale
        if stochastic:
            u = _mask_words(torch.tensor([[seed, offset]]), [1], first, n).to(torch.float64)
            r = torch.floor(w + u * 2.0**-32)
        else:
            r = torch.round(w)
        code = r.to(torch.int64) + _mask_words(seeds, signs, first, n)
        out.append(_ring32(code).reshape(xt.shape).to(xt.device))
        first += n
    return out


def secagg_unmask_sum_reference(masked: Sequence[Sequence[Tensor]], seeds: Tensor,
                                signs: Sequence[int]) -> list[Tensor]:
    """``fedkernels::secagg_unmask_sum``: sum_k y_k - sum_m s_m G_m mod 2^32, as int32."""
    out, first = [], 0
    for t in range(len(masked[0])):
        n = masked[0][t].numel()
        acc = torch.zeros(n, dtype=torch.int64)
        for client in masked:
            acc = acc + client[t].reshape(-1).cpu().to(torch.int64)
        acc = acc - _mask_words(seeds, signs, first, n)
        out.append(_ring32(acc).reshape(masked[0][t].shape).to(masked[0][t].device))
        first += n
    return out


def topk_indices_reference(v: Tensor, k: int) -> Tensor:
    """The positions (int64, increasing) of the ``k`` largest ``|v|`` of a 1-D tensor, ties
    to the lower position, NaN ranking above every number: a stable sort, the definition that
    :func:`fedkernels.sparsify_topk` computes faster."""
    a = v.abs().to(torch.float64)
    a = torch.where(torch.isnan(a), torch.full_like(a, float("inf")), a)
    order = torch.sort(-a, stable=True).indices[:k]
    return torch.sort(order).values


def sparsify_topk_reference(
    tensors: Sequence[Tensor],
    counts: Sequence[int],
    residual: Sequence[Tensor] | None = None,
) -> tuple[list[Tensor], list[Tensor], list[Tensor] | None]:
    """Top-``counts[t]`` per tensor of ``v = x (+ residual)`` (in x's dtype): the positions
    (int64), the values ``v`` there, and the new residual ``v`` with the sent entries zeroed."""
    idx, vals, res = [], [], []
    for t, x in enumerate(tensors):
        v = x.reshape(-1) if residual is None else (x + residual[t]).reshape(-1)
        i = topk_indices_reference(v, counts[t])
        idx.append(i)
        vals.append(v[i].clone())
        r = v.clone()
        r[i] = 0
        res.append(r.reshape(x.shape))
    return idx, vals, res if residual is not None else None


def sparse_weighted_sum_reference(
    base: Sequence[Tensor],
    indices: Sequence[Tensor],
    values: Sequence[Tensor],
    weights: Sequence[float] | Tensor,
) -> list[Tensor]:
    """``base_t + sum_k w_k v_kt`` scattered at ``indices[k * T + t]``, client by client in the
    accumulate type (float32; float64 for float64), each present entry ``acc + w_k v``."""
    w = torch.as_tensor(weights, dtype=torch.float64).cpu()
    K = w.numel()
    out = []
    for t, b in enumerate(base):
        acc_dtype = _acc_dtype(b.dtype)
        acc = b.reshape(-1).to(acc_dtype).clone()
        for k in range(K):
            i = indices[k * len(base) + t].long()
            wk = w[k].to(acc_dtype).to(b.device)
            acc[i] = acc[i] + wk * values[k * len(base) + t].to(acc_dtype)
        out.append(acc.to(b.dtype).reshape(b.shape))
    return out
