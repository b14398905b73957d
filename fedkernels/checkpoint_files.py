"""Weighted sums of K model checkpoints held as files, out of core: :func:`aggregate_files`.

Fine-tuned language models, their LoRA adapters and model soups are exchanged as files
(safetensors, sharded safetensors with a ``model.safetensors.index.json``, torch ``.pt``
state_dicts). Loading K of them to call :func:`fedkernels.aggregate` needs K models' worth of
memory; here every tensor is streamed in chunks through the fused ``weighted_sum`` op instead,
so memory stays O(chunk × K) whatever the model's size, and the result is written as
safetensors (sharded above a size, with Hugging Face's index file).

Inputs are mapped read-only and shared (``mmap``), and the op reads each chunk in place from
the page cache: no copy, unlike ``read``/``pread`` into a buffer, which cost more than the sum
itself (docs/guide/large_models.md has the measurement). The pages of each chunk are unmapped
once summed, so the resident set stays a few chunks.
"""

from __future__ import annotations

import json
import math
import mmap
import os
import shutil
import tempfile
import warnings
from collections.abc import Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field

import torch
from torch import Tensor

from .aggregate import _check_weight_range
from .model_layout import (
    FLOAT_DTYPES,
    INT_POLICIES,
    ModelLayout,
    elementwise_max,
    real_number,
    weights_and_values,
)
from .ops import summation

API = "fedkernels.aggregate_files"

# safetensors' dtype codes (its format specification)
SAFETENSORS_DTYPES: dict[str, torch.dtype] = {
    "F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16,
    "I64": torch.int64, "I32": torch.int32, "I16": torch.int16, "I8": torch.int8,
    "U64": torch.uint64, "U32": torch.uint32, "U16": torch.uint16, "U8": torch.uint8,
    "BOOL": torch.bool, "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2,
}
_DTYPE_CODES = {dtype: code for code, dtype in SAFETENSORS_DTYPES.items()}
INDEX_SUFFIX = ".safetensors.index.json"
TORCH_SUFFIXES = (".pt", ".pth", ".bin")
DEFAULT_CHUNK_BYTES = 1 << 20
DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # Hugging Face's default shard size ("5GB")
_MAX_HEADER_BYTES = 100 << 20  # the safetensors package's own limit on a header
_ALIGN = 64  # each piece in a chunk buffer starts on a cache line


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read as one (its message names the file and tensor)."""


# ---------------------------------------------------------------- reading checkpoints


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor's bytes are: ``path`` at byte ``offset`` (safetensors), or ``source``
    (a tensor of a ``.pt`` file loaded with ``mmap=True``)."""

    name: str
    dtype: torch.dtype
    shape: tuple[int, ...]
    path: str
    offset: int = 0
    source: Tensor | None = None

    @property
    def numel(self) -> int:
        return math.prod(self.shape)

    @property
    def nbytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass
class Checkpoint:
    """One client's (or the base's) tensors, by name, in file order."""

    what: str  # "client 2 (path)" or "base (path)"
    files: list[str]
    entries: dict[str, TensorEntry]
    metadata: dict[str, str] = field(default_factory=dict)


def _fail(message: str) -> CheckpointError:
    return CheckpointError(f"{API}: {message}")


