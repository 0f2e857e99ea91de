import random

import pytest
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
