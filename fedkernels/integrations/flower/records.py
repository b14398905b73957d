"""Flower's records as tensors and back: ``Array``/``ArrayRecord`` to CPU tensors that are
views of the message's bytes (no ``np.load`` copy), ndarrays to ``Array`` with one copy, and
the state_dict conversions. Shared by every strategy of :mod:`fedkernels.integrations.flower`."""

from __future__ import annotations

import ctypes
import functools
import io
import math
import platform
import warnings
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from flwr.app import Array, ArrayRecord
from torch import Tensor

from fedkernels.integrations.adapters import ndarrays_to_tensors, tensors_to_ndarrays

__all__ = ["array_to_tensor", "arrayrecord_to_state_dict", "ndarray_to_array",
           "state_dict_to_arrayrecord"]

StateDict = dict[str, Tensor]
_NUMPY_STYPE = "numpy.ndarray"
# The float dtypes the fused ops take; other dtypes go through Flower's own NumPy code.
FUSED_FLOAT_DTYPES = (np.dtype(np.float16), np.dtype(np.float32), np.dtype(np.float64))


def array_to_tensor(array: Array, *, copy: bool = False) -> Tensor:
    """A Flower ``Array`` as a CPU tensor. Without ``copy`` the tensor is a read-only view of
    the ``Array``'s serialized bytes (the ``.npy`` header is parsed and skipped), where
    ``Array.numpy()`` would copy them; it falls back to ``Array.numpy()`` for other
    serializations. Do not write into a view: it aliases the message's bytes."""
    if array.stype != _NUMPY_STYPE:
        return ndarrays_to_tensors([array.numpy()], copy=copy)[0]
    a = _array_view(array)
    if copy:
        a = a.copy()
    return ndarrays_to_tensors([a])[0]


_NPY_MAGIC = b"\x93NUMPY"


def _array_view(array: Array) -> np.ndarray:
    """A read-only ndarray over a NumPy-serialized ``Array``'s bytes (no copy)."""
    data = array.data
    fast = _array_view_from_metadata(array, data)
    if fast is not None:
        return fast
    stream = io.BytesIO(data)
    version = np.lib.format.read_magic(stream)
    if version == (1, 0):
        shape, fortran, dtype = np.lib.format.read_array_header_1_0(stream)
    else:
        shape, fortran, dtype = np.lib.format.read_array_header_2_0(stream)
    if dtype.hasobject:
        raise TypeError("array_to_tensor: object arrays are not supported")
    count = math.prod(shape)
    flat = np.frombuffer(data, dtype=dtype, count=count, offset=stream.tell())
    return flat.reshape(shape[::-1]).T if fortran else flat.reshape(shape)


def _array_view_from_metadata(array: Array, data: bytes) -> np.ndarray | None:
    """The view from the dtype and shape the ``Array`` carries, once the ``.npy`` header has
    been checked to say the same (C order, that descr, that shape): no header parsing
    (``np.lib.format`` evaluates it as a Python literal, slow next to a small array's copy).
    None where anything differs; the caller then parses the header."""
    try:
        expected = _expected_header(array.dtype, array.shape)
    except (TypeError, ValueError):
        return None
    if expected is None:
        return None
    dtype, shape, count, (order, descr, dims), saved = expected
    if saved is not None and data.startswith(saved):  # np.save's own header, byte for byte
        end = len(saved)
    else:
        if data[:6] != _NPY_MAGIC or len(data) < 12 or data[6] not in (1, 2, 3):
            return None
        start = 10 if data[6] == 1 else 12
        end = start + int.from_bytes(data[8:start], "little")
        if data.find(order, start, end) < 0 or data.find(descr, start, end) < 0 \
                or data.find(dims, start, end) < 0:
            return None
    if end + count * dtype.itemsize > len(data):
        return None
    return np.ndarray(shape, dtype=dtype, buffer=data, offset=end)


@functools.lru_cache(maxsize=4096)
def _expected_header(dtype_name: str, shape: tuple[int, ...]):
    """What the ``.npy`` header of a C-ordered array of this dtype and shape says, and the
    header ``np.save`` writes for it, which most replies carry byte for byte (cached: a model
    has few distinct layer shapes, its replies many arrays)."""
    dtype = np.dtype(dtype_name)
    shape = tuple(int(s) for s in shape)
    if dtype.hasobject:
        return None
    markers = (b"'fortran_order': False", f"'descr': {dtype.str!r}".encode(),
               f"'shape': {shape!r}".encode())
    return dtype, shape, math.prod(shape), markers, _npy_header(dtype.str, shape)


def ndarray_to_array(a: np.ndarray) -> Array:
    """``flwr.app.Array(a)``, the same object (``np.save``'s bytes, dtype, shape), built with
    one copy of the data where ``Array`` makes two (``np.save`` into a buffer, then
    ``getvalue``)."""
    a = np.asarray(a)
    if a.dtype.hasobject or not a.flags.c_contiguous:
        return Array(a)
    header = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(header, np.lib.format.header_data_from_array_1_0(a))
    except ValueError:  # a header too long for format 1.0: let NumPy choose
        return Array(a)
    data = b"".join((header.getvalue(), memoryview(a.reshape(-1).view(np.uint8))))
    return Array(dtype=str(a.dtype), shape=tuple(int(s) for s in a.shape),
                 stype=_NUMPY_STYPE, data=data)


