"""The ``dt_bias`` initialisation (``mixers.layers.blocks.init``): ``softplus(dt_bias)`` is
log-uniform in ``[dt_min, dt_max]`` as mamba and fla draw it, both from the function and from the
layers users build with their default or configured ranges; and the scalar gate's decay rate
``exp(A_log)`` of GDN and Gated DeltaProduct."""

import math

import pytest
import torch
import torch.nn.functional as F

from mixers import Mamba1Mixer, Mamba2Mixer
from mixers.layers import Mamba1Config
from mixers.layers.blocks.init import inverse_softplus_dt


def _assert_log_uniform(dt: torch.Tensor, lo: float, hi: float):
    """``dt`` within ``[lo, hi]`` (fp32 round-off), reaching both ends and centred in log space."""
    log = dt.double().log()
    assert dt.min() >= lo * (1 - 1e-5) and dt.max() <= hi * (1 + 1e-5), (dt.min(), dt.max())
    span = math.log(hi) - math.log(lo)
    assert log.min() < math.log(lo) + 0.05 * span and log.max() > math.log(hi) - 0.05 * span
    assert abs(log.mean().item() - (math.log(lo) + math.log(hi)) / 2) < 0.05 * span


@pytest.mark.parametrize("lo, hi", [
    pytest.param(0.001, 0.1, id="default"),
    pytest.param(0.01, 0.5, id="configured"),
])
def test_softplus_of_the_bias_is_log_uniform_in_the_range(lo, hi):
    torch.manual_seed(0)
    bias = inverse_softplus_dt(4096, lo, hi)
    assert bias.shape == (4096,)
    _assert_log_uniform(F.softplus(bias), lo, hi)


def test_the_floor_clamps_the_smallest_steps():
    torch.manual_seed(0)
    dt = F.softplus(inverse_softplus_dt(4096, 1e-6, 1e-3, floor=1e-4))
    assert dt.min() >= 1e-4 * (1 - 1e-5) and (dt < 1.01e-4).float().mean() > 0.5     # 2/3 of the draws clamp


def test_the_layers_users_build_draw_their_steps_in_range():
    torch.manual_seed(0)
    _assert_log_uniform(F.softplus(Mamba1Mixer(512).dt_proj.bias.detach()), 0.001, 0.1)
    config = Mamba1Config(hidden_size=512, dt_min=0.01, dt_max=0.2)
    _assert_log_uniform(F.softplus(Mamba1Mixer(config=config).dt_proj.bias.detach()), 0.01, 0.2)
    dt = F.softplus(Mamba2Mixer(64).dt_bias.detach())
    assert dt.min() >= 0.001 * (1 - 1e-5) and dt.max() <= 0.1 * (1 + 1e-5)


def test_the_scalar_gate_decay_rate_is_uniform_up_to_16():
    """GDN's (and Gated DeltaProduct's) ``A = exp(A_log)`` is drawn uniform in ``[1e-3, 16]`` per value
    head (fla's GatedDeltaNet draws it in ``(0, 16)``; the floor keeps ``log`` finite): over 4096
    heads every draw lies in the range, both ends are reached within 0.1 (a gap that wide has
    probability ~exp(-4096 * 0.1 / 16)) and the mean is near 8."""
    from mixers import GatedDeltaNetMixer
    torch.manual_seed(0)
    mixer = GatedDeltaNetMixer(64, head_dim=16, num_heads=4, num_v_heads=4096, expand_v=0.125)
    a = mixer.A_log.detach().double().exp()
    assert a.shape == (4096,)
    assert a.min() >= 1e-3 * (1 - 1e-5) and a.max() <= 16 * (1 + 1e-6), (a.min(), a.max())
    assert a.min() < 0.1 and a.max() > 15.9 and abs(a.mean().item() - 8.0) < 0.3
