"""The template's benchmarks, run as `python -m bench ...` from the repository's root (bench/__main__.py).

- suite/: the user's benchmarks, what `make bench` runs (`python -m bench all`); each one also alone,
  `python -m bench.suite.overhead` etc. report.py writes BENCHMARKS.md from their figures.
- baselines/: the bare loops they compare `python -m train` with, one a model: gpt.py (nanoGPT's loop) and
  resnet.py (the PyTorch tutorial's DDP loop, or the template's same math with --same-math).
- check/: the acceptance check of a GPU machine, `make gpu-check` (`python -m bench gpu-check`): not a benchmark.
- studies/: measurements run by hand, each cited with its command from docs/ or docs/dev/.
- common.py: what they share (the project's entry points run as processes, a run's figures read back).
"""
