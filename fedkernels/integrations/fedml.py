r"""A drop-in for FedML's server aggregation, ``FedMLAggOperator.agg``
(``fedml.ml.aggregator.agg_operator``), whose weighted sums are the fused ``weighted_sum`` op.

FedML's ``ServerAggregator.aggregate`` and its single-process simulation trainers (FedAvg,
FedProx, FedDyn, Mime, SCAFFOLD, ...) hand the clients' results to the static method
``FedMLAggOperator.agg(args, raw_grad_list)``, a list of ``(sample_count, state_dict)`` pairs
(``(sample_count, state_dict, state_dict)`` triples for SCAFFOLD and Mime). With the torch
backend it loops over every key and every client in Python: one multiply and one add per tensor
and client. Here all the tensors of all the clients go into one fused call that reads each
client tensor once and writes each result once.

What each ``args.federated_optimizer`` computes (:math:`n_k` the sample counts):

- ``"FedAvg"``, ``"FedProx"``: :math:`\sum_k \frac{n_k}{\sum_j n_j} x_k` per key.
- ``"FedAvg_seq"``, ``"FedDyn"``: :math:`\sum_k x_k` per key (the counts are ignored), written
  into client 0's tensors in place, as FedML's ``+=`` does.
- ``"Mime"``: the FedAvg mean of both dicts of the triples, over the keys of the first (the
  model); ``args.client_num_per_round`` must equal K, as FedML asserts. Both dicts go through
  one fused call.
- Anything else goes to FedML's own code, which must then be installed: ``"SCAFFOLD"`` (FedML's
  result is not a weighted sum: each key ends up as the *last* client's weights delta and its
  control delta divided by ``args.client_num_in_total``), ``"FedOpt"`` and ``"FedNova"`` (FedML
  computes nothing there and raises ``UnboundLocalError``), names FedML does not know, and
  ``args.ml_engine`` ``"tf"``, ``"jax"`` or ``"mxnet"``.

Use it by name (``from fedkernels.integrations.fedml import FedMLAggOperator``), or call
:func:`install` to swap it into FedML's own class, so that FedML's ``ServerAggregator`` and
trainers call it; the handle :func:`install` returns puts FedML's method back. FedML is imported
only by :func:`install` and for the cases above that go to FedML's code.

Same as FedML: the result is client 0's dict object (a tuple of client 0's two dicts for Mime),
in client 0's key order, with each entry replaced by a new tensor (FedAvg, FedProx, Mime;
the clients' tensors are not modified) or holding client 0's own tensor, now the sum
(FedAvg_seq, FedDyn, as FedML's in-place ``+=``; unchanged for K = 1). Sample counts may be
Python ints or floats or NumPy numbers, and the weights are FedML's ``n_k / sum`` in Python
(or NumPy) arithmetic, so the exceptions are FedML's: ``KeyError`` for a key of client 0 that
another client lacks, ``ZeroDivisionError`` for Python counts that sum to 0 (NumPy counts give
FedML's NaN/Inf), ``ValueError`` for pairs given where triples are expected or the reverse,
``IndexError`` for an empty list. Result dtypes are torch's for FedML's arithmetic: a floating
tensor keeps its dtype; an integer tensor such as BatchNorm's ``num_batches_tracked`` times a
float weight becomes ``torch.get_default_dtype()`` (float32) under FedAvg and stays an integer
sum under FedAvg_seq. Integer and bool tensors, entries whose dtype, shape or device differs
between clients (FedML broadcasts a client's tensor that broadcasts to client 0's shape), other
values than tensors, sample counts that are tensors, and weights that are not finite or beyond
the float32 range go through the same arithmetic as FedML's loop (same results, bit for bit).

Where it differs: float32 and float64 sums agree with FedML's to the rounding of the dtype
(the op accumulates in fp32, fp64 for float64, in another order of operations); float16 and
bfloat16 tensors accumulate in fp32 and are rounded once, where FedML rounds every product
and partial sum to half precision, so the results differ by about K half-precision roundings
(ours are the closer ones). Every key is gathered, and every tensor's shape checked, before
anything is written: a missing key or a shape that does not broadcast raises with the inputs
untouched, where FedML leaves client 0's dict half updated (shapes raise a ``RuntimeError``
naming the key and client, as FedML's raises a ``RuntimeError`` from torch). Mime's check of
``client_num_per_round`` raises ``AssertionError`` also under ``python -O``.
"""

from __future__ import annotations

import importlib
import math
import numbers

import torch
from torch import Tensor

from fedkernels.aggregate import FLOAT32_MAX, aggregate
from fedkernels.ops import summation

__all__ = ["FedMLAggOperator", "Installed", "agg", "install"]

