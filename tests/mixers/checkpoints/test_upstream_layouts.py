"""Converters against upstream's real storage: key names, shapes and where each value lands.

Round trips (ours -> theirs -> ours) cannot see a consistent mistake such as two names swapped in
both directions. Here the upstream side is written independently of the converters:

* Megatron-core's ``MambaMixer`` (not installable on CPU): its parameters as its constructor
  creates them, ``in_proj.weight [2E + 2GN + H, D]`` (rows z, x, B, C, dt), ``conv1d_weight
  [E + 2GN, 1, W]``, ``conv1d_bias [E + 2GN]``, ``dt_bias`` / ``A_log`` / ``D`` ``[H]``,
  ``norm.weight [E]``, ``out_proj.weight [D, E]``; older releases hold an ``nn.Conv1d``
  (``conv1d.weight`` / ``conv1d.bias``, same shapes); mamba-ssm's ``Mamba2`` stores the same
  names as the older releases.
* the layers that do construct on CPU (transformers, fla) are built for real and every tensor of
  our converted mixer is checked against the upstream tensor (or slice) a hand-written map names.

    D = hidden, E = d_inner = H * P, H = heads, P = head dim, G = groups, N = state size, W = conv width
"""

from __future__ import annotations

import io
import math

import pytest
import torch

from mixers.checkpoints import from_module, from_state_dict, to_state_dict
from mixers.layers import Mamba2Config
from tests.mixers.checkpoints.upstream import BUILDERS, HIDDEN

# the Mamba2 sizes of upstream.hf_mamba2 (hidden 32, 4 heads of 16, 2 groups, state 8, conv 4, chunk 8)
HEADS, HEAD_DIM, GROUPS, STATE, WIDTH = 4, 16, 2, 8, 4
MAMBA = Mamba2Config(HIDDEN, num_heads=HEADS, head_dim=HEAD_DIM, state_size=STATE, num_groups=GROUPS,
                     conv_size=WIDTH, chunk_size=8, dt_limit=(0.0, math.inf), norm_eps=1e-5)


def megatron_shapes(conv_weight: str, conv_bias: str) -> dict[str, tuple[int, ...]]:
    """The parameters of Megatron-core's MambaMixer / mamba-ssm's Mamba2 for the sizes above."""
    inner, conv_dim = HEADS * HEAD_DIM, HEADS * HEAD_DIM + 2 * GROUPS * STATE
    return {"in_proj.weight": (2 * inner + 2 * GROUPS * STATE + HEADS, HIDDEN), conv_weight: (conv_dim, 1, WIDTH),
            conv_bias: (conv_dim,), "dt_bias": (HEADS,), "A_log": (HEADS,), "D": (HEADS,),
            "norm.weight": (inner,), "out_proj.weight": (HIDDEN, inner)}


# source -> (its conv weight key, its conv bias key)
MAMBA_LAYOUTS = {"megatron": ("conv1d_weight", "conv1d_bias"),
                 "megatron_legacy": ("conv1d.weight", "conv1d.bias"),
                 "mamba_ssm": ("conv1d.weight", "conv1d.bias"),
                 "hf_mamba2": ("conv1d.weight", "conv1d.bias")}
LAYOUT_CASES = [pytest.param(s, id=s) for s in MAMBA_LAYOUTS]


def _distinct(shapes: dict[str, tuple[int, ...]]) -> dict[str, torch.Tensor]:
    """One tensor per key, every value in the whole state dict different (so any misplacement shows)."""
    out, offset = {}, 0
    for key, shape in shapes.items():
        n = math.prod(shape)
        out[key] = (torch.arange(offset, offset + n, dtype=torch.float32) / 1000 + 0.5).reshape(shape)
        offset += n
    return out


@pytest.mark.parametrize("source", LAYOUT_CASES)
def test_mamba2_layouts_have_upstream_names_and_shapes(source):
    mixer = from_state_dict(_distinct(megatron_shapes(*MAMBA_LAYOUTS[source])), source, MAMBA, backend="reference")
    got = {k: tuple(v.shape) for k, v in to_state_dict(mixer, source).items()}
    assert got == megatron_shapes(*MAMBA_LAYOUTS[source])


