"""Converters: bit-exact round trips, every key accounted for, unsupported options refused, safe file reading."""

import io
import pickle
import re

import pytest
import torch

from mixers import GatedDeltaNetMixer, GatedDeltaProductMixer, KDAMixer, Mamba2Mixer
from mixers.checkpoints import (
    SOURCES,
    from_module,
    from_state_dict,
    load_checkpoint,
    select,
    source_of,
    to_module,
    to_state_dict,
)
from mixers.layers import (
    GatedDeltaNetConfig,
    GatedDeltaProductConfig,
    GatedShortConvConfig,
    KDAConfig,
    LightningConfig,
    Mamba1Config,
    Mamba2Config,
    RGLRUConfig,
)
from tests.mixers.checkpoints.upstream import BUILDERS, falcon_h1_config

MAMBA = Mamba2Config(32, num_heads=3, head_dim=16, state_size=8, num_groups=3)
GDN = GatedDeltaNetConfig(32, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1.5)
CONFIGS = {
    "hf_mamba2": MAMBA, "mamba_ssm": MAMBA, "megatron": MAMBA, "megatron_legacy": MAMBA, "hf_zamba2": MAMBA,
    "fla_gdn": GDN, "hf_qwen3_next": GDN, "hf_qwen3_5": GDN, "hf_olmo_hybrid": GDN,
    "fla_kda": KDAConfig(32, head_dim=16, num_heads=2, num_v_heads=4),
    "hf_kimi_linear": KDAConfig(32, head_dim=16, num_heads=2, output_gate_bias=False),
    "fla_gdp": GatedDeltaProductConfig(32, head_dim=16, num_heads=2, num_householder=3),
    "hf_lfm2": GatedShortConvConfig(32, conv_size=3, proj_bias=True, conv_bias=True),
    "hf_mamba": Mamba1Config(32, state_size=8, dt_rank=3, proj_bias=True),
    "hf_falcon_mamba": Mamba1Config(32, state_size=8, conv_bias=False, dt_bc_norm="weightless"),
    "hf_jamba": Mamba1Config(32, d_inner=48, state_size=4, dt_bc_norm="weighted", norm_eps=1e-5),
    "hf_recurrent_gemma": RGLRUConfig(32, lru_width=48, num_heads=4),
    "hf_minimax": LightningConfig(32, head_dim=8, num_heads=4, layer_idx=1, num_layers=3),
}


def _random_mixer(source, dtype=torch.float32):
    mixer = SOURCES[source].mixer(config=CONFIGS[source], backend="reference").to(dtype)
    with torch.no_grad():
        for p in mixer.parameters():
            p.copy_(torch.randn_like(p))
    return mixer


def _assert_identical(a, b):
    assert a.keys() == b.keys()
    for k in a:
        assert a[k].dtype == b[k].dtype and torch.equal(a[k], b[k]), k


