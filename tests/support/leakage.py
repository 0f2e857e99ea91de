"""Bitwise document-isolation checks for ops (the module-level checker is ssm_pack.testing)."""

from __future__ import annotations

import torch


def _slice(t, dim, s, e):
    return t.narrow(dim, s, e - s)


def _spec(entry):
    """``(tensor, token_dim)`` or ``(tensor, token_dim, rows_per_token)``."""
    tensor, dim, *rest = entry
    return tensor, dim, (rest[0] if rest else 1)


def _run(run, inputs, g_out):
    leaves = {k: _spec(v)[0].detach().clone().requires_grad_() for k, v in inputs.items()}
    out = run(**leaves)
    grads = torch.autograd.grad((out * g_out).sum(), list(leaves.values()))
    return out.detach(), dict(zip(leaves, grads))


def perturbation_report(run, inputs, spans, out_dim, *, victims=None, seed=0, scale=1e3):
    """Perturb each victim span of every token input; return the spans whose outputs or input
    gradients changed although they were not perturbed.

    Args:
        run: ``run(**tensors) -> out`` with a token axis ``out_dim``.
        inputs: ``name -> (tensor, token_dim)`` or ``(tensor, token_dim, rows_per_token)`` (for
            sub-step tensors such as Gated DeltaProduct's keys).
        spans: ``(start, end)`` of every document (and the padding tail).
    """
    g = torch.Generator().manual_seed(seed)
    base_in = {k: _spec(v)[0] for k, v in inputs.items()}
    probe = run(**base_in).detach()
    g_out = torch.randn(probe.shape, generator=g, dtype=probe.dtype)
    out0, grads0 = _run(run, inputs, g_out)
    leaks = []
    for victim in (victims if victims is not None else range(len(spans))):
        s, e = spans[victim]
        if e == s:
            continue
        changed = {}
        for name, entry in inputs.items():
            t, dim, rows = _spec(entry)
            t = t.clone()
            piece = _slice(t, dim, s * rows, e * rows)
            noise = (torch.rand(piece.shape, generator=g, dtype=torch.float64) * 2 - 1) * scale
            piece.copy_(noise.to(t.dtype))
            changed[name] = (t, dim, rows)
        out1, grads1 = _run(run, changed, g_out)
        for k, (a, b) in enumerate(spans):
            if k == victim or a == b:
                continue
            same = torch.equal(_slice(out0, out_dim, a, b), _slice(out1, out_dim, a, b))
            for name, entry in inputs.items():
                _, dim, rows = _spec(entry)
                same &= torch.equal(_slice(grads0[name], dim, a * rows, b * rows),
                                    _slice(grads1[name], dim, a * rows, b * rows))
            if not same:
                leaks.append((victim, k))
    return leaks
