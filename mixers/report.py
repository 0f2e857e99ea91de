"""``ssm-pack report``: the ``ssm_pack`` support report plus, for every mixer, which backend each
part of its packed forward takes here, read from the mixer's own ``PLAN`` (the rows a
``backend="kernel"`` mixer checks at construction and ``auto`` warns about), and each part of its
inference beyond that (decode steps, the KV cache) from its ``INFERENCE_PLAN`` (what
``backend="kernel"`` checks when a cache is allocated), so the report and the layers cannot
disagree.
"""

from __future__ import annotations

import torch

from ssm_pack.support import installed
from ssm_pack.support.report import fix_lines, header_lines, kernel_lines

from .layers import registry
from .layers.base import plan_support
from .ops.attention.choice import auto_choice

ATTENTION_FACTS = ((torch.bfloat16, 64), (torch.bfloat16, 128), (torch.bfloat16, 12), (torch.bfloat16, 320),
                   (torch.float32, 128))


def _registered() -> list[type]:
    """Every registered mixer's layer class (:mod:`mixers.layers.registry`), in registration order."""
    return [kind.mixer for kind in registry.MIXERS.values()]


def mixer_backends(mixers=None) -> list[tuple[str, str, str, str | None]]:
    """``(mixer, part, backend, reason)``: what each part of each mixer's packed training runs on
    a CUDA device here (``reason`` says why not the kernel); ``mixers``: layer classes, every
    registered one by default."""
    rows = []
    for cls in _registered() if mixers is None else mixers:
        for part, kernel, ok, reason in plan_support(cls.PLAN, training=True):
            rows.append((cls.__name__, part, kernel if ok else "reference", reason))
    return rows


def inference_backends(mixers=None) -> list[tuple[str, str, str, str | None]]:
    """``(mixer, part, backend, reason)``: what each inference part of each mixer (decode steps, the
    KV cache) runs on a CUDA device here, from the mixers' ``INFERENCE_PLAN`` (a packed prefill runs
    the training parts, :func:`mixer_backends`)."""
    rows = []
    for cls in _registered() if mixers is None else mixers:
        for part, kernel, ok, reason in plan_support(cls.INFERENCE_PLAN):
            rows.append((cls.__name__, part, kernel if ok else "reference", reason))
    return rows


def attention_limit_lines(facts=ATTENTION_FACTS, device="cuda") -> list[str]:
    """What ``backend="auto"`` takes for packed attention of each ``(dtype, head dim)`` in ``facts`` on
    ``device``, and the limit (or package state) that passed over each kernel before it."""
    lines = ["attention kernel per dtype and head dim (auto takes the first kernel that can run; why not the others):"]
    if not installed.probe.cuda_available():
        return lines + ["  no CUDA device: every call takes the reference"]
    for dtype, head_dim in facts:
        kernel, reasons = auto_choice(dtype, head_dim, device)
        why = f"  ({'; '.join(reasons)})" if reasons else ""
        lines.append(f"  {str(dtype).removeprefix('torch.'):9s} D={head_dim:<4d} {kernel}{why}")
    return lines


def full_report() -> str:
    """Packages, kernel features and the backend of every mixer part."""
    lines = header_lines() + [""] + kernel_lines() + ["", "packed training backends per mixer "
                                                       "(kernel name, or reference = ssm-pack's exact PyTorch path):"]
    for mixer, part, backend, reason in mixer_backends():
        lines.append(f"  {mixer:24s} {part:18s} {backend}" + (f"  ({reason})" if reason else ""))
    lines += ["", "inference backends per mixer (decode steps, KV cache; a packed prefill runs the parts above):"]
    for mixer, part, backend, reason in inference_backends():
        lines.append(f"  {mixer:24s} {part:18s} {backend}" + (f"  ({reason})" if reason else ""))
    lines += [""] + attention_limit_lines()
    lines += fix_lines()
    lines += ["", "The reference path is exact and packs correctly everywhere; kernels are faster on CUDA."]
    return "\n".join(lines)
