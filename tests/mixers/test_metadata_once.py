"""The packing metadata is resolved once per forward, and the kernel path reads no tensor value.

* One ``HybridLM("MGKPA")`` forward and backward over a packed row builds the references' segment
  structure exactly once (it used to be built 15 times), and reads the boundaries once.
* With ``validate=False`` metadata, every layer's kernel path (the fake kernels of
  ``tests/support/fakes.py`` standing in for upstream) performs no host read of a tensor value: no
  ``.item()``, ``.tolist()``, ``bool/int/float(tensor)``, ``.numpy()``, ``torch.equal``,
  ``nonzero`` or ``unique`` (each a device synchronisation on a GPU).
"""

import traceback

import pytest
import torch
from torch.overrides import TorchFunctionMode

from mixers import HybridLM
from mixers.ops.device_policy import device_policy
from ssm_pack import PackedSeqParams, VarlenBatch
from ssm_pack.formats import segments
from tests.mixers.layers.test_layers import HIDDEN, LAYERS
from tests.support import fakes

OVERRIDES = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
             "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
LENGTHS = [5, 0, 40, 17, 1]


class Builds(list):
    """``Segments`` built from boundaries (each a host read); ``derived`` counts the cheap views
    ``Segments.expanded`` makes of one (Gated DeltaProduct's sub-steps: no value read)."""

    derived = 0


@pytest.fixture
def count_segments(monkeypatch):
    built = Builds()
    init, expanded = segments.Segments.__init__, segments.Segments.expanded
    deriving = []

    def counting(self, *args, **kwargs):
        if not deriving:
            built.append(1)
        init(self, *args, **kwargs)

    def derive(self, factor):
        deriving.append(1)
        try:
            out = expanded(self, factor)
        finally:
            deriving.pop()
        built.derived += out is not self
        return out

    monkeypatch.setattr(segments.Segments, "__init__", counting)
    monkeypatch.setattr(segments.Segments, "expanded", derive)
    return built


def test_one_hybrid_forward_builds_the_segments_once(count_segments):
    torch.manual_seed(0)
    model = HybridLM(256, 32, "MGKPA", backend="reference", mixer_overrides=OVERRIDES)
    params = PackedSeqParams.from_lengths(LENGTHS, total_tokens=70)
    ids = torch.randint(0, 256, (1, 70))
    model(ids, packed_seq_params=params, labels=ids)["loss"].backward()
    # GDP without states repeats the segment ids for its sub-steps; it derives no second Segments
    assert len(count_segments) == 1 and count_segments.derived == 0


def test_layers_given_the_prebuilt_metadata_build_nothing(count_segments):
    """Negative control of the count: a layer called alone with the params builds its own."""
    params = PackedSeqParams.from_lengths(LENGTHS, total_tokens=70)
    x = torch.randn(1, 70, HIDDEN)
    varlen = VarlenBatch.build(params, 70).materialize()
    count_segments.clear()
    for name in LAYERS:
        LAYERS[name](backend="reference")(x, packed_seq_params=varlen)
    assert count_segments == []
    LAYERS["gdn"](backend="reference")(x, packed_seq_params=params)
    assert len(count_segments) == 1


class HostReads(TorchFunctionMode):
    """Records every host read of a tensor value made outside the fake kernels."""

    METHODS = {"item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "__len__"}
    FUNCTIONS = {torch.equal, torch.nonzero, torch.unique, torch.masked_select, torch.Tensor.nonzero,
                 torch.Tensor.unique, torch.argwhere}

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", "")
        if name in self.METHODS or func in self.FUNCTIONS:
            stack = traceback.extract_stack()[:-1]
            if not any(frame.filename.endswith("fakes.py") for frame in stack):
                here = next((f for f in reversed(stack) if "/ssm_pack/" in f.filename or "/mixers/" in f.filename),
                            stack[-1])
                self.reads.append(f"{name} at {here.filename.split('/')[-1]}:{here.lineno} {here.line}")
        return func(*args, **(kwargs or {}))


def _unvalidated_params(lengths, total):
    offsets = [0]
    for n in lengths:
        offsets.append(offsets[-1] + n)
    cu = torch.tensor(offsets, dtype=torch.int32)
    return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, max_seqlen_q=max(lengths + [3]),
                           max_seqlen_kv=max(lengths + [3]), total_tokens=total, validate=False)


@pytest.mark.parametrize("name", list(LAYERS))
def test_kernel_path_reads_no_tensor_value(monkeypatch, name):
    torch.manual_seed(0)
    module = LAYERS[name]().to(torch.bfloat16)
    x = torch.randn(1, 66, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    calls = fakes.install(monkeypatch)
    with HostReads() as mode:
        params = _unvalidated_params([5, 0, 40, 18], 66)
        out = module(x, packed_seq_params=params)
        out.float().square().sum().backward()
    assert calls, "the fake kernels ran"
    assert mode.reads == []


def test_the_read_counter_sees_reads(monkeypatch):
    """Negative control: the same layer with validating metadata reads the boundaries."""
    module = LAYERS["gdn"]().to(torch.bfloat16)
    fakes.install(monkeypatch)
    with HostReads() as mode:
        module(torch.randn(1, 66, HIDDEN, dtype=torch.bfloat16), packed_seq_params=PackedSeqParams.from_lengths(
            [5, 0, 40, 18], total_tokens=66))
    assert mode.reads


def test_hybrid_kernel_path_reads_no_tensor_value(monkeypatch):
    torch.manual_seed(0)
    model = HybridLM(256, 32, "MGKPA", mixer_overrides=OVERRIDES).to(torch.bfloat16)
    ids = torch.randint(0, 256, (1, 66))
    fakes.install(monkeypatch)
    # the accelerator policy: the token-id check is a device-side assert there, a host read on the CPU
    with device_policy("cuda"), HostReads() as mode:
        out = model(ids, packed_seq_params=_unvalidated_params([5, 0, 40, 18], 66), labels=ids)
        out["loss"].backward()
    assert mode.reads == []
