"""Observing a run: its logs and W&B (log.py), step times, throughput and MFU (metrics.py), and the report
written at its end (report_writer.py, also `python -m train.report RUN_DIR`)."""
