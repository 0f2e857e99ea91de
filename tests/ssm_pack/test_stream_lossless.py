"""pack_stream loses nothing: a refused document stops the stream on every later call (never a
silent skip), a stream of empty documents ends with an error, and an edited state is refused whole."""

import copy
import itertools

import pytest
import torch

import ssm_pack as sp
import ssm_pack.stream.packs as packs_module


def _drain(stream, calls: int = 6) -> list:
    """Up to ``calls`` outcomes of ``next(stream)``: the documents of a pack or the error type."""
    seen = []
    for _ in range(calls):
        try:
            seen.append(next(stream)["documents"].tolist())
        except StopIteration:
            break
        except (ValueError, TypeError) as err:
            seen.append(type(err).__name__)
    return seen


BAD_SOURCES = [
    pytest.param([[1, 2], [1] * 10, [3, 4]], {"split_long": "refuse"}, ValueError, "has 10 tokens",
                 id="refuse-long"),
    pytest.param([[1, 2], [1.5, 2], [3, 4]], {"lookahead": 1}, TypeError, "element 1.5", id="float-token"),
    pytest.param([[1, 2], [3, -4], [5, 6]], {"lookahead": 1}, ValueError, "negative token id", id="negative-token"),
    pytest.param([[1, 2], "text", [5, 6]], {}, TypeError, "is a str", id="str-document"),
]


@pytest.mark.parametrize("documents,kwargs,error,match", BAD_SOURCES)
def test_a_refused_document_stops_the_stream_on_every_later_call(documents, kwargs, error, match):
    stream = sp.pack_stream(documents, 4, **kwargs)
    seen = _drain(stream)
    first = seen.index(error.__name__)
    assert seen[first:] == [error.__name__] * (len(seen) - first)      # never a pack after the refusal
    assert len(seen) == 6
    with pytest.raises(error, match=f"stopped at a refused document.*{match}"):
        next(stream)
    with pytest.raises(error, match="stopped at a refused document"):
        stream.state_dict()


def test_the_recovery_path_packs_every_document():
    """Catch, fix the document, resume from the state saved before the refusal: nothing is lost."""
    documents = [[1, 2], [7, 8, 9], [1.5, 2], [3, 4], [5]]
    stream = sp.pack_stream(documents, 4, lookahead=1)
    first = next(stream)
    saved = copy.deepcopy(stream.state_dict())
    assert _drain(stream, 3)[-1] == "TypeError"
    documents[2] = [15, 2]
    resumed = sp.pack_stream(documents, 4, lookahead=1)
    resumed.load_state_dict(saved)
    packed = first["documents"].tolist() + [d for pack in resumed for d in pack["documents"].tolist()]
    assert sorted(packed) == [0, 1, 2, 3, 4]


def test_a_valid_stream_is_not_stopped():
    """Negative control: the same stream without the bad document yields every document."""
    seen = _drain(sp.pack_stream([[1, 2], [1] * 3, [3, 4]], 4, split_long="refuse"))
    assert sorted(d for pack in seen for d in pack) == [0, 1, 2]


def test_endless_empty_documents_end_with_an_error(monkeypatch):
    monkeypatch.setattr(packs_module, "MAX_EMPTY_RUN", 50)
    stream = sp.pack_stream(itertools.repeat([]), 8)
    with pytest.raises(ValueError, match=r"documents\[49\] is the 50th empty document in a row.*MAX_EMPTY_RUN=50"):
        next(stream)
    with pytest.raises(ValueError, match="stopped at a refused document"):
        next(stream)


def test_the_empty_run_bound_is_the_documented_one():
    with pytest.raises(ValueError, match=f"MAX_EMPTY_RUN={packs_module.MAX_EMPTY_RUN}"):
        next(sp.pack_stream(itertools.repeat(b""), 8))


def test_empty_runs_below_the_bound_are_skipped_and_counted(monkeypatch):
    monkeypatch.setattr(packs_module, "MAX_EMPTY_RUN", 50)
    documents = [[]] * 49 + [[1, 2]] + [[]] * 49 + [[3]]
    stream = sp.pack_stream(documents, 8)
    packs = list(stream)
    assert [d for pack in packs for d in pack["documents"].tolist()] == [49, 99]
    assert stream.stats["empty_documents"] == 98


def _edit(path, value):
    def apply(state):
        target = state
        for key in path[:-1]:
            target = target[key]
        if value is _DELETE:
            del target[path[-1]]
        else:
            target[path[-1]] = value
    return apply


_DELETE = object()
TAMPERED = [
    pytest.param(_edit(("config",), "x"), ValueError, r"state\['config'\] must be a dict", id="config-str"),
    pytest.param(_edit(("config", "max_tokens"), _DELETE), ValueError, r"missing \['max_tokens'\]",
                 id="config-missing"),
    pytest.param(_edit(("epoch",), "1"), ValueError, r"state\['epoch'\] must be an int >= 0, got str", id="epoch-str"),
    pytest.param(_edit(("pass", "num_workers"), _DELETE), ValueError, r"missing \['num_workers'\]",
                 id="pass-missing-key"),
    pytest.param(_edit(("pass", "position"), -3), ValueError, r"\['position'\] must be an int >= 0, got int -3",
                 id="position-negative"),
    pytest.param(_edit(("pass", "counters", "packs"), _DELETE), ValueError, r"counters'\] must have the keys",
                 id="counters-missing"),
    pytest.param(_edit(("pass", "lanes"), []), ValueError, r"\['lanes'\] must be a list of world=1", id="lanes-short"),
    pytest.param(_edit(("pass", "buffer"), [[0, "5", False]]), ValueError, r"\['buffer'\]\[0\]\[1\] must be an int",
                 id="buffer-entry"),
    pytest.param(_edit(("pass", "source_done"), "no"), ValueError, r"\['source_done'\] must be a bool",
                 id="source-done-str"),
    pytest.param(lambda state: state.pop("pass"), TypeError, "state must be a dict from PackStream.state_dict",
                 id="no-pass"),
]


@pytest.mark.parametrize("tamper,error,match", TAMPERED)
def test_an_edited_state_is_refused_before_the_stream_changes(tamper, error, match):
    documents = [[1] * n for n in (3, 5, 2, 7, 1, 4)]
    saver = sp.pack_stream(documents, 8, lookahead=2)
    next(saver)
    state = copy.deepcopy(saver.state_dict())
    tamper(state)
    stream = sp.pack_stream(documents, 8, lookahead=2)
    next(stream)
    before = copy.deepcopy(stream.state_dict())
    with pytest.raises(error, match=match):
        stream.load_state_dict(state)
    assert stream.state_dict() == before
    rest = [pack["documents"].tolist() for pack in stream]
    reference = sp.pack_stream(documents, 8, lookahead=2)
    next(reference)
    assert rest == [pack["documents"].tolist() for pack in reference]


def test_an_unedited_state_still_loads():
    """Negative control for the edits above."""
    documents = [torch.arange(n) for n in (3, 5, 2, 7, 1, 4)]
    saver = sp.pack_stream(documents, 8, lookahead=2)
    next(saver)
    resumed = sp.pack_stream(documents, 8, lookahead=2)
    resumed.load_state_dict(copy.deepcopy(saver.state_dict()))
    assert [p["pack_index"] for p in resumed] == [p["pack_index"] for p in saver]
