"""``VarlenBatch``: every lazily derived field against a per-token recompute in plain Python,
tight and padded layouts, Megatron-style params (duck-typed), ``materialize`` and each refusal."""

from __future__ import annotations

import re

import pytest
import torch

from ssm_pack import PackedSeqParams, VarlenBatch
from tests.support.megatron_standin import MegatronPackedSeqParams

LAZY = ("max_seqlen", "seq_idx", "cu_seqlens_long", "position_ids", "segments", "covering_cu_seqlens",
        "nonempty_layout", "real_tokens")


def oracle(physical: list[int], real: list[int], total: int) -> dict:
    """Every fact of a packed row, token by token: ``physical`` / ``real`` boundaries ``[N+1]``."""
    n = len(physical) - 1
    doc, pos, is_real = [], [], []
    for t in range(total):
        # the last document starting at or before t (so empty documents sharing its start are skipped)
        d = max(i for i in range(n) if physical[i] <= t) if t < physical[-1] else n
        start = physical[d] if d < n else physical[-1]
        doc.append(d)
        pos.append(t - start)
        is_real.append(d < n and t - start < real[d + 1] - real[d])
    segments = [(physical[i], physical[i + 1] - physical[i]) for i in range(n) if physical[i + 1] > physical[i]]
    if total > physical[-1]:
        segments.append((physical[-1], total - physical[-1]))
    covering = physical + [total]
    lengths = [covering[i + 1] - covering[i] for i in range(n + 1)]
    order = [i for i in range(n + 1) if lengths[i] > 0] + [i for i in range(n + 1) if lengths[i] == 0]
    nonempty_cu = [0]
    for i in order:
        nonempty_cu.append(nonempty_cu[-1] + lengths[i])
    return dict(seq_idx=[doc], position_ids=[pos], real_tokens=[is_real], segments=segments,
                max_seqlen=max([length for _, length in segments], default=0), covering=covering,
                nonempty=(nonempty_cu, order))


def _params(kind: str):
    """``(params or boundaries, total_tokens, physical, real)`` of each layout under test."""
    if kind == "tight":
        return PackedSeqParams.from_lengths([3, 1, 5]), 9, [0, 3, 4, 9], [0, 3, 4, 9]
    if kind == "tight-tail-empty":
        return PackedSeqParams.from_lengths([2, 0, 4, 0], total_tokens=9), 9, [0, 2, 2, 6, 6], [0, 2, 2, 6, 6]
    if kind == "padded":
        return (PackedSeqParams.from_lengths([3, 1, 5], pad_to_multiple_of=4), 16, [0, 4, 8, 16],
                [0, 3, 4, 9])
    if kind == "padded-tail":
        return (PackedSeqParams.from_lengths([5, 0, 2], pad_to_multiple_of=4, total_tokens=15), 15,
                [0, 8, 8, 12], [0, 5, 5, 7])
    if kind == "megatron-padded":
        real, padded = [0, 3, 4, 9], [0, 4, 8, 12]
        t = [torch.tensor(v, dtype=torch.int32) for v in (real, padded)]
        return (MegatronPackedSeqParams(qkv_format="thd", cu_seqlens_q=t[0], cu_seqlens_kv=t[0],
                                        cu_seqlens_q_padded=t[1], cu_seqlens_kv_padded=t[1], max_seqlen_q=4,
                                        max_seqlen_kv=4), 13, padded, real)
    if kind == "bare-list":
        return [0, 1, 1, 4], 9, [0, 1, 1, 4], [0, 1, 1, 4]              # the tail is the longest segment
    if kind == "no-documents":
        return PackedSeqParams.from_lengths([], total_tokens=0), 0, [0], [0]      # cu_seqlens of one entry
    assert kind == "zero-tokens"
    return PackedSeqParams.from_lengths([0], total_tokens=0), 0, [0, 0], [0, 0]


KINDS = [pytest.param(k, id=k) for k in ("tight", "tight-tail-empty", "padded", "padded-tail", "megatron-padded",
                                         "bare-list", "no-documents", "zero-tokens")]