@pytest.mark.parametrize("source", LAYOUT_CASES)
def test_mamba2_values_land_where_upstream_keeps_them(source):
    conv_weight, conv_bias = MAMBA_LAYOUTS[source]
    theirs = _distinct(megatron_shapes(conv_weight, conv_bias))
    ours = from_state_dict(theirs, source, MAMBA, backend="reference").state_dict()
    where = {"in_proj.weight": "in_proj.weight", "conv.weight": conv_weight, "conv.bias": conv_bias,
             "dt_bias": "dt_bias", "A_log": "A_log", "D": "D", "norm.weight": "norm.weight",
             "out_proj.weight": "out_proj.weight"}
    assert set(ours) == set(where)
    for key, upstream_key in where.items():
        assert torch.equal(ours[key], theirs[upstream_key]), (key, upstream_key)


def test_megatron_transformer_engine_entries_pass_over_and_values_still_land():
    """Megatron with Transformer Engine saves ``*._extra_state`` beside the weights (bytes or uint8)."""
    theirs = _distinct(megatron_shapes("conv1d_weight", "conv1d_bias"))
    saved = {**theirs, "in_proj._extra_state": io.BytesIO(), "out_proj._extra_state": torch.empty(0, dtype=torch.uint8)}
    mixer = from_state_dict(saved, "megatron", MAMBA, backend="reference")
    assert torch.equal(mixer.conv.weight, theirs["conv1d_weight"]) and torch.equal(mixer.conv.bias,
                                                                                    theirs["conv1d_bias"])


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm())


