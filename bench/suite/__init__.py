"""The user's benchmarks: what `make bench` (`python -m bench all`) runs, each writing its figures for BENCHMARKS.md."""
