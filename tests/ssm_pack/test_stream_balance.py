"""pack_stream deals each round of ``world`` packs to balance real tokens over the ranks."""

import pytest
import torch

import ssm_pack as sp


def _ratio(per_rank: list[int]) -> float:
    return max(per_rank) / (sum(per_rank) / len(per_rank))


@pytest.mark.parametrize("world", [pytest.param(2, id="world2"), pytest.param(4, id="world4")])
def test_skewed_stream_is_balanced_over_ranks_with_equal_pack_counts(world):
    # lookahead=1: one document per pack, so packs alternate full / 60% full in step with the ranks
    lengths = ([100] + [60] * (world - 1)) * 40
    docs = [torch.arange(n) + 1 for n in lengths]
    planned = [int(p["packed_seq_params"].cu_seqlens[-1]) for p in sp.pack_stream(docs, 100, lookahead=1)]
    round_robin = [sum(planned[r::world]) for r in range(world)]              # negative control
    assert _ratio(round_robin) > 1.2
    real, counts, documents = [], set(), []
    for rank in range(world):
        packs = list(sp.pack_stream(docs, 100, lookahead=1, world=world, rank=rank))
        counts.add(len(packs))
        real.append(sum(int(p["packed_seq_params"].cu_seqlens[-1]) for p in packs))
        documents += [d for p in packs for d in p["documents"].tolist()]
    assert len(counts) == 1
    assert sorted(documents) == list(range(len(docs)))
    assert _ratio(real) < 1.05


@pytest.mark.parametrize("world, n, want", [
    pytest.param(2, 16, [80, 80], id="two-ranks"),
    pytest.param(4, 10, [30, 30, 20, 20], id="four-ranks-one-pack-of-tokens"),
])
def test_last_round_spreads_the_tail_over_every_rank(world, n, want):
    # n documents of 10 tokens fit fewer than world packs: the epoch's last round gives each rank a
    # share instead of leaving some ranks a padding pack (round-robin: [100, n*10-100] for two ranks)
    docs = [torch.arange(10) + 10 * i for i in range(n)]
    real, documents = [], []
    for rank in range(world):
        packs = list(sp.pack_stream(docs, 100, lookahead=32, world=world, rank=rank))
        assert len(packs) == 1
        real.append(int(packs[0]["packed_seq_params"].cu_seqlens[-1]))
        documents += packs[0]["documents"].tolist()
    assert sorted(documents) == list(range(n))
    assert real == want


def test_random_corpus_balanced_within_one_percent_at_eight_ranks():
    g = torch.Generator().manual_seed(0)
    docs = [torch.arange(int(n)) + 1 for n in torch.randint(1, 400, (1500,), generator=g)]
    planned = [int(p["packed_seq_params"].cu_seqlens[-1]) for p in sp.pack_stream(docs, 4096, lookahead=512)]
    world = 8
    assert len(planned) % world                                               # a ragged last round
    assert _ratio([sum(planned[r::world]) for r in range(world)]) > 1.01      # negative control: round-robin
    real = [sum(int(p["packed_seq_params"].cu_seqlens[-1]) for p in
                sp.pack_stream(docs, 4096, lookahead=512, world=world, rank=rank)) for rank in range(world)]
    assert _ratio(real) <= 1.01
