"""Smoke test of the family table (``benchmarks/bench_families.py``): one tiny family end to end,
a model enable_packing refuses, and the dated report file."""

import datetime

import pytest

transformers = pytest.importorskip("transformers")

from benchmarks import bench_families as bf  # noqa: E402
from benchmarks.common import machine, machine_slug  # noqa: E402


def test_a_family_packs_exactly_only_with_enable_packing():
    rows = bf.family_rows("LFM2", "lfm2", None, ["sdpa"], log=lambda m: None)
    assert [(r.impl, r.call) for r in rows] == [("sdpa", "trainer"), ("sdpa", "loop")]
    for r in rows:
        assert float(r.native_error) > 1e-5 and float(r.native_leak) > 0      # transformers leaks
        assert float(r.packed_error) <= 1e-5 and r.packed_leak == "0"


def _llama(monkeypatch, impl):
    return transformers.LlamaForCausalLM(transformers.LlamaConfig(
        vocab_size=bf.VOCAB, hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
        num_key_value_heads=1, attn_implementation=impl))


def test_a_model_without_a_converted_layer_is_reported_refused():
    rows = bf.family_rows("Llama", "no_such_factory", _llama, ["sdpa"], log=lambda m: None)
    assert all(r.packed_error.startswith("refused: LlamaForCausalLM has no layer") and r.packed_leak == "-"
               for r in rows)
    trainer, loop = rows                # attention only: transformers' block-diagonal mask without a cache only
    assert float(trainer.native_error) < 1e-5 and trainer.native_leak == "0"
    assert float(loop.native_error) > 1e-2 and float(loop.native_leak) > 0


def test_every_family_has_a_model():
    assert len({key for _, key, _ in bf.FAMILIES}) == len(bf.FAMILIES)
    for _, key, fallback in bf.FAMILIES:
        assert callable(bf._factory(key, fallback))


def test_the_report_is_a_dated_file_of_its_machine(tmp_path, capsys):
    assert bf.main(["--families", "lfm2", "--out", str(tmp_path)]) == 0
    path = tmp_path / f"{datetime.date.today().isoformat()}-{machine_slug(machine())}-families.md"
    text = path.read_text()
    assert "| LFM2 | eager | trainer |" in text and "| LFM2 | sdpa | loop |" in text
    assert path.name in (tmp_path / "index.md").read_text()
