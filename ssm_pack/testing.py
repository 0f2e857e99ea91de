"""Check any mixer for packing correctness: packed equals per document, and nothing leaks.

    T = physical packed tokens, D = hidden, N = documents

Works for any ``nn.Module`` called as ``module(hidden_states [1, T, D], packed_seq_params=...)``
that also accepts ``packed_seq_params=None`` for one plain sequence. The metadata may be anything
the mixers accept: an :class:`ssm_pack.PackedSeqParams`, a Megatron-core style object with its
fields, or a prebuilt :class:`ssm_pack.VarlenBatch`; it is handed to the module unchanged.
Document ``i`` is the run of its real tokens ``[physical start_i, + length_i)`` of the physical
layout; padding between documents and after the last one is "padding". A padding run inside a
document's padded slot is *owned* by that document (it follows the document's tokens in the
same segment); the tail after the last boundary is owned by nobody.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .varlen import VarlenBatch

# dtype -> (forward, gradient) tolerance; fp64 is max abs error, the others relative RMS
TOLERANCES = {torch.float64: (1e-10, 1e-10), torch.float32: (1e-5, 1e-5), torch.bfloat16: (5e-3, 1e-2),
              torch.float16: (5e-3, 1e-2)}

_BIT_VIEWS = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.int8}


class LeakageCheckInconclusive(AssertionError):
    """A leakage check that proves nothing: the module does not depend on other tokens even
    without the packing metadata (the check cannot fail), or a perturbation overflowed to inf /
    NaN (which crosses documents through any masked product, ``0 * inf``, whatever the state)."""


@dataclass(frozen=True)
class Span:
    """Tokens ``[start, end)`` of the physical row; ``owner`` is the document whose padded slot
    holds a padding run (``None`` for a document and for the tail)."""

    name: str
    start: int
    end: int
    owner: str | None = None


def _check_row(hidden_states) -> None:
    if not isinstance(hidden_states, torch.Tensor):
        raise TypeError(f"hidden_states must be a torch.Tensor [1, T, D], got {type(hidden_states).__name__}")
    if hidden_states.dim() != 3 or hidden_states.shape[0] != 1:
        raise ValueError(f"hidden_states must be one packed row [1, T, D], got {tuple(hidden_states.shape)}; "
                         "pack the documents into one row first (PackedSeqParams.from_lengths + pack_padded)")


def _spans(packed_seq_params, total: int) -> tuple[list[Span], list[Span]]:
    """``(documents, padding)`` of a row of ``total`` tokens (empty documents own no span)."""
    if packed_seq_params is None:
        raise TypeError("packed_seq_params must be a PackedSeqParams, a Megatron-style PackedSeqParams or a "
                        "VarlenBatch describing the packed row, got None")
    varlen = VarlenBatch.build(packed_seq_params, total)
    physical = varlen.cu_seqlens.tolist()
    lengths = (varlen.real_cu_seqlens[1:] - varlen.real_cu_seqlens[:-1]).tolist()
    docs, pads = [], []
    for start, end_slot, n in zip(physical[:-1], physical[1:], lengths):
        owner = None
        if n:
            owner = f"document {len(docs)}"
            docs.append(Span(owner, start, start + n))
        if end_slot > start + n:
            pads.append(Span(f"padding {len(pads)}", start + n, end_slot, owner))
    if total > physical[-1]:
        pads.append(Span(f"padding {len(pads)}", physical[-1], total))
    return docs, pads


def document_spans(packed_seq_params, total: int) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """``(documents, padding)``: ``(start, end)`` of every non-empty document's real tokens and of
    every padding run of the physical layout of ``total`` tokens."""
    docs, pads = _spans(packed_seq_params, total)
    return [(s.start, s.end) for s in docs], [(s.start, s.end) for s in pads]


def bitwise_equal(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Same shape, dtype and bit pattern (``-0.0`` differs from ``0.0``; a NaN equals the same NaN)."""
    if a.shape != b.shape or a.dtype != b.dtype:
        return False
    if a.is_complex():
        a, b = torch.view_as_real(a), torch.view_as_real(b)
    if a.is_floating_point():
        view = _BIT_VIEWS[a.element_size()]
        return torch.equal(a.contiguous().view(view), b.contiguous().view(view))
    return torch.equal(a, b)


