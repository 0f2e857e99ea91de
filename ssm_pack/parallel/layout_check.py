"""Do all context-parallel ranks run the same layout? One small all-gather of a fingerprint.

    P = ranks of the CP group, N = documents, T = tokens of the whole physical row

Every CP op derives who sends what from its own rank's :class:`~ssm_pack.ContextParallelLayout`
without talking. Ranks that disagree about it (different ``bounds``, different documents, a
different row) would run silently wrong, abort inside a collective or hang until the process
group's timeout. :func:`check_layout_agreement` makes that one ``ValueError`` on every rank:
each rank contributes ``[T, N, hash of the boundaries, bounds...]`` (``P + 4`` int64) to one
``all_gather`` over the CP group and compares.

When it runs (:func:`set_layout_check`, or the environment variable
``SSM_PACK_CP_LAYOUT_CHECK``):

* ``"first"`` (default): on the first forward of each layout; the fingerprints all ranks agreed
  on are kept (the last 1024, the same list on every rank) and not checked again. A row whose
  layout is new on every rank, as a new batch's is, is always checked.
* ``"always"``: on every forward (debugging a data loader). Needed to catch a rank that repeats a
  layout already agreed on while another runs a different one: under ``"first"`` such a rank
  skips the check and the other rank's all-gather meets its first exchange.
* ``"off"``: never.

Cost: one all-gather of ``P + 4`` int64 per forward checked (``HybridLM`` resolves its metadata
twice per forward: the layers' and the loss targets'), which on an accelerator is also one host
sync (the gathered rows are compared on the host), plus hashing the ``N + 2`` boundaries.
It is not part of :func:`mixers.ops.common.cp_exchange.record_traffic`'s
count (that counts the ops' exchanges); :func:`checks_run` counts the checks. Groups that are not
a ``torch.distributed.ProcessGroup`` (test stand-ins) are not checked. A backward run on only
some ranks cannot be detected this way (it waits in the first exchange's backward until the
group's timeout).
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
    """How many layout checks (all-gathers) this process has run: for measuring their cost."""
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


def check_layout_agreement(layout, group, device) -> None:
    """Raise ``ValueError`` on every rank when the ranks of ``group`` hold different layouts
    (a collective: every rank of the group must call it, as every CP forward does)."""
    import torch.distributed as dist
    mode = layout_check_mode()
    if mode == "off" or not isinstance(group, dist.ProcessGroup):
        return
    mine = fingerprint(layout)
    key = (tuple(dist.get_process_group_ranks(group)), mine)
    if mode == "first" and key in _AGREED:
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
