"""The CPU output pool of the allocating ``weighted_sum`` (``fedkernels.aggregate`` without
``out=``).

A fresh result is new memory, and its first write faults once per 4 KiB page. A federated
server aggregates every round and drops the previous global model; the pool keeps the blocks of
dropped results (of 256 KiB or more) and hands them to the next results of the same size, whose
pages are then already in place. A block goes back to the pool only when every tensor that uses
it is freed, so two live results never share memory.

The pool holds at most ``limit`` idle bytes (the least recently used blocks are freed first):
512 MiB, or an eighth of the machine's memory where that is less, unless the environment
variable ``FEDKERNELS_OUTPUT_POOL_BYTES`` (read when fedkernels loads) or
:func:`set_output_pool_limit` says otherwise; 0 turns the pool off.
"""

from __future__ import annotations

import os

import torch

_ops = torch.ops.fedkernels
ENV_VAR = "FEDKERNELS_OUTPUT_POOL_BYTES"


def set_output_pool_limit(limit_bytes: int) -> None:
    """Keep at most ``limit_bytes`` of idle result blocks (0: no pool; results then come from
    PyTorch's allocator). Idle blocks beyond the new limit are freed now."""
    if isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int) or limit_bytes < 0:
        raise ValueError(f"the output pool limit must be a whole number of bytes >= 0, "
                         f"got {limit_bytes!r}")
    _ops.output_pool_set_limit(limit_bytes)


def release_output_pool() -> int:
    """Free every idle block now (the results still in use are untouched); returns the bytes
    freed. The pool stays on and fills again as results are dropped."""
    return int(_ops.output_pool_release())


def output_pool_stats() -> dict[str, int]:
    """``limit`` and ``idle_bytes``/``idle_blocks`` (held for reuse), and the allocations
    served from the pool (``hits``) or freshly (``misses``) so far."""
    limit, idle_bytes, idle_blocks, hits, misses = _ops.output_pool_stats()
    return {"limit": limit, "idle_bytes": idle_bytes, "idle_blocks": idle_blocks,
            "hits": hits, "misses": misses}


def _limit_from_environment() -> None:
    text = os.environ.get(ENV_VAR, "").strip()
    if not text:
        return
    try:
        limit = int(text)
    except ValueError:
        limit = -1
    if limit < 0:
        raise ImportError(f"{ENV_VAR} must be a whole number of bytes >= 0 (0 turns the pool "
                          f"off), not {text!r}")
    set_output_pool_limit(limit)


_limit_from_environment()
