"""Check any mixer for packing correctness: packed equals per document, and nothing leaks.

    T = physical packed tokens, D = hidden, N = documents

Works for any ``nn.Module`` called as ``module(hidden_states [1, T, D], packed_seq_params=...)``
that also accepts ``packed_seq_params=None`` for one plain sequence. Document ``i`` is the run
of its real tokens ``[cu_seqlens_q_padded[i], + length_i)`` of the physical layout; padding
between documents and after the last one is "padding".
"""

from __future__ import annotations

import torch

from .params import PackedSeqParams
from .seq_idx import get_cu_seqlens

# dtype -> (forward, gradient) tolerance; fp64 is max abs error, the others relative RMS
TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 1e-2),
              torch.float16: (5e-3, 1e-2)}


class LeakageCheckInconclusive(AssertionError):
    """The module does not depend on other tokens even without the packing metadata, so a
    leakage check on it cannot fail and proves nothing."""


def document_spans(params: PackedSeqParams, total: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(documents, padding)``: ``(start, end)`` of every non-empty document's real tokens and of
    every padding run of the physical layout of ``total`` tokens."""
    physical = get_cu_seqlens(params).tolist()
    lengths = (params.cu_seqlens_q[1:] - params.cu_seqlens_q[:-1]).tolist()
    docs, pads = [], []
    for start, end_slot, n in zip(physical[:-1], physical[1:], lengths):
        if n:
            docs.append((start, start + n))
        if end_slot > start + n:
            pads.append((start + n, end_slot))
    if total > physical[-1]:
        pads.append((physical[-1], total))
    return docs, pads


def _error(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    return float((got - want).abs().max()) if got.numel() else 0.0


def _rel_rms(got: torch.Tensor, want: torch.Tensor) -> float:
    got, want = got.detach().double(), want.detach().double()
    if not got.numel():
        return 0.0
    return float((got - want).square().mean().sqrt() / want.square().mean().sqrt().clamp_min(1e-30))


def _close(got, want, dtype, grad, what, failures):
    fwd, bwd = TOLERANCES.get(dtype, TOLERANCES[torch.float32])
    limit = bwd if grad else fwd
    err = _error(got, want) if dtype == torch.float64 else _rel_rms(got, want)
    if err > limit:
        kind = "max abs" if dtype == torch.float64 else "relative RMS"
        failures.append(f"{what}: {kind} error {err:.3e} > {limit:.0e}")
    return err


def assert_packed_equals_unpacked(module, hidden_states: torch.Tensor, packed_seq_params: PackedSeqParams, *,
                                  check_grads: bool = True, seed: int = 0) -> dict[str, float]:
    """Each document's slice of the packed output equals ``module`` run on that document alone.

    With ``check_grads``, the input gradients of every document and every parameter gradient
    (summed over the documents) are compared too, for one fixed random output gradient.
    Tolerances per dtype are :data:`TOLERANCES`. Returns the largest error per quantity;
    raises ``AssertionError`` listing every quantity out of tolerance.
    """
    if not isinstance(packed_seq_params, PackedSeqParams):
        raise TypeError(f"packed_seq_params must be a PackedSeqParams, got {type(packed_seq_params).__name__}")
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be one packed row [1, T, D], got {tuple(hidden_states.shape)}")
    dtype = hidden_states.dtype
    docs, _ = document_spans(packed_seq_params, hidden_states.shape[1])
    params = [p for p in module.parameters() if p.requires_grad]
    x = hidden_states.detach().clone().requires_grad_(check_grads)
    out = module(x, packed_seq_params=packed_seq_params)
    g = torch.Generator(device="cpu").manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    mask = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
    for s, e in docs:
        mask[s:e] = True
    failures, worst = [], {"output": 0.0, "input grad": 0.0, "param grad": 0.0}
    packed_grads = None
    if check_grads:
        packed_grads = torch.autograd.grad((out * g_out)[:, mask].sum(), [x] + params, allow_unused=True,
                                           materialize_grads=True)
    summed = [torch.zeros_like(p) for p in params]
    for i, (s, e) in enumerate(docs):
        xi = hidden_states[:, s:e].detach().clone().requires_grad_(check_grads)
        oi = module(xi, packed_seq_params=None)
        worst["output"] = max(worst["output"], _close(out[:, s:e], oi, dtype, False, f"document {i} output", failures))
        if check_grads:
            gi = torch.autograd.grad((oi * g_out[:, s:e]).sum(), [xi] + params, allow_unused=True,
                                     materialize_grads=True)
            err = _close(packed_grads[0][:, s:e], gi[0], dtype, True, f"document {i} input grad", failures)
            worst["input grad"] = max(worst["input grad"], err)
            summed = [a + b for a, b in zip(summed, gi[1:])]
    if check_grads:
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        for name, a, b in zip(names, packed_grads[1:], summed):
            worst["param grad"] = max(worst["param grad"], _close(a, b, dtype, True, f"grad of {name}", failures))
    if failures:
        raise AssertionError("packed output differs from per-document runs:\n  " + "\n  ".join(failures))
    return worst


def _leaks(module, hidden_states, params, victims, others, scale, seed, stop_at_first=False):
    gen = torch.Generator(device="cpu").manual_seed(seed)
    real = torch.zeros(hidden_states.shape[1], dtype=torch.bool)
    for _, (a, b) in others:
        real[a:b] = True                 # padding outputs are discarded: no gradient flows from them

    def run(x):
        x = x.detach().clone().requires_grad_(True)
        out = module(x, packed_seq_params=params)
        g_out = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        g_out = (g_out * real[None, :, None]).to(out.device, out.dtype)
        (grad,) = torch.autograd.grad((out * g_out).sum(), [x])
        return out.detach(), grad

    out0, grad0 = run(hidden_states)
    found = []
    for name, (s, e) in victims:
        x = hidden_states.detach().clone()
        noise = (torch.rand(x[:, s:e].shape, generator=gen, dtype=torch.float64) * 2 - 1) * scale
        x[:, s:e] = noise.to(x.device, x.dtype)
        out1, grad1 = run(x)
        for other, (a, b) in others:
            if other == name:
                continue
            if not (torch.equal(out0[:, a:b], out1[:, a:b]) and torch.equal(grad0[:, a:b], grad1[:, a:b])):
                found.append((name, other))
                if stop_at_first:
                    return found
    return found


def assert_no_cross_document_leakage(module, hidden_states: torch.Tensor, packed_seq_params: PackedSeqParams, *,
                                     scale: float = 1e3, seed: int = 0, negative_control: bool = True) -> int:
    """Perturbing one document (values up to +-``scale``), or the padding, leaves every other
    document's outputs and input gradients bitwise unchanged.

    It runs its own negative control: the same perturbations without the metadata must change
    another document, or the module does not depend on its context at all and the check could
    not fail (:class:`LeakageCheckInconclusive`). Returns the number of perturbations checked;
    raises ``AssertionError`` naming every leaking (perturbed, changed) pair.
    """
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be one packed row [1, T, D], got {tuple(hidden_states.shape)}")
    docs, pads = document_spans(packed_seq_params, hidden_states.shape[1])
    if len(docs) < 2 and not pads:
        raise ValueError("a leakage check needs at least two documents (or one and some padding)")
    named = [(f"document {i}", span) for i, span in enumerate(docs)]
    victims = named + [(f"padding {j}", span) for j, span in enumerate(pads)]
    leaks = _leaks(module, hidden_states, packed_seq_params, victims, named, scale, seed)
    if leaks:
        pairs = ", ".join(f"{a} -> {b}" for a, b in leaks[:10])
        raise AssertionError(f"state leaks across documents ({len(leaks)} pairs): {pairs}")
    if negative_control and not _leaks(module, hidden_states, None, named, named, scale, seed, stop_at_first=True):
        raise LeakageCheckInconclusive(
            "without packed_seq_params the module still shows no dependence of one document on another, "
            "so this leakage check could not have failed; use a module that mixes tokens, or longer documents")
    return len(victims)
