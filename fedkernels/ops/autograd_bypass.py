"""Autograd plumbing of the differentiable ops: calling an op straight on its kernel when no
gradient can flow, and a differentiable backward for second derivatives.

The ops with an autograd formula register it from Python (``torch.library.register_autograd``),
and PyTorch then routes every call through that Python layer, which checks for gradients and
redispatches: 4-8 µs a call on the quiet 2-core CI machine (a tiny ``ensemble_pseudo_labels``
call 18 µs against 10 µs below it; ~15 µs more on a busy one), most of a small call. When
nothing requires grad, or grad mode is off, the wrappers take the same switch PyTorch's layer
would take, without the layer. Under ``torch.compile`` they make the plain call, which it
traces.

When a gradient is wanted, the wrappers of ops with tensor arguments (no tensor lists) run the
op's registered formula through :class:`EagerAutograd` instead: the same ``setup_context`` and
backward in a plain ``autograd.Function``, which costs half as much a call as PyTorch's layer,
and which ``torch.func`` transforms accept (PyTorch's layer is a Function they refuse).

The native backward kernels compute a first derivative and leave no graph, so with
``create_graph=True`` (grad mode on inside backward) a second derivative through them would be
silently zero or missing. :func:`backward_through_reference` then recomputes the op with its
PyTorch reference on the saved inputs and differentiates that, so higher derivatives are exact.
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
    wanted = [t for x, need in zip(inputs, needs) if need
              for t in (x if isinstance(x, (list, tuple)) else [x])
              if isinstance(t, Tensor) and t.requires_grad]
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


class EagerAutograd:
    """An op's registered autograd formula (its ``setup_context`` and ``backward``) as two
    ``autograd.Function`` classes for the op's Python wrapper:

    - ``plain``, which sets the context up in ``forward``: a call with the gradient and its
      ``backward()`` took ~60 µs against ~90 µs through PyTorch's ``register_autograd`` layer
      (``distill_kl``, N = 256, C = 10, 2-core Zen 4; a Function with a separate
      ``setup_context`` took as long as that layer);
    - ``transforms``, with its own ``setup_context`` and a generated vmap rule, for
      ``torch.func`` (``grad``, ``vjp``, ``jacrev`` and ``vmap`` over them), which refuses
      PyTorch's layer ("must override the setup_context staticmethod"). Forward-mode AD
      (``jvp``, ``jacfwd``) has no formula.
    """

    def __init__(self, op, setup_context, backward):
        def run(*inputs):
            with torch._C._AutoDispatchBelowAutograd():
                return op(*inputs)

        def forward_with_ctx(ctx, *inputs):
            output = run(*inputs)
            setup_context(ctx, inputs, output)
            return output

        name = op.__name__ if hasattr(op, "__name__") else "op"
        self.plain = type(f"Eager_{name}", (torch.autograd.Function,), {
            "forward": staticmethod(forward_with_ctx),
            "backward": staticmethod(backward),
        })
        self.transforms = type(f"Transforms_{name}", (torch.autograd.Function,), {
            "generate_vmap_rule": True,
            "forward": staticmethod(run),
            "setup_context": staticmethod(setup_context),
            "backward": staticmethod(backward),
        })

    def function(self, *tensors: object) -> type[torch.autograd.Function] | None:
        """The Function to run for these inputs (tensors or None), or None for the op's
        registered path: under ``torch.compile``, which traces that, and for tensor subclasses."""
        if torch.compiler.is_compiling() or any(
                t is not None and type(t) is not Tensor for t in tensors):
            return None
        if torch._C._functorch.peek_interpreter_stack() is not None:
            return self.transforms
        return self.plain
