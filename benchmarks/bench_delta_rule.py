"""How fast are the delta-rule references and varlen attention on CPU, next to their peers?

T = 8192, H = 8, K = V = 64 (and 128), fp32, one document unless stated. Every figure is a ratio
of functions run in alternating rounds in one process (fastest round of each, with the spread of
the per-round ratios; see :mod:`benchmarks.common`). The peers (:mod:`benchmarks.peers`):
transformers' ``torch_chunk_gated_delta_rule`` (Qwen3-Next's CPU path) and fla's
``naive_chunk_gated_delta_rule`` / ``naive_chunk_kda``. Targets:

* GDN forward >= 2x faster than each GDN peer; forward + backward >= 3x faster than autograd
  through each; the same for KDA against fla's naive chunk KDA;
* GDN forward at >= 40% of the machine's ``torch.matmul`` FLOP/s (measured in the same rounds;
  the chunked algorithm's matmul FLOPs counted once, :func:`gdn_flops`);
* GDN forward + backward <= 3x its forward (every forward + backward, ours and the peers', gets
  its output gradient made once, outside the timing: :func:`benchmarks.common.training_step`);
* KDA <= 1.5x GDN, Gated DeltaProduct (2 householders) <= 2.2x GDN, at equal sizes;
* 256 documents vs one document of the same T: <= 1.1x;
* varlen attention within 1.5x of SDPA with a dense block-diagonal mask, at a fraction of its memory.

    python -m benchmarks.bench_delta_rule [--tokens 8192] [--backward-tokens 4096] [--dims 64 128]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F

from benchmarks import peers
from benchmarks.bench_metadata import random_lengths
from benchmarks.common import (
    ROOFLINE,
    Possible,
    Result,
    alternate,
    machine,
    matmul_rate,
    ratio_result,
    results_table,
    roofline_matmul,
    roofline_result,
    settle,
    training_step,
)
from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda, varlen_attention
from ssm_pack import lengths_to_cu_seqlens, max_seqlen_from_cu_seqlens

GROUP = "delta rule"


def inputs(tokens, heads, dim, grad=False, kda=False, householder=1):
    g = torch.Generator().manual_seed(0)
    steps = tokens * householder
    q = torch.randn(1, tokens, heads, dim, generator=g)
    k = F.normalize(torch.randn(1, steps, heads, dim, generator=g), dim=-1)
    v = torch.randn(1, steps, heads, dim, generator=g)
    gate = F.logsigmoid(torch.randn(1, tokens, heads, *((dim,) if kda else ()), generator=g))
    beta = torch.rand(1, steps, heads, generator=g)
    return [t.requires_grad_(grad) for t in (q, k, v, gate, beta)]


def gdn_flops(tokens, heads, dim, chunk=64):
    """Matmul FLOPs of the chunked forward: two Gram matrices, the solve, the state recurrence
    (Phi, Psi, the scan) and the outputs, counted in the textbook order (a fixed yardstick: the
    reference forms no ``[W | U]`` and runs ~20% fewer at K = V = chunk = 64, so its rate here
    is an effective one)."""
    per_token = 2 * chunk * dim * 2 + chunk * 2 * dim + 2 * dim * dim * 2 + 2 * dim * dim * 3 + 2 * chunk * dim
    return tokens * heads * per_token


def fresh_pages(t, ours: str, peer: str) -> str:
    """What each side first-touched in its fastest run (page faults: the kernel maps and zeroes each
    fresh 4 KB page): a peer's time moves with its faults, which depend on the heap that earlier
    benchmarks left, so a speed-up is read next to them."""
    a, b = t.fresh_mb(ours), t.fresh_mb(peer)
    return "" if a is None or b is None else f"fresh pages in the fastest runs: ours {a:.0f} MB, peer {b:.0f} MB"


def matmul_ceiling(t, peer: str, flops: float) -> float:
    """The speed-up over ``peer`` that running ``flops`` at the yardstick matmul's rate (same
    rounds) would give: what a speed-up target can ask of the algorithm at most. The peers'
    times include their allocator costs (page faults of fresh tensors), so this moves with them."""
    return t.best(peer) / (flops / matmul_rate(t))


def _fwd_bwd(fn, args, *extra):
    return training_step(lambda: fn(*args, *extra)[0], args)


def forward_rows(tokens, dim, heads, repeat) -> list[Result]:
    """Forward (no autograd) of ours and the peers, and the matmul yardstick, in one alternation."""
    x = inputs(tokens, heads, dim)
    xk = inputs(tokens, heads, dim, kda=True)
    xp = inputs(tokens, heads, dim, householder=2)
    cu = lengths_to_cu_seqlens(random_lengths(tokens, 256))
    fns = {"gdn": lambda: chunk_gated_delta_rule(*x), "docs": lambda: chunk_gated_delta_rule(*x, cu_seqlens=cu),
           "kda": lambda: chunk_kda(*xk), "gdp": lambda: chunk_gated_delta_product(*xp, 2), "matmul": roofline_matmul()}
    hf, naive, naive_kda = peers.hf_torch_gdn(), peers.fla_naive_gdn(), peers.fla_naive_kda()
    if hf is not None:
        fns["hf"] = lambda: hf(*x)
    if naive is not None:
        fns["naive"] = lambda: naive(*x)
    if naive_kda is not None:
        fns["naive_kda"] = lambda: naive_kda(*xk)
    with torch.no_grad():
        t = alternate(fns, rounds=repeat)
    tag = f"K=V={dim}"
    flops = gdn_flops(tokens, heads, dim)
    rows = []
    for key, who in (("hf", "HF torch_chunk_gated_delta_rule"), ("naive", "fla naive_chunk_gated_delta_rule")):
        if key in fns:
            rows.append(ratio_result(GROUP, f"GDN fwd speed-up over {who} ({tag})", t, "gdn", key, 2,
                                     note="; ".join(filter(None, (
                                         f"at the matmul's rate: {matmul_ceiling(t, key, flops):.2f}x",
                                         fresh_pages(t, "gdn", key))))))
    if "naive_kda" in fns:
        rows.append(ratio_result(GROUP, f"KDA fwd speed-up over fla naive_chunk_kda ({tag})", t, "kda", "naive_kda", 2,
                                 note=fresh_pages(t, "kda", "naive_kda")))
    rows.append(roofline_result(GROUP, f"GDN fwd GFLOP/s vs torch.matmul {ROOFLINE}^3 ({tag})", t, "gdn", flops,
                                0.40))
    rows.append(ratio_result(GROUP, f"GDN fwd, 256 documents vs one ({tag})", t, "docs", "gdn", 1.1, False))
    rows.append(ratio_result(GROUP, f"KDA vs GDN fwd ({tag})", t, "kda", "gdn", 1.5, False))
    rows.append(ratio_result(GROUP, f"GDP(2) vs GDN fwd ({tag})", t, "gdp", "gdn", 2.2, False,
                             possible=Possible(1.0, None, "GDP(2) runs GDN's work on twice the steps")))
    return rows


def backward_rows(tokens, dim, heads, repeat) -> list[Result]:
    """Forward + backward of ours and autograd through the peers; our forward alone for fwd+bwd / fwd."""
    ours, ours_k = inputs(tokens, heads, dim, grad=True), inputs(tokens, heads, dim, grad=True, kda=True)
    plain = inputs(tokens, heads, dim)
    fns = {"gdn": _fwd_bwd(chunk_gated_delta_rule, ours), "kda": _fwd_bwd(chunk_kda, ours_k)}
    hf, naive, naive_kda = peers.hf_torch_gdn(), peers.fla_naive_gdn(), peers.fla_naive_kda()
    if hf is not None:
        fns["hf"] = _fwd_bwd(hf, inputs(tokens, heads, dim, grad=True))
    if naive is not None:
        fns["naive"] = _fwd_bwd(naive, inputs(tokens, heads, dim, grad=True))
    if naive_kda is not None:
        fns["naive_kda"] = _fwd_bwd(naive_kda, inputs(tokens, heads, dim, grad=True, kda=True))

    def forward():
        with torch.no_grad():
            chunk_gated_delta_rule(*plain)
    fns["fwd"] = forward
    t = alternate(fns, rounds=repeat)
    tag = f"T={tokens}, K=V={dim}"
    rows = []
    for key, who in (("hf", "HF torch_chunk_gated_delta_rule"), ("naive", "fla naive_chunk_gated_delta_rule")):
        if key in fns:
            rows.append(ratio_result(GROUP, f"GDN fwd+bwd speed-up over autograd through {who} ({tag})", t, "gdn",
                                     key, 3, note=fresh_pages(t, "gdn", key)))
    if "naive_kda" in fns:
        rows.append(ratio_result(GROUP, f"KDA fwd+bwd speed-up over autograd through fla naive_chunk_kda ({tag})",
                                 t, "kda", "naive_kda", 3, note=fresh_pages(t, "kda", "naive_kda")))
    rows.append(ratio_result(GROUP, f"GDN fwd+bwd vs fwd ({tag})", t, "gdn", "fwd", 3, False,
                             possible=Possible(1.0, None, "forward + backward contains the forward")))
    return rows


def missing_rows() -> list[Result]:
    """One informational row per peer that could not be loaded (why), instead of a silent gap."""
    return [Result(GROUP, f"peer not measured: {name}", float("nan"), None, float("nan"), note=why)
            for name, why in peers.MISSING.items() if "KDA" in name or "GDN" in name]


_ATTN_PROBE = """
import json, sys, torch, torch.nn.functional as F
from mixers.ops import varlen_attention
from ssm_pack import lengths_to_cu_seqlens, max_seqlen_from_cu_seqlens
from benchmarks.bench_metadata import random_lengths
tokens, docs, which = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
cu = lengths_to_cu_seqlens(random_lengths(tokens, docs))
q, k, v = (torch.randn(tokens, 8, 64) for _ in range(3))
def status(key):
    for line in open("/proc/self/status"):
        if line.startswith(key):
            return int(line.split()[1]) / 1024
