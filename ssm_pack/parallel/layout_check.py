"""Do all context-parallel ranks run the same layout? A small all-reduce per forward.

    P = ranks of the CP group, N = documents, T = tokens of the whole physical row

Every CP op derives who sends what from its own rank's :class:`~ssm_pack.ContextParallelLayout`
without talking. Ranks that disagree about it (different ``bounds``, different documents, a
different row) would run silently wrong, abort inside a collective or hang until the process
group's timeout. :func:`check_layout_agreement` makes that one ``ValueError`` on every rank:
each rank contributes ``[T, N, hash of the boundaries, bounds...]`` (``P + 4`` int64) to one
``all_gather`` over the CP group and compares.

When it runs (:func:`set_layout_check`, or the environment variable
``SSM_PACK_CP_LAYOUT_CHECK``):

* ``"first"`` (default): every forward all-reduces (max) three int64 over the CP group,
  ``[1 if this rank has not yet agreed its layout else 0, d, -d]`` with ``d`` a 64-bit digest of
  the fingerprint. Every rank gets the same result, so every rank takes the same branch: when all
  ranks had agreed their layouts before and the digests are equal (``max d == -max(-d)``) the
  forward goes on; otherwise the full all-gather above runs (raising on a mismatch) and the
  agreed fingerprint is kept (the last 1024, the same list on every rank). So a rank repeating an
  agreed layout while another runs a new one fails too: the skip is decided by all ranks, never
  by one rank's cache alone.
* ``"always"``: the full all-gather on every forward (debugging a data loader).
* ``"off"``: never.

Cost per forward checked (``HybridLM`` resolves its metadata twice per forward: the layers' and
the loss targets'): under ``"first"`` one all-reduce of 3 int64 (24 bytes) on every forward, plus
one all-gather of ``P + 4`` int64 on a layout's first forward: 2 collectives for a new layout, 1
for a repeat; under ``"always"`` 1 (the all-gather); each is also one host sync on an accelerator
(the result is read on the host). Hashing the ``N + 2`` boundaries is a small part of it. It is not
part of :func:`mixers.ops.common.cp_exchange.record_traffic`'s count (that counts the ops'
exchanges); :func:`checks_run` counts these collectives. Groups that are not a
``torch.distributed.ProcessGroup`` (test stand-ins) are not checked. A backward run on only some
ranks cannot be detected this way (it waits in the first exchange's backward until the group's
timeout).
"""

from __future__ import annotations

import hashlib
import os
import struct
from collections import OrderedDict

import torch

MODES = ("first", "always", "off")
ENV = "SSM_PACK_CP_LAYOUT_CHECK"
KEEP = 1024
_state = {"mode": None, "checks": 0}
_AGREED: OrderedDict = OrderedDict()


def set_layout_check(mode: str) -> str:
    """Set when ranks check their layouts agree (``"first"``, ``"always"`` or ``"off"``); returns
    the previous mode. Overrides ``SSM_PACK_CP_LAYOUT_CHECK``."""
    if not isinstance(mode, str) or mode not in MODES:
        raise ValueError(f"mode must be one of {MODES}, got {mode!r}")
    previous = layout_check_mode()
    _state["mode"] = mode
    return previous


def layout_check_mode() -> str:
    """The mode in force: :func:`set_layout_check`'s, else ``SSM_PACK_CP_LAYOUT_CHECK``'s, else ``"first"``."""
    if _state["mode"] is not None:
        return _state["mode"]
    mode = os.environ.get(ENV, "first")
    if mode not in MODES:
        raise ValueError(f"the environment variable {ENV} must be one of {MODES}, got {mode!r}; unset it for "
                         "the default 'first'")
    return mode


def checks_run() -> int:
    """How many collectives the layout check has run in this process (the all-reduces deciding
    whether to skip and the all-gathers comparing fingerprints): for measuring its cost."""
    return _state["checks"]


def fingerprint(layout) -> tuple:
    """``(T, N, hash, *bounds)``: plain ints that differ when two ranks' layouts differ (the hash
    covers the physical boundaries and the bounds)."""
    cover, bounds = layout.cover.tolist(), list(layout.bounds)
    digest = hashlib.blake2b(struct.pack(f"<{len(cover) + len(bounds)}q", *cover, *bounds), digest_size=8).digest()
    return (layout.total_tokens, layout.num_docs, struct.unpack("<q", digest)[0], *bounds)


def _describe(row: list) -> str:
    total, docs, digest, *bounds = row
    return f"T={total}, {docs} documents, bounds {bounds}, boundaries hash {digest & 0xFFFFFFFF:08x}"


def _digest(row: tuple) -> int:
    """A signed 64-bit digest of a fingerprint (what the ranks all-reduce to compare cheaply)."""
    digest = hashlib.blake2b(struct.pack(f"<{len(row)}q", *row), digest_size=8).digest()
    return struct.unpack("<q", digest)[0] // 2       # halved: -d never overflows int64


def _all_agreed_before(known: bool, mine: tuple, group, device) -> bool:
    """One all-reduce (max) of ``[unknown, d, -d]``: True on every rank, or on none, when every
    rank has agreed its layout before and all digests are equal."""
    import torch.distributed as dist
    d = _digest(mine)
    flags = torch.tensor([0 if known else 1, d, -d], dtype=torch.int64, device=device)
    dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=group)
    _state["checks"] += 1
    unknown, high, neg_low = flags.tolist()
    return unknown == 0 and high == -neg_low


def check_layout_agreement(layout, group, device) -> None:
    """Raise ``ValueError`` on every rank when the ranks of ``group`` hold different layouts
    (a collective: every rank of the group must call it, as every CP forward does)."""
    import torch.distributed as dist
    mode = layout_check_mode()
    if mode == "off" or not isinstance(group, dist.ProcessGroup):
        return
    mine = fingerprint(layout)
    key = (tuple(dist.get_process_group_ranks(group)), mine)
    if mode == "first" and _all_agreed_before(key in _AGREED, mine, group, device):
        return
    local = torch.tensor(mine, dtype=torch.int64, device=device)
    rows = [torch.empty_like(local) for _ in range(layout.size)]
    dist.all_gather(rows, local, group=group)
    _state["checks"] += 1
    rows = [r.tolist() for r in rows]
    if any(r != rows[0] for r in rows):
        seen = "; ".join(f"rank {j}: {_describe(r)}" for j, r in enumerate(rows))
        raise ValueError(f"the context-parallel ranks disagree about the packed row ({seen}); every rank of "
                         "cp_group must shard the same row's params with the same bounds: "
                         "shard_for_context_parallel(params, rank, cp_size, total_tokens=T, bounds=...) with the "
                         "same params, T and bounds on every rank")
    _AGREED[key] = None
    if len(_AGREED) > KEEP:
        _AGREED.popitem(last=False)


__all__ = ["check_layout_agreement", "checks_run", "fingerprint", "layout_check_mode", "set_layout_check"]
