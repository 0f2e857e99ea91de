"""The cache's public surface, pinned: ``allocate_inference_cache`` defaults and arguments (dtype,
device, table), the states' documented layouts, ``reset`` (default, list, tensor, repeats), and the
forms of ``cache_slots`` (list, tensor; bool and 2-D tensors refused), each refusal leaving the
cache bitwise unchanged."""

import pytest
import torch

from mixers import HybridLM
from mixers.inference import InferenceCache, LayerCache, SlotTable
from ssm_pack import PackedSeqParams
from tests.mixers.inference.common import HIDDEN, LETTERS, SMALL, make_mixer, same, sequences, snapshot

F64, F32, BF16 = torch.float64, torch.float32, torch.bfloat16


def model(pattern="MGKPA", dtype=F64):
    torch.manual_seed(0)
    return HybridLM(64, HIDDEN, pattern, mixer_overrides=SMALL).to(dtype).eval()


def filled(m, slots=4):
    cache = m.allocate_inference_cache(slots, 12)
    with torch.no_grad():
        m(torch.tensor([[5, 6, 7, 8, 9, 10]]), PackedSeqParams.from_lengths([2, 3, 1]), cache=cache,
          cache_slots=[0, 3, 1])
    return cache


def nonzero_slots(cache) -> list[int]:
    """The slots whose states hold any non-zero value, in any mixer."""
    return sorted({s for layer in cache.layers for t in layer.states.values()
                   for s in range(t.shape[0]) if t[s].abs().sum() > 0})


def test_model_allocate_defaults_and_arguments():
    m = model()
    cache = m.allocate_inference_cache(3, 10)
    assert isinstance(cache, InferenceCache) and (cache.capacity, cache.max_seqlen) == (3, 10)
    assert (cache.dtype, cache.device) == (F64, torch.device("cpu")) and len(cache.layers) == 5
    assert all(t.dtype == F64 and not t.any() for layer in cache.layers for t in layer.states.values())
    assert cache.lengths.tolist() == [0, 0, 0] and cache.free_slots() == [0, 1, 2]
    assert repr(cache) == ("InferenceCache(HybridLM, 5 mixers, 3 slots x 10 tokens, dtype=torch.float64, "
                           "device=cpu)")
    low = m.allocate_inference_cache(max_batch_size=2, max_seqlen=4, dtype=F32, device="cpu")
    assert low.dtype == F32 and all(t.dtype == F32 for layer in low.layers for t in layer.states.values())
    assert all(layer.table is low.table for layer in low.layers)
    with pytest.raises(ValueError, match="allocated for torch.float32 activations but the model now runs"):
        m(torch.tensor([[1]]), cache=low, cache_slots=[0])
    assert m.float()(torch.tensor([[1]]), cache=low, cache_slots=[0])["logits"].shape == (1, 1, 64)


@pytest.mark.parametrize("size,value,error,match", [
    pytest.param("max_batch_size", 0, ValueError, "max_batch_size must be >= 1", id="no-slots"),
    pytest.param("max_seqlen", 0, ValueError, "max_seqlen must be >= 1", id="no-tokens"),
    pytest.param("max_seqlen", 2.5, TypeError, "max_seqlen must be an int", id="float-length"),
])
def test_allocate_refuses_bad_sizes(size, value, error, match):
    args = {"max_batch_size": 2, "max_seqlen": 4, size: value}
    with pytest.raises(error, match=match):
        model("G").allocate_inference_cache(**args)


def layouts(letter, slots, seqlen):
    """The documented state shapes of each mixer (S = slots, L = max_seqlen), from its config."""
    layer = make_mixer(letter)
    c = layer.config
    if letter == "M":
        return layer, {"conv": (slots, c.d_inner + 2 * c.num_groups * c.state_size, c.conv_size - 1),
                       "ssm": (slots, c.num_heads, c.head_dim, c.state_size)}
    if letter == "A":
        heads = getattr(c, "num_kv_heads", None) or c.num_heads
        return layer, {"key": (slots, seqlen, heads, c.head_dim), "value": (slots, seqlen, heads, c.head_dim)}
    return layer, None


