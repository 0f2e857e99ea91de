"""``python -m ssm_pack``: print the support report (``ssm-pack report`` adds the per-mixer rows);
``python -m ssm_pack --matrix`` prints the support matrix, the markdown table of
:mod:`ssm_pack.support.requirements` that the docs quote."""

from __future__ import annotations

import argparse


def support_matrix() -> str:
    """The kernel requirements table as markdown: one row per package a kernel needs (its own
    minimums) and one per feature packing relies on, each with its forward minimum (the first
    release with the call form ssm-pack uses), its backward minimum (the first whose gradients are
    right; "no backward" for a forward-only row) and the upstream change that decided them."""
    from .support.requirements import FEATURES, KERNELS

    rows = ["| kernel | package | forward | backward | needed for | why |", "|---|---|---|---|---|---|"]
    for kernel in KERNELS.values():
        for package, minimum in kernel.packages:
            rows.append(f"| `{kernel.name}` | `{package}` | {minimum} | {kernel.backward_minimum(package, minimum)} "
                        f"| {kernel.label} | {kernel.why} |")
        if not kernel.packages:
            rows.append(f"| `{kernel.name}` | `torch` | 2.10 | 2.10 | {kernel.label} | {kernel.why} |")
        for feature in (f for f in FEATURES.values() if f.kernel == kernel.name):
            backward = feature.backward_minimum or "no backward"
            rows.append(f"| `{kernel.name}` | `{feature.package}` | {feature.minimum} | {backward} | {feature.what} "
                        f"| {feature.why} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ssm_pack", description="print what runs packed here")
    parser.add_argument("--matrix", action="store_true", help="print the support matrix (markdown) instead")
    args = parser.parse_args(argv)
    if args.matrix:
        print(support_matrix(), end="")
        return 0
    from .support.report import support_report
    print(support_report())
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
