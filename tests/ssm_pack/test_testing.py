"""The public testing helpers against deliberately broken modules, one kind of leak each.

Every module below is exact except for one planted defect, and each defect is visible to
exactly one check of the helpers: the forward probe, the output-gradient probe, the padding
probes, the parameter-gradient probe, bitwise comparison, the per-dtype tolerance. So each test
fails if the helper's corresponding check is removed or weakened.

    T = packed tokens, D = hidden
"""

from __future__ import annotations

import math
import re

import pytest
import torch
from torch import nn

from ssm_pack import PackedSeqParams, VarlenBatch
from ssm_pack.pytest_plugin import layout
from ssm_pack.testing import (
    LeakageCheckInconclusive,
    assert_no_cross_document_leakage,
    assert_packed_equals_unpacked,
    bitwise_equal,
    document_spans,
)
from tests.support.megatron_standin import megatron_copy

D = 4
# documents of 3, 5, 4 and 6 tokens in slots of 4, 8, 4 and 8, then a 2-token tail:
# padding after document 0 (token 3), after document 1 (9..11), after document 3 (22..23), tail 24..25
LENGTHS, PAD, TAIL = [3, 5, 4, 6], 4, 2


def row(dtype=torch.float64):
    return layout(LENGTHS, hidden=D, dtype=dtype, pad_to_multiple_of=PAD, tail=TAIL)


def structure(meta, total):
    """``(documents, segments)``: real-token spans and the physical segments (slots, then the tail).

    Read from the boundaries directly (not from ssm_pack.testing, which is under test)."""
    if meta is None:
        return [(0, total)], [(0, total)]
    varlen = VarlenBatch.build(meta, total)
    physical, real = varlen.cu_seqlens.tolist(), varlen.real_cu_seqlens.tolist()
    docs = [(p, p + b - a) for p, a, b in zip(physical[:-1], real[:-1], real[1:]) if b > a]
    segments = [(a, b) for a, b in zip(physical[:-1], physical[1:]) if b > a]
    if total > physical[-1]:
        segments.append((physical[-1], total))
    return docs, segments


def pairs(docs, *, through_padding=False):
    """``(source, destination)`` token pairs across each boundary between consecutive documents:
    the last real token of one (or, ``through_padding``, the padding token just before the next
    document, where there is one) and the first token of the next."""
    out = []
    for (_, end), (start, _) in zip(docs[:-1], docs[1:]):
        if not through_padding:
            out.append((end - 1, start))
        elif start > end:
            out.append((start - 1, start))
    return out


class GradientShift(torch.autograd.Function):
    """Identity forward; the backward adds ``grad[:, src]`` into ``grad[:, dst]`` (a backward-only leak)."""

    @staticmethod
    def forward(ctx, x, src, dst):
        ctx.src, ctx.dst = src, dst
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        g = g.clone()
        g[:, ctx.dst] += g[:, ctx.src]
        return g, None, None


class LeakyScale(torch.autograd.Function):
    """``c * w``, exact in forward and input gradient; the gradient of ``w`` also sums
    ``g[:, dst] * c[:, src]`` (a leak into the parameter gradient only)."""

    @staticmethod
    def forward(ctx, c, w, src, dst):
        ctx.save_for_backward(c, w)
        ctx.src, ctx.dst = src, dst
        return c * w

    @staticmethod
    def backward(ctx, g):
        c, w = ctx.saved_tensors
        grad_w = (g * c).sum((0, 1))
        if ctx.src:
            grad_w = grad_w + (g[:, ctx.dst] * c[:, ctx.src]).sum((0, 1))
        return g * w, grad_w, None, None


