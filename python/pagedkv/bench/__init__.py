"""Benchmark drivers: ``python -m pagedkv bench <name>``.

:data:`BENCHES` names each one's module (``add_arguments(parser)``, ``run(args) -> int``); ``all``
runs the others in this order.
"""

BENCHES = {
    "blocks": "pagedkv.bench.blocks",
    "attention": "pagedkv.bench.attention",
    "scheduler": "pagedkv.bench.scheduler",
    "serve": "pagedkv.bench.serve",
    "sampling": "pagedkv.bench.sampling",
    "all": "pagedkv.bench.all",
}
