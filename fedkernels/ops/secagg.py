r"""Secure aggregation in the integer ring :math:`\mathbb{Z}_{2^{32}}` (the protocol, what
the server learns and the threat model: ``docs/algorithms/secagg.md``). The masks are never in
memory: each is a Philox-4x32-10 stream expanded from its seed while the pass adds it.

- :func:`secagg_mask` (client side): in one pass over the model,
  :math:`y = \mathrm{code}(x) + \sum_m s_m G_m \bmod 2^{32}` with the fixed-point code
  :math:`\mathrm{round}(\mathrm{clamp}(x, -c, c) \cdot \mathrm{scale})` (to nearest, or
  stochastic and unbiased) and the masks :math:`G_m` of the seeds given (the pairwise masks with
  signs :math:`\pm 1` by client order, and the self-mask with sign +1).
- :func:`secagg_unmask_sum` (server side): in one pass,
  :math:`\sum_k y_k - \sum_m s_m G_m \bmod 2^{32}`: the survivors' masked vectors summed, their
  self-masks and the dropped clients' halves of pairwise masks removed.
- :func:`secagg_decode`: the ring sum back to floats, :math:`\mathrm{int32}(z) / \mathrm{scale}`.

Mask :math:`G_m` at element ``e`` of the list (all tensors in order) is word ``e % 4`` of the
block ``(key_m, subsequence e / 4, offset_m)``, the convention of every random op here, so that
both devices and :func:`fedkernels.ops.reference.philox_words_reference` give the same words.
A seed is 128 bits: :func:`mask_seeds` turns 16-byte secrets into the ``[M, 2]`` int64 rows.
Not differentiable.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import Tensor

from .devices import check_device

_ops = torch.ops.fedkernels

__all__ = ["secagg_mask", "secagg_unmask_sum", "secagg_decode", "mask_seeds", "MAX_CODE"]

MAX_CODE = 2**31 - 1  # the largest clip * scale, and the bound on |sum of codes| for decoding
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


def _as_list(tensors) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def _signed64(v: int, op: str, name: str) -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not -(2**63) <= v < 2**64:
        raise ValueError(f"fedkernels.{op}: {name} must be an int in [-2**63, 2**64), got {v!r}")
    return v - 2**64 if v >= 2**63 else v


def mask_seeds(secrets: Sequence[bytes]) -> Tensor:
    """The ``[M, 2]`` int64 rows ``(key, offset)`` of M 16-byte secrets (little-endian halves)."""
    rows = []
    for i, s in enumerate(secrets):
        if not isinstance(s, (bytes, bytearray)) or len(s) != 16:
            raise ValueError(f"fedkernels.mask_seeds: secret {i} must be 16 bytes, got "
                             f"{len(s) if isinstance(s, (bytes, bytearray)) else type(s).__name__}")
        rows.append([int.from_bytes(s[:8], "little", signed=True),
                     int.from_bytes(s[8:], "little", signed=True)])
    return torch.tensor(rows, dtype=torch.int64).reshape(-1, 2)


def _seeds_of(seeds: Tensor | Sequence[bytes] | None) -> Tensor:
    if seeds is None:
        return torch.zeros(0, 2, dtype=torch.int64)
    return seeds if isinstance(seeds, Tensor) else mask_seeds(seeds)


def secagg_mask(
    tensors: Tensor | Sequence[Tensor],
    *,
    clip: float,
    scale: float,
    seeds: Tensor | Sequence[bytes] | None = None,
    signs: Sequence[int] = (),
    stochastic: bool = False,
    seed: int = 0,
    offset: int = 0,
) -> list[Tensor]:
    r"""A client's masked update, int32 tensors shaped as ``tensors``: the fixed-point codes of
    the values clipped to ``[-clip, clip]`` (NaN as 0) at ``scale`` steps per unit, plus
    :math:`\sum_m s_m G_m` for the mask ``seeds`` (``[M, 2]`` int64 or M 16-byte secrets) and
    their ``signs`` (+1 or -1), all mod :math:`2^{32}`.

    Args:
        clip, scale: ``clip * scale`` must be at most :data:`MAX_CODE`; for a sum of K clients
            to decode, ``K * clip * scale`` must be too.
        stochastic: round stochastically (unbiased) with the Philox stream ``(seed, offset)``
            (word e for element e), instead of to nearest.
    """
    x = _as_list(tensors)
    return list(_ops.secagg_mask(x, float(clip), float(scale), bool(stochastic),
                                 _signed64(seed, "secagg_mask", "seed"),
                                 _signed64(offset, "secagg_mask", "offset"), _seeds_of(seeds),
                                 [int(v) for v in signs]))


def secagg_unmask_sum(
    masked: Sequence[Sequence[Tensor]],
    *,
    seeds: Tensor | Sequence[bytes] | None = None,
    signs: Sequence[int] = (),
) -> list[Tensor]:
    r"""The ring sum of K clients' masked updates (``masked[k][t]``, int32) minus
    :math:`\sum_m s_m G_m` for the ``seeds`` and ``signs`` given: the survivors' self-masks
    with sign +1, and for each dropped client d and surviving neighbour j the mask of their
    pair with the sign j used."""
    masked = [_as_list(m) for m in masked]
    if not masked:
        raise ValueError("fedkernels.secagg_unmask_sum: no clients")
    T = len(masked[0])
    for k, m in enumerate(masked):
        if len(m) != T:
            raise ValueError(f"fedkernels.secagg_unmask_sum: client {k} has {len(m)} tensors, "
                             f"client 0 has {T}")
    return list(_ops.secagg_unmask_sum([t for m in masked for t in m], len(masked),
                                       _seeds_of(seeds), [int(v) for v in signs]))


def secagg_decode(ring_sum: Sequence[Tensor], scale: float,
                  dtype: torch.dtype = torch.float32) -> list[Tensor]:
    """The float values of a sum of codes: each int32 read as signed, divided by ``scale``
    (in float64, then ``dtype``)."""
    if not (isinstance(scale, (int, float)) and scale > 0 and scale != float("inf")):
        raise ValueError(f"fedkernels.secagg_decode: scale must be finite and > 0, got {scale!r}")
    out = []
    for t, z in enumerate(_as_list(ring_sum)):
        if z.dtype != torch.int32:
            raise TypeError(f"fedkernels.secagg_decode: tensor {t} has dtype {z.dtype}, "
                            "expected int32")
        out.append((z.to(torch.float64) / scale).to(dtype))
    return out


# ---------------------------------------------------------------- fake implementations


def _check_masks(op, seeds, signs, device):
    check_device(op, seeds, device, "mask_seeds", allow_cpu=True)
    if seeds.dtype != torch.int64:
        raise TypeError(f"fedkernels.{op}: mask_seeds must be int64, got {seeds.dtype}")
    if seeds.dim() != 2 or seeds.shape[1] != 2:
        raise ValueError(f"fedkernels.{op}: mask_seeds must be [M, 2] (key, offset), got shape "
                         f"{list(seeds.shape)}")
    if len(signs) != seeds.shape[0]:
        raise ValueError(f"fedkernels.{op}: {len(signs)} mask_signs for {seeds.shape[0]} "
                         "mask_seeds")
    for m, s in enumerate(signs):
        if s not in (1, -1):
            raise ValueError(f"fedkernels.{op}: mask_signs[{m}] must be 1 or -1, got {s}")


@torch.library.register_fake("fedkernels::secagg_mask")
def _secagg_mask_fake(x, clip, scale, stochastic, seed, offset, mask_seeds, mask_signs):
    op = "secagg_mask"
    for name, v in (("clip", clip), ("scale", scale)):
        if not (v > 0 and v != float("inf")):
            raise ValueError(f"fedkernels.{op}: {name} must be finite and > 0, got {v}")
    if clip * scale > MAX_CODE:
        raise ValueError(f"fedkernels.{op}: clip * scale must be at most 2^31 - 1 (codes are "
                         f"int32), got {clip * scale}")
    device = x[0].device if x else mask_seeds.device
    for t, xt in enumerate(x):
        if xt.dtype not in _FLOATS:
            raise TypeError(f"fedkernels.{op}: x tensor {t} has dtype {xt.dtype}; supported: "
                            "float32, float64, float16, bfloat16")
        check_device(op, xt, device, f"x tensor {t}")
    _check_masks(op, mask_seeds, mask_signs, device)
    return [torch.empty(xt.shape, dtype=torch.int32, device=xt.device) for xt in x]


@torch.library.register_fake("fedkernels::secagg_unmask_sum")
def _secagg_unmask_fake(masked, num_clients, mask_seeds, mask_signs):
    op = "secagg_unmask_sum"
    if num_clients < 1:
        raise ValueError(f"fedkernels.{op}: num_clients must be >= 1, got {num_clients}")
    if len(masked) % num_clients:
        raise ValueError(f"fedkernels.{op}: {len(masked)} masked tensors for num_clients = "
                         f"{num_clients} (expected K * T, client-major)")
    T = len(masked) // num_clients
    device = masked[0].device if masked else mask_seeds.device
    for i, y in enumerate(masked):
        k, t = divmod(i, T)
        check_device(op, y, device, f"masked tensor {i}")
        if y.dtype != torch.int32:
            raise TypeError(f"fedkernels.{op}: masked tensor {i} (client {k}, tensor {t}) has "
                            f"dtype {y.dtype}, expected int32")
        if y.shape != masked[t].shape:
            raise ValueError(f"fedkernels.{op}: masked tensor {i} (client {k}, tensor {t}) has "
                             f"shape {list(y.shape)}, client 0's has {list(masked[t].shape)}")
    _check_masks(op, mask_seeds, mask_signs, device)
    return [torch.empty(masked[t].shape, dtype=torch.int32, device=device) for t in range(T)]
