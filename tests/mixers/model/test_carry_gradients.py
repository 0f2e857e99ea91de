"""Gradients through carried states: a continuing pack differentiates its own tokens exactly.

The carried states (conv window, SSM / delta-rule state, attention keys and values of earlier
pieces) are constants of the pack that continues from them; everything the pack computes itself
is differentiable, attention's keys and values of its own tokens included. The oracle is a
central finite difference in fp64: the loss of the continuing pack, re-run from the same carried
states (restored with ``load_state_dict``) with every parameter moved along one random direction,
against autograd's directional derivative, for every mixer kind alone and for the hybrid.
"""

import pytest
import torch

from mixers import HybridLM
from mixers.model import CarriedStates
from ssm_pack import pack_stream

SMALL = {"M": {"head_dim": 16, "state_size": 8, "chunk_size": 16}, "G": {"head_dim": 8, "chunk_size": 16},
         "K": {"head_dim": 8, "chunk_size": 16}, "P": {"head_dim": 8, "chunk_size": 16}, "A": {"head_dim": 8}}
EPS = 1e-6
RTOL = 1e-6       # central differences in fp64 at EPS: truncation ~EPS^2, rounding ~1e-16 / EPS


def _continuing_pack():
    """Packs of 24 tokens over documents (9, 70, 5, 12): the 70 is carried; returns the packs up to
    and including the first one whose piece continues it and that also holds a fresh document."""
    g = torch.Generator().manual_seed(1)
    docs = [torch.randint(0, 64, (n,), generator=g) for n in (9, 70, 5, 12)]
    packs = list(pack_stream(docs, 24, align_to=4, split_long="carry"))
    for i, pack in enumerate(packs):
        if pack["continues"]:
            return packs[:i], pack
    raise AssertionError("no continuing pack")


def _directional(pattern: str) -> tuple[float, float, list[str]]:
    torch.manual_seed(0)
    model = HybridLM(64, 32, pattern, mixer_overrides=SMALL).double()
    carry = CarriedStates(model, max_documents=8, max_document_tokens=80)
    before, pack = _continuing_pack()
    with torch.no_grad():
        for p in before:
            carry(p)
    saved = carry.state_dict()
    model.zero_grad(set_to_none=True)
    carry(pack)["loss"].backward()
    missing = [n for n, p in model.named_parameters() if p.grad is None]
    direction = {n: torch.randn_like(p) for n, p in model.named_parameters()}
    autograd = sum(float((p.grad * direction[n]).sum()) for n, p in model.named_parameters() if p.grad is not None)
    losses = []
    for sign in (1, -1):
        with torch.no_grad():
            for n, p in model.named_parameters():
                p.add_(direction[n], alpha=sign * EPS)
            carry.load_state_dict(saved)
            losses.append(float(carry(pack)["loss"]))
            for n, p in model.named_parameters():
                p.sub_(direction[n], alpha=sign * EPS)
    return autograd, (losses[0] - losses[1]) / (2 * EPS), missing


@pytest.mark.parametrize("pattern", [pytest.param(p, id=p) for p in ("A", "M", "G", "K", "P", "MGKPA")])
def test_a_continuing_pack_differentiates_its_own_tokens(pattern):
    autograd, numeric, missing = _directional(pattern)
    assert missing == []                                    # every parameter gets a gradient
    assert abs(autograd - numeric) <= RTOL * abs(numeric), (autograd, numeric)
