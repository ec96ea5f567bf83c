"""Benchmark drivers: ``python -m lab bench <name>``.

:data:`BENCHES` names each one's module (``add_arguments(parser)``, ``run(args) -> int``); ``all``
runs the others in this order.
"""

BENCHES = {
    "blocks": "lab.bench.blocks",
    "attention": "lab.bench.attention",
    "linear": "lab.bench.linear",
    "scheduler": "lab.bench.scheduler",
    "serve": "lab.bench.serve",
    "model": "lab.bench.model",
    "sampling": "lab.bench.sampling",
    "grammar": "lab.bench.grammar",
    "http": "lab.bench.http",
    "tiers": "lab.bench.tiers",
    "kv-groups": "lab.bench.kv_groups",
    "cluster": "lab.bench.cluster",
    "all": "lab.bench.all",
}
