"""Autograd plumbing of the differentiable ops: calling an op straight on its kernel when no
gradient can flow, and a differentiable backward for second derivatives.

The ops with an autograd formula register it from Python (``torch.library.register_autograd``),
and PyTorch then routes every call through that Python layer, which checks for gradients and
redispatches: most of the time of a small call. When nothing requires grad, or grad mode is
off, the wrappers take the same switch PyTorch's layer would take, without the layer. Under
``torch.compile`` they make the plain call, which it traces.

When a gradient is wanted, the wrappers run the op's registered formula through
:class:`EagerAutograd` instead: the same ``setup_context`` and backward in a plain
``autograd.Function`` (lists of tensors passed flattened), which costs less a call than
PyTorch's layer, and which ``torch.func`` transforms accept (PyTorch's layer is a Function
they refuse). Calls through ``torch.ops`` keep the registered path.

The native backward kernels compute a first derivative and leave no graph, so with
``create_graph=True`` (grad mode on inside backward) a second derivative through them would be
silently zero or missing. :func:`backward_through_reference` then recomputes the op with its
PyTorch reference on the saved inputs and differentiates that, so higher derivatives are exact
(under ``torch.func`` by ``torch.func.vjp``).
"""

from __future__ import annotations

import contextlib

import torch
from torch import Tensor

__all__ = ["EagerAutograd", "backward_through_reference", "below_autograd_unless_needed",
           "grad_can_flow"]


def _requires_grad(item: object) -> bool:
    # Anything but a tensor or a list/tuple of them counts as not requiring grad, so that a
    # wrong argument reaches the op, whose check names it.
    if isinstance(item, Tensor):
        return item.requires_grad
    if isinstance(item, (list, tuple)):
        return any(isinstance(t, Tensor) and t.requires_grad for t in item)
    return False


def grad_can_flow(*inputs: object) -> bool:
    """Grad mode is on and one of ``inputs`` (tensors, lists of tensors, anything else ignored)
    requires grad."""
    return torch.is_grad_enabled() and any(_requires_grad(x) for x in inputs)


def below_autograd_unless_needed(*inputs: object) -> contextlib.AbstractContextManager:
    """A context for one op call: below the autograd layer when no gradient can flow to or from
    ``inputs``, a no-op context otherwise (and under ``torch.compile``)."""
    if torch.compiler.is_compiling() or grad_can_flow(*inputs):
        return contextlib.nullcontext()
    return torch._C._AutoDispatchBelowAutograd()


def _flat(items) -> list:
    out = []
    for x in items:
        out.extend(x if isinstance(x, (list, tuple)) else [x])
    return out


def backward_through_reference(reference, inputs: tuple, needs: tuple, grad_outputs: tuple):
    """The gradients of ``reference(*inputs)`` (the op's outputs, in the same structure) with
    respect to the inputs flagged in ``needs`` (``ctx.needs_input_grad``), given the outputs'
    gradients, with a graph for the next derivative. Returns one entry per input: a list for a
    list argument, a tensor or None otherwise, as a ``register_autograd`` backward does."""
    needed = [t for x, need in zip(inputs, needs)
              for t, flag in zip(*_with_flags(x, need)) if flag and isinstance(t, Tensor)]
    if any(torch._C._functorch.is_functorch_wrapped_tensor(t) for t in needed):
        # Under a torch.func transform the saved inputs are its wrappers, and autograd.grad
        # finds no graph from them to the recomputed outputs: every gradient would be None.
        return _vjp_through_reference(reference, inputs, needs, grad_outputs)
    wanted = [t for t in needed if t.requires_grad]
    with torch.enable_grad():
        outputs = reference(*inputs)
    if not isinstance(outputs, tuple):
        outputs = (outputs,)
    pairs = [(o, g) for o, g in zip(_flat(outputs), _flat(grad_outputs))
             if g is not None and isinstance(o, Tensor) and o.requires_grad]
    found = iter(torch.autograd.grad(
        [o for o, _ in pairs], wanted, [g for _, g in pairs], create_graph=True,
        allow_unused=True) if pairs and wanted else [None] * len(wanted))
    by_id = {id(t): g for t, g in zip(wanted, found)}
    result = []
    for x, need in zip(inputs, needs):
        if isinstance(x, (list, tuple)):
            result.append([by_id.get(id(t)) if need else None for t in x])
        else:
            result.append(by_id.get(id(x)) if need and isinstance(x, Tensor) else None)
    return tuple(result)


