"""Argument checks shared by every public function of ``ssm_pack`` and ``mixers``.

Each check raises ``TypeError`` (wrong kind of object or dtype) or ``ValueError`` (wrong shape
or value) with a message that names the argument, the value seen and the fix. ``assert`` is
kept for internal invariants only.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

_INT_DTYPES = (torch.int8, torch.int16, torch.int32, torch.int64, torch.uint8)


def describe(value) -> str:
    """Short description of ``value`` for an error message."""
    if isinstance(value, torch.Tensor):
        return f"tensor(dtype={value.dtype}, shape={tuple(value.shape)})"
    return f"{type(value).__name__} {value!r}"[:120]


def check_int(name: str, value, *, minimum: int | None = None, allow_none: bool = False):
    """``value`` must be a Python ``int`` (bools refused) no smaller than ``minimum``."""
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, int):
        if isinstance(value, torch.Tensor) and value.numel() == 1 and value.dtype in _INT_DTYPES:
            value = int(value)
        else:
            raise TypeError(f"{name} must be an int, got {describe(value)}")
    if minimum is not None and value < minimum:
        raise ValueError(f"{name} must be >= {minimum}, got {value}")
    return value


def check_tensor(name: str, value, *, ndim: int | tuple[int, ...] | None = None,
                 integer: bool = False) -> torch.Tensor:
    """``value`` must be a tensor with ``ndim`` dimensions (and an integer dtype if asked)."""
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {describe(value)}")
    dims = (ndim,) if isinstance(ndim, int) else ndim
    if dims is not None and value.dim() not in dims:
        want = " or ".join(f"{d}-D" for d in dims)
        raise ValueError(f"{name} must be {want}, got shape {tuple(value.shape)}")
    if integer and value.dtype not in _INT_DTYPES:
        raise TypeError(f"{name} must have an integer dtype (int32 or int64), got {value.dtype}; "
                        f"convert it with .to(torch.int32)")
    return value


def as_index_tensor(name: str, value, *, device=None) -> torch.Tensor:
    """Accept a 1-D integer tensor or a sequence of ints; return a 1-D integer tensor."""
    if isinstance(value, torch.Tensor):
        check_tensor(name, value, ndim=1, integer=True)
        return value if device is None else value.to(device)
    if isinstance(value, Sequence) and not isinstance(value, (str, bytes)):
        for v in value:
            if isinstance(v, bool) or not isinstance(v, int):
                raise TypeError(f"{name} must hold ints, got element {describe(v)}")
        return torch.tensor(list(value), dtype=torch.int64, device=device)
    raise TypeError(f"{name} must be a 1-D integer tensor or a list of ints, got {describe(value)}")


def check_lengths(name: str, lengths: torch.Tensor) -> None:
    """Lengths must be non-negative (a zero is an empty document)."""
    if lengths.numel() and bool((lengths < 0).any()):
        bad = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be >= 0, got {int(lengths[bad])} at index {bad}")


def check_boundaries(name: str, cu: torch.Tensor, *, values: bool = True) -> None:
    """``cu`` must be a 1-D integer tensor of offsets starting at 0 and non-decreasing.

    Any integer dtype is checked exactly: neighbours are compared, never subtracted, so unsigned
    offsets cannot wrap around and narrow offsets that overflowed show up as a decrease.
    ``values=False`` skips the checks that read the tensor's values (they synchronise with
    the device when ``cu`` lives on an accelerator).
    """
    check_tensor(name, cu, ndim=1, integer=True)
    if cu.numel() == 0:
        raise ValueError(f"{name} must hold at least one offset (the leading 0), got an empty tensor")
    if not values:
        return
    first = int(cu[0])
    if first != 0:
        raise ValueError(f"{name} must start at 0, got {first}")
    if cu.numel() > 1:
        decrease = cu[1:] < cu[:-1]              # a comparison: no difference that could wrap around
        if bool(decrease.any()):
            wide = cu.to(torch.int64)
            i = int(torch.nonzero(decrease)[0, 0])
            hint = (f" ({cu.dtype} holds at most {torch.iinfo(cu.dtype).max}: use int32)"
                    if cu.dtype in (torch.int8, torch.uint8, torch.int16) else "")
            raise ValueError(f"{name} must be non-decreasing, got {int(wide[i])} then {int(wide[i + 1])} "
                             f"at positions {i} and {i + 1}{hint}")


def is_numpy_array(value) -> bool:
    """A numpy array, recognised without importing numpy."""
    return type(value).__module__ == "numpy" and hasattr(value, "dtype") and hasattr(value, "shape")


def as_boundaries(name: str, value, *, device=None) -> torch.Tensor:
    """Offsets given as a tensor, a list / tuple of ints or a numpy array -> a 1-D integer tensor.

    Anything else is refused by name (a ``TypeError`` rather than an ``AttributeError`` later).
    The values are not checked here (see :func:`check_boundaries`).
    """
    if isinstance(value, torch.Tensor):
        return check_tensor(name, value, ndim=1, integer=True)
    if is_numpy_array(value):
        if value.dtype.kind not in "iu":
            raise TypeError(f"{name} must hold integers, got a numpy array of dtype {value.dtype}")
        return check_tensor(name, torch.as_tensor(value, device=device), ndim=1)
    return as_index_tensor(name, value, device=device)
