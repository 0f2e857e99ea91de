"""The host-sync census (benchmarks/sync_census.py) and the step it counts (benchmarks/bench_syncs.py).

* The census counts every op class that reads a device value on the host, and none that does not.
* It attributes a sync to the block it happens in, forward and backward (negative controls: a
  block made to read a value is caught).
* One ``HybridLM("MGKPA")`` training step under the CUDA policy with the fake kernels makes no
  sync inside any block, with either conv kernel, and its total does not grow with T or documents.
"""

import pytest
import torch

from benchmarks.bench_syncs import census_step
from benchmarks.sync_census import OUTSIDE, SyncCensus
from mixers.layers.blocks import mlp
from ssm_pack import PackedSeqParams

UNEVEN = [5, 0, 40, 17, 1, 66]


def _count(fn) -> int:
    census = SyncCensus()
    with census:
        fn()
    return census.total()


x = torch.arange(6.0)
counts = torch.tensor([1, 0, 2])


@pytest.mark.parametrize("fn, reads", [
    pytest.param(lambda: x.sum().item(), 1, id="item"),
    pytest.param(lambda: bool(x.any()), 1, id="bool"),
    pytest.param(lambda: int(x[2]), 1, id="int"),
    pytest.param(lambda: x.tolist(), 1, id="tolist"),
    pytest.param(lambda: x[x > 2], 1, id="bool-mask-index"),
    pytest.param(lambda: x.clone().__setitem__(x > 2, x[:3]), 1, id="bool-mask-assign"),
    pytest.param(lambda: torch.nonzero(x), 1, id="nonzero"),
    pytest.param(lambda: torch.masked_select(x, x > 1), 1, id="masked-select"),
    pytest.param(lambda: torch.unique(x), 1, id="unique"),
    pytest.param(lambda: torch.equal(x, x), 1, id="equal"),
    pytest.param(lambda: torch.repeat_interleave(counts), 2, id="repeat-interleave"),
    pytest.param(lambda: torch.repeat_interleave(counts, output_size=3), 0, id="repeat-interleave-sized"),
    pytest.param(lambda: x[torch.tensor([0, 2])], 0, id="integer-index"),
    pytest.param(lambda: torch.where(x > 2, x, 0.0).cumsum(0).max(), 0, id="device-only"),
    pytest.param(lambda: x.shape[0] + len(x), 0, id="shapes"),
])
def test_counts_each_kind_of_host_read(fn, reads):
    assert _count(fn) == reads


def _reading(forward):
    def patched(self, x):
        torch.isfinite(x.sum()).item()             # a host read inside the block's MLP
        return forward(self, x)
    return patched


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x):
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        bool(torch.isfinite(grad).all())
        return grad


@pytest.mark.parametrize("conv, dtype", [pytest.param("causal_conv1d", torch.bfloat16, id="causal-conv1d"),
                                         pytest.param("fla_conv", torch.bfloat16, id="fla-conv"),
                                         pytest.param("causal_conv1d", torch.float32, id="fp32-references")])
def test_no_sync_inside_any_block(conv, dtype):
    """fp32: fla has no fp32 Gated DeltaProduct and attention kernels take 16-bit only, so those
    blocks run the references (and their non-finite guard, branch-free under the CUDA policy)."""
    found = census_step(sum(UNEVEN), 0, conv=conv, dtype=dtype, params=PackedSeqParams.from_lengths(UNEVEN),
                        trace=True)
    inside = [s for s in found.syncs if s.where != OUTSIDE]
    assert inside == []
    assert found.total > 0, "the step's metadata is read outside the blocks (the census sees it)"


def test_a_sync_inside_a_block_is_caught_and_placed(monkeypatch):
    """Negative control: a host read in the MLP (forward) and in a backward is counted in its block."""
    monkeypatch.setattr(mlp.SwiGLU, "forward", _reading(mlp.SwiGLU.forward))
    found = census_step(sum(UNEVEN), 0, params=PackedSeqParams.from_lengths(UNEVEN))
    blocks = sorted(place for place in found.per_place if place != OUTSIDE)
    assert len(blocks) == 5 and all(found.per_place[b] == 1 for b in blocks), found.per_place


def test_a_sync_in_a_backward_is_placed_in_its_block(monkeypatch):
    forward = mlp.SwiGLU.forward
    monkeypatch.setattr(mlp.SwiGLU, "forward", lambda self, x: _ReadsInBackward.apply(forward(self, x)))
    found = census_step(sum(UNEVEN), 0, params=PackedSeqParams.from_lengths(UNEVEN))
    inside = [s for s in found.syncs if s.where != OUTSIDE]
    assert len(inside) == 5 and {s.phase for s in inside} == {"backward"}
    assert len({s.where for s in inside}) == 5


@pytest.mark.parametrize("conv", [pytest.param("causal_conv1d", id="causal-conv1d"),
                                  pytest.param("fla_conv", id="fla-conv")])
def test_step_total_does_not_grow_with_tokens_or_documents(conv):
    totals = {(t, n): census_step(t, n, conv=conv).total for t, n in ((96, 1), (96, 7), (320, 1), (320, 40))}
    assert len(set(totals.values())) == 1, totals


@pytest.mark.parametrize("branch_free", [pytest.param(True, id="branch-free"),
                                         pytest.param(False, id="host-read-control")])
def test_the_references_guard_reads_nothing_branch_free(monkeypatch, branch_free):
    """fp32: fla has no fp32 Gated DeltaProduct, so that block runs the reference and its guard
    against non-finite values; branch-free (the CUDA policy's form) it reads no value."""
    from mixers.ops import device_policy

    monkeypatch.setattr(device_policy, "branch_free_isolation", lambda device: branch_free)
    found = census_step(sum(UNEVEN), 0, dtype=torch.float32, params=PackedSeqParams.from_lengths(UNEVEN))
    gdp = next(place for place in found.per_place if "GatedDeltaProduct" in place) if not branch_free else None
    places = {place for place in found.per_place if "GatedDeltaProduct" in place}
    assert (places == set()) if branch_free else found.per_place[gdp] >= 6, found.per_place
