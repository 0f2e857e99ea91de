"""enable_packing on a tiny RecurrentGemma (``RecurrentGemmaForCausalLM``: two recurrent blocks, one
local attention block with a window shorter than the documents), what only RecurrentGemma needs
beyond test_transformers_families.py (which checks every family, with sdpa, against each document
alone, the gradient leak, the weights' round trip and both training calls): eager attention, and
both recurrent blocks swapped for ``RGLRUMixer``. Each check has its negative control on the
unpatched model."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import RGLRUMixer  # noqa: E402
from mixers.integrations.transformers import PackedMixer, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import VOCAB, build  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

LENGTHS = [7, 1, 12]                       # uneven; a 1-token document; longer than the conv and the window


def _documents():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _flattened(docs, **collator):
    batch = transformers.DataCollatorWithFlattening(**collator)([{"input_ids": d} for d in docs])
    batch.pop("labels")
    return batch


def _alone(model, docs):
    """Each document alone through the model as it is, as the Trainer calls it (``use_cache=False``)."""
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([d]), use_cache=False).logits[0] for d in docs])


STYLES = [pytest.param({}, id="position_ids"), pytest.param({"return_flash_attn_kwargs": True}, id="cu_seq_lens"),
          pytest.param({"return_seq_idx": True}, id="seq_idx")]


@pytest.mark.parametrize("collator", STYLES)
def test_flattened_batch_equals_each_document_alone_with_eager_attention(monkeypatch, collator):
    """Eager attention (the families test runs sdpa): its sliding window, shorter than the documents."""
    model = build("recurrent_gemma", monkeypatch, "eager")
    docs = _documents()
    batch = _flattened(docs, **collator)
    want = _alone(model, docs)
    if not collator:            # negative control: Hugging Face's layers leak (its RG-LRU resets, its conv does not)
        with torch.no_grad():
            assert float((model(**batch, use_cache=False).logits[0] - want).abs().max()) > 1e-2
    enable_packing(model)
    assert sum(isinstance(m, PackedMixer) and isinstance(m.mixer, RGLRUMixer) for m in model.modules()) == 2
    with torch.no_grad():
        got = model(**batch).logits[0]
    assert rel_rms(got, want) <= 1e-5