class DocCumsum(nn.Module):
    """An exact packed mixer: a per-token projection, then a running sum that restarts at every
    physical segment (each document's slot, the tail). ``defect`` plants one leak:

    * ``"forward"``: the first token of a document adds the previous document's last input;
    * ``"backward"``: the output gradient of a document's last token reaches the next document's
      first token (forward exact);
    * ``"padding-forward"``: the padding token before a document adds into its first output;
    * ``"padding-gradient"``: the output gradient of that padding token reaches the document;
    * ``"parameter-gradient"``: only the gradient of ``scale`` mixes two documents;
    * ``"tiny"``: like ``"forward"`` at ``1e-14`` (far below any tolerance; bits still change).
    """

    def __init__(self, defect=None):
        super().__init__()
        torch.manual_seed(0)
        self.proj = nn.Linear(D, D).double()
        self.scale = nn.Parameter(torch.rand(D, dtype=torch.float64) + 0.5)
        self.defect = defect

    def forward(self, hidden_states, packed_seq_params=None):
        total = hidden_states.shape[1]
        docs, segments = structure(packed_seq_params, total)
        h = self.proj(hidden_states)
        out = torch.cat([h[:, a:b].cumsum(1) for a, b in segments], 1)
        across = pairs(docs, through_padding=self.defect in ("padding-forward", "padding-gradient"))
        src, dst = [s for s, _ in across], [d for _, d in across]
        if self.defect in ("forward", "padding-forward", "tiny"):
            weight = 1e-14 if self.defect == "tiny" else 1.0
            leak = torch.zeros_like(out)
            leak[:, dst] = weight * hidden_states[:, src].to(out.dtype)
            out = out + leak
        if self.defect in ("backward", "padding-gradient"):
            out = GradientShift.apply(out, src, dst)
        if self.defect == "parameter-gradient":
            return LeakyScale.apply(out, self.scale, src, dst)
        return out * self.scale


def leak_lines(module, x, meta):
    with pytest.raises(AssertionError, match="state leaks across documents") as caught:
        assert_no_cross_document_leakage(module, x, meta)
    return [line.strip() for line in str(caught.value).splitlines()[1:]]


# ----------------------------------------------------------------- the exact module passes
@pytest.mark.parametrize("form", [
    pytest.param(lambda p: p, id="PackedSeqParams"),
    pytest.param(megatron_copy, id="megatron-standin"),
    pytest.param(lambda p: VarlenBatch.build(p, p.total_tokens), id="VarlenBatch"),
])
def test_exact_module_passes_with_every_metadata_form(form):
    x, params = row()
    assert assert_no_cross_document_leakage(DocCumsum(), x, form(params)) == 2 * (4 + 4)
    assert_packed_equals_unpacked(DocCumsum(), x, form(params))


# ----------------------------------------------------------------- one leak, one probe
@pytest.mark.parametrize("defect,expected", [
    pytest.param("forward", ["input of document 0 -> document 1: output",
                             "output gradient of document 1 -> document 0: input gradient"], id="forward"),
    pytest.param("backward", ["output gradient of document 0 -> document 1: input gradient",
                              "output gradient of document 2 -> document 3: input gradient"], id="backward-only"),
    pytest.param("padding-forward", ["input of padding 0 -> document 1: output",
                                     "input of padding 1 -> document 2: output"], id="padding-input-only"),
    pytest.param("padding-gradient", ["output gradient of padding 0 -> document 1: input gradient",
                                      "output gradient of padding 1 -> document 2: input gradient"],
                 id="padding-output-gradient-only"),
    pytest.param("parameter-gradient", ["input of document 0 -> the other documents: parameter-gradient contribution",
                                        "input of document 2 -> the other documents: parameter-gradient contribution"],
                 id="parameter-gradient-only"),
    pytest.param("tiny", ["input of document 0 -> document 1: output"], id="below-any-tolerance"),
])
def test_each_kind_of_leak_is_caught_by_its_probe(defect, expected):
    x, params = row()
    lines = leak_lines(DocCumsum(defect), x, params)
    for line in expected:
        assert line in lines, (line, lines)


@pytest.mark.parametrize("defect,only", [
    pytest.param("backward", "output gradient of document", id="backward-only"),
    pytest.param("padding-forward", "input of padding", id="padding-input-only"),
    pytest.param("padding-gradient", "output gradient of padding", id="padding-output-gradient-only"),
    pytest.param("parameter-gradient", "parameter-gradient contribution", id="parameter-gradient-only"),
])
def test_each_planted_leak_is_visible_to_one_probe_only(defect, only):
    """So removing that probe from the checker would let the module pass."""
    x, params = row()
    module = DocCumsum(defect)
    if defect == "backward":    # its leaked gradient also meets the next document's inputs in the parameter grads
        module.requires_grad_(False)
    lines = leak_lines(module, x, params)
    assert lines and all(only in line for line in lines), lines


