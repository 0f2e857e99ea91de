"""enable_packing on a tiny random-weight MiniMax (``MiniMaxForCausalLM``: a lightning-attention layer,
then a full-attention layer, each followed by a mixture of experts): a flattened batch of three
documents equals each document alone, no gradient crosses from one document to another, the weights
(and the lightning layer's derived buffers) go back to the unpatched model bit for bit, and both call
styles (the ``Trainer``'s ``model(**batch)`` with labels and ``use_cache=False``, and a plain loop's
``model(**batch)`` with the default ``use_cache``) run packed. Each check has its negative control on
the unpatched model."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import LightningMixer  # noqa: E402
from mixers.checkpoints import SOURCES  # noqa: E402
from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import VOCAB, build  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

LENGTHS = [11, 1, 19]                      # uneven; a 1-token document; crosses MiniMax's blocks of 8


def _documents():
    g = torch.Generator().manual_seed(7)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _flattened(docs, labels=False, **collator):
    batch = transformers.DataCollatorWithFlattening(**collator)([{"input_ids": d} for d in docs])
    if not labels:
        batch.pop("labels")
    return batch


def _alone(model, docs):
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs])


STYLES = [pytest.param({}, id="position_ids"), pytest.param({"return_flash_attn_kwargs": True}, id="cu_seq_lens"),
          pytest.param({"return_seq_idx": True}, id="seq_idx")]


@pytest.mark.parametrize("collator", STYLES)
def test_flattened_batch_equals_each_document_alone(monkeypatch, collator):
    model = build("minimax", monkeypatch)
    docs = _documents()
    batch = _flattened(docs, **collator)
    want = _alone(model, docs)
    with torch.no_grad():                                      # negative control: Hugging Face's layers leak
        assert float((model(**batch).logits[0] - want).abs().max()) > 1e-2
    enable_packing(model)
    assert sum(isinstance(m, PackedMixer) and isinstance(m.mixer, LightningMixer) for m in model.modules()) == 1
    with torch.no_grad():
        got = model(**batch).logits[0]
    assert rel_rms(got, want) <= 1e-5


def _cross_gradient(model, batch, target: int) -> float:
    """Largest |d logits(document ``target``) / d embeddings| over the OTHER documents' tokens."""
    bounds = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits[0]
    g = torch.Generator().manual_seed(target)
    lo, hi = bounds[target], bounds[target + 1]
    (logits[lo:hi] * torch.randn(hi - lo, VOCAB, generator=g)).sum().backward()
    others = torch.ones(bounds[-1], dtype=torch.bool)
    others[lo:hi] = False
    return float(embeds.grad[0, others].abs().max())


@pytest.mark.parametrize("target", [pytest.param(i, id=f"doc{i}") for i in range(len(LENGTHS))])
def test_no_gradient_crosses_documents(monkeypatch, target):
    model = build("minimax", monkeypatch)
    batch = _flattened(_documents())
    if target > 0:         # negative control: unpatched, a document's logits reach back into earlier documents
        assert _cross_gradient(model, batch, target) > 1e-6
    enable_packing(model)
    assert _cross_gradient(model, batch, target) == 0.0


def test_weights_round_trip_bitwise_through_the_patch(monkeypatch):
    """The patched state dict is the unpatched one, key for key and bit for bit (the lightning layer's
    slope_rate and decay tables included); loading it back and unpatching restores the model."""
    model = build("minimax", monkeypatch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    assert any(k.endswith("self_attn.diagonal_decay") for k in original)
    classes = {k: type(m) for k, m in model.named_modules()}
    enable_packing(model)
    patched = model.state_dict()
    assert patched.keys() == original.keys() and all(torch.equal(patched[k], original[k]) for k in original)
    model.load_state_dict(original)
    disable_packing(model)
    assert {k: type(m) for k, m in model.named_modules()} == classes
    restored = model.state_dict()
    assert restored.keys() == original.keys() and all(torch.equal(restored[k], original[k]) for k in original)


def _loss_alone(model, docs):
    """The packed labels' loss from each document alone: mean over every predicted token."""
    total, count = 0.0, 0
    for d in docs:
        if len(d) > 1:
            ids = torch.tensor([d])
            total, count = total + model(input_ids=ids, labels=ids).loss * (len(d) - 1), count + len(d) - 1
    return total / count


def _trainer_step(model, batch):
    """What ``Trainer`` does with a ``DataCollatorWithFlattening`` batch (cache off, as it sets it)."""
    return model(**batch, use_cache=False).loss


def _plain_step(model, batch):
    """A plain loop: ``model(**batch)`` as written, MiniMax's default ``use_cache`` (a cache is built)."""
    return model(**batch).loss


def _loss_and_grads(model, loss):
    """``(loss, gradients)``, in Hugging Face's parameter names: a swapped layer's gradients go
    through its converter (a pure rearrangement), as its weights do."""
    loss.backward()
    swapped = {path: m for path, m in model.named_modules() if isinstance(m, PackedMixer)}
    grads = {k: p.grad for k, p in model.named_parameters() if not any(k.startswith(f"{s}.") for s in swapped)}
    for path, m in swapped.items():
        ours = {k: p.grad for k, p in m.mixer.named_parameters()}
        grads.update((f"{path}.{k}", g) for k, g in SOURCES[m.source].to_upstream(ours, m.mixer.config).items())
    return float(loss.detach()), grads


def _worst(grads, want):
    assert grads.keys() == want.keys()
    return max(rel_rms(grads[k], want[k]) for k in want if want[k] is not None and want[k].abs().max() > 0)


@pytest.mark.parametrize("step", [pytest.param(_trainer_step, id="trainer"), pytest.param(_plain_step, id="loop")])
def test_both_call_styles_train_like_each_document_alone(monkeypatch, step):
    """Loss and every weight's gradient of a packed training step equal those of the documents run
    alone (train mode); the unpatched packed step's gradients differ (negative control)."""
    model = build("minimax", monkeypatch).train()
    docs = _documents()
    batch = _flattened(docs, labels=True)
    reference = copy.deepcopy(model)
    want_loss, want = _loss_and_grads(reference, _loss_alone(reference, docs))
    unpatched = copy.deepcopy(model)
    _, leaked = _loss_and_grads(unpatched, step(unpatched, batch))
    assert _worst(leaked, want) > 1e-3
    enable_packing(model)
    loss, grads = _loss_and_grads(model, step(model, batch))
    assert abs(loss - want_loss) <= 1e-5 * want_loss
    assert _worst(grads, want) <= 1e-5


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
