"""Stream shards: ``data.shuffle_seed`` picks the order of the documents (0 is a seed), and a
shard resumed from its ``state_dict`` (the carried-state cache grown past its first size, a
document carried into the next pack) continues bitwise as the shard that never stopped."""

from __future__ import annotations

import copy
import random

import pytest
import torch

from mixers import HybridLM
from mixers.training.config import Config, DataConfig
from mixers.training.data import Corpus
from mixers.training.shards import FIRST_SLOTS, Shard
from ssm_pack import pack_stream

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "A": {"head_dim": 8}}


def _corpus(count: int = 120) -> Corpus:
    """Uneven byte documents: many of 1-3 bytes (a pack holds dozens) and some of 90 (split and carried)."""
    rng = random.Random(0)
    lengths = [rng.choice([1, 2, 3, 90]) for _ in range(count)]
    return Corpus([bytes(rng.randrange(1, 256) for _ in range(n)) for n in lengths], 256, "bytes", 0)


def _model() -> HybridLM:
    torch.manual_seed(0)
    return HybridLM(256, 32, "MA", mixer_overrides=SMALL)


def _packs(shard: Shard, count: int) -> list[dict]:
    return [shard.next() for _ in range(count)]


def _ids(packs) -> list[list[int]]:
    return [p["documents"].tolist() for p in packs]


@pytest.mark.parametrize("seed", [pytest.param(0, id="seed-0"), pytest.param(3, id="seed-3")])
def test_shuffle_seed_is_the_stream_seed(seed):
    corpus = _corpus()
    data = DataConfig(max_tokens=64, batch_packs=1, lookahead=64, carry=False, shuffle_seed=seed)
    shard = Shard(0, corpus, Config(data=data), None, torch.float32)
    got = _ids(_packs(shard, 6))
    stream = pack_stream(corpus.documents, 64, lookahead=64, seed=seed, split_long="carry")
    want = _ids([next(iter(stream)) for _ in range(6)])
    unshuffled = Shard(0, corpus, Config(data=DataConfig(max_tokens=64, batch_packs=1, lookahead=64, carry=False)),
                       None, torch.float32)
    assert got == want, f"data.shuffle_seed={seed} must shuffle with seed {seed}"
    assert got != _ids(_packs(unshuffled, 6)), f"data.shuffle_seed={seed} gave the source's order"


@torch.no_grad()
def test_a_resumed_shard_continues_its_carried_document_bitwise():
    corpus, model = _corpus(), _model()
    data = DataConfig(max_tokens=64, batch_packs=1, lookahead=64)
    running = Shard(0, corpus, Config(data=data), model, torch.float32)
    for pack in _packs(running, 3):
        running.carry(pack)
    assert running.carry.carried is not None and running.carry.carried[1] > FIRST_SLOTS, \
        "the corpus should leave a document carried in a slot past the cache's first size"
    state = copy.deepcopy(running.state_dict())
    want = [running.carry(pack)["loss"] for pack in _packs(running, 4)]
    resumed = Shard(0, corpus, Config(data=data), model, torch.float32)
    resumed.load_state_dict(state)
    got = [resumed.carry(pack)["loss"] for pack in _packs(resumed, 4)]
    assert all(torch.equal(g, w) for g, w in zip(got, want)), f"resumed losses {got} != uninterrupted {want}"
