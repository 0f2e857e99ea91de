"""Correctness stage of the GPU check: every kernel through ssm-pack (``backend="kernel"``) against
ssm-pack's reference, on the same inputs.

    python -m benchmarks.gpu_correctness --out OUT [--dry-run] [--cases REGEX]

Packed inputs hold empty and 1-token documents and a padding tail; the chunked ops get one initial
state per document and return per-document final states; outputs and the gradient of every input
are compared (relative RMS, the project's limits: fp32 1e-5, bf16 / fp16 5e-3 forward and 1e-2
gradients). The kernel runs in the case's dtype; the reference runs in fp32 on the same values
(the kernel's inputs upcast), so the figure is the kernel's own error. The decode kernels have no
backward: their outputs and updated states are compared.

A kernel that refuses the inputs (``ValueError``: a feature upstream lacks, e.g. fp32 in fla's
Gated DeltaProduct) or whose package is missing (``RuntimeError: ... unavailable``) makes the case
``skipped`` with upstream's reason. ``--dry-run``: CPU, tiny sizes, Triton kernels under
``TRITON_INTERPRET=1`` (fp32, fp16 where fla refuses fp32: the interpreter has no bf16 arithmetic).
"""

from __future__ import annotations

import math
import sys

import torch
import torch.nn.functional as F

from benchmarks.gpu_results import Skip, stage_main
from ssm_pack.testing import TOLERANCES

LIMITS = {dtype: TOLERANCES[dtype] for dtype in (torch.float32, torch.bfloat16, torch.float16)}   # (forward, grads)


class Setup:
    """Device and sizes of one run (tiny on the CPU dry run)."""

    def __init__(self, dry_run: bool):
        self.dry = dry_run
        self.device = "cpu" if dry_run else "cuda"
        self.lengths = [0, 1, 9, 0, 13, 1] if dry_run else [0, 1, 300, 0, 1000, 1, 77, 2]
        self.tail = 3 if dry_run else 17
        self.T = sum(self.lengths) + self.tail
        self.heads, self.dim = (2, 16) if dry_run else (4, 64)
        self.dtypes = [torch.float32] if dry_run else [torch.bfloat16, torch.float32]

    def cu(self):
        from ssm_pack import lengths_to_cu_seqlens
        return lengths_to_cu_seqlens(self.lengths, device=self.device)


def rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30))


def kernel_refusal(err: Exception) -> bool:
    """Whether ``err`` is dispatch refusing ``backend="kernel"`` (a feature upstream lacks, a package
    missing here, no device), as opposed to a failure inside a kernel that ran."""
    text = str(err)
    refused = "backend='kernel'" in text or "use backend='reference'" in text
    return isinstance(err, (ValueError, RuntimeError)) and refused


def compare(op, tensors: dict, dtype, setup: Setup, *, grad=True, keep_fp32=()):
    """``op(backend, args)`` on the kernel (inputs in ``dtype``) and on the reference (the same values in
    fp32); returns ``(detail, figures, ok)`` over every output and input gradient."""
    def leaves(reference):
        out = {}
        for name, t in tensors.items():
            if t is not None and t.is_floating_point():
                t = t if name in keep_fp32 else t.to(dtype)
                t = (t.float() if reference else t).to(setup.device).detach().requires_grad_(grad)
            out[name] = t.to(setup.device) if isinstance(t, torch.Tensor) else t
        return out

    projections = []

    def run(backend, args):
        outs = op(backend, args)
        outs = outs if isinstance(outs, tuple) else (outs,)
        if not grad:
            return outs, {}
        if not projections:
            gen = torch.Generator().manual_seed(7)
            projections.extend(torch.randn(o.shape, generator=gen) for o in outs)
        loss = sum((o.float() * p.to(o.device)).sum() for o, p in zip(outs, projections))
        present = {k: v for k, v in args.items() if isinstance(v, torch.Tensor) and v.requires_grad}
        return outs, dict(zip(present, torch.autograd.grad(loss, list(present.values()), allow_unused=True)))

    try:
        k_outs, k_grads = run("kernel", leaves(False))
    except (ValueError, RuntimeError) as err:
        if kernel_refusal(err):
            raise Skip(str(err)) from err
        raise
    r_outs, r_grads = run("reference", leaves(True))
    fwd, bwd = LIMITS[dtype]
    figures = {f"out{i}": rel_rms(k, r) for i, (k, r) in enumerate(zip(k_outs, r_outs))}
    figures.update({f"d{name}": math.inf if k_grads.get(name) is None else rel_rms(k_grads[name], r_grads[name])
                    for name in r_grads if r_grads[name] is not None})          # a missing kernel gradient fails
    bad = [n for n, e in figures.items() if not e <= (fwd if n.startswith("out") else bwd)]
    worst = max(figures, key=lambda n: figures[n] if math.isfinite(figures[n]) else math.inf)
    detail = f"worst {worst} {figures[worst]:.2e} (limits {fwd:.0e} / {bwd:.0e})"
    return (detail + (f"; over the limit: {bad}" if bad else "")), figures, not bad


