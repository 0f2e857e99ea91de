"""The delta-rule mixers' behaviour defaults are fla's: a user moving from ``fla.layers`` to our
mixer with the same arguments gets the same layer (number of householder steps, negative
eigenvalues, value expansion, conv width, norm epsilon). Sizes are not compared: our configs derive
``head_dim`` and ``num_heads`` from ``hidden_size`` on purpose."""

import dataclasses
import inspect

import pytest

from mixers.layers import GatedDeltaNetConfig, GatedDeltaProductConfig, KDAConfig

BEHAVIOUR = ("expand_v", "conv_size", "allow_neg_eigval", "norm_eps", "num_householder")


@pytest.mark.parametrize("ours, theirs, want", [
    pytest.param(GatedDeltaNetConfig, "GatedDeltaNet", {"expand_v", "conv_size", "allow_neg_eigval", "norm_eps"},
                 id="gated-deltanet"),
    pytest.param(GatedDeltaProductConfig, "GatedDeltaProduct", set(BEHAVIOUR), id="gated-deltaproduct"),
    pytest.param(KDAConfig, "KimiDeltaAttention", {"expand_v", "conv_size", "allow_neg_eigval", "norm_eps"},
                 id="kda"),
])
def test_behaviour_defaults_equal_fla_layers(ours, theirs, want):
    layers = pytest.importorskip("fla.layers")
    upstream = {name: p.default for name, p in inspect.signature(getattr(layers, theirs).__init__).parameters.items()}
    mine = {f.name: f.default for f in dataclasses.fields(ours)}
    shared = {name for name in BEHAVIOUR if name in mine and name in upstream}
    assert shared == want, f"{ours.__name__} and fla's {theirs} no longer share {sorted(want - shared)}"
    for name in sorted(shared):
        assert mine[name] == upstream[name], \
            f"{ours.__name__}.{name} = {mine[name]!r}, fla's {theirs}: {upstream[name]!r}"
