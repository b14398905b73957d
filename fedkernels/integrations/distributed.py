r"""Weighted aggregation when the clients' updates live on different ranks (``torch.distributed``).

Each rank holds some of the K clients. It sums its share with the fused ``weighted_sum`` op
into one flat accumulator (fp32 for fp32/fp16/bf16 models, fp64 for fp64); then **one**
``all_reduce`` of that one model-sized buffer gives every rank

.. math:: S = \sum_{k} w_k x_k \quad\text{or, with a base } b,\quad
          S = \sum_k w_k (x_k - b), \qquad W = \sum_k w_k,

and the result is :math:`\mathrm{scale}\cdot S / [W]` (plain) or
:math:`b + \mathrm{scale}\cdot S / [W]` (delta mode, the server-learning-rate form), with the
division by :math:`W` only when ``normalize``: exactly what :func:`fedkernels.aggregate` gives on
the union of all ranks' clients, up to float rounding. Integer tensors
(``num_batches_tracked``) follow ``int_policy`` with a second, tiny all-reduce (``max``).

The ranks first agree on what they are about to sum. The buffer is laid out in a canonical
order (a state_dict's tensors sorted by name, a list's by position), so ranks whose dicts hold
the same keys in another order still add tensor to tensor by name. Before the model-sized
all-reduce, one small ``all_gather`` of a fixed-size record per rank (a status, the client
count, the rank's :math:`\sum w_k` and :math:`\sum |w_k|` in float64, the power of two its sums
are relative to, which ranks' clients it holds, and a SHA-256 of the layout: kind, names,
shapes, dtypes, device type, ``int_policy``, the call's flags and, in delta mode, a checksum of
the base's bits) checks that every rank is ready and that the layouts and bases agree; every
rank then adds the gathered weight totals itself (``math.fsum``, so :math:`W` is exact to
float64 whatever the model's precision). When they
do not, or a rank failed its local checks (a NaN weight, a bad tensor), a second small gather
exchanges the descriptions, and every rank raises the same ``ValueError`` or ``TypeError``
naming the rank and the tensor at fault: no rank crashes in the backend, none waits for the
others until the process-group timeout, and nothing is summed.

- :func:`all_reduce_aggregate`: the one-call form.
- :class:`WeightedPartial`: the pieces, for hierarchical aggregation (reduce inside a node or a
  region with ``group=``, then across the leaders, then broadcast), or for adding partial sums
  that arrive by other means.

Any backend works: gloo for CPU tensors, NCCL for CUDA tensors (the buffer lives on the
updates' device; with NCCL the small agreement record lives on the current CUDA device). A
rank with no clients passes an empty list and ``like=`` (or ``base``) for the model's
structure; it still takes part in the collectives.
"""

from __future__ import annotations

import hashlib
import json
import math
import operator
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch import Tensor

from fedkernels.aggregate import FLOAT32_MAX, needs_float64_factor, weight_unit
from fedkernels.memory_footprints import Footprints, byte_span, has_internal_overlap, same_memory
from fedkernels.model_layout import (
    INT_POLICIES,
    Model,
    ModelLayout,
    elementwise_max,
    real_number,
    split_clients,
    weight_vector,
    with_metadata,
)
from fedkernels.ops import summation
from fedkernels.ops.concurrency import one_call_at_a_time

__all__ = ["WeightedPartial", "all_reduce_aggregate"]

API = "fedkernels.integrations.distributed"


def _accumulate_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.float64 if dtype == torch.float64 else torch.float32


def _name_key(name) -> tuple[str, str]:
    """A total order on state_dict keys that every process computes the same way."""
    return type(name).__name__, repr(name)


def _canonical_layout(template: Model, what: str) -> tuple[ModelLayout, list]:
    """The layout with a state_dict's names sorted (the order every rank shares), and the
    template's own order (the order of the result)."""
    layout = ModelLayout.of(template, what)
    if layout.kind != "dict":
        return layout, list(layout.names)
    float_of = dict(zip(layout.names, layout.float_mask))
    names = sorted(layout.names, key=_name_key)
    return ModelLayout("dict", names, [float_of[n] for n in names]), list(layout.names)


def _describe_tensor(t: Tensor) -> str:
    return f"{t.dtype} {tuple(t.shape)} on {t.device}"


_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bit_checksums(tensors: list[Tensor]) -> list[str]:
    """Per tensor, the sum of its elements' bits read as integers (int64, wrapping): equal
    tensors give equal checksums on every device and in any summation order, and a base that
    drifted on one rank gives another. One read of each tensor, one host synchronisation."""
    if not tensors:
        return []
    sums = []
    for t in tensors:
        bits = t.view(_BITS[t.element_size()]) if t.is_floating_point() else t
        sums.append(bits.sum(dtype=torch.int64))
    return [format(v & (2**64 - 1), "016x") for v in torch.stack(sums).tolist()]


def _check_same_structure(layout: ModelLayout, clients: list[list[Tensor]],
                          base: list[Tensor] | None, like: list[Tensor]) -> None:
    """Local checks, before anything is summed: every client like client 0 (or like ``like``
    on a rank without clients), and ``base`` like them (float entries may be float32 for half
    precision clients, as in :func:`fedkernels.aggregate`)."""
    reference = clients[0] if clients else like
    who = "client 0" if clients else "like"
    sources = [(f"client {k}, tensor", c) for k, c in enumerate(clients)]
    sources += [("base tensor", base)] if base is not None else []
    for what, tensors in sources or [(f"{who} tensor", like)]:
        for name, t in zip(layout.names, tensors):
            if t.layout != torch.strided:  # the fused op reads dense memory only
                raise TypeError(f"{API}: {what} {layout.label(name)} has layout {t.layout}; "
                                "only dense (strided) tensors are supported (call .to_dense())")
    for k, tensors in enumerate(clients[1:], start=1):
        for name, t, r in zip(layout.names, tensors, reference):
            if t.shape != r.shape or t.device != r.device:
                raise ValueError(f"{API}: client {k}, tensor {layout.label(name)} is "
                                 f"{_describe_tensor(t)}, {who} has {_describe_tensor(r)}")
            if t.dtype != r.dtype:
                raise TypeError(f"{API}: client {k}, tensor {layout.label(name)} has dtype "
                                f"{t.dtype}, {who} has {r.dtype}")
    if base is None:
        return
    for name, b, r, f in zip(layout.names, base, reference, layout.float_mask):
        ok_dtype = b.dtype == r.dtype or (f and b.dtype == torch.float32
                                          and r.dtype in (torch.float16, torch.bfloat16))
        if b.shape != r.shape or b.device != r.device or not ok_dtype:
            raise ValueError(f"{API}: base tensor {layout.label(name)} is {_describe_tensor(b)}, "
                             f"{who} has {_describe_tensor(r)}")


