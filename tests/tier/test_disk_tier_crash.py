"""Crash safety of the disk tier: a child process serves traffic with the tier
(tests/tier/tier_crash_child.py) and is killed with SIGKILL at random points, half of them right after
it reported tier writes in flight (mid-write). After each kill the next child reopens the same
directory and must: open the index, serve the fixed prompts with the greedy tokens of a RAM-only
run (a corrupt block served would change them), and count every block it found on disk as either
loaded (verified) or dropped, never anything else. The kill count and how many landed mid-write
are printed (``pytest -s``)."""

from __future__ import annotations

import json
import os
import queue
import random
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from support.tier_workload import FIXED, greedy, tiny_core, tiny_model

KILLS = 20
CHILD = Path(__file__).with_name("tier_crash_child.py")
# The child imports tests/support as the tests do.
CHILD_ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(Path(__file__).parents[1]), os.environ.get("PYTHONPATH", "")])}
START_TIMEOUT = 60.0  # seconds for a child to reopen the tier and serve the fixed prompts


def _reader(stream, lines: queue.Queue) -> None:
    for line in stream:
        lines.put(line)
    lines.put(None)


def _next(lines: queue.Queue, timeout: float) -> dict | None:
    line = lines.get(timeout=timeout)
    return None if line is None else json.loads(line)


def test_sigkill_at_random_points_never_serves_a_corrupt_block(tmp_path: Path) -> None:
    model, identity = tiny_model()
    expected = greedy(tiny_core(model, identity, None, num_blocks=256), FIXED)
    directory = tmp_path / "tier"
    rng = random.Random(2026)
    kills = mid_write = restarts_with_disk_hits = 0
    for round_ in range(KILLS + 1):
        child = subprocess.Popen([sys.executable, str(CHILD), str(directory), str(round_)], stdout=subprocess.PIPE,
                                 stderr=subprocess.PIPE, text=True, env=CHILD_ENV)
        lines: queue.Queue = queue.Queue()
        threading.Thread(target=_reader, args=(child.stdout, lines), daemon=True).start()
        try:
            first = _next(lines, START_TIMEOUT)
            assert first is not None, f"restart {round_} failed: {child.stderr.read() if child.stderr else ''}"
            stats = first["stats"]
            assert isinstance(first["opened"], dict), first  # the index opened
            assert first["fixed"] == expected, f"restart {round_}: outputs changed"
            # Every block found on disk was loaded (verified) or dropped: nothing else was served.
            assert stats["disk_hits"] == stats["disk_loads"] + stats["disk_loads_dropped"], stats
            restarts_with_disk_hits += stats["disk_loads"] > 0
            if round_ == KILLS:
                break
            # Serve a while, then kill: at a random step, or (every other round) at the first step
            # after that which reports writes in flight.
            deadline = time.monotonic() + rng.uniform(0.02, 0.25)
            want_write = round_ % 2 == 1
            inflight = 0
            while True:
                report = _next(lines, START_TIMEOUT)
                assert report is not None, f"the child died: {child.stderr.read() if child.stderr else ''}"
                inflight = report["inflight"]
                if time.monotonic() >= deadline and (not want_write or inflight > 0):
                    break
            os.kill(child.pid, signal.SIGKILL)
            kills += 1
            mid_write += inflight > 0
        finally:
            child.kill()
            child.wait(timeout=30)
            for stream in (child.stdout, child.stderr):
                if stream is not None:
                    stream.close()
    print(f"\ncrash test: {kills} SIGKILLs, {mid_write} with tier jobs (writes or loads) in flight;"
          f" {restarts_with_disk_hits} of {KILLS + 1} restarts served blocks from disk")
    assert kills == KILLS and mid_write >= KILLS // 2
    assert restarts_with_disk_hits > 0
