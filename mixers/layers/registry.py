"""The mixer registry: what the rest of the house needs to know about each kind of mixer, in one place.

    letter -> MixerKind(letter, name, mixer, cache, checkpoints, small)

One entry per kind of mixer: the letter a ``HybridLM`` pattern uses for it, its name in messages,
its layer class (whose ``CONFIG`` is its config class), the kind of inference cache it keeps, the
checkpoint converter modules that read its upstream layers, and the sizes of a small instance.
Everything that lists mixers reads this table: ``HybridLM`` and the demo (which letters a pattern
may use), :mod:`mixers.model.sizes` (which configs a pattern builds), ``ssm-pack report`` (which
mixers' backends to show), :mod:`mixers.checkpoints` (which converters exist, hence which
Hugging Face and fla layer classes map to which mixer: each converter's ``Source.classes``) and
``enable_packing`` (which Hugging Face layers it swaps).

A new mixer is one op folder (``mixers/ops/<op>/``), one layer file (config and layer) and one
:func:`register` call here; its converters, when it reads upstream checkpoints, are one module of
:mod:`mixers.checkpoints` that the entry names.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field

from .attention import AttentionMixer
from .gated_deltanet import GatedDeltaNetMixer
from .gated_deltaproduct import GatedDeltaProductMixer
from .gated_short_conv import GatedShortConvMixer
from .kda import KDAMixer
from .lightning import LightningMixer
from .mamba1 import Mamba1Mixer
from .mamba2 import Mamba2Mixer
from .rg_lru import RGLRUMixer

CACHES = {
    "state": "fixed-size states per slot (short-conv windows and a recurrent state), whatever the length",
    "kv": "keys and values per slot, growing with the tokens it holds (up to max_seqlen)",
}


@dataclass(frozen=True)
class MixerKind:
    """One kind of mixer.

    Attributes:
        letter: one upper-case letter, its block in a ``HybridLM`` pattern.
        name: how messages name it (``"Mamba2"``, ``"attention"``).
        mixer: the layer class (a :class:`mixers.layers.base.MixerBase` whose ``CONFIG`` is its config).
        cache: the kind of inference cache it keeps (a key of :data:`CACHES`).
        checkpoints: the converter modules that read its upstream layers: a module of
            :mod:`mixers.checkpoints` (``"mamba2"``) or a dotted path, each holding ``SOURCES``
            (:class:`mixers.checkpoints.Source`; those whose ``mixer`` is this one count).
        small: config overrides of a small, fast instance (what the demo builds).
    """

    letter: str
    name: str
    mixer: type
    cache: str
    checkpoints: tuple[str, ...] = ()
    small: Mapping = field(default_factory=dict)

    @property
    def config(self) -> type:
        """The config class (``mixer.CONFIG``)."""
        return self.mixer.CONFIG


MIXERS: dict[str, MixerKind] = {}


def register(kind: MixerKind) -> MixerKind:
    """Add ``kind`` to the registry (checked first: a free upper-case letter, a layer class with a
    ``CONFIG``, a known cache kind); returns it."""
    if not isinstance(kind, MixerKind):
        raise TypeError(f"register takes a MixerKind, got {type(kind).__name__}")
    if not (isinstance(kind.letter, str) and len(kind.letter) == 1 and kind.letter.isupper()):
        raise ValueError(f"a mixer's letter must be one upper-case letter, got {kind.letter!r}")
    if kind.letter in MIXERS:
        raise ValueError(f"letter {kind.letter!r} is taken by {MIXERS[kind.letter].mixer.__name__}; pick another")
    if not isinstance(kind.mixer, type) or getattr(kind.mixer, "CONFIG", None) is None:
        raise TypeError(f"{kind.letter}: mixer must be a layer class with a CONFIG (its config class), got "
                        f"{kind.mixer!r}")
    if kind.cache not in CACHES:
        raise ValueError(f"{kind.letter}: cache must be one of {sorted(CACHES)}, got {kind.cache!r}")
    MIXERS[kind.letter] = kind
    return kind


def letters() -> str:
    """Every registered letter, in registration order (``"MGKPACSRL"``)."""
    return "".join(MIXERS)


def legend() -> str:
    """``"M Mamba2, G Gated DeltaNet, ..."``: each letter and its mixer, for messages and help."""
    return ", ".join(f"{kind.letter} {kind.name}" for kind in MIXERS.values())


def unknown_letters(pattern: str) -> list[str]:
    """The letters of ``pattern`` no mixer is registered for (sorted)."""
    return sorted(set(pattern) - set(MIXERS))


register(MixerKind("M", "Mamba2", Mamba2Mixer, "state", ("mamba2", "zamba2"),
                   small={"head_dim": 16, "state_size": 16, "chunk_size": 64}))
register(MixerKind("G", "Gated DeltaNet", GatedDeltaNetMixer, "state", ("fla", "qwen3_next", "qwen3_5", "olmo_hybrid"),
                   small={"head_dim": 16}))
register(MixerKind("K", "KDA", KDAMixer, "state", ("fla", "kimi_linear"), small={"head_dim": 16}))
register(MixerKind("P", "Gated DeltaProduct", GatedDeltaProductMixer, "state", ("fla",), small={"head_dim": 16}))
register(MixerKind("A", "attention", AttentionMixer, "kv", small={"head_dim": 16}))
register(MixerKind("C", "gated short conv", GatedShortConvMixer, "state", ("lfm2",)))
register(MixerKind("S", "Mamba-1 selective scan", Mamba1Mixer, "state", ("mamba1",), small={"state_size": 8}))
register(MixerKind("R", "RG-LRU", RGLRUMixer, "state", ("recurrent_gemma",), small={"num_heads": 2}))
register(MixerKind("L", "lightning attention", LightningMixer, "state", ("minimax",), small={"head_dim": 16}))