def _vjp_through_reference(reference, inputs: tuple, needs: tuple, grad_outputs: tuple):
    """backward_through_reference by ``torch.func.vjp``, which the enclosing transforms then
    differentiate again (jacrev of jacrev); unused outputs count with zero gradients."""
    outputs, pullback = torch.func.vjp(reference, *inputs)
    single = not isinstance(outputs, tuple)

    def zero_filled(out, grad):
        if isinstance(out, (list, tuple)):
            grad = [None] * len(out) if grad is None else grad
            return [torch.zeros_like(o) if g is None else g for o, g in zip(out, grad)]
        return torch.zeros_like(out) if grad is None else grad

    cotangents = tuple(zero_filled(o, g)
                       for o, g in zip((outputs,) if single else outputs, grad_outputs))
    grads = pullback(cotangents[0] if single else cotangents)
    result = []
    for x, need, g in zip(inputs, needs, grads):
        if isinstance(x, (list, tuple)):
            result.append([gi if f else None for gi, f in zip(g, _with_flags(x, need)[1])])
        else:
            result.append(g if need and isinstance(x, Tensor) else None)
    return tuple(result)


def _with_flags(x, need) -> tuple[list, list]:
    """An argument as a list of items and their needs_input_grad flags (one flag per tensor of
    a list argument, or one for the list)."""
    if isinstance(x, (list, tuple)):
        return list(x), list(need) if isinstance(need, (list, tuple)) else [need] * len(x)
    return [x], [need]


class _Layout:
    """Where each argument (or output) of an op sits in a flat tuple: a list argument's length,
    or None for anything else. An ``autograd.Function`` takes and returns tensors only as
    separate arguments, so lists travel flattened."""

    def __init__(self, items) -> None:
        self.sizes = tuple(len(x) if isinstance(x, list) else None for x in items)

    @staticmethod
    def flatten(items) -> list:
        flat = []
        for x in items:
            if isinstance(x, list):
                flat.extend(x)
            else:
                flat.append(x)
        return flat

    def unflatten(self, flat) -> tuple:
        out, i = [], 0
        for n in self.sizes:
            if n is None:
                out.append(flat[i])
                i += 1
            else:
                out.append(list(flat[i:i + n]))
                i += n
        return tuple(out)


class _Call:
    """One call's layouts: of the inputs, and of the outputs (set by ``forward``)."""

    def __init__(self, inputs) -> None:
        self.inputs = _Layout(inputs)
        self.outputs: _Layout | None = None
        self.single = False  # the op returns one tensor or list, not a tuple

    def structured(self, flat_outputs):
        """The op's outputs from the Function's flat ones."""
        flat_outputs = flat_outputs if isinstance(flat_outputs, tuple) else (flat_outputs,)
        outputs = self.outputs.unflatten(flat_outputs)
        return outputs[0] if self.single else outputs


