"""``ssm_pack.stream.source``: token conversion without a copy where none is needed, and a resumed
pass that reads a dataset's rows before the resume point no more."""

import copy

import pytest
import torch

import ssm_pack as sp
from ssm_pack.stream.source import document_tokens
from tests.ssm_pack.stream_helpers import same_packs


def test_a_cpu_int64_tensor_is_used_as_it_is():
    tokens = torch.tensor([3, 1, 2])
    assert document_tokens(0, tokens) is tokens                   # no copy, not even a detached view
    narrow = torch.tensor([3, 1, 2], dtype=torch.int32)          # control: another dtype is converted
    converted = document_tokens(0, narrow)
    assert converted.dtype == torch.int64 and converted.tolist() == [3, 1, 2]


class Rows:
    """A dataset: ``len`` and ``__getitem__`` (not a list), logging the rows read."""

    def __init__(self, docs):
        self.docs, self.read = docs, []

    def __len__(self):
        return len(self.docs)

    def __getitem__(self, i):
        self.read.append(i)
        return self.docs[i]


DOCS = [[1] * 3, [2] * 5, [3] * 19, [4] * 2, [5] * 6, [6] * 4, [7] * 7]


@pytest.mark.parametrize("stop", [pytest.param(2, id="inside-a-carry"), pytest.param(1, id="after-one")])
def test_a_resumed_dataset_is_not_read_again_before_the_resume_point(stop):
    full = list(sp.pack_stream(Rows(DOCS), 8, lookahead=2))
    stream = sp.pack_stream(Rows(DOCS), 8, lookahead=2)
    head = [next(stream) for _ in range(stop)]
    state = copy.deepcopy(stream.state_dict())
    rows = Rows(DOCS)
    resumed = sp.pack_stream(rows, 8, lookahead=2)
    resumed.load_state_dict(state)
    rest = list(resumed)
    assert same_packs(head + rest, full)
    position = state["pass"]["position"]
    carried = sorted({lane[0] for lane in state["pass"]["lanes"] if lane is not None}
                     | {entry[0] for entry in state["pass"]["buffer"]})
    assert rows.read == carried + list(range(position, len(DOCS)))
