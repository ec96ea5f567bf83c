"""Serving experiments: workloads from request traces, the replay driver, the max-length
reservation baselines, summaries and plots behind ``python -m lab bench serve``."""
