"""The child of the crash test (tests/tier/test_disk_tier_crash.py): ``python tier_crash_child.py DIR SEED``.

It reopens the disk tier in DIR (after the previous child was SIGKILLed), serves the fixed prompts
and prints one JSON line: what opening the tier reported, their greedy tokens and the engine's
stats. Then it serves random traffic (system prompts shared, a RAM pool far too small, so blocks
are offloaded, evicted from disk and loaded back all the time) until it is killed, printing after
every step one JSON line with the tier's jobs in flight (offloads and loads queued or under way,
the former being copied out, written and committed), so the parent knows whether its kill landed
while the tier was writing.
"""

from __future__ import annotations

import json
import random
import sys
from pathlib import Path

from pagedkv.sampling import SamplingParams
from support.tier_workload import FIXED, GREEDY, greedy, random_prompt, tiny_core, tiny_model


def main() -> None:
    directory, seed = Path(sys.argv[1]), int(sys.argv[2])
    model, identity = tiny_model()
    core = tiny_core(model, identity, directory, num_blocks=24, capacity_blocks=40)
    tokens = greedy(core, FIXED)
    print(json.dumps({"opened": core.disk_tier, "fixed": tokens, "stats": core.stats()}), flush=True)
    rng = random.Random(seed)
    for n in range(10**9):
        while core.scheduler.num_unfinished_requests < 3:
            params = SamplingParams(max_tokens=rng.randrange(1, 5), **GREEDY)
            core.add_request(f"r{n}-{core.scheduler.num_unfinished_requests}", random_prompt(rng), params)
        core.step()
        stats = core.stats()
        print(json.dumps({"inflight": stats["disk_jobs_in_flight"]}), flush=True)


if __name__ == "__main__":
    main()
