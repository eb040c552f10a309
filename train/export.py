"""python -m train.export RUN_DIR [--step N] [--out FILE]: a checkpoint's model weights in one plain file.

FILE is the model's state dict (parameter and buffer names -> tensors) written by torch.save: any process
loads it with torch.load(FILE, weights_only=True), without this package, e.g. into the task's model with
load_state_dict. The checkpoint (the latest, or that of step N) is checked (its files' CRC-32s) and read by
DCP in this one process, whatever the number of ranks that saved it. Default FILE:
RUN_DIR/export/step_XXXXXXXX.pt. A bad RUN_DIR, no checkpoint or no checkpoint of step N: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from train.checkpoint.dcp_io import read_state
from train.checkpoint.storage import complete_checkpoints, convert_hint, old_checkpoints, write_atomic
from train.config import OneLineParser, UsageError


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m train.export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoints/ folder)")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    p.add_argument("--out", metavar="FILE", help="where to write (default: RUN_DIR/export/step_XXXXXXXX.pt)")
    return p.parse_args(argv)


def find(run_dir: Path, step: int | None) -> Path:
    """The checkpoint folder to export."""
    if not run_dir.is_dir():
        raise UsageError(f"{run_dir} is not a folder (give a run directory)")
    folder = run_dir / "checkpoints" if (run_dir / "checkpoints").is_dir() else run_dir
    found = complete_checkpoints(folder)
    if not found:
        if old := old_checkpoints(folder):
            raise UsageError(f"{old[0]} is a checkpoint of an earlier version of this project: {convert_hint(folder)}")
        raise UsageError(f"{run_dir} holds no complete checkpoint")
    if step is None:
        return found[0]
    for path in found:
        if path.name == f"step_{step:08d}":
            return path
    steps = ", ".join(str(int(p.name[5:])) for p in reversed(found))
    raise UsageError(f"{run_dir} holds no complete checkpoint of step {step} (it has steps {steps})")


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        run_dir = Path(args.run_dir)
        path = find(run_dir, args.step)
        try:
            state = read_state(path, keys=("model",))
        except ValueError as e:
            raise UsageError(f"checkpoint {path} {e}") from None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    out = Path(args.out) if args.out else run_dir / "export" / f"{path.name}.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    weights = state["model"]
    write_atomic(out, lambda f: torch.save(weights, f))
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"wrote {out}: {len(weights)} tensors, {size / 2**20:.1f} MiB, the model of {path} (step {state['step']}); "
          f"load it with torch.load({out.name!r}, weights_only=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
