"""GPU benchmarks of the kernel paths (run by ``benchmarks/gpu_check.sh`` on a CUDA machine).

* every op, packed, bf16: the upstream kernel through ssm-pack vs ssm-pack's reference;
* our wrapper's overhead over calling the upstream kernel directly: target <= 5%;
* packed vs padded forward + backward of the kernel layers at 50% padding: target >= 1.8x.

    python -m benchmarks.bench_gpu --out gpu_out
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

from benchmarks.common import Result, alternate, ratio_result, results_table
from mixers.ops import dispatch


def _compare(op: str, upstream: str, kernel, reference, direct, repeat: int) -> list[Result]:
    """Kernel through ssm-pack vs our reference, and vs the upstream kernel called directly."""
    t = alternate({"kernel": kernel, "reference": reference, "direct": direct}, rounds=repeat)
    return [ratio_result("gpu ops", f"{op}: kernel vs reference", t, "kernel", "reference", note="(speed-up)"),
            ratio_result("gpu ops", f"{op}: our wrapper vs {upstream} directly", t, "kernel", "direct", 1.05, False)]


def op_results(tokens: int, repeat: int) -> list[Result]:
    from mixers.ops import causal_conv1d_fn, chunk_gated_delta_rule, mamba_chunk_scan_combined
    from ssm_pack import lengths_to_cu_seqlens, seq_idx_from_cu_seqlens
    dev, bf16 = "cuda", torch.bfloat16
    cu = lengths_to_cu_seqlens([tokens // 8] * 8, device=dev)
    seq_idx = seq_idx_from_cu_seqlens(cu, tokens)                            # what the upstream kernels take
    results = []
    if dispatch.cached_support("causal_conv1d", ("seq_idx",))[0]:
        from causal_conv1d import causal_conv1d_fn as upstream_conv
        x = torch.randn(1, tokens, 2048, device=dev, dtype=bf16).transpose(1, 2)
        w, b = torch.randn(2048, 4, device=dev, dtype=bf16), torch.randn(2048, device=dev, dtype=bf16)
        results += _compare(
            "conv", "causal-conv1d",
            lambda: causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend="kernel"),
            lambda: causal_conv1d_fn(x, w, b, activation="silu", cu_seqlens=cu, backend="reference"),
            lambda: upstream_conv(x, w, b, seq_idx=seq_idx, activation="silu"), repeat)
    if dispatch.cached_support("mamba_ssd", ("seq_idx",))[0]:
        from mamba_ssm.ops.triton.ssd_combined import mamba_chunk_scan_combined as upstream_ssd
        h, p, n = 32, 64, 128
        x = torch.randn(1, tokens, h, p, device=dev, dtype=bf16)
        dt, A = torch.rand(1, tokens, h, device=dev, dtype=bf16), -torch.rand(h, device=dev)
        B, C = (torch.randn(1, tokens, 1, n, device=dev, dtype=bf16) for _ in range(2))
        results += _compare(
            "SSD", "mamba-ssm",
            lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, cu_seqlens=cu, backend="kernel"),
            lambda: mamba_chunk_scan_combined(x, dt, A, B, C, 256, cu_seqlens=cu, backend="reference"),
            lambda: upstream_ssd(x, dt, A, B, C, 256, seq_idx=seq_idx), repeat)
    if dispatch.cached_support("fla", ("varlen",))[0]:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as upstream_gdn
        h, d = 16, 128
        q, k, v = (torch.randn(1, tokens, h, d, device=dev, dtype=bf16) for _ in range(3))
        g = F.logsigmoid(torch.randn(1, tokens, h, device=dev)).to(bf16)
        beta = torch.rand(1, tokens, h, device=dev, dtype=bf16)
        results += _compare(
            "GDN", "fla",
            lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                           backend="kernel"),
            lambda: chunk_gated_delta_rule(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu,
                                           backend="reference"),
            lambda: upstream_gdn(q, k, v, g, beta, use_qk_l2norm_in_kernel=True, cu_seqlens=cu.long()), repeat)
    return results


def layer_results(repeat: int) -> list[Result]:
    from mixers import GatedDeltaNetMixer, Mamba2Mixer
    from ssm_pack import PackedSeqParams, pack_padded
    lengths = [2048, 256, 1024, 768, 2048, 512, 1280, 256]     # 8192 real tokens in 8 x 2048: 50% padding
    width = max(lengths)
    results = []
    for name, cls in (("Mamba2", Mamba2Mixer), ("GatedDeltaNet", GatedDeltaNetMixer)):
        try:
            layer = cls(1024, backend="kernel").to("cuda", torch.bfloat16)     # checks its kernels
        except RuntimeError as err:
            print(f"skipping the {name} layer: {err}", file=sys.stderr)
            continue
        padded = torch.randn(len(lengths), width, 1024, device="cuda", dtype=torch.bfloat16)
        packed = pack_padded(padded, lengths)
        params = PackedSeqParams.from_lengths(lengths, device="cuda")

        def step(x, p):
            x = x.detach().requires_grad_()
            layer(x, packed_seq_params=p).float().square().mean().backward()

        t = alternate({"packed": lambda: step(packed, params), "padded": lambda: step(padded, None)}, rounds=repeat)
        padding = 1 - sum(lengths) / (len(lengths) * width)
        results.append(ratio_result("gpu layers", f"{name} kernel layer: packed vs padded ({padding:.0%} padding)",
                                    t, "packed", "padded", 1.8))
    return results


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=16384)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", default="gpu_out")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_gpu needs a CUDA device (torch.cuda.is_available() is False)", file=sys.stderr)
        return 2
    results = op_results(args.tokens, args.repeat) + layer_results(args.repeat)
    if not results:
        print("no kernel is available here; see python -m ssm_pack", file=sys.stderr)
        return 3
    text = f"GPU: {torch.cuda.get_device_name(0)}, torch {torch.__version__}\n\n" + results_table(results)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "gpu_bench.md").write_text(text + "\n")
    print(text)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
