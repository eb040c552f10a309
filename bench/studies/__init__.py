"""Measurements run by hand for one question each, cited with their command from docs/ or docs/dev/ (dated results:
docs/dev/benchmark-studies.md). Not run by `make bench`; their smoke runs in tests/test_bench.py where they have one."""
