"""State-reset regression suite: every mixer, every dtype, the length grid, padded layouts."""

import pytest
import torch
from torch import nn

from mixers import (
    AttentionMixer,
    GatedDeltaNetMixer,
    GatedDeltaProductMixer,
    GatedShortConvMixer,
    KDAMixer,
    LightningMixer,
    Mamba1Mixer,
    Mamba2Mixer,
    RGLRUMixer,
)
from mixers.layers import AttentionConfig, GatedDeltaNetConfig, KDAConfig, Mamba2Config
from ssm_pack import PackedSeqParams
from ssm_pack.pytest_plugin import layout
from ssm_pack.testing import LeakageCheckInconclusive, assert_no_cross_document_leakage, assert_packed_equals_unpacked
from tests.support.oracles import design_lengths

HIDDEN, CHUNK = 32, 16
LAYERS = {
    "mamba2": lambda backend="auto": Mamba2Mixer(HIDDEN, head_dim=16, state_size=8, chunk_size=CHUNK, backend=backend),
    "gdn": lambda backend="auto": GatedDeltaNetMixer(HIDDEN, head_dim=8, num_heads=2, num_v_heads=4,
                                                     chunk_size=CHUNK, backend=backend),
    "kda": lambda backend="auto": KDAMixer(HIDDEN, head_dim=8, num_heads=2, chunk_size=CHUNK, backend=backend),
    "gdp": lambda backend="auto": GatedDeltaProductMixer(HIDDEN, head_dim=8, num_heads=2, chunk_size=CHUNK,
                                                         backend=backend),
    "attention": lambda backend="auto": AttentionMixer(HIDDEN, head_dim=8, num_heads=4, num_kv_heads=2,
                                                       backend=backend),
    "gated_short_conv": lambda backend="auto": GatedShortConvMixer(HIDDEN, conv_bias=True, backend=backend),
    "mamba1": lambda backend="auto": Mamba1Mixer(HIDDEN, state_size=4, chunk_size=8, dt_bc_norm="weighted",
                                                 backend=backend),
    "rg_lru": lambda backend="auto": RGLRUMixer(HIDDEN, num_heads=4, backend=backend),
    "lightning": lambda backend="auto": LightningMixer(HIDDEN, head_dim=8, chunk_size=8, backend=backend),
}
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}


def build(name, dtype, seed=0):
    torch.manual_seed(seed)
    return LAYERS[name]().to(dtype)


@pytest.mark.parametrize("dtype", list(DTYPES), ids=list(DTYPES))
@pytest.mark.parametrize("name", list(LAYERS))
def test_design_grid_packed_equals_per_document(name, dtype):
    module = build(name, DTYPES[dtype])
    x, params = layout(design_lengths(CHUNK), hidden=HIDDEN, dtype=DTYPES[dtype], tail=3)
    assert_packed_equals_unpacked(module, x, params)


@pytest.mark.parametrize("name", list(LAYERS))
@pytest.mark.parametrize("lengths,pad", [
    pytest.param([0, 15, 100, 37], 8, id="padded-to-8"),
    pytest.param([1, 2, 3] * 60, 4, id="many-tiny-padded"),
])
def test_padded_layout_gives_the_unpadded_outputs(name, lengths, pad):
    module = build(name, torch.float64)
    x, padded = layout(lengths, hidden=HIDDEN, dtype=torch.float64, pad_to_multiple_of=pad, tail=2)
    assert_packed_equals_unpacked(module, x, padded)
    tight = PackedSeqParams.from_lengths(lengths)
    keep = torch.zeros(x.shape[1], dtype=torch.bool)
    starts = padded.cu_seqlens_q_padded.tolist()
    for s, n in zip(starts[:-1], lengths):
        keep[s:s + n] = True
    out_padded = module(x, packed_seq_params=padded)[:, keep]
    out_tight = module(x[:, keep], packed_seq_params=tight)
    assert (out_padded - out_tight).abs().max() < 1e-10


@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
@pytest.mark.parametrize("name", list(LAYERS))
def test_no_cross_document_leakage_with_negative_control(name, dtype):
    module = build(name, DTYPES[dtype])
    x, params = layout([1, 15, 0, 40, 2, 3], hidden=HIDDEN, dtype=DTYPES[dtype], pad_to_multiple_of=4, tail=2)
    assert assert_no_cross_document_leakage(module, x, params) >= 5


