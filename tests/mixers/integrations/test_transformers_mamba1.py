"""enable_packing on tiny random-weight Mamba, Falcon-Mamba and Jamba models (``MambaForCausalLM``,
``FalconMambaForCausalLM``: two selective-scan layers, no attention; ``JambaForCausalLM``: a
selective-scan layer, then attention with a mixture of experts): a flattened batch of three documents
equals each document alone, no gradient crosses from one document to another, the weights go back
to the unpatched model bit for bit, and both call styles (the ``Trainer``'s ``model(**batch)`` with
``use_cache=False``, and a plain loop's ``model(**batch)`` with the model's default ``use_cache``)
train like the documents alone. Each check has its negative control on the unpatched model."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import Mamba1Mixer  # noqa: E402
from mixers.checkpoints import SOURCES  # noqa: E402
from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import VOCAB, build  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

LENGTHS = [11, 1, 70]                      # uneven; a 1-token document; crosses the scan's chunk of 64 and the conv
FAMILIES = [pytest.param("mamba", id="mamba"), pytest.param("falcon_mamba", id="falcon_mamba"),
            pytest.param("jamba", id="jamba")]
SWAPPED = {"mamba": 2, "falcon_mamba": 2, "jamba": 1}
NORM = {"mamba": None, "falcon_mamba": "weightless", "jamba": "weighted"}


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
@pytest.mark.parametrize("family", FAMILIES)
def test_flattened_batch_equals_each_document_alone(monkeypatch, family, collator):
    model = build(family, monkeypatch)
    docs = _documents()
    batch = _flattened(docs, **collator)
    want = _alone(model, docs)
    with torch.no_grad():                                      # negative control: Hugging Face's layers leak
        assert rel_rms(model(**batch).logits[0], want) > 1e-2
    enable_packing(model)
    mixers = [m.mixer for m in model.modules() if isinstance(m, PackedMixer)]
    assert len(mixers) == SWAPPED[family] and all(isinstance(m, Mamba1Mixer) for m in mixers)
    assert {m.config.dt_bc_norm for m in mixers} == {NORM[family]}
    with torch.no_grad():
        got = model(**batch).logits[0]
    assert rel_rms(got, want) <= 1e-5


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


@pytest.mark.parametrize("target", [pytest.param(i, id=f"doc{i}") for i in (1, 2)])
@pytest.mark.parametrize("family", FAMILIES)
def test_no_gradient_crosses_documents(monkeypatch, family, target):
    model = build(family, monkeypatch)
    batch = _flattened(_documents())
    assert _cross_gradient(model, batch, target) > 1e-6      # negative control: unpatched, it reaches back
    enable_packing(model)
    assert _cross_gradient(model, batch, target) == 0.0


@pytest.mark.parametrize("family", FAMILIES)
def test_weights_round_trip_bitwise_through_the_patch(monkeypatch, family):
    model = build(family, monkeypatch)
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


def _loss_alone(model, docs):
    """The packed labels' loss from each document alone: mean over every predicted token."""
    total, count = 0.0, 0
    for d in docs:
        if len(d) > 1:
            ids = torch.tensor([d])
            total, count = total + model(input_ids=ids, labels=ids).loss * (len(d) - 1), count + len(d) - 1
    return total / count


def _trainer_step(model, batch):
    """What ``Trainer`` does with a ``DataCollatorWithFlattening`` batch (``use_cache=False`` in training)."""
    return model(**batch, use_cache=False).loss


def _plain_step(model, batch):
    """A plain loop: ``model(**batch)`` as is (the config's ``use_cache``), the loss read from the output."""
    return model(**batch).loss


def _loss_and_grads(model, loss):
    """``(loss, gradients)`` in Hugging Face's parameter names (a swapped layer's through its converter)."""
    loss.backward()
    swapped = {path: m for path, m in model.named_modules() if isinstance(m, PackedMixer)}
    grads = {k: p.grad for k, p in model.named_parameters() if not any(k.startswith(f"{s}.") for s in swapped)}
    for path, m in swapped.items():
        ours = {k: p.grad for k, p in m.mixer.named_parameters()}
        grads.update((f"{path}.{k}", g) for k, g in SOURCES[m.source].to_upstream(ours, m.mixer.config).items())
    return float(loss.detach()), grads


def _worst(grads, want):
    assert grads.keys() == want.keys()
    return max(rel_rms(grads[k], want[k]) for k in want if want[k].abs().max() > 0)


@pytest.mark.parametrize("step", [pytest.param(_trainer_step, id="trainer"), pytest.param(_plain_step, id="loop")])
@pytest.mark.parametrize("family", FAMILIES)
def test_both_call_styles_train_like_each_document_alone(monkeypatch, family, step):
    """Loss and every weight's gradient of a packed training step equal those of the documents run
    alone (train mode); the unpatched packed step's gradients differ (negative control)."""
    model = build(family, monkeypatch).train()
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
@pytest.mark.parametrize("family", FAMILIES)
def test_the_returned_cache_is_refused_and_generate_runs_after_disable(monkeypatch, family):
    """An eval call with the default ``use_cache`` returns Hugging Face's cache object, which the swapped
    layers did not fill: continuing from it raises with the fix; after ``disable_packing`` the
    model decodes with its own cache again."""
    model = enable_packing(build(family, monkeypatch))
    ids = torch.tensor([_documents()[0]])
    out = model(input_ids=ids)
    assert out.cache is not None                        # transformers' DynamicCache, left unfilled
    with pytest.raises(RuntimeError, match="call disable_packing"):
        model(input_ids=ids[:, -1:], cache=out.cache, use_cache=True)
    disable_packing(model)
    assert model.generate(ids, max_new_tokens=3, do_sample=False).shape == (1, ids.shape[1] + 3)
