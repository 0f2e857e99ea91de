"""Oracles for the op tests: step-by-step recurrences and per-document loops, written plainly.

They share no code with the references they check: the SSM and delta-rule oracles step through
tokens (all documents in lockstep, one step per position), the conv oracle runs ``F.conv1d`` on
each document alone.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# tolerances per dtype: the tests' own table, never the product's
from tests.support.tolerances import BF16_FWD_REL, BF16_GRAD_REL, FP32_REL, FP64_ABS  # noqa: F401


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach(), want.detach().to(torch.float64)
    err = (got.to(torch.float64) - want).square().mean().sqrt()
    scale = want.square().mean().sqrt().clamp_min(1e-30)
    return float(err / scale)


def check_close(got, want, dtype, *, grad=False, what=""):
    """Assert ``got`` matches the fp64 oracle ``want`` within the tolerance of ``dtype``."""
    got, want = got.detach(), want.detach()
    if dtype == torch.float64:
        err = float((got - want).abs().max()) if got.numel() else 0.0
        assert err <= FP64_ABS, f"{what}: max abs error {err:.3e} > {FP64_ABS}"
    else:
        limit = FP32_REL if dtype == torch.float32 else (BF16_GRAD_REL if grad else BF16_FWD_REL)
        err = rel_rms(got, want) if got.numel() else 0.0
        assert err <= limit, f"{what}: relative RMS error {err:.3e} > {limit} ({dtype})"


def design_lengths(chunk: int, width: int = 4) -> list[int]:
    """The length grid: 1, 2, W-1, W, chunk-1, chunk, chunk+1, 2*chunk, with empty documents."""
    return [1, 2, 0, width - 1, width, chunk - 1, 0, chunk, chunk + 1, 2 * chunk, 3, 0]


def documents(cu: torch.Tensor, total: int) -> list[tuple[int, int]]:
    """``(start, end)`` of every document, then the tail after ``cu[-1]`` (if any)."""
    bounds = cu.tolist()
    spans = list(zip(bounds[:-1], bounds[1:]))
    if total > bounds[-1]:
        spans.append((bounds[-1], total))
    return spans


def conv_oracle(x, weight, bias, cu, initial_states=None, activation=None):
    """Per-document ``F.conv1d``: ``(out [1, D, T], final_states [N, D, W-1])``."""
    dim, width = weight.shape
    total = x.shape[-1]
    outs, finals = [], []
    for i, (s, e) in enumerate(documents(cu, total)):
        is_doc = i < cu.numel() - 1
        init = initial_states[i:i + 1] if (initial_states is not None and is_doc) else \
            x.new_zeros(1, dim, width - 1)
        seg = torch.cat([init, x[:, :, s:e]], dim=-1)
        if e > s:
            y = F.conv1d(seg, weight.unsqueeze(1), bias, groups=dim)
            outs.append(F.silu(y) if activation else y)
        if is_doc:
            finals.append(seg[0, :, seg.shape[-1] - (width - 1):])
    out = torch.cat(outs, dim=-1) if outs else x[:, :, :0]
    return out, (torch.stack(finals) if finals else x.new_zeros(0, dim, width - 1))


def ssm_oracle(x, dt, A, B, C, cu, *, D=None, z=None, initial_states=None):
    """Token-by-token SSM, every document from its own state, all documents in lockstep.

    ``h = exp(dt*A) h + dt * x B^T``, ``y = h C + D x``, ``y *= silu(z)``. ``dt`` is used as
    given (bias and softplus applied by the caller). ``initial_states`` has one row per document
    (or per span, the padding tail last). Returns ``(y [1, T, H, P], states [N, H, P, Ns])``.
    """
    _, total, heads, p = x.shape
    g, n = B.shape[2:]
    spans = documents(cu, total)
    docs = cu.numel() - 1
    longest = max([e - s for s, e in spans] + [0])
    state = x.new_zeros(len(spans), heads, p, n)
    if initial_states is not None:   # one row per document, or per span (the tail included)
        state = torch.cat([initial_states, x.new_zeros(len(spans) - initial_states.shape[0], heads, p, n)])
    rep = heads // g
    ys = [None] * total
    for step in range(longest):
        idx = [s + step for s, e in spans if s + step < e]
        live = [k for k, (s, e) in enumerate(spans) if s + step < e]
        if not idx:
            break
        t = torch.tensor(idx)
        dA = torch.exp(dt[0, t] * A)                                         # [k, H]
        Bh = B[0, t].repeat_interleave(rep, dim=1)                           # [k, H, N]
        Ch = C[0, t].repeat_interleave(rep, dim=1)
        new = dA[:, :, None, None] * state[live] + (dt[0, t, :, None] * x[0, t])[..., None] * Bh[:, :, None, :]
        state = state.index_put((torch.tensor(live),), new)
        y = (new * Ch[:, :, None, :]).sum(-1)
        if D is not None:
            y = y + x[0, t] * (D[:, None] if D.dim() == 1 else D)
        if z is not None:
            y = y * F.silu(z[0, t])
        for j, tok in enumerate(idx):
            ys[tok] = y[j]
    out = torch.stack(ys).unsqueeze(0) if ys else x.new_zeros(1, 0, heads, p)
    return out, state[:docs]


def delta_oracle(q, k, v, g, beta, cu, *, scale, nh=1, initial_states=None):
    """Token-by-token (gated) delta rule, every document from its own state, in lockstep.

    q ``[1, T, H, K]``; k, v, beta with ``nh`` sub-steps per token (``[1, T*nh, ...]``); g
    ``[1, T, H, Kg]`` log-decays or ``None``; heads already expanded (H == value heads).
    Per token: ``S = exp(g) * S``, then ``nh`` times ``S += k (beta (v - S^T k))^T``, then
    ``o = S^T (scale q)``. Returns ``(o [1, T, H, V], states [N, H, K, V])``.
    """
    _, total, heads, kd = q.shape
    vd = v.shape[-1]
    spans = documents(cu, total)
    docs = cu.numel() - 1
    state = q.new_zeros(len(spans), heads, kd, vd)
    if initial_states is not None:
        state = torch.cat([initial_states, q.new_zeros(len(spans) - initial_states.shape[0], heads, kd, vd)])
    longest = max([e - s for s, e in spans] + [0])
    outs = [None] * total
    for step in range(longest):
        live = [i for i, (s, e) in enumerate(spans) if s + step < e]
        tok = torch.tensor([spans[i][0] + step for i in live])
        S = state[live]
        if g is not None:
            S = S * torch.exp(g[0, tok]).unsqueeze(-1)
        for j in range(nh):
            kt, vt, bt = k[0, tok * nh + j], v[0, tok * nh + j], beta[0, tok * nh + j]
            pred = (S * kt.unsqueeze(-1)).sum(-2)
            S = S + kt.unsqueeze(-1) * (bt.unsqueeze(-1) * (vt - pred)).unsqueeze(-2)
        state = state.index_put((torch.tensor(live),), S)
        o = (S * (scale * q[0, tok]).unsqueeze(-1)).sum(-2)
        for j, t in enumerate(tok.tolist()):
            outs[t] = o[j]
    out = torch.stack(outs).unsqueeze(0) if outs else q.new_zeros(1, 0, heads, vd)
    return out, state[:docs]


def check_grads(loss, ref_loss, leaves, ref_leaves, dtype, what=""):
    """Compare the gradients of ``loss`` (w.r.t. ``leaves``) with the fp64 oracle's."""
    if not loss.requires_grad:          # no token and no initial state on the way: nothing to differentiate
        assert not ref_loss.requires_grad
        return
    grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True, materialize_grads=True)
    ref_grads = torch.autograd.grad(ref_loss, list(ref_leaves.values()), allow_unused=True, materialize_grads=True)
    for name, a, r in zip(leaves, grads, ref_grads):
        check_close(a, r, dtype, grad=True, what=f"{what} grad {name}")


def hf_attention_oracle(q, k, v, lengths, scale, *, causal=True, window=None):
    """Dense softmax attention per document in Hugging Face's layout: ``q [1, H, T, D]``, ``k, v
    [1, Hk, T, D/Dv]`` (grouped heads repeated) -> ``[1, T, H, Dv]``; keys ``j <= i`` when causal
    (and ``i - j < window`` when a window is given), every key of the document otherwise."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
    out, start = [], 0
    for n in lengths:
        s = q[0, :, start:start + n] @ k[0, :, start:start + n].transpose(-1, -2) * scale
        i, j = torch.arange(n)[:, None], torch.arange(n)[None]
        keep = ((j <= i) if causal else torch.ones(n, n, dtype=torch.bool)) & ((i - j < window) if window else True)
        out.append((s.masked_fill(~keep, float("-inf")).softmax(-1) @ v[0, :, start:start + n]).transpose(0, 1))
        start += n
    return torch.cat(out)[None]
