"""Launching: `python -m train.launch` (one node's torchrun, supervised), its rendezvous checks and its exit
code. `python -m train.doctor` and `python -m train.submit` (SLURM from Python) build on it."""
