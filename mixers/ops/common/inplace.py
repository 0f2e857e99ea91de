"""Writing an op's result into a given buffer (a block of a larger output), also under ``torch.compile``."""

from __future__ import annotations

import torch


def into(out: torch.Tensor, op, *args, **kwargs) -> torch.Tensor:
    """``op(*args, **kwargs, out=out)``: written in place in eager mode; computed and copied while
    ``torch.compile`` traces (Dynamo refuses an ``out=`` that is not contiguous).

    Elementwise ops write a strided ``out`` at full speed; a matmul (``bmm``, ``baddbmm``) into a
    strided ``out`` runs one product per batch entry (slower): give those a contiguous one."""
    if torch.compiler.is_compiling():
        return out.copy_(op(*args, **kwargs))
    return op(*args, **kwargs, out=out)