def test_the_checker_reports_a_module_that_cannot_leak():
    class PerToken(nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(HIDDEN, HIDDEN)

        def forward(self, hidden_states, packed_seq_params=None):
            return self.proj(hidden_states)

    x, params = layout([5, 7], hidden=HIDDEN)
    with pytest.raises(LeakageCheckInconclusive, match="could not have failed"):
        assert_no_cross_document_leakage(PerToken(), x, params)


def test_the_checker_catches_a_leaking_module():
    class Leaky(nn.Module):                     # a cumulative mean over the whole row: ignores the metadata
        def forward(self, hidden_states, packed_seq_params=None):
            return hidden_states.cumsum(1) / torch.arange(1, hidden_states.shape[1] + 1)[:, None]

    x, params = layout([5, 7], hidden=HIDDEN)
    with pytest.raises(AssertionError, match="document 0 -> document 1"):
        assert_no_cross_document_leakage(Leaky(), x, params)
    with pytest.raises(AssertionError, match="differs from per-document runs"):
        assert_packed_equals_unpacked(Leaky(), x.double(), params, check_grads=False)


class Hybrid(nn.Module):
    """Every mixer in one residual stack."""

    def __init__(self):
        super().__init__()
        self.layers = nn.ModuleList(LAYERS[name]() for name in LAYERS)

    def forward(self, hidden_states, packed_seq_params=None):
        for layer in self.layers:
            hidden_states = hidden_states + layer(hidden_states, packed_seq_params=packed_seq_params)
        return hidden_states


def test_hybrid_stack_end_to_end():
    torch.manual_seed(0)
    model = Hybrid().double()
    x, params = layout([0, 15, 100, 37, 1], hidden=HIDDEN, dtype=torch.float64, pad_to_multiple_of=4)
    assert_packed_equals_unpacked(model, x, params)
    # scale 10, not 1e3: products of three activations (the gated conv's B * x * C, lightning's
    # unscaled q k^T v) stacked residually overflow fp32 at +-1e3, and the check refuses to judge
    assert_no_cross_document_leakage(model.float(), x.float(), params, scale=10.0)


@pytest.mark.parametrize("name", list(LAYERS))
def test_unpacked_batch_rows_are_independent_sequences(name):
    module = build(name, torch.float64)
    x = torch.randn(3, 20, HIDDEN, dtype=torch.float64)
    out = module(x)
    for r in range(3):
        assert (module(x[r:r + 1]) - out[r:r + 1]).abs().max() < 1e-12


@pytest.mark.parametrize("name", list(LAYERS))
def test_packed_input_must_be_one_row(name):
    module = build(name, torch.float32)
    with pytest.raises(ValueError, match=r"packed input must be one row \[1, T, D\].*got B=2"):
        module(torch.randn(2, 8, HIDDEN), packed_seq_params=PackedSeqParams.from_lengths([3, 5]))


@pytest.mark.parametrize("name", list(LAYERS))
def test_kernel_backend_is_checked_at_construction(name):
    with pytest.raises(RuntimeError, match=r"backend='kernel'\): .*(not installed|no CUDA device|too old|missing)"):
        LAYERS[name](backend="kernel")


def test_bad_backend_name():
    with pytest.raises(ValueError, match="backend must be one of"):
        Mamba2Mixer(HIDDEN, backend="cuda")


def test_defaults_from_hidden_size_alone():
    for cls in (Mamba2Mixer, GatedDeltaNetMixer, KDAMixer, GatedDeltaProductMixer, AttentionMixer):
        module = cls(512)
        assert module.config.hidden_size == 512 and module(torch.randn(1, 4, 512)).shape == (1, 4, 512)
    with pytest.raises(ValueError, match="head_dim=48 must divide"):
        Mamba2Mixer(64, head_dim=48)
    with pytest.raises(ValueError, match="chunk_size must be a power of two"):
        GatedDeltaNetMixer(64, chunk_size=48)


def test_wrong_hidden_states_shape():
    with pytest.raises(ValueError, match=r"hidden_states must be \[B, T, D\]"):
        build("gdn", torch.float32)(torch.randn(8, HIDDEN))
    with pytest.raises(TypeError, match="GatedDeltaNetMixer: packed_seq_params must be a PackedSeqParams"):
        build("gdn", torch.float32)(torch.randn(1, 8, HIDDEN), packed_seq_params={"cu_seqlens": [0, 8]})


@pytest.mark.parametrize("cls, config", [
    pytest.param(Mamba2Mixer, Mamba2Config(HIDDEN, head_dim=16, state_size=8), id="mamba2"),
    pytest.param(GatedDeltaNetMixer, GatedDeltaNetConfig(HIDDEN, head_dim=8), id="gdn"),
    pytest.param(AttentionMixer, AttentionConfig(HIDDEN, head_dim=8), id="attention"),
])
def test_built_from_a_config_which_must_be_the_layers_own_and_alone(cls, config):
    module = cls(config=config)
    assert module.config is config and module(torch.randn(1, 4, HIDDEN)).shape == (1, 4, HIDDEN)
    with pytest.raises(TypeError, match=f"config must be a {type(config).__name__}, got KDAConfig"):
        cls(config=KDAConfig(HIDDEN, head_dim=8))
    with pytest.raises(ValueError, match="config is given, so hidden_size, head_dim would be ignored"):
        cls(HIDDEN, config=config, head_dim=4)
