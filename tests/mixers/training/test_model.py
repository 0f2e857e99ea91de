"""The blocks ``ssm-pack train`` shards, recomputes and compiles: a HybridLM's, and a Hugging Face
decoder's layers whether it keeps them under ``.model`` or ``.backbone``."""

from __future__ import annotations

import pytest
from torch import nn

pytest.importorskip("transformers")

from mixers.training.model import blocks  # noqa: E402
from tests.mixers.integrations.hf_models import build  # noqa: E402


@pytest.mark.parametrize("name, owner", [pytest.param("bamba", "model", id="bamba-model-layers"),
                                         pytest.param("mamba2", "backbone", id="mamba2-backbone-layers")])
def test_a_hugging_face_decoders_blocks_are_its_layers(monkeypatch, name, owner):
    model = build(name, monkeypatch)
    layers = getattr(model, owner).layers
    assert blocks(model) == list(layers) and len(layers) >= 2


def test_a_model_without_layers_is_refused():
    with pytest.raises(ValueError, match=r"Sequential keeps no \.model\.layers or \.backbone\.layers"):
        blocks(nn.Sequential(nn.Linear(2, 2)))
