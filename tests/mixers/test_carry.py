"""CarriedStates: a document split across packs by pack_stream(split_long="carry") runs as in one row."""

import pytest
import torch

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import PackedSeqParams, pack_stream

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
LONG = 1          # the source index of the long document below


def _setup(pattern):
    torch.manual_seed(0)
    model = HybridLM(64, 32, pattern, mixer_overrides=SMALL).double()
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in (9, 70, 5, 12)]
    packs = list(pack_stream(docs, 24, align_to=4))
    return model, docs, packs


def _whole(model, doc):
    return model(doc.unsqueeze(0), packed_seq_params=PackedSeqParams.from_lengths([doc.shape[0]]))["logits"][0]


def _long_logits(packs, outputs):
    """The long document's logits, piece by piece in order, read at the packs' boundaries."""
    rows = []
    for pack, out in zip(packs, outputs):
        docs = pack["documents"].tolist()
        if LONG in docs:
            i = docs.index(LONG)
            start = int(pack["packed_seq_params"].cu_seqlens[i])
            length = int(pack["packed_seq_params"].lengths()[i])
            rows.append(out["logits"][0, start:start + length])
    return torch.cat(rows)


@pytest.mark.parametrize("letter", [pytest.param(c, id=c) for c in "MGKPA"])
def test_carried_forward_equals_the_whole_document_in_one_row(letter):
    model, docs, packs = _setup(letter)
    assert sum(LONG in p["documents"].tolist() for p in packs) >= 3                 # split across >= 3 packs
    carry = CarriedStates(model, max_documents=8, max_document_tokens=80)
    outputs = []
    for pack in packs:
        out = carry(pack)
        out["loss"].backward()                                                      # TBPTT: each step alone
        outputs.append({"logits": out["logits"].detach()})
    got = _long_logits(packs, outputs)
    want = _whole(model, docs[LONG]).detach()
    assert got.shape == want.shape
    assert (got - want).abs().max() <= 1e-10
    # negative control: the same packs without the carry start every piece from zero
    plain = [{"logits": model(p["input_ids"], packed_seq_params=p["packed_seq_params"])["logits"].detach()}
             for p in packs]
    assert (_long_logits(packs, plain) - want).abs().max() > 1e-6


def test_loss_counts_the_target_across_the_cut_and_gradients_stop_there():
    model, docs, packs = _setup("MA")
    carry = CarriedStates(model, max_documents=8, max_document_tokens=80)
    first = next(i for i, p in enumerate(packs) if p["continued"])
    for pack in packs[:first]:
        carry(pack)
    pack = packs[first]
    embed = model.embed.weight
    out = carry(pack)
    out["loss"].backward()
    before = embed.grad.clone()
    embed.grad = None
    follow = carry(packs[first + 1])
    assert follow["loss"].requires_grad
    follow["loss"].backward()                 # a second backward works: the carried states are detached
    assert torch.isfinite(before).all() and torch.isfinite(embed.grad).all()
    params = pack["packed_seq_params"]
    offset, length = int(pack["offsets"][-1]), int(params.lengths()[-1])
    last = int(params.cu_seqlens[-2]) + length - 1                                  # the piece's last token
    assert int(pack["targets"][0, last]) == int(docs[LONG][offset + length])        # predicts across the cut


def test_packs_out_of_order_are_refused():
    model, _, packs = _setup("G")
    carry = CarriedStates(model, max_documents=8, max_document_tokens=80)
    later = next(p for p in packs if p["continues"])
    with pytest.raises(ValueError, match=r"continues document 1 from token \d+ but the carried state is none"):
        carry(later)
    with pytest.raises(ValueError, match="max_documents must be an int >= 1, got 0"):
        CarriedStates(model, max_documents=0, max_document_tokens=80)


@pytest.mark.parametrize("align_to", [pytest.param(1, id="align1"), pytest.param(8, id="align8")])
def test_labels_and_targets_give_the_same_loss(align_to):
    """HybridLM shifts ``labels`` itself; the pack's ``targets`` are that shift done already."""
    torch.manual_seed(0)
    model = HybridLM(64, 32, "GA", mixer_overrides=SMALL).double()
    docs = [torch.randint(0, 64, (n,)) for n in (9, 17, 5, 12, 1)]
    (pack,) = list(pack_stream(docs, 128, align_to=align_to))
    out = model(pack["input_ids"], pack["packed_seq_params"], labels=pack["labels"])
    logits = out["logits"][0]
    direct = torch.nn.functional.cross_entropy(logits, pack["targets"][0], ignore_index=-100)
    assert (out["loss"] - direct).abs() <= 1e-12
    assert int((pack["targets"] != -100).sum()) == sum(len(d) - 1 for d in docs)
