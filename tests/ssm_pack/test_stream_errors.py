"""pack_stream refusals: bad arguments, bad documents, a state from another configuration or source."""

import numpy as np
import pytest
import torch

import ssm_pack as sp

DOCS = [torch.arange(n) for n in (5, 9, 3, 12, 7, 4, 8)]


@pytest.mark.parametrize("kwargs,error,match", [
    pytest.param({"max_tokens": 0}, ValueError, "max_tokens must be >= 1, got 0", id="max_tokens-0"),
    pytest.param({"max_tokens": 2.5}, TypeError, "max_tokens must be an int", id="max_tokens-float"),
    pytest.param({"max_tokens": 4, "align_to": 8}, ValueError, "max_tokens=4 is smaller than align_to=8",
                 id="max_tokens-below-align"),
    pytest.param({"lookahead": 0}, ValueError, "lookahead must be >= 1, got 0", id="lookahead-0"),
    pytest.param({"split_long": "drop"}, ValueError, "split_long must be one of .* got 'drop'", id="split_long"),
    pytest.param({"world": 2, "rank": 2}, ValueError, r"rank must be in \[0, world=2\), got 2", id="rank"),
    pytest.param({"world": 0}, ValueError, "world must be >= 1, got 0", id="world"),
    pytest.param({"seed": -1}, ValueError, "seed must be >= 0, got -1", id="seed"),
])
def test_bad_arguments_are_refused_by_name(kwargs, error, match):
    args = {"max_tokens": 16, **kwargs}
    with pytest.raises(error, match=match):
        sp.pack_stream(DOCS, args.pop("max_tokens"), **args)


@pytest.mark.parametrize("documents,error,match", [
    pytest.param("some text", TypeError, "documents must be an iterable of token sequences", id="str"),
    pytest.param(42, TypeError, "documents must be an iterable", id="int"),
    pytest.param(torch.arange(5), ValueError, r"must be \[N, L\]", id="one-1d-tensor"),
    pytest.param([[1, 2], "abc"], TypeError, r"documents\[1\] is a str", id="str-document"),
    pytest.param([[1, 2], {"input_ids": [1]}], TypeError, r"documents\[1\] is a mapping.*dataset\['input_ids'\]",
                 id="row-dict"),
    pytest.param([[1, 2], [1.5, 2.0]], TypeError, r"documents\[1\] must be a 1-D sequence of integer token ids, "
                 "got element 1.5", id="float-ids"),
    pytest.param([[1, 2], [True, False]], TypeError, r"documents\[1\].*element True", id="bool-ids"),
    pytest.param([[1, 2], torch.rand(3)], TypeError, r"documents\[1\] must hold integer token ids", id="float-tensor"),
    pytest.param([[1, 2], np.zeros(3)], TypeError, r"documents\[1\] must be a 1-D integer array", id="float-numpy"),
    pytest.param([[1, 2], [3, -4]], ValueError, r"documents\[1\] holds a negative token id -4", id="negative-id"),
    pytest.param([[1, 2], torch.zeros(2, 2, dtype=torch.long)], ValueError, r"documents\[1\] must be a 1-D",
                 id="2d-document"),
    pytest.param([[1, 2], 7], TypeError, r"documents\[1\] must be a sequence of token ids", id="int-document"),
])
def test_bad_documents_are_refused_by_index(documents, error, match):
    with pytest.raises(error, match=match):
        list(sp.pack_stream(documents, 16))


def test_refuse_names_the_long_document_and_the_fixes():
    with pytest.raises(ValueError, match=r"documents\[1\] has 40 tokens but a pack holds 32 .*split_long='carry'"):
        list(sp.pack_stream([[1] * 4, [1] * 40], 32, split_long="refuse"))


def test_seed_needs_an_indexable_source():
    with pytest.raises(ValueError, match="seed=3 shuffles an indexable source.*generator"):
        sp.pack_stream((d for d in DOCS), 16, seed=3)


@pytest.mark.parametrize("change,match", [
    pytest.param({"max_tokens": 32}, "saved with max_tokens=16 but this stream has max_tokens=32", id="max_tokens"),
    pytest.param({"world": 2}, "saved with world=1", id="world"),
    pytest.param({"world": 2, "rank": 1}, "saved with world=1", id="rank"),
    pytest.param({"lookahead": 2}, "saved with lookahead=4", id="lookahead"),
    pytest.param({"documents": DOCS[:-1]}, "saved from documents .*'length': 7.* but these are .*'length': 6",
                 id="other-documents"),
])
def test_state_from_another_configuration_is_refused(change, match):
    stream = sp.pack_stream(DOCS, 16, lookahead=4)
    next(stream)
    state = stream.state_dict()
    args = {"documents": DOCS, "max_tokens": 16, "lookahead": 4, **change}
    other = sp.pack_stream(args.pop("documents"), args.pop("max_tokens"), **args)
    with pytest.raises(ValueError, match=match):
        other.load_state_dict(state)


def test_state_from_another_stream_of_the_same_shape_is_refused():
    stream = sp.pack_stream((d for d in DOCS), 16, lookahead=2)
    next(stream)
    state = stream.state_dict()
    other = sp.pack_stream((torch.arange(len(d) + 1) for d in DOCS), 16, lookahead=2)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="first documents differ|has .* tokens but had"):
        next(other)


def test_state_must_be_a_state_dict():
    with pytest.raises(TypeError, match="state must be a dict from PackStream.state_dict"):
        sp.pack_stream(DOCS, 16).load_state_dict({"epoch": 0})


def test_state_from_another_worker_layout_is_refused(monkeypatch):
    import ssm_pack.stream.packs as stream_module
    stream = sp.pack_stream(DOCS, 16)
    next(stream)
    state = stream.state_dict()
    monkeypatch.setattr(stream_module, "get_worker_info", lambda: type("Info", (), {"id": 0, "num_workers": 2}))
    other = sp.pack_stream(DOCS, 16)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="saved by worker 0 of 1 but is loaded in worker 0 of 2"):
        next(other)


@pytest.mark.parametrize("seed", [pytest.param(None, id="in-order"), pytest.param(2, id="shuffled")])
def test_state_from_another_list_of_the_same_length_is_refused(seed):
    stream = sp.pack_stream(DOCS, 16, lookahead=1, seed=seed)
    next(stream)
    state = stream.state_dict()
    assert not state["pass"]["buffer"]                  # only the documents already packed can tell
    other = sp.pack_stream([torch.arange(len(d) + 1) for d in DOCS], 16, lookahead=1, seed=seed)
    other.load_state_dict(state)
    with pytest.raises(ValueError, match="first documents differ"):
        next(other)
