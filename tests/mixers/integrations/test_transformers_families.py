"""enable_packing on every tiny model of :mod:`tests.mixers.integrations.hf_models` (a family added
to ``FACTORIES`` is covered here with no other change): a flattened batch of three documents equals
each document alone for every boundary form the collator writes, no gradient crosses from one
document to another, every layer a converter reads is swapped, and the weights go back to the
unpatched model bit for bit. Each check has its negative control on the unpatched model.

Then the calls users make to train, for every family: the ``Trainer``'s ``model(**batch,
use_cache=False)``, ``model(**batch)`` with the config's ``use_cache`` and a plain loop, whose loss
and every weight's gradient equal the documents run alone; and Qwen3.5's CPU refusal of packed
boundaries, which enable_packing lifts."""

import copy

import pytest
import torch

transformers = pytest.importorskip("transformers")

from mixers.checkpoints import SOURCES  # noqa: E402
from mixers.integrations.transformers import PackedMixer, disable_packing, enable_packing  # noqa: E402
from tests.mixers.integrations.hf_models import FACTORIES, SMALL, VOCAB, build  # noqa: E402
from tests.support.oracles import rel_rms  # noqa: E402

LENGTHS = [70, 1, 12]        # uneven; a 1-token document; crosses the delta rules' chunk of 64, SSD's 8, the convs
FAMILIES = [pytest.param(name, id=name) for name in FACTORIES]
STYLES = {"position_ids": {}, "cu_seq_lens": {"return_flash_attn_kwargs": True},
          "seq_idx": {"return_seq_idx": True}}


def _documents():
    g = torch.Generator().manual_seed(5)
    return [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in LENGTHS]


def _flattened(docs, labels=False, **collator):
    batch = transformers.DataCollatorWithFlattening(**collator)([{"input_ids": d} for d in docs])
    if not labels:
        batch.pop("labels")
    return batch


def _alone(model, docs):
    with torch.no_grad():
        return torch.cat([model(input_ids=torch.tensor([d])).logits[0] for d in docs])


def _converted_layers(model) -> list[str]:
    """The ``package:Class`` names of the layers a converter reads, in module order."""
    classes = {c for s in SOURCES.values() for c in s.classes if c.startswith("transformers:")}
    return [c for m in model.modules() if (c := f"{type(m).__module__.split('.')[0]}:{type(m).__name__}") in classes]


@pytest.mark.parametrize("name", FAMILIES)
def test_flattened_batch_equals_each_document_alone(monkeypatch, name):
    """Every collator form (position_ids restarts, cu_seq_lens, seq_idx); fp32 relative RMS 1e-5."""
    model = build(name, monkeypatch)
    docs = _documents()
    batches = {style: _flattened(docs, **collator) for style, collator in STYLES.items()}
    want = _alone(model, docs)
    with torch.no_grad():                                      # negative control: Hugging Face's layers leak
        assert float((model(**batches["position_ids"]).logits[0] - want).abs().max()) > 1e-2
    layers = _converted_layers(model)
    enable_packing(model)
    swapped = [m for m in model.modules() if isinstance(m, PackedMixer)]
    assert layers and len(swapped) == len(layers) and not _converted_layers(model)
    assert all(isinstance(m.mixer, SOURCES[m.source].mixer) for m in swapped)
    for style, batch in batches.items():
        with torch.no_grad():
            got = model(**batch).logits[0]
        assert rel_rms(got, want) <= 1e-5, style


def _cross_gradients(model, batch) -> list[float]:
    """Per document: largest |d logits(document) / d embeddings| over the OTHER documents' tokens."""
    bounds = [0] + torch.tensor(LENGTHS).cumsum(0).tolist()
    embeds = model.get_input_embeddings()(batch["input_ids"]).detach().requires_grad_(True)
    logits = model(inputs_embeds=embeds, position_ids=batch["position_ids"]).logits[0]
    out = []
    for target, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        g = torch.Generator().manual_seed(target)
        (grad,) = torch.autograd.grad((logits[lo:hi] * torch.randn(hi - lo, VOCAB, generator=g)).sum(), embeds,
                                      retain_graph=True)
        others = torch.ones(bounds[-1], dtype=torch.bool)
        others[lo:hi] = False
        out.append(float(grad[0, others].abs().max()))
    return out


