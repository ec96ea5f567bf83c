"""The Ray instance a cluster runs on: :func:`connect` joins an existing one (``ray start --head``
elsewhere, given its address) or starts a local one on loopback only.

Invariants:

- A local instance is a one-node cluster on 127.0.0.1: every Ray process is told that address
  (and its gRPC peers dial it). ``_node_ip_address="127.0.0.1"`` alone does not do it: on Linux
  Ray "resolves" a loopback node address to the machine's outward one unless its multi-node mode
  is off (``RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0``, read at import: so set here for the processes it
  starts, and on its constant for this one). It runs no dashboard, and keeps its files in a temporary directory of
  its own (short: Ray's socket paths must fit 107 bytes).
- Leaving :func:`connect` disconnects; for a local instance that also stops every process it
  started (``ray.shutdown`` stops those of the node this driver started, by their handles, never
  by name) and removes its directory. Joining stops nothing of the cluster's.
- A local instance outlives no driver, even one killed outright (SIGKILL skips ``ray.shutdown``):
  a watchdog process (:mod:`pagedkv.cluster.ray_watchdog`) holding a pipe from this one kills what
  is left of it and removes its directory when the pipe closes.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

import ray

__all__ = ["cluster_cpus", "connect"]


@contextlib.contextmanager
def connect(address: str | None = None, *, num_cpus: int | None = None) -> Iterator[float]:
    """Connects this process to Ray for the ``with`` block; yields the seconds it took (a local
    start on a loaded 2-core machine: 8-10 s). ``num_cpus`` sizes a local instance (None: the
    machine's)."""
    started = time.monotonic()
    if address is not None:
        ray.init(address=address, include_dashboard=False, log_to_driver=False, logging_level=logging.WARNING)
        try:
            yield time.monotonic() - started
        finally:
            ray.shutdown()
        return
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray._private.ray_constants.ENABLE_RAY_CLUSTER = False
    temp_dir = tempfile.mkdtemp(prefix="pkv-ray-", dir="/tmp")
    # Its own session: a signal to this process's group (Ctrl-C) leaves it to clean up after.
    watchdog = subprocess.Popen([sys.executable, "-m", "pagedkv.cluster.ray_watchdog", str(os.getpid()), temp_dir],
                                stdin=subprocess.PIPE, start_new_session=True)
    try:
        ray.init(_node_ip_address="127.0.0.1", include_dashboard=False, _temp_dir=temp_dir, num_cpus=num_cpus,
                 log_to_driver=False, logging_level=logging.WARNING)  # its INFO lines are not the server's
        try:
            yield time.monotonic() - started
        finally:
            ray.shutdown()
    finally:
        shutil.rmtree(temp_dir, ignore_errors=True)
        watchdog.stdin.close()  # type: ignore[union-attr]
        watchdog.wait()  # it finds nothing left: returns at once


def cluster_cpus() -> int:
    """The CPUs of the Ray cluster this process is connected to (every node's)."""
    return int(ray.cluster_resources().get("CPU", 0))