def _safetensors_entries(path: str, who: str) -> tuple[dict[str, TensorEntry], dict[str, str]]:
    """Reads and checks the header of one safetensors file: every tensor's dtype, shape and
    byte range (within the file: a truncated file is named with the first tensor it cuts)."""
    try:
        size = os.path.getsize(path)
        with open(path, "rb") as f:
            prefix = f.read(8)
            length = int.from_bytes(prefix, "little") if len(prefix) == 8 else -1
            if not 0 < length <= min(size - 8, _MAX_HEADER_BYTES):
                raise _fail(f"{who}: {path} is not a safetensors file (its header length "
                            f"{length if length >= 0 else 'is missing'}; the file has "
                            f"{size} bytes)")
            raw = f.read(length)
    except OSError as err:
        raise _fail(f"{who}: cannot read {path} ({err.strerror or err})") from None
    try:
        header = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(f"{who}: {path} has a damaged safetensors header ({err})") from None
    if not isinstance(header, dict):
        raise _fail(f"{who}: {path} has a damaged safetensors header (not a JSON object)")
    metadata = header.pop("__metadata__", None) or {}
    start = 8 + length
    entries = {}
    for name, info in header.items():
        where = f"{who}: {path}, tensor {name!r}"
        try:
            code, shape, (begin, end) = info["dtype"], info["shape"], info["data_offsets"]
        except (TypeError, KeyError, ValueError):
            raise _fail(f"{where}: damaged header entry {info!r}") from None
        if code not in SAFETENSORS_DTYPES:
            raise _fail(f"{where}: unknown dtype {code!r}")
        if not (isinstance(shape, list) and all(type(d) is int and d >= 0 for d in shape)):
            raise _fail(f"{where}: damaged shape {shape!r}")
        entry = TensorEntry(name, SAFETENSORS_DTYPES[code], tuple(shape), path, start + begin)
        if not (type(begin) is int and type(end) is int and 0 <= begin and end - begin == entry.nbytes):
            raise _fail(f"{where}: byte range {[begin, end]} does not hold {code} "
                        f"{tuple(shape)} ({entry.nbytes} bytes)")
        if start + end > size:
            raise _fail(f"{where}: ends at byte {start + end}, past the end of the file "
                        f"({size} bytes): the file is truncated")
        entries[name] = entry
    # The package's own checks on top (overlapping or unordered ranges, and whatever else
    # it refuses), so that any file accepted here loads with it too.
    from safetensors import safe_open

    try:
        with safe_open(path, framework="pt"):
            pass
    except Exception as err:  # the package raises its own SafetensorError, and OSError
        raise _fail(f"{who}: {path} is not a valid safetensors file ({_one_line(err)})") from None
    return entries, {str(k): str(v) for k, v in metadata.items()}


def _one_line(err: object) -> str:
    return " ".join(str(err).split())


def _sharded_entries(index_path: str, who: str) -> tuple[list[str], dict[str, TensorEntry]]:
    """The tensors of a sharded checkpoint: its index's ``weight_map`` (name -> shard file),
    every shard checked against it."""
    try:
        with open(index_path, encoding="utf-8") as f:
            index = json.load(f)
    except OSError as err:
        raise _fail(f"{who}: cannot read {index_path} ({err.strerror or err})") from None
    except (UnicodeDecodeError, json.JSONDecodeError) as err:
        raise _fail(f"{who}: {index_path} is not valid JSON ({err})") from None
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not weight_map:
        raise _fail(f"{who}: {index_path} has no 'weight_map' (name -> shard file)")
    folder = os.path.dirname(index_path)
    by_shard: dict[str, list[str]] = {}
    for name, shard in weight_map.items():
        if not isinstance(shard, str) or os.path.basename(shard) != shard:
            raise _fail(f"{who}: {index_path}: tensor {name!r} maps to {shard!r}, not a file "
                        "name beside the index")
        by_shard.setdefault(shard, []).append(name)
    entries: dict[str, TensorEntry] = {}
    files = []
    for shard, names in by_shard.items():
        path = os.path.join(folder, shard)
        if not os.path.isfile(path):
            raise _fail(f"{who}: shard {path} is missing (tensor {names[0]!r} of {index_path})")
        found, _ = _safetensors_entries(path, who)
        missing = [n for n in names if n not in found]
        if missing:
            raise _fail(f"{who}: shard {path} lacks tensor {missing[0]!r}, which {index_path} "
                        f"maps to it ({len(missing)} missing)")
        extra = [n for n in found if weight_map.get(n) != shard]
        if extra:
            raise _fail(f"{who}: shard {path} holds tensor {extra[0]!r}, which {index_path} "
                        "does not map to it")
        files.append(path)
        entries.update(found)
    order = {name: i for i, name in enumerate(weight_map)}
    return files, dict(sorted(entries.items(), key=lambda item: order[item[0]]))


def _torch_entries(path: str, who: str) -> dict[str, TensorEntry]:
    """A ``torch.save``'d state_dict, memory-mapped (``torch.load(mmap=True)``): its tensors'
    bytes are read from the page cache as they are needed."""
    try:
        loaded = torch.load(path, map_location="cpu", mmap=True, weights_only=True)
    except Exception as err:  # torch raises RuntimeError, pickle errors, OSError
        raise _fail(f"{who}: cannot load {path} with torch.load(mmap=True) "
                    f"({_one_line(err)})") from None
    if not isinstance(loaded, dict) or not all(isinstance(t, Tensor) for t in loaded.values()):
        kind = type(loaded).__name__
        raise _fail(f"{who}: {path} holds a {kind}, not a state_dict of tensors "
                    "(name -> tensor)")
    return {str(name): TensorEntry(str(name), t.dtype, tuple(t.shape), path, source=t)
            for name, t in loaded.items()}


