"""The numbers that define "correct", held by the tests themselves.

The product has its own table (``ssm_pack.testing.TOLERANCES``, what the public helpers use);
the tests never read it, so loosening the product cannot loosen a test, and
``tests/ssm_pack/test_tolerances.py`` fails if the product's table is looser than this one.

dtype -> (forward, gradient): fp64 is the max abs error, the others the relative RMS error.
"""

from __future__ import annotations

import torch

TOLERANCES = {
    torch.float64: (1e-10, 1e-10),
    torch.float32: (1e-5, 1e-5),
    torch.bfloat16: (5e-3, 1e-2),
    torch.float16: (5e-3, 1e-2),
}

FP64_ABS = TOLERANCES[torch.float64][0]
FP32_REL = TOLERANCES[torch.float32][0]
BF16_FWD_REL, BF16_GRAD_REL = TOLERANCES[torch.bfloat16]
