"""Is the layers' hot path shaped for CUDA? An op census of one HybridLM training step.

A dispatch-mode census, not a timer, so the figures are the same on every machine: a
``TorchDispatchMode`` counts the aten ops one ``HybridLM("MGKPA")`` training step (forward and
backward, tiny hidden) dispatches **outside the op kernels** (the conv, the SSD scan, the
delta-rule scans and attention are each wrapped as one opaque call while counting, so only the
layers' and the model's own work is seen), and records, for every matrix product among them,
the rows it serves: ``max(M, K)`` of an ``[M, K] @ [K, N]`` (the tokens are ``M`` for a
forward or input-gradient product, ``K`` for a weight gradient).

Under the CUDA device policy (:mod:`mixers.ops.device_policy`, forced on CPU tensors) the op
count must be the same at T = 4,096 and T = 32,768 (no per-row loop) and no product may serve
fewer rows than the step's tokens; the CPU policy's row blocks are printed next to it.

    python -m benchmarks.bench_census [--lengths 4096 32768] [--hidden 32] [--block-elements N]
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass
from unittest import mock

import torch
from torch.utils._pytree import tree_flatten, tree_unflatten

from benchmarks.common import PausableMode
from mixers import HybridLM
from mixers.layers import attention, gated_deltanet, gated_deltaproduct, kda, mamba2
from mixers.layers.blocks import decay_gate as gate_module
from mixers.layers.blocks import mlp, norm, norm_linear, short_conv
from mixers.ops.common import chunks
from mixers.ops.delta_rule import l2norm
from mixers.ops.device_policy import device_policy
from ssm_pack import PackedSeqParams

# the op kernels as the layers call them: (module or class, name); the delta-rule mixers call their CHUNK
OP_KERNELS = ((mamba2, "mamba_chunk_scan_combined"), (gated_deltanet.GatedDeltaNetMixer, "CHUNK"),
              (kda.KDAMixer, "CHUNK"), (gated_deltaproduct.GatedDeltaProductMixer, "CHUNK"),
              (attention, "varlen_attention"), (short_conv, "causal_conv1d_fn"))
BLOCKED = (mlp, norm, norm_linear, gate_module, l2norm)          # the modules whose passes follow the policy
MATMULS = {"mm", "addmm", "bmm", "baddbmm"}
SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 64}, "G": {"head_dim": 8, "chunk_size": 64},
         "K": {"head_dim": 8, "chunk_size": 64}, "P": {"head_dim": 8, "chunk_size": 64}, "A": {"head_dim": 8}}


class OpCensus(PausableMode):
    """Counts aten ops (and the rows of matrix products) dispatched while no op kernel runs."""

    def __init__(self):
        super().__init__()
        self.ops, self.min_rows, self.paused = 0, None, 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if not self.paused:
            self.ops += 1
            name = func.overloadpacket.__name__
            if name in MATMULS:
                a, b = (args[1], args[2]) if name in ("addmm", "baddbmm") else (args[0], args[1])
                rows = max(a.shape[-2], a.shape[-1])
                self.min_rows = rows if self.min_rows is None else min(self.min_rows, rows)
        return func(*args, **(kwargs or {}))


class _Opaque(torch.autograd.Function):
    """One op-kernel call as a single autograd node, run (forward and backward) with the census paused."""

    @staticmethod
    def forward(ctx, box, *tensors):
        census, fn, flat, spec, slots = box
        with census.pause(), torch.enable_grad():
            inner = [t.detach().requires_grad_(need) for t, need in zip(tensors, ctx.needs_input_grad[1:])]
            for slot, t in zip(slots, inner):
                flat[slot] = t
            args, kwargs = tree_unflatten(flat, spec)
            out_flat, out_spec = tree_flatten(fn(*args, **kwargs))
        outs = [o for o in out_flat if isinstance(o, torch.Tensor)]
        ctx.census, ctx.inner, ctx.outs = census, inner, outs
        box.append((out_flat, out_spec))
        return tuple(o.detach() for o in outs)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(o, g) for o, g in zip(ctx.outs, grads) if o.requires_grad and g is not None]
        wanted = [t for t in ctx.inner if t.requires_grad]
        with ctx.census.pause():
            got = iter(torch.autograd.grad([o for o, _ in pairs], wanted, [g for _, g in pairs], allow_unused=True)
                       if pairs and wanted else [None] * len(wanted))
        return (None, *(next(got) if t.requires_grad else None for t in ctx.inner))


def opaque(fn, census: OpCensus):
    """``fn`` as one opaque call for ``census`` (same arguments, same results)."""
    def call(*args, **kwargs):
        flat, spec = tree_flatten((args, kwargs))
        slots = [i for i, a in enumerate(flat) if isinstance(a, torch.Tensor)]
        box = [census, fn, list(flat), spec, slots]
        outs = iter(_Opaque.apply(box, *(flat[i] for i in slots)))
        out_flat, out_spec = box[-1]
        return tree_unflatten([next(outs) if isinstance(o, torch.Tensor) else o for o in out_flat], out_spec)
    return call


def _cpu_blocks(elements: int):
    def row_blocks(rows, width, _elements=None, *, device=None):
        return chunks.row_blocks(rows, width, elements, device=device)
    return row_blocks


@dataclass
class Census:
    policy: str
    tokens: int
    ops: int
    min_rows: int


def census_step(tokens: int, policy: str, *, hidden: int = 32, docs: int = 4, block_elements: int | None = None,
                overrides: dict | None = None) -> Census:
    """The census of one training step of ``HybridLM(256, hidden, "MGKPA")`` on ``docs`` equal
    documents of ``tokens`` tokens in all, under ``policy``; ``block_elements`` shrinks the CPU
    policy's row blocks (to see them at small T)."""
    torch.manual_seed(0)
    model = HybridLM(256, hidden, "MGKPA", mixer_overrides=overrides or SMALL)
    lengths = [tokens // docs] * (docs - 1) + [tokens - (tokens // docs) * (docs - 1)]
    params = PackedSeqParams.from_lengths(lengths)
    ids = torch.randint(0, 256, (1, tokens))
    census = OpCensus()
    with contextlib.ExitStack() as stack:
        for owner, name in OP_KERNELS:
            call = opaque(getattr(owner, name), census)
            stack.enter_context(mock.patch.object(owner, name, staticmethod(call) if isinstance(owner, type) else call))
        if block_elements is not None:
            for module in BLOCKED:
                stack.enter_context(mock.patch.object(module, "row_blocks", _cpu_blocks(block_elements)))
        stack.enter_context(device_policy(policy))
        with census:
            model(ids, params, labels=ids)["loss"].backward()
    return Census(policy, tokens, census.ops, census.min_rows)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs=2, default=[4096, 32768])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--block-elements", type=int, default=None,
                        help="shrink the CPU policy's row blocks to this many elements")
    args = parser.parse_args(argv)
    lines = ["| policy | T | ops outside the op kernels | fewest rows of a matmul | rows / T |",
             "|---|---|---|---|---|"]
    verdicts = []
    for policy in ("cpu", "cuda"):
        found = [census_step(t, policy, hidden=args.hidden, block_elements=args.block_elements)
                 for t in args.lengths]
        for c in found:
            lines.append(f"| {policy} | {c.tokens:,} | {c.ops:,} | {c.min_rows:,} | {c.min_rows / c.tokens:.3f} |")
        same = found[0].ops == found[1].ops
        whole = all(c.min_rows >= c.tokens for c in found)
        verdicts.append(f"{policy} policy: op count {'the same' if same else 'differs'} at both lengths, "
                        f"every matmul {'serves all' if whole else 'does not serve all'} tokens")
    report = "\n".join(lines + [""] + verdicts)
    print(report)
    return report


if __name__ == "__main__":
    main()
