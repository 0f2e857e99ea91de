"""Metadata that disagrees with its input, bad labels and arguments, out-of-order carried packs:
each refused by name before anything runs or changes; a loss with no target is zero, never NaN."""

import pytest
import torch

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import PackedSeqParams, pack_stream
from tests.mixers.inference.common import same, snapshot

SMALL = {"G": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
VOCAB = 32


def _model():
    torch.manual_seed(0)
    return HybridLM(VOCAB, 32, "GA", mixer_overrides=SMALL).double()


def _ids(t=6):
    return torch.randint(0, VOCAB, (1, t), generator=torch.Generator().manual_seed(3))


CU = torch.tensor([0, 2, 6], dtype=torch.int32)
REFUSED = [
    pytest.param({"packed_seq_params": PackedSeqParams.from_lengths([2, 2])}, ValueError,
                 "total_tokens=4 but the input has 6 tokens", id="params-of-4-tokens"),
    pytest.param({"position_ids": torch.tensor([[0, 1, 0, 1]])}, ValueError,
                 r"cover different numbers of tokens.*'position_ids': 4", id="position-ids-short"),
    pytest.param({"position_ids": torch.tensor([[0, 1, 2, 0, 1, 2]]), "cu_seq_lens_q": CU, "cu_seq_lens_k": CU},
                 ValueError, r"position_ids'\] and batch\['cu_seq_lens_q'\] describe different documents",
                 id="cu-and-positions-disagree"),
    pytest.param({"seq_idx": torch.tensor([[0, 0, 0, 1, 1, 1]], dtype=torch.int32), "cu_seq_lens_q": CU},
                 ValueError, r"seq_idx'\] and batch\['cu_seq_lens_q'\] describe different documents",
                 id="cu-and-seq-idx-disagree"),
    pytest.param({"labels": torch.full((1, 6), 99)}, ValueError, r"labels\[0, 0\]=99 is outside the vocabulary",
                 id="labels-out-of-range"),
    pytest.param({"labels": torch.zeros(1, 6)}, TypeError, "labels must hold integer token ids", id="labels-float"),
]


@pytest.mark.parametrize("kwargs,error,match", REFUSED)
def test_metadata_or_labels_that_disagree_with_the_input_are_refused(kwargs, error, match):
    model = _model()
    with pytest.raises(error, match=match):
        model(_ids(), **kwargs)


AGREEING = [
    pytest.param({"packed_seq_params": PackedSeqParams.from_lengths([2, 2], total_tokens=6)}, id="params-with-tail"),
    pytest.param({"position_ids": torch.tensor([[0, 1, 0, 1, 2, 3]])}, id="positions"),
    pytest.param({"position_ids": torch.tensor([[0, 1, 0, 1, 2, 3]]), "cu_seq_lens_q": CU, "cu_seq_lens_k": CU},
                 id="cu-and-positions"),
    pytest.param({"seq_idx": torch.tensor([[0, 0, 1, 1, 1, 1]], dtype=torch.int32), "cu_seq_lens_q": CU},
                 id="cu-and-seq-idx"),
    pytest.param({"labels": torch.tensor([[-100, 1, 2, 3, -100, 31]])}, id="labels-with-ignore"),
]


@pytest.mark.parametrize("kwargs", AGREEING)
def test_agreeing_metadata_runs(kwargs):
    """Negative control for the refusals above."""
    out = _model()(_ids(), **kwargs)
    assert out["logits"].shape == (1, 6, VOCAB)


@pytest.mark.parametrize("make,error,match", [
    pytest.param(lambda: HybridLM(vocab_size=-1, hidden_size=32, pattern="G"), ValueError,
                 "vocab_size must be >= 1, got -1", id="vocab-negative"),
    pytest.param(lambda: HybridLM(vocab_size=16, hidden_size=0, pattern="G"), ValueError,
                 "hidden_size must be >= 1, got 0", id="hidden-zero"),
    pytest.param(lambda: HybridLM(vocab_size=2.5, pattern="G"), TypeError, "vocab_size must be an int",
                 id="vocab-float"),
    pytest.param(lambda: _model()(torch.zeros(1, 0, dtype=torch.long)), ValueError,
                 r"input_ids must hold at least one token, got shape \(1, 0\)", id="empty-input"),
    pytest.param(lambda: PackedSeqParams.from_lengths([2**31 - 1, 5]), ValueError,
                 r"lengths \(sum of 2 documents\) reaches 2147483652 tokens, past int32", id="lengths-past-int32"),
    pytest.param(lambda: PackedSeqParams.from_cu_seqlens(torch.tensor([0, 2**31 + 4])), ValueError,
                 r"cu_seqlens\[-1\] reaches 2147483652 tokens, past int32", id="cu-past-int32"),
])
def test_bad_arguments_are_refused_by_name(make, error, match):
    with pytest.raises(error, match=match):
        make()


def _grads(model):
    return [p.grad for p in model.parameters() if p.grad is not None]


def test_no_target_gives_zero_loss_and_zero_gradient():
    model = _model()
    out = model(_ids(), labels=torch.full((1, 6), -100))
    out["loss"].backward()
    assert float(out["loss"]) == 0.0 and all(bool((g == 0).all()) for g in _grads(model))
    model.zero_grad()
    control = model(_ids(), labels=_ids())["loss"]          # negative control: targets give a loss and gradients
    control.backward()
    assert float(control) > 0 and any(bool((g != 0).any()) for g in _grads(model))


def test_no_target_in_one_packed_document_is_zero_too():
    model = _model()
    params = PackedSeqParams.from_lengths([1, 1, 1, 1, 1, 1])          # every target crosses a boundary
    out = model(_ids(), packed_seq_params=params, labels=_ids())
    assert float(out["loss"]) == 0.0 and not torch.isnan(out["loss"])


def test_context_parallel_share_with_no_target_is_zero():
    from types import SimpleNamespace

    import torch.distributed as dist

    from mixers.model.cp_loss import mean_share
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        run = SimpleNamespace(group=None, layout=SimpleNamespace(size=1))
        logits = torch.randn(5, 7, dtype=torch.float64, requires_grad=True)
        targets = torch.full((5,), -100)
        total = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
        share = mean_share(run, total, targets != -100)
        share.backward()
        assert float(share) == 0.0 and bool((logits.grad == 0).all())
        counted = mean_share(run, torch.tensor(6.0, dtype=torch.float64), torch.ones(3, dtype=torch.bool))
        assert float(counted) == 2.0                                    # negative control: the mean
        one = mean_share(run, torch.tensor(5.0, dtype=torch.float64), torch.tensor([False, True, False]))
        assert float(one) == 5.0                                        # one counted target: its loss, whole
    finally:
        dist.destroy_process_group()


# ----------------------------------------------------------------- carried states
def _carry_setup():
    model = _model()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, VOCAB, (n,), generator=g) for n in (5, 40, 3)]
    packs = list(pack_stream(docs, 12))
    carried = CarriedStates(model, max_documents=4, max_document_tokens=48)
    return packs, carried


