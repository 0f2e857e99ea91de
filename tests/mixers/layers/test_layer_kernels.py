"""Layers on (fake) kernels: each hands upstream what it requires, and equals the reference layer."""

import warnings

import pytest
import torch

from ssm_pack.pytest_plugin import layout
from tests.mixers.layers.test_layers import HIDDEN, LAYERS
from tests.support.fakes import install
from tests.support.oracles import rel_rms

EXPECTED = {"mamba2": {"conv", "ssd"}, "gdn": {"conv", "gdn"}, "kda": {"conv", "kda"}, "gdp": {"conv", "gdp"},
            "attention": {"flash"}, "gated_short_conv": {"conv"}, "mamba1": {"conv"}, "rg_lru": {"conv", "hgrn"},
            "lightning": {"simple_gla"}}


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_hands_the_kernels_what_they_need(monkeypatch, name):
    torch.manual_seed(0)
    module = LAYERS[name]().to(torch.bfloat16)
    x, params = layout([0, 15, 100, 37], hidden=HIDDEN, dtype=torch.bfloat16, pad_to_multiple_of=8, tail=3)
    with torch.no_grad():
        reference = [LAYERS[name](backend="reference")]
    reference[0].load_state_dict(module.state_dict())
    reference[0].to(torch.bfloat16)
    calls = install(monkeypatch)
    out = module(x, packed_seq_params=params)
    assert {kind for kind, _ in calls} == EXPECTED[name]
    # the conv and the SSD scan get the physical seq_idx in its canonical form (0, then +1 at every change;
    # it starts at 1 here, after the empty first document)
    canonical = torch.unique_consecutive(params.seq_idx[0], return_inverse=True)[1]
    assert params.seq_idx.tolist()[0][0] == 1
    for kind, meta in calls:
        if kind in ("conv", "ssd"):
            assert meta["seq_idx"].tolist()[0] == canonical.tolist()
    monkeypatch.undo()
    # fla's fakes run the reference at fla's own chunk size, so compare within bf16 rounding
    assert rel_rms(out.float(), reference[0](x, packed_seq_params=params).float()) < 1e-2


@pytest.mark.parametrize("name", list(LAYERS))
def test_auto_warns_once_when_a_kernel_cannot_pack(monkeypatch, name):
    import mixers.layers.base as packing
    monkeypatch.setattr(packing, "_WARNED", set())
    module = LAYERS[name]().to(torch.bfloat16)
    x, params = layout([5, 7], hidden=HIDDEN, dtype=torch.bfloat16)
    calls = install(monkeypatch, supported=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        module(x, packed_seq_params=params)
        module(x, packed_seq_params=params)
    messages = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert messages and len(messages) == len(set(messages)), messages       # each reason once
    assert all("runs ssm-pack's reference" in m for m in messages)
    assert calls == []                                                     # nothing reached a kernel


@pytest.mark.parametrize("name", ["mamba2", "gdn"])
def test_kernel_layer_accepts_fla_conv_when_causal_conv1d_is_missing(monkeypatch, name):
    """The short convolutions have two kernels: construction with backend='kernel' needs one of them."""
    from mixers.ops import dispatch
    reasons = {"causal_conv1d": "causal-conv1d is not installed"}
    monkeypatch.setattr(dispatch, "cached_support", lambda kernel, features=(): (
        (False, reasons[kernel]) if kernel in reasons else (True, None)))
    LAYERS[name](backend="kernel")
    reasons["fla_conv"] = "flash-linear-attention 0.5.2 is too old"
    with pytest.raises(RuntimeError, match="short conv.*causal-conv1d is not installed; and .*0.5.2 is too old"):
        LAYERS[name](backend="kernel")
