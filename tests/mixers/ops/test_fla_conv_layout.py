"""fla's Triton conv gets its chunk indices from the forward's metadata, built once.

Without them fla builds the indices on every call (``prepare_chunk_indices``: two host reads on a
GPU, its identity-keyed cache missing because the boundaries are a new tensor each call).
"""

import pytest
import torch

from mixers import HybridLM
from mixers.ops.device_policy import device_policy
from ssm_pack import PackedSeqParams, VarlenBatch
from tests.support import fakes

CASES = [pytest.param([5, 0, 40, 17, 1], 70, id="empty-doc-and-tail"), pytest.param([64], 64, id="one-chunk"),
         pytest.param([65, 63, 1, 128], 257, id="chunk-edges"), pytest.param([1] * 40, 40, id="many-short"),
         pytest.param([], 9, id="only-tail")]


@pytest.mark.parametrize("lengths, total", CASES)
def test_layout_is_what_fla_builds(lengths, total):
    index = pytest.importorskip("fla.ops.utils.index")
    varlen = VarlenBatch.build(PackedSeqParams.from_lengths(lengths, total_tokens=total), total)
    cu, chunk_indices = varlen.fla_conv_layout
    segs = varlen.segments
    assert torch.equal(cu, torch.cat([segs.starts, torch.tensor([total])]))
    assert torch.equal(chunk_indices, index.prepare_chunk_indices(cu.clone(), fakes.FLA_CONV_CHUNK))


def test_the_fake_refuses_wrong_chunk_indices():
    """Negative control: a grid that drops a chunk would leave its tokens uncomputed."""
    calls = []
    conv = fakes.fake_fla_conv(calls)
    x, w = torch.randn(1, 70, 8), torch.randn(8, 4)
    cu = torch.tensor([0, 5, 70])
    good = fakes.fla_chunk_indices(cu, fakes.FLA_CONV_CHUNK, cached=False)
    conv(x, w, cu_seqlens=cu, chunk_indices=good)
    with pytest.raises(AssertionError, match="wrong chunk_indices"):
        conv(x, w, cu_seqlens=cu, chunk_indices=good[:-1].contiguous())


def test_every_conv_of_a_step_gets_the_same_indices(monkeypatch):
    torch.manual_seed(0)
    small = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
             "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
    model = HybridLM(256, 32, "MGKPA", mixer_overrides=small).to(torch.bfloat16)
    calls = fakes.install(monkeypatch)
    monkeypatch.setattr(fakes.dispatch, "cached_support", lambda name, features=(): (name != "causal_conv1d", None))
    ids = torch.randint(0, 256, (1, 70))
    with device_policy("cuda"):
        model(ids, PackedSeqParams.from_lengths([5, 0, 40, 17, 1], total_tokens=70), labels=ids)["loss"].backward()
    given = [c["chunk_indices"] for c in fakes.of_kind(calls, "fla_conv")]
    assert len(given) == 12 and given[0] is not None and all(g is given[0] for g in given)