def test_a_leak_far_below_any_tolerance_changes_bits():
    x, params = row()
    exact, tiny = DocCumsum(), DocCumsum("tiny")
    a, b = exact(x, packed_seq_params=params), tiny(x, packed_seq_params=params)
    assert torch.allclose(a, b, rtol=1e-12, atol=1e-12) and not bitwise_equal(a, b)   # what a tolerance misses
    with pytest.raises(AssertionError, match="input of document 0 -> document 1: output"):
        assert_no_cross_document_leakage(tiny, x, params)


@pytest.mark.parametrize("form", [
    pytest.param(megatron_copy, id="megatron-standin"),
    pytest.param(lambda p: VarlenBatch.build(p, p.total_tokens), id="VarlenBatch"),
])
def test_leaks_are_caught_with_every_metadata_form(form):
    x, params = row()
    for defect in ("backward", "padding-forward", "parameter-gradient"):
        assert leak_lines(DocCumsum(defect), x, form(params))


# ----------------------------------------------------------------- the negative control
class PerToken(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(D, D).double()

    def forward(self, hidden_states, packed_seq_params=None):
        return self.proj(hidden_states)


class ForwardOnlyMixing(DocCumsum):
    """Mixes tokens in the forward but no gradient crosses tokens (a detached running sum)."""

    def forward(self, hidden_states, packed_seq_params=None):
        _, segments = structure(packed_seq_params, hidden_states.shape[1])
        mixed = torch.cat([hidden_states[:, a:b].cumsum(1) for a, b in segments], 1)
        return self.proj(hidden_states) + mixed.detach()


def test_negative_control_refuses_a_module_that_cannot_leak():
    x, params = row()
    with pytest.raises(LeakageCheckInconclusive, match="could not have failed") as caught:
        assert_no_cross_document_leakage(PerToken(), x, params)
    assert "input changes another's output" in str(caught.value)


class MaskedExpSum(DocCumsum):
    """Exact, but in the shape of a chunked kernel: ``exp`` of the input summed through a
    block-diagonal 0 / 1 mask, so an overflow in one document (``0 * inf``) turns the others NaN."""

    def forward(self, hidden_states, packed_seq_params=None):
        t = hidden_states.shape[1]
        _, segments = structure(packed_seq_params, t)
        mask = torch.zeros(t, t, dtype=hidden_states.dtype)
        for a, b in segments:
            mask[a:b, a:b] = torch.ones(b - a, b - a).tril()
        return torch.einsum("ts,bsd->btd", mask, self.proj(hidden_states).exp()) * self.scale


def test_an_overflowing_perturbation_is_inconclusive_not_a_leak():
    x, params = row(torch.float32)
    module = MaskedExpSum().float()
    with pytest.raises(LeakageCheckInconclusive, match=r"not finite .* document 0 perturbed up to \+-1000.*"
                                                       r"pass a smaller scale="):
        assert_no_cross_document_leakage(module, x, params)
    assert assert_no_cross_document_leakage(module, x, params, scale=1.0) > 0     # exact at a sane scale


def test_negative_control_requires_the_gradient_probes_to_be_able_to_fail():
    """A forward that mixes is not enough: the output-gradient and parameter probes must each
    see a dependence without the metadata."""
    x, params = row()
    with pytest.raises(LeakageCheckInconclusive) as caught:
        assert_no_cross_document_leakage(ForwardOnlyMixing(), x, params)
    message = str(caught.value)
    assert "output gradient changes another's input gradient" in message
    assert "parameter-gradient contribution" in message and "input changes another's output" not in message
    assert assert_no_cross_document_leakage(ForwardOnlyMixing(), x, params, negative_control=False) > 0


class RecordingDocCumsum(DocCumsum):
    """:class:`DocCumsum` keeping every input it is called with (the probes' perturbations)."""

    def __init__(self):
        super().__init__()
        self.inputs = []

    def forward(self, x, packed_seq_params=None):
        self.inputs.append(x.detach().clone())
        return super().forward(x, packed_seq_params=packed_seq_params)


def test_the_leakage_check_perturbs_reproducibly_with_seed_0_by_default():
    x, params = row()
    seen = {}
    for name, kwargs in [("default", {}), ("seed=0", dict(seed=0)), ("seed=1", dict(seed=1))]:
        module = RecordingDocCumsum()
        assert_no_cross_document_leakage(module, x, params, **kwargs)
        seen[name] = module.inputs

    def same(a, b):
        return len(a) == len(b) and all(torch.equal(s, t) for s, t in zip(a, b))
    assert same(seen["default"], seen["seed=0"]), "the default perturbations are not those of seed=0"
    assert not same(seen["seed=0"], seen["seed=1"]), "the seed does not change the perturbations"


def test_one_document_followed_by_padding_is_inconclusive():
    x, params = layout([5], hidden=D, dtype=torch.float64, pad_to_multiple_of=8, tail=3)
    with pytest.raises(LeakageCheckInconclusive):
        assert_no_cross_document_leakage(DocCumsum(), x, params)


class DropMetadata(nn.Module):
    """A real mixer run without its metadata: the negative control of the probes themselves."""

    def __init__(self, mixer):
        super().__init__()
        self.mixer = mixer

    def forward(self, hidden_states, packed_seq_params=None):
        return self.mixer(hidden_states)


@pytest.mark.parametrize("name", [pytest.param("gdn", id="gdn"), pytest.param("mamba2", id="mamba2")])
def test_every_probe_fails_on_a_real_mixer_without_metadata(name):
    from mixers import GatedDeltaNetMixer, Mamba2Mixer
    torch.manual_seed(0)
    mixer = (GatedDeltaNetMixer(16, head_dim=8, num_heads=2, chunk_size=8) if name == "gdn"
             else Mamba2Mixer(16, head_dim=8, state_size=4, chunk_size=8))
    x, params = layout([5, 7, 3], hidden=16, pad_to_multiple_of=4, tail=1)
    assert assert_no_cross_document_leakage(mixer, x, params) == 2 * (3 + 4)
    lines = leak_lines(DropMetadata(mixer), x, params)
    assert "output gradient of document 1 -> document 0: input gradient" in lines
    assert any(line.startswith("input of document 0 -> document 1: output, input gradient") for line in lines)
    assert "input of document 0 -> the other documents: parameter-gradient contribution" in lines


# ----------------------------------------------------------------- packed == unpacked
class PackedOffset(DocCumsum):
    """Adds ``offset`` to the outputs only when packed (a packed-only numerical error)."""

    def __init__(self, offset):
        super().__init__()
        self.offset = offset

    def forward(self, hidden_states, packed_seq_params=None):
        out = super().forward(hidden_states, packed_seq_params)
        return out if packed_seq_params is None else out + self.offset * out.detach().abs().amax()


@pytest.mark.parametrize("dtype,offset", [
    pytest.param(torch.float64, 1e-8, id="fp64-1e-8"),
    pytest.param(torch.float32, 1e-3, id="fp32-1e-3"),
    # relative RMS errors of 6e-3 to 9e-3: over bf16's output limit (5e-3), under its gradient limit (1e-2)
    pytest.param(torch.bfloat16, 2e-3, id="bf16-2e-3-between-the-output-and-gradient-limits"),
])
def test_packed_equals_unpacked_holds_its_tolerance(dtype, offset):
    """An error 100x the fp64 limit of 1e-10 (fp32: 1e-5 relative) fails, and so does a bf16 output error
    that only the looser gradient limit would allow; a loosened table would pass them."""
    x, params = row(dtype)
    module = PackedOffset(offset).to(dtype)
    with pytest.raises(AssertionError, match="document 0 output"):
        assert_packed_equals_unpacked(module, x, params)
    assert_packed_equals_unpacked(PackedOffset(0.0).to(dtype), x, params)


class WithEmptyParameter(DocCumsum):
    """:class:`DocCumsum` holding a zero-size parameter (a bias of no channel), which gets an empty gradient."""

    def __init__(self):
        super().__init__()
        self.empty = nn.Parameter(torch.zeros(0))

    def forward(self, hidden_states, packed_seq_params=None):
        return super().forward(hidden_states, packed_seq_params) + self.empty.sum()


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.float64, id="fp64")])
def test_an_empty_gradient_has_no_error(dtype):
    """A zero-size parameter's gradient compares as equal (no NaN from an empty mean): the check
    passes, and the worst parameter-gradient error it returns is finite."""
    x, params = row(dtype)
    errors = assert_packed_equals_unpacked(WithEmptyParameter().to(dtype), x, params)
    assert math.isfinite(errors["param grad"])


