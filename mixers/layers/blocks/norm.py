"""RMS norms of the mixers (computed in fp32, returned in the input dtype).

    ... = any leading dims, D = normalised dim, G = groups of ``group_size`` channels

Both norms are one autograd function each that keeps only its inputs and the per-group
``1 / rms`` for backward, and recomputes the rest there: autograd through the elementwise
steps would keep four or five full-size intermediates per norm (the activated gate, the gated
input, the normalised values, the weighted ones), several KB per token in a layer. On a CPU both
passes run over blocks of rows, so no temporary is larger than a few MB; under the CUDA device
policy (:mod:`..ops.device_policy`) each pass is one whole-tensor step.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from ...ops.common.chunks import compute_dtype, records_grad, row_blocks

_ACTIVATIONS = {"swish": F.silu, "silu": F.silu, "sigmoid": torch.sigmoid}


def upcast(t: torch.Tensor) -> torch.Tensor:
    """fp16 / bf16 -> fp32 for norms, gates and decays; fp32 and fp64 stay as they are."""
    return t.to(compute_dtype(t.dtype))


def _act_and_grad(gate: torch.Tensor, activation: str) -> tuple[torch.Tensor, torch.Tensor]:
    """``(act(gate), act'(gate))``."""
    sig = torch.sigmoid(gate)
    if activation == "sigmoid":
        return sig, sig * (1 - sig)
    return gate * sig, torch.rsub(sig, 1).mul_(gate).add_(1).mul_(sig)


def _normalize_backward(g_hat: torch.Tensor, hat: torch.Tensor, rstd: torch.Tensor) -> torch.Tensor:
    """Gradient of ``hat = y * rstd`` (``rstd = 1 / rms(y)`` over the last dim) w.r.t. ``y``
    (``g_hat`` is overwritten)."""
    mean = (g_hat * hat).mean(-1, keepdim=True)
    return g_hat.sub_(hat * mean).mul_(rstd)


class _RMSNormFn(torch.autograd.Function):
    """``rmsnorm(x) * weight`` over the last dim; keeps ``x``, ``weight`` and ``1 / rms``.

    Both passes run over blocks of rows, so their temporaries stay small (a few MB) at any T."""

    @staticmethod
    def forward(ctx, x, weight, eps):
        x2 = x.reshape(-1, x.shape[-1])
        w = upcast(weight)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], 1, dtype=w.dtype, device=x.device)
        for r0, r1 in row_blocks(*x2.shape, device=x2):
            xf = upcast(x2[r0:r1])
            r = torch.rsqrt(xf.square().mean(-1, keepdim=True) + eps)
            rstd[r0:r1] = r
            out[r0:r1] = xf * r * w
        ctx.save_for_backward(x, weight, rstd)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, weight, rstd = ctx.saved_tensors
        x2, g2 = x.reshape(-1, x.shape[-1]), grad.reshape(-1, x.shape[-1])
        w = upcast(weight)
        g_x = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        g_w = torch.zeros_like(w)
        for r0, r1 in row_blocks(*x2.shape, device=x2):
            hat = upcast(x2[r0:r1]) * rstd[r0:r1]
            g = upcast(g2[r0:r1])
            g_w += (g * hat).sum(0)
            g_x[r0:r1] = _normalize_backward(g * w, hat, rstd[r0:r1])
        return g_x.reshape(x.shape), g_w.to(weight.dtype), None


