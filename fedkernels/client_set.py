"""The K client models of the robust and private APIs, checked against client 0
(:class:`ClientSet`): one home for the input checks, the op calls that name tensors as the
user does, and the result's assembly, shared by :mod:`fedkernels.robust` and
:mod:`fedkernels.privacy.mechanism`."""

from __future__ import annotations

import re
from collections.abc import Sequence

import torch
from torch import Tensor

from .memory_footprints import Footprints, byte_span, has_internal_overlap
from .model_layout import Model, ModelLayout, elementwise_max, split_clients, with_metadata

# How an op's error names a tensor (by its index); run() puts the user's key there.
_WHERE = re.compile(r"(client \d+, tensor |base tensor |out tensor )(\d+)")


class ClientSet:
    """K client models checked against client 0: every float entry has client 0's shape,
    dtype and device in every client. ``floats[k]`` are client k's float tensors in layout
    order, ``ints[i]`` the K values of integer entry i."""

    def __init__(self, clients, api: str):
        self.api = api
        models, self.is_flat = split_clients(clients)
        if not models:
            raise ValueError(f"{api}: no client models (K = 0)")
        self.metadata = getattr(models[0], "_metadata", None)  # kept by a state_dict result
        try:
            self.layout = layout = ModelLayout.of(models[0], "client 0")
            tensors = layout.client_tensors(models)
        except (TypeError, ValueError) as err:  # the layout's checks speak as aggregate's
            raise type(err)(re.sub(r"^fedkernels\.\w+:", f"{api}:", str(err))) from None
        first = tensors[0]
        for k, c in enumerate(tensors[1:], start=1):
            for i, (t, t0) in enumerate(zip(c, first)):
                if t.shape != t0.shape or t.dtype != t0.dtype or t.device != t0.device:
                    raise ValueError(
                        f"{api}: client {k}, tensor {self.label(i)} is {t.dtype} "
                        f"{tuple(t.shape)} on {t.device}; client 0 has {t0.dtype} "
                        f"{tuple(t0.shape)} on {t0.device}")
        # Read as values: the rules have no derivative, so their results carry no gradient
        # (rather than a graph whose backward only warns).
        self.floats = [[c[i].detach() for i in layout.float_index] for c in tensors]
        self.ints = {i: [c[i] for c in tensors] for i in layout.int_index}
        self.K = len(models)
        # A model without floating-point entries (counters only) has nothing for the native
        # ops, which need at least one tensor: run() then returns no results.
        self.has_floats = bool(layout.float_index)

    def refuse_meta(self, why: str) -> None:
        """A ValueError naming the API when the clients are on the meta device (no values):
        for rules whose result or selection depends on the values (``why``)."""
        if self.floats and self.floats[0] and self.floats[0][0].device.type == "meta":
            raise ValueError(f"{self.api}: the clients are on the meta device, which holds no "
                             f"values; {why}")

    def label(self, i: int) -> str:
        return self.layout.label(self.layout.names[i])

    def out_tensors(self, out: Model | None, *, floats_written_here: bool = False,
                    op_sees: Sequence[int] | None = ()) -> list[Tensor] | None:
        """``out``'s tensors after checking them against client 0's, before any write: every
        entry's shape, dtype and device; with grad mode on, no entry that requires grad (as
        PyTorch's in-place ops; checked here because Krum copies into ``out`` itself, and an
        entry written before a later one is refused would stay written); and memory: no entry
        may overlap any of the K clients (also those a rule does not select: the native ops
        only see, and check against, the clients they are given: ``op_sees`` are the clients
        whose float tensors the rule's op takes with every float out entry, and checks itself;
        None for all of them). The integer entries, and
        the float ones where ``floats_written_here`` (Krum copies its selection itself), must
        not be expanded views nor overlap another out entry."""
        if out is None:
            return None
        tensors = self.layout.tensors(out, "out")
        for i, (o, t) in enumerate(zip(tensors, self.client0())):
            if o.shape != t.shape or o.dtype != t.dtype or o.device != t.device:
                raise ValueError(f"{self.api}: out tensor {self.label(i)} is {o.dtype} "
                                 f"{tuple(o.shape)} on {o.device}, expected {t.dtype} "
                                 f"{tuple(t.shape)} on {t.device}")
        if torch.is_grad_enabled():
            for i, o in enumerate(tensors):
                if o.requires_grad:
                    what = "is a leaf that requires grad" if o.is_leaf else "requires grad"
                    raise RuntimeError(f"{self.api}: out tensor {self.label(i)} {what}; the "
                                       "result is written in place and carries no gradient: "
                                       "write it under torch.no_grad(), as PyTorch's in-place "
                                       "ops require")
        written_here = {i for i, f in enumerate(self.layout.float_mask)
                        if floats_written_here or not f}
        for i in sorted(written_here):
            if has_internal_overlap(tensors[i]):
                raise ValueError(f"{self.api}: out tensor {self.label(i)} has elements "
                                 "that share memory (an expanded or overlapping view); the "
                                 "output needs one element of memory each")
        ints = Footprints([(byte_span(t), t, (k, i)) for i, column in self.ints.items()
                           for k, t in enumerate(column)])
        seen = set() if floats_written_here else set(range(self.K) if op_sees is None
                                                     else op_sees)
        floats = Footprints([(byte_span(t), t, (k, i)) for k, c in enumerate(self.floats)
                             if k not in seen for i, t in zip(self.layout.float_index, c)])
        outputs = Footprints([(byte_span(o), o, j) for j, o in enumerate(tensors)])
        for i, o in enumerate(tensors):
            span = byte_span(o)
            hit = ints.overlap(span, o)
            if hit is None:
                hit = floats.overlap(span, o)
            if hit is not None:
                raise ValueError(f"{self.api}: out tensor {self.label(i)} overlaps client "
                                 f"{hit[0]}, tensor {self.label(hit[1])}; the output must not "
                                 "alias a client")
            other = outputs.overlap(span, o, exclude=i) if i in written_here else None
            if other is not None:
                raise ValueError(f"{self.api}: out tensor {self.label(i)} overlaps out tensor "
                                 f"{self.label(other)}; every output entry needs its own "
                                 "memory")
        return tensors

    def flat(self, who: Sequence[int] | None = None) -> list[Tensor]:
        """The float tensors of clients ``who`` (all when None), client-major: the ops' input."""
        who = range(self.K) if who is None else who
        return [t for k in who for t in self.floats[k]]

    def float_out(self, out_tensors: list[Tensor] | None) -> list[Tensor] | None:
        if out_tensors is None:
            return None
        return [out_tensors[i] for i in self.layout.float_index]

    def run(self, fn, *args):
        """Calls op ``fn``, naming tensors as the user does (state_dict keys) in its errors.
        A model without float entries has no float results: ``[]``, without calling."""
        if not self.has_floats:
            return []
        try:
            return fn(*args)
        except (RuntimeError, ValueError, TypeError) as err:
            names = self.layout.float_names

            def name(match: re.Match) -> str:
                i = int(match.group(2))
                if self.layout.kind == "tensor" or i >= len(names):
                    return match.group(0)
                return match.group(1) + self.layout.label(names[i])

            message = _WHERE.sub(name, str(err).split("\nException raised from")[0])
            message = re.sub(r"^fedkernels\.\w+:", f"{self.api}:", message)
            kind = type(err) if isinstance(err, (ValueError, TypeError)) else RuntimeError
            raise kind(message) from None

    def client0(self) -> list[Tensor]:
        """Client 0's tensors (float and integer) in layout order."""
        floats = iter(self.floats[0])
        return [next(floats) if f else self.ints[i][0]
                for i, f in enumerate(self.layout.float_mask)]

    def finish(self, float_results: list[Tensor], who: Sequence[int] | None,
               out_tensors: list[Tensor] | None, out: Model | None) -> Model:
        """The result model: float entries from ``float_results``, integer entries the maximum
        over clients ``who`` (all when None), written into ``out`` when given."""
        who = range(self.K) if who is None else who
        merged, it = [], iter(float_results)
        for i, f in enumerate(self.layout.float_mask):
            if f:
                merged.append(next(it))
                continue
            values = [self.ints[i][k] for k in who]
            r = values[0]
            for v in values[1:]:
                r = elementwise_max(r, v)
            merged.append(r.clone() if len(values) == 1 else r)
        if out_tensors is None:
            return with_metadata(self.layout.build(merged), self.metadata)
        for o, r in zip(out_tensors, merged):
            if o.data_ptr() != r.data_ptr():
                o.copy_(r)
        return out
