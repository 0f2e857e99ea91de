"""Which hidden sizes a stack of mixers can be built with, and what to change when one cannot.

The configs are the registered mixers' (:mod:`mixers.layers.registry`). A block's config refuses a
size it cannot split into heads (Mamba2: ``head_dim`` must divide
``expand * hidden_size``). :func:`size_problem` finds the first block of a pattern that refuses a
hidden size and works out the fixes by trying the configs (cheap dataclasses, no weights): the
nearest hidden sizes every block of the pattern accepts, and the head sizes that block accepts at
the hidden size asked for. :class:`HybridLM <mixers.HybridLM>` and the demo's flags word the same
answer in their own terms.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..layers import registry


def _config(letter: str) -> type:
    """The config class of the mixer registered for ``letter``."""
    return registry.MIXERS[letter].config


def _fits(letter: str, hidden: int, overrides: dict) -> bool:
    try:
        _config(letter)(hidden_size=hidden, **overrides.get(letter, {}))
    except ValueError:
        return False
    return True


@dataclass(frozen=True)
class SizeProblem:
    """Block ``index`` (mixer ``letter``) cannot be built at ``hidden``: ``reason`` (its config's
    words), the nearest working hidden sizes below / above, and head sizes that work at ``hidden``."""

    index: int
    letter: str
    hidden: int
    reason: str
    below: int | None
    above: int | None
    head_dims: tuple[int, ...]
    head_dim: int | None

    def message(self, hidden_name: str = "hidden_size", pattern: str = "", overrides_name: str = "mixer_overrides"
                ) -> str:
        """One paragraph: the argument, the block and its constraint, the sizes that work, the override.

        ``hidden_name`` is how the caller spells the size: ``"hidden_size"`` (``hidden_size=100``)
        or a flag (``"--hidden"``: ``--hidden 100``).
        """
        def given(h):
            return f"{hidden_name} {h}" if hidden_name.startswith("-") else f"{hidden_name}={h}"

        name = registry.MIXERS[self.letter].mixer.__name__
        text = f"{given(self.hidden)}: block {self.index} ({self.letter!r}, {name}) cannot be built: {self.reason}"
        near = [given(h) for h in (self.below, self.above) if h is not None]
        if near:
            text += f"; sizes that work for pattern {pattern!r} with these head sizes: {' or '.join(near)}"
        if self.head_dims:
            text += (f"; or keep {given(self.hidden)} and change that block's head size (now {self.head_dim}): "
                     f"{overrides_name}={{{self.letter!r}: {{'head_dim': {self.head_dims[0]}}}}} "
                     f"(head_dim {', '.join(map(str, self.head_dims))} fit)")
        return text


def size_problem(pattern: str, hidden: int, overrides: dict | None = None, *, search: int = 256) -> SizeProblem | None:
    """The first block of ``pattern`` whose config refuses ``hidden`` (``None`` when every block
    builds). Config errors other than ``ValueError`` (an unknown override) are not caught."""
    overrides = overrides or {}
    for index, letter in enumerate(pattern):
        try:
            _config(letter)(hidden_size=hidden, **overrides.get(letter, {}))
        except ValueError as err:
            reason = str(err)
        else:
            continue

        def works(h):
            return all(_fits(x, h, overrides) for x in set(pattern))

        below = next((h for h in range(hidden - 1, max(hidden - search, 0), -1) if works(h)), None)
        above = next((h for h in range(hidden + 1, hidden + search) if works(h)), None)
        own = dict(overrides.get(letter, {}))
        head_dim = own.get("head_dim", _config(letter).__dataclass_fields__["head_dim"].default)
        candidates = sorted(range(1, 4 * head_dim + 1), key=lambda h: (abs(h - head_dim), -h))
        fits = [h for h in candidates if _fits(letter, hidden, {letter: {**own, "head_dim": h}})]
        return SizeProblem(index, letter, hidden, reason, below, above, tuple(fits[:4]), head_dim)
    return None
