"""Kernel paths of inference on CPU: fake upstream kernels assert upstream's contracts; the cached
model takes each kernel where it can, the reference (or an error with ``backend="kernel"``) where it
cannot, and matches the reference path."""

import math

import pytest
import torch

from mixers import HybridLM
from mixers.ops import (
    attention_with_kvcache,
    causal_conv1d_update,
    dispatch,
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    selective_state_update,
)
from ssm_pack import PackedSeqParams
from tests.mixers.inference.common import SMALL
from tests.support import decode_fakes as fakes
from tests.support.fakes import of_kind
from tests.support.oracles import rel_rms
from tests.support.tolerances import BF16_FWD_REL

BF16 = torch.bfloat16


def model(backend):
    torch.manual_seed(0)
    return HybridLM(64, 32, "MGKPA", backend=backend, mixer_overrides=SMALL).to(BF16)


def run(m, calls=None):
    """Packed prefill (fresh slots), two decode steps, a packed call continuing the slots."""
    cache = m.allocate_inference_cache(3, 32)
    ids = torch.arange(1, 20).remainder(64)
    outs = []
    with torch.no_grad():
        first = PackedSeqParams.from_lengths([6, 7])
        outs.append(m(ids[:13][None], first, cache=cache, cache_slots=[2, 0])["logits"])
        for step in range(2):
            outs.append(m(ids[13 + step:15 + step].reshape(2, 1), cache=cache, cache_slots=[2, 0])["logits"])
        marks = None if calls is None else len(calls)
        then = PackedSeqParams.from_lengths([1, 3])
        outs.append(m(ids[15:19][None], then, cache=cache, cache_slots=[0, 2])["logits"])
    return outs, marks


def test_cached_model_runs_every_decode_kernel(monkeypatch):
    calls = fakes.install(monkeypatch)
    got, mark = run(model("auto"), calls)
    cont = calls[mark:]
    kinds = {k for k, _ in calls}
    assert {"conv", "ssd", "gdn", "kda", "gdp", "flash", "conv_update", "state_update", "fused_recurrent_gdn",
            "fused_recurrent_kda", "kvcache"} <= kinds, kinds
    # G and P (GDN's kernel on P's sub-step layout: two steps per token), two decode steps each
    assert [tuple(s) for s in of_kind(calls, "fused_recurrent_gdn")] == [(2, 1, 3, 8), (2, 2, 3, 8)] * 2
    assert all(idx.tolist() == [2, 0] for idx in of_kind(calls, "conv_update"))
    # continuing slots: per-document initial states -> fla's conv, fla's chunk kernels, the KV cache without
    # new keys; mamba-ssm's scan cannot (reference), so no "ssd" call in that part
    cont_kinds = [k for k, _ in cont]
    assert "fla_conv" in cont_kinds and "ssd" not in cont_kinds and ("kvcache", False) in cont
    monkeypatch.undo()
    want, _ = run(model("reference"))
    for g, w in zip(got, want):
        assert rel_rms(g.float(), w.float()) <= BF16_FWD_REL


def test_fp64_never_reaches_a_kernel(monkeypatch):
    calls = fakes.install(monkeypatch)
    torch.manual_seed(0)
    m = HybridLM(64, 32, "MGKPA", mixer_overrides=SMALL).double()
    cache = m.allocate_inference_cache(2, 8)
    with torch.no_grad():
        m(torch.tensor([[1, 2, 3]]), PackedSeqParams.from_lengths([3]), cache=cache, cache_slots=[1])
        m(torch.tensor([[4]]), cache=cache, cache_slots=[1])
    assert calls == []


