"""The masks of a patched Hugging Face model's attention: a bidirectional layer (``is_causal=False``)
stays bidirectional on packed batches, and an unpacked call of an ``eager`` model keeps the causal
and padding mask Hugging Face builds (the packed wrapper must only drop it for packed calls)."""

import copy

import pytest
import torch

from mixers.integrations.hf_attention import packed_attention, wrapped_name
from mixers.integrations.transformers import enable_packing
from ssm_pack import PackedSeqParams, VarlenBatch
from tests.mixers.integrations.hf_models import VOCAB, build, transformers
from tests.support.oracles import hf_attention_oracle, rel_rms

LENGTHS = [4, 9, 1, 6]


class _Layer(torch.nn.Module):
    def __init__(self, is_causal):
        super().__init__()
        self.is_causal = is_causal


def _oracle(q, k, v, scale, causal):
    return hf_attention_oracle(q, k, v, LENGTHS, scale, causal=causal)


@pytest.mark.parametrize("causal", [pytest.param(False, id="bidirectional"), pytest.param(True, id="causal")])
def test_packed_attention_follows_the_layer_s_is_causal(causal):
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    q, k, v = (torch.randn(1, h, t, 8, generator=g, dtype=torch.float64, requires_grad=True) for h in (4, 2, 2))
    params = VarlenBatch.build(PackedSeqParams.from_lengths(torch.tensor(LENGTHS)), t)
    out = packed_attention(_Layer(causal), q, k, v, params, scaling=0.4)[0]
    want = _oracle(q, k, v, 0.4, causal)
    assert float((out - want).detach().abs().max()) <= 1e-10
    grad = torch.randn(out.shape, generator=g, dtype=torch.float64)
    got_grads = torch.autograd.grad(out, (q, k, v), grad)
    want_grads = torch.autograd.grad(want, (q, k, v), grad)
    assert all(float((a - b).abs().max()) <= 1e-10 for a, b in zip(got_grads, want_grads))
    other = _oracle(q, k, v, 0.4, not causal)                    # negative control: the other mode differs
    assert float((out - other).detach().abs().max()) > 1e-3


def _attention_layers(model):
    return [m for m in model.modules() if type(m).__name__.endswith("Attention") and hasattr(m, "is_causal")]


def _packed_logits(model, docs):
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    with torch.no_grad():
        return model(**batch).logits[0]


@pytest.mark.parametrize("impl", [pytest.param("eager", id="eager"), pytest.param("sdpa", id="sdpa")])
@pytest.mark.parametrize("causal", [pytest.param(False, id="bidirectional"), pytest.param(True, id="causal")])
def test_a_bidirectional_layer_of_a_patched_model_sees_its_whole_document_only(monkeypatch, impl, causal):
    """Changing the last token of document 0 changes document 0's first output only when the
    attention layer is bidirectional (the causal case is the negative control), and never any
    other document's outputs."""
    model = enable_packing(build("bamba", monkeypatch, impl))
    layers = _attention_layers(model)
    assert layers
    for layer in layers:
        layer.is_causal = causal
    g = torch.Generator().manual_seed(2)
    docs = [torch.randint(1, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]
    edited = copy.deepcopy(docs)
    edited[0][-1] = (docs[0][-1] + 1) % VOCAB
    base, changed = _packed_logits(model, docs), _packed_logits(model, edited)
    first_moved = float((base[0] - changed[0]).abs().max()) > 1e-6
    assert first_moved is (not causal)
    assert torch.equal(base[LENGTHS[0]:], changed[LENGTHS[0]:])


def _padded_batch():
    """Two right-padded rows (lengths 11 and 6) of an unpacked call."""
    g = torch.Generator().manual_seed(3)
    ids = torch.randint(1, VOCAB, (2, 11), generator=g)
    mask = torch.ones(2, 11, dtype=torch.long)
    mask[1, 6:] = 0
    return ids, mask


def _unpacked_eager_check(model, reference):
    ids, mask = _padded_batch()
    with torch.no_grad():
        got = model(input_ids=ids, attention_mask=mask).logits
        want = reference(input_ids=ids, attention_mask=mask).logits
        single = model(input_ids=ids[:1]).logits                          # no mask given: causal still
        single_want = reference(input_ids=ids[:1]).logits
        other = ids.clone()
        other[1, 6:] = (ids[1, 6:] + 5) % VOCAB                           # new ids under the padding only
        repadded = model(input_ids=other, attention_mask=mask).logits
    keep = mask.bool()
    return (rel_rms(got[keep], want[keep]) <= 1e-5 and rel_rms(single, single_want) <= 1e-5
            and torch.equal(repadded[1, :6], got[1, :6]))


@pytest.mark.parametrize("name", [pytest.param("bamba", id="bamba"), pytest.param("qwen3_next", id="qwen3_next")])
def test_an_unpacked_eager_call_keeps_hugging_face_s_causal_and_padding_mask(monkeypatch, name):
    reference = build(name, monkeypatch, "eager")
    model = enable_packing(copy.deepcopy(reference))
    assert model.config._attn_implementation == wrapped_name("eager")
    assert _unpacked_eager_check(model, reference)
    # negative control: the wrapped implementation's mask function handing out no mask is seen
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS
    monkeypatch.setitem(ALL_MASK_ATTENTION_FUNCTIONS._global_mapping, wrapped_name("eager"), lambda *a, **k: None)
    assert not _unpacked_eager_check(model, reference)