def _as_timeout(timeout) -> timedelta | None:
    if timeout is None or isinstance(timeout, timedelta):
        seconds = None if timeout is None else timeout.total_seconds()
    elif isinstance(timeout, (int, float)) and not isinstance(timeout, bool):
        seconds = float(timeout)
    else:
        raise TypeError(f"{API}: timeout must be seconds (a number) or a datetime.timedelta, "
                        f"not {type(timeout).__name__}")
    if seconds is None:
        return None
    if not math.isfinite(seconds) or seconds <= 0:
        raise ValueError(f"{API}: timeout must be a positive number of seconds, got {seconds}")
    return timedelta(seconds=seconds)


# ---------------------------------------------------------------- collectives with a bound


def _group_ranks(group) -> list[int]:
    if dist.get_rank(group) < 0:
        raise ValueError(f"{API}: this process (global rank {dist.get_rank()}) is not a member "
                         "of the group it was given; only the group's ranks may call")
    if group is None:
        return list(range(dist.get_world_size()))
    return dist.get_process_group_ranks(group)


def _control_device(group, fallback: torch.device) -> torch.device:
    """Where the small agreement tensors live: the CPU for gloo (or a gloo/NCCL mix), the
    current CUDA device for NCCL, the buffer's device otherwise."""
    backend = str(dist.get_backend(group)).lower()
    if "gloo" in backend or backend == "mpi":
        return torch.device("cpu")
    if backend == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return fallback


def _wait(work, timeout: timedelta | None, what: str, group) -> None:
    """Waits for an asynchronous collective, at most ``timeout`` (else the process group's
    own timeout). A dead, crashed or absent rank becomes a ``RuntimeError`` here."""
    if work is None:  # not a member: refused earlier by _group_ranks
        return
    cause: RuntimeError | None = None
    try:
        done = work.wait() if timeout is None else work.wait(timeout=timeout)
        failure = None if done is not False else "the wait returned False"
    except RuntimeError as err:
        cause = err
        failure = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
    if failure is None:
        return
    bound = "the process group's timeout" if timeout is None else f"{timeout.total_seconds():g} s"
    raise RuntimeError(
        f"{API}: the {what} over {dist.get_world_size(group)} ranks failed: a rank died, "
        f"crashed or did not join it within {bound} ({failure}). This process group can no "
        "longer be used: destroy it (dist.destroy_process_group()) and start the ranks "
        "again") from cause


def _all_gather(t: Tensor, group, timeout: timedelta | None, what: str) -> list[Tensor]:
    parts = [torch.empty_like(t) for _ in range(dist.get_world_size(group))]
    _wait(dist.all_gather(parts, t, group=group, async_op=True), timeout, what, group)
    return parts


def _all_reduce(t: Tensor, op, group, timeout: timedelta | None, what: str) -> None:
    _wait(dist.all_reduce(t, op=op, group=group, async_op=True), timeout, what, group)


# The backends reduce and broadcast only some integer dtypes (gloo: no bool, int16, uint16,
# uint32 nor uint64, "Invalid scalar type"; NCCL: no bool nor int16). An integer tensor
# travels as a wider signed one that holds every value in the same order (for max), and
# comes back in its own dtype.
_WIRE = {torch.bool: torch.uint8, torch.int16: torch.int32, torch.uint16: torch.int32,
         torch.uint32: torch.int64}
_TOP = -(2**63)  # the sign bit of int64: uint64 values keep their order as int64 once flipped


def _int_wire(t: Tensor) -> Tensor:
    """``t`` in a dtype every backend reduces, contiguous (the backends refuse other
    tensors): a copy, or ``t`` itself when it is both."""
    if t.dtype == torch.uint64:
        return t.contiguous().view(torch.int64) ^ _TOP
    wide = _WIRE.get(t.dtype)
    if wide is None:
        return t.contiguous()
    return t.to(wide, memory_format=torch.contiguous_format)


def _from_int_wire(wire: Tensor, t: Tensor) -> None:
    """Writes the reduced ``wire`` back into ``t`` (nothing to do when it is ``t``)."""
    if wire is t:
        return
    if t.dtype == torch.uint64:
        t.copy_((wire ^ _TOP).view(torch.uint64))
    else:
        t.copy_(wire.to(t.dtype))


# ---------------------------------------------------------------- agreement

_OK, _FAILED = 0, 1


def _entry_label(kind: str, label: str) -> str:
    return "the tensor" if kind == "tensor" else f"tensor {label}"