@pytest.mark.parametrize("defect,what", [
    pytest.param("parameter-gradient", "grad of scale", id="parameter-gradient-only"),
    pytest.param("backward", "document 1 input grad", id="input-gradient-only"),
    pytest.param("forward", "document 1 output", id="forward"),
])
def test_packed_equals_unpacked_compares_every_gradient(defect, what):
    x, params = row()
    with pytest.raises(AssertionError, match="differs from per-document runs") as caught:
        assert_packed_equals_unpacked(DocCumsum(defect), x, params)
    failures = [line.strip() for line in str(caught.value).splitlines()[1:]]
    assert any(line.startswith(what) for line in failures), failures
    if defect != "forward":
        assert not any("output" in line for line in failures), failures
        assert_packed_equals_unpacked(DocCumsum(defect), x, params, check_grads=False)


# ----------------------------------------------------------------- the pieces
def test_document_spans_of_a_padded_layout_with_an_empty_document():
    params = PackedSeqParams.from_cu_seqlens([0, 3, 3, 8], cu_seqlens_padded=[0, 4, 6, 12], total_tokens=14)
    docs, pads = document_spans(params, 14)
    assert docs == [(0, 3), (6, 11)]
    assert pads == [(3, 4), (4, 6), (11, 12), (12, 14)]       # the empty document's slot is padding too
    assert document_spans(megatron_copy(params), 14) == (docs, pads)


