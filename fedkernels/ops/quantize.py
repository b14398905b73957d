r"""Quantized client updates (the method and its guarantees:
``docs/algorithms/quantized.md``):

- :func:`quantize_int8` (client side): symmetric int8 with one float32 scale per block of
  ``block_size`` consecutive elements of each tensor, :math:`s = \max|v| / 127`,
  :math:`q = \mathrm{round}(v / s)`; rounding to nearest, or stochastic (unbiased:
  :math:`E[q s] = v`) from the counter-based Philox-4x32-10 stream of the other random ops,
  keyed by ``(seed, offset)``. With ``residual`` (error feedback) it quantizes
  :math:`v = x + r` and returns :math:`r' = v - q s` from the same pass.
- :func:`quantize_int4`: the same with levels -7..7 (:math:`s = \max|v| / 7`), packed two a
  byte (element 2j in the low nibble of byte j).
- :func:`quantize_fp8`: float8 e4m3fn values with one float32 scale per tensor,
  :math:`s = \max|v| / 448`, rounded to the e4m3 grid to nearest or stochastically, saturated.
- :func:`aggregate_quantized` (server side, any of the three formats) and the ops under it
  (:func:`dequantize_weighted_sum`, :func:`dequantize_int4_weighted_sum`,
  :func:`dequantize_fp8_weighted_sum`): :math:`\sum_k w_k s_{kb} q_k` in one pass over the
  compressed bytes, float32 accumulation in client order; the float clients are never built.

A block (fp8: a tensor) holding a NaN or an infinity gets scale NaN and values 0: it
dequantizes to NaN (as an fp32 aggregate of that client would), and its residual is NaN. Not
differentiable.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import NamedTuple

import torch
from torch import Tensor

from .devices import check_device
from .native import refuse_jit_trace

_ops = torch.ops.fedkernels

__all__ = ["QuantizedTensors", "quantize_int8", "quantize_int4", "quantize_fp8",
           "dequantize_weighted_sum", "dequantize_int4_weighted_sum",
           "dequantize_fp8_weighted_sum", "aggregate_quantized", "DEFAULT_BLOCK_SIZE"]

DEFAULT_BLOCK_SIZE = 256
_MAX_BLOCK = 1 << 24
_FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)


class QuantizedTensors(NamedTuple):
    """One client's quantized tensor list: ``values[t]``, ``scales[t]`` (float32), the
    ``block_size``, the new error-feedback ``residual`` (None without error feedback), the
    ``format`` and the tensors' ``shapes``.

    - ``"int8"``: values int8 shaped as tensor t, one scale per block;
    - ``"int4"``: values uint8 of shape [ceil(n / 2)] (two levels a byte, element 2j in the low
      nibble of byte j), one scale per block;
    - ``"fp8"``: values float8_e4m3fn shaped as tensor t, one scale per tensor (``scales[t]`` of
      shape [1]; ``block_size`` 0).
    """

    values: list[Tensor]
    scales: list[Tensor]
    block_size: int
    residual: list[Tensor] | None = None
    format: str = "int8"
    shapes: list[torch.Size] | None = None  # None: the values' shapes (int8, fp8)

    @property
    def nbytes(self) -> int:
        """Bytes a client sends: the values and the float32 scales."""
        return sum(v.numel() * v.element_size() + 4 * s.numel()
                   for v, s in zip(self.values, self.scales))

    def dequantize(self, dtype: torch.dtype = torch.float32) -> list[Tensor]:
        """The float tensors the values stand for (``q * s``), in ``dtype``."""
        return aggregate_quantized([self], torch.ones(1, dtype=torch.float64), dtype=dtype)


def _as_list(tensors) -> list[Tensor]:
    return [tensors] if isinstance(tensors, Tensor) else list(tensors)


def _seed_from(generator: torch.Generator | None) -> int:
    """One 64-bit draw of the generator (the default CPU generator when None)."""
    v = torch.empty((), dtype=torch.int64).random_(-(2**63), None, generator=generator)
    return int(v.item())


def _signed64(v: int, name: str, op: str = "quantize_int8") -> int:
    if not isinstance(v, int) or isinstance(v, bool) or not -(2**63) <= v < 2**64:
        raise ValueError(f"fedkernels.{op}: {name} must be an int in [-2**63, 2**64), "
                         f"got {v!r}")
    return v - 2**64 if v >= 2**63 else v


def _quantize(fmt: str, tensors, block_size, stochastic, seed, offset, generator,
              residual) -> QuantizedTensors:
    """The call shared by the three quantizers: seed, checks of the empty list, the op."""
    op = f"quantize_{fmt}"
    x = _as_list(tensors)
    if stochastic and seed is None:
        seed = _seed_from(generator)
    seed64 = _signed64(0 if seed is None else seed, "seed", op)
    offset64 = _signed64(offset, "offset", op)
    res = [] if residual is None else _as_list(residual)
    shapes = [t.shape for t in x] if fmt == "int4" else None
    if not x:  # no tensor argument to dispatch on: the checks and the (empty) result here
        if fmt != "fp8":
            _check_block(op, block_size, even=fmt == "int4")
        if res:
            raise ValueError(f"fedkernels.{op}: residual must be empty or have one "
                             f"tensor per x tensor (0), got {len(res)}")
        return QuantizedTensors([], [], int(block_size), [] if residual is not None else None,
                                fmt, shapes)
    if fmt == "fp8":
        values, scales, new_res = _ops.quantize_fp8(x, res, bool(stochastic), seed64, offset64)
    else:
        values, scales, new_res = getattr(_ops, op)(x, res, int(block_size), bool(stochastic),
                                                    seed64, offset64)
    return QuantizedTensors(list(values), list(scales), int(block_size),
                            list(new_res) if residual is not None else None, fmt, shapes)




def quantize_int8(
    tensors: Tensor | Sequence[Tensor],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    offset: int = 0,
    generator: torch.Generator | None = None,
    residual: Sequence[Tensor] | None = None,
) -> QuantizedTensors:
    """Quantize a client's tensors (a tensor or a list) to int8 with per-block scales:
    ``s = max|v| / 127`` per block, levels -127..127.

    ``block_size``: elements per scale, counted in each tensor's C order (the last block of a
    tensor may be short); 256 by default (a 1.6 % overhead of scales).

    Args:
        stochastic: round stochastically (unbiased) instead of to nearest.
        seed, offset: the Philox key of the stochastic rounding: element e of the list (all
            tensors in order) uses word e % 4 of block (seed, subsequence e / 4, offset), the
            same bits on every device. ``seed=None`` draws one from ``generator`` (the default
            CPU generator when None); use a new ``offset`` (or seed) for every round.
        residual: the error-feedback memory (one tensor per input, same shapes and dtypes;
            zeros at the first round): quantizes ``x + residual`` and returns the new residual.
    """
    return _quantize("int8", tensors, block_size, stochastic, seed, offset, generator, residual)


def quantize_int4(
    tensors: Tensor | Sequence[Tensor],
    block_size: int = DEFAULT_BLOCK_SIZE,
    *,
    stochastic: bool = False,
    seed: int | None = None,
    offset: int = 0,
    generator: torch.Generator | None = None,
    residual: Sequence[Tensor] | None = None,
) -> QuantizedTensors:
    """Quantize a client's tensors to packed 4-bit levels with per-block scales:
    ``s = max|v| / 7`` per block, levels -7..7 as two's complement nibbles, two a byte
    (element 2j of a tensor in the low nibble of byte j, 2j + 1 in the high one).

    ``block_size``: as :func:`quantize_int8`'s, and even (a block ends on a byte boundary);
    256 by default (a 3.1 % overhead of scales over the 4-bit values).

    Args:
        stochastic: round stochastically (unbiased) instead of to nearest.
        seed, offset: the Philox key of the stochastic rounding: element e of the list (all
            tensors in order) uses word e % 4 of block (seed, subsequence e / 4, offset), the
            same bits on every device. ``seed=None`` draws one from ``generator`` (the default
            CPU generator when None); use a new ``offset`` (or seed) for every round.
        residual: the error-feedback memory (one tensor per input, same shapes and dtypes;
            zeros at the first round): quantizes ``x + residual`` and returns the new residual.
    """
    return _quantize("int4", tensors, block_size, stochastic, seed, offset, generator, residual)


def quantize_fp8(
    tensors: Tensor | Sequence[Tensor],
    *,
    stochastic: bool = False,
    seed: int | None = None,
    offset: int = 0,
    generator: torch.Generator | None = None,
    residual: Sequence[Tensor] | None = None,
) -> QuantizedTensors:
    """Quantize a client's tensors to float8 e4m3fn (``torch.float8_e4m3fn`` values) with one
    float32 scale per tensor: ``s = max|v| / 448``, ``q = v / s`` saturated to [-448, 448] and
    rounded to the e4m3 grid (no NaN from finite input).

    Args:
        stochastic: round stochastically (unbiased) instead of to nearest.
        seed, offset: the Philox key of the stochastic rounding: element e of the list (all
            tensors in order) uses word e % 4 of block (seed, subsequence e / 4, offset), the
            same bits on every device. ``seed=None`` draws one from ``generator`` (the default
            CPU generator when None); use a new ``offset`` (or seed) for every round.
        residual: the error-feedback memory (one tensor per input, same shapes and dtypes;
            zeros at the first round): quantizes ``x + residual`` and returns the new residual.
    """
    return _quantize("fp8", tensors, 0, stochastic, seed, offset, generator, residual)


def dequantize_weighted_sum(values: Sequence[Tensor], scales: Sequence[Tensor], weights: Tensor,
                            block_size: int, dtype: torch.dtype = torch.float32,
                            out: Sequence[Tensor] | None = None) -> list[Tensor]:
    r""":math:`\sum_k w_k s_{kb} q_k` per tensor over K = ``weights.numel()`` clients given
    client-major (``values[k * T + t]``, ``scales[k * T + t]``), in ``dtype``; into ``out``
    when given (T tensors of ``dtype``, shaped as the values)."""
    if out is None:
        return _ops.dequantize_weighted_sum(values, scales, weights, int(block_size), dtype)
    refuse_jit_trace("dequantize_weighted_sum.out")
    _ops.dequantize_weighted_sum.out(values, scales, weights, int(block_size), dtype, out=out)
    return list(out)


def dequantize_int4_weighted_sum(values: Sequence[Tensor], scales: Sequence[Tensor],
                                 weights: Tensor, block_size: int, numels: Sequence[int],
                                 dtype: torch.dtype = torch.float32,
                                 out: Sequence[Tensor] | None = None) -> list[Tensor]:
    r""":func:`dequantize_weighted_sum` of packed 4-bit values (``values[k * T + t]``: uint8
    [ceil(numels[t] / 2)]): 1-D results of ``numels[t]`` elements, or into ``out`` (T tensors
    of ``dtype``, any shape of ``numels[t]`` elements, written in C order)."""
    numels = [int(n) for n in numels]
    if out is None:
        return _ops.dequantize_int4_weighted_sum(values, scales, weights, int(block_size), numels,
                                                 dtype)
    refuse_jit_trace("dequantize_int4_weighted_sum.out")
    _ops.dequantize_int4_weighted_sum.out(values, scales, weights, int(block_size), numels, dtype,
                                          out=out)
    return list(out)


def dequantize_fp8_weighted_sum(values: Sequence[Tensor], scales: Sequence[Tensor],
                                weights: Tensor, dtype: torch.dtype = torch.float32,
                                out: Sequence[Tensor] | None = None) -> list[Tensor]:
    r""":math:`\sum_k (w_k s_{kt}) q_k` of float8 e4m3fn values with one scale per tensor
    (``scales[k * T + t]`` of shape [1]), in ``dtype``; into ``out`` when given."""
    if out is None:
        return _ops.dequantize_fp8_weighted_sum(values, scales, weights, dtype)
    refuse_jit_trace("dequantize_fp8_weighted_sum.out")
    _ops.dequantize_fp8_weighted_sum.out(values, scales, weights, dtype, out=out)
    return list(out)


def aggregate_quantized(
    clients: Sequence[QuantizedTensors],
    weights,
    *,
    normalize: bool = False,
    dtype: torch.dtype = torch.float32,
    out: Sequence[Tensor] | None = None,
) -> list[Tensor]:
    r"""Weighted sum of K clients' quantized updates, :math:`\sum_k w_k \hat x_k`, in one fused
    pass that reads each client's values and scales once (as :func:`fedkernels.aggregate`
    over the dequantized clients, without building them).

    Args:
        clients: K :class:`QuantizedTensors` of one format (from :func:`quantize_int8`,
            :func:`quantize_int4` or :func:`quantize_fp8`), with the same shapes and block
            size.
        weights: K real numbers (tensor, list or array); divided by their sum with ``normalize``.
        dtype: of the result (float32, float16, bfloat16 or float64; accumulation is float32).
        out: where to write the result (one tensor per client tensor, of ``dtype``); a server
            that keeps these buffers between rounds saves the page faults of fresh memory.
    """
    clients = list(clients)
    if not clients:
        raise ValueError("fedkernels.aggregate_quantized: no clients")
    formats = {c.format for c in clients}
    if len(formats) != 1:
        raise ValueError(f"fedkernels.aggregate_quantized: the clients' formats differ: "
                         f"{sorted(formats)}")
    fmt = formats.pop()
    blocks = {c.block_size for c in clients}
    if len(blocks) != 1:
        raise ValueError(f"fedkernels.aggregate_quantized: the clients' block sizes differ: "
                         f"{sorted(blocks)}")
    T = len(clients[0].values)
    for k, c in enumerate(clients):
        if len(c.values) != T or len(c.scales) != T:
            raise ValueError(f"fedkernels.aggregate_quantized: client {k} has {len(c.values)} "
                             f"tensors, client 0 has {T}")
    if isinstance(weights, Tensor) and weights.dtype == torch.bool or (
            not isinstance(weights, Tensor) and any(isinstance(w, bool) for w in weights)):
        raise TypeError("fedkernels.aggregate_quantized: weights must be real numbers, not bool")
    w = torch.as_tensor(weights, dtype=torch.float64, device="cpu").reshape(-1) \
        if not isinstance(weights, Tensor) else weights.to(torch.float64).reshape(-1)
    if w.numel() != len(clients):
        raise ValueError(f"fedkernels.aggregate_quantized: {w.numel()} weights for "
                         f"{len(clients)} clients")
    if normalize:
        total = w.sum()
        if not torch.isfinite(total) or total == 0:
            raise ValueError(f"fedkernels.aggregate_quantized: normalize needs weights with a "
                             f"finite non-zero sum, got {total.item()}")
        w = w / total
    values = [v for c in clients for v in c.values]
    scales = [s for c in clients for s in c.scales]
    if fmt == "fp8":
        return dequantize_fp8_weighted_sum(values, scales, w, dtype, out=out)
    if fmt == "int4":
        shapes = clients[0].shapes
        for k, c in enumerate(clients):
            if list(c.shapes) != list(shapes):
                t = next(t for t, (a, b) in enumerate(zip(c.shapes, shapes)) if a != b)
                raise ValueError(f"fedkernels.aggregate_quantized: tensor {t} of client {k} "
                                 f"has shape {list(c.shapes[t])}, client 0's has "
                                 f"{list(shapes[t])}")
        sums = dequantize_int4_weighted_sum(values, scales, w, blocks.pop(),
                                            [math.prod(sh) for sh in shapes], dtype, out=out)
        return sums if out is not None else [o.view(sh) for o, sh in zip(sums, shapes)]
    return dequantize_weighted_sum(values, scales, w, blocks.pop(), dtype, out=out)


# ---------------------------------------------------------------- fake implementations


def _blocks(numel, block_size):
    return (numel + block_size - 1) // block_size


def _check_block(op: str, block_size: int, even: bool = False) -> None:
    if not 1 <= block_size <= _MAX_BLOCK:
        raise ValueError(f"fedkernels.{op}: block_size must be in [1, {_MAX_BLOCK}], "
                         f"got {block_size}")
    if even and block_size % 2:
        raise ValueError(f"fedkernels.{op}: block_size must be even (two 4-bit values a byte), "
                         f"got {block_size}")


def _quantize_fake_checks(op, x, residual):
    if residual and len(residual) != len(x):
        raise ValueError(f"fedkernels.{op}: residual must be empty or have one tensor per x "
                         f"tensor ({len(x)}), got {len(residual)}")
    for t, xt in enumerate(x):
        if xt.dtype not in _FLOATS:
            raise TypeError(f"fedkernels.{op}: x tensor {t} has dtype {xt.dtype}; supported: "
                            "float32, float64, float16, bfloat16")
        check_device(op, xt, x[0].device, f"x tensor {t}")
        if residual:
            check_device(op, residual[t], x[0].device, f"residual tensor {t}")
            if residual[t].shape != xt.shape:
                raise ValueError(f"fedkernels.{op}: residual tensor {t} has shape "
                                 f"{list(residual[t].shape)}, x tensor {t} has {list(xt.shape)}")
            if residual[t].dtype != xt.dtype:
                raise TypeError(f"fedkernels.{op}: residual tensor {t} has dtype "
                                f"{residual[t].dtype}, x tensor {t} has {xt.dtype}")
    return [torch.empty(xt.shape, dtype=xt.dtype, device=xt.device) for xt in x] \
        if residual else []


@torch.library.register_fake("fedkernels::quantize_int8")
def _quantize_fake(x, residual, block_size, stochastic, seed, offset):
    op = "quantize_int8"
    _check_block(op, block_size)
    new_res = _quantize_fake_checks(op, x, residual)
    values = [torch.empty(xt.shape, dtype=torch.int8, device=xt.device) for xt in x]
    scales = [torch.empty((_blocks(xt.numel(), block_size),), dtype=torch.float32,
                          device=xt.device) for xt in x]
    return values, scales, new_res


@torch.library.register_fake("fedkernels::quantize_int4")
def _quantize_int4_fake(x, residual, block_size, stochastic, seed, offset):
    op = "quantize_int4"
    _check_block(op, block_size, even=True)
    new_res = _quantize_fake_checks(op, x, residual)
    values = [torch.empty(((xt.numel() + 1) // 2,), dtype=torch.uint8, device=xt.device)
              for xt in x]
    scales = [torch.empty((_blocks(xt.numel(), block_size),), dtype=torch.float32,
                          device=xt.device) for xt in x]
    return values, scales, new_res


@torch.library.register_fake("fedkernels::quantize_fp8")
def _quantize_fp8_fake(x, residual, stochastic, seed, offset):
    new_res = _quantize_fake_checks("quantize_fp8", x, residual)
    values = [torch.empty(xt.shape, dtype=torch.float8_e4m3fn, device=xt.device) for xt in x]
    scales = [torch.empty((1,), dtype=torch.float32, device=xt.device) for xt in x]
    return values, scales, new_res


@torch.library.register_fake("fedkernels::dequantize_weighted_sum")
def _dequantize_fake(values, scales, weights, block_size, dtype):
    T = _dequantize_checks("dequantize_weighted_sum", values, scales, weights, block_size, dtype)
    return [torch.empty(values[t].shape, dtype=dtype, device=values[t].device) for t in range(T)]


@torch.library.register_fake("fedkernels::dequantize_weighted_sum.out")
def _dequantize_out_fake(values, scales, weights, block_size, dtype, *, out):
    op = "dequantize_weighted_sum.out"
    T = _dequantize_checks(op, values, scales, weights, block_size, dtype)
    _out_checks(op, values, dtype, out, T, [v.shape for v in values[:T]])


@torch.library.register_fake("fedkernels::dequantize_int4_weighted_sum")
def _dequantize_int4_fake(values, scales, weights, block_size, numels, dtype):
    T = _dequantize_checks("dequantize_int4_weighted_sum", values, scales, weights, block_size,
                           dtype, "int4", numels)
    return [torch.empty((numels[t],), dtype=dtype, device=values[t].device) for t in range(T)]


@torch.library.register_fake("fedkernels::dequantize_int4_weighted_sum.out")
def _dequantize_int4_out_fake(values, scales, weights, block_size, numels, dtype, *, out):
    op = "dequantize_int4_weighted_sum.out"
    T = _dequantize_checks(op, values, scales, weights, block_size, dtype, "int4", numels)
    _out_checks(op, values, dtype, out, T, None, numels)


@torch.library.register_fake("fedkernels::dequantize_fp8_weighted_sum")
def _dequantize_fp8_fake(values, scales, weights, dtype):
    T = _dequantize_checks("dequantize_fp8_weighted_sum", values, scales, weights, 0, dtype,
                           "fp8")
    return [torch.empty(values[t].shape, dtype=dtype, device=values[t].device) for t in range(T)]


@torch.library.register_fake("fedkernels::dequantize_fp8_weighted_sum.out")
def _dequantize_fp8_out_fake(values, scales, weights, dtype, *, out):
    op = "dequantize_fp8_weighted_sum.out"
    T = _dequantize_checks(op, values, scales, weights, 0, dtype, "fp8")
    _out_checks(op, values, dtype, out, T, [v.shape for v in values[:T]])


def _out_checks(op, values, dtype, out, T, shapes, numels=None):
    if len(out) != T:
        raise ValueError(f"fedkernels.{op}: out has {len(out)} tensors, expected {T}")
    for t, o in enumerate(out):
        check_device(op, o, values[0].device, f"out tensor {t}")
        if o.dtype != dtype:
            raise TypeError(f"fedkernels.{op}: out tensor {t} has dtype {o.dtype}, expected {dtype}")
        if shapes is not None and o.shape != shapes[t]:
            raise ValueError(f"fedkernels.{op}: out tensor {t} has shape {list(o.shape)}, "
                             f"expected {list(shapes[t])}")
        if numels is not None and o.numel() != numels[t]:
            raise ValueError(f"fedkernels.{op}: out tensor {t} has shape {list(o.shape)}, "
                             f"expected {numels[t]} elements")


_STORED = {"int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}


def _dequantize_checks(op, values, scales, weights, block_size, dtype, fmt="int8",
                       numels=None) -> int:
    if fmt != "fp8":
        _check_block(op, block_size, even=fmt == "int4")
    if dtype not in _FLOATS:
        raise TypeError(f"fedkernels.{op}: dtype has dtype {dtype}; supported: float32, "
                        "float64, float16, bfloat16")
    if weights.dim() != 1 or weights.numel() < 1:
        raise ValueError(f"fedkernels.{op}: weights must be 1-D [K] with K >= 1, got shape "
                         f"{list(weights.shape)}")
    K = int(weights.shape[0])  # the list lengths depend on it: specialized
    if len(values) % K:
        raise ValueError(f"fedkernels.{op}: {len(values)} values tensors for K = {K} clients "
                         "(expected K * T, client-major)")
    if len(scales) != len(values):
        raise ValueError(f"fedkernels.{op}: {len(scales)} scales tensors for {len(values)} "
                         "values tensors (expected one per values tensor)")
    T = len(values) // K
    if fmt == "int4":
        if len(numels) != T:
            raise ValueError(f"fedkernels.{op}: numels has {len(numels)} entries for {T} "
                             "tensors per client")
        for t, n in enumerate(numels):
            if n < 0:
                raise ValueError(f"fedkernels.{op}: numels[{t}] is {n}")
    stored = _STORED[fmt]
    for i, (v, s) in enumerate(zip(values, scales)):
        k, t = divmod(i, T)
        check_device(op, v, values[0].device, f"values tensor {i}")
        check_device(op, s, values[0].device, f"scales tensor {i}")
        if v.dtype != stored:
            raise TypeError(f"fedkernels.{op}: values tensor {i} (client {k}, tensor {t}) has "
                            f"dtype {v.dtype}, expected {str(stored).removeprefix('torch.')}")
        if s.dtype != torch.float32:
            raise TypeError(f"fedkernels.{op}: scales tensor {i} (client {k}, tensor {t}) has "
                            f"dtype {s.dtype}, expected float32")
        if fmt == "int4":
            want_bytes = (numels[t] + 1) // 2
            if v.dim() != 1 or v.shape[0] != want_bytes:
                raise ValueError(f"fedkernels.{op}: values tensor {i} (client {k}, tensor {t}) "
                                 f"has shape {list(v.shape)}, expected [{want_bytes}]")
        elif v.shape != values[t].shape:
            raise ValueError(f"fedkernels.{op}: values tensor {i} (client {k}, tensor {t}) has "
                             f"shape {list(v.shape)}, client 0's has {list(values[t].shape)}")
        n = numels[t] if fmt == "int4" else v.numel()
        want = 1 if fmt == "fp8" else _blocks(n, block_size)
        if s.dim() != 1 or s.shape[0] != want:
            raise ValueError(f"fedkernels.{op}: scales tensor {i} (client {k}, tensor {t}) has "
                             f"shape {list(s.shape)}, expected [{want}]")
    if values:
        check_device(op, weights, values[0].device, "weights", allow_cpu=True)
    return T