@pytest.mark.parametrize("letter", LETTERS)
def test_mixer_allocate_defaults_dtypes_and_table(letter):
    layer, shapes = layouts(letter, 3, 9)
    cache = layer.allocate_inference_cache(3, 9)
    assert isinstance(cache, LayerCache) and cache.dtype == F64 and not cache.shared
    assert all(t.shape[0] == 3 and t.dtype == F64 and not t.any() for t in cache.states.values())
    if shapes is not None:
        assert {k: tuple(v.shape) for k, v in cache.states.items()} == shapes
    half = layer.allocate_inference_cache(3, 9, dtype=BF16)
    recurrent = {"M": "ssm", "G": "recurrent", "K": "recurrent", "P": "recurrent", "S": "ssm", "R": "lru",
                 "L": "recurrent"}.get(letter)
    for name, t in half.states.items():        # recurrent states in the compute dtype, the rest as asked
        assert t.dtype == (F32 if name == recurrent else BF16), name
    table = SlotTable(3, 9)
    shared = layer.allocate_inference_cache(3, 9, table=table)
    assert shared.table is table and shared.shared
    with pytest.raises(ValueError, match="part of a model's InferenceCache"):
        shared.reset()
    with pytest.raises(ValueError, match=r"table holds 3 slots x 9 tokens, not 4 x 9"):
        layer.allocate_inference_cache(4, 9, table=table)
    with pytest.raises(TypeError, match="dtype must be a floating-point torch.dtype, got torch.int64"):
        layer.allocate_inference_cache(3, 9, dtype=torch.int64)


def test_reset_default_list_tensor_and_repeats():
    m = model()
    cache = filled(m)
    assert cache.lengths.tolist() == [2, 1, 0, 3] and nonzero_slots(cache) == [0, 1, 3]
    held = {k: v[3].clone() for k, v in snapshot(cache).items() if k != "lengths"}
    cache.reset([1, 1])                                  # repeats allowed
    assert cache.lengths.tolist() == [2, 0, 0, 3] and nonzero_slots(cache) == [0, 3]
    cache.reset(torch.tensor([0]))
    assert cache.lengths.tolist() == [0, 0, 0, 3] and nonzero_slots(cache) == [3]
    assert all(torch.equal(snapshot(cache)[k][3], v) for k, v in held.items())
    cache.reset([])
    assert nonzero_slots(cache) == [3]
    cache.reset()
    assert cache.lengths.tolist() == [0, 0, 0, 0] and nonzero_slots(cache) == [] and cache.free_slots() == [0, 1, 2, 3]


def test_lengths_is_a_copy():
    """``cache.lengths`` is a host copy: a later forward does not change a copy taken before it, and
    writing into a copy changes neither the cache's lengths nor what the next forward continues from."""
    m = model("GA")
    cache = filled(m)
    taken = cache.lengths
    with torch.no_grad():
        m(torch.tensor([[11, 12, 13, 14]]), PackedSeqParams.from_lengths([3, 1]), cache=cache, cache_slots=[2, 0])
    assert taken.tolist() == [2, 1, 0, 3], f"a copy taken before the forward changed: {taken.tolist()}"
    assert cache.lengths.tolist() == [3, 1, 3, 3]
    cache.lengths[1] = 7
    assert cache.lengths.tolist() == [3, 1, 3, 3], "writing into the copy changed the cache's lengths"
    assert cache.free_slots() == []


def test_advance_refuses_slots_resolved_for_another_cache():
    """A :class:`SlotBatch` of one cache advances that cache only: another cache refuses it and keeps
    its lengths and states."""
    m = model("GA")
    mine, other = filled(m), filled(m)
    before = snapshot(other)
    batch = mine.resolve([2, 0], rows=2, steps=3, varlen=None, device="cpu")
    with pytest.raises(ValueError, match="cache_slots were resolved for another cache"):
        other.advance(batch)
    assert same(before, snapshot(other)), "the refused advance changed the other cache"
    mine.advance(batch)                                  # negative control: its own cache takes it
    assert mine.lengths.tolist() == [5, 1, 3, 3]