# ---------------------------------------------------------------------------- the cases
def _randn(*shape, seed=0):
    return torch.randn(*shape, generator=torch.Generator().manual_seed(seed))


def case_conv(setup: Setup, dtype):
    """Short convolution (causal-conv1d if its wheel is given, else fla's Triton conv): packed,
    per-document initial and final states, channel-last x, silu."""
    from mixers.ops import causal_conv1d_fn
    D, W, N = 4 * setup.dim, 4, len(setup.lengths)
    cu = setup.cu()
    tensors = {"x": _randn(1, setup.T, D).transpose(1, 2), "weight": _randn(D, W, seed=1),
               "bias": _randn(D, seed=2), "initial_states": _randn(N, D, W - 1, seed=3)}

    def op(backend, a):
        return causal_conv1d_fn(a["x"], a["weight"], a["bias"], initial_states=a["initial_states"],
                                return_final_states=True, activation="silu", cu_seqlens=cu, backend=backend)
    return compare(op, tensors, dtype, setup)


def case_conv_seq_idx(setup: Setup, dtype):
    """Short convolution over two rows described by ``seq_idx`` with negative padding runs."""
    from mixers.ops import causal_conv1d_fn
    D, W, T = 2 * setup.dim, 4, setup.T
    ids = [0] * 2 + [1] * (T // 2) + [-1] * 3
    ids = (ids + [2] * T)[:T]
    seq_idx = torch.tensor([ids, sorted(ids, key=lambda i: i if i >= 0 else 99)], dtype=torch.int32)
    tensors = {"x": _randn(2, T, D).transpose(1, 2), "weight": _randn(D, W, seed=1), "seq_idx": seq_idx}

    def op(backend, a):
        return causal_conv1d_fn(a["x"], a["weight"], seq_idx=a["seq_idx"], activation="silu", backend=backend)
    return compare(op, tensors, dtype, setup)


def case_ssd(setup: Setup, dtype, per_doc_initial: bool):
    """mamba-ssm's SSD scan: packed, D, z, dt_bias, softplus, per-document final states; initial
    states one per document (upstream has one per row: the kernel refuses) or one for the row."""
    from mixers.ops import mamba_chunk_scan_combined
    H, P, G, Ns, N = setup.heads, setup.dim // 2, 1, setup.dim // 2, len(setup.lengths)
    chunk = 16 if setup.dry else 64
    cu = setup.cu()
    tensors = {"x": _randn(1, setup.T, H, P), "dt": _randn(1, setup.T, H, seed=1) - 1.0,
               "A": -torch.rand(H, generator=torch.Generator().manual_seed(2)) - 0.5,
               "B": _randn(1, setup.T, G, Ns, seed=3), "C": _randn(1, setup.T, G, Ns, seed=4),
               "D": _randn(H, seed=5), "z": _randn(1, setup.T, H, P, seed=6), "dt_bias": _randn(H, seed=7),
               "initial_states": _randn(N if per_doc_initial else 1, H, P, Ns, seed=8)}

    def op(backend, a):
        return mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], chunk, D=a["D"], z=a["z"],
                                         dt_bias=a["dt_bias"], initial_states=a["initial_states"], cu_seqlens=cu,
                                         dt_softplus=True, return_final_states=True, backend=backend)
    return compare(op, tensors, dtype, setup, keep_fp32=("A", "D", "dt_bias"))


def case_ssd_varlen_states(setup: Setup, dtype):
    """mamba-ssm's SSD scan returning per-document states through its varlen-states kernel (forward)."""
    from mixers.ops import mamba_chunk_scan_combined
    H, P, Ns = setup.heads, setup.dim // 2, setup.dim // 2
    cu = setup.cu()
    tensors = {"x": _randn(1, setup.T, H, P), "dt": _randn(1, setup.T, H, seed=1) - 1.0,
               "A": -torch.rand(H, generator=torch.Generator().manual_seed(2)) - 0.5,
               "B": _randn(1, setup.T, 1, Ns, seed=3), "C": _randn(1, setup.T, 1, Ns, seed=4)}

    def op(backend, a):
        with torch.no_grad():
            return mamba_chunk_scan_combined(a["x"], a["dt"], a["A"], a["B"], a["C"], 16 if setup.dry else 64,
                                             cu_seqlens=cu, dt_softplus=True, return_final_states=True,
                                             return_varlen_states=True, backend=backend)
    return compare(op, tensors, dtype, setup, grad=False, keep_fp32=("A",))


