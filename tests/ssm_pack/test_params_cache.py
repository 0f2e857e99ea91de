"""Megatron-style calls hand every layer the params: the metadata is built once per params object.

Negative controls: another params object, other tokens, or a boundary tensor changed in place
build anew (and ssm-pack's own params, changed in place, still raise).
"""

import gc

import pytest
import torch

from benchmarks.bench_syncs import install_fakes
from benchmarks.sync_census import OUTSIDE, SyncCensus
from mixers.ops.device_policy import device_policy
from ssm_pack import PackedSeqParams, VarlenBatch, varlen
from tests.mixers.layers.test_layers import HIDDEN, LAYERS
from tests.support.megatron_standin import megatron_copy

LENGTHS = [5, 0, 40, 18]


@pytest.fixture
def builds(monkeypatch):
    made = []
    original = VarlenBatch._from_params.__func__

    def counting(cls, params, total_tokens, device):
        made.append(params)
        return original(cls, params, total_tokens, device)

    monkeypatch.setattr(VarlenBatch, "_from_params", classmethod(counting))
    return made


def _params(kind):
    ours = PackedSeqParams.from_lengths(LENGTHS, total_tokens=66)
    return ours if kind == "ours" else megatron_copy(ours)


KINDS = [pytest.param("ours", id="ssm-pack-params"), pytest.param("megatron", id="megatron-params")]


@pytest.mark.parametrize("kind", KINDS)
def test_a_stack_of_layers_builds_the_metadata_once(builds, kind):
    params = _params(kind)
    x = torch.randn(1, 66, HIDDEN)
    for name in LAYERS:
        x = x + LAYERS[name](backend="reference")(x, packed_seq_params=params)
    assert len(builds) == 1
    other = _params(kind)                            # control: a new params object builds its own
    LAYERS["gdn"](backend="reference")(x, packed_seq_params=other)
    assert len(builds) == 2


def test_the_same_params_for_other_tokens_build_anew(builds):
    # params without total_tokens or seq_idx (params that carry them are refused for another count)
    params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS))
    params.total_tokens, params.seq_idx = None, None
    a = VarlenBatch.build(params, 66)
    assert VarlenBatch.build(params, 66) is a and len(builds) == 1
    b = VarlenBatch.build(params, 70)
    assert b is not a and b.total_tokens == 70 and len(builds) == 2
    c = VarlenBatch.build(params, 66)                # one entry per params: the last build is kept
    assert c is not a and c.total_tokens == 66 and len(builds) == 3


def test_a_boundary_changed_in_place_builds_anew(builds):
    params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS, total_tokens=66))
    first = VarlenBatch.build(params, 66)
    for cu in {id(t): t for t in (params.cu_seqlens_q, params.cu_seqlens_kv)}.values():
        cu[1] = 4                                    # Megatron's params are plain, mutable tensors
    again = VarlenBatch.build(params, 66)
    assert again is not first and int(again.cu_seqlens[1]) == 4 and len(builds) == 2


def test_a_field_replaced_builds_anew(builds):
    params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS, total_tokens=66))
    first = VarlenBatch.build(params, 66)
    params.max_seqlen_q = 41
    assert VarlenBatch.build(params, 66) is not first and len(builds) == 2


def test_ssm_pack_params_changed_in_place_still_raise():
    params = PackedSeqParams.from_lengths(LENGTHS, total_tokens=66)
    VarlenBatch.build(params, 66)
    params.cu_seqlens_q[1] = 4
    with pytest.raises(ValueError, match="modified in place"):
        VarlenBatch.build(params, 66)


def test_the_cache_keeps_no_params_alive():
    gc.collect()
    before = len(varlen.BUILT_PER_PARAMS)
    params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS, total_tokens=66))
    VarlenBatch.build(params, 66)
    assert len(varlen.BUILT_PER_PARAMS) == before + 1
    del params
    gc.collect()
    assert len(varlen.BUILT_PER_PARAMS) == before


def test_megatron_style_layers_sync_only_in_the_first():
    """The host-sync census of a Megatron-style stack (each layer given the params) on the fake kernels."""
    import contextlib

    torch.manual_seed(0)
    layers = {name: LAYERS[name]().to(torch.bfloat16) for name in LAYERS}
    params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS, total_tokens=66))
    x = torch.randn(1, 66, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    census = SyncCensus()
    with contextlib.ExitStack() as stack:
        install_fakes(stack, census, "causal_conv1d")
        stack.enter_context(device_policy("cuda"))
        handles = census.watch(layers)
        stack.callback(lambda: [h.remove() for h in handles])
        with census:
            h = x
            for layer in layers.values():
                h = h + layer(h, packed_seq_params=params)
            h.float().square().sum().backward()
    places = census.per_place()
    first = next(iter(layers))
    assert places[first] > 0 and set(places) - {OUTSIDE} == {first}, places


@pytest.mark.parametrize("validate", [pytest.param(True, id="validated"), pytest.param(False, id="unvalidated")])
def test_host_boundaries_derive_everything_without_a_device_read(validate):
    """Tokens on another device, boundaries on the host: every field that needs boundary values reads
    the host copy (a meta device stands for the GPU: reading one of its values raises)."""
    params = PackedSeqParams.from_lengths([5, 0, 40, 17, 1], total_tokens=70)
    if not validate:
        params = PackedSeqParams(**{k: getattr(params, k) for k in ("qkv_format", "cu_seqlens_q", "cu_seqlens_kv",
                                                                   "total_tokens")}, validate=False)
    batch = VarlenBatch.build(params, 70, device="meta")
    batch.materialize()
    on_host = VarlenBatch.build(params, 70)
    assert batch.max_seqlen == on_host.max_seqlen == 40
    for name in ("seg_id", "starts", "lengths", "first_in_row", "doc_segment"):
        assert getattr(batch.segments, name).device.type == "meta"
        assert torch.equal(getattr(batch._host_segments, name), getattr(on_host.segments, name))
    assert all(t.device.type == "meta" for t in batch.fla_conv_layout)
    assert [tuple(t.shape) for t in batch.fla_conv_layout] == [tuple(t.shape) for t in on_host.fla_conv_layout]


def test_params_of_inference_tensors_build_each_time(builds):
    """Inference tensors have no version counter, so a change in place could not be seen: not cached."""
    with torch.inference_mode():
        params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS, total_tokens=66))
        first = VarlenBatch.build(params, 66)
        again = VarlenBatch.build(params, 66)
    assert again is not first and len(builds) == 2


@pytest.mark.parametrize("change", [pytest.param("added", id="field-added"),
                                    pytest.param("removed", id="field-removed")])
def test_a_field_added_or_removed_builds_anew(builds, change):
    """A public field more or less is another snapshot, also when the others read the same."""
    params = megatron_copy(PackedSeqParams.from_lengths(LENGTHS, total_tokens=66))
    if change == "removed":
        params.zz_note = "x"
    first = VarlenBatch.build(params, 66)
    if change == "added":
        params.zz_note = "x"                         # sorts after every other field
    else:
        del params.zz_note
    assert VarlenBatch.build(params, 66) is not first and len(builds) == 2