# ----------------------------------------------------------------- packed == per document
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
    if not err <= limit:                                           # NaN is a failure too
        kind = "max abs" if dtype == torch.float64 else "relative RMS"
        failures.append(f"{what}: {kind} error {err:.3e} > {limit:.0e}")
    return err


def assert_packed_equals_unpacked(module, hidden_states: torch.Tensor, packed_seq_params, *,
                                  check_grads: bool = True, seed: int = 0) -> dict[str, float]:
    """Each document's slice of the packed output equals ``module`` run on that document alone.

    Args:
        hidden_states: ``[1, T, D]`` one packed row (padding included).
        packed_seq_params: what the module takes (``PackedSeqParams``, a Megatron-style object
            or a ``VarlenBatch``) describing those T tokens.

    With ``check_grads``, the input gradients of every document and every parameter gradient
    (the packed run's against the sum over the per-document runs) are compared too, for one
    fixed random output gradient on the documents' tokens. Tolerances per dtype are
    :data:`TOLERANCES`. Returns the largest error per quantity; raises ``AssertionError``
    listing every quantity out of tolerance.
    """
    _check_row(hidden_states)
    dtype = hidden_states.dtype
    docs, _ = _spans(packed_seq_params, hidden_states.shape[1])
    named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
    params = [p for _, p in named]
    x = hidden_states.detach().clone().requires_grad_(check_grads)
    out = module(x, packed_seq_params=packed_seq_params)
    g = torch.Generator(device="cpu").manual_seed(seed)
    g_out = torch.randn(out.shape, generator=g, dtype=torch.float64).to(out.device, out.dtype)
    mask = torch.zeros(out.shape[1], dtype=torch.bool, device=out.device)
    for d in docs:
        mask[d.start:d.end] = True
    failures, worst = [], {"output": 0.0, "input grad": 0.0, "param grad": 0.0}
    packed_grads = None
    if check_grads:
        packed_grads = torch.autograd.grad((out * g_out)[:, mask].sum(), [x] + params, allow_unused=True,
                                           materialize_grads=True)
    summed = [torch.zeros_like(p) for p in params]
    for i, d in enumerate(docs):
        s, e = d.start, d.end
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
        for (name, _), a, b in zip(named, packed_grads[1:], summed):
            worst["param grad"] = max(worst["param grad"], _close(a, b, dtype, True, f"grad of {name}", failures))
    if failures:
        raise AssertionError("packed output differs from per-document runs:\n  " + "\n  ".join(failures))
    return worst


# ----------------------------------------------------------------- no leakage, bitwise
OUTPUT, INPUT_GRAD, PARAM_GRAD = "output", "input gradient", "parameter-gradient contribution"


@dataclass(frozen=True)
class Leak:
    """``perturbed`` (``"input"`` or ``"output gradient"``) of span ``victim`` changed
    ``quantities`` of document ``other``."""

    perturbed: str
    victim: str
    other: str
    quantities: tuple[str, ...]

    def __str__(self) -> str:
        return f"{self.perturbed} of {self.victim} -> {self.other}: {', '.join(self.quantities)}"


