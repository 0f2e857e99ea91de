"""Which process groups a microbatch runs on (Megatron-core dynamic context parallelism).

With dynamic CP the packing scheduler gives each microbatch its own context-parallel group
(``packed_seq_params.cp_group``, sized ``local_cp_size``), which may differ from the group the
model was built with. A singleton group is a real group: it means "no CP for this microbatch",
not "use the static group". Groups are duck-typed: anything with ``.size()``.
"""

from __future__ import annotations

from typing import Any


def _size(name: str, group) -> int:
    size = getattr(group, "size", None)
    if not callable(size):
        raise TypeError(f"{name} must be a process group (with .size()), got {type(group).__name__}")
    return int(size())


def resolve_cp_group(static_cp_group: Any, packed_seq_params=None) -> Any:
    """The context-parallel group for this microbatch: its own group wins over the static one.

    Raises ``ValueError`` when ``local_cp_size`` is set without a ``cp_group`` or the two
    disagree in size.
    """
    dynamic = None if packed_seq_params is None else getattr(packed_seq_params, "cp_group", None)
    local = None if packed_seq_params is None else getattr(packed_seq_params, "local_cp_size", None)
    if local is not None:
        if dynamic is None:
            raise ValueError(f"packed_seq_params.local_cp_size={local} but packed_seq_params.cp_group "
                             "is None; set the matching group (a singleton group for CP off)")
        size = _size("packed_seq_params.cp_group", dynamic)
        if size != local:
            raise ValueError(f"packed_seq_params.cp_group has size {size} but local_cp_size={local}")
    if dynamic is not None:
        return dynamic
    return static_cp_group


def resolve_tp_cp_group(static_tp_cp_group: Any, packed_seq_params=None, *,
                        sequence_parallel: bool, tp_group: Any) -> Any:
    """The tensor x context parallel group matching this microbatch's CP group.

    * No per-microbatch CP group: the static TP x CP group.
    * A per-microbatch group with ``packed_seq_params.tp_cp_group`` set: that group, which must
      have ``tp_size * cp_size`` ranks.
    * A singleton per-microbatch CP group without one: TP x CP is TP itself, so ``tp_group``.
    * A larger per-microbatch CP group without one: ``ValueError`` under sequence parallelism
      (its shards are exchanged over that group), ``None`` otherwise (callers compose the TP
      and CP collectives).
    """
    if not isinstance(sequence_parallel, bool):
        raise TypeError(f"sequence_parallel must be a bool, got {type(sequence_parallel).__name__}")
    cp_group = resolve_cp_group(None, packed_seq_params)
    if cp_group is None:
        return static_tp_cp_group
    if tp_group is None:
        raise ValueError("tp_group is None; pass the tensor-parallel group (a singleton group without TP)")
    tp_size, cp_size = _size("tp_group", tp_group), _size("cp_group", cp_group)
    own = getattr(packed_seq_params, "tp_cp_group", None)
    if own is not None:
        size = _size("packed_seq_params.tp_cp_group", own)
        if size != tp_size * cp_size:
            raise ValueError(f"packed_seq_params.tp_cp_group has size {size} but tp_size * cp_size = "
                             f"{tp_size} * {cp_size} = {tp_size * cp_size}")
        return own
    if cp_size == 1:
        return tp_group
    if sequence_parallel:
        raise ValueError(f"this microbatch runs on a CP group of size {cp_size} under sequence "
                         "parallelism but packed_seq_params.tp_cp_group is None; set the matching "
                         f"TP x CP group (size {tp_size * cp_size})")
    return None
