"""Inference under torch.autocast: the decode-step ops compute in the dtype their inputs arrive in
(same bits in and out of autocast, like every op), and a cached model under autocast decodes what
a full forward under autocast computes."""

import pytest
import torch

from mixers import HybridLM
from mixers.ops import (
    attention_with_kvcache,
    causal_conv1d_update,
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    selective_state_update,
)
from ssm_pack import PackedSeqParams
from tests.mixers.inference.common import SMALL
from tests.support.oracles import rel_rms
from tests.support.tolerances import BF16_FWD_REL

BF16 = torch.bfloat16


def _call(op, g):
    """One decode step as a layer under autocast hands it over: activations bf16, parameters and
    recurrent states fp32; returns the output and the pools it updates."""
    act = lambda *s: torch.randn(*s, generator=g).to(BF16)  # noqa: E731
    par = lambda *s: torch.randn(*s, generator=g)  # noqa: E731
    idx = torch.tensor([2, 0])
    if op == "conv":
        pool = act(3, 16, 3)
        return lambda: causal_conv1d_update(act(2, 16), pool, par(16, 4), par(16), "silu", conv_state_indices=idx), \
            [pool]
    if op == "ssd":
        state = par(3, 2, 4, 5)
        args = (act(2, 2, 4), act(2, 2, 1).expand(2, 2, 4), -torch.rand(2, 1, 1, generator=g).expand(2, 4, 5),
                act(2, 1, 5), act(2, 1, 5))
        return lambda: selective_state_update(state, *args, D=par(2, 1).expand(2, 4), dt_softplus=True,
                                              dt_bias=par(2, 1).expand(2, 4), state_batch_indices=idx), [state]
    if op == "attention":
        k_cache, v_cache = act(3, 8, 2, 8), act(3, 8, 2, 8)
        return lambda: attention_with_kvcache(act(2, 1, 4, 8), k_cache, v_cache, k=act(2, 1, 2, 8), v=act(2, 1, 2, 8),
                                              cache_seqlens=torch.tensor([3, 5]), cache_batch_idx=idx,
                                              causal=True), [k_cache, v_cache]
    nh = 2 if op == "gdp" else 1
    gate = -torch.rand((2, 1, 2, 8) if op == "kda" else (2, 1, 2), generator=g)
    args = (act(2, 1, 2, 8), act(2, nh, 2, 8), act(2, nh, 2, 8), gate, torch.rand(2, nh, 2, generator=g).to(BF16))
    fn = {"gdn": fused_recurrent_gated_delta_rule, "kda": fused_recurrent_kda,
          "gdp": lambda *a, **k: fused_recurrent_gated_delta_product(*a, 2, **k)}[op]
    h0 = par(2, 2, 8, 8)
    return lambda: fn(*args, initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)[0], []


@pytest.mark.parametrize("op", [pytest.param(o, id=o) for o in ("conv", "ssd", "attention", "gdn", "kda", "gdp")])
def test_decode_ops_compute_the_same_bits_under_autocast(op):
    results = []
    for enabled in (False, True):
        call, pools = _call(op, torch.Generator().manual_seed(0))
        with torch.autocast("cpu", dtype=BF16, enabled=enabled):
            out = call()
        results.append((out, pools))
    (plain, plain_pools), (cast, cast_pools) = results
    assert cast.dtype == plain.dtype == BF16 and torch.equal(cast, plain)
    assert all(torch.equal(a, b) for a, b in zip(cast_pools, plain_pools))


def test_cached_model_under_autocast_decodes_what_a_full_forward_computes():
    torch.manual_seed(0)
    model = HybridLM(64, 32, "MGKPA", mixer_overrides=SMALL).eval()
    seqs = [[1, 5, 9, 2, 7, 3, 8], [4, 4, 6]]
    cache = model.allocate_inference_cache(2, 16)
    with torch.no_grad(), torch.autocast("cpu", dtype=BF16):
        model(torch.tensor([seqs[0][:-1] + seqs[1][:-1]]), PackedSeqParams.from_lengths([6, 2]), cache=cache,
              cache_slots=[1, 0])
        step = model(torch.tensor([[seqs[0][-1]], [seqs[1][-1]]]), cache=cache, cache_slots=[1, 0])["logits"]
        for i, seq in enumerate(seqs):
            want = model(torch.tensor([seq]))["logits"][0, -1]
            assert rel_rms(step[i, -1].float(), want.float()) <= BF16_FWD_REL