class EagerAutograd:
    """An op's registered autograd formula (its ``setup_context`` and ``backward``) as two
    ``autograd.Function`` classes for the op's Python wrapper, arguments and outputs that are
    lists of tensors passed flattened:

    - a plain one, which sets the context up in ``forward``: cheaper a call than PyTorch's
      ``register_autograd`` layer (a Function with a separate ``setup_context`` costs as much
      as that layer);
    - one with its own ``setup_context`` and a generated vmap rule, for
      ``torch.func`` (``grad``, ``vjp``, ``jacrev``, and ``vmap`` over them where the op
      has no list), which refuses PyTorch's layer ("must override the setup_context
      staticmethod"). Forward-mode AD (``jvp``, ``jacfwd``) has no formula.

    :meth:`apply` runs the op through the one that fits, or returns None where the op's
    registered path must run (under ``torch.compile``, which traces that, and for tensor
    subclasses).
    """

    def __init__(self, op, setup_context, backward):
        self._op = op
        schema = op._schema
        self._lists = any(isinstance(x.type, torch.ListType)
                          for x in (*schema.arguments, *schema.returns))
        name = getattr(op, "__name__", "op")

        def below(*inputs):
            with torch._C._AutoDispatchBelowAutograd():
                return op(*inputs)

        if not self._lists:  # tensors in, tensors out: no layouts to keep
            def forward(ctx, *inputs):
                output = below(*inputs)
                setup_context(ctx, inputs, output)
                return output

            self._plain = _function(f"Eager_{name}", forward, backward)
            self._transforms = _function(f"Transforms_{name}", below, backward, setup_context)
            return

        def run(call: _Call, flat) -> tuple:
            inputs = call.inputs.unflatten(flat)
            output = below(*inputs)
            call.single = not isinstance(output, tuple)
            outputs = (output,) if call.single else output
            call.outputs = _Layout(outputs)
            return inputs, output, tuple(_Layout.flatten(outputs))

        def list_forward(ctx, call, *flat):
            inputs, output, flat_outputs = run(call, flat)
            setup_context(ctx, inputs, output)
            ctx.call = call
            return flat_outputs

        def list_backward(ctx, *grads):
            call = ctx.call
            needs = ctx.needs_input_grad
            ctx.needs_input_grad = call.inputs.unflatten(needs[1:])
            try:
                result = backward(ctx, *call.outputs.unflatten(grads))
            finally:
                ctx.needs_input_grad = needs
            flat = []
            for r, n in zip(result if isinstance(result, tuple) else (result,), call.inputs.sizes):
                if n is None:
                    flat.append(r)
                else:
                    flat.extend([None] * n if r is None else r)
            return (None, *flat)

        def list_setup(ctx, inputs, output):
            call = inputs[0]
            setup_context(ctx, call.inputs.unflatten(inputs[1:]), call.structured(output))
            ctx.call = call

        self._plain = _function(f"Eager_{name}", list_forward, list_backward)
        self._transforms = _function(f"Transforms_{name}", lambda call, *flat: run(call, flat)[2],
                                     list_backward, list_setup)

    def __call__(self, *inputs):
        """The op's outputs for a wrapper: through :meth:`apply` when a gradient can flow (or
        PyTorch's layer where that does not fit), the kernel below autograd otherwise."""
        if grad_can_flow(*inputs):
            out = self.apply(*inputs)
            return self._op(*inputs) if out is None else out
        if torch.compiler.is_compiling():  # as below_autograd_unless_needed, without its check
            return self._op(*inputs)
        with torch._C._AutoDispatchBelowAutograd():
            return self._op(*inputs)

    def apply(self, *inputs):
        """The op's outputs, through the Function that fits the call, or None (above)."""
        if torch.compiler.is_compiling():
            return None
        flat = _Layout.flatten(inputs) if self._lists else inputs
        if any(isinstance(t, Tensor) and type(t) is not Tensor for t in flat):
            return None  # a tensor subclass
        if self._lists and not all(isinstance(t, Tensor) for x in inputs if isinstance(x, list)
                                   for t in x):
            return None  # the op's own check names what is not a tensor
        function = (self._plain if torch._C._functorch.peek_interpreter_stack() is None
                    else self._transforms)
        if not self._lists:
            return function.apply(*inputs)
        call = _Call(inputs)
        return call.structured(function.apply(call, *flat))


def _function(name: str, forward, backward, setup_context=None) -> type[torch.autograd.Function]:
    """An autograd.Function class: with ``setup_context`` the form ``torch.func`` takes (and a
    generated vmap rule), without it the context set up in ``forward``."""
    body = {"forward": staticmethod(forward), "backward": staticmethod(backward)}
    if setup_context is not None:
        body.update(setup_context=staticmethod(setup_context), generate_vmap_rule=True)
    return type(name, (torch.autograd.Function,), body)