def _difference(a: dict, b: dict, ra: int, rb: int) -> str:
    """The first way in which rank ``rb``'s model description differs from rank ``ra``'s."""
    kinds = {"dict": "a state_dict", "list": "a sequence of tensors", "tensor": "one tensor"}
    if a["kind"] != b["kind"]:
        return (f"rank {rb} passes {kinds[b['kind']]} per client, rank {ra} "
                f"{kinds[a['kind']]}")
    for flag in sorted(set(a["flags"]) | set(b["flags"])):
        va, vb = a["flags"].get(flag), b["flags"].get(flag)
        # compared as the digest sees them: scale=-0.0 and 0.0 are equal numbers but give
        # results with zeros of opposite signs
        if json.dumps(va) != json.dumps(vb):
            if flag == "delta":
                given = lambda v: "passes base= (delta mode)" if v else "passes no base"  # noqa: E731
                return f"rank {rb} {given(vb)}, rank {ra} {given(va)}"
            return f"{flag} is {vb!r} on rank {rb}, {va!r} on rank {ra}"
    ea = {e[0]: e for e in a["entries"]}
    eb = {e[0]: e for e in b["entries"]}
    if a["kind"] == "list" and len(ea) != len(eb):
        return f"rank {rb} has {len(eb)} tensors per model, rank {ra} has {len(ea)}"
    missing = [n for n in ea if n not in eb]
    if missing:
        return (f"tensor {missing[0]} is missing on rank {rb} (rank {ra} has it; missing: "
                f"{', '.join(missing[:5])}{', ...' if len(missing) > 5 else ''})")
    extra = [n for n in eb if n not in ea]
    if extra:
        return (f"rank {rb} has tensor {extra[0]}, which rank {ra} does not have (unexpected: "
                f"{', '.join(extra[:5])}{', ...' if len(extra) > 5 else ''})")
    for label, (_, shape_a, dtype_a, device_a) in ea.items():
        _, shape_b, dtype_b, device_b = eb[label]
        what = _entry_label(a["kind"], label)
        if shape_a != shape_b:
            return (f"{what} has shape {tuple(shape_b)} on rank {rb}, {tuple(shape_a)} on "
                    f"rank {ra}")
        if dtype_a != dtype_b:
            return f"{what} has dtype {dtype_b} on rank {rb}, {dtype_a} on rank {ra}"
        if device_a != device_b:
            return f"{what} is on a {device_b} device on rank {rb}, {device_a} on rank {ra}"
    for label, sum_a, sum_b in zip(ea, a.get("base", []), b.get("base", [])):
        if sum_a != sum_b:
            return (f"the base's {_entry_label(a['kind'], label)} holds other values on rank "
                    f"{rb} than on rank {ra} (every rank must pass the same base; the ranks "
                    "compare a checksum of its bits)")
    return f"rank {rb}'s model description differs from rank {ra}'s"


def _disagreement(ranks: list[int], payloads: list[dict]) -> Exception:
    """The one exception every rank raises, built from every rank's payload."""
    failed = [i for i, p in enumerate(payloads) if "error" in p]
    if failed:
        kind, message = payloads[failed[0]]["error"]
        others = (f" (ranks that failed: {[ranks[i] for i in failed]})" if len(failed) > 1
                  else "")
        cls = {"ValueError": ValueError, "TypeError": TypeError}.get(kind, RuntimeError)
        return cls(f"{API}: rank {ranks[failed[0]]} failed before the all-reduce, so no rank "
                   f"aggregated: {message}{others}")
    models = [p["model"] for p in payloads]
    # as the digests compare them (0.0 and -0.0 are == but hash differently)
    texts = [json.dumps(m, sort_keys=True) for m in models]
    differ = [i for i in range(1, len(models)) if texts[i] != texts[0]]
    if not differ:  # equal descriptions, unequal digests: cannot happen, but say so plainly
        return RuntimeError(f"{API}: the ranks' layout digests differ although their "
                            "descriptions agree")
    first = differ[0]
    others = (f" (ranks that differ from rank {ranks[0]}: {[ranks[i] for i in differ]})"
              if len(differ) > 1 else "")
    return ValueError(f"{API}: the ranks disagree on what to aggregate: "
                      f"{_difference(models[0], models[first], ranks[0], ranks[first])}{others}")


@dataclass
class _Agreement:
    """What the agreement gathered, one entry per rank of the group, in the group's order."""
    counts: list[int]         # clients
    totals: list[float]       # sum w
    abs_totals: list[float]   # sum |w|
    units: list[float]        # the power of two the rank's sums are relative to (0: none yet)
    sources: list[list[int]]  # the global ranks whose clients the rank's partial holds


def _floats_of(bits: list[int]) -> list[float]:
    return [struct.unpack("<d", struct.pack("<q", b))[0] for b in bits]


def _agree(group, timeout: timedelta | None, device: torch.device, *, model: dict | None,
           error: BaseException | None, require_clients: bool, count: int = 0,
           total: float = 0.0, abs_total: float = 0.0, unit: float = 0.0,
           sources: Sequence[int] = ()) -> _Agreement:
    """One small all_gather of ``[status, count, payload length, total, abs_total, unit,
    number of sources, first source, digest]`` per rank (the floats as their float64 bits; see
    _Agreement). Returns what every rank sent when all are ready and describe the same model
    (the sources take a second small gather only when some rank holds more than one);
    otherwise exchanges the payloads (a second small gather) and raises the same exception on
    every rank, naming the rank and the tensor at fault."""
    ranks = _group_ranks(group)
    sources = list(sources)
    if error is not None:
        payload = {"error": [type(error).__name__, str(error)]}
        status, digest, total, abs_total, unit = _FAILED, bytes(32), 0.0, 0.0, 0.0
    else:
        payload = {"model": model}
        status = _OK
        digest = hashlib.sha256(json.dumps(model, sort_keys=True).encode()).digest()
    blob = json.dumps(payload, sort_keys=True).encode()
    bits = struct.unpack("<3q", struct.pack("<3d", total, abs_total, unit))
    head = torch.tensor([status, count, len(blob), *bits, len(sources),
                         sources[0] if sources else -1, *struct.unpack("<4q", digest)],
                        dtype=torch.int64, device=device)
    heads = [h.tolist() for h in _all_gather(head, group, timeout, "layout agreement")]
    if all(h[0] == _OK for h in heads) and all(h[8:] == heads[0][8:] for h in heads):
        counts = [h[1] for h in heads]
        if require_clients and sum(counts) == 0:
            raise ValueError(f"{API}: no client updates on any of the {len(ranks)} ranks "
                             "(K = 0)")
        agreement = _Agreement(counts, _floats_of([h[3] for h in heads]),
                               _floats_of([h[4] for h in heads]),
                               _floats_of([h[5] for h in heads]),
                               [[h[7]] if h[6] else [] for h in heads])
        longest = max(h[6] for h in heads)
        if longest > 1:
            mine = torch.full((longest,), -1, dtype=torch.int64)
            mine[:len(sources)] = torch.tensor(sources, dtype=torch.int64)
            gathered = _all_gather(mine.to(device), group, timeout, "agreement on the sources")
            agreement.sources = [g[:h[6]].tolist() for g, h in zip(gathered, heads)]
        return agreement
    longest = max(h[2] for h in heads)
    mine = torch.zeros(longest, dtype=torch.uint8)
    mine[:len(blob)] = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
    blobs = _all_gather(mine.to(device), group, timeout, "layout disagreement report")
    payloads = [json.loads(bytes(b[:h[2]].cpu().tolist()).decode()) for b, h in zip(blobs, heads)]
    raise _disagreement(ranks, payloads)


