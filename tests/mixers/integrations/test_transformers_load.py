"""load_state_dict on a patched model: a Hugging Face checkpoint with a missing, an unexpected or a
mis-shaped key is reported in Hugging Face's names exactly as the unpatched model reports it, and a
mis-shaped tensor of a swapped layer is refused before any parameter is written."""

import copy

import pytest
import torch

from mixers.integrations.transformers import enable_packing
from tests.mixers.integrations.hf_models import build

SSM_LAYER = {"mamba2": ("backbone.layers.0.mixer", "D"), "qwen3_next": ("model.layers.0.linear_attn", "A_log"),
             "bamba": ("model.layers.0.mamba", "dt_bias"),
             "kimi_linear": ("model.layers.0.self_attn", "forget_gate.A_log"),
             "nemotron_h": ("model.layers.0.mixer", "conv1d.weight"),
             "granite": ("model.layers.0.mamba", "norm.weight"),
             "falcon_h1": ("model.layers.0.mamba", "out_proj.weight"),
             "qwen3_5": ("model.layers.0.linear_attn", "in_proj_z.weight"),
             "mamba": ("backbone.layers.0.mixer", "A_log"),
             "falcon_mamba": ("backbone.layers.1.mixer", "x_proj.weight"),
             "jamba": ("model.layers.0.mamba", "dt_layernorm.weight")}
SSM_KEY = {name: f"{layer}.{key}" for name, (layer, key) in SSM_LAYER.items()}
MODELS = [pytest.param(name, id=name) for name in SSM_KEY]


def _pair(name, monkeypatch):
    """(unpatched, patched) holding the same weights, and a checkpoint of other weights."""
    unpatched = build(name, monkeypatch)
    patched = enable_packing(copy.deepcopy(unpatched))
    checkpoint = {k: v + 0.5 if v.is_floating_point() else v for k, v in unpatched.state_dict().items()}
    return unpatched, patched, checkpoint


def _snapshot(model):
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _load(model, checkpoint, strict):
    try:
        result = model.load_state_dict(checkpoint, strict=strict)
    except RuntimeError as err:
        return str(err).replace(type(model).__name__, "Model"), None
    return None, (list(result.missing_keys), list(result.unexpected_keys))


def _same_report_and_weights(name, monkeypatch, edit, strict):
    unpatched, patched, checkpoint = _pair(name, monkeypatch)
    checkpoint = edit(checkpoint)
    want = _load(unpatched, dict(checkpoint), strict)
    assert _load(patched, dict(checkpoint), strict) == want
    got, expected = patched.state_dict(), unpatched.state_dict()        # loaded alike (HF layout)
    assert got.keys() == expected.keys()
    assert all(torch.equal(got[k], expected[k]) for k in got)
    return want


@pytest.mark.parametrize("strict", [pytest.param(True, id="strict"), pytest.param(False, id="not_strict")])
@pytest.mark.parametrize("name", MODELS)
def test_missing_and_unexpected_keys_are_reported_in_hugging_face_names(monkeypatch, name, strict):
    """One key of a swapped layer missing, one unknown key in that layer and one elsewhere: the
    same report and the same loaded weights as the unpatched model."""
    key = SSM_KEY[name]
    extra = {f"{SSM_LAYER[name][0]}.extra_scale": torch.ones(3), "lm_head.extra": torch.ones(2)}
    error, lists = _same_report_and_weights(
        name, monkeypatch, lambda c: {**{k: v for k, v in c.items() if k != key}, **extra}, strict)
    if strict:
        assert f'Missing key(s) in state_dict: "{key}"' in error
    else:
        assert lists[0] == [key] and sorted(lists[1]) == sorted(extra)


@pytest.mark.parametrize(("name", "key"), [
    pytest.param("qwen3_next", "model.layers.0.linear_attn.in_proj_qkvz.weight", id="qwen3_next-in_proj_qkvz"),
    pytest.param("mamba2", "backbone.layers.1.mixer.in_proj.weight", id="mamba2-in_proj")])
