"""pack_stream: layout of a pack, every document exactly once, input kinds, long documents."""

import random

import pytest
import torch

import ssm_pack as sp
from benchmarks.bench_stream import greedy_packs
from tests.ssm_pack.stream_helpers import corpus, documents_of, pieces_of, same_packs


def _check_exact(docs, packs):
    """Every non-empty document comes back whole, exactly once; nothing else is in the packs."""
    back = documents_of(packs)
    want = {i: torch.as_tensor(d) for i, d in enumerate(docs) if len(d)}
    assert sorted(back) == sorted(want)
    for i, tokens in want.items():
        assert torch.equal(back[i], tokens.long()), i


@pytest.mark.parametrize("align_to,lookahead", [pytest.param(1, 4096, id="default"), pytest.param(4, 8, id="align4"),
                                                 pytest.param(8, 1, id="lookahead1")])
def test_every_document_once_and_every_pack_full_size(align_to, lookahead):
    docs = corpus(300, empty=5, long=(200, 64))
    stream = sp.pack_stream(docs, 64, lookahead=lookahead, align_to=align_to)
    packs = list(stream)
    _check_exact(docs, packs)
    for pack in packs:
        for key in ("input_ids", "labels", "targets", "position_ids"):
            assert pack[key].shape == (1, 64) and pack[key].dtype == torch.int64
        params = pack["packed_seq_params"]
        assert params.total_tokens == 64 and params.seq_idx.shape == (1, 64)
        assert all(int(s) % align_to == 0 for s in params.cu_seqlens)
    assert stream.stats["empty_documents"] == 5 and stream.stats["documents"] == 307
    assert stream.stats["real_tokens"] == sum(len(d) for d in docs)
    assert stream.stats["packs"] == len(packs)


def test_labels_targets_and_positions_of_one_pack():
    docs = [torch.tensor([5, 6, 7]), torch.tensor([8, 9])]
    (pack,) = list(sp.pack_stream(docs, 8, align_to=4, pad_token_id=1))
    assert pack["input_ids"].tolist() == [[5, 6, 7, 1, 8, 9, 1, 1]]
    assert pack["labels"].tolist() == [[-100, 6, 7, -100, -100, 9, -100, -100]]
    assert pack["targets"].tolist() == [[6, 7, -100, -100, 9, -100, -100, -100]]
    assert pack["position_ids"].tolist() == [[0, 1, 2, 3, 0, 1, 2, 3]]      # slot padding counts on
    assert pack["packed_seq_params"].cu_seqlens_q.tolist() == [0, 3, 5]
    assert pack["packed_seq_params"].cu_seqlens_q_padded.tolist() == [0, 4, 8]
    assert pack["documents"].tolist() == [0, 1] and not pack["continues"] and not pack["continued"]


def test_best_fit_decreasing_fills_a_pack_with_the_largest_documents_that_fit():
    docs = [[1] * n for n in (2, 5, 3, 6, 4)]
    packs = list(sp.pack_stream(docs, 10))
    assert [p["documents"].tolist() for p in packs] == [[3, 4], [1, 2, 0]]     # 6+4, 5+3+2


@pytest.mark.parametrize("kind", [
    pytest.param(lambda docs: docs, id="tensors"),
    pytest.param(lambda docs: [d.tolist() for d in docs], id="lists"),
    pytest.param(lambda docs: [tuple(d.tolist()) for d in docs], id="tuples"),
    pytest.param(lambda docs: [d.numpy().astype("int32") for d in docs], id="numpy"),
    pytest.param(lambda docs: (d for d in docs), id="generator"),
    pytest.param(lambda docs: [bytes(d.tolist()) for d in docs], id="bytes"),
])
def test_input_kinds(kind):
    docs = [torch.randint(0, 256, (n,)) for n in (7, 3, 12, 1, 9)]
    _check_exact(docs, list(sp.pack_stream(kind(docs), 16)))


def test_tensor_of_rows_is_one_document_per_row():
    rows = torch.randint(0, 256, (5, 6))
    packs = list(sp.pack_stream(rows, 16))
    _check_exact(list(rows), packs)
    assert len(packs) == 3