@pytest.mark.parametrize("name", FAMILIES)
def test_no_gradient_crosses_documents(monkeypatch, name):
    model = build(name, monkeypatch)
    batch = _flattened(_documents())
    leaked = _cross_gradients(model, batch)
    assert all(g > 1e-6 for g in leaked[1:]), leaked   # negative control: later documents reach back unpatched
    enable_packing(model)
    assert _cross_gradients(model, batch) == [0.0] * len(LENGTHS)


@pytest.mark.parametrize("name", FAMILIES)
def test_weights_round_trip_bitwise_through_the_patch(monkeypatch, name):
    model = build(name, monkeypatch)
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


# --- training calls: loss and every weight's gradient -------------------------------------------

def _loss_alone(model, docs):
    """The packed labels' loss from each document alone: mean over every predicted token."""
    total, count = 0.0, 0
    for d in docs:
        if len(d) > 1:
            ids = torch.tensor([d])
            total, count = total + model(input_ids=ids, labels=ids).loss * (len(d) - 1), count + len(d) - 1
    return total / count


def _trainer_step(model, batch):
    """What ``Trainer`` does with a ``DataCollatorWithFlattening`` batch in training (cache off)."""
    return model(**batch, use_cache=False).loss


def _batch_step(model, batch):
    """``model(**batch).loss`` as written: the config's ``use_cache`` (most build a cache)."""
    return model(**batch).loss


def _plain_step(model, batch):
    """A plain loop: explicit keywords (``use_cache`` at its default), logits shifted by hand."""
    logits = model(input_ids=batch["input_ids"], position_ids=batch["position_ids"]).logits[0]
    labels = batch["labels"][0]
    keep = labels[1:] != -100
    return torch.nn.functional.cross_entropy(logits[:-1][keep], labels[1:][keep])


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
    """The largest relative RMS over the weights whose gradient is not zero up to rounding: LFM2-MoE's
    top-1 router normalises its one weight to 1, so its gate's gradient is 0 in exact arithmetic and
    1e-9 of rounding in fp32 (1e-8 of the largest gradient), which no relative error can judge."""
    assert grads.keys() == want.keys()
    largest = max(float(g.abs().max()) for g in want.values() if g is not None)
    return max((rel_rms(grads[k], want[k]), k) for k in want
               if want[k] is not None and want[k].abs().max() > 1e-6 * largest)


# Qwen3.5 in fp64: in fp32, A_log's and dt_bias's gradients (one sum over every token of cancelling
# terms) move by ~4e-3 with the summation order alone. Its reference is the patched model run on each
# document alone: transformers computes Qwen3.5's decay in fp32 even in an fp64 model, so A_log's
# gradient through the unpatched layers moves by 3e-4, while through ours every weight agrees to ~1e-7.
FP64_TRAINING = {"qwen3_next": torch.float64, "qwen3_5": torch.float64}
TRAINING = [pytest.param(name, dtype, step, id=f"{name}-{sid}")
            for name, dtype in ((n, FP64_TRAINING.get(n, torch.float32)) for n in FACTORIES)
            for step, sid in ((_trainer_step, "trainer"), (_batch_step, "batch"), (_plain_step, "loop"))]


@pytest.mark.parametrize(("name", "dtype", "step"), TRAINING)
def test_both_call_styles_train_like_each_document_alone(monkeypatch, name, dtype, step):
    """Loss and every weight's gradient of a packed training step equal those of the documents run
    alone (train mode); the unpatched packed step's gradients differ (negative control)."""
    model = build(name, monkeypatch).to(dtype).train()
    reference = copy.deepcopy(model)
    if dtype == torch.float64:
        enable_packing(reference)
    docs = _documents()
    batch = _flattened(docs, labels=True)
    want_loss, want = _loss_and_grads(reference, _loss_alone(reference, docs))
    unpatched = copy.deepcopy(model)
    _, leaked = _loss_and_grads(unpatched, step(unpatched, batch))
    assert _worst(leaked, want)[0] > 1e-3
    enable_packing(model)
    loss, grads = _loss_and_grads(model, step(model, batch))
    assert abs(loss - want_loss) <= 1e-5 * want_loss
    assert _worst(grads, want)[0] <= 1e-5, _worst(grads, want)


