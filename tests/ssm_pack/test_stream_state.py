"""Every field of a saved PackStream state checked by name before the stream takes it
(ssm_pack.stream.state): each edit a checkpoint could make is refused with the field and the
value, the stream left as it was; the edges of each range are taken."""

import copy

import pytest
import torch

import ssm_pack as sp

DOCS = [torch.arange(n) for n in (5, 9, 3, 12, 7, 4, 8)]


def saved(world=1):
    stream = sp.pack_stream(DOCS, 16, lookahead=4, world=world, rank=world - 1)
    next(stream)
    return stream.state_dict()


def edited(state, path, value):
    state = copy.deepcopy(state)
    *parents, last = path
    target = state
    for key in parents:
        target = target[key]
    if value is KeyError:
        del target[last]
    else:
        target[last] = value
    return state


REFUSED = [
    pytest.param(("source",), 5, r"state\['source'\] must be a dict, got int", id="source-not-dict"),
    pytest.param(("config", "world"), 0, r"state\['config'\]\['world'\] must be an int >= 1", id="world-0"),
    pytest.param(("epoch",), -1, r"state\['epoch'\] must be an int >= 0", id="epoch-negative"),
    pytest.param(("epoch",), True, r"state\['epoch'\] must be an int >= 0, got bool", id="epoch-bool"),
    pytest.param(("pass", "num_workers"), 0, r"\['pass'\]\['num_workers'\] must be an int >= 1", id="workers-0"),
    pytest.param(("pass", "g"), -1, r"\['pass'\]\['g'\] must be an int >= 0", id="g-negative"),
    pytest.param(("pass", "source_done"), 1, r"\['pass'\]\['source_done'\] must be a bool", id="done-int"),
    pytest.param(("pass", "checksum"), -1, r"\['pass'\]\['checksum'\] must be an int >= 0", id="checksum-negative"),
    pytest.param(("pass", "checksum"), (1 << 61) - 1, r"\['pass'\]\['checksum'\] must be below", id="checksum-mod"),
    pytest.param(("pass", "total"), -1, r"\['pass'\]\['total'\] must be an int >= 0", id="total-negative"),
    pytest.param(("pass", "total"), "7", r"\['pass'\]\['total'\] must be an int >= 0", id="total-str"),
    pytest.param(("pass", "counters", "packs"), -1, r"\['counters'\]\['packs'\] must be an int >= 0",
                 id="counter-negative"),
    pytest.param(("pass", "counters", "packs"), KeyError, r"\['pass'\]\['counters'\] must have the keys",
                 id="counter-missing"),
    pytest.param(("pass", "lanes"), [None, None], r"\['pass'\]\['lanes'\] must be a list of world=1",
                 id="lanes-too-many"),
    pytest.param(("pass", "rank_tokens"), 16, r"\['pass'\]\['rank_tokens'\] must be a list", id="rank-tokens-int"),
    pytest.param(("pass", "rank_tokens", 0), -1, r"\['rank_tokens'\]\[0\] must be an int >= 0",
                 id="rank-tokens-negative"),
    pytest.param(("pass", "lanes", 0), 3, r"\['lanes'\]\[0\] must be None or \[index, offset, length\]",
                 id="lane-int"),
    pytest.param(("pass", "lanes", 0), [0, 1], r"\['lanes'\]\[0\] must be None or \[index, offset", id="lane-2"),
    pytest.param(("pass", "lanes", 0), [-1, 0, 1], r"\['lanes'\]\[0\]\[0\] must be an int >= 0", id="lane-index"),
    pytest.param(("pass", "lanes", 0), [0, -1, 1], r"\['lanes'\]\[0\]\[1\] must be an int >= 0", id="lane-offset"),
    pytest.param(("pass", "lanes", 0), [0, 0, 0], r"\['lanes'\]\[0\]\[2\] must be an int >= 1", id="lane-length-0"),
    pytest.param(("pass", "buffer"), {}, r"\['pass'\]\['buffer'\] must be a list", id="buffer-dict"),
    pytest.param(("pass", "buffer", 0), [2, 3], r"\['buffer'\]\[0\] must be \[index, length, long\]",
                 id="buffer-entry-2"),
    pytest.param(("pass", "buffer", 0), [2, 3, 0], r"\['buffer'\]\[0\] must be \[index, length, long\]",
                 id="buffer-long-int"),
    pytest.param(("pass", "buffer", 1), [-1, 5, False], r"\['buffer'\]\[1\]\[0\] must be an int >= 0",
                 id="buffer-index"),
    pytest.param(("pass", "buffer", 1), [0, 0, False], r"\['buffer'\]\[1\]\[1\] must be an int >= 1",
                 id="buffer-length-0"),
]


@pytest.mark.parametrize("path, value, match", REFUSED)
def test_an_edited_field_is_refused_by_name_and_the_stream_is_unchanged(path, value, match):
    stream = sp.pack_stream(DOCS, 16, lookahead=4)
    before = copy.deepcopy(stream.state_dict())
    with pytest.raises(ValueError, match=match):
        stream.load_state_dict(edited(saved(), path, value))
    assert stream.state_dict() == before


TAKEN = [
    pytest.param(("pass", "g"), 0, id="g-0"),
    pytest.param(("pass", "position"), 0, id="position-0"),
    pytest.param(("pass", "num_workers"), 1, id="one-worker"),
    pytest.param(("pass", "checksum"), (1 << 61) - 2, id="checksum-below-mod"),
    pytest.param(("pass", "checksum"), 0, id="checksum-0"),
    pytest.param(("pass", "total"), 7, id="total-known"),
    pytest.param(("pass", "total"), 0, id="total-0"),
    pytest.param(("pass", "lanes", 0), [0, 0, 1], id="lane-at-zero-of-length-1"),
    pytest.param(("pass", "lanes", 0), (6, 3, 5), id="lane-tuple"),
    pytest.param(("pass", "buffer", 1), [0, 1, True], id="buffer-length-1"),
    pytest.param(("pass", "buffer"), [], id="buffer-empty"),
]


@pytest.mark.parametrize("path, value", TAKEN)
def test_a_state_at_the_edge_of_each_range_is_taken(path, value):
    state = edited(saved(), path, value)
    stream = sp.pack_stream(DOCS, 16, lookahead=4)
    stream.load_state_dict(state)
    assert stream.state_dict()["pass"][path[1]] == state["pass"][path[1]]


def test_a_state_before_any_pass_is_taken_whatever_follows():
    state = saved()
    state["pass"] = None
    stream = sp.pack_stream(DOCS, 16, lookahead=4)
    stream.load_state_dict(state)
    assert [p["input_ids"].tolist() for p in stream] == [p["input_ids"].tolist()
                                                         for p in sp.pack_stream(DOCS, 16, lookahead=4)]


def test_a_state_of_two_ranks_checks_both_lists():
    state = saved(world=2)
    stream = sp.pack_stream(DOCS, 16, lookahead=4, world=2, rank=1)
    stream.load_state_dict(copy.deepcopy(state))
    with pytest.raises(ValueError, match=r"\['rank_tokens'\]\[1\] must be an int >= 0"):
        stream.load_state_dict(edited(state, ("pass", "rank_tokens", 1), -3))
    with pytest.raises(ValueError, match=r"\['lanes'\]\[1\] must be None or"):
        stream.load_state_dict(edited(state, ("pass", "lanes", 1), "x"))
