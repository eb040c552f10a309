"""`python -m train.report RUN_DIR`: a run's curves in one PNG and a few lines of text.

Writes RUN_DIR/report.png and RUN_DIR/report.txt from the run's files (train/observe/report_writer.py, which
every run also calls at its end) and prints the text; works on a finished run, one still training or one that
was stopped. A directory without metrics is one line and exit code 2.
"""

import argparse
import sys
from pathlib import Path

from train.errors import EXIT_USAGE
from train.observe.report_writer import ReportError, write


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m train.report", description=__doc__.splitlines()[0])
    p.add_argument("run_dir", metavar="RUN_DIR", type=Path, help="a run directory (runs/<name>)")
    args = p.parse_args(argv)
    try:
        png, report = write(args.run_dir)
    except ReportError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_USAGE
    print(report + f"wrote {png} and {png.with_suffix('.txt')}", end="\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
