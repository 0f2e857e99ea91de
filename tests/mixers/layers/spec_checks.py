"""The three checks every mixer's own test file runs against its spec, in fp64.

    D = hidden, T = tokens

``spec(mixer, h [T, D]) -> [T, D]`` is the mixer's algorithm written out for ONE document, from a
zero state. Each check states what it compares; the mixer files keep their own specs and cases.
"""

from __future__ import annotations

import torch

from ssm_pack import PackedSeqParams, get_cu_seqlens
from tests.support.oracles import check_grads


def assert_packed_equals_spec(mixer, spec, lengths, pad: int, tail: int, what: str) -> None:
    """A packed row (documents padded to ``pad``, ``tail`` tokens after them) equals ``spec`` on each
    document alone: outputs within 1e-12, the input's and every parameter's gradient by
    ``check_grads`` (the padding's outputs and gradients excluded from the loss)."""
    hidden = mixer.config.hidden_size
    starts = get_cu_seqlens(PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad)).tolist()
    total = starts[-1] + tail
    params = PackedSeqParams.from_lengths(lengths, pad_to_multiple_of=pad, total_tokens=total)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(1, total, hidden, generator=g, dtype=torch.float64, requires_grad=True)
    w_out = torch.randn(1, total, hidden, generator=g, dtype=torch.float64)
    out = mixer(x, params)
    keep = torch.zeros(total, dtype=torch.bool)
    for s, n in zip(starts, lengths):
        keep[s:s + n] = True
    loss = (out[0, keep] * w_out[0, keep]).sum()
    ref_x = x.detach().clone().requires_grad_(True)
    want = torch.cat([spec(mixer, ref_x[0, s:s + n]) for s, n in zip(starts, lengths)])
    assert float((out[0, keep] - want).abs().max().detach()) <= 1e-12
    named = dict(mixer.named_parameters())
    check_grads(loss, (want * w_out[0, keep]).sum(), {"x": x, **named}, {"x": ref_x, **named}, torch.float64,
                what=what)


def assert_metadata_matters(mixer, spec, lengths=(5, 9), leak: float = 1e-3) -> None:
    """Negative control of :func:`assert_packed_equals_spec`: the row with its metadata equals the
    documents alone; the same row as one sequence differs by more than ``leak``."""
    x = torch.randn(1, sum(lengths), mixer.config.hidden_size, dtype=torch.float64)
    bounds = [0, *torch.tensor(lengths).cumsum(0).tolist()]
    with torch.no_grad():
        want = torch.cat([spec(mixer, x[0, a:b]) for a, b in zip(bounds[:-1], bounds[1:])])
        assert float((mixer(x, PackedSeqParams.from_lengths(list(lengths)))[0] - want).abs().max()) <= 1e-12
        assert float((mixer(x)[0] - want).abs().max()) > leak


def assert_decode_equals_recompute(mixer, lengths, steps: int = 3) -> None:
    """A packed prefill of every sequence but its last ``steps`` tokens into a cache, then ``steps``
    decode steps of one token per slot, equals the mixer on each whole sequence (fp64, 1e-12)."""
    g = torch.Generator().manual_seed(3)
    seqs = [torch.randn(n + steps, mixer.config.hidden_size, generator=g, dtype=torch.float64) for n in lengths]
    cache = mixer.allocate_inference_cache(len(seqs), max(lengths) + steps)
    slots = torch.arange(len(seqs))
    prompt = torch.cat([s[:-steps] for s in seqs])[None]
    with torch.no_grad():
        got = list(mixer(prompt, PackedSeqParams.from_lengths(list(lengths)), cache=cache, cache_slots=slots)[0]
                   .split(list(lengths)))
        decoded = [mixer(torch.stack([s[n + k] for s, n in zip(seqs, lengths)])[:, None], cache=cache,
                         cache_slots=slots)[:, 0] for k in range(steps)]
        for i, s in enumerate(seqs):
            mine = torch.cat([got[i]] + [step[i:i + 1] for step in decoded])
            assert float((mine - mixer(s[None])[0]).abs().max()) <= 1e-12, i
