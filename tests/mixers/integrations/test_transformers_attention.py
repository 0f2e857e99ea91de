"""enable_packing keeps documents apart in Hugging Face's attention layers too, called the way the
``Trainer`` calls a model: ``model(**batch)`` with a ``DataCollatorWithFlattening`` batch (labels
included, ``use_cache`` left at its config default). The reference is each document alone through
the unpatched model; the negative control is the same packed call on the unpatched model."""

import copy

import pytest
import torch

from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing
from tests.mixers.integrations.hf_models import FACTORIES, VOCAB, build, transformers
from tests.support.oracles import rel_rms

LENGTHS = [5, 17, 1, 30]                     # uneven; a 1-token document; crosses Mamba2's chunk of 8
NO_ATTENTION = ("mamba2", "mamba", "falcon_mamba")
ATTENTION = [m for m in FACTORIES if m not in NO_ATTENTION]


def _documents():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _collate(docs):
    return transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in docs])


def _alone(reference, docs):
    """(logits [T, V], loss) of each document alone through ``reference``, the loss averaged over
    every predicted token as the packed batch's labels average it."""
    logits, total, count = [], 0.0, 0
    for d in docs:
        ids = torch.tensor([d])
        out = reference(input_ids=ids, labels=ids)
        logits.append(out.logits[0])
        if len(d) > 1:
            total, count = total + out.loss * (len(d) - 1), count + len(d) - 1
    return torch.cat(logits), total / count


def _check_trainer_call(model, reference, mode, **extra):
    docs = _documents()
    batch = _collate(docs)
    getattr(model, mode)()
    getattr(reference, mode)()
    with torch.no_grad():
        want_logits, want_loss = _alone(reference, docs)
        leaked = reference(**batch, **extra)                   # negative control: unpatched, same call
        assert float((leaked.logits[0] - want_logits).abs().max()) > 1e-2
        enable_packing(model)
        got = model(**batch, **extra)
    assert rel_rms(got.logits[0], want_logits) <= 1e-5
    assert abs(float(got.loss - want_loss)) <= 1e-5 * float(want_loss)


CASES = [pytest.param(name, "sdpa", mode, id=f"{name}-{mode}") for name in NO_ATTENTION
         for mode in ("train", "eval")] + [
    pytest.param(name, impl, mode, id=f"{name}-{impl}-{mode}")
    for name in ATTENTION for impl in ("eager", "sdpa") for mode in ("train", "eval")]


@pytest.mark.parametrize(("name", "impl", "mode"), CASES)
def test_trainer_call_equals_each_document_alone(monkeypatch, name, impl, mode):
    model = build(name, monkeypatch, impl)
    _check_trainer_call(model, copy.deepcopy(model), mode)


@pytest.mark.parametrize("use_cache", [pytest.param(True, id="use_cache=True"),
                                       pytest.param(False, id="use_cache=False")])
@pytest.mark.parametrize("name", [pytest.param("qwen3_next", id="qwen3_next"), pytest.param("bamba", id="bamba")])
def test_explicit_use_cache(monkeypatch, name, use_cache):
    model = build(name, monkeypatch)
    _check_trainer_call(model, copy.deepcopy(model), "eval", use_cache=use_cache)


@pytest.mark.parametrize("name", [pytest.param("nemotron_h", id="nemotron_h"), pytest.param("granite", id="granite")])
def test_flex_attention_packed_call(monkeypatch, name):
    """flex_attention (the models that support it): the packed call equals each document alone
    (reference: sdpa, the same weights; an unpacked flex call is Hugging Face's own path, and
    compiles for minutes on CPU)."""
    model = build(name, monkeypatch, "flex_attention")
    reference = copy.deepcopy(model)
    reference.set_attn_implementation("sdpa")
    docs = _documents()
    with torch.no_grad():
        want_logits, want_loss = _alone(reference, docs)
        got = enable_packing(model)(**_collate(docs))
    assert model.config._attn_implementation == "ssm_pack_flex_attention"
    assert rel_rms(got.logits[0], want_logits) <= 1e-5
    assert abs(float(got.loss - want_loss)) <= 1e-5 * float(want_loss)


