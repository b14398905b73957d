"""Fresh CPU result tensors backed by transparent huge pages.

A freshly allocated multi-megabyte tensor is new memory from the kernel: its first write
faults once per 4 KiB page, and the kernel zeroes each page as it faults. For a model-sized
result that is thousands of faults per call, a large part of an allocating aggregation's
time. Mapped with ``MADV_HUGEPAGE``, the same memory faults once per 2 MiB page.
"""

from __future__ import annotations

import mmap
from functools import cache

import torch
from torch import Tensor

HUGE_PAGE_BYTES = 2 << 20
_THP_SETTING = "/sys/kernel/mm/transparent_hugepage/enabled"


@cache
def huge_pages_available() -> bool:
    """Whether the kernel gives transparent huge pages to a region that asks for them
    (``enabled`` is ``[always]`` or ``[madvise]``, not ``[never]``), and ``mmap`` can ask."""
    if not hasattr(mmap, "MADV_HUGEPAGE"):
        return False
    try:
        with open(_THP_SETTING) as f:
            return "[never]" not in f.read()
    except OSError:
        return False


def empty_huge(shape: torch.Size | tuple[int, ...], dtype: torch.dtype) -> Tensor:
    """An uninitialised CPU tensor in its own anonymous mapping advised for huge pages (the
    mapping is released when the tensor's storage is). Large anonymous mappings start on a
    2 MiB boundary on current kernels, so every whole 2 MiB of the tensor can be one page."""
    nbytes = torch.Size(shape).numel() * dtype.itemsize
    region = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    region.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(region, dtype=dtype, count=nbytes // dtype.itemsize).view(shape)
