"""Does a training step stall the GPU? A host-sync census of one HybridLM training step.

A count, not a timer (:mod:`benchmarks.sync_census`): one ``HybridLM("MGKPA")`` training step
(forward and backward) runs under the CUDA device policy with every upstream kernel replaced by
its strict fake (``tests/support/fakes.py``, the fake-device mode's fakes, on CPU tensors). The
fakes' own checks and reference arithmetic are not counted (each kernel call is one opaque node,
forward and backward); what upstream itself reads on the host is (the fakes run that part as
upstream does, e.g. fla building its chunk indices when none are given). Each sync is attributed
to the block it happens in, or to the model outside the blocks (building the step's
``VarlenBatch``, the loss).

Targets: no sync inside any block once the step's ``VarlenBatch`` exists, and a step total that
does not grow with the tokens or the documents. Both conv kernels are counted: causal-conv1d's
CUDA kernel, and fla's Triton conv (what runs where causal-conv1d is not built).

    python -m benchmarks.bench_syncs [--lengths 4096 32768] [--docs 1 512] [--trace]
"""

from __future__ import annotations

import argparse
import contextlib
from dataclasses import dataclass

import torch

from benchmarks.bench_census import opaque
from benchmarks.sync_census import OUTSIDE, SyncCensus, backward_phase
from mixers import HybridLM
from mixers.ops.device_policy import device_policy
from ssm_pack import PackedSeqParams

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 64}, "G": {"head_dim": 8, "chunk_size": 64},
         "K": {"head_dim": 8, "chunk_size": 64}, "P": {"head_dim": 8, "chunk_size": 64}, "A": {"head_dim": 8}}
CONV_KERNELS = ("causal_conv1d", "fla_conv")


class _Patcher:
    """The ``setattr`` of pytest's monkeypatch, undone when ``stack`` closes."""

    def __init__(self, stack: contextlib.ExitStack):
        self.stack = stack

    def setattr(self, owner, name, value):
        old = getattr(owner, name)
        setattr(owner, name, value)
        self.stack.callback(setattr, owner, name, old)


def _opaque_result(value, census):
    if isinstance(value, tuple):
        return tuple(_opaque_result(v, census) for v in value)
    return opaque(value, census) if callable(value) else value


def install_fakes(stack: contextlib.ExitStack, census: SyncCensus, conv: str) -> list:
    """Every upstream kernel replaced by its fake, run opaque (not counted) except upstream's host
    work; ``conv`` picks the conv kernel (``"fla_conv"``: causal-conv1d reported not installed)."""
    import mixers.ops.attention.kernel as attn_kernel
    import mixers.ops.causal_conv1d.kernel as conv_kernel
    import mixers.ops.causal_conv1d.kernel_fla as fla_conv_kernel
    import mixers.ops.delta_rule.kernel as fla_kernel
    import mixers.ops.lightning.kernel as lightning_kernel
    import mixers.ops.ssd.kernel as ssd_kernel
    from mixers.ops import dispatch
    from mixers.ops.attention import kernel_torch
    from mixers.ops.rg_lru import kernel as hgrn_kernel
    from tests.support import fakes

    if conv not in CONV_KERNELS:
        raise ValueError(f"conv must be one of {CONV_KERNELS}, got {conv!r}")
    patch = _Patcher(stack)
    calls = fakes.install(patch)
    patch.setattr(kernel_torch, "on_cuda", lambda t: True)
    patch.setattr(kernel_torch, "load_upstream", lambda: fakes.fake_torch_varlen(calls))
    if conv == "fla_conv":
        patch.setattr(dispatch, "cached_support", lambda name, features=(): (
            (False, "causal-conv1d is not installed") if name == "causal_conv1d" else (True, None)))
    for module in (conv_kernel, fla_conv_kernel, ssd_kernel, fla_kernel, lightning_kernel, hgrn_kernel, attn_kernel,
                   kernel_torch):
        load = module.load_upstream
        patch.setattr(module, "load_upstream", lambda *a, _load=load: _opaque_result(_load(*a), census))
    host_work = fakes.upstream_host_work
    patch.setattr(fakes, "upstream_host_work", lambda fn, *a, **k: host_work(fn, *a, **k, around=census.resume))
    return calls


@dataclass
class StepCensus:
    tokens: int
    docs: int
    conv: str
    dtype: str
    per_place: dict
    inside: int
    total: int
    syncs: list


