"""enable_packing on tiny random-weight Hugging Face hybrid models: gradients of a flattened batch,
one document through the patched model, padding, the state dict, generation, bad calls and the
Trainer. Each family against each document alone, for every boundary form the collator writes:
test_transformers_families.py."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers.integrations.transformers import (  # noqa: E402
    PackedMixer,
    disable_packing,
    enable_packing,
    native_names,
)
from tests.mixers.integrations import hf_models  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

transformers.logging.set_verbosity_error()
VOCAB = 64
LENGTHS = [5, 17, 1, 30]                     # uneven; a 1-token document; crosses Mamba2's chunk of 8


def _sdpa(name):
    """The tiny model ``name`` of :mod:`tests.mixers.integrations.hf_models` with sdpa attention."""
    def factory(monkeypatch):
        return hf_models.FACTORIES[name](monkeypatch, "sdpa")
    factory.__name__ = name
    return factory


mamba2, qwen3_next = _sdpa("mamba2"), _sdpa("qwen3_next")
MODELS = [pytest.param(_sdpa(name), id=name) for name in hf_models.FACTORIES]         # mamba2, qwen3_next first


def _build(factory, monkeypatch):
    torch.manual_seed(0)
    model = factory(monkeypatch).float().eval()
    with torch.no_grad():                          # norms and biases away from their inits
        for p in model.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    return model


def _documents():
    g = torch.Generator().manual_seed(1)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _flattened(docs, **collator):
    batch = transformers.DataCollatorWithFlattening(**collator)([{"input_ids": d} for d in docs])
    batch.pop("labels")
    return batch


def _logits(model, **batch):
    return model(**batch).logits                   # use_cache left at its default, as Trainer calls


@pytest.mark.parametrize("factory", MODELS[:2])
def test_gradients_of_a_flattened_batch_are_the_sum_over_documents(monkeypatch, factory):
    """In fp64: in fp32 the decay parameters' gradients (A_log, dt_bias: one sum over every token
    with cancellation) move by up to 5e-3 relative between any two summation orders. The bound is
    1e-6, not fp64's 1e-10, because Hugging Face's norms and rotary tables run in fp32 even in an
    fp64 model (measured worst 1.4e-7, on an attention norm)."""
    model = enable_packing(_build(factory, monkeypatch).double())
    docs = _documents()
    batch = _flattened(docs)
    weights = torch.randn(sum(LENGTHS), VOCAB, dtype=torch.float64)

    def grads(loss):
        model.zero_grad()
        loss.backward()
        return {k: p.grad.clone() for k, p in model.named_parameters() if p.grad is not None}

    packed = grads((_logits(model, **batch)[0] * weights).sum())
    alone, start = {}, 0
    for d in docs:
        g = grads((_logits(model, input_ids=torch.tensor([d]))[0] * weights[start:start + len(d)]).sum())
        alone = {k: alone.get(k, 0) + v for k, v in g.items()}
        start += len(d)
    assert packed.keys() == alone.keys()
    worst = max(rel_rms(packed[k], alone[k]) for k in packed)
    assert worst <= 1e-6, worst


@pytest.mark.parametrize("factory", MODELS)
def test_patched_model_equals_the_unpatched_one_on_one_document(monkeypatch, factory):
    model = _build(factory, monkeypatch)
    ids = torch.tensor([_documents()[3]])
    want = _logits(model, input_ids=ids)
    enable_packing(model)
    assert rel_rms(_logits(model, input_ids=ids), want) <= 1e-5


@torch.no_grad()
def test_padded_batches_run_as_packed_rows(monkeypatch):
    """Left and right padding: the real tokens equal the documents alone; a padded row without
    packing (the negative control) differs."""
    model = enable_packing(_build(mamba2, monkeypatch))
    docs = _documents()
    width = max(LENGTHS)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        if i % 2:
            ids[i, :len(d)], mask[i, :len(d)] = torch.tensor(d), 1                  # right padding
        else:
            ids[i, width - len(d):], mask[i, width - len(d):] = torch.tensor(d), 1  # left padding
    got = _logits(model, input_ids=ids, attention_mask=mask)
    for i, d in enumerate(docs):
        alone = _logits(model, input_ids=torch.tensor([d]))[0]
        assert rel_rms(got[i][mask[i].bool()], alone) <= 1e-5
    unmasked = _logits(model, input_ids=ids)
    leak = unmasked[0][mask[0].bool()] - _logits(model, input_ids=torch.tensor([docs[0]]))[0]
    assert float(leak.abs().max()) > 1e-2


def test_state_dict_keeps_hugging_face_layout_and_disable_restores(monkeypatch):
    model = _build(qwen3_next, monkeypatch)
    original = {k: v.clone() for k, v in model.state_dict().items()}
    classes = {k: type(m) for k, m in model.named_modules()}
    enable_packing(model)
    patched = model.state_dict()
    assert patched.keys() == original.keys()
    assert all(torch.equal(patched[k], original[k]) for k in original)
    model.load_state_dict(original)                                        # HF layout loads into the patch
    with torch.no_grad():                                                  # a "fine-tuning" step
        for p in model.parameters():
            p.add_(0.01)
    ids = torch.tensor([_documents()[1]])
    tuned = _logits(model, input_ids=ids)
    disable_packing(model)
    assert {k: type(m) for k, m in model.named_modules()} == classes
    assert rel_rms(_logits(model, input_ids=ids), tuned) <= 1e-5
    assert all(torch.equal(model.state_dict()[k], original[k] + 0.01) for k in original)


def test_generation_asks_for_disable_packing(monkeypatch):
    model = enable_packing(_build(mamba2, monkeypatch))
    with pytest.raises(RuntimeError, match="disable_packing"):
        model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3, do_sample=False)
    disable_packing(model)
    assert model.generate(torch.tensor([[1, 2, 3]]), max_new_tokens=3, min_new_tokens=3,
                          do_sample=False).shape == (1, 6)


def test_bad_calls_are_refused(monkeypatch):
    with pytest.raises(ValueError, match="has no layer enable_packing converts"):
        enable_packing(torch.nn.Linear(2, 2))
    model = enable_packing(_build(mamba2, monkeypatch))
    with pytest.raises(ValueError, match="already called"):
        enable_packing(model)
    with pytest.raises(ValueError, match="one row"):
        model(input_ids=torch.zeros(2, 6, dtype=torch.long), position_ids=torch.tensor([[0, 1, 2, 0, 1, 2]] * 2))
    with pytest.raises(TypeError, match="must be a torch.nn.Module"):
        enable_packing("model")


def test_disable_packing_refuses_a_model_it_did_not_patch(monkeypatch):
    model = _build(mamba2, monkeypatch)
    with pytest.raises(ValueError, match=r"^enable_packing\(model\) was not called on this model$"):
        disable_packing(model)
    disable_packing(enable_packing(model))
    with pytest.raises(ValueError, match=r"^enable_packing\(model\) was not called on this model$"):
        disable_packing(model)                                              # a second time


def _hooks(model) -> dict:
    return {"forward": dict(model._forward_hooks), "always": dict(model._forward_hooks_always_called),
            "pre": dict(model._forward_pre_hooks), "load": dict(model._load_state_dict_pre_hooks),
            "state_dict": dict(model._state_dict_hooks)}


@torch.no_grad()
def test_disable_packing_after_native_names_leaves_no_hook_of_ours(monkeypatch):
    """``native_names`` re-registers the whole-load check on the way out; ``disable_packing`` then
    removes every hook ``enable_packing`` put on the model: the model is called as the unpatched one."""
    model = _build(mamba2, monkeypatch)
    unpatched = _hooks(model)
    ids = torch.tensor([_documents()[3]])
    want = _logits(model, input_ids=ids)
    enable_packing(model)
    with native_names(model):
        pass
    disable_packing(model)
    assert _hooks(model) == unpatched
    assert torch.equal(_logits(model, input_ids=ids), want)


def test_trainer_with_the_flattening_collator(monkeypatch, tmp_path):
    pytest.importorskip("accelerate")
    model = enable_packing(_build(qwen3_next, monkeypatch)).train()
    seen = []
    monkeypatch.setattr(PackedMixer, "forward", _spy(PackedMixer.forward, seen))
    g = torch.Generator().manual_seed(2)
    data = [{"input_ids": torch.randint(0, VOCAB, (n,), generator=g).tolist()} for n in (7, 19, 3, 11) * 4]
    args = transformers.TrainingArguments(output_dir=str(tmp_path), per_device_train_batch_size=4, max_steps=2,
                                          learning_rate=1e-2, logging_steps=1, save_strategy="no", report_to=[],
                                          use_cpu=True, disable_tqdm=True)
    before = {k: v.clone() for k, v in model.state_dict().items()}
    trainer = transformers.Trainer(model=model, args=args, train_dataset=data,
                                   data_collator=transformers.DataCollatorWithFlattening())
    losses = [log["loss"] for log in trainer.train() and trainer.state.log_history if "loss" in log]
    assert len(losses) == 2 and all(torch.isfinite(torch.tensor(losses)))
    assert seen and all(n == 4 for n in seen)                        # every step packed 4 documents
    assert any(not torch.equal(before[k], v) for k, v in model.state_dict().items())


def _spy(forward, seen):
    def wrapped(self, hidden_states, *args, **kwargs):
        if self._batch.params is not None:
            seen.append(self._batch.params.num_docs)
        return forward(self, hidden_states, *args, **kwargs)
    return wrapped


def test_boundaries_from_model_kwargs():
    from mixers.integrations.transformers import packing_from_model_kwargs
    assert packing_from_model_kwargs({"position_ids": torch.arange(6)[None], "input_ids": torch.zeros(1, 6)}) is None
    explicit = packing_from_model_kwargs({"cu_seq_lens_q": torch.tensor([0, 2, 6], dtype=torch.int32),
                                          "input_ids": torch.zeros(1, 6, dtype=torch.long)})
    assert explicit.cu_seqlens_q.tolist() == [0, 2, 6]
    mrope = packing_from_model_kwargs({"position_ids": torch.tensor([[[0, 1, 0, 1, 2]]] * 3)})
    assert mrope.cu_seqlens_q.tolist() == [0, 2, 5]
    # restarts at another value than 0 (DataCollatorWithFlattening(position_ids_start=2)) are
    # either found or refused, never merged into one document
    try:
        shifted = packing_from_model_kwargs({"position_ids": torch.tensor([[2, 3, 4, 2, 3]])})
    except ValueError as err:
        assert "cu_seq_lens_q" in str(err)
    else:
        assert shifted.cu_seqlens_q.tolist() == [0, 3, 5]
