r"""Central differential privacy for aggregation: per-client update norms, the clipped weighted
sum plus Gaussian noise, and the adaptive clip norm of Andrew et al. (2021), with the arithmetic
of Flower's ``DifferentialPrivacyServerSideFixedClipping`` / ``...AdaptiveClipping`` (the math
and the noise stream: ``docs/algorithms/robust_and_private.md``).

``clients`` is what :func:`fedkernels.aggregate` accepts (K state_dicts, K tensor lists, or a
``[K, P]`` tensor) and ``base`` is the current global model with the same structure. Only the
floating-point entries take part; integer and bool entries of the result are ``base``'s (a
privatised release carries no un-noised client data).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fedkernels.client_set import ClientSet
from fedkernels.memory_footprints import same_memory
from fedkernels.model_layout import Model, real_number, weights_and_values, with_metadata
from fedkernels.ops import private as private_ops

__all__ = ["update_norms", "clip_factors", "private_aggregate", "adaptive_clip_norm",
           "adaptive_noise_params"]


def _with_base(clients, base: Model, api: str) -> tuple[ClientSet, list[Tensor], list[Tensor]]:
    """The checked clients, base's float tensors and base's integer tensors."""
    cs = ClientSet(clients, api)
    if base is None:
        raise ValueError(f"{api}: base (the current global model) is required")
    tensors = cs.layout.tensors(base, "base")
    if cs.is_flat and tensors[0].dim() != 1:
        raise ValueError(f"{api}: with [K, P] clients, base must be a 1-D [P] tensor")
    first = cs.client0()
    for i, (b, t) in enumerate(zip(tensors, first)):
        if b.shape != t.shape or b.dtype != t.dtype or b.device != t.device:
            raise ValueError(f"{api}: base tensor {cs.label(i)} is {b.dtype} {tuple(b.shape)} "
                             f"on {b.device}; client 0 has {t.dtype} {tuple(t.shape)} "
                             f"on {t.device}")
    floats = [tensors[i] for i in cs.layout.float_index]
    return cs, floats, tensors


def _norms(cs: ClientSet, base: list[Tensor], keep: list[int] | None = None) -> Tensor:
    if not cs.has_floats:  # no float entries: every update is empty
        return torch.zeros(cs.K, dtype=torch.float64)
    return cs.run(private_ops.update_norms, _flat(cs, keep), cs.K, base)


def _flat(cs: ClientSet, keep: list[int] | None) -> list[Tensor]:
    """The clients' float tensors, client-major, only the entries ``keep`` (all when None)."""
    if keep is None:
        return cs.flat()
    return [c[j] for c in cs.floats for j in keep]


def _tied_entries(cs: ClientSet, base_floats: list[Tensor]) -> dict[int, int]:
    """Float entries of ``base`` that are one tensor under two keys (tied weights, e.g. an
    embedding shared with the output layer), as {later entry: first entry}; every client must
    hold equal values under both keys. Such a parameter is one coordinate of the release: it
    is clipped, counted in the norm and noised once, so the release never holds two noisy
    copies of it (their mean would have less noise than the guarantee assumes)."""
    starts = [t.data_ptr() for t in base_floats]
    if len(set(starts)) == len(starts):
        return {}
    first_at: dict[int, list[int]] = {}
    tied: dict[int, int] = {}
    for j, t in enumerate(base_floats):
        if t.numel() == 0:
            continue
        same = [i for i in first_at.get(t.data_ptr(), ()) if same_memory(base_floats[i], t)]
        if same:
            tied[j] = same[0]
        else:
            first_at.setdefault(t.data_ptr(), []).append(j)
    names = cs.layout.float_names
    for j, i in tied.items():
        for k, c in enumerate(cs.floats):
            if not (same_memory(c[i], c[j]) or torch.equal(c[i], c[j])):
                raise ValueError(
                    f"{cs.api}: base tensors {cs.layout.label(names[i])} and "
                    f"{cs.layout.label(names[j])} are one tensor (tied weights), but client {k} "
                    "has different values under the two keys")
    return tied


def update_norms(clients, base: Model) -> Tensor:
    r"""``[K]`` float64: :math:`\lVert x_k - b\rVert_2` over all floating-point tensors, the
    differences and squares accumulated in float64 (Flower's ``get_norm`` takes each array's
    norm in the array's dtype, so it agrees up to float32 rounding for float32 models)."""
    cs, base_floats, _ = _with_base(clients, base, "fedkernels.update_norms")
    return _norms(cs, base_floats)