@pytest.mark.parametrize("order,bad", [
    pytest.param([0, 1, 1], 2, id="same-pack-twice"),
    pytest.param([0, 2], 1, id="skipped-pack"),
])
def test_carried_pieces_must_follow_each_other(order, bad):
    packs, carried = _carry_setup()
    long_packs = [i for i, p in enumerate(packs) if 1 in p["documents"].tolist()]
    assert len(long_packs) >= 3 and all(packs[i]["continues"] for i in long_packs[1:3])
    feed = [long_packs[i] for i in order]
    for i in feed[:bad]:
        carried(packs[i])
    before = (snapshot(carried.cache), carried.carried)
    with pytest.raises(ValueError, match=r"the pack continues document 1 from token \d+ but the carried state is "
                                         r"document 1 from token \d+"):
        carried(packs[feed[bad]])
    assert carried.carried == before[1] and same(before[0], snapshot(carried.cache))


def test_carried_pieces_in_order_are_accepted():
    """Negative control: every pack once, in order."""
    packs, carried = _carry_setup()
    losses = [carried(pack)["loss"] for pack in packs]
    assert all(torch.isfinite(loss) for loss in losses)


def test_a_padding_pack_carries_a_zero_loss():
    packs, carried = _carry_setup()
    empty = {**packs[0], "targets": torch.full_like(packs[0]["targets"], -100)}
    assert float(carried(empty)["loss"]) == 0.0


def test_a_generator_of_another_type_is_refused_before_prefill():
    model = _model().eval()
    cache = model.allocate_inference_cache(2, 16)
    before = snapshot(cache)
    with pytest.raises(TypeError, match="generator must be a torch.Generator .*got int 5"):
        model.generate([[1, 2]], max_new_tokens=2, temperature=1.0, generator=5, cache=cache)
    assert same(before, snapshot(cache))
    out = model.generate([[1, 2]], max_new_tokens=2, temperature=1.0, generator=torch.Generator().manual_seed(0))
    assert len(out[0]) == 2                                            # negative control
