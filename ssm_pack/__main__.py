"""``python -m ssm_pack``: print the support report (``ssm-pack report`` adds the per-mixer rows)."""

from .report import support_report

print(support_report())