def _plain_rank(value):
    """A rank (or any flag) as JSON data that every rank writes the same way: an int for any
    integer (Python, NumPy or 0-d tensor), else its repr."""
    if isinstance(value, str):
        return value
    try:
        return operator.index(value)
    except TypeError:
        return repr(value)


def _global_total(totals) -> float:
    """The ranks' weight totals summed exactly (``math.fsum``); a ``ValueError`` when the sum
    is beyond float64 (fsum raised OverflowError, and a rank's own total of inf gave a zero or
    NaN model once normalised)."""
    totals = list(totals)
    try:
        total = math.fsum(totals)
    except OverflowError:
        total = math.inf
    if not math.isfinite(total):
        raise ValueError(f"{API}: the weights sum to more than float64 holds (rank totals "
                         f"{[float(t) for t in totals][:10]}); scale them down (a common factor "
                         "cancels when normalize=True)")
    return total


class WeightedPartial:
    r"""A partial weighted sum :math:`S` over some clients and their :math:`W = \sum w_k`:
    :math:`S` in one flat buffer per accumulate dtype (usually one), :math:`W` in float64,
    plus the integer tensors. :math:`S` is held relative to a power of two near the largest
    weight (as ``fedkernels.Accumulator`` holds it), so weights near or past float32's limits
    normalise as in :func:`fedkernels.aggregate`.

    Build it with :meth:`from_clients`, combine across ranks with :meth:`all_reduce` (or
    :meth:`reduce` + :meth:`broadcast` for hierarchies), and read the model with
    :meth:`result`. Each collective method first checks, with one small all_gather, that
    every rank of the group holds a partial of the same layout and calls the same method with
    the same ``dst``/``src`` (else every rank raises the same ``ValueError``); ``timeout=``
    (seconds or a ``timedelta``) bounds every wait.

    A partial remembers which ranks' clients it holds. A sum that would count some clients
    twice (the same partials all-reduced twice, or partials that share a rank's clients after
    an earlier collective) raises the same ``ValueError`` on every rank; so does reading or
    summing a partial that :meth:`reduce` sent to another rank (its buffer is no longer a
    sum: it may only receive a :meth:`broadcast`).

    Not for concurrent use: a method called while another thread is inside one on the same
    partial (clients added during a collective, two collectives at once) raises
    ``RuntimeError`` without touching it. Each rank's partial is used by one thread at a time."""

    def __init__(self, layout: ModelLayout, like: list[Tensor], base: list[Tensor] | None,
                 int_policy: str, order: list | None = None) -> None:
        self.layout = layout
        self.order = list(layout.names) if order is None else order
        self.base = base
        self.int_policy = int_policy
        self.dtypes = [t.dtype for t in like]
        self.shapes = [t.shape for t in like]
        device = like[0].device if like else torch.device("cpu")
        self.device = device
        floats = [i for i, f in enumerate(layout.float_mask) if f]
        # One buffer per accumulate dtype.
        groups: dict[torch.dtype, list[int]] = {}
        for i in floats:
            groups.setdefault(_accumulate_dtype(like[i].dtype), []).append(i)
        if not groups:
            groups[torch.float64] = []
        self.buffers: list[Tensor] = []
        self.views: dict[int, Tensor] = {}
        for dtype, members in groups.items():
            size = sum(like[i].numel() for i in members)
            buffer = torch.zeros(size, dtype=dtype, device=device)
            offset = 0
            for i in members:
                numel = like[i].numel()
                self.views[i] = buffer[offset:offset + numel].view(like[i].shape)
                offset += numel
            self.buffers.append(buffer)
        self.ints: dict[int, Tensor] = {}
        self.count = 0
        self._total = torch.zeros((), dtype=torch.float64)
        # Every rank's client count and weight total, from the last agreement.
        self._counts: dict[int, int] = {}
        self._totals: dict[int, float] = {}
        # In delta mode the ranks also agree on the base's values (a checksum of its bits).
        self._base_checksums = None if base is None else _bit_checksums(base)
        # A Module.state_dict()'s _metadata (module versions, e.g. BatchNorm's), carried over
        # to the result as aggregate does.
        self._metadata = None
        # The global ranks whose clients the sums hold: None before the first collective (this
        # rank's own), () once reduce() summed them onto another rank (the buffer is then no
        # sum). The collectives compare them, so that no client is counted twice.
        self._sources: tuple[int, ...] | None = None
        self._rank_sources: dict[int, list[int]] = {}
        # The sums are held relative to a power of two near the largest weight (0.0: no client
        # yet, read as 1), as Accumulator holds them: weights near or past float32's limits
        # (3e38 + 3e38, 1e-46) then sum and normalise as aggregate's do. The collectives first
        # bring every rank's sums to the largest unit of the group.
        self._unit = 0.0
        self._units: dict[int, float] = {}

    @property
    def total_weight(self) -> Tensor:
        """:math:`W`, a 0-d float64 tensor on the CPU. The collectives carry it in their
        agreement step (each rank adds the gathered totals with ``math.fsum``), not in the
        model's buffer, so it keeps float64 precision for fp32 and half-precision models."""
        return self._total

    # ---------------------------------------------------------------- building

    @classmethod
    def from_clients(cls, updates: Sequence[Model], weights, *, base: Model | None = None,
                     like: Model | None = None, int_policy: str = "max") -> WeightedPartial:
        r"""The partial sum over this rank's clients: one fused pass
        :math:`S \mathrel{+}= \sum_k w_k x_k` (with ``base``: the inputs ``x_1..x_K, b`` with
        weights ``w_1..w_K, -\sum w``, i.e. :math:`\sum_k w_k (x_k - b)`).

        ``updates`` may be empty (a rank without clients); then ``like`` or ``base`` gives
        the structure. Every input is checked before anything is summed."""
        partial, clients, w = cls._checked(updates, weights, base, like, int_policy)
        if clients:
            partial._add(clients, w)
        return partial

    @classmethod
    def _checked(cls, updates, weights, base, like, int_policy
                 ) -> tuple[WeightedPartial, list[list[Tensor]], Tensor | None]:
        """:meth:`from_clients`'s checks: an empty partial of the clients' structure, the
        clients' tensors in the layout's order and their weights, nothing summed yet."""
        if int_policy not in INT_POLICIES:
            raise ValueError(f"{API}: int_policy must be one of {INT_POLICIES}, "
                             f"not {int_policy!r}")
        models, _ = split_clients(updates)
        template = models[0] if models else (like if like is not None else base)
        if template is None:
            raise ValueError(f"{API}: a rank without clients needs like= or base= (the "
                             "model's structure)")
        what = "client 0" if models else ("like" if like is not None else "base")
        layout, order = _canonical_layout(template, what)
        clients = [layout.tensors(m, f"client {k}") for k, m in enumerate(models)]
        base_tensors = None if base is None else layout.tensors(base, "base")
        like_tensors = clients[0] if clients else layout.tensors(template, what)
        _check_same_structure(layout, clients, base_tensors, like_tensors)
        w = None
        if clients:
            w = weight_vector(weights, len(clients), False)
        elif weights is not None and len(weights) != 0:
            raise ValueError(f"{API}: weights given but no updates")
        if int_policy == "error":
            ints = [n for n, f in zip(layout.names, layout.float_mask) if not f]
            if ints:
                raise TypeError(f"{API}: tensor {layout.label(ints[0])} has dtype "
                                f"{like_tensors[layout.names.index(ints[0])].dtype} and "
                                "int_policy='error'; choose 'max', 'first' or 'skip'")
        if base_tensors is not None:
            like_tensors = [b if f else t for b, t, f in
                            zip(base_tensors, like_tensors, layout.float_mask)]
        partial = cls(layout, like_tensors, base_tensors, int_policy, order)
        partial._metadata = getattr(template, "_metadata", None)
        return partial, clients, w

    @one_call_at_a_time("fedkernels.WeightedPartial")
    def add_clients(self, updates: Sequence[Model], weights) -> None:
        """Adds more clients, models of the partial's structure (state_dicts are matched by
        name), in one fused pass. Every input is checked before anything is added."""
        self._check_not_spent("add clients to it")
        models, _ = split_clients(updates)
        clients = [self.layout.tensors(m, f"client {k}") for k, m in enumerate(models)]
        half = (torch.float16, torch.bfloat16)
        for k, tensors in enumerate(clients):
            for i, (name, t) in enumerate(zip(self.layout.names, tensors)):
                dtype = self.dtypes[i]
                ok_dtype = t.dtype == dtype or (self.base is not None and self.layout.float_mask[i]
                                                and dtype == torch.float32 and t.dtype in half)
                if t.shape != self.shapes[i] or t.device != self.device or not ok_dtype:
                    raise ValueError(f"{API}: client {k}, tensor {self.layout.label(name)} is "
                                     f"{_describe_tensor(t)}, the partial holds {dtype} "
                                     f"{tuple(self.shapes[i])} on {self.device}")
        self._add(clients, weight_vector(weights, len(clients), False))

    def _add(self, clients: list[list[Tensor]], weights, divisor: float | None = None) -> None:
        """Adds checked clients (tensor lists in the layout's order) in one fused pass; the
        weights divided by ``divisor`` (all_reduce_aggregate's global total, so that
        normalize=True divides before it multiplies, as aggregate does: a raw weight beyond
        float32's range, or one so small that its reciprocal is, then stays exact)."""
        # Read as values (as Accumulator reads them): the sum goes into a buffer that the
        # all-reduce overwrites, so no gradient could reach the clients or the weights, and
        # the in-place op refuses tensors that require grad (a module's parameters).
        w = weight_vector(weights, len(clients), False).detach()
        if not clients:
            return
        floats = [i for i, f in enumerate(self.layout.float_mask) if f]
        inputs = [c[i].detach() for c in clients for i in floats]
        views = [self.views[i] for i in floats]
        raw_total = w.sum().to(device="cpu", dtype=torch.float64)
        peak = float(w.abs().max())
        unit = self._unit
        if divisor is not None:
            w, unit = w / divisor, 1.0
        elif peak != 0 and (unit == 0.0 or peak > unit * 2.0**32):
            new_unit = weight_unit(peak)
            if unit != 0.0:  # the sums so far, relative to the new unit
                self._rescale(unit / new_unit)
                self._unit = new_unit
            unit = new_unit
        w = w / (unit or 1.0)
        total = w.sum()
        if self.base is not None and floats:
            base = [self.base[i].detach() for i in floats]
            if all(b.dtype == clients[0][i].dtype for b, i in zip(base, floats)):
                # the base is one more input with weight -sum w: one pass
                inputs += base
                w = torch.cat([w, -total.reshape(1)])
            else:
                # a float32 base under half-precision clients: the op takes one dtype per
                # tensor across its inputs, so the base term is a second pass
                summation.weighted_sum_(views, base, -total.reshape(1), 1.0, False)
        if floats:
            summation.weighted_sum_(views, inputs, w, 1.0, False)
        self._total.add_(raw_total)
        if peak != 0:
            self._unit = unit
        for i, f in enumerate(self.layout.float_mask):
            if f:
                continue
            values = [c[i] for c in clients]
            if self.int_policy == "max":
                # elementwise_max: torch has no max for uint16/32/64 on the CPU. A copy: the
                # collectives write into it.
                local = values[0].clone()
                for v in values[1:]:
                    local = elementwise_max(local, v)
                self.ints[i] = local if i not in self.ints else elementwise_max(self.ints[i], local)
            else:  # "first" / "skip": the first client seen
                self.ints.setdefault(i, values[0].clone())
        self.count += len(clients)

    # ---------------------------------------------------------------- agreement

    def describe(self, **flags) -> dict:
        """What every rank must agree on, as plain JSON data: the layout kind, each tensor's
        name, shape, dtype and device type in the canonical order, ``int_policy``, delta mode,
        the caller's ``flags`` (e.g. ``normalize``, ``scale``) and, in delta mode, a checksum
        of each base tensor's bits."""
        kind = self.layout.kind
        entries = [["" if kind == "tensor" else self.layout.label(name), list(shape), str(dtype),
                    self.device.type]
                   for name, shape, dtype in zip(self.layout.names, self.shapes, self.dtypes)]
        described = {"kind": kind, "entries": entries,
                     "flags": {"int_policy": self.int_policy, "delta": self.base is not None,
                               **flags}}
        if self._base_checksums is not None:
            described["base"] = self._base_checksums
        return described

    @one_call_at_a_time("fedkernels.WeightedPartial")
    def agree(self, group=None, *, timeout=None) -> list[int]:
        """Checks, with one small all_gather, that every rank of ``group`` holds a partial of
        the same layout; returns each rank's client count. Every rank raises the same
        ``ValueError`` (naming the rank and the tensor) when they differ."""
        return self._agree_on(group, timeout)

    def _agree_on(self, group, timeout, **flags) -> list[int]:
        """:meth:`agree`, the ranks also agreeing on ``flags`` (which collective, its
        ``dst``/``src``): ranks that pass different roots would otherwise wait in different
        collectives until the timeout, some returning a partial that others never summed."""
        ranks = _group_ranks(group)
        flags = {k: _plain_rank(v) for k, v in flags.items()}
        mine = [dist.get_rank()] if self._sources is None else list(self._sources)
        agreed = _agree(group, _as_timeout(timeout), _control_device(group, self.device),
                        model=self.describe(**flags), error=None, require_clients=False,
                        count=self.count, total=float(self._total), unit=self._unit,
                        sources=mine)
        self._take(ranks, agreed)
        return agreed.counts

    def _take(self, ranks: list[int], agreed: _Agreement) -> None:
        self._counts = dict(zip(ranks, agreed.counts))
        self._totals = dict(zip(ranks, agreed.totals))
        self._units = dict(zip(ranks, agreed.units))
        self._rank_sources = dict(zip(ranks, agreed.sources))

    def _check_sums_once(self, collective: str) -> list[int]:
        """After the agreement, on every rank alike: the group's partials are sums (none was
        reduced onto another rank) and hold disjoint sets of ranks' clients. Returns their
        union."""
        seen: dict[int, int] = {}
        for rank, sources in self._rank_sources.items():
            if not sources:
                raise ValueError(f"{API}: rank {rank}'s partial was summed onto another rank "
                                 f"by reduce(), so it holds no sum for this {collective}; it "
                                 "can only receive a broadcast (or start anew with from_clients)")
            for source in sources:
                if source in seen:
                    raise ValueError(
                        f"{API}: the partials of ranks {seen[source]} and {rank} both hold the "
                        f"clients of rank {source} (an earlier collective summed them); this "
                        f"{collective} would count them twice. Start each round from new "
                        "partials (from_clients)")
                seen[source] = rank
        return sorted(seen)

    def _rescale(self, ratio: float) -> None:
        """The sums relative to another unit: times ``ratio``, a power of two (exact)."""
        for buffer in self.buffers:
            buffer.mul_(ratio)

    def _align_units(self) -> None:
        """After the agreement, before a sum: every rank's sums relative to the group's
        largest unit (ranks without clients have none)."""
        common = max(self._units.values(), default=0.0)
        if self._unit != 0.0 and self._unit != common:
            self._rescale(self._unit / common)
        self._unit = common

    def _check_not_spent(self, what: str) -> None:
        if self._sources == ():
            raise ValueError(f"{API}: this partial was summed onto another rank by reduce(); "
                             f"its buffer is no longer a sum, so it cannot {what}. Receive the "
                             "result with broadcast(), or start anew with from_clients")

    # ---------------------------------------------------------------- collectives

    @one_call_at_a_time("fedkernels.WeightedPartial")
    def all_reduce(self, group=None, *, timeout=None) -> WeightedPartial:
        """Sums the partials of every rank of ``group`` (one all-reduce per accumulate
        dtype, usually one; plus a max over the integer tensors), after :meth:`agree`."""
        self._agree_on(group, timeout, collective="all_reduce")
        return self._all_reduce_agreed(group, _as_timeout(timeout))

    def _all_reduce_agreed(self, group, timeout: timedelta | None) -> WeightedPartial:
        # on every rank, before the collectives
        sources = self._check_sums_once("all_reduce")
        total = _global_total(self._totals.values())
        self._align_units()
        for buffer in self.buffers:
            _all_reduce(buffer, dist.ReduceOp.SUM, group, timeout, "all-reduce of the model")
        self._reduce_ints(group, dst=None, timeout=timeout)
        self.count = sum(self._counts.values())
        self._total.fill_(total)
        self._sources = tuple(sources)
        return self

    @one_call_at_a_time("fedkernels.WeightedPartial")
    def reduce(self, dst: int, group=None, *, timeout=None) -> WeightedPartial:
        """Sums the partials onto rank ``dst`` (global rank) only, e.g. a node's leader."""
        self._agree_on(group, timeout, collective="reduce", dst=dst)
        bound = _as_timeout(timeout)
        # on every rank, before the collectives
        sources = self._check_sums_once("reduce")
        total = _global_total(self._totals.values())
        self._align_units()
        for buffer in self.buffers:
            _wait(dist.reduce(buffer, dst=dst, op=dist.ReduceOp.SUM, group=group, async_op=True),
                  bound, "reduce of the model", group)
        self._reduce_ints(group, dst=dst, timeout=bound)
        if dist.get_rank() == dst:
            self.count = sum(self._counts.values())
            self._total.fill_(total)
            self._sources = tuple(sources)
        else:
            self._sources = ()
        return self

    @one_call_at_a_time("fedkernels.WeightedPartial")
    def broadcast(self, src: int, group=None, *, timeout=None) -> WeightedPartial:
        """Copies rank ``src``'s (global rank) partial to every rank of ``group``."""
        self._agree_on(group, timeout, collective="broadcast", src=src)
        bound = _as_timeout(timeout)
        if src in self._rank_sources and not self._rank_sources[src]:
            raise ValueError(f"{API}: broadcast from rank {src}, whose partial was summed onto "
                             "another rank by reduce(): it holds no sum to send")
        for buffer in self.buffers:
            _wait(dist.broadcast(buffer, src=src, group=group, async_op=True), bound,
                  "broadcast of the model", group)
        for i in self._int_indices():
            t = self._int_tensor(i)
            wire = _int_wire(t)
            _wait(dist.broadcast(wire, src=src, group=group, async_op=True), bound,
                  "broadcast of an integer tensor", group)
            _from_int_wire(wire, t)
        self.count = self._counts.get(src, self.count)
        self._total.fill_(self._totals.get(src, float(self._total)))
        self._sources = tuple(self._rank_sources.get(src, self._sources or ()))
        self._unit = self._units.get(src, self._unit)
        return self

    def _int_indices(self) -> list[int]:
        return [i for i, f in enumerate(self.layout.float_mask) if not f]

    def _int_tensor(self, i: int) -> Tensor:
        if i not in self.ints:
            # A rank without clients: the identity of max, or a placeholder for first/skip.
            dtype, shape = self.dtypes[i], self.shapes[i]
            if self.int_policy == "max":
                fill = False if dtype == torch.bool else torch.iinfo(dtype).min
                self.ints[i] = torch.full(shape, fill, dtype=dtype, device=self.device)
            else:
                self.ints[i] = torch.zeros(shape, dtype=dtype, device=self.device)
        return self.ints[i]

    def _reduce_ints(self, group, dst: int | None, timeout: timedelta | None) -> None:
        indices = self._int_indices()
        if not indices or self.int_policy == "skip" and self.base is not None:
            return
        if self.int_policy == "max":
            for i in indices:
                t = self._int_tensor(i)
                wire = _int_wire(t)
                work = (dist.all_reduce(wire, op=dist.ReduceOp.MAX, group=group, async_op=True)
                        if dst is None else
                        dist.reduce(wire, dst=dst, op=dist.ReduceOp.MAX, group=group,
                                    async_op=True))
                _wait(work, timeout, "max-reduce of an integer tensor", group)
                _from_int_wire(wire, t)
            return
        # "first" (and "skip" without base): the first client of the lowest rank with clients.
        owners = [r for r, n in sorted(self._counts.items()) if n > 0]
        if not owners:
            raise ValueError(f"{API}: no rank has a client")
        for i in indices:
            t = self._int_tensor(i)
            wire = _int_wire(t)
            _wait(dist.broadcast(wire, src=owners[0], group=group, async_op=True),
                  timeout, "broadcast of an integer tensor", group)
            _from_int_wire(wire, t)

    # ---------------------------------------------------------------- reading

    def _narrow(self) -> str | None:
        """The label of the first float tensor that accumulates in float32, if any."""
        for i, f in enumerate(self.layout.float_mask):
            if f and self.views[i].dtype == torch.float32:
                return self.layout.label(self.layout.names[i])
        return None

    def _check_scale(self, scale) -> float:
        """``scale`` as a float: a finite real number, within float32's range where the
        model accumulates in float32 (as :func:`fedkernels.aggregate` refuses it)."""
        scale = real_number(API, "scale", scale)
        if not math.isfinite(scale):
            raise ValueError(f"{API}: scale must be finite, got {scale}")
        narrow = self._narrow()
        if narrow and abs(scale) > FLOAT32_MAX:
            raise ValueError(f"{API}: scale {scale:.4g} is beyond the float32 range (|x| <= "
                             f"{FLOAT32_MAX:.4g}) of tensor {narrow}")
        return scale

    def _check_out(self, out: Model) -> list[Tensor]:
        """``out``'s tensors in the canonical order, after checking each has the result's
        shape, dtype and device, and everything else that would fail or corrupt midway, as
        the entries are written one by one: with grad mode on, no entry that requires grad;
        no entry with elements that share memory, overlapping another entry, or overlapping
        a base entry other than its own (which it may be, in place)."""
        tensors = self.layout.tensors(out, "out")
        labels = [self.layout.label(name) for name in self.layout.names]
        for label, t, shape, dtype in zip(labels, tensors, self.shapes, self.dtypes):
            if t.shape != shape or t.dtype != dtype or t.device != self.device:
                raise ValueError(f"{API}: out tensor {label} is {_describe_tensor(t)}, the "
                                 f"result is {dtype} {tuple(shape)} on {self.device}")
            if t.requires_grad and torch.is_grad_enabled():
                raise RuntimeError(f"{API}: out tensor {label} requires grad; the result is "
                                   "written in place and carries no gradient: write it under "
                                   "torch.no_grad(), as PyTorch's in-place ops require")
            if has_internal_overlap(t):
                raise ValueError(f"{API}: out tensor {label} has elements that share memory "
                                 "(an expanded or overlapping view)")
        outputs = Footprints([(byte_span(t), t, i) for i, t in enumerate(tensors)])
        bases = Footprints([] if self.base is None else
                           [(byte_span(b), b, i) for i, b in enumerate(self.base)])
        for i, t in enumerate(tensors):
            span = byte_span(t)
            other = outputs.overlap(span, t, exclude=i)
            if other is not None and not same_memory(t, tensors[other]):  # tied: one tensor
                raise ValueError(f"{API}: out tensors {labels[i]} and {labels[other]} "
                                 "overlap; every output entry needs its own memory")
            own = self.base is not None and same_memory(t, self.base[i])
            hit = bases.overlap(span, t, exclude=i if own else None)
            if hit is not None and not same_memory(t, self.base[hit]):
                raise ValueError(f"{API}: out tensor {labels[i]} overlaps base tensor "
                                 f"{labels[hit]}; out may be the base itself (in place), not "
                                 "part of it")
        return tensors

    @one_call_at_a_time("fedkernels.WeightedPartial")
    def result(self, *, scale: float = 1.0, normalize: bool = False,
               out: Model | None = None) -> Model:
        r"""The aggregate: :math:`\mathrm{scale}\,S/[W]`, or :math:`b + \mathrm{scale}\,S/[W]`
        with a base; in the models' dtypes (base's in delta mode); written into ``out`` when
        given (which may be the base, for an in-place server step). A state_dict result has
        the key order of this rank's first client (or ``like``/``base``), and its
        ``_metadata`` (a ``Module.state_dict()``'s module versions) as a copy.

        As :func:`fedkernels.aggregate` and ``Accumulator``: ``scale``, and without
        ``normalize`` a weight, beyond float32's range is refused for models that accumulate
        in float32 (fp32, fp16, bf16); with ``normalize`` weights of any finite size give the
        normalised model."""
        self._check_not_spent("give a result")
        self._check_scale(scale)
        total = float(self.total_weight)
        if normalize and total == 0:
            raise ValueError(f"{API}: normalize=True but the weights sum to 0")
        unit = self._unit or 1.0
        narrow = self._narrow()
        if not normalize and narrow and unit > 2.0**128:  # the largest weight is past 2^128
            raise ValueError(f"{API}: a weight is beyond the float32 range (|w| <= "
                             f"{FLOAT32_MAX:.4g}) of tensor {narrow}; use "
                             "result(normalize=True), or float64 models")
        # S = unit * the buffer
        factor = scale * (unit / total if normalize else unit)
        wide = needs_float64_factor(factor)
        out_tensors = None if out is None else self._check_out(out)
        results = []
        for i, f in enumerate(self.layout.float_mask):
            target = None if out_tensors is None else out_tensors[i]
            if not f:
                if self.int_policy == "skip" and self.base is not None:
                    value = self.base[i]
                else:
                    value = self._int_tensor(i)
                results.append(value.clone() if target is None else target.copy_(value))
                continue
            s = self.views[i]
            s = s.double() if wide and s.dtype == torch.float32 else s
            if self.base is None:
                value = (s * factor).to(self.dtypes[i])
            else:
                b = self.base[i]
                value = torch.add(b.to(s.dtype), s, alpha=factor).to(b.dtype)
            results.append(value if target is None else target.copy_(value))
        if out is not None:
            return out
        model = self.layout.build(results)
        if self.layout.kind == "dict":
            model = with_metadata({n: model[n] for n in self.order}, self._metadata)
        return model


