import random

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

import ssm_pack as sp


def test_first_fit_decreasing_small_case():
    plan = sp.plan_packs([5, 3, 7, 2, 4], max_tokens=10)
    assert plan.packs == ((2, 1), (0, 4), (3,))  # 7+3, 5+4, 2
    assert [plan.pack_tokens(i) for i in range(3)] == [10, 9, 2]


@given(st.lists(st.integers(0, 40), max_size=60), st.integers(40, 90), st.integers(1, 8))
def test_every_document_once_and_within_budget(lengths, budget, align):
    aligned = [(n + align - 1) // align * align for n in lengths]
    if any(a > budget for a in aligned):
        with pytest.raises(ValueError, match="max_tokens"):
            sp.plan_packs(lengths, budget, align_to=align)
        return
    plan = sp.plan_packs(lengths, budget, align_to=align)
    placed = sorted(d for pack in plan.packs for d in pack)
    assert placed == list(range(len(lengths)))
    assert all(plan.pack_tokens(i) <= budget for i in range(len(plan.packs)))
    # first-fit-decreasing never leaves two packs that could have been merged
    sizes = sorted(plan.pack_tokens(i) for i in range(len(plan.packs)))
    assert len(sizes) < 2 or sizes[0] + sizes[1] > budget or sizes[0] == 0


def test_padding_report_and_pack_metadata():
    rng = random.Random(0)
    lengths = [rng.randint(1, 512) for _ in range(200)]
    plan = sp.plan_packs(lengths, 2048, align_to=8)
    assert 0.0 <= plan.padding_fraction_packed < plan.padding_fraction_padded < 1.0
    assert plan.padding_removed > 0.5
    assert "packs of <= 2048" in plan.summary()
    params = plan.packed_seq_params(0)
    assert params.total_tokens == 2048 and params.lengths().tolist() == [lengths[d] for d in plan.packs[0]]
    assert all(int(n) % 8 == 0 for n in (params.cu_seqlens_q_padded[1:] - params.cu_seqlens_q_padded[:-1]))
    tight = plan.packed_seq_params(0, fixed_length=False)
    assert tight.total_tokens == plan.pack_tokens(0)


def test_twenty_thousand_documents_plan_quickly():
    rng = random.Random(1)
    plan = sp.plan_packs([rng.randint(1, 3000) for _ in range(20000)], 8192)
    assert sum(len(p) for p in plan.packs) == 20000


def test_planner_errors():
    with pytest.raises(ValueError, match="document 1 needs 16 tokens"):
        sp.plan_packs([3, 13], 12, align_to=8)
    with pytest.raises(ValueError, match="max_tokens must be >= 1"):
        sp.plan_packs([3], 0)
    with pytest.raises(ValueError, match="lengths must be >= 0"):
        sp.plan_packs([3, -1], 8)


# ------------------------------------------------------------------ PackPlan.assemble
LENGTHS = [5, 3, 7, 2, 4, 0, 9]


def _documents():
    return [list(range(100 * d + 1, 100 * d + 1 + n)) for d, n in enumerate(LENGTHS)]


def _padded(docs, width=12):
    out = torch.full((len(docs), width), -7, dtype=torch.int64)     # -7: must never be read
    for d, doc in enumerate(docs):
        out[d, :len(doc)] = torch.tensor(doc)
    return out


@pytest.mark.parametrize("fixed_length", [pytest.param(True, id="fixed-length"), pytest.param(False, id="tight")])
@pytest.mark.parametrize("form", [pytest.param("lists", id="lists"), pytest.param("padded", id="padded-tensor")])
def test_assemble_lays_tokens_out_where_the_metadata_says(form, fixed_length):
    plan = sp.plan_packs(LENGTHS, max_tokens=24, align_to=4)
    docs = _documents()
    given = docs if form == "lists" else _padded(docs)
    for i, pack in enumerate(plan.packs):
        out = plan.assemble(i, given, labels=given, loss_mask=[[1] * n for n in LENGTHS], fixed_length=fixed_length)
        params = out["packed_seq_params"]
        want = plan.packed_seq_params(i, fixed_length=fixed_length)
        assert torch.equal(params.cu_seqlens, want.cu_seqlens) and params.total_tokens == want.total_tokens
        total = 24 if fixed_length else plan.pack_tokens(i)
        assert out["input_ids"].shape == out["labels"].shape == out["position_ids"].shape == (1, total)
        real = torch.zeros(total, dtype=torch.bool)
        starts = params.cu_seqlens.tolist()
        for slot, d in enumerate(pack):                        # document d sits at its slot's start
            start, n = starts[slot], LENGTHS[d]
            assert out["input_ids"][0, start:start + n].tolist() == docs[d]
            assert out["labels"][0, start:start + n].tolist() == docs[d]
            assert out["position_ids"][0, start:start + n].tolist() == list(range(n))
            real[start:start + n] = True
        assert (out["input_ids"][0, ~real] == 0).all() and (out["labels"][0, ~real] == -100).all()
        assert out["loss_mask"][0].bool().tolist() == real.tolist()
        # the positions describe the same layout: restarts at every slot, and at a fixed-length tail
        from_positions = sp.PackedSeqParams.from_position_ids(out["position_ids"]).cu_seqlens_q.tolist()
        slots = [s for s, e in zip(starts, starts[1:]) if e > s] + [starts[-1]]
        assert from_positions == slots + ([total] if total > starts[-1] else [])


def test_assemble_keeps_given_positions_and_mrope_planes():
    plan = sp.plan_packs(LENGTHS, max_tokens=24, align_to=4)
    docs = _documents()
    mrope = torch.stack([_padded([[p + 10 * k for p in range(n)] for n in LENGTHS]) for k in range(3)])
    out = plan.assemble(0, docs, position_ids=mrope)
    starts = out["packed_seq_params"].cu_seqlens.tolist()
    assert out["position_ids"].shape == (3, 1, 24)
    d, start = plan.packs[0][0], starts[0]
    assert out["position_ids"][2, 0, start:start + LENGTHS[d]].tolist() == [p + 20 for p in range(LENGTHS[d])]
    assert out["labels"] is None and out["loss_mask"] is None


def test_assemble_refuses_documents_that_do_not_match_the_plan():
    plan = sp.plan_packs(LENGTHS, max_tokens=24, align_to=4)
    docs = _documents()
    with pytest.raises(ValueError, match="tokens holds 6 documents but the plan has 7"):
        plan.assemble(0, docs[:-1])
    wrong = list(docs)
    wrong[plan.packs[0][0]] = [1, 2]
    with pytest.raises(ValueError, match=rf"tokens\[{plan.packs[0][0]}\] has shape \(2,\) but the plan was made"):
        plan.assemble(0, wrong)
    with pytest.raises(ValueError, match="labels has 2 rows but the plan has 7 documents"):
        plan.assemble(0, docs, labels=_padded(docs)[:2])
    with pytest.raises(ValueError, match=r"i must be a pack index in \[0, 2\), got 2"):
        plan.assemble(2, docs)
    with pytest.raises(ValueError, match=r"i must be a pack index in \[0, 2\), got 5"):
        plan.packed_seq_params(5)
    with pytest.raises(TypeError, match="tokens must be a padded"):
        plan.assemble(0, "not documents")


@pytest.mark.parametrize("lengths", [pytest.param([4, 4], id="rows-full"), pytest.param([], id="no-documents")])
def test_no_padding_to_remove_reports_zero(lengths):
    plan = sp.plan_packs(lengths, 8)
    assert plan.padding_removed == 0.0
    assert plan.padding_fraction_padded == 0.0
    assert "0.0% of it removed" in plan.summary()
