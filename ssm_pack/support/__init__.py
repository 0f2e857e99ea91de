"""What runs here: installed packages, the kernel requirements table, the support report.

* :mod:`.installed`: package versions, CUDA extensions, the device, the interpreter switch;
* :mod:`.requirements`: the kernel requirements table and the ``check_*_support`` functions;
* :mod:`.report`: the report ``python -m ssm_pack`` prints.
"""

from .installed import triton_interpreter
from .requirements import (
    check_causal_conv1d_support,
    check_fla_conv_support,
    check_fla_sequence_packing_support,
    check_flash_attn_support,
    check_mamba_sequence_packing_support,
    check_mamba_ssd_support,
)

__all__ = ["check_causal_conv1d_support", "check_fla_conv_support", "check_fla_sequence_packing_support",
           "check_flash_attn_support", "check_mamba_sequence_packing_support", "check_mamba_ssd_support",
           "triton_interpreter"]
