"""``ssm_pack.stream.buffer``: the tokens the buffer holds, as ``stats["max_buffered_tokens"]`` reports
them, counting the documents longer than a pack (queued apart) in and out."""

import pytest

import ssm_pack as sp

DOCS = [[1] * 19, [2, 3], [4] * 5]           # 19 tokens: longer than a pack of 8, carried


@pytest.mark.parametrize("lookahead, held", [
    pytest.param(4096, 26, id="all-at-once"),        # every document buffered before the first pack
    pytest.param(1, 19, id="one-at-a-time"),         # the long one leaves before the next is read
])
def test_max_buffered_tokens_counts_long_documents_in_and_out(lookahead, held):
    stream = sp.pack_stream(DOCS, 8, lookahead=lookahead)
    packs = list(stream)
    assert len(packs) == 4
    assert stream.stats["max_buffered_tokens"] == held


def test_max_buffered_tokens_counts_truncated_documents():
    stream = sp.pack_stream(DOCS, 8, split_long="truncate")
    list(stream)
    assert stream.stats["max_buffered_tokens"] == 8 + 2 + 5
