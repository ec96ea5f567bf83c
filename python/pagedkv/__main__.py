"""Command line: ``python -m pagedkv demo`` and ``python -m pagedkv serve`` (benchmarks run from a
checkout: ``python -m lab bench <name>``).

Wiring only: each subcommand lives in its own module; :func:`pagedkv.cli.add_command` and
:func:`pagedkv.cli.run_command` say how it is called and how its errors exit.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from pagedkv.cli import add_command, run_command

# subcommand name -> module implementing it
COMMANDS = {"demo": "pagedkv.demo", "serve": "pagedkv.server.launch"}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagedkv", description="Paged KV cache and continuous batching.")
    commands = parser.add_subparsers(dest="command", required=True)
    for name, module_name in COMMANDS.items():
        add_command(commands, name, module_name)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    return run_command(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
