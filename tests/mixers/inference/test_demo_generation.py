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


def small():
    torch.manual_seed(0)
    return HybridLM(256, 32, "GA", mixer_overrides=SMALL)


# documents of uneven lengths; the sixth's first 48 bytes are 44 characters (two 3-byte dashes)
SHOWN = [b"ABCDEFGHIJKLMNOPQRSTUVWXYZ" * 3, b"hello world, " * 8, b"packed sequences " * 5, b"0123456789" * 9,
         b"slots and states " * 5, "Packs \u2014 uneven documents \u2014 one row, many states".encode() * 2, b"short"]


def test_generation_demo_with_its_defaults_prints_what_the_docs_show(capsys):
    summary = generation.generation_demo(small(), SHOWN)
    out = capsys.readouterr().out
    assert "6 prompts (12-64 bytes) through 3 slots" in out and "prefill chunks of <= 24 with decodes" in out, out
    assert "cached decoding matches a full recompute: 6 sequences, 192 tokens" in out, out   # 32 new tokens each
    assert [len(p.encode()) for p in summary["prompts"]] == [40, 12, 28, 64, 20, 48]
    shown = [line.split(" -> ")[0].removeprefix("    prompt ") for line in out.splitlines() if "    prompt " in line]
    sixth = SHOWN[5][:48].decode()
    assert len(sixth) == 44
    assert shown == [repr("ABCDEFGHIJKLMNOPQRSTUVWXYZABCDEFGHIJKLMN"), repr("hello world,"),
                     repr("packed sequences packed sequ"), repr("0123456789" * 4 + "0..."),
                     repr("slots and states slo"), repr(sixth)], shown   # 44 characters shown whole, longer cut


def test_generation_demo_holds_a_bfloat16_model_to_the_forward_tolerance(monkeypatch, capsys):
    real = generation.check_against_recompute

    def between(model, prompts, outputs, logits):             # over bf16's forward 5e-3, under its 1e-2
        return {**real(model, prompts, outputs, logits), "rel_rms": 7e-3}
    monkeypatch.setattr(generation, "check_against_recompute", between)
    with pytest.raises(RuntimeError, match=r"relative RMS 7.00e-03 > 5e-03"):
        generation.generation_demo(small().to(torch.bfloat16), DOCS, max_new_tokens=2)
    assert "cached decoding DOES NOT match" in capsys.readouterr().out


def test_generation_demo_passes_a_drift_exactly_at_the_tolerance(monkeypatch, capsys):
    real = generation.check_against_recompute

    def at_the_limit(model, prompts, outputs, logits):
        return {**real(model, prompts, outputs, logits), "rel_rms": FP32_REL}
    monkeypatch.setattr(generation, "check_against_recompute", at_the_limit)
    summary = generation.generation_demo(small(), DOCS, max_new_tokens=2)
    assert summary["rel_rms"] == FP32_REL
    assert "cached decoding matches a full recompute" in capsys.readouterr().out, "a drift at the limit passes"
