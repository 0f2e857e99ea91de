"""Writing an op's result into a given buffer (mixers.ops.common.inplace.into), called directly: in eager
mode through the op's ``out=``, while ``torch.compile`` traces (faked by patching
``torch.compiler.is_compiling``) by computing and copying, so the op never sees ``out=``."""

import pytest
import torch

from mixers.ops.common.inplace import into


class Recorder:
    """``torch.mul`` that records whether it was given ``out=``."""

    def __init__(self):
        self.outs = []

    def __call__(self, a, b, **kwargs):
        self.outs.append("out" in kwargs)
        return torch.mul(a, b, **kwargs)


@pytest.mark.parametrize("compiling, passes_out", [pytest.param(False, True, id="eager-writes-through-out"),
                                                   pytest.param(True, False, id="compiling-copies")])
def test_into_writes_the_result_into_a_strided_block(monkeypatch, compiling, passes_out):
    monkeypatch.setattr(torch.compiler, "is_compiling", lambda: compiling)
    a = torch.arange(6, dtype=torch.float64).reshape(2, 3)
    b = torch.full((2, 3), 2.0, dtype=torch.float64)
    whole = torch.full((2, 6), -1.0, dtype=torch.float64)
    block = whole[:, 1:4]                                   # a strided (non-contiguous) block of a larger output
    op = Recorder()
    got = into(block, op, a, b)
    assert op.outs == [passes_out]
    assert got.data_ptr() == block.data_ptr() and got.stride() == block.stride()
    want = torch.tensor([[-1.0, 0.0, 2.0, 4.0, -1.0, -1.0], [-1.0, 6.0, 8.0, 10.0, -1.0, -1.0]],
                        dtype=torch.float64)
    assert torch.equal(whole, want)                         # only the block written, the rest untouched