def open_checkpoint(path: str | os.PathLike, who: str) -> Checkpoint:
    """The tensors of one checkpoint: a ``.safetensors`` file, a sharded checkpoint (its
    ``*.safetensors.index.json``, or a folder holding one, or one ``.safetensors`` file), or
    a torch ``.pt``/``.pth``/``.bin`` state_dict. Every header is read and checked here."""
    path = os.fspath(path)
    if os.path.isdir(path):
        names = sorted(os.listdir(path))
        indexes = [n for n in names if n.endswith(INDEX_SUFFIX)]
        singles = [n for n in names if n.endswith(".safetensors")]
        if len(indexes) == 1:
            path = os.path.join(path, indexes[0])
        elif not indexes and len(singles) == 1:
            path = os.path.join(path, singles[0])
        else:
            found = indexes or singles
            raise _fail(f"{who}: folder {path} holds "
                        + (f"several checkpoints ({', '.join(found[:4])})" if found else
                           "no *.safetensors file nor *.safetensors.index.json")
                        + "; name the file")
    if not os.path.exists(path):
        raise _fail(f"{who}: {path} does not exist")
    label = f"{who} ({path})"
    if path.endswith(".json"):
        files, entries = _sharded_entries(path, who)
        metadata = {}
    elif path.endswith(TORCH_SUFFIXES):
        files, entries, metadata = [path], _torch_entries(path, who), {}
    else:
        entries, metadata = _safetensors_entries(path, who)
        files = [path]
    return Checkpoint(label, files, entries, metadata)


# ---------------------------------------------------------------- the output files