@pytest.mark.parametrize("kind", KINDS)
def test_every_lazy_field_equals_the_per_token_recompute(kind):
    params, total, physical, real = _params(kind)
    batch = VarlenBatch.build(params, total)
    want = oracle(physical, real, total)
    assert batch.total_tokens == total and batch.num_docs == len(physical) - 1
    assert batch.cu_seqlens.dtype == torch.int32 and batch.cu_seqlens.tolist() == physical
    assert batch.real_cu_seqlens.dtype == torch.int32 and batch.real_cu_seqlens.tolist() == real
    assert batch.cu_seqlens_long.dtype == torch.int64 and batch.cu_seqlens_long.tolist() == physical
    assert batch.seq_idx.dtype == torch.int32 and batch.seq_idx.is_contiguous()
    assert batch.seq_idx.tolist() == want["seq_idx"]
    assert batch.position_ids.tolist() == want["position_ids"]
    assert batch.real_tokens.dtype == torch.bool and batch.real_tokens.tolist() == want["real_tokens"]
    assert batch.max_seqlen == want["max_seqlen"]
    assert batch.covering_cu_seqlens.tolist() == want["covering"]
    cu, order = batch.nonempty_layout
    assert (cu.tolist(), order.tolist()) == want["nonempty"]
    seg = batch.segments
    assert list(zip(seg.starts.tolist(), seg.lengths.tolist())) == want["segments"]
    assert seg.seg_id.shape == (1, total)
    flat = [i for i, (start, length) in enumerate(want["segments"]) for _ in range(length)]
    assert seg.seg_id[0].tolist() == flat


def test_padded_layout_reads_the_padded_boundaries_and_keeps_the_real_ones():
    params = PackedSeqParams.from_lengths([3, 1, 5], pad_to_multiple_of=4)
    batch = VarlenBatch.build(params, 16)
    assert batch.cu_seqlens.tolist() == [0, 4, 8, 16] and batch.real_cu_seqlens.tolist() == [0, 3, 4, 9]
    # negative control: the tight view of the same documents differs in every derived field that sees padding
    tight = VarlenBatch.build(params.cu_seqlens_q, 16)
    assert tight.seq_idx.tolist() != batch.seq_idx.tolist()
    assert tight.real_tokens.tolist() != batch.real_tokens.tolist()


def test_materialize_derives_every_field_up_front_with_the_lazy_values():
    params = PackedSeqParams.from_lengths([5, 0, 2], pad_to_multiple_of=4, total_tokens=15)
    lazy = VarlenBatch.build(params, 15)
    assert not any(name in vars(lazy) for name in LAZY)
    eager = VarlenBatch.build(params, 15)
    assert eager.materialize() is eager
    assert all(name in vars(eager) for name in LAZY), [n for n in LAZY if n not in vars(eager)]
    for name in LAZY:
        a, b = getattr(eager, name), getattr(lazy, name)
        if name == "segments":
            assert all(torch.equal(getattr(a, f), getattr(b, f)) for f in ("seg_id", "starts", "lengths"))
        elif name == "nonempty_layout":
            assert all(torch.equal(x, y) for x, y in zip(a, b))
        elif isinstance(a, torch.Tensor):
            assert torch.equal(a, b), name
        else:
            assert a == b, name


def test_a_seq_idx_in_the_params_is_used_as_given(monkeypatch):
    """ssm-pack's params carry a checked seq_idx: the batch hands that tensor on, it derives none."""
    import ssm_pack.varlen as varlen_module
    calls = []
    derive = varlen_module.seq_idx_from_cu_seqlens
    monkeypatch.setattr(varlen_module, "seq_idx_from_cu_seqlens", lambda *a, **k: calls.append(a) or derive(*a, **k))
    params = PackedSeqParams.from_lengths([2, 0, 3], total_tokens=7)
    batch = VarlenBatch.build(params, 7)
    assert batch.seq_idx.data_ptr() == params.seq_idx.data_ptr() and calls == []
    assert batch.seq_idx.tolist() == [[0, 0, 2, 2, 2, 3, 3]]
    # negative control: bare boundaries carry none, so the batch derives it (once)
    bare = VarlenBatch.build([0, 2, 2, 5], 7)
    assert bare.seq_idx.tolist() == [[0, 0, 2, 2, 2, 3, 3]] and len(calls) == 1


