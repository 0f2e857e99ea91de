"""Shared pieces of the inference tests: tiny mixers, packed calls, snapshots of slots."""

from __future__ import annotations

import pytest
import torch

from mixers.layers.registry import MIXERS
from ssm_pack import PackedSeqParams

CHUNK, WIDTH = 8, 4            # small chunks so short prompts cross several; conv width W = 4
SMALL = {"M": {"head_dim": 16, "state_size": 4, "chunk_size": CHUNK},   # 4 heads of 16: a heads/head_dim mix-up shows
         "G": {"head_dim": 8, "chunk_size": CHUNK},
         "K": {"head_dim": 8, "chunk_size": CHUNK},
         "P": {"head_dim": 8, "chunk_size": CHUNK},
         "A": {"head_dim": 8},
         "C": {"conv_size": WIDTH, "conv_bias": True},
         "S": {"state_size": 4, "chunk_size": CHUNK, "conv_size": WIDTH, "dt_bc_norm": "weighted"},
         "R": {"conv_size": WIDTH, "num_heads": 4},
         "L": {"head_dim": 8, "chunk_size": CHUNK}}
HIDDEN = 32
LETTERS = [pytest.param(letter, id=MIXERS[letter].mixer.__name__) for letter in "MGKPACSRL"]


def make_mixer(letter: str, dtype=torch.float64, seed: int = 0, backend: str = "auto"):
    torch.manual_seed(seed)
    return MIXERS[letter].mixer(HIDDEN, backend=backend, **SMALL[letter]).to(dtype)


def sequences(lengths, dtype=torch.float64, seed: int = 1) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, HIDDEN, generator=g).to(dtype) for n in lengths]


def packed_call(layer, pieces, cache, slots, **params):
    """One packed call of ``pieces`` (``[n_i, D]``), one slot each -> the outputs of each piece."""
    lengths = [p.shape[0] for p in pieces]
    p = PackedSeqParams.from_lengths(lengths, **params)
    x = torch.zeros(1, p.total_tokens, HIDDEN, dtype=pieces[0].dtype)
    starts = p.cu_seqlens.tolist()            # physical starts (padded layout when asked)
    for piece, start in zip(pieces, starts):
        x[0, start:start + piece.shape[0]] = piece
    out = layer(x, p, cache=cache, cache_slots=slots)
    return [out[0, s:s + n] for s, n in zip(starts, lengths)]


def full(layer, seq: torch.Tensor) -> torch.Tensor:
    """The mixer on one whole sequence, no cache: ``[n, D]``."""
    with torch.no_grad():
        return layer(seq.unsqueeze(0))[0]


def slot_states(cache, slot: int) -> dict[str, torch.Tensor]:
    """A copy of everything a slot holds (a KV cache: its first ``length`` entries)."""
    length = int(cache.table.lengths[slot])
    return {name: (t[slot, :length] if name in ("key", "value") else t[slot]).clone()
            for name, t in cache.states.items()}


def snapshot(cache) -> dict[str, torch.Tensor]:
    """Every tensor of a (layer or model) cache, bitwise, with the lengths."""
    layers = cache.layers if hasattr(cache, "layers") else [cache]
    out = {"lengths": cache.table.lengths.clone()}
    for i, layer in enumerate(layers):
        out.update({f"{i}.{k}": v.clone() for k, v in layer.states.items()})
    return out


def same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def max_error(got, want) -> float:
    return float((got.detach().double() - want.detach().double()).abs().max()) if got.numel() else 0.0
