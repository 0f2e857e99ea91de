"""The decode-step ops against the chunked ops they stand beside (fp64, exact): one token (or a few)
continuing per-slot states of a pool, the pool updated in place only at the named rows."""

import math

import pytest
import torch
import torch.nn.functional as F

from mixers.ops import (
    attention_with_kvcache,
    causal_conv1d_fn,
    causal_conv1d_update,
    chunk_gated_delta_product,
    chunk_gated_delta_rule,
    chunk_kda,
    fused_recurrent_gated_delta_product,
    fused_recurrent_gated_delta_rule,
    fused_recurrent_kda,
    mamba_chunk_scan_combined,
    selective_state_update,
    varlen_attention,
)
from ssm_pack import lengths_to_cu_seqlens
from tests.support.oracles import check_close

F64 = torch.float64


def rand(*shape, g):
    return torch.randn(*shape, generator=g, dtype=F64)


@pytest.mark.parametrize("steps", [pytest.param(1, id="one-token"), pytest.param(3, id="three-tokens")])
@pytest.mark.parametrize("state_len", [pytest.param(3, id="W-1"), pytest.param(5, id="longer-state")])
def test_conv_update_continues_the_named_rows(steps, state_len):
    g = torch.Generator().manual_seed(0)
    dim, width, index = 6, 4, torch.tensor([3, 0])
    pool, x, w, b = rand(5, dim, state_len, g=g), rand(2, dim, steps, g=g), rand(dim, width, g=g), rand(dim, g=g)
    before = pool.clone()
    out = causal_conv1d_update(x, pool, w, b, "silu", conv_state_indices=index)
    want, _ = causal_conv1d_fn(x, w, b, initial_states=before[index][..., -(width - 1):], return_final_states=True,
                               activation="silu")
    check_close(out, want, F64, what="out")
    check_close(pool[index], torch.cat([before[index], x], dim=2)[..., -state_len:], F64, what="state")
    untouched = torch.tensor([1, 2, 4])
    assert torch.equal(pool[untouched], before[untouched])
    # negative control: the other rows' states give other outputs
    wrong = causal_conv1d_update(x, before.clone(), w, b, "silu", conv_state_indices=torch.tensor([1, 2]))
    assert (wrong - want).abs().max() > 1e-3