def _bytes_allocator():
    """CPython's ``PyBytes_FromStringAndSize(NULL, n)``: a bytes object of n bytes, not yet
    written. The C API lets its creator fill such an object before anyone else sees it, which
    is how the result is written where the outgoing ``Array`` keeps it (no copy into a second
    buffer). None on other interpreters: the caller then copies, as before."""
    if platform.python_implementation() != "CPython":
        return None
    try:
        make = ctypes.pythonapi.PyBytes_FromStringAndSize
    except AttributeError:  # pragma: no cover - a CPython without the symbol exported
        return None
    make.restype = ctypes.py_object
    make.argtypes = [ctypes.c_void_p, ctypes.c_ssize_t]
    return make


_NEW_BYTES = _bytes_allocator()


@functools.lru_cache(maxsize=4096)
def _npy_header(dtype_str: str, shape: tuple[int, ...]) -> bytes | None:
    """The ``.npy`` header ``np.save`` writes for a C-ordered array of this dtype and shape
    (format 1.0), or None where format 1.0 cannot hold it."""
    fields = {"descr": np.lib.format.dtype_to_descr(np.dtype(dtype_str)),
              "fortran_order": False, "shape": shape}
    stream = io.BytesIO()
    try:
        np.lib.format.write_array_header_1_0(stream, fields)
    except ValueError:
        return None
    return stream.getvalue()


def array_with_buffer(dtype: np.dtype, shape: Sequence[int]) -> tuple[Array, Tensor] | None:
    """A NumPy-serialized ``Array`` of ``dtype`` and ``shape`` whose values are not written
    yet, and a writable CPU tensor over them (its own fresh bytes, aliasing nothing else).
    The caller must write every value before handing the ``Array`` on; the ``Array`` then
    equals ``Array(ndarray)`` of those values. None where this cannot be done (another
    interpreter, an empty array, a dtype torch lacks): the caller copies as before."""
    dtype = np.dtype(dtype)
    shape = tuple(int(s) for s in shape)
    count = math.prod(shape)
    if _NEW_BYTES is None or count == 0 or dtype not in FUSED_FLOAT_DTYPES \
            or not dtype.isnative:
        return None
    header = _npy_header(dtype.str, shape)
    if header is None:
        return None
    nbytes = count * dtype.itemsize
    data = _NEW_BYTES(None, len(header) + nbytes)
    with warnings.catch_warnings():  # the buffer is a new bytes object only this code sees
        warnings.filterwarnings("ignore", message=".*not writable.*")
        raw = torch.frombuffer(data, dtype=torch.uint8)
    raw[:len(header)].copy_(torch.frombuffer(bytearray(header), dtype=torch.uint8))
    values = raw[len(header):].view(_TORCH_DTYPES[dtype]).view(shape)
    array = Array(dtype=str(dtype), shape=shape, stype=_NUMPY_STYPE, data=data)
    return array, values


_TORCH_DTYPES = {np.dtype(np.float16): torch.float16, np.dtype(np.float32): torch.float32,
                 np.dtype(np.float64): torch.float64}


def arrayrecord_to_state_dict(record: ArrayRecord, *, copy: bool = False) -> StateDict:
    """An ``ArrayRecord`` as a state_dict of CPU tensors (views of its bytes unless ``copy``;
    :func:`array_to_tensor`). Equal to ``record.to_torch_state_dict()`` without its copies."""
    return {k: array_to_tensor(v, copy=copy) for k, v in record.items()}


def state_dict_to_arrayrecord(state: Mapping[str, Tensor]) -> ArrayRecord:
    """A state_dict as an ``ArrayRecord`` (one serialization per tensor, which Flower's wire
    format needs; bfloat16 becomes float32, which NumPy lacks)."""
    arrays = tensors_to_ndarrays(state)
    return ArrayRecord({k: Array(np.asarray(a)) for k, a in zip(state.keys(), arrays)})


def ndarray_view(value: Any) -> np.ndarray:
    """A Flower ``Array`` (or an ndarray, as in FedOpt's ``current_arrays``) as an ndarray:
    a read-only view of the Array's bytes where possible, never a copy of an ndarray."""
    if isinstance(value, Array):
        if value.stype != _NUMPY_STYPE:
            return value.numpy()  # raises Flower's own TypeError for other serializations
        return _array_view(value)
    return np.asarray(value)


def to_tensor(a: np.ndarray, dtype: np.dtype) -> Tensor:
    return as_tensors([a], [dtype])[0]


def as_tensors(arrays: Sequence[np.ndarray], dtypes: Iterable[np.dtype]) -> list[Tensor]:
    """The arrays as tensors in ``dtypes`` (converted where they differ), sharing memory with
    them otherwise. Views of a message's bytes are read-only; the fused op only reads them,
    so torch's warning about that is silenced, once for all the arrays."""
    out = []
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message=".*not writable.*")
        for a, dtype in zip(arrays, dtypes):
            if a.dtype != dtype:
                a = a.astype(dtype)
            if a.dtype.isnative:
                try:
                    out.append(torch.from_numpy(a))
                    continue
                except ValueError:  # negative strides, which torch cannot view
                    pass
            out.append(ndarrays_to_tensors([a])[0])
    return out


def to_arrayrecord(arrays: dict[str, np.ndarray]) -> ArrayRecord:
    """An ArrayRecord of ``arrays``, emptying the dict as each array is serialized, so the peak
    holds one model plus one array, not two models."""
    return ArrayRecord({k: ndarray_to_array(arrays.pop(k)) for k in list(arrays)})
