"""`torchrec-tpu` command line: one entry point, one subcommand per job.

Each subcommand lives in its own module exposing ``add_arguments(parser)`` and ``run(args) -> int``;
modules keep heavy imports (torch, jax, ray) inside ``run`` so ``--help`` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# subcommand -> (module, one-line help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "train": ("torchrec_tpu.train.cli", "train DLRM end to end (default: embedded synthetic data)"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="torchrec-tpu",
        description="Recommendation models on Cloud TPU: train, plan, infer, profile.",
    )
    subparsers = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        module = importlib.import_module(module_name)
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        module.add_arguments(sub)
        sub.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args._run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
