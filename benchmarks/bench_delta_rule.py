"""How fast are the delta-rule references and varlen attention on CPU, side by side?

T = 8192, H = 8, K = V = 64 (and 128), fp32, one document unless stated. Targets:

* forward >= 4x faster than fla's ``naive_chunk_gated_delta_rule``;
* forward + backward (T = 2048) >= 8x faster than autograd through it;
* 256 documents vs one document of the same T: <= 1.25x the time;
* achieved FLOP/s vs ``torch.matmul`` in the same run: >= 15%;
* KDA within 1.5x of GDN; Gated DeltaProduct (2 householders) within 2.5x of GDN;
* varlen attention within 1.5x of SDPA with a dense block-diagonal mask, at a fraction of its memory.

    python -m benchmarks.bench_delta_rule [--tokens 8192] [--dims 64 128] [--repeat 3]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys

import torch
import torch.nn.functional as F

from benchmarks.bench_metadata import random_lengths
from benchmarks.common import Result, matmul_flops_per_s, measure, measure_side_by_side, results_table
from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda, varlen_attention
from ssm_pack import lengths_to_cu_seqlens, max_seqlen_from_cu_seqlens


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
    (Phi, Psi, the scan) and the outputs."""
    per_token = 2 * chunk * dim * 2 + chunk * 2 * dim + 2 * dim * dim * 2 + 2 * dim * dim * 3 + 2 * chunk * dim
    return tokens * heads * per_token


def fla_naive():
    try:
        from fla.ops.gated_delta_rule.naive import naive_chunk_gated_delta_rule
        return naive_chunk_gated_delta_rule
    except Exception:  # noqa: BLE001 - fla needs triton to import; report instead of failing
        return None


def delta_rows(tokens, dim, heads, repeat):
    rows, g = [], "delta rule"
    x = inputs(tokens, heads, dim)
    cu = lengths_to_cu_seqlens(random_lengths(tokens, 256))
    xk = inputs(tokens, heads, dim, kda=True)
    xp = inputs(tokens, heads, dim, householder=2)
    fns = {"gdn": lambda: chunk_gated_delta_rule(*x), "docs": lambda: chunk_gated_delta_rule(*x, cu_seqlens=cu),
           "kda": lambda: chunk_kda(*xk), "gdp": lambda: chunk_gated_delta_product(*xp, 2)}
    naive = fla_naive()
    if naive is not None:
        fns["naive"] = lambda: naive(x[0], x[1], x[2], x[3], x[4])
    with torch.no_grad():
        t = measure_side_by_side(fns, repeat=repeat)
    t_gdn, t_docs, t_kda, t_gdp = t["gdn"], t["docs"], t["kda"], t["gdp"]
    tag = f"K=V={dim}"
    if naive is not None:
        rows.append(Result(g, f"GDN fwd speed-up over fla's naive_chunk ({tag})", t_gdn, t["naive"],
                           t["naive"] / t_gdn, 4))
    rows.append(Result(g, f"GDN fwd, 256 documents vs one ({tag})", t_docs, t_gdn, t_docs / t_gdn, 1.25, False))
    peak = matmul_flops_per_s(1024)
    frac = gdn_flops(tokens, heads, dim) / t_gdn / peak
    rows.append(Result(g, f"GDN fwd GFLOP/s vs torch.matmul ({tag})", frac * peak / 1e9, peak / 1e9, frac, 0.15,
                       unit="GFLOP/s"))
    rows.append(Result(g, f"KDA vs GDN fwd ({tag})", t_kda, t_gdn, t_kda / t_gdn, 1.5, False))
    rows.append(Result(g, f"GDP(2) vs GDN fwd ({tag})", t_gdp, t_gdn, t_gdp / t_gdn, 2.5, False))
    return rows


def backward_row(tokens, dim, heads, repeat):
    naive = fla_naive()
    if naive is None:
        return []
    ours = inputs(tokens, heads, dim, grad=True)
    theirs = inputs(tokens, heads, dim, grad=True)

    def run(fn, args):
        o = fn(*args)[0]
        o.backward(torch.ones_like(o))

    t = measure_side_by_side({"ours": lambda: run(chunk_gated_delta_rule, ours),
                              "naive": lambda: run(naive, theirs)}, repeat=repeat)
    t_ours, t_naive = t["ours"], t["naive"]
    return [Result("delta rule", f"GDN fwd+bwd speed-up over autograd through fla naive (T={tokens}, K=V={dim})",
                   t_ours, t_naive, t_naive / t_ours, 8)]


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


def attention_rows(tokens, repeat, docs=64):
    cu = lengths_to_cu_seqlens(random_lengths(tokens, docs))
    q, k, v = (torch.randn(tokens, 8, 64) for _ in range(3))
    seg = torch.repeat_interleave(torch.arange(docs), cu[1:] - cu[:-1])
    i = torch.arange(tokens)
    mask = (seg[:, None] == seg[None, :]) & (i[None, :] <= i[:, None])
    longest = max_seqlen_from_cu_seqlens(cu)
    with torch.no_grad():
        t_ours = measure(lambda: varlen_attention(q, k, v, cu, longest), repeat=repeat)
        t_dense = measure(lambda: F.scaled_dot_product_attention(q.transpose(0, 1), k.transpose(0, 1),
                                                                 v.transpose(0, 1), attn_mask=mask), repeat=repeat)
    memory = {}
    for which in ("dense", "varlen"):
        out = subprocess.run([sys.executable, "-c", _ATTN_PROBE, str(tokens), str(docs), which],
                             capture_output=True, text=True, check=True)
        memory[which] = json.loads(out.stdout.strip().splitlines()[-1])["extra_mb"]
    g = "attention"
    return [Result(g, f"varlen attention vs SDPA + dense block mask ({docs} documents)", t_ours, t_dense,
                   t_ours / t_dense, 1.5, False),
            Result(g, "varlen attention peak memory vs SDPA + dense mask (fresh process)", memory["varlen"],
                   memory["dense"], memory["varlen"] / max(memory["dense"], 1e-9), 1.0, False, unit="MB")]


def main(argv=None) -> str:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=8192)
    parser.add_argument("--backward-tokens", type=int, default=2048)
    parser.add_argument("--dims", type=int, nargs="+", default=[64, 128])
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args(argv)
    rows: list[Result] = []
    for dim in args.dims:
        rows += delta_rows(args.tokens, dim, args.heads, args.repeat)
    rows += backward_row(args.backward_tokens, args.dims[0], args.heads, args.repeat)
    rows += attention_rows(args.tokens, args.repeat)
    text = (f"delta rule + varlen attention, T={args.tokens}, H={args.heads}, fp32, CPU {torch.get_num_threads()} "
            "threads\n\n" + results_table(rows))
    print(text)
    return text


if __name__ == "__main__":
    main()
