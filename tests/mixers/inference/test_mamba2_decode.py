"""Mamba2's decode step with a limited ``dt``: the op against a reference written here from
mamba-ssm's ``selective_state_update_ref`` semantics (plus the scan's clamp of ``dt``), and the
mixer's cached decoding against its full forward, the limit binding in both (so dropping it fails)."""

import math

import pytest
import torch
import torch.nn.functional as F

from mixers.layers.registry import MIXERS
from mixers.ops import selective_state_update
from tests.mixers.inference.common import HIDDEN, SMALL, full, max_error, packed_call, sequences
from tests.support.tolerances import FP64_ABS

F64 = torch.float64
LIMITED = (0.05, 0.3)
UNLIMITED = (0.0, math.inf)


def step_reference(state, x, dt, A, B, C, D, z, dt_bias, dt_limit):
    """One token: ``state [N, H, P, Ns]`` (the named rows), ``x, dt, z [N, H, P]``, ``A [H, P, Ns]``,
    ``B, C [N, G, Ns]``, ``D, dt_bias [H, P]`` -> ``(out [N, H, P], new state)``."""
    heads, groups = x.shape[1], B.shape[1]
    dt = F.softplus(dt + dt_bias).clamp(dt_limit[0], dt_limit[1])
    B = B.repeat_interleave(heads // groups, dim=1)
    C = C.repeat_interleave(heads // groups, dim=1)
    decay = torch.exp(dt[..., None] * A)
    new = state * decay + (dt * x)[..., None] * B[:, :, None, :]
    out = (new * C[:, :, None, :]).sum(-1) + D * x
    return out * F.silu(z), new


def case(seed=0, rows=3, slots=5, heads=4, p=3, n=5, groups=2):
    g = torch.Generator().manual_seed(seed)
    r = lambda *s: torch.randn(*s, generator=g, dtype=F64)  # noqa: E731
    return dict(state=r(slots, heads, p, n), x=r(rows, heads, p), dt=r(rows, heads, p),
                A=-(torch.rand(heads, p, n, generator=g, dtype=F64) + 0.1), B=r(rows, groups, n),
                C=r(rows, groups, n), D=r(heads, p), z=r(rows, heads, p), dt_bias=r(heads, p))


@pytest.mark.parametrize("dt_limit", [pytest.param(LIMITED, id="limited"), pytest.param(UNLIMITED, id="unlimited")])
def test_selective_state_update_matches_the_written_reference(dt_limit):
    c = case()
    index = torch.tensor([4, 0, 2])
    before = c["state"].clone()
    out = selective_state_update(c["state"], c["x"], c["dt"], c["A"], c["B"], c["C"], D=c["D"], z=c["z"],
                                 dt_bias=c["dt_bias"], dt_softplus=True, state_batch_indices=index,
                                 dt_limit=dt_limit)
    want, new = step_reference(before[index], c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"],
                               c["dt_bias"], dt_limit)
    assert max_error(out, want) <= FP64_ABS and max_error(c["state"][index], new) <= FP64_ABS
    assert torch.equal(c["state"][torch.tensor([1, 3])], before[torch.tensor([1, 3])])
    # negative control: the limit binds (the other setting's reference is far off)
    other = UNLIMITED if dt_limit == LIMITED else LIMITED
    wrong, _ = step_reference(before[index], c["x"], c["dt"], c["A"], c["B"], c["C"], c["D"], c["z"],
                              c["dt_bias"], other)
    assert max_error(out, wrong) > 1e-3


def mamba(dt_limit):
    torch.manual_seed(0)
    return MIXERS["M"].mixer(HIDDEN, dt_limit=dt_limit, **SMALL["M"]).double()


def test_mixer_decoding_with_a_dt_limit_equals_its_full_forward():
    layer = mamba(LIMITED)
    seqs = sequences([6, 3], seed=21)
    cache = layer.allocate_inference_cache(2, 16)
    with torch.no_grad():
        outs = packed_call(layer, [s[:-2] for s in seqs], cache, [1, 0])
        for k in (-2, -1):
            row = torch.stack([s[len(s) + k:len(s) + k + 1] for s in seqs])
            step = layer(row, cache=cache, cache_slots=[1, 0])
            outs = [torch.cat([o, step[i]]) for i, o in enumerate(outs)]
    for seq, out in zip(seqs, outs):
        assert max_error(out, full(layer, seq)) <= FP64_ABS
    # negative control: the same weights without the limit compute something else
    free = mamba(UNLIMITED)
    free.load_state_dict(layer.state_dict())
    assert max_error(full(free, seqs[0])[-2:], full(layer, seqs[0])[-2:]) > 1e-3