def clip_factors(norms: Tensor, clip_norm: float) -> list[float]:
    r""":math:`\min(1, C / \lVert u_k\rVert)` per client, as Flower's ``clip_inputs_inplace``
    computes it in Python floats (a zero update keeps factor 1, where Flower divides by zero)."""
    return [1.0 if n == 0 else min(1.0, clip_norm / n) for n in norms.tolist()]


def private_aggregate(
    clients,
    weights=None,
    *,
    base: Model,
    clip_norm: float,
    noise_std: float,
    generator: torch.Generator | None = None,
    out: Model | None = None,
) -> tuple[Model, Tensor]:
    r"""Clipped weighted average of the client updates plus Gaussian noise:

    .. math::
        r = b + \sum_k \bar w_k \min\!\Big(1, \frac{C}{\lVert x_k - b\rVert_2}\Big)(x_k - b)
              + \sigma\,\varepsilon,\qquad \varepsilon \sim \mathcal N(0, I)

    with :math:`\bar w` the weights divided by their sum (None: equal weights, :math:`1/K`),
    :math:`C` = ``clip_norm`` and :math:`\sigma` = ``noise_std``. This is Flower's server-side
    fixed clipping (``compute_clip_model_update`` per client, then FedAvg's weighted average,
    then ``add_gaussian_noise_inplace``); Flower's noise level is
    ``noise_std = noise_multiplier * clip_norm / num_sampled_clients``.

    Arithmetic in the accumulate type (float32; float64 for float64 models); norms in float64.
    Noise: one seed from ``generator`` (the default generator of base's device when None; CPU:
    one ``random64``, CUDA: its Philox seed and offset) keys the Philox-4x32-10 stream of the
    SGLD ops (:func:`fedkernels.sgld_step`); element e of the model (all floating-point tensors
    concatenated in order) gets normal e of it. A tensor that ``base`` holds under several keys
    (tied weights) is one parameter: counted once in the norms, noised once, and the result
    holds it once (the same tensor under each key). ``noise_std = 0`` adds nothing and draws
    nothing. A non-finite update norm (NaN/Inf in a client) is refused, naming the clients:
    such an update cannot be clipped.

    ``out``: where to write the result (``base`` itself updates the global model in place).
    Returns ``(result, norms)`` with ``norms`` the ``[K]`` float64 update norms before
    clipping (what :func:`adaptive_clip_norm` takes).
    """
    api = "fedkernels.private_aggregate"
    clip_norm = real_number(api, "clip_norm", clip_norm)
    noise_std = real_number(api, "noise_std", noise_std)
    if not (math.isfinite(clip_norm) and clip_norm > 0):
        raise ValueError(f"{api}: clip_norm must be finite and > 0, got {clip_norm}")
    if not (math.isfinite(noise_std) and noise_std >= 0):
        raise ValueError(f"{api}: noise_std must be finite and >= 0, got {noise_std}")
    cs, base_floats, base_all = _with_base(clients, base, api)
    cs.refuse_meta("the clipping depends on the update norms")
    if weights is None:
        w = [1.0 / cs.K] * cs.K
    else:
        try:
            raw, _ = weights_and_values(weights, cs.K, False)
            negative = [k for k, x in enumerate(raw.tolist()) if x < 0]
            if not negative:
                w = weights_and_values(raw, cs.K, True)[0].tolist()
        except (TypeError, ValueError) as err:  # raised in aggregate's words
            message = str(err).replace("fedkernels.aggregate:", f"{api}:", 1)
            message = message.replace("normalize=True but the weights", "the weights")
            raise type(err)(message) from None
        if negative:
            raise ValueError(f"{api}: weights must be >= 0 (sample counts); client "
                             f"{negative[0]} has a negative weight (clients {negative[:10]})")
    out_tensors = cs.out_tensors(out)
    tied = _tied_entries(cs, base_floats)
    keep = [j for j in range(len(base_floats)) if j not in tied] if tied else None
    if keep is not None:
        base_floats = [base_floats[j] for j in keep]

    norms = _norms(cs, base_floats, keep)
    values = norms.tolist()
    bad = [k for k, n in enumerate(values) if not math.isfinite(n)]
    if bad:
        raise ValueError(f"{api}: the update of client {bad[0]} has norm {values[bad[0]]} "
                         f"(NaN/Inf in clients {bad[:10]}); a non-finite update cannot be "
                         "clipped")
    coef = torch.tensor([wk * fk for wk, fk in zip(w, clip_factors(norms, float(clip_norm)))],
                        dtype=torch.float64, device="cpu")
    std = float(noise_std)
    flat = _flat(cs, keep)

    def untie(results: list[Tensor]) -> list[Tensor]:
        """Per float entry, its result: a tied entry's is its first key's tensor."""
        if keep is None:
            return results
        by_entry = dict(zip(keep, results))
        return [by_entry[tied.get(j, j)] for j in range(len(cs.layout.float_index))]

    if out_tensors is None:  # read as values, like the clients: the release has no gradient
        base_floats = [b.detach() for b in base_floats]
        results = untie(cs.run(private_ops.private_sum, flat, coef, base_floats, std, generator))
        merged, it = [], iter(results)
        for i, f in enumerate(cs.layout.float_mask):
            merged.append(next(it) if f else base_all[i].clone())
        return with_metadata(cs.layout.build(merged), cs.metadata), norms
    float_out = cs.float_out(out_tensors)
    op_out = float_out if keep is None else [float_out[j] for j in keep]
    if all(o.data_ptr() == b.data_ptr() and o.stride() == b.stride()
           for o, b in zip(op_out, base_floats)):
        cs.run(private_ops.private_sum_, base_floats, flat, coef, std, generator)
    else:
        cs.run(private_ops.private_sum, flat, coef, base_floats, std, generator, op_out)
    for j, i in tied.items():  # a tied entry's out, unless it is its first key's memory
        if not same_memory(float_out[j], float_out[i]):
            float_out[j].copy_(float_out[i])
    for i in cs.layout.int_index:
        if out_tensors[i].data_ptr() != base_all[i].data_ptr():
            out_tensors[i].copy_(base_all[i])
    return out, norms


