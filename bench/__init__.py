"""Benchmarks: each script writes bench/results/<name>.json; report.py renders them."""
