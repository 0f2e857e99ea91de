"""Speed stage of the GPU check (``benchmarks/gpu_check.sh``): what the kernels buy, measured.

    python -m benchmarks.gpu_check stage speed --out OUT [--dry-run] [--cases REGEX]

* every mixer built with ``backend="kernel"``: packed vs padded forward + backward at 50% padding
  (target: packed >= 1.8x faster);
* ssm-pack's wrapper vs calling the upstream kernel directly with the same packed input (fla's
  conv, pinned even where causal-conv1d would be taken first; SSD; GDN; target: <= 5% slower);
* one ``HybridLM("MGKPA")`` training step (forward, backward, AdamW) on a packed batch, kernels
  vs references.

Figures are medians of alternating rounds (``benchmarks.common.alternate``, which synchronises the
device). A missed target is reported in the case's detail, not as a failure: the stage fails when
something errors or a kernel that should run here is missing (:mod:`.verdict`). ``--dry-run``: CPU,
tiny sizes, one round, Triton kernels under the interpreter; its figures say nothing about speed
and carry no target.
"""

from __future__ import annotations

import sys

import torch
import torch.nn.functional as F

from benchmarks.common import alternate

from .autocast import plan_kernels
from .grading import pinned, refusals_as_skips
from .record import Case, Skip
from .stage import stage_main


class Sizes:
    def __init__(self, dry_run: bool):
        self.dry = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.dtype = torch.float32 if dry_run else torch.bfloat16
        self.rounds = 1 if dry_run else 10
        self.lengths = [8, 3, 5, 1] if dry_run else [2048, 256, 1024, 768, 2048, 512, 1280, 256]
        self.hidden = 64 if dry_run else 1024
        self.tokens = 24 if dry_run else 16384


def _ratio(timings, fast: str, slow: str) -> float:
    return timings.median(slow) / timings.median(fast)


def _graded(figure: float, target: float | None, higher_is_better: bool, dry: bool) -> str:
    if dry or target is None:
        return f"{figure:.2f}x (dry run: no target)" if dry else f"{figure:.2f}x"
    met = figure >= target if higher_is_better else figure <= target
    return f"{figure:.2f}x (target {'>=' if higher_is_better else '<='} {target}: {'met' if met else 'MISSED'})"


def _kernel_only(build, kernels):
    """Run ``build()``; a refusal of ``backend="kernel"`` becomes a skip with its reason."""
    with refusals_as_skips(kernels):
        return build()


def case_layer(sizes: Sizes, cls):
    """Packed vs padded forward + backward of one mixer on its kernels."""
    from ssm_pack import PackedSeqParams, pack_padded
    dtype = torch.float16 if sizes.dry and cls.__name__ == "GatedDeltaProductMixer" else sizes.dtype
    kernels = plan_kernels(cls)
    layer = _kernel_only(lambda: cls(sizes.hidden, backend="kernel").to(sizes.device, dtype), kernels)
    lengths, width = sizes.lengths, max(sizes.lengths)
    padded = torch.randn(len(lengths), width, sizes.hidden, device=sizes.device, dtype=dtype)
    packed = pack_padded(padded, lengths)
    params = PackedSeqParams.from_lengths(lengths, device=sizes.device)

    def step(x, p):
        x = x.detach().requires_grad_()
        layer(x, packed_seq_params=p).float().square().mean().backward()

    t = _kernel_only(lambda: alternate({"packed": lambda: step(packed, params), "padded": lambda: step(padded, None)},
                                       rounds=sizes.rounds, warmup=0 if sizes.dry else 1), kernels)
    padding = 1 - sum(lengths) / (len(lengths) * width)
    speedup = _ratio(t, "packed", "padded")
    figures = {"packed_ms": 1e3 * t.median("packed"), "padded_ms": 1e3 * t.median("padded"), "speedup": speedup}
    return (f"packed {figures['packed_ms']:.2f} ms vs padded {figures['padded_ms']:.2f} ms at {padding:.0%} "
            f"padding: {_graded(speedup, 1.8, True, sizes.dry)}"), figures, True


