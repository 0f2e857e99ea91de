"""A NaN or inf in one document stays in that document, through every layer and the whole model.

Random packed layouts (uneven lengths, empty documents, 1-3 token documents, a padding tail,
padded physical layouts); one value of one document's hidden states is replaced by NaN, +inf or
-inf. Every other document's outputs and input gradients must be finite and bitwise equal to the
run without it; the poisoned document's outputs must be non-finite somewhere (never silently
finite). The negative control runs the same layouts without the packing metadata: the poison
then reaches other documents.
"""

import random

import pytest
import torch

from mixers import HybridLM
from mixers.ops import device_policy
from ssm_pack import PackedSeqParams
from ssm_pack.testing import document_spans
from tests.mixers.layers.test_layers import HIDDEN, LAYERS

CASES = 6
OVERRIDES = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
             "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}


@pytest.fixture(autouse=True, params=[pytest.param(False, id="host-read"), pytest.param(True, id="branch-free")])
def guard_form(request, monkeypatch):
    """Every test on both forms of the references' guard (the device policy picks one)."""
    monkeypatch.setattr(device_policy, "branch_free_isolation", lambda device: request.param)
    return request.param


def random_layout(rng: random.Random):
    lengths = [rng.choice([0, 1, 2, 3, rng.randint(4, 40)]) for _ in range(rng.randint(2, 7))]
    if sum(lengths) == 0 or sum(1 for n in lengths if n) < 2:
        lengths += [5, 9]
    pad = rng.choice([1, 1, 4])
    tail = rng.choice([0, 3])
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad)
    total = int(params.cu_seqlens[-1]) + tail
    return PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad, total_tokens=total), total


def run(fn, x, spans, seed):
    x = x.clone().requires_grad_()
    out = fn(x)
    g = torch.randn(out.shape, generator=torch.Generator().manual_seed(seed), dtype=out.dtype)
    real = torch.zeros(out.shape[1], dtype=torch.bool)
    for s, e in spans:
        real[s:e] = True
    (grad,) = torch.autograd.grad((out * (g * real[None, :, None])).sum(), [x])
    return out.detach(), grad


def check_isolated(fn, params, total, rng, seed, victim=None):
    docs, _ = document_spans(params, total)
    x = torch.randn(1, total, HIDDEN, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    clean_out, clean_grad = run(fn, x, docs, seed)
    victim = rng.randrange(len(docs)) if victim is None else victim
    s, e = docs[victim]
    bad = x.clone()
    bad[0, rng.randrange(s, e), rng.randrange(HIDDEN)] = rng.choice([float("nan"), float("inf"), -float("inf")])
    out, grad = run(fn, bad, docs, seed)
    assert not torch.isfinite(out[:, s:e]).all(), "the poisoned document came out silently finite"
    for i, (a, b) in enumerate(docs):
        if i == victim:
            continue
        assert torch.isfinite(out[:, a:b]).all() and torch.isfinite(grad[:, a:b]).all(), f"document {i} not finite"
        assert torch.equal(out[:, a:b], clean_out[:, a:b]) and torch.equal(grad[:, a:b], clean_grad[:, a:b]), \
            f"document {i} changed"


@pytest.mark.parametrize("name", list(LAYERS))
def test_layer_keeps_a_non_finite_value_in_its_document(name):
    torch.manual_seed(0)
    layer = LAYERS[name](backend="reference").double()
    rng = random.Random(name)
    for case in range(CASES):
        params, total = random_layout(rng)
        check_isolated(lambda x: layer(x, packed_seq_params=params), params, total, rng, case)


def test_hybrid_model_keeps_a_non_finite_value_in_its_document():
    torch.manual_seed(0)
    model = HybridLM(256, HIDDEN, "MGKPA", backend="reference", mixer_overrides=OVERRIDES).double()
    rng = random.Random(1)
    for case in range(CASES):
        params, total = random_layout(rng)
        check_isolated(lambda x: model.backbone(x, params), params, total, rng, case)


@pytest.mark.parametrize("name", ["mamba2", "gdn", "attention"])
def test_negative_control_without_metadata_the_poison_spreads(name):
    torch.manual_seed(0)
    layer = LAYERS[name](backend="reference").double()
    params = PackedSeqParams.from_lengths([9, 12, 7])
    with pytest.raises(AssertionError):
        check_isolated(lambda x: layer(x, packed_seq_params=None), params, 28, random.Random(0), 0, victim=0)
