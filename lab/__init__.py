"""The lab: pagedkv's benchmarks (:mod:`lab.bench`) and its serving simulator and baselines
(:mod:`lab.serving`). Run from a checkout (``python -m lab bench <name>``); not part of the
installed package, which they import as any user would.
"""