def test_bitwise_equal_is_bitwise():
    one = torch.tensor([1.0], dtype=torch.float64)
    assert bitwise_equal(one, one.clone()) and not bitwise_equal(one, torch.nextafter(one, 2 * one))
    assert not bitwise_equal(torch.tensor([0.0]), torch.tensor([-0.0]))
    nan = torch.tensor([float("nan")])
    assert bitwise_equal(nan, nan.clone())
    assert not bitwise_equal(one, one.float()) and not bitwise_equal(one, one.repeat(2))


@pytest.mark.parametrize("call,error,match", [
    pytest.param(lambda x, p: assert_no_cross_document_leakage(PerToken(), x[0], p), ValueError,
                 r"one packed row \[1, T, D\]", id="leakage-2d-input"),
    pytest.param(lambda x, p: assert_no_cross_document_leakage(PerToken(), x, None), TypeError,
                 "packed_seq_params must be", id="leakage-no-metadata"),
    pytest.param(lambda x, p: document_spans(None, x.shape[1]), TypeError,
                 re.escape("packed_seq_params must be a PackedSeqParams, a Megatron-style PackedSeqParams or a "
                           "VarlenBatch describing the packed row, got None"), id="spans-no-metadata"),
    pytest.param(lambda x, p: assert_packed_equals_unpacked(PerToken(), x.numpy(), p), TypeError,
                 "hidden_states must be a torch.Tensor", id="packed-numpy-input"),
    pytest.param(lambda x, p: assert_no_cross_document_leakage(PerToken(), x[:, :5], PackedSeqParams.from_lengths([5])),
                 ValueError, "at least two documents", id="leakage-one-document"),
])
def test_bad_arguments(call, error, match):
    x, params = row()
    with pytest.raises(error, match=match):
        call(x, params)
