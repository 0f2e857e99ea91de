"""The ``ssm-pack`` command: ``ssm-pack report`` (default) prints what runs packed here."""

from __future__ import annotations

import argparse
import sys


def _report(_args) -> int:
    from .report import support_report
    print(support_report())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="ssm-pack", description=__doc__)
    sub = parser.add_subparsers(dest="command")
    report = sub.add_parser("report", help="print the support report (default)")
    report.set_defaults(run=_report)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    run = getattr(args, "run", _report)
    try:
        return run(args)
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