def adaptive_clip_norm(
    clip_norm: float,
    norms,
    *,
    target_quantile: float,
    clip_norm_lr: float,
    clipped_count_stddev: float,
    generator: torch.Generator | None = None,
) -> float:
    r"""The clip norm for the next round, by the geometric update of Andrew et al. (2021) as
    Flower's ``DifferentialPrivacyServerSideAdaptiveClipping`` applies it:

    .. math::
        b = \#\{k : \min(1, C/\lVert u_k\rVert) < 1\},\quad
        \tilde b = (b + \sigma_b z) / K,\quad
        C' = C \exp\!\big(-\eta_C (\tilde b - \gamma)\big)

    with :math:`K` = ``len(norms)`` (Flower divides by the number of replies),
    :math:`\sigma_b` = ``clipped_count_stddev``, :math:`\eta_C` = ``clip_norm_lr``,
    :math:`\gamma` = ``target_quantile`` and :math:`z` one standard normal drawn from
    ``generator`` (a CPU generator; the default one when None; nothing is drawn when
    :math:`\sigma_b = 0`). ``norms`` are the update norms before clipping, as
    :func:`private_aggregate` returns them. Note that Flower computes the round's noise
    standard deviation from the clip norm *after* this update.
    """
    api = "fedkernels.adaptive_clip_norm"
    clip_norm, target_quantile, clip_norm_lr, clipped_count_stddev = (
        real_number(api, name, value) for name, value in (
            ("clip_norm", clip_norm), ("target_quantile", target_quantile),
            ("clip_norm_lr", clip_norm_lr), ("clipped_count_stddev", clipped_count_stddev)))
    checks = (("clip_norm", clip_norm, lambda v: v > 0, "> 0"),
              ("target_quantile", target_quantile, lambda v: 0 <= v <= 1, "in [0, 1]"),
              ("clip_norm_lr", clip_norm_lr, lambda v: v > 0, "> 0"),
              ("clipped_count_stddev", clipped_count_stddev, lambda v: v >= 0, ">= 0"))
    for name, value, ok, what in checks:
        if not (math.isfinite(value) and ok(value)):
            raise ValueError(f"{api}: {name} must be finite and {what}, got {value}")
    if isinstance(norms, (str, bytes)) or (isinstance(norms, Tensor) and norms.is_complex()):
        # a string's characters were read as norms ("12": 1 and 2), a complex tensor's real part
        raise TypeError(f"{api}: norms must be real numbers, got "
                        f"{norms.dtype if isinstance(norms, Tensor) else type(norms).__name__}")
    values = (norms.detach().cpu().double().reshape(-1).tolist() if isinstance(norms, Tensor)
              else [float(n) for n in norms])
    if not values:
        raise ValueError(f"{api}: norms is empty (no client updates)")
    if any(math.isnan(n) or n < 0 for n in values):
        raise ValueError(f"{api}: norms must be >= 0 and not NaN, got {values[:10]}")
    clipped = sum(1 for n in values if n != 0 and min(1.0, clip_norm / n) < 1)
    noisy = float(clipped)
    if clipped_count_stddev > 0:
        if generator is not None and generator.device.type != "cpu":
            raise ValueError(f"{api}: generator must be a CPU generator, got one on "
                             f"{generator.device}")
        z = torch.randn((), dtype=torch.float64, generator=generator).item()
        noisy = clipped + clipped_count_stddev * z
    fraction = noisy / len(values)
    formula = (f"{clip_norm} * exp({-clip_norm_lr} * ({fraction} - {target_quantile}))")
    try:
        next_norm = float(clip_norm * math.exp(-clip_norm_lr * (fraction - target_quantile)))
    except OverflowError:  # math.exp's "math range error"
        raise ValueError(f"{api}: the next clip norm, {formula}, is beyond the float64 range; "
                         "lower clip_norm_lr") from None
    # The other end of the range: a norm that underflows to 0 is one that private_aggregate
    # (and this function, next round) refuses, so it is refused here, where it arises.
    if not next_norm > 0:
        raise ValueError(f"{api}: the next clip norm, {formula}, underflows to 0 in float64; "
                         "lower clip_norm_lr or raise clip_norm")
    return next_norm