@pytest.mark.parametrize("case,match", [
    pytest.param("conv-fp64", "causal-conv1d cannot do dtype torch.float64.*fla's Triton conv cannot do",
                 id="conv-fp64"),
    pytest.param("ssd-dt-limit", r"cannot do dt_limit=\(0.1, 1.0\)", id="ssd-dt-limit"),
    pytest.param("fla-fp64", "cannot do dtype torch.float64", id="fla-fp64"),
])
def test_kernel_backend_refuses_what_no_kernel_can_do(monkeypatch, case, match):
    calls = fakes.install(monkeypatch)
    g = torch.Generator().manual_seed(0)
    with pytest.raises(ValueError, match=match):
        if case == "conv-fp64":
            causal_conv1d_update(torch.randn(2, 8, dtype=torch.float64), torch.zeros(2, 8, 3, dtype=torch.float64),
                                 torch.randn(8, 4, dtype=torch.float64), backend="kernel")
        elif case == "ssd-dt-limit":
            selective_state_update(torch.zeros(2, 1, 2, 3), torch.randn(2, 1, 2, generator=g), torch.randn(2, 1, 2),
                                   -torch.ones(1, 2, 3), torch.randn(2, 1, 3), torch.randn(2, 1, 3),
                                   dt_limit=(0.1, 1.0), backend="kernel")
        else:
            q = torch.randn(2, 1, 1, 4, dtype=torch.float64)
            fused_recurrent_gated_delta_rule(q, q, q, torch.zeros(2, 1, 1, dtype=torch.float64),
                                             torch.ones(2, 1, 1, dtype=torch.float64), backend="kernel")
    assert calls == []


def test_conv_update_takes_fla_where_causal_conv1d_cannot(monkeypatch):
    """Width 5 (causal-conv1d takes 2..4): fla's update on gathered rows, its unread column dropped
    (the fake writes NaN there); more than one token per row: neither kernel, so the reference in
    ``auto`` and an error with ``kernel``."""
    calls = fakes.install(monkeypatch)
    g = torch.Generator().manual_seed(1)
    pool, x, w = torch.randn(4, 8, 4, generator=g), torch.randn(2, 8, generator=g), torch.randn(8, 5, generator=g)
    ref_pool = pool.clone()
    index = torch.tensor([3, 1])
    out = causal_conv1d_update(x, pool, w, activation="silu", conv_state_indices=index)
    want = causal_conv1d_update(x, ref_pool, w, activation="silu", conv_state_indices=index, backend="reference")
    assert [k for k, _ in calls] == ["fla_conv_update"] and torch.allclose(out, want)
    assert torch.equal(pool, ref_pool) and not pool.isnan().any()
    causal_conv1d_update(x.unsqueeze(-1).expand(2, 8, 2), pool, w, conv_state_indices=index)
    assert len(calls) == 1
    with pytest.raises(ValueError, match="kernel width 5.*2 tokens per row"):
        causal_conv1d_update(x.unsqueeze(-1).expand(2, 8, 2), pool, w, conv_state_indices=index, backend="kernel")


def test_missing_packages_mean_reference_in_auto_and_an_error_with_kernel(monkeypatch):
    calls = fakes.install(monkeypatch, supported=False)
    x = torch.randn(2, 1, 2)
    args = (torch.zeros(2, 1, 2, 3), x, x.clone(), -torch.ones(1, 2, 3), torch.randn(2, 1, 3), torch.randn(2, 1, 3))
    selective_state_update(*args)
    assert calls == []
    with pytest.raises(RuntimeError, match="mamba_decode is not installed"):
        selective_state_update(*args, backend="kernel")
    assert dispatch.select_backend("x", "auto", on_cuda=True, support_state=lambda: (True, None),
                                   missing_feature=None) == "kernel"
    assert math.isfinite(float(selective_state_update(*args).sum()))


