"""A toy mixer that lives outside the product: a config, a layer and a checkpoint converter in one
module, the way a new mixer's layer file holds them. ``tests/mixers/layers/test_registry.py``
registers it and checks that everything listing mixers picks it up.

    B = rows, T = tokens, D = hidden

``ToyMixer`` is a per-token linear map (no state crosses a token, so it packs trivially); its
"upstream" is ``ToyLayer``, a layer class that presents itself as a Hugging Face one (its module
is under ``transformers``), storing the same weights under other names.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from mixers.checkpoints import Source
from mixers.checkpoints._source import renaming
from mixers.layers.base import MixerBase


@dataclass(frozen=True)
class ToyConfig:
    """``head_dim`` must divide ``hidden_size`` (a constraint for the size checks to find)."""

    hidden_size: int
    head_dim: int = 8

    def __post_init__(self):
        if self.hidden_size % self.head_dim:
            raise ValueError(f"head_dim={self.head_dim} must divide hidden_size={self.hidden_size}")


class ToyMixer(MixerBase):
    """``[B, T, D] -> [B, T, D]``: one linear map per token."""

    CONFIG = ToyConfig
    PLAN = (("toy scan", (("fla", ("varlen",)),)),)
    INFERENCE_PLAN = (("toy decode", (("fla", ("fused_recurrent",)),)),)

    def __init__(self, hidden_size: int | None = None, *, config=None, backend: str = "auto", **overrides):
        super().__init__(self.CONFIG, hidden_size, config, backend, overrides)
        self.proj = nn.Linear(self.config.hidden_size, self.config.hidden_size)

    def forward(self, hidden_states: torch.Tensor, packed_seq_params=None) -> torch.Tensor:
        self.varlen(hidden_states, packed_seq_params)            # checks the input and the metadata
        return self.proj(hidden_states)


class ToyLayer(nn.Module):
    """The toy's "upstream" layer: ``linear`` holds what ``ToyMixer.proj`` holds."""

    def __init__(self, hidden_size: int):
        super().__init__()
        self.linear = nn.Linear(hidden_size, hidden_size)

    def forward(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        return self.linear(hidden_states)


ToyLayer.__module__ = "transformers.models.toy.modeling_toy"     # what enable_packing looks for

_to_ours, _to_upstream = renaming({"proj.weight": "linear.weight", "proj.bias": "linear.bias"})

SOURCES = (Source(name="toy", description="the toy layer", mixer=ToyMixer, config_type=ToyConfig, to_ours=_to_ours,
                  to_upstream=_to_upstream, read_config=lambda module: ToyConfig(module.linear.in_features),
                  classes=("transformers:ToyLayer",)),)
