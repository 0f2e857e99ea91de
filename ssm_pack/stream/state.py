"""The saved state of :class:`ssm_pack.PackStream`, checked whole before a stream takes it.

``load_state_dict`` reads a dict that went through a checkpoint (and may have been edited or
truncated there): every field is checked here, by name, with the value seen and the fix, before
the stream changes, so a refused state leaves the stream as it was and a taken one cannot fail
later with a ``KeyError`` in the middle of a pass.
"""

from __future__ import annotations

from ..checks import describe

_PASS_INTS = {"worker": 0, "num_workers": 1, "position": 0, "g": 0, "pad_next": 0}


def _fail(where: str, want: str, value) -> None:
    raise ValueError(f"load_state_dict: state{where} must be {want}, got {describe(value)}; pass the dict "
                     "PackStream.state_dict() returned, unchanged")


def _int(where: str, value, minimum: int = 0) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        _fail(where, f"an int >= {minimum}", value)


def _keys(where: str, value, keys) -> None:
    if not isinstance(value, dict):
        _fail(where, "a dict", value)
    if set(value) != set(keys):
        missing, extra = sorted(set(keys) - set(value)), sorted(set(value) - set(keys), key=str)
        raise ValueError(f"load_state_dict: state{where} must have the keys {sorted(keys)}; missing {missing}, "
                         f"unknown {extra}; pass the dict PackStream.state_dict() returned, unchanged")


def check_state(state, *, config_keys, counter_keys, checksum_mod: int) -> None:
    """Refuse a state that :meth:`PackStream.state_dict` cannot have written (see the module docstring);
    its config is compared with the stream's by the caller."""
    if not isinstance(state, dict) or not {"config", "source", "epoch", "pass"} <= set(state):
        raise TypeError(f"state must be a dict from PackStream.state_dict(), got {describe(state)}")
    _keys("['config']", state["config"], config_keys)
    if not isinstance(state["source"], dict):
        _fail("['source']", "a dict", state["source"])
    _int("['config']['world']", state["config"]["world"], 1)
    _int("['epoch']", state["epoch"])
    saved = state["pass"]
    if saved is None:
        return
    _keys("['pass']", saved, (*_PASS_INTS, "source_done", "checksum", "total", "counters", "lanes",
                              "rank_tokens", "buffer"))
    for name, minimum in _PASS_INTS.items():
        _int(f"['pass']['{name}']", saved[name], minimum)
    if not isinstance(saved["source_done"], bool):
        _fail("['pass']['source_done']", "a bool", saved["source_done"])
    _int("['pass']['checksum']", saved["checksum"])
    if saved["checksum"] >= checksum_mod:
        _fail("['pass']['checksum']", f"below {checksum_mod}", saved["checksum"])
    if saved["total"] is not None:
        _int("['pass']['total']", saved["total"])
    _keys("['pass']['counters']", saved["counters"], counter_keys)
    for name, value in saved["counters"].items():
        _int(f"['pass']['counters']['{name}']", value)
    _check_lists(saved, state["config"]["world"])


def _check_lists(saved: dict, world: int) -> None:
    for name in ("lanes", "rank_tokens"):
        if not isinstance(saved[name], (list, tuple)) or len(saved[name]) != world:
            _fail(f"['pass']['{name}']", f"a list of world={world} entries", saved[name])
    for i, value in enumerate(saved["rank_tokens"]):
        _int(f"['pass']['rank_tokens'][{i}]", value)
    for i, lane in enumerate(saved["lanes"]):
        if lane is None:
            continue
        if not isinstance(lane, (list, tuple)) or len(lane) != 3:
            _fail(f"['pass']['lanes'][{i}]", "None or [index, offset, length]", lane)
        for j, value in enumerate(lane):
            _int(f"['pass']['lanes'][{i}][{j}]", value, 1 if j == 2 else 0)
    if not isinstance(saved["buffer"], (list, tuple)):
        _fail("['pass']['buffer']", "a list", saved["buffer"])
    for i, entry in enumerate(saved["buffer"]):
        if not isinstance(entry, (list, tuple)) or len(entry) != 3 or not isinstance(entry[2], bool):
            _fail(f"['pass']['buffer'][{i}]", "[index, length, long]", entry)
        _int(f"['pass']['buffer'][{i}][0]", entry[0])
        _int(f"['pass']['buffer'][{i}][1]", entry[1], 1)
