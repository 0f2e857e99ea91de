"""What every mixer shares: its constructor preamble, its kernel plan, how it gets its packing
metadata, and the checks its config runs.

    B = rows, T = tokens, D = hidden

A mixer's ``PLAN`` lists the parts of its packed forward and, for each, the kernels that can run
it in the order the op tries them: ``(part, ((kernel, features), ...))`` rows of the
requirements table (:mod:`ssm_pack.support.requirements`). The ``backend="kernel"`` check at construction,
the once-per-type warning in ``auto`` and the support report all read it through
:func:`plan_support`, so they agree with each other and with the ops (which ask the table for
the same kernels and features, in the same order).

``forward(hidden_states, packed_seq_params)`` takes a :class:`ssm_pack.VarlenBatch` (what
``HybridLM`` builds once per forward and hands to every block) or anything it is built from (an
ssm-pack or Megatron-core ``PackedSeqParams``, offsets): a mixer called on its own builds it
itself.
"""

from __future__ import annotations

import warnings

import torch
from torch import nn

from ssm_pack.checks import check_int
from ssm_pack.support import requirements
from ssm_pack.varlen import VarlenBatch

from ..ops import dispatch

_WARNED: set[tuple[str, str]] = set()


SHORT_CONV = (("causal_conv1d", ("seq_idx",)), ("fla_conv", ()))   # the short convolutions' kernels, in order


def plan_support(plan, training: bool = False) -> list[tuple[str, str, bool, str | None]]:
    """``[(part, kernel, ok, reason)]`` for every row of a mixer's ``PLAN``: the first kernel that
    can run the part (or the last one tried, with every kernel's reason); ``training``: its backward too."""
    rows = []
    extra = (requirements.BACKWARD,) if training else ()
    for part, choices in plan:
        reasons = []
        for kernel, features in choices:
            ok, reason = dispatch.cached_support(kernel, tuple(features) + extra)
            if ok:
                rows.append((part, kernel, True, None))
                break
            reasons.append(reason)
        else:
            rows.append((part, choices[0][0], False, "; and ".join(reasons)))
    return rows


# ----------------------------------------------------------------- the checks the configs run


def positive(name: str, value) -> None:
    """``value`` must be an int >= 1 (``ValueError`` / ``TypeError`` naming ``name``)."""
    check_int(name, value, minimum=1)


def divides(a_name: str, a: int, b_name: str, b: int) -> None:
    """``a`` must divide ``b``, or a ``ValueError`` names both."""
    if b % a:
        raise ValueError(f"{a_name}={a} must divide {b_name}={b}")


def default_heads(hidden_size: int, head_dim: int, share: float) -> int:
    """Heads of ``head_dim`` covering ``share`` of ``hidden_size`` (at least one)."""
    return max(1, int(hidden_size * share) // head_dim)


class MixerBase(nn.Module):
    """Base of our mixers: ``self.config`` and ``self.backend`` set, the kernels checked.

    Subclasses set ``CONFIG`` (their config class) and ``PLAN``, and build their modules after
    ``super().__init__``.
    """

    CONFIG: type | None = None
    PLAN: tuple = ()

    def __init__(self, config_cls, hidden_size, config, backend: str, overrides: dict):
        super().__init__()
        name = type(self).__name__
        if config is None:
            config = config_cls(hidden_size=hidden_size, **overrides)
        elif not isinstance(config, config_cls):
            raise TypeError(f"{name}: config must be a {config_cls.__name__}, got {type(config).__name__}")
        elif hidden_size is not None or overrides:
            given = ["hidden_size"] * (hidden_size is not None) + sorted(overrides)
            raise ValueError(f"{name}: config is given, so {', '.join(given)} would be ignored; "
                             f"set them in the config (dataclasses.replace(config, ...)) instead")
        if backend not in dispatch.BACKENDS:
            raise ValueError(f"{name}: backend must be one of {dispatch.BACKENDS}, got {backend!r}")
        if backend == "kernel":
            for part, kernel, ok, reason in plan_support(self.PLAN):
                if not ok:
                    raise RuntimeError(f"{name}(backend='kernel'): its {part} cannot run on {kernel}: {reason}")
        self.config, self.backend = config, backend

    def varlen(self, hidden_states: torch.Tensor, packed_seq_params) -> VarlenBatch | None:
        """Check ``hidden_states [B, T, D]`` and resolve the packing metadata (``None``: unpacked rows)."""
        name = type(self).__name__
        if not isinstance(hidden_states, torch.Tensor) or hidden_states.dim() != 3:
            shape = tuple(hidden_states.shape) if isinstance(hidden_states, torch.Tensor) else type(hidden_states)
            raise ValueError(f"{name}: hidden_states must be [B, T, D], got {shape}")
        if packed_seq_params is None:
            return None
        batch, length, _ = hidden_states.shape
        if batch != 1:
            raise ValueError(f"{name}: packed input must be one row [1, T, D] (fla / THD convention), got B={batch}; "
                             "pack the batch with ssm_pack.pack_padded or pass packed_seq_params=None")
        try:
            varlen = VarlenBatch.build(packed_seq_params, length, device=hidden_states.device)
        except (TypeError, ValueError) as err:
            raise type(err)(f"{name}: {err}") from None
        self._warn_reference_once(hidden_states)
        return varlen

    def _warn_reference_once(self, hidden_states) -> None:
        """In ``auto`` on CUDA, say once per mixer type and kernel when packed input runs the reference."""
        if self.backend != "auto" or not dispatch.is_cuda(hidden_states):
            return
        name = type(self).__name__
        for part, kernel, ok, reason in plan_support(self.PLAN):
            if not ok and (name, kernel) not in _WARNED:
                _WARNED.add((name, kernel))
                warnings.warn(f"{name}: its packed {part} runs ssm-pack's reference instead of the {kernel} kernel: "
                              f"{reason}", RuntimeWarning, stacklevel=3)