open("/proc/self/clear_refs", "w").write("5")          # reset the peak (VmHWM) to the current RSS
base = status("VmRSS")
with torch.no_grad():
    if which == "dense":
        seg = torch.repeat_interleave(torch.arange(docs), cu[1:] - cu[:-1])
        i = torch.arange(tokens)
        mask = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
        F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1), attn_mask=mask)
    else:
        varlen_attention(q, k, v, cu, max_seqlen_from_cu_seqlens(cu))
print(json.dumps({"extra_mb": status("VmHWM") - base}))
"""


def attention_rows(tokens, repeat, docs=64) -> list[Result]:
    cu = lengths_to_cu_seqlens(random_lengths(tokens, docs))
    q, k, v = (torch.randn(tokens, 8, 64) for _ in range(3))
    seg = torch.repeat_interleave(torch.arange(docs), cu[1:] - cu[:-1])
    i = torch.arange(tokens)
    mask = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    longest = max_seqlen_from_cu_seqlens(cu)
    qt, kt, vt = (x.transpose(0, 1) for x in (q, k, v))
    with torch.no_grad():
        t = alternate({"ours": lambda: varlen_attention(q, k, v, cu, longest),
                       "dense": lambda: F.scaled_dot_product_attention(qt, kt, vt, attn_mask=mask)}, rounds=repeat)
    memory = {}
    for which in ("dense", "varlen"):
        out = subprocess.run([sys.executable, "-c", _ATTN_PROBE, str(tokens), str(docs), which],
                             capture_output=True, text=True, check=True)
        memory[which] = json.loads(out.stdout.strip().splitlines()[-1])["extra_mb"]
    g = "attention"
    return [ratio_result(g, f"varlen attention vs SDPA + dense block mask ({docs} documents)", t, "ours", "dense",
                         1.5, False),
            Result(g, "varlen attention peak memory vs SDPA + dense mask (fresh process)", memory["varlen"],
                   memory["dense"], memory["varlen"] / max(memory["dense"], 1e-9), 1.0, False, unit="MB")]


def run(tokens, dims, backward_tokens, repeat, heads=8, log=None) -> list[Result]:
    rows: list[Result] = []
    for dim in dims:
        rows += settle(lambda: forward_rows(tokens, dim, heads, repeat), log=log)
    rows += settle(lambda: backward_rows(backward_tokens, dims[0], heads, repeat), log=log)
    rows += missing_rows()
    rows += settle(lambda: attention_rows(tokens, repeat), log=log)
    return rows


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--backward-tokens", type=int, default=4096)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    rows = run(args.tokens, args.dims, args.backward_tokens, args.repeat, args.heads, log=print)
    text = (f"delta rule + varlen attention, T={args.tokens}, H={args.heads}, fp32, "
            f"{machine()}\n\n" + results_table(rows))
    print(text)
    return text


if __name__ == "__main__":
    main()