@pytest.mark.parametrize("source", LAYOUT_CASES)
def test_mamba2_checkpoint_in_each_layout_computes_what_transformers_computes(monkeypatch, source):
    """transformers' Mamba2Mixer is the oracle for every Mamba2 layout (same math, other names): its
    weights renamed by hand to each layout, converted, must give its output (fp32, ours: reference)."""
    upstream = BUILDERS["hf_mamba2"](monkeypatch)
    conv_weight, conv_bias = MAMBA_LAYOUTS[source]
    renamed = {"conv1d.weight": conv_weight, "conv1d.bias": conv_bias}
    theirs = {renamed.get(k, k): v.detach() for k, v in upstream.state_dict().items()}
    assert {k: tuple(v.shape) for k, v in theirs.items()} == megatron_shapes(conv_weight, conv_bias)
    ours = from_state_dict(theirs, source, MAMBA, backend="reference")
    x = torch.randn(2, 21, HIDDEN, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = upstream(x)
        got = ours(x)
    assert _rel(got, want) <= 1e-6
    # negative control: the conv weights of one channel moved to another change the output
    with torch.no_grad():
        ours.conv.weight.copy_(torch.roll(ours.conv.weight, 1, dims=0))
        assert _rel(ours(x), want) > 1e-3


# ---- layers that construct on CPU: every tensor of ours is the upstream tensor a hand map names --------

def _rows(w: torch.Tensor, per: int, picks) -> torch.Tensor:
    """Rows of ``w`` in blocks of ``per`` rows: ``picks`` lists ``(block, first, count)``, concatenated."""
    return torch.cat([w[b * per + first: b * per + first + count] for b, first, count in picks])


def _qwen3_next_map(m) -> dict[str, torch.Tensor]:
    hk, hv, k, v = m.num_k_heads, m.num_v_heads, m.head_k_dim, m.head_v_dim
    r = hv // hk
    qkvz, ba, conv = m.in_proj_qkvz.weight, m.in_proj_ba.weight, m.conv1d.weight
    block = 2 * k + 2 * r * v                             # per key head: q K, k K, v rV, z rV
    return {"q_proj.weight": _rows(qkvz, block, [(h, 0, k) for h in range(hk)]),
            "k_proj.weight": _rows(qkvz, block, [(h, k, k) for h in range(hk)]),
            "v_proj.weight": _rows(qkvz, block, [(h, 2 * k, r * v) for h in range(hk)]),
            "g_proj.weight": _rows(qkvz, block, [(h, 2 * k + r * v, r * v) for h in range(hk)]),
            "b_proj.weight": _rows(ba, 2 * r, [(h, 0, r) for h in range(hk)]),
            "a_proj.weight": _rows(ba, 2 * r, [(h, r, r) for h in range(hk)]),
            "q_conv.weight": conv[:hk * k], "k_conv.weight": conv[hk * k:2 * hk * k],
            "v_conv.weight": conv[2 * hk * k:], "o_norm.weight": m.norm.weight, "o_proj.weight": m.out_proj.weight,
            "dt_bias": m.dt_bias, "A_log": m.A_log}


def _qwen3_5_map(m) -> dict[str, torch.Tensor]:
    key_dim = m.num_k_heads * m.head_k_dim
    qkv, conv = m.in_proj_qkv.weight, m.conv1d.weight     # both rows [q, k, v], flat
    return {"q_proj.weight": qkv[:key_dim], "k_proj.weight": qkv[key_dim:2 * key_dim],
            "v_proj.weight": qkv[2 * key_dim:], "g_proj.weight": m.in_proj_z.weight,
            "b_proj.weight": m.in_proj_b.weight, "a_proj.weight": m.in_proj_a.weight,
            "q_conv.weight": conv[:key_dim], "k_conv.weight": conv[key_dim:2 * key_dim],
            "v_conv.weight": conv[2 * key_dim:], "o_norm.weight": m.norm.weight, "o_proj.weight": m.out_proj.weight,
            "dt_bias": m.dt_bias, "A_log": m.A_log}


def _kimi_map(m) -> dict[str, torch.Tensor]:
    key_dim = m.num_heads * m.head_dim
    conv = m.conv1d.weight                                # rows q, k, v
    return {"q_proj.weight": m.q_proj.weight, "k_proj.weight": m.k_proj.weight, "v_proj.weight": m.v_proj.weight,
            "b_proj.weight": m.b_proj.weight, "o_norm.weight": m.o_norm.weight, "o_proj.weight": m.o_proj.weight,
            "q_conv.weight": conv[:key_dim], "k_conv.weight": conv[key_dim:2 * key_dim],
            "v_conv.weight": conv[2 * key_dim:], "f_proj.0.weight": m.forget_gate.f_a_proj.weight,
            "f_proj.1.weight": m.forget_gate.f_b_proj.weight, "dt_bias": m.forget_gate.dt_bias,
            "A_log": m.forget_gate.A_log.reshape(-1), "g_proj.0.weight": m.g_a_proj.weight,
            "g_proj.1.weight": m.g_b_proj.weight}


def _fla_map(m) -> dict[str, torch.Tensor]:
    """fla keeps our names except its three short convolutions (``ShortConvolution``, weight ``[C, 1, W]``)."""
    renamed = {"q_conv1d.weight": "q_conv.weight", "k_conv1d.weight": "k_conv.weight",
               "v_conv1d.weight": "v_conv.weight"}
    return {renamed.get(k, k): v for k, v in m.state_dict().items()}


def _hf_mamba2_map(m) -> dict[str, torch.Tensor]:
    return {"in_proj.weight": m.in_proj.weight, "conv.weight": m.conv1d.weight, "conv.bias": m.conv1d.bias,
            "dt_bias": m.dt_bias, "A_log": m.A_log, "D": m.D, "norm.weight": m.norm.weight,
            "out_proj.weight": m.out_proj.weight}


def _olmo_hybrid_map(m) -> dict[str, torch.Tensor]:
    same = {k: v for k, v in m.state_dict().items() if k != "conv1d.weight"}
    q, k, v = m.conv1d.weight.split([m.key_dim, m.key_dim, m.value_dim])
    return {**same, "q_conv.weight": q, "k_conv.weight": k, "v_conv.weight": v}


def _lfm2_map(m) -> dict[str, torch.Tensor]:
    biases = {"in_proj.bias": m.in_proj.bias, "conv.bias": m.conv.bias, "out_proj.bias": m.out_proj.bias}
    return {"in_proj.weight": m.in_proj.weight, "conv.weight": m.conv.weight, "out_proj.weight": m.out_proj.weight,
            **{k: v for k, v in biases.items() if v is not None}}


def _mamba1_map(m) -> dict[str, torch.Tensor]:
    out = {"in_proj.weight": m.in_proj.weight, "in_proj.bias": m.in_proj.bias, "conv.weight": m.conv1d.weight,
           "conv.bias": m.conv1d.bias, "x_proj.weight": m.x_proj.weight, "dt_proj.weight": m.dt_proj.weight,
           "dt_proj.bias": m.dt_proj.bias, "A_log": m.A_log, "D": m.D, "out_proj.weight": m.out_proj.weight,
           "out_proj.bias": m.out_proj.bias}
    if type(m).__name__ == "JambaMambaMixer":
        out.update(dt_norm=m.dt_layernorm.weight, b_norm=m.b_layernorm.weight, c_norm=m.c_layernorm.weight)
    return out


def _recurrent_gemma_map(m) -> dict[str, torch.Tensor]:
    lru = m.rg_lru
    return {"linear_y.weight": m.linear_y.weight, "linear_y.bias": m.linear_y.bias,
            "linear_x.weight": m.linear_x.weight, "linear_x.bias": m.linear_x.bias,
            "conv.weight": m.conv_1d.weight, "conv.bias": m.conv_1d.bias,
            "input_gate_weight": lru.input_gate_weight, "input_gate_bias": lru.input_gate_bias,
            "recurrent_gate_weight": lru.recurrent_gate_weight, "recurrent_gate_bias": lru.recurrent_gate_bias,
            "recurrent_param": lru.recurrent_param,
            "linear_out.weight": m.linear_out.weight, "linear_out.bias": m.linear_out.bias}


def _minimax_map(m) -> dict[str, torch.Tensor]:
    return {"qkv_proj.weight": m.qkv_proj.weight, "output_gate.weight": m.output_gate.weight,
            "norm.weight": m.norm.weight, "out_proj.weight": m.out_proj.weight, "slope": m.slope_rate.reshape(-1)}


HAND_MAPS = {"hf_mamba2": _hf_mamba2_map, "hf_bamba": _hf_mamba2_map, "hf_nemotron_h": _hf_mamba2_map,
             "hf_granite": _hf_mamba2_map, "hf_falcon_h1": _hf_mamba2_map, "hf_qwen3_next": _qwen3_next_map,
             "hf_qwen3_5": _qwen3_5_map, "hf_qwen3_5_moe": _qwen3_5_map,
             "hf_kimi_linear": _kimi_map, "fla_gdn": _fla_map, "fla_gdn_neg": _fla_map, "fla_kda": _fla_map,
             "fla_gdp": _fla_map, "hf_lfm2": _lfm2_map, "hf_lfm3": _lfm2_map, "hf_olmo_hybrid": _olmo_hybrid_map,
             "hf_lfm2_moe": _lfm2_map, "hf_zamba2": _hf_mamba2_map,
             "hf_mamba": _mamba1_map, "hf_falcon_mamba": _mamba1_map, "hf_jamba": _mamba1_map,
             "hf_recurrent_gemma": _recurrent_gemma_map, "hf_minimax": _minimax_map}


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BUILDERS])
def test_every_converted_tensor_is_the_upstream_tensor_the_hand_map_names(monkeypatch, name):
    assert set(HAND_MAPS) == set(BUILDERS)
    upstream = BUILDERS[name](monkeypatch)
    ours = from_module(upstream, backend="reference").state_dict()
    want = HAND_MAPS[name](upstream)
    assert set(ours) == set(want)
    for key, value in want.items():
        assert ours[key].shape == value.shape and torch.equal(ours[key], value.detach()), key
