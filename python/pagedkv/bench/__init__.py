"""Benchmark drivers: ``python -m pagedkv bench <name>``."""
