"""pack_stream: exact resume, ranks and DataLoader workers (every document once, equal packs per rank)."""

import copy
import random
from types import SimpleNamespace

import pytest
import torch
from torch.utils.data import DataLoader

import ssm_pack as sp
import ssm_pack.stream.packs as stream_module
from tests.ssm_pack.stream_helpers import corpus, documents_of, real_tokens, same_packs

DOCS = corpus(400, longest=48, empty=7, long=(300, 130, 97))

CONFIGS = [
    pytest.param({}, "list", id="default"),
    pytest.param({"lookahead": 16, "align_to": 4}, "generator", id="generator-align4"),
    pytest.param({"world": 3, "rank": 1, "lookahead": 32}, "list", id="rank1of3"),
    pytest.param({"world": 2, "rank": 0, "seed": 5, "lookahead": 8}, "list", id="seeded-rank0of2"),
    pytest.param({"split_long": "truncate", "lookahead": 4}, "generator", id="truncate"),
]


def _source(kind):
    return (d for d in DOCS) if kind == "generator" else DOCS


@pytest.mark.parametrize("kwargs,kind", CONFIGS)
def test_resume_at_random_stop_points_yields_the_uninterrupted_packs(kwargs, kind):
    full = list(sp.pack_stream(_source(kind), 64, **kwargs))
    stops = sorted({0, 1, len(full) - 1, len(full), *random.Random(7).sample(range(len(full)), 3)})
    for stop in stops:
        stream = sp.pack_stream(_source(kind), 64, **kwargs)
        head = [next(stream) for _ in range(stop)]
        state = copy.deepcopy(stream.state_dict())               # what a checkpoint keeps
        resumed = sp.pack_stream(_source(kind), 64, **kwargs)
        resumed.load_state_dict(state)
        rest = list(resumed)
        assert same_packs(head + rest, full), stop


def test_resume_without_the_state_would_differ():
    """Negative control: a fresh stream does not continue where the stopped one was."""
    stream = sp.pack_stream(DOCS, 64, lookahead=16)
    head = [next(stream) for _ in range(5)]
    assert not same_packs(head + list(sp.pack_stream(DOCS, 64, lookahead=16)), list(sp.pack_stream(DOCS, 64,
                                                                                                    lookahead=16)))


def _shard(monkeypatch, kwargs, worker, num_workers):
    info = SimpleNamespace(id=worker, num_workers=num_workers)
    monkeypatch.setattr(stream_module, "get_worker_info", lambda: info)
    packs = list(sp.pack_stream(DOCS, 64, **kwargs))
    monkeypatch.setattr(stream_module, "get_worker_info", lambda: None)
    return packs


@pytest.mark.parametrize("world,num_workers,kwargs", [
    pytest.param(1, 3, {}, id="1rank-3workers"),
    pytest.param(4, 1, {"lookahead": 32}, id="4ranks"),
    pytest.param(3, 2, {"lookahead": 8, "align_to": 8}, id="3ranks-2workers-align8"),
])
def test_ranks_and_workers_share_every_document_exactly_once(monkeypatch, world, num_workers, kwargs):
    per_rank, everything = [], []
    for rank in range(world):
        mine = []
        for worker in range(num_workers):
            mine += _shard(monkeypatch, {**kwargs, "world": world, "rank": rank}, worker, num_workers)
        per_rank.append(mine)
        everything += mine
    back = documents_of(everything)                                   # pieces tile each document once
    want = {i: d for i, d in enumerate(DOCS) if len(d)}
    assert sorted(back) == sorted(want)
    assert all(torch.equal(back[i], want[i]) for i in want)
    tokens = torch.cat([tokens for pack in everything for tokens in real_tokens(pack)]).sort().values
    assert torch.equal(tokens, torch.cat(DOCS).sort().values)        # multiset of all tokens over the shards
    counts = {len(packs) for packs in per_rank}
    assert len(counts) == 1, counts                                   # the same number of packs on every rank
    real = [sum(int(p["packed_seq_params"].lengths().sum()) for p in packs) for packs in per_rank]
    assert max(real) / (sum(real) / world) < 1.2
    indices = sorted(p["pack_index"] for p in everything)
    assert indices == sorted(set(indices))                            # no pack on two shards


def test_carried_pieces_stay_on_one_rank_in_consecutive_packs(monkeypatch):
    for rank in range(3):
        packs = _shard(monkeypatch, {"world": 3, "rank": rank, "lookahead": 16}, 0, 1)
        for before, after in zip(packs, packs[1:]):
            assert after["continues"] == before["continued"]
            if after["continues"]:
                assert int(after["documents"][0]) == int(before["documents"][-1])


def test_dataloader_workers_yield_the_single_process_sequence():
    stream = sp.pack_stream(DOCS, 64, lookahead=32)
    alone = list(stream)
    loaded = list(DataLoader(stream, batch_size=None, num_workers=2))
    assert same_packs(loaded, alone)