@pytest.mark.parametrize("impl", [pytest.param("flash_attention_2", id="flash_attention_2"),
                                  pytest.param("paged|eager", id="paged")])
def test_implementations_we_cannot_make_exact_are_refused(monkeypatch, impl):
    model = build("qwen3_next", monkeypatch)
    model.config._attn_implementation_internal = impl              # as loaded with it (no flash-attn on CPU)
    with pytest.raises(ValueError, match=r"attn_implementation='sdpa'") as err:
        enable_packing(model)
    assert repr(impl) in str(err.value)
    assert not any(isinstance(m, PackedMixer) for m in model.modules())          # nothing swapped
    assert getattr(model, "_ssm_pack_packing", None) is None
    model.config._attn_implementation_internal = "sdpa"
    enable_packing(build("mamba2", monkeypatch))            # no attention layer: nothing to refuse


@pytest.mark.parametrize("name", [pytest.param("qwen3_next", id="qwen3_next"), pytest.param("mamba2", id="mamba2")])
def test_packed_batch_with_a_padding_mask_is_refused(monkeypatch, name):
    """A packed batch with a padding attention_mask is refused before any layer runs; with an
    all-ones mask it is exact."""
    model = enable_packing(build(name, monkeypatch))
    reference = disable_packing(copy.deepcopy(model))
    docs = _documents()
    batch = _collate(docs)
    calls = []
    monkeypatch.setattr(PackedMixer, "forward", _counting(PackedMixer.forward, calls))
    mask = torch.ones_like(batch["input_ids"])
    mask[0, -1] = 0
    with pytest.raises(ValueError, match="attention_mask with padding"):
        model(**batch, attention_mask=mask)
    custom = torch.ones(1, 1, mask.shape[1], mask.shape[1], dtype=torch.bool).tril()     # a 4D mask of the user's
    with pytest.raises(ValueError, match="4D attention_mask"):
        model(**batch, attention_mask=custom)
    assert calls == []
    with torch.no_grad():
        got = model(**batch, attention_mask=torch.ones_like(mask)).logits[0]
        assert calls
        assert rel_rms(got, _alone(reference, docs)[0]) <= 1e-5


def _counting(forward, calls):
    def wrapped(self, *args, **kwargs):
        calls.append(1)
        return forward(self, *args, **kwargs)
    return wrapped


def test_disable_packing_restores_the_implementation(monkeypatch):
    model = build("bamba", monkeypatch, "eager")
    enable_packing(model)
    assert model.config._attn_implementation == "ssm_pack_eager"
    disable_packing(model)
    assert model.config._attn_implementation == "eager"
    enable_packing(model)                                    # and packing can be turned on again
    with torch.no_grad():
        got = model(**_collate(_documents())).logits[0]
    assert rel_rms(got, _alone(disable_packing(copy.deepcopy(model)), _documents())[0]) <= 1e-5


def test_a_deep_copy_of_a_patched_model_packs_on_its_own(monkeypatch):
    """A deep copy (an EMA or reference model) reads its own calls' boundaries, not the original's."""
    model = build("bamba", monkeypatch)
    reference = copy.deepcopy(model)
    twin = copy.deepcopy(enable_packing(model))
    docs = _documents()
    batch = _collate(docs)
    with torch.no_grad():
        want = _alone(reference, docs)[0]
        model(input_ids=torch.tensor([docs[3]]))             # the original's last call is not packed
        assert rel_rms(twin(**batch).logits[0], want) <= 1e-5
        twin(input_ids=torch.tensor([docs[3]]))
        assert rel_rms(model(**batch).logits[0], want) <= 1e-5
