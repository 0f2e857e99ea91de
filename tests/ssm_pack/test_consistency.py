"""The metadata checks every entry point shares (ssm_pack.formats.consistency), called directly: the
int32 limit at its boundary, the params' token count, and each boundary source against the others."""

from types import SimpleNamespace

import pytest
import torch

from ssm_pack.formats.consistency import INT32_MAX, check_boundary_sources, check_metadata, check_within_int32

CU = torch.tensor([0, 3, 5, 9], dtype=torch.int32)                  # documents of 3, 2 and 4 tokens


def positions(cu, total):
    """Positions restarting at 0 at every document start and at the tail past ``cu[-1]`` (a segment
    of its own, as ``VarlenBatch.position_ids`` numbers it)."""
    out, cu = [], cu.tolist()
    for a, b in zip(cu[:-1], cu[1:]):
        out += list(range(b - a))
    out += list(range(total - cu[-1]))
    return torch.tensor([out])


def test_int32_limit_is_the_largest_int32():
    assert INT32_MAX == torch.iinfo(torch.int32).max


@pytest.mark.parametrize("value, refused", [
    pytest.param(INT32_MAX, False, id="int32-max-fits"),
    pytest.param(INT32_MAX + 1, True, id="one-past-refused"),
    pytest.param(0, False, id="zero-fits"),
])
def test_within_int32_at_its_boundary(value, refused):
    if refused:
        with pytest.raises(ValueError, match=rf"the row reaches {value} tokens, past int32 \({INT32_MAX}\)"):
            check_within_int32("the row", value)
    else:
        check_within_int32("the row", value)


@pytest.mark.parametrize("params, total, match", [
    pytest.param(SimpleNamespace(), INT32_MAX + 1, "past int32", id="input-past-int32"),
    pytest.param(SimpleNamespace(total_tokens=7), 9, "total_tokens=7 but the input has 9 tokens", id="fewer"),
    pytest.param(SimpleNamespace(total_tokens=11), 9, "total_tokens=11 but the input has 9 tokens", id="more"),
])
def test_check_metadata_refuses(params, total, match):
    with pytest.raises(ValueError, match=match):
        check_metadata(params, total)


@pytest.mark.parametrize("params", [
    pytest.param(SimpleNamespace(total_tokens=9), id="same-count"),
    pytest.param(SimpleNamespace(total_tokens=None), id="no-count"),
    pytest.param(SimpleNamespace(total_tokens=True), id="bool-is-not-a-count"),
])
def test_check_metadata_takes(params):
    check_metadata(params, 9)


@pytest.mark.parametrize("cu, total, mrope", [
    pytest.param(CU, 9, False, id="exact"),
    pytest.param(CU, 12, False, id="padding-tail"),
    pytest.param(torch.tensor([0, 3, 3, 5, 9]), 9, False, id="empty-document-inside"),
    pytest.param(torch.tensor([0, 3, 5, 9, 9]), 9, False, id="empty-document-last"),
    pytest.param(CU, 9, True, id="mrope"),
])
def test_agreeing_sources_pass(cu, total, mrope):
    pos = positions(cu, total)
    seq = torch.repeat_interleave(torch.arange(len(cu) - 1), torch.diff(cu).long())
    seq = torch.cat([seq, torch.full((total - int(cu[-1]),), len(cu) - 1)])
    check_boundary_sources(total, cu, source="cu_seq_lens_q", position_ids=pos, seq_idx=seq[None], mrope=mrope)
    check_boundary_sources(total, cu, source="seq_idx", position_ids=pos, mrope=mrope)
    check_boundary_sources(total, cu, source="position_ids", seq_idx=seq)         # no position_ids given


def test_mrope_allows_repeated_positions_inside_a_document_only():
    pos = torch.tensor([[0, 1, 0, 0, 1, 0, 0, 1, 2]])                  # temporal plane: 0 again inside doc 0 and 2
    check_boundary_sources(9, CU, source="cu_seq_lens_q", position_ids=pos, mrope=True)
    with pytest.raises(ValueError, match="at token 2 position_ids is 0 but cu_seq_lens_q does not start"):
        check_boundary_sources(9, CU, source="cu_seq_lens_q", position_ids=pos, mrope=False)


def test_position_ids_naming_other_documents_are_refused_at_the_first_bad_token():
    pos = positions(CU, 9)
    pos[0, 5] = 7                                                    # doc 2 does not restart at token 5
    pos[0, 7] = 0                                                    # and restarts inside at token 7
    with pytest.raises(ValueError, match="at token 5 position_ids is 7 but cu_seq_lens_q starts a document"):
        check_boundary_sources(9, CU, source="cu_seq_lens_q", position_ids=pos)
    check_boundary_sources(9, CU, source="position_ids", position_ids=pos)     # its own source: not compared


@pytest.mark.parametrize("shape", [pytest.param((1, 9), id="batch-row"), pytest.param((9,), id="flat")])
def test_seq_idx_naming_other_documents_is_refused_at_the_first_bad_token(shape):
    seq = torch.tensor([0, 0, 0, 1, 1, 2, 2, 2, 2])
    seq[4] = 2
    seq[6] = 0
    with pytest.raises(ValueError, match="token 4 is in document 2 by seq_idx but 1 by cu_seq_lens_q"):
        check_boundary_sources(9, CU, source="cu_seq_lens_q", seq_idx=seq.reshape(shape))
    check_boundary_sources(9, CU, source="seq_idx", seq_idx=seq.reshape(shape))     # its own source


@pytest.mark.parametrize("name", ["position_ids", "seq_idx"])
@pytest.mark.parametrize("tokens", [pytest.param(8, id="fewer"), pytest.param(10, id="more")])
def test_a_source_of_another_length_is_refused(name, tokens):
    with pytest.raises(ValueError, match=rf"batch\['{name}'\] covers {tokens} tokens but the row has 9"):
        check_boundary_sources(9, CU, source="cu_seq_lens_q", **{name: torch.zeros(1, tokens, dtype=torch.long)})