def test_unvalidated_params_keep_a_given_max_seqlen_of_zero(monkeypatch):
    """``validate=False`` reads no boundary value: a given ``max_seqlen_q`` is the answer, 0 (every document
    empty) included, even though the boundaries (all empty, a 4-token tail) would measure 4."""
    import ssm_pack.varlen as varlen_module
    monkeypatch.setattr(varlen_module, "_longest", lambda *a: pytest.fail("read the boundaries"))
    cu = torch.tensor([0, 0, 0], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=0, total_tokens=4, validate=False)
    assert VarlenBatch.build(params, 4).max_seqlen == 0
    # negative control: not given, it is read from the boundaries (the tail counts)
    monkeypatch.undo()
    unknown = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, total_tokens=4, validate=False)
    assert VarlenBatch.build(unknown, 4).max_seqlen == 4


@pytest.mark.parametrize("given, total, error", [
    pytest.param(0, 5, "max_seqlen_q=0 is shorter than the longest segment of this row (3 tokens", id="zero"),
    pytest.param(3, 9, "max_seqlen_q=3 is shorter than the longest segment of this row (4 tokens", id="tail-of-4"),
    pytest.param(2, 5, "max_seqlen_q=2 is shorter than the longest segment of this row (3 tokens", id="a-document"),
    pytest.param(4, 9, None, id="covers-the-tail"),
    pytest.param(9, 9, None, id="an-upper-bound"),
])
def test_materialize_checks_an_unvalidated_max_seqlen_against_the_tail(given, total, error):
    """``validate=False`` trusts a given ``max_seqlen_q`` until :meth:`materialize` reads the boundaries:
    a value below the longest segment (documents [2, 3], the tail ``total - 5`` tokens) is refused
    there, before a kernel sized by it would leave rows unwritten; validated params (which refuse a
    value below the longest document) measure it, the tail included."""
    cu = torch.tensor([0, 2, 5], dtype=torch.int32)
    params = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=given, total_tokens=total,
                             validate=False)
    batch = VarlenBatch.build(params, total)
    assert batch.max_seqlen == given                  # nothing is read at build time
    if error is None:
        assert batch.materialize() is batch and batch.max_seqlen == given
    else:
        with pytest.raises(ValueError, match=re.escape(error)):
            batch.materialize()
    checked = PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, max_seqlen_q=max(given, 3), total_tokens=total)
    assert VarlenBatch.build(checked, total).materialize().max_seqlen == max(3, total - 5)


@pytest.mark.parametrize("lengths, total, want", [
    pytest.param([2, 0, 3], 8, [0, 2, 5, 8, 8], id="empty-document-and-tail"),
    pytest.param([0, 4, 0], 4, [0, 4, 4, 4, 4], id="empty-documents-no-tail"),
])
def test_host_nonempty_cu_comes_from_the_host_boundaries(lengths, total, want):
    """Host boundaries, tokens elsewhere (``meta`` here: no value can be read there): fla's
    ``cu_seqlens_cpu`` is ``nonempty_layout``'s ``cu``, built from the host copy."""
    params = PackedSeqParams.from_lengths(lengths, total_tokens=total)
    batch = VarlenBatch.build(params, total, device="meta")
    assert batch.host_cu_seqlens is not None and batch.device.type == "meta"
    host = batch.host_nonempty_cu
    assert host.device.type == "cpu" and host.dtype == torch.int64 and host.tolist() == want
    on_host = VarlenBatch.build(params, total)                       # the same row on the host, read directly
    assert on_host.host_cu_seqlens is None and on_host.host_nonempty_cu.tolist() == want
    assert on_host.nonempty_layout[0].tolist() == want