_MEAN = ("FedAvg", "FedProx")  # sum_k n_k / sum_j n_j * x_k
_SUM = ("FedAvg_seq", "FedDyn")  # sum_k x_k, in place into client 0's tensors
_TRIPLES = ("SCAFFOLD", "Mime")  # FedML's optimizers whose list holds (n, dict, dict)
_OTHER_ENGINES = ("tf", "jax", "mxnet")  # FedML's MLEngineBackend names other than torch
_FUSED_DTYPES = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
_FEDML_MODULE = "fedml.ml.aggregator.agg_operator"


def _fedml_code():
    """FedML's ``agg_operator`` module, imported on first need."""
    try:
        return importlib.import_module(_FEDML_MODULE)
    except ImportError as err:
        raise ImportError(
            f"fedkernels.integrations.fedml: this needs FedML's own code ({_FEDML_MODULE}), "
            f"which did not import ({type(err).__name__}: {err}). The fused FedAvg, FedProx, "
            "FedAvg_seq, FedDyn and Mime sums work without FedML; SCAFFOLD, FedOpt, FedNova, "
            "other optimizer names, the tf/jax/mxnet engines and install() need it: "
            "pip install fedml"
        ) from err


def _sequential(values: list, weights: list | None):
    """FedML's per-key arithmetic for one entry: ``x_0 * w_0``, then ``+= x_k * w_k`` (``x_0``
    and ``+= x_k`` without weights, in place on client 0's value, for the plain sums)."""
    if weights is None:
        acc = values[0]
        for v in values[1:]:
            acc += v
        return acc
    acc = values[0] * weights[0]
    for v, w in zip(values[1:], weights[1:]):
        acc += v * w
    return acc


def _fusable(values: list, in_place: bool) -> bool:
    """Whether one entry's K values are tensors the fused op takes as they are: one floating
    dtype, shape and device, dense, and (written in place, which carries no autograd graph)
    none that requires grad: FedML's ``+=`` records those, and so does its arithmetic here."""
    first = values[0]
    if not isinstance(first, Tensor) or first.dtype not in _FUSED_DTYPES:
        return False
    if first.layout != torch.strided:
        return False
    if not all(isinstance(v, Tensor) and v.dtype == first.dtype and v.shape == first.shape
               and v.device == first.device and v.layout == torch.strided for v in values[1:]):
        return False
    return not (in_place and torch.is_grad_enabled() and any(v.requires_grad for v in values))


def _check_shapes(key, values: list) -> None:
    """FedML adds each client's tensor into one of client 0's shape: shapes must broadcast to
    it. Checked for every entry before anything is written."""
    first = values[0]
    if not isinstance(first, Tensor):
        return
    for i, v in enumerate(values[1:], start=1):
        if isinstance(v, Tensor) and v.shape != first.shape:
            try:
                fits = torch.broadcast_shapes(first.shape, v.shape) == first.shape
            except RuntimeError:
                fits = False
            if not fits:
                raise RuntimeError(
                    f"fedkernels.integrations.fedml: client {i}'s tensor {key!r} has shape "
                    f"{tuple(v.shape)}, which does not broadcast to client 0's "
                    f"{tuple(first.shape)} (FedML adds it into client 0's shape)")


