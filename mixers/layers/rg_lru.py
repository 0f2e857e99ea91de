"""``RGLRUMixer``: Griffin's recurrent block (RecurrentGemma's ``RecurrentGemmaRecurrentBlock``), packed.

    B = rows, T = tokens, D = hidden, W = ``lru_width``, H = gate blocks, K = W / H, Wc = conv width

The spec, one document at a time (nothing else enters it):

1. ``y = act(linear_y(h))`` ``[T, W]`` (RecurrentGemma's tanh GeLU);
2. ``x = causal_depthwise_conv(linear_x(h))`` ``[T, W]``, with a bias, width Wc, the terms
   before the document's first token being zero;
3. the gates' pre-activations, block-diagonal: channel block k of ``x`` (``K`` channels) times
   ``input_gate_weight[k]`` / ``recurrent_gate_weight[k]`` ``[K, K]`` plus the biases ``[H, K]``;
4. ``x = rg_lru(x, gate_x, gate_a, recurrent_param)`` (:mod:`mixers.ops.rg_lru`: the first
   token of the document resets, every later one decays the state and adds its normalised input);
5. ``out = linear_out(x * y)``.

Steps 2 and 4 mix tokens, so the packed forward hands both the forward's packing metadata: the
convolution restarts at every document (:func:`mixers.ops.causal_conv1d_fn`), the recurrence
resets at every document start (:func:`mixers.ops.rg_lru`), both with per-document states and
context parallelism by state passing; steps 1, 3 and 5 act on each token alone.

``backend`` picks the kernels of both token-mixing steps, as ``PLAN`` lists them: the
convolution's (causal-conv1d, else fla's Triton conv) and the recurrence's (fla's
``fused_recurrent_hgrn``, :mod:`mixers.ops.rg_lru.kernel`); the decode step has no kernel (one
elementwise update per token), so it runs the torch backend whatever ``backend`` says.

Inference: the cache holds ``conv [S, W, Wc-1]`` (the last Wc-1 values of ``linear_x(h)`` per
slot, in the activations' dtype) and ``lru [S, W]`` (the recurrent state, fp32 for half
activations as RecurrentGemma keeps it); a fresh slot's first token resets, as in a full forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from ..inference.layer_cache import LayerCache
from ..inference.slots import SlotBatch
from ..ops import rg_lru, rg_lru_update
from ..ops.common.chunks import compute_dtype
from .base import SHORT_CONV, MixerBase, divides, positive
from .blocks.short_conv import ShortConvolution
from .blocks.short_conv_cache import conv_cached
from .cached import CachedMixin

ACTIVATIONS = {"gelu_pytorch_tanh": lambda t: F.gelu(t, approximate="tanh"), "gelu": F.gelu}


@dataclass(frozen=True)
class RGLRUConfig:
    """Griffin's recurrent block: ``linear_y`` / ``linear_x`` to ``lru_width`` (default
    ``hidden_size``), a depthwise conv of width ``conv_size`` (RecurrentGemma's ``conv1d_width``, 4),
    the RG-LRU with ``num_heads`` block-diagonal gate blocks (RecurrentGemma's
    ``num_attention_heads``; must divide ``lru_width``) and decay exponent ``scale`` (8.0), then
    ``linear_out``. Every linear and the conv carry a bias, as in RecurrentGemma.
    ``activation``: the GeLU of the ``y`` branch (``"gelu_pytorch_tanh"`` or ``"gelu"``).
    """

    hidden_size: int
    lru_width: int | None = None
    num_heads: int = 1
    conv_size: int = 4
    scale: float = 8.0
    activation: str = "gelu_pytorch_tanh"

    def __post_init__(self):
        if self.lru_width is None:
            object.__setattr__(self, "lru_width", self.hidden_size)
        for name in ("hidden_size", "lru_width", "num_heads", "conv_size"):
            positive(name, getattr(self, name))
        divides("num_heads", self.num_heads, "lru_width", self.lru_width)
        if isinstance(self.scale, bool) or not isinstance(self.scale, (int, float)) or not self.scale > 0:
            raise ValueError(f"scale must be a positive number (RecurrentGemma's 8.0), got {self.scale!r}")
        if self.activation not in ACTIVATIONS:
            raise ValueError(f"activation must be one of {sorted(ACTIVATIONS)}, got {self.activation!r}")

    @property
    def block_width(self) -> int:
        return self.lru_width // self.num_heads


class RGLRUMixer(CachedMixin, MixerBase):
    """Griffin's recurrent block: ``forward(hidden_states [B, T, D], packed_seq_params=None) -> [B, T, D]``.

    Build it from ``hidden_size`` alone (``RGLRUMixer(512)``), with overrides
    (``RGLRUMixer(512, num_heads=8)``) or from an :class:`RGLRUConfig`. ``backend``: ``"auto"``,
    ``"kernel"`` (the convolution's and the recurrence's kernels; checked now) or ``"reference"``.
    """

    CONFIG = RGLRUConfig
    PLAN = (("short conv", SHORT_CONV), ("RG-LRU scan", (("fla_hgrn", ()),)))
    INFERENCE_PLAN = (("conv decode", (("causal_conv1d", ("update_indices",)), ("fla_conv", ("update",)))),)

    def __init__(self, hidden_size: int | None = None, *, config: RGLRUConfig | None = None, backend: str = "auto",
                 **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        c = self.config
        w, h, k = c.lru_width, c.num_heads, c.block_width
        self.linear_y = nn.Linear(c.hidden_size, w)
        self.linear_x = nn.Linear(c.hidden_size, w)
        self.conv = ShortConvolution(w, c.conv_size, bias=True, activation=None, backend=backend)
        self.input_gate_weight = nn.Parameter(torch.randn(h, k, k) / math.sqrt(k))
        self.input_gate_bias = nn.Parameter(torch.zeros(h, k))
        self.recurrent_gate_weight = nn.Parameter(torch.randn(h, k, k) / math.sqrt(k))
        self.recurrent_gate_bias = nn.Parameter(torch.zeros(h, k))
        self.recurrent_param = nn.Parameter(self._decay_init(w))
        self.linear_out = nn.Linear(w, c.hidden_size)

    @staticmethod
    def _decay_init(width: int) -> torch.Tensor:
        """Griffin's init: ``a = sigmoid(-recurrent_param)`` with ``a^2`` uniform in [0.9^2, 0.999^2]."""
        a = torch.empty(width).uniform_(0.9 ** 2, 0.999 ** 2).sqrt()
        return torch.log(1.0 / a - 1.0)

    @property
    def _step_backend(self) -> str:
        """The decode step's: it has no kernel, so ``"kernel"`` asks for none there."""
        return "reference" if self.backend == "reference" else "auto"

    def _gates(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Step 3: ``(gate_x, gate_a)`` ``[B, T, W]`` of ``x [B, T, W]``, block by block."""
        c = self.config
        blocks = x.reshape(*x.shape[:-1], c.num_heads, c.block_width)
        gate_x = torch.einsum("...hi,hio->...ho", blocks, self.input_gate_weight) + self.input_gate_bias
        gate_a = torch.einsum("...hi,hio->...ho", blocks, self.recurrent_gate_weight) + self.recurrent_gate_bias
        return gate_x.reshape(x.shape), gate_a.reshape(x.shape)

    def _branch_y(self, hidden_states: torch.Tensor) -> torch.Tensor:
        return ACTIVATIONS[self.config.activation](self.linear_y(hidden_states))

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None, *, cache=None,
                cache_slots=None) -> torch.Tensor:
        if cache is not None or cache_slots is not None:   # inference: _cached below
            return self._forward_cached(hidden_states, packed_seq_params, cache, cache_slots)
        varlen = self.varlen(hidden_states, packed_seq_params)
        y = self._branch_y(hidden_states)
        x = self.conv(self.linear_x(hidden_states), varlen)
        x, _ = rg_lru(x, *self._gates(x), self.recurrent_param, scale=self.config.scale, cu_seqlens=varlen,
                      backend=self.backend)
        return self.linear_out(x * y)

    def _cache_states(self, slots, max_seqlen, dtype, device):
        c = self.config
        return {"conv": torch.zeros(slots, c.lru_width, c.conv_size - 1, dtype=dtype, device=device),
                "lru": torch.zeros(slots, c.lru_width, dtype=compute_dtype(dtype), device=device)}

    def _cached(self, hidden_states, varlen, cache: LayerCache, batch: SlotBatch) -> torch.Tensor:
        c = self.config
        y = self._branch_y(hidden_states)
        x = conv_cached(self.conv, self.linear_x(hidden_states), cache, "conv", batch)
        gate_x, gate_a = self._gates(x)
        continues = batch.starts_device > 0                                     # [N]: a fresh slot resets
        if batch.decode:
            out = rg_lru_update(cache["lru"], x[:, 0], gate_x[:, 0], gate_a[:, 0], self.recurrent_param,
                                scale=c.scale, state_indices=batch.slots, continues=continues,
                                backend=self._step_backend)
            return self.linear_out(out.unsqueeze(1) * y)
        initial = None if batch.all_fresh else cache.gather("lru", batch)
        if batch.packed:
            spread = batch.spread(continues)
            out, final = rg_lru(x, gate_x, gate_a, self.recurrent_param, scale=c.scale,
                                initial_state=batch.spread(initial), continues=spread, output_final_state=True,
                                cu_seqlens=batch.state_varlen, backend=self.backend)
            final = batch.pick(final)
        else:
            out, final = rg_lru(x, gate_x, gate_a, self.recurrent_param, scale=c.scale, initial_state=initial,
                                continues=continues, output_final_state=True, backend=self.backend)
        cache.write("lru", batch, final)
        return self.linear_out(out * y)