@pytest.mark.parametrize("dtype", [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")])
@pytest.mark.parametrize("source", [pytest.param(s, id=s) for s in SOURCES])
def test_ours_upstream_ours_is_bit_exact(source, dtype):
    assert set(CONFIGS) == set(SOURCES)
    mixer = _random_mixer(source, dtype)
    upstream = to_state_dict(mixer, source)
    back = from_state_dict(upstream, source, mixer.config, backend="reference")
    _assert_identical(mixer.state_dict(), back.state_dict())
    _assert_identical(upstream, to_state_dict(back, source))
    assert all(p.requires_grad for p in back.parameters())
    for k, v in upstream.items():          # copies: converting never aliases the source
        assert all(v.untyped_storage().data_ptr() != p.untyped_storage().data_ptr() for p in back.state_dict().values())


@pytest.mark.parametrize("name", [pytest.param(n, id=n) for n in BUILDERS])
def test_upstream_ours_upstream_is_bit_exact(monkeypatch, name):
    upstream = BUILDERS[name](monkeypatch)
    ours = from_module(upstream, backend="reference")
    before = {k: v.clone() for k, v in upstream.state_dict().items()}
    with torch.no_grad():
        for p in upstream.parameters():
            p.zero_()
    to_module(ours, upstream)
    _assert_identical(before, upstream.state_dict())


def test_negative_control_round_trip_sees_one_bit():
    """The round-trip check compares bits: one ulp on one entry fails it."""
    mixer = _random_mixer("hf_qwen3_next")
    upstream = to_state_dict(mixer, "hf_qwen3_next")
    upstream["in_proj_qkvz.weight"][5, 3] = torch.nextafter(upstream["in_proj_qkvz.weight"][5, 3], torch.tensor(9.0))
    back = from_state_dict(upstream, "hf_qwen3_next", mixer.config)
    with pytest.raises(AssertionError):
        _assert_identical(mixer.state_dict(), back.state_dict())


def test_qwen3_next_layout_by_hand():
    """One key head's block of in_proj_qkvz is [q, k, v, z] of that group (the interleave)."""
    mixer = _random_mixer("hf_qwen3_next")
    fused = to_state_dict(mixer, "hf_qwen3_next")["in_proj_qkvz.weight"]
    c = mixer.config
    block = 2 * c.head_dim + 2 * c.head_v_dim * 2           # two value heads per key head
    second = fused[block:2 * block]
    assert torch.equal(second[:16], mixer.q_proj.weight[16:32])
    assert torch.equal(second[16:32], mixer.k_proj.weight[16:32])
    assert torch.equal(second[32:80], mixer.v_proj.weight[48:96])
    assert torch.equal(second[80:], mixer.g_proj.weight[48:96])


# ---- every key accounted for ----------------------------------------------------------------------

def test_missing_unexpected_and_misshapen_keys_are_all_listed():
    sd = to_state_dict(_random_mixer("hf_mamba2"), "hf_mamba2")
    sd.pop("D")
    sd["extra.weight"] = torch.zeros(1)
    sd["A_log"] = torch.zeros(7)
    with pytest.raises(ValueError) as err:
        from_state_dict(sd, "hf_mamba2", MAMBA)
    message = str(err.value)
    assert "missing keys ['D']" in message and "unexpected keys ['extra.weight']" in message
    assert "'A_log' has shape (7,), expected (3,)" in message


@pytest.mark.parametrize("value, problem", [
    pytest.param(torch.zeros(3, dtype=torch.int64), "'A_log' has dtype torch.int64, expected a floating-point dtype",
                 id="integer-weight"),
    pytest.param([0.0, 0.0, 0.0], "'A_log' is a list, not a tensor", id="not-a-tensor"),
])
def test_a_weight_that_is_not_a_real_tensor_is_refused(value, problem):
    """A converted weight must be a floating-point tensor: an integer one (a quantized or mislabelled
    checkpoint) is refused by name, not cast into the mixer."""
    sd = to_state_dict(_random_mixer("hf_mamba2"), "hf_mamba2")
    sd["A_log"] = value
    with pytest.raises(ValueError, match=re.escape(problem)):
        from_state_dict(sd, "hf_mamba2", MAMBA)


def test_wrong_naming_suggests_the_right_source():
    sd = to_state_dict(_random_mixer("megatron_legacy"), "megatron_legacy")
    with pytest.raises(ValueError, match="source='megatron_legacy'|source='hf_mamba2'"):
        from_state_dict(sd, "megatron", MAMBA)


def test_megatron_extra_state_is_no_weight_but_a_fused_norm_is_refused():
    sd = to_state_dict(_random_mixer("megatron"), "megatron")
    sd["in_proj._extra_state"] = io.BytesIO()
    sd["out_proj._extra_state"] = None
    from_state_dict(sd, "megatron", MAMBA)
    sd["in_proj.layer_norm_weight"] = torch.ones(32)
    with pytest.raises(ValueError, match="pre-norm that Transformer Engine fuses"):
        from_state_dict(sd, "megatron", MAMBA)
    sd.pop("in_proj.layer_norm_weight")
    sd["in_proj._extra_state"] = torch.randn(4)          # a float tensor is a weight: never passed over
    with pytest.raises(ValueError, match=r"unexpected keys \['in_proj._extra_state'\]"):
        from_state_dict(sd, "megatron", MAMBA)


@pytest.mark.parametrize(("value", "passed_over"), [
    pytest.param(torch.empty(0), True, id="empty-float-tensor"),
    pytest.param(torch.zeros(3, dtype=torch.uint8), True, id="uint8-bytes"),
    pytest.param(torch.ones(1), False, id="one-float"),
])
def test_megatron_extra_state_tensors(value, passed_over):
    # Transformer Engine stores an empty tensor (no FP8 state) or uint8 bytes; a float value is a weight
    sd = to_state_dict(_random_mixer("megatron"), "megatron")
    sd["in_proj._extra_state"] = value
    if passed_over:
        assert from_state_dict(sd, "megatron", MAMBA) is not None
    else:
        with pytest.raises(ValueError, match=r"unexpected keys \['in_proj._extra_state'\]"):
            from_state_dict(sd, "megatron", MAMBA)


def test_d_per_channel_is_refused_with_the_reason():
    sd = to_state_dict(_random_mixer("mamba_ssm"), "mamba_ssm")
    sd["D"] = torch.ones(MAMBA.d_inner)
    with pytest.raises(ValueError, match="D_has_hdim"):
        from_state_dict(sd, "mamba_ssm", MAMBA)


@pytest.mark.parametrize("edit", [
    pytest.param(lambda sd: sd.pop("out_proj.weight"), id="missing-key"),
    pytest.param(lambda sd: sd.__setitem__("dt_bias", torch.ones(97)), id="other-shape"),
])
def test_the_d_hint_is_given_only_when_d_is_the_problem(edit):
    sd = to_state_dict(_random_mixer("mamba_ssm"), "mamba_ssm")
    edit(sd)
    with pytest.raises(ValueError) as caught:
        from_state_dict(sd, "mamba_ssm", MAMBA)
    assert "D_has_hdim" not in str(caught.value)


def test_bad_arguments_name_themselves():
    mixer = _random_mixer("fla_gdn")
    with pytest.raises(ValueError, match="source must be one of"):
        to_state_dict(mixer, "fla")
    with pytest.raises(TypeError, match="converts a Mamba2Mixer, got GatedDeltaNetMixer"):
        to_state_dict(mixer, "megatron")
    with pytest.raises(TypeError, match="config must be a GatedDeltaNetConfig"):
        from_state_dict(to_state_dict(mixer, "fla_gdn"), "fla_gdn", MAMBA)
    with pytest.raises(TypeError, match="state_dict must be a mapping"):
        from_state_dict([1, 2], "fla_gdn", GDN)
    with pytest.raises(TypeError, match="no converter reads a torch:Linear layer"):
        source_of(torch.nn.Linear(2, 2))


# ---- upstream options our mixers cannot express are refused ---------------------------------------

def test_unsupported_upstream_options_are_refused(monkeypatch):
    t = pytest.importorskip("transformers")
    from transformers.models.falcon_h1.modeling_falcon_h1 import FalconH1Model
    from transformers.models.mamba2.modeling_mamba2 import Mamba2Mixer as HFMamba2
    base = dict(hidden_size=32, num_heads=4, head_dim=16, state_size=8, n_groups=2, num_hidden_layers=1)
    with pytest.raises(ValueError, match="biases"):
        from_module(HFMamba2(t.Mamba2Config(**base, use_bias=True), 0))
    with pytest.raises(ValueError, match="no bias"):
        from_module(HFMamba2(t.Mamba2Config(**base, use_conv_bias=False), 0))
    with pytest.raises(ValueError, match="mup_vector"):
        from_module(FalconH1Model(falcon_h1_config(ssm_multipliers=[1.0, 2.0, 1.0, 1.0, 1.0])).layers[0].mamba)
    with pytest.raises(ValueError, match="mamba_rms_norm=False"):
        from_module(FalconH1Model(falcon_h1_config(mamba_rms_norm=False)).layers[0].mamba)
    with pytest.raises(ValueError, match="after the norm"):
        from_module(FalconH1Model(falcon_h1_config(mamba_norm_before_gate=True)).layers[0].mamba)


def test_unsupported_fla_options_are_refused():
    fla_layers = pytest.importorskip("fla.layers")
    kwargs = dict(hidden_size=32, head_dim=16, num_heads=2)
    for layer, match in ((fla_layers.GatedDeltaNet(**kwargs, use_gate=False), "no output gate"),
                         (fla_layers.GatedDeltaNet(**kwargs, conv_bias=True), "conv_bias"),
                         (fla_layers.KimiDeltaAttention(**kwargs, lower_bound=-5.0), "lower-bounded"),
                         (fla_layers.GatedDeltaProduct(**kwargs, use_forget_gate=False), "use_forget_gate"),
                         (fla_layers.GatedDeltaProduct(**kwargs, num_v_heads=4), "num_v_heads")):
        with pytest.raises(ValueError, match=match):
            from_module(layer)


def test_our_options_upstream_lacks_are_refused_going_back():
    with pytest.raises(ValueError, match="output_gate_bias=True"):
        to_state_dict(KDAMixer(config=KDAConfig(32, head_dim=16)), "hf_kimi_linear")
    with pytest.raises(ValueError, match="output_gate_bias=False"):
        to_state_dict(KDAMixer(config=KDAConfig(32, head_dim=16, output_gate_bias=False)), "fla_kda")
    with pytest.raises(ValueError, match="allow_neg_eigval"):
        to_state_dict(GatedDeltaNetMixer(config=GatedDeltaNetConfig(32, head_dim=16, allow_neg_eigval=True)),
                      "hf_qwen3_next")


def test_qwen3_next_refusal_names_the_source_and_the_family():
    with pytest.raises(ValueError, match=r"^hf_qwen3_next: our config has allow_neg_eigval=True; .*"
                                         r"Qwen3-Next has no negative-eigenvalue beta"):
        to_state_dict(GatedDeltaNetMixer(config=GatedDeltaNetConfig(32, head_dim=16, allow_neg_eigval=True)),
                      "hf_qwen3_next")


def _kimi_conv_bias(m):
    m.conv1d.bias = torch.nn.Parameter(torch.zeros(m.conv1d.out_channels))


def _kimi_gate_bias(m):
    m.g_b_proj.bias = torch.nn.Parameter(torch.zeros(m.g_b_proj.out_features))


@pytest.mark.parametrize(("edit", "match"), [
    pytest.param(_kimi_conv_bias, "the conv has a bias; .*nothing was converted. Only bias-free convolutions convert",
                 id="conv-bias"),
    pytest.param(_kimi_gate_bias, "g_b_proj has a bias; .*nothing was converted. Only the bias-free gate converts",
                 id="gate-bias"),
])
def test_kimi_linear_options_our_mixer_cannot_represent_are_refused(monkeypatch, edit, match):
    module = BUILDERS["hf_kimi_linear"](monkeypatch)
    assert from_module(module) is not None                                       # negative control
    edit(module)
    with pytest.raises(ValueError, match=f"^KimiLinearDeltaAttention: {match}$"):
        from_module(module)


def test_to_module_refuses_a_layer_of_other_sizes_or_eps(monkeypatch):
    upstream = BUILDERS["hf_qwen3_next"](monkeypatch)
    ours = GatedDeltaNetMixer(config=GatedDeltaNetConfig(32, head_dim=16, num_heads=2, num_v_heads=4, expand_v=1.5))
    with pytest.raises(ValueError, match="norm_eps: ours 1e-05, upstream 1e-06"):
        to_module(ours, upstream)


def test_mamba2_config_num_heads_and_expand():
    assert Mamba2Config(32, num_heads=3, head_dim=16).d_inner == 48
    assert Mamba2Config(32, head_dim=16).num_heads == 4 and Mamba2Config(32).expand == 2
    with pytest.raises(ValueError, match="expand=2 gives d_inner=64 but num_heads"):
        Mamba2Config(32, expand=2, num_heads=3, head_dim=16)
    assert Mamba2Mixer(config=Mamba2Config(32, num_heads=3, head_dim=16)).out_proj.in_features == 48
    assert GatedDeltaProductMixer(config=CONFIGS["fla_gdp"]).k_proj.out_features == 3 * 32


# ---- files ----------------------------------------------------------------------------------------

class _Payload:
    def __reduce__(self):
        return (print, ("code ran",))


def test_files_are_read_without_running_code(tmp_path):
    sd = to_state_dict(_random_mixer("fla_gdn"), "fla_gdn")
    torch.save({f"model.layers.0.attn.{k}": v for k, v in sd.items()}, tmp_path / "a.pt")
    got = select(load_checkpoint(tmp_path / "a.pt"), "model.layers.0.attn.")
    _assert_identical(sd, got)
    with open(tmp_path / "evil.pt", "wb") as f:
        pickle.dump({"x": _Payload()}, f)
    with pytest.raises(pickle.UnpicklingError):
        load_checkpoint(tmp_path / "evil.pt")
    with pytest.raises(ValueError, match="no key starts with prefix='model.layers.1.'"):
        select(got, "model.layers.1.")


def test_safetensors_shards(tmp_path):
    st = pytest.importorskip("safetensors.torch")
    sd = to_state_dict(_random_mixer("hf_mamba2"), "hf_mamba2")
    keys = sorted(sd)
    st.save_file({k: sd[k] for k in keys[:3]}, str(tmp_path / "model-00001.safetensors"))
    st.save_file({k: sd[k] for k in keys[3:]}, str(tmp_path / "model-00002.safetensors"))
    _assert_identical(sd, load_checkpoint(tmp_path))
    st.save_file({keys[0]: sd[keys[0]]}, str(tmp_path / "model-00003.safetensors"))
    with pytest.raises(ValueError, match="repeats keys"):
        load_checkpoint(tmp_path)
    with pytest.raises(FileNotFoundError):
        load_checkpoint(tmp_path / "nope.safetensors")


def test_safetensors_files_are_read_by_safetensors_not_the_pickle_loader(tmp_path, monkeypatch):
    st = pytest.importorskip("safetensors.torch")
    sd = to_state_dict(_random_mixer("fla_gdn"), "fla_gdn")
    st.save_file(sd, str(tmp_path / "model.safetensors"))

    def pickle_loader(*args, **kwargs):              # an older torch.load cannot read a .safetensors file
        raise pickle.UnpicklingError("invalid load key")
    monkeypatch.setattr(torch, "load", pickle_loader)
    _assert_identical(sd, load_checkpoint(tmp_path / "model.safetensors"))
    _assert_identical(sd, load_checkpoint(tmp_path))


def test_a_lightning_checkpoint_is_read_through_its_state_dict(tmp_path):
    sd = to_state_dict(_random_mixer("fla_gdn"), "fla_gdn")
    torch.save({"state_dict": sd, "epoch": 3, "global_step": 120}, tmp_path / "last.ckpt")
    _assert_identical(sd, load_checkpoint(tmp_path / "last.ckpt"))


def _lfm2_with(monkeypatch, edit):
    from tests.mixers.checkpoints.upstream import hf_lfm2
    module = hf_lfm2(monkeypatch)
    edit(module)
    return module


def _no_out_bias(m):
    m.out_proj.bias = None


def _no_in_bias(m):
    m.in_proj.bias = None


def _grouped_conv(m):
    m.conv = torch.nn.Conv1d(32, 32, 3, groups=16, padding=2)


def _dilated_conv(m):
    m.conv = torch.nn.Conv1d(32, 32, 3, groups=32, padding=2, dilation=2)


def _circular_conv(m):
    m.conv = torch.nn.Conv1d(32, 32, 3, groups=32, padding=2, padding_mode="circular")


def _centred_conv(m):
    m.conv = torch.nn.Conv1d(32, 32, 3, groups=32, padding=1)


@pytest.mark.parametrize(("edit", "match"), [
    pytest.param(_no_out_bias, "in_proj has a bias but out_proj has none", id="projection-biases-differ"),
    pytest.param(_no_in_bias, "in_proj has no bias but out_proj has one", id="out-projection-bias-only"),
    pytest.param(_grouped_conv, r"not depthwise over 32 channels \(in_channels=32, out_channels=32, groups=16\)",
                 id="grouped"),
    pytest.param(_dilated_conv, r"dilation=\(2,\)", id="dilated"),
    pytest.param(_circular_conv, "pads with 'circular'", id="circular"),
    pytest.param(_centred_conv, r"padding is \(1,\) for kernel_size 3", id="not-causal"),
])
def test_lfm2_options_our_mixer_cannot_represent_are_refused(monkeypatch, edit, match):
    with pytest.raises(ValueError, match=f"Lfm2ShortConv: .*{match}.*nothing was converted"):
        from_module(_lfm2_with(monkeypatch, edit))


@pytest.mark.parametrize(("name", "layer"), [pytest.param("hf_lfm3", "Lfm3ShortConv", id="lfm3"),
                                             pytest.param("hf_lfm2_moe", "Lfm2MoeShortConv", id="lfm2_moe")])
def test_lfm2_copies_refuse_by_their_own_class_name(monkeypatch, name, layer):
    module = BUILDERS[name](monkeypatch)
    assert from_module(module) is not None                     # negative control: the layer as built converts
    width = module.conv.kernel_size[0]
    module.conv = torch.nn.Conv1d(32, 32, width, groups=32, padding=width - 1, dilation=2)
    with pytest.raises(ValueError, match=rf"{layer}: .*dilation=\(2,\).*nothing was converted"):
        from_module(module)


def test_lfm2_has_one_bias_flag_going_back():
    from mixers import GatedShortConvMixer
    with pytest.raises(ValueError, match="proj_bias=True, conv_bias=False.*one conv_bias flag"):
        to_state_dict(GatedShortConvMixer(config=GatedShortConvConfig(32, proj_bias=True)), "hf_lfm2")


def _qwen3_5_gelu(monkeypatch):
    from transformers.models.qwen3_5.modeling_qwen3_5 import Qwen3_5GatedDeltaNet

    from tests.mixers.checkpoints.upstream import qwen3_5_config
    return Qwen3_5GatedDeltaNet(qwen3_5_config(hidden_act="gelu"), 0)


def _qwen3_5_with(edit):
    def build(monkeypatch):
        module = BUILDERS["hf_qwen3_5"](monkeypatch)
        edit(module)
        return module
    return build


def _conv_bias(m):
    m.conv1d.bias = torch.nn.Parameter(torch.zeros(m.conv_dim))


def _z_bias(m):
    m.in_proj_z.bias = torch.nn.Parameter(torch.zeros(m.value_dim))


@pytest.mark.parametrize(("build", "match"), [
    pytest.param(_qwen3_5_gelu, r"the conv activation \(hidden_act\) is 'gelu'", id="gelu-conv"),
    pytest.param(_qwen3_5_with(_conv_bias), "the conv has a bias", id="conv-bias"),
    pytest.param(_qwen3_5_with(_z_bias), r"the projections \['in_proj_z'\] have a bias", id="projection-bias"),
])
def test_qwen3_5_options_our_mixer_cannot_represent_are_refused(monkeypatch, build, match):
    with pytest.raises(ValueError, match=f"Qwen3_5GatedDeltaNet: .*{match}.*nothing was converted"):
        from_module(build(monkeypatch))


def test_qwen3_5_has_no_negative_eigenvalues_going_back():
    with pytest.raises(ValueError, match="allow_neg_eigval=True.*Qwen3.5 has no negative-eigenvalue beta"):
        to_state_dict(GatedDeltaNetMixer(config=GatedDeltaNetConfig(32, head_dim=16, allow_neg_eigval=True)),
                      "hf_qwen3_5")


def _olmo_hybrid_gelu(monkeypatch):
    from tests.mixers.checkpoints.upstream import hf_olmo_hybrid
    return hf_olmo_hybrid(monkeypatch, hidden_act="gelu")


def _olmo_hybrid_with(edit):
    def build(monkeypatch):
        module = BUILDERS["hf_olmo_hybrid"](monkeypatch)
        edit(module)
        return module
    return build


def _g_bias(m):
    m.g_proj.bias = torch.nn.Parameter(torch.zeros(m.value_dim))


def _sigmoid_gate(m):
    m.o_norm.activation = "sigmoid"


@pytest.mark.parametrize(("build", "match"), [
    pytest.param(_olmo_hybrid_gelu, r"the conv activation \(hidden_act\) is 'gelu'", id="gelu-conv"),
    pytest.param(_olmo_hybrid_with(_conv_bias), "the conv has a bias", id="conv-bias"),
    pytest.param(_olmo_hybrid_with(_g_bias), r"the projections \['g_proj'\] have a bias", id="projection-bias"),
    pytest.param(_olmo_hybrid_with(_sigmoid_gate), "the output gate uses 'sigmoid'", id="sigmoid-gate"),
])
def test_olmo_hybrid_options_our_mixer_cannot_represent_are_refused(monkeypatch, build, match):
    assert from_module(BUILDERS["hf_olmo_hybrid"](monkeypatch)) is not None     # negative control
    with pytest.raises(ValueError, match=f"OlmoHybridGatedDeltaNet: .*{match}.*nothing was converted"):
        from_module(build(monkeypatch))


def _zamba2_mixer(**overrides):
    from transformers.models.zamba2.modeling_zamba2 import Zamba2MambaMixer

    from tests.mixers.checkpoints.upstream import zamba2_config
    return Zamba2MambaMixer(zamba2_config(**overrides), layer_idx=0)


@pytest.mark.parametrize(("overrides", "match"), [
    pytest.param({"add_bias_linear": True}, r"in_proj / out_proj have biases \(config.add_bias_linear=True\)",
                 id="add_bias_linear"),
    pytest.param({"n_mamba_heads": 3}, r"intermediate_size=64 != n_mamba_heads \* mamba_headdim = 63",
                 id="heads-do-not-divide"),
])
def test_zamba2_options_our_mixer_cannot_represent_are_refused(overrides, match):
    pytest.importorskip("transformers")
    with pytest.raises(ValueError, match=f"Zamba2MambaMixer: {match}.*nothing was converted"):
        from_module(_zamba2_mixer(**overrides))


def test_a_zamba2_conv_without_a_bias_is_refused():
    """Zamba2's conv always has a bias (config.use_conv_bias does not reach it); one without is refused by name."""
    pytest.importorskip("transformers")
    module = _zamba2_mixer()
    module.conv1d.bias = None
    with pytest.raises(ValueError, match="Zamba2MambaMixer: the conv has no bias.*nothing was converted"):
        from_module(module)


def test_zamba2_layer_is_read_by_its_own_source():
    pytest.importorskip("transformers")
    assert source_of(_zamba2_mixer()).name == "hf_zamba2"


def _mamba_with(monkeypatch, name, edit):
    module = BUILDERS[name](monkeypatch)
    edit(module)
    return module


def _gelu(m):
    m.activation = "gelu"


def _no_mamba_out_bias(m):
    m.out_proj.bias = None


def _mamba_grouped_conv(m):
    m.conv1d = torch.nn.Conv1d(64, 64, 4, groups=32, padding=3)


def _mamba_centred_conv(m):
    m.conv1d = torch.nn.Conv1d(64, 64, 4, groups=64, padding=1)


def _quantized(m):
    m.config._is_quantized = True


def _no_b_norm(m):
    del m.b_layernorm


def _two_eps(m):
    m.c_layernorm.variance_epsilon = 1e-3


@pytest.mark.parametrize(("name", "cls", "edit", "match"), [
    pytest.param("hf_mamba", "MambaMixer", _gelu, "hidden_act is 'gelu'", id="mamba-gelu"),
    pytest.param("hf_mamba", "MambaMixer", _no_mamba_out_bias, "in_proj and out_proj disagree on a bias",
                 id="mamba-biases-differ"),
    pytest.param("hf_mamba", "MambaMixer", _mamba_grouped_conv, "the conv is not depthwise", id="mamba-grouped"),
    pytest.param("hf_mamba", "MambaMixer", _mamba_centred_conv, r"padding is \(1,\) for kernel_size 4",
                 id="mamba-not-causal"),
    pytest.param("hf_falcon_mamba", "FalconMambaMixer", _quantized, "quantized", id="falcon-quantized"),
    pytest.param("hf_falcon_mamba", "FalconMambaMixer", _no_b_norm, "only some of dt_layernorm", id="falcon-one-norm"),
    pytest.param("hf_jamba", "JambaMambaMixer", _two_eps, "different eps", id="jamba-two-eps"),
])
def test_mamba1_options_our_mixer_cannot_represent_are_refused(monkeypatch, name, cls, edit, match):
    with pytest.raises(ValueError, match=f"{cls}: .*{match}.*nothing was converted"):
        from_module(_mamba_with(monkeypatch, name, edit))


@pytest.mark.parametrize(("source", "norm"), [pytest.param("hf_mamba", "weighted", id="mamba"),
                                              pytest.param("hf_falcon_mamba", None, id="falcon-mamba"),
                                              pytest.param("hf_jamba", "weightless", id="jamba")])
def test_mamba1_norm_option_must_match_the_family_going_back(source, norm):
    from mixers import Mamba1Mixer
    with pytest.raises(ValueError, match=f"our config has dt_bc_norm={norm!r}"):
        to_state_dict(Mamba1Mixer(config=Mamba1Config(32, dt_bc_norm=norm)), source)


def _recurrent_gemma_with(monkeypatch, edit):
    from tests.mixers.checkpoints.upstream import hf_recurrent_gemma
    module = hf_recurrent_gemma(monkeypatch)
    edit(module)
    return module


def _rg_no_out_bias(m):
    m.linear_out.bias = None


def _rg_grouped_conv(m):
    m.conv_1d = torch.nn.Conv1d(48, 48, 4, groups=12, padding=3)


def _rg_strided_conv(m):
    m.conv_1d = torch.nn.Conv1d(48, 48, 4, groups=48, padding=3, stride=2)


def _rg_reflect_conv(m):
    m.conv_1d = torch.nn.Conv1d(48, 48, 4, groups=48, padding=3, padding_mode="reflect")


def _rg_centred_conv(m):
    m.conv_1d = torch.nn.Conv1d(48, 48, 4, groups=48, padding=1)


def _rg_conv_without_bias(m):
    m.conv_1d = torch.nn.Conv1d(48, 48, 4, groups=48, padding=3, bias=False)


def _rg_relu(m):
    m.act_fn = torch.nn.ReLU()


@pytest.mark.parametrize(("edit", "match"), [
    pytest.param(_rg_no_out_bias, "linear_out has no bias", id="linear-without-bias"),
    pytest.param(_rg_grouped_conv, r"not depthwise over 48 channels \(in_channels=48, out_channels=48, groups=12\)",
                 id="grouped"),
    pytest.param(_rg_strided_conv, r"stride=\(2,\)", id="strided"),
    pytest.param(_rg_reflect_conv, "pads with 'reflect'", id="reflect"),
    pytest.param(_rg_centred_conv, r"padding is \(1,\) for kernel_size 4", id="not-causal"),
    pytest.param(_rg_conv_without_bias, "the conv has no bias", id="conv-without-bias"),
    pytest.param(_rg_relu, "activation ReLU is neither the tanh nor the exact GeLU", id="activation"),
])
def test_recurrent_gemma_options_our_mixer_cannot_represent_are_refused(monkeypatch, edit, match):
    with pytest.raises(ValueError, match=f"RecurrentGemmaRecurrentBlock: .*{match}.*nothing was converted"):
        from_module(_recurrent_gemma_with(monkeypatch, edit))


def test_recurrent_gemma_reads_its_exact_gelu(monkeypatch):
    from tests.mixers.checkpoints.upstream import hf_recurrent_gemma
    assert from_module(hf_recurrent_gemma(monkeypatch, hidden_activation="gelu")).config.activation == "gelu"
    assert from_module(hf_recurrent_gemma(monkeypatch)).config.activation == "gelu_pytorch_tanh"


def test_recurrent_gemma_fixes_the_decay_exponent_going_back():
    from mixers import RGLRUMixer
    with pytest.raises(ValueError, match="scale=4.0.*fixes the decay exponent at 8.0"):
        to_state_dict(RGLRUMixer(config=RGLRUConfig(32, scale=4.0)), "hf_recurrent_gemma")


def _minimax_with(monkeypatch, edit):
    from tests.mixers.checkpoints.upstream import hf_minimax
    module = hf_minimax(monkeypatch)
    edit(module)
    return module


def _gelu(m):
    from transformers.activations import ACT2FN
    m.act_fn = ACT2FN["gelu"]


def _qkv_bias(m):
    m.qkv_proj.bias = torch.nn.Parameter(torch.zeros(m.qkv_proj.out_features))


def _edited_slopes(m):
    with torch.no_grad():
        m.slope_rate.mul_(2)


def _layer_past_the_end(m):
    m.layer_idx = 3


@pytest.mark.parametrize(("edit", "match"), [
    pytest.param(_gelu, "its activation is GELUActivation", id="not-silu"),
    pytest.param(_qkv_bias, "qkv_proj has a bias", id="projection-bias"),
    pytest.param(_edited_slopes, "slope_rate is not MiniMax's slopes for layer_idx=1 of num_hidden_layers=3",
                 id="edited-slopes"),
    pytest.param(_layer_past_the_end, "layer_idx=3 is not an index of num_hidden_layers=3", id="layer-index"),
])
def test_minimax_options_our_mixer_cannot_represent_are_refused(monkeypatch, edit, match):
    with pytest.raises(ValueError, match=f"MiniMaxLightningAttention: {match}.*nothing was converted"):
        from_module(_minimax_with(monkeypatch, edit))


def test_a_minimax_layer_on_the_meta_device_converts_onto_the_meta_device(monkeypatch):
    """A layer built under ``torch.device("meta")`` (deferred init) has no slope values to check: it converts
    to a mixer with the same config, every tensor still on the meta device."""
    pytest.importorskip("transformers")
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    from tests.mixers.checkpoints.upstream import hf_minimax, minimax_config
    with torch.device("meta"):
        module = MiniMaxLightningAttention(minimax_config(), 1)
    ours = from_module(module, backend="reference")
    assert ours.config == from_module(hf_minimax(monkeypatch), backend="reference").config
    assert {t.device.type for t in ours.state_dict().values()} == {"meta"}


def test_minimax_round_trip_through_the_module_keeps_its_buffers(monkeypatch):
    """from_module then to_module: the weights come back bitwise, the derived buffers (slope_rate, decay
    tables) stay what the layer holds, and the layer's state dict is whole (every buffer key present)."""
    from tests.mixers.checkpoints.upstream import hf_minimax
    upstream = hf_minimax(monkeypatch)
    before = {k: v.clone() for k, v in upstream.state_dict().items()}
    ours = from_module(upstream, backend="reference")
    with torch.no_grad():
        for p in upstream.parameters():
            p.zero_()
    to_module(ours, upstream)
    _assert_identical(before, upstream.state_dict())
    assert {"slope_rate", "query_decay", "key_decay", "diagonal_decay"} <= set(before)

