"""Command line of the lab: ``python -m lab bench <name> [--json]`` (the benchmarks:
:data:`lab.bench.BENCHES`), wired as ``python -m pagedkv``'s subcommands are (:mod:`pagedkv.cli`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from lab.bench import BENCHES
from pagedkv.cli import add_command, run_command


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="lab", description="pagedkv's benchmarks, run from a checkout.")
    commands = parser.add_subparsers(dest="command", required=True)
    bench = commands.add_parser("bench", help="benchmarks")
    benches = bench.add_subparsers(dest="bench", required=True)
    for name, module_name in BENCHES.items():
        add_command(benches, name, module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
