"""A dispatch-mode recorder for tests that check what an op allocates."""

import torch
from torch.utils._python_dispatch import TorchDispatchMode


class OutputShapes(TorchDispatchMode):
    """Records the shape of every tensor an op returns, in ``seen`` (a set of tuples)."""

    def __enter__(self):
        self.seen = set()
        return super().__enter__()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, (tuple, list)) else (out,):
            if isinstance(t, torch.Tensor):
                self.seen.add(tuple(t.shape))
        return out
