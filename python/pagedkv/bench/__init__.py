"""Benchmark drivers: ``python -m pagedkv bench <name>``.

:data:`BENCHES` names each one's module (``add_arguments(parser)``, ``run(args) -> int``); ``all``
runs the others in this order.
"""

BENCHES = {
    "blocks": "pagedkv.bench.blocks",
    "attention": "pagedkv.bench.attention",
    "linear": "pagedkv.bench.linear",
    "scheduler": "pagedkv.bench.scheduler",
    "serve": "pagedkv.bench.serve",
    "model": "pagedkv.bench.model",
    "sampling": "pagedkv.bench.sampling",
    "http": "pagedkv.bench.http",
    "tiers": "pagedkv.bench.tiers",
    "cluster": "pagedkv.bench.cluster",
    "all": "pagedkv.bench.all",
}
