"""``ssm-pack train`` on a Hugging Face hybrid (``model.kind = "hf"``): a tiny random Bamba saved
with ``save_pretrained``, trained packed through ``enable_packing``, checkpointed (its swapped
layers under their parameter paths), resumed, and exported in Hugging Face's layout, which the
unpatched model loads."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def tiny_bamba(tmp_path_factory):
    transformers.logging.set_verbosity_error()
    torch.manual_seed(0)
    model = transformers.BambaForCausalLM(transformers.BambaConfig(
        hidden_size=32, intermediate_size=64, mamba_n_heads=4, mamba_d_head=16, mamba_expand=2, mamba_d_state=8,
        mamba_n_groups=2, mamba_chunk_size=8, num_hidden_layers=2, attn_layer_indices=[1], vocab_size=256,
        num_attention_heads=2, num_key_value_heads=1))
    path = tmp_path_factory.mktemp("bamba")
    model.save_pretrained(path)
    return path


def _config(out, hf_path, *extra):
    from mixers.training.config import load_config
    return load_config(None, [f'out_dir="{out}"', 'model.kind="hf"', f'model.hf_path="{hf_path}"',
                              "data.carry=false", "data.max_tokens=128", "data.batch_packs=2", "train.steps=4",
                              "train.lr=1e-2", "metrics.plot=false", "metrics.tensorboard=false", *extra])


def test_a_hugging_face_hybrid_trains_resumes_and_exports(tiny_bamba, tmp_path):
    from mixers.training.train import train
    whole = train(_config(tmp_path / "whole", tiny_bamba), stream=open("/dev/null", "w"))
    losses = [json.loads(line)["loss"] for line in (tmp_path / "whole" / "metrics.jsonl").read_text().splitlines()]
    assert whole["step"] == 4 and losses[-1] < losses[0]
    exported = transformers.AutoModelForCausalLM.from_pretrained(whole["export"])
    assert type(exported).__name__ == "BambaForCausalLM"
    from mixers.training.checkpoint import read_extra
    assert read_extra(next((tmp_path / "whole" / "checkpoints").glob("step-*")))["step"] == 4

    # two steps, then the rest from the checkpoint: the same exported weights
    train(_config(tmp_path / "parts", tiny_bamba, "train.steps=2", "checkpoint.export=false"),
          stream=open("/dev/null", "w"))
    resumed = train(_config(tmp_path / "parts", tiny_bamba), stream=open("/dev/null", "w"))
    again = transformers.AutoModelForCausalLM.from_pretrained(resumed["export"])
    for (name, a), (_, b) in zip(exported.state_dict().items(), again.state_dict().items(), strict=True):
        assert torch.equal(a, b), name


def test_a_tokenizer_larger_than_the_model_vocabulary_is_refused_before_training(tiny_bamba, tmp_path):
    from mixers.training.train import Trainer
    small = transformers.AutoConfig.from_pretrained(tiny_bamba)
    small.vocab_size = 100
    path = tmp_path / "small"
    transformers.BambaForCausalLM(small).save_pretrained(path)
    with pytest.raises(ValueError, match="vocabulary of 100 but the tokenizer's is 256"):
        Trainer(_config(tmp_path / "out", path))