class _Column:
    """Duck-typed stand-in for a Hugging Face ``datasets`` column: len, __getitem__, _fingerprint."""

    _fingerprint = "abc123"

    def __init__(self, rows):
        self.rows = rows

    def __len__(self):
        return len(self.rows)

    def __getitem__(self, i):
        return self.rows[i]


def test_dataset_column_with_seed_is_a_permutation_per_epoch():
    docs = corpus(200, longest=20)
    column = _Column([d.tolist() for d in docs])
    stream = sp.pack_stream(column, 32, seed=3, lookahead=4)
    first = list(stream)
    stream.set_epoch(1)
    second = list(stream)
    _check_exact(docs, first)
    _check_exact(docs, second)
    order = [p["documents"].tolist() for p in first]
    assert order != [p["documents"].tolist() for p in second]                 # another shuffle
    assert order != [p["documents"].tolist() for p in sp.pack_stream(column, 32, lookahead=4)]
    assert order == [p["documents"].tolist() for p in sp.pack_stream(column, 32, seed=3, lookahead=4)]


@pytest.mark.parametrize("align_to", [pytest.param(1, id="align1"), pytest.param(4, id="align4")])
def test_carry_pieces_in_consecutive_packs_with_continuing_positions_and_targets(align_to):
    long = torch.arange(1000, 1150)
    docs = [torch.arange(1, 11), long, torch.arange(20, 25)]
    packs = list(sp.pack_stream(docs, 64, align_to=align_to))
    _check_exact(docs, packs)
    pieces = sorted(pieces_of(packs)[1], key=lambda item: item[0])
    assert len(pieces) == 3
    holding = [i for i, p in enumerate(packs) if 1 in p["documents"].tolist()]
    assert holding == list(range(holding[0], holding[0] + 3))                  # consecutive packs
    for i in holding:
        pack = packs[i]
        slot = pack["documents"].tolist().index(1)
        start = int(pack["packed_seq_params"].cu_seqlens[slot])
        offset = int(pack["offsets"][slot])
        length = int(pack["packed_seq_params"].lengths()[slot])
        assert pack["position_ids"][0, start:start + length].tolist() == list(range(offset, offset + length))
        last = int(pack["targets"][0, start + length - 1])
        assert last == (1000 + offset + length if offset + length < 150 else -100)
        assert pack["continues"] == (offset > 0)
        assert pack["continued"] == (offset + length < 150)
        assert pack["continued"] == (slot == len(pack["documents"]) - 1 and offset + length < 150)


def test_truncate_keeps_the_head_and_counts_the_rest():
    docs = [torch.arange(100), torch.arange(5)]
    stream = sp.pack_stream(docs, 32, split_long="truncate", align_to=8)
    back = documents_of(list(stream))
    assert torch.equal(back[0], torch.arange(32)) and torch.equal(back[1], torch.arange(5))
    assert stream.stats["truncated_tokens"] == 68


def test_padding_close_to_the_offline_first_fit_decreasing_plan():
    rng = random.Random(1)
    lengths = [min(int(rng.paretovariate(1.2) * 40), 2048) for _ in range(4000)]
    docs = [[1] * n for n in lengths]
    stream = sp.pack_stream(docs, 2048, lookahead=1024)
    packs = sum(1 for _ in stream)
    offline = len(sp.plan_packs(lengths, 2048).packs)
    greedy = greedy_packs(lengths, 2048)
    assert packs <= offline * 1.01 + 1, (packs, offline)
    assert packs < greedy
    assert stream.stats["max_buffered_tokens"] <= 1024 * 2048


@pytest.mark.parametrize("align_to", [pytest.param(1, id="align1"), pytest.param(4, id="align4")])
def test_byte_documents_with_a_carried_one_match_the_same_token_lists(align_to):
    g = torch.Generator().manual_seed(0)
    docs = [torch.randint(0, 256, (n,), generator=g) for n in (7, 3, 40, 12, 1, 9)]
    as_bytes = list(sp.pack_stream([bytes(d.tolist()) for d in docs], 16, align_to=align_to))
    as_lists = list(sp.pack_stream([d.tolist() for d in docs], 16, align_to=align_to))
    _check_exact(docs, as_bytes)
    assert any(p["continued"] for p in as_bytes)
    assert same_packs(as_bytes, as_lists)