class _Prober:
    """Runs the perturbations of one packed row; ``meta=None`` runs them without the metadata
    (the negative control). Output gradients are random on the documents' tokens, zero on the
    padding (padding outputs are discarded)."""

    def __init__(self, module, hidden_states, meta, docs, scale, seed):
        self.module, self.meta, self.docs, self.scale = module, meta, docs, scale
        self.params = [p for p in module.parameters() if p.requires_grad]
        self.noise = torch.Generator(device="cpu").manual_seed(seed)
        self.hidden = hidden_states.detach()
        self.x, self.out = self._forward(self.hidden)        # keeps its graph for every probe
        g = torch.randn(self.out.shape, generator=torch.Generator().manual_seed(seed + 1), dtype=torch.float64)
        self.g_out = torch.zeros_like(g)
        for d in docs:
            self.g_out[:, d.start:d.end] = g[:, d.start:d.end]
        self.g_out = self.g_out.to(self.out.device, self.out.dtype)
        self.grad = self._grads(self.x, self.out, self.g_out, params=False)[0]
        self._finite("output or input gradient", None, self.out, self.grad)

    def _noise(self, shape, like: torch.Tensor) -> torch.Tensor:
        noise = (torch.rand(shape, generator=self.noise, dtype=torch.float64) * 2 - 1) * self.scale
        return noise.to(like.device, like.dtype)

    def _forward(self, hidden):
        x = hidden.detach().clone().requires_grad_(True)
        return x, self.module(x, packed_seq_params=self.meta)

    def _finite(self, what: str, victim, *tensors) -> None:
        """Refuse to judge bits once a probe overflowed: ``0 * inf`` is NaN, so an overflow in one
        document reaches the others through any masked product, state or not."""
        if all(bool(torch.isfinite(t).all()) for t in tensors):
            return
        at = "the unperturbed row" if victim is None else f"{victim.name} perturbed up to +-{self.scale:g}"
        raise LeakageCheckInconclusive(
            f"the module's {what} is not finite (inf / NaN) with {at}, so the bitwise comparison means "
            f"nothing; pass a smaller scale= (perturbations are uniform in [-scale, scale], got "
            f"{self.scale:g}) or normalise the module's activations")

    def _grads(self, x, out, g, params=True):
        """``(input gradient [1, T, D], parameter gradients)`` of a backward pass of ``g``."""
        wrt = [x] + (self.params if params else [])
        grads = torch.autograd.grad(out, wrt, g, retain_graph=True, allow_unused=True, materialize_grads=True)
        return grads[0], grads[1:]

    def perturb_input(self, victim: Span) -> list[Leak]:
        """Random values (up to +-scale) in ``victim``'s tokens. For a backward pass carrying every
        output gradient but the victim's, every other document's output and input gradient, and
        the parameter gradients (the other documents' contributions), must keep their bits."""
        g = self.g_out.clone()
        g[:, victim.start:victim.end] = 0
        grad0, params0 = self._grads(self.x, self.out, g)
        hidden = self.hidden.clone()
        hidden[:, victim.start:victim.end] = self._noise(hidden[:, victim.start:victim.end].shape, hidden)
        x, out = self._forward(hidden)
        grad1, params1 = self._grads(x, out, g)
        self._finite("output or a gradient", victim, out, grad1, *params1)
        leaks = []
        for d in self.docs:
            if d.name == victim.name:
                continue
            changed = tuple(what for what, a, b in ((OUTPUT, self.out, out), (INPUT_GRAD, grad0, grad1))
                            if not bitwise_equal(a[:, d.start:d.end].detach(), b[:, d.start:d.end].detach()))
            if changed:
                leaks.append(Leak("input", victim.name, d.name, changed))
        if not all(bitwise_equal(a, b) for a, b in zip(params0, params1)):
            leaks.append(Leak("input", victim.name, "the other documents", (PARAM_GRAD,)))
        return leaks

    def perturb_output_gradient(self, victim: Span) -> list[Leak]:
        """Random values in ``victim``'s output gradient; every other document's input gradient
        must keep its bits (a padding run's own document excepted: the run follows it)."""
        g = self.g_out.clone()
        g[:, victim.start:victim.end] = self._noise(g[:, victim.start:victim.end].shape, g)
        grad = self._grads(self.x, self.out, g, params=False)[0]
        self._finite("input gradient (its output gradient perturbed)", victim, grad)
        return [Leak("output gradient", victim.name, d.name, (INPUT_GRAD,)) for d in self.docs
                if d.name not in (victim.name, victim.owner)
                and not bitwise_equal(self.grad[:, d.start:d.end], grad[:, d.start:d.end])]


