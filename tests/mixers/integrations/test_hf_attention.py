"""The packed attention function enable_packing registers, against a dense per-document oracle:
grouped heads, MLA's value head narrower than the query head, Hugging Face's sliding window; and
its refusals."""

import pytest
import torch

from mixers.integrations.hf_attention import packed_attention
from ssm_pack import PackedSeqParams, VarlenBatch
from tests.support.oracles import hf_attention_oracle

LENGTHS = [3, 9, 1, 7]


class _Layer(torch.nn.Module):
    is_causal = True


def _oracle(q, k, v, scale, window):
    return hf_attention_oracle(q, k, v, LENGTHS, scale, window=window)


def _inputs(hq=4, hk=2, d=8, dv=8):
    g = torch.Generator().manual_seed(0)
    t = sum(LENGTHS)
    return (torch.randn(1, hq, t, d, generator=g, dtype=torch.float64),
            torch.randn(1, hk, t, d, generator=g, dtype=torch.float64),
            torch.randn(1, hk, t, dv, generator=g, dtype=torch.float64))


def _params():
    return VarlenBatch.build(PackedSeqParams.from_lengths(torch.tensor(LENGTHS)), sum(LENGTHS))


@pytest.mark.parametrize(("dv", "window"), [pytest.param(8, None, id="plain"), pytest.param(5, None, id="mla"),
                                            pytest.param(8, 3, id="sliding_window")])
def test_packed_attention_equals_each_document_alone(dv, window):
    q, k, v = _inputs(dv=dv)
    out, weights = packed_attention(_Layer(), q, k, v, _params(), scaling=0.3, sliding_window=window)
    assert weights is None and out.shape == (1, sum(LENGTHS), 4, dv)
    want = _oracle(q, k, v, 0.3, window)
    assert float((out - want).abs().max()) <= 1e-10
    whole = VarlenBatch.build(PackedSeqParams.from_lengths(torch.tensor([sum(LENGTHS)])), sum(LENGTHS))
    leak = packed_attention(_Layer(), q, k, v, whole, scaling=0.3, sliding_window=window)[0]
    assert float((leak - want).abs().max()) > 1e-2               # negative control: one document


@pytest.mark.parametrize(("kwargs", "match"), [
    pytest.param({"dropout": 0.1}, "attention_dropout", id="dropout"),
    pytest.param({"softcap": 30.0}, "softcap", id="softcap"),
    pytest.param({"s_aux": torch.zeros(4)}, "s_aux", id="sinks")])
def test_options_packed_attention_lacks_are_refused(kwargs, match):
    q, k, v = _inputs()
    with pytest.raises(ValueError, match=match):
        packed_attention(_Layer(), q, k, v, _params(), **kwargs)


def test_keys_from_an_earlier_cache_are_refused():
    q, k, v = _inputs()
    k, v = torch.cat([k, k], 2), torch.cat([v, v], 2)
    with pytest.raises(ValueError, match="without past_key_values"):
        packed_attention(_Layer(), q, k, v, _params())


@pytest.mark.parametrize("dv", [pytest.param(8, id="plain"), pytest.param(12, id="mla-wider-values")])
def test_without_scaling_the_scale_is_the_query_head_dims(dv):
    q, k, v = _inputs(dv=dv)
    out = packed_attention(_Layer(), q, k, v, _params())[0]
    assert float((out - _oracle(q, k, v, 8 ** -0.5, None)).abs().max()) <= 1e-10    # not the padded width's
    other = packed_attention(_Layer(), q, k, v, _params(), scaling=0.3)[0]
    assert float((other - out).abs().max()) > 1e-3                                  # negative control


class _Model(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.attn = _Layer()
        self.implementations = []

    def set_attn_implementation(self, name):
        self.implementations.append(name)


def test_detach_takes_the_batch_off_every_attention_module():
    from mixers.integrations.hf_attention import _BATCH, attach, detach, wrapped_name
    model, batch = _Model(), object()
    attach(model, [model.attn], "sdpa", batch)
    assert getattr(model.attn, _BATCH) is batch and model.implementations == [wrapped_name("sdpa")]
    detach(model, "sdpa")
    assert not hasattr(model.attn, _BATCH) and model.implementations[-1] == "sdpa"