def gated_rows(x, gate, w, eps, size, activation, norm_before_gate):
    """One block of rows ``x, gate [rows, C]`` through the gated norm over groups of ``size``
    channels, ``w [C]`` (compute dtype): ``(out [rows, C] in the compute dtype, 1 / rms
    [rows, C / size, 1])``."""
    rows, dim = x.shape
    xf, gf = upcast(x), upcast(gate)
    act = _ACTIVATIONS[activation](gf)
    y = (xf if norm_before_gate else xf * act).reshape(rows, dim // size, size)
    r = torch.rsqrt(y.square().mean(-1, keepdim=True) + eps)                  # [rows, G, 1]
    o = (y * r).reshape(rows, dim) * w
    return (o * act if norm_before_gate else o), r


def gated_rows_backward(g, x, gate, w, r, size, activation, norm_before_gate, with_output=False):
    """``(g_x, g_gate, g_w, out)`` of one block of :func:`gated_rows` from its output gradient
    ``g`` (compute dtype; ``g_w [C]`` the block's part); ``out`` is the block's output recomputed
    with ``with_output``, else None (equal to the forward's up to rounding: SiLU is
    ``gate * sigmoid(gate)`` here, ``F.silu`` there)."""
    rows, dim = x.shape
    xf, gf = upcast(x), upcast(gate)
    act, d_act = _act_and_grad(gf, activation)
    y = xf if norm_before_gate else xf * act
    hat = (y.reshape(rows, dim // size, size) * r).reshape(rows, dim)
    out = (hat * w * act if norm_before_gate else hat * w) if with_output else None
    g_gate = None
    if norm_before_gate:                   # out = hat * w * act
        g_gate = g * hat * w * d_act
        g = g * act
    g_w = (g * hat).sum(0)                 # out = hat * w, hat = rmsnorm(x * act) (mamba)
    groups = (rows, dim // size, size)
    g_y = _normalize_backward((g * w).reshape(groups), hat.reshape(groups), r).reshape(rows, dim)
    if norm_before_gate:
        g_x = g_y
    else:
        g_gate = g_y * xf * d_act
        g_x = g_y.mul_(act)
    return g_x, g_gate, g_w, out


class _GatedRMSNormFn(torch.autograd.Function):
    """:class:`GatedRMSNorm`'s math; keeps ``x``, ``gate``, ``weight`` and the per-group ``1 / rms``.

    Both passes run over blocks of rows (the leading dims flattened), so their temporaries stay
    small (a few MB) at any T."""

    @staticmethod
    def forward(ctx, x, gate, weight, eps, group_size, activation, norm_before_gate):
        dim = x.shape[-1]
        x2, gate2, w = x.reshape(-1, dim), gate.reshape(-1, dim), upcast(weight)
        out = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        rstd = torch.empty(x2.shape[0], dim // group_size, 1, dtype=w.dtype, device=x.device)
        for r0, r1 in row_blocks(*x2.shape, device=x2):
            out[r0:r1], rstd[r0:r1] = gated_rows(x2[r0:r1], gate2[r0:r1], w, eps, group_size, activation,
                                                 norm_before_gate)
        ctx.save_for_backward(x, gate, weight, rstd)
        ctx.meta = (group_size, activation, norm_before_gate)
        return out.reshape(x.shape)

    @staticmethod
    def backward(ctx, grad):
        x, gate, weight, rstd = ctx.saved_tensors
        dim = x.shape[-1]
        x2, gate2, g2, w = x.reshape(-1, dim), gate.reshape(-1, dim), grad.reshape(-1, dim), upcast(weight)
        g_x = torch.empty(x2.shape, dtype=x.dtype, device=x.device)
        g_gate = torch.empty(gate2.shape, dtype=gate.dtype, device=x.device)
        g_w = torch.zeros_like(w)
        for r0, r1 in row_blocks(*x2.shape, device=x2):
            g_x[r0:r1], g_gate[r0:r1], g_w_part, _ = gated_rows_backward(
                upcast(g2[r0:r1]), x2[r0:r1], gate2[r0:r1], w, rstd[r0:r1], *ctx.meta)
            g_w += g_w_part
        return (g_x.reshape(x.shape), g_gate.reshape(gate.shape), g_w.to(weight.dtype), None, None, None,
                None)


class RMSNorm(nn.Module):
    """``x / rms(x) * weight`` over the last dim ``D``."""

    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if records_grad(x, self.weight):
            return _RMSNormFn.apply(x, self.weight, self.eps)
        x2, w = x.reshape(-1, x.shape[-1]), upcast(self.weight)
        return _joined([F.rms_norm(upcast(x2[r0:r1]), (x2.shape[1],), w, self.eps)
                        for r0, r1 in row_blocks(*x2.shape, device=x2)], x)


class GatedRMSNorm(nn.Module):
    """RMS norm with a multiplicative gate ``act(gate)``.

    ``norm_before_gate=True`` (fla's ``FusedRMSNormGated``): ``rmsnorm(x) * weight * act(gate)``.
    ``norm_before_gate=False`` (mamba's ``RMSNormGated``): ``rmsnorm(x * act(gate)) * weight``,
    normalised over groups of ``group_size`` channels.
    """

    def __init__(self, dim: int, eps: float = 1e-5, activation: str = "swish", norm_before_gate: bool = True,
                 group_size: int | None = None):
        super().__init__()
        if activation not in _ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(_ACTIVATIONS)}, got {activation!r}")
        group_size = dim if group_size is None else group_size
        if dim % group_size:
            raise ValueError(f"group_size={group_size} must divide dim={dim}")
        self.eps, self.activation = eps, activation
        self.norm_before_gate, self.group_size = norm_before_gate, group_size
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        if records_grad(x, gate, self.weight):
            return _GatedRMSNormFn.apply(x, gate, self.weight, self.eps, self.group_size, self.activation,
                                         self.norm_before_gate)
        dim, size = x.shape[-1], self.group_size
        x2, gate2, w = x.reshape(-1, dim), gate.reshape(-1, dim), upcast(self.weight)
        parts = []
        for r0, r1 in row_blocks(*x2.shape, device=x2):
            act = _ACTIVATIONS[self.activation](upcast(gate2[r0:r1]))
            y = upcast(x2[r0:r1]) if self.norm_before_gate else upcast(x2[r0:r1]) * act
            o = F.rms_norm(y.reshape(r1 - r0, dim // size, size), (size,), None, self.eps).reshape(r1 - r0, dim) * w
            parts.append(o * act if self.norm_before_gate else o)
        return _joined(parts, x)


def _joined(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The no-grad path's blocks as one tensor shaped and typed like ``like``. Without gradients
    nothing is kept, and torch's ``rms_norm`` (the same rounding as the training path's steps)
    runs in one call per block: a decode step's norm costs a third of the autograd function's.
    No rows (no blocks): an empty tensor."""
    if not parts:
        return like.new_empty(like.shape)
    return (parts[0] if len(parts) == 1 else torch.cat(parts)).to(like.dtype).reshape(like.shape)
