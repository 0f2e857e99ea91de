"""fla's delta-rule wrapper keeps every document's states in the documents' order.

fla (< 0.6) misreads empty documents, so the wrapper hands it the documents reordered (empty ones
last, the padding tail as one more document) and must put the initial states into that order and
the final states back into the documents' order. Every initial state here is distinct, so any
permutation mistake shows; layouts put empty documents first, last, in runs, and leave none.
"""

import pytest
import torch
import torch.nn.functional as F

import mixers.ops.delta_rule.kernel as fla_kernel
from mixers.ops import chunk_gated_delta_product, chunk_gated_delta_rule, chunk_kda, dispatch
from ssm_pack import lengths_to_cu_seqlens
from tests.support import fakes

H, K, V = 2, 8, 8
LAYOUTS = [
    pytest.param([0, 5, 3], 0, id="leading-empty"),
    pytest.param([5, 3, 0], 2, id="trailing-empty-and-tail"),
    pytest.param([2, 0, 0, 7, 0, 1], 2, id="runs-of-empties"),
    pytest.param([0, 3, 0, 4, 5], 0, id="permutation-with-a-3-cycle"),
    pytest.param([0, 0, 6, 0], 3, id="one-document"),
    pytest.param([4, 9, 3], 3, id="no-empty"),
]
KINDS = [pytest.param("gdn", torch.float32, id="gdn"), pytest.param("kda", torch.float32, id="kda"),
         pytest.param("gdp", torch.bfloat16, id="gdp")]


@pytest.fixture
def fla_calls(monkeypatch):
    """Pretend CUDA and fla; every call's ``(cu_seqlens, initial_state)`` is recorded."""
    monkeypatch.setattr(dispatch, "is_cuda", lambda t: True)
    monkeypatch.setattr(dispatch, "cached_support", lambda name, features=(): (True, None))
    seen, make = [], fakes.fake_fla([])

    def load(kind):
        op = make(kind)

        def recorded(*args, initial_state=None, cu_seqlens=None, **kwargs):
            seen.append((cu_seqlens, initial_state))
            return op(*args, initial_state=initial_state, cu_seqlens=cu_seqlens, **kwargs)
        return recorded
    monkeypatch.setattr(fla_kernel, "load_upstream", load)
    return seen


def inputs(kind, lengths, tail, dtype):
    g = torch.Generator().manual_seed(0)
    total, nh = sum(lengths) + tail, (2 if kind == "gdp" else 1)

    def rnd(*shape):
        return torch.randn(*shape, generator=g).to(dtype)

    gate = F.logsigmoid(torch.randn(1, total, H, K if kind == "kda" else 1, generator=g))
    gate = (gate if kind == "kda" else gate[..., 0]).to(dtype)
    args = (rnd(1, total, H, K), rnd(1, total * nh, H, K), rnd(1, total * nh, H, V), gate,
            torch.rand(1, total * nh, H, generator=g).to(dtype))
    # document i's initial state is filled with i + 1 (plus noise): any permutation is visible
    h0 = torch.stack([torch.full((H, K, V), i + 1.0) + 0.01 * torch.randn(H, K, V, generator=g)
                      for i in range(len(lengths))])
    return args, h0


def run(kind, args, backend, **kw):
    if kind == "gdp":
        return chunk_gated_delta_product(*args, 2, backend=backend, **kw)
    return (chunk_gated_delta_rule if kind == "gdn" else chunk_kda)(*args, backend=backend, **kw)


@pytest.mark.parametrize("kind,dtype", KINDS)
@pytest.mark.parametrize("lengths,tail", LAYOUTS)
def test_final_states_come_back_in_document_order(fla_calls, kind, dtype, lengths, tail):
    args, h0 = inputs(kind, lengths, tail, dtype)
    cu = lengths_to_cu_seqlens(lengths)
    out, final = run(kind, args, "kernel", initial_state=h0, output_final_state=True, cu_seqlens=cu)
    ref, ref_final = run(kind, args, "reference", initial_state=h0, output_final_state=True, cu_seqlens=cu)
    assert len(fla_calls) == 1 and final.shape == ref_final.shape == h0.shape
    for i, n in enumerate(lengths):
        if n == 0:            # an empty document's final state is its initial state, bit for bit
            assert torch.equal(final[i].float(), h0[i]), f"document {i} (empty) got another document's state"
        else:
            assert torch.allclose(final[i].float(), ref_final[i].float(), rtol=1e-2, atol=1e-2), f"document {i}"
            others = [j for j in range(len(lengths)) if j != i]
            assert all(not torch.allclose(final[i].float(), ref_final[j].float(), rtol=1e-2, atol=1e-2)
                       for j in others), f"document {i}'s state matches another document's too: the check is blind"
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)


@pytest.mark.parametrize("lengths,tail", LAYOUTS)
def test_fla_gets_each_documents_initial_state_in_its_order(fla_calls, lengths, tail):
    args, h0 = inputs("gdn", lengths, tail, torch.float32)
    cu = lengths_to_cu_seqlens(lengths)
    run("gdn", args, "kernel", initial_state=h0, output_final_state=True, cu_seqlens=cu)
    (given_cu, given_init), = fla_calls
    starts = {s: i for i, (s, n) in enumerate(zip(cu[:-1].tolist(), lengths)) if n}
    assert given_init.shape[0] == given_cu.numel() - 1
    for j, (s, e) in enumerate(zip(given_cu[:-1].tolist(), given_cu[1:].tolist())):
        if e == s:
            continue
        if s in starts:       # a document's tokens: its own initial state
            assert torch.equal(given_init[j], h0[starts[s]].to(given_init.dtype)), f"segment {j} at token {s}"
        else:                 # the padding tail starts from zeros
            assert s == int(cu[-1]) and not given_init[j].any()


@pytest.mark.parametrize("lengths,tail", LAYOUTS)
def test_final_states_without_initial_states(fla_calls, lengths, tail):
    args, _ = inputs("kda", lengths, tail, torch.float32)
    cu = lengths_to_cu_seqlens(lengths)
    _, final = run("kda", args, "kernel", output_final_state=True, cu_seqlens=cu)
    _, ref_final = run("kda", args, "reference", output_final_state=True, cu_seqlens=cu)
    assert final.shape[0] == len(lengths)
    for i, n in enumerate(lengths):
        if n == 0:
            assert not final[i].any(), f"empty document {i} must keep a zero state"
        else:
            assert torch.allclose(final[i], ref_final[i], rtol=1e-4, atol=1e-4), f"document {i}"


@pytest.mark.parametrize("kind,dtype", KINDS)
@pytest.mark.parametrize("final", [pytest.param(False, id="output-only"), pytest.param(True, id="final-state")])
def test_rows_without_cu_seqlens(fla_calls, kind, dtype, final):
    """Each row one sequence (no ``cu_seqlens``), with a bf16 initial state: fla gets it in fp32 (its
    KDA kernel refuses anything else), and returns no final state unless asked; outputs and final
    states equal the reference's."""
    args, h0 = inputs(kind, [7], 0, dtype)
    h0 = h0.to(torch.bfloat16)
    out, got = run(kind, args, "kernel", initial_state=h0, output_final_state=final)
    ref, want = run(kind, args, "reference", initial_state=h0, output_final_state=final)
    (given_cu, given_init), = fla_calls
    assert given_cu is None and given_init.dtype == torch.float32
    assert torch.allclose(out.float(), ref.float(), rtol=1e-2, atol=1e-2)
    assert (got is None) == (want is None) == (not final)
    if final:
        assert got.dtype == want.dtype and torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
