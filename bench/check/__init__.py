"""Acceptance checks: gpu.py, the prepared check of a GPU machine (`make gpu-check`)."""