def _negative_control(module, hidden_states, docs, pads, scale, seed) -> list[str]:
    """The probes that found no dependence between documents without the metadata (each must
    find one, or it could not have failed with the metadata either)."""
    prober = _Prober(module, hidden_states, None, docs, scale, seed)
    missing = {("input", OUTPUT): "perturbing one document's input changes another's output",
               ("output gradient", INPUT_GRAD): "perturbing one document's output gradient changes another's "
                                                "input gradient"}
    if prober.params:
        missing[("input", PARAM_GRAD)] = ("perturbing one document's input changes another's "
                                          "parameter-gradient contribution")
    for victim in docs + pads:
        for leak in prober.perturb_input(victim) + prober.perturb_output_gradient(victim):
            for what in leak.quantities:
                missing.pop((leak.perturbed, what), None)
        if not missing:
            break
    return list(missing.values())


def assert_no_cross_document_leakage(module, hidden_states: torch.Tensor, packed_seq_params, *,
                                     scale: float = 1e3, seed: int = 0, negative_control: bool = True) -> int:
    """Nothing of one document reaches another, forward or backward, compared bitwise.

    Args:
        module: called as ``module(x [1, T, D], packed_seq_params=...)`` and with ``None``.
        hidden_states: ``[1, T, D]`` one packed row (padding included).
        packed_seq_params: what the module takes (``PackedSeqParams``, a Megatron-style object
            or a ``VarlenBatch``) describing those T tokens; handed to the module unchanged.
        scale: perturbations are uniform in ``[-scale, scale]``.

    Two probes, each document and each padding run in turn (the output gradient is random on
    the documents' tokens, zero on the padding):

    * its **input** is replaced by random values: every other document's outputs keep their
      bits, and so do, for a backward pass carrying every output gradient but the perturbed
      span's, their input gradients and the parameter gradients (their contributions);
    * its **output gradient** is replaced by random values: every other document's input
      gradients keep their bits (a padding run's own document excepted, as the run follows it
      in its slot).

    It runs its own negative control: the same probes without the metadata must find, for each
    probe (and for the parameter gradients, when the module has trainable ones), one document
    that depends on another span, or the check could not have failed
    (:class:`LeakageCheckInconclusive`; a causal module with one document and padding after it
    is such a case). Returns the number of perturbations checked; raises
    ``AssertionError`` listing every leak (perturbed span, changed document, what changed).
    """
    _check_row(hidden_states)
    docs, pads = _spans(packed_seq_params, hidden_states.shape[1])
    if len(docs) < 2 and not pads:
        raise ValueError(f"a leakage check needs at least two documents (or one and some padding), got "
                         f"{len(docs)} non-empty document(s) and no padding; pack more documents")
    prober = _Prober(module, hidden_states, packed_seq_params, docs, scale, seed)
    leaks = []
    for victim in docs + pads:
        leaks += prober.perturb_input(victim) + prober.perturb_output_gradient(victim)
    if leaks:
        shown = "\n  ".join(str(leak) for leak in leaks[:20])
        more = f"\n  ... and {len(leaks) - 20} more" if len(leaks) > 20 else ""
        raise AssertionError(f"state leaks across documents ({len(leaks)} leaks):\n  {shown}{more}")
    if negative_control:
        missing = _negative_control(module, hidden_states, docs, pads, scale, seed)
        if missing:
            raise LeakageCheckInconclusive(
                "without packed_seq_params the module still shows no dependence of one document on another ("
                + "; ".join(f"never: {m}" for m in missing) + "), so this leakage check could not have failed; "
                "use a module that mixes tokens, or longer documents, or pass negative_control=False for a "
                "probe that cannot apply")
    return 2 * len(docs + pads)


__all__ = ["TOLERANCES", "Leak", "LeakageCheckInconclusive", "Span", "assert_no_cross_document_leakage",
           "assert_packed_equals_unpacked", "bitwise_equal", "document_spans"]
