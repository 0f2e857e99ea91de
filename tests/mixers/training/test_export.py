"""The trained weights as one folder: a HybridLM's ``model.safetensors`` + ``config.json`` that
``load_exported`` rebuilds bitwise, a Hugging Face model's ``save_pretrained`` folder holding the
trained (not the initial) weights, and nothing written by a rank other than 0."""

from __future__ import annotations

import pytest
import torch

from mixers import HybridLM
from mixers.training.config import Config, ModelConfig
from mixers.training.export import export_model, load_exported

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "A": {"head_dim": 8}}


def _hybrid() -> tuple[HybridLM, Config]:
    config = Config(model=ModelConfig(pattern="MA", hidden_size=32, mixer_overrides=SMALL))
    torch.manual_seed(0)
    return HybridLM(256, 32, "MA", mixer_overrides=SMALL), config


def test_an_exported_hybrid_loads_back_bitwise(tmp_path):
    model, config = _hybrid()
    out = tmp_path / "runs" / "export"                         # folders not made yet
    assert export_model(model, config, out) == out
    loaded = load_exported(out)
    assert isinstance(loaded, HybridLM)
    want, got = model.state_dict(), loaded.state_dict()
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    ids = torch.randint(0, 256, (1, 13), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        assert torch.equal(loaded(ids)["logits"], model(ids)["logits"])


def test_a_folder_without_an_export_is_refused(tmp_path):
    with pytest.raises(ValueError, match=r"config\.json is missing; pass a directory written by ssm-pack train"):
        load_exported(tmp_path)


def test_only_rank_0_writes(tmp_path):
    model, config = _hybrid()
    assert export_model(model, config, tmp_path / "export", rank=1) is None
    assert not (tmp_path / "export").exists(), "a rank other than 0 wrote the export"


def test_a_hugging_face_model_exports_its_trained_weights(tmp_path):
    transformers = pytest.importorskip("transformers")
    from mixers.training.model import hf_model
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    initial = transformers.BambaForCausalLM(transformers.BambaConfig(
        hidden_size=32, intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_d_state=8,
        mamba_n_groups=2, mamba_chunk_size=8, num_hidden_layers=2, attn_layer_indices=[1], vocab_size=256,
        num_attention_heads=2, num_key_value_heads=1))
    initial.save_pretrained(tmp_path / "initial")
    config = Config(model=ModelConfig(kind="hf", hf_path=str(tmp_path / "initial")))
    model = hf_model(config)
    with torch.no_grad():                                       # "trained": every parameter moved
        for p in model.parameters():
            p.add_(0.25)
    assert export_model(model, config, tmp_path / "export") == tmp_path / "export"
    exported = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "export")
    assert type(exported).__name__ == "BambaForCausalLM"
    want = model.state_dict()                                   # Hugging Face's names (enable_packing)
    got = exported.state_dict()
    assert got.keys() == want.keys()
    for name in want:
        assert torch.equal(got[name], want[name]), f"{name}: the export holds other weights than the model's"
