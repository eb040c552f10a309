"""python -m train.export RUN_DIR [--step N] [--format pt|hf] [--dtype D] [--out PATH]: a checkpoint's model.

--format pt (the default): one plain file, the model's state dict (parameter and buffer names -> tensors)
written by torch.save, that any process loads with torch.load(FILE, weights_only=True), without this
package, e.g. into the task's model with load_state_dict. Default: RUN_DIR/export/step_XXXXXXXX.pt.
--format hf: a Hugging Face model folder (config.json, safetensors, and the tokenizer of the folder the run
started from, if any) that transformers' AutoModelForCausalLM.from_pretrained loads, and so vLLM,
lm-eval-harness and the Hub; for tasks that say how (Task.hf_model: the built-in GPT as GPT2LMHeadModel, the
Hugging Face task as its own architecture). Default: RUN_DIR/export/step_XXXXXXXX-hf/.
--dtype: the tensors' type in the files (default: as trained, fp32).

The checkpoint (the latest, or that of step N) is checked (its files' CRC-32s) and read by DCP in this one
process, whatever the number of ranks that saved it: it needs the model's size in host memory. A bad
RUN_DIR, no checkpoint or no checkpoint of step N, a task without a Hugging Face form: one line, exit 2.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

from train import config
from train.checkpoint.dcp_io import read_state
from train.checkpoint.storage import complete_checkpoints, convert_hint, old_checkpoints, write_atomic
from train.config import OneLineParser, UsageError
from train.errors import ConfigError

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def parse(argv: list[str] | None) -> argparse.Namespace:
    p = OneLineParser(prog="python -m train.export", description=__doc__.splitlines()[0].split(": ", 1)[1])
    p.add_argument("run_dir", metavar="RUN_DIR", help="a run directory (or its checkpoints/ folder)")
    p.add_argument("--step", type=int, help="the checkpoint of this step (default: the latest)")
    p.add_argument("--format", choices=("pt", "hf"), default="pt",
                   help="pt: one torch.save file; hf: a Hugging Face model folder")
    p.add_argument("--dtype", choices=sorted(DTYPES), help="the tensors' type (default: as trained)")
    p.add_argument("--out", metavar="PATH", help="where to write (default: RUN_DIR/export/step_XXXXXXXX.pt, or "
                                                 "step_XXXXXXXX-hf/ for --format hf)")
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


def hf_form(state: dict, path: Path):
    """The task's Hugging Face form of its model (Task.hf_model), from the config the checkpoint was trained
    with; UsageError where the task has none."""
    try:
        cfg = config.from_dict(state["config"])
        task = cfg.task_class(cfg.task, cfg.seed)
        model = task.model()
        hf = task.hf_model(model)
    except ConfigError as e:
        raise UsageError(f"checkpoint {path}: its task does not build here ({e})") from None
    if hf is None:
        raise UsageError(f"checkpoint {path}: task {cfg.task_name} has no Hugging Face form (its hf_model() returns "
                         f"None): export it with --format pt")
    return hf


def main(argv: list[str] | None = None) -> int:
    try:
        args = parse(argv)
        run_dir = Path(args.run_dir)
        path = find(run_dir, args.step)
        try:
            state = read_state(path, keys=("model",))
        except ValueError as e:
            raise UsageError(f"checkpoint {path} {e}") from None
        hf = hf_form(state, path) if args.format == "hf" else None
    except UsageError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    weights, dtype = state["model"], DTYPES.get(args.dtype)
    if hf is not None:
        from train.checkpoint.pretrained import save_hf

        out = Path(args.out) if args.out else run_dir / "export" / f"{path.name}-hf"
        size = save_hf(weights, hf, out, dtype)
        print(f"wrote {out}: a Hugging Face {hf.config.get('architectures', ['model'])[0]}, {size / 2**20:.1f} MiB, "
              f"the model of {path} (step {state['step']}); load it with "
              f"transformers.AutoModelForCausalLM.from_pretrained({str(out)!r})")
        return 0
    out = Path(args.out) if args.out else run_dir / "export" / f"{path.name}.pt"
    out.parent.mkdir(parents=True, exist_ok=True)
    if dtype is not None:
        weights = {k: v.to(dtype) if v.is_floating_point() else v for k, v in weights.items()}
    write_atomic(out, lambda f: torch.save(weights, f))
    size = sum(t.numel() * t.element_size() for t in weights.values())
    print(f"wrote {out}: {len(weights)} tensors, {size / 2**20:.1f} MiB, the model of {path} (step {state['step']}); "
          f"load it with torch.load({out.name!r}, weights_only=True)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
