"""enable_packing on a tiny random-weight RecurrentGemma (``RecurrentGemmaForCausalLM``: two recurrent
blocks, one local attention block with a window shorter than the documents): a flattened batch of
three documents equals each document alone, no gradient crosses from one document to another, the
weights go back to the unpatched model bit for bit, and the Trainer-style and plain calls agree.
Each check has its negative control on the unpatched model."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import RGLRUMixer  # noqa: E402
from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing  # noqa: E402
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


@pytest.mark.parametrize("impl", ["sdpa", "eager"])
@pytest.mark.parametrize("collator", STYLES)
def test_flattened_batch_equals_each_document_alone(monkeypatch, collator, impl):
    model = build("recurrent_gemma", monkeypatch, impl)
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


@pytest.mark.parametrize("use_cache", [pytest.param(False, id="trainer-use_cache-False"),
                                       pytest.param(None, id="plain-default-use_cache")])
@pytest.mark.parametrize("training", [False, True])
def test_trainer_style_and_plain_calls(monkeypatch, use_cache, training):
    """``model(**batch)`` as the Trainer calls it (``use_cache=False``, with labels: a loss) and as a plain
    loop does (the default ``use_cache``, which makes RecurrentGemma build a cache), train and eval."""
    model = build("recurrent_gemma", monkeypatch)
    docs = _documents()
    want = _alone(model, docs)
    enable_packing(model)
    model.train(training)
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    kwargs = {} if use_cache is None else {"use_cache": use_cache}
    out = model(**batch, **kwargs)
    assert rel_rms(out.logits[0].detach(), want) <= 1e-5
    out.loss.backward()
    grads = [m.mixer.recurrent_param.grad for m in model.modules() if isinstance(m, PackedMixer)]
    assert len(grads) == 2 and all(g is not None and torch.isfinite(g).all() for g in grads)


def _cross_gradient(model, batch, target: int) -> float:
    """Largest |d logits(document ``target``) / d embeddings| over the OTHER documents' tokens."""
    bounds = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, position_ids=batch["position_ids"], use_cache=False).logits[0]
    g = torch.Generator().manual_seed(target)
    lo, hi = bounds[target], bounds[target + 1]
    (logits[lo:hi] * torch.randn(hi - lo, VOCAB, generator=g)).sum().backward()
    others = torch.ones(bounds[-1], dtype=torch.bool)
    others[lo:hi] = False
    return float(embeds.grad[0, others].abs().max())


@pytest.mark.parametrize("target", [pytest.param(i, id=f"doc{i}") for i in range(len(LENGTHS))])
def test_no_gradient_crosses_documents(monkeypatch, target):
    model = build("recurrent_gemma", monkeypatch)
    batch = _flattened(_documents())
    if target > 0:         # negative control: unpatched, a document's logits reach back into earlier documents
        assert _cross_gradient(model, batch, target) > 1e-6
    enable_packing(model)
    assert _cross_gradient(model, batch, target) == 0.0


def test_weights_round_trip_bitwise_through_the_patch(monkeypatch):
    model = build("recurrent_gemma", monkeypatch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {k: type(m) for k, m in model.named_modules()}
    enable_packing(model)
    patched = model.state_dict()
    assert patched.keys() == original.keys() and all(torch.equal(patched[k], original[k]) for k in original)
    model.load_state_dict(original)
    disable_packing(model)
    assert {k: type(m) for k, m in model.named_modules()} == classes
    restored = model.state_dict()
    assert restored.keys() == original.keys() and all(torch.equal(restored[k], original[k]) for k in original)
