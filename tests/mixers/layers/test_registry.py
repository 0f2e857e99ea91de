"""The mixer registry is the one place that lists mixers: a mixer registered from outside the product
(``tests/support/toy_mixer.py``: config, layer and converter in one module, plus one entry) is
picked up by HybridLM, the size checks, the report, the demo's flags, the checkpoint converters
and enable_packing, with no product file edited."""

from __future__ import annotations

import argparse

import pytest
import torch

from mixers import HybridLM
from mixers.layers import registry
from mixers.layers.registry import MixerKind
from ssm_pack import PackedSeqParams
from tests.support.toy_mixer import ToyLayer, ToyMixer


@pytest.fixture
def toy(monkeypatch):
    """The toy mixer registered as ``Z`` for one test (the registry restored afterwards)."""
    monkeypatch.setattr(registry, "MIXERS", dict(registry.MIXERS))
    return registry.register(MixerKind("Z", "toy", ToyMixer, "state", ("tests.support.toy_mixer",),
                                       small={"head_dim": 4}))


def test_the_mixers_are_registered_in_pattern_order():
    assert registry.letters() == "MGKPACSRL"
    assert registry.legend() == ("M Mamba2, G Gated DeltaNet, K KDA, P Gated DeltaProduct, A attention, "
                                 "C gated short conv, S Mamba-1 selective scan, R RG-LRU, L lightning attention")
    assert all(kind.config is kind.mixer.CONFIG for kind in registry.MIXERS.values())


def test_a_registered_mixer_builds_and_trains_in_hybridlm(toy):
    model = HybridLM(32, 16, "GZ", mixer_overrides={"G": {"head_dim": 8}, "Z": {"head_dim": 4}}).double()
    assert isinstance(model.blocks[1].mixer, ToyMixer) and model.blocks[1].mixer.config.head_dim == 4
    ids = torch.randint(0, 32, (1, 12))
    out = model(ids, PackedSeqParams.from_lengths([5, 7]), labels=ids)
    out["loss"].backward()
    assert torch.isfinite(out["loss"]) and model.blocks[1].mixer.proj.weight.grad is not None


def test_pattern_errors_list_the_registered_letters(toy):
    with pytest.raises(ValueError, match=r"pattern must be letters of MGKPACSRLZ \(M Mamba2, .*, A attention, "
                                         r"C gated short conv, S Mamba-1 selective scan, R RG-LRU, "
                                         r"L lightning attention, Z toy\), got 'MX'"):
        HybridLM(32, 16, "MX")


def test_without_the_entry_the_letter_is_refused():
    """Negative control: the same pattern before registering."""
    with pytest.raises(ValueError, match="pattern must be letters of MGKPACSRL "):
        HybridLM(32, 16, "GZ")


def test_the_size_checks_read_the_registered_config(toy):
    from mixers.model.sizes import size_problem

    problem = size_problem("GZ", 30, {"G": {"head_dim": 6}, "Z": {"head_dim": 4}})
    assert (problem.index, problem.letter, problem.below, problem.above) == (1, "Z", 28, 32)
    assert "block 1 ('Z', ToyMixer) cannot be built: head_dim=4 must divide hidden_size=30" in problem.message()
    assert size_problem("GZ", 32, {"G": {"head_dim": 8}, "Z": {"head_dim": 4}}) is None


def test_the_report_shows_the_registered_mixer(toy):
    from mixers.report import full_report, inference_backends, mixer_backends

    assert [row[:2] for row in mixer_backends() if row[0] == "ToyMixer"] == [("ToyMixer", "toy scan")]
    assert [row[:2] for row in inference_backends() if row[0] == "ToyMixer"] == [("ToyMixer", "toy decode")]
    assert "ToyMixer" in full_report()


def test_the_demo_flags_accept_the_registered_letter(toy):
    from mixers.demo import DEFAULTS, build_parser, check_args, mixer_overrides

    assert "Z toy" in build_parser().format_help()
    assert mixer_overrides()["Z"] == {"head_dim": 4}
    args = argparse.Namespace(**{**DEFAULTS, "pattern": "mz", "device": "cpu", "out": "unused"})
    assert check_args(args).pattern == "MZ"
    with pytest.raises(ValueError, match=r"--pattern must be letters of MGKPACSRLZ \(.*, Z toy; any case\)"):
        check_args(argparse.Namespace(**{**vars(args), "pattern": "MY"}))


def test_the_converters_and_enable_packing_read_the_registered_mixer(toy):
    from mixers.checkpoints import SOURCES, from_module
    from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing

    layer = ToyLayer(16)
    assert SOURCES["toy"].mixer is ToyMixer
    assert torch.equal(from_module(layer).proj.weight, layer.linear.weight)
    model = torch.nn.Sequential(layer)
    x = torch.randn(1, 6, 16)
    want = model(x)
    enable_packing(model)
    assert isinstance(model[0], PackedMixer) and isinstance(model[0].mixer, ToyMixer)
    torch.testing.assert_close(model(x), want, rtol=0, atol=0)
    disable_packing(model)
    assert isinstance(model[0], ToyLayer) and torch.equal(model(x), want)


def test_without_the_entry_no_converter_reads_the_toy_layer():
    """Negative control: enable_packing finds nothing to swap before the toy is registered."""
    from mixers.checkpoints import SOURCES
    from mixers.integrations.transformers import enable_packing

    assert "toy" not in SOURCES
    with pytest.raises(ValueError, match="has no layer enable_packing converts"):
        enable_packing(torch.nn.Sequential(ToyLayer(16)))


@pytest.mark.parametrize("letter", list("MGKPACSRL"))
def test_the_cache_kind_says_how_a_slot_grows(letter):
    """``state``: a slot's states do not depend on ``max_seqlen``; ``kv``: they grow with it."""
    kind = registry.MIXERS[letter]
    mixer = kind.mixer(32, **{**kind.small, **({"head_dim": 8} if "head_dim" in kind.small else {})})
    short, long = (mixer.allocate_inference_cache(2, length) for length in (8, 64))
    sizes = [sum(t.numel() for t in cache.states.values()) for cache in (short, long)]
    assert (sizes[0] == sizes[1]) == (kind.cache == "state"), (kind.cache, sizes)


@pytest.mark.parametrize("entry, error", [
    pytest.param(dict(letter="M"), "letter 'M' is taken by Mamba2Mixer", id="taken"),
    pytest.param(dict(letter="z"), "one upper-case letter, got 'z'", id="lower-case"),
    pytest.param(dict(letter="ZZ"), "one upper-case letter, got 'ZZ'", id="two-letters"),
    pytest.param(dict(cache="paged"), "cache must be one of \\['kv', 'state'\\], got 'paged'", id="cache"),
    pytest.param(dict(mixer=torch.nn.Linear), "mixer must be a layer class with a CONFIG", id="no-config"),
])
def test_register_refuses_a_bad_entry(monkeypatch, entry, error):
    monkeypatch.setattr(registry, "MIXERS", dict(registry.MIXERS))
    fields = {"letter": "Z", "name": "toy", "mixer": ToyMixer, "cache": "state", **entry}
    with pytest.raises((ValueError, TypeError), match=error):
        registry.register(MixerKind(**fields))
    assert registry.letters() == "MGKPACSRL"
