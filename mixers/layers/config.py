"""Typed, frozen configs of the mixers: every size derived from ``hidden_size`` unless given.

Defaults follow the upstream layers (mamba-ssm's ``Mamba2``, fla's ``GatedDeltaNet``,
``KimiDeltaAttention``, ``GatedDeltaProduct``), with head dims of 64 so that small models stay
cheap on a CPU.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from ssm_pack.checks import check_int

from ..ops.common.checks import check_chunk_size


def _positive(name: str, value) -> None:
    check_int(name, value, minimum=1)


def _divides(a_name: str, a: int, b_name: str, b: int) -> None:
    if b % a:
        raise ValueError(f"{a_name}={a} must divide {b_name}={b}")


@dataclass(frozen=True)
class Mamba2Config:
    """Mamba2 (SSD) mixer: ``d_inner = expand * hidden_size``, ``d_inner / head_dim`` heads.

    ``num_heads`` instead sets ``d_inner = num_heads * head_dim`` for checkpoints whose inner width
    is not a multiple of ``hidden_size`` (Megatron's / NemotronH's ``mamba_num_heads``, FalconH1's
    ``mamba_d_ssm``); giving both ``expand`` and ``num_heads`` requires them to agree.
    ``norm_eps``: 1e-5 in mamba-ssm and Megatron; HF checkpoints carry their own
    (``layer_norm_epsilon`` / ``rms_norm_eps``, often 1e-6).
    """

    hidden_size: int
    expand: int | None = None
    head_dim: int = 64
    state_size: int = 64
    num_groups: int = 1
    conv_size: int = 4
    chunk_size: int = 128
    dt_min: float = 0.001
    dt_max: float = 0.1
    dt_init_floor: float = 1e-4
    dt_limit: tuple[float, float] = (0.0, math.inf)
    norm_eps: float = 1e-5
    num_heads: int | None = None

    def __post_init__(self):
        for name in ("hidden_size", "head_dim", "state_size", "num_groups", "conv_size", "chunk_size"):
            _positive(name, getattr(self, name))
        if self.num_heads is None:
            if self.expand is None:
                object.__setattr__(self, "expand", 2)
            _positive("expand", self.expand)
            _divides("head_dim", self.head_dim, "expand * hidden_size", self.expand * self.hidden_size)
            object.__setattr__(self, "num_heads", self.expand * self.hidden_size // self.head_dim)
        else:
            _positive("num_heads", self.num_heads)
            if self.expand is not None and self.expand * self.hidden_size != self.d_inner:
                raise ValueError(f"expand={self.expand} gives d_inner={self.expand * self.hidden_size} but "
                                 f"num_heads * head_dim = {self.d_inner}; give one of them (expand=None)")
        _divides("num_groups", self.num_groups, "num_heads", self.num_heads)

    @property
    def d_inner(self) -> int:
        return self.num_heads * self.head_dim


def _default_heads(hidden_size: int, head_dim: int, share: float) -> int:
    return max(1, int(hidden_size * share) // head_dim)


@dataclass(frozen=True)
class DeltaConfig:
    """Shared by GDN, KDA and Gated DeltaProduct: key heads of ``head_dim``, value heads of
    ``head_dim * expand_v`` (``num_v_heads`` a multiple of ``num_heads``: grouped values).

    ``norm_eps`` of the gated output norm: 1e-5 in fla; 1e-6 (``rms_norm_eps``) in Hugging Face's
    Qwen3-Next and Kimi-Linear.
    """

    hidden_size: int
    head_dim: int = 64
    num_heads: int | None = None
    num_v_heads: int | None = None
    expand_v: float = 2.0
    conv_size: int = 4
    chunk_size: int = 64
    allow_neg_eigval: bool = False
    norm_eps: float = 1e-5
    heads_share: float = field(default=0.75, repr=False)   # num_heads * head_dim = 0.75 * hidden (fla's GDN)

    def __post_init__(self):
        _positive("hidden_size", self.hidden_size)
        _positive("head_dim", self.head_dim)
        if self.num_heads is None:
            object.__setattr__(self, "num_heads", _default_heads(self.hidden_size, self.head_dim, self.heads_share))
        if self.num_v_heads is None:
            object.__setattr__(self, "num_v_heads", self.num_heads)
        _positive("num_heads", self.num_heads)
        _positive("num_v_heads", self.num_v_heads)
        _divides("num_heads", self.num_heads, "num_v_heads", self.num_v_heads)
        if self.head_v_dim * 1.0 != self.head_dim * self.expand_v or self.head_v_dim < 1:
            raise ValueError(f"head_dim * expand_v = {self.head_dim * self.expand_v} must be a positive integer")
        check_chunk_size(self.chunk_size)

    @property
    def head_v_dim(self) -> int:
        return int(round(self.head_dim * self.expand_v))

    @property
    def key_dim(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def value_dim(self) -> int:
        return self.num_v_heads * self.head_v_dim


@dataclass(frozen=True)
class GatedDeltaNetConfig(DeltaConfig):
    """fla's ``GatedDeltaNet``: scalar decay per head, SiLU-gated output norm."""


@dataclass(frozen=True)
class KDAConfig(DeltaConfig):
    """fla's ``KimiDeltaAttention``: per-channel decay, low-rank gate projections, sigmoid output gate.

    ``output_gate_bias``: the output gate's second projection has a bias in fla (True) and none in
    Hugging Face's Kimi-Linear (False).
    """

    expand_v: float = 1.0
    heads_share: float = field(default=1.0, repr=False)
    output_gate_bias: bool = True


@dataclass(frozen=True)
class GatedDeltaProductConfig(DeltaConfig):
    """fla's ``GatedDeltaProduct``: ``num_householder`` delta steps per token."""

    num_householder: int = 2
    allow_neg_eigval: bool = True

    def __post_init__(self):
        super().__post_init__()
        _positive("num_householder", self.num_householder)
        if self.num_v_heads != self.num_heads:
            raise ValueError("GatedDeltaProduct needs num_v_heads == num_heads")


@dataclass(frozen=True)
class AttentionConfig:
    """Grouped-query attention with rotary embeddings restarting at every document."""

    hidden_size: int
    head_dim: int = 64
    num_heads: int | None = None
    num_kv_heads: int | None = None
    rope_theta: float = 10000.0
    window_size: tuple[int, int] | None = None

    def __post_init__(self):
        _positive("hidden_size", self.hidden_size)
        _positive("head_dim", self.head_dim)
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.num_heads is None:
            object.__setattr__(self, "num_heads", _default_heads(self.hidden_size, self.head_dim, 1.0))
        if self.num_kv_heads is None:
            object.__setattr__(self, "num_kv_heads", max(1, self.num_heads // 2) if self.num_heads % 2 == 0
                               else self.num_heads)
        _positive("num_heads", self.num_heads)
        _positive("num_kv_heads", self.num_kv_heads)
        _divides("num_kv_heads", self.num_kv_heads, "num_heads", self.num_heads)