def _shard_names(out: str, count: int) -> list[str]:
    stem = out[: -len(".safetensors")]
    return [f"{stem}-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)]


def safetensors_header(tensors: Sequence[tuple[str, torch.dtype, tuple[int, ...]]],
                       metadata: dict[str, str]) -> bytes:
    """The header of a safetensors file holding ``tensors`` back to back in this order: the
    8-byte little-endian length, then the JSON, padded with spaces to a multiple of 8 bytes
    (so every tensor's data is aligned for its dtype when they come in decreasing element
    size). Written by hand: the safetensors package only writes files from tensors held in
    memory, which is what streaming avoids."""
    header: dict[str, object] = {"__metadata__": dict(metadata)} if metadata else {}
    offset = 0
    for name, dtype, shape in tensors:
        nbytes = math.prod(shape) * dtype.itemsize
        header[name] = {"dtype": _DTYPE_CODES[dtype], "shape": list(shape),
                        "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    return len(text).to_bytes(8, "little") + text


@dataclass
class _Shard:
    path: str  # the final name
    names: list[str]
    data_start: int = 0  # the header's size: where the first tensor's bytes begin
    offsets: dict[str, int] = field(default_factory=dict)  # name -> byte offset in the file
    header: bytes = b""


def _plan_shards(out: str, names: list[str], dtypes: dict[str, torch.dtype],
                 shapes: dict[str, tuple[int, ...]], max_shard_bytes: int | None,
                 metadata: dict[str, str]) -> tuple[list[_Shard], str | None]:
    """Which tensors go to which output file, and the index file (None for one file). Shards
    fill in the given order as Hugging Face's do; a tensor larger than a shard has its own."""
    always_index = out.endswith(INDEX_SUFFIX)
    single = out[: -len(".index.json")] if always_index else out
    groups: list[list[str]] = [[]]
    size = 0
    for name in names:
        nbytes = math.prod(shapes[name]) * dtypes[name].itemsize
        if max_shard_bytes is not None and groups[-1] and size + nbytes > max_shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(name)
        size += nbytes
    sharded = always_index or len(groups) > 1
    paths = _shard_names(single, len(groups)) if sharded else [single]
    shards = []
    for path, group in zip(paths, groups):
        # decreasing element size: every tensor's bytes aligned for its dtype
        group = sorted(group, key=lambda n: -dtypes[n].itemsize)
        header = safetensors_header([(n, dtypes[n], shapes[n]) for n in group], metadata)
        shard = _Shard(path, group, len(header), header=header)
        offset = shard.data_start
        for n in group:
            shard.offsets[n] = offset
            offset += math.prod(shapes[n]) * dtypes[n].itemsize
        shards.append(shard)
    return shards, (single + ".index.json") if sharded else None


# ---------------------------------------------------------------- chunked streaming


@dataclass
class _Piece:
    """Elements [start, start + count) of one tensor, at ``buffer_offset`` in the clients' and
    base's chunk buffers and ``out_offset`` in the output chunk buffer."""

    name: str
    start: int
    count: int
    buffer_offset: int
    out_offset: int


@dataclass
class _Step:
    shard: int
    file_offset: int  # where the output chunk starts in its shard
    pieces: list[_Piece]
    in_bytes: int  # bytes used in each client buffer
    out_bytes: int


def _plan_steps(shards: list[_Shard], in_dtypes: dict[str, torch.dtype],
                out_dtypes: dict[str, torch.dtype], shapes: dict[str, tuple[int, ...]],
                chunk_bytes: int) -> list[_Step]:
    """Cuts the output, in file order, into steps of at most ``chunk_bytes`` of each client's
    input (a large tensor spans steps; small tensors share one)."""
    steps: list[_Step] = []
    for s, shard in enumerate(shards):
        step = _Step(s, shard.data_start, [], 0, 0)
        for name in shard.names:
            numel = math.prod(shapes[name])
            size_in, size_out = in_dtypes[name].itemsize, out_dtypes[name].itemsize
            start = 0
            while start < numel:
                rest = numel - start
                room = (chunk_bytes - step.in_bytes) // size_in
                if step.pieces and room < rest and room < chunk_bytes // (4 * size_in):
                    # too little room left for a useful piece: the next step
                    steps.append(step)
                    step = _Step(s, step.file_offset + step.out_bytes, [], 0, 0)
                    continue
                count = max(1, min(rest, room))
                step.pieces.append(_Piece(name, start, count, step.in_bytes, step.out_bytes))
                step.in_bytes += -(-count * size_in // _ALIGN) * _ALIGN
                step.out_bytes += count * size_out
                start += count
        if step.pieces:
            steps.append(step)
    return steps


class _Reader:
    """One checkpoint's tensors as views of its files mapped into memory (read-only, shared:
    the op reads the page cache in place, with no copy)."""

    def __init__(self, checkpoint: Checkpoint):
        self.checkpoint = checkpoint
        self.maps: dict[str, mmap.mmap] = {}
        self.bytes: dict[str, Tensor] = {}  # path -> the whole file as uint8
        self._flat: tuple[str, Tensor] | None = None  # the last .pt tensor, flattened
        # whether some piece must be copied: a .pt tensor, or bytes not aligned for the dtype
        self.needs_scratch = any(e.source is not None or e.offset % e.dtype.itemsize
                                 for e in checkpoint.entries.values())

    def open(self) -> None:
        for path in self.checkpoint.files:
            if path.endswith(TORCH_SUFFIXES):
                continue  # torch.load(mmap=True) mapped it already
            with open(path, "rb") as f:
                self.maps[path] = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            with warnings.catch_warnings():  # read-only memory: the op only reads it
                warnings.simplefilter("ignore", UserWarning)
                self.bytes[path] = torch.frombuffer(self.maps[path], dtype=torch.uint8)

    def close(self) -> None:
        self.bytes.clear()
        self._flat = None
        for m in self.maps.values():
            try:
                m.close()
            except BufferError:  # a view still referenced (a traceback): unmapped when freed
                pass
        self.maps.clear()

    def views(self, step: _Step, scratch: Tensor | None, at_out_offsets: bool) -> list[Tensor]:
        """The step's pieces of this checkpoint, one 1-D tensor each: views of the mapped
        file, or copies in ``scratch`` (at the pieces' client-buffer offsets, or output
        offsets for the base) where a piece's bytes are not aligned for its dtype (the
        safetensors format does not require alignment) or come from a ``.pt`` file."""
        out = []
        for p in step.pieces:
            entry = self.checkpoint.entries[p.name]
            size = entry.dtype.itemsize
            if entry.source is None:
                at = entry.offset + p.start * size
                raw = self.bytes[entry.path][at:at + p.count * size]
                if at % size == 0:
                    out.append(raw.view(entry.dtype))
                    continue
            else:
                raw = self._flattened(entry)[p.start:p.start + p.count]
            at = p.out_offset if at_out_offsets else p.buffer_offset
            if entry.source is None:  # bytes to bytes, then viewed where aligned
                scratch[at:at + p.count * size].copy_(raw)
                out.append(_piece_view(scratch, at, p.count, entry.dtype))
            else:
                out.append(_piece_view(scratch, at, p.count, entry.dtype).copy_(raw))
        return out

    def release(self, step: _Step) -> None:
        """Unmaps the pages the step read (they stay in the page cache): the process's
        resident memory stays a few chunks, not the size of the files."""
        for p in step.pieces:
            entry = self.checkpoint.entries[p.name]
            if entry.source is not None:
                continue
            start = entry.offset + p.start * entry.dtype.itemsize
            end = start + p.count * entry.dtype.itemsize
            first = start // mmap.PAGESIZE * mmap.PAGESIZE
            if end > first:
                self.maps[entry.path].madvise(mmap.MADV_DONTNEED, first, end - first)

    def _flattened(self, entry: TensorEntry) -> Tensor:
        if self._flat is None or self._flat[0] != entry.name:
            # a view for contiguous tensors; one copy of a non-contiguous one, kept while its
            # pieces are read
            self._flat = (entry.name, entry.source.reshape(-1))
        return self._flat[1]


def _piece_view(buffer: Tensor, offset: int, count: int, dtype: torch.dtype) -> Tensor:
    return buffer[offset:offset + count * dtype.itemsize].view(dtype)


# ---------------------------------------------------------------- validation


def _file_list(files) -> list[str]:
    if isinstance(files, (str, bytes, os.PathLike)) or not isinstance(files, Sequence):
        raise TypeError(f"{API}: files must be a list of checkpoint paths, got "
                        f"{type(files).__name__}")
    paths = []
    for k, f in enumerate(files):
        if not isinstance(f, (str, os.PathLike)):
            raise TypeError(f"{API}: files[{k}] must be a path, got {type(f).__name__}")
        paths.append(os.fspath(f))
    if not paths:
        raise ValueError(f"{API}: no client files (K = 0)")
    return paths


def _check_same_tensors(ref: Checkpoint, other: Checkpoint, is_base: bool) -> None:
    names = set(ref.entries)
    if set(other.entries) != names:
        missing = [n for n in ref.entries if n not in other.entries]
        extra = [n for n in other.entries if n not in names]
        raise _fail(f"{other.what} has different tensors than {ref.what}"
                    + (f"; missing {missing[:5]}" if missing else "")
                    + (f"; unexpected {extra[:5]}" if extra else ""))
    for name, r in ref.entries.items():
        e = other.entries[name]
        dtype_ok = e.dtype == r.dtype or (is_base and e.dtype == torch.float32
                                          and r.dtype in (torch.float16, torch.bfloat16))
        if e.shape != r.shape or not dtype_ok:
            expected = " (or float32 for half-precision clients)" if is_base else ""
            shard = f" (in {e.path})" if len(other.files) > 1 else ""
            raise _fail(f"{other.what}, tensor {name!r}{shard} is {e.dtype} {e.shape}, "
                        f"{ref.what} has {r.dtype} {r.shape}{expected}")


def _same_file(a: str, b: str) -> bool:
    try:
        return os.path.samefile(a, b)
    except OSError:
        return os.path.realpath(a) == os.path.realpath(b)


def _check_output_paths(targets: list[str], inputs: list[str], overwrite: bool,
                        total_bytes: int) -> str:
    """Refuses an output that is an input, that exists (without ``overwrite``), or that does
    not fit on its disk; returns the output folder."""
    folder = os.path.dirname(os.path.abspath(targets[0]))
    if not os.path.isdir(folder):
        raise _fail(f"the output folder {folder} does not exist")
    for target in targets:
        for path in inputs:
            if os.path.exists(target) and _same_file(target, path):
                raise _fail(f"the output {target} is an input file ({path}); write the result "
                            "elsewhere")
        if os.path.isdir(target):
            raise _fail(f"the output {target} is a folder")
        if os.path.exists(target) and not overwrite:
            raise _fail(f"the output {target} exists; pass overwrite=True (--overwrite) to "
                        "replace it")
    if not os.access(folder, os.W_OK):
        raise _fail(f"cannot write into the output folder {folder}")
    stats = os.statvfs(folder)
    free = stats.f_bavail * stats.f_frsize
    if free < total_bytes:
        raise _fail(f"the output needs {total_bytes / 1e9:.2f} GB but {folder} has "
                    f"{free / 1e9:.2f} GB free")
    return folder


# ---------------------------------------------------------------- the API


def aggregate_files(
    files: Sequence[str | os.PathLike],
    weights,
    *,
    out: str | os.PathLike,
    base: str | os.PathLike | None = None,
    scale: float = 1.0,
    normalize: bool = False,
    int_policy: str = "max",
    chunk_bytes: int = DEFAULT_CHUNK_BYTES,
    max_shard_bytes: int | None = DEFAULT_MAX_SHARD_BYTES,
    overwrite: bool = False,
    fsync: bool = True,
) -> list[str]:
    r"""Weighted sum of K checkpoint files, streamed in chunks: what
    ``fedkernels.aggregate`` computes on the loaded state_dicts, in O(chunk × K) memory.

    Plain mode: :math:`r = \mathrm{scale}\cdot\sum_k w_k x_k`; delta mode (``base`` given):
    :math:`r = b + \mathrm{scale}\cdot\sum_k w_k (x_k - b)`.

    Args:
        files: K client checkpoints, each a ``.safetensors`` file, a sharded checkpoint (its
            ``*.safetensors.index.json``, or the folder holding it) or a torch
            ``.pt``/``.pth``/``.bin`` state_dict (memory-mapped with ``torch.load(mmap=True)``).
            All hold the same tensor names, shapes and dtypes (in any order and sharding).
        weights: K real numbers, used as given unless ``normalize``.
        out: the result, a ``.safetensors`` path. Above ``max_shard_bytes`` it is split as
            Hugging Face does: ``NAME-00001-of-0000N.safetensors`` beside
            ``NAME.safetensors.index.json``; an ``out`` ending in ``.safetensors.index.json``
            is always written that way.
        base, scale, normalize, int_policy: as :func:`fedkernels.aggregate` (``base`` is a
            checkpoint file; its float tensors have the clients' dtype, or float32 for
            half-precision clients, and give the result its dtype).
        chunk_bytes: bytes of each client summed per step. Memory beyond the page cache is
            about ``(K + 3) × chunk_bytes``: the mapped pages of one step, two output buffers
            (one written while the next is summed), and copies of pieces that need one
            (``.pt`` tensors, unaligned safetensors data).
        max_shard_bytes: the largest output file (None: one file).
        overwrite: replace existing output files (refused otherwise).
        fsync: flush the output to the disk before it takes its final name, so that a crash
            of the machine cannot leave a named but incomplete file.

    Returns:
        The written paths: the index first when sharded, then the shards.

    Every file's header, tensor names, shapes and dtypes, the weights and the output path
    are checked before any output is created; a failure names the file and the tensor. The
    output is written under a temporary name in the output folder and renamed when complete,
    so a crash or Ctrl-C leaves no partial file under the output's name. Half-precision
    tensors accumulate in fp32; clients are summed in order (bitwise reproducible).
    """
    paths = _file_list(files)
    if int_policy not in INT_POLICIES:
        raise ValueError(f"{API}: int_policy must be one of {INT_POLICIES}, not {int_policy!r}")
    scale = real_number(API, "scale", scale)
    if not math.isfinite(scale):
        raise ValueError(f"{API}: scale must be finite, got {scale}")
    if isinstance(chunk_bytes, bool) or not isinstance(chunk_bytes, int) or chunk_bytes < 4096:
        raise ValueError(f"{API}: chunk_bytes must be an integer of at least 4096, got "
                         f"{chunk_bytes!r}")
    if max_shard_bytes is not None and (isinstance(max_shard_bytes, bool)
                                        or not isinstance(max_shard_bytes, int)
                                        or max_shard_bytes < 1):
        raise ValueError(f"{API}: max_shard_bytes must be a positive integer or None, got "
                         f"{max_shard_bytes!r}")
    out = os.fspath(out)
    if not out.endswith(".safetensors") and not out.endswith(INDEX_SUFFIX):
        raise ValueError(f"{API}: out must be a .safetensors (or .safetensors.index.json) "
                         f"path, got {out!r}")
    try:
        w, w_values = weights_and_values(weights, len(paths), normalize)
    except (TypeError, ValueError) as err:
        raise type(err)(str(err).replace("fedkernels.aggregate:", f"{API}:", 1)) from None

    clients = [open_checkpoint(p, f"client {k}") for k, p in enumerate(paths)]
    base_ckpt = None if base is None else open_checkpoint(base, "base")
    ref = clients[0]
    if not ref.entries:
        raise _fail(f"{ref.what} holds no tensors")
    for c in clients[1:]:
        _check_same_tensors(ref, c, is_base=False)
    if base_ckpt is not None:
        _check_same_tensors(ref, base_ckpt, is_base=True)
    names = list(ref.entries)
    in_dtypes = {n: e.dtype for n, e in ref.entries.items()}
    shapes = {n: e.shape for n, e in ref.entries.items()}
    is_float = {}
    for name, dtype in in_dtypes.items():
        if dtype in FLOAT_DTYPES:
            is_float[name] = True
        elif dtype.is_floating_point or dtype.is_complex:
            raise TypeError(f"{API}: {ref.what}, tensor {name!r} has unsupported dtype {dtype}; "
                            "supported: float32, float64, float16, bfloat16 (integer and bool "
                            "tensors follow int_policy)")
        else:
            is_float[name] = False
            if int_policy == "error":
                raise TypeError(f"{API}: tensor {name!r} has dtype {dtype} and "
                                "int_policy='error'; choose 'max', 'first' or 'skip'")
    out_dtypes = {n: (base_ckpt.entries[n].dtype if base_ckpt is not None and is_float[n]
                      else in_dtypes[n]) for n in names}
    layout = ModelLayout("dict", tuple(names), tuple(is_float[n] for n in names))
    float_meta = [(n, torch.empty(0, dtype=in_dtypes[n], device="meta"))
                  for n in names if is_float[n]]
    _check_weight_range(w_values, scale, normalize, float_meta, layout, api=API)

    metadata = {"format": "pt", **ref.metadata} if ref.metadata else {"format": "pt"}
    shards, index_path = _plan_shards(out, names, out_dtypes, shapes, max_shard_bytes, metadata)
    targets = ([index_path] if index_path else []) + [s.path for s in shards]
    inputs = [f for c in clients + ([base_ckpt] if base_ckpt else []) for f in c.files]
    total = sum(len(s.header) for s in shards) + sum(
        math.prod(shapes[n]) * out_dtypes[n].itemsize for n in names)
    folder = _check_output_paths(targets, inputs, overwrite, total)

    readers = [_Reader(c) for c in clients] + ([_Reader(base_ckpt)] if base_ckpt else [])
    steps = _plan_steps(shards, in_dtypes, out_dtypes, shapes, chunk_bytes)
    with _StagingFolder(folder, targets) as staging:
        _stream(readers, steps, shards, staging, w, scale, base_ckpt is not None, int_policy,
                in_dtypes, out_dtypes, shapes, is_float, fsync, index_path, names)
    return targets


class _StagingFolder:
    """A temporary folder beside the output; on success its files are renamed to their final
    names (the index last: a reader that finds it finds every shard), on any failure or
    interrupt it is removed."""

    def __init__(self, folder: str, targets: list[str]):
        self.folder = folder
        self.targets = targets
        self.path = ""

    def __enter__(self) -> _StagingFolder:
        self.path = tempfile.mkdtemp(prefix=".aggregate_files-", dir=self.folder)
        return self

    def staged(self, target: str) -> str:
        return os.path.join(self.path, os.path.basename(target))

    def __exit__(self, kind, value, traceback) -> None:
        try:
            if kind is None:
                for target in self.targets[1:] + self.targets[:1]:
                    os.replace(self.staged(target), target)
        finally:
            shutil.rmtree(self.path, ignore_errors=True)


def _stream(readers: list[_Reader], steps: list[_Step], shards: list[_Shard],
            staging: _StagingFolder, w: Tensor, scale: float, delta: bool, int_policy: str,
            in_dtypes, out_dtypes, shapes, is_float, fsync: bool,
            index_path: str | None, names: list[str]) -> None:
    """Sums every step from the mapped inputs into one of two output buffers; a writer
    thread writes the previous step's buffer meanwhile."""
    num_clients = len(readers) - (1 if delta else 0)
    in_size = max((s.in_bytes for s in steps), default=0)
    out_size = max((s.out_bytes for s in steps), default=0)
    scratch: list[Tensor | None] = [None] * len(readers)  # made when a piece needs a copy
    outs = [torch.empty(out_size, dtype=torch.uint8) for _ in range(2)]
    fds: list[int] = []
    try:
        for r in readers:
            r.open()
        for shard in shards:
            fd = os.open(staging.staged(shard.path), os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
            fds.append(fd)
            os.pwrite(fd, shard.header, 0)
        with ThreadPoolExecutor(max_workers=1, thread_name_prefix="aggregate_files") as writer:
            pending: Future | None = None
            try:
                for i, step in enumerate(steps):
                    views = []
                    for j, r in enumerate(readers):
                        is_base = j == num_clients
                        if scratch[j] is None and r.needs_scratch:
                            scratch[j] = torch.empty(out_size if is_base else in_size,
                                                     dtype=torch.uint8)
                        views.append(r.views(step, scratch[j], at_out_offsets=is_base))
                    _sum_step(step, views, outs[i % 2], num_clients, w, scale, delta,
                              int_policy, out_dtypes, is_float)
                    del views
                    if pending is not None:
                        pending.result()
                    data = memoryview(outs[i % 2].numpy())[:step.out_bytes]
                    pending = writer.submit(_pwrite_all, fds[step.shard], data, step.file_offset)
                    for r in readers:
                        r.release(step)
                if pending is not None:
                    pending.result()
            finally:  # the writer may not outlive the buffers and files
                writer.shutdown(wait=True, cancel_futures=True)
        if fsync:
            for fd in fds:
                os.fsync(fd)
    finally:
        for fd in fds:
            os.close(fd)
        for r in readers:
            r.close()
    if index_path is not None:
        total = sum(math.prod(shapes[n]) * out_dtypes[n].itemsize for n in names)
        weight_map = {n: os.path.basename(s.path) for s in shards for n in s.names}
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(staging.staged(index_path), "w", encoding="utf-8") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
            if fsync:
                f.flush()
                os.fsync(f.fileno())
    if fsync:
        fd = os.open(staging.path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


# Writes of at most this many bytes: larger single writes into a growing file stalled in the
# page cache's writeback throttling here (several times slower per byte).
WRITE_PIECE_BYTES = 1 << 20


def _pwrite_all(fd: int, data: memoryview, offset: int) -> None:
    done = 0
    while done < len(data):
        done += os.pwrite(fd, data[done:done + WRITE_PIECE_BYTES], offset + done)


def _sum_step(step: _Step, views: list[list[Tensor]], out: Tensor, num_clients: int,
              w: Tensor, scale: float, delta: bool, int_policy: str, out_dtypes,
              is_float) -> None:
    """One step: the fused op on the float pieces of every client (``views[k][i]``: client k's
    piece i; the base's last), ``int_policy`` on the integer ones, into the output buffer."""
    batch = _OpBatch(num_clients, w, scale, delta)
    for i, p in enumerate(step.pieces):
        pieces = [v[i] for v in views[:num_clients]]
        target = _piece_view(out, p.out_offset, p.count, out_dtypes[p.name])
        base = views[-1][i] if delta else None
        if is_float[p.name]:
            batch.add(pieces, base, target)
        elif int_policy == "max":
            result = pieces[0]
            for v in pieces[1:]:
                result = elementwise_max(result, v)
            target.copy_(result)
        elif int_policy == "skip" and base is not None:
            target.copy_(base)
        else:  # "first", or "skip" without a base: client 0's
            target.copy_(pieces[0])
    batch.run()


# The most bytes one op call touches: under the op's serial threshold (4 MiB, csrc/cpu/
# parallel.h), so each call runs on the calling thread alone while the reader and writer
# threads use the other cores (a thread team would wait on them, and they on it).
OP_CALL_BYTES = 3 << 20


class _OpBatch:
    """Float pieces gathered into op calls of at most OP_CALL_BYTES of traffic each (a large
    piece is cut into several calls)."""

    def __init__(self, num_clients: int, w: Tensor, scale: float, delta: bool):
        self.num_clients, self.w, self.scale, self.delta = num_clients, w, scale, delta
        self._clear()

    def _clear(self) -> None:
        self.updates: list[list[Tensor]] = [[] for _ in range(self.num_clients)]
        self.bases: list[Tensor] = []
        self.outs: list[Tensor] = []
        self.bytes = 0

    def add(self, views: list[Tensor], base: Tensor | None, target: Tensor) -> None:
        per_element = self.num_clients * views[0].element_size() + target.element_size() * (
            2 if base is not None else 1)
        start, numel = 0, target.numel()
        while start < numel:
            count = min(numel - start, (OP_CALL_BYTES - self.bytes) // per_element)
            if count <= 0:
                self.run()
                continue
            end = start + count
            for k, v in enumerate(views):
                self.updates[k].append(v[start:end])
            if base is not None:
                self.bases.append(base[start:end])
            self.outs.append(target[start:end])
            self.bytes += count * per_element
            start = end

    def run(self) -> None:
        if self.outs:
            summation.weighted_sum_out([t for c in self.updates for t in c], self.w, self.bases,
                                       self.scale, self.delta, self.outs)
        self._clear()
