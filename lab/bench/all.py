"""Every benchmark in turn, each with its own defaults (``make bench``); stops at the first failure."""

from __future__ import annotations

import argparse
import importlib

from lab.bench import BENCHES


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--quick", action="store_true", help="pass --quick to the benchmarks that have it")


def run(args: argparse.Namespace) -> int:
    for name, module_name in BENCHES.items():
        if module_name == __name__:
            continue
        module = importlib.import_module(module_name)
        parser = argparse.ArgumentParser(prog=f"pagedkv bench {name}")
        module.add_arguments(parser)
        # A benchmark without --quick leaves it unknown: parse_known_args drops it.
        bench_args, _ = parser.parse_known_args(["--quick"] if args.quick else [])
        print(f"== pagedkv bench {name}", flush=True)
        status = int(module.run(bench_args) or 0)
        if status:
            return status
    return 0