@torch.no_grad()
def test_padded_batch_runs_as_packed_rows(monkeypatch):
    """Left and right padding (Zamba2 zeroes padded inputs of its Mamba2 layers; the patched layers
    drop them): the real tokens equal the documents alone; the same rows unmasked differ."""
    model = enable_packing(build("zamba2", monkeypatch))
    docs = _documents()
    width = max(LENGTHS)
    ids = torch.zeros(len(docs), width, dtype=torch.long)
    mask = torch.zeros(len(docs), width, dtype=torch.long)
    for i, d in enumerate(docs):
        cols = slice(0, len(d)) if i % 2 else slice(width - len(d), width)          # right / left padding
        ids[i, cols], mask[i, cols] = torch.tensor(d), 1
    got = model(input_ids=ids, attention_mask=mask).logits
    for i, d in enumerate(docs):
        alone = model(input_ids=torch.tensor([d])).logits[0]
        assert rel_rms(got[i][mask[i].bool()], alone) <= 1e-5
    unmasked = model(input_ids=ids).logits
    k = 2                                                        # a left-padded row: padding precedes it
    assert float((unmasked[k][mask[k].bool()] - model(input_ids=torch.tensor([docs[k]])).logits[0]).abs().max()) > 1e-2


# --- Qwen3.5 as transformers builds it on a CPU -------------------------------------------------

def _qwen3_5_as_transformers_builds_it():
    """The tiny model with transformers' own kernel routing (no torch path restored): on a CPU the
    delta rule falls back to torch and refuses packed boundaries."""
    torch.manual_seed(0)
    return transformers.Qwen3_5ForCausalLM(transformers.Qwen3_5TextConfig(
        hidden_size=32, intermediate_size=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=16, linear_value_head_dim=16, num_hidden_layers=2,
        layer_types=["linear_attention", "full_attention"], head_dim=16, attn_implementation="sdpa", **SMALL)).eval()


@pytest.mark.parametrize("style", ["cu_seq_lens", "seq_idx"])
def test_the_boundaries_transformers_refuses_on_cpu_pack_once_enabled(style):
    model = _qwen3_5_as_transformers_builds_it()
    docs = _documents()
    batch = _flattened(docs, **STYLES[style])
    with pytest.raises(ValueError, match="can't keep packed sequences apart"), torch.no_grad():
        model(**batch)                                         # negative control: transformers refuses
    want = _alone(model, docs)
    enable_packing(model)
    with torch.no_grad():
        assert rel_rms(model(**batch).logits[0], want) <= 1e-5


def test_transformers_conv_is_not_told_the_documents():
    """transformers passes ``cu_seq_lens_q`` to Qwen3.5's conv under that name; its conv ignores it,
    so the conv of a flattened row mixes documents (what enable_packing replaces)."""
    from transformers.models.qwen3_5.modeling_qwen3_5 import causal_conv1d_forward
    conv = _qwen3_5_as_transformers_builds_it().model.layers[0].linear_attn.conv1d
    x = torch.randn(1, conv.in_channels, sum(LENGTHS))
    cu = torch.tensor([0] + torch.tensor(LENGTHS).cumsum(0).tolist())
    with torch.no_grad():
        told = causal_conv1d_forward(conv, x, None, 0, activation="silu", cu_seq_lens_q=cu)
        untold = causal_conv1d_forward(conv, x, None, 0, activation="silu")
        alone = torch.cat([causal_conv1d_forward(conv, x[..., a:b], None, 0, activation="silu")
                           for a, b in zip(cu[:-1], cu[1:])], dim=-1)
    assert torch.equal(told, untold) and float((told - alone).abs().max()) > 1e-3
