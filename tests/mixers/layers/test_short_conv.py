"""``ShortConvolution.forward_parts``: the parts of a channel-wise concatenation, convolved apart,
equal the convolution of the whole (output and every gradient), packed documents included."""

import pytest
import torch

from mixers.layers.blocks.short_conv import ShortConvolution
from ssm_pack import PackedSeqParams, VarlenBatch
from tests.support.oracles import check_close

WIDTHS = [10, 3, 3]


@pytest.mark.parametrize("lengths", [pytest.param([0, 15, 100, 3], id="packed-0-15-100-3"),
                                     pytest.param(None, id="rows")])
@pytest.mark.parametrize("bias", [True, False], ids=["bias", "no-bias"])
def test_parts_equal_the_whole(lengths, bias):
    torch.manual_seed(0)
    conv = ShortConvolution(sum(WIDTHS), 4, bias=bias, backend="reference").double()
    shape = (1, sum(lengths)) if lengths else (2, 37)
    varlen = VarlenBatch.build(PackedSeqParams.from_lengths(lengths), shape[1]) if lengths else None
    parts = [torch.randn(*shape, w, dtype=torch.float64, requires_grad=True) for w in WIDTHS]
    g_out = torch.randn(*shape, sum(WIDTHS), dtype=torch.float64)
    got = torch.cat(conv.forward_parts(parts, varlen), -1)
    want = conv(torch.cat(parts, -1), varlen)
    check_close(got, want, torch.float64, what="out")
    params = list(conv.parameters())
    g_got = torch.autograd.grad(got, parts + params, g_out)
    g_want = torch.autograd.grad(want, parts + params, g_out)
    for i, (a, b) in enumerate(zip(g_got, g_want)):
        check_close(a, b, torch.float64, grad=True, what=f"grad {i}")


def test_parts_must_cover_the_channels():
    conv = ShortConvolution(8, 4)
    with pytest.raises(ValueError, match=r"parts' channels \[4, 3\] must add up to the convolution's 8"):
        conv.forward_parts([torch.zeros(1, 5, 4), torch.zeros(1, 5, 3)])
