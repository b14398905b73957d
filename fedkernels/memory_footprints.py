"""Which memory a tensor can touch, and whether memory ranges overlap: the checks that keep an
aggregation from writing into its own inputs, for the entries the native ops do not check
themselves (integer entries of ``aggregate``, the outputs of the robust rules' Python paths)."""

from __future__ import annotations

import bisect
from collections.abc import Hashable

from torch import Tensor


def byte_span(t: Tensor) -> tuple[int, int] | None:
    """``[first byte, past last byte)`` that ``t`` can touch (None when it has no memory).
    Called for every integer input, so the common contiguous case costs three queries."""
    start, size = t.data_ptr(), t.nbytes
    if start == 0 or size == 0:  # meta and empty tensors touch no memory
        return None
    if not t.is_contiguous():
        size = (1 + sum((n - 1) * s for n, s in zip(t.shape, t.stride()))) * t.element_size()
    return start, start + size


def same_memory(a: Tensor, b: Tensor) -> bool:
    """True when ``a`` and ``b`` are the same view of the same memory (one tensor under two
    names, such as tied weights in a state_dict, or base passed again as out)."""
    return (a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.stride() == b.stride()
            and a.dtype == b.dtype)


def has_internal_overlap(t: Tensor) -> bool:
    """True when two elements of ``t`` may share memory (an expanded or overlapping view)."""
    reach = 1  # elements spanned by the dimensions of smaller stride
    for stride, size in sorted((s, n) for n, s in zip(t.shape, t.stride()) if n > 1):
        if stride < reach:
            return True
        reach += (size - 1) * stride
    return False


class Footprints:
    """Memory ranges of tensors, each with a key, for "does this range overlap any of them"
    queries in O(log n) each (sorted starts and a running maximum of the ends)."""

    def __init__(self, spans: list[tuple[tuple[int, int] | None, Tensor, Hashable]]):
        spans = sorted(((s[0], s[1], t, key) for s, t, key in spans if s is not None),
                       key=lambda item: item[0])
        self._spans = spans
        self._starts = [item[0] for item in spans]
        self._reach, end = [], -1
        for item in spans:
            end = max(end, item[1])
            self._reach.append(end)

    def overlap(self, span: tuple[int, int] | None, t: Tensor, exclude: Hashable = None):
        """The key of a tensor (other than ``exclude``) whose memory overlaps ``span`` (the
        footprint of ``t``), or None."""
        if span is None:
            return None
        start, stop = span
        j = bisect.bisect_left(self._starts, stop) - 1
        while j >= 0 and self._reach[j] > start:
            _, end, other, key = self._spans[j]
            if end > start and key != exclude and other.device == t.device:
                return key
            j -= 1
        return None
