"""What a local Ray instance leaves when its driver is killed outright, removed:
``python -m pagedkv.cluster.ray_watchdog PID TEMP_DIR``, its stdin a pipe from process ``PID``
(:func:`pagedkv.cluster.ray_runtime.connect` starts it, in a session of its own).

``ray.shutdown`` stops the processes of a local instance when the driver leaves normally or on
SIGTERM. After a SIGKILL (the OOM killer's) nothing runs it: the GCS and the raylet notice their
driver gone and exit, but their agents (``ray::RuntimeEnvAgent``, ``ray::DashboardAgent``) were
still running 20 s later, and the temporary directory stayed (issue 23).

Invariants:

- While the pipe is open, the watchdog records every descendant of ``PID`` as (pid, start time),
  each :data:`SCAN_SECONDS`; once the process dies they are orphans, no longer found through it.
- When the pipe closes (the process ended, however), it kills what it recorded that still runs
  with the same start time (a pid the system gave to another process since is never touched),
  with every descendant of those, then removes ``TEMP_DIR``. After a normal exit there is nothing
  left to kill and the directory is already gone.
"""

from __future__ import annotations

import os
import select
import shutil
import signal
import sys
from collections.abc import Iterable, Sequence

__all__ = ["SCAN_SECONDS", "descendants", "main", "process_table"]

# A process Ray starts between two scans and outlives its driver would escape; Ray starts its
# processes within the instance's first seconds and its workers at each actor's start, so a
# scan a second finds them long before a kill could orphan them.
SCAN_SECONDS = 1.0


def main(argv: Sequence[str]) -> int:
    watched, temp_dir = int(argv[0]), argv[1]
    known: dict[int, int] = {}  # pid -> start time, of every descendant seen
    while not select.select([sys.stdin], [], [], SCAN_SECONDS)[0]:
        table = process_table()
        known.update(descendants(table, [watched]))
    while os.read(sys.stdin.fileno(), 4096):  # readable: data (none is sent) or end of file
        pass
    table = process_table()
    survivors = [pid for pid, started in known.items() if pid in table and table[pid][1] == started]
    for pid in descendants(table, survivors).keys() | set(survivors):
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    shutil.rmtree(temp_dir, ignore_errors=True)
    return 0


def process_table() -> dict[int, tuple[int, int]]:
    """pid -> (parent pid, start time in clock ticks since boot), from /proc."""
    table: dict[int, tuple[int, int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat", "rb") as stat:
                fields = stat.read().rsplit(b")", 1)[1].split()  # after the command, which may hold spaces
        except OSError:
            continue  # it ended meanwhile
        table[int(entry)] = (int(fields[1]), int(fields[19]))
    return table


def descendants(table: dict[int, tuple[int, int]], roots: Iterable[int]) -> dict[int, int]:
    """pid -> start time of every process below ``roots`` in ``table``."""
    children: dict[int, list[int]] = {}
    for pid, (parent, _) in table.items():
        children.setdefault(parent, []).append(pid)
    found: dict[int, int] = {}
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found and child != os.getpid():
                found[child] = table[child][1]
                stack.append(child)
    return found


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