def all_reduce_aggregate(
    updates: Sequence[Model],
    weights,
    *,
    base: Model | None = None,
    scale: float = 1.0,
    normalize: bool = False,
    out: Model | None = None,
    int_policy: str = "max",
    like: Model | None = None,
    group=None,
    timeout: float | timedelta | None = None,
) -> Model:
    r""":func:`fedkernels.aggregate` over the union of every rank's clients, each rank
    passing only its own ``updates`` and ``weights`` (see the module docstring): plain
    :math:`\mathrm{scale}\sum_k w_k x_k`, or with ``base``
    :math:`b + \mathrm{scale}\sum_k w_k (x_k - b)`; ``normalize`` divides by the global
    :math:`\sum_k w_k`. Every rank of ``group`` must call it (with the same ``base``, flags
    and ``int_policy``, and ``like`` where it has no clients), and every rank gets the result.
    State_dict tensors are matched by name, whatever each rank's key order.

    Errors: each rank checks its own inputs first, then all ranks agree (one small
    all_gather) on the layout, the flags and that some rank has a client. If any rank failed
    or the ranks differ, every rank raises the same ``ValueError``/``TypeError`` naming the
    rank and the tensor, and nothing is summed or written. ``timeout`` (seconds or a
    ``timedelta``; default: the process group's timeout) bounds every wait: a rank that died
    or never calls makes the others raise ``RuntimeError`` after at most that long, and the
    process group is then unusable.

    Errors also cover a ``base`` whose values differ between ranks (the ranks compare a
    checksum of its bits), which would otherwise give each rank another model.

    Cost per rank: one fused pass over its clients (and, in delta mode, one read of the base
    for its checksum), one small all_gather (12 integers per rank), one all-reduce of one model
    (in the accumulate dtype), and one small max-reduce per integer tensor."""
    local_error: Exception | None = None
    partial: WeightedPartial | None = None
    model = None
    bound = None
    try:
        bound = _as_timeout(timeout)
        scale = real_number(API, "scale", scale)
        partial, clients, w = WeightedPartial._checked(updates, weights, base, like, int_policy)
        scale = partial._check_scale(scale)
        count = len(clients)
        local_total = 0.0 if w is None else float(w.sum())
        abs_total = 0.0 if w is None else float(w.abs().sum())
        if clients and not normalize:
            narrow = partial._narrow()
            peak = float(w.abs().max())
            if narrow and peak > FLOAT32_MAX:  # as aggregate refuses it
                raise ValueError(f"{API}: a weight of {peak:.4g} is beyond the float32 range "
                                 f"(|w| <= {FLOAT32_MAX:.4g}) of tensor {narrow}; use "
                                 "normalize=True, or float64 models")
            partial._add(clients, w)
        # With normalize=True the clients are summed after the agreement, relative to 1.
        unit = 1.0 if normalize and count else partial._unit
        if out is not None:
            partial._check_out(out)
        model = partial.describe(normalize=bool(normalize), scale=scale)
    except Exception as err:  # reported to every rank by the agreement below
        local_error = err
    ranks = _group_ranks(group)  # first: a non-member's backend is unknown
    device = _control_device(group, partial.device if partial is not None
                             else torch.device("cpu"))
    try:
        ok = local_error is None
        agreed = _agree(group, bound, device, model=model, error=local_error,
                        require_clients=True, count=count if ok else 0,
                        total=local_total if ok else 0.0, abs_total=abs_total if ok else 0.0,
                        unit=unit if ok else 0.0, sources=[dist.get_rank()])
    except (ValueError, TypeError, RuntimeError) as err:
        if local_error is not None:
            raise err from local_error
        raise
    partial._take(ranks, agreed)
    # Every rank gathered the same totals, so every rank raises the same error here, before
    # the model-sized all-reduce.
    total = _global_total(agreed.totals)
    if normalize:
        if total == 0:
            raise ValueError(f"{API}: normalize=True but the weights sum to 0")
        # With normalize=True each rank sums its clients now, by w_k / W with the global W (as
        # aggregate divides before it multiplies: raw weights of any finite size). Every
        # w_k / W, and a base's -sum w / W, is at most max(abs totals) / |W|: every rank
        # refuses alike what a float32 accumulator cannot take, rather than one rank raising
        # in the op while the others wait in the all-reduce.
        largest = max(agreed.abs_totals) / abs(total)
        if largest > FLOAT32_MAX and partial._narrow():
            raise ValueError(f"{API}: normalize=True with weights of mixed signs that almost "
                             f"cancel: sum |w| / |sum w| is {largest:.3g}, beyond float32's "
                             "range in which this model accumulates")
        if clients:
            partial._add(clients, w, divisor=total)
    partial._all_reduce_agreed(group, bound)
    return partial.result(scale=scale, out=out)
