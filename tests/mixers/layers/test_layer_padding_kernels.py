"""Layers with padded packing metadata on the (fake) kernel path: outputs AND gradients equal the
reference layer's. The fakes (``tests/support/fakes.py``) keep upstream's contracts, causal-conv1d's
backward included (it takes padding in where a negative ``seq_idx`` reaches it)."""

import pytest
import torch

from ssm_pack import PackedSeqParams, lengths_to_cu_seqlens, plan_packs
from tests.mixers.layers.test_layers import HIDDEN, LAYERS
from tests.support.fakes import install, of_kind
from tests.support.megatron_standin import MegatronPackedSeqParams
from tests.support.oracles import rel_rms

LENGTHS = [5, 13, 1, 22]


def padded_to_8():
    return PackedSeqParams.from_lengths(LENGTHS, pad_to_multiple_of=8, total_tokens=67)   # and a tail of 3


def megatron_padded():
    """Megatron-core's params with padded boundaries (what its data path builds for CP / alignment)."""
    real = lengths_to_cu_seqlens(LENGTHS)
    padded = lengths_to_cu_seqlens([8, 16, 4, 24])
    return MegatronPackedSeqParams(qkv_format="thd", cu_seqlens_q=real, cu_seqlens_kv=real, cu_seqlens_q_padded=padded,
                                   cu_seqlens_kv_padded=padded, max_seqlen_q=24, max_seqlen_kv=24)


def planner_aligned():
    plan = plan_packs(LENGTHS, max_tokens=72, align_to=8)
    assert len(plan.packs) == 1
    return plan.packed_seq_params(0)


PARAMS = [
    pytest.param(padded_to_8, id="pad_to_multiple_of"),
    pytest.param(megatron_padded, id="megatron-padded-cu_seqlens"),
    pytest.param(planner_aligned, id="planner-alignment"),
]


def run(module, x, params):
    x = x.clone().requires_grad_()
    out = module(x, packed_seq_params=params)
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(3), dtype=out.dtype)
    leaves = [x] + [p for p in module.parameters()]
    return out, torch.autograd.grad(out, leaves, cot)


@pytest.mark.parametrize("make_params", PARAMS)
@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_padded_layer_on_kernels_equals_the_reference(monkeypatch, name, make_params):
    params = make_params()
    tokens = params.total_tokens if getattr(params, "total_tokens", None) else int(params.cu_seqlens_q_padded[-1])
    x = torch.randn(1, tokens, HIDDEN, generator=torch.Generator().manual_seed(1))
    torch.manual_seed(0)
    reference = LAYERS[name](backend="reference")
    module = LAYERS[name]()
    module.load_state_dict(reference.state_dict())
    ref_out, ref_grads = run(reference, x, params)
    calls = install(monkeypatch)
    out, grads = run(module, x, params)
    assert len(of_kind(calls, "conv")) >= 1, "the short convolution ran on causal-conv1d's kernel"
    assert rel_rms(out, ref_out) < 1e-5
    for (pname, _), got, want in zip([("x", None)] + list(module.named_parameters()), grads, ref_grads):
        assert rel_rms(got, want) < 1e-5, pname