def agg(args, raw_grad_list):
    """FedML's ``FedMLAggOperator.agg(args, raw_grad_list)`` with fused weighted sums.

    Args:
        args: FedML's arguments; reads ``federated_optimizer``, ``ml_engine`` (when present)
            and, for Mime, ``client_num_per_round``.
        raw_grad_list: K ``(sample_count, state_dict)`` pairs, or ``(sample_count, dict,
            dict)`` triples for SCAFFOLD and Mime.

    Returns:
        What FedML returns: client 0's dict holding the result (a tuple of two dicts for Mime
        and SCAFFOLD). See the module's documentation for the cases that run FedML's code.
    """
    optimizer = args.federated_optimizer
    triples = optimizer in _TRIPLES
    training_num = 0  # summed as FedML does, so its exceptions and number types carry over
    for i in range(len(raw_grad_list)):
        if triples:
            count, _, _ = raw_grad_list[i]
        else:
            count, _ = raw_grad_list[i]
        training_num += count
    engine = args.ml_engine if hasattr(args, "ml_engine") else None
    if engine in _OTHER_ENGINES or optimizer not in _MEAN + _SUM + ("Mime",):
        return _fedml_code().model_aggregator(args, raw_grad_list, training_num)

    if optimizer == "Mime":
        _, params0, grads0 = raw_grad_list[0]
        if args.client_num_per_round != len(raw_grad_list):
            raise AssertionError(
                f"fedkernels.integrations.fedml: Mime needs args.client_num_per_round "
                f"({args.client_num_per_round}) to equal the number of clients "
                f"({len(raw_grad_list)}), as FedML asserts")
        targets = (params0, grads0)
        models = [[entry[1] for entry in raw_grad_list], [entry[2] for entry in raw_grad_list]]
    else:
        _, model0 = raw_grad_list[0]
        targets = (model0,)
        models = [[entry[1] for entry in raw_grad_list]]
    keys = list(params0.keys() if optimizer == "Mime" else model0.keys())
    if not keys:  # FedML's loops do nothing (nor divide by the total)
        return (params0, grads0) if optimizer == "Mime" else model0

    # Every entry of every client, key by key as FedML reads them (its KeyError comes first).
    entries = []  # (target dict, key, K values)
    for key in keys:
        for target, side in zip(targets, models):
            entries.append((target, key, [m[key] for m in side]))
    for _, key, values in entries:
        _check_shapes(key, values)

    in_place = optimizer in _SUM
    weights = None
    fused_ok = True
    if not in_place:
        weights = [raw_grad_list[i][0] / training_num for i in range(len(raw_grad_list))]
        fused_ok = all(isinstance(w, numbers.Real) and math.isfinite(w)
                       and abs(w) <= FLOAT32_MAX for w in weights)
    fused, rest = [], []
    for entry in entries:
        (fused if fused_ok and _fusable(entry[2], in_place) else rest).append(entry)

    results = []  # (target dict, key, new value)
    if in_place:
        # In place into client 0's tensors: sum_k x_k = x_0 + sum_{k>0} x_k, one fused pass.
        if len(raw_grad_list) > 1 and fused:
            k_rest = len(raw_grad_list) - 1
            updates = [values[i] for i in range(1, k_rest + 1) for _, _, values in fused]
            try:
                summation.weighted_sum_([values[0] for _, _, values in fused], updates,
                                        torch.ones(k_rest, dtype=torch.float64), 1.0, False)
            except ValueError:
                # A client's tensor shares memory with client 0's (the op checks before it
                # writes): FedML's in-place adds see each other's writes; follow them.
                rest = fused + rest
        for target, key, values in rest:
            results.append((target, key, _sequential(values, None)))
    else:
        for target, key, values in rest:  # integer buffers, mixed entries: FedML's arithmetic
            results.append((target, key, _sequential(values, weights)))
        if fused:
            k = len(raw_grad_list)
            sums = aggregate([[values[i] for _, _, values in fused] for i in range(k)],
                             [float(w) for w in weights])
            results.extend((target, key, s) for (target, key, _), s in zip(fused, sums))
    for target, key, value in results:
        target[key] = value
    return (params0, grads0) if optimizer == "Mime" else model0


class FedMLAggOperator:
    """FedML's ``fedml.ml.aggregator.agg_operator.FedMLAggOperator`` with fused arithmetic
    (same static method, :func:`agg`)."""

    agg = staticmethod(agg)


class Installed:
    """What :func:`install` returns: call it, call :meth:`undo`, or leave its ``with`` block to
    put FedML's own ``agg`` back on the class."""

    def __init__(self, cls: type, previous, installed) -> None:
        self.cls = cls
        self._previous = previous
        self._installed = installed
        self.active = True

    def undo(self) -> None:
        """Restores the method that was there before :func:`install` (a no-op when already
        undone, or when something else has replaced ours on the class since)."""
        if self.active and self.cls.__dict__.get("agg") is self._installed:
            self.cls.agg = self._previous
        self.active = False

    __call__ = undo

    def __enter__(self) -> Installed:
        return self

    def __exit__(self, *exc) -> None:
        self.undo()

    def __repr__(self) -> str:
        state = "active" if self.active else "undone"
        return f"<fedkernels FedML agg on {self.cls.__module__}.{self.cls.__qualname__}, {state}>"


def install(operator_class: type | None = None) -> Installed:
    """Makes FedML aggregate with :func:`agg`: replaces ``FedMLAggOperator.agg`` on FedML's own
    class (``fedml.ml.aggregator.agg_operator``, or ``operator_class`` when given), in place,
    so every caller that looks it up on the class (``ServerAggregator.aggregate``, the
    simulation trainers, the defenses' ``base_aggregation_func``) runs the fused sums. Cases
    :func:`agg` hands to FedML still run FedML's original code.

    Returns:
        An :class:`Installed` handle; call it (or use it as a context manager) to undo.
    """
    cls = _fedml_code().FedMLAggOperator if operator_class is None else operator_class
    if "agg" not in cls.__dict__:
        raise TypeError(f"fedkernels.integrations.fedml.install: {cls!r} has no agg of its own "
                        "to replace (expected FedML's FedMLAggOperator)")
    previous = cls.__dict__["agg"]
    ours = staticmethod(agg)
    cls.agg = ours
    return Installed(cls, previous, ours)
