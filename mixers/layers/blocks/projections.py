"""Several linear projections of one input, with one input gradient.

    N = rows (the input's leading dims flattened), D = in features, O_i = projection i's out features

A mixer feeds its hidden state to several projections (q, k, v, beta, gates; Mamba2's in_proj
row blocks). Through autograd each one's backward builds its own ``[N, D]`` input gradient and
the engine sums them out of place: 2n - 1 tensors of the input's size for n projections. At
T = 65,536 each is a fresh mapping (glibc serves every block above 32 MB with its own ``mmap``)
that the kernel faults in and zeroes page by page, for nothing. One autograd function does the n products instead:

1. forward: ``y_i = x W_i^T (+ b_i)``, each its own contiguous ``[N, O_i]`` (a conv reads it
   without a copy);
2. backward: ``dx = sum_i dy_i W_i``, accumulated into one ``[N, D]`` buffer
   (``addmm_``), ``dW_i = dy_i^T x``, ``db_i = sum_N dy_i``.

It keeps ``x`` and the weights, as the n linear layers do. Under ``torch.autocast`` the input,
weights and biases are cast the way autocast casts a linear layer's, and both passes run in
that dtype.

:func:`project` takes the modules (``nn.Linear``, or an ``nn.Sequential`` of low-rank linears):
it uses the function only when every first linear is a plain ``nn.Linear`` and nothing has
hooks, and otherwise calls the modules (a LoRA wrapper, a quantized linear or a forward hook
then works as it would in any layer).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from ...ops.common.autocast import autocast_operands, outside_autocast


class _SharedInputLinearFn(torch.autograd.Function):
    """``(x [N, D], n, W_1 .. W_n, b_1 .. b_n) -> (y_1 [N, O_1] .. y_n)``; a ``b_i`` may be ``None``."""

    @staticmethod
    def forward(ctx, x, n, *params):
        weights, biases = params[:n], params[n:]
        outs = tuple(torch.addmm(b, x, w.t()) if b is not None else torch.mm(x, w.t())
                     for w, b in zip(weights, biases))
        ctx.n, ctx.device_type = n, x.device.type
        ctx.has_bias = tuple(b is not None for b in biases)
        ctx.save_for_backward(x, *weights)
        ctx.set_materialize_grads(False)
        return outs

    @staticmethod
    def backward(ctx, *grads):
        with torch.autocast(ctx.device_type, enabled=False):       # the dtype the forward ran in
            return _SharedInputLinearFn._backward(ctx, grads)

    @staticmethod
    def _backward(ctx, grads):
        x, *weights = ctx.saved_tensors
        n, need = ctx.n, ctx.needs_input_grad
        g_x = None
        g_w, g_b = [None] * n, [None] * n
        for i, (grad, w) in enumerate(zip(grads, weights)):
            if grad is None:                          # an output that reached no loss
                continue
            if need[0]:
                g_x = torch.mm(grad, w) if g_x is None else g_x.addmm_(grad, w)
            if need[2 + i]:
                g_w[i] = grad.t() @ x
            if ctx.has_bias[i] and need[2 + n + i]:
                g_b[i] = grad.sum(0)
        return (g_x, None, *g_w, *g_b)           # g_x None: no output had a gradient (zero)


@outside_autocast
def _apply(x, n, *params):
    return _SharedInputLinearFn.apply(x, n, *params)


def shared_input_linear(x: torch.Tensor, weights: Sequence[torch.Tensor],
                        biases: Sequence[torch.Tensor | None] | None = None) -> list[torch.Tensor]:
    """``[F.linear(x, W_i, b_i) for each i]`` for ``x [..., D]``, ``W_i [O_i, D]``, ``b_i [O_i]`` or
    ``None``, with one input gradient (module docstring). Returns ``[..., O_i]`` tensors."""
    weights = list(weights)
    biases = [None] * len(weights) if biases is None else list(biases)
    if not weights or len(biases) != len(weights):
        raise ValueError(f"shared_input_linear needs one or more weights and as many biases (or None), "
                         f"got {len(weights)} weights and {len(biases)} biases")
    lead, n = x.shape[:-1], len(weights)
    x, *params = autocast_operands(x.device.type, x, *weights, *biases)
    weights, biases = params[:n], params[n:]
    outs = _apply(x.reshape(-1, x.shape[-1]), n, *weights, *biases)
    return [y.reshape(*lead, y.shape[-1]) for y in outs]


def _hookless(module: nn.Module) -> bool:
    return not any(getattr(module, name, None) for name in
                   ("_forward_hooks", "_forward_pre_hooks", "_backward_hooks", "_backward_pre_hooks"))


def _first_linear(module: nn.Module) -> nn.Module:
    """The module that reads the input: ``module`` itself, or a plain ``nn.Sequential``'s first."""
    if type(module) is nn.Sequential and len(module) and _hookless(module):
        return module[0]
    return module


def project(x: torch.Tensor, modules: Sequence[nn.Module]) -> list[torch.Tensor]:
    """``[m(x) for m in modules]``, each module an ``nn.Linear`` or an ``nn.Sequential`` starting
    with one (a low-rank projection). The first linear of each goes through
    :func:`shared_input_linear` (the rest of a ``Sequential`` is applied after it) when all of
    them are plain ``nn.Linear`` (not a subclass) and nothing has hooks; otherwise the modules are
    called as they are."""
    heads = [_first_linear(m) for m in modules]
    if not (all(type(h) is nn.Linear for h in heads) and bypassable(*heads)):
        return [m(x) for m in modules]
    outs = shared_input_linear(x, [h.weight for h in heads], [h.bias for h in heads])
    for i, (m, h) in enumerate(zip(modules, heads)):
        if m is not h:
            for layer in list(m)[1:]:
                outs[i] = layer(outs[i])
    return outs


def bypassable(*modules: nn.Module) -> bool:
    """Whether a function of ``modules``' parameters may stand in for calling them: none of them
    has hooks and no global module hook is registered (a hook must see its module called)."""
    return all(_hookless(m) for m in modules) and not _global_hooks()


def _global_hooks() -> bool:
    """Whether ``nn.modules.module.register_module_forward_(pre_)hook`` hooks are registered."""
    mod = nn.modules.module
    return any(getattr(mod, name, None) for name in
               ("_global_forward_hooks", "_global_forward_pre_hooks", "_global_backward_hooks",
                "_global_backward_pre_hooks"))
