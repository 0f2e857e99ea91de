"""Count the multiply-adds a real forward + backward dispatches: a ``TorchDispatchMode`` over the
matmul-family aten ops, split into the projections (``nn.Linear``) and everything else.

    [.., m, k] @ [.., k, n] -> b * m * k * n multiply-adds (b: the batch of a bmm / baddbmm);
    SDPA (fused, CPU): q [.., L, D], k [.., S, D], v [.., S, Dv] -> b * L * S * (D + Dv) forward,
    b * L * S * (3 D + 2 Dv) backward (the scores recomputed, then dV, dP, dQ, dK)

``matmul``, ``einsum``, ``linear`` and friends are composite: they reach the dispatcher as ``mm``,
``addmm``, ``bmm`` or ``baddbmm``, so those four (and SDPA's fused CPU kernels, counted by the
formula above) are every multiply-add of a product; elementwise work, reductions and the
depthwise short convolution (``convolution``) are not counted. Any other op whose name looks
like a product (``mm``, ``conv``, ``attention``, ``einsum``, ``dot``, ``mv``) is listed in
``unknown`` so that a new kernel cannot slip past the count.

Attribution: the layers call their projections through fused autograd functions (a shared
input, a norm before the output projection) as well as ``nn.Linear``, so a product belongs to the
projections when one operand shares storage with an ``nn.Linear`` weight of ``module`` (the
forward, and the input gradient ``grad @ W``), or when it runs in the backward of an autograd node
whose inputs are such a weight, directly or through views (the weight gradient ``grad^T @ x``).
Everything else (the scans' chunk products, attention's scores) is ``other``.

    with MatmulCounter(layer) as counter:
        layer(x, packed_seq_params=params).square().sum().backward()
    counter.macs   # {"projections": int, "other": int}; counter.by_op: {(part, op name): int}
"""

from __future__ import annotations

import math
from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

aten = torch.ops.aten
_PRODUCT_WORDS = ("mm", "conv", "attention", "einsum", "dot", "mv", "matmul", "linear")


def _mm(a, b) -> int:
    """``[m, k] @ [k, n]`` or ``[b, m, k] @ [b, k, n]``: ``(b) m k n``."""
    return math.prod(a.shape) * b.shape[-1]


def _sdpa(q, k, v, backward: bool) -> int:
    pairs = math.prod(q.shape[:-1]) * k.shape[-2]
    d, dv = q.shape[-1], v.shape[-1]
    return pairs * (3 * d + 2 * dv if backward else d + dv)


_RULES = {
    **{op: (lambda a, b, *_, **__: _mm(a, b)) for op in (aten.mm.default, aten.mm.out, aten.bmm.default, aten.bmm.out)},
    **{op: (lambda c, a, b, *_, **__: _mm(a, b)) for op in (aten.addmm.default, aten.addmm.out, aten.addmm_.default,
                                                           aten.baddbmm.default, aten.baddbmm.out,
                                                           aten.baddbmm_.default)},
    aten._scaled_dot_product_flash_attention_for_cpu.default:
        lambda q, k, v, *_, **__: _sdpa(q, k, v, False),
    aten._scaled_dot_product_flash_attention_for_cpu_backward.default:
        lambda grad, q, k, v, *_, **__: _sdpa(q, k, v, True),
}
_NOT_COUNTED = (aten.convolution, aten.convolution_backward)   # the depthwise short conv: not a matmul


_VIEWS = ("TBackward", "SplitBackward", "SplitWithSizesBackward", "ViewBackward", "UnsafeViewBackward",
          "TransposeBackward", "PermuteBackward", "SliceBackward", "ReshapeAliasBackward", "UnbindBackward",
          "SelectBackward", "ExpandBackward")


class MatmulCounter(TorchDispatchMode):
    """Multiply-adds of the matmul-family ops dispatched while active (forward and backward).

    ``module``: the layer whose ``nn.Linear`` weights mark the projections. ``macs``:
    ``{"projections": int, "other": int}``; ``by_op``: ``{(part, op name): int}``; ``unknown``:
    names of product-like ops no rule counts (empty where the count is complete)."""

    def __init__(self, module: torch.nn.Module):
        super().__init__()
        weights = [m.weight for m in module.modules() if isinstance(m, torch.nn.Linear)]
        self._storages = {w.untyped_storage().data_ptr() for w in weights}
        self._weight_ids = {id(w) for w in weights}
        self.macs = {"projections": 0, "other": 0}
        self.by_op: Counter = Counter()
        self.unknown: set[str] = set()
        self._node_part: dict[int, str] = {}

    def _reaches_weight(self, node) -> bool:
        """Whether ``node``'s inputs are a projection weight, directly or through views of it."""
        todo = [n for n, _ in node.next_functions]
        while todo:
            n = todo.pop()
            if n is None:
                continue
            name = type(n).__name__
            if name == "AccumulateGrad":
                if id(n.variable) in self._weight_ids:
                    return True
            elif name.rstrip("0123456789").endswith(_VIEWS):
                todo += [m for m, _ in n.next_functions]
        return False

    def _part(self, args) -> str:
        if any(isinstance(a, torch.Tensor) and a.untyped_storage().data_ptr() in self._storages for a in args):
            return "projections"                        # forward (and grad_input = grad @ W)
        node = torch._C._current_autograd_node()        # backward: the node whose forward used a weight
        if node is None:
            return "other"
        key = id(node)
        if key not in self._node_part:
            self._node_part[key] = "projections" if self._reaches_weight(node) else "other"
        return self._node_part[key]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        rule = _RULES.get(func)
        if rule is not None:
            part = self._part(args)
            n = rule(*args, **kwargs)
            self.macs[part] += n
            self.by_op[(part, str(func.overloadpacket.__name__))] += n
        elif any(w in func.__name__ for w in _PRODUCT_WORDS) and func.overloadpacket not in _NOT_COUNTED:
            self.unknown.add(func.__name__)
        return func(*args, **kwargs)


def count_training_step(layer: torch.nn.Module, packed_seq_params, total: int) -> dict:
    """``{"projections": int, "other": int}``: the multiply-adds one forward + backward of ``layer``
    (loss ``out.square().sum()``) dispatches on a random ``[1, total, hidden]`` row packed as
    ``packed_seq_params``; ``RuntimeError`` naming any product-like op the counter has no rule for
    (an incomplete count is never returned)."""
    x = torch.randn(1, total, layer.config.hidden_size, requires_grad=True)
    with MatmulCounter(layer) as counter:
        layer(x, packed_seq_params=packed_seq_params).square().sum().backward()
    if counter.unknown:
        raise RuntimeError(f"{type(layer).__name__}: products the counter has no rule for: {sorted(counter.unknown)}")
    return dict(counter.macs)


__all__ = ["MatmulCounter", "count_training_step"]