def census_step(tokens: int, docs: int, *, conv: str = "causal_conv1d", dtype=torch.bfloat16, hidden: int = 32,
                params=None, trace: bool = False) -> StepCensus:
    """The host syncs of one training step of ``HybridLM(256, hidden, "MGKPA")`` on ``docs`` documents
    of ``tokens`` tokens in all (``params``: given packing metadata instead)."""
    torch.manual_seed(0)
    model = HybridLM(256, hidden, "MGKPA", mixer_overrides=SMALL).to(dtype)
    if params is None:
        lengths = [tokens // docs + (i < tokens % docs) for i in range(docs)]
        params = PackedSeqParams.from_lengths(lengths)
    ids = torch.randint(0, 256, (1, tokens))
    census = SyncCensus(trace=trace)
    with contextlib.ExitStack() as stack:
        install_fakes(stack, census, conv)
        stack.enter_context(device_policy("cuda"))
        handles = census.watch({f"blocks.{i} ({block.mixer.__class__.__name__})": block
                                for i, block in enumerate(model.blocks)})
        stack.callback(lambda: [h.remove() for h in handles])
        with census:
            loss = model(ids, params, labels=ids)["loss"]
            with backward_phase(census):
                loss.backward()
    places = dict(census.per_place())
    return StepCensus(tokens, docs, conv, str(dtype).replace("torch.", ""), places, census.inside_layers(),
                      census.total(), census.syncs)


def isolation_cost(tokens: int = 4096, docs: int = 16, rounds: int = 3) -> dict:
    """The branch-free guard's cost on the CPU: aten ops and seconds of one Gated DeltaNet reference
    call (forward and backward, fp32) with each form of the guard, side by side; the figures are
    printed, never asserted."""
    from benchmarks.bench_census import OpCensus
    from benchmarks.common import alternate, training_step
    from mixers.ops import chunk_gated_delta_rule
    from mixers.ops import device_policy as policy_module
    from ssm_pack import VarlenBatch

    torch.manual_seed(0)
    heads, dim = 4, 32
    lengths = [tokens // docs + (i < tokens % docs) for i in range(docs)]
    varlen = VarlenBatch.build(PackedSeqParams.from_lengths(lengths), tokens).materialize()
    q, k, v = (torch.randn(1, tokens, heads, dim, requires_grad=True) for _ in range(3))
    g = (-torch.rand(1, tokens, heads)).requires_grad_()
    beta = torch.rand(1, tokens, heads, requires_grad=True)

    def forward():
        return chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=varlen, use_qk_l2norm_in_kernel=True,
                                      backend="reference")[0]

    found = {}
    steps = {}
    for form in (False, True):
        with contextlib.ExitStack() as stack:
            patch = _Patcher(stack)
            patch.setattr(policy_module, "branch_free_isolation", lambda device, b=form: b)
            census = OpCensus()
            with census:
                training_step(forward, [q, k, v, g, beta])()
            found[form] = census.ops
        steps[form] = training_step(forward, [q, k, v, g, beta])

    def run(form):
        def timed():
            with contextlib.ExitStack() as stack:
                _Patcher(stack).setattr(policy_module, "branch_free_isolation", lambda device: form)
                steps[form]()
        return timed
    timings = alternate({"host-read": run(False), "branch-free": run(True)}, rounds=rounds)
    ratio = sorted(timings.ratios("branch-free", "host-read"))[len(timings.rounds["host-read"]) // 2]
    return {"tokens": tokens, "docs": docs, "ops": (found[False], found[True]), "time_ratio": ratio,
            "seconds": (timings.median("host-read"), timings.median("branch-free"))}


def report(lengths=(4096, 32768), docs=(1, 512), *, guard_tokens: int = 4096, hidden: int = 32,
           trace: bool = False, log=None) -> str:
    """The census table at every T and document count, with both conv kernels, its verdicts, and the
    guard's cost (markdown)."""
    lines = ["| conv kernel | T | documents | syncs inside blocks | syncs outside blocks | step total |",
             "|---|---|---|---|---|---|"]
    found = []
    for conv in CONV_KERNELS:
        for t in lengths:
            for n in docs:
                if log:
                    log(f"sync census: {conv}, T = {t}, {n} documents")
                c = census_step(t, n, conv=conv, hidden=hidden, trace=trace)
                found.append(c)
                lines.append(f"| {conv} | {t:,} | {n:,} | {c.inside} | {c.per_place.get(OUTSIDE, 0)} | {c.total} |")
                if trace:
                    lines += [f"<!-- {s.where} {s.phase} {s.op} x{s.reads} {s.line} -->" for s in c.syncs]
    verdicts = []
    for conv in CONV_KERNELS:
        mine = [c for c in found if c.conv == conv]
        inside = max(c.inside for c in mine)
        same = len({c.total for c in mine}) == 1
        verdicts.append(f"- {conv}: {'no sync' if inside == 0 else f'up to {inside} syncs'} inside the blocks; "
                        f"step total {'the same' if same else 'differs'} at every T and document count "
                        f"({', '.join(sorted({str(c.total) for c in mine}))})")
    if log:
        log("guard cost ...")
    cost = isolation_cost(guard_tokens)
    host, free = cost["ops"]
    guard = ["", "Non-finite guard of the references, branch-free (the CUDA policy's form) vs one host read per "
             f"input (the CPU policy's), one Gated DeltaNet reference call, fp32, T = {cost['tokens']:,}, "
             f"{cost['docs']} documents, forward and backward on this CPU:", "",
             "| guard | aten ops | median seconds |", "|---|---|---|",
             f"| host read per input | {host:,} | {cost['seconds'][0]:.4f} |",
             f"| branch-free | {free:,} | {cost['seconds'][1]:.4f} |", "",
             f"branch-free / host-read: {free / host:.2f}x the ops, {cost['time_ratio']:.2f}x the time (median of "
             "per-round ratios)"]
    return "\n".join(lines + [""] + verdicts + guard)


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096, 32768])
    parser.add_argument("--docs", type=int, nargs="+", default=[1, 512])
    parser.add_argument("--hidden", type=int, default=32)
    parser.add_argument("--trace", action="store_true", help="list every sync with its file and line")
    parser.add_argument("--guard-tokens", type=int, default=4096, help="T of the guard's cost measurement")
    args = parser.parse_args(argv)
    text = report(args.lengths, args.docs, guard_tokens=args.guard_tokens, hidden=args.hidden, trace=args.trace)
    print(text)
    return text


if __name__ == "__main__":
    main()
