"""The demo's generation step: continuous batching over reused slots, and the recompute check that
fails the demo when cached decoding drifts."""

import pytest
import torch

import mixers.demo.generation as generation
from mixers import HybridLM
from tests.mixers.inference.common import SMALL
from tests.support.tolerances import FP32_REL

DOCS = [bytes(range(65, 65 + 26)) * 3, b"hello world, " * 8, b"packed sequences " * 5, b"0123456789" * 9,
        b"slots and states " * 5, b"continuous batching " * 4, b"short"]


def tiny():
    torch.manual_seed(0)
    return HybridLM(256, 32, "MGKPA", mixer_overrides=SMALL)


def test_generation_demo_prints_continuations_and_the_check(capsys):
    summary = generation.generation_demo(tiny(), DOCS, max_new_tokens=5)
    out = capsys.readouterr().out
    assert "6 prompts (12-64 bytes) through 3 slots" in out and "3 slots reused" in out
    assert "cached decoding matches a full recompute: 6 sequences, 30 tokens" in out
    assert summary["greedy_match"] and summary["rel_rms"] <= FP32_REL and len(summary["continuations"]) == 6


def test_generation_demo_fails_when_cached_decoding_drifts(monkeypatch, capsys):
    real = generation.check_against_recompute

    def drifted(model, prompts, outputs, logits):
        return real(model, prompts, outputs, [lg + 0.1 * torch.randn_like(lg) for lg in logits])
    monkeypatch.setattr(generation, "check_against_recompute", drifted)
    with pytest.raises(RuntimeError, match="cached decoding differs from a full recompute"):
        generation.generation_demo(tiny(), DOCS, max_new_tokens=3)
    assert "DOES NOT match" in capsys.readouterr().out
