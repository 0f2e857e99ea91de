"""One ``VarlenBatch`` per packing-params object: Megatron-style callers hand every layer the params.

Megatron-core passes its ``PackedSeqParams`` to each layer of the model, not a metadata object
resolved once, so a stack of N ssm-pack layers would build (and, when validating, read the
boundaries of) N copies of the same metadata: N host synchronisations where one is needed.
:class:`BuiltPerParams` keeps the metadata built from each params object while that object
lives (a weak reference: the cache never keeps the params alive) and hands it out again while
nothing the build read has changed: the same objects in every field (held by the entry, so no
identity is ever reused) and no boundary tensor modified in place (its version counter; reading
it reads no tensor value). Anything else builds anew, and so do params holding inference tensors
(made under ``torch.inference_mode``: they have no version counter to follow).
"""

from __future__ import annotations

import threading
import weakref

import torch

_PLAIN = (int, float, bool, str, type(None))


def _snapshot(params) -> tuple | None:
    """What the build reads from ``params``: every public field, with each tensor's version; ``None``
    when a version cannot be followed (an inference tensor has no version counter): not cached."""
    fields = vars(params) if hasattr(params, "__dict__") else {}
    public = sorted((name, value) for name, value in fields.items() if not name.startswith("_"))
    if any(isinstance(value, torch.Tensor) and value.is_inference() for _, value in public):
        return None
    return tuple((name, value, value._version if isinstance(value, torch.Tensor) else None) for name, value in public)


def _same(a: tuple, b: tuple) -> bool:
    if len(a) != len(b):
        return False
    for (name_a, value_a, version_a), (name_b, value_b, version_b) in zip(a, b):
        if name_a != name_b or version_a != version_b:
            return False
        if value_a is not value_b and not (isinstance(value_a, _PLAIN) and type(value_a) is type(value_b)
                                           and value_a == value_b):
            return False
    return True


class BuiltPerParams:
    """``get(params, total_tokens, device, build)``: ``build(params, total_tokens, device)`` once per
    params object, tokens and device while the params are unchanged (see the module docstring)."""

    def __init__(self):
        self._entries: dict[int, tuple] = {}
        self._lock = threading.Lock()
        self.builds = 0

    def get(self, params, total_tokens: int, device, build):
        key = (total_tokens, None if device is None else torch.device(device))
        snapshot = _snapshot(params)
        if snapshot is None:
            self.builds += 1
            return build(params, total_tokens, device)
        with self._lock:
            entry = self._entries.get(id(params))
        if entry is not None:
            ref, entry_key, entry_snapshot, built = entry
            if ref() is params and entry_key == key and _same(entry_snapshot, snapshot):
                return built
        built = build(params, total_tokens, device)
        self.builds += 1
        if getattr(built, "cp", None) is not None:        # context parallel: resolved per call
            return built
        try:
            ref = weakref.ref(params, self._forget(id(params)))
        except TypeError:                                 # no weak reference possible: nothing kept
            return built
        with self._lock:
            self._entries[id(params)] = (ref, key, snapshot, built)
        return built

    def _forget(self, ident: int):
        def forget(ref):
            with self._lock:
                entry = self._entries.get(ident)
                if entry is not None and entry[0] is ref:
                    del self._entries[ident]
        return forget

    def __len__(self) -> int:
        return len(self._entries)