def _overhead(sizes: Sizes, ours, direct, kernel):
    t = _kernel_only(lambda: alternate({"ours": ours, "direct": direct}, rounds=sizes.rounds,
                                       warmup=0 if sizes.dry else 1), (kernel,))
    overhead = t.median("ours") / t.median("direct")
    figures = {"ours_ms": 1e3 * t.median("ours"), "direct_ms": 1e3 * t.median("direct"), "ratio": overhead}
    return (f"ours {figures['ours_ms']:.3f} ms vs direct {figures['direct_ms']:.3f} ms: "
            f"{_graded(overhead, 1.05, False, sizes.dry)}"), figures, True


def _packed_metadata(sizes: Sizes):
    from ssm_pack import lengths_to_cu_seqlens, seq_idx_from_cu_seqlens
    n = 8
    cu = lengths_to_cu_seqlens([sizes.tokens // n] * n, device=sizes.device)
    return cu, seq_idx_from_cu_seqlens(cu, sizes.tokens)


def case_conv_overhead(sizes: Sizes):
    """Our causal_conv1d_fn pinned to fla's conv vs fla's conv directly."""
    import mixers.ops.causal_conv1d.kernel_fla as fla_conv
    from mixers.ops import causal_conv1d_fn
    cu, _ = _packed_metadata(sizes)
    D = 4 * sizes.hidden
    x = torch.randn(1, sizes.tokens, D, device=sizes.device, dtype=sizes.dtype)
    w = torch.randn(D, 4, device=sizes.device, dtype=sizes.dtype)
    raw = _kernel_only(lambda: _loaded(fla_conv.load_upstream, "fla_conv"), ("fla_conv",))

    def ours():
        with pinned("fla_conv"):
            return causal_conv1d_fn(x.transpose(1, 2), w, activation="silu", cu_seqlens=cu, backend="kernel")
    return _overhead(sizes, ours, lambda: raw(x, w, None, activation="silu", backend="triton", cu_seqlens=cu.long()),
                     "fla_conv")


def _loaded(load, kernel: str):
    """``load()`` (an upstream function); its package missing is an ``unavailable`` skip of ``kernel``."""
    try:
        return load()
    except ImportError as err:
        raise Skip(f"{kernel}: {err}", "unavailable", (kernel,)) from err


def case_ssd_overhead(sizes: Sizes):
    """Our mamba_chunk_scan_combined vs mamba-ssm's, both packed through seq_idx."""
    from mixers.ops import mamba_chunk_scan_combined
    try:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as raw
    except ImportError as err:
        raise Skip(f"mamba-ssm is not available: {err}", "unavailable", ("mamba_ssd",)) from err
    cu, seq_idx = _packed_metadata(sizes)
    h, p, n, chunk = (2, 8, 8, 16) if sizes.dry else (32, 64, 128, 256)
    dev, dt_ = sizes.device, sizes.dtype
    x = torch.randn(1, sizes.tokens, h, p, device=dev, dtype=dt_)
    dt, A = torch.rand(1, sizes.tokens, h, device=dev, dtype=dt_), -torch.rand(h, device=dev)
    B, C = (torch.randn(1, sizes.tokens, 1, n, device=dev, dtype=dt_) for _ in range(2))
    return _overhead(sizes, lambda: mamba_chunk_scan_combined(x, dt, A, B, C, chunk, cu_seqlens=cu, backend="kernel"),
                     lambda: raw(x, dt, A, B, C, chunk, seq_idx=seq_idx), "mamba_ssd")


def case_gdn_overhead(sizes: Sizes):
    """Our chunk_gated_delta_rule vs fla's, packed with cu_seqlens, l2norm in the kernel."""
    import mixers.ops.delta_rule.kernel as delta
    from mixers.ops import chunk_gated_delta_rule
    raw = _kernel_only(lambda: _loaded(lambda: delta.load_upstream("gdn"), "fla"), ("fla",))
    cu, _ = _packed_metadata(sizes)
    h, d = (2, 16) if sizes.dry else (16, 128)
    dev, dt_ = sizes.device, sizes.dtype
    q, k, v = (torch.randn(1, sizes.tokens, h, d, device=dev, dtype=dt_) for _ in range(3))
    g = F.logsigmoid(torch.randn(1, sizes.tokens, h, device=dev)).to(dt_)
    beta = torch.rand(1, sizes.tokens, h, device=dev, dtype=dt_)
    return _overhead(sizes, lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True,
                                                           cu_seqlens=cu, backend="kernel"),
                     lambda: raw(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long()), "fla")


def case_training_step(sizes: Sizes):
    """One HybridLM("MGKPA") training step on a packed batch: the kernels (``auto``) vs the references."""
    from mixers import HybridLM
    from ssm_pack import PackedSeqParams
    hidden, vocab = (64, 64) if sizes.dry else (1024, 32000)
    dtype = torch.float16 if sizes.dry else sizes.dtype      # fla's Gated DeltaProduct takes fp16 / bf16 only
    params = PackedSeqParams.from_lengths(sizes.lengths, device=sizes.device)
    ids = torch.randint(0, vocab, (1, sum(sizes.lengths)), device=sizes.device)
    models = {b: HybridLM(vocab, hidden, "MGKPA", backend=b).to(sizes.device, dtype) for b in ("auto", "reference")}
    models["reference"].load_state_dict(models["auto"].state_dict())
    optims = {b: torch.optim.AdamW(m.parameters(), lr=1e-4) for b, m in models.items()}

    def step(b):
        optims[b].zero_grad(set_to_none=True)
        models[b](ids, params, labels=ids)["loss"].backward()
        optims[b].step()

    t = alternate({"kernels": lambda: step("auto"), "references": lambda: step("reference")},
                  rounds=sizes.rounds, warmup=0 if sizes.dry else 1)
    figures = {"kernels_ms": 1e3 * t.median("kernels"), "references_ms": 1e3 * t.median("references"),
               "speedup": _ratio(t, "kernels", "references"), "tokens": sum(sizes.lengths)}
    return (f"{figures['tokens']} tokens, hidden {hidden}, {dtype}: kernels {figures['kernels_ms']:.1f} ms vs "
            f"references {figures['references_ms']:.1f} ms ({figures['speedup']:.2f}x); auto ran "
            f"{_auto_kernels()}"), figures, True


def _auto_kernels() -> str:
    """Which kernel ``backend="auto"`` takes for each part of each mixer here (the reference where none can)."""
    from mixers.layers.base import plan_support
    from mixers.layers.registry import MIXERS
    parts = [f"{letter} {part}: {kernel if ok else 'reference'}" for letter, kind in MIXERS.items()
             for part, kernel, ok, _ in plan_support(kind.mixer.PLAN)]
    return ", ".join(parts)


def all_cases(sizes: Sizes) -> list[Case]:
    from mixers import AttentionMixer, GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer
    out = [Case(f"{cls.__name__} packed vs padded", case_layer, (sizes, cls), plan_kernels(cls))
           for cls in (Mamba2Mixer, GatedDeltaNetMixer, KDAMixer, GatedDeltaProductMixer, AttentionMixer)]
    out += [Case("wrapper overhead: conv vs fla directly", case_conv_overhead, (sizes,), ("fla_conv",)),
            Case("wrapper overhead: SSD vs mamba-ssm directly", case_ssd_overhead, (sizes,), ("mamba_ssd",)),
            Case("wrapper overhead: GDN vs fla directly", case_gdn_overhead, (sizes,), ("fla",)),
            Case("HybridLM MGKPA training step", case_training_step, (sizes,))]
    return out


def main(argv=None) -> int:
    return stage_main("speed", __doc__.splitlines()[0], argv, lambda dry_run: all_cases(Sizes(dry_run)))


if __name__ == "__main__":
    sys.exit(main())
