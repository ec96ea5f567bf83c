"""Command line: ``python -m pagedkv demo``, ``python -m pagedkv serve`` and ``python -m pagedkv bench <name> [--json]``.

Wiring only: each subcommand lives in its own module (benchmarks: :data:`pagedkv.bench.BENCHES`)
exposing ``add_arguments(parser)``, its flags typed with :mod:`pagedkv.cli`, and ``run(args) ->
int``. A bad flag is a usage error, exit 2 with a message naming it: from argparse, or from the
library's ``InvalidArgumentError`` / ``CheckpointError`` (or ``OverflowError``, a number past what
the core takes) when a value only fails in context (one limit against another). Any other pagedkv
error (a failed engine), ``OSError`` (a port taken) or ``MemoryError`` exits 1 with its message.
Neither prints a traceback; anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from pagedkv.bench import BENCHES
from pagedkv.errors import CheckpointError, InvalidArgumentError, PagedKVError

# subcommand name -> module implementing it
COMMANDS = {"demo": "pagedkv.demo", "serve": "pagedkv.server.launch"}


def _add(subparsers: argparse._SubParsersAction, name: str, module_name: str) -> None:
    try:
        module = importlib.import_module(module_name)
    except ModuleNotFoundError as error:  # its optional extra (``serve``: pagedkv[server]) is not installed
        # No options (every argument is taken as ignored), so that any command line reaches the message.
        unavailable = subparsers.add_parser(name, help=f"unavailable: needs {error.name}", add_help=False, prefix_chars="\0")
        unavailable.add_argument("ignored", nargs=argparse.REMAINDER)
        unavailable.set_defaults(run=None, usage_parser=unavailable, missing=error)
        return
    parser = subparsers.add_parser(name, help=(module.__doc__ or "").strip().splitlines()[0])
    module.add_arguments(parser)
    parser.set_defaults(run=module.run, usage_parser=parser)


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
    parser: argparse.ArgumentParser = args.usage_parser
    if args.run is None:
        parser.exit(1, f"{parser.prog}: error: this command needs {args.missing.name}, which is not installed"
                       " (pip install 'pagedkv[server]')\n")
    try:
        return int(args.run(args) or 0)
    except (InvalidArgumentError, CheckpointError, OverflowError) as error:
        parser.error(_message(error))  # exits 2
    except (PagedKVError, OSError, MemoryError) as error:
        parser.exit(1, f"{parser.prog}: error: {type(error).__name__}: {_message(error)}\n")


def _message(error: BaseException) -> str:
    """The error's text with its notes (PyO3 notes which argument a conversion failed on)."""
    return " ".join([str(error), *getattr(error, "__notes__", [])])


if __name__ == "__main__":
    sys.exit(main())
