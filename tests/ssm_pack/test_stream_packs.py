"""pack_stream on small exact cases: counters, pack indices, worker rounds, aligned documents, the
empty-run bound, the default lookahead, one conversion per split document, resume inside a carry."""

import itertools
from types import SimpleNamespace

import pytest
import torch

import ssm_pack as sp
import ssm_pack.stream.buffer as buffer_module
import ssm_pack.stream.packs as packs_module
from tests.ssm_pack.stream_helpers import corpus, documents_of, same_packs


def _exact(docs, packs):
    back = documents_of(packs)
    want = {i: torch.as_tensor(d).long() for i, d in enumerate(docs) if len(d)}
    assert sorted(back) == sorted(want)
    for i, tokens in want.items():
        assert torch.equal(back[i], tokens), i


def _shard(monkeypatch, docs, worker, num_workers, **kwargs):
    monkeypatch.setattr(packs_module, "get_worker_info", lambda: SimpleNamespace(id=worker, num_workers=num_workers))
    try:
        return list(sp.pack_stream(docs, **kwargs))
    finally:
        monkeypatch.setattr(packs_module, "get_worker_info", lambda: None)


@pytest.mark.parametrize("docs,max_tokens,align_to", [
    pytest.param([[1, 2, 3], [], [4, 5, 6, 7, 8], [9, 10], [], [11] * 7], 8, 1, id="uneven-with-empties"),
    pytest.param([[1, 2, 3], [4] * 5, [5, 6]], 8, 4, id="align4"),
    pytest.param([[1] * 19, [2, 3]], 8, 1, id="carried"),
])
def test_the_counters_add_up_to_the_packs(docs, max_tokens, align_to):
    stream = sp.pack_stream(docs, max_tokens, align_to=align_to)
    packs = list(stream)
    real = sum(len(d) for d in docs)
    in_rows = sum(int(p["packed_seq_params"].lengths().sum()) for p in packs)
    stats = stream.stats
    assert stats["documents"] == len(docs)
    assert stats["empty_documents"] == sum(1 for d in docs if not d)
    assert stats["packs"] == len(packs)
    assert stats["real_tokens"] == real == in_rows
    assert stats["padding_tokens"] == len(packs) * max_tokens - real


@pytest.mark.parametrize("world", [pytest.param(1, id="world1"), pytest.param(2, id="world2"),
                                   pytest.param(3, id="world3")])
def test_pack_index_is_round_times_world_plus_rank(world):
    docs = corpus(23, seed=3, longest=9)
    for rank in range(world):
        packs = list(sp.pack_stream(docs, 12, world=world, rank=rank, lookahead=4))
        assert [p["pack_index"] for p in packs] == [k * world + rank for k in range(len(packs))]


SPREAD_CASES = [          # each ends its epoch with a spread round (checked below)
    pytest.param(2, 2, corpus(23, seed=0, longest=7), id="world2-workers2"),
    pytest.param(2, 3, corpus(31, seed=0, longest=7), id="world2-workers3"),
    pytest.param(3, 2, corpus(23, seed=0, longest=7), id="world3-workers2"),
]


@pytest.mark.parametrize("world,num_workers,docs", SPREAD_CASES)
def test_each_round_is_yielded_by_its_worker_only(monkeypatch, world, num_workers, docs):
    """Round r belongs to worker r % num_workers, the epoch's last (spread) round included: the
    workers of a rank together yield exactly that rank's single-worker packs, each once."""
    for rank in range(world):
        kwargs = dict(max_tokens=16, world=world, rank=rank, lookahead=4)
        alone = list(sp.pack_stream(docs, **kwargs))
        together = []
        for worker in range(num_workers):
            mine = _shard(monkeypatch, docs, worker, num_workers, **kwargs)
            assert all(p["pack_index"] // world % num_workers == worker for p in mine), (rank, worker)
            together += mine
        together.sort(key=lambda p: p["pack_index"])
        assert same_packs(together, alone), rank


@pytest.mark.parametrize("world,num_workers,docs", SPREAD_CASES)
def test_the_worker_cases_end_with_a_spread_round(monkeypatch, world, num_workers, docs):
    """Negative control for the worker test: its corpora do reach the last-round branch."""
    spread, rounds = buffer_module.Planner.spread, []

    def recording(self, totals):
        rounds.append(spread(self, totals))
        return rounds[-1]

    monkeypatch.setattr(buffer_module.Planner, "spread", recording)
    list(sp.pack_stream(docs, 16, world=world, lookahead=4))
    assert rounds and rounds[-1] is not None


@pytest.mark.parametrize("docs", [
    pytest.param([[1, 2, 3], [4] * 5, [5, 6], [8]], id="three-slots"),
    pytest.param([[9] * 5, [1, 2, 3, 4, 5, 6, 7], [3]], id="two-slots"),
])
def test_aligned_documents_come_back_exactly(docs):
    packs = list(sp.pack_stream(docs, 8, align_to=4))
    _exact(docs, packs)
    for pack in packs:
        lengths = pack["packed_seq_params"].lengths().tolist()
        assert lengths == [len(docs[i]) for i in pack["documents"].tolist()]


def test_the_empty_run_bound_is_65536_documents():
    """docs/packing.md and docs/errors.md: MAX_EMPTY_RUN = 65536 empty documents in a row stop the stream."""
    with pytest.raises(ValueError, match=r"documents\[65535\] is the 65536th empty document in a row"):
        next(sp.pack_stream(itertools.repeat([], 65536), 8))


def test_one_empty_document_fewer_than_the_bound_is_skipped():
    """Negative control: 65535 empty documents in a row, then a real one, pack."""
    stream = sp.pack_stream(itertools.chain(itertools.repeat([], 65535), [[1, 2]]), 8)
    assert [p["documents"].tolist() for p in stream] == [[65535]]
    assert stream.stats["empty_documents"] == 65535


@pytest.mark.parametrize("make", [pytest.param(sp.pack_stream, id="pack_stream"),
                                  pytest.param(sp.PackStream, id="PackStream")])
def test_the_default_lookahead_reads_4096_documents_before_the_first_pack(make):
    stream = make([[1]] * 5000, 64)
    next(stream)
    assert stream.stats["documents"] == 4096


def test_a_split_document_is_converted_once(monkeypatch):
    """Each document's ids are converted once, however many packs its pieces span."""
    calls = []
    convert = packs_module.document_tokens

    def counting(index, doc):
        calls.append(index)
        return convert(index, doc)

    monkeypatch.setattr(packs_module, "document_tokens", counting)
    docs = [list(range(1, 30)), [5, 6], list(range(40, 52))]
    packs = list(sp.pack_stream(docs, 8))
    _exact(docs, packs)
    assert sorted(calls) == [0, 1, 2]


def test_resume_inside_a_carried_document():
    docs = [list(range(1, 21)), [30, 31, 32], list(range(40, 51)), [60]]
    whole = list(sp.pack_stream(docs, 8, lookahead=2))
    for stop in range(1, len(whole)):
        stream = sp.pack_stream(docs, 8, lookahead=2)
        head = [next(stream) for _ in range(stop)]
        resumed = sp.pack_stream(docs, 8, lookahead=2)
        resumed.load_state_dict(stream.state_dict())
        assert same_packs(head + list(resumed), whole), stop
    assert any(p["continued"] for p in whole[:-1])       # the state is taken inside a carry
