"""pack_stream properties over random streams: exact tiling, capacity, carry placement, resume."""

import copy

import torch
from hypothesis import given, settings
from hypothesis import strategies as st

import ssm_pack as sp
from tests.ssm_pack.stream_helpers import documents_of, same_packs

streams = st.fixed_dictionaries({
    "lengths": st.lists(st.integers(0, 70), max_size=40),
    "max_tokens": st.integers(4, 40),
    "align_to": st.sampled_from([1, 2, 4]),
    "lookahead": st.integers(1, 12),
    "world": st.integers(1, 3),
    "stop": st.integers(0, 30),
})


def _docs(lengths):
    out, start = [], 1
    for n in lengths:
        out.append(torch.arange(start, start + n))
        start += n
    return out


@settings(max_examples=40, deadline=None)
@given(streams)
def test_random_streams_tile_every_document_once_and_resume_exactly(case):
    if case["max_tokens"] < case["align_to"]:
        case["max_tokens"] = case["align_to"]
    docs = _docs(case["lengths"])
    kw = {k: case[k] for k in ("align_to", "lookahead", "world")}
    everything, counts = [], set()
    for rank in range(case["world"]):
        packs = list(sp.pack_stream(docs, case["max_tokens"], rank=rank, **kw))
        counts.add(len(packs))
        for before, after in zip(packs, packs[1:]):                  # carry stays on the rank, in order
            assert after["continues"] == before["continued"]
        for pack in packs:
            assert int(pack["packed_seq_params"].cu_seqlens[-1]) <= case["max_tokens"]
        everything += packs
        stop = min(case["stop"], len(packs))
        stream = sp.pack_stream(docs, case["max_tokens"], rank=rank, **kw)
        head = [next(stream) for _ in range(stop)]
        resumed = sp.pack_stream(docs, case["max_tokens"], rank=rank, **kw)
        resumed.load_state_dict(copy.deepcopy(stream.state_dict()))
        assert same_packs(head + list(resumed), packs)
    assert len(counts) <= 1
    back = documents_of(everything)
    want = {i: d for i, d in enumerate(docs) if len(d)}
    assert sorted(back) == sorted(want) and all(torch.equal(back[i], want[i]) for i in want)