def test_a_misshapen_tensor_is_named_and_nothing_is_written(monkeypatch, name, key):
    unpatched, patched, checkpoint = _pair(name, monkeypatch)
    checkpoint[key] = checkpoint[key][:-1]
    error, _ = _load(unpatched, dict(checkpoint), True)
    assert f"size mismatch for {key}" in error
    before = _snapshot(patched)
    with pytest.raises(RuntimeError) as err:
        patched.load_state_dict(checkpoint)
    line = next(x for x in error.splitlines() if key in x).strip()
    assert line in str(err.value)                                       # the same words as unpatched
    after = _snapshot(patched)
    assert all(torch.equal(before[k], after[k]) for k in before)     # bitwise: nothing written
    with pytest.raises(RuntimeError, match=f"size mismatch for {key}"):
        patched.load_state_dict(checkpoint, strict=False)
    after = _snapshot(patched)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_a_misshapen_tensor_loaded_into_a_submodule_is_reported_as_unpatched(monkeypatch):
    """``load_state_dict`` on a part of the model (the backbone, without the model-level check):
    a mis-shaped tensor of a swapped layer gives the unpatched backbone's report, nothing more."""
    unpatched, patched, _ = _pair("mamba2", monkeypatch)
    checkpoint = {k: v + 0.5 for k, v in unpatched.backbone.state_dict().items()}
    key = "layers.1.mixer.in_proj.weight"
    checkpoint[key] = checkpoint[key][:-1]
    for strict in (True, False):
        want, _ = _load(unpatched.backbone, dict(checkpoint), strict)
        got, _ = _load(patched.backbone, dict(checkpoint), strict)
        assert f"size mismatch for {key}" in want
        assert got == want, f"strict={strict}: the patched backbone reports otherwise:\n{got}"


@pytest.mark.parametrize("name", MODELS)
def test_native_names_give_parameter_paths_and_round_trip(name, monkeypatch):
    """Inside ``native_names`` every key is a parameter path (what torch.distributed.checkpoint
    reads); loading those keys back changes nothing, and Hugging Face's names return after."""
    from torch.distributed.checkpoint.state_dict import get_model_state_dict

    from mixers.integrations.transformers import native_names
    unpatched, patched, checkpoint = _pair(name, monkeypatch)
    hf_keys = list(patched.state_dict())
    with native_names(patched):
        native = _snapshot(patched)
        paths = ({n for n, _ in patched.named_parameters(remove_duplicate=False)}      # tied: lm_head too
                 | {n for n, _ in patched.named_buffers()})
        assert set(native) <= paths and any(".mixer." in k for k in native)
        assert set(get_model_state_dict(patched)) == set(native)
        patched.load_state_dict(native, strict=True)
    assert list(patched.state_dict()) == hf_keys and set(hf_keys) == set(unpatched.state_dict())
    for key, value in unpatched.state_dict().items():
        assert torch.equal(patched.state_dict()[key], value), key
    error, _ = _load(patched, {**checkpoint, SSM_KEY[name]: torch.zeros(3)}, strict=True)
    assert error is not None and SSM_KEY[name] in error          # the whole-load check is back


def test_a_swapped_layer_reads_a_padding_mask_passed_positionally(monkeypatch):
    """Hugging Face layers take ``(hidden_states, cache, attention_mask)``; the mask may come by
    position. Left padding: without the mask the real tokens would read the padding's state."""
    from mixers.integrations.transformers import PackedMixer
    _, patched, _ = _pair("bamba", monkeypatch)
    layer = next(m for m in patched.modules() if isinstance(m, PackedMixer))
    hidden = torch.randn(2, 9, 32, generator=torch.Generator().manual_seed(0))
    mask = torch.ones(2, 9, dtype=torch.long)
    mask[1, :4] = 0                                                   # row 1: 4 padding tokens first
    with torch.no_grad():
        by_keyword = layer(hidden, attention_mask=mask)
        by_position = layer(hidden, None, mask)
        unmasked = layer(hidden)
    assert torch.equal(by_position, by_keyword)
    assert not torch.allclose(unmasked[1, 4:], by_keyword[1, 4:], atol=1e-4)   # the mask matters
