"""The ``ssm-pack`` command: ``ssm-pack report`` (default) prints what runs packed here;
``ssm-pack demo`` trains a small hybrid model on packed documents (see ``mixers.demo``);
``ssm-pack train`` trains a hybrid on a corpus from a config (see ``mixers.training``);
``ssm-pack --version`` prints the version."""

from __future__ import annotations

import argparse
import sys


def _report(_args) -> int:
    from .report import full_report
    print(full_report())
    return 0


def version() -> str:
    """The installed distribution's version; the package's ``__version__`` when run from a source tree."""
    from importlib import metadata
    try:
        return metadata.version("ssm-pack")
    except metadata.PackageNotFoundError:
        from ssm_pack import __version__
        return __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ssm-pack", description="ssm-pack report (the default) prints what runs packed here; ssm-pack demo "
                                     "trains a small hybrid model on packed documents; ssm-pack train trains a "
                                     "hybrid on a corpus from a config.")
    parser.add_argument("--version", action="version", version=f"ssm-pack {version()}")
    sub = parser.add_subparsers(dest="command")
    report = sub.add_parser("report", help="print the support report (default)")
    report.set_defaults(run=_report)
    sub.add_parser("demo", help="train a small hybrid model on packed documents (ssm-pack demo --help)",
                   add_help=False)
    sub.add_parser("train", help="train a hybrid on a corpus: packing, FSDP2, context parallelism, checkpoints "
                                 "(ssm-pack train --help)", add_help=False)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] == "demo":                 # the demo owns its flags
        from .demo import main as demo_main
        return demo_main(argv[1:])
    if argv and argv[0] == "train":                # so does the training command
        from .training.train import main as train_main
        return train_main(argv[1:])
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
