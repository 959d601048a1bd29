"""Benchmarks: each measures our code and its baselines side by side in one run and prints its
ratios as a final JSON line. Run them with `make bench` (they use the local services)."""
