"""python -m train.report RUN_DIR: a run's report (report.md's text and report.png) from its files; the code
is train/observe/report.py, which every run also calls at its end."""

import sys

from train.observe.report import main

if __name__ == "__main__":
    sys.exit(main())
