"""Property tests of the checkpoint converters: a drawn tampering of a valid upstream state dict
(keys dropped, keys added, shapes changed, dtypes changed, a value that is no tensor) is refused
with a ``ValueError`` / ``TypeError`` naming every tampered key, the input left bitwise as it was;
an untampered one (any floating dtype per key) converts and round-trips bit-exactly."""

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from mixers.checkpoints import SOURCES, from_state_dict, to_state_dict
from tests.mixers.checkpoints.test_convert import CONFIGS, _random_mixer
from tests.ssm_pack.contracts import outcome

# Dtypes a checkpoint entry may hold: the floating ones convert (each key keeps its own), the
# others are no weight of a real-valued layer and must be refused by key.
FLOATS = (torch.float32, torch.float16, torch.bfloat16, torch.float64)
NOT_FLOATS = (torch.int64, torch.int8, torch.bool, torch.complex64)

_EDIT = st.sampled_from(["drop", "extra", "reshape", "grow", "float", "not-float", "not-tensor"])


@st.composite
def tampering(draw):
    source = draw(st.sampled_from(sorted(SOURCES)))
    keys = sorted(to_state_dict(_random_mixer(source), source))
    edits = draw(st.lists(st.tuples(_EDIT, st.sampled_from(keys), st.integers(0, 3)), max_size=3,
                          unique_by=lambda edit: edit[1]))      # one edit per key
    return source, edits, draw(st.integers(0, 2**16))


def _apply(sd: dict, edits) -> set[str]:
    """Tamper ``sd`` in place; the keys a refusal must name (empty: the dict is still valid)."""
    bad: set[str] = set()
    for kind, key, pick in edits:
        if kind == "extra":
            name = f"zz_extra_{pick}.weight"
            sd[name] = torch.zeros(2)
            bad.add(name)
        elif kind == "drop":
            del sd[key]
            bad.add(key)
        elif kind == "reshape":
            sd[key] = sd[key].unsqueeze(0)
            bad.add(key)
        elif kind == "grow":
            sd[key] = torch.cat([sd[key], sd[key][:1]])
            bad.add(key)
        elif kind == "float":
            sd[key] = sd[key].to(FLOATS[pick])
        elif kind == "not-float":
            sd[key] = sd[key].to(NOT_FLOATS[pick])
            bad.add(key)
        else:
            sd[key] = sd[key].tolist()
            bad.add(key)
    return bad


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(
        type(a[k]) is type(b[k]) and (a[k] == b[k] if not isinstance(a[k], torch.Tensor)
                                      else a[k].dtype == b[k].dtype and torch.equal(a[k], b[k])) for k in a)


def convert_verdict(case) -> str:
    source, edits, seed = case
    torch.manual_seed(seed)
    sd = to_state_dict(_random_mixer(source), source)
    bad = _apply(sd, edits)
    before = {k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in sd.items()}

    def round_trips(mixer) -> bool:
        return not bad and _same(to_state_dict(mixer, source), before)

    names = tuple(repr(k) if not k.startswith("zz_") else k for k in bad) or ("state_dict",)
    verdict = outcome(lambda: from_state_dict(sd, source, CONFIGS[source], backend="reference"), names,
                      round_trips)
    if verdict == "clear" and not all(k in _message(sd, source) for k in bad):
        return "obscure"                                  # refused, but some tampered key unnamed
    if not _same(sd, before):
        return "silent"                                   # the input was written to
    return verdict


def _message(sd, source) -> str:
    try:
        from_state_dict(sd, source, CONFIGS[source], backend="reference")
    except (ValueError, TypeError) as err:
        return str(err)
    return ""


@given(tampering())
def test_a_tampered_state_dict_is_refused_by_key_or_round_trips(case):
    assert convert_verdict(case) in ("clear", "ok")


@pytest.mark.parametrize("case,want", [
    pytest.param(("hf_mamba2", [], 0), "ok", id="valid"),
    pytest.param(("fla_gdn", [("float", "o_proj.weight", 2)], 0), "ok", id="one-key-bf16"),
    pytest.param(("hf_mamba2", [("drop", "D", 0)], 0), "clear", id="dropped"),
    pytest.param(("mamba_ssm", [("grow", "dt_bias", 0), ("extra", "D", 1)], 0), "clear", id="grown-and-extra"),
    pytest.param(("hf_mamba2", [("not-float", "dt_bias", 0)], 0), "clear", id="int64-weight"),
    pytest.param(("fla_kda", [("not-float", "o_proj.weight", 3)], 0), "clear", id="complex-weight"),
])
def test_the_convert_verdict_is_not_vacuous(case, want):
    """Negative controls: each verdict the property accepts is reached, each refusal names the key."""
    assert convert_verdict(case) == want