def test_conv_update_one_token_form_and_errors():
    g = torch.Generator().manual_seed(1)
    pool, x, w = rand(2, 4, 3, g=g), rand(2, 4, g=g), rand(4, 4, g=g)
    pool3 = pool.clone()
    assert torch.equal(causal_conv1d_update(x, pool, w), causal_conv1d_update(x.unsqueeze(-1), pool3, w)[..., 0])
    with pytest.raises(ValueError, match="cache_seqlens .* is not supported"):
        causal_conv1d_update(x, pool, w, cache_seqlens=torch.zeros(2, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"conv_state_indices must be \[N\] = \[2\]"):
        causal_conv1d_update(x, pool, w, conv_state_indices=torch.tensor([0]))
    with pytest.raises(TypeError, match="conv_state_indices must have an integer dtype"):
        causal_conv1d_update(x, pool, w, conv_state_indices=torch.tensor([1.0, 0.0]))
    with pytest.raises(ValueError, match="conv_state must be"):
        causal_conv1d_update(x, pool[..., :1], w)


def ssd_case(g, rows=3, slots=5, heads=4, p=3, n=5, groups=2):
    return dict(state=rand(slots, heads, p, n, g=g), x=rand(rows, heads, p, g=g), dt=rand(rows, heads, g=g),
                A=-torch.rand(heads, generator=g, dtype=F64) - 0.1, B=rand(rows, groups, n, g=g),
                C=rand(rows, groups, n, g=g), D=rand(heads, g=g), z=rand(rows, heads, p, g=g),
                dt_bias=rand(heads, g=g))


@pytest.mark.parametrize("dt_limit", [pytest.param((0.0, math.inf), id="no-limit"),
                                      pytest.param((0.05, 0.5), id="dt-limit")])
def test_selective_state_update_is_one_step_of_the_scan(dt_limit):
    g = torch.Generator().manual_seed(2)
    c = ssd_case(g)
    heads, p, n = c["x"].shape[1], c["x"].shape[2], c["B"].shape[2]
    index, before = torch.tensor([4, 1, 2]), c["state"].clone()
    out = selective_state_update(c["state"], c["x"], c["dt"][..., None].expand(-1, -1, p),
                                 c["A"][:, None, None].expand(heads, p, n), c["B"], c["C"],
                                 D=c["D"][:, None].expand(heads, p), z=c["z"],
                                 dt_bias=c["dt_bias"][:, None].expand(heads, p), dt_softplus=True,
                                 state_batch_indices=index, dt_limit=dt_limit)
    want, final = mamba_chunk_scan_combined(c["x"][:, None], c["dt"][:, None], c["A"], c["B"][:, None],
                                            c["C"][:, None], 4, D=c["D"], z=c["z"][:, None], dt_bias=c["dt_bias"],
                                            initial_states=before[index], dt_softplus=True, dt_limit=dt_limit,
                                            return_final_states=True)
    check_close(out, want[:, 0], F64, what="out")
    check_close(c["state"][index], final, F64, what="state")
    assert torch.equal(c["state"][torch.tensor([0, 3])], before[torch.tensor([0, 3])])
    # negative control: from zero states
    zero = mamba_chunk_scan_combined(c["x"][:, None], c["dt"][:, None], c["A"], c["B"][:, None], c["C"][:, None],
                                        4, D=c["D"], z=c["z"][:, None], dt_bias=c["dt_bias"], dt_softplus=True,
                                        dt_limit=dt_limit)
    assert (zero - want).abs().max() > 1e-3


def test_selective_state_update_headless_form_and_errors():
    g = torch.Generator().manual_seed(3)
    state, x, dt = rand(2, 3, 4, g=g), rand(2, 3, g=g), rand(2, 3, g=g)
    A, B, C = -torch.rand(3, 4, generator=g, dtype=F64), rand(2, 4, g=g), rand(2, 4, g=g)
    heads_state = state.clone().unsqueeze(1)
    out = selective_state_update(state, x, dt, A, B, C, dt_softplus=True)
    out4 = selective_state_update(heads_state, x[:, None], dt[:, None], A[None], B[:, None], C[:, None],
                                  dt_softplus=True)
    assert torch.equal(out, out4[:, 0]) and torch.equal(state, heads_state[:, 0])
    with pytest.raises(ValueError, match="pass state_batch_indices"):
        selective_state_update(rand(3, 3, 4, g=g), x, dt, A, B, C)
    with pytest.raises(ValueError, match=r"A must be \[1, 3, 4\], got \[1, 3, 2\] \(a 3-D state is upstream's"):
        selective_state_update(state, x, dt, A[:, :2], B, C)


DELTA = {
    "gdn": (fused_recurrent_gated_delta_rule, chunk_gated_delta_rule, 2),
    "kda": (fused_recurrent_kda, chunk_kda, 2),
    "gdp": (fused_recurrent_gated_delta_product, chunk_gated_delta_product, 1),
}


@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in DELTA])
def test_fused_recurrent_step_is_the_chunked_op(kind):
    step, chunk, groups = DELTA[kind]
    g = torch.Generator().manual_seed(4)
    rows, h, kd, vd, nh = 3, 2, 4, 5, 2 if kind == "gdp" else 1
    hv = h * groups
    q, k = rand(rows, 1, h, kd, g=g), rand(rows, nh, h, kd, g=g)
    v = rand(rows, nh, hv, vd, g=g)
    gate = F.logsigmoid(rand(rows, 1, hv, kd, g=g) if kind == "kda" else rand(rows, 1, hv, g=g))
    beta, h0 = torch.rand(rows, nh, hv, generator=g, dtype=F64), rand(rows, hv, kd, vd, g=g)
    extra = (nh,) if kind == "gdp" else ()
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, s = step(q, k, v, gate, beta, *extra, **kw)
    ro, rs = chunk(q, k, v, gate, beta, *extra, **kw)
    check_close(o, ro, F64, what="out")
    check_close(s, rs, F64, what="state")
    zero, _ = step(q, k, v, gate, beta, *extra, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert (zero - o).abs().max() > 1e-3                          # negative control: without the state


@pytest.mark.parametrize("layout", [pytest.param(None, id="rows-of-3-tokens"),
                                    pytest.param([2, 0, 5, 1], id="packed-uneven")])
@pytest.mark.parametrize("kind", [pytest.param(k, id=k) for k in DELTA])
def test_fused_recurrent_beyond_one_token_is_the_chunked_op(kind, layout):
    """Several tokens per row, or packed documents (``cu_seqlens``): the chunked op's result, the same call."""
    step, chunk, groups = DELTA[kind]
    g = torch.Generator().manual_seed(5)
    rows, t = (2, 3) if layout is None else (1, sum(layout) + 1)          # packed: a one-token padding tail
    h, kd, vd, nh = 2, 4, 5, 2 if kind == "gdp" else 1
    hv = h * groups
    q, k, v = rand(rows, t, h, kd, g=g), rand(rows, t * nh, h, kd, g=g), rand(rows, t * nh, hv, vd, g=g)
    gate = F.logsigmoid(rand(rows, t, hv, kd, g=g) if kind == "kda" else rand(rows, t, hv, g=g))
    beta = torch.rand(rows, t * nh, hv, generator=g, dtype=F64)
    cu = None if layout is None else lengths_to_cu_seqlens(layout)
    h0 = rand(rows if layout is None else len(layout), hv, kd, vd, g=g)
    extra = (nh,) if kind == "gdp" else ()
    kw = dict(initial_state=h0, output_final_state=True, use_qk_l2norm_in_kernel=True, cu_seqlens=cu)
    o, s = step(q, k, v, gate, beta, *extra, **kw)
    ro, rs = chunk(q, k, v, gate, beta, *extra, **kw)
    assert torch.equal(o, ro) and torch.equal(s, rs), f"{kind}: not the chunked op's result"


def full_attention(q, k, v, lengths, window):
    cu = lengths_to_cu_seqlens(lengths)
    return varlen_attention(q, k, v, cu, None, causal=True, window_size=window)


@pytest.mark.parametrize("steps", [pytest.param(1, id="decode"), pytest.param(3, id="chunk")])
@pytest.mark.parametrize("window", [pytest.param(None, id="full"), pytest.param((4, 0), id="window-4")])
def test_attention_with_kvcache_is_attention_over_the_whole_sequence(steps, window):
    g = torch.Generator().manual_seed(5)
    cached, hq, hk, d, length = [0, 5, 9], 4, 2, 8, 16
    lengths = [c + steps for c in cached]
    q, k, v = rand(sum(lengths), hq, d, g=g), rand(sum(lengths), hk, d, g=g), rand(sum(lengths), hk, d, g=g)
    want = full_attention(q, k, v, lengths, window)
    k_cache, v_cache = rand(4, length, hk, d, g=g), rand(4, length, hk, d, g=g)
    slots, starts = torch.tensor([2, 0, 3]), torch.tensor(lengths).cumsum(0) - torch.tensor(lengths)
    for slot, start, n in zip(slots.tolist(), starts.tolist(), cached):
        k_cache[slot, :n], v_cache[slot, :n] = k[start:start + n], v[start:start + n]
    spare = k_cache[1].clone()
    new = [torch.arange(s + c, s + c + steps) for s, c in zip(starts.tolist(), cached)]
    rows = lambda t: torch.stack([t[i] for i in new])  # noqa: E731
    out = attention_with_kvcache(rows(q), k_cache, v_cache, k=rows(k), v=rows(v),
                                 cache_seqlens=torch.tensor(cached, dtype=torch.int32), cache_batch_idx=slots,
                                 causal=True, window_size=window or (-1, -1))
    check_close(out, torch.stack([want[i] for i in new]), F64, what="out")
    for slot, start, n in zip(slots.tolist(), starts.tolist(), lengths):
        assert torch.equal(k_cache[slot, :n], k[start:start + n])
    assert torch.equal(k_cache[1], spare)
    # negative control: forgetting the cached keys (lengths 0)
    alone = attention_with_kvcache(rows(q), k_cache, v_cache, cache_seqlens=torch.tensor([steps] * 3),
                                   cache_batch_idx=slots, causal=True)
    assert (alone - out).abs().max() > 1e-3


def test_attention_with_kvcache_edges_and_errors():
    g = torch.Generator().manual_seed(6)
    q, cache = rand(2, 1, 2, 4, g=g), rand(2, 3, 2, 4, g=g)
    assert torch.equal(attention_with_kvcache(q, cache, cache.clone(), cache_seqlens=0), torch.zeros_like(q))
    with pytest.raises(ValueError, match="reach position 3 of a cache of 3"):
        attention_with_kvcache(q, cache, cache.clone(), k=q, v=q, cache_seqlens=3)
    with pytest.raises(ValueError, match="k and v must be given together"):
        attention_with_kvcache(q, cache, cache.clone(), k=q)
    with pytest.raises(ValueError, match=r"cache_batch_idx must be \[N\] = \[2\]"):
        attention_with_kvcache(q, cache, cache.clone(), cache_batch_idx=torch.tensor([0]))


def test_attention_with_kvcache_without_cache_seqlens_starts_every_slot_empty():
    """``cache_seqlens`` left out: every row's slot holds nothing yet (as ``cache_seqlens=0``), whatever
    stale keys it has, and the new keys land at its start."""
    g = torch.Generator().manual_seed(7)
    q, k, v = rand(2, 3, 4, 8, g=g), rand(2, 3, 2, 8, g=g), rand(2, 3, 2, 8, g=g)
    k_cache, v_cache = rand(2, 5, 2, 8, g=g), rand(2, 5, 2, 8, g=g)
    k_zero, v_zero = k_cache.clone(), v_cache.clone()
    out = attention_with_kvcache(q, k_cache, v_cache, k=k, v=v, causal=True)
    want = attention_with_kvcache(q, k_zero, v_zero, k=k, v=v, cache_seqlens=0, causal=True)
    assert torch.equal(out, want), "no cache_seqlens is not the same as empty slots"
    assert torch.equal(k_cache, k_zero) and torch.equal(k_cache[:, :3], k), "the new keys are not at the slots' start"


@pytest.mark.parametrize("kwargs,match", [
    pytest.param(dict(k="vector", v="vector"), r"^k must be 4-D, got shape \(4,\)", id="k-not-4d"),
    pytest.param(dict(rows=3), r"^the cache has 2 slots for 3 rows; pass cache_batch_idx", id="more-rows-than-slots"),
    pytest.param(dict(cache_seqlens=torch.tensor([[1], [2]])), r"^cache_seqlens must be 1-D", id="seqlens-2d"),
    pytest.param(dict(cache_seqlens=torch.tensor([1, 2, 0])),
                 r"^cache_seqlens must be an int or \[N\] = \[2\]", id="seqlens-per-row"),
])
def test_attention_with_kvcache_bad_input(kwargs, match):
    g = torch.Generator().manual_seed(8)
    q, cache = rand(kwargs.pop("rows", 2), 1, 2, 4, g=g), rand(2, 3, 2, 4, g=g)
    kwargs = {name: rand(4, g=g) if isinstance(value, str) else value for name, value in kwargs.items()}
    with pytest.raises(ValueError, match=match):
        attention_with_kvcache(q, cache, cache.clone(), **kwargs)
