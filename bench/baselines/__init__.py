"""The bare loops the benchmarks measure `python -m train` against: one a model (gpt.py, resnet.py)."""