@pytest.mark.parametrize("slots,error,match", [
    pytest.param(torch.tensor([True, False]), TypeError, "slots must be a 1-D integer tensor", id="bool-tensor"),
    pytest.param([0, True], TypeError, "slots must hold ints", id="bool-element"),
    pytest.param([-1], ValueError, r"slots\[0\]=-1 is out of range", id="negative"),
    pytest.param(3, TypeError, "slots must be a 1-D integer tensor or a list of ints", id="bare-int"),
])
def test_reset_refusals_leave_the_cache_unchanged(slots, error, match):
    cache = filled(model("GA"))
    before = snapshot(cache)
    with pytest.raises(error, match=match):
        cache.reset(slots)
    assert same(before, snapshot(cache))


def test_mixer_reset_default_and_named():
    layer = make_mixer("G")
    cache = layer.allocate_inference_cache(3, 8)
    x = torch.cat(sequences([2, 3]), 0).unsqueeze(0)
    with torch.no_grad():
        layer(x, PackedSeqParams.from_lengths([2, 3]), cache=cache, cache_slots=[2, 0])
    cache.reset([2])
    assert cache.table.lengths.tolist() == [3, 0, 0] and not cache["recurrent"][2].any()
    assert cache["recurrent"][0].any()
    cache.reset()
    assert cache.table.lengths.tolist() == [0, 0, 0] and not any(t.any() for t in cache.states.values())


@pytest.mark.parametrize("form", [pytest.param(list, id="list"), pytest.param(torch.tensor, id="int64-tensor"),
                                  pytest.param(lambda s: torch.tensor(s, dtype=torch.int32), id="int32-tensor")])
def test_cache_slots_forms_agree(form):
    m = model("MGA")
    ids, p = torch.tensor([[5, 6, 7, 8, 9]]), PackedSeqParams.from_lengths([2, 3])
    with torch.no_grad():
        want = m(ids, p, cache=m.allocate_inference_cache(3, 8), cache_slots=[2, 0])["logits"]
        got = m(ids, p, cache=(cache := m.allocate_inference_cache(3, 8)), cache_slots=form([2, 0]))["logits"]
    assert torch.equal(got, want) and cache.lengths.tolist() == [3, 0, 2]


BAD_SLOTS = [
    pytest.param(torch.tensor([True, False]), "cache_slots must be a 1-D integer tensor", id="bool-tensor"),
    pytest.param(torch.tensor([[0, 1]]), "cache_slots must be a 1-D integer tensor", id="2-D-tensor"),
    pytest.param([0, False], "cache_slots must hold ints", id="bool-element"),
    pytest.param((0.0, 1.0), "cache_slots must hold ints", id="float-elements"),
]


@pytest.mark.parametrize("slots,match", BAD_SLOTS)
def test_model_refuses_bad_cache_slots_forms(slots, match):
    m = model("MGA")
    cache = filled(m)
    before = snapshot(cache)
    with pytest.raises(TypeError, match=match):
        m(torch.tensor([[5, 6, 7]]), PackedSeqParams.from_lengths([1, 2]), cache=cache, cache_slots=slots)
    assert same(before, snapshot(cache))


@pytest.mark.parametrize("slots,match", BAD_SLOTS)
@pytest.mark.parametrize("letter", LETTERS)
def test_mixer_refuses_bad_cache_slots_forms(letter, slots, match):
    layer = make_mixer(letter)
    cache = layer.allocate_inference_cache(2, 8)
    with torch.no_grad():
        layer(sequences([3])[0].unsqueeze(0), cache=cache, cache_slots=[1])
    before = snapshot(cache)
    with pytest.raises(TypeError, match=match):
        layer(sequences([2, 2])[0].reshape(2, 1, HIDDEN), cache=cache, cache_slots=slots)
    assert same(before, snapshot(cache))
