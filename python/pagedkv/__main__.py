"""Command line: ``python -m pagedkv demo`` and ``python -m pagedkv bench <name> [--json]``.

Wiring only: each subcommand lives in its own module exposing ``add_arguments(parser)`` and
``run(args) -> int``.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import Sequence

# subcommand name -> module implementing it
COMMANDS = {"demo": "pagedkv.demo"}
BENCHES = {
    "blocks": "pagedkv.bench.blocks",
    "attention": "pagedkv.bench.attention",
    "scheduler": "pagedkv.bench.scheduler",
    "serve": "pagedkv.bench.serve",
}


def _add(subparsers: argparse._SubParsersAction, name: str, module_name: str) -> None:
    module = importlib.import_module(module_name)
    parser = subparsers.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
    module.add_arguments(parser)
    parser.set_defaults(run=module.run)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="Paged KV cache and continuous batching.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        _add(commands, name, module_name)
    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        _add(benches, name, module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return int(args.run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
