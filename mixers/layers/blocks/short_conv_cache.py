"""The short convolution of a cached forward: its state is the last W-1 inputs of each slot.

    B = rows, T = tokens, D = channels, W = width, N = slots of the call

* decoding (rows of one token): :func:`mixers.ops.causal_conv1d_update` on the pool, in place,
  by slot index (causal-conv1d's ``conv_state_indices``);
* a packed call: :func:`mixers.ops.causal_conv1d_fn` with ``cu_seqlens`` (the call's
  state layout), per-document initial states read from the slots (none when every slot is
  fresh, which keeps the causal-conv1d kernel and its ``causal_conv1d_varlen_states``), and the
  per-document final states written back;
* rows of t tokens: the same op with per-row initial and final states.
"""

from __future__ import annotations

import torch

from ...inference.layer_cache import LayerCache
from ...inference.slots import SlotBatch
from ...ops import causal_conv1d_fn, causal_conv1d_update
from .short_conv import ShortConvolution


def conv_cached(conv: ShortConvolution, x: torch.Tensor, cache: LayerCache, name: str,
                batch: SlotBatch) -> torch.Tensor:
    """``[B, T, D] -> [B, T, D]``, the slots' conv states ``cache[name]`` continued and updated."""
    weight = conv.weight[:, 0]
    if batch.decode:
        out = causal_conv1d_update(x[:, 0], cache[name], weight, conv.bias, conv.activation,
                                   conv_state_indices=batch.slots, backend=conv.backend)
        return out.unsqueeze(1)
    initial = None if batch.all_fresh else cache.gather(name, batch)
    if batch.packed:
        out, final = causal_conv1d_fn(x.transpose(1, 2), weight, conv.bias, initial_states=batch.spread(initial),
                                      return_final_states=True, activation=conv.activation,
                                      cu_seqlens=batch.state_varlen, backend=conv.backend)
        final = batch.pick(final)
    else:
        out, final = causal_conv1d_fn(x.transpose(1, 2), weight, conv.bias, initial_states=initial,
                                      return_final_states=True, activation=conv.activation, backend=conv.backend)
    cache.write(name, batch, final)
    return out.transpose(1, 2)
