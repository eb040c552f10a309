"""Checkpoints: when to save, how the files are written and checked, which one a run resumes from, and
converting those of earlier releases. `python -m train.checkpoint --convert RUN_DIR` converts."""