def test_a_varlen_batch_passes_through_when_it_matches():
    batch = VarlenBatch.build(PackedSeqParams.from_lengths([3, 4]), 7)
    assert VarlenBatch.build(batch, 7) is batch
    assert VarlenBatch.build(batch, 7, device="cpu") is batch
    with pytest.raises(ValueError, match="describes 7 tokens but the input has 8"):
        VarlenBatch.build(batch, 8)
    with pytest.raises(ValueError, match="lives on cpu but the input on meta"):
        VarlenBatch.build(batch, 7, device="meta")


# ---- foreign (Megatron-style) params are validated like ours ---------------------------------------

def _megatron(**fields):
    t = {k: torch.tensor(v, dtype=torch.int32) for k, v in fields.items()}
    return MegatronPackedSeqParams(qkv_format="thd", **t)


@pytest.mark.parametrize("fields, message", [
    pytest.param(dict(cu_seqlens_q=[0, 5, 3, 8], cu_seqlens_kv=[0, 5, 3, 8]),
                 r"packed_seq_params.cu_seqlens_q must be non-decreasing, got 5 then 3", id="q-decreases"),
    pytest.param(dict(cu_seqlens_q=[0, 2, 4], cu_seqlens_q_padded=[0, 4, 2]),
                 r"packed_seq_params.cu_seqlens_q_padded must be non-decreasing, got 4 then 2", id="padded-decreases"),
    pytest.param(dict(cu_seqlens_q=[2, 4, 8]), r"packed_seq_params.cu_seqlens_q must start at 0", id="q-not-at-0"),
    pytest.param(dict(cu_seqlens_q=[0, 4, 8], cu_seqlens_kv=[0, 3, 8]), r"cu_seqlens_kv differs from cu_seqlens_q",
                 id="kv-differs"),
    pytest.param(dict(cu_seqlens_q=[0, 4, 12]), r"cu_seqlens\[-1\]=12 is beyond the 8 tokens", id="past-the-row"),
])
def test_foreign_params_with_bad_boundaries_are_refused(fields, message):
    with pytest.raises(ValueError, match=message):
        VarlenBatch.build(_megatron(**fields), 8)


def test_foreign_params_with_good_boundaries_build():
    """Negative control for the refusals above: the same fields, well formed, build."""
    batch = VarlenBatch.build(_megatron(cu_seqlens_q=[0, 3, 5, 8], cu_seqlens_kv=[0, 3, 5, 8]), 8)
    assert batch.seq_idx.tolist() == [[0, 0, 0, 1, 1, 2, 2, 2]]


def test_foreign_params_without_cu_seqlens_q_are_refused():
    with pytest.raises(ValueError, match="packed_seq_params.cu_seqlens_q is None"):
        VarlenBatch.build(MegatronPackedSeqParams(qkv_format="thd"), 8)


# ---- other refusals ---------------------------------------------------------------------------------

@pytest.mark.parametrize("params, total, error, message", [
    pytest.param(None, 4, TypeError, "packed_seq_params must be a PackedSeqParams, a VarlenBatch or cu_seqlens, "
                 "got None", id="none"),
    pytest.param("0,4", 4, TypeError, "packed_seq_params must be a PackedSeqParams", id="string"),
    pytest.param([0, 3, 2], 4, ValueError, "cu_seqlens must be non-decreasing, got 3 then 2", id="list-decreases"),
    pytest.param(torch.tensor([1, 4]), 4, ValueError, "cu_seqlens must start at 0", id="tensor-not-at-0"),
    pytest.param([0, 5], 4, ValueError, r"cu_seqlens\[-1\]=5 is beyond the 4 tokens", id="past-the-row"),
    pytest.param([0, 4], -1, ValueError, "total_tokens", id="negative-tokens"),
    pytest.param([0, 4], 4.0, TypeError, "total_tokens", id="float-tokens"),
    pytest.param(torch.tensor([0.0, 4.0]), 4, TypeError, "cu_seqlens must have an integer dtype",
                 id="float-boundaries"),
])
def test_bad_input_is_refused_by_name(params, total, error, message):
    with pytest.raises(error, match=message):
        VarlenBatch.build(params, total)
