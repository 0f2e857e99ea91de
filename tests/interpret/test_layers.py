"""Mixers built with ``backend="kernel"``: every op on its real upstream Triton kernel (short
convolutions on fla's conv, scans on mamba-ssm / fla), against the same mixer on the reference.

Interpreter lane: see ``shims.py``. The packed row has an empty document, per-document padding
(the physical layout) and a tail.
"""

import pytest
import torch

from ssm_pack.pytest_plugin import layout
from tests.interpret import shims
from tests.mixers.layers.test_layers import HIDDEN, LAYERS
from tests.support.oracles import check_close

pytestmark = shims.lane(("fla", "flash-linear-attention"), ("mamba_ssm", "mamba-ssm"), ("einops", "einops"))
# (layer, dtype, upstream calls of one forward): Gated DeltaProduct's kernel refuses fp32, and the
# interpreter cannot do bf16 arithmetic, so it runs in fp16. Mamba2 convolves x, B and C as three
# calls (ShortConvolution.forward_parts).
CASES = [
    pytest.param("mamba2", torch.float32, {"fla_conv": 3, "ssd": 1}, id="mamba2"),
    pytest.param("gdn", torch.float32, {"fla_conv": 3, "gdn": 1}, id="gdn-grouped-values"),
    pytest.param("kda", torch.float32, {"fla_conv": 3, "kda": 1}, id="kda"),
    pytest.param("gdp", torch.float16, {"fla_conv": 3, "gdp": 1}, id="gdp-fp16"),
    pytest.param("rg_lru", torch.float32, {"fla_conv": 1, "hgrn": 1}, id="rg_lru"),
]


@pytest.mark.parametrize("name,dtype,calls", CASES)
def test_kernel_layer_matches_reference_layer(upstream_calls, name, dtype, calls):
    torch.manual_seed(0)
    kernel = LAYERS[name](backend="kernel").to(dtype)       # construction checks every kernel is there
    reference = LAYERS[name](backend="reference").to(dtype)
    reference.load_state_dict(kernel.state_dict())
    x, params = layout([0, 13, 30, 6], hidden=HIDDEN, dtype=dtype, pad_to_multiple_of=8, tail=3)
    results = []
    for module in (kernel, reference):
        leaf = x.clone().requires_grad_()
        out = module(leaf, packed_seq_params=params)
        gen = torch.Generator().manual_seed(7)
        loss = (out.float() * torch.randn(out.shape, generator=gen)).sum()
        names = [n for n, p in module.named_parameters() if p.requires_grad]
        grads = torch.autograd.grad(loss, [leaf] + [dict(module.named_parameters())[n] for n in names])
        results.append((out, dict(zip(["input"] + names, grads))))
        if module is kernel:
            assert {k: v for k, v in upstream_calls.items() if v} == calls
    (out, grads), (ref_out, ref_grads) = results
    check_close(out.float(), ref_out.float(), dtype, what="output")
    for what, want in ref_grads.items():
        check_close(grads[what].float(), want.float(), dtype, grad=True, what=f"grad {what}")