def case_delta(setup: Setup, dtype, kind: str):
    """fla's chunk kernels (GDN, KDA, Gated DeltaProduct): packed, grouped value heads (GDN, KDA),
    per-document initial and final states, l2-normalised q and k in the kernel."""
    from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda
    H, K, N = setup.heads, setup.dim, len(setup.lengths)
    nh, HV = (2, H) if kind == "gdp" else (1, 2 * H)
    T = setup.T
    gate_shape = (1, T, HV, K) if kind == "kda" else (1, T, HV)
    tensors = {"q": _randn(1, T, H, K), "k": _randn(1, T * nh, H, K, seed=1), "v": _randn(1, T * nh, HV, K, seed=2),
               "g": F.logsigmoid(_randn(*gate_shape, seed=3) + 2.0),
               "beta": torch.rand(1, T * nh, HV, generator=torch.Generator().manual_seed(4)),
               "initial_state": _randn(N, HV, K, K, seed=5)}
    cu = setup.cu()

    def op(backend, a):
        args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
        kwargs = dict(initial_state=a["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                      cu_seqlens=cu, backend=backend)
        if kind == "gdp":
            return chunk_gated_delta_product(*args, nh, **kwargs)
        return (chunk_kda if kind == "kda" else chunk_gated_delta_rule)(*args, **kwargs)
    return compare(op, tensors, dtype, setup)


def _decode_inputs(setup: Setup, kind: str):
    rows, H, K = 3, setup.heads, setup.dim
    nh, HV = (2, H) if kind == "gdp" else (1, 2 * H)
    return {"q": _randn(rows, 1, H, K), "k": _randn(rows, nh, H, K, seed=1), "v": _randn(rows, nh, HV, K, seed=2),
            "g": F.logsigmoid(_randn(*((rows, 1, HV, K) if kind == "kda" else (rows, 1, HV)), seed=3) + 2.0),
            "beta": torch.rand(rows, nh, HV, generator=torch.Generator().manual_seed(4)),
            "initial_state": _randn(rows, HV, K, K, seed=5)}


def case_recurrent_step(setup: Setup, dtype, kind: str):
    """fla's fused_recurrent decode kernels: one token per row, per-row states, l2norm in the kernel."""
    from mixers.ops import fused_recurrent_gated_delta_product as gdp_step
    from mixers.ops import fused_recurrent_gated_delta_rule as gdn_step
    from mixers.ops import fused_recurrent_kda as kda_step

    def op(backend, a):
        args = (a["q"], a["k"], a["v"], a["g"], a["beta"])
        kwargs = dict(initial_state=a["initial_state"], output_final_state=True, use_qk_l2norm_in_kernel=True,
                      backend=backend)
        if kind == "gdp":
            return gdp_step(*args, 2, **kwargs)
        return (kda_step if kind == "kda" else gdn_step)(*args, **kwargs)
    return compare(op, _decode_inputs(setup, kind), dtype, setup, grad=False)


def case_state_update(setup: Setup, dtype):
    """mamba-ssm's selective_state_update: pooled states picked by index, grouped B / C, D, z, dt_bias."""
    from mixers.ops import selective_state_update
    H, P, Ns, rows = setup.heads, setup.dim // 2, setup.dim // 2, 2
    tensors = {"state": _randn(4, H, P, Ns), "x": _randn(rows, H, P, seed=1), "dt": _randn(rows, H, P, seed=2),
               "A": -torch.rand(H, P, Ns, generator=torch.Generator().manual_seed(3)), "B": _randn(rows, 1, Ns, seed=4),
               "C": _randn(rows, 1, Ns, seed=5), "D": _randn(H, P, seed=6), "z": _randn(rows, H, P, seed=7),
               "dt_bias": _randn(H, P, seed=8), "index": torch.tensor([3, 1], dtype=torch.int32)}

    def op(backend, a):
        state = a["state"].clone()
        out = selective_state_update(state, a["x"], a["dt"], a["A"], a["B"], a["C"], D=a["D"], z=a["z"],
                                     dt_bias=a["dt_bias"], dt_softplus=True, state_batch_indices=a["index"],
                                     backend=backend)
        return out, state
    return compare(op, tensors, dtype, setup, grad=False, keep_fp32=("A", "D", "dt_bias", "state"))


def case_conv_update(setup: Setup, dtype):
    """The short convolution's decode step (causal-conv1d's if given, else fla's) on pooled states."""
    from mixers.ops import causal_conv1d_update
    D, W = 2 * setup.dim, 4
    tensors = {"x": _randn(2, D), "conv_state": _randn(5, D, W - 1, seed=1), "weight": _randn(D, W, seed=2),
               "bias": _randn(D, seed=3), "index": torch.tensor([4, 0], dtype=torch.int32)}

    def op(backend, a):
        state = a["conv_state"].clone()
        out = causal_conv1d_update(a["x"], state, a["weight"], a["bias"], "silu", conv_state_indices=a["index"],
                                   backend=backend)
        return out, state
    return compare(op, tensors, dtype, setup, grad=False)


def case_attention(setup: Setup, dtype):
    """ssm-pack's varlen attention (the kernel its dispatch picks on this machine): packed, causal, GQA."""
    from mixers.ops import varlen_attention
    H, Dh, T = setup.heads, setup.dim, setup.T
    cu = setup.cu()
    tensors = {"q": _randn(T, 2 * H, Dh), "k": _randn(T, H, Dh, seed=1), "v": _randn(T, H, Dh, seed=2)}

    def op(backend, a):
        return varlen_attention(a["q"], a["k"], a["v"], cu, max(setup.lengths), causal=True, backend=backend)
    return compare(op, tensors, dtype, setup)


def case_torch_varlen_attn(setup: Setup, dtype):
    """PyTorch's own ``varlen_attn`` called directly (causal, per its release's signature) vs the reference."""
    import inspect
    try:
        from torch.nn.attention.varlen import varlen_attn
    except ImportError as err:
        raise Skip(f"torch {torch.__version__} has no torch.nn.attention.varlen.varlen_attn") from err
    if setup.device != "cuda":
        raise Skip("varlen_attn runs on CUDA only")
    if dtype == torch.float32:
        raise Skip("varlen_attn (FlashAttention-2) takes fp16 / bf16 only")
    from mixers.ops import varlen_attention
    params = inspect.signature(varlen_attn).parameters
    causal = {"is_causal": True} if "is_causal" in params else {"window_size": (-1, 0)}
    H, Dh = setup.heads, setup.dim
    cu = setup.cu()
    T = int(cu[-1])
    tensors = {"q": _randn(T, H, Dh), "k": _randn(T, H, Dh, seed=1), "v": _randn(T, H, Dh, seed=2)}
    longest = max(setup.lengths)

    def op(backend, a):
        if backend == "kernel":
            return varlen_attn(a["q"], a["k"], a["v"], cu, cu, longest, longest, **causal)
        return varlen_attention(a["q"], a["k"], a["v"], cu, longest, causal=True, backend="reference")
    return compare(op, tensors, dtype, setup)


def case_context_parallel(setup: Setup):
    """Context parallelism is not covered by a one-GPU check: recorded as skipped, with the reason."""
    raise Skip("context parallelism is not covered by the one-GPU check: NCCL refuses two ranks on one GPU, gloo "
               "moves CUDA tensors through host copies (not the path CP users train on) and a world of 1 exchanges "
               "nothing; the exchange runs on CPU with gloo in tests/context_parallel, and the per-document initial "
               "and final states it hands between ranks are checked on the kernels above")


def all_cases(setup: Setup):
    """``[(name, function, args)]`` in the order they run."""
    names = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16"}
    out = []
    for dtype in setup.dtypes:
        tag = names[dtype]
        out += [(f"conv packed, per-document states [{tag}]", case_conv, (setup, dtype)),
                (f"conv seq_idx rows with padding [{tag}]", case_conv_seq_idx, (setup, dtype)),
                (f"conv decode step [{tag}]", case_conv_update, (setup, dtype)),
                (f"ssd packed, row initial state, per-document final states [{tag}]", case_ssd, (setup, dtype, False)),
                (f"ssd packed, per-document initial states [{tag}]", case_ssd, (setup, dtype, True)),
                (f"ssd varlen states [{tag}]", case_ssd_varlen_states, (setup, dtype)),
                (f"ssd decode step (selective_state_update) [{tag}]", case_state_update, (setup, dtype))]
        for kind in ("gdn", "kda", "gdp"):
            out += [(f"{kind} packed, per-document states [{tag}]", case_delta, (setup, dtype, kind)),
                    (f"{kind} decode step (fused_recurrent) [{tag}]", case_recurrent_step, (setup, dtype, kind))]
        out += [(f"attention packed, GQA [{tag}]", case_attention, (setup, dtype)),
                (f"torch varlen_attn direct [{tag}]", case_torch_varlen_attn, (setup, dtype))]
    if setup.dry:      # fla's Gated DeltaProduct refuses fp32 and the interpreter has no bf16 arithmetic
        out += [("gdp packed, per-document states [fp16]", case_delta, (setup, torch.float16, "gdp"))]
    from benchmarks.gpu_autocast import autocast_cases
    out += [("context parallelism", case_context_parallel, (setup,))]     # before the slow cases: always reported
    return out + autocast_cases(setup)


def main(argv=None) -> int:
    return stage_main("correctness", __doc__.splitlines()[0], argv, lambda dry_run: all_cases(Setup(dry_run)))


if __name__ == "__main__":
    sys.exit(main())
