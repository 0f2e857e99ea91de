"""Property test of ``enable_packing`` on a tiny Hugging Face Mamba2: drawn packing keywords
(``cu_seq_lens_q/k``, ``max_length_q/k``, ``position_ids``, ``seq_idx``, ``attention_mask``), each
absent, describing the row's documents, or describing other documents. The call is refused with a
``ValueError`` / ``TypeError`` naming the keyword (the weights bitwise unchanged), or its logits
equal the per-document oracle: each document the keywords describe, run alone."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given, settings
from hypothesis import strategies as st

transformers = pytest.importorskip("transformers")

from mixers.integrations.transformers import enable_packing  # noqa: E402
from tests.mixers.integrations import hf_models  # noqa: E402
from tests.ssm_pack.contracts import outcome  # noqa: E402

NAMES = ("cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k", "position_ids", "seq_idx",
         "attention_mask")
_LENGTHS = st.lists(st.integers(1, 6), min_size=1, max_size=4)
_MODEL = {}


def _model():
    if not _MODEL:
        torch.manual_seed(0)
        model = hf_models.mamba2(None, "sdpa").float().eval()
        _MODEL["model"] = enable_packing(model)
    return _MODEL["model"]


def _cu(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@st.composite
def packing_case(draw):
    lengths = draw(_LENGTHS)
    other = draw(_LENGTHS)                                    # the documents a wrong keyword describes
    pick = st.sampled_from(["absent", "row", "other"])
    keys = {k: draw(pick) for k in ("cu_seq_lens_q", "position_ids", "seq_idx", "attention_mask")}
    if keys["cu_seq_lens_q"] != "absent":                     # flash-attention keywords come with cu_seq_lens_q
        keys.update({k: draw(pick) for k in ("cu_seq_lens_k", "max_length_q", "max_length_k")})
    return lengths, other, keys, draw(st.integers(0, 5)), draw(st.integers(0, 2**16))


def _kwargs(case) -> dict:
    lengths, other, keys, small, seed = case
    total = sum(lengths)
    g = torch.Generator().manual_seed(seed)
    out = {"input_ids": torch.randint(0, hf_models.VOCAB, (1, total), generator=g)}
    for key, how in keys.items():
        docs = lengths if how == "row" else other
        if how == "absent":
            continue
        if key.startswith("cu_seq_lens"):
            out[key] = torch.tensor(_cu(docs), dtype=torch.int32)
        elif key.startswith("max_length"):
            out[key] = max(lengths) if how == "row" else small
        elif key == "position_ids":
            out[key] = torch.cat([torch.arange(n) for n in docs]).unsqueeze(0)
        elif key == "seq_idx":
            out[key] = torch.cat([torch.full((n,), i, dtype=torch.int32) for i, n in enumerate(docs)]).unsqueeze(0)
        else:
            mask = torch.ones(1, total, dtype=torch.long)
            if how == "other":
                mask[0, small % total] = 0
            out[key] = mask
    return out


def _split(kwargs) -> list[int] | None:
    """The documents (as offsets) the keywords agree on, ``[]`` for an unpacked call, ``None``
    where a refusal is due (keywords that disagree or do not fit the row)."""
    total = kwargs["input_ids"].shape[1]
    found = []
    if "cu_seq_lens_q" in kwargs:
        cu = kwargs["cu_seq_lens_q"].tolist()
        if cu[-1] > total or kwargs.get("cu_seq_lens_k", kwargs["cu_seq_lens_q"]).tolist() != cu:
            return None
        longest = max(b - a for a, b in zip(cu, cu[1:]))
        if any(kwargs.get(k, longest) < longest for k in ("max_length_q", "max_length_k")):
            return None
        found.append(cu + ([total] if cu[-1] < total else []))
    for key in ("seq_idx", "position_ids"):
        if key in kwargs:
            row = kwargs[key][0].tolist()
            if len(row) != total:
                return None
            starts = [t for t in range(total) if (row[t] != row[t - 1] if key == "seq_idx" else row[t] == 0)]
            found.append([*([0] if 0 not in starts else []), *starts, total])
    if "position_ids" in kwargs and len(found) == 1 and found[0] == [0, total]:
        found = []                                            # positions without a restart: not packed
    if any(f != found[0] for f in found):
        return None
    if found and "attention_mask" in kwargs and not bool(kwargs["attention_mask"].all()):
        return None
    return found[0] if found else []


@torch.no_grad()
def _oracle(kwargs, split) -> torch.Tensor:
    model, ids = _model(), kwargs["input_ids"]
    if not split:                                             # unpacked: the kept tokens as one document
        keep = kwargs.get("attention_mask", torch.ones_like(ids)).bool()
        return model(input_ids=ids[keep].unsqueeze(0)).logits[0]
    return torch.cat([model(input_ids=ids[:, a:b]).logits[0] for a, b in zip(split, split[1:])])


def packing_verdict(case) -> str:
    model = _model()
    kwargs = _kwargs(case)
    split = _split(kwargs)
    before = {k: v.clone() for k, v in model.state_dict().items()}

    def equals_oracle(out) -> bool:
        if split is None:
            return False
        logits = out.logits[0]
        if not split and "attention_mask" in kwargs:
            logits = logits[kwargs["attention_mask"][0].bool()]
        return bool(torch.allclose(logits, _oracle(kwargs, split), rtol=1e-4, atol=1e-5))

    with torch.no_grad():
        verdict = outcome(lambda: model(**kwargs), NAMES, equals_oracle)
    after = model.state_dict()
    if any(not torch.equal(v, after[k]) for k, v in before.items()):
        return "silent"                                       # a call wrote to the weights
    return verdict


@settings(max_examples=20)                                    # each example runs the model per document
@given(packing_case())
# a second source carrying the last document on into the tokens after cu_seq_lens_q[-1]
@example(([2], [1], {"cu_seq_lens_q": "other", "position_ids": "absent", "seq_idx": "row", "attention_mask": "absent",
                     "cu_seq_lens_k": "absent", "max_length_q": "absent", "max_length_k": "absent"}, 0, 0))
@example(([2], [1], {"cu_seq_lens_q": "other", "position_ids": "row", "seq_idx": "absent", "attention_mask": "absent",
                     "cu_seq_lens_k": "absent", "max_length_q": "absent", "max_length_k": "absent"}, 0, 0))
def test_packing_keywords_are_refused_by_name_or_give_each_document_alone(case):
    assert packing_verdict(case) in ("clear", "ok")


ROW = {"cu_seq_lens_q": "row", "position_ids": "absent", "seq_idx": "absent", "attention_mask": "absent"}


@pytest.mark.parametrize("case,want", [
    pytest.param(([3, 5, 2], [4], ROW, 0, 0), "ok", id="cu-seq-lens"),
    pytest.param(([3, 5, 2], [4], {**ROW, "cu_seq_lens_q": "absent", "position_ids": "row"}, 0, 0), "ok",
                 id="position-resets"),
    pytest.param(([3, 5, 2], [4], {**ROW, "cu_seq_lens_q": "absent"}, 0, 0), "ok", id="unpacked"),
    pytest.param(([3, 5, 2], [5, 5], {**ROW, "seq_idx": "other"}, 0, 0), "clear", id="seq-idx-disagrees"),
    pytest.param(([3, 5, 2], [4], {**ROW, "max_length_q": "other"}, 2, 0), "clear", id="max-length-short"),
    pytest.param(([3, 5, 2], [4], {**ROW, "attention_mask": "other"}, 1, 0), "clear", id="packed-and-padded"),
    pytest.param(([3, 5, 2], [4, 6], {**ROW, "cu_seq_lens_k": "other"}, 0, 0), "clear", id="cu-seq-lens-k-disagrees"),
    pytest.param(([3, 5, 2], [4], {**ROW, "cu_seq_lens_k": "other"}, 0, 0), "clear", id="cu-seq-lens-k-fewer-docs"),
    pytest.param(([2], [4], {**ROW, "cu_seq_lens_q": "absent", "position_ids": "other"}, 0, 0), "clear",
                 id="unpacked-positions-of-other-length"),
])
def test_the_packing_verdict_is_not_vacuous(case, want):
    """Negative controls: each verdict the property accepts is reached."""
    assert packing_verdict(case) == want


def test_the_oracle_tells_documents_apart():
    """Negative control of the oracle: the row run as one document is not the documents alone."""
    kwargs = _kwargs(([3, 5, 2], [4], ROW, 0, 0))
    with torch.no_grad():
        whole = _model()(input_ids=kwargs["input_ids"]).logits[0]
    assert not torch.allclose(whole, _oracle(kwargs, [0, 3, 8, 10]), rtol=1e-4, atol=1e-5)
