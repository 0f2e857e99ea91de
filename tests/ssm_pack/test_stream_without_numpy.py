"""pack_stream without numpy: the torch path of ``ssm_pack.stream.assemble`` builds the same packs.

Every install this suite runs on has numpy, so the torch fallback (``_np is None``) is forced here,
once by setting the module's ``_np`` to ``None`` and once by importing the package in a fresh
interpreter where ``import numpy`` fails, and compared pack by pack with the numpy path.
"""

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import ssm_pack as sp
from ssm_pack.stream import assemble
from tests.ssm_pack.stream_helpers import corpus

ROOT = Path(__file__).resolve().parents[2]
FIELDS = ("input_ids", "labels", "targets", "position_ids", "documents", "offsets")


def _packs(docs, max_tokens, align_to):
    return list(sp.pack_stream(docs, max_tokens, align_to=align_to, split_long="carry", pad_token_id=3))


def _expected_positions(pack, max_tokens):
    """Positions from the pack's own metadata: offset + index in the piece, counting on through a
    slot's padding, and 0.. over the tail."""
    params = pack["packed_seq_params"]
    starts = (params.cu_seqlens_q_padded if params.cu_seqlens_q_padded is not None else params.cu_seqlens_q).tolist()
    want = list(range(max_tokens))
    for start, end, offset in zip(starts, starts[1:] + [max_tokens], pack["offsets"].tolist() + [0]):
        want[start:end] = range(offset, offset + end - start)
    return want


CASES = [pytest.param(24, 1, id="align1"), pytest.param(24, 4, id="align4"), pytest.param(16, 8, id="align8")]


@pytest.mark.parametrize("max_tokens,align_to", CASES)
def test_the_torch_path_gives_the_numpy_path_s_packs(monkeypatch, max_tokens, align_to):
    docs = corpus(30, seed=3, longest=13, long=(70, 41))                 # uneven lengths, two long documents
    with_numpy = _packs(docs, max_tokens, align_to)
    monkeypatch.setattr(assemble, "_np", None)
    without = _packs(docs, max_tokens, align_to)
    assert sum(p["continues"] for p in without) >= 3                      # continuing pieces are exercised
    assert len(with_numpy) == len(without)
    for a, b in zip(with_numpy, without):
        for key in FIELDS:
            assert torch.equal(a[key], b[key]), key
        assert torch.equal(a["packed_seq_params"].seq_idx, b["packed_seq_params"].seq_idx)
        assert b["position_ids"].dtype == torch.int64 and b["packed_seq_params"].seq_idx.dtype == torch.int32


@pytest.mark.parametrize("max_tokens,align_to", CASES)
def test_a_continuing_piece_counts_on_from_its_offset_without_numpy(monkeypatch, max_tokens, align_to):
    monkeypatch.setattr(assemble, "_np", None)
    docs = corpus(12, seed=5, longest=9, long=(60,))
    packs = _packs(docs, max_tokens, align_to)
    continuing = [p for p in packs if p["continues"]]
    assert continuing
    for pack in packs:
        positions = pack["position_ids"][0].tolist()
        assert min(positions) >= 0
        assert positions == _expected_positions(pack, max_tokens)
    first = continuing[0]
    assert first["position_ids"][0, 0] == first["offsets"][0] > 0


def test_the_expected_positions_see_a_wrong_row():
    """Negative control: a continuing piece's positions restarting at 0 do not pass the check."""
    packs = _packs(corpus(12, seed=5, longest=9, long=(60,)), 24, 4)
    pack = next(p for p in packs if p["continues"])
    wrong = pack["position_ids"][0].clone()
    wrong[: int(pack["packed_seq_params"].lengths()[0])] -= int(pack["offsets"][0])
    assert wrong.tolist() != _expected_positions(pack, 24)


SCRIPT = """
import sys
sys.modules["numpy"] = None                      # "import numpy" raises ImportError from here on
import torch, ssm_pack
from ssm_pack.stream import assemble
assert assemble._np is None, "the numpy-less fallback was not taken"
docs = [torch.arange(1, n + 1) for n in (5, 3, 40, 7, 2, 29)]
for pack in ssm_pack.pack_stream(docs, 16, align_to=4, split_long="carry"):
    print(pack["position_ids"][0].tolist(), pack["targets"][0].tolist(), pack["packed_seq_params"].seq_idx[0].tolist())
"""


def test_an_install_without_numpy_takes_the_torch_path():
    run = subprocess.run([sys.executable, "-c", SCRIPT], cwd=ROOT, capture_output=True, text=True, timeout=300,
                         env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"})
    assert run.returncode == 0, run.stderr[-3000:]
    docs = [torch.arange(1, n + 1) for n in (5, 3, 40, 7, 2, 29)]
    want = [f"{p['position_ids'][0].tolist()} {p['targets'][0].tolist()} {p['packed_seq_params'].seq_idx[0].tolist()}"
            for p in sp.pack_stream(docs, 16, align_to=4, split_long="carry")]
    assert run.stdout.splitlines() == want
