"""`python -m bench COMMAND ...`, from the repository's root:

    python -m bench all [--smoke] [--out BENCHMARKS.md] [--gpu-json FILE [--gpu-only]]   every benchmark (make bench)
    python -m bench gpu-check OUT_DIR [--smoke] [--budget-s 300] ...                     a GPU machine (make gpu-check)
    python -m bench NAME [ARGS ...]      one benchmark of bench/suite/ or study of bench/studies/ (NAME --help)
    python -m bench list                 their names
"""

from __future__ import annotations

import pkgutil
import runpy
import sys

from bench import studies, suite


def modules() -> dict[str, str]:
    """Each benchmark's and study's name -> its module."""
    return {m.name: f"{package.__name__}.{m.name}" for package in (suite, studies)
            for m in pkgutil.iter_modules(package.__path__) if not m.name.endswith("_fork")}


def main() -> int:
    if len(sys.argv) < 2 or sys.argv[1] in ("-h", "--help"):
        print(__doc__)
        return 0 if len(sys.argv) >= 2 else 2
    command, rest = sys.argv[1], sys.argv[2:]
    if command == "all":
        from bench import report

        sys.argv = ["python -m bench all", *rest]
        return report.main() or 0
    if command == "gpu-check":
        from bench.check import gpu

        sys.argv = ["python -m bench gpu-check", *rest]
        return gpu.main(rest)
    if command == "list":
        for name, module in modules().items():
            print(f"{name:16s} python -m {module}")
        return 0
    module = modules().get(command)
    if module is None:
        print(f"error: no benchmark or study {command!r} (python -m bench list)", file=sys.stderr)
        return 2
    sys.argv = [f"python -m {module}", *rest]
    runpy.run_module(module, run_name="__main__", alter_sys=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