def adaptive_noise_params(noise_multiplier: float, num_sampled: int,
                          clipped_count_stddev: float | None = None) -> tuple[float, float]:
    r"""``(clipped_count_stddev, update_noise_multiplier)`` for adaptive clipping, as Flower's
    ``compute_adaptive_noise_params``: the clipped-count query spends part of the privacy
    budget, so the updates get the larger multiplier
    :math:`(z^{-2} - (2\sigma_b)^{-2})^{-1/2}`; :math:`\sigma_b` defaults to
    ``num_sampled / 20`` (Andrew et al.'s suggestion). ``noise_multiplier = 0`` gives
    ``(clipped_count_stddev or 0, 0)``. Raises ``ValueError`` when
    :math:`z \ge 2\sigma_b` (no finite multiplier exists)."""
    api = "fedkernels.adaptive_noise_params"
    if not (math.isfinite(noise_multiplier) and noise_multiplier >= 0):
        raise ValueError(f"{api}: noise_multiplier must be finite and >= 0, got "
                         f"{noise_multiplier}")
    if clipped_count_stddev is not None and not (math.isfinite(clipped_count_stddev)
                                                 and clipped_count_stddev >= 0):
        raise ValueError(f"{api}: clipped_count_stddev must be finite and >= 0, got "
                         f"{clipped_count_stddev}")
    if noise_multiplier == 0:
        return (0.0 if clipped_count_stddev is None else float(clipped_count_stddev)), 0.0
    if clipped_count_stddev is None:
        # A NaN or infinite count gave a NaN or zero noise multiplier, silently.
        num_sampled = real_number(api, "num_sampled", num_sampled)
        if not (math.isfinite(num_sampled) and num_sampled > 0):
            raise ValueError(f"{api}: num_sampled must be finite and > 0, got {num_sampled}")
    stddev = num_sampled / 20 if clipped_count_stddev is None else float(clipped_count_stddev)
    if noise_multiplier >= 2 * stddev:
        raise ValueError(f"{api}: noise_multiplier {noise_multiplier} needs "
                         f"clipped_count_stddev > {noise_multiplier / 2} (got {stddev}); "
                         "raise clipped_count_stddev or lower noise_multiplier")
    return stddev, (noise_multiplier ** -2 - (2 * stddev) ** -2) ** -0.5
