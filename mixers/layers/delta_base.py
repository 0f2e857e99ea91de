"""What Gated DeltaNet, KDA and Gated DeltaProduct mixers share (fla's layer structure).

    B = rows, T = tokens, D = hidden, H = key heads, HV = value heads, K / V = head dims,
    nh = delta steps per token (1 except for Gated DeltaProduct)

q / k / v projections, each through a short convolution (SiLU) fed the packed ``seq_idx``;
``beta = sigmoid(b_proj(x))`` (times 2 with ``allow_neg_eigval``); the subclass's gate and scan;
a gated RMS norm per value head and out_proj, as one function (:mod:`.norm_linear`). The kernel
and reference paths share all of it: only the op call inside ``_scan`` differs, and the op
chooses the backend.
"""

from __future__ import annotations

import torch
from torch import nn

from ._init import decay_gate, inverse_softplus_dt
from .base import SHORT_CONV, MixerBase
from .delta_cache import DeltaCached
from .norm import GatedRMSNorm, upcast
from .norm_linear import norm_linear
from .projections import project
from .short_conv import ShortConvolution


class DeltaMixerBase(DeltaCached, MixerBase):
    """Base of the delta-rule mixers; subclasses set ``CONFIG`` and build the gates."""

    CONFIG = None
    PLAN = (("short convs", SHORT_CONV), ("delta-rule scan", (("fla", ("varlen",)),)))
    HOUSEHOLDER = 1

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c, nh = self.config, self.householder
        self.q_proj = nn.Linear(c.hidden_size, c.key_dim, bias=False)
        self.k_proj = nn.Linear(c.hidden_size, c.key_dim * nh, bias=False)
        self.v_proj = nn.Linear(c.hidden_size, c.value_dim * nh, bias=False)
        self.b_proj = nn.Linear(c.hidden_size, c.num_v_heads * nh, bias=False)
        self.q_conv = ShortConvolution(c.key_dim, c.conv_size, activation="silu", backend=backend)
        self.k_conv = ShortConvolution(c.key_dim * nh, c.conv_size, activation="silu", backend=backend)
        self.v_conv = ShortConvolution(c.value_dim * nh, c.conv_size, activation="silu", backend=backend)
        self.o_proj = nn.Linear(c.value_dim, c.hidden_size, bias=False)

    @property
    def householder(self) -> int:
        return getattr(self.config, "num_householder", 1)

    def _project(self, hidden_states: torch.Tensor):
        """``(q, k, v, beta_logits, gate_in, output_gate)``: every projection of ``hidden_states`` in
        one call with one input gradient (:func:`mixers.layers.projections.project`); ``gate_in``
        feeds the subclass's ``_gate``, ``output_gate`` the output norm. The subclass's
        ``_gate_inputs()`` names the last two projections."""
        return project(hidden_states, (self.q_proj, self.k_proj, self.v_proj, self.b_proj, *self._gate_inputs()))

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        """``[B, T, D]`` -> ``[B, T, D]``; packed input needs ``B == 1``. With ``cache``: inference
        (:mod:`mixers.layers.delta_cache`)."""
        if cache is not None or cache_slots is not None:   # inference: delta_cache.py
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        c, nh = self.config, self.householder
        varlen = self.varlen(hidden_states, packed_seq_params)
        b, t, _ = hidden_states.shape
        q, k, v, beta, gate_in, out_gate = self._project(hidden_states)
        q = self.q_conv(q, varlen).reshape(b, t, c.num_heads, c.head_dim)
        k = self.k_conv(k, varlen).reshape(b, t * nh, c.num_heads, c.head_dim)
        v = self.v_conv(v, varlen).reshape(b, t * nh, c.num_v_heads, c.head_v_dim)
        beta = torch.sigmoid(upcast(beta)).reshape(b, t * nh, c.num_v_heads)
        if c.allow_neg_eigval:
            beta = beta * 2
        o = self._scan(q, k, v.to(q.dtype), self._gate(gate_in), beta.to(q.dtype), varlen)
        return norm_linear(self.o_norm, o.reshape(b, t, c.value_dim), out_gate, self.o_proj)   # per value head


class ScalarGateMixer(DeltaMixerBase):
    """GDN and Gated DeltaProduct: ``g = -exp(A_log) * softplus(a_proj(x) + dt_bias)`` per value
    head and a SiLU-gated output norm with ``g_proj(x)``."""

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(hidden_size, config=config, backend=backend, **overrides)
        c = self.config
        self.a_proj = nn.Linear(c.hidden_size, c.num_v_heads, bias=False)
        self.A_log = nn.Parameter(torch.log(torch.empty(c.num_v_heads).uniform_(1e-3, 16)))
        self.dt_bias = nn.Parameter(inverse_softplus_dt(c.num_v_heads))
        self.g_proj = nn.Linear(c.hidden_size, c.value_dim, bias=False)
        self.o_norm = GatedRMSNorm(c.head_v_dim, c.norm_eps, "swish")

    def _gate_inputs(self):
        return self.a_proj, self.g_proj

    def _gate(self, a):
        """The log decay ``[B, T, HV]`` from ``a_proj``'s output."""
        return decay_gate(a, self.dt_bias, self.A_log)