def test_kvcache_with_a_cache_of_another_dtype_takes_the_reference(monkeypatch):
    """bf16 queries over an fp32 KV cache: flash-attn needs one dtype, so ``auto`` runs the reference
    (the new keys appended to the cache as there) and ``kernel`` names the mismatch."""
    calls = fakes.install(monkeypatch)
    g = torch.Generator().manual_seed(2)
    q, k, v = (torch.randn(2, 1, 2, 8, generator=g).to(BF16) for _ in range(3))
    caches = [torch.randn(3, 6, 2, 8, generator=g) for _ in range(2)]
    ref_caches = [c.clone() for c in caches]
    lens, idx = torch.tensor([2, 4], dtype=torch.int32), torch.tensor([2, 0], dtype=torch.int32)
    out = attention_with_kvcache(q, *caches, k, v, cache_seqlens=lens, cache_batch_idx=idx, causal=True)
    want = attention_with_kvcache(q, *ref_caches, k, v, cache_seqlens=lens, cache_batch_idx=idx, causal=True,
                                  backend="reference")
    assert calls == [] and torch.equal(out, want)
    assert all(torch.equal(a, b) for a, b in zip(caches, ref_caches)), "the caches must hold the same keys"
    with pytest.raises(ValueError, match=r"a torch\.float32 cache with torch\.bfloat16 queries"):
        attention_with_kvcache(q, *caches, k, v, cache_seqlens=lens, cache_batch_idx=idx, backend="kernel")


def test_ssd_decode_without_pool_rows_takes_a_kernel_lacking_state_batch_indices(monkeypatch):
    """mamba-ssm before 2.2.3 has the decode kernel but no ``state_batch_indices``: row i updating state
    i takes the kernel, a call naming pool rows the reference in ``auto`` and an error with ``kernel``."""
    calls = fakes.install(monkeypatch)
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (
        (False, f"mamba-ssm 2.2.2 is too old for {name} with state_batch_indices")
        if "state_batch_indices" in features else (True, None)))
    g = torch.Generator().manual_seed(3)
    x, dt = torch.randn(2, 2, 3, generator=g), torch.randn(2, 2, 3, generator=g)
    A, B, C = -torch.rand(2, 3, 4, generator=g), torch.randn(2, 1, 4, generator=g), torch.randn(2, 1, 4, generator=g)
    pool = torch.randn(3, 2, 3, 4, generator=g)
    state, ref_state = pool[:2].clone(), pool[:2].clone()
    out = selective_state_update(state, x, dt, A, B, C, dt_softplus=True)
    want = selective_state_update(ref_state, x, dt, A, B, C, dt_softplus=True, backend="reference")
    assert [k for k, _ in calls] == ["state_update"], "row i updating state i must take the kernel"
    assert torch.allclose(out, want) and torch.allclose(state, ref_state)
    rows = torch.tensor([2, 0])
    selective_state_update(pool.clone(), x, dt, A, B, C, dt_softplus=True, state_batch_indices=rows)
    assert len(calls) == 1, "pool rows need state_batch_indices: the reference"
    with pytest.raises(RuntimeError, match="too old for mamba_decode with state_batch_indices"):
        selective_state_update(pool.clone(), x, dt, A, B, C, dt_softplus=True, state_batch_indices=rows,
                               backend="kernel")


def test_gated_delta_product_decode_without_gate_runs_gdn_kernel_on_sub_steps(monkeypatch):
    """No gate: GDN's fused recurrent kernel gets zero log-decays on every row's sub-steps; three rows, the
    result of the reference step."""
    calls = fakes.install(monkeypatch)
    g = torch.Generator().manual_seed(6)
    rows, nh = 3, 2
    q, k = torch.randn(rows, 1, 2, 4, generator=g), torch.randn(rows, nh, 2, 4, generator=g)
    v, beta = torch.randn(rows, nh, 2, 5, generator=g), torch.rand(rows, nh, 2, generator=g)
    h0 = torch.randn(rows, 2, 4, 5, generator=g)
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, final = fused_recurrent_gated_delta_product(q, k, v, None, beta, nh, **kw)
    assert [kind for kind, _ in calls] == ["fused_recurrent_gdn"]
    want, want_final = fused_recurrent_gated_delta_product(q, k, v, None, beta, nh, backend="reference", **kw)
    torch.testing.assert_close(out, want, msg="output of the ungated sub-steps")
    torch.testing.assert_close(final, want_final, msg="final states of the ungated sub-steps")
