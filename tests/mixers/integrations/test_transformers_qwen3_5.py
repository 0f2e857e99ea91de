"""enable_packing on a tiny random-weight Qwen3.5 (``Qwen3_5ForCausalLM``: one gated delta net layer,
one attention layer): a flattened batch of three documents equals each document alone, no gradient
crosses from one document to another, a plain training loop's gradients are the documents' own, and
the weights go back to the unpatched model bit for bit. Each check has its negative control on the
unpatched model, which on a CPU refuses the collator's boundaries and otherwise leaks."""

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers import GatedDeltaNetMixer  # noqa: E402
from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import SMALL, VOCAB, build  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

LENGTHS = [70, 1, 12]                      # uneven; a 1-token document; one crosses the delta rule's chunk of 64


def _documents():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _flattened(docs, **collator):
    batch = transformers.DataCollatorWithFlattening(**collator)([{"input_ids": d} for d in docs])
    batch.pop("labels")
    return batch


def _alone(model, docs):
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs])


STYLES = [pytest.param({}, id="position_ids"), pytest.param({"return_flash_attn_kwargs": True}, id="cu_seq_lens"),
          pytest.param({"return_seq_idx": True}, id="seq_idx")]


@pytest.mark.parametrize("collator", STYLES)
def test_flattened_batch_equals_each_document_alone(monkeypatch, collator):
    model = build("qwen3_5", monkeypatch)
    docs = _documents()
    batch = _flattened(docs, **collator)
    want = _alone(model, docs)
    if not collator:                                           # negative control: Hugging Face's layers leak
        with torch.no_grad():
            assert float((model(**batch).logits[0] - want).abs().max()) > 1e-2
    enable_packing(model)
    assert sum(isinstance(m, PackedMixer) and isinstance(m.mixer, GatedDeltaNetMixer) for m in model.modules()) == 1
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
    model = build("qwen3_5", monkeypatch)
    batch = _flattened(_documents())
    if target > 0:         # negative control: unpatched, a document's logits reach back into earlier documents
        assert _cross_gradient(model, batch, target) > 1e-6
    enable_packing(model)
    assert _cross_gradient(model, batch, target) == 0.0


def test_weights_round_trip_bitwise_through_the_patch(monkeypatch):
    model = build("qwen3_5", monkeypatch)
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


def _as_transformers_builds_it():
    """The tiny model with transformers' own kernel routing (no torch path restored): on a CPU the
    delta rule falls back to torch and refuses packed boundaries."""
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], head_dim=16, attn_implementation="sdpa", **SMALL)).eval()


@pytest.mark.parametrize("collator", STYLES[1:])
def test_the_boundaries_transformers_refuses_on_cpu_pack_once_enabled(collator):
    model = _as_transformers_builds_it()
    docs = _documents()
    batch = _flattened(docs, **collator)
    with pytest.raises(ValueError, match="can't keep packed sequences apart"), torch.no_grad():
        model(**batch)                                         # negative control: transformers refuses
    want = _alone(model, docs)
    enable_packing(model)
    with torch.no_grad():
        assert rel_rms(model(**batch).logits[0], want) <= 1e-5


def test_transformers_conv_is_not_told_the_documents():
    """transformers passes ``cu_seq_lens_q`` to the conv under that name; its conv ignores it, so
    the conv of a flattened row mixes documents (what enable_packing replaces)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_forward
    conv = _as_transformers_builds_it().model.layers[0].linear_attn.conv1d
    x = torch.randn(1, conv.in_channels, sum(LENGTHS))
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    with torch.no_grad():
        told = causal_conv1d_forward(conv, x, None, 0, activation="silu", cu_seq_lens_q=cu)
        untold = causal_conv1d_forward(conv, x, None, 0, activation="silu")
        alone = torch.cat([causal_conv1d_forward(conv, x[..., a:b], None, 0, activation="silu")
                           for a, b in zip(cu[:-1], cu[1:])], dim=-1)
    assert torch.equal(told, untold) and float((told - alone).abs().max()) > 1e-3


def _grads(model):
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def _loop_gradients(model, docs):
    """(gradients of the flattened row's loss, of the documents' losses run alone and weighted by
    their next-token counts, so that both are the same mean) from plain model calls."""
    counts = [len(d) - 1 for d in docs]
    model.zero_grad()
    for d, n in zip(docs, counts):
        if n:
            (model(input_ids=torch.tensor([d]), labels=torch.tensor([d])).loss * n / sum(counts)).backward()
    alone = _grads(model)
    model.zero_grad()
    batch = transformers.DataCollatorWithFlattening()([{"input_ids": d} for d in docs])
    model(input_ids=batch["input_ids"], position_ids=batch["position_ids"], labels=batch["labels"]).loss.backward()
    return _grads(model), alone


def test_a_plain_training_loop_gets_each_documents_own_gradients(monkeypatch):
    """model(input_ids=, position_ids=, labels=) on the flattened row, then backward: every weight's
    gradient is the documents' own. In fp64: in fp32, A_log's and dt_bias's gradients (one sum over
    every token of cancelling terms) move by ~4e-3 with the summation order alone, while in fp64
    every weight agrees to ~1e-7."""
    model = build("qwen3_5", monkeypatch).double().train()
    docs = _documents()
    packed, alone = _loop_gradients(model, docs)          # negative control: transformers' layers leak
    assert max(rel_rms(packed[k], alone[k]) for k in alone) > 1e-2
    packed, alone = _loop_gradients(enable_packing(model), docs)
    assert packed.keys() == alone.keys()
    assert max(rel_rms(packed[k], alone[k]) for k in alone) <= 1e-5
