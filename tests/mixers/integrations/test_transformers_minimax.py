"""enable_packing on a tiny MiniMax (``MiniMaxForCausalLM``: a lightning-attention layer, then a
full-attention layer, each followed by a mixture of experts), what only MiniMax needs beyond
test_transformers_families.py (which checks every family against each document alone, the gradient
leak, the weights' round trip and both training calls): the lightning layer's derived decay tables
stay in the state dict, and left / right padded rows (MiniMax zeroes the padded q, k, v) equal the
documents."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import LightningMixer  # noqa: E402
from mixers.integrations.transformers import PackedMixer, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import VOCAB, build  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

LENGTHS = [11, 1, 19]                      # uneven; a 1-token document; crosses MiniMax's blocks of 8


def _documents():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def test_the_lightning_layer_is_swapped_and_its_decay_tables_stay(monkeypatch):
    model = build("minimax", monkeypatch)
    tables = {k: v.clone() for k, v in model.state_dict().items() if k.endswith(("_decay", "slope_rate"))}
    assert any(k.endswith("self_attn.diagonal_decay") for k in tables)
    enable_packing(model)
    assert sum(isinstance(m, PackedMixer) and isinstance(m.mixer, LightningMixer) for m in model.modules()) == 1
    patched = model.state_dict()
    assert all(torch.equal(patched[k], v) for k, v in tables.items())


@torch.no_grad()
def test_padded_batch_runs_as_packed_rows(monkeypatch):
    """Left and right padding (MiniMax zeroes the padded q, k, v of its lightning layer; the patched
    layer drops them): the real tokens equal the documents alone; the same rows unmasked differ."""
    model = enable_packing(build("minimax", monkeypatch))
    docs = _documents()
    width = max(LENGTHS)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        cols = slice(0, len(d)) if i % 2 else slice(width - len(d), width)          # right / left padding
        ids[i, cols], mask[i, cols] = torch.tensor(d), 1
    got = model(input_ids=ids, attention_mask=mask).logits
    unmasked = model(input_ids=ids).logits
    for i, d in enumerate(docs):
        alone = model(input_ids=torch.tensor([d])).logits[0]
        assert rel_rms(got[i][mask[i].bool()], alone) <= 1e-5
    assert float((unmasked[0][mask[0].bool()] - model(input_ids=torch.tensor([docs[0]])).logits[0]).abs().max()) > 1e-2


def test_a_misshapen_decay_table_is_refused_as_the_unpatched_model_refuses_it(monkeypatch):
    """A checkpoint's decay table of another shape (one that broadcasts onto the model's): the same
    size-mismatch error as the unpatched model, and the table the layer keeps is unchanged."""
    import copy
    model = build("minimax", monkeypatch)
    patched = enable_packing(copy.deepcopy(model))
    key = "model.layers.0.self_attn.diagonal_decay"
    checkpoint = dict(model.state_dict())
    checkpoint[key] = checkpoint[key][..., :1] + 1.0                # [1, 2, 8, 1]: broadcasts onto [1, 2, 8, 8]
    before = patched.state_dict()[key].clone()
    with pytest.raises(RuntimeError) as want:
        model.load_state_dict(dict(checkpoint))
    with pytest.raises(RuntimeError) as got:
        patched.load_state_dict(dict(checkpoint))
    assert f"size mismatch for {key}" in str(want.value)
    assert str(got.value) == str(want.value), "the patched model reports the mis-shaped table otherwise"
    assert torch.equal(patched.state_dict()[key], before), "the kept decay table was overwritten"
